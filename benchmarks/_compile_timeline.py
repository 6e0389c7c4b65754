"""A cold start's compiles in order, each with where its Triton kernels were built.

Why. On the H200 the SDPA example's piecewise arm spent about 4 s more than the names-only arm
in ``async_compile.precompile`` (1.7-1.8 s against 5.8-5.9 s in two calls): inductor's timer of
kernels built *in the calling process*, one after another, which it does while its worker pool
is not ready (``AsyncCompile.use_process_pool()`` False). The same calls showed the graphs both
plans compile (the patch embed, the four fusion-block sizes) 3-5 s slower in the piecewise arm,
and its pieces 5.5 s for 3 compiles against about 2.4 s for the names plan's whole frame block.
The phase totals cannot say which compile built its kernels where, so this records, per compile
(each dynamo frame compile, and each piece the piecewise backend compiles after the trace):
when it started (seconds from ``start``), how long it took, and how many kernels it asked the
pool for and how many it built in-process.

It only observes: it wraps ``AsyncCompile.use_process_pool`` (one call per Triton kernel, plus
inductor's own probes) and the piece compile of surgery's piecewise groups, and registers
dynamo's compile callbacks. Where a torch version lacks one of them, that part records nothing
(``missing`` says which). Benchmark code: the library never imports it.
"""

from __future__ import annotations

import time
from typing import Any


class CompileTimeline:
    """The compiles of one process, from ``start()``; ``events()`` is the JSON-ready list."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.open: list[dict[str, Any]] = []  # the compiles running now, innermost last
        self.missing: list[str] = []
        self.pool_calls = [0, 0]  # use_process_pool() False / True outside any compile

    def _begin(self, what: str) -> dict[str, Any]:
        row = {"what": what, "at_s": round(time.perf_counter() - self.t0, 2),
               "in_process": 0, "pooled": 0}
        self.open.append(row)
        return row

    def _end(self, row: dict[str, Any]) -> None:
        row["s"] = round(time.perf_counter() - self.t0 - row["at_s"], 2)
        if row in self.open:
            self.open.remove(row)
        self.rows.append(row)

    def _pool(self, used: bool) -> None:
        if self.open:
            self.open[-1]["pooled" if used else "in_process"] += 1
        else:
            self.pool_calls[used] += 1

    def start(self) -> CompileTimeline:
        """Install the observers; the clock starts now."""
        self.t0 = time.perf_counter()
        self._watch_pool()
        self._watch_dynamo()
        self._watch_pieces()
        return self

    def _watch_pool(self) -> None:
        try:
            from torch._inductor.async_compile import AsyncCompile
        except ImportError:
            self.missing.append("AsyncCompile")
            return
        inner = getattr(AsyncCompile, "use_process_pool", None)
        if inner is None:
            self.missing.append("use_process_pool")
            return
        timeline = self

        def use_process_pool(cls: Any) -> bool:
            used = bool(inner())
            timeline._pool(used)
            return used

        AsyncCompile.use_process_pool = classmethod(use_process_pool)  # type: ignore[assignment]

    def _watch_dynamo(self) -> None:
        import torch

        handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
        if handler is None or not hasattr(handler, "register_start_callback"):
            self.missing.append("dynamo callbacks")
            return
        frames: list[dict[str, Any]] = []

        def compile_id(args: tuple[Any, ...]) -> str:
            cid = getattr(args[0], "compile_id", None) if args else None
            if cid is None:
                cid = torch._guards.CompileContext.current_compile_id()
            return str(cid)

        def begin(*args: Any) -> None:
            frames.append(self._begin(f"dynamo {compile_id(args)}"))

        def end(*args: Any) -> None:
            if frames:
                self._end(frames.pop())

        handler.register_start_callback(begin)
        handler.register_end_callback(end)

    def _watch_pieces(self) -> None:
        from surgery.runtime.piecewise import PiecewiseGroup

        inner = PiecewiseGroup._compile_piece
        timeline = self

        def compile_piece(group: Any, gm: Any, example: list[Any]) -> Any:
            calls = sum(1 for n in gm.graph.nodes if n.op.startswith("call"))
            row = timeline._begin(f"piece {calls} ops")
            try:
                return inner(group, gm, example)
            finally:
                timeline._end(row)

        PiecewiseGroup._compile_piece = compile_piece  # type: ignore[method-assign]

    def events(self) -> dict[str, Any]:
        rows = sorted(self.rows, key=lambda r: r["at_s"])
        return {"compiles": rows[:40], "missing": self.missing,
                "in_process_outside": self.pool_calls[0], "pooled_outside": self.pool_calls[1],
                "in_process": sum(r["in_process"] for r in rows) + self.pool_calls[0],
                "pooled": sum(r["pooled"] for r in rows) + self.pool_calls[1]}
