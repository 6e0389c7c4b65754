"""Compiled callables: the counting backend, and one compiled copy of a function per group.

A record may say ``compiled`` only when compiled code ran for its path, so the backend that
torch.compile is given wraps the real one: it counts each graph compiled and each execution,
attributed to the path whose call is running (surgery.runtime.slots pushes it). A group compiles a
copy of its function with a code object of its own (surgery.runtime.budget), so its dynamo cache and
recompile limit are its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.runtime.budget import Signature, fresh_function

# A slot here is surgery.runtime.slots._Slot, typed Any: slots imports this module, and the
# import stays one-way.
# --- counting what runs ------------------------------------------------------------------------

_ACTIVE = threading.local()  # .stack: the slots whose compiled callable is running


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


@dataclass
class _Group:
    """One compiled callable shared by every path with the same code and options.

    Identical blocks share it, so dynamo compiles once per distinct structure, not per instance.
    It compiles a copy of the function with a code object of its own (surgery.runtime.budget), so
    its dynamo cache and recompile limit are its own: no other group, handle or model shares them.
    """

    compiled: Callable[..., Any]
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

    @classmethod
    def create(cls, target: Callable[..., Any], *, bound: bool, backend: str,
               config_patches: dict[str, Any] | None, fullgraph: bool,
               dynamic: bool | None) -> _Group:
        counting = _CountingBackend(backend, config_patches)
        compiled = torch.compile(fresh_function(target), backend=counting, fullgraph=fullgraph,
                                 dynamic=dynamic)
        return cls(compiled, counting, bound, target, fullgraph, dynamic)

    def call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.compiled(module, *args, **kwargs) if self.bound else \
            self.compiled(*args, **kwargs)

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
