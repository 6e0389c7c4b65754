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
(surgery.runtime.signing: $SURGERY_CACHE_KEY or $SURGERY_CACHE_KEY_FILE). The checks, in order, all
before torch sees a byte: magic and lengths against the file's size; the key is there; the MAC
(constant-time compare), before any byte of the metadata is parsed; the metadata; the framing of
the blob and every artifact key (surgery.runtime.artifacts, defence in depth); then the environment;
then that the folders torch writes the code into are private (surgery.runtime.private_dirs).
Every problem becomes a one-line reason, never an exception: a stale, forged or corrupt bundle
must not stop a deployment; it only costs the compile it would have saved. Format-1 bundles
(``SGCACHE1``, written before bundles were signed) are never loaded; verify calls them unsigned.

This module imports torch only inside the functions that need it: `surgery verify` checks a
bundle's signature and compares versions without importing torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from surgery import __version__
from surgery.errors import (
    CacheBundleError,
    CacheKeyError,
    OutputExistsError,
)
from surgery.formats.manifest import Manifest
from surgery.runtime.bundle import (
    FORMAT_VERSION,
    _canonical,
    manifest_key,
    mismatches,
    one_line,
    read_bundle,
    write_bundle,
)
from surgery.runtime.bundle_env import ENV_KEYS, environment, environment_without_torch
from surgery.runtime.bundle_parts import (
    FORMAT_PRECOMPILED,
    PRECOMPILED_KEY,
    AotiParsed,
    Parsed,
    count_entries,
    parse_parts,
    split_blob,
)
from surgery.runtime.kernel_ids import KernelRecord, parse_record
from surgery.runtime.private_dirs import private_dirs_problem
from surgery.runtime.signing import load_key, require_key

__all__ = ["ENV_KEYS", "environment", "environment_without_torch"]  # re-exported
# torch.compile counters (torch._dynamo.utils.counters) that show whether compiles hit a cache.
_COUNTERS = {
    "fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
    "aot_autograd_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_autograd_misses": ("aot_autograd", "autograd_cache_miss"),
}


# --- the file ---------------------------------------------------------------------------------


# --- load and save (these import torch) -------------------------------------------------------

def _api_missing() -> str | None:
    import torch

    if not hasattr(torch.compiler, "load_cache_artifacts"):
        return (f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts "
                "(added in torch 2.7)")
    return None


@dataclass
class OpenedBundle:
    """What `open_bundle` made of a bundle: whether its Mega-Cache part went to torch, why (or
    what it held), and its precompiled artifacts (group identity -> signature text -> (bytes,
    modes, inlined source spans)), which exist only when the bundle verified with the
    deployer's key and fits."""

    loaded: bool
    reason: str
    precompiled: Parsed
    aoti: AotiParsed = field(default_factory=dict)  # AOTInductor packages, trusted likewise
    pending: bytes | None = None  # the Mega-Cache part, verified, not yet given to torch
    kernels: KernelRecord | None = None  # what the cold run ran (surgery.runtime.kernel_ids)


def load_bundle(path: str, *, manifest: Manifest, overrides: Mapping[str, Any] | None,
                device: str) -> tuple[bool, str]:
    """`open_bundle`'s (loaded, one-line reason), for callers that want the Mega-Cache only."""
    opened = open_bundle(path, manifest=manifest, overrides=overrides, device=device)
    return opened.loaded, opened.reason


def open_bundle(path: str, *, manifest: Manifest, overrides: Mapping[str, Any] | None,
                device: str, defer: bool = False,
                admitted: Callable[[Parsed, AotiParsed], None] | None = None) -> OpenedBundle:
    """Hand the bundle's Mega-Cache part to ``torch.compiler.load_cache_artifacts``, and return
    its precompiled part, if, and only if, it is signed with the deployer's key
    (surgery.runtime.signing) and fits this manifest and machine. With ``defer`` and AOTInductor
    packages in the bundle, the Mega-Cache part is returned unloaded (``pending``): runners need
    none of it, and its load imports inductor's caches (surgery.runtime.aoti_bundle).
    ``admitted(precompiled, aoti)`` is called once every check passed, before the Mega-Cache
    load: work that the artifacts will need and that needs no byte of the bundle (the loader's
    keys and native build, surgery.runtime.warm_loader) can start there, beside that load.

    Never raises for a bad bundle: the caller compiles as usual. No byte of the bundle reaches
    torch, or the caller, unless every check passed.
    """
    try:
        parts, why = _admit(path, manifest=manifest, overrides=overrides, device=device)
    except Exception as e:  # a bundle must never stop a deployment, whatever is in it
        return OpenedBundle(False, one_line(f"{path}: unreadable ({type(e).__name__})"), {})
    if parts is None:
        return OpenedBundle(False, one_line(why), {})
    blob, precompiled, aoti, kernels = parts
    if admitted is not None:
        admitted(precompiled, aoti)
    counts: dict[str, int] = {}
    if not (defer and aoti):
        failed, counts = load_megacache(path, blob)
        if failed:
            return OpenedBundle(False, failed, {})
    if n := sum(len(v) for v in precompiled.values()):
        counts["precompiled"] = n
    if n := sum(len(v) for v in aoti.values()):
        counts["AOTInductor"] = n
    waits = "; its Mega-Cache part waits for the first compile" if defer and aoti else ""
    return OpenedBundle(True, f"{path}: {_describe(counts)}{waits}", precompiled, aoti,
                        blob if defer and aoti else None, kernels)


def load_megacache(path: str, blob: bytes) -> tuple[str, dict[str, int]]:
    """Give a verified Mega-Cache part to torch: ("", artifact counts), or (why not, {})."""
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as e:  # torch's own deserialiser: any failure means "compile as usual"
        return one_line(f"{path}: torch could not load it ({type(e).__name__}: {e})"), {}
    if info is None:
        return f"{path}: torch could not deserialise the blob (see its log above)", {}
    return "", _artifact_counts(info)


def _admit(path: str, *, manifest: Manifest, overrides: Mapping[str, Any] | None,
           device: str
           ) -> tuple[tuple[bytes, Parsed, AotiParsed, KernelRecord | None] | None, str]:
    """((Mega-Cache part, precompiled artifacts, AOTInductor packages, kernel record), "")
    when the bundle may be loaded, else (None, why)."""
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
    # Verified and fitting; its code is still only as safe as the folders torch writes it to.
    if unsafe := private_dirs_problem():
        return None, f"{path} is not loaded: {unsafe}"
    assert blob is not None
    megacache, section = split_blob(meta, blob)  # read_bundle checked both parts
    return (megacache, *parse_parts(meta, section), parse_record(meta)), ""


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
        n = count_entries(self.metadata)
        pre = self.metadata.get(PRECOMPILED_KEY) or {}
        return [f"wrote {self.path} ({self.bytes / 1e6:.2f} MB; "
                f"{_describe(self.metadata['artifacts'])}"
                + (f"; {n} precompiled region artifact(s), loaded without dynamo" if n else "")
                + ")",
                *(f"not precompiled: {note}" for note in pre.get("notes", [])[:8]),
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
                device: str, force: bool = True, key: bytes | None = None,
                precompiled: tuple[bytes, dict[str, Any]] | None = None) -> SavedBundle:
    """Serialise this process's compile caches into a bundle bound to ``manifest``, signed with
    ``key`` (default: the deployer's key from the environment, surgery.runtime.signing).

    torch records every artifact compiled (or loaded from a cache) in this process, so call it
    after warm-up, in a process that compiled this model only. ``precompiled`` is the
    precompiled part and its record (surgery.runtime.precompiled.Section): with it the bundle
    is written in format 3 (surgery.runtime.bundle), even when the record lists no
    artifact (its notes say why).
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
    if precompiled is not None:
        section, record = precompiled
        meta["format"] = FORMAT_PRECOMPILED
        meta[PRECOMPILED_KEY] = record
        blob = blob + section
    size = write_bundle(path, blob, meta, key=key, force=force)
    meta["blob"] = {"bytes": len(blob)}
    return SavedBundle(path, size, meta)


def cache_counters() -> dict[str, int]:
    """Compile-cache hits and misses so far in this process (torch's own counters)."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for name, (group, key) in _COUNTERS.items()}



# --- surgery verify ---------------------------------------------------------------------------
