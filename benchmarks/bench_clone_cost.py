"""What cloning CUDA-graph region outputs costs (apply_manifest's clone_outputs).

Arms, in one process so they compare as ratios (eager timings on these machines are CPU-bound
and noisy between runs, DESIGN.md):
- eager: no regions;
- clone_all: every region reduce-overhead, outputs cloned outside the graph (the default);
- clone_needed: only attn_pre clones (its k, v go into the KV cache); the other regions' outputs
  are consumed within the step, so they skip the clone.
Without any clone the streaming model fails (pytorch#152887; tests/test_apply_cuda.py), so there
is no "no clone" arm for the whole model. Each step resets the stream and runs one frame, so every
step does the same work.

    python benchmarks/bench_clone_cost.py [--size lingbot|tiny] [--steps 30] [--dtype bf16]

Needs CUDA. Prints one JSON object per arm and a summary line; record figures in RESULTS.md.

Seen 2026-11-30, one H200, torch 2.11.0+cu130, lingbot size, bf16, 50 steps, arms interleaved
eager, clone_needed, clone_all, clone_needed, clone_all, eager (median / min ms per step):
eager 27.5 / 17.5 and 28.4 / 18.8 (CPU-bound and noisy); clone_needed 17.1 / 16.0 and
16.3 / 15.8; clone_all 25.9 / 22.9 and 37.1 / 24.3. Cloning the outputs of all 120 region paths
costs about 7 ms a step (min against min) over cloning only attn_pre's 24, far more than the
bytes copied (about 0.2 GB at 4 TB/s is 50 us): every cloned output reaches the next graph as a
non-pool input that cudagraph trees copy in, on a launch-bound step. Clone where a region's
outputs outlive the step (attn_pre's k, v in the KV cache), not everywhere. Cold start (apply +
3 warm-up passes) was 1.7-3.6 s with the FX/Triton caches warm, 15.7 s on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from surgery import examples
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest, mark_step


def regions(depth: int, *, clone_all: bool) -> list[Region]:
    """The example model's regions; ``clone_all=False`` clones only attn_pre's outputs."""
    keep = {} if clone_all else {"clone_outputs": False}
    r = range(depth)
    return [
        Region("patch_embed_block", [f"aggregator.patch_embed.blocks.{i}" for i in r],
               compile=dict(keep)),
        Region("frame_block", [f"aggregator.frame_blocks.{i}" for i in r], compile=dict(keep)),
        Region("attn_pre", [f"aggregator.global_blocks.{i}.attn_pre" for i in r],
               callable="method"),
        Region("ffn_residual", [f"aggregator.global_blocks.{i}.ffn_residual" for i in r],
               callable="method", compile=dict(keep)),
        Region("attn_proj", [f"aggregator.global_blocks.{i}.attn.proj" for i in r],
               compile=dict(keep)),
    ]


def step_times(model: examples.ExampleModel, x: torch.Tensor, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.reset_stream()
        mark_step()
        model(x)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def run_arm(name: str, model: examples.ExampleModel, x: torch.Tensor, steps: int,
            clone_all: bool | None) -> dict[str, object]:
    torch._dynamo.reset()
    handle = None
    cold = 0.0
    if clone_all is not None:
        depth = len(model.aggregator.global_blocks)
        manifest = Manifest(compute_fingerprint(model.state_dict()),
                            regions(depth, clone_all=clone_all),
                            compile={**DEFAULT_COMPILE, "mode": "reduce-overhead"})
        t = time.perf_counter()
        handle = apply_manifest(model, manifest,
                                warmup=lambda m: (m.reset_stream(), m(x)))
        torch.cuda.synchronize()
        cold = time.perf_counter() - t
    else:
        for _ in range(3):
            model.reset_stream()
            model(x)
    times = step_times(model, x, steps)
    result: dict[str, object] = {
        "arm": name, "cold_start_s": round(cold, 2),
        "median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
    }
    if handle is not None:
        c = handle.report.counts()
        result["regions"] = {k: c[k] for k in ("compiled", "eager", "pending", "recompiles",
                                               "graphs_compiled")}
        result["cloned_paths"] = sum(r.clone_outputs for r in handle.report)
        handle.restore()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("lingbot", "tiny"), default="lingbot")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--arms", default="eager,clone_all,clone_needed,eager_again",
                    help="comma-separated arms, run in this order")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: clone_outputs only applies to CUDA-graph regions", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = getattr(examples, args.size)().to("cuda", dtype).eval()
    x = model.example_input()
    results = []
    with torch.no_grad():
        arms = {"eager": None, "clone_all": True, "clone_needed": False, "eager_again": None}
        for name in args.arms.split(","):
            results.append(run_arm(name, model, x, args.steps, arms[name]))
            print(json.dumps(results[-1]), flush=True)
    by = {r["arm"]: r["median_ms"] for r in results}
    if not {"eager", "clone_all", "clone_needed"} <= set(by):
        return 0
    print(json.dumps({
        "torch": torch.__version__, "device": torch.cuda.get_device_name(), "size": args.size,
        "dtype": args.dtype, "clone_all_over_clone_needed":
            round(float(by["clone_all"]) / float(by["clone_needed"]), 3),
        "clone_all_over_eager": round(float(by["clone_all"]) / float(by["eager"]), 3),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
