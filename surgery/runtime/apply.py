"""Runtime: compile exactly a manifest's regions in place, warm them up, prove it, restore.

``apply_manifest(model, manifest)`` replaces ``forward`` (or the named method) *on the instance*
of every region path with a small wrapper around a ``torch.compile``-d callable. The module is
never swapped in its parent, so ``state_dict()`` keys are identical before, during and after,
and ``restore()`` puts the exact original callables back.

Nothing is assumed: the compile backend is wrapped so that every compiled graph *execution* is
counted against the region that ran it. A record says ``compiled`` only once compiled code has
actually run for it; a region that fails to trace falls back to eager with one warning (or raises
when its ``on_failure = "error"``), and the report says why.

Deployment imports only torch, jsonschema and the manifest reader: no click, no tomli-w.
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from surgery.errors import CacheBundleError
from surgery.formats.manifest import PIECEWISE_KIND, Manifest, Region, save_manifest
from surgery.runtime.budget import parameter_names
from surgery.runtime.bundle import default_bundle_path
from surgery.runtime.cache import SavedBundle, cache_counters, save_bundle
from surgery.runtime.compile_options import (
    CLONE_RISK,
    COMPILE_KEYS,
    CompilePlan,
    RegionPlans,
    plan_region,
)
from surgery.runtime.compile_start import start_compile_pool
from surgery.runtime.graph_memory import collect_memory, note_expandable_segments, parse_size
from surgery.runtime.graphs.arena import arena_of
from surgery.runtime.graphs.capture import Capturer, CudaCapturer
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.groups import DimMarks, _Group
from surgery.runtime.piecewise import PiecewiseGroup, install_piecewise
from surgery.runtime.piecewise_stack import settle_standby
from surgery.runtime.precompiled import Loaded, build_section, load_for_apply, report_use
from surgery.runtime.report import (
    ApplyReport,
    CacheIgnoredWarning,
    CacheRecord,
    RegionFallbackWarning,
    RegionRecord,
    SurgeryWarning,
    warn_eager_on_cpu,
)
from surgery.runtime.resolve import (
    ENV_MANIFEST,
    ManifestSource,
    _check_nesting,
    bind_model,
    callable_at,
    check_fingerprint,
    resolve_manifest,
    resolve_path,
    resolve_regions,
)
from surgery.runtime.shared_pieces import Sharing, piece_sharing
from surgery.runtime.signatures import group_key, signature_check
from surgery.runtime.slots import _HandleState, _make_wrapper, _Slot
from surgery.runtime.stream_route import StreamRoute, install_route
from surgery.runtime.warm_loader import mark_step

__all__ = [
    "COMPILE_KEYS", "ENV_MANIFEST", "ApplyHandle", "ApplyReport", "CacheIgnoredWarning",
    "ManifestSource", "RegionFallbackWarning", "RegionRecord", "SurgeryWarning", "apply_manifest",
    "check_fingerprint", "mark_step", "plan_region", "resolve_manifest", "resolve_path"]

class ApplyHandle:
    """A live application of a manifest. ``restore()`` (or leaving the ``with``) undoes it."""

    def __init__(self, model: nn.Module, manifest: Manifest, report: ApplyReport) -> None:
        self.model = model
        self.manifest = manifest
        self.report = report
        self._slots: list[_Slot] = []
        self._mha_fastpath: bool | None = None  # the value to put back, when we changed it
        self.restored = False
        self._overrides: dict[str, Any] = {}  # what a saved cache bundle was compiled with
        self._device = "cpu"
        self.groups: list[_Group] = []  # compiled callables, shared by paths (save_cache
        self.precompiled: Loaded | None = None  # precompiles them); a bundle's artifacts
        self.route: StreamRoute | None = None  # default-stream calls onto the side stream

    def save_cache(self, path: str | os.PathLike[str] | None = None, *, force: bool = True,
                   key: bytes | None = None, precompile: bool = True, aoti: bool = False
                   ) -> SavedBundle:
        """Write this process's compile caches as a bundle bound to the manifest (after warm-up).

        ``path`` defaults to ``STEM.surgery.cache`` beside the manifest file (see
        surgery.runtime.bundle). The bundle is signed with ``key``, or the deployer's key from
        the environment (surgery.runtime.signing). The next ``apply_manifest(..., cache=path)``
        loads it when its signature verifies and it fits. With ``precompile`` (and a torch that
        has the AOT path), each compiled group and signature seen in warm-up is also compiled
        ahead of time into the bundle, so that deployment runs it without dynamo
        (surgery.runtime.precompiled); ``aoti``, an AOTInductor package (runtime.aoti_build).
        """
        if path is None:
            if not self.manifest.source_path:
                raise CacheBundleError(
                    "the manifest was built in memory, so there is no file to put the bundle "
                    "beside", path="", hint="pass a path: handle.save_cache('model.surgery.cache')")
            path = default_bundle_path(self.manifest.source_path)
        target = os.fspath(path)
        part = None
        if precompile:
            section = build_section(self.groups, aoti=aoti, device=self._device)
            part = (section.data, section.record())
        saved = save_bundle(target, manifest=self.manifest, overrides=self._overrides,
                            device=self._device, force=force, key=key, precompiled=part)
        if self.report.cache is None:
            self.report.cache = CacheRecord()
        self.report.cache.saved_to = target
        return saved

    def save_manifest(self, path: str | os.PathLike[str], *, force: bool = False) -> None:
        """Write the applied manifest (``compile_regions``' plan) as TOML, atomically, to review."""
        save_manifest(self.manifest, os.fspath(path), force=force)

    def restore(self) -> None:
        """Put back exactly the original callables (and the MHA fastpath). Idempotent."""
        if self.restored:
            return
        if self.route is not None:  # installed last, over any region on the root's forward
            self.route.remove()
        for slot in reversed(self._slots):
            d = slot.module.__dict__
            if slot.had_own:
                d[slot.name] = slot.own
            else:
                d.pop(slot.name, None)
            slot.mode = "restored"  # a wrapper someone kept a reference to now runs eager
            if slot.graphs is not None:
                slot.graphs.drop("restored")  # frees the owned buffers and graphs
                slot.graphs = None
        self._slots.clear()
        if self._mha_fastpath is not None:
            torch.backends.mha.set_fastpath_enabled(self._mha_fastpath)
            self._mha_fastpath = None
        self.restored = True

    def __enter__(self) -> ApplyHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        c, state = self.report.counts(), "restored" if self.restored else "live"
        return (f"<ApplyHandle {state}: {c['compiled']} compiled, {c['pending']} pending, "
                f"{c['eager']} eager, {c['skipped']} skipped>")


def _on_cuda(module: nn.Module, model: nn.Module) -> bool:
    return torch.cuda.is_available() and _device_of(module, model).type == "cuda"


def _device_of(module: nn.Module, model: nn.Module) -> torch.device:
    # Lazily: the first tensor decides, and a tuple of every tensor walked the whole model
    # (0.12 s a call for the SDPA example at LingBot size, on the 2-core CPU).
    for t in itertools.chain(module.parameters(), module.buffers(), model.parameters(),
                             model.buffers()):
        return t.device
    return torch.device("cpu")


def apply_manifest(
    model: nn.Module,
    manifest: ManifestSource = None,
    *,
    warmup: Callable[[nn.Module], Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    strict: bool = True,
    passes: int | None = None,
    cache: str | os.PathLike[str] | bool | None = None,
    max_graph_memory: int | str | None = None,
    route_default_stream: bool = True,
) -> ApplyHandle:
    """Compile the manifest's regions of ``model`` in place, warm them up, and report.

    ``manifest`` is a Manifest, a ``.surgery.toml`` path, an exported ``.safetensors`` (or the
    ``.index.json`` of a sharded export) that carries its manifest, or None to read the path
    from ``$SURGERY_MANIFEST``. ``warmup(model)`` is called ``passes`` times (the manifest's
    ``warmup.passes`` by default), each opened with ``cudagraph_mark_step_begin()`` when
    ``warmup.mark_step``; without it, records stay ``pending`` until the model's first call
    proves them. Warm up with the same grad mode and shapes as inference, or dynamo recompiles
    on the first real call; with ``capture = "region"`` (the plan's default) warm up under
    ``no_grad`` or ``inference_mode``, since region graphs are captured only there (from each
    path's second call, its first with precompiled code). ``overrides`` is merged over every
    region's compile options. ``strict=False`` turns a fingerprint mismatch into a warning.
    Dynamo keeps the compiled code cached after ``restore()`` until ``torch._dynamo.reset()``.

    ``cache`` is a compile-cache bundle (``surgery warm`` or ``handle.save_cache()``), or True
    for the one beside the manifest file. It is loaded before anything compiles, only when it
    was built for this manifest, these overrides, this torch / triton / CUDA and this GPU;
    otherwise one CacheIgnoredWarning says why and the regions compile as usual. Its
    precompiled code (format 3, surgery.runtime.precompiled) is installed in the groups and runs
    without dynamo. ``report.cache`` records which, and how many warm-up compiles hit the caches.

    ``max_graph_memory`` (bytes, or ``"2GiB"``) caps what region graphs hold on the device;
    past it, paths run compiled without a graph (surgery.runtime.graph_memory).
    ``report.memory`` says what they hold, per path and in total. With ``route_default_stream``,
    calls on the default stream run on the graphs' side stream (surgery.runtime.stream_route).
    A cold start on CUDA starts inductor's compile workers before the warm-up's first trace
    (surgery.runtime.compile_start).
    """
    dev = _device_of(model, model)
    m = resolve_manifest(manifest)
    cap = parse_size(max_graph_memory)
    binding = bind_model(model, m, strict=strict)
    records: list[RegionRecord] = []
    report = ApplyReport(records)
    report.notes += binding.notes  # a cast since the plan, an older fingerprint
    handle = ApplyHandle(model, m, report)
    report.memory_source = lambda: collect_memory(handle._slots)
    handle._overrides = dict(overrides or {})
    handle._device = str(dev) if dev.type == "cuda" else dev.type
    if cache is not None and cache is not False:
        report.cache, handle.precompiled = load_for_apply(
            cache, manifest=m, overrides=handle._overrides, device=handle._device,
            notes=report.notes)
    state = _HandleState()
    groups: dict[tuple[Any, ...], _Group] = {}
    piecewise_groups: dict[Any, PiecewiseGroup] = {}

    resolved = resolve_regions(model, m, records)  # every path, or one error naming all
    _check_nesting(resolved)

    cuda_graph_regions = mha = False
    capped: set[int] = set()  # arenas whose cap this apply set
    clone_risk: list[str] = []
    plans = RegionPlans(m, overrides, lambda mod: _on_cuda(mod, model))  # once per region
    try:
        share = piece_sharing(resolved, plans.get, piecewise_groups)  # (shared_pieces)
        for region, path, mod, name in resolved:
            plan = plans.get(region, mod)
            rec = RegionRecord(path, region.kind, region.callable, "pending",
                               backend=plan.backend, options=dict(plan.options),
                               cuda_graphs=plan.cuda_graphs, clone_outputs=plan.clone_outputs,
                               notes=list(plan.notes))
            records.append(rec)
            if plan.eager_reason:
                rec.status, rec.reason = "eager", plan.eager_reason
                continue
            if region.kind == PIECEWISE_KIND:  # one graph split at the cache (runtime.piecewise)
                handle._slots.append(install_piecewise(  # type: ignore[arg-type]
                    mod, name, rec, region, plan, piecewise_groups,
                    _capturer_for(mod) if plan.capture_region else None))
            else:
                handle._slots.append(_install(mod, name, rec, region, plan, groups, state,
                                              handle.precompiled, share))
            if plan.capture_region:  # the cap is per device: the latest apply sets it
                arena = arena_of(_capturer_for(mod))
                if id(arena) not in capped:  # this apply's demotions only (collect_memory)
                    capped.add(id(arena))
                    arena.demoted = []
                arena.limit = cap
            cuda_graph_regions |= plan.cuda_graphs
            clone_risk += [path] if plan.clone_risk else []
            mha |= any(isinstance(x, nn.MultiheadAttention) for x in mod.modules())
        handle.groups = list(groups.values())
        if handle.precompiled is not None and report.cache is not None:
            report_use(handle.precompiled, report.cache, notes=report.notes)
        warn_eager_on_cpu(report)
        if mha and torch.backends.mha.get_fastpath_enabled():
            # Dynamo does not guard on this flag; the fused fastpath would bypass the graph.
            handle._mha_fastpath = True
            torch.backends.mha.set_fastpath_enabled(False)
            report.notes.append("nn.MultiheadAttention fastpath turned off while applied")
        if cuda_graph_regions:
            note_expandable_segments(report)
        if clone_risk:
            warnings.warn(f"surgery: {len(clone_risk)} region path(s) (e.g. {clone_risk[0]}) "
                          f"were {CLONE_RISK}", SurgeryWarning, stacklevel=2)
        handle.route = install_route(model, handle._slots, enabled=route_default_stream,
                                     notes=report.notes)
        hits_before = cache_counters()
        _warm_up(handle, m, warmup, passes)
        report.cache = report.cache or CacheRecord()
        report.cache.counts = {k: v - hits_before[k] for k, v in cache_counters().items()}
    except BaseException:
        handle.restore()
        raise
    return handle


def _install(mod: nn.Module, name: str, rec: RegionRecord, region: Region, plan: CompilePlan,
             groups: dict[tuple[Any, ...], _Group], state: _HandleState,
             precompiled: Loaded | None, share: Sharing) -> _Slot:
    own, eager, bound, target = callable_at(mod, name, path=rec.path)
    dynamic = True if region.dynamic else plan.dynamic  # plan --input saw only sizes vary
    # The dims that varied, and only those, compile dynamic (DimMarks, surgery.runtime.groups).
    marks = DimMarks(region.dynamic_dims, parameter_names(eager)) if region.dynamic else None
    options = [plan.backend, plan.config_patches, plan.fullgraph, dynamic]
    if marks:
        options.append(marks.text())
    key = group_key(target, options, mod, region.group)
    group = groups.get(key)
    if group is None:
        group = groups[key] = _Group.create(
            target, bound=bound, backend=plan.backend, config_patches=plan.config_patches,
            fullgraph=plan.fullgraph, dynamic=dynamic, marks=marks or None,
            shared=share(mod, plan, dynamic))  # pieces of a piecewise block of its class
        if precompiled is not None:
            group.precompiled = precompiled.take(group.identity, target, bound=bound)
    slot = _Slot(mod, name, name in vars(mod), own, eager, rec, region, group, state,
                 budget=plan.max_signatures, names=parameter_names(eager))
    if dynamic is True:  # already dynamic: its budget counts compiles, not shapes
        slot.dyn = group
        rec.signature_mode = "dynamic"
    if plan.capture_region:
        slot.graphs = RegionGraphs(mod, _capturer_for(mod), slot.raw_call,
                                   clone_outputs=plan.clone_outputs, warn=slot.warn_graphs,
                                   notes=rec.notes, label=rec.path)
        slot.graphs.ready = functools.partial(group.ready_for, slot)
    slot.check = signature_check(region.evidence, rec.path, eager, region.dynamic_dims)
    group.slots.append(slot)
    mod.__dict__[name] = _make_wrapper(slot)
    return slot


_CAPTURERS: dict[int, Capturer] = {}


def _capturer_for(module: nn.Module) -> Capturer:
    """One capturer (its memory pool, and a side stream if needed) per CUDA device, for all."""
    dev = next((t.device for t in (*module.parameters(), *module.buffers())), None)
    index = dev.index if dev is not None and dev.type == "cuda" and dev.index is not None \
        else torch.cuda.current_device()
    if index not in _CAPTURERS:
        _CAPTURERS[index] = CudaCapturer(index)
    return _CAPTURERS[index]


def _warm_up(handle: ApplyHandle, manifest: Manifest,
             warmup: Callable[[nn.Module], Any] | None, passes: int | None) -> None:
    """Run the warm-up passes, then settle every installed record's status from the counts."""
    from torch._dynamo.utils import counters

    report = handle.report
    n = int(manifest.warmup.get("passes", 3) if passes is None else passes)
    if warmup is None or n == 0:
        if handle._slots:
            report.notes.append("no warm-up ran: installed regions stay 'pending' until a call "
                                "runs their compiled code")
        return
    mark = bool(manifest.warmup.get("mark_step", True))
    report.notes += start_compile_pool(handle._slots, handle._device, report.cache)
    before = counters["stats"]["unique_graphs"]
    for _ in range(n):
        if mark:
            mark_step()
        warmup(handle.model)
    report.warmup_passes = n
    report.dynamo_unique_graphs = counters["stats"]["unique_graphs"] - before
    unproven = []
    standing_by = settle_standby(handle._slots, report)
    for slot in handle._slots:
        rec = slot.record
        if rec.status != "pending":
            continue
        if id(slot) in standing_by:
            continue  # a block of a piecewise stack: runs only if the stack runs eager
        if rec.calls == 0:
            rec.reason = "not called during warm-up"
        elif rec.empty_cache_calls == rec.calls:  # piecewise: each call a prefill, run eager
            rec.reason = (f"called {rec.calls} time(s) in warm-up, each with an empty cache, "
                          "which runs eager: warm up with calls that fill it (a generate() of 2+ "
                          "tokens, 2+ frames of a stream); it compiles on the first such call")
        else:
            rec.status = "eager"
            rec.reason = (f"called {rec.calls} time(s) in warm-up but no compiled graph ran "
                          "(dynamo ran it eagerly; see TORCH_LOGS=recompiles,graph_breaks)")
        unproven.append(f"{rec.path} ({rec.reason})")
    if unproven:
        warnings.warn(f"surgery: {len(unproven)} region path(s) did not run compiled code in "
                      f"warm-up: {'; '.join(unproven[:6])}" +
                      (" ..." if len(unproven) > 6 else ""), SurgeryWarning, stacklevel=3)
    uncaptured = [s.record.path for s in handle._slots
                  if s.graphs is not None and not s.graphs.disabled and s.graphs.captures == 0
                  and s.record.status == "compiled"]
    if uncaptured:
        report.notes.append(
            f"{len(uncaptured)} region path(s) captured no CUDA graph in warm-up (e.g. "
            f"{uncaptured[0]}): region graphs are captured from the second call under no_grad "
            "or inference_mode, so warm up in the mode you infer in; until then they capture "
            "on the first inference calls")
