"""A call's example: its layout and modes without its tensors, to trace the same signature again.

Why. A precompiled artifact (surgery.runtime.precompiled) is made when the bundle is saved, long
after the calls it stands for; keeping their tensors would hold activations (and a KV cache's
views) alive for the whole warm-up. What torch's AOT path needs to trace a call again is its
layout: each tensor's shape, strides, dtype, device, ``requires_grad`` and whether it is an
inference tensor (dynamo guards on that, and on the dispatch keys that follow from it); scalars,
strings and None by value; plain tuples, lists and str-keyed dicts of these, four levels deep; and
the grad, inference and autocast modes the call ran under. ``Example.of`` records that (None for
anything else: an object argument, a tensor subclass, a sparse tensor), ``Example.build`` makes
fresh tensors of the same layout with random values, and ``modes_of`` enters the modes again,
which an artifact needs both when it is traced and when it is loaded (torch rebuilds its tensor
guards from the thread's modes).

The modes' record is what a bundle's index stores (surgery.runtime.bundle_parts checks it against
fixed lists before ``modes_of`` sees it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

_MAX_DEPTH = 4


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    inference: bool  # an inference tensor (dynamo guards on it)


_NOT_EXAMPLE = object()


def _spec(obj: Any, depth: int) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return _NOT_EXAMPLE  # sparse, or a subclass whose type dynamo guards on
        return _TensorSpec(tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device,
                           obj.requires_grad, obj.is_inference())
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth < _MAX_DEPTH and type(obj) in (tuple, list):
        items = [_spec(o, depth + 1) for o in obj]
        return _NOT_EXAMPLE if any(i is _NOT_EXAMPLE for i in items) else type(obj)(items)
    if depth < _MAX_DEPTH and type(obj) is dict and all(isinstance(k, str) for k in obj):
        out = {k: _spec(v, depth + 1) for k, v in obj.items()}
        return _NOT_EXAMPLE if any(v is _NOT_EXAMPLE for v in out.values()) else out
    return _NOT_EXAMPLE


def _build(spec: Any, gen: torch.Generator) -> Any:
    if isinstance(spec, _TensorSpec):
        with torch.inference_mode(spec.inference):  # a normal tensor inside inference mode too
            t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype,
                                    device=spec.device)
            if t.is_floating_point() or t.is_complex():
                t.normal_(generator=gen if t.device.type == "cpu" else None)
            else:
                t.zero_()
        return t.requires_grad_(spec.requires_grad) if spec.requires_grad else t
    if isinstance(spec, (tuple, list)):
        return type(spec)(_build(s, gen) for s in spec)
    if isinstance(spec, dict):
        return {k: _build(v, gen) for k, v in spec.items()}
    return spec


@dataclass(frozen=True)
class Example:
    """A call's layout and modes (no tensor data), to trace the same signature again."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each autocast on

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Example | None:
        """The example of this call, or None when it holds something other than tensors,
        scalars, strings, None and plain containers of them."""
        a = _spec(tuple(args), 0)
        k = _spec(dict(kwargs), 0)
        if a is _NOT_EXAMPLE or k is _NOT_EXAMPLE:
            return None
        autocast = tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                         if torch.is_autocast_enabled(d))
        return cls(a, k, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)

    def modes(self) -> contextlib.AbstractContextManager[None]:
        """The grad, inference and autocast modes of the recorded call."""
        return modes_of(self.mode_record())

    def mode_record(self) -> dict[str, Any]:
        """The modes as an index entry stores them (surgery.runtime.bundle.ENTRY_FIELDS)."""
        return {"grad": self.grad, "inference": self.inference,
                "autocast": [[d, str(t).removeprefix("torch.")] for d, t in self.autocast]}

    def build(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh tensors of the recorded layout (random values: tracing needs no real data).
        Call inside ``modes()``, so that they are inference tensors when the call's were."""
        gen = torch.Generator().manual_seed(0)
        return _build(self.args, gen), _build(self.kwargs, gen)


@contextlib.contextmanager
def modes_of(record: Mapping[str, Any]) -> Iterator[None]:
    """Enter the modes of an entry (checked by surgery.runtime.bundle: names from fixed lists).

    An artifact is traced under them and must be *loaded* under them too: torch rebuilds its
    tensor guards, dispatch keys included, from the thread's modes when it loads one.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(True) if record["inference"]
                            else torch.set_grad_enabled(record["grad"]))
        for dev, dtype in record["autocast"]:
            stack.enter_context(torch.autocast(dev, dtype=getattr(torch, dtype)))
        yield
