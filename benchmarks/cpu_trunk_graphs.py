"""The SDPA example's camera trunk planned piecewise: dynamo graphs and cold start with its
``global_idx`` passed to dynamo, and with the slot passed instead (surgery.runtime.index_select).

Why. The trunk's blocks are called as ``blk(x, cache, global_idx=i)`` and read
``cache[global_idx]``; dynamo specializes the index and guards on every slot, so each instance
traced graphs of its own (8 for the 4 blocks at LingBot size on the H200, where 2 hold the same
code). The counts here are machine-independent; the seconds are this machine's.

Arms (each a fresh process, aot_eager on the CPU, inductor with --backend inductor):
  index  runtime/index_select off: each instance its own graphs
  slot   as shipped: the compiled calls get the slot, the instances share their graphs

    python benchmarks/cpu_trunk_graphs.py --depth 4 --frames 20     # LingBot's 4 trunk blocks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._arms import child_result, fresh_cache_env

ARMS = ("index", "slot")


def run_arm(arm: str, depth: int, frames: int, backend: str) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    import surgery.runtime.index_select as index_select
    from surgery import apply_manifest
    from surgery.examples.sdpa import SdpaConfig, SdpaExampleModel
    from surgery.planning.plan import plan_model

    index_select.SELECT_SLOTS = arm == "slot"
    m = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    trunk = [r for r in m.regions if r.paths[0].startswith("camera_head.trunk.")]
    (region,) = trunk
    region.paths = [f"camera_head.trunk.{i}" for i in range(depth)]
    m.regions = trunk
    torch.manual_seed(0)
    model = SdpaExampleModel(SdpaConfig(camera_depth=depth)).eval()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # strict=False: a trunk of another depth than the planned model's (a fingerprint warning)
        handle = apply_manifest(model, m, strict=False,
                                overrides={"backend": backend, "on_cpu": "compile"})
    with torch.no_grad():
        for s in range(frames):
            model(model.example_input(seed=s))
    recs = [handle.report.by_path(p) for p in region.paths]
    return {"arm": arm, "depth": depth, "frames": frames, "backend": backend,
            "cold_s": round(time.perf_counter() - t0, 2),
            "dynamo_graphs": counters["stats"]["unique_graphs"],
            "compiles_per_path": [r.compiles for r in recs],
            "compiled_calls": sum(r.compiled_calls for r in recs),
            "eager_calls": sum(r.eager_calls for r in recs),
            "pieces_compiled": sum(r.pieces_compiled for r in recs),
            "status": sorted({r.status for r in recs}), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--depth", type=int, default=4, help="camera trunk blocks (LingBot: 4)")
    ap.add_argument("--frames", type=int, default=20)
    ap.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager")
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(run_arm(a.arm, a.depth, a.frames, a.backend)))
        return
    res = [child_result([__file__, "--arm", arm, "--depth", str(a.depth), "--frames",
                         str(a.frames), "--backend", a.backend],
                        env=fresh_cache_env(f"trunk_graphs_{arm}"), timeout=a.timeout,
                        ident={"arm": arm}) for arm in ARMS]
    print("| arm | dynamo graphs | compiles per path | compiled / eager calls | "
          "pieces compiled | cold s |")
    print("|---|---|---|---|---|---|")
    for r in res:
        if "error" in r:
            print(f"| {r['arm']} | failed: {r['error'][:120]} | | | | |")
            continue
        print(f"| {r['arm']} | {r['dynamo_graphs']} | {r['compiles_per_path']} | "
              f"{r['compiled_calls']} / {r['eager_calls']} | {r['pieces_compiled']} | "
              f"{r['cold_s']} |")


if __name__ == "__main__":
    main()
