"""The CLI's error mapping: an unexpected exception is exit 3 and one line, never exit 1
(which means findings and nothing else) and never a traceback, unless SURGERY_DEBUG=1."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

import surgery.formats.source
import surgery.hygiene
import surgery.planning.plan
from surgery.cli import cli

CASES = [
    pytest.param(RuntimeError("boom\nsecond line of a long story"), id="RuntimeError"),
    pytest.param(RecursionError("maximum recursion depth exceeded"), id="RecursionError"),
    pytest.param(OverflowError("cannot convert float infinity to integer"), id="OverflowError"),
    pytest.param(ValueError("x" * 5000), id="ValueError-long"),
    pytest.param(KeyError("weight"), id="KeyError"),
    pytest.param(AssertionError(), id="AssertionError-empty"),
]

# (command line, module attribute the command calls): one library call per command.
COMMANDS = [
    pytest.param(["verify", "{f}"], (surgery.hygiene, "verify_checkpoint"), id="verify"),
    pytest.param(["export", "{f}", "-o", "{d}/o.safetensors"],
                 (surgery.hygiene, "export_checkpoint"), id="export"),
    pytest.param(["plan", "{f}", "-o", "{d}/m.surgery.toml"],
                 (surgery.planning.plan, "plan_checkpoint"), id="plan"),
    pytest.param(["check", "{f}"], (surgery.formats.source, "load_manifest_file"), id="check"),
]


def invoke(args: list[str], tmp_path) -> object:
    f = tmp_path / "input.safetensors"
    f.write_bytes(b"")
    argv = [a.format(f=f, d=tmp_path) for a in args]
    return CliRunner().invoke(cli, argv)


@pytest.mark.parametrize("exc", CASES)
@pytest.mark.parametrize("args,target", COMMANDS)
def test_unexpected_exception_is_exit_3_one_line(tmp_path, monkeypatch, exc, args, target
                                                  ) -> None:
    def boom(*a: object, **k: object) -> None:
        raise exc

    monkeypatch.setattr(*target, boom)
    monkeypatch.delenv("SURGERY_DEBUG", raising=False)
    r = invoke(args, tmp_path)
    assert r.exit_code == 3, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"internal error, {type(exc).__name__}" in lines[0]
    assert "please report it" in lines[0] and "SURGERY_DEBUG=1" in lines[0]
    assert len(lines[0]) < 400
    assert "Traceback" not in r.output and r.stdout == ""


def test_surgery_debug_shows_the_traceback(tmp_path, monkeypatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(surgery.hygiene, "verify_checkpoint", boom)
    monkeypatch.setenv("SURGERY_DEBUG", "1")
    r = invoke(["verify", "{f}"], tmp_path)
    assert r.exit_code == 3
    assert "Traceback (most recent call last)" in r.stderr and "in boom" in r.stderr


def test_memory_error_is_exit_3(tmp_path, monkeypatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise MemoryError()

    monkeypatch.setattr(surgery.hygiene, "verify_checkpoint", boom)
    r = invoke(["verify", "{f}"], tmp_path)
    assert r.exit_code == 3 and r.stderr.strip() == "error: out of memory"


def test_usage_errors_stay_exit_2(tmp_path) -> None:
    r = invoke(["export", "{f}", "-o", "{d}/o.bin"], tmp_path)
    assert r.exit_code == 2 and "does not end in .safetensors" in r.output


def test_deep_json_header_is_not_a_finding(tmp_path) -> None:
    """A 100k-deep JSON header: whatever the reader makes of it, verify must say "could not
    run" (3) in one line, never "findings" (1) or a traceback."""
    raw = (b"[" * 100_000) + (b"]" * 100_000)
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    r = CliRunner().invoke(cli, ["verify", str(path)])
    assert r.exit_code == 3, r.output
    assert len(r.stderr.strip().splitlines()) <= 2  # the error, and its fix line if any
    assert "Traceback" not in r.output


def test_help_documents_exit_codes() -> None:
    r = CliRunner().invoke(cli, ["--help"])
    for code in ("1  findings", "3  could not run", "internal error", "143"):
        assert code in r.output, code


def test_findings_are_still_exit_1(tmp_path) -> None:
    path = str(tmp_path / "w.safetensors")
    save_file({"module.w": np.zeros(2, dtype=np.float32)}, path)
    r = CliRunner().invoke(cli, ["verify", path, "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["findings"]
