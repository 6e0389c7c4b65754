"""Watch a model run a few steps: each module call's signature, what ran inside it, its time.

What it records, and why each thing is needed to choose a compile region:

- **The call signature**: every argument's shape, dtype and strides, the values of ints, floats,
  bools and strings, the structure of lists and dicts, plus the autocast and grad state. A
  compiled callable guards on exactly these, and a captured CUDA graph replays one of them.
- **What ran inside**: each torch function called directly in the call (seen through a
  ``TorchFunctionMode``) with its argument shapes, and the child calls in order. A module whose
  inside changes while its signature does not keeps state between calls (a KV cache), and a graph
  of it would replay stale shapes.
- **Python state it changed**: containers, tensors and scalars in the module's ``__dict__`` (not
  parameters, buffers or submodules), and list/dict arguments it mutated. A graph replay runs no
  Python, so such a call cannot be replayed. An argument that is a plain object (a transformers
  ``DynamicCache``: lists of layers that hold the key and value tensors) is walked a few levels
  into its ``__dict__`` (``_object_token``), so a cache that an attention appends to is seen
  changing even where every decode call has a signature of its own (a mask that grows with the
  cache), which would otherwise leave "same arguments, other ops inside" nothing to compare.
- **Time**, in more phases without the function mode. First the *bare* step: STEP itself,
  timed around its call (a synchronise before and after on a GPU), with no hook installed. That
  is the figure that counts (the fastest of the bare steps: a shared host preempts at random),
  and every share is a share of it: a step may never go through the root module's
  ``__call__`` (``model.forward(x)``, ``model.generate(...)``, a loop), so the root's hooks
  cannot time it. Then the module calls, one nesting level a pass
  (surgery.planning.level_timing): CUDA events recorded around each call of that level on a GPU
  (no synchronise per call), the perf_counter elsewhere, or a clock the caller injects (tests).
  No span holds the hooks of a call inside it, so a launch-bound GPU step, where the hooks' host
  time delays the launches, does not inflate a module by the hooks below it; the hooks' own part
  inside each span is calibrated and taken off. Self time is total minus the direct children's
  totals.
- **The hooks' overhead** that remains is reported: ``hook_overhead_ms`` (the slowest pass's
  step against the bare one: time that falls between spans) and the calibrated part inside each
  span (``hook_ms_per_call``, taken off).
- **Memory**: each call's tensor inputs and outputs (addresses and bytes) and when its outputs
  are freed, from which surgery.planning.graph_estimate estimates what region graphs will hold;
  on a GPU, the bare steps' peak allocated memory.
- **A step that never reached the model** (no module call seen while watched, none timed, or no
  measurable step time) is an error: a plan from it would be empty for no visible reason.

Methods (``attn_pre``, ``--include path:method``) are watched by wrapping them on the instance for
the duration; everything is removed afterwards, even when a step fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from surgery.errors import ModelSourceError
from surgery.planning.graph_estimate import OutputWatch, record_inputs
from surgery.planning.level_timing import calibrate, time_levels
from surgery.planning.observation import (
    Call,
    Clock,
    Observation,
    fold_times,
    sync,
    unwrap,
    wrap_method,
)
from surgery.runtime.signatures import Signature, bind_args, context, describe

# Tensor queries that launch nothing: not counted as ops.
_META_OPS = frozenset({"size", "dim", "stride", "numel", "is_contiguous", "element_size",
                       "data_ptr", "is_floating_point", "is_complex", "__len__", "__repr__",
                       "__format__", "get_device", "storage_offset", "ndimension", "nelement",
                       "__bool__", "__index__", "__int__", "__hash__", "__eq__", "__iter__",
                       "untyped_storage", "has_names", "__reduce_ex__", "requires_grad_"})
# Ops that make a view or read metadata, launching no kernel: recorded (their shapes are
# evidence of what ran inside) but not counted when judging whether a subtree is worth a graph,
# so GPT-2's Conv1D (view, addmm, view) counts as the one op it launches.
VIEW_OPS = frozenset({"view", "reshape", "view_as", "reshape_as", "permute", "transpose", "t",
                      "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten",
                      "narrow", "select", "split", "chunk", "unbind", "__getitem__", "detach",
                      "movedim", "swapaxes", "as_strided", "unfold"})
# nn.Module's own bookkeeping attributes: never model state.
_MODULE_ATTRS = frozenset(vars(nn.Module()))


# --- watching ------------------------------------------------------------------------------------

def _state_token(value: Any, depth: int = 0) -> Any:
    """Identity and length of Python state, deep enough to see a slot of a list of lists grow."""
    if isinstance(value, torch.Tensor):
        return ("T", id(value))
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and depth < 2:
        ends = [value[0], value[-1]] if value else []
        return (len(value), id(value), tuple(_state_token(v, depth + 1) for v in ends))
    if isinstance(value, dict) and depth < 2:
        return (len(value), tuple((k, _state_token(v, depth + 1))
                                  for k, v in list(value.items())[:4]))
    return id(value)


_OBJECT_DEPTH = 4  # how deep an argument object's state is walked (cache -> layers -> layer)
_OBJECT_ITEMS = 8  # attributes / dict items walked per level


def _object_token(value: Any, depth: int = 0) -> Any:
    """A token of an object argument's state: tensors by identity and shape, containers by length
    and their ends, objects by their attributes; bounded in depth and items."""
    if isinstance(value, torch.Tensor):
        return ("T", id(value), tuple(value.shape))
    if isinstance(value, (bool, int, float, str)) or value is None or depth >= _OBJECT_DEPTH:
        return value if not hasattr(value, "__dict__") else id(value)
    if isinstance(value, (list, tuple)):
        ends = [value[0], value[-1]] if value else []
        return (len(value), tuple(_object_token(v, depth + 1) for v in ends))
    if isinstance(value, dict):
        return (len(value), tuple((k, _object_token(v, depth + 1))
                                  for k, v in list(value.items())[:_OBJECT_ITEMS]))
    if isinstance(value, nn.Module) or not hasattr(value, "__dict__"):
        return id(value)
    return tuple((k, _object_token(v, depth + 1))
                 for k, v in list(vars(value).items())[:_OBJECT_ITEMS] if not callable(v))


def _is_state_object(a: Any) -> bool:
    """An argument that may carry state between calls: not a tensor, module, scalar or type."""
    return hasattr(a, "__dict__") and not isinstance(a, (torch.Tensor, nn.Module, type)) \
        and not callable(a)


def _module_state(mod: nn.Module) -> dict[str, Any]:
    return {k: _state_token(v) for k, v in vars(mod).items()
            if k not in _MODULE_ATTRS and not callable(v) and not isinstance(v, nn.Module)}


def _op_arg(a: Any) -> Any:
    """An op argument as evidence: a tensor's shape, a scalar, a list's tensor shapes."""
    if isinstance(a, torch.Tensor):
        return tuple(a.shape)
    if isinstance(a, (int, float, bool)):
        return a
    if isinstance(a, (list, tuple)):
        return ("list", tuple(_op_arg(x) for x in a))
    return None


class _Recorder(TorchFunctionMode):
    """Counts the torch calls made directly inside the innermost watched call."""

    def __init__(self, watcher: _Watcher) -> None:
        super().__init__()
        self.watcher = watcher

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") or str(func)
        stack = self.watcher.stack
        if stack and name not in _META_OPS and not name.endswith("__get__"):
            shapes = tuple(_op_arg(a) for a in args)
            self.watcher.calls[stack[-1]].ops.append((name, shapes))
        return func(*args, **kwargs)


class _Watcher:
    """Forward hooks on every module (and wrappers on watched methods) that record calls."""

    def __init__(self, model: nn.Module, *, methods: Sequence[str] = ()) -> None:
        self.model = model
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.calls: list[Call] = []
        self.stack: list[int] = []
        self.step = 0
        self.handles: list[Any] = []
        self.restore: list[tuple[nn.Module, str, bool, Any]] = []
        self.methods = list(methods)
        self.snapshots: dict[int, tuple[dict[str, Any], list[tuple[str, Any, Any]]]] = {}
        self.freed = OutputWatch(self.calls)  # when each call's outputs are freed

    def _enter(self, path: str, mod: nn.Module, fn: Callable[..., Any], key: Any,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        named = bind_args(fn, args, kwargs, key=key)
        sig = Signature(tuple((n, describe(a)) for n, a in named), context())
        parent = self.stack[-1] if self.stack else -1
        idx = len(self.calls)
        self.calls.append(Call(path, self.step, parent, sig))
        record_inputs(self.calls[idx], args, kwargs)  # what a region graph of it would hold
        if parent >= 0:
            self.calls[parent].children.append(idx)
        containers = [(n, a, _state_token(a)) for n, a in named if isinstance(a, (list, dict))]
        containers += [(n, a, ("object", _object_token(a))) for n, a in named
                       if _is_state_object(a)]
        self.snapshots[idx] = (_module_state(mod), containers)
        self.stack.append(idx)

    def _exit(self, mod: nn.Module) -> None:
        if not self.stack:
            return
        idx = self.stack.pop()
        call = self.calls[idx]
        before, containers = self.snapshots.pop(idx)
        after = _module_state(mod)
        call.mutated = [f"attribute {k}" for k in sorted(set(before) | set(after))
                        if before.get(k) != after.get(k)]
        call.mutated += [f"argument {n}" for n, a, tok in containers
                         if tok[:1] != ("object",) and _state_token(a) != tok]
        call.mutated += [f"object {n}" for n, a, tok in containers
                         if tok[:1] == ("object",) and ("object", _object_token(a)) != tok]
        kids = [self.calls[i] for i in call.children]
        call.subtree_ops = sum(1 for name, _ in call.ops if name not in VIEW_OPS) + \
            sum(k.subtree_ops for k in kids)
        call.inner = hash((tuple(call.ops), tuple((k.path, k.sig, k.inner) for k in kids)))

    def __enter__(self) -> _Watcher:
        for path, mod in self.model.named_modules():
            fwd = type(mod).forward

            def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    path: str = path, fwd: Any = fwd) -> None:
                self._enter(path, m, fwd.__get__(m), type(m), args, kwargs)

            def post(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
                if self.stack:  # what a region graph of it would keep: its output set
                    self.calls[self.stack[-1]].out_bytes = sum(
                        t.nbytes for t in torch.utils._pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor))
                    self.freed.outputs(self.stack[-1], out)
                self._exit(m)

            self.handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(mod.register_forward_hook(post, with_kwargs=True))
        for mp in self.methods:
            mod = self.model.get_submodule(mp.rpartition(".")[0])
            orig = getattr(mod, mp.rpartition(".")[2])

            def begin(path: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      mod: nn.Module = mod, orig: Any = orig) -> None:
                self._enter(path, mod, orig, (type(mod), path), args, kwargs)

            def end(out: Any, mod: nn.Module = mod) -> None:
                if self.stack:
                    self.freed.outputs(self.stack[-1], out)
                self._exit(mod)

            self.restore.append(wrap_method(self.model, mp, begin, end, with_args=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        unwrap(self.restore)
        self.handles.clear()
        self.freed.close()


# --- timing --------------------------------------------------------------------------------------


# Bare steps before timing: at most this many, and until two in a row were no faster than 0.95x
# the fastest before them.
SETTLE_MAX = 24
SETTLE_GAIN = 0.95


def settle(timed: Callable[[], float]) -> int:
    """Run bare steps until the step stops getting faster; how many ran.

    A stream's first frames can be slower than its later ones for reasons that pass (on the
    H200 the SDPA example's first twenty frames still allocated its caches' growing tensors
    anew, each frame faster than the one before). The timing passes take turns step by step
    (surgery.planning.level_timing), but while every step is faster than the last, the pass
    timed later in a round still sees a faster model: there the root came out 23 ms slower than
    its three children together, a quarter of the step as the model's own code. A model whose
    steps get slower as its cache grows stops at once: two steps, each no faster than before.
    """
    times: list[float] = []
    while len(times) < SETTLE_MAX:
        times.append(timed())
        if len(times) >= 3 and all(times[i] >= SETTLE_GAIN * min(times[:i])
                                   for i in (-2, -1)):
            break
    return len(times)


def observe(model: nn.Module, step: Callable[[nn.Module], Any], *, steps: int = 4,
            timed_steps: int = 3, methods: Sequence[str] = (), clock: Clock | None = None,
            autocast: torch.dtype | None = None) -> Observation:
    """Run ``step(model)`` ``steps`` times watched, then ``timed_steps`` bare and as many for
    each nesting level of the calls (surgery.planning.level_timing).

    Module times are of one step (the last watched step's calls, each its fastest span over the
    timed steps); ``step_ms`` is the fastest bare step, timed around STEP.
    With ``autocast`` every step runs under ``torch.autocast`` of the model's device type. The
    step runs with any torch.compile of its own ignored (``force_eager``): the plan is of the
    eager step. Raises ModelSourceError when the step runs no module of the model.
    """
    p = next(iter(model.parameters()), None)
    dev = p.device.type if p is not None else "cpu"
    cuda = dev == "cuda"

    def run() -> None:
        # The step is watched eager: a torch.compile of its own (transformers' generate()
        # compiles the forward of a static cache on CUDA) would trace the watcher's hooks and
        # time compiled code. force_eager ignores it for the step and marks no code skipped.
        try:
            with torch.compiler.set_stance("force_eager"):
                if autocast is not None:
                    with torch.autocast(dev, dtype=autocast):
                        step(model)
                else:
                    step(model)
        except Exception as e:  # the user's step may fail in any way; say which part failed
            raise ModelSourceError(f"the --input step failed: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}",
                                   hint="make the --input callable run one step of the model "
                                   "it is given, e.g. model(example)") from None

    clock_fn = clock or time.perf_counter

    def timed() -> float:
        """One step, timed around STEP itself (ms)."""
        sync(cuda)
        t = clock_fn()
        run()
        sync(cuda)
        return (clock_fn() - t) * 1e3

    obs = Observation(steps=steps)
    for path, mod in model.named_modules():
        obs.classes[path] = type(mod).__name__
        fwd = type(mod).forward
        obs.callables[path] = f"{fwd.__module__}.{fwd.__qualname__}"
        obs.structure[path] = hash(tuple((k, tuple(v.shape), str(v.dtype))
                                         for k, v in mod.state_dict().items()))
    for mp in methods:
        mod_path, _, name = mp.rpartition(".")
        fn = getattr(type(model.get_submodule(mod_path)), name)
        obs.callables[mp] = f"{fn.__module__}.{fn.__qualname__}"
    t0 = clock_fn()
    with _Watcher(model, methods=methods) as w, _Recorder(w):
        for i in range(steps):
            w.step = i
            run()
    sync(cuda)
    obs.watched_step_ms = (clock_fn() - t0) * 1e3 / steps
    obs.calls = w.calls
    if not w.calls:
        raise ModelSourceError(
            f"the --input step ran no module of the {type(model).__name__} it was given "
            f"({steps} step(s) watched, no module call seen)",
            hint="make STEP(model) run the model it receives: model(x), model.forward(x), "
                 "model.generate(...) or a loop over them; not a model of its own")
    if timed_steps <= 0:
        return obs
    # Module times, one nesting level a pass (surgery.planning.level_timing): no span holds the
    # hooks of a call inside it. The bare steps take turns with the passes, so that a stream's
    # state is the same for both.
    cost = calibrate(cuda=cuda, clock=clock)
    obs.settle_steps = settle(timed)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    lt = time_levels(model, timed, calls=w.calls, methods=methods, cuda=cuda, clock=clock,
                     timed_steps=timed_steps, cost=cost)
    if cuda:  # the eager peak (timing events hold no tensor), which plan's estimate adds to
        obs.eager_peak_bytes = int(torch.cuda.max_memory_allocated())
    # The fastest of each: a shared host preempts steps at random, and a preempted step says
    # nothing about the model (timeit's rule).
    obs.bare_step_ms = min(lt.bare_ms)
    obs.hooked_step_ms = max(lt.pass_step_ms)
    if not lt.timed or obs.bare_step_ms <= 0:
        what = "no module call was timed" if not lt.timed else "the step took no measurable time"
        raise ModelSourceError(f"the --input step could not be timed: {what}",
                               hint="make STEP(model) run the model on every call (not a "
                                    "cached result), and time at least one step")
    # On a noisy host the module calls can still add up to more than the bare step: scale them
    # down to it, so that no share exceeds the step and the remainders add up.
    top = sum(ms for _p, parent, ms in lt.calls if parent < 0)
    fit = min(1.0, obs.bare_step_ms / top) if top > 0 else 1.0
    fold_times(obs, [(p, parent, ms * fit) for p, parent, ms in lt.calls])
    obs.step_ms = obs.bare_step_ms
    obs.timed_steps = timed_steps
    obs.hook_ms_per_call = cost.inner_ms
    obs.hook_pair_ms = cost.pair_ms
    obs.timing_passes = len(lt.pass_step_ms)
    obs.pass_step_ms = [round(ms, 4) for ms in lt.pass_step_ms]
    obs.bare_steps_ms = [round(ms, 4) for ms in lt.bare_ms]
    obs.clock = "injected" if clock is not None else ("cuda-events" if cuda else "perf_counter")
    return obs
