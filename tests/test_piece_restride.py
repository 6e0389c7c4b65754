"""surgery.runtime.piece_restride: a piece that differs from a compiled one only in the strides
of inputs that are not weights takes that compile, its inputs copied into the compiled layout
(the SDPA example's camera trunk and global blocks, after attention), where copying is safe."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import fx

from surgery.planning.plan import plan_model
from surgery.runtime.apply import apply_manifest
from surgery.runtime.piece_cache import PieceCache
from surgery.runtime.piece_restride import RestridedPiece, copy_safe
from surgery.runtime.piecewise import PiecewiseGroup
from tests.sdpa_streams import stream_against_eager
from tests.test_graphs import FakeCapturer, fake_cuda  # noqa: F401 (fake_cuda: a fixture)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TRUNK = ["camera_head.trunk.0", "camera_head.trunk.1"]
GLOBAL = ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]


def after_attention(o: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The piece after attention, shortened: heads back to tokens, a projection, a residual."""
    return x + torch.nn.functional.linear(o.transpose(1, 2).reshape(x.shape), w).relu()


def writes_its_input(o: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    o.mul_(2)  # the caller's tensor changes: a copy would not
    return after_attention(o, x, w)


def returns_a_view(o: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[Any, ...]:
    return after_attention(o, x, w), o.transpose(1, 2)  # a view of the caller's tensor


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention output laid out as the global blocks give it (contiguous) and as the trunk
    does (a permuted view: its q was a view of the fused qkv), the residual, the weight."""
    g = torch.Generator().manual_seed(0)
    contiguous = torch.randn(1, 2, 6, 16, generator=g)
    permuted = torch.randn(1, 6, 2, 16, generator=g).transpose(1, 2)
    assert contiguous.stride() != permuted.stride() and contiguous.shape == permuted.shape
    return contiguous, permuted, torch.randn(1, 6, 32, generator=g), torch.randn(32, 32,
                                                                                 generator=g)


def _cache() -> tuple[PieceCache, list[int]]:
    built: list[int] = []

    def compile_fn(gm: fx.GraphModule, example: list[Any]) -> Any:
        built.append(len(example))
        return gm.forward

    return PieceCache(compile_fn), built


def test_the_same_piece_on_other_input_strides_takes_the_compile_behind_a_copy() -> None:
    contiguous, permuted, x, w = _inputs()
    cache, built = _cache()
    gm = fx.symbolic_trace(after_attention)
    first, _, fresh = cache.get(gm, [contiguous, x, w], [2])
    assert fresh and built == [3]
    first(contiguous, x, w)
    second, _, fresh = cache.get(fx.symbolic_trace(after_attention), [permuted, x, w], [2])
    assert not fresh and built == [3]  # no second compile
    assert isinstance(second, RestridedPiece) and cache.restrided == 1 and cache.shared == 1
    assert second.targets == ((0, contiguous.stride()),)  # only the attention output copied
    assert second.runs == 1  # the compiled code ran: a path may capture at its first call
    seen: list[tuple[int, ...]] = []
    inner = second.inner
    second.inner = lambda *a: (seen.append(a[0].stride()), inner(*a))[1]
    torch.testing.assert_close(second(permuted, x, w), after_attention(permuted, x, w),
                               rtol=0, atol=0)
    assert seen == [contiguous.stride()]  # the compiled code saw the layout it was built for
    # the trunk's other instances find the restrided piece under their own exact key
    again, _, fresh = cache.get(fx.symbolic_trace(after_attention), [permuted, x, w], [2])
    assert again is second and not fresh and cache.restrided == 1


@pytest.mark.parametrize("fn", [
    pytest.param(writes_its_input, id="writes-an-input-in-place"),
    pytest.param(returns_a_view, id="returns-a-view-of-an-input"),
])
def test_a_piece_that_a_copy_would_change_compiles_on_its_own(fn: Any) -> None:
    contiguous, permuted, x, w = _inputs()
    cache, built = _cache()
    assert not copy_safe(fx.symbolic_trace(fn), [0])
    cache.get(fx.symbolic_trace(fn), [contiguous, x, w], [2])
    piece, _, fresh = cache.get(fx.symbolic_trace(fn), [permuted, x, w], [2])
    assert fresh and len(built) == 2 and cache.restrided == 0
    assert not isinstance(piece, RestridedPiece)


def test_weights_of_other_strides_are_never_copied() -> None:
    """Parameters and buffers are read in place (region graphs bake their addresses)."""
    contiguous, _, x, w = _inputs()
    cache, built = _cache()
    gm = fx.symbolic_trace(after_attention)
    assert copy_safe(gm, [0, 1, 2])
    cache.get(gm, [contiguous, x, w], [2])
    cache.get(fx.symbolic_trace(after_attention), [contiguous, x, w.t().contiguous().t()], [2])
    assert len(built) == 2 and cache.restrided == 0
    # the same input as a non-weight would have been copied
    cache.get(fx.symbolic_trace(after_attention), [contiguous, x, w.t().contiguous().t()], [])
    cache.get(fx.symbolic_trace(after_attention), [contiguous, x, w], [])
    assert len(built) == 3 and cache.restrided == 1


def _trunk_applied() -> tuple[Any, Any, Any]:
    """The tiny SDPA example with its piecewise plan (global blocks and camera trunk) applied on
    aot_eager, an eager copy of it, and the handle."""
    from surgery.examples import tiny_sdpa

    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    ref = copy.deepcopy(model)
    manifest = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    manifest.compile = {**manifest.compile, "backend": "aot_eager", "on_cpu": "compile"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest)
    return model, ref, handle


def test_the_trunk_runs_the_global_blocks_piece_after_attention(
        fake_cuda: FakeCapturer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The camera trunk's piece after attention is the global blocks' (same ops and shapes; its
    attention output is a permuted view): 3 piece compiles for the plan, not 4, and the trunk's
    outputs, caches and pose stay eager's over 20 frames (its full window compiles at 17).
    Applied as on CUDA (the stand-in capturer): the copy runs inside the piece's graph."""
    compiled: list[int] = []
    inner = PiecewiseGroup._compile_piece

    def counting(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        compiled.append(len(gm.graph.nodes))
        return inner(self, gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", counting)
    model, ref, handle = _trunk_applied()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for s in range(20):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k])
    for mine, theirs in zip(model.camera_head.kv_cache, ref.camera_head.kv_cache, strict=True):
        assert len(mine) == len(theirs) == 16
        torch.testing.assert_close(torch.stack(mine), torch.stack(theirs))
    trunk = [handle.report.by_path(p) for p in TRUNK]
    assert all(r.status == "compiled" for r in trunk), [r.reason for r in trunk]
    assert len(compiled) == 3  # frame/global before and after attention, the trunk's before
    # the piece after attention of each of the trunk's 2 graphs (first frame, full window)
    assert sum(r.pieces_restrided for r in trunk) == 2
    assert all(handle.report.by_path(p).pieces_restrided == 0 for p in GLOBAL)
    assert sum(r.pieces_compiled for r in trunk) == 1
    assert all(r.cuda_graph_replays > 0 for r in trunk)


@pytest.mark.cuda
def test_on_cuda_the_trunk_compiles_only_its_piece_before_attention_and_replays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with inductor and region capture (bf16 autocast, as the benchmark streams): the
    frame blocks build the RopeBlock's two pieces, the global blocks share them, the trunk's
    piece after attention is theirs too (restrided where its attention output's layout differs:
    flash attention lays it out like q), so its piece before attention is its one compile,
    with inductor: PieceWork's light rule across regions is off by default
    (piece_cache.LIGHT_ACROSS_REGIONS), and this test runs the defaults. Every trunk path
    replays; outputs and the trunk's cache within bf16 tolerance of eager's over 20 frames (its
    full window compiles at 17).

    The rule switched on makes that piece light instead (the H200 showed it: pieces_light 1):
    tests/test_piece_work.py covers both settings under the stand-in capturer."""
    import surgery.runtime.compile_start as compile_start
    import surgery.runtime.piece_cache as piece_cache
    from surgery.examples import tiny_sdpa

    monkeypatch.setattr(compile_start, "LIGHT_PIECE_ELEMENTS", 0)  # tiny sizes: the share rules
    assert not piece_cache.LIGHT_ACROSS_REGIONS  # the default this test checks
    torch.manual_seed(0)
    model = tiny_sdpa().cuda().eval()
    ref = copy.deepcopy(model)
    manifest = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    manifest.regions = [r for r in manifest.regions if r.kind in ("piecewise", "frame_block")]
    manifest.compile = {**manifest.compile, "backend": "inductor"}
    # the planner's light pieces write aot_eager into each region's compile table, which wins
    # over the manifest's: the documented opt-out (inductor named per region) keeps this test's
    # premise, the trunk's piece before attention built by inductor
    for r in manifest.regions:
        r.compile = {**r.compile, "backend": "inductor"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest)
    stream_against_eager(model, ref, frames=20)
    trunk = [handle.report.by_path(p) for p in TRUNK]
    detail = [(r.status, r.pieces_compiled, r.pieces_light, r.pieces_restrided,
               r.cuda_graph_replays) for r in trunk]
    assert all(r.status == "compiled" for r in trunk), detail
    assert sum(r.pieces_compiled for r in trunk) == 1, detail  # before attention only
    assert sum(r.pieces_light for r in trunk) == 0, detail
    assert all(r.cuda_graph_replays > 0 for r in trunk), detail
