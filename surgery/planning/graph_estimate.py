"""What a plan's region graphs will hold, estimated from the watched eager calls (issue 20).

Why. ``plan --input`` watches the model run, so it sees every region call's inputs and outputs
and how long each output stays referenced. That is all surgery's region graphs need to decide
their buffers (surgery.runtime.graphs: replay.py, arena.py), so the plan can say, before anything
is compiled, about how much memory the graphs will hold: the ``[coverage]`` table gets the
figures and ``plan`` prints them. On CUDA the watch also reads the bare eager steps' peak, and
the table adds the two for an estimate of the peak with graphs.

What the watcher records per call (surgery.planning.observe calls ``record_inputs`` and
``OutputWatch.outputs``): each tensor input's storage address and the bytes a static buffer of
its layout takes; the outputs' distinct storages and their layout, as the runtime allocates an
output set; and when the last of its output tensors was freed, counted in calls begun by then.
A call whose inputs or outputs a graph cannot take (a dict, an object, an output that is a view
of an input) gets no graph at runtime, and none here.

The simulation replays the watched calls in order and applies the runtime's rules:
- a path's graph per signature (at most MAX_GRAPHS_PER_PATH), with static input buffers for its
  inputs, except an input that is another region's output still alive (read in place);
- its first output set is any set of the same layout whose last contents are freed by then
  (``share_outputs``), else a new one; a later call writes a set of its ring that is free, or
  adds one while the caller still holds them all (a KV cache), up to MAX_OUTPUT_SETS, after
  which the path clones (nothing more held);
- a set's contents are freed when eager's output of that call was freed.
So for a model whose steps repeat, it counts what the runtime's report counts (outputs and static
inputs) up to the differences below.

What it does not count, or gets only roughly: the capture pool (the compiled code's temporaries
inside the graphs, which depend on the compiler and the allocator; on the H200 it was 2-108
MiB) and any cuBLAS workspace of the capture stream; rings of outputs kept longer than the
watched steps (watch more steps than the cache is long); a caller that keeps only a view of an
output (its tensor counts as freed, while the runtime sees the storage held).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from surgery.planning.observation import Call, Observation
from surgery.runtime.graphs.arena import fmt_bytes, strided_bytes
from surgery.runtime.graphs.outputs import MAX_OUTPUT_SETS
from surgery.runtime.graphs.replay import MAX_GRAPHS_PER_PATH

_SCALARS = (int, float, bool, str, type(None))


def _leaves(obj: Any, out: list[torch.Tensor]) -> bool:
    """The tensors of a call's arguments, as the runtime flattens them; False if a leaf or a
    container is one a graph cannot take."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return not obj.is_sparse
    if isinstance(obj, _SCALARS):
        return True
    if type(obj) in (tuple, list):
        return all(_leaves(o, out) for o in obj)
    return False


def record_inputs(call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Note the call's tensor inputs (or that a graph could not take them)."""
    tensors: list[torch.Tensor] = []
    if not (_leaves(args, tensors) and _leaves(list(kwargs.values()), tensors)):
        call.layout = ("no graph",)
        return
    call.ins = [(t.untyped_storage().data_ptr(), strided_bytes(t)) for t in tensors]


class OutputWatch:
    """Notes each watched call's outputs and, through weak references, when they are freed."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self._refs: list[weakref.ref[torch.Tensor]] = []

    def outputs(self, idx: int, out: Any) -> None:
        call = self.calls[idx]
        if call.layout:  # its inputs already rule a graph out
            return
        leaves = torch.utils._pytree.tree_leaves(out)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        mine = {p for p, _ in call.ins}
        if not tensors or not all(isinstance(x, (torch.Tensor, *_SCALARS)) for x in leaves) \
                or any(t.untyped_storage().data_ptr() in mine for t in tensors):
            call.layout = ("no graph",)
            return
        numbers: dict[int, int] = {}
        layout = []
        for t in tensors:
            st = t.untyped_storage()
            n = numbers.setdefault(st.data_ptr(), len(numbers))
            if n == len(call.outs):
                call.outs.append((st.data_ptr(), st.nbytes()))
            layout.append((n, st.nbytes(), str(t.dtype), int(t.storage_offset()),
                           tuple(t.shape), tuple(t.stride())))
        call.layout = tuple(layout)
        live = [len(tensors)]

        def freed(_ref: Any, idx: int = idx, live: list[int] = live) -> None:
            live[0] -= 1
            if live[0] == 0:
                self.calls[idx].dead_at = len(self.calls)

        self._refs += [weakref.ref(t, freed) for t in tensors]

    def close(self) -> None:
        """Stop noting (outputs alive now stay 'alive when the watch ended')."""
        self._refs.clear()


@dataclass
class GraphEstimate:
    outputs: int = 0  # output sets' bytes
    static_inputs: int = 0  # static input buffers' bytes
    paths: int = 0  # region paths that get a graph
    ring_sets: int = 0  # output sets added to rings (outputs kept across calls)
    # Paths with outputs of a step before the last still held when the watch ended: a cache
    # longer than the watch, whose ring may grow past the estimate.
    open_rings: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.outputs + self.static_inputs


def estimate_graphs(obs: Observation, paths: Sequence[str], *, share_outputs: bool = True
                    ) -> GraphEstimate:
    """What the region graphs of ``paths`` would hold after the watched steps (see above)."""
    regions = set(paths)
    never = len(obs.calls) + 1
    est = GraphEstimate()
    busy: list[int] = []  # per set: the call index from which its contents are freed
    free_sets: dict[tuple[Any, ...], list[int]] = {}  # layout -> shared sets
    rings: dict[tuple[str, Any], list[int]] = {}
    per_path: dict[str, int] = {}
    owned: dict[int, int] = {}  # eager storage address of a region output -> when freed
    for i, c in enumerate(obs.calls):
        if c.path not in regions or not c.layout or c.layout == ("no graph",):
            continue
        nbytes = sum(n for _, n in c.outs)
        freed_at = c.dead_at if c.dead_at >= 0 else never
        key = (c.path, c.sig)
        ring = rings.get(key)
        if ring is None:
            if per_path.get(c.path, 0) >= MAX_GRAPHS_PER_PATH:
                continue
            per_path[c.path] = per_path.get(c.path, 0) + 1
            est.static_inputs += sum(n for p, n in c.ins if owned.get(p, -1) <= i)
            shared = free_sets.setdefault(c.layout, [])
            pick = next((j for j in shared if busy[j] <= i), None) if share_outputs else None
            if pick is None:
                pick = len(busy)
                busy.append(0)
                est.outputs += nbytes
                shared.append(pick)
            ring = rings[key] = [pick]
        else:
            pick = next((j for j in ring if busy[j] <= i), None)
            if pick is None:
                if len(ring) >= MAX_OUTPUT_SETS:
                    continue  # the path clones from now on: the caller holds clones
                pick = len(busy)
                busy.append(0)
                est.outputs += nbytes
                est.ring_sets += 1
                ring.append(pick)
        busy[pick] = freed_at
        for p, _ in c.outs:
            owned[p] = freed_at
        if c.dead_at < 0 and c.step < obs.steps - 1 and c.path not in est.open_rings:
            est.open_rings.append(c.path)
    est.paths = len(per_path)
    return est


# Keys of the manifest's [coverage] table this module fills (schemas/manifest.schema.json; the
# README lists them). Bytes, all of them.
GRAPH_OUTPUTS = "graph_outputs_bytes"  # output sets, shared as the runtime shares them
GRAPH_STATIC_INPUTS = "graph_static_inputs_bytes"  # static input buffers
GRAPH_BYTES = "graph_bytes"  # the two: what report.memory will count, the pool aside
GRAPH_BYTES_UNSHARED = "graph_bytes_unshared"  # the same with no output set shared
EAGER_PEAK = "eager_peak_bytes"  # CUDA only: the bare eager steps' peak allocated memory
PEAK_ESTIMATE = "peak_estimate_bytes"  # CUDA only: eager's peak plus graph_bytes


def graph_coverage(obs: Observation, paths: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """The [coverage] figures for a plan of these region paths, and the paths whose rings may
    grow past them (outputs held beyond the watch)."""
    est = estimate_graphs(obs, paths)
    out = {GRAPH_OUTPUTS: est.outputs, GRAPH_STATIC_INPUTS: est.static_inputs,
           GRAPH_BYTES: est.total,
           GRAPH_BYTES_UNSHARED: estimate_graphs(obs, paths, share_outputs=False).total}
    if obs.eager_peak_bytes:
        out[EAGER_PEAK] = obs.eager_peak_bytes
        out[PEAK_ESTIMATE] = obs.eager_peak_bytes + est.total
    return out, est.open_rings


def graph_note(cov: dict[str, Any], paths: int, open_rings: Sequence[str]) -> str:
    """One line for plan's notes: the estimate."""
    text = (f"region graphs: about {fmt_bytes(cov[GRAPH_BYTES])} held by {paths} region "
            f"path(s) (output sets {fmt_bytes(cov[GRAPH_OUTPUTS])}, static inputs "
            f"{fmt_bytes(cov[GRAPH_STATIC_INPUTS])}; {fmt_bytes(cov[GRAPH_BYTES_UNSHARED])} "
            "with no set shared), plus the capture pool, which is not estimated")
    if EAGER_PEAK in cov:
        text += (f"; eager's peak {fmt_bytes(cov[EAGER_PEAK])}, so about "
                 f"{fmt_bytes(cov[PEAK_ESTIMATE])} with graphs")
    if open_rings:
        text += (f"; {len(open_rings)} path(s) (e.g. {open_rings[0]}) still held outputs of "
                 "earlier steps when the watch ended, so their rings may grow past this (up to "
                 f"{MAX_OUTPUT_SETS} sets): watch more steps than the cache is long")
    return text + "; apply_manifest's handle.report.memory says what they hold"
