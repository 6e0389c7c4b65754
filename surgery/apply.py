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
import inspect
import json
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.cache import CacheRecord, SavedBundle, cache_counters, default_bundle_path, load_bundle
from surgery.compile_options import COMPILE_KEYS, CompilePlan, plan_region
from surgery.errors import RegionError
from surgery.graphs import Capturer, CudaCapturer, RegionGraphs
from surgery.manifest import Manifest, Region
from surgery.report import (
    ApplyReport,
    CacheIgnoredWarning,
    RegionFallbackWarning,
    RegionRecord,
    SurgeryWarning,
)
from surgery.resolve import (
    ENV_MANIFEST,
    ManifestSource,
    check_fingerprint,
    resolve_manifest,
    resolve_path,
)

__all__ = [
    "COMPILE_KEYS", "ENV_MANIFEST", "ApplyHandle", "ApplyReport", "CacheIgnoredWarning",
    "ManifestSource", "RegionFallbackWarning", "RegionRecord", "SurgeryWarning", "apply_manifest",
    "check_fingerprint", "mark_step", "plan_region", "resolve_manifest", "resolve_path",
]

# Before pytorch#128068 (first released in torch 2.5) the caching allocator could not checkpoint
# a private pool that holds expandable segments, which is what cudagraph trees do between
# recordings; users saw "!block->expandable_segment_ INTERNAL ASSERT FAILED". We warn below that
# version. Later versions support it, though distributed set-ups still report hangs with it
# (torchtitan#3306), so the report always notes the setting when CUDA graphs are in use.
_EXPANDABLE_SEGMENTS_OK_FROM = (2, 5)

# Errors raised while dynamo traces or a backend compiles. A region that raises one of these
# falls back to eager; any other exception is the model's own and propagates unchanged.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)


# --- counting what runs ------------------------------------------------------------------------

_ACTIVE = threading.local()  # .stack: the slots whose compiled callable is running


def _active_slot() -> _Slot | None:
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


class _CountingBackend:
    """A torch.compile backend that compiles with the real one and counts what happens.

    Compiles are counted when dynamo hands a graph over; executions are counted by wrapping the
    compiled graph. Both are attributed to the region path whose call is running, which is what
    lets a record say ``compiled`` only when compiled code ran.
    """

    def __init__(self, backend: str, config_patches: dict[str, Any] | None) -> None:
        self.backend = backend
        self.config_patches = config_patches
        self.__name__ = f"surgery_{backend}"  # torch names the compiler after it in its logs
        self.calls_done = 0  # completed compiled calls through this backend's callable

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inner: Callable[..., Any] = torch._dynamo.lookup_backend(self.backend)
        if self.config_patches is not None:
            # The inductor entry point applies these with inductor's config.patch around the
            # compile, which is how mode + options reach it without torch.compile's mode/options
            # check (verified: emulate_precision_casts changes the generated code).
            compiled = inner(gm, example_inputs, config_patches=self.config_patches)
        else:
            compiled = inner(gm, example_inputs)
        slot = _active_slot()
        if slot is not None:
            slot.record.compiles += 1
            if self.calls_done:
                slot.record.recompiles += 1

        def run(*args: Any) -> Any:
            s = _active_slot()
            if s is not None:
                s.record.graphs_run += 1
            return compiled(*args)

        return run

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: free the cudagraph trees, as inductor's own
        torch.compile wrapper does, or their recorded graphs and pools outlive the reset."""
        if self.config_patches and self.config_patches.get("triton.cudagraphs"):
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()


@dataclass
class _Group:
    """One compiled callable shared by every path with the same code and options.

    Identical blocks share it, so dynamo compiles once per distinct structure, not per instance.
    """

    compiled: Callable[..., Any]
    backend: _CountingBackend
    bound: bool  # True: compiled(module, *args); False: compiled(*args)
    slots: list[_Slot] = field(default_factory=list)
    failed: BaseException | None = None


@dataclass
class _Slot:
    """One installed region path: where the wrapper sits and what it replaced."""

    module: nn.Module
    name: str
    had_own: bool  # was `name` in the instance __dict__ before?
    own: Any  # the instance attribute it replaced, if any
    eager: Callable[..., Any]  # the original callable, bound
    record: RegionRecord
    region: Region
    group: _Group
    state: _HandleState
    mode: str = "compiled"  # "compiled" | "eager" | "restored"

    graphs: RegionGraphs | None = None  # surgery's own CUDA graphs (capture = "region")

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = self.record
        rec.calls += 1
        if self.mode != "compiled":
            rec.eager_calls += 1
            return self.eager(*args, **kwargs)
        graphs = self.graphs
        if graphs is None:
            out = self.run_compiled(args, kwargs)[0]
            return _clone_tensors(out) if rec.clone_outputs else out
        replays = graphs.replays
        out = graphs(args, kwargs, self.run_compiled)
        if graphs.replays > replays:  # a replay of a graph captured from compiled code
            rec.compiled_calls += 1
            rec.graph_replays += 1
        rec.graphs_captured = graphs.captures
        rec.output_sets = graphs.output_sets
        rec.capture_s = graphs.capture_s
        rec.clone_outputs = graphs.clone
        return out

    def run_compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """Run the compiled callable (eager after a compile failure); True if a graph ran."""
        rec = self.record
        if self.mode != "compiled":
            return self.eager(*args, **kwargs), False
        g = self.group
        ran_before = rec.graphs_run
        stack = getattr(_ACTIVE, "stack", None)
        if stack is None:
            stack = _ACTIVE.stack = []
        stack.append(self)
        try:
            out = g.compiled(self.module, *args, **kwargs) if g.bound else \
                g.compiled(*args, **kwargs)
        except _COMPILE_ERRORS as exc:
            stack.pop()
            return self._fall_back(exc, args, kwargs), False
        stack.pop()
        g.backend.calls_done += 1
        if rec.graphs_run > ran_before:
            rec.compiled_calls += 1
            if rec.status != "compiled":  # pending, or unproven after warm-up
                rec.status, rec.reason = "compiled", ""
            return out, True
        rec.eager_calls += 1  # dynamo ran the frame without a graph (e.g. recompile limit)
        return out, False

    def raw_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The compiled callable itself, outside the accounting (what a capture records)."""
        g = self.group
        return g.compiled(self.module, *args, **kwargs) if g.bound else g.compiled(*args, **kwargs)

    def warn_graphs(self, message: str) -> None:
        """One warning per region path and message kind, and a note in its record."""
        if message not in self.record.notes:
            self.record.notes.append(message)
        key = (id(self), message[:40])
        if key not in self.state.warned_graphs:
            self.state.warned_graphs.add(key)
            warnings.warn(f"surgery: region {self.region.kind!r} path {self.record.path!r}: "
                          f"{message}", SurgeryWarning, stacklevel=5)

    def _fall_back(self, exc: BaseException, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """Fall back to eager for every path sharing this compiled callable, warning once.

        The eager call runs first: if the original code fails too, the error is the model's own
        and propagates, and nothing is marked as a compile failure.
        """
        cause = _first_line(exc)
        if self.region.on_failure == "error":
            raise RegionError(
                f"region {self.region.kind!r} path {self.record.path!r} failed to compile "
                f"({type(exc).__name__}): {cause}", region=self.record.path,
                hint="fix the code so dynamo can trace it, or set on_failure = \"eager\" on the "
                     "region to run it eagerly") from exc
        out = self.eager(*args, **kwargs)
        self.group.failed = exc
        failed = []
        for s in self.group.slots:
            if s.mode == "compiled":
                s.mode = "eager"
                s.record.status = "eager"
                s.record.reason = f"failed to compile ({type(exc).__name__}: {cause}); runs eager"
                failed.append(s.record.path)
        self.record.eager_calls += 1
        key = id(self.region)
        if key not in self.state.warned_regions:
            self.state.warned_regions.add(key)
            warnings.warn(
                f"surgery: region {self.region.kind!r} could not be compiled and runs eager for "
                f"{', '.join(failed)}: {type(exc).__name__}: {cause}. Set on_failure = \"error\" "
                f"on the region to make this fatal.", RegionFallbackWarning, stacklevel=4)
        return out


def _make_wrapper(slot: _Slot) -> Callable[..., Any]:
    eager = slot.eager

    @functools.wraps(eager)
    def region_call(*args: Any, **kwargs: Any) -> Any:
        # Under an outer torch.compile (a whole-model compile, or a region inside another), let
        # dynamo inline the original code instead of tracing the bookkeeping.
        if torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        return slot.call(args, kwargs)

    region_call.__surgery_slot__ = slot  # type: ignore[attr-defined]
    return region_call


def _clone_tensors(out: Any) -> Any:
    """Clone every tensor in a (nested) output, outside the graph.

    CUDA-graph outputs live in the graph's memory pool and the next replay overwrites them
    (pytorch#152887); a clone made inside the graph lives in that pool too, so it must be here.
    """
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple
        return type(out)(*(_clone_tensors(o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_tensors(o) for o in out)
    if isinstance(out, dict):
        return type(out)((k, _clone_tensors(v)) for k, v in out.items())
    return out


# --- the handle --------------------------------------------------------------------------------

@dataclass
class _HandleState:
    warned_regions: set[int] = field(default_factory=set)
    warned_graphs: set[tuple[int, str]] = field(default_factory=set)


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

    def save_cache(self, path: str | os.PathLike[str] | None = None, *,
                   force: bool = True) -> SavedBundle:
        """Write this process's compile caches as a bundle bound to the manifest (after warm-up).

        ``path`` defaults to ``STEM.surgery.cache`` beside the manifest file (see
        surgery.cache). The next ``apply_manifest(..., cache=path)`` loads it when it fits.
        """
        from surgery.cache import save_from_handle

        return save_from_handle(self, None if path is None else os.fspath(path), force=force)

    def restore(self) -> None:
        """Put back exactly the original callables (and the MHA fastpath). Idempotent."""
        if self.restored:
            return
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
        c = self.report.counts()
        state = "restored" if self.restored else "live"
        return (f"<ApplyHandle {state}: {c['compiled']} compiled, {c['pending']} pending, "
                f"{c['eager']} eager, {c['skipped']} skipped>")


def mark_step() -> None:
    """Open one CUDA-graph step: call before each inference step of a CUDA-graph model.

    cudagraph trees only reuse a graph's memory once they know the previous step's outputs are
    no longer needed; this is how the caller says so.
    """
    torch.compiler.cudagraph_mark_step_begin()


def _on_cuda(module: nn.Module, model: nn.Module) -> bool:
    return torch.cuda.is_available() and _device_of(module, model).type == "cuda"


def _device_of(module: nn.Module, model: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers(), *model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


# --- apply -------------------------------------------------------------------------------------

def apply_manifest(
    model: nn.Module,
    manifest: ManifestSource = None,
    *,
    warmup: Callable[[nn.Module], Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    strict: bool = True,
    passes: int | None = None,
    cache: str | os.PathLike[str] | bool | None = None,
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
    path's second call). ``overrides`` is merged over every region's compile options.
    ``strict=False`` turns a fingerprint mismatch into a warning. Dynamo keeps the compiled code
    cached after ``restore()`` until ``torch._dynamo.reset()``.

    ``cache`` is a compile-cache bundle (``surgery warm`` or ``handle.save_cache()``), or True
    for the one beside the manifest file. It is loaded before anything compiles, only when it
    was built for this manifest, these overrides, this torch / triton / CUDA and this GPU;
    otherwise one CacheIgnoredWarning says why and the regions compile as usual.
    ``report.cache`` records which, and how many warm-up compiles hit the caches.
    """
    m = resolve_manifest(manifest)
    check_fingerprint(model, m, strict=strict)
    records: list[RegionRecord] = []
    report = ApplyReport(records)
    handle = ApplyHandle(model, m, report)
    handle._overrides = dict(overrides or {})
    dev = _device_of(model, model)
    handle._device = str(dev) if dev.type == "cuda" else dev.type
    if cache is not None and cache is not False:
        report.cache = _load_cache(handle, cache)
    state = _HandleState()
    groups: dict[tuple[Any, ...], _Group] = {}

    resolved: list[tuple[Region, str, nn.Module, str]] = []
    problems: list[RegionError] = []
    for region in m.regions:
        for path in region.paths:
            try:
                mod, name = resolve_path(model, path, callable=region.callable)
            except RegionError as e:
                if region.required:
                    problems.append(e)
                else:
                    records.append(RegionRecord(path, region.kind, region.callable, "skipped",
                                                f"optional and not found: {e.message}"))
                continue
            resolved.append((region, path, mod, name))
    if problems:
        first = problems[0]
        more = "".join(f"\n  {p.message}" for p in problems[1:])
        raise RegionError(first.message + more, region=first.region, hint=first.hint)
    _check_nesting(resolved)

    cuda_graph_regions = False
    mha = False
    try:
        for region, path, mod, name in resolved:
            on_cuda = _on_cuda(mod, model)
            plan = plan_region(m, region, overrides=overrides, on_cuda=on_cuda)
            rec = RegionRecord(path, region.kind, region.callable, "pending",
                               backend=plan.backend, options=plan.options,
                               cuda_graphs=plan.cuda_graphs, clone_outputs=plan.clone_outputs,
                               notes=list(plan.notes))
            records.append(rec)
            if plan.eager_reason:
                rec.status, rec.reason = "eager", plan.eager_reason
                continue
            handle._slots.append(_install(mod, name, rec, region, plan, groups, state))
            cuda_graph_regions |= plan.cuda_graphs
            mha |= any(isinstance(x, nn.MultiheadAttention) for x in mod.modules())
        if mha and torch.backends.mha.get_fastpath_enabled():
            # Dynamo does not guard on this flag; the fused fastpath would bypass the graph.
            handle._mha_fastpath = True
            torch.backends.mha.set_fastpath_enabled(False)
            report.notes.append("nn.MultiheadAttention fastpath turned off while applied")
        if cuda_graph_regions:
            _note_expandable_segments(report)
        hits_before = cache_counters()
        _warm_up(handle, m, warmup, passes)
        if report.cache is None:
            report.cache = CacheRecord()
        report.cache.counts = {k: v - hits_before[k] for k, v in cache_counters().items()}
    except BaseException:
        handle.restore()
        raise
    return handle


def _load_cache(handle: ApplyHandle, cache: str | os.PathLike[str] | bool) -> CacheRecord:
    """Load a compile-cache bundle when it fits; otherwise warn once and say why in the report."""
    src = handle.manifest.source_path
    if isinstance(cache, bool):  # True: the bundle beside the manifest file
        path = default_bundle_path(src) if src else ""
    else:
        path = os.fspath(cache)
    loaded, why = False, "cache=True, but the manifest has no file to find a bundle beside"
    if path:
        loaded, why = load_bundle(path, manifest=handle.manifest, overrides=handle._overrides,
                                  device=handle._device)
    if not loaded:
        handle.report.notes.append(f"compile-cache bundle ignored: {why}")
        warnings.warn(f"surgery: compile-cache bundle ignored, compiling as usual: {why}",
                      CacheIgnoredWarning, stacklevel=3)
    return CacheRecord(path or None, loaded, why)


def _check_nesting(resolved: list[tuple[Region, str, nn.Module, str]]) -> None:
    """A region inside a forward region would never run compiled: the outer graph inlines it."""
    forwards = sorted(p for r, p, _, _ in resolved if r.callable == "forward")
    for region, path, _, _ in resolved:
        owner = path if region.callable == "forward" else path.rsplit(".", 1)[0]
        for outer in forwards:
            if outer != path and (owner == outer or owner.startswith(outer + ".")):
                raise RegionError(
                    f"region path {path!r} is inside region {outer!r}: the outer graph would "
                    "inline it, so it would never run its own compiled code", region=path,
                    hint="keep one of the two (`surgery plan` resolves nesting)")


def _install(mod: nn.Module, name: str, rec: RegionRecord, region: Region, plan: CompilePlan,
             groups: dict[tuple[Any, ...], _Group], state: _HandleState) -> _Slot:
    own = vars(mod).get(name)
    if getattr(own, "__surgery_slot__", None) is not None:
        raise RegionError(f"region path {rec.path!r} is already compiled by another "
                          "apply_manifest handle", region=rec.path,
                          hint="restore() the first handle before applying again")
    eager = getattr(mod, name)
    bound = inspect.ismethod(eager) and eager.__self__ is mod
    target = eager.__func__ if bound else eager
    key = (id(target), json.dumps([plan.backend, plan.config_patches, plan.fullgraph,
                                   plan.dynamic], sort_keys=True, default=str))
    group = groups.get(key)
    if group is None:
        backend = _CountingBackend(plan.backend, plan.config_patches)
        compiled = torch.compile(target, backend=backend, fullgraph=plan.fullgraph,
                                 dynamic=plan.dynamic)
        group = groups[key] = _Group(compiled, backend, bound)
    slot = _Slot(mod, name, name in vars(mod), own, eager, rec, region, group, state)
    if plan.capture_region:
        slot.graphs = RegionGraphs(mod, _capturer_for(mod), slot.raw_call,
                                   clone_outputs=plan.clone_outputs, warn=slot.warn_graphs,
                                   notes=rec.notes)
    group.slots.append(slot)
    mod.__dict__[name] = _make_wrapper(slot)
    return slot


_CAPTURERS: dict[int, Capturer] = {}


def _capturer_for(module: nn.Module) -> Capturer:
    """One capturer (side stream and shared memory pool) per CUDA device, for every handle."""
    dev = next((t.device for t in (*module.parameters(), *module.buffers())), None)
    index = dev.index if dev is not None and dev.type == "cuda" and dev.index is not None \
        else torch.cuda.current_device()
    if index not in _CAPTURERS:
        _CAPTURERS[index] = CudaCapturer(index)
    return _CAPTURERS[index]


def _note_expandable_segments(report: ApplyReport) -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        return
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < _EXPANDABLE_SEGMENTS_OK_FROM:
        warnings.warn(
            f"surgery: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments, which cudagraph trees in "
            f"torch {torch.__version__} do not support (pytorch#128068, fixed in torch 2.5): "
            "expect an INTERNAL ASSERT in the caching allocator. Unset it, or upgrade torch.",
            SurgeryWarning, stacklevel=3)
    report.notes.append("expandable_segments is set together with CUDA graphs; if capture "
                        "hangs or asserts, unset it first")


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
    before = counters["stats"]["unique_graphs"]
    for _ in range(n):
        if mark:
            mark_step()
        warmup(handle.model)
    report.warmup_passes = n
    report.dynamo_unique_graphs = counters["stats"]["unique_graphs"] - before
    unproven = []
    for slot in handle._slots:
        rec = slot.record
        if rec.status != "pending":
            continue
        if rec.calls == 0:
            rec.reason = "not called during warm-up"
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "ENV_MANIFEST", "ApplyHandle", "ApplyReport", "CacheIgnoredWarning", "RegionFallbackWarning",
    "RegionRecord",
    "SurgeryWarning", "apply_manifest", "check_fingerprint", "mark_step", "plan_region",
    "resolve_manifest", "resolve_path",
]
