"""Where a piecewise block's cache is (the manifest's ``dynamic`` sources), and its structure.

A source names a forward argument (``past_key_values:2``) or an attribute path of the block
(``self.attn.kv_cache``), with the dim that grows when the cache is a tensor. The runtime
(surgery.runtime.piecewise) walks a source for its tensors, to mark the growing dim dynamic and
to tell the split which graph inputs are the cache (surgery.runtime.piecewise_split). Every walk
is bounded: a hostile manifest names a source, never a walk of unbounded size.

**The structure of a list cache, and when a new one compiles.** Dynamo traces a Python
list of tensors element by element, so a cache kept as a list (the SDPA example's sliding
windows: one ``(k, v)`` per frame, or the camera trunk's ``cache[global_idx]``) gives one graph
per list length until its window is full. No dim can be marked for a list's length
(``mark_dynamic`` takes a tensor dim), and ``mark_unbacked`` does not apply either. On the H200
the camera trunk's 4 indexed blocks compiled 68 graphs this way (17 lengths x 4 instances), each
of them used once per stream, and the cold start went from 36.7 s to 124.4 s.

So ``cache_structure`` gives the lengths of the lists and tuples under the sources that have no
dim (tensors and scalars are leaves: a tensor's growth is the marked dim's business), and a
piecewise path compiles its first structure at once (its first call proves the region, in
warm-up), but a *further* structure only when two calls in a row show it (surgery.runtime.
piecewise): until then the block runs its original forward. A window that fills runs eager while
it fills and compiles once, when full, and the lengths a stream passes through while it fills
never compile, however many streams start again. (The rule before compiled a length when it
recurred: a second stream compiled every length the warm-up stream had shown, 1 and 2 with 3
warm-up frames, which is 8 of the trunk's 16 graphs on the H200, each run once per stream, and a
third stream would compile the rest.) Correctness never depends on this: dynamo's guards still
choose the graph that runs, and an eager call is the model's own code; the rule only decides
when a compile may happen.

**An empty tensor cache (a prefill) runs eager.** A cache of tensors with a growing dim
(``cache:2``, a transformers ``DynamicCache``) is empty on the first call of every stream: the
prefill of ``generate()``. That call is traced as a graph of its own (the cache's first update
takes another code path, and its token count differs from decode's), its pieces are compiled for
the prompt's shape, and the cache it leaves can be laid out otherwise than the one decode grows
(GPT-2 with inductor: the first decode step traced a third graph for the keys' strides). All of
that runs once per stream. So ``filled`` tells a call whose cache holds no element at all (no
tensor, or only empty ones) and the path runs it eager, unless an empty call ran compiled
before or the previous call was empty too (a caller that always runs without a cache compiles
on its second call): on GPT-2 small in ``generate()`` one graph in all instead of three, and
about half the pieces' compiles. Dynamo never sees that eager call, so it cannot tell from it
which other inputs grow with the cache (a padding mask: 8 wide at the prefill, 9 at the first
decode step) and would trace decode twice, static then dynamic. ``mark_grown`` does what its
automatic dynamic would have done: a dim of a tensor argument that grew since the empty-cache
call is marked dynamic on the next compile (``maybe_mark_dynamic``: dynamo may still
specialize it; what shrank, the prompt's token count, stays static).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from surgery.errors import RegionError

# A dynamic-dim source: a forward argument name, or `self.` and a dotted attribute path of the
# block, then an optional `:DIM` (the dim that grows). Identifiers never start with `_`.
SOURCE_RE = re.compile(r"^(self(\.[A-Za-z][A-Za-z0-9_]*)+|[A-Za-z][A-Za-z0-9_]*)(:-?[0-9])?$")
# How far a walk goes into a source (lists, dicts, plain objects), and how many tensors (or, for
# the structure, items) it takes.
MAX_DEPTH = 4
MAX_TENSORS = 4096
# Distinct structures a path remembers having run compiled (they run compiled again at once).
MAX_STRUCTURES = 64
# What a path's record notes when an empty-cache call first runs eager.
EMPTY_CACHE_NOTE = ("a call with an empty cache (a prefill: once a stream) runs eager; it "
                    "compiles only when two such calls come in a row")


@dataclass
class Source:
    """Where a block's cache is: an argument or an attribute path, and the dim that grows."""

    arg: str | None
    attrs: tuple[str, ...]
    dim: int | None

    @classmethod
    def parse(cls, text: str, *, region: str) -> Source:
        m = SOURCE_RE.match(text)
        if m is None:
            raise RegionError(
                f"piecewise region {region!r}: dynamic source {text!r} is neither a forward "
                "argument nor `self.ATTR...`, with an optional `:DIM`", region=region,
                hint="e.g. 'past_key_values:2' or 'self.attn.kv_cache'")
        where, _, dim = text.partition(":")
        parts = tuple(where.split("."))
        if parts[0] == "self":
            return cls(None, parts[1:], int(dim) if dim else None)
        return cls(parts[0], (), int(dim) if dim else None)


def tensors_in(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    """Tensors reachable from obj through sequences, dicts and plain objects (bounded)."""
    if len(out) >= MAX_TENSORS or depth > MAX_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for o in obj:
            tensors_in(o, out, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            tensors_in(o, out, depth + 1)
    elif isinstance(obj, nn.Module) or obj is None or isinstance(obj, int | float | str | bool):
        return
    elif hasattr(obj, "__dict__"):
        for o in vars(obj).values():
            tensors_in(o, out, depth + 1)


# What filled never walks into: modules (their parameters are no cache) and scalars.
_LEAVES = (nn.Module, int, float, str, bool)


def filled(obj: Any, left: list[int] | None = None, depth: int = 0) -> bool:
    """True if a tensor under obj holds an element: the walk of tensors_in, bounded the same
    way, stopping at the first such tensor (a decode step's cache answers at once: ~6 us for a
    GPT-2 DynamicCache on a CPU core, so plain loops and tuple isinstance checks)."""
    if left is None:
        left = [MAX_TENSORS]
    if depth > MAX_DEPTH or left[0] <= 0:
        return False
    left[0] -= 1
    if isinstance(obj, torch.Tensor):
        return obj.numel() > 0
    if isinstance(obj, _LEAVES) or obj is None:
        return False
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)):
        if not hasattr(obj, "__dict__"):
            return False
        obj = vars(obj).values()
    for o in obj:  # noqa: SIM110 (no generator per level: this runs every decode step)
        if filled(o, left, depth + 1):
            return True
    return False


def source_roots(sources: Sequence[Source], module: nn.Module, names: Sequence[str],
                 args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """What each source names in this call of the block: an argument's value or the attribute."""
    bound: dict[str, Any] | None = None
    roots = []
    for src in sources:
        if src.arg is not None:
            if bound is None:
                bound = dict(zip(names, args, strict=False))
                bound.update(kwargs)
            roots.append(bound.get(src.arg))
        else:
            roots.append(resolve_attr(module, src.attrs))
    return roots


def tensor_shapes(names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any]
                  ) -> dict[str, tuple[int, ...]]:
    """The shapes of a call's tensor arguments, by parameter name."""
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return {k: tuple(v.shape) for k, v in bound.items() if isinstance(v, torch.Tensor)}


def mark_grown(before: dict[str, tuple[int, ...]], names: Sequence[str], args: Sequence[Any],
               kwargs: dict[str, Any]) -> list[str]:
    """Mark dynamic each dim of a tensor argument that grew since ``before`` (the empty-cache
    call's tensor_shapes); returns them as ``name:dim``."""
    marked = []
    for name, t in zip(names, args, strict=False):
        marked += _grown(name, t, before)
    for name, t in kwargs.items():
        marked += _grown(name, t, before)
    return marked


def _grown(name: str, t: Any, before: dict[str, tuple[int, ...]]) -> list[str]:
    old = before.get(name)
    if not isinstance(t, torch.Tensor) or old is None or len(old) != t.dim():
        return []
    dims = [d for d in range(t.dim()) if t.shape[d] > old[d] and t.shape[d] >= 2]
    for d in dims:  # sizes 0 and 1 are specialized by dynamo
        torch._dynamo.maybe_mark_dynamic(t, d)
    return [f"{name}:{d}" for d in dims]


def resolve_attr(module: nn.Module, attrs: tuple[str, ...]) -> Any:
    """module.a.b through submodules and the instance dict only (never a class attribute)."""
    obj: Any = module
    for a in attrs:
        d = vars(obj) if hasattr(obj, "__dict__") else {}
        mods = d.get("_modules") or {}
        if a in mods:
            obj = mods[a]
        elif a in d:
            obj = d[a]
        else:
            return None
    return obj


def _shape(obj: Any, depth: int, left: list[int]) -> Hashable:
    if depth > MAX_DEPTH or left[0] <= 0:
        return "..."
    left[0] -= 1
    if isinstance(obj, list | tuple):
        if not obj or isinstance(obj[0], torch.Tensor):  # a list of tensors: its length
            return len(obj)
        return tuple(_shape(o, depth + 1, left) for o in obj)
    if isinstance(obj, dict):
        return tuple(_shape(o, depth + 1, left) for o in obj.values())
    if isinstance(obj, torch.Tensor | nn.Module | int | float | str | bool) or obj is None:
        return None
    if hasattr(obj, "__dict__"):
        return _shape(vars(obj), depth + 1, left)
    return None


def cache_structure(roots: Sequence[Any]) -> Hashable:
    """The lengths of the lists and tuples under each root (bounded; see the docstring)."""
    left = [MAX_TENSORS]
    return tuple(_shape(r, 0, left) for r in roots)
