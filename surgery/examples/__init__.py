"""A built-in example model that mirrors the published LingBot-Map streaming layout.

- ``aggregator.patch_embed``: a ViT whose repeated blocks are ``aggregator.patch_embed.blocks.N``.
- ``aggregator.frame_blocks.N``: transformer blocks over the tokens of one frame.
- ``aggregator.global_blocks.N``: streaming blocks that attend over a KV cache that grows by one
  frame per step. ``attn_pre`` and ``ffn_residual`` are plain methods owning no parameters; their
  shapes are fixed, while the attention over the cache is not.

The KV cache keeps the very tensors that ``attn_pre`` returns (no copy), as streaming models do.
Under CUDA graphs those tensors live in the graph's memory pool and the next replay overwrites
them (pytorch#152887), unless the region's outputs are cloned outside the graph.

``tiny()`` is for tests; ``lingbot()`` is LingBot size (dim 1024, 24 of each block kind,
16 heads, 14-pixel patches) for benchmarks. Both are ``--model`` factories:
``surgery plan --model surgery.examples:tiny``.

The SDPA build (``tiny_sdpa``, ``lingbot_sdpa``; ``surgery.examples.sdpa``) is LingBot-Map's
other layout: plain SDPA streaming blocks, a shared RoPE module, a float32 DPT head and a camera
trunk with its own KV cache. ``stream_step`` streams one frame a call, for ``--input``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Re-exported so that `--model surgery.examples:lingbot_sdpa` and `--input
# surgery.examples:stream_step` name every example from one module.
from surgery.examples.sdpa import PatchEmbed, StreamingExample
from surgery.examples.sdpa import lingbot_sdpa as lingbot_sdpa
from surgery.examples.sdpa import stream_step as stream_step
from surgery.examples.sdpa import tiny_sdpa as tiny_sdpa


@dataclass(frozen=True)
class ExampleConfig:
    dim: int = 32
    depth: int = 2  # blocks of each kind
    heads: int = 2
    patch: int = 14
    height: int = 28
    width: int = 42
    mlp_ratio: int = 4
    window: int = 4  # frames the KV cache keeps (a sliding window, as streaming models do)

    @property
    def tokens(self) -> int:
        return (self.height // self.patch) * (self.width // self.patch)


TINY = ExampleConfig()
LINGBOT = ExampleConfig(dim=1024, depth=24, heads=16, patch=14, height=378, width=518)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """QKV projection split into heads: (q, k, v), each (B, H, N, D)."""
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]

    @staticmethod
    def merge_heads(o: torch.Tensor) -> torch.Tensor:
        b, h, n, d = o.shape
        return o.transpose(1, 2).reshape(b, n, h * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(x)
        return self.proj(self.merge_heads(F.scaled_dot_product_attention(q, k, v)))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block over a fixed number of tokens (frame and patch-embed)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GlobalBlock(nn.Module):
    """A streaming block: attention over every frame seen so far, through a growing KV cache.

    ``attn_pre`` and ``ffn_residual`` are fixed-shape methods; the attention between them is not
    (the cache grows each step), so the block as a whole is not a good compile region.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: int, window: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)
        self.window = window
        # Streaming state: one (k, v) pair per frame. Not a buffer, so not in the state dict.
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attn_pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm and QKV projection, split into heads: (q, k, v), each (B, H, N, D)."""
        return self.attn.split_heads(self.norm1(x))

    def ffn_residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The attention residual, then the MLP residual."""
        x = x + attn_out
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn_pre(x)
        # The cache keeps the region's outputs themselves, as streaming models do.
        self.kv_cache.append((k, v))
        if len(self.kv_cache) > self.window:
            self.kv_cache.pop(0)
        keys = torch.cat([kv[0] for kv in self.kv_cache], dim=2)
        values = torch.cat([kv[1] for kv in self.kv_cache], dim=2)
        o = F.scaled_dot_product_attention(q, keys, values)
        o = self.attn.proj(self.attn.merge_heads(o))
        return self.ffn_residual(x, o)


class Aggregator(nn.Module):
    def __init__(self, cfg: ExampleConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg, block=Block)
        self.frame_blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.mlp_ratio)
                                          for _ in range(cfg.depth))
        self.global_blocks = nn.ModuleList(
            GlobalBlock(cfg.dim, cfg.heads, cfg.mlp_ratio, cfg.window) for _ in range(cfg.depth))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        for frame, glob in zip(self.frame_blocks, self.global_blocks, strict=True):
            x = glob(frame(x))
        return x


class ExampleModel(StreamingExample):
    """LingBot-Map-shaped streaming model: one frame in, one set of per-token features out."""

    def __init__(self, cfg: ExampleConfig = TINY) -> None:
        super().__init__()
        self.config = cfg
        self.aggregator = Aggregator(cfg)
        self.head = nn.Linear(cfg.dim, 8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.aggregator(images))

    def reset_stream(self) -> None:
        """Forget every cached frame (start a new sequence)."""
        for blk in self.aggregator.global_blocks:
            assert isinstance(blk, GlobalBlock)
            blk.kv_cache.clear()


def tiny() -> ExampleModel:
    """The example model at test size (dim 32, 2 blocks of each kind)."""
    return ExampleModel(TINY)


def lingbot() -> ExampleModel:
    """The example model at LingBot size (dim 1024, 24 blocks of each kind, 16 heads)."""
    return ExampleModel(LINGBOT)


def example_input(model: ExampleModel) -> torch.Tensor:
    """An example-input factory for `surgery warm` and benchmarks."""
    return model.example_input()
