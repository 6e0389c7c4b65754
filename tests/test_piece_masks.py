"""One additive mask per split graph (surgery.runtime.piece_masks): the SDPAs that read one
dynamic boolean mask read one float mask converted once a call, with the values SDPA's own
conversion gives (fully masked rows too), and the GPT-2 stack's tokens, cache and logits stay
bit for bit what they were with a conversion per attention."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.profiler import ProfilerActivity, profile

from surgery.planning.plan import plan_module
from surgery.runtime import piece_masks
from surgery.runtime.apply import apply_manifest
from surgery.runtime.budget import fresh_function
from surgery.runtime.piece_masks import ALIGN, additive_mask, share_masks
from tests.test_piecewise_stack import ON_CPU, generate, same_as_eager, tiny_gpt2

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _masks(device: str = "cpu") -> list[torch.Tensor]:
    """Boolean masks as decoders build them: causal over a cache, broadcast over heads (an
    expanded batch), padding, and rows with no key at all."""
    g = torch.Generator().manual_seed(0)
    causal = (torch.arange(13)[None, None, None, :] <= torch.arange(10, 13)[None, None, :, None])
    padded = torch.rand(3, 1, 3, 13, generator=g) > 0.3
    padded[1, :, 0] = False  # a fully masked row
    return [m.to(device) for m in (causal, causal.expand(3, -1, -1, -1), padded,
                                   torch.zeros(1, 1, 3, 13, dtype=torch.bool))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_additive_mask_is_what_sdpa_makes_of_the_boolean_one(dtype: torch.dtype) -> None:
    """Same shape, rows aligned, and SDPA's output bit for bit the same as with the boolean
    mask, fully masked rows included."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g).to(dtype) for n in (3, 13, 13))
    for mask in _masks():
        add = additive_mask(mask, dtype)
        assert add.shape == mask.shape and add.dtype == dtype
        assert all(s % ALIGN == 0 for s in add.stride()[:-1]) and add.stride(-1) == 1
        assert torch.equal(add == 0, mask) and bool(torch.isneginf(add[~mask]).all())
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=add)
        assert torch.equal(got, want)


class TwoAttentions(nn.Module):
    """Two attentions over one boolean mask, the second a static mask's only reader."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor,
                other: torch.Tensor) -> torch.Tensor:
        a = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        b = F.scaled_dot_product_attention(a, k, k, attn_mask=mask)
        c = F.scaled_dot_product_attention(b, k[:, :, :4], k[:, :, :4], attn_mask=other)
        return c


def _traced(dynamic_mask: bool) -> tuple[int, list[Any], Callable[..., Any], list[Any]]:
    """(SDPAs that share a mask, each SDPA's mask target, the compiled module, its inputs)."""
    seen: list[Any] = []

    def backend(gm: fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        seen.append(share_masks(gm))
        seen.append([getattr(n.kwargs.get("attn_mask"), "target", None) for n in gm.graph.nodes
                     if n.target is F.scaled_dot_product_attention])
        return gm.forward

    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 9, 8)
    mask = torch.arange(9)[None, None, None, :] <= torch.tensor([7, 8])[None, None, :, None]
    other = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    if dynamic_mask:
        torch._dynamo.mark_dynamic(k, 2)
        torch._dynamo.mark_dynamic(mask, 3)
    fn = torch.compile(TwoAttentions(), backend=backend, dynamic=False, fullgraph=True)
    out = fn(q, k, mask, other)
    assert torch.equal(out, TwoAttentions()(q, k, mask, other))  # the values are eager's
    return seen[0], seen[1], fn, [q, k, mask, other]


def test_only_a_dynamic_boolean_mask_read_by_two_attentions_is_shared() -> None:
    shared, targets, _, _ = _traced(dynamic_mask=True)
    assert shared == 2
    assert targets[0] is targets[1] is additive_mask
    assert targets[2] is not additive_mask  # the static mask (one reader) is left alone
    shared, targets, _, _ = _traced(dynamic_mask=False)  # all static: not between pieces
    assert shared == 0 and additive_mask not in targets


def test_the_pass_off_leaves_the_graph_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(piece_masks, "SHARE_MASKS", False)
    shared, targets, _, _ = _traced(dynamic_mask=True)
    assert shared == 0 and additive_mask not in targets


def _stack(share: bool, monkeypatch: pytest.MonkeyPatch, *, not_exporting: bool = True,
           layers: int = 3) -> tuple[Any, Any]:
    monkeypatch.setattr(piece_masks, "SHARE_MASKS", share)
    monkeypatch.setattr(piece_masks, "NOT_EXPORTING", not_exporting)
    model = tiny_gpt2(layers)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan_of(model), overrides=ON_CPU, passes=1,
                                warmup=lambda m: generate(m, ids, 2))
    return model, handle


def stack_plan_of(model: nn.Module) -> Any:
    """The planner's piecewise plan of ``model``: its stack region over ``transformer``."""
    m = plan_module(model, source="test", piecewise=True).manifest
    assert any(r.paths == ["transformer"] for r in m.regions)
    return m


def _graphs(handle: Any) -> list[Any]:
    return [g for s in handle._slots if hasattr(s, "group") for g in s.group.graphs]


def _sdpa_masks(graph: Any) -> list[Any]:
    """What each SDPA of a split graph reads as its mask: None, or the node's target."""
    return [getattr(piece_masks._mask_of(n), "target", piece_masks._mask_of(n))
            for n in graph.split.graph.nodes if n.target is F.scaled_dot_product_attention]


def _conversions(model: nn.Module, ids: torch.Tensor, n: int, **kw: Any) -> tuple[Any, int]:
    """generate() of ``n`` tokens, and how many times an SDPA converted a boolean mask in it
    (the ``where`` of ATen's ``convert_boolean_attn_mask``, run inside the SDPA op)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = generate(model, ids, n, output_logits=True, **kw)
    return out, sum(1 for e in prof.events() if e.name == "aten::where" and e.cpu_parent
                    is not None and e.cpu_parent.name == "aten::scaled_dot_product_attention")


def test_a_padded_batch_converts_its_mask_once_a_token_and_keeps_every_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 (3 blocks) through generate() on a left-padded batch of 2 (a boolean padding mask
    in the graph on every torch): with the pass, no SDPA converts it (the graph does, once a
    decode token), without it each of the 3 does; tokens, cache and logits identical with and
    without it and to eager's; no recompile as the cache grows."""
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, 6, dtype=torch.long)
    pad[1, :2] = 0
    eager = tiny_gpt2(3)
    with torch.no_grad():
        want = generate(eager, ids, 6, output_logits=True, attention_mask=pad)
    got: dict[bool, Any] = {}
    inverted: dict[bool, int] = {}
    for share in (True, False):
        model, handle = _stack(share, monkeypatch)
        stack = handle.report.by_path("transformer")
        with torch.no_grad():
            generate(model, ids, 6, attention_mask=pad)
            runs, compiles = stack.compiled_runs, stack.compiles
            got[share], inverted[share] = _conversions(model, ids, 6, attention_mask=pad)
        assert stack.compiled_runs - runs == 5 and stack.compiles == compiles, stack.reason
        graph = _graphs(handle)[-1]  # the padded batch's (warm-up traced batch 1)
        masks = _sdpa_masks(graph)
        assert graph.masks_shared == (3 if share else 0)
        assert (masks == [additive_mask] * 3) if share else (additive_mask not in masks)
        same_as_eager(got[share], want)
    # the prefill runs eager (an empty cache), its 3 SDPAs converting eager's own mask
    assert inverted == {True: 3, False: 3 + 5 * 3}, inverted
    for a, b in zip(got[True].logits, got[False].logits, strict=True):
        assert torch.equal(a, b)


def skips_mask_under_compile() -> bool:
    """Whether this transformers skips the causal mask of a one-token query, without padding,
    under torch.compile as a piecewise call traces it (its own predicate, compiled; transformers
    5.24 does, with the shim on torch < 2.14; 5.17, the H200's, never does under compile)."""
    import inspect

    from transformers import masking_utils

    fn = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if fn is None:
        return False
    known = {"padding_mask": None, "query_length": 1, "q_length": 1, "kv_length": 9,
             "q_offset": 8, "kv_offset": 0}
    kw: dict[str, Any] = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in known:
            kw[name] = known[name]
        elif p.default is inspect.Parameter.empty:
            return False  # a layout this probe does not know: expect the mask
    compiled = torch.compile(fresh_function(lambda: fn(**kw)), backend="eager", fullgraph=True)
    return bool(piece_masks.compiling_not_exporting(compiled))


def test_decoding_without_padding_attends_with_no_mask_as_eager_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 1, no padding: eager's attention gets no mask, and neither does the stack's where
    transformers skips it under compile (5.24), on any torch. Before 2.14, dynamo folded
    ``is_exporting()`` to True, so that transformers built a causal mask in the graph: with the
    fix off the graph has one there (and only there), converted once (share_masks). A
    transformers that never skips it under compile (5.17) gets the shared conversion."""
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    eager = tiny_gpt2(3)
    with torch.no_grad():
        want = generate(eager, ids, 10)
    skips = skips_mask_under_compile()
    for fix in (True, False):
        model, handle = _stack(True, monkeypatch, not_exporting=fix)
        with torch.no_grad():
            same_as_eager(generate(model, ids, 10), want)
        (graph,) = _graphs(handle)
        masks = _sdpa_masks(graph)
        assert len(masks) == 3
        if skips and (fix or torch.__version__ >= (2, 14)):  # type: ignore[operator]
            assert masks == [None] * 3, masks
        else:  # the causal mask in the graph, converted once (share_masks)
            assert masks == [additive_mask] * 3, masks


def test_the_export_flag_reads_false_only_while_a_piecewise_call_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The table entry is False inside the call, put back after, nested calls and a raise
    included; inside a real export, or with the fix off, it is never touched."""
    key = torch.compiler.is_exporting
    table = {key: True}
    monkeypatch.setattr(piece_masks, "_table", table)
    seen: list[Any] = []

    def inner() -> None:
        seen.append(table[key])
        piece_masks.compiling_not_exporting(lambda: seen.append(table[key]))
        seen.append(table[key])
        raise ValueError("the model's own error")

    with pytest.raises(ValueError, match="own error"):
        piece_masks.compiling_not_exporting(inner)
    assert seen == [False, False, False] and table == {key: True}
    with monkeypatch.context() as m:  # inside a real export: its answer stands
        m.setattr(torch.compiler, "_is_exporting_flag", True)
        assert piece_masks.compiling_not_exporting(lambda: table[key]) is True
    monkeypatch.setattr(piece_masks, "NOT_EXPORTING", False)
    assert piece_masks.compiling_not_exporting(lambda: table[key]) is True


def test_overlapping_calls_of_two_threads_put_the_export_flag_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads' piecewise calls overlap and end in the order they began: the process's
    table entry reads False while either runs, and True again once both ended (a call that
    restored what it found would leave the second one's False for good)."""
    key = torch.compiler.is_exporting
    table = {key: True}
    monkeypatch.setattr(piece_masks, "_table", table)
    a_in, b_in, a_go, b_go = (threading.Event() for _ in range(4))
    seen: list[Any] = []

    def call(entered: threading.Event, go: threading.Event) -> None:
        def body() -> None:
            entered.set()
            assert go.wait(10)
            seen.append(table[key])

        piece_masks.compiling_not_exporting(body)

    a = threading.Thread(target=call, args=(a_in, a_go))
    b = threading.Thread(target=call, args=(b_in, b_go))
    a.start()
    assert a_in.wait(10)
    b.start()
    assert b_in.wait(10)
    a_go.set()
    a.join(10)
    assert table[key] is False  # b still runs
    b_go.set()
    b.join(10)
    assert seen == [False, False] and table == {key: True}


@pytest.mark.cuda
def test_cuda_stack_shares_its_mask_in_fp32_and_keeps_boolean_for_half() -> None:
    """On CUDA: SDPA's outputs with the shared mask equal the boolean mask's on the backends
    that take a mask (math, memory-efficient), fully masked rows included; a half-precision
    query keeps the boolean mask while cuDNN attention is enabled (its conversion writes
    -65504, not -inf); the fp32 stack on a left-padded batch reads one shared mask, captured
    pieces replaying, tokens as eager's; unpadded, its attentions read no mask where this
    transformers skips it under compile (torch 2.11 too), the shared one where not (5.17)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, n, 64, generator=g).cuda() for n in (3, 13, 13))
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel(backend):
            for mask in _masks("cuda"):
                add = additive_mask(mask, torch.float32)
                assert add is not mask
                assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=add),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    mask = _masks("cuda")[0]
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert additive_mask(mask, torch.bfloat16) is mask
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert additive_mask(mask, torch.float32) is mask
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN cannot be chosen: shared again
        assert additive_mask(mask, torch.bfloat16).dtype == torch.bfloat16
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    pad = torch.ones(2, 8, dtype=torch.long, device="cuda")
    pad[1, :3] = 0
    unpadded = [None] * 3 if skips_mask_under_compile() else [additive_mask] * 3
    for kw, want_masks in (({"attention_mask": pad}, [additive_mask] * 3), ({}, unpadded)):
        model = tiny_gpt2(3).cuda()
        ref = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = apply_manifest(model, stack_plan_of(model))
        batch = ids if kw else ids[:1]
        with torch.no_grad():
            want = generate(ref, batch, 16, **kw)
            for _ in range(3):
                same_as_eager(generate(model, batch, 16, **kw), want, exact=False)
        stack = handle.report.by_path("transformer")
        assert stack.status == "compiled" and stack.cuda_graph_replays > 0, stack.notes
        assert [_sdpa_masks(g) for g in _graphs(handle)] == [want_masks]
