"""Recompile budgets of an evidence plan: which paths share compiled code, and which go dynamic.

Why. Every compiled callable guards on its call signatures, and each new one is a compile (and,
under CUDA graphs, a capture). At runtime each group of paths compiles its own copy of the
function (surgery.runtime.groups), keyed by the function, its weight layout and the region's
``group`` name. So the plan judges budgets per group, where a group is:

1. **One function with one weight layout.** An ``Mlp`` class at width 1024 in the trunk and 2048
   in a head is two groups: the runtime never mixes their signatures (a parameter's shape is a
   guard), so the head's signatures do not count against the trunk's budget.
2. **Split by signature when over budget.** The paths of one layout are packed into as few
   groups as keep each at most ``RECOMPILE_BUDGET`` signatures (the per-instance ``global_idx``
   of six blocks: two groups of four and two). Each is its own region with its own ``group``
   name, so each compiles on its own. More than ``MAX_SPLIT`` groups costs more compiles than a
   region saves; then the paths are left out with the evidence and their children are tried.
3. **Dynamic when only sizes vary.** A path whose signatures differ only in tensor sizes (a
   batch size that varies, a sequence length) and that shows more than the budget is one dynamic
   region: ``dynamic = true`` and the dims that varied (``dynamic_dims = {x = [0]}``), compiled
   once with those dims dynamic and every other dim static (DimMarks, surgery.runtime.groups). Its
   recorded signatures carry ``*`` in those dims, so the runtime's
   signature check (surgery.runtime.signatures) treats every size there as planned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from surgery.planning.observation import Call, Observation

RECOMPILE_BUDGET = 4  # signatures one compiled callable may take (dynamo's limit is 8)
MAX_SPLIT = 4  # compiled copies one layout group may be split into, by signature


@dataclass
class Group:
    """Region paths that compile one copy of one function, and why they were put together."""

    fn: str
    paths: list[str]
    sigs: set[Any] = field(default_factory=set)
    dynamic_dims: dict[str, list[int]] | None = None
    name: str | None = None  # set when a layout group was split: the runtime keys on it


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    acc = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n > 1 and s != acc:
            return False
        acc *= max(n, 1)
    return True


def sizes_only(calls: Sequence[Call]) -> dict[str, list[int]] | None:
    """The tensor dims that varied, when the calls' signatures differ in nothing else.

    Same argument names in the same order, same context, same scalars and structures; tensors
    of the same rank, dtype, device, grad flag and contiguity. None when anything else differs
    or nothing varies at all.
    """
    sigs = list(dict.fromkeys(c.sig for c in calls))
    if len(sigs) < 2:
        return None
    ref = sigs[0]
    names = [n for n, _ in ref.args]
    dims: dict[str, set[int]] = {}
    for s in sigs[1:]:
        if s.context != ref.context or [n for n, _ in s.args] != names:
            return None
        for (name, a), (_, b) in zip(ref.args, s.args, strict=True):
            if a == b:
                continue
            if a[0] != "T" or b[0] != "T":
                return None
            (_, sa, da, ta, va, ga), (_, sb, db, tb, vb, gb) = a, b
            if len(sa) != len(sb) or (da, va, ga) != (db, vb, gb) or \
                    _contiguous(sa, ta) != _contiguous(sb, tb):
                return None
            dims.setdefault(name, set()).update(i for i, (x, y) in enumerate(zip(sa, sb,
                                                                            strict=True))
                                                if x != y)
    out = {n: sorted(d) for n, d in dims.items() if d}
    return out or None


def layout_of(obs: Observation, path: str) -> int | None:
    """The weight layout a path compiles with (a method's is its module's)."""
    if path in obs.structure:
        return obs.structure[path]
    return obs.structure.get(path.rpartition(".")[0])


def plan_groups(obs: Observation, chosen: Sequence[str], by_path: dict[str, list[Call]],
                dynamic: dict[str, dict[str, list[int]]], why: Any
                ) -> tuple[list[Group], dict[str, str]]:
    """The compile groups of ``chosen``, and the paths over budget even when split (reasons).

    ``why(calls)`` words what varies across calls, for the reason.
    """
    keyed: dict[tuple[Any, ...], list[str]] = {}
    for p in chosen:
        dims = dynamic.get(p)
        frozen = tuple(sorted((k, tuple(v)) for k, v in dims.items())) if dims else None
        keyed.setdefault((obs.callables.get(p, p), layout_of(obs, p), frozen), []).append(p)
    groups: list[Group] = []
    over: dict[str, str] = {}
    for (fn, _layout, frozen), paths in keyed.items():
        if frozen is not None:
            groups.append(Group(fn, list(paths), dynamic_dims={k: list(v) for k, v in frozen}))
            continue
        bins: list[Group] = []
        for p in paths:
            sigs = {c.sig for c in by_path[p]}
            home = next((b for b in bins if len(b.sigs | sigs) <= RECOMPILE_BUDGET), None)
            if home is None:
                bins.append(Group(fn, [p], set(sigs)))
            else:
                home.paths.append(p)
                home.sigs |= sigs
        if len(bins) <= MAX_SPLIT:
            if len(bins) > 1:
                for i, b in enumerate(bins):
                    b.name = f"{fn.rsplit('.', 2)[-2]}.{i}"
            groups += bins
            continue
        total = len(set().union(*(b.sigs for b in bins)))
        calls = [c for p in paths for c in by_path[p]]
        reason = (f"its {len(paths)} paths share one compiled callable "
                  f"({fn.rsplit('.', 1)[-1]}) with one weight layout and show {total} "
                  f"signatures together, beyond the recompile budget of {RECOMPILE_BUDGET} even "
                  f"split into {MAX_SPLIT} groups: {why(calls) or 'their arguments differ'}")
        for p in paths:
            over[p] = reason
    return groups, over
