"""surgery.runtime.shared_pieces: an ordinary region of a piecewise block's class is built from
that block's compiled pieces (the SDPA example's frame blocks and global blocks are both
RopeBlock), so the piecewise plan does not compile the same code twice."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
from torch import fx

from surgery.examples import tiny_sdpa
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs.outputs import SHARED_SET_NOTE
from surgery.runtime.groups import _CountingBackend
from surgery.runtime.piecewise import PiecewiseGroup
from surgery.runtime.piecewise_split import op_name
from tests.test_graphs import fake_cuda  # noqa: F401 (a fixture: the stand-in capturer)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FRAME = ["aggregator.frame_blocks.0", "aggregator.frame_blocks.1"]
GLOBAL = ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]
PATCH = ["aggregator.patch_embed.blocks.0", "aggregator.patch_embed.blocks.1"]
SPLIT = {"split_ops": ["scaled_dot_product_attention"], "dynamic": ["self.attn.kv_cache"]}


def _manifest(model: torch.nn.Module, *, piecewise: bool, backend: str = "aot_eager"
              ) -> Manifest:
    regions = [Region("patch_embed_block", PATCH), Region("frame_block", FRAME)]
    if piecewise:
        regions.append(Region("piecewise", GLOBAL, piecewise=dict(SPLIT)))
    return Manifest(compute_fingerprint(model.state_dict()), regions,
                    compile={**DEFAULT_COMPILE, "backend": backend, "on_cpu": "compile"})


def _count_compiles(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """(nodes of each piece compiled, nodes of each graph an ordinary group compiled whole)."""
    pieces: list[int] = []
    whole: list[int] = []
    piece, backend = PiecewiseGroup._compile_piece, _CountingBackend.__call__

    def compile_piece(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        pieces.append(len(gm.graph.nodes))
        return piece(self, gm, example)

    def counting(self: _CountingBackend, gm: fx.GraphModule, example: list[Any]) -> Any:
        split = self.shared.split_ops if self.shared is not None else ()
        if not any(op_name(n) in split for n in gm.graph.nodes if n.op.startswith("call")):
            whole.append(len(gm.graph.nodes))
        return backend(self, gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", compile_piece)
    monkeypatch.setattr(_CountingBackend, "__call__", counting)
    return pieces, whole


def _applied(*, piecewise: bool, backend: str = "aot_eager", device: str = "cpu"
             ) -> tuple[Any, Any, Any]:
    """(the tiny SDPA model with the manifest applied, an eager copy of it, the handle)."""
    torch.manual_seed(0)
    model = tiny_sdpa().to(device).eval()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, _manifest(model, piecewise=piecewise, backend=backend))
    return model, ref, handle


def _stream(model: Any, ref: Any, frames: int, *, inference: bool = False, **tol: float) -> None:
    """``frames`` frames through both models, outputs compared: under no_grad with bf16
    autocast, or (``inference``) under inference_mode in the model's own dtype."""
    mode = torch.inference_mode() if inference else torch.no_grad()
    cast = contextlib.nullcontext() if inference else torch.autocast("cpu", dtype=torch.bfloat16)
    with mode, cast:
        for s in range(frames):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k], **tol)


def test_frame_blocks_are_built_from_the_global_blocks_pieces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frame blocks (ordinary) and global blocks (piecewise) are both RopeBlock: the frame block
    compiles its two pieces (before and after attention) and the global blocks compile none;
    a patch-embed block (another class) still compiles whole. Outputs match eager."""
    pieces, whole = _count_compiles(monkeypatch)
    model, ref, handle = _applied(piecewise=True)
    _stream(model, ref, 6)
    frame, glob = handle.report.by_path(FRAME[0]), handle.report.by_path(GLOBAL[0])
    assert frame.status == glob.status == "compiled", (frame.reason, glob.reason)
    assert frame.pieces_compiled == 2 and frame.pieces_shared == 0
    assert glob.pieces_compiled == 0 and glob.pieces_shared >= 2
    assert len(pieces) == 2  # the block's code, compiled once for both kinds of block
    assert sum(pieces) > 100  # (the whole block, split at attention)
    patch = handle.report.by_path(PATCH[0])
    assert patch.status == "compiled" and patch.pieces_compiled == 0
    assert len(whole) == 1  # the patch-embed block, compiled whole


def test_without_a_piecewise_region_the_frame_block_compiles_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A names plan (no piecewise region): nothing is split, nothing changes."""
    pieces, whole = _count_compiles(monkeypatch)
    model, ref, handle = _applied(piecewise=False)
    _stream(model, ref, 2)
    assert pieces == [] and len(whole) == 2  # the patch-embed block and the frame block
    assert handle.report.by_path(FRAME[0]).pieces_compiled == 0


def _replayed_from_the_second_call(handle: Any) -> None:
    """Every call of a frame block after its first replays or captures: none runs uncaptured."""
    for p in FRAME:
        rec = handle.report.by_path(p)
        assert rec.status == "compiled", rec.reason
        assert rec.calls == 8 and rec.cuda_graph_replays >= 5, (p, rec.calls, rec.notes)
        assert rec.calls == 1 + rec.graphs_captured + rec.cuda_graph_replays, \
            (p, rec.graphs_captured, rec.cuda_graph_replays, rec.notes)
    # The second frame block reads the first global block's output, which that block's last
    # piece writes into the output set it shares with the frame block (graphs.arena: a path's
    # first set is any set nobody holds). The frame block clones its outputs; once the global
    # block's window is full (the 5th frame) and its pieces capture, that set is held whenever
    # the frame block replays: it captures a set of its own, once (it used to run uncaptured
    # from then on, silently: 3 replays in 8 frames on the H200).
    second, glob = handle.report.by_path(FRAME[1]), handle.report.by_path(GLOBAL[0])
    assert glob.graphs_captured > 0 and second.clone_outputs
    assert second.graphs_captured == 2 and SHARED_SET_NOTE in second.notes, second.notes


@pytest.mark.usefixtures("fake_cuda")
def test_shared_frame_block_keeps_replaying_once_the_global_blocks_capture() -> None:
    """The cuda test below, on the CPU with the stand-in capturer."""
    model, ref, handle = _applied(piecewise=True)
    _stream(model, ref, 8, inference=True)
    _replayed_from_the_second_call(handle)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_shared_frame_block_is_captured_whole_and_replays_on_cuda(backend: str) -> None:
    """On CUDA the frame block's region graph captures the whole call (both pieces and the
    attention between them), from its second call on, outputs within tolerance."""
    model, ref, handle = _applied(piecewise=True, backend=backend, device="cuda")
    _stream(model, ref, 8, inference=True, rtol=1e-4, atol=1e-4)
    _replayed_from_the_second_call(handle)
    assert handle.report.by_path(FRAME[0]).pieces_compiled == 2
    assert handle.report.by_path(GLOBAL[0]).pieces_compiled == 0
