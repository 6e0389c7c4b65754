"""The warm-start benchmark's bytecode modes (benchmarks/_bytecode.py): what `--pyc` compiles,
and how a process's modules without bytecode are counted.

Issue 23's H200 warm start spent 2.27 s compiling torch's sources (the image has no .pyc); the
benchmark's figures with and without bytecode rest on these counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import _bytecode

# A child that imports the package's two modules and counts, with the benchmark's own rule,
# how many of the package's modules had no bytecode to load.
COUNT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import _bytecode
    t0 = _bytecode.process_start()
    import pkgx.mod, pkgx.lazy
    print(json.dumps({"missing": len(_bytecode.missing(["pkgx", "pkgx.mod", "pkgx.lazy"], t0)),
                      "prefix": sys.pycache_prefix}))
''')


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    """tmp_path/src/pkgx: __init__, mod (what discovery imports), lazy (what it does not)."""
    src = tmp_path / "src" / "pkgx"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("X = 1\n")
    (src / "mod.py").write_text("Y = 2\n")
    (src / "lazy.py").write_text("Z = 3\n")
    return tmp_path


def _env(pkg: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(pkg / "src")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    return env


def _count(pkg: Path, env: dict[str, str]) -> dict:
    run = subprocess.run([sys.executable, "-c", COUNT, os.path.dirname(_bytecode.__file__)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_compiled_mode_gives_every_module_of_an_imported_package_bytecode(pkg) -> None:
    """The package is compiled whole: its module the discovery process never imported
    (pkgx.lazy) has bytecode too, and the timed process compiles none of the three."""
    prefix = str(pkg / "pyc")
    done = _bytecode.compile_into(prefix, ["pkgx.mod"], _env(pkg), stdlib=False)
    assert "pkgx" in done["roots"] and done["py_files"] >= 3, done
    got = _count(pkg, _bytecode.env_for("compiled", prefix, _env(pkg)))
    assert got == {"missing": 0, "prefix": prefix}, got


def test_none_mode_has_no_bytecode_and_writes_none(pkg) -> None:
    prefix = str(pkg / "empty")
    env = _bytecode.env_for("none", prefix, _env(pkg))
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PYTHONPYCACHEPREFIX"] == prefix
    assert _count(pkg, env)["missing"] == 3
    assert not os.listdir(prefix)  # nothing written: the next process has none either
    with pytest.raises(ValueError, match="empty prefix"):
        (Path(prefix) / "x").write_text("")
        _bytecode.env_for("none", prefix, _env(pkg))


def test_bytecode_written_by_the_process_itself_counts_as_missing(pkg) -> None:
    """A process that may write bytecode compiles the modules, then finds its own .pyc: those
    were compiled in it all the same, and are counted."""
    env = {**_env(pkg), "PYTHONPYCACHEPREFIX": str(pkg / "fresh")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    assert _count(pkg, env)["missing"] == 3
    assert _count(pkg, env)["missing"] == 0  # the second process loads what the first wrote


def test_host_mode_changes_nothing_and_a_bad_mode_is_named() -> None:
    base = {"A": "1"}
    assert _bytecode.env_for("host", None, base) == base
    with pytest.raises(ValueError, match="bytecode mode 'pyc'"):
        _bytecode.env_for("pyc", None, base)
    with pytest.raises(ValueError, match="needs a prefix"):
        _bytecode.env_for("compiled", None, base)
