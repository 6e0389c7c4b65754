"""A bundle is bounded before its MAC (issue 22): the blob's length is checked against the file's
real size and SURGERY_MAX_BUNDLE_BYTES, the MAC is streamed, and the blob is read only after it
verifies. The sparse-file reproducer runs capped (tests/capped.py)."""

from __future__ import annotations

import struct
from pathlib import Path
from unittest import mock

import pytest
from bundle_support import KEY, KEY_HEX

from surgery.errors import CacheBundleError, CacheSignatureError
from surgery.runtime import bundle
from tests.capped import snippet_capped


def _forged(path: Path, blob_bytes: int, *, meta: bytes = b"{}") -> None:
    """A bundle header promising `blob_bytes` of blob, the file sparse to exactly that size,
    signed with no key at all (a forger's file)."""
    head = bundle.MAGIC + struct.pack("<QQ", len(meta), blob_bytes) + bytes(32)
    with open(path, "wb") as f:
        f.write(head + meta)
        f.truncate(len(head) + len(meta) + blob_bytes)


def test_a_sparse_bundle_promising_a_huge_blob_is_refused_within_the_cap(tmp_path: Path) -> None:
    """768 MiB promised (a hole on disk), 700 MB of address space: reading the blob before the
    MAC dies of MemoryError here; the streamed MAC refuses it at 1 MiB."""
    f = tmp_path / "forged.surgery.cache"
    _forged(f, 768 << 20)
    r = snippet_capped(
        "import sys\n"
        "from surgery.errors import CacheSignatureError\n"
        "from surgery.runtime.bundle import read_bundle\n"
        f"try:\n    read_bundle({str(f)!r}, key=bytes.fromhex({KEY_HEX!r}))\n"
        "except CacheSignatureError as e:\n    print(e.state); sys.exit(3)\n",
        cap=700_000_000, timeout=60)
    assert r.rc == 3 and r.stdout.strip() == "bad-signature", r.output[-2000:]


def test_a_blob_beyond_the_limit_is_refused_before_any_read(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "big.surgery.cache"
    _forged(f, 3 << 20)
    monkeypatch.setenv("SURGERY_MAX_BUNDLE_BYTES", str(1 << 20))
    with mock.patch.object(bundle, "file_mac_matches", side_effect=AssertionError("MAC run")), \
            pytest.raises(CacheBundleError, match="SURGERY_MAX_BUNDLE_BYTES") as info:
        bundle.read_bundle(str(f), key=KEY)
    assert "SURGERY_MAX_BUNDLE_BYTES=" in (info.value.hint or "")
    monkeypatch.delenv("SURGERY_MAX_BUNDLE_BYTES")
    with pytest.raises(CacheSignatureError, match="does not verify"):  # under it: the MAC says
        bundle.read_bundle(str(f), key=KEY)


def test_a_length_that_does_not_match_the_file_is_refused_without_a_mac(tmp_path: Path) -> None:
    f = tmp_path / "short.surgery.cache"
    _forged(f, 1 << 20)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1)
    with mock.patch.object(bundle, "file_mac_matches", side_effect=AssertionError("MAC run")), \
            pytest.raises(CacheBundleError, match="truncated"):
        bundle.read_bundle(str(f), key=KEY)


def test_bytes_changed_after_the_streamed_mac_are_refused(tmp_path: Path) -> None:
    """The file is read again after the streamed MAC: those very bytes are checked again, so a
    file swapped between the two reads is refused (here the first check is made to pass)."""
    f = tmp_path / "swapped.surgery.cache"
    _forged(f, 64)
    with mock.patch.object(bundle, "file_mac_matches", return_value=True), \
            pytest.raises(CacheSignatureError, match="changed while it was read"):
        bundle.read_bundle(str(f), key=KEY)
