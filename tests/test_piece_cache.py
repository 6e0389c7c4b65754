"""surgery.runtime.piece_cache: a piece that is the same code on the same input layout is compiled
once, across the graphs of a growing list cache and across blocks; region graphs too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn

from surgery.runtime.piece_cache import PieceCache, canonical_graph, piece_key
from surgery.runtime.piecewise import PiecewiseGroup
from tests.test_graphs import FakeCapturer
from tests.test_piecewise import install_rope_stack

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _graph(fn: Any) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def norm_then_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (4,)) * w


def same_with_other_names(inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(inp, (4,)) * weight


def other_eps(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (4,), eps=1e-3) * w


def test_key_names_by_position_and_tells_layouts_and_state_apart() -> None:
    a, b = _graph(norm_then_scale), _graph(same_with_other_names)
    x, w = torch.randn(2, 4), torch.randn(4)
    assert canonical_graph(a) == canonical_graph(b)  # names do not matter, positions do
    assert piece_key(a, [x, w], [1]) == piece_key(b, [x, w], [1])
    assert piece_key(a, [x, w], [1]) != piece_key(_graph(other_eps), [x, w], [1])  # a constant
    assert piece_key(a, [x, w], [1]) != piece_key(a, [torch.randn(3, 4), w], [1])  # a shape
    assert piece_key(a, [x, w], [1]) != piece_key(a, [x.t().contiguous().t(), w], [1])  # strides
    assert piece_key(a, [x, w], [1]) != piece_key(a, [x.double(), w.double()], [1])  # dtype
    assert piece_key(a, [x, w], [1]) != piece_key(a, [x, w], [])  # which inputs are weights
    outside = piece_key(a, [x, w], [1])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the compile bakes in
        assert piece_key(a, [x, w], [1]) != outside
    with torch.no_grad():
        assert piece_key(a, [x, w], [1]) != outside


def _method_graph(method: str, *args: Any) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_method(method, (x, *args)))
    return fx.GraphModule(nn.Module(), g)


def test_a_lone_size_sequence_is_the_same_op_as_spread_sizes() -> None:
    """``x.reshape(x.shape)`` (dynamo writes the tuple) is ``x.reshape(b, n, c)``: the camera
    trunk's piece after attention and the global blocks' differed only there."""
    spread = canonical_graph(_method_graph("reshape", 1, 6, 32))
    assert canonical_graph(_method_graph("reshape", (1, 6, 32))) == spread
    assert canonical_graph(_method_graph("reshape", [1, 6, 32])) == spread
    assert canonical_graph(_method_graph("view", (1, 6, 32))) == \
        canonical_graph(_method_graph("view", 1, 6, 32))
    assert canonical_graph(_method_graph("reshape", (1, 6, 32))) != \
        canonical_graph(_method_graph("reshape", 1, 192))  # other sizes stay apart
    assert canonical_graph(_method_graph("view", torch.float16)) != \
        canonical_graph(_method_graph("view", torch.bfloat16))  # a dtype view is untouched
    assert canonical_graph(_method_graph("flatten", (1, 2))) != \
        canonical_graph(_method_graph("flatten", 1, 2))  # not a size method


def test_state_outside_the_inputs_is_never_shared() -> None:
    lin = _graph(nn.Linear(4, 4))  # its weight is a get_attr: not an input
    assert canonical_graph(lin) is None
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.add, (x, torch.ones(2))))  # a tensor constant
    assert canonical_graph(fx.GraphModule(nn.Module(), g)) is None
    assert piece_key(_graph(norm_then_scale), [torch.randn(2, 4), object()], []) is None
    cache = PieceCache(lambda gm, args: gm.forward)
    fns = [cache.get(lin, [torch.randn(2, 4)], [])[0] for _ in range(2)]
    assert fns[0] is not fns[1] and cache.compiles == 2 and cache.shared == 0


def test_list_cache_graphs_share_pieces_and_each_path_its_region_graphs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A list cache gives one dynamo graph per length that compiles: the first frame's and the
    full window's. Their pieces are the same two (the join of this frame's k, v with the cache
    runs between pieces even when the cache is empty), compiled once each, and each path keeps
    one set of region graphs per distinct piece, not per graph. A second stream compiles
    nothing: the length it passes through while filling never holds two calls in a row."""
    compiled: list[int] = []
    inner = PiecewiseGroup._compile_piece

    def counting(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        compiled.append(len(example))
        return inner(self, gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", counting)
    model, ref, slots = install_rope_stack(FakeCapturer())
    group = slots[0].group
    with torch.inference_mode():
        for s in range(12):
            if s == 8:  # a new stream: lengths 0 and 1 come back
                for blk in (*model.blocks, *ref.blocks):
                    blk.attn.kv_cache.clear()
            x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(s))
            torch.testing.assert_close(model(x), ref(x))
            if s == 7:
                first_stream = len(group.graphs)
    pieces = sum(len(g.static) for g in group.graphs)
    assert first_stream == len(group.graphs) == 2  # lengths 0 and 2 (window 2)
    assert pieces == 4  # 2 a graph
    assert len(compiled) == group.pieces.compiles == 2  # the same two pieces in both graphs
    assert group.pieces.shared == pieces - len(compiled)
    recs = [s.record for s in slots]
    assert sum(r.pieces_compiled for r in recs) == len(compiled)
    assert sum(r.pieces_shared for r in recs) == pieces - len(compiled)
    assert all(r.new_structure_calls == 3 for r in recs)  # length 1 twice, length 2 once
    for slot in slots:
        assert len(slot.graphs.graphs) == len(compiled)  # region graphs per distinct piece
        assert slot.record.cuda_graph_replays >= 8


def _qkv_then(order: str) -> Any:
    """q, k, v from x by the same ops, then joined in ``order`` (a split op), then scaled."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        q, k, v = x * 3, x * 2, x + 1
        parts = {"q": q, "k": k, "v": v}
        return torch.cat([parts[c] for c in order], dim=-1) * 2
    return fn


def test_pieces_that_differ_only_in_their_users_order_share_one_compile() -> None:
    """The same ops before a split op give one piece whatever order the split op reads their
    values in (a frame block reads q, k, v; a streaming block's cache join reads k, v first):
    the piece returns them in the order it computes them, and each caller gets its own order."""
    from surgery.runtime.piecewise_split import PiecewiseGraph

    cache = PieceCache(lambda gm, args: gm.forward)
    x = torch.randn(2, 4)
    for order in ("qkv", "vkq", "kvq"):
        fn = _qkv_then(order)
        gm = fx.symbolic_trace(fn)
        graph = PiecewiseGraph(gm, [x], split_ops=("cat",), cache_ids=set(), stable_ids=set(),
                               pieces=cache, state_for=lambda: None)
        assert len(graph.static) == 2  # q, k, v before the cat; the scale after it
        torch.testing.assert_close(graph(x), fn(x))  # each caller gets its own order
    assert cache.compiles == 2 and cache.shared == 4  # the same two pieces, three times
