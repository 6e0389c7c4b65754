"""What an evidence plan costs to compile (surgery.planning.compile_cost, issue 18): a small
compile group the names-only plan does not have is light (aot_eager under region capture, left
out without it), names groups never are, and the plan's estimated compiles are what the runtime
compiles."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from surgery import apply_manifest
from surgery.planning.compile_cost import LIGHT_BACKEND, LIGHT_SHARE, weigh_compile_cost
from surgery.planning.evidence import choose_regions
from surgery.planning.observe import observe
from surgery.planning.observed import plan_from_step
from surgery.planning.plan import compile_defaults
from surgery.runtime.compile_options import plan_region

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fates import assert_one_fate

X = torch.randn(32, 64)
NOW = [0.0]  # a virtual clock (s): each module adds its cost when it runs, the hooks add none


def virtual_time(model: nn.Module, cost: dict[type, float]) -> list[object]:
    """Hooks that advance NOW by each module's cost: shares of the step exactly as given."""
    def advance(m: nn.Module, args: object, out: object) -> None:
        NOW[0] += cost.get(type(m), 0.0)

    return [m.register_forward_hook(advance) for m in model.modules()]


def _plan(model: nn.Module, **kw):  # type: ignore[no-untyped-def]
    """An evidence plan where a block costs 1 ms and the embed 10 us (0.25% of the step)."""
    hooks = virtual_time(model, {Block: 1e-3, Embed: 1e-5})
    try:
        return plan_from_step(model, step, steps=2, timed_steps=3, clock=lambda: NOW[0], **kw)
    finally:
        for h in hooks:
            h.remove()  # type: ignore[attr-defined]


class Embed(nn.Module):
    """Like Flux's time_text_embed: a few small ops, found by the evidence only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.b(nn.functional.silu(self.a(t))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.fc1(x).relu()) * s.mean()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.embed(x[:1, :8])
        for b in self.blocks:
            x = b(x, s)
        return x


def step(m: nn.Module) -> None:
    with torch.no_grad():
        m(X)


def _regions(manifest):  # type: ignore[no-untyped-def]
    return {p: r for r in manifest.regions for p in r.paths}


def test_a_small_group_new_to_the_names_plan_compiles_light_and_the_figures_hold() -> None:
    model = Net().eval()
    m = _plan(model, compile=compile_defaults())
    regions = _regions(m)
    assert "embed" in regions and "blocks.0" in regions, sorted(regions)
    assert regions["embed"].compile.get("backend") == LIGHT_BACKEND
    assert 0.002 < regions["embed"].evidence["share"] < LIGHT_SHARE
    assert "backend" not in regions["blocks.0"].compile  # a names group: as names compiles it
    cov = m.coverage
    assert cov["light_groups"] == 1 and cov["compile_groups"] == 2
    assert cov["inductor_groups"] == 1 and cov["regions"] == 5
    assert cov["names_compile_groups"] == 1
    # On a GPU (region capture) the light region is traced by aot_eager and captured; the blocks
    # compile with inductor, as the names-only plan's do.
    on_gpu = {p: plan_region(m, r, overrides=None, on_cuda=True) for p, r in regions.items()}
    assert on_gpu["embed"].backend == LIGHT_BACKEND and on_gpu["embed"].capture_region
    assert on_gpu["blocks.0"].backend == "inductor" and on_gpu["blocks.0"].capture_region
    # The estimate is what the runtime compiles (here with the eager backend, the same count).
    torch._dynamo.reset()
    handle = apply_manifest(model, m, warmup=step,
                            overrides={"on_cpu": "compile", "backend": "eager"})
    try:
        recs = list(handle.report)
        assert all(r.status == "compiled" for r in recs)
        assert sum(r.compiles for r in recs) == cov["estimated_compiles"] == 2
    finally:
        handle.restore()


def test_without_region_capture_a_light_group_is_left_out_with_its_reason() -> None:
    model = Net().eval()
    m = _plan(model, compile=compile_defaults(capture="compiler"))
    left = assert_one_fate(model, m)
    assert "embed" not in _regions(m)
    assert left["embed"].startswith("not worth its compile")
    assert left["embed.a"] == "inside embed, which is left out as not worth its compile"
    assert m.coverage["light_groups"] == 0 and m.coverage["compile_groups"] == 1


def test_names_groups_are_never_light_and_a_large_group_is_not() -> None:
    """The rule on given shares: new and under LIGHT_SHARE is light; a names group or one at
    LIGHT_SHARE or more compiles with inductor."""
    obs = observe(Net().eval(), step, steps=2, timed_steps=0)
    choice = choose_regions(obs)
    assert [g.paths[0] for g in choice.groups] == ["embed", "blocks.0"]
    obs.clock = "injected"  # as if timed: the shares below are the ones weighed
    table = compile_defaults()
    small = {p: 0.001 for p in ("embed", *(f"blocks.{i}" for i in range(4)))}
    w = weigh_compile_cost(obs, choice.groups, ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
                           small, compile=table)
    assert w.light == {"embed"}, w.light
    w = weigh_compile_cost(obs, choice.groups, ["embed"], small, compile=table)
    assert "embed" not in w.light, "a names group compiled light"
    assert "blocks.0" in w.light  # now the blocks are the small group new to the names plan
    w = weigh_compile_cost(obs, choice.groups, [], {**small, "embed": LIGHT_SHARE}, compile=table)
    assert "embed" not in w.light
    # Another backend for the whole plan: nothing to weigh.
    w = weigh_compile_cost(obs, choice.groups, [], small,
                           compile=compile_defaults(backend="aot_eager"))
    assert w.light == set() and w.figures["inductor_compiles"] == 0


@pytest.mark.cuda
def test_on_the_gpu_a_light_region_is_traced_by_aot_eager_and_replays_its_graph() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the GPU machine")
    torch._dynamo.reset()
    model = Net().cuda().eval()
    x = X.cuda()

    def gpu_step(m: nn.Module) -> None:
        with torch.no_grad():
            m(x)

    hooks = virtual_time(model, {Block: 1e-3, Embed: 1e-5})
    try:
        m = plan_from_step(model, gpu_step, steps=2, timed_steps=3, clock=lambda: NOW[0])
    finally:
        for h in hooks:
            h.remove()  # type: ignore[attr-defined]
    assert _regions(m)["embed"].compile.get("backend") == LIGHT_BACKEND
    with torch.no_grad():
        ref = model(x)
    handle = apply_manifest(model, m, warmup=gpu_step)
    try:
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(model(x), ref)
        recs = {r.path: r for r in handle.report}
        assert recs["embed"].options["backend"] == LIGHT_BACKEND
        assert recs["blocks.0"].options["backend"] == "inductor"
        assert recs["embed"].cuda_graph_replays >= 1 and recs["blocks.0"].cuda_graph_replays >= 1
    finally:
        handle.restore()
