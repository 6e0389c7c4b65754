"""The memory benchmark's whole-model arm and its turns with eager (benchmarks/_whole.py,
benchmarks/_turns.py, benchmarks/gpu_memory.py): what they count and how they time, on the CPU.

The H200 figures of issue 20 rest on these: the graph and operator counts estimate the whole
arm's compile time there, and the ratios taken in turns decide the 5% speed target.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import _turns
import _whole
import gpu_memory


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    saved = torch.compiler.config.dynamic_sources
    yield
    torch.compiler.config.dynamic_sources = saved
    torch._dynamo.reset()


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 2 + 1


def test_watched_backend_counts_each_graph_and_its_operators(capsys):
    backend = _whole.WatchedBackend("eager", t0=0.0)
    f = torch.compile(_Branchy(), backend=backend)
    f(torch.ones(2, 4))
    f(torch.ones(2, 4))  # same shapes: no second graph
    assert backend.summary()["graphs"] == 1
    f(torch.ones(3, 4))  # a new size: a recompile, which must show as a second graph
    s = backend.summary()
    assert s["graphs"] == 2
    # linear, relu, mul, add: each graph has exactly these 4 operator nodes
    assert s["graph_ops"] == [4, 4] and s["ops"] == 8
    assert "graph 2 compiled by eager: 4 ops" in capsys.readouterr().out


def test_frame_counter_probe_tells_whether_dynamic_sources_takes():
    torch.compiler.config.dynamic_sources = ""
    assert gpu_memory.counter_is_symbolic() is False  # specialised: it recompiles
    torch._dynamo.reset()
    torch.compiler.config.dynamic_sources = "L['self'].frames_seen,.*frames_seen"
    assert gpu_memory.counter_is_symbolic() is True


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.kv_cache: list[torch.Tensor] = []


def test_eager_twin_shares_weights_and_not_state():
    m = _Stateful()
    twin = _turns.eager_twin(m)
    assert twin is not m
    assert twin.lin.weight.data_ptr() == m.lin.weight.data_ptr()
    assert twin.scale.data_ptr() == m.scale.data_ptr()
    twin.kv_cache.append(torch.zeros(1))
    assert m.kv_cache == []


def test_turns_alternate_and_give_each_rounds_ratio():
    a, b = object(), object()
    seen = []
    ms = {id(a): 2.0, id(b): 1.0}  # the arm (b) is twice as fast as eager (a)

    def run(m):
        seen.append("arm" if m is b else "eager")
        return [ms[id(m)], ms[id(m)] * 3, ms[id(m)]]

    res = _turns.take_turns(run, b, a, 3)
    assert seen == ["eager", "arm", "arm", "eager", "eager", "arm"]
    assert res["ab_speedup"] == 2.0 and res["ab_round_speedups"] == [2.0, 2.0, 2.0]
    assert res["ab_eager_ms"] == 2.0 and res["ab_ms"] == 1.0


@pytest.mark.parametrize(("variants", "routes", "stream", "want"), [
    pytest.param(["before:unrouted", "outputs"], ("on",), "default",
                 [("before", "off"), ("outputs", "on")], id="unrouted-only"),
    pytest.param(["outputs"], ("on", "off"), "default", [("outputs", "on"), ("outputs", "off")],
                 id="routes"),
    pytest.param(["before:unrouted", "outputs"], ("on",), "user", [("outputs", "on")],
                 id="user-stream-has-no-route-to-leave-out"),
])
def test_surgery_arms(variants, routes, stream, want):
    assert gpu_memory.surgery_arms(variants, routes, stream) == want
