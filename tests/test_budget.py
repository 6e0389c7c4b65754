"""Recompile budgets (surgery.runtime.budget and the slot's routing): own caches, bounded,
explained.

Every test runs apply_manifest on the CPU with aot_eager (on_cpu="compile"), the full dynamo +
AOTAutograd path. Compiles are counted by dynamo itself (`_debug_get_cache_entry_list` on the
code object a group compiles, and ``counters["stats"]["unique_graphs"]``), not by surgery.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from surgery.errors import RegionError
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest
from surgery.runtime.budget import call_signature, explain_new, fix_for, fresh_function
from surgery.runtime.report import RegionFallbackWarning, SurgeryWarning

AOT = {"backend": "aot_eager", "on_cpu": "compile"}
EXACT = {"atol": 1e-6, "rtol": 1e-5}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def manifest_for(model: nn.Module, regions: list[Region], **compile_: object) -> Manifest:
    return Manifest(compute_fingerprint(model.state_dict()), regions,
                    compile={**DEFAULT_COMPILE, **AOT, **compile_})


def slot_of(module: nn.Module, name: str = "forward"):
    return vars(module)[name].__surgery_slot__


def code_entries(slot) -> int:
    """Dynamo cache entries on the code object the slot's group compiles."""
    fn = slot.group.compiled._torchdynamo_orig_callable
    return len(_debug_get_cache_entry_list(fn.__code__))


def ours(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, SurgeryWarning)]


class Lin(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


# --- one dynamo cache per group ----------------------------------------------------------------

@torch._dynamo.config.patch(recompile_limit=3)
def test_each_handle_compiles_its_own_code_object() -> None:
    """With dynamo's limit at 3 signatures per code object, a second model of the same class,
    applied after the first was restored, still compiles 3 new shapes: its cache is its own."""
    torch.manual_seed(0)
    slots = []
    for sizes in ((1, 2, 3), (4, 5, 6)):
        model = nn.Sequential(Lin())
        m = manifest_for(model, [Region("lin", ["0"])])
        with torch.no_grad(), apply_manifest(model, m) as h:
            before = counters["stats"]["unique_graphs"]
            for n in sizes:
                x = torch.randn(n, 8)
                torch.testing.assert_close(model(x), model[0].lin(x), **EXACT)
            rec = h.report[0]
            assert rec.status == "compiled" and rec.signature_mode == "static", h.report.summary()
            assert rec.compiles == 3 and counters["stats"]["unique_graphs"] - before == 3
            slots.append(slot_of(model[0]))
            assert code_entries(slots[-1]) == 3
    # The class's own forward was never compiled: nothing is cached on its code object.
    assert _debug_get_cache_entry_list(Lin.forward.__code__) == []
    a, b = (s.group.compiled._torchdynamo_orig_callable for s in slots)
    assert a.__code__ is not b.__code__ and a.__code__ is not Lin.forward.__code__


class TwoWidths(nn.Module):
    """One class (Lin) at width 8 in a trunk and at width 16 in a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.ModuleList(Lin(8) for _ in range(2))
        self.head = nn.ModuleList(Lin(16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.trunk:
            x = t(x)
        x = torch.cat([x, x], -1)
        for h in self.head:
            x = h(x)
        return x


@torch._dynamo.config.patch(recompile_limit=2)
def test_paths_of_two_weight_layouts_compile_a_copy_each() -> None:
    """The runtime half of issue 18's budgets per weight layout: one region over a class used
    at two widths compiles one copy for the trunk's paths and one for the head's, so each
    dynamo cache holds only its own layout's signatures (2 token counts: 2 entries each, within
    dynamo's limit of 2; one merged copy would hold all 4)."""
    torch.manual_seed(0)
    model = TwoWidths().eval()
    xs = [torch.randn(n, 8) for n in (2, 3)]
    with torch.no_grad():
        want = [model(x) for x in xs]
    m = manifest_for(model, [Region("repeated_block", ["trunk.0", "trunk.1", "head.0", "head.1"])])
    with torch.no_grad(), apply_manifest(model, m) as h:
        for x, w in zip(xs, want, strict=True):
            torch.testing.assert_close(model(x), w, **EXACT)
        trunk, head = slot_of(model.trunk[0]), slot_of(model.head[0])
        assert slot_of(model.trunk[1]).group is trunk.group
        assert slot_of(model.head[1]).group is head.group
        assert trunk.group is not head.group
        assert code_entries(trunk) == 2 and code_entries(head) == 2
        assert all(r.status == "compiled" for r in h.report), h.report.summary()


def test_fresh_function_keeps_defaults_closure_and_super() -> None:
    class Base(nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 2.0, *, shift: int = 1) -> torch.Tensor:
            return x * scale + shift

    class Child(Base):
        def forward(self, x: torch.Tensor, scale: float = 3.0, *, shift: int = 1) -> torch.Tensor:
            return super().forward(x, scale, shift=shift) + 1

    fn = fresh_function(Child.forward)
    assert fn.__code__ is not Child.forward.__code__
    x = torch.ones(2)
    torch.testing.assert_close(fn(Child(), x), Child()(x))
    torch.testing.assert_close(fn(Child(), x, shift=5), Child()(x, shift=5))
    # A callable that is not a plain function goes through a trampoline of its own.
    lin = nn.Linear(2, 2)
    t1, t2 = fresh_function(lin), fresh_function(lin)
    assert t1.__code__ is not t2.__code__
    torch.testing.assert_close(t1(torch.ones(1, 2)), lin(torch.ones(1, 2)))


# --- many shapes keep working ------------------------------------------------------------------

def test_fourteen_batch_sizes_compile_a_bounded_number_of_times() -> None:
    """A one-Linear region called with batch sizes 1..12 and a non-contiguous input: 4 static
    signatures, then one dynamic compile serves the rest; outputs match eager throughout."""
    torch.manual_seed(0)
    model = nn.Sequential(Lin())
    h = apply_manifest(model, manifest_for(model, [Region("lin", ["0"])]))
    inputs = [torch.randn(n, 8) for n in range(1, 13)] + [torch.randn(8, 16)[:, ::2]]
    inputs.append(torch.randn(3, 16)[:, ::2])  # a second non-contiguous shape
    with torch.no_grad(), warnings.catch_warnings(record=True) as rec_w:
        warnings.simplefilter("always")
        for _ in range(2):  # the second round compiles nothing new
            for x in inputs:
                torch.testing.assert_close(model(x), model[0].lin(x), **EXACT)
    rec = h.report[0]
    s = h.report.summary()
    assert rec.status == "compiled" and rec.signature_mode == "dynamic", s
    assert rec.signatures == 4  # sizes 1..4 kept their static code
    # 4 static compiles, then the dynamic one (plus at most its size and stride
    # specialisations): bounded, far below one per shape.
    assert 5 <= rec.compiles <= 8, s
    assert rec.compiled_calls == rec.calls == 2 * len(inputs)
    assert "shape of x (5, 8) (was (4, 8))" in s and "recompiled for:" in s
    assert "dynamic: strides of x (16, 2) (was (8, 1); a non-contiguous input?)" in s
    assert "set dynamic = true" in rec.fix
    got = ours(rec_w)
    assert len(got) == 1 and "dynamic shapes" in str(got[0].message), [str(w.message) for w in got]
    h.restore()


def test_without_the_budget_the_same_calls_storm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a budget past dynamo's limit lets fullgraph hit FailOnRecompileLimitHit,
    which the runtime survives only by falling back to eager."""
    torch.manual_seed(0)
    model = nn.Sequential(Lin())
    h = apply_manifest(model, manifest_for(model, [Region("lin", ["0"])], max_signatures=64))
    monkeypatch.setattr(type(slot_of(model[0]).group), "capacity", lambda self: 64)
    with torch.no_grad(), pytest.warns(RegionFallbackWarning, match="FailOnRecompileLimitHit"):
        for n in range(1, 13):
            x = torch.randn(n, 8)
            torch.testing.assert_close(model(x), model[0].lin(x), **EXACT)
    rec = h.report[0]
    assert rec.status == "eager" and "FailOnRecompileLimitHit" in rec.reason
    assert rec.compiles == 8
    h.restore()


# --- per-instance ints, autocast, growing caches -------------------------------------------------

class IdxBlock(nn.Module):
    """A real block's shape: an int block index that differs per instance."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.lin(x) * (1.0 + 0.1 * layer_idx)


class IdxModel(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(IdxBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = b(x, i)
        return x


def test_per_instance_int_arguments_are_bounded_and_named() -> None:
    """12 identical blocks share one compiled function; each passes its own layer_idx. The
    shared cache fills at dynamo's limit (8), the rest compile once, dynamically; nothing
    storms, and each record names the int argument."""
    torch.manual_seed(0)
    depth = 12
    model = IdxModel(depth).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = model(x)
        m = manifest_for(model, [Region("block", [f"blocks.{i}" for i in range(depth)])])
        h = apply_manifest(model, m, warmup=lambda mdl: mdl(x))
        torch.testing.assert_close(model(x), ref, **EXACT)
    s = h.report.summary()
    assert {r.status for r in h.report} == {"compiled"}, s
    modes = [r.signature_mode for r in h.report]
    assert modes == ["static"] * 8 + ["dynamic"] * 4, s
    assert sum(r.compiles for r in h.report) <= 8 + 2, s
    one = h.report.by_path("blocks.1")
    assert one.recompile_reasons == ["int argument layer_idx = 1 (was 0)"]
    assert one.fix.startswith("int argument layer_idx differs per call: make it a tensor")
    h.restore()


class Head(nn.Module):
    """Turns autocast off inside itself, as real heads do in an autocast step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.lin(x.float())


class AutocastModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.ModuleList(Lin() for _ in range(2))
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.trunk[0](x)
        with torch.autocast("cpu", enabled=False):  # the head's trunk runs in float32
            x = self.trunk[1](x.float())
        return self.head(x)


def test_autocast_flipped_inside_an_autocast_step() -> None:
    torch.manual_seed(0)
    model = AutocastModel().eval()
    x = torch.randn(3, 8)

    def step(mdl: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mdl(x)

    with torch.no_grad():
        ref = step(model)
        m = manifest_for(model, [Region("trunk", ["trunk.0", "trunk.1"]),
                                 Region("head", ["head"])])
        h = apply_manifest(model, m, warmup=step, passes=2)
        out = step(model)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)  # bf16 inside autocast
    assert out.dtype == torch.float32
    s = h.report.summary()
    assert {r.status for r in h.report} == {"compiled"}, s
    t1 = h.report.by_path("trunk.1")
    assert t1.recompile_reasons == ["autocast state cpu:off/cuda:off (was cpu:bfloat16/cuda:off)"]
    assert "autocast state" in t1.fix
    assert h.report.by_path("head").recompiles == 0
    h.restore()


class CacheBlock(nn.Module):
    """Attends over a KV cache passed as a growing list: no fixed shape to compile for."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        y = self.lin(x)
        for c in cache:
            y = y + c.mean(0, keepdim=True)
        return y


def test_a_growing_cache_argument_demotes_the_path_to_eager(recwarn) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(CacheBlock())
    h = apply_manifest(model, manifest_for(model, [Region("cache", ["0"])]))
    cache: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(2, 8)
            torch.testing.assert_close(model[0](x, cache), CacheBlock.forward(model[0], x, cache),
                                       **EXACT)
            cache.append(x)
    rec = h.report[0]
    assert rec.status == "eager" and rec.signature_mode == "eager"
    assert "over its budget of 4" in rec.reason
    assert "list argument cache has 4 items (was 3)" in rec.reason
    assert rec.compiles == 4 and rec.eager_calls == 4
    assert "exclude the region" in rec.fix
    got = ours(recwarn)
    assert len(got) == 1 and issubclass(got[0].category, RegionFallbackWarning)
    h.restore()


class IndexedScale(nn.Module):
    """An int used as a list index: dynamic shapes cannot make it symbolic."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scales = [float(i + 1) for i in range(16)]

    def forward(self, x: torch.Tensor, idx: int) -> torch.Tensor:
        return self.lin(x) * self.scales[idx]


def test_a_dynamic_compile_that_keeps_recompiling_is_demoted_to_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(IndexedScale())
    h = apply_manifest(model, manifest_for(model, [Region("scaled", ["0"])]))
    x = torch.randn(2, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as rec_w:
        warnings.simplefilter("always")
        for i in range(16):
            torch.testing.assert_close(model[0](x, i), model[0].lin(x) * (i + 1), **EXACT)
    rec = h.report[0]
    assert rec.status == "eager" and "dynamic compile recompiled 5 times" in rec.reason
    assert rec.compiles == 4 + 5  # 4 static, 5 dynamic, then nothing more
    assert [w.category for w in ours(rec_w)] == [SurgeryWarning, RegionFallbackWarning]
    h.restore()


def test_max_signatures_is_a_compile_key() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Lin())
    h = apply_manifest(model, manifest_for(model, [Region("lin", ["0"],
                                                          compile={"max_signatures": 2})]))
    with torch.no_grad(), pytest.warns(SurgeryWarning, match="over its budget of 2"):
        for n in (1, 2, 3):
            model(torch.randn(n, 8))
    assert h.report[0].signatures == 2 and h.report[0].signature_mode == "dynamic"
    h.restore()
    for bad in (0, "4", 1.5, True):
        with pytest.raises(RegionError, match="max_signatures"):
            apply_manifest(model, manifest_for(model, [Region("lin", ["0"])],
                                               max_signatures=bad))


# --- the signature and its explanations --------------------------------------------------------

def test_signature_differences_are_named() -> None:
    m = Lin()
    names = ["x", "layer_idx"]
    a = call_signature(names, m, (torch.zeros(2, 8), 0), {})
    b = call_signature(names, m, (torch.zeros(3, 8), 0), {})
    c = call_signature(names, m, (torch.zeros(2, 8), 5), {})
    with torch.no_grad():
        d = call_signature(names, m, (torch.zeros(2, 8), 0), {})
    e = call_signature(names, m, (torch.zeros(2, 8), 0), {"mask": None})
    assert explain_new(b, [a]) == [("shape", "shape of x (3, 8) (was (2, 8))")]
    assert explain_new(c, [a, b]) == [("int", "int argument layer_idx = 5 (was 0)")]
    assert explain_new(d, [a]) == [("grad", "grad mode off (was on)")]
    assert explain_new(e, [a])[0][0] == "structure"
    assert "make it a tensor" in fix_for(explain_new(c, [a]))
    assert "no_grad" in fix_for(explain_new(d, [a]))
    # Floats are not part of it: dynamo does not specialise on them by default.
    t = torch.zeros(2, 8)
    assert call_signature(["x", "s"], m, (t, 0.5), {}) == call_signature(["x", "s"], m, (t, 2.0),
                                                                          {})


# --- the case that broke: LingBot's layout, planned naively, streamed under autocast ------------

@pytest.mark.slow
def test_sdpa_example_streams_with_a_naive_plan_without_breaking() -> None:
    """The regions the planner proposed for LingBot's GCTStream: the camera trunk's blocks
    (a growing KV cache and an int global_idx), single convs of the float32 depth head, and the
    frame blocks; streamed in a bf16 autocast step. Nothing escapes, outputs match eager, the
    trunk is demoted with its reason, and the fixed-shape regions stay compiled."""
    from surgery.examples import tiny_sdpa

    torch.manual_seed(0)
    model, ref = tiny_sdpa().eval(), tiny_sdpa().eval()
    ref.load_state_dict(model.state_dict())
    regions = [
        Region("camera_block", ["camera_head.trunk.0", "camera_head.trunk.1"]),
        Region("depth_conv", [f"depth_head.projects.{i}" for i in range(4)]),
        Region("frame_block", ["aggregator.frame_blocks.0", "aggregator.frame_blocks.1"]),
    ]
    frames = [model.example_input(seed=i) for i in range(6)]

    def stream(mdl: nn.Module, xs: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return [mdl(x) for x in xs]

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        h = apply_manifest(model, manifest_for(model, regions),
                           warmup=lambda mdl: stream(mdl, frames[:1]), passes=2)
        outs = stream(model, frames[2:])
    want = stream(ref, [frames[0], frames[0], *frames[2:]])[2:]  # warm-up: frame 0, twice
    for o, w in zip(outs, want, strict=True):
        torch.testing.assert_close(o["depth"], w["depth"], atol=1e-2, rtol=1e-2)  # bf16 trunk
        torch.testing.assert_close(o["pose"], w["pose"], atol=1e-2, rtol=1e-2)
    s = h.report.summary()
    trunk = h.report.by_path("camera_head.trunk.0")
    assert trunk.status == "eager" and "list argument cache[0] has" in trunk.reason, s
    assert h.report.by_path("camera_head.trunk.1").recompile_reasons[0].startswith(
        "int argument global_idx = 1 (was 0)") or "global_idx" in s, s
    for path in ("depth_head.projects.0", "aggregator.frame_blocks.0"):
        assert h.report.by_path(path).status == "compiled", s
    assert sum(r.compiles for r in h.report) <= 4 * len(h.report), s
    fallback = [w for w in got if issubclass(w.category, RegionFallbackWarning)]
    assert len(fallback) == 1 and "camera_block" in str(fallback[0].message)
    h.restore()
