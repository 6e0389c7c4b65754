"""A region's arguments and outputs as a CUDA graph sees them: flattened into tensors and a
signature, outputs kept in a ring of owned sets, and the held check (is an output set still
referenced outside the graph?) that decides when a set may be reused. Knows tensors only: no
manifest, no modules.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from surgery.runtime.graphs.capture import Graph

_DETACH = torch.Tensor.detach

# At most this many output sets per signature (a ring for outputs kept across calls, such as a
# KV cache of `attn_pre`'s k and v); past it, the path clones its outputs instead.
MAX_OUTPUT_SETS = 8
# Output sets of a path that clones its outputs: the shared first set, and one of its own.
SHARED_SET_GROWTH = 2
SHARED_SET_NOTE = "its shared output set held other paths' outputs: it captured a set of its own"
KEPT_NOTE = ("outputs are kept across calls (a KV cache?): surgery keeps a ring of output "
             "buffers instead of cloning")


_SCALARS = (int, float, bool, str, type(None))


# How many tensors and storage objects share a storage: the held check rests on it. It is a
# private torch function (cudagraph trees use it too); without it, nothing is captured.
# Read through this module at each use (tests set it to None to see the fallback).
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


NO_USE_COUNT = ("not captured: this torch has no torch._C._storage_Use_Count, which the held "
                "check needs; runs compiled without a graph (capture = \"compiler\" uses the "
                "compiler's CUDA graphs instead)")


def _flatten_args(args: tuple[Any, ...], sig: list[Any], tensors: list[torch.Tensor],
                  device: int) -> bool:
    """_flatten for a call's positional arguments, with a fast path for plain tensors."""
    for a in args:
        if type(a) is torch.Tensor and a.get_device() == device and not a.is_sparse:
            sig.append((a.shape, a.stride(), a.dtype))
            tensors.append(a)
        elif not _flatten(a, sig, tensors, device):
            return False
    return True


def _flatten(obj: Any, sig: list[Any], tensors: list[torch.Tensor], device: int) -> bool:
    """Append obj's signature and tensors; False if a leaf cannot be part of a captured call."""
    if isinstance(obj, torch.Tensor):
        if obj.get_device() != device or obj.is_sparse:
            return False
        sig.append((obj.shape, obj.stride(), obj.dtype))
        tensors.append(obj)
        return True
    if isinstance(obj, _SCALARS):
        sig.append((type(obj), obj))
        return True
    if type(obj) in (tuple, list):
        sig.append((type(obj), len(obj)))
        return all(_flatten(o, sig, tensors, device) for o in obj)
    return False


def call_signature(training: bool, device: int, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """A call's signature (the module's ``training``, inference mode, the device's autocast,
    then each argument as _flatten has it) and its tensors; None if it cannot be captured."""
    kind = "cuda" if device >= 0 else "cpu"  # the autocast state of the device it runs on
    sig: list[Any] = [training, torch.is_inference_mode_enabled(),
                      torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind)]
    tensors: list[torch.Tensor] = []
    if not _flatten_args(args, sig, tensors, device):
        return None
    if kwargs:
        keys = sorted(kwargs)
        sig.append(tuple(keys))
        if not _flatten([kwargs[k] for k in keys], sig, tensors, device):
            return None
    return tuple(sig), tensors


def plain_signature(training: bool, device: int, args: tuple[Any, ...]
                    ) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """call_signature() of a call without kwargs whose arguments are all plain tensors on the
    device (a static piece's call: surgery.runtime.piece_replay), the same tuple built in one
    frame; None for any other call, which then takes call_signature()."""
    kind = "cuda" if device >= 0 else "cpu"
    sig: list[Any] = [training, torch.is_inference_mode_enabled(),
                      torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind)]
    for a in args:
        if type(a) is not torch.Tensor or a.get_device() != device or a.is_sparse:
            return None
        sig.append((a.shape, a.stride(), a.dtype))
    return tuple(sig), list(args)


def _substitute(obj: Any, it: Any) -> Any:
    """obj with each tensor replaced by the next item of ``it`` (same walk as _flatten)."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if type(obj) in (tuple, list):
        return type(obj)(_substitute(o, it) for o in obj)
    return obj


def _out_tensors(out: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]] | None:
    """The output's tensors and a function that rebuilds it from new ones; None if unsupported."""
    if isinstance(out, torch.Tensor):
        return [out], _first
    # A tuple or a list of tensors is rebuilt by its own type, one C call per replay (aot_eager
    # and inductor return lists: through pytree that was a dozen Python frames a replay).
    if type(out) in (tuple, list) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out), type(out)
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    if not all(isinstance(x, (torch.Tensor, *_SCALARS)) for x in leaves):
        return None
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(ts: list[torch.Tensor]) -> Any:
        filled = list(leaves)
        for i, t in zip(where, ts, strict=True):
            filled[i] = t
        return torch.utils._pytree.tree_unflatten(filled, spec)

    return [leaves[i] for i in where], rebuild


def _first(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


class _Watch:
    """What a captured graph baked in: the module tree's tensors, where they are, and children.

    ``unchanged()`` runs before every replay, so it is two flat passes: every parameter, buffer,
    tensor attribute and child (``None`` entries too) is still the same object in the same
    place, and every tensor still has the same address (``module.to()`` and ``.data = ...``
    move data without replacing the object). A key added later is not seen; the captured code
    never reads it.
    """

    def __init__(self, module: nn.Module) -> None:
        entries: list[tuple[dict[str, Any], str, Any]] = []
        for m in module.modules():
            for d in (m._parameters, m._buffers, m._modules):
                entries += [(d, k, v) for k, v in d.items()]
            entries += [(vars(m), k, v) for k, v in vars(m).items()
                        if isinstance(v, torch.Tensor)]
        # Flat lists, so the check is two C-level passes (map), not a Python loop.
        self._dicts = [d for d, _, _ in entries]
        self._keys = [k for _, k, _ in entries]
        self._values = [v for _, _, v in entries]  # held, so their ids stay theirs
        self._ids = [id(v) for v in self._values]
        # A DTensor (tensor parallel, FSDP2 at rest) has no data pointer of its own: its
        # local shard is what a graph reads.
        self._tensors = [getattr(v, "_local_tensor", v) for v in self._values
                         if isinstance(v, torch.Tensor)]
        self._ptrs = [t.data_ptr() for t in self._tensors]
        self.storages = {t.untyped_storage().data_ptr() for t in self._tensors}
        # False for a module with nothing to watch (a static piece's stand-in module): then
        # nothing can change, and the replay skips the check
        self.tracked = bool(self._ids)

    def unchanged(self) -> bool:
        return (list(map(id, map(dict.get, self._dicts, self._keys))) == self._ids
                and list(map(torch.Tensor.data_ptr, self._tensors)) == self._ptrs)


class OutputSet:
    """One set of owned output buffers, written by the graphs of one or more region paths
    (surgery.runtime.graphs.arena shares a set between paths whose outputs do not outlive the
    call after them).

    ``baseline`` is each storage's use count with only surgery's own references (this set's
    tensors and storage objects, plus one per graph that reads it in place): more means that
    someone still holds what a replay returned from it.
    """

    __slots__ = ("__weakref__", "_cdata", "baseline", "shared", "storages", "tensors", "writers")

    def __init__(self, tensors: list[torch.Tensor], *, shared: bool) -> None:
        self.tensors = tensors  # in output order; views of `storages`, laid out as compiled
        distinct = {o.untyped_storage().data_ptr(): o.untyped_storage() for o in tensors}
        self.storages: list[Any] = list(distinct.values())  # the distinct storages, one each
        self.shared = shared  # may other paths' graphs write it (a path's first set)?
        self.writers = 0  # graphs that write it
        count = _use_count
        assert count is not None  # RegionGraphs never captures without it
        self._cdata = [s._cdata for s in self.storages]  # read per replay by held()
        self.baseline = list(map(count, self._cdata))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def index(self, t: torch.Tensor) -> int:
        """Which of this set's storages holds ``t``."""
        ptr = t.untyped_storage().data_ptr()
        return next(j for j, s in enumerate(self.storages) if s.data_ptr() == ptr)

    def hand_out(self, clone: bool) -> list[torch.Tensor]:
        """What a call returns: clones, or views that share this set's buffers."""
        return [o.clone() for o in self.tensors] if clone else list(map(_DETACH, self.tensors))

    def held(self) -> bool:
        """Does anyone but us still reference what an earlier replay returned from this set?"""
        count = _use_count
        assert count is not None
        return any(map(operator.gt, map(count, self._cdata), self.baseline))


@dataclass
class _Outputs:
    """One graph, and the output set it writes."""

    graph: Graph
    set: OutputSet

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.set.tensors

    @property
    def storages(self) -> list[Any]:
        return self.set.storages

    def hand_out(self, clone: bool) -> list[torch.Tensor]:
        return self.set.hand_out(clone)

    def held(self) -> bool:
        return self.set.held()


@dataclass
class _Captured:
    """One signature's inputs, and a ring of output sets (each with its own graph)."""

    inputs: list[torch.Tensor]  # the graphs' input buffers, in _flatten order
    copied: list[int]  # inputs copied into those buffers before each replay
    adopted: list[tuple[int, int]]  # (input, address): read in place from another region's output
    adopted_from: list[tuple[OutputSet, int]]  # whose output each adopted input is
    written: list[int]  # inputs the region writes in place: copied back after each replay
    rebuild: Callable[[list[torch.Tensor]], Any]
    layout: _Layout  # how to allocate a new output set
    work: Callable[[list[torch.Tensor]], Callable[[], None]]  # capture work for an output set
    sets: list[_Outputs]


# How to allocate one output set: per output, (storage number, storage bytes, dtype, device,
# storage offset, shape, strides). Metadata only: the compiled call's own outputs are not kept.
_Layout = list[tuple[int, int, torch.dtype, torch.device, int, torch.Size, tuple[int, ...]]]


def _layout_of(outputs: list[torch.Tensor]) -> _Layout:
    """The outputs' layout: same strides, and outputs that shared a storage (q, k and v split
    from one projection) share one in every output set too."""
    numbers: dict[int, int] = {}
    layout: _Layout = []
    for t in outputs:
        st = t.untyped_storage()
        n = numbers.setdefault(st.data_ptr(), len(numbers))
        layout.append((n, st.nbytes(), t.dtype, t.device, int(t.storage_offset()), t.shape,
                       t.stride()))
    return layout


def _alloc_like(layout: _Layout) -> list[torch.Tensor]:
    """Fresh output buffers laid out as ``layout`` says."""
    fresh: dict[int, Any] = {}
    out = []
    for n, nbytes, dtype, device, offset, shape, stride in layout:
        if n not in fresh:
            fresh[n] = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        out.append(torch.empty(0, dtype=dtype, device=device).set_(fresh[n], offset, shape,
                                                                   stride))
    return out
