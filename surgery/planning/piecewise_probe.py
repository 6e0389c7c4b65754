"""The piecewise probe: a planned piecewise block that cannot trace is left out at plan time.

Why. Whether a streaming block traces as one graph (surgery.runtime.piecewise compiles it
``fullgraph``) is known only when dynamo traces it: a graph break inside (a ``print``,
``torch._dynamo.graph_break()``, an unsupported call) or a branch on the cache length (dynamo
specializes the dim the manifest marks dynamic). The runtime then runs the block eager with
the reason in its record, so nothing crashes, but a manifest planned from names alone promises
a piecewise region that never runs compiled, and its coverage counts it. A plan that can run
the model, the evidence planner (``plan --input STEP``, ``plan_from_step``), holds the live
model and the user's STEP, so it asks the runtime before writing the manifest.

How (``probe_piecewise``). A copy of the planned manifest that holds only its piecewise
regions (the blocks and a decoder stack with its blocks standing by, surgery.planning.stacks),
each with ``on_failure = "eager"``, is applied to the live model with the overrides
``PROBE_OVERRIDES``: ``aot_eager`` (dynamo's and AOTAutograd's trace, no kernel build) and the
compiler's capture (which aot_eager never uses: no CUDA graph, no region graph memory). A graph
break and a branch on the cache length are dynamo's findings, made before any backend runs, so
the cheap backend finds what inductor would. STEP runs once, under the plan's autocast, with
the runtime's fallback warnings caught (their reason goes into the manifest instead). Then:

- a path whose record ended ``eager`` after being called, with a reason (the runtime's
  ``why_not_piecewise``: a graph break, a branch on the cache length, a compile that failed),
  is **refused**: the planner plans again without it (surgery.planning.streaming's
  ``refused``), so the block keeps the treatment the plan had without ``--piecewise`` (its
  small children as regions), with the reason under ``[[left_out]]``. A refused stack leaves
  its blocks as piecewise regions of their own, as the runtime would have run them;
- a path never entered (the step did not reach it, its cache was empty on every call, or it
  stood by for a stack that compiled) is kept: the runtime checks it when it runs.

What one step cannot see: a branch on the cache length that dynamo only guards (``len % 2 ==
0``, ``len > 4``: tried, the step compiles) rather than specializes (the marked dim made a
constant, which raises). Such a block recompiles as the length changes and the runtime demotes
it past its budget, with the reason in its record, as without the probe.

What is safe when the probe itself fails (``apply_manifest`` raises, or STEP raises under the
probe where it ran eager in every observed step): every piecewise path is refused, with the
error. The plain plan is what the observed eager steps vouched for; the piecewise regions are
the only thing the probe added, so they are what broke the step, and a deployment of them
could break the same way. Losing the piecewise speed is the price of never shipping a plan
that failed its one trial run.

The model afterwards. ``handle.restore()`` runs in a ``finally``: every forward the probe
replaced is put back exactly (the slot keeps the instance attribute it replaced, or its
absence), and no hook is installed (the default-stream route is off). The compiled code lives
on fresh copies of the forwards (surgery.runtime.budget's ``fresh_function``), so the model's
own code objects carry no dynamo cache entry. Parameters are never written; STEP runs once
more, so a stream or cache the model keeps is one step further on than after the observed
steps (the evidence plan's contract already: reset a stream before deploying).

Cost. One step, traced by dynamo once per piecewise group and signature on aot_eager, and no
kernel build (the tiny SDPA example's probe: see benchmarks/RESULTS.md, issue 19 (x19b)).

A names-only plan (``plan --piecewise`` of a factory or a checkpoint) has no step to run, so it
probes nothing: its notes say that a graph break is checked at run time (surgery.planning.
streaming's ``NAMES_ONLY_NOTE``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from surgery.formats.manifest import PIECEWISE_KIND, Manifest
from surgery.runtime.apply import apply_manifest
from surgery.runtime.slots import first_line

# What the probe compiles with: a trace, no kernel build, and no CUDA graph.
PROBE_OVERRIDES: dict[str, Any] = {"backend": "aot_eager", "capture": "compiler",
                                   "on_cpu": "compile"}
# The runtime's fallback reasons end with this (surgery.runtime.piecewise ``_fail``).
_RUNS_EAGER = "; runs eager"


@dataclass
class Probe:
    """What one traced step showed: refused paths (with the reason), the paths that ran
    compiled, those the step never entered, and the probe's own failure, if any."""

    refused: dict[str, str] = field(default_factory=dict)
    compiled: list[str] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)
    error: str | None = None


def probe_manifest(manifest: Manifest) -> Manifest:
    """A copy of ``manifest`` with only its piecewise regions, each falling back to eager."""
    probe = copy.deepcopy(manifest)
    probe.regions = [r for r in probe.regions if r.kind == PIECEWISE_KIND]
    for region in probe.regions:
        region.on_failure = "eager"
    return probe


def refusal(reason: str) -> str:
    """The ``[[left_out]]`` reason for a block the probe saw fall back with ``reason``."""
    why = reason[:-len(_RUNS_EAGER)] if reason.endswith(_RUNS_EAGER) else reason
    return (f"not piecewise: {why}, found at plan time by one step traced on aot_eager; it "
            "keeps the plan's treatment without --piecewise")


def probe_piecewise(manifest: Manifest, model: Any, step: Callable[[Any], Any], *,
                    autocast: torch.dtype | None = None) -> Probe:
    """Apply the piecewise regions of ``manifest`` on aot_eager, run ``step(model)`` once,
    read each path's record and restore the model (see the module docstring)."""
    probe = probe_manifest(manifest)
    paths = [p for r in probe.regions for p in r.paths]
    out = Probe()
    if not paths:
        return out
    p = next(iter(model.parameters()), None)
    dev = p.device.type if p is not None else "cpu"
    handle = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallbacks' reasons go into the manifest
            handle = apply_manifest(model, probe, overrides=PROBE_OVERRIDES, strict=False,
                                    route_default_stream=False)
            if autocast is not None:
                with torch.autocast(dev, dtype=autocast):
                    step(model)
            else:
                step(model)
    except Exception as exc:  # the probe must never crash the plan: see the docstring
        out.error = f"{type(exc).__name__}: {first_line(exc)}"
        out.refused = dict.fromkeys(paths, (
            f"not piecewise: the plan's probe (one step with the piecewise regions on "
            f"aot_eager) failed ({out.error}); it keeps the plan's treatment without "
            "--piecewise"))
        return out
    finally:
        if handle is not None:
            handle.restore()
    for rec in handle.report:
        if rec.status == "eager" and rec.calls and rec.reason:
            out.refused[rec.path] = refusal(rec.reason)
        elif rec.status == "compiled":
            out.compiled.append(rec.path)
        else:
            out.unreached.append(rec.path)
    return out


def probe_notes(found: Probe) -> list[str]:
    """The plan's notes on what the probe found (one or two lines)."""
    if found.error is not None:
        return [f"the piecewise probe failed ({found.error}): no block is planned piecewise; "
                "the plan keeps the treatment it had without --piecewise"]
    notes = [f"piecewise probe (one step on aot_eager): {len(found.compiled)} path(s) traced "
             f"as one graph, {len(found.refused)} left out, {len(found.unreached)} not entered "
             "by the step (checked at run time)"]
    if found.refused:
        path, why = next(iter(found.refused.items()))
        notes.append(f"left out as not piecewise at plan time: {len(found.refused)} path(s), "
                     f"e.g. {path}: {why}")
    return notes
