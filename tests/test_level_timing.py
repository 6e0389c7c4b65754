"""Module shares on a launch-bound step (surgery.planning.level_timing, issue 18).

A virtual clock stands in for a GPU that waits on its host: every module costs exactly the host
time to launch its kernels (forward hooks advance NOW by it), the step spends hook-free host time
outside the model (a generate loop's sampler), and every reading of the clock costs HOOK of host
time, as a hook's mark does. The true shares are then known exactly, and they must not move when
the hooks get dearer. With hooks on every module at once (the method before level timing, its
spans corrected by the average hook cost but never below bare / hooked of themselves) the
GPT-2-like MLP, four child calls around little work, went from 13.6% (hooks of 0.5 us a reading)
to 26.9% (40 us) of the step, against a true 12.9%: its share became a count of nested hooks.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from surgery.planning.evidence import coverage, shares
from surgery.planning.observe import observe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NOW = [0.0]  # the virtual clock (s)
HOOK = [0.0]  # what one reading of it costs (s): a timing hook's host time
US = 1e-6


def read_clock() -> float:
    NOW[0] += HOOK[0]
    return NOW[0]


class Leaf(nn.Module):
    """One module of a few launches: ``cost`` seconds of host time, the GPU idle meanwhile."""

    def __init__(self, cost: float) -> None:
        super().__init__()
        self.cost = cost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOW[0] += self.cost
        return x


class Mlp(nn.Module):  # GPT2MLP: c_fc, act (NewGELU: eight small ops), c_proj, dropout
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.act, self.c_proj, self.drop = (Leaf(5 * US), Leaf(40 * US), Leaf(5 * US),
                                                       Leaf(0.5 * US))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


class Attn(nn.Module):  # c_attn, the attention's own ops (split, SDPA, merge), c_proj, dropouts
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = Leaf(5 * US), Leaf(5 * US)
        self.drop1, self.drop2 = Leaf(0.5 * US), Leaf(0.5 * US)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop1(self.c_attn(x))
        NOW[0] += 60 * US
        return self.drop2(self.c_proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = Leaf(5 * US), Attn(), Leaf(5 * US), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x))
        NOW[0] += 5 * US  # the residual adds
        return self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block() for _ in range(n))
        self.head = Leaf(20 * US)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        return self.head(x)


# A step's own host time outside the model (generate's sampler, stopping criteria, cache
# updates): on an H200 about a third of GPT-2's bare generate() step; here 60%.
OUTSIDE = 4000 * US
TOKENS = 4
X = torch.zeros(1)


def decode(m: nn.Module) -> None:
    for _ in range(TOKENS):
        m(X)
        NOW[0] += OUTSIDE / TOKENS


MLP_US = 50.5  # the true figures, from the costs above
ATTN_US = 71.0
BLOCK_US = 5 + ATTN_US + 5 + 5 + MLP_US
STEP_US = TOKENS * (4 * BLOCK_US + 20) + OUTSIDE / US


def _observe(hook_us: float, model: nn.Module | None = None):  # type: ignore[no-untyped-def]
    HOOK[0] = hook_us * US
    try:
        return observe(model or Decoder().eval(), decode, steps=2, timed_steps=2,
                       clock=read_clock)
    finally:
        HOOK[0] = 0.0


def _group(share: dict[str, float], leaf: str) -> float:
    return sum(v for k, v in share.items() if k.endswith(f".{leaf}"))


@pytest.mark.parametrize("hook_us", [pytest.param(0.5, id="cheap-hooks"),
                                     pytest.param(8.0, id="hooks-like-launches"),
                                     pytest.param(40.0, id="a-fast-gpu-host")])
def test_shares_on_a_launch_bound_step_do_not_move_with_the_hooks_cost(hook_us: float) -> None:
    obs = _observe(hook_us)
    share = shares(obs)
    step = STEP_US + hook_us  # the bare step, and the one reading of the clock that ends it
    assert obs.step_ms == pytest.approx(step / 1e3)
    true_mlp = TOKENS * 4 * MLP_US / step  # 12.9%: the method before said 13.6% to 26.9%
    true_attn = TOKENS * 4 * ATTN_US / step
    # The hooks added to the step (the slowest pass), but not to any span.
    assert obs.hooked_step_ms > obs.bare_step_ms
    assert _group(share, "mlp") == pytest.approx(true_mlp, abs=2e-3)
    assert _group(share, "attn") == pytest.approx(true_attn, abs=2e-3)
    assert share[""] == pytest.approx(1 - (OUTSIDE / US + hook_us) / step, abs=2e-3)
    assert share["h.0.mlp.act"] == pytest.approx(TOKENS * 40 / step, abs=1e-3)
    assert obs.hook_ms_per_call == pytest.approx(hook_us / 1e3)
    assert obs.hook_pair_ms == pytest.approx(2 * hook_us / 1e3)
    assert obs.timing_passes == 4  # the root; h.N and head; ln, attn, mlp; their leaves


def test_the_mlps_coverage_is_the_same_on_a_slow_and_a_fast_host() -> None:
    """The figure choose_piecewise reads: the plain plan's coverage of the step (GPT-2's plain
    plan in generate() is its MLPs: the attention keeps a cache)."""
    mlps = [f"h.{i}.mlp" for i in range(4)]
    slow, fast = (coverage(_observe(h), mlps)["covered_share"] for h in (0.5, 40.0))
    assert slow == pytest.approx(fast, abs=2e-3)
    assert fast == pytest.approx(TOKENS * 4 * MLP_US / STEP_US, abs=2e-3)


class RopeBlock(Block):
    def forward(self, x: torch.Tensor, rope: nn.Module) -> torch.Tensor:  # type: ignore[override]
        return super().forward(rope(x))


class Shared(nn.Module):
    """A module called at two depths: by the root, and inside every block."""

    def __init__(self) -> None:
        super().__init__()
        self.rope = Leaf(10 * US)
        self.h = nn.ModuleList(RopeBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rope(x)
        for b in self.h:
            x = b(x, self.rope)
        return x


def test_a_module_called_at_two_depths_nests_in_its_level_and_a_hook_pair_comes_off() -> None:
    """rope's level is 1 (the root calls it), as the blocks' is: in that pass each block's span
    holds a hooked call of rope, and a whole hook pair is taken off for it."""
    obs = _observe(30.0, Shared().eval())
    assert obs.total_ms["rope"] == pytest.approx(TOKENS * 3 * 10 / 1e3, rel=1e-3)
    assert obs.total_ms["h.0"] == pytest.approx(TOKENS * (BLOCK_US + 10) / 1e3, rel=1e-3)
    assert obs.self_ms["h.0"] == pytest.approx(TOKENS * 5 / 1e3, rel=1e-3)  # the residual adds


class Branchy(Decoder):
    """A step that runs its head on every third call only: one or two heads a step of 4 calls,
    in other places each step."""

    def __init__(self) -> None:
        super().__init__(n=2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        self.calls += 1
        return self.head(x) if self.calls % 3 == 0 else x


def test_a_step_that_branches_gets_each_paths_mean() -> None:
    """The timed steps call the head once or twice (20 us a call): it gets the mean of its
    pass's steps, 20 to 40 us, where matching calls by position would misplace them."""
    obs = _observe(8.0, Branchy().eval())
    assert 20 / 1e3 <= obs.total_ms["head"] <= 40 / 1e3
    assert obs.total_ms["h.1"] == pytest.approx(TOKENS * BLOCK_US / 1e3, rel=1e-3)


# GPT-2 in generate() on the virtual clock: each module class costs its own host time (the
# GPU idle meanwhile); the step's own Python outside the model costs OUTSIDE_GPT2 a step.
GPT2_COST_US = {"Conv1D": 5.0, "NewGELUActivation": 40.0, "Dropout": 0.5, "LayerNorm": 5.0,
                "GPT2Attention": 60.0, "GPT2Block": 5.0, "Embedding": 5.0, "Linear": 20.0,
                "GPT2Model": 5.0}
OUTSIDE_GPT2 = 2000 * US


@pytest.mark.parametrize("hook_us", [pytest.param(0.5, id="a-slow-host"),
                                     pytest.param(40.0, id="a-fast-gpu-host")])
def test_gpt2_generate_is_planned_with_its_stack_whatever_the_hooks_cost(hook_us: float) -> None:
    """The plan the H200 lost: GPT-2's MLPs are the same share of the step on either host, and
    the plan is piecewise by default on both (surgery.planning.compile_cost.choose_piecewise)."""
    pytest.importorskip("transformers")
    from test_evidence_cache import generate, gpt2

    from surgery.formats.manifest import PIECEWISE_KIND
    from surgery.planning.observed import plan_from_step

    model = gpt2()

    def advance(m: nn.Module, args: object, out: object) -> None:
        NOW[0] += GPT2_COST_US.get(type(m).__name__, 0.0) * US

    def step(m: nn.Module) -> None:
        generate(m)
        NOW[0] += OUTSIDE_GPT2

    hooks = [m.register_forward_hook(advance) for m in model.modules()]
    HOOK[0] = hook_us * US
    try:
        m = plan_from_step(model, step, steps=2, timed_steps=2, clock=read_clock)
    finally:
        HOOK[0] = 0.0
        for h in hooks:
            h.remove()
    cov = m.coverage
    assert cov is not None and cov["piecewise_regions"] > 0
    assert any(r.kind == PIECEWISE_KIND for r in m.regions)
    # 8 forwards (the prompt, then 7 of the 8 new tokens) of 2 blocks' MLPs: 50.5 us each
    forwards, mlp_us = 8, 2 * 5.0 + 40.0 + 0.5
    step_us = cov["step_ms"] * 1e3
    assert cov["plain_covered_share"] == pytest.approx(forwards * 2 * mlp_us / step_us, abs=2e-3)


class GrowingBlock(nn.Module):
    """A block that costs 100 us plus 10 us a call seen before (attention over a growing cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOW[0] += (100 + 10 * self.seen) * US
        self.seen += 1
        return x


def test_the_levels_take_turns_so_a_growing_stream_times_them_at_the_same_length() -> None:
    """The root and its block are timed in different passes. One pass after the other, the
    block's fastest step would come 3 steps (30 us) later in the stream than the root's; taking
    turns, one (10 us)."""
    model = nn.Sequential(GrowingBlock()).eval()
    obs = observe(model, lambda m: m(X), steps=1, timed_steps=3, clock=read_clock)
    gap_us = (obs.total_ms["0"] - obs.total_ms[""]) * 1e3  # the root holds nothing but the block
    assert 0 < gap_us <= 10.0 + 1e-6, gap_us


class WarmingBlock(nn.Module):
    """A block whose first calls are slow and the rest fast: a stream's first frames on a GPU,
    whose caches' growing tensors are still allocated anew (the SDPA example on the H200)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOW[0] += (600 if self.seen < 4 else 100) * US
        self.seen += 1
        return x


def test_the_bare_steps_take_turns_with_the_passes_so_a_warming_stream_is_all_covered() -> None:
    """The root holds nothing but the block, so the block is all of the step. Bare steps timed
    before the passes saw only slow frames (600 us) and the spans only fast ones (100 us): 83% of
    the step came out "outside every module call". Taking turns, both see the fast ones."""
    model = nn.Sequential(WarmingBlock()).eval()
    obs = observe(model, lambda m: m(X), steps=1, timed_steps=3, clock=read_clock)
    cov = coverage(obs, ["0"])
    assert obs.step_ms == pytest.approx(0.1), obs.step_ms
    assert cov["covered_share"] >= 0.99, cov


class SlowlyWarmingBlock(nn.Module):
    """A block 100 us faster each call for its first nine calls, then 100 us a call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOW[0] += max(100, 1000 - 100 * self.seen) * US
        self.seen += 1
        return x


def test_the_step_settles_before_timing_so_a_stream_that_gets_faster_is_all_covered() -> None:
    """Taking turns is not enough while every step is faster than the last: in each round the
    block, timed after the root, saw a faster model, and at 100 us a step less the root came out
    at 2x its only child (coverage 33%). Bare steps run first until the step stops getting
    faster; a model that gets slower (a growing cache) settles in three."""
    model = nn.Sequential(SlowlyWarmingBlock()).eval()
    obs = observe(model, lambda m: m(X), steps=1, timed_steps=3, clock=read_clock)
    assert coverage(obs, ["0"])["covered_share"] >= 0.99
    assert obs.settle_steps == 11, obs.settle_steps  # 900 .. 100 us, then 100 and 100 again
    grow = observe(nn.Sequential(GrowingBlock()).eval(), lambda m: m(X), steps=1, timed_steps=3,
                   clock=read_clock)
    assert grow.settle_steps == 3, grow.settle_steps


def test_the_observation_keeps_each_passs_step_and_every_bare_step() -> None:
    """What a benchmark reads to tell a stream's drift from a span that is wrong: one fastest
    step a timing pass (root's level first) and every bare step of the rounds."""
    obs = observe(nn.Sequential(GrowingBlock()).eval(), lambda m: m(X), steps=1, timed_steps=3,
                  clock=read_clock)
    assert len(obs.pass_step_ms) == obs.timing_passes == 2
    assert len(obs.bare_steps_ms) == 3
    # the block grows 10 us a call: bare, root's pass, block's pass take turns, so the root's
    # pass (timed first in its last round) ran a faster step than the block's
    assert obs.pass_step_ms[0] < obs.pass_step_ms[1]
    assert min(obs.bare_steps_ms) == pytest.approx(obs.bare_step_ms)
