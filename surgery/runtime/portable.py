"""What lets an AOT-compiled region run in another process: the guards it keeps, the code it checks.

Why. torch's AOT path (surgery.runtime.precompiled) saves the guards dynamo built, except those
that name an object of the tracing process by its identity (ID_MATCH and kin: an ``id()`` means
nothing in another process). Its default filter drops such a guard when it is the guard's own
type, but not when it is only *derived*: a CONSTANT_MATCH or EQUALS_MATCH on a code object is
checked by identity, and torch then refuses the whole function ("ID_MATCH guard cannot be
serialized"). Real blocks hit it through a method their code looks at rather than calls:
transformers' BertLayer passes ``self.feed_forward_chunk`` to ``apply_chunking_to_forward``,
which reads its signature (``__code__``); diffusers' Flux blocks call ``attn.processor``,
whose class's ``__call__.__code__`` is guarded. Both then fell back to the Mega-Cache part.

What is dropped. ``guard_filter_for`` keeps torch's default rule (no global guards, none of the
types torch cannot serialise) and drops, besides, a guard whose derived types torch cannot
serialise *when the guarded value is a code object or a function*: it says "this code is the
code that was traced", which an id cannot say across processes anyway; and a guard on a cell of
the region callable's own closure (a decorator's arguments and wrapped function: torch rebuilds
them from names the loading frame does not have) when the group's identity records that cell
(``closure_identity``: constants by value, functions by code). Anything else that torch cannot
serialise still refuses the function, which goes to the Mega-Cache part with a note.

What replaces it. The code those guards stood for is checked by its text instead: when a bundle
is built, every source span dynamo inlined into the artifact (torch's ``source_info``: module,
first and last line) is recorded with a sha256 of those lines as the module has them now
(``inlined_sources``); at deploy time, before a byte of the artifact is unpickled, each span is
hashed again from the module this process has imported (``sources_problem``). A module that is
not imported, a span that moved or changed: the group's artifacts are stale, ignored with the
bundle's one warning, and the group compiles with dynamo. This covers every inlined callee (a
changed ``Linear.forward`` or attention helper), not only the guards dropped here; the group's
identity (surgery.runtime.precompiled) already covers the region's own function.

Decorated methods. A region's callable may be a decorator's wrapper (transformers wraps
``BertLayer.forward`` in ``deprecate_kwarg``): the function it calls sits in its closure, carries
the same qualname and so cannot be pickled by reference ("not the same object as
...BertLayer.forward"). ``closure_refs`` names every function in the callable's closure
(``closure.N``); torch's AOT pickler stores those names instead of the functions, and the loader
resolves them to the functions in *this* process's closure of the same callable. A name the
callable here does not have fails the load, and the group compiles with dynamo.

Accepted limit: code swapped on a live class after the artifact is installed (monkeypatching
``BertLayer.feed_forward_chunk`` mid-run) is not seen, as with torch's own default filter for
the guards it drops.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

# torch's list of guard types it cannot serialise (CheckFunctionManager.
# UNSUPPORTED_SERIALIZATION_GUARD_TYPES in torch 2.10-2.14), read from torch where it has it.
_FALLBACK_UNSUPPORTED = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH",
                         "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE")
MAX_SOURCES = 2048  # spans one artifact may list (a BERT layer inlines a few dozen)


def _unsupported() -> tuple[str, ...]:
    from torch._dynamo.guards import CheckFunctionManager  # heavy: dynamo's guard builder

    return tuple(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES",
                         _FALLBACK_UNSUPPORTED))


def guard_filter_for(target: Any) -> Callable[[Sequence[Any]], list[bool]]:
    """torch's ``guard_filter_fn`` for an artifact of ``target``: which of dynamo's guards it
    keeps (True: kept)."""
    names = getattr(getattr(target, "__code__", None), "co_freevars", ())
    texts = _closure_texts(target, 0, set())
    covered = {n for n, t in zip(names, texts, strict=False) if t is not None}

    def keep_guard(e: Any) -> bool:
        bad = _unsupported()
        derived = tuple(getattr(e, "derived_guard_types", ()) or ())
        value = getattr(e, "value", None) if getattr(e, "has_value", False) else None
        code_identity = any(d in bad for d in derived) and isinstance(
            value, (types.CodeType, types.FunctionType))
        root = str(getattr(e, "name", "")).split(".", 1)[0].split("[", 1)[0]
        return not (getattr(e, "is_global", False) or e.guard_type in bad or code_identity
                    or root in covered)

    return lambda entries: [keep_guard(e) for e in entries]


_MAX_NESTING = 4  # decorators within decorators: transformers stacks two on BertLayer.forward


def _value_text(v: Any, depth: int, seen: set[int]) -> str | None:
    """A closure value as text the same in every process, or None when it is not one the
    identity can record (then guards on it stay)."""
    if v is None or type(v) in (bool, int, float, str, bytes):
        return repr(v)
    if type(v) is tuple:
        parts = [_value_text(x, depth, seen) for x in v]
        return None if None in parts else "(" + ",".join(p for p in parts if p) + ")"
    if isinstance(v, types.FunctionType):
        if id(v) in seen:  # a wrapper that names itself (transformers' checkpointing layer)
            return f"<self {v.__qualname__}>"
        if depth >= _MAX_NESTING:
            return None
        seen.add(id(v))
        inner = _closure_texts(v, depth + 1, seen)
        extra = [_value_text(v.__defaults__, depth, seen),
                 _value_text(tuple(sorted((v.__kwdefaults__ or {}).items())), depth, seen)]
        if None in inner or None in extra:
            return None
        return f"{v.__module__}.{v.__qualname__}:{code_text(v.__code__)}:{extra}:{inner}"
    return None


def _closure_texts(target: Any, depth: int, seen: set[int]) -> list[str | None]:
    """Per cell of ``target``'s closure, what the group's identity records of it: a constant's
    repr, a function's qualname, code, defaults and own closure; None for anything else (its
    guards stay, and an artifact whose guards torch cannot rebuild elsewhere fails the load-back
    when it is built)."""
    seen.add(id(target))
    out: list[str | None] = []
    for cell in getattr(target, "__closure__", None) or ():
        try:
            out.append(_value_text(cell.cell_contents, depth, seen))
        except ValueError:  # an empty cell
            out.append(None)
    return out


def closure_identity(target: Any) -> str:
    """The part of a group's identity its closure makes (surgery.runtime.precompiled)."""
    texts = _closure_texts(target, 0, set())
    return repr(texts) if texts else ""


def code_text(obj: Any) -> str:
    """What a code object does, as text that is the same in every process: not ``marshal``,
    whose output follows reference counts, nor a frozenset's repr, which follows the hash seed."""
    if isinstance(obj, types.CodeType):
        return repr((obj.co_code.hex(), obj.co_names, obj.co_varnames, obj.co_freevars,
                     obj.co_cellvars, obj.co_argcount, obj.co_kwonlyargcount, obj.co_flags,
                     [code_text(c) for c in obj.co_consts]))
    if isinstance(obj, tuple):
        return "(" + ",".join(code_text(c) for c in obj) + ")"
    if isinstance(obj, frozenset):
        return "frozenset(" + ",".join(sorted(code_text(c) for c in obj)) + ")"
    return repr(obj)


def _span_digest(module: types.ModuleType, first: int, last: int) -> str | None:
    try:
        lines = inspect.getsourcelines(module)[0]
    except (OSError, TypeError):  # no source file (a C module, a zip without sources)
        return None
    if not 1 <= first <= last <= len(lines) + 1:
        return None
    return "sha256:" + hashlib.sha256("".join(lines[first - 1:last - 1]).encode()).hexdigest()


def inlined_sources(fn: Any) -> list[list[Any]]:
    """[[module, first line, last line, digest], ...] of the code dynamo inlined into ``fn`` (a
    torch AOTCompiledFunction), sorted; [] where this torch does not say. Raises ValueError for
    a span whose source cannot be read (its changes could not be seen at deploy time)."""
    info = getattr(fn, "source_info", None)
    spans = getattr(info(), "inlined_sources", None) if callable(info) else None
    out = []
    for s in spans or ():
        name = str(getattr(s, "module", ""))
        module = sys.modules.get(name)
        first, last = getattr(s, "firstlineno", 0), getattr(s, "lastlineno", 0)
        digest = _span_digest(module, first, last) if module is not None else None
        if digest is None:  # code that could change unseen: not precompiled (the caller notes)
            raise ValueError(f"the source of {name} lines {first}-{last} (inlined) cannot be read")
        out.append([name, first, last, digest])
    return sorted(out)


def sources_problem(sources: Sequence[Sequence[Any]]) -> str | None:
    """Why the code recorded for an artifact is not this process's code (None: it is)."""
    for name, first, last, digest in sources:
        module = sys.modules.get(name)
        if module is None:
            return f"module {name} (inlined into it) is not imported here"
        if _span_digest(module, first, last) != digest:
            return f"{name} lines {first}-{last - 1} (inlined into it) changed"
    return None


def closure_refs(target: Any) -> dict[str, Any]:
    """{"closure.N": function} for each function in ``target``'s closure (a decorator's wrapped
    function): torch's ``external_data``, the same names on both sides."""
    out = {}
    for i, cell in enumerate(getattr(target, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.FunctionType):
            out[f"closure.{i}"] = value
    return out


def takes_args(fn: Callable[..., Any], n: int) -> bool:
    """Whether ``fn`` takes at least ``n`` positional arguments (torch's serialiser grew one)."""
    try:
        return len(inspect.signature(fn).parameters) >= n
    except (TypeError, ValueError):
        return False
