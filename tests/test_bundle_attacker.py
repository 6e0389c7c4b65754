"""The bundle as an attacker's file: nothing of a forged, edited, copied or stale bundle is
unpickled, and a verified one is not handed to torch where others could swap its code.

The proof runs in a fresh process with a Python audit hook (``sys.addaudithook``), which sees
every ``pickle.find_class`` (any unpickler, C or Python, resolving a global: what a payload
needs) and every ``ctypes.dlopen``, whichever code path makes them, not only the functions a
spy wraps. Each bundle carries two payloads: a Mega-Cache inductor entry and a precompiled
artifact, each a pickle that calls ``payloadmod.pwn`` (a marker file) when it is unpickled. The
control, a genuine bundle signed with the deployer's key holding the same payloads, shows that
the hook and the markers do see them run; each attack must leave no trace of them.

Also here: surgery.runtime.private_dirs (torch's cache folders must be this user's), and what
a 100 KB hostile bundle costs in time and memory.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from bundle_support import EMPTY_BLOB, KEY, KEY_HEX, TWO_BLOCKS_SRC, torch_cache_blob

from surgery.formats.manifest import Manifest, Region
from surgery.runtime import bundle, cache, private_dirs, signing

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTACKER_KEY = bytes(range(32))

PAYLOAD_SRC = textwrap.dedent('''
    def pwn(path):
        with open(path, "w") as f:
            f.write("ran")
        return path
''')

# The deploying process: builds a genuine bundle (aot_eager, precompiled part; inductor where
# aot_eager records no cache artifact, as on torch 2.11), then, for each
# attack, writes the attacker's bundle in its place and deploys a new model from it.
ATTACK_SRC = textwrap.dedent('''
    import json, os, pathlib, pickle, sys, warnings
    import torch
    import premod, payloadmod
    from bundle_support import EMPTY_BLOB, KEY, torch_cache_blob
    from surgery.runtime import bundle
    from surgery.runtime.apply import apply_manifest
    from surgery.runtime.report import SurgeryWarning

    AOT = {"backend": "aot_eager", "on_cpu": "compile"}
    ATTACKER_KEY = bytes(range(32))
    EVENTS, WATCH = [], [False]

    def hook(event, args):
        if WATCH[0] and event in ("pickle.find_class", "ctypes.dlopen"):
            EVENTS.append([event, " ".join(map(str, args))[:120]])

    sys.addaudithook(hook)

    class Pwn:
        def __init__(self, path):
            self.path = path
        def __reduce__(self):
            return (payloadmod.pwn, (self.path,))

    from surgery.errors import CacheBundleError

    def genuine_bundle(overrides):
        model = premod.build().eval()
        with torch.no_grad():
            h = apply_manifest(model, "net.surgery.toml", warmup=premod.step,
                               overrides=overrides, passes=2)
        try:
            return h.save_cache().metadata
        finally:
            h.restore()

    try:
        genuine = genuine_bundle(AOT)
    except CacheBundleError:  # torch 2.11: aot_eager records no AOTAutograd cache artifact
        torch._dynamo.reset()
        AOT = {"backend": "inductor", "on_cpu": "compile"}  # the attacks' applies must fit it
        genuine = genuine_bundle(AOT)
    genuine_bytes = open("net.surgery.cache", "rb").read()
    assert genuine["precompiled"]["entries"], genuine["precompiled"]

    def payload_bundle(tag, *, key=KEY, meta=None):
        """The genuine record, its Mega-Cache part and its artifact replaced by payloads."""
        mega = torch_cache_blob([("inductor", [("fevilgraph" + tag,
                                               pickle.dumps(Pwn(tag + ".mega")))])])
        art = pickle.dumps(Pwn(tag + ".artifact"))
        meta = dict(genuine if meta is None else meta)
        entry = meta["precompiled"]["entries"][0]
        meta["precompiled"] = {**meta["precompiled"], "bytes": len(art),
                               "entries": [{**entry, "offset": 0, "bytes": len(art)}]}
        meta["artifacts"] = {"inductor": 1}
        bundle.write_bundle("net.surgery.cache", mega + art, meta, key=key)

    def attack(tag):
        # a cache folder of its own for each attack, so that one's planted entry is not another's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath("inductor-" + tag)
        if tag == "attacker-key":  # knows the layout and the record, signs with their own key
            payload_bundle(tag, key=ATTACKER_KEY)
        elif tag == "edited":  # the genuine signature kept, the contents replaced
            payload_bundle(tag)
            data = open("net.surgery.cache", "rb").read()
            head = bundle._HEADER.size
            open("net.surgery.cache", "wb").write(data[:24] + genuine_bytes[24:head]
                                                  + data[head:])
        elif tag == "another-machine":  # genuine, signed, but built for another torch and GPU
            env = {**genuine["env"], "torch": "2.99.0", "device": "NVIDIA H200"}
            payload_bundle(tag, meta={**genuine, "env": env})
        elif tag == "stale":  # genuine, signed, for another model (fingerprint)
            payload_bundle(tag, meta={**genuine, "manifest": {
                **genuine["manifest"], "fingerprint": "sha256:" + "0" * 64}})
        elif tag == "shared-cache-dir":  # genuine and fitting, but others can write torch's cache
            payload_bundle(tag)
            shared = os.path.abspath("shared-inductor")
            os.makedirs(shared, exist_ok=True)
            os.chmod(shared, 0o777)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = shared
        elif tag == "control":  # genuine and fitting: the payloads are reached
            payload_bundle(tag)
        torch._dynamo.reset()
        EVENTS.clear()
        model = premod.build().eval()
        want = model(premod.X)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            WATCH[0] = True
            try:
                with torch.no_grad():
                    h = apply_manifest(model, "net.surgery.toml", warmup=premod.step,
                                       overrides=AOT, cache=True, passes=1)
                    got = premod.step(model)
            finally:
                WATCH[0] = False
        loaded = h.report.cache.loaded
        h.restore()
        cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        planted = [str(p) for p in pathlib.Path(cache_dir).rglob("fevil*")]
        return {"warnings": [str(w.message) for w in caught
                             if issubclass(w.category, SurgeryWarning)],
                "events": list(EVENTS),
                "markers": sorted(p for p in os.listdir(".") if p.startswith(tag + ".")),
                "planted": planted, "loaded": loaded,
                "same": torch.equal(got, want) if AOT["backend"] == "aot_eager"
                else torch.allclose(got, want, rtol=1e-4, atol=1e-5)}

    print(json.dumps({tag: attack(tag) for tag in sys.argv[1:]}))
''')

ATTACKS = ["attacker-key", "edited", "another-machine", "stale", "shared-cache-dir"]
WHY = {"attacker-key": "signature does not verify", "edited": "signature does not verify",
       "another-machine": "torch 2.99.0 when built", "stale": "built for model fingerprint",
       "shared-cache-dir": "is writable by others"}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("attacked")
    (site / "premod.py").write_text(TWO_BLOCKS_SRC + textwrap.dedent('''
        X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

        def step(model):
            with torch.no_grad():
                return model(X)
    '''))
    (site / "payloadmod.py").write_text(PAYLOAD_SRC)
    sys.path.insert(0, str(site))
    try:
        import premod  # type: ignore[import-not-found]

        from surgery.formats.fingerprint import compute_fingerprint
        from surgery.formats.manifest import DEFAULT_COMPILE, save_manifest

        m = Manifest(compute_fingerprint(premod.build().state_dict()),
                     [Region("block", ["blocks.0", "blocks.1"])],
                     compile={**DEFAULT_COMPILE, "on_cpu": "compile"})
        save_manifest(m, str(site / "net.surgery.toml"))
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("premod", None)
    env = {**os.environ, signing.ENV_KEY: KEY_HEX,
           "TORCHINDUCTOR_CACHE_DIR": str(site / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(site), HERE, os.path.join(HERE, "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop(signing.ENV_KEY_FILE, None)
    (site / "attack.py").write_text(ATTACK_SRC)
    r = subprocess.run([sys.executable, "attack.py", *ATTACKS, "control"], cwd=site, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_control_a_genuine_bundle_with_payloads_runs_them(attacked) -> None:
    """The hook and the markers see a payload run: the attacks' clean results mean something."""
    got = attacked["control"]
    assert got["loaded"] is True
    assert "control.artifact" in got["markers"], got
    assert any(e[0] == "pickle.find_class" and "payloadmod" in e[1] for e in got["events"])
    # torch 2.13 unpickles the Mega-Cache entry at load, torch 2.14 stores it unread
    assert "control.mega" in got["markers"] or got["planted"], got


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attackers_bundle_is_refused_before_anything_is_unpickled(attacked, attack) -> None:
    got = attacked[attack]
    # not the payload's global, and no other either: nothing at all was unpickled or dlopened
    assert got["events"] == [], f"{attack}: unpickled or dlopened: {got['events']}"
    assert got["markers"] == [] and got["planted"] == [], got
    assert got["loaded"] is False and got["same"] is True
    assert len(got["warnings"]) == 1 and WHY[attack] in got["warnings"][0], got["warnings"]


# --- torch's cache folders must be this user's (surgery.runtime.private_dirs) ------------------

def test_a_private_folder_passes_and_a_missing_one_is_made_private(tmp_path) -> None:
    assert private_dirs.dir_problem(str(tmp_path), "X") is None
    new = tmp_path / "a" / "b"
    assert private_dirs.dir_problem(str(new), "X") is None
    assert stat.S_IMODE(new.stat().st_mode) & 0o077 == 0


def test_a_folder_others_can_write_is_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    why = private_dirs.dir_problem(str(shared), "TORCHINDUCTOR_CACHE_DIR")
    assert why and "writable by others (mode 0777)" in why and "TORCHINDUCTOR_CACHE_DIR" in why


def test_a_folder_below_an_open_folder_is_refused_unless_it_is_sticky(tmp_path) -> None:
    top = tmp_path / "top"
    (top / "cache").mkdir(parents=True)
    top.chmod(0o777)  # anyone could rename `cache` away and put their own in its place
    why = private_dirs.dir_problem(str(top / "cache"), "X")
    assert why and f"the folder {top} above" in why
    top.chmod(0o777 | stat.S_ISVTX)  # as /tmp: only the owner may rename what is inside
    assert private_dirs.dir_problem(str(top / "cache"), "X") is None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a folder to another user needs root")
def test_a_folder_another_user_made_is_refused(tmp_path) -> None:
    """/tmp/torchinductor_$USER made first by someone else (anyone may create it in /tmp)."""
    theirs = tmp_path / "torchinductor_victim"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    why = private_dirs.dir_problem(str(theirs), "X")
    assert why and "belongs to uid 65534" in why


def test_the_default_folder_is_torchs(monkeypatch) -> None:
    """The mirror of torch's default (private_dirs imports nothing of inductor) is torch's."""
    cache_dir_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    monkeypatch.delenv(private_dirs.INDUCTOR_DIR_ENV, raising=False)
    assert private_dirs.inductor_cache_dir() == os.path.abspath(
        cache_dir_utils.default_cache_dir())


# --- 100 KB hostile bundles: time and memory ---------------------------------------------------

def _hostile(tmp_path: Path) -> dict[str, Path]:
    """Bundles of about 100 KB an attacker (or a buggy key holder) could hand over."""
    out: dict[str, Path] = {}
    manifest = Manifest("sha256:" + "0" * 64, [Region("lin", ["a"])])
    meta = cache.bundle_metadata(manifest, overrides={}, env=cache.environment(device="cpu"),
                                 artifacts={})

    def raw(name: str, text: bytes, blob: bytes, *, key: bytes, lengths: bytes | None = None
            ) -> None:
        n = lengths or struct.pack("<QQ", len(text), len(blob))
        tag = signing.mac(key, bundle.MAGIC, n, text, blob)
        out[name] = tmp_path / f"{name}.surgery.cache"
        out[name].write_bytes(bundle.MAGIC + n + tag + text + blob)

    body = os.urandom(100_000)
    raw("forged", json.dumps(meta).encode(), body, key=ATTACKER_KEY)
    raw("promises-a-terabyte", b"{}", body, key=ATTACKER_KEY,
        lengths=struct.pack("<QQ", 2, 2**40))
    raw("signed-deep-json", b"[" * 50_000 + b"]" * 50_000, b"", key=KEY)
    # 100 KB of artifact framing, signed: 2500 tiny artifacts, each key checked
    many = torch_cache_blob([("autotune", [(f"ab/{i:06d}.best_config", b"{}")
                                          for i in range(2500)])])
    # (built for another torch: the framing and every key are read, then the record does not
    # fit, so none reaches torch; a fitting one is the key holder's, loaded by torch)
    out["signed-many-artifacts"] = tmp_path / "signed-many-artifacts.surgery.cache"
    bundle.write_bundle(str(out["signed-many-artifacts"]), many,
                        {**meta, "env": {**meta["env"], "torch": "2.99.0"}}, key=KEY)
    # a signed precompiled index of 12000 entries in 100 KB (the reader allows 4096)
    pre = {**meta, "format": 3, "precompiled": {"format": 1, "bytes": 8000, "notes": [],
                                                "entries": [{}] * 12_000}}
    out["signed-huge-index"] = tmp_path / "signed-huge-index.surgery.cache"
    bundle.write_bundle(str(out["signed-huge-index"]), EMPTY_BLOB + b"x" * 8000, pre, key=KEY)
    return out


# How far each gets: the forged ones not past the MAC, the signed ones to the check they fail.
WHY_HOSTILE = {"forged": "signature does not verify", "promises-a-terabyte": "beyond the limit",
               "signed-deep-json": "corrupt metadata",
               "signed-many-artifacts": "torch 2.99.0 when built",
               "signed-huge-index": "refused"}


def test_a_100kb_hostile_bundle_is_refused_in_little_time_and_memory(tmp_path,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv(signing.ENV_KEY, KEY_HEX)
    monkeypatch.setenv(private_dirs.INDUCTOR_DIR_ENV, str(tmp_path / "inductor"))
    manifest = Manifest("sha256:" + "0" * 64, [Region("lin", ["a"])])
    for name, path in _hostile(tmp_path).items():
        assert path.stat().st_size < 200_000
        tracemalloc.start()
        t = time.perf_counter()
        opened = cache.open_bundle(str(path), manifest=manifest, overrides={}, device="cpu")
        took = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert opened.loaded is False and opened.reason, name
        assert WHY_HOSTILE[name] in opened.reason, (name, opened.reason)
        assert took < 2.0, f"{name}: {took:.2f} s"
        assert peak < 32 * 2**20, f"{name}: {peak / 2**20:.1f} MiB"
