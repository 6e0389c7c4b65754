"""Bytecode for a warm start's imports, compiled once into a private folder the deployer names.

Why. A warm start from a precompiled bundle imports torch's loader (surgery.runtime.load_timing:
over 550 modules, inductor's lowering, codegen and networkx among them: torch's own imports,
which the loader and inductor's generated code need). Where an image ships no ``.pyc`` for them
and sets ``PYTHONDONTWRITEBYTECODE=1`` (the H200's), every fresh process compiles those sources
again: on the H200, apply -> first replayed frame of the SDPA example took 3.96 s without
bytecode against 2.54 s with it, its loader imports 1.96 s against 0.77 s (573 of 620 modules
had no ``.pyc``). The modules are fixed by torch, so the honest cut is bytecode, made once, as
``pip install`` makes it; the rest of the start is the same either way.

What it does (``compile_bytecode``, ``surgery bytecode FOLDER``), only when asked:

1. checks the folder as surgery checks torch's cache folders (surgery.runtime.private_dirs):
   created 0700 when missing, refused when another user owns it, others may write it, or a
   folder above it could be swapped. A ``.pyc`` there is code that every deployment runs, and
   Python trusts one whose recorded source mtime and size match: whoever can write the folder
   could run their code in the deployment.
2. discovers the modules in a fresh interpreter (this Python), which imports the fixed list
   ``WARM_PATH_MODULES`` (torch, surgery's apply, torch's loader modules and the native build's,
   jsonschema for the manifest check) plus the modules the caller names (its model's package),
   and lists the source file of every module loaded, the standard library's included (with a
   prefix set, Python looks for bytecode in the prefix only).
3. byte-compiles exactly those files with ``compileall`` (timestamp-checked ``.pyc``, as pip
   writes them), all cores, with ``PYTHONPYCACHEPREFIX`` at the folder: every file goes under
   it, none into a package's own ``__pycache__``.

4. where the modules include inductor's code cache (the default list does), records torch's
   source key beside the bytecode (surgery.runtime.torch_key_stamp), computed in the
   discovery interpreter: a warm start then hands it to torch instead of hashing torch's
   sources (measured on the H200, the eleventh session: with the record the key thread's
   ``torch_key`` took 0.0 s and the loader waited 0.18-0.26 s for the thread, against 1.74-2.86 s
   and 0.39-0.46 s without it).

Using it: run the deployment with ``PYTHONPYCACHEPREFIX=FOLDER`` (``PYTHONDONTWRITEBYTECODE=1``
may stay: Python still reads). A package changed since is compiled from source again (its mtime
or size no longer match), so a stale folder costs time, never correctness; run the step again
after an upgrade. The ``.pyc`` are for this Python version (their names carry its tag).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from surgery.errors import BytecodeFolderError
from surgery.runtime import torch_key_stamp
from surgery.runtime.load_timing import CUDA_LOADER_MODULES, LOADER_MODULES
from surgery.runtime.private_dirs import dir_problem
from surgery.runtime.warm_loader import CPU_BUILD_MODULES, CUDA_BUILD_MODULES

PREFIX_ENV = "PYTHONPYCACHEPREFIX"  # where Python reads (and writes) bytecode when set
# Imported after the loader's set-up: by inductor's generated code's header (memory planning,
# hooks, Triton's helpers on CUDA), by guards (the validator) and by torch's locks; found
# missing by `gpu_warm_start.py --pyc surgery` on the CPU when only the loader was listed.
AFTER_LOADER_MODULES = ("torch._inductor.codegen.memory_planning", "torch._inductor.hooks",
                        "torch.fx.experimental.validator", "multiprocessing.synchronize",
                        "torch._inductor.runtime.triton_helpers",
                        "torch._inductor.runtime.hints", "torch._inductor.runtime.runtime_utils")
# What a warm start imports, by fixed names (a name this torch lacks is skipped).
WARM_PATH_MODULES: tuple[str, ...] = ("torch", "surgery.runtime.apply", "jsonschema",
                                      *LOADER_MODULES, *CUDA_LOADER_MODULES,
                                      *CPU_BUILD_MODULES, *CUDA_BUILD_MODULES,
                                      *AFTER_LOADER_MODULES)
_TIMEOUT_S = 900  # discovery or compile: a hung interpreter is an error, not a wait forever

_DISCOVER = """
import importlib, json, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
if "torch._inductor.codecache" in sys.modules:  # the warm path's list: record torch's key
    try:
        from surgery.runtime.torch_key_stamp import record
        print("torch-key " + json.dumps(record()))
    except Exception as e:
        print("torch-key-failed " + json.dumps(f"{type(e).__name__}: {e}"[:200]))
files = set()
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if isinstance(path, str) and path.endswith(".py"):
        files.add(path)
print(json.dumps(sorted(files)))
"""


@dataclass
class BytecodeResult:
    """What ``compile_bytecode`` did: the folder, the files compiled, seconds per stage."""

    folder: str
    files: int
    failed: int  # files compileall could not compile (left to compile from source at import)
    discover_s: float
    compile_s: float
    # torch's key recorded beside the bytecode (surgery.runtime.torch_key_stamp): its path, or
    # why not ("" where the modules did not include inductor's code cache)
    torch_key: str = ""

    def describe(self) -> list[str]:
        return [f"compiled {self.files - self.failed} of {self.files} source files into "
                f"{self.folder} (discovery {self.discover_s:.1f} s, compile "
                f"{self.compile_s:.1f} s)",
                *([f"torch's source key: {self.torch_key}"] if self.torch_key else []),
                f"deploy with {PREFIX_ENV}={self.folder} in the environment: Python then reads "
                "this bytecode (PYTHONDONTWRITEBYTECODE=1 may stay)"]


def _child_env(folder: str, *, write: bool) -> dict[str, str]:
    """The environment of a child that reads (and with ``write``, writes) bytecode in
    ``folder`` only; the discovery writes none (compileall does, and reports failures)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env[PREFIX_ENV] = folder
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(argv: list[str], *, folder: str, write: bool, stage: str
         ) -> subprocess.CompletedProcess[str]:
    """A child interpreter of this Python; one that outlives _TIMEOUT_S is an error."""
    try:
        return subprocess.run(argv, env=_child_env(folder, write=write), capture_output=True,
                              text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BytecodeFolderError(f"the {stage} did not finish within {_TIMEOUT_S} s",
                                  path=folder, hint="check that this Python imports torch and "
                                  "surgery without hanging, then run it again") from e


def discover_files(modules: Sequence[str], *, folder: str) -> list[str]:
    """The source files of every module a fresh interpreter loads importing ``modules``."""
    return _discover(modules, folder=folder)[0]


def _discover(modules: Sequence[str], *, folder: str
              ) -> tuple[list[str], dict[str, Any] | str | None]:
    """(the source files, torch's key record or why none could be made, or None where the
    modules do not include inductor's code cache)."""
    run = _run([sys.executable, "-c", _DISCOVER, *modules], folder=folder, write=False,
               stage="discovery interpreter")
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        raise BytecodeFolderError(
            f"the discovery interpreter failed (rc {run.returncode}): "
            f"{run.stderr.strip()[-300:]}", path=folder,
            hint="check that this Python imports torch and surgery")
    files: list[str] = json.loads(lines[-1])
    return [f for f in files if os.path.isfile(f)], _key_line(lines[:-1])


def _key_line(lines: Sequence[str]) -> dict[str, Any] | str | None:
    """The discovery's torch-key line read back (the last one: an imported module may print
    too): the record, why none was made, or None where the child printed none."""
    for line in reversed(lines):
        tag, _, rest = line.partition(" ")
        if tag in ("torch-key", "torch-key-failed"):
            try:
                got = json.loads(rest)
            except ValueError:
                return "the discovery printed a torch-key line that is not JSON"
            if tag == "torch-key-failed" or not isinstance(got, dict):
                return str(got)[:200]
            return got
    return None


def compile_bytecode(folder: str, *, extra_modules: Sequence[str] = (),
                     modules: Sequence[str] = WARM_PATH_MODULES) -> BytecodeResult:
    """Byte-compile what a warm start imports (``modules`` and ``extra_modules``, and all they
    import) into the private folder ``folder`` (see the module doc). Raises
    BytecodeFolderError for a folder that is not private, or a stage that fails."""
    folder = os.path.abspath(folder)
    if why := dir_problem(folder, PREFIX_ENV, what="the bytecode folder"):
        raise BytecodeFolderError(why, path=folder)
    t = time.perf_counter()
    files, key = _discover([*modules, *extra_modules], folder=folder)
    discover_s = time.perf_counter() - t
    if not files:
        raise BytecodeFolderError(f"no source file to compile was found for {list(modules)}",
                                  path=folder, hint="name modules that exist here")
    t = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=folder, delete=False) as listing:
        listing.write("\n".join(files) + "\n")
    try:
        run = _run([sys.executable, "-m", "compileall", "-q", "-j", "0", "-i", listing.name],
                   folder=folder, write=True, stage="compileall")
    finally:
        os.unlink(listing.name)
    failed = sum(1 for line in run.stdout.splitlines() if line.startswith("*** Error"))
    if run.returncode not in (0, 1):  # 1: some file did not compile (counted above)
        raise BytecodeFolderError(f"compileall failed (rc {run.returncode}): "
                                  f"{run.stderr.strip()[-300:]}", path=folder)
    return BytecodeResult(folder, len(files), failed, round(discover_s, 2),
                          round(time.perf_counter() - t, 2), _record_key(folder, key))


def _record_key(folder: str, key: dict[str, Any] | str | None) -> str:
    """Write torch's key record into the folder; the line for the result."""
    if key is None:
        return ""
    if isinstance(key, str):
        return f"not recorded ({key}); a warm start computes it"
    try:
        return f"recorded in {torch_key_stamp.write(folder, key)}"
    except (OSError, ValueError) as e:
        return f"not recorded ({str(e)[:200]}); a warm start computes it"
