"""Bounds on a pickle checkpoint, checked before torch's unpickler reads a byte of it.

torch's weights-only unpickler runs no code, but what it allows can still allocate far more
than a file holds: ``builtins.bytearray(N)`` and the tensor and storage classes called with
an integer allocate N elements from a 35-byte file; a legacy file's storage ids declare a
``numel`` that torch allocates before it reads the bytes; a zip's ``data.pkl`` is read whole,
so a DEFLATE entry of zeros inflates 1 MB into gigabytes. And a stride-0 (expanded) tensor of
1.5 KB is a 2 GB tensor to whoever copies it.

So, in this order, each step bounded by what the file could justify:

1. a zip's central directory: every entry lies inside the file; an entry's uncompressed size
   is at most ``SURGERY_MAX_ZIP_RATIO`` times its compressed size; ``data.pkl`` is at most
   ``SURGERY_MAX_PICKLE_BYTES``. Read through zipfile, which stops at the declared size.
2. the pickle's opcodes, walked by `scan_pickle` (a symbolic stack of the opcodes torch's
   weights-only unpickler supports, never executing one): every string length fits in what is
   left of the stream; the bytes every storage id declares (each storage once) plus every
   allocating constructor called with integers stay within ``SURGERY_MAX_PICKLE_ALLOC_RATIO``
   times the file's size (plus 1 MiB). An opcode torch does not support ends the walk: torch
   refuses it at the same point.
3. after torch loaded the tensors, `check_loaded_tensors`: a tensor whose logical bytes exceed
   its storage's by more than ``SURGERY_MAX_EXPAND_RATIO`` is refused (raise the limit to have
   it materialised), and so are meta, nested and non-strided tensors, which have no bytes to
   export.

The walk is linear in the pickle's size and holds only what is on the symbolic stack.
DCP metadata (``.metadata``) is a pickle too: a reader of it calls `check_pickle_bytes`.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Mapping
from typing import IO, Any

from surgery.errors import CheckpointError
from surgery.formats.limits import env_var, limit, over, printable, raise_hint

_MIB = 1024 * 1024
_SLACK = _MIB  # allocations a tiny file may make regardless of its size
# Bytes per element of the storage classes a pickle names (torch.<Name>Storage); an unknown
# name counts as one byte (the bound stays a small multiple of the truth).
_STORAGE_BYTES = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
    "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1,
    "BoolStorage": 1, "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16,
    "UntypedStorage": 1,
}


class _Global(str):
    """A global the pickle names (module.name); never imported."""


class _Opaque:
    """Any value the walk does not need to know."""


_OPAQUE = _Opaque()
_MARK = object()
_SHORT = 256  # strings longer than this are kept as _OPAQUE: names and keys are shorter


def _allocates(name: str) -> bool:
    """Constructors torch's allowlist lets a pickle call that allocate from an int argument."""
    if name == "builtins.bytearray":
        return True
    return name.startswith("torch.") and (name.endswith("Tensor") or name.endswith("Storage"))


def _ints(value: Any) -> int:
    """The element count an argument tuple of ints (or nested tuples of ints) asks for."""
    n = 1
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is int:
            n *= max(v, 0)
        elif type(v) is tuple:
            stack.extend(v)
    return n


class PickleLimit(ValueError):
    """Why a pickle stream is refused: (message, limit name)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.limit = name


def scan_pickle(f: IO[bytes], *, end: int, budget: int, pickles: int = 1) -> int:
    """Walk `pickles` pickles from `f` (which ends at byte `end`); the bytes they would allocate.

    Raises PickleLimit when a length runs past `end` or the allocations pass `budget`. Stops
    quietly at an opcode torch's weights-only unpickler does not support, or at the stream's
    end (torch reports those itself).
    """
    read = f.read
    unpack = struct.unpack
    allocated = 0
    storages: set[Any] = set()
    for _ in range(pickles):
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        while True:
            b = read(1)
            if not b:
                return allocated
            op = b[0]
            if op == 0x58:  # BINUNICODE
                raw = read(4)
                if len(raw) < 4:
                    return allocated
                (n,) = unpack("<I", raw)
                if n > end - f.tell():
                    return allocated  # truncated: torch reads what is there and says so
                s = read(n)
                if n <= _SHORT:
                    try:
                        stack.append(s.decode("utf-8", "surrogatepass"))
                    except UnicodeDecodeError:
                        return allocated
                else:
                    stack.append(_OPAQUE)
            elif op == 0x55 or op == 0x8A:  # SHORT_BINSTRING, LONG1
                raw = read(1)
                if not raw:
                    return allocated
                data = read(raw[0])
                if op == 0x55:
                    stack.append(data.decode("latin-1"))
                else:
                    stack.append(int.from_bytes(data, "little", signed=True))
            elif op == 0x4A:  # BININT
                stack.append(unpack("<i", read(4))[0])
            elif op == 0x4B:  # BININT1
                stack.append(read(1)[0])
            elif op == 0x4D:  # BININT2
                stack.append(unpack("<H", read(2))[0])
            elif op == 0x47:  # BINFLOAT
                read(8)
                stack.append(_OPAQUE)
            elif op == 0x71:  # BINPUT
                memo[read(1)[0]] = stack[-1] if stack else _OPAQUE
            elif op == 0x72:  # LONG_BINPUT
                memo[unpack("<I", read(4))[0]] = stack[-1] if stack else _OPAQUE
            elif op == 0x68:  # BINGET
                stack.append(memo.get(read(1)[0], _OPAQUE))
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo.get(unpack("<I", read(4))[0], _OPAQUE))
            elif op == 0x63:  # GLOBAL
                module = f.readline(_SHORT)
                name = f.readline(_SHORT)
                stack.append(_Global(f"{module[:-1].decode('utf-8', 'replace')}."
                                     f"{name[:-1].decode('utf-8', 'replace')}"))
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
            elif op in (0x74, 0x65, 0x75):  # TUPLE, APPENDS, SETITEMS
                items = stack
                stack = metastack.pop() if metastack else []
                if op == 0x74:
                    stack.append(tuple(items))
            elif op == 0x85:  # TUPLE1
                if stack:
                    stack[-1] = (stack[-1],)
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [tuple(stack[-2:])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [tuple(stack[-3:])]
            elif op in (0x52, 0x81):  # REDUCE, NEWOBJ
                args = stack.pop() if stack else ()
                func = stack[-1] if stack else None
                if isinstance(func, _Global) and _allocates(func) and type(args) is tuple:
                    allocated += _ints(args) * (1 if func == "builtins.bytearray" else 8)
                if stack:
                    stack[-1] = _OPAQUE
            elif op == 0x51:  # BINPERSID: ('storage', type, key, location, numel[, views])
                pid = stack.pop() if stack else None
                if type(pid) is tuple and len(pid) >= 5 and pid[0] == "storage" and \
                        type(pid[4]) is int and (pid[2], pid[1]) not in storages:
                    storages.add((pid[2], pid[1]))
                    kind = str(pid[1]).rsplit(".", 1)[-1]
                    allocated += max(pid[4], 0) * _STORAGE_BYTES.get(kind, 1)
                stack.append(_OPAQUE)
            elif op in (0x62, 0x61, 0x73):  # BUILD, APPEND, SETITEM
                del stack[-(2 if op == 0x73 else 1):]
            elif op in (0x4E, 0x89, 0x88, 0x29, 0x5D, 0x7D, 0x8F):
                # NONE, NEWFALSE, NEWTRUE, EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT, EMPTY_SET
                stack.append(() if op == 0x29 else _OPAQUE)
            elif op == 0x80:  # PROTO
                read(1)
            elif op == 0x2E:  # STOP
                break
            else:
                return allocated  # torch's weights-only unpickler refuses it at this point
            if allocated > budget:
                raise PickleLimit(f"its pickle would allocate {allocated} bytes, more than "
                                  f"{limit('PICKLE_ALLOC_RATIO')}x the file's size plus 1 MiB "
                                  f"({budget} bytes; {env_var('PICKLE_ALLOC_RATIO')})",
                                  "PICKLE_ALLOC_RATIO")
    return allocated


def alloc_budget(size: int) -> int:
    """What a pickle of a `size`-byte file may allocate: its bytes times the ratio, plus 1 MiB."""
    return size * limit("PICKLE_ALLOC_RATIO") + _SLACK


def check_pickle_bytes(data: bytes, *, path: str, size: int | None = None) -> None:
    """Refuse a pickle held in memory (a zip's data.pkl, DCP ``.metadata``) beyond the bounds.

    `size` is the size of the file it came from (default: the pickle's own length).
    """
    try:
        scan_pickle(io.BytesIO(data), end=len(data),
                    budget=alloc_budget(len(data) if size is None else size))
    except PickleLimit as e:
        raise _refusal(path, e) from None
    except (IndexError, struct.error, UnicodeDecodeError):
        return  # damaged: torch's unpickler refuses it with its own reason


def _refusal(path: str, e: PickleLimit) -> CheckpointError:
    return CheckpointError(f"{path}: refused: {e}", path=path, hint=raise_hint(e.limit))


def check_pickle_file(path: str, *, fmt: str, size: int) -> None:
    """Refuse a torch.save file (`fmt` 'zip' or 'pickle') whose pickle is beyond the bounds."""
    if fmt == "zip":
        check_pickle_bytes(_data_pkl(path, size), path=path, size=size)
    elif fmt == "pickle":
        # A legacy file: magic number, protocol, sys info, the object, the storage keys.
        with open(path, "rb") as f:
            try:
                scan_pickle(f, end=size, budget=alloc_budget(size), pickles=5)
            except PickleLimit as e:
                raise _refusal(path, e) from None
            except (IndexError, struct.error, UnicodeDecodeError):
                return


def _data_pkl(path: str, size: int) -> bytes:
    """A zip checkpoint's data.pkl, after its central directory passed the bounds."""
    ratio, most = limit("ZIP_RATIO"), limit("PICKLE_BYTES")
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            for info in infos:
                if info.header_offset + info.compress_size > size:
                    raise CheckpointError(
                        f"{path}: not a readable PyTorch checkpoint (zip entry "
                        f"{info.filename[:80]!r} runs past the end of the file)", path=path,
                        hint="the file is truncated or corrupt; save or copy it again")
                if info.file_size > ratio * max(info.compress_size, 1) + _SLACK:
                    raise CheckpointError(
                        f"{path}: refused: zip entry {info.filename[:80]!r} inflates "
                        f"{info.compress_size} bytes to {info.file_size}: "
                        + over("ZIP_RATIO", "its ratio",
                               info.file_size // max(info.compress_size, 1)),
                        path=path, hint=raise_hint("ZIP_RATIO"))
            pkl = next((i for i in infos if i.filename.endswith("data.pkl")), None)
            if pkl is None:
                return b""
            if pkl.file_size > most:
                raise CheckpointError(f"{path}: refused: "
                                      + over("PICKLE_BYTES", "its data.pkl", pkl.file_size),
                                      path=path, hint=raise_hint("PICKLE_BYTES"))
            with z.open(pkl) as f:
                return f.read(most + 1)[:most]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return b""  # torch reports a damaged archive in its own words


def check_loaded_tensors(sd: Mapping[Any, Any], *, path: str) -> None:
    """Refuse tensors that have no bytes to export, or far more logical bytes than stored."""
    ratio = limit("EXPAND_RATIO")
    for key, t in sd.items():
        name = printable(repr(str(key)), max_chars=80)
        if type(key) is not str:
            # str() would make 1 and "1" one tensor without a word.
            raise CheckpointError(f"{path}: key {name} is a {type(key).__name__}, not a string",
                                  path=path, hint="a state dict's keys are module paths (str); "
                                  "re-save it with string keys")
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise CheckpointError(f"{path}: key {name} is not valid Unicode (a lone "
                                      "surrogate)", path=path,
                                      hint="re-save it with valid key names") from None
        if getattr(t, "is_nested", False) or str(getattr(t, "layout", "")) != "torch.strided":
            what = "nested" if getattr(t, "is_nested", False) else f"{t.layout}"
            raise CheckpointError(f"{path}: tensor {name} is a {what} tensor, which a "
                                  "checkpoint of dense weights does not hold", path=path,
                                  hint="save it as dense tensors (t.to_dense()) and try again")
        if t.device.type == "meta":
            raise CheckpointError(f"{path}: tensor {name} is on the meta device: it has no "
                                  "data", path=path,
                                  hint="save the state dict of a model with real weights")
        stored = t.untyped_storage().nbytes()
        logical = t.numel() * t.element_size()
        if logical > ratio * stored + _SLACK:
            raise CheckpointError(
                f"{path}: refused: tensor {name} is {logical} bytes but its storage holds "
                f"{stored} (an expanded, stride-0 tensor): "
                + over("EXPAND_RATIO", "its ratio", logical // max(stored, 1)),
                path=path, hint=raise_hint("EXPAND_RATIO", needed=logical // max(stored, 1) + 1)
                + "; a raised limit materialises it")
