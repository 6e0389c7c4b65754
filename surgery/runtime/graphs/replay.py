"""Region CUDA graphs: surgery captures one CUDA graph per region path and input signature.

Why. A region compiled with ``mode="reduce-overhead"`` enters dynamo on every call (guards, the
AOT prologue, cudagraph-tree bookkeeping): 80-140 us of host time per call on an H200 with
torch 2.11. LingBot-Map calls 120 regions a frame, so the step is bound by the host, not the GPU.
With ``capture = "region"`` the region compiles *without* inductor's CUDA graphs, and surgery
captures the compiled code itself; a replay costs a signature check, one copy per input and one
``cudaGraphLaunch``.

The contract, which is what makes that safe:

- **When.** A graph is captured on the second call with the same signature (the first one
  compiles and autotunes outside any capture), or on the first when ``ready`` says that call
  compiles nothing (code precompiled in a bundle: surgery.runtime.precompiled), only with CUDA,
  with grad disabled (``no_grad`` or ``inference_mode``), and when every input is a tensor on
  the region's device, a Python scalar, ``None``, or a tuple or list of these. Anything else
  runs the compiled code, unchanged.
- **What is checked before each replay.** The signature: every tensor's shape, strides, dtype and
  device, every scalar's value, the module's ``training`` flag, inference mode and autocast. The
  *addresses* of the region module's parameters, buffers and tensor attributes, and its children:
  a changed one drops the path's graphs (``load_state_dict`` copies in place and keeps them). Any
  other Python state the region reads is frozen at capture, as in every CUDA graph. A path whose
  state moves ``MAX_STATE_MOVES`` times stops capturing and runs compiled without a graph, the
  reason in its record: an FSDP2 unit (``fully_shard``, ``reshard_after_forward=True``, the
  default below the root) frees its unsharded parameters after each forward and all-gathers them
  into newly allocated memory before the next, so their addresses are the caching allocator's
  choice from call to call; recapturing on every move would cost a capture per call and a pool
  that grows. ``reshard_after_forward=False`` keeps them in place, and its graphs replay.
- **Inputs** are copied into static buffers just before each replay (buffers shared by every
  path with an input of that layout: surgery.runtime.graphs.arena), or, when the input is another
  region's output, read where it is (the graph keeps a view of its own of it, which the owner's
  held check counts). An input the region writes in place is copied back after each replay.
  Which inputs it writes is found at capture (surgery.runtime.graphs.capture): exactly for
  normal tensors (their version counters); under ``inference_mode``, whose tensors have no
  version counter, by comparing bytes before and after, which misses only a write that left
  every byte unchanged in both the second call and the capture's run.
- **Autocast** of the region's device is part of the signature, so a head that turns autocast
  off inside an autocast step gets a graph of its own for each state.
- **Outputs** are copied, inside the graph, into owned output sets, laid out as the compiled
  code returned them, so the memory pool that all region graphs share holds only temporaries. A
  path's first set may also be written by other paths' graphs (arena.py: a set nobody holds),
  and a replay would overwrite what any of them returned, so before each replay the set's
  storage use counts are checked.
  When a caller still holds what an earlier call returned (a KV cache keeps ``attn_pre``'s k and
  v, pytorch#152887), the path captures one more graph writing a fresh output set, and replays
  rotate through this ring, using a set nobody holds. Past ``MAX_OUTPUT_SETS`` sets, the call
  runs without a graph, one warning says so, and the path clones its outputs from then on
  (``clone_outputs = true``: from the start): it forgets the ring and captures one set, which
  its clones never hold, or one more of its own if another path's held outputs are in it (a
  first set is shared: ``outputs.SHARED_SET_GROWTH``). Nothing is overwritten while referenced.
- **Collectives.** A path whose call issues a torch.distributed collective (a tensor-parallel
  all-reduce) is never captured and runs its compiled code without a graph; the reason is in
  its record (surgery.runtime.graphs.collectives holds the evidence).
- **Streams.** Graphs capture and replay on the caller's stream (graphs.capture says when not);
  two region graphs must not run concurrently on different streams: they share one pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.runtime.graphs import outputs
from surgery.runtime.graphs.arena import arena_of, fmt_bytes
from surgery.runtime.graphs.capture import Capturer, CudaCapturer, Graph, WriteProbe
from surgery.runtime.graphs.collectives import (
    collective_counts,
    holds_collective_reason,
    issued_since,
)
from surgery.runtime.graphs.demote import make_room
from surgery.runtime.graphs.outputs import (
    MAX_OUTPUT_SETS,
    NO_USE_COUNT,
    _Captured,
    _layout_of,
    _out_tensors,
    _Outputs,
    _substitute,
    _Watch,
    call_signature,
    plain_signature,
)

__all__ = ["MAX_GRAPHS_PER_PATH", "MAX_OUTPUT_SETS", "MAX_STATE_MOVES", "STATE_MOVES_REASON",
           "Capturer", "CudaCapturer", "Graph", "RegionGraphs"]

# At most this many captured signatures per region path; more run the compiled code uncaptured.
MAX_GRAPHS_PER_PATH = 8
# After this many drops because the module's tensors moved, the path stops capturing.
MAX_STATE_MOVES = 3
STATE_MOVES_REASON = (
    f"runs compiled without a CUDA graph: its parameters or buffers moved {MAX_STATE_MOVES} "
    "times between calls (an FSDP2 unit re-gathers them into new memory each forward; "
    "fully_shard(..., reshard_after_forward=False) keeps them in place, and graphs replay)")


# run_compiled(args, kwargs) -> (output, whether compiled code ran)
RunCompiled = Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, bool]]


class RegionGraphs:
    """The captured graphs of one region path, keyed by call signature."""

    def __init__(self, module: nn.Module, capturer: Capturer,
                 raw_call: Callable[[tuple[Any, ...], dict[str, Any]], Any], *,
                 clone_outputs: bool, warn: Callable[[str], None],
                 notes: list[str] | None = None, label: str = "") -> None:
        self.module = module
        self.label = label  # the region path (and piece) it captures, for notes
        self.capturer = capturer
        self.raw_call = raw_call  # the compiled callable, outside surgery's call accounting
        self.clone = clone_outputs
        self.warn = warn  # called with a message once per event kind
        self.graphs: dict[tuple[Any, ...], _Captured] = {}
        self.seen: dict[tuple[Any, ...], int] = {}
        self.watch: _Watch | None = None
        self.disabled = ""  # why this path no longer captures
        self.replays = 0
        self.captures = 0
        self.adopt = True  # read other regions' owned outputs in place (see _capture)
        self.epoch = self.plans = 0  # moves at each capture or forget; plans made (graphs.steady)
        self.readopted: set[tuple[Any, ...]] = set()  # forgotten once to read inputs in place
        self.moved = 0  # replays refused because an adopted input was somewhere else
        self.state_moves = 0  # graphs dropped because the module's tensors moved
        self.output_sets = 0  # the most output sets any signature needed
        self.capture_s = 0.0  # time spent capturing (warm-up run, capture, instantiation)
        self.arena = arena_of(capturer)  # shared static inputs and output sets; the cap
        self.arena_order = self.arena.register(self)  # ties under the cap (graphs.demote)
        self.pool_bytes = 0  # what its captures added to the capture pool (CUDA: reserved)
        self.over_cap = ""  # set when max_graph_memory kept a graph or a ring set from it
        self.notes: list[str] = [] if notes is None else notes  # what happened, for the report
        # ready(args, kwargs): True when the call compiles nothing, so its first call captures.
        self.ready: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None
        if outputs._use_count is None:
            self.disabled = NO_USE_COUNT
            self.notes.append(NO_USE_COUNT)

    def signature(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
        return call_signature(self.module.training, self.capturer.device, args, kwargs)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 run_compiled: RunCompiled) -> Any:
        if self.disabled or torch.is_grad_enabled():
            return run_compiled(args, kwargs)[0]
        found = plain_signature(self.module.training, self.capturer.device, args) \
            if not kwargs else None
        if found is None:
            found = self.signature(args, kwargs)
            if found is None:
                return run_compiled(args, kwargs)[0]
        sig, tensors = found
        cap = self.graphs.get(sig)
        if cap is not None:
            return self._replay(sig, cap, tensors, args, kwargs, run_compiled)
        n = self.seen[sig] = self.seen.get(sig, 0) + 1
        room = len(self.graphs) < MAX_GRAPHS_PER_PATH
        early = n == 1 and room and self.ready is not None and self.ready(args, kwargs)
        probe = WriteProbe(tensors) if (n >= 2 or early) and room else None
        before = collective_counts() if probe is not None else None
        out, ran = run_compiled(args, kwargs)
        if before is not None and (issued := issued_since(before)):
            self.disabled = holds_collective_reason(issued)  # never captured: see collectives
            self.notes.append(self.disabled)
            return out
        if ran and n == 2 and not room:
            self.notes.append(f"a signature beyond the first {MAX_GRAPHS_PER_PATH} runs "
                              "compiled without a graph (shapes vary from call to call?)")
        if ran and probe is not None:
            mine = self._capture(sig, tensors, args, kwargs, out, probe.written(tensors))
            if mine is not None:
                return mine
        return out

    def _replay(self, sig: tuple[Any, ...], cap: _Captured, tensors: list[torch.Tensor],
                args: tuple[Any, ...], kwargs: dict[str, Any], run_compiled: RunCompiled) -> Any:
        watch = self.watch
        assert watch is not None
        if watch.tracked and not watch.unchanged():
            self.drop("the region's parameters, buffers or submodules changed since capture")
            self.state_moves += 1
            if self.state_moves >= MAX_STATE_MOVES:
                self.disabled = STATE_MOVES_REASON
                self.notes.append(STATE_MOVES_REASON)
            return run_compiled(args, kwargs)[0]
        for i, ptr in cap.adopted:
            if tensors[i].data_ptr() != ptr:  # not the output it was captured reading: recapture
                self.forget(sig)
                self.moved += 1
                if self.moved == 3:
                    self.adopt = False
                    self.notes.append("inputs are copied: the outputs this path read in place "
                                      "moved three times")
                return run_compiled(args, kwargs)[0]
        # An output set whose last outputs nobody holds any more; checked in clone mode too,
        # since aliases returned before the switch may still live.
        outs = None
        for o in cap.sets:
            if not o.set.held():
                outs = o
                break
        if outs is None and not self.clone and len(cap.sets) >= MAX_OUTPUT_SETS:
            self.clone = True
            self.warn(f"the outputs of its last {MAX_OUTPUT_SETS} calls were all still "
                      "referenced (a long cache?), so a replay would overwrite one. That call "
                      "ran without the graph, and the path clones its outputs from now on, from "
                      "one output set; set clone_outputs = true on the region to start that way")
            # It hands out clones now, so one set serves it: forget the ring (freed as the
            # caller lets go); the next call captures one set again.
            self.forget(sig)
            return run_compiled(args, kwargs)[0]
        grow = outs is None and len(cap.sets) < (MAX_OUTPUT_SETS if not self.clone else 0 if
                                                 self.over_cap else outputs.SHARED_SET_GROWTH)
        if grow and not make_room(self.arena, self, self.arena.set_needed(cap.layout, set(),
                                                                          first=False)):
            grow = False
            self.clone = True  # clones live outside the graphs' memory
            self._over_cap("another output set for its ring", 0, "clones its outputs")
        if outs is None and not grow:
            return run_compiled(args, kwargs)[0]
        inputs = cap.inputs
        for i in cap.copied:
            t = tensors[i]
            if inputs[i].data_ptr() != t.data_ptr():
                inputs[i].copy_(t)
        if outs is None:  # every set is held (a KV cache keeps them): capture one more set,
            outs = self._new_set(cap)  # whose warm-up run inside capture is this call's run
            if outs is None:
                return run_compiled(args, kwargs)[0]
            if len(cap.sets) == 2:
                self.notes.append(outputs.SHARED_SET_NOTE if self.clone else outputs.KEPT_NOTE)
        else:
            outs.graph.replay()
            self.replays += 1
        for i in cap.written:
            tensors[i].copy_(inputs[i])
        self.output_sets = max(self.output_sets, len(cap.sets))
        return cap.rebuild(outs.set.hand_out(self.clone))

    def demote(self, why: str) -> None:
        """Stop capturing for good and free the graphs (max_graph_memory: graphs.demote)."""
        self.drop(why)
        self.disabled = self.over_cap = why

    def drop(self, why: str) -> None:
        """Forget every captured graph of this path; the next calls capture again."""
        if self.graphs:
            self.notes.append(f"graphs dropped: {why}")
        for sig in list(self.graphs):
            self.forget(sig)
        self.seen.clear()
        self.watch = None

    def forget(self, sig: tuple[Any, ...]) -> None:
        """Forget one signature's graphs; it is one sighting from being captured again."""
        cap = self.graphs.pop(sig)
        self.epoch += 1  # its steady plans (graphs.steady) are stale
        for outs in cap.sets:
            outs.set.writers -= 1
            if outs.set.writers == 0:  # no graph writes it any more: not a stable address
                for s in outs.storages:
                    self.capturer.owned.pop(s.data_ptr(), None)
        for owner, j in cap.adopted_from:  # our references to their outputs are gone
            owner.baseline[j] -= 1
        self.seen[sig] = 1

    def _new_set(self, cap: _Captured, avoid: set[int] | None = None) -> _Outputs | None:
        """Capture a graph writing another output set; None (and capture off) if it fails.

        The set comes from the arena (surgery.runtime.graphs.arena): a path's first set may be
        one that another path's graph writes too, when nobody holds it and no input of this
        call (storage addresses ``avoid``) lives in it. The inputs must already be in place:
        the warm-up run inside the capture computes this call's outputs into the set.
        """
        owned = self.arena.output_set(cap.layout, avoid or set(), first=not cap.sets)
        t0 = time.perf_counter()
        try:
            graph = self.capturer.capture(cap.work(owned.tensors))
        except Exception as exc:  # any capture failure means: run uncaptured
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.disabled = (f"CUDA-graph capture failed ({type(exc).__name__}: {first}); "
                             "runs compiled without a graph")
            self.notes.append(self.disabled)
            self.warn(self.disabled)
            return None
        finally:
            self.capture_s += time.perf_counter() - t0
        self.pool_bytes += int(getattr(self.capturer, "last_growth", 0) or 0)
        outs = _Outputs(graph, owned)
        owned.writers += 1
        for s in owned.storages:
            self.capturer.owned[s.data_ptr()] = owned
        cap.sets.append(outs)
        self.captures += 1
        return outs

    def _over_cap(self, what: str, need: int, instead: str) -> None:
        """max_graph_memory keeps ``what`` from this path: say so once, in its notes."""
        arena = self.arena
        self.over_cap = (f"{what} would take region graphs past max_graph_memory = "
                         f"{fmt_bytes(arena.limit or 0)} (they hold {fmt_bytes(arena.used())}, "
                         f"{fmt_bytes(need)} more needed, and no larger path could make room); "
                         f"{instead}")
        self.notes.append(self.over_cap)

    def buffers(self) -> tuple[list[Any], list[Any]]:
        """(output storages, static input storages) of this path's graphs, for the report."""
        sets: list[Any] = []
        inputs: list[Any] = []
        for cap in self.graphs.values():
            for o in cap.sets:
                sets += o.storages
            inputs += [cap.inputs[i].untyped_storage() for i in cap.copied]
        return sets, inputs

    def _capture(self, sig: tuple[Any, ...], tensors: list[torch.Tensor],
                 args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                 writes: set[int]) -> Any:
        """Capture this signature's graph. Returns this call's output from the owned buffers
        (the warm-up run inside the capture computed it from the same inputs), so regions that
        read it next capture reading it in place; or None to return ``out``."""
        split = _out_tensors(out)
        why = ""
        if split is None:
            why = "its output holds something other than tensors and Python scalars"
        watch = self.watch or _Watch(self.module)
        if not why and split is not None:
            mine = {t.untyped_storage().data_ptr() for t in tensors} | watch.storages
            if any(o.untyped_storage().data_ptr() in mine for o in split[0]):
                why = "it returns a view of an input or of its own parameters or buffers"
        if why:
            self.disabled = f"not captured: {why}; runs compiled without a graph"
            self.notes.append(self.disabled)
            return None
        assert split is not None
        outputs, rebuild = split
        # Another region's owned output has a stable address: read it in place (no copy per
        # replay), unless this region writes it, which the warm-up run inside capture would
        # then repeat on the caller's tensor.
        owners = {i: self.capturer.owned.get(t.untyped_storage().data_ptr())
                  for i, t in enumerate(tensors) if self.adopt and i not in writes}
        adopted = [(i, tensors[i].data_ptr()) for i, o in owners.items() if o is not None]
        adopt = {i for i, _ in adopted}
        copied = [i for i in range(len(tensors)) if i not in adopt]
        layout = _layout_of(outputs)
        avoid = {t.untyped_storage().data_ptr() for t in tensors}
        arena = self.arena
        need = arena.inputs_needed(tensors, copied) + arena.set_needed(layout, avoid, first=True)
        if not make_room(arena, self, need):  # larger paths give way first, if that is enough
            self.disabled = "not captured: over max_graph_memory"
            self._over_cap("its graph", need, "runs compiled without a graph")
            return None
        # Static input buffers, shared with every path whose input has the same layout: a graph
        # reads them only while it replays, right after they are copied in (arena.py).
        static = arena.static_inputs(tensors, copied)
        # An input read in place is kept as a view of its own: two regions reading one output
        # (a block's x into attn_pre and ffn_residual) then hold two references, one each, as
        # its owner's baseline counts them; the caller's own tensor stays the caller's.
        inputs = [static[i] if i in static else t.detach() for i, t in enumerate(tensors)]
        for i in copied:
            inputs[i].copy_(tensors[i])
        probe = WriteProbe(inputs)
        it = iter(inputs)  # the same order as _flatten: args, then kwargs by sorted key
        static_args = _substitute(args, it)
        keys = sorted(kwargs)
        static_kwargs = dict(zip(keys, _substitute([kwargs[k] for k in keys], it), strict=True))
        raw_call = self.raw_call

        def work(owned: list[torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                got = _out_tensors(raw_call(static_args, static_kwargs))
                assert got is not None and len(got[0]) == len(owned)
                for dst, src in zip(owned, got[0], strict=True):
                    dst.copy_(src)
            return run

        # The graph keeps each adopted input alive: one more reference its owner must expect.
        adopted_from = [(owner, owner.index(tensors[i])) for i, _ in adopted
                        if (owner := owners[i]) is not None]
        cap = _Captured(inputs, copied, adopted, adopted_from, [], rebuild, layout, work, [])
        outs = self._new_set(cap, avoid)
        if outs is None:
            return None
        # Written in the capture's run, or in the call before it (the union: for an inference
        # tensor either one alone can miss a write that left the bytes unchanged).
        cap.written = sorted((probe.written(inputs) | writes) & set(copied))
        for owner, j in adopted_from:
            owner.baseline[j] += 1
        self.watch = watch
        self.graphs[sig] = cap
        self.epoch += 1
        self.output_sets = max(self.output_sets, 1)
        if writes:  # the warm-up run saw the inputs after this call had written them
            return None
        return rebuild(outs.hand_out(self.clone))
