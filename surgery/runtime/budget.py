"""Recompile budgets: one dynamo cache per group, and a bounded number of signatures per path.

Why. Dynamo keys its cache and its recompile limit on the *code object* it compiles, so every
``torch.compile`` of ``SomeClass.forward`` shares one cache: distinct groups, a second handle,
or another model of the same class after ``restore()`` all spend one budget, and past dynamo's
limit (8) a ``fullgraph`` compile raises ``FailOnRecompileLimitHit`` out of the forward. Real
blocks recompile for reasons the manifest cannot see: an int argument that differs per call or
per instance (``layer_idx``), a batch size that varies, an autocast state flipped by a head.

The contract:

- **Own code object.** Each group compiles a copy of its function with a fresh code object
  (``fresh_function``), so its dynamo cache starts empty and dies with the group.
- **Signatures first.** Before a path calls its compiled callable, surgery computes the call's
  signature (``call_signature``): grad mode, inference mode, autocast, the module's ``training``
  flag, and every argument: a tensor's shape, strides, dtype, device, ``requires_grad`` and
  inference flag; a scalar's value; a sequence's length; another object's type. These are what
  dynamo guards on. A signature the path has not seen is a compile; ``explain_new`` names what
  differs from the nearest seen one, and ``fix_for`` says how to avoid it.
- **Bounded.** A path may see ``max_signatures`` signatures (compile key, default
  ``DEFAULT_MAX_SIGNATURES``); the runtime (surgery.runtime.slots) then demotes it, to a dynamic
  compile where only shapes or int values differ, else to eager. Guards the signature cannot see (an
  object argument's attributes) are caught by counting real compiles per path.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

DEFAULT_MAX_SIGNATURES = 4
# Differences a dynamic compile can absorb (dynamic=True makes sizes and ints symbolic).
DYNAMIC_KINDS = frozenset({"shape", "stride", "int"})
# Nesting of sequences and dicts walked into a signature; deeper ones count by length only.
_MAX_DEPTH = 3
_MAX_ITEMS = 64

Signature = tuple[tuple[str, Any], ...]


def fresh_function(target: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``target`` with a code object of its own, so dynamo caches it separately.

    A plain function is copied (same globals, defaults and closure, so zero-argument ``super()``
    still works). Anything else (a builtin, a callable object) is called through a small
    trampoline whose code object is made fresh for this call.
    """
    if isinstance(target, types.FunctionType):
        fn = types.FunctionType(target.__code__.replace(), target.__globals__, target.__name__,
                                target.__defaults__, target.__closure__)
        fn.__kwdefaults__ = dict(target.__kwdefaults__) if target.__kwdefaults__ else None
        fn.__qualname__ = target.__qualname__
        fn.__module__ = target.__module__
        fn.__doc__ = target.__doc__
        fn.__dict__.update(target.__dict__)
        return fn

    def trampoline(*args: Any, **kwargs: Any) -> Any:
        return target(*args, **kwargs)

    return types.FunctionType(trampoline.__code__.replace(), trampoline.__globals__,
                              "surgery_trampoline", None, trampoline.__closure__)


def parameter_names(fn: Callable[..., Any]) -> list[str]:
    """Names of the positional parameters of a bound callable, for naming signature entries."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


# torch's own "is any autocast on" (one C call); without it, ask each device.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
_NO_AUTOCAST = (False, False)


def _autocast_state() -> tuple[Any, ...]:
    if _any_autocast is not None and not _any_autocast():
        return _NO_AUTOCAST
    out: list[Any] = []
    for dev in ("cpu", "cuda"):
        on = torch.is_autocast_enabled(dev)
        out.append(torch.get_autocast_dtype(dev) if on else False)
    return tuple(out)


def call_signature(names: Sequence[str], module: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Signature:
    """What dynamo would guard on for this call, as (label, value) pairs in a fixed order."""
    sig: list[tuple[str, Any]] = [
        ("grad mode", torch.is_grad_enabled()),
        ("inference mode", torch.is_inference_mode_enabled()),
        ("autocast", _autocast_state()),
        ("training", module.training),
    ]
    for i, a in enumerate(args):
        _walk(names[i] if i < len(names) else f"args[{i}]", a, sig, 0)
    for k in sorted(kwargs):
        _walk(k, kwargs[k], sig, 0)
    return tuple(sig)


def _walk(label: str, obj: Any, sig: list[tuple[str, Any]], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        # torch.Size is a tuple; get_device() is an int (-1: CPU), cheaper than .device
        sig.append((label, ("tensor", obj.shape, obj.stride(), obj.dtype, obj.get_device(),
                            obj.requires_grad, obj.is_inference())))
    elif isinstance(obj, bool):
        sig.append((label, ("bool", obj)))
    elif isinstance(obj, int):
        sig.append((label, ("int", obj)))
    elif isinstance(obj, float):
        # dynamo passes floats as inputs unless told to specialise on them
        specialise = getattr(torch._dynamo.config, "specialize_float", False)
        sig.append((label, ("float", obj) if specialise else ("float",)))
    elif isinstance(obj, str) or obj is None:
        sig.append((label, (type(obj).__name__, obj)))
    elif isinstance(obj, (tuple, list)):
        sig.append((label, (type(obj).__name__, len(obj))))
        if depth < _MAX_DEPTH and len(obj) <= _MAX_ITEMS:
            for i, o in enumerate(obj):
                _walk(f"{label}[{i}]", o, sig, depth + 1)
    elif isinstance(obj, dict):
        keys = sorted(obj, key=str)
        sig.append((label, ("dict", tuple(str(k) for k in keys))))
        if depth < _MAX_DEPTH and len(obj) <= _MAX_ITEMS:
            for k in keys:
                _walk(f"{label}[{k!r}]", obj[k], sig, depth + 1)
    else:
        sig.append((label, ("object", type(obj).__qualname__)))


# --- explaining a new signature ----------------------------------------------------------------

def _describe(label: str, new: Any, old: Any) -> tuple[str, str]:
    """(kind, text) for one differing entry."""
    if label == "grad mode":
        return "grad", f"grad mode {'on' if new else 'off'} (was {'on' if old else 'off'})"
    if label == "inference mode":
        return "inference", f"inference mode {'on' if new else 'off'}"
    if label == "autocast":
        return "autocast", f"autocast state {_fmt_autocast(new)} (was {_fmt_autocast(old)})"
    if label == "training":
        return "training", f"module.training = {new} (was {old})"
    if new[0] != old[0]:
        return "structure", f"argument {label} is a {new[0]} (was a {old[0]})"
    if new[0] == "tensor":
        _, shape, stride, dtype, device, rg, inf = new
        _, oshape, ostride, odtype, odevice, org, _ = old
        shape, oshape = tuple(shape), tuple(oshape)
        if shape != oshape and _contiguous(shape, stride) == _contiguous(oshape, ostride):
            return "shape", f"shape of {label} {shape} (was {oshape})"
        if stride != ostride:
            return "stride", (f"strides of {label} {stride} (was {ostride}; "
                              "a non-contiguous input?)")
        if dtype != odtype or device != odevice:
            return "dtype", (f"{label} is {dtype} on {_device_name(device)} (was {odtype} on "
                             f"{_device_name(odevice)})")
        if rg != org:
            return "grad", f"{label}.requires_grad = {rg} (was {org})"
        return "inference", f"{label} is {'an' if inf else 'not an'} inference tensor"
    if new[0] == "int":
        return "int", f"int argument {label} = {new[1]} (was {old[1]})"
    if new[0] in ("tuple", "list"):
        return "structure", f"{new[0]} argument {label} has {new[1]} items (was {old[1]})"
    if new[0] == "dict":
        return "structure", f"dict argument {label} has keys {list(new[1])} (was {list(old[1])})"
    if new[0] == "object":
        return "structure", f"argument {label} is a {new[1]} (was a {old[1]})"
    return "scalar", f"{new[0]} argument {label} = {new[1]!r} (was {old[1]!r})"


def _device_name(index: int) -> str:
    return "cpu" if index < 0 else f"device {index}"


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


def _fmt_autocast(state: tuple[Any, ...]) -> str:
    parts = [f"{dev}:{str(d).replace('torch.', '') if d else 'off'}"
             for dev, d in zip(("cpu", "cuda"), state, strict=True)]
    return "/".join(parts)


def diff(new: Signature, old: Signature) -> list[tuple[str, str]]:
    """What differs between two signatures, as (kind, text), in signature order."""
    if [lab for lab, _ in new] != [lab for lab, _ in old]:
        # A sequence that grew, or an argument added: name what differs among the entries both
        # have (a list's length), else the first entry only one has.
        was = dict(old)
        found = [_describe(lab, v, was[lab]) for lab, v in new if lab in was and v != was[lab]]
        if found:
            return found
        extra = next((lab for lab, _ in new if lab not in was), None)
        what = f" ({extra} is new)" if extra else ""
        return [("structure", f"the arguments' structure changed{what}")]
    return [_describe(lab, v, w) for (lab, v), (_, w) in zip(new, old, strict=True) if v != w]


def explain_new(new: Signature, seen: Sequence[Signature]) -> list[tuple[str, str]]:
    """Why ``new`` is a compile: its differences from the nearest signature already seen."""
    if not seen:
        return []
    return min((diff(new, s) for s in reversed(seen)), key=len)  # ties: the latest seen


def fix_for(kinds: Sequence[tuple[str, str]]) -> str:
    """The fix to suggest for the differences seen (the first kind that has one)."""
    for kind, text in kinds:
        if kind == "int":
            name = text.split(" = ")[0].removeprefix("int argument ")
            return (f"int argument {name} differs per call: make it a tensor, or exclude the "
                    "region")
        if kind == "shape":
            return ("shapes vary from call to call: set dynamic = true on the region, or call "
                    "it with a few fixed (padded) shapes")
        if kind == "stride":
            return "pass contiguous inputs (.contiguous()), or set dynamic = true"
        if kind == "autocast":
            return ("it runs under more than one autocast state: call it in one state, or "
                    "exclude the region")
        if kind in ("grad", "inference"):
            return ("warm up in the grad mode you infer in (no_grad or inference_mode), and "
                    "pass tensors of one kind")
        if kind == "training":
            return "call model.eval() (or train()) before apply_manifest, not in between"
        if kind == "dtype":
            return "call it with one dtype and device"
    return ("an argument's structure or value differs per call (a growing cache?): exclude the "
            "region, or plan its fixed-shape parts")


def dynamic_helps(kinds: Sequence[tuple[str, str]]) -> bool:
    """Whether a dynamic compile can absorb these differences (sizes and int values only)."""
    return bool(kinds) and all(k in DYNAMIC_KINDS for k, _ in kinds)
