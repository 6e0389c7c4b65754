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
  gdb           the first of B, C that crashed, again under ``gdb -batch`` (or ``cuda-gdb``,
                which the H200 image has instead of gdb): its native stack
  --cpu-too     the same for a CPU package on that host (is it CUDA's?)

A time budget (``--budget``, 115 s) bounds the whole probe: each process gets what is left, and
the gdb rerun is skipped when too little is.

    python benchmarks/aoti_cuda_probe.py            # at most --budget s (115) on the H200
    python benchmarks/aoti_cuda_probe.py --cpu      # the CPU variants only (a check here)

Prints each variant's stages and return code, then one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
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
if variant == "fresh_runner_cpu":
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


def run(variant: str, work: str, timeout: float, gdb: str = "") -> dict[str, object]:
    script = os.path.join(work, "child.py")
    cmd = [sys.executable, script, variant, work]
    if gdb:
        cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
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
    cuda = ["build_cuda", "fresh_cuda", "fresh_runner"]
    cpu = ["build_cpu", "fresh_cpu", "fresh_runner_cpu"]
    plan = cpu if args.cpu else cuda + (cpu if args.cpu_too else [])
    results = []
    for v in plan:
        left = deadline - time.perf_counter()
        if left < 5:
            print(f"== {v}: not run (budget spent)")
            continue
        r = run(v, work, left)
        results.append(r)
        print(f"== {r['variant']}: rc={r['rc']} in {r['seconds']} s; stages {r['stages']}")
        for ln in r["tail"]:
            print("   ", ln[:300])
    crashed = next((r for r in results if str(r["variant"]).startswith("fresh")
                    and r["rc"] not in (0, None)), None)
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
