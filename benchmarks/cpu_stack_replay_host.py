"""Host time per token of surgery's piecewise stack replays, on the CPU, with a free graph.

What it isolates. On an H200, GPT-2 small's decode through ``generate()`` is host-bound, and the
piecewise stack (``plan --piecewise``: ``transformer`` one region) spends its host time in the
piece replays (signature check, parameter checks, output ring, input copies) and in surgery's
bookkeeping around them. Here the same path runs on the CPU with a stand-in capturer whose
replay does nothing (``NullCapturer``), so a replay costs only surgery's Python; pieces compile
with ``eager`` so the captured work is free too. The figure to read is surgery's host time per
token: the stack arm's ms/token minus what a plain eager ``generate()`` of the same model costs
is *not* it (the eager arm computes every op); instead the profile's ``surgery`` share (frames in
surgery/) and the per-replay cost are printed.

    python benchmarks/cpu_stack_replay_host.py [--layers 12] [--tokens 32] [--rounds 5]
        [--profile FILE]     # write a cProfile of one generate() to FILE

Printed: ms/token of the stack arm (median of rounds), piece replays per token, the wall time
of a static piece's call (``StaticPiece.__call__``: with the free graph that is all surgery's
host cost of a replay: lookups, signature, parameter checks, held check, copies, hand-out) per
call and per token, and surgery's us per token and per replay (cProfile of one generate: self
time inside surgery/ frames, not the model's code they call), tokens identical to eager.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from _stack_stand_in import gpt2_stack_on_stand_in  # noqa: E402


def surgery_self_us(prof: cProfile.Profile) -> float:
    """Seconds spent in frames of surgery/ itself (tottime), in us."""
    stats = pstats.Stats(prof)
    root = os.path.join(os.path.dirname(HERE), "surgery")
    return sum(v[2] for k, v in stats.stats.items()  # type: ignore[attr-defined]
               if k[0].startswith(root)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="")
    args = ap.parse_args()
    import torch

    base, model, handle, generate = gpt2_stack_on_stand_in(
        layers=args.layers, width=args.width, tokens=args.tokens, backend="eager",
        source="cpu_stack_replay_host")
    want = generate(base)
    identical = bool(torch.equal(generate(model), want))
    from surgery.runtime import piecewise_split

    piece_s = [0.0, 0]
    forward = piecewise_split.StaticPiece.__call__

    def timed(self: Any, *a: Any) -> Any:  # the pieces' host time: a replay runs no work here
        t0 = time.perf_counter()
        try:
            return forward(self, *a)
        finally:
            piece_s[0] += time.perf_counter() - t0
            piece_s[1] += 1

    replays0 = sum(r.cuda_graph_replays for r in handle.report)
    piecewise_split.StaticPiece.__call__ = timed  # type: ignore[method-assign]
    ms = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        generate(model)
        ms.append((time.perf_counter() - t) * 1e3 / args.tokens)
    piecewise_split.StaticPiece.__call__ = forward  # type: ignore[method-assign]
    replays = (sum(r.cuda_graph_replays for r in handle.report) - replays0) / args.rounds
    piece_calls = piece_s[1] / args.rounds
    prof = cProfile.Profile()
    prof.enable()
    generate(model)
    prof.disable()
    if args.profile:
        prof.dump_stats(args.profile)
    s_us = surgery_self_us(prof)
    per_token = replays / args.tokens
    res = {"torch": torch.__version__, "layers": args.layers, "tokens": args.tokens,
           "stack_ms_per_token": round(statistics.median(ms), 3),
           "piece_replays_per_token": round(per_token, 2),
           "piece_calls_per_token": round(piece_calls / args.tokens, 2),
           "surgery_us_per_piece_call": round(piece_s[0] / max(piece_s[1], 1) * 1e6, 2),
           "surgery_piece_us_per_token": round(piece_s[0] / args.rounds / args.tokens * 1e6, 1),
           "surgery_self_us_per_token_profiled": round(s_us / args.tokens, 1),
           "surgery_self_us_per_replay_profiled": round(s_us / args.tokens / max(per_token, 1), 2),
           "tokens_identical": identical,
           "compiled_paths": [r.path for r in handle.report if r.status == "compiled"]}
    if not res["compiled_paths"] or per_token == 0:
        print("NOTHING REPLAYED: the stack path did not capture; the figure is meaningless",
              file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
