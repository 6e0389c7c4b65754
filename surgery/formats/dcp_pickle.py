"""The restricted unpickler of DCP's ``.metadata``: every global it may name answers a stand-in.

DCP pickles its ``Metadata`` dataclass tree; ``FileSystemReader.read_metadata`` unpickles it with
``pickle.load``, which would import and call whatever an attacker's file names. Here
``find_class`` answers only from `GLOBALS`, the fixed table of the names DCP writes (torch 2.0 to
2.14), and every answer is defined in this module: `Record` subclasses that store their
arguments and BUILD state and do nothing else, a tuple for ``torch.Size``, a `TorchName` marker
for a dtype or layout. torch is never imported and no DCP class is constructed from the file.
Any other global (``os.system``, ``builtins.eval``, an unknown DCP class) raises
`UnsafeCheckpointError` before anything is imported; EXT opcodes look up copyreg's registry, which
holds nothing in this process, and persistent ids are refused by the unpickler itself.

The stand-ins accept anything, so whatever reads them (surgery.formats.dcp) checks every field.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from surgery.errors import CheckpointError, UnsafeCheckpointError
from surgery.formats.limits import limit, over, raise_hint, read_regular
from surgery.formats.pickle_bounds import check_pickle_bytes
from surgery.formats.tensors import _TORCH_TO_ST

HINT_REWRITE = ("save it again with torch.distributed.checkpoint.save from the trainer; a "
                ".metadata is written by DCP, never by hand")


class Record:
    """A DCP dataclass read as data: NEWOBJ/REDUCE arguments and BUILD state, stored only."""

    args: tuple[Any, ...]
    state: Any  # what BUILD handed over: a dict of fields, or TensorProperties' 5-tuple

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        obj = object.__new__(cls)
        obj.__dict__["args"] = args
        obj.__dict__["state"] = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def get(self, name: str) -> Any:
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict state, slot state)
        return state.get(name) if isinstance(state, dict) else None


class Metadata(Record):
    pass


class TensorMeta(Record):
    pass


class BytesMeta(Record):
    pass


class Properties(Record):
    pass


class Chunk(Record):
    pass


class Index(Record):
    pass


class StorageMeta(Record):
    pass


class StorageInfo(Record):
    pass


class TorchName(str):
    """A dtype or layout the pickle named (``torch.float32``), as its name; never imported."""


def _size(*args: Any) -> tuple[Any, ...]:
    """``torch.Size(seq)`` as a tuple; its items are checked where a shape is used."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else ()


def _layout(name: Any) -> TorchName:
    return TorchName(name if isinstance(name, str) else "?")


def _memory_format(value: Any) -> int:
    return value if isinstance(value, int) else -1


def _path(*parts: Any) -> str:
    return "/".join(p for p in parts if isinstance(p, str))


_META = "torch.distributed.checkpoint.metadata"
_OLD_META = "torch.distributed._shard.sharded_tensor.metadata"  # TensorProperties before 2.1
# (module, name) in the pickle -> what find_class returns. Nothing else is ever resolved.
GLOBALS: dict[tuple[str, str], Any] = {
    (_META, "Metadata"): Metadata,
    (_META, "TensorStorageMetadata"): TensorMeta,
    (_META, "BytesStorageMetadata"): BytesMeta,
    (_META, "TensorProperties"): Properties,
    (_OLD_META, "TensorProperties"): Properties,
    (_META, "ChunkStorageMetadata"): Chunk,
    (_META, "MetadataIndex"): Index,
    (_META, "StorageMeta"): StorageMeta,
    (_META, "_MEM_FORMAT_ENCODING"): _memory_format,
    (_OLD_META, "MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path, ("pathlib", "WindowsPath"): _path, ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): dict,
    **{("torch", name): TorchName(f"torch.{name}") for name in _TORCH_TO_ST},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = GLOBALS.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.path}: refused: loading it would run code ({module[:80]}.{name[:80]}); "
                "surgery never executes a checkpoint", path=self.path, hint=HINT_REWRITE)
        return found


def not_dcp(folder: str, what: str) -> CheckpointError:
    """The error for a folder whose .metadata is not what DCP writes."""
    return CheckpointError(f"{folder}: not a valid DCP checkpoint ({what})", path=folder,
                           hint=HINT_REWRITE)


def load_metadata(path: str, *, folder: str) -> Any:
    """The restricted unpickle of the ``.metadata`` at `path` (stand-ins only; see above).

    Bounded as every pickle here is (surgery.formats.pickle_bounds, surgery.formats.limits):
    at most ``SURGERY_MAX_PICKLE_BYTES``, a regular file, and its opcodes walked for lengths
    past its end and allocations beyond its size before the unpickler sees a byte.
    """
    name = os.path.basename(path)
    try:
        data = read_regular(path, max_bytes=limit("PICKLE_BYTES"))
    except FileNotFoundError:
        raise not_dcp(folder, f"no {name}") from None
    except OverflowError as e:
        raise CheckpointError(f"{path}: refused: " + over("PICKLE_BYTES", name, e.args[0]),
                              path=path, hint=raise_hint("PICKLE_BYTES")) from None
    except OSError as e:
        raise not_dcp(folder, f"{name} cannot be read: {e}") from None
    check_pickle_bytes(data, path=path)
    try:
        return _Unpickler(data, path).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, MemoryError, RecursionError, UnicodeDecodeError
            ) as e:
        raise not_dcp(folder, f"{name} is not a readable pickle: {type(e).__name__}") from None
