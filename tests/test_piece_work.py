"""surgery.runtime.piece_cache.PieceWork: a piece that is a small share of all the apply's
piecewise pieces (the SDPA example's camera trunk beside its global blocks) compiles light under
region capture; for a single piecewise region the rule is compile_start's per-graph one."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import fx

import surgery.runtime.compile_start as compile_start
import surgery.runtime.piece_cache as piece_cache
from surgery.planning.plan import plan_model
from surgery.runtime.apply import apply_manifest
from surgery.runtime.compile_start import light_pieces
from surgery.runtime.piece_cache import PieceWork
from surgery.runtime.piecewise import PiecewiseGroup
from tests.sdpa_streams import stream_against_eager
from tests.test_compile_start import GPT2_SMALL
from tests.test_graphs import FakeCapturer, fake_cuda  # noqa: F401 (fake_cuda: a fixture)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def across(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule switched on (it is off by default: piece_cache.LIGHT_ACROSS_REGIONS)."""
    monkeypatch.setattr(piece_cache, "LIGHT_ACROSS_REGIONS", True)

TRUNK = ["camera_head.trunk.0", "camera_head.trunk.1"]
GLOBAL = ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]


@pytest.mark.parametrize("pieces", [
    pytest.param(GPT2_SMALL, id="gpt2-small-stack"),
    pytest.param([("first", 8), ("middle", 19), ("last", 17)], id="two-blocks"),
    pytest.param([("a", 1), ("b", 40)], id="a-one-op-piece"),
    pytest.param([(None, 5), (None, 5), ("m", 50)], id="unshareable pieces count alone"),
    pytest.param([("v", 0), ("w", 0)], id="no work at all"),
])
@pytest.mark.parametrize("paths", [1, 12])
def test_one_region_is_the_per_graph_rule(pieces: list[tuple[str | None, int]],
                                          paths: int, across: None) -> None:
    """With one piecewise group every weight and the total scale by its paths: the GPT-2
    stack's light pieces (and every other case of compile_start's) do not change."""
    work = PieceWork()
    assert work.light(1, paths, pieces) == light_pieces(pieces)
    assert work.light(1, paths, pieces) == light_pieces(pieces)  # a second graph, same pieces


def test_a_small_group_beside_a_large_one_has_light_pieces(across: None) -> None:
    """The trunk's graph alone: its piece before attention is 3 of 10 ops (not light). Beside
    24 global blocks running a 40-op piece and the same 7-op piece after attention, it is 12
    of about 1170 op-paths: light. The shared piece after attention is not (its code runs in
    both groups)."""
    trunk = [("trunk-before", 3), ("after", 7)]
    assert light_pieces(trunk) == [False, False]
    work = PieceWork()
    assert work.light(1, 24, [("global-before", 40), ("after", 7)]) == [False, False]
    assert work.light(2, 4, trunk) == [True, False]
    # traced first, the small group is weighed against itself alone: nothing light
    first = PieceWork()
    assert first.light(2, 4, trunk) == [False, False]


@pytest.mark.parametrize("on", [pytest.param(True, id="rule-on"),
                                pytest.param(False, id="default-off")])
def test_the_trunks_piece_before_attention_compiles_light_beside_the_global_blocks(
        fake_cuda: FakeCapturer, monkeypatch: pytest.MonkeyPatch, on: bool) -> None:  # noqa: F811
    """The tiny SDPA example's frame blocks and piecewise regions on an inductor plan under the
    stand-in capturer (the plan's backend stood in by the FX code itself): the frame blocks
    compile the two RopeBlock pieces with the plan's backend (shared_pieces), the global blocks
    share them, the trunk's piece after attention is theirs too (piece_restride), and the
    trunk's piece before attention, 3 ops on 2 paths beside 81 ops on 2 global paths, compiles
    light; by default (the rule off) it compiles with the plan's backend. Outputs stay eager's."""
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_ELEMENTS", 0)  # the tiny sizes: share only
    monkeypatch.setattr(piece_cache, "LIGHT_ACROSS_REGIONS", on)
    full: list[int] = []
    light: list[int] = []

    def plan_backend(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        full.append(len(gm.graph.nodes))
        return gm.forward

    real_light = piece_cache.compile_light

    def counted_light(gm: fx.GraphModule, example: list[Any]) -> Any:
        light.append(len(gm.graph.nodes))
        return real_light(gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", plan_backend)
    monkeypatch.setattr(piece_cache, "compile_light", counted_light)
    handle = _stream_piecewise_sdpa(frames=4)
    trunk = [handle.report.by_path(p) for p in TRUNK]
    glob = [handle.report.by_path(p) for p in GLOBAL]
    assert all(r.status == "compiled" for r in (*trunk, *glob))
    if not on:  # RopeBlock's two and the trunk's piece before attention, all full
        assert len(full) == 3 and light == [], (full, light)
        assert sum(r.pieces_light for r in (*trunk, *glob)) == 0
        return
    assert len(full) == 2 and len(light) == 1, (full, light)  # RopeBlock's two; the trunk's
    assert light[0] < min(full)  # the trunk's small piece
    assert sum(r.pieces_light for r in trunk) == 1 and sum(r.pieces_light for r in glob) == 0
    assert sum(r.pieces_restrided for r in trunk) == 1


def test_the_planned_light_pieces_share_and_replay(
        fake_cuda: FakeCapturer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The piecewise plan as planned (planning/streaming.light_pieces_plan: its piecewise regions
    and frame blocks say ``backend = "aot_eager"`` on an inductor plan under region capture; the
    stand-in capturer), which is what w19s's arm ``sdpa_piecewise_light`` measured. Every piece
    compiles with aot_eager, never the plan's inductor; the frame blocks and the global blocks
    still share one compile per piece; every path replays; outputs stay eager's over 20
    frames."""
    plan_built: list[int] = []
    real = PiecewiseGroup._compile_piece

    def compile_piece(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        plan_built.append(self.plan.backend == "inductor")
        return real(self, gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", compile_piece)
    handle = _stream_piecewise_sdpa(frames=20, region_backend=None)  # trunk's window: 17
    assert {handle.report.by_path(p).backend for p in (*TRUNK, *GLOBAL)} == {"aot_eager"}
    recs = [handle.report.by_path(p) for p in (*TRUNK, *GLOBAL)]
    assert all(r.status == "compiled" for r in recs), [r.reason for r in recs]
    assert plan_built == [False, False, False], plan_built  # RopeBlock's two, the trunk's one
    frames = [handle.report.by_path(f"aggregator.frame_blocks.{i}") for i in (0, 1)]
    assert sum(r.pieces_compiled for r in frames) == 2  # the frame blocks build them
    # the trunk's first path builds its piece before attention and takes the RopeBlock's after
    # it (restrided); the global blocks take both of the frame blocks' pieces
    assert sum(r.pieces_compiled for r in recs) == 1
    assert handle.report.by_path(TRUNK[0]).pieces_restrided > 0
    assert handle.report.by_path(GLOBAL[0]).pieces_shared > 0
    assert all(r.cuda_graph_replays > 0 for r in (*recs, *frames))


def _stream_piecewise_sdpa(frames: int, region_backend: str | None = "inductor") -> Any:
    """The tiny SDPA example's piecewise and frame-block regions on an inductor plan (each
    region on ``region_backend``; None: as planned, light pieces), deployed, then ``frames``
    frames streamed under bf16 autocast, each output checked against an eager twin's. Returns
    the apply handle."""
    from surgery.examples import tiny_sdpa

    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    ref = copy.deepcopy(model)
    manifest = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    manifest.regions = [r for r in manifest.regions if r.kind in ("piecewise", "frame_block")]
    if region_backend is not None:
        for r in manifest.regions:
            r.compile = {**r.compile, "backend": region_backend}
    manifest.compile = {**manifest.compile, "backend": "inductor", "on_cpu": "compile"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for s in range(frames):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k])
    return handle


@pytest.mark.cuda
def test_on_cuda_the_planned_light_pieces_build_no_inductor_code_and_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny SDPA example's piecewise plan as planned, deployed with its defaults on CUDA
    (region capture): no piece goes to inductor (every one compiles aot_eager), the frame blocks
    and the streaming blocks share them, every path replays its graphs, and 20 streamed frames,
    the trunk's cache and the held k and v stay within bf16 tolerance of eager."""
    from surgery.examples import tiny_sdpa

    built: list[str] = []
    real = PiecewiseGroup._compile_piece

    def compile_piece(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        built.append(self.plan.backend)
        return real(self, gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", compile_piece)
    torch.manual_seed(0)
    model = tiny_sdpa().cuda().eval()
    ref = copy.deepcopy(model)
    manifest = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    # the regions the rule touches (the others would only add inductor builds to the test)
    manifest.regions = [r for r in manifest.regions if r.kind in ("piecewise", "frame_block")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest)
    stream_against_eager(model, ref, frames=20)
    frames = [handle.report.by_path(f"aggregator.frame_blocks.{i}") for i in (0, 1)]
    recs = [handle.report.by_path(p) for p in (*TRUNK, *GLOBAL)]
    detail = [(r.path, r.status, r.backend, r.pieces_compiled, r.pieces_shared,
               r.cuda_graph_replays) for r in (*frames, *recs)]
    assert all(r.status == "compiled" and r.backend == "aot_eager" for r in (*frames, *recs)), \
        detail
    assert built and set(built) == {"aot_eager"}, built  # no inductor build of any piece
    assert sum(r.pieces_compiled for r in (*frames, *recs)) == 3, detail  # RopeBlock 2, trunk 1
    assert all(r.cuda_graph_replays > 0 for r in (*frames, *recs)), detail
    handle.restore()
