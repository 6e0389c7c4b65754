"""kind = "piecewise" (surgery.runtime.piecewise): a streaming block compiled as one graph, split
at its cache-dependent ops, its fixed-shape pieces run as region graphs. CPU tests: aot_eager
(one inductor), and the region graphs driven by a stand-in capturer."""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from surgery.errors import ManifestError, RegionError
from surgery.examples import tiny_sdpa
from surgery.examples.sdpa import Rope2D, RopeBlock
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region, load_schema, validate
from surgery.runtime.apply import apply_manifest
from surgery.runtime.compile_options import plan_region
from surgery.runtime.piecewise import install_piecewise
from surgery.runtime.piecewise_split import SPLIT_OPS
from surgery.runtime.report import RegionFallbackWarning, RegionRecord
from tests.test_graphs import FakeCapturer

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ON_CPU = {"backend": "aot_eager", "on_cpu": "compile"}


def piecewise_manifest(model: nn.Module, paths: list[str], dynamic: list[str],
                       **compile_: Any) -> Manifest:
    region = Region("piecewise", paths, piecewise={"split_ops": ["scaled_dot_product_attention"],
                                                   "dynamic": dynamic})
    return Manifest(compute_fingerprint(model.state_dict()), [region],
                    compile={**DEFAULT_COMPILE, **ON_CPU, **compile_})


class TensorCacheBlock(nn.Module):
    """A block whose cache is one tensor per k and v that grows along dim 2 (as HF's do)."""

    def __init__(self, dim: int = 16, heads: int = 2, branch: bool = False,
                 graph_break: bool = False) -> None:
        super().__init__()
        self.heads, self.branch, self.graph_break = heads, branch, graph_break
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if self.k_cache is not None:
            k = torch.cat([self.k_cache, k], dim=2)
            v = torch.cat([self.v_cache, v], dim=2)
        else:  # as HF caches do: the cache is always a fresh tensor (one stride pattern)
            k, v = k.contiguous(), v.contiguous()
        self.k_cache, self.v_cache = k, v
        if self.graph_break:
            torch._dynamo.graph_break()
        if self.branch and k.shape[2] == 6:  # a branch on the cache length
            k = k * 2
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(TensorCacheBlock(**kw) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


CACHE = ["self.k_cache:2", "self.v_cache:2"]


def stream(model: nn.Module, ref: nn.Module, steps: int, *, tokens: int = 3) -> None:
    """Stream `steps` inputs through both; outputs and caches match eager's at every step."""
    for s in range(steps):
        x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
        for blk, rblk in zip(model.blocks, ref.blocks, strict=True):
            assert blk.k_cache.shape[2] == rblk.k_cache.shape[2] == tokens * (s + 1)
            torch.testing.assert_close(blk.k_cache, rblk.k_cache)
            torch.testing.assert_close(blk.v_cache, rblk.v_cache)


def test_split_points_and_pieces_are_found() -> None:
    model = Stack()
    handle = apply_manifest(model, piecewise_manifest(model, ["blocks.0", "blocks.1"], CACHE))
    stream(model, copy.deepcopy(Stack()), 3)
    for rec in handle.report:
        assert rec.status == "compiled", rec.reason
        # the cache cats, the size sums of the dynamic length, and attention run between pieces
        assert {"cat", "scaled_dot_product_attention"} <= set(rec.split_ops)
        assert rec.pieces == 2  # norm+qkv before; proj+mlp after
        assert 3 <= rec.ops_between <= 6
        assert rec.ops_between_run >= rec.ops_between
    assert "pieces=2 between=" in handle.report.summary()


def test_cache_grows_as_eager_without_recompiles() -> None:
    from torch._dynamo.utils import counters

    model, ref = Stack(), Stack()
    handle = apply_manifest(model, piecewise_manifest(model, ["blocks.0", "blocks.1"], CACHE))
    stream(model, ref, 2)  # step 1: an empty cache (runs eager); step 2: the dynamic graph
    graphs = counters["stats"]["unique_graphs"]
    compiles = [r.compiles for r in handle.report]
    for s in range(2, 6):  # 4 more steps: the cache grows, nothing is traced again
        x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
        assert model.blocks[1].k_cache.shape[2] == ref.blocks[1].k_cache.shape[2] == 3 * (s + 1)
    assert counters["stats"]["unique_graphs"] == graphs
    assert [r.compiles for r in handle.report] == compiles
    # the two blocks share one compiled copy, and the empty-cache step ran eager (it traced a
    # graph of its own before): 1 graph in all
    assert sum(compiles) == 1
    assert all(r.recompiles == 0 and r.empty_cache_calls == 1 for r in handle.report)
    assert all(r.eager_calls == 1 and r.compiled_calls == 5 for r in handle.report)


def test_example_sdpa_blocks_stream_as_eager_over_6_frames() -> None:
    """The SDPA example's list cache (a sliding window): outputs and caches match eager."""
    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    ref = copy.deepcopy(model)
    paths = ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]
    handle = apply_manifest(model, piecewise_manifest(model, paths, ["self.attn.kv_cache"]))
    with torch.no_grad():
        for s in range(6):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k])
            for blk, rblk in zip(model.aggregator.global_blocks, ref.aggregator.global_blocks,
                                 strict=True):
                assert len(blk.attn.kv_cache) == len(rblk.attn.kv_cache) == min(s + 1, 4)
                for (k, v), (rk, rv) in zip(blk.attn.kv_cache, rblk.attn.kv_cache, strict=True):
                    torch.testing.assert_close(k, rk)
                    torch.testing.assert_close(v, rv)
    recs = list(handle.report)
    assert all(r.status == "compiled" for r in recs), [r.reason for r in recs]
    # the first frame's graph, then the full window's (4 frames) when it recurs, shared by both
    # blocks; lengths 1 to 4 ran eager once each (surgery.runtime.cache_sources)
    assert sum(r.compiles for r in recs) == 2
    assert all(r.new_structure_calls == 4 for r in recs)
    assert all(r.pieces == 2 and "cat" in r.split_ops for r in recs)


@pytest.mark.parametrize("kw, why", [
    pytest.param({"graph_break": True}, "a graph break inside the block", id="graph-break"),
    pytest.param({"branch": True}, "a branch on the cache length", id="branch-on-length"),
])
def test_block_that_cannot_be_piecewise_falls_back_with_reason(kw: dict[str, bool],
                                                               why: str) -> None:
    model, ref = Stack(**kw), Stack(**kw)
    handle = apply_manifest(model, piecewise_manifest(model, ["blocks.0", "blocks.1"], CACHE))
    with pytest.warns(RegionFallbackWarning, match="piecewise|runs eager"):
        stream(model, ref, 4)  # never crashes; caches and outputs stay eager's
    for rec in handle.report:
        assert rec.status == "eager"
        assert why in rec.reason, rec.reason


def test_on_failure_error_raises_and_in_memory_tables_are_checked() -> None:
    model = Stack(graph_break=True)
    manifest = piecewise_manifest(model, ["blocks.0", "blocks.1"], CACHE)
    manifest.regions[0].on_failure = "error"
    apply_manifest(model, manifest)
    with torch.no_grad():
        model(torch.randn(1, 3, 16))  # an empty cache: runs eager, nothing compiles
    with pytest.raises(RegionError, match=r"piecewise region path 'blocks\.0' failed"), \
            torch.no_grad():
        model(torch.randn(1, 3, 16))
    for bad in ({"split_ops": ["system"]}, {"dynamic": ["self.__class__:2"]}, {"other": []}):
        fresh = Stack()
        m = piecewise_manifest(fresh, ["blocks.0"], CACHE)
        m.regions[0].piecewise = bad
        with pytest.raises(RegionError):
            apply_manifest(fresh, m)


def test_inductor_pieces_match_eager() -> None:
    model, ref = Stack(), Stack()
    handle = apply_manifest(model, piecewise_manifest(model, ["blocks.0", "blocks.1"], CACHE,
                                                      backend="inductor"))
    stream(model, ref, 4)
    assert all(r.status == "compiled" and r.pieces == 2 for r in handle.report)
    assert sum(r.compiles for r in handle.report) == 1  # the empty-cache step ran eager


class RopeStack(nn.Module):
    """Two of the SDPA example's streaming blocks (list KV cache, window of 2 frames)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        rope = Rope2D()
        self.blocks = nn.ModuleList(RopeBlock(16, 2, 2, rope, window=2) for _ in range(2))
        self.pos = torch.stack([torch.arange(6) // 3, torch.arange(6) % 3], -1)[None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, self.pos)
        return x


def install_rope_stack(capturer: Any) -> tuple[RopeStack, RopeStack, list[Any]]:
    """A RopeStack with both blocks piecewise over their list cache, under ``capturer``; its
    eager twin; the installed slots."""
    model = RopeStack().eval()
    ref = copy.deepcopy(model)
    paths = ["blocks.0", "blocks.1"]
    manifest = piecewise_manifest(model, paths, ["self.attn.kv_cache"])
    region = manifest.regions[0]
    plan = plan_region(manifest, region, overrides=None, on_cuda=False)
    groups: dict[Any, Any] = {}
    slots = [install_piecewise(model.get_submodule(p), "forward",
                               RegionRecord(p, "piecewise", "forward", "pending"), region, plan,
                               groups, capturer) for p in paths]
    return model, ref, slots


def test_pieces_replay_and_held_outputs_are_never_overwritten() -> None:
    """Region graphs of the pieces, driven on the CPU by a stand-in capturer: the pieces
    replay, and the k and v the list cache holds (a piece's outputs) keep their values."""
    cap: Any = FakeCapturer()
    model, ref, slots = install_rope_stack(cap)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        for s in range(14):  # readopt recaptures a piece once (graphs.steady): 14, not 10
            x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(s))
            torch.testing.assert_close(model(x), ref(x))
            for blk in model.blocks:
                k, v = blk.attn.kv_cache[-1]
                kept += [(k, k.clone()), (v, v.clone())]
            for held, clone in kept[-8:]:  # still in the window: never overwritten
                assert torch.equal(held, clone)
            for blk, rblk in zip(model.blocks, ref.blocks, strict=True):
                assert len(blk.attn.kv_cache) == len(rblk.attn.kv_cache) == min(s + 1, 2)
    for slot in slots:
        rec = slot.record
        assert rec.graphs_captured >= 3 and rec.cuda_graph_replays >= 6, rec.notes
        assert any("ring of output buffers" in n for n in rec.notes)  # held k, v: a ring


def test_manifest_keys_round_trip_and_are_checked() -> None:
    model = Stack()
    m = piecewise_manifest(model, ["blocks.0"], CACHE)
    data = m.to_dict()
    validate(data)
    assert Manifest.from_dict(data).regions[0].piecewise == m.regions[0].piecewise
    schema_ops = load_schema()["$defs"]["region"]["properties"]["piecewise"]["properties"][
        "split_ops"]["items"]["enum"]
    assert tuple(schema_ops) == SPLIT_OPS
    for bad in ({"split_ops": ["system"]}, {"dynamic": ["self.__class__:2"]},
                {"dynamic": ["cache:22"]}, {"other": []}):
        data["region"][0]["piecewise"] = bad
        with pytest.raises(ManifestError):
            validate(data)


def test_gpt2_generate_tokens_identical_and_decode_compiles_once() -> None:
    transformers = pytest.importorskip("transformers")
    import inspect

    torch.manual_seed(0)
    # 5 layers: each specializes on its layer index, so the shared code holds 10 graphs,
    # past dynamo's recompile limit of 8 (the path compiles again with room for its budget)
    cfg = transformers.GPT2Config(n_layer=5, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=64, bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ref = copy.deepcopy(model)
    params = inspect.signature(type(model.transformer.h[0]).forward).parameters
    cache = next(n for n in ("cache", "past_key_values", "layer_past") if n in params)
    paths = [f"transformer.h.{i}" for i in range(5)]
    handle = apply_manifest(model, piecewise_manifest(model, paths, [f"{cache}:2"]))
    ids = torch.randint(2, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
        want = ref.generate(ids, max_new_tokens=10, do_sample=False)
        assert torch.equal(out, want)
        compiles = [r.compiles for r in handle.report]
        again = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(again, want)
    assert [r.compiles for r in handle.report] == compiles  # nothing traced again
    for rec in handle.report:
        assert rec.status == "compiled", rec.reason
        assert rec.pieces == 2 and "scaled_dot_product_attention" in rec.split_ops
    assert sum(compiles) <= 10  # decode per layer; the first layer's prefill runs eager


def test_under_replay_the_tensor_cache_grows_and_no_piece_is_captured_again() -> None:
    """Issue 19's breakage "put the cat into a captured piece": a piece that read the growing
    cache would need a new graph every step (its input grows), and a real CUDA graph replays
    the shapes it was captured with. With the cat between pieces, after the first compiled step
    every step replays each piece and captures nothing, while the cache grows as eager's."""
    cap: Any = FakeCapturer()
    model, ref = Stack().eval(), Stack().eval()
    manifest = piecewise_manifest(model, ["blocks.0", "blocks.1"], CACHE)
    region = manifest.regions[0]
    plan = plan_region(manifest, region, overrides=None, on_cuda=False)
    groups: dict[Any, Any] = {}
    paths = ["blocks.0", "blocks.1"]
    slots = [install_piecewise(model.get_submodule(p), "forward",
                               RegionRecord(p, "piecewise", "forward", "pending"), region, plan,
                               groups, cap) for p in paths]
    captured: list[list[int]] = []
    replays: list[list[int]] = []
    with torch.inference_mode():
        for s in range(8):
            x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(s))
            torch.testing.assert_close(model(x), ref(x))
            for blk, rblk in zip(model.blocks, ref.blocks, strict=True):
                assert blk.k_cache.shape[2] == rblk.k_cache.shape[2] == 3 * (s + 1)
                torch.testing.assert_close(blk.k_cache, rblk.k_cache)
            captured.append([sl.record.graphs_captured for sl in slots])
            replays.append([sl.record.cuda_graph_replays for sl in slots])
    for sl in slots:
        assert sl.record.pieces == 2 and sl.record.status == "compiled", sl.record.reason
    # steps 1-3: the empty cache (eager), the compile, the first capture; then at most one
    # recapture a piece (graphs.steady's readopt: an input another piece now owns is read in
    # place), and from step 5 on, steady
    assert captured[4] == captured[-1] and all(c >= 2 for c in captured[-1]), captured
    assert all(c - b <= 2 for b, c in zip(captured[2], captured[-1], strict=True)), captured
    for before, after in itertools.pairwise(replays[4:]):
        assert all(b - a >= 2 for a, b in zip(before, after, strict=True)), replays
