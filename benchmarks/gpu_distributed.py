"""Past one GPU: apply_manifest on every rank of a DDP model, throughput on 1 and N GPUs, per-rank
start-up cold and warm (one signed bundle loaded by every rank), and peak memory per rank.

Model: transformers' BERT-base (random weights, bf16, 128 tokens, batch 64 per rank) under
DistributedDataParallel, inference_mode, the manifest `surgery plan` writes for the live model
(the 12 ``encoder.layer.N`` blocks, region CUDA graphs). Every rank runs its own batch
(data-parallel inference), so the throughput of N ranks is the sum of theirs.

Four launches, each through ``torchrun`` (torch's own launcher), each rank with its own new,
empty TORCHINDUCTOR_CACHE_DIR:
  cold/1   1 rank compiles from nothing; it saves the signed bundle
  warm/1   1 rank loads that bundle
  cold/N   N ranks compile from nothing, each on its own
  warm/N   N ranks all load the one bundle of cold/1 (a fleet's warm start)
Per rank: start-up (apply_manifest with its warm-up passes, s), the whole process's wall time,
eager and applied throughput (sequences/s), peak memory (max_memory_allocated), the
bundle's state and the region statuses.

    python benchmarks/gpu_distributed.py                 # 1 and 2 H200s (nccl)
    python benchmarks/gpu_distributed.py --tiny          # CPU check: gloo, tiny BERT, 2 ranks

Prints a markdown table, then one JSON line. A rank is `--rank-run` (torchrun sets RANK etc.).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
STARTED = time.perf_counter()


def _cpu_torchvision() -> None:
    """On the CPU machine, let transformers import torchvision beside the CPU torch, as the
    tests do (tests/conftest.py says why); the GPU machine's torchvision loads as is."""
    if os.environ.get("DIST_TINY") == "1":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import _let_torchvision_import_on_cpu_torch

        _let_torchvision_import_on_cpu_torch()


def bench_model() -> Any:
    """transformers' BERT: BERT-base (its config's defaults), or a tiny one."""
    from transformers import BertConfig, BertModel

    if os.environ.get("DIST_TINY") == "1":
        return BertModel(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64,
                                    max_position_embeddings=64))
    return BertModel(BertConfig())


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from surgery import apply_manifest

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = not args.tiny
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache_root, f"rank{rank}")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    model = bench_model().to(dev, dtype).eval()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if cuda else None)
    seq = 16 if args.tiny else 128
    x = torch.randint(0, 128, (args.batch, seq), device=dev,
                      generator=torch.Generator(dev).manual_seed(rank))
    overrides: dict[str, Any] = {"on_cpu": "compile"} if not cuda else {}
    cache: Any = args.bundle if args.phase == "warm" else None

    def step(m: Any) -> Any:
        return m(x).last_hidden_state

    def tput(fn: Any) -> float:
        with torch.inference_mode():
            for _ in range(2):
                fn()
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                fn()
            sync()
        return args.batch * args.steps / (time.perf_counter() - t)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    eager = tput(lambda: ddp(x))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t = time.perf_counter()
    with torch.inference_mode():
        handle = apply_manifest(ddp, args.manifest, warmup=step, overrides=overrides,
                                cache=cache)
    startup = time.perf_counter() - t
    applied = tput(lambda: ddp(x))
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else _rss_gib()
    saved = None
    if args.phase == "cold" and rank == 0 and args.save_bundle:
        saved = handle.save_cache(args.bundle).path
    reports = handle.report.gather()
    dist.destroy_process_group()
    counts = handle.report.counts()
    cache_line = handle.report.cache.line() if handle.report.cache else ""
    return {"phase": args.phase, "world": world, "rank": rank, "startup_s": round(startup, 2),
            "process_s": round(time.perf_counter() - STARTED, 1),
            "eager_per_s": round(eager, 1), "applied_per_s": round(applied, 1),
            "peak_gib": round(peak, 2), "compiled": counts["compiled"],
            "eager_regions": counts["eager"], "cache": cache_line, "saved": saved,
            "ranks_reported": None if reports is None else len(reports)}


def _rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _launch(args: argparse.Namespace, *, phase: str, world: int, work: str, manifest: str,
            bundle: str, key: str) -> list[dict[str, Any]]:
    """One torchrun launch; each rank's JSON result (or an error entry)."""
    out = os.path.join(work, f"{phase}{world}")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", os.path.abspath(__file__), "--rank-run",
           "--phase", phase, "--manifest", manifest, "--bundle", bundle, "--out", out,
           "--cache-root", tempfile.mkdtemp(prefix=f"inductor_{phase}{world}_", dir=work),
           "--batch", str(args.batch), "--steps", str(args.steps),
           *(["--tiny"] if args.tiny else []), *(["--save-bundle"] if world == 1 else [])]
    # torchrun sets OMP_NUM_THREADS=1 for 2+ processes a node and not for one; inductor's
    # cache key holds the thread count, so a bundle built by 1 rank would miss on N (measured
    # on the CPU: 0 hits, against 1 of 1 with the same count). Every launch gets the same.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "SURGERY_CACHE_KEY": key, "DIST_TINY": "1" if args.tiny else "0",
           "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    got = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                got.append(json.load(f))
        else:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-3:]
            got.append({"phase": phase, "world": world, "rank": r, "error": " | ".join(tail)})
    print(json.dumps(got), file=sys.stderr, flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check: gloo, tiny BERT")
    ap.add_argument("--gpus", type=int, default=2, help="the N of the N-rank launches")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--timeout", type=int, default=420, help="per launch, s")
    ap.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    ap.add_argument("--manifest", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cache-root", help=argparse.SUPPRESS)
    ap.add_argument("--save-bundle", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch = args.batch or (2 if args.tiny else 64)
    args.steps = args.steps or (3 if args.tiny else 30)
    os.environ["DIST_TINY"] = "1" if args.tiny else "0"
    _cpu_torchvision()
    if args.rank_run:
        result = _rank(args)
        with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
        return
    from surgery.formats.manifest import save_manifest
    from surgery.planning.plan import plan_model

    work = tempfile.mkdtemp(prefix="gpu_distributed_")
    manifest = os.path.join(work, "bert.surgery.toml")
    planned = plan_model("gpu_distributed:bench_model").manifest
    save_manifest(planned, manifest)
    bundle = os.path.join(work, "bert.surgery.cache")
    key = secrets.token_hex(32)
    rows: list[dict[str, Any]] = []
    for phase, world in (("cold", 1), ("warm", 1), ("cold", args.gpus), ("warm", args.gpus)):
        rows += _launch(args, phase=phase, world=world, work=work, manifest=manifest,
                        bundle=bundle, key=key)
    print("| phase | ranks | rank | start-up s | process s | eager seq/s | surgery seq/s | "
          "peak GiB | compiled | bundle |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['phase']} | {r['world']} | {r['rank']} | error: {r['error'][:120]} |")
            continue
        print(f"| {r['phase']} | {r['world']} | {r['rank']} | {r['startup_s']} | "
              f"{r['process_s']} | {r['eager_per_s']} | {r['applied_per_s']} | {r['peak_gib']} "
              f"| {r['compiled']} | {r['cache'][:60]} |")
    total = {f"{p}{w}": sum(r.get("applied_per_s", 0) for r in rows
                            if r["phase"] == p and r["world"] == w)
             for p, w in (("warm", 1), ("warm", args.gpus))}
    print(json.dumps({"bench": "gpu_distributed", "tiny": args.tiny, "regions":
                      sum(len(r.paths) for r in planned.regions), "throughput": total,
                      "rows": rows}))


if __name__ == "__main__":
    main()
