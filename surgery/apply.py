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

import builtins
import difflib
import functools
import inspect
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.cache import CacheRecord, SavedBundle, cache_counters, default_bundle_path, load_bundle
from surgery.errors import FingerprintMismatchError, ManifestError, RegionError
from surgery.manifest import Manifest, Region, compute_fingerprint, load_manifest, parse_manifest

ENV_MANIFEST = "SURGERY_MANIFEST"
ManifestSource = Manifest | str | os.PathLike[str] | None

# The compile keys a manifest (or an override) may set; anything else is a typo.
COMPILE_KEYS: frozenset[str] = frozenset({
    "backend", "mode", "fullgraph", "dynamic", "options", "emulate_precision_casts",
    "clone_outputs", "on_cpu",
})
# Keys that belong to inductor only: torch hands them to other backends as kwargs they reject.
_INDUCTOR_ONLY = ("mode", "options")

# Before pytorch#128068 (first released in torch 2.5) the caching allocator could not checkpoint
# a private pool that holds expandable segments, which is what cudagraph trees do between
# recordings; users saw "!block->expandable_segment_ INTERNAL ASSERT FAILED". We warn below that
# version. Later versions support it, though distributed set-ups still report hangs with it
# (torchtitan#3306), so the report always notes the setting when CUDA graphs are in use.
_EXPANDABLE_SEGMENTS_OK_FROM = (2, 5)

# Errors raised while dynamo traces or a backend compiles. A region that raises one of these
# falls back to eager; any other exception is the model's own and propagates unchanged.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)


class SurgeryWarning(UserWarning):
    """Something the runtime did differently from what the manifest asked, and why."""


class RegionFallbackWarning(SurgeryWarning):
    """A region could not be compiled and runs eager (one warning per manifest region)."""


class CacheIgnoredWarning(SurgeryWarning):
    """A compile-cache bundle was given but not loaded (stale, corrupt, or for another machine);
    the regions compile as usual. One warning per apply."""


# --- the report --------------------------------------------------------------------------------

@dataclass
class RegionRecord:
    """What happened to one region path. ``status`` is live: it is updated as the model runs.

    - ``compiled``: compiled code ran for this path (``graphs_run`` > 0), so it is proven.
    - ``pending``: compiled and installed, but not called yet (no warm-up, or warm-up did not
      reach it); it turns ``compiled`` on its first call that runs compiled code.
    - ``eager``: runs the original code; ``reason`` says why (no CUDA, failed to trace ...).
    - ``skipped``: an optional path that does not exist on this model.
    """

    path: str
    kind: str
    callable: str
    status: str
    reason: str = ""
    backend: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # what torch.compile was given
    cuda_graphs: bool = False
    clone_outputs: bool = False
    calls: int = 0  # calls into the region
    compiled_calls: int = 0  # calls in which at least one compiled graph ran
    eager_calls: int = 0  # calls that ran the original code
    graphs_run: int = 0  # compiled graph executions
    compiles: int = 0  # graphs compiled while this path ran
    recompiles: int = 0  # compiles after its compiled callable had already run once
    notes: list[str] = field(default_factory=list)


class ApplyReport(Sequence[RegionRecord]):
    """One record per region path, plus what applied to all of them."""

    def __init__(self, records: list[RegionRecord]) -> None:
        self.records = records
        self.notes: list[str] = []
        self.warmup_passes = 0
        self.dynamo_unique_graphs = 0  # torch._dynamo's own counter, over warm-up
        self.cache: CacheRecord | None = None  # compile-cache bundle and cache hits, over warm-up

    def __getitem__(self, i: Any) -> Any:
        return self.records[i]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[RegionRecord]:
        return iter(self.records)

    def by_path(self, path: str) -> RegionRecord:
        for r in self.records:
            if r.path == path:
                return r
        raise KeyError(path)

    def with_status(self, status: str) -> list[RegionRecord]:
        return [r for r in self.records if r.status == status]

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("compiled", "pending", "eager", "skipped")}
        for r in self.records:
            out[r.status] = out.get(r.status, 0) + 1
        out["graphs_compiled"] = sum(r.compiles for r in self.records)
        out["recompiles"] = sum(r.recompiles for r in self.records)
        return out

    def summary(self) -> str:
        """A plain-text table for logs and the CLI (the library itself never prints)."""
        c = self.counts()
        lines = [f"{c['compiled']} compiled, {c['pending']} pending, {c['eager']} eager, "
                 f"{c['skipped']} skipped; {c['graphs_compiled']} graph(s) compiled, "
                 f"{c['recompiles']} recompile(s), {self.warmup_passes} warm-up pass(es)"]
        for r in self.records:
            why = f"  ({r.reason})" if r.reason else ""
            lines.append(f"  {r.status:8} {r.kind:14} {r.path}  calls={r.calls} "
                         f"graphs_run={r.graphs_run} recompiles={r.recompiles}{why}")
        if self.cache is not None and self.cache.line():
            lines.append(f"  {self.cache.line()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


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

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = self.record
        rec.calls += 1
        if self.mode != "compiled":
            rec.eager_calls += 1
            return self.eager(*args, **kwargs)
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
            return self._fall_back(exc, args, kwargs)
        stack.pop()
        g.backend.calls_done += 1
        if rec.graphs_run > ran_before:
            rec.compiled_calls += 1
            if rec.status != "compiled":  # pending, or unproven after warm-up
                rec.status, rec.reason = "compiled", ""
        else:
            rec.eager_calls += 1  # dynamo ran the frame without a graph (e.g. recompile limit)
        if rec.clone_outputs:
            out = _clone_tensors(out)
        return out

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


# --- manifest sources --------------------------------------------------------------------------

def resolve_manifest(source: ManifestSource) -> Manifest:
    """A Manifest from a Manifest, a ``.toml`` path, an exported ``.safetensors``, or the env."""
    if source is None:
        env = os.environ.get(ENV_MANIFEST, "").strip()
        if not env:
            raise ManifestError(
                f"no manifest was given and {ENV_MANIFEST} is not set",
                hint=f"pass apply_manifest(model, 'model{'.surgery.toml'}'), or set "
                     f"{ENV_MANIFEST}=/path/to/model.surgery.toml")
        source = env
    if isinstance(source, Manifest):
        return source
    path = os.fspath(source)
    if path.endswith((".safetensors", ".index.json")):  # an export, single file or sharded
        return _embedded_manifest(path)
    return load_manifest(path)


def _embedded_manifest(path: str) -> Manifest:
    reader = None
    for mod in ("surgery.checkpoint", "surgery.hygiene"):
        try:
            reader = getattr(__import__(mod, fromlist=["read_embedded_manifest"]),
                             "read_embedded_manifest", None)
        except ImportError:
            continue
        if reader is not None:
            break
    if reader is None:
        raise ManifestError(
            f"{path}: reading a manifest embedded in a .safetensors file needs "
            "read_embedded_manifest, which this installation of surgery lacks", path=path,
            hint="pass the .surgery.toml manifest instead, or upgrade surgery")
    found = reader(path)
    if found is None:
        raise ManifestError(f"{path}: carries no embedded surgery manifest", path=path,
                            hint="export it with `surgery export`, or pass the .surgery.toml")
    if isinstance(found, Manifest):
        return found
    if isinstance(found, str):
        return parse_manifest(found, path=path)
    if isinstance(found, Mapping):
        from surgery.manifest import validate

        validate(found, path=path)
        m = Manifest.from_dict(found)
        m.source_path = path
        return m
    raise ManifestError(f"{path}: the embedded manifest reader returned {type(found).__name__}",
                        path=path)


def check_fingerprint(model: nn.Module, manifest: Manifest, *, strict: bool = True) -> str:
    """Compare the manifest's fingerprint with the live model's state dict (canonical keys)."""
    from surgery.hygiene import model_fingerprint

    # The same naming as plan and export: canonical keys, EMA bookkeeping left out.
    sd = model.state_dict()
    actual = model_fingerprint(sd) or compute_fingerprint(sd)
    if actual != manifest.fingerprint:
        where = manifest.source_path or "the manifest"
        msg = (f"{where} was planned for a different model: its fingerprint is "
               f"{manifest.fingerprint}, the live model's state dict gives {actual}")
        hint = ("plan the manifest again for this checkpoint (`surgery plan`), or pass "
                "strict=False to apply it anyway")
        if strict:
            raise FingerprintMismatchError(msg, expected=manifest.fingerprint, actual=actual,
                                           hint=hint)
        warnings.warn(f"surgery: {msg} (strict=False: applying anyway)", SurgeryWarning,
                      stacklevel=3)
    return actual


# --- resolution --------------------------------------------------------------------------------

def _closest(name: str, candidates: Sequence[str]) -> str | None:
    hits = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


def resolve_path(model: nn.Module, path: str, *, callable: str) -> tuple[nn.Module, str]:
    """(module, attribute name) for a region path, or RegionError naming the closest real name.

    ``forward`` paths are module paths; ``method`` paths end in a method of the module before.
    """
    parts = path.split(".")
    mod_parts = parts if callable == "forward" else parts[:-1]
    mod: nn.Module = model
    for i, seg in enumerate(mod_parts):
        children = dict(mod.named_children())
        child = children.get(seg)
        if child is None:
            here = ".".join(parts[:i]) or "the model"
            near = _closest(seg, list(children))
            if near is None and callable == "forward" and i == len(mod_parts) - 1:
                near = _closest(seg, _methods(mod))  # a method listed as a forward region
            guess = ".".join([*parts[:i], near, *parts[i + 1:]]) if near else None
            raise RegionError(
                f"region path {path!r} does not resolve: {here} ({type(mod).__name__}) has no "
                f"submodule {seg!r}" + (f"; did you mean {guess!r}?" if guess else
                                        f"; it has {sorted(children)[:8]}"),
                region=path, hint="fix the path in the manifest, or plan it again")
        mod = child
    if callable == "forward":
        return mod, "forward"
    name = parts[-1]
    owner = ".".join(parts[:-1]) or "the model"
    if isinstance(getattr(mod, name, None), nn.Module):
        raise RegionError(
            f"region path {path!r} names a submodule, not a method", region=path,
            hint=f"list {path!r} in a region with callable = \"forward\"")
    attr = getattr(type(mod), name, None) if name not in vars(mod) else vars(mod)[name]
    if attr is None or not builtins.callable(attr):
        near = _closest(name, _methods(mod))
        guess = f"{owner}.{near}" if near and owner != "the model" else near
        raise RegionError(
            f"region path {path!r} does not resolve: {owner} ({type(mod).__name__}) has no "
            f"method {name!r}" + (f"; did you mean {guess!r}?" if guess else ""),
            region=path, hint="fix the method name in the manifest, or plan it again")
    return mod, name


def _methods(mod: nn.Module) -> list[str]:
    names: set[str] = set()
    for klass in type(mod).__mro__:
        if klass in (nn.Module, object):
            break
        names.update(n for n, v in vars(klass).items()
                     if not n.startswith("_") and inspect.isfunction(v))
    return sorted(names)


# --- options -----------------------------------------------------------------------------------

@dataclass
class _Plan:
    backend: str
    options: dict[str, Any]  # what the record shows
    config_patches: dict[str, Any] | None  # inductor only
    fullgraph: bool
    dynamic: bool | None
    cuda_graphs: bool
    clone_outputs: bool
    eager_reason: str | None = None
    notes: list[str] = field(default_factory=list)


def plan_region(manifest: Manifest, region: Region, *, overrides: Mapping[str, Any] | None,
                on_cuda: bool) -> _Plan:
    """The compile settings of one region: defaults, region overrides, then call overrides.

    An override of ``None`` removes a key (e.g. ``{"mode": None, "options": {...}}``).
    """
    layers = [dict(manifest.compile), dict(region.compile), dict(overrides or {})]
    opts: dict[str, Any] = {}
    origin: dict[str, int] = {}
    for level, layer in enumerate(layers):
        for k, v in layer.items():
            if k not in COMPILE_KEYS:
                near = _closest(k, sorted(COMPILE_KEYS))
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
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        near = _closest(backend, known)
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
        _check_inductor_options(patches, region)
        cuda_graphs = bool(patches.get("triton.cudagraphs", False))
    eager_reason = None
    if cuda_graphs and not on_cuda:
        if backend != "inductor":
            what = f"backend={backend!r}"
        elif "mode" in opts:
            what = f"mode={opts['mode']!r}"
        else:
            what = "options triton.cudagraphs"
        if opts.get("on_cpu", "eager") == "compile":
            if backend == "inductor":
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
    shown: dict[str, Any] = {k: opts[k] for k in ("backend", "mode", "fullgraph", "dynamic")
                             if k in opts}
    shown["backend"] = backend
    if patches:
        shown["inductor_config"] = dict(patches)
    return _Plan(backend=backend, options=shown, config_patches=patches,
                 fullgraph=bool(opts.get("fullgraph", True)), dynamic=opts.get("dynamic"),
                 cuda_graphs=cuda_graphs,
                 clone_outputs=cuda_graphs and bool(opts.get("clone_outputs", True)),
                 eager_reason=eager_reason, notes=notes)


def _check_inductor_options(patches: Mapping[str, Any], region: Region) -> None:
    from torch._inductor import config as inductor_config

    valid = inductor_config.get_config_copy()
    for k in patches:
        if k.replace("-", "_") not in valid:
            near = _closest(k, list(valid))
            raise RegionError(
                f"region {region.kind!r}: inductor has no option {k!r}" +
                (f"; did you mean {near!r}?" if near else ""), region=region.kind,
                hint="see torch._inductor.list_options()")


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
    on the first real call. ``overrides`` is merged over every region's compile options.
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
            on_cuda = torch.cuda.is_available() and _device_of(mod, model).type == "cuda"
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


def _install(mod: nn.Module, name: str, rec: RegionRecord, region: Region, plan: _Plan,
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
    group.slots.append(slot)
    mod.__dict__[name] = _make_wrapper(slot)
    return slot


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "ENV_MANIFEST", "ApplyHandle", "ApplyReport", "CacheIgnoredWarning", "RegionFallbackWarning",
    "RegionRecord",
    "SurgeryWarning", "apply_manifest", "check_fingerprint", "mark_step", "plan_region",
    "resolve_manifest", "resolve_path",
]
