"""Host cost of the stream route (surgery.runtime.stream_route): what a call of a model pays for
being run on surgery's side stream (two event records, two waits, two stream switches, one
raw-stream read), and what an unrouted call pays (the read and a compare).

On CUDA: ``nn.Linear(8, 8)`` at batch 1, timed per call over many calls (the GPU work is a few
microseconds, so the host's share shows), in four ways: the plain module, the module with the
route on the default stream (routed), with the route on a user stream (not routed), and the
plain module on the user stream. Peak memory beside each. No region graph is involved.

With ``--cpu`` (no CUDA): the same route code driven by stand-ins whose stream, event and
``set_stream`` calls do nothing, so the figure is the route's Python alone; the CUDA driver calls
(``cudaEventRecord``, ``cudaStreamWaitEvent``, about 1-2 us each) come on top on a GPU.

    python benchmarks/bench_stream_route.py            # H200: about 20 s
    python benchmarks/bench_stream_route.py --cpu      # this project's CPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

from surgery.runtime.graphs.capture import CudaCapturer
from surgery.runtime.stream_route import install_route


def per_call_us(calls: dict[str, Callable[[], Any]], n: int, sync: Callable[[], None],
                rounds: int = 7) -> dict[str, float]:
    """Microseconds a call for each of ``calls``: the fastest of ``rounds`` rounds of n calls,
    the arms taking turns within each round, so a loaded host slows them alike."""
    best = {k: float("inf") for k in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            sync()
            t = time.perf_counter()
            for _ in range(n):
                call()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t) / n * 1e6)
    return best


class _Null:
    """A stand-in stream or event: every call does nothing."""

    cuda_stream = 0

    def __init__(self, raw: int = 0) -> None:
        self.cuda_stream = raw

    def record(self, stream: Any = None) -> None: ...

    def wait_event(self, event: Any) -> None: ...


@contextlib.contextmanager
def stand_ins() -> Iterator[dict[str, Any]]:
    """torch.cuda as the route uses it, with calls that do nothing (the --cpu run)."""
    state = {"current": _Null(0)}
    fakes = {"Stream": lambda device=0: _Null(101), "default_stream": lambda device=0: _Null(0),
             "Event": _Null, "set_stream": lambda s: state.__setitem__("current", s),
             "current_device": lambda: 0, "set_device": lambda i: None}
    saved = {k: getattr(torch.cuda, k) for k in fakes}
    for k, v in fakes.items():
        setattr(torch.cuda, k, v)
    try:
        yield state
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)


def run_cpu(n: int) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(1, 8)
    plain = nn.Linear(8, 8).eval()
    routed = nn.Linear(8, 8).eval()
    out: dict[str, float] = {}
    with stand_ins() as state, torch.no_grad():
        cap = CudaCapturer(0)
        cap.current_raw = lambda: state["current"].cuda_stream  # type: ignore[method-assign]
        install_route(routed, [types.SimpleNamespace(capturer=cap)], enabled=True, notes=[])
        times = per_call_us({"plain": lambda: plain(x), "routed": lambda: routed(x)}, n,
                            lambda: None)
        out["plain_us"], out["routed_us"] = times["plain"], times["routed"]
        state["current"] = _Null(7)  # a user stream: not routed
        times = per_call_us({"plain": lambda: plain(x), "unrouted": lambda: routed(x)}, n,
                            lambda: None)
        out["plain_user_us"], out["unrouted_us"] = times["plain"], times["unrouted"]
    out["route_cost_us"] = out["routed_us"] - out["plain_us"]
    out["check_cost_us"] = out["unrouted_us"] - out["plain_user_us"]
    return {k: round(v, 2) for k, v in out.items()}


def run_cuda(n: int) -> dict[str, float]:
    torch.manual_seed(0)
    dev = torch.cuda.current_device()
    x = torch.randn(1, 8, device="cuda")
    plain = nn.Linear(8, 8).cuda().eval()
    routed = nn.Linear(8, 8).cuda().eval()
    cap = CudaCapturer(dev)
    install_route(routed, [types.SimpleNamespace(capturer=cap)], enabled=True, notes=[])
    user = torch.cuda.Stream()
    out: dict[str, float] = {}
    with torch.no_grad():
        for model in (plain, routed):  # workspaces, lazy inits, on both streams
            model(x)
            with torch.cuda.stream(user):
                model(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = per_call_us({"plain": lambda: plain(x), "routed": lambda: routed(x)}, n,
                            torch.cuda.synchronize)
        out["plain_us"], out["routed_us"] = times["plain"], times["routed"]
        out["default_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        with torch.cuda.stream(user):
            times = per_call_us({"plain": lambda: plain(x), "routed": lambda: routed(x)}, n,
                                torch.cuda.synchronize)
        out["plain_user_us"], out["unrouted_user_us"] = times["plain"], times["routed"]
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    out["route_cost_us"] = out["routed_us"] - out["plain_us"]
    out["check_cost_us"] = out["unrouted_user_us"] - out["plain_user_us"]
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="stand-in streams (no CUDA needed)")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA here: pass --cpu for the route's Python alone")
    res = run_cpu(args.calls) if args.cpu else run_cuda(args.calls)
    res["torch"] = torch.__version__  # type: ignore[assignment]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
