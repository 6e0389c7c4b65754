"""Region-graph memory on one GPU: eager, whole-model compile and surgery's peaks side by side,
speed beside each, what the region graphs hold (``handle.report.memory``), and what each of
issue 20's changes saved (each can be turned off: surgery.runtime.graphs.arena.POLICY).

Models (one fresh process each; inside it eager first, then surgery's variants one after the
other on the same model, each applied, streamed and restored):

  sdpa     `surgery.examples:lingbot_sdpa` (dim 1024, 24 patch-embed, 24 frame, 24 global
           blocks, DPT head, camera trunk), float32 weights under bf16 autocast, one 378x518
           frame a step: 20 frames to fill the caches, then 24 timed frames
  gpt2     transformers GPT-2 (small config, random weights) through ``generate()``: a 128-token
           prompt, 32 new tokens greedily, 4 timed calls, bf16. That is decode through a growing
           cache (generate's DynamicCache: each new token attends over the cache so far); the ms
           per new token are a whole call's over its 32 tokens, so they include one 128-token
           prefill, and the peak is the call's (prefill included)
  timm_vit, hf_bert   the zoo's small models (benchmarks/gpu_zoo.py), batch 8, bf16

Variants of surgery (the names-only plan, ``apply_manifest`` defaults):
  before   nothing shared: every path its own static inputs and output sets (before issue 20)
  outputs  a path's first output set shared with paths whose outputs are released by then
  all      also the static input buffers shared by layout (the default)

``whole`` (``torch.compile(model)``; for GPT-2 its ``forward``, which ``generate()`` calls, with
dynamic shapes) runs in a process of its own, with ``--whole-timeout`` (150 s). From an empty
stream the SDPA example recompiled the whole model on every frame while its KV caches grew (did
not finish in 530 s, then 60 s, on the H200), so this arm fills them with eager frames first and
compiles the steady state once (run_whole says why). It prints its progress, so a timeout says
how far it got (``progress`` in its result).

Peaks are ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) over the timed
steps, after compile and capture, plus the peak over compile and warm-up; weights included.

Streams (``--streams default,user``: each model once per stream, each a fresh process). ``user``
runs every arm of the process, eager included, under ``torch.cuda.stream(torch.cuda.Stream())``:
surgery then captures on that stream and its graphs share eager's cuBLAS workspace, where on the
default stream they are captured on a side stream whose workspace (33 MiB on an H200) is theirs
alone (surgery.runtime.graphs.capture). Each arm's overhead is over eager's peak on the same
stream; "vs before issue 20" compares with the nothing-shared variant on the default stream.

Routes (``--routes on,off``; default ``on``). On the default stream ``apply_manifest`` routes each
call of the model, whole, onto surgery's side stream (surgery.runtime.stream_route), so the model
and its graphs use that stream's one cuBLAS workspace; ``off`` adds, on the default stream only,
the same variant with ``route_default_stream=False`` (graphs captured on the side stream, the
model on the default one: the code before the route), as ``surgery:VARIANT:unrouted``.

How the peaks are taken, since eager and surgery share a process: cuBLAS keeps a workspace per
stream for the life of the process, so the eager arm's one on the default stream would stay in
every later arm's peak. Before each surgery arm, with no graph alive, the process frees every
cuBLAS workspace (``torch._C._cuda_clearCublasWorkspaces``, what torch's cudagraph trees and test
harness call), so each arm's peak holds the workspaces its own calls make; ``ws_freed_mib`` says
what was freed. After each surgery arm a probe matmul on the default stream says whether the
arm made a workspace there (``default_ws``: "made" when the probe made none).

    python benchmarks/gpu_memory.py --all --models sdpa --variants outputs   # H200: about 3 min
    python benchmarks/gpu_memory.py --all --models gpt2,timm_vit,hf_bert --whole-timeout 0 \
        --streams default,user --variants before,outputs
    python benchmarks/gpu_memory.py --all --models gpt2 --variants before,outputs
    python benchmarks/gpu_memory.py --all --models gpt2,timm_vit,hf_bert --whole-timeout 0 \
        --streams default --variants outputs --routes on,off   # the route against none
    python benchmarks/gpu_memory.py --model sdpa --variants all      # one model, this process
    python benchmarks/gpu_memory.py --all --tiny                     # CPU smoke run (peaks 0)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _arms import child_result, fresh_cache_env, latency, print_arm_result  # noqa: E402

MODELS = ("sdpa", "gpt2", "timm_vit", "hf_bert")
STREAMS = ("default", "user")
ROUTES = ("on", "off")
VARIANTS = {"before": (False, False), "outputs": (True, False), "all": (True, True)}
TINY = os.environ.get("GPU_MEMORY_SIZE") == "tiny"
WARM, TIMED = (2, 3) if TINY else (20, 24)
NEW_TOKENS = 4 if TINY else 32
FILL_CACHES = 20  # eager frames that fill every SDPA cache (camera trunk: 16), at any size
GENERATES = 2 if TINY else 4  # timed generate() calls (ms per token over each)
GIB = 2**30


def gpt2() -> Any:
    """The factory ``plan_model("gpu_memory:gpt2")`` plans."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4) if TINY else GPT2Config())


def sdpa() -> Any:
    from surgery.examples import lingbot_sdpa, tiny_sdpa

    return tiny_sdpa() if TINY else lingbot_sdpa()


class Workload:
    """A model, its step, and how to time it: ``run(call)`` -> per-step ms list."""

    def __init__(self, name: str, device: str) -> None:
        import torch

        self.name, self.device = name, device
        self.cuda = device == "cuda"
        if not self.cuda:  # the CPU machine's torchvision is built for CUDA torch (timm needs it)
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from conftest import _let_torchvision_import_on_cpu_torch

            _let_torchvision_import_on_cpu_torch()
        torch.manual_seed(0)
        if name == "sdpa":
            self.model = sdpa().to(device).eval()  # float32 weights, bf16 autocast
            self.xs = [self.model.example_input(seed=1000 + i) for i in range(8)]
            self.spec = "gpu_memory:sdpa"
        elif name == "gpt2":
            self.model = gpt2().to(device=device, dtype=torch.bfloat16).eval()
            g = torch.Generator().manual_seed(0)
            self.prompt = torch.randint(0, 1000, (1, 16 if TINY else 128), generator=g).to(device)
            self.spec = "gpu_memory:gpt2"
        else:
            os.environ.setdefault("ZOO_SIZE", "tiny" if TINY else "")
            import gpu_zoo

            self.model = getattr(gpu_zoo, name)().to(device=device, dtype=torch.bfloat16).eval()
            self.step, _ = gpu_zoo.driver(name, self.model, device)
            self.spec = f"gpu_zoo:{name}"

    def _sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def warm(self, call: Any) -> None:
        """One step as warm-up (what apply_manifest's warmup= runs)."""
        self.run(call, steps=1, fill=0)

    def run(self, call: Any, *, steps: int = TIMED, fill: int = WARM,
            reset: bool = True) -> list[float]:
        """``fill`` untimed steps, then ``steps`` timed; the SDPA stream starts afresh unless
        ``reset`` is False (its caches then keep what earlier calls put in them)."""
        import torch

        times = []
        if self.name == "gpt2":  # each step is a whole generate() of NEW_TOKENS tokens
            steps = min(steps, GENERATES)
        if self.name == "sdpa":
            if reset:
                self.model.reset_stream()
            ac = torch.autocast(self.device, dtype=torch.bfloat16)
            with torch.no_grad():
                for i in range(fill + steps):
                    self._sync()
                    t = time.perf_counter()
                    with ac:
                        call(self.xs[i % len(self.xs)])
                    self._sync()
                    if i >= fill:
                        times.append((time.perf_counter() - t) * 1e3)
            return times
        with torch.inference_mode():
            for _ in range(steps):
                self._sync()
                t = time.perf_counter()
                if self.name == "gpt2":
                    gen = getattr(call, "generate", None) or self.model.generate
                    gen(self.prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        do_sample=False, pad_token_id=0)
                    self._sync()
                    times.append((time.perf_counter() - t) * 1e3 / NEW_TOKENS)
                else:
                    self.step(call)
                    self._sync()
                    times.append((time.perf_counter() - t) * 1e3)
        return times


def _peaks(cuda: bool) -> dict[str, float]:
    import torch

    if not cuda:
        return {"peak_gib": 0.0, "peak_mib": 0.0, "reserved_gib": 0.0}
    peak = torch.cuda.max_memory_allocated()
    return {"peak_gib": round(peak / GIB, 3), "peak_mib": round(peak / 2**20, 1),
            "reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3)}


def _reset_peaks(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _speed(times: list[float]) -> dict[str, float]:
    return latency(times)


def on_stream(stream: str) -> contextlib.AbstractContextManager[Any]:
    """Where every arm of this process runs: the default stream, or a stream of its own."""
    import torch

    if stream == "user" and torch.cuda.is_available():
        return torch.cuda.stream(torch.cuda.Stream())
    return contextlib.nullcontext()


def run_model(name: str, variants: list[str], stream: str = "default",
              routes: tuple[str, ...] = ("on",)) -> dict[str, Any]:
    """Eager, then each surgery variant, in this process, on the same model and stream."""
    with on_stream(stream):
        arms = [(v, r) for v in variants for r in routes if r == "on" or stream == "default"]
        return {**_run_model(name, arms), "stream": stream}


def free_workspaces(cuda: bool) -> float | None:
    """Free every cuBLAS workspace when no region graph is alive (graphs keep using theirs);
    the MiB freed, or None when not freed."""
    import torch

    from surgery.runtime import apply as apply_mod

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if not cuda or clear is None or any(getattr(c, "live", 0) for c in
                                        apply_mod._CAPTURERS.values()):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    clear()
    return round((before - torch.cuda.memory_allocated()) / 2**20, 1)


def cross_stream_replays() -> int:
    """Replays so far of graphs on another stream than their capture's (each waits both ways)."""
    from surgery.runtime import apply as apply_mod

    return sum(int(getattr(c, "cross_stream_replays", 0)) for c in apply_mod._CAPTURERS.values())


def default_workspace_made(cuda: bool) -> str:
    """Whether the default stream had a cuBLAS workspace: a first matmul there makes one."""
    import torch

    if not cuda:
        return ""
    with torch.cuda.stream(torch.cuda.default_stream()):
        a = torch.ones(64, 64, device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        b = a @ a
        torch.cuda.synchronize()
        grew = torch.cuda.memory_allocated() - before - b.nbytes
    return "none" if grew > 2**20 else "made"


def _run_model(name: str, arms: list[tuple[str, str]]) -> dict[str, Any]:
    import torch

    from surgery import apply_manifest
    from surgery.planning.plan import plan_model
    from surgery.runtime.graphs import arena

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    w = Workload(name, dev)
    out: dict[str, Any] = {"model": name, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                           "torch": torch.__version__}
    out["weights_gib"] = round(torch.cuda.memory_allocated() / GIB, 3) if cuda else 0.0
    w.run(w.model, steps=1, fill=0)  # lazy inits (cuBLAS, autocast caches) out of every peak
    _reset_peaks(cuda)
    eager = {"arm": "eager", **_speed(w.run(w.model)), **_peaks(cuda)}
    out["arms"] = [eager]
    t = time.perf_counter()
    manifest = plan_model(w.spec).manifest
    out["plan_s"] = round(time.perf_counter() - t, 2)
    out["paths"] = sum(len(r.paths) for r in manifest.regions)
    overrides = None if cuda else {"on_cpu": "compile", "backend": "aot_eager"}
    for v, route in arms:
        arena.POLICY.share_outputs, arena.POLICY.share_inputs = VARIANTS[v]
        freed = free_workspaces(cuda)  # each arm's peak holds the workspaces it makes
        _reset_peaks(cuda)
        t = time.perf_counter()
        handle = apply_manifest(w.model, manifest, warmup=w.warm, passes=3, overrides=overrides,
                                route_default_stream=route == "on")
        cold = time.perf_counter() - t
        compile_peak = _peaks(cuda)["peak_gib"]
        w.run(w.model, steps=2)  # the steady state: rings grown, every signature captured
        _reset_peaks(cuda)
        crossed = cross_stream_replays()
        times = w.run(w.model)
        crossed = cross_stream_replays() - crossed  # replays that waited both ways: 0 expected
        mem = handle.report.memory
        counts = handle.report.counts()
        res = {"arm": f"surgery:{v}" + ("" if route == "on" else ":unrouted"),
               **_speed(times), **_peaks(cuda), "ws_freed_mib": freed,
               "routed_calls": handle.route.calls if handle.route is not None else 0,
               "compile_peak_gib": compile_peak, "cold_s": round(cold, 1),
               "regions": f"{counts['compiled']}/{len(handle.report)}",
               "graphs_gib": round(mem.total / GIB, 4), "outputs_gib": round(mem.outputs / GIB, 4),
               "static_inputs_gib": round(mem.static_inputs / GIB, 4),
               "pool_gib": round(mem.pool / GIB, 4),
               "capture_stream_gib": round(mem.capture_stream / GIB, 4),
               "captures_side_caller": [mem.side_captures, mem.caller_captures],
               "captures_routed": mem.routed_captures, "cross_stream_replays": crossed,
               "memory_line": mem.line(),
               "output_sets": sum(p.output_sets for p in mem.paths),
               "largest_paths": [[p.path, round((p.outputs + p.static_inputs) / 2**20, 1)]
                                 for p in sorted(mem.paths, key=lambda p: -(p.outputs +
                                                                           p.static_inputs))[:3]]}
        handle.restore()
        del handle, mem
        res["default_ws"] = default_workspace_made(cuda)  # after the peaks were read
        out["arms"].append(res)
        print(json.dumps(res), file=sys.stderr, flush=True)
    return out


def _progress(what: str, t0: float) -> None:
    """One JSON line on stdout: how far the arm got (child_result keeps it on a timeout)."""
    print(json.dumps({"progress": f"{what} at {time.perf_counter() - t0:.1f} s"}), flush=True)


def run_whole(name: str, stream: str = "default") -> dict[str, Any]:
    """The whole-model arm on the given stream (_run_whole)."""
    with on_stream(stream):
        return {**_run_whole(name), "stream": stream}


def _run_whole(name: str) -> dict[str, Any]:
    """torch.compile of the whole model (for GPT-2: of its forward, which generate() calls).

    The SDPA example's KV caches are Python lists (4 frames in the global blocks, 16 in the
    camera trunk) and dynamo specializes on a list's length: compiled from an empty stream, the
    whole model recompiled on every frame while they grew (about a minute each on the H200,
    and past torch's recompile limit of 8 a frame runs eager). So this arm fills the caches
    with eager frames first and compiles the steady state once, at fixed lengths: its peak and
    speed are those of the steady stream, as the other arms' are; its cold start is one
    compile, not the growing frames'. Its frame counter is made a symbolic int (below), from the
    first compile where torch has ``dynamic_sources``. GPT-2's sequence grows every token:
    dynamic shapes."""
    import torch
    from torch._dynamo.utils import counters

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    t0 = time.perf_counter()
    w = Workload(name, dev)
    w.run(w.model, steps=1, fill=0)  # lazy inits out of the peaks, as in run_model
    steady = name == "sdpa"
    if steady:  # every cache full: their lengths stay fixed from here (see above)
        w.run(w.model, steps=0, fill=FILL_CACHES)
    _progress("model built" + (", caches filled by eager frames" if steady else ""), t0)
    _reset_peaks(cuda)
    t = time.perf_counter()
    backend = "inductor" if cuda else "aot_eager"  # the CPU smoke run checks the arm, fast
    # The example counts its frames in an int attribute (frames_seen), on which dynamo
    # specializes by default: a whole-model recompile every frame, then eager past the limit.
    # torch's own hint for that is this flag (the counter becomes a symbolic int).
    if hasattr(torch._dynamo.config, "allow_unspec_int_on_nn_module"):
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # Without this the first compile specializes on the counter's value and the next frame
    # compiles the whole model again (about a minute at LingBot size); a toy module with the
    # same counter compiles 1 graph with it, 2 without (torch 2.14, aot_eager). The exact source
    # name, and a pattern for a torch that names it otherwise (2.14 takes either).
    if name == "sdpa" and hasattr(torch.compiler.config, "dynamic_sources"):
        torch.compiler.config.dynamic_sources = "L['self'].frames_seen,.*frames_seen"
    if name == "gpt2":
        w.model.forward = torch.compile(w.model.forward, dynamic=True, backend=backend)
        call: Any = w.model
    else:
        call = torch.compile(w.model, backend=backend)
    for i in range(2):
        w.run(call, steps=1, fill=0, reset=not steady)
        _progress(f"warm-up step {i + 1} done ({counters['stats']['unique_graphs']} graphs)", t0)
    cold = time.perf_counter() - t
    compile_peak = _peaks(cuda)["peak_gib"]
    w.run(call, steps=1, fill=1, reset=not steady)
    _progress("steady state reached", t0)
    _reset_peaks(cuda)
    times = w.run(call, fill=0 if steady else WARM, reset=not steady)
    return {"model": name, "arm": "whole", **_speed(times), **_peaks(cuda),
            "compile_peak_gib": compile_peak, "cold_s": round(cold, 1),
            "graphs": counters["stats"]["unique_graphs"]}


def run_all(models: list[str], variants: list[str], timeout: int, whole_timeout: int,
            streams: tuple[str, ...] = ("default",), routes: tuple[str, ...] = ("on",)
            ) -> list[dict[str, Any]]:
    """Each model on each stream: its eager and surgery arms in one fresh process, then the
    whole-model arm in another."""
    results = []
    for name in models:
        for stream in streams:
            tag = f"{name}_{stream}"
            ident = {"model": name, "stream": stream}
            res = child_result([__file__, "--model", name, "--variants", ",".join(variants),
                                "--stream", stream, "--routes", ",".join(routes)],
                               env=fresh_cache_env(f"gpu_memory_{tag}"), timeout=timeout,
                               ident=ident)
            arms = res.pop("arms", [])
            if whole_timeout > 0:
                whole = child_result([__file__, "--model", name, "--whole", "--stream", stream],
                                     env=fresh_cache_env(f"gpu_memory_whole_{tag}"),
                                     timeout=whole_timeout, ident={**ident, "arm": "whole"})
                arms.insert(1, whole)
            res["arms"] = arms
            res.setdefault("stream", stream)
            results.append(res)
    return results


def _overhead_mib(arm: dict[str, Any], eager: dict[str, Any]) -> float | None:
    """The arm's steady peak over eager's, in MiB (None without both peaks)."""
    if not eager.get("peak_mib") or "peak_mib" not in arm:
        return None
    return float(arm["peak_mib"] - eager["peak_mib"])


def _vs_before(mine: float | None, arm: dict[str, Any], then: float | None) -> str:
    """A surgery variant's overhead over eager's peak against the nothing-shared variant's on
    the default stream (the code before issue 20): "less than half of today's" reads off it."""
    if mine is None or then is None or not arm["arm"].startswith("surgery:"):
        return ""
    if then <= 0:
        return f"before was {then:+.0f} MiB (under eager's peak)"
    return f"{mine / then:.2f}x ({mine:+.0f} vs {then:+.0f} MiB)"


def _arm(results: list[dict[str, Any]], model: str, stream: str, arm: str) -> dict[str, Any]:
    r = next((r for r in results if r.get("model") == model and r.get("stream") == stream), {})
    return next((a for a in r.get("arms", []) if a.get("arm") == arm), {})


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| model | stream | arm | ms (median) | p90 | vs eager | peak GiB (steady) "
            "| over eager's peak | overhead vs before issue 20 | reserved GiB | region graphs hold "
            "(MiB): outputs / static inputs / pool / capture stream | captures side / caller / "
            "routed (default stream's workspace) | cold s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name, stream = r["model"], r.get("stream", "default")
        if "error" in r:
            rows.append(f"| {name} | {stream} | failed: {r['error'][:160]} |||||||||||")
            continue
        eager = _arm(results, name, stream, "eager")
        # Before issue 20: nothing shared, on the default stream (else on this stream).
        # Unrouted when that arm ran: the code before issue 20 had no stream route.
        old = next((n for n in ("surgery:before:unrouted", "surgery:before")
                    if _arm(results, name, "default", n)), None)
        was = "default" if old else stream
        before = _arm(results, name, was, old or "surgery:before")
        then = _overhead_mib(before, _arm(results, name, was, "eager"))
        for a in r["arms"]:
            if "error" in a:
                why = a["error"][:120] + (f" ({a['progress']})" if a.get("progress") else "")
                rows.append(f"| {name} | {stream} | {a.get('arm')} | failed: {why} ||||||||||")
                continue
            speed = (f"{eager['median_ms'] / a['median_ms']:.2f}x" if eager.get("median_ms")
                     else "")
            over = _overhead_mib(a, eager)
            peak = (f"{over:+.0f} MiB ({a['peak_mib'] / eager['peak_mib'] - 1:+.1%})"
                    if over is not None and a is not eager else "")
            if peak and "ws_freed_mib" in a and a["ws_freed_mib"] is None:
                peak += " (workspaces not freed: eager's may be in it)"
            vs = "" if a is before else _vs_before(over, a, then)
            mib = GIB / 2**20
            held = (f"{a['graphs_gib'] * mib:.1f}: {a['outputs_gib'] * mib:.1f} / "
                    f"{a['static_inputs_gib'] * mib:.1f} / {a['pool_gib'] * mib:.1f} / "
                    f"{a.get('capture_stream_gib', 0.0) * mib:.1f}"
                    if "graphs_gib" in a else "")
            counts = [*a.get("captures_side_caller", []), a.get("captures_routed", 0)]
            caps = " / ".join(map(str, counts)) if "captures_side_caller" in a else ""
            if caps and not any(counts):  # an empty result is not a figure
                caps = "**none captured**" + (" (no CUDA)" if r.get("gpu") == "cpu" else "")
            if a.get("default_ws"):
                caps += f" ({a['default_ws']})"
            if a.get("cross_stream_replays"):
                caps += f"; {a['cross_stream_replays']} cross-stream replays"
            rows.append(f"| {name} | {stream} | {a['arm']} | {a['median_ms']:.2f} "
                        f"| {a['p90_ms']:.2f} | {speed} | {a['peak_gib']:.3f} | {peak} | {vs} "
                        f"| {a['reserved_gib']:.3f} | {held} | {caps} | {a.get('cold_s', '')}"
                        + (f" ({a['graphs']} graph(s))" if "graphs" in a else "") + " |")
    return "\n".join(rows)


def _names(text: str, allowed: tuple[str, ...], what: str, ap: argparse.ArgumentParser
           ) -> list[str]:
    names = [v for v in text.split(",") if v]
    bad = sorted(set(names) - set(allowed))
    if bad or not names:
        ap.error(f"unknown {what}(s) {bad or text!r}; choose from {', '.join(allowed)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every model, each in a fresh process")
    ap.add_argument("--model", choices=MODELS)
    ap.add_argument("--models", help="comma-separated subset for --all")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"surgery variants, comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--stream", choices=STREAMS, default="default",
                    help="with --model: run every arm on the default stream or on a stream of "
                         "its own")
    ap.add_argument("--streams", default="default",
                    help="for --all: comma-separated streams (default,user), each model on each")
    ap.add_argument("--routes", default="on",
                    help="comma-separated of on,off: surgery with the stream route, and (on the "
                         "default stream) without it")
    ap.add_argument("--whole", action="store_true", help="with --model: the whole-model arm")
    ap.add_argument("--whole-timeout", type=int, default=150,
                    help="seconds for each whole-model arm (0: skip it)")
    ap.add_argument("--timeout", type=int, default=200, help="per model, seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.tiny and not TINY:  # the size is read at import: re-run with it set
        os.environ["GPU_MEMORY_SIZE"] = "tiny"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    variants = _names(args.variants, tuple(VARIANTS), "variant", ap)
    streams = tuple(_names(args.streams, STREAMS, "stream", ap))
    routes = tuple(_names(args.routes, ROUTES, "route", ap))
    if args.model and not args.all:
        ident = {"model": args.model, "stream": args.stream}
        if args.whole:
            print_arm_result(lambda: run_whole(args.model, args.stream), {**ident, "arm": "whole"})
        else:
            print_arm_result(lambda: run_model(args.model, variants, args.stream, routes), ident)
        return
    if not args.all:
        ap.error("give --all, or --model")
    models = _names(args.models, MODELS, "model", ap) if args.models else list(MODELS)
    results = run_all(models, variants, args.timeout, args.whole_timeout, streams, routes)
    print(table(results))
    for r in results:
        for a in r.get("arms", []):
            if "memory_line" in a:
                print(f"{r['model']} ({r.get('stream', 'default')} stream) {a['arm']}: "
                      f"{a['memory_line']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
