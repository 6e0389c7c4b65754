"""Region CUDA graphs (surgery.runtime.graphs.replay), checked on the CPU with a graph that behaves
like one.

``FakeCapturer`` records the captured work and ``replay()`` runs it again against the same input
and output buffers, which is exactly what a CUDA graph's replay does to memory: the graph's input
buffers are read, its owned output buffers are overwritten. So every bookkeeping rule (signature,
held outputs, moved parameters, inputs written in place) is exercised here; the real capture runs
in tests/test_apply_cuda.py on a GPU.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from surgery import examples
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime import apply as apply_mod
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs import outputs
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.report import SurgeryWarning

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class FakeGraph:
    def __init__(self, work: Callable[[], None]) -> None:
        self.work = work

    def replay(self) -> None:
        self.work()


class FakeCapturer:
    device = -1  # CPU tensors

    def __init__(self, fail: bool = False) -> None:
        self.owned: Any = weakref.WeakValueDictionary()  # as CudaCapturer holds them
        self.fail = fail
        # The live graphs, held weakly as a CUDA capturer holds none: a dropped graph (and the
        # static inputs its work reads) is freed, as on the device.
        self.graphs: weakref.WeakSet[FakeGraph] = weakref.WeakSet()

    def capture(self, work: Callable[[], None]) -> FakeGraph:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        work()
        graph = FakeGraph(work)
        self.graphs.add(graph)
        return graph


class Calls:
    """run_compiled for a RegionGraphs: runs fn, counts the calls that did not replay."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.runs = 0

    def raw(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.fn(*args, **kwargs)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        self.runs += 1
        return self.fn(*args, **kwargs), True


def graphs_for(module: nn.Module, fn: Callable[..., Any] | None = None, *,
               clone: bool = False, fail: bool = False
               ) -> tuple[RegionGraphs, Calls, list[str], FakeCapturer]:
    calls = Calls(fn or module)
    warned: list[str] = []
    cap = FakeCapturer(fail)
    return RegionGraphs(module, cap, calls.raw, clone_outputs=clone, warn=warned.append), \
        calls, warned, cap


def test_second_call_captures_and_later_calls_replay_with_their_own_inputs() -> None:
    lin = nn.Linear(4, 3)
    g, calls, _, cap = graphs_for(lin)
    xs = [torch.randn(2, 4) for _ in range(4)]
    with torch.no_grad():
        outs = [g((x,), {}, calls).clone() for x in xs]  # released at once: no hold
        expected = [lin(x) for x in xs]
    assert (g.captures, g.replays, calls.runs, len(cap.graphs)) == (1, 2, 2, 1)
    for got, want in zip(outs[:2], expected[:2], strict=True):
        torch.testing.assert_close(got, want)
    # The replays read the inputs of their own call, not the captured ones.
    torch.testing.assert_close(outs[3], expected[3])


def test_without_storage_use_counts_nothing_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    from surgery.runtime.graphs import outputs as graphs

    monkeypatch.setattr(graphs, "_use_count", None)
    lin = nn.Linear(4, 3)
    g, calls, _, _ = graphs_for(lin)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g((x,), {}, calls), lin(x))
    assert (g.captures, calls.runs) == (0, 4) and g.notes == [outputs.NO_USE_COUNT]


def test_capture_keeps_no_output_of_the_compiled_call_alive() -> None:
    """Only the layout of the compiled call's outputs is kept, not the tensors (memory)."""
    lin = nn.Linear(4, 3)
    made: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = lin(x)
        made.append(weakref.ref(out))
        return out

    g, calls, _, _ = graphs_for(lin, fn)
    with torch.no_grad():
        for _ in range(3):
            g((torch.randn(2, 4),), {}, calls)
    gc.collect()
    assert g.captures == 1 and g.replays == 1
    # The two uncaptured calls (the second one captured), and the capture's warm-up run: the
    # graph owns its own output buffers, so none of these is still alive.
    assert len(made) >= 3 and all(r() is None for r in made)


def test_a_path_dropped_without_restore_leaves_nothing_in_the_capturer() -> None:
    from surgery.runtime.graphs.capture import CudaCapturer

    assert isinstance(CudaCapturer(0).owned, weakref.WeakValueDictionary)
    lin = nn.Linear(4, 3)
    g, calls, _, cap = graphs_for(lin)
    with torch.no_grad():
        for _ in range(2):
            g((torch.randn(2, 4),), {}, calls)
    assert len(cap.owned) == 1
    del g, calls
    gc.collect()
    assert len(cap.owned) == 0


def test_grad_mode_never_captures() -> None:
    lin = nn.Linear(4, 3)
    g, calls, _, _ = graphs_for(lin)
    for _ in range(4):
        g((torch.randn(2, 4),), {}, calls)
    assert (g.captures, g.replays, calls.runs) == (0, 0, 4)


def test_a_new_signature_runs_compiled_then_gets_its_own_graph() -> None:
    lin = nn.Linear(4, 3)
    g, calls, _, _ = graphs_for(lin)
    with torch.no_grad():
        for _ in range(3):
            g((torch.randn(2, 4),), {}, calls)
        assert (g.captures, g.replays) == (1, 1)
        x = torch.randn(5, 4)  # another shape: not the captured graph
        torch.testing.assert_close(g((x,), {}, calls), lin(x))
        assert g.replays == 1
        g((torch.randn(5, 4),), {}, calls)
        assert g.captures == 2
        torch.testing.assert_close(g((x,), {}, calls), lin(x))
        assert g.replays == 2
        lin.eval()  # the training flag is part of the signature
        g((x,), {}, calls)
        assert g.replays == 2


def test_signatures_past_the_limit_run_compiled_and_are_noted() -> None:
    from surgery.runtime.graphs.replay import MAX_GRAPHS_PER_PATH

    lin = nn.Linear(4, 3)
    g, calls, _, _ = graphs_for(lin)
    with torch.no_grad():
        for rows in range(1, MAX_GRAPHS_PER_PATH + 3):
            for _ in range(3):
                x = torch.randn(rows, 4)
                torch.testing.assert_close(g((x,), {}, calls), lin(x))
    assert len(g.graphs) == MAX_GRAPHS_PER_PATH
    assert g.replays == MAX_GRAPHS_PER_PATH  # the third call of each captured shape
    assert sum("beyond the first" in n for n in g.notes) == 2


def test_scalar_arguments_are_part_of_the_signature() -> None:
    lin = nn.Linear(4, 4)
    g, calls, _, _ = graphs_for(lin, lambda x, scale: lin(x) * scale)
    x = torch.randn(2, 4)
    with torch.no_grad():
        g((x, 2.0), {}, calls)
        g((x, 2.0), {}, calls)
        torch.testing.assert_close(g((x, 3.0), {}, calls), lin(x) * 3.0)
        torch.testing.assert_close(g((x, 2.0), {}, calls), lin(x) * 2.0)
    assert g.replays == 1


def test_outputs_still_held_get_a_ring_of_output_sets() -> None:
    """A cache keeps each call's outputs for two more calls: replays rotate through three output
    sets, and nothing a caller holds is ever overwritten."""
    lin = nn.Linear(4, 3)
    g, calls, warned, cap = graphs_for(lin)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (output, its value when returned)
    checked = 0
    with torch.no_grad():
        for _ in range(10):
            out = g((torch.randn(2, 4),), {}, calls)
            kept.append((out, out.clone()))
            if len(kept) > 2:  # a sliding-window cache of two steps
                old, value = kept.pop(0)
                torch.testing.assert_close(old, value)  # fails if a replay overwrote it
                checked += 1
                del old
            del out  # nothing but the cache holds an output during the next call
    for out, value in kept:
        torch.testing.assert_close(out, value)
    assert checked == 8 and warned == [] and not g.clone
    assert g.output_sets == 3 and len(cap.graphs) == 3
    assert calls.runs == 2 and g.replays == 10 - 2 - 2  # two calls captured a new set
    assert any("ring of output buffers" in n for n in g.notes)


def test_past_the_ring_the_path_clones_and_says_so() -> None:
    from surgery.runtime.graphs.outputs import MAX_OUTPUT_SETS

    lin = nn.Linear(4, 3)
    g, calls, warned, _ = graphs_for(lin)
    kept = []
    with torch.no_grad():
        for _ in range(MAX_OUTPUT_SETS + 4):
            out = g((torch.randn(2, 4),), {}, calls)
            kept.append((out, out.clone()))  # kept forever
    for out, value in kept:
        torch.testing.assert_close(out, value)
    # past the ring it clones: one call without the graph, then one set captured again (never
    # held: it hands out clones) that replays; the ring's sets are forgotten
    assert g.clone and g.output_sets == MAX_OUTPUT_SETS
    assert calls.runs == 4 and g.replays == 1  # the 10th call, and the 11th before capture
    assert [len(c.sets) for c in g.graphs.values()] == [1]
    assert len(warned) == 1 and "still referenced" in warned[0]


def test_outputs_released_by_the_caller_replay_without_cloning() -> None:
    lin = nn.Linear(4, 3)
    g, calls, warned, _ = graphs_for(lin)
    with torch.no_grad():
        for _ in range(5):
            g((torch.randn(2, 4),), {}, calls).sum().item()
    assert (g.replays, g.clone, warned) == (3, False, [])


def test_views_of_a_held_output_count_as_held() -> None:
    lin = nn.Linear(4, 6)
    g, calls, _, _ = graphs_for(lin)
    with torch.no_grad():
        for _ in range(2):
            g((torch.randn(2, 4),), {}, calls)
        view = g((torch.randn(2, 4),), {}, calls)[:, :3]  # only a view survives
        value = view.clone()
        g((torch.randn(2, 4),), {}, calls)
    torch.testing.assert_close(view, value)


def test_moved_or_replaced_parameters_drop_the_graphs() -> None:
    lin = nn.Linear(4, 3)
    g, calls, _, _ = graphs_for(lin)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            g((x,), {}, calls)
        assert g.replays == 1
        lin.load_state_dict({"weight": torch.ones(3, 4), "bias": torch.zeros(3)})  # in place
        torch.testing.assert_close(g((x,), {}, calls), lin(x))
        assert g.replays == 2
        lin.weight = nn.Parameter(torch.full((3, 4), 2.0))  # a new tensor at a new address
        torch.testing.assert_close(g((x,), {}, calls), lin(x))
        assert g.replays == 2 and not g.graphs
        assert any("changed since capture" in n for n in g.notes)


def test_parameters_that_move_every_call_stop_the_captures_with_the_reason() -> None:
    """FSDP2's reshard/unshard, as the region sees it: before each call the same Parameter
    object gets its data in newly allocated memory. Each move drops the graphs (a replay would
    read the old address); after MAX_STATE_MOVES the path runs compiled, uncaptured, and says
    why; parameters that stay in place keep replaying."""
    from surgery.runtime.graphs.replay import MAX_STATE_MOVES, STATE_MOVES_REASON

    lin = nn.Linear(4, 3)
    g, calls, _, _ = graphs_for(lin)
    x = torch.randn(2, 4)
    keep = []  # old storages held, so the new ones cannot reuse their addresses
    with torch.no_grad():
        for i in range(4 * MAX_STATE_MOVES + 4):
            keep.append(lin.weight.data)
            lin.weight.data = torch.full((3, 4), float(i))  # "unshard": new memory, same object
            torch.testing.assert_close(g((x,), {}, calls), lin(x))
    assert g.disabled == STATE_MOVES_REASON and STATE_MOVES_REASON in g.notes
    assert g.captures == MAX_STATE_MOVES and g.replays == 0 and not g.graphs
    assert "reshard_after_forward=False" in STATE_MOVES_REASON
    # In place (reshard_after_forward=False): one capture, then replays.
    g2, calls2, _, _ = graphs_for(lin)
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(g2((x,), {}, calls2), lin(x))
    assert (g2.captures, g2.replays, g2.disabled) == (1, 4, "")


@pytest.mark.parametrize("change", ["dict-assignment", "data-assignment", "new-child",
                                    "none-to-tensor"])
def test_every_way_of_moving_a_tensor_drops_the_graphs(change: str) -> None:
    """module.to() with overwrite_module_params_on_conversion assigns into _parameters directly
    (no setattr); `.data =` keeps the object and moves the data; children can be replaced."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.ReLU())
    g, calls, _, _ = graphs_for(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            g((x,), {}, calls)
        assert g.replays == 1
        lin = model[0]
        if change == "dict-assignment":
            lin._parameters["weight"] = nn.Parameter(torch.ones(4, 4))
        elif change == "data-assignment":
            lin.weight.data = torch.ones(4, 4)
        elif change == "new-child":
            model._modules["0"] = nn.Linear(4, 4, bias=False)
        else:
            lin.bias = nn.Parameter(torch.ones(4))
        torch.testing.assert_close(g((x,), {}, calls), model(x))
    assert g.replays == 1 and not g.graphs


def test_an_input_written_in_place_is_written_back_after_replay() -> None:
    lin = nn.Linear(4, 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return lin(x)

    g, calls, _, _ = graphs_for(lin, step)
    with torch.no_grad():
        for _ in range(2):
            g((torch.zeros(2, 4),), {}, calls)
        x = torch.full((2, 4), 5.0)
        out = g((x,), {}, calls)
        torch.testing.assert_close(out, lin(torch.full((2, 4), 6.0)))
    assert g.replays == 1
    torch.testing.assert_close(x, torch.full((2, 4), 6.0))


def test_a_region_returning_its_input_is_not_captured() -> None:
    lin = nn.Linear(4, 4)
    g, calls, _, _ = graphs_for(lin, lambda x: x[:1])
    assert g.notes == []
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            assert g((x,), {}, calls).data_ptr() == x.data_ptr()
    assert g.captures == 0 and "view of an input" in g.disabled
    assert g.notes == [g.disabled]  # the record's notes, through apply_manifest


def test_a_failed_capture_runs_compiled_and_says_why() -> None:
    lin = nn.Linear(4, 3)
    g, calls, warned, _ = graphs_for(lin, fail=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        outs = [g((x,), {}, calls) for _ in range(4)]
    torch.testing.assert_close(outs[-1], lin(x))
    assert g.captures == 0 and calls.runs == 4
    assert len(warned) == 1 and "capture failed" in warned[0]


def test_nested_outputs_and_keyword_arguments() -> None:
    lin = nn.Linear(4, 4)

    def fn(x: torch.Tensor, *, extra: torch.Tensor) -> dict[str, Any]:
        return {"a": lin(x), "pair": (x + extra, 3)}

    g, calls, _, _ = graphs_for(lin, fn)
    with torch.no_grad():
        for _ in range(2):
            g((torch.randn(2, 4),), {"extra": torch.randn(2, 4)}, calls)
        x, e = torch.randn(2, 4), torch.randn(2, 4)
        out = g((x,), {"extra": e}, calls)
        assert g.replays == 1
        torch.testing.assert_close(out["a"], lin(x))
        torch.testing.assert_close(out["pair"][0], x + e)
        assert out["pair"][1] == 3


def test_an_input_that_is_another_regions_output_is_read_in_place() -> None:
    """A -> B: B's graph reads A's owned output where it is, with no copy per replay."""
    a_mod, b_mod = nn.Linear(4, 4), nn.Linear(4, 4)
    cap = FakeCapturer()
    a_calls, b_calls = Calls(a_mod), Calls(b_mod)
    a = RegionGraphs(a_mod, cap, a_calls.raw, clone_outputs=False, warn=print)
    b = RegionGraphs(b_mod, cap, b_calls.raw, clone_outputs=False, warn=print)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            got = b((a((x,), {}, a_calls),), {}, b_calls).clone()
            torch.testing.assert_close(got, b_mod(a_mod(x)))
        (cap_a,), (cap_b,) = a.graphs.values(), b.graphs.values()
        assert cap_a.copied == [0] and cap_b.copied == [] and len(cap_b.adopted) == 1
        assert b.replays == 2
        # Called with some other tensor, B cannot replay reading A's buffer: it runs compiled,
        # and captures again on the next call with that signature.
        y = torch.randn(2, 4)
        torch.testing.assert_close(b((y,), {}, b_calls), b_mod(y))
        assert b.replays == 2 and not b.graphs
        torch.testing.assert_close(b((y,), {}, b_calls), b_mod(y))
        torch.testing.assert_close(b((y,), {}, b_calls), b_mod(y))
        assert b.replays == 3 and next(iter(b.graphs.values())).copied == [0]


def test_an_input_the_region_writes_is_copied_not_read_in_place() -> None:
    a_mod = nn.Linear(4, 4)
    cap = FakeCapturer()
    a_calls = Calls(a_mod)

    def bump(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return x + 1.0

    b_calls = Calls(bump)
    a = RegionGraphs(a_mod, cap, a_calls.raw, clone_outputs=False, warn=print)
    b = RegionGraphs(nn.Identity(), cap, b_calls.raw, clone_outputs=False, warn=print)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            h = a((x,), {}, a_calls)
            want = a_mod(x) * 2.0
            got = b((h,), {}, b_calls)
            torch.testing.assert_close(got, want + 1.0)
            torch.testing.assert_close(h, want)  # written once, as eager would
            del h, got
    assert b.replays == 2 and next(iter(b.graphs.values())).adopted == []


# --- through apply_manifest --------------------------------------------------------------------

def tiny_manifest(model: nn.Module, **compile_: object) -> Manifest:
    n = 2
    regions = [
        Region("frame_block", [f"aggregator.frame_blocks.{i}" for i in range(n)]),
        Region("patch_embed_block", [f"aggregator.patch_embed.blocks.{i}" for i in range(n)]),
        Region("attn_pre", [f"aggregator.global_blocks.{i}.attn_pre" for i in range(n)],
               callable="method"),
        Region("ffn_residual", [f"aggregator.global_blocks.{i}.ffn_residual" for i in range(n)],
               callable="method"),
    ]
    compile_ = {**DEFAULT_COMPILE, "backend": "aot_eager", "capture": "region", **compile_}
    compile_.pop("mode", None)
    compile_.pop("emulate_precision_casts", None)
    return Manifest(compute_fingerprint(model.state_dict()), regions, compile=compile_)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCapturer:
    """apply_manifest on the CPU as if on CUDA, with the faithful fake graph."""
    cap = FakeCapturer()
    monkeypatch.setattr(apply_mod, "_on_cuda", lambda module, model: True)
    monkeypatch.setattr(apply_mod, "_capturer_for", lambda module: cap)
    return cap


@pytest.mark.parametrize("clone_attn_pre", [True, False])
def test_streaming_model_through_region_graphs_matches_eager(
        fake_cuda: FakeCapturer, clone_attn_pre: bool) -> None:
    """The KV cache keeps attn_pre's outputs. Cloned or not in the manifest, they survive.

    The other regions do not clone (as planned): their outputs are owned buffers, read in place
    by the region after them."""
    torch.manual_seed(0)
    eager, model = examples.tiny().eval(), examples.tiny().eval()
    model.load_state_dict(eager.state_dict())
    keys = list(model.state_dict())
    m = tiny_manifest(model, clone_outputs=False)
    m.regions[2].compile["clone_outputs"] = clone_attn_pre  # the plan's policy when True
    frames = [model.example_input(seed=s) for s in range(7)]
    with torch.no_grad():
        handle = apply_manifest(model, m, warmup=lambda mdl: mdl(frames[0]), passes=2)
        eager(frames[0]), eager(frames[0])  # the same stream position as the warm-up
        outs = [model(f) for f in frames]
        want = [eager(f) for f in frames]
    for got, exp in zip(outs, want, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-5)
    assert list(model.state_dict()) == keys
    frame = handle.report.by_path("aggregator.frame_blocks.0")
    assert frame.graphs_captured == 1 and frame.graph_replays == len(frames)
    assert frame.output_sets == 1
    assert frame.status == "compiled" and frame.compiled_calls == frame.calls
    pre = handle.report.by_path("aggregator.global_blocks.0.attn_pre")
    assert pre.clone_outputs is clone_attn_pre
    # Without the clone, the cache's window of 4 frames holds 4 output sets and the next call
    # writes a 5th; with it, one set does.
    assert pre.output_sets == (1 if clone_attn_pre else model.config.window + 1), \
        handle.report.summary()
    assert not any("still referenced" in n for n in pre.notes)
    assert "captured=1" in handle.report.summary()
    # frame_blocks.1 reads global_blocks.0's output, an owned buffer, in place: no input copy.
    slot = vars(model.aggregator.frame_blocks[1])["forward"].__surgery_slot__
    (captured,) = slot.graphs.graphs.values()
    assert captured.copied == [] and len(captured.adopted) == 1
    handle.restore()
    assert "forward" not in vars(model.aggregator.frame_blocks[0])


def test_warm_up_with_grad_enabled_is_noted(fake_cuda: FakeCapturer) -> None:
    model = examples.tiny().eval()
    x = model.example_input()
    handle = apply_manifest(model, tiny_manifest(model), warmup=lambda m: m(x), passes=2)
    assert all(r.graphs_captured == 0 for r in handle.report)
    assert any("captured no CUDA graph in warm-up" in n for n in handle.report.notes)
    with torch.no_grad():  # the first inference calls capture
        model(x), model(x)
    assert all(r.graphs_captured == 1 for r in handle.report)
    handle.restore()


def test_capture_region_without_cuda_follows_on_cpu() -> None:
    model = examples.tiny().eval()
    handle = apply_manifest(model, tiny_manifest(model))
    assert {r.status for r in handle.report} == {"eager"}
    assert "(capture='region') without CUDA: runs eager" in handle.report[0].reason
    handle.restore()
    handle = apply_manifest(model, tiny_manifest(model, on_cpu="compile"),
                            warmup=lambda mdl: mdl(mdl.example_input()), passes=1)
    assert {r.status for r in handle.report} == {"compiled"}
    assert all(r.graphs_captured == 0 for r in handle.report)
    handle.restore()


def test_switching_a_region_plan_to_the_compilers_graphs_warns_about_clones(
        fake_cuda: FakeCapturer) -> None:
    """A plan for capture='region' clones nothing; trees would overwrite the KV cache."""
    from surgery.planning.plan import plan_model

    model = examples.tiny().eval()
    manifest = plan_model("surgery.examples:tiny").manifest
    with pytest.warns(SurgeryWarning, match="overwritten by the next replay") as got:
        handle = apply_manifest(model, manifest, overrides={"mode": "reduce-overhead"})
    assert sum("region path(s)" in str(w.message) for w in got) == 1
    assert all(any("Re-plan with --capture compiler" in n for n in r.notes) for r in handle.report)
    handle.restore()
    # As planned, or switched with the clones set: no such warning.
    for overrides in (None, {"mode": "reduce-overhead", "clone_outputs": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("error", SurgeryWarning)
            apply_manifest(model, manifest, overrides=overrides).restore()


def test_compile_plan_for_capture_region() -> None:
    from surgery.errors import RegionError
    from surgery.runtime.compile_options import plan_region

    model = examples.tiny()
    # mode and capture at the same level: surgery captures, inductor's trees are turned off.
    m = tiny_manifest(model, backend="inductor", mode="reduce-overhead")
    m.compile["mode"] = "reduce-overhead"  # tiny_manifest drops it
    plan = plan_region(m, m.regions[0], overrides=None, on_cuda=True)
    assert plan.capture_region and plan.cuda_graphs
    assert plan.config_patches is not None and plan.config_patches["triton.cudagraphs"] is False
    assert any("cudagraph trees are off" in n for n in plan.notes)
    # An override asking for the compiler's graphs wins over the manifest's capture.
    plan = plan_region(m, m.regions[0], overrides={"mode": "reduce-overhead"}, on_cuda=True)
    assert not plan.capture_region and plan.cuda_graphs
    assert plan.config_patches is not None and plan.config_patches["triton.cudagraphs"] is True
    assert any("capture='region' dropped" in n for n in plan.notes)
    m.compile.pop("mode")
    assert not plan_region(m, m.regions[0], overrides={"capture": "compiler"},
                           on_cuda=True).capture_region
    m.compile["backend"] = "cudagraphs"  # at the same level as capture='region'
    with pytest.raises(RegionError, match="captures its own CUDA graphs"):
        plan_region(m, m.regions[0], overrides=None, on_cuda=True)
    m.compile["backend"] = "inductor"
    with pytest.raises(RegionError, match="not one of"):
        plan_region(m, m.regions[0], overrides={"capture": "trees"}, on_cuda=True)


# --- inference_mode, any number of inputs, autocast (issue 11 C) --------------------------------

class _Mix(nn.Module):
    """A region taking ``n`` tensor inputs (and a scalar), so zero, one and many are covered."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *xs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        acc = self.lin.weight.sum() * scale
        for x in xs:
            acc = acc + self.lin(x)
        return acc * 1.0


@pytest.mark.parametrize("n_inputs", [0, 1, 3])
def test_inference_mode_captures_and_replays_with_any_number_of_inputs(n_inputs: int) -> None:
    """Under inference_mode every input is an inference tensor, which has no version counter."""
    mod = _Mix()
    g, calls, _, _ = graphs_for(mod)
    with torch.inference_mode():
        for step in range(5):
            xs = [torch.randn(2, 4) + step for _ in range(n_inputs)]
            assert all(x.is_inference() for x in xs)
            got = g(tuple(xs), {"scale": 2.0}, calls).clone()
            torch.testing.assert_close(got, mod(*xs, scale=2.0))
    assert (g.captures, g.replays, calls.runs) == (1, 3, 2), g.notes
    assert not g.disabled


def test_inference_mode_an_input_written_in_place_is_written_back() -> None:
    lin = nn.Linear(4, 4)

    def step(x: torch.Tensor, cache: torch.Tensor, pos: int) -> torch.Tensor:
        cache[pos].copy_(x[0])  # a KV cache filled at a position
        return lin(cache)

    g, calls, _, _ = graphs_for(lin, step)
    with torch.inference_mode():
        for _ in range(2):  # warm-up: a fresh (zero) cache each pass
            g((torch.randn(2, 4), torch.zeros(3, 4), 1), {}, calls)
        x, cache = torch.randn(2, 4), torch.zeros(3, 4)
        out = g((x, cache, 1), {}, calls)
        want = torch.zeros(3, 4)
        want[1] = x[0]
        torch.testing.assert_close(cache, want)  # written back to the caller's tensor
        torch.testing.assert_close(out, lin(want))
    assert g.replays == 1
    (captured,) = g.graphs.values()
    assert captured.written == [1]


def test_write_probe_is_exact_for_normal_tensors_and_sees_changed_bytes_of_inference_ones() -> None:
    from surgery.runtime.graphs.capture import WriteProbe

    a, b = torch.zeros(3), torch.zeros(3)
    probe = WriteProbe([a, b])
    b.mul_(1.0)  # same bytes, but a write: the version counter sees it
    assert probe.written([a, b]) == {1}
    with torch.inference_mode():
        c, d, e = torch.zeros(3), torch.full((3,), float("nan")), torch.zeros(2, 3)[:, 1]
        probe = WriteProbe([c, d, e])
        c[0] = 5.0
        assert probe.written([c, d, e]) == {0}  # NaN compares by bytes: not "written"


def test_autocast_switched_on_and_off_in_one_step_gets_a_graph_each() -> None:
    """A head that turns autocast off inside an autocast step: two signatures, two graphs, and
    each replay gives the dtype its own autocast state gives."""
    lin = nn.Linear(4, 4)
    g, calls, _, _ = graphs_for(lin)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(2, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                on = g((x,), {}, calls)
                with torch.autocast("cpu", enabled=False):
                    off = g((x,), {}, calls)
            assert on.dtype == torch.bfloat16 and off.dtype == torch.float32
            torch.testing.assert_close(off, lin(x))
            torch.testing.assert_close(on, lin(x), atol=0.05, rtol=0.05, check_dtype=False)
            del on, off  # released, so each replay reuses its one output set
    assert g.captures == 2 and g.replays == 4


def test_readme_deployment_snippet_runs_under_inference_mode(fake_cuda: FakeCapturer) -> None:
    """The README's deployment snippet, as written, with the faithful fake graph."""
    torch.manual_seed(0)
    eager, model = examples.tiny().eval(), examples.tiny().eval()
    model.load_state_dict(eager.state_dict())
    example = model.example_input()
    m = tiny_manifest(model)
    with torch.inference_mode():    # warm up as you infer: region graphs are captured in warm-up
        handle = apply_manifest(model, m, warmup=lambda m: m(example))
    assert all(r.graphs_captured >= 1 for r in handle.report), handle.report.summary()
    frames = [model.example_input(seed=s) for s in range(4)]
    with torch.inference_mode():
        for _ in range(handle.report.warmup_passes):
            eager(example)  # the same stream position as the warm-up
        want = [eager(f).clone() for f in frames]
    with handle, torch.inference_mode():                    # restores on exit
        outs = [model(f).clone() for f in frames]
    for got, exp in zip(outs, want, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-5)
    assert all(r.graph_replays >= len(frames) for r in handle.report), handle.report.summary()
