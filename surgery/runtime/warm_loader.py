"""A warm start's one-time costs: keys hashed and native code built beside the imports, no pool.

Why. Loading precompiled code (surgery.runtime.precompiled) compiles nothing, yet the first
artifact of a process paid for things a compile needs. On the H200 (issue 23) the first artifact
took 1.0 s and every later one 0.01-0.04 s. Read from torch 2.14's loader, on CUDA:

- ``torch_key()`` hashes torch's own Python sources, once a process: every Triton kernel of an
  artifact is looked up in inductor's kernel table under a key that includes it
  (``CompiledTritonKernels.key``), and the compile pool's start passes it to its workers
  (0.1 s on the H200, 0.7 s on a 2-core CPU).
- triton's own key hashes ``libtriton.so`` (505 MB in triton 3.8: 1.0 s on the 2-core CPU), the
  first time a kernel goes through Triton's compile path (its cache lookup, a hit included) and
  in inductor's FX-graph cache keys. Whether torch 2.11's load takes that path for an artifact's
  kernels (or loads them all as static launchers) is for the H200's profile to show.
- The first Triton kernel makes inductor start its compile pool (``AsyncCompile.use_process_pool``:
  a sidecar process that imports torch and starts one worker per core), although every kernel of
  a precompiled artifact is already built: the artifact carries them, and they are found in
  inductor's kernel table (filled from the artifact's bundle) or loaded in this process while
  the pool warms up, so the pool does no work for them.

What is done instead.

- **Keys beside the imports.** ``KeyPrefetch.start(device)``, once ``apply_manifest(cache=...)``
  on CUDA has opened a bundle holding artifacts that no AOTInductor runner replaces
  (surgery.runtime.aoti_bundle: runners need neither key, and the start would import inductor's
  code cache), computes both keys in a daemon thread while torch's loader is imported. Both are
  file reads and sha256 over large buffers, which release the GIL, so they overlap that work
  instead of following it. ``wait()`` joins the thread before the first artifact loads: on a
  torch whose key cache is a plain ``functools.cache`` the loader would otherwise compute a key
  the thread is still computing. The thread only calls torch's and triton's own cached
  functions; it changes no value, imports nothing (the two modules are imported by the caller,
  on this thread, first) and swallows its errors (the loader then computes the key itself, as
  without this). On the CPU neither key is on the load path (kernels are C++), so no key
  thread starts (the native build's does, below).
- **torch's key from the deployment step.** Where ``surgery bytecode`` recorded torch's key
  beside the bytecode and the record's stamp matches the installed torch,
  the key thread hands it to torch first (surgery.runtime.torch_key_stamp), so its
  ``torch_key()`` returns at once and it computes triton's key only.
- **Native builds beside the imports.** The loader's set-up (surgery.runtime.load_timing) runs
  one native build a process: on CUDA Triton's driver utilities (a small C extension that Triton
  builds with the C compiler into an empty ``TRITON_CACHE_DIR``: 0.30 s of the H200's 1.22 s
  set-up), on the CPU inductor's vector-ISA probe (a test program built and loaded with the C++
  compiler into an empty inductor cache: about 5 s on the 2-core CPU). Both wait on a compiler
  process, with the GIL released, yet ran after the loader's imports, which hold it. So
  ``KeyPrefetch.start`` also starts that build (``native_build(device)``) in a second daemon
  thread, before the imports, and the set-up's step waits for it (``wait_build()``) and then
  calls the same cached function itself: a no-op once the thread built it, the build as
  before when the thread failed. The modules the build imports (the fixed list of
  ``native_build``, never a bundle's names) are imported on the caller's thread before the
  thread starts, so the two threads never import at once: two threads importing torch's
  circular modules in opposite orders can meet in the import lock (``_DeadlockError``). A
  test checks, in a fresh interpreter, that the thread's work imports no module.
  By default on CUDA only. On the CPU the probe is a C++ build plus a child interpreter that
  imports torch to load it: measured in turns on the 2-core CPU (benchmarks/RESULTS.md, y23b),
  the thread made the set-up slower on torch 2.11 without bytecode in all three rounds (49 ->
  80, 58 -> 95, 43 -> 53 s: the compiler and the child took the cores the imports needed) and
  gave no gain it could vouch for on torch 2.14. So the CPU keeps the probe after the imports
  unless ``start(..., build=True)`` asks for the thread.
- **No pool for loads.** ``serial_kernel_loads(device)`` sets inductor's ``compile_threads`` to 1
  around each artifact's load on CUDA, so no pool is started for kernels that are only loaded.
  A later compile (a region with no artifact, a new signature) runs with the configured threads
  and starts the pool then, as it would have. On the CPU an artifact's C++ kernels are built at
  load, in inductor's thread pool, so the CPU keeps it.
- **No step counter imported for nothing.** ``mark_step()`` (surgery's step marker, called
  before every frame) called ``torch.compiler.cudagraph_mark_step_begin()``, which imports
  inductor's cudagraph trees (0.21-0.26 s on the 2-core CPU, in the first frame of a warm start)
  to move a counter that only cudagraph trees read. surgery's own region graphs make no tree, and
  while that module is not imported no tree exists in the process, so there is nothing to mark;
  the call is made once it is imported (a compile with the compiler's graphs imports it). The one
  difference: a tree made later starts from an unmarked counter, as in a process that began
  marking steps after its first compile, which is torch's default until the next mark.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from surgery.runtime import torch_key_stamp


def _key_functions(device: str) -> list[tuple[str, Callable[[], Any]]]:
    """The cached key functions the loader calls on ``device``, imported here (on the caller's
    thread): [(name, function)]; the ones this torch or triton lacks are left out."""
    if not device.startswith("cuda"):
        return []
    out: list[tuple[str, Callable[[], Any]]] = []
    with contextlib.suppress(Exception):  # inductor's; a torch without it has no such cost
        from torch._inductor.codecache import torch_key  # heavy: inductor's

        out.append(("torch_key", torch_key))
    with contextlib.suppress(Exception):  # a torch without triton has no Triton kernels
        from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key  # heavy

        if HAS_TRITON:
            out.append(("triton_key", triton_key))
    return out


# What each native build imports when it runs (torch 2.11-2.14, triton 3.x; a name a version
# lacks is skipped): imported on the caller's thread before the build's thread starts.
CUDA_BUILD_MODULES = ("triton", "triton.runtime.driver", "triton.runtime.build",
                      "triton.backends.nvidia.driver")
CPU_BUILD_MODULES = ("torch._inductor.codecache", "torch._inductor.cpp_builder",
                     "torch._inductor.cpu_vec_isa", "torch.utils.cpp_extension",
                     "torch.utils._filelock")


def _triton_utils() -> Any:
    """Triton's driver utilities: built with the C compiler on first use (cached by Triton)."""
    from triton.runtime import driver  # heavy, optional: triton

    return getattr(driver.active, "utils", None)


def _cpu_isa() -> Any:
    """inductor's vector ISA: probed once a process by building a test program (cached)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # heavy: inductor's

    return pick_vec_isa()


def native_build(device: str) -> tuple[str, Callable[[], Any], tuple[str, ...]] | None:
    """The one-time native build the loader's set-up runs on ``device``:
    (step name, its cached function, the modules it imports); None where there is none."""
    if device.startswith("cuda"):
        return "triton_driver", _triton_utils, CUDA_BUILD_MODULES
    if device == "cpu":
        return "cpu_isa_probe", _cpu_isa, CPU_BUILD_MODULES
    return None


def import_quietly(names: tuple[str, ...]) -> None:
    """Import each of a fixed list of modules; one this torch or triton lacks is skipped."""
    for name in names:
        with contextlib.suppress(Exception):  # absent, or failing: the loader meets it itself
            importlib.import_module(name)


class KeyPrefetch:
    """Torch's and triton's one-time keys, and the loader's native build, computed in daemon
    threads beside the loader's imports (see the module doc)."""

    def __init__(self, names: list[str], thread: threading.Thread | None,
                 build: str = "", build_thread: threading.Thread | None = None) -> None:
        self.names = names  # the keys it computes
        self.thread = thread
        self.build = build  # the native build's step name ("" when none is started)
        self.build_thread = build_thread
        self.seconds: dict[str, float] = {}  # per key and build, in its thread
        self.failed: dict[str, str] = {}  # per key or build, why (the loader does it itself)
        self.waited = 0.0  # how long wait() blocked the caller
        self.build_waited = 0.0  # how long wait_build() blocked the caller
        self.imports_s = 0.0  # the build's modules, imported on the caller's thread first
        self.torch_key_from = ""  # "set": torch's key came from the bytecode folder's record

    def _timed(self, name: str, fn: Callable[[], Any]) -> None:
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # torch's or triton's; the loader tries again itself
            self.failed[name] = f"{type(e).__name__}: {e}"[:200]
        self.seconds[name] = round(time.perf_counter() - t, 3)

    @classmethod
    def start(cls, device: str, *, build: bool | None = None) -> KeyPrefetch:
        """Start computing the keys the loader needs on ``device`` (none on the CPU) and, on
        CUDA, its native build (Triton's driver). ``build``: True also starts the CPU's ISA
        probe in the thread, False none (the keys only, as before that thread), for an A/B;
        by default CUDA only (see the module doc for why not the CPU)."""
        funcs = _key_functions(device)
        pre = cls([n for n, _ in funcs], None)
        preset = any(n == "torch_key" for n, _ in funcs)
        build = device.startswith("cuda") if build is None else build
        if build and (native := native_build(device)) is not None:
            name, fn, modules = native
            t = time.perf_counter()
            import_quietly(modules)  # on this thread: the build's thread then imports nothing
            pre.imports_s = round(time.perf_counter() - t, 3)
            pre.build = name
            pre.build_thread = threading.Thread(target=pre._timed, args=(name, fn),
                                                name="surgery-build-prefetch", daemon=True)
            pre.build_thread.start()
        if funcs:
            def run() -> None:
                if preset:  # the deployment step's record, where it matches this torch
                    # (surgery.runtime.torch_key_stamp; its stat walk runs here, beside the
                    # imports, not before them): torch_key() below then returns at once
                    pre.torch_key_from = torch_key_stamp.preset()
                for key, fn in funcs:
                    pre._timed(key, fn)

            pre.thread = threading.Thread(target=run, name="surgery-key-prefetch", daemon=True)
            pre.thread.start()
        return pre

    def wait(self) -> float:
        """Block until the keys are computed; the seconds this call blocked."""
        if self.thread is None:
            return 0.0
        t = time.perf_counter()
        self.thread.join()
        self.waited = round(self.waited + time.perf_counter() - t, 3)
        return self.waited

    def wait_build(self) -> float:
        """Block until the native build's thread is done; the seconds this call blocked."""
        if self.build_thread is None:
            return 0.0
        t = time.perf_counter()
        self.build_thread.join()
        self.build_waited = round(self.build_waited + time.perf_counter() - t, 3)
        return self.build_waited

    def summary(self) -> dict[str, Any]:
        """For a report: seconds per key and build in its thread, seconds the caller waited
        for each, the build's imports on the caller's thread."""
        return {"keys": {k: v for k, v in self.seconds.items() if k in self.names},
                "waited_s": self.waited,
                **({"build": {self.build: self.seconds.get(self.build),
                              "waited_s": self.build_waited, "imports_s": self.imports_s}}
                   if self.build else {}),
                **({"torch_key_record": self.torch_key_from} if self.torch_key_from else {}),
                **({"failed": dict(self.failed)} if self.failed else {})}


@contextlib.contextmanager
def serial_kernel_loads(device: str) -> Iterator[None]:
    """On CUDA, inductor's ``compile_threads`` at 1 for the duration: kernels that are only
    loaded start no compile pool (see the module doc). Elsewhere, nothing changes."""
    if not device.startswith("cuda"):
        yield
        return
    try:
        from torch._inductor import config  # heavy: inductor's

        patch = config.patch(compile_threads=1)
    except Exception:  # a torch without the setting has no pool to keep from starting
        patch = contextlib.nullcontext()
    with patch:
        yield


_TREES = "torch._inductor.cudagraph_trees"  # where torch keeps the step counter trees read


def mark_step() -> None:
    """Open one CUDA-graph step: call before each inference step of a CUDA-graph model.

    cudagraph trees reuse a graph's memory only once told the last step's outputs are dead.
    Before any tree exists there is nothing to tell (see the module doc)."""
    if _TREES in sys.modules:
        torch.compiler.cudagraph_mark_step_begin()
