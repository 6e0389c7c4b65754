"""Under max_graph_memory the largest region paths give way first (surgery.runtime.graphs.demote),
whatever order the model calls them in. On the CPU, with tests/test_graphs.py's faithful fake
graph (a replay reruns the captured work against the same buffers)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs import arena
from surgery.runtime.graphs.demote import alone_bytes
from surgery.runtime.graphs.replay import RegionGraphs
from tests.test_graphs import Calls, FakeCapturer, fake_cuda

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
__all__ = ["fake_cuda"]  # the fixture, imported for the tests below

WIDTH = 16
ROWS = 2
# Output widths of five paths, all different (no two share a first output set). Each path holds
# alone its static input (ROWS x WIDTH floats) and its output set (ROWS x width floats).
WIDTHS = {"a": 64, "b": 8, "c": 16, "d": 12, "e": 32}


def alone(width: int) -> int:
    return ROWS * (WIDTH + width) * 4


def paths(order: str) -> tuple[dict[str, nn.Linear], dict[str, RegionGraphs], dict[str, Calls],
                               FakeCapturer]:
    """One Linear(WIDTH, width) path per letter, registered (installed) in ``order``."""
    cap = FakeCapturer()
    mods = {k: nn.Linear(WIDTH, WIDTHS[k]) for k in order}
    calls = {k: Calls(m) for k, m in mods.items()}
    graphs = {k: RegionGraphs(m, cap, calls[k].raw, clone_outputs=False, warn=print, label=k)
              for k, m in mods.items()}
    return mods, graphs, calls, cap


def step(order: str, mods: dict[str, nn.Linear], graphs: dict[str, RegionGraphs],
         calls: dict[str, Calls]) -> None:
    """Each path once, on a fresh input (copied into its static input), in ``order``; checked."""
    for k in order:
        x = torch.randn(ROWS, WIDTH)
        torch.testing.assert_close(graphs[k]((x,), {}, calls[k]), mods[k](x))


@pytest.mark.parametrize(("order", "a_captured_first"), [
    pytest.param("abcde", True, id="largest-called-first"),
    pytest.param("bcdea", False, id="largest-called-last"),
    pytest.param("edcba", False, id="reversed"),
    pytest.param("bacde", True, id="largest-called-second"),
])
def test_the_cap_demotes_the_largest_path_whatever_the_call_order(
        monkeypatch: pytest.MonkeyPatch, order: str, a_captured_first: bool) -> None:
    """A cap that holds every path but the largest: the largest (a) runs without a graph, the
    four others replay, in every call order. Admitting by first capture demoted c and e when a
    was called first."""
    monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy())  # the defaults
    total = sum(alone(w) for w in WIDTHS.values())
    limit = total - alone(WIDTHS["a"])
    mods, graphs, calls, cap = paths(order)
    arena.arena_of(cap).limit = limit
    with torch.no_grad():
        for _ in range(4):
            step(order, mods, graphs, calls)
    used = arena.arena_of(cap)
    assert sum(used.held_bytes()) == limit  # exactly b, c, d and e
    assert used.used() <= limit
    captured = {k for k, g in graphs.items() if g.graphs}
    assert captured == {"b", "c", "d", "e"}, {k: g.notes for k, g in graphs.items()}
    assert all(graphs[k].replays >= 2 for k in captured)
    assert graphs["a"].disabled and "max_graph_memory" in graphs["a"].over_cap
    assert not any(graphs[k].over_cap for k in captured)
    # a is demoted when it had a graph to give up (captured before the cap was reached);
    # otherwise it is simply not captured
    want = [("a", alone(WIDTHS["a"]))] if a_captured_first else []
    assert used.demoted == want
    if want:
        assert "demoted by max_graph_memory" in graphs["a"].notes[-1]
        assert "largest paths give way first" in graphs["a"].notes[-1]


def test_a_tie_keeps_the_path_already_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two paths of one size and room for one: the first captured keeps its graph (demoting it
    for its twin would free nothing the twin does not take again)."""
    monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy())
    cap = FakeCapturer()
    mods = [nn.Linear(WIDTH, 24), nn.Linear(WIDTH, 24)]
    # The same bytes in another shape, so that the twin cannot write the first one's set.
    fns = [mods[0], lambda x: mods[1](x).reshape(-1)]
    calls = [Calls(f) for f in fns]
    graphs = [RegionGraphs(m, cap, c.raw, clone_outputs=False, warn=print, label=str(i))
              for i, (m, c) in enumerate(zip(mods, calls, strict=True))]
    arena.arena_of(cap).limit = alone(24) + alone(24) // 2
    with torch.no_grad():
        for _ in range(3):
            for g, c, f in zip(graphs, calls, fns, strict=True):
                x = torch.randn(ROWS, WIDTH)
                torch.testing.assert_close(g((x,), {}, c), f(x))
    assert bool(graphs[0].graphs) and not graphs[1].graphs
    assert arena.arena_of(cap).demoted == [] and graphs[1].over_cap
    assert sum(arena.arena_of(cap).held_bytes()) == alone(24)


def test_a_set_the_caller_holds_is_not_counted_as_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller holds the large path's last output. Demoting it would free only its static
    input (the held set stays the caller's), less than the small path needs, so it keeps its
    graph and the small path gives way; what the caller holds keeps its value."""
    monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy())
    mods, graphs, calls, cap = paths("ab")
    a_set = ROWS * WIDTHS["a"] * 4
    with torch.no_grad():
        for _ in range(2):
            kept = graphs["a"]((torch.randn(ROWS, WIDTH),), {}, calls["a"])
        assert graphs["a"].graphs  # captured, and the caller holds its output set
        value = kept.clone()
        sizes = alone_bytes(arena.arena_of(cap))
        assert sizes[graphs["a"]] == alone(WIDTHS["a"]) - a_set  # only its static input
        # Room for b only if a's held output set were freed.
        arena.arena_of(cap).limit = alone(WIDTHS["a"]) + alone(WIDTHS["b"]) - ROWS * WIDTH * 4
        step("bbab", mods, graphs, calls)
    torch.testing.assert_close(kept, value)
    assert graphs["a"].graphs and not graphs["a"].disabled
    assert not graphs["b"].graphs and "no larger path could make room" in graphs["b"].over_cap
    assert arena.arena_of(cap).demoted == []
    assert arena.arena_of(cap).used() <= arena.arena_of(cap).limit


# --- through apply_manifest ----------------------------------------------------------------------

class HeadFirst(nn.Module):
    """A wide head called first, then a chain of narrow blocks: admitting by first capture
    would spend the cap on the head and leave the blocks without graphs."""

    def __init__(self, blocks: int = 4, wide: int = 512) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, wide)
        self.down = nn.Linear(wide, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(self.head(x))
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def head_first_manifest(model: nn.Module) -> object:
    from surgery.formats.fingerprint import compute_fingerprint
    from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region

    regions = [Region("head", ["head"]),
               Region("block", [f"blocks.{i}" for i in range(len(model.blocks))])]
    compile_ = {**DEFAULT_COMPILE, "backend": "aot_eager", "capture": "region",
                "clone_outputs": False}
    compile_.pop("mode", None)
    compile_.pop("emulate_precision_casts", None)
    return Manifest(compute_fingerprint(model.state_dict()), regions, compile=compile_)


def head_first_limit(uncapped: object) -> int:
    """Room for the pool, the capture stream's workspace, the head's buffers and half the
    blocks': the head is captured first, and gives way when the blocks come (they all fit
    without it)."""
    head = uncapped.by_path("head")  # type: ignore[attr-defined]
    head_buffers = head.outputs + head.static_inputs
    blocks = uncapped.outputs + uncapped.static_inputs - head_buffers  # type: ignore[attr-defined]
    assert head_buffers > blocks > 0
    return (uncapped.pool + uncapped.capture_stream  # type: ignore[attr-defined, no-any-return]
            + head_buffers + blocks // 2)


def _stream(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x).clone() for x in xs]


def test_apply_demotes_the_wide_head_called_first(fake_cuda: FakeCapturer) -> None:
    """Through apply_manifest: a cap that holds the head or the blocks, not both. The head,
    captured first, is demoted when the blocks need the room; the report says so, in its line
    too. (Admitting by first capture kept the head and left blocks without graphs.)"""
    torch.manual_seed(0)
    model = HeadFirst()
    xs = [torch.randn(ROWS, WIDTH) for _ in range(4)]
    want = _stream(model, xs)
    with apply_manifest(model, head_first_manifest(model), warmup=lambda m: _stream(m, xs[:1]),
                        passes=2) as free:
        _stream(model, xs)
        uncapped = free.report.memory
    limit = head_first_limit(uncapped)
    with apply_manifest(model, head_first_manifest(model), warmup=lambda m: _stream(m, xs[:1]),
                        passes=2, max_graph_memory=limit) as handle:
        got = _stream(model, xs)
        mem = handle.report.memory
        assert mem.total <= limit < uncapped.total
        assert mem.over_cap == ["head"] and [p for p, _ in mem.demoted] == ["head"]
        rec = handle.report.by_path("head")
        assert rec.status == "compiled" and any("demoted by max_graph_memory" in n
                                                for n in rec.notes)
        blocks = [handle.report.by_path(f"blocks.{i}") for i in range(4)]
        assert all(b.graphs_captured >= 1 and b.graph_replays >= len(xs) for b in blocks)
        assert "the largest first (1 demoted, the first head" in mem.line()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.cuda
def test_cuda_the_cap_demotes_the_largest_path_and_the_peak_stays_under_it() -> None:
    """On a GPU, real graphs: under a cap that holds the wide head or the blocks, not both, the
    head is demoted, the blocks replay, what the graphs hold (pool included) stays under the
    cap, and the steady step's peak over eager's peak stays under it too."""
    torch.manual_seed(0)
    model = HeadFirst(blocks=6, wide=8192).cuda().eval()
    xs = [torch.randn(256, WIDTH, device="cuda") for _ in range(6)]

    def peak_of_stream() -> tuple[list[torch.Tensor], int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = _stream(model, xs)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated()

    want, _ = peak_of_stream()
    _, eager_peak = peak_of_stream()
    warm = lambda m: _stream(m, xs[:2])  # noqa: E731
    with apply_manifest(model, head_first_manifest(model), warmup=warm) as free:
        _, free_peak = peak_of_stream()
        uncapped = free.report.memory
        assert free.report.by_path("head").graphs_captured >= 1, uncapped.line()
    limit = head_first_limit(uncapped)
    with apply_manifest(model, head_first_manifest(model), warmup=warm,
                        max_graph_memory=limit) as handle:
        got, capped_peak = peak_of_stream()
        mem = handle.report.memory
        assert "head" in mem.over_cap, (uncapped.line(), mem.line())
        assert mem.total <= limit, (uncapped.line(), mem.line())
        assert all(handle.report.by_path(f"blocks.{i}").graph_replays >= len(xs)
                   for i in range(6)), handle.report.summary()
    assert capped_peak - eager_peak <= limit, (eager_peak, capped_peak, free_peak, limit)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


class _StubGraph:
    """Stands in for a torch.cuda.CUDAGraph: records its destruction."""

    destroyed: ClassVar[list[int]] = []

    def __init__(self, n: int) -> None:
        self.n = n

    def replay(self) -> None: ...

    def __del__(self) -> None:
        _StubGraph.destroyed.append(self.n)


def test_a_dropped_graph_is_parked_until_the_last_of_its_pool_goes() -> None:
    """Destroying a CUDAGraph clears its capture stream's cuBLAS workspace, which the graphs
    still alive on that stream use (pytorch#193402): a demoted path's graph waits, parked,
    until the last graph of the pool is dropped."""
    from surgery.runtime.graphs.capture import CudaCapturer, PooledGraph

    _StubGraph.destroyed.clear()
    owner = CudaCapturer(0)  # no CUDA call until it captures
    graphs = [PooledGraph(_StubGraph(i), owner) for i in range(3)]  # type: ignore[arg-type]
    assert owner.live == 3
    del graphs[1]  # demoted: parked, not destroyed
    assert _StubGraph.destroyed == [] and len(owner.parked) == 1
    del graphs[0]
    assert _StubGraph.destroyed == [] and len(owner.parked) == 2
    graphs.clear()  # the last one: everything goes
    assert sorted(_StubGraph.destroyed) == [0, 1, 2] and owner.parked == [] and owner.live == 0


@pytest.mark.cuda
def test_cuda_a_demoted_graph_leaves_the_others_replaying_right() -> None:
    """Real graphs with matmuls on one capture stream: one is dropped (parked), the cache is
    emptied, and the other keeps replaying correct results."""
    from surgery.runtime.graphs.capture import CudaCapturer

    cap = CudaCapturer(torch.cuda.current_device())
    with torch.device("cuda"):
        mods = [nn.Linear(512, 512), nn.Linear(512, 512)]
    calls = [Calls(m) for m in mods]
    graphs = [RegionGraphs(m, cap, c.raw, clone_outputs=False, warn=print, label=str(i))
              for i, (m, c) in enumerate(zip(mods, calls, strict=True))]
    with torch.no_grad():
        for _ in range(3):
            for g, c, m in zip(graphs, calls, mods, strict=True):
                x = torch.randn(64, 512, device="cuda")
                torch.testing.assert_close(g((x,), {}, c), m(x))
        graphs[0].demote("test")
        assert len(cap.parked) == 1 and cap.live == 1
        torch.cuda.empty_cache()
        for _ in range(3):
            x = torch.randn(64, 512, device="cuda")
            torch.testing.assert_close(graphs[1]((x,), {}, calls[1]), mods[1](x))
    assert graphs[1].replays >= 4
