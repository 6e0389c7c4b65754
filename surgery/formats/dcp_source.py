"""Stream a DCP folder's tensors one at a time through DCP's own reader, for export and --deep.

`export` must never hold the whole model in one process. Each tensor is loaded alone: a zeroed
tensor of its global shape is handed to ``torch.distributed.checkpoint.load`` (``no_dist``: this
process only), whose ``FileSystemReader`` reads every rank's chunk of it and copies the chunks
into place; its bytes are yielded, then dropped. Peak memory is about twice the largest tensor
(the target, and one chunk as ``torch.load`` returns it), not the model.

DCP's reader is handed metadata rebuilt here from what `surgery.formats.dcp` read and checked,
holding only the tensor being loaded: DCP's ``read_metadata`` (a plain ``pickle.load`` of the
file) is overridden and never runs, and no "bytes" entry is ever requested (DCP loads those with
``torch.load(weights_only=False)``). Chunk bytes are read by DCP with
``torch.load(weights_only=True)``.

`open_checkpoint_source` opens any checkpoint for streaming: a DCP folder here, every other
kind through `surgery.formats.stream.open_source`.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterator
from typing import Any

from surgery.errors import CheckpointError
from surgery.formats.dcp import DcpCheckpoint, read_dcp_metadata, select_dcp_entry
from surgery.formats.stream import CHUNK, TensorSource, open_source
from surgery.formats.tensors import CheckpointInfo, checkpoint_kind

# safetensors dtype spelling -> torch dtype attribute name.
_ST_TO_TORCH: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
    "C128": "complex128",
}


def _reader_class() -> type:
    """A FileSystemReader that reads its metadata from us, never from the file."""
    from torch.distributed.checkpoint import FileSystemReader

    class CheckedReader(FileSystemReader):  # type: ignore[misc]
        def __init__(self, folder: str, metadata: Any) -> None:
            super().__init__(folder)
            self.checked = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.checked

    return CheckedReader


def dcp_metadata_for(ck: DcpCheckpoint, key: str) -> Any:
    """DCP ``Metadata`` describing one tensor, built from checked values (not from the pickle)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # private: guarded below
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    info = ck.tensors[key]
    dtype = getattr(torch, _ST_TO_TORCH[info.dtype])
    chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
              for c in ck.chunks[key]]
    storage = {MetadataIndex(key, torch.Size(c.offsets)): _StorageInfo(c.file, c.offset, c.length)
               for c in ck.chunks[key]}
    tensor = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(info.shape), chunks)
    return Metadata(state_dict_metadata={key: tensor}, planner_data={key: (key,)},
                    storage_data=storage, storage_meta=StorageMeta())


class DcpSource(TensorSource):
    """The tensors of a DCP folder's model entry, each loaded alone by DCP's reader."""

    def __init__(self, folder: str, *, key: str | None = None) -> None:
        self.ck = read_dcp_metadata(folder)
        sel = select_dcp_entry(self.ck, key=key)
        self.names = sel.names  # exported-side name -> DCP key
        self.info = CheckpointInfo(folder, "dcp", {n: self.ck.tensors[k]
                                                   for n, k in sel.names.items()},
                                   entry=sel.entry, candidates=sel.candidates,
                                   ignored=sel.ignored, optimizer=sel.optimizer, files=[folder])
        self._reader = _reader_class()

    def identity(self, name: str) -> Hashable:
        # DCP stores every key's chunks separately (tied weights are saved twice).
        return tuple((c.file, c.offset, c.length) for c in self.ck.chunks[self.names[name]])

    def load(self, name: str) -> Any:
        """One tensor, whole, on the CPU."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        key = self.names[name]
        info = self.ck.tensors[key]
        target = torch.zeros(info.shape, dtype=getattr(torch, _ST_TO_TORCH[info.dtype]))
        reader = self._reader(self.ck.folder, dcp_metadata_for(self.ck, key))
        try:
            with warnings.catch_warnings():  # "assuming ... a single process": it is, by design
                warnings.simplefilter("ignore")
                dcp.load({key: target}, storage_reader=reader, planner=DefaultLoadPlanner(),
                         no_dist=True)
        except Exception as e:  # a damaged .distcp file fails inside DCP in many ways
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise CheckpointError(f"{self.ck.folder}: cannot read {name!r} from the DCP "
                                  f"files ({type(e).__name__}: {first})", path=self.ck.folder,
                                  hint="the .distcp files are damaged or incomplete; copy "
                                       "the whole folder again") from None
        return target

    def chunks(self, name: str) -> Iterator[memoryview]:
        import torch

        t = self.load(name)
        if t.numel() == 0:
            return
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
        for lo in range(0, data.nbytes, CHUNK):
            yield data[lo:lo + CHUNK]
        del data, t


def open_checkpoint_source(path: str, *, key: str | None = None, kind: str | None = None
                           ) -> TensorSource:
    """Open any supported checkpoint for streaming reads, a DCP folder included."""
    if checkpoint_kind(path, kind=kind) == "dcp":
        return DcpSource(path, key=key)
    return open_source(path, key=key, kind=kind)
