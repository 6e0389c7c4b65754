"""`surgery plan` (and `verify`) time in a fresh process, against file size and tensor count.

Plan reads the safetensors header only, so its time should not grow with the file size.
Both files of the first table are real, fully written safetensors files (the big one is the
example model at LingBot size in F32, ~3.6 GB).

The second table (`--scale`) times `surgery plan` and `surgery verify` on synthetic header-only
files of N tensors (a transformer-like layout: numbered layers of 16 small tensors each), so
that a planner or reader that is quadratic in the tensor count shows (issue 10: 8k tensors took
6.2 s, 100k did not finish in 600 s). Targets: 100k tensors under 3 s, 1M under 30 s.

Each timing is a fresh process, interpreter start-up included; the median of several runs is
reported.

    .venv/bin/python benchmarks/bench_plan.py [--runs 5] [--dir /tmp]
    .venv/bin/python benchmarks/bench_plan.py --scale 1000,10000,100000,1000000 [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from tests_support import write_header_only_safetensors  # noqa: E402


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
    out = path + ".surgery.toml"
    return [w for w, _ in time_cli(["plan", path, "-o", out, "--force", "--json"], runs)]


def time_cli(args: list[str], runs: int, *, ok: tuple[int, ...] = (0,)
             ) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of `runs` fresh `surgery ARGS` processes.

    CPU time (user + system of the child) is reported beside wall time because the machines
    these run on are shared: under a load of 6 on 2 cores the wall time is several times the
    CPU time, and only the CPU time says whether the work grows linearly.
    """
    # `python -m surgery` with this checkout first on the path, so that the code timed is the
    # code beside this script, not whatever copy the venv's `surgery` script imports.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    times = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "surgery", *args], capture_output=True,
                              env=env)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        times.append((wall, cpu))
        if proc.returncode not in ok:
            raise SystemExit(f"surgery {' '.join(args)} exited {proc.returncode}: "
                             f"{proc.stderr.decode()[-500:]}")
    return times


# One layer of the synthetic model: 16 tensors, as a pre-norm transformer block has.
_LAYER = ("norm1.weight", "norm1.bias", "attn.q.weight", "attn.q.bias", "attn.k.weight",
          "attn.k.bias", "attn.v.weight", "attn.v.bias", "attn.proj.weight", "attn.proj.bias",
          "norm2.weight", "norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight",
          "mlp.fc2.bias")


def write_synthetic_header(path: str, n: int) -> int:
    """A header-only (sparse) safetensors file of `n` tiny tensors in numbered layers.

    The header is written compactly so that 1M tensors stay under the readers' 100 MB header
    limit; each tensor is 2 BF16 values, so the data offsets stay short too.
    """
    parts = []
    offset = 0
    for i in range(n):
        name = f"layers.{i // len(_LAYER)}.{_LAYER[i % len(_LAYER)]}"
        parts.append(f'"{name}":{{"dtype":"BF16","shape":[2],"data_offsets":[{offset},'
                     f'{offset + 4}]}}')
        offset += 4
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    json.loads(raw)  # the file must be valid, or the timings would measure an error path
    return len(raw)


def scale_rows(counts: list[int], work: str, runs: int) -> list[tuple[Any, ...]]:
    """Per count: tensors, header bytes, then (wall, CPU) medians of plan and of verify."""
    rows: list[tuple[Any, ...]] = []
    for n in counts:
        path = os.path.join(work, f"synthetic-{n}.safetensors")
        header = write_synthetic_header(path, n)
        out = path + ".surgery.toml"
        plan = time_cli(["plan", path, "-o", out, "--force", "--json"], runs)
        verify = time_cli(["verify", path, "--json"], runs, ok=(0, 1))
        rows.append((n, header, *_medians(plan), *_medians(verify), os.getloadavg()[0]))
        os.remove(path)
    return rows


def _medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def _machine_line() -> str:
    import torch

    return (f"# {time.strftime('%Y-%m-%d')}  {platform.machine()} {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--scale", default="", help="comma-separated tensor counts (e.g. "
                    "1000,100000,1000000): time plan and verify on synthetic headers instead")
    args = ap.parse_args()
    work = tempfile.mkdtemp(dir=args.dir, prefix="bench_plan_")
    try:
        if args.scale:
            counts = [int(c) for c in args.scale.split(",")]
            scaled = scale_rows(counts, work, args.runs)
            print(_machine_line())
            print("| tensors | header | plan wall | plan CPU | verify wall | verify CPU | load |")
            print("|---|---|---|---|---|---|---|")
            for n, header, pw, pc, vw, vc, load in scaled:
                print(f"| {n:,} | {header / 1e6:.1f} MB | {pw:.2f} s | {pc:.2f} s | "
                      f"{vw:.2f} s | {vc:.2f} s | {load:.1f} |")
            return
        rows = []
        for size in ("tiny", "lingbot"):
            path = os.path.join(work, f"{size}.safetensors")
            nbytes = write_safetensors(path, model_tensors(size))
            times = time_plan(path, args.runs)
            rows.append((size, nbytes, statistics.median(times), min(times), max(times)))
        print(_machine_line())
        print("| checkpoint | file size | plan wall (median) | min | max |")
        print("|---|---|---|---|---|")
        for size, nbytes, med, lo, hi in rows:
            print(f"| {size} | {nbytes / 1e9:.3f} GB | {med:.3f} s | {lo:.3f} s | {hi:.3f} s |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
