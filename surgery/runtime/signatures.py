"""Call signatures as a plan records them and a deployment checks them. Needs only torch.

A signature is what a compiled callable guards on and what a captured CUDA graph replays: each
argument's shape, dtype and strides, the values of ints, floats, bools and strings, the structure
of lists and dicts, and the autocast and grad state. ``surgery plan --input`` writes the rendered
signatures it saw under ``[region.evidence]``; at runtime ``SignatureCheck`` warns once per region
path when a call shows one the plan never saw, since the plan's evidence no longer describes it.

Two rules keep that warning for real differences:

- **Grad modes.** ``no_grad`` and ``inference_mode`` are one context here (``no_grad``): both run
  without autograd, a graph captured under either replays the same kernels, and the README's own
  flow plans under ``no_grad`` and deploys under ``inference_mode``. (The runtime still keys its
  graphs on inference mode, surgery.runtime.graphs.replay; what this removes is a warning for
  identical shapes, once per region.) Manifests written before say ``inference_mode``; it
  reads as ``no_grad``.
- **Dynamic regions.** A region planned ``dynamic = true`` records its signatures with ``*`` in
  its ``dynamic_dims`` (``x=f32[*,16]``); a call is compared in the same form, so any size there
  is planned.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_LIST_SHOWN = 3  # list elements spelled out in a rendered signature


def _dtype(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "").replace("float", "f").replace("bfloat", "bf") \
        .replace("int", "i").replace("complex", "c")


def describe(value: Any, depth: int = 0) -> Any:
    """A hashable description of one argument: what a compiled callable would guard on."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), _dtype(value.dtype), tuple(value.stride()),
                value.device.type, value.requires_grad)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return (type(value).__name__, value)
    if depth > 4:
        return ("obj", type(value).__name__)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(describe(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), describe(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (torch.dtype, torch.device)):
        return (type(value).__name__, str(value))
    return ("obj", type(value).__name__)


def render(desc: Any) -> str:
    """Short human form of a ``describe`` result: ``bf16[1,999,1024]``, ``3``, ``list(4)[...]``."""
    kind = desc[0]
    if kind == "T":
        _, shape, dt, stride, _dev, _grad = desc
        contiguous = stride == (_wild_stride(shape) if "*" in shape else
                                _contiguous_stride(shape))
        return f"{dt}[{','.join(map(str, shape))}]" + ("" if contiguous else f"@{stride}")
    if kind in ("list", "tuple"):
        items = [render(d) for d in desc[1][:_LIST_SHOWN]]
        more = ",..." if len(desc[1]) > _LIST_SHOWN else ""
        return f"{kind}({len(desc[1])})[{','.join(items)}{more}]"
    if kind == "dict":
        return "{" + ",".join(f"{k}:{render(v)}" for k, v in desc[1][:_LIST_SHOWN]) + "}"
    if kind == "obj":
        return f"<{desc[1]}>"
    return repr(desc[1])


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def context() -> tuple[str, ...]:
    """Autocast and grad state, which a compiled callable and a captured graph depend on."""
    out = []
    for dev in ("cuda", "cpu"):
        if torch.is_autocast_enabled(dev):
            out.append(f"autocast({dev},{_dtype(torch.get_autocast_dtype(dev))})")
    if not torch.is_grad_enabled():  # inference_mode too: one state for a plan (module docstring)
        out.append(GRAD_OFF)
    return tuple(out)


GRAD_OFF = "no_grad"  # the context token of no_grad and of inference_mode
_OLD_GRAD_OFF = "inference_mode"  # what manifests before issue 18 wrote for inference_mode


def same_grad_mode(rendered: str) -> str:
    """A rendered signature with an old manifest's ``inference_mode`` read as ``no_grad``."""
    parts = rendered.split(", ")
    return ", ".join(GRAD_OFF if p == _OLD_GRAD_OFF else p for p in parts)


def wildcard(sig: Signature, dims: dict[str, list[int]]) -> Signature:
    """``sig`` with the sizes in ``dims`` replaced by ``*`` (how a dynamic region records it).

    A non-contiguous tensor's strides become ``*`` too, since they follow its sizes.
    """
    args = []
    for name, d in sig.args:
        if name in dims and d[0] == "T":
            shape = tuple("*" if i in dims[name] else n for i, n in enumerate(d[1]))
            contiguous = tuple(d[3]) == _contiguous_stride(d[1])
            stride = _wild_stride(shape) if contiguous else tuple("*" for _ in d[3])
            d = ("T", shape, d[2], stride, *d[4:])
        args.append((name, d))
    return Signature(tuple(args), sig.context)


def _wild_stride(shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """The contiguous stride of a shape with ``*`` dims, so that render() shows no stride."""
    out: list[Any] = []
    acc: Any = 1
    for n in reversed(shape):
        out.append(acc)
        acc = "*" if n == "*" or acc == "*" else acc * max(n, 1)
    return tuple(reversed(out))


def group_key(target: Callable[..., Any], options: list[Any], module: torch.nn.Module,
              group: str | None) -> tuple[Any, ...]:
    """Which region paths share one compiled copy of ``target`` (surgery.runtime.groups).

    The same function with the same compile options, weights of the same layout (a parameter's
    shape is a guard: two widths would only fill one dynamo cache with each other's signatures)
    and the same manifest ``group`` name (a plan that split one layout by signature keeps the
    parts apart, each within its budget).
    """
    return (id(target), json.dumps(options, sort_keys=True, default=str), weight_layout(module),
            group)


def weight_layout(module: torch.nn.Module) -> int:
    """A hash of the names, shapes and dtypes of a module's parameters and buffers."""
    return hash(tuple((k, tuple(v.shape), v.dtype) for k, v in
                      (*module.named_parameters(), *module.named_buffers())))


@dataclass(frozen=True)
class Signature:
    """One call's arguments (named where the callable's signature names them) and context."""

    args: tuple[tuple[str, Any], ...]
    context: tuple[str, ...]

    def render(self) -> str:
        parts = [f"{name}={render(d)}" for name, d in self.args]
        return ", ".join(parts + list(self.context))


_NAMES: dict[Any, list[str]] = {}


def _param_names(fn: Callable[..., Any], key: Any) -> list[str]:
    names = _NAMES.get(key)
    if names is None:
        try:
            ps = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            ps = []
        names = [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        _NAMES[key] = names
    return names


def bind_args(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
              key: Any = None) -> list[tuple[str, Any]]:
    """Arguments named as ``fn`` names them (``arg3`` past its named ones), kwargs sorted."""
    names = _param_names(fn, key if key is not None else getattr(fn, "__func__", fn))
    named = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)]
    return named + sorted(kwargs.items())


def signature_of(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
                 key: Any = None) -> Signature:
    return Signature(tuple((n, describe(a)) for n, a in bind_args(fn, args, kwargs, key=key)),
                     context())


class UnplannedSignatureWarning(UserWarning):
    """A region saw a call signature that `surgery plan --input` never observed."""


class SignatureCheck:
    """Warns once when a region path is called with a signature its plan did not observe.

    It renders a signature only for a call whose cheap key (top-level tensor shapes and dtypes,
    scalar values, autocast) it has not met, so repeated calls cost a tuple build and a lookup.
    """

    def __init__(self, path: str, fn: Callable[..., Any], observed: Sequence[str], *,
                 dynamic_dims: dict[str, list[int]] | None = None) -> None:
        self.path = path
        self.fn = fn
        self.observed = frozenset(same_grad_mode(s) for s in observed)
        self.dynamic_dims = dynamic_dims or None
        self.met: set[Any] = set()
        self.warned = False
        self.grad_off: str | None = None  # the first grad-off mode it ran under
        self.mode_warned = False

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned and self.mode_warned:
            return
        inference = torch.is_inference_mode_enabled()
        cheap = (tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                       (a if isinstance(a, (int, float, bool, str)) or a is None else type(a))
                       for a in args), tuple(sorted(kwargs)), torch.is_grad_enabled(), inference,
                 torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
        if cheap in self.met:
            return
        self.met.add(cheap)
        self._check_mode(inference)
        if self.warned:
            return
        full = signature_of(self.fn, args, kwargs)
        if self.dynamic_dims:
            full = wildcard(full, self.dynamic_dims)
        sig = full.render()
        if sig in self.observed:
            return
        self.warned = True
        seen = "; ".join(sorted(self.observed)[:2])
        warnings.warn(f"surgery: region path {self.path!r} was called with ({sig}), a signature "
                      f"its plan never observed (it saw: {seen}); the plan's evidence does not "
                      f"describe this call, which costs a compile and a graph of its own unless "
                      f"warm-up already ran it. Re-plan with an --input that runs the model as "
                      f"deployed.", UnplannedSignatureWarning, stacklevel=4)

    def _check_mode(self, inference: bool) -> None:
        """One plan serves both grad-off modes, but one compiled graph does not: dynamo guards
        on inference mode (checked on torch 2.13: a function compiled under no_grad compiles
        again under inference_mode). Say so once when a path switches between them."""
        if torch.is_grad_enabled() or self.mode_warned:
            return
        mode = "inference_mode" if inference else "no_grad"
        if self.grad_off is None:
            self.grad_off = mode
            return
        if mode != self.grad_off:
            self.mode_warned = True
            warnings.warn(f"surgery: region path {self.path!r} ran under {self.grad_off} and now "
                          f"under {mode}: its plan is the same, but dynamo compiles it again and "
                          f"another CUDA graph is captured (a compiled graph guards on inference "
                          f"mode). Warm up under the mode you deploy in.", GradModeWarning,
                          stacklevel=4)


class GradModeWarning(UserWarning):
    """A region path ran under both no_grad and inference_mode: it compiles once for each."""


def signature_check(evidence: dict[str, Any] | None, path: str, fn: Callable[..., Any],
                    dynamic_dims: dict[str, list[int]] | None = None) -> SignatureCheck | None:
    """The check for one region path, or None when its region carries no observed signatures."""
    if not evidence or not evidence.get("signatures"):
        return None
    return SignatureCheck(path, fn, evidence["signatures"], dynamic_dims=dynamic_dims)
