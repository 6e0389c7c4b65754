"""The zoo's models and drivers: real architectures from their own packages, tiny, random weights.

Every factory builds from the package's own config class (nothing is downloaded) and is a
``--model`` factory (``plan_model("zoo_models:timm_vit")``, with tests/ on the path). Every
driver runs a fixed sequence of calls from fixed inputs and returns the outputs to compare, after
putting back any state the model carries (the decoder's KV cache, the example's stream), so that
eager and compiled runs see the same thing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def timm_vit() -> Any:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                             depth=2, num_classes=10)


def hf_vit() -> Any:
    from transformers import ViTConfig, ViTModel

    return ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, image_size=32, patch_size=8))


def hf_bert() -> Any:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64,
                                max_position_embeddings=64))


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


def dit() -> Any:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)


def flux() -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2,
                                  joint_attention_dim=32, pooled_projection_dim=32,
                                  axes_dims_rope=(4, 6, 6))


def sd3() -> Any:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                 attention_head_dim=16, num_attention_heads=2,
                                 joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16)


def example_sdpa() -> Any:
    from surgery.examples import tiny_sdpa

    return tiny_sdpa()


class _InBf16:
    """``zoo_models:bf16.NAME`` builds model NAME cast to bf16, for a manifest planned in bf16."""

    def __getattr__(self, name: str) -> Callable[[], Any]:
        factory = globals()[name]
        return lambda: factory().to(torch.bfloat16)


bf16 = _InBf16()


# --- drivers -----------------------------------------------------------------------------------

def _dtype_of(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype


def _dev(model: Any) -> torch.device:
    return next(model.parameters()).device


def _randn(g: torch.Generator, *shape: int, like: Any) -> torch.Tensor:
    """Random values from the CPU generator (the same on every device), moved to the model."""
    return torch.randn(*shape, generator=g).to(device=_dev(like), dtype=_dtype_of(like))


def _first(y: Any) -> torch.Tensor:
    while isinstance(y, (tuple, list)):
        y = y[0]
    return y


def run_image(model: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = _randn(g, 2, 3, 32, 32, like=model)
    y = model(x)
    return [getattr(y, "last_hidden_state", y)]


def run_text(model: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 12), generator=g).to(_dev(model))
    return [model(input_ids=ids).last_hidden_state]


DECODE_STEPS = 4


def run_decode(model: Any) -> list[torch.Tensor]:
    """A 12-token prefill, then DECODE_STEPS tokens one at a time on the growing KV cache.

    The decoded tokens are fixed (teacher forcing), not the argmax of the logits: in bf16 two
    near-equal logits may swap, and the runs would then compare different sequences.
    """
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1, 12 + DECODE_STEPS), generator=g).to(_dev(model))
    # transformers 5 names the argument and the output field `cache`; earlier releases (the GPU
    # machine's) say `past_key_values`.
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def cache_of(out: Any) -> Any:
        c = getattr(out, "cache", None)
        return out.past_key_values if c is None else c

    out = model(input_ids=ids[:, :12], **{arg: DynamicCache()}, use_cache=True)
    logits = [out.logits]
    for i in range(12, 12 + DECODE_STEPS):
        out = model(input_ids=ids[:, i:i + 1], **{arg: cache_of(out)}, use_cache=True)
        logits.append(out.logits)
    assert cache_of(out).get_seq_length() == 12 + DECODE_STEPS  # the cache really grew
    return logits


GENERATE_TOKENS = 4


def run_generate(model: Any, *, cache: str | None = None) -> list[torch.Tensor]:
    """transformers' own loop: ``generate()`` greedily, GENERATE_TOKENS new tokens after a
    6-token prompt, with its dynamic cache or ``cache_implementation=cache`` ("static")."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1, 6), generator=g).to(_dev(model))
    kw = {} if cache is None else {"cache_implementation": cache}
    out = model.generate(ids, max_new_tokens=GENERATE_TOKENS, do_sample=False, pad_token_id=0,
                         **kw)
    assert out.shape[1] == 6 + GENERATE_TOKENS
    return [out]


def run_generate_static(model: Any) -> list[torch.Tensor]:
    return run_generate(model, cache="static")


def run_dit(model: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lat = _randn(g, 2, 4, 8, 8, like=model)
    t = torch.tensor([3, 7], device=_dev(model))
    cls = torch.tensor([1, 4], device=_dev(model))
    return [model(lat, timestep=t, class_labels=cls, return_dict=False)[0]]


def run_flux(model: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    dt = _dtype_of(model)
    y = model(hidden_states=_randn(g, 1, 16, 16, like=model),
              encoder_hidden_states=_randn(g, 1, 8, 32, like=model),
              pooled_projections=_randn(g, 1, 32, like=model),
              timestep=torch.full((1,), 0.5, dtype=dt, device=_dev(model)),
              img_ids=torch.zeros(16, 3, device=_dev(model)),
              txt_ids=torch.zeros(8, 3, device=_dev(model)), return_dict=False)
    return [_first(y)]


def run_sd3(model: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = model(hidden_states=_randn(g, 1, 4, 8, 8, like=model),
              encoder_hidden_states=_randn(g, 1, 8, 32, like=model),
              pooled_projections=_randn(g, 1, 32, like=model),
              timestep=torch.tensor([500], device=_dev(model)), return_dict=False)
    return [_first(y)]


STREAM_FRAMES = 3


def run_stream(model: Any) -> list[torch.Tensor]:
    """STREAM_FRAMES frames of a new sequence: depth and pose of each."""
    model.reset_stream()
    outs = []
    for i in range(STREAM_FRAMES):
        y = model(model.example_input(seed=i))
        outs += [y["depth"], y["pose"]]
    return outs


@dataclass(frozen=True)
class ZooCase:
    """One architecture: its factory, its driver, and what the plan must show."""

    name: str
    run: Callable[[Any], list[torch.Tensor]]
    kinds: dict[str, int]  # region paths per kind the live plan must have
    streaming: tuple[str, ...] = ()  # left-out paths that must name streaming
    checkpoint_same: bool = True  # a checkpoint plan finds the same regions
    notes: tuple[str, ...] = field(default=())

    @property
    def spec(self) -> str:
        return f"zoo_models:{self.name}"

    def build(self) -> Any:
        return globals()[self.name]()


CASES: dict[str, ZooCase] = {c.name: c for c in (
    ZooCase("timm_vit", run_image, {"repeated_block": 2}),
    ZooCase("hf_vit", run_image, {"repeated_block": 2}),
    # BertLayer.forward takes `cache=None`, but BertModel cannot generate: whole layers.
    ZooCase("hf_bert", run_text, {"repeated_block": 2}),
    # GPT2Block.forward takes the cache: each block streams; its MLP is the fixed-shape part.
    # A checkpoint shows no signatures, so it plans the whole blocks.
    ZooCase("gpt2", run_decode, {"fixed_part": 2}, streaming=("transformer.h.0",),
            checkpoint_same=False),
    ZooCase("dit", run_dit, {"repeated_block": 2}),
    # One joint block (not repeated) and two single blocks.
    ZooCase("flux", run_flux, {"repeated_block": 2}),
    ZooCase("sd3", run_sd3, {"repeated_block": 2}),
    # The SDPA build of the example model: a camera trunk with its own KV cache and an int
    # block index, a float32 (autocast-off) head, a conv head with per-layer widths.
    ZooCase("example_sdpa", run_stream,
            {"frame_block": 2, "patch_embed_block": 2, "attn_proj": 2, "fixed_part": 2,
             "repeated_block": 4},
            streaming=("camera_head.trunk.0", "aggregator.global_blocks.0"),
            checkpoint_same=False),
)}
