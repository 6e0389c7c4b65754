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


# --- defect 8: the demo's "recompiles: PATH (1)" says what differed ---------------------------


def test_report_table_names_what_a_recompile_differed_in() -> None:
    from surgery.runtime.report import ApplyReport, RegionRecord

    rec = RegionRecord("aggregator.frame_blocks.0", "frame_block", "forward", "compiled",
                       recompiles=1, recompile_reasons=["stride of x (1024, 1) (was (1, 64))"],
                       fix="make the input contiguous before the region")
    table = ApplyReport([rec]).table()
    assert "aggregator.frame_blocks.0 (1: stride of x (1024, 1) (was (1, 64)))" in table, table
    assert "fix: make the input contiguous before the region" in table


# --- defect 8: help teaches: examples, the files it names exist, only its own exit codes ------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_command_s_help_has_examples_and_only_its_exit_codes() -> None:
    import re

    assert set(cli.commands) >= {"plan", "check", "verify", "export", "warm"}
    for name in cli.commands:
        text = run(name, "--help").output
        assert "Example" in text, f"{name} --help has no examples"
        codes = text.split("Exit codes:")[1]
        assert ("1  findings" in codes) == (name == "verify"), (name, codes)
        for code in ("0  clean", "2  usage error", "3  could not run", "130 interrupted"):
            assert code in codes, (name, code)
        for path in re.findall(r"surgery/[\w/]+\.py", text):
            assert os.path.exists(os.path.join(ROOT, path)), f"{name} --help names {path}"


# --- defect 8: a misspelt kind, a misspelt table -----------------------------------------------


def _tiny_manifest(tmp_path) -> str:
    path = tmp_path / "tiny.surgery.toml"
    assert run("plan", "--model", "surgery.examples:tiny", "-o", path).exit_code == 0
    return path.read_text()


def test_check_refuses_a_misspelt_kind(tmp_path) -> None:
    text = _tiny_manifest(tmp_path).replace('kind = "frame_block"', 'kind = "repeated_blocks"', 1)
    (tmp_path / "typo.surgery.toml").write_text(text)
    r = run("check", tmp_path / "typo.surgery.toml")
    assert r.exit_code == 3, r.output
    assert "'repeated_blocks' is not a kind surgery plans; did you mean 'repeated_block'?" \
        in r.output


def test_a_misspelt_table_shows_every_problem(tmp_path) -> None:
    text = _tiny_manifest(tmp_path).replace("\n[compile]\n", "\n[compil]\n", 1)
    (tmp_path / "typo.surgery.toml").write_text(text)
    r = run("check", tmp_path / "typo.surgery.toml")
    assert r.exit_code == 3, r.output
    assert "'compile' is a required property" in r.output
    assert "'compil' was unexpected" in r.output and "more problem" not in r.output


# --- defect 8: apply_manifest on a wrapper names what to pass ----------------------------------


def test_apply_manifest_on_a_wrapper_says_what_to_pass(tmp_path) -> None:
    import pytest

    import surgery
    from surgery.errors import RegionError

    model = tiny()
    man = tmp_path / "tiny.surgery.toml"
    man.write_text(_tiny_manifest(tmp_path))
    with pytest.raises(RegionError, match="AveragedModel") as info:
        surgery.apply_manifest(torch.optim.swa_utils.AveragedModel(model), str(man))
    assert "apply_manifest(model.module" in info.value.hint
    with pytest.raises(RegionError, match=r"torch.compile\(model\)") as info:
        surgery.apply_manifest(torch.compile(model), str(man))
    assert "apply_manifest(model._orig_mod" in info.value.hint


# --- defect 5: EMA under a prefix ---------------------------------------------------------------


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


class _WithEma(torch.nn.Module):
    """A training module keeping its EMA as an attribute: model.*, ema.module.*, ema.n_averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _net()
        self.ema = torch.optim.swa_utils.AveragedModel(self.model)


def test_verify_finds_an_averaged_model_under_an_attribute(tmp_path) -> None:
    path = tmp_path / "train.ckpt"
    torch.save(_WithEma().state_dict(), path)
    r = run("verify", path)
    assert r.exit_code == 1, r.output
    assert "SG002" in r.output and "AveragedModel under `ema.`" in r.output
    assert "SG007" in r.output and "ema.n_averaged" in r.output
    assert f"--prefix ema. -o {tmp_path / 'train.clean.safetensors'}" in r.output


def test_export_prefix_ema_leaves_n_averaged_out_and_verifies(tmp_path) -> None:
    path, out = tmp_path / "train.ckpt", tmp_path / "ema.safetensors"
    torch.save(_WithEma().state_dict(), path)
    r = run("export", path, "--prefix", "ema.", "-o", out)
    assert r.exit_code == 0, r.output
    assert "left out ema.n_averaged: EMA bookkeeping" in r.output
    r = run("verify", out)
    assert r.exit_code == 0, r.output  # was SG007: the export kept `n_averaged`
    import surgery

    sd, _ = surgery.load_exported(str(out))
    _net().load_state_dict(sd, strict=True)


def test_verify_names_a_wrapped_ema_entry_it_did_not_check(tmp_path) -> None:
    path = tmp_path / "both.pt"
    m = _net()
    torch.save({"model": m.state_dict(),
                "ema": torch.optim.swa_utils.AveragedModel(m).state_dict()}, path)
    r = run("verify", path)
    assert r.exit_code == 0, r.output  # the entry it checked, 'model', is clean
    assert "SG010" in r.output and "entry `ema`" in r.output
    assert "module." in r.output and "EMA bookkeeping" in r.output
    assert f"surgery verify {path} --key ema" in r.output
    r = run("verify", path, "--key", "ema")
    assert r.exit_code == 1 and "SG002" in r.output and "SG007" in r.output


# --- defect 8: a diffusers pipeline folder points to its models ---------------------------------


def test_plan_of_a_pipeline_folder_points_to_its_denoiser(tmp_path) -> None:
    import pytest

    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"))
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler()).save_pretrained(
        tmp_path / "pipe")
    r = run("plan", tmp_path / "pipe", "-o", tmp_path / "x.toml")
    assert r.exit_code == 3, r.output
    assert "a pipeline folder (model_index.json)" in r.output
    assert f"surgery plan {tmp_path / 'pipe' / 'unet'}{os.sep}" in r.output
    r = run("plan", tmp_path / "pipe" / "unet", "-o", tmp_path / "unet.toml")
    assert r.exit_code == 0, r.output


# --- defect 8: a decoder LM's checkpoint plan says the live plan differs ------------------------


def test_a_decoder_checkpoint_plan_says_the_live_plan_differs(tmp_path) -> None:
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    r = run("plan", tmp_path / "gpt2", "-o", tmp_path / "gpt2.toml")
    assert r.exit_code == 0, r.output
    assert "looks like a decoder language model" in r.output and "fixed_part" in r.output
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64))
    bert.save_pretrained(tmp_path / "bert")
    r = run("plan", tmp_path / "bert", "-o", tmp_path / "bert.toml")
    assert r.exit_code == 0 and "decoder language model" not in r.output, r.output
