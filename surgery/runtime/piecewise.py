"""Streaming blocks compiled piecewise: one dynamo graph per block, its fixed-shape pieces
captured as surgery's region graphs, the cache-dependent ops run between them.

Why. A block that attends over a growing KV cache changes shape every step, so a plain region
recompiles each step and names-only plans leave it eager apart from small children. The serving
engines (vLLM's ``splitting_ops``, SGLang, TensorRT-LLM) trace the model once, split the FX graph
at attention, compile each piece and capture the pieces in CUDA graphs for fixed token counts;
attention runs between them. A region of kind ``piecewise`` does that for any block a manifest
names, with no code from the user.

The choice, after reading what torch offers (2.11 to 2.14):

- **A custom dynamo backend over the FX graph, split with ``torch.fx.passes.split_module``**
  (surgery.runtime.piecewise_split). This is vLLM's design; it needs only public FX and
  backend APIs present in every torch we support, and it keeps the pieces as ordinary FX
  modules that any backend (inductor, aot_eager) compiles.
- **Not inductor's ``graph_partition``**: it partitions around ops that cannot be in a CUDA
  graph, but only for inductor's own cudagraph trees, whose per-call host cost (80-140 us on an
  H200) is the overhead this project measured and avoids (``capture = "region"``); it also ties
  the pieces to inductor.
- **Not ``nested_compile_region``**: it compiles a repeated region once and stamps it out
  inside an outer compile, which cuts compile time; it does not split around shape-changing
  ops nor hand surgery pieces to capture, and its per-region backend option is 2.12's.
- **``mark_dynamic``, not ``mark_unbacked``**: the cache length is marked dynamic on the cache
  tensors the manifest locates (``dynamic = ["past_key_values:2"]``), so the graph is not traced
  again as the cache grows. ``mark_dynamic`` raises when the code branches on the marked size
  (dynamo would specialize it): that is exactly "a data-dependent branch on the cache length",
  and the block then falls back to eager with that reason. ``mark_unbacked`` would refuse far
  more (any size comparison) and forbids the 0/1 checks real attention code makes.
- **Surgery's own region graphs** (surgery.runtime.graphs.replay) capture each static piece per
  region path: the same contract as every region (captured from the second call under
  ``no_grad``/``inference_mode``, outputs a cache keeps go into the output ring, never
  overwritten while referenced). Parameters are read in place, never copied.

What stays correct. Dynamo replays the block's Python side effects after the graph (a list
append, a dict or attribute update, a cache object's new tensors), so the cache grows exactly as
in eager. A tensor the cache keeps that a static piece produced lives in that piece's output
ring (held, so never overwritten); a ``cat`` that reads the cache is a split node, so it never
runs inside a captured piece (where the cache would stop growing).

Where it cannot work, the block runs eager with the reason in its record and one
RegionFallbackWarning (``on_failure = "error"`` raises instead): a graph break inside the block
(it compiles ``fullgraph``), a branch on the cache length, or more recompiles than its budget.
Two rules decide when a call may compile (surgery.runtime.cache_sources has the why): a list
cache compiles a further structure only when two calls in a row show it (a window that fills
compiles once, when full); a call whose tensor cache is empty (a prefill) runs eager, so
``generate()`` traces decode alone. An int that only selects the block's slot of a list cache
is not passed to dynamo (surgery.runtime.index_select). Each distinct piece of all the graphs
compiles once (surgery.runtime.piece_cache).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from surgery.errors import RegionError
from surgery.formats.manifest import PIECEWISE_KEYS, Region
from surgery.runtime.budget import fresh_function, parameter_names
from surgery.runtime.cache_sources import (
    EMPTY_CACHE_NOTE,
    MAX_STRUCTURES,
    Source,
    cache_structure,
    filled,
    mark_grown,
    source_roots,
    tensor_shapes,
    tensors_in,
)
from surgery.runtime.compile_options import CompilePlan
from surgery.runtime.graphs.capture import Capturer
from surgery.runtime.index_select import IndexSelect, find_index_select
from surgery.runtime.piece_cache import PieceCache
from surgery.runtime.piece_masks import compiling_not_exporting
from surgery.runtime.piecewise_split import DEFAULT_SPLIT_OPS, SPLIT_OPS, PathPieces, PiecewiseGraph
from surgery.runtime.piecewise_stack import fallback_of, standby_reason, why_not_piecewise
from surgery.runtime.report import RegionFallbackWarning, RegionRecord
from surgery.runtime.resolve import callable_at
from surgery.runtime.slots import _make_wrapper, first_line
from surgery.runtime.tree_guards import DICT_TAGS_NOTE, compile_watched, dict_tags_skip, watch_for

_STABLE_CALLS = 2  # calls without a compile after which a path stops marking its cache
# Default compile budget of a piecewise path: a list cache changes structure until it is full.
PIECEWISE_MAX_COMPILES = 8
# A further list-cache structure compiles once two calls in a row show it (False: at once)
DEFER_STRUCTURES = True
# Raised by a fullgraph compile past dynamo's recompile limit (a plain Exception).
_RECOMPILE_LIMIT = (torch._dynamo.exc.FailOnRecompileLimitHit,)
_ACTIVE = threading.local()  # .slot: the path whose call runs; .resting: a stack run eager


def _active() -> PiecewiseSlot | None:
    return getattr(_ACTIVE, "slot", None)


@dataclass
class PiecewiseSlot:
    """One installed piecewise path; duck-types the slot ApplyHandle restores and warms up."""

    module: nn.Module
    name: str
    had_own: bool
    own: Any
    eager: Callable[..., Any]
    record: RegionRecord
    region: Region
    group: PiecewiseGroup
    names: list[str]
    sources: list[Source]
    capturer: Capturer | None
    budget: int = PIECEWISE_MAX_COMPILES
    mode: str = "compiled"
    graphs: PathPieces | None = None
    marking: int = 0  # calls since the last compile, while < _STABLE_CALLS it marks
    cache_ids: set[int] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    standby: str | None = None  # the piecewise stack this block stands by for
    select: IndexSelect | None = None  # compiled calls get the slot, not the index
    last: Any = None  # the last call's list-cache structure (cache_sources)
    ran: set[Any] = field(default_factory=set)  # the structures a compiled call ran on
    # every source has a dim: an empty one (a prefill) may run eager (cache_sources.filled)
    tensor_cache: bool = False
    last_empty: bool = False
    empty_ran: bool = False
    rest_shapes: dict[str, tuple[int, ...]] | None = None  # the last empty call's tensor args

    def __post_init__(self) -> None:
        self.graphs = PathPieces(self.module, self.capturer, warn=self._warn_graphs,
                                 notes=self.record.notes, label=self.record.path)
        self.tensor_cache = bool(self.sources) and all(s.dim is not None for s in self.sources)

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.standby is not None and getattr(_ACTIVE, "resting", None) == self.standby:
            return self.eager(*args, **kwargs)  # inside its stack's eager empty-cache call
        rec = self.record
        rec.calls += 1
        if self.mode != "compiled":
            rec.eager_calls += 1
            return self.eager(*args, **kwargs)
        cargs, ckw = (self.select and self.select.rewrite(args, kwargs)) or (args, kwargs)
        try:
            empty, shape, rest = self._prepare(cargs, ckw)
        except Exception as exc:  # a source that cannot be read or marked: the block runs eager
            return self._fail(exc, args, kwargs)
        if rest:  # outside the try: the model's own error is not a compile failure
            return self._rest(args, kwargs, empty)
        if self.group.watch is not None and not self.group.watch.unchanged():  # tree_guards
            self.group.full_guards()
        compiles, runs = rec.compiles, rec.compiled_runs
        prev, _ACTIVE.slot = _active(), self
        try:
            try:
                out = self.group.call(self.module, cargs, ckw)
            except _RECOMPILE_LIMIT:
                # The paths share one code object, so dynamo's limit (8) counts every path's
                # graphs. Nothing ran yet (the limit is checked before compiling): compile again
                # with room for each path's budget. Patched only here: it costs ~0.4 ms.
                with torch._dynamo.config.patch(recompile_limit=self.group.limit()):
                    out = self.group.call(self.module, cargs, ckw)
        except Exception as exc:
            return self._fail(exc, args, kwargs)
        finally:
            _ACTIVE.slot = prev
        self.marking = 0 if rec.compiles > compiles else self.marking + 1
        if rec.compiled_runs > runs:
            rec.compiled_calls += 1
            self.empty_ran = self.empty_ran or empty
            if shape is not None and len(self.ran) < MAX_STRUCTURES:
                self.ran.add(shape)
            if rec.status != "compiled":
                rec.status, rec.reason = "compiled", ""
        else:
            rec.eager_calls += 1
        g = self.graphs
        assert g is not None
        rec.graphs_captured, rec.cuda_graph_replays = g.captures, g.replays
        rec.pieces_compiled, rec.pieces_shared, rec.pieces_light, rec.pieces_restrided = \
            g.compiled, g.shared, g.light, g.restrided
        rec.piece_compile_s, rec.capture_s = g.compile_s, g.capture_s
        if rec.compiles > self.budget:
            self._demote(f"recompiled {rec.compiles} times (over its budget of {self.budget}) "
                         "as the cache changed: a branch on the cache length, or a cache whose "
                         "structure keeps changing; runs eager")
        return out

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any, bool]:
        """(empty cache, list-cache structure, run eager): mark the cache while it may compile."""
        empty = self.tensor_cache and not any(filled(r) for r in self._roots(args, kwargs))
        rest, self.last_empty = empty and not self.empty_ran and not self.last_empty, empty
        if rest:
            return empty, None, True
        shape = self._structure(args, kwargs)
        last, self.last = self.last, shape
        if shape is not None and shape not in self.ran:
            if self.record.compiled_runs and DEFER_STRUCTURES and shape != last:
                return empty, shape, True  # a further structure: compiles once it holds twice
            self.marking = 0  # this call may compile: mark, and find the cache afresh
        if self.marking < _STABLE_CALLS:
            self._mark(args, kwargs)
        return empty, shape, False

    def _rest(self, args: tuple[Any, ...], kwargs: dict[str, Any], empty: bool) -> Any:
        """Run the original forward: on a new list structure, or an empty cache (a prefill;
        a stack's standby blocks then run theirs too, not piecewise)."""
        rec = self.record
        rec.eager_calls += 1
        if not empty:
            rec.new_structure_calls += 1
            return self.eager(*args, **kwargs)
        rec.empty_cache_calls += 1
        if "empty" not in self.warned:
            self.warned.add("empty")
            rec.notes.append(EMPTY_CACHE_NOTE)
        # the next call marks the cache again, and what grew since this one (cache_sources)
        self.rest_shapes, self.marking = tensor_shapes(self.names, args, kwargs), 0
        prev, _ACTIVE.resting = getattr(_ACTIVE, "resting", None), rec.path
        try:
            return self.eager(*args, **kwargs)
        finally:
            _ACTIVE.resting = prev

    def _roots(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        return source_roots(self.sources, self.module, self.names, args, kwargs)

    def _structure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The list lengths under the sources without a dim (list caches), or None if none."""
        if all(src.dim is not None for src in self.sources):
            return None
        roots = self._roots(args, kwargs)
        return cache_structure([r for r, src in zip(roots, self.sources, strict=True)
                                if src.dim is None])

    def _mark(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Mark the growing dim of every cache tensor dynamic, and remember the cache tensors."""
        self.cache_ids.clear()
        for src, root in zip(self.sources, self._roots(args, kwargs), strict=True):
            found: list[torch.Tensor] = []
            tensors_in(root, found)
            for t in found:
                self.cache_ids.add(id(t))
                if src.dim is None or t.dim() == 0:
                    continue
                d = src.dim % t.dim()
                if t.dim() > d and t.shape[d] >= 2:  # sizes 0 and 1 are specialized by dynamo
                    torch._dynamo.mark_dynamic(t, d)
        if self.rest_shapes:  # after an empty-cache call: what grew with the cache since
            mark_grown(self.rest_shapes, self.names, args, kwargs)

    def _fail(self, exc: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The block cannot be compiled piecewise: run it eager from now on, saying why."""
        if self.region.on_failure == "error":
            raise RegionError(
                f"piecewise region path {self.record.path!r} failed ({type(exc).__name__}): "
                f"{first_line(exc)}", region=self.record.path,
                hint="fix the graph break or the branch on the cache length, or set "
                     "on_failure = \"eager\"") from exc
        out = self.eager(*args, **kwargs)  # the model's own error propagates from here
        self.record.eager_calls += 1
        self._demote(f"{why_not_piecewise(exc)}; runs eager")
        return out

    def _demote(self, reason: str) -> None:
        self.mode = "eager"
        rec = self.record
        rec.status, rec.reason, rec.signature_mode = "eager", reason, "eager"
        if self.graphs is not None:
            self.graphs.drop("the path fell back to eager")
        if "eager" not in self.warned:
            self.warned.add("eager")
            warnings.warn(f"surgery: region {self.region.kind!r} path {rec.path!r}: {reason}. "
                          "Set on_failure = \"error\" on the region to make this fatal.",
                          RegionFallbackWarning, stacklevel=5)

    def _warn_graphs(self, message: str) -> None:
        if message not in self.record.notes:
            self.record.notes.append(message)


class PiecewiseGroup:
    """One compiled copy of a block's forward, shared by the region's identical paths.

    Its backend splits each graph dynamo hands over (PiecewiseGraph); counts go to the path
    whose call is running.
    """

    def __init__(self, target: Callable[..., Any], *, bound: bool, plan: CompilePlan,
                 split_ops: tuple[str, ...], pieces: PieceCache | None = None) -> None:
        self.bound = bound
        self.plan = plan
        self.split_ops = split_ops
        self.slots: list[PiecewiseSlot] = []
        self.graphs: list[PiecewiseGraph] = []
        # compiled pieces, shared with every group of this apply that compiles the same way
        self.pieces = pieces if pieces is not None else PieceCache(self._compile_piece)
        self.split_s = 0.0  # seconds spent splitting the graphs dynamo handed over
        self.target, self.watch = target, watch_for(  # one path: surgery.runtime.tree_guards
            target, bound, lambda: self.slots[0].module if len(self.slots) == 1 else None)
        self.compiled = compile_watched(fresh_function(target), self._backend, self.watch)

    def full_guards(self) -> None:
        """The watched module tree changed: compile afresh with dynamo's full guards."""
        why, self.watch = self.watch.end() if self.watch else "", None
        self.compiled = compile_watched(fresh_function(self.target), self._backend, None)
        for s in self.slots:  # the fresh compile marks the cache again
            s.marking = 0
            s.record.notes.append(why)

    def limit(self) -> int:
        """Dynamo's recompile limit while paths compile: room for each path's budget."""
        return min(256, max(int(torch._dynamo.config.recompile_limit),
                            sum(s.budget for s in self.slots)))

    def call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # traced, if it traces, as torch.compile and not export (piece_masks: torch < 2.14)
        return compiling_not_exporting(self.compiled, *((module, *args) if self.bound else args),
                                       **kwargs)

    def _compile_piece(self, gm: fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        inner: Callable[..., Any] = torch._dynamo.lookup_backend(self.plan.backend)
        if self.plan.config_patches is not None:
            return inner(gm, example, config_patches=self.plan.config_patches)
        return inner(gm, example)

    def _backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        slot = _active()
        stable = {id(t) for t in (*slot.module.parameters(), *slot.module.buffers())} \
            if slot is not None else set()
        t0 = time.perf_counter()
        graph = PiecewiseGraph(gm, example_inputs, split_ops=self.split_ops,
                               cache_ids=slot.cache_ids if slot is not None else set(),
                               stable_ids=stable, pieces=self.pieces, backend=self.plan.backend,
                               state_for=lambda: s.graphs if (s := _active()) else None,
                               group=id(self), paths=len(self.slots))
        self.split_s += time.perf_counter() - t0
        self.graphs.append(graph)
        if slot is not None:
            rec = slot.record
            rec.compiles += 1
            if rec.compiled_runs:
                rec.recompiles += 1

        def run(*args: Any) -> Any:
            s = _active()
            if s is not None:
                r = s.record
                r.compiled_runs += 1
                r.ops_between_run += graph.between_ops
                r.pieces, r.ops_between = graph.pieces, graph.between_ops
                r.split_ops = graph.split_ops_seen
            return graph(*args)

        return run


def install_piecewise(mod: nn.Module, name: str, rec: RegionRecord, region: Region,
                      plan: CompilePlan, groups: dict[Any, PiecewiseGroup],
                      capturer: Capturer | None) -> PiecewiseSlot:
    """Install the piecewise wrapper on ``mod.name`` (a block's forward)."""
    spec = region.piecewise or {}
    # A Manifest built in memory skipped the reader's schema: check the table again here.
    unknown = sorted(set(spec) - set(PIECEWISE_KEYS))
    split_ops = tuple(spec.get("split_ops", DEFAULT_SPLIT_OPS))
    bad = [op for op in split_ops if op not in SPLIT_OPS]
    if unknown or bad:
        raise RegionError(f"piecewise region {rec.path!r}: " + (
            f"unknown key(s) {unknown}" if unknown else f"split op(s) {bad} not allowed"),
            region=rec.path,
            hint=f"keys: {', '.join(PIECEWISE_KEYS)}; split ops: {list(SPLIT_OPS)}")
    sources = [Source.parse(s, region=rec.path) for s in spec.get("dynamic", ())]
    own, eager, bound, target = callable_at(mod, name, path=rec.path)
    key = (id(target), plan.backend, split_ops)
    group = groups.get(key)
    if group is None:
        shared = next((g.pieces for g in groups.values() if g.plan.backend == plan.backend
                       and g.plan.config_patches == plan.config_patches), None)
        group = groups[key] = PiecewiseGroup(target, bound=bound, plan=plan, split_ops=split_ops,
                                             pieces=shared)
    slot = PiecewiseSlot(mod, name, name in vars(mod), own, eager, rec, region, group,
                         parameter_names(eager), sources, capturer,
                         budget=plan.max_signatures if "max_signatures" in region.compile
                         else PIECEWISE_MAX_COMPILES, standby=fallback_of(region))
    slot.select = find_index_select(target, slot.names, [s.arg for s in sources if s.dim is None])
    rec.notes += [slot.select.note()] if slot.select is not None else []
    rec.notes += [DICT_TAGS_NOTE] if group.watch is None and bound and dict_tags_skip() else []
    rec.signature_mode = "piecewise"
    rec.reason = standby_reason(slot.standby) if slot.standby is not None else rec.reason
    group.slots.append(slot)
    mod.__dict__[name] = _make_wrapper(slot)  # type: ignore[arg-type]
    return slot
