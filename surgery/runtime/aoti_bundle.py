"""AOTInductor runners in the bundle: region code that starts without torch's Python compiler.

Why. A precompiled artifact (surgery.runtime.precompiled) skips dynamo, but loading it imports
inductor's Python: its loader rebuilds an FX-graph cache entry (``GraphLowering`` -> lowering ->
kernel templates) and inductor's generated module imports its codegen, AOTAutograd and networkx.
On the H200 (issue 23) that was 2.1-2.7 s of a 4.7 s warm start, under the GIL. An AOTInductor
package (``torch._inductor.aoti_compile_and_package``) is a shared library with the kernels
inside; ``torch._C._aoti.AOTIModelPackageLoader`` (C++, bound in torch._C) extracts it and
``dlopen``s it, and its ``run`` launches the kernels. Nothing of ``torch._inductor`` is imported
(measured on torch 2.14: 2 new modules, 13 ms for a two-Linear block).

What is packaged (surgery.runtime.aoti_build). Per compiled group and static signature whose
example torch.export accepts: the region's function, exported around its module, compiled by
AOTInductor without its weights (``aot_inductor.package_constants_in_so=False``). Only calls with
grad off (``no_grad`` or ``inference_mode``; under autocast too, exported with it inside), and
arguments whose non-tensor values are in the signature by value (ints, bools, strings, None; no
float, no nested dict): export specialises every other value, and the runner keeps no autograd
graph. Each package is loaded back (in a fresh process: surgery.runtime.aoti_child) and run
twice before it is written: on the module's weights, and on random weights of the same layout,
against the region run eagerly on the same weights; a package whose output does not
follow the weights it is given (torch folded one into the library) is not written.

Whose weights. One loader per package, shared by every path of the group. Its constants are the
calling module's own parameters and buffers, handed over by pointer (``load_constants(...,
user_managed=True)``: nothing copied, an in-place update is seen), rebound when another path
calls (3-5 us on the 2-core CPU) and when a weight of the module was replaced or moved (its
object or its ``data_ptr`` changed). Before they are handed over, each one's shape, strides, dtype
and device are checked against the layout the package was built for: the runner checks nothing
itself (measured: it runs on wrong-shaped inputs and weights), so a mismatch would read or write
out of bounds. One that does not match: the call goes to dynamo (guards failed, as an artifact's).

Checks before every run. The artifact is chosen by the call's full signature (grad, inference
and autocast modes, ``training``, every tensor's shape, strides, dtype, device, requires_grad and
inference flag, every scalar: surgery.runtime.budget), so a call reaches the runner only with the
layout it was built for; the weights are checked as above; the inputs handed over are the
tensors of (args, kwargs in the export's order), counted against the package's inputs. A failure
of the runner itself raises, and surgery.runtime.slots falls back to eager with a note.

The Mega-Cache part waits. Runners need none of torch's compile caches, and loading them
(``load_cache_artifacts``) imports inductor's code cache and Triton's language modules (120
modules on the 2-core CPU). A bundle with packages is opened with its Mega-Cache part held back
(``DeferredMegaCache``) and given to torch before anything else could use it: before the first
torch AOT artifact loads (surgery.runtime.precompiled), and at the start of the process's next
dynamo compile, whichever region, path or signature it is for (torch's own compile-start
callback, ``torch._dynamo.callback.callback_handler``; on a torch without it, at once). A part
that torch then cannot load is reported in one warning, and compiles go on without it.

Trust. A package is native code: it reaches ``dlopen`` only from a bundle whose HMAC verified
with the deployer's key and which fits this manifest and machine (surgery.runtime.cache); a
forged, stale or truncated bundle never gets that far. The bytes loaded are the verified bytes:
written by this process into a directory it has just made (``mkdtemp``, mode 0700, the file
``O_EXCL``), never a path another process could have planted or can rewrite; the loader extracts
them into a directory of its own (``mkdtemp``) and the file is removed once it has. Before that,
the archive's directory is read (``zipfile``, no extraction): at most MAX_MEMBERS members, names
relative, inside one top folder, without ``..``, backslashes or control characters, no links, at
most MAX_UNPACKED bytes in all (a 100 KB bundle cannot expand to more than that on disk), and at
most one library. A zip that fails any of these is ignored with the bundle's one warning.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import io
import os
import shutil
import stat
import tempfile
import threading
import warnings
import weakref
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from surgery.runtime.bundle_parts import AOTI_LOADERS
from surgery.runtime.cache import load_megacache
from surgery.runtime.load_timing import LoadTiming, timed
from surgery.runtime.report import CacheIgnoredWarning
from surgery.runtime.warm_loader import serial_kernel_loads

MODEL_NAME = "model"  # the name torch packages a single AOTInductor model under
# What the exported wrapper calls the region's module (surgery.runtime.aoti_build.Region): a
# package's weights are named PREFIX + their fqn in the module; an index lists them without it.
PREFIX = "inner."
MAX_MEMBERS = 4096  # files one package may hold (a block's has about ten)
MAX_UNPACKED = 2 * 2**30  # bytes one package may unpack to (its .so and kernel binaries)
LOADERS = AOTI_LOADERS  # "package": torch's package loader; "runner": _SoRunner


def api_missing() -> str | None:
    """Why this torch cannot load AOTInductor packages (None: it can)."""
    aoti = getattr(torch._C, "_aoti", None)
    if aoti is None or not hasattr(aoti, "AOTIModelPackageLoader"):
        return f"torch {torch.__version__} has no torch._C._aoti.AOTIModelPackageLoader"
    return None


def archive_problem(data: bytes) -> str | None:
    """Why these bytes are not a package surgery would extract (None: they are)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        return f"not a zip archive ({type(e).__name__})"
    if not infos or len(infos) > MAX_MEMBERS:
        return f"{len(infos)} members (1 to {MAX_MEMBERS} allowed)"
    tops, names, total, libs = set(), set(), 0, 0
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if not name or name.startswith("/") or "\\" in name or ".." in parts or \
                not all(c.isprintable() for c in name) or ":" in parts[0]:
            return f"member name {name[:80]!r} is not a plain relative path"
        if name in names:
            return f"member {name[:80]!r} appears twice"
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            return f"member {name[:80]!r} is a link"
        names.add(name)
        tops.add(parts[0])
        total += info.file_size
        libs += name.endswith(".so")
    if len(tops) != 1:
        return f"members under {len(tops)} top folders (one expected)"
    if total > MAX_UNPACKED:
        return f"unpacks to {total} bytes (at most {MAX_UNPACKED})"
    if libs != 1:
        return f"{libs} shared libraries (one expected)"
    return None


def open_package(data: bytes, *, device: str, loader: str = LOADERS[0]) -> Any:
    """A loader for verified package bytes (see the module doc), by ``loader`` (one of
    LOADERS): raises ValueError for an archive that fails the checks, and whatever torch raises
    for one it cannot load."""
    if why := archive_problem(data):
        raise ValueError(f"AOTInductor package refused: {why}")
    if loader not in LOADERS:
        raise ValueError(f"AOTInductor loader {loader!r} is not one of {', '.join(LOADERS)}")
    index = torch.device(device).index if device.startswith("cuda") else -1
    folder = tempfile.mkdtemp(prefix="surgery-aoti-")
    if loader == "runner":
        return _SoRunner.unpack(data, folder, device)
    path = os.path.join(folder, "package.pt2")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        # run_single_threaded: no model pool, whose event waits a CUDA-graph capture forbids
        return torch._C._aoti.AOTIModelPackageLoader(path, MODEL_NAME, True, 1,
                                                     -1 if index is None else index)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


# dlopen's flag for a library's own definitions first (Linux; see _SoRunner); 0 where none
DEEPBIND = getattr(os, "RTLD_DEEPBIND", 0)


def open_deep_bound(lib: str) -> Any:
    """``dlopen`` the library at ``lib`` so that its references bind to its own definitions
    first (RTLD_DEEPBIND, every symbol resolved now); None where the platform has no such flag.
    A later ``dlopen`` of the same path (torch's runner) gets this handle, bound this way."""
    if not DEEPBIND:
        return None
    return ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL | DEEPBIND)


def _dlclose(handle: Any) -> None:  # a handle of open_deep_bound, or None (nothing to close)
    with contextlib.suppress(Exception):  # CPython's own binding (POSIX); a leak at worst
        _ctypes.dlclose(handle._handle)  # type: ignore[attr-defined]


class _SoRunner:
    """The "runner" loader: the package's library run by torch's model-container runner
    directly (``AOTIModelContainerRunnerCuda`` / ``Cpu``), past the package loader, whose
    constructor is where torch 2.11 crashed on CUDA. The archive (checked by archive_problem)
    is unpacked here into a fresh ``mkdtemp`` folder, which stays until the runner is freed
    (kernel binaries are read at their first launch). It answers the package loader's calls
    surgery makes: weights by fqn (mapped to the library's constant names), run, call spec.

    Deep-bound. The crash on torch 2.11 (H200, cuda-gdb) is in the ``std::regex`` the library's
    constructor compiles to parse its device string (``parse_device_str``): code the library
    instantiates from the C++ headers of the g++ that built it, and exports as weak symbols. So
    do torch's own libraries (libc10, libtorch_cpu, libtorch_cuda, libtorch_python: 105-123
    such symbols each on torch 2.14, built by torch's GCC 13) and Triton's. A library opened
    normally binds its references to the first definition loaded, torch's, made from other
    headers; where the two g++'s layouts differ, a call lands in the wrong code, which is the
    crash's shape (a virtual call ending in ``codecvt::do_unshift``). That cause is a reading,
    not shown: the H200's g++ is 13.3, as torch's, which makes a layout difference less likely
    (benchmarks/aoti_cuda_probe.py's ``deepbind`` variant asks it; not yet run there).
    Opened with RTLD_DEEPBIND first (``open_deep_bound``), the library runs its own copy. The
    extra handle is closed with the runner (torch's own handle is the last)."""

    def __init__(self, runner: Any, folder: str, handle: Any = None) -> None:
        self._runner = runner
        self._handle = handle  # the deep-bound dlopen, kept open while the runner lives
        weakref.finalize(self, _dlclose, handle)
        names = dict(runner.get_constant_names_to_original_fqns())  # constant name -> fqn
        self._by_fqn = {fqn: name for name, fqn in names.items()}
        weakref.finalize(self, shutil.rmtree, folder, True)

    @classmethod
    def unpack(cls, data: bytes, folder: str, device: str) -> _SoRunner:
        handle = None
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                z.extractall(folder)  # names checked: relative, no "..", no links, one top
            (lib,) = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files
                      if f.endswith(".so")]
            handle = open_deep_bound(lib)
            aoti: Any = torch._C._aoti  # the 5-argument CUDA constructor is not in its stubs
            # run_single_threaded, as for the package loader
            runner = aoti.AOTIModelContainerRunnerCuda(lib, 1, device, os.path.dirname(lib),
                                                       True) \
                if device.startswith("cuda") else aoti.AOTIModelContainerRunnerCpu(lib, 1)
        except BaseException:
            _dlclose(handle)  # the deep-bound open, if made before the runner failed
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(runner, folder, handle)

    def get_constant_fqns(self) -> list[str]:
        return list(self._by_fqn)

    def get_call_spec(self) -> list[str]:
        return list(self._runner.get_call_spec())

    def load_constants(self, constants: Mapping[str, torch.Tensor], use_inactive: bool,
                       check_full_update: bool, user_managed: bool) -> None:
        self._runner.update_constant_buffer(
            {self._by_fqn[f]: t for f, t in constants.items()}, use_inactive,
            check_full_update, user_managed)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._runner.run(inputs)


def layout_of(t: torch.Tensor) -> list[Any]:
    """A weight's layout as an index stores it: [shape, strides, dtype, device type]."""
    return [list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch."),
            t.device.type]


def _owner(module: nn.Module, fqn: str) -> tuple[dict[str, Any], str] | None:
    """The parameter or buffer dict of ``module`` holding ``fqn``, and its name there."""
    *path, name = fqn.split(".")
    owner: Any = module
    for p in path:
        owner = owner._modules.get(p) if isinstance(owner, nn.Module) else None
        if owner is None:
            return None
    for d in (owner._parameters, owner._buffers):
        if d.get(name) is not None:
            return d, name
    return None


class _Bound:
    """What a module handed to the runner: where its weights live, and which tensors they were."""

    def __init__(self, refs: list[tuple[dict[str, Any], str]]) -> None:
        self.refs = refs
        self.tensors: list[Any] = []
        self.ptrs: list[int] = []

    def current(self) -> list[Any]:
        return [d.get(n) for d, n in self.refs]


class AotiRunner:
    """One loaded package: a precompiled artifact's interface (``try_call``) over a C++ runner
    (see the module doc). ``constants``: [[fqn, layout], ...] the package was built for, fqns
    relative to the region's module."""

    def __init__(self, loader: Any, constants: Sequence[Sequence[Any]], *, bound: bool,
                 inputs: int) -> None:
        self.loader = loader
        self.bound = bound
        self.inputs = inputs  # tensors the package takes
        self.constants = [(str(f), list(lay)) for f, lay in constants]
        wanted = set(loader.get_constant_fqns())
        if wanted != {PREFIX + f for f, _ in self.constants}:
            raise ValueError("the package's weights are not the ones its index lists")
        in_spec = pytree.treespec_loads(loader.get_call_spec()[0])
        kw_spec = (in_spec.child(1) if hasattr(in_spec, "child")  # torch 2.13+; before:
                   else in_spec.children_specs[1]) if in_spec.num_children == 2 else None
        self._kw_order = list(kw_spec.context or []) if kw_spec is not None else []
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])
        self._modules: weakref.WeakKeyDictionary[nn.Module, _Bound] = \
            weakref.WeakKeyDictionary()
        self._active: _Bound | None = None
        self._lock = threading.Lock()
        self.rebinds = 0  # how often weights were handed over (a report's figure)

    def _bind(self, module: nn.Module) -> bool:
        """Hand ``module``'s weights to the runner when they are not the ones it holds; False
        when they are not of the layout it was built for (nothing is handed over then)."""
        b = self._modules.get(module)
        if b is None:
            refs = [_owner(module, f) for f, _ in self.constants]
            if any(r is None for r in refs):
                return False
            b = self._modules[module] = _Bound([r for r in refs if r is not None])
        cur = b.current()
        if b is self._active and all(x is y for x, y in zip(cur, b.tensors, strict=True)) and \
                [t.data_ptr() for t in cur] == b.ptrs:
            return True
        for t, (_, want) in zip(cur, self.constants, strict=True):
            if not isinstance(t, torch.Tensor) or layout_of(t) != want:
                return False
        self.loader.load_constants(
            {PREFIX + f: t for (f, _), t in zip(self.constants, cur, strict=True)},
            False, True, True)  # use_inactive, check_full_update, user_managed
        b.tensors, b.ptrs = cur, [t.data_ptr() for t in cur]
        self._active = b
        self.rebinds += 1
        return True

    def try_call(self, full: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """(True, output) when the weights fit; (False, None) otherwise. The caller matched the
        call's signature to the package's (surgery.runtime.groups)."""
        module = full[0] if self.bound else None
        args = full[1:] if self.bound else full
        if set(kwargs) != set(self._kw_order):
            return False, None
        ordered = {k: kwargs[k] for k in self._kw_order}
        flat = [x for x in pytree.tree_leaves((args, ordered)) if isinstance(x, torch.Tensor)]
        if len(flat) != self.inputs:
            return False, None
        with self._lock:
            if module is not None and not self._bind(module):
                return False, None
            out = self.loader.run(flat)
        return True, pytree.tree_unflatten(out, self._out_spec)


class DeferredMegaCache:
    """A verified Mega-Cache part, given to torch once, when something first could use it."""

    def __init__(self, path: str, blob: bytes, *, device: str) -> None:
        self.path = path
        self.device = device
        self._blob: bytes | None = blob
        self._lock = threading.Lock()
        self.loaded_at = ""  # what made it load ("compile", "artifact", "now"), once it did
        self.failed = ""

    def arm(self) -> None:
        """Load at the start of the next dynamo compile (at once on a torch without the hook)."""
        try:
            from torch._dynamo.callback import callback_handler  # heavy: dynamo's
        except ImportError:
            self.load("now")
            return
        callback_handler.register_start_callback(self._on_compile)

    def _on_compile(self, *_: Any) -> None:  # torch 2.14 passes CallbackArgs; older, nothing
        if self._blob is not None:  # left registered, a no-op: removing it mid-run would skip
            self.load("compile")  # the callback after it in torch's loop

    def load(self, why: str) -> None:
        """Give the part to torch now, once; warn if torch cannot load it."""
        with self._lock:
            if self._blob is None:
                return
            blob, self._blob = self._blob, None
            with serial_kernel_loads(self.device):
                failed, _ = load_megacache(self.path, blob)
            self.loaded_at, self.failed = why, failed
        if failed:
            warnings.warn(f"surgery: the bundle's Mega-Cache part could not be loaded, compiles "
                          f"go on without it: {failed}", CacheIgnoredWarning, stacklevel=2)


def load_runners(entries: Mapping[str, tuple[bytes, Any, list[list[Any]], int, str, Any]], *,
                 device: str, bound: bool, timings: list[LoadTiming], name: str
                 ) -> tuple[dict[str, AotiRunner], str]:
    """A group's runners (signature text -> AotiRunner), each load timed into ``timings``;
    ({}, why) when one cannot be loaded (the group then takes its artifacts, or dynamo)."""
    out: dict[str, AotiRunner] = {}
    for i, (sig, (data, _, constants, inputs, loader, _)) in enumerate(entries.items()):
        try:
            with timed(timings, name, i):
                out[sig] = AotiRunner(open_package(data, device=device, loader=loader),
                                      constants, bound=bound, inputs=inputs)
        except Exception as e:  # torch's loader, or an archive refused
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return {}, f"{name}: AOTInductor package: {type(e).__name__}: {first}"
    return out, ""
