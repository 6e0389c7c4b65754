"""The piecewise probe (surgery.planning.piecewise_probe): a streaming block that cannot trace as
one graph is left out at plan time, with its reason under [[left_out]], and the model is left
as it was found."""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any

import pytest
import torch
from torch import nn

from surgery.formats.manifest import PIECEWISE_KIND, Manifest, Region, validate
from surgery.planning.observed import plan_from_step
from surgery.planning.piecewise_probe import probe_piecewise
from surgery.planning.plan import plan_model
from surgery.planning.streaming import NAMES_ONLY_NOTE
from surgery.runtime.apply import apply_manifest
from tests.test_piecewise import ON_CPU, TensorCacheBlock

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class PrintBlock(TensorCacheBlock):
    """A streaming block with a print inside: a graph break in every torch we support."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("streaming block", x.shape[1])
        return super().forward(x)


class Blocks(nn.Module):
    """Two streaming blocks with a tensor cache each; the second cannot trace as one graph."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        second = PrintBlock() if broken == "print" else TensorCacheBlock(graph_break=True)
        self.blocks = nn.ModuleList([TensorCacheBlock(), second])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def reset(self) -> None:
        for b in self.blocks:
            b.k_cache = b.v_cache = None


def step(model: nn.Module) -> None:
    with torch.no_grad():
        model(torch.randn(1, 3, 16))


def _plan(model: Blocks, step_fn: Any = step, *, piecewise: bool = True) -> Manifest:
    m = plan_from_step(model, step_fn, steps=3, timed_steps=1, piecewise=piecewise,
                       compile={"capture": "region", **ON_CPU})
    data = m.to_dict()
    validate(data)  # the plan is still a valid manifest
    return Manifest.from_dict(data)


def _module_state(model: nn.Module) -> dict[str, Any]:
    return {name: ("forward" in vars(mod), len(mod._forward_hooks), len(mod._forward_pre_hooks),
                   type(mod).forward) for name, mod in model.named_modules()}


def _same_model(model: nn.Module, before: dict[str, torch.Tensor], shape: dict[str, Any]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert _module_state(model) == shape  # no forward left on an instance, no hook
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks


@pytest.mark.parametrize("broken", ["graph-break", "print"])
def test_a_block_that_breaks_is_left_out_at_plan_time_and_its_sibling_stays_piecewise(
        broken: str) -> None:
    m = _plan(Blocks(broken))
    pw = [r for r in m.regions if r.kind == PIECEWISE_KIND]
    assert [r.paths for r in pw] == [["blocks.0"]]  # the sibling without the break
    assert not any(p == "blocks.1" for r in m.regions for p in r.paths)
    (lo,) = [lo for lo in m.left_out if lo.path == "blocks.1"]
    assert "a graph break inside the block" in lo.reason and "at plan time" in lo.reason, \
        lo.reason
    # today's treatment: its children are judged as the plain plan judges them (regions or
    # left out with their own evidence), never folded into a piecewise region; the sibling's
    # are inside its region, neither regions nor left out
    inner = [lo.reason for lo in m.left_out if lo.path.startswith("blocks.1.")]
    assert inner and not any("inside piecewise region" in r for r in inner), inner
    assert not any(lo.path.startswith("blocks.0.") for lo in m.left_out)
    assert not any(p.startswith("blocks.0.") for r in m.regions for p in r.paths)
    assert m.coverage is not None and m.coverage["piecewise_regions"] == 1

    # deploying it matches eager, and the piecewise block ran compiled
    model, ref = Blocks(broken), Blocks(broken)
    handle = apply_manifest(model, m)
    for s in range(4):
        x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
        for blk, rblk in zip(model.blocks, ref.blocks, strict=True):
            torch.testing.assert_close(blk.k_cache, rblk.k_cache)
    recs = {r.path: r for r in handle.report}
    assert recs["blocks.0"].status == "compiled", recs["blocks.0"].reason
    assert "blocks.1" not in recs
    handle.restore()


def test_the_model_after_the_probe_is_the_model_before() -> None:
    model = Blocks("graph-break")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shape = _module_state(model)
    planned = _plan(model)  # the probe ran on this model: it found the break
    assert any("at plan time" in lo.reason for lo in planned.left_out)
    _same_model(model, before, shape)
    # both blocks planned piecewise, as plan_piecewise plans them before the probe
    trial = Manifest.from_dict(planned.to_dict())
    trial.regions = [Region(kind=PIECEWISE_KIND, paths=["blocks.0", "blocks.1"],
                            piecewise={"split_ops": ["scaled_dot_product_attention"],
                                       "dynamic": ["self.k_cache", "self.v_cache"]})]
    found = probe_piecewise(trial, model, step)
    assert found.compiled == ["blocks.0"] and list(found.refused) == ["blocks.1"]
    assert found.error is None
    _same_model(model, before, shape)
    # forward is the original: the same output as a twin that ran eagerly
    twin = Blocks("graph-break")
    model.reset()
    twin.reset()
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)


def test_a_probe_that_fails_keeps_every_block_out_and_never_crashes_the_plan() -> None:
    def fails_under_the_probe(model: nn.Module) -> None:
        if "forward" in vars(model.blocks[0]):  # a piecewise wrapper is installed
            raise RuntimeError("the step broke under the probe")
        step(model)

    model = Blocks("graph-break")
    m = _plan(model, fails_under_the_probe)
    assert not [r for r in m.regions if r.kind == PIECEWISE_KIND]
    for path in ("blocks.0", "blocks.1"):
        (lo,) = [lo for lo in m.left_out if lo.path == path]
        assert "probe" in lo.reason and "the step broke under the probe" in lo.reason
    assert all("forward" not in vars(mod) for mod in model.modules())


def test_a_names_only_piecewise_plan_says_it_is_checked_at_run_time() -> None:
    result = plan_model("surgery.examples:tiny_sdpa", piecewise=True)
    assert any(r.kind == PIECEWISE_KIND for r in result.manifest.regions)
    assert NAMES_ONLY_NOTE in result.notes


def test_a_refused_stack_leaves_its_blocks_piecewise_on_their_own() -> None:
    """A decoder stack the probe saw fall back is not planned; its blocks no longer stand by."""
    pytest.importorskip("transformers")
    from surgery.formats.manifest import PIECEWISE_FALLBACK_FOR
    from surgery.planning.plan import plan_module, view_from_module
    from surgery.planning.streaming import plan_piecewise
    from tests.test_streaming import tiny_gpt2

    model = tiny_gpt2()
    base = plan_module(model, source="tiny_gpt2").manifest
    view, _ = view_from_module(model)
    for refused, stacked in (({}, True), ({"transformer": "not piecewise: R"}, False)):
        m = Manifest.from_dict(base.to_dict())
        plan_piecewise(m, model, view, refused=refused)
        pw = {tuple(r.paths): r for r in m.regions if r.kind == PIECEWISE_KIND}
        assert (("transformer",) in pw) is stacked, sorted(pw)
        blocks = pw[("transformer.h.0", "transformer.h.1")]
        assert (PIECEWISE_FALLBACK_FOR in blocks.piecewise) is stacked
        assert any(lo.path == "transformer" and lo.reason == "not piecewise: R"
                   for lo in m.left_out) is not stacked


def test_gpt2_generate_with_a_block_that_prints_plans_the_other_block_alone() -> None:
    """transformers' GPT-2 in generate(), its second block printing: the probe sees the stack
    and that block fall back; the plan keeps block 0 piecewise, no stack, the same tokens."""
    pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from tests.test_evidence_cache import generate
    from tests.test_streaming import tiny_gpt2

    class PrintingBlock(GPT2Block):
        @functools.wraps(GPT2Block.forward)  # the same signature: its cache is located
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            print("block")
            return super().forward(*args, **kwargs)

    model = tiny_gpt2()
    printing = PrintingBlock(model.config, layer_idx=1)
    printing.load_state_dict(model.transformer.h[1].state_dict())
    model.transformer.h[1] = printing.eval()
    with contextlib.redirect_stdout(io.StringIO()):
        m = plan_from_step(model, generate, steps=3, timed_steps=1, piecewise=True)
        ref = generate(model)
        pw = [r.paths for r in m.regions if r.kind == PIECEWISE_KIND]
        assert pw == [["transformer.h.0"]], pw
        (lo,) = [lo for lo in m.left_out if lo.path == "transformer.h.1"]
        assert "a graph break inside the block" in lo.reason and "at plan time" in lo.reason
        handle = apply_manifest(model, m, warmup=generate, overrides=ON_CPU)
        try:
            assert torch.equal(generate(model), ref)
            status = {r.path: r.status for r in handle.report}
            assert status["transformer.h.0"] == "compiled", status
        finally:
            handle.restore()
