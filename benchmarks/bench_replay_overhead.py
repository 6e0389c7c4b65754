"""Host cost of one region-graph replay, without the GPU: surgery's own checks per call.

A region-capture replay (surgery/runtime/graphs/replay.py) checks the call signature, that the
module's tensors have not moved, that no caller holds the outputs it is about to overwrite, then
copies inputs, launches the graph and hands back output views. This measures everything but the
launch and the copies, on the CPU: the graph is a stand-in whose replay does nothing, and inputs are
passed as the region's own buffers (a replay skips copying those), so only the Python bookkeeping is
timed. It runs through ``apply_manifest``'s installed wrapper, as a model's call does.

    python benchmarks/bench_replay_overhead.py          # prints a table and one JSON line

It also times the stream check of a graph captured on the caller's stream against a plain
replay (``ordered_replay_cost``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import timeit
import weakref
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


class NullGraph:
    def replay(self) -> None:
        pass


class NullCapturer:
    """Runs the capture's work once (so the owned outputs are filled) and replays nothing."""

    device = -1

    def __init__(self) -> None:
        # Held weakly, as CudaCapturer holds them: a dropped model frees its output sets.
        self.owned: Any = weakref.WeakValueDictionary()

    def capture(self, work: Callable[[], None]) -> NullGraph:
        work()
        return NullGraph()


def measure(make: Callable[[], Any], call: str, shape: tuple[int, ...],
            n: int = 20000) -> dict[str, Any]:
    import torch

    from surgery.formats.fingerprint import compute_fingerprint
    from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
    from surgery.runtime import apply as apply_mod
    from surgery.runtime.apply import apply_manifest

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.add_module("m", make().eval())
    callable_ = "forward" if call == "forward" else "method"
    path = "m" if call == "forward" else f"m.{call}"
    manifest = Manifest(compute_fingerprint(holder.state_dict()),
                        [Region("r", [path], callable=callable_)],
                        compile={**DEFAULT_COMPILE, "backend": "eager", "clone_outputs": False})
    apply_mod._on_cuda = lambda module, model: True  # type: ignore[assignment]
    apply_mod._capturer_for = lambda module: NullCapturer()  # type: ignore[assignment]
    x = torch.randn(*shape)
    with torch.no_grad():
        handle = apply_manifest(holder, manifest, warmup=lambda h: getattr(h.m, call)(x),
                                passes=2)
        fn = getattr(holder.m, call)  # the installed wrapper, as the model calls it
        slot = vars(holder.m)[call].__surgery_slot__
        (captured,) = slot.graphs.graphs.values()
        static = captured.inputs[0]  # the region's input buffer: the replay copies nothing

        def one() -> Any:
            return fn(static)

        per_call = [timeit.timeit(one, number=n) / n * 1e6 for _ in range(5)]
        watch = slot.graphs.watch
        assert watch is not None
        watch_us = min(timeit.timeit(watch.unchanged, number=n) / n * 1e6 for _ in range(5))
        eager = [timeit.timeit(lambda: slot.eager(static), number=n // 10) / (n // 10) * 1e6
                 for _ in range(3)]
    rec = handle.report[0]
    assert rec.graph_replays >= 5 * n, rec  # every timed call was a replay
    handle.restore()
    return {"region": f"{type(holder.m).__name__}.{call}", "replay_us": round(min(per_call), 2),
            "replay_us_median": round(statistics.median(per_call), 2),
            "address_check_us": round(watch_us, 2), "eager_cpu_us": round(min(eager), 1)}


def ordered_replay_cost(n: int = 200000) -> dict[str, float]:
    """What a graph captured on the caller's stream adds per replay (surgery.runtime.graphs.
    capture.ordered_replay): the current stream's raw handle, compared with the capture's. The
    handle is read here by a stand-in (no CUDA), so this is the Python part only."""
    from surgery.runtime.graphs.capture import CudaCapturer, PooledGraph

    class Stream:
        cuda_stream = 7

    owner = CudaCapturer(0)
    owner.current_raw = lambda: 7  # type: ignore[method-assign]
    plain = PooledGraph(NullGraph(), owner)  # captured on the side stream: graph.replay itself
    ordered = PooledGraph(NullGraph(), owner, Stream())
    base = min(timeit.timeit(plain.replay, number=n) / n * 1e6 for _ in range(5))
    mine = min(timeit.timeit(ordered.replay, number=n) / n * 1e6 for _ in range(5))
    return {"side_stream_replay_us": round(base, 3), "caller_stream_replay_us": round(mine, 3)}


def main() -> None:
    import torch

    from surgery.examples import Block, GlobalBlock

    torch.set_num_threads(1)
    dim, tokens = 64, 16  # small tensors: the eager column is only for scale
    rows = [
        measure(lambda: Block(dim, 4, 4), "forward", (1, tokens, dim)),
        measure(lambda: GlobalBlock(dim, 4, 4), "attn_pre", (1, tokens, dim)),
    ]
    print("| region | surgery replay bookkeeping, us/call (min of 5) | median | of which the "
          "address check, us | eager on CPU (small tensors), us |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['region']} | {r['replay_us']} | {r['replay_us_median']} | "
              f"{r['address_check_us']} | {r['eager_cpu_us']} |")
    streams = ordered_replay_cost()
    print(f"graph.replay of a null graph: {streams['side_stream_replay_us']} us as captured on "
          f"the side stream, {streams['caller_stream_replay_us']} us as captured on the caller's "
          "stream (the stream check, with a stand-in for the raw-stream read)")
    print(json.dumps({"torch": torch.__version__, "results": rows, "stream_check": streams}))


if __name__ == "__main__":
    main()
