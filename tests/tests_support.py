"""Helpers shared by tests: build files without building models."""

from __future__ import annotations

import json
import os
import struct

_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "U8": 1}


def write_header_only_safetensors(path: str | os.PathLike[str],
                                  tensors: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """A valid safetensors file whose data region is sparse (zeros, no real I/O).

    Returns the file size. Used to plan and verify multi-GB checkpoints in milliseconds.
    """
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, dtype) in sorted(tensors.items()):
        n = _ITEMSIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset
