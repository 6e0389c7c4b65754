"""One installed region path: the wrapper, the compiled callable it shares, and the counting.

``apply_manifest`` (surgery.runtime.apply) installs a ``_Slot`` per region path. Each call goes
through the slot: eager after a fallback, a demotion or restore; otherwise the compiled callable,
counted by a wrapping backend so a record says ``compiled`` only when compiled code ran; or, with
``capture = "region"``, a replay of surgery's own CUDA graph (surgery.runtime.graphs.replay).

What it promises (with ``on_failure = "eager"``): no compile problem escapes a call. Anything
raised by dynamo, AOTAutograd, inductor, Triton or surgery's capture and replay makes the path
(or every path sharing the failed code) run eager from then on, with one warning per region and
the reason in the record; only an error the original code raises too propagates. Before the
compiled callable runs, the call's signature is checked against the path's budget
(surgery.runtime.budget): past it the path compiles dynamic or runs eager instead of recompiling.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from surgery.errors import RegionError
from surgery.formats.manifest import Region
from surgery.runtime.budget import Signature, call_signature, dynamic_helps, explain_new, fix_for
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.groups import _ACTIVE, _Group
from surgery.runtime.report import RegionFallbackWarning, RegionRecord, SurgeryWarning
from surgery.runtime.signatures import SignatureCheck

# Any exception out of a compiled callable (dynamo, AOTAutograd, inductor, Triton) is taken
# for a compile problem unless the original code raises too: then it is the model's own error
# and propagates. This one (a plain Exception, not a TorchDynamoException) concerns one path's
# signatures, so only that path falls back.
_RECOMPILE_LIMIT = (torch._dynamo.exc.FailOnRecompileLimitHit,)


# Most recompile reasons kept per record (the first ones say why; later ones repeat them).
_MAX_REASONS = 8


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
    budget: int = 4  # distinct signatures before a demotion (compile key max_signatures)
    mode: str = "compiled"  # "compiled" | "eager" | "restored"

    graphs: RegionGraphs | None = None  # surgery's own CUDA graphs (capture = "region")
    # Warns once on a signature `plan --input` never observed; checked off the replay path.
    check: SignatureCheck | None = None
    names: list[str] = field(default_factory=list)  # positional parameter names (for reasons)
    sigs: set[Signature] = field(default_factory=set)  # static signatures this path has seen
    sig_list: list[Signature] = field(default_factory=list)
    dyn: _Group | None = None  # after a demotion: new signatures go to this dynamic compile
    dyn_seen: list[Signature] = field(default_factory=list)  # signatures that compiled there
    dyn_compiles: int = 0
    hidden: int = 0  # compiles dynamo made for signatures surgery had already seen
    _raised: BaseException | None = None  # an error run_compiled let out on purpose
    _done: tuple[Any, bool] | None = None  # run_compiled's result within the current call

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
            try:
                out = self.run_compiled(args, kwargs)[0]
            finally:
                self._raised = None  # holds a traceback, and so the call's tensors
            return _clone_tensors(out) if rec.clone_outputs else out
        replays = graphs.replays
        try:
            out = graphs(args, kwargs, self._run_for_graphs)
        except Exception as exc:
            raised, self._raised = self._raised, None
            done, self._done = self._done, None
            if exc is raised:  # the model's own error, or on_failure = "error"
                raise
            return self._graphs_failed(exc, args, kwargs, done)
        self._done = None
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
        """Run the compiled callable (eager after a compile failure); True if a graph ran.

        The call's signature is checked against the path's budget first, so a path that would
        storm is demoted before dynamo compiles again (surgery.runtime.budget).
        """
        rec = self.record
        if self.mode != "compiled":
            return self.eager(*args, **kwargs), False
        sig = call_signature(self.names, self.module, args, kwargs)
        known = sig in self.group.sigs  # compiled before: dynamo should not compile again
        g = self._route(sig)
        if g is None:  # demoted to eager just now
            rec.eager_calls += 1
            return self.eager(*args, **kwargs), False
        known = known and g is self.group
        compiles = rec.compiles
        ran_before = rec.graphs_run
        stack = getattr(_ACTIVE, "stack", None)
        if stack is None:
            stack = _ACTIVE.stack = []
        stack.append(self)
        try:
            out = g.call(self.module, args, kwargs, sig if g is self.group else None)
        except Exception as exc:
            stack.pop()
            try:
                return self._fall_back(exc, g, args, kwargs), False
            except BaseException as e:
                self._raised = e
                raise
        stack.pop()
        g.backend.calls_done += 1
        if rec.compiles > compiles:
            self._count_compiles(g, sig, rec.compiles - compiles, known)
        if rec.graphs_run > ran_before:
            rec.compiled_calls += 1
            if rec.status != "compiled" and self.mode == "compiled":  # pending, or unproven
                rec.status, rec.reason = "compiled", ""
            return out, True
        rec.eager_calls += 1  # dynamo ran the frame without a graph (e.g. recompile limit)
        return out, False

    def _run_for_graphs(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[Any, bool]:
        """run_compiled, remembering its result: if the capture fails after it, the call
        returns this output instead of running the region a second time."""
        self._done = self.run_compiled(args, kwargs)
        return self._done

    def raw_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The compiled callable itself, outside the accounting (what a capture records)."""
        sig = call_signature(self.names, self.module, args, kwargs)
        g = self.dyn if self.dyn is not None and sig not in self.sigs else self.group
        return g.call(self.module, args, kwargs, sig if g is self.group else None)

    # --- the signature budget ------------------------------------------------------------------

    def _route(self, sig: Signature) -> _Group | None:
        """Which compiled callable serves this signature; None after demoting the path to eager."""
        if sig in self.sigs:
            return self.group
        if self.dyn is not None:
            return self.dyn
        group = self.group
        why = explain_new(sig, self.sig_list or group.sig_list)
        new_to_group = sig not in group.sigs
        full = new_to_group and len(group.sigs) >= group.capacity()
        if len(self.sigs) < self.budget and not full:
            self.sigs.add(sig)
            self.sig_list.append(sig)
            self.record.signatures = len(self.sigs)
            if new_to_group:
                group.sigs.add(sig)
                group.sig_list.append(sig)
                if why:  # a compile of this group's code: say why
                    self._reason(why)
            return group
        if full:
            over = (f"its compiled code already holds {len(group.sigs)} signatures (dynamo's "
                    "recompile_limit) across the paths that share it")
        else:
            over = f"signature {len(self.sigs) + 1} is over its budget of {self.budget}"
        self._reason(why)
        sibling = group.dynamic_sibling() if dynamic_helps(why) else None
        if sibling is not None:
            self.dyn = sibling
            sibling.slots.append(self)
            self.record.signature_mode = "dynamic"
            kept = f"; the {len(self.sigs)} seen keep their static code" if self.sigs else ""
            note = (f"{over} ({_kinds_text(why)}): new signatures compile with dynamic "
                    f"shapes{kept}")
            self.record.notes.append(note)
            self._warn_once("dynamic", f"{note}. Fix: {self.record.fix}", SurgeryWarning)
            return sibling
        self._demote(f"{over} ({_kinds_text(why)}); runs eager")
        return None

    def _count_compiles(self, g: _Group, sig: Signature, n: int, known: bool) -> None:
        """Compiles dynamo made in this call: a dynamic compile's or ones the signature missed."""
        if g is self.dyn:
            why = explain_new(sig, self.dyn_seen) or [("shape", "first dynamic compile")]
            self.dyn_seen.append(sig)
            self.dyn_compiles += n
            if self.dyn_compiles > 1:
                self._reason([(k, f"dynamic: {t}") for k, t in why])
            if self.dyn_compiles > self.budget:
                self._demote(f"its dynamic compile recompiled {self.dyn_compiles} times "
                             f"(over its budget of {self.budget}); runs eager")
        elif known:
            self.hidden += n
            seen = _dynamo_guard_failure(g)
            self._reason([("structure", "dynamo recompiled for a difference surgery's "
                           "signature does not see" + (f" (guard: {seen})" if seen else ""))])
            if self.hidden > self.budget:
                self._demote(f"dynamo recompiled it {self.hidden} times for signatures it had "
                             "already compiled (an object argument's attributes?); runs eager")

    def _reason(self, why: list[tuple[str, str]]) -> None:
        rec = self.record
        if not why:
            return
        text = "; ".join(t for _, t in why)
        if len(rec.recompile_reasons) < _MAX_REASONS and text not in rec.recompile_reasons:
            rec.recompile_reasons.append(text)
        rec.fix = fix_for(why)

    def _demote(self, reason: str) -> None:
        """This path runs eager from now on: one warning per region, the reason in its record."""
        self.mode = "eager"
        rec = self.record
        rec.status, rec.reason = "eager", reason
        rec.signature_mode = "eager"
        if self.graphs is not None:
            self.graphs.drop("the path was demoted to eager")
        fix = f" Fix: {rec.fix}." if rec.fix else ""
        self._warn_once("eager", f"path {rec.path!r}: {reason}.{fix}", RegionFallbackWarning)

    def _warn_once(self, what: str, message: str, category: type[Warning]) -> None:
        key = (id(self.region), what)
        if key not in self.state.warned_demotions:
            self.state.warned_demotions.add(key)
            warnings.warn(f"surgery: region {self.region.kind!r}: {message}", category,
                          stacklevel=6)

    # --- failures ------------------------------------------------------------------------------

    def warn_graphs(self, message: str) -> None:
        """One warning per region path and message kind, and a note in its record."""
        if message not in self.record.notes:
            self.record.notes.append(message)
        key = (id(self), message[:40])
        if key not in self.state.warned_graphs:
            self.state.warned_graphs.add(key)
            warnings.warn(f"surgery: region {self.region.kind!r} path {self.record.path!r}: "
                          f"{message}", SurgeryWarning, stacklevel=5)

    def _graphs_failed(self, exc: BaseException, args: tuple[Any, ...],
                       kwargs: dict[str, Any], done: tuple[Any, bool] | None) -> Any:
        """Surgery's own capture or replay failed: this path runs compiled without graphs."""
        cause = f"{type(exc).__name__}: {first_line(exc)}"
        if self.region.on_failure == "error":
            raise RegionError(
                f"region {self.region.kind!r} path {self.record.path!r}: CUDA-graph capture or "
                f"replay failed ({cause})", region=self.record.path,
                hint="set capture = \"compiler\" on the region, or on_failure = \"eager\" to run "
                     "it compiled without surgery's graphs") from exc
        graphs = self.graphs
        self.graphs = None
        if graphs is not None:
            graphs.drop("capture or replay failed")
        self.warn_graphs(f"CUDA-graph capture or replay failed ({cause}); runs compiled "
                         "without a graph")
        out = done[0] if done is not None else self.run_compiled(args, kwargs)[0]
        return _clone_tensors(out) if self.record.clone_outputs else out

    def _fall_back(self, exc: BaseException, g: _Group, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """Fall back to eager for every path using the compiled callable that failed, warning
        once; a recompile-limit failure is this path's alone.

        The eager call runs first: if the original code fails too, the error is the model's own
        and propagates, and nothing is marked as a compile failure.
        """
        cause = first_line(exc)
        if self.region.on_failure == "error":
            raise RegionError(
                f"region {self.region.kind!r} path {self.record.path!r} failed to compile "
                f"({type(exc).__name__}): {cause}", region=self.record.path,
                hint="fix the code so dynamo can trace it, exclude the region, or set "
                     "on_failure = \"eager\" on the region to run it eagerly") from exc
        out = self.eager(*args, **kwargs)
        reason = f"failed to compile ({type(exc).__name__}: {cause}); runs eager"
        if isinstance(exc, _RECOMPILE_LIMIT):
            self._demote(reason)
            self.record.eager_calls += 1
            return out
        g.failed = exc
        failed = []
        for s in g.slots:
            if s.mode == "compiled" and (s.group is g or s.dyn is g):
                s.mode = "eager"
                s.record.status, s.record.reason = "eager", reason
                s.record.signature_mode = "eager"
                if s.graphs is not None:
                    s.graphs.drop("the path fell back to eager")
                failed.append(s.record.path)
        if self.mode == "compiled":  # a path that called a group it is not registered with
            self._demote(reason)
        self.record.eager_calls += 1
        key = id(self.region)
        if key not in self.state.warned_regions:
            self.state.warned_regions.add(key)
            warnings.warn(
                f"surgery: region {self.region.kind!r} could not be compiled and runs eager for "
                f"{', '.join(failed) or self.record.path}: {type(exc).__name__}: {cause}. Set "
                "on_failure = \"error\" on the region to make this fatal.",
                RegionFallbackWarning, stacklevel=5)
        return out


def _kinds_text(why: list[tuple[str, str]]) -> str:
    return "; ".join(t for _, t in why) or "a new signature"


def _dynamo_guard_failure(g: _Group) -> str:
    """Dynamo's last guard failure for this group's code (a private table; best effort)."""
    try:
        from torch._dynamo.utils import guard_failures

        fn = getattr(g.compiled_fn, "_torchdynamo_orig_callable", None)
        code = getattr(fn, "__code__", None)
        fails = guard_failures.get(code) if code is not None else None
        return fails[-1].splitlines()[0].split("#")[0].strip() if fails else ""
    except Exception:  # private API: its absence costs only the detail
        return ""


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
    warned_demotions: set[tuple[int, str]] = field(default_factory=set)
    warned_graphs: set[tuple[int, str]] = field(default_factory=set)


def first_line(exc: BaseException) -> str:
    """An exception's first line (what a backend failure wrapped, when it wraps one)."""
    inner = getattr(exc, "inner_exception", None)  # BackendCompilerFailed: what the backend raised
    if isinstance(inner, BaseException) and inner is not exc:
        return f"{type(inner).__name__}: {first_line(inner)}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
