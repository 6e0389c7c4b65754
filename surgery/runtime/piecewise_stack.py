"""A decoder stack compiled piecewise as one region, its blocks standing by as the fallback.

Why. A piecewise region per block (surgery.runtime.piecewise) enters dynamo once per block per
token: on GPT-2 small that is 12 frame entries and guard evaluations a token (about 0.6 ms of
host time each on a CPU, issue 19b), and it held decoding to 1.13x eager on an H200. A region
over the module that runs the whole stack (GPT-2's ``transformer``: embeddings, mask, the 12
blocks, ``ln_f``) is entered once a token: dynamo traces it as ONE graph, the cache updates of
every block replayed after the graph as side effects, and the split backend
(surgery.runtime.piecewise_split) cuts it at the 12 attention ops and the cache ``cat``s, so a
decode step is one dynamo entry and about 13 static pieces, each a region graph on CUDA. The
runtime needs nothing new for that: the stack is a piecewise region whose cache source is its
forward argument (``cache:2``), and the split finds the blocks' cache ops from the marked dim.

The fallback. Whether a stack traces whole is only known when dynamo traces it (a graph break
in mask creation, a branch on the cache length). So the planner (surgery.planning.stacks) keeps
the per-block regions in the manifest too, each table saying ``fallback_for = [STACK]``:

- The blocks' wrappers are installed, but stand by: while the stack runs compiled, dynamo
  inlines them (a wrapper called under compilation runs the original forward), so they are
  never entered and their records stay ``pending`` with the reason that they stand by.
- When the stack runs eager (it failed to trace, went over its compile budget), its eager
  forward calls the blocks' wrappers, and each block runs piecewise as before the stack region
  existed, its record going ``compiled``. The stack's record says why it runs eager.

This is the one nesting the runtime allows (surgery.runtime.resolve refuses every other): a
piecewise region whose table names, as ``fallback_for``, the piecewise region that contains it.
A manifest that names anything else there is refused at apply, before anything is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from surgery.errors import RegionError
from surgery.formats.manifest import PIECEWISE_FALLBACK_FOR, PIECEWISE_KIND, Region
from surgery.runtime.report import ApplyReport
from surgery.runtime.slots import first_line


def fallback_of(region: Region) -> str | None:
    """The stack path a piecewise region stands by for, or None."""
    if region.kind != PIECEWISE_KIND or not region.piecewise:
        return None
    value = region.piecewise.get(PIECEWISE_FALLBACK_FOR)
    if not value:
        return None
    if not isinstance(value, list | tuple) or len(value) != 1 or not isinstance(value[0], str):
        raise RegionError(f"piecewise {PIECEWISE_FALLBACK_FOR} {value!r} is not one path",
                          region=str(region.paths[0]) if region.paths else None,
                          hint=f"{PIECEWISE_FALLBACK_FOR} = [\"transformer\"]: the path of the "
                               "piecewise region that contains these blocks")
    return value[0]


def standby_nesting(region: Region, path: str, outer: str, outer_region: Region) -> bool:
    """True if ``path`` (of ``region``) may lie inside the forward region at ``outer``: it is a
    block standing by for that piecewise stack."""
    return fallback_of(region) == outer and outer_region.kind == PIECEWISE_KIND and \
        path.startswith(outer + ".")


def check_fallbacks(resolved: Iterable[tuple[Region, str, Any, str]]) -> None:
    """Every ``fallback_for`` names a piecewise forward region that contains the paths."""
    items = list(resolved)
    stacks = {p for r, p, _, _ in items if r.kind == PIECEWISE_KIND and r.callable == "forward"
              and fallback_of(r) is None}
    for region, path, _, _ in items:
        stack = fallback_of(region)
        if stack is None:
            continue
        if stack not in stacks or not path.startswith(stack + "."):
            raise RegionError(
                f"piecewise region path {path!r} stands by for {stack!r} "
                f"({PIECEWISE_FALLBACK_FOR}), which is not a piecewise region containing it",
                region=path, hint=f"name the piecewise stack region that contains the block, "
                                  f"or drop {PIECEWISE_FALLBACK_FOR} (`surgery plan --piecewise` "
                                  "writes both)")


def standby_reason(stack: str) -> str:
    return (f"stands by for piecewise region {stack!r}: runs piecewise only when that region "
            "runs eager")


def settle_standby(slots: Iterable[Any], report: ApplyReport) -> set[int]:
    """After warm-up: the ids of the standby slots that were never called (not unproven: they
    stand by), and one note per stack saying how it ran and how many blocks stand by for it."""
    idle: dict[str, int] = {}
    woke: dict[str, int] = {}
    out: set[int] = set()
    for slot in slots:
        stack = getattr(slot, "standby", None)
        if stack is None:
            continue
        if slot.record.calls == 0:
            out.add(id(slot))
            idle[stack] = idle.get(stack, 0) + 1
        else:
            woke[stack] = woke.get(stack, 0) + 1
    for stack in sorted({*idle, *woke}):
        status = next((r.status for r in report.records if r.path == stack), "missing")
        report.notes.append(
            f"piecewise stack {stack!r} ran {status} in warm-up: {idle.get(stack, 0)} block "
            f"path(s) stand by for it, {woke.get(stack, 0)} ran piecewise in its place")
    return out


def why_not_piecewise(exc: BaseException) -> str:
    """The reason a block cannot be compiled piecewise, from what dynamo raised."""
    text, name = first_line(exc), type(exc).__name__
    if "ConstraintViolation" in name or "Constraints violated" in text or \
            "specialized" in text.lower():
        return f"a branch on the cache length (dynamo specialized the marked dim: {text})"
    if isinstance(exc, torch._dynamo.exc.Unsupported) or "graph break" in text.lower():
        return f"a graph break inside the block ({name}: {text})"
    if isinstance(exc, torch._dynamo.exc.FailOnRecompileLimitHit):
        return f"recompiled past dynamo's limit as the cache changed ({text})"
    return f"failed to compile piecewise ({name}: {text})"
