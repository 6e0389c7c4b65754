"""The warm-start benchmark's hash spy (benchmarks/_hashes.py): hashing timed per call site and
thread, digests unchanged, hashlib restored."""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import _hashes


def _hash_in_thread(data: bytes) -> None:
    hashlib.sha256(data).hexdigest()


def test_hashing_is_counted_per_site_and_thread_with_the_same_digests() -> None:
    real = hashlib.sha256
    with _hashes.HashSpy() as spy:
        h = hashlib.sha256(b"a" * 1000)
        h.update(b"b" * 2_000_000)
        got = h.hexdigest()
        mac = hmac.new(b"key", b"m" * 10, hashlib.sha256).hexdigest()
        t = threading.Thread(target=_hash_in_thread, args=(b"c" * 3_000_000,), name="keys")
        t.start()
        t.join()
    assert hashlib.sha256 is real  # restored
    assert got == real(b"a" * 1000 + b"b" * 2_000_000).hexdigest()
    assert mac == hmac.new(b"key", b"m" * 10, "sha256").hexdigest()
    rows = {site: (mb, n) for _, mb, n, site in spy.top(20)}
    mine = [s for s in rows if s.startswith("[MainThread]") and "test_bench_hashes" in s
            and "hashing_is_counted" in s]
    assert sum(rows[s][0] for s in mine) >= 2.0, rows  # 2 MB hashed here, on the main thread
    keys = [s for s in rows if s.startswith("[keys]") and "_hash_in_thread" in s]
    assert keys and rows[keys[0]][0] >= 3.0, rows  # the thread's 3 MB, under its name
    assert not any("/hmac.py" in s or "benchmarks/_hashes.py" in s for s in rows), rows
