"""What a watched run records (one Call per module or method call, folded into an Observation)
and the timing of its calls: CUDA events around each call on a GPU, a host clock on the CPU,
total and self time per path. surgery.planning.observe fills these in; surgery.planning.evidence
reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.runtime.signatures import Signature


@dataclass
class Call:
    """One call of a module (or watched method) during one step."""

    path: str
    step: int
    parent: int  # index in Observation.calls of the enclosing call; -1 for a top-level call
    sig: Signature
    ops: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)  # direct torch calls
    children: list[int] = field(default_factory=list)
    # state it changed: "attribute kv_cache", "argument cache" (a list or dict), "object cache"
    mutated: list[str] = field(default_factory=list)
    inner: int = 0  # hash of what ran inside (ops and child calls, recursively)
    subtree_ops: int = 0  # ops that launch, in the call and below (views not counted)
    out_bytes: int = 0  # bytes of the tensors a module call returned (graph memory estimate)
    # What a region graph of it would hold (surgery.planning.graph_estimate): its tensor inputs
    # as (storage address, bytes a static buffer of that layout takes), its outputs' distinct
    # storages as (address, bytes), their layout, and how many calls had begun when the last
    # of its output tensors was freed (-1: still alive when the watch ended).
    ins: list[tuple[int, int]] = field(default_factory=list)
    outs: list[tuple[int, int]] = field(default_factory=list)
    layout: tuple[Any, ...] = ()
    dead_at: int = -1


@dataclass
class Observation:
    """What a few eager steps showed; the input of evidence-based region choice."""

    calls: list[Call] = field(default_factory=list)
    steps: int = 0
    classes: dict[str, str] = field(default_factory=dict)  # path -> class name
    # path -> the function apply_manifest compiles for it; paths with one function share one
    # compiled callable, and so one recompile budget.
    callables: dict[str, str] = field(default_factory=dict)
    structure: dict[str, int] = field(default_factory=dict)  # path -> hash of its tensors
    # Timing (surgery.planning.level_timing): per path, total and self ms of one step.
    total_ms: dict[str, float] = field(default_factory=dict)
    self_ms: dict[str, float] = field(default_factory=dict)
    step_ms: float = 0.0  # the bare step (no hooks), timed around STEP itself: shares are of it
    timed_steps: int = 0  # steps timed bare, and in each timing pass
    clock: str = ""  # "cuda-events" | "perf_counter" | "injected" | "" (not timed)
    bare_step_ms: float = 0.0  # a step without hooks, for the hooks' overhead
    hooked_step_ms: float = 0.0  # the slowest timing pass's step (the most hooks at once)
    watched_step_ms: float = 0.0  # a step while watched (hooks and the function mode)
    # The hooks' own part inside each span they time (calibrated, taken off each span), and a
    # whole hook pair's cost (what a nested timed call adds to the span around it).
    hook_ms_per_call: float = 0.0
    hook_pair_ms: float = 0.0
    timing_passes: int = 0  # one a nesting level (level_timing)
    settle_steps: int = 0  # bare steps run before timing, until the step stopped getting faster
    # each timing pass's fastest step (ms), the root's level first, and every bare step's: where
    # the spans of two levels disagree, whether their steps did too
    pass_step_ms: list[float] = field(default_factory=list)
    bare_steps_ms: list[float] = field(default_factory=list)
    # One step's calls, path, parent index, ms: the last watched step's call tree, each call's
    # fastest span over the timed steps.
    timed_calls: list[tuple[str, int, float]] = field(default_factory=list)
    eager_peak_bytes: int = 0  # CUDA: the bare steps' peak allocated memory (0: not measured)

    def by_path(self) -> dict[str, list[Call]]:
        out: dict[str, list[Call]] = {}
        for c in self.calls:
            out.setdefault(c.path, []).append(c)
        return out


Clock = Callable[[], float]  # seconds


class Timer:
    """Hooks that time module calls: CUDA events on a GPU, else a clock.

    ``paths`` (module paths) and ``methods`` (``module.path.method``) say which calls are timed;
    ``paths=None`` times every module. surgery.planning.level_timing times one nesting level at a
    time, so that no timed span holds the hooks of another. ``step`` is set by the caller before
    each step and recorded with every call.
    """

    def __init__(self, model: nn.Module, *, cuda: bool, clock: Clock | None,
                 methods: Sequence[str] = (), paths: Collection[str] | None = None) -> None:
        self.model = model
        self.methods = list(methods)
        self.paths = None if paths is None else set(paths)
        self.restore: list[tuple[nn.Module, str, bool, Any]] = []
        self.cuda = cuda and clock is None
        self.clock = clock or time.perf_counter
        self.step = 0
        self.done: list[tuple[str, int, Any, Any, int]] = []  # path, parent, start, end, step
        self.open: list[int] = []
        self.handles: list[Any] = []
        self.pool: list[Any] = []  # CUDA events made before the timed steps (reserve)

    def reserve(self, n: int) -> None:
        """Create ``n`` CUDA events up front: creating one inside a hook costs host time on
        every call, which on a launch-bound step delays the launches being timed."""
        if self.cuda:
            self.pool.extend(torch.cuda.Event(enable_timing=True) for _ in range(n))

    def _mark(self) -> Any:
        if self.cuda:
            ev = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.clock()

    def __enter__(self) -> Timer:
        for path, mod in self.model.named_modules():
            if self.paths is not None and path not in self.paths:
                continue

            def pre(m: nn.Module, args: Any, path: str = path) -> None:
                self._begin(path)

            def post(m: nn.Module, args: Any, out: Any) -> None:
                self._end()

            self.handles.append(mod.register_forward_pre_hook(pre))
            self.handles.append(mod.register_forward_hook(post))
        for mp in self.methods:
            self.restore.append(wrap_method(self.model, mp, self._begin, self._end))
        return self

    def _begin(self, path: str) -> None:
        parent = self.open[-1] if self.open else -1
        self.done.append((path, parent, self._mark(), None, self.step))
        self.open.append(len(self.done) - 1)

    def _end(self) -> None:
        if self.open:
            i = self.open.pop()
            p, parent, start, _, step = self.done[i]
            self.done[i] = (p, parent, start, self._mark(), step)

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        unwrap(self.restore)

    def calls_ms(self) -> list[tuple[str, int, float, int]]:
        """(path, parent index, ms, step) of each timed call, in the order they began."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for path, parent, start, end, step in self.done:
            if end is None:
                ms = 0.0
            elif self.cuda:
                ms = float(start.elapsed_time(end))
            else:
                ms = (end - start) * 1e3
            out.append((path, parent, ms, step))
        return out


def fold_times(obs: Observation, calls: list[tuple[str, int, float]]) -> None:
    """Per-path total and self time from timed calls (self = total - direct children).

    Calls come in the order they began, so a parent's index is below its children's. The spans
    are taken as they are: surgery.planning.level_timing times them so that none holds the
    hooks of another, and takes the hooks' own part off each.
    """
    child_sum = [0.0] * len(calls)
    for _path, parent, ms in calls:
        if parent >= 0:
            child_sum[parent] += ms
    for i, (path, _parent, ms) in enumerate(calls):
        obs.total_ms[path] = obs.total_ms.get(path, 0.0) + ms
        obs.self_ms[path] = obs.self_ms.get(path, 0.0) + max(0.0, ms - child_sum[i])
    obs.timed_calls = list(calls)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def wrap_method(model: nn.Module, mp: str, begin: Callable[..., None], end: Callable[..., None],
                 *, with_args: bool = False) -> tuple[nn.Module, str, bool, Any]:
    """Wrap the method ``mp`` (``module.path.method``) on its instance; returns what undoes it.
    With ``with_args``, ``begin`` gets (mp, args, kwargs) and ``end`` the method's output."""
    mod_path, _, name = mp.rpartition(".")
    mod = model.get_submodule(mod_path)
    orig = getattr(mod, name)
    undo = (mod, name, name in vars(mod), vars(mod).get(name))

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if with_args:
            begin(mp, args, kwargs)
        else:
            begin(mp)
        out = orig(*args, **kwargs)
        if with_args:
            end(out)
        else:
            end()
        return out

    mod.__dict__[name] = wrapped
    return undo


def unwrap(restore: list[tuple[nn.Module, str, bool, Any]]) -> None:
    for mod, name, had, own in reversed(restore):
        if had:
            mod.__dict__[name] = own
        else:
            del mod.__dict__[name]
    restore.clear()
