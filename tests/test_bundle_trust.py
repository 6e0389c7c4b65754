"""A compile-cache bundle is code, so it is loaded only when signed with the deployer's key
(issue 10, parts 2 and 3).

Each forged bundle carries an inductor artifact whose pickle creates a marker file when torch
loads it, and (where it says so) an autotune artifact whose key is an absolute path, which torch
writes to. A spy around ``torch.compiler.load_cache_artifacts`` records every call: "never passes
its bytes to torch" is asserted on the spy, and "nothing ran" on the markers. The control test
shows the same payload does create the markers when torch is handed it, so the markers prove
something.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from bundle_support import EMPTY_BLOB, KEY, KEY_HEX, payload_blob, torch_cache_blob
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from surgery.cli import cli
from surgery.errors import CacheKeyError
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region, save_manifest
from surgery.runtime import bundle, bundle_env, cache, signing
from surgery.runtime.apply import apply_manifest
from surgery.runtime.artifacts import ArtifactError, key_problem, read_artifacts
from surgery.runtime.bundle_env import environment_without_torch, same_torch
from surgery.runtime.report import CacheIgnoredWarning, SurgeryWarning
from tests.capped import case_bounds

AOT = {"backend": "aot_eager", "on_cpu": "compile"}
ATTACKER_KEY = bytes(range(32))

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def env_key(monkeypatch) -> bytes:
    monkeypatch.setenv(signing.ENV_KEY, KEY_HEX)
    monkeypatch.delenv(signing.ENV_KEY_FILE, raising=False)
    return KEY


@pytest.fixture
def no_key(monkeypatch) -> None:
    monkeypatch.delenv(signing.ENV_KEY, raising=False)
    monkeypatch.delenv(signing.ENV_KEY_FILE, raising=False)


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """tmp_path with net.surgery.toml; torch's caches in tmp_path/inductor."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    m = Manifest(compute_fingerprint(_net().state_dict()), [Region("lin", ["a"])],
                 compile={**DEFAULT_COMPILE, "on_cpu": "compile"})
    save_manifest(m, str(tmp_path / "net.surgery.toml"))
    return tmp_path


@pytest.fixture
def spy(monkeypatch) -> list[bytes]:
    """Every blob handed to torch.compiler.load_cache_artifacts (which still runs)."""
    calls: list[bytes] = []
    real = torch.compiler.load_cache_artifacts

    def recording(blob: bytes):  # type: ignore[no-untyped-def]
        calls.append(blob)
        return real(blob)

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", recording)
    return calls


def _manifest(site: Path) -> Manifest:
    from surgery.formats.manifest import load_manifest

    return load_manifest(str(site / "net.surgery.toml"))


def _record(site: Path) -> dict:
    """A record that fits this machine and manifest, as an attacker who read the code makes it."""
    return cache.bundle_metadata(_manifest(site), overrides=AOT,
                                 env=bundle_env.environment(device="cpu"),
                                 artifacts={"inductor": 1})


def _raw_bundle(path: Path, meta: bytes, blob: bytes, *, key: bytes,
                magic: bytes = bundle.MAGIC) -> None:
    """Any metadata bytes, signed as surgery signs (the key holder's hand, or the attacker's
    own key)."""
    lengths = struct.pack("<QQ", len(meta), len(blob))
    path.write_bytes(magic + lengths + signing.mac(key, magic, lengths, meta, blob) + meta + blob)


def _apply(site: Path, bundle: str | bool = True) -> tuple[list[str], object]:
    model, x = _net(), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            handle = apply_manifest(model, str(site / "net.surgery.toml"),
                                    warmup=lambda m: m(x), overrides=AOT, cache=bundle)
    handle.restore()
    assert handle.report.counts()["compiled"] == 1  # compiled as usual either way
    ours = [str(w.message) for w in caught if issubclass(w.category, SurgeryWarning)]
    assert all(issubclass(w.category, CacheIgnoredWarning) for w in caught
               if issubclass(w.category, SurgeryWarning))
    return ours, handle.report


def _nothing_ran(site: Path, spy: list[bytes]) -> None:
    assert spy == [], "bundle bytes reached torch"
    assert not (site / "PWNED").exists() and not (site / "WRITTEN").exists()


# --- the control: the payload is live -------------------------------------------------------

def test_control_torch_runs_the_payload_when_handed_it(site) -> None:
    # torch 2.13 unpickles the FX-graph artifact at load (the pickle runs, then torch raises:
    # what it returns is not a graph). torch 2.14 stores it in the FX graph cache unread, to be
    # unpickled on the first cache lookup: the payload is planted for a later process instead.
    with contextlib.suppress(Exception):
        torch.compiler.load_cache_artifacts(payload_blob(site / "PWNED"))
    planted = list((site / "inductor").rglob("fevilgraph/*"))
    assert (site / "PWNED").exists() or planted  # the pickle ran, or waits in the cache
    torch.compiler.load_cache_artifacts(
        torch_cache_blob([("autotune", [(str(site / "WRITTEN"), b"{}")])]))
    assert (site / "WRITTEN").exists()  # an absolute key is written where it points


# --- forged bundles: none is loaded, none runs ----------------------------------------------

def test_forger_who_recomputes_every_hash_but_lacks_the_key(site, env_key, spy) -> None:
    """(a) The attacker knows the format, makes a record that fits, and signs with a key of
    their own: the MAC does not verify, so nothing is parsed or handed to torch."""
    path = site / "net.surgery.cache"
    bundle.write_bundle(str(path), payload_blob(site / "PWNED", traversal=site / "WRITTEN"),
                       _record(site), key=ATTACKER_KEY)
    caught, report = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1 and "signature does not verify" in caught[0]
    assert report.cache.loaded is False  # type: ignore[attr-defined]


def test_format_1_bundle_with_a_recomputed_sha256_is_unsigned(site, env_key, spy) -> None:
    """The old format's only check was a sha256 in the same file: it is never loaded now."""
    import hashlib

    blob = payload_blob(site / "PWNED")
    meta = {**_record(site), "format": 1,
            "blob": {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
    text = json.dumps(meta).encode()
    (site / "net.surgery.cache").write_bytes(b"SGCACHE1" + struct.pack("<Q", len(text)) + text
                                             + blob)
    caught, _ = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1 and "unsigned" in caught[0]


def test_without_a_key_a_bundle_is_never_loaded(site, no_key, spy) -> None:
    """Even a genuine one: without the key nothing can tell it from a forgery."""
    bundle.write_bundle(str(site / "net.surgery.cache"), payload_blob(site / "PWNED"),
                       _record(site), key=KEY)
    caught, _ = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1 and "no key to check its signature" in caught[0]
    assert signing.ENV_KEY_FILE in caught[0]


@pytest.mark.parametrize(("key", "why"), [
    pytest.param(str(Path("/").resolve() / "tmp" / "x.pth"), "is an absolute path",
                 id="absolute"),
    pytest.param("../../../site-packages/evil.pth", "climbs out", id="dot-dot"),
    pytest.param("ab/../../evil", "climbs out", id="dot-dot-inside"),
    pytest.param("ab\\..\\evil", "characters other than", id="backslash"),
    pytest.param("~/.bashrc", "is an absolute path", id="home"),
    pytest.param("ab/\x00", "characters other than", id="nul"),
])
def test_traversal_keys_are_refused_even_when_signed(site, env_key, spy, key, why) -> None:
    """(b) Signed by the key holder, so trusted; its keys are still checked (defence in
    depth), and a key that leaves torch's cache folder refuses the whole bundle."""
    blob = torch_cache_blob([("autotune", [("ab/fine.best_config", b"{}"), (key, b"{}")])])
    bundle.write_bundle(str(site / "net.surgery.cache"), blob, _record(site), key=KEY)
    caught, _ = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1 and why in caught[0] and "refused" in caught[0]


def test_absolute_key_pointing_at_a_real_file_writes_nothing(site, env_key, spy) -> None:
    blob = payload_blob(site / "PWNED", traversal=site / "WRITTEN")
    bundle.write_bundle(str(site / "net.surgery.cache"), blob, _record(site), key=KEY)
    caught, _ = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1 and "absolute path" in caught[0]


@pytest.mark.parametrize("signer", [ATTACKER_KEY, KEY], ids=["forged", "signed"])
def test_nested_metadata_is_ignored_not_raised(site, env_key, spy, signer) -> None:
    """(c) 100k-deep JSON: forged, it is never parsed (the MAC fails first); signed by a buggy
    holder, parsing hits the recursion limit, which is a reason, not an exception."""
    meta = b"[" * 100_000 + b"]" * 100_000
    _raw_bundle(site / "net.surgery.cache", meta, payload_blob(site / "PWNED"), key=signer)
    caught, _ = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1
    assert ("signature does not verify" if signer is ATTACKER_KEY else "corrupt metadata") \
        in caught[0]


def test_unknown_artifact_type_is_refused(site, env_key, spy) -> None:
    blob = torch_cache_blob([("mystery", [("k", b"")])])
    bundle.write_bundle(str(site / "net.surgery.cache"), blob, _record(site), key=KEY)
    caught, _ = _apply(site)
    _nothing_ran(site, spy)
    assert len(caught) == 1 and "'mystery' is not one torch writes" in caught[0]


def test_a_fifo_is_not_read(site, env_key, spy) -> None:
    os.mkfifo(site / "net.surgery.cache")
    caught, _ = _apply(site)  # would block forever on open()
    _nothing_ran(site, spy)
    assert len(caught) == 1 and "not a regular file" in caught[0]


# --- a genuine bundle still loads --------------------------------------------------------------

def test_a_genuine_signed_bundle_loads(site, env_key, spy) -> None:
    """Signed with the deployer's key, fitting, with a benign autotune artifact: torch gets the
    exact bytes and writes the artifact inside its cache folder."""
    blob = torch_cache_blob([("autotune", [("ab/abcdef.best_config", b'{"XBLOCK": 8}')])])
    bundle.write_bundle(str(site / "net.surgery.cache"), blob, _record(site), key=KEY)
    caught, report = _apply(site)
    assert caught == []
    assert report.cache.loaded is True and "1 autotune artifact" in report.cache.reason  # type: ignore[attr-defined]
    assert spy == [blob]
    assert (site / "inductor" / "ab" / "abcdef.best_config").exists()


def test_a_key_file_works_as_well_as_the_variable(site, monkeypatch, spy, tmp_path) -> None:
    (tmp_path / "cache.key").write_text(KEY_HEX + "\n")
    (tmp_path / "cache.key").chmod(0o600)
    monkeypatch.delenv(signing.ENV_KEY, raising=False)
    monkeypatch.setenv(signing.ENV_KEY_FILE, str(tmp_path / "cache.key"))
    bundle.write_bundle(str(site / "net.surgery.cache"), EMPTY_BLOB, _record(site), key=KEY)
    caught, report = _apply(site)
    assert caught == [] and report.cache.loaded is True  # type: ignore[attr-defined]


# --- the bundle reader, fuzzed: always "ignored, one line", never an exception ----------------

def _fuzz_manifest() -> Manifest:
    return Manifest("sha256:" + "0" * 64, [Region("lin", ["a"])])


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


def _check_ignored(path: str) -> None:
    with mock.patch.object(torch.compiler, "load_cache_artifacts") as load:
        loaded, why = cache.load_bundle(path, manifest=_fuzz_manifest(), overrides=AOT,
                                        device="cpu")
    assert loaded is False and why and "\n" not in why and len(why) < 800, why
    assert not load.called


@settings(max_examples=1000, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300) | st.builds(
    lambda tail: bundle.MAGIC + tail, st.binary(max_size=300)))
def test_fuzz_any_bytes_are_ignored_with_a_reason(env_key, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.surgery.cache")
        with open(path, "wb") as f:
            f.write(data)
        with case_bounds(max_s=1.0):
            _check_ignored(path)


@settings(max_examples=1000, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=st.one_of(st.binary(max_size=200), _JSON.map(lambda v: json.dumps(v).encode()),
                      st.builds(lambda env, manifest, over, fmt: json.dumps(
                          {"format": fmt, "env": env, "manifest": manifest, "overrides": over,
                           "blob": {}}).encode(), _JSON, _JSON, _JSON, st.sampled_from([2, 1]))),
       body=st.binary(max_size=200), artifacts=st.lists(st.tuples(
           st.sampled_from(["inductor", "autotune", "pgo", "x"]), st.text(max_size=12)),
           max_size=3))
def test_fuzz_signed_garbage_is_ignored_with_a_reason(env_key, meta: bytes, body: bytes,
                                                      artifacts) -> None:
    """The key holder signing garbage: metadata of any shape, blobs with a valid crc and
    framing but any types and keys, or random bytes."""
    framed = torch_cache_blob([(k, [(name, body)]) for k, name in artifacts])
    with tempfile.TemporaryDirectory() as d:
        for blob in (body, framed):
            path = Path(d) / "x.surgery.cache"
            _raw_bundle(path, meta, blob, key=KEY)
            with case_bounds(max_s=1.0):
                _check_ignored(str(path))


@settings(max_examples=1000, deadline=None)
@given(body=st.binary(max_size=400))
def test_fuzz_artifact_framing_raises_only_artifact_error(body: bytes) -> None:
    import zlib

    blob = zlib.crc32(body).to_bytes(4, "big") + body  # a valid crc, so parsing goes deeper
    with case_bounds(max_s=1.0):
        try:
            found = read_artifacts(blob)
        except ArtifactError as e:
            assert "\n" not in str(e)
        else:
            assert all(key_problem(k) is None for keys in found.values() for k in keys)


# --- surgery verify: unsigned, does not verify, no key -- never "fits" ------------------------

@pytest.fixture
def checkpoint(site) -> str:
    path = str(site / "net.safetensors")
    save_file(_net().state_dict(), path)
    return path


def _verify_note(site: Path, checkpoint: str) -> dict:
    r = CliRunner().invoke(cli, ["verify", checkpoint, "--manifest",
                                 str(site / "net.surgery.toml"), "--json"])
    assert r.exit_code == 0, r.output
    found = [f for f in json.loads(r.output)["findings"] if f["code"] in ("SG301", "SG302")]
    assert len(found) == 1
    return found[0]


def test_verify_says_signature_does_not_verify(site, checkpoint, env_key) -> None:
    bundle.write_bundle(str(site / "net.surgery.cache"), EMPTY_BLOB, _record(site),
                       key=ATTACKER_KEY)
    note = _verify_note(site, checkpoint)
    assert note["code"] == "SG302" and "signature does not verify" in note["title"]
    assert note["detail"]["state"] == "bad-signature"


def test_verify_says_unsigned(site, checkpoint, env_key) -> None:
    (site / "net.surgery.cache").write_bytes(b"SGCACHE1" + b"\0" * 8)
    note = _verify_note(site, checkpoint)
    assert note["code"] == "SG302" and "unsigned" in note["title"]


def test_verify_says_no_key_to_check_it(site, checkpoint, no_key) -> None:
    bundle.write_bundle(str(site / "net.surgery.cache"), EMPTY_BLOB, _record(site), key=KEY)
    note = _verify_note(site, checkpoint)
    assert note["code"] == "SG302" and "no key to check it" in note["title"]
    assert signing.ENV_KEY_FILE in note["fix"]


def test_verify_says_fits_only_when_signed_with_the_key(site, checkpoint, env_key) -> None:
    bundle.write_bundle(str(site / "net.surgery.cache"), EMPTY_BLOB, _record(site), key=KEY)
    note = _verify_note(site, checkpoint)
    assert note["code"] == "SG301" and "signature verified" in note["detail"]["reason"]


def test_verify_checks_the_signature_without_importing_torch(site, checkpoint, env_key) -> None:
    bundle.write_bundle(str(site / "net.surgery.cache"), EMPTY_BLOB, _record(site),
                       key=ATTACKER_KEY)
    code = ("import sys\nfrom click.testing import CliRunner\nfrom surgery.cli import cli\n"
            f"r = CliRunner().invoke(cli, ['verify', {checkpoint!r}, '--manifest', "
            f"{str(site / 'net.surgery.toml')!r}])\n"
            "assert r.exit_code == 0, r.output\n"
            "assert 'signature does not verify' in r.output, r.output\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=site)


# --- torch versions: the local build tag (issue 12, defect 2) --------------------------------

@pytest.mark.parametrize(("built", "here", "same"), [
    pytest.param("2.14.1+cu130", "2.14.1", True, id="metadata-without-local-part"),
    pytest.param("2.14.1+cu130", "2.14.1+cu130", True, id="same-build"),
    pytest.param("2.14.1+cu130", "2.14.1+cpu", False, id="other-build"),
    pytest.param("2.13.0", "2.14.1", False, id="other-release"),
    pytest.param("2.14.1+cu130", None, False, id="no-torch"),
])
def test_torch_versions_compare_honestly(built, here, same) -> None:
    assert same_torch(built, here) is same
    meta = {"manifest": {"fingerprint": "f", "key": "k"}, "env": {"torch": built}}
    why = bundle.mismatches(meta, fingerprint="f", key="k", overrides=None,
                           env={"torch": here}, skip=("triton", "cuda", "device", "python",
                                                      "platform"))
    assert (why == []) is same


def test_verify_reads_torchs_own_version_text() -> None:
    """torch/version.py, not the package metadata: the same string torch.__version__ is."""
    env, _ = environment_without_torch(want_gpu=False)
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda


# --- keys -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "key"), [
    pytest.param(KEY_HEX, KEY, id="hex"),
    pytest.param(KEY_HEX + "\n", KEY, id="hex-with-newline"),
    pytest.param("correct horse battery staple", b"correct horse battery staple", id="text"),
])
def test_keys_from_the_environment(value: str, key: bytes) -> None:
    assert signing.load_key(environ={signing.ENV_KEY: value}) == key


def test_bad_keys_are_refused_with_how_to_make_one(tmp_path) -> None:
    with pytest.raises(CacheKeyError, match="at least 16") as info:
        signing.load_key(environ={signing.ENV_KEY: "abcd"})
    assert "secrets.token_hex(32)" in (info.value.hint or "")
    with pytest.raises(CacheKeyError, match="cannot read the cache key file"):
        signing.load_key(environ={signing.ENV_KEY_FILE: str(tmp_path / "missing")})
    assert signing.load_key(environ={}) is None


# --- surgery warm: refuses without a key, and never overwrites an input ----------------------

WARMMOD = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.a(x))

def build():
    torch.manual_seed(0)
    return Net()

def example(model):
    return torch.randn(2, 8)
'''


@pytest.fixture
def warm_site(site, monkeypatch) -> Path:
    (site / "trustmod.py").write_text(WARMMOD)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(site)
    return site


WARM = ["warm", "--model", "trustmod:build", "--manifest", "net.surgery.toml", "--input",
        "trustmod:example", "--device", "cpu", "--overrides", "on_cpu=compile"]


def test_warm_without_a_key_refuses_and_says_how_to_make_one(warm_site, no_key) -> None:
    r = CliRunner().invoke(cli, WARM)
    assert r.exit_code == 3, r.output
    assert "no key to sign" in r.output and "secrets.token_hex(32)" in r.output
    assert not (warm_site / "net.surgery.cache").exists()


def test_warm_with_a_missing_key_file_exits_3(warm_site, no_key) -> None:
    r = CliRunner().invoke(cli, [*WARM, "--key-file", "nope.key"])
    assert r.exit_code == 3 and "cannot read the cache key file" in r.output, r.output


@pytest.mark.parametrize("target", ["net.surgery.toml", "./net.surgery.toml", "trustmod.py",
                                    "cache.key"])
def test_warm_never_overwrites_an_input(warm_site, no_key, target) -> None:
    (warm_site / "cache.key").write_text(KEY_HEX)
    (warm_site / "cache.key").chmod(0o600)
    before = {p.name: p.read_bytes() for p in warm_site.iterdir() if p.is_file()}
    r = CliRunner().invoke(cli, [*WARM, "--key-file", "cache.key", "-o", target, "--force"])
    assert r.exit_code == 3, r.output
    assert ("is the manifest being warmed" if target.endswith(".toml") else
            "an input of this command") in r.output and "Traceback" not in r.output
    after = {p.name: p.read_bytes() for p in warm_site.iterdir() if p.is_file()}
    assert after == before


def test_warm_never_overwrites_its_input_through_a_link(warm_site, no_key) -> None:
    (warm_site / "cache.key").write_text(KEY_HEX)
    (warm_site / "cache.key").chmod(0o600)
    os.symlink(warm_site / "net.surgery.toml", warm_site / "link.cache")
    before = (warm_site / "net.surgery.toml").read_bytes()
    r = CliRunner().invoke(cli, [*WARM, "--key-file", "cache.key", "-o", "link.cache",
                                 "--force"])
    assert r.exit_code == 3 and "is the manifest being warmed" in r.output, r.output
    assert (warm_site / "net.surgery.toml").read_bytes() == before


def test_save_cache_without_a_key_refuses_and_writes_nothing(site, no_key) -> None:
    model, x = _net(), torch.randn(2, 8)
    with torch.no_grad(), apply_manifest(model, str(site / "net.surgery.toml"),
                                         warmup=lambda m: m(x), overrides=AOT) as handle, \
            pytest.raises(CacheKeyError, match="no key to sign") as info:
        handle.save_cache()
    assert "secrets.token_hex(32)" in (info.value.hint or "")
    assert not (site / "net.surgery.cache").exists()


def test_warm_counts_an_indexes_shards_as_its_inputs(tmp_path) -> None:
    """`warm --manifest model.index.json -o SHARD --force` must not overwrite a shard: the shards
    an index names are inputs. The index is read as every index is (bounded, its shards kept in
    its folder), so a hostile one adds no name outside it and a broken one adds none."""
    from surgery.runtime.warm import _inputs

    index = tmp_path / "model.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors",
                                                "b": "model-2.safetensors"}}))
    got = _inputs(str(index), key_file=None, factories=[])
    assert got == [str(index), str(tmp_path / "model-1.safetensors"),
                   str(tmp_path / "model-2.safetensors")]
    index.write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    assert _inputs(str(index), key_file=None, factories=[]) == [str(index)]
    index.write_text("[" * 100_000)
    assert _inputs(str(index), key_file=None, factories=[]) == [str(index)]


@pytest.mark.slow  # inductor on the CPU: only its compiles leave artifacts to bundle
def test_warm_signs_with_the_key_file_it_was_given(warm_site, no_key) -> None:
    """`warm --key-file` reaches the signer (ApplyHandle.save_cache(key=)): with no key in the
    environment the bundle is written, verifies with that key, and with no other."""
    from surgery.errors import CacheSignatureError

    (warm_site / "cache.key").write_text(KEY_HEX)

    (warm_site / "cache.key").chmod(0o600)
    r = CliRunner().invoke(cli, [*WARM, "--key-file", "cache.key"])
    assert r.exit_code == 0, r.output
    path = str(warm_site / "net.surgery.cache")
    meta, _ = bundle.read_bundle(path, key=KEY)
    assert meta["format"] in bundle.READ_FORMATS
    with pytest.raises(CacheSignatureError, match="signature does not verify"):
        bundle.read_bundle(path, key=ATTACKER_KEY)
