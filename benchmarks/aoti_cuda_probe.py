"""Where an AOTInductor package crashes on this torch: built in one process, loaded in others.

On the H200 (torch 2.11, 2026-12-01) a CUDA package of two Linear layers built fine and then
ended the process with SIGSEGV in the loader's constructor (torch's own ``aoti_load_package``
and ``torch._C._aoti.AOTIModelPackageLoader`` alike), in the process that had built it. This
probe asks the next questions, each variant in a fresh process with faulthandler on, stage by
stage (one line each, flushed, so the last line says where it died):

  build         process A: export + aoti_compile_and_package (one package, CUDA)
  fresh_cuda    process B (fresh, nothing compiled in it): surgery's open_package with the
                package loader (torch's AOTIModelPackageLoader, as aoti_load_package) + run
  fresh_runner  process C (fresh): surgery's open_package with the runner loader (the library
                run by torch._C._aoti.AOTIModelContainerRunnerCuda directly) + run
  abi           (no process) the built library against the C++ runtimes: the g++ that built it
                and the highest GLIBCXX its libstdc++ provides, the highest the library
                needs, what ldd resolves it to, the ABI flags in the package's flag files
  maps          a fresh loader process (torch, CUDA, triton imported): the libstdc++ it has
                mapped, torch's C++11-ABI flag, and which loaded libraries export std::regex
                code (the crash is in the regex the library's constructor compiles: code
                the library instantiates, which the dynamic linker may bind to another
                library's copy of it), and whether the library itself exports it
  deepbind      the runner loader after the library was dlopen-ed with RTLD_DEEPBIND (its own
                definitions first): if this runs and fresh_runner crashes, the crash is symbol
                interposition, and this is the work-around
  preload       the runner loader with LD_PRELOAD of the g++'s own libstdc++ (for the load
                only): if this runs, the crash is an older libstdc++ loaded first
  gdb           the first of B, C that crashed, again under ``gdb -batch`` (or ``cuda-gdb``,
                which the H200 image has instead of gdb): its native stack
  --cpu-too     the same for a CPU package on that host (is it CUDA's?)

They run in that order (build, abi, maps, deepbind, preload, fresh_runner, fresh_cuda), so
that the questions are answered before the two known crashes. A time budget (``--budget``,
115 s) bounds the whole probe: each process gets what is left, and
the gdb rerun is skipped when too little is.

    python benchmarks/aoti_cuda_probe.py            # at most --budget s (115) on the H200
    python benchmarks/aoti_cuda_probe.py --cpu      # the CPU variants only (a check here)

Prints each variant's stages and return code, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import faulthandler, os, sys
faulthandler.enable()
def say(*a): print("stage:", *a, flush=True)
import torch
from torch import nn
variant, work = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
class M(nn.Module):
    def __init__(s): super().__init__(); s.a = nn.Linear(64, 128); s.b = nn.Linear(128, 64)
    def forward(s, x): return s.b(torch.nn.functional.gelu(s.a(x)))
dev = "cpu" if variant.endswith("cpu") else "cuda"
variant = variant[:-len("_cpu")] if variant.endswith("_cpu") else variant
if variant == "preload":  # the runner loader, with LD_PRELOAD set by the parent
    variant = "fresh_runner"
m = M().to(dev).eval(); x = torch.randn(4, 64, device=dev)
with torch.no_grad():
    want = m(x)
path = os.path.join(work, f"p_{dev}.pt2")
if variant.startswith("build"):
    from torch._inductor import aoti_compile_and_package
    with torch.no_grad():
        ep = torch.export.export(m, (x,), strict=False)
    say("exported")
    aoti_compile_and_package(ep, package_path=path)
    say("packaged", os.path.getsize(path))
    raise SystemExit(0)
def check(y):
    if dev == "cuda":
        torch.cuda.synchronize()
    say("ran, max abs diff", float((y - want).abs().max()))
def unpacked():
    import zipfile
    folder = os.path.join(work, f"unpacked_{dev}")
    with zipfile.ZipFile(path) as z:
        z.extractall(folder)
    (lib,) = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".so")]
    return lib
if variant == "maps":  # which C++ runtime and which exporters of std::regex a loader process has
    import subprocess, json as _j
    import torch._C._aoti
    if dev == "cuda":
        torch.zeros(1, device="cuda")
    import triton  # a real warm process has it mapped too
    libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if ".so" in ln.split()[-1]})
    say("libstdc++ mapped", [l for l in libs if "libstdc++" in l])
    say("torch cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI, "torch", torch.__version__)
    lib = unpacked()
    def regex_syms(so):
        try:
            out = subprocess.run(["nm", "-D", "-C", "--defined-only", so], capture_output=True,
                                 text=True, timeout=30).stdout
        except Exception as e:
            return f"nm failed: {e}"
        return sum(("regex_traits" in ln or "std::__detail::_Compiler" in ln
                    or "std::__detail::_Scanner" in ln) for ln in out.splitlines())
    exporters = {}
    for so in libs:
        if any(k in so for k in ("torch", "c10", "triton", "libstdc++", "nvidia", "cuda")):
            n = regex_syms(so)
            if n:
                exporters[os.path.basename(so)] = n
    say("loaded libs exporting std::regex code", exporters)
    say("wrapper exports std::regex code", regex_syms(lib))
    raise SystemExit(0)
if variant == "deepbind":
    # The package's library dlopen-ed first with RTLD_DEEPBIND (its own definitions before any
    # loaded library's, for the std::regex code it instantiates), then the runner opens the
    # same path, which dlopen answers with that handle.
    import ctypes
    lib = unpacked()
    ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND)
    say("dlopen deepbind", os.path.basename(lib))
    aoti = torch._C._aoti
    runner = aoti.AOTIModelContainerRunnerCuda(lib, 1, "cuda", os.path.dirname(lib), True) \
        if dev == "cuda" else aoti.AOTIModelContainerRunnerCpu(lib, 1)
    say("loaded")
    check(runner.run([x])[0])
    say("OK")
    raise SystemExit(0)
if variant.startswith("fresh"):
    from surgery.runtime.aoti_bundle import open_package
    data = open(path, "rb").read()
    loader = "runner" if variant == "fresh_runner" else "package"
    say("open_package", loader)
    L = open_package(data, device=str(x.device) if dev == "cuda" else "cpu", loader=loader)
    say("loaded", L.get_constant_fqns())
    check(L.run([x])[0])
say("OK")
'''


def gxx_runtime() -> str:
    """The libstdc++ of the g++ that builds the package (what LD_PRELOAD gives ``preload``)."""
    try:
        out = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return os.path.realpath(out) if out and os.path.isabs(out) else ""


def _sh(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return p.stdout + p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cmd[0]}: {e}"


def _glibcxx_max(text: str) -> str:
    """The highest GLIBCXX_3.4.N version named in ``text`` (objdump -T or strings output)."""
    found = [int(v) for v in re.findall(r"GLIBCXX_3\.4\.(\d+)", text)]
    return f"GLIBCXX_3.4.{max(found)}" if found else "none"


def abi_report(work: str, dev: str) -> dict[str, object]:
    """The built library against the C++ runtimes: which g++ built it and its libstdc++, the
    highest GLIBCXX the library needs, what ``ldd`` resolves it to, the ABI flags it was built
    with (the package's flag files), and the highest GLIBCXX each libstdc++ provides."""
    path = os.path.join(work, f"p_{dev}.pt2")
    if not os.path.exists(path):
        return {"error": "no package built"}
    folder = os.path.join(work, f"abi_{dev}")
    with zipfile.ZipFile(path) as z:
        z.extractall(folder)
        flags = [n for n in z.namelist() if n.endswith("flags.json")]
    libs = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".so")]
    if not libs:
        return {"error": "no .so in the package"}
    lib = libs[0]
    gxx = gxx_runtime()
    ldd = [ln.strip() for ln in _sh(["ldd", lib]).splitlines() if "stdc++" in ln or "not found"
           in ln]
    abi_flags = []
    for n in flags:
        with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, n)) as f:
            abi_flags += re.findall(r"-D_GLIBCXX_USE_CXX11_ABI=\d|-static-libstdc\+\+|"
                                    r"-fvisibility[=\w-]*|_GLIBCXX_USE_CXX11_ABI[^,\]]*",
                                    f.read())
    return {"gxx": _sh(["g++", "--version"]).splitlines()[0] if gxx else "no g++",
            "gxx_libstdcxx": gxx, "gxx_libstdcxx_provides": _glibcxx_max(_sh(["strings", gxx]))
            if gxx else "", "library_needs": _glibcxx_max(_sh(["objdump", "-T", lib])),
            "ldd_libstdcxx": ldd, "build_flags": sorted(set(abi_flags)), "flag_files": flags}


def run(variant: str, work: str, timeout: float, gdb: str = "",
        extra_env: dict[str, str] | None = None) -> dict[str, object]:
    script = os.path.join(work, "child.py")
    cmd = [sys.executable, script, variant, work]
    if gdb:
        cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    started = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout),
                           env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", f"timed out at {timeout:.0f} s"
    stages = [ln[len("stage: "):] for ln in out.splitlines() if ln.startswith("stage: ")]
    tail = [ln for ln in (err + ("\n" + out if gdb else "")).splitlines()
            if ln.strip() and "Warning" not in ln][-(25 if gdb else 8):]
    return {"variant": variant + (" (gdb)" if gdb else ""), "rc": rc, "stages": stages,
            "seconds": round(time.perf_counter() - started, 1), "tail": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU variants only")
    ap.add_argument("--cpu-too", action="store_true", help="the CPU variants after CUDA's")
    ap.add_argument("--budget", type=float, default=115, help="seconds for the whole probe")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.budget
    work = tempfile.mkdtemp(prefix="aoti_probe_")
    with open(os.path.join(work, "child.py"), "w") as f:
        f.write(CHILD)
    # The crash's questions first (the ABI, the loaded runtimes, the two work-arounds), the two
    # loaders that crashed before last.
    cuda = ["build_cuda", "abi", "maps", "deepbind", "preload", "fresh_runner", "fresh_cuda"]
    cpu = ["build_cpu", "abi_cpu", "maps_cpu", "deepbind_cpu", "preload_cpu", "fresh_cpu",
           "fresh_runner_cpu"]
    plan = cpu if args.cpu else cuda + (cpu if args.cpu_too else [])
    results: list[dict[str, object]] = []
    gxx = gxx_runtime()
    for v in plan:
        left = deadline - time.perf_counter()
        if left < 5:
            print(f"== {v}: not run (budget spent)")
            continue
        if v.startswith("abi"):
            rep = abi_report(work, "cpu" if v.endswith("cpu") else "cuda")
            results.append({"variant": v, "abi": rep})
            print(f"== {v}: {json.dumps(rep)}")
            continue
        if v.startswith("preload") and not gxx:
            print(f"== {v}: not run (no g++ runtime found to preload)")
            continue
        r = run(v, work, left, extra_env={"LD_PRELOAD": gxx} if v.startswith("preload") else None)
        results.append(r)
        print(f"== {r['variant']}: rc={r['rc']} in {r['seconds']} s; stages {r['stages']}")
        for ln in r["tail"]:
            print("   ", ln[:300])
    crashed = next((r for r in results if str(r["variant"]).startswith("fresh")
                    and r.get("rc") not in (0, None)), None)
    gdb = shutil.which("gdb") or shutil.which("cuda-gdb") or ""
    left = deadline - time.perf_counter()
    if crashed is not None and gdb and left > 15:
        r = run(str(crashed["variant"]), work, left, gdb=gdb)
        results.append(r)
        print(f"== {r['variant']}: rc={r['rc']}")
        for ln in r["tail"]:
            print("   ", ln[:300])
    elif crashed is not None:
        print("(no native stack: " + ("budget spent)" if gdb else
                                       "neither gdb nor cuda-gdb installed)"))
    names = sorted(os.path.relpath(n, work) for n in glob.glob(os.path.join(work, "*.pt2")))
    for n in names:
        with zipfile.ZipFile(os.path.join(work, n)) as z:
            print(n, [i.filename.split("/")[-1] for i in z.infolist()][:12])
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
