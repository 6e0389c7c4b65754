"""No write touches a file that is not its own (issue 22), and the mutation-audit gaps of the
atomic writer: each test fails when the guarantee it names is broken."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from surgery.cli import cli
from surgery.errors import SurgeryError
from surgery.formats import atomic
from surgery.formats.atomic import TEMP_MARK, AtomicGroup
from surgery.formats.safe_write import recover, write_text_atomic

OLD = time.time() - 3600  # an hour before this test process started


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _sharded_export(tmp_path: Path) -> tuple[str, Path]:
    src = tmp_path / "src.safetensors"
    save_file({f"layers.{i}.w": torch.full((4096,), float(i)) for i in range(4)}, str(src))
    out = tmp_path / "out"
    out.mkdir()
    r = CliRunner().invoke(cli, ["export", str(src), "-o", str(out / "model.safetensors"),
                                 "--max-shard-size", "20KB"])
    assert r.exit_code == 0, r.output
    return str(src), out


def test_a_forged_dead_temp_hard_link_deletes_nothing(tmp_path: Path) -> None:
    """A hard link named like surgery's temp of a dead run, to an existing shard: a sharded
    export without --force must leave the shard (and the link) alone and exit 3."""
    src, out = _sharded_export(tmp_path)
    shard = out / "model-00001-of-00004.safetensors"
    before = shard.read_bytes()
    forged = out / f".{shard.name}{TEMP_MARK}{_dead_pid()}-0123456789ab"
    os.link(shard, forged)
    os.utime(forged, (OLD, OLD))
    r = CliRunner().invoke(cli, ["export", src, "-o", str(out / "model.safetensors"),
                                 "--max-shard-size", "20KB"])
    assert r.exit_code == 3, r.output
    assert "already exists" in r.stderr and "left alone" in r.stderr, r.stderr
    assert shard.read_bytes() == before
    assert forged.exists(), "the forged link was removed: cleanup removed a hard link"


def test_recover_removes_only_its_own_once_linked_old_temps(tmp_path: Path) -> None:
    """No _STARTED override: the age check decides against a temp newer than this process."""
    dest = tmp_path / "m.toml"
    pid = _dead_pid()
    old = tmp_path / f".m.toml{TEMP_MARK}{pid}-0123456789ab"
    new = tmp_path / f".m.toml{TEMP_MARK}{pid}-abcdefabcdef"
    victim = tmp_path / "victim.txt"
    linked = tmp_path / f".m.toml{TEMP_MARK}{pid}-aaaaaaaaaaaa"
    for f in (old, new, victim):
        f.write_bytes(b"t")
    os.link(victim, linked)
    os.utime(old, (OLD, OLD))
    os.utime(linked, (OLD, OLD))
    os.utime(new, (time.time() + 5, time.time() + 5))  # written after this run started
    notes = recover([str(dest)])
    assert not old.exists()
    assert new.exists() and linked.exists() and victim.read_bytes() == b"t"
    assert any(str(new) in n and "newer than this run" in n for n in notes), notes
    assert any(str(linked) in n and "2 names link to it" in n for n in notes), notes


@pytest.mark.parametrize("plant", ["regular", "hard-link"])
def test_o_excl_refuses_a_planted_file_at_the_drawn_temp_name(tmp_path: Path, monkeypatch,
                                                              plant: str) -> None:
    """The first temp name drawn is taken by a planted regular file or a hard link to another
    file (O_NOFOLLOW does not stop those; only O_EXCL does): neither is written to."""
    draws = iter(["0123456789ab", "fedcba987654"])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(draws))
    dest = tmp_path / "m.toml"
    planted = tmp_path / f".m.toml{TEMP_MARK}{os.getpid()}-0123456789ab"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"victim")
    if plant == "regular":
        planted.write_bytes(b"victim")
    else:
        os.link(victim, planted)
    write_text_atomic(str(dest), "new")
    assert dest.read_text() == "new"
    assert planted.read_bytes() == b"victim" and victim.read_bytes() == b"victim"


def test_a_temp_swapped_before_publish_is_taken_back(tmp_path: Path) -> None:
    """Someone renames another file over our temp between the write and the publish: the inode
    check refuses it, and the destination does not end up holding their file."""
    dest = tmp_path / "out.bin"
    theirs = tmp_path / "theirs.bin"
    theirs.write_bytes(b"theirs")
    with pytest.raises(SurgeryError, match="replaced by another process"), \
            AtomicGroup() as group:
        fd = group.create(str(dest))
        os.write(fd, b"ours")
        temp = tmp_path / group._items[0].temp
        os.replace(theirs, temp)
        group.commit()
    assert not dest.exists()


def test_export_refuses_a_derived_shard_or_index_that_is_an_input(tmp_path: Path) -> None:
    """`export model.safetensors.index.json -o model.safetensors --force` in the input's own
    folder: the index and shards it would write are the inputs. Refused even with --force."""
    _, out = _sharded_export(tmp_path)
    index = out / "model.safetensors.index.json"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = CliRunner().invoke(cli, ["export", str(index), "-o", str(out / "model.safetensors"),
                                 "--max-shard-size", "20KB", "--force"])
    assert r.exit_code == 3, r.output
    assert "which this run reads" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_warm_refuses_to_overwrite_the_key_file_from_the_environment(tmp_path: Path) -> None:
    manifest = tmp_path / "tiny.surgery.toml"
    r = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "-o", str(manifest)])
    assert r.exit_code == 0, r.output
    key = tmp_path / "cache.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    r = CliRunner(env={"SURGERY_CACHE_KEY_FILE": str(key), "SURGERY_CACHE_KEY": None}).invoke(
        cli, ["warm", "--model", "surgery.examples:tiny", "--manifest", str(manifest),
              "--input", "surgery.examples:example_input", "--device", "cpu", "-o", str(key),
              "--force"])
    assert r.exit_code == 3, r.output
    assert str(key) in r.stderr and "an input of this command" in r.stderr, r.stderr
    assert key.read_text() == "ab" * 32
