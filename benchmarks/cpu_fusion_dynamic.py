"""The SDPA example's depth-head fusion blocks: one static inductor compile per resolution, or
one compile with the spatial dims dynamic? (issue 19, the cold start against names-only's).

Why. ``depth_head.fusion.N`` are four paths of one code object (``FusionBlock.forward``) at four
fixed resolutions. Compiled static, as both plans do today (``dynamic = false``), dynamo traces
and inductor compiles each resolution: 4 graphs, about 11 s of the H200's 32-39 s cold start.
A compile with the spatial dims of ``x`` and ``skip`` marked dynamic would serve the three paths
that take a skip (the fourth has ``skip=None``, a different graph either way): 2 graphs. This
measures what that costs at run time, per block and resolution, relative to static.

Arms (each a fresh process with its own inductor cache):
  static   torch.compile(dynamic=False), every block static: 4 graphs.
  marked   the same, with ``maybe_mark_dynamic`` on dims 2 and 3 of ``x`` and ``skip`` of the
           blocks that take a skip: 2 graphs.

    python benchmarks/cpu_fusion_dynamic.py                   # both arms, mid size (CPU)
    python benchmarks/cpu_fusion_dynamic.py --channels 128    # LingBot's width (the H200)

Prints one JSON line per arm and a table; the figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._arms import child_result, fresh_cache_env

ARMS = ("static", "marked")


def run_arm(arm: str, channels: int, calls: int) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    from surgery.examples.sdpa import DptHead, SdpaConfig

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    cfg = SdpaConfig(dim=64, height=378, width=518, head_features=channels)  # LingBot's frame
    head = DptHead(cfg).to(dev).eval()
    feats = [torch.randn(1, cfg.tokens, cfg.dim, device=dev) for _ in range(4)]
    compiled = torch.compile(type(head.fusion[0]).forward, backend="inductor", dynamic=False,
                             fullgraph=True)

    def fused(block: Any) -> Any:
        def call(x: Any, skip: Any = None) -> Any:
            if arm == "marked" and skip is not None:
                torch._dynamo.maybe_mark_dynamic(x, [2, 3])
                torch._dynamo.maybe_mark_dynamic(skip, [2, 3])
            return compiled(block, x, skip)
        return call

    for block in head.fusion:
        block.forward = fused(block)  # type: ignore[method-assign]
    per_block: dict[int, list[float]] = {i: [] for i in range(4)}
    for i, block in enumerate(head.fusion):  # time each block's calls
        inner = block.forward

        def timed(x: Any, skip: Any = None, inner: Any = inner, i: int = i) -> Any:
            sync()
            t = time.perf_counter()
            y = inner(x, skip)
            sync()
            per_block[i].append((time.perf_counter() - t) * 1e3)
            return y
        block.forward = timed  # type: ignore[method-assign]
    with torch.no_grad():
        t0 = time.perf_counter()
        ref = head(feats)
        sync()
        cold = time.perf_counter() - t0
        for v in per_block.values():
            v.clear()
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            head(feats)
            sync()
            times.append((time.perf_counter() - t) * 1e3)
    return {"arm": arm, "channels": channels, "cold_s": round(cold, 2),
            "graphs": counters["stats"]["unique_graphs"],
            "head_ms": round(statistics.median(times), 2),
            "block_ms": {f"fusion.{i}": round(statistics.median(v), 3)
                         for i, v in per_block.items()},
            "out_sum": float(ref.double().sum()), "device": dev, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS, help="run one arm in this process")
    ap.add_argument("--channels", type=int, default=32, help="the head's width (LingBot: 128)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(run_arm(a.arm, a.channels, a.calls)))
        return
    res = [child_result([__file__, "--arm", arm, "--channels", str(a.channels),
                         "--calls", str(a.calls)],
                        env=fresh_cache_env(f"fusion_dynamic_{arm}"), timeout=a.timeout,
                        ident={"arm": arm}) for arm in ARMS]
    print("| arm | graphs | cold s | head ms | fusion.3 / .2 / .1 / .0 ms |")
    print("|---|---|---|---|---|")
    for r in res:
        if "error" in r:
            print(f"| {r['arm']} | failed: {r['error'][:120]} | | | |")
            continue
        b = r["block_ms"]
        print(f"| {r['arm']} | {r['graphs']} | {r['cold_s']} | {r['head_ms']} | "
              f"{b['fusion.3']} / {b['fusion.2']} / {b['fusion.1']} / {b['fusion.0']} |")
    same = len({round(r.get("out_sum", 0), 2) for r in res}) == 1
    print(f"outputs agree (sum to 2 places): {same}")


if __name__ == "__main__":
    main()
