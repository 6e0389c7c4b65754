"""What region graphs' buffers hold, counted on the CPU: the SDPA example at LingBot depth (24
blocks of each kind; 378x518 frames, 999 tokens, by default) but a narrow width, through
apply_manifest with tests/test_graphs.py's faithful fake graph (a replay reruns the captured
work against the same buffers), under each of issue 20's sharing policies.

Why on the CPU: output sets and static input buffers are plain allocations whose count and
layout do not depend on the device, so their bytes are exact here; only the capture pool (CUDA
temporaries) needs the GPU (benchmarks/gpu_memory.py). Their size is linear in the width: at
dim 1024 each buffer is 1024/dim times larger (the depth head's float32 maps excepted).

    python benchmarks/bench_graph_buffers.py [--dim 64] [--frames 4] [--size 378x518]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

POLICIES = {"before": (False, False), "outputs": (True, False), "all": (True, True)}


def count(dim: int, frames: int, policy: str, hw: tuple[int, int]) -> dict[str, Any]:
    import torch

    from surgery.examples.sdpa import SdpaConfig, SdpaExampleModel
    from surgery.planning.plan import compile_defaults, plan_module
    from surgery.runtime import apply as apply_mod
    from surgery.runtime.graphs import arena
    from tests.test_graphs import FakeCapturer

    cfg = SdpaConfig(dim=dim, depth=24, heads=4, height=hw[0], width=hw[1], head_features=16,
                     camera_depth=4)
    torch.manual_seed(0)
    model = SdpaExampleModel(cfg).eval()
    manifest = plan_module(model, source="bench_graph_buffers",
                           compile=compile_defaults(capture="region")).manifest
    cap = FakeCapturer()
    apply_mod._on_cuda = lambda module, mdl: True  # type: ignore[assignment]
    apply_mod._capturer_for = lambda module: cap  # type: ignore[assignment]
    arena.POLICY.share_outputs, arena.POLICY.share_inputs = POLICIES[policy]
    xs = [model.example_input(seed=i) for i in range(frames)]
    with torch.no_grad():
        handle = apply_manifest_quiet(apply_mod, model, manifest, xs[0])
        for x in xs:
            model(x)
    mem = handle.report.memory
    out = {"policy": policy, "dim": dim, "paths": len(mem.paths),
           "outputs_mib": round(mem.outputs / 2**20, 2),
           "static_inputs_mib": round(mem.static_inputs / 2**20, 2),
           "output_sets": sum(p.output_sets for p in mem.paths),
           "shared_uses": sum(p.shared for p in mem.paths),
           "captured": sum(r.graphs_captured for r in handle.report),
           "replays": sum(r.cuda_graph_replays for r in handle.report),
           "line": mem.line()}
    handle.restore()
    return out


def apply_manifest_quiet(apply_mod: Any, model: Any, manifest: Any, x: Any) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return apply_mod.apply_manifest(model, manifest, warmup=lambda m: m(x), passes=2,
                                        overrides={"backend": "aot_eager"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--size", default="378x518", help="frame height x width (378x518: 999 "
                    "tokens, as LingBot; smaller is quicker on a busy CPU)")
    args = ap.parse_args()
    h, w = (int(v) for v in args.size.split("x"))
    rows = [count(args.dim, args.frames, p, (h, w)) for p in POLICIES]
    print("| policy | paths | output sets | outputs MiB | static inputs MiB | shared uses | "
          "graphs captured | replays |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['paths']} | {r['output_sets']} | {r['outputs_mib']} | "
              f"{r['static_inputs_mib']} | {r['shared_uses']} | {r['captured']} | "
              f"{r['replays']} |")
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
