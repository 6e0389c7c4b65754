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
nodes run between pieces as an FX module, op by op (eagerly).

One FX graph may serve several region paths (identical blocks share compiled code), so the
per-path state (graphs, counts) is looked up from the path whose call is running.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from surgery.formats.manifest import PIECEWISE_DEFAULT_SPLIT_OPS, PIECEWISE_SPLIT_OPS
from surgery.runtime.graphs.capture import Capturer
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.piece_cache import CompiledPiece, PieceCache

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


def canonical_output(gm: fx.GraphModule) -> tuple[bool, tuple[int, ...] | None]:
    """Make the piece return a tuple (backends require one), its values in the order the graph
    computes them. Returns (whether it returned one value, the permutation ``perm`` with
    ``returned[i] = canonical[perm[i]]``, None when the order is kept)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    if not isinstance(value, tuple | list):
        out.args = ((value,),)
        gm.recompile()
        return True, None
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    if not all(isinstance(v, fx.Node) for v in value) or len(set(value)) != len(value):
        return False, None  # a constant or a value returned twice: keep the order
    ordered = sorted(value, key=pos.__getitem__)
    if ordered == list(value):
        return False, None
    out.args = (tuple(ordered),)
    gm.recompile()
    return False, tuple(ordered.index(v) for v in value)


def _is_work(gm: fx.GraphModule) -> bool:
    return any(n.op.startswith("call") and not _free(n) for n in gm.graph.nodes)


def _ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call"))


class PiecewiseGraph:
    """One dynamo graph split into pieces; called by dynamo as the compiled graph.

    ``state_for()`` gives the running path's PathPieces (its region graphs and counts).
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                 split_ops: Sequence[str], cache_ids: set[int], stable_ids: set[int],
                 pieces: PieceCache, state_for: Callable[[], PathPieces | None]) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        cache_inputs = {n.name for n, e in zip(placeholders, example_inputs, strict=False)
                        if id(e) in cache_ids}
        stable = {n.name for n, e in zip(placeholders, example_inputs, strict=False)
                  if id(e) in stable_ids or isinstance(e, nn.Parameter)}
        hoist_sizes(gm)
        between = _merge_free_runs(classify(gm, split_ops=split_ops, cache_inputs=cache_inputs))
        part: dict[fx.Node, int] = {}
        pid, last = 0, None
        for node, b in between.items():
            if last is not None and b != last:
                pid += 1
            part[node], last = pid, b
        kinds = {part[n]: b for n, b in between.items()}
        self.split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
        self.state_for = state_for
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
            self.static.append(piece)
            setattr(self.split, node.target, piece)

    @property
    def pieces(self) -> int:
        """Static pieces that do work (what "pieces" counts in reports)."""
        return sum(1 for p in self.static if p.work)

    def __call__(self, *args: Any) -> Any:
        return self.split(*args)


class PathPieces:
    """One region path's view of the pieces: its region graphs and what it counted."""

    def __init__(self, module: nn.Module, capturer: Capturer | None, *, warn: Callable[[str], None],
                 notes: list[str], label: str = "") -> None:
        self.module = module
        self.label = label  # the region path, for its pieces' notes
        self.capturer = capturer
        self.warn = warn
        self.notes = notes
        # a distinct piece (its key, or its id when it has none) -> its graphs
        self.graphs: dict[Any, tuple[RegionGraphs, _PieceCall]] = {}
        self.piece_runs = 0  # static pieces run (replayed or not)
        self.compiled = 0  # pieces this path compiled
        self.shared = 0  # pieces this path found compiled (surgery.runtime.piece_cache)
        self.compile_s = 0.0  # seconds this path spent compiling pieces
        self.disabled = ""  # as RegionGraphs: each piece's own graphs say why they stopped

    @property
    def replays(self) -> int:
        return sum(g.replays for g, _ in self.graphs.values())

    @property
    def captures(self) -> int:
        return sum(g.captures for g, _ in self.graphs.values())

    @property
    def capture_s(self) -> float:
        return sum(g.capture_s for g, _ in self.graphs.values())

    def drop(self, why: str) -> None:
        for g, _ in self.graphs.values():
            g.drop(why)
        self.graphs.clear()


class _PieceCall:
    """What a RegionGraphs calls for one piece and path: the compiled piece with the path's
    current parameters put back among the copied inputs."""

    def __init__(self, piece: StaticPiece) -> None:
        self.piece = piece
        self.stable: list[Any] = []
        self.ptrs: list[int] = []

    def merge(self, args: Sequence[Any]) -> list[Any]:
        it, st = iter(args), iter(self.stable)
        pos = self.piece.stable_set
        return [next(st) if j in pos else next(it) for j in range(self.piece.arity)]

    def raw(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.piece.run_canonical(self.merge(args))

    def run_compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        return self.piece.run_canonical(self.merge(args)), True


class StaticPiece(nn.Module):
    """A fixed-shape piece: compiled on its first call, replayed from a path's region graphs."""

    def __init__(self, index: int, gm: fx.GraphModule, stable_pos: list[int],
                 pieces: PieceCache, owner: PiecewiseGraph) -> None:
        super().__init__()
        self.index = index
        self.gm = gm
        self.stable_pos = stable_pos
        self.stable_set = frozenset(stable_pos)
        self.arity = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        self._pieces = [pieces]  # a list: not a submodule
        self._fn: CompiledPiece | None = None
        self.key: Any = None  # what makes it interchangeable with other pieces (piece_cache)
        # its values come back in the graph's order (canonical_output); put back per caller
        self._single, self._perm = canonical_output(gm)
        self.work = True
        self._owner = [owner]

    def ensure(self, args: Sequence[Any], state: PathPieces | None) -> CompiledPiece:
        """The compiled piece: compiled now, or the callable of an identical piece."""
        if self._fn is None:
            t0 = time.perf_counter()
            self._fn, key, fresh = self._pieces[0].get(self.gm, list(args), self.stable_pos)
            self.key = key if key is not None else ("piece", id(self))
            if state is not None:
                if fresh:
                    state.compiled += 1
                    state.compile_s += time.perf_counter() - t0
                else:
                    state.shared += 1
        return self._fn

    def run_canonical(self, args: list[Any]) -> Any:
        """The compiled piece's outputs, in the canonical order (what region graphs capture:
        identical pieces share them whatever order each caller wants)."""
        return self.ensure(args, None)(*args)  # dynamo's calling convention

    def restore(self, out: Sequence[Any]) -> Any:
        """The outputs as this piece's callers expect them: one value, or the tuple in order."""
        if self._single:
            return out[0]
        return tuple(out) if self._perm is None else tuple(out[p] for p in self._perm)

    def run(self, args: list[Any]) -> Any:
        return self.restore(self.run_canonical(args))

    def forward(self, *args: Any) -> Any:
        state = self._owner[0].state_for()
        if state is None:
            return self.run(list(args))
        state.piece_runs += 1
        fn = self.ensure(args, state)
        if state.capturer is None:
            return self.run(list(args))
        stable = [args[j] for j in self.stable_pos]
        # One set of graphs per distinct piece AND the weights it runs with: the stack region's
        # blocks run one piece code with each block's own parameters (by identity: a parameter
        # moved in place keeps its set, whose graphs are dropped below). The graphs return the
        # canonical outputs, so one piece's graphs serve every identical piece.
        gkey = (self.key, tuple(id(t) for t in stable))
        entry = state.graphs.get(gkey)
        if entry is None:
            call = _PieceCall(self)
            graphs = RegionGraphs(nn.Module(), state.capturer, call.raw, clone_outputs=False,
                                  warn=state.warn, notes=state.notes,
                                  label=f"{state.label} (piece {len(state.graphs)})")
            if fn.runs > 0:  # it ran already (in another graph or path): capture at once
                graphs.ready = lambda args, kwargs: True
            entry = state.graphs[gkey] = (graphs, call)
        graphs, call = entry
        ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else id(t) for t in stable]
        if ptrs != call.ptrs:  # new or moved parameters: graphs baked the old addresses
            if call.ptrs:
                graphs.drop("a piece's parameters or buffers moved")
            call.stable, call.ptrs = stable, ptrs
        dynamic = tuple(a for j, a in enumerate(args) if j not in self.stable_set)
        return self.restore(graphs(dynamic, {}, call.run_compiled))

