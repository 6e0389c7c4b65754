"""surgery.runtime.compile_start: a piecewise stack's once-a-step pieces compile light under region
capture (the repeated middle piece keeps inductor), and a cold start on CUDA starts inductor's
compile workers before the warm-up's first trace."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import fx, nn

import surgery.runtime.compile_start as compile_start
import surgery.runtime.piece_cache as piece_cache
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.planning.plan import plan_module
from surgery.runtime.apply import apply_manifest
from surgery.runtime.compile_options import plan_region
from surgery.runtime.compile_start import (
    LIGHT_PIECE_ELEMENTS,
    LIGHT_PIECE_SHARE,
    POOL_NOTE,
    launch_bound,
    light_allowed,
    light_pieces,
    pool_wanted,
)
from surgery.runtime.piecewise import PiecewiseGroup, install_piecewise
from surgery.runtime.report import RegionRecord
from tests.test_graphs import (
    FakeCapturer,
    fake_cuda,  # noqa: F401 (a fixture: the stand-in capturer)
)
from tests.test_piecewise_stack import generate, same_as_eager, stack_plan, tiny_gpt2

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# GPT-2's stack of 12 blocks as the split gives it (transformers 5.24): the piece before the first
# attention (8 ops that do work), the piece between two blocks (19, eleven times: one code), the
# piece after the last (17): 3% and 7% of the pieces' ops.
GPT2_SMALL = [("first", 8), *[("middle", 19)] * 11, ("last", 17)]


@pytest.mark.parametrize(("pieces", "want"), [
    pytest.param(GPT2_SMALL, [True, *[False] * 11, True], id="gpt2-small-stack"),
    pytest.param([("first", 8), ("middle", 19), ("last", 17)], [False] * 3,
                 id="two-blocks: each a large share"),
    pytest.param([("before", 30), ("after", 35)], [False, False], id="one-block-graph"),
    pytest.param([("a", 1), ("b", 40)], [True, False], id="a-one-op-piece"),
    pytest.param([(None, 5), (None, 5), ("m", 50)], [True, True, False],
                 id="unshareable pieces count alone"),
    pytest.param([("v", 0), ("w", 0)], [False, False], id="no work at all"),
])
def test_light_pieces_are_those_with_a_small_share_of_the_graphs_work(
        pieces: list[tuple[str | None, int]], want: list[bool]) -> None:
    assert light_pieces(pieces) == want


def test_light_pieces_need_inductor_and_region_capture() -> None:
    assert light_allowed("inductor", True)
    assert not light_allowed("inductor", False)  # no graph: aot_eager would launch op by op
    assert not light_allowed("aot_eager", True)  # nothing to save


def test_a_light_piece_is_never_handed_to_a_full_compile_of_the_same_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same code light in one graph and full in another (an ordinary region built from the
    pieces, surgery.runtime.shared_pieces): the full piece never takes the light compile, and a
    light piece takes the full compile once there is one (on the H200 the SDPA example's global
    block compiled a light piece of its own where the frame block's full one was there)."""
    light: list[int] = []
    monkeypatch.setattr(piece_cache, "compile_light", lambda gm, args: light.append(1) or gm)
    cache = piece_cache.PieceCache(lambda gm, args: gm)
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    x = torch.randn(2, 4)
    a, _, fresh_a = cache.get(gm, [x], [], light=True)
    b, _, fresh_b = cache.get(gm, [x], [], light=False)
    c, _, fresh_c = cache.get(gm, [x], [], light=True)
    assert fresh_a and fresh_b and not fresh_c and a is not b and c is b
    assert cache.compiles == 2 and cache.light == 1 and light == [1]
    first_full = piece_cache.PieceCache(lambda gm, args: gm)
    full, _, _ = first_full.get(gm, [x], [], light=False)
    shared, _, fresh = first_full.get(gm, [x], [], light=True)
    assert shared is full and not fresh and first_full.compiles == 1 and first_full.light == 0


def _counting(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Count the pieces compiled through the plan's backend (stood in by aot_eager: the CPU's
    C++ builds would take minutes) and those compiled light; (full, light) op counts."""
    full: list[int] = []
    light: list[int] = []
    aot = torch._dynamo.lookup_backend("aot_eager")

    def plan_backend(self: PiecewiseGroup, gm: fx.GraphModule, example: list[Any]) -> Any:
        full.append(len(gm.graph.nodes))
        fn = aot(gm, example)

        def run(*args: Any) -> Any:  # fresh buffers, as inductor returns (not eager's views)
            return [o.clone(memory_format=torch.contiguous_format)
                    if isinstance(o, torch.Tensor) else o for o in fn(*args)]

        return run

    real_light = piece_cache.compile_light

    def counted_light(gm: fx.GraphModule, example: list[Any]) -> Any:
        light.append(len(gm.graph.nodes))
        return real_light(gm, example)

    monkeypatch.setattr(PiecewiseGroup, "_compile_piece", plan_backend)
    monkeypatch.setattr(piece_cache, "compile_light", counted_light)
    return full, light


def _install_stack(layers: int, capturer: Any) -> tuple[nn.Module, nn.Module, RegionRecord]:
    model = tiny_gpt2(layers)
    ref = copy.deepcopy(model)
    m = plan_module(model, source="test", piecewise=True).manifest
    (region,) = [r for r in m.regions if r.paths == ["transformer"]]
    m.compile.update({"backend": "inductor", "on_cpu": "compile"})
    plan = plan_region(m, region, overrides=None, on_cuda=False)
    assert plan.backend == "inductor"
    rec = RegionRecord("transformer", "piecewise", "forward", "pending")
    install_piecewise(model.transformer, "forward", rec, region, plan, {}, capturer)
    return model, ref, rec


def test_a_stack_compiles_its_first_and_last_piece_light_and_tokens_stay_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 (3 blocks) under a stand-in capturer: the middle piece (twice a step) compiles with
    the plan's backend, the first and the last light; tokens and cache as eager's, bit for bit,
    over 3 generate() calls, with one dynamo graph. The middle piece stays ONE compile although
    the first block's gets its attention output from a light piece's views and the second's
    from the plan backend's fresh buffers: layouts that differ only in the strides of size-1
    dims (piece_cache)."""
    # 3 blocks, not 12: the first piece is 13% of the pieces' ops, the last 27%
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_SHARE", 0.3)
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_ELEMENTS", 0)  # the share rule alone
    full, light = _counting(monkeypatch)
    model, ref, rec = _install_stack(3, FakeCapturer())
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = generate(ref, ids, 12)
        for _ in range(3):
            same_as_eager(generate(model, ids, 12), want)
    assert len(full) == 1 and len(light) == 2, (full, light)
    assert min(light) < full[0]  # the two light pieces are the small ones
    assert rec.pieces_compiled == 3 and rec.pieces_light == 2 and rec.pieces_shared >= 1
    assert rec.compiles == 1 and rec.recompiles == 0 and rec.status == "compiled"


def test_without_region_capture_every_piece_keeps_the_plans_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_SHARE", 0.3)  # and the size rule on: tiny
    full, light = _counting(monkeypatch)
    model, ref, rec = _install_stack(3, None)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        same_as_eager(generate(model, ids, 6), generate(ref, ids, 6))
    assert len(full) == 3 and light == [] and rec.pieces_light == 0


def test_default_share_leaves_a_short_stack_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the default share (``LIGHT_PIECE_SHARE``), 3 blocks are too few for any light piece:
    only a long stack's once-a-step pieces fall under it (GPT-2 small: 3% and 7%)."""
    assert pytest.approx(0.1) == LIGHT_PIECE_SHARE
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_ELEMENTS", 0)  # the share rule alone
    full, light = _counting(monkeypatch)
    model, ref, rec = _install_stack(3, FakeCapturer())
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        same_as_eager(generate(model, ids, 6), generate(ref, ids, 6))
    assert len(full) == 3 and light == [] and rec.pieces_compiled == 3


def test_a_launch_bound_stack_builds_no_plan_backend_piece(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny GPT-2's decode (every activation at most 128 elements, under LIGHT_PIECE_ELEMENTS)
    under a stand-in capturer: every piece compiles light, none with the plan's backend, the
    report says why, and tokens and cache are eager's, bit for bit, with one dynamo graph."""
    assert LIGHT_PIECE_ELEMENTS == 1 << 16
    full, light = _counting(monkeypatch)
    model, ref, rec = _install_stack(3, FakeCapturer())
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = generate(ref, ids, 12)
        for _ in range(2):
            same_as_eager(generate(model, ids, 12), want)
    assert full == [] and len(light) == 3, (full, light)  # first, middle (shared), last
    assert rec.pieces_compiled == 3 and rec.pieces_light == 3 and rec.pieces_shared >= 1
    assert rec.compiles == 1 and rec.recompiles == 0 and rec.status == "compiled"
    assert any("launch-bound" in n and f"{rec.pieces} of {rec.pieces}" in n for n in rec.notes)


@pytest.mark.usefixtures("fake_cuda")
def test_the_planned_stack_applied_as_on_cuda_builds_no_inductor_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda test's flow on the CPU (`plan_model(..., piecewise=True)`, `apply_manifest` with
    its defaults, CUDA's condition and capture stood in): the plan says inductor, every piece
    compiles light, none builds inductor code, the pieces replay from the second token, and the
    tokens are eager's, bit for bit."""
    built: list[int] = []
    real = PiecewiseGroup._compile_piece
    monkeypatch.setattr(PiecewiseGroup, "_compile_piece",
                        lambda self, gm, ex: built.append(1) or real(self, gm, ex))
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    handle = apply_manifest(model, stack_plan())
    stack = handle.report.by_path("transformer")
    assert stack.backend == "inductor"
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same_as_eager(generate(model, ids, 16), generate(ref, ids, 16))
    assert stack.status == "compiled" and stack.compiles == 1, stack.reason
    assert stack.pieces_compiled == 3 and stack.pieces_light == 3, stack.notes
    assert built == []  # nothing went to the plan's backend (inductor)
    # 15 decode steps: the first compiles, the second captures, 13 replay 3 pieces each
    assert stack.cuda_graph_replays >= 3 * 13 and stack.graphs_captured >= 3
    handle.restore()


def test_a_piece_over_the_size_keeps_the_plans_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bound between tiny GPT-2's widths (qkv 96 elements, MLP 128) and the share rule
    off: the first piece (embeddings, ln_1, qkv) is light, the two holding an MLP are not."""
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_ELEMENTS", 100)
    monkeypatch.setattr(compile_start, "LIGHT_PIECE_SHARE", 0.0)
    full, light = _counting(monkeypatch)
    model, ref, rec = _install_stack(3, FakeCapturer())
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        same_as_eager(generate(model, ids, 8), generate(ref, ids, 8))
    assert len(full) == 2 and len(light) == 1, (full, light)
    assert rec.pieces_light == 1 and any("1 of" in n and "launch-bound" in n for n in rec.notes)


@pytest.mark.parametrize(("largest", "want"), [
    pytest.param([768, 3072, 3072], [True] * 3, id="gpt2-small-decode-batch-1"),
    pytest.param([32 * 768, 32 * 3072], [True, False], id="a batch of 32: the MLP is not"),
    pytest.param([1 << 16, (1 << 16) + 1], [True, False], id="the bound is inclusive"),
    pytest.param([None, 0], [False, True], id="unknown is never small"),
])
def test_launch_bound(largest: list[int | None], want: list[bool]) -> None:
    assert launch_bound(largest) == want
    # the size rule makes a piece light whatever its share
    assert light_pieces([(str(i), 50) for i in range(len(largest))], largest) == want


# --- inductor's compile workers -------------------------------------------------------------


@pytest.mark.parametrize(("backends", "device", "loaded", "want"), [
    pytest.param(["inductor"], "cuda:0", False, True, id="inductor-on-cuda"),
    pytest.param(["aot_eager", "inductor"], "cuda", False, True, id="one-inductor-region"),
    pytest.param(["inductor"], "cpu", False, False, id="cpu: C++ kernels, no worker pool"),
    pytest.param(["aot_eager", None], "cuda", False, False, id="no-inductor"),
    pytest.param(["inductor"], "cuda", True, False, id="a bundle: kernels load"),
    pytest.param([], "cuda", False, False, id="nothing-to-compile"),
])
def test_pool_wanted(backends: list[str | None], device: str, loaded: bool, want: bool) -> None:
    assert pool_wanted(backends, device, loaded) is want


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _net_manifest(net: nn.Module, backend: str) -> Manifest:
    return Manifest(compute_fingerprint(net.state_dict()), [Region("r", ["block"])],
                    compile={**DEFAULT_COMPILE, "backend": backend, "on_cpu": "compile"})


def test_apply_starts_the_pool_before_the_first_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a region to compile where the pool is wanted, the pool starts once, before warm-up
    traced anything, and the report says so (CUDA's condition stood in: this CPU has none)."""
    from torch._dynamo.utils import counters

    started: list[int] = []
    seen: list[tuple[list[str | None], str, bool]] = []

    def wanted(backends: list[str | None], device: str, loaded: bool) -> bool:
        seen.append((list(backends), device, loaded))
        return True

    def warm() -> bool:
        started.append(counters["stats"]["unique_graphs"])
        return True

    monkeypatch.setattr(compile_start, "pool_wanted", wanted)
    monkeypatch.setattr(compile_start, "_warm_pool", warm)
    net = _Net()
    handle = apply_manifest(net, _net_manifest(net, "aot_eager"), warmup=lambda m: m(
        torch.randn(2, 8)), passes=2)
    assert len(started) == 1  # once, and before the warm-up compiled its graph
    assert counters["stats"]["unique_graphs"] == started[0] + 1
    assert seen == [(["aot_eager"], "cpu", False)]
    assert POOL_NOTE in handle.report.notes
    handle.restore()


def test_apply_on_the_cpu_starts_no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """An inductor region on the CPU: asked (the warm-up ran), not wanted, nothing started."""
    started: list[bool] = []
    asked: list[bool] = []
    real = compile_start.pool_wanted
    monkeypatch.setattr(compile_start, "_warm_pool", lambda: started.append(True) or True)
    monkeypatch.setattr(compile_start, "pool_wanted",
                        lambda *a: asked.append(real(*a)) or asked[-1])
    net = _Net()
    # the warm-up calls nothing: the decision comes before it, and no C++ build runs here
    handle = apply_manifest(net, _net_manifest(net, "inductor"), warmup=lambda m: None,
                            passes=1)
    assert handle.report.records[0].backend == "inductor"  # wanted on CUDA, not here
    assert asked == [False] and started == [] and POOL_NOTE not in handle.report.notes
    handle.restore()


def test_a_piecewise_region_starts_no_pool_at_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPT-2 stack (piecewise regions only, inductor, CUDA's condition stood in): the pool is
    not started at apply, since its pieces' sizes decide after the trace whether inductor builds
    anything; a plain inductor region beside it would start it."""
    started: list[bool] = []
    asked: list[list[str | None]] = []
    monkeypatch.setattr(compile_start, "_warm_pool", lambda: started.append(True) or True)
    monkeypatch.setattr(compile_start, "pool_wanted",
                        lambda b, d, loaded: asked.append(list(b)) or bool(asked[-1]))
    model = tiny_gpt2(2)
    m = plan_module(model, source="test", piecewise=True).manifest
    m.compile.update({"backend": "inductor", "on_cpu": "compile"})
    assert {r.kind for r in m.regions} == {"piecewise"}
    handle = apply_manifest(model, m, warmup=lambda _: None, passes=1)
    assert asked == [[]] and started == [] and POOL_NOTE not in handle.report.notes
    handle.restore()
    net = _Net()
    handle = apply_manifest(net, _net_manifest(net, "inductor"), warmup=lambda _: None, passes=1)
    assert asked[-1] == ["inductor"] and started == [True]
    handle.restore()


@pytest.mark.cuda
def test_cuda_cold_apply_has_the_pool_started_at_the_first_warm_up_call() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._inductor import async_compile

    if async_compile.get_compile_threads() <= 1 or not hasattr(async_compile, "_pool_set"):
        pytest.skip("this torch or host compiles in-process (compile_threads 1)")
    net = _Net().cuda()
    pools: list[int] = []

    def warm(m: nn.Module) -> None:
        if not pools:  # the first call: nothing has compiled yet
            pools.append(len(async_compile._pool_set))
        with torch.no_grad():
            m(torch.randn(2, 8, device="cuda"))

    handle = apply_manifest(net, _net_manifest(net, "inductor"), warmup=warm, passes=2)
    assert pools and pools[0] >= 1
    assert POOL_NOTE in handle.report.notes
    assert handle.report.records[0].status == "compiled"
    handle.restore()
