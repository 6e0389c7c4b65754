"""Buffers that region graphs share: static inputs and output sets that several region paths'
graphs use, so that a hundred paths hold about what the few live at once need (issue 20).

Why. Each region path's graph reads its inputs from buffers of its own and writes its outputs
into buffers of its own (surgery.runtime.graphs.replay). Per path that is one activation each
way, where eager holds a few activations at a time; with 160 paths it was most of a +43% peak.

What is shared, and why it is safe.
- **Static inputs.** A graph reads its input buffers only while it replays, and surgery copies
  the caller's tensors into them just before (and the ones it writes back just after). Two
  region graphs never replay at the same time (one stream, as replay.py says), so every path
  with an input of the same shape, strides, dtype, device and inference mode reads one buffer.
  The k-th input of a layout within one call gets the k-th buffer: one call's inputs never share.
  Off by default (``MemoryPolicy.share_inputs``): measured once on the H200 it cost step time
  for 150 MiB of peak (benchmarks/RESULTS.md); a user at the edge of memory turns it on.
- **Output sets.** A set may be overwritten once nothing outside surgery references what an
  earlier replay returned from it: the held check (its storages' use counts) decides before
  every replay, whichever path's graph wrote it last. So a path's *first* set is any set of its
  layout that nobody holds now and that none of this call's inputs lives in, or a new one.
  Blocks chained ``x = block(x)`` then take turns over two or three sets instead of one each.
  Sets a path adds to its ring (its outputs are kept across calls: a KV cache) are its own, so
  one cache's rotation never takes the sets another needs.
- Nothing is kept alive here: the arena holds buffers weakly, the graphs that use them hold them.

Accounting. ``used()`` is what the live buffers hold (each storage once) plus the capture pool's
growth (``pool_bytes``, filled in by the capturer: on CUDA, the reserved memory each capture
added) and what the capture stream keeps (``stream_bytes``: its cuBLAS workspace). ``limit``
(``apply_manifest(max_graph_memory=...)``) is checked before each new buffer or capture: past it
the largest paths give way first (surgery.runtime.graphs.demote) and run compiled without a
graph. The pool's growth of a capture is known only after it (and comes in the allocator's
segments, 2 MiB and up), so the cap holds to within the last admitted capture's pool growth.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from surgery.runtime.graphs.outputs import OutputSet, _alloc_like, _Layout


@dataclass
class MemoryPolicy:
    """What the arena shares; a benchmark turns each off to measure what it saves."""

    # Off by default: on the H200 (benchmarks/RESULTS.md, issue 20) sharing static inputs saved
    # 150 MiB more of the SDPA example's peak (already 13% under eager's with shared outputs)
    # but the step ran 56.5 ms against 45.7 ms with outputs shared alone; one run, so it is a
    # switch to measure again, not a settled cost.
    share_inputs: bool = False
    share_outputs: bool = True


# What every arena made without a policy of its own follows (read at each use, so a benchmark
# may switch it between applies).
POLICY = MemoryPolicy()

# A static input buffer: shape, strides, dtype, device, inference mode, k-th of it in one call.
_InputKey = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device, bool, int]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _layout_bytes(layout: _Layout) -> int:
    return sum(dict((n, nbytes) for n, nbytes, *_ in layout).values())


class BufferArena:
    """The shared static inputs and output sets of every region graph of one capturer."""

    def __init__(self, policy: MemoryPolicy | None = None) -> None:
        self.policy = policy or POLICY
        self.limit: int | None = None  # bytes; None: no cap
        self.pool_bytes = 0  # capture pool growth (the capturer adds to it)
        self.stream_bytes = 0  # what the capture stream keeps (CudaCapturer.stream_bytes)
        # The capture pool's exact size (CudaCapturer.pool_reserved), read when a cap is set.
        self.pool_reader: Callable[[], int | None] | None = None
        self._ids = itertools.count()
        self._inputs: weakref.WeakValueDictionary[_InputKey, torch.Tensor] = \
            weakref.WeakValueDictionary()
        self._all_inputs: weakref.WeakValueDictionary[int, torch.Tensor] = \
            weakref.WeakValueDictionary()
        self._sets: dict[tuple[Any, ...], list[weakref.ref[OutputSet]]] = {}
        self._all_sets: weakref.WeakValueDictionary[int, OutputSet] = \
            weakref.WeakValueDictionary()
        # The region graphs (one path's, or one piece's) that use this arena, by registration
        # order, which surgery.runtime.graphs.demote breaks ties by; and what the cap demoted.
        self._members: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.demoted: list[tuple[str, int]] = []  # (label, bytes it held alone), in order

    def register(self, member: Any) -> int:
        """Add a RegionGraphs to the members; returns its registration number."""
        n = next(self._ids)
        self._members[n] = member
        return n

    def members(self) -> list[Any]:
        """The live members, in registration order."""
        return [m for _, m in sorted(self._members.items())]

    # --- static inputs ---------------------------------------------------------------------

    def _input_keys(self, tensors: list[torch.Tensor], which: list[int]) -> list[_InputKey]:
        inference = torch.is_inference_mode_enabled()
        seen: dict[tuple[Any, ...], int] = {}
        keys = []
        for i in which:
            t = tensors[i]
            base = (t.shape, t.stride(), t.dtype, t.device, inference)
            k = seen[base] = seen.get(base, -1) + 1
            keys.append((*base, k))
        return keys

    def inputs_needed(self, tensors: list[torch.Tensor], which: list[int]) -> int:
        """Bytes of the new buffers ``static_inputs`` would make for these inputs."""
        keys = self._input_keys(tensors, which)
        return sum(strided_bytes(tensors[i]) for i, key in zip(which, keys, strict=True)
                   if not (self.policy.share_inputs and key in self._inputs))

    def static_inputs(self, tensors: list[torch.Tensor], which: list[int]
                      ) -> dict[int, torch.Tensor]:
        """A buffer for each input in ``which``, laid out like it (shared when allowed)."""
        out = {}
        for i, key in zip(which, self._input_keys(tensors, which), strict=True):
            buf = self._inputs.get(key) if self.policy.share_inputs else None
            if buf is None:
                t = tensors[i]
                buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                self._all_inputs[next(self._ids)] = buf
                if self.policy.share_inputs:
                    self._inputs[key] = buf
            out[i] = buf
        return out

    # --- output sets -----------------------------------------------------------------------

    def _free_set(self, layout: _Layout, avoid: set[int]) -> OutputSet | None:
        key = (tuple(layout), torch.is_inference_mode_enabled())
        refs = self._sets.get(key, [])
        refs[:] = [r for r in refs if r() is not None]
        for r in refs:
            s = r()
            if s is not None and not s.held() and not any(st.data_ptr() in avoid
                                                          for st in s.storages):
                return s
        return None

    def set_needed(self, layout: _Layout, avoid: set[int], *, first: bool) -> int:
        """Bytes ``output_set`` would allocate."""
        if first and self.policy.share_outputs and self._free_set(layout, avoid) is not None:
            return 0
        return _layout_bytes(layout)

    def output_set(self, layout: _Layout, avoid: set[int], *, first: bool) -> OutputSet:
        """A path's output set: for its first set (``first``), one of this layout that nobody
        holds and no input of this call (storage addresses ``avoid``) lives in, if any;
        otherwise a new one, shared only if it is a path's first."""
        if first and self.policy.share_outputs:
            found = self._free_set(layout, avoid)
            if found is not None:
                return found
        fresh = OutputSet(_alloc_like(layout), shared=first and self.policy.share_outputs)
        self._all_sets[next(self._ids)] = fresh
        if fresh.shared:
            key = (tuple(layout), torch.is_inference_mode_enabled())
            self._sets.setdefault(key, []).append(weakref.ref(fresh))
        return fresh

    # --- accounting and the cap ------------------------------------------------------------

    def held_bytes(self) -> tuple[int, int]:
        """(output sets, static inputs): bytes of the live buffers, each storage once."""
        sets = {s.data_ptr(): s.nbytes() for o in list(self._all_sets.values())
                for s in o.storages}
        inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in list(self._all_inputs.values())}
        return sum(sets.values()), sum(inputs.values())

    def used(self) -> int:
        pool = self.pool_reader() if self.pool_reader is not None else None
        return sum(self.held_bytes()) + (self.pool_bytes if pool is None else pool) + \
            self.stream_bytes

    def admits(self, nbytes: int) -> bool:
        """Would ``nbytes`` more stay within the cap?"""
        return self.limit is None or self.used() + nbytes <= self.limit


def strided_bytes(t: torch.Tensor) -> int:
    """Bytes ``torch.empty_strided(t.shape, t.stride())`` allocates."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size()


def arena_of(capturer: Any) -> BufferArena:
    """The capturer's arena; a capturer without one (an older one, a test's) gets one, or, if
    it takes no attributes, each of its paths gets one of its own (nothing shared)."""
    arena = getattr(capturer, "arena", None)
    if arena is None:
        arena = BufferArena()
        with contextlib.suppress(AttributeError):
            capturer.arena = arena
    return arena


def fmt_bytes(n: int) -> str:
    """Bytes for a person: GiB from 1 GiB, MiB from 1 MiB, else KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
