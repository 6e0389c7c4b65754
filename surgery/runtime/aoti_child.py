"""An AOTInductor package is built, then loaded and run, in child processes, never in the saver.

Why. On the H200 (torch 2.11, issue 23) a CUDA package ended its process with SIGSEGV, in native
code where no exception can be caught: first seen as the building process dying (the whole
``save_cache``, and the warm-up before it, lost); the probe of 2026-12-01 placed it in the
loader's constructor (``AOTIModelPackageLoader``, torch's public ``aoti_load_package`` too), in
the process that had just built the package. A child that crashes costs one note instead. And a
package that crashed while being built, loaded or run is never written: the parent ships only
what the children proved.

The hand-over (``build_in_child``, the parent's side). In a directory the parent has just made
(``mkdtemp``, mode 0700, so no other user can plant or swap a file in it) it writes
JOB_PROGRAM (``torch.export.save`` of the region's exported program), JOB_TENSORS (the example's
args and kwargs, the module's weights, random weights of the same layout, and the region's
eager outputs on each: ``torch.save``, read back with ``weights_only=True``) and JOB_SPEC (JSON:
the inductor options, the device, whether the function is bound, the call's modes, the input
count). Then two children (``python -m surgery.runtime.aoti_child build|prove DIR``), each stage
named in JOB_STAGES before it starts (appended and flushed, so a crash leaves the stage it died
in). The build child:

1. ``export_load``: reads the exported program back;
2. ``package``: ``aoti_compile_and_package`` with the given options, into JOB_PACKAGE.

The prove child, a fresh process that has compiled nothing, as a deploying process is:

3. ``load``: the package opened from its bytes as a deployment opens it
   (surgery.runtime.aoti_bundle.open_package: the same checks, the same loader arguments);
4. ``run``: the runner called twice through ``AotiRunner.try_call``, the deployment's call path,
   on the module's weights and on the random ones (handed over by pointer, as at deploy time),
   each compared with the parent's eager output on the same weights;

then writes its weights' names and layouts (JOB_RESULT). It loads with the package loader
(``AOTIModelPackageLoader``, what torch's ``aoti_load_package`` uses) first; if that child
crashes, a second fresh child tries the "runner" loader (surgery.runtime.aoti_bundle: the
library unpacked and run by torch's model-container runner, past the package loader's
constructor), and the entry records the loader that worked (the bundle's ``loader`` field).
A Python error ends a child with exit code 1 and the error in JOB_RESULT. The parent reads the
package only after the build child and one prove child exit with 0; a signal (SIGSEGV), a
timeout (BUILD_TIMEOUT_S) or any other code is a note naming the process, the loader, the
signal, the stage and the torch version. Nothing a child writes is trusted beyond that: the
bytes are checked again when a deployment opens them (surgery.runtime.aoti_bundle).

Children start with ``faulthandler`` on, so a crash's Python stack is in their stderr (its last
lines end the note, cut short). Their environment is the parent's, with the directory holding
this package first on PYTHONPATH, so they run the same surgery and torch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from surgery.runtime.aoti_bundle import LOADERS, PREFIX, AotiRunner, layout_of, open_package
from surgery.runtime.call_example import modes_of

JOB_PROGRAM = "program.pt2"
JOB_TENSORS = "tensors.pt"
JOB_SPEC = "job.json"
JOB_STAGES = "stages.txt"
JOB_PACKAGE = "package.pt2"
JOB_RESULT = "result.json"
STAGES = ("export_load", "package", "load", "run")
BUILD_TIMEOUT_S = 1800  # one package: a C++ build (45 s on the 2-core CPU for a small block)
TRIALS = ("own", "random")  # the weights each package is run on before it is kept
CHILD_MODULE = "surgery.runtime.aoti_child"  # what the child runs (``python -m``)


class ChildFailed(Exception):
    """The child did not prove a package; ``crashed``: it died by a signal or timed out."""

    def __init__(self, message: str, *, crashed: bool) -> None:
        super().__init__(message)
        self.crashed = crashed


def close_enough(got: Any, want: Any) -> bool:
    """Whether a runner's output is the eager output (same tree, shapes and dtypes; values
    within a tolerance fit for a kernel generated anew: 1e-3 in fp32, 3e-2 below)."""
    ga, wa = pytree.tree_flatten(got), pytree.tree_flatten(want)
    if ga[1] != wa[1] or len(ga[0]) != len(wa[0]):
        return False
    for g, w in zip(ga[0], wa[0], strict=True):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                return False
            tol = 1e-3 if w.dtype in (torch.float32, torch.float64) else 3e-2
            scale = float(w.abs().max()) if w.numel() and w.is_floating_point() else 0.0
            if w.numel() and float((g.double() - w.double()).abs().max()) > tol * (1 + scale):
                return False
        elif g != w:
            return False
    return True


def plant(root: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put ``tensors`` at their fqns under ``root`` (as buffers of empty modules)."""
    for fqn, t in tensors.items():
        *path, name = fqn.split(".")
        m = root
        for p in path:
            if p not in m._modules:
                m._modules[p] = nn.Module()
            m = m._modules[p]  # type: ignore[assignment]
        m._buffers[name] = t


# --- the parent's side ---------------------------------------------------------------------------

# The folder holding this process's surgery package: the child must import the same one.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child_env() -> dict[str, str]:
    root = _ROOT
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _run_child(mode: str, folder: str, timeout: float, *extra: str) -> None:
    """Run one child (``mode``: "build" or "prove") on the job in ``folder``; raises
    ChildFailed for anything but exit code 0."""
    with contextlib.suppress(OSError):  # what an earlier child said is not this one's word
        os.unlink(os.path.join(folder, JOB_RESULT))
    try:
        run = subprocess.run([sys.executable, "-m", CHILD_MODULE, mode, folder, *extra],
                             env=_child_env(), capture_output=True, text=True, timeout=timeout)
        rc, err = run.returncode, run.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = None, (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes)
                         else e.stderr or "")
    if rc == 0:
        return
    stages = _read(os.path.join(folder, JOB_STAGES)).split()
    stage = stages[-1] if stages else "start"
    where = f"at stage {stage!r} (torch {torch.__version__})"
    who = "the build process" if mode == "build" else \
        f"the fresh process loading it ({extra[0] if extra else LOADERS[0]} loader)"
    if rc is None:
        raise ChildFailed(f"{who} ran past {timeout:.0f} s {where}", crashed=True)
    if rc < 0:
        tail = " | ".join(ln.strip() for ln in err.strip().splitlines()[-3:])[:240]
        raise ChildFailed(f"{who} ended with {_signal_name(rc)} {where}"
                          + (f": {tail}" if tail else ""), crashed=True)
    result = _read(os.path.join(folder, JOB_RESULT))
    why = json.loads(result).get("error", "") if result.startswith("{") else \
        (err.strip().splitlines() or [""])[-1]
    raise ChildFailed(f"{why[:240]} {where}", crashed=False)


def build_in_child(program: Any, tensors: Mapping[str, Any], spec: Mapping[str, Any], *,
                   timeout: float = BUILD_TIMEOUT_S) -> tuple[bytes, list[list[Any]], str]:
    """(package bytes, [[fqn, layout], ...] of its weights, the loader that loaded it), built
    by one child process and loaded and run by another (see the module doc); raises
    ChildFailed naming the stage."""
    folder = tempfile.mkdtemp(prefix="surgery-aoti-job-")
    try:
        torch.export.save(program, os.path.join(folder, JOB_PROGRAM))
        torch.save(dict(tensors), os.path.join(folder, JOB_TENSORS))
        with open(os.path.join(folder, JOB_SPEC), "w") as f:
            json.dump(dict(spec), f)
        _run_child("build", folder, timeout)
        loader, crashes = "", []  # type: str, list[str]
        for loader in LOADERS:  # the package loader; if it crashed, the runner, in a new child
            try:
                _run_child("prove", folder, timeout, loader)
                break
            except ChildFailed as e:
                if not e.crashed or loader == LOADERS[-1]:
                    raise ChildFailed("; ".join([*crashes, str(e)]), crashed=e.crashed) from None
                crashes.append(str(e))
        result = json.loads(_read(os.path.join(folder, JOB_RESULT)))
        with open(os.path.join(folder, JOB_PACKAGE), "rb") as pkg:
            data = pkg.read()
        return data, result["constants"], loader
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


# --- the child's side ----------------------------------------------------------------------------

def _stage(folder: str, name: str) -> None:
    with open(os.path.join(folder, JOB_STAGES), "a") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())


def build_main(folder: str) -> int:
    """The build child: the exported program read back and packaged (see the module doc)."""
    from torch._inductor import aoti_compile_and_package  # heavy: inductor's AOT compiler

    with open(os.path.join(folder, JOB_SPEC)) as spec_file:
        spec = json.load(spec_file)
    _stage(folder, "export_load")
    program = torch.export.load(os.path.join(folder, JOB_PROGRAM))
    _stage(folder, "package")
    aoti_compile_and_package(program, package_path=os.path.join(folder, JOB_PACKAGE),
                             inductor_configs=spec["configs"])
    return 0


def prove_main(folder: str, loader: str = LOADERS[0]) -> int:
    """The proving child, a fresh process as a deployment is: the package loaded from its
    bytes by ``loader`` and run on both trials' weights (see the module doc)."""
    with open(os.path.join(folder, JOB_SPEC)) as spec_file:
        spec = json.load(spec_file)
    tensors = torch.load(os.path.join(folder, JOB_TENSORS), weights_only=True)
    with open(os.path.join(folder, JOB_PACKAGE), "rb") as pkg:
        data = pkg.read()
    _stage(folder, "load")
    opened = open_package(data, device=spec["device"], loader=loader)
    fqns = opened.get_constant_fqns()
    own = tensors["own"]
    if not all(f.startswith(PREFIX) and f in own for f in fqns):
        raise ValueError("it needs a constant that is not a weight of the module")
    constants = [[f[len(PREFIX):], layout_of(own[f])] for f in sorted(fqns)]
    runner = AotiRunner(opened, constants, bound=spec["bound"], inputs=spec["inputs"])
    _stage(folder, "run")
    args, kwargs = tensors["args"], tensors["kwargs"]
    with modes_of(spec["modes"]):
        for trial in TRIALS:
            probe = nn.Module() if spec["bound"] else None
            if probe is not None:  # a module of the same tree, holding this trial's weights
                plant(probe, {k[len(PREFIX):]: v for k, v in tensors[trial].items()})
            ok, got = runner.try_call((probe, *args) if probe is not None else tuple(args),
                                      kwargs)
            if str(spec["device"]).startswith("cuda"):
                torch.cuda.synchronize()
            if not ok or not close_enough(got, tensors[f"want_{trial}"]):
                raise ValueError(f"its output does not follow the weights it is given ({trial} "
                                 "weights)")
    with open(os.path.join(folder, JOB_RESULT), "w") as f:
        json.dump({"constants": constants}, f)
    _stage(folder, "done")
    return 0


MAINS = {"build": build_main, "prove": prove_main}


def _main(argv: list[str]) -> int:
    faulthandler.enable()
    mode, folder, *extra = argv
    try:
        return MAINS[mode](folder, *extra)
    except Exception as e:  # export, inductor, the loader or the proof: said to the parent
        first = (str(e).strip().splitlines() or [""])[0][:200]
        with contextlib.suppress(OSError), open(os.path.join(folder, JOB_RESULT), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {first}"}, f)
        return 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
