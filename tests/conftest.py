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


def pytest_configure(config: pytest.Config) -> None:
    if _let_torchvision_import_on_cpu_torch():
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            "this venv's torchvision was built for another torch (the venv predates issue 21); "
            "the tests declared its ops so that timm imports, but outside pytest it does not: "
            "rebuild it with `make clean && make install` (tests/test_venv.py fails until then)"),
            stacklevel=2)


def _let_torchvision_import_on_cpu_torch() -> bool:
    """Let ``import torchvision`` (which timm needs) work beside the CPU build of torch.

    Transitional: a venv built by the Makefile since issue 21 has a torchvision that matches
    its torch, and this does nothing there (False). It stays for venvs made before, and says so
    (True), until they are rebuilt; then it goes away.

    PyPI's x86_64 torchvision wheel links against CUDA torch (libtorch_cuda.so), so beside the
    CPU torch 2.13.0 its C ops do not load, and its import then dies registering a fake kernel
    for ``torchvision::nms`` ("operator torchvision::nms does not exist"). Declaring the two
    schemas it registers unconditionally lets the pure-Python part import; the detection ops
    stay unavailable, and no model in the tests uses them. Where the C ops load (the GPU
    machine), nothing is done.
    """
    import contextlib
    import ctypes
    import importlib.util
    import os

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    import torch

    # Its extension is `_C.so` up to 0.28 and `_C_stable.so` from 0.29 on: if any of them loads,
    # torchvision registers the ops itself, and declaring them here would abort the process.
    folder = os.path.dirname(spec.origin)
    for name in sorted(os.listdir(folder)):
        if name.startswith("_C") and name.endswith(".so"):
            try:
                ctypes.CDLL(os.path.join(folder, name))
                return False
            except OSError:
                pass
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already declared
            torch.library.define(f"torchvision::{op}",
                                 "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True
