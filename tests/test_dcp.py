"""DCP folders (surgery.formats.dcp, surgery.formats.dcp_source): read as data, streamed out.

The folders here are saved in this one process by ``torch.distributed.checkpoint.save``; the
folder an FSDP2 model saves on 2 ranks is planned, verified and exported in
tests/test_distributed.py. A hostile ``.metadata`` is built the way an attacker would: a real
DCP ``Metadata`` with a malicious object inside, or edited fields, pickled.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import surgery.formats.dcp_source as dcp_source
from surgery.cli import cli
from surgery.errors import CheckpointError, UnsafeCheckpointError
from surgery.formats.checkpoint import read_checkpoint
from surgery.formats.dcp import METADATA_NAME
from surgery.formats.source import load_exported, resolve_checkpoint
from surgery.hygiene.export import export_checkpoint
from surgery.hygiene.verify import verify_checkpoint
from surgery.planning.plan import plan_checkpoint

dcp = pytest.importorskip("torch.distributed.checkpoint")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 3)


def _save(folder: str, obj: dict[str, Any]) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming ... a single process"
        dcp.save(obj, checkpoint_id=folder, no_dist=True)
    return folder


@pytest.fixture
def saved(tmp_path: Any) -> str:
    net = Net()
    return _save(str(tmp_path / "step-10"), {"model": net.state_dict(), "step": 10,
                                            "optim": {"lr": torch.tensor(1e-3)}})


def _edit(folder: str, change: Any) -> None:
    """Rewrite .metadata after `change(metadata)`: the test's own, trusted, file."""
    path = os.path.join(folder, METADATA_NAME)
    with open(path, "rb") as f:
        meta = pickle.load(f)  # our own file, written just now
    change(meta)
    with open(path, "wb") as f:
        pickle.dump(meta, f)


def test_keys_come_from_metadata_alone(saved: str) -> None:
    # The data files replaced by zeros of the same size: the keys are still read, as no tensor
    # byte is.
    for name in os.listdir(saved):
        if name.endswith(".distcp"):
            path = os.path.join(saved, name)
            size = os.path.getsize(path)
            with open(path, "wb") as f:
                f.truncate(size)
    info = read_checkpoint(saved, kind="dcp")
    assert info.format == "dcp" and info.entry == "model"
    assert sorted(info.tensors) == sorted(Net().state_dict())
    assert info.tensors["head.weight"] == ((3, 8), "F32")
    assert "step" in info.ignored and info.optimizer == {"optim": 1}


def test_reading_the_key_list_never_imports_torch(saved: str) -> None:
    code = ("import sys; from surgery.formats.checkpoint import read_checkpoint; "
            f"i = read_checkpoint({saved!r}, kind='dcp'); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(len(i.tensors))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "6"


def test_a_folder_with_metadata_resolves_to_itself(saved: str) -> None:
    assert resolve_checkpoint(saved).kind == "dcp"
    with pytest.raises(CheckpointError, match="not a DCP checkpoint"):
        resolve_checkpoint(os.path.dirname(saved), format="dcp")


def test_plan_verify_export_and_strict_load(saved: str, tmp_path: Any) -> None:
    planned = plan_checkpoint(saved, kind="dcp")  # regions: see test_distributed (a ViT)
    assert "used the state dict in entry 'model'" in planned.notes[0]
    report = verify_checkpoint(saved, kind="dcp", deep=True)
    assert report.clean and report.tensors == 6
    out = str(tmp_path / "out.safetensors")
    result = export_checkpoint(saved, out=out, kind="dcp")
    assert result.tensors == 6 and result.fingerprint == planned.manifest.fingerprint
    state, _ = load_exported(out)
    net = Net()
    net.load_state_dict(state, strict=True)
    assert all(torch.equal(state[k], v) for k, v in Net().state_dict().items())


def test_dcp_own_read_metadata_never_runs(saved: str, tmp_path: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    def unpickles(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("DCP's read_metadata (pickle.load) ran")

    monkeypatch.setattr(FileSystemReader, "read_metadata", unpickles)
    export_checkpoint(saved, out=str(tmp_path / "o.safetensors"), kind="dcp")


def test_export_loads_one_tensor_at_a_time(saved: str, tmp_path: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = dcp_source.dcp_metadata_for

    def spy(ck: Any, key: str) -> Any:
        meta = real(ck, key)
        sizes.append(len(meta.state_dict_metadata))
        return meta

    monkeypatch.setattr(dcp_source, "dcp_metadata_for", spy)
    export_checkpoint(saved, out=str(tmp_path / "o.safetensors"), kind="dcp")
    assert sizes == [1] * 6


def test_key_chooses_an_entry(saved: str) -> None:
    info = read_checkpoint(saved, kind="dcp", key="optim")
    assert list(info.tensors) == ["lr"]
    with pytest.raises(CheckpointError, match="no entry 'ema'"):
        read_checkpoint(saved, kind="dcp", key="ema")


class Boom:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/surgery-dcp-pwned"


@pytest.mark.parametrize("plant", [
    pytest.param(lambda m: setattr(m.storage_meta, "checkpoint_id", Boom()), id="storage_meta"),
    pytest.param(lambda m: setattr(m, "planner_data", {"model.head.weight": Boom()}),
                 id="planner_data"),
    pytest.param(lambda m: setattr(next(iter(m.state_dict_metadata.values())).properties,
                                   "dtype", Boom()), id="dtype"),
])
def test_a_hostile_metadata_is_refused_without_running_code(saved: str, plant: Any) -> None:
    if os.path.exists(MARKER):
        os.remove(MARKER)
    _edit(saved, plant)
    with pytest.raises(UnsafeCheckpointError, match=r"would run code .*system"):
        read_checkpoint(saved, kind="dcp")
    result = CliRunner().invoke(cli, ["verify", saved])
    assert result.exit_code == 3, result.output
    assert "would run code" in result.output and "weights_only=False" not in result.output
    assert not os.path.exists(MARKER)


@pytest.mark.parametrize("data,match", [
    pytest.param(b"cos\nsystem\n(S'true'\ntR.", "would run code", id="protocol0-global"),
    pytest.param(b"\x80\x02\x82\x01.", "not a readable pickle", id="copyreg-extension"),
    pytest.param(b"\x80\x04K\x01.", "does not hold DCP Metadata", id="an-int"),
    pytest.param(b"\x80\x04", "not a readable pickle", id="truncated"),
    pytest.param(b"", "not a readable pickle", id="empty"),
    pytest.param(b"\x80\x04P0\n.", "not a readable pickle", id="persistent-id"),
])
def test_broken_or_hostile_bytes(saved: str, data: bytes, match: str) -> None:
    with open(os.path.join(saved, METADATA_NAME), "wb") as f:
        f.write(data)
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(saved, kind="dcp")


def _first_storage(m: Any) -> Any:
    """Where the bytes of a tensor lie (bytes entries such as `step` are never read)."""
    return next(v for k, v in m.storage_data.items() if k.fqn == "model.head.weight")


@pytest.mark.parametrize("change,match", [
    pytest.param(lambda m: setattr(_first_storage(m), "relative_path", "../outside.distcp"),
                 "not a plain file name", id="path-escape"),
    pytest.param(lambda m: setattr(_first_storage(m), "relative_path", "/etc/passwd"),
                 "not a plain file name", id="absolute-path"),
    pytest.param(lambda m: setattr(_first_storage(m), "length", 10**12),
                 "past the end", id="range-past-end"),
    pytest.param(lambda m: setattr(_first_storage(m), "length", 4),
                 "more elements than", id="too-few-bytes"),
    pytest.param(lambda m: setattr(_first_storage(m), "transform_descriptors", ["zstd"]),
                 "transform", id="transform"),
    pytest.param(lambda m: next(iter(m.state_dict_metadata.values())).chunks.append(
        next(iter(m.state_dict_metadata.values())).chunks[0]), "do not cover it exactly",
        id="chunk-twice"),
    pytest.param(lambda m: setattr(next(iter(m.state_dict_metadata.values())), "size",
                                   torch.Size([2**40, 2**40])), "do not cover",
                 id="huge-shape"),
])
def test_malformed_metadata_is_refused(saved: str, change: Any, match: str) -> None:
    _edit(saved, change)
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(saved, kind="dcp")


def test_cli_takes_the_folder(saved: str, tmp_path: Any) -> None:
    runner = CliRunner()
    out = str(tmp_path / "clean.safetensors")
    result = runner.invoke(cli, ["export", saved, "-o", out])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["verify", saved, "--format", "dcp"])
    assert result.exit_code == 0 and "dcp" in result.output, result.output


def test_metadata_bounds_are_those_of_every_pickle(saved: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGERY_MAX_PICKLE_BYTES", "64")
    with pytest.raises(CheckpointError, match="SURGERY_MAX_PICKLE_BYTES"):
        read_checkpoint(saved, kind="dcp")
    monkeypatch.delenv("SURGERY_MAX_PICKLE_BYTES")
    # Lengths that claim more bytes than the file holds: refused, nothing allocated to hold
    # them (a 1 TiB BINBYTES8 fails its allocation at once; a 2 GiB BINUNICODE is never read).
    for data in (b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b"x",
                 b"\x80\x04X" + (2**31).to_bytes(4, "little") + b"x"):
        with open(os.path.join(saved, METADATA_NAME), "wb") as f:
            f.write(data)
        with pytest.raises(CheckpointError, match="not a readable pickle"):
            read_checkpoint(saved, kind="dcp")


def test_cli_plan_writes_the_manifest_beside_the_folder(saved: str) -> None:
    result = CliRunner().invoke(cli, ["plan", saved + "/"])
    assert result.exit_code == 0, result.output
    assert os.path.isfile(saved + ".surgery.toml")
    assert not os.path.exists(os.path.join(saved, ".surgery.toml"))


def test_verify_json_of_a_folder_fits_the_output_schema(saved: str) -> None:
    import json
    from pathlib import Path

    import jsonschema

    result = CliRunner().invoke(cli, ["verify", saved, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["format"] == "dcp" and doc["entry"] == "model" and doc["clean"]
    schema = Path(__file__).resolve().parents[1] / "schemas" / "verify-output.schema.json"
    jsonschema.validate(doc, json.loads(schema.read_text()),
                        cls=jsonschema.Draft202012Validator)
