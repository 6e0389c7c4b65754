"""Choose compile regions from what a run showed (surgery.planning.observe), and say what they
cover.

The rule, and why:

- A **region** is a maximal module subtree whose calls are one function of their signature, and
  which is worth a graph. It is *fixed* when (1) it changed no Python state (a graph replay runs
  no Python, so a KV cache appended to in ``forward`` would stop growing), (2) the same signature
  always ran the same ops on the same shapes inside (else it hides state), both judged on the
  steps after the first (state built once, such as a lazy table, changes only in the first),
  (3) it was called under one autocast/grad state (a captured graph replays one; ``no_grad`` and
  ``inference_mode`` are one state), and (4) its compile group (surgery.planning.budgets: one
  function, one weight layout, split by signature) shows at most ``RECOMPILE_BUDGET`` signatures;
  a path whose signatures differ only in sizes is a dynamic region instead. It is *worth* a
  graph when it runs more than one op a call and, where timed, holds at least ``MIN_SHARE`` of
  the bare step (a graph replay costs about what one launch costs).
- **Every module gets one fate**: a region, inside a region, or under ``[[left_out]]`` with the
  reason. A subtree that is not fixed, or fixed but not worth a graph ("not worth a graph: 1 op a
  call"), is **descended into**: its children are judged in turn, and it is recorded with the
  evidence ("`global_idx` took 24 values"). So is a module never called in the watched steps.
- **Method regions** (``attn_pre``, ``ffn_residual``, ``--include path.method``) come from names;
  the evidence decides whether they are fixed.
- A module shared by several parents (one RoPE module inside every attention) is a region when
  it runs outside the other regions; inside them it is traced inline (slots.py's wrapper defers
  to dynamo while compiling). A candidate that runs *only* inside other regions is dropped.

Coverage is the share of the model's eager step time spent inside regions, from the timed
calls: a call counts once, at its outermost region.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from surgery.planning.budgets import RECOMPILE_BUDGET, Group, plan_groups, sizes_only
from surgery.planning.observation import Call, Observation
from surgery.runtime.signatures import Signature, render, wildcard

__all__ = ["MIN_SHARE", "NEVER_CALLED", "OBSERVED", "RECOMPILE_BUDGET", "Choice", "Verdict",
           "choose_regions", "coverage", "evidence_of", "judge", "shares", "why_varies"]

MIN_SHARE = 0.001  # of the step's time, for a region to be worth a graph
OBSERVED = "observed"  # the kind of a region found by evidence alone
_REMAINDERS = 8
OUTSIDE = "(step, outside every module call)"  # the remainder that no module's hooks see


@dataclass
class Verdict:
    """Whether one path's calls are fixed, and the evidence if not."""

    path: str
    calls: list[Call]
    reasons: list[str] = field(default_factory=list)
    # The dims that varied, when more signatures than the budget differ only in sizes.
    dynamic_dims: dict[str, list[int]] | None = None

    @property
    def fixed(self) -> bool:
        return not self.reasons

    @property
    def signatures(self) -> list[Signature]:
        return list(dict.fromkeys(c.sig for c in self.calls))


@dataclass
class Choice:
    """Regions, what was left out and why, each region's evidence, and the coverage."""

    regions: list[str]  # module paths and module.method paths
    left_out: list[tuple[str, str]]  # (path, reason)
    evidence: dict[str, dict[str, Any]]
    coverage: dict[str, Any]
    groups: list[Group] = field(default_factory=list)  # compile groups of the regions


def _quote(name: str) -> str:
    return f"`{name}`"


def _arg_evidence(calls: list[Call]) -> list[str]:
    """Which arguments vary, in words: int values, growing lists, changing shapes."""
    by_arg: dict[str, list[tuple[int, Any]]] = {}
    for c in calls:
        for name, d in c.sig.args:
            by_arg.setdefault(name, []).append((c.step, d))
    out = []
    for name, seen in by_arg.items():
        distinct = list(dict.fromkeys(d for _, d in seen))
        if len(distinct) < 2:
            continue
        kinds = {d[0] for d in distinct}
        if kinds <= {"int", "float", "bool", "str"}:
            vals = ", ".join(repr(d[1]) for d in distinct[:4])
            more = ", ..." if len(distinct) > 4 else ""
            out.append(f"{_quote(name)} took {len(distinct)} values ({vals}{more})")
        elif kinds <= {"list", "tuple", "dict"}:
            sizes = [_leaves(d) for _, d in seen]
            grew = _grew_per_step(seen, _leaves)
            what = "grew every step" if grew else f"took {len(distinct)} structures"
            out.append(f"{_quote(name)} {what} ({min(sizes)} to {max(sizes)} tensors)")
        else:
            shapes = ", ".join(render(d) for d in distinct[:3])
            out.append(f"{_quote(name)} took {len(distinct)} forms ({shapes}"
                       f"{', ...' if len(distinct) > 3 else ''})")
    return out


def _grew_per_step(seen: list[tuple[int, Any]], size: Any) -> bool:
    """Whether the largest size seen in a step grows from each step to the next."""
    per_step: dict[int, int] = {}
    for step, d in seen:
        per_step[step] = max(per_step.get(step, 0), size(d))
    vals = [per_step[s] for s in sorted(per_step)]
    return len(vals) >= 2 and all(b > a for a, b in itertools.pairwise(vals))


def _inner_evidence(a: Call, b: Call, calls: list[Call]) -> str:
    """What differs inside two calls with one signature: an op's shapes, or a child's call."""
    for (na, sa), (nb, sb) in zip(a.ops, b.ops, strict=False):
        if (na, sa) != (nb, sb):
            return f"`{na}` ran on {_shapes(sa)} then on {_shapes(sb)}"
    if len(a.ops) != len(b.ops):
        return f"it ran {len(a.ops)} ops, then {len(b.ops)}"
    for ia, ib in zip(a.children, b.children, strict=False):
        ca, cb = calls[ia], calls[ib]
        if ca.sig != cb.sig:
            return f"its call of `{ca.path}` changed from ({ca.sig.render()}) to " \
                   f"({cb.sig.render()})"
        if ca.inner != cb.inner:
            return _inner_evidence(ca, cb, calls)
    return "its inner calls changed"


def _shape(x: Any) -> str:
    if isinstance(x, tuple) and x[:1] == ("list",):
        items = x[1]
        if 1 < len(items) <= 3:
            return "+".join(_shape(i) for i in items)
        return f"{len(items)} tensors" if len(items) != 1 else "1 tensor"
    if isinstance(x, tuple):
        return "[" + ",".join(map(str, x)) + "]"
    return str(x)


def _shapes(s: tuple[Any, ...]) -> str:
    return "(" + ", ".join(_shape(x) for x in s if x is not None) + ")"


def _leaves(d: Any) -> int:
    """Tensors in a described argument (a KV cache's length, however nested)."""
    if d[0] == "T":
        return 1
    if d[0] in ("list", "tuple"):
        return sum(_leaves(x) for x in d[1])
    if d[0] == "dict":
        return sum(_leaves(v) for _, v in d[1])
    return 0


def judge(path: str, calls: list[Call], all_calls: list[Call]) -> Verdict:
    """Whether ``path``'s calls are fixed (see the module docstring), with the evidence."""
    v = Verdict(path, calls)
    # State set up on the first step only (a lazily built RoPE table) is not streaming state:
    # the first call runs compiled, uncaptured, and applies it. Judge state from the steps after.
    steady = [c for c in calls if c.step > 0] or calls
    mutated = Counter(m for c in steady for m in c.mutated)
    for what, n in mutated.most_common(2):
        kind, _, name = what.partition(" ")
        if kind == "object":
            if 2 * n <= len(steady):
                # An argument object changed in at most half of the calls: a cache filled once
                # a step (a static cache's lazy tensors), not one that grows with every call (a
                # KV cache appended to). Judged by the rest of the evidence, as state set up
                # once is.
                continue
            # A cache object the caller carries between calls: worded as such, so that
            # --piecewise (surgery.planning.streaming) sees a cache.
            v.reasons.append(f"changed its argument {_quote(name)}, an object holding tensors, "
                             f"in {n} of {len(steady)} calls (state kept between calls, such as "
                             "a KV cache, that a graph replay would not update)")
            continue
        v.reasons.append(f"changed its {kind} {_quote(name)} in {n} of {len(steady)} calls "
                         "(Python state a graph replay would not update)")
    contexts = list(dict.fromkeys(c.sig.context for c in calls))
    if len(contexts) > 1:
        said = " and ".join("(" + (", ".join(c) or "no autocast, grad on") + ")"
                            for c in contexts[:3])
        v.reasons.append(f"called under {len(contexts)} autocast/grad states: {said}")
    first: dict[Signature, Call] = {}
    for c in steady:
        f = first.setdefault(c.sig, c)
        if f.inner != c.inner:
            v.reasons.append("with the same arguments, what ran inside changed (state kept "
                             f"between calls, such as a KV cache): "
                             f"{_inner_evidence(f, c, all_calls)}")
            break
    n_sigs = len({c.sig for c in calls})
    if n_sigs > RECOMPILE_BUDGET and not v.reasons:
        v.dynamic_dims = sizes_only(calls)
    if n_sigs > RECOMPILE_BUDGET and v.dynamic_dims is None:
        why = "; ".join(_arg_evidence(calls)) or "signatures differ"
        v.reasons.append(f"{n_sigs} signatures, beyond the recompile budget of "
                         f"{RECOMPILE_BUDGET}: {why}")
    return v


def _enclosing(call: Call, regions: set[str], calls: list[Call]) -> str | None:
    """The region whose call encloses ``call``, if any."""
    p = call.parent
    while p >= 0 and calls[p].path not in regions:
        p = calls[p].parent
    return calls[p].path if p >= 0 else None


def _kids_index(paths: Sequence[str]) -> dict[str, list[str]]:
    kids: dict[str, list[str]] = {}
    for p in paths:
        if p:
            kids.setdefault(p.rpartition(".")[0], []).append(p)
    return kids


def _below(kids: dict[str, list[str]], path: str) -> list[str]:
    """Every module strictly below ``path``."""
    out, stack = [], list(kids.get(path, ()))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(kids.get(p, ()))
    return out


NEVER_CALLED = "never called in the watched steps: nothing to judge it by"


def choose_regions(obs: Observation, *, methods: Sequence[str] = (),
                   include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Choice:
    """Regions from evidence: maximal fixed subtrees worth a graph, plus fixed methods.

    Every module but the root ends as a region, inside one, or under ``left_out`` with a reason.
    """
    by_path = obs.by_path()
    kids = _kids_index(list(obs.classes))
    verdicts = {p: judge(p, cs, obs.calls) for p, cs in by_path.items()}
    dynamic = {p: v.dynamic_dims for p, v in verdicts.items() if v.dynamic_dims}
    breaches: dict[str, str] = {}
    share = shares(obs)

    def forced(p: str) -> bool:
        return any(fnmatch.fnmatchcase(p, g) for g in include)

    def unworthy(p: str) -> str | None:
        calls = by_path[p]
        ops = sum(c.subtree_ops for c in calls) / len(calls)
        if ops <= 1:
            return f"not worth a graph: {ops:g} op{'' if ops == 1 else 's'} a call"
        if obs.clock and share.get(p, 0.0) < MIN_SHARE:
            return (f"not worth a graph: under {MIN_SHARE:.1%} of the step "
                    f"({share.get(p, 0.0):.3%})")
        return None

    def visit(p: str, chosen: list[str], left: dict[str, str]) -> None:
        glob = next((g for g in exclude if fnmatch.fnmatchcase(p, g)), None)
        if p and glob is not None:
            left[p] = "excluded by --exclude"
            for d in _below(kids, p):
                left[d] = f"inside {p}, excluded by --exclude {glob!r}"
            return
        v = verdicts.get(p)
        if p and (forced(p) or (v is not None and v.fixed and p not in breaches)):
            why = None if forced(p) else unworthy(p)
            if why is None:
                chosen.append(p)
                return
            left[p] = why
        elif p and v is None:
            left[p] = NEVER_CALLED
        elif p and v is not None:
            left[p] = "; ".join(v.reasons) if v.reasons else breaches[p]
        for kid in kids.get(p, ()):
            visit(kid, chosen, left)

    while True:
        chosen: list[str] = []
        left: dict[str, str] = {}
        visit("", chosen, left)
        for m in methods:
            v = verdicts.get(m)
            inside = [r for r in chosen if m.startswith(f"{r}.")]
            if v is None:
                left[m] = NEVER_CALLED
            elif m in breaches:
                left[m] = breaches[m]
            elif not v.fixed and not forced(m):
                left[m] = "; ".join(v.reasons)
            elif inside:
                left[m] = f"inside region {inside[0]}"
            else:
                chosen.append(m)
        _, over = plan_groups(obs, chosen, by_path, dynamic, why_varies)
        new = {p: r for p, r in over.items() if not forced(p)}
        if not new:
            break
        breaches.update(new)
    regions = set(chosen)
    for p in list(chosen):
        encl = [_enclosing(c, regions - {p}, obs.calls) for c in by_path[p]]
        if all(e is not None for e in encl):
            left[p] = f"runs only inside region {encl[0]}"
            regions.discard(p)
            for d in _below(kids, p) if p in obs.classes else ():
                left[d] = f"inside {p}, which runs only inside region {encl[0]}"
    final = [p for p in chosen if p in regions]
    groups, _ = plan_groups(obs, final, by_path, dynamic, why_varies)
    evidence = {p: evidence_of(verdicts[p], share.get(p)) for p in final}
    return Choice(final, sorted(left.items()), evidence, coverage(obs, final), groups)


def why_varies(calls: list[Call]) -> str:
    """What varies across the calls, in words (for a budget reason)."""
    return "; ".join(_arg_evidence(calls))


def evidence_of(v: Verdict, share: float | None) -> dict[str, Any]:
    steps = len({c.step for c in v.calls}) or 1
    sigs = v.signatures
    if v.dynamic_dims:
        sigs = list(dict.fromkeys(wildcard(s, v.dynamic_dims) for s in sigs))
    out: dict[str, Any] = {"signatures": [s.render() for s in sigs[:RECOMPILE_BUDGET]],
                           "calls_per_step": round(len(v.calls) / steps, 3)}
    if share is not None:
        out["share"] = round(share, 5)
    return out


def shares(obs: Observation) -> dict[str, float]:
    """Each path's total time as a share of the step (all its calls)."""
    if not obs.step_ms:
        return {}
    return {p: ms / obs.step_ms for p, ms in obs.total_ms.items()}


def coverage(obs: Observation, regions: Sequence[str]) -> dict[str, Any]:
    """Share of the eager step inside regions, and the largest eager remainders.

    Uses the timed calls (path, parent, ms): a call counts once, at its outermost region; the
    remainder is the self time of calls outside every region, summed over numbered paths
    (``blocks.3.attn`` and ``blocks.7.attn`` count as ``blocks.*.attn``).
    """
    if not obs.timed_calls or not obs.step_ms:
        return {}
    calls = obs.timed_calls
    rset = set(regions)
    inside = [False] * len(calls)
    covered = 0.0
    child_ms = [0.0] * len(calls)
    for i, (path, parent, ms) in enumerate(calls):
        if parent >= 0:
            child_ms[parent] += ms
        if parent >= 0 and inside[parent]:
            inside[i] = True
        elif path in rset:
            inside[i] = True
            covered += ms
    rest: dict[str, float] = {}
    for i, (path, _parent, ms) in enumerate(calls):
        if not inside[i]:
            key = re.sub(r"\.\d+(?=\.|$)", ".*", path)
            rest[key] = rest.get(key, 0.0) + max(0.0, ms - child_ms[i])
    step = obs.step_ms  # timed_calls are one step's calls (surgery.planning.level_timing)
    # The step's own time outside every module call (the driver's Python, a sampler, a loop).
    top = sum(ms for _path, parent, ms in calls if parent < 0)
    if step > top:
        rest[OUTSIDE] = step - top
    remainders = [{"path": p or "(model)", "ms": round(ms, 4), "share": round(ms / step, 4)}
                  for p, ms in sorted(rest.items(), key=lambda kv: -kv[1])[:_REMAINDERS]
                  if ms > 0]
    out: dict[str, Any] = {
        "clock": obs.clock, "timed_steps": obs.timed_steps or 1, "step_ms": round(step, 4),
        "covered_ms": round(min(covered, step), 4),
        "covered_share": round(min(1.0, covered / step), 4),
    }
    if obs.bare_step_ms and obs.hooked_step_ms:
        out["hooked_step_ms"] = round(obs.hooked_step_ms, 4)
        out["hook_overhead_ms"] = round(max(0.0, obs.hooked_step_ms - obs.bare_step_ms), 4)
    if obs.watched_step_ms:
        out["watched_step_ms"] = round(obs.watched_step_ms, 4)
    out["remainder"] = remainders
    return out
