"""Warm starts: a compile-cache bundle bound to its manifest, so deployment skips recompiling.

``torch.compiler.save_cache_artifacts()`` serialises what inductor and AOTAutograd compiled in
this process (torch 2.7+, "Mega-Cache"); ``load_cache_artifacts()`` puts it into the local
caches of another process, whose compiles then hit instead of miss. The blob is only valid for
the same torch / triton versions and the same GPU, and only useful for the same graphs, so a
bundle carries a record of what it was built for, and is loaded only when all of it matches.

Naming rule: the bundle sits beside its manifest as ``STEM.surgery.cache``, where STEM is the
manifest's file name without ``.surgery.toml`` (or ``.toml``, ``.safetensors``,
``.index.json`` for a manifest embedded in an export): ``model.surgery.toml`` and
``model.safetensors`` both give ``model.surgery.cache``.

File layout (integers little-endian)::

    8 bytes  magic  b"SGCACHE1"
    8 bytes  u64    N, the length of the metadata
    N bytes         metadata: UTF-8 JSON (what it is valid for, blob length and sha256)
    the rest        the blob of save_cache_artifacts()

Everything is checked (magic, lengths, JSON, sha256 of the blob, then the environment) *before*
torch sees a byte, and every problem becomes a reason string, never an exception: a stale or
corrupt bundle must not stop a deployment; it only costs the compile it would have saved.

This module imports torch only inside the functions that need it: `surgery verify` reads a
bundle's metadata and compares versions without importing torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from surgery import __version__
from surgery.errors import CacheBundleError, OutputExistsError
from surgery.manifest import MANIFEST_SUFFIX, Manifest

if TYPE_CHECKING:
    from surgery.apply import ApplyHandle

BUNDLE_SUFFIX = ".surgery.cache"
MAGIC = b"SGCACHE1"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sQ")
# Metadata is a few KiB; a larger length means the file is not a bundle (or is garbage).
_MAX_META = 16 * 2**20
# Suffixes a manifest source may carry; the bundle's stem is the name without them.
_MANIFEST_SUFFIXES = (MANIFEST_SUFFIX, ".toml", ".index.json", ".safetensors")
# The environment keys a bundle must match, in the order reasons name them.
ENV_KEYS = ("torch", "triton", "cuda", "device", "python", "platform")
# torch.compile counters (torch._dynamo.utils.counters) that show whether compiles hit a cache.
_COUNTERS = {
    "fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
    "aot_autograd_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_autograd_misses": ("aot_autograd", "autograd_cache_miss"),
}


def default_bundle_path(manifest_path: str | os.PathLike[str]) -> str:
    """``model.surgery.toml`` (or ``model.safetensors``) -> ``model.surgery.cache``, beside it."""
    p = os.fspath(manifest_path)
    for suffix in _MANIFEST_SUFFIXES:
        if p.endswith(suffix) and len(p) > len(suffix):
            return p[: -len(suffix)] + BUNDLE_SUFFIX
    return p + BUNDLE_SUFFIX


def manifest_key(manifest: Manifest) -> str:
    """sha256 of what decides the compiled graphs: compile options and regions.

    Not the file's bytes: a comment or a `left_out` edit must not make a bundle stale.
    """
    regions = [{k: v for k, v in r.to_dict().items() if k not in ("class", "parameters")}
               for r in manifest.regions]
    text = json.dumps({"compile": manifest.compile, "region": regions}, sort_keys=True,
                      default=str)
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def _canonical(overrides: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(overrides or {}), sort_keys=True, default=str)


# --- the environment -------------------------------------------------------------------------

def _python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _platform() -> str:
    return f"{sys.platform}-{platform.machine()}"


def environment(*, device: str) -> dict[str, str | None]:
    """What a bundle built here, for a model on ``device``, would be valid for (imports torch)."""
    import torch

    try:
        import triton

        triton_version: str | None = str(triton.__version__)
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {"torch": str(torch.__version__), "triton": triton_version,
            "cuda": torch.version.cuda, "device": name, "python": _python(),
            "platform": _platform()}


def environment_without_torch(*, want_gpu: bool) -> tuple[dict[str, str | None], list[str]]:
    """The same record read from package metadata, without importing torch (for `verify`).

    Returns the record and what could not be checked. The GPU name comes from ``nvidia-smi``
    when ``want_gpu`` and it is on PATH; otherwise it is unknown, and said so.
    """
    unchecked: list[str] = []
    env: dict[str, str | None] = {"python": _python(), "platform": _platform(), "device": "cpu"}
    # triton ships as `triton`, or as `pytorch-triton` with nightly builds of torch.
    for name, dists in (("torch", ("torch",)), ("triton", ("triton", "pytorch-triton"))):
        env[name] = None
        for dist in dists:
            try:
                env[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    env["cuda"] = _torch_cuda_version()
    if want_gpu:
        gpu = _nvidia_smi_gpu()
        env["device"] = gpu
        if gpu is None:
            unchecked.append("device")
    return env, unchecked


def _torch_cuda_version() -> str | None:
    """torch.version.cuda, read from torch/version.py's text (find_spec does not import torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                for line in f:
                    if line.startswith("cuda"):
                        value = line.split("=", 1)[1].strip().strip("'\"")
                        return None if value == "None" else value
        except OSError:
            continue
    return None


def _nvidia_smi_gpu() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return names[0] if names else None


# --- the file ---------------------------------------------------------------------------------

def write_bundle(path: str, blob: bytes, metadata: Mapping[str, Any], *,
                 force: bool = True) -> int:
    """Write header + metadata + blob to a temporary file beside ``path``, then rename it.

    The blob's length and sha256 are added to the metadata here, so a reader can prove the
    blob intact before torch deserialises it. Returns the bytes written.
    """
    from surgery.manifest import write_text_atomic

    meta = {**metadata, "blob": {"bytes": len(blob),
                                 "sha256": hashlib.sha256(blob).hexdigest()}}
    text = json.dumps(meta, indent=1, sort_keys=True).encode("utf-8")
    data = _HEADER.pack(MAGIC, len(text)) + text + blob
    write_text_atomic(path, data, force=force)
    return len(data)


def read_bundle(path: str, *, with_blob: bool = True) -> tuple[dict[str, Any], bytes | None]:
    """(metadata, blob) of a bundle, after checking its header, lengths and sha256.

    Raises CacheBundleError naming what is wrong. ``with_blob=False`` still reads and hashes
    the blob (a truncated or altered bundle must not read as valid) but does not return it.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size or head[:8] != MAGIC:
                raise CacheBundleError(f"{path}: not a surgery compile-cache bundle (bad magic)",
                                       path=path, hint=_REBUILD)
            _, n = _HEADER.unpack(head)
            if n > _MAX_META:
                raise CacheBundleError(f"{path}: corrupt header (metadata length {n})",
                                       path=path, hint=_REBUILD)
            raw = f.read(n)
            if len(raw) < n:
                raise CacheBundleError(f"{path}: truncated inside its metadata", path=path,
                                       hint=_REBUILD)
            blob = f.read()
    except FileNotFoundError:
        raise CacheBundleError(f"{path}: no such bundle", path=path,
                               hint="build one with `surgery warm` or handle.save_cache()"
                               ) from None
    except OSError as e:
        raise CacheBundleError(f"{path}: cannot read: {e.strerror}", path=path) from None
    try:
        meta = json.loads(raw.decode("utf-8"))
        want = int(meta["blob"]["bytes"])
        sha = str(meta["blob"]["sha256"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CacheBundleError(f"{path}: corrupt metadata (not the JSON record surgery writes)",
                               path=path, hint=_REBUILD) from None
    if meta.get("format") != FORMAT_VERSION:
        raise CacheBundleError(f"{path}: bundle format {meta.get('format')!r}, this surgery "
                               f"reads format {FORMAT_VERSION}", path=path, hint=_REBUILD)
    if len(blob) != want:
        raise CacheBundleError(f"{path}: truncated: the blob is {len(blob)} bytes, the header "
                               f"says {want}", path=path, hint=_REBUILD)
    if hashlib.sha256(blob).hexdigest() != sha:
        raise CacheBundleError(f"{path}: corrupt: the blob's sha256 does not match its header",
                               path=path, hint=_REBUILD)
    return meta, blob if with_blob else None


_REBUILD = "build it again on this machine: `surgery warm ...` (or handle.save_cache())"


def mismatches(meta: Mapping[str, Any], *, fingerprint: str, key: str,
               overrides: Mapping[str, Any] | None, env: Mapping[str, str | None],
               skip: tuple[str, ...] = ()) -> list[str]:
    """Why the bundle does not fit here, one phrase per difference (empty: it fits)."""
    out: list[str] = []
    m = meta.get("manifest", {})
    if m.get("fingerprint") != fingerprint:
        out.append(f"it was built for model fingerprint {m.get('fingerprint')}, the manifest "
                   f"has {fingerprint}")
    if m.get("key") != key:
        out.append("the manifest's regions or compile options changed since it was built")
    if overrides is not None and _canonical(meta.get("overrides")) != _canonical(overrides):
        out.append(f"it was built with overrides {_canonical(meta.get('overrides'))}, this "
                   f"apply uses {_canonical(overrides)}")
    built = meta.get("env", {})
    for k in ENV_KEYS:
        if k in skip:
            continue
        if built.get(k) != env.get(k):
            out.append(f"{k} {built.get(k)} when built, {env.get(k)} here")
    return out


# --- load and save (these import torch) -------------------------------------------------------

def _api_missing() -> str | None:
    import torch

    if not hasattr(torch.compiler, "load_cache_artifacts"):
        return (f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts "
                "(added in torch 2.7)")
    return None


def load_bundle(path: str, *, manifest: Manifest, overrides: Mapping[str, Any] | None,
                device: str) -> tuple[bool, str]:
    """Hand the bundle to ``torch.compiler.load_cache_artifacts`` if, and only if, it fits.

    Returns (loaded, reason). Never raises for a bad bundle: the caller compiles as usual.
    """
    missing = _api_missing()
    if missing:
        return False, missing
    try:
        meta, blob = read_bundle(path)
    except CacheBundleError as e:
        return False, e.message
    assert blob is not None
    why = mismatches(meta, fingerprint=manifest.fingerprint, key=manifest_key(manifest),
                     overrides=overrides or {}, env=environment(device=device))
    if why:
        return False, f"{path} does not fit: " + "; ".join(why)
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as e:  # torch's own deserialiser: any failure means "compile as usual"
        return False, f"{path}: torch could not load it ({type(e).__name__}: {e})"
    if info is None:
        return False, f"{path}: torch could not deserialise the blob (see its log above)"
    return True, f"{path}: {_describe(_artifact_counts(info))}"


def _artifact_counts(info: Any) -> dict[str, int]:
    return {str(k): len(v) for k, v in sorted(getattr(info, "artifacts", {}).items())}


def _describe(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in counts.items()) + " artifact(s)" if counts \
        else "no artifacts"


@dataclass
class SavedBundle:
    """What `save_bundle` wrote: where, how big, and the record it is valid for."""

    path: str
    bytes: int
    metadata: dict[str, Any]

    def describe(self) -> list[str]:
        env = self.metadata["env"]
        return [f"wrote {self.path} ({self.bytes / 1e6:.2f} MB; "
                f"{_describe(self.metadata['artifacts'])})",
                "valid for: " + ", ".join(f"{k} {env.get(k)}" for k in ENV_KEYS),
                f"manifest fingerprint {self.metadata['manifest']['fingerprint']}",
                f"compile options {json.dumps(self.metadata['compile'], sort_keys=True)}" +
                (f", overrides {_canonical(self.metadata['overrides'])}"
                 if self.metadata["overrides"] else "")]


def bundle_metadata(manifest: Manifest, *, overrides: Mapping[str, Any] | None,
                    env: Mapping[str, str | None], artifacts: Mapping[str, int]
                    ) -> dict[str, Any]:
    """The record of what a bundle is valid for (`write_bundle` adds the blob's length and
    sha256)."""
    return {"format": FORMAT_VERSION, "surgery": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "manifest": {"fingerprint": manifest.fingerprint, "key": manifest_key(manifest),
                         "source": os.path.basename(manifest.source_path or "")},
            "compile": dict(manifest.compile), "overrides": json.loads(_canonical(overrides)),
            "env": dict(env), "artifacts": dict(artifacts)}


def save_bundle(path: str, *, manifest: Manifest, overrides: Mapping[str, Any] | None,
                device: str, force: bool = True) -> SavedBundle:
    """Serialise this process's compile caches into a bundle bound to ``manifest``.

    torch records every artifact compiled (or loaded from a cache) in this process, so call it
    after warm-up, in a process that compiled this model only.
    """
    import torch

    if not hasattr(torch.compiler, "save_cache_artifacts"):
        raise CacheBundleError(f"torch {torch.__version__} has no "
                               "torch.compiler.save_cache_artifacts (added in torch 2.7)",
                               path=path, hint="upgrade torch to 2.7 or later")
    if os.path.exists(path) and not force:
        raise OutputExistsError(path)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise CacheBundleError(
            "nothing to save: no inductor or AOTAutograd cache artifact was recorded in this "
            "process", path=path,
            hint="warm up first; only backend 'inductor' fills these caches (on the CPU, "
                 "CUDA-graph regions run eager unless the override on_cpu=compile is given)")
    blob, info = saved
    meta = bundle_metadata(manifest, overrides=overrides, env=environment(device=device),
                           artifacts=_artifact_counts(info))
    size = write_bundle(path, blob, meta, force=force)
    meta["blob"] = {"bytes": len(blob)}
    return SavedBundle(path, size, meta)


def cache_counters() -> dict[str, int]:
    """Compile-cache hits and misses so far in this process (torch's own counters)."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for name, (group, key) in _COUNTERS.items()}


@dataclass
class CacheRecord:
    """What the report says about compile caches: a bundle loaded or not, and why; then how
    many compiles in warm-up hit or missed the caches (hits are the work a bundle saved)."""

    path: str | None = None
    loaded: bool = False
    reason: str = ""
    saved_to: str | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        c = self.counts
        if self.path is None and not any(c.values()) and not self.saved_to:
            return ""  # no bundle and no cached compile: nothing worth a line
        hits = (f"; warm-up compiles: FX graph cache {c.get('fx_graph_hits', 0)} hit / "
                f"{c.get('fx_graph_misses', 0)} miss, AOTAutograd cache "
                f"{c.get('aot_autograd_hits', 0)} hit / {c.get('aot_autograd_misses', 0)} miss"
                if c else "")
        if self.path is None:
            state = "compile cache: no bundle given"
        else:
            state = f"compile cache: {'loaded' if self.loaded else 'ignored'} ({self.reason})"
        return state + hits + (f"; saved to {self.saved_to}" if self.saved_to else "")


def save_from_handle(handle: ApplyHandle, path: str | None, *, force: bool) -> SavedBundle:
    """The body of ``ApplyHandle.save_cache``: the default path, then `save_bundle`."""
    if path is None:
        if not handle.manifest.source_path:
            raise CacheBundleError(
                "the manifest was built in memory, so there is no file to put the bundle beside",
                path="", hint="pass a path: handle.save_cache('model.surgery.cache')")
        path = default_bundle_path(handle.manifest.source_path)
    saved = save_bundle(path, manifest=handle.manifest, overrides=handle._overrides,
                        device=handle._device, force=force)
    if handle.report.cache is None:
        handle.report.cache = CacheRecord()
    handle.report.cache.saved_to = path
    return saved


# --- surgery verify ---------------------------------------------------------------------------

def check_beside(manifest: Manifest) -> tuple[str, bool | None, str] | None:
    """(bundle path, valid here?, why) for the bundle beside a manifest file; None if none.

    Without importing torch: versions come from package metadata, the GPU from nvidia-smi.
    ``valid`` is None when everything checked matches but the GPU could not be checked.
    """
    if not manifest.source_path:
        return None
    path = default_bundle_path(manifest.source_path)
    if not os.path.exists(path):
        return None
    try:
        meta, _ = read_bundle(path, with_blob=False)
    except CacheBundleError as e:
        return path, False, e.message
    built = meta.get("env", {})
    gpu = built.get("device") not in (None, "cpu")
    env, unchecked = environment_without_torch(want_gpu=gpu)
    why = mismatches(meta, fingerprint=manifest.fingerprint, key=manifest_key(manifest),
                     overrides=None, env=env, skip=tuple(unchecked))
    over = meta.get("overrides") or {}
    extra = (f"; apply_manifest must be given the same overrides {_canonical(over)}"
             if over else "")
    if why:
        return path, False, "; ".join(why)
    valid_for = f"torch {built.get('torch')} on {built.get('device')}"
    if unchecked:
        return path, None, (f"valid for {valid_for}; the GPU was not checked (no nvidia-smi, "
                            "and verify does not import torch)" + extra)
    return path, True, f"valid for {valid_for}" + extra
