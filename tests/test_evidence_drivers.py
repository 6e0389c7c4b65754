"""Evidence plans from the drivers users write (issue 18): `model(x)`, `model.forward(x)`, a
method, a batch that varies, `inference_mode`, and a step that never reaches the model; an empty
plan is a failure; budgets per weight layout; dynamic regions; grad modes as one signature."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from surgery.cli import cli
from surgery.errors import EmptyPlanError, ModelSourceError
from surgery.formats.manifest import dumps_manifest, parse_manifest
from surgery.planning.evidence import RECOMPILE_BUDGET, choose_regions
from surgery.planning.observe import observe
from surgery.planning.observed import plan_from_step
from surgery.runtime.signatures import UnplannedSignatureWarning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fates import assert_one_fate

X = torch.randn(2, 8)


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.lin(x)).relu()


class Net(nn.Module):
    """The issue's reproducer: 4 identical Linear+LayerNorm blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).softmax(-1)


def _paths(manifest) -> list[str]:  # type: ignore[no-untyped-def]
    return [p for r in manifest.regions for p in r.paths]


def _plan(step, model: nn.Module | None = None, **kw):  # type: ignore[no-untyped-def]
    return plan_from_step((model or Net()).eval(), step, steps=3, timed_steps=3, **kw)


def _no_grad_call(m: nn.Module, x: torch.Tensor = X) -> None:
    with torch.no_grad():
        m(x)


def _no_grad_forward(m: nn.Module) -> None:
    with torch.no_grad():
        m.forward(X)


def _no_grad_method(m: nn.Module) -> None:
    with torch.no_grad():
        m.predict(X)


def _inference_loop(m: nn.Module) -> None:
    with torch.inference_mode():
        for _ in range(2):
            m(X)


NOW = [0.0]  # a virtual clock (s), as in tests/test_compile_cost.py
COST = {Block: 1e-3, nn.Sequential: 5e-4}  # a block 1 ms, the head 0.5 ms; nothing else costs


def _virtual_plan(step, model: nn.Module | None = None,  # type: ignore[no-untyped-def]
                  cost: dict[type, float] | None = None):
    """_plan timed by NOW, which each block and the head advance when they run (forward hooks,
    so the step's own Python and a preempted host cost nothing): the shares are exactly COST's,
    whatever the load. The step is still timed around STEP itself, so a step that bypasses the
    root's __call__ (model.forward, a method) is timed as much as model(x)."""
    model = (model or Net()).eval()
    costs = COST if cost is None else cost

    def advance(m: nn.Module, args: object, out: object) -> None:
        NOW[0] += costs.get(type(m), 0.0)

    hooks = [m.register_forward_hook(advance) for m in model.modules()]
    try:
        return _plan(step, model, clock=lambda: NOW[0])
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("step", [
    pytest.param(_no_grad_call, id="model(x)"),
    pytest.param(_no_grad_forward, id="model.forward(x)"),
    pytest.param(_no_grad_method, id="a method"),
    pytest.param(_inference_loop, id="a loop under inference_mode"),
])
def test_every_driver_plans_the_blocks_and_covers_the_step(step) -> None:  # type: ignore[no-untyped-def]
    m = _virtual_plan(step)
    assert {f"blocks.{i}" for i in range(4)} | {"head"} <= set(_paths(m))
    # On the virtual clock the blocks and the head are the whole step: timed from the root's
    # hooks (which model.forward and a method never fire), the shares would be 0.
    calls = 2 if step is _inference_loop else 1
    assert m.coverage is not None
    assert m.coverage["step_ms"] == pytest.approx(4.5 * calls)
    assert m.coverage["covered_share"] == pytest.approx(1.0, abs=1e-3)
    assert m.coverage["covered_share"] >= m.coverage["names_covered_share"]
    # under inference_mode the evidence reads as no_grad: one grad-off state
    assert all(s.endswith("no_grad") for r in m.regions for s in r.evidence["signatures"])


@pytest.mark.parametrize("step", [
    pytest.param(_no_grad_forward, id="model.forward(x)"),
    pytest.param(_inference_loop, id="a loop under inference_mode"),
])
def test_every_driver_is_timed_on_the_real_clock(step) -> None:  # type: ignore[no-untyped-def]
    """The host clock, as users plan: the bare step and the module calls are timed (never 0),
    whatever the load; which regions win is the deterministic test's job above."""
    m = _plan(step)
    assert m.regions and m.coverage is not None
    assert m.coverage["step_ms"] > 0 and m.coverage["covered_share"] > 0


def test_a_step_that_runs_no_module_fails_loudly() -> None:
    other = Net().eval()

    def elsewhere(m: nn.Module) -> None:
        with torch.no_grad():
            other(X)  # a model of its own: the planned one never runs

    with pytest.raises(ModelSourceError, match="ran no module of the Net"):
        _plan(elsewhere)


def test_a_step_that_reaches_the_model_only_while_watched_fails_loudly() -> None:
    """The other half of "the step never reached the model": it runs the model in the watched
    steps, then returns a cached result, so no module call is ever timed. Without the check the
    shares are all 0 and the plan is empty for a wrong reason ("under 0.1% of the step")."""
    runs = [0]

    def cached(m: nn.Module) -> None:
        runs[0] += 1
        if runs[0] <= 3:  # _plan watches 3 steps; every later call returns what it had
            _no_grad_call(m)

    with pytest.raises(ModelSourceError, match="could not be timed: no module call was timed"):
        _plan(cached)


def test_an_empty_plan_is_an_error_with_the_reasons() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    with pytest.raises(EmptyPlanError) as err:
        _plan(_no_grad_call, model)
    assert err.value.exit_code == 1
    assert "not worth a graph: 1 op a call" in err.value.reasons
    assert "not worth a graph: 1 op a call" in str(err.value)


def test_cli_empty_plan_exits_1_and_json_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "m.toml"
    args = ["plan", "--model", "test_evidence_drivers:one_layer", "--input",
            "test_evidence_drivers:_no_grad_call", "--steps", "2", "-o", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1, res.output
    assert "found no region" in res.output and "1 op a call" in res.output
    assert not out.exists()  # nothing written
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["error"]["code"] == "EmptyPlanError" and doc["error"]["exit_code"] == 1


def one_layer() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU())


def test_cli_plans_a_step_through_forward(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The issue's case 1 through the CLI: it was 0 regions, exit 0."""
    res = CliRunner().invoke(cli, ["plan", "--model", "test_evidence_drivers:Net", "--input",
                                   "test_evidence_drivers:_no_grad_forward", "--steps", "2",
                                   "-o", str(tmp_path / "m.toml")])
    assert res.exit_code == 0, res.output
    assert "evidence " in res.output and "names-only " in res.output
    assert "blocks" in (tmp_path / "m.toml").read_text()


# --- one fate per module --------------------------------------------------------------------


class Scale(nn.Module):
    """LayerScale: one multiply by a learned vector."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(8, 8)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ls = nn.ModuleList(Scale() for _ in range(2))
        self.unused = Unused()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b, s in zip(self.blocks, self.ls, strict=True):
            x = s(b(x))
        return x


def test_every_module_gets_one_fate_with_a_reason() -> None:
    model = Scaled().eval()
    m = _plan(_no_grad_call, model)
    left = assert_one_fate(model, m)
    assert left["ls.0"] == "not worth a graph: 1 op a call"
    assert left["unused"].startswith("never called")
    assert left["unused.spare"].startswith("never called")


# --- the mutation alone decides -------------------------------------------------------------


class Counting(nn.Module):
    """Runs the same ops on the same shapes every call, and counts its calls in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.mlp(x)


def test_a_python_state_change_alone_leaves_a_fixed_shape_subtree_out() -> None:
    model = nn.Sequential(Counting(), Block()).eval()
    obs = observe(model, _no_grad_call, steps=3, timed_steps=0)
    choice = choose_regions(obs)
    left = dict(choice.left_out)
    # Same signature, same ops, one context: only the counter decides.
    assert left["0"] == ("changed its attribute `calls` in 2 of 2 calls (Python state a graph "
                         "replay would not update)")
    assert "0.mlp" in choice.regions and "1" in choice.regions


# --- budgets per weight layout ---------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())


class TwoWidths(nn.Module):
    """One Mlp class at width 8 (3 token counts) and width 16 (3 token counts): 6 signatures
    together, 3 per layout."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.ModuleList(Mlp(8) for _ in range(2))
        self.head = nn.ModuleList(Mlp(16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for n in (2, 3, 4):
            h = x[:n]  # contiguous rows
            for t in self.trunk:
                h = t(h)
            g = torch.cat([h, h], -1)
            for t in self.head:
                g = t(g)
            outs.append(g.sum())
        return torch.stack(outs)


def test_paths_of_different_weight_layouts_get_budgets_of_their_own() -> None:
    x = torch.randn(4, 8)
    obs = observe(TwoWidths().eval(), lambda m: _no_grad_call(m, x), steps=2, timed_steps=0)
    choice = choose_regions(obs)
    assert {"trunk.0", "trunk.1", "head.0", "head.1"} <= set(choice.regions)
    mlp_groups = [g for g in choice.groups if g.paths[0].startswith(("trunk", "head"))]
    assert sorted(sorted(g.paths) for g in mlp_groups) == [["head.0", "head.1"],
                                                            ["trunk.0", "trunk.1"]]
    assert all(len(g.sigs) == 3 <= RECOMPILE_BUDGET for g in mlp_groups)
    # Each layout is within budget on its own: no split by signature was needed (merged into one
    # group by function alone, the six signatures would have forced one).
    assert all(g.name is None for g in mlp_groups)


# --- dynamic regions --------------------------------------------------------------------------


def _varying_batch(m: nn.Module) -> None:
    with torch.no_grad():
        for b in range(2, 2 + RECOMPILE_BUDGET + 2):
            m(torch.randn(b, 8))


def test_a_batch_that_varies_makes_dynamic_regions() -> None:
    m = _plan(_varying_batch)
    regions = {p: r for r in m.regions for p in r.paths}
    blk = regions["blocks.0"]
    assert blk.dynamic and blk.dynamic_dims == {"x": [0]}
    assert blk.evidence["signatures"] == ["x=f32[*,8], no_grad"]
    again = parse_manifest(dumps_manifest(m))  # schema-valid, and it round-trips
    assert {p: (r.dynamic, r.dynamic_dims) for r in again.regions for p in r.paths} == \
        {p: (r.dynamic, r.dynamic_dims) for p, r in regions.items()}


def test_a_dynamic_region_runs_as_planned_without_a_warning() -> None:
    from surgery import apply_manifest

    model = Net().eval()
    m = plan_from_step(model, _varying_batch, steps=2, timed_steps=0)
    handle = apply_manifest(model, m, overrides={"backend": "eager", "on_cpu": "compile"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnplannedSignatureWarning)
            with torch.no_grad():
                for b in (3, 9, 17):  # sizes never seen in planning
                    model(torch.randn(b, 8))
        rec = next(r for r in handle.report if r.path == "blocks.0")
        assert rec.signature_mode == "dynamic" and rec.status == "compiled"
    finally:
        handle.restore()


# --- grad modes are one signature ------------------------------------------------------------


def test_planned_under_no_grad_deployed_under_inference_mode_is_the_same_plan() -> None:
    from surgery import apply_manifest

    torch._dynamo.reset()
    model = Net().eval()
    m = plan_from_step(model, _no_grad_call, steps=2, timed_steps=0)
    handle = apply_manifest(model, m, overrides={"backend": "eager", "on_cpu": "compile"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnplannedSignatureWarning)
            with torch.inference_mode():
                for _ in range(3):
                    model(X)
        recs = [r for r in handle.report if r.status == "compiled"]
        assert recs and all(r.signatures == 1 for r in recs)  # one signature: no recompile
    finally:
        handle.restore()


def test_an_old_manifest_that_says_inference_mode_reads_as_no_grad() -> None:
    from surgery.runtime.signatures import signature_check

    lin = nn.Linear(4, 4)
    check = signature_check({"signatures": ["input=f32[2,4], inference_mode"]}, "lin",
                            lin.forward)
    assert check is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnplannedSignatureWarning)
        with torch.no_grad():
            check.check((torch.zeros(2, 4),), {})
    with pytest.warns(UnplannedSignatureWarning, match="does not describe this call"):
        check.check((torch.zeros(2, 4),), {})  # grad on: a real difference, said so


def test_observe_leaves_no_hook_or_mode_behind() -> None:
    from torch.overrides import _get_current_function_mode_stack

    model = Scaled().eval()
    observe(model, _no_grad_forward, steps=2, timed_steps=2)
    for path, mod in model.named_modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks, path
    assert not _get_current_function_mode_stack()


# --- LayerScale-like modules: one tensor, one op -----------------------------------------------


class StreamBlock(nn.Module):
    """A streaming block (its forward takes the cache) whose fixed parts include LayerScales."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp(8)
        self.ls1, self.ls2 = Scale(), Scale()

    def forward(self, x: torch.Tensor, kv_cache: list[torch.Tensor]) -> torch.Tensor:
        kv_cache.append(x)
        x = x + self.ls1(torch.cat(kv_cache, 0)[-x.shape[0]:])
        return x + self.ls2(self.mlp(x))


class Streamer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(StreamBlock() for _ in range(2))

    def forward(self, x: torch.Tensor, caches: list[list[torch.Tensor]]) -> torch.Tensor:
        for b, c in zip(self.blocks, caches, strict=True):
            x = b(x, c)
        return x


def test_both_planners_leave_one_tensor_modules_out_with_the_reason() -> None:
    from surgery.planning.plan import view_from_module
    from surgery.planning.regions import find_regions

    model = Streamer().eval()
    found = find_regions(view_from_module(model)[0])
    names = {c.path for c in found.regions}
    assert {"blocks.0.mlp", "blocks.1.mlp"} <= names  # the fixed parts of the streaming blocks
    left = {p: why for p, _k, why in found.left_out}
    assert not {"blocks.0.ls1", "blocks.0.ls2"} & names
    assert left["blocks.0.ls1"] == ("a single Scale owning one tensor (gamma): one op gains "
                                    "nothing as a region and costs a graph launch")
    caches: list[list[torch.Tensor]] = [[], []]

    def step(m: nn.Module) -> None:
        with torch.no_grad():
            m(X, caches)

    m = plan_from_step(model, step, steps=3, timed_steps=0)
    evidence_left = {lo.path: lo.reason for lo in m.left_out}
    assert evidence_left["blocks.0.ls2"] == "not worth a graph: 1 op a call"
    assert "blocks.0.ls2" not in _paths(m) and "blocks.0.mlp" in _paths(m)


# --- evidence never loses to names ---------------------------------------------------------


class CountingBlock(Block):
    """A repeated block by its names (a numbered container of one class) that keeps Python
    state: the names-only plan proposes it, the run shows it unsafe."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return super().forward(x)


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CountingBlock() for _ in range(3))
        self.head = Mlp(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_names_region_the_run_shows_unsafe_is_left_out_with_the_evidence() -> None:
    from surgery.planning.plan import view_from_module
    from surgery.planning.regions import find_regions

    model = Counted().eval()
    assert "blocks.0" in {c.path for c in find_regions(view_from_module(model)[0]).regions}
    # On the virtual clock (a block 1 ms, the head 0.5 ms): under load the host clock once made
    # the head "under 0.1% of the step" and the plan empty; the mutation decides here, not time.
    m = _virtual_plan(_no_grad_call, model, {CountingBlock: 1e-3, Mlp: 5e-4})
    left = {lo.path: (lo.kind, lo.reason) for lo in m.left_out}
    kind, why = left["blocks.0"]
    assert kind == "repeated_block"
    assert why.startswith("found by names, but the run shows it unsafe: changed its attribute "
                          "`seen`")
    assert {"blocks.0.lin", "blocks.0.norm"} & set(left)  # descended into: single ops
    assert "blocks.0" not in _paths(m) and "head" in _paths(m)


def test_the_plan_that_covers_more_of_the_step_is_kept() -> None:
    """best_of, given an evidence choice weaker than the names plan: a names region judged fixed
    joins it, and where the names regions nest with it and cover more, the names plan wins."""
    from surgery.planning.compare import best_of
    from surgery.planning.evidence import Choice

    model = Net().eval()  # on the virtual clock (COST): the same shares every run

    def advance(m: nn.Module, args: object, out: object) -> None:
        NOW[0] += COST.get(type(m), 0.0)

    hooks = [m.register_forward_hook(advance) for m in model.modules()]
    try:
        obs = observe(model, _no_grad_call, steps=2, timed_steps=3, clock=lambda: NOW[0])
    finally:
        for h in hooks:
            h.remove()
    weak = Choice(["blocks.0.norm"], [], {}, {})
    joined, info = best_of(obs, weak, ["head"])
    assert "head" in joined.regions and "blocks.0.norm" in joined.regions
    assert info["chosen"] == "evidence"
    names, info = best_of(obs, weak, ["blocks.0", "head"])
    assert info["chosen"] == "names" and names.regions == ["blocks.0", "head"]
    left = dict(names.left_out)
    assert left["blocks.1"] == "left out by the names-only plan"  # still one fate each
    assert names.coverage["covered_share"] >= joined.coverage["covered_share"]


def test_warm_up_in_one_grad_off_mode_and_deploy_in_the_other_says_it_compiles_again() -> None:
    """The recompile is real (dynamo guards on inference mode), so the warning names it."""
    from surgery import apply_manifest
    from surgery.runtime.signatures import GradModeWarning

    torch._dynamo.reset()
    model = Net().eval()
    m = plan_from_step(model, _no_grad_call, steps=2, timed_steps=0)
    handle = apply_manifest(model, m, warmup=_no_grad_call,
                            overrides={"backend": "eager", "on_cpu": "compile"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnplannedSignatureWarning)
            with pytest.warns(GradModeWarning, match="ran under no_grad and now under "
                              "inference_mode.*compiles it again"), torch.inference_mode():
                model(X)
        rec = next(r for r in handle.report if r.path == "blocks.0")
        assert rec.signatures == 2  # the runtime counted the second compile too
    finally:
        handle.restore()


@pytest.mark.cuda
def test_an_evidence_plan_on_the_gpu_times_with_events_and_its_regions_replay() -> None:
    """On a GPU: the step through model.forward is timed around the step (CUDA events for the
    modules), planned under no_grad; deployed under inference_mode, its regions replay their
    graphs with no UnplannedSignatureWarning."""
    from surgery import apply_manifest

    torch._dynamo.reset()
    model = Net().cuda().eval()
    x = X.cuda()

    def step(m: nn.Module) -> None:
        with torch.no_grad():
            m.forward(x)

    m = plan_from_step(model, step, steps=3, timed_steps=3)
    assert m.coverage["clock"] == "cuda-events" and m.coverage["covered_share"] > 0
    assert m.coverage["covered_share"] >= m.coverage["names_covered_share"]
    # issue 20: on CUDA the plan reads the bare steps' peak and estimates the peak with graphs
    cov = m.coverage
    assert cov["eager_peak_bytes"] > 0 and cov["graph_bytes"] > 0, cov
    assert cov["peak_estimate_bytes"] == cov["eager_peak_bytes"] + cov["graph_bytes"], cov
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnplannedSignatureWarning)
        with torch.inference_mode():
            handle = apply_manifest(model, m, warmup=lambda mm: mm.forward(x))
            try:
                for _ in range(3):
                    model.forward(x)
                assert sum(r.cuda_graph_replays for r in handle.report) >= 1
            finally:
                handle.restore()


def test_a_step_that_compiles_the_model_itself_is_watched_eager() -> None:
    """transformers' generate() compiles the forward of a static cache on CUDA; on the H200 that
    compile traced the watcher's hooks and the plan failed ("RuntimeError when making fake
    tensor call"). The step's own torch.compile is ignored while it is watched and timed."""
    traced = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()

    def compiled_step(m: nn.Module) -> None:
        with torch.no_grad():
            torch.compile(m, backend=backend)(X)

    m = _virtual_plan(compiled_step)
    assert traced == [], "the step's own compile ran while the plan watched it"
    assert {"blocks.0", "head"} <= set(_paths(m))
