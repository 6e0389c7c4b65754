"""Ordinary regions built from the piecewise regions' compiled pieces: compile once, capture many.

Why. A plan with piecewise regions often has ordinary regions of the *same class* beside them.
The SDPA example's frame blocks and global blocks are both ``RopeBlock``: one attends within
the frame, the other over a cache. Compiled as usual, the frame block is one inductor compile of
the whole block, the plan's largest. The global block's pieces are the same ops on the same
layouts: the norm, qkv, q/k norms and RoPE before attention; the projection, residual and MLP
after it. So the piecewise plan paid inductor twice for the same code, and its cold start came
out behind the names-only plan's, which compiles the frame block and only small children of
the global block.

What it does. An ordinary region qualifies when the apply has a piecewise region of the same
module class and the same compile plan (backend and inductor config), and it compiles static
(no dynamic dims). Its dynamo graph is then split at that piecewise region's split ops
(surgery.runtime.piecewise_split). Each static piece comes from the apply's piece cache
(surgery.runtime.piece_cache): it is compiled only if no identical piece was compiled before,
in this region or a piecewise one. The split ops (attention) run between the pieces. The region
keeps its own region graph, which captures the whole call: the pieces and the attention end up
in one CUDA graph, as before. So the steady state does not change (one replay a call), and only
the compile is shared. The pieces an ordinary region compiled or found are counted on its record
(``pieces_compiled``, ``pieces_shared``, ``piece_compile_s``).

What it does not do. It looks for no piece of another class, so a region unlike every piecewise
block never pays for a split it cannot share. A graph without a split op compiles whole, as before.
Dynamic groups (their sizes are symbols, and the split would run those ops eagerly) compile as
usual.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx, nn

from surgery.formats.manifest import (
    PIECEWISE_DEFAULT_SPLIT_OPS,
    PIECEWISE_KIND,
    PIECEWISE_SPLIT_OPS,
    Region,
)
from surgery.runtime.compile_options import CompilePlan
from surgery.runtime.piece_cache import PieceCache
from surgery.runtime.piecewise_split import PiecewiseGraph, op_name


def _record_counter(name: str, kind: Callable[[Any], Any]) -> Any:
    """A property that reads ``self.record.<name>`` (as ``kind``) and writes it."""
    return property(lambda self: kind(getattr(self.record, name)),
                    lambda self, value: setattr(self.record, name, value))


class RecordPieces:
    """What StaticPiece counts for a path (surgery.runtime.piecewise_split), kept on an ordinary
    region's record. Its pieces have no region graphs of their own (``capturer`` is None): the
    region's own graph captures the whole call."""

    capturer = None

    def __init__(self, record: Any) -> None:
        self.record = record
        self.piece_runs = 0

    # The counters piece_cache keeps, read and written on the region's record.
    compiled = _record_counter("pieces_compiled", int)
    shared = _record_counter("pieces_shared", int)
    restrided = _record_counter("pieces_restrided", int)
    compile_s = _record_counter("piece_compile_s", float)


class SharedPieces:
    """How one ordinary group compiles from the piece cache of the piecewise regions it matches.

    ``cache()`` finds that cache when the group first compiles (the piecewise groups are all
    installed by then); ``active()``, given by the group's backend, is the ordinary slot whose
    call is running.
    """

    def __init__(self, split_ops: tuple[str, ...], cache: Callable[[], PieceCache | None]) -> None:
        self.split_ops = split_ops
        self.cache = cache
        self.active: Callable[[], Any] = lambda: None
        self.paths: dict[int, RecordPieces] = {}
        self.graphs = 0  # dynamo graphs built from shared pieces

    def compile(self, gm: fx.GraphModule, example_inputs: list[Any],
                active: Callable[[], Any]) -> Callable[..., Any] | None:
        """The graph split into pieces from the cache, or None: compile it whole as usual."""
        ops = set(self.split_ops)
        pieces = self.cache()
        if pieces is None or not any(n.op.startswith("call") and op_name(n) in ops
                                     for n in gm.graph.nodes):
            return None
        self.active = active
        slot = active()
        stable = {id(t) for t in (*slot.module.parameters(), *slot.module.buffers())} \
            if slot is not None else set()
        self.graphs += 1
        return PiecewiseGraph(gm, example_inputs, split_ops=self.split_ops, cache_ids=set(),
                              stable_ids=stable, pieces=pieces, state_for=self._state)

    def _state(self) -> Any:  # a RecordPieces, which StaticPiece uses as a PathPieces
        slot = self.active()
        if slot is None:
            return None
        state = self.paths.get(id(slot))
        if state is None:
            state = self.paths[id(slot)] = RecordPieces(slot.record)
        return state


# (module, compile plan, dynamic) of an ordinary region -> how it shares pieces, or None
Sharing = Callable[[nn.Module, CompilePlan, Any], SharedPieces | None]


def piece_sharing(resolved: Sequence[tuple[Region, str, nn.Module, str]],
                  plan_for: Callable[[Region, nn.Module], CompilePlan],
                  groups: Mapping[Any, Any]) -> Sharing:
    """Which ordinary regions share pieces with the apply's piecewise regions (see the module
    docstring). ``resolved``: the apply's (region, path, module, callable name); ``plan_for``:
    a region's compile plan for a module; ``groups``: the apply's piecewise groups
    (surgery.runtime.piecewise), filled as they are installed, each with its piece cache."""
    kinds: dict[tuple[type, str, str], tuple[str, ...]] = {}
    for region, _, mod, _ in resolved:
        if region.kind != PIECEWISE_KIND:
            continue
        plan = plan_for(region, mod)
        ops = tuple((region.piecewise or {}).get("split_ops", PIECEWISE_DEFAULT_SPLIT_OPS))
        if not plan.eager_reason and all(op in PIECEWISE_SPLIT_OPS for op in ops):
            # (an op off the allowlist: install_piecewise refuses the region with its error)
            kinds[(type(mod), plan.backend, _text(plan.config_patches))] = ops

    def share(module: nn.Module, plan: CompilePlan, dynamic: Any) -> SharedPieces | None:
        split_ops = kinds.get((type(module), plan.backend, _text(plan.config_patches)))
        if split_ops is None or dynamic is True:
            return None
        return SharedPieces(split_ops, lambda: next(
            (g.pieces for g in groups.values() if g.plan.backend == plan.backend
             and g.plan.config_patches == plan.config_patches), None))

    return share


def _text(patches: Any) -> str:
    return json.dumps(patches, sort_keys=True, default=str)
