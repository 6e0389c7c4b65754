"""The piecewise backend: split a block's one dynamo graph at its cache-dependent ops, compile
the fixed-shape pieces, and run them as surgery's region graphs (surgery.runtime.piecewise has
the design; this module is the FX side of it).

Which op goes *between* pieces (a "split node"), decided once per FX graph dynamo hands over:

- its target is a split op named by the manifest (``scaled_dot_product_attention`` by default);
- an input or its output has a symbolic (dynamic) size, or it is a SymInt computation: the
  dims the runtime marked dynamic, the cache length, flow through it;
- it reads a graph input that came from the block's cache (the tensors the runtime found at
  the cache sources the manifest names), e.g. the ``cat`` that appends to a cache;
- it joins tensors (``cat``, ``stack``) and one of them is also a graph output: a tensor this
  call stores in the block's state, so the join reads the cache *with* this call's entry. With
  an empty cache (a stream's first frame) that join has no cache input, and without this rule
  it would sit inside the piece before attention, making that piece differ from every later
  frame's: one more compile of the block's largest piece.

Every other op is static. A piece returns its values in the order they are computed (not the
order split_module happened to discover their users), so that the same ops give the same piece
whoever uses its outputs (a frame block's and a streaming block's projections before attention).
 Runs of consecutive ops of one class become one piece
(``torch.fx.passes.split_module``, order kept), so pieces follow program order and never form a
cycle. A static piece has fixed shapes: it is compiled with the manifest's backend on its first
call (with that call's real tensors), once per distinct piece (surgery.runtime.piece_cache: the
pieces of every graph and block that are the same code on the same input layout share one
callable) and, with CUDA and ``capture = "region"``, captured and replayed by a RegionGraphs per
region path and distinct piece. Its parameters and buffers are read in place, never
copied: the graph bakes their addresses, and a moved one drops that path's graphs. The split
nodes run between pieces op by op (eagerly), inlined into the split graph's own forward
(surgery.runtime.piece_replay has the call-time side: graphs per piece, checks, glue). Before
the split, the SDPAs that read one dynamic boolean mask get one additive mask, converted once a
call (surgery.runtime.piece_masks), instead of each converting and padding it.

One FX graph may serve several region paths (identical blocks share compiled code), so the
per-path state (graphs, counts) is looked up from the path whose call is running.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from surgery.formats.manifest import PIECEWISE_DEFAULT_SPLIT_OPS, PIECEWISE_SPLIT_OPS
from surgery.runtime import piece_replay
from surgery.runtime.compile_start import launch_bound, light_allowed, light_pieces, size_note
from surgery.runtime.piece_cache import PieceCache, canonical_graph
from surgery.runtime.piece_masks import share_masks
from surgery.runtime.piece_replay import PathPieces, StaticPiece, inline_between

# Ops that always run between pieces: the manifest names some of these (attention by default).
SPLIT_OPS = PIECEWISE_SPLIT_OPS
DEFAULT_SPLIT_OPS = PIECEWISE_DEFAULT_SPLIT_OPS
# Node targets that are bookkeeping, not work: a piece made only of these is not counted.
_FREE = {operator.getitem, "view", "reshape", "transpose", "permute", "contiguous", "size",
         "unsqueeze", "squeeze", "flatten", "expand"}


def op_name(node: fx.Node) -> str:
    """The name an op is known by: ``torch.cat`` -> "cat", ``x.index_copy_`` -> "index_copy_"."""
    t = node.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", "") or str(t)
    return name.split(".")[-1]


def _symbolic(value: Any) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in value.shape)
    if isinstance(value, list | tuple):
        return any(_symbolic(v) for v in value)
    return False


# Ops that join tensors: one that joins a tensor the call also stores reads the cache.
_JOINS = frozenset({"cat", "concat", "concatenate", "stack"})


def classify(gm: fx.GraphModule, *, split_ops: Sequence[str], cache_inputs: set[str]
             ) -> dict[fx.Node, bool]:
    """For each call node: True if it runs between pieces (see the module docstring)."""
    ops = set(split_ops)
    returned = {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    out: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        why = op_name(node) in ops or _symbolic(node.meta.get("example_value")) or (
            op_name(node) in _JOINS and not returned.isdisjoint(node.all_input_nodes))
        for arg in node.all_input_nodes:
            if why:
                break
            why = _symbolic(arg.meta.get("example_value")) or (
                arg.op == "placeholder" and arg.name in cache_inputs)
        out[node] = bool(why)
    return out


# Size arithmetic that only reads metadata (never data): safe to run before anything else.
_SIZE_OPS = {"numel", "size", "sym_size", "sym_numel", "sym_sum", "dim", "add", "sub", "mul",
             "floordiv", "neg"}


def hoist_sizes(gm: fx.GraphModule) -> int:
    """Move size arithmetic on graph inputs (a decoder stack's ``cache.get_seq_length()``) to the
    top, so it runs before the first piece instead of cutting it in two; returns how many moved.
    Only SymInt results of metadata ops whose inputs are inputs or moved nodes: they read no
    tensor data, so an in-place write later in the graph cannot change them."""
    anchor = None
    moved: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            anchor = node
            continue
        if anchor is None or node.op not in ("call_function", "call_method") or \
                op_name(node) not in _SIZE_OPS or \
                not isinstance(node.meta.get("example_value"), torch.SymInt) or \
                not all(a.op == "placeholder" or a in moved for a in node.all_input_nodes):
            continue
        if node.prev is not anchor:
            anchor.append(node)
        anchor = node
        moved.add(node)
    if moved:
        gm.graph.lint()
        gm.recompile()
    return len(moved)


def drop_dead_sizes(gm: fx.GraphModule) -> int:
    """Erase size arithmetic whose result nothing uses (dynamo leaves some: a decoder stack's
    ``sym_sum`` per layer, a cache's ``numel``), which would otherwise run between pieces every
    call; returns how many. Only ops of ``_SIZE_OPS`` with an int or SymInt result: they read
    metadata only and write nothing, so erasing one cannot change what the graph computes (a
    general dead-code pass could: FX counts an in-place method such as ``index_copy_`` as pure)."""
    dropped = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method") or \
                op_name(node) not in _SIZE_OPS or \
                not isinstance(node.meta.get("example_value"), int | torch.SymInt):
            continue
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped


def _free(node: fx.Node) -> bool:
    return node.target in _FREE or op_name(node) in _FREE


def _merge_free_runs(between: dict[fx.Node, bool]) -> dict[fx.Node, bool]:
    """A static run of bookkeeping ops only (a view, a transpose) joins the ops between pieces:
    as a piece of its own it would cost a graph and capture nothing (it returns views)."""
    out = dict(between)
    run: list[fx.Node] = []
    for node, b in [*between.items(), (None, True)]:
        if b:
            if run and all(_free(n) for n in run):
                out.update(dict.fromkeys(run, True))
            run = []
        else:
            run.append(node)  # type: ignore[arg-type]
    return out


def _work(gm: fx.GraphModule) -> int:
    """The ops of a piece that do work (not views, sizes or tuple indexing)."""
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call") and not _free(n))


def _is_work(gm: fx.GraphModule) -> bool:
    return _work(gm) > 0


def _ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call"))


def _elements(value: Any) -> int | None:
    """The elements of the largest tensor in a node's value (0: none; None: not known, or
    symbolic)."""
    if isinstance(value, torch.Tensor):
        n = value.numel()
        return n if isinstance(n, int) else None
    if isinstance(value, list | tuple):
        sizes = [_elements(v) for v in value]
        return None if None in sizes else max(sizes, default=0)  # type: ignore[type-var]
    if value is None or isinstance(value, int | float | bool | str | torch.dtype |
                                   torch.device | torch.Size):
        return 0
    return None


def largest_activations(between: dict[fx.Node, bool], part: dict[fx.Node, int],
                        stable: set[str]) -> dict[int, int | None]:
    """Per static part: the elements of its largest activation, each op's output and each
    input that is not a parameter or buffer (a graph input in ``stable``, or a ``get_attr``);
    None where a value is not known (compile_start's size rule then leaves it alone)."""
    out: dict[int, int | None] = {}
    for node, b in between.items():
        if b:
            continue
        idx = part[node]
        values = [node, *(a for a in node.all_input_nodes if a.op != "get_attr"
                          and not (a.op == "placeholder" and a.name in stable))]
        for v in values:
            n = _elements(v.meta["example_value"]) if "example_value" in v.meta else None
            have = out.get(idx, 0)
            out[idx] = None if n is None or have is None else max(have, n)
    return out


class PiecewiseGraph:
    """One dynamo graph split into pieces; called by dynamo as the compiled graph.

    ``state_for()`` gives the running path's PathPieces (its region graphs and counts).
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                 split_ops: Sequence[str], cache_ids: set[int], stable_ids: set[int],
                 pieces: PieceCache, state_for: Callable[[], PathPieces | None],
                 backend: str | None = None, group: int = 0, paths: int = 1) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        cache_inputs = {n.name for n, e in zip(placeholders, example_inputs, strict=False)
                        if id(e) in cache_ids}
        stable = {n.name for n, e in zip(placeholders, example_inputs, strict=False)
                  if id(e) in stable_ids or isinstance(e, nn.Parameter)}
        hoist_sizes(gm)
        self.dead_sizes = drop_dead_sizes(gm)  # before the split: never run between pieces
        self.masks_shared = share_masks(gm)  # SDPAs that read one additive mask (piece_masks)
        between = _merge_free_runs(classify(gm, split_ops=split_ops, cache_inputs=cache_inputs))
        part: dict[fx.Node, int] = {}
        pid, last = 0, None
        for node, b in between.items():
            if last is not None and b != last:
                pid += 1
            part[node], last = pid, b
        kinds = {part[n]: b for n, b in between.items()}
        largest = largest_activations(between, part, stable)
        self.split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
        self.state_for = state_for
        self.local = threading.local()  # .state: the running path's, while a run lasts
        self.static: list[StaticPiece] = []
        self.between_ops = 0  # ops a call runs between pieces
        self.split_ops_seen: list[str] = sorted({op_name(n) for n, b in between.items() if b})
        for node in self.split.graph.nodes:
            if node.op != "call_module":
                continue
            sub = getattr(self.split, node.target)
            idx = int(str(node.target).rsplit("_", 1)[1])
            if kinds.get(idx, True):
                self.between_ops += _ops(sub)
                continue
            stable_pos = [j for j, a in enumerate(node.args)
                          if isinstance(a, fx.Node) and a.op == "placeholder" and a.name in stable]
            piece = StaticPiece(len(self.static), sub, stable_pos, pieces, self)
            piece.work = _is_work(sub)
            piece.largest = largest.get(idx)
            self.static.append(piece)
            setattr(self.split, node.target, piece)
        # static pieces that do work (what "pieces" counts in reports; read every run)
        self.pieces = sum(1 for p in self.static if p.work)
        # a piecewise region's graph (``backend``: its plan's) may have light pieces: pieces
        # that hold a small share of its work, replayed as graphs (compile_start)
        path = state_for()
        if backend is not None and light_allowed(backend, getattr(path, "capturer", None)
                                                 is not None):
            sizes = [p.largest for p in self.static]
            codes = [(canonical_graph(p.gm), _work(p.gm)) for p in self.static]
            flags = light_pieces(codes, sizes)
            # or a small share of all the apply's piecewise pieces (piece_cache.PieceWork)
            across = pieces.work.light(group, paths, codes)
            for p, flag, small in zip(self.static, flags, across, strict=True):
                p.light = flag or small
            by_size = sum(s and p.work for s, p in zip(launch_bound(sizes), self.static,
                                                       strict=True))
            note = size_note(by_size, self.pieces)
            if by_size and path is not None and note not in path.notes:
                path.notes.append(note)
        self.inlined = inline_between(self.split, {p.gm for p in self.static})
        # its weight inputs, checked once a run (PathPieces.begin), all tensors or not at all
        at = [i for i, (n, e) in enumerate(zip(placeholders, example_inputs, strict=False))
              if n.name in stable]
        tensors = bool(at) and all(isinstance(example_inputs[i], torch.Tensor) for i in at)
        self.weights = operator.itemgetter(*at) if tensors and len(at) > 1 else None


    def __call__(self, *args: Any) -> Any:
        # The running path's state, looked up once per run for every piece (StaticPiece reads
        # ``local.state``), per thread as state_for() is; put back after, so a nested run leaves
        # the outer one its own.
        local = self.local
        prev, local.state = getattr(local, "state", None), self.state_for()
        was, state, marks = getattr(local, "steady", False), local.state, None
        local.steady = False
        if state is not None and state.capturer is not None and self.weights is not None \
                and piece_replay.WEIGHTS_ONCE_A_RUN:
            local.steady, marks = state.begin(id(self), self.weights(args))  # once a run
        try:
            out = self.split(*args)
        finally:
            local.state, local.steady = prev, was
        if marks is not None:
            state.end(id(self), marks)
        return out
