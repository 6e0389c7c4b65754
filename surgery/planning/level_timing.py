"""Module times that the timing hooks cannot inflate: one timing pass per nesting level.

The problem. A module's time is the span between a mark in its forward pre-hook and one in its
forward hook (a CUDA event on a GPU, a clock elsewhere). With hooks on every module at once, a
span also holds the hooks of every call nested inside it. On a launch-bound GPU step (GPT-2
decoding one token: the GPU waits for the host to launch each kernel) the host time of those
hooks delays the launches, so the events see it as well. On an H200, GPT-2's ``generate()`` took
139 ms bare and 249 ms with the hooks: a hook pair (Python, the slow path of ``__call__`` and an
event record) costs tens of microseconds, as much as the few kernels of a small module.

The method before this one took the hooks out afterwards: each span lost the average cost of a
hook, (hooked step - bare step) / calls, once for every call nested in it, but never fell below
the span times bare / hooked. Both halves depend on the host:

- The average hides where the hooks are. The step also spends hook-free host time outside every
  module (``generate``'s sampler, stopping criteria and cache updates), so bare / hooked says how
  much of the *step* is hooks, not how much of a span is. A subtree dense in hooks (GPT-2's MLP:
  four child calls around eleven small launches) keeps most of its hook time under the floor,
  and a share becomes a count of nested hooks.
- Whether the subtraction or the floor decides a span depends on the ratio of a hook's cost to
  a launch's and to that outside time: the speed of the host's Python against its driver calls.
  The same GPT-2 MLPs were 14.5% of the step on one H200 host and 64.3% on another (10.4% on
  this CPU), and at 64% the planner stopped planning the stack piecewise, which had run 1.23x
  the names-only plan. tests/test_level_timing.py reproduces it on a virtual clock.

This method. Calls are timed one nesting level at a time: the watched run gives the call tree,
a path's level is the least depth at which it is called, and each level gets its own
``timed_steps`` steps with hooks on that level's paths only. So a span holds no hook of any
call inside it; the host time of the hooks falls between spans, where a launch-bound GPU idles
instead of running a timed module. What is left inside a span is the hooks' own part around the
mark (the rest of the pre-hook, the hooked ``__call__``'s bookkeeping, the post-hook up to its
mark). ``calibrate`` measures it on a hooked ``nn.Identity`` with the same marks and it is taken
off every span (``hook_ms_per_call``); a path called at two depths (a shared module) can still
nest in its own level, and each such nested call also takes off a whole hook pair
(``hook_pair_ms``, calibrated the same way). The remaining error is the spread of that cost
(a microsecond or two a span), and, on a GPU, the queue: between passes' hooks the GPU drains,
so a span is max(its kernels, its launches) with nothing queued before it, where a bare step
could overlap a module's launches with the previous module's kernels.

The passes are merged on one call tree, the last watched step's (the closest to the timed steps
in a model whose caches grow): each call gets its fastest span over the timed steps (timeit's
rule, as for the bare step: a shared host preempts at random). A pass whose steps called other
paths or another number of them (a step that branches) spreads each path's mean step total
evenly over that path's calls in the tree (the mean: the fastest could be a step without it).
The levels take turns step by step, so that in a model whose state grows with every step (a
stream's KV cache) each level sees the same range of states. The bare steps, the hook-free
steps whose fastest is the step every share is of, take their turn in the same rounds: timed
before the passes, they saw other states than the spans did. On the H200 the SDPA example at
LingBot size ran its first frames slower than the later ones (the caches' growing tensors still
allocated anew), so the root's span came out at 128 of a 209 ms bare step, and 39% of the step
showed up as "outside every module call", a remainder no region could cover.
The cost is ``timed_steps`` steps a level (GPT-2: 5 levels) instead of ``timed_steps`` in all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from surgery.planning.observation import Call, Clock, Timer, sync

CALIBRATION_CALLS = 64  # hooked nn.Identity calls that measure the hooks' own cost


@dataclass
class HookCost:
    """What the timing hooks cost: their part inside the span they time, and a whole pair."""

    inner_ms: float
    pair_ms: float


@dataclass
class LevelTimes:
    """One step's calls (the reference tree) with their spans, and each pass's fastest step."""

    calls: list[tuple[str, int, float]]
    pass_step_ms: list[float]
    timed: int  # spans recorded in all passes
    bare_ms: list[float]  # the hook-free steps, one a round, taking turns with the passes


def call_levels(calls: Sequence[Call]) -> dict[str, int]:
    """Each path's nesting level: the least depth at which it was called (0: a top-level call)."""
    depth: list[int] = []
    out: dict[str, int] = {}
    for c in calls:
        d = depth[c.parent] + 1 if c.parent >= 0 else 0
        depth.append(d)
        out[c.path] = min(out.get(c.path, d), d)
    return out


def calibrate(*, cuda: bool, clock: Clock | None, calls: int = CALIBRATION_CALLS) -> HookCost:
    """The hooks' cost on a hooked ``nn.Identity`` (which launches nothing): the median span is
    their part inside a span, the added time of a loop of hooked calls a whole pair."""
    probe = nn.Identity()
    x = torch.zeros(1, device="cuda" if cuda else "cpu")
    clock_fn = clock or time.perf_counter

    def loop() -> float:
        sync(cuda)
        t = clock_fn()
        for _ in range(calls):
            probe(x)
        sync(cuda)
        return (clock_fn() - t) * 1e3

    bare = loop()
    timer = Timer(probe, cuda=cuda, clock=clock, paths=[""])
    timer.reserve(2 * calls)
    with timer:
        hooked = loop()
    inner = statistics.median(ms for _p, _q, ms, _s in timer.calls_ms())
    return HookCost(inner_ms=max(0.0, inner), pair_ms=max(0.0, (hooked - bare) / calls))


def reference_step(calls: Sequence[Call]) -> list[Call]:
    """The last watched step's calls, with parents indexing this list."""
    last = max((c.step for c in calls), default=0)
    first = next((i for i, c in enumerate(calls) if c.step == last), len(calls))
    out = []
    for c in calls[first:]:
        parent = c.parent - first if c.parent >= first else -1
        out.append(Call(c.path, c.step, parent, c.sig))
    return out


def time_levels(model: nn.Module, timed: Callable[[], float], *, calls: Sequence[Call],
                methods: Sequence[str], cuda: bool, clock: Clock | None, timed_steps: int,
                cost: HookCost) -> LevelTimes:
    """Time ``timed()`` (one step, returning its ms) ``timed_steps`` times a nesting level, with
    hooks on that level's paths only, and ``timed_steps`` times with no hook (the bare steps
    the shares are of), all taking turns step by step; the spans merged on the reference step's
    call tree."""
    levels = call_levels(calls)
    ref = reference_step(calls)
    watched = set(methods)
    steps = max(1, max((c.step for c in calls), default=0) + 1)
    passes: list[tuple[set[str], Timer, list[float]]] = []
    for level in sorted(set(levels.values())):
        paths = {p for p, d in levels.items() if d == level}
        timer = Timer(model, cuda=cuda, clock=clock, methods=sorted(paths & watched),
                      paths=paths - watched)
        timer.reserve(2 * (sum(1 for c in calls if c.path in paths) // steps) * timed_steps + 64)
        passes.append((paths, timer, []))
    # Round robin, one step a level at a time: a model whose state grows step by step (a stream's
    # KV cache) shows every level the same range of states, not the last level the longest.
    bare: list[float] = []
    for s in range(timed_steps):
        bare.append(timed())  # no hook installed: the figure that counts
        for _paths, timer, step_ms in passes:
            with timer:
                timer.step = s
                step_ms.append(timed())
    ms = [0.0] * len(ref)
    n_timed = 0
    for paths, timer, _ms in passes:
        spans = _corrected(timer.calls_ms(), cost)
        n_timed += len(spans)
        _assign(ms, ref, paths, spans, timed_steps)
    return LevelTimes([(c.path, c.parent, ms[i]) for i, c in enumerate(ref)],
                      [min(step_ms) for _p, _t, step_ms in passes], n_timed, bare)


def _corrected(spans: list[tuple[str, int, float, int]],
               cost: HookCost) -> list[tuple[str, float, int]]:
    """(path, ms, step) a span: less the hooks' own part, and a pair for each timed call nested
    in it (a path called at two depths)."""
    below = [0] * len(spans)
    for i in range(len(spans) - 1, -1, -1):
        parent = spans[i][1]
        if parent >= 0:
            below[parent] += below[i] + 1
    return [(path, max(0.0, ms - cost.inner_ms - cost.pair_ms * below[i]), step)
            for i, (path, _parent, ms, step) in enumerate(spans)]


def _assign(ms: list[float], ref: list[Call], paths: set[str],
            spans: list[tuple[str, float, int]], timed_steps: int) -> None:
    """Put one pass's spans on the reference calls of its paths: position by position where
    every timed step called them in the reference's order (the fastest of each), else each path's
    mean step total spread over its reference calls."""
    idx = [i for i, c in enumerate(ref) if c.path in paths]
    want = [ref[i].path for i in idx]
    by_step: list[list[tuple[str, float]]] = [[] for _ in range(timed_steps)]
    for path, span, step in spans:
        by_step[step].append((path, span))
    if by_step and all([p for p, _ in s] == want for s in by_step):
        for k, i in enumerate(idx):
            ms[i] = min(s[k][1] for s in by_step)
        return
    for p in paths:  # a step that branches: the mean, since the fastest could be a step without p
        mine = [i for i in idx if ref[i].path == p]
        if mine:
            per = sum(span for q, span, _s in spans if q == p) / timed_steps
            for i in mine:
                ms[i] = per / len(mine)
