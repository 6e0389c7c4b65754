"""Where the load of precompiled code goes: the loader's one-time set-up, then each artifact.

Why. On the H200 (issue 23) loading 8 artifacts took 2.86 s, 2.58 s of it in one group, the
first one installed. Loading an artifact (torch.compiler.load_compiled_function) unpickles its
state, rebuilds the AOTAutograd entry (writes the Triton kernels of its bundle into Triton's
cache, writes inductor's generated Python module and executes it: each kernel is then built or
loaded, C++ compiled on the CPU, Triton compiled from source or read from the bundle on CUDA) and
rebuilds the guards. The first artifact of a process also pays what every later one shares:
importing inductor's loader (on torch 2.14 over 600 modules, inductor's lowering and codegen
included, because the loader imports ``torch._inductor.graph``) and, on the CPU, the vector-ISA
probe that builds a test program. Charged to the first group, those look like its own cost.

So the set-up runs first, on its own clock (``prepare_loader``): the loader's modules from the
fixed list LOADER_MODULES (never names from a bundle), triton and its driver on CUDA (Triton
builds its CUDA utilities with the C compiler on first use in an empty TRITON_CACHE_DIR), the
ISA probe on the CPU (both started in a thread beside the imports by surgery.runtime.
warm_loader, so this step waits for that build, then asks the cached result), then the wait for
the one-time keys that surgery.runtime.warm_loader computes in a thread meanwhile.
The list is what torch's loader and inductor's generated code
import themselves (checked on torch 2.14 by loading with an empty list: the same modules but
``compile_fx`` and its FX passes, 22 modules and 0.1 s on the 2-core CPU, which only a
compile needs and which are therefore left out).
Then each artifact is timed (``timed``) with the deltas of torch's own instruments:
``compilation_time_metrics`` (its ``dynamo_timed`` phases, e.g. ``PyCodeCache.load_by_key_path``,
``async_compile.wait``, ``async_compile.precompile`` (a Triton kernel compiled from source in this
process), ``TritonBundler.read_and_emit``, ``compile_file`` (a C++ build)), the ``inductor``
counters (``async_compile_cache_miss``: kernels compiled or loaded) and how many modules it
imported. The phases are torch's names, nested as torch nests them (not additive); what no phase
covers (unpickling, guards) is the artifact's seconds minus its outermost phase.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from surgery.runtime.warm_loader import KeyPrefetch, native_build, serial_kernel_loads

# The modules torch's loader imports on its first artifact (torch 2.11-2.14; a name a version
# lacks is skipped). A fixed list: nothing a bundle says is ever imported.
LOADER_MODULES = (
    "torch._dynamo.aot_compile",
    "torch._dynamo.package",
    "torch._functorch._aot_autograd.autograd_cache",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._inductor.codecache",
    "torch._inductor.output_code",
    "torch._inductor.graph",
    "torch._inductor.async_compile",
)
CUDA_LOADER_MODULES = ("triton", "torch._inductor.runtime.triton_heuristics",
                       "torch._inductor.runtime.static_cuda_launcher")
_MIN_PHASE_S = 0.001  # phases shorter than this are left out of a timing


@dataclass
class LoadTiming:
    """One artifact's load: total seconds, torch's phases (seconds), its counters, imports."""

    group: str
    signature: int  # which of the group's artifacts (0, 1, ... in the bundle's order)
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    imported: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoaderSetup:
    """The one-time set-up before the first artifact: seconds, per step, modules imported."""

    seconds: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)
    imported: int = 0
    keys: dict[str, Any] = field(default_factory=dict)  # KeyPrefetch.summary(), on CUDA


def prepare_loader(device: str, keys: KeyPrefetch | None = None) -> LoaderSetup:
    """Import torch's loader and run its one-time probes, timed apart from any artifact; then
    wait for the keys ``keys`` computes beside it (surgery.runtime.warm_loader)."""
    setup = LoaderSetup()
    before = len(sys.modules)
    started = time.perf_counter()
    t = started
    with serial_kernel_loads(device):  # a torch that starts its pool on import does not
        for name in LOADER_MODULES + (CUDA_LOADER_MODULES if device.startswith("cuda") else ()):
            with contextlib.suppress(ImportError):  # a module this torch does not have
                importlib.import_module(name)
    setup.steps["imports"] = round(time.perf_counter() - t, 3)
    # Triton's driver utilities on CUDA (built with the C compiler into an empty
    # TRITON_CACHE_DIR: in a fresh container that is a compiler run), the vector-ISA probe on
    # the CPU (a test program built once a process): started beside the imports by ``keys``
    # (surgery.runtime.warm_loader), waited for here, then asked again (cached by torch or
    # triton: free once built; built here when the thread could not).
    if (native := native_build(device)) is not None:
        name, build, _ = native
        t = time.perf_counter()
        if keys is not None and keys.build == name:
            keys.wait_build()
        with contextlib.suppress(Exception):  # torch's or triton's; a failure is theirs
            build()
        setup.steps[name] = round(time.perf_counter() - t, 3)
    if keys is not None and (keys.names or keys.build):
        if keys.names:
            setup.steps["keys_wait"] = keys.wait()
        setup.keys = keys.summary()
    setup.seconds = round(time.perf_counter() - started, 3)
    setup.imported = len(sys.modules) - before
    return setup


def _metrics() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["inductor"].items()}


@contextlib.contextmanager
def timed(into: list[LoadTiming], group: str, signature: int) -> Iterator[LoadTiming]:
    """Time one artifact's load into ``into``, with the deltas of torch's instruments."""
    m0, c0, n0 = _metrics(), _counts(), len(sys.modules)
    rec = LoadTiming(group, signature, 0.0)
    started = time.perf_counter()
    try:
        yield rec
    finally:
        rec.seconds = round(time.perf_counter() - started, 3)
        m1, c1 = _metrics(), _counts()
        rec.phases = {k: round(v - m0.get(k, 0.0), 3) for k, v in sorted(m1.items())
                      if v - m0.get(k, 0.0) >= _MIN_PHASE_S}
        rec.counts = {k: v - c0.get(k, 0) for k, v in sorted(c1.items()) if v != c0.get(k, 0)}
        rec.imported = len(sys.modules) - n0
        into.append(rec)
