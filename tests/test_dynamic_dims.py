"""A region with ``dynamic_dims`` compiles those dims dynamic and the others static (DimMarks
in surgery.runtime.groups, issue 18): no recompile over a dim the plan saw vary, a recompile when
a dim it saw fixed changes, the fixed dim's size a constant in the graph, and the caller's
tensors left unmarked."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from surgery import apply_manifest
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import Manifest, Region
from surgery.runtime.groups import DimMarks

GRAPHS: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend(name="surgery_test_graphs")
def _keep_graphs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    GRAPHS.append(gm)
    return gm.forward


class Tokens(nn.Module):
    """x is (batch, tokens, 8): the planned batch varies, the token count did not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale + x.shape[1]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Tokens()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x, torch.ones(1, 8, device=x.device))


def _manifest(model: nn.Module, dims: dict[str, list[int]]) -> Manifest:
    region = Region(kind="observed", paths=["body"], dynamic=True, dynamic_dims=dims)
    return Manifest(fingerprint=compute_fingerprint(model.state_dict()), regions=[region])


def _placeholder_shapes(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 3:
            out.append(tuple(v.shape))
    return out


def _run(dims: dict[str, list[int]], shapes: list[tuple[int, int, int]]) -> tuple[int, Any]:
    torch._dynamo.reset()
    GRAPHS.clear()
    model = Net().eval()
    handle = apply_manifest(model, _manifest(model, dims),
                            overrides={"backend": "surgery_test_graphs", "on_cpu": "compile"})
    try:
        with torch.no_grad():
            for s in shapes:
                x = torch.randn(*s)
                torch.testing.assert_close(model(x), model.body.lin(x) + s[1])
                assert not hasattr(x, "_dynamo_weak_dynamic_indices")  # left as it came
        rec = handle.report.records[0]
        assert rec.status == "compiled" and rec.signature_mode == "dynamic"
        return rec.compiles, list(GRAPHS)
    finally:
        handle.restore()


def test_only_the_dims_that_varied_are_dynamic() -> None:
    compiles, graphs = _run({"x": [0]}, [(2, 4, 8), (3, 4, 8), (5, 4, 8), (9, 4, 8)])
    assert compiles == 1, "a batch size that the plan saw vary compiled again"
    (shape,) = _placeholder_shapes(graphs[0])
    assert isinstance(shape[0], torch.SymInt), shape
    assert shape[1:] == (4, 8) and all(type(d) is int for d in shape[1:]), \
        f"the token dim the plan saw fixed is not specialised: {shape}"


def test_a_change_in_a_dim_planned_static_is_a_recompile() -> None:
    compiles, graphs = _run({"x": [0]}, [(2, 4, 8), (3, 4, 8), (3, 6, 8), (5, 6, 8)])
    assert compiles == 2, "a token count the plan saw fixed did not recompile"
    assert [_placeholder_shapes(g)[0][1] for g in graphs] == [4, 6]


def test_both_dims_marked_compile_once() -> None:
    compiles, _ = _run({"x": [0, 1]}, [(2, 4, 8), (3, 6, 8), (5, 7, 8)])
    assert compiles == 1


@pytest.mark.parametrize("dims", [pytest.param({"y": [0]}, id="no-such-argument"),
                                  pytest.param({"x": [63]}, id="no-such-dim")])
def test_names_and_dims_a_call_does_not_have_are_skipped(dims: dict[str, list[int]]) -> None:
    marks = DimMarks(dims, ["x", "scale"])
    x = torch.randn(2, 3)
    with marks.applied((x, x), {}):
        assert not getattr(x, "_dynamo_weak_dynamic_indices", set())
    assert not hasattr(x, "_dynamo_weak_dynamic_indices")


def test_marks_a_caller_set_are_kept() -> None:
    x = torch.randn(2, 3)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    with DimMarks({"x": [0]}, ["x"]).applied((x,), {}):
        assert x._dynamo_weak_dynamic_indices == {0, 1}
    assert x._dynamo_weak_dynamic_indices == {1}


@pytest.mark.cuda
def test_on_the_gpu_inductor_compiles_a_batch_that_varies_once() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run on the GPU machine")
    torch._dynamo.reset()
    model = Net().cuda().eval()
    handle = apply_manifest(model, _manifest(model, {"x": [0]}), overrides={"capture": "compiler"})
    try:
        with torch.no_grad():
            for b in (2, 3, 5, 9):
                x = torch.randn(b, 4, 8, device="cuda")
                torch.testing.assert_close(model(x), model.body.lin(x) + 4)
        rec = handle.report.records[0]
        assert rec.status == "compiled" and rec.compiles == 1, (rec.compiles, rec.reason)
    finally:
        handle.restore()
