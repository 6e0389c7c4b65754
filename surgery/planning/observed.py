"""`surgery plan --model F --input G`: build the model, watch G drive it, plan from the evidence.

Data flow: factory -> model on ``device`` (real tensors: it must run) -> surgery.planning.observe
(calls, ops, state changes, times) -> surgery.planning.evidence (regions, left-out with evidence,
coverage) -> surgery.planning.compare (the names-only plan judged by the same run; the better is
kept) -> Manifest with ``[region.evidence]`` and ``[coverage]``, one region per compile group
(surgery.planning.budgets). The fingerprint is the same as a plan of the same factory without
``--input``: the model's weights are not cast (``dtype`` is autocast, as streaming models deploy).

In process, ``plan_from_step(model, step)`` does the same for a model you already hold; STEP may
call ``model(x)``, ``model.forward(x)``, a method (``model.generate(...)``) or drive a loop. A plan
with no region raises ``EmptyPlanError`` (exit 1 in the CLI) with the reasons counted.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from surgery.errors import EmptyPlanError, ModelSourceError, RegionError
from surgery.formats.binding import binding_fields
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, DEFAULT_WARMUP, LeftOut, Manifest, Region
from surgery.formats.source import load_factory
from surgery.planning.compare import best_of
from surgery.planning.compile_cost import (
    LIGHT_BACKEND,
    choose_piecewise,
    cost_note,
    drop_light,
    weigh_compile_cost,
)
from surgery.planning.evidence import OBSERVED, RECOMPILE_BUDGET, Choice, choose_regions, shares
from surgery.planning.graph_estimate import graph_coverage, graph_note
from surgery.planning.observation import Clock, Observation
from surgery.planning.observe import observe
from surgery.planning.plan import PlanResult, reason_class, view_from_module
from surgery.planning.regions import OUTPUTS_OUTLIVE_STEP, find_regions, natural_key

# --dtype names -> the autocast dtype the steps run under (None: no autocast).
AUTOCAST_DTYPES: dict[str, str | None] = {"bf16": "bfloat16", "fp16": "float16", "fp32": None}


def _load(spec: str, flag: str) -> Callable[..., Any]:
    try:
        return load_factory(spec)  # type: ignore[no-any-return]
    except ModelSourceError as e:
        raise ModelSourceError(str(e).replace("--model", flag, 1),
                               hint=e.hint if flag == "--model" else
                               "name a callable that takes the model and runs one step, e.g. "
                               "--input surgery.examples:stream_step") from None


def build_live(spec: str, *, device: str) -> Any:
    """Build the model for real on ``device`` (it has to run), in eval mode."""
    import torch

    factory = _load(spec, "--model")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelSourceError(f"--device {device!r}: CUDA is not available on this machine",
                               hint="plan with --device cpu, or on a machine with a GPU")
    try:
        with torch.device(device):
            model = factory()
        model = model.to(device)
    except Exception as e:  # the user's constructor may fail in any way
        raise ModelSourceError(f"--model {spec!r}: the factory failed: "
                               f"{type(e).__name__}: {e}",
                               hint="make the factory build the model without arguments"
                               ) from None
    if not isinstance(model, torch.nn.Module):
        raise ModelSourceError(f"--model {spec!r} returned a {type(model).__name__}, "
                               "not an nn.Module", hint="return the model from the factory")
    return model.eval()


def plan_observed(spec: str, *, input_spec: str, steps: int = 4, timed_steps: int = 3,
                  device: str = "cpu", dtype: str = "fp32", include: Sequence[str] = (),
                  exclude: Sequence[str] = (), compile: dict[str, Any] | None = None,
                  clock: Clock | None = None, piecewise: bool | None = None) -> PlanResult:
    """Plan a live model from ``steps`` eager steps of ``input_spec(model)``, then time it.

    ``piecewise``: True plans the streaming blocks piecewise, False never, None where the
    evidence shows they are most of the step (surgery.planning.compile_cost.choose_piecewise).
    """
    import torch

    if steps < 1:
        raise ModelSourceError(f"--steps {steps}: at least one step is needed",
                               hint="use --steps 4 or more, so a growing cache shows")
    if dtype not in AUTOCAST_DTYPES:
        raise ModelSourceError(f"--dtype {dtype!r} is not one of {', '.join(AUTOCAST_DTYPES)}",
                               hint="use --dtype bf16 for bf16 autocast")
    step = _load(input_spec, "--input")
    model = build_live(spec, device=device)
    auto = AUTOCAST_DTYPES[dtype]
    watched = watch_model(model, step, steps=steps, timed_steps=timed_steps, clock=clock,
                          include=include, autocast=None if auto is None else getattr(torch, auto))
    notes = [f"planned from {steps} eager step(s) of {input_spec} on {device}"
             f"{'' if auto is None else f' under {dtype} autocast'}"]
    manifest = manifest_from_evidence(watched, source=spec, include=include, exclude=exclude,
                                      compile=compile, notes=notes,
                                      extra={"input": input_spec, "steps": steps,
                                             "device": device, "dtype": dtype})
    # streaming blocks as piecewise regions (surgery.planning.streaming), asked or by default
    notes += choose_piecewise(manifest, watched.obs, watched.model, watched.view,
                              exclude=exclude, piecewise=piecewise, step=step,
                              autocast=None if auto is None else getattr(torch, auto))
    return PlanResult(manifest, spec, notes, 0)


def plan_from_step(model: Any, step: Callable[..., Any], *, steps: int = 4,
                   timed_steps: int = 3, include: Sequence[str] = (),
                   exclude: Sequence[str] = (), compile: dict[str, Any] | None = None,
                   autocast: Any = None, source: str | None = None,
                   clock: Clock | None = None, piecewise: bool | None = None) -> Manifest:
    """Plan ``model`` in process from ``steps`` watched calls of ``step(model)`` (then timed).

    The in-process form of ``surgery plan --model F --input STEP``: STEP may call ``model(x)``,
    ``model.forward(x)``, a method (``model.generate``) or run a loop. ``autocast`` is a dtype
    (``torch.bfloat16``) every step runs under. The model's state after the steps is whatever
    the steps left (reset a stream or a cache before deploying). ``piecewise`` as in
    ``plan_observed``. Raises EmptyPlanError when no region is found, ModelSourceError when the
    step fails or never reaches the model.
    """
    w = watch_model(model, step, steps=steps, timed_steps=timed_steps, clock=clock,
                    include=include, autocast=autocast)
    name = source or f"{type(model).__module__}.{type(model).__qualname__}"
    manifest = manifest_from_evidence(w, source=name, include=include, exclude=exclude,
                                      compile=compile, extra={"steps": steps})
    choose_piecewise(manifest, w.obs, w.model, w.view, exclude=exclude, piecewise=piecewise,
                     step=step, autocast=autocast)
    return manifest


@dataclass
class Watched:
    """A live model's view, its names-based regions and what a run of it showed."""

    model: Any
    view: Any
    tensors: dict[str, Any]
    names: Any  # regions.Found: the names-only plan, for kinds and comparison
    methods: list[str]
    obs: Observation
    forced: list[str]  # method paths named by --include GLOB:method


def watch_model(model: Any, step: Callable[..., Any], *, steps: int, timed_steps: int = 3,
                clock: Clock | None = None, include: Sequence[str] = (),
                autocast: Any = None) -> Watched:
    """Run ``step`` on the model watched (planning.observe), with every named method wrapped."""
    view, tensors = view_from_module(model)
    plain, forced = method_includes(model, include)
    names = find_regions(view, include=plain)  # validates --include globs, names the kinds
    methods = sorted({f"{p}.{m}" for p, node in view.modules.items() for m in node.methods}
                     | set(forced), key=natural_key)
    obs = observe(model, step, steps=steps, timed_steps=timed_steps, methods=methods,
                  clock=clock, autocast=autocast)
    return Watched(model, view, tensors, names, methods, obs, forced)


def method_includes(model: Any, include: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``--include`` into module globs and ``GLOB:method`` method paths.

    ``GLOB:method`` names any method that the classes of the modules GLOB matches define (not only
    ``attn_pre``/``ffn_residual``): a fixed-shape part of a forward that a run can vouch for. One
    that matches nothing is an error, since a silent no-op is how regions go missing.
    """

    import torch

    plain, forced = [], []
    for g in include:
        if ":" not in g:
            plain.append(g)
            continue
        glob, _, name = g.rpartition(":")
        hits = [p for p, m in model.named_modules() if p and fnmatch.fnmatchcase(p, glob)
                and callable(getattr(type(m), name, None))
                and not isinstance(getattr(m, name), torch.nn.Module)]
        if not hits:
            raise RegionError(f"--include {g!r}: no module matching {glob!r} has a method "
                              f"{name!r}", region=g, hint="name a method its class defines, "
                              "e.g. --include 'aggregator.global_blocks.*.attn:qkv_heads'")
        forced += [f"{p}.{name}" for p in hits]
    return plain, forced


def manifest_from_evidence(w: Watched, *, source: str, include: Sequence[str] = (),
                           exclude: Sequence[str] = (), compile: dict[str, Any] | None = None,
                           notes: list[str] | None = None,
                           extra: dict[str, Any] | None = None) -> Manifest:
    """Choose regions from the evidence, judge the names-only plan by the same run, keep the
    better, and write it, with its evidence, as a manifest. Raises EmptyPlanError on none."""
    include = [g for g in include if ":" not in g] + w.forced
    first = choose_regions(w.obs, methods=w.methods, include=include, exclude=exclude)
    names = [c.path for c in w.names.regions
             if not any(fnmatch.fnmatchcase(c.path, g) for g in exclude)]
    table = dict(compile or DEFAULT_COMPILE)
    share = shares(w.obs)
    # Light groups that no region capture would repay are left out before the two plans are
    # compared, so that the comparison sees the plan as it will be written.
    first = drop_light(w.obs, first, weigh_compile_cost(w.obs, first.groups, names, share,
                                                        compile=table).dropped)
    choice, versus = best_of(w.obs, first, names)
    weighed = weigh_compile_cost(w.obs, choice.groups, names, share, compile=table)
    choice = drop_light(w.obs, choice, weighed.dropped)
    if not choice.regions:
        raise _empty(w, choice, source)
    cov = choice.coverage
    graphs, open_rings = graph_coverage(w.obs, list(choice.regions))  # what graphs will hold
    if notes is not None:
        notes.extend(_coverage_notes(cov, versus))
        notes.append(cost_note(weighed.figures))
        notes.append(graph_note(graphs, len(choice.regions), open_rings))
    kinds = {c.path: c.kind for c in w.names.regions}
    manifest = _manifest(w.view, w.tensors, w.obs, choice, kinds=kinds, source=source,
                         compile=compile, light=weighed.light,
                         extra={**(extra or {}), **versus, **weighed.figures, **graphs})
    manifest.model["class"] = f"{type(w.model).__module__}.{type(w.model).__qualname__}"
    return manifest


def _coverage_notes(cov: dict[str, Any], versus: dict[str, Any]) -> list[str]:
    out = []
    if "covered_share" in cov and "names_covered_share" in versus:
        kept = "the names-only plan" if versus["chosen"] == "names" else "the evidence plan"
        out.append(f"evidence {cov['covered_share']:.0%} of the step, names-only "
                   f"{versus['names_covered_share']:.0%}: kept {kept}")
    if cov.get("hook_overhead_ms") is not None:
        out.append(f"the timing hooks added {cov['hook_overhead_ms']:.2f} ms to a "
                   f"{cov['step_ms']:.2f} ms step (shares are of the bare step, each module "
                   f"timed with hooks on its nesting level only); a watched step (signatures "
                   f"and ops) took {cov.get('watched_step_ms', 0.0):.2f} ms")
    return out


_SHOWN_REASONS = 6  # reasons an empty plan lists, in its one line (within 1000 characters)


def _empty(w: Watched, choice: Choice, source: str) -> EmptyPlanError:
    """Why no module became a region, counted by reason (one screen)."""
    counts: dict[str, int] = {}
    for _path, why in choice.left_out:
        for part in why.split("; "):
            key = reason_class(part)
            counts[key] = counts.get(key, 0) + 1
    ranked = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    # One line (the CLI prints an error as one escaped line): the reasons, most common first.
    parts = [f"{n} x {why[:110]}" for why, n in list(ranked.items())[:_SHOWN_REASONS]]
    more = len(ranked) - _SHOWN_REASONS
    if more > 0:
        parts.append(f"and {more} other reason(s)")
    modules = len([p for p in w.obs.classes if p])
    return EmptyPlanError(
        f"the evidence plan of {source} found no region: {modules} module(s), "
        f"{len(w.obs.calls)} call(s) watched, every one left out; why, by how many modules: "
        + "; ".join(parts), reasons=ranked,
        hint="run the step as deployed (--steps, --dtype, batch sizes), or name regions "
             "with --include GLOB; `surgery plan --model` alone plans by names")


# Signatures a region's evidence lists: its group's budget of each of up to 4 split groups, so the
# runtime's check knows every one it was planned for (a split group lists its own only).
_SIGNATURES_KEPT = RECOMPILE_BUDGET * 4


def _merge_evidence(items: list[dict[str, Any]]) -> dict[str, Any]:
    sigs: list[str] = []
    for e in items:
        sigs += [s for s in e["signatures"] if s not in sigs]
    out: dict[str, Any] = {"signatures": sigs[:_SIGNATURES_KEPT],
                           "calls_per_step": round(sum(e["calls_per_step"] for e in items), 3)}
    if all("share" in e for e in items):
        out["share"] = round(sum(e["share"] for e in items), 5)
    return out


def _manifest(view: Any, tensors: dict[str, Any], obs: Observation, choice: Choice, *,
              kinds: dict[str, str], source: str, compile: dict[str, Any] | None,
              extra: dict[str, Any], light: set[str] | None = None) -> Manifest:
    compile = dict(compile or DEFAULT_COMPILE)
    ring = compile.get("capture") == "region"
    if ring:
        compile["clone_outputs"] = False
    regions: list[Region] = []
    covered = 0
    for g in choice.groups:
        parts: dict[tuple[str, str, str], list[str]] = {}
        for p in g.paths:
            is_method = p not in obs.classes
            mod_path = p.rpartition(".")[0] if is_method else p
            kind = kinds.get(p) or (p.rpartition(".")[2] if is_method else OBSERVED)
            callable_ = "method" if is_method else "forward"
            parts.setdefault((kind, callable_, obs.classes.get(mod_path, "")), []).append(p)
        for (kind, callable_, cls), paths in parts.items():
            params = sum(view.numel(p) for p in paths) if callable_ == "forward" else None
            covered += params or 0
            keep = None if ring else OUTPUTS_OUTLIVE_STEP.get(kind)
            table: dict[str, Any] = {} if keep is None else {"clone_outputs": keep}
            if light and light.intersection(paths):  # a trace, not a kernel build
                table["backend"] = LIGHT_BACKEND  # (surgery.planning.compile_cost)
            regions.append(Region(
                kind=kind, callable=callable_, module_class=cls or None, parameters=params,
                compile=table,
                paths=sorted(paths, key=natural_key),
                evidence=_merge_evidence([choice.evidence[p] for p in paths]),
                dynamic=g.dynamic_dims is not None, dynamic_dims=dict(g.dynamic_dims or {}),
                group=g.name))
    regions.sort(key=lambda r: natural_key(r.paths[0]))
    model = {"source": source, "tensors": len(tensors),
             "parameters": sum(t.numel for t in tensors.values()), "covered_parameters": covered,
             **binding_fields(tensors)}  # the key brief a fingerprint mismatch is explained from
    coverage = {**extra, **choice.coverage} if choice.coverage else dict(extra)
    return Manifest(fingerprint=compute_fingerprint(tensors), regions=regions, compile=compile,
                    warmup=dict(DEFAULT_WARMUP),
                    left_out=[LeftOut(p, kinds.get(p, OBSERVED), r) for p, r in choice.left_out],
                    model=model, coverage=coverage)
