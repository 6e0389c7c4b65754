"""The stream route (surgery.runtime.stream_route): a model called on the default stream runs,
whole, on surgery's side stream, ordered both ways, so that its eager parts and its region graphs
use one cuBLAS workspace.

On the CPU, test_capture's ``FakeCuda`` stands in for torch.cuda's streams (plus events and
``set_stream`` here); every model call logs the stream it ran on. The `cuda` tests drive
transformers GPT-2's ``generate()`` on the default stream on a GPU.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch
from torch import nn

from surgery.errors import SurgeryError
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime import apply as apply_mod
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs.capture import CudaCapturer
from surgery.runtime.report import GraphMemory
from surgery.runtime.stream_route import ROUTE_ATTR, ROUTE_NOTE, install_route
from tests.test_capture import WORKSPACE, FakeCuda, FakeStream, capturer, gpt2_decode_on_cuda
from tests.test_graphs import FakeCapturer

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

def manifest_for(model: nn.Module, regions: list[Region], **compile_: object) -> Manifest:
    # Not test_apply's: importing that module a second time registers its failing backend twice.
    return Manifest(compute_fingerprint(model.state_dict()), regions,
                    compile={**DEFAULT_COMPILE, **compile_})


SIDE = 101  # the raw handle of the first stream FakeCuda makes: the capturer's side stream


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.at: int | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.at = (stream or self.cuda.current).cuda_stream


def routed_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """FakeCuda with what the route uses besides: events, set_stream and the current device."""
    cuda = FakeCuda(monkeypatch)
    cuda.device = 0
    cuda.switches = 0

    def set_stream(stream: FakeStream) -> None:
        cuda.switches += 1
        cuda.current = stream

    def set_device(index: int) -> None:
        cuda.device = index

    for name, value in {"Event": lambda: FakeEvent(cuda), "set_stream": set_stream,
                        "current_device": lambda: cuda.device, "set_device": set_device}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    return cuda


class Logged(nn.Module):
    """Logs the stream each forward ran on. ``again`` calls ``self.forward`` inside (nested);
    ``generate`` calls ``self(...)`` as transformers' generate() does."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.log = cuda.log
        self.cuda = [cuda]  # not a submodule, not state

    def forward(self, x: torch.Tensor, again: bool = False, fail: bool = False) -> torch.Tensor:
        self.log.append(("run", self.cuda[0].current.cuda_stream))
        if fail:
            raise ValueError("the model's own error")
        if again:
            self.forward(x)
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self(x) for _ in range(2)]


def routed(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCuda, Logged, CudaCapturer, Any]:
    cuda = routed_cuda(monkeypatch)
    model = Logged(cuda)
    cap = capturer(cuda)
    notes: list[str] = []
    route = install_route(model, [types.SimpleNamespace(capturer=cap)], enabled=True,
                          notes=notes)
    assert route is not None and notes == [ROUTE_NOTE]
    cuda.log.clear()
    return cuda, model, cap, route


ORDERED = [("wait", SIDE, 0), ("run", SIDE), ("wait", 0, SIDE)]


@pytest.mark.parametrize(("how", "runs"), [
    pytest.param(lambda m, x: m(x), 1, id="__call__"),
    pytest.param(lambda m, x: m.forward(x), 1, id="forward"),
    pytest.param(lambda m, x: m.generate(x)[0], 2, id="generate-calls-self")])
def test_a_call_on_the_default_stream_runs_on_the_side_stream_ordered_both_ways(
        monkeypatch: pytest.MonkeyPatch, how: Any, runs: int) -> None:
    cuda, model, _, route = routed(monkeypatch)
    x = torch.randn(3, 2)
    torch.testing.assert_close(how(model, x), model.lin(x))
    assert cuda.log == ORDERED * runs  # waits before and after every routed call
    assert cuda.current is cuda.default and route.calls == runs


def test_the_stream_is_put_back_and_ordered_when_the_model_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, model, _, _ = routed(monkeypatch)
    with pytest.raises(ValueError, match="the model's own error"):
        model(torch.randn(1, 2), fail=True)
    assert cuda.log == ORDERED and cuda.current is cuda.default


def test_a_nested_call_enters_the_route_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, model, _, route = routed(monkeypatch)
    model(torch.randn(1, 2), again=True)
    assert cuda.log == [("wait", SIDE, 0), ("run", SIDE), ("run", SIDE), ("wait", 0, SIDE)]
    assert route.calls == 1 and cuda.switches == 2


def test_a_call_on_a_users_stream_is_not_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, model, _, route = routed(monkeypatch)
    cuda.current = FakeStream(7, cuda.log)
    model(torch.randn(1, 2))
    assert cuda.log == [("run", 7)] and route.calls == 0 and cuda.switches == 0


def test_a_call_from_another_device_puts_that_device_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """set_stream makes the side stream's device current: the caller's device is restored."""
    cuda, model, _, _ = routed(monkeypatch)
    cuda.device = 3
    model(torch.randn(1, 2))
    assert cuda.device == 3 and cuda.log == ORDERED


def test_under_an_outer_compile_trace_the_route_steps_aside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, model, _, route = routed(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    model(torch.randn(1, 2))
    assert cuda.log == [("run", 0)] and route.calls == 0


def test_the_wrapper_keeps_forwards_signature_and_the_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers reads ``inspect.signature(model.forward)`` (logits_to_keep, kwargs)."""
    import inspect

    cuda = routed_cuda(monkeypatch)
    model = Logged(cuda)
    keys = list(model.state_dict())
    want = inspect.signature(model.forward)
    install_route(model, [types.SimpleNamespace(capturer=capturer(cuda))], enabled=True,
                  notes=[])
    assert inspect.signature(model.forward) == want
    assert list(model.state_dict()) == keys and ROUTE_ATTR in vars(model.forward)


def test_no_route_without_a_cuda_capturer_or_when_turned_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = routed_cuda(monkeypatch)
    model = Logged(cuda)
    notes: list[str] = []
    stand_in = types.SimpleNamespace(capturer=FakeCapturer())  # no side stream: a CPU stand-in
    assert install_route(model, [stand_in], enabled=True, notes=notes) is None
    assert install_route(model, [], enabled=True, notes=notes) is None
    cuda_slot = types.SimpleNamespace(capturer=capturer(cuda))
    assert install_route(model, [cuda_slot], enabled=False, notes=notes) is None
    assert "forward" not in vars(model) and notes == []
    two = [cuda_slot, types.SimpleNamespace(graphs=types.SimpleNamespace(capturer=capturer(cuda)))]
    assert install_route(model, two, enabled=True, notes=notes) is None
    assert "on 2 devices" in notes[0]
    with pytest.raises(SurgeryError, match="route_default_stream = 'yes' is not a bool"):
        install_route(model, [cuda_slot], enabled="yes", notes=notes)  # type: ignore[arg-type]


def test_two_handles_share_one_route_and_the_last_removes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = routed_cuda(monkeypatch)
    model = Logged(cuda)
    slots = [types.SimpleNamespace(capturer=capturer(cuda))]
    first = install_route(model, slots, enabled=True, notes=[])
    second = install_route(model, slots, enabled=True, notes=[])
    assert first is second and first is not None and first.users == 2
    first.remove()
    assert vars(model)["forward"] is first.wrapper
    cuda.log.clear()
    model(torch.randn(1, 2))
    assert cuda.log == ORDERED  # entered once, not twice
    second.remove()
    assert "forward" not in vars(model)


def test_a_route_wrapped_again_goes_inert_when_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = routed_cuda(monkeypatch)
    model = Logged(cuda)
    route = install_route(model, [types.SimpleNamespace(capturer=capturer(cuda))], enabled=True,
                          notes=[])
    assert route is not None
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k)  # someone wraps the route afterwards
    route.remove()
    cuda.log.clear()
    model(torch.randn(1, 2))
    assert cuda.log == [("run", 0)]  # left in their chain, but no longer routing


def test_a_call_from_each_thread_is_routed_against_the_default_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One call at a time from several threads (region graphs' rule): each one routed."""
    cuda, model, _, route = routed(monkeypatch)
    for _ in range(2):
        t = threading.Thread(target=model, args=(torch.randn(1, 2),))
        t.start()
        t.join()
    assert cuda.log == ORDERED * 2 and route.calls == 2


def test_a_capture_inside_a_routed_call_counts_as_routed_and_keeps_no_workspace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The routed call's eager parts made the side stream's workspace; the graphs share it."""
    cuda, _, cap, route = routed(monkeypatch)
    model = nn.Identity()
    graphs = []

    def call() -> None:
        cuda.matmul()  # eager, before the region: the side stream's workspace
        graphs.append(cap.capture(cuda.matmul))

    route.run(lambda: call(), (), {})
    assert cuda.workspaces == {SIDE}, "a matmul ran on the default stream"
    assert (cap.routed_captures, cap.side_captures, cap.caller_captures) == (1, 0, 0)
    assert cap.stream_bytes == cap.side_bytes == 0 and cuda.made == 1
    assert graphs[0].stream.cuda_stream == SIDE  # type: ignore[attr-defined]
    cuda.log.clear()
    graphs[0].replay()  # replayed outside the route, on the default stream: ordered
    assert cuda.log == [("wait", 0, SIDE), ("replay", 0), ("wait", SIDE, 0)]
    del model


def test_a_workspace_a_routed_captures_warm_up_makes_is_the_models_not_the_graphs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A region that is the model's first matmul: its warm-up makes the side stream's workspace,
    which unrouted would have been eager's on the default stream: not counted as the graphs'."""
    cuda, _, cap, route = routed(monkeypatch)
    graphs = []
    route.run(lambda: graphs.append(cap.capture(cuda.matmul)), (), {})
    assert cuda.workspaces == {SIDE} and cuda.allocated == WORKSPACE
    assert (cap.routed_captures, cap.stream_bytes, cap.side_bytes) == (1, 0, 0)


def test_the_report_says_the_calls_were_routed() -> None:
    mem = GraphMemory([], caller_captures=0, routed_captures=4)
    assert "4 capture(s) on surgery's side stream, which the whole call ran on" in mem.line()
    assert "torch.cuda.stream(" not in mem.line()
    both = GraphMemory([], capture_stream=WORKSPACE, side_stream=WORKSPACE, side_captures=1,
                       routed_captures=2)
    assert "outside the route" in both.line() and "2 capture(s)" in both.line()


# --- through apply_manifest, on the CPU ----------------------------------------------------------

class RoutedFake(FakeCapturer):
    """test_graphs' faithful stand-in graph (replays its work), with FakeCuda's streams."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda
        self._side: FakeStream | None = None

    def side_stream(self) -> FakeStream:
        if self._side is None:
            self._side = torch.cuda.Stream(0)  # type: ignore[assignment]
        return self._side  # type: ignore[return-value]

    def current_raw(self) -> int:
        return self.cuda.current.cuda_stream


class Net(nn.Module):
    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = [cuda]
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cuda[0].log.append(("run", self.cuda[0].current.cuda_stream))
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def test_apply_manifest_routes_warm_up_and_calls_and_restore_removes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = routed_cuda(monkeypatch)
    cap = RoutedFake(cuda)
    monkeypatch.setattr(apply_mod, "_on_cuda", lambda module, model: True)
    monkeypatch.setattr(apply_mod, "_capturer_for", lambda module: cap)
    torch.manual_seed(0)
    model = Net(cuda).eval()
    keys = list(model.state_dict())
    m = manifest_for(model, [Region("block", ["blocks.0", "blocks.1"])], backend="aot_eager",
                     capture="region")
    x = torch.randn(2, 4)
    with torch.no_grad():
        want = model(x)
        handle = apply_manifest(model, m, warmup=lambda mdl: mdl(x), passes=2)
        assert cuda.log.count(("run", SIDE)) == 2 and ("run", 0) not in cuda.log[1:]
        assert ROUTE_NOTE in handle.report.notes and handle.route is not None
        got = [model(x), model.forward(x)]
        assert list(model.state_dict()) == keys
        assert sum(r.cuda_graph_replays for r in handle.report) > 0, handle.report.summary()
        handle.restore()
        assert "forward" not in vars(model) and handle.route.users == 0
        cuda.log.clear()
        model(x)
    assert cuda.log == [("run", 0)]
    for out in got:
        torch.testing.assert_close(out, want)
    # Opted out: nothing is routed.
    with torch.no_grad():
        handle = apply_manifest(model, m, warmup=lambda mdl: mdl(x), passes=2,
                                route_default_stream=False)
    assert handle.route is None and "forward" not in vars(model)
    assert ROUTE_NOTE not in handle.report.notes
    handle.restore()


def test_no_route_on_the_cpu() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    m = manifest_for(model, [Region("lin", ["0"])], backend="aot_eager", on_cpu="compile")
    with torch.no_grad(), apply_manifest(model, m, warmup=lambda mdl: mdl(torch.randn(2, 4)),
                                         passes=2) as handle:
        assert handle.route is None and "forward" not in vars(model)


# --- on a GPU ------------------------------------------------------------------------------------

def gpt2_default_stream_child() -> dict[str, Any]:
    """transformers GPT-2 (tiny random config) through ``generate()`` on the default stream, in a
    fresh process: cuBLAS keeps a workspace per stream for the life of the process, so only a
    process where nothing ran a matmul on the default stream can show that none was made there.
    The eager reference runs on a stream of its own for that reason."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 tokens
    model, ids, generate, manifest = gpt2_decode_on_cuda()
    keys = list(model.state_dict())
    torch.cuda.synchronize()
    with torch.inference_mode():
        with torch.cuda.stream(torch.cuda.Stream()):
            want = generate(model)
        torch.cuda.synchronize()
        handle = apply_manifest(model, manifest, warmup=generate, passes=2)
        got = [generate(model) for _ in range(2)]
        held = model(ids).logits  # made on the side stream, read on the default stream below
        value = held.clone()
        got += [generate(model) for _ in range(3)]
        intact = torch.equal(held, value)
        mem = handle.report.memory
        route_calls = handle.route.calls if handle.route is not None else 0
        records = [(r.path, r.graphs_captured, r.cuda_graph_replays) for r in handle.report]
        same_keys = list(model.state_dict()) == keys
        torch.cuda.synchronize()
        a = torch.ones(64, 64, device="cuda")
        growth = []
        for _ in range(2):  # the first matmul on the default stream: its workspace, if none yet
            before = torch.cuda.memory_allocated()
            b = a @ a
            torch.cuda.synchronize()
            growth.append(torch.cuda.memory_allocated() - before)
            del b
        handle.restore()
    return {"tokens_equal": [torch.equal(t, want) for t in got], "held_intact": intact,
            "routed": mem.routed_captures, "side": mem.side_captures,
            "caller": mem.caller_captures, "capture_stream": mem.capture_stream,
            "route_calls": route_calls, "records": records, "keys_equal": same_keys,
            "default_matmul_growth": growth, "line": mem.line(),
            "forward_left": "forward" in vars(model)}


@pytest.mark.cuda
def test_cuda_gpt2_generate_on_the_default_stream_makes_no_default_workspace() -> None:
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json; from tests.test_stream_route import gpt2_default_stream_child as c; "
            "print('RESULT ' + json.dumps(c()))")
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, done.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert all(r["tokens_equal"]) and r["held_intact"] and r["keys_equal"], r
    assert all(cap > 0 and rep > 0 for _, cap, rep in r["records"]), r["records"]
    # Every capture on the side stream the whole call ran on; none paid a workspace of its own.
    assert r["routed"] > 0 and r["side"] == 0 and r["caller"] == 0, r
    assert r["capture_stream"] < 2**20 and "routed" in r["line"], r["line"]
    assert r["route_calls"] > 0 and not r["forward_left"], r
    # No default-stream workspace was made: the probe's first matmul there makes one (MiBs),
    # its second makes nothing but its 16 KiB output.
    first, second = r["default_matmul_growth"]
    assert first > 4 * 2**20 and second < 2**20, r["default_matmul_growth"]


@pytest.mark.cuda
def test_cuda_the_route_runs_the_model_on_the_side_stream_and_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).cuda().eval()
    seen: list[int] = []
    model[1].register_forward_pre_hook(
        lambda mod, args: seen.append(torch.cuda.current_stream().cuda_stream))
    m = manifest_for(model, [Region("lin", ["0", "2"])], backend="aot_eager", capture="region")
    x = torch.randn(4, 256, device="cuda")
    with torch.no_grad():
        wants = [model(x + i) for i in range(4)]
        handle = apply_manifest(model, m, warmup=lambda mdl: mdl(x), passes=3)
        assert handle.route is not None
        side = handle.route.side.cuda_stream
        seen.clear()
        outs = [model(x + i) for i in range(4)]  # held: rings, read on the default stream
        assert set(seen) == {side} and torch.cuda.current_stream() == torch.cuda.default_stream()
        user = torch.cuda.Stream()
        user.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(user):
            seen.clear()
            mine = model(x)
            assert seen == [user.cuda_stream]  # a user stream is not routed
        torch.cuda.current_stream().wait_stream(user)
        replays = sum(r.cuda_graph_replays for r in handle.report)
        handle.restore()
    assert replays > 0 and "forward" not in vars(model)
    for out, want in zip(outs, wants, strict=True):
        torch.testing.assert_close(out, want)
    torch.testing.assert_close(mine, wants[0])


@pytest.mark.cuda
def test_cuda_inside_the_users_own_capture_the_model_is_not_routed() -> None:
    """torch.cuda.graph captures on a stream of its own, never the default one: a call made
    inside it stays there (a routed call would leave the capture). The route alone, on a plain
    model: what region graphs do inside a user's capture is test_capture's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).cuda().eval()
    route = install_route(model, [types.SimpleNamespace(
        capturer=CudaCapturer(torch.cuda.current_device()))], enabled=True, notes=[])
    assert route is not None
    x = torch.randn(2, 64, device="cuda")
    with torch.no_grad():
        want = model(x)
        assert route.calls == 1
        user = torch.cuda.CUDAGraph()
        with torch.cuda.graph(user):
            out = model(x)
        x.add_(1)
        want = model(x)
        user.replay()
        torch.cuda.synchronize()
    assert route.calls == 2  # the call inside the capture was not routed
    torch.testing.assert_close(out, want)
    route.remove()  # install_route counted this one user
    assert "forward" not in vars(model)
