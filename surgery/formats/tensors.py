"""What a checkpoint holds, without its data: tensor shapes and dtypes, the file kinds, and the
metadata keys an export writes. Pure: no I/O beyond a stat, no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

from surgery.errors import CheckpointError
from surgery.formats.st_header import (
    DTYPE_BITS,
)

SAFETENSORS_SUFFIXES = (".safetensors",)


# `.pth.tar` (and `.tar`) is what timm's train.py names its checkpoints: a torch.save zip file.
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")


# The kinds a file can be read as; `kind=` (the CLI's --format) names one when the suffix cannot.
KINDS: tuple[str, ...] = ("safetensors", "pickle", "sharded", "dcp")


# A folder holding this file is a torch.distributed.checkpoint (DCP) save (surgery.formats.dcp).
DCP_METADATA = ".metadata"


INDEX_SUFFIX = ".index.json"


# torch dtype names -> safetensors header names, so fingerprints agree whichever side read them.
_TORCH_TO_ST: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
    "complex128": "C128",
}


_ST_DTYPES = frozenset(_TORCH_TO_ST.values()) | frozenset(DTYPE_BITS)


# Bytes per element of each safetensors dtype (to check data_offsets against shapes).
_ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "C64": 8, "C128": 16,
}


# Metadata keys that `surgery export` writes into every safetensors file (and the index of a
# sharded export). They are a file format: spelled out here and in the README, never derived
# from a module path, and never renamed. `format=pt` is what safetensors' own torch loader expects.
META_FORMAT = "format"
META_FINGERPRINT = "surgery.fingerprint"
META_MANIFEST = "surgery.manifest"  # the manifest's TOML text, exactly as its file holds it
META_MANIFEST_SHA256 = "surgery.manifest_sha256"  # sha256 of that text (UTF-8), hex
META_ALIASES = "surgery.aliases"  # JSON {alias: stored key}: tied tensors stored once
META_SOURCE = "surgery.source"  # the file it was exported from (base name)
META_DROPPED = "surgery.dropped"  # JSON list of keys left out (e.g. EMA `n_averaged`)
META_VERSION = "surgery.version"

# The one other layout ever written: for a day (2026-12-01, the restructure into layers until
# issue 21) a search-and-replace of module paths renamed these two keys. Exports of that day
# carry them, so readers look for each key set, the current one first.
META_MANIFEST_RESTRUCTURE = "surgery.formats.manifest"
META_SOURCE_RESTRUCTURE = "surgery.formats.source"
META_MANIFEST_KEYS: tuple[str, ...] = (META_MANIFEST, META_MANIFEST_RESTRUCTURE)
META_SOURCE_KEYS: tuple[str, ...] = (META_SOURCE, META_SOURCE_RESTRUCTURE)


def embedded_entry(metadata: dict[str, str], keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(key, value) of the first of `keys` that `metadata` holds: a reader for every layout."""
    for key in keys:
        if key in metadata:
            return key, metadata[key]
    return None


def normalize_dtype(dtype: object) -> str:
    """'torch.float32', torch.float32 or 'F32' -> 'F32' (the safetensors spelling)."""
    s = str(dtype)
    if s in _ST_DTYPES:
        return s
    s = s.removeprefix("torch.")
    return _TORCH_TO_ST.get(s, s.upper())


class TensorInfo(NamedTuple):
    """Shape and dtype of one tensor, without its data.

    A named tuple rather than a frozen dataclass: a header of a million tensors makes a million
    of them, and a tuple is built at C speed (a frozen dataclass's __init__ cost 0.4 s more per
    million on the 2-core CI machine).
    """

    shape: tuple[int, ...]
    dtype: str  # safetensors spelling, e.g. "F32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class CheckpointInfo:
    """What reading a checkpoint found: its tensors and how they were found."""

    path: str
    format: str  # "safetensors" | "pickle" | "sharded"
    tensors: dict[str, TensorInfo]
    entry: str | None = None  # the container entry the state dict came from, if any
    candidates: list[str] = field(default_factory=list)  # every entry that held a state dict
    ignored: list[str] = field(default_factory=list)  # non-tensor entries beside it
    optimizer: dict[str, int] = field(default_factory=dict)  # entry -> optimizer param states
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    files: list[str] = field(default_factory=list)
    # The keys of the container's other state dicts (e.g. an `ema` entry beside `model`), which
    # verify does not check but names when their keys carry wrapper segments.
    others: dict[str, list[str]] = field(default_factory=dict)


def checkpoint_kind(path: str, *, kind: str | None = None) -> str:
    """'safetensors', 'pickle', 'sharded' from the file name, 'dcp' for a folder holding a DCP
    ``.metadata`` (or `kind`, when given).

    Raises on a suffix it does not know: a file is read only as the kind it is named or said to
    be, never guessed from its bytes.
    """
    if kind is not None:
        if kind not in KINDS:
            raise CheckpointError(f"{path}: unknown checkpoint kind {kind!r}", path=path,
                                  hint=f"one of {', '.join(KINDS)}")
        return kind
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA)):
        return "dcp"
    name = os.path.basename(path)
    if name.endswith(INDEX_SUFFIX):
        return "sharded"
    if name.endswith(SAFETENSORS_SUFFIXES):
        return "safetensors"
    if name.endswith(PICKLE_SUFFIXES):
        return "pickle"
    raise CheckpointError(
        f"{path}: unknown checkpoint type {os.path.splitext(name)[1] or '(no suffix)'!r}",
        path=path,
        hint="give a .safetensors, .pt/.pth/.pth.tar/.ckpt/.bin file or a sharded *.index.json, "
        "a DCP checkpoint folder (holding .metadata), "
        "name the format with --format safetensors|torch|index, "
        "or plan a live model with --model package.module:factory",
    )


def _require_file(path: str) -> int:
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file", path=path, hint="check the path")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not a regular file", path=path,
                              hint="give the checkpoint file, or its *.index.json if sharded")
    return os.path.getsize(path)
