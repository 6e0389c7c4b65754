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

- its source is a plain chain from the frame's module argument (``self``) or from one of the
  frame's globals (``G['name']``), then only ``.name`` (an instance-dict attribute, never a class
  attribute or a property), ``._modules[...]`` / ``._parameters[...]`` / ``._buffers[...]`` and
  ``['key']`` (a dict's item) steps, each resolving through a dict on the live objects;
- the value it guards is immutable (None, bool, int, float, str, a dtype, a device, a tuple or
  frozenset of these), a module or plain object (a config), a dict, a plain function, or a
  parameter/buffer under TENSOR_MATCH (never one with a dim marked dynamic: a cache); never a
  list, a set, a class or a builtin;
- its kind is one of ``DROPPABLE`` (type, identity, value, key and length matches, closures,
  TENSOR_MATCH; never an aliasing guard, whose other side may lie outside the tree).

What covers each dropped guard, checked before every call of the path:

- **The values the chains read** (a value match only on an immutable value; on anything else
  only identity, type and key guards are dropped): every dict a chain steps through (a module's
  ``__dict__`` and its ``_modules``/``_parameters``/``_buffers``, a config's, the frame's
  globals) by its CPython version tag (``torch._C._dynamo.guards.dict_version``, the tag of
  dynamo's own DICT_VERSION guards: every store, delete or insert moves it), one C-level ``map``
  over all of them.
- **Keys and lengths** (NOT_PRESENT_IN_GENERIC_DICT, DICT_CONTAINS, lengths, key matches): the
  guarded object's own dict, the same way; on a moved tag its keys are compared (never a Python
  module's dict: imports add to it).
- **Types** of every object along the chains (``__class__`` can be assigned without a dict
  store), and the ``__code__`` of each function (swappable the same way).
- **Parameters' metadata** (TENSOR_MATCH: type, dtype, device, layout, sizes, strides,
  requires_grad, dispatch keys): dynamo's own ``TensorGuards`` over all of them in one call, one
  per dispatch state seen (no_grad, inference_mode), at most ``MAX_TENSOR_CHECKS``. A marking
  guard on a parameter (``_dynamo_dynamic_indices``) goes with it: a mark only changes which
  graph dynamo would build for another shape, which this check refuses anyway.

A moved tag is not yet a change (``model.train(); model.eval()`` stores the same flags again;
dynamo sets a flag in a module's globals while it compiles): what the guards read of the dict
(the items at a chain's keys, a dict's key list for key guards) is compared with the snapshot
taken when the guards were built (values by identity, immutable ones by value); equal, the tags
are taken again. Different, the watch ends: the group compiles afresh WITHOUT the filter
(dynamo's full guards from then on, recompiling on its own for any later change), the path's
record says why, and the changed call runs that fresh compile. A hook dict (dynamo skips hook
guards by default, ``skip_nnmodule_hook_guards``), a closure cell, a class's dict, or anything
reached otherwise is not a plain chain: those guards are kept as they were. The watch holds the
objects it checks (the old parameter of a replaced one stays alive until the next call ends the
watch).

Where the tag cannot be trusted (a Python whose dicts no longer move it: tested once on import,
by mutating a dict), or dynamo has no ``guard_filter_fn``, nothing is dropped.

**Not where dynamo already skips the tree** by recursive dict tags (its default in torch
2.10/2.11, off in 2.14): the guards a watch drops are then nearly free and its own check is pure
cost (torch 2.11, token's real run: 615 us of guards + 218 us of watch against 636 us of full
guards; benchmarks/RESULTS.md, x19g), so ``watch_for`` gives none (the record: DICT_TAGS_NOTE).
"""

from __future__ import annotations

import operator
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# dynamo's TENSOR_MATCH check, for many tensors in one call (every torch we support has it)
TensorGuards: Any = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
TensorGuards = getattr(TensorGuards, "TensorGuards", None)

# The guard kinds a watched chain covers: type, identity, value, and key/length matches.
DROPPABLE = frozenset({
    "TYPE_MATCH", "ID_MATCH", "EQUALS_MATCH", "CONSTANT_MATCH", "NONE_MATCH", "TRUE_MATCH",
    "FALSE_MATCH", "BOOL_MATCH", "NOT_PRESENT_IN_GENERIC_DICT", "DICT_CONTAINS",
    "SEQUENCE_LENGTH", "LENGTH_CHECK", "DICT_LENGTH", "DICT_KEYS_MATCH", "DICT_KEYS",
    "TENSOR_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH", "MODULE_MATCH"})
# Of them, those that read a dict's keys (else a value's identity, type or value)
_WHOLE = frozenset({"NOT_PRESENT_IN_GENERIC_DICT", "DICT_CONTAINS", "SEQUENCE_LENGTH",
                    "LENGTH_CHECK", "DICT_LENGTH", "DICT_KEYS_MATCH", "DICT_KEYS"})
# Of them, those that read only a value's identity or type
_IDENTITY = frozenset({"TYPE_MATCH", "ID_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
                       "FUNCTION_MATCH"})
# TensorGuards kept for one watch (one per dispatch state: no_grad, inference_mode, autocast)
MAX_TENSOR_CHECKS = 4
# One step of a plain chain: a submodule/parameter/buffer by key, or an instance attribute.
_STEP = re.compile(r"\._(modules|parameters|buffers)\['([^'\\]+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)"
                   r"|\['([^'\\]+)'\]")
_GLOBAL = re.compile(r"G\['([A-Za-z_][A-Za-z0-9_]*)'\]")  # a global of the compiled frame
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_MAX_DEPTH = 32  # steps in a chain; GPT-2 small's deepest is 10
# Watch single-path groups' module trees (False: dynamo's full guards everywhere, as before)
WATCH_TREES = True
DICT_TAGS_NOTE = ("dynamo's full guards (its recursive dict tags skip the unchanged module "
                  "tree, so no tree watch: surgery.runtime.tree_guards)")  # a path's record


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
    return isinstance(value, tuple | frozenset) and depth < 4 and \
        all(immutable(v, depth + 1) for v in value)


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

    def __init__(self, root: Callable[[], nn.Module | None], arg: str,
                 scope: Callable[[], Any] = dict) -> None:
        self.root = root  # the path's module, or None while the group has no single path
        self.arg = arg  # the frame's name for it (``self``)
        self.scope = scope  # the frame's globals (``G[...]``)
        self.fns: list[types.FunctionType] = []  # functions whose identity a guard read
        self.codes: list[Any] = []  # and their code, which can be swapped without a dict
        self.dicts: list[dict[Any, Any]] = []
        self.objs: list[Any] = []
        self.versions: list[int] = []
        self.types: list[type] = []
        self._reads: dict[int, _Read] = {}  # per watched dict: what its guards read of it
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
            if not all(r.same() for r in self._reads.values()):
                return False
            self.versions = list(map(DICT_VERSION, self.dicts))  # stored again, same values
        if list(map(type, self.objs)) != self.types or list(map(_CODE, self.fns)) != self.codes:
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
        self.codes = list(map(_CODE, self.fns))
        for r in self._reads.values():
            r.take()
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
        found = self._root(module, name)
        if found is None:
            return False
        obj, reads, start = found
        dicts: list[dict[Any, Any]] = []  # read whole (a leaf's own dict, a dict itself)
        steps = list(_STEP.finditer(name, start))
        if sum(len(m.group(0)) for m in steps) != len(name) - start or len(steps) > _MAX_DEPTH:
            return False  # not a plain chain (a call, a type(), a closure, an index)
        objs: list[Any] = []
        for m in steps:
            kind, key, attr, item = m.groups()
            if item is not None:  # a dict's item: ``G['__builtins_dict___0']['int']``
                if not isinstance(obj, dict) or item not in obj:
                    return False
                reads.append((obj, item))
                obj = obj[item]
                continue
            own = getattr(obj, "__dict__", None)
            if type(own) is not dict or not _plain_object(obj):
                return False
            objs.append(obj)
            if kind is not None:
                sub = own.get(f"_{kind}")
                if not isinstance(sub, dict) or key not in sub:
                    return False
                reads += [(own, f"_{kind}"), (sub, key)]
                obj = sub[key]
            elif attr in own:
                reads.append((own, attr))
                obj = own[attr]
            else:
                return False  # a class attribute or a property: not an instance dict's
        tensor = entry.guard_type == "TENSOR_MATCH"
        if tensor:
            if not isinstance(obj, torch.Tensor) or TensorGuards is None or any(
                    hasattr(obj, a) for a in _MARKS):
                return False  # a tensor with a dynamic dim (a cache): dynamo keeps its guard
            self._add(self.tensors, [obj])
        elif not immutable(obj) and entry.guard_type not in _IDENTITY | _WHOLE:
            return False  # a value match on a mutable object (its __eq__ reads its state)
        elif isinstance(obj, dict):
            dicts += [obj] if entry.guard_type in _WHOLE else []
        elif type(obj) is types.FunctionType:  # its identity, and the code it runs
            self._add(self.fns, [obj])
        elif _plain_object(obj):
            if entry.guard_type in _WHOLE:  # it reads the keys of the object's own dict
                if isinstance(obj, types.ModuleType):
                    return False  # a Python module's dict: imports add to it any time
                dicts.append(vars(obj))
            objs.append(obj)
        elif not immutable(obj):
            return False  # a tensor, a class, a builtin, a list: dynamo keeps its guard
        for d in dicts:
            self._watch(d).whole = True
        for d, k in reads:
            self._watch(d).keys.add(k)
        self._add(self.objs, objs)
        return True

    def _watch(self, d: dict[Any, Any]) -> _Read:
        read = self._reads.get(id(d))
        if read is None:
            read = self._reads[id(d)] = _Read(d)
            self.dicts.append(d)
        return read

    def _root(self, module: nn.Module, name: str
              ) -> tuple[Any, list[tuple[dict[Any, Any], Any]], int] | None:
        """Where a chain starts (the module, or a frame global: its dict watched), the dicts
        read so far, and where the steps begin in the name."""
        for prefix in (f"L['{self.arg}']", self.arg):
            if name.startswith(prefix):
                return module, [], len(prefix)
        m = _GLOBAL.match(name)
        scope = self.scope() if m is not None else None
        if m is None or not isinstance(scope, dict) or m.group(1) not in scope:
            return None
        return scope[m.group(1)], [(scope, m.group(1))], m.end()

    def _add(self, into: list[Any], items: list[Any]) -> None:
        for o in items:
            if id(o) not in self._seen:
                self._seen.add(id(o))
                into.append(o)


_CODE = operator.attrgetter("__code__")
_MISSING = object()


class _Read:
    """What dropped guards read of a dict: its keys (key/length guards), and the items at the
    keys chains step through (elsewhere it may change: dynamo's compile flag, a new cache)."""

    def __init__(self, d: dict[Any, Any]) -> None:
        self.d = d
        self.whole = False  # its keys are read (presence, length, order)
        self.keys: set[Any] = set()  # the keys whose values are read
        self.names: list[Any] = []
        self.items: list[tuple[Any, Any]] = []

    def take(self) -> None:
        self.names = list(self.d) if self.whole else []
        self.items = [(k, self.d.get(k, _MISSING)) for k in self.keys]

    def same(self) -> bool:
        if self.whole and list(self.d) != self.names:
            return False
        return _same_items([(k, self.d.get(k, _MISSING)) for k, _ in self.items], self.items)


# What a dim marked dynamic leaves on a tensor (torch._dynamo.decorators)
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices")


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """TENSOR_MATCH's facts as Python values (a change, or a new dispatch state: inference)."""
    return (type(t), t.dtype, t.device, t.layout, tuple(t.shape), t.stride(), t.requires_grad)


def _tensor_check(tensors: list[torch.Tensor]) -> Any:
    """dynamo's TENSOR_MATCH of each tensor, static sizes and strides, in this dispatch state."""
    assert TensorGuards is not None
    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


_HAS_FILTER = hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")  # guard filters: 2.8


def dict_tags_skip() -> bool:
    """Does dynamo skip unchanged module subtrees by recursive dict tags (then no watch)?"""
    return bool(getattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", False))


def watch_for(target: Callable[..., Any], bound: bool,
              root: Callable[[], nn.Module | None]) -> TreeWatch | None:
    """A watch for a group compiling ``target`` (called with its module first when bound), or
    None: off, tags untrusted, no module argument or guard filter hook, dynamo's dict tags."""
    code = getattr(target, "__code__", None)
    if not (WATCH_TREES and _HAS_FILTER and bound) or DICT_VERSION is None or code is None \
            or code.co_argcount < 1 or dict_tags_skip():
        return None
    return TreeWatch(root, code.co_varnames[0], scope=lambda: getattr(target, "__globals__", None))


def compile_watched(fn: Callable[..., Any], backend: Callable[..., Any],
                    watch: TreeWatch | None) -> Callable[..., Any]:
    """``torch.compile`` of a piecewise group's function, with the watch's filter if any."""
    options: dict[str, Any] | None = \
        {"guard_filter_fn": watch.filter} if watch is not None else None
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=None, options=options)
