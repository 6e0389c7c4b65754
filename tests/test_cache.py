"""Compile-cache bundles: the file format, the fall-backs, `surgery warm` and the verify note.

Only one test compiles with inductor (two fresh processes, ~20 s each on these CPUs); it is the
proof that a process given the bundle compiles less than one without it, counted with torch's
FX-graph and AOTAutograd cache counters, each process with its own empty TORCHINDUCTOR_CACHE_DIR
so that the bundle is the only way to skip work. Every fall-back test rejects the bundle before
torch sees it and runs the model with backend aot_eager, which needs no code generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from bundle_support import EMPTY_BLOB, KEY, KEY_HEX, TWO_BLOCKS_SRC, torch_cache_blob
from click.testing import CliRunner
from safetensors.torch import save_file
from torch import nn

from surgery.cli import cli
from surgery.errors import CacheBundleError
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region, save_manifest
from surgery.runtime import bundle as bundle_file
from surgery.runtime import bundle_env, cache
from surgery.runtime.apply import apply_manifest
from surgery.runtime.report import CacheIgnoredWarning, SurgeryWarning
from surgery.runtime.signing import ENV_KEY, ENV_KEY_FILE

AOT = {"backend": "aot_eager", "on_cpu": "compile"}  # on_cpu: no CUDA here, so no graphs

# A two-block model small enough that inductor compiles its one graph quickly. It lives in a
# file so that `surgery warm --model warmmod:build` and a second process can import it.
MODEL_SRC = TWO_BLOCKS_SRC + textwrap.dedent('''
    def example(model):
        return torch.randn(4, 16)
''')


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "cache_key")


@pytest.fixture
def cache_key(monkeypatch) -> bytes:
    """The deployer's key, in the environment of this process and of those it starts."""
    monkeypatch.setenv(ENV_KEY, KEY_HEX)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    return KEY


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """tmp_path holding warmmod.py and net.surgery.toml (inductor, no CUDA graphs); cwd there."""
    (tmp_path / "warmmod.py").write_text(MODEL_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import importlib

    import warmmod  # type: ignore[import-not-found]

    importlib.reload(warmmod)
    model = warmmod.build()
    compile_ = {**DEFAULT_COMPILE, "on_cpu": "compile"}  # inductor on the CPU, no CUDA graphs
    m = Manifest(compute_fingerprint(model.state_dict()),
                 [Region("block", ["blocks.0", "blocks.1"])], compile=compile_)
    save_manifest(m, str(tmp_path / "net.surgery.toml"))
    return tmp_path


def _model_and_manifest(project: Path) -> tuple[nn.Module, Manifest]:
    import warmmod  # type: ignore[import-not-found]

    from surgery.formats.manifest import load_manifest

    return warmmod.build().eval(), load_manifest(str(project / "net.surgery.toml"))


def _fitting_bundle(project: Path, *, blob: bytes = EMPTY_BLOB, **changes: object) -> str:
    """A bundle whose record fits this machine and manifest (with `changes` applied)."""
    _, m = _model_and_manifest(project)
    meta = cache.bundle_metadata(m, overrides=AOT, env=bundle_env.environment(device="cpu"),
                                 artifacts={"inductor": 1})
    for dotted, value in changes.items():
        *outer, last = dotted.split("__")
        d = meta
        for k in outer:
            d = d[k]
        d[last] = value
    path = str(project / "net.surgery.cache")
    bundle_file.write_bundle(path, blob, meta, key=KEY)
    return path


def _apply_with(project: Path, bundle: str | bool) -> tuple[list[warnings.WarningMessage], object]:
    model, m = _model_and_manifest(project)
    x = torch.randn(4, 16)
    want = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            handle = apply_manifest(model, m, warmup=lambda mod: mod(x), overrides=AOT,
                                    cache=bundle)
            torch.testing.assert_close(model(x), want)
    assert handle.report.counts()["compiled"] == 2  # compiled as usual
    handle.restore()
    return [w for w in caught if issubclass(w.category, SurgeryWarning)], handle.report


# --- the file ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("manifest", "bundle"), [
    pytest.param("model.surgery.toml", "model.surgery.cache", id="toml"),
    pytest.param("d/model.safetensors", "d/model.surgery.cache", id="export"),
    pytest.param("model.index.json", "model.surgery.cache", id="sharded-export"),
    pytest.param("plain.toml", "plain.surgery.cache", id="other-toml"),
    pytest.param("weird", "weird.surgery.cache", id="no-suffix"),
])
def test_default_bundle_path(manifest: str, bundle: str) -> None:
    assert bundle_file.default_bundle_path(manifest) == bundle


def test_write_read_roundtrip_is_atomic(project) -> None:
    big = torch_cache_blob([("inductor", [("fkey", b"x" * 1000)])])
    path = _fitting_bundle(project, blob=big)
    meta, blob = bundle_file.read_bundle(path, key=KEY)
    assert blob == big and meta["blob"]["bytes"] == len(big)
    assert meta["env"]["device"] == "cpu" and meta["overrides"] == AOT
    from surgery.formats.atomic import TEMP_MARK

    assert [p.name for p in project.iterdir() if TEMP_MARK in p.name] == []


@pytest.mark.parametrize(("damage", "message"), [
    pytest.param(lambda b: b[:-10], "truncated: the file is", id="truncated-blob"),
    pytest.param(lambda b: b[:40], "truncated inside its header", id="truncated-header"),
    pytest.param(lambda b: b + b"x", "damaged: the file is", id="trailing-bytes"),
    pytest.param(lambda b: b[:-1] + bytes([b[-1] ^ 1]), "signature does not verify",
                 id="bit-flip-in-blob"),
    pytest.param(lambda b: b[:60] + bytes([b[60] ^ 1]) + b[61:], "signature does not verify",
                 id="bit-flip-in-metadata"),
    pytest.param(lambda b: b"garbage" * 10, "bad magic", id="garbage"),
    pytest.param(lambda b: b"", "bad magic", id="empty"),
    pytest.param(lambda b: b[:8] + (2**62).to_bytes(8, "little") + b[16:], "corrupt header",
                 id="absurd-length"),
])
def test_read_refuses_damaged_bundles(project, damage, message) -> None:
    path = _fitting_bundle(project)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with pytest.raises(CacheBundleError, match=message):
        bundle_file.read_bundle(path, key=KEY)


# --- apply_manifest falls back, once and cleanly ----------------------------------------------

def _torch_defers_unpickling() -> bool:
    """Whether torch.compiler.load_cache_artifacts stores an FX-graph artifact without
    unpickling it (2.14 does; 2.13 unpickles at load)."""
    import tempfile

    blob = torch_cache_blob([("inductor", [("fprobe", b"not a pickle")])])
    with tempfile.TemporaryDirectory() as d:
        old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        try:
            torch.compiler.load_cache_artifacts(blob)
            return True
        except Exception:
            return False
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _damage(path: str, how: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-5] if how == "truncated" else data[:-1] + bytes([data[-1] ^ 0xFF]))


@pytest.mark.parametrize(("kind", "reason"), [
    pytest.param("corrupt", "signature does not verify", id="corrupt"),
    pytest.param("truncated", "truncated", id="truncated"),
    pytest.param("fingerprint", "model fingerprint sha256:0000", id="other-fingerprint"),
    pytest.param("torch", "torch 2.0.0 when built", id="other-torch"),
    pytest.param("device", "device NVIDIA H200 when built, cpu here", id="other-gpu"),
    pytest.param("overrides", "built with overrides", id="other-overrides"),
    pytest.param("manifest", "regions or compile options changed", id="edited-manifest"),
    pytest.param("torch-refuses", "torch could not", id="torch-cannot-deserialise"),
    pytest.param("missing", "no such bundle", id="missing"),
])
def test_bad_bundle_falls_back_with_one_message(project, kind: str, reason: str) -> None:
    changes: dict[str, object] = {
        "fingerprint": {"manifest__fingerprint": "sha256:" + "0" * 64},
        "torch": {"env__torch": "2.0.0"},
        "device": {"env__device": "NVIDIA H200"},
        "overrides": {"overrides": {"backend": "inductor"}},
        "manifest": {"manifest__key": "sha256:edited"},
    }.get(kind, {})
    # Passes surgery's checks, but torch cannot unpickle the artifact.
    blob = torch_cache_blob([("inductor", [("fkey", b"not a pickle")])])
    path = _fitting_bundle(project, blob=blob, **changes)  # type: ignore[arg-type]
    if kind in ("corrupt", "truncated"):
        _damage(path, kind)
    if kind == "missing":
        os.unlink(path)
    if kind == "torch-refuses" and _torch_defers_unpickling():
        pytest.skip("this torch stores FX-graph artifacts unread at load (torch 2.14+): a bad "
                    "one is a cache miss later, so the load itself cannot fail this way")
    caught, report = _apply_with(project, True)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].category is CacheIgnoredWarning
    assert reason in str(caught[0].message)
    assert report.cache.loaded is False and reason in report.cache.reason  # type: ignore[attr-defined]
    assert [n for n in report.notes if "compile-cache bundle ignored" in n]  # type: ignore[attr-defined]


def test_in_memory_manifest_has_nowhere_to_save(project) -> None:
    model, m = _model_and_manifest(project)
    m.source_path = None
    x = torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), apply_manifest(model, m, warmup=lambda mod: mod(x),
                                             overrides=AOT, cache=True) as handle, \
                pytest.raises(CacheBundleError, match="built in memory"):
            handle.save_cache()
    msgs = [str(w.message) for w in caught if issubclass(w.category, SurgeryWarning)]
    assert len(msgs) == 1 and "no file to find a bundle beside" in msgs[0]


# --- the proof: a second process with the bundle compiles less ------------------------------

LOAD_SRC = textwrap.dedent('''
    import json, sys, torch, warmmod
    from surgery.runtime.apply import apply_manifest
    model = warmmod.build().eval()
    x = warmmod.example(model)
    with torch.no_grad():
        h = apply_manifest(model, "net.surgery.toml", warmup=lambda m: m(x),
                           cache=sys.argv[1] == "bundle")
    c = h.report.cache
    print(json.dumps({"loaded": c.loaded, "reason": c.reason, "counts": c.counts,
                      "compiled": h.report.counts()["compiled"]}))
''')


@pytest.mark.slow
def test_second_process_with_bundle_compiles_less(project) -> None:
    """Process 1: `surgery warm` (fresh cache dir: every compile misses) writes the bundle.
    Process 2: a fresh, empty cache dir plus the bundle: every compile hits. This is the
    Mega-Cache part alone (--no-precompile), the fall-back of a torch without the AOT path;
    tests/test_precompiled.py proves the precompiled part."""
    (project / "load.py").write_text(LOAD_SRC)
    # The project first, then this checkout's surgery (not whichever one is installed).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), here]),
           "TORCHINDUCTOR_CACHE_DIR":
           str(project / "inductor-warm")}
    warm = subprocess.run(
        [sys.executable, "-m", "surgery", "warm", "--model", "warmmod:build", "--manifest",
         "net.surgery.toml", "--input", "warmmod:example", "--device", "cpu", "--json",
         "--no-precompile"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr[-3000:]
    made = json.loads(warm.stdout)
    assert made["bundle"] == "net.surgery.cache" and (project / "net.surgery.cache").exists()
    assert made["regions"]["compiled"] == 2
    cold = made["cache"]["counts"]
    assert cold["fx_graph_misses"] >= 1 and cold["fx_graph_hits"] == 0, cold

    env["TORCHINDUCTOR_CACHE_DIR"] = str(project / "inductor-deploy")
    load = subprocess.run([sys.executable, "load.py", "bundle"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    got = json.loads(load.stdout.strip().splitlines()[-1])
    assert got["loaded"] is True, got["reason"]
    assert got["compiled"] == 2
    hot = got["counts"]
    # Every graph the cold process compiled from scratch is a cache hit here.
    assert hot["fx_graph_misses"] == 0 and hot["fx_graph_hits"] == cold["fx_graph_misses"], hot
    assert hot["aot_autograd_misses"] == 0 and hot["aot_autograd_hits"] >= 1, hot
    assert "CacheIgnoredWarning" not in load.stderr


# --- surgery warm: usage and failures ---------------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(cli, list(args))


WARM = ("warm", "--model", "warmmod:build", "--manifest", "net.surgery.toml", "--input",
        "warmmod:example", "--device", "cpu")


@pytest.mark.parametrize(("args", "code", "text"), [
    pytest.param(("warm", "--model", "warmmod:build"), 2, "Missing option", id="missing-options"),
    pytest.param((*WARM, "--overrides", "nokeyvalue"), 2, "is not KEY=VALUE", id="bad-override"),
    pytest.param((*WARM, "--dtype", "int8"), 2, "Invalid value", id="bad-dtype"),
    pytest.param(("warm", "--model", "nomod:build", *WARM[3:]), 3, "cannot import",
                 id="bad-model"),
    pytest.param((*WARM[:4], "missing.surgery.toml", *WARM[5:]), 3, "no such manifest",
                 id="no-manifest"),
    pytest.param((*WARM, "--overrides", "backend=nope"), 3, "not a torch.compile backend",
                 id="bad-backend"),
])
def test_warm_usage_and_errors(project, args, code: int, text: str) -> None:
    r = run(*args)
    assert r.exit_code == code, r.output
    assert text in r.output and "Traceback" not in r.output


def test_warm_refuses_to_overwrite(project) -> None:
    (project / "net.surgery.cache").write_bytes(b"old")
    r = run(*WARM)
    assert r.exit_code == 3
    assert "already exists" in r.output and "--force" in r.output
    assert (project / "net.surgery.cache").read_bytes() == b"old"


def test_warm_with_nothing_compiled_says_why(project, tmp_path) -> None:
    """The default manifest on the CPU: CUDA-graph regions run eager, so nothing to cache."""
    text = (project / "net.surgery.toml").read_text()
    assert 'on_cpu = "compile"' in text
    text = text.replace('on_cpu = "compile"', 'on_cpu = "eager"')
    (project / "net.surgery.toml").write_text(text)
    r = run(*WARM, "-o", str(tmp_path / "out.cache"))
    assert r.exit_code == 3, r.output
    assert "no region ran compiled code" in r.output and "on_cpu=compile" in r.output
    assert not (tmp_path / "out.cache").exists()


# --- surgery verify: a note on the bundle beside the manifest ---------------------------------

@pytest.fixture
def checkpoint(project) -> str:
    model, _ = _model_and_manifest(project)
    path = str(project / "net.safetensors")
    save_file(model.state_dict(), path)
    return path


def test_verify_notes_a_fitting_bundle(project, checkpoint) -> None:
    _fitting_bundle(project)
    r = run("verify", checkpoint, "--manifest", "net.surgery.toml")
    assert r.exit_code == 0, r.output
    assert "SG301 note: the compile-cache bundle beside the manifest fits this machine" in r.output
    assert f"valid for torch {torch.__version__} on cpu" in r.output
    assert 'same overrides {"backend": "aot_eager", "on_cpu": "compile"}' in r.output


@pytest.mark.parametrize(("changes", "damage", "text"), [
    pytest.param({"env__torch": "2.0.0"}, False, "torch 2.0.0 when built", id="other-torch"),
    pytest.param({"manifest__fingerprint": "sha256:0"}, False, "model fingerprint sha256:0",
                 id="other-model"),
    pytest.param({}, True, "signature does not verify", id="corrupt"),
])
def test_verify_notes_a_bundle_that_will_be_ignored(project, checkpoint, changes, damage,
                                                    text) -> None:
    path = _fitting_bundle(project, **changes)
    if damage:
        _damage(path, "corrupt")
    r = run("verify", checkpoint, "--manifest", "net.surgery.toml", "--json")
    assert r.exit_code == 0, r.output  # a note, not a failure
    found = [f for f in json.loads(r.output)["findings"] if f["code"] == "SG302"]
    assert len(found) == 1 and found[0]["severity"] == "note"
    assert text in found[0]["detail"]["reason"]
    assert "surgery warm" in found[0]["fix"]


def test_verify_no_bundle_no_note(project, checkpoint) -> None:
    r = run("verify", checkpoint, "--manifest", "net.surgery.toml")
    assert r.exit_code == 0 and "SG30" not in r.output


def test_verify_bundle_check_does_not_import_torch(project, checkpoint) -> None:
    _fitting_bundle(project)
    code = ("import sys\nfrom click.testing import CliRunner\nfrom surgery.cli import cli\n"
            f"r = CliRunner().invoke(cli, ['verify', {checkpoint!r}, '--manifest', "
            "'net.surgery.toml'])\n"
            "assert r.exit_code == 0, r.output\nassert 'SG301' in r.output, r.output\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=project)
