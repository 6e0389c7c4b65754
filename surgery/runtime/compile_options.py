"""The compile settings of one region: manifest defaults, region overrides, call overrides.

torch.compile refuses ``mode`` together with ``options``, and hands inductor-only keys to other
backends as arguments they reject; both are caught here with a fix in the message. Inductor's
mode is translated into its config patches, which is how ``emulate_precision_casts`` can be set
beside a mode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from surgery.errors import RegionError
from surgery.formats.allowlist import compile_refusals
from surgery.formats.manifest import Manifest, Region, load_schema
from surgery.runtime.budget import DEFAULT_MAX_SIGNATURES
from surgery.runtime.resolve import closest_name

# The compile keys a manifest (or an override) may set; anything else is a typo.
COMPILE_KEYS: frozenset[str] = frozenset({
    "backend", "mode", "fullgraph", "dynamic", "options", "emulate_precision_casts",
    "clone_outputs", "on_cpu", "capture", "max_signatures",
})
# Who captures CUDA graphs: the compiler (cudagraph trees under mode="reduce-overhead", or the
# cudagraphs backend), or surgery itself, one graph per region path (see
# surgery.runtime.graphs.replay).
CAPTURES = ("compiler", "region")
CLONE_RISK = ("planned for capture='region', which clones no outputs, but run under the "
              "compiler's CUDA graphs: an output kept across steps (a KV cache) is overwritten by "
              "the next replay. Re-plan with --capture compiler, or set clone_outputs = true on "
              "the regions whose outputs outlive the step")
# The backends a manifest may name (its schema's enum): torch registers each of them itself.
TORCH_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
# Keys that belong to inductor only: torch hands them to other backends as kwargs they reject.
_INDUCTOR_ONLY = ("mode", "options")
# Off by default on CUDA. Where a reduction kernel's compile uses too many registers, inductor
# compiles a copy with half the R-block and, at the kernel's first launch, benchmarks the two and
# keeps the faster. No cache stores that pick, so it is a timing race: on the H200 one Flux
# process launched the halved copy in one graph and the full one in two others of the same
# kernel, another launched the full one everywhere, and a warm start from the bundle differed
# from its cold start by 7.8e-3 (benchmarks/RESULTS.md, the ninth session). With it off, each such
# kernel launches its one config in every process, so a warm start runs the cold start's kernels
# (measured: identical outputs, the tenth session). Two cold starts may still differ: a kernel
# with several configs autotunes by timing, and only the bundle carries its pick to a warm start.
# In turns the default cost Flux about 1.6% (on/off 0.984) and SDPA and BERT nothing shown. A
# manifest may turn it back on with
# ``options = {dynamic_scale_rblock = true}``; code, with overrides={"options": {...}}.
SCALE_RBLOCK = "dynamic_scale_rblock"


@dataclass
class CompilePlan:
    """How one region compiles: backend, inductor patches, and whether it runs eager and why."""

    backend: str
    options: dict[str, Any]  # what the record shows
    config_patches: dict[str, Any] | None  # inductor only
    fullgraph: bool
    dynamic: bool | None
    cuda_graphs: bool
    clone_outputs: bool
    capture_region: bool = False  # surgery captures this region's graphs (runtime.graphs)
    clone_risk: bool = False  # planned for region capture, run under the compiler's graphs
    eager_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    max_signatures: int = DEFAULT_MAX_SIGNATURES  # per path, before a demotion (runtime.budget)


def plan_region(manifest: Manifest, region: Region, *, overrides: Mapping[str, Any] | None,
                on_cuda: bool) -> CompilePlan:
    """The compile settings of one region: defaults, region overrides, then call overrides.

    An override of ``None`` removes a key (e.g. ``{"mode": None, "options": {...}}``).
    """
    # A manifest's settings are data (surgery.formats.allowlist); a Manifest built in memory skipped
    # the reader's validation, so its tables are checked again here. Overrides are the caller's
    # code.
    schema = load_schema()
    for table, where in ((manifest.compile, "compile"), (region.compile,
                                                        f"region {region.kind!r} compile")):
        refused = compile_refusals(table, schema=schema, location=where)
        if refused:
            raise RegionError(refused[0].message, region=region.kind, hint=refused[0].hint)
    layers = [dict(manifest.compile), dict(region.compile), dict(overrides or {})]
    opts: dict[str, Any] = {}
    origin: dict[str, int] = {}
    for level, layer in enumerate(layers):
        for k, v in layer.items():
            if k not in COMPILE_KEYS:
                near = closest_name(k, sorted(COMPILE_KEYS))
                raise RegionError(
                    f"compile option {k!r} is unknown" + (f"; did you mean {near!r}?" if near
                                                          else ""),
                    region=region.kind, hint=f"use one of {sorted(COMPILE_KEYS)}")
            if v is None:
                opts.pop(k, None)
                origin.pop(k, None)
            else:
                opts[k], origin[k] = v, level
    notes: list[str] = []
    backend = str(opts.get("backend", "inductor"))
    # The manifest's backend is one of a fixed set (checked above) that torch always registers;
    # an override is the caller's code, trusted to name any backend registered with torch.
    # torch's list imports every backend module and scans the installed packages' entry points
    # (0.03 s on the 2-core CPU once inductor is imported; before it, AOTAutograd and networkx
    # too), so it is asked only about a name outside the set.
    if backend not in TORCH_BACKENDS and \
            backend not in (known := torch._dynamo.list_backends(exclude_tags=())):
        near = closest_name(backend, known)
        raise RegionError(
            f"region {region.kind!r}: compile backend {backend!r} is not a torch.compile "
            "backend" + (f"; did you mean {near!r}?" if near else ""), region=region.kind,
            hint="use 'inductor', or 'cudagraphs' / 'aot_eager' / 'eager'")
    if backend != "inductor":
        for k in _INDUCTOR_ONLY:
            if k not in opts:
                continue
            if origin[k] < origin.get("backend", 0):
                notes.append(f"{k}={opts.pop(k)!r} dropped: it belongs to inductor and the "
                             f"backend is {backend!r}")
            else:
                raise RegionError(
                    f"region {region.kind!r}: {k!r} is an inductor setting but the backend is "
                    f"{backend!r}", region=region.kind,
                    hint=f"remove {k!r}, or use backend 'inductor'")
    if "mode" in opts and "options" in opts:
        raise RegionError(
            f"region {region.kind!r}: compile sets both mode={opts['mode']!r} and options, "
            "which torch.compile refuses", region=region.kind,
            hint="keep one: mode='reduce-overhead' is options={'triton.cudagraphs': True}; "
                 "an override of {'mode': None} removes an inherited mode")
    budget = opts.get("max_signatures", DEFAULT_MAX_SIGNATURES)
    if type(budget) is not int or not 1 <= budget <= 64:
        raise RegionError(f"region {region.kind!r}: max_signatures={budget!r} is not an integer "
                          "from 1 to 64", region=region.kind,
                          hint=f"use a small integer (default {DEFAULT_MAX_SIGNATURES}): the "
                               "distinct call signatures a path compiles before it is demoted")
    capture = str(opts.get("capture", "compiler"))
    if capture not in CAPTURES:
        raise RegionError(f"region {region.kind!r}: capture={capture!r} is not one of "
                          f"{list(CAPTURES)}", region=region.kind,
                          hint="use 'region' (surgery captures one CUDA graph per region path) "
                               "or 'compiler' (cudagraph trees / the cudagraphs backend)")
    # The compiler's own graphs asked for at a later level than capture='region' (an override
    # over the manifest, say) win, with a note; at the same level they are a contradiction.
    wants_compiler = [k for k, v in (("backend", "cudagraphs"), ("mode", "reduce-overhead"))
                      if opts.get(k) == v]
    if capture == "region" and wants_compiler:
        later = [k for k in wants_compiler if origin[k] > origin["capture"]]
        if later:
            capture = "compiler"
            notes.append(f"capture='region' dropped: {later[0]}={opts[later[0]]!r} asks for "
                         "the compiler's own CUDA graphs")
        elif backend == "cudagraphs":
            raise RegionError(f"region {region.kind!r}: backend 'cudagraphs' captures its own "
                              "CUDA graphs, so capture='region' would capture them twice",
                              region=region.kind,
                              hint="use backend 'inductor' (or 'aot_eager') with "
                                   "capture='region', or capture='compiler'")
    patches: dict[str, Any] | None = None
    cuda_graphs = backend == "cudagraphs"
    if backend == "inductor":
        from torch._inductor import list_mode_options

        mode = opts.get("mode")
        try:
            patches = dict(list_mode_options(mode)) if mode and mode != "default" else {}
        except RuntimeError as e:
            raise RegionError(f"region {region.kind!r}: {e}", region=region.kind) from None
        patches.update(opts.get("options", {}))
        if opts.get("emulate_precision_casts", True):
            patches.setdefault("emulate_precision_casts", True)
        if on_cuda and _has_inductor_option(SCALE_RBLOCK):
            patches.setdefault(SCALE_RBLOCK, False)
        _check_inductor_options(patches, region)
        if capture == "region" and patches.get("triton.cudagraphs"):
            patches["triton.cudagraphs"] = False
            notes.append("inductor's cudagraph trees are off: surgery captures this region's "
                         "CUDA graphs itself (capture='region')")
        cuda_graphs = bool(patches.get("triton.cudagraphs", False))
    cuda_graphs = cuda_graphs or capture == "region"
    eager_reason = None
    if cuda_graphs and not on_cuda:
        if capture == "region":
            what = "capture='region'"
        elif backend != "inductor":
            what = f"backend={backend!r}"
        elif "mode" in opts:
            what = f"mode={opts['mode']!r}"
        else:
            what = "options triton.cudagraphs"
        if opts.get("on_cpu", "eager") == "compile":
            if capture == "region":
                notes.append("capture='region' without CUDA: compiled without CUDA graphs "
                             "(on_cpu='compile')")
            elif backend == "inductor":
                assert patches is not None
                patches["triton.cudagraphs"] = False
                notes.append(f"CUDA-graph region ({what}) without CUDA: compiled with inductor "
                             "on the CPU, without CUDA graphs (on_cpu='compile')")
            else:
                backend = "aot_eager"
                notes.append(f"CUDA-graph region ({what}) without CUDA: compiled with "
                             "aot_eager, the same graph without the CUDA graph (on_cpu='compile')")
            cuda_graphs = False
        else:
            eager_reason = (f"CUDA-graph region ({what}) without CUDA: runs eager "
                            "(on_cpu='eager'; set on_cpu='compile' to compile on the CPU)")
    clone = cuda_graphs and bool(opts.get("clone_outputs", True))
    # A plan for capture='region' clones nothing (surgery keeps a ring of output buffers); the
    # compiler's graphs overwrite kept outputs on the next replay, so say so when an override
    # switched this region to them.
    planned = {**manifest.compile, **region.compile}.get("capture")
    clone_risk = planned == "region" and capture == "compiler" and cuda_graphs and not clone
    if clone_risk:
        notes.append(CLONE_RISK)
    shown: dict[str, Any] = {k: opts[k] for k in ("backend", "mode", "fullgraph", "dynamic",
                                                  "capture") if k in opts}
    shown["backend"] = backend
    if patches:
        shown["inductor_config"] = dict(patches)
    return CompilePlan(backend=backend, options=shown, config_patches=patches,
                 fullgraph=bool(opts.get("fullgraph", True)), dynamic=opts.get("dynamic"),
                 cuda_graphs=cuda_graphs,
                 clone_outputs=clone, clone_risk=clone_risk,
                 capture_region=cuda_graphs and capture == "region" and on_cuda,
                 eager_reason=eager_reason, notes=notes, max_signatures=budget)


def _has_inductor_option(name: str) -> bool:
    """Whether the installed torch's inductor has this config option (not every torch does)."""
    from torch._inductor import config as inductor_config

    return hasattr(inductor_config, name)


def _check_inductor_options(patches: Mapping[str, Any], region: Region) -> None:
    from torch._inductor import config as inductor_config

    valid = inductor_config.get_config_copy()
    for k in patches:
        if k.replace("-", "_") not in valid:
            near = closest_name(k, list(valid))
            raise RegionError(
                f"region {region.kind!r}: inductor has no option {k!r}" +
                (f"; did you mean {near!r}?" if near else ""), region=region.kind,
                hint="see torch._inductor.list_options()")


class RegionPlans:
    """One apply's plans, made once per region and device kind rather than once per path: a plan
    checks the region's compile tables against the allowlist and copies inductor's config, and
    the SDPA example's 80 paths in a few regions took 0.21 s of a warm start on the H200 so."""

    def __init__(self, manifest: Manifest, overrides: Mapping[str, Any] | None,
                 on_cuda: Callable[[Any], bool]) -> None:
        self.manifest = manifest
        self.overrides = overrides
        self.on_cuda = on_cuda  # whether a region's module is on CUDA
        self.plans: dict[tuple[int, bool], CompilePlan] = {}

    def get(self, region: Region, module: Any) -> CompilePlan:
        """The plan of ``region`` for ``module`` (a path of it)."""
        key = (id(region), self.on_cuda(module))  # the manifest keeps its regions alive
        if key not in self.plans:
            self.plans[key] = plan_region(self.manifest, region, overrides=self.overrides,
                                          on_cuda=key[1])
        return self.plans[key]
