"""surgery.runtime.torch_key_stamp: torch's source key recorded by `surgery bytecode` and handed
to torch by a warm start, only while the stamp of torch's files still matches.

The fresh interpreters here set the key from a record and then ask torch for it: a record whose
key is not torch's real one (``FAKE``) shows that torch took it, and was not computing its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from surgery.runtime import torch_key_stamp as tks

FAKE = "01" * 32
ROOT = str(Path(__file__).resolve().parents[1])

_CHILD = textwrap.dedent("""
    import json, sys
    from torch._inductor.codecache import torch_key
    from surgery.runtime import torch_key_stamp
    status = torch_key_stamp.preset(sys.argv[1])
    print(json.dumps({"status": status, "key": torch_key().hex()}))
""")


def _child(folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _record(**change: object) -> dict:
    rec = {"format": tks.FORMAT, "torch": "x", "stamp": tks.stamp(), "torch_key": FAKE}
    rec.update(change)
    return rec


def test_the_stamp_follows_size_mtime_and_new_modules_only(tmp_path) -> None:
    root = tmp_path / "torch"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.so").write_bytes(b"\0" * 8)
    first = tks.stamp(str(root), "1.0")
    assert tks.stamp(str(root), "1.0") == first
    assert tks.stamp(str(root), "1.1") != first  # another version
    (root / "notes.txt").write_text("not a module")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"bytecode")
    assert tks.stamp(str(root), "1.0") == first  # neither is read by torch's key
    (root / "a.py").write_text("x = 22\n")  # size
    second = tks.stamp(str(root), "1.0")
    assert second != first
    st = os.stat(root / "a.py")
    os.utime(root / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # mtime only
    assert tks.stamp(str(root), "1.0") != second
    third = tks.stamp(str(root), "1.0")
    (root / "sub" / "c.py").write_text("")  # a new module
    assert tks.stamp(str(root), "1.0") != third


def test_a_matching_record_sets_torchs_key_in_a_fresh_process(tmp_path) -> None:
    tks.write(str(tmp_path), _record())
    got = _child(tmp_path)
    assert got == {"status": "set", "key": FAKE}
    assert (os.stat(tmp_path / tks.FILE).st_mode & 0o777) == 0o600


@pytest.mark.parametrize(("content", "reason"), [
    pytest.param(None, "stale", id="stale-stamp"),
    pytest.param(b"{not json", "not JSON", id="not-json"),
    pytest.param(b" " * (tks.MAX_BYTES + 10), "larger than", id="too-large"),
    pytest.param(json.dumps({"torch_key": FAKE}).encode(), "not a record", id="missing-fields"),
    pytest.param("extra", "not a record", id="extra-field"),
    pytest.param("short-key", "not a sha256", id="key-not-a-digest"),
    pytest.param("bool-format", "format", id="format-true"),
])
def test_a_stale_or_bad_record_leaves_torch_to_compute_its_key(tmp_path, content,
                                                               reason) -> None:
    if content is None:
        raw = json.dumps(_record(stamp="ab" * 32)).encode()
    elif content == "extra":
        raw = json.dumps({**_record(), "run": "rm -rf /"}).encode()
    elif content == "short-key":
        raw = json.dumps(_record(torch_key="01")).encode()
    elif content == "bool-format":
        raw = json.dumps(_record(format=True)).encode()
    else:
        assert isinstance(content, bytes)
        raw = content
    (tmp_path / tks.FILE).write_bytes(raw)
    got = _child(tmp_path)
    assert reason in got["status"] and got["status"] != "set", got
    assert got["key"] != FAKE and len(got["key"]) == 64  # torch's own


def test_no_folder_or_no_file_says_so(monkeypatch) -> None:
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert "PYTHONPYCACHEPREFIX unset" in tks.preset()
    assert "no surgery-torch-key.json" in tks.preset("/nonexistent-folder-for-this-test")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_or_a_folder_in_the_records_place_is_refused_without_blocking(tmp_path) -> None:
    os.mkfifo(tmp_path / tks.FILE)
    assert tks.preset(str(tmp_path)) == f"{tks.FILE} ignored: not a regular file"
    other = tmp_path / "other"
    (other / tks.FILE).mkdir(parents=True)
    assert tks.preset(str(other)) == f"{tks.FILE} ignored: not a regular file"


def test_a_record_that_would_not_read_back_is_never_written(tmp_path) -> None:
    with pytest.raises(ValueError, match="sha256"):
        tks.write(str(tmp_path), _record(torch_key="zz"))
    assert list(tmp_path.iterdir()) == []


def test_the_warm_loaders_key_thread_uses_the_record(tmp_path) -> None:
    """KeyPrefetch.start on CUDA presets torch's key first in its key thread (its torch_key()
    then returns at once); the summary says where the key came from."""
    tks.write(str(tmp_path), _record())
    code = textwrap.dedent("""
        import json, sys
        from surgery.runtime.warm_loader import KeyPrefetch
        pre = KeyPrefetch.start("cuda", build=False)
        pre.wait()
        from torch._inductor.codecache import torch_key
        print(json.dumps({"summary": pre.summary(), "key": torch_key().hex()}))
    """)
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["key"] == FAKE, (got, time.perf_counter() - t)
    assert got["summary"]["torch_key_record"] == "set"


def test_the_deployment_steps_discovery_records_torchs_real_key(tmp_path) -> None:
    """`surgery bytecode`'s discovery interpreter, given the warm path's code cache, returns
    torch's key with its stamp; the step writes it; a warm start then sets exactly that key.
    A module list without inductor's code cache records nothing."""
    from surgery.runtime import bytecode

    folder = tmp_path / "pyc"
    folder.mkdir(mode=0o700)
    files, key = bytecode._discover(("torch._inductor.codecache",), folder=str(folder))
    assert files and isinstance(key, dict), key
    line = bytecode._record_key(str(folder), key)
    assert line.startswith("recorded in ") and (folder / tks.FILE).exists(), line
    got = _child(folder)
    assert got == {"status": "set", "key": key["torch_key"]}
    from torch._inductor.codecache import torch_key

    assert key["torch_key"] == torch_key().hex()  # torch's own key, not a copy of it
    assert bytecode._discover(("json",), folder=str(folder))[1] is None
    assert bytecode._record_key(str(folder), None) == ""


@pytest.mark.parametrize(("lines", "want"), [
    pytest.param(['torch-key {"format": 1}'], {"format": 1}, id="record"),
    pytest.param(['torch-key-failed "ImportError: no"'], "ImportError: no", id="failed"),
    pytest.param(["torch-key {not json"], "the discovery printed a torch-key line that is not JSON",
                 id="not-json"),
    pytest.param(['torch-key [1, 2]'], "[1, 2]", id="not-an-object"),
    pytest.param(['torch-key {bad', 'torch-key {"format": 1}'], {"format": 1},
                 id="the-last-line-wins"),
    pytest.param(["hello", "torch-keys are fun"], None, id="none"),
])
def test_the_discoverys_key_line_is_read_back_without_raising(lines, want) -> None:
    """A module the discovery imports may print anything; a bad torch-key line is a reason,
    never a traceback from `surgery bytecode`."""
    from surgery.runtime import bytecode

    assert bytecode._key_line(lines) == want


def test_a_key_torch_computed_first_is_kept(tmp_path) -> None:
    """A process that asked torch for its key before the preset keeps torch's own key, and the
    reason says so (torch 2.14's setter raises, 2.11's asserts)."""
    tks.write(str(tmp_path), _record())
    code = textwrap.dedent("""
        import json, sys
        from torch._inductor.codecache import torch_key
        own = torch_key().hex()
        from surgery.runtime import torch_key_stamp
        status = torch_key_stamp.preset(sys.argv[1])
        print(json.dumps({"status": status, "own": own, "key": torch_key().hex()}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["status"] == "not set: torch computed its key in this process first", got
    assert got["key"] == got["own"] != FAKE

