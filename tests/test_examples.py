"""The built-in example model mirrors LingBot-Map's streaming layout."""

from __future__ import annotations

import inspect

import torch

from surgery.examples import LINGBOT, GlobalBlock, lingbot, tiny
from surgery.examples.demo import save_hand_compiled_checkpoint


def test_tiny_streams_and_caches_region_outputs() -> None:
    torch.manual_seed(0)
    model = tiny().eval()
    x1, x2 = model.example_input(seed=1), model.example_input(seed=2)
    with torch.no_grad():
        out1 = model(x1)
        out2 = model(x2)
        model.reset_stream()
        alone = model(x2)
    assert out1.shape == (1, model.config.tokens, 8)
    blk = model.aggregator.global_blocks[0]
    assert len(blk.kv_cache) == 1
    # The second step attends over both frames, so it differs from frame 2 seen alone.
    assert not torch.allclose(out2, alone)
    model.reset_stream()
    assert blk.kv_cache == []


def test_global_block_methods_own_no_parameters() -> None:
    for name in ("attn_pre", "ffn_residual"):
        assert inspect.isfunction(getattr(GlobalBlock, name))
        assert not isinstance(getattr(GlobalBlock, name), torch.nn.Module)


def test_lingbot_size_on_meta() -> None:
    with torch.device("meta"):
        model = lingbot()
    agg = model.aggregator
    assert len(agg.frame_blocks) == len(agg.global_blocks) == len(agg.patch_embed.blocks) == 24
    assert agg.frame_blocks[0].attn.proj.weight.shape == (1024, 1024)
    assert agg.global_blocks[0].attn.heads == 16
    assert LINGBOT.tokens == 27 * 37


def test_hand_compiled_checkpoint_has_orig_mod_keys(tmp_path) -> None:
    n = save_hand_compiled_checkpoint(str(tmp_path / "x.pt"))
    sd = torch.load(tmp_path / "x.pt", weights_only=True)["state_dict"]
    assert n == sum("._orig_mod." in k for k in sd) > 0


def test_kv_cache_is_a_sliding_window() -> None:
    model = tiny().eval()
    with torch.no_grad():
        for i in range(model.config.window + 3):
            model(model.example_input(seed=i))
    assert len(model.aggregator.global_blocks[0].kv_cache) == model.config.window
