"""Eager and a surgery arm taking turns in one process, for speed only (gpu_memory.py ``--ab``).

Why: on the H200 the arms of one process ran one after the other, eager first, and the host's
pace drifted between them: GPT-2's names-only plan read 1.36x eager in one call, 0.81x in
another, 0.92x on a user stream in a third. A ratio taken in turns (eager, arm, arm, eager, ...)
shares the host's state between both sides of each round, as gpu_piecewise.py's ``gpt2_ab`` does.

The eager twin is ``copy.deepcopy`` of the model before any surgery, with every parameter and
buffer mapped to itself: it shares the weights (no memory of its own beyond Python state, so it
moves no peak) and has its own Python state (the SDPA example's KV-cache lists, emptied first).
Nothing writes weights at inference, and a region graph's weight check sees the same pointers.
The turns run after an arm's peaks were read, while its handle is still applied.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any


def eager_twin(model: Any) -> Any:
    """A deep copy of ``model`` that shares its parameters and buffers."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def take_turns(run: Callable[[Any], list[float]], model: Any, twin: Any, rounds: int
               ) -> dict[str, Any]:
    """``rounds`` rounds of ``run(twin)`` (eager) and ``run(model)`` (the arm), the first of
    each pair alternating (round 0 eager first). ``run`` returns per-step ms; each side's
    figure is the median of its steps in a round. Returns the medians over rounds and each
    round's eager/arm ratio."""
    eager: list[float] = []
    arm: list[float] = []
    for r in range(rounds):
        pair = ((twin, eager), (model, arm)) if r % 2 == 0 else ((model, arm), (twin, eager))
        for m, into in pair:
            into.append(statistics.median(run(m)))
    ratios = [e / a for e, a in zip(eager, arm, strict=True)]
    return {"ab_rounds": rounds, "ab_eager_ms": round(statistics.median(eager), 3),
            "ab_ms": round(statistics.median(arm), 3),
            "ab_speedup": round(statistics.median(ratios), 3),
            "ab_round_speedups": [round(x, 3) for x in ratios]}
