"""The resource contract: how much memory and time an untrusted file may make surgery spend.

A crafted file of a few KB must not take gigabytes, minutes, or a file that is not its own
(README, "Threat model"). Each reader checks its input against a named limit here *before*
the costly step (tomllib, torch's unpickler, a blob read, a MAC), and refuses what is beyond
it with one line and exit 3 that names the limit and how to raise it.

Every limit was picked from real files, with a wide margin: the largest real checkpoints and
manifests pass under the defaults (the figures beside each). A user who trusts a file beyond
them raises one limit with its environment variable, ``SURGERY_MAX_<NAME>=<value>``; an
unparsable or non-positive value is ignored (the default holds), so a typo never lifts a bound.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

_ENV_PREFIX = "SURGERY_MAX_"
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Limit:
    """One named bound: its default, its unit, and what real files need of it."""

    name: str  # the env var suffix: SURGERY_MAX_<name>
    default: int
    unit: str
    why: str


LIMITS: dict[str, Limit] = {lim.name: lim for lim in (
    # TOML (manifest files and the manifest an export embeds). Real manifests: the deepest
    # dotted key is `region.compile.options` (3 parts inside a table header); module paths
    # are values, not keys. The longest key is an option name (~40 characters).
    Limit("TOML_KEY_PARTS", 16, "dotted parts", "a manifest's deepest key has 3"),
    Limit("TOML_KEY_CHARS", 256, "characters", "a manifest's longest key has ~40"),
    # A module path in a manifest or a checkpoint key: real ones (LingBot-Map, Flux, HF) are
    # under 12 dotted parts and 200 characters.
    Limit("KEY_PARTS", 32, "dotted parts", "real checkpoint keys have at most ~12"),
    Limit("KEY_CHARS", 4096, "characters", "real checkpoint keys are under 200"),
    # The characters of the distinct module paths keys imply, over the keys' own characters:
    # real keys share their prefixes (a 24-block model: ~0.3x).
    Limit("MODULE_PATHS_RATIO", 8, "x", "real keys share their prefixes (well under 1x)"),
    # Pickles: the pickle torch unpickles (a zip's data.pkl or a legacy file) is ~100-200
    # bytes per tensor: 1M tensors is ~200 MB.
    Limit("PICKLE_BYTES", 1024 * _MIB, "bytes", "1M tensors pickle to ~200 MB"),
    # What a pickle's storage ids and constructor calls would allocate, over the file's size
    # (plus 1 MiB): a real checkpoint's storages are bytes inside the file (1x).
    Limit("PICKLE_ALLOC_RATIO", 2, "x", "a real checkpoint's storages lie inside it (1x)"),
    # A zip entry's uncompressed size over its compressed size. torch.save stores every entry
    # uncompressed (ratio 1); a re-zipped checkpoint of real weights compresses ~1.1x.
    Limit("ZIP_RATIO", 20, "x", "torch.save stores entries uncompressed (1x)"),
    # A tensor's logical bytes over the bytes of its storage (stride-0 expanded tensors).
    # Real state dicts hold views no larger than their storage.
    Limit("EXPAND_RATIO", 1, "x", "real state dict tensors are no larger than their storage"),
    # A bundle's blob: real bundles of a 24-block model are ~20-60 MB.
    Limit("BUNDLE_BYTES", 4096 * _MIB, "bytes", "real bundles are ~20-60 MB"),
    # Problems collected before one is reported (schema errors, findings in text output).
    Limit("ERRORS", 1000, "problems", "one is reported, with a count"),
)}


def limit(name: str) -> int:
    """The value of limit `name`: its env var if set to a positive integer, else the default."""
    lim = LIMITS[name]
    raw = os.environ.get(_ENV_PREFIX + name, "").strip().replace("_", "")
    try:
        value = int(raw)
    except ValueError:
        return lim.default
    return value if value > 0 else lim.default


def env_var(name: str) -> str:
    """The environment variable that raises limit `name`."""
    assert name in LIMITS, name
    return _ENV_PREFIX + name


def raise_hint(name: str, *, needed: int | None = None) -> str:
    """The fix for a refusal by limit `name`: how a user who trusts the file raises it."""
    lim = LIMITS[name]
    value = f"{needed}" if needed is not None else f"{max(limit(name), 1) * 4}"
    return (f"if you trust the file, raise the limit: {env_var(name)}={value} "
            f"(now {limit(name)} {lim.unit}; {lim.why})")


def over(name: str, what: str, got: int) -> str:
    """One line: `what` is `got`, beyond limit `name`."""
    lim = LIMITS[name]
    return f"{what} is {got} {lim.unit}, beyond the limit of {limit(name)} ({env_var(name)})"


class NotRegularFile(OSError):
    """A path that names a FIFO, a device, a socket or a folder: never read as a file."""


def read_regular(path: str, *, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path` (``read_regular_stat`` without the stat)."""
    return read_regular_stat(path, max_bytes=max_bytes)[0]


def read_regular_stat(path: str, *, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at `path`, at most its size as ``fstat`` reported it, and
    that ``fstat``: the mode and owner of the very file read (a second ``stat`` of the path
    could see another file put there between the two).

    A FIFO, a device (a symlink to ``/dev/zero`` reports size 0 and never ends), a socket or a
    folder raises NotRegularFile; opening is non-blocking, so a FIFO with no writer cannot hang
    the open itself. A file larger than `max_bytes` raises OverflowError(size) before any read.
    Reading stops at the reported size even if the file grows meanwhile. Symlinks to regular
    files are followed (the Hugging Face cache is made of them).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise OverflowError(st.st_size)
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break  # truncated meanwhile: what was there is what is read
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a plain file"


# C0 and C1 control characters, DEL, and the line and paragraph separators: what can move a
# terminal's cursor, start an escape sequence, or forge a line of output.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029", ord("\\"): "\\\\"})
MAX_LINE_CHARS = 300


def printable(text: str, *, max_chars: int = MAX_LINE_CHARS) -> str:
    """`text` safe to print on one line: control characters escaped (``\\x1b``, ``\\n``), lone
    surrogates escaped, cut to `max_chars` with a count of what was left out."""
    if len(text) > max_chars:
        text = f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"
    out = text.translate(_CONTROL)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        out = out.encode("utf-8", "backslashreplace").decode("utf-8")
    return out
