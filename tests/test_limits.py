"""The resource contract's shared pieces (surgery.formats.limits): only regular files are read,
to the size stat reported; each limit is raised by its env var and by nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from surgery.errors import CacheKeyError, ManifestError
from surgery.formats.limits import (
    LIMITS,
    NotRegularFile,
    env_var,
    limit,
    read_regular,
    read_regular_stat,
)
from surgery.formats.manifest import load_manifest
from surgery.runtime import signing
from tests.capped import assert_refused, surgery_capped


def _specials(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.surgery.toml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.surgery.toml"
    zero.symlink_to("/dev/zero")  # st_size 0, never ends
    folder = tmp_path / "dir.surgery.toml"
    folder.mkdir()
    return {"fifo": fifo, "zero": zero, "folder": folder}


def test_manifest_that_is_a_fifo_or_dev_zero_is_refused_without_hanging(tmp_path: Path) -> None:
    specials = _specials(tmp_path)
    for name, path in specials.items():
        with pytest.raises(ManifestError, match="not a regular file") as info:
            load_manifest(path)
        assert "\n" not in info.value.message, name
    # The CLI too, capped: before the fix a FIFO hung `check` and /dev/zero ate memory.
    r = surgery_capped("check", str(specials["fifo"]), timeout=30)
    assert_refused(r, names="a FIFO")
    r = surgery_capped("verify", "--manifest", str(specials["zero"]),
                       str(specials["zero"]), timeout=30)
    assert r.rc == 3 and "Traceback" not in r.output, r.output


def test_read_regular_stops_at_the_reported_size(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    assert read_regular(str(f), max_bytes=10) == b"abc"
    with pytest.raises(OverflowError):
        read_regular(str(f), max_bytes=2)
    with pytest.raises(NotRegularFile, match="character device"):
        read_regular("/dev/zero", max_bytes=10)


def test_key_file_fifo_device_and_world_writable_are_refused(tmp_path: Path) -> None:
    specials = _specials(tmp_path)
    for path in (specials["fifo"], specials["zero"]):
        with pytest.raises(CacheKeyError, match="cannot read the cache key file"):
            signing.load_key(path)
    key = tmp_path / "cache.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    assert signing.load_key(key) == bytes.fromhex("ab" * 32)
    key.chmod(0o666)
    with pytest.raises(CacheKeyError, match="world-writable"):
        signing.load_key(key)
    with pytest.raises(CacheKeyError, match="world-writable"):
        signing.load_key(environ={signing.ENV_KEY_FILE: str(key)})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o610])
def test_a_key_file_others_can_read_or_change_is_refused(tmp_path: Path, mode: int) -> None:
    """HMAC is symmetric: whoever reads the key signs bundles that run in the deployer's
    process (a plain `> cache.key` under umask 022 gives 0644)."""
    key = tmp_path / "cache.key"
    key.write_text("ab" * 32)
    key.chmod(mode)
    with pytest.raises(CacheKeyError, match=f"has mode {mode:04o}") as info:
        signing.load_key(key)
    assert f"chmod 600 {key}" in (info.value.hint or "")
    key.chmod(0o400)
    assert signing.load_key(key) == bytes.fromhex("ab" * 32)


def test_a_key_file_is_judged_by_the_file_read_not_by_what_the_path_names_after(
        tmp_path: Path, monkeypatch) -> None:
    """The mode and owner checked are those of the very file whose bytes became the key (its
    fstat): a private file put at the path after the read, or a path stat'ed a second time,
    must not vouch for a readable key."""
    key = tmp_path / "cache.key"
    key.write_text("ab" * 32)
    key.chmod(0o644)
    private = tmp_path / "private.key"
    private.write_text("cd" * 32)
    private.chmod(0o600)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(
        private if os.fspath(p) == os.fspath(key) else p, *a, **k))
    with pytest.raises(CacheKeyError, match="has mode 0644"):
        signing.load_key(key)
    assert read_regular_stat(key, max_bytes=4096)[1].st_mode & 0o777 == 0o644


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_a_key_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "cache.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    os.chown(key, 65534, 65534)  # nobody: they could rewrite it and sign with their own key
    with pytest.raises(CacheKeyError, match="belongs to uid 65534"):
        signing.load_key(key)


def test_a_limit_is_raised_by_its_env_var_only(monkeypatch) -> None:
    for name, lim in LIMITS.items():
        monkeypatch.delenv(env_var(name), raising=False)
        assert limit(name) == lim.default
        monkeypatch.setenv(env_var(name), str(lim.default * 3))
        assert limit(name) == lim.default * 3
        for junk in ("", "0", "-5", "lots", "1e9"):  # a typo never lifts a bound
            monkeypatch.setenv(env_var(name), junk)
            assert limit(name) == lim.default
