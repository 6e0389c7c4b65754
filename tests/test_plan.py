"""`surgery plan` and `surgery check`: library and CLI, golden manifests, LingBot size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from surgery.cli import cli
from surgery.examples import tiny
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import load_manifest
from surgery.planning.plan import compile_defaults, default_output, plan_checkpoint, plan_model

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_golden import golden_texts  # noqa: E402


def _kinds(manifest) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in manifest.regions:
        out[r.kind] = out.get(r.kind, 0) + len(r.paths)
    return out


def _save_tiny(path, *, wrap=None) -> dict:
    sd = tiny().state_dict()
    if wrap is not None:
        sd = {wrap(k): v for k, v in sd.items()}
    if str(path).endswith(".safetensors"):
        save_file(sd, str(path))
    else:
        torch.save(sd, path)
    return sd


def test_golden_manifests_are_current() -> None:
    """`make golden` regenerates these; a diff here is a change in what plan writes."""
    for name, text in golden_texts().items():
        with open(os.path.join(HERE, "golden", name), encoding="utf-8") as f:
            assert f.read() == text, f"tests/golden/{name} is stale: run `make golden`"


def test_lingbot_size_from_live_model() -> None:
    result = plan_model("surgery.examples:lingbot")
    assert _kinds(result.manifest) == {"frame_block": 24, "patch_embed_block": 24,
                                       "attn_proj": 24, "attn_pre": 24, "ffn_residual": 24}
    paths = [p for r in result.manifest.regions if r.callable == "forward" for p in r.paths]
    assert not [(a, b) for a in paths for b in paths if b.startswith(f"{a}.")]
    with torch.device("meta"):
        sd = tiny().state_dict()
    assert result.manifest.fingerprint != compute_fingerprint(sd)


def test_lingbot_size_from_checkpoint_header(tmp_path) -> None:
    # A header-only safetensors file with LingBot-size shapes (no data needed to plan).
    from tests_support import write_header_only_safetensors

    with torch.device("meta"):
        from surgery.examples import lingbot
        sd = lingbot().state_dict()
    path = tmp_path / "lingbot.safetensors"
    write_header_only_safetensors(path, {k: (tuple(v.shape), "BF16") for k, v in sd.items()})
    result = plan_checkpoint(str(path))
    assert _kinds(result.manifest) == {"frame_block": 24, "patch_embed_block": 24,
                                       "attn_proj": 24}


@pytest.mark.parametrize(
    ("name", "wrap", "expect_export"),
    [
        pytest.param("clean.safetensors", None, False, id="clean-safetensors"),
        pytest.param("clean.pt", None, False, id="clean-pt"),
        pytest.param("ddp_compiled.pt", lambda k: f"module._orig_mod.{k}", True,
                     id="wrapped-pt"),
        pytest.param("mid.safetensors",
                     lambda k: k.replace("frame_blocks.0.", "frame_blocks.0._orig_mod."), True,
                     id="mid-key-orig-mod"),
    ],
)
def test_plan_is_the_canonical_model(tmp_path, name, wrap, expect_export) -> None:
    _save_tiny(tmp_path / name, wrap=wrap)
    result = plan_checkpoint(str(tmp_path / name))
    with torch.device("meta"):
        clean = tiny().state_dict()
    assert result.manifest.fingerprint == compute_fingerprint(clean)
    assert bool(result.needs_export) == expect_export
    assert any("surgery export" in n for n in result.notes) == expect_export


def test_lightning_container_and_prefix(tmp_path) -> None:
    sd = {f"model.{k}": v for k, v in tiny().state_dict().items()}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": sd, "epoch": 7, "global_step": 100}, path)
    plain = plan_checkpoint(str(path))
    assert any("entry 'state_dict'" in n for n in plain.notes)
    assert any("--prefix model." in n for n in plain.notes)
    inner = plan_checkpoint(str(path), prefix="model.")
    with torch.device("meta"):
        assert inner.manifest.fingerprint == compute_fingerprint(tiny().state_dict())
    assert inner.manifest.model["prefix"] == "model."
    assert _kinds(inner.manifest)["frame_block"] == 2


def test_sharded_index(tmp_path) -> None:
    sd = tiny().state_dict()
    keys = sorted(sd)
    half = len(keys) // 2
    shards = {"m-00001.safetensors": keys[:half], "m-00002.safetensors": keys[half:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / fname))
        weight_map |= dict.fromkeys(ks, fname)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = plan_checkpoint(str(index))
    assert result.manifest.fingerprint == compute_fingerprint(sd)
    assert default_output(str(index)) == str(tmp_path / "model.surgery.toml")


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_plan_writes_beside_input_and_refuses_overwrite(tmp_path) -> None:
    _save_tiny(tmp_path / "m.safetensors")
    runner = CliRunner()
    res = runner.invoke(cli, ["plan", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "m.surgery.toml"
    assert "frame_block" in res.output and "left out:" in res.output
    assert load_manifest(out).regions
    before = out.read_bytes()
    res = runner.invoke(cli, ["plan", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 3 and "--force" in res.output
    assert out.read_bytes() == before
    res = runner.invoke(cli, ["plan", str(tmp_path / "m.safetensors"), "--force",
                              "--exclude", "aggregator.frame_blocks.*"])
    assert res.exit_code == 0
    assert "frame_block" not in {r.kind for r in load_manifest(out).regions}


def test_cli_plan_json_and_stdout(tmp_path) -> None:
    _save_tiny(tmp_path / "m.safetensors")
    runner = CliRunner()
    res = runner.invoke(cli, ["plan", str(tmp_path / "m.safetensors"), "--json"])
    data = json.loads(res.output)
    assert data["regions"] == {"frame_block": 2, "attn_proj": 2, "patch_embed_block": 2}
    assert 0 < data["covered_share"] < 1
    res = runner.invoke(cli, ["plan", str(tmp_path / "m.safetensors"), "-o", "-", "--force"])
    assert res.exit_code == 0 and res.output.startswith("# surgery manifest")


def test_cli_plan_live_model(tmp_path) -> None:
    out = tmp_path / "live.toml"
    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "-o", str(out)])
    assert res.exit_code == 0, res.output
    kinds = {r.kind for r in load_manifest(out).regions}
    assert {"attn_pre", "ffn_residual"} <= kinds


def test_cli_plan_backend_preset(tmp_path) -> None:
    out = tmp_path / "cg.toml"
    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "-o", str(out),
                                   "--backend", "cudagraphs"])
    assert res.exit_code == 0, res.output
    comp = load_manifest(out).compile
    assert comp["backend"] == "cudagraphs" and "mode" not in comp


def test_cli_plan_capture_region(tmp_path) -> None:
    out = tmp_path / "region.toml"
    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "-o", str(out),
                                   "--capture", "region"])
    assert res.exit_code == 0, res.output
    comp = load_manifest(out).compile  # validated against the schema on reading
    assert comp["capture"] == "region" and comp["backend"] == "inductor"
    assert "captured by surgery, one per region path" in res.output
    assert "mode" not in comp, "mode reduce-overhead would only add cudagraph trees"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        pytest.param(["--capture", "region", "--backend", "cudagraphs"], 3, "twice",
                     id="capture-region-cudagraphs"),
        pytest.param(["--capture", "region", "--mode", "reduce-overhead"], 3,
                     "--mode reduce-overhead would capture", id="capture-region-reduce-overhead"),
        pytest.param(["--capture", "graph"], 2, "'compiler', 'region'", id="capture-typo"),
    ],
)
def test_cli_plan_capture_conflicts(tmp_path, args: list[str], code: int, message: str) -> None:
    out = tmp_path / "m.toml"
    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "-o", str(out),
                                   *args])
    assert res.exit_code == code, res.output
    assert message in res.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        pytest.param([], 2, "either a checkpoint", id="no-source"),
        pytest.param(["{ckpt}", "--model", "x:y"], 2, "either a checkpoint", id="both"),
        pytest.param(["{tmp}/missing.safetensors"], 3, "no such file", id="missing"),
        pytest.param(["{tmp}/m.onnx"], 3, "unknown checkpoint type", id="unknown-suffix"),
        pytest.param(["--model", "nodots"], 2, "is not PKG.MOD:FACTORY", id="bad-spec"),
        pytest.param(["--model", "no_such_module_xyz:f"], 3, "cannot import", id="no-module"),
        pytest.param(["--model", "surgery.examples:nope"], 3, "no attribute", id="no-attr"),
        pytest.param(["{ckpt}", "--include", "aggregator.fram_blocks.*"], 3, "did you mean",
                     id="include-typo"),
        pytest.param(["{ckpt}", "--prefix", "model."], 3, "no key is under", id="bad-prefix"),
        pytest.param(["{ckpt}", "-o", "{ckpt}"], 2, "overwrite its own checkpoint",
                     id="output-is-input"),
        pytest.param(["{tmp}/garbage.safetensors"], 3, "not a valid safetensors", id="garbage"),
    ],
)
def test_cli_plan_bad_input(tmp_path, args, code, message) -> None:
    ckpt = tmp_path / "m.safetensors"
    _save_tiny(ckpt)
    (tmp_path / "garbage.safetensors").write_bytes(os.urandom(64))
    (tmp_path / "m.onnx").write_bytes(b"x")
    before = sorted(os.listdir(tmp_path))
    argv = ["plan", *(a.format(ckpt=ckpt, tmp=tmp_path) for a in args)]
    res = CliRunner().invoke(cli, argv)
    assert res.exit_code == code, res.output
    assert message in res.output
    assert "Traceback" not in res.output
    assert sorted(os.listdir(tmp_path)) == before  # no partial output


def test_cli_plan_falls_back_to_cpu_when_meta_fails(tmp_path, monkeypatch) -> None:
    mod = tmp_path / "itemmodel.py"
    mod.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        n = int(torch.tensor(2).item())  # fails on the meta device\n"
        "        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))\n"
        "                                    for _ in range(n))\n"
        "def build():\n"
        "    return M()\n")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["plan", "--model", "itemmodel:build", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output[res.output.index("{"):])
    assert data["regions"] == {"repeated_block": 2}
    assert any("built on the CPU" in n for n in data["notes"])


def test_cli_check(tmp_path) -> None:
    good = os.path.join(HERE, "golden", "tiny-live.surgery.toml")
    runner = CliRunner()
    res = runner.invoke(cli, ["check", good])
    assert res.exit_code == 0 and "valid" in res.output
    bad = tmp_path / "bad.toml"
    with open(good, encoding="utf-8") as f:
        bad.write_text(f.read().replace('callable = "method"', 'callable = "methd"', 1))
    res = runner.invoke(cli, ["check", str(bad)])
    assert res.exit_code == 3
    assert "region[" in res.output and ".callable" in res.output
    assert "Traceback" not in res.output


def test_plan_of_safetensors_does_not_import_torch(tmp_path) -> None:
    _save_tiny(tmp_path / "m.safetensors")
    code = ("import sys; from surgery.cli import main; sys.argv=['surgery','plan',sys.argv[1],"
            "'-o',sys.argv[2]]\ntry:\n    main()\nexcept SystemExit as e:\n    assert not e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.safetensors"),
                    str(tmp_path / "o.toml")], check=True)


def test_plan_fingerprint_matches_export_for_averaged_model(tmp_path) -> None:
    """EMA bookkeeping (n_averaged) is not part of the model: plan and export agree."""
    from torch.optim.swa_utils import AveragedModel

    from surgery.hygiene import export_checkpoint

    path = tmp_path / "ema.pt"
    torch.save(AveragedModel(tiny()).state_dict(), path)
    result = plan_checkpoint(str(path))
    with torch.device("meta"):
        assert result.manifest.fingerprint == compute_fingerprint(tiny().state_dict())
    assert any("n_averaged" in n or "bookkeeping" in n for n in result.notes)
    exported = export_checkpoint(str(path), out=str(tmp_path / "clean.safetensors"))
    assert exported.fingerprint == result.manifest.fingerprint


def test_plan_clones_only_outputs_that_outlive_the_step() -> None:
    """Under the compiler's graphs only attn_pre (kept by the KV cache) clones; under region
    capture nothing does, since the runtime keeps a ring of output buffers instead."""
    manifest = plan_model("surgery.examples:tiny",
                          compile=compile_defaults(capture="compiler")).manifest
    clone = {r.kind: manifest.region_compile(r)["clone_outputs"] for r in manifest.regions}
    assert clone == {"frame_block": False, "patch_embed_block": False, "attn_proj": False,
                     "ffn_residual": False, "attn_pre": True}
    manifest = plan_model("surgery.examples:tiny").manifest
    assert manifest.compile["capture"] == "region"
    assert {manifest.region_compile(r)["clone_outputs"] for r in manifest.regions} == {False}


def test_plan_refuses_keys_that_would_merge(tmp_path) -> None:
    """An EMA `module.` copy beside the online weights: both originals are named."""
    sd = tiny().state_dict()
    both = {**sd, **{f"module.{k}": v for k, v in sd.items()}}
    torch.save(both, tmp_path / "two.pt")
    res = CliRunner().invoke(cli, ["plan", str(tmp_path / "two.pt")])
    assert res.exit_code == 3, res.output
    k = "aggregator.frame_blocks.0.attn.proj.bias"
    assert f"79 key(s) would merge into one: {k!r} + 'module.{k}' -> {k!r}" in res.output
    assert "--prefix module." in res.output
    assert not (tmp_path / "two.surgery.toml").exists()
