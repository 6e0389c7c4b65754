"""Count what a whole-model compile of the gpu_regions.py example hands its backend, on the CPU.

gpu_regions.py's ``whole`` arm (``torch.compile(model)`` of the LingBot-size example, bf16, its
KV cache filled by eager frames first, one warm-up frame) compiled in 52-60 s on the H200 from
empty caches (benchmarks/RESULTS.md, issue 5). Its graphs' operator count is a property of the
model's depth and code, not of its width or the machine, so this script builds the example at
LingBot depth (24 blocks of each kind) and test width, compiles it the same way with the
watched ``aot_eager`` backend (benchmarks/_whole.py), and prints the graphs and operators.
Divided into the H200's seconds, that gives a seconds-per-operator figure for a whole-model
inductor compile of this family of models, from which gpu_memory.py's whole arms are
estimated (issue 20, fifth pass). About 2-4 minutes on this 2-core CPU.

    python benchmarks/cpu_whole_graphs.py
    WHOLE_GRAPHS_BACKEND=inductor python benchmarks/cpu_whole_graphs.py   # CPU inductor's time
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _whole import WatchedBackend, graph_breaks, progress  # noqa: E402


def main() -> None:
    import torch

    from surgery.examples import LINGBOT, ExampleConfig, ExampleModel

    t0 = time.perf_counter()
    torch.set_num_threads(1)  # the shared 2-core host: two spinning threads slow it 5-10x
    torch.manual_seed(0)
    model = ExampleModel(ExampleConfig(depth=LINGBOT.depth)).to(torch.bfloat16).eval()
    xs = [model.example_input(seed=1000 + i) for i in range(model.config.window + 1)]
    backend = WatchedBackend(os.environ.get("WHOLE_GRAPHS_BACKEND", "aot_eager"), t0=t0)
    with torch.no_grad():
        for x in xs[:-1]:  # fill the KV cache eagerly, as gpu_regions.py's arms do
            model(x)
        progress("model built, cache filled", t0)
        compiled = torch.compile(model, backend=backend)
        t = time.perf_counter()
        saved = [list(b.kv_cache) for b in model.aggregator.global_blocks]
        compiled(xs[-1])  # gpu_regions.py's warm pass: one frame, the cache put back
        for blk, cache in zip(model.aggregator.global_blocks, saved, strict=True):
            blk.kv_cache[:] = cache
        cold = time.perf_counter() - t
        compiled(xs[0])  # a steady frame: a recompile here would show as a second graph
    print(json.dumps({"model": "surgery.examples ExampleModel, depth 24, dim 32",
                      **backend.summary(), "graph_breaks": graph_breaks(),
                      "cold_s": round(cold, 1), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
