"""stream.py: streaming sources and the atomic safetensors writer."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from surgery.formats.st_file import read_safetensors_layout
from surgery.formats.stream import itemsize, open_source
from surgery.formats.writer import Planned, parse_size, shard_paths, write_safetensors


@pytest.mark.parametrize("text,size", [
    pytest.param("4096", 4096, id="bytes"),
    pytest.param("500MB", 500 * 10**6, id="MB"),
    pytest.param("2GB", 2 * 10**9, id="GB"),
    pytest.param("1.5GiB", int(1.5 * 2**30), id="GiB"),
    pytest.param("10 kib", 10240, id="lower-case-space"),
])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "-1GB", "5XB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_shard_paths_follow_hf_naming() -> None:
    assert shard_paths("d/model.safetensors", 1) == (["d/model.safetensors"], None)
    files, index = shard_paths("d/model.safetensors", 2)
    assert files == ["d/model-00001-of-00002.safetensors", "d/model-00002-of-00002.safetensors"]
    assert index == "d/model.safetensors.index.json"


SD = {
    "odd.u8": torch.arange(3, dtype=torch.uint8),
    "b.bf16": torch.randn(5, dtype=torch.bfloat16),
    "a.f32": torch.randn(3, 7),
    "c.f64": torch.randn(2, dtype=torch.float64),
    "flag": torch.tensor([True, False]),
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(3.5),
}


@pytest.mark.parametrize("kind", [pytest.param("pt", id="from-pickle"),
                                  pytest.param("safetensors", id="from-safetensors")])
@pytest.mark.parametrize("fallback", [pytest.param(False, id="copy_file_range"),
                                      pytest.param(True, id="pread-fallback")])
def test_writer_output_is_valid_aligned_and_exact(tmp_path, monkeypatch, kind, fallback) -> None:
    src_path = str(tmp_path / f"src.{kind}")
    (torch.save if kind == "pt" else save_file)(SD, src_path)
    if fallback:
        def refuse(*args, **kwargs):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    src = open_source(src_path)
    out = str(tmp_path / "out.safetensors")
    try:
        planned = [Planned(f"x.{k}", src.infos[k], src, k) for k in src.infos]
        result = write_safetensors(out, planned, metadata={"format": "pt"})
    finally:
        src.close()
    assert result.files == [out] and result.index is None
    layout = read_safetensors_layout(out)
    for name, (lo, _) in layout.offsets.items():
        assert lo % itemsize(layout.tensors[name].dtype) == 0, name  # aligned for zero-copy
    with safe_open(out, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, v in SD.items():
            assert torch.equal(f.get_tensor(f"x.{k}"), v), k


def test_pickle_source_pages_released_data_intact(tmp_path) -> None:
    """After a tensor's mapped pages are dropped, reading it again gives the same bytes."""
    big = torch.randn(1024, 1024)
    path = str(tmp_path / "big.pt")
    torch.save({"w": big, "v": big[::2]}, path)
    src = open_source(path)
    try:
        first = b"".join(bytes(p) for p in src.chunks("w"))
        second = b"".join(bytes(p) for p in src.chunks("w"))
        view = b"".join(bytes(p) for p in src.chunks("v"))
    finally:
        src.close()
    assert first == second == big.numpy().tobytes()
    assert view == big[::2].contiguous().numpy().tobytes()


def test_open_source_refuses_key_for_safetensors(tmp_path) -> None:
    from surgery.errors import CheckpointError

    path = str(tmp_path / "m.safetensors")
    save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="--key does not apply"):
        open_source(path, key="state_dict")
