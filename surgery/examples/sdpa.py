"""The example model's SDPA build: LingBot-Map's `GCTStream` as its SDPA variant is laid out.

What makes it hard for a planner that goes by names, and why each part is here:

- ``aggregator.global_blocks.N`` are plain SDPA blocks: no ``attn_pre``/``ffn_residual``
  methods. Their attention keeps a KV cache (``attn.kv_cache``, a sliding window of frames) as
  Python state, so a block is not a function of its inputs; its fixed-shape parts (``norm1``,
  ``attn.qkv``, the q/k norms, the RoPE of the new frame, ``attn.proj``, ``norm2``, ``mlp``)
  are plain submodules that only a run shows to be fixed.
- ``aggregator.rope`` is one 2D rotary module shared by every attention (frame and global),
  called inside attention, as VGGT/LingBot do. It owns no tensors, so a checkpoint cannot show it.
- ``depth_head`` is a DPT-like convolutional head that upsamples to full resolution and runs in
  float32 under ``torch.autocast(device_type, enabled=False)``.
- ``camera_head`` has a trunk of blocks attending over its own growing KV cache; each block is
  called with the cache and an int ``global_idx`` naming its slot in it.

``tiny_sdpa()`` is test size, ``lingbot_sdpa()`` LingBot size (dim 1024, 24 blocks of each kind,
378x518 frames). ``stream_step(model)`` is an ``--input``/``warmup=`` driver: each call streams
the next frame.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SdpaConfig:
    dim: int = 32
    depth: int = 2  # blocks of each kind
    heads: int = 2
    patch: int = 14
    height: int = 28
    width: int = 42
    mlp_ratio: int = 4
    window: int = 4  # frames the global blocks' KV cache keeps
    head_features: int = 16  # channels of the depth head
    camera_depth: int = 2  # blocks of the camera trunk
    camera_window: int = 16  # frames the camera trunk's KV cache keeps

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // self.patch, self.width // self.patch

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]


TINY_SDPA = SdpaConfig()
LINGBOT_SDPA = SdpaConfig(dim=1024, depth=24, heads=16, height=378, width=518, head_features=128,
                          camera_depth=4)


class Rope2D(nn.Module):
    """2D rotary position embedding: half of each head's channels rotate by row, half by column.

    It owns no tensors and is shared: every attention module holds the same instance.
    """

    def __init__(self, base: float = 100.0) -> None:
        super().__init__()
        self.base = base

    def _rotate(self, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        n = t.shape[-1] // 2
        inv = self.base ** (-torch.arange(n, device=t.device, dtype=torch.float32) / n)
        angle = pos[:, None, :, None].float() * inv  # (B, 1, N, n)
        cos, sin = angle.cos().to(t.dtype), angle.sin().to(t.dtype)
        a, b = t[..., :n], t[..., n:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``t`` (B, H, N, D), ``pos`` (B, N, 2) integer (row, column) of each token."""
        d = t.shape[-1] // 2
        return torch.cat([self._rotate(t[..., :d], pos[..., 0]),
                          self._rotate(t[..., d:], pos[..., 1])], dim=-1)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, out: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim if out is None else out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class RopeAttention(nn.Module):
    """QKV, q/k norms, the shared RoPE, SDPA, projection."""

    def __init__(self, dim: int, heads: int, rope: Rope2D) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.LayerNorm(dim // heads)
        self.k_norm = nn.LayerNorm(dim // heads)
        self.rope = rope
        self.proj = nn.Linear(dim, dim)

    def qkv_heads(self, x: torch.Tensor, pos: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(qkv[0]), self.k_norm(qkv[1])
        return self.rope(q, pos), self.rope(k, pos), qkv[2]

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, h, n, d = o.shape
        return self.proj(o.transpose(1, 2).reshape(b, n, h * d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_heads(x, pos)
        return self.out(F.scaled_dot_product_attention(q, k, v))


class StreamingAttention(RopeAttention):
    """Attention of the new frame's tokens over every frame in the window (a KV cache)."""

    def __init__(self, dim: int, heads: int, rope: Rope2D, window: int) -> None:
        super().__init__(dim, heads, rope)
        self.window = window
        # Streaming state: one (k, v) per frame, as Python state (not in the state dict).
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_heads(x, pos)
        self.kv_cache.append((k, v))
        if len(self.kv_cache) > self.window:
            self.kv_cache.pop(0)
        keys = torch.cat([kv[0] for kv in self.kv_cache], dim=2)
        values = torch.cat([kv[1] for kv in self.kv_cache], dim=2)
        return self.out(F.scaled_dot_product_attention(q, keys, values))


class RopeBlock(nn.Module):
    """A plain pre-norm block; with ``window`` set, its attention streams over a KV cache."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, rope: Rope2D,
                 window: int | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = (RopeAttention(dim, heads, rope) if window is None
                     else StreamingAttention(dim, heads, rope, window))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), pos)
        return x + self.mlp(self.norm2(x))


class StreamingExample(nn.Module):
    """What both example builds share: a config that sizes the frame, and an example frame."""

    config: Any

    def example_input(self, *, batch: int = 1, seed: int = 0) -> torch.Tensor:
        """One random frame, on the model's device and dtype."""
        p = next(self.parameters())
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, 3, self.config.height, self.config.width, generator=g)
        return x.to(device=p.device, dtype=p.dtype)


class _AttnMlpBlock(nn.Module):
    """The layers VitBlock and CameraBlock share: pre-norm attention (qkv, proj), then an MLP.
    Each defines its own forward (the camera block's attends over a cache)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """(3, B, heads, N, head_dim): q, k and v of the normed tokens."""
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads)
        return qkv.permute(2, 0, 3, 1, 4)

    def _out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual after attention output ``o`` (B, heads, N, head_dim), then the MLP."""
        x = x + self.proj(o.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.norm2(x))


class VitBlock(_AttnMlpBlock):
    """A patch-embed (DINO-like) block: no RoPE, learned position embedding upstream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        return self._out(x, F.scaled_dot_product_attention(q, k, v))


class PatchEmbed(nn.Module):
    """A small ViT: conv patchify, then repeated blocks (``block``, VitBlock by default; the
    method build in surgery.examples passes its own), then a norm."""

    def __init__(self, cfg: Any, block: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.tokens, cfg.dim))
        self.blocks = nn.ModuleList((block or VitBlock)(cfg.dim, cfg.heads, cfg.mlp_ratio)
                                    for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class SdpaAggregator(nn.Module):
    """Patch embed, then frame and global blocks alternating; returns 4 intermediate outputs."""

    def __init__(self, cfg: SdpaConfig) -> None:
        super().__init__()
        self.grid = cfg.grid
        self.rope = Rope2D()  # registered first, so its path is `aggregator.rope`
        self.patch_embed = PatchEmbed(cfg)
        self.frame_blocks = nn.ModuleList(
            RopeBlock(cfg.dim, cfg.heads, cfg.mlp_ratio, self.rope) for _ in range(cfg.depth))
        self.global_blocks = nn.ModuleList(
            RopeBlock(cfg.dim, cfg.heads, cfg.mlp_ratio, self.rope, window=cfg.window)
            for _ in range(cfg.depth))
        d = cfg.depth
        self.taps = [d // 4, d // 2, 3 * d // 4, d - 1]  # the blocks whose outputs heads read

    def positions(self, b: int, device: torch.device) -> torch.Tensor:
        h, w = self.grid
        rows = torch.arange(h, device=device).repeat_interleave(w)
        cols = torch.arange(w, device=device).repeat(h)
        return torch.stack([rows, cols], dim=-1)[None].expand(b, -1, -1)

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        x = self.patch_embed(images)
        pos = self.positions(x.shape[0], x.device)
        outs = []
        for frame, glob in zip(self.frame_blocks, self.global_blocks, strict=True):
            x = glob(frame(x, pos), pos)
            outs.append(x)
        return [outs[i] for i in self.taps]


class FusionBlock(nn.Module):
    """DPT's feature fusion: residual conv units, then 2x bilinear upsampling."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.res1 = nn.Sequential(nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(ch, ch, 3, padding=1))
        self.res2 = nn.Sequential(nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(ch, ch, 3, padding=1))
        self.out = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if skip is not None:
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=True)
            x = x + skip + self.res1(skip)
        x = x + self.res2(x)
        return self.out(F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True))


class DptHead(nn.Module):
    """Depth and confidence at full resolution from 4 token maps, in float32 (autocast off)."""

    def __init__(self, cfg: SdpaConfig) -> None:
        super().__init__()
        f = cfg.head_features
        self.grid, self.size = cfg.grid, (cfg.height, cfg.width)
        self.norm = nn.LayerNorm(cfg.dim)
        self.projects = nn.ModuleList(nn.Conv2d(cfg.dim, f, 1) for _ in range(4))
        self.resize = nn.ModuleList([nn.ConvTranspose2d(f, f, 4, stride=4),
                                     nn.ConvTranspose2d(f, f, 2, stride=2), nn.Identity(),
                                     nn.Conv2d(f, f, 3, stride=2, padding=1)])
        self.fusion = nn.ModuleList(FusionBlock(f) for _ in range(4))
        self.out = nn.Sequential(nn.Conv2d(f, f // 2, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(f // 2, 2, 1))

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        h, w = self.grid
        with torch.autocast(device_type=feats[0].device.type, enabled=False):
            maps = []
            for x, proj, resize in zip(feats, self.projects, self.resize, strict=True):
                x = self.norm(x.float()).transpose(1, 2).reshape(x.shape[0], -1, h, w)
                maps.append(resize(proj(x)))
            y = self.fusion[3](maps[3])
            for i in (2, 1, 0):
                y = self.fusion[i](y, maps[i])
            y = F.interpolate(y, size=self.size, mode="bilinear", align_corners=True)
            return self.out(y)


class CameraBlock(_AttnMlpBlock):
    """A trunk block: the frame's camera tokens attend over those of earlier frames.

    ``cache[global_idx]`` is this block's slot in the trunk's KV cache, which grows each frame.
    """

    def forward(self, x: torch.Tensor, cache: list[list[torch.Tensor]], global_idx: int,
                window: int) -> torch.Tensor:
        q, k, v = self._qkv(x)
        slot = cache[global_idx]
        slot.append(torch.stack([k, v]))
        if len(slot) > window:
            slot.pop(0)
        kv = torch.cat(slot, dim=3)
        return self._out(x, F.scaled_dot_product_attention(q, kv[0], kv[1]))


class CameraHead(nn.Module):
    """Pose from the last token map: a streaming trunk, then a fixed-shape pose branch."""

    def __init__(self, cfg: SdpaConfig) -> None:
        super().__init__()
        self.window = cfg.camera_window
        self.norm = nn.LayerNorm(cfg.dim)
        self.trunk = nn.ModuleList(CameraBlock(cfg.dim, cfg.heads, cfg.mlp_ratio)
                                   for _ in range(cfg.camera_depth))
        self.pose_branch = Mlp(cfg.dim, cfg.dim // 2, out=9)
        self.kv_cache: list[list[torch.Tensor]] = [[] for _ in range(cfg.camera_depth)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for i, blk in enumerate(self.trunk):
            x = blk(x, self.kv_cache, global_idx=i, window=self.window)
        return self.pose_branch(x.mean(dim=1))


class SdpaExampleModel(StreamingExample):
    """One frame in; depth (B, 2, H, W) and pose (B, 9) out, streaming over earlier frames."""

    def __init__(self, cfg: SdpaConfig = TINY_SDPA) -> None:
        super().__init__()
        self.config = cfg
        self.aggregator = SdpaAggregator(cfg)
        self.depth_head = DptHead(cfg)
        self.camera_head = CameraHead(cfg)
        self.frames_seen = 0

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        feats = self.aggregator(images)
        self.frames_seen += 1
        return {"depth": self.depth_head(feats), "pose": self.camera_head(feats[-1])}

    def reset_stream(self) -> None:
        """Forget every cached frame (start a new sequence)."""
        for blk in self.aggregator.global_blocks:
            assert isinstance(blk, RopeBlock) and isinstance(blk.attn, StreamingAttention)
            blk.attn.kv_cache.clear()
        for slot in self.camera_head.kv_cache:
            slot.clear()
        self.frames_seen = 0


def tiny_sdpa() -> SdpaExampleModel:
    """The SDPA build at test size (dim 32, 2 blocks of each kind, 2 camera blocks)."""
    return SdpaExampleModel(TINY_SDPA)


def lingbot_sdpa() -> SdpaExampleModel:
    """The SDPA build at LingBot size (dim 1024, 24 blocks of each kind, 378x518 frames)."""
    return SdpaExampleModel(LINGBOT_SDPA)


def stream_step(model: Any) -> Any:
    """An ``--input``/``warmup=`` driver: stream the model's next frame (one step a call).

    Works for either example build; the frame's pixels differ per step, its shape does not.
    """
    with torch.no_grad():
        return model(model.example_input(seed=next(_FRAME_SEEDS)))


_FRAME_SEEDS = itertools.count()
