"""Capturing CUDA graphs for surgery's region graphs (surgery.runtime.graphs.replay): who captures,
and where.

``CudaCapturer`` captures into one memory pool shared by every live region graph of a device.
``surgery.runtime.graphs.replay`` talks to it through the ``Capturer`` protocol, which is also how
the tests drive the same logic on a CPU with a stand-in graph.

Which stream. A CUDA graph cannot be captured on the device's default stream (torch refuses:
"CUDA graphs must be captured on a non-default stream"), and every stream a matmul runs on gets
cuBLAS's workspace of its own, for good: torch keeps one per (handle, stream), 32 MiB by default
on Hopper (``CUBLAS_WORKSPACE_CONFIG``), and a captured graph keeps using the one of the stream
it was captured on. So:

- **On the caller's stream** when the caller's current stream is not the default stream (the
  model runs under ``torch.cuda.stream(s)``): the graph captures right there. Eager's workspace
  for that stream is already there, so the capture adds none (H200: +0.01 MiB, against +33 MiB
  on a side stream), and the warm-up run's temporaries come from that stream's cache.
- **On a side stream** of surgery's when the caller runs on the default stream, as before: that
  stream's workspace (33 MiB on an H200) and cache are surgery's cost, in ``stream_bytes`` and
  the report, whose line says how to avoid it.
- **On the side stream, routed**: ``apply_manifest`` routes a model called on the default stream
  onto that same side stream for the whole call (surgery.runtime.stream_route), so the capture
  finds it current and captures there as on a caller's stream (``routed_captures``); the model's
  eager parts made its workspace, which is then the model's one, not a second.

Either way the work queued before, the warm-up run, the capture, and what runs after it (the
WriteProbe's byte comparison, the next region) keep one order: on the caller's stream by being
on it, with the side stream by its two waits.

Whether the default-stream case could share eager's workspace too: not without unsafe tricks.
torch picks the workspace inside ``getCurrentCUDABlasHandle`` from its map for the current
stream and sets it on the handle at every call (CublasHandlePool.cpp, ``setWorkspaceForHandle``);
nothing public points one stream's entry at another's memory, capture on the default stream is
refused, and a smaller ``CUBLAS_WORKSPACE_CONFIG`` sizes eager's workspace as well (on the H200,
``:4096:1`` made eager's M=1 matmuls 5x slower). Freeing the side stream's workspace after
capture would leave the graphs pointing at freed memory (pytorch#193402, below).

Graphs replay on the caller's current stream. One captured on a caller's stream A and replayed
on another stream B uses A's workspace, which eager work on A uses too; so such a replay waits
for A's work before it, and A waits for the replay after it (``cross_stream_replays`` counts
them). Graphs captured on different streams do not share temporaries (the caching allocator
keeps a pool's blocks per stream), so a model run on several streams holds a pool share for each.
A graph captured on the side stream for a caller on the default stream replays anywhere without
waits: only graphs, and routed calls, use that stream's workspace; two region graphs never run at
once (replay.py), and a routed call waits for the default stream and makes it wait in turn. A
graph captured in a routed call is a caller's-stream graph of the side stream: ordered when
replayed elsewhere.

WriteProbe: which inputs a call wrote in place, for normal tensors and for inference tensors alike.

Why. A captured CUDA graph reads its own copies of the inputs. When the region writes an input in
place (a KV cache filled at a position), the replay writes the copy, so surgery must copy it
back to the caller's tensor after every replay, and must not read such an input in place from
another region's buffers. So at capture time it has to know which inputs the region writes.

How. A normal tensor carries a version counter that every in-place op bumps, so the answer is
exact. An inference tensor (made under ``torch.inference_mode()``) has none: ``t._version``
raises "Inference tensors do not track version counter". For those the probe keeps a copy of the
bytes before the call and compares after it. That sees every write that changes a byte; a write
that leaves every byte as it was (the same value written again) is not seen. surgery asks at two
calls, the second uncaptured call and the capture's own run, and takes the union.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class Capturer(Protocol):
    """Captures work into a graph. ``device`` is the CUDA index inputs must be on (-1: CPU).

    ``owned`` maps the storage address of every live region graph's owned output to its output
    set: an input found there has a stable address, so a graph reads it in place instead of
    copying it. The CUDA capturer holds the sets weakly: a model dropped without ``restore()``
    frees its graphs and buffers. A capturer may also carry ``arena`` (the shared buffers,
    surgery.runtime.graphs.arena; one is attached when missing) and ``last_growth`` (bytes the
    last capture added to the pool).
    """

    device: int
    owned: MutableMapping[int, Any]  # -> surgery.runtime.graphs.outputs.OutputSet

    def capture(self, work: Callable[[], None]) -> Graph: ...


# Why a capture is refused inside the caller's own capture: a second capture cannot begin on a
# capturing stream, and a side stream that waited on it would join the caller's graph.
CAPTURING_ALREADY = ("the caller's stream is capturing a CUDA graph of its own; a region graph "
                     "is not captured inside another capture")

# The current stream's raw handle, cheap enough for every replay (inductor's generated code reads
# it the same way); torch.cuda.current_stream builds a Stream object per call.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CudaCapturer:
    """Captures on the caller's stream, or on a side stream when that is the default stream (see
    the module's docstring), into one memory pool shared by every live region graph.

    It calls ``CUDAGraph.capture_begin`` directly: ``torch.cuda.graph`` empties the allocator's
    cache on every capture, which costs time across a hundred captures. The allocator frees a
    pool with its last graph, and a freed pool's handle must not be reused (it trips an
    INTERNAL ASSERT in the caching allocator), so a new handle is taken whenever no graph of
    the old one is alive.

    A graph that surgery drops while others of its pool live (restore of one handle, moved
    parameters, a demotion under max_graph_memory) is parked, not destroyed, until the last
    one goes: destroying a CUDAGraph clears the cuBLAS workspaces of its capture stream
    (``CUDAGraph::reset`` -> ``clearCublasWorkspacesForStream`` in recent torch), which every
    live graph captured on that stream still uses (pytorch#193402). Parking costs no memory:
    the pool is shared and is freed only with its last graph anyway. When the last one goes, a
    caller's stream loses its workspace too; eager's next matmul there allocates it again.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self.owned: MutableMapping[int, Any] = weakref.WeakValueDictionary()
        self.live = 0  # graphs of the current pool still alive
        self.arena: Any = None  # surgery.runtime.graphs.arena.BufferArena, attached by its user
        self.last_growth = 0  # reserved bytes the last capture added (its pool's temporaries)
        # What the warm-up runs before each capture left allocated on the capture stream: above
        # all cuBLAS's workspace for the (handle, stream) pair, which captured matmuls use for
        # good (32 MiB on Hopper by default). On the side stream that is surgery's cost; on a
        # caller's stream eager's first call made it already, so it is about 0.
        self.stream_bytes = 0
        self.side_bytes = 0  # the part of stream_bytes kept on the side stream
        self.side_captures = 0  # captures on the side stream (the caller ran on the default)
        self.caller_captures = 0  # captures on the caller's own stream
        self.routed_captures = 0  # on the side stream, current because the call was routed
        self.cross_stream_replays = 0  # replays on another stream than their capture's
        self.parked: list[torch.cuda.CUDAGraph] = []  # dropped while others live (see above)
        self._side_before = 0  # the side stream's bytes in the last pool (side_kept)
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None

    def current_raw(self) -> int:
        """The raw handle of this device's current stream."""
        if _raw_current_stream is not None:
            return int(_raw_current_stream(self.device))
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def side_stream(self) -> torch.cuda.Stream:
        """Surgery's side stream on this device (made on first use): captures for callers on the
        default stream, and the stream that routed calls run on (surgery.runtime.stream_route)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def capture(self, work: Callable[[], None]) -> Graph:
        if self.live == 0:  # a new pool: its accounting starts afresh (side_kept says why)
            self._pool = torch.cuda.graph_pool_handle()
            self._side_before, self.side_bytes = self.side_bytes, 0
            self.stream_bytes = self.side_captures = self.caller_captures = 0
            self.routed_captures = 0
            if self.arena is not None:
                self.arena.pool_bytes = 0
        with torch.cuda.device(self.device):
            if torch.cuda.is_current_stream_capturing():  # the caller's own capture is open
                raise RuntimeError(CAPTURING_ALREADY)
        current = self.current_stream()
        on_caller = current.cuda_stream != torch.cuda.default_stream(self.device).cuda_stream
        if on_caller:
            stream = current  # work queued on it before runs first, in stream order
        else:
            stream = self.side_stream()
            stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.cuda.stream(stream):  # also makes the capturer's device current
            allocated = torch.cuda.memory_allocated(self.device)
            work()  # warm the stream (cuBLAS workspace, lazy inits) outside the capture
            kept = max(0, torch.cuda.memory_allocated(self.device) - allocated)
            graph.capture_begin(pool=self._pool)
            try:
                work()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the first error is the one to show
                    graph.capture_end()
                raise
            graph.capture_end()
        if on_caller and self._stream is not None and \
                current.cuda_stream == self._stream.cuda_stream:
            # The route made the side stream current: a workspace this warm-up made is the
            # model's one (eager's, unrouted), so it is not counted as the graphs'.
            self.routed_captures += 1
            kept = 0
        elif on_caller:
            self.caller_captures += 1
        else:
            current.wait_stream(stream)
            kept = self.side_kept(kept)
            self.side_captures += 1
            self.side_bytes += kept
        self.stream_bytes += kept
        # The pool's growth, and the stream's cache for the warm-up run before it.
        self.last_growth = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        if self.arena is not None:
            self.arena.pool_bytes += self.last_growth
            self.arena.pool_reader = self.pool_reserved
            self.arena.stream_bytes = self.stream_bytes
        return PooledGraph(graph, self, stream if on_caller else None)

    def side_kept(self, kept: int) -> int:
        """What a side-stream capture's warm-up keeps, for the accounting.

        When the last graph of a pool goes, recent torch frees its capture stream's
        workspace (``CUDAGraph::reset``, pytorch#175276), and the next pool's first warm-up
        there makes it again: counted then. A torch that does not free it leaves it allocated,
        and that warm-up makes nothing: the previous pool's bytes are still the side stream's,
        so they are carried over, once."""
        if self.side_captures == 0 and kept == 0:
            kept, self._side_before = self._side_before, 0
        return kept

    def pool_reserved(self) -> int | None:
        """Bytes the current capture pool holds (the allocator's snapshot), or None."""
        if self._pool is None:
            return None
        try:
            segments = torch.cuda.memory_snapshot()
        except Exception:  # the snapshot's layout is private; its absence costs only this figure
            return None
        if not any("segment_pool_id" in seg for seg in segments):
            return None  # a torch whose snapshot does not name pools: the growth sum stands
        want = tuple(self._pool)
        return sum(int(seg.get("total_size", 0)) for seg in segments
                   if tuple(seg.get("segment_pool_id", ())) == want)


class PooledGraph:
    """A captured graph that keeps its capturer's count of live graphs in its pool.

    ``stream``: the caller's stream it was captured on (None: the side stream). Such a graph
    replayed on another stream is ordered against its capture stream both ways, since eager work
    there uses the same cuBLAS workspace (the module's docstring).
    """

    def __init__(self, graph: Any, owner: CudaCapturer, stream: Any = None) -> None:
        self._graph = graph
        self._owner = owner
        self.stream = stream
        # A bound method of self would make a cycle and delay __del__ (the parking count) to
        # the garbage collector: replay is the graph's own method, or a closure without self.
        self.replay = graph.replay if stream is None else ordered_replay(graph, owner, stream)
        owner.live += 1

    def __del__(self) -> None:
        owner = self._owner
        owner.live -= 1
        if owner.live > 0:
            owner.parked.append(self._graph)  # destroyed with the last one (CudaCapturer)
        else:
            owner.parked.clear()


def ordered_replay(graph: Any, owner: CudaCapturer, stream: Any) -> Callable[[], None]:
    """``graph.replay`` for a graph captured on the caller's ``stream``: on that stream as it
    is; on any other, after the capture stream's work so far, and before its next work."""
    raw = int(stream.cuda_stream)

    def replay() -> None:
        if owner.current_raw() == raw:
            graph.replay()
            return
        owner.cross_stream_replays += 1
        current = owner.current_stream()
        current.wait_stream(stream)  # eager work queued on the capture stream goes first
        graph.replay()
        stream.wait_stream(current)  # and what it queues next waits for the replay

    return replay


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes, so NaN compares equal to the same NaN."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)

class WriteProbe:
    """Taken before a call on its input tensors; ``written()`` after it says which it wrote."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        # An inference tensor's bytes, or a normal tensor's version counter.
        self._before: list[torch.Tensor | int] = [
            _bytes(t).clone() if t.is_inference() else t._version for t in tensors]

    def written(self, tensors: Sequence[torch.Tensor]) -> set[int]:
        """Indices of the tensors written in place since the probe was taken."""
        out = set()
        for i, (t, before) in enumerate(zip(tensors, self._before, strict=True)):
            if isinstance(before, int):
                if t._version != before:
                    out.add(i)
            elif not torch.equal(_bytes(t), before):
                out.add(i)
        return out
