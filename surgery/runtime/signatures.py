"""Call signatures as a plan records them and a deployment checks them. Needs only torch.

A signature is what a compiled callable guards on and what a captured CUDA graph replays: each
argument's shape, dtype and strides, the values of ints, floats, bools and strings, the structure
of lists and dicts, and the autocast and grad state. ``surgery plan --input`` writes the rendered
signatures it saw under ``[region.evidence]``; at runtime ``SignatureCheck`` warns once per region
path when a call shows one the plan never saw, since that call compiles (or captures) anew and
the plan's evidence no longer describes it.
"""

from __future__ import annotations

import inspect
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
        contiguous = stride == _contiguous_stride(shape)
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
    if torch.is_inference_mode_enabled():
        out.append("inference_mode")
    elif not torch.is_grad_enabled():
        out.append("no_grad")
    return tuple(out)


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

    def __init__(self, path: str, fn: Callable[..., Any], observed: Sequence[str]) -> None:
        self.path = path
        self.fn = fn
        self.observed = frozenset(observed)
        self.met: set[Any] = set()
        self.warned = False

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned:
            return
        cheap = (tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                       (a if isinstance(a, (int, float, bool, str)) or a is None else type(a))
                       for a in args), tuple(sorted(kwargs)), torch.is_grad_enabled(),
                 torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
        if cheap in self.met:
            return
        self.met.add(cheap)
        sig = signature_of(self.fn, args, kwargs).render()
        if sig in self.observed:
            return
        self.warned = True
        seen = "; ".join(sorted(self.observed)[:2])
        warnings.warn(f"surgery: region path {self.path!r} was called with ({sig}), a signature "
                      f"its plan never observed (it saw: {seen}); it compiles anew. Re-plan with "
                      f"an --input that runs the model as deployed.", UnplannedSignatureWarning,
                      stacklevel=4)


def signature_check(evidence: dict[str, Any] | None, path: str,
                    fn: Callable[..., Any]) -> SignatureCheck | None:
    """The check for one region path, or None when its region carries no observed signatures."""
    if not evidence or not evidence.get("signatures"):
        return None
    return SignatureCheck(path, fn, evidence["signatures"])
