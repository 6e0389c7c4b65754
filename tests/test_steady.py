"""Steady replay plans (surgery.runtime.graphs.steady): a plan replays only the signature it was
made on, from the graph it was made on, and keeps every check of RegionGraphs' replay (checked on
the CPU with tests/test_graphs.py's graph, whose replay runs the captured work again)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from surgery.runtime.graphs import steady
from surgery.runtime.graphs.replay import RegionGraphs
from surgery.runtime.graphs.steady import SteadyReplay, steady_plan
from tests.test_graphs import Calls, FakeCapturer, graphs_for

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y


def _planned(fn: Any = _fn, module: nn.Module | None = None
             ) -> tuple[RegionGraphs, Calls, SteadyReplay, tuple[torch.Tensor, ...]]:
    """A path over ``fn(x, y)`` captured and replayed once, and its plan."""
    g, calls, _, _ = graphs_for(module or nn.Module(), fn)
    args = (torch.randn(2, 3), torch.randn(2, 3))
    with torch.no_grad():
        for _ in range(3):  # compiles, captures, replays
            g(args, {}, calls)
        plan = steady_plan(g, args)
    assert plan is not None and g.replays == 1
    return g, calls, plan, args



def plan_hits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[replays a plan served, calls it passed to the full path], counted from now on."""
    hits = [0, 0]
    inner = SteadyReplay.__call__

    def counted(self: SteadyReplay, args: tuple[Any, ...]) -> Any:
        out = inner(self, args)
        hits[out is None] += 1
        return out

    monkeypatch.setattr(SteadyReplay, "__call__", counted)
    return hits

def test_a_plan_replays_its_own_signature_with_the_calls_inputs() -> None:
    g, calls, plan, _ = _planned()
    with torch.no_grad():
        for _ in range(3):
            x, y = torch.randn(2, 3), torch.randn(2, 3)
            got = plan((x, y))
            assert got is not None
            torch.testing.assert_close(got, x * 2 + y)  # this call's inputs, not the captured
            del got  # released: the next replay may reuse the set
    assert g.replays == 4 and calls.runs == 2  # three by plan, no compiled run


@pytest.mark.parametrize("change", [
    pytest.param(lambda x, y: (torch.randn(3, 3), y), id="shape"),
    pytest.param(lambda x, y: (torch.randn(3, 2).t(), y), id="strides"),
    pytest.param(lambda x, y: (x, y.double()), id="dtype"),
    pytest.param(lambda x, y: (nn.Parameter(x, requires_grad=False), y), id="subclass"),
    pytest.param(lambda x, y: (x, y.to_sparse()), id="sparse"),
    pytest.param(lambda x, y: (x,), id="arity"),
])
def test_a_plan_refuses_any_other_signature(change: Any) -> None:
    """What RegionGraphs' signature holds (and more: the exact type) sends the call to the full
    path: a plan never replays a graph on inputs laid out otherwise."""
    g, _, plan, args = _planned()
    with torch.no_grad():
        assert plan(change(*args)) is None
    assert g.replays == 1


def test_a_plan_refuses_grad_inference_mode_autocast_and_training() -> None:
    g, _, plan, args = _planned()
    assert plan(args) is None  # grad enabled: the full path runs compiled, uncaptured
    with torch.inference_mode():
        assert plan(args) is None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert plan(args) is None
    with torch.no_grad():
        g.module.train(False)
        assert plan(args) is None  # the captured signature's training flag was True
        g.module.train(True)
        assert plan(args) is not None
    assert g.replays == 2


def test_a_plan_is_stale_once_its_graphs_are_forgotten_or_the_path_disabled() -> None:
    g, calls, plan, args = _planned()
    with torch.no_grad():
        g.drop("test")
        assert plan(args) is None
        for _ in range(2):
            g(args, {}, calls)  # seen once more, then captured again (a new epoch)
        assert plan(args) is None  # still the old graph's plan
        fresh = steady_plan(g, args)
        assert fresh is not None and fresh(args) is not None
        g.disabled = "test"
        assert fresh(args) is None


def test_a_plan_never_overwrites_an_output_still_held() -> None:
    """A replay's output that the caller keeps (a KV cache's k and v) is never overwritten: the
    plan hands the call to the full path, which grows the ring."""
    g, calls, plan, args = _planned()
    with torch.no_grad():
        kept = plan(args)
        assert kept is not None
        want = kept.clone()
        assert plan((torch.randn(2, 3), torch.randn(2, 3))) is None  # its one set is held
        g((torch.randn(2, 3), torch.randn(2, 3)), {}, calls)  # the full path: a second set
        torch.testing.assert_close(kept, want)


def test_a_plan_checks_the_modules_weights_where_they_are() -> None:
    """A module with weights (watched by RegionGraphs): a weight moved in place after the plan
    was made sends the call to the full path, which drops the graphs."""
    lin = nn.Linear(3, 3)
    g, calls, plan, args = _planned(lambda x, y: lin(x) + y, lin)
    with torch.no_grad():
        assert plan(args) is not None
        lin.weight.data = lin.weight.data * 2
        assert plan(args) is None
        got = g(args, {}, calls)
        torch.testing.assert_close(got, lin(args[0]) + args[1])
    assert g.state_moves == 1


def test_a_copied_input_that_became_an_owned_output_is_read_in_place_after_one_recapture(
) -> None:
    """A path that captured while its input was a plain tensor copies it every replay. Once the
    input comes from another region's owned outputs, making its plan forgets the signature once;
    it captures again reading the input in place, and never forgets it a second time."""
    cap = FakeCapturer()
    first_calls, second_calls = Calls(lambda x: x + 1), Calls(lambda h, y: h * y)
    first = RegionGraphs(nn.Module(), cap, first_calls.raw, clone_outputs=False, warn=print)
    second = RegionGraphs(nn.Module(), cap, second_calls.raw, clone_outputs=False, warn=print)
    x, y = torch.randn(4), torch.randn(4)

    def first_out() -> torch.Tensor:  # the first path's output (uncaptured until it captures)
        return first((x,), {}, first_calls)

    with torch.no_grad():
        h = first_calls.fn(x)  # the second path captures while the first has not
        for _ in range(2):
            second((h, y), {}, second_calls)
        del h
        (old,) = second.graphs.values()
        assert old.copied == [0, 1] and not old.adopted
        for _ in range(3):  # the first path captures; its outputs are owned from now on
            second((first_out(), y), {}, second_calls)
        assert first.graphs and second.replays >= 1
        assert steady_plan(second, (first_out(), y)) is None and not second.graphs  # forgot
        for _ in range(2):
            torch.testing.assert_close(second((first_out(), y), {}, second_calls), (x + 1) * y)
        (new,) = second.graphs.values()
        assert new.copied == [1] and [i for i, _ in new.adopted] == [0]
        h = first_out()
        plan = steady_plan(second, (h, y))
        assert plan is not None  # never forgotten twice
        torch.testing.assert_close(plan((h, y)), (x + 1) * y)
        # an input it reads in place that is now another tensor: never replayed from the old
        other = torch.randn(4)
        assert plan((other, y)) is None
        torch.testing.assert_close(second((other, y), {}, second_calls), other * y)


def test_plans_stop_after_max_plans_for_signatures_taking_turns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steady, "MAX_PLANS", 2)
    g, _, _, args = _planned()
    with torch.no_grad():
        assert steady_plan(g, args) is not None
        assert steady_plan(g, args) is None


def test_gpt2_decode_replays_its_pieces_by_plan_and_makes_eagers_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers GPT-2 through generate() with the piecewise stack: in a steady decode every
    piece replays by its plan; a switch to no_grad at another batch size (other signatures)
    takes the full path and plans again; every token and the cache are eager's,
    and the cache's k and v held across tokens are never overwritten (same_as_eager compares
    the whole cache)."""
    from tests.test_piecewise_stack import generate, installed_stack, same_as_eager

    pytest.importorskip("transformers")
    hits = plan_hits(monkeypatch)
    model, ref, slot, rec = installed_stack()
    gen = torch.Generator().manual_seed(5)
    for mode, batch in ((torch.inference_mode, 1), (torch.no_grad, 2)):
        ids = torch.randint(0, 100, (batch, 5), generator=gen)
        with mode():
            for _ in range(3):  # compile or capture, then replay
                same_as_eager(generate(model, ids, 8), generate(ref, ids, 8))
            hits[:] = [0, 0]
            pieces = sum(p.work for p in slot.group.graphs[-1].static)
            same_as_eager(generate(model, ids, 8), generate(ref, ids, 8))
        assert hits == [7 * pieces, 0], (mode, batch, hits, rec.notes)  # 7 decode steps


@pytest.mark.cuda
def test_cuda_gpt2_decode_replays_by_plan_with_real_graphs_and_makes_eagers_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (real region graphs, the apply's own capturer): a steady decode replays every
    piece by its plan, and the tokens and the whole cache (the held k and v) are eager's."""
    import copy
    import warnings

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the GPU machine")
    from surgery.runtime.apply import apply_manifest
    from tests.test_piecewise_stack import generate, same_as_eager, stack_plan, tiny_gpt2

    hits = plan_hits(monkeypatch)
    model = tiny_gpt2().cuda()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan(), overrides={"backend": "aot_eager"})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    stack = handle.report.by_path("transformer")
    with torch.no_grad():
        for _ in range(2):
            same_as_eager(generate(model, ids), generate(ref, ids), exact=False)
        hits[:] = [0, 0]
        replays = stack.cuda_graph_replays
        same_as_eager(generate(model, ids), generate(ref, ids), exact=False)
    assert stack.cuda_graph_replays > replays, stack.notes
    assert hits[0] == stack.cuda_graph_replays - replays and hits[1] == 0, (hits, stack.notes)
