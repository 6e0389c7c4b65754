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

``whole`` (``torch.compile(model)``; for GPT-2 ``torch.compile(model.forward, dynamic=True)``, as a
user compiles for generate()'s growing cache, no CUDA graphs) runs in a process of its own, with
``--whole-timeout`` (150 s). The SDPA example fills its caches with eager frames first and
compiles the steady state once (run_whole says why). The backend is watched
(benchmarks/_whole.py): each compiled graph prints a progress line with its operator count, so
a timeout says how far the compile got, and the result has the graphs, operators, graph breaks
and the backend's seconds. ``--deep`` builds the models at their real depth and tiny width: a
CPU run then counts the graphs and operators the H200 compiles (1 graph of 5868 operators for
SDPA, 2 of 615 and 566 for GPT-2), from which its compile time is estimated.

``--ab ROUNDS`` times each surgery arm again in ROUNDS turns with an eager twin (shared weights)
in the same process, after its peaks were read (benchmarks/_turns.py), and prints each variant's
speed against the code before issue 20 (``before:unrouted``) in the same turns. Every timed arm
runs with inductor's compile workers stopped.

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

    python benchmarks/gpu_memory.py --all --models sdpa --variants before:unrouted,outputs --ab 5
    python benchmarks/gpu_memory.py --all --models gpt2 --variants before:unrouted,outputs --ab 7
    python benchmarks/gpu_memory.py --all --models gpt2,timm_vit,hf_bert --whole-timeout 0 \
        --streams default,user --variants before,outputs
    python benchmarks/gpu_memory.py --all --models gpt2 --variants before,outputs
    python benchmarks/gpu_memory.py --all --models gpt2,timm_vit,hf_bert --whole-timeout 0 \
        --streams default --variants outputs --routes on,off   # the route against none
    python benchmarks/gpu_memory.py --model sdpa --variants all      # one model, this process
    python benchmarks/gpu_memory.py --all --tiny                     # CPU smoke run (peaks 0)
    python benchmarks/gpu_memory.py --model sdpa --whole --deep      # the H200's graph counts
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
from _turns import eager_twin, take_turns  # noqa: E402
from _whole import WatchedBackend, graph_breaks, progress, stop_compile_workers  # noqa: E402

MODELS = ("sdpa", "gpt2", "timm_vit", "hf_bert")
STREAMS = ("default", "user")
ROUTES = ("on", "off")
VARIANTS = {"before": (False, False), "outputs": (True, False), "all": (True, True)}
SIZE = os.environ.get("GPU_MEMORY_SIZE", "")
# "deep": the models' real depth (24 blocks of each kind, 12 GPT-2 layers, 128-token prompt, 32
# new tokens) at tiny width, so that a CPU run counts the graphs and operators the H200 compiles.
DEEP = SIZE == "deep"
TINY = SIZE in ("tiny", "deep")
WARM, TIMED = (2, 3) if TINY else (20, 24)
NEW_TOKENS = 4 if TINY and not DEEP else 32
FILL_CACHES = 20  # eager frames that fill every SDPA cache (camera trunk: 16), at any size
GENERATES = 2 if TINY else 4  # timed generate() calls (ms per token over each)
GIB = 2**30
AB_STEPS = 4  # steps of each side's turn with --ab (GPT-2: generate() calls, capped at GENERATES)


def gpt2() -> Any:
    """The factory ``plan_model("gpu_memory:gpt2")`` plans."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if DEEP:
        return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=12, n_head=4))
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4) if TINY else GPT2Config())


def sdpa() -> Any:
    from surgery.examples.sdpa import LINGBOT_SDPA, SdpaConfig, SdpaExampleModel

    if DEEP:  # LingBot depth and windows, test width and frame size
        return SdpaExampleModel(SdpaConfig(depth=LINGBOT_SDPA.depth,
                                           camera_depth=LINGBOT_SDPA.camera_depth))
    return SdpaExampleModel(SdpaConfig() if TINY else LINGBOT_SDPA)


class Workload:
    """A model, its step, and how to time it: ``run(call)`` -> per-step ms list."""

    def __init__(self, name: str, device: str) -> None:
        import torch

        self.name, self.device = name, device
        self.cuda = device == "cuda"
        if not self.cuda:  # the CPU machine's torchvision is built for CUDA torch (timm needs it)
            # One thread: on the shared 2-core CPU, two spinning threads made eager frames 5-10x
            # slower (the smoke runs' figures are not timings anyway, only that they finish).
            torch.set_num_threads(1)
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
            prompt = 16 if TINY and not DEEP else 128
            self.prompt = torch.randint(0, 1000, (1, prompt), generator=g).to(device)
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
            if reset:  # the stream of the model called (an eager twin has its own)
                getattr(call, "reset_stream", self.model.reset_stream)()
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


def surgery_arms(variants: list[str], routes: tuple[str, ...], stream: str
                 ) -> list[tuple[str, str]]:
    """(variant, route) of each surgery arm, in order: a variant named ``V:unrouted`` runs
    unrouted only; any other runs once per route (``off`` only on the default stream, where
    there is a route to leave out)."""
    arms = []
    for v in variants:
        base, _, only = v.partition(":")
        for r in ("off",) if only == "unrouted" else routes:
            if (r == "on" or stream == "default") and (base, r) not in arms:
                arms.append((base, r))
    return arms


def run_model(name: str, variants: list[str], stream: str = "default",
              routes: tuple[str, ...] = ("on",), ab: int = 0) -> dict[str, Any]:
    """Eager, then each surgery variant, in this process, on the same model and stream (and,
    with ``ab`` rounds, each variant's speed in turns with an eager twin)."""
    with on_stream(stream):
        arms = surgery_arms(variants, routes, stream)
        return {**_run_model(name, arms, ab), "stream": stream}


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


def _run_model(name: str, arms: list[tuple[str, str]], ab: int = 0) -> dict[str, Any]:
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
    twin = None
    if ab:  # before any surgery: shares the weights, its own stream state (_turns)
        getattr(w.model, "reset_stream", lambda: None)()
        twin = eager_twin(w.model)  # its caches stay empty until its first turn
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
        stopped = stop_compile_workers()  # no worker pool beside the timed steps (_whole)
        _reset_peaks(cuda)
        crossed = cross_stream_replays()
        times = w.run(w.model)
        crossed = cross_stream_replays() - crossed  # replays that waited both ways: 0 expected
        mem = handle.report.memory
        counts = handle.report.counts()
        res = {"arm": f"surgery:{v}" + ("" if route == "on" else ":unrouted"),
               **_speed(times), **_peaks(cuda), "ws_freed_mib": freed,
               "workers_stopped": stopped,
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
        if twin is not None:  # speed in turns with eager, the peaks already read
            w.run(twin, steps=0, fill=FILL_CACHES if name == "sdpa" else 0)  # its stream
            res.update(take_turns(lambda m: w.run(m, steps=AB_STEPS, fill=0, reset=False),
                                  w.model, twin, ab))
            # The twin's KV caches (about 0.4 GiB for SDPA at LingBot size) out of the next
            # arm's peaks.
            getattr(twin, "reset_stream", lambda: None)()
        handle.restore()
        del handle, mem
        res["default_ws"] = default_workspace_made(cuda)  # after the peaks were read
        out["arms"].append(res)
        print(json.dumps(res), file=sys.stderr, flush=True)
    return out


def counter_is_symbolic() -> bool:
    """Whether this torch's ``dynamic_sources`` keeps a module's frame counter from recompiling:
    a toy module counting its calls, compiled and called 3 times, makes one graph."""
    import torch

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frames_seen = 0

        def forward(self, x: Any) -> Any:
            self.frames_seen += 1
            return x * self.frames_seen

    graphs: list[int] = []

    def count(gm: Any, example_inputs: Any) -> Any:
        graphs.append(1)
        return gm.forward

    toy = torch.compile(Counter(), backend=count)
    for _ in range(3):
        toy(torch.ones(2))
    return len(graphs) == 1


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
    first compile where torch has ``dynamic_sources``.

    GPT-2's sequence grows every token, so its forward is compiled as a user compiles it for a
    growing DynamicCache: ``torch.compile(model.forward, dynamic=True)``, no CUDA graphs. That
    is two graphs, the prefill (no cache yet) and the decode step (the cache's length symbolic),
    and no recompile as the cache grows (the CPU run counts them).

    The backend is watched (_whole.WatchedBackend): each graph prints a progress line with its
    operator count and backend seconds as it is done, and the result carries them, so a timeout
    still says how far the compile got."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    t0 = time.perf_counter()
    w = Workload(name, dev)
    w.run(w.model, steps=1, fill=0)  # lazy inits out of the peaks, as in run_model
    steady = name == "sdpa"
    if steady:  # every cache full: their lengths stay fixed from here (see above)
        w.run(w.model, steps=0, fill=FILL_CACHES)
    progress("model built" + (", caches filled by eager frames" if steady else ""), t0)
    _reset_peaks(cuda)
    t = time.perf_counter()
    backend = WatchedBackend("inductor" if cuda else "aot_eager", t0=t0)  # CPU: fast, same graphs
    # The example counts its frames in an int attribute (frames_seen), on which dynamo
    # specializes by default: a whole-model recompile every frame, then eager past the limit.
    # ``dynamic_sources`` makes that one int symbolic from the first compile (the exact source
    # name, and a pattern for a torch that names it otherwise). Where it does not take on this
    # torch (a toy counter probed first), the fallback is torch's own hint for it,
    # ``allow_unspec_int_on_nn_module``, which makes EVERY int attribute of every module
    # symbolic: on GPT-2 that made dynamo's trace grow much faster than its depth (this CPU: 4
    # layers 54 s against 12 s without it, 12 layers 949 s against 110 s), so it is set only
    # where needed.
    unspec = False
    if name == "sdpa":
        if hasattr(torch.compiler.config, "dynamic_sources"):
            torch.compiler.config.dynamic_sources = "L['self'].frames_seen,.*frames_seen"
        if not counter_is_symbolic() and hasattr(torch._dynamo.config,
                                                 "allow_unspec_int_on_nn_module"):
            torch._dynamo.config.allow_unspec_int_on_nn_module = unspec = True
    if name == "gpt2":
        w.model.forward = torch.compile(w.model.forward, dynamic=True, backend=backend)
        call: Any = w.model
    else:
        call = torch.compile(w.model, backend=backend)
    first = 0.0
    for i in range(2):
        s = time.perf_counter()
        w.run(call, steps=1, fill=0, reset=not steady)
        first = first or time.perf_counter() - s
        progress(f"warm-up step {i + 1} done ({len(backend.graphs)} graph(s))", t0)
    cold = time.perf_counter() - t
    compile_peak = _peaks(cuda)["peak_gib"]
    w.run(call, steps=1, fill=1, reset=not steady)
    stopped = stop_compile_workers()  # no worker pool beside the timed steps (_whole says why)
    warm_graphs = len(backend.graphs)
    progress("steady state reached", t0)
    _reset_peaks(cuda)
    times = w.run(call, fill=0 if steady else WARM, reset=not steady)
    if len(backend.graphs) != warm_graphs:  # a recompile inside the timed steps: say so
        progress(f"{len(backend.graphs) - warm_graphs} graph(s) compiled while timed", t0)
    return {"model": name, "arm": "whole", **_speed(times), **_peaks(cuda),
            "compile_peak_gib": compile_peak, "cold_s": round(cold, 1),
            "first_call_s": round(first, 1), **backend.summary(),
            "graphs_while_timed": len(backend.graphs) - warm_graphs,
            "graph_breaks": graph_breaks(), "workers_stopped": stopped,
            "unspec_int_attributes": unspec,
            "process_to_timed_s": round(time.perf_counter() - t0, 1)}


def run_all(models: list[str], variants: list[str], timeout: int, whole_timeout: int,
            streams: tuple[str, ...] = ("default",), routes: tuple[str, ...] = ("on",),
            ab: int = 0) -> list[dict[str, Any]]:
    """Each model on each stream: its eager and surgery arms in one fresh process, then the
    whole-model arm in another."""
    results = []
    for name in models:
        for stream in streams:
            tag = f"{name}_{stream}"
            ident = {"model": name, "stream": stream}
            res = child_result([__file__, "--model", name, "--variants", ",".join(variants),
                                "--stream", stream, "--routes", ",".join(routes),
                                "--ab", str(ab)],
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
            if "ab_speedup" in a:  # the figure to trust: taken in turns with eager (_turns)
                lo, hi = min(a["ab_round_speedups"]), max(a["ab_round_speedups"])
                speed += (f"; in turns {a['ab_speedup']:.2f}x ({lo:.2f}-{hi:.2f}, "
                          f"{a['ab_rounds']} rounds)")
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
                        + _compiled(a) + " |")
    return "\n".join(rows + _against_before(results))


def _against_before(results: list[dict[str, Any]]) -> list[str]:
    """Lines under the table: each variant's speed in turns with eager, against the code
    before issue 20's (nothing shared, unrouted) in the same process; the target is >= 0.95."""
    lines = []
    for r in results:
        arms = {a.get("arm"): a for a in r.get("arms", []) if "ab_speedup" in a}
        old = arms.get("surgery:before:unrouted") or arms.get("surgery:before")
        for name, a in arms.items():
            if old is None or a is old:
                continue
            ratio = a["ab_speedup"] / old["ab_speedup"]
            lines.append(f"\n{r['model']} ({r.get('stream', 'default')} stream): {name} in turns "
                         f"with eager {a['ab_speedup']:.3f}x against {old['arm']}'s "
                         f"{old['ab_speedup']:.3f}x: {ratio:.3f} of its speed "
                         f"({'within' if ratio >= 0.95 else 'MORE than'} the 5% allowed)")
    return lines


def _compiled(a: dict[str, Any]) -> str:
    """What the whole arm compiled: graphs, their operator nodes, the backend's seconds."""
    if "graphs" not in a:
        return ""
    if not a["graphs"]:
        return " (**0 graphs compiled**)"
    more = f"; {a['graphs_while_timed']} while timed" if a.get("graphs_while_timed") else ""
    return (f" ({a['graphs']} graph(s), {a.get('ops', '?')} ops, backend "
            f"{a.get('backend_s', '?')} s{more})")


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
                    help=f"surgery variants, comma-separated, of {', '.join(VARIANTS)}; "
                         "V:unrouted runs V without the stream route only")
    ap.add_argument("--stream", choices=STREAMS, default="default",
                    help="with --model: run every arm on the default stream or on a stream of "
                         "its own")
    ap.add_argument("--streams", default="default",
                    help="for --all: comma-separated streams (default,user), each model on each")
    ap.add_argument("--routes", default="on",
                    help="comma-separated of on,off: surgery with the stream route, and (on the "
                         "default stream) without it")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="also time each surgery arm in ROUNDS turns with an eager twin in the "
                         "same process (speed only; benchmarks/_turns.py)")
    ap.add_argument("--whole", action="store_true", help="with --model: the whole-model arm")
    ap.add_argument("--whole-timeout", type=int, default=150,
                    help="seconds for each whole-model arm (0: skip it)")
    ap.add_argument("--timeout", type=int, default=200, help="per model, seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--deep", action="store_true",
                    help="the models' real depth at tiny width (a CPU run that counts the "
                         "graphs and operators the H200 compiles)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    want = "deep" if args.deep else "tiny" if args.tiny else SIZE
    if want != SIZE:  # the size is read at import: re-run with it set
        os.environ["GPU_MEMORY_SIZE"] = want
        os.execv(sys.executable, [sys.executable, *sys.argv])
    variants = _names(args.variants, (*VARIANTS, *(f"{v}:unrouted" for v in VARIANTS)),
                      "variant", ap)
    streams = tuple(_names(args.streams, STREAMS, "stream", ap))
    routes = tuple(_names(args.routes, ROUTES, "route", ap))
    if args.model and not args.all:
        ident = {"model": args.model, "stream": args.stream}
        if args.whole:
            print_arm_result(lambda: run_whole(args.model, args.stream), {**ident, "arm": "whole"})
        else:
            print_arm_result(lambda: run_model(args.model, variants, args.stream, routes,
                                               args.ab), ident)
        return
    if not args.all:
        ap.error("give --all, or --model")
    models = _names(args.models, MODELS, "model", ap) if args.models else list(MODELS)
    results = run_all(models, variants, args.timeout, args.whole_timeout, streams, routes,
                      args.ab)
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
