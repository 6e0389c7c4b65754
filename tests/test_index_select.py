"""surgery.runtime.index_select: an int that only selects a cache slot is not passed to dynamo.

The end-to-end check (the camera trunk's instances share their graphs, outputs and caches equal
eager's every frame) is tests/test_streaming.py::
test_indexed_camera_trunk_compiles_no_graph_while_its_window_fills.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import surgery.runtime.index_select as index_select
from surgery.examples.sdpa import CameraBlock
from surgery.runtime.index_select import IndexSelect, find_index_select


def selects(x: Any, cache: Any, global_idx: int, window: int) -> Any:
    slot = cache[global_idx]
    slot.append(x)
    if len(slot) > window:
        slot.pop(0)
    return torch.cat(slot)


def reads_length(x: Any, cache: Any, global_idx: int) -> Any:
    return cache[global_idx], len(cache)


def reads_neighbour(x: Any, cache: Any, global_idx: int) -> Any:
    return cache[global_idx - 1]


def assigns_slot(x: Any, cache: Any, global_idx: int) -> Any:
    cache[global_idx] = [x]
    return x


def branches_on_index(x: Any, cache: Any, global_idx: int) -> Any:
    return cache[global_idx] if global_idx else x


def passes_cache_on(x: Any, cache: Any, global_idx: int) -> Any:
    return selects(x, cache, global_idx, 2)


def rebinds_index(x: Any, cache: Any, global_idx: int) -> Any:
    global_idx = 0
    return cache[global_idx]


def reads_locals(x: Any, cache: Any, global_idx: int) -> Any:
    return cache[global_idx], locals()


def rebinds_by_import(x: Any, cache: Any, global_idx: int) -> Any:
    import math as global_idx
    return cache[global_idx]


def rebinds_by_except(x: Any, cache: Any, global_idx: int) -> Any:
    try:
        return cache[global_idx]
    except IndexError as global_idx:
        return x


def rebinds_by_match(x: Any, cache: Any, global_idx: int) -> Any:
    match x:
        case [*global_idx]:
            return cache[global_idx]
    return x


def shadows_in_lambda(x: Any, cache: Any, global_idx: int) -> Any:
    f = lambda cache: cache  # noqa: E731
    return cache[global_idx], f


def never_reads_cache(x: Any, cache: Any, global_idx: int) -> Any:
    return x


@pytest.mark.parametrize("fn", [
    pytest.param(reads_length, id="len-of-cache"),
    pytest.param(reads_neighbour, id="other-slot"),
    pytest.param(assigns_slot, id="assigns-slot"),
    pytest.param(branches_on_index, id="index-in-branch"),
    pytest.param(passes_cache_on, id="cache-passed-on"),
    pytest.param(rebinds_index, id="index-rebound"),
    pytest.param(rebinds_by_import, id="index-rebound-by-import"),
    pytest.param(rebinds_by_except, id="index-rebound-by-except"),
    pytest.param(rebinds_by_match, id="index-rebound-by-match"),
    pytest.param(reads_locals, id="locals"),
    pytest.param(shadows_in_lambda, id="lambda-parameter"),
    pytest.param(never_reads_cache, id="no-use"),
])
def test_an_index_with_another_use_is_left_alone(fn: Any) -> None:
    assert find_index_select(fn, ["x", "cache", "global_idx"], ["cache"]) is None


def test_the_camera_blocks_index_only_selects() -> None:
    names = ["x", "cache", "global_idx", "window"]
    assert find_index_select(CameraBlock.forward, names, ["cache"]) == \
        IndexSelect("cache", "global_idx", tuple(names))
    assert find_index_select(selects, names, ["cache"]) is not None
    assert find_index_select(selects, names, ["other"]) is None  # not a list-cache source


def test_no_source_or_switched_off_leaves_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    ns: dict[str, Any] = {}
    exec("def made(x, cache, global_idx):\n    return cache[global_idx]\n", ns)  # no file
    assert find_index_select(ns["made"], ["x", "cache", "global_idx"], ["cache"]) is None
    monkeypatch.setattr(index_select, "SELECT_SLOTS", False)
    assert find_index_select(selects, ["x", "cache", "global_idx"], ["cache"]) is None


def test_the_call_gets_the_slot_object_and_index_zero() -> None:
    sel = IndexSelect("cache", "global_idx", ("x", "cache", "global_idx", "window"))
    cache: list[list[torch.Tensor]] = [[], [], []]
    x = torch.ones(2)
    args, kwargs = sel.rewrite((x, cache), {"global_idx": 2, "window": 1}) or ((), {})
    assert args[1] == [cache[2]] and args[1][0] is cache[2] and kwargs["global_idx"] == 0
    selects(*args, **kwargs)  # the append lands in the real slot, and only there
    assert len(cache[2]) == 1 and cache[0] == [] and cache[1] == []
    args, kwargs = sel.rewrite((x, tuple(cache), -1, 1), {}) or ((), {})
    assert args[1] == (cache[2],) and args[2] == 0 and kwargs == {}


class _Slots(list):  # a subclass may index otherwise
    pass


@pytest.mark.parametrize("cache,idx", [
    pytest.param([[], []], 2, id="out-of-range"),
    pytest.param([[], []], True, id="bool-index"),
    pytest.param([[], []], 1.0, id="float-index"),
    pytest.param(_Slots([[], []]), 0, id="list-subclass"),
    pytest.param({0: []}, 0, id="dict"),
])
def test_a_call_that_does_not_qualify_goes_on_unchanged(cache: Any, idx: Any) -> None:
    sel = IndexSelect("cache", "global_idx", ("x", "cache", "global_idx"))
    assert sel.rewrite((None, cache, idx), {}) is None
    assert sel.rewrite((None,), {"cache": cache}) is None  # the index not passed at all
