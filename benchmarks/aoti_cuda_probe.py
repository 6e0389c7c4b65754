"""Where an AOTInductor package crashes on this torch: built in one process, loaded in others.

On the H200 (torch 2.11, 2026-12-01) a CUDA package of two Linear layers built fine and then
ended the process with SIGSEGV in the loader's constructor (torch's own ``aoti_load_package``
and ``torch._C._aoti.AOTIModelPackageLoader`` alike), in the process that had built it. This
probe asks the next questions, each variant in a fresh process with faulthandler on, stage by
stage (one line each, flushed, so the last line says where it died):

  build        process A: export + aoti_compile_and_package, on CUDA and on the CPU
  fresh_cuda   process B (fresh, nothing compiled in it): surgery's open_package + run
  fresh_public process C (fresh): torch._inductor.aoti_load_package + run
  fresh_cpu    process D (fresh): the CPU package, surgery's open_package + run (is it CUDA's?)
  so_runner    process E (fresh): the package unzipped, its .so given to
               torch._C._aoti.AOTIModelContainerRunnerCuda directly (is it the package loader?)
  gdb          process B again under ``gdb -batch`` (or ``cuda-gdb``, which the H200 image has
               instead of gdb) when B crashed: the native stack

    python benchmarks/aoti_cuda_probe.py            # about 60-120 s on the H200
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
if variant in ("fresh_cuda", "fresh_cpu"):
    from surgery.runtime.aoti_bundle import open_package
    data = open(path, "rb").read()
    say("open_package")
    L = open_package(data, device=str(x.device) if dev == "cuda" else "cpu")
    say("loaded", L.get_constant_fqns())
    check(L.run([x])[0])
elif variant == "fresh_public":
    say("aoti_load_package")
    r = torch._inductor.aoti_load_package(path)
    say("loaded")
    check(r(x))
elif variant == "so_runner":
    out = os.path.join(work, "unzipped")
    import zipfile
    zipfile.ZipFile(path).extractall(out)
    so = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.endswith(".so")]
    say("so", so)
    R = torch._C._aoti.AOTIModelContainerRunnerCuda(so[0], 1, "cuda", os.path.dirname(so[0]))
    say("runner made")
    check(R.run([x])[0])
say("OK")
'''


def run(variant: str, work: str, timeout: int, gdb: str = "") -> dict[str, object]:
    script = os.path.join(work, "child.py")
    cmd = [sys.executable, script, variant, work]
    if gdb:
        cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", "timed out"
    stages = [ln[len("stage: "):] for ln in out.splitlines() if ln.startswith("stage: ")]
    tail = [ln for ln in (err + ("\n" + out if gdb else "")).splitlines()
            if ln.strip() and "Warning" not in ln][-(25 if gdb else 8):]
    return {"variant": variant + (" (gdb)" if gdb else ""), "rc": rc, "stages": stages,
            "tail": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU variants only")
    ap.add_argument("--timeout", type=int, default=240, help="per process, seconds")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="aoti_probe_")
    with open(os.path.join(work, "child.py"), "w") as f:
        f.write(CHILD)
    plan = ["build_cpu", "fresh_cpu"] if args.cpu else \
        ["build_cuda", "fresh_cuda", "fresh_public", "so_runner", "build_cpu", "fresh_cpu"]
    results = []
    for v in plan:
        r = run(v, work, args.timeout)
        results.append(r)
        print(f"== {r['variant']}: rc={r['rc']}; stages {r['stages']}")
        for ln in r["tail"]:
            print("   ", ln[:300])
    crashed = next((r for r in results if r["variant"] == "fresh_cuda" and r["rc"] != 0), None)
    gdb = shutil.which("gdb") or shutil.which("cuda-gdb") or ""
    if crashed is not None and gdb:
        r = run("fresh_cuda", work, args.timeout, gdb=gdb)
        results.append(r)
        print(f"== {r['variant']}: rc={r['rc']}")
        for ln in r["tail"]:
            print("   ", ln[:300])
    elif crashed is not None:
        print("(neither gdb nor cuda-gdb installed: no native stack)")
    names = sorted(os.path.relpath(n, work) for n in glob.glob(os.path.join(work, "*.pt2")))
    for n in names:
        with zipfile.ZipFile(os.path.join(work, n)) as z:
            print(n, [i.filename.split("/")[-1] for i in z.infolist()][:12])
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
