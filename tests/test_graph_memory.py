"""Region-graph memory (surgery.runtime.graphs.arena, surgery.runtime.graph_memory): what the
report says the graphs hold, what sharing saves, the cap, and that nothing a caller holds is
overwritten with shared buffers. On the CPU, with tests/test_graphs.py's faithful fake graph
(a replay reruns the captured work against the same buffers, as a CUDA graph does to memory).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from surgery import examples
from surgery.errors import SurgeryError
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graph_memory import parse_size
from surgery.runtime.graphs import arena
from surgery.runtime.graphs.replay import RegionGraphs
from tests.test_graphs import Calls, FakeCapturer, fake_cuda, graphs_for, tiny_manifest

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
__all__ = ["fake_cuda"]  # the fixture, imported for the tests below

WIDTH = 16


def chain(n: int, cap: FakeCapturer | None = None) -> tuple[list[nn.Linear], list[RegionGraphs],
                                                             list[Calls], FakeCapturer]:
    """n region paths of one layout, each a Linear: what `x = block(x)` over blocks looks like."""
    cap = cap or FakeCapturer()
    mods = [nn.Linear(WIDTH, WIDTH) for _ in range(n)]
    calls = [Calls(m) for m in mods]
    graphs = [RegionGraphs(m, cap, c.raw, clone_outputs=False, warn=print)
              for m, c in zip(mods, calls, strict=True)]
    return mods, graphs, calls, cap


def run_chain(graphs: list[RegionGraphs], calls: list[Calls], x: torch.Tensor) -> torch.Tensor:
    for g, c in zip(graphs, calls, strict=True):
        x = g((x,), {}, c)
    return x


def held_by(graphs: list[RegionGraphs]) -> tuple[int, int]:
    """(output bytes, static input bytes): the distinct storages the graphs hold, counted here
    from the graphs' own buffers (independently of the arena and the report)."""
    outs: dict[int, int] = {}
    ins: dict[int, int] = {}
    for g in graphs:
        for c in g.graphs.values():
            for o in c.sets:
                outs.update((s.data_ptr(), s.nbytes()) for s in o.storages)
            ins.update((c.inputs[i].untyped_storage().data_ptr(),
                        c.inputs[i].untyped_storage().nbytes()) for i in c.copied)
    return sum(outs.values()), sum(ins.values())


@pytest.mark.parametrize("share", [True, False])
def test_chained_paths_take_turns_over_two_output_sets(monkeypatch: pytest.MonkeyPatch,
                                                       share: bool) -> None:
    """Ten blocks chained x = block(x): with sharing, two output sets for all of them (each
    block's input is the last one's output, so it takes the other set); without, ten."""
    monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy(share_outputs=share))
    mods, graphs, calls, _ = chain(10)
    one_set = 2 * WIDTH * 4
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, WIDTH)
            got = run_chain(graphs, calls, x).clone()
            want = x
            for m in mods:
                want = m(want)
            torch.testing.assert_close(got, want)
    assert all(g.output_sets == 1 and g.captures == 1 for g in graphs)  # no ring anywhere
    assert sum(g.replays for g in graphs) == 10 * 2
    outputs, _ = held_by(graphs)
    assert outputs == (2 if share else 10) * one_set


def test_the_report_counts_what_the_ring_sets_and_static_inputs_hold(
        fake_cuda: FakeCapturer) -> None:
    """The report's bytes are the graphs' own buffers, each storage once, summed over paths."""
    torch.manual_seed(0)
    model = examples.tiny().eval()
    frames = [model.example_input(seed=s) for s in range(6)]
    with torch.no_grad():
        handle = apply_manifest(model, tiny_manifest(model, clone_outputs=False),
                                warmup=lambda m: m(frames[0]), passes=2)
        for f in frames:
            model(f)
    mem = handle.report.memory
    graphs = [s.graphs for s in handle._slots]
    outputs, static = held_by(graphs)
    assert (mem.outputs, mem.static_inputs) == (outputs, static) and outputs > 0 and static > 0
    assert mem.total == outputs + static + mem.pool and mem.pool == 0  # no pool on the CPU
    # attn_pre keeps a ring (the KV cache holds 4 frames of k and v): window + 1 sets of its own.
    pre = mem.by_path("aggregator.global_blocks.0.attn_pre")
    k_and_v = sum(o.untyped_storage().nbytes() for o in
                  next(iter(graphs[4].graphs.values())).sets[0].tensors[:1])
    assert pre.output_sets == model.config.window + 1 and pre.outputs >= pre.output_sets * k_and_v
    assert sum(p.shared for p in mem.paths) > 0  # frame blocks share their sets
    line = mem.line()
    assert line.startswith("region graphs hold ") and "outputs" in line and "static inputs" in line
    assert line in handle.report.summary() and line in str(handle.report)
    handle.restore()
    assert handle.report.memory.paths == []  # restored: nothing held


def test_an_output_two_regions_read_in_place_stays_held_while_the_caller_holds_it() -> None:
    """B and C both read A's output in place. Each keeps a reference of its own, so a caller
    that keeps A's output past the next call of A still sees it held, and A does not overwrite
    it (when both readers kept the caller's own tensor, one reference was counted twice)."""
    cap = FakeCapturer()
    a_mod, b_mod, c_mod = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
    ca, cb, cc = Calls(a_mod), Calls(b_mod), Calls(c_mod)
    a, b, c = (RegionGraphs(m, cap, k.raw, clone_outputs=False, warn=print)
               for m, k in ((a_mod, ca), (b_mod, cb), (c_mod, cc)))
    with torch.no_grad():
        for call in range(4):
            h = a((torch.randn(2, WIDTH),), {}, ca)
            b((h,), {}, cb)
            c((h,), {}, cc)
            if call == 1:  # A captured in this call, and B and C read its output in place
                assert [len(cap_.adopted) for g in (b, c) for cap_ in g.graphs.values()] == [1, 1]
                kept, value = h, h.clone()
            del h
    torch.testing.assert_close(kept, value)  # A's replay in the next call would overwrite it
    assert a.output_sets == 2  # instead, A wrote another set


def test_held_outputs_are_never_overwritten_with_shared_sets() -> None:
    """Eight chained blocks of one layout; the caller keeps a random choice of their outputs
    for a random number of steps. Every kept output keeps its value, and every step's result
    matches eager."""
    rng = random.Random(0)
    mods, graphs, calls, _ = chain(8)
    kept: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (until step, output, value)
    checked = 0
    with torch.no_grad():
        for step in range(30):
            x = torch.randn(2, WIDTH)
            want = x
            for g, c, m in zip(graphs, calls, mods, strict=True):
                want = m(want)
                x = g((x,), {}, c)
                torch.testing.assert_close(x, want)
                if rng.random() < 0.2:
                    kept.append((step + rng.randint(0, 3), x, x.clone()))
            for _, out, value in kept:
                torch.testing.assert_close(out, value)
                checked += 1
            kept = [k for k in kept if k[0] > step]
            del x
    assert checked > 50 and all(not g.disabled for g in graphs)
    assert sum(g.replays for g in graphs) > 100


def test_static_inputs_are_one_buffer_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths whose inputs are not another region's output copy them into one shared buffer
    (per layout and per position among one call's inputs of that layout)."""
    for share, want_buffers in ((True, 2), (False, 12)):
        monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy(share_inputs=share))
        cap = FakeCapturer()
        mods = [nn.Linear(WIDTH, WIDTH) for _ in range(6)]

        def fn(m: nn.Linear) -> object:
            return lambda a, b: m(a) + m(b)

        calls = [Calls(fn(m)) for m in mods]
        graphs = [RegionGraphs(m, cap, c.raw, clone_outputs=False, warn=print)
                  for m, c in zip(mods, calls, strict=True)]
        with torch.no_grad():
            for _ in range(3):
                for m, g, c in zip(mods, graphs, calls, strict=True):
                    x, y = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
                    torch.testing.assert_close(g((x, y), {}, c), m(x) + m(y))
        _, static = held_by(graphs)
        assert static == want_buffers * 2 * WIDTH * 4, share
        assert all(g.replays == 1 for g in graphs)


def test_inference_mode_and_no_grad_do_not_share_buffers() -> None:
    """A buffer made under inference_mode cannot be written outside it: each mode gets its own."""
    mods, graphs, calls, _ = chain(3)
    for _ in range(3):
        with torch.inference_mode():
            run_chain(graphs, calls, torch.randn(2, WIDTH))
        with torch.no_grad():
            x = torch.randn(2, WIDTH)
            got = run_chain(graphs, calls, x)
            want = x
            for m in mods:
                want = m(want)
            torch.testing.assert_close(got, want)
    assert not any(g.disabled for g in graphs) and sum(g.replays for g in graphs) > 0
    for g in graphs:  # sig[1]: inference mode; its buffers were made in the same mode
        for sig, c in g.graphs.items():
            bufs = [t for o in c.sets for t in o.tensors] + [c.inputs[i] for i in c.copied]
            assert {t.is_inference() for t in bufs} == {sig[1]}


def test_the_cap_keeps_graphs_within_it_and_says_which_paths_run_without(
        fake_cuda: FakeCapturer, monkeypatch: pytest.MonkeyPatch) -> None:
    # With static inputs shared (opt-in), a third of the uncapped total admits some paths and
    # not others; unshared, the first paths' own inputs would take the whole third.
    monkeypatch.setattr(arena, "POLICY", arena.MemoryPolicy(share_inputs=True))
    torch.manual_seed(0)
    eager, model = examples.tiny().eval(), examples.tiny().eval()
    model.load_state_dict(eager.state_dict())
    frames = [model.example_input(seed=s) for s in range(5)]
    with torch.no_grad():
        free = apply_manifest(model, tiny_manifest(model, clone_outputs=False),
                              warmup=lambda m: m(frames[0]), passes=2)
        uncapped = free.report.memory.total
        free.restore()
        limit = uncapped // 3
        model.reset_stream()
        handle = apply_manifest(model, tiny_manifest(model, clone_outputs=False),
                                warmup=lambda m: m(frames[0]), passes=2,
                                max_graph_memory=limit)
        eager(frames[0]), eager(frames[0])
        outs = [model(f).clone() for f in frames]
        want = [eager(f) for f in frames]
    for got, exp in zip(outs, want, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-5)
    mem = handle.report.memory
    assert 0 < mem.total <= limit < uncapped and mem.limit == limit
    over = [r for r in handle.report if any("max_graph_memory" in n for n in r.notes)]
    assert over and set(mem.over_cap) == {r.path for r in over}
    assert all(r.status == "compiled" for r in handle.report)  # compiled, just not captured
    assert any(r.graphs_captured == 0 for r in over)
    assert "max_graph_memory" in mem.line() and "path(s) over it" in mem.line()
    handle.restore()


@pytest.mark.parametrize(("given", "want"), [
    pytest.param(None, None, id="none"),
    pytest.param(1024, 1024, id="int"),
    pytest.param("2GiB", 2 * 2**30, id="GiB"),
    pytest.param(" 512 mib ", 512 * 2**20, id="spaces-lowercase"),
    pytest.param("1.5GB", 1_500_000_000, id="decimal"),
])
def test_parse_size(given: object, want: int | None) -> None:
    assert parse_size(given) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["2 GiBs", "lots", "-1GiB", 0, "0", True, [1], "1e400GiB",
                                   "nan"])
def test_parse_size_refuses_what_is_not_a_size(given: object) -> None:
    with pytest.raises(SurgeryError, match="max_graph_memory") as err:
        parse_size(given)  # type: ignore[arg-type]
    assert err.value.hint


def test_apply_refuses_a_bad_cap_before_touching_the_model() -> None:
    model = examples.tiny().eval()
    forward = vars(model.aggregator.frame_blocks[0]).get("forward")
    with pytest.raises(SurgeryError, match="not a size"):
        apply_manifest(model, tiny_manifest(model), max_graph_memory="two gigs")
    assert vars(model.aggregator.frame_blocks[0]).get("forward") is forward


def test_graphs_without_an_arena_on_their_capturer_get_one() -> None:
    """A capturer written before the arena (issue 19's, a test's) still works: one is attached."""
    g, calls, _, cap = graphs_for(nn.Linear(4, 4))
    with torch.no_grad():
        for _ in range(3):
            g((torch.randn(2, 4),), {}, calls)
    assert isinstance(cap.arena, arena.BufferArena) and g.replays == 1  # type: ignore[attr-defined]


# --- on the GPU ---------------------------------------------------------------------------------

def _cuda_stream(model: nn.Module, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    model.reset_stream()  # type: ignore[operator]
    return [model(f).clone() for f in frames]


def _region_plan() -> object:
    from surgery.planning.plan import compile_defaults, plan_model

    return plan_model("surgery.examples:tiny", compile=compile_defaults(capture="region")).manifest


@pytest.mark.cuda
def test_cuda_the_report_matches_the_buffers_and_reads_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the report's bytes are the graphs' buffers, the pool's size comes from the
    allocator, frame blocks share output sets (no ring), attn_pre keeps its KV-cache ring."""
    from surgery.runtime import apply as apply_mod

    # A capturer of its own: a side stream that earlier tests' routed calls made no workspace on.
    monkeypatch.setattr(apply_mod, "_CAPTURERS", {})
    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    frames = [model.example_input(seed=i) for i in range(8)]
    with torch.no_grad():
        ref = _cuda_stream(model, frames)
        # Unrouted (surgery.runtime.stream_route), so that the captures run on the side stream
        # for a caller on the default stream and its workspace is the graphs' own.
        with apply_manifest(model, _region_plan(), warmup=lambda m: _cuda_stream(m, frames[:2]),
                            route_default_stream=False) as handle:
            outs = _cuda_stream(model, frames)
            mem = handle.report.memory
            graphs = [g for s in handle._slots for g in [s.graphs] if g is not None]
            assert (mem.outputs, mem.static_inputs) == held_by(graphs)
            assert mem.pool_reserved is not None and mem.pool_reserved > 0, mem.line()
            # The capture stream's cuBLAS workspace (the linears' matmuls), kept for good.
            assert mem.capture_stream > 0 and mem.total > mem.pool + mem.outputs, mem.line()
            assert mem.side_captures > 0 and mem.routed_captures == 0, mem.line()
            frame = mem.by_path("aggregator.frame_blocks.1")
            assert frame.output_sets == 1 and frame.shared >= 1, mem  # no ring, no set of its own
            pre = handle.report.by_path("aggregator.global_blocks.0.attn_pre")
            assert pre.output_sets == model.config.window + 1
    for out, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
def test_cuda_the_cap_demotes_paths_and_the_graphs_stay_under_it() -> None:
    torch.manual_seed(0)
    model = examples.tiny().cuda().eval()
    frames = [model.example_input(seed=i) for i in range(6)]
    with torch.no_grad():
        ref = _cuda_stream(model, frames)
        with apply_manifest(model, _region_plan(),
                            warmup=lambda m: _cuda_stream(m, frames[:2])) as free:
            uncapped = free.report.memory
        # Room for the pool (its segments come 2 MiB at a time), the capture stream's cuBLAS
        # workspace and half the buffers.
        limit = uncapped.pool + uncapped.capture_stream + \
            (uncapped.outputs + uncapped.static_inputs) // 2
        torch.cuda.synchronize()
        with apply_manifest(model, _region_plan(), warmup=lambda m: _cuda_stream(m, frames[:2]),
                            max_graph_memory=limit) as handle:
            outs = _cuda_stream(model, frames)
            mem = handle.report.memory
            assert mem.over_cap, (uncapped.line(), mem.line())
            assert mem.total <= limit, (uncapped.line(), mem.line())
            assert all(r.status == "compiled" for r in handle.report), handle.report.summary()
    for out, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
def test_cuda_held_outputs_are_never_overwritten_with_shared_sets() -> None:
    """The random keep-and-release test above, with real CUDA graphs."""
    from surgery.runtime.graphs.capture import CudaCapturer

    rng = random.Random(1)
    cap = CudaCapturer(torch.cuda.current_device())
    with torch.device("cuda"):
        mods, graphs, calls, _ = chain(6, cap)  # type: ignore[arg-type]
    kept: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for step in range(25):
            x = torch.randn(2, WIDTH, device="cuda")
            want = x
            for g, c, m in zip(graphs, calls, mods, strict=True):
                want = m(want)
                x = g((x,), {}, c)
                torch.testing.assert_close(x, want)
                if rng.random() < 0.25:
                    kept.append((step + rng.randint(0, 3), x, x.clone()))
            for _, out, value in kept:
                torch.testing.assert_close(out, value)
            kept = [k for k in kept if k[0] > step]
    assert sum(g.replays for g in graphs) > 50 and not any(g.disabled for g in graphs)
