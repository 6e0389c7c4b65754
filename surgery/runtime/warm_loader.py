"""A warm start's one-time costs: keys hashed beside the bundle checks, and no compile pool.

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
  without this). On the CPU neither key is on the load path (kernels are C++), so nothing
  starts.
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
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


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


class KeyPrefetch:
    """Torch's and triton's one-time keys, computed in a daemon thread (see the module doc)."""

    def __init__(self, names: list[str], thread: threading.Thread | None) -> None:
        self.names = names  # the keys it computes
        self.thread = thread
        self.seconds: dict[str, float] = {}  # per key, in the thread
        self.failed: dict[str, str] = {}  # per key, why (the loader computes it itself then)
        self.waited = 0.0  # how long wait() blocked the caller

    @classmethod
    def start(cls, device: str) -> KeyPrefetch:
        """Start computing the keys the loader needs on ``device`` (none on the CPU)."""
        funcs = _key_functions(device)
        if not funcs:
            return cls([], None)
        pre = cls([n for n, _ in funcs], None)

        def run() -> None:
            for name, fn in funcs:
                t = time.perf_counter()
                try:
                    fn()
                except Exception as e:  # torch's or triton's; the loader tries again itself
                    pre.failed[name] = f"{type(e).__name__}: {e}"[:200]
                pre.seconds[name] = round(time.perf_counter() - t, 3)

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

    def summary(self) -> dict[str, Any]:
        """For a report: which keys, seconds each in the thread, seconds the caller waited."""
        return {"keys": dict(self.seconds), "waited_s": self.waited,
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
