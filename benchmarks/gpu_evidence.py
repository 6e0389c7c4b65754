"""Evidence plan vs names-only plan vs whole-model compile vs eager, on the SDPA example build.

Model: `surgery.examples.lingbot_sdpa()` (dim 1024; 24 patch-embed, 24 frame and 24 plain-SDPA
global blocks sharing one 2D RoPE; a float32 DPT head at 378x518 under autocast(enabled=False);
a camera trunk with its own KV cache), float32 weights, every step under bf16 autocast, as
LingBot-Map's SDPA build runs. Frames stream one a step; before timing every arm streams
`WARM` frames so both KV caches are at their steady length.

Arms (each in a fresh process with a fresh inductor cache, all in one call):
  eager     the model as it is
  names     `surgery plan --model` (names and structure only), apply_manifest defaults
  evidence  `surgery plan --model --input surgery.examples:stream_step --steps 6 --dtype bf16`
            (regions from what the run showed), apply_manifest defaults
  whole     torch.compile(model), default inductor

For each: ms a frame (median, p90; CUDA events, synchronised each frame), cold start (plan,
compile and warm-up), peak GPU memory while compiling and in the steady frames, eager-step
coverage of each plan (from the evidence arm's timed run: the share of the eager step inside the
plan's regions), and the largest relative output difference from eager.

    python benchmarks/gpu_evidence.py --all [--out results.json]
    python benchmarks/gpu_evidence.py --arm evidence --frames 20      # one arm, this process
    GPU_EVIDENCE_SIZE=tiny python benchmarks/gpu_evidence.py --all    # the CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _arms import (  # noqa: E402
    against_reference,
    child_result,
    fresh_cache_env,
    latency,
    paths_per_kind,
    plan_from_evidence,
    print_arm_result,
    time_call,
)

ARMS = ("eager", "names", "evidence", "whole")
SPEC = "surgery.examples:lingbot_sdpa"
STEP = "surgery.examples:stream_step"
WARM = 20  # frames before timing: the camera trunk's window is 16


def spec() -> str:
    return "surgery.examples:tiny_sdpa" if os.environ.get("GPU_EVIDENCE_SIZE") == "tiny" \
        else SPEC


def run_arm(arm: str, n_frames: int) -> dict[str, Any]:
    import torch

    from surgery.formats.source import load_factory
    from surgery.planning.observed import build_live
    from surgery.planning.plan import compile_defaults, plan_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"arm": arm}
    torch.manual_seed(0)
    model = build_live(spec(), device=dev)
    xs = [model.example_input(seed=1000 + i) for i in range(8)]
    ac = torch.autocast(dev, dtype=torch.bfloat16)

    def step(m: Any) -> Any:
        with torch.no_grad(), ac:
            return m(xs[m.frames_seen % len(xs)])

    keys_before = set(model.state_dict())
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    call: Any = model
    handle = None
    if arm in ("names", "evidence"):
        from surgery import apply_manifest

        comp = compile_defaults()
        if arm == "names":
            manifest = plan_model(spec(), compile=comp).manifest
        else:
            manifest = plan_from_evidence(model, load_factory(STEP), source=spec(), out=out,
                                          autocast=torch.bfloat16)
            model.reset_stream()
        out["plan_s"] = round(time.perf_counter() - t0, 2)
        out["regions"] = paths_per_kind(manifest)
        handle = apply_manifest(model, manifest, warmup=step)
        counts = handle.report.counts()
        out["regions_compiled"] = f"{counts.get('compiled', 0)}/{len(handle.report)}"
    elif arm == "whole":
        call = torch.compile(model)
    model.reset_stream()  # every arm streams the same frames from an empty cache
    times: list[float] = []
    outs: list[Any] = []
    with torch.no_grad():
        for i in range(WARM + n_frames):
            if i == WARM:
                sync()
                out["cold_s"] = round(time.perf_counter() - t0, 2)
                out["compile_peak_gib"] = round(
                    (torch.cuda.max_memory_allocated() - base) / 2**30, 3) if cuda else 0.0
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            if handle is not None:
                torch.compiler.cudagraph_mark_step_begin()
            with ac:
                y, ms, _ = time_call(functools.partial(call, xs[i % len(xs)]), cuda=cuda)
            model.frames_seen += 1
            if i >= WARM:
                times.append(ms)
                outs.append({k: v.float().cpu() for k, v in y.items()})
    out.update(**latency(times),
               steady_peak_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
               if cuda else 0.0,
               weights_gib=round(base / 2**30, 3),
               changed_keys=len(keys_before - set(model.state_dict())),
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    if handle is not None:
        out["graphs_captured"] = sum(r.graphs_captured for r in handle.report)
        out["output_sets_max"] = max((r.output_sets for r in handle.report), default=0)
        out["fell_back"] = [r.path for r in handle.report if r.status != "compiled"][:5]
    diff = against_reference(outs, ref_path=os.environ.get("GPU_EVIDENCE_REF"),
                             is_reference=arm == "eager")
    if diff is not None:
        out["max_rel_diff"] = diff
    if handle is not None:
        handle.restore()
    return out


def run_all(arms: list[str], n_frames: int, timeout: int) -> list[dict[str, Any]]:
    ref = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpu_evidence_ref_{os.getpid()}.pt")
    results = []
    for i, arm in enumerate(arms):
        env = fresh_cache_env(f"gpu_evidence_cache_{i}", GPU_EVIDENCE_REF=ref)
        results.append(child_result([__file__, "--arm", arm, "--frames", str(n_frames)],
                                    env=env, timeout=timeout, ident={"arm": arm}))
    return results


def table(results: list[dict[str, Any]]) -> str:
    eager = next((r["median_ms"] for r in results if r["arm"] == "eager" and "median_ms" in r),
                 None)
    rows = ["| arm | ms/frame (median) | p90 | vs eager | cold start (s) | peak GiB compile / "
            "steady (above weights) | regions compiled | max rel diff |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['arm']} | failed: {r['error'][:160]} | | | | | | |")
            continue
        speed = f"{eager / r['median_ms']:.2f}x" if eager else ""
        diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else "(reference)"
        rows.append(f"| {r['arm']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {speed} | "
                    f"{r['cold_s']:.1f} | {r['compile_peak_gib']:.2f} / "
                    f"{r['steady_peak_gib']:.2f} | {r.get('regions_compiled', '')} | {diff} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--all", action="store_true", help="every arm, each in a fresh process")
    ap.add_argument("--arms", help="comma-separated subset for --all")
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=240, help="per arm, seconds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.arm:
        print_arm_result(lambda: run_arm(args.arm, args.frames), {"arm": args.arm})
        return
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    results = run_all(arms, args.frames, args.timeout)
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
