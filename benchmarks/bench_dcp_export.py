"""`surgery export` of a DCP folder streams tensor by tensor: its peak memory against the model.

Saves a DCP folder (``torch.distributed.checkpoint.save``, one process) of ``--tensors`` float32
tensors of ``--mib`` MiB each under a ``model`` entry, then runs ``surgery plan``, ``verify`` and
``export`` on it, each in a fresh process, and reports wall time and peak RSS (the child's
``ru_maxrss``, interpreter start-up and ``import torch`` included). Streaming shows as a peak
near the import baseline plus about twice one tensor (the target, and the chunk ``torch.load``
returns), whatever the model's size; loading the whole model would need its full size.

    python benchmarks/bench_dcp_export.py                  # 16 x 64 MiB = 1 GiB
    python benchmarks/bench_dcp_export.py --tensors 4 --mib 8   # quick check

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(folder: str, tensors: int, mib: int) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    n = mib * 2**20 // 4
    sd = {f"layers.{i}.weight": torch.randn(n // 1024, 1024) for i in range(tensors)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "step": 1}, checkpoint_id=folder, no_dist=True)
    return sum(t.numel() * 4 for t in sd.values())


def _child(argv: list[str]) -> dict[str, Any]:
    """One fresh `python -m surgery ...` process: its wall time and peak RSS."""
    t = time.perf_counter()
    code = ("import resource, runpy, sys; sys.argv = ['surgery', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('surgery', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\nelse:\n    rc = 0\n"
            "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=1800)
    wall = time.perf_counter() - t
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RSS ")), "RSS 0 -1")
    _, rss, rc = line.split()
    return {"cmd": argv[0], "wall_s": round(wall, 2), "peak_rss_mib": round(int(rss) / 1024),
            "rc": int(rc) if rc.lstrip("-").isdigit() else rc,
            "err": proc.stderr.strip().splitlines()[-1:] if int(rss) == 0 else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--save-to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.save_to:  # the child that writes the folder
        print(_save(args.save_to, args.tensors, args.mib))
        return
    work = tempfile.mkdtemp(prefix="bench_dcp_")
    try:
        folder = os.path.join(work, "step-1")
        # Saved by a child process: this one never imports torch, and a child's ru_maxrss
        # starts from its parent's at fork (Linux keeps the high-water mark across exec).
        total = int(subprocess.run(
            [sys.executable, __file__, "--tensors", str(args.tensors), "--mib", str(args.mib),
             "--save-to", folder], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONPATH": ROOT}).stdout.split()[-1])
        out = os.path.join(work, "out", "model.safetensors")
        os.makedirs(os.path.dirname(out))
        rows = [_child(["plan", folder, "-o", os.path.join(work, "m.surgery.toml")]),
                _child(["verify", folder]),
                _child(["export", folder, "-o", out])]
        baseline = _child(["verify", folder, "--deep"])
        rows.append({**baseline, "cmd": "verify --deep"})
        exported = os.path.getsize(out) if os.path.exists(out) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"model: {args.tensors} x {args.mib} MiB = {total / 2**20:.0f} MiB of float32; "
          f"export wrote {exported / 2**20:.0f} MiB\n")
    print("| command | wall s | peak RSS MiB | exit |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['cmd']} | {r['wall_s']} | {r['peak_rss_mib']} | {r['rc']} |")
    print(json.dumps({"bench": "dcp_export", "tensors": args.tensors, "mib": args.mib,
                      "model_mib": round(total / 2**20), "rows": rows,
                      "self_peak_rss_mib": round(resource.getrusage(
                          resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
