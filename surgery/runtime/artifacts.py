"""Read the framing of torch's Mega-Cache blob without torch, and refuse keys that leave the cache.

``torch.compiler.save_cache_artifacts()`` returns bytes laid out by
``torch.utils._appending_byte_serializer`` (torch 2.7+); no pickle is involved at this level:

    4 bytes   crc32 of the rest, big-endian
    8 bytes   u64 encoding version (1), big-endian
    then, until the end, one group per artifact type:
        bytes   the type name, base64 of UTF-8 ("inductor", "autotune", ...)
        8 bytes u64 number of artifacts
        per artifact: bytes key (base64 of UTF-8), bytes content
    where "bytes" is a u64 big-endian length followed by that many bytes.

Only the contents are pickles, and they are never touched here. What is checked is where torch
will *write* them: an ``autotune`` artifact is written at ``os.path.join(cache_dir, key)``, so an
absolute key (or ``..``) writes any file, such as a ``.pth`` that Python runs at start-up. Keys
must be relative paths of plain name characters, and types must be ones torch 2.7-2.13 writes.

This is defence in depth behind the bundle's signature (surgery.runtime.signing), not the defence: a
signed bundle comes from the key holder, yet its keys are still checked.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib

# Artifact types torch registers (torch/compiler/_cache.py, _ensure_cache_artifacts_registered).
KNOWN_TYPES = ("inductor", "autotune", "aot_autograd", "pgo", "precompile")
_VERSION = 1
# Relative path segments of plain characters: what inductor's hashed keys ("fkoepcbz...") and
# autotune keys ("ab/abcdef....best_config") look like.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+=\-]{0,199}")
_MAX_KEY = 512


class ArtifactError(ValueError):
    """The blob's framing is broken, or an artifact would be written outside torch's caches."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def u64(self) -> int:
        if self.at + 8 > len(self.data):
            raise ArtifactError("the blob ends inside a length field")
        value = int.from_bytes(self.data[self.at:self.at + 8], "big")
        self.at += 8
        return value

    def chunk(self) -> bytes:
        n = self.u64()
        if n > len(self.data) - self.at:
            raise ArtifactError(f"a field says {n} bytes, only {len(self.data) - self.at} remain")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def text(self) -> str:
        try:
            # validate=True: a lenient decode could read another string than the one checked.
            return base64.b64decode(self.chunk(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise ArtifactError("a name field is not base64 of UTF-8 text") from None


def key_problem(key: str) -> str | None:
    """Why torch must not write an artifact under ``key`` (None: a plain relative path)."""
    if not key or len(key) > _MAX_KEY:
        return f"artifact key of length {len(key)}"
    parts = key.split("/")
    if key.startswith(("/", "\\", "~")) or re.match(r"[A-Za-z]:", key):
        return f"artifact key {key[:80]!r} is an absolute path"
    if any(p in ("..", ".") for p in parts):
        return f"artifact key {key[:80]!r} climbs out of the cache folder ('..')"
    if not all(_SEGMENT.fullmatch(p) for p in parts):
        return f"artifact key {key[:80]!r} has characters other than letters, digits and _.:+=-"
    return None


def read_artifacts(blob: bytes) -> dict[str, list[str]]:
    """{type: [key, ...]} of a Mega-Cache blob, after checking its framing, types and keys.

    Raises ArtifactError naming the first problem. Contents are skipped, never parsed.
    """
    if len(blob) < 12:
        raise ArtifactError(f"the blob is {len(blob)} bytes, too short for torch's cache format")
    if zlib.crc32(blob[4:]).to_bytes(4, "big") != blob[:4]:
        raise ArtifactError("the blob's crc32 does not match (not torch's cache format, or "
                            "damaged)")
    r = _Reader(blob)
    r.at = 4
    version = r.u64()
    if version != _VERSION:
        raise ArtifactError(f"torch cache encoding version {version}, expected {_VERSION}")
    out: dict[str, list[str]] = {}
    while r.at < len(blob):
        kind = r.text()
        if kind not in KNOWN_TYPES:
            raise ArtifactError(f"artifact type {kind[:40]!r} is not one torch writes "
                                f"({', '.join(KNOWN_TYPES)})")
        count = r.u64()
        if count > (len(blob) - r.at) // 16:  # each artifact takes two length fields at least
            raise ArtifactError(f"{count} {kind} artifacts cannot fit in the blob")
        keys = out.setdefault(kind, [])
        for _ in range(count):
            key = r.text()
            why = key_problem(key)
            if why:
                raise ArtifactError(f"{kind} {why}")
            r.chunk()  # the content: a pickle, left alone
            keys.append(key)
    return out
