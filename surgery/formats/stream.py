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
end, or not at all (surgery.formats.atomic).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from surgery.errors import CheckpointError
from surgery.formats.checkpoint import read_index, refuse_key_for_safetensors
from surgery.formats.pickled import select_state_dict, torch_load_safely
from surgery.formats.safe_write import write_all
from surgery.formats.st_file import read_safetensors_layout
from surgery.formats.tensors import (
    _ST_ITEMSIZE,
    CheckpointInfo,
    TensorInfo,
    checkpoint_kind,
    normalize_dtype,
)

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
        if flat.stride(0) != 1:  # torch calls a size-1 tensor of stride 0 contiguous
            flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
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
