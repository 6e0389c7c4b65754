"""Benchmarks for `surgery verify` and `surgery export` (issue 3). Run by hand, not in CI.

1. `surgery verify` on a multi-GB safetensors file: wall time of a fresh process, interpreter
   start-up included. The file is the example model at LingBot size saved after LingBot-Map's
   regional compile (so verify has findings to group). Its data region is sparse: a valid
   file that costs no real I/O to create, which is fine since verify reads the header only.
2. `surgery export` on a >= 1 GB ``torch.save`` checkpoint of real tensors: throughput and
   peak RSS (``/usr/bin/time -v``), against the naive ``torch.load`` + ``save_file``.

Usage: .venv/bin/python benchmarks/bench_verify_export.py [--runs 5] [--gb 1.2] [--record]
Big files go to a temporary folder under /tmp and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
SURGERY = os.path.join(BIN, "surgery")

NAIVE = """
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], weights_only=True{mmap})
save_file({{k.replace("_orig_mod.", ""): v.contiguous() for k, v in sd.items()}}, sys.argv[2],
          metadata={{"format": "pt"}})
"""


def sparse_safetensors(path: str, tensors: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """A valid safetensors file whose data region is a hole (zeros); returns its size."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tests_support import write_header_only_safetensors

    return write_header_only_safetensors(path, tensors)


def lingbot_regional_keys() -> dict[str, tuple[tuple[int, ...], str]]:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from wrapped import _regional

    from surgery.examples import LINGBOT, ExampleModel

    with torch.device("meta"):
        m = _regional(ExampleModel(LINGBOT))
    return {k: (tuple(v.shape), "F32") for k, v in m.state_dict().items()}


def wall(cmd: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - t)
    return times


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one command, through /usr/bin/time -v."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{r.stdout}\n{r.stderr}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    assert m, r.stderr
    return elapsed, int(m.group(1)) / 1024


def bench_verify(folder: str, runs: int) -> list[dict[str, object]]:
    rows = []
    keys = lingbot_regional_keys()
    tiny_keys = {f"_orig_mod.{k}" if i % 2 else k: v for i, (k, v) in enumerate(
        {"a.weight": ((8, 8), "F32"), "b.weight": ((8,), "F32")}.items())}
    for label, tensors in (("tiny (2 tensors)", tiny_keys),
                           (f"LingBot size after regional compile ({len(keys)} tensors, "
                            f"{sum('_orig_mod' in k for k in keys)} `_orig_mod.` keys)", keys)):
        path = os.path.join(folder, "verify.safetensors")
        size = sparse_safetensors(path, tensors)
        times = wall([SURGERY, "verify", path], runs)
        rows.append({"checkpoint": label, "size_gb": size / 1e9,
                     "median": statistics.median(times), "min": min(times), "max": max(times)})
        os.unlink(path)
    return rows


def bench_export(folder: str, gb: float) -> list[dict[str, object]]:
    import torch

    # Real tensors: 64 MiB F32 matrices (the largest tensor) plus small biases, keys left by
    # torch.compile, saved with torch.save (zip format) as a training job would.
    n = max(1, round(gb * 1e9 / (4096 * 4096 * 4)))
    sd = {}
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        sd[f"_orig_mod.blocks.{i}.weight"] = torch.randn(4096, 4096, generator=g)
        sd[f"_orig_mod.blocks.{i}.bias"] = torch.randn(4096, generator=g)
    src = os.path.join(folder, "big.pt")
    torch.save(sd, src)
    del sd
    size = os.path.getsize(src)
    subprocess.run(["cat", src], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    rows = []
    elapsed, rss = timed([sys.executable, "-c", "import torch, safetensors.torch"])
    rows.append({"arm": "baseline: `import torch` only", "input_gb": size / 1e9, "wall": elapsed,
                 "throughput_gbs": float("nan"), "peak_rss_mib": rss})
    arms = [
        ("surgery export", [SURGERY, "export", src, "-o", os.path.join(folder, "a.safetensors")]),
        ("naive torch.load + save_file",
         [sys.executable, "-c", NAIVE.format(mmap=""), src, os.path.join(folder, "b.safetensors")]),
        ("naive, torch.load(mmap=True) + save_file",
         [sys.executable, "-c", NAIVE.format(mmap=", mmap=True"), src,
          os.path.join(folder, "c.safetensors")]),
    ]
    for label, cmd in arms:
        elapsed, rss = timed(cmd)
        rows.append({"arm": label, "input_gb": size / 1e9, "wall": elapsed,
                     "throughput_gbs": size / 1e9 / elapsed, "peak_rss_mib": rss})
        os.unlink(cmd[-1])
    os.unlink(src)
    rows.append({"largest_tensor_mib": 4096 * 4096 * 4 / 2**20, "tensors": 2 * n})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="surgery-bench-", dir="/tmp")
    free = shutil.disk_usage(folder).free / 1e9
    if free < 3 * args.gb + 5:
        raise SystemExit(f"/tmp has {free:.1f} GB free; need about {3 * args.gb + 5:.0f} GB")
    try:
        verify_rows = bench_verify(folder, args.runs)
        export_rows = bench_export(folder, args.gb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"verify": verify_rows, "export": export_rows}, indent=2))
    if args.record:
        record(verify_rows, export_rows, args)


def record(verify_rows, export_rows, args) -> None:
    import torch

    today = datetime.date.today().isoformat()
    lines = [
        "", "## `surgery verify` and `surgery export` (issue 3)", "",
        f"{today} · this project's CPU machine ({platform.machine()}, 2-core CPU, 24 GiB) · "
        f"Python {platform.python_version()} · torch {torch.__version__}", "",
        f"Command: `.venv/bin/python benchmarks/bench_verify_export.py --runs {args.runs} "
        f"--gb {args.gb} --record`", "",
        "### verify on a safetensors file (fresh `surgery verify FILE` process, start-up "
        "included)", "",
        f"| checkpoint | file size | wall (median of {args.runs}) | min | max |",
        "|---|---|---|---|---|",
    ]
    for r in verify_rows:
        lines.append(f"| {r['checkpoint']} | {r['size_gb']:.3f} GB | {r['median']:.3f} s | "
                     f"{r['min']:.3f} s | {r['max']:.3f} s |")
    meta = export_rows[-1]
    lines += [
        "", f"### export of a {export_rows[0]['input_gb']:.2f} GB `torch.save` checkpoint "
        f"({meta['tensors']} tensors, largest {meta['largest_tensor_mib']:.0f} MiB, "
        "`_orig_mod.` keys; page cache warm; wall and peak RSS from `/usr/bin/time -v`, "
        "interpreter start-up and `import torch` included)", "",
        "| arm | wall | throughput | peak RSS |", "|---|---|---|---|",
    ]
    for r in export_rows[:-1]:
        gbs = r["throughput_gbs"]
        tp = "-" if gbs != gbs else f"{gbs:.2f} GB/s"  # NaN for the baseline row
        lines.append(f"| {r['arm']} | {r['wall']:.2f} s | {tp} | {r['peak_rss_mib']:.0f} MiB |")
    with open(os.path.join(HERE, "RESULTS.md"), "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
