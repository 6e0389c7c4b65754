"""`surgery verify` and `surgery export` through the CLI: exit codes and what is printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from surgery.cli import cli
from surgery.examples import tiny
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import Manifest, Region, dumps_manifest

SD = tiny().state_dict()
REGIONAL = {k.replace("frame_blocks.0.", "frame_blocks.0._orig_mod."): v for k, v in SD.items()}


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def wrapped(tmp_path) -> str:
    path = str(tmp_path / "wrapped.pt")
    torch.save({"state_dict": {f"module.{k}": v for k, v in REGIONAL.items()}, "epoch": 3},
               path)
    return path


@pytest.fixture
def clean(tmp_path) -> str:
    path = str(tmp_path / "clean.safetensors")
    save_file(SD, path)
    return path


def test_verify_clean_exits_0(clean) -> None:
    r = run("verify", clean)
    assert r.exit_code == 0, r.output
    assert "OK: prefix-free" in r.output and "fingerprint v2:sha256:" in r.output


def test_verify_findings_grouped_exit_1(wrapped) -> None:
    r = run("verify", wrapped)
    assert r.exit_code == 1
    out = r.stdout
    assert "SG001 error: wrapper segment `_orig_mod.`" in out and "(12 keys)" in out
    assert "SG002 error: wrapper segment `module.`" in out and f"({len(SD)} keys)" in out
    assert "wrapper: torch.compile (OptimizedModule)" in out
    assert f"fix: surgery export {wrapped} -o " in out
    assert "--all lists every key" in out
    assert len(out.splitlines()) < 25  # grouped, not one line per key
    every = run("verify", wrapped, "--all").stdout
    assert sum("->" in ln for ln in every.splitlines()) >= len(SD) + 12


def test_verify_json(wrapped) -> None:
    r = run("verify", wrapped, "--json", "--all")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["entry"] == "state_dict" and data["clean"] is False
    codes = {f["code"]: f for f in data["findings"]}
    assert codes["SG001"]["count"] == 12 and len(codes["SG001"]["keys"]) == 12
    assert codes["SG002"]["wrapper"].startswith("DDP")


def test_export_then_verify_clean(wrapped, tmp_path) -> None:
    out = str(tmp_path / "deploy.safetensors")
    r = run("export", wrapped, "-o", out)
    assert r.exit_code == 0, r.output
    assert f"wrote {out}: {len(SD)} tensors" in r.stdout
    assert run("verify", out, "--deep").exit_code == 0
    again = run("export", wrapped, "-o", out)
    assert again.exit_code == 3 and "already exists" in again.output
    assert run("export", wrapped, "-o", out, "--force").exit_code == 0


def test_export_sharded_json(wrapped, tmp_path) -> None:
    out = str(tmp_path / "model.safetensors")
    r = run("export", wrapped, "-o", out, "--max-shard-size", "100KB", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["index"].endswith("model.safetensors.index.json") and len(data["files"]) > 1
    assert run("verify", data["index"]).exit_code == 0


@pytest.mark.parametrize("args,match", [
    pytest.param(["--max-shard-size", "lots"], "not a size", id="bad-size"),
    pytest.param([], "does not end in .safetensors", id="bad-suffix"),
])
def test_export_usage_errors_exit_2(wrapped, tmp_path, args, match) -> None:
    out = str(tmp_path / ("o.safetensors" if args else "o.pt"))
    r = run("export", wrapped, "-o", out, *args)
    assert r.exit_code == 2 and match in r.output


def test_manifest_checks(clean, tmp_path) -> None:
    good = tmp_path / "good.surgery.toml"
    good.write_text(dumps_manifest(Manifest(
        fingerprint=compute_fingerprint(SD),
        regions=[Region(kind="frame_block", paths=["aggregator.frame_blocks.0"])])))
    assert run("verify", clean, "--manifest", str(good)).exit_code == 0
    bad = tmp_path / "bad.surgery.toml"
    bad.write_text(dumps_manifest(Manifest(
        fingerprint="sha256:" + "1" * 64,
        regions=[Region(kind="frame_block", paths=["aggregator.fnn_blocks.0"])])))
    r = run("verify", clean, "--manifest", str(bad))
    assert r.exit_code == 1
    assert "SG101" in r.stdout and "SG102" in r.stdout and "aggregator.fnn_blocks.0" in r.stdout
    broken = tmp_path / "broken.surgery.toml"
    broken.write_text("[[region]\n")
    r = run("verify", clean, "--manifest", str(broken))
    assert r.exit_code == 3 and "not valid TOML" in r.output
    r = run("export", clean, "-o", str(tmp_path / "x.safetensors"), "--manifest", str(bad))
    assert r.exit_code == 3 and "different checkpoint" in r.output
    assert not (tmp_path / "x.safetensors").exists()


def test_collision_is_refused_listing_both(tmp_path) -> None:
    path = str(tmp_path / "both.pt")
    torch.save({**SD, **{f"module.{k}": v for k, v in SD.items()}}, path)
    r = run("verify", path)
    assert r.exit_code == 1 and "SG008" in r.stdout
    assert "head.bias + module.head.bias -> head.bias" in r.stdout or "SG008" in r.stdout
    r = run("export", path, "-o", str(tmp_path / "o.safetensors"))
    assert r.exit_code == 3
    assert "'aggregator.frame_blocks.0.attn.proj.bias' + " \
        "'module.aggregator.frame_blocks.0.attn.proj.bias'" in r.output
    assert not (tmp_path / "o.safetensors").exists()


def _damage(kind: str, path: Path) -> None:
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(os.urandom(2048))
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("command", ["verify", "export"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".ckpt"])
@pytest.mark.parametrize("kind", ["truncated", "empty", "garbage"])
def test_broken_files_one_line_error_exit_3(tmp_path, command, suffix, kind) -> None:
    path = tmp_path / f"m{suffix}"
    (save_file if suffix == ".safetensors" else torch.save)(SD, str(path))
    _damage(kind, path)
    args = [command, str(path)] + (["-o", str(tmp_path / "o.safetensors")]
                                   if command == "export" else [])
    r = run(*args)
    assert r.exit_code == 3, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith(f"error: {path}:")
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("  fix:"))
    assert not (tmp_path / "o.safetensors").exists()


def _evil(tmp_path: Path) -> tuple[str, Path]:
    marker = tmp_path / "PWNED"
    path = str(tmp_path / "evil.pt")
    subprocess.run([sys.executable, "-c", (
        "import torch\n"
        "class Payload:\n"
        "    def __reduce__(self):\n"
        f"        return (open, ({str(marker)!r}, 'w'))\n"
        f"torch.save({{'w': torch.zeros(2), 'x': Payload()}}, {path!r})\n")], check=True)
    return path, marker


@pytest.mark.parametrize("command", [
    pytest.param(["verify"], id="verify"),
    pytest.param(["verify", "--deep"], id="verify-deep"),
    pytest.param(["export", "-o", "OUT"], id="export"),
])
def test_malicious_pickle_refused_exit_3(tmp_path, command) -> None:
    path, marker = _evil(tmp_path)
    out = str(tmp_path / "o.safetensors")
    r = run(command[0], path, *[out if a == "OUT" else a for a in command[1:]])
    assert r.exit_code == 3
    assert "refused" in r.output and "io.open" in r.output
    assert "weights_only=False" not in r.output
    assert not marker.exists() and not os.path.exists(out)


def test_malicious_pickle_refused_by_plan(tmp_path) -> None:
    path, marker = _evil(tmp_path)
    r = run("plan", path, "-o", str(tmp_path / "m.surgery.toml"))
    assert r.exit_code == 3, r.output
    assert "refused" in r.output and "Traceback" not in r.output
    assert not marker.exists() and not (tmp_path / "m.surgery.toml").exists()


def test_verify_safetensors_cli_does_not_import_torch(tmp_path) -> None:
    path = str(tmp_path / "w.safetensors")
    save_file(REGIONAL, path)
    code = ("import sys\nfrom click.testing import CliRunner\nfrom surgery.cli import cli\n"
            f"r = CliRunner().invoke(cli, ['verify', {path!r}])\n"
            "assert r.exit_code == 1, r.output\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("args", [
    pytest.param(["verify", "{clean}"], id="verify-clean"),
    pytest.param(["verify", "{wrapped}"], id="verify-findings"),
    pytest.param(["verify", "{missing}"], id="verify-unreadable"),
    pytest.param(["plan", "{clean}", "-o", "{out}"], id="plan"),
    pytest.param(["plan", "{missing}", "-o", "{out}"], id="plan-unreadable"),
])
def test_the_paused_garbage_collector_comes_back(args, clean, wrapped, tmp_path) -> None:
    """plan and verify pause the cyclic GC while they read a header (issue 10's scale
    targets); a command that returns, finds problems or fails must leave it running, or every
    later command in the process (CliRunner, an embedding tool) would leak cycles."""
    import gc

    assert gc.isenabled()
    argv = [a.format(clean=clean, wrapped=wrapped, missing=tmp_path / "none.safetensors",
                     out=tmp_path / "m.surgery.toml") for a in args]
    r = run(*argv)
    assert r.exit_code in (0, 1, 3), r.output
    assert gc.isenabled()
