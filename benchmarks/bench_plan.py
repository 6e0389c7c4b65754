"""`surgery plan` on a multi-GB safetensors checkpoint vs a tiny one (wall time, fresh process).

Plan reads the safetensors header only, so its time should not grow with the file size.
Both files are real, fully written safetensors files (the big one is the example model at
LingBot size in F32, ~3.6 GB). Each timing is a fresh `surgery plan` process, interpreter
start-up included; the median of several runs is reported.

    .venv/bin/python benchmarks/bench_plan.py [--runs 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from tests_support import write_header_only_safetensors


def write_safetensors(path: str, tensors: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """A complete safetensors file with zero-filled data, written for real (not sparse)."""
    return write_header_only_safetensors(path, tensors, sparse=False)


def model_tensors(size: str) -> dict[str, tuple[tuple[int, ...], str]]:
    import torch

    from surgery.examples import lingbot, tiny

    with torch.device("meta"):
        model = lingbot() if size == "lingbot" else tiny()
    return {k: (tuple(v.shape), "F32") for k, v in model.state_dict().items()}


def time_plan(path: str, runs: int) -> list[float]:
    exe = os.path.join(os.path.dirname(sys.executable), "surgery")
    out = path + ".surgery.toml"
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([exe, "plan", path, "-o", out, "--force", "--json"], check=True,
                       capture_output=True)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    work = tempfile.mkdtemp(dir=args.dir, prefix="bench_plan_")
    try:
        rows = []
        for size in ("tiny", "lingbot"):
            path = os.path.join(work, f"{size}.safetensors")
            nbytes = write_safetensors(path, model_tensors(size))
            times = time_plan(path, args.runs)
            rows.append((size, nbytes, statistics.median(times), min(times), max(times)))
        import torch

        print(f"# {time.strftime('%Y-%m-%d')}  {platform.machine()} {os.cpu_count()} cores, "
              f"Python {platform.python_version()}, torch {torch.__version__}")
        print("| checkpoint | file size | plan wall (median) | min | max |")
        print("|---|---|---|---|---|")
        for size, nbytes, med, lo, hi in rows:
            print(f"| {size} | {nbytes / 1e9:.3f} GB | {med:.3f} s | {lo:.3f} s | {hi:.3f} s |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
