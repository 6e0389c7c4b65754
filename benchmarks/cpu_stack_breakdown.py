"""Where a token of the GPT-2 piecewise stack spends its host time, layer by layer (CPU).

Why. On an H200 the stack's decode is host-bound (3.8 ms a token against well under 3 ms of
GPU time), so the figure to cut is host time. cProfile distorts it (it slows Python frames far
more than C calls, and it cannot see into dynamo's frame entry), so this script times each layer
of one token with this thread's CPU time around the calls themselves, inclusive (per decode
token: ``generate()`` of 2N tokens minus N, over N, so the prefill and set-up cancel), and
subtracts:

- ``generate``: one ``generate()`` per token, all of it;
- ``model_forward``: ``GPT2LMHeadModel.forward`` (so ``generate`` minus it is HF's own work:
  logits processing, stopping criteria, the next input's preparation);
- ``stack_wrapper``: the piecewise region's wrapper over ``transformer`` (``PiecewiseSlot.call``);
  model_forward minus it is ``lm_head`` and the output's construction;
- ``dynamo_call``: the compiled function's call (``PiecewiseGroup.call``); stack_wrapper minus
  it is surgery's bookkeeping per call (cache checks, counters);
- ``graph``: the split graph's run (``PiecewiseGraph.__call__``); dynamo_call minus it is
  dynamo's entry: the guard check, and the frame's side-effect bytecode after the graph (the
  cache's new tensors stored back);
- ``pieces``: the static pieces' calls (``StaticPiece.forward``); graph minus it is the glue
  between pieces (attention, the cache cats, masks: the ops that run eagerly);
- ``replay``: the pieces' region graphs (``RegionGraphs.__call__``); pieces minus it is the
  piece's own lookups (graph set, weights' pointers, picking inputs).

Pieces compile with ``aot_eager`` (``--backend``; what the H200's light pieces use, and like
inductor's it returns a list) and a stand-in capturer replays nothing (benchmarks/
bench_replay_overhead.py's ``NullCapturer``), so a replay costs only surgery's host work, as on
the H200 where the GPU runs behind the host. The timers cost ~3 us a call (a thread-time read);
the script reports the untimed ms a token too, and the Python and C calls a decode token makes
(``calls_per_token``, by ``sys.setprofile``): a count, which the host's load does not move.

``--guards-twin`` builds the stack a second time with surgery.runtime.tree_guards off (dynamo's
full guards on the module tree, as before it) and lets the three models take turns: the
stack's ms a token against its full-guard twin's, and, for both, dynamo's guard check timed in
the token's real run (the frame's guard manager checked on the call's own arguments just before
the call, thread CPU time) plus the watch's own check.

    python benchmarks/cpu_stack_breakdown.py [--layers 12] [--width 64] [--tokens 32]
        [--rounds 5] [--guards-twin] [--once-twin] [--masks-twin]

``--masks-twin`` builds the stack a second time with surgery.runtime.piece_masks off (on torch
< 2.14 dynamo folding ``is_exporting()`` to True, so the graph builds the causal mask, and each
SDPA converting a boolean mask itself: as before it), taking turns: ``stack_over_bool_masks``.

``--plan-twin`` lets the same stack take turns with itself with piece_replay.STEADY_PLANS off
(every replay through ``RegionGraphs.__call__``, as before surgery.runtime.graphs.steady):
``stack_over_no_plan``. Every arm's tokens are compared with eager's in every round.

``--once-twin`` lets the same stack take turns with itself with piece_replay.WEIGHTS_ONCE_A_RUN
off (each piece checks its weights every call, as before that cut): ``stack_over_per_piece``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _stack_stand_in import gpt2_stack_on_stand_in  # noqa: E402

LAYERS = ("generate", "model_forward", "stack_wrapper", "dynamo_call", "graph", "pieces",
          "replay")
# What each layer minus the next one is.
SELF = {"generate": "hf_generate_own", "model_forward": "lm_head_and_output",
        "stack_wrapper": "surgery_call_bookkeeping", "dynamo_call": "dynamo_entry_and_effects",
        "graph": "glue_between_pieces", "pieces": "piece_lookups", "replay": "replay_checks"}
# This thread's CPU time, not wall time: the 2-core host is shared, and a process that waits for
# a core would read its wait as host work. (One thread: torch runs with 1 thread here.)
CLOCK = time.thread_time


def _timer(spent: dict[str, float], label: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` timed into ``spent[label]``, outermost calls only (a stack's prefill runs eager
    and calls its standby blocks' wrappers: the same layer nested, which must count once)."""
    depth = [0]

    @functools.wraps(inner)  # generate() reads forward's signature to choose its kwargs
    def timed(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        t = CLOCK()
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent[label] += CLOCK() - t
    return timed


def calls_per_token(generate: Callable[[int], Any], tokens: int) -> dict[str, float]:
    """Python function calls and C calls a decode token makes, all of them and those in
    surgery's own modules (generate() of 2N tokens minus N, over N): a count, so it does not
    move with the host's load as the times do."""
    root = os.path.join(os.path.dirname(HERE), "surgery") + os.sep

    def count(n: int) -> list[int]:
        seen = [0, 0, 0]  # python calls, C calls, python calls in surgery/

        def hook(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                seen[0] += 1
                if frame.f_code.co_filename.startswith(root):
                    seen[2] += 1
            elif event == "c_call":
                seen[1] += 1

        sys.setprofile(hook)
        try:
            generate(n)
        finally:
            sys.setprofile(None)
        return seen

    short, long = count(tokens), count(2 * tokens)
    per = [(b - a) / tokens for a, b in zip(short, long, strict=True)]
    return {"python": round(per[0], 1), "c": round(per[1], 1),
            "python_in_surgery": round(per[2], 1)}


def full_guard_twin(args: argparse.Namespace) -> Any:
    """The same stack applied with tree_guards off: dynamo's full guards on its module tree."""
    import surgery.runtime.tree_guards as tree_guards

    tree_guards.WATCH_TREES = False
    try:
        return gpt2_stack_on_stand_in(layers=args.layers, width=args.width, tokens=args.tokens,
                                      backend=args.backend, source="cpu_stack_breakdown")[1]
    finally:
        tree_guards.WATCH_TREES = True


def bool_mask_twin(args: argparse.Namespace) -> Any:
    """The same stack applied with piece_masks off (its graph traced as before it: a causal mask
    on torch < 2.14, converted by each SDPA)."""
    from surgery.runtime import piece_masks

    piece_masks.SHARE_MASKS = piece_masks.NOT_EXPORTING = False
    try:
        return gpt2_stack_on_stand_in(layers=args.layers, width=args.width, tokens=args.tokens,
                                      backend=args.backend, source="cpu_stack_breakdown")[1]
    finally:
        piece_masks.SHARE_MASKS = piece_masks.NOT_EXPORTING = True


def time_guards(into: dict[str, list[float]], models: dict[str, Any]) -> Callable[[], None]:
    """Time, in each stack call of the runs, dynamo's guard check of the stack's frame on the
    call's own arguments (its one cache entry) and the watch's check; returns the undo."""
    import torch

    from surgery.runtime import piecewise

    label = {id(models[k].transformer.__dict__["forward"].__closure__[1].cell_contents.group): k
             for k in ("stack", "full")}
    inner = piecewise.PiecewiseGroup.call

    def call(group: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = group.compiled._torchdynamo_orig_callable
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
        frame = {"self": module, "args": args, "kwargs": kwargs}
        frame.update(zip(fn.__code__.co_freevars,
                         (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        t = CLOCK()
        ok = any(e.guard_manager.check(frame) for e in entries)
        into[label[id(group)]].append((CLOCK() - t) * 1e6)
        if group.watch is not None:
            t = CLOCK()
            ok = group.watch.unchanged() and ok
            into["watch"].append((CLOCK() - t) * 1e6)
        assert ok, "a stack call's guards failed in a steady decode"
        return inner(group, module, args, kwargs)

    piecewise.PiecewiseGroup.call = call  # type: ignore[method-assign]
    return lambda: setattr(piecewise.PiecewiseGroup, "call", inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    # aot_eager: the backend of the H200's light pieces (compile_start), which returns a list
    ap.add_argument("--backend", default="aot_eager", choices=("aot_eager", "eager"))
    ap.add_argument("--guards-twin", action="store_true",
                    help="also the stack with tree_guards off, taking turns (see above)")
    ap.add_argument("--plan-twin", action="store_true",
                    help="also the same stack with piece_replay.STEADY_PLANS off (every replay "
                         "through RegionGraphs.__call__, as before graphs.steady), taking turns")
    ap.add_argument("--once-twin", action="store_true",
                    help="also the same stack with piece_replay.WEIGHTS_ONCE_A_RUN off (each "
                         "piece checks its weights every call, as before), taking turns")
    ap.add_argument("--masks-twin", action="store_true",
                    help="also the stack with piece_masks off (each SDPA converting the "
                         "boolean mask, as before), taking turns")
    args = ap.parse_args()
    import torch

    from surgery.runtime import piece_replay, piecewise, piecewise_split
    from surgery.runtime.graphs import replay

    base, model, handle, generate = gpt2_stack_on_stand_in(
        layers=args.layers, width=args.width, tokens=args.tokens, backend=args.backend,
        source="cpu_stack_breakdown")
    want = generate(base)
    identical = bool(torch.equal(generate(model), want))
    compiled = [r.path for r in handle.report if r.status == "compiled"]
    replays0 = sum(r.cuda_graph_replays for r in handle.report)

    # untimed first, the models taking turns (the host is shared: compare in one run)
    models = {"stack": model, "eager": base}
    if args.guards_twin:
        models["full"] = full_guard_twin(args)
        identical = identical and bool(torch.equal(generate(models["full"]), want))
    if args.masks_twin:
        models["bool_masks"] = bool_mask_twin(args)
        identical = identical and bool(torch.equal(generate(models["bool_masks"]), want))
    if args.once_twin:  # the same model, the flag off while its turn runs
        models["per_piece"] = model
    if args.plan_twin:  # the same model, steady plans off while its turn runs
        models["no_plan"] = model
    ms: dict[str, list[float]] = {k: [] for k in models}
    guards: dict[str, list[float]] = {"stack": [], "full": [], "watch": []}
    names = list(models)
    for i in range(args.rounds):
        for arm in names[i % len(names):] + names[:i % len(names)]:
            piece_replay.WEIGHTS_ONCE_A_RUN = arm != "per_piece"
            piece_replay.STEADY_PLANS = arm != "no_plan"
            t = CLOCK()
            got = generate(models[arm])
            ms[arm].append((CLOCK() - t) * 1e3 / args.tokens)
            identical = identical and bool(torch.equal(got, want))
        piece_replay.WEIGHTS_ONCE_A_RUN = piece_replay.STEADY_PLANS = True
    replays = (sum(r.cuda_graph_replays for r in handle.report) - replays0) / args.rounds \
        / (1 + args.once_twin + args.plan_twin)  # the twins' arms run the same model
    if args.guards_twin:  # the guard checks timed in runs of their own (they double them)
        undo = time_guards(guards, models)
        for i in range(args.rounds):
            for arm in ("stack", "full") if i % 2 == 0 else ("full", "stack"):
                generate(models[arm])
        undo()

    patches: list[tuple[Any, str, Any]] = [
        (type(model), "forward", type(model).forward),
        (piecewise.PiecewiseSlot, "call", piecewise.PiecewiseSlot.call),
        (piecewise.PiecewiseGroup, "call", piecewise.PiecewiseGroup.call),
        (piecewise_split.PiecewiseGraph, "__call__", piecewise_split.PiecewiseGraph.__call__),
        (piece_replay.StaticPiece, "__call__", piece_replay.StaticPiece.__call__),
        (replay.RegionGraphs, "__call__", replay.RegionGraphs.__call__)]
    # Per decode token: generate() of 2N tokens minus generate() of N, over N (the prefill, which
    # runs eager inside the stack's wrapper, and generate()'s set-up cancel out).
    spent = {n: dict.fromkeys(LAYERS, 0.0) for n in (args.tokens, 2 * args.tokens)}
    for n, into in spent.items():
        for (owner, name, inner), label in zip(patches, LAYERS[1:], strict=True):
            setattr(owner, name, _timer(into, label, inner))
        try:
            for _ in range(args.rounds):
                t = CLOCK()
                generate(model, n)
                into["generate"] += CLOCK() - t
        finally:
            for owner, name, inner in patches:
                setattr(owner, name, inner)
    short, long = spent[args.tokens], spent[2 * args.tokens]
    inclusive = {k: (long[k] - short[k]) * 1e6 / (args.rounds * args.tokens) for k in LAYERS}
    own = {SELF[k]: inclusive[k] - (inclusive[LAYERS[i + 1]] if i + 1 < len(LAYERS) else 0.0)
           for i, k in enumerate(LAYERS)}
    calls = calls_per_token(lambda n: generate(model, n), args.tokens)
    res = {"torch": torch.__version__, "backend": args.backend, "layers": args.layers,
           "width": args.width,
           "tokens": args.tokens,
           "stack_ms_per_token": round(statistics.median(ms["stack"]), 3),
           "eager_ms_per_token": round(statistics.median(ms["eager"]), 3),
           "eager_over_stack": round(statistics.median(ms["eager"])
                                     / statistics.median(ms["stack"]), 2),
           **({"full_guards_ms_per_token": round(statistics.median(ms["full"]), 3),
               "stack_over_full": round(statistics.median(ms["stack"])
                                        / statistics.median(ms["full"]), 3),
               "round_stack_over_full": [round(a / b, 3) for a, b in
                                         zip(ms["stack"], ms["full"], strict=True)],
               "guard_check_us": {k: round(statistics.median(v), 1) for k, v in guards.items()
                                  if v}} if args.guards_twin else {}),
           **({"bool_masks_ms_per_token": round(statistics.median(ms["bool_masks"]), 3),
               "stack_over_bool_masks": round(statistics.median(ms["stack"])
                                              / statistics.median(ms["bool_masks"]), 3),
               "round_stack_over_bool_masks": [round(a / b, 3) for a, b in
                                               zip(ms["stack"], ms["bool_masks"], strict=True)]}
              if args.masks_twin else {}),
           **({"per_piece_ms_per_token": round(statistics.median(ms["per_piece"]), 3),
               "stack_over_per_piece": round(statistics.median(ms["stack"])
                                             / statistics.median(ms["per_piece"]), 3),
               "round_stack_over_per_piece": [round(a / b, 3) for a, b in
                                              zip(ms["stack"], ms["per_piece"], strict=True)]}
              if args.once_twin else {}),
           **({"no_plan_ms_per_token": round(statistics.median(ms["no_plan"]), 3),
               "stack_over_no_plan": round(statistics.median(ms["stack"])
                                           / statistics.median(ms["no_plan"]), 3),
               "round_stack_over_no_plan": [round(a / b, 3) for a, b in
                                            zip(ms["stack"], ms["no_plan"], strict=True)]}
              if args.plan_twin else {}),
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "timed_decode_ms_per_token": round(inclusive["generate"] / 1e3, 3),
           "piece_replays_per_token": round(replays / args.tokens, 2),
           "us_per_token": {k: round(v, 1) for k, v in own.items()},
           "calls_per_token": calls,
           "tokens_identical": identical, "compiled_paths": compiled,
           "masks_shared": [g.masks_shared for s in handle._slots if hasattr(s, "group")
                            for g in s.group.graphs],
           "ops_between": [g.between_ops for s in handle._slots if hasattr(s, "group")
                           for g in s.group.graphs]}
    if not compiled or replays == 0:
        print("NOTHING REPLAYED: the stack path did not capture; the breakdown is meaningless",
              file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
