"""The smaller findings of issue 22: each refused in one clear line (or fixed), never an
internal error, and nothing written that safetensors would refuse."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from surgery.cli import cli
from surgery.errors import RegionError
from surgery.formats import writer
from surgery.runtime.resolve import resolve_path


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def _one_error(r) -> str:
    assert r.exit_code == 3, r.output
    assert "internal error" not in r.stderr and "Traceback" not in r.output, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_a_size_one_expanded_tensor_exports(tmp_path: Path) -> None:
    src = tmp_path / "e.pt"
    torch.save({"w": torch.tensor(1.5).expand(1)}, src)
    out = tmp_path / "e.safetensors"
    r = run("export", str(src), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert torch.equal(load_file(str(out))["w"], torch.tensor([1.5]))


def test_keys_1_and_str_1_do_not_collapse(tmp_path: Path) -> None:
    src = tmp_path / "k.pt"
    torch.save({1: torch.zeros(1), "1": torch.ones(1)}, src)
    for cmd in (["verify", str(src)], ["export", str(src), "-o", str(tmp_path / "k.safetensors")]):
        assert "is a int, not a string" in _one_error(run(*cmd))


@pytest.mark.parametrize("dtype", ["complex128", "float8_e8m0fnu", "float4_e2m1fn_x2"])
def test_dtypes_safetensors_cannot_store_are_refused_before_writing(tmp_path: Path,
                                                                    dtype: str) -> None:
    if not hasattr(torch, dtype):
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    src = tmp_path / "d.pt"
    t = torch.zeros(2, dtype=torch.uint8).view(getattr(torch, dtype)) if "4" in dtype[:6] \
        else torch.zeros(2, dtype=getattr(torch, dtype))
    torch.save({"t": t}, src)
    out = tmp_path / "d.safetensors"
    assert "safetensors cannot store" in _one_error(run("export", str(src), "-o", str(out)))
    assert not out.exists()


def test_a_lone_surrogate_key_is_refused_by_every_command(tmp_path: Path) -> None:
    header = {"a\ud800b.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()  # JSON escapes it as \\ud800, which parses to a surrogate
    f = tmp_path / "s.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    for cmd in (["verify", str(f)], ["plan", str(f), "-o", str(tmp_path / "s.surgery.toml")],
                ["export", str(f), "-o", str(tmp_path / "o.safetensors")]):
        assert "lone surrogate" in _one_error(run(*cmd)), cmd


def test_an_oversized_header_is_refused_before_export_writes(tmp_path: Path,
                                                             monkeypatch) -> None:
    """An embedded manifest over safetensors' 100 MB header cap (shrunk here to 256 bytes)."""
    from safetensors.torch import save_file

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(2)}, str(src))
    manifest = tmp_path / "m.surgery.toml"
    assert run("plan", str(src), "-o", str(manifest)).exit_code == 0
    monkeypatch.setattr(writer, "MAX_HEADER_BYTES", 256)
    out = tmp_path / "o.safetensors"
    line = _one_error(run("export", str(src), "-o", str(out), "--manifest", str(manifest)))
    assert "header would be" in line
    assert not out.exists()


def test_methods_of_library_base_classes_are_not_method_regions() -> None:
    transformers = pytest.importorskip("transformers")

    class Mine(transformers.GPT2LMHeadModel):
        def my_step(self, x: torch.Tensor) -> torch.Tensor:
            return x

    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16,
                                     n_positions=8)
    model = Mine(config)
    for name in ("save_pretrained", "push_to_hub", "generate"):
        with pytest.raises(RegionError, match=r"nn.Module's own API|has no method"):
            resolve_path(model, name, callable="method")
    assert resolve_path(model, "my_step", callable="method") == (model, "my_step")
