"""Exports written by earlier surgery releases keep loading: the export metadata is a contract.

`tests/golden/exports/<layout>/` holds a tiny export (single file and sharded) of each metadata
layout ever written, made by that code with `make_export.py`:
- `v1`: the original keys `surgery.manifest` / `surgery.source` (commit 2a6e56c, and again now);
- `v2`: `surgery.formats.manifest` / `surgery.formats.source`, written for one day after the
  restructure renamed them along with the module paths (commit 5775d56).
These files are never regenerated: a reader change that stops loading one is a format break.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from click.testing import CliRunner

import surgery
from surgery.cli import cli
from surgery.formats import tensors as meta
from surgery.formats.checkpoint import read_embedded_manifest

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "exports")
LAYOUTS = [
    pytest.param(os.path.join(GOLDEN, "v1", "tiny.safetensors"), id="v1-file"),
    pytest.param(os.path.join(GOLDEN, "v1", "sharded", "tiny.safetensors.index.json"),
                 id="v1-sharded"),
    pytest.param(os.path.join(GOLDEN, "v2", "tiny.safetensors"), id="v2-file"),
    pytest.param(os.path.join(GOLDEN, "v2", "sharded", "tiny.safetensors.index.json"),
                 id="v2-sharded"),
]


def _tiny_model() -> torch.nn.Module:
    """The model the golden exports hold: the classes of make_export.py (its tail exports)."""
    with open(os.path.join(GOLDEN, "make_export.py")) as f:
        src = f.read()
    namespace: dict[str, object] = {}
    exec(compile(src.split('if __name__ == "__main__":')[0], "make_export.py", "exec"), namespace)
    return namespace["Tiny"]()  # type: ignore[operator]


def test_metadata_keys_are_the_documented_strings() -> None:
    """The constants are the format: a rename (e.g. following a module move) fails here."""
    assert meta.META_MANIFEST == "surgery.manifest"
    assert meta.META_SOURCE == "surgery.source"
    assert meta.META_MANIFEST_SHA256 == "surgery.manifest_sha256"
    assert meta.META_FINGERPRINT == "surgery.fingerprint"
    assert meta.META_ALIASES == "surgery.aliases"
    assert meta.META_DROPPED == "surgery.dropped"
    assert meta.META_VERSION == "surgery.version"
    assert meta.META_MANIFEST_KEYS == ("surgery.manifest", "surgery.formats.manifest")
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        readme = f.read()
    for key in ("surgery.manifest", "surgery.source", "surgery.manifest_sha256",
                "surgery.fingerprint", "surgery.aliases", "surgery.dropped", "surgery.version",
                "surgery.formats.manifest", "surgery.formats.source"):
        assert f"`{key}`" in readme, key


@pytest.mark.parametrize("path", LAYOUTS)
def test_every_layout_loads(path: str) -> None:
    manifest = read_embedded_manifest(path)
    assert manifest is not None, f"{path}: its embedded manifest is no longer found"
    state_dict, embedded = surgery.load_exported(path)
    assert embedded is not None and embedded.fingerprint == manifest.fingerprint
    model = _tiny_model()
    model.load_state_dict(state_dict, strict=True)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    runner = CliRunner()
    res = runner.invoke(cli, ["verify", path, "--manifest", path])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["check", path])
    assert res.exit_code == 0, res.output


def test_a_new_export_writes_the_current_keys(tmp_path) -> None:
    src = os.path.join(GOLDEN, "v1", "tiny.safetensors")
    out = str(tmp_path / "again.safetensors")
    res = CliRunner().invoke(cli, ["export", src, "-o", out, "--manifest", src])
    assert res.exit_code == 0, res.output
    with open(out, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    keys = set(header["__metadata__"])
    assert {"surgery.manifest", "surgery.source", "surgery.fingerprint"} <= keys
    assert not keys & {"surgery.formats.manifest", "surgery.formats.source"}
