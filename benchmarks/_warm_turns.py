"""Steady speed cold against warm, in turns, in one process (gpu_warm_start.py ``--turns N``).

Two processes differ by up to 40% in steady speed on the H200 host (the seventh session), so a
cold process's ms/frame against a warm one's says nothing about the kernels. Here one process
holds both:

- ``cold``: the model compiled by apply_manifest without a bundle (dynamo and inductor here,
  this process's own empty cache folders), frames until its first replayed frame;
- ``warm``: a second model, built the same way (same seed, same weights), applied with the cold
  process's bundle (``cache=bundle``): its groups install the bundle's precompiled callables.
  That it runs them, and not the dynamo cache the cold model just filled, is counted, not
  assumed: its paths' ``compiles`` stay 0, every compiled path ran the bundle's callable
  (``precompiled_runs``: its CUDA graph, where it has one, was captured from that callable),
  the turns' calls are replays of those graphs or further runs of the callables (a replay
  never reaches the callable, so ``precompiled_runs`` alone stays still once a path replays:
  the eighth session's proof counted only it, and read False on a warm model that replayed),
  and dynamo traces no frame from the warm model's apply to the end of the turns
  (``bytecode_tracing`` entries).

Then N rounds, each one frame of each model, the order alternating (cold first in even rounds),
timed with CUDA events around ``mark_step(); frame()``; both models get the same inputs (the
sdpa model's streams are reset and refilled with the same seeds first), and each pair of
outputs is compared bit for bit. The host's drift lands on both arms of a round alike, so the
ratio warm/cold per round, and its median, is the figure. Peak memory per arm: the CUDA peak
during that arm's frames (both models resident, so each includes the other's weights and
graphs); and the process's peak.

What it does not show: whether the warm *process* runs the cold process's kernels (in this
process the warm model's kernels are loaded next to the cold model's); that is the census and
region comparison of the separate warm process (benchmarks/_same_kernels.py). Nor do its
identical rounds decide warm == cold: the cold model here is compiled again and its Triton
kernels tune themselves, so where a cold compile is not deterministic (Flux on the H200) its
bits follow its own picks, not the bundle's cold process's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import _same_kernels
from _arms import time_call


def _until_replayed(frame: Callable[[], Any], records: list[Any], ready: Callable[..., bool],
                    cuda: bool, sync: Callable[[], None], mark_step: Callable[[], None],
                    limit: int = 8) -> int:
    for i in range(1, limit + 1):
        seen = {r.path: (r.cuda_graph_replays, r.compiles) for r in records}
        mark_step()
        frame()
        sync()
        if ready(records, seen, cuda):
            return i
    return -1


def alternate(frames: dict[str, Callable[[], Any]], *, rounds: int,
              tensors: Callable[[Any], list[Any]], cuda: bool,
              mark_step: Callable[[], None]) -> dict[str, Any]:
    """``rounds`` rounds of one frame per arm (two arms), the order alternating (the first arm
    first in even rounds), timed with CUDA events; each round's two outputs compared bit for
    bit. Returns ms and peak GiB per arm, the identical rounds and the largest difference."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = list(frames)
    assert len(names) == 2, names
    ms: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, float] = {n: 0.0 for n in names}
    identical, max_diff = 0, 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(rounds):
        arms = list(frames.items())
        got: dict[str, list[Any]] = {}
        for arm, frame in (arms if i % 2 == 0 else arms[::-1]):
            if cuda:
                sync()
                torch.cuda.reset_peak_memory_stats()
            y, t, _ = time_call(lambda f=frame: (mark_step(), f())[1], cuda=cuda)
            got[arm] = [x.detach().clone() for x in tensors(y)]
            ms[arm].append(t)
            if cuda:
                peak[arm] = max(peak[arm], torch.cuda.max_memory_allocated() / 2**30)
        a, b = got[names[0]], got[names[1]]
        identical += all(torch.equal(x, z) for x, z in zip(a, b, strict=True))
        max_diff = max([max_diff, *(float((x.float() - z.float()).abs().max())
                                    for x, z in zip(a, b, strict=True))])
    return {"ms": ms, "peak": peak, "identical": identical, "max_diff": max_diff}


def _makers(name: str, device: str, build: Callable[[], Any], frames_for: Callable[..., Any]
            ) -> tuple[Callable[[], Any], Callable[[Any], Callable[[], Any]]]:
    """(a model built from seed 0, a fresh frame source for a model: seeds from the start,
    sdpa's stream reset and refilled)."""
    import torch

    def model() -> Any:
        torch.manual_seed(0)
        with torch.device(device):
            return build().eval()

    def fill(m: Any) -> Callable[[], Any]:
        frame, _ = frames_for(name, m, device)
        if name == "sdpa":
            m.reset_stream()
            for _ in range(m.config.window + 1):
                frame()
        return frame

    return model, fill


def run_rblock_turns(*, name: str, manifest: str, device: str, rounds: int,
                     build: Callable[[], Any], frames_for: Callable[..., Any],
                     tensors: Callable[[Any], list[Any]], ready: Callable[..., bool]
                     ) -> dict[str, Any]:
    """Steady speed with inductor's dynamic R-block scaling off (surgery's default on CUDA)
    against on, in turns in one process (``--rblock-turns N``): two models compiled cold from
    the same manifest, the second with ``options = {dynamic_scale_rblock = true}``. Their
    kernels differ in source (the option is in each kernel's inductor meta), so the two share
    no cache entry. The figure is the median of on/off per round; outputs are compared too,
    though the two compiles may pick other configs anyway (autotuning is not deterministic)."""
    import torch

    from surgery.runtime.apply import apply_manifest, mark_step

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    base = dict(_same_kernels.overrides(cuda))
    base.pop("options", None)
    arms = {"off": base, "on": {**base, "options": {"dynamic_scale_rblock": True}}}
    model, fill = _makers(name, device, build, frames_for)
    out: dict[str, Any] = {"model": name, "phase": "turns-rblock", "rounds": rounds}
    models = {arm: model() for arm in arms}
    handles = {}
    with torch.inference_mode():
        for arm, overrides in arms.items():
            frame = fill(models[arm])
            handles[arm] = apply_manifest(models[arm], manifest, overrides=overrides)
            out[f"{arm}_frames_to_replay"] = _until_replayed(
                frame, handles[arm].report.records, ready, cuda, sync, mark_step)
        frames = {arm: fill(m) for arm, m in models.items()}  # the same inputs, in lockstep
        turns = alternate(frames, rounds=rounds, tensors=tensors, cuda=cuda,
                          mark_step=mark_step)
    ms = turns["ms"]
    ratios = [b / a for a, b in zip(ms["off"], ms["on"], strict=True)]
    for arm, h in handles.items():
        config = [r.options.get("inductor_config", {}).get("dynamic_scale_rblock")
                  for r in h.report.records if r.status == "compiled"]
        out[f"{arm}_median_ms"] = round(statistics.median(ms[arm]), 3)
        out[f"{arm}_peak_gib"] = round(turns["peak"][arm], 3) if cuda else None
        out[f"{arm}_compiled_paths"] = len(config)
        out[f"{arm}_scale_rblock"] = sorted({str(c) for c in config})  # what the report shows
        h.restore()
    out.update({"on_over_off_median": round(statistics.median(ratios), 4),
                "on_over_off_range": [round(min(ratios), 4), round(max(ratios), 4)],
                "identical_rounds": turns["identical"], "max_abs_diff": turns["max_diff"]})
    out["ab_problem"] = rblock_ab_problem(out, cuda)
    return out


def rblock_ab_problem(out: dict[str, Any], cuda: bool) -> str:
    """Why the R-block turns are not an A/B of the setting ("" when they are): an arm that
    compiled nothing, or whose reports do not show the setting it was meant to run with (on the
    CPU surgery sets nothing, and there is no Triton kernel to scale)."""
    if not cuda:
        return "not on CUDA: no Triton kernel, and surgery sets no default here"
    for arm, want in (("off", "False"), ("on", "True")):
        if not out.get(f"{arm}_compiled_paths"):
            return f"the {arm} arm compiled no region path"
        if out.get(f"{arm}_scale_rblock") != [want]:
            return (f"the {arm} arm's reports show dynamic_scale_rblock "
                    f"{out.get(f'{arm}_scale_rblock')}, not [{want!r}]")
    return ""


def run_turns(*, name: str, manifest: str, bundle: str, device: str, rounds: int,
              build: Callable[[], Any], frames_for: Callable[..., Any],
              tensors: Callable[[Any], list[Any]], ready: Callable[..., bool]) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import compilation_time_metrics as metrics

    from surgery.runtime.apply import apply_manifest, mark_step
    from surgery.runtime.kernel_ids import check_kernels

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    overrides = _same_kernels.overrides(cuda)
    model, fill = _makers(name, device, build, frames_for)

    def traced() -> int:
        return len(metrics.get("bytecode_tracing", []))

    out: dict[str, Any] = {"model": name, "phase": "turns", "rounds": rounds}
    # Built outside inference mode, as in the cold and warm processes: weights made under it
    # are inference tensors, which the artifacts' guards refuse (every call went to dynamo).
    cold, warm = model(), model()
    with torch.inference_mode():
        frame_c = fill(cold)
        hc = apply_manifest(cold, manifest, overrides=overrides)
        out["cold_frames_to_replay"] = _until_replayed(frame_c, hc.report.records, ready, cuda,
                                                       sync, mark_step)
        frame_w = fill(warm)
        traced0 = traced()
        hw = apply_manifest(warm, manifest, overrides=overrides, cache=bundle)
        out["warm_frames_to_replay"] = _until_replayed(frame_w, hw.report.records, ready, cuda,
                                                       sync, mark_step)
        runs0 = sum(r.precompiled_runs for r in hw.report.records)
        replays0 = sum(r.cuda_graph_replays for r in hw.report.records)
        frame_c, frame_w = fill(cold), fill(warm)  # the same inputs from here on, in lockstep
        turns = alternate({"cold": frame_c, "warm": frame_w}, rounds=rounds, tensors=tensors,
                          cuda=cuda, mark_step=mark_step)
    ms, peak = turns["ms"], turns["peak"]
    identical, max_diff = turns["identical"], turns["max_diff"]
    ratios = [w / c for c, w in zip(ms["cold"], ms["warm"], strict=True)]
    records = hw.report.records
    out.update({
        "cold_median_ms": round(statistics.median(ms["cold"]), 3),
        "warm_median_ms": round(statistics.median(ms["warm"]), 3),
        "warm_over_cold_median": round(statistics.median(ratios), 4),
        "warm_over_cold_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "cold_peak_gib": round(peak["cold"], 3) if cuda else None,
        "warm_peak_gib": round(peak["warm"], 3) if cuda else None,
        "process_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
        if cuda else None,
        "identical_rounds": identical, "max_abs_diff": max_diff,
        # the proof that the warm model ran the bundle's callables, not dynamo's cache
        "warm_precompiled_installed": hw.report.cache.precompiled if hw.report.cache else 0,
        "warm_compiles": sum(r.compiles for r in records),
        "warm_precompiled_runs_in_turns": sum(r.precompiled_runs for r in records) - runs0,
        # a path whose graph was captured replays it: its calls in the turns are replays of
        # a graph captured from the bundle's callable, and never reach the callable again
        "warm_replays_in_turns": sum(r.cuda_graph_replays for r in records) - replays0,
        # compiled paths that never ran the bundle's code (compiled or captured elsewhere)
        "warm_paths_without_precompiled_run": sorted(
            r.path for r in records if r.status == "compiled" and not r.precompiled_runs),
        "warm_compiled_paths": sum(r.status == "compiled" for r in records),
        "dynamo_frames_from_warm_apply": traced() - traced0,
        # calls whose artifact's guards failed (they went to dynamo): the first thing to read
        # when the warm model did not run the bundle's code
        "warm_guards_failed": sum(len(getattr(g, "_guards_failed", ())) for g in hw.groups),
        "kernels_check": check_kernels(hw).line(),
        "bundle_reason": hw.report.cache.reason if hw.report.cache else ""})
    out["warm_ran_the_bundle"] = (out["warm_precompiled_installed"] > 0 and
                                  out["warm_compiles"] == 0 and
                                  out["dynamo_frames_from_warm_apply"] == 0 and
                                  not out["warm_paths_without_precompiled_run"] and
                                  out["warm_precompiled_runs_in_turns"] +
                                  out["warm_replays_in_turns"] >= rounds)
    hc.restore()
    hw.restore()
    return out
