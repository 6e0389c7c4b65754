"""apply_manifest on each rank of a DDP, FSDP2 or tensor-parallel model, and the report on rank 0.

Each rank applies the same manifest to its own model; nothing here launches processes or
communicates beyond gathering the reports (torchrun, DDP, ``fully_shard`` and
``parallelize_module`` do the rest). What holds, and why:

- **Paths.** A manifest's paths are the canonical model's (no ``module.``). They resolve through
  the wrappers that training adds, which hold the model under one attribute:
  ``DistributedDataParallel`` / ``DataParallel`` (``module``), FSDP1 (``_fsdp_wrapped_module``),
  and ``checkpoint_wrapper`` (``_checkpoint_wrapped_module``): where a path's segment is not
  a child but such a wrapper child is, resolution steps through it (`wrapped_child`). FSDP2
  (``fully_shard``) and tensor parallelism change no path: they swap the module's class and
  parameters in place.
- **Hooks.** apply replaces ``forward`` on the instance, so ``nn.Module.__call__`` still runs
  every hook around it: FSDP2's pre-forward all-gather and post-forward reshard, DDP's, and the
  input/output redistribution of ``parallelize_module``'s styles. A region that is an FSDP unit
  runs with its parameters unsharded.
- **Keys.** ``state_dict()`` keys are unchanged (DDP's keep their ``module.``), and the manifest
  binds through the same canonical keys; a DTensor's shape is the global one, so each rank's
  sharded model binds to the manifest planned for the unsharded one.
- **Collectives inside a region** (a tensor-parallel block whose output hook all-reduces) are
  compiled (dynamo traces DTensor and functional collectives) but never captured in a CUDA
  graph: the rule and its evidence are in surgery.runtime.graphs.collectives. It covers the
  graphs surgery captures (``capture = "region"``, the plan's default); with
  ``capture = "compiler"`` inductor's cudagraph trees decide what they capture, unchecked here.
- **Grad modes.** Binding reads the state dict outside inference mode (a DTensor parameter
  cannot be detached inside it), so a tensor-parallel model applies under ``inference_mode``.
  FSDP2 itself fails under ``inference_mode`` (torch 2.13: its unshard preserves version
  counters, which inference tensors lack); warm up and serve it under ``no_grad``, where region
  graphs capture as well.
- **Reports.** `gather_reports` collects every rank's report on one rank (``dst``) as JSON text
  through ``gather_object``; the peers are ranks of the same job.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import nn

from surgery.formats.keys import CHECKPOINT_WRAPPED, FSDP_WRAPPED, MODULE

# Attribute under which each wrapper keeps the module it wraps (keys.py names the segments).
# ``module`` counts only on the wrapper classes that own it: a user's own child called
# ``module`` is a real path segment.
# ``_orig_mod`` is not stepped through: a region inside an OptimizedModule would be compiled
# twice (torch.compile's graph around surgery's wrapper); such a path fails to resolve, as before.
WRAPPER_CHILDREN: tuple[str, ...] = (FSDP_WRAPPED.name, CHECKPOINT_WRAPPED.name)
_MODULE_WRAPPERS: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def wrapper_child(mod: nn.Module) -> nn.Module | None:
    """The module a wrapper holds, or None when `mod` is no wrapper."""
    if isinstance(mod, _MODULE_WRAPPERS):
        inner = getattr(mod, MODULE.name, None)
        return inner if isinstance(inner, nn.Module) else None
    children = dict(mod.named_children())
    for name in WRAPPER_CHILDREN:
        if name in children:
            return children[name]
    return None


def wrapped_child(mod: nn.Module, seg: str) -> nn.Module | None:
    """Child `seg` of `mod`, looking through any wrappers around `mod` (None if none has it)."""
    seen = 0
    while seen < 8:  # wrappers nest a few deep (DDP around checkpoint_wrapper ...), never more
        # One dict lookup, not a dict of every child built per segment (a wide container
        # made resolving its paths quadratic).
        child = getattr(mod, "_modules", {}).get(seg)
        if child is not None:
            return child
        inner = wrapper_child(mod)
        if inner is None:
            return None
        mod, seen = inner, seen + 1
    return None


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def report_dict(report: Any) -> dict[str, Any]:
    """One rank's ApplyReport as JSON-safe data: counts, every record, notes."""
    records = [{k: _jsonable(v) for k, v in dataclasses.asdict(r).items()} for r in report]
    return {"rank": rank(), "counts": report.counts(), "records": records,
            "notes": list(report.notes)}


def rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_reports(report: Any, *, dst: int = 0, group: Any = None
                   ) -> list[dict[str, Any]] | None:
    """Every rank's report (`report_dict`) on rank `dst`, in rank order; None on other ranks.

    Outside torch.distributed it is this process's report alone. Every rank of `group` must
    call it (it is a collective). With NCCL, set the rank's CUDA device first, as
    ``gather_object`` requires.
    """
    mine = json.dumps(report_dict(report))
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return [json.loads(mine)]
    world = dist.get_world_size(group)
    gathered: list[Any] | None = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(mine, gathered, dst=dst, group=group)
    if gathered is None:
        return None
    return [json.loads(text) for text in gathered]
