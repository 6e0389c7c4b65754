"""The GPT-2 stack's cold start on the CPU, with and without runtime/compile_start's light pieces.

What it isolates. On CUDA the piecewise stack (``plan --piecewise``: ``transformer`` one region)
compiles each distinct piece with inductor and replays it as a region graph. Without CUDA there
is no capture, so light pieces never apply; here a stand-in capturer (tests/test_graphs.py's
FakeCapturer: captures by running the work, replays by running it again) stands for CUDA's, and
the pieces compile with CPU inductor (C++ builds: slower than Triton's, so read the counts and
the ratio, not the seconds). Each arm is a fresh process with an empty inductor cache.

Arms: ``after`` (main: every piece of this launch-bound decode light, by compile_start's size
rule), ``fused`` (the size rule off: the once-a-step pieces light by their share, the middle piece
inductor), ``before`` (every piece inductor, as before compile_start). ``--as-torch211`` makes
transformers build the causal mask inside the compiled graph, as it does on torch < 2.14
(pytorch#176499: there ``is_torchdynamo_exporting()`` reads True under dynamo), which gives the
stack extra small pieces, as on the H200's torch 2.11.

    python benchmarks/cpu_stack_cold.py [--layers 12] [--width 64] [--as-torch211]

Printed per arm: cold s (apply_manifest with 2 warm-up passes of an 8-token generate(), then one
16-token generate()), dynamo trace s, piece compile s, pieces compiled / light / shared, pieces a
graph, steady ms a token (median of 3), tokens identical to eager's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _arms import (  # noqa: E402
    child_result,
    cold_start_as_before,
    fresh_cache_env,
    pieces_fused,
)

ARMS = ("after", "fused", "before")


def run_arm(arm: str, layers: int, width: int, as211: bool) -> dict[str, Any]:
    import torch
    import transformers
    import transformers.masking_utils as masking

    from surgery import apply_manifest
    from surgery.planning.plan import plan_module
    from surgery.runtime import apply as apply_mod
    from tests.test_graphs import FakeCapturer

    if as211:  # torch < 2.14: the mask is never skipped while compiling
        masking.is_torchdynamo_exporting = lambda: torch.compiler.is_compiling()
    if arm == "before":
        cold_start_as_before()
    if arm == "fused":
        pieces_fused()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=100,
                                  n_positions=256, bos_token_id=None, eos_token_id=None)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    model = copy.deepcopy(base)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))

    def generate(m: Any, n: int = 16) -> Any:
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    want = generate(base)
    manifest = plan_module(model, source="cpu_stack_cold", piecewise=True).manifest
    capturer = FakeCapturer()
    apply_mod._on_cuda = lambda module, model: True  # type: ignore[assignment]
    apply_mod._capturer_for = lambda module: capturer  # type: ignore[assignment]
    from torch._dynamo.utils import compilation_time_metrics as metrics

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest, warmup=lambda m: generate(m, 8), passes=2,
                                overrides={"backend": "inductor"})
        got = generate(model)
    cold = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t = time.perf_counter()
        generate(model)
        times.append((time.perf_counter() - t) * 1e3 / 16)
    (rec,) = [r for r in handle.report if r.path == "transformer"]
    backend = sum(metrics.get("OutputGraph.call_user_compiler", []))
    return {"arm": arm, "as_torch211": as211, "layers": layers, "width": width,
            "cold_s": round(cold, 2),
            "dynamo_trace_s": round(sum(metrics.get("_compile.compile_inner", [])) - backend, 2),
            "piece_compile_s": round(rec.piece_compile_s, 2),
            "pieces_compiled": rec.pieces_compiled, "pieces_light": rec.pieces_light,
            "pieces_shared": rec.pieces_shared, "pieces": rec.pieces,
            "graphs_captured": rec.graphs_captured, "compiles": rec.compiles,
            "ms_per_token": round(statistics.median(times), 3),
            "tokens_identical": bool(torch.equal(got, want)), "status": rec.status,
            "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--as-torch211", action="store_true")
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.layers, args.width, args.as_torch211)),
              flush=True)
        return
    rows = []
    for i, arm in enumerate(args.arms.split(",")):
        argv = [__file__, "--arm", arm, "--layers", str(args.layers), "--width",
                str(args.width), *(["--as-torch211"] if args.as_torch211 else [])]
        rows.append(child_result(argv, env=fresh_cache_env(f"cpu_stack_cold_{i}"),
                                 timeout=args.timeout, ident={"arm": arm}))
    keys = ("cold_s", "dynamo_trace_s", "piece_compile_s", "pieces_compiled", "pieces_light",
            "pieces_shared", "pieces", "ms_per_token", "tokens_identical")
    print("| arm | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        print(f"| {r['arm']} | " + " | ".join(str(r.get(k, r.get("error", ""))) for k in keys)
              + " |")


if __name__ == "__main__":
    main()
