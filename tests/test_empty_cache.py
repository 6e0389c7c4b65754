"""A piecewise path whose tensor cache is empty (a prefill) runs eager (surgery.runtime
.cache_sources, the rule; surgery.runtime.piecewise, the slot): each stream's first call never
traces a graph of its own, a caller that always runs without a cache still compiles (on its
second call), a stack's standby blocks stay eager meanwhile, and what grew with the cache since
the eager call is marked dynamic for the compile that follows it."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch

from surgery.runtime.apply import apply_manifest
from surgery.runtime.cache_sources import EMPTY_CACHE_NOTE, MAX_DEPTH, filled, mark_grown
from tests.test_piecewise import CACHE, Stack, piecewise_manifest, stream

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PATHS = ["blocks.0", "blocks.1"]


def reset(model: Stack) -> None:
    for b in model.blocks:
        b.k_cache = b.v_cache = None


def test_each_stream_starts_eager_and_decode_is_one_graph() -> None:
    """3 streams of 4 steps: the first step of each (no cache yet) runs eager, the other 3
    run the one dynamic graph; outputs and caches as eager's throughout."""
    from torch._dynamo.utils import counters

    model, ref = Stack(), Stack()
    before = counters["stats"]["unique_graphs"]
    handle = apply_manifest(model, piecewise_manifest(model, PATHS, CACHE))
    for _ in range(3):
        stream(model, ref, 4)
        reset(model)
        reset(ref)
    assert counters["stats"]["unique_graphs"] - before == 1
    for rec in handle.report:
        assert rec.status == "compiled", rec.reason
        assert (rec.empty_cache_calls, rec.eager_calls, rec.compiled_calls) == (3, 3, 9)
        assert rec.compiles == (1 if rec.path == "blocks.0" else 0)  # one shared copy
        assert EMPTY_CACHE_NOTE in rec.notes


def test_a_caller_that_never_keeps_a_cache_compiles_on_its_second_call() -> None:
    """Every call starts from an empty cache (a scorer, not a decoder): the first runs eager,
    the second compiles the empty-cache graph, and from then on it runs compiled."""
    model, ref = Stack(), Stack()
    handle = apply_manifest(model, piecewise_manifest(model, PATHS, CACHE))
    recs = list(handle.report)
    for s in range(4):
        x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
        reset(model)
        reset(ref)
        assert [r.compiled_calls for r in recs] == [s] * 2, s
    assert all(r.empty_cache_calls == 1 and r.status == "compiled" for r in recs)
    assert sum(r.compiles for r in recs) == 1


def test_mark_grown_marks_only_what_grew_since_the_eager_call() -> None:
    before = {"input_ids": (2, 8), "attention_mask": (2, 8), "pos": (1, 1)}
    ids, mask, pos = torch.ones(2, 1), torch.ones(2, 9), torch.ones(1, 1)
    marked = mark_grown(before, ["input_ids"], (ids,), {"attention_mask": mask, "pos": pos,
                                                         "other": torch.ones(3)})
    assert marked == ["attention_mask:1"]  # the prompt's tokens shrank; a size 1 stays static
    assert mark_grown(before, ["input_ids"], (ids,), {"attention_mask": torch.ones(9)}) == []


def test_filled_is_bounded_and_stops_at_the_first_element() -> None:
    empty = [torch.empty(1, 2, 0, 4) for _ in range(100_000)]  # a hostile cache source
    t = time.perf_counter()
    assert not filled(empty)
    assert not filled([*empty, torch.ones(1)])  # past the walk's bound: not looked at
    assert time.perf_counter() - t < 2.0
    deep: list[object] = [torch.ones(1)]
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    assert not filled(deep)
    assert filled({"a": None, "b": [torch.empty(0), (torch.ones(2, 0), torch.ones(1))]})
    assert not filled(torch.nn.Linear(2, 2))  # a module's parameters are no cache


def test_gpt2_stack_that_always_prefills_compiles_on_its_second_forward() -> None:
    """GPT-2 called as ``model(ids)`` (a fresh empty DynamicCache every call): the stack runs
    eager once, its standby blocks eager with it (never piecewise), then compiled."""
    pytest.importorskip("transformers")
    from tests.test_piecewise_stack import ON_CPU, generate, same_as_eager, stack_plan, tiny_gpt2

    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan(), overrides=ON_CPU, passes=0)
    stack = handle.report.by_path("transformer")
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for call in range(3):
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
            assert stack.compiled_calls == call, call
            assert all(handle.report.by_path(p).calls == 0
                       for p in ("transformer.h.0", "transformer.h.1"))
        assert stack.empty_cache_calls == 1 and stack.compiles == 1
        same_as_eager(generate(model, ids, 8), generate(ref, ids, 8))
    assert stack.status == "compiled", stack.reason


def test_a_warm_up_of_prefills_only_says_so() -> None:
    """Warm-up that only ever shows an empty cache proves nothing compiled: the warning says
    why and what to warm up with, the path stays pending and compiles on its first filled call."""
    model, ref = Stack(), Stack()
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(0))

    def one_frame(m: Stack) -> None:
        with torch.no_grad():
            m(x)
        reset(m)

    with pytest.warns(Warning, match="each with an empty cache, which runs eager"):
        handle = apply_manifest(model, piecewise_manifest(model, PATHS, CACHE), passes=1,
                                warmup=one_frame)
    rec = handle.report.by_path("blocks.0")
    assert rec.status == "pending" and rec.compiled_calls == 0 and rec.empty_cache_calls == 1
    stream(model, ref, 3)
    # the stream's first call is the second empty one in a row: it compiles too
    assert rec.status == "compiled" and rec.compiles == 2 and rec.empty_cache_calls == 1
