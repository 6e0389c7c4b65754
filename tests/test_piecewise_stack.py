"""A decoder stack as one piecewise region (surgery.runtime.piecewise_stack, planned by
surgery.planning.stacks): GPT-2 from transformers driven through generate(), tokens identical to
eager in fp32, the cache as eager's, no recompile per token; its blocks stand by and take over
when the stack cannot be one graph."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import surgery.runtime.compile_start as compile_start
from surgery.errors import ManifestError, RegionError
from surgery.formats.manifest import PIECEWISE_KIND, Manifest, validate
from surgery.planning.plan import plan_model, plan_module
from surgery.planning.stacks import STACK_MAX_COMPILES, drop_stacks
from surgery.runtime.apply import apply_manifest
from surgery.runtime.compile_options import plan_region
from surgery.runtime.piecewise import install_piecewise
from surgery.runtime.report import RegionRecord
from tests.test_graphs import FakeCapturer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ON_CPU = {"backend": "aot_eager", "on_cpu": "compile"}
NEW = 64


def tiny_gpt2(layers: int = 2) -> nn.Module:
    """A --model factory: GPT-2 at test size, random weights, no EOS (every run is NEW long)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=128, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg).eval()


def installed_stack(layers: int = 2) -> tuple[nn.Module, nn.Module, Any, RegionRecord]:
    """(tiny GPT-2 with its planned stack region installed under a stand-in capturer, an eager
    copy, the slot, the record)."""
    model = tiny_gpt2(layers)
    ref = copy.deepcopy(model)
    m = plan_module(model, source="test", piecewise=True).manifest
    (region,) = [r for r in m.regions if r.paths == ["transformer"]]
    m.compile.update(ON_CPU)
    plan = plan_region(m, region, overrides=None, on_cuda=False)
    rec = RegionRecord("transformer", "piecewise", "forward", "pending")
    slot = install_piecewise(model.transformer, "forward", rec, region, plan, {}, FakeCapturer())
    return model, ref, slot, rec


def tiny_llama() -> nn.Module:
    """A --model factory: Llama at test size (RMSNorm, RoPE, grouped kv heads), random weights."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                   max_position_embeddings=128, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def stack_plan(factory: str = "tiny_gpt2") -> Manifest:
    m = plan_model(f"tests.test_piecewise_stack:{factory}", piecewise=True).manifest
    fingerprint = m.fingerprint
    m = Manifest.from_dict(m.to_dict())  # through the file layout
    validate(m.to_dict())
    m.fingerprint = fingerprint
    return m


def generate(model: nn.Module, ids: torch.Tensor, n: int = NEW, **kw: Any) -> Any:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          return_dict_in_generate=True, **kw)


def same_as_eager(got: Any, want: Any, *, exact: bool = True) -> None:
    """Every token equal, and the cache the stack grew equal to eager's, layer by layer (bit
    for bit with aot_eager; inductor's fusions may round the last bit)."""
    tol = {"rtol": 0, "atol": 0} if exact else {}
    assert torch.equal(got.sequences, want.sequences)
    cache, ref = got.past_key_values, want.past_key_values
    assert len(cache.layers) == len(ref.layers)
    for layer, rlayer in zip(cache.layers, ref.layers, strict=True):
        assert layer.keys.shape == rlayer.keys.shape
        assert layer.keys.shape[2] == got.sequences.shape[1] - 1  # the last token is not fed
        torch.testing.assert_close(layer.keys, rlayer.keys, **tol)
        torch.testing.assert_close(layer.values, rlayer.values, **tol)


def test_plan_prefers_the_stack_and_keeps_the_blocks_standing_by() -> None:
    m = stack_plan()
    pw = {r.paths[0]: r for r in m.regions if r.kind == PIECEWISE_KIND}
    assert sorted(pw) == ["transformer", "transformer.h.0"]
    stack, blocks = pw["transformer"], pw["transformer.h.0"]
    assert stack.piecewise == {"split_ops": ["scaled_dot_product_attention"],
                               "dynamic": ["cache:2"]}
    assert stack.compile == {"max_signatures": STACK_MAX_COMPILES}
    assert blocks.paths == ["transformer.h.0", "transformer.h.1"]
    assert blocks.piecewise["fallback_for"] == ["transformer"]
    # the per-block layout of the same plan: no stack, no standby key
    (per_block,) = [r for r in drop_stacks(stack_plan()).regions if r.kind == PIECEWISE_KIND]
    assert per_block.paths == blocks.paths and "fallback_for" not in per_block.piecewise


def test_stack_generates_eagers_tokens_and_cache_with_one_compile_per_mode() -> None:
    """One stack graph a token: 64 tokens in fp32 as eager, batch 1 and 2 (left padding),
    no_grad and inference_mode; once a mode has compiled, nothing is traced again. The prefill
    (its cache empty) runs eager, its blocks too: one graph per mode, decode's."""
    from torch._dynamo.utils import counters

    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = torch.Generator().manual_seed(0)
        ids1, ids2 = torch.randint(0, 100, (1, 8), generator=g), torch.randint(0, 100, (2, 8),
                                                                              generator=g)
        handle = apply_manifest(model, stack_plan(), overrides=ON_CPU, passes=1,
                                warmup=lambda m: generate(m, ids1, 2))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    stack = handle.report.by_path("transformer")
    pieces: list[int] = []
    for mode, ids, kw in [(torch.no_grad, ids1, {}), (torch.inference_mode, ids2,
                                                       {"attention_mask": mask})]:
        with mode():
            want = generate(ref, ids, **kw)
            same_as_eager(generate(model, ids, **kw), want)
            graphs, compiles = counters["stats"]["unique_graphs"], stack.compiles
            runs, empty = stack.compiled_runs, stack.empty_cache_calls
            same_as_eager(generate(model, ids, **kw), want)
        assert counters["stats"]["unique_graphs"] == graphs  # no recompile per token
        assert stack.compiles == compiles
        # one dynamo entry a decode token, the stack's; the prefill ran its eager forward
        assert stack.compiled_runs - runs == NEW - 1
        assert stack.empty_cache_calls - empty == 1
        pieces.append(stack.pieces)
    assert stack.status == "compiled", stack.reason
    assert stack.compiles == 2  # decode, per mode and batch (no prefill graph)
    # a decode step: one piece before the first attention, then one after each (the size
    # arithmetic hoisted to the top); a padding mask adds its own ops between
    assert pieces[0] == 3, pieces
    assert {"cat", "scaled_dot_product_attention"} <= set(stack.split_ops)
    assert "piecewise stack 'transformer' ran compiled in warm-up: 2 block path(s) stand by " \
        "for it, 0 ran piecewise in its place" in handle.report.notes
    for p in ("transformer.h.0", "transformer.h.1"):  # inlined by the stack's graph
        rec = handle.report.by_path(p)
        assert rec.status == "pending" and rec.calls == 0 and "stands by" in rec.reason


def test_stack_that_breaks_falls_back_to_its_piecewise_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph break in mask creation: the stack runs eager with the reason, its blocks take
    over piecewise, and the tokens stay eager's."""
    import transformers.models.gpt2.modeling_gpt2 as gpt2

    original = gpt2.create_causal_mask

    def breaking(*args: Any, **kwargs: Any) -> Any:
        torch._dynamo.graph_break()
        return original(*args, **kwargs)

    monkeypatch.setattr(gpt2, "create_causal_mask", breaking)
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    with pytest.warns(Warning, match="transformer"), torch.no_grad():
        handle = apply_manifest(model, stack_plan(), overrides=ON_CPU, passes=1,
                                warmup=lambda m: generate(m, ids, 2))
        same_as_eager(generate(model, ids, 12), generate(ref, ids, 12))
    assert "piecewise stack 'transformer' ran eager in warm-up: 0 block path(s) stand by for " \
        "it, 2 ran piecewise in its place" in handle.report.notes
    stack = handle.report.by_path("transformer")
    assert stack.status == "eager" and "a graph break" in stack.reason, stack.reason
    for p in ("transformer.h.0", "transformer.h.1"):
        rec = handle.report.by_path(p)
        assert rec.status == "compiled" and rec.pieces == 2, rec.reason


def test_llama_stack_generates_eagers_tokens_without_recompiles() -> None:
    """A second architecture: Llama's `model` (rotary embeddings computed in the stack) is one
    piecewise region, planned by the same names rule."""
    from torch._dynamo.utils import counters

    m = stack_plan("tiny_llama")
    stack, blocks = [r for r in m.regions if r.kind == PIECEWISE_KIND]
    assert stack.paths == ["model"] and blocks.paths == ["model.layers.0", "model.layers.1"]
    assert blocks.piecewise["fallback_for"] == ["model"]
    model = tiny_llama()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, m, overrides=ON_CPU)
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(3))
    rec = handle.report.by_path("model")
    with torch.no_grad():
        want = generate(ref, ids, 32)
        same_as_eager(generate(model, ids, 32), want)
        graphs = counters["stats"]["unique_graphs"]
        same_as_eager(generate(model, ids, 32), want)
    assert counters["stats"]["unique_graphs"] == graphs
    # decode's graph only: the prefill (an empty cache) ran eager
    assert rec.status == "compiled" and rec.compiles == 1 and rec.pieces == 3, rec.reason


def test_inductor_stack_tokens_identical() -> None:
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan(),
                                overrides={**ON_CPU, "backend": "inductor"})
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    stack = handle.report.by_path("transformer")
    with torch.no_grad():
        want = generate(ref, ids, 16)
        same_as_eager(generate(model, ids, 16), want, exact=False)
        compiles = stack.compiles
        same_as_eager(generate(model, ids, 16), want, exact=False)
    assert stack.status == "compiled", stack.reason
    # decode's graph alone. Before the prefill ran eager there were three: the prefill's, and
    # two of decode, since inductor laid out the prefill's k and v (the cache's first tensors)
    # with other strides than the cat that grows it, so the first decode step traced its own
    assert compiles == 1 and stack.compiles == compiles
    assert stack.empty_cache_calls == 2  # the 2 generate() calls here (no warm-up)


@pytest.mark.parametrize("fallback_for", [
    pytest.param(["lm_head"], id="not-a-region"),
    pytest.param(["transformer.h.1"], id="not-containing"),
])
def test_a_standby_that_names_no_containing_stack_is_refused(fallback_for: list[str]) -> None:
    m = stack_plan()
    (blocks,) = [r for r in m.regions if r.piecewise and "fallback_for" in r.piecewise]
    blocks.piecewise["fallback_for"] = fallback_for
    model = tiny_gpt2()
    with pytest.raises(RegionError, match="stands by for"):
        apply_manifest(model, m, overrides=ON_CPU)
    assert "forward" not in vars(model.transformer.h[0])  # nothing left installed


def test_blocks_inside_a_stack_without_fallback_for_are_refused() -> None:
    m = stack_plan()
    for r in m.regions:
        if r.piecewise:
            r.piecewise.pop("fallback_for", None)
    with pytest.raises(RegionError, match="is inside region 'transformer'"):
        apply_manifest(tiny_gpt2(), m, overrides=ON_CPU)


@pytest.mark.parametrize("value", [
    pytest.param(["transformer", "lm_head"], id="two-paths"),
    pytest.param(["transformer/../x"], id="not-a-path"),
    pytest.param([], id="empty"),
    pytest.param("transformer", id="not-a-list"),
])
def test_the_schema_refuses_a_bad_fallback_for(value: Any) -> None:
    data = stack_plan().to_dict()
    (block,) = [r for r in data["region"] if "fallback_for" in r.get("piecewise", {})]
    block["piecewise"]["fallback_for"] = value
    with pytest.raises(ManifestError):
        validate(data)


@pytest.mark.cuda
@pytest.mark.parametrize("elements", [
    pytest.param(None, id="size rule: every piece light (aot_eager)"),
    pytest.param(0, id="size rule off: the pieces build inductor code")])
def test_stack_on_cuda_replays_its_pieces_and_tokens_match(
        elements: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with inductor: the stack's pieces are captured and replayed as region graphs,
    the tokens are eager's over 64, the cache (k and v held across steps) matches eager's. At
    test size every piece is launch-bound, so by default all compile light
    (surgery.runtime.compile_start); with the size rule off they build inductor code."""
    if elements is not None:
        monkeypatch.setattr(compile_start, "LIGHT_PIECE_ELEMENTS", elements)
    model = tiny_gpt2().cuda()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan())
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    stack = handle.report.by_path("transformer")
    with torch.no_grad():
        want = generate(ref, ids)
        same_as_eager(generate(model, ids), want, exact=False)
        compiles, replays = stack.compiles, stack.cuda_graph_replays
        same_as_eager(generate(model, ids), want, exact=False)
    assert stack.status == "compiled", stack.reason
    assert stack.compiles == compiles == 1  # decode; the prefill runs eager
    # a decode step replays every piece: 3 for 2 blocks
    assert stack.cuda_graph_replays - replays >= 3 * (NEW - 1), (stack.graphs_captured,
                                                                stack.notes)
    assert all(handle.report.by_path(p).calls == 0 for p in ("transformer.h.0",
                                                             "transformer.h.1"))
    light = stack.pieces_light == stack.pieces_compiled
    assert light if elements is None else not light, (stack.pieces_light, stack.pieces_compiled)


def test_stack_pieces_of_one_code_keep_a_set_of_graphs_per_block() -> None:
    """The stack's middle pieces are one FX code with each block's weights (compiled once,
    runtime.piece_cache): driven by a stand-in capturer, each block's piece keeps its own region
    graphs (captured once, then replayed every token), never dropped as "moved" parameters."""
    # 3 blocks: the middle one's pieces are the same code as the first's
    model, ref, slot, rec = installed_stack(3)
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = generate(ref, ids, 12)
        for _ in range(2):
            same_as_eager(generate(model, ids, 12), want)
        captured, replays = rec.graphs_captured, rec.cuda_graph_replays
        same_as_eager(generate(model, ids, 12), want)
    assert not any("moved" in n for n in rec.notes), rec.notes
    assert rec.graphs_captured == captured  # nothing captured again
    assert rec.pieces_shared >= 1  # the middle block's decode piece reuses the first's code
    # every decode step replays its 4 pieces (one before the first attention, one after each);
    # the prefill (its cache empty) runs eager, so it has no pieces: one set of graphs per
    # decode piece and block
    assert rec.cuda_graph_replays - replays == 4 * 11, (captured, rec.cuda_graph_replays)
    assert slot.graphs is not None and len(slot.graphs.graphs) == 4
    assert rec.empty_cache_calls == 3 and rec.compiles == 1
