"""Recompile budgets on the GPU: inductor, surgery's region graphs, many batch sizes.

The CPU tests (tests/test_budget.py) prove the routing with aot_eager; these check that the real
path (inductor kernels, region CUDA graphs captured per signature) keeps working when a region's
shapes vary, and that nothing escapes under inference_mode. tests/conftest.py skips them cleanly
without CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest
from surgery.runtime.graphs.replay import MAX_GRAPHS_PER_PATH
from surgery.runtime.report import SurgeryWarning

TOL = {"atol": 1e-3, "rtol": 1e-3}  # inductor vs cuBLAS, float32

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _inputs() -> list[torch.Tensor]:
    xs = [torch.randn(n, 64, device="cuda") for n in range(1, 13)]
    return [*xs, torch.randn(8, 128, device="cuda")[:, ::2]]  # the last is non-contiguous


@pytest.mark.cuda
@pytest.mark.parametrize("grad_mode", [pytest.param(torch.no_grad, id="no_grad"),
                                       pytest.param(torch.inference_mode, id="inference_mode")])
def test_fourteen_batch_sizes_with_region_graphs(grad_mode) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Lin()).cuda().eval()
    m = Manifest(compute_fingerprint(model.state_dict()), [Region("lin", ["0"])],
                 compile=dict(DEFAULT_COMPILE))  # inductor, capture = "region"
    inputs = _inputs()
    with grad_mode(), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        h = apply_manifest(model, m)
        for _ in range(3):  # the second sighting of a signature captures, the third replays
            for x in inputs:
                torch.testing.assert_close(model(x), model[0].lin(x), **TOL)
    rec = h.report[0]
    summary = h.report.summary()
    assert rec.status == "compiled" and rec.signature_mode == "dynamic", summary
    assert rec.signatures == 4 and rec.compiles <= 8, summary
    assert rec.compiled_calls == rec.calls == 3 * len(inputs), summary
    assert rec.graphs_captured <= MAX_GRAPHS_PER_PATH, summary
    ours = [str(w.message) for w in got if issubclass(w.category, SurgeryWarning)]
    assert any("dynamic shapes" in w for w in ours), ours
    print(f"[{grad_mode.__name__}] {summary}")  # what it did, in the GPU run's log
    h.restore()


class IdxBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.lin(x) * (1.0 + 0.1 * layer_idx)


class Trunk(nn.Module):
    """Per-instance int arguments, and a last block run with autocast turned off."""

    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(IdxBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks[:-1]):
            x = b(x, i)
        with torch.autocast("cuda", enabled=False):
            return self.blocks[-1](x.float(), 0)


@pytest.mark.cuda
def test_per_instance_ints_and_autocast_off_under_inference_mode() -> None:
    torch.manual_seed(0)
    model = Trunk().cuda().eval()
    depth = len(model.blocks)
    x = torch.randn(4, 64, device="cuda")

    def step(mdl: nn.Module) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return mdl(x)

    m = Manifest(compute_fingerprint(model.state_dict()),
                 [Region("block", [f"blocks.{i}" for i in range(depth)])],
                 compile=dict(DEFAULT_COMPILE))
    with torch.inference_mode():
        ref = step(model)
        h = apply_manifest(model, m, warmup=step, passes=3)
        out = step(model)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)  # bf16 blocks
    summary = h.report.summary()
    assert {r.status for r in h.report} == {"compiled"}, summary
    last = h.report.by_path(f"blocks.{depth - 1}")
    assert any("autocast state" in r for r in last.recompile_reasons), summary
    assert sum(r.compiles for r in h.report) <= 8 + 2, summary
    print(summary)
    h.restore()
