"""A StaticCache through ``generate()`` and region graphs (issue 18 follow-up): every call of
``generate(..., cache_implementation="static")`` makes a NEW cache whose tensors the decoder
writes in place (``index_copy_``/``copy_``). A graph captured against the first call's cache
tensors must never be replayed against the next call's: its static inputs would be copied in and
the write lost, or written into the old tensors.

It holds because the cache reaches each region as a ``StaticCache`` object (``past_key_values``),
a leaf that region capture does not take (surgery.runtime.graphs.outputs._flatten: only tensors,
scalars, None, tuples and lists): the region runs its compiled code, which reads and writes
whatever cache it is handed, and captures no graph. These tests check the tokens against eager
on three calls with three prompts (a new cache each), with the faithful fake graph on the CPU
and with real CUDA graphs on a GPU, for the evidence plan (``transformer``) and the names plan
(``transformer.h.N.mlp``, which captures and replays) and the names plan told to take the
blocks (``--include 'transformer.h.*'``: each ``GPT2Block`` takes the cache object and returns a
plain tensor, so only the input check keeps it from capturing; the whole ``transformer`` also
returns the cache, a second reason), and that no cache-taking region captured a graph, so that a
change that starts capturing such calls fails here (letting _flatten pass any object makes the
blocks replay into the first cache: index_copy_ out of bounds)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_graphs import FakeCapturer  # noqa: E402
from test_zoo import _needs  # noqa: E402
from zoo_models import gpt2  # noqa: E402

from surgery.formats.manifest import Manifest  # noqa: E402
from surgery.planning.observed import plan_from_step  # noqa: E402
from surgery.planning.plan import plan_module  # noqa: E402
from surgery.runtime import apply as apply_mod  # noqa: E402
from surgery.runtime.apply import apply_manifest  # noqa: E402

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), _needs("transformers")]

# (seed, prompt length, new tokens): every cache has 17 positions, so each call's new cache has
# the very shapes of the last (a graph's signature would match) and only its identity differs.
PROMPTS = [(1, 6, 11), (2, 6, 11), (3, 9, 8)]


def _prompt(seed: int, n: int, device: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (1, n), generator=g).to(device)


def _generate(model: Any, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, cache_implementation="static")


def _step(m: Any) -> None:
    _generate(m, _prompt(0, 6, m.device), 4)


def _models(device: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    eager = gpt2().eval().to(device)
    model = gpt2().eval().to(device)
    model.load_state_dict(eager.state_dict())
    return eager, model


def _plan(kind: str, model: Any) -> Manifest:
    comp = {"backend": "aot_eager", "capture": "region"}
    if kind == "evidence":
        m = plan_from_step(model, _step, steps=2, timed_steps=2, compile=comp)
        assert [p for r in m.regions for p in r.paths] == ["transformer"], m.regions
        return m
    if kind == "blocks":  # each GPT2Block takes the cache object and returns a plain tensor
        m = plan_module(model, source="gpt2", include=("transformer.h.*",), compile=comp).manifest
        assert [p for r in m.regions for p in r.paths] == ["transformer.h.0", "transformer.h.1"]
        return m
    m = plan_module(model, source="gpt2", compile=comp).manifest
    assert [p for r in m.regions for p in r.paths] == ["transformer.h.0.mlp",
                                                       "transformer.h.1.mlp"], m.regions
    return m


def _check(kind: str, device: str) -> None:
    eager, model = _models(device)
    manifest = _plan(kind, model)
    handle = apply_manifest(model, manifest, warmup=_step, passes=2)
    try:
        for seed, n, new in PROMPTS:
            ids = _prompt(seed, n, device)
            want, got = _generate(eager, ids, new), _generate(model, ids, new)
            assert torch.equal(got, want), (kind, seed, got.tolist(), want.tolist())
        records = list(handle.report)
        assert records and all(r.status == "compiled" for r in records), \
            handle.report.summary()
        assert all(r.compiled_calls > 0 for r in records), handle.report.summary()
        if kind != "names":
            # The guarantee's mechanism: a call that hands a region the cache object is not
            # captured, so no graph holds the first call's cache tensors.
            assert all(r.graphs_captured == 0 for r in records), handle.report.summary()
        else:
            # The MLPs never see the cache: they capture and replay (so capture is live here).
            assert all(r.graphs_captured > 0 and r.graph_replays > 0 for r in records), \
                handle.report.summary()
    finally:
        handle.restore()


@pytest.mark.parametrize("kind", ["evidence", "blocks", "names"])
def test_generate_with_new_static_caches_matches_eager_through_region_graphs(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    cap = FakeCapturer()
    monkeypatch.setattr(apply_mod, "_on_cuda", lambda module, model: True)
    monkeypatch.setattr(apply_mod, "_capturer_for", lambda module: cap)
    _check(kind, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (real region graphs)")
@pytest.mark.parametrize("kind", ["evidence", "blocks", "names"])
def test_generate_with_new_static_caches_matches_eager_on_cuda(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 tokens
    _check(kind, "cuda")
