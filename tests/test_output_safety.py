"""Output is safe to print (issue 22): keys and paths from a file are escaped, a closed pipe
ends quietly with 141, and error lines are cut (the full text stays under --json)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from surgery.cli import app
from surgery.errors import SurgeryError
from tests.capped import ROOT, surgery_capped


def _st(path: Path, keys: list[str]) -> None:
    header = {k: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i, k in enumerate(keys)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * len(keys)))


def test_a_newline_or_escape_in_a_key_cannot_forge_output(tmp_path: Path) -> None:
    f = tmp_path / "evil.safetensors"
    _st(f, ["_orig_mod.evil\nOK: prefix-free\x1b[2J.w", "_orig_mod.fine.w"])
    r = surgery_capped("verify", "--all", str(f))
    assert r.rc == 1, r.output
    assert "OK: prefix-free" not in r.stdout.splitlines()
    assert "\x1b" not in r.stdout
    assert "evil\\x0aOK: prefix-free\\x1b[2J" in r.stdout
    j = surgery_capped("verify", "--all", "--json", str(f))  # --json keeps the key exactly
    keys = [k for f in json.loads(j.stdout)["findings"] for k in f.get("keys", [])]
    assert "_orig_mod.evil\nOK: prefix-free\x1b[2J.w" in keys


def test_a_closed_pipe_ends_quietly_with_141(tmp_path: Path) -> None:
    f = tmp_path / "many.safetensors"
    _st(f, [f"_orig_mod.k{i}.w" for i in range(20_000)])
    p = subprocess.run(f"{sys.executable} -m surgery verify --all {f} {f} | head -1",
                       shell=True, capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                       executable="/bin/bash", timeout=120)
    assert p.stdout.startswith(str(f)), p.stdout
    assert p.stderr == "", p.stderr
    status = subprocess.run(f"{sys.executable} -m surgery verify --all {f} {f} | head -1 "
                            ">/dev/null; echo ${PIPESTATUS[0]}", shell=True,
                            capture_output=True, text=True, cwd=ROOT,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                            executable="/bin/bash", timeout=120)
    assert status.stdout.strip() == "141", status


def test_error_lines_are_one_line_and_cut(capsys) -> None:
    err = SurgeryError("key " + "x" * 600_000 + "\nOK: prefix-free", hint="h\x1b[2J")
    with pytest.raises(SystemExit) as info:
        app._fail(err)
    assert info.value.code == 3
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines[:3]
    assert all(len(ln) < 1200 for ln in lines)
    assert "more characters" in lines[0] and "\x1b" not in lines[1]
