"""What `apply_manifest` did, region path by region path, and the warnings it gives.

A record's ``status`` is live: the runtime updates it as the model runs, so ``compiled`` always
means that compiled code ran for that path (counted, not assumed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from surgery.cache import CacheRecord


class SurgeryWarning(UserWarning):
    """Something the runtime did differently from what the manifest asked, and why."""


class RegionFallbackWarning(SurgeryWarning):
    """A region could not be compiled and runs eager (one warning per manifest region)."""


class CacheIgnoredWarning(SurgeryWarning):
    """A compile-cache bundle was given but not loaded (stale, corrupt, or for another machine);
    the regions compile as usual. One warning per apply."""




@dataclass
class RegionRecord:
    """What happened to one region path. ``status`` is live: it is updated as the model runs.

    - ``compiled``: compiled code ran for this path (``graphs_run`` > 0), so it is proven.
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
    graphs_run: int = 0  # compiled graph executions
    compiles: int = 0  # graphs compiled while this path ran
    recompiles: int = 0  # compiles after its compiled callable had already run once
    graphs_captured: int = 0  # CUDA graphs surgery captured for this path (capture = "region")
    graph_replays: int = 0  # calls answered by replaying one of them
    output_sets: int = 0  # the ring of output buffers it needed (>1: outputs kept across calls)
    capture_s: float = 0.0  # time spent capturing its graphs
    signatures: int = 0  # distinct static call signatures (shapes, int values, modes) it saw
    signature_mode: str = "static"  # "static", "dynamic" (over budget: new ones dynamic), "eager"
    recompile_reasons: list[str] = field(default_factory=list)  # what differed, per compile
    fix: str = ""  # how to avoid its recompiles (from the kind of difference)
    notes: list[str] = field(default_factory=list)


class ApplyReport(Sequence[RegionRecord]):
    """One record per region path, plus what applied to all of them."""

    def __init__(self, records: list[RegionRecord]) -> None:
        self.records = records
        self.notes: list[str] = []
        self.warmup_passes = 0
        self.dynamo_unique_graphs = 0  # torch._dynamo's own counter, over warm-up
        self.cache: CacheRecord | None = None  # compile-cache bundle and cache hits, over warm-up

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
                         f"graphs_run={r.graphs_run} recompiles={r.recompiles}"
                         + (f" captured={r.graphs_captured} replays={r.graph_replays}"
                            f" output_sets={r.output_sets}" if r.graphs_captured else "")
                         + (f" sigs={r.signatures}" if r.signatures else "")
                         + (f" [{r.signature_mode}]" if r.signature_mode == "dynamic" else "")
                         + why)
            if r.recompile_reasons:
                lines.append(f"           recompiled for: {' | '.join(r.recompile_reasons)}")
            if r.fix:
                lines.append(f"           fix: {r.fix}")
        if self.cache is not None and self.cache.line():
            lines.append(f"  {self.cache.line()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
