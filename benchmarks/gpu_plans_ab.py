"""The names-only plan against the evidence plan in ONE process, taking turns (issue 18).

Why: gpu_plans.py runs each arm in a fresh process, and on the H200 the host's pace moves up to
40% between processes: GPT-2 generate() read evidence 65.08 / names 119.57 ms in one call and
94.78 / 72.80 in another, so a pair of processes cannot tell noise from a real loss. Here both
plans run in one process, on twins of one model, in alternating rounds, as gpu_piecewise.py's
``gpt2_ab`` does for eager and the stack.

How. One model is built (gpu_plans.py's factory and driver: bf16 weights, ``generate()`` of 16
new tokens from a 32-token prompt, a new DynamicCache each call; or ``cache_implementation=
"static"``). Two twins are deep copies that share its parameters and buffers (_turns.eager_twin:
no weight memory of their own), and the model itself stays eager. The names-only plan
(``plan_model``, as ``surgery plan --model``) is applied to one twin and the evidence plan
(``plan_from_step`` over the same driver under ``no_grad``, as gpu_plans.py's evidence arm) to
the other, both deployed under ``inference_mode`` with the same warm-up. Then R rounds: each
round runs N ``generate()`` calls of each twin (and of eager, with ``--eager``), the order
alternating: names first in even rounds, evidence first in odd ones (eager, with ``--eager``,
last in even rounds and first in odd ones). Each side's figure in a round is the median of its
N calls; the round's ratio is names / evidence (above 1: the evidence plan is faster).

Twin interference, and how each is ruled out:
- dynamo caches: each compile group compiles a copy of its function with a fresh code object
  (surgery.runtime.budget.fresh_function), so the twins' regions never share a dynamo cache or
  a recompile budget; ``recompiles`` per twin is printed (0 in steady state when none leak).
- inductor's in-process caches: the second apply may reuse a kernel the first compiled. That
  moves only the second apply's cold start (``apply_s``, printed per twin with which went
  first), never the steady rounds.
- the stream route: each twin gets its own route on its own instance ``forward``; the eager
  model has none.
- one twin slowing the other (graph pools held, host caches), or the evidence plan's watched
  run leaving process-wide state behind: the first twin is planned, applied and timed ALONE
  before the second plan is even planned (``solo_ms``), and again in the rounds; the two
  figures are printed side by side. ``--first evidence`` swaps which goes first.

After the rounds, one more generate() per side has each model call (the prefill, then each
decode step) timed alone, synchronised around it by hooks removed after: the prefill, the
first decode step and the median later one, so a per-generate() cost shows apart from the
per-token one. Prints one JSON line with --json, else a table. Per side: median and p90 ms a
call over every timed call, ms per new token, steady peak GPU memory above the weights (the
peak of its own calls; both twins' graphs are held throughout), regions, compiled paths,
graphs captured, replays, recompiles; the rounds' ratios and their median; whether every call's
tokens equal the eager model's.

    python benchmarks/gpu_plans_ab.py --model gpt2_generate --rounds 7 --calls 5 --pin
    python benchmarks/gpu_plans_ab.py --model gpt2_static --rounds 5 --calls 3
    GPU_PLANS_SIZE=tiny python benchmarks/gpu_plans_ab.py --rounds 2 --calls 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _arms import latency, paths_per_kind, time_call  # noqa: E402
from _turns import eager_twin  # noqa: E402
from gpu_plans import driver, gpt2  # noqa: E402

MODELS = ("gpt2_generate", "gpt2_static")
PLANS = ("names", "evidence")
PROMPT = 32  # gpu_plans.driver's prompt length


def _pin() -> str:
    """This process on one CPU core (the lowest it may use), so both twins share it."""
    if not hasattr(os, "sched_setaffinity"):
        return "no (os.sched_setaffinity is not on this platform)"
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"cpu {core}"


def plan(kind: str, twin: Any, unit: Any) -> Any:
    """The manifest of ``kind`` for ``twin``: names-only from the factory, or evidence from six
    watched ``no_grad`` calls of ``unit`` on the twin itself (its hooks removed after)."""
    import torch

    from surgery.planning.observed import plan_from_step
    from surgery.planning.plan import compile_defaults, plan_model

    if kind == "names":
        return plan_model("gpu_plans:gpt2", compile=compile_defaults()).manifest

    def step(m: Any) -> None:
        with torch.no_grad():
            unit(m)

    return plan_from_step(twin, step, steps=6, timed_steps=3, compile=compile_defaults(),
                          source="gpt2")


def _counts(handle: Any) -> dict[str, Any]:
    recs = list(handle.report)
    return {"compiled": f"{sum(r.status == 'compiled' for r in recs)}/{len(recs)}",
            "graphs_captured": sum(r.graphs_captured for r in recs),
            "replays": sum(r.cuda_graph_replays for r in recs),
            "compiles": sum(r.compiles for r in recs),
            "recompiles": sum(r.recompiles for r in recs),
            "pieces_light": sum(r.pieces_light for r in recs)}


def per_call(model: Any, unit: Any, sync: Any) -> dict[str, Any]:
    """One more ``unit(model)`` with each model call (the prefill, then one a decode step)
    timed alone: synchronised before and after, by hooks on the model removed after. Shows a
    per-generate() cost (a prefill on a slow path, a first decode step that marks or binds a
    new cache) that a median over whole calls blurs."""
    times: list[float] = []
    t0 = [0.0]

    def pre(*_: Any) -> None:
        sync()
        t0[0] = time.perf_counter()

    def post(*_: Any) -> None:
        sync()
        times.append((time.perf_counter() - t0[0]) * 1e3)

    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    try:
        unit(model)
    finally:
        for h in hooks:
            h.remove()
    if len(times) < 3:
        raise RuntimeError(f"one generate() made {len(times)} model calls: expected a prefill "
                           "and decode steps")
    return {"prefill_ms": round(times[0], 3), "first_decode_ms": round(times[1], 3),
            "decode_ms": round(statistics.median(times[2:]), 3), "model_calls": len(times)}


def run_ab(name: str, rounds: int, calls: int, *, with_eager: bool, first: str,
           pin: bool) -> dict[str, Any]:
    import torch

    from surgery import apply_manifest

    out: dict[str, Any] = {"model": name, "pinned": "no"}
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)  # the shared CPU machine
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = gpt2().to(device=dev, dtype=torch.bfloat16).eval()
    unit, _ = driver(name, model, dev)
    twins = {"names": eager_twin(model), "evidence": eager_twin(model)}
    base = torch.cuda.memory_allocated() if cuda else 0  # the one set of weights
    overrides = None if cuda else {"on_cpu": "compile", "backend": "aot_eager"}
    order = (first, *(p for p in PLANS if p != first))
    handles: dict[str, Any] = {}
    with torch.inference_mode():
        ref = unit(model).cpu()  # eager's tokens
    for i, k in enumerate(order):
        t = time.perf_counter()
        manifest = plan(k, twins[k], unit)  # outside inference_mode, as users plan
        out[f"{k}_plan_s"] = round(time.perf_counter() - t, 2)
        out[f"{k}_regions"] = paths_per_kind(manifest)
        with torch.inference_mode():
            t = time.perf_counter()
            handles[k] = apply_manifest(twins[k], manifest, warmup=unit, overrides=overrides)
            unit(twins[k])  # one more full call: every signature seen
            sync()
            out[f"{k}_apply_s"] = round(time.perf_counter() - t, 2)
            out[f"{k}_applied"] = "first" if i == 0 else "second"
            if i == 0 and pin:  # after the first compiles: inductor's workers keep every core
                out["pinned"] = _pin()
            if i == 0:  # alone: before the other plan is planned (its watch) or applied
                out[f"{k}_solo_ms"] = round(statistics.median(
                    time_call(lambda m=twins[k]: unit(m), cuda=cuda)[1] for _ in range(calls)), 3)
    with torch.inference_mode():
        sides = {**({"eager": model} if with_eager else {}), **twins}
        per_round: dict[str, list[float]] = {k: [] for k in sides}
        every: dict[str, list[float]] = {k: [] for k in sides}
        peaks = dict.fromkeys(sides, 0.0)
        identical = True
        firsts = []
        before = {k: _counts(h)["recompiles"] for k, h in handles.items()}
        for r in range(rounds):
            even = r % 2 == 0
            turn = [*(PLANS if even else PLANS[::-1])]
            if with_eager:
                turn = [*turn, "eager"] if even else ["eager", *turn]
            firsts.append(turn[0])
            for k in turn:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                ms = []
                for _ in range(calls):
                    y, t, _ = time_call(lambda m=sides[k]: unit(m), cuda=cuda)
                    ms.append(t)
                    identical = identical and bool(torch.equal(y.cpu(), ref))
                if cuda:
                    peaks[k] = max(peaks[k], round(
                        (torch.cuda.max_memory_allocated() - base) / 2**30, 3))
                per_round[k].append(statistics.median(ms))
                every[k] += ms
        counts = {k: _counts(h) for k, h in handles.items()}  # the rounds' own, before the split
        for k, m in sides.items():
            out[f"{k}_per_call"] = per_call(m, unit, sync)
    new = int(ref.shape[1]) - PROMPT
    for k in sides:
        lat = latency(every[k])
        out[f"{k}_ms"] = lat["median_ms"]
        out[f"{k}_p90_ms"] = lat["p90_ms"]
        out[f"{k}_ms_per_token"] = round(lat["median_ms"] / max(new, 1), 3)
        out[f"{k}_peak_gib"] = peaks[k]
        out[f"{k}_round_ms"] = [round(x, 3) for x in per_round[k]]
    for k, c in counts.items():
        c["recompiles_in_rounds"] = c["recompiles"] - before[k]
        out[f"{k}_counts"] = c
    ratios = [n / e for n, e in zip(per_round["names"], per_round["evidence"], strict=True)]
    out.update(rounds=rounds, calls_per_round=calls, first_in_round=firsts,
               round_ratios=[round(x, 3) for x in ratios],
               names_over_evidence=round(statistics.median(ratios), 3),
               evidence_not_slower=statistics.median(ratios) >= 1.0,
               new_tokens=new, tokens_identical=identical, weights_gib=round(base / 2**30, 3),
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    for h in handles.values():
        h.restore()
    return out


def table(r: dict[str, Any]) -> str:
    sides = [k for k in ("eager", *PLANS) if f"{k}_ms" in r]
    rows = [f"{r['model']}, {r['rounds']} rounds of {r['calls_per_round']} generate() calls, "
            f"{r['new_tokens']} new tokens each, pinned {r['pinned']}, {r['gpu']}",
            "| side | ms a call (median / p90) | ms per token | steady peak GiB | applied "
            "(plan s / apply s) | solo ms | prefill / 1st decode / decode ms | compiled | "
            "graphs captured / replays / recompiles (in rounds) | regions |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for k in sides:
        c = r.get(f"{k}_counts", {})
        counts = (f"{c['graphs_captured']} / {c['replays']} / {c['recompiles']} "
                  f"({c['recompiles_in_rounds']})" if c else "")
        applied = (f"{r[f'{k}_applied']} ({r[f'{k}_plan_s']} / {r[f'{k}_apply_s']})"
                   if f"{k}_applied" in r else "")
        pc = r[f"{k}_per_call"]
        rows.append(f"| {k} | {r[f'{k}_ms']:.2f} / {r[f'{k}_p90_ms']:.2f} | "
                    f"{r[f'{k}_ms_per_token']:.3f} | {r[f'{k}_peak_gib']:.3f} | {applied} | "
                    f"{r.get(f'{k}_solo_ms', '')} | {pc['prefill_ms']:.2f} / "
                    f"{pc['first_decode_ms']:.2f} / {pc['decode_ms']:.2f} | "
                    f"{c.get('compiled', '')} | {counts} | "
                    f"{r.get(f'{k}_regions', '')} |")
    verdict = "met" if r["evidence_not_slower"] else "NOT met"
    rows += ["", f"- round ratios names/evidence: {r['round_ratios']} (first in round: "
             f"{r['first_in_round']})",
             f"- median ratio {r['names_over_evidence']:.3f}: evidence at least as fast as "
             f"names: {verdict}; tokens identical to eager in every call: "
             f"{r['tokens_identical']}"]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="gpt2_generate")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="generate() calls per side a round")
    ap.add_argument("--eager", action="store_true", help="time the eager model in turns too")
    ap.add_argument("--first", choices=PLANS, default="names", help="which plan applies first")
    ap.add_argument("--pin", action="store_true",
                    help="this process on one CPU core, from the first twin's solo timing on")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args()
    if args.rounds < 2 or args.calls < 1:
        ap.error(f"--rounds must be at least 2 and --calls at least 1 (got {args.rounds}, "
                 f"{args.calls})")
    res = run_ab(args.model, args.rounds, args.calls, with_eager=args.eager, first=args.first,
                 pin=args.pin)
    print(json.dumps(res) if args.json else table(res), flush=True)


if __name__ == "__main__":
    main()
