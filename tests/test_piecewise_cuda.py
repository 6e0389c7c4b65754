"""kind = "piecewise" on CUDA: the static pieces are captured and replayed as surgery's region
graphs, and the k and v a cache holds are never overwritten by a later replay."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from surgery.examples import tiny_sdpa
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

PATHS = ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]


def _manifest(model: torch.nn.Module, paths: list[str], dynamic: list[str],
              backend: str) -> Manifest:
    region = Region("piecewise", paths, piecewise={"split_ops": ["scaled_dot_product_attention"],
                                                   "dynamic": dynamic})
    return Manifest(compute_fingerprint(model.state_dict()), [region],
                    compile={**DEFAULT_COMPILE, "backend": backend})


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_pieces_replay_and_held_kv_is_never_overwritten(backend: str) -> None:
    torch.manual_seed(0)
    model = tiny_sdpa().cuda().eval()
    ref = copy.deepcopy(model)
    handle = apply_manifest(model, _manifest(model, PATHS, ["self.attn.kv_cache"], backend))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        for s in range(14):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
            for blk in model.aggregator.global_blocks:
                k_new, v_new = blk.attn.kv_cache[-1]
                kept += [(k_new, k_new.clone()), (v_new, v_new.clone())]
            torch.cuda.synchronize()
            for held, clone in kept[-16:]:  # the window's k and v: never overwritten
                assert torch.equal(held, clone)
    for p in PATHS:
        rec = handle.report.by_path(p)
        assert rec.status == "compiled", rec.reason
        assert rec.pieces == 2
        assert rec.graphs_captured >= 2  # both pieces, and the ring of the kept k, v
        assert rec.cuda_graph_replays >= 6, (rec.graphs_captured, rec.cuda_graph_replays,
                                             rec.notes)


def test_gpt2_generate_on_cuda_replays_pieces_and_tokens_match() -> None:
    transformers = pytest.importorskip("transformers")
    import inspect

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100,
                                  n_positions=128, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg).cuda().eval()
    ref = copy.deepcopy(model)
    params = inspect.signature(type(model.transformer.h[0]).forward).parameters
    cache = next(n for n in ("cache", "past_key_values", "layer_past") if n in params)
    handle = apply_manifest(model, _manifest(model, ["transformer.h.0", "transformer.h.1"],
                                             [f"{cache}:2"], "inductor"))
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    for rec in handle.report:
        assert rec.status == "compiled", rec.reason
        assert rec.cuda_graph_replays >= 20, (rec.graphs_captured, rec.notes)
        # prefill, then decode; an older transformers' mask may add one automatic-dynamic
        # recompile. Not one per token.
        assert rec.recompiles <= 2


def test_camera_trunk_fills_its_window_without_recompiles_then_replays_every_call() -> None:
    """The camera trunk (``cache[global_idx]``, a 16-frame list window) over 40 frames: 2 graphs
    (the first frame's, and the full window's when it recurs), compiled by the first path and run
    by both (the index only selects: runtime/index_select), every piece call of the last 10
    frames a replay on each path's own region graphs, and the window's k, v (ring sets, then
    clones) never overwritten."""
    torch.manual_seed(0)
    model = tiny_sdpa().cuda().eval()
    ref = copy.deepcopy(model)
    paths = ["camera_head.trunk.0", "camera_head.trunk.1"]
    manifest = _manifest(model, paths, ["cache"], "aot_eager")
    manifest.regions[0].compile = {"max_signatures": 20}
    handle = apply_manifest(model, manifest)
    window = model.camera_head.window
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in paths]
    before: dict[str, tuple[int, int]] = {}
    with torch.inference_mode():
        for s in range(40):
            if s == 30:
                before = {p: (handle.report.by_path(p).cuda_graph_replays,
                              handle.report.by_path(p).graphs_captured) for p in paths}
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
            for i, slot in enumerate(model.camera_head.kv_cache):
                kept[i].append((slot[-1], slot[-1].clone()))
            torch.cuda.synchronize()
            for held in kept:
                for t, value in held[-window:]:  # still in the window: never overwritten
                    assert torch.equal(t, value)
    assert [handle.report.by_path(p).compiles for p in paths] == [2, 0]
    for p in paths:
        rec = handle.report.by_path(p)
        assert rec.status == "compiled", rec.reason
        assert rec.new_structure_calls == window
        replays, captured = before[p]
        assert rec.cuda_graph_replays - replays == 2 * 10, (rec.cuda_graph_replays, rec.notes)
        assert rec.graphs_captured == captured  # nothing captured once the ring is full
