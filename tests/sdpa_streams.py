"""A helper shared by the cuda tests of the tiny SDPA example's piecewise plans."""

from __future__ import annotations

from typing import Any

import torch


def stream_against_eager(model: Any, ref: Any, frames: int = 20) -> None:
    """Stream `frames` frames through the deployed `model` and its eager twin `ref` under bf16
    autocast on CUDA: every output, and at the end the camera trunk's cache, within bf16
    tolerance of eager's."""
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for s in range(frames):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k].float(), want[k].float(), rtol=2e-2,
                                           atol=2e-2)
    for mine, theirs in zip(model.camera_head.kv_cache, ref.camera_head.kv_cache, strict=True):
        torch.testing.assert_close(torch.stack(mine).float(), torch.stack(theirs).float(),
                                   rtol=2e-2, atol=2e-2)
