"""Which blocks cannot hold one shape, and which cannot pay for a region. Pure: no torch.

A region pays when its compiled graph replaces enough launches to cover its own, and it holds
when every call sees the shapes and constants it was compiled for. Two kinds of block break that,
and both were proposed by the planner on LingBot-Map's real camera and depth heads (issue 11):

- **Streaming blocks** carry state across steps. Attention over a growing KV cache changes shape
  every step, and an integer index that differs per block instance (``global_idx == 3``) is a
  constant dynamo specializes on. Either way every call recompiles, until the recompile limit
  fails the step. The signs, strongest first:
  - LingBot's region methods (``attn_pre``, ``ffn_residual``) on the class (live models);
  - a ``forward`` argument named as a cache or state (``kv_cache``, ``past_key_values``,
    ``cache``, ``state`` ...) or as a per-instance index (``global_idx``, ``layer_idx`` ...),
    read with inspect.signature on the live model. An optional cache (``cache=None``) counts
    unless the model says it never generates (:attr:`ModelView.optional_cache_streams`); an
    index annotated as a tensor is data, not an index;
  - the container's name (``global_blocks``), the only sign a checkpoint shows.
- **Single layers**: a block that is one ``Conv2d``, ``ConvTranspose2d``, ``Linear`` or norm (one
  module owning tensors) is one op; as a region it gains nothing and costs a graph launch. So is
  a module owning exactly one tensor and nothing else: LayerScale (``ls1``, ``ls2``: one multiply
  by a learned vector). On a real streaming model 56 of a names-only plan's 160 region paths
  were LayerScales; leaving them out made it 8% faster and 1.7 GiB lighter (issue 18).

Streaming blocks are left out with the reason. Where the state comes in through ``forward``, their
fixed-shape parts (children that take no cache and are more than one layer) are planned instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from surgery.formats.manifest import Manifest
from surgery.planning.view import ForwardArg, ModelView

# Containers whose blocks stream over a growing KV cache (LingBot-Map's `global_blocks`). A
# checkpoint cannot show the cache, so the name is the only sign there.
STREAMING_CONTAINERS: tuple[str, ...] = ("global_blocks",)
# Forward arguments that carry state across steps (HF's `cache` / `past_key_values`, LingBot's
# `kv_cache`, Mamba's `inference_params`, Transformer-XL's `mems`).
CACHE_ARGS: frozenset[str] = frozenset({
    "cache", "caches", "kv_cache", "kv_caches", "past_key_values", "past_key_value",
    "layer_past", "past", "state", "states", "inference_params", "cache_params", "mems",
    "memory_state", "recurrent_state", "ssm_state", "conv_state", "cache_position",
})
CACHE_SUFFIXES: tuple[str, ...] = ("_cache", "_caches")
# Forward arguments that number the block instance: each instance passes its own int, and dynamo
# specializes on it (LingBot's camera trunk takes `global_idx`).
INDEX_ARGS: frozenset[str] = frozenset({
    "idx", "index", "global_idx", "layer_idx", "block_idx", "layer_id", "block_id",
    "layer_index", "block_index", "layer_number", "depth_idx",
})
INDEX_SUFFIXES: tuple[str, ...] = ("_idx",)

# What a layer owns. A leaf module owning these and nothing else is one op even when its class is
# not torch.nn's (transformers' GPT-2 `Conv1D` is a Linear with its weight transposed).
LAYER_TENSORS: frozenset[str] = frozenset({"weight", "bias"})

_NAMED_STREAMING = ("streaming block: its attention over a growing KV cache changes shape every "
                    "step; its fixed-shape parts are regions instead")


def is_cache_arg(name: str) -> bool:
    return name in CACHE_ARGS or name.endswith(CACHE_SUFFIXES)


def is_index_arg(arg: ForwardArg) -> bool:
    """An int that numbers the instance; a tensor argument named `index` is data, not that."""
    if not (arg.name in INDEX_ARGS or arg.name.endswith(INDEX_SUFFIXES)):
        return False
    return "Tensor" not in arg.annotation


def stream_reason(view: ModelView, path: str) -> str | None:
    """Why the block at `path` cannot hold one shape across steps, or None when it can."""
    if view.modules[path].methods:
        return _NAMED_STREAMING
    reason = signature_reason(view, path)
    if reason is not None:
        return reason
    seg = path.split(".") if path else []
    if len(seg) >= 2 and seg[-2] in STREAMING_CONTAINERS:
        return _NAMED_STREAMING
    return None


def signature_reason(view: ModelView, path: str) -> str | None:
    """Why the forward arguments of the block at `path` show state or an index, or None."""
    for arg in view.modules[path].forward_args or ():
        if is_cache_arg(arg.name) and (arg.required or view.optional_cache_streams):
            return (f"streaming block: its forward takes {arg.name!r}, state carried across "
                    "steps, so its shapes change every step; its fixed-shape parts are regions "
                    "instead")
        if is_index_arg(arg):
            return (f"its forward takes a per-instance index {arg.name!r}: dynamo specializes "
                    "on the integer, so every block instance recompiles; its fixed-shape parts "
                    "are regions instead")
    return None


def single_layer(view: ModelView, path: str) -> str | None:
    """The class (or "layer") when the block at `path` is one layer, else None.

    One module owning tensors is one op in a checkpoint's view. A live model shows the class: a
    torch.nn layer (Linear, Conv2d, a norm), or any module owning just a weight and a bias, is
    one op, while a model's own leaf module that owns other weights directly (``w1``, ``w2``)
    may be a whole block, and stays one.
    """
    if view.owners(path) != 1:
        return None
    owner = next(p for p in view.subtree(path) if view.modules[p].tensors)
    node = view.modules[owner]
    if len(node.tensors) == 1 and not node.library_layer:
        return f"{node.cls or 'module'} owning one tensor ({next(iter(node.tensors))})"
    if view.live and not node.library_layer and not set(node.tensors) <= LAYER_TENSORS:
        return None
    return node.cls or "layer"


def single_layer_reason(layer: str) -> str:
    """Why a single layer (single_layer's answer) is never a region."""
    return f"a single {layer}: one op gains nothing as a region and costs a graph launch"


def fixed_parts(view: ModelView, path: str,
                skipped: list[tuple[str, str]] | None = None) -> list[str]:
    """The largest parts of streaming block `path` that hold one shape and can pay.

    A child that streams itself (an attention module taking the cache) is searched in turn;
    one that is a single layer or owns no tensors is skipped. This needs the block's state to
    come in through its forward arguments, where a child that does not take them cannot see
    it. A block known to stream only by its name (``global_blocks``) may keep its cache inside
    a child (the SDPA build's attention does), so it gets its attn.proj only, as a checkpoint's.
    """
    if not view.live or signature_reason(view, path) is None:
        return []
    out: list[str] = []
    stack = list(reversed(view.children(path)))
    while stack:
        child = stack.pop()
        if not view.has_tensors(child):
            continue
        layer = single_layer(view, child)
        if layer is not None:
            if skipped is not None:
                skipped.append((child, single_layer_reason(layer)))
            continue
        if stream_reason(view, child) is not None:
            stack.extend(reversed(view.children(child)))
            continue
        out.append(child)
    return out


# Names of a decoder language model's token embedding or output head (GPT-2, Llama, Mistral...).
_DECODER_NAMES = ("lm_head.weight", ".wte.weight", ".embed_tokens.weight", "tok_embeddings.weight")


def decoder_note(manifest: Manifest, tensors: Mapping[str, Any]) -> list[str]:
    """A checkpoint of a decoder LM plans whole layers; its live plan does not: say so."""
    if not any(r.kind == "repeated_block" for r in manifest.regions) or not any(
            k.endswith(_DECODER_NAMES) or k == _DECODER_NAMES[0] for k in tensors):
        return []
    return ["this looks like a decoder language model: a checkpoint shows no forward arguments, "
            "so its layers are planned whole; the live model's layers take the KV cache, and "
            "`surgery plan --model` plans their fixed-shape parts (the MLP, as fixed_part) "
            "instead. Plan the model you deploy with --model (or compile_regions) for that plan"]
