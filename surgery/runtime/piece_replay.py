"""The static pieces of a piecewise graph at call time: each piece's region graphs per path and
per set of weights, and the glue between pieces (surgery.runtime.piecewise_split splits the
graph; surgery.runtime.piecewise has the design of the region kind).

Why a module of its own. On a host-bound decode (GPT-2 small at batch 1 on an H200 is all host
time) every microsecond of a piece's call repeats ~13-16 times a token. So the per-call path is
written for a few C-level calls, not Python loops, while every check a replay needs stays:

- **Which graphs.** A piece's graphs are found by (its compiled callable, the ids of the
  parameters and buffers it reads). Identical pieces share one compiled callable
  (surgery.runtime.piece_cache), so its id stands for the piece's key: the key itself is a tuple
  of code and layout that Python does not hash-cache, and hashing it every replay cost ~10 us
  on a 2-core CPU. The callable is kept alive by the piece, so its id is never reused while a
  graph keyed by it lives.
- **Moved weights.** The graphs bake the weights' addresses. Before each replay the data
  pointers of the piece's parameters and buffers are compared with those the graphs were
  captured with (one ``map`` over ``Tensor.data_ptr``); a moved one (``.data = ``,
  ``module.to()``) drops that set's graphs, which capture again. A replaced parameter object is
  a new key: graphs of its own.
- **Held outputs.** The replay's held check (surgery.runtime.graphs.outputs) reads each output
  storage's use count through precomputed handles in one pass; a set a caller still holds is
  never overwritten (the ring grows instead).
- **Between pieces.** split_module leaves each run of split ops (attention, cache cats, masks)
  as a submodule of its own, whose call costs two to four Python frames and nn.Module's call
  path. ``inline_between`` copies their ops into the split graph's own forward, in order, so
  the glue runs as one generated function; the ops are the same, so the cache grows as eager.
  A submodule reading attributes of its own stays a call.
- **Inputs.** A piece's weights and its other inputs are picked with ``operator.itemgetter``
  built once per piece, not rebuilt per call.
- **Weights checked once a run, not once a piece.** The split graph reads the ids and data
  pointers of all its weight inputs once per run (``PathPieces.begin``, two C-level ``map``s
  over ~150 parameters on GPT-2 small) and compares them with those of the path's last
  COMPLETE run; when they are equal, every piece replays from the entry it validated in that
  run (same objects, same addresses: what its own key lookup and pointer check would find), and
  skips both. Any difference, a run that raised, or the path's graphs dropped: every piece takes
  the full per-piece checks again. The marks hold the last complete run's weights themselves
  (references, until the next complete run), compared by ``is``: an id per weight built 148
  ints a token (~50 us in the real decode on a 2-core CPU, against ~16 by ``is``). A token of
  the stack did ~13 key builds, dict lookups and pointer lists of ~16 weights each; now one
  pass. The marks and entries are keyed by the ids of split graphs and pieces, which their
  group keeps alive (``PiecewiseGroup.graphs``) as long as the path: an id is never reused
  while a mark or an entry names it.
- **Frames.** The split graph calls a piece directly (``StaticPiece.__call__``, not nn.Module's
  call path: nothing can hook a piece), the running path is looked up once per graph run
  (``PiecewiseGraph.local``, per thread), the list a compiled piece returns is rebuilt by
  ``list`` (not pytree), and the outputs are reordered by ``itemgetter``. In a steady run a
  piece replays by its plan (surgery.runtime.graphs.steady: the same checks in a few C calls):
  three frames of surgery a replay (tests/test_piece_replay.py counts them), against six without
  the plan, about twenty before these cuts, and a pytree rebuild.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from surgery.runtime.graphs.capture import Capturer
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.graphs.steady import SteadyReplay, steady_plan
from surgery.runtime.piece_cache import Piece, PieceCache
from surgery.runtime.piece_restride import RestridedPiece


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


def inline_between(split: fx.GraphModule, keep: set[Any]) -> int:
    """Copy the ops of each between-pieces submodule into ``split``'s own graph, so they run in
    its one forward instead of through a GraphModule call each (two to four Python frames and
    nn.Module's call path: ~10 us a submodule on a 2-core CPU, ~13 submodules a GPT-2 token).
    The ops and their order are unchanged. A submodule that reads attributes or submodules of
    its own (``get_attr``, ``call_module``) stays a call. Returns how many were inlined."""
    graph = split.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or node.kwargs:
            continue
        sub = split.get_submodule(str(node.target))
        if getattr(sub, "gm", None) in keep or not isinstance(sub, fx.GraphModule) or any(
                n.op in ("get_attr", "call_module") for n in sub.graph.nodes):
            continue
        inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        users = list(node.users)
        out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        many = isinstance(out, tuple | list)
        if len(inputs) != len(node.args) or (many and not all(
                u.op == "call_function" and u.target is operator.getitem
                and isinstance(u.args[1], int) for u in users)):
            continue
        env: dict[fx.Node, Any] = dict(zip(inputs, node.args, strict=True))
        with graph.inserting_before(node):
            value = graph.graph_copy(sub.graph, env)
        if many:
            for u in users:
                u.replace_all_uses_with(value[u.args[1]])  # type: ignore[index]
                graph.erase_node(u)
        else:
            node.replace_all_uses_with(value)
        graph.erase_node(node)
        split.delete_submodule(str(node.target))
        done += 1
    if done:
        graph.lint()
        split.recompile()
    return done


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
        self.region_graphs: list[RegionGraphs] = []  # the same graphs, in a flat list (add)
        self.piece_runs = 0  # static pieces run (replayed or not)
        self.compiled = 0  # pieces this path compiled
        self.light = 0  # of them, with the light backend (surgery.runtime.compile_start)
        self.shared = 0  # pieces this path found compiled (surgery.runtime.piece_cache)
        self.restrided = 0  # of them, behind copies into another layout (piece_restride)
        self.compile_s = 0.0  # seconds this path spent compiling pieces
        self.disabled = ""  # as RegionGraphs: each piece's own graphs say why they stopped
        # per split graph (its id): the ids and data pointers of its weight inputs in this
        # path's last complete run; per piece (its id): the entry it validated then
        self.marks: dict[int, tuple[tuple[Any, ...], list[int]]] = {}
        self.last: dict[int, tuple[RegionGraphs, _PieceCall]] = {}

    # The path's record reads these after every call of a stack (26 region graphs on GPT-2):
    # sums over a flat list by C-level map, not a generator's frame per graph.
    @property
    def replays(self) -> int:
        return sum(map(_REPLAYS, self.region_graphs))

    @property
    def captures(self) -> int:
        return sum(map(_CAPTURES, self.region_graphs))

    @property
    def capture_s(self) -> float:
        return sum(map(_CAPTURE_S, self.region_graphs))

    def add(self, key: Any, entry: tuple[RegionGraphs, _PieceCall]) -> None:
        self.graphs[key] = entry
        self.region_graphs.append(entry[0])

    def drop(self, why: str) -> None:
        for g in self.region_graphs:
            g.drop(why)
        self.graphs.clear()
        self.region_graphs.clear()
        self.marks.clear()
        self.last.clear()

    def begin(self, graph: int, weights: Sequence[Any]
              ) -> tuple[bool, tuple[tuple[Any, ...], list[int]]]:
        """A split graph's run starts: (are its weights the last complete run's, this run's
        marks for ``end``). The last marks are popped: a run that raises leaves none."""
        last = self.marks.pop(graph, None)
        marks = (tuple(weights), list(map(_DATA_PTR, weights)))
        # the same objects by ``is`` (one C-level map, no int per weight as ids would build)
        same = last is not None and len(last[0]) == len(marks[0]) and \
            all(map(operator.is_, marks[0], last[0])) and last[1] == marks[1]
        return same, marks

    def end(self, graph: int, marks: tuple[tuple[Any, ...], list[int]]) -> None:
        """The run completed: every piece validated its entry with these weights."""
        self.marks[graph] = marks


_DATA_PTR = torch.Tensor.data_ptr
# Weights checked once a split graph's run (False: by every piece, every call, as before)
WEIGHTS_ONCE_A_RUN = True
# Steady replays by plan, their checks folded (graphs.steady; False: every replay takes
# RegionGraphs.__call__, as before)
STEADY_PLANS = True
_REPLAYS = operator.attrgetter("replays")
_CAPTURES = operator.attrgetter("captures")
_CAPTURE_S = operator.attrgetter("capture_s")


def _picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function returning the items of a sequence at ``positions``, as a tuple."""
    if not positions:
        return lambda seq: ()
    get = operator.itemgetter(*positions)
    if len(positions) == 1:
        return lambda seq: (get(seq),)
    return get  # type: ignore[return-value]


class _PieceCall:
    """What a RegionGraphs calls for one piece and path: the compiled piece with the path's
    current parameters put back among the copied inputs."""

    def __init__(self, piece: StaticPiece) -> None:
        self.piece = piece
        self.stable: list[Any] = []
        self.ptrs: list[int] = []
        self.tensors = False  # every stable input is a tensor (ptrs by one map)
        self.plan: SteadyReplay | None = None  # its graphs' steady replay (graphs.steady)

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
                 pieces: PieceCache, owner: Any) -> None:  # owner: its PiecewiseGraph
        super().__init__()
        self.index = index
        self.gm = gm
        self.stable_pos = stable_pos
        self.stable_set = frozenset(stable_pos)
        self.arity = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        self._pieces = [pieces]  # a list: not a submodule
        self._fn: Piece | None = None
        self.key: Any = None  # what makes it interchangeable with other pieces (piece_cache)
        # its values come back in the graph's order (canonical_output); put back per caller
        self._single, self._perm = canonical_output(gm)
        # the callers' order from the canonical outputs, in one C-level call (len(perm) >= 2)
        self._reorder = None if self._perm is None else operator.itemgetter(*self._perm)
        self.work = True
        self.light = False  # compiles with the light backend (surgery.runtime.compile_start)
        self.largest: int | None = None  # elements of its largest activation, if known
        self._owner = [owner]
        self.kid = -1  # id of the compiled callable: one per key (ensure)
        # a call's parameters/buffers and its other inputs, picked in one C-level call each
        self._take_stable = _picker(stable_pos)
        self._take_dynamic = _picker([j for j in range(self.arity) if j not in self.stable_set])

    def ensure(self, args: Sequence[Any], state: PathPieces | None) -> Piece:
        """The compiled piece: compiled now, or the callable of an identical piece."""
        if self._fn is None:
            t0 = time.perf_counter()
            self._fn, key, fresh = self._pieces[0].get(self.gm, list(args), self.stable_pos,
                                                       light=self.light)
            self.key = key if key is not None else ("piece", id(self))
            self.kid = id(self._fn)  # identical pieces share the callable (piece_cache)
            if state is not None:
                if fresh:
                    state.compiled += 1
                    if self.light:  # only a piecewise region's pieces (PathPieces) are light
                        state.light += 1
                    state.compile_s += time.perf_counter() - t0
                else:
                    state.shared += 1
                    state.restrided += isinstance(self._fn, RestridedPiece)
        return self._fn

    def run_canonical(self, args: list[Any]) -> Any:
        """The compiled piece's outputs, in the canonical order (what region graphs capture:
        identical pieces share them whatever order each caller wants)."""
        return self.ensure(args, None)(*args)  # dynamo's calling convention

    def restore(self, out: Sequence[Any]) -> Any:
        """The outputs as this piece's callers expect them: one value, or the tuple in order."""
        if self._single:
            return out[0]
        return tuple(out) if self._reorder is None else self._reorder(out)

    def run(self, args: list[Any]) -> Any:
        return self.restore(self.run_canonical(args))

    def __call__(self, *args: Any) -> Any:
        """The split graph's call of this piece. Not nn.Module's call path: a piece is reached
        only from its split graph's own forward, so no hook can be registered where it would
        run, and the two frames and hook checks per replay are host time on a decode."""
        local = self._owner[0].local
        state = getattr(local, "state", None)  # set once per graph run
        if state is None:
            return self.run(list(args))
        state.piece_runs += 1
        if self._fn is None:
            self.ensure(args, state)
        if state.capturer is None:
            return self.run(list(args))
        dynamic = self._take_dynamic(args)
        steady = local.steady and (last := state.last.get(id(self))) is not None
        if steady:
            graphs, call = last  # the weights of the last complete run: checked by begin()
            plan = call.plan
            if plan is not None and STEADY_PLANS and (out := plan(dynamic)) is not None:
                return self._restore_fast(out)  # the steady plan's own checks held
        else:
            graphs, call = self._checked_graphs(args, state)
        replays = graphs.replays
        out = graphs(dynamic, {}, call.run_compiled)
        if steady and STEADY_PLANS and graphs.replays > replays and (
                call.plan is None or call.plan.epoch != graphs.epoch):
            call.plan = steady_plan(graphs, dynamic)  # a steady replay: plan the next ones
        return self._restore_fast(out)

    def _restore_fast(self, out: Sequence[Any]) -> Any:
        """restore(), for a replay's list (one frame: this runs every replay)."""
        if self._single:
            return out[0]
        return tuple(out) if self._reorder is None else self._reorder(out)

    forward = __call__  # what nn.Module callers expect; the split graph calls __call__

    def _checked_graphs(self, args: tuple[Any, ...], state: PathPieces
                        ) -> tuple[RegionGraphs, _PieceCall]:
        """This call's graphs, found by its weights, with their addresses checked."""
        stable = self._take_stable(args)
        # One set of graphs per distinct piece AND the weights it runs with: the stack region's
        # blocks run one piece code with each block's own parameters (by identity: a parameter
        # moved in place keeps its set, whose graphs are dropped below). The graphs return the
        # canonical outputs, so one piece's graphs serve every identical piece. Identical pieces
        # share one compiled callable, whose id (``kid``, kept alive by the piece) stands for
        # the key: a key tuple is not hash-cached, and hashing it every replay cost ~10 us.
        gkey = (self.kid, *map(id, stable))
        entry = state.graphs.get(gkey)
        if entry is None:
            entry = self._new_graphs(state)
            state.add(gkey, entry)
        graphs, call = entry
        # New or moved parameters (``.data = ``, ``module.to()`` keep the object, move the
        # data): the graphs baked the old addresses. One C-level pass when all are tensors.
        ptrs = list(map(_DATA_PTR, stable)) if call.tensors else \
            [t.data_ptr() if isinstance(t, torch.Tensor) else id(t) for t in stable]
        if ptrs != call.ptrs:
            if call.ptrs:
                graphs.drop("a piece's parameters or buffers moved")
            call.stable, call.ptrs = list(stable), ptrs
            call.tensors = all(isinstance(t, torch.Tensor) for t in stable)
        state.last[id(self)] = entry
        return entry

    def _new_graphs(self, state: PathPieces) -> tuple[RegionGraphs, _PieceCall]:
        call = _PieceCall(self)
        assert state.capturer is not None  # only with a capturer: call() runs the piece otherwise
        graphs = RegionGraphs(nn.Module(), state.capturer, call.raw, clone_outputs=False,
                              warn=state.warn, notes=state.notes,
                              label=f"{state.label} (piece {len(state.graphs)})")
        assert self._fn is not None
        if self._fn.runs > 0:  # it ran already (in another graph or path): capture at once
            graphs.ready = lambda args, kwargs: True
        return graphs, call
