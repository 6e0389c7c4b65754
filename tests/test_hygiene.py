"""verify_checkpoint / export_checkpoint on inputs built by the real wrappers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from wrapped import BUILDERS, gloo_group

from surgery.errors import (
    CheckpointError,
    FingerprintMismatchError,
    KeyCollisionError,
    ManifestError,
    OutputExistsError,
    UnsafeCheckpointError,
)
from surgery.examples import tiny
from surgery.formats.checkpoint import load_export_tensors as load_exported
from surgery.formats.checkpoint import read_embedded_manifest
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import Manifest, Region, dumps_manifest
from surgery.formats.st_file import read_safetensors_layout
from surgery.formats.tensors import META_ALIASES, META_FINGERPRINT
from surgery.hygiene import export_checkpoint, verify_checkpoint
from surgery.hygiene.verify import count_nonfinite

CLEAN_KEYS = set(tiny().state_dict())


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def process_group():
    with gloo_group():
        yield


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BUILDERS])
def test_real_wrappers_verify_export_roundtrip(name: str, tmp_path, request) -> None:
    build, codes, needs_group = BUILDERS[name]
    if needs_group:
        request.getfixturevalue("process_group")
    sd, clean = build()
    assert set(sd) != CLEAN_KEYS  # the wrapper really left segments behind
    src = str(tmp_path / "wrapped.pt")
    torch.save(sd, src)
    before = _digest(src)

    report = verify_checkpoint(src)
    assert not report.clean
    assert {f.code for f in report.findings if f.severity == "error"} == codes

    out = str(tmp_path / "clean.safetensors")
    result = export_checkpoint(src, out=out)
    assert _digest(src) == before  # the input is never modified
    assert set(read_safetensors_layout(out).tensors) == CLEAN_KEYS
    assert result.tensors == len(CLEAN_KEYS)
    again = verify_checkpoint(out)
    assert again.clean and not [f for f in again.findings if f.severity == "error"]
    assert again.fingerprint == result.fingerprint == compute_fingerprint(clean.state_dict())

    fresh = tiny()
    fresh.load_state_dict(load_exported(out), strict=True)
    for k, v in clean.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_regional_compile_findings_are_grouped() -> None:
    """LingBot-Map's recipe at LingBot size (meta device): one finding, not one per key."""
    from wrapped import _regional

    from surgery.examples import LINGBOT, ExampleModel
    from surgery.formats.keys import check_keys

    with torch.device("meta"):
        m = _regional(ExampleModel(LINGBOT))
    keys = list(m.state_dict())
    wrapped = [k for k in keys if "._orig_mod." in k]
    assert len(wrapped) == 24 * 12 * 2 + 24 * 2
    findings = check_keys(keys, source="lingbot.pt")
    assert [f.code for f in findings] == ["SG001"]
    assert findings[0].count == len(wrapped) and len(findings[0].examples) == 3
    assert findings[0].fix == "surgery export lingbot.pt -o lingbot.clean.safetensors"


def test_ema_copy_beside_online_weights_is_refused_with_both_keys(tmp_path) -> None:
    sd = tiny().state_dict()
    both = {**sd, **{f"module.{k}": v.clone() for k, v in sd.items()}}
    src = str(tmp_path / "both.pt")
    torch.save(both, src)
    report = verify_checkpoint(src)
    collision = next(f for f in report.findings if f.code == "SG008")
    assert "head.weight" in collision.keys and "module.head.weight" in collision.keys
    with pytest.raises(KeyCollisionError) as e:
        export_checkpoint(src, out=str(tmp_path / "x.safetensors"))
    assert "'head.weight' + 'module.head.weight' -> 'head.weight'" in str(e.value) or \
        e.value.collisions["head.weight"] == ["head.weight", "module.head.weight"]
    assert not os.path.exists(tmp_path / "x.safetensors")
    # --prefix module. picks the EMA copy.
    result = export_checkpoint(src, out=str(tmp_path / "ema.safetensors"), prefix="module.")
    assert set(read_safetensors_layout(result.files[0]).tensors) == CLEAN_KEYS
    assert len(result.dropped) == len(sd)


def test_lightning_container_with_prefix_and_key(tmp_path) -> None:
    sd = tiny().state_dict()
    ckpt = {"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 3,
            "ema": {"model": {f"model.{k}": v + 1 for k, v in sd.items()}}}
    src = str(tmp_path / "lightning.ckpt")
    torch.save(ckpt, src)
    report = verify_checkpoint(src)
    assert report.clean and report.entry == "state_dict"
    assert [f.code for f in report.findings] == ["SG009"]
    assert verify_checkpoint(src, prefix="model.").fingerprint == compute_fingerprint(sd)
    out = str(tmp_path / "ema.safetensors")
    export_checkpoint(src, out=out, key="ema/model", prefix="model.")
    loaded = load_exported(out)
    assert set(loaded) == CLEAN_KEYS
    assert torch.equal(loaded["head.bias"], sd["head.bias"] + 1)


def _manifest_file(tmp_path, fingerprint: str, paths: list[str], callable_: str = "forward",
                   **model) -> str:
    m = Manifest(fingerprint=fingerprint,
                 regions=[Region(kind="frame_block", paths=paths, callable=callable_)],
                 model=model)
    path = tmp_path / "m.surgery.toml"
    path.write_text(dumps_manifest(m))
    return str(path)


@pytest.mark.parametrize("paths,callable_,codes", [
    pytest.param(["aggregator.frame_blocks.0", "aggregator.frame_blocks.1"], "forward", [],
                 id="modules-exist"),
    pytest.param(["aggregator.global_blocks.0.attn_pre"], "method", [], id="method-on-module"),
    pytest.param(["aggregator.frame_blocks.0", "aggregator.fnn_blocks.0"], "forward",
                 ["SG102"], id="misspelt-path"),
])
def test_verify_manifest_region_paths(tmp_path, paths, callable_, codes) -> None:
    sd = tiny().state_dict()
    src = str(tmp_path / "m.safetensors")
    save_file(sd, src)
    man = _manifest_file(tmp_path, compute_fingerprint(sd), paths, callable_)
    report = verify_checkpoint(src, manifest=man)
    assert [f.code for f in report.findings] == codes
    if codes:
        assert report.findings[0].keys == ["aggregator.fnn_blocks.0"]


def test_manifest_fingerprint_mismatch(tmp_path) -> None:
    sd = tiny().state_dict()
    src = str(tmp_path / "m.safetensors")
    save_file(sd, src)
    man = _manifest_file(tmp_path, "sha256:" + "0" * 64, ["aggregator.frame_blocks.0"])
    report = verify_checkpoint(src, manifest=man)
    assert [f.code for f in report.findings] == ["SG101"]
    with pytest.raises(FingerprintMismatchError):
        export_checkpoint(src, out=str(tmp_path / "o.safetensors"), manifest=man)
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_export_embeds_manifest_and_runtime_reads_it(tmp_path) -> None:
    sd = {f"_orig_mod.{k}": v for k, v in tiny().state_dict().items()}
    src = str(tmp_path / "c.pt")
    torch.save(sd, src)
    man = _manifest_file(tmp_path, compute_fingerprint(tiny().state_dict()),
                         ["aggregator.frame_blocks.0"])
    text = Path(man).read_text(encoding="utf-8")
    out = str(tmp_path / "deploy.safetensors")
    result = export_checkpoint(src, out=out, manifest=man)
    meta = read_safetensors_layout(out).metadata
    assert meta["format"] == "pt" and meta[META_FINGERPRINT] == result.fingerprint
    assert meta["surgery.manifest"] == text
    assert meta["surgery.manifest_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    embedded = read_embedded_manifest(out)
    assert isinstance(embedded, Manifest)
    assert embedded.fingerprint == result.fingerprint
    assert embedded.regions[0].paths == ["aggregator.frame_blocks.0"]
    assert verify_checkpoint(out, manifest=man).clean
    plain = str(tmp_path / "plain.safetensors")
    save_file(tiny().state_dict(), plain)
    assert read_embedded_manifest(plain) is None


def test_tampered_embedded_manifest_is_refused(tmp_path) -> None:
    sd = tiny().state_dict()
    man = _manifest_file(tmp_path, compute_fingerprint(sd), ["aggregator.frame_blocks.0"])
    src = str(tmp_path / "c.safetensors")
    save_file(sd, src)
    out = str(tmp_path / "d.safetensors")
    export_checkpoint(src, out=out, manifest=man)
    raw = bytearray(Path(out).read_bytes())
    i = raw.find(b"frame_blocks.0")
    raw[i:i + 14] = b"frame_blocks.1"
    Path(out).write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="sha256"):
        read_embedded_manifest(out)


def test_tied_weights_stored_once_and_restored(tmp_path) -> None:
    m = tiny()
    blocks = m.aggregator.frame_blocks
    blocks[1].attn.proj.weight = blocks[0].attn.proj.weight  # tied, as embeddings/heads are
    sd = {f"module.{k}": v for k, v in m.state_dict().items()}
    # pickle keeps the sharing: both keys point at one storage after load
    src = str(tmp_path / "tied.pt")
    torch.save(sd, src)
    deep = verify_checkpoint(src, deep=True)
    shared = next(f for f in deep.findings if f.code == "SG203")
    assert shared.severity == "note" and set(shared.keys) == {
        "module.aggregator.frame_blocks.0.attn.proj.weight",
        "module.aggregator.frame_blocks.1.attn.proj.weight"}
    out = str(tmp_path / "tied.safetensors")
    result = export_checkpoint(src, out=out)
    assert result.aliases == {"aggregator.frame_blocks.1.attn.proj.weight":
                              "aggregator.frame_blocks.0.attn.proj.weight"}
    layout = read_safetensors_layout(out)
    assert json.loads(layout.metadata[META_ALIASES]) == result.aliases
    assert set(layout.tensors) == set(m.state_dict())  # aliases listed back
    assert verify_checkpoint(out).fingerprint == compute_fingerprint(m.state_dict())
    fresh = tiny()
    fb = fresh.aggregator.frame_blocks
    fb[1].attn.proj.weight = fb[0].attn.proj.weight
    loaded = load_exported(out)
    fresh.load_state_dict(loaded, strict=True)
    assert loaded["aggregator.frame_blocks.1.attn.proj.weight"] is \
        loaded["aggregator.frame_blocks.0.attn.proj.weight"]


def test_non_contiguous_tensors_are_made_contiguous(tmp_path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"a.t": base.t(), "a.slice": base[:, 1:3], "b": torch.ones(3, dtype=torch.bfloat16)}
    src = str(tmp_path / "nc.pt")
    torch.save(sd, src)
    out = str(tmp_path / "nc.safetensors")
    export_checkpoint(src, out=out)
    loaded = load_exported(out)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k


def test_deep_finds_nonfinite_and_float64(tmp_path) -> None:
    sd = tiny().state_dict()
    sd["head.bias"] = sd["head.bias"].clone()
    sd["head.bias"][0] = float("nan")
    sd["head.bias"][1] = float("inf")
    sd["extra.stats"] = torch.zeros(3, dtype=torch.float64)
    for name, save in (("d.pt", torch.save), ("d.safetensors", save_file)):
        src = str(tmp_path / name)
        save(sd, src)
        seen: list[tuple[int, int]] = []
        report = verify_checkpoint(src, deep=True, progress=lambda d, t, s=seen: s.append((d, t)))
        codes = {f.code: f for f in report.findings}
        assert codes["SG201"].keys == ["head.bias"]
        assert codes["SG201"].detail["counts"]["head.bias"] == {"nan": 1, "inf": 1}
        assert codes["SG202"].keys == ["extra.stats"]
        assert seen[-1][0] == seen[-1][1] > 0  # progress reached the end
        assert verify_checkpoint(src).clean  # without --deep the data is not read


@pytest.mark.parametrize("dtype", [
    pytest.param(d, id=str(d).removeprefix("torch."))
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
              torch.float8_e5m2, torch.complex64)])
def test_count_nonfinite_bit_patterns(dtype) -> None:
    from surgery.formats.tensors import normalize_dtype

    vals = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, -2.5])
    t = vals.to(dtype) if not dtype.is_complex else torch.complex(vals, torch.zeros(6))
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    nan, inf = count_nonfinite(raw, normalize_dtype(dtype))
    assert (nan, inf) == (1, 2)


def test_sharded_export_and_verify(tmp_path) -> None:
    sd = {f"_orig_mod.{k}": v for k, v in tiny().state_dict().items()}
    src = str(tmp_path / "big.pt")
    torch.save(sd, src)
    out = str(tmp_path / "model.safetensors")
    result = export_checkpoint(src, out=out, max_shard_size=100_000)
    assert result.index == str(tmp_path / "model.safetensors.index.json")
    assert len(result.files) > 2
    assert all(os.path.basename(f).startswith("model-0000") for f in result.files)
    index = json.loads(Path(result.index).read_text())
    assert index["metadata"]["total_size"] == result.bytes_written - sum(
        read_safetensors_layout(f).data_start for f in result.files)
    assert set(index["weight_map"]) == CLEAN_KEYS
    for f in result.files:  # no shard above the limit unless a single tensor is
        tensors = read_safetensors_layout(f).tensors
        assert len(tensors) == 1 or os.path.getsize(f) <= 100_000 + 8192
    report = verify_checkpoint(result.index, deep=True)
    assert report.clean and report.fingerprint == result.fingerprint
    tiny().load_state_dict(load_exported(result.index), strict=True)


def test_failed_export_leaves_nothing(tmp_path, monkeypatch) -> None:
    src = str(tmp_path / "c.pt")
    torch.save({f"_orig_mod.{k}": v for k, v in tiny().state_dict().items()}, src)
    from surgery.formats import stream

    calls = {"n": 0}
    real = stream.PickleSource.write_to

    def flaky(self, name, fd, *, advance):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real(self, name, fd, advance=advance)

    monkeypatch.setattr(stream.PickleSource, "write_to", flaky)
    with pytest.raises(Exception, match="No space left"):
        export_checkpoint(src, out=str(tmp_path / "o.safetensors"), max_shard_size=50_000)
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]


def test_export_refuses_existing_output_and_the_input_itself(tmp_path) -> None:
    src = str(tmp_path / "c.safetensors")
    save_file(tiny().state_dict(), src)
    with pytest.raises(Exception, match="is the input file"):
        export_checkpoint(src, out=src, force=True)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError):
        export_checkpoint(src, out=str(out))
    assert out.read_bytes() == b"keep me"
    export_checkpoint(src, out=str(out), force=True)
    assert verify_checkpoint(str(out)).clean


def test_malicious_pickle_is_refused_and_never_runs(tmp_path) -> None:
    marker = tmp_path / "PWNED"
    src = str(tmp_path / "evil.pt")
    subprocess.run([sys.executable, "-c", (
        "import os, sys, torch\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        f"        return (os.system, ('touch {marker}',))\n"
        f"torch.save({{'w': torch.zeros(2), 'x': Evil()}}, {src!r})\n")], check=True)
    for call in (lambda: verify_checkpoint(src),
                 lambda: verify_checkpoint(src, deep=True),
                 lambda: export_checkpoint(src, out=str(tmp_path / "o.safetensors"))):
        with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
            call()
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_safetensors_verify_and_export_do_not_import_torch(tmp_path) -> None:
    sd = {f"module._orig_mod.{k}": v for k, v in tiny().state_dict().items()}
    src = str(tmp_path / "w.safetensors")
    save_file(sd, src)
    code = (
        "import sys\n"
        "from surgery.hygiene import verify_checkpoint, export_checkpoint\n"
        f"r = verify_checkpoint({src!r})\n"
        "assert not r.clean\n"
        f"e = export_checkpoint({src!r}, out={str(tmp_path / 'c.safetensors')!r})\n"
        f"assert verify_checkpoint(e.files[0]).clean\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    loaded = load_exported(str(tmp_path / "c.safetensors"))
    assert set(loaded) == CLEAN_KEYS


def test_bookkeeping_only_prefix_errors(tmp_path) -> None:
    src = str(tmp_path / "c.safetensors")
    save_file(tiny().state_dict(), src)
    with pytest.raises(CheckpointError, match="no key is under --prefix"):
        verify_checkpoint(src, prefix="nothing.")
