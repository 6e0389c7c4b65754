"""Host time of GPT-2's names-only plan at batch-1 decode: on the CPU with a free graph, or the GPU.

Why: on the H200, GPT-2's names-only plan (12 ``GPT2MLP`` regions, one CUDA graph each) ran
0.81x eager through ``generate()`` in two calls of the evening (benchmarks/RESULTS.md, the fourth
session, calls 2 and 3) and 1.36x in another. At batch 1 every decode step is host-bound, so
what a region call costs the host against what the eager MLP it replaces costs decides it.

What runs: a GPT-2 of 12 layers at tiny width (random weights) through ``generate()``, eager
and the names-only plan (``plan_module``'s default) taking turns round by round, one thread.
The plan is applied with a stand-in capturer whose replay does nothing (bench_replay_overhead's
``NullCapturer``) and the ``eager`` backend, so a region call costs only surgery's Python and
the input copy; the eager MLP here computes its (tiny) work, which at width 64 is a few us.
(The stand-in replays nothing, so the plan's tokens are not eager's: no equality is claimed.)
Every MLP call is timed on both models (the instance ``forward`` wrapped), so the figures
are: us per MLP call, eager against the region's host path, and a cProfile of one generate()
of the plan: surgery's self time per region call and the functions that take it.

    python benchmarks/cpu_names_decode_host.py [--layers 12] [--tokens 32] [--rounds 5]
    python benchmarks/cpu_names_decode_host.py --cuda    # the H200: real graphs, GPT-2 small

``--cuda`` runs GPT-2 small (768 wide, bf16) on the GPU with surgery's real capturer and the
plan's own backend (inductor): an MLP call's wall time is then its host time (the GPU runs
behind it), eager's launches against the region's bookkeeping, input copy and graph launch,
which is the comparison that decides batch-1 decode there.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _whole import stop_compile_workers  # noqa: E402
from bench_replay_overhead import NullCapturer  # noqa: E402 (a stand-in whose replay is free)


def time_mlps(model: Any, spent: list[float]) -> Callable[[], None]:
    """Wrap every block's ``mlp.forward`` (the instance attribute: surgery's wrapper where a
    region is installed) to add its wall time and count to ``spent``; returns the undo."""
    undo = []
    for blk in model.transformer.h:
        mlp = blk.mlp
        had = "forward" in mlp.__dict__
        inner = mlp.forward

        def timed(*a: Any, _f: Any = inner, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
                spent[1] += 1

        mlp.forward = timed
        undo.append((mlp, had, inner))

    def restore() -> None:
        for mlp, had, inner in undo:
            if had:
                mlp.forward = inner
            else:
                del mlp.forward
    return restore


def top_surgery(prof: cProfile.Profile, calls: int, n: int = 8) -> list[list[Any]]:
    """The surgery/ functions with the most self time, in us per region call."""
    stats = pstats.Stats(prof)
    root = os.path.join(ROOT, "surgery")
    rows = [(v[2], f"{os.path.relpath(k[0], ROOT)}:{k[1]}({k[2]})")
            for k, v in stats.stats.items() if k[0].startswith(root)]  # type: ignore[attr-defined]
    rows.sort(reverse=True)
    return [[name, round(t / calls * 1e6, 2)] for t, name in rows[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cuda", action="store_true", help="GPT-2 small on the GPU, real graphs")
    args = ap.parse_args()
    import torch
    import transformers

    from surgery import apply_manifest
    from surgery.planning.plan import plan_module
    from surgery.runtime import apply as apply_mod

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, heads, dev = (768, 12, "cuda") if args.cuda else (64, 2, "cpu")
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=width, n_head=heads, vocab_size=100,
                                  n_positions=256, bos_token_id=None, eos_token_id=None)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    if args.cuda:
        base = base.to(device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0)).to(dev)

    def generate(m: Any, n: int = args.tokens) -> Any:
        with torch.inference_mode():
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    model = copy.deepcopy(base)
    manifest = plan_module(model, source="cpu_names_decode_host").manifest
    if not args.cuda:  # a stand-in graph whose replay is free, and no compile
        apply_mod._on_cuda = lambda module, model: True  # type: ignore[assignment]
        capturer = NullCapturer()
        apply_mod._capturer_for = lambda module: capturer  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest, warmup=lambda m: generate(m, 4), passes=2,
                                overrides=None if args.cuda else {"backend": "eager"})
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    if args.cuda:
        generate(model)  # every signature captured
        stop_compile_workers()  # no worker pool beside the timed turns
    compiled = [r.path for r in handle.report if r.status == "compiled"]
    spent = {"eager": [0.0, 0], "names": [0.0, 0]}
    undo = [time_mlps(base, spent["eager"]), time_mlps(model, spent["names"])]
    ms: dict[str, list[float]] = {"eager": [], "names": []}
    replays0 = sum(r.cuda_graph_replays for r in handle.report)
    for r in range(args.rounds):
        for name in (("eager", "names") if r % 2 == 0 else ("names", "eager")):
            sync()
            t = time.perf_counter()
            generate(base if name == "eager" else model)
            sync()
            ms[name].append((time.perf_counter() - t) * 1e3 / args.tokens)
    replays = sum(r.cuda_graph_replays for r in handle.report) - replays0
    for u in undo:
        u()
    prof = cProfile.Profile()
    prof.enable()
    generate(model)
    prof.disable()
    mlp_calls = spent["names"][1]
    per_call = {k: round(v[0] / max(v[1], 1) * 1e6, 2) for k, v in spent.items()}
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.cuda
           else "cpu", "width": width, "layers": args.layers, "tokens": args.tokens,
           "regions": len(compiled),
           "eager_ms_per_token": round(statistics.median(ms["eager"]), 3),
           "names_ms_per_token": round(statistics.median(ms["names"]), 3),
           "mlp_calls_per_token": round(mlp_calls / args.rounds / args.tokens, 2),
           "replays_per_token": round(replays / args.rounds / args.tokens, 2),
           "us_per_mlp_call_eager": per_call["eager"], "us_per_mlp_call_names": per_call["names"],
           "surgery_self_us_per_region_call_profiled": top_surgery(
               prof, max(1, mlp_calls // args.rounds), n=10)}
    if not compiled or not replays:
        print("NOTHING REPLAYED: the names-only plan captured nothing; the figures are "
              "meaningless", file=sys.stderr)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
