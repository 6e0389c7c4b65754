"""What a new user hits, round 2 (issue 21): each test reproduces one defect of the issue.

timm checkpoints (tests/test_plain_types.py), tied weights (tests/test_ties.py) and the export
metadata keys (tests/test_golden_exports.py) have their own files.
"""

from __future__ import annotations

import os

import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from surgery.cli import cli
from surgery.examples import tiny


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _st(path, sd) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return str(path)


# --- defect 7: SG101's fix line never overwrites another model's manifest ---------------------


def test_sg101_fix_plans_a_new_manifest_for_this_checkpoint(tmp_path) -> None:
    mine = _st(tmp_path / "t1" / "model.safetensors", tiny().state_dict())
    other = _st(tmp_path / "t2" / "bert" / "model.safetensors",
                {"encoder.layer.0.weight": torch.zeros(4, 4)})
    theirs = tmp_path / "t2" / "bert" / "model.surgery.toml"
    assert run("plan", other, "-o", theirs).exit_code == 0
    r = run("verify", mine, "--manifest", theirs)
    assert r.exit_code == 1 and "SG101" in r.output
    fix = next(line for line in r.output.splitlines() if "surgery plan" in line)
    assert f"-o {theirs}" not in fix and "--force" not in fix, fix
    assert f"surgery plan {mine} -o {tmp_path / 't1' / 'model.surgery.toml'}" in fix, fix


def test_sg101_fix_replans_a_checkpoint_s_own_manifest_with_force(tmp_path) -> None:
    ckpt = _st(tmp_path / "model.safetensors", tiny().state_dict())
    own = tmp_path / "model.surgery.toml"
    assert run("plan", ckpt, "-o", own).exit_code == 0
    _st(tmp_path / "model.safetensors", {**tiny().state_dict(), "extra.weight": torch.zeros(2)})
    r = run("verify", ckpt, "--manifest", own)
    assert r.exit_code == 1 and "SG101" in r.output
    assert f"surgery plan {ckpt} -o {own} --force" in r.output, r.output


# --- defect 6: user mistakes are not reported as surgery bugs ---------------------------------

_WARM_MOD = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
                                    for _ in range(2))
    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x

def build():
    return Net()

def example_fp32(model):
    return torch.randn(2, 8)  # float32 whatever --dtype cast the model to
'''


def test_warm_with_inputs_of_another_dtype_is_the_user_s_error(tmp_path, monkeypatch) -> None:
    (tmp_path / "warm21mod.py").write_text(_WARM_MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SURGERY_CACHE_KEY", "ab" * 32)
    assert run("plan", "--model", "warm21mod:build", "-o", "net.surgery.toml").exit_code == 0
    r = run("warm", "--model", "warm21mod:build", "--manifest", "net.surgery.toml", "--input",
            "warm21mod:example_fp32", "--dtype", "bf16", "--device", "cpu",
            "--overrides", "on_cpu=compile", "--overrides", "backend=aot_eager")
    assert r.exit_code == 3, r.output
    assert "internal error" not in r.output and "a bug in surgery" not in r.output, r.output
    assert "warm21mod:example_fp32" in r.output and "failed in the model" in r.output
    assert "--dtype bf16 casts the model" in r.output
    assert not (tmp_path / "net.surgery.cache").exists()


def test_a_lazy_import_that_fails_names_the_import(tmp_path, monkeypatch) -> None:
    """transformers' lazy module raises ModuleNotFoundError from __getattr__ (issue 21: a
    torchvision built for another torch); that is the user's environment, not a bug."""
    (tmp_path / "lazy21.py").write_text(
        "def __getattr__(name):\n"
        "    raise ModuleNotFoundError(f'Could not import module {name!r}. Are this object\\'s "
        "requirements defined correctly?')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = run("plan", "--model", "lazy21:BertModel", "-o", tmp_path / "x.toml")
    assert r.exit_code == 3, r.output
    assert "internal error" not in r.output and "a bug in surgery" not in r.output, r.output
    assert "lazy21.BertModel exists but fails to import: ModuleNotFoundError" in r.output
    assert 'python -c "from lazy21 import BertModel"' in r.output
