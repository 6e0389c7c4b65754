"""The call-time side of piecewise pieces (surgery.runtime.piece_replay), on a decoder stack
(GPT-2 from transformers through generate(), a stand-in capturer whose graphs replay the work):
the glue between pieces runs inlined in one forward, and the cheaper per-replay checks still
catch what they must (moved weights, replaced weights), tokens identical to eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import fx, nn

from surgery.runtime.apply import apply_manifest
from surgery.runtime.piece_replay import StaticPiece, inline_between
from surgery.runtime.report import RegionRecord
from tests.test_piecewise_stack import (
    generate,
    installed_stack,
    same_as_eager,
    stack_plan,
    tiny_gpt2,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
MOVED = "a piece's parameters or buffers moved"


IDS = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))


def warm(model: nn.Module, ref: nn.Module, rec: RegionRecord) -> None:
    """Two generate() calls: the pieces compile, then capture; a third replays them."""
    for _ in range(3):
        same_as_eager(generate(model, IDS, 8), generate(ref, IDS, 8))
    assert rec.cuda_graph_replays > 0 and rec.graphs_captured > 0, rec.notes


def test_glue_between_pieces_runs_inlined_in_one_forward() -> None:
    """The split graph calls only its static pieces: every between-pieces submodule was copied
    into its forward (no GraphModule call per attention), and the tokens and cache are eager's."""
    model, ref, slot, rec = installed_stack()
    with torch.inference_mode():
        warm(model, ref, rec)
    (graph,) = slot.group.graphs
    calls = [n for n in graph.split.graph.nodes if n.op == "call_module"]
    assert calls and all(isinstance(graph.split.get_submodule(str(n.target)), StaticPiece)
                         for n in calls), [n.target for n in calls]
    assert graph.inlined >= 2  # one run of glue per attention, at least
    assert graph.between_ops > 0 and rec.ops_between == graph.between_ops  # still counted


def test_inline_keeps_a_submodule_that_reads_its_own_attributes() -> None:
    """A between submodule with a ``get_attr`` (a constant of its own) is left a call: copying
    its node would read an attribute the parent does not have."""
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("c", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.c

    root = nn.Module()
    root.inner = fx.symbolic_trace(Inner())
    root.plain = fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    g = fx.Graph()
    x_in = g.placeholder("x")
    g.output(g.call_module("plain", (g.call_module("inner", (x_in,)),)))
    outer = fx.GraphModule(root, g)
    x = torch.randn(3)
    want = outer(x)
    assert inline_between(outer, set()) == 1  # the ReLU, not the one with a buffer
    assert [n.target for n in outer.graph.nodes if n.op == "call_module"] == ["inner"]
    assert torch.equal(outer(x), want)


def test_weight_moved_in_place_after_capture_drops_the_pieces_graphs() -> None:
    """``.data = `` keeps the parameter object and moves its memory: the graphs baked the old
    address, so the replay's pointer check must drop them and capture again; the tokens follow
    the new weight (as eager's do)."""
    model, ref, _, rec = installed_stack()
    with torch.inference_mode():
        warm(model, ref, rec)
        captured = rec.graphs_captured
        for m in (model, ref):
            w = m.transformer.h[1].mlp.c_fc.weight
            w.data = w.data * 0.5
        same_as_eager(generate(model, IDS, 8), generate(ref, IDS, 8))
    assert any(MOVED in n for n in rec.notes), rec.notes
    assert rec.graphs_captured > captured  # captured again, with the new address


def test_weight_replaced_after_capture_gets_graphs_of_its_own() -> None:
    """A new parameter object is a new set of weights: its graphs are its own (never the old
    object's), and the tokens follow it."""
    model, ref, _, rec = installed_stack()
    with torch.inference_mode():
        warm(model, ref, rec)
        captured = rec.graphs_captured
        for m in (model, ref):
            lin = m.transformer.h[0].attn.c_proj
            lin.weight = nn.Parameter(lin.weight.detach() * 2)
        same_as_eager(generate(model, IDS, 8), generate(ref, IDS, 8))
    assert rec.graphs_captured > captured
    assert not any(MOVED in n for n in rec.notes), rec.notes  # a new key, not a move


@pytest.mark.cuda
def test_cuda_weight_moved_in_place_between_generates_is_not_read_from_the_old_address() -> None:
    """On CUDA the pieces' graphs bake the weights' addresses: after ``.data = `` on a weight
    (between two generate() calls, graphs captured and replaying), the tokens and cache must be
    those of eager with the new weight, so the pointer check must have dropped and recaptured."""
    model = tiny_gpt2().cuda()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan(), overrides={"backend": "aot_eager"})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    stack = handle.report.by_path("transformer")
    with torch.no_grad():
        for _ in range(2):
            same_as_eager(generate(model, ids), generate(ref, ids), exact=False)
        assert stack.cuda_graph_replays > 0, stack.notes
        captured = stack.graphs_captured
        for m in (model, ref):
            w = m.transformer.h[1].mlp.c_fc.weight
            w.data = w.data * -1.0
        same_as_eager(generate(model, ids), generate(ref, ids), exact=False)
    assert any(MOVED in n for n in stack.notes), stack.notes
    assert stack.graphs_captured > captured
