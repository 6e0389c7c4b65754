"""surgery.runtime.kernel_ids: the bundle records what the cold frames ran; a warm start checks
it, and pins Triton kernels to the cold run's configs.

The CPU half runs inductor for real (its C++ kernels are inline in the output code); Triton
kernels are stand-ins with a CachingAutotuner's fields (configs, compile_results, launchers,
kernel_hash, autotune_cache_info), since no Triton kernel launches on the CPU. The H200 runs
the real ones (benchmarks/gpu_warm_start.py, which prints the check per process).
"""

from __future__ import annotations

import importlib
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from bundle_support import KEY, KEY_HEX, TWO_BLOCKS_SRC, signed_site
from torch._inductor.codecache import PyCodeCache

from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import (
    DEFAULT_COMPILE,
    Manifest,
    Region,
    load_manifest,
    save_manifest,
)
from surgery.runtime import bundle, bundle_parts, cache, kernel_ids, precompiled
from surgery.runtime.apply import apply_manifest
from surgery.runtime.report import CacheIgnoredWarning
from surgery.runtime.signing import ENV_KEY, ENV_KEY_FILE

INDUCTOR = {"backend": "inductor", "on_cpu": "compile"}
AOT = {"backend": "aot_eager", "on_cpu": "compile"}  # where no kernel is generated (faster)
SRC = TWO_BLOCKS_SRC + "\nX = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))\n"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    return signed_site(tmp_path, monkeypatch, "kmod", SRC)


def _mod():  # type: ignore[no-untyped-def]
    import kmod  # type: ignore[import-not-found]

    return importlib.reload(kmod)


def _fresh_code_cache(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What a fresh process has loaded: no output-code module (the files stay on disk)."""
    monkeypatch.setattr(PyCodeCache, "modules", [])
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})


def _cold(site: Path, overrides: dict = INDUCTOR) -> dict:
    """Compile cold (inductor), run, save the bundle; its metadata."""
    mod = _mod()  # one module object a phase: torch pickles Block.forward by reference
    model = mod.build().eval()
    with torch.no_grad():
        h = apply_manifest(model, "net.surgery.toml", overrides=overrides)
        for _ in range(2):
            model(mod.X)
    saved = h.save_cache()
    h.restore()
    torch._dynamo.reset()
    return saved.metadata


def _warm(site: Path, overrides: dict = INDUCTOR
          ) -> tuple[kernel_ids.KernelCheck, object, list[str]]:
    mod = _mod()
    model = mod.build().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            h = apply_manifest(model, "net.surgery.toml", overrides=overrides, cache=True)
            model(mod.X)
    check = kernel_ids.check_kernels(h)
    h.restore()
    return check, h.report, [str(w.message) for w in caught
                             if issubclass(w.category, CacheIgnoredWarning)]


def test_warm_start_runs_the_code_the_cold_frames_ran(site, monkeypatch) -> None:
    """The record lists the cold frames' output code; a warm start (artifacts, no dynamo) in a
    process with no code loaded runs exactly that code: the check says the same, and it had
    something to compare (not an empty census)."""
    meta = _cold(site)
    record = meta["precompiled"][kernel_ids.KERNELS_FIELD]
    assert record["format"] == kernel_ids.KERNELS_FORMAT and len(record["code"]) >= 1, record
    _fresh_code_cache(monkeypatch)
    check, report, ignored = _warm(site)
    assert not ignored and report.cache.precompiled == 1, report.cache  # type: ignore[attr-defined]
    assert [r.compiles for r in report.records] == [0, 0]  # type: ignore[attr-defined]
    now = kernel_ids.census()
    assert len(now.code) >= 1 and set(now.code) <= set(record["code"]), (now.code, record)
    assert check.recorded and check.same, check.line()
    assert check.line().startswith("kernels: the cold run's")


def test_an_artifact_compiled_other_than_the_cold_frames_is_reported(site, monkeypatch) -> None:
    """An artifact whose code differs from what ran cold (here: compiled without inductor's
    size asserts and with the C++ kernels' SIMD width at 1, which the cold frames did not use)
    is caught: the check names new code and says DIFFER. (A record taken after the precompile
    would list the artifact's code too, and say same.)"""
    real = precompiled._compile_options

    def other(group):  # type: ignore[no-untyped-def]
        backend, options = real(group)
        return backend, {**options, "size_asserts": False, "cpp.simdlen": 1}

    monkeypatch.setattr(precompiled, "_compile_options", other)
    _cold(site)
    _fresh_code_cache(monkeypatch)
    check, report, _ = _warm(site)
    assert report.cache.precompiled == 1  # type: ignore[attr-defined]
    assert check.recorded and not check.same and check.new_code, check.line()
    assert "DIFFER" in check.line()


def test_a_bundle_without_a_record_is_not_called_checked(site, monkeypatch) -> None:
    """A format-3 bundle written before records loads as before; the check says NOT CHECKED,
    never "same"."""
    path = str(site / "net.surgery.cache")
    _cold(site, AOT)
    meta, blob = bundle.read_bundle(path, key=KEY)
    meta["precompiled"].pop(kernel_ids.KERNELS_FIELD)
    meta.pop("blob")
    bundle.write_bundle(path, blob, meta, key=KEY)
    _fresh_code_cache(monkeypatch)
    check, report, ignored = _warm(site, AOT)
    assert not ignored and report.cache.precompiled == 1  # type: ignore[attr-defined]
    assert not check.recorded and not check.same and "NOT CHECKED" in check.line()


DAMAGES = [
    pytest.param({"format": 2, "code": [], "triton": {}}, id="format"),
    pytest.param({"format": True, "code": [], "triton": {}}, id="bool-format"),
    pytest.param({"format": 1, "code": ["a"] * (kernel_ids.MAX_KERNELS + 1), "triton": {}},
                 id="too-many"),
    pytest.param({"format": 1, "code": [3], "triton": {}}, id="not-text"),
    pytest.param({"format": 1, "code": [], "triton": {"h": ["name", "x" * 513]}},
                 id="long-config"),
    pytest.param({"format": 1, "code": [], "triton": {"h": "name"}}, id="entry-shape"),
    pytest.param([1, 2], id="not-a-dict"),
]


def _damaged(path: str, genuine: tuple[dict, bytes], damage: object) -> None:
    meta, blob = genuine
    meta = {**meta, "precompiled": {**meta["precompiled"], kernel_ids.KERNELS_FIELD: damage}}
    meta.pop("blob")
    bundle.write_bundle(path, blob, meta, key=KEY)


def test_a_malformed_record_ignores_the_bundle_with_one_warning(site) -> None:
    """Signed with the deployer's key, yet not the record surgery writes: the bundle is
    refused before torch sees a byte, never an exception; through apply_manifest, one warning
    and a compile as usual."""
    path = str(site / "net.surgery.cache")
    _cold(site, AOT)
    manifest = load_manifest("net.surgery.toml")
    genuine = bundle.read_bundle(path, key=KEY)
    for p in DAMAGES:
        _damaged(path, genuine, p.values[0])  # type: ignore[arg-type]
        opened = cache.open_bundle(path, manifest=manifest, overrides=AOT, device="cpu")
        assert not opened.loaded and "kernel record" in opened.reason, (p.id, opened.reason)
    _check, report, ignored = _warm(site, AOT)
    assert len(ignored) == 1 and "kernel record" in ignored[0], ignored
    assert report.cache.loaded is False  # type: ignore[attr-defined]
    assert all(r.status == "compiled" for r in report.records)  # type: ignore[attr-defined]


def test_a_hostile_record_at_its_bounds_parses_fast() -> None:
    big = {"format": 1, "code": ["c" * 512] * kernel_ids.MAX_KERNELS,
           "triton": {f"{i:0512d}": ["n" * 512, "x" * 512] for i in range(kernel_ids.MAX_KERNELS)}}
    t = time.perf_counter()
    rec = kernel_ids.parse_record({"precompiled": {kernel_ids.KERNELS_FIELD: big}})
    assert rec is not None and len(rec.triton) == kernel_ids.MAX_KERNELS
    assert time.perf_counter() - t < 1.0


# --- Triton kernels: stand-ins with a CachingAutotuner's fields ----------------------------------

class _Config:
    def __init__(self, xblock: int, rblock: int) -> None:
        self.kwargs = {"XBLOCK": xblock, "R0_BLOCK": rblock}
        self.num_warps, self.num_stages = 4, 1


class _Launcher:
    def __init__(self, config: _Config) -> None:
        self.config = config


class _Kernel:
    """A reduction with two candidate configs, as torch leaves it after a cache miss."""

    def __init__(self, configs: list[_Config], *, state: str = "miss") -> None:
        self.fn = object()
        self.kernel_hash = "c" * 52
        self.configs = list(configs)
        self.compile_results: list[object] = []
        self.launchers = [_Launcher(c) for c in configs]
        self.autotune_cache_info = {"autotune_cache_state": state}

    def autotune(self, pick: int) -> None:  # what a first launch does: keep the fastest
        if len(self.launchers) > 1:
            self.launchers = [self.launchers[pick]]


A, B = _Config(8, 64), _Config(8, 128)


def _loaded(monkeypatch, kernel: _Kernel) -> None:  # type: ignore[no-untyped-def]
    mod = types.ModuleType("torch._inductor.codecache.fake")
    mod.triton_red_fused_0 = kernel  # type: ignore[attr-defined]
    monkeypatch.setattr(PyCodeCache, "modules", [mod])
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})


def _record_of_cold(monkeypatch, pick: int) -> kernel_ids.KernelRecord:  # type: ignore[no-untyped-def]
    cold = _Kernel([A, B])
    cold.autotune(pick)
    _loaded(monkeypatch, cold)
    raw = kernel_ids.kernel_record()
    assert raw["triton"] == {"c" * 52: ["triton_red_fused_0", kernel_ids.config_text(
        [A, B][pick])]}, raw
    rec = kernel_ids.parse_record({"precompiled": {kernel_ids.KERNELS_FIELD: raw}})
    assert rec is not None
    return rec


def test_a_warm_kernel_that_missed_the_autotune_cache_launches_the_cold_pick(monkeypatch) -> None:
    """Cold picked B; the warm kernel has both candidates and would pick A (its own timing):
    the pin leaves it only B, so it launches B and the check says the same."""
    rec = _record_of_cold(monkeypatch, pick=1)
    warm = _Kernel([A, B])
    _loaded(monkeypatch, warm)
    assert kernel_ids.census().triton["c" * 52][1] is None  # untuned until its first launch
    assert kernel_ids.pin_kernels(rec) == 1
    warm.autotune(pick=0)  # nothing left to choose
    assert [c.kwargs for c in warm.configs] == [B.kwargs]
    assert [lc.config for lc in warm.launchers] == [B]
    check = kernel_ids.check_against(rec, kernel_ids.census())
    assert check.same and check.pinned == 1, check.line()


def test_without_the_pin_the_other_pick_is_reported(monkeypatch) -> None:
    """The same warm kernel, not pinned, autotunes to A: the check names it, cold B, warm A."""
    rec = _record_of_cold(monkeypatch, pick=1)
    warm = _Kernel([A, B])
    _loaded(monkeypatch, warm)
    warm.autotune(pick=0)
    check = kernel_ids.check_against(rec, kernel_ids.census())
    assert not check.same
    assert check.configs_differ == [("triton_red_fused_0", kernel_ids.config_text(B),
                                     kernel_ids.config_text(A))]


def test_a_pin_never_makes_a_config_the_kernel_lacks(monkeypatch) -> None:
    """A recorded config that is not among the warm kernel's candidates changes nothing (the
    record only selects; it never builds a config), and the check says why."""
    rec = _record_of_cold(monkeypatch, pick=1)
    warm = _Kernel([A, _Config(16, 32)])
    _loaded(monkeypatch, warm)
    assert kernel_ids.pin_kernels(rec) == 0
    assert len(warm.launchers) == 2 and len(warm.configs) == 2
    check = kernel_ids.check_against(rec, kernel_ids.census())
    assert check.not_pinned and "not one of its configs" in check.not_pinned[0]
    warm.autotune(pick=0)
    assert not kernel_ids.check_against(rec, kernel_ids.census()).same


def test_a_kernel_the_cold_run_did_not_have_is_new(monkeypatch) -> None:
    rec = _record_of_cold(monkeypatch, pick=0)
    other = _Kernel([A])
    other.kernel_hash = "d" * 52
    _loaded(monkeypatch, other)
    check = kernel_ids.check_against(rec, kernel_ids.census())
    assert check.new_kernels == ["triton_red_fused_0"] and not check.same


def test_output_code_identity_ignores_only_the_aot_id_line() -> None:
    src = "# AOT ID: ['0_inference']\nimport torch\nkernel = 1\n"
    assert kernel_ids.code_identity(src) == kernel_ids.code_identity(
        src.replace("0_inference", "1_inference"))
    assert kernel_ids.code_identity(src) != kernel_ids.code_identity(src.replace("1", "2"))


def test_golden_format_3_with_a_kernel_record_reads_back() -> None:
    """tests/golden/format3-kernels.surgery.cache: the format3-sources golden with the optional
    KERNELS_FIELD in its precompiled record, signed with bundle_support.KEY; its artifact part
    reads as before."""
    golden = Path(__file__).parent / "golden" / "format3-kernels.surgery.cache"
    meta, blob = bundle.read_bundle(str(golden), key=KEY)
    assert blob is not None
    _, section = bundle_parts.split_blob(meta, blob)
    assert list(bundle_parts.parse_precompiled(meta, section)) == ["g"]
    rec = kernel_ids.parse_record(meta)
    assert rec is not None and rec.code == frozenset({"ab" * 32})
    assert rec.triton == {"cd" * 26: ("triton_red_fused_0", kernel_ids.config_text(B))}


# --- CUDA: real Triton kernels, two fresh processes, the cold one's cache folder gone -----------

CUDA_SRC = '''
import json, os, sys, torch
from torch import nn
from surgery.runtime.apply import apply_manifest
from surgery.runtime.kernel_ids import census, check_kernels

class Block(nn.Module):  # reductions (a norm, a softmax): Triton kernels with several configs
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(1024), nn.Linear(1024, 1024)

    def forward(self, x):
        return x + torch.softmax(self.lin(self.norm(x)), dim=-1)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def build():
    torch.manual_seed(0)
    return Net()

if __name__ == "__main__":
    dev = os.environ.get("KERNEL_DEVICE", "cuda")
    model = build().to(dev).eval()
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)).to(dev)
    warm = sys.argv[1] == "warm"
    with torch.inference_mode():
        h = apply_manifest(model, "net.surgery.toml", cache=True if warm else None,
                           overrides={} if dev == "cuda" else {"on_cpu": "compile"})
        for _ in range(3):
            out = model(x)
    res = {"out": out.float().cpu().tolist()[0][:64], "sum": float(out.double().sum()),
           "census": census().as_dict()}
    if warm:
        res.update(check=check_kernels(h).as_dict(), precompiled=h.report.cache.precompiled,
                   reason=h.report.cache.reason)
    else:
        h.save_cache()
    print(json.dumps(res))
'''


def _process(site: Path, phase: str, cache_dir: Path, device: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton"),
        "KERNEL_DEVICE": device}
    run = subprocess.run([sys.executable, "knet.py", phase], cwd=site, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def kernel_site(tmp_path: Path) -> Path:
    """tmp_path with knet.py and its manifest (one group, both blocks)."""
    import sys

    (tmp_path / "knet.py").write_text(CUDA_SRC)
    sys.path.insert(0, str(tmp_path))
    try:
        knet = importlib.import_module("knet")
        m = Manifest(compute_fingerprint(knet.build().state_dict()),
                     [Region("block", ["blocks.0", "blocks.1"])],
                     compile={**DEFAULT_COMPILE, "on_cpu": "compile"})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("knet", None)
    save_manifest(m, str(tmp_path / "net.surgery.toml"))
    return tmp_path


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_warm_process_runs_the_cold_processs_kernels_and_bits(tmp_path, monkeypatch) -> None:
    """A cold process compiles (inductor, Triton, its own cache folder), runs and saves; its
    cache folder is then deleted (a deployment on another host has none of it); a warm process
    with an empty folder of its own starts from the bundle: it launches the same Triton kernels
    with the same configs (pinned where its autotune cache missed), and its output has the
    cold output's bits."""
    import shutil

    monkeypatch.setenv(ENV_KEY, KEY_HEX)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    site = kernel_site(tmp_path)
    cold = _process(site, "cold", site / "inductor-cold", "cuda")
    shutil.rmtree(site / "inductor-cold")
    warm = _process(site, "warm", site / "inductor-warm", "cuda")
    assert warm["precompiled"] >= 1, warm["reason"]
    assert cold["census"]["triton"] and warm["census"]["triton"], (cold, warm)  # not vacuous
    states = {k["cache"] for k in warm["census"]["triton"].values()}
    assert warm["check"]["recorded"] and warm["check"]["same"], (warm["check"], states)
    assert warm["sum"] == cold["sum"] and warm["out"] == cold["out"], (
        warm["check"], states, cold["census"]["triton"], warm["census"]["triton"])


def test_a_kernel_held_twice_reads_as_the_object_that_launched(monkeypatch, tmp_path) -> None:
    """A kernel's own source module and the graph's module can hold two objects of one kernel
    (one hash); only one launched. The census reads that one, whichever comes first, and a
    module without a graph's ``call`` (a kernel's own) is not output code."""
    launched, idle = _Kernel([A, B]), _Kernel([A, B])
    launched.autotune(1)
    for first, second in ((launched, idle), (idle, launched)):
        kmod, gmod = types.ModuleType("kernel_src"), types.ModuleType("graph")
        (tmp_path / "k.py").write_text("import triton\n")
        kmod.__file__ = gmod.__file__ = str(tmp_path / "k.py")
        kmod.triton_red_fused_0 = first  # type: ignore[attr-defined]
        gmod.triton_red_fused_0 = second  # type: ignore[attr-defined]
        monkeypatch.setattr(PyCodeCache, "modules", [kmod, gmod])
        monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})
        now = kernel_ids.census()
        assert now.triton["c" * 52][1] == kernel_ids.config_text(B)
        assert now.code == {}  # neither module has a graph's call
        gmod.call = lambda args: None  # type: ignore[attr-defined]
        assert len(kernel_ids.census().code) == 1


def test_a_kernel_of_another_shape_never_stops_a_deployment(monkeypatch) -> None:
    """A torch whose kernel objects break the pin's reading (here: a config list that raises):
    nothing raises, the kernel stays as it is, and the check says the pin failed."""
    rec = _record_of_cold(monkeypatch, pick=1)

    class Odd(_Kernel):
        @property
        def compile_results(self):  # type: ignore[no-untyped-def,override]
            raise RuntimeError("another torch")

        @compile_results.setter
        def compile_results(self, v):  # type: ignore[no-untyped-def]
            pass

    odd = Odd([A, B])
    _loaded(monkeypatch, odd)
    assert kernel_ids.pin_kernels(rec) == 0 and len(odd.launchers) == 2
    assert "pinning failed (RuntimeError" in kernel_ids.check_against(
        rec, kernel_ids.census()).not_pinned[0]


def test_one_kernel_launched_with_two_configs_in_the_cold_run_is_never_the_same(
        monkeypatch, tmp_path) -> None:
    """The H200's Flux (ninth session): one kernel source, held by two graphs' objects,
    launched R0_BLOCK 64 in one graph and 128 in the other in one cold process. The record
    keeps both configs (``split``), a warm process that launches either one everywhere is not
    "the same", and the pin leaves such a kernel alone (it cannot know which graph ran which)."""
    g1, g2 = _Kernel([A, B]), _Kernel([A, B])
    g1.autotune(0)
    g2.autotune(1)
    m1, m2 = types.ModuleType("graph1"), types.ModuleType("graph2")
    m1.triton_red_fused_0, m2.triton_red_fused_0 = g1, g2  # type: ignore[attr-defined]
    monkeypatch.setattr(PyCodeCache, "modules", [m1, m2])
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})
    raw = kernel_ids.kernel_record()
    assert raw["split"] == {"c" * 52: sorted([kernel_ids.config_text(A),
                                              kernel_ids.config_text(B)])}
    rec = kernel_ids.parse_record({"precompiled": {kernel_ids.KERNELS_FIELD: raw}})
    assert rec is not None and rec.split
    warm = _Kernel([A, B])
    _loaded(monkeypatch, warm)
    assert kernel_ids.pin_kernels(rec) == 0
    assert "launched 2 configs" in next(iter(rec.not_pinned.values()))
    warm.autotune(1)  # the record's one pick per hash (B) matches, yet graph 1 ran A
    check = kernel_ids.check_against(rec, kernel_ids.census())
    assert not check.configs_differ and check.cold_split == ["triton_red_fused_0"]
    assert not check.same and "several configs in the cold run 1" in check.line()


def test_a_record_without_split_reads_as_before_and_a_bad_split_is_refused() -> None:
    base = {"format": kernel_ids.KERNELS_FORMAT, "code": [], "triton": {}}
    rec = kernel_ids.parse_record({"precompiled": {kernel_ids.KERNELS_FIELD: base}})
    assert rec is not None and rec.split == {}
    for bad in ({"h": ["only one"]}, {"h": "x"}, ["h"], {"h": ["a"] * 17}):
        with pytest.raises(kernel_ids.KernelRecordError):
            kernel_ids.parse_record({"precompiled": {kernel_ids.KERNELS_FIELD:
                                                     {**base, "split": bad}}})


# --- the R-block halving race is off by default on CUDA ----------------------------------------

def test_cuda_regions_compile_without_the_rblock_race_unless_the_manifest_asks() -> None:
    """Inductor's first-launch pick between a reduction kernel and its halved R-block copy is
    stored by no cache, so a warm start could launch other kernels than its cold start (Flux on
    the H200: 7.8e-3 apart). On CUDA every inductor region compiles with it off; a manifest may
    turn it back on (a boolean on the allowlist), and on the CPU, where there is no Triton
    kernel, nothing is patched."""
    from surgery.formats.manifest import parse_manifest
    from surgery.runtime.compile_options import SCALE_RBLOCK, plan_region

    if not hasattr(torch._inductor.config, SCALE_RBLOCK):
        pytest.skip(f"this torch's inductor has no {SCALE_RBLOCK}")
    m = Manifest(compute_fingerprint(torch.nn.Linear(2, 2).state_dict()),
                 [Region("block", ["blocks.0"])], compile=dict(DEFAULT_COMPILE))
    on = plan_region(m, m.regions[0], overrides=None, on_cuda=True)
    assert on.config_patches is not None and on.config_patches[SCALE_RBLOCK] is False
    assert on.options["inductor_config"][SCALE_RBLOCK] is False  # the report shows it
    off = plan_region(m, m.regions[0], overrides=None, on_cuda=False)
    assert SCALE_RBLOCK not in (off.config_patches or {})
    # A mode's patches get it too (a mode cannot sit beside options in a manifest).
    moded = plan_region(m, m.regions[0], overrides={"mode": "max-autotune-no-cudagraphs"},
                        on_cuda=True)
    assert moded.config_patches is not None and moded.config_patches[SCALE_RBLOCK] is False
    # The manifest's own choice wins, through the reader's allowlist; a default one (as
    # `surgery plan` writes it) does not carry the option at all.
    data = m.to_dict()
    assert SCALE_RBLOCK not in data["compile"].get("options", {})
    data["compile"] = {**data["compile"], "options": {SCALE_RBLOCK: True}}
    import tomli_w

    back = parse_manifest(tomli_w.dumps(data), path="m.toml")
    kept = plan_region(back, back.regions[0], overrides=None, on_cuda=True)
    assert kept.config_patches is not None and kept.config_patches[SCALE_RBLOCK] is True
    # From code, too.
    code = plan_region(m, m.regions[0], overrides={"options": {SCALE_RBLOCK: True}},
                       on_cuda=True)
    assert code.config_patches is not None and code.config_patches[SCALE_RBLOCK] is True


class _Norms(torch.nn.Module):
    """Reductions too long for one block (16384 wide): non-persistent, the kind inductor halves."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(x), dim=-1) * x.sum(-1, keepdim=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("asked", [False, True], ids=["default", "manifest-asks"])
def test_cuda_reduction_kernels_carry_the_choice(asked) -> None:
    """The Triton reduction kernels of a compiled region carry dynamic_scale_rblock=False in
    their inductor meta (what the runtime reads at the first launch), unless the manifest asks
    for the race back. Fails without the default: inductor's own default is True."""
    from surgery.runtime.compile_options import SCALE_RBLOCK

    if not hasattr(torch._inductor.config, SCALE_RBLOCK):
        pytest.skip(f"this torch's inductor has no {SCALE_RBLOCK}")
    model = torch.nn.Sequential(_Norms()).cuda().eval()
    compile_ = {**DEFAULT_COMPILE, "capture": "compiler"}
    if asked:
        compile_["options"] = {SCALE_RBLOCK: True}
    m = Manifest(compute_fingerprint(model.state_dict()), [Region("norms", ["0"])],
                 compile=compile_)
    x = torch.randn(64, 16384, device="cuda")
    with torch.no_grad():
        ref = model(x)
    before = {id(mod) for mod in kernel_ids._modules()}
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        h = apply_manifest(model, m, warmup=lambda mod: mod(x), passes=1)
        out = model(x)
    try:
        assert h.report[0].status == "compiled", h.report.summary()
        new = [mod for mod in kernel_ids._modules() if id(mod) not in before]
        reductions = [k for _, k in kernel_ids._autotuners(new)
                      if k.inductor_meta.get("persistent_reduction") is not True
                      and "red" in k.inductor_meta.get("kernel_name", "")]
        assert reductions, "no non-persistent reduction kernel was compiled: the test is vacuous"
        seen = {k.inductor_meta.get(SCALE_RBLOCK, True) for k in reductions}
        assert seen == {asked}, seen
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    finally:
        h.restore()
