"""The precompiled loader's one-time set-up, with and without its prefetch threads, in turns.

What it times: in a fresh process (torch and ``surgery.runtime.apply`` imported first, untimed,
as a deployment has them before ``apply_manifest``), exactly what a warm start runs before its
first artifact loads: ``KeyPrefetch.start(device)`` (surgery.runtime.warm_loader: the keys and
the native build started in threads, the build's modules imported first) and then
``prepare_loader(device, keys)`` (surgery.runtime.load_timing: the loader's imports, the
native build's step, the wait for the keys). Arms:

  after   the native build's thread beside the imports (``KeyPrefetch.start(device,
          build=True)``: the default on CUDA; on the CPU asked for, since by default the CPU
          keeps its probe after the imports)
  before  ``KeyPrefetch.start(device, build=False)``: the code before the native-build thread
          (on CUDA the keys still hashed in their thread; the build after the imports, on the
          caller's thread; on the CPU every step on the caller's thread, one after the other)

Each process gets its own new, empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (a fresh
container's), and, with ``--no-bytecode``, PYTHONDONTWRITEBYTECODE=1 and an empty
PYTHONPYCACHEPREFIX (an image that ships no ``.pyc``: every module the set-up imports is
compiled from source). Arms alternate (before, after, after, before, ...), so a host whose
load drifts moves both. Per process: the set-up's seconds and steps, its process CPU seconds,
and its peak RSS (the kernel's ``ru_maxrss`` of that process, which it reports at its end).

    python benchmarks/warm_setup_turns.py --device cpu --rounds 3
    python benchmarks/warm_setup_turns.py --device cpu --rounds 3 --no-bytecode
    python benchmarks/warm_setup_turns.py --device cuda --rounds 4          # the H200

Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("before", "after")

_CHILD = """
import json, resource, sys, time
import torch
import surgery.runtime.apply  # noqa: F401  (dynamo too: a deployment has it before apply)
from surgery.runtime.load_timing import prepare_loader
from surgery.runtime.warm_loader import KeyPrefetch
arm, device = sys.argv[1], sys.argv[2]
if device.startswith("cuda"):
    torch.cuda.init()  # the model is on the GPU before apply_manifest runs
n0, c0, t0 = len(sys.modules), time.process_time(), time.perf_counter()
keys = KeyPrefetch.start(device, build=arm == "after")
setup = prepare_loader(device, keys)
print(json.dumps({"arm": arm, "seconds": round(time.perf_counter() - t0, 3),
                  "loader_setup_s": setup.seconds, "steps": setup.steps, "keys": setup.keys,
                  "cpu_s": round(time.process_time() - c0, 3),
                  "modules": len(sys.modules) - n0, "torch": torch.__version__,
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                        / 1024, 1)}))
"""


def run_one(arm: str, device: str, *, no_bytecode: bool, timeout: int) -> dict[str, Any]:
    """One fresh process of one arm; its result with the child's peak RSS (MiB)."""
    work = tempfile.mkdtemp(prefix=f"warm_setup_{arm}_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(work, "triton"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if no_bytecode:
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=os.path.join(work, "pyc"))
    try:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, arm, device], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"arm": arm, "error": f"timed out after {timeout} s"}
        wall = time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        return {"arm": arm, "error": f"rc {proc.returncode}: {err.strip()[-400:]}"}
    res = json.loads(out.strip().splitlines()[-1])
    res["process_wall_s"] = round(wall, 2)
    return res


def run_turns(rounds: int, device: str, *, no_bytecode: bool, timeout: int
              ) -> list[dict[str, Any]]:
    """Rounds of both arms, alternating which goes first (before/after, after/before, ...)."""
    results = []
    for i in range(rounds):
        for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
            res = run_one(arm, device, no_bytecode=no_bytecode, timeout=timeout)
            res["round"] = i
            print(json.dumps(res), file=sys.stderr, flush=True)
            results.append(res)
    return results


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| arm | processes | set-up s (median) | each | steps (median s) | process CPU s "
            "(median) | peak RSS MiB (max) |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        ok = [r for r in results if r["arm"] == arm and "error" not in r]
        bad = [r for r in results if r["arm"] == arm and "error" in r]
        if not ok:
            rows.append(f"| {arm} | 0 (failed: {bad[0]['error'][:120] if bad else 'none run'}) "
                        "| | | | | |")
            continue
        steps = sorted({k for r in ok for k in r["steps"]})
        med = {k: round(statistics.median(r["steps"].get(k, 0.0) for r in ok), 3) for k in steps}
        each = " / ".join(f"{r['seconds']:.2f}" for r in ok)
        rows.append(
            f"| {arm} | {len(ok)}{f' ({len(bad)} failed)' if bad else ''} "
            f"| **{statistics.median(r['seconds'] for r in ok):.2f}** "
            f"| {each} | {med} "
            f"| {statistics.median(r['cpu_s'] for r in ok):.2f} "
            f"| {max(r.get('peak_rss_mib', 0) for r in ok)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both arms")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="every process without bytecode (an image without .pyc)")
    ap.add_argument("--timeout", type=int, default=120, help="per process, seconds")
    args = ap.parse_args()
    results = run_turns(args.rounds, args.device, no_bytecode=args.no_bytecode,
                        timeout=args.timeout)
    print(f"## loader set-up in turns ({args.device}; bytecode "
          f"{'none' if args.no_bytecode else 'host'})\n")
    print(table(results))
    print()
    print(json.dumps({"device": args.device, "no_bytecode": args.no_bytecode,
                      "results": results}))


if __name__ == "__main__":
    main()
