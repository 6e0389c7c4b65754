"""GPT-2 in ``generate()``: each module's share of the step timed both ways, and the plan chosen.

The probe for issue 18's timing (surgery.planning.level_timing). At gpu_plans' size (GPT-2 base,
bf16, ``generate(prompt, max_new_tokens=16)`` greedy from a 32-token prompt, dynamic cache,
6 watched steps, 3 timed) it prints, per module group (``transformer.h.*.mlp`` sums the 12):

- ``old_raw``: ms a step inside its spans with hooks on every module at once (the method before
  level timing), as the events saw them;
- ``old``: the same corrected as that method did (the average hook cost off each span for every
  call nested in it, never below bare / hooked of the span, children fitted inside parents, the
  whole fitted to the bare step), and its share of the bare step;
- ``new``: level timing's ms a step and share (one pass a nesting level, the hooks' own part
  calibrated and taken off);

then the bare step, each method's hooked step, the plain plan's coverage by each, the piecewise
trial's coverage, the rule before (plain under 50% and piecewise at least twice it) and the rule
now (surgery.planning.compile_cost.piecewise_wins) on each method's figures, and the plan that
``plan_from_step``'s path chooses from the new figures. One JSON line at the end.

    python benchmarks/gpu_level_timing.py            # H200: about 40 s
    python benchmarks/gpu_level_timing.py --tiny     # CPU smoke run (2 layers, width 64)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NEW_TOKENS = 16


def legacy_fold(calls: list[tuple[str, int, float]], *, overhead_ms: float,
                scale: float) -> list[tuple[str, int, float]]:
    """The correction before level timing (observation.fold_times at b161406), for comparison:
    each span less the average hook cost for every call nested in it, never below scale times
    itself; then children scaled to fit inside their parent."""
    below = [0] * len(calls)
    for i in range(len(calls) - 1, -1, -1):
        if calls[i][1] >= 0:
            below[calls[i][1]] += below[i] + 1
    span = [max(ms * scale, ms - overhead_ms * below[i]) for i, (_p, _q, ms) in enumerate(calls)]
    kids = [0.0] * len(calls)
    for i, (_p, parent, _ms) in enumerate(calls):
        if parent >= 0:
            kids[parent] += span[i]
    for i, (_p, parent, _ms) in enumerate(calls):
        if parent >= 0 and kids[parent] > span[parent]:
            span[i] *= span[parent] / kids[parent]
    return [(p, q, span[i]) for i, (p, q, _ms) in enumerate(calls)]


def group(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path) or "(model)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="2 layers, width 64 (the CPU smoke run)")
    args = ap.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from surgery.formats.manifest import PIECEWISE_KIND
    from surgery.planning.compile_cost import choose_piecewise, in_model_share, piecewise_wins
    from surgery.planning.evidence import coverage
    from surgery.planning.observation import Observation, Timer
    from surgery.planning.observed import manifest_from_evidence, watch_model
    from surgery.planning.streaming import plan_piecewise, region_paths

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4) if args.tiny else GPT2Config()
    model = GPT2LMHeadModel(cfg).to(dev, dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0)).to(dev)

    def step(m: Any) -> None:
        with torch.no_grad():
            m.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

    t0 = time.perf_counter()
    w = watch_model(model, step, steps=6, timed_steps=3)  # the new method, as plan does it
    watch_s = time.perf_counter() - t0
    obs = w.obs

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.compiler.set_stance("force_eager"):
            step(model)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    # The old method: hooks on every module at once, 3 steps.
    timer = Timer(model, cuda=cuda, clock=None)
    timer.reserve(2 * len(obs.calls) // 6 * 3 + 64)
    with timer:
        hooked = []
        for s in range(3):
            timer.step = s
            hooked.append(timed())
    raw = timer.calls_ms()
    hooked_ms = min(hooked)
    bare = obs.bare_step_ms
    calls = [(p, q, ms) for p, q, ms, _s in raw]
    per_call = max(0.0, hooked_ms - bare) * 3 / len(calls)
    fixed = legacy_fold(calls, overhead_ms=per_call, scale=min(1.0, bare / hooked_ms))
    top = sum(ms for _p, q, ms in fixed if q < 0) / 3
    fit = min(1.0, bare / top) if top > 0 else 1.0
    old = Observation(step_ms=bare, timed_steps=1, clock=obs.clock, calls=obs.calls)
    old.timed_calls = [(p, q, ms * fit / 3) for p, q, ms in fixed]  # one step's worth each

    rows: dict[str, dict[str, float]] = {}
    for p, _q, ms, _s in raw:
        rows.setdefault(group(p), {}).setdefault("old_raw", 0.0)
        rows[group(p)]["old_raw"] += ms / 3
    for p, _q, ms in old.timed_calls:
        rows[group(p)]["old"] = rows[group(p)].get("old", 0.0) + ms
    for p, _q, ms in obs.timed_calls:
        rows.setdefault(group(p), {})
        rows[group(p)]["new"] = rows[group(p)].get("new", 0.0) + ms
    print(f"{'module group':34s} {'old_raw':>9s} {'old':>9s} {'old%':>6s} {'new':>9s} "
          f"{'new%':>6s}   (ms a generate step)")
    for g, r in sorted(rows.items(), key=lambda kv: -kv[1].get("new", 0.0)):
        o, n = r.get("old", 0.0), r.get("new", 0.0)
        print(f"{g:34s} {r.get('old_raw', 0.0):9.3f} {o:9.3f} {o / bare:6.1%} {n:9.3f} "
              f"{n / bare:6.1%}")

    m = manifest_from_evidence(w, source="gpt2_generate")
    plain_paths = region_paths(m)
    trial = manifest_from_evidence(w, source="gpt2_generate")
    plan_piecewise(trial, w.model, w.view)
    pw_paths = region_paths(trial)
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                               "torch": torch.__version__, "watch_s": round(watch_s, 2),
                               "bare_step_ms": round(bare, 3),
                               "old_hooked_step_ms": round(hooked_ms, 3),
                               "old_hook_ms_per_call": round(per_call, 5),
                               "new_slowest_pass_step_ms": round(obs.hooked_step_ms, 3),
                               "new_timing_passes": obs.timing_passes,
                               "new_hook_inner_ms": round(obs.hook_ms_per_call, 5),
                               "new_hook_pair_ms": round(obs.hook_pair_ms, 5),
                               "plain_regions": len(plain_paths)}
    for name, o in (("old", old), ("new", obs)):
        plain = coverage(o, plain_paths)["covered_share"]
        got = coverage(o, pw_paths)["covered_share"]
        inside = in_model_share(o)
        figures[f"{name}_plain_covered"] = plain
        figures[f"{name}_piecewise_covered"] = got
        figures[f"{name}_in_model"] = round(inside, 4)
        figures[f"{name}_rule_before"] = plain < 0.5 and got >= 2.0 * plain
        figures[f"{name}_rule_now"] = piecewise_wins(plain, got, inside)
    notes = choose_piecewise(m, obs, w.model, w.view)
    figures["chosen"] = sorted({f"{r.kind}:{r.module_class}" for r in m.regions})
    figures["piecewise_planned"] = any(r.kind == PIECEWISE_KIND for r in m.regions)
    figures["note"] = notes[0] if notes else ""
    for k, v in figures.items():
        print(f"{k}: {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
