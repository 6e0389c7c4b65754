"""``surgery.compile_regions(model)``: plan from the live model and apply, in one call.

Peers offer a one-liner (diffusers' ``model.compile_repeated_blocks()``, accelerate's
``compile_regions(model)``); surgery's file flow (``surgery plan`` -> review the TOML ->
``apply_manifest``) asks a user to write a manifest first. This is the same flow in process, with
nothing skipped:

1. **Plan from the live model.** Without ``step``, from names and the module tree, as
   ``surgery plan --model`` does (surgery.planning.plan.plan_module). With ``step`` (a callable
   that takes the model and runs one inference step, as ``surgery plan --input`` takes), from
   evidence: the step runs ``steps`` times eagerly while every module call is watched, and the
   regions are what the evidence vouches for (surgery.planning.observed: ``watch_model``, then
   ``manifest_from_evidence``), with their evidence and a ``[coverage]`` table in the manifest.
2. **Apply at once**, through ``apply_manifest`` like any manifest: the same binding, the same
   compile-option allowlist (``overrides`` is code, as in ``apply_manifest``), the same per-region
   fallback and report. ``step`` is also the warm-up: it runs the manifest's ``warmup.passes``
   more times under the compiled regions, which captures their CUDA graphs on a GPU.
3. **Return the handle**, whose ``manifest`` is the plan: ``handle.save_manifest(path)`` writes it
   for review, and the next process can ``apply_manifest(model, path)`` without planning again.

The live model's tied weights are recorded in the manifest (surgery.formats.ties), so an export
bound to the saved manifest keeps them.

What it refuses, loudly: a model that is not an ``nn.Module``; a wrapper (``torch.compile``'s
``OptimizedModule``, ``AveragedModel``, DDP), named with the attribute to pass instead
(surgery.runtime.resolve.refuse_wrapper); and a plan with no region at all, which would
otherwise return a handle that compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from surgery.errors import RegionError
from surgery.formats.manifest import Manifest
from surgery.formats.ties import TIED_FIELD, live_ties
from surgery.planning.observed import manifest_from_evidence, watch_model
from surgery.planning.plan import compile_defaults, plan_module
from surgery.runtime.apply import ApplyHandle, apply_manifest
from surgery.runtime.resolve import refuse_wrapper

# Eager steps watched when planning from evidence: enough for a growing cache to show as
# changing shapes (the CLI's --steps default is the same).
WATCHED_STEPS = 4


def compile_regions(
    model: Any,
    step: Callable[[Any], Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    steps: int = WATCHED_STEPS,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    backend: str | None = None,
    mode: str | None = None,
    capture: str | None = None,
    autocast: Any = None,
    passes: int | None = None,
) -> ApplyHandle:
    """Plan ``model``'s compile regions from the live model, apply them in place, return the handle.

    ``step(model)`` runs one inference step (call it as you infer: ``model(x)``,
    ``model.generate(...)``, a denoising loop, under ``no_grad``/``inference_mode``). Given, the
    plan comes from ``steps`` watched eager steps, and the step then warms the regions up
    ``passes`` times (the manifest's ``warmup.passes`` by default). Without it the plan comes
    from names only, and the regions compile on the model's first call. ``include`` /
    ``exclude`` / ``backend`` / ``mode`` / ``capture`` are ``surgery plan``'s options;
    ``autocast`` (a torch dtype) runs the watched steps under autocast; ``overrides`` goes to
    ``apply_manifest``. ``handle.manifest`` is the plan; ``handle.save_manifest(path)`` saves it.
    """
    refuse_wrapper(model, what="compile_regions")
    compile = compile_defaults(backend=backend, mode=mode, capture=capture)
    source = f"{type(model).__module__}.{type(model).__qualname__} (compile_regions)"
    notes: list[str] = []
    if step is None:
        result = plan_module(model, source=source, include=include, exclude=exclude,
                             compile=compile, notes=notes)
        manifest = result.manifest
    else:
        if steps < 1:
            raise RegionError(f"compile_regions(steps={steps}): at least one watched step is "
                              "needed", hint="use steps=4, so a growing cache shows")
        watched = watch_model(model, step, steps=steps, include=include, autocast=autocast)
        manifest = manifest_from_evidence(watched, source=source, include=include,
                                          exclude=exclude, compile=compile, notes=notes)
        ties = live_ties(model)
        if ties:
            manifest.model[TIED_FIELD] = ties
    _refuse_empty(manifest, model, step is not None)
    handle = apply_manifest(model, manifest, warmup=step, overrides=overrides, passes=passes)
    handle.report.notes[:0] = notes
    return handle


def _refuse_empty(manifest: Manifest, model: Any, from_evidence: bool) -> None:
    """A plan with no region would return a handle that compiles nothing: say so instead."""
    if manifest.regions:
        return
    reasons = "; ".join(f"{lo.path}: {lo.reason}" for lo in manifest.left_out[:3])
    how = "the watched steps" if from_evidence else "its module names"
    raise RegionError(
        f"compile_regions found no region in {type(model).__name__} from {how}"
        + (f" (left out: {reasons})" if reasons else ""),
        hint="name the regions with include=['blocks.*'], or pass step= so that the plan "
             "comes from a run" if not from_evidence else
             "name the regions with include=['blocks.*']; the left-out reasons say why each "
             "candidate was refused")
