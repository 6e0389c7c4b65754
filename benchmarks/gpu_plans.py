"""Names-only plan vs evidence plan on real drivers (issue 18): speed, cold start, peak memory,
coverage, and the timing hooks' overhead, one call for every model.

Models and drivers (each the way its users drive it):

  sdpa            ``surgery.examples:lingbot_sdpa`` (dim 1024, 24+24+24 blocks, 378x518 frames),
                  float32 weights under bf16 autocast, one frame a step through
                  ``model.forward(frame)`` (the root's hooks never fire), planned under
                  ``no_grad`` and deployed under ``inference_mode`` (the README's flow). Every
                  arm streams WARM frames first, so the KV caches are at their steady length.
  flux            diffusers ``FluxTransformer2DModel`` (4 + 8 layers, 512 px, 512 text tokens),
                  bf16, ``model(**inputs)`` under ``inference_mode``.
  gpt2_generate   transformers ``GPT2LMHeadModel`` (base config), bf16: one timed unit is
                  ``model.generate(prompt, max_new_tokens=16)`` (greedy) from a 32-token prompt,
                  with its dynamic cache.
  gpt2_static     the same with ``cache_implementation="static"``.

Arms, each a fresh process with an empty inductor/Triton cache:

  eager     the model as it is
  names     ``plan_model`` (``surgery plan --model``: names and structure), ``apply_manifest``
  evidence  ``plan_from_step`` (``surgery plan --model --input``): 6 watched steps, 3 bare and
            3 hooked timed steps, then ``apply_manifest``
  evidence_before
            the evidence plan without surgery.runtime.compile_start's cold-start cuts (light
            pieces, the compile pool started at apply): what they save, and cost in speed
  evidence_fused
            the evidence plan with surgery.runtime.compile_start's size rule off: launch-bound
            pieces (GPT-2's decode stack) build inductor code again (ask for it with --arms)
  evidence_inductor
            the same plan with its light regions (surgery.planning.compile_cost: small compile
            groups new to the names plan, aot_eager under region capture) put back on inductor,
            as plans were before: what the light rule saves in cold start, and costs in speed

Per arm: median and p90 ms a unit (CUDA events, synchronised each unit), cold start (s: plan,
compile and warm-up until the first timed unit; the plan's own time beside it), peak GPU memory
(GiB) while compiling and in the timed units, the largest relative difference from eager. For the
plans: regions per kind, what compiled, and the cold start's parts: seconds in apply_manifest,
dynamo's unique graphs, compiles and recompiles per path, paths demoted to dynamic shapes, CUDA
graphs captured (and seconds), UnplannedSignatureWarnings, and module hooks left after planning.
For the evidence arm: its coverage of the bare step and the names-only plan's, the bare step,
the hooked step and the watched step (ms), and the hooks' cost per call.

    python benchmarks/gpu_plans.py --all --out plans.json                 # everything
    python benchmarks/gpu_plans.py --all --models sdpa --arms names,evidence
    python benchmarks/gpu_plans.py --model flux --arm evidence            # one arm, here
    GPU_PLANS_SIZE=tiny python benchmarks/gpu_plans.py --all --calls 4    # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _arms import (  # noqa: E402
    against_reference,
    cold_start_as_before,
    latency,
    paths_per_kind,
    pieces_fused,
    print_arm_result,
    run_grid,
    time_call,
)

MODELS = ("sdpa", "flux", "gpt2_generate", "gpt2_static")
ARMS = ("eager", "names", "evidence", "evidence_before", "evidence_fused", "evidence_inductor")
TINY = os.environ.get("GPU_PLANS_SIZE") == "tiny"
WARM = 2 if TINY else 20  # sdpa: frames before timing (the camera trunk's window is 16)
NEW_TOKENS = 4 if TINY else 16


# --- factories: `plan_model("gpu_plans:<name>")` plans these ------------------------------------

def sdpa() -> Any:
    from surgery.examples import lingbot_sdpa, tiny_sdpa

    return tiny_sdpa() if TINY else lingbot_sdpa()


def flux() -> Any:
    from gpu_zoo import flux as zoo_flux

    return zoo_flux()


if TINY:  # gpu_zoo's factories and drivers read their own size switch
    os.environ["ZOO_SIZE"] = "tiny"


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4) if TINY else GPT2Config()
    return GPT2LMHeadModel(cfg)


FACTORY = {"sdpa": "sdpa", "flux": "flux", "gpt2_generate": "gpt2", "gpt2_static": "gpt2"}


def driver(name: str, model: Any, device: str) -> tuple[Callable[[Any], Any], Any]:
    """``(unit, autocast)``: ``unit(model)`` runs one timed unit the way users drive the model
    (grad mode set by the caller); ``autocast`` is the dtype it runs under, or None."""
    import torch

    g = torch.Generator().manual_seed(0)
    if name == "sdpa":
        frames = [model.example_input(seed=1000 + i) for i in range(8)]

        def frame(m: Any) -> Any:
            return m.forward(frames[m.frames_seen % len(frames)])  # around __call__

        return frame, torch.bfloat16
    if name == "flux":
        from gpu_zoo import driver as zoo_driver

        step, _ = zoo_driver("flux", model, device)
        return (lambda m: step(m)), None
    prompt = torch.randint(0, 1000, (1, 32), generator=g).to(device)
    kw = {"cache_implementation": "static"} if name == "gpt2_static" else {}

    def generate(m: Any) -> Any:
        return m.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          **kw)

    return generate, None


def _hooks_left(model: Any) -> int:
    return sum(1 for m in model.modules() if m._forward_hooks or m._forward_pre_hooks)


def run_arm(name: str, arm: str, n_calls: int) -> dict[str, Any]:
    import torch

    from surgery import apply_manifest
    from surgery.planning.compile_cost import COST_KEYS, LIGHT_BACKEND
    from surgery.planning.observed import plan_from_step
    from surgery.planning.plan import compile_defaults, plan_model
    from surgery.runtime.precompiled import group_breakdown
    from surgery.runtime.signatures import UnplannedSignatureWarning

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"model": name, "arm": arm}
    torch.manual_seed(0)
    model = globals()[FACTORY[name]]().to(device=dev)
    if name != "sdpa":  # the SDPA build keeps float32 weights under bf16 autocast
        model = model.to(dtype=torch.bfloat16)
    model.eval()
    unit, auto = driver(name, model, dev)
    ac = torch.autocast(dev, dtype=auto, enabled=auto is not None)
    reset = getattr(model, "reset_stream", lambda: None)
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    manifest = None
    if arm == "names":
        manifest = plan_model(f"gpu_plans:{FACTORY[name]}", compile=compile_defaults()).manifest
    elif arm in ("evidence", "evidence_before", "evidence_fused", "evidence_inductor"):
        if arm == "evidence_before":
            cold_start_as_before()
        if arm == "evidence_fused":
            pieces_fused()
        def step(m: Any) -> None:
            with torch.no_grad():  # planned under no_grad, deployed under inference_mode
                unit(m)

        manifest = plan_from_step(model, step, steps=6, timed_steps=3, autocast=auto,
                                  compile=compile_defaults(), source=name)
        cov = manifest.coverage or {}
        out.update({k: cov.get(k) for k in ("covered_share", "names_covered_share", "chosen",
                                              "step_ms", "hooked_step_ms", "hook_overhead_ms",
                                              "watched_step_ms")})
        out["remainder"] = cov.get("remainder", [])[:4]
        out["plan_cost"] = {k: cov[k] for k in COST_KEYS if k in cov}
        if arm == "evidence_inductor":  # the plan before the light rule: every region inductor
            for r in manifest.regions:
                if r.compile.get("backend") == LIGHT_BACKEND:
                    r.compile.pop("backend")
        out["dynamic_regions"] = sum(len(r.paths) for r in manifest.regions if r.dynamic)
        out["left_out"] = len(manifest.left_out)
    if manifest is not None:
        out["plan_s"] = round(time.perf_counter() - t0, 2)
        out["hooks_left"] = _hooks_left(model)
        out["regions"] = paths_per_kind(manifest)
    reset()
    handle = None
    overrides = None if cuda else {"on_cpu": "compile", "backend": "aot_eager"}
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always", UnplannedSignatureWarning)
        if manifest is not None:
            torch._dynamo.utils.counters.clear()
            t1 = time.perf_counter()

            def warm(m: Any) -> None:
                with ac:
                    unit(m)

            handle = apply_manifest(model, manifest, warmup=warm, overrides=overrides)
            out["apply_s"] = round(time.perf_counter() - t1, 2)
        reset()
        times: list[float] = []
        outputs: list[Any] = []
        for i in range(WARM + n_calls if name == "sdpa" else n_calls + 2):
            first = WARM if name == "sdpa" else 2
            if i == first:
                sync()
                out["cold_s"] = round(time.perf_counter() - t0, 2)
                out["compile_peak_gib"] = round((torch.cuda.max_memory_allocated() - base)
                                                / 2**30, 3) if cuda else 0.0
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            with ac:
                y, ms, _ = time_call(lambda: unit(model), cuda=cuda)
            if i >= first:
                times.append(ms)
                y = y if isinstance(y, dict) else {"out": y}
                outputs.append({k: v.float().cpu() for k, v in y.items()})
    out.update(**latency(times), steady_peak_gib=round(
        (torch.cuda.max_memory_allocated() - base) / 2**30, 3) if cuda else 0.0,
        weights_gib=round(base / 2**30, 3), gpu=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__)
    if handle is not None:
        recs = list(handle.report)
        out.update(
            compiled=f"{sum(r.status == 'compiled' for r in recs)}/{len(recs)}",
            unique_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
            compiles=sum(r.compiles for r in recs), recompiles=sum(r.recompiles for r in recs),
            demoted_dynamic=sum(r.signature_mode == "dynamic" for r in recs),
            graphs_captured=sum(r.graphs_captured for r in recs),
            pieces_compiled=sum(r.pieces_compiled for r in recs),
            pieces_light=sum(r.pieces_light for r in recs),
            piece_compile_s=round(sum(r.piece_compile_s for r in recs), 2),
            capture_s=round(sum(r.capture_s for r in recs), 2),
            unplanned_warnings=sum(issubclass(w.category, UnplannedSignatureWarning)
                                   for w in caught),
            eager_reasons=sorted({f"{r.kind}: {r.reason}"[:120] for r in recs
                                  if r.status == "eager"})[:4])
        groups = group_breakdown(handle.groups, None)
        backends = [g.backend.backend for g in handle.groups]
        out["compile_groups"] = len(groups)
        out["compile_s"] = round(sum(g["compile_s"] for g in groups), 2)
        pairs = zip(groups, backends, strict=True)
        out["light_compile_s"] = round(sum(g["compile_s"] for g, b in pairs if b != "inductor"),
                                       2)
    diff = against_reference(outputs, ref_path=os.environ.get("GPU_PLANS_REF"),
                             is_reference=arm == "eager")
    if diff is not None:
        out["max_rel_diff"] = diff
    if handle is not None:
        handle.restore()
    return out


def run_all(models: list[str], arms: list[str], n_calls: int, timeout: int) -> list[dict]:
    return run_grid(__file__, "gpu_plans", "GPU_PLANS_REF", models, arms, n_calls, timeout)


def _pct(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, (int, float)) else ""


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| model | arm | ms a unit (median / p90) | vs eager | cold start s (plan s) | "
            "peak GiB compile / steady | compiled | unique graphs / recompiles / dynamic | "
            "coverage evidence / names | bare / hooked step ms | groups (light) / est. "
            "compiles / compiles, backend s | max rel diff |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    eager = {r["model"]: r["median_ms"] for r in results
             if r["arm"] == "eager" and "median_ms" in r}
    for r in results:
        if "error" in r:
            rows.append(f"| {r['model']} | {r['arm']} | failed: {r['error'][:160]} "
                        "||||||||||")
            continue
        e = eager.get(r["model"])
        speed = f"{e / r['median_ms']:.2f}x" if e else ""
        plan = f" ({r['plan_s']:.1f})" if "plan_s" in r else ""
        cov = (f"{_pct(r.get('covered_share'))} / {_pct(r.get('names_covered_share'))}"
               if r["arm"].startswith("evidence") else "")
        pc = r.get("plan_cost") or {}
        cost = (f"{r.get('compile_groups', '')}"
                + (f" ({pc['light_groups']})" if pc.get("light_groups") else "")
                + f" / {pc.get('estimated_compiles', '')} / {r.get('compiles', '')}, "
                  f"{r.get('compile_s', '')}" if "compiles" in r else "")
        steps = (f"{r['step_ms']:.2f} / {r['hooked_step_ms']:.2f}"
                 if r.get("step_ms") is not None and r.get("hooked_step_ms") is not None else "")
        graphs = (f"{r['unique_graphs']} / {r['recompiles']} / {r['demoted_dynamic']}"
                  if "unique_graphs" in r else "")
        diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "(reference)"
        rows.append(f"| {r['model']} | {r['arm']} | {r['median_ms']:.2f} / {r['p90_ms']:.2f} | "
                    f"{speed} | {r['cold_s']:.1f}{plan} | {r['compile_peak_gib']:.2f} / "
                    f"{r['steady_peak_gib']:.2f} | {r.get('compiled', '')} | {graphs} | {cov} | "
                    f"{steps} | {cost} | {diff} |")
    return "\n".join(rows + targets(results))


def targets(results: list[dict[str, Any]]) -> list[str]:
    """Issue 18's targets, per model: the evidence plan at least as fast as names-only, and its
    cold start at most names-only's plus its planning time."""
    by = {(r["model"], r["arm"]): r for r in results if "median_ms" in r}
    out = [""]
    for model in dict.fromkeys(r["model"] for r in results):
        n, e = by.get((model, "names")), by.get((model, "evidence"))
        if n is None or e is None:
            continue
        fast = e["median_ms"] <= n["median_ms"]
        bound = n["cold_s"] + e.get("plan_s", 0.0)
        cold = e["cold_s"] <= bound
        out.append(f"- {model}: evidence {e['median_ms']:.2f} ms against names "
                   f"{n['median_ms']:.2f} ({'met' if fast else 'NOT met'}); cold start "
                   f"{e['cold_s']:.1f} s against {n['cold_s']:.1f} + {e.get('plan_s', 0.0):.1f} "
                   f"= {bound:.1f} ({'met' if cold else 'NOT met'})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS)
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--all", action="store_true", help="every model and arm, fresh processes")
    ap.add_argument("--models", help="comma-separated subset for --all")
    ap.add_argument("--arms", help="comma-separated subset for --all")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=200, help="per arm, seconds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.all:
        models = args.models.split(",") if args.models else list(MODELS)
        arms = args.arms.split(",") if args.arms else list(ARMS)
        bad = sorted((set(models) - set(MODELS)) | (set(arms) - set(ARMS)))
        if bad:
            ap.error(f"unknown model(s) or arm(s) {bad}")
        results = run_all(models, arms, args.calls, args.timeout)
        print(table(results))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    if not (args.model and args.arm):
        ap.error("give --all, or --model and --arm")
    print_arm_result(lambda: run_arm(args.model, args.arm, args.calls),
                     {"model": args.model, "arm": args.arm})


if __name__ == "__main__":
    main()
