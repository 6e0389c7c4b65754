"""apply_manifest with CUDA graphs: the KV-cache streaming case of pytorch#152887.

The example model's global blocks keep the (k, v) tensors that ``attn_pre`` returns in a KV cache,
without copying them. Under ``mode="reduce-overhead"`` those tensors live in the CUDA-graph pool,
and the next step's replay of ``attn_pre`` overwrites them: cudagraph trees then refuse the access
("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"), or, if
the access slips past that check, the cached keys hold the newer frame and outputs are wrong.
Cloning region outputs outside the graph (``clone_outputs``, the default) fixes it.

These run on the GPU machine; tests/conftest.py skips them cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from surgery import examples
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest, mark_step

FRAMES = 4
# Inductor and eager both call cuBLAS for the float32 matmuls (TF32 off by default); fusion
# reorders the LayerNorm/GELU arithmetic, so float32 results agree to about 1e-5.
TOL = {"atol": 1e-3, "rtol": 1e-3}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _global_block_manifest(model: torch.nn.Module, *, clone: bool) -> Manifest:
    depth = len(model.aggregator.global_blocks)
    regions = [
        Region("attn_pre", [f"aggregator.global_blocks.{i}.attn_pre" for i in range(depth)],
               callable="method", on_failure="error"),
        Region("ffn_residual", [f"aggregator.global_blocks.{i}.ffn_residual"
                                for i in range(depth)], callable="method", on_failure="error"),
    ]
    compile_ = {**DEFAULT_COMPILE, "mode": "reduce-overhead", "capture": "compiler",
                "clone_outputs": clone}  # inductor's cudagraph trees
    return Manifest(compute_fingerprint(model.state_dict()), regions, compile=compile_)


def _stream(model: examples.ExampleModel, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """One sequence, frame by frame, each step opened with mark_step() as deployments do."""
    model.reset_stream()
    outs = []
    for f in frames:
        mark_step()
        outs.append(model(f).clone())
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("clone", [pytest.param(True, id="clone_outputs"),
                                   pytest.param(False, id="no_clone")])
def test_kv_cache_streaming_needs_cloned_region_outputs(clone: bool) -> None:
    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    frames = [model.example_input(seed=i) for i in range(FRAMES)]
    with torch.no_grad():
        ref = _stream(model, frames)  # eager
        handle = apply_manifest(model, _global_block_manifest(model, clone=clone),
                                warmup=lambda m: _stream(m, frames[:1]))
        try:
            for rec in handle.report:
                assert rec.status == "compiled", handle.report.summary()
                assert rec.cuda_graphs and rec.clone_outputs is clone
            error: RuntimeError | None = None
            outs: list[torch.Tensor] = []
            try:
                outs = _stream(model, frames)
            except RuntimeError as e:
                error = e
        finally:
            handle.restore()
    if clone:
        assert error is None, f"streaming failed with cloned outputs: {error}"
        for out, want in zip(outs, ref, strict=True):
            torch.testing.assert_close(out, want, **TOL)
    else:
        overwritten = error is not None and "overwritten" in str(error)
        wrong = error is None and any(not torch.allclose(o, r, **TOL)
                                      for o, r in zip(outs, ref, strict=True))
        assert overwritten or wrong, (
            "without clone_outputs the KV cache should have been overwritten by the next replay "
            f"(pytorch#152887), but streaming gave correct outputs; error={error!r}")


@pytest.mark.cuda
def test_planned_manifest_streams_correctly_with_cuda_graphs() -> None:
    """The plan clones only where outputs outlive the step (attn_pre); that must be enough."""
    from surgery.planning.plan import plan_model

    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    from surgery.planning.plan import compile_defaults

    manifest = plan_model("surgery.examples:tiny",
                          compile=compile_defaults(capture="compiler")).manifest  # trees
    frames = [model.example_input(seed=i) for i in range(FRAMES + 2)]
    with torch.no_grad():
        ref = _stream(model, frames)
        with apply_manifest(model, manifest, warmup=lambda m: _stream(m, frames[:1])) as handle:
            counts = handle.report.counts()
            assert counts["compiled"] == len(handle.report), handle.report.summary()
            assert {r.kind for r in handle.report if r.clone_outputs} == {"attn_pre"}
            outs = _stream(model, frames)
    for out, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, want, **TOL)


def _region_capture_manifest() -> Manifest:
    from surgery.planning.plan import compile_defaults, plan_model

    return plan_model("surgery.examples:tiny", compile=compile_defaults(capture="region")).manifest


@pytest.mark.cuda
@pytest.mark.parametrize("clone_all", [pytest.param(None, id="planned"),
                                       pytest.param(True, id="clone_everywhere")])
def test_region_capture_streams_correctly(clone_all: bool | None) -> None:
    """surgery's own region graphs (capture = "region"), captured and replayed on a real GPU.

    The plan clones nothing: the KV cache keeps attn_pre's k and v for 4 frames, so the held
    check finds those output sets in use and the path captures a ring of 5. With clone_outputs
    everywhere, one set per path is enough.
    """
    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    keys = list(model.state_dict())
    manifest = _region_capture_manifest()
    assert manifest.compile["capture"] == "region" and "mode" not in manifest.compile
    frames = [model.example_input(seed=i) for i in range(FRAMES + 4)]
    overrides = None if clone_all is None else {"clone_outputs": clone_all}
    with torch.no_grad():
        ref = _stream(model, frames)
        handle = apply_manifest(model, manifest, overrides=overrides,
                                warmup=lambda m: _stream(m, frames[:2]))
        with handle:
            outs = _stream(model, frames)
            report = handle.report
            assert report.counts()["compiled"] == len(report), report.summary()
            frame = report.by_path("aggregator.frame_blocks.0")
            assert frame.graph_replays >= len(frames), report.summary()
            assert frame.output_sets == 1 and frame.clone_outputs is bool(clone_all)
            pre = report.by_path("aggregator.global_blocks.0.attn_pre")
            assert pre.graph_replays > 0, report.summary()
            assert pre.output_sets == (1 if clone_all else model.config.window + 1), \
                report.summary()
            assert not any("still referenced" in n for r in report for n in r.notes)
            assert list(model.state_dict()) == keys
    for out, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, want, **TOL)


# --- inference_mode (issue 11 C) ----------------------------------------------------------------

@pytest.mark.cuda
def test_readme_snippet_region_capture_under_inference_mode() -> None:
    """The README's deployment snippet as written: warm-up and inference under inference_mode,
    real CUDA graphs, the KV-cache ring; outputs equal eager's."""
    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    manifest = _region_capture_manifest()
    frames = [model.example_input(seed=i) for i in range(FRAMES + 4)]
    with torch.inference_mode():
        ref = _stream(model, frames)
    with torch.inference_mode():    # warm up as you infer: region graphs are captured in warm-up
        handle = apply_manifest(model, manifest, warmup=lambda m: _stream(m, frames[:2]))
    with handle, torch.inference_mode():                    # restores on exit
        outs = _stream(model, frames)
        report = handle.report
        assert report.counts()["compiled"] == len(report), report.summary()
        assert all(r.graphs_captured >= 1 and r.graph_replays > 0 for r in report), \
            report.summary()
    for out, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, want, **TOL)


class _Head(torch.nn.Module):
    """Several tensor inputs, one written in place (a cache at a position), and a part that
    turns autocast off inside an autocast step, as LingBot-Map's heads do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, y: torch.Tensor, cache: torch.Tensor, pos: int
                ) -> torch.Tensor:
        cache[pos].copy_(x[0])
        return self.lin(x) + self.lin(y) + cache.sum(0)


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = _Head()

    def forward(self, x: torch.Tensor, y: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a = self.head(x, y, cache, 1)
            with torch.autocast("cuda", enabled=False):
                b = self.head(x.float(), y.float(), cache, 2)
        return a.float() + b


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_region_graphs_with_many_inputs_writes_and_autocast_toggled(mode: str) -> None:
    torch.manual_seed(0)
    model = _Holder().cuda().eval()
    manifest = Manifest(compute_fingerprint(model.state_dict()), [Region("head", ["head"])],
                        compile={**DEFAULT_COMPILE, "clone_outputs": False})
    grad_off = torch.inference_mode if mode == "inference_mode" else torch.no_grad

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(8, 64, device="cuda", generator=g),
                torch.randn(8, 64, device="cuda", generator=g), torch.zeros(4, 64, device="cuda"))

    with grad_off():
        refs = []
        for s in range(6):
            x, y, c = inputs(s)
            refs.append((model(x, y, c).clone(), c.clone()))
        handle = apply_manifest(model, manifest, warmup=lambda m: m(*inputs(100)), passes=3)
        with handle:
            for s in range(6):
                x, y, c = inputs(s)
                out = model(x, y, c)
                torch.testing.assert_close(out, refs[s][0], atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(c, refs[s][1], atol=2e-2, rtol=2e-2)  # written back
            rec = handle.report.by_path("head")
            assert rec.status == "compiled" and rec.graphs_captured >= 2, handle.report.summary()
            assert rec.graph_replays >= 12, handle.report.summary()
