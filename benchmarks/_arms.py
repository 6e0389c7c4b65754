"""What the GPU benchmarks share: every arm in a fresh process that prints its result as one JSON
line, a fresh compile cache per arm, the timing of one call, latency figures, and the largest
relative difference from the eager arm's outputs.

Used by gpu_regions.py, gpu_evidence.py, gpu_zoo.py and gpu_warm_start.py. Imports torch only
inside the functions that need it, so a parent process that only launches arms stays light.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def child_result(argv: list[str], *, env: dict[str, str], timeout: int,
                 ident: dict[str, str]) -> dict[str, Any]:
    """Run one arm as ``python argv...``; its result is the last stdout line that is a JSON
    object. A crash, no output or a timeout becomes ``{**ident, "error": ...}``. Adds the
    process's wall time and echoes the result on stderr as it comes."""
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              timeout=timeout, env=env)
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")),
                    None)
        res = json.loads(line) if line else {
            **ident, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    except subprocess.TimeoutExpired as e:
        res = {**ident, "error": f"timed out after {timeout} s"}
        # How far it got: the last JSON line it printed ({"progress": ...}), if any.
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        last = next((ln for ln in reversed((out or "").splitlines()) if ln.startswith("{")),
                    None)
        if last:
            with contextlib.suppress(ValueError):
                res["progress"] = json.loads(last).get("progress", last)
    res["process_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def fresh_cache_env(tag: str, **extra: str) -> dict[str, str]:
    """This environment plus an inductor and triton cache of its own (under TMPDIR) for one
    arm: every cold start is cold, nothing reused from an earlier arm."""
    cache = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{tag}_{os.getpid()}")
    return {**os.environ, **extra, "TORCHINDUCTOR_CACHE_DIR": cache,
            "TRITON_CACHE_DIR": os.path.join(cache, "triton")}


def run_grid(script: str, tag: str, ref_var: str, models: list[str], arms: list[str],
             n_calls: int, timeout: int) -> list[dict[str, Any]]:
    """Every model x arm of ``script`` (``--model M --arm A --calls N``), each in a fresh
    process with its own compile caches. The arms of one model share one reference file, named
    to the child by ``ref_var``: the eager arm writes it and the others compare with it."""
    tmp = os.environ.get("TMPDIR", "/tmp")
    results = []
    for name in models:
        ref = os.path.join(tmp, f"{tag}_ref_{os.getpid()}_{name}.pt")
        for i, arm in enumerate(arms):
            env = fresh_cache_env(f"{tag}_cache_{name}_{i}", **{ref_var: ref})
            results.append(child_result(
                [script, "--model", name, "--arm", arm, "--calls", str(n_calls)], env=env,
                timeout=timeout, ident={"model": name, "arm": arm}))
    return results


def cold_start_as_before() -> None:
    """The ``*_before`` arms: no light pieces and no early compile pool
    (surgery.runtime.compile_start), as the cold start was before them: every piece compiles
    with the plan's backend, and inductor starts its workers at its first compile."""
    import surgery.runtime.compile_start as compile_start
    import surgery.runtime.piecewise_split as piecewise_split

    if not hasattr(piecewise_split, "light_allowed"):  # a no-op patch would compare nothing
        raise RuntimeError("piecewise_split no longer asks light_allowed: update this arm")
    piecewise_split.light_allowed = lambda *a, **k: False  # type: ignore[assignment]
    compile_start.pool_wanted = lambda *a, **k: False  # type: ignore[assignment]


def pieces_fused() -> None:
    """The ``*_fused`` arms: compile_start's size rule off (``LIGHT_PIECE_ELEMENTS`` 0), so a
    launch-bound piece builds inductor code again unless its share makes it light."""
    import surgery.runtime.compile_start as compile_start

    if not hasattr(compile_start, "LIGHT_PIECE_ELEMENTS"):  # a no-op patch would compare nothing
        raise RuntimeError("compile_start has no LIGHT_PIECE_ELEMENTS: update this arm")
    compile_start.LIGHT_PIECE_ELEMENTS = 0


def print_arm_result(run: Callable[[], dict[str, Any]], ident: dict[str, str]) -> None:
    """In an arm's own process: print ``run()``'s result as one JSON line, or its failure
    (type and first line of the message) as the arm's result, after the traceback on stderr."""
    try:
        res = run()
    except Exception as e:  # the arm's failure is its result
        traceback.print_exc()
        msg = str(e).strip().splitlines()
        res = {**ident, "error": f"{type(e).__name__}: {msg[0] if msg else ''}"}
    print(json.dumps(res), flush=True)


def time_call(fn: Callable[[], Any], *, cuda: bool) -> tuple[Any, float, float]:
    """``(result, ms, host_ms)`` of one call: on a GPU, CUDA events around it and a synchronise
    after (``host_ms`` is the time until the call returned: launches, not work); on the CPU,
    wall time for both."""
    import torch

    if not cuda:
        t = time.perf_counter()
        y = fn()
        ms = (time.perf_counter() - t) * 1e3
        return y, ms, ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    y = fn()
    host = (time.perf_counter() - t) * 1e3
    end.record()
    torch.cuda.synchronize()
    return y, start.elapsed_time(end), host


def latency(times: list[float]) -> dict[str, float]:
    """Median and 90th percentile, in ms, rounded for the table."""
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"median_ms": round(statistics.median(times), 3), "p90_ms": round(q[8], 3)}


def _tensors(outputs: Any) -> list[Any]:
    """The tensors of a list of outputs, each a tensor or a dict of them (in key order)."""
    out = []
    for o in outputs:
        out += [o[k] for k in sorted(o)] if isinstance(o, dict) else [o]
    return out


def against_reference(outputs: list[Any], *, ref_path: str | None,
                      is_reference: bool) -> float | None:
    """The eager arm saves its outputs at ``ref_path``; any other arm gets the largest
    ``|out - ref|.max() / |ref|.max()`` over them (None when there is no reference)."""
    import torch

    if not ref_path:
        return None
    if is_reference:
        torch.save(outputs, ref_path)
        return None
    if not os.path.exists(ref_path):
        return None
    ref = torch.load(ref_path)
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
               for a, b in zip(_tensors(outputs), _tensors(ref), strict=True))


def plan_from_evidence(model: Any, step: Callable[[Any], Any], *, source: str,
                       out: dict[str, Any], autocast: Any = None) -> Any:
    """Plan ``model`` from 6 watched calls of ``step`` (3 timed), as ``surgery plan --input``
    does, with the default compile settings. Records in ``out``: the region paths per kind,
    the eager step's coverage by this plan and by the names-only plan of the same model (the
    same watched run), the hooks' overhead, the largest remainders and how much was left out."""
    from surgery.planning.evidence import coverage
    from surgery.planning.observed import manifest_from_evidence, watch_model
    from surgery.planning.plan import compile_defaults

    w = watch_model(model, step, steps=6, timed_steps=3, autocast=autocast)
    manifest = manifest_from_evidence(w, source=source, compile=compile_defaults())
    cov = manifest.coverage or {}
    out.update(planned=paths_per_kind(manifest), coverage_evidence=cov.get("covered_share"),
               coverage_names=coverage(w.obs, [c.path for c in w.names.regions])
               .get("covered_share"),
               eager_step_ms_hooked=cov.get("step_ms"),
               hook_overhead_ms=cov.get("hook_overhead_ms"),
               remainder=cov.get("remainder", [])[:5], left_out=len(manifest.left_out))
    return manifest


def paths_per_kind(manifest: Any) -> dict[str, int]:
    """Region paths per ``kind:class``, summed over the regions (one per compiled callable)
    that share it."""
    counts: dict[str, int] = {}
    for r in manifest.regions:
        k = f"{r.kind}:{r.module_class or ''}"
        counts[k] = counts.get(k, 0) + len(r.paths)
    return counts
