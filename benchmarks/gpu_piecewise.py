"""Piecewise streaming blocks (issue 19): the SDPA example at LingBot size and GPT-2 decoding.

Arms (each in a fresh process with a fresh inductor cache, all in one call):
  sdpa_eager      surgery.examples:lingbot_sdpa as it is (bf16 autocast, one frame a step)
  sdpa_names      `surgery plan --model` (names only), apply_manifest defaults
  sdpa_piecewise  `surgery plan --model --piecewise`: the 24 global blocks and the 4 camera
                  trunk blocks (`cache[global_idx]`, a 16-frame list window) as piecewise regions
  sdpa_piecewise_global  the same plan with the trunk's blocks as the names plan has them
                  (their `mlp` compiled, the blocks left out): the global blocks only, as before
                  issue 19b
  sdpa_piecewise_before  sdpa_piecewise with piece sharing (runtime/piece_cache) and the
                  list-structure rule (runtime/cache_sources) turned off: what they cut (not in
                  the default --all; ask for it with --arms)
  sdpa_piecewise_unshared  sdpa_piecewise with its frame blocks compiled whole, as before
                  runtime/shared_pieces (they are RopeBlock, like the global blocks, and share
                  their pieces): what that sharing cuts (ask for it with --arms)
  sdpa_piecewise_noselect  sdpa_piecewise with runtime/index_select off: the trunk's calls
                  pass `global_idx` to dynamo, so each instance traces its own graphs (ask for
                  it with --arms)
  sdpa_piecewise_lightfusion  sdpa_piecewise with the depth head's FusionBlock region on
                  aot_eager (`[region.compile] backend`), still captured: its 4 resolutions are
                  4 inductor compiles (~11 s on the H200, in both plans) for conv-bound blocks
                  whose launches the region graph saves anyway (an experiment: ask with --arms)
  sdpa_piecewise_trunkfull  sdpa_piecewise with the camera trunk's two pieces compiled in full
                  as before v19s: no piece shared across input strides (runtime/piece_restride)
                  and no light piece across regions (piece_cache.PieceWork): what they cut (ask
                  for it with --arms)
  sdpa_piecewise_fused  sdpa_piecewise with its pieces built by inductor, as before x19s: the
                  planner's light pieces (planning/streaming.light_pieces_plan: the piecewise
                  regions and the frame blocks, which share their pieces, on aot_eager under
                  region capture) undone, so what the light pieces cost in speed and save in cold
                  start (ask for it with --arms). The arm sdpa_piecewise_light of w19s measured
                  what is now sdpa_piecewise itself.
  gpt2_eager      GPT-2 small (random weights, fp32) `generate()` of 64 new tokens at batch 1
  gpt2_names      `plan --model ...` without --piecewise: the names-only plan of GPT-2, its
                  cold start the figure the stack's must not exceed (issue 19; ask for it with
                  --arms, beside gpt2_ab or gpt2_stack: each arm's process has fresh caches)
  gpt2_piecewise  `plan --model ... --piecewise`, per-block layout (planning.stacks.drop_stacks):
                  its 12 blocks piecewise, each entered through dynamo every token
  gpt2_stack      `plan --model ... --piecewise` as planned: `transformer` as ONE piecewise
                  region (one dynamo entry a token), its blocks standing by
  gpt2_stack_before  gpt2_stack without runtime/compile_start's cuts (light pieces, the compile
                  pool started at apply): what they save in cold start, and cost in speed (ask
                  for it with --arms)
  gpt2_stack_fused  gpt2_stack with compile_start's size rule off (LIGHT_PIECE_ELEMENTS 0):
                  the stack's launch-bound pieces build inductor code as before the rule (the
                  middle piece with inductor, the others light by share): what the rule saves
                  in cold start, and whether it costs speed (ask for it with --arms)
  gpt2_ab_fused   gpt2_ab with the size rule off, the same way (ask for it with --arms)
  gpt2_ab_guards  gpt2_ab with a third model taking turns: the stack applied with
                  surgery.runtime.tree_guards off (WATCH_TREES False: dynamo's full guards on
                  the module tree, as before tree_guards); ``full_ms_per_token`` and
                  ``watched_over_full`` (the stack's median over the full-guard stack's), each
                  round's ratio, tokens identical for all three (ask for it with --arms)
  gpt2_ab_masks   gpt2_ab with a third model taking turns: the stack applied with
                  surgery.runtime.piece_masks off (on torch < 2.14 its graph builds the causal
                  mask eager skips, and each SDPA converts it, as before y19a):
                  ``before_ms_per_token``, ``stack_over_before``, each round's ratio, and the
                  twin's ops between pieces (ask for it with --arms)
  gpt2_ab_once    gpt2_ab with the same stack taking a third turn with
                  surgery.runtime.piece_replay.WEIGHTS_ONCE_A_RUN off (each piece checks its
                  weights every call, as before x19g): ``per_piece_ms_per_token`` and
                  ``stack_over_per_piece``, each round's ratio (ask for it with --arms)
  gpt2_ab_plan    gpt2_ab with the same stack taking a third turn with
                  surgery.runtime.piece_replay.STEADY_PLANS off (every replay through
                  RegionGraphs.__call__, as before graphs.steady): ``no_plan_ms_per_token`` and
                  ``stack_over_no_plan``, each round's ratio (ask for it with --arms)
  gpt2_ab         eager and gpt2_stack in ONE process, taking turns (not in the default --all;
                  ask for it with --arms): GPT-2 is built once, an untouched deep copy kept as
                  the eager model, the stack plan applied to the other; both warmed at full
                  length, then --rounds R (5) rounds each time one generate() of each, the first
                  of the pair alternating (eager first in round 0). Separate processes swing
                  with where the host places each (0.71x-2.07x across five H200 calls, one
                  eager arm 8.2 and 5.7 ms a token in one call); here both share the placement.
                  It reports per model the median / p90 ms per token, the ratio of the medians
                  (eager / stack), each round's ratio and which went first, whether every
                  round's tokens equal the eager model's first, the stack's counts (as
                  gpt2_stack), and each model's steady peak memory above both models' weights
                  (the peak of its own calls; the stack's graphs and pools are held throughout,
                  so they count in eager's figure too). --pin puts the process on one CPU
                  core (os.sched_setaffinity, the lowest core it may use; ``pinned`` says which,
                  or "no"), so the two models cannot be placed apart.

Figures: ms a frame (median, p90; CUDA events) or ms per generate() call and per token, cold
start, peak GPU memory above the weights, the eager step's coverage by the plan (a watched run:
the share of the eager step inside the plan's regions; a piecewise block counts whole, its
attention included), pieces captured / replays / ops between pieces / recompiles summed over the
piecewise paths, and the largest relative output difference from eager over 24 frames (SDPA) or
whether every token equals eager's (GPT-2). The compiled arms (SDPA and GPT-2) also break
their cold start down (``cold_breakdown``): dynamo's tracing and guards, the backends dynamo
called (inductor for the plain regions, the split for piecewise ones), the pieces' own compiles
after the trace, the captures, and the counts: dynamo graphs, piecewise graphs, pieces compiled
and shared (identical pieces of other graphs and blocks), calls run eager on a new list-cache
structure or an empty tensor cache (a prefill), the seconds of each dynamo frame compile, and
the guard failure that triggered each recompile (dynamo's ``recompiles`` log, captured, not
printed).

    python benchmarks/gpu_piecewise.py --all [--out results.json]       # on the H200
    python benchmarks/gpu_piecewise.py --arm sdpa_piecewise --frames 24  # one arm, this process
    python benchmarks/gpu_piecewise.py --all --tiny                      # the CPU smoke run
    python benchmarks/gpu_piecewise.py --all --frames 8 --timeout 110 \
        --arms sdpa_names,sdpa_piecewise_global,sdpa_piecewise  # cold starts side by side

Every compiled SDPA arm's cold start (``cold_s``) starts after the plan and a watched eager run
(its coverage), and ends before the first timed frame: apply_manifest with 3 warm-up frames, a
reset, and the 32 warm frames. ``rest_s`` is what the breakdown does not name: running those
frames (eager calls included), guards, surgery's and dynamo's Python, first kernel launches.
    python benchmarks/gpu_piecewise.py --all --arms gpt2_eager,gpt2_piecewise,gpt2_stack --profile

``--profile`` adds, to the GPT-2 arms (not gpt2_ab), one cProfile'd generate() split into
host-time shares (benchmarks/_host_profile.py): dynamo entry, pieces, attention, surgery's
wrappers, the rest, and the dynamo entries per token.
    python benchmarks/gpu_piecewise.py --all --arms gpt2_ab --rounds 7 --pin   # one process, A/B
    python benchmarks/gpu_piecewise.py --all --tiny --cpu-backend inductor \
        --arms sdpa_piecewise_before,sdpa_piecewise     # the cold start on the CPU, inductor
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _arms import (  # noqa: E402
    against_reference,
    child_result,
    cold_start_as_before,
    fresh_cache_env,
    latency,
    paths_per_kind,
    pieces_fused,
    print_arm_result,
    time_call,
)
from _compile_timeline import CompileTimeline  # noqa: E402
from _host_profile import host_profile  # noqa: E402

ARMS = ("sdpa_eager", "sdpa_names", "sdpa_piecewise", "sdpa_piecewise_global",
        "sdpa_piecewise_before", "sdpa_piecewise_unshared", "sdpa_piecewise_noselect",
        "sdpa_piecewise_lightfusion", "sdpa_piecewise_trunkfull", "sdpa_piecewise_fused",
        "gpt2_eager", "gpt2_names", "gpt2_piecewise",
        "gpt2_stack",
        "gpt2_stack_before", "gpt2_stack_fused", "gpt2_ab", "gpt2_ab_fused", "gpt2_ab_guards",
        "gpt2_ab_once", "gpt2_ab_masks", "gpt2_ab_plan")
DEFAULT_ARMS = tuple(a for a in ARMS if a not in ("sdpa_piecewise_before",
                                                  "sdpa_piecewise_unshared",
                                                  "sdpa_piecewise_noselect",
                                                  "sdpa_piecewise_lightfusion",
                                                  "sdpa_piecewise_trunkfull",
                                                  "sdpa_piecewise_fused", "gpt2_ab",
                                                  "gpt2_stack_before", "gpt2_stack_fused",
                                                  "gpt2_ab_fused", "gpt2_ab_guards",
                                                  "gpt2_ab_once", "gpt2_names",
                                                  "gpt2_ab_masks", "gpt2_ab_plan"))
# Where the camera trunk's blocks are: sdpa_piecewise_global plans them as the names plan does.
TRUNK = "camera_head.trunk."
# Frames before timing. The camera trunk keeps a 16-frame window: its full window compiles when
# it recurs (frame 17 after a reset, runtime/cache_sources), and the ring of output sets its held
# k, v need grows one set (one capture) a frame for 9 frames more; 20 timed those captures.
WARM = 32
NEW_TOKENS = 64


def tiny() -> bool:
    return os.environ.get("GPU_PIECEWISE_SIZE") == "tiny"


def gpt2() -> Any:
    """A --model factory: GPT-2 small's shape (tiny with --tiny), random weights, no EOS."""
    import torch

    if not torch.cuda.is_available():  # the CPU smoke run: torchvision beside the CPU torch
        from tests.conftest import _let_torchvision_import_on_cpu_torch

        _let_torchvision_import_on_cpu_torch()
    import transformers

    torch.manual_seed(0)
    kw = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=128) if tiny() \
        else {}
    cfg = transformers.GPT2Config(**kw, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _overrides(cuda: bool) -> dict[str, Any] | None:
    # Without CUDA there are no graphs to capture: compile the pieces on the CPU (aot_eager,
    # quick to build) so the smoke run goes through the same code.
    # GPU_PIECEWISE_BACKEND=aot_eager on CUDA: the same graphs without inductor's fusion (how
    # much of the speed is the graphs, and how much of the cold start is inductor).
    if cuda:
        backend = os.environ.get("GPU_PIECEWISE_BACKEND")
        return {"backend": backend} if backend else None
    return {"on_cpu": "compile"}


def _cpu_backend(manifest: Any, cuda: bool) -> None:
    """Without CUDA, the plan's backend (manifest [compile]) is the CPU one: an override would
    also replace what a region names (the planner's light pieces), so it is set here instead."""
    if not cuda:
        manifest.compile = {**manifest.compile,
                            "backend": os.environ.get("GPU_PIECEWISE_CPU_BACKEND", "aot_eager")}


def _as_before() -> None:
    """sdpa_piecewise_before: no piece is shared (no key), no list structure is deferred."""
    import surgery.runtime.piece_cache as piece_cache
    import surgery.runtime.piecewise as piecewise

    piece_cache.piece_key = lambda *a, **k: None  # type: ignore[assignment]
    piecewise.DEFER_STRUCTURES = False  # every list-cache structure compiles at once


def _trunk_full() -> None:
    """sdpa_piecewise_trunkfull: no piece takes a compile of other input strides, and light
    pieces only by their own graph's share (or size), as before piece_restride / PieceWork."""
    import surgery.runtime.piece_cache as piece_cache

    piece_cache.PieceCache._restrided = lambda self, gm, key, *a: (None, key)  # type: ignore
    piece_cache.PieceWork.light = lambda self, g, p, pieces: [False] * len(pieces)  # type: ignore


def _fused(manifest: Any) -> None:
    """Undo the planner's light pieces (planning/streaming.light_pieces_plan): the regions it
    set to its light backend compile with the plan's backend again."""
    from surgery.runtime.compile_start import LIGHT_PIECE_BACKEND

    undone = 0
    for r in manifest.regions:
        if r.compile.get("backend") == LIGHT_PIECE_BACKEND:
            r.compile = {k: v for k, v in r.compile.items() if k != "backend"}
            undone += 1
    if not undone:
        raise RuntimeError("the plan has no light-piece region to build with inductor")


def _shared(handle: Any) -> int:
    """SDPAs of the handle's piecewise graphs that read one shared additive mask (piece_masks)."""
    return sum(g.masks_shared for s in handle._slots if hasattr(s, "group")
               for g in s.group.graphs)


def _piecewise_counts(handle: Any, out: dict[str, Any]) -> None:
    recs = [r for r in handle.report if r.kind == "piecewise"]
    out.update(piecewise_paths=len(recs),
               piecewise_compiled=sum(r.status == "compiled" for r in recs),
               pieces=sum(r.pieces for r in recs),
               pieces_captured=sum(r.graphs_captured for r in recs),
               piece_replays=sum(r.cuda_graph_replays for r in recs),
               ops_between_per_call=max((r.ops_between for r in recs), default=0),
               split_ops=sorted({o for r in recs for o in r.split_ops}),
               piecewise_compiles=sum(r.compiles for r in recs),
               piecewise_recompiles=sum(r.recompiles for r in recs),
               fell_back=[f"{r.path}: {r.reason[:120]}" for r in handle.report
                          if r.status != "compiled"][:4])


def _coverage(model: Any, step: Any, manifest: Any, out: dict[str, Any]) -> None:
    """The share of the eager step inside the manifest's regions (a watched eager run)."""
    from surgery.planning.evidence import coverage
    from surgery.planning.observed import watch_model
    from surgery.planning.streaming import region_paths

    w = watch_model(model, step, steps=2, timed_steps=3)
    cov = coverage(w.obs, region_paths(manifest))
    out.update(coverage=cov.get("covered_share"), remainder=cov.get("remainder", [])[:4])
    # How the shares were timed: where a remainder has no code of its own (the SDPA example's
    # "(model)" on the H200), whether the root's pass ran slower steps than its children's.
    o = w.obs
    root = [ms for _p, parent, ms in o.timed_calls if parent < 0]
    kids = sum(ms for _p, parent, ms in o.timed_calls if parent == 0)
    out["timing"] = {"settle_steps": o.settle_steps, "bare_steps_ms": o.bare_steps_ms,
                     "pass_step_ms": o.pass_step_ms, "root_ms": round(sum(root), 4),
                     "root_children_ms": round(kids, 4), "clock": o.clock}


def _without_trunk(manifest: Any, names: Any) -> None:
    """The piecewise plan with the trunk's blocks as the names plan has them (their small fixed
    children compiled, the blocks left out): the global blocks only, as before issue 19b."""
    import dataclasses

    manifest.regions = [r for r in manifest.regions
                        if not (r.kind == "piecewise" and r.paths[0].startswith(TRUNK))]
    taken = {p for r in manifest.regions for p in r.paths}
    for r in names.regions:
        paths = [p for p in r.paths if p.startswith(TRUNK) and p not in taken]
        if paths:
            manifest.regions.append(dataclasses.replace(r, paths=paths))


class _Recompiles(logging.Handler):
    """Keeps the first guard failure of each dynamo recompile (what triggered it)."""

    def __init__(self) -> None:
        super().__init__()
        self.triggers: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("- ")]
        if lines and len(self.triggers) < 16:
            self.triggers.append(lines[0][2:][:200])


def _watch_recompiles() -> _Recompiles:
    """Capture dynamo's recompile reasons (the `recompiles` log) without printing them."""
    import torch

    torch._logging.set_logs(recompiles=True)
    handler = _Recompiles()
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    log.addHandler(handler)
    log.propagate = False
    return handler


def _cold_breakdown(handle: Any, out: dict[str, Any],
                    recompiles: _Recompiles | None = None,
                    timeline: CompileTimeline | None = None) -> None:
    """Where the cold start went (this process compiled nothing before the arm)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    def total(name: str) -> float:
        return sum(compilation_time_metrics.get(name, []))

    backend = total("OutputGraph.call_user_compiler")
    recs = list(handle.report)
    pw = [r for r in recs if r.kind == "piecewise"]
    out["cold_breakdown"] = {
        "dynamo_trace_s": round(total("_compile.compile_inner") - backend, 2),
        "backend_s": round(backend, 2),
        # pieces of piecewise regions, and of ordinary ones built from them (shared_pieces)
        "piece_compile_s": round(sum(r.piece_compile_s for r in recs), 2),
        "capture_s": round(sum(r.capture_s for r in recs), 2),
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "piecewise_graphs": sum(r.compiles for r in pw),
        "plain_compiles": sum(r.compiles for r in recs if r.kind != "piecewise"),
        "pieces_compiled": sum(r.pieces_compiled for r in recs),
        "pieces_shared": sum(r.pieces_shared for r in recs),
        "pieces_light": sum(r.pieces_light for r in recs),
        "pieces_restrided": sum(r.pieces_restrided for r in recs),
        "new_structure_calls": sum(r.new_structure_calls for r in pw),
        "empty_cache_calls": sum(r.empty_cache_calls for r in pw)}
    b = out["cold_breakdown"]
    if "cold_s" in out:  # the rest: running the frames, guards, Python, first launches
        b["rest_s"] = round(out["cold_s"] - b["dynamo_trace_s"] - b["backend_s"]
                            - b["piece_compile_s"] - b["capture_s"], 2)
    # each dynamo frame compile (trace + guards + backend), in order
    out["cold_breakdown"]["dynamo_each_s"] = [
        round(x, 2) for x in compilation_time_metrics.get("_compile.compile_inner", [])][:16]
    if recompiles is not None:  # each dynamo recompile's first guard failure
        out["cold_breakdown"]["recompile_triggers"] = recompiles.triggers
    # every timed phase of dynamo and inductor over 50 ms (where a piece's build went: the
    # inductor import, graph lowering, codegen, waits on the Triton compile pool, ...)
    out["cold_breakdown"]["phases_s"] = {
        k: round(sum(v), 2) for k, v in sorted(compilation_time_metrics.items())
        if sum(v) >= 0.05}
    if timeline is not None:  # each compile in order, and where its kernels were built
        out["cold_breakdown"]["timeline"] = timeline.events()


def run_sdpa(arm: str, n_frames: int) -> dict[str, Any]:
    import torch

    from surgery import apply_manifest
    from surgery.planning.observed import build_live
    from surgery.planning.plan import compile_defaults, plan_model

    spec = "surgery.examples:tiny_sdpa" if tiny() else "surgery.examples:lingbot_sdpa"
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"arm": arm}
    if arm == "sdpa_piecewise_before":
        _as_before()
    if arm == "sdpa_piecewise_noselect":  # the trunk's index reaches dynamo (per instance)
        import surgery.runtime.index_select as index_select

        index_select.SELECT_SLOTS = False
    if arm == "sdpa_piecewise_trunkfull":
        _trunk_full()
    if arm == "sdpa_piecewise_unshared":  # frame blocks compile whole (no shared pieces)
        import surgery.runtime.apply as apply_module

        apply_module.piece_sharing = lambda *a, **k: (lambda *b: None)  # type: ignore
    torch.manual_seed(0)
    model = build_live(spec, device=dev)
    xs = [model.example_input(seed=1000 + i) for i in range(8)]
    ac = torch.autocast(dev, dtype=torch.bfloat16)

    def step(m: Any) -> Any:
        with torch.no_grad(), ac:
            return m(xs[m.frames_seen % len(xs)])

    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    handle = None
    timeline: CompileTimeline | None = None
    recompiles = _watch_recompiles()
    if arm != "sdpa_eager":
        piecewise = arm.startswith("sdpa_piecewise")  # the piecewise arms
        manifest = plan_model(spec, compile=compile_defaults(), piecewise=piecewise).manifest
        if arm == "sdpa_piecewise_global":
            _without_trunk(manifest, plan_model(spec, compile=compile_defaults()).manifest)
        if arm == "sdpa_piecewise_lightfusion":  # the fusion blocks traced, not inductor-built
            for r in manifest.regions:
                if r.module_class == "FusionBlock":
                    r.compile = {**r.compile, "backend": "aot_eager"}
        if arm == "sdpa_piecewise_fused":  # the pieces built by inductor, as before x19s
            _fused(manifest)
        out["plan_s"] = round(time.perf_counter() - t0, 2)
        out["regions"] = paths_per_kind(manifest)
        # The coverage target is the piecewise plan's; names has its figure too, and every
        # compiled arm's cold start then starts after the same watched eager run (CUDA's
        # handles and lazily loaded kernels are warm in each), so their cold starts compare.
        _coverage(model, step, manifest, out)
        model.reset_stream()
        t0 = time.perf_counter()  # cold start: compile and warm-up, not the watched run
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timeline = CompileTimeline().start()
        _cpu_backend(manifest, cuda)
        handle = apply_manifest(model, manifest, warmup=step, overrides=_overrides(cuda))
    elif cuda:
        torch.cuda.reset_peak_memory_stats()
    model.reset_stream()
    times: list[float] = []
    outs: list[Any] = []
    with torch.no_grad():
        for i in range(WARM + n_frames):
            if i == WARM:
                sync()
                out["cold_s"] = round(time.perf_counter() - t0, 2)
                if handle is not None:
                    _cold_breakdown(handle, out, recompiles, timeline)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            with ac:
                y, ms, _ = time_call(lambda i=i: model(xs[i % len(xs)]), cuda=cuda)
            if i >= WARM:
                times.append(ms)
                outs.append({k: v.float().cpu() for k, v in y.items()})
    out.update(**latency(times), frames=n_frames,
               steady_peak_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
               if cuda else 0.0, weights_gib=round(base / 2**30, 3),
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    if handle is not None:
        counts = handle.report.counts()
        out["regions_compiled"] = f"{counts.get('compiled', 0)}/{len(handle.report)}"
        _piecewise_counts(handle, out)
    diff = against_reference(outs, ref_path=os.environ.get("GPU_PIECEWISE_SDPA_REF"),
                             is_reference=arm == "sdpa_eager")
    if diff is not None:
        out["max_rel_diff"] = diff
    return out


def _gpt2_setup() -> tuple[Any, Any, bool]:
    """GPT-2 on the device (one CPU thread without CUDA), its 8-token prompt, whether CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # the CPU smoke run: one thread, the shared machine's other cores are busy
        torch.set_num_threads(1)
    model = gpt2().to("cuda" if cuda else "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 8),
                        generator=torch.Generator().manual_seed(0)).to(model.device)
    return model, ids, cuda


def _generate(m: Any, ids: Any, n: int = NEW_TOKENS) -> Any:
    """Greedy decoding of exactly ``n`` new tokens, as a user calls it."""
    import torch

    with torch.no_grad():
        return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def _gpt2_plan(arm: str, model: Any, ids: Any, out: dict[str, Any]) -> Any:
    """The piecewise plan of GPT-2 for ``arm``: per block (gpt2_piecewise) or the stack region
    over ``transformer`` (gpt2_stack, gpt2_ab). Records its regions and the eager step's
    coverage (a watched run of ``model``)."""
    from surgery.planning.plan import compile_defaults, plan_model
    from surgery.planning.stacks import drop_stacks

    manifest = plan_model("gpu_piecewise:gpt2", compile=compile_defaults(),
                          piecewise=arm != "gpt2_names").manifest
    if arm == "gpt2_names":  # names only: no piecewise region, and not an empty plan
        if not manifest.regions or any(r.kind == "piecewise" for r in manifest.regions):
            raise RuntimeError(f"the names-only plan of GPT-2 has regions "
                               f"{[(r.kind, r.paths) for r in manifest.regions]}")
    elif arm == "gpt2_piecewise":  # the per-block layout, as before the stack region
        drop_stacks(manifest)
    elif not any(r.paths == ["transformer"] for r in manifest.regions):
        raise RuntimeError("the plan has no stack region over `transformer`")
    out["regions"] = paths_per_kind(manifest)
    _coverage(model, lambda m: _generate(m, ids, 8), manifest, out)
    return manifest


def _apply_gpt2(model: Any, manifest: Any, ids: Any, cuda: bool) -> Any:
    from surgery import apply_manifest

    _cpu_backend(manifest, cuda)
    return apply_manifest(model, manifest, warmup=lambda m: _generate(m, ids, 8), passes=2,
                          overrides=_overrides(cuda))


def _peak_gib(base: int, cuda: bool) -> float:
    import torch

    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3) if cuda else 0.0


def _env(cuda: bool) -> dict[str, str]:
    import torch
    import transformers

    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__}


def run_gpt2(arm: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"arm": arm}
    model, ids, cuda = _gpt2_setup()

    def generate() -> Any:
        return _generate(model, ids)

    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    handle = None
    recompiles = _watch_recompiles()
    if arm == "gpt2_stack_before":
        cold_start_as_before()
    if arm == "gpt2_stack_fused":
        pieces_fused()
    if arm in ("gpt2_names", "gpt2_piecewise", "gpt2_stack", "gpt2_stack_before",
               "gpt2_stack_fused"):
        manifest = _gpt2_plan(arm, model, ids, out)
        t0 = time.perf_counter()
        handle = _apply_gpt2(model, manifest, ids, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tokens, _, _ = time_call(generate, cuda=cuda)  # warm at full length
    out["cold_s"] = round(time.perf_counter() - t0, 2)
    if handle is not None:  # the cold start's parts, and what made dynamo trace again
        _cold_breakdown(handle, out, recompiles)
    times = []
    for _ in range(3):
        tokens, ms, _ = time_call(generate, cuda=cuda)
        times.append(ms)
    med = statistics.median(times)
    out.update(**latency(times), ms_per_token=round(med / NEW_TOKENS, 3),
               new_tokens=int(tokens.shape[1] - ids.shape[1]),
               steady_peak_gib=_peak_gib(base, cuda), **_env(cuda))
    ref = os.environ.get("GPU_PIECEWISE_GPT2_REF")
    if ref and arm == "gpt2_eager":
        torch.save(tokens.cpu(), ref)
    elif ref and os.path.exists(ref):
        out["tokens_identical"] = bool(torch.equal(tokens.cpu(), torch.load(ref)))
    if handle is not None:
        _piecewise_counts(handle, out)
    if os.environ.get("GPU_PIECEWISE_PROFILE"):
        out.update(host_profile(generate, tokens=NEW_TOKENS))
    return out


def _pin(pin: bool) -> str:
    """With --pin: this process, and the threads it starts later, on one CPU core (the lowest
    it may use); what was done, for the output."""
    if not pin:
        return "no"
    if not hasattr(os, "sched_setaffinity"):
        return "no (os.sched_setaffinity is not on this platform)"
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"cpu {core}"


def run_gpt2_ab(rounds: int, pin: bool, arm: str = "gpt2_ab") -> dict[str, Any]:
    """Eager and the stack plan in one process, taking turns: R rounds, each one generate() of
    each, the first of the pair alternating (round 0 eager first). The host's placement of the
    process, its clocks and caches are then shared by both models, unlike two arms' processes."""
    import copy

    import torch

    from surgery.runtime import piece_replay

    out: dict[str, Any] = {"arm": arm, "pinned": _pin(pin)}
    if arm == "gpt2_ab_fused":
        pieces_fused()
    stack, ids, cuda = _gpt2_setup()
    eager = copy.deepcopy(stack)  # untouched: no hooks, no compiled regions
    base = torch.cuda.memory_allocated() if cuda else 0  # both models' weights
    manifest = _gpt2_plan("gpt2_ab", stack, ids, out)
    recompiles = _watch_recompiles()
    t0 = time.perf_counter()  # the stack's cold start, as gpt2_stack's
    handle = _apply_gpt2(stack, manifest, ids, cuda)
    first = {"stack": time_call(lambda: _generate(stack, ids), cuda=cuda)[0]}  # full length
    out["cold_s"] = round(time.perf_counter() - t0, 2)
    _cold_breakdown(handle, out, recompiles)
    first["eager"] = time_call(lambda: _generate(eager, ids), cuda=cuda)[0]  # warm eager too
    models = {"eager": eager, "stack": stack}
    if arm == "gpt2_ab_guards":  # the stack again, with dynamo's full guards on its tree
        import surgery.runtime.tree_guards as tree_guards

        models["full"] = copy.deepcopy(eager)
        tree_guards.WATCH_TREES = False
        try:
            _apply_gpt2(models["full"], manifest, ids, cuda)
        finally:
            tree_guards.WATCH_TREES = True
        first["full"] = time_call(lambda: _generate(models["full"], ids), cuda=cuda)[0]
    if arm == "gpt2_ab_masks":  # the stack again, its graph traced as before piece_masks
        from surgery.runtime import piece_masks

        models["before"] = copy.deepcopy(eager)
        piece_masks.SHARE_MASKS = piece_masks.NOT_EXPORTING = False
        try:  # its traces: the apply's warm-up and the first full-length generate()
            before = _apply_gpt2(models["before"], manifest, ids, cuda)
            first["before"] = time_call(lambda: _generate(models["before"], ids), cuda=cuda)[0]
        finally:
            piece_masks.SHARE_MASKS = piece_masks.NOT_EXPORTING = True
    if arm == "gpt2_ab_once":  # the same stack, each piece checking its weights every call
        models["per_piece"], first["per_piece"] = stack, first["stack"]
    if arm == "gpt2_ab_plan":  # the same stack, every replay through RegionGraphs.__call__
        models["no_plan"], first["no_plan"] = stack, first["stack"]
    times: dict[str, list[float]] = {k: [] for k in models}
    peaks = dict.fromkeys(models, 0.0)
    identical = all(bool(torch.equal(first["eager"], first[k])) for k in models)
    order = []
    for r in range(rounds):
        pair = ("eager", "stack") if r % 2 == 0 else ("stack", "eager")
        if len(models) == 3:  # three models: each goes first in turn
            names = list(models)
            pair = tuple(names[(r + i) % 3] for i in range(3))
        order.append(pair[0])
        got = {}
        for k in pair:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            piece_replay.WEIGHTS_ONCE_A_RUN = k != "per_piece"
            piece_replay.STEADY_PLANS = k != "no_plan"
            got[k], ms, _ = time_call(lambda m=models[k]: _generate(m, ids), cuda=cuda)
            piece_replay.WEIGHTS_ONCE_A_RUN = piece_replay.STEADY_PLANS = True
            times[k].append(ms / NEW_TOKENS)
            peaks[k] = max(peaks[k], _peak_gib(base, cuda))
        identical = identical and bool(torch.equal(got["eager"], first["eager"])) \
            and all(bool(torch.equal(got[k], got["eager"])) for k in models)
    for k, ts in times.items():
        lat = latency(ts)
        out[f"{k}_ms_per_token"] = lat["median_ms"]
        out[f"{k}_p90_ms_per_token"] = lat["p90_ms"]
        out[f"{k}_steady_peak_gib"] = peaks[k]
    out.update(rounds=rounds, first_in_round=order,
               speedup=round(out["eager_ms_per_token"] / out["stack_ms_per_token"], 3),
               round_speedups=[round(e / s, 3) for e, s in zip(times["eager"], times["stack"],
                                                               strict=True)],
               eager_round_ms_per_token=[round(t, 3) for t in times["eager"]],
               stack_round_ms_per_token=[round(t, 3) for t in times["stack"]],
               new_tokens=int(first["stack"].shape[1] - ids.shape[1]),
               tokens_identical=identical, weights_gib=round(base / 2**30, 3), **_env(cuda))
    if "per_piece" in models:
        out.update(stack_over_per_piece=round(out["stack_ms_per_token"]
                                              / out["per_piece_ms_per_token"], 3),
                   round_stack_over_per_piece=[round(a / b, 3) for a, b in
                                               zip(times["stack"], times["per_piece"],
                                                   strict=True)])
    if "before" in models:
        twin: dict[str, Any] = {}
        _piecewise_counts(before, twin)
        out.update(stack_over_before=round(out["stack_ms_per_token"]
                                           / out["before_ms_per_token"], 3),
                   round_stack_over_before=[round(a / b, 3) for a, b in
                                            zip(times["stack"], times["before"], strict=True)],
                   before_ops_between_per_call=twin.get("ops_between_per_call"),
                   before_recompiles=twin.get("piecewise_recompiles"),
                   # SDPAs reading a shared additive mask (0 for both: no mask is left)
                   masks_shared=[_shared(handle), _shared(before)])
    if "no_plan" in models:
        out.update(stack_over_no_plan=round(out["stack_ms_per_token"]
                                            / out["no_plan_ms_per_token"], 3),
                   round_stack_over_no_plan=[round(a / b, 3) for a, b in
                                             zip(times["stack"], times["no_plan"], strict=True)])
    if "full" in models:
        out.update(watched_over_full=round(out["stack_ms_per_token"]
                                           / out["full_ms_per_token"], 3),
                   full_round_ms_per_token=[round(t, 3) for t in times["full"]],
                   round_watched_over_full=[round(w / f, 3) for w, f in
                                            zip(times["stack"], times["full"], strict=True)])
        slot = stack.transformer.__dict__["forward"].__closure__[1].cell_contents
        watch = slot.group.watch
        out["guards_dropped"] = watch.dropped if watch is not None else 0
    _piecewise_counts(handle, out)
    return out


def run_all(arms: list[str], n_frames: int, timeout: int,
            ab: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Each arm in a fresh process; ``ab`` is gpt2_ab's own arguments (--rounds, --pin)."""
    tmp = os.environ.get("TMPDIR", "/tmp")
    refs = {"GPU_PIECEWISE_SDPA_REF": os.path.join(tmp, f"pw_sdpa_ref_{os.getpid()}.pt"),
            "GPU_PIECEWISE_GPT2_REF": os.path.join(tmp, f"pw_gpt2_ref_{os.getpid()}.pt")}
    results = []
    for i, arm in enumerate(arms):
        env = fresh_cache_env(f"gpu_piecewise_cache_{i}", **refs)
        results.append(child_result([__file__, "--arm", arm, "--frames", str(n_frames), *ab],
                                    env=env, timeout=timeout, ident={"arm": arm}))
    return results


def table(results: list[dict[str, Any]]) -> str:
    by = {r["arm"]: r for r in results}
    rows = ["| arm | ms (median) | p90 | vs eager | vs names | cold (s) | steady peak GiB | "
            "coverage | pieces / captured / replays / ops between / recompiles | check |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['arm']} | failed: {r['error'][:160]} | | | | | | | | |")
            continue
        if r["arm"].startswith("gpt2_ab"):  # its own table below
            continue
        fam = r["arm"].split("_")[0]
        eager, names = by.get(f"{fam}_eager", {}), by.get(f"{fam}_names", {})
        ve = f"{eager['median_ms'] / r['median_ms']:.2f}x" if "median_ms" in eager else ""
        vn = f"{names['median_ms'] / r['median_ms']:.2f}x" if "median_ms" in names else ""
        pw = (f"{r['pieces']} / {r['pieces_captured']} / {r['piece_replays']} / "
              f"{r['ops_between_per_call']} / {r['piecewise_recompiles']}") if "pieces" in r \
            else ""
        check = (f"max rel diff {r['max_rel_diff']:.2e}" if "max_rel_diff" in r else
                 f"tokens identical: {r['tokens_identical']}" if "tokens_identical" in r else
                 "(reference)")
        cov = f"{r['coverage']:.1%}" if r.get("coverage") is not None else ""
        rows.append(f"| {r['arm']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {ve} | {vn} | "
                    f"{r['cold_s']:.1f} | {r['steady_peak_gib']:.2f} | {cov} | {pw} | {check} |")
    if len(rows) == 2:  # only gpt2_ab arms: no row for this table
        rows = []
    rows += ab_table([r for r in results if r["arm"].startswith("gpt2_ab") and "error" not in r])
    prof = [r for r in results if "host_shares" in r]
    if prof:
        names = list(prof[0]["host_shares"])
        rows += ["", "| arm | ms/token | profiled ms/token | dynamo entries/token | "
                 + " | ".join(names) + " |", "|---" * (4 + len(names)) + "|"]
        rows += [f"| {r['arm']} | {r['ms_per_token']:.3f} | {r['profiled_ms_per_token']:.3f} | "
                 f"{r['dynamo_entries_per_token']} | "
                 + " | ".join(f"{r['host_shares'][n]:.1%}" for n in names) + " |" for r in prof]
    return "\n".join(rows)


def ab_table(results: list[dict[str, Any]]) -> list[str]:
    """gpt2_ab: eager and the stack in one process, taking turns (ms per token)."""
    if not results:
        return []
    rows = ["", "| gpt2_ab (one process) | eager ms/token (median / p90) | stack ms/token "
            "(median / p90) | eager / stack | per round (first) | steady peak GiB eager / "
            "stack | captured / replays / ops between / recompiles | tokens identical | pinned |",
            "|---" * 9 + "|"]
    for r in results:
        per = ", ".join(f"{x:.2f}x ({f[0]})" for x, f in
                        zip(r["round_speedups"], r["first_in_round"], strict=True))
        rows.append(
            f"| {r['arm']}, {r['rounds']} rounds | {r['eager_ms_per_token']:.3f} / "
            f"{r['eager_p90_ms_per_token']:.3f} | {r['stack_ms_per_token']:.3f} / "
            f"{r['stack_p90_ms_per_token']:.3f} | **{r['speedup']:.2f}x** | {per} | "
            f"{r['eager_steady_peak_gib']:.2f} / {r['stack_steady_peak_gib']:.2f} | "
            f"{r['pieces_captured']} / {r['piece_replays']} / {r['ops_between_per_call']} / "
            f"{r['piecewise_recompiles']} | {r['tokens_identical']} | {r['pinned']} |")
    for r in results:
        if "per_piece_ms_per_token" in r:
            rows.append(f"\n{r['arm']}: the stack checking weights per piece "
                        f"{r['per_piece_ms_per_token']:.3f} ms a token; once a run / per piece "
                        f"**{r['stack_over_per_piece']:.3f}** (rounds "
                        f"{r['round_stack_over_per_piece']})")
        if "before_ms_per_token" in r:
            rows.append(f"\n{r['arm']}: the stack with piece_masks off "
                        f"{r['before_ms_per_token']:.3f} / {r['before_p90_ms_per_token']:.3f} "
                        f"ms a token ({r['before_ops_between_per_call']} ops between, "
                        f"SDPAs on a shared mask stack / before {r['masks_shared']}, "
                        f"{r['before_recompiles']} recompiles); stack / before "
                        f"**{r['stack_over_before']:.3f}** (rounds "
                        f"{r['round_stack_over_before']}); eager / before "
                        f"{r['eager_ms_per_token'] / r['before_ms_per_token']:.2f}x")
        if "no_plan_ms_per_token" in r:
            rows.append(f"\n{r['arm']}: the stack without steady plans "
                        f"{r['no_plan_ms_per_token']:.3f} ms a token; plans / no plans "
                        f"**{r['stack_over_no_plan']:.3f}** (rounds "
                        f"{r['round_stack_over_no_plan']})")
        if "full_ms_per_token" in r:
            rows.append(
                f"\n{r['arm']}: the stack with full guards {r['full_ms_per_token']:.3f} / "
                f"{r['full_p90_ms_per_token']:.3f} ms a token; watched / full "
                f"**{r['watched_over_full']:.3f}** (rounds {r['round_watched_over_full']}); "
                f"eager / full {r['eager_ms_per_token'] / r['full_ms_per_token']:.2f}x; "
                f"guards dropped {r['guards_dropped']}")
    return rows


def cold_table(results: list[dict[str, Any]]) -> str:
    """The cold start of each arm that has a breakdown, where it went."""
    keys = ("dynamo_trace_s", "backend_s", "piece_compile_s", "capture_s", "rest_s",
            "dynamo_graphs", "piecewise_graphs", "plain_compiles", "pieces_compiled",
            "pieces_shared", "pieces_light", "pieces_restrided", "new_structure_calls",
            "empty_cache_calls")
    rows = ["| arm | cold s | vs names | " + " | ".join(keys) + " |",
            "|---" * (len(keys) + 3) + "|"]
    triggers = []
    names = {r["arm"].split("_")[0]: r["cold_s"] for r in results
             if r["arm"].endswith("_names") and "cold_s" in r}
    for r in results:
        b = r.get("cold_breakdown")
        if b:
            ref = names.get(r["arm"].split("_")[0])
            vs = f"{r['cold_s'] / ref:.2f}x" if ref else ""
            rows.append(f"| {r['arm']} | {r['cold_s']:.1f} | {vs} | " +
                        " | ".join(str(b.get(k, "")) for k in keys) + " |")
            triggers += [f"- {r['arm']} recompile {i + 1}: {t}"
                         for i, t in enumerate(b.get("recompile_triggers", []))]
    if len(rows) == 2:
        rows.append("| (no arm has a breakdown: only compiled arms have one) |" +
                    " |" * (len(keys) + 1))
    return "\n".join(rows + triggers)


def timeline_table(results: list[dict[str, Any]]) -> str:
    """Per arm: the kernels built in-process and in the pool, and its compiles in order (what,
    when it started, seconds, kernels in-process / pooled) over 0.3 s (benchmarks/
    _compile_timeline.py)."""
    rows = ["| arm | kernels in-process / pooled | compiles over 0.3 s: what @start s: "
            "seconds (in-process / pooled) |", "|---|---|---|"]
    for r in results:
        t = (r.get("cold_breakdown") or {}).get("timeline")
        if not t:
            continue
        each = "; ".join(f"{c['what']} @{c['at_s']}: {c['s']} ({c['in_process']}/{c['pooled']})"
                         for c in t["compiles"] if c.get("s", 0) >= 0.3)
        missing = f" (not observed: {', '.join(t['missing'])})" if t["missing"] else ""
        rows.append(f"| {r['arm']} | {t['in_process']} / {t['pooled']}{missing} | {each} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--all", action="store_true", help="every arm, each in a fresh process")
    ap.add_argument("--arms", help="comma-separated subset for --all")
    ap.add_argument("--frames", type=int, default=24, help="timed frames of the SDPA arms")
    ap.add_argument("--timeout", type=int, default=240, help="per arm, seconds")
    ap.add_argument("--tiny", action="store_true", help="test-size models (the CPU smoke run)")
    ap.add_argument("--cpu-backend", choices=("aot_eager", "inductor"),
                    help="what compiles the regions without CUDA (aot_eager by default)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--profile", action="store_true",
                    help="GPT-2 arms but gpt2_ab: add one profiled generate()'s host-time "
                    "shares")
    ap.add_argument("--rounds", type=int, default=5,
                    help="gpt2_ab: rounds of one generate() of each model")
    ap.add_argument("--pin", action="store_true",
                    help="gpt2_ab: pin its process to one CPU core (os.sched_setaffinity)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.tiny:
        os.environ["GPU_PIECEWISE_SIZE"] = "tiny"
    if args.profile:
        os.environ["GPU_PIECEWISE_PROFILE"] = "1"
    if args.cpu_backend:  # the arms' processes inherit it
        os.environ["GPU_PIECEWISE_CPU_BACKEND"] = args.cpu_backend
    if args.arm:
        run = (lambda: run_gpt2_ab(args.rounds, args.pin, args.arm)) \
            if args.arm.startswith("gpt2_ab") else \
            (lambda: run_gpt2(args.arm)) if args.arm.startswith("gpt2") else \
            (lambda: run_sdpa(args.arm, args.frames))
        print_arm_result(run, {"arm": args.arm})
        return
    arms = args.arms.split(",") if args.arms else list(DEFAULT_ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    ab = ("--rounds", str(args.rounds), *(("--pin",) if args.pin else ()))
    results = run_all(arms, args.frames, args.timeout, ab)
    print(table(results))
    print(cold_table(results))
    print(timeline_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
