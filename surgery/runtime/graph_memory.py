"""How much memory surgery's region graphs hold, path by path, and the cap on it (issue 20).

Why. On a LingBot-size streaming model the region graphs took the peak from 11.0 GiB (eager)
to 15.8 GiB, and nothing said where the 4.7 GiB went. ``handle.report.memory`` says it now:
per region path, the output sets (ring sets x their bytes), the static input buffers, and what
its captures added to the capture pool; in total, the pool's size as the CUDA allocator reports
it, and what the capture stream keeps allocated (cuBLAS's workspace for that stream, 32 MiB
by default on Hopper: 33 of GPT-2's 35 MiB over eager's peak on the H200). That is paid only
when the caller runs on the default stream, which cannot be captured on, so surgery captures on
a side stream of its own; the line then says how to avoid it (surgery.runtime.graphs.capture).
A call of the model itself on the default stream is routed onto that side stream, whole
(surgery.runtime.stream_route): its captures are counted as routed, and the line says so.
``summary()`` and ``print(handle.report)`` give it as one line.

How it counts. Buffers are shared between paths (surgery.runtime.graphs.arena), so each storage
is counted once, at the first path in manifest order that uses it; the paths then sum to the
total, and ``shared`` says how many buffers a path uses that an earlier one already counts.
Inputs read in place (another region's output) cost nothing: that output is counted at its
writer.

The cap. ``apply_manifest(..., max_graph_memory="2GiB")`` (bytes, or a string with a unit)
sets the arena's limit: before each new buffer or capture the arena checks that the graphs'
memory stays within it. Past it the largest paths give way first, whatever order the model
calls them in (surgery.runtime.graphs.demote): paths that hold more alone than the newcomer
needs are demoted (their graphs dropped; they run compiled without a graph) when that makes
room, or else the newcomer is not captured (a ring that would grow clones its outputs instead).
Each demotion is in the demoted path's record, and ``GraphMemory.demoted`` lists them in order.
The cap is per device (one arena per capturer): the latest ``apply_manifest`` sets it.

Also here, as it concerns the allocator under CUDA graphs: the note apply_manifest adds when
``expandable_segments`` is set together with CUDA graphs.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from surgery.errors import SurgeryError
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.report import GraphMemory, PathMemory, SurgeryWarning

# Units max_graph_memory accepts (case-insensitive): powers of 1024 for the i-units, of 1000
# for the others.
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | float | str | None, *, what: str = "max_graph_memory") -> int | None:
    """Bytes from ``2147483648``, ``"2GiB"``, ``"512 MiB"`` or ``"1.5GB"``; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SurgeryError(f"{what} = {value!r} is not a size",
                           hint=f'give bytes as an int, or a string such as "2GiB" ({what})')
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in SIZE_UNITS:
            raise SurgeryError(
                f"{what} = {value!r} is not a size: expected a number and one of the units "
                f"{', '.join(u for u in SIZE_UNITS if u)}", hint=f'for example {what}="2GiB"')
        n = float(m.group(1)) * SIZE_UNITS[unit]
    else:
        n = float(value)
    if not n > 0 or n != n or n == float("inf"):
        raise SurgeryError(f"{what} = {value!r} is not a positive size",
                           hint=f"leave {what} out for no cap")
    return int(n)


def region_graphs(graphs: Any) -> list[RegionGraphs]:
    """The RegionGraphs behind a slot's ``graphs``: itself, or a piecewise path's pieces'
    (surgery.runtime.piecewise_split.PathPieces keeps ``{piece: (RegionGraphs, call)}``)."""
    if graphs is None:
        return []
    if isinstance(graphs, RegionGraphs):
        return [graphs]
    pieces = getattr(graphs, "graphs", {})
    return [p[0] for p in pieces.values()
            if isinstance(p, tuple) and isinstance(p[0], RegionGraphs)]


def collect_memory(slots: Sequence[Any]) -> GraphMemory:
    """What the region graphs of these slots (surgery.runtime.slots._Slot, or a piecewise
    slot) hold now."""
    seen: set[int] = set()
    paths: list[PathMemory] = []
    limit = None
    over: list[str] = []
    pools: dict[int, Any] = {}
    arenas: dict[int, Any] = {}
    for slot in slots:
        parts = region_graphs(getattr(slot, "graphs", None))
        if not parts:
            continue
        rec = PathMemory(slot.record.path)
        for graphs in parts:
            rec.pool += graphs.pool_bytes
            sets, inputs = graphs.buffers()
            rec.output_sets += sum(len(c.sets) for c in graphs.graphs.values())
            for kind, storages in (("outputs", sets), ("static_inputs", inputs)):
                for st in storages:
                    ptr = st.data_ptr()
                    if ptr in seen:
                        rec.shared += 1
                        continue
                    seen.add(ptr)
                    setattr(rec, kind, getattr(rec, kind) + st.nbytes())
            if graphs.over_cap and slot.record.path not in over:
                over.append(slot.record.path)
            limit = graphs.arena.limit
            arenas[id(graphs.arena)] = graphs.arena
            pools[id(graphs.capturer)] = graphs.capturer
        paths.append(rec)
    reserved = [getattr(c, "pool_reserved", lambda: None)() for c in pools.values()]
    pool = sum(r for r in reserved if r is not None) if any(r is not None for r in reserved) \
        else None
    mine = {p.path for p in paths}
    demoted = [(label, n) for a in arenas.values() for label, n in a.demoted
               if label.split(" (piece ")[0] in mine]
    def total(name: str) -> int:  # a stand-in capturer (the tests') may have none of these
        return sum(int(getattr(c, name, 0) or 0) for c in pools.values())

    return GraphMemory(paths, pool, limit, over, demoted, total("stream_bytes"),
                       side_stream=total("side_bytes"), side_captures=total("side_captures"),
                       caller_captures=total("caller_captures"),
                       routed_captures=total("routed_captures"))


# Before pytorch#128068 (first released in torch 2.5) the caching allocator could not checkpoint
# a private pool that holds expandable segments, which is what cudagraph trees do between
# recordings; users saw "!block->expandable_segment_ INTERNAL ASSERT FAILED". We warn below that
# version. Later versions support it, though distributed set-ups still report hangs with it
# (torchtitan#3306), so the report always notes the setting when CUDA graphs are in use.
_EXPANDABLE_SEGMENTS_OK_FROM = (2, 5)


def note_expandable_segments(report: Any) -> None:
    """A note (and below torch 2.5 a warning) when expandable segments meet CUDA graphs."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        return
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < _EXPANDABLE_SEGMENTS_OK_FROM:
        warnings.warn(
            f"surgery: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments, which cudagraph trees in "
            f"torch {torch.__version__} do not support (pytorch#128068, fixed in torch 2.5): "
            "expect an INTERNAL ASSERT in the caching allocator. Unset it, or upgrade torch.",
            SurgeryWarning, stacklevel=3)
    report.notes.append("expandable_segments is set together with CUDA graphs; if capture "
                        "hangs or asserts, unset it first")
