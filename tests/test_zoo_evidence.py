"""Evidence plans on the zoo (issue 18): real architectures from their packages, each driven by
its own driver (tests/zoo_models.py), GPT-2 also through transformers' ``generate()`` with its
dynamic cache and with ``cache_implementation="static"``.

Then the drivers users write, each on a package's model (below): `model.forward(x)`, a method, a
batch that varies, a loop under `inference_mode`, a denoising loop.

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
from surgery.planning.evidence import RECOMPILE_BUDGET  # noqa: E402
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


# --- the drivers users write, on real architectures ------------------------------------------
# tests/test_evidence_drivers.py proves each driver on a model of its own on a virtual clock;
# here each runs a package's model on the host clock: timm's ViT through `model.forward(x)`, a
# method (`forward_features`) and a batch that varies; HF BERT in a loop under
# `inference_mode`; diffusers' DiT in a denoising loop (timesteps from high to low).

def _vit_images(model: Any, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 32, 32, generator=g)


def _vit_forward(m: Any) -> None:
    with torch.no_grad():
        m.forward(_vit_images(m))


def _vit_method(m: Any) -> None:
    with torch.no_grad():
        m.forward_features(_vit_images(m))


def _vit_batches(m: Any) -> None:
    with torch.no_grad():
        for b in range(1, RECOMPILE_BUDGET + 3):
            m(_vit_images(m, b))


def _bert_inference_loop(m: Any) -> None:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for _ in range(2):
            m(input_ids=ids)


def _dit_denoising_loop(m: Any) -> None:
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(2, 4, 8, 8, generator=g)
    cls = torch.tensor([1, 4])
    with torch.inference_mode():
        for t in (900, 500, 100):
            lat = lat - 0.1 * m(lat, timestep=torch.tensor([t, t]), class_labels=cls,
                                return_dict=False)[0][:, :4]


REAL_DRIVERS = {
    "timm_vit model.forward(x)": ("timm_vit", _vit_forward),
    "timm_vit a method (forward_features)": ("timm_vit", _vit_method),
    "timm_vit a batch that varies": ("timm_vit", _vit_batches),
    "hf_bert a loop under inference_mode": ("hf_bert", _bert_inference_loop),
    "dit a denoising loop": ("dit", _dit_denoising_loop),
}
BLOCK = {"timm_vit": "blocks.1", "hf_bert": "encoder.layer.1", "dit": "transformer_blocks.1"}


@pytest.mark.parametrize("case", [pytest.param(k, id=k, marks=_needs(PACKAGE[v[0]]))
                                  for k, v in REAL_DRIVERS.items()])
def test_each_driver_plans_a_real_model_with_one_fate_each(case: str) -> None:
    name, step = REAL_DRIVERS[case]
    torch.manual_seed(0)
    model = FACTORIES[name]().eval()
    manifest = plan_from_step(model, step, steps=2, timed_steps=2)
    paths = [p for r in manifest.regions for p in r.paths]
    # the repeated blocks run compiled: a region, or inside one (a maximal fixed subtree)
    assert any(f"{BLOCK[name]}.".startswith(f"{p}.") for p in paths), paths
    cov = manifest.coverage
    assert cov is not None and cov["covered_share"] > 0 and cov["step_ms"] > 0
    assert cov["covered_share"] >= cov["names_covered_share"], cov
    assert_one_fate(model, manifest)
    # the grad-off state is one signature context, inference_mode or no_grad
    assert all(s.endswith("no_grad") for r in manifest.regions
               for s in r.evidence.get("signatures", []))
    if step is _vit_batches:  # batch 1..6: more sizes than the budget, so dynamic in the batch
        dyn = [r for r in manifest.regions if r.dynamic]
        assert dyn and all(0 in dims for r in dyn for dims in r.dynamic_dims.values()), \
            [(r.paths, r.dynamic_dims) for r in manifest.regions]


@pytest.mark.parametrize("planned, deployed", [
    pytest.param(_vit_forward, None, id="no_grad-then-inference_mode",
                 marks=_needs("timm")),
    pytest.param(_vit_batches, (3, 7, 9), id="varying-batch-then-unseen-sizes",
                 marks=_needs("timm")),
])
def test_a_timm_plan_deploys_as_planned_without_a_warning(planned: Any, deployed: Any) -> None:
    """As users deploy: planned under no_grad, run under inference_mode (one signature: no
    UnplannedSignatureWarning, one compile each); planned over a varying batch, run at batch
    sizes never watched (a dynamic region: every size in the batch dim is planned)."""
    import warnings

    from surgery import apply_manifest
    from surgery.runtime.signatures import UnplannedSignatureWarning

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = FACTORIES["timm_vit"]().eval()
    manifest = plan_from_step(model, planned, steps=2, timed_steps=0)
    handle = apply_manifest(model, manifest, overrides={"backend": "eager", "on_cpu": "compile"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnplannedSignatureWarning)
            with torch.inference_mode():
                for b in deployed or (2, 2, 2):
                    model(_vit_images(model, b))
        recs = [r for r in handle.report if r.status == "compiled"]
        assert recs, handle.report.summary()
        if deployed is None:
            assert all(r.signatures == 1 for r in recs), handle.report.summary()
        else:
            assert any(r.signature_mode == "dynamic" for r in recs), handle.report.summary()
    finally:
        handle.restore()
