"""Evidence never loses to names: plan both ways from one run, keep the better, and say both.

Why. The names-only planner (surgery.planning.regions) proposes whole blocks by their names and
structure; the evidence planner (surgery.planning.evidence) proposes the subtrees a run showed to
keep one shape. On a real streaming model the evidence plan once covered less than the names-only
plan of the same model. So both are judged by the same run:

- A names-found region that the evidence judges **fixed** stays a region: it joins the evidence
  regions unless it nests with one (then the evidence region, a maximal fixed subtree, already
  holds it) or runs only inside them.
- A names-found region that the evidence shows to be **unsafe** (it changed Python state, its
  inside changed for one signature, its autocast state flipped, too many signatures) is left out,
  with that evidence. One never called in the watched steps is left out too: it adds nothing to
  this step, and nothing vouches for it.
- The coverage of both is computed on the same bare step, and the plan with more of the step
  inside regions is kept (the evidence side on a tie). Both figures go into ``[coverage]``
  (``covered_share``, ``names_covered_share``) and the CLI prints them side by side.

Whichever is kept, every module still gets one fate (``complete_fates``). A module neither
plan gave a reason is left out as ``NAMES_LEFT_OUT``; when the evidence plan is kept, no module
should need it (the evidence planner records every module it does not choose), so a test that
finds that reason in an evidence plan has found a module the evidence planner lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from surgery.planning.budgets import plan_groups
from surgery.planning.evidence import (
    NEVER_CALLED,
    Choice,
    coverage,
    evidence_of,
    judge,
    shares,
    why_varies,
)
from surgery.planning.observation import Call, Observation

__all__ = ["NAMES_LEFT_OUT", "best_of", "complete_fates"]

# The fate of a module the names-only plan left out and the evidence plan never judged.
NAMES_LEFT_OUT = "left out by the names-only plan"


def _module(path: str, obs: Observation) -> str:
    return path if path in obs.classes else path.rpartition(".")[0]


def _within(inner: str, outer: str) -> bool:
    return inner == outer or not outer or inner.startswith(f"{outer}.")


def _nests(a: str, b: str, obs: Observation) -> bool:
    """Whether compiling both would put one compiled callable inside the other."""
    ma, mb = _module(a, obs), _module(b, obs)
    a_method, b_method = a not in obs.classes, b not in obs.classes
    if a_method and b_method:
        return a == b
    if a_method:
        return _within(ma, mb)
    if b_method:
        return _within(mb, ma)
    return _within(ma, mb) or _within(mb, ma)


def _only_inside(path: str, regions: set[str], calls: list[Call], mine: list[Call]) -> bool:
    for c in mine:
        p = c.parent
        while p >= 0 and calls[p].path not in regions:
            p = calls[p].parent
        if p < 0:
            return False
    return True


def complete_fates(obs: Observation, regions: Sequence[str], left: dict[str, str],
                   default: str) -> dict[str, str]:
    """``left`` with every module that is neither a region nor inside one given a reason, and
    nothing inside a region or a region itself listed."""
    modules = {_module(r, obs) for r in regions if r in obs.classes}
    out: dict[str, str] = {}
    for p in obs.classes:
        if not p or any(_within(p, m) for m in modules):
            continue
        out[p] = left.get(p, default)
    for p, why in left.items():  # method paths
        if p not in obs.classes and p not in regions:
            out[p] = why
    return out


def best_of(obs: Observation, choice: Choice,
            names: Sequence[str]) -> tuple[Choice, dict[str, Any]]:
    """The better of the evidence plan (joined by the names regions it judged fixed) and the
    names-only plan less what the evidence showed unsafe; and what both covered."""
    by_path = obs.by_path()
    share = shares(obs)
    names_cov = coverage(obs, list(names)).get("covered_share", 0.0) if obs.timed_calls else None
    fixed, unsafe = [], {}
    for p in names:
        calls = by_path.get(p)
        if not calls:
            unsafe[p] = f"found by names, but {NEVER_CALLED}"
            continue
        v = judge(p, calls, obs.calls)
        if v.fixed or v.dynamic_dims:
            fixed.append(p)
        else:
            unsafe[p] = "found by names, but the run shows it unsafe: " + "; ".join(v.reasons)
    left = dict(choice.left_out)
    joined = list(choice.regions)
    for p in fixed:
        if any(_nests(p, r, obs) for r in joined):
            continue
        if _only_inside(p, set(joined), obs.calls, by_path[p]):
            continue
        joined.append(p)
    dynamic = {p: d for p in joined + fixed
               if (d := judge(p, by_path[p], obs.calls).dynamic_dims)}
    groups, over = plan_groups(obs, joined, by_path, dynamic, why_varies)
    if over:  # a names region that breaks its group's budget: the evidence plan stands alone
        joined = [p for p in joined if p not in over or p in choice.regions]
        groups, _ = plan_groups(obs, joined, by_path, dynamic, why_varies)
        left.update({p: r for p, r in over.items() if p not in joined})
    rival = [p for p in names if p in fixed]
    _, over_rival = plan_groups(obs, rival, by_path, dynamic, why_varies)
    rival = [p for p in rival if p not in over_rival]
    cov_joined = coverage(obs, joined)
    cov_rival = coverage(obs, rival)
    pick_names = bool(cov_joined) and cov_rival.get("covered_share", 0.0) > \
        cov_joined.get("covered_share", 0.0)
    regions = rival if pick_names else joined
    if pick_names:
        groups, _ = plan_groups(obs, regions, by_path, dynamic, why_varies)
        lost = f"the names-only plan covered more of the step " \
               f"({cov_rival['covered_share']:.1%} against {cov_joined['covered_share']:.1%})"
        left.update({p: lost for p in joined if p not in regions})
        left.update({p: r for p, r in over_rival.items() if p not in regions})
    left.update(unsafe)
    fates = complete_fates(obs, regions, left, default=NAMES_LEFT_OUT)
    evidence = {}
    for p in regions:
        evidence[p] = choice.evidence.get(p) or evidence_of(judge(p, by_path[p], obs.calls),
                                                            share.get(p))
    cov = cov_rival if pick_names else cov_joined
    info: dict[str, Any] = {"chosen": "names" if pick_names else "evidence"}
    if names_cov is not None:
        info["names_covered_share"] = round(names_cov, 4)
    return Choice(regions, sorted(fates.items()), evidence, cov, groups), info
