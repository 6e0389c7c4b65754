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

    8 bytes   magic  b"SGCACHE2"
    8 bytes   u64    N, the length of the metadata
    8 bytes   u64    B, the length of the blob
    32 bytes         HMAC-SHA256 under the deployer's key of the magic, N, B, metadata and blob
    N bytes          metadata: UTF-8 JSON (what it is valid for)
    B bytes          the blob of save_cache_artifacts()

A bundle is code: torch unpickles its artifacts and writes them into its caches, where they run
again in later processes. A hash kept in the same file proves nothing against whoever wrote the
file, so a bundle is trusted only when its MAC verifies with the key the deployer holds
(surgery.signing: $SURGERY_CACHE_KEY or $SURGERY_CACHE_KEY_FILE). The checks, in order, all
before torch sees a byte: magic and lengths against the file's size; the key is there; the MAC
(constant-time compare), before any byte of the metadata is parsed; the metadata; the framing of
the blob and every artifact key (surgery.artifacts, defence in depth); then the environment.
Every problem becomes a one-line reason, never an exception: a stale, forged or corrupt bundle
must not stop a deployment; it only costs the compile it would have saved. Format-1 bundles
(``SGCACHE1``, written before bundles were signed) are never loaded; verify calls them unsigned.

This module imports torch only inside the functions that need it: `surgery verify` checks a
bundle's signature and compares versions without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from surgery import __version__
from surgery.artifacts import ArtifactError, read_artifacts
from surgery.bundle_env import ENV_KEYS, environment, environment_without_torch, same_torch
from surgery.errors import (
    CacheBundleError,
    CacheKeyError,
    CacheSignatureError,
    OutputExistsError,
)
from surgery.manifest import MANIFEST_SUFFIX, Manifest
from surgery.signing import ENV_KEY, ENV_KEY_FILE, load_key, mac, mac_matches, require_key

if TYPE_CHECKING:
    from surgery.apply import ApplyHandle

BUNDLE_SUFFIX = ".surgery.cache"
MAGIC = b"SGCACHE2"
UNSIGNED_MAGIC = b"SGCACHE1"  # format 1, before bundles were signed: never loaded
FORMAT_VERSION = 2
_HEADER = struct.Struct("<8sQQ32s")
# Metadata is a few KiB; a larger length means the file is not a bundle (or is garbage).
_MAX_META = 16 * 2**20
# Suffixes a manifest source may carry; the bundle's stem is the name without them.
_MANIFEST_SUFFIXES = (MANIFEST_SUFFIX, ".toml", ".index.json", ".safetensors")
__all__ = ["ENV_KEYS", "environment", "environment_without_torch"]  # re-exported
# A reason is one line of a report and of a warning; a signed record could still hold a megabyte.
_REASON_MAX = 600
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


# --- the file ---------------------------------------------------------------------------------

def write_bundle(path: str, blob: bytes, metadata: Mapping[str, Any], *, key: bytes,
                 force: bool = True) -> int:
    """Sign header + metadata + blob with ``key`` and write them beside ``path``, then rename.

    Returns the bytes written.
    """
    from surgery.manifest import write_text_atomic

    meta = {**metadata, "blob": {"bytes": len(blob)}}
    text = json.dumps(meta, indent=1, sort_keys=True).encode("utf-8")
    lengths = struct.pack("<QQ", len(text), len(blob))
    tag = mac(key, MAGIC, lengths, text, blob)
    data = MAGIC + lengths + tag + text + blob
    write_text_atomic(path, data, force=force)
    return len(data)


def _untrusted(path: str, state: str, why: str, hint: str) -> CacheSignatureError:
    return CacheSignatureError(f"{path}: {why}", path=path, state=state, hint=hint)


def read_bundle(path: str, *, key: bytes | None, with_blob: bool = True
                ) -> tuple[dict[str, Any], bytes | None]:
    """(metadata, blob) of a bundle whose signature verifies with ``key``.

    Raises CacheSignatureError when it is unsigned, there is no key, or the MAC does not
    verify; CacheBundleError for anything else wrong (lengths, metadata, artifact keys).
    Nothing of the file but its fixed-size header is interpreted before the MAC verifies.
    """
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the open below forever
            raise CacheBundleError(f"{path}: not a regular file", path=path, hint=_REBUILD)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if head[:8] == UNSIGNED_MAGIC:
                raise _untrusted(path, "unsigned", "unsigned (format 1, written before bundles "
                                 "were signed), so it is never loaded", _REBUILD)
            if head[:8] != MAGIC:
                raise CacheBundleError(f"{path}: not a surgery compile-cache bundle (bad magic)",
                                       path=path, hint=_REBUILD)
            if len(head) < _HEADER.size:
                raise CacheBundleError(f"{path}: truncated inside its header", path=path,
                                       hint=_REBUILD)
            _, n, b, tag = _HEADER.unpack(head)
            if n > _MAX_META:
                raise CacheBundleError(f"{path}: corrupt header (metadata length {n})",
                                       path=path, hint=_REBUILD)
            want = _HEADER.size + n + b
            if info.st_size != want:
                what = "truncated" if info.st_size < want else "damaged"
                raise CacheBundleError(f"{path}: {what}: the file is {info.st_size} bytes, its "
                                       f"header says {want}", path=path, hint=_REBUILD)
            if key is None:
                raise _untrusted(path, "no-key", f"no key to check its signature (neither "
                                 f"{ENV_KEY} nor {ENV_KEY_FILE} is set), so it is not loaded",
                                 _KEY_HINT)
            raw = f.read(n)
            blob = f.read(b)
    except FileNotFoundError:
        raise CacheBundleError(f"{path}: no such bundle", path=path,
                               hint="build one with `surgery warm` or handle.save_cache()"
                               ) from None
    except OSError as e:
        raise CacheBundleError(f"{path}: cannot read: {e.strerror}", path=path) from None
    if len(raw) != n or len(blob) != b:
        raise CacheBundleError(f"{path}: truncated while it was read", path=path, hint=_REBUILD)
    if not mac_matches(key, tag, MAGIC, head[8:24], raw, blob):
        raise _untrusted(path, "bad-signature", "signature does not verify: it was signed with "
                         "another key, or changed since it was signed", _REBUILD)
    meta = _parse_metadata(raw, path)
    try:
        read_artifacts(blob)
    except ArtifactError as e:
        raise CacheBundleError(f"{path}: refused: {e}", path=path, hint=_REBUILD) from None
    return meta, blob if with_blob else None


def _parse_metadata(raw: bytes, path: str) -> dict[str, Any]:
    """The signed record, checked for the shape surgery writes (it is the key holder's, but a
    holder's bug must not become an exception in a deployment either)."""
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or not all(
            isinstance(meta.get(k), dict) for k in ("manifest", "env", "blob")) or \
            not isinstance(meta.get("overrides", {}), dict):
        raise CacheBundleError(f"{path}: corrupt metadata (not the JSON record surgery writes)",
                               path=path, hint=_REBUILD)
    if meta.get("format") != FORMAT_VERSION:
        raise CacheBundleError(f"{path}: bundle format {_short(meta.get('format'))}, this "
                               f"surgery reads format {FORMAT_VERSION}", path=path, hint=_REBUILD)
    return meta


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def one_line(reason: str) -> str:
    """A reason as one bounded line (a warning, a report row, a verify note)."""
    text = " ".join(reason.split())
    return text if len(text) <= _REASON_MAX else text[:_REASON_MAX] + "...(cut)"


_REBUILD = "build it again on this machine: `surgery warm ...` (or handle.save_cache())"
_KEY_HINT = (f"set {ENV_KEY_FILE} (or {ENV_KEY}) to the key the bundle was signed with, "
             "where it is loaded")


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
        same = same_torch(built.get(k), env.get(k)) if k == "torch" else \
            built.get(k) == env.get(k)
        if not same:
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
    """Hand the bundle to ``torch.compiler.load_cache_artifacts`` if, and only if, it is signed
    with the deployer's key (surgery.signing) and fits this manifest and machine.

    Returns (loaded, one-line reason). Never raises for a bad bundle: the caller compiles as
    usual. No byte of the bundle reaches torch unless every check passed.
    """
    try:
        blob, why = _admit(path, manifest=manifest, overrides=overrides, device=device)
    except Exception as e:  # a bundle must never stop a deployment, whatever is in it
        return False, one_line(f"{path}: unreadable ({type(e).__name__})")
    if blob is None:
        return False, one_line(why)
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as e:  # torch's own deserialiser: any failure means "compile as usual"
        return False, one_line(f"{path}: torch could not load it ({type(e).__name__}: {e})")
    if info is None:
        return False, f"{path}: torch could not deserialise the blob (see its log above)"
    return True, f"{path}: {_describe(_artifact_counts(info))}"


def _admit(path: str, *, manifest: Manifest, overrides: Mapping[str, Any] | None,
           device: str) -> tuple[bytes | None, str]:
    """(blob, "") when the bundle may be loaded, else (None, why)."""
    missing = _api_missing()
    if missing:
        return None, missing
    try:
        key = load_key()
        meta, blob = read_bundle(path, key=key)
    except (CacheBundleError, CacheKeyError) as e:
        return None, e.message
    why = mismatches(meta, fingerprint=manifest.fingerprint, key=manifest_key(manifest),
                     overrides=overrides or {}, env=environment(device=device))
    if why:
        return None, f"{path} does not fit: " + "; ".join(why)
    return blob, ""


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
                device: str, force: bool = True, key: bytes | None = None) -> SavedBundle:
    """Serialise this process's compile caches into a bundle bound to ``manifest``, signed with
    ``key`` (default: the deployer's key from the environment, surgery.signing).

    torch records every artifact compiled (or loaded from a cache) in this process, so call it
    after warm-up, in a process that compiled this model only.
    """
    import torch

    key = key if key is not None else require_key()

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
    size = write_bundle(path, blob, meta, key=key, force=force)
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


def save_from_handle(handle: ApplyHandle, path: str | None, *, force: bool,
                     key: bytes | None = None) -> SavedBundle:
    """The body of ``ApplyHandle.save_cache``: the default path, then `save_bundle`."""
    if path is None:
        if not handle.manifest.source_path:
            raise CacheBundleError(
                "the manifest was built in memory, so there is no file to put the bundle beside",
                path="", hint="pass a path: handle.save_cache('model.surgery.cache')")
        path = default_bundle_path(handle.manifest.source_path)
    saved = save_bundle(path, manifest=handle.manifest, overrides=handle._overrides,
                        device=handle._device, force=force, key=key)
    if handle.report.cache is None:
        handle.report.cache = CacheRecord()
    handle.report.cache.saved_to = path
    return saved


# --- surgery verify ---------------------------------------------------------------------------

@dataclass
class BundleCheck:
    """What verify says about the bundle beside a manifest.

    ``state``: "fits", "gpu-unchecked", "mismatch", or why it cannot be trusted or read:
    "unsigned", "no-key", "bad-signature", "bad-key", "corrupt".
    """

    path: str
    state: str
    reason: str

    @property
    def valid(self) -> bool | None:
        return True if self.state == "fits" else None if self.state == "gpu-unchecked" else False


def check_beside(manifest: Manifest) -> BundleCheck | None:
    """The bundle beside a manifest file, checked as apply_manifest would; None if none.

    Without importing torch: the signature with the deployer's key, then versions from torch's
    version.py and package metadata, the GPU from nvidia-smi. "gpu-unchecked" when everything
    checked matches but the GPU could not be checked.
    """
    if not manifest.source_path:
        return None
    path = default_bundle_path(manifest.source_path)
    if not os.path.lexists(path):
        return None
    try:
        key = load_key()
    except CacheKeyError as e:
        return BundleCheck(path, "bad-key", one_line(e.message))
    try:
        meta, _ = read_bundle(path, key=key, with_blob=False)
    except CacheSignatureError as e:
        return BundleCheck(path, e.state, one_line(e.message))
    except CacheBundleError as e:
        return BundleCheck(path, "corrupt", one_line(e.message))
    built = meta["env"]
    gpu = built.get("device") not in (None, "cpu")
    env, unchecked = environment_without_torch(want_gpu=gpu)
    why = mismatches(meta, fingerprint=manifest.fingerprint, key=manifest_key(manifest),
                     overrides=None, env=env, skip=tuple(unchecked))
    over = meta.get("overrides") or {}
    extra = (f"; apply_manifest must be given the same overrides {_canonical(over)}"
             if over else "")
    if why:
        return BundleCheck(path, "mismatch", one_line("; ".join(why)))
    valid_for = f"torch {built.get('torch')} on {built.get('device')}, signature verified"
    if unchecked:
        return BundleCheck(path, "gpu-unchecked", one_line(
            f"valid for {valid_for}; the GPU was not checked (no nvidia-smi, and verify does "
            "not import torch)" + extra))
    return BundleCheck(path, "fits", one_line(f"valid for {valid_for}" + extra))
