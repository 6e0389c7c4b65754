"""Regional compile on one GPU: the example model at LingBot size, arm by arm, side by side.

Model: `surgery.examples.lingbot()` (dim 1024; 24 patch-embed, 24 frame and 24 global blocks;
16 heads), bf16, streaming one 378x518 frame per step with the KV cache warm (its window is
filled eagerly before any arm compiles, so every arm starts from the same state).

Arms (each in a fresh process, all in one call):
  eager          the model as it is
  whole          torch.compile(model), default inductor
  hand           LingBot-Map's demo.py recipe: frame and patch-embed blocks *swapped* for
                 torch.compile(block, mode="reduce-overhead"); attn_pre, ffn_residual and
                 attn.proj compiled on every global block; 1 eager + 3 compiled warm-up passes;
                 cudagraph_mark_step_begin() before every forward
  hand_clone     the same, with attn_pre's outputs cloned by hand (what a user must add to
                 keep a KV cache of them alive across replays)
  surgery        `surgery plan` of the live model, then apply_manifest with its defaults
                 (capture = "region": surgery captures one CUDA graph per region path and
                 replays it without entering dynamo; surgery.runtime.graphs.replay)
  surgery_fold   `surgery plan --fold`: the whole patch embed as one region, 1 graph replay
                 instead of 24 (surgery_pe gets the same with --include aggregator.patch_embed)
  surgery_trees  `surgery plan --capture compiler`: inductor's cudagraph trees
                 (mode="reduce-overhead"), the default before region capture; and _fold
  surgery_cg     the same manifest planned with --backend cudagraphs
  surgery_nope / surgery_noepc   diagnostics: patch-embed blocks left eager; no
                 emulate_precision_casts

For each arm: cold start (compile + warm-up, s), steady per-frame latency (median and p90 over
50 frames, CUDA events, synchronised each frame), peak GPU memory, how many state-dict keys
changed, and the largest relative output difference from eager over the same frames.

    python benchmarks/gpu_regions.py --all [--out results.json]      # every arm, fresh processes
    python benchmarks/gpu_regions.py --arm surgery --frames 60          # one arm, this process
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
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
    print_arm_result,
    time_call,
)

# surgery arms: (plan --include, plan --exclude, plan --backend, plan --fold, apply overrides,
# plan --capture)
SURGERY_ARMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None, bool,
                              dict[str, Any], str | None]] = {
    "surgery": ((), (), None, False, {}, None),
    "surgery_fold": ((), (), None, True, {}, None),
    "surgery_trees": ((), (), None, False, {}, "compiler"),
    "surgery_trees_fold": ((), (), None, True, {}, "compiler"),
    "surgery_cg": ((), (), "cudagraphs", False, {}, None),
    "surgery_pe": (("aggregator.patch_embed",), (), None, False, {}, None),
    "surgery_nope": ((), ("aggregator.patch_embed.blocks.*",), None, False, {}, None),
    "surgery_noepc": ((), (), None, False, {"emulate_precision_casts": False}, None),
}
ARMS = ("eager", "whole", "hand", "hand_clone", *SURGERY_ARMS)
TIMED = 50
DISTINCT_FRAMES = 8


def bf16_model() -> Any:
    """The factory `surgery plan --model gpu_regions:bf16_model` plans (dtype matters to the
    fingerprint, so the plan is of the bf16 model that is deployed)."""
    import torch

    from surgery.examples import lingbot, tiny

    size = os.environ.get("GPU_REGIONS_SIZE", "lingbot")
    return (tiny() if size == "tiny" else lingbot()).to(torch.bfloat16)


def build(device: str) -> Any:
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        model = bf16_model().eval()
    return model


def frames(model: Any, n: int) -> list[Any]:
    return [model.example_input(seed=1000 + i) for i in range(n)]


def snapshot_cache(model: Any) -> list[list[Any]]:
    return [list(b.kv_cache) for b in model.aggregator.global_blocks]


def restore_cache(model: Any, saved: list[list[Any]]) -> None:
    for blk, cache in zip(model.aggregator.global_blocks, saved, strict=True):
        blk.kv_cache[:] = cache


def warm_pass(model: Any, x: Any, call: Any = None) -> None:
    """One warm-up forward that leaves the stream as it was (the cache is restored)."""
    saved = snapshot_cache(model)
    (model if call is None else call)(x)
    restore_cache(model, saved)


def hand_recipe(model: Any, *, clone: bool) -> None:
    """LingBot-Map's compile_model, as published: swap blocks, compile methods and attn.proj."""
    import torch

    from surgery.examples.demo import swap_in_compiled_blocks

    swap_in_compiled_blocks(model, mode="reduce-overhead")  # blocks and attn.proj
    for blk in model.aggregator.global_blocks:
        pre = torch.compile(blk.attn_pre, mode="reduce-overhead")
        if clone:
            blk.attn_pre = (lambda f: lambda x: tuple(t.clone() for t in f(x)))(pre)
        else:
            blk.attn_pre = pre
        blk.ffn_residual = torch.compile(blk.ffn_residual, mode="reduce-overhead")


def plan_manifest(arm: str) -> Any:
    from surgery.planning.plan import compile_defaults, plan_model

    include, exclude, backend, fold, _, capture = SURGERY_ARMS[arm]
    comp = compile_defaults(backend=backend, capture=capture)
    return plan_model("gpu_regions:bf16_model", include=include, exclude=exclude,
                      compile=comp, fold=fold).manifest


def run_arm(arm: str, n_frames: int) -> dict[str, Any]:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"arm": arm}
    plan_s = 0.0
    manifest = None
    if arm.startswith("surgery"):
        t = time.perf_counter()
        manifest = plan_manifest(arm)
        plan_s = time.perf_counter() - t
    model = build(dev)
    xs = frames(model, DISTINCT_FRAMES)
    warm_x = model.example_input(seed=7)
    keys_before = set(model.state_dict())
    window = model.config.window
    with torch.no_grad():
        for i in range(window):  # fill the KV cache eagerly: every arm starts warm
            model(xs[i % len(xs)])
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    mark = torch.compiler.cudagraph_mark_step_begin
    call = model
    handle = None
    t0 = time.perf_counter()
    with torch.no_grad():
        if arm == "whole":
            call = torch.compile(model)
            keys_after = set(call.state_dict())
            warm_pass(model, warm_x, call)
        elif arm in ("hand", "hand_clone"):
            warm_pass(model, warm_x)  # 1 eager pass, as the recipe does
            hand_recipe(model, clone=arm == "hand_clone")
            keys_after = set(model.state_dict())
            for _ in range(3):
                mark()
                warm_pass(model, warm_x)
        elif manifest is not None:
            from surgery import apply_manifest

            handle = apply_manifest(model, manifest, warmup=lambda m: warm_pass(m, warm_x),
                                    overrides=SURGERY_ARMS[arm][4] or None)
            keys_after = set(model.state_dict())
            counts = handle.report.counts()
            out["report"] = counts
            out["regions_compiled"] = counts.get("compiled", 0)
            out["regions_total"] = len(handle.report)
        else:
            keys_after = keys_before
            warm_pass(model, warm_x)
        sync()
        cold = time.perf_counter() - t0
        if arm != "eager":
            # Benchmark hygiene: inductor's compile-worker pool has done its work; stop it so
            # no arm is timed beside idle or busy workers (the first arm's ran slow otherwise).
            try:
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
            except ImportError:
                pass
        step = arm not in ("eager", "whole")
        times: list[float] = []
        host: list[float] = []  # host time until the call returns (CUDA: launches, not work)
        outputs: list[Any] = []
        for i in range(n_frames):
            x = xs[(window + i) % len(xs)]
            if step:
                mark()
            y, ms, host_ms = time_call(functools.partial(call, x), cuda=cuda)
            times.append(ms)
            if cuda:
                host.append(host_ms)
            outputs.append(y.float().cpu())
        prof_path = os.environ.get("GPU_REGIONS_PROFILE")
        if prof_path and cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(5):
                    if step:
                        mark()
                    call(xs[i % len(xs)])
                sync()
            with open(f"{prof_path}.{arm}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
                f.write("\n\n")
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    out.update(
        cold_s=round(cold, 3), plan_s=round(plan_s, 3), **latency(times[-TIMED:]),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else 0.0,
        changed_keys=len(keys_before - keys_after),
        gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
    )
    if host:
        out["host_ms"] = round(statistics.median(host[-TIMED:]), 3)
    if handle is not None:
        out["graphs_captured"] = sum(r.graphs_captured for r in handle.report)
        out["graph_replays"] = sum(r.graph_replays for r in handle.report)
        out["capture_s"] = round(sum(r.capture_s for r in handle.report), 3)
        out["output_sets_max"] = max((r.output_sets for r in handle.report), default=0)
    diff = against_reference(outputs, ref_path=os.environ.get("GPU_REGIONS_REF"),
                             is_reference=arm == "eager")
    if diff is not None:
        out["max_rel_diff"] = diff
    if handle is not None:
        handle.restore()
    return out


def run_all(arms: list[str], n_frames: int, timeout: int,
            warm_rerun: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Each arm in a fresh process with a fresh compile cache; then each arm in ``warm_rerun``
    once more in a fresh process that reuses its cache (a restart on the same machine)."""
    ref = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpu_regions_ref_{os.getpid()}.pt")
    results = []
    runs = [(i, arm, "") for i, arm in enumerate(arms)]
    runs += [(arms.index(a), a, " (warm cache)") for a in warm_rerun if a in arms]
    for i, arm, label in runs:
        # A fresh compile cache per arm (a warm rerun reuses its arm's): every cold start is cold.
        env = fresh_cache_env(f"gpu_regions_cache_{i}", GPU_REGIONS_REF=ref)
        res = child_result([__file__, "--arm", arm, "--frames", str(n_frames)], env=env,
                           timeout=timeout, ident={"arm": arm})
        res["arm"] += label
        print(json.dumps(res), file=sys.stderr, flush=True)
        results.append(res)
    return results


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| arm | cold start (s) | median (ms) | p90 (ms) | peak mem (GiB) | changed keys "
            "| max rel diff vs eager | regions compiled |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['arm']} | failed: {r['error'][:160]} | | | | | | |")
            continue
        rc = (f"{r['regions_compiled']}/{r['regions_total']}" if "regions_total" in r else "")
        diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else "(reference)"
        rows.append(f"| {r['arm']} | {r['cold_s']:.2f} | {r['median_ms']:.2f} | {r['p90_ms']:.2f}"
                    f" | {r['peak_gib']:.2f} | {r['changed_keys']} | {diff} | {rc} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--all", action="store_true", help="every arm, each in a fresh process")
    ap.add_argument("--arms", help="comma-separated subset for --all")
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--timeout", type=int, default=300, help="per arm, seconds")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--warm-rerun", default="", metavar="ARMS",
                    help="comma-separated arms to run again after all, reusing their compile "
                         "cache (start-up after a restart on the same machine)")
    args = ap.parse_args()
    if args.arm:
        print_arm_result(lambda: run_arm(args.arm, args.frames), {"arm": args.arm})
        return
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if "eager" in arms:  # the reference runs first
        arms.remove("eager")
        arms.insert(0, "eager")
    rerun = tuple(a for a in args.warm_rerun.split(",") if a)
    results = run_all(arms, args.frames, args.timeout, rerun)
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
