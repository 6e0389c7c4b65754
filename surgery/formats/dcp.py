"""DCP folders (torch.distributed.checkpoint): the key list from ``.metadata``, read as data.

A DCP folder holds ``.metadata`` and one ``__R_I.distcp`` file per writing rank. ``.metadata``
is a pickle of DCP's ``Metadata`` dataclass: per key, its global shape, dtype and the chunks
each rank wrote, plus where each chunk's bytes lie (file, offset, length). DCP's own
``FileSystemReader.read_metadata`` reads it with a plain ``pickle.load``, which runs whatever
the file names. So DCP's reader never sees this file here:

- **What is executed.** Nothing from the file. The pickle is read by the restricted unpickler
  of surgery.formats.dcp_pickle, whose ``find_class`` answers only from a fixed table of the
  names DCP writes, each with a stand-in that stores what it is given. torch is not imported
  and no DCP class is constructed from the file; any other global is refused before anything
  is imported (`UnsafeCheckpointError`, exit 3).
- **What is checked** after unpickling, since the stand-ins accept anything: every field's type;
  shapes of non-negative integers; chunks inside their tensor, not overlapping, and covering it
  exactly; each chunk's file a plain name inside the folder, and its byte range inside that file
  and large enough for the chunk's elements; no storage transform (compression extensions).
- **Bounds.** Those of every pickle here (surgery.formats.pickle_bounds). Unpickling is linear
  in the file's size (pickle has no repeat opcode): a 100 KB file builds ~100 K small objects.

`read_dcp` returns the tensors (no tensor data is read) as a `CheckpointInfo`; non-tensor entries
(DCP's "bytes" items, e.g. a ``step`` counter) are listed as ignored, never loaded (DCP loads
them with ``torch.load(weights_only=False)``). `surgery.formats.dcp_source` streams the tensor
bytes with DCP's own reader, handed metadata rebuilt from what was checked here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from surgery.errors import CheckpointError
from surgery.formats.dcp_pickle import (
    BytesMeta,
    Chunk,
    Index,
    Metadata,
    Properties,
    Record,
    StorageInfo,
    TensorMeta,
    TorchName,
    load_metadata,
    not_dcp,
)
from surgery.formats.pickled import CONTAINER_ENTRIES
from surgery.formats.tensors import (
    _ST_ITEMSIZE,
    _TORCH_TO_ST,
    DCP_METADATA,
    CheckpointInfo,
    TensorInfo,
)

# The file DCP's FileSystemWriter writes beside the .distcp files (a folder holding it is a DCP
# checkpoint) and the suffix of its data files.
METADATA_NAME = DCP_METADATA
DISTCP_SUFFIX = ".distcp"
# Top-level entries holding optimizer state in what trainers save ({"model": ..., "optim": ...}).
OPTIMIZER_ENTRIES: tuple[str, ...] = ("optim", "optimizer", "optimizer_state_dict", "optimizers")
_MAX_DIM = 2**62


# --- what was read --------------------------------------------------------------------------

@dataclass(frozen=True)
class DcpChunk:
    """One rank's piece of a tensor, and where its ``torch.save`` bytes lie."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # base name inside the folder
    offset: int
    length: int


@dataclass
class DcpCheckpoint:
    """A DCP folder's ``.metadata``, checked: tensors by DCP key, their chunks, other entries."""

    folder: str
    tensors: dict[str, TensorInfo]
    chunks: dict[str, list[DcpChunk]]
    paths: dict[str, tuple[str, ...]]  # DCP key -> its path in the saved (nested) dict
    other: list[str] = field(default_factory=list)  # bytes entries: never loaded
    version: str | None = None


def is_dcp_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_NAME))


def _shape(value: Any, folder: str, key: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(
            type(d) is int and 0 <= d < _MAX_DIM for d in value):
        raise not_dcp(folder, f"{what} of {key[:80]!r} is not a shape of non-negative integers")
    return value


def _dtype(props: Any, folder: str, key: str) -> str:
    state = props.state if isinstance(props, Properties) else None
    dtype = state[0] if isinstance(state, tuple) and state else \
        props.get("dtype") if isinstance(props, Properties) else None
    layout = state[1] if isinstance(state, tuple) and len(state) > 1 else TorchName("torch.strided")
    if not isinstance(dtype, TorchName) or dtype.removeprefix("torch.") not in _TORCH_TO_ST:
        raise not_dcp(folder, f"{key[:80]!r} has no dtype safetensors can hold")
    if layout != "torch.strided":
        raise not_dcp(folder, f"{key[:80]!r} has layout {str(layout)[:40]}, not a dense tensor")
    return _TORCH_TO_ST[dtype.removeprefix("torch.")]


def _storage_map(meta: Metadata, folder: str) -> dict[tuple[str, tuple[int, ...]], Record]:
    storage = meta.get("storage_data")
    if not isinstance(storage, dict):
        raise not_dcp(folder, "no storage_data")
    out: dict[tuple[str, tuple[int, ...]], Record] = {}
    for index, info in storage.items():
        if not isinstance(index, Index) or not isinstance(info, StorageInfo) or \
                not isinstance(index.get("fqn"), str):
            raise not_dcp(folder, "a storage_data entry is not MetadataIndex -> StorageInfo")
        offset = index.get("offset")
        out[(index.get("fqn"), offset if isinstance(offset, tuple) else ())] = info
    return out


def _chunk_file(info: Record, folder: str, key: str, sizes: dict[str, int]
                ) -> tuple[str, int, int]:
    name, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name \
            or "\\" in name or "\0" in name:
        raise not_dcp(folder, f"a chunk of {key[:80]!r} names file {str(name)[:80]!r}, which is "
                           "not a plain file name inside the folder")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise not_dcp(folder, f"a chunk of {key[:80]!r} has no valid byte range")
    if info.get("transform_descriptors"):
        raise not_dcp(folder, f"{key[:80]!r} is stored through a transform "
                           f"({str(info.get('transform_descriptors'))[:60]}), which is not read")
    if name not in sizes:
        full = os.path.join(folder, name)
        sizes[name] = os.path.getsize(full) if os.path.isfile(full) else -1
    if sizes[name] < 0:
        raise not_dcp(folder, f"{name!r}, holding {key[:80]!r}, is missing")
    if offset + length > sizes[name]:
        raise not_dcp(folder, f"{key[:80]!r} lies past the end of {name!r} (truncated copy?)")
    return name, offset, length


def _check_tiling(folder: str, key: str, shape: tuple[int, ...], chunks: list[DcpChunk]) -> None:
    """Chunks inside the tensor, pairwise disjoint, and covering it (their sizes sum to it)."""
    total = 0
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                o + s > d for o, s, d in zip(c.offsets, c.sizes, shape, strict=True)):
            raise not_dcp(folder, f"a chunk of {key[:80]!r} lies outside its shape {list(shape)}")
        total += _numel(c.sizes)
    if total != _numel(shape):
        raise not_dcp(folder, f"the chunks of {key[:80]!r} do not cover it exactly")
    if not shape:
        return
    ordered = sorted((c for c in chunks if _numel(c.sizes)), key=lambda c: c.offsets[0])
    for i, a in enumerate(ordered):  # sweep along dim 0: compare only chunks that meet there
        for b in ordered[i + 1:]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(bo < ao + asz and ao < bo + bsz for ao, asz, bo, bsz in
                   zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                raise not_dcp(folder, f"two chunks of {key[:80]!r} overlap")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_dcp_metadata(folder: str) -> DcpCheckpoint:
    """Read and check a DCP folder's ``.metadata``: no tensor data is read, torch not imported."""
    meta = load_metadata(os.path.join(folder, METADATA_NAME), folder=folder)
    if not isinstance(meta, Metadata) or not isinstance(meta.get("state_dict_metadata"), dict):
        raise not_dcp(folder, f"{METADATA_NAME} does not hold DCP Metadata")
    storage = _storage_map(meta, folder)
    planner = meta.get("planner_data")
    planner = planner if isinstance(planner, dict) else {}
    sizes: dict[str, int] = {}
    out = DcpCheckpoint(folder, {}, {}, {}, version=meta.get("version")
                        if isinstance(meta.get("version"), str) else None)
    for key, item in meta.get("state_dict_metadata").items():
        if not isinstance(key, str):
            raise not_dcp(folder, "a key is not a string")
        path = planner.get(key)
        out.paths[key] = tuple(str(p) for p in path) if isinstance(path, (tuple, list)) and \
            path and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path) \
            else (key,)
        if isinstance(item, BytesMeta):
            out.other.append(key)
            continue
        if not isinstance(item, TensorMeta):
            raise not_dcp(folder, f"entry {key[:80]!r} is neither a tensor nor bytes")
        shape = _shape(item.get("size"), folder, key, "the size")
        dtype = _dtype(item.get("properties"), folder, key)
        chunks: list[DcpChunk] = []
        listed = item.get("chunks")
        if not isinstance(listed, list):
            raise not_dcp(folder, f"{key[:80]!r} lists no chunks")
        for c in listed:
            if not isinstance(c, Chunk):
                raise not_dcp(folder, f"a chunk of {key[:80]!r} is not ChunkStorageMetadata")
            offsets = _shape(c.get("offsets"), folder, key, "a chunk's offsets")
            csizes = _shape(c.get("sizes"), folder, key, "a chunk's sizes")
            info = storage.get((key, offsets))
            if info is None:
                raise not_dcp(folder, f"a chunk of {key[:80]!r} has no storage entry")
            name, off, length = _chunk_file(info, folder, key, sizes)
            if _numel(csizes) * _ST_ITEMSIZE[dtype] > length:
                raise not_dcp(folder, f"a chunk of {key[:80]!r} claims more elements than its "
                                   f"{length} stored bytes hold")
            chunks.append(DcpChunk(offsets, csizes, name, off, length))
        _check_tiling(folder, key, shape, chunks)
        out.tensors[key] = TensorInfo(shape, dtype)
        out.chunks[key] = chunks
    return out


# --- choosing the model's entry -------------------------------------------------------------

@dataclass
class DcpSelection:
    """The tensors of one entry of what was saved: the name to use -> the DCP key."""

    names: dict[str, str]
    entry: str | None
    candidates: list[str]
    optimizer: dict[str, int]
    ignored: list[str]


def select_dcp_entry(ck: DcpCheckpoint, *, key: str | None = None) -> DcpSelection:
    """The model's tensors in a DCP save, like `select_state_dict` for a torch.save file.

    ``dcp.save({"model": sd, "optim": osd})`` keys its tensors ``model.…``/``optim.…`` and keeps
    each key's path in the saved dict (planner_data). `key` (``--key``) names a top-level entry
    (``a/b`` for a nested one); without it, a well-known model entry (``model``, ``state_dict``,
    ...) is chosen when the save has such entries, else every tensor is used.
    """
    groups: dict[str, list[str]] = {}
    for k in ck.tensors:
        if len(ck.paths[k]) > 1:
            groups.setdefault(ck.paths[k][0], []).append(k)
    optimizer = {g: len(ks) for g, ks in groups.items() if g in OPTIMIZER_ENTRIES}
    if key is not None:
        prefix = tuple(key.split("/"))
        names = {".".join(ck.paths[k][len(prefix):]): k for k in ck.tensors
                 if ck.paths[k][:len(prefix)] == prefix and len(ck.paths[k]) > len(prefix)}
        if not names:
            raise CheckpointError(f"{ck.folder}: no entry {key!r} in the DCP checkpoint",
                                  path=ck.folder,
                                  hint=f"entries here: {', '.join(sorted(groups)) or '(none)'}")
        return DcpSelection(names, key, [key], optimizer, sorted(ck.other))
    chosen = next((g for g in CONTAINER_ENTRIES if g in groups), None)
    if chosen is None:
        return DcpSelection({k: k for k in ck.tensors}, None, [], {}, sorted(ck.other))
    names = {".".join(ck.paths[k][1:]): k for k in groups[chosen]}
    ignored = sorted({*ck.other, *(g for g in groups if g != chosen and g not in optimizer),
                      *(ck.paths[k][0] for k in ck.tensors if len(ck.paths[k]) == 1)})
    return DcpSelection(names, chosen, sorted(g for g in groups if g not in optimizer),
                        optimizer, ignored)


def read_dcp(folder: str, *, key: str | None = None) -> CheckpointInfo:
    """A DCP folder's tensors (of the model entry, see `select_dcp_entry`) from .metadata alone."""
    ck = read_dcp_metadata(folder)
    sel = select_dcp_entry(ck, key=key)
    files = sorted({c.file for cs in ck.chunks.values() for c in cs})
    return CheckpointInfo(folder, "dcp", {n: ck.tensors[k] for n, k in sel.names.items()},
                          entry=sel.entry, candidates=sel.candidates, ignored=sel.ignored,
                          optimizer=sel.optimizer,
                          files=[os.path.join(folder, METADATA_NAME),
                                 *(os.path.join(folder, f) for f in files)])
