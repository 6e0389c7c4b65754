"""The zoo (issue 11 F): plan and apply on real architectures nobody here wrote, against eager.

Each model comes from its own package's config with random weights, at test size
(tests/zoo_models.py): timm ViT; transformers ViT, BERT and GPT-2 (decoding on its KV cache);
diffusers DiT, Flux and SD3; and the SDPA build of the example model (a camera trunk with its own
KV cache and an integer block index, a float32 head inside autocast, a conv head).

On the CPU the regions compile with ``on_cpu = "compile"`` and ``backend = "aot_eager"`` (one
model also with inductor, marked slow). Every run asserts that the outputs match eager within a
tolerance, that the state-dict keys did not change, that the regions really ran compiled code
(the report's counted graph executions and dynamo's own ``unique_graphs`` counter), and that
whatever runs eager says why. The grad-mode / autocast / dtype matrix is marked slow (CI runs
slow tests too). The ``cuda`` variant runs on the GPU machine under ``inference_mode`` and
``no_grad`` in bf16 with the manifest's own settings (region CUDA graphs) and reports what was
compiled, demoted and replayed per model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zoo_models import CASES, ZooCase  # noqa: E402

from surgery import apply_manifest  # noqa: E402
from surgery.formats.manifest import Manifest  # noqa: E402
from surgery.planning.plan import plan_checkpoint, plan_model  # noqa: E402

CPU_OVERRIDES = {"on_cpu": "compile", "backend": "aot_eager"}
# Largest |compiled - eager| allowed, relative to the largest |eager| of that output. aot_eager
# runs the very aten ops eager runs, so fp32 must agree to rounding; bf16 (or autocast) gets a
# few bf16 ulps, for kernels that pick another accumulation order inside a graph.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


def _needs(*packages: str) -> Any:
    missing = [p for p in packages if _missing(p)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} "
                              "(installed by `make install`'s dev extra)")


@functools.cache
def _missing(package: str) -> bool:
    try:
        __import__(package)
    except Exception:  # not installed, or installed but broken: either way it cannot run here
        return True
    return False


_PACKAGE = {"timm_vit": "timm", "hf_vit": "transformers", "hf_bert": "transformers",
            "gpt2": "transformers", "dit": "diffusers", "flux": "diffusers", "sd3": "diffusers",
            "example_sdpa": "torch"}


def _case_params(names: list[str] | None = None) -> list[Any]:
    return [pytest.param(CASES[n], id=n, marks=_needs(_PACKAGE[n])) for n in names or CASES]


@functools.cache
def _plan(name: str, dtype: str = "fp32") -> Manifest:
    """The live plan, of the float32 model or of the model cast to bf16."""
    spec = CASES[name].spec if dtype == "fp32" else f"zoo_models:bf16.{name}"
    return plan_model(spec).manifest


def _kinds(manifest: Manifest) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in manifest.regions:
        out[r.kind] = out.get(r.kind, 0) + len(r.paths)
    return out


# --- plan --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", _case_params())
def test_plan_from_the_live_model(case: ZooCase) -> None:
    m = _plan(case.name)
    assert _kinds(m) == case.kinds
    left = {lo.path: lo.reason for lo in m.left_out}
    for path in case.streaming:
        assert "streaming" in left[path], left.get(path)
    # No single layer is a region (issue 11 E), and no other model's vocabulary leaks in.
    assert all(r.kind != "repeated_block" or r.module_class not in
               ("Conv2d", "ConvTranspose2d", "Linear", "LayerNorm") for r in m.regions)
    if "attn_proj" not in case.kinds:
        assert not [lo for lo in m.left_out if lo.kind == "attn_proj"]


@pytest.mark.parametrize("case", _case_params())
def test_plan_from_a_saved_checkpoint(case: ZooCase, tmp_path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = case.build().state_dict()
    # Tied weights (GPT-2's lm_head and wte) share storage, which save_file refuses.
    save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
              str(tmp_path / "model.safetensors"))
    res = plan_checkpoint(str(tmp_path / "model.safetensors"))
    live = _plan(case.name)
    assert res.manifest.fingerprint == live.fingerprint  # one binding, whichever was planned
    repeated = [r.paths for r in res.manifest.regions if r.kind == "repeated_block"]
    if case.checkpoint_same:
        assert _kinds(res.manifest) == case.kinds
        assert repeated == [r.paths for r in live.regions if r.kind == "repeated_block"]
    assert not [n for n in res.notes if "attn_pre" in n]


# --- apply, against eager ----------------------------------------------------------------------

@contextlib.contextmanager
def _mode(grad: str, autocast: bool) -> Iterator[None]:
    grad_ctx = torch.inference_mode() if grad == "inference_mode" else torch.no_grad()
    with grad_ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        yield


def _rel_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert len(got) == len(ref)
    worst = 0.0
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        a, b = a.float(), b.float()
        assert torch.isfinite(a).all()
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)))
    return worst


def run_zoo_case(case: ZooCase, *, grad: str = "inference_mode", autocast: bool = False,
                 dtype: str = "fp32", backend: str = "aot_eager", device: str = "cpu",
                 overrides: dict[str, Any] | None = None,
                 planned: str | None = None) -> dict[str, Any]:
    """Eager outputs, then apply the live plan and run again; returns what the report says.

    The plan is of the model in `planned` (default: `dtype`); planning in fp32 and deploying in
    bf16 is issue 11 D, tested on its own.
    """
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: the counts must be this run's
    torch.manual_seed(0)
    model = case.build().to(device=device, dtype=torch.bfloat16 if dtype == "bf16" else None)
    model.eval()
    keys = list(model.state_dict())
    if overrides is None:
        overrides = {**CPU_OVERRIDES, "backend": backend}
    with _mode(grad, autocast):
        ref = case.run(model)
        handle = apply_manifest(model, _plan(case.name, planned or dtype), warmup=case.run,
                                passes=2, overrides=overrides)
        try:
            got = case.run(model)
        finally:
            report = handle.report
            handle.restore()
    assert list(model.state_dict()) == keys
    records = list(report)
    compiled = [r for r in records if r.status == "compiled"]
    eager = [r for r in records if r.status == "eager"]
    return {
        "diff": _rel_diff(got, ref),
        "compiled": len(compiled),
        "graphs_run": sum(r.graphs_run for r in records),
        "replays": sum(r.graph_replays for r in records),
        "demoted": sorted({f"{r.path}: {r.reason}" for r in eager}),
        "unreasoned": [r.path for r in eager if not r.reason],
        "pending": [r.path for r in records if r.status == "pending"],
        "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "summary": report.summary(),
    }


def _check(out: dict[str, Any], *, dtype: str, autocast: bool, paths: int) -> None:
    print(out["summary"])  # shown with -rA / on failure: compiled, demoted and why
    assert out["unreasoned"] == [], "a region runs eager without saying why"
    assert out["compiled"] >= 1 and out["graphs_run"] >= out["compiled"]
    assert out["unique_graphs"] >= 1  # dynamo's own count: something really compiled
    assert out["compiled"] + len(out["demoted"]) + len(out["pending"]) == paths
    tol = TOLERANCE["bf16" if dtype == "bf16" or autocast else "fp32"]
    assert out["diff"] <= tol, f"outputs differ from eager by {out['diff']:.2e} (> {tol})"


def _paths(case: ZooCase) -> int:
    return sum(len(r.paths) for r in _plan(case.name).regions)


@pytest.mark.parametrize("case", _case_params())
def test_apply_matches_eager(case: ZooCase) -> None:
    out = run_zoo_case(case)
    _check(out, dtype="fp32", autocast=False, paths=_paths(case))
    # On the CPU nothing is replayed; every region of these models is called, so all compile.
    assert out["demoted"] == [] and out["pending"] == []
    assert out["compiled"] == _paths(case)


# Grad mode x autocast x dtype, each on two models (every model gets at least one mode beyond
# the default inference_mode / fp32 / no autocast): the full product, 8 models x 6 modes, would
# cost most of CI's 15 minutes on 2 cores for little more coverage.
MODES = {
    ("no_grad", False, "fp32"): ("flux", "gpt2"),
    ("no_grad", True, "fp32"): ("hf_bert", "example_sdpa"),
    ("inference_mode", True, "fp32"): ("gpt2", "dit"),
    ("no_grad", False, "bf16"): ("sd3", "hf_vit"),
    ("inference_mode", False, "bf16"): ("timm_vit", "gpt2"),
    ("inference_mode", True, "bf16"): ("flux", "hf_bert"),
}


def _mode_params() -> list[Any]:
    out = []
    for (grad, autocast, dtype), names in MODES.items():
        mode = f"{grad}-{'autocast-' if autocast else ''}{dtype}"
        out += [pytest.param(CASES[n], grad, autocast, dtype, id=f"{n}-{mode}",
                             marks=_needs(_PACKAGE[n])) for n in names]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("case", "grad", "autocast", "dtype"), _mode_params())
def test_apply_matches_eager_in_other_modes(case: ZooCase, grad: str, autocast: bool,
                                            dtype: str) -> None:
    out = run_zoo_case(case, grad=grad, autocast=autocast, dtype=dtype)
    _check(out, dtype=dtype, autocast=autocast, paths=_paths(case))


@pytest.mark.parametrize("case", _case_params(["hf_bert"]))
def test_a_plan_of_the_float32_model_applies_in_bf16(case: ZooCase) -> None:
    run_zoo_case(case, dtype="bf16", planned="fp32")


@pytest.mark.slow
@pytest.mark.parametrize("case", _case_params(["timm_vit"]))
def test_apply_with_inductor(case: ZooCase) -> None:
    out = run_zoo_case(case, backend="inductor")
    _check(out, dtype="fp32", autocast=False, paths=_paths(case))


@pytest.mark.cuda
@pytest.mark.parametrize("grad", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("case", _case_params())
def test_zoo_on_the_gpu(case: ZooCase, grad: str, record_property: Any) -> None:
    """The manifest as planned (inductor, region CUDA graphs) from the float32 model, as a
    checkpoint is saved, deployed in bf16 on the GPU."""
    # The example keeps its float32 head under autocast(enabled=False), which needs float32
    # weights: it runs in fp32 here (its bf16-autocast run is benchmarks/gpu_evidence.py).
    dtype = "fp32" if case.name == "example_sdpa" else "bf16"
    out = run_zoo_case(case, grad=grad, dtype=dtype, device="cuda", overrides={},
                       planned="fp32")
    for key in ("compiled", "replays", "demoted", "diff"):
        record_property(key, out[key])
    print(f"{case.name} {grad}: compiled {out['compiled']}, replayed {out['replays']}, "
          f"demoted {out['demoted']}")
    _check(out, dtype=dtype, autocast=False, paths=_paths(case))
    assert out["replays"] >= 1  # region graphs were captured and replayed
