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
