"""torch's source key, computed once by the deployment step and read by every warm start.

Why. inductor looks every Triton kernel of a precompiled artifact up under a key that includes
``torch_key()``: a sha256 over the source of every module in the torch package (the ``.py`` files
and the extension modules), computed once a process. surgery.runtime.warm_loader computes it in
a thread beside the loader's imports, but that walk is Python code (pkgutil, per-module specs)
that holds the GIL between its reads, so it runs slower beside the imports than alone: on the
H200 (the tenth session) it took 1.07-1.12 s there while the imports took 0.91 s, and the first
artifact's load waited 0.45 s for it (with triton's key, which follows it in the same thread).
That wait is about a seventh of the SDPA example's warm start (3.17 s). Yet the key is a function
of the installed torch only, so it can be computed once per install, like bytecode. With the
record (the eleventh session, H200): ``torch_key`` 0.0 s in the thread, the wait 0.18-0.26 s (what
is left is triton's key, which has no setter), and the SDPA warm start 2.15-2.50 s.

What it does.

- ``record()``, in the deployment step (``surgery bytecode``, surgery.runtime.bytecode, in its
  discovery interpreter, which has imported inductor's code cache already): torch's own
  ``torch_key()`` and a *stamp* of the files it reads, written as ``FILE`` into the bytecode
  folder. The stamp is a sha256 over torch's version, the torch package's real path and, for
  every ``.py`` and ``.so`` file below it (``__pycache__`` left out) and the three extra files
  torch adds to its key (inductor's AOT runtime ``interface.cpp``, ``streams.h``, ``script.ld``),
  its path relative to the package, its size and its modification time in ns. That is a
  superset of what ``torch_key()`` reads, and the same proof Python uses to trust a ``.pyc``:
  source size and mtime. A stat walk of about 2,400 files takes 0.06 s on the 2-core CPU,
  against 0.2-1.1 s for the key.
- ``preset()``, in a warm start (warm_loader.KeyPrefetch, on CUDA, first in the key thread,
  beside the loader's imports): where the process has a bytecode folder
  (``sys.pycache_prefix``, from ``PYTHONPYCACHEPREFIX``) holding ``FILE``, and its stamp
  equals the stamp computed now, it hands the key to torch through torch's own setter
  (``torch_key.set``, which torch's compile workers use to receive the parent's key).
  Anything else leaves torch to compute the key as before, and ``preset`` says why: no
  folder, no file, a stale stamp (torch upgraded, a file edited), a file it cannot read, or a
  torch without the setter.

What an attacker's file can do. The file is data: a regular file only (opened without blocking,
so a FIFO cannot hang the start), at most ``MAX_BYTES`` read, one JSON object
with exactly the fields of ``record()``, each checked (two sha256 hex digests, short texts);
anything else is ignored. A forged key that passes (someone who can write the folder, and who
could then also replace its ``.pyc``, which Python runs) changes only which inductor cache entries
are looked up: a mismatch is a cache miss, and an entry found under it is one that person could
have written under the true key into inductor's cache folder (surgery.runtime.private_dirs checks
that folder before a bundle loads). A stale stamp is never trusted, so an upgraded torch
recomputes its key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from typing import Any

FILE = "surgery-torch-key.json"
FORMAT = 1
MAX_BYTES = 4096  # a record is about 300 bytes
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = frozenset({"format", "torch", "stamp", "torch_key"})
# The files torch adds to its key besides the package's modules (torch 2.11-2.14's torch_key).
_EXTRA = ("_inductor/codegen/aoti_runtime/interface.cpp",
          "_inductor/codegen/aoti_runtime/streams.h", "_inductor/script.ld")


def torch_root() -> str:
    import torch

    return os.path.realpath(os.path.dirname(torch.__file__))


def stamp(root: str | None = None, version: str | None = None) -> str:
    """A sha256 over the version, the package path and each key file's path, size and mtime."""
    import torch

    root = os.path.realpath(root or torch_root())
    h = hashlib.sha256()
    h.update(f"{version or torch.__version__}\0{root}\n".encode())
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so")):
                _entry(h, root, os.path.join(folder, name))
    for rel in _EXTRA:
        _entry(h, root, os.path.join(root, rel))
    return h.hexdigest()


def _entry(h: Any, root: str, path: str) -> None:
    try:
        st = os.stat(path)
    except OSError:
        h.update(f"{os.path.relpath(path, root)}\0absent\n".encode())
        return
    h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())


def record() -> dict[str, Any]:
    """torch's key and the stamp of the files it reads, for ``write`` (imports inductor's code
    cache: a deployment step's cost)."""
    import torch
    from torch._inductor.codecache import torch_key  # heavy: inductor's

    key = torch_key()
    return {"format": FORMAT, "torch": torch.__version__, "stamp": stamp(),
            "torch_key": key.hex()}


def parse(raw: bytes) -> dict[str, Any] | str:
    """A record read back, or why it is refused (one line)."""
    if len(raw) > MAX_BYTES:
        return f"larger than {MAX_BYTES} bytes"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "not JSON"
    if not isinstance(data, dict) or set(data) != _FIELDS:
        return f"not a record: fields {sorted(data)[:6] if isinstance(data, dict) else '-'}"
    if data["format"] != FORMAT or type(data["format"]) is not int:
        return f"format {str(data['format'])[:20]!r}, not {FORMAT}"
    if not isinstance(data["torch"], str) or len(data["torch"]) > 64:
        return "torch: not a short text"
    for k in ("stamp", "torch_key"):
        if not isinstance(data[k], str) or not _HEX64.fullmatch(data[k]):
            return f"{k}: not a sha256 hex digest"
    return data


def write(folder: str, rec: dict[str, Any]) -> str:
    """Write ``rec`` as ``FILE`` into ``folder`` (already checked private by the caller), whole
    or not at all; returns the path. A record that would not read back is refused."""
    text = json.dumps(rec, sort_keys=True).encode()
    if isinstance(why := parse(text), str):
        raise ValueError(f"torch key record refused: {why}")
    path = os.path.join(folder, FILE)
    fd, tmp = tempfile.mkstemp(prefix=".torch-key-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def preset(folder: str | None = None) -> str:
    """Hand torch its key from the bytecode folder's record when the stamp matches; "set", or
    why not (see the module doc). Never raises: torch then computes the key itself."""
    folder = folder or sys.pycache_prefix
    if not folder:
        return "no bytecode folder (PYTHONPYCACHEPREFIX unset)"
    path = os.path.join(folder, FILE)
    try:
        # not blocking: a FIFO put there would hang the start on open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return f"no {FILE} in the bytecode folder (run `surgery bytecode` again)"
    except OSError as e:
        return f"{FILE} unreadable: {type(e).__name__}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{FILE} ignored: not a regular file"
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        return f"{FILE} unreadable: {type(e).__name__}"
    finally:
        os.close(fd)
    rec = parse(raw)
    if isinstance(rec, str):
        return f"{FILE} ignored: {rec}"
    try:
        from torch._inductor.codecache import torch_key  # heavy: inductor's (imported already)

        setter = getattr(torch_key, "set", None)
        if setter is None:
            return "this torch's torch_key has no setter"
        now = stamp()
        if now != rec["stamp"]:
            return f"{FILE} is stale (torch's files changed since `surgery bytecode`)"
        setter(bytes.fromhex(rec["torch_key"]))
    except (RuntimeError, AssertionError):  # torch's setter (2.14 raises, 2.11 asserts)
        return "not set: torch computed its key in this process first"
    except Exception as e:  # torch then computes its key itself, as before
        return f"not set: {type(e).__name__}: {str(e)[:80]}"
    return "set"
