"""The streaming safetensors writer: plan the shards, write the header, copy each tensor's bytes
from its source in chunks, and publish every file (shards, then the index) through
surgery.formats.atomic, so a failure or a kill leaves nothing half-written at the destination.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from surgery.errors import CheckpointError, OutputExistsError, SurgeryError
from surgery.formats.atomic import AtomicGroup
from surgery.formats.limits import printable
from surgery.formats.safe_write import recover, refuse_inputs, write_all
from surgery.formats.st_header import DTYPE_BITS, MAX_HEADER_BYTES
from surgery.formats.stream import ProgressFn, TensorSource, itemsize, nbytes
from surgery.formats.tensors import META_ALIASES, TensorInfo


@dataclass
class Planned:
    """One tensor to write: its output name, shape/dtype, and where its bytes come from."""

    name: str
    info: TensorInfo
    source: TensorSource
    source_name: str


@dataclass
class WriteResult:
    files: list[str]
    index: str | None
    bytes_written: int
    shards: dict[str, list[str]] = field(default_factory=dict)  # file -> names stored in it
    recovered: list[str] = field(default_factory=list)  # cleanup after a killed run, one a line


def parse_size(text: str) -> int:
    """'500MB', '2GB', '1.5GiB', '4096' -> bytes (GB = 10**9, GiB = 2**30, as HF counts)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r} is not a size; use e.g. 500MB, 2GB or 1.5GiB") from None
    if unit not in units or value <= 0:
        raise ValueError(f"{text!r} is not a size; use e.g. 500MB, 2GB or 1.5GiB")
    return int(value * units[unit])


def shard_paths(out: str, count: int) -> tuple[list[str], str | None]:
    """HF naming: ``dir/model.safetensors`` -> ``model-00001-of-00002.safetensors`` + index."""
    if count == 1:
        return [out], None
    folder, base = os.path.split(out)
    stem = base.removesuffix(".safetensors")
    files = [os.path.join(folder, f"{stem}-{i:05d}-of-{count:05d}.safetensors")
             for i in range(1, count + 1)]
    return files, os.path.join(folder, f"{base}.index.json")


def plan_shards(tensors: list[Planned], max_shard_size: int | None) -> list[list[Planned]]:
    """Split in key order (a block's tensors stay together); a tensor larger than the limit
    gets a shard of its own, as HF does."""
    if not max_shard_size:
        return [tensors]
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in sorted(tensors, key=lambda p: p.name):
        n = nbytes(t.info)
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def safetensors_header(tensors: list[Planned], metadata: Mapping[str, str]
                       ) -> tuple[bytes, list[Planned]]:
    """The header bytes (length prefix included) and the order the data must follow.

    Larger dtypes first, then by name, so every tensor starts at a multiple of its item size
    (the header is padded to 8 bytes), which zero-copy loaders rely on.
    """
    order = sorted(tensors, key=lambda p: (-itemsize(p.info.dtype), p.name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for p in order:
        if p.info.dtype not in DTYPE_BITS:  # safetensors (and surgery's reader) would refuse
            raise SurgeryError(f"tensor {printable(p.name, max_chars=80)} has dtype "
                               f"{p.info.dtype}, which safetensors cannot store",
                               hint=f"convert it first (safetensors stores "
                               f"{', '.join(sorted(DTYPE_BITS))})")
        n = nbytes(p.info)
        header[p.name] = {"dtype": p.info.dtype, "shape": list(p.info.shape),
                          "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:  # safetensors (and surgery's own reader) would refuse it
        raise SurgeryError(f"the safetensors header would be {len(raw)} bytes, more than the "
                           f"{MAX_HEADER_BYTES} the format allows (the embedded manifest and "
                           "metadata are part of it)",
                           hint="export without --manifest, or with a smaller manifest")
    return len(raw).to_bytes(8, "little") + raw, order


def write_safetensors(out: str, tensors: list[Planned], *, metadata: Mapping[str, str],
                      aliases: Mapping[str, str] | None = None,
                      max_shard_size: int | None = None, force: bool = False,
                      progress: ProgressFn | None = None,
                      inputs: Sequence[str] = ()) -> WriteResult:
    """Write `tensors` to `out` (or to shards plus an HF-style index), all or nothing.

    Every file is written to a fresh temp file in the output folder (surgery.formats.atomic); only
    when all are complete are they published, shards first and the index last. If any step
    fails (a full disk, a signal, a file that appeared meanwhile without `force`), the files
    published so far are taken back and the temps removed, so the destination is left as it
    was and a rerun works. What a killed earlier run left for these names is cleaned up first
    (`surgery.formats.safe_write.recover`, reported in `WriteResult.recovered`).
    """
    aliases = dict(aliases or {})
    shards = plan_shards(tensors, max_shard_size)
    files, index = shard_paths(out, len(shards))
    refuse_inputs([*files, *([index] if index else [])], inputs)  # even with force
    recovered = recover([*files, *([index] if index else [])])
    if not force:
        for p in [*files, *([index] if index else [])]:
            if os.path.lexists(p):
                err = OutputExistsError(p)
                left = [n for n in recovered if "left alone" in n]
                if left:  # why it is still there: the note recover made for it
                    more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
                    err.hint = f"{printable(left[0])}{more}"
                raise err
    total = sum(nbytes(t.info) for t in tensors)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    result = WriteResult(files, index, 0, recovered=recovered)
    try:
        with AtomicGroup(force=force) as group:
            for path, shard in zip(files, shards, strict=True):
                names = {t.name for t in shard}
                meta = dict(metadata)
                local = {a: t for a, t in aliases.items() if t in names}
                if local:
                    meta[META_ALIASES] = json.dumps(local, sort_keys=True)
                head, order = safetensors_header(shard, meta)
                fd = group.create(path)
                write_all(fd, head)
                for t in order:
                    t.source.write_to(t.source_name, fd, advance=advance)
                written = os.lseek(fd, 0, os.SEEK_CUR)
                expected = len(head) + sum(nbytes(t.info) for t in order)
                if written != expected:
                    raise CheckpointError(f"{path}: wrote {written} bytes, expected {expected}",
                                          path=path, hint="the source changed during export")
                result.shards[path] = [t.name for t in order]
                result.bytes_written += expected
            if index is not None:
                weight_map = {name: os.path.basename(f) for f, names in result.shards.items()
                              for name in names}
                body = {"metadata": {"total_size": total, **metadata},
                        "weight_map": dict(sorted(weight_map.items()))}
                # Created last, so published last: a loader that finds the index finds its
                # shards.
                write_all(group.create(index), (json.dumps(body, indent=2) + "\n").encode())
            group.commit()
    except OSError as e:
        raise SurgeryError(f"{out}: cannot write the export: {e.strerror or e}",
                           hint="check the folder exists, is writable and has room") from None
    # A dead run's temp that was a second link of a file this run just replaced is now
    # linked once, and goes too.
    result.recovered += [n for n in recover([*files, *([index] if index else [])])
                         if n not in result.recovered]
    return result
