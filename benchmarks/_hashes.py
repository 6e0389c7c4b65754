"""Where a start's hashing goes: hashlib's constructors wrapped for a window, by caller.

Why. The H200's profile of a warm apply (issue 23) showed 0.92 s in hashlib's ``update`` on the
main thread, with no caller (the profile's rows are cumulative per function). The candidates
are torch's and Triton's cache keys (torch's Python sources, ``libtriton.so``'s 505 MB), which
surgery.runtime.warm_loader hashes in a thread, and inductor's code hashes; which of them the
main thread still pays is what a warm start needs to know. A profile would answer it, but it
also slows every import it watches, so this is a narrow instrument instead.

How. Inside ``HashSpy()`` (a ``with`` block), ``hashlib.sha256``, ``sha1``, ``md5``, ``sha512``,
``blake2b`` and ``new`` return a thin proxy whose construction and ``update`` calls are timed and
counted, per call site: the first frame outside this module, hashlib and hmac, with the thread's
name. Code that took a constructor before the block (``from hashlib import sha256``) is not
seen; the report says so by what it lists. ``top()`` gives the sites by seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
import threading
import time
from typing import Any

_NAMES = ("sha256", "sha1", "md5", "sha512", "blake2b", "new")
_SKIP_FILES = tuple(os.path.abspath(f) for f in (__file__, hashlib.__file__, hmac.__file__))


def _size(data: Any) -> int:
    try:
        return memoryview(data).nbytes if data is not None else 0
    except TypeError:
        return 0


class _Timed:
    """A hash object whose ``update`` calls are timed for its call site."""

    __slots__ = ("_h", "_site", "_spy")

    def __init__(self, h: Any, site: str, spy: HashSpy) -> None:
        self._h, self._site, self._spy = h, site, spy

    def update(self, data: Any) -> None:
        t = time.perf_counter()
        self._h.update(data)
        self._spy.add(self._site, time.perf_counter() - t, _size(data))

    def copy(self) -> _Timed:
        return _Timed(self._h.copy(), self._site, self._spy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._h, name)


class HashSpy:
    """hashlib's constructors timed per call site while the block runs (see the module doc)."""

    def __init__(self) -> None:
        self.sites: dict[str, list[float]] = {}  # site -> [seconds, bytes, objects]
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    def add(self, site: str, seconds: float, nbytes: int, made: int = 0) -> None:
        with self._lock:
            row = self.sites.setdefault(site, [0.0, 0, 0])
            row[0] += seconds
            row[1] += nbytes
            row[2] += made

    def _site(self) -> str:
        f: Any = sys._getframe(2)
        while f is not None and os.path.abspath(f.f_code.co_filename) in _SKIP_FILES:
            f = f.f_back
        where = "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}({f.f_code.co_name})"
        return f"[{threading.current_thread().name}] {where[-130:]}"

    def _wrap(self, real: Any, named: bool) -> Any:
        def make(*args: Any, **kwargs: Any) -> _Timed:
            site = self._site()
            t = time.perf_counter()
            h = real(*args, **kwargs)
            data = args[1 if named else 0] if len(args) > int(named) else \
                kwargs.get("data", kwargs.get("string", b""))
            self.add(site, time.perf_counter() - t, _size(data), made=1)
            return _Timed(h, site, self)

        return make

    def __enter__(self) -> HashSpy:
        self._saved = {n: getattr(hashlib, n) for n in _NAMES if hasattr(hashlib, n)}
        for n, real in self._saved.items():
            setattr(hashlib, n, self._wrap(real, named=n == "new"))
        return self

    def __exit__(self, *exc: Any) -> None:
        for n, real in self._saved.items():
            setattr(hashlib, n, real)

    def top(self, n: int = 8) -> list[list[Any]]:
        """[[seconds, MB hashed, hash objects made, "[thread] site"], ...] by seconds."""
        rows = [[round(s, 3), round(b / 1e6, 1), int(m), site]
                for site, (s, b, m) in self.sites.items()]
        return sorted(rows, key=lambda r: -r[0])[:n]
