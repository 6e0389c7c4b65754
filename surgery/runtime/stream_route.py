"""The stream route: a model called on the default stream runs, whole, on surgery's side stream.

Why. A CUDA graph cannot be captured on the device's default stream, so when the model runs
there the region graphs are captured on a side stream of surgery's (surgery.runtime.graphs
.capture), and every stream a matmul runs on gets a cuBLAS workspace of its own, for good (32-33
MiB on Hopper). Eager work on the default stream has made one already, so the graphs' one was
extra: GPT-2 decode +34 MiB over eager's peak (+11.9%) on an H200, where on a user stream, which
the graphs capture on directly, it was +1 MiB. The workspace cannot be shared between two streams
without writing into torch's internal map (capture.py says why). What users were told to do by
hand, the route does for them: the whole call (the eager parts, a prefill, the region graphs'
warm-ups, captures and replays) runs on the side stream. Every matmul of the model then uses that
stream's one workspace, and the default stream's is never made, as in eager, which has exactly
one.

How. ``install_route`` puts a wrapper on the model's instance ``forward`` (as regions do: never
the module in its parent, so ``state_dict()`` keys are unchanged), which ``model(...)``,
``model.forward(...)`` and methods that call ``self(...)`` (``generate()``) all go through. When
the caller's current stream on the graphs' device is the default stream, a call:

1. records an event on the default stream and makes the side stream wait for it (entry);
2. makes the side stream current and runs the model's forward;
3. makes the default stream current again (also when the forward raised), records an event on
   the side stream and makes the default stream wait for it (exit).

Not routed: a call on any other stream (a user stream, which the graphs capture on already;
inside the route, so a nested call enters it once; inside the user's own ``torch.cuda.graph``,
whose stream is never the default one), under an outer ``torch.compile`` trace, on the CPU (no
route is installed without a CUDA capturer), with ``apply_manifest(...,
route_default_stream=False)``. Methods that reach the regions without ``forward`` (a submodule
called directly) are not routed either: their graphs capture on the side stream as before, at
the cost of its workspace, which ``report.memory`` names.

Why the two waits make the caching allocator's reuse safe. The allocator hands a freed block
again only to an allocation on the stream it was allocated on, without waiting for other streams
(unless ``record_stream`` marked it). So:

- A tensor the routed call allocates (logits, a KV cache kept in the user's objects) belongs to
  the side stream. The caller reads it on the default stream after the exit wait, so those reads
  come after its writes. When the caller frees it, the block is handed again only to a side-stream
  allocation, which is made only inside a routed call, after that call's entry wait (or in a
  capture, which waits for the caller's stream first): every default-stream read queued before
  the free is ordered before the new owner's writes.
- An input allocated on the default stream and read inside the call: freed by the caller after
  the call, its block goes to a default-stream allocation queued after the exit wait, so after
  the reads. Freed during the call (a cache the model replaces), the same: no default-stream
  allocation is made in this thread until the call returns.
- A tensor the caller uses on a third stream needs ``record_stream`` or a wait exactly as in
  eager: a wait on the default stream before the free also orders it before the side stream's
  next use, through the next entry wait.

So no ``record_stream`` is needed. What the waits do not cover: another thread allocating on the
default stream of the same device while a routed call runs could be handed a block the call
freed and still reads. The route itself is per thread (torch's current stream is per thread, the
events only ever make a stream wait for a later point), but region graphs run one call at a time
(replay.py); call a model from one thread at a time, or pass ``route_default_stream=False``.

Host cost per routed call: two event records, two waits, two stream switches and one raw-stream
read (a few microseconds; ``benchmarks/bench_stream_route.py`` measures it); an unrouted call
pays the raw-stream read and a compare.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from surgery.errors import SurgeryError

# The attribute that marks the route's wrapper on a model's instance ``forward``: a second
# apply_manifest on the same model joins the route there instead of wrapping it again.
ROUTE_ATTR = "__surgery_route__"

ROUTE_NOTE = ("calls of the model made on the default stream run on surgery's side stream, "
              "ordered both ways, so its eager parts and region graphs share that stream's one "
              "cuBLAS workspace (route_default_stream=False turns this off)")


class StreamRoute:
    """The route of one model (the module's docstring). ``calls`` counts routed calls."""

    def __init__(self, model: nn.Module, capturer: Any) -> None:
        cuda = torch.cuda
        self.model = model
        self.capturer = capturer
        self.device = int(capturer.device)
        self.side = capturer.side_stream()
        self.default = cuda.default_stream(self.device)
        self.default_raw = int(self.default.cuda_stream)
        # Made here, once, and re-recorded every call: a record only ever moves an event to a
        # later point of its stream, so a wait on it never orders less than it should.
        self.entered, self.left = cuda.Event(), cuda.Event()
        self.entered.record(self.default)
        self.left.record(self.side)
        self.users = 0  # live handles that use this route
        self.calls = 0
        self.had_own = "forward" in vars(model)
        self.own = vars(model).get("forward")
        self.wrapper = _wrap(self, model.forward)

    def run(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
        """``inner(*args, **kwargs)`` on the side stream, ordered both ways."""
        cuda = torch.cuda
        self.entered.record(self.default)
        self.side.wait_event(self.entered)
        device = cuda.current_device()
        cuda.set_stream(self.side)  # also makes the side stream's device current
        self.calls += 1
        try:
            return inner(*args, **kwargs)
        finally:
            cuda.set_stream(self.default)
            if device != self.device:
                cuda.set_device(device)
            self.left.record(self.side)
            self.default.wait_event(self.left)

    def remove(self) -> None:
        """Put back what the instance held as ``forward`` once no handle uses the route."""
        self.users -= 1
        if self.users > 0:
            return
        d = self.model.__dict__
        if d.get("forward") is not self.wrapper:  # wrapped again since: the route goes inert
            self.wrapper.__dict__[ROUTE_ATTR] = None
            return
        if self.had_own:
            d["forward"] = self.own
        else:
            d.pop("forward", None)


def _wrap(route: StreamRoute, inner: Callable[..., Any]) -> Callable[..., Any]:
    raw = route.capturer.current_raw
    default_raw = route.default_raw

    @functools.wraps(inner)  # keeps the signature (transformers reads forward's parameters)
    def forward(*args: Any, **kwargs: Any) -> Any:
        live = forward.__dict__[ROUTE_ATTR]
        if live is None or torch.compiler.is_compiling() or raw() != default_raw:
            return inner(*args, **kwargs)
        return live.run(inner, args, kwargs)

    forward.__dict__[ROUTE_ATTR] = route
    return forward


def capturers_of(slots: Sequence[Any]) -> list[Any]:
    """The distinct capturers the slots' region graphs capture with (a piecewise slot names its
    own; an ordinary slot's RegionGraphs does)."""
    found: dict[int, Any] = {}
    for slot in slots:
        cap = getattr(slot, "capturer", None)
        if cap is None:
            cap = getattr(getattr(slot, "graphs", None), "capturer", None)
        if cap is not None:
            found[id(cap)] = cap
    return list(found.values())


def install_route(model: nn.Module, slots: Sequence[Any], *, enabled: bool,
                  notes: list[str]) -> StreamRoute | None:
    """The model's route, when its region graphs capture with one CUDA capturer (one with a side
    stream); None otherwise, or when not ``enabled``. A note says which."""
    if not isinstance(enabled, bool):
        raise SurgeryError(f"route_default_stream = {enabled!r} is not a bool",
                           hint="pass True (the default) or False")
    caps = [c for c in capturers_of(slots) if callable(getattr(c, "side_stream", None))]
    if not caps or not enabled:
        return None
    if len(caps) > 1:
        notes.append(f"not routed onto a side stream: the region graphs are on {len(caps)} "
                     "devices; calls on the default stream capture on each device's side stream")
        return None
    existing = getattr(vars(model).get("forward"), "__dict__", {}).get(ROUTE_ATTR)
    route = existing if isinstance(existing, StreamRoute) else StreamRoute(model, caps[0])
    if route is not existing:
        model.__dict__["forward"] = route.wrapper
    route.users += 1
    notes.append(ROUTE_NOTE)
    return route
