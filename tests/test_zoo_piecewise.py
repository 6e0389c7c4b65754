"""The piecewise plan over the zoo (issue 19: "no new crash anywhere in the zoo").

``plan --piecewise`` (``plan_model(..., piecewise=True)``) on every zoo model: where the plan
leaves no streaming block out (timm ViT, HF ViT, BERT, DiT, Flux, SD3) it must be the plain plan,
region for region, which tests/test_zoo.py already applies against eager in every mode; where
it does (GPT-2 decoding on its cache, the SDPA example's streaming blocks and camera trunk), the
piecewise plan is applied and driven as users drive those models: GPT-2 through ``model(...)``
on a growing ``DynamicCache`` and through ``generate()``, the SDPA example frame by frame, under
``no_grad`` and ``inference_mode``, fp32 and bf16, autocast on and off. Each run compares every
output with eager's, checks that the piecewise regions really ran their compiled graph (their
own calls counted, dynamo's ``unique_graphs``), that whatever ran eager says why, and that the
state-dict keys did not change. On the CPU the regions compile with ``aot_eager``.
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
from test_zoo import TOLERANCE, _case_params, _mode, _rel_diff  # noqa: E402
from zoo_models import CASES, GENERATE_TOKENS, ZooCase, run_generate  # noqa: E402

from surgery import apply_manifest  # noqa: E402
from surgery.formats.manifest import PIECEWISE_KIND, Manifest  # noqa: E402
from surgery.planning.plan import plan_model  # noqa: E402

CPU_OVERRIDES = {"on_cpu": "compile", "backend": "aot_eager"}
STREAMING = ("gpt2", "example_sdpa")


@functools.cache
def _piecewise_plan(name: str, dtype: str = "fp32") -> Manifest:
    spec = CASES[name].spec if dtype == "fp32" else f"zoo_models:bf16.{name}"
    return plan_model(spec, piecewise=True).manifest


@pytest.mark.parametrize("case", _case_params([n for n in CASES if n not in STREAMING]))
def test_without_streaming_blocks_the_piecewise_plan_is_the_plain_plan(case: ZooCase) -> None:
    """Nothing streams, so nothing may change: the plain plan is what test_zoo applies."""
    result = plan_model(case.spec, piecewise=True)
    plain = plan_model(case.spec).manifest
    assert result.manifest.to_dict()["region"] == plain.to_dict()["region"]
    assert not [r for r in result.manifest.regions if r.kind == PIECEWISE_KIND]
    assert "nothing is piecewise" in result.notes[-1]  # said, not silently empty


def _run(case: ZooCase, run: Any, *, grad: str, autocast: bool, dtype: str) -> dict[str, Any]:
    """Eager outputs, then the piecewise plan applied and run again; what the report says."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = case.build().to(dtype=torch.bfloat16 if dtype == "bf16" else None).eval()
    keys = list(model.state_dict())
    manifest = _piecewise_plan(case.name, dtype)
    with _mode(grad, autocast):
        ref = run(model)
        handle = apply_manifest(model, manifest, warmup=run, passes=2,
                                overrides=CPU_OVERRIDES)
        try:
            got = run(model)
        finally:
            report = handle.report
            handle.restore()
    assert list(model.state_dict()) == keys
    records = list(report)
    pw = {r.path for reg in manifest.regions if reg.kind == PIECEWISE_KIND for r in records
          if r.path in reg.paths}
    return {"records": records, "piecewise": pw, "got": got, "ref": ref,
            "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "summary": report.summary()}


def _check(out: dict[str, Any], *, dtype: str, autocast: bool, exact: bool = False) -> None:
    print(out["summary"])
    records = out["records"]
    assert out["piecewise"], "the plan has no piecewise region: nothing of issue 19 ran"
    assert [r.path for r in records if r.status == "eager" and not r.reason] == []
    ran = [r for r in records if r.path in out["piecewise"] and r.compiled_calls > 0]
    assert ran, "no piecewise region ran its compiled graph: " + out["summary"]
    assert out["unique_graphs"] >= 1
    if exact:
        assert all(torch.equal(a, b) for a, b in zip(out["got"], out["ref"], strict=True))
        return
    tol = TOLERANCE["bf16" if dtype == "bf16" or autocast else "fp32"]
    diff = _rel_diff(out["got"], out["ref"])
    assert diff <= tol, f"outputs differ from eager by {diff:.2e} (> {tol})"


# Each streaming model in the default mode and in two more (the full product would cost
# minutes on 2 cores for little more coverage; test_zoo.py covers the plain regions' modes).
MODES = [
    ("gpt2", "inference_mode", False, "fp32"),
    ("gpt2", "no_grad", True, "fp32"),
    ("gpt2", "inference_mode", False, "bf16"),
    ("example_sdpa", "no_grad", False, "fp32"),
    ("example_sdpa", "inference_mode", True, "fp32"),
]


@pytest.mark.parametrize(("name", "grad", "autocast", "dtype"), [
    pytest.param(n, g, a, d, id=f"{n}-{g}-{'autocast-' if a else ''}{d}",
                 marks=_case_params([n])[0].marks) for n, g, a, d in MODES])
def test_streaming_zoo_models_run_their_piecewise_plan_as_eager(name: str, grad: str,
                                                                 autocast: bool,
                                                                 dtype: str) -> None:
    case = CASES[name]
    out = _run(case, case.run, grad=grad, autocast=autocast, dtype=dtype)
    _check(out, dtype=dtype, autocast=autocast)


@pytest.mark.parametrize("case", _case_params(["gpt2"]))
def test_gpt2_generate_with_the_piecewise_plan_makes_eagers_tokens(case: ZooCase) -> None:
    """transformers' own loop over its dynamic cache: every token identical in fp32."""
    out = _run(case, run_generate, grad="no_grad", autocast=False, dtype="fp32")
    _check(out, dtype="fp32", autocast=False, exact=True)
    assert out["got"][0].shape[1] == 6 + GENERATE_TOKENS
