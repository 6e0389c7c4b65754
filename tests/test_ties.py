"""Tied and shared weights bind (issue 21): GPT-2's save_pretrained folder and a diffusers model
with a shared weight saved by safetensors' save_model (surgery.formats.ties)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_model

import surgery
from surgery.cli import cli
from surgery.errors import FingerprintMismatchError
from surgery.formats.manifest import load_manifest
from surgery.formats.ties import TIED_FIELD, binding_variants, live_ties, restore_ties
from surgery.planning.plan import plan_checkpoint
from surgery.runtime.resolve import bind_model

AOT = {"backend": "aot_eager", "on_cpu": "compile", "mode": None, "options": None}


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return cfg, transformers.GPT2LMHeadModel


def _factory(name: str, build) -> str:
    mod = types.ModuleType(name)
    mod.build = build  # type: ignore[attr-defined]
    sys.modules[name] = mod
    return f"{name}:build"


def test_gpt2_folder_plan_binds_the_model_loaded_from_it(tmp_path) -> None:
    cfg, cls = _gpt2()
    torch.manual_seed(0)
    cls(cfg).save_pretrained(tmp_path / "gpt2")
    man = tmp_path / "gpt2.surgery.toml"
    r = run("plan", tmp_path / "gpt2", "-o", man)
    assert r.exit_code == 0, r.output
    assert "lm_head.weight" not in man.read_text()  # save_pretrained left it out
    model = cls.from_pretrained(tmp_path / "gpt2").eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(ids).logits
        with surgery.apply_manifest(model, str(man), overrides=AOT,
                                    warmup=lambda m: m(ids)) as handle:
            got = model(ids).logits
    assert any("lm_head.weight (= transformer.wte.weight)" in n for n in handle.report.notes)
    assert sum(r.compiled_runs for r in handle.report) > 0
    torch.testing.assert_close(got, want)


def test_gpt2_export_of_the_folder_loads_strict(tmp_path) -> None:
    """A plan from the live model records the tie; the export restores it as an alias."""
    cfg, cls = _gpt2()
    torch.manual_seed(0)
    original = cls(cfg).eval()
    original.save_pretrained(tmp_path / "gpt2")
    spec = _factory("ties_gpt2_factory", lambda: cls(cfg))
    man = tmp_path / "live.surgery.toml"
    assert run("plan", "--model", spec, "-o", man).exit_code == 0
    assert load_manifest(str(man)).model[TIED_FIELD] == {"lm_head.weight": "transformer.wte.weight"}
    r = run("verify", tmp_path / "gpt2", "--manifest", man)
    assert r.exit_code == 0, r.output
    out = tmp_path / "gpt2.safetensors"
    r = run("export", tmp_path / "gpt2", "-o", out, "--manifest", man)
    assert r.exit_code == 0, r.output
    state_dict, manifest = surgery.load_exported(str(out))
    model = cls(cfg).eval()
    model.load_state_dict(state_dict, strict=True)  # lm_head.weight is there
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits)
    assert manifest is not None
    assert bind_model(model, manifest).matches
    assert run("verify", out, "--manifest", out).exit_code == 0


def _unet_shared():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    m = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                              block_out_channels=(8, 16), norm_num_groups=4,
                              down_block_types=("DownBlock2D", "DownBlock2D"),
                              up_block_types=("UpBlock2D", "UpBlock2D"))
    # ALBERT-style sharing: one conv weight used at two depths of the network.
    m.up_blocks[0].resnets[0].conv2.weight = m.down_blocks[1].resnets[0].conv2.weight
    return m.eval()


def test_diffusers_model_with_a_shared_weight_binds(tmp_path) -> None:
    model = _unet_shared()
    with pytest.raises(RuntimeError, match="share memory"):  # why such a model uses save_model
        model.save_pretrained(tmp_path / "unet")
    path = tmp_path / "unet.safetensors"
    save_model(model, str(path))  # keeps one name of the shared pair
    plan = plan_checkpoint(str(path)).manifest
    assert live_ties(model) == {"up_blocks.0.resnets.0.conv2.weight":
                                "down_blocks.1.resnets.0.conv2.weight"}
    binding = bind_model(model, plan)
    assert binding.matches and "up_blocks.0.resnets.0.conv2.weight" in binding.notes[0]
    x, t = torch.randn(1, 3, 8, 8), torch.tensor([3])
    with torch.no_grad():
        want = model(x, t).sample
        with surgery.apply_manifest(model, plan, overrides=AOT,
                                    warmup=lambda m: m(x, t)) as handle:
            got = model(x, t).sample
    assert sum(r.compiled_runs for r in handle.report) > 0
    torch.testing.assert_close(got, want)


def test_an_untied_model_still_does_not_bind(tmp_path) -> None:
    """Leaving out aliases only helps where the names really share one tensor."""
    model = _unet_shared()
    path = tmp_path / "unet.safetensors"
    save_model(model, str(path))
    plan = plan_checkpoint(str(path)).manifest
    other = _unet_shared()
    other.up_blocks[0].resnets[0].conv2.weight = torch.nn.Parameter(
        other.up_blocks[0].resnets[0].conv2.weight.detach().clone())  # untied again
    with pytest.raises(FingerprintMismatchError, match="up_blocks"):
        bind_model(other, plan)


def test_a_hostile_tied_table_cannot_invent_tensors() -> None:
    table = {"a.weight": "A", "b.weight": "B"}
    out, restored = restore_ties(table, {"c.weight": "a.weight", "d.weight": "missing",
                                         "a.weight": "b.weight", 3: "a.weight",
                                         "e.weight": ["a.weight"]})
    assert restored == {"c.weight": "a.weight"}
    assert out == {**table, "c.weight": "A"}
    assert restore_ties(table, "not a table") == (table, {})
    assert list(binding_variants(table, {"zz": "a.weight"})) == []
