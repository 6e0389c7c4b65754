"""The deployer's key for compile-cache bundles, and the HMAC-SHA256 that binds a bundle to it.

A bundle is code: torch unpickles its artifacts and writes them into its caches. A hash stored
in the same file proves nothing (an attacker recomputes it), so a bundle carries an HMAC-SHA256
over everything it holds, made with a key only the deployer has, and is loaded only when that
MAC verifies (compared in constant time) *before* any of its bytes is parsed or given to torch.

The key comes from code (``key_file=``, ``surgery warm --key-file``) or from the environment:
``SURGERY_CACHE_KEY`` (64 hex digits, or any text of 16 bytes or more) or
``SURGERY_CACHE_KEY_FILE`` (a file holding the same, mode 600: a key file its group or others
can read or write, or that another user owns, is refused, since whoever reads the key can sign).
Without one, building a bundle is refused and loading one is skipped. Make one with
``python -c "import secrets;print(secrets.token_hex(32))"``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import string
from collections.abc import Mapping
from typing import BinaryIO

from surgery.errors import CacheKeyError
from surgery.formats.limits import read_regular_stat

ENV_KEY = "SURGERY_CACHE_KEY"
ENV_KEY_FILE = "SURGERY_CACHE_KEY_FILE"
MIN_KEY_BYTES = 16  # 128 bits; `secrets.token_hex(32)` gives 32 bytes
MAKE_KEY = 'python -c "import secrets;print(secrets.token_hex(32))"'
# A key file's mode may give nothing to its group or others (read or write).
_OPEN_TO_OTHERS = stat.S_IRWXG | stat.S_IRWXO
# Separates this MAC from any other use of the same key.
_DOMAIN = b"surgery compile-cache bundle\x00"
_KEY_FILE_MAX = 4096
_HOW = (f"make a key once with `(umask 077; {MAKE_KEY} > cache.key)` (private to you), then set "
        f"{ENV_KEY_FILE}=cache.key (or {ENV_KEY}=<the hex>) where bundles are built and loaded")


def _decode(raw: bytes, *, where: str) -> bytes:
    """Hex when the text is hex (what `secrets.token_hex` prints), else the bytes themselves."""
    text = raw.strip()
    try:
        s = text.decode("ascii")
    except UnicodeDecodeError:
        s = ""
    key = bytes.fromhex(s) if s and len(s) % 2 == 0 and all(
        c in string.hexdigits for c in s) else text
    if len(key) < MIN_KEY_BYTES:
        raise CacheKeyError(f"the cache key from {where} is {len(key)} bytes; at least "
                            f"{MIN_KEY_BYTES} are needed", hint=_HOW)
    return key


def _read_key_file(path: str, *, where: str) -> bytes:
    try:
        raw, info = read_regular_stat(path, max_bytes=_KEY_FILE_MAX)  # the file read's own
        mode, owner = info.st_mode, info.st_uid
    except OverflowError:
        raise CacheKeyError(f"the cache key file {path!r} ({where}) is larger than "
                            f"{_KEY_FILE_MAX} bytes: not a key", hint=_HOW) from None
    except OSError as e:  # NotRegularFile too: a FIFO or a device is never read as a key
        raise CacheKeyError(f"cannot read the cache key file {path!r} ({where}): "
                            f"{e.strerror or e}", hint=_HOW) from None
    if mode & stat.S_IWOTH:
        # Anyone on the machine could replace the key and sign bundles with it.
        raise CacheKeyError(f"the cache key file {path!r} ({where}) is world-writable, so "
                            "anyone on this machine could sign bundles with it",
                            hint=f"chmod 600 {path}, and rotate the key if others could write "
                            "it")
    if mode & _OPEN_TO_OTHERS:
        # HMAC is symmetric: whoever can read the key can sign a bundle that this process then
        # runs. ssh refuses a private key others can read for the same reason.
        raise CacheKeyError(f"the cache key file {path!r} ({where}) has mode "
                            f"{stat.S_IMODE(mode):04o}: others can read or change it, and "
                            "anyone who can read the key can sign bundles that run here",
                            hint=f"chmod 600 {path}, and rotate the key if others could read "
                            "it")
    if hasattr(os, "geteuid") and owner not in (os.geteuid(), 0):
        raise CacheKeyError(f"the cache key file {path!r} ({where}) belongs to uid {owner}, "
                            "not to this user, who could replace it and sign bundles",
                            hint=f"keep the key in a file of your own, mode 600 ({_HOW})")
    return _decode(raw, where=f"{where} {path!r}")


def load_key(key_file: str | os.PathLike[str] | None = None, *,
             environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key: ``key_file`` if given, else $SURGERY_CACHE_KEY, else $SURGERY_CACHE_KEY_FILE.

    None when none is set; CacheKeyError when one is set but unusable (unreadable, too short).
    """
    env = os.environ if environ is None else environ
    if key_file is not None:
        return _read_key_file(os.fspath(key_file), where="--key-file")
    if env.get(ENV_KEY):
        return _decode(env[ENV_KEY].encode("utf-8", "surrogateescape"), where=f"${ENV_KEY}")
    if env.get(ENV_KEY_FILE):
        return _read_key_file(env[ENV_KEY_FILE], where=f"${ENV_KEY_FILE}")
    return None


def require_key(key_file: str | os.PathLike[str] | None = None) -> bytes:
    """The key, or CacheKeyError saying how to make one (building a bundle needs it)."""
    key = load_key(key_file)
    if key is None:
        raise CacheKeyError(f"no key to sign the compile-cache bundle: neither {ENV_KEY} nor "
                            f"{ENV_KEY_FILE} is set (a bundle is code, so it is loaded only "
                            "when signed by a key its deployer holds)", hint=_HOW)
    return key


def mac(key: bytes, *chunks: bytes) -> bytes:
    """HMAC-SHA256 of the chunks, in order, under ``key``."""
    h = hmac.new(key, _DOMAIN, hashlib.sha256)
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


def file_mac_matches(key: bytes, expected: bytes, *prefix: bytes, f: BinaryIO, length: int,
                     chunk: int = 1 << 20) -> bool:
    """Whether ``expected`` is the MAC of `prefix` then the next `length` bytes of `f`.

    Streamed in `chunk`-byte reads and nothing kept: checking a bundle's MAC costs 1 MiB of
    memory whatever its header claims. A file shorter than `length` does not match.
    """
    h = hmac.new(key, _DOMAIN, hashlib.sha256)
    for part in prefix:
        h.update(part)
    left = length
    while left > 0:
        data = f.read(min(chunk, left))
        if not data:
            return False
        h.update(data)
        left -= len(data)
    return hmac.compare_digest(h.digest(), expected)


def mac_matches(key: bytes, expected: bytes, *chunks: bytes) -> bool:
    """Whether ``expected`` is the MAC of the chunks under ``key`` (constant-time compare)."""
    return hmac.compare_digest(mac(key, *chunks), expected)
