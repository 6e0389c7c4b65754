"""What an evidence plan costs to compile, and the light regions that inductor would not repay.

Why. A region's cold start is its compiles: dynamo traces the function once per compile group
(one function with one weight layout, surgery.planning.budgets) and signature, and inductor then
generates and builds kernels for each graph, from scratch in a fresh process (about 2 s a small
graph on an H200, more on a CPU). The evidence plan finds regions the names-only plan does not
(on diffusers' Flux: ``time_text_embed``, ``pos_embed``, ``norm_out``, three small graphs that
were 7.7% of the step), and each is a *new* compile group. On an H200 those three cost 7 s of
cold start for 0.8 ms a call, so the evidence plan's cold start missed its target (at most the
names-only plan's plus the planning time).

What a small region gains under region capture (``capture = "region"``, the default) is mostly
its launches: surgery replays one CUDA graph of it, whatever compiled it. What inductor adds on
top is kernel fusion, which can save at most the region's own kernel time, a part of its share of
the step. So:

- A **light group** is a compile group of the evidence plan that the names-only plan does not
  have (none of its paths is a names region) and whose paths together hold less than
  ``LIGHT_SHARE`` of the bare step. Names groups are never light: they compile exactly as the
  names-only plan would, so the evidence plan keeps every speed-up the names plan has.
- With region capture, a light group compiles with ``LIGHT_BACKEND`` (``aot_eager``: dynamo's
  trace and AOTAutograd's, no code generation) as a per-region ``[region.compile]`` override,
  and is captured like every region. Its launches are saved; its compile costs a trace, not a
  kernel build.
- Without region capture (the compiler's own graphs, or none), aot_eager would save nothing, so
  a light group is **left out** with the reason ("not worth its compile: ...").

**Piecewise by default, where the case is strong.** A streaming
block (attention over a growing cache: GPT-2 in ``generate()``) is left out of a plain plan, and
``--piecewise`` (surgery.planning.streaming) makes it one piecewise region. On an H200 that was
the difference between a plan slower than eager (GPT-2's 12 MLP graphs: 0.69x) and 1.13x at 90%
of the step, for a cold start of 30 s against 9 s; on the SDPA example (H200, gpu_plans) its
global blocks piecewise ran 2.30x the names plan at 0.97x its cold start, and with the trunk
piecewise too 2.52x at 1.21x. So an evidence plan that is not told (``piecewise=None``) tries
it, and keeps it in either of two strong cases:

- of the step time inside the model's calls (what any plan can reach: not a generate loop's own
  Python), the piecewise plan leaves outside its regions at most ``AUTO_PIECEWISE_LEFT`` of what
  the plain plan leaves, and adds at least ``AUTO_PIECEWISE_MIN_GAIN`` of the step: the plain
  plan misses most of what there is to gain, and that is much (tiny SDPA on a noisy CPU once read
  81% against 85%: all of what was left, but 4% of the step);
- or the plain plan covers under ``AUTO_PIECEWISE_BELOW`` of the step and the piecewise plan at
  least ``AUTO_PIECEWISE_GAIN`` times as much.

The first case exists because the second rests on the weaker of the two figures. GPT-2's plain
plan is its twelve MLPs, small modules around many child calls, which the timing hooks once
inflated from 14.5% to 64.3% of the step on one H200 host (surgery.planning.level_timing), and
the 50% threshold then lost the stack; the stack itself is most of the step on any host. The
second case stays for a model with a large module outside both plans: tiny GPT-2 in bf16 on
this CPU, whose ``lm_head`` (50257 wide) is 18% of the step, 75% left by the plain plan against
32%, but 2% covered against 45%. GPT-2 on that H200: 35% left against under 1%, piecewise. The
SDPA example: 56% left against 29%, and 43% against 70%: plain by either (opt-in there, for its
cold start). ``piecewise=True`` / ``False`` decide without the trial.

The figures (``compile_cost``) go into ``[coverage]`` and the plan's notes, so that a benchmark
can check them against the runtime's report: regions, compile groups, and estimated compiles
(one a group and distinct signature seen, the most a group's budget allows; a dynamic group one),
for the evidence plan as written, for its inductor part, and for the names-only plan.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from surgery.formats.manifest import PIECEWISE_KIND, Manifest
from surgery.planning.budgets import RECOMPILE_BUDGET, Group, layout_of
from surgery.planning.evidence import Choice, coverage
from surgery.planning.observation import Call, Observation
from surgery.planning.piecewise_probe import probe_notes, probe_piecewise
from surgery.planning.streaming import plan_piecewise, region_paths

LIGHT_SHARE = 0.05  # of the bare step: below it a new compile group is light
# Piecewise by default when, of the step inside the model, it leaves outside its regions at most
# this share of what the plain plan leaves outside its own ...
AUTO_PIECEWISE_LEFT = 0.25
AUTO_PIECEWISE_MIN_GAIN = 0.2  # ... and adds at least this share of the step, ...
AUTO_PIECEWISE_BELOW = 0.5  # ... or where a plain plan covering less of the step than this ...
AUTO_PIECEWISE_GAIN = 2.0  # ... is covered at least this many times over by the piecewise plan
LIGHT_BACKEND = "aot_eager"  # what a light group compiles with under region capture
# The [coverage] keys these figures are written under (a file format: listed in the README).
COST_KEYS: tuple[str, ...] = ("regions", "compile_groups", "estimated_compiles",
                              "inductor_groups", "inductor_compiles", "light_groups",
                              "names_compile_groups", "names_estimated_compiles",
                              "piecewise_regions", "plain_covered_share")


@dataclass
class Weighed:
    """The groups kept (with the light ones marked), the light paths left out, and the figures."""

    groups: list[Group]
    light: set[str]  # paths of light groups that compile with LIGHT_BACKEND
    dropped: dict[str, str]  # light paths left out (no region capture), with the reason
    figures: dict[str, int]


def group_compiles(g: Group, by_path: dict[str, list[Call]]) -> int:
    """Compiles a group costs: one a distinct signature, at most the budget; dynamic: one."""
    if g.dynamic_dims is not None:
        return 1
    sigs = {c.sig for p in g.paths for c in by_path.get(p, ())}
    return max(1, min(len(sigs), RECOMPILE_BUDGET))


def names_cost(obs: Observation, names: Sequence[str],
               by_path: dict[str, list[Call]]) -> tuple[int, int]:
    """(compile groups, estimated compiles) of the names-only plan's paths that ran."""
    keyed: dict[tuple[Any, ...], set[Any]] = {}
    for p in names:
        if p in by_path:
            key = (obs.callables.get(p, p), layout_of(obs, p))
            keyed.setdefault(key, set()).update(c.sig for c in by_path[p])
    return len(keyed), sum(max(1, min(len(s), RECOMPILE_BUDGET)) for s in keyed.values())


def weigh_compile_cost(obs: Observation, groups: Sequence[Group], names: Sequence[str],
                       share: dict[str, float], *, compile: dict[str, Any]) -> Weighed:
    """Mark the light groups (see the module docstring) and count what the plan compiles."""
    by_path = obs.by_path()
    named = set(names)
    region_capture = compile.get("capture") == "region"
    inductor = compile.get("backend", "inductor") == "inductor"
    kept: list[Group] = []
    light: set[str] = set()
    dropped: dict[str, str] = {}
    for g in groups:
        part = sum(share.get(p, 0.0) for p in g.paths)
        is_light = (inductor and bool(obs.clock) and not named.intersection(g.paths)
                    and part < LIGHT_SHARE)
        if not is_light:
            kept.append(g)
            continue
        if region_capture:
            light.update(g.paths)
            kept.append(g)
            continue
        why = (f"not worth its compile: a compile group the names-only plan does not have, "
               f"for {part:.2%} of the step (under {LIGHT_SHARE:.0%}); without region capture "
               f"a cheaper backend saves nothing, and inductor's compile would not repay it")
        dropped.update({p: why for p in g.paths})
    heavy = [g for g in kept if not light.intersection(g.paths)]
    n_groups, n_compiles = names_cost(obs, names, by_path)
    figures = {
        "regions": sum(len(g.paths) for g in kept),
        "compile_groups": len(kept),
        "estimated_compiles": sum(group_compiles(g, by_path) for g in kept),
        "inductor_groups": len(heavy) if inductor else 0,
        "inductor_compiles": sum(group_compiles(g, by_path) for g in heavy) if inductor else 0,
        "light_groups": len(kept) - len(heavy),
        "names_compile_groups": n_groups,
        "names_estimated_compiles": n_compiles,
    }
    return Weighed(kept, light, dropped, figures)


def cost_note(figures: dict[str, int], light_backend: str = LIGHT_BACKEND) -> str:
    """The figures in one line, for the plan's notes."""
    f = figures
    light = (f", {f['light_groups']} light (under {LIGHT_SHARE:.0%} of the step, new to the "
             f"names plan: {light_backend} under region capture)" if f["light_groups"] else "")
    return (f"compile cost: {f['regions']} region path(s) in {f['compile_groups']} compile "
            f"group(s){light}; about {f['estimated_compiles']} compile(s), "
            f"{f['inductor_compiles']} of them by inductor; the names-only plan: "
            f"{f['names_compile_groups']} group(s), about {f['names_estimated_compiles']} "
            "compile(s)")


def drop_light(obs: Observation, choice: Choice, dropped: dict[str, str]) -> Choice:
    """``choice`` without the ``dropped`` paths: each left out with its reason, the modules
    inside each with a reason naming it, and the coverage taken again."""
    if not dropped:
        return choice
    regions = [p for p in choice.regions if p not in dropped]
    left = dict(choice.left_out)
    left.update(dropped)
    for p in dropped:
        for d in obs.classes:
            if d.startswith(f"{p}.") and d not in left:
                left[d] = f"inside {p}, which is left out as not worth its compile"
    return Choice(regions, sorted(left.items()),
                  {p: e for p, e in choice.evidence.items() if p in regions},
                  coverage(obs, regions),
                  [g for g in choice.groups if not dropped.keys() & set(g.paths)])


def in_model_share(obs: Observation) -> float:
    """The share of the bare step inside the model's top-level calls: what any plan can reach
    (the rest is the step's own Python, a generate loop's sampler)."""
    if not obs.step_ms:
        return 1.0
    top = sum(ms for _p, parent, ms in obs.timed_calls if parent < 0)
    return min(1.0, top / obs.step_ms)


def piecewise_wins(plain: float, got: float, model_share: float = 1.0) -> bool:
    """The default rule (the module docstring), on the plain plan's coverage ``plain``, the
    piecewise plan's ``got`` and the share of the step inside the model ``model_share``: the
    piecewise plan takes at least 1 - AUTO_PIECEWISE_LEFT of what the plain plan leaves inside
    the model and AUTO_PIECEWISE_MIN_GAIN of the step, or the plain plan covers under
    AUTO_PIECEWISE_BELOW and piecewise at least AUTO_PIECEWISE_GAIN times that."""
    reach = max(model_share, got, plain)
    takes_most = reach - got <= AUTO_PIECEWISE_LEFT * (reach - plain) and \
        got - plain >= AUTO_PIECEWISE_MIN_GAIN
    multiplies = plain < AUTO_PIECEWISE_BELOW and got >= AUTO_PIECEWISE_GAIN * plain
    return got > plain and (takes_most or multiplies)


def _left(plain: float, got: float, model_share: float) -> str:
    reach = max(model_share, got, plain)
    return (f"the plain plan covers {plain:.0%} of the step, the piecewise plan {got:.0%}; of "
            f"the {reach:.0%} inside the model, they leave {reach - plain:.0%} and "
            f"{reach - got:.0%} outside their regions")


_RULE = (f"by default where piecewise leaves at most {AUTO_PIECEWISE_LEFT:.0%} of what the plain "
         f"plan leaves and adds {AUTO_PIECEWISE_MIN_GAIN:.0%} of the step, or the plain plan "
         f"covers under {AUTO_PIECEWISE_BELOW:.0%} and piecewise at least "
         f"{AUTO_PIECEWISE_GAIN:g}x that")


def _may_win(trial: Manifest, obs: Observation, plain: float | None) -> bool:
    """Whether the piecewise plan, not yet probed, wins the default rule: the probe only takes
    blocks away, so a plan that loses before it would lose after it (no step spent on it)."""
    if plain is None or not obs.timed_calls:
        return False
    got = coverage(obs, region_paths(trial)).get("covered_share", 0.0)
    return piecewise_wins(plain, got, in_model_share(obs))


def choose_piecewise(manifest: Manifest, obs: Observation, model: Any, view: Any, *,
                     exclude: Sequence[str] = (), piecewise: bool | None = None,
                     step: Callable[[Any], Any] | None = None, autocast: Any = None
                     ) -> list[str]:
    """Plan the streaming blocks of ``manifest`` piecewise, in place: always (True), never
    (False), or where the module docstring's rule keeps it (None). With ``step``, the blocks
    planned piecewise are probed first (surgery.planning.piecewise_probe: one step on
    aot_eager, under ``autocast``), and one that cannot trace keeps its plain treatment with
    the reason under ``[[left_out]]``. Returns the notes."""
    if piecewise is False:
        return []
    plain = (manifest.coverage or {}).get("covered_share")
    trial = copy.deepcopy(manifest)
    notes = plan_piecewise(trial, model, view, exclude=exclude)
    if step is not None and any(r.kind == PIECEWISE_KIND for r in trial.regions) and \
            (piecewise or _may_win(trial, obs, plain)):
        found = probe_piecewise(trial, model, step, autocast=autocast)
        if found.refused:
            trial = copy.deepcopy(manifest)
            notes = plan_piecewise(trial, model, view, exclude=exclude, refused=found.refused)
        notes = [*probe_notes(found), *notes]
    if piecewise:
        manifest.__dict__.update(vars(trial))
        trial = manifest
    pieces = sum(len(r.paths) for r in trial.regions if r.kind == PIECEWISE_KIND)
    after = coverage(obs, region_paths(trial)) if obs.timed_calls else {}
    if piecewise is None:
        got = after.get("covered_share", 0.0)
        model_share = in_model_share(obs)
        if not pieces or plain is None or not piecewise_wins(plain, got, model_share):
            if pieces and plain is not None:
                return [f"not planned piecewise by default: {_left(plain, got, model_share)} "
                        f"(only {_RULE}; plan --piecewise asks for it)"]
            return []
        manifest.__dict__.update(vars(trial))
        notes = [f"planned piecewise by default: {_left(plain, got, model_share)} ({_RULE}; "
                 "the compile-cost and region-graph notes above are of the plain plan); plan "
                 "--no-piecewise keeps them out", *notes]
    if pieces:  # one fate: a module inside a piecewise block is inside a region, not left out
        blocks = [p for r in manifest.regions if r.kind == PIECEWISE_KIND for p in r.paths]
        manifest.left_out = [lo for lo in manifest.left_out if not any(
            lo.path == b or lo.path.startswith(f"{b}.") for b in blocks)]
        manifest.coverage = {**(manifest.coverage or {}), **after, "piecewise_regions": pieces,
                             "regions": sum(len(r.paths) for r in manifest.regions)}
        if plain is not None:
            manifest.coverage["plain_covered_share"] = plain
    return notes
