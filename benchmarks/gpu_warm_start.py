"""Warm starts: from apply_manifest to the first replayed frame, cold and from a precompiled bundle.

Models (each planned by `surgery plan` of the live model, its default names-only manifest):

  sdpa     `surgery.examples.lingbot_sdpa()`: the SDPA streaming example at LingBot size
           (dim 1024, 24 blocks of each kind, 378x518 frames), bf16; the KV caches are filled
           eagerly before anything compiles, so every measured frame has the steady shapes
  flux     diffusers `FluxTransformer2DModel` (Flux widths, 4 + 8 layers, 512 px), bf16
  hf_bert  transformers `BertModel` (base config), batch 8, 128 tokens, bf16

Per model, two fresh processes, each with its own new, empty TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR, under `torch.inference_mode()`:

  cold   apply_manifest without a bundle, then frames until the first replayed frame; steady
         frames; the reference output; then `handle.save_cache()` writes the bundle beside the
         manifest (format 3: Mega-Cache + precompiled artifacts; its time is not a start)
  warm   apply_manifest(cache=True) with that bundle, then the same measurements

  warm-base  (``--baseline``) the same as warm without the two cuts of surgery.runtime.
         warm_loader (the keys hashed in a thread, kernels loaded without inductor's compile
         pool): an A/B of them in one call
  warm-aoti  (``--aoti``) from a second bundle that cold also writes, with
         ``save_cache(aoti=True)``: AOTInductor packages beside the artifacts, so that the
         groups install C++ runners (surgery.runtime.aoti_bundle) and torch's Python loader is
         never imported; its build time (one C++ build per group and signature) is reported

  cold2  (``--cold2``) a second cold process, its own empty caches, that saves nothing: is a
         cold start deterministic? (its output, region outputs and kernels against cold's)
  warm-mega  (``--mega``) warm from the same bundle with its precompiled part unused (every
         group compiles with dynamo, hitting the Mega-Cache part): the dynamo path's kernels
  turns-rblock  (``--rblock-turns N``) one process with two cold-compiled models, inductor's
         dynamic R-block scaling off (surgery's default on CUDA) and on, N frames of each in
         turns: the speed that default costs or saves (benchmarks/_warm_turns.py)
  turns  (``--turns N``) one process holding a cold-compiled model and a model warm-loaded
         from the bundle, N frames of each in alternating turns (benchmarks/_warm_turns.py):
         steady ms warm/cold with the host's drift cancelled, outputs compared bit for bit,
         peak memory per arm, and the counts that prove the warm model ran the bundle's code

Same kernels (benchmarks/_same_kernels.py, surgery.runtime.kernel_ids): every process
digests each region call's output during the reference run and takes a census of its compiled
code (output-code identities; Triton kernels, the config each launched, torch's autotune-cache
state: "hit" = the pick came from the cache, "miss" = benchmarked here). Each process other
than cold compares both with cold's: the first region call whose output differs, and the
kernels whose configs differ. Warm processes also print ``check_kernels`` against the record
in the bundle (and how many kernels the warm start pinned to the cold pick).

Every warm process also counts the modules imported from the call of apply_manifest to the end
of the first replayed frame, and lists the heavy ones among them (inductor's graph, lowering,
select_algorithm, codecache; Triton).

"First replayed frame" is the first frame in which every region path that captured a CUDA graph
replayed one (on the CPU, where nothing is captured: the first frame that compiled nothing). The
figure is the wall time from the call of apply_manifest to the end of that frame, synchronised.
Its breakdown: apply_manifest itself (of which the bundle's checks and Mega-Cache load, and the
precompiled artifacts' load), dynamo tracing, the backend (AOTAutograd + inductor, cache hits
included), CUDA graph capture, and the rest of those frames (running them: eager code, first
kernel launches); per compiled group too. Then steady ms/frame (median, CUDA events), peak
GPU memory, the graphs dynamo traced, and whether the warm process's reference output is
bit-identical to the cold one's (the same kernels). The precompiled load is broken down
(surgery.runtime.load_timing): the loader's one-time set-up (imports, the CPU's ISA probe), then
per artifact its seconds with torch's own phases (inductor module load, Triton compile or bundle
read, C++ builds), counters and imports. ``--profile`` adds, in every warm process alike (so
``--baseline``'s A/B stays fair), a cProfile of the first artifact's load (the group that
pays the one-time costs) and one of the frames to the first replay (import machinery left out).

Nothing is hidden before apply_manifest: each process also reports the seconds from its own
start (the kernel's start time of the process: interpreter, imports) to the first replayed
frame, and what came before apply: ``import torch``, ``import surgery.runtime.apply`` (which
imports dynamo), building the model and filling its stream.

    python benchmarks/gpu_warm_start.py                       # sdpa, flux, hf_bert on CUDA
    python benchmarks/gpu_warm_start.py --models sdpa         # one model
    python benchmarks/gpu_warm_start.py --size tiny --device cpu   # CPU check (minutes)
    python benchmarks/gpu_warm_start.py --models sdpa --profile    # + first load, first frames
    python benchmarks/gpu_warm_start.py --models sdpa --baseline   # + warm without warm_loader
    python benchmarks/gpu_warm_start.py --models hf_bert --aoti    # + warm from AOTI runners
    python benchmarks/gpu_warm_start.py --models sdpa --profile-apply  # + whole apply profiled
    python benchmarks/gpu_warm_start.py --models flux --cold2 --mega --turns 30  # warm == cold?

Prints a markdown table per model, then one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
STARTED = time.perf_counter()
import _bytecode  # noqa: E402
import _hashes  # noqa: E402
import _same_kernels  # noqa: E402
from _arms import child_result, latency, time_call  # noqa: E402
from _warm_turns import run_rblock_turns, run_turns  # noqa: E402

MODELS = ("sdpa", "flux", "hf_bert")
PHASES = ("cold", "cold2", "warm", "warm-host", "warm-base", "warm-aoti", "warm-mega", "turns",
          "turns-rblock")
_COLD = ("cold", "cold2")  # processes that compile without a bundle
# Modules a start from runners should not import (inductor's compiler and loader, Triton).
HEAVY = ("torch._inductor.graph", "torch._inductor.lowering", "torch._inductor.select_algorithm",
         "torch._inductor.codecache", "triton")
_MAX_FRAMES = 8  # frames to wait for the first replay before calling it a failure
_STEADY = 20
_PROFILE_ROWS = 60
_PROFILE_SKIP = ("<built-in method builtins.exec>", "<built-in method builtins.__import__>",
                 "<built-in method _imp.exec_dynamic>", "<built-in method _imp.create_dynamic>")


def process_age() -> float:
    """Seconds since this process started, from the kernel's record of its start (so the
    interpreter's start-up and every import are in it); the script's own clock elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - STARTED


def _without_warm_loader() -> None:
    """warm-base: the keys are computed where the loader needs them, and kernels load with the
    configured compile threads (the code before surgery.runtime.warm_loader)."""
    import contextlib

    import surgery.runtime.load_timing as load_timing
    import surgery.runtime.precompiled as pre
    import surgery.runtime.warm_loader as warm_loader

    def no_prefetch(cls: Any, device: str) -> Any:
        return cls([], None)

    def configured_threads(device: str) -> Any:
        return contextlib.nullcontext()

    warm_loader.KeyPrefetch.start = classmethod(no_prefetch)  # type: ignore[method-assign,assignment]
    pre.serial_kernel_loads = configured_threads  # type: ignore[assignment]
    load_timing.serial_kernel_loads = configured_threads  # type: ignore[assignment]


def bench_model() -> Any:
    """The planned and deployed model (`plan --model gpu_warm_start:bench_model`): WARM_MODEL at
    WARM_START_SIZE, in WARM_START_DTYPE (the dtype is part of the fingerprint)."""
    import torch

    name = os.environ.get("WARM_MODEL", "sdpa")
    tiny = os.environ.get("WARM_START_SIZE", "lingbot") == "tiny"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        os.environ.get("WARM_START_DTYPE", "bf16")]
    if name == "sdpa":
        from surgery.examples import lingbot_sdpa, tiny_sdpa

        # LingBot-Map's SDPA build keeps float32 weights and runs each step under bf16
        # autocast (its depth head turns autocast off and needs float32 weights): the dtype
        # picks the autocast, not the weights (see _frames_for).
        return tiny_sdpa() if tiny else lingbot_sdpa()
    else:
        os.environ["ZOO_SIZE"] = "tiny" if tiny else ""
        import gpu_zoo

        model = getattr(gpu_zoo, name)()
    return model.to(dtype)


def _frames_for(name: str, model: Any, device: str) -> tuple[Callable[[], Any],
                                                             Callable[[], Any]]:
    """(next frame, reference output): the sdpa model streams a new frame each call (same
    seeds in both processes); the reference output is the last of a fixed run of frames from a
    reset stream. Reset, because a window's worth of frames does not bring two streams to one
    state: each frame's keys come from features that attended over the frames before, so the
    whole history leaks in (eager, CPU, tiny: after 17 frames the pose still differed by 4.9e-3
    between a stream that ran 3 frames more and one that did not). Without the reset, two
    processes that needed different numbers of frames to their first replay differ there."""
    import torch

    if name == "sdpa":
        seeds = iter(range(1000, 10**6))
        span = max(model.config.window, getattr(model.config, "camera_window", 0)) + 1
        bf16 = os.environ.get("WARM_START_DTYPE", "bf16") == "bf16"

        def call(seed: int) -> Any:
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
                return model(model.example_input(seed=seed))

        def frame() -> Any:
            return call(next(seeds))

        def reference() -> Any:
            out = None
            model.reset_stream()
            for i in range(span):
                out = call(50_000 + i)
            return out

        return frame, reference
    os.environ["ZOO_DTYPE"] = "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 \
        else "float32"
    import gpu_zoo

    step, reset = gpu_zoo.driver(name, model, device)
    reset()
    return (lambda: step(model)), (lambda: step(model))


def _tensors(out: Any) -> list[Any]:
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _tensors(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return [out] if hasattr(out, "shape") else []


def _ready(records: list[Any], before: dict[str, tuple[int, int]], cuda: bool) -> bool:
    """Whether this frame was replayed: every path with a captured graph replayed (CUDA); on
    the CPU, every compiled path ran compiled code and nothing compiled in the frame."""
    live = [r for r in records if r.status == "compiled"]
    if not live:
        return False
    if cuda:
        captured = [r for r in live if r.graphs_captured]
        return bool(captured) and all(
            r.cuda_graph_replays > before[r.path][0] for r in captured)
    return all(r.compiles == before[r.path][1] for r in records)


# What apply_manifest calls, by the names it looks up in its module (timed in the benchmark
# only, by wrapping them there): where an apply's seconds go besides the bundle.
_APPLY_PARTS = ("resolve_manifest", "bind_model", "load_for_apply", "resolve_path",
                "_check_nesting", "plan_region", "_install", "_capturer_for", "report_use",
                "warn_eager_on_cpu", "note_expandable_segments", "cache_counters", "_warm_up")


def _time_apply_parts() -> dict[str, float]:
    """Wrap apply_manifest's helpers in its module with timers; {name: seconds} as they run
    (a part called inside another is counted in both)."""
    import surgery.runtime.apply as apply_mod

    spent: dict[str, float] = {}
    for name in _APPLY_PARTS:
        real = getattr(apply_mod, name, None)
        if real is None:
            continue

        def timed(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t

        setattr(apply_mod, name, timed)
    return spent


def _top(prof: cProfile.Profile, n: int = _PROFILE_ROWS) -> list[list[Any]]:
    """A profile's n functions with the most cumulative time, as
    [cumulative s, own s, calls, "file:line(function)"]; importlib's own frames and exec are
    left out (every import would head the list), the modules' bodies stay."""
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "importlib" in file or fn in _PROFILE_SKIP:
            continue
        where = f"{os.path.relpath(file, ROOT) if file.startswith(ROOT) else file}:{line}({fn})"
        rows.append([round(cum, 3), round(own, 3), calls, where[-140:]])
    return sorted(rows, key=lambda r: -r[0])[:n]


def _label(file: str, line: int, fn: str) -> str:
    return f"{os.path.relpath(file, ROOT) if file.startswith(ROOT) else file}:{line}({fn})"[-140:]


def _callers(prof: cProfile.Profile, n: int = 8, k: int = 3) -> list[list[Any]]:
    """Who spends a profile's time: its n functions with the most own time, each as
    [own s, calls, function, [[cumulative s spent in it from that caller, caller], ...k]]
    (what ``builtins.compile`` or a hash update is called for, say)."""
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, calls, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        by = sorted(((v[3], _label(*c)) for c, v in callers.items()), key=lambda r: -r[0])
        rows.append([round(own, 3), calls, _label(file, line, fn),
                     [[round(c, 3), w] for c, w in by[:k]]])
    return sorted(rows, key=lambda r: -r[0])[:n]


def _profile_first_load(pre: Any, prof: cProfile.Profile) -> None:
    """Profile the first Loaded.take that loads artifacts (it pays the one-time costs)."""
    real = pre.Loaded.take

    def take(self: Any, identity: Any, target: Any, **kwargs: Any) -> Any:
        if self.loaded or not prof_pending:
            return real(self, identity, target, **kwargs)
        prof.enable()
        try:
            return real(self, identity, target, **kwargs)
        finally:
            prof.disable()
            if self.loaded:
                prof_pending.clear()

    prof_pending = [True]
    pre.Loaded.take = take


def aoti_path(bundle: str) -> str:
    """Where cold writes the bundle with AOTInductor packages (``--aoti``)."""
    return bundle.replace(".surgery.cache", ".aoti.surgery.cache")


def run_phase(phase: str, name: str, manifest: str, bundle: str, device: str,
              ref_path: str, profile: bool = False, aoti: bool = False,
              profile_apply: bool = False) -> dict[str, Any]:
    """One fresh process: build, fill the stream, apply, frames to the first replay, steady
    frames, reference output; the cold one then saves the bundle."""
    before: dict[str, float] = {"start_to_script": round(process_age() - (
        time.perf_counter() - STARTED), 3)}
    t = time.perf_counter()
    import torch

    before["import torch"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    import surgery.runtime.precompiled as pre
    from surgery.runtime.apply import apply_manifest, mark_step

    before["import surgery.runtime.apply"] = round(time.perf_counter() - t, 3)  # dynamo too
    from torch._dynamo.utils import compilation_time_metrics as metrics
    from torch._dynamo.utils import counters

    if phase == "warm-base":
        _without_warm_loader()
    if phase == "turns":
        return run_turns(name=name, manifest=manifest, bundle=bundle, device=device,
                         rounds=int(os.environ.get("WARM_TURNS", "20")), build=bench_model,
                         frames_for=_frames_for, tensors=_tensors, ready=_ready)
    if phase == "turns-rblock":
        return run_rblock_turns(name=name, manifest=manifest, device=device,
                                rounds=int(os.environ.get("WARM_RBLOCK_TURNS", "20")),
                                build=bench_model, frames_for=_frames_for, tensors=_tensors,
                                ready=_ready)
    if phase == "warm-mega":  # the bundle's precompiled part left unused: dynamo + Mega-Cache
        pre.Loaded.take = lambda self, *a, **k: {}  # type: ignore[method-assign]
    import_s = time.perf_counter() - STARTED
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(device):
        model = bench_model().eval()
    frame, reference = _frames_for(name, model, device)
    sync()
    before["build the model"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    with torch.inference_mode():
        if name == "sdpa":
            for _ in range(model.config.window + 1):  # steady cache shapes before compiling
                frame()
    sync()
    before["fill the stream"] = round(time.perf_counter() - t, 3)
    load_s = [0.0]
    real_open = pre.open_bundle

    def timed_open(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_open(*args, **kwargs)
        finally:
            load_s[0] += time.perf_counter() - t

    pre.open_bundle = timed_open  # instrumentation only: the bundle's checks and Mega-Cache load
    parts = _time_apply_parts()

    def seconds(*keys: str) -> float:
        return round(sum(sum(metrics.get(k, [])) for k in keys), 3)

    overrides = _same_kernels.overrides(cuda)
    prof = cProfile.Profile() if profile and phase != "cold" else None
    whole = cProfile.Profile() if profile_apply and phase != "cold" else None
    first_load = cProfile.Profile() if prof is not None and whole is None else None
    if first_load is not None:
        _profile_first_load(pre, first_load)
    age0 = process_age()
    started_wall = _bytecode.process_start()  # for the bytecode count
    modules0 = set(sys.modules)
    hashes = _hashes.HashSpy()  # who hashes from apply to the first replay, and on which thread
    hashes.__enter__()
    t0 = time.perf_counter()
    with torch.inference_mode():
        if whole is not None:
            whole.enable()
        handle = apply_manifest(model, manifest, overrides=overrides,
                                cache=None if phase in _COLD else
                                aoti_path(bundle) if phase == "warm-aoti" else True)
        if whole is not None:
            whole.disable()
        apply_s = time.perf_counter() - t0
        if prof is not None:
            prof.enable()
        records = handle.report.records
        frame_s, replayed = [], False
        for _ in range(_MAX_FRAMES):
            seen = {r.path: (r.cuda_graph_replays, r.compiles) for r in records}
            t = time.perf_counter()
            mark_step()
            frame()
            sync()
            frame_s.append(round(time.perf_counter() - t, 3))
            if _ready(records, seen, cuda):
                replayed = True
                break
        first_s = time.perf_counter() - t0
        hashes.__exit__(None, None, None)
        age1 = process_age()
        new_modules = sorted(set(sys.modules) - modules0)
        no_pyc = _bytecode.missing(new_modules, started_wall, skip_under=(
            os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""),))
        if prof is not None:
            prof.disable()
        tracing, backend = seconds("bytecode_tracing"), seconds("OutputGraph.call_user_compiler")
        capture = round(sum(r.capture_s for r in records), 3)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        steady = []
        for _ in range(_STEADY):
            _, ms, _ = time_call(lambda: (mark_step(), frame()), cuda=cuda)
            steady.append(ms)
        mark_step()
        digests = _same_kernels.RegionDigests(model, records, _tensors)
        with digests.collect():
            ref = [t.detach().float().cpu() for t in _tensors(reference())]
        kernels = _same_kernels.census_summary()
    pre_loaded = handle.precompiled
    setup = pre_loaded.setup if pre_loaded else None
    loaded_s = sum(pre_loaded.seconds.values()) + setup.seconds if pre_loaded and setup else 0.0
    cache = handle.report.cache
    out: dict[str, Any] = {
        "model": name, "phase": phase, "first_replay_s": round(first_s, 3),
        "process_to_replay_s": round(age1, 2), "before_apply_s": round(age0, 2),
        "before_apply": before,
        "replayed": replayed, "frames_to_replay": len(frame_s), "frame_s": frame_s,
        "apply_s": round(apply_s, 3), "bundle_s": round(load_s[0], 3),
        "precompiled_load_s": round(loaded_s, 3),
        "apply_parts": {k: round(v, 3) for k, v in parts.items()},
        "loader_setup": {"seconds": setup.seconds, "steps": setup.steps,
                         "imported": setup.imported, "keys": getattr(setup, "keys", {})}
        if setup else None,
        "profile": _top(prof) if prof is not None else [],
        "profile_first_load": _top(first_load) if first_load is not None else [],
        "profile_apply": _top(whole) if whole is not None else [],
        "profile_apply_callers": _callers(whole) if whole is not None else [],
        "tracing_s": tracing, "backend_s": backend,
        "capture_s": capture,
        "rest_s": round(first_s - apply_s - tracing - backend - capture, 3),
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        # frames dynamo traced: one "bytecode_tracing" entry each (counters["frames"] misses
        # fullgraph compiles, which skip the wrapper that counts them)
        "dynamo_frames": len(metrics.get("bytecode_tracing", [])),
        "hashing": hashes.top(),
        "pyc_missing": len(no_pyc), "pyc_missing_some": no_pyc[:8],
        "pyc_missing_before_apply": len(_bytecode.missing(sorted(modules0), started_wall)),
        "bytecode": os.environ.get("WARM_START_BYTECODE", "host"),
        "precompiled": cache.precompiled if cache else 0,
        "aoti_runners": getattr(cache, "aoti", 0) if cache else 0,
        "imported": len(new_modules), "imported_heavy": [m for m in new_modules if any(
            m == h or m.startswith(h + ".") for h in HEAVY)][:12],
        "loaded": bool(cache and cache.loaded), "cache_reason": cache.reason if cache else "",
        "groups": pre.group_breakdown(handle.groups, handle.precompiled),
        **latency(steady), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if cuda else None, "regions": handle.report.counts(), "import_s": round(import_s, 2),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__}
    out["census"] = {k: kernels[k] for k in ("n_code", "n_triton", "autotune_cache_states")}
    out["regions_digested"] = len(digests.calls)
    out["regions_not_digested"] = digests.skipped[:4]
    if phase != "cold" and handle.precompiled is not None:
        from surgery.runtime.kernel_ids import check_kernels

        check = check_kernels(handle)
        out["kernels_check"], out["kernels_line"] = check.as_dict(), check.line()
    if phase == "cold":
        with open(ref_path + ".kernels.json", "w") as f:
            json.dump({"census": kernels, "digests": digests.calls}, f)
    elif os.path.exists(ref_path + ".kernels.json"):
        with open(ref_path + ".kernels.json") as f:
            cold_k = json.load(f)
        out["regions_vs_cold"] = _same_kernels.first_difference(cold_k["digests"], digests.calls)
        out["census_vs_cold"] = _same_kernels.compare_census(cold_k["census"], kernels)
    if phase == "cold":
        torch.save(ref, ref_path)
        t = time.perf_counter()
        saved = handle.save_cache(bundle)
        out.update(save_s=round(time.perf_counter() - t, 2),
                   bundle_mb=round(saved.bytes / 1e6, 2),
                   bundle_precompiled=len(saved.metadata.get("precompiled", {})
                                          .get("entries", [])),
                   not_precompiled=saved.metadata.get("precompiled", {}).get("notes", [])[:5])
        if aoti:  # a second bundle, with AOTInductor packages (surgery.runtime.aoti_build)
            t = time.perf_counter()
            saved = handle.save_cache(aoti_path(bundle), aoti=True)
            entries = saved.metadata.get("precompiled", {}).get("entries", [])
            out.update(aoti_save_s=round(time.perf_counter() - t, 2),
                       aoti_bundle_mb=round(saved.bytes / 1e6, 2),
                       aoti_packages=sum(e.get("kind") == "aoti" for e in entries),
                       not_packaged=[n for n in saved.metadata.get("precompiled", {})
                                     .get("notes", []) if "AOTInductor" in n][:5])
    elif os.path.exists(ref_path):
        cold = torch.load(ref_path)
        out["identical_to_cold"] = all(torch.equal(a, b) for a, b in zip(ref, cold, strict=True))
        out["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in
                                  zip(ref, cold, strict=True))
    handle.restore()
    return out


# What a discovery process imports for ``--pyc`` (its packages are then compiled whole): what
# every timed process imports, plus the model's package.
# (The manifest's schema check and writer import jsonschema and tomli_w inside a function; a
# C++ build on the CPU imports torch.utils.cpp_extension, and through it setuptools' distutils.)
_BYTECODE_IMPORTS = ("torch", "surgery.runtime.apply", "surgery.runtime.precompiled",
                     "surgery.examples", "torch._inductor.compile_fx",
                     "torch._inductor.select_algorithm", "_arms", "_bytecode", "_hashes", "gpu_zoo",
                     "jsonschema", "tomli_w", "torch.utils.cpp_extension")
_MODEL_IMPORTS = {"hf_bert": ("transformers.models.bert.modeling_bert",),
                  "flux": ("diffusers.models.transformers.transformer_flux",), "sdpa": ()}


def _surgery_bytecode(prefix: str, models: list[str]) -> dict[str, Any]:
    """``--pyc surgery``: what `surgery bytecode PREFIX --import ...` does (its discovery runs
    with this script's folder on the path, so that the benchmark's helpers are compiled too)."""
    from surgery.runtime.bytecode import compile_bytecode

    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")])
    extra = ["_arms", "_hashes", "gpu_zoo",
             *(m for name in models for m in _MODEL_IMPORTS.get(name, ()))]
    done = compile_bytecode(prefix, extra_modules=extra)
    print(f"bytecode by `surgery bytecode` into {prefix}: {done.files} .py files "
          f"({done.failed} failed), discovery {done.discover_s} s, compile {done.compile_s} s",
          file=sys.stderr, flush=True)
    return {"mode": "surgery", "prefix": prefix, "py_files": done.files, "roots": [],
            "failed": done.failed, "discover_s": done.discover_s, "compile_s": done.compile_s}


def prepare_bytecode(mode: str, models: list[str], device: str, work: str,
                     prefix: str | None = None) -> dict[str, Any]:
    """The bytecode every timed process of this run reads (see benchmarks/_bytecode.py):
    {"mode", "prefix", ...}; ``compiled`` compiles it here, once, before any timed process,
    into ``prefix`` (default: a folder of this run); compileall skips what is up to date there,
    so a second run with the same ``--pyc-dir`` pays only the discovery."""
    if mode == "host":
        return {"mode": "host", "prefix": None}
    prefix = prefix if prefix and mode in ("compiled", "surgery") else \
        os.path.join(work, f"pyc-{mode}")
    if mode == "none":
        return {"mode": "none", "prefix": prefix}
    if mode == "surgery":  # the deployment step itself, with the model's package named
        return _surgery_bytecode(prefix, models)
    from surgery.runtime.load_timing import CUDA_LOADER_MODULES, LOADER_MODULES

    imports = [*_BYTECODE_IMPORTS, *LOADER_MODULES,
               *(CUDA_LOADER_MODULES if device == "cuda" else ()),
               *(m for name in models for m in _MODEL_IMPORTS.get(name, ()))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [HERE, ROOT, os.environ.get("PYTHONPATH", "")])}
    done = _bytecode.compile_into(prefix, imports, env)
    print(f"bytecode compiled into {prefix}: {done['py_files']} .py files of "
          f"{len(done['roots'])} packages, discovery {done['discover_s']} s, compileall "
          f"{done['compile_s']} s (rc {done['compileall_rc']})", file=sys.stderr, flush=True)
    return done


def run_model(name: str, *, size: str, device: str, dtype: str, timeout: int,
              keep: bool, profile: bool = False, baseline: bool = False, aoti: bool = False,
              profile_apply: bool = False, bytecode: dict[str, Any] | None = None,
              cold2: bool = False, mega: bool = False, turns: int = 0,
              rblock_turns: int = 0) -> list[dict[str, Any]]:
    from surgery.formats.manifest import save_manifest
    from surgery.planning.plan import plan_model

    work = tempfile.mkdtemp(prefix=f"warm_start_{name}_")
    env = {**os.environ, "WARM_MODEL": name, "WARM_START_SIZE": size,
           "WARM_START_DTYPE": dtype,
           "PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")])}
    # Bundles are signed (surgery.runtime.signing): one throw-away key for this run's processes.
    if not (env.get("SURGERY_CACHE_KEY") or env.get("SURGERY_CACHE_KEY_FILE")):
        env["SURGERY_CACHE_KEY"] = secrets.token_hex(32)
    os.environ.update(WARM_MODEL=name, WARM_START_SIZE=size, WARM_START_DTYPE=dtype)
    manifest = os.path.join(work, "model.surgery.toml")
    save_manifest(plan_model("gpu_warm_start:bench_model").manifest, manifest)
    bundle = os.path.join(work, "model.surgery.cache")
    ref = os.path.join(work, "cold_output.pt")
    results: list[dict[str, Any]] = []
    bytecode = bytecode or {"mode": "host", "prefix": None}
    env["WARM_TURNS"] = str(turns)
    env["WARM_RBLOCK_TURNS"] = str(rblock_turns)
    extra = {"cold2": cold2, "warm-mega": mega, "turns": turns > 0,
             "turns-rblock": rblock_turns > 0}
    phases = [p for p in PHASES if p in ("cold", "warm") or extra.get(p)
              or (p == "warm-base" and baseline)
              or (p == "warm-aoti" and aoti) or (p == "warm-host" and
                                                  bytecode["mode"] != "host")]
    for phase in phases:
        cache = os.path.join(work, f"inductor-{phase}")
        penv = {**env, "TORCHINDUCTOR_CACHE_DIR": cache,
                "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        # warm-host: the host's own bytecode (none on an image without .pyc), for the A/B
        mode = "host" if phase == "warm-host" else bytecode["mode"]
        penv = _bytecode.env_for(mode, bytecode["prefix"], penv)
        penv["WARM_START_BYTECODE"] = mode
        res = child_result([__file__, "--phase", phase, "--models", name, "--manifest",
                            manifest, "--bundle", bundle, "--device", device, "--ref", ref,
                            *(["--profile"] if profile else []), *(["--aoti"] if aoti else []),
                            *(["--profile-apply"] if profile_apply else [])],
                           env=penv, timeout=timeout * (2 if phase.startswith("turns") else 1),
                           ident={"model": name, "phase": phase})
        results.append(res)
        if phase in _COLD:  # a deployment has none of the cold host's cache folder: torch's
            shutil.rmtree(cache, ignore_errors=True)  # loader must not find its files there
        if "error" in res:
            break
    if keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return results


def turns_table(results: list[dict[str, Any]]) -> list[str]:
    """The in-turns rows (benchmarks/_warm_turns.py)."""
    rows = []
    for r in results:
        if r.get("phase") == "turns-rblock":
            rows += rblock_lines(r)
        if r.get("phase") != "turns":
            continue
        if "error" in r:
            rows.append(f"{r['model']} turns: failed: {r['error'][:300]}")
            continue
        rows += [
            f"{r['model']} in turns ({r['rounds']} rounds, one process): cold {r['cold_median_ms']}"
            f" ms, warm {r['warm_median_ms']} ms, warm/cold median {r['warm_over_cold_median']} "
            f"(range {r['warm_over_cold_range']}); peak GiB cold {r['cold_peak_gib']} / warm "
            f"{r['warm_peak_gib']} (process {r['process_peak_gib']}); outputs identical "
            f"{r['identical_rounds']}/{r['rounds']} (max abs {r['max_abs_diff']:.2e})",
            f"  the warm model ran the bundle's code: {r['warm_ran_the_bundle']} (precompiled "
            f"installed {r['warm_precompiled_installed']}, compiles {r['warm_compiles']}, "
            f"precompiled runs in the turns {r['warm_precompiled_runs_in_turns']}, graph "
            f"replays in the turns {r.get('warm_replays_in_turns')}, paths that never ran the "
            f"bundle's code {len(r.get('warm_paths_without_precompiled_run', []))}, dynamo frames "
            f"from its apply on {r['dynamo_frames_from_warm_apply']}, artifact guards failed "
            f"{r.get('warm_guards_failed')}); frames to replay cold "
            f"{r['cold_frames_to_replay']}, warm {r['warm_frames_to_replay']}",
            f"  {r['kernels_check']}"]
        if not r["warm_ran_the_bundle"]:
            rows.append("  WARNING: THE WARM MODEL DID NOT (ONLY) RUN THE BUNDLE'S CODE: this is "
                        "not a cold-against-warm figure")
    return rows


def rblock_lines(r: dict[str, Any]) -> list[str]:
    """The R-block A/B row (benchmarks/_warm_turns.run_rblock_turns)."""
    if "error" in r:
        return [f"{r['model']} R-block turns: failed: {r['error'][:300]}"]
    return [f"{r['model']} R-block scaling in turns ({r['rounds']} rounds, one process, two cold "
            f"compiles): off (surgery's default) {r['off_median_ms']} ms, on "
            f"{r['on_median_ms']} ms, on/off median {r['on_over_off_median']} (range "
            f"{r['on_over_off_range']}); peak GiB off {r['off_peak_gib']} / on "
            f"{r['on_peak_gib']}; the reports' dynamic_scale_rblock: off {r['off_scale_rblock']}"
            f" on {r['on_scale_rblock']} ({r['off_compiled_paths']} / {r['on_compiled_paths']} "
            f"compiled paths); outputs identical {r['identical_rounds']}/{r['rounds']}"] + (
        [f"  WARNING: NOT AN A/B OF THE R-BLOCK SETTING: {r['ab_problem']}"]
        if r.get("ab_problem") else [])


def kernel_lines(r: dict[str, Any]) -> list[str]:
    """Same kernels: the census, and against cold (benchmarks/_same_kernels.py)."""
    c = r.get("census") or {}
    rows = [f"  kernels: {c.get('n_code')} output-code modules, {c.get('n_triton')} Triton "
            f"kernels (autotune cache: {c.get('autotune_cache_states')}); region calls digested "
            f"{r.get('regions_digested')}" + (f" (not: {r['regions_not_digested']})"
                                              if r.get("regions_not_digested") else "")]
    if (reg := r.get("regions_vs_cold")) is not None:
        where = (f"first differing call {reg['first_call']} at {reg['first_path']}"
                 if reg.get("differing_calls") else "every region call identical")
        rows.append(f"  regions vs cold: {reg.get('compared')} calls compared, "
                    f"{reg.get('differing_calls', 0)} differ; {where}" + (
                        f"; {reg['note']}" if reg.get("note") else ""))
    if (cen := r.get("census_vs_cold")) is not None:
        rows.append(f"  kernels vs cold: same {cen['same']}; code only cold {cen['code_only_cold']}"
                    f" / only here {cen['code_only_now']}; Triton only cold "
                    f"{cen['triton_only_cold']} / only here {cen['triton_only_now']}; configs "
                    f"differ {cen['n_configs_differ']}: {cen['configs_differ'][:4]}")
    if r.get("kernels_line"):
        rows.append(f"  {r['kernels_line']}")
    return rows


def table(results: list[dict[str, Any]]) -> str:
    turns = turns_table(results)
    results = [r for r in results if not str(r.get("phase")).startswith("turns")]
    rows = ["| model | process | apply -> first replayed frame (s) | frames | apply (s) "
            "| of which bundle checks + Mega-Cache (s) | precompiled load (s) | dynamo tracing (s) "
            "| backend (s) | graph capture (s) | rest: running the frames (s) "
            "| graphs dynamo traced | steady ms/frame | peak GiB | identical to cold "
            "| process start -> first replayed frame (s) | process (s) |",
            "|" + "---|" * 17]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['model']} | {r['phase']} | failed: {r['error'][:160]} |"
                        + " |" * 14)
            continue
        same = "" if r["phase"] == "cold" else \
            ("yes" if r.get("identical_to_cold") else f"no ({r.get('max_abs_diff', 0):.2e})")
        flag = "" if r["replayed"] else " (never replayed)"
        rows.append(
            f"| {r['model']} | {r['phase']} | **{r['first_replay_s']:.2f}**{flag} "
            f"| {r['frames_to_replay']} | {r['apply_s']:.2f} | {r['bundle_s']:.2f} "
            f"| {r['precompiled_load_s']:.2f} | {r['tracing_s']:.2f} | {r['backend_s']:.2f} "
            f"| {r['capture_s']:.2f} | {r['rest_s']:.2f} | {r['dynamo_graphs']} "
            f"| {r['median_ms']:.2f} | {r['peak_gib']} | {same} "
            f"| {r.get('process_to_replay_s', 0):.2f} | {r['process_s']:.1f} |")
    for r in results:
        if "error" in r:
            continue
        rows.append("")
        extra = (f"; bundle {r['bundle_mb']} MB, {r['bundle_precompiled']} precompiled, "
                 f"saved in {r['save_s']} s" if r["phase"] == "cold" else
                 f"; bundle: {r['cache_reason'][:200]}")
        if "aoti_save_s" in r:
            extra += (f"; AOTI bundle {r['aoti_bundle_mb']} MB, {r['aoti_packages']} packages, "
                      f"built in {r['aoti_save_s']} s")
        rows.append(f"{r['model']} {r['phase']}: regions {r['regions']}{extra}")
        if r["phase"] == "warm-aoti" and not r.get("aoti_runners"):
            rows.append("  NO AOTI RUNNER INSTALLED: this row is not an AOTInductor warm start "
                        "(the bundle's notes below say why)")
        if "aoti_packages" in r and not r["aoti_packages"]:
            rows.append("  NO AOTI PACKAGE BUILT (the notes below say why)")
        rows.append(f"  counts: dynamo frames {r.get('dynamo_frames')}, graphs traced "
                    f"{r['dynamo_graphs']}, precompiled installed {r.get('precompiled', 0)} "
                    f"(AOTI runners {r.get('aoti_runners', 0)}), frames to the first replay "
                    f"{r['frames_to_replay']}, modules imported from apply to it "
                    f"{r.get('imported')} ({r.get('pyc_missing')} with no .pyc to load; "
                    f"before apply {r.get('pyc_missing_before_apply')}; bytecode "
                    f"{r.get('bytecode')}; some: {r.get('pyc_missing_some')})")
        if r["phase"] != "cold":
            rows.append(f"  heavy modules imported from apply to the first replay: "
                        f"{r.get('imported_heavy')}")
        for note in r.get("not_precompiled", []) + r.get("not_packaged", []):
            rows.append(f"  not precompiled: {note[:200]}")
        rows.append("  per group: " + "; ".join(
            f"{g['group']} x{g['paths']} (sigs {g['signatures']}, compile {g['compile_s']} s, "
            f"precompiled {g['precompiled']} load {g['load_s']} s, captures {g['captures']} "
            f"in {g['capture_s']} s)" for g in r["groups"]))
        rows += kernel_lines(r)
        rows += _load_lines(r)
    return "\n".join(rows + (["", *turns] if turns else []))


def _load_lines(r: dict[str, Any]) -> list[str]:
    """The precompiled load's breakdown: the loader's one-time set-up, then per artifact its
    seconds, torch's phases (nested as torch nests them), counters and modules imported; then
    the warm apply's profile when --profile ran."""
    rows = []
    if r.get("before_apply"):
        rows.append(f"  before apply_manifest ({r['before_apply_s']} s since the process "
                    f"started), s: {r['before_apply']}")
    if r.get("hashing"):
        rows.append("  hashing from apply to the first replay (s, MB, objects, [thread] caller): "
                    + "; ".join(f"{s} s {mb} MB x{n} {w}" for s, mb, n, w in r["hashing"][:6]))
    if r.get("apply_parts"):
        rows.append(f"  apply_manifest's parts (s): {r['apply_parts']}")
    if setup := r.get("loader_setup"):
        rows.append(f"  loader set-up (once, before any artifact): {setup['seconds']} s "
                    f"{setup['steps']}, {setup['imported']} modules imported"
                    + (f"; keys hashed beside it: {setup['keys']}" if setup.get("keys") else ""))
    for g in r["groups"]:
        for a in g.get("artifacts", []):
            rows.append(f"  load {a['group']}[{a['signature']}]: {a['seconds']} s; phases "
                        f"{a['phases']}; counters {a['counts']}; {a['imported']} modules")
    for key, what in (("profile_first_load", "the first artifact's load"),
                      ("profile_apply", "apply_manifest, whole"),
                      ("profile", "the frames to the first replay")):
        if r.get(key):
            rows.append(f"  {r['phase']}: profile of {what} (cumulative s, own s, calls, "
                        "function):")
            rows += [f"    {c:8.3f} {o:8.3f} {n:6} {w}" for c, o, n, w in r[key]]
    if r.get("profile_apply_callers"):
        rows.append(f"  {r['phase']}: apply_manifest's most own time, and who called it "
                    "(own s, calls, function; cumulative s from each caller):")
        for own, calls, where, by in r["profile_apply_callers"]:
            rows.append(f"    {own:8.3f} {calls:6} {where}")
            rows += [f"        <- {c:8.3f} {w}" for c, w in by]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--size", choices=["lingbot", "tiny"],
                    default=os.environ.get("WARM_START_SIZE", "lingbot"))
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default=os.environ.get("WARM_START_DEVICE", "cuda"))
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--timeout", type=int, default=200, help="per process, seconds")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work folders (manifest, bundle, cache dirs)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the warm process's apply_manifest; print its top functions")
    ap.add_argument("--profile-apply", action="store_true",
                    help="cProfile the warm process's whole apply_manifest (instead of its "
                         "first artifact's load)")
    ap.add_argument("--baseline", action="store_true",
                    help="add a warm process without surgery.runtime.warm_loader's cuts (A/B)")
    ap.add_argument("--aoti", action="store_true",
                    help="add a warm process from a bundle with AOTInductor packages")
    ap.add_argument("--pyc", nargs="?", const="compiled", default="host",
                    choices=_bytecode.MODES,
                    help="bytecode for every timed process: 'compiled' (the flag alone) "
                         "byte-compiles the packages they import into a PYTHONPYCACHEPREFIX "
                         "first, as pip does at install, and adds a warm-host process with the "
                         "host's own bytecode for the A/B; 'none' runs all with no bytecode "
                         "at all (an image without .pyc); 'surgery': the prefix filled by "
                         "`surgery bytecode` (the deployment step); default 'host': as is")
    ap.add_argument("--pyc-dir", default=None,
                    help="with --pyc: the prefix folder to compile into and keep (a later run "
                         "with the same folder reuses it); default: a temporary one")
    ap.add_argument("--cold2", action="store_true",
                    help="add a second cold process: is a cold start deterministic?")
    ap.add_argument("--mega", action="store_true",
                    help="add a warm process with the bundle's precompiled part unused")
    ap.add_argument("--turns", type=int, default=0, metavar="N",
                    help="add one process with a cold and a warm model, N frames each in turns")
    ap.add_argument("--rblock-turns", type=int, default=0, metavar="N",
                    help="add one process with two cold models, R-block scaling off (the "
                         "default) and on, N frames each in turns: the speed A/B")
    ap.add_argument("--scale-rblock", action="store_true",
                    help="every process with inductor's dynamic R-block scaling on (surgery "
                         "turns it off on CUDA: its first-launch pick is cached nowhere); the "
                         "A/B of speed and of warm == cold")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--manifest", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    ap.add_argument("--ref", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.models, args.manifest, args.bundle,
                                   args.device, args.ref, profile=args.profile,
                                   aoti=args.aoti, profile_apply=args.profile_apply)))
        return
    if args.scale_rblock:
        os.environ[_same_kernels.SCALE_RBLOCK_ENV] = "1"  # the child processes inherit it
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown model(s) {bad}; use {', '.join(MODELS)}")
    results: list[dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="warm_start_bytecode_")
    bytecode = prepare_bytecode(args.pyc, models, args.device, work,
                                prefix=os.path.abspath(args.pyc_dir) if args.pyc_dir else None)
    for name in models:
        results += run_model(name, size=args.size, device=args.device, dtype=dtype,
                             timeout=args.timeout, keep=args.keep, profile=args.profile,
                             baseline=args.baseline, aoti=args.aoti,
                             profile_apply=args.profile_apply, bytecode=bytecode,
                             cold2=args.cold2, mega=args.mega, turns=args.turns,
                             rblock_turns=args.rblock_turns)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    rblock = "; dynamic R-block scaling on" if args.scale_rblock else ""
    print(f"## warm start ({args.size}, {dtype}, {args.device}; bytecode {args.pyc}{rblock})\n")
    if bytecode["mode"] == "surgery":
        print(f"bytecode: `surgery bytecode` compiled {bytecode['py_files']} .py files before "
              f"the timed processes (discovery {bytecode['discover_s']} s + compile "
              f"{bytecode['compile_s']} s: a deployment step's cost, not a start's); warm-host "
              f"is the same warm start with the host's own bytecode\n")
    if bytecode["mode"] == "compiled":
        print(f"bytecode: {bytecode['py_files']} .py files of {len(bytecode['roots'])} "
              f"packages compiled before the timed processes (discovery "
              f"{bytecode['discover_s']} s + compileall {bytecode['compile_s']} s: an "
              f"install's cost, not a start's); warm-host is the same warm start with the "
              f"host's own bytecode\n")
    print(table(results))
    print()
    print(json.dumps({"size": args.size, "device": args.device, "dtype": dtype,
                      "bytecode": bytecode, "results": results}))


if __name__ == "__main__":
    main()
