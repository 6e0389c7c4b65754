"""Helpers shared by tests: build files without building models."""

from __future__ import annotations

import json
import os
import struct

_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "U8": 1}


def write_header_only_safetensors(path: str | os.PathLike[str],
                                  tensors: dict[str, tuple[tuple[int, ...], str]],
                                  *, sparse: bool = True) -> int:
    """A valid safetensors file of zeros; returns its size.

    With `sparse` the data region is a hole (no real I/O), which plans and verifies multi-GB
    checkpoints in milliseconds; without it every byte is written, for benchmarks that must
    not depend on the file system's holes. Shared by the tests and the benchmarks.
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
        if sparse:
            f.truncate(8 + len(raw) + offset)
        else:
            chunk = b"\0" * (64 << 20)
            left = offset
            while left:
                f.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
    return 8 + len(raw) + offset
