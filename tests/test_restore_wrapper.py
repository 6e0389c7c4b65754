"""A wrapper the caller kept across ``restore()`` runs eager, never the compiled code (a gap
the mutation audit of issue 22 found: no test failed when restore left it compiled)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest

AOT = {"backend": "aot_eager", "on_cpu": "compile"}
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.block(x))


def test_a_kept_wrapper_runs_eager_after_restore() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    manifest = Manifest(compute_fingerprint(model.state_dict()), [Region("b", ["block"])],
                        compile=dict(DEFAULT_COMPILE))
    x = torch.randn(2, 8)
    with torch.no_grad():
        handle = apply_manifest(model, manifest, warmup=lambda m: m(x), overrides=AOT)
        kept = model.block.forward  # the caller keeps the wrapper
        slot = kept.__surgery_slot__
        calls: list[int] = []
        group = slot.group
        real = group.call

        def counting(*a, **k):
            calls.append(1)
            return real(*a, **k)

        group.call = counting
        kept(x)
        assert calls, "the probe does not see compiled calls"  # control: it counts them
        calls.clear()
        handle.restore()
        out = kept(x)
    assert calls == [], "a wrapper kept across restore() still ran compiled code"
    torch.testing.assert_close(out, nn.Linear.forward(model.block, x))
