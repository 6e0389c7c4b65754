"""Regions chosen from evidence (surgery.planning.observe + surgery.planning.evidence): what a run
shows decides."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from surgery.planning.budgets import MAX_SPLIT
from surgery.planning.evidence import RECOMPILE_BUDGET, choose_regions, coverage
from surgery.planning.observation import Observation, fold_times
from surgery.planning.observe import observe


class Mlp(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CachedHead(nn.Module):
    """A head that keeps a growing cache of its inputs; `pre` and `post` are fixed-shape."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.post = Mlp(), Mlp()
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        self.cache.append(h)
        ctx = torch.cat(self.cache, dim=1).mean(dim=1, keepdim=True)
        return self.post(h + ctx)


class IndexedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, global_idx: int) -> torch.Tensor:
        return x + self.mlp(x) * self.scale * (global_idx + 1)


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.stem = Mlp()
        self.blocks = nn.ModuleList(IndexedBlock() for _ in range(blocks))
        self.head = CachedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, blk in enumerate(self.blocks):
            x = blk(x, global_idx=i)
        return self.head(x)


def step(model: nn.Module) -> None:
    with torch.no_grad():
        model(torch.randn(1, 4, 8))


def plan(model: nn.Module, steps: int = 4, **kw):  # type: ignore[no-untyped-def]
    obs = observe(model, step, steps=steps, timed_steps=0)
    return obs, choose_regions(obs, **kw)


def test_growing_cache_head_is_left_out_with_evidence_and_its_fixed_parts_kept() -> None:
    _, choice = plan(Net().eval())
    left = dict(choice.left_out)
    assert "head" not in choice.regions
    assert "attribute `cache`" in left["head"]
    assert "`cat` ran on ([1,4,8]+[1,4,8]) then on ([1,4,8]+[1,4,8]+[1,4,8])" in left["head"]
    assert {"head.pre", "head.post", "stem"} <= set(choice.regions)
    assert choice.evidence["head.post"]["signatures"] == ["x=f32[1,4,8], no_grad"]


def test_per_instance_int_index_within_budget_keeps_the_blocks() -> None:
    _, choice = plan(Net(blocks=3).eval())
    assert {"blocks.0", "blocks.1", "blocks.2"} <= set(choice.regions)
    assert choice.evidence["blocks.2"]["signatures"] == ["x=f32[1,4,8], global_idx=2, no_grad"]


def test_a_group_over_budget_is_split_by_signature_before_anything_is_dropped() -> None:
    n = RECOMPILE_BUDGET + 2  # six global_idx values: two compile groups of 4 and 2
    _, choice = plan(Net(blocks=n).eval())
    assert {f"blocks.{i}" for i in range(n)} <= set(choice.regions)
    blocks = [g for g in choice.groups if g.paths[0].startswith("blocks.")]
    assert sorted(len(g.paths) for g in blocks) == [2, 4]
    assert len({g.name for g in blocks}) == 2 and all(g.name for g in blocks)
    assert all(len(g.sigs) <= RECOMPILE_BUDGET for g in blocks)


def test_per_instance_int_index_beyond_every_split_descends_into_the_blocks() -> None:
    n = RECOMPILE_BUDGET * MAX_SPLIT + 1
    _, choice = plan(Net(blocks=n).eval())
    left = dict(choice.left_out)
    assert not any(r.startswith("blocks.") and r.count(".") == 1 for r in choice.regions)
    assert f"`global_idx` took {n} values (0, 1, 2, 3, ...)" in left["blocks.0"]
    assert "share one compiled callable" in left["blocks.0"]
    assert f"even split into {MAX_SPLIT} groups" in left["blocks.0"]
    # Their MLPs hold one signature between them, so they share one compiled callable.
    assert {f"blocks.{i}.mlp" for i in range(n)} <= set(choice.regions)


class Counter(nn.Module):
    """Called with a frame index that changes every call."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.frames = itertools.count()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, frame=next(self.frames))

    def inner(self, x: torch.Tensor, frame: int) -> torch.Tensor:
        return self.mlp(x) + frame


class Framed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Stepper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x, global_idx=self.body.seen)


class Stepper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.seen = 0

    def forward(self, x: torch.Tensor, global_idx: int) -> torch.Tensor:
        return self.mlp(x) * (global_idx + 1)


def test_int_index_changing_every_call_is_left_out_and_named() -> None:
    model = Framed().eval()

    def stepping(m: nn.Module) -> None:
        step(m)
        m.body.seen += 1

    obs = observe(model, stepping, steps=6, timed_steps=0)
    choice = choose_regions(obs)
    left = dict(choice.left_out)
    assert "`global_idx` took 6 values (0, 1, 2, 3, ...)" in left["body"]
    assert "body.mlp" in choice.regions


class Flipper(nn.Module):
    """Calls one shared MLP under bf16 autocast and with autocast off, as heads do."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = Mlp()
        self.tail = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = self.shared(x)
        with torch.autocast("cpu", enabled=False):
            b = self.shared(x)
        return self.tail(a.float() + b)


def test_autocast_flip_is_a_change() -> None:
    _, choice = plan(Flipper().eval())
    left = dict(choice.left_out)
    assert "shared" not in choice.regions
    assert "called under 2 autocast/grad states" in left["shared"]
    assert "autocast(cpu,bf16)" in left["shared"]
    assert "tail" in choice.regions


def test_no_state_and_one_signature_makes_the_whole_subtree_one_region() -> None:
    model = nn.Sequential(Mlp(), Mlp()).eval()
    _, choice = plan(model)
    assert choice.regions == ["0", "1"]  # the root itself is never a region


def test_single_op_modules_are_not_worth_a_graph() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Mlp()).eval()
    _, choice = plan(model)
    assert choice.regions == ["1"]


def test_method_regions_are_judged_by_evidence() -> None:
    from surgery.examples import stream_step, tiny

    model = tiny().eval()
    methods = [f"aggregator.global_blocks.{i}.{m}" for i in range(2)
               for m in ("attn_pre", "ffn_residual")]
    obs = observe(model, stream_step, steps=3, timed_steps=0, methods=methods)
    choice = choose_regions(obs, methods=methods)
    assert set(methods) <= set(choice.regions)
    left = dict(choice.left_out)
    assert "attribute `kv_cache`" in left["aggregator.global_blocks.0"]
    # The MLP runs only inside ffn_residual, which is a region: it is not a second one.
    assert left["aggregator.global_blocks.0.mlp"] == \
        "runs only inside region aggregator.global_blocks.0.ffn_residual"
    assert sig_of(choice, "aggregator.global_blocks.0.attn_pre") == ["x=f32[1,6,32], no_grad"]


def sig_of(choice, path):  # type: ignore[no-untyped-def]
    return choice.evidence[path]["signatures"]


def test_injected_clock_gives_total_and_self_times() -> None:
    """A clock that ticks 1 ms a reading and nothing else: the modules cost nothing, and every
    span is the hooks' own part (one tick), which the calibration measures and takes off."""
    ticks = itertools.count()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    obs = observe(model, lambda m: m(torch.randn(2, 8)), steps=1, timed_steps=1,
                  clock=lambda: next(ticks) / 1e3)
    # Ticks: a bare step (start, end: 1 ms); calibration: a hooked nn.Identity's span is one
    # tick, a hook pair two; then one pass a level: the root (start, pre, post, end: 3 ms), its
    # two children (5 ms).
    assert obs.clock == "injected" and obs.timing_passes == 2
    assert obs.bare_step_ms == pytest.approx(1.0) and obs.hooked_step_ms == pytest.approx(5.0)
    assert obs.hook_ms_per_call == pytest.approx(1.0) and obs.hook_pair_ms == pytest.approx(2.0)
    assert obs.total_ms == pytest.approx({"": 0.0, "0": 0.0, "1": 0.0})
    assert obs.step_ms == pytest.approx(1.0)  # the bare step, not the root's hooks


def test_a_step_through_forward_is_timed_around_the_step() -> None:
    """A step that calls model.forward(x) never fires the root's hooks: the step is still
    timed, and its children's calls are its share (issue 18, cause 1)."""
    model = nn.Sequential(Mlp(), Mlp()).eval()
    obs = observe(model, lambda m: m.forward(torch.randn(2, 8)), steps=2, timed_steps=2)
    assert "" not in obs.total_ms  # the root was never called through __call__
    assert obs.step_ms > 0 and obs.clock == "perf_counter"
    choice = choose_regions(obs)
    assert choice.regions == ["0", "1"]
    assert choice.coverage["covered_share"] > 0


def test_coverage_arithmetic() -> None:
    obs = Observation(timed_steps=2, clock="injected")
    # One step (the timed calls are one step's, surgery.planning.level_timing): root 10 ms = a
    # (region, 4 ms, r inside 1 ms) + b (5 ms: b.y region 2 ms, r outside any region 1 ms) +
    # 1 ms of the root's own.
    one = [("", -1, 10.0), ("a", 0, 4.0), ("r", 1, 1.0), ("b", 0, 5.0), ("b.y", 3, 2.0),
           ("r", 3, 1.0)]
    fold_times(obs, one)
    obs.step_ms = 10.0
    cov = coverage(obs, ["a", "b.y", "r"])
    # a (4) + b.y (2) + r outside a (1): 7 of 10; r inside a counts once, inside a.
    assert cov["covered_ms"] == 7.0
    assert cov["covered_share"] == 0.7
    rest = {r["path"]: r["ms"] for r in cov["remainder"]}
    assert rest == {"b": 2.0, "(model)": 1.0}
    assert coverage(obs, [])["covered_share"] == 0.0
    assert coverage(obs, ["a", "b"])["covered_share"] == 0.9


@pytest.mark.parametrize("steps", [pytest.param(1, id="one-step"), pytest.param(3, id="three")])
def test_observe_restores_the_model(steps: int) -> None:
    from surgery.examples import tiny

    model = tiny().eval()
    blk = model.aggregator.global_blocks[0]
    observe(model, step=lambda m: m(m.example_input()), steps=steps, timed_steps=1,
            methods=["aggregator.global_blocks.0.attn_pre"])
    assert "attn_pre" not in vars(blk)
    assert not blk._forward_hooks and not blk._forward_pre_hooks


class LazyTable(nn.Module):
    """Builds a lookup table on its first call only, as rotary embeddings often do."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, 8).sin()
        return self.mlp(x) * self.table


def test_state_set_up_on_the_first_step_only_is_not_streaming_state() -> None:
    model = nn.Sequential(LazyTable(), Mlp()).eval()
    _, choice = plan(model, steps=3)
    assert "0" in choice.regions
    # With one step there is nothing after it to judge by: the change is evidence again.
    _, one = plan(nn.Sequential(LazyTable(), Mlp()).eval(), steps=1)
    assert "attribute `table`" in dict(one.left_out)["0"]
