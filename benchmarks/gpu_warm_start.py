"""Warm starts: cold start of the example model in a fresh process without, then with, the bundle.

Model: `surgery.examples.lingbot()` (dim 1024; 24 patch-embed, 24 frame and 24 global blocks),
bf16 on CUDA, the default manifest of `surgery plan` for the live bf16 model
(`plan_model("gpu_warm_start:bench_model")`), the KV cache filled eagerly before anything
compiles, and warm-up passes that leave the stream as it was (as benchmarks/gpu_regions.py does).

Three steps, each process fresh and each with its own new, empty TORCHINDUCTOR_CACHE_DIR, so
the local inductor cache cannot hide the difference:
  cold   apply_manifest without a bundle (every compile misses), then handle.save_cache()
  warm   apply_manifest(cache=BUNDLE): compiles hit the caches the bundle filled
For each: cold start (apply + warm-up, s), time in dynamo (bytecode tracing, and the backend:
AOTAutograd + inductor, hits included), time loading the bundle, and the rest (running the
warm-up passes: eager code, first kernel launches, CUDA graph capture), plus the cache
hit/miss counts and the whole process's wall time (import torch and building the model too).

    python benchmarks/gpu_warm_start.py                        # LingBot size, bf16, CUDA
    python benchmarks/gpu_warm_start.py --size tiny --device cpu --dtype fp32  # CPU check

On the CPU the regions are CUDA-graph regions, so they are compiled with inductor's C++
backend (override on_cpu=compile). Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
STARTED = time.perf_counter()
from _arms import child_result  # noqa: E402


def bench_model() -> Any:
    """The planned and deployed model: the example at WARM_START_SIZE, in WARM_START_DTYPE
    (the dtype is part of the fingerprint, so the plan is of the model that is deployed)."""
    import torch

    from surgery.examples import lingbot, tiny

    size = os.environ.get("WARM_START_SIZE", "lingbot")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        os.environ.get("WARM_START_DTYPE", "bf16")]
    return (tiny() if size == "tiny" else lingbot()).to(dtype)


def _overrides(device: str) -> dict[str, Any]:
    return {"on_cpu": "compile"} if device == "cpu" else {}


def _dynamo_times() -> dict[str, float]:
    """Seconds torch spent per phase (torch._dynamo.utils.compilation_time_metrics)."""
    from torch._dynamo.utils import compilation_time_metrics as m

    def total(*keys: str) -> float:
        return round(sum(sum(m.get(k, [])) for k in keys), 3)

    return {"dynamo_s": total("_compile.compile_inner"),
            "tracing_s": total("bytecode_tracing"),
            "backend_s": total("OutputGraph.call_user_compiler"),
            # C++ builds (inductor's CPU kernels, and its start-up probes): a CPU bundle holds
            # the generated code but not the built libraries, so a hit still builds them.
            "cpp_build_s": total("compile_file")}


def run_phase(phase: str, manifest: str, bundle: str, device: str) -> dict[str, Any]:
    """One fresh process: build, fill the KV cache, apply (+ warm-up), time it; save or load."""
    import torch

    import surgery.runtime.apply as sa
    from surgery.runtime.apply import apply_manifest

    import_s = time.perf_counter() - STARTED
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    with torch.device(device):
        model = bench_model().eval()
    x = model.example_input(seed=7)
    with torch.no_grad():
        for i in range(model.config.window):  # the stream is warm before anything compiles
            model(model.example_input(seed=1000 + i))
    sync()

    def warm_pass(m: Any) -> None:  # a warm-up step that leaves the stream as it was
        saved = [list(b.kv_cache) for b in m.aggregator.global_blocks]
        m(x)
        for blk, kv in zip(m.aggregator.global_blocks, saved, strict=True):
            blk.kv_cache[:] = kv

    load_s = [0.0]
    real_load = sa.load_bundle

    def timed_load(*args: Any, **kwargs: Any) -> tuple[bool, str]:
        t = time.perf_counter()
        try:
            return real_load(*args, **kwargs)
        finally:
            load_s[0] += time.perf_counter() - t

    sa.load_bundle = timed_load  # instrumentation only: the time spent loading the bundle
    t0 = time.perf_counter()
    with torch.no_grad():
        handle = apply_manifest(model, manifest, warmup=warm_pass, overrides=_overrides(device),
                                cache=bundle if phase == "warm" else None)
        sync()
    cold = time.perf_counter() - t0
    times = _dynamo_times()
    rec = handle.report.cache
    out: dict[str, Any] = {
        "phase": phase, "cold_s": round(cold, 3), **times, "load_s": round(load_s[0], 3),
        "rest_s": round(cold - times["dynamo_s"] - load_s[0], 3),
        "loaded": bool(rec and rec.loaded), "cache": rec.counts if rec else {},
        "regions": handle.report.counts(), "import_s": round(import_s, 3),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    if phase == "warm" and rec is not None and not rec.loaded:
        out["ignored"] = rec.reason
    if phase == "cold":
        t = time.perf_counter()
        saved = handle.save_cache(bundle)
        out["save_s"] = round(time.perf_counter() - t, 3)
        out["bundle_mb"] = round(saved.bytes / 1e6, 2)
        out["artifacts"] = saved.metadata["artifacts"]
    handle.restore()
    return out


def run_all(*, size: str, device: str, dtype: str, timeout: int,
            keep: bool = False) -> list[dict[str, Any]]:
    from surgery.formats.manifest import save_manifest
    from surgery.planning.plan import plan_model

    work = tempfile.mkdtemp(prefix="warm_start_")
    env = {**os.environ, "WARM_START_SIZE": size, "WARM_START_DTYPE": dtype,
           "PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")])}
    # Bundles are signed (surgery.runtime.signing): one throw-away key for this run's processes.
    if not (env.get("SURGERY_CACHE_KEY") or env.get("SURGERY_CACHE_KEY_FILE")):
        env["SURGERY_CACHE_KEY"] = secrets.token_hex(32)
    os.environ.update(WARM_START_SIZE=size, WARM_START_DTYPE=dtype)
    manifest = os.path.join(work, "model.surgery.toml")
    save_manifest(plan_model("gpu_warm_start:bench_model").manifest, manifest)
    bundle = os.path.join(work, "model.surgery.cache")
    results: list[dict[str, Any]] = []
    for phase in ("cold", "warm"):
        penv = {**env, "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, f"inductor-{phase}")}
        res = child_result([__file__, "--phase", phase, "--manifest", manifest, "--bundle",
                            bundle, "--device", device], env=penv, timeout=timeout,
                           ident={"phase": phase})
        results.append(res)
        if "error" in res:
            break
    if keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return results


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| process | bundle | cold start (s) | dynamo (s) | of which tracing (s) "
            "| backend (s) | bundle load (s) | rest: warm-up runs (s) | FX graph hit/miss "
            "| AOTAutograd hit/miss | regions compiled | process (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['phase']} | failed: {r['error'][:160]} |" + " |" * 10)
            continue
        c = r["cache"]
        bundle = ("loaded" if r["loaded"] else f"ignored: {r.get('ignored', '')[:80]}") \
            if r["phase"] == "warm" else f"written ({r['bundle_mb']} MB, {r['save_s']} s)"
        rows.append(
            f"| {r['phase']} | {bundle} | {r['cold_s']:.2f} | {r['dynamo_s']:.2f} "
            f"| {r['tracing_s']:.2f} | {r['backend_s']:.2f} | {r['load_s']:.2f} "
            f"| {r['rest_s']:.2f} | {c.get('fx_graph_hits', 0)}/{c.get('fx_graph_misses', 0)} "
            f"| {c.get('aot_autograd_hits', 0)}/{c.get('aot_autograd_misses', 0)} "
            f"| {r['regions']['compiled']}/{sum(r['regions'][k] for k in ('compiled', 'pending', 'eager', 'skipped'))} "  # noqa: E501
            f"| {r['process_s']:.1f} |")
    ok = [r for r in results if "error" not in r]
    if len(ok) == 2:
        cold, warm = ok
        rows.append("")
        rows.append(f"warm / cold start: {warm['cold_s'] / cold['cold_s']:.2f} "
                    f"({warm['cold_s']:.2f} s / {cold['cold_s']:.2f} s); whole process "
                    f"{warm['process_s'] / cold['process_s']:.2f}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["lingbot", "tiny"],
                    default=os.environ.get("WARM_START_SIZE", "lingbot"))
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default=os.environ.get("WARM_START_DEVICE", "cuda"))
    ap.add_argument("--dtype", choices=["bf16", "fp32"],
                    default=os.environ.get("WARM_START_DTYPE", "bf16"))
    ap.add_argument("--timeout", type=int, default=240, help="per process, seconds")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work folder (manifest, bundle, inductor cache dirs)")
    ap.add_argument("--phase", choices=["cold", "warm"], help=argparse.SUPPRESS)
    ap.add_argument("--manifest", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.manifest, args.bundle, args.device)))
        return
    results = run_all(size=args.size, device=args.device, dtype=args.dtype,
                      timeout=args.timeout, keep=args.keep)
    print(f"## warm start: example model ({args.size}, {args.dtype}, {args.device})\n")
    print(table(results))
    print()
    print(json.dumps({"size": args.size, "device": args.device, "dtype": args.dtype,
                      "results": results}))


if __name__ == "__main__":
    main()
