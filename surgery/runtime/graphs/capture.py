"""Capturing CUDA graphs for surgery's region graphs (surgery.runtime.graphs.replay): who captures,
and where.

``CudaCapturer`` captures on a side stream into one memory pool shared by every live region
graph of a device. ``surgery.runtime.graphs.replay`` talks to it through the ``Capturer`` protocol,
which is also how the tests drive the same logic on a CPU with a stand-in graph.

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


class CudaCapturer:
    """Captures on a side stream into one memory pool shared by every live region graph.

    It calls ``CUDAGraph.capture_begin`` directly: ``torch.cuda.graph`` empties the allocator's
    cache on every capture, which costs time across a hundred captures. The allocator frees a
    pool with its last graph, and a freed pool's handle must not be reused (it trips an
    INTERNAL ASSERT in the caching allocator), so a new handle is taken whenever no graph of
    the old one is alive.

    A graph that surgery drops while others of its pool live (restore of one handle, moved
    parameters, a demotion under max_graph_memory) is parked, not destroyed, until the last
    one goes: destroying a CUDAGraph clears the cuBLAS workspaces of its capture stream
    (``CUDAGraph::reset`` -> ``clearCublasWorkspacesForStream`` in recent torch), which every
    live graph captured on that one side stream still uses (pytorch#193402). Parking costs no
    memory: the pool is shared and is freed only with its last graph anyway.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self.owned: MutableMapping[int, Any] = weakref.WeakValueDictionary()
        self.live = 0  # graphs of the current pool still alive
        self.arena: Any = None  # surgery.runtime.graphs.arena.BufferArena, attached by its user
        self.last_growth = 0  # reserved bytes the last capture added (its pool's temporaries)
        # What the side stream's warm-up runs left allocated: above all cuBLAS's workspace for
        # the (handle, stream) pair, which captured matmuls use for good (PyTorch keeps one per
        # stream; 32 MiB on Hopper by default, CUBLAS_WORKSPACE_CONFIG sets it).
        self.stream_bytes = 0
        self.parked: list[torch.cuda.CUDAGraph] = []  # dropped while others live (see above)
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None

    def capture(self, work: Callable[[], None]) -> Graph:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self.live == 0:
            self._pool = torch.cuda.graph_pool_handle()
            if self.arena is not None:
                self.arena.pool_bytes = 0
        side, current = self._stream, torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved(self.device)
        with torch.cuda.stream(side):
            allocated = torch.cuda.memory_allocated(self.device)
            work()  # warm the side stream (cuBLAS workspace, lazy inits) outside the capture
            self.stream_bytes += max(0, torch.cuda.memory_allocated(self.device) - allocated)
            graph.capture_begin(pool=self._pool)
            try:
                work()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the first error is the one to show
                    graph.capture_end()
                raise
            graph.capture_end()
        current.wait_stream(side)
        # The pool's growth, and the side stream's cache for the warm-up run before it.
        self.last_growth = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        if self.arena is not None:
            self.arena.pool_bytes += self.last_growth
            self.arena.pool_reader = self.pool_reserved
            self.arena.stream_bytes = self.stream_bytes
        return _PooledGraph(graph, self)

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


class _PooledGraph:
    """A captured graph that keeps its capturer's count of live graphs in its pool."""

    def __init__(self, graph: torch.cuda.CUDAGraph, owner: CudaCapturer) -> None:
        self.replay = graph.replay
        self._graph = graph
        self._owner = owner
        owner.live += 1

    def __del__(self) -> None:
        owner = self._owner
        owner.live -= 1
        if owner.live > 0:
            owner.parked.append(self._graph)  # destroyed with the last one (CudaCapturer)
        else:
            owner.parked.clear()



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
