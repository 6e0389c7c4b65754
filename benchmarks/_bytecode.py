"""Bytecode for a start-up benchmark: the .pyc a normal install has, or none at all, on purpose.

Why. Python compiles each module it imports from source unless a ``.pyc`` for it is cached. A
``pip install`` writes them (it byte-compiles every package it installs) and distributions ship
them for the standard library, so a deployed service imports from bytecode. An image built with
``PYTHONDONTWRITEBYTECODE=1``, or whose site-packages is read-only and was installed without
compiling, has none and never gets any: every process compiles every module again. On the H200
image of issue 23 a warm start spent 2.27 s in ``builtins.compile`` (764 calls) that way, about a
third of it. A start-up figure taken on such a host is the host's, not the deployment's, so the
benchmark says which it measured and can measure both.

How. Python looks a module's bytecode up under ``PYTHONPYCACHEPREFIX`` when that is set (the
file's full path mirrored below the prefix; the ``__pycache__`` folders beside the sources are
then ignored). So, without touching the installed packages:

- ``compiled``: a discovery process imports what the benchmark's processes import (torch,
  surgery's apply and precompiled loader, the model's package) and lists the top-level packages
  and modules it loaded from files; ``compileall`` then byte-compiles each of them whole (a
  package's lazy imports included, as pip would have at install) into a fresh prefix, for every
  timed process of the run, cold and warm alike. Its seconds are reported; they are an install's,
  not a start's.
- ``surgery``: the prefix filled by surgery's own deployment step (``surgery bytecode``,
  surgery.runtime.bytecode: exactly the files a warm start imports, not whole packages), read
  like ``compiled``: the figure a deployer gets from that step.
- ``none``: an empty prefix and ``PYTHONDONTWRITEBYTECODE=1``: no bytecode at all, the standard
  library's included, as on an image that has none (to show the H200's condition on a host that
  has bytecode).
- ``host``: the environment as it is (what earlier runs measured).

``missing(names, since)`` counts, after the fact, the imported modules that had no bytecode to
load: no ``.pyc`` where Python looks for it (``importlib.util.cache_from_source`` follows the
prefix), or one written after the process started (so it was compiled in this process).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import time
from typing import Any

MODES = ("host", "compiled", "surgery", "none")
_SKIP_ROOTS = ("__main__",)  # a script, not a module to compile
# The standard library's folders no start imports (its tests, GUI), and the installed packages
# below it (compiled by name instead).
_STDLIB_SKIP = (r"[/\\](test|tests|idlelib|tkinter|turtledemo|lib2to3|site-packages"
                r"|dist-packages)[/\\]")

_DISCOVER = r'''
import importlib, json, os, sys
for name in sys.argv[1].split(","):
    if name:
        try:
            importlib.import_module(name)
        except Exception as e:  # a package the host lacks: nothing of it to compile
            print(f"discovery: {name}: {type(e).__name__}: {e}", file=sys.stderr)
roots = {}
for name, mod in list(sys.modules.items()):
    top = name.partition(".")[0]
    if top in roots:
        continue
    f = getattr(sys.modules.get(top), "__file__", None)
    if not f or not f.endswith(".py"):
        continue
    roots[top] = os.path.dirname(f) if os.path.basename(f) == "__init__.py" else f
print(json.dumps(roots))
'''


def env_for(mode: str, prefix: str | None, base: dict[str, str]) -> dict[str, str]:
    """``base`` with the bytecode of ``mode``: ``compiled`` reads ``prefix`` (filled by
    ``compile_into``), ``surgery`` likewise (filled by ``surgery bytecode``), ``none`` an empty
    ``prefix`` with writing off, ``host`` unchanged."""
    if mode not in MODES:
        raise ValueError(f"bytecode mode {mode!r}: use one of {', '.join(MODES)}")
    env = dict(base)
    if mode == "host":
        return env
    if not prefix:
        raise ValueError(f"bytecode mode {mode!r} needs a prefix folder")
    env["PYTHONPYCACHEPREFIX"] = prefix
    if mode == "none":
        os.makedirs(prefix, exist_ok=True)
        if os.listdir(prefix):
            raise ValueError(f"bytecode mode 'none' needs an empty prefix; {prefix} is not")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def discover(imports: list[str], env: dict[str, str], timeout: int = 300) -> dict[str, str]:
    """{top-level name: its package folder or module file} of everything a fresh process loads
    from source files when it imports ``imports`` (their dependencies included)."""
    proc = subprocess.run([sys.executable, "-c", _DISCOVER, ",".join(imports)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode or line is None:
        raise RuntimeError("bytecode discovery failed: "
                           + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return {k: v for k, v in json.loads(line).items() if k not in _SKIP_ROOTS}


def compile_into(prefix: str, imports: list[str], env: dict[str, str], *, stdlib: bool = True,
                 timeout: int = 600) -> dict[str, Any]:
    """Byte-compile, into ``prefix``, every package and module a process importing ``imports``
    loads (see the module doc), and with ``stdlib`` the standard library. Returns what it did:
    roots, .py files of the packages, seconds."""
    os.makedirs(prefix, exist_ok=True)
    t = time.perf_counter()
    # The discovery process writes the bytecode of what it imports into the prefix too.
    denv = {**env, "PYTHONPYCACHEPREFIX": prefix}
    denv.pop("PYTHONDONTWRITEBYTECODE", None)
    roots = discover(imports, denv, timeout=timeout)
    discovered_s = time.perf_counter() - t
    t = time.perf_counter()
    lib = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in set(roots.values()) if not p.startswith(lib + os.sep))
    rcs, errors = [], []
    # The packages whole; the standard library whole but for its tests and GUI (a module of it
    # may be imported later than the discovery process got: multiprocessing's, say).
    for args in ([*paths], ["-x", _STDLIB_SKIP, lib] if stdlib else []):
        if not args:
            continue
        proc = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *args],
                              env=denv, capture_output=True, text=True, timeout=timeout)
        rcs.append(proc.returncode)
        errors += [ln for ln in proc.stdout.splitlines() if "Error" in ln][:3]
    # compileall's status is 1 when any one file fails to compile (a package's test data with
    # syntax of another Python, say): the rest are compiled, which is what a pip install does.
    files = sum(1 for p in paths for _ in _py_files(p))
    return {"mode": "compiled", "prefix": prefix, "roots": sorted(roots), "py_files": files,
            "discover_s": round(discovered_s, 2), "compile_s": round(time.perf_counter() - t, 2),
            "compileall_rc": rcs, "compile_errors": errors[:3]}


def _py_files(path: str) -> Any:
    if path.endswith(".py"):
        yield path
        return
    for folder, _, names in os.walk(path):
        for n in names:
            if n.endswith(".py"):
                yield os.path.join(folder, n)


def process_start() -> float:
    """This process's start as a time.time(), from the kernel's record of it (Linux); the
    current time elsewhere (then a .pyc this process wrote before the call is not counted)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def missing(names: list[str], since: float, skip_under: tuple[str, ...] = ()) -> list[str]:
    """Which of these imported modules had no bytecode to load: no .pyc where Python looks
    (which follows PYTHONPYCACHEPREFIX), or one written at or after ``since`` (a time.time(),
    the process's start): compiled from source in this process either way. Files under
    ``skip_under`` (inductor's generated code, written by this process) are not counted."""
    out = []
    for name in names:
        f = getattr(sys.modules.get(name), "__file__", None) or ""
        if not f.endswith(".py") or any(f.startswith(s) for s in skip_under if s):
            continue
        try:
            pyc = importlib.util.cache_from_source(f)
            if not os.path.exists(pyc) or os.path.getmtime(pyc) >= since:
                out.append(name)
        except (NotImplementedError, ValueError, OSError):
            out.append(name)
    return out
