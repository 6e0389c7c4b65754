"""A cache passed as an argument, seen by the evidence (issue 18): a cache object that an
attention appends to is state even when every decode call has a signature of its own, and the
evidence plan of GPT-2 in ``generate()`` plans its blocks piecewise by default
(surgery.planning.compile_cost.choose_piecewise), keeping the plain plan elsewhere."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from surgery.cli import cli
from surgery.formats.manifest import PIECEWISE_KIND, dumps_manifest, parse_manifest
from surgery.planning.compile_cost import piecewise_wins
from surgery.planning.observed import plan_from_step, plan_observed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fates import assert_one_fate


class KV:
    """A cache object, as transformers' DynamicCache is: layers that hold tensors."""

    def __init__(self) -> None:
        self.layers: list[dict[str, torch.Tensor]] = [{}]

    def update(self, k: torch.Tensor) -> torch.Tensor:
        layer = self.layers[0]
        layer["k"] = k if "k" not in layer else torch.cat([layer["k"], k], 1)
        return layer["k"]


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: KV, mask: torch.Tensor) -> torch.Tensor:
        keys = cache.update(self.k(x))
        w = (self.q(x) @ keys.transpose(1, 2)).masked_fill(mask[:, None, :] == 0, -1e4)
        return x + w.softmax(-1) @ keys


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attend = Attend()
        self.out = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor, cache: KV, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.attend(x, cache, mask))


def decode(m: nn.Module) -> None:
    """A decode loop whose mask grows with the cache: every call a signature of its own."""
    cache, x = KV(), torch.randn(1, 1, 8)
    with torch.no_grad():
        for t in range(1, 8):
            x = m(x, cache, torch.ones(1, t))


def test_a_cache_object_an_attention_appends_to_is_state_whatever_the_signatures() -> None:
    model = Decoder().eval()
    m = plan_from_step(model, decode, steps=3, timed_steps=0, piecewise=False)
    left = assert_one_fate(model, m)
    regions = {p for r in m.regions for p in r.paths}
    assert "attend" not in regions, "a growing cache argument was planned as a fixed region"
    assert left["attend"].startswith("changed its argument `cache`, an object holding tensors, "
                                     "in 14 of 14 calls (state kept between calls, such as a KV "
                                     "cache")
    assert "out" in regions  # the fixed part after it stays a region


def gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=64, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg).eval()


PROMPT = torch.randint(2, 100, (1, 12), generator=torch.Generator().manual_seed(0))


def generate(m: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0)


def test_gpt2_generate_is_planned_piecewise_by_default_and_makes_the_same_tokens() -> None:
    pytest.importorskip("transformers")
    from surgery import apply_manifest

    model = gpt2()
    m = parse_manifest(dumps_manifest(plan_from_step(model, generate, steps=3, timed_steps=3)))
    pieces = {p: r for r in m.regions if r.kind == PIECEWISE_KIND for p in r.paths}
    # each block piecewise; with a decoder stack over them (surgery.planning.stacks) the blocks
    # stand by for it
    assert {"transformer.h.0", "transformer.h.1"} <= set(pieces), sorted(pieces)
    stack = pieces["transformer.h.0"].piecewise.get("fallback_for")
    assert stack is None or set(stack) <= set(pieces)
    assert_one_fate(model, m)
    cov = m.coverage
    assert cov["piecewise_regions"] == len(pieces)
    assert cov["covered_share"] > cov["plain_covered_share"] > 0
    plain = plan_from_step(model, generate, steps=3, timed_steps=0, piecewise=False)
    assert not any(r.kind == PIECEWISE_KIND for r in plain.regions)
    ref = generate(model)
    handle = apply_manifest(model, m, warmup=generate,
                            overrides={"on_cpu": "compile", "backend": "aot_eager"})
    try:
        assert torch.equal(generate(model), ref)
        status = {r.path: r.status for r in handle.report}
        # the outermost piecewise region runs compiled; blocks standing by for it stay pending
        assert status[min(pieces, key=len)] == "compiled", status
        assert all(s in ("compiled", "pending") for s in status.values()), status
    finally:
        handle.restore()


@pytest.mark.parametrize(("plain", "got", "inside", "wins"), [
    pytest.param(0.104, 0.64, 0.65, True, id="gpt2-tiny-cpu"),  # generate's Python: 35% outside
    pytest.param(0.019, 0.446, 0.765, True, id="gpt2-tiny-bf16-lm-head"),  # by the second case
    pytest.param(0.145, 0.99, 1.0, True, id="gpt2-h200-before"),
    pytest.param(0.643, 0.99, 1.0, True, id="gpt2-h200-mlps-inflated"),  # call 1: was lost
    pytest.param(0.43, 0.70, 0.99, False, id="sdpa-h200"),  # opt-in there, for its cold start
    pytest.param(0.50, 0.50, 1.0, False, id="no-gain"),
    pytest.param(0.70, 1.0, 1.0, True, id="the-last-third"),
    pytest.param(0.90, 1.0, 1.0, False, id="the-last-tenth-is-too-little"),
    pytest.param(0.81, 0.85, 0.85, False, id="sdpa-tiny-noisy"),  # all that was left, but 4%
    pytest.param(0.70, 0.85, 1.0, False, id="half-the-last-third"),
    pytest.param(0.30, 0.55, 1.0, False, id="neither-case"),
])
def test_the_default_rule_compares_what_each_plan_leaves_inside_the_model(
        plain: float, got: float, inside: float, wins: bool) -> None:
    assert piecewise_wins(plain, got, inside) is wins


def test_the_sdpa_example_stays_plain_by_default_and_says_why() -> None:
    """Its evidence plan covers most of the step already: piecewise stays opt-in there."""
    result = plan_observed("surgery.examples:tiny_sdpa", input_spec="surgery.examples:stream_step",
                           steps=3, timed_steps=1)
    assert not any(r.kind == PIECEWISE_KIND for r in result.manifest.regions)
    assert any(n.startswith("not planned piecewise by default") for n in result.notes), \
        result.notes


def test_cli_no_piecewise_keeps_the_blocks_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    out = tmp_path / "m.toml"
    res = CliRunner().invoke(cli, ["plan", "--model", "tests.test_evidence_cache:gpt2",
                                   "--input", "tests.test_evidence_cache:generate",
                                   "--steps", "2", "--no-piecewise", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "piecewise" not in out.read_text().split("[coverage]")[0]
