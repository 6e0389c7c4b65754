"""The wheel ships the schema inside the package, and the installed runtime finds it there."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_contains_schema_and_installed_lookup_uses_it(tmp_path) -> None:
    pytest.importorskip("hatchling")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(tmp_path / "dist"), ROOT], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("surgery-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "surgery/schemas/manifest.schema.json" in names
    assert "surgery/cli/app.py" in names and "surgery/runtime/graphs/replay.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)
    code = ("import surgery.formats.manifest as m, sys; p = m.schema_path(); "
            "assert str(p).startswith(sys.argv[1]), p; "
            "m.load_manifest(sys.argv[2])")
    env = {**os.environ, "PYTHONPATH": str(site)}
    manifest = os.path.join(ROOT, "manifests", "example-tiny.surgery.toml")
    subprocess.run([sys.executable, "-c", code, str(site), manifest], check=True, env=env,
                   cwd=tmp_path)
