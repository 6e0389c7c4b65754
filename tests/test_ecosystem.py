"""What other tools rely on: the pre-commit hooks, and the documented shape of --json output.

The hooks are run the way pre-commit runs them: ``entry + args + the staged files that match
``files``, in a fresh process. The --json outputs of plan, verify, export (and of any failure)
are checked against the JSON Schemas under schemas/, on real output.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import save_file

from surgery.cli import cli
from surgery.examples import tiny

ROOT = Path(__file__).resolve().parents[1]
SD = tiny().state_dict()
WRAPPED = {k.replace("frame_blocks.0.", "frame_blocks.0._orig_mod."): v for k, v in SD.items()}


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """A clean and a dirty checkpoint, a valid and a broken manifest, and a file no hook takes."""
    out = {"clean": tmp_path / "clean.safetensors", "dirty": tmp_path / "dirty.pth.tar",
           "valid": tmp_path / "good.surgery.toml", "broken": tmp_path / "bad.surgery.toml",
           "other": tmp_path / "notes.txt"}
    save_file(SD, str(out["clean"]))
    torch.save({"state_dict": WRAPPED, "epoch": 1}, out["dirty"])
    assert run("plan", out["clean"], "-o", out["valid"]).exit_code == 0
    out["broken"].write_text(out["valid"].read_text().replace("schema_version = 1",
                                                              "schema_version = 7"))
    out["other"].write_text("not a checkpoint")
    return out


# --- pre-commit -----------------------------------------------------------------------------------


def _hooks() -> dict[str, dict]:
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert isinstance(hooks, list)
    return {h["id"]: h for h in hooks}


def _run_hook(hook: dict, staged: list[Path]) -> subprocess.CompletedProcess[str]:
    """As pre-commit does: keep the staged files `files` matches, append them to the entry."""
    pattern = re.compile(hook["files"])
    chosen = [str(p) for p in staged if pattern.search(str(p))]
    argv = shlex.split(hook["entry"]) + list(hook.get("args", [])) + chosen
    assert argv[0] == "surgery"  # the console script; run this checkout's copy of it
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "surgery", *argv[1:]], capture_output=True,
                          text=True, env=env, cwd=ROOT)


def test_hook_definitions() -> None:
    hooks = _hooks()
    assert set(hooks) == {"surgery-verify", "surgery-check"}
    for h in hooks.values():
        assert {"id", "name", "entry", "language", "files"} <= set(h)
        assert h["language"] == "python"
    verify = re.compile(hooks["surgery-verify"]["files"])
    for name in ("a.safetensors", "a.pt", "a.pth", "ckpt/a.pth.tar", "a.ckpt",
                 "pytorch_model.bin"):
        assert verify.search(name), name
    for name in ("a.txt", "a.surgery.toml", "a.safetensors.index.json", "a.ptx"):
        assert not verify.search(name), name
    check = re.compile(hooks["surgery-check"]["files"])
    assert check.search("m/model.surgery.toml") and not check.search("pyproject.toml")


def test_verify_hook_passes_clean_and_fails_dirty(files) -> None:
    hook = _hooks()["surgery-verify"]
    ok = _run_hook(hook, [files["clean"], files["other"], files["valid"]])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK: prefix-free" in ok.stdout and "notes.txt" not in ok.stdout + ok.stderr
    bad = _run_hook(hook, [files["clean"], files["dirty"]])
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "SG001 error" in bad.stdout and "OK: prefix-free" in bad.stdout  # both were checked


def test_check_hook_passes_valid_and_fails_broken(files) -> None:
    hook = _hooks()["surgery-check"]
    ok = _run_hook(hook, [files["valid"], files["clean"]])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{files['valid']}: valid" in ok.stdout
    bad = _run_hook(hook, [files["broken"], files["valid"]])
    assert bad.returncode == 3, bad.stdout + bad.stderr
    assert "schema_version" in bad.stderr and f"{files['valid']}: valid" in bad.stdout


def test_unreadable_file_among_several_is_exit_3_and_the_rest_still_checked(files) -> None:
    garbage = files["clean"].with_name("garbage.pt")
    garbage.write_bytes(b"garbage\n")
    r = run("verify", files["clean"], garbage, files["dirty"])
    assert r.exit_code == 3, r.output
    assert "OK: prefix-free" in r.stdout and "SG001 error" in r.stdout
    assert "garbage.pt" in r.stderr
    assert run("verify", files["clean"], files["dirty"], "--json").exit_code == 2


# --- --json output schemas -----------------------------------------------------------------------


def _schema(name: str) -> dict:
    return json.loads((ROOT / "schemas" / f"{name}-output.schema.json").read_text())


def _check(name: str, result, *, exit_code: int) -> dict:
    assert result.exit_code == exit_code, result.output
    doc = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(_schema(name))
    jsonschema.validate(doc, _schema(name), cls=jsonschema.Draft202012Validator)
    return doc


def test_plan_json_follows_its_schema(files, tmp_path) -> None:
    doc = _check("plan", run("plan", files["dirty"], "-o", tmp_path / "d.toml", "--json"),
                 exit_code=0)
    assert doc["needs_export"] > 0 and doc["notes"]
    _check("plan", run("plan", "--model", "surgery.examples:tiny", "-o", tmp_path / "l.toml",
                       "--json"), exit_code=0)


def test_verify_json_follows_its_schema(files) -> None:
    clean = _check("verify", run("verify", files["clean"], "--json", "--manifest",
                                 files["valid"], "--deep"), exit_code=0)
    assert clean["clean"] is True
    dirty = _check("verify", run("verify", files["dirty"], "--json", "--all"), exit_code=1)
    assert dirty["clean"] is False and dirty["findings"][0]["code"] == "SG001"
    assert dirty["findings"][0]["keys"]


def test_export_json_follows_its_schema(files, tmp_path) -> None:
    one = _check("export", run("export", files["dirty"], "-o", tmp_path / "one.safetensors",
                               "--json"), exit_code=0)
    assert one["index"] is None and one["renamed"] > 0
    sharded = _check("export", run("export", files["dirty"], "-o", tmp_path / "s.safetensors",
                                   "--max-shard-size", "20KB", "--json"), exit_code=0)
    assert sharded["index"].endswith(".index.json") and len(sharded["files"]) > 1


def test_error_json_follows_its_schema(files, tmp_path) -> None:
    _check("error", run("verify", tmp_path / "missing.pt", "--json"), exit_code=3)
    _check("error", run("plan", "--json"), exit_code=2)
    _check("error", run("check", files["broken"], "--json"), exit_code=3)


def test_schemas_reject_what_they_should() -> None:
    """The schemas are not vacuous: a report missing `clean`, or a finding with a made-up code,
    does not validate."""
    report = {"path": "a", "format": "safetensors", "entry": None, "prefix": None, "tensors": 1,
              "fingerprint": None, "manifest": None, "deep": False, "clean": True,
              "findings": [{"code": "SG001", "severity": "error", "title": "t", "wrapper": None,
                            "count": 1, "examples": [], "fix": "f"}]}
    jsonschema.validate(report, _schema("verify"))
    for broken in ({k: v for k, v in report.items() if k != "clean"},
                   {**report, "format": "zip"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, _schema("verify"))
    bad_code = copy.deepcopy(report)
    bad_code["findings"][0]["code"] = "E42"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_code, _schema("verify"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"error": {"code": "X", "message": "m", "hint": None}},
                            _schema("error"))


# --- the install (issue 12, friction 4) -----------------------------------------------------------


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make (the set-up path uses it)")
def test_demo_installs_only_what_it_needs_and_says_so(tmp_path) -> None:
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        (tmp_path / name).write_text((ROOT / name).read_text())

    def dry(target: str) -> list[str]:
        p = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()

    demo = dry("demo")
    pips = [i for i, ln in enumerate(demo) if "pip install" in ln]
    assert pips and not any("[dev]" in demo[i] for i in pips)  # no pytest/ruff/mypy/build
    for i in pips:  # every pip step is announced, and none is silenced
        assert " -q" not in demo[i]
        assert any(ln.lstrip().startswith("echo \"== installing") for ln in demo[i - 2:i])
    assert any("[dev]" in ln for ln in dry("test"))


def test_readme_tables_list_every_code() -> None:
    """The README's finding-code table names every code verify can emit, and its error table
    every SurgeryError the CLI can print as error.code."""
    import inspect

    from surgery import errors
    from surgery.formats.keys import CODES

    readme = (ROOT / "README.md").read_text()
    for code in CODES:
        assert f"| {code} |" in readme, code
    for name, obj in vars(errors).items():
        if inspect.isclass(obj) and issubclass(obj, errors.SurgeryError):
            assert f"| `{name}` |" in readme, name
