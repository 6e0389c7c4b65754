"""What a new user hits with checkpoints from the wild (issue 12): each test is one reproduction.

Lightning `--prefix` round trips, timm's `.pth.tar` with optimizer state, save_pretrained
folders, `--format`, JSON errors, `--fold` that folds nothing, notes under `-o -`, and
`surgery.load_exported`.
"""

from __future__ import annotations

import json
import os

import pytest
import tomllib
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import surgery
from surgery.cli import cli
from surgery.examples import tiny

SD = tiny().state_dict()


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _lightning(tmp_path) -> str:
    path = str(tmp_path / "lightning.ckpt")
    torch.save({"state_dict": {f"model.{k}": v for k, v in SD.items()}, "epoch": 3}, path)
    return path


# --- defect 1: verify of an export made with --prefix -----------------------------------------


def test_verify_of_prefix_export_needs_no_prefix(tmp_path) -> None:
    ckpt, m, out = _lightning(tmp_path), tmp_path / "m.surgery.toml", tmp_path / "out.safetensors"
    assert run("plan", ckpt, "--prefix", "model.", "-o", m).exit_code == 0
    r = run("export", ckpt, "--prefix", "model.", "--manifest", m, "-o", out)
    assert r.exit_code == 0, r.output
    r = run("verify", out, "--manifest", m)
    assert r.exit_code == 0, r.output
    assert "OK: prefix-free, manifest matches" in r.stdout
    assert "prefix 'model.'" not in r.stdout  # the export's keys are not stripped again
    # The training checkpoint itself still takes the manifest's prefix without being told.
    r = run("verify", ckpt, "--manifest", m)
    assert r.exit_code == 0, r.output
    assert "prefix 'model.'" in r.stdout
    # A file the user stripped themselves (no export metadata) matches by fingerprint.
    own = tmp_path / "own.safetensors"
    save_file(SD, str(own))
    r = run("verify", own, "--manifest", m)
    assert r.exit_code == 0, r.output
    # Exporting the export again with the manifest does not strip it either.
    r = run("export", out, "--manifest", m, "-o", tmp_path / "again.safetensors")
    assert r.exit_code == 0, r.output


# --- defect 3 and 11: timm's .pth.tar, --format, optimizer state --------------------------------


def _timm_train_checkpoint(path) -> int:
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.save({"epoch": 4, "arch": "tiny", "state_dict": model.state_dict(),
                "optimizer": opt.state_dict(), "version": 2, "metric": 0.5}, path)
    return len(opt.state_dict()["state"])


def test_plan_pth_tar_with_optimizer_state(tmp_path) -> None:
    ckpt = tmp_path / "checkpoint.pth.tar"
    n = _timm_train_checkpoint(ckpt)
    r = run("plan", ckpt)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "checkpoint.surgery.toml").exists()  # named without .pth.tar
    assert f"note: optimizer state ({n} entries) in 'optimizer', ignored" in r.stderr
    assert "optimizer/state" not in r.output and "other state dicts" not in r.output
    assert "used the state dict in entry 'state_dict'" in r.stderr
    assert "ignored non-tensor entries: arch, epoch, metric, version" in r.stderr
    assert run("verify", ckpt).exit_code == 0
    out = tmp_path / "clean.safetensors"
    r = run("export", ckpt, "-o", out)
    assert r.exit_code == 0, r.output
    assert json.loads(run("verify", out, "--json").stdout)["tensors"] == len(SD)


def test_format_names_a_file_whose_suffix_does_not(tmp_path) -> None:
    weights = tmp_path / "weights.data"
    torch.save(SD, weights)
    r = run("plan", weights)
    assert r.exit_code == 3
    assert "unknown checkpoint type '.data'" in r.stderr and "--format" in r.stderr
    r = run("plan", weights, "--format", "torch", "-o", tmp_path / "w.surgery.toml")
    assert r.exit_code == 0, r.output
    assert run("verify", weights, "--format", "torch").exit_code == 0
    st = tmp_path / "weights.st"
    save_file(SD, str(st))
    r = run("verify", st, "--format", "safetensors", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["format"] == "safetensors"
    # Named wrong, it is refused as what it was said to be, not guessed.
    r = run("verify", weights, "--format", "safetensors")
    assert r.exit_code == 3 and "not a valid safetensors file" in r.stderr
    assert run("verify", weights, "--format", "onnx").exit_code == 2


# --- defect 4: save_pretrained folders -----------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "diffusion_pytorch_model.safetensors",
                                  "pytorch_model.bin"])
def test_save_pretrained_folder_just_works(tmp_path, name) -> None:
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if name.endswith(".bin"):
        torch.save(SD, folder / name)
    else:
        save_file(SD, str(folder / name))
    r = run("plan", folder)
    assert r.exit_code == 0, r.output
    stem = name.split(".")[0]
    assert (folder / f"{stem}.surgery.toml").exists()
    assert f"using {folder / name}" in r.stderr
    r = run("verify", folder, "--manifest", folder / f"{stem}.surgery.toml")
    assert r.exit_code == 0, r.output
    assert str(folder / name) in r.stdout
    r = run("export", folder, "-o", tmp_path / "out.safetensors")
    assert r.exit_code == 0, r.output


def test_sharded_folder_and_preference(tmp_path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    r = run("export", _lightning(tmp_path), "--prefix", "model.", "--max-shard-size", "20KB",
            "-o", folder / "model.safetensors")
    assert r.exit_code == 0, r.output
    assert (folder / "model.safetensors.index.json").exists()
    r = run("verify", folder, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["path"] == str(folder / "model.safetensors.index.json")
    # safetensors wins over pickle weights beside it, as in transformers.
    both = tmp_path / "both"
    both.mkdir()
    save_file(SD, str(both / "model.safetensors"))
    torch.save(SD, both / "pytorch_model.bin")
    r = run("verify", both)
    assert r.exit_code == 0, r.output
    assert "(not pytorch_model.bin)" in r.stderr


def test_ambiguous_or_empty_folder_is_refused_with_candidates(tmp_path) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    save_file(SD, str(folder / "model.safetensors"))
    save_file(SD, str(folder / "diffusion_pytorch_model.safetensors"))
    for cmd in (["plan", folder], ["verify", folder],
                ["export", folder, "-o", tmp_path / "o.safetensors"]):
        r = run(*cmd)
        assert r.exit_code == 3, r.output
        assert "diffusion_pytorch_model.safetensors, model.safetensors" in r.stderr
        assert "fix: give the file itself" in r.stderr
    assert sorted(os.listdir(folder)) == ["diffusion_pytorch_model.safetensors",
                                          "model.safetensors"]
    assert not (tmp_path / "o.safetensors").exists()
    r = run("plan", tmp_path / "no-such-folder")  # not "unknown checkpoint type"
    assert r.exit_code == 3 and "no-such-folder: no such file or folder" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run("verify", empty)
    assert r.exit_code == 3 and "a folder with no checkpoint in it" in r.stderr


# --- defect 6: --json errors ---------------------------------------------------------------------


@pytest.mark.parametrize(("args", "code", "exit_code"), [
    pytest.param(["verify", "{tmp}/missing.pt", "--json"], "CheckpointError", 3, id="missing"),
    pytest.param(["plan", "--json"], "UsageError", 2, id="usage"),
    pytest.param(["plan", "--model", "nodots", "--json"], "UsageError", 2, id="bad-param"),
    pytest.param(["check", "{tmp}/nope.surgery.toml", "--json"], "ManifestError", 3,
                 id="manifest"),
    pytest.param(["export", "{tmp}/missing.pt", "-o", "{tmp}/o.safetensors", "--json"],
                 "CheckpointError", 3, id="export"),
])
def test_json_errors_are_json_on_stdout(tmp_path, args, code, exit_code) -> None:
    r = run(*(a.format(tmp=tmp_path) for a in args))
    assert r.exit_code == exit_code, r.output
    err = json.loads(r.stdout)["error"]
    assert err["code"] == code and err["exit_code"] == exit_code
    assert err["message"] and "Traceback" not in r.output
    assert err["message"].splitlines()[0] in r.stderr  # the human line stays on stderr


def test_errors_without_json_keep_stdout_empty(tmp_path) -> None:
    r = run("verify", tmp_path / "missing.pt")
    assert r.exit_code == 3 and r.stdout == ""
    assert "no such file" in r.stderr


# --- defect 7: an export as the manifest --------------------------------------------------------


def test_check_and_verify_take_an_export_as_the_manifest(tmp_path, monkeypatch) -> None:
    ckpt, m, out = _lightning(tmp_path), tmp_path / "m.surgery.toml", tmp_path / "out.safetensors"
    assert run("plan", ckpt, "--prefix", "model.", "-o", m).exit_code == 0
    assert run("export", ckpt, "--manifest", m, "-o", out).exit_code == 0
    r = run("check", out)
    assert r.exit_code == 0, r.output
    assert f"{out}: valid" in r.stdout
    r = run("verify", out, "--manifest", out)
    assert r.exit_code == 0, r.output
    assert "manifest matches" in r.stdout
    r = run("verify", ckpt, "--manifest", out)  # the export's manifest, against its source
    assert r.exit_code == 0, r.output
    # An export without an embedded manifest says so.
    bare = tmp_path / "bare.safetensors"
    save_file(SD, str(bare))
    r = run("check", bare)
    assert r.exit_code == 3 and "carries no embedded surgery manifest" in r.stderr


def test_check_of_an_export_does_not_import_torch(tmp_path) -> None:
    import subprocess
    import sys

    ckpt, m, out = _lightning(tmp_path), tmp_path / "m.surgery.toml", tmp_path / "out.safetensors"
    assert run("plan", ckpt, "--prefix", "model.", "-o", m).exit_code == 0
    assert run("export", ckpt, "--manifest", m, "-o", out).exit_code == 0
    code = ("import sys\nfrom surgery.cli import main\nsys.argv = ['surgery', 'verify', "
            f"{str(out)!r}, '--manifest', {str(out)!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nsys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.getcwd())
    assert p.returncode == 0, p.stdout + p.stderr


# --- defect 8: --fold that folds nothing --------------------------------------------------------


def test_fold_says_when_nothing_folds(tmp_path) -> None:
    timm_like = {f"blocks.{i}.{n}.weight": torch.zeros(8, 8) for i in range(4)
                 for n in ("attn.qkv", "mlp.fc1")}
    path = tmp_path / "vit.safetensors"
    save_file(timm_like, str(path))
    r = run("plan", path, "--fold")
    assert r.exit_code == 0, r.output
    assert "note: --fold folded nothing" in r.stderr
    assert "--fold folded nothing" in " ".join(json.loads(
        run("plan", path, "--fold", "--json", "--force").stdout)["notes"])
    r = run("plan", path, "--force")  # no --fold, no note
    assert "folded nothing" not in r.output
    r = run("plan", "--model", "surgery.examples:tiny", "--fold", "-o", tmp_path / "t.toml")
    assert r.exit_code == 0, r.output
    assert "folded nothing" not in r.output  # the example model's patch_embed folds


# --- defect 9: notes under -o - ---------------------------------------------------------------


def test_plan_to_stdout_keeps_notes_on_stderr(tmp_path) -> None:
    r = run("plan", _lightning(tmp_path), "-o", "-")
    assert r.exit_code == 0, r.output
    doc = tomllib.loads(r.stdout)  # stdout is the manifest and nothing else
    assert doc["region"]
    assert "note: used the state dict in entry 'state_dict'" in r.stderr
    assert "--prefix model." in r.stderr
    assert run("plan", _lightning(tmp_path), "-o", "-", "--json").exit_code == 2


# --- defect 10: a malformed factory spec is a usage error ---------------------------------------


@pytest.mark.parametrize("argv", [
    pytest.param(["plan", "--model", "mypkg.factories"], id="plan-model"),
    pytest.param(["plan", "--model", ":build"], id="plan-no-module"),
    pytest.param(["warm", "--model", "mypkg.factories", "--manifest", "m.toml", "--input",
                  "a:b"], id="warm-model"),
    pytest.param(["warm", "--model", "a:b", "--manifest", "m.toml", "--input", "mypkg.inputs"],
                 id="warm-input"),
])
def test_factory_without_colon_is_usage_error(argv) -> None:
    r = run(*argv)
    assert r.exit_code == 2, r.output
    assert "is not PKG.MOD:FACTORY" in r.stderr and "Traceback" not in r.output


# --- friction 3: surgery.load_exported ------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_load_exported_returns_state_dict_and_manifest(tmp_path, shard) -> None:
    ckpt, m = _lightning(tmp_path), tmp_path / "m.surgery.toml"
    assert run("plan", ckpt, "--prefix", "model.", "-o", m).exit_code == 0
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    extra = ["--max-shard-size", shard] if shard else []
    assert run("export", ckpt, "--manifest", m, "-o", out, *extra).exit_code == 0
    target = out.parent / "model.safetensors.index.json" if shard else out
    sd, manifest = surgery.load_exported(target)
    assert set(sd) == set(SD)
    assert all(torch.equal(sd[k], SD[k]) for k in SD)
    assert manifest is not None and manifest.fingerprint == tomllib.loads(m.read_text())[
        "model"]["fingerprint"]
    model = tiny()
    model.load_state_dict(sd, strict=True)
    # The folder works too, and an export without a manifest gives None.
    assert set(surgery.load_exported(out.parent).state_dict) == set(SD)
    bare = tmp_path / "bare.safetensors"
    save_file(SD, str(bare))
    assert surgery.load_exported(bare).manifest is None
    with pytest.raises(surgery.SurgeryError, match="not a safetensors export"):
        surgery.load_exported(ckpt)
