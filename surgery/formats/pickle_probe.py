"""Say what a refused ``.pt``/``.pth``/``.ckpt``/``.bin`` file is, without running any of it.

torch's weights-only loader refuses many different files with one message: a text file, a
truncated copy and a pickle that would start a shell all come back as "Weights only load
failed", with advice to turn weights_only off. Repeating that advice would execute the file,
and calling a text file "code" misleads. So the file is classified by its bytes first:

- empty, or neither a zip archive (torch >= 1.6) nor a pickle (the legacy format): it is not a
  PyTorch checkpoint at all, and torch never sees it;
- a legacy pickle cannot be memory-mapped, so it is loaded without mmap from the start;
- a refusal is explained by scanning the pickle's opcodes with ``pickletools`` (which parses
  and never executes): a pickle that imports or calls anything torch's allowlist refused is
  unsafe (`UnsafeCheckpointError`, "would run code"); one that merely uses an opcode the
  weights-only loader lacks, or ends early, is unreadable (`CheckpointError`).

## Plain-data classes allowed as data

`torch.load(weights_only=True)` refuses every class outside torch's own allowlist, and rightly:
a pickle that names a class can make the loader call it. But some checkpoints name a class that
holds only data. timm's `train.py` (its `CheckpointSaver`) saves every checkpoint as
``{'epoch', 'arch', 'state_dict', 'optimizer', 'version', 'args', 'metric'}`` with `args` an
`argparse.Namespace`, and timm's own loader allows that class. Refusing it refused the file the
README shows first (`surgery plan output/train/checkpoint.pth.tar`).

So the classes in `PLAIN_DATA_TYPES` are allowed through torch's weights-only unpickler, and
nothing else changes:

- Only torch's weights-only unpickler ever sees the file, never `pickle.load`. The classes are
  added for the duration of surgery's own load (`torch.serialization.safe_globals`, a context),
  never process-wide (`add_safe_globals` would widen what the caller's own `torch.load` accepts).
- What that unpickler can do with an allowed class, and why each is data:
  - NEWOBJ calls ``cls.__new__(cls, *args)``: `object.__new__` for `Namespace`, which ignores
    the arguments; the path classes' `__new__` only stores the given parts.
  - BUILD, on a class without `__setstate__` (none of these has one), does
    ``inst.__dict__.update(state)``: it sets attributes and runs no method.
  - REDUCE calls ``cls(*args)``: `Namespace(*args)` takes no positional argument (a non-empty
    call is a TypeError, reported as unreadable); `PurePosixPath(*parts)` joins strings and does
    no I/O (a `PosixPath` touches the file system only when one of its methods is called, which
    the loader never does).
  - The values they hold are unpickled by the same loader, so they are tensors, containers,
    numbers, strings, or another class from this list; an attacker's pickle can nest them but
    cannot reach any other callable. A 100 KB file makes at most ~100 KB of such objects.
- The pickle scan that explains a refusal (`scan_for_code`, below) counts these classes as
  allowed, so a refused file still names the class that makes it unsafe, not `Namespace`.

The allowed classes, and who saves them:

- `argparse.Namespace`: timm `train.py` (`args`), fairseq, most argparse training scripts. A bag
  of attributes: no `__setstate__`, no positional constructor.
- `pathlib.PosixPath`, `pathlib.PurePosixPath`: an argparse `type=pathlib.Path` option inside
  those `args` (`--data-dir`, `--output`). A tuple of strings; no I/O until a method is called.

Not allowed, because their reconstruction can call code or they need a third-party import: numpy
arrays and scalars (`_reconstruct`, object dtypes), omegaconf `DictConfig`, Lightning's
`AttributeDict`, any model or optimizer object. Such a file is still refused, naming the class.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickletools
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager

from surgery.errors import CheckpointError, UnsafeCheckpointError

ZIP_MAGIC = b"PK\x03\x04"
# A pickle of protocol 2 or later opens with PROTO; torch's legacy format writes protocol 2.
# Protocol 0 and 1 pickles open with any opcode: they are recognised by parsing (`_parses`).
_PROTO = 0x80
# Only the first bytes of a pickle are scanned to explain a refusal: the refused opcode of a
# real checkpoint comes early, and a scan must not read a multi-GB file.
_SCAN_BYTES = 16 * 1024 * 1024
_TAR_MAGIC_AT = 257
_NOT_A_CHECKPOINT_HINT = ("give a checkpoint written by torch.save (or a .safetensors file); "
                          "this file may be mislabelled or damaged")
_REFUSED_HINT = ("in the trusted environment that wrote it, re-save only tensors: "
                 "torch.save(model.state_dict(), ...) or safetensors' save_file")


def probe_format(path: str, head: bytes, size: int) -> str:
    """'zip', 'pickle' or 'tar' from a file's first bytes; a CheckpointError for anything else.

    `head` is the file's first 512 bytes (or all of it, if shorter).
    """
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a PyTorch checkpoint",
                              path=path, hint="the file has no data; save or copy it again")
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if head[:1] == bytes([_PROTO]) and len(head) > 1 and 2 <= head[1] <= 5:
        return "pickle"
    if head[_TAR_MAGIC_AT:_TAR_MAGIC_AT + 5] == b"ustar":
        return "tar"  # torch's oldest format (before 0.4); torch reads and checks it
    if _parses(head):
        return "pickle"
    shown = head[:8].hex(" ")
    raise CheckpointError(
        f"{path}: not a PyTorch checkpoint: it is neither a zip archive nor a pickle "
        f"(it starts with bytes {shown})", path=path, hint=_NOT_A_CHECKPOINT_HINT)


def _parses(data: bytes) -> bool:
    """Whether `data` opens with one complete, well-formed pickle (protocol 0 or 1)."""
    try:
        for op, _arg, _pos in pickletools.genops(io.BytesIO(data)):
            if op.name == "STOP":
                return True
    except Exception:  # pickletools raises ValueError, KeyError, ... on malformed input
        return False
    return False


def _pickle_bytes(path: str, fmt: str) -> bytes:
    """The pickle torch unpickles: the file itself, or the zip's ``*/data.pkl``."""
    if fmt == "zip":
        try:
            with zipfile.ZipFile(path) as z:
                name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
                if name is None:
                    return b""
                with z.open(name) as f:
                    return f.read(_SCAN_BYTES)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
            return b""
    with open(path, "rb") as f:
        return f.read(_SCAN_BYTES)


def scan_for_code(data: bytes) -> str | None:
    """The first global a pickle stream imports that torch does not allow, else None.

    Parses with pickletools and never executes. A legacy file is several pickles back to back,
    so scanning continues after each STOP until the raw tensor data stops the parser. Names
    torch's weights-only loader allows (its rebuild functions, OrderedDict, dtypes) are what
    every checkpoint holds, so they are skipped: the name reported is the one that makes the
    file unsafe. An EXT opcode fetches a global from the copyreg registry, so it counts too.
    """
    allowed = _allowed_globals() | plain_type_names()
    stream = io.BytesIO(data)
    strings: list[str] = []
    while stream.tell() < len(data):
        try:
            for op, arg, _pos in pickletools.genops(stream):
                if isinstance(arg, str):
                    strings = [*strings, arg][-2:]
                name = None
                if op.name in ("GLOBAL", "INST") and isinstance(arg, str):
                    name = arg.replace(" ", ".")
                elif op.name == "STACK_GLOBAL" and len(strings) == 2:
                    name = ".".join(strings)
                elif op.name in ("EXT1", "EXT2", "EXT4"):
                    return f"pickle opcode {op.name}, which imports a registered global"
                if name is not None and name not in allowed:
                    return name
        except Exception:  # the rest of the stream is raw tensor data or damaged: stop here
            break
    return None


def _allowed_globals() -> frozenset[str]:
    """What torch's weights-only loader allows; torch is imported by the time this runs."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals  # private, so guarded

        return frozenset(_get_allowed_globals())
    except Exception:  # another torch version: fall back to what every state dict holds
        return frozenset({"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                          "torch._utils._rebuild_parameter", "torch.FloatStorage"})


def explain_refusal(path: str, fmt: str, message: str) -> CheckpointError:
    """The error for a file torch's weights-only loader refused with `message`.

    torch's text advises weights_only=False; it is never passed on.
    """
    culprit = _named_global(message) or scan_for_code(_pickle_bytes(path, fmt))
    if culprit is not None:
        return UnsafeCheckpointError(
            f"{path}: refused: loading it would run code ({culprit}); surgery never executes "
            "a checkpoint", path=path, hint=_REFUSED_HINT)
    opcode = _unsupported_opcode(message)
    what = f"its pickle uses opcode {opcode}, which a weights-only load does not read" \
        if opcode else "its pickle is damaged or not one torch.save wrote"
    return CheckpointError(f"{path}: not a readable PyTorch checkpoint ({what})", path=path,
                           hint=_NOT_A_CHECKPOINT_HINT)


def _named_global(message: str) -> str | None:
    """The global torch's message says it refused (``GLOBAL posix.system``), if it says one."""

    m = re.search(r"GLOBAL ([\w.]+)", message)
    return m.group(1) if m else None


def _unsupported_opcode(message: str) -> str | None:

    m = re.search(r"Unsupported operand (\d+)", message)
    if not m:
        return None
    code = int(m.group(1))
    names = {op.code: op.name for op in pickletools.opcodes}
    return f"{names[chr(code)]} ({code})" if 0 <= code < 256 and chr(code) in names \
        else str(code)


PLAIN_DATA_TYPES: tuple[type, ...] = (argparse.Namespace, pathlib.PosixPath,
                                      pathlib.PurePosixPath)


def plain_type_names() -> frozenset[str]:
    """The pickle global names of PLAIN_DATA_TYPES (``argparse.Namespace``, ...).

    Taken from the classes themselves: pathlib's classes live in ``pathlib._local`` from
    Python 3.13, and a pickle names the module that defines the class.
    """
    return frozenset(f"{t.__module__}.{t.__qualname__}" for t in PLAIN_DATA_TYPES)


@contextmanager
def plain_types_allowed() -> Iterator[None]:
    """Allow PLAIN_DATA_TYPES in torch's weights-only loader inside the block, and only there."""
    import torch  # heavy: only where a pickle is loaded

    with torch.serialization.safe_globals(list(PLAIN_DATA_TYPES)):
        yield
