"""Stream tensor bytes out of a checkpoint and into safetensors files, one tensor at a time.

`export` must not hold the whole checkpoint in memory: a 20 GB model would need 40 GB with the
naive ``torch.load`` + ``save_file`` (the load, plus the bytes ``save_file`` builds). Here:
- a safetensors source is copied range by range with ``copy_file_range`` (no torch, no user-space
  copy at all where the kernel can do it);
- a pickle source is memory-mapped by ``torch.load(mmap=True)``; each tensor's pages are dropped
  from this process (``madvise(MADV_DONTNEED)``) once written, so resident memory stays near the
  largest tensor instead of growing to the file size;
- the writer computes the whole header from shapes and dtypes first, then appends raw bytes.
Outputs are written to fresh temporary files in the output folder and published together at the
end, or not at all (surgery.atomic).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from surgery.atomic import AtomicGroup, recover, write_all
from surgery.checkpoint import (
    _ST_ITEMSIZE,
    CheckpointError,
    CheckpointInfo,
    TensorInfo,
    checkpoint_kind,
    normalize_dtype,
    read_index,
    read_safetensors_layout,
    refuse_key_for_safetensors,
    select_state_dict,
    torch_load_safely,
)
from surgery.errors import OutputExistsError, SurgeryError

# (bytes done, bytes total): the CLI turns it into a progress bar; library code never prints.
ProgressFn = Callable[[int, int], None]

# Bytes moved per system call / per scanned slice: large enough for throughput, small next to
# any real tensor, so it does not add to peak memory.
CHUNK = 64 * 1024 * 1024


def itemsize(dtype: str) -> int:
    return _ST_ITEMSIZE.get(dtype, 1)


def nbytes(info: TensorInfo) -> int:
    return info.numel * itemsize(info.dtype)


class TensorSource:
    """Read access to the tensors of one checkpoint, by the keys the file uses."""

    info: CheckpointInfo

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return self.info.tensors

    def identity(self, name: str) -> Hashable:
        """Equal for two names that hold the very same bytes (tied weights)."""
        raise NotImplementedError

    def storage(self, name: str) -> Hashable:
        """Equal for two names whose bytes live in one storage, even if they differ (views)."""
        return self.identity(name)

    def chunks(self, name: str) -> Iterator[memoryview]:
        """The tensor's bytes, C-contiguous, in slices of at most CHUNK bytes."""
        raise NotImplementedError

    def write_to(self, name: str, fd: int, *, advance: Callable[[int], None]) -> None:
        for piece in self.chunks(name):
            write_all(fd, piece)
            advance(len(piece))

    def close(self) -> None:
        """Release what the source holds (maps, file descriptors)."""


class SafetensorsSource(TensorSource):
    """Byte ranges of a safetensors file. Never imports torch."""

    def __init__(self, path: str) -> None:
        self.layout = read_safetensors_layout(path)
        self.info = CheckpointInfo(path, "safetensors", self.layout.tensors,
                                   metadata=self.layout.metadata, files=[path])
        self.fd = os.open(path, os.O_RDONLY)

    def identity(self, name: str) -> Hashable:
        return (self.info.path, *self.layout.offsets[name])

    def chunks(self, name: str) -> Iterator[memoryview]:
        lo, hi = self.layout.offsets[name]
        while lo < hi:
            piece = os.pread(self.fd, min(CHUNK, hi - lo), lo)
            if not piece:
                raise CheckpointError(f"{self.info.path}: file shrank while reading {name!r}",
                                      path=self.info.path, hint="do not modify it during export")
            lo += len(piece)
            yield memoryview(piece)

    def write_to(self, name: str, fd: int, *, advance: Callable[[int], None]) -> None:
        lo, hi = self.layout.offsets[name]
        try:
            # In-kernel copy: the bytes never enter this process.
            while lo < hi:
                n = os.copy_file_range(self.fd, fd, min(CHUNK, hi - lo), lo)
                if n <= 0:
                    break
                lo += n
                advance(n)
        except (AttributeError, OSError):
            pass  # no copy_file_range here (other OS, other file system): copy through memory
        if lo < hi:
            os.lseek(fd, 0, os.SEEK_END)
            rest = self.layout.offsets[name][1] - lo
            for piece in _pread_range(self.fd, lo, rest, self.info.path, name):
                write_all(fd, piece)
                advance(len(piece))

    def close(self) -> None:
        os.close(self.fd)


def _pread_range(fd: int, lo: int, count: int, path: str, name: str) -> Iterator[memoryview]:
    end = lo + count
    while lo < end:
        piece = os.pread(fd, min(CHUNK, end - lo), lo)
        if not piece:
            raise CheckpointError(f"{path}: file shrank while reading {name!r}", path=path,
                                  hint="do not modify it during export")
        lo += len(piece)
        yield memoryview(piece)


class PickleSource(TensorSource):
    """Tensors of a ``torch.load(weights_only=True, mmap=True)`` state dict."""

    def __init__(self, path: str, *, key: str | None = None) -> None:
        sd, entry, cands, ignored = select_state_dict(torch_load_safely(path), path=path, key=key)
        self.tensors: dict[str, Any] = {str(k): v for k, v in sd.items()}
        for k, t in self.tensors.items():
            if str(t.layout) != "torch.strided" or t.is_quantized:
                raise CheckpointError(f"{path}: tensor {k!r} is {t.layout} / quantized, which "
                                      "safetensors cannot hold", path=path,
                                      hint="convert it to a dense tensor before exporting")
        infos = {k: TensorInfo(tuple(t.shape), normalize_dtype(t.dtype))
                 for k, t in self.tensors.items()}
        self.info = CheckpointInfo(path, "pickle", infos, entry=entry, candidates=cands,
                                   ignored=ignored, files=[path])
        self._maps = _file_mappings(path)

    def identity(self, name: str) -> Hashable:
        t = self.tensors[name]
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                tuple(t.stride()), str(t.dtype))

    def storage(self, name: str) -> Hashable:
        return self.tensors[name].untyped_storage().data_ptr()

    def chunks(self, name: str) -> Iterator[memoryview]:
        import torch

        t = self.tensors[name].detach()
        if t.numel() == 0:
            return
        flat = t.contiguous().reshape(-1)  # a copy only when the tensor is not contiguous
        data = memoryview(flat.view(torch.uint8).numpy()).cast("B")
        for lo in range(0, data.nbytes, CHUNK):
            yield data[lo:lo + CHUNK]
        del data, flat
        self._release(t)

    def _release(self, t: Any) -> None:
        """Drop the tensor's pages from this process once written (they stay in the file).

        Only pages of a read-only use of this file's own mapping are dropped: the kernel
        reads them back from the file if touched again. Memory that is not a mapping of the
        file (a legacy pickle loaded into the heap) is never touched, since dropping it would
        zero it.
        """
        storage = t.untyped_storage()
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for start, end in self._maps:
            if start <= lo and hi <= end:
                page = os.sysconf("SC_PAGE_SIZE")
                a = max(start, lo - lo % page)
                b = min(end, -(-hi // page) * page)
                _madvise_dontneed(a, b - a)
                return


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (Linux /proc/self/maps; else none)."""
    real = os.path.realpath(path)
    out: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    a, b = parts[0].split("-")
                    out.append((int(a, 16), int(b, 16)))
    except OSError:
        return []
    return out


def _madvise_dontneed(addr: int, length: int) -> None:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass  # only a memory optimisation


class ShardedSource(TensorSource):
    """A sharded checkpoint: each key is read from the shard its index names."""

    def __init__(self, path: str, *, key: str | None = None) -> None:
        weight_map = read_index(path)
        self.shards: dict[str, TensorSource] = {}
        self.where: dict[str, TensorSource] = {}
        infos: dict[str, TensorInfo] = {}
        try:
            for shard in sorted(set(weight_map.values())):
                src = open_source(shard, key=key if checkpoint_kind(shard) == "pickle" else None)
                self.shards[shard] = src
                for k, ti in src.infos.items():
                    if k in infos:
                        raise CheckpointError(f"{path}: key {k!r} appears in two shards",
                                              path=path, hint="the shards overlap; re-export")
                    infos[k] = ti
                    self.where[k] = src
        except BaseException:
            self.close()
            raise
        missing = sorted(k for k in weight_map if k not in infos)
        if missing:
            self.close()
            raise CheckpointError(
                f"{path}: {len(missing)} key(s) listed in the index are in no shard: "
                + ", ".join(repr(k) for k in missing[:5]),
                path=path, hint="a shard is missing or stale; copy all shards together")
        self.info = CheckpointInfo(path, "sharded", infos, files=sorted(self.shards))

    def identity(self, name: str) -> Hashable:
        return self.where[name].identity(name)

    def storage(self, name: str) -> Hashable:
        return self.where[name].storage(name)

    def chunks(self, name: str) -> Iterator[memoryview]:
        return self.where[name].chunks(name)

    def write_to(self, name: str, fd: int, *, advance: Callable[[int], None]) -> None:
        self.where[name].write_to(name, fd, advance=advance)

    def close(self) -> None:
        for src in self.shards.values():
            src.close()


def open_source(path: str, *, key: str | None = None, kind: str | None = None
                ) -> TensorSource:
    """Open any supported checkpoint for streaming reads (see read_checkpoint for `key`, `kind`)."""
    kind = checkpoint_kind(path, kind=kind)
    if kind == "safetensors":
        refuse_key_for_safetensors(path, key)
        return SafetensorsSource(path)
    if kind == "pickle":
        return PickleSource(path, key=key)
    return ShardedSource(path, key=key)


# --- writing ------------------------------------------------------------------------------------

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
        n = nbytes(p.info)
        header[p.name] = {"dtype": p.info.dtype, "shape": list(p.info.shape),
                          "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def write_safetensors(out: str, tensors: list[Planned], *, metadata: Mapping[str, str],
                      aliases: Mapping[str, str] | None = None,
                      max_shard_size: int | None = None, force: bool = False,
                      progress: ProgressFn | None = None) -> WriteResult:
    """Write `tensors` to `out` (or to shards plus an HF-style index), all or nothing.

    Every file is written to a fresh temp file in the output folder (surgery.atomic); only
    when all are complete are they published, shards first and the index last. If any step
    fails (a full disk, a signal, a file that appeared meanwhile without `force`), the files
    published so far are taken back and the temps removed, so the destination is left as it
    was and a rerun works. What a killed earlier run left for these names is cleaned up first
    (`surgery.atomic.recover`, reported in `WriteResult.recovered`).
    """
    aliases = dict(aliases or {})
    shards = plan_shards(tensors, max_shard_size)
    files, index = shard_paths(out, len(shards))
    recovered = recover([*files, *([index] if index else [])])
    if not force:
        for p in [*files, *([index] if index else [])]:
            if os.path.lexists(p):
                raise OutputExistsError(p)
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
                    meta["surgery.aliases"] = json.dumps(local, sort_keys=True)
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
    return result
