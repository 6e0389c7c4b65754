"""The compile-cache bundle file: its signed framing, its metadata, and what it is valid for.

A bundle is code (torch unpickles its artifacts), so nothing in it is believed before its
HMAC-SHA256 verifies with the deployer's key (surgery.runtime.signing): `read_bundle` checks the
MAC first, then parses the metadata as bounded JSON. It is bounded before the MAC too: the
blob's length must match the file's real size and stay under ``SURGERY_MAX_BUNDLE_BYTES``; the
MAC is streamed over the file in 1 MiB chunks, keeping nothing; only a file that verifies is
read, and the bytes read are checked against the MAC again (the file may change meanwhile).
Loading and saving (with torch) live in surgery.runtime.cache; `check_beside` is what
`surgery verify --manifest` reports, without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from surgery.errors import (
    CacheBundleError,
    CacheKeyError,
    CacheSignatureError,
)
from surgery.formats.limits import limit, over, raise_hint
from surgery.formats.manifest import MANIFEST_SUFFIX, Manifest
from surgery.formats.safe_write import write_text_atomic
from surgery.runtime.artifacts import ArtifactError, read_artifacts
from surgery.runtime.bundle_env import ENV_KEYS, environment_without_torch, same_torch
from surgery.runtime.bundle_parts import (
    FORMAT_PRECOMPILED,
    PrecompiledError,
    count_entries,
    parse_precompiled,
    split_blob,
)
from surgery.runtime.kernel_ids import KernelRecordError, parse_record
from surgery.runtime.signing import (
    ENV_KEY,
    ENV_KEY_FILE,
    file_mac_matches,
    load_key,
    mac,
    mac_matches,
)

BUNDLE_SUFFIX = ".surgery.cache"


MAGIC = b"SGCACHE2"


UNSIGNED_MAGIC = b"SGCACHE1"  # format 1, before bundles were signed: never loaded


FORMAT_VERSION = 2  # a Mega-Cache blob only; FORMAT_PRECOMPILED (3) adds a precompiled part


READ_FORMATS = (FORMAT_VERSION, FORMAT_PRECOMPILED)  # every signed layout written so far


_HEADER = struct.Struct("<8sQQ32s")


# Metadata is a few KiB; a larger length means the file is not a bundle (or is garbage).
_MAX_META = 16 * 2**20


# Suffixes a manifest source may carry; the bundle's stem is the name without them.
_MANIFEST_SUFFIXES = (MANIFEST_SUFFIX, ".toml", ".index.json", ".safetensors")


# A reason is one line of a report and of a warning; a signed record could still hold a megabyte.
_REASON_MAX = 600


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


def write_bundle(path: str, blob: bytes, metadata: Mapping[str, Any], *, key: bytes,
                 force: bool = True) -> int:
    """Sign header + metadata + blob with ``key`` and write them beside ``path``, then rename.

    Returns the bytes written.
    """

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
        # Non-blocking, so a FIFO put in its place cannot hang the open; fstat decides.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise CacheBundleError(f"{path}: not a regular file", path=path, hint=_REBUILD)
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
            if b > limit("BUNDLE_BYTES"):
                raise CacheBundleError(f"{path}: refused: " + over("BUNDLE_BYTES", "its blob",
                                                                   b),
                                       path=path, hint=raise_hint("BUNDLE_BYTES", needed=b))
            want = _HEADER.size + n + b
            if info.st_size != want:
                what = "truncated" if info.st_size < want else "damaged"
                raise CacheBundleError(f"{path}: {what}: the file is {info.st_size} bytes, its "
                                       f"header says {want}", path=path, hint=_REBUILD)
            if key is None:
                raise _untrusted(path, "no-key", f"no key to check its signature (neither "
                                 f"{ENV_KEY} nor {ENV_KEY_FILE} is set), so it is not loaded",
                                 _KEY_HINT)
            # The MAC first, streamed over the file in chunks: an unsigned or forged file is
            # refused at 1 MiB of memory, whatever its header promises.
            if not file_mac_matches(key, tag, MAGIC, head[8:24], f=f, length=n + b):
                raise _untrusted(path, "bad-signature", "signature does not verify: it was "
                                 "signed with another key, or changed since it was signed",
                                 _REBUILD)
            f.seek(_HEADER.size)
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
    # The bytes kept are checked again: the file may have changed since the streamed check.
    if not mac_matches(key, tag, MAGIC, head[8:24], raw, blob):
        raise _untrusted(path, "bad-signature", "signature does not verify: it changed while "
                         "it was read", _REBUILD)
    meta = _parse_metadata(raw, path)
    try:
        # Format 3: the Mega-Cache part, then the precompiled part (runtime.bundle_sections).
        megacache, section = split_blob(meta, blob)
        read_artifacts(megacache)
        parse_precompiled(meta, section)
        parse_record(meta)  # the cold run's kernels (runtime.kernel_ids)
    except (ArtifactError, PrecompiledError, KernelRecordError) as e:
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
    if meta.get("format") not in READ_FORMATS:
        raise CacheBundleError(f"{path}: bundle format {_short(meta.get('format'))}, this "
                               f"surgery reads formats {', '.join(map(str, READ_FORMATS))}",
                               path=path, hint=_REBUILD)
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
    if n := count_entries(meta):
        valid_for += f", {n} precompiled region artifact(s)"
    if unchecked:
        return BundleCheck(path, "gpu-unchecked", one_line(
            f"valid for {valid_for}; the GPU was not checked (no nvidia-smi, and verify does "
            "not import torch)" + extra))
    return BundleCheck(path, "fits", one_line(f"valid for {valid_for}" + extra))
