"""The SDPA build of the example model: LingBot-Map's GCTStream laid out as its SDPA variant."""

from __future__ import annotations

import pytest
import torch

from surgery.examples import lingbot_sdpa, stream_step, tiny_sdpa
from surgery.examples.sdpa import LINGBOT_SDPA, Rope2D, RopeBlock


def test_streams_depth_and_pose_and_grows_its_caches() -> None:
    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    cfg = model.config
    outs = [stream_step(model) for _ in range(cfg.window + 2)]
    assert outs[0]["depth"].shape == (1, 2, cfg.height, cfg.width)
    assert outs[0]["pose"].shape == (1, 9)
    assert len(model.aggregator.global_blocks[0].attn.kv_cache) == cfg.window
    assert [len(s) for s in model.camera_head.kv_cache] == [cfg.window + 2] * cfg.camera_depth
    x = model.example_input(seed=99)
    with torch.no_grad():
        late = model(x)["pose"]
        model.reset_stream()
        alone = model(x)["pose"]
    assert not torch.allclose(late, alone)  # the caches carry earlier frames


def test_global_blocks_are_plain_and_share_one_rope() -> None:
    model = tiny_sdpa()
    agg = model.aggregator
    for blk in agg.global_blocks:
        assert isinstance(blk, RopeBlock)
        assert not hasattr(blk, "attn_pre") and not hasattr(blk, "ffn_residual")
        assert blk.attn.rope is agg.rope
    assert agg.frame_blocks[0].attn.rope is agg.rope
    paths = [p for p, m in model.named_modules() if isinstance(m, Rope2D)]
    assert paths == ["aggregator.rope"]


def test_depth_head_runs_float32_under_bf16_autocast() -> None:
    model = tiny_sdpa().eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(model.example_input())
    assert out["depth"].dtype == torch.float32
    assert out["pose"].dtype == torch.bfloat16


def test_lingbot_sdpa_size_on_meta() -> None:
    with torch.device("meta"):
        model = lingbot_sdpa()
    assert len(model.aggregator.global_blocks) == 24
    assert model.aggregator.global_blocks[0].attn.qkv.weight.shape == (3072, 1024)
    assert LINGBOT_SDPA.tokens == 27 * 37


@pytest.mark.slow
def test_whole_model_compile_matches_eager() -> None:
    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    x = model.example_input()
    with torch.no_grad():
        ref = model(x)
        model.reset_stream()
        got = torch.compile(model, backend="aot_eager")(x)
    torch.testing.assert_close(got["depth"], ref["depth"])
