"""checkpoint.py readers: every format, containers, shards, and bad files -> CheckpointError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from surgery.errors import CheckpointError, UnsafeCheckpointError
from surgery.examples import tiny
from surgery.formats.checkpoint import read_checkpoint, read_index
from surgery.formats.pickled import select_state_dict
from surgery.formats.st_file import read_safetensors_header
from surgery.formats.tensors import TensorInfo, checkpoint_kind, normalize_dtype

SD = tiny().state_dict()
KEYS = set(SD)
WRAPPED = {f"module._orig_mod.{k}": v for k, v in SD.items()}


def _infos(sd: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {k: TensorInfo(tuple(v.shape), normalize_dtype(v.dtype)) for k, v in sd.items()}


@pytest.mark.parametrize("name,save", [
    pytest.param("m.safetensors", lambda sd, p: save_file(sd, p), id="safetensors"),
    pytest.param("m.pt", torch.save, id="pt"),
    pytest.param("m.pth", torch.save, id="pth"),
    pytest.param("m.ckpt", torch.save, id="ckpt"),
    pytest.param("m.bin", torch.save, id="bin"),
    pytest.param("legacy.pt", lambda sd, p: torch.save(sd, p, _use_new_zipfile_serialization=False),
                 id="legacy-non-zip-pickle"),
])
@pytest.mark.parametrize("sd", [pytest.param(SD, id="clean"), pytest.param(WRAPPED, id="wrapped")])
def test_every_format_reads_keys_shapes_dtypes(tmp_path, name, save, sd) -> None:
    path = str(tmp_path / name)
    save(sd, path)
    info = read_checkpoint(path)
    assert info.tensors == _infos(sd)  # raw keys: readers never rename
    assert info.format == ("safetensors" if name.endswith(".safetensors") else "pickle")
    assert info.entry is None


def test_dtypes_normalise_to_one_spelling(tmp_path) -> None:
    sd = {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float16),
          "c": torch.zeros(2, dtype=torch.int64), "d": torch.zeros(2, dtype=torch.bool)}
    save_file(sd, str(tmp_path / "x.safetensors"))
    torch.save(sd, str(tmp_path / "x.pt"))
    a = read_checkpoint(str(tmp_path / "x.safetensors")).tensors
    b = read_checkpoint(str(tmp_path / "x.pt")).tensors
    assert a == b and a["a"].dtype == "BF16" and a["d"].dtype == "BOOL"
    assert normalize_dtype(torch.float32) == normalize_dtype("torch.float32") == "F32"


def test_safetensors_header_only_without_torch(tmp_path) -> None:
    path = str(tmp_path / "m.safetensors")
    save_file(SD, path, metadata={"format": "pt"})
    code = ("import sys\nfrom surgery.formats.checkpoint import read_checkpoint\n"
            f"info = read_checkpoint({path!r})\n"
            "print(len(info.tensors), info.metadata['format'])\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.split() == [str(len(SD)), "pt"]
    _, meta, start = read_safetensors_header(path)
    assert start % 8 == 0 and meta == {"format": "pt"}


def test_lightning_container(tmp_path) -> None:
    path = str(tmp_path / "lightning.ckpt")
    torch.save({"state_dict": {f"model.{k}": v for k, v in SD.items()}, "epoch": 3,
                "global_step": 120, "hyper_parameters": {"lr": 0.1}}, path)
    info = read_checkpoint(path)
    assert info.entry == "state_dict"
    assert set(info.tensors) == {f"model.{k}" for k in KEYS}
    assert "epoch" in info.ignored and "global_step" in info.ignored


@pytest.mark.parametrize("container,key,entry", [
    pytest.param({"model": SD, "ema": WRAPPED}, None, "model", id="prefers-online-weights"),
    pytest.param({"model": SD, "ema": WRAPPED}, "ema", "ema", id="key-picks-ema"),
    pytest.param({"ckpt": {"weights": {"net": SD}}, "step": 1}, None, "ckpt/weights/net",
                 id="nested-found"),
    pytest.param({"a": {"model": SD}, "b": {"model": WRAPPED}}, "b/model", "b/model",
                 id="nested-key"),
    pytest.param({"module": WRAPPED, "optimizer": {"state": {}}}, None, "module",
                 id="module-entry"),
])
def test_container_selection(tmp_path, container, key, entry) -> None:
    path = str(tmp_path / "c.pt")
    torch.save(container, path)
    info = read_checkpoint(path, key=key)
    assert info.entry == entry
    cur = container
    for part in entry.split("/"):
        cur = cur[part]
    assert set(info.tensors) == set(cur)
    if key is None and len(info.candidates) > 1:
        assert entry in info.candidates


@pytest.mark.parametrize("container,key,match", [
    pytest.param({"model": SD}, "ema", "no entry 'ema'", id="missing-entry"),
    pytest.param({"model": SD, "epoch": 3}, "epoch", "not a state dict", id="not-a-state-dict"),
    pytest.param({"epoch": 3, "lr": 0.1}, None, "no state dict of tensors", id="no-tensors"),
])
def test_container_errors(tmp_path, container, key, match) -> None:
    path = str(tmp_path / "c.pt")
    torch.save(container, path)
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(path, key=key)


def test_key_does_not_apply_to_safetensors(tmp_path) -> None:
    path = str(tmp_path / "m.safetensors")
    save_file(SD, path)
    with pytest.raises(CheckpointError, match="--key does not apply"):
        read_checkpoint(path, key="model")


def _shard(sd: dict[str, torch.Tensor], folder: Path, suffix: str, n: int = 3) -> str:
    keys = sorted(sd)
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}{suffix}"
        part = {k: sd[k].clone() for k in keys[i::n]}
        if suffix == ".safetensors":
            save_file(part, str(folder / name))
        else:
            torch.save(part, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    index = folder / f"model{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return str(index)


@pytest.mark.parametrize("suffix", [pytest.param(".safetensors", id="safetensors-shards"),
                                    pytest.param(".bin", id="bin-shards")])
@pytest.mark.parametrize("sd", [pytest.param(SD, id="clean"), pytest.param(WRAPPED, id="wrapped")])
def test_sharded_index(tmp_path, suffix, sd) -> None:
    index = _shard(sd, tmp_path, suffix)
    info = read_checkpoint(index)
    assert info.format == "sharded" and len(info.files) == 3
    assert info.tensors == _infos(sd)
    assert set(read_index(index).values()) == set(info.files)


def test_sharded_index_errors(tmp_path) -> None:
    index = _shard(SD, tmp_path, ".safetensors")
    data = json.loads(Path(index).read_text())
    data["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    Path(index).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="in no shard"):
        read_checkpoint(index)
    os.unlink(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match="no such file"):
        read_checkpoint(index)
    Path(index).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid sharded-checkpoint index"):
        read_checkpoint(index)


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(4096))


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _text(p: Path) -> None:
    p.write_text("hello, this is not a checkpoint\n" * 10)


def _zero_header(p: Path) -> None:
    p.write_bytes(b"\x00" * 64)


def _bad_json_header(p: Path) -> None:
    p.write_bytes((16).to_bytes(8, "little") + b"{not json at all" + b"\x00" * 8)


@pytest.mark.parametrize("name", [pytest.param("m.safetensors", id="safetensors"),
                                  pytest.param("m.pt", id="pt"),
                                  pytest.param("legacy.pth", id="legacy-pickle")])
@pytest.mark.parametrize("damage", [
    pytest.param(_truncate, id="truncated"),
    pytest.param(_empty, id="empty"),
    pytest.param(_garbage, id="garbage"),
    pytest.param(_text, id="text"),
    pytest.param(_zero_header, id="zeros"),
    pytest.param(_bad_json_header, id="bad-json-header"),
])
def test_broken_files_raise_checkpoint_error(tmp_path, name, damage) -> None:
    path = tmp_path / name
    if name.endswith(".safetensors"):
        save_file(SD, str(path))
    else:
        torch.save(SD, str(path), _use_new_zipfile_serialization=not name.startswith("legacy"))
    damage(path)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(path))
    assert not isinstance(e.value, UnsafeCheckpointError) or name != "m.safetensors"
    assert str(path) in e.value.message and "\n" not in e.value.message
    assert "weights_only=False" not in str(e.value)


def test_truncated_safetensors_with_intact_header(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    save_file(SD, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint(str(path))


@pytest.mark.parametrize("name,match", [
    pytest.param("missing.pt", "no such file", id="missing"),
    pytest.param("model.onnx", "unknown checkpoint type", id="unknown-suffix"),
])
def test_unknown_or_missing(tmp_path, name, match) -> None:
    if name.endswith(".onnx"):
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(str(tmp_path / name))
    assert checkpoint_kind("a/b.index.json") == "sharded"


def test_select_state_dict_flat() -> None:
    sd, entry, cands, ignored = select_state_dict(SD, path="x")
    assert entry is None and set(sd) == KEYS and cands == [] and ignored == []
