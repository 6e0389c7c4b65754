"""Dynamo's guards on a piecewise path's module tree, traded for one check of the dicts they read.

Why. A decode token of the GPT-2 piecewise stack enters dynamo once, and dynamo then checks
every guard of the stack's frame: 3,915 guard lines on GPT-2 small, about 2,300 of them on the
module tree (each block's submodules' types, ``eps``, ``head_dim``, ``nf``, dropout ``p``, the
``training`` flags, which attributes an instance dict does not hold, the lengths and keys of
``_modules``). In the token's real run that check took ~1.2 ms of a ~5 ms token on a 2-core CPU,
~0.8 ms of it on the module tree (benchmarks/RESULTS.md, "Issue 19 (w19g)"). Those facts do not
change while a model decodes, and every one of them is a value read through instance dicts.

The trade. For a piecewise group with ONE path (a stack region: its frame's module is always
the same object), a ``guard_filter_fn`` drops a guard only when all of this holds:

- its source is a plain chain from the frame's module argument: ``self``, then only
  ``.name`` (an instance-dict attribute) and ``._modules[...]`` / ``._parameters[...]`` /
  ``._buffers[...]`` steps, each resolving through an instance dict on the live module;
- the value it guards is immutable (None, bool, int, float, str, a dtype, a device, a tuple
  or frozenset of these), a module, a dict reached that way, or a plain object (a config);
  never a tensor, a function, a list or a set (their guards are kept: TENSOR_MATCH on every
  parameter stays, so shapes, dtypes, strides and devices are still dynamo's to check);
- its kind is one of ``DROPPABLE`` (type, identity, value, key and length matches; never an
  aliasing guard, whose other side may lie outside the tree).

What covers each dropped guard: every dict read along those chains (each module's ``__dict__``
and its ``_modules``, ``_parameters``, ``_buffers``, a config's ``__dict__``) is watched by its
CPython version tag (``torch._C._dynamo.guards.dict_version``, the tag dynamo's own DICT_VERSION
guards read: any store, delete or insert into the dict moves it), and every object along them by
its type. Before each call the path compares the tags (one C-level ``map``) and the types. A
moved tag is not yet a change (``model.train(); model.eval()`` stores the same flags again):
the dict's items are compared with the snapshot taken when the guards were built (values by
identity, immutable ones by value); equal, the tags are taken again. Different, the watch ends:
the group compiles afresh WITHOUT the filter (dynamo's full guards from then on, recompiling on
its own for any later change), the path's record says why, and the changed call runs that
fresh compile. A class attribute, a property, a hook dict (dynamo skips hook guards by default,
``skip_nnmodule_hook_guards``) or anything reached otherwise is not a plain chain: its guards
are kept as they were.

Where the tag cannot be trusted (a Python whose dicts no longer move it: tested once on import,
by mutating a dict), or dynamo has no ``guard_filter_fn``, nothing is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

try:  # dynamo's TENSOR_MATCH check, for many tensors in one call
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover (every torch we support has it)
    TensorGuards = None

# The guard kinds a watched chain covers: type, identity, value, and key/length matches.
DROPPABLE = frozenset({
    "TYPE_MATCH", "ID_MATCH", "EQUALS_MATCH", "CONSTANT_MATCH", "NONE_MATCH", "TRUE_MATCH",
    "FALSE_MATCH", "BOOL_MATCH", "NOT_PRESENT_IN_GENERIC_DICT", "DICT_CONTAINS",
    "SEQUENCE_LENGTH", "LENGTH_CHECK", "DICT_LENGTH", "DICT_KEYS_MATCH", "DICT_KEYS",
    "TENSOR_MATCH"})
# TensorGuards kept for one watch (one per dispatch state: no_grad, inference_mode, autocast)
MAX_TENSOR_CHECKS = 4
# One step of a plain chain: a submodule/parameter/buffer by key, or an instance attribute.
_STEP = re.compile(r"\._(modules|parameters|buffers)\['([^'\\]+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)")
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_MAX_DEPTH = 32  # steps in a chain; GPT-2 small's deepest is 10
# Watch single-path groups' module trees (False: dynamo's full guards everywhere, as before)
WATCH_TREES = True


def _tags_work() -> Callable[[dict[Any, Any]], int] | None:
    """dynamo's dict_version if it moves on every change of a dict here, else None."""
    version = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    version = getattr(version, "dict_version", None)
    if version is None:
        return None
    d: dict[Any, Any] = {}
    try:
        seen = [version(d)]
        d["k"] = 0
        seen.append(version(d))
        d["k"] = 1
        seen.append(version(d))
        del d["k"]
        seen.append(version(d))
    except Exception:  # an odd build: keep every guard
        return None
    return version if len(set(seen)) == len(seen) else None


DICT_VERSION = _tags_work()


def immutable(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _IMMUTABLE):
        return True
    if isinstance(value, tuple | frozenset) and depth < 4:
        return all(immutable(v, depth + 1) for v in value)
    return False


def _plain_object(value: Any) -> bool:
    """A module, or an object whose state is its instance dict (a config), not a callable."""
    if isinstance(value, nn.Module):
        return True
    if callable(value) or isinstance(value, torch.Tensor | list | set | dict):
        return False
    return type(getattr(value, "__dict__", None)) is dict


def _same_items(now: list[tuple[Any, Any]], then: list[tuple[Any, Any]]) -> bool:
    if len(now) != len(then):
        return False
    for (k, v), (k0, v0) in zip(now, then, strict=True):
        if k != k0:
            return False
        if v is not v0 and not (immutable(v) and immutable(v0) and type(v) is type(v0)
                                and v == v0):
            return False
    return True


class TreeWatch:
    """The dicts and objects a piecewise group's dropped guards read, and their snapshot."""

    def __init__(self, root: Callable[[], nn.Module | None], arg: str) -> None:
        self.root = root  # the path's module, or None while the group has no single path
        self.arg = arg  # the frame's name for it (``self``)
        self.dicts: list[dict[Any, Any]] = []
        self.objs: list[Any] = []
        self.versions: list[int] = []
        self.types: list[type] = []
        self.items: list[list[tuple[Any, Any]]] = []
        self.tensors: list[torch.Tensor] = []  # parameters and buffers whose TENSOR_MATCH dropped
        self.meta: list[tuple[Any, ...]] = []  # their metadata when the guards were built
        self.checks: list[Any] = []  # TensorGuards of them, one per dispatch state seen
        self.dropped = 0  # guards dropped, over every compile of the group
        self.kept = 0  # guards on the module tree kept (not a plain chain, or not covered)
        self.ended = ""  # why the watch ended (the group compiled again with full guards)
        self._seen: set[int] = set()

    def filter(self, entries: Sequence[Any]) -> list[bool]:
        """dynamo's guard_filter_fn: False for each guard this watch covers."""
        module = self.root()
        if module is None or self.ended or DICT_VERSION is None:
            return [True] * len(entries)
        keep = []
        for e in entries:
            covered = self._cover(module, e)
            keep.append(not covered)
            if covered:
                self.dropped += 1
            elif self._on_tree(str(e.name)):
                self.kept += 1
        self.snapshot()
        return keep

    def end(self) -> str:
        """End the watch; returns the note for the path's record."""
        self.ended = (f"the module tree changed after its compile (a submodule, parameter or "
                      f"attribute that {self.dropped} dropped guard(s) read): compiled again "
                      "with dynamo's full guards")
        return self.ended

    def unchanged(self) -> bool:
        """True while nothing a dropped guard read has changed (a few C-level calls a call)."""
        assert DICT_VERSION is not None
        if list(map(DICT_VERSION, self.dicts)) != self.versions:
            if not all(map(_same_items, map(_items, self.dicts), self.items)):
                return False
            self.versions = list(map(DICT_VERSION, self.dicts))  # stored again, same values
        if list(map(type, self.objs)) != self.types:
            return False
        return not self.tensors or self._tensors_same()

    def _tensors_same(self) -> bool:
        tensors = self.tensors
        if self.checks[0].check(*tensors):
            return True
        for i, c in enumerate(self.checks[1:], 1):  # another dispatch state seen before
            if c.check(*tensors):
                self.checks.insert(0, self.checks.pop(i))
                return True
        if list(map(_meta, tensors)) != self.meta or len(self.checks) >= MAX_TENSOR_CHECKS:
            return False
        self.checks.insert(0, _tensor_check(tensors))  # same tensors, a new dispatch state
        return True

    def snapshot(self) -> None:
        assert DICT_VERSION is not None
        self.versions = list(map(DICT_VERSION, self.dicts))
        self.types = list(map(type, self.objs))
        self.items = list(map(_items, self.dicts))
        grew = len(self.meta) != len(self.tensors)  # a compile covered more tensors
        self.meta = list(map(_meta, self.tensors))
        if grew:
            self.checks = [_tensor_check(self.tensors)] if self.tensors else []
        elif self.tensors and not any(c.check(*self.tensors) for c in self.checks):
            self.checks.insert(0, _tensor_check(self.tensors))  # compiled in a new state
            del self.checks[MAX_TENSOR_CHECKS:]

    def _on_tree(self, name: str) -> bool:
        return name == self.arg or name.startswith((f"{self.arg}.", f"L['{self.arg}']"))

    def _cover(self, module: nn.Module, entry: Any) -> bool:
        if entry.guard_type not in DROPPABLE:
            return False
        name = str(entry.name)
        prefix = next((p for p in (f"L['{self.arg}']", self.arg) if name.startswith(p)), None)
        if prefix is None:
            return False
        steps = list(_STEP.finditer(name, len(prefix)))
        if sum(len(m.group(0)) for m in steps) != len(name) - len(prefix) or \
                len(steps) > _MAX_DEPTH:
            return False  # not a plain chain (a call, a type(), a closure, an index)
        obj: Any = module
        dicts: list[dict[Any, Any]] = []
        objs: list[Any] = []
        for m in steps:
            own = getattr(obj, "__dict__", None)
            if type(own) is not dict or not _plain_object(obj):
                return False
            dicts.append(own)
            objs.append(obj)
            kind, key, attr = m.groups()
            if kind is not None:
                sub = own.get(f"_{kind}")
                if not isinstance(sub, dict) or key not in sub:
                    return False
                dicts.append(sub)
                obj = sub[key]
            elif attr in own:
                obj = own[attr]
            else:
                return False  # a class attribute or a property: not an instance dict's
        tensor = entry.guard_type == "TENSOR_MATCH"
        if tensor:
            if not isinstance(obj, torch.Tensor) or TensorGuards is None or any(
                    hasattr(obj, a) for a in _MARKS):
                return False  # a tensor with a dynamic dim (a cache): dynamo keeps its guard
        elif isinstance(obj, dict):
            dicts.append(obj)
        elif _plain_object(obj):
            dicts.append(vars(obj))
            objs.append(obj)
        elif not immutable(obj):
            return False  # a tensor, a function, a list: dynamo keeps its guard
        if tensor and id(obj) not in self._seen:
            self._seen.add(id(obj))
            self.tensors.append(obj)
        for d in dicts:
            if id(d) not in self._seen:
                self._seen.add(id(d))
                self.dicts.append(d)
        for o in objs:
            if id(o) not in self._seen:
                self._seen.add(id(o))
                self.objs.append(o)
        return True


def _items(d: dict[Any, Any]) -> list[tuple[Any, Any]]:
    return list(d.items())


# What a dim marked dynamic leaves on a tensor (torch._dynamo.decorators)
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices")


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """What TENSOR_MATCH checks of a tensor, as Python values (to tell a change from a new
    dispatch state, e.g. inference_mode, under which the C check reads other keys)."""
    return (type(t), t.dtype, t.device, t.layout, tuple(t.shape), t.stride(), t.requires_grad)


def _tensor_check(tensors: list[torch.Tensor]) -> Any:
    """dynamo's TENSOR_MATCH of each tensor, static sizes and strides, in this dispatch state."""
    assert TensorGuards is not None
    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


# torch.compile takes a guard_filter_fn from 2.8 on (these helpers came with it)
_HAS_FILTER = hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")


def watch_for(target: Callable[..., Any], bound: bool,
              root: Callable[[], nn.Module | None]) -> TreeWatch | None:
    """A watch for a group compiling ``target`` (called with its module first when bound), or
    None where it cannot work: off, tags untrusted, no module argument, no guard filter hook."""
    code = getattr(target, "__code__", None)
    if not (WATCH_TREES and _HAS_FILTER and bound) or DICT_VERSION is None or code is None \
            or code.co_argcount < 1:
        return None
    return TreeWatch(root, code.co_varnames[0])


def compile_watched(fn: Callable[..., Any], backend: Callable[..., Any],
                    watch: TreeWatch | None) -> Callable[..., Any]:
    """``torch.compile`` of a piecewise group's function, with the watch's filter if any."""
    options = {"guard_filter_fn": watch.filter} if watch is not None else None
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=None, options=options)
