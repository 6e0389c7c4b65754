"""A safetensors file's header, read as untrusted input: the tensor table, the data offsets, the
metadata, and the aliases an export records for tied tensors. Never reads tensor data and never
imports torch (the header rules themselves are surgery.formats.st_header's).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from surgery.errors import CheckpointError
from surgery.formats.safejson import UntrustedJSONError, load_untrusted_json
from surgery.formats.st_header import (
    MAX_HEADER_BYTES,
    HeaderProblem,
    Truncated,
    parse_header,
)
from surgery.formats.tensors import META_ALIASES, TensorInfo, _require_file

# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER = MAX_HEADER_BYTES


@dataclass(frozen=True)
class SafetensorsLayout:
    """Where each tensor's bytes lie in a safetensors file (offsets are absolute)."""

    tensors: dict[str, TensorInfo]
    offsets: dict[str, tuple[int, int]]  # name -> (start, end), absolute file offsets
    metadata: dict[str, str]
    data_start: int


def read_safetensors_layout(path: str) -> SafetensorsLayout:
    """Parse a safetensors header into shapes, dtypes and absolute byte ranges. No torch import.

    The header is held to the rules safetensors itself enforces (surgery.formats.st_header): a
    header it would refuse is refused here too, as one CheckpointError, so nothing is planned,
    verified or exported from a file that cannot be loaded. A garbage file reads as an absurd header
    length; a truncated file can keep an intact header, so the tensors' end is compared with
    the file size.
    """
    size = _require_file(path)
    bad = f"{path}: not a valid safetensors file"
    if size < 8:
        raise CheckpointError(f"{bad} ({'empty' if size == 0 else f'only {size} bytes'})",
                              path=path, hint="the file is empty or truncated; re-export it")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > _MAX_HEADER or n > size - 8:
            raise CheckpointError(f"{bad} (header length {n} does not fit a {size}-byte file)",
                                  path=path, hint="the file is corrupt, truncated or not "
                                  "safetensors; re-export it")
        raw = f.read(n)
    try:
        parsed = parse_header(raw, data_size=size - 8 - n)
    except Truncated as e:
        raise CheckpointError(
            f"{path}: truncated: the header promises {8 + n + e.end} bytes, the file has {size}",
            path=path, hint="the copy was cut short; copy or export it again") from None
    except HeaderProblem as e:
        raise CheckpointError(f"{bad} ({e})", path=path,
                              hint="safetensors would refuse it too; re-export it from its "
                              "source") from None
    base = 8 + n
    tensors = {name: TensorInfo(shape, dtype) for _, _, name, shape, dtype in parsed.entries}
    offsets = {name: (base + lo, base + hi) for lo, hi, name, _, _ in parsed.entries}
    metadata = dict(parsed.metadata)
    _expand_aliases(path, tensors, offsets, metadata)
    return SafetensorsLayout(tensors, offsets, metadata, 8 + n)


def read_aliases(path: str, metadata: Mapping[str, str]) -> dict[str, str]:
    """The ``surgery.aliases`` metadata of an export: {alias: stored key}, checked as data.

    The text comes from the file, so it is parsed as untrusted JSON (bounded, no duplicates)
    and must be an object of string -> string.
    """
    raw = metadata.get(META_ALIASES)
    if not raw:
        return {}
    try:
        aliases = load_untrusted_json(raw, max_bytes=_MAX_HEADER, max_depth=2)
    except UntrustedJSONError as e:
        raise CheckpointError(f"{path}: metadata {META_ALIASES!r} is not valid: {e}", path=path,
                              hint="the file is corrupt; re-export it") from None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"{path}: metadata {META_ALIASES!r} is not a JSON object of "
                              "names", path=path, hint="the file is corrupt; re-export it")
    return aliases


def _expand_aliases(path: str, tensors: dict[str, TensorInfo],
                    offsets: dict[str, tuple[int, int]], metadata: dict[str, str]) -> None:
    """Add the tied keys that `surgery export` stored once back under their own names.

    Without this, a file exported from a model with tied weights would show fewer keys than the
    model's state dict, and its fingerprint would not match the manifest planned for it.
    """
    for alias, target in read_aliases(path, metadata).items():
        if target not in tensors:
            raise CheckpointError(f"{path}: alias {alias!r} points at {target!r}, which the file "
                                  "does not hold", path=path, hint="re-export the checkpoint")
        if alias not in tensors:
            tensors[alias] = tensors[target]
            offsets[alias] = offsets[target]


def read_safetensors_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse a safetensors header: (tensors, metadata, data start offset). No torch import.

    Tied keys that `surgery export` stored once (metadata ``surgery.aliases``) are listed under
    their own names too, as the model's state dict lists them.
    """
    layout = read_safetensors_layout(path)
    return layout.tensors, layout.metadata, layout.data_start
