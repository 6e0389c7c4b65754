"""Precompiled regions: compiled code that runs without dynamo, carried inside the signed bundle.

Why. A Mega-Cache bundle (surgery.runtime.cache) fills inductor's caches, but the deploying
process still runs dynamo over every region and looks the artifacts up by key: on a LingBot-Map
size model that left the warm start at half of the cold one (issue 23). torch 2.10+ compiles a
function ahead of time: ``torch.compile(fn, fullgraph=True).aot_compile((args, kwargs))``
returns a callable whose guards, dynamo-rewritten bytecode and compiled code serialise to
bytes, which ``torch.compiler.load_compiled_function`` turns back into it without tracing. On a
torch without that path the bundle holds the Mega-Cache part only, and says so.

What is precompiled. Per compiled group (one function and one set of compile options,
surgery.runtime.groups) and per static signature it compiled, one artifact, made when the bundle
is saved, from an *example* recorded at that signature's first call: each tensor's shape,
strides, dtype, device and flags; scalars, strings and None by value; tuples, lists and dicts of
these; the grad, inference and autocast modes (an artifact is traced, and loaded, under them).
No tensor is kept. Other objects, dynamic compiles and backends torch cannot serialise
(cudagraphs, eager) are left to the Mega-Cache part, with a note.

How it is matched. An artifact names its group by identity (the function's module and
qualname, a sha256 of its code, the compile options) and its signature by text (repr
of surgery.runtime.budget.call_signature). A group whose identity differs (the code changed since
the bundle was built) uses none of them and compiles with dynamo; unused artifacts are reported
stale, in one warning.

How it runs. A call whose signature has an artifact runs it once torch's own guards pass
(``guard_check``); otherwise the call goes to dynamo, as without a bundle. Counting, the
signature budget, fallback to eager, CUDA-graph capture and restore stay those of
surgery.runtime.slots; a region graph may be captured on the first call, since nothing compiles
in it (surgery.runtime.graphs.replay).

AOTInductor runners (``save_cache(aoti=True)``, surgery.runtime.aoti_build): a group takes a
runner for each signature with a package, artifacts for the others only, so a warm start whose
signatures all have runners never imports torch's Python loader nor unpickles an artifact.

Trust. An artifact is code (a pickle of bytecode and kernels). Its bytes exist in memory only
from a bundle whose HMAC verified with the deployer's key, and reach torch only once the bundle
fits this manifest and machine (surgery.runtime.cache). Its index (read without torch by
surgery.runtime.bundle_parts) is the key holder's, yet every field is checked, so that a
builder's bug becomes an ignored bundle, never an exception in a deployment.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import time
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from surgery.formats.manifest import Manifest
from surgery.runtime.aoti_build import build_entries
from surgery.runtime.aoti_bundle import DeferredMegaCache, load_runners
from surgery.runtime.aoti_bundle import api_missing as aoti_missing
from surgery.runtime.bundle import default_bundle_path, one_line
from surgery.runtime.bundle_parts import SOURCES_FIELD, AotiParsed, Parsed, record_format
from surgery.runtime.cache import open_bundle
from surgery.runtime.call_example import Example, modes_of
from surgery.runtime.kernel_ids import KERNELS_FIELD, KernelRecord, kernel_record, pin_kernels
from surgery.runtime.load_timing import LoaderSetup, LoadTiming, prepare_loader, timed
from surgery.runtime.portable import (
    closure_identity,
    closure_refs,
    code_text,
    guard_filter_for,
    inlined_sources,
    sources_problem,
    takes_args,
)
from surgery.runtime.report import CacheIgnoredWarning, CacheRecord
from surgery.runtime.warm_loader import KeyPrefetch, serial_kernel_loads

# Backends whose compiled code torch serialises (inductor, and AOTAutograd-based ones).
SERIALISABLE_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")


def api_missing() -> str | None:
    """Why this torch cannot precompile (None: it can)."""
    if not hasattr(torch.compiler, "load_compiled_function") or \
            not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return (f"torch {torch.__version__} has no torch.compile(...).aot_compile / "
                "torch.compiler.load_compiled_function (torch 2.10+): the bundle holds the "
                "Mega-Cache part only, and dynamo traces every region at deploy time")
    return None


def group_identity(target: Callable[..., Any], options: str) -> str | None:
    """What an artifact must match to serve a group: function, its code (and its closure's:
    a decorator's arguments and wrapped function) and compile options.

    None for a target that is not a plain Python function (a builtin, a callable object):
    those are not precompiled.
    """
    if not isinstance(target, types.FunctionType):
        return None
    text = code_text(target.__code__) + closure_identity(target)
    code = hashlib.sha256(text.encode()).hexdigest()
    return json.dumps([target.__module__, target.__qualname__, f"sha256:{code}", options])


def signature_text(sig: Any) -> str:
    """The signature as the text an index stores (reprs of shapes, dtypes and flags)."""
    return repr(sig)


# --- saving ------------------------------------------------------------------------------------

@dataclass
class Section:
    """The precompiled part of a bundle: the artifacts' bytes and the record that indexes them."""

    data: bytes
    entries: list[dict[str, Any]]
    notes: list[str]
    kernels: dict[str, Any] | None = None  # what the cold frames ran (runtime.kernel_ids)

    def record(self) -> dict[str, Any]:
        return {"format": record_format(self.entries), "bytes": len(self.data),
                "entries": self.entries, "notes": self.notes,
                **({KERNELS_FIELD: self.kernels} if self.kernels else {})}


def _compile_options(group: Any) -> tuple[str, dict[str, Any]]:
    """The backend and torch.compile ``options``: the group's inductor config patches, and the
    guard filter that keeps the artifact portable (surgery.runtime.portable)."""
    backend = group.backend.backend
    patches = group.backend.config_patches
    options: dict[str, Any] = {"guard_filter_fn": guard_filter_for(group.target)}
    if backend == "inductor" and patches:
        options.update(patches)
    return backend, options


def precompile_one(group: Any, module: Any, example: Example) -> tuple[bytes, list[list[Any]]]:
    """Trace and compile the group's function for one example, ahead of time: its bytes, and
    the source spans inlined into it (surgery.runtime.portable, checked when it is loaded)."""
    backend, options = _compile_options(group)
    # The function itself, not the group's fresh copy (surgery.runtime.budget): torch pickles
    # it by reference, which a copy with the same qualname fails (torch.nn.Linear.forward), and
    # an AOT compile fills no dynamo cache that the copy would keep apart.
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled: Any = torch.compile(group.target, backend=backend, fullgraph=True,
                                      dynamic=group.dynamic, options=options)
    with example.modes():
        args, kwargs = example.build()
        full = (module, *args) if group.bound else args
        fn = compiled.aot_compile((full, kwargs))
    refs = closure_refs(group.target)
    saved = type(fn).serialize(fn, refs) if refs and takes_args(type(fn).serialize, 2) \
        else type(fn).serialize(fn)
    # torch 2.13 returns an AOTCompileSaveResult; the first releases of the path, the bytes.
    return bytes(getattr(saved, "serialized_data", saved)), inlined_sources(fn)


def build_section(groups: Iterable[Any], *, aoti: bool = False, device: str = "cpu") -> Section:
    """Precompile every (group, static signature) with an example; what could not be, in notes.

    ``groups``: surgery.runtime.groups._Group objects that ran (their ``examples`` map a
    signature to (module, Example), recorded by surgery.runtime.slots on its first call).
    ``aoti``: also build an AOTInductor package for each (surgery.runtime.aoti_build).
    """
    groups = list(groups)
    ran = kernel_record()  # before anything compiles here: what the frames ran
    section = replace(_build_artifacts(groups), kernels=ran)
    if aoti:
        if missing := aoti_missing():
            section.notes.append(missing)
            return section
        sources = {(e["group"], e["signature"]): e[SOURCES_FIELD] for e in section.entries}
        blob, extra, notes = build_entries(groups, device=device, signature_text=signature_text,
                                           offset=len(section.data), sources=sources)
        section = Section(section.data + blob, section.entries + extra, section.notes + notes,
                          ran)
    return section


def _build_artifacts(groups: Iterable[Any]) -> Section:
    notes: list[str] = []
    if missing := api_missing():
        return Section(b"", [], [missing])
    data = bytearray()
    entries: list[dict[str, Any]] = []
    for g in groups:
        if g.identity is None or g.dynamic is True or g.failed is not None:
            continue
        backend = g.backend.backend
        if backend not in SERIALISABLE_BACKENDS:
            notes.append(f"backend {backend!r} is not precompiled (torch serialises only "
                         f"{', '.join(SERIALISABLE_BACKENDS)}); {g.target.__qualname__} uses "
                         "the Mega-Cache part")
            continue
        for sig, (module, example) in g.examples.items():
            if example is None:
                notes.append(f"{g.target.__qualname__}: a signature with an argument other "
                             "than tensors and scalars is not precompiled")
                continue
            try:
                blob, sources = precompile_one(g, module, example)
                with example.modes():  # one that cannot be loaded back here is not written
                    _load_function(blob, g.target)
            except Exception as e:  # torch's experimental path: the Mega-Cache part remains
                first = (str(e).strip().splitlines() or [""])[0][:200]
                notes.append(f"{g.target.__qualname__}: not precompiled "
                             f"({type(e).__name__}: {first})")
                continue
            entries.append({"group": g.identity, "signature": signature_text(sig),
                            "modes": example.mode_record(), "offset": len(data),
                            "bytes": len(blob), SOURCES_FIELD: sources})
            data += blob
    return Section(bytes(data), entries, notes)


# --- loading -----------------------------------------------------------------------------------

def _load_function(data: bytes, target: Callable[..., Any]) -> Any:
    """torch's loader; given the function's globals, and the functions of its closure
    (surgery.runtime.portable.closure_refs), where this torch takes them (2.13+ does)."""
    load = torch.compiler.load_compiled_function
    params = inspect.signature(load).parameters
    kwargs: dict[str, Any] = {}
    if "f_globals" in params:
        kwargs["f_globals"] = getattr(target, "__globals__", None)
    if "external_data" in params and (refs := closure_refs(target)):
        kwargs["external_data"] = refs
    return load(io.BytesIO(data), **kwargs)


class Artifact:
    """One loaded artifact: torch's AOT-compiled callable, called after its guards pass."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # The compiled callable itself, past the guard check torch's __call__ repeats.
        self._run: Callable[..., Any] = getattr(fn, "fn", fn)

    def try_call(self, full: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """(True, output) when torch's guards pass for this call, else (False, None)."""
        if not self.fn.guard_check(*full, **kwargs):
            return False, None
        return True, self._run(*full, **kwargs)


@dataclass
class Loaded:
    """The artifacts of a bundle that verified and fits, handed out to groups as they install."""

    entries: Parsed
    device: str = "cpu"  # where the model is: on CUDA, kernels load without a compile pool
    aoti: AotiParsed = field(default_factory=dict)  # AOTInductor packages (preferred)
    keys: KeyPrefetch | None = None  # waited for before the first artifact (not runner) loads
    prepared: bool = False  # whether the loader's set-up ran (before the first artifact)
    deferred: DeferredMegaCache | None = None  # the Mega-Cache part, when runners are in it
    kernels: KernelRecord | None = None  # the cold run's kernels, pinned as artifacts load
    used: set[str] = field(default_factory=set)
    stale: str = ""  # why a group's inlined code is not this process's (the first one)
    loaded: int = 0  # artifacts and runners handed out
    aoti_loaded: int = 0  # of them, runners
    failed: str = ""  # why an artifact could not be loaded (the first one)
    seconds: dict[str, float] = field(default_factory=dict)  # per group identity, loading
    setup: LoaderSetup = field(default_factory=LoaderSetup)  # once, before the first artifact
    timings: dict[str, list[LoadTiming]] = field(default_factory=dict)  # per group, in order

    def take(self, identity: str | None, target: Callable[..., Any], *, bound: bool = True
             ) -> dict[str, Any]:
        """The loaded code for a group (signature text -> AotiRunner or Artifact); {} when none
        fits. Runners first; artifacts for the signatures without one (or all, when a package
        cannot be loaded). An artifact torch cannot load leaves the group its runners and
        dynamo; the first failure of either is kept in ``failed`` for the one warning.
        """
        if identity is None or identity in self.used or \
                (identity not in self.entries and identity not in self.aoti):
            return {}
        name = qualname_of(target)
        for *_, sources in [*self.entries.get(identity, {}).values(),
                            *self.aoti.get(identity, {}).values()]:
            if why := sources_problem(sources):  # type: ignore[arg-type]  # before any load
                self.stale = self.stale or f"{name}: {why}"
                return {}
        started = time.perf_counter()
        timings = self.timings.setdefault(identity, [])
        runners, failed = load_runners(self.aoti.get(identity, {}), device=self.device,
                                       bound=bound, timings=timings, name=name)
        self.failed = self.failed or failed
        self.used.add(identity)
        self.aoti_loaded += len(runners)
        self.loaded += len(runners)
        rest = {s: v for s, v in self.entries.get(identity, {}).items() if s not in runners}
        out: dict[str, Any] = dict(runners)
        try:
            if rest and self.deferred is not None:  # its autotune entries serve artifacts
                self.deferred.load("artifact")
            if rest and not self.prepared:  # the loader's one-time cost, apart from the first
                self.prepared = True
                self.setup = prepare_loader(self.device, self.keys)
            for i, (sig, (data, modes, _)) in enumerate(rest.items(), start=len(timings)):
                try:
                    with timed(timings, name, i), modes_of(modes), \
                            serial_kernel_loads(self.device):
                        fn = _load_function(data, target)
                except Exception as e:  # torch's deserialiser, or its compatibility check
                    first = (str(e).strip().splitlines() or [""])[0][:200]
                    self.failed = self.failed or f"{name}: {type(e).__name__}: {first}"
                    return runners
                out[sig] = Artifact(fn)
            pin_kernels(self.kernels)  # its Triton kernels launch the cold run's configs
        finally:
            self.seconds[identity] = time.perf_counter() - started
        self.loaded += len(out) - len(runners)
        return out

    def unused(self) -> int:
        """Artifacts of groups that no installed group matched (stale code or options)."""
        return sum(len(v) for k, v in self.entries.items() if k not in self.used) + \
            sum(len(v) for k, v in self.aoti.items() if k not in self.used)


# --- apply_manifest(..., cache=...) -------------------------------------------------------------

def load_for_apply(cache: str | os.PathLike[str] | bool, *, manifest: Manifest,
                   overrides: Mapping[str, Any], device: str, notes: list[str],
                   keys: KeyPrefetch | None = None) -> tuple[CacheRecord, Loaded | None]:
    """Load a compile-cache bundle when it verifies and fits: its Mega-Cache part into torch's
    caches, and its precompiled part for the groups to take as they install. Otherwise warn
    once, say why in ``notes``, and return no artifacts. ``keys``: the one-time keys and native
    build being computed meanwhile (surgery.runtime.warm_loader): by default started here, once
    the bundle passed its checks and holds artifacts no runner replaces, before its Mega-Cache
    part loads, and waited for before any artifact loads."""
    src = manifest.source_path  # cache=True: the bundle beside the manifest file
    path = os.fspath(cache) if not isinstance(cache, bool) else \
        default_bundle_path(src) if src else ""
    loaded, why = False, "cache=True, but the manifest has no file to find a bundle beside"
    pre, prefetch = None, [keys]

    def admitted(entries: Parsed, aoti: AotiParsed) -> None:  # before the Mega-Cache load
        if prefetch[0] is None and any(set(v) - set(aoti.get(k, {})) for k, v in entries.items()):
            prefetch[0] = KeyPrefetch.start(device)  # artifacts to load: their one-time work
    if path:
        with serial_kernel_loads(device):  # a torch whose import starts the pool does not
            opened = open_bundle(path, manifest=manifest, overrides=overrides, device=device,
                                 defer=aoti_missing() is None, admitted=admitted)
        loaded, why = opened.loaded, opened.reason
        pre = Loaded(opened.precompiled, device=device, aoti=opened.aoti, keys=prefetch[0],
                     kernels=opened.kernels) if opened.precompiled or opened.aoti else None
        if pre is not None and opened.pending is not None:
            pre.deferred = DeferredMegaCache(path, opened.pending, device=device)
            pre.deferred.arm()
    if not loaded:
        notes.append(f"compile-cache bundle ignored: {why}")
        warnings.warn(f"surgery: compile-cache bundle ignored, compiling as usual: {why}",
                      CacheIgnoredWarning, stacklevel=3)
    return CacheRecord(path or None, loaded, why), pre


def report_use(pre: Loaded, record: CacheRecord, *, notes: list[str]) -> None:
    """Say how much precompiled code the groups took; warn once about what of it could not be
    used (torch could not load it, or no group has its code and options: stale)."""
    record.precompiled, record.precompiled_unused = pre.loaded, pre.unused()
    record.aoti = pre.aoti_loaded
    problems = ([f"torch could not load one ({pre.failed})"] if pre.failed else []) + (
        [f"{pre.unused()} artifact(s) match no region group here (its code or compile options "
         "changed since the bundle was built" + (f"; {pre.stale}" if pre.stale else "") + ")"]
        if pre.unused() else [])
    if problems:
        why = one_line("; ".join(problems))
        notes.append(f"precompiled code in the bundle partly ignored: {why}")
        warnings.warn(f"surgery: precompiled code in the bundle partly ignored, those groups "
                      f"compile with dynamo: {why}", CacheIgnoredWarning, stacklevel=3)


def group_breakdown(groups: Iterable[Any], loaded: Loaded | None) -> list[dict[str, Any]]:
    """Where a start went, per compiled group (an ApplyHandle's ``groups``): its paths and
    signatures, backend compile time (AOTAutograd + inductor, cache hits included), artifacts
    loaded and the time loading them (per artifact with torch's phases: surgery.runtime.
    load_timing), CUDA graphs captured and the time capturing them."""
    out = []
    for g in groups:
        slots, ident = g.slots, g.identity
        out.append({
            "group": qualname_of(g.target), "paths": len(slots),
            "signatures": len(g.sigs), "compiles": sum(s.record.compiles for s in slots),
            "compile_s": round(g.backend.compile_s, 3), "precompiled": len(g.precompiled),
            "load_s": round(loaded.seconds.get(ident, 0.0), 3) if loaded and ident else 0.0,
            "precompiled_runs": sum(s.record.precompiled_runs for s in slots),
            "captures": sum(s.record.graphs_captured for s in slots),
            "capture_s": round(sum(s.record.capture_s for s in slots), 3),
            "artifacts": [t.as_dict() for t in loaded.timings.get(ident, [])]
            if loaded and ident else []})
    return out


def qualname_of(target: Any) -> str:
    return str(getattr(target, "__qualname__", target))
