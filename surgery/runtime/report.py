"""What `apply_manifest` did, region path by region path, and the warnings it gives.

A record's ``status`` is live: the runtime updates it as the model runs, so ``compiled`` always
means that compiled code ran for that path (counted, not assumed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


class SurgeryWarning(UserWarning):
    """Something the runtime did differently from what the manifest asked, and why."""


class RegionFallbackWarning(SurgeryWarning):
    """A region could not be compiled and runs eager (one warning per manifest region)."""


class CacheIgnoredWarning(SurgeryWarning):
    """A compile-cache bundle was given but not loaded (stale, corrupt, or for another machine);
    the regions compile as usual. One warning per apply."""


class EagerOnCpuWarning(SurgeryWarning):
    """Regions planned for CUDA graphs run eager because there is no CUDA, as the manifest's
    ``on_cpu = "eager"`` says. One warning per apply, naming the setting that compiles them."""




@dataclass
class RegionRecord:
    """What happened to one region path. ``status`` is live: it is updated as the model runs.

    - ``compiled``: compiled code ran for this path (``compiled_runs`` > 0), so it is proven.
    - ``pending``: compiled and installed, but not called yet (no warm-up, or warm-up did not
      reach it); it turns ``compiled`` on its first call that runs compiled code.
    - ``eager``: runs the original code; ``reason`` says why (no CUDA, failed to trace ...).
    - ``skipped``: an optional path that does not exist on this model.
    """

    path: str
    kind: str
    callable: str
    status: str
    reason: str = ""
    backend: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # what torch.compile was given
    cuda_graphs: bool = False
    clone_outputs: bool = False
    calls: int = 0  # calls into the region
    compiled_calls: int = 0  # calls in which at least one compiled graph ran
    eager_calls: int = 0  # calls that ran the original code
    # Two counters that are easy to confuse: ``compiled_runs`` counts executions of the code
    # torch.compile produced (each call of the path can run one or more compiled graphs);
    # ``cuda_graph_replays`` counts calls answered by replaying a CUDA graph surgery captured
    # (capture = "region"), which skip the compiled code's Python entirely.
    compiled_runs: int = 0  # executions of torch.compile-d graphs (old name: graphs_run)
    compiles: int = 0  # graphs compiled while this path ran
    precompiled_runs: int = 0  # compiled runs of code loaded precompiled from a bundle
    recompiles: int = 0  # compiles after its compiled callable had already run once
    graphs_captured: int = 0  # CUDA graphs surgery captured for this path (capture = "region")
    cuda_graph_replays: int = 0  # calls answered by replaying one (old name: graph_replays)
    output_sets: int = 0  # the ring of output buffers it needed (>1: outputs kept across calls)
    capture_s: float = 0.0  # time spent capturing its graphs
    signatures: int = 0  # distinct static call signatures (shapes, int values, modes) it saw
    signature_mode: str = "static"  # "static", "dynamic" (over budget: new ones dynamic), "eager"
    recompile_reasons: list[str] = field(default_factory=list)  # what differed, per compile
    fix: str = ""  # how to avoid its recompiles (from the kind of difference)
    notes: list[str] = field(default_factory=list)
    # kind = "piecewise" (surgery.runtime.piecewise): the fixed-shape pieces of its last graph,
    # the ops that run between them (per call) and their names, and those ops run in all.
    pieces: int = 0
    ops_between: int = 0
    split_ops: list[str] = field(default_factory=list)
    ops_between_run: int = 0
    # distinct pieces this path compiled, and pieces it found compiled by an identical piece of
    # another graph or block (surgery.runtime.piece_cache)
    pieces_compiled: int = 0
    pieces_shared: int = 0
    pieces_light: int = 0  # of pieces_compiled, with the light backend (runtime.compile_start)
    pieces_restrided: int = 0  # of pieces_shared, inputs copied to its strides (piece_restride)
    piece_compile_s: float = 0.0  # seconds it spent compiling them (after dynamo's trace)
    # calls that ran eager because their list cache had a structure not compiled yet (it
    # compiles once two calls in a row show it: surgery.runtime.cache_sources)
    new_structure_calls: int = 0
    empty_cache_calls: int = 0  # calls run eager on an empty tensor cache (a prefill; as above)

    # The old names, kept for code written against them.
    @property
    def graphs_run(self) -> int:
        return self.compiled_runs

    @graphs_run.setter
    def graphs_run(self, value: int) -> None:
        self.compiled_runs = value

    @property
    def graph_replays(self) -> int:
        return self.cuda_graph_replays

    @graph_replays.setter
    def graph_replays(self, value: int) -> None:
        self.cuda_graph_replays = value


_STATUSES = ("compiled", "pending", "eager", "skipped")
_TABLE = ("kind", "paths", *_STATUSES, "calls", "compiled runs", "CUDA-graph replays",
          "recompiles")


class ApplyReport(Sequence[RegionRecord]):
    """One record per region path, plus what applied to all of them."""

    def __init__(self, records: list[RegionRecord]) -> None:
        self.records = records
        self.notes: list[str] = []
        self.warmup_passes = 0
        self.dynamo_unique_graphs = 0  # torch._dynamo's own counter, over warm-up
        self.cache: CacheRecord | None = None  # compile-cache bundle and cache hits, over warm-up
        # What the region graphs hold now (surgery.runtime.graph_memory, set by apply_manifest).
        self.memory_source: Callable[[], GraphMemory] | None = None

    @property
    def memory(self) -> GraphMemory:
        """What surgery's region graphs hold now, per path and in total (live)."""
        return self.memory_source() if self.memory_source is not None else GraphMemory([])

    def __getitem__(self, i: Any) -> Any:
        return self.records[i]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[RegionRecord]:
        return iter(self.records)

    def by_path(self, path: str) -> RegionRecord:
        for r in self.records:
            if r.path == path:
                return r
        raise KeyError(path)

    def with_status(self, status: str) -> list[RegionRecord]:
        return [r for r in self.records if r.status == status]

    def gather(self, *, dst: int = 0, group: Any = None) -> list[dict[str, Any]] | None:
        """Every rank's report as data, on rank ``dst`` (None on the others); a collective:
        every rank calls it. One process alone gets its own (surgery.runtime.distributed)."""
        # Deferred: this module stays torch-free; the gather needs torch.distributed.
        from surgery.runtime.distributed import gather_reports

        return gather_reports(self, dst=dst, group=group)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("compiled", "pending", "eager", "skipped")}
        for r in self.records:
            out[r.status] = out.get(r.status, 0) + 1
        out["graphs_compiled"] = sum(r.compiles for r in self.records)
        out["recompiles"] = sum(r.recompiles for r in self.records)
        return out

    def summary(self) -> str:
        """A plain-text table for logs and the CLI (the library itself never prints)."""
        c = self.counts()
        lines = [f"{c['compiled']} compiled, {c['pending']} pending, {c['eager']} eager, "
                 f"{c['skipped']} skipped; {c['graphs_compiled']} graph(s) compiled, "
                 f"{c['recompiles']} recompile(s), {self.warmup_passes} warm-up pass(es)"]
        for r in self.records:
            why = f"  ({r.reason})" if r.reason else ""
            lines.append(f"  {r.status:8} {r.kind:14} {r.path}  calls={r.calls} "
                         f"compiled_runs={r.compiled_runs} recompiles={r.recompiles}"
                         + (f" captured={r.graphs_captured} replays={r.cuda_graph_replays}"
                            f" output_sets={r.output_sets}" if r.graphs_captured else "")
                         + (f" pieces={r.pieces} between={r.ops_between}"
                            f" ({', '.join(r.split_ops)})" if r.pieces else "")
                         + (f" sigs={r.signatures}" if r.signatures else "")
                         + (f" [{r.signature_mode}]" if r.signature_mode == "dynamic" else "")
                         + why)
            if r.recompile_reasons:
                lines.append(f"           recompiled for: {' | '.join(r.recompile_reasons)}")
            if r.fix:
                lines.append(f"           fix: {r.fix}")
        if self.cache is not None and self.cache.line():
            lines.append(f"  {self.cache.line()}")
        mem = self.memory
        if mem.paths:
            lines.append(f"  {mem.line()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def table(self) -> str:
        """Per kind: paths compiled / pending / eager / skipped, calls, compiled runs, CUDA-graph
        replays and recompiles; then why paths run eager or were skipped, and the notes. This
        is what ``print(handle.report)`` shows."""
        kinds: dict[str, list[RegionRecord]] = {}
        for r in self.records:
            kinds.setdefault(r.kind, []).append(r)
        rows = [list(_TABLE)]
        for kind, recs in kinds.items():
            rows.append([kind, str(len(recs)),
                         *(str(sum(r.status == st for r in recs)) for st in _STATUSES),
                         str(sum(r.calls for r in recs)), str(sum(r.compiled_runs for r in recs)),
                         str(sum(r.cuda_graph_replays for r in recs)),
                         str(sum(r.recompiles for r in recs))])
        if len(kinds) > 1:
            rows.append(["total", *(str(sum(int(row[i]) for row in rows[1:]))
                                    for i in range(1, len(_TABLE)))])
        widths = [max(len(row[i]) for row in rows) for i in range(len(_TABLE))]
        c = self.counts()
        lines = [f"surgery: {len(self.records)} region path(s): {c['compiled']} compiled, "
                 f"{c['pending']} pending, {c['eager']} eager, {c['skipped']} skipped "
                 f"({self.warmup_passes} warm-up pass(es))"]
        lines += ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                  for row in rows]
        reasons: dict[tuple[str, str], list[str]] = {}
        for r in self.records:
            if r.status in ("eager", "skipped", "pending") and r.reason:
                reasons.setdefault((r.status, r.reason), []).append(r.path)
        if reasons:
            lines.append("why:")
        for (status, reason), paths in reasons.items():
            more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
            lines.append(f"  {status}: {paths[0]}{more}: {reason}")
        recompiled = [r for r in self.records if r.recompiles]
        if recompiled:  # with what differed, as summary() says it: a count alone explains nothing
            lines.append("recompiles: " + ", ".join(
                f"{r.path} ({r.recompiles}" + (f": {r.recompile_reasons[-1]}"
                                               if r.recompile_reasons else "") + ")"
                for r in recompiled[:6]) + (" ..." if len(recompiled) > 6 else "")
                + ("" if all(r.recompile_reasons for r in recompiled[:6]) else
                   " (TORCH_LOGS=recompiles names the guard that failed)"))
            fixes = sorted({r.fix for r in recompiled if r.fix})
            lines += [f"  fix: {f}" for f in fixes[:3]]
        if self.cache is not None and self.cache.line():
            lines.append(self.cache.line())
        mem = self.memory
        if mem.paths:
            lines.append(mem.line())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        c = self.counts()
        return (f"<ApplyReport: {len(self.records)} region path(s), {c['compiled']} compiled, "
                f"{c['pending']} pending, {c['eager']} eager, {c['skipped']} skipped>")


def warn_eager_on_cpu(report: ApplyReport) -> None:
    """One warning, and a note, when CUDA-graph regions run eager because there is no CUDA.

    Why: on a CPU the default manifest compiles nothing (``on_cpu = "eager"``), and a user found
    out only by printing the report (issue 12). The warning names the setting that changes it.
    """
    paths = [r.path for r in report.records
             if r.status == "eager" and "without CUDA" in r.reason and "on_cpu='eager'" in r.reason]
    if not paths:
        return
    msg = (f"{len(paths)} region path(s) (e.g. {paths[0]}) run eager: there is no CUDA here, and "
           "the manifest says on_cpu = \"eager\". Set on_cpu = \"compile\" in its [compile] "
           "table, or pass overrides={\"on_cpu\": \"compile\"}, to compile them on the CPU")
    report.notes.append(msg)
    warnings.warn(f"surgery: {msg}", EagerOnCpuWarning, stacklevel=3)


@dataclass
class CacheRecord:
    """What the report says about compile caches: a bundle loaded or not, and why; then how
    many compiles in warm-up hit or missed the caches (hits are the work a bundle saved)."""

    path: str | None = None
    loaded: bool = False
    reason: str = ""
    saved_to: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    precompiled: int = 0  # artifacts loaded precompiled (surgery.runtime.precompiled)
    precompiled_unused: int = 0  # artifacts of the bundle no region group matched (stale)
    aoti: int = 0  # of those, AOTInductor runners (surgery.runtime.aoti_bundle)

    def line(self) -> str:
        c = self.counts
        if self.path is None and not any(c.values()) and not self.saved_to:
            return ""  # no bundle and no cached compile: nothing worth a line
        hits = (f"; warm-up compiles: FX graph cache {c.get('fx_graph_hits', 0)} hit / "
                f"{c.get('fx_graph_misses', 0)} miss, AOTAutograd cache "
                f"{c.get('aot_autograd_hits', 0)} hit / {c.get('aot_autograd_misses', 0)} miss"
                if c else "")
        if self.path is None:
            state = "compile cache: no bundle given"
        else:
            state = f"compile cache: {'loaded' if self.loaded else 'ignored'} ({self.reason})"
        pre = (f"; {self.precompiled} precompiled artifact(s) installed (no dynamo trace"
               + (f", {self.aoti} of them AOTInductor runners" if self.aoti else "") + ")"
               if self.precompiled else "") + (
            f", {self.precompiled_unused} stale" if self.precompiled_unused else "")
        return state + pre + hits + (f"; saved to {self.saved_to}" if self.saved_to else "")


@dataclass
class PathMemory:
    """What one region path's graphs hold, in bytes. A buffer that several paths share counts
    once, at the first path (in manifest order) that uses it, so the paths sum to the total."""

    path: str
    outputs: int = 0  # output sets (ring sets x their bytes)
    static_inputs: int = 0  # the graphs' input buffers (inputs read in place cost nothing)
    pool: int = 0  # what its captures added to the capture pool (CUDA; reserved bytes)
    output_sets: int = 0  # sets its graphs write
    shared: int = 0  # buffers it uses that an earlier path's bytes already count


@dataclass
class GraphMemory:
    """What surgery's region graphs hold now (``handle.report.memory``), in bytes.

    ``pool`` is the capture pool's size read from the CUDA allocator when it can be read, else
    the sum of what each capture added to reserved memory. Inductor's workspaces are
    temporaries of the compiled code, so inside a graph they are part of the pool.
    """

    paths: list[PathMemory]
    pool_reserved: int | None = None
    limit: int | None = None  # max_graph_memory, when set
    over_cap: list[str] = field(default_factory=list)  # paths the cap kept a graph from
    # (path, bytes its graphs held alone): what the cap demoted, largest first, in order
    demoted: list[tuple[str, int]] = field(default_factory=list)
    # What the capture streams keep allocated (their cuBLAS workspace: CudaCapturer.stream_bytes),
    # for as long as the process runs; no path's, so in the total only.
    capture_stream: int = 0
    # Of it, what surgery's side stream keeps (captures made while the caller ran on the default
    # stream, which cannot be captured on); and how many captures ran on each kind of stream.
    side_stream: int = 0
    side_captures: int = 0
    caller_captures: int = 0
    # Captures on the side stream inside a routed call (surgery.runtime.stream_route): the whole
    # call ran there, so its workspace is the model's one, not the graphs' own.
    routed_captures: int = 0

    @property
    def outputs(self) -> int:
        return sum(p.outputs for p in self.paths)

    @property
    def static_inputs(self) -> int:
        return sum(p.static_inputs for p in self.paths)

    @property
    def pool(self) -> int:
        return self.pool_reserved if self.pool_reserved is not None else \
            sum(p.pool for p in self.paths)

    @property
    def total(self) -> int:
        return self.outputs + self.static_inputs + self.pool + self.capture_stream

    def by_path(self, path: str) -> PathMemory:
        return next(p for p in self.paths if p.path == path)

    def line(self) -> str:
        """"region graphs hold 4.70 GiB: outputs 3.10, static inputs 0.90, pool 0.70" """
        unit, div = ("GiB", 2**30) if self.total >= 2**30 else ("MiB", 2**20)
        text = (f"region graphs hold {self.total / div:.2f} {unit}: outputs "
                f"{self.outputs / div:.2f}, static inputs {self.static_inputs / div:.2f}, pool "
                f"{self.pool / div:.2f}, capture stream {self.capture_stream / div:.2f} "
                f"({len(self.paths)} path(s), "
                f"{sum(p.shared for p in self.paths)} shared buffer use(s))")
        if self.limit is not None:
            text += f"; max_graph_memory {self.limit / div:.2f} {unit}"
        if self.over_cap:
            text += (f", {len(self.over_cap)} path(s) over it run without a graph or clone "
                     f"(e.g. {self.over_cap[0]})")
        if self.demoted:
            text += (f", the largest first ({len(self.demoted)} demoted, the first "
                     f"{self.demoted[0][0]} holding {self.demoted[0][1] / div:.2f} {unit})")
        return text + self.stream_hint()

    def stream_hint(self) -> str:
        """Where the graphs captured, and how to avoid the side stream's workspace when they
        paid for one ("" when every capture was on the caller's own stream)."""
        routed = (f"; {self.routed_captures} capture(s) on surgery's side stream, which the "
                  "whole call ran on (called on the default stream: routed), so the model and its "
                  "graphs share one cuBLAS workspace (a matmul on the default stream outside the "
                  "model makes that stream's too)" if self.routed_captures else "")
        if not self.side_stream:
            return routed
        return routed + (
            f"; the capture stream's {self.side_stream / 2**20:.1f} MiB is cuBLAS's workspace "
            "for surgery's side stream, used because the model ran on the default stream outside "
            "the route (a submodule or method called directly, or route_default_stream=False): "
            "call the model itself, or run it under `with torch.cuda.stream(torch.cuda.Stream()):`"
            " and graphs capture on that stream, sharing eager's workspace")
