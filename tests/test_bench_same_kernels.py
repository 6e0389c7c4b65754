"""benchmarks/_same_kernels.py: the region digests and census comparisons gpu_warm_start.py
prints to say where a warm (or second cold) process parts from the cold one."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _same_kernels


@dataclass
class _Rec:
    path: str
    callable: str = "forward"
    status: str = "compiled"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _digest(net: nn.Module, x: torch.Tensor, records: list[_Rec]) -> _same_kernels.RegionDigests:
    d = _same_kernels.RegionDigests(net, records, lambda out: [out])
    with d.collect():
        net(x)
    return d


def test_checksum_sees_one_byte_and_a_swap() -> None:
    t = torch.arange(8, dtype=torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.int16)[3] += 1  # one step of bf16, as Flux's warm output differed
    swapped = t.clone()[[1, 0, 2, 3, 4, 5, 6, 7]]
    base = _same_kernels.checksum(t)
    assert base == _same_kernels.checksum(t.clone())
    assert base != _same_kernels.checksum(flipped)
    assert base[0] == _same_kernels.checksum(swapped)[0]  # the plain sum cannot tell
    assert base != _same_kernels.checksum(swapped)  # the weighted one does


def test_the_first_differing_region_call_is_named() -> None:
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4)
    records = [_Rec("blocks.0"), _Rec("blocks.1"), _Rec("blocks.1", callable="helper"),
               _Rec("blocks.0", status="eager")]
    cold = _digest(net, x, records)
    assert [p for p, _ in cold.calls] == ["blocks.0", "blocks.1"]
    assert cold.skipped == ["blocks.1.helper"]  # a method region has no hook point: said
    same = _same_kernels.first_difference(cold.calls, _digest(net, x, records).calls)
    assert same["compared"] == 2 and same["differing_calls"] == 0
    with torch.no_grad():
        net.blocks[1].bias[0] += 1e-3  # the second region computes differently
    other = _same_kernels.first_difference(cold.calls, _digest(net, x, records).calls)
    assert other["differing_calls"] == 1 and other["first_path"] == "blocks.1"
    assert _same_kernels.first_difference([], cold.calls)["compared"] == 0  # never "same"


def test_census_comparison_names_the_kernel_whose_config_differs() -> None:
    cold = {"code": ["a"], "triton": {"h1": {"name": "k1", "config": "A"},
                                      "h2": {"name": "k2", "config": "A"}}}
    warm = {"code": ["a"], "triton": {"h1": {"name": "k1", "config": "A"},
                                      "h2": {"name": "k2", "config": "B"}}}
    got = _same_kernels.compare_census(cold, warm)
    assert got["configs_differ"] == [["k2", "A", "B"]] and not got["same"]
    assert _same_kernels.compare_census(cold, cold)["same"]
    assert not _same_kernels.compare_census(cold, {**cold, "code": ["b"]})["same"]


def test_a_kernel_launched_with_two_configs_in_one_process_is_not_the_same() -> None:
    """One config per hash agrees, yet the cold process launched that kernel with two configs in
    two graphs (the H200's Flux, ninth session): the comparison must not read "same"."""
    one = {"code": ["x"], "triton": {"h": {"name": "k", "config": "B"}}, "split": {}}
    split = {**one, "split": {"h": ["A", "B"]}}
    assert _same_kernels.compare_census(one, one)["same"]
    got = _same_kernels.compare_census(split, one)
    assert not got["same"] and got["split_cold"] == 1 and got["n_configs_differ"] == 0
    assert not _same_kernels.compare_census(one, split)["same"]


def test_turns_alternate_the_order_and_compare_each_round(monkeypatch) -> None:
    """_warm_turns.alternate: the first arm goes first in even rounds only, every frame is timed
    once, and a round counts as identical only when both outputs are equal bit for bit."""
    import _warm_turns

    order: list[str] = []
    outs = {"a": [torch.ones(3)] * 4, "b": [torch.ones(3), torch.ones(3) + 1e-3,
                                            torch.ones(3), torch.ones(3)]}

    def frame(arm: str):
        def f():
            order.append(arm)
            return outs[arm][sum(x == arm for x in order) - 1]
        return f

    monkeypatch.setattr(_warm_turns, "time_call",
                        lambda fn, cuda: (fn(), 1.0, None))
    got = _warm_turns.alternate({"a": frame("a"), "b": frame("b")}, rounds=4,
                                tensors=lambda y: [y], cuda=False, mark_step=lambda: None)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert got["ms"] == {"a": [1.0] * 4, "b": [1.0] * 4}
    assert got["identical"] == 3 and abs(got["max_diff"] - 1e-3) < 1e-6


def test_the_benchmarks_overrides_turn_rblock_scaling_on_only_when_asked(monkeypatch) -> None:
    monkeypatch.delenv(_same_kernels.SCALE_RBLOCK_ENV, raising=False)
    assert _same_kernels.overrides(True) == {}
    assert _same_kernels.overrides(False) == {"on_cpu": "compile"}
    monkeypatch.setenv(_same_kernels.SCALE_RBLOCK_ENV, "1")
    assert _same_kernels.overrides(True) == {"options": {"dynamic_scale_rblock": True}}


def test_rblock_turns_that_compiled_nothing_or_ran_the_wrong_setting_say_so() -> None:
    """An R-block A/B whose arm compiled nothing, or ran without the setting it was meant to
    test, is flagged, not printed as a figure; on CUDA with both settings shown it is not."""
    import _warm_turns
    import gpu_warm_start

    good = {"model": "m", "rounds": 2, "off_median_ms": 1.0, "on_median_ms": 1.0,
            "on_over_off_median": 1.0, "on_over_off_range": [1.0, 1.0], "off_peak_gib": 1.0,
            "on_peak_gib": 1.0, "off_scale_rblock": ["False"], "on_scale_rblock": ["True"],
            "off_compiled_paths": 3, "on_compiled_paths": 3, "identical_rounds": 2}
    assert _warm_turns.rblock_ab_problem(good, True) == ""
    assert "not on CUDA" in _warm_turns.rblock_ab_problem(good, False)
    assert "compiled no region path" in _warm_turns.rblock_ab_problem(
        {**good, "on_compiled_paths": 0}, True)
    assert "not ['False']" in _warm_turns.rblock_ab_problem(
        {**good, "off_scale_rblock": ["None"]}, True)
    bad = {**good, "ab_problem": _warm_turns.rblock_ab_problem(
        {**good, "off_compiled_paths": 0}, True)}
    assert any("WARNING: NOT AN A/B" in line for line in gpu_warm_start.rblock_lines(bad))
    assert not any("WARNING" in line for line in gpu_warm_start.rblock_lines(
        {**good, "ab_problem": ""}))
