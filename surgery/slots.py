"""One installed region path: the wrapper, the compiled callable it shares, and the counting.

``apply_manifest`` (surgery.apply) installs a ``_Slot`` per region path. Each call goes through
the slot: eager after a fallback or restore; otherwise the compiled callable, counted by a
wrapping backend so a record says ``compiled`` only when compiled code ran; or, with
``capture = "region"``, a replay of surgery's own CUDA graph (surgery.graphs).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.errors import RegionError
from surgery.graphs import RegionGraphs
from surgery.manifest import Region
from surgery.report import RegionFallbackWarning, RegionRecord, SurgeryWarning
from surgery.signatures import SignatureCheck

# Errors raised while dynamo traces or a backend compiles. A region that raises one of these
# falls back to eager; any other exception is the model's own and propagates unchanged.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)


# --- counting what runs ------------------------------------------------------------------------

_ACTIVE = threading.local()  # .stack: the slots whose compiled callable is running


def _active_slot() -> _Slot | None:
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


class _CountingBackend:
    """A torch.compile backend that compiles with the real one and counts what happens.

    Compiles are counted when dynamo hands a graph over; executions are counted by wrapping the
    compiled graph. Both are attributed to the region path whose call is running, which is what
    lets a record say ``compiled`` only when compiled code ran.
    """

    def __init__(self, backend: str, config_patches: dict[str, Any] | None) -> None:
        self.backend = backend
        self.config_patches = config_patches
        self.__name__ = f"surgery_{backend}"  # torch names the compiler after it in its logs
        self.calls_done = 0  # completed compiled calls through this backend's callable

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inner: Callable[..., Any] = torch._dynamo.lookup_backend(self.backend)
        if self.config_patches is not None:
            # The inductor entry point applies these with inductor's config.patch around the
            # compile, which is how mode + options reach it without torch.compile's mode/options
            # check (verified: emulate_precision_casts changes the generated code).
            compiled = inner(gm, example_inputs, config_patches=self.config_patches)
        else:
            compiled = inner(gm, example_inputs)
        slot = _active_slot()
        if slot is not None:
            slot.record.compiles += 1
            if self.calls_done:
                slot.record.recompiles += 1

        def run(*args: Any) -> Any:
            s = _active_slot()
            if s is not None:
                s.record.graphs_run += 1
            return compiled(*args)

        return run

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: free the cudagraph trees, as inductor's own
        torch.compile wrapper does, or their recorded graphs and pools outlive the reset."""
        if self.config_patches and self.config_patches.get("triton.cudagraphs"):
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()


@dataclass
class _Group:
    """One compiled callable shared by every path with the same code and options.

    Identical blocks share it, so dynamo compiles once per distinct structure, not per instance.
    """

    compiled: Callable[..., Any]
    backend: _CountingBackend
    bound: bool  # True: compiled(module, *args); False: compiled(*args)
    slots: list[_Slot] = field(default_factory=list)
    failed: BaseException | None = None


@dataclass
class _Slot:
    """One installed region path: where the wrapper sits and what it replaced."""

    module: nn.Module
    name: str
    had_own: bool  # was `name` in the instance __dict__ before?
    own: Any  # the instance attribute it replaced, if any
    eager: Callable[..., Any]  # the original callable, bound
    record: RegionRecord
    region: Region
    group: _Group
    state: _HandleState
    mode: str = "compiled"  # "compiled" | "eager" | "restored"

    graphs: RegionGraphs | None = None  # surgery's own CUDA graphs (capture = "region")
    # Warns once on a signature `plan --input` never observed; checked off the replay path.
    check: SignatureCheck | None = None

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rec = self.record
        rec.calls += 1
        if self.mode != "compiled":
            rec.eager_calls += 1
            return self.eager(*args, **kwargs)
        graphs = self.graphs
        if graphs is None:
            if self.check is not None:
                self.check.check(args, kwargs)
            out = self.run_compiled(args, kwargs)[0]
            return _clone_tensors(out) if rec.clone_outputs else out
        replays = graphs.replays
        out = graphs(args, kwargs, self.run_compiled)
        if graphs.replays > replays:  # a replay of a graph captured from compiled code
            rec.compiled_calls += 1
            rec.graph_replays += 1
        else:  # captures, ring growth and the switch to cloning happen only off the replay path
            if self.check is not None:  # a new signature always arrives here first
                self.check.check(args, kwargs)
            rec.graphs_captured = graphs.captures
            rec.output_sets = graphs.output_sets
            rec.capture_s = graphs.capture_s
            rec.clone_outputs = graphs.clone
        return out

    def run_compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """Run the compiled callable (eager after a compile failure); True if a graph ran."""
        rec = self.record
        if self.mode != "compiled":
            return self.eager(*args, **kwargs), False
        g = self.group
        ran_before = rec.graphs_run
        stack = getattr(_ACTIVE, "stack", None)
        if stack is None:
            stack = _ACTIVE.stack = []
        stack.append(self)
        try:
            out = g.compiled(self.module, *args, **kwargs) if g.bound else \
                g.compiled(*args, **kwargs)
        except _COMPILE_ERRORS as exc:
            stack.pop()
            return self._fall_back(exc, args, kwargs), False
        stack.pop()
        g.backend.calls_done += 1
        if rec.graphs_run > ran_before:
            rec.compiled_calls += 1
            if rec.status != "compiled":  # pending, or unproven after warm-up
                rec.status, rec.reason = "compiled", ""
            return out, True
        rec.eager_calls += 1  # dynamo ran the frame without a graph (e.g. recompile limit)
        return out, False

    def raw_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The compiled callable itself, outside the accounting (what a capture records)."""
        g = self.group
        return g.compiled(self.module, *args, **kwargs) if g.bound else g.compiled(*args, **kwargs)

    def warn_graphs(self, message: str) -> None:
        """One warning per region path and message kind, and a note in its record."""
        if message not in self.record.notes:
            self.record.notes.append(message)
        key = (id(self), message[:40])
        if key not in self.state.warned_graphs:
            self.state.warned_graphs.add(key)
            warnings.warn(f"surgery: region {self.region.kind!r} path {self.record.path!r}: "
                          f"{message}", SurgeryWarning, stacklevel=5)

    def _fall_back(self, exc: BaseException, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """Fall back to eager for every path sharing this compiled callable, warning once.

        The eager call runs first: if the original code fails too, the error is the model's own
        and propagates, and nothing is marked as a compile failure.
        """
        cause = _first_line(exc)
        if self.region.on_failure == "error":
            raise RegionError(
                f"region {self.region.kind!r} path {self.record.path!r} failed to compile "
                f"({type(exc).__name__}): {cause}", region=self.record.path,
                hint="fix the code so dynamo can trace it, or set on_failure = \"eager\" on the "
                     "region to run it eagerly") from exc
        out = self.eager(*args, **kwargs)
        self.group.failed = exc
        failed = []
        for s in self.group.slots:
            if s.mode == "compiled":
                s.mode = "eager"
                s.record.status = "eager"
                s.record.reason = f"failed to compile ({type(exc).__name__}: {cause}); runs eager"
                failed.append(s.record.path)
        self.record.eager_calls += 1
        key = id(self.region)
        if key not in self.state.warned_regions:
            self.state.warned_regions.add(key)
            warnings.warn(
                f"surgery: region {self.region.kind!r} could not be compiled and runs eager for "
                f"{', '.join(failed)}: {type(exc).__name__}: {cause}. Set on_failure = \"error\" "
                f"on the region to make this fatal.", RegionFallbackWarning, stacklevel=4)
        return out


def _make_wrapper(slot: _Slot) -> Callable[..., Any]:
    eager = slot.eager

    @functools.wraps(eager)
    def region_call(*args: Any, **kwargs: Any) -> Any:
        # Under an outer torch.compile (a whole-model compile, or a region inside another), let
        # dynamo inline the original code instead of tracing the bookkeeping.
        if torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        return slot.call(args, kwargs)

    region_call.__surgery_slot__ = slot  # type: ignore[attr-defined]
    return region_call


def _clone_tensors(out: Any) -> Any:
    """Clone every tensor in a (nested) output, outside the graph.

    CUDA-graph outputs live in the graph's memory pool and the next replay overwrites them
    (pytorch#152887); a clone made inside the graph lives in that pool too, so it must be here.
    """
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple
        return type(out)(*(_clone_tensors(o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_tensors(o) for o in out)
    if isinstance(out, dict):
        return type(out)((k, _clone_tensors(v)) for k, v in out.items())
    return out


@dataclass
class _HandleState:
    warned_regions: set[int] = field(default_factory=set)
    warned_graphs: set[tuple[int, str]] = field(default_factory=set)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
