"""What the benchmarks' whole-model arms share: a compile that says how far it got, and a timed
arm that no compile worker runs beside.

``WatchedBackend`` wraps the backend a whole-model ``torch.compile`` hands each graph to
(``torch._dynamo.lookup_backend(name)``, which is what ``backend="inductor"`` resolves to in
default mode; surgery's own groups call it the same way). For every graph dynamo produces it
counts the graph's operator nodes and inputs, times the backend, and prints one progress line
as the graph is done. So a whole arm cut short by its timeout still says how many graphs it
compiled and how large they were, and a run that recompiles shows it line by line.

The counts are machine-independent: they depend on the model's depth and code and on how
dynamo traces it, not on its width or on the GPU. That is what lets a CPU run at LingBot depth
(tiny width) estimate the compile time on the H200 (benchmarks/RESULTS.md, issue 20's fifth
pass).

``stop_compile_workers()``: inductor keeps a pool of compile worker processes after compiling
(and surgery starts one early at ``apply_manifest``). Timing an arm beside them made the first
timed arm slow in gpu_regions.py; every timed arm here is measured with them stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

# FX node kinds that are operators (placeholders, get_attr and output are not).
OP_NODES: tuple[str, ...] = ("call_function", "call_method", "call_module")


def progress(what: str, t0: float) -> None:
    """One JSON line on stdout: how far the arm got (child_result keeps it on a timeout)."""
    print(json.dumps({"progress": f"{what} at {time.perf_counter() - t0:.1f} s"}), flush=True)


class WatchedBackend:
    """A dynamo backend that compiles with ``name``'s and records each graph it is given."""

    def __init__(self, name: str, *, t0: float) -> None:
        import torch

        self.name, self.t0 = name, t0
        self.inner: Callable[..., Any] = torch._dynamo.lookup_backend(name)
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Any:
        ops = sum(1 for n in gm.graph.nodes if n.op in OP_NODES)
        t = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        spent = time.perf_counter() - t
        self.graphs.append({"ops": ops, "inputs": len(example_inputs),
                            "backend_s": round(spent, 2)})
        progress(f"graph {len(self.graphs)} compiled by {self.name}: {ops} ops, "
                 f"{len(example_inputs)} inputs, {spent:.1f} s in the backend", self.t0)
        return compiled

    def summary(self) -> dict[str, Any]:
        """Graphs, their operator nodes (each and in all) and the backend's seconds."""
        return {"graphs": len(self.graphs), "ops": sum(g["ops"] for g in self.graphs),
                "graph_ops": [g["ops"] for g in self.graphs],
                "backend_s": round(sum(g["backend_s"] for g in self.graphs), 1)}


def graph_breaks() -> int:
    """Graph breaks dynamo counted in this process so far."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def stop_compile_workers() -> bool:
    """Stop inductor's compile worker pool, if this torch has the call (True when it did)."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:
        return False
    shutdown_compile_workers()
    return True
