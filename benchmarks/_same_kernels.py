"""Warm == cold, read region by region and kernel by kernel (for gpu_warm_start.py).

- ``RegionDigests``: forward hooks on every compiled region path whose callable is ``forward``
  record, per call in order, an exact checksum of the region's output tensors (computed where
  the tensor is, one small copy to the host a call). Two processes that ran the same frames
  compare their lists: the first call whose checksum differs names the region where the
  outputs part, and every later difference may be its consequence.
- ``census_summary``: this process's compiled code (surgery.runtime.kernel_ids.census): output
  code identities, Triton kernels with the config each launched and torch's autotune-cache
  state ("hit": its pick came from the cache, "miss": it benchmarked its candidates here).
- ``compare_census``: two summaries against each other: code and kernels only in one, kernels
  whose configs differ (name, then each side's config).
- ``overrides``: every process's apply_manifest overrides; ``--scale-rblock`` (the environment
  variable ``SCALE_RBLOCK_ENV``, so every child process sees it) turns inductor's R-block halving
  race back on, which surgery turns off on CUDA (surgery.runtime.compile_options): the A/B of
  its speed and of its effect on warm == cold.

The checksum: the tensor's bytes as int64, summed plain and weighted by position (mod 65521,
+1), so a change in any one byte changes it, and a swap of two bytes changes the weighted sum.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

SCALE_RBLOCK_ENV = "SURGERY_BENCH_SCALE_RBLOCK"


def overrides(cuda: bool) -> dict[str, Any]:
    """apply_manifest's overrides in every benchmark process: compile on the CPU; with
    ``SCALE_RBLOCK_ENV=1``, inductor's dynamic R-block scaling back on."""
    out: dict[str, Any] = {} if cuda else {"on_cpu": "compile"}
    if os.environ.get(SCALE_RBLOCK_ENV) == "1":
        out["options"] = {"dynamic_scale_rblock": True}
    return out


def checksum(t: Any) -> list[int]:
    import torch

    b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
    return [int(b.sum()), int((b * w).sum()), int(t.numel())]


class RegionDigests:
    """Per region call (path, checksums of its output tensors), while active."""

    def __init__(self, model: Any, records: list[Any], tensors: Callable[[Any], list[Any]]):
        self.model, self.records, self.tensors = model, records, tensors
        self.calls: list[list[Any]] = []
        self.skipped: list[str] = []  # method regions: no hook point
        self.active = False

    @contextlib.contextmanager
    def collect(self) -> Iterator[RegionDigests]:
        handles = []
        for r in self.records:
            if r.status != "compiled":
                continue
            if r.callable != "forward":
                self.skipped.append(f"{r.path}.{r.callable}")
                continue
            mod = self.model.get_submodule(r.path)

            def hook(_m: Any, _a: Any, out: Any, _p: str = r.path) -> None:
                self.calls.append([_p, [checksum(t) for t in self.tensors(out)]])

            handles.append(mod.register_forward_hook(hook))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


def first_difference(cold: list[list[Any]], now: list[list[Any]]) -> dict[str, Any]:
    """Where two processes' region outputs part: the first differing call, and how many."""
    if not cold or not now:
        return {"compared": 0, "note": "NO REGION CALLS DIGESTED in one of the two"}
    n = min(len(cold), len(now))
    differ = [i for i in range(n) if cold[i] != now[i]]
    out: dict[str, Any] = {"compared": n, "calls_cold": len(cold), "calls_now": len(now),
                           "differing_calls": len(differ),
                           "order_differs": any(cold[i][0] != now[i][0] for i in range(n))}
    if differ:
        i = differ[0]
        out.update(first_call=i, first_path=now[i][0], cold_path=cold[i][0])
    return out


def census_summary() -> dict[str, Any]:
    from surgery.runtime.kernel_ids import census

    c = census().as_dict()
    states: dict[str, int] = {}
    for k in c["triton"].values():
        states[k["cache"] or "?"] = states.get(k["cache"] or "?", 0) + 1
    return {**c, "n_code": len(c["code"]), "n_triton": len(c["triton"]),
            "autotune_cache_states": states}


def compare_census(cold: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    ct, nt = cold.get("triton", {}), now.get("triton", {})
    differ = [[nt[h]["name"], ct[h]["config"], nt[h]["config"]] for h in sorted(set(ct) & set(nt))
              if ct[h]["config"] != nt[h]["config"]]
    return {"code_only_cold": len(set(cold.get("code", [])) - set(now.get("code", []))),
            "code_only_now": len(set(now.get("code", [])) - set(cold.get("code", []))),
            "triton_only_cold": sorted(ct[h]["name"] for h in set(ct) - set(nt))[:8],
            "triton_only_now": sorted(nt[h]["name"] for h in set(nt) - set(ct))[:8],
            "configs_differ": differ[:12], "n_configs_differ": len(differ),
            # kernels launched with several configs in one process (kernel_ids' module doc):
            # one config per hash above cannot show that the two ran the same
            "split_cold": len(cold.get("split", {})), "split_now": len(now.get("split", {})),
            "same": not differ and set(cold.get("code", [])) == set(now.get("code", []))
            and set(ct) == set(nt) and not cold.get("split") and not now.get("split")}
