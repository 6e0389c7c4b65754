"""Run a reproducer of a memory or time blow-up in a subprocess under a memory cap and a timeout.

An uncapped blow-up takes the whole machine (the finder's run was killed at 24 GB), so every
regression test of issue 22 runs the CLI or a snippet here: a regression then fails the test
(exit by MemoryError, or killed at the timeout) instead of taking everyone's memory. The child's
own peak RSS and wall time come back from ``wait4``, for the complexity tests and the fuzzers.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Python + torch + surgery reserve address space before reading a byte, and how much depends on
# the torch build: ~0.64 GB for torch 2.13 CPU, ~3.3 GB for torch 2.14.1+cu130 (its CUDA
# libraries are mapped at import, GPU or not). A fixed cap either refuses the import itself
# (ImportError: failed to map segment) or lets the blow-ups through, so the default cap is that
# measured baseline plus HEADROOM: what a bounded command may allocate on top. The blow-ups these
# tests guard against ask for 2 GB and more, above the headroom.
HEADROOM = 1_000_000_000
DEFAULT_TIMEOUT = 60.0


@functools.cache
def import_baseline() -> int:
    """Address space (VmPeak, bytes) of this interpreter after importing torch and surgery.cli."""
    code = ("import torch, surgery.cli\n"
            "print(next(int(ln.split()[1]) for ln in open('/proc/self/status')"
            " if ln.startswith('VmPeak:')) * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=DEFAULT_TIMEOUT,
                         check=True)
    return int(out.stdout.split()[-1])


def default_cap() -> int:
    """The cap a capped command runs under unless told: the import baseline plus HEADROOM."""
    return import_baseline() + HEADROOM


@dataclass
class Capped:
    rc: int  # the exit code; -9 when killed at the timeout
    stdout: str
    stderr: str
    wall_s: float
    peak_rss: int  # bytes

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error: ")]


def run_capped(argv: list[str], *, cap: int | None = None, timeout: float = DEFAULT_TIMEOUT,
               env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
               stdin: bytes | None = None) -> Capped:
    """`python ARGV...` (e.g. ``["-m", "surgery", "verify", f]``) under RLIMIT_AS = `cap`
    (bytes of address space; default_cap() when None)."""
    as_limit = default_cap() if cap is None else cap

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with tempfile.TemporaryFile() as fi, tempfile.TemporaryFile() as fo, \
            tempfile.TemporaryFile() as fe:
        fi.write(stdin or b"")
        fi.seek(0)
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, *argv], stdin=fi, stdout=fo, stderr=fe,
                             env=full_env, cwd=cwd, preexec_fn=limit)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)  # this child's own peak, not the largest yet
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        return Capped(p.returncode, fo.read().decode(errors="replace"),
                      fe.read().decode(errors="replace"), wall, usage.ru_maxrss * 1024)


def surgery_capped(*args: str, **kw: object) -> Capped:
    """The CLI under the cap: ``surgery ARGS...``."""
    return run_capped(["-m", "surgery", *args], **kw)  # type: ignore[arg-type]


def snippet_capped(code: str, **kw: object) -> Capped:
    """A Python snippet under the cap (for library calls such as apply_manifest)."""
    return run_capped(["-c", code], **kw)  # type: ignore[arg-type]


def assert_refused(r: Capped, *, names: str) -> str:
    """Exit 3 with one error line that names `names` (the limit's env var, or the problem)."""
    assert r.rc == 3, (r.rc, r.output[-2000:])
    assert "Traceback" not in r.output, r.output[-2000:]
    assert len(r.error_lines) == 1, r.stderr[-2000:]
    line = r.error_lines[0]
    assert names in r.stderr, r.stderr[-2000:]
    assert len(line) < 1000, len(line)
    return line


@contextlib.contextmanager
def case_bounds(*, max_s: float = 2.0, max_growth: int = 256 << 20) -> Iterator[None]:
    """One fuzz case's bounds: at most `max_s` seconds, and at most `max_growth` bytes added to
    the process's peak RSS. Cheap enough for a thousand cases (no tracemalloc): the peak only
    shows a case that goes past every earlier one, which is what a blow-up does.

    The seconds are this thread's CPU time: a blow-up in reading is CPU work in the reading
    thread, and other jobs on a shared 2-core machine stretch the wall clock (a case once read
    1.71 s under load and 0.1 s alone). Not the process's CPU time: a thread an earlier test left
    running (a compile worker, a hash in a thread) is counted there. The cyclic garbage collector
    is off during the case, so a full collection of the whole suite's heap that happens to fall in
    one case is not charged to it (a mutated manifest once read 1.43 s of CPU in the full suite
    and passed when run again alone). The wall clock still has a bound ten times as wide, for a
    case that waits instead."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    collecting = gc.isenabled()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        yield
        took, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        if collecting:
            gc.enable()
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert cpu < max_s, f"one case took {cpu:.2f} s of CPU (bound {max_s} s)"
    assert took < 10 * max_s, f"one case took {took:.2f} s of wall time (bound {10 * max_s} s)"
    assert grew < max_growth, f"one case raised peak memory by {grew >> 20} MB"
