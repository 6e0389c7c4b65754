"""timm training checkpoints load: `argparse.Namespace` (and pathlib paths) as data (issue 21).

The attacks on those classes are in tests/test_untrusted_read.py's pickle corpus.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle

import pytest
import torch
from click.testing import CliRunner

from surgery.cli import cli
from surgery.formats.checkpoint import read_checkpoint
from surgery.formats.pickle_probe import PLAIN_DATA_TYPES, scan_for_code


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
            for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _timm_checkpoint(tmp_path) -> str:
    """What timm's train.py writes: its own CheckpointSaver, args a Namespace with a Path."""
    saver_mod = pytest.importorskip("timm.utils")
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    args = argparse.Namespace(model="net", lr=1e-3, epochs=1,
                              data_dir=pathlib.PosixPath("/data/imagenet"))
    out = tmp_path / "output" / "train"
    out.mkdir(parents=True)
    saver = saver_mod.CheckpointSaver(model, opt, args=args, checkpoint_dir=str(out),
                                      recovery_dir=str(out))
    saver.save_checkpoint(epoch=0, metric=0.5)
    names = sorted(os.listdir(out))
    assert "last.pth.tar" in names, names
    return str(out / "last.pth.tar")


def test_timm_train_checkpoint_plans_verifies_and_exports(tmp_path) -> None:
    ckpt = _timm_checkpoint(tmp_path)
    man = tmp_path / "net.surgery.toml"
    r = run("plan", ckpt, "-o", man)
    assert r.exit_code == 0, r.output
    assert "blocks.0" in man.read_text()
    r = run("verify", ckpt, "--manifest", man)
    assert r.exit_code == 0, r.output
    out = tmp_path / "net.safetensors"
    r = run("export", ckpt, "-o", out, "--manifest", man)
    assert r.exit_code == 0, r.output
    info = read_checkpoint(ckpt)
    assert len(info.tensors) == len(_Net().state_dict())


def test_the_allowance_is_for_surgery_s_own_load_only(tmp_path) -> None:
    """The caller's torch.load still refuses a Namespace after surgery read one."""
    ckpt = _timm_checkpoint(tmp_path)
    read_checkpoint(ckpt)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(ckpt, weights_only=True)


def test_a_class_off_the_list_is_still_refused_by_name(tmp_path) -> None:
    path = tmp_path / "frac.pth.tar"
    import fractions

    torch.save({"state_dict": {"w": torch.zeros(2)}, "args": argparse.Namespace(),
                "metric": fractions.Fraction(1, 3)}, path)
    r = run("plan", path, "-o", tmp_path / "x.toml")
    assert r.exit_code == 3, r.output
    assert "fractions.Fraction" in r.output and "Namespace" not in r.output


def test_the_refusal_scan_skips_the_allowed_classes() -> None:
    """A refused file names the class that makes it unsafe, never an allowed one."""
    for t in PLAIN_DATA_TYPES:
        obj = argparse.Namespace(a=1) if t is argparse.Namespace else t("/a")
        assert scan_for_code(pickle.dumps({"args": obj}, protocol=2)) is None, t
        assert scan_for_code(pickle.dumps({"args": obj}, protocol=4)) is None, t
    import fractions

    blob = pickle.dumps({"args": argparse.Namespace(), "m": fractions.Fraction(1, 3)}, protocol=4)
    assert scan_for_code(blob) == "fractions.Fraction"
