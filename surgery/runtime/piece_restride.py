"""A piece shared across the strides of its inputs: the input is copied into the layout the
compiled piece was built for, instead of the piece compiling again.

Why. Inductor specializes a static graph to its inputs' strides, so the piece key
(surgery.runtime.piece_cache) holds them, and two pieces of the same code whose inputs differ
only in strides compile twice. In the SDPA example this is the camera trunk's piece after
attention and the global blocks' (the projection, residual, norm and MLP: the same ops on the
same shapes): the attention output arrives contiguous from a global block (q is a fresh tensor
after RoPE) and as a permuted view from the trunk (q is a view of the fused qkv, and the
attention kernels lay their output out like q, on the CPU and in CUDA's flash and efficient
kernels alike). That was one more inductor compile of the plan's largest piece after
attention, which the names-only plan does not pay (it compiles the trunk's MLP only).

What it does. When a piece's key misses, the cache looks for a compiled piece whose key is the
same but for the strides (and 16-byte alignment) of inputs that are *not* the block's
parameters or buffers: a *loose key*. If one exists and the copy is safe (below), the piece
takes that callable behind a ``RestridedPiece``: each call copies the inputs whose layout
differs into a fresh tensor of the compiled layout (``empty_strided`` + ``copy_``), then runs
the compiled code. Under region capture the copy is a kernel inside the piece's CUDA graph (one
read and one write of that input, about 2 MB for the trunk's attention output at LingBot size);
without capture it is one eager copy a call. The values are the compiled code's on the same
values, so outputs agree with eager as the compiled piece's do.

When the copy is not safe, the piece compiles on its own, as before:

- the piece writes a tensor in place (an ``add_``, ``setitem``, an ``out=``): a write to the
  copy would not reach the caller's tensor;
- a piece output may be a view of an input that would be copied (reached from it through view
  ops only): the caller would get a view of the copy, not of its own tensor;
- a parameter or buffer differs in layout: they are read in place (their addresses are baked
  into the region graphs), so their strides stay part of the loose key.

What it does not do. It never changes a shape, dtype, device or value, never shares between
a light and a full compile in a way the exact key would refuse (a full piece never takes a
light compile), and it adds no key to an exact match: identical pieces still share as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

# Positions of a key's layout tuple (piece_cache._layout): type, shape, strides, dtype, device,
# requires_grad, aligned. The loose key drops the strides and the alignment of copied inputs.
_STRIDE, _ALIGNED = 2, 6
# Ops whose result may share its input's storage: an output reached from an input through
# these alone may be a view of it (``reshape`` and ``contiguous`` may return the input itself).
_VIEW_OPS = frozenset({
    "getitem", "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand",
    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "contiguous", "t", "T", "mT",
    "narrow", "select", "split", "chunk", "unbind", "detach", "alias", "movedim", "moveaxis",
    "swapaxes", "swapdims", "as_strided", "diagonal", "unfold", "real", "imag", "view_as_real",
    "view_as_complex", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit",
    # conversions that return the input itself when it already has the asked type
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool",
    "cpu", "cuda"})
# In-place operators of Python's ``operator`` module as dynamo writes them.
_INPLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def _op(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else (getattr(t, "__name__", "") or str(t)).split(".")[-1]


def _writes_in_place(node: fx.Node) -> bool:
    if node.target in _INPLACE_OPERATORS or "out" in node.kwargs:
        return True
    name = _op(node)
    return name.endswith("_") and not name.endswith("__")


def copy_safe(gm: fx.GraphModule, positions: Sequence[int]) -> bool:
    """Whether the inputs at ``positions`` may be given to the piece as copies: the piece
    writes nothing in place, and no output may be a view of one of them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    views = {placeholders[i] for i in positions if i < len(placeholders)}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            if node.op == "call_module" or _writes_in_place(node):
                return False
            if _op(node) in _VIEW_OPS and node.args and node.args[0] in views:
                views.add(node)
        elif node.op == "output":
            returned: list[Any] = []
            fx.node.map_arg(node.args, returned.append)
            if any(n in views for n in returned):
                return False
    return True


def loose_key(key: tuple[Any, ...], stable_pos: Sequence[int]) -> tuple[Any, tuple[int, ...]]:
    """The key without the strides and alignment of the tensor inputs that are not parameters
    or buffers, and the positions of those inputs."""
    code, layouts, stable, state = key[:4]
    keep = set(stable_pos)
    loose, free = [], []
    for i, lay in enumerate(layouts):
        if i in keep or len(lay) <= _ALIGNED:  # a weight, or a Python scalar
            loose.append(lay)
            continue
        free.append(i)
        loose.append((*lay[:_STRIDE], None, *lay[_STRIDE + 1:_ALIGNED], None))
    return (code, tuple(loose), stable, state, *key[4:]), tuple(free)


def differing(key: tuple[Any, ...], other: tuple[Any, ...], positions: Sequence[int]
              ) -> list[int]:
    """Of ``positions``, those whose layout (strides or alignment) differs between two keys."""
    return [i for i in positions if key[1][i] != other[1][i]]


class RestridedPiece:
    """A compiled piece called with some inputs copied into the layout it was compiled for.

    ``targets``: (position, strides) of each input to copy. Duck-types piece_cache's
    CompiledPiece (``fn``, ``runs``, calling it); ``runs`` starts at the compiled piece's, so a
    path whose piece it is captures at its first call when the compiled code already ran.
    """

    def __init__(self, inner: Callable[..., Any], runs: int,
                 targets: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        self.inner = inner
        self.targets = tuple(targets)
        self.runs = runs
        self.fn = self._call

    def _call(self, *args: Any) -> Any:
        given = list(args)
        for i, stride in self.targets:
            a = given[i]
            copy = torch.empty_strided(a.shape, stride, dtype=a.dtype, device=a.device)
            given[i] = copy.copy_(a)
        return self.inner(*given)

    def __call__(self, *args: Any) -> Any:
        out = self._call(*args)
        self.runs += 1
        return out
