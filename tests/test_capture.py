"""Where CudaCapturer captures (surgery.runtime.graphs.capture): on the caller's stream when it is
not the default stream, so the graphs share eager's cuBLAS workspace; on a side stream otherwise.

On the CPU, ``FakeCuda`` stands in for torch.cuda's streams, graphs and allocator counters, and
models the one fact that matters here: the first matmul on a stream allocates that stream's
cuBLAS workspace, which stays. The `cuda` tests check the same on a GPU with real graphs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from surgery import examples
from surgery.runtime import apply as apply_mod
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs.capture import CudaCapturer, PooledGraph
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.report import GraphMemory
from tests.test_graphs import Calls

WORKSPACE = 32 * 2**20  # cuBLAS's workspace per stream on Hopper


class FakeStream:
    def __init__(self, raw: int, log: list[Any]) -> None:
        self.cuda_stream = raw
        self.log = log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))

    def wait_event(self, event: Any) -> None:
        """A wait on an event (the stream route's): logged as a wait on the stream it was last
        recorded on, the same entry as ``wait_stream``."""
        self.log.append(("wait", self.cuda_stream, event.at))


class FakeCuda:
    """torch.cuda as CudaCapturer.capture uses it. Stream 0 is the default stream."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[Any] = []
        self.default = FakeStream(0, self.log)
        self.current = self.default
        self.allocated = 0
        self.workspaces: set[int] = set()  # streams whose cuBLAS workspace exists
        self.made = 0
        fake = self

        class Graph:
            def capture_begin(self, pool: Any = None) -> None:
                fake.log.append(("begin", fake.current.cuda_stream))

            def capture_end(self) -> None:
                fake.log.append(("end", fake.current.cuda_stream))

            def replay(self) -> None:
                fake.log.append(("replay", fake.current.cuda_stream))

        def new_stream(device: int = 0) -> FakeStream:
            fake.made += 1
            return FakeStream(100 + fake.made, fake.log)

        @contextmanager
        def on(stream: FakeStream) -> Iterator[None]:
            before, fake.current = fake.current, stream
            try:
                yield
            finally:
                fake.current = before

        self.capturing = False
        for name, value in {"graph_pool_handle": lambda: (0, 1), "CUDAGraph": Graph,
                            "device": lambda device: contextlib.nullcontext(),
                            "is_current_stream_capturing": lambda: fake.capturing,
                            "Stream": new_stream, "stream": on,
                            "default_stream": lambda device=0: fake.default,
                            "current_stream": lambda device=0: fake.current,
                            "memory_allocated": lambda device=0: fake.allocated,
                            "memory_reserved": lambda device=0: fake.allocated}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def matmul(self) -> None:
        """What a region's work does to memory: its stream's workspace, made once."""
        if self.current.cuda_stream not in self.workspaces:
            self.workspaces.add(self.current.cuda_stream)
            self.allocated += WORKSPACE


def capturer(cuda: FakeCuda) -> CudaCapturer:
    cap = CudaCapturer(0)
    cap.current_raw = lambda: cuda.current.cuda_stream  # type: ignore[method-assign]
    return cap


def test_on_a_users_stream_the_graph_captures_there_and_adds_no_workspace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    cuda.current = mine = FakeStream(7, cuda.log)
    cuda.matmul()  # eager ran on the user's stream first: its workspace exists
    cap = capturer(cuda)
    graphs = [cap.capture(cuda.matmul) for _ in range(3)]
    assert cuda.made == 0, "a side stream was made, though the caller's stream can be captured"
    assert ("begin", 7) in cuda.log and not [e for e in cuda.log if e[0] == "wait"]
    assert (cap.stream_bytes, cap.side_bytes, cap.caller_captures, cap.side_captures) == \
        (0, 0, 3, 0)
    assert all(g.stream is mine for g in graphs)  # type: ignore[attr-defined]
    cuda.log.clear()
    graphs[0].replay()  # on its capture stream: no wait
    assert cuda.log == [("replay", 7)] and cap.cross_stream_replays == 0


def test_on_the_default_stream_the_graph_captures_on_a_side_stream_that_pays_the_workspace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    cuda.matmul()  # eager on the default stream
    cap = capturer(cuda)
    graphs = [cap.capture(cuda.matmul) for _ in range(2)]
    assert cuda.made == 1  # one side stream for every capture
    side = 101
    assert cuda.log[:2] == [("wait", side, 0), ("begin", side)]
    assert ("wait", 0, side) in cuda.log  # the caller's stream waits for the capture
    assert (cap.stream_bytes, cap.side_bytes, cap.caller_captures, cap.side_captures) == \
        (WORKSPACE, WORKSPACE, 0, 2)
    assert graphs[0].stream is None  # type: ignore[attr-defined]
    cuda.log.clear()
    cuda.current = FakeStream(9, cuda.log)
    graphs[0].replay()  # a side stream's graph replays anywhere without waits
    assert cuda.log == [("replay", 9)] and cap.cross_stream_replays == 0


def test_a_graph_replayed_off_its_capture_stream_waits_both_ways(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its matmuls use the capture stream's workspace, which eager work there uses too."""
    cuda = FakeCuda(monkeypatch)
    cuda.current = FakeStream(7, cuda.log)
    cap = capturer(cuda)
    graph = cap.capture(cuda.matmul)
    assert cap.stream_bytes == WORKSPACE  # no eager matmul on it before: the warm-up made it
    cuda.current = cuda.default
    cuda.log.clear()
    graph.replay()
    assert cuda.log == [("wait", 0, 7), ("replay", 0), ("wait", 7, 0)]
    assert cap.cross_stream_replays == 1


def test_several_user_streams_each_capture_on_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    cap = capturer(cuda)
    graphs = []
    for raw in (7, 8):
        cuda.current = FakeStream(raw, cuda.log)
        cuda.matmul()
        graphs.append(cap.capture(cuda.matmul))
    assert [e for e in cuda.log if e[0] == "begin"] == [("begin", 7), ("begin", 8)]
    assert cuda.made == 0 and cap.stream_bytes == 0 and cap.caller_captures == 2


class _Stub:
    def replay(self) -> None: ...


def test_a_pooled_graph_is_freed_at_once_not_by_the_garbage_collector() -> None:
    """The parking count (pytorch#193402) relies on __del__ running when the last reference
    goes: the ordered replay must not make a cycle through the graph."""
    owner = CudaCapturer(0)  # no CUDA call until it captures
    stream = FakeStream(7, [])
    gc.disable()
    try:
        graphs = [PooledGraph(_Stub(), owner, stream), PooledGraph(_Stub(), owner, None)]
        assert owner.live == 2
        graphs.clear()
        assert owner.live == 0 and owner.parked == []
    finally:
        gc.enable()


def test_the_report_says_how_to_avoid_the_side_streams_workspace() -> None:
    side = GraphMemory([], capture_stream=WORKSPACE, side_stream=WORKSPACE, side_captures=3)
    assert "torch.cuda.stream(torch.cuda.Stream())" in side.line()
    assert "32.0 MiB is cuBLAS's workspace for surgery's side stream" in side.line()
    mine = GraphMemory([], capture_stream=0, caller_captures=3)
    assert "side stream" not in mine.line() and mine.stream_hint() == ""


# --- on a GPU ------------------------------------------------------------------------------

WIDTH = 1024


def _chain(cap: CudaCapturer) -> tuple[list[nn.Linear], list[RegionGraphs], list[Calls]]:
    with torch.device("cuda"):
        mods = [nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    calls = [Calls(m) for m in mods]
    graphs = [RegionGraphs(m, cap, c.raw, clone_outputs=False, warn=print, label=str(i))
              for i, (m, c) in enumerate(zip(mods, calls, strict=True))]
    torch.cuda.synchronize()  # made on the default stream; the tests use them on others
    return mods, graphs, calls


def _run(mods: list[nn.Linear], graphs: list[RegionGraphs], calls: list[Calls],
         x: torch.Tensor) -> torch.Tensor:
    want = x
    for g, c, m in zip(graphs, calls, mods, strict=True):
        want = m(want)
        x = g((x,), {}, c)
        torch.testing.assert_close(x, want)
    return x


@pytest.mark.cuda
def test_cuda_on_a_user_stream_the_capture_adds_no_workspace_and_replays_right() -> None:
    """4 Linear(1024, 1024) at M=1, fp32, eager first on the user's stream (as the H200 probe)."""
    torch.manual_seed(0)
    cap = CudaCapturer(torch.cuda.current_device())
    mods, graphs, calls = _chain(cap)
    stream = torch.cuda.Stream()
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad(), torch.cuda.stream(stream):
        x = torch.randn(1, WIDTH, device="cuda")
        for m in mods:  # eager: the stream's cuBLAS workspace
            m(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for step in range(6):
            out = _run(mods, graphs, calls, torch.randn(1, WIDTH, device="cuda"))
            if step % 2:
                held.append((out, out.clone()))  # a caller keeps some outputs
        torch.cuda.synchronize()
        added = torch.cuda.memory_allocated() - before
    for out, value in held:
        torch.testing.assert_close(out, value)  # never overwritten by later replays
    # Every output was checked against eager in _run; held outputs make rings grow, and a
    # reader of a path whose ring moved recaptures, so only "some replays" is certain here.
    assert sum(g.replays for g in graphs) > 0 and not any(g.disabled for g in graphs)
    assert (cap.side_captures, cap.caller_captures) == (0, sum(g.captures for g in graphs))
    assert cap.stream_bytes < 2**20 and cap.side_bytes == 0, cap.stream_bytes
    # Output sets, static inputs and the held outputs are a few KiB each: nothing near 32 MiB.
    assert added < 4 * 2**20, f"capture on the user's stream added {added / 2**20:.1f} MiB"


@pytest.mark.cuda
def test_cuda_on_the_default_stream_the_side_stream_is_used_and_reported() -> None:
    torch.manual_seed(0)
    cap = CudaCapturer(torch.cuda.current_device())
    mods, graphs, calls = _chain(cap)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with torch.no_grad():
        for _ in range(4):
            _run(mods, graphs, calls, torch.randn(1, WIDTH, device="cuda"))
    assert cap.caller_captures == 0 and cap.side_captures == sum(g.captures for g in graphs) > 0
    assert cap.side_bytes == cap.stream_bytes  # all of it on the side stream


@pytest.mark.cuda
def test_cuda_a_graph_replayed_on_another_stream_stays_right() -> None:
    torch.manual_seed(0)
    cap = CudaCapturer(torch.cuda.current_device())
    mods, graphs, calls = _chain(cap)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.no_grad():
        with torch.cuda.stream(first):
            for _ in range(3):
                _run(mods, graphs, calls, torch.randn(1, WIDTH, device="cuda"))
        torch.cuda.synchronize()
        replays = sum(g.replays for g in graphs)
        for where in (second, torch.cuda.default_stream()):
            with torch.cuda.stream(where):
                for _ in range(3):  # eager work on the capture stream in between
                    with torch.cuda.stream(first):
                        big = torch.randn(256, WIDTH, device="cuda")
                        big @ big.T
                    _run(mods, graphs, calls, torch.randn(1, WIDTH, device="cuda"))
        torch.cuda.synchronize()
    assert sum(g.replays for g in graphs) >= replays + 24
    assert cap.cross_stream_replays >= 24 and cap.side_captures == 0


def _frames(model: examples.ExampleModel, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    model.reset_stream()
    return [model(f).clone() for f in frames]


@pytest.mark.cuda
def test_cuda_apply_manifest_on_a_user_stream_captures_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The streaming example (its KV cache holds attn_pre's outputs: rings) under a user stream:
    outputs match eager, every capture on that stream, no workspace kept, no hint."""
    from surgery.planning.plan import compile_defaults, plan_model

    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    frames = [model.example_input(seed=i) for i in range(8)]
    manifest = plan_model("surgery.examples:tiny", compile=compile_defaults(capture="region"))
    monkeypatch.setattr(apply_mod, "_CAPTURERS", {})  # a capturer of its own: its counts
    torch.cuda.synchronize()  # weights and frames copied on the default stream
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        ref = _frames(model, frames)
        with apply_manifest(model, manifest.manifest,
                            warmup=lambda m: _frames(m, frames[:2])) as handle:
            outs = _frames(model, frames)
            mem = handle.report.memory
            assert sum(r.cuda_graph_replays for r in handle.report) > 0, handle.report
            assert mem.caller_captures > 0 and mem.side_captures == 0, mem
            assert mem.capture_stream < 2**20 and mem.stream_hint() == "", mem.line()
    for out, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("torch_frees_it", [pytest.param(True, id="freed-with-the-pool"),
                                             pytest.param(False, id="kept-by-torch")])
def test_the_side_streams_workspace_is_counted_once_across_pools(
        monkeypatch: pytest.MonkeyPatch, torch_frees_it: bool) -> None:
    """When the last graph of a pool goes, recent torch frees its capture stream's workspace
    (CUDAGraph::reset) and the next pool's warm-up makes it again; an older torch keeps it. Either
    way the next pool's report holds it once, and a pool on the caller's stream holds none."""
    cuda = FakeCuda(monkeypatch)
    cap = capturer(cuda)
    graph = cap.capture(cuda.matmul)
    assert cap.stream_bytes == WORKSPACE
    del graph  # the last graph of its pool
    if torch_frees_it:
        cuda.workspaces.discard(101)
        cuda.allocated -= WORKSPACE
    graphs = [cap.capture(cuda.matmul) for _ in range(2)]
    assert (cap.stream_bytes, cap.side_bytes, cap.side_captures) == (WORKSPACE, WORKSPACE, 2)
    assert graphs[0].stream is None  # type: ignore[attr-defined]
    graphs.clear()
    cuda.current = FakeStream(7, cuda.log)  # the user follows the hint
    cuda.matmul()
    graphs = [cap.capture(cuda.matmul)]
    assert (cap.stream_bytes, cap.side_bytes, cap.caller_captures) == (0, 0, 1)


def test_no_capture_inside_the_callers_own_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model run inside the user's own torch.cuda.graph: surgery begins no capture of its own
    and runs nothing (RegionGraphs then runs the path compiled, the reason in its notes)."""
    from surgery.runtime.graphs.capture import CAPTURING_ALREADY

    cuda = FakeCuda(monkeypatch)
    cuda.current = FakeStream(7, cuda.log)
    cuda.capturing = True
    cap = capturer(cuda)
    ran: list[int] = []
    with pytest.raises(RuntimeError, match="capturing a CUDA graph of its own"):
        cap.capture(lambda: ran.append(1))
    assert ran == [] and cuda.log == [] and cuda.made == 0 and cap.live == 0
    assert "another capture" in CAPTURING_ALREADY


@pytest.mark.cuda
def test_cuda_a_region_inside_the_users_own_capture_runs_compiled_in_it() -> None:
    cap = CudaCapturer(torch.cuda.current_device())
    mods, graphs, calls = _chain(cap)
    x = torch.randn(1, WIDTH, device="cuda")
    with torch.no_grad():
        _run(mods, graphs, calls, x)  # the first call: compiled, nothing captured yet
        user = torch.cuda.CUDAGraph()
        with torch.cuda.graph(user):  # the second call would capture: inside the user's graph
            out = x
            for g, c in zip(graphs, calls, strict=True):
                out = g((out,), {}, c)
        user.replay()
        torch.cuda.synchronize()
        want = x
        for m in mods:
            want = m(want)
    torch.testing.assert_close(out, want)
    assert all("capturing a CUDA graph of its own" in g.disabled for g in graphs), graphs[0].notes
    assert cap.live == 0


def gpt2_decode_on_cuda() -> tuple[Any, torch.Tensor, Callable[[Any], torch.Tensor], Any]:
    """(model, prompt, generate, manifest): tiny transformers GPT-2 on CUDA, a 6-token prompt,
    greedy ``generate()`` of 10 new tokens, and its names plan (aot_eager, region capture)."""
    from surgery.planning.plan import plan_module
    from tests.zoo_models import gpt2

    torch.manual_seed(0)
    model = gpt2().eval().cuda()
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(1)).cuda()

    def generate(m: Any) -> torch.Tensor:
        return m.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          pad_token_id=0)

    manifest = plan_module(model, source="gpt2",
                           compile={"backend": "aot_eager", "capture": "region"}).manifest
    return model, ids, generate, manifest


@pytest.mark.cuda
def test_cuda_gpt2_generate_on_a_user_stream_shares_eagers_workspace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers GPT-2 through generate() (a growing DynamicCache), names plan (its MLPs
    capture and replay): on a user stream every capture is there and keeps no workspace, tokens
    equal eager's; then generate() on the default stream replays the same graphs, ordered."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 tokens
    monkeypatch.setattr(apply_mod, "_CAPTURERS", {})
    model, _, generate, manifest = gpt2_decode_on_cuda()
    torch.cuda.synchronize()  # weights and prompt copied on the default stream
    stream = torch.cuda.Stream()
    with torch.inference_mode(), torch.cuda.stream(stream):
        want = generate(model)
        handle = apply_manifest(model, manifest, warmup=generate, passes=2)
        try:
            got = [generate(model) for _ in range(2)]
            mem = handle.report.memory
            assert all(r.graphs_captured > 0 and r.cuda_graph_replays > 0
                       for r in handle.report), handle.report.summary()
            assert mem.caller_captures > 0 and mem.side_captures == 0, mem
            assert mem.capture_stream < 2**20, mem.line()
            with torch.cuda.stream(torch.cuda.default_stream()):
                got.append(generate(model))
            cap = apply_mod._CAPTURERS[torch.cuda.current_device()]
            assert cap.cross_stream_replays > 0  # type: ignore[attr-defined]
        finally:
            handle.restore()
    for tokens in got:
        assert torch.equal(tokens, want), (tokens.tolist(), want.tolist())
