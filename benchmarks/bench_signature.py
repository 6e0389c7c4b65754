"""Host cost of the signature budget check, per call of a compiled region (not a replay).

Before a path calls its compiled callable, surgery.runtime.slots computes the call's signature
(surgery.runtime.budget.call_signature) and looks it up in the path's set. A region-graph replay
skips this (graphs.py has its own check); the calls that pay it are the ones that run the compiled
code: capture = "compiler", CPU regions, and signatures past the captured ones. This times the
signature alone for three call shapes a block sees, on whatever machine runs it.

    python benchmarks/bench_signature.py          # prints a table and one JSON line
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    import torch
    from torch import nn

    from surgery.runtime.budget import call_signature

    m = nn.Linear(8, 8)
    x = torch.randn(4, 16, 64)
    cache = [[torch.randn(2, 1, 4, 16, 16) for _ in range(4)] for _ in range(4)]
    cases = {
        "one tensor": (["x"], (x,), {}),
        "tensor + int + kwarg": (["x", "layer_idx"], (x, 3), {"window": 16}),
        "tensor + KV-cache list (4x4 tensors) + int": (["x", "cache", "global_idx"],
                                                       (x, cache, 2), {}),
    }
    rows = {}
    for name, (names, args, kwargs) in cases.items():
        seen = {call_signature(names, m, args, kwargs)}

        def one(names=names, args=args, kwargs=kwargs, seen=seen) -> bool:
            return call_signature(names, m, args, kwargs) in seen

        n = 20000
        runs = [timeit.timeit(one, number=n) / n * 1e6 for _ in range(5)]
        rows[name] = round(statistics.median(runs), 2)
    width = max(map(len, rows))
    print(f"{'call':{width}}  us per call (median of 5 x 20000)")
    for name, us in rows.items():
        print(f"{name:{width}}  {us:.2f}")
    print(json.dumps({"bench": "signature", "torch": torch.__version__,
                      "machine": platform.processor() or platform.machine(),
                      "us_per_call": rows}))


if __name__ == "__main__":
    main()
