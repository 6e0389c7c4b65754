"""Whether a call issued a collective: the evidence behind region capture under torch.distributed.

The rule (used by surgery.runtime.graphs.replay): **a region path whose call issues a collective
is never captured; it runs its compiled code without a graph, and its record says why.**

Why, from what was measured (tests/test_distributed.py, 2 gloo ranks, torch 2.13):

- A capture call runs the region more than once. Surgery captures on a signature's second call:
  that call runs the compiled code, then the capturer runs it once more outside the capture to
  warm the capture stream, then records it. With a tensor-parallel MLP the capturing rank issued 2
  all-reduces on that call against 1 on an ordinary call (the stand-in capturer of the tests runs
  the work twice, as CudaCapturer does). Ranks stay in step only if every rank captures on the
  very same call, which nothing guarantees: a rank whose signature differs (a ragged last batch),
  or whose capture fails, issues a different sequence of collectives, and every rank then hangs
  in its next collective, or pairs the wrong tensors.
- A replayed graph issues its collectives behind the process group's back: its sequence number
  (what NCCL's watchdog and flight recorder use to find a desync) does not advance, and a gloo
  collective, which runs on the CPU, cannot be captured at all.
- What a region does not hold is unaffected: FSDP2 gathers and frees parameters in its pre- and
  post-forward hooks, which run in ``nn.Module.__call__`` around the replaced ``forward``, so a
  region that is an FSDP unit (or lies inside one) issues no collective itself and captures as on
  one GPU, with its parameters unsharded while it runs.

How it is seen: every process group counts its collectives (``_get_sequence_number_for_group``,
on gloo and NCCL alike, for functional collectives and DTensor redistribution too, and for code
run at a graph break). The sum over all groups is read before and after the call that precedes
capture, so the check costs two reads per captured signature and nothing when torch.distributed
is not initialized. A dispatch mode would see the ops too, but running compiled code under one
makes dynamo trace it again (measured: "non-infra torch dispatch mode present").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _groups() -> dict[str, Any]:
    """Every live process group of this process by name (WORLD and each device mesh's groups)."""
    from torch.distributed import distributed_c10d as c10d

    try:  # private registry: guarded
        return {str(c10d._world.pg_names.get(pg, i)): pg
                for i, pg in enumerate(list(c10d._world.pg_map))}
    except Exception:
        return {"default": c10d._get_default_group()}


def collective_counts() -> dict[str, int] | None:
    """Collectives issued so far by this process, per process group; None outside a job.

    A backend that does not count its collectives is left out: it cannot be told apart from
    one that issued none, which is why the rule is stated for gloo and NCCL.
    """
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    out: dict[str, int] = {}
    for name, pg in _groups().items():
        try:
            out[name] = int(pg._get_sequence_number_for_group())
        except Exception:
            continue
    return out


def issued_since(before: Mapping[str, int] | None) -> dict[str, int]:
    """The collectives issued per group since `before` (a `collective_counts()`); only groups
    that issued any. Empty outside a job."""
    if before is None:
        return {}
    now = collective_counts() or {}
    return {g: n - before.get(g, 0) for g, n in now.items() if n - before.get(g, 0) > 0}


def collective_count() -> int | None:
    """Collectives issued so far by this process over all its groups; None outside a job."""
    counts = collective_counts()
    return None if counts is None else sum(counts.values())


class CollectiveCounter:
    """``with CollectiveCounter() as c: ...``, then ``c.issued`` (per group) and ``c.total``.

    What the tests and benchmarks use to show how many collectives a call issued; it reads the
    same counters as the capture rule, so what they report is what the rule sees.
    """

    def __init__(self) -> None:
        self.issued: dict[str, int] = {}
        self._before: dict[str, int] | None = None

    def __enter__(self) -> CollectiveCounter:
        self._before = collective_counts()
        return self

    def __exit__(self, *exc: object) -> None:
        self.issued = issued_since(self._before)

    @property
    def total(self) -> int:
        return sum(self.issued.values())


def holds_collective_reason(issued: Mapping[str, int]) -> str:
    """The report's reason for a region path whose call issued collectives (per group)."""
    n = sum(issued.values())
    groups = ", ".join(sorted(issued))
    return (f"not captured: one call issued {n} collective(s) (torch.distributed, process "
            f"group(s) {groups}); a captured collective would desynchronise the ranks (see "
            "surgery.runtime.graphs.collectives); runs compiled without a graph")
