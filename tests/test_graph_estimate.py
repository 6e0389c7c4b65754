"""plan's estimate of what region graphs will hold (surgery.planning.graph_estimate) against
what the runtime's accounting (handle.report.memory) then reports for the same plan, on the CPU
with tests/test_graphs.py's faithful fake graph (no capture pool there: the estimate leaves it
out too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from surgery import examples
from surgery.planning.graph_estimate import (
    GRAPH_BYTES,
    GRAPH_BYTES_UNSHARED,
    GRAPH_OUTPUTS,
    GRAPH_STATIC_INPUTS,
)
from surgery.planning.observed import manifest_from_evidence, watch_model
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs import arena
from tests.test_graphs import FakeCapturer, fake_cuda

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
__all__ = ["fake_cuda"]  # the fixture, imported for the tests below

STEPS = 4


def bert() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 16))

    def step(m: nn.Module) -> Any:
        with torch.inference_mode():
            return m(input_ids=ids)

    return model, step


def vit() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, embed_dim=32, depth=2, num_heads=2).eval()
    x = torch.randn(2, 3, 32, 32)

    def step(m: nn.Module) -> Any:
        with torch.no_grad():
            return m(x)

    return model, step


def plan_and_apply(model: nn.Module, step: Callable[[nn.Module], Any], *, steps: int,
                   ) -> tuple[dict[str, Any], Any, list[str]]:
    """The evidence plan from ``steps`` watched steps, then the same plan applied and run for
    the same number of steps; (its [coverage], report.memory, the notes)."""
    w = watch_model(model, step, steps=steps, timed_steps=1)
    notes: list[str] = []
    manifest = manifest_from_evidence(w, source="test", notes=notes)
    if hasattr(model, "reset_stream"):
        model.reset_stream()
    handle = apply_manifest(model, manifest, warmup=step, passes=2,
                            overrides={"backend": "aot_eager"})
    for _ in range(steps - 2):
        step(model)
    mem = handle.report.memory
    handle.restore()
    assert manifest.coverage is not None
    return manifest.coverage, mem, notes


@pytest.mark.parametrize("build", [pytest.param(bert, id="hf-bert-inference-mode"),
                                   pytest.param(vit, id="timm-vit-no-grad")])
def test_the_estimate_is_the_runtimes_accounting_on_real_models(
        fake_cuda: FakeCapturer, monkeypatch: pytest.MonkeyPatch, build: Any) -> None:
    """Outputs released within the step: the estimate is exact (tolerance 0), shared and not."""
    for share in (True, False):
        monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy(share_outputs=share))
        model, step = build()
        cov, mem, notes = plan_and_apply(model, step, steps=STEPS)
        assert mem.paths and mem.outputs > 0, mem.line()  # something was captured
        want = cov[GRAPH_BYTES] if share else cov[GRAPH_BYTES_UNSHARED]
        assert mem.outputs + mem.static_inputs == want, (share, cov, mem.line())
        if share:
            assert (mem.outputs, mem.static_inputs) == (cov[GRAPH_OUTPUTS],
                                                        cov[GRAPH_STATIC_INPUTS])
            assert any(n.startswith("region graphs: about ") for n in notes), notes
        fake_cuda.arena = arena.BufferArena()  # the next apply starts from an empty arena


def test_a_streaming_cache_longer_than_the_watch_is_flagged_and_close(
        fake_cuda: FakeCapturer) -> None:
    """The example's KV cache keeps attn_pre's k and v for ``window`` steps. Watched for fewer,
    the estimate counts the rings it saw: static inputs exact, outputs within one ring set per
    flagged path (the stated tolerance), and the note names the paths."""
    model = examples.tiny().eval()
    x = model.example_input()

    def step(m: nn.Module) -> Any:
        with torch.no_grad():
            return m(x)

    steps = model.config.window + 2  # the runtime's rings fill: window + 1 sets
    w_steps = model.config.window - 1  # the planner sees fewer
    w = watch_model(model, step, steps=w_steps, timed_steps=1)
    notes: list[str] = []
    manifest = manifest_from_evidence(w, source="test", notes=notes)
    cov = manifest.coverage
    assert cov is not None
    model.reset_stream()
    with apply_manifest(model, manifest, warmup=step, passes=2,
                        overrides={"backend": "aot_eager"}) as handle:
        for _ in range(steps - 2):
            step(model)
        mem = handle.report.memory
    flagged = [n for n in notes if "rings may grow past this" in n]
    assert flagged and "attn_pre" in flagged[0], notes
    assert mem.static_inputs == cov[GRAPH_STATIC_INPUTS]
    rings = [p for p in mem.paths if p.output_sets > 1]
    assert rings and all(".attn_pre" in p.path for p in rings)
    ring_set = max(p.outputs // p.output_sets for p in rings)
    assert 0 < mem.outputs - cov[GRAPH_OUTPUTS] <= len(rings) * ring_set * (steps - w_steps)
