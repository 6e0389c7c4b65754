"""`surgery bytecode` (surgery.runtime.bytecode): a warm start's imports byte-compiled, once, into a
private folder the deployer names, which an interpreter that writes no bytecode then reads.

The compile runs on a small stdlib module list (the default list is torch's loader: minutes on
these CPUs; benchmarks/gpu_warm_start.py --pyc surgery runs it whole). The folder checks are
surgery.runtime.private_dirs's, tested with the bundle's folders in test_bundle_attacker.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from surgery.cli import cli
from surgery.errors import BytecodeFolderError
from surgery.runtime import bytecode

SMALL = ("email.mime.text", "json")  # stdlib modules that import a few dozen more

# A fresh interpreter that writes no bytecode: which of the modules it imports for SMALL had no
# .pyc to read where Python looks (with a prefix set: only under the prefix).
_READS = textwrap.dedent("""
    import importlib, importlib.util, json, os, sys
    before = set(sys.modules)
    for name in sys.argv[1:]:
        importlib.import_module(name)
    new = [m for n, m in list(sys.modules.items()) if n not in before]
    files = [m.__file__ for m in new if str(getattr(m, "__file__", "")).endswith(".py")]
    missing = [f for f in files if not os.path.exists(importlib.util.cache_from_source(f))]
    print(json.dumps({"files": len(files), "missing": missing}))
""")


def _reads(prefix: str) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", bytecode.PREFIX_ENV: prefix}
    run = subprocess.run([sys.executable, "-c", _READS, *SMALL], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_deployment_reads_every_module_from_the_compiled_folder(tmp_path) -> None:
    folder = tmp_path / "pyc"
    assert _reads(str(folder))["missing"]  # an empty prefix: nothing to read (the image's case)
    result = bytecode.compile_bytecode(str(folder), modules=SMALL)
    assert result.files > 10 and result.failed == 0, result
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # made private
    got = _reads(str(folder))
    assert got["files"] > 10 and got["missing"] == [], got["missing"][:5]
    written = [p for p in folder.rglob("*") if p.is_file()]
    assert written and all(p.suffix == ".pyc" for p in written)  # the listing is gone


def test_nothing_is_written_outside_the_folder(tmp_path) -> None:
    """A package of the caller's (on the path, never byte-compiled) gets no __pycache__."""
    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import json\nVALUE = 1\n")
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "src"), old])
    try:
        result = bytecode.compile_bytecode(str(tmp_path / "pyc"), modules=("mypkg",))
    finally:
        os.environ["PYTHONPATH"] = old
    assert result.files >= 2
    assert not (pkg / "__pycache__").exists()
    assert list((tmp_path / "pyc").rglob("__init__*.pyc"))


def test_a_folder_others_can_write_is_refused_before_anything_runs(tmp_path, monkeypatch
                                                                   ) -> None:
    ran: list[str] = []
    monkeypatch.setattr(bytecode, "discover_files", lambda *a, **k: ran.append("x") or [])
    open_folder = tmp_path / "shared"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(BytecodeFolderError, match="writable by others"):
        bytecode.compile_bytecode(str(open_folder), modules=SMALL)
    r = CliRunner().invoke(cli, ["bytecode", str(open_folder)])
    assert r.exit_code == 3, r.output
    assert "writable by others" in r.output and "chmod 700" in r.output
    assert ran == [] and list(open_folder.iterdir()) == []


def test_the_cli_compiles_and_says_how_to_deploy(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bytecode, "WARM_PATH_MODULES", SMALL)
    real = bytecode.compile_bytecode

    def small(folder: str, **kw: object) -> bytecode.BytecodeResult:
        return real(folder, modules=SMALL, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bytecode, "compile_bytecode", small)
    r = CliRunner().invoke(cli, ["bytecode", str(tmp_path / "pyc"), "--import", "csv"])
    assert r.exit_code == 0, r.output
    assert f"PYTHONPYCACHEPREFIX={tmp_path / 'pyc'}" in r.output
    assert list((tmp_path / "pyc").rglob("csv*.pyc"))  # the --import module's too
    r = CliRunner().invoke(cli, ["bytecode", str(tmp_path / "pyc"), "--import", "os; rm"])
    assert r.exit_code == 2 and "not a dotted module name" in r.output


def test_a_child_that_hangs_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch) -> None:
    """A discovery interpreter past the time limit: BytecodeFolderError (exit 3 at the CLI)
    naming the stage and the limit, and the folder holds nothing it wrote."""
    monkeypatch.setattr(bytecode, "_TIMEOUT_S", 0.01)
    folder = tmp_path / "pyc"
    with pytest.raises(BytecodeFolderError, match="discovery interpreter did not finish"):
        bytecode.compile_bytecode(str(folder), modules=("json",))
    assert list(folder.iterdir()) == []
