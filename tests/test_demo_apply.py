"""The deployment half of `make demo`: an exported file applies its embedded manifest."""

from __future__ import annotations

import pytest

from surgery.examples.demo import main, save_hand_compiled_checkpoint
from surgery.formats.manifest import save_manifest
from surgery.hygiene import export_checkpoint
from surgery.planning.plan import plan_checkpoint


@pytest.mark.usefixtures("fresh_dynamo")
def test_demo_applies_the_embedded_manifest(tmp_path, capsys) -> None:
    ckpt = str(tmp_path / "example.pt")
    save_hand_compiled_checkpoint(ckpt)
    manifest = str(tmp_path / "example.surgery.toml")
    save_manifest(plan_checkpoint(ckpt).manifest, manifest)
    out = str(tmp_path / "example.safetensors")
    export_checkpoint(ckpt, out=out, manifest=manifest)
    assert main([out]) == 0
    printed = capsys.readouterr().out
    assert "6 compiled, 0 pending, 0 eager" in printed
    assert "overrides over the manifest's [compile] (this is a CPU demo): {'backend': " \
        "'aot_eager', 'on_cpu': 'compile'}" in printed
    assert "CUDA-graph replays" in printed  # the report's table
    assert "state-dict keys unchanged" in printed


def test_demo_usage(capsys) -> None:
    assert main([]) == 2
