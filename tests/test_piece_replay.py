"""The call-time side of piecewise pieces (surgery.runtime.piece_replay), on a decoder stack
(GPT-2 from transformers through generate(), a stand-in capturer whose graphs replay the work):
the glue between pieces runs inlined in one forward, and the cheaper per-replay checks still
catch what they must (moved weights, replaced weights), tokens identical to eager."""

from __future__ import annotations

import copy
import os
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import fx, nn

import surgery
from surgery.runtime.apply import apply_manifest
from surgery.runtime.piece_replay import StaticPiece, inline_between
from surgery.runtime.piecewise_split import drop_dead_sizes
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


class _CountingDict(dict):  # type: ignore[type-arg]
    gets = 0

    def get(self, *a: Any) -> Any:
        self.gets += 1
        return super().get(*a)


def test_steady_decode_checks_the_weights_once_a_run_not_once_a_piece() -> None:
    """While the split graph's weight inputs are the same objects at the same addresses as in
    its last complete run, no piece looks its graphs up by its weights again (each replays the
    entry it validated); a weight moved in place sends every piece through the full checks."""
    model, ref, slot, rec = installed_stack()
    with torch.inference_mode():
        warm(model, ref, rec)
        counting = slot.graphs.graphs = _CountingDict(slot.graphs.graphs)
        replays = rec.cuda_graph_replays
        same_as_eager(generate(model, IDS, 8), generate(ref, IDS, 8))
        assert rec.cuda_graph_replays - replays >= 7 * 3, rec.notes  # 7 decode steps replayed
        assert counting.gets == 0
        for m in (model, ref):
            w = m.transformer.h[1].mlp.c_fc.weight
            w.data = w.data * 0.5
        same_as_eager(generate(model, IDS, 8), generate(ref, IDS, 8))
        assert counting.gets >= 3  # that run's pieces took the per-piece checks
    assert any(MOVED in n for n in rec.notes), rec.notes


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


class _FreeGraph:
    """A captured graph whose replay runs nothing: what is left of a piece's call is surgery's."""

    def replay(self) -> None:
        return None


class _FreeCapturer:
    device = -1

    def __init__(self) -> None:
        import weakref

        self.owned: Any = weakref.WeakValueDictionary()

    def capture(self, work: Any) -> _FreeGraph:
        work()  # fills the owned outputs once
        return _FreeGraph()


_MODULE_CALL = (nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__)


def _surgery_frames(fn: Any) -> int:
    """Python frames entered in surgery/ and nn.Module's call path while fn() runs (generator
    resumes included)."""
    root = os.path.dirname(os.path.abspath(surgery.__file__)) + os.sep
    seen = [0]

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and (frame.f_code.co_filename.startswith(root)
                                or frame.f_code in _MODULE_CALL):
            seen[0] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen[0]


def _decode_frames(layers: int) -> tuple[float, float]:
    """(frames, piece replays) per decode token of a stack of ``layers`` blocks."""
    model, _, slot, rec = installed_stack(layers=layers)
    slot.capturer = slot.graphs.capturer = _FreeCapturer()
    with torch.no_grad():
        for _ in range(2):  # the pieces compile, then capture
            generate(model, IDS, 6)
        short = _surgery_frames(lambda: generate(model, IDS, 4))
        mid = rec.cuda_graph_replays
        long = _surgery_frames(lambda: generate(model, IDS, 12))
    # generate(n) runs a prefill (eager) and n - 1 decode steps
    replays = (rec.cuda_graph_replays - mid) / 11
    assert replays == layers + 1, rec.notes  # every piece replays
    return (long - short) / 8, replays


def test_a_decode_token_costs_few_surgery_frames_per_piece_replay() -> None:
    """On a host-bound decode each Python frame of a piece's call repeats ~13 times a token
    (GPT-2 small). A replay enters the piece and its region graphs directly: no nn.Module call
    path, no generator per output set or per output, no pytree rebuild of the list a compiled
    piece returns, the running path looked up once per graph run. Counted as the frames a
    block adds to a decode token (the stack's own call cancels out): at most REPLAY_FRAMES
    (about 20 before, and a pytree rebuild's frames outside surgery; 6 before steady plans)."""
    f2, r2 = _decode_frames(2)
    f4, r4 = _decode_frames(4)
    per_replay = (f4 - f2) / (r4 - r2)
    # StaticPiece.__call__, its steady plan (graphs.steady), _restore_fast; without the plan
    # RegionGraphs.__call__, plain_signature, _replay, held, hand_out (6)
    assert per_replay <= REPLAY_FRAMES, (f2, f4, r2, r4)


REPLAY_FRAMES = 3


def test_dead_size_arithmetic_is_dropped_and_nothing_else() -> None:
    """Size arithmetic nothing uses (dynamo leaves a ``sym_sum`` per layer and a ``numel`` in a
    decoder stack's graph) is erased before the split, so it never runs between pieces; an
    in-place method whose result is unused (a cache write) is NOT erased, which a general
    dead-code pass would do (FX counts call_method as pure)."""
    g = fx.Graph()
    x = g.placeholder("x")
    cache = g.placeholder("cache")
    n = g.call_method("numel", (x,))  # dead
    s = g.call_function(torch.sym_sum, ([n, 1],))  # dead, and makes n dead too
    written = g.call_method("add_", (cache, x))  # dead result, live effect
    size = g.call_method("size", (x, 0))  # used below
    out = g.call_method("view", (x, size))
    g.output(out)
    gm = fx.GraphModule(nn.Module(), g)
    for node, value in ((n, 3), (s, 4), (size, 3)):
        node.meta["example_value"] = value
    written.meta["example_value"] = torch.zeros(3)
    assert drop_dead_sizes(gm) == 2
    kept = [nd.target for nd in gm.graph.nodes if nd.op.startswith("call")]
    assert kept == ["add_", "size", "view"], kept
    c = torch.zeros(3)
    gm(torch.ones(3), c)
    assert torch.equal(c, torch.ones(3))  # the cache write still runs


def test_the_stack_runs_no_dead_size_op_between_pieces() -> None:
    model, ref, slot, rec = installed_stack()
    with torch.inference_mode():
        warm(model, ref, rec)
    (graph,) = slot.group.graphs
    dead = [n.name for n in graph.split.graph.nodes if n.op.startswith("call")
            and not n.users and n.target in (torch.sym_sum, "numel", "size")]
    assert not dead, dead
