"""Evidence plans on the zoo (issue 18): real architectures from their packages, each driven by
its own driver (tests/zoo_models.py), GPT-2 also through transformers' ``generate()`` with its
dynamic cache and with ``cache_implementation="static"``.

For every model: every module gets one fate (a region, inside one, or left out with a reason),
the evidence plan covers some of the step, and never less than the names-only plan of the same
run (both timed on the same bare step).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fates import assert_one_fate  # noqa: E402
from test_zoo import _PACKAGE, _needs  # noqa: E402
from zoo_models import CASES, gpt2, run_generate, run_generate_static  # noqa: E402

from surgery.formats.manifest import Manifest  # noqa: E402
from surgery.planning.observed import plan_from_step  # noqa: E402

DRIVERS = {name: case.run for name, case in CASES.items()}
DRIVERS["gpt2_generate"] = run_generate
DRIVERS["gpt2_generate_static"] = run_generate_static
FACTORIES = {name: case.build for name, case in CASES.items()}
FACTORIES["gpt2_generate"] = FACTORIES["gpt2_generate_static"] = gpt2
PACKAGE = {**_PACKAGE, "gpt2_generate": "transformers", "gpt2_generate_static": "transformers"}


@functools.cache
def _evidence_plan(name: str, **kw: Any) -> tuple[Any, Manifest]:
    torch.manual_seed(0)
    model = FACTORIES[name]().eval()
    run = DRIVERS[name]

    def step(m: Any) -> None:
        with torch.no_grad():
            run(m)

    return model, plan_from_step(model, step, steps=2, timed_steps=2, **kw)


def _params() -> list[Any]:
    return [pytest.param(n, id=n, marks=_needs(PACKAGE[n])) for n in DRIVERS]


@pytest.mark.parametrize("name", _params())
def test_every_module_of_every_zoo_model_gets_one_fate(name: str) -> None:
    model, manifest = _evidence_plan(name)
    assert manifest.regions, "an evidence plan with no region"
    assert_one_fate(model, manifest)


@pytest.mark.parametrize("name", _params())
def test_evidence_covers_at_least_the_names_only_plan_and_never_zero(name: str) -> None:
    _, manifest = _evidence_plan(name)
    cov = manifest.coverage
    assert cov is not None and cov["covered_share"] > 0
    assert cov["covered_share"] >= cov["names_covered_share"], cov


@pytest.mark.parametrize("name", [pytest.param("gpt2_generate_static", id="static",
                                               marks=_needs("transformers"))])
def test_generate_with_a_static_cache_plans_the_whole_decoder(name: str) -> None:
    """A static cache keeps one shape per phase (prefill, then one token a step): the whole
    transformer is one region, where the dynamic cache leaves each block out of a plain plan
    (its KV grows; by default those blocks are then piecewise, tests/test_evidence_cache.py)."""
    _, static = _evidence_plan(name)
    _, dynamic = _evidence_plan("gpt2_generate", piecewise=False)
    assert [p for r in static.regions for p in r.paths] == ["transformer"]
    left = {lo.path: lo.reason for lo in dynamic.left_out}
    assert "what ran inside changed" in left["transformer.h.0"]
    assert static.coverage["covered_share"] > dynamic.coverage["covered_share"]
