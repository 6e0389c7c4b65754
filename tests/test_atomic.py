"""atomic.py: every writer publishes all or nothing, never in place, never through a symlink.

Each test makes a write fail (or race) at a chosen point and checks the destination byte for
byte: a writer that wrote in place, skipped the no-replace check or left shards behind fails.
Killed and terminated processes are in test_atomic_kill.py.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from surgery.errors import OutputExistsError, SurgeryError
from surgery.formats import atomic, safe_write
from surgery.formats.atomic import TEMP_MARK, AtomicGroup
from surgery.formats.safe_write import recover, write_text_atomic
from surgery.hygiene import export_checkpoint

OLD = b"# the previous manifest\n" * 50


def tensors(n: int = 6, size: int = 4096, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"blocks.{i}.weight": rng.standard_normal(size).astype(np.float32)
            for i in range(n)}


def make_source(folder: Path, *, seed: int = 0, n: int = 6, size: int = 4096) -> str:
    path = str(folder / f"src{seed}.safetensors")
    save_file(tensors(n, size, seed), path)
    return path


def assert_loads_as(path: str, expected: dict[str, np.ndarray]) -> None:
    with safe_open(path, framework="numpy") as f:
        assert set(f.keys()) == set(expected)
        for k, v in expected.items():
            assert np.array_equal(f.get_tensor(k), v), k


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every entry of the folder (hidden ones included) with its bytes."""
    return {p.name: (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<link>")
            for p in sorted(folder.iterdir())}


def fail_writes_after(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """Every os.write after `limit` bytes fails with ENOSPC, as a full disk does.

    copy_file_range is refused too, so the safetensors copy goes through os.write."""
    real_write = os.write
    written = 0

    def write(fd: int, data: bytes | memoryview) -> int:
        nonlocal written
        n = len(memoryview(data).cast("B"))
        if written + n > limit:
            room = max(limit - written, 0)
            if room:
                written += real_write(fd, memoryview(data).cast("B")[:room])
                return room
            raise OSError(errno.ENOSPC, "No space left on device")
        written += n
        return real_write(fd, data)

    def no_copy(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "copy_file_range", no_copy)


# --- a failure mid-write leaves the previous file byte for byte, and no temp ---------------------

def test_manifest_write_failure_keeps_previous_file(tmp_path, monkeypatch) -> None:
    dest = tmp_path / "m.surgery.toml"
    dest.write_bytes(OLD)
    fail_writes_after(monkeypatch, 1000)
    with pytest.raises(SurgeryError, match="cannot write: No space left"):
        write_text_atomic(str(dest), "x = 1\n" * 5000, force=True)
    assert snapshot(tmp_path) == {"m.surgery.toml": OLD}


def test_manifest_write_succeeds_and_replaces_with_force(tmp_path) -> None:
    dest = tmp_path / "m.surgery.toml"
    dest.write_bytes(OLD)
    with pytest.raises(OutputExistsError):
        write_text_atomic(str(dest), "new\n")
    write_text_atomic(str(dest), "new\n", force=True)
    assert snapshot(tmp_path) == {"m.surgery.toml": b"new\n"}


def test_single_file_export_failure_keeps_previous_file(tmp_path, monkeypatch) -> None:
    src = make_source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "model.safetensors"
    dest.write_bytes(OLD)
    fail_writes_after(monkeypatch, 30_000)  # inside the third tensor
    with pytest.raises(SurgeryError, match="No space left"):
        export_checkpoint(src, out=str(dest), force=True)
    assert snapshot(out) == {"model.safetensors": OLD}


def test_sharded_export_failure_mid_shard_leaves_nothing_and_rerun_works(
        tmp_path, monkeypatch) -> None:
    src = make_source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    dest = str(out / "model.safetensors")
    with monkeypatch.context() as m:
        fail_writes_after(m, 40_000)  # shards of 2 tensors (32 KB each): fails in the second
        with pytest.raises(SurgeryError, match="No space left"):
            export_checkpoint(src, out=dest, max_shard_size=33_000)
    assert snapshot(out) == {}
    result = export_checkpoint(src, out=dest, max_shard_size=33_000)
    assert len(result.files) == 3 and result.index is not None
    assert sorted(os.listdir(out)) == sorted(
        [os.path.basename(f) for f in result.files] + ["model.safetensors.index.json"])


def _fail_link_to(monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    """Publishing the file whose name ends in `suffix` fails (a disk full at the last step)."""
    real_link, real_replace = os.link, os.replace

    def link(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(dst).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_link(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(dst).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)


def test_sharded_export_index_failure_takes_back_published_shards(tmp_path, monkeypatch) -> None:
    """Shards and index together or not at all: the index fails last, so every shard is
    already published and must be taken back."""
    src = make_source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "unrelated.txt").write_bytes(b"keep me")
    with monkeypatch.context() as m:
        _fail_link_to(m, ".index.json")
        with pytest.raises(SurgeryError, match="No space left"):
            export_checkpoint(src, out=str(out / "model.safetensors"), max_shard_size=33_000)
    assert snapshot(out) == {"unrelated.txt": b"keep me"}


def test_forced_sharded_export_failure_puts_previous_set_back(tmp_path, monkeypatch) -> None:
    """With --force the replaced shards are restored byte for byte when the index fails."""
    out = tmp_path / "out"
    out.mkdir()
    dest = str(out / "model.safetensors")
    export_checkpoint(make_source(tmp_path, seed=1), out=dest, max_shard_size=33_000)
    before = snapshot(out)
    with monkeypatch.context() as m:
        _fail_link_to(m, ".index.json")
        with pytest.raises(SurgeryError, match="No space left"):
            export_checkpoint(make_source(tmp_path, seed=2), out=dest, max_shard_size=33_000,
                              force=True)
    assert snapshot(out) == before
    export_checkpoint(make_source(tmp_path, seed=2), out=dest, max_shard_size=33_000,
                      force=True)
    assert snapshot(out) != before and not [n for n in os.listdir(out) if TEMP_MARK in n]


# --- a real full disk: a 1 MiB tmpfs --------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the injected-failure tests cover this")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); injected failures cover it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_single_and_sharded_leave_destination_as_it_was(tmp_path, small_fs) -> None:
    src = make_source(tmp_path, n=8, size=64 * 1024)  # 2 MiB of tensors: cannot fit in 1 MiB
    old = small_fs / "model.safetensors"
    old.write_bytes(OLD)
    with pytest.raises(SurgeryError, match="No space left"):
        export_checkpoint(src, out=str(old), force=True)
    assert snapshot(small_fs) == {"model.safetensors": OLD}
    sharded = str(small_fs / "sharded.safetensors")
    with pytest.raises(SurgeryError, match="No space left"):
        export_checkpoint(src, out=sharded, max_shard_size=300_000)
    assert snapshot(small_fs) == {"model.safetensors": OLD}
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_fs)], check=True)
    result = export_checkpoint(src, out=sharded, max_shard_size=300_000)
    assert len(result.files) == 8
    assert snapshot(small_fs)["model.safetensors"] == OLD


# --- symlinks planted at temp names and at the destination ---------------------------------------

def test_symlink_at_old_predictable_temp_name_is_not_followed(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "m.surgery.toml"
    # The name the writer used before: ".NAME.PID.tmp" (and its export twin).
    for name in (f".m.surgery.toml.{os.getpid()}.tmp", f".m.surgery.toml.{os.getpid()}"):
        (out / name).symlink_to(victim)
    write_text_atomic(str(dest), "x = 1\n")
    assert victim.read_bytes() == b"precious"
    assert dest.read_bytes() == b"x = 1\n" and not dest.is_symlink()


def test_symlink_at_the_drawn_temp_name_is_not_followed(tmp_path, monkeypatch) -> None:
    """Even a symlink at exactly the name the writer draws cannot redirect it (O_EXCL)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    drawn = iter(["aaaaaaaaaaaa", "aaaaaaaaaaaa", "bbbbbbbbbbbb"] * 10)
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(drawn))
    planted = out / f".model.safetensors{TEMP_MARK}{os.getpid()}-aaaaaaaaaaaa"
    planted.symlink_to(victim)
    src = make_source(tmp_path)
    export_checkpoint(src, out=str(out / "model.safetensors"))
    assert victim.read_bytes() == b"precious"
    assert planted.is_symlink()  # left alone: not ours to remove while a live pid names it
    assert_loads_as(str(out / "model.safetensors"), tensors())


def test_symlink_at_destination_is_replaced_not_written_through(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dest = tmp_path / "m.surgery.toml"
    dest.symlink_to(victim)
    with pytest.raises(OutputExistsError):
        write_text_atomic(str(dest), "x = 1\n")
    write_text_atomic(str(dest), "x = 1\n", force=True)
    assert victim.read_bytes() == b"precious"
    assert not dest.is_symlink() and dest.read_bytes() == b"x = 1\n"


# --- a file that appears while writing is never replaced ------------------------------------------

def test_publish_refuses_a_file_that_appeared_meanwhile(tmp_path) -> None:
    dest = tmp_path / "model.safetensors"
    with pytest.raises(OutputExistsError), AtomicGroup() as group:
        os.write(group.create(str(dest)), b"ours")
        dest.write_bytes(b"theirs")  # after every check a writer makes before publishing
        group.commit()
    assert snapshot(tmp_path) == {"model.safetensors": b"theirs"}


def test_publish_without_hard_links_still_refuses(tmp_path, monkeypatch) -> None:
    """On a file system without hard links, renameat2(RENAME_NOREPLACE) does the refusing."""
    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    dest = tmp_path / "m.toml"
    with pytest.raises(OutputExistsError), AtomicGroup() as group:
        os.write(group.create(str(dest)), b"ours")
        dest.write_bytes(b"theirs")
        group.commit()
    assert snapshot(tmp_path) == {"m.toml": b"theirs"}
    write_text_atomic(str(tmp_path / "n.toml"), "fine\n")
    assert snapshot(tmp_path) == {"m.toml": b"theirs", "n.toml": b"fine\n"}


def test_two_concurrent_exports_one_wins_one_output_exists(tmp_path, monkeypatch) -> None:
    """Both pass the start-of-run check (a barrier holds them until both wrote their temps);
    exactly one publish succeeds, the other is refused, and its temps are gone."""
    out = tmp_path / "out"
    out.mkdir()
    dest = str(out / "model.safetensors")
    sources = [make_source(tmp_path, seed=s) for s in (1, 2)]
    barrier = threading.Barrier(2, timeout=60)
    real_commit = AtomicGroup.commit

    def commit(self: AtomicGroup) -> None:
        barrier.wait()
        real_commit(self)

    monkeypatch.setattr(AtomicGroup, "commit", commit)
    outcomes: dict[int, BaseException | None] = {}

    def run(i: int) -> None:
        try:
            export_checkpoint(sources[i], out=dest, max_shard_size=33_000)
            outcomes[i] = None
        except BaseException as e:  # recorded, asserted below
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [i for i, e in outcomes.items() if e is None]
    losers = [e for e in outcomes.values() if e is not None]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert isinstance(losers[0], OutputExistsError) and losers[0].exit_code == 3
    with open(dest + ".index.json") as f:
        import json

        shard_names = set(json.load(f)["weight_map"].values())
    expected = tensors(seed=(1, 2)[winners[0]])
    got: dict[str, np.ndarray] = {}
    for name in shard_names:
        with safe_open(str(out / name), framework="numpy") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert set(got) == set(expected)
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    assert not [n for n in os.listdir(out) if TEMP_MARK in n]


# --- what a killed run leaves is proven its own before it is removed -----------------------------

def test_recover_only_touches_dead_writers_of_this_destination(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(safe_write, "_STARTED", 2e9)  # everything on disk predates "this run"
    dest = tmp_path / "m.toml"
    p = subprocess.Popen(["true"])  # a pid that has exited
    p.wait()
    stale = tmp_path / f".m.toml{TEMP_MARK}{p.pid}-0123456789ab"
    live = tmp_path / f".m.toml{TEMP_MARK}{os.getppid()}-0123456789ab"
    other = tmp_path / f".n.toml{TEMP_MARK}{p.pid}-0123456789ab"
    odd = tmp_path / f".m.toml{TEMP_MARK}{p.pid}-not-ours"
    for f in (stale, live, other, odd):
        f.write_bytes(b"t")
    notes = recover([str(dest)])
    assert [n.split(":")[0] for n in notes] == [str(stale)]
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(
        x.name for x in (live, other, odd))


def test_warm_refuses_to_overwrite_its_own_manifest(tmp_path) -> None:
    """`surgery warm -o` naming the manifest (or a link to it) is refused even with --force."""
    from click.testing import CliRunner

    from surgery.cli import cli

    manifest = tmp_path / "tiny.surgery.toml"
    r = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "-o", str(manifest)])
    assert r.exit_code == 0, r.output
    before = manifest.read_bytes()
    (tmp_path / "alias.toml").symlink_to(manifest)
    for out in (manifest, tmp_path / "alias.toml"):
        r = CliRunner().invoke(cli, ["warm", "--model", "surgery.examples:tiny", "--manifest",
                                     str(manifest), "--input", "surgery.examples:example_input",
                                     "--device", "cpu", "-o", str(out), "--force"])
        assert r.exit_code == 3 and "is the manifest being warmed" in r.stderr, r.output
    assert manifest.read_bytes() == before
