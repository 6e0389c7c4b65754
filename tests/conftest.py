"""Shared test set-up: `cuda`-marked tests skip cleanly on a machine without a GPU."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU; run on the GPU machine (benchmarks/RESULTS.md has the last run)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """Empty dynamo caches and counters before and after the test, so counts are its own."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
