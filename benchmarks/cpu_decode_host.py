"""GPT-2 decode host time on the CPU: eager, per-block piecewise regions, one stack region.

Why on the CPU: the H200 figures are the lead's; this is what each engineer can measure, and on
a CPU without CUDA graphs every microsecond of a decode step is host time. The CPU of this
project is shared, so the three arms run interleaved in one process (round by round, one
thread) and the figures to read are the ratios, the dynamo entries per token and the shares.

    python benchmarks/cpu_decode_host.py [--layers 12] [--width 64] [--tokens 32] [--rounds 5]

Arms: ``eager``; ``block`` (``plan --piecewise`` in the per-block layout, drop_stacks); ``stack``
(``plan --piecewise`` as planned: ``transformer`` one piecewise region). Pieces compile with
aot_eager (no CUDA: nothing is captured). Printed: ms/token (median of the rounds), dynamo
entries per token, tokens identical to eager, and one profiled generate()'s host shares
(benchmarks/_host_profile.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _host_profile import host_profile  # noqa: E402

SIZE: dict[str, int] = {}


def gpt2() -> Any:
    """A --model factory: GPT-2 of SIZE (random weights, no EOS)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=SIZE.get("layers", 12), n_embd=SIZE.get("width", 64),
                                  n_head=2, vocab_size=100, n_positions=256, bos_token_id=None,
                                  eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    SIZE.update(layers=args.layers, width=args.width)
    import torch

    from surgery import apply_manifest
    from surgery.planning.plan import plan_module
    from surgery.planning.stacks import drop_stacks

    torch.set_num_threads(1)
    base = gpt2()
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))

    def generate(m: Any, n: int = args.tokens) -> Any:
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    arms: dict[str, Any] = {"eager": base}
    handles = {}
    for name in ("block", "stack"):
        model = copy.deepcopy(base)
        manifest = plan_module(model, source="cpu_decode_host", piecewise=True).manifest
        if name == "block":
            drop_stacks(manifest)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handles[name] = apply_manifest(model, manifest, warmup=lambda m: generate(m, 4),
                                           passes=2, overrides={"on_cpu": "compile",
                                                                "backend": "aot_eager"})
        arms[name] = model
    want = generate(base)
    out: dict[str, dict[str, Any]] = {a: {"ms": []} for a in arms}
    for name, model in arms.items():
        runs = sum(r.compiled_runs for r in handles[name].report) if name in handles else 0
        out[name]["tokens_identical"] = bool(torch.equal(generate(model), want))
        if name in handles:
            runs = sum(r.compiled_runs for r in handles[name].report) - runs
        out[name]["compiled_runs_per_token"] = round(runs / args.tokens, 2)
    for _ in range(args.rounds):
        for name, model in arms.items():
            t = time.perf_counter()
            generate(model)
            out[name]["ms"].append((time.perf_counter() - t) * 1e3 / args.tokens)
    for name, model in arms.items():
        res = out[name]
        res["ms_per_token"] = round(statistics.median(res.pop("ms")), 3)
        res.update(host_profile(lambda m=model: generate(m), tokens=args.tokens))
        if name in handles:
            recs = [r for r in handles[name].report if r.status == "compiled"]
            res["compiled_paths"] = [r.path for r in recs][:3]
            res["pieces"] = sum(r.pieces for r in recs)
    eager = out["eager"]["ms_per_token"]
    print(f"GPT-2 {args.layers} layers x {args.width}, {args.tokens} tokens, torch "
          f"{torch.__version__}, 1 thread")
    print("| arm | ms/token | vs eager | dynamo entries/token | tokens identical | "
          + " | ".join(out["eager"]["host_shares"]) + " |")
    print("|---" * (5 + len(out["eager"]["host_shares"])) + "|")
    for name, res in out.items():
        print(f"| {name} | {res['ms_per_token']:.2f} | {eager / res['ms_per_token']:.2f}x | "
              f"{res['dynamo_entries_per_token']} | {res['tokens_identical']} | "
              + " | ".join(f"{v:.1%}" for v in res["host_shares"].values()) + " |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
