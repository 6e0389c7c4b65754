"""The attention mask inside a piecewise graph: none where eager passes none, and one additive
mask per split graph, not one per attention op, where a boolean mask remains.

**No mask where eager has none (torch < 2.14).** Eager transformers decoding skips the causal
mask (a query of one token attends to every cached key: ``attn_mask=None``,
``masking_utils._ignore_causal_mask_sdpa``). Under ``torch.compile`` it skips it too, unless
``torch.compiler.is_exporting()`` answers True: and dynamo before torch 2.14 folds that call to
the constant True in every trace, export or not (its ``tracing_state_functions`` table; fixed by
pytorch#176499, which transformers names). So on torch 2.11 (the H200's) the GPT-2 stack's graph
built the causal mask as a boolean tensor (``arange(L) <= position``, 8 ops between the pieces)
and handed it to all 12 SDPAs, which eager's attention never sees. While a piecewise group's
compiled function runs (``compiling_not_exporting``), that table entry reads False: what
``is_exporting()`` returns outside an export, and what torch 2.14's dynamo reads there (the real
flag). Never inside a real export (``torch.compiler.is_exporting()`` called outside a trace
reads the flag torch.export sets). Nothing else in the table changes, the entry is put back once
the last call in flight ends (nested calls and other threads' calls counted), and on torch 2.14
and later, or where the table is not found, nothing is touched. A transformers whose skip
declines whenever it traces (5.17, the H200's; the skip under compile came with
transformers#48975) builds the mask anyway: the shared conversion below is what applies there.
One limit: the table is the process's, so a ``torch.export`` traced in another thread *while* a
piecewise call runs would read False.

**One additive mask, not one per attention.** Where a boolean mask remains (a padding mask:
``generate()`` of a left-padded batch; any model that builds its own), SDPA converts it to an
additive one on every call (ATen's ``convert_boolean_attn_mask``: a ``where`` over its
inverse and scalar tensors, in the query's dtype), and CUDA's memory-efficient kernel then
pads a mask whose rows are not aligned (``preprocess_mask`` -> ``pad_bias``: a new tensor and a
copy) on every call: some six more ATen ops and kernel launches per layer than eager's
attention. ``share_masks`` (run by surgery.runtime.piecewise_split on each graph dynamo hands
over, before the split) converts it once a call, before the first attention, into rows padded
to a multiple of ``ALIGN`` elements, and every SDPA that read the boolean mask reads that one.

Exactly the same values. The float mask holds 0 where the boolean one is True and -inf where it
is False, in the query's dtype: what ``convert_boolean_attn_mask`` computes, so every backend
adds the same bias (fully masked rows included). The one backend that converts differently is
cuDNN's, which writes a finite -65504 instead of -inf (``convert_boolean_attn_mask_cudnn``; a
fully masked row then attends uniformly instead of giving 0). cuDNN attention takes only half
precision, so the boolean mask is kept, per call, whenever cuDNN could be chosen: a CUDA mask
with a half-precision query (or CUDA autocast on) while ``cudnn_sdp_enabled()``; the graph then
runs as it did before this pass. The shape is the boolean mask's (broadcast dims filled); only
the strides differ, which no backend reads as values.

Which masks. A graph input or op result of dtype bool with a dynamic size (the cache length: so
the conversion runs between pieces, never inside a captured one), read as ``attn_mask`` by at
least two SDPAs whose queries have one dtype. A mask that one attention reads gains only the
pad, and is left alone. Memory: one float mask held for the graph's run (a row of the cache
length per query and batch row) instead of one per attention in turn.

``SHARE_MASKS`` and ``NOT_EXPORTING`` (True) turn each part off, for an A/B in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

try:  # private: what dynamo folds tracing-state calls to (torch 2.11-2.13 need the fix)
    from torch._dynamo.variables.torch import tracing_state_functions as _tracing_state_functions
except ImportError:  # another layout: nothing is changed
    _tracing_state_functions = None  # type: ignore[assignment]

# Elements a row of the float mask is padded to: 16 fp32 elements are 64 bytes, a multiple of
# what CUDA's memory-efficient attention asks of a bias's strides (ATen's ``aligned_tensor``).
ALIGN = 16
# The SDPA function dynamo records (``torch.nn.functional.scaled_dot_product_attention``).
_SDPA = torch._C._nn.scaled_dot_product_attention
_MASK_POS = 3  # attn_mask's position among SDPA's arguments
# Whether split graphs share one additive mask (False: each SDPA converts its boolean mask).
SHARE_MASKS = True
# Whether piecewise calls trace ``torch.compiler.is_exporting()`` as False on torch < 2.14.
NOT_EXPORTING = True
# The first torch whose dynamo reads the real export flag under torch.compile (pytorch#176499).
_FIXED_IN = (2, 14)
_UNKNOWN: Any = object()
_table: Any = _UNKNOWN  # dynamo's tracing-state table where it needs the fix, else None
_HALF = frozenset({torch.float16, torch.bfloat16})


def exporting_table() -> dict[Any, Any] | None:
    """Dynamo's table of what tracing-state calls fold to, where it folds ``is_exporting()`` to
    True under torch.compile (torch < 2.14); None where nothing needs changing or it is not
    found (a private API: looked up once)."""
    global _table
    if _table is _UNKNOWN:
        _table = None
        if torch.__version__ < _FIXED_IN:  # type: ignore[operator]  # a TorchVersion does
            try:
                table = _tracing_state_functions() if _tracing_state_functions else None
            except Exception:  # not this torch's layout: leave dynamo alone
                table = None
            if isinstance(table, dict) and table.get(torch.compiler.is_exporting) is True:
                _table = table
    return _table if NOT_EXPORTING else None


def compiling_not_exporting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with dynamo tracing ``torch.compiler.is_exporting()`` as False
    (torch < 2.14; see the module docstring), the table entry put back after.

    The table is the process's, so the calls in flight are counted under a lock: the first one
    in saves the entry, the last one out puts it back. (Each call saving and restoring its own
    view would leave it False for good when two threads' calls overlap and end in the order
    they began.)"""
    table = exporting_table()
    if table is None or torch.compiler.is_exporting():  # a real export: its answer stands
        return fn(*args, **kwargs)
    _enter(table)
    try:
        return fn(*args, **kwargs)
    finally:
        _leave(table)


_lock = threading.Lock()
_in_flight = 0  # piecewise calls running with the entry flipped (any thread, nested)
_saved: Any = None  # the entry as the first of them found it


def _enter(table: dict[Any, Any]) -> None:
    global _in_flight, _saved
    with _lock:
        if _in_flight == 0:
            _saved = table[torch.compiler.is_exporting]
            table[torch.compiler.is_exporting] = False
        _in_flight += 1


def _leave(table: dict[Any, Any]) -> None:
    global _in_flight
    with _lock:
        _in_flight -= 1
        if _in_flight == 0:
            table[torch.compiler.is_exporting] = _saved


def _cudnn_may_convert(mask: torch.Tensor, dtype: torch.dtype) -> bool:
    """Could SDPA pick cuDNN (whose boolean conversion differs) for a query of ``dtype``?"""
    if mask.device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    return dtype in _HALF or torch.is_autocast_enabled("cuda")


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float mask SDPA would make of boolean ``mask`` for a query of ``dtype`` (0 where
    True, -inf where False), its rows padded to ``ALIGN`` elements; ``mask`` itself where cuDNN
    could convert it differently (see the module docstring)."""
    if _cudnn_may_convert(mask, dtype):
        return mask
    n = mask.shape[-1]
    full = mask.new_zeros((*mask.shape[:-1], n + (-n) % ALIGN), dtype=dtype)
    out = full[..., :n]
    out.masked_fill_(mask.logical_not(), float("-inf"))
    return out


def _symbolic_bool(node: Any) -> bool:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and any(
        isinstance(s, torch.SymInt) for s in value.shape)


def _mask_of(node: fx.Node) -> Any:
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"]
    return node.args[_MASK_POS] if len(node.args) > _MASK_POS else None


def _set_mask(node: fx.Node, value: fx.Node) -> None:
    if "attn_mask" in node.kwargs:
        node.update_kwarg("attn_mask", value)
    else:
        node.update_arg(_MASK_POS, value)


def _query_dtype(node: fx.Node) -> torch.dtype | None:
    q = node.args[0] if node.args else node.kwargs.get("query")
    value = q.meta.get("example_value") if isinstance(q, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) and value.is_floating_point() else None


def share_masks(gm: fx.GraphModule) -> int:
    """Give the SDPAs that read one dynamic boolean mask one additive mask, converted once
    before the first of them (see the module docstring); returns how many SDPAs now read a
    shared mask (0: the graph is unchanged)."""
    if not SHARE_MASKS:
        return 0
    users: dict[tuple[fx.Node, torch.dtype], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask, dtype = _mask_of(node), _query_dtype(node)
        if dtype is not None and _symbolic_bool(mask):
            users.setdefault((mask, dtype), []).append(node)
    shared = 0
    for (mask, dtype), nodes in users.items():
        if len(nodes) < 2:
            continue
        with gm.graph.inserting_before(nodes[0]):
            float_mask = gm.graph.call_function(additive_mask, (mask, dtype))
        for node in nodes:
            _set_mask(node, float_mask)
        shared += len(nodes)
    if shared:
        gm.graph.lint()
        gm.recompile()
    return shared
