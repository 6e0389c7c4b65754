"""Compiled callables: the counting backend, and one compiled copy of a function per group.

A record may say ``compiled`` only when compiled code ran for its path, so the backend that
torch.compile is given wraps the real one: it counts each graph compiled and each execution,
attributed to the path whose call is running (surgery.runtime.slots pushes it). A group compiles a
copy of its function with a code object of its own (surgery.runtime.budget), so its dynamo cache and
recompile limit are its own.

**Dynamic dims, one by one.** A region planned with ``dynamic_dims`` (``plan --input`` saw those
sizes vary: ``{x = [0]}``, a batch) compiles those dims dynamic and every other dim static.
``torch.compile(dynamic=True)`` would make *every* size symbolic: the feature width, a token
count that never changed; the graph then computes on symbols where it could have constants, and
a change in a dim the plan saw fixed would pass as planned. So such a group compiles with
``dynamic=False`` (dynamo assumes every size static and never turns one dynamic on its own), and
``DimMarks`` puts ``torch._dynamo.maybe_mark_dynamic`` on exactly the listed dims of the named
tensor arguments before every compiled call. A size change in a marked dim runs the same graph;
one in any other dim is a recompile, counted against the path's dynamic budget
(surgery.runtime.slots). ``maybe_mark_dynamic``, not ``mark_dynamic``: where the code
specialises a marked dim (a branch on it, or a size of 1), dynamo compiles that size statically
instead of raising. The marks go on every call the same way, because dynamo guards on a tensor's
marks, and come off when the call returns, so the caller's tensors leave as they came. A name or
dim the call does not have is skipped (a manifest is untrusted; the schema bounds it to 64
names of 16 dims).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.runtime.budget import Signature, call_signature, fresh_function
from surgery.runtime.call_example import Example
from surgery.runtime.precompiled import Artifact, group_identity, signature_text

# A slot here is surgery.runtime.slots._Slot, typed Any: slots imports this module, and the
# import stays one-way.
# --- counting what runs ------------------------------------------------------------------------

_ACTIVE = threading.local()  # .stack: the slots whose compiled callable is running
_MAKING = threading.Lock()  # held while a group makes its torch.compile-d callable


def _active_slot() -> Any:
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
        self.compile_s = 0.0  # time in the real backend (AOTAutograd + inductor), cache hits too
        # surgery.runtime.shared_pieces.SharedPieces: compile from the piecewise regions' pieces
        self.shared: Any = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inner: Callable[..., Any] = torch._dynamo.lookup_backend(self.backend)
        started = time.perf_counter()
        # split at a piecewise region's split ops, pieces from its cache (compiled when first run)
        compiled = self.shared.compile(gm, example_inputs, _active_slot) \
            if self.shared is not None else None
        if compiled is not None:
            pass
        elif self.config_patches is not None:
            # The inductor entry point applies these with inductor's config.patch around the
            # compile, which is how mode + options reach it without torch.compile's mode/options
            # check (verified: emulate_precision_casts changes the generated code).
            compiled = inner(gm, example_inputs, config_patches=self.config_patches)
        else:
            compiled = inner(gm, example_inputs)
        self.compile_s += time.perf_counter() - started
        slot = _active_slot()
        if slot is not None:
            slot.record.compiles += 1
            if self.calls_done or slot.record.compiles > 1:  # after this group's or path's first
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


_WEAK = "_dynamo_weak_dynamic_indices"  # where maybe_mark_dynamic keeps a tensor's marks
_MARKED = "_has_dynamo_dim_marking"


class DimMarks:
    """The dims of named arguments to mark dynamic before a compiled call."""

    def __init__(self, dims: Mapping[str, Sequence[int]], names: Sequence[str]) -> None:
        self.dims = {k: sorted(set(v)) for k, v in dims.items() if v}
        self.names = list(names)  # positional parameter names of the callable

    def __bool__(self) -> bool:
        return bool(self.dims)

    def text(self) -> str:
        """For a group's identity and the report: ``x=[0]; y=[0, 1]``."""
        return "; ".join(f"{k}={v}" for k, v in sorted(self.dims.items()))

    def _targets(self, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Iterator[tuple[torch.Tensor, list[int]]]:
        for i, a in enumerate(args):
            name = self.names[i] if i < len(self.names) else f"arg{i}"
            if name in self.dims and isinstance(a, torch.Tensor):
                yield a, self.dims[name]
        for k, a in kwargs.items():
            if k in self.dims and isinstance(a, torch.Tensor):
                yield a, self.dims[k]

    @contextmanager
    def applied(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        """Mark the dims for the duration of one call, then put each tensor's marks back."""
        undo: list[tuple[torch.Tensor, Any, Any]] = []
        for t, dims in self._targets(args, kwargs):
            had = vars(t).get(_WEAK)
            undo.append((t, None if had is None else set(had), vars(t).get(_MARKED)))
            torch._dynamo.maybe_mark_dynamic(t, [d for d in dims if d < t.dim()])
        try:
            yield
        finally:
            for t, weak, marked in reversed(undo):
                _put_back(t, _WEAK, weak)
                _put_back(t, _MARKED, marked)


def _put_back(t: torch.Tensor, attr: str, value: Any) -> None:
    if value is None:
        vars(t).pop(attr, None)
    else:
        setattr(t, attr, value)


@dataclass
class _Group:
    """One compiled callable shared by every path with the same code and options.

    Identical blocks share it, so dynamo compiles once per distinct structure, not per instance.
    It compiles a copy of the function with a code object of its own (surgery.runtime.budget), so
    its dynamo cache and recompile limit are its own: no other group, handle or model shares them.
    """

    backend: _CountingBackend
    bound: bool  # True: compiled(module, *args); False: compiled(*args)
    target: Callable[..., Any]  # the original function (what a dynamic sibling compiles)
    fullgraph: bool
    dynamic: bool | None
    slots: list[Any] = field(default_factory=list)
    failed: BaseException | None = None
    sigs: set[Signature] = field(default_factory=set)  # static signatures compiled here
    sig_list: list[Signature] = field(default_factory=list)  # the same, in order (explaining)
    _dynamic_sibling: _Group | None = None
    # Precompiled code (surgery.runtime.precompiled): what an artifact must match, one example
    # per static signature (module, Example or None) to build artifacts from, and the loaded
    # artifacts by signature text.
    identity: str | None = None
    examples: dict[Signature, tuple[nn.Module, Example | None]] = field(default_factory=dict)
    precompiled: dict[str, Artifact] = field(default_factory=dict)
    _by_sig: dict[Signature, Artifact | None] = field(default_factory=dict)
    _guards_failed: set[tuple[int, Signature]] = field(default_factory=set)
    # The dims a plan saw vary, marked dynamic on every call (DimMarks, surgery.runtime.groups);
    # the group then compiles with every other dim static, and counts as dynamic for budgets.
    marks: DimMarks | None = None
    # The torch.compile-d copy of the function, made on first use (``compiled``): None until a
    # call goes to dynamo. What torch.compile is given as ``dynamic`` (False under marks).
    compiled_fn: Callable[..., Any] | None = None
    compile_dynamic: bool | None = None

    @property
    def compiled(self) -> Callable[..., Any]:
        """The function compiled by dynamo, made on its first use. A group whose calls all run
        precompiled code (a warm start) never makes it: a compile's object, whose first making
        imports dynamo's backend wrappers (the minifier's, and through it AOTAutograd's entry
        point); 0.02 s a process on the 2-core CPU once inductor's generated code, which imports
        AOTAutograd itself, has run."""
        if self.compiled_fn is None:
            with _MAKING:  # two threads' first calls make one, or dynamo would compile twice
                if self.compiled_fn is None:
                    self.compiled_fn = torch.compile(
                        fresh_function(self.target), backend=self.backend,
                        fullgraph=self.fullgraph, dynamic=self.compile_dynamic)
        return self.compiled_fn

    @classmethod
    def create(cls, target: Callable[..., Any], *, bound: bool, backend: str,
               config_patches: dict[str, Any] | None, fullgraph: bool,
               dynamic: bool | None, marks: DimMarks | None = None,
               shared: Any = None) -> _Group:
        counting = _CountingBackend(backend, config_patches)
        counting.shared = shared if not marks else None  # marked dims compile as usual
        group = cls(counting, bound, target, fullgraph, True if marks else dynamic)
        group.compile_dynamic = False if marks else dynamic
        group.marks = marks or None
        # torch's AOT path traces whole graphs: a function with a graph break is left to the
        # Mega-Cache part when the bundle is built (surgery.runtime.precompiled).
        options = [backend, config_patches, fullgraph, dynamic]
        if marks:
            options.append(marks.text())
        group.identity = group_identity(target, json.dumps(options, sort_keys=True,
                                                           default=str))
        return group

    def call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             sig: Signature | None = None) -> Any:
        """Run the compiled code: the precompiled artifact of ``sig`` when there is one and
        torch's guards pass for this call, else the torch.compile-d callable (dynamo)."""
        if sig is not None and sig not in self.examples:
            self.record_example(sig, module, args, kwargs)  # to precompile it in a bundle
        if sig is not None and self.precompiled:
            art = self.artifact(sig)
            if art is not None and (id(module), sig) not in self._guards_failed:
                ok, out = art.try_call((module, *args) if self.bound else args, kwargs)
                if ok:
                    slot = _active_slot()
                    if slot is not None:
                        slot.record.graphs_run += 1
                        slot.record.precompiled_runs += 1
                    return out
                self._guards_failed.add((id(module), sig))
        if self.marks is not None:
            with self.marks.applied(args, kwargs):
                return self.compiled(module, *args, **kwargs) if self.bound else \
                    self.compiled(*args, **kwargs)
        return self.compiled(module, *args, **kwargs) if self.bound else \
            self.compiled(*args, **kwargs)

    def artifact(self, sig: Signature) -> Artifact | None:
        """The loaded artifact for this signature, if the bundle held one."""
        if sig not in self._by_sig:
            self._by_sig[sig] = self.precompiled.get(signature_text(sig))
        return self._by_sig[sig]

    def ready_for(self, slot: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call of ``slot`` (a path of this group) runs code precompiled in a
        bundle, whose guards have not failed for its module: nothing compiles in it, so its CUDA
        graph may be captured on this first call (surgery.runtime.graphs.replay)."""
        if not self.precompiled or slot.mode != "compiled":
            return False
        sig = call_signature(slot.names, slot.module, args, kwargs)
        return (slot.dyn is None or sig in slot.sigs) and self.artifact(sig) is not None and \
            (id(slot.module), sig) not in self._guards_failed

    def record_example(self, sig: Signature, module: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> None:
        """Keep the layout (never the tensors) of a signature's first call, to precompile it."""
        if self.identity is not None and sig not in self.examples:
            self.examples[sig] = (module, Example.of(args, kwargs))

    def capacity(self) -> int:
        """How many signatures its code object's dynamo cache holds before dynamo gives up."""
        return int(torch._dynamo.config.recompile_limit)

    def dynamic_sibling(self) -> _Group | None:
        """The same function compiled with dynamic shapes (one per group), or None when this
        group already compiles dynamically."""
        if self.dynamic is True:
            return None
        if self._dynamic_sibling is None:
            self._dynamic_sibling = _Group.create(
                self.target, bound=self.bound, backend=self.backend.backend,
                config_patches=self.backend.config_patches, fullgraph=self.fullgraph,
                dynamic=True)
        return self._dynamic_sibling
