"""Compiled pieces shared across graphs and blocks: each distinct piece is compiled once.

Why. A piecewise block (surgery.runtime.piecewise) is traced by dynamo once per cache
structure: a list cache that grows one frame a step gives one dynamo graph per list length until
its window is full (the SDPA example's camera trunk: 17 per instance), and a block whose forward
takes a per-instance int (``cache[global_idx]``) traces its own graphs per instance. Splitting
each of those graphs at attention and the cache gives static pieces that are *the same* FX code
every time: the norms and projections before attention, and the projection, residual and MLP
after it, never see the cache. The weights are graph inputs (dynamo lifts parameters to
placeholders), so a piece compiled for one block runs any block of the same weight layout.
Compiling every piece of every graph cost inductor (or aot_eager) one compile per piece per
graph: 78 piece compiles for 6 distinct pieces on the tiny SDPA example.

What is shared, and the key that makes two pieces interchangeable (``piece_key``):

- **the code**: the piece's FX graph written out node by node, placeholders and values named by
  position, targets by their qualified names, constants by ``repr``, and a lone size sequence of
  ``reshape``/``view``/``expand``/``permute``/``repeat`` spread (``x.reshape(x.shape)`` is
  ``x.reshape(b, n, c)``). A graph holding a
  ``get_attr`` or ``call_module`` node (state outside its inputs) is never shared;
- **the inputs' layout**: type, shape, strides, dtype, device and 16-byte alignment of every
  tensor (what inductor specializes a static graph to), and the value of every Python scalar;
  any other input makes the piece unshareable;
- **which inputs are the block's parameters or buffers** (the region graphs read them in place);
- **the global state the compile bakes in**: grad mode, inference mode, and the autocast state of
  the CPU and CUDA;
- **the compile plan** (backend and inductor config patches): the cache lives in one apply.

A piece with the same key reuses the compiled callable, and, per region path, the same region
graphs (surgery.runtime.piecewise_split.PathPieces): a capture is made once per path and piece,
not once per graph, and since the callable already ran, the path's first call of it captures
(``ready``) instead of waiting for a second one. A piece whose key differs from a compiled one
only in the strides of inputs that are not weights takes that compile too, its inputs copied into
the compiled layout (surgery.runtime.piece_restride, where it is safe).

**Light across the apply** (``PieceWork``). compile_start's light pieces weigh a piece against
the other pieces of *its own graph* (the GPT-2 stack's first and last pieces are 3% and 7% of
its one graph). A plan with several piecewise regions has pieces that are a large share of their
own graph and a small share of the step: the SDPA example's camera trunk (4 blocks) beside 24
global blocks. The trunk's piece before attention (its norm, the fused qkv projection, the stack
of k and v: 3 ops that do work) is 30% of the trunk's graph but about 1% of the pieces the
apply's piecewise regions run a step; its inductor build (about 1 s on an H200) was one of the
compiles the names-only plan does not pay, for fusing a layer norm's casts. So each piecewise
group's graphs register their pieces as (code, ops that do work) times the group's paths (its
blocks, which all run the code each step) and the copies of the code in the graph, a group
counting once per code however many graphs it traces. A piece is also light when its code's
work, summed over the groups that run it, is under ``LIGHT_PIECE_SHARE`` of all the work
registered. **Off by default** (``LIGHT_ACROSS_REGIONS``): on the H200 (call 3 of session 5)
the SDPA example's step read 28.6 ms a frame with it against 16.4 ms without (call 2), its one
effect being the trunk's piece before attention on aot_eager; the CPU stand-in shows the same
captures and replays either way, so the cause is not known, and a cold-start rule must not cost
the step. For one piecewise region this is exactly the per-graph rule (every weight and the
total scale by its paths), so the GPT-2 stack's pieces do not change. It knows only the groups
traced before the graph: a group traced first is weighed against itself alone, and ordinary
regions built from pieces (surgery.runtime.shared_pieces) are not counted, which can only make
fewer pieces light. A light piece still replays as a CUDA graph and keeps eager's values.

What it does not do: it never compares weights (they are inputs), and a piece that fails the key
(an unknown input type) compiles on its own, as before.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from surgery.runtime import compile_start
from surgery.runtime.compile_start import LIGHT_PIECE_BACKEND, compile_light
from surgery.runtime.piece_restride import RestridedPiece, copy_safe, differing, loose_key

# Alignment inductor checks an input's data pointer against (its `ALIGNMENT`).
_ALIGN = 16
# Python scalars a key may hold by value (a piece specializes on them).
_SCALARS = (bool, int, float, str, type(None))


# Modules whose functions are known by their qualified name alone; any other target is also
# known by its identity (two closures can share a qualified name).
_NAMED = ("torch", "_operator", "operator", "math", "builtins")


class _Unshareable(Exception):
    """A graph holds something its text cannot name exactly (a tensor constant)."""


def _name(target: Any) -> str:
    if isinstance(target, str):
        return target
    mod = getattr(target, "__module__", None) or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    name = f"{mod}.{qual}" if qual else repr(target)
    return name if mod.split(".")[0] in _NAMED else f"{name}@{id(target)}"


def _arg(value: Any, ids: dict[fx.Node, int]) -> str:
    if isinstance(value, torch.Tensor):
        raise _Unshareable
    if isinstance(value, fx.Node):
        return f"%{ids[value]}"
    if isinstance(value, list | tuple):
        inner = ", ".join(_arg(v, ids) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner},)"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v, ids)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_arg(value.start, ids)}, {_arg(value.stop, ids)}, {_arg(value.step, ids)})"
    return repr(value)


# Tensor methods that take their sizes either spread or as one sequence: ``x.reshape(b, n, c)``
# and ``x.reshape(x.shape)`` are the same op (the camera trunk's and the global blocks' pieces
# after attention differed only there), so the key spreads a lone sequence.
_SIZE_METHODS = frozenset({"reshape", "view", "expand", "permute", "repeat"})


def _spread(node: fx.Node) -> tuple[Any, ...]:
    args = node.args
    if node.op == "call_method" and node.target in _SIZE_METHODS and len(args) == 2 and \
            isinstance(args[1], list | tuple) and args[1] and not node.kwargs:
        return (args[0], *args[1])
    return args


def canonical_graph(gm: fx.GraphModule) -> str | None:
    """The piece's code with every name replaced by its position; None if not shareable."""
    ids: dict[fx.Node, int] = {}
    lines: list[str] = []
    for i, node in enumerate(gm.graph.nodes):
        ids[node] = i
        if node.op in ("get_attr", "call_module"):
            return None
        target = "" if node.op in ("placeholder", "output") else _name(node.target)
        try:
            lines.append(f"{node.op} {target} {_arg(_spread(node), ids)} "
                         f"{_arg(node.kwargs, ids)}")
        except _Unshareable:
            return None
    return "\n".join(lines)


def _layout(value: Any) -> tuple[Any, ...] | None:
    if isinstance(value, torch.Tensor):
        # The stride of a dim of size 1 addresses nothing: two such layouts read the same
        # elements at the same offsets, and inductor's input check ignores it too
        # (``assert_size_stride``). A light piece's outputs (eager's views) and inductor's
        # (fresh buffers) differ just there, and the piece after them must stay one compile.
        stride = tuple(0 if n == 1 else st for n, st in zip(value.shape, value.stride(),
                                                             strict=True))
        return (type(value).__name__, tuple(value.shape), stride, value.dtype,
                str(value.device), value.requires_grad,
                value.data_ptr() % _ALIGN == 0 if value.device.type != "meta" else True)
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    return None


def global_state() -> tuple[Any, ...]:
    """Grad mode, inference mode and autocast (CPU, CUDA): what a compile bakes in."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
              for d in ("cpu", "cuda")))


def piece_key(gm: fx.GraphModule, args: Sequence[Any], stable_pos: Sequence[int]
              ) -> tuple[Any, ...] | None:
    """What makes two pieces interchangeable (see the module docstring); None: never shared."""
    code = canonical_graph(gm)
    if code is None:
        return None
    layouts = []
    for a in args:
        lay = _layout(a)
        if lay is None:
            return None
        layouts.append(lay)
    return (code, tuple(layouts), tuple(stable_pos), global_state())


class CompiledPiece:
    """A compiled piece and how often it ran (a piece that ran may be captured at once), and
    the strides of the inputs it was compiled for (a piece of other strides may copy into
    them: surgery.runtime.piece_restride)."""

    def __init__(self, fn: Callable[..., Any], strides: Sequence[Any] = ()) -> None:
        self.fn = fn
        self.runs = 0
        self.strides = tuple(strides)

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        self.runs += 1
        return out


# Whether PieceWork's rule (a small share of all the apply's pieces) makes pieces light: off
# until the H200 shows it keeps the step (see the module docstring).
LIGHT_ACROSS_REGIONS = False


@dataclass
class PieceWork:
    """The piece work the apply's piecewise groups registered: (code, group) -> work a step."""

    work: dict[tuple[object, int], int] = field(default_factory=dict)

    def light(self, group: int, paths: int, pieces: Sequence[tuple[str | None, int]]
              ) -> list[bool]:
        """Register one graph of ``group`` (run by ``paths`` paths each step), its pieces as
        (canonical code or None, ops that do work), and say which are light across the apply
        (see the module docstring). A piece without a code counts alone, by its position.
        With ``LIGHT_ACROSS_REGIONS`` off (the default) none is."""
        if not LIGHT_ACROSS_REGIONS:
            return [False] * len(pieces)
        keys: list[object] = [code if code is not None else ("unshared", group, i)
                              for i, (code, _) in enumerate(pieces)]
        ops = dict(zip(keys, (n for _, n in pieces), strict=True))
        for key, copies in Counter(keys).items():
            self.work[(key, group)] = ops[key] * copies * max(paths, 1)
        total = sum(self.work.values())
        by_code: Counter[object] = Counter()
        for (key, _), w in self.work.items():
            by_code[key] += w
        share = compile_start.LIGHT_PIECE_SHARE
        return [total > 0 and by_code[k] < share * total for k in keys]


# What the cache hands out: a compiled piece, or one behind copies into its input layout.
Piece = CompiledPiece | RestridedPiece


@dataclass
class PieceCache:
    """The compiled pieces of one apply, by key, and what sharing them saved."""

    compile_fn: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]
    compiled: dict[tuple[Any, ...], Piece] = field(default_factory=dict)
    # by loose key (piece_restride): the pieces compiled here, with their exact keys
    loose: dict[tuple[Any, ...], tuple[CompiledPiece, tuple[Any, ...]]] = \
        field(default_factory=dict)
    compiles: int = 0  # pieces compiled
    light: int = 0  # of them, light pieces (surgery.runtime.compile_start)
    shared: int = 0  # pieces that took a callable already compiled
    restrided: int = 0  # of them, a compile of other input strides (piece_restride)
    compile_s: float = 0.0  # seconds spent compiling pieces
    work: PieceWork = field(default_factory=PieceWork)  # the groups' pieces (light across them)

    def get(self, gm: fx.GraphModule, args: list[Any], stable_pos: Sequence[int],
            light: bool = False) -> tuple[Piece, tuple[Any, ...] | None, bool]:
        """(the compiled piece, its key, whether it was compiled now) for these inputs. A light
        piece takes a full compile of the same key when one exists (the better code, for no
        compile); otherwise it compiles with the light backend, under a key of its own, which a
        full piece never takes. Failing an exact key, a compile of the same key but for the
        strides of inputs that are not weights serves, its inputs copied (piece_restride)."""
        key = piece_key(gm, args, stable_pos)
        found = self.compiled.get(key) if key is not None else None
        if key is not None and light and found is None:
            found = self.compiled.get((*key, LIGHT_PIECE_BACKEND))
            key = key if found is None else (*key, LIGHT_PIECE_BACKEND)
        if key is not None and found is None:
            found, key = self._restrided(gm, key, stable_pos, light)
        if found is not None:
            self.shared += 1
            return found, key, False
        if key is not None and light:
            key = (*key, LIGHT_PIECE_BACKEND)
        t0 = time.perf_counter()
        piece = CompiledPiece((compile_light if light else self.compile_fn)(gm, args),
                              [a.stride() if isinstance(a, torch.Tensor) else None
                               for a in args])
        self.compile_s += time.perf_counter() - t0
        self.compiles += 1
        self.light += light
        if key is not None:
            self.compiled[key] = piece
            self.loose.setdefault(loose_key(key, stable_pos)[0], (piece, key))
        return piece, key, True

    def _restrided(self, gm: fx.GraphModule, key: tuple[Any, ...], stable_pos: Sequence[int],
                   light: bool) -> tuple[RestridedPiece | None, tuple[Any, ...]]:
        """A compiled piece of this code and these inputs but for the strides of non-weights,
        behind copies into its layout (a full compile first; a light one only for a light
        piece), kept under this exact key; or None."""
        for k in ((key, (*key, LIGHT_PIECE_BACKEND)) if light else (key,)):
            lk, free = loose_key(k, stable_pos)
            hit = self.loose.get(lk)
            if hit is None:
                continue
            inner, inner_key = hit
            copied = differing(k, inner_key, free)
            if not copied or not copy_safe(gm, copied):
                return None, key
            piece = RestridedPiece(inner, inner.runs, [(i, inner.strides[i]) for i in copied])
            self.compiled[k] = piece
            self.restrided += 1
            return piece, k
        return None, key
