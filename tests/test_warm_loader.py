"""A warm start's one-time costs (surgery.runtime.warm_loader) and what it no longer imports.

The keys are hashed, and the loader's native build runs, in threads beside the imports, waited
for before the first artifact; kernels load on CUDA
without inductor's compile pool; the manifest's backend is checked without importing every
dynamo backend; a group whose calls all run precompiled code never makes its dynamo callable;
mark_step imports no cudagraph trees before any exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch._inductor import codecache
from torch._inductor import config as inductor_config
from torch._inductor.runtime import triton_compat

from surgery.errors import RegionError
from surgery.formats.manifest import Manifest, Region, load_schema
from surgery.runtime import compile_options, groups, load_timing, precompiled, warm_loader
from surgery.runtime.warm_loader import KeyPrefetch, serial_kernel_loads

MODES = {"grad": False, "inference": False, "autocast": []}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_keys(monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[tuple[str, str]]:
    """Replace both key functions with recorders: [(key, thread name)] as they are called."""
    calls: list[tuple[str, str]] = []

    def fake(name: str):  # type: ignore[no-untyped-def]
        def key() -> str:
            time.sleep(delay)
            calls.append((name, threading.current_thread().name))
            return name
        return key

    monkeypatch.setattr(codecache, "torch_key", fake("torch_key"))
    monkeypatch.setattr(triton_compat, "triton_key", fake("triton_key"))
    monkeypatch.setattr(triton_compat, "HAS_TRITON", True)
    return calls


def _fake_builds(monkeypatch: pytest.MonkeyPatch, delay: float = 0.0, fail_first: bool = False
                 ) -> list[tuple[str, str, float]]:
    """Replace both native builds (Triton's driver, the CPU's ISA probe) with recorders:
    [(build, thread name, when it started)] as they are called; the first call takes ``delay``
    (later ones are free, as torch's and triton's cached answers are); ``fail_first``: the first
    call raises, as a build that fails in its thread would."""
    calls: list[tuple[str, str, float]] = []

    def fake(name: str):  # type: ignore[no-untyped-def]
        def build() -> str:
            calls.append((name, threading.current_thread().name, time.perf_counter()))
            time.sleep(delay if len(calls) == 1 else 0.0)
            if fail_first and len(calls) == 1:
                raise RuntimeError("no compiler")
            return name
        return build

    monkeypatch.setattr(warm_loader, "_triton_utils", fake("triton_driver"))
    monkeypatch.setattr(warm_loader, "_cpu_isa", fake("cpu_isa_probe"))
    return calls


def test_keys_are_computed_in_a_thread_on_cuda_and_not_at_all_on_the_cpu(monkeypatch) -> None:
    calls = _fake_keys(monkeypatch)
    _fake_builds(monkeypatch)
    assert KeyPrefetch.start("cpu").names == []
    assert calls == []  # the CPU's load needs neither key
    pre = KeyPrefetch.start("cuda:0")
    assert pre.names == ["torch_key", "triton_key"]
    pre.wait()
    assert calls == [("torch_key", "surgery-key-prefetch"),
                     ("triton_key", "surgery-key-prefetch")]
    assert set(pre.summary()["keys"]) == {"torch_key", "triton_key"}


def test_a_failing_key_is_left_to_the_loader(monkeypatch) -> None:
    def broken() -> str:
        raise OSError("no such file")

    monkeypatch.setattr(codecache, "torch_key", broken)
    pre = KeyPrefetch.start("cuda")
    pre.wait()  # nothing escapes the thread
    assert "OSError" in pre.summary()["failed"]["torch_key"]


def test_the_loader_set_up_waits_for_the_keys(monkeypatch) -> None:
    """No artifact loads while a key is still being hashed: on a torch whose key cache is a
    plain functools.cache, the loader would compute it a second time."""
    monkeypatch.setattr(load_timing, "LOADER_MODULES", ())
    monkeypatch.setattr(load_timing, "CUDA_LOADER_MODULES", ())
    _fake_builds(monkeypatch)
    _fake_keys(monkeypatch, delay=1.0)
    pre = KeyPrefetch.start("cuda")
    setup = load_timing.prepare_loader("cuda", pre)
    assert pre.thread is not None and not pre.thread.is_alive(), setup.steps
    assert setup.steps["keys_wait"] > 0.5, setup.steps
    assert set(setup.keys["keys"]) == {"torch_key", "triton_key"}


@pytest.mark.parametrize("device, build", [pytest.param("cpu", "cpu_isa_probe", id="cpu"),
                                           pytest.param("cuda", "triton_driver", id="triton")])
def test_the_native_build_starts_beside_the_imports_and_the_set_up_waits_for_it(
        monkeypatch, device: str, build: str) -> None:
    """The set-up's native build (the CPU's ISA probe, Triton's driver on CUDA) runs in the
    prefetch thread, started before the loader's imports; the set-up's step waits for it and
    then asks the cached result again on its own thread (free once built)."""
    slow_imports = 0.5
    monkeypatch.setattr(load_timing, "LOADER_MODULES", ())
    monkeypatch.setattr(load_timing, "CUDA_LOADER_MODULES", ())
    monkeypatch.setattr(load_timing, "serial_kernel_loads",  # the imports' stand-in: 0.5 s
                        lambda device: _sleeping(slow_imports))
    _fake_keys(monkeypatch)
    calls = _fake_builds(monkeypatch, delay=1.0)
    pre = KeyPrefetch.start(device, build=True)
    called = time.perf_counter()
    setup = load_timing.prepare_loader(device, pre)
    assert [(n, who) for n, who, _ in calls] == [(build, "surgery-build-prefetch"),
                                                 (build, "MainThread")], calls
    assert calls[0][2] < called  # started before the set-up, so it overlaps the imports
    assert calls[1][2] >= calls[0][2] + 1.0  # asked again only once the thread's build ended
    assert setup.steps["imports"] >= slow_imports
    assert setup.steps[build] < 1.0 - slow_imports + 0.3, setup.steps  # the rest of the build
    assert setup.seconds < 1.0 + slow_imports, setup.steps  # not one after the other
    assert setup.keys["build"][build] >= 1.0 and "failed" not in setup.keys


def test_the_build_thread_starts_by_default_on_cuda_only(monkeypatch) -> None:
    """On the 2-core CPU the ISA probe's thread made the set-up slower (RESULTS.md, y23b): the
    CPU runs it after the imports, on the caller's thread, unless asked; CUDA starts it."""
    _fake_keys(monkeypatch)
    monkeypatch.setattr(load_timing, "LOADER_MODULES", ())
    monkeypatch.setattr(load_timing, "CUDA_LOADER_MODULES", ())
    calls = _fake_builds(monkeypatch)
    cpu = KeyPrefetch.start("cpu")
    assert cpu.build_thread is None and cpu.build == ""
    load_timing.prepare_loader("cpu", cpu)
    cuda = KeyPrefetch.start("cuda")
    cuda.wait_build()
    assert [(n, who) for n, who, _ in calls] == [("cpu_isa_probe", "MainThread"),
                                                 ("triton_driver", "surgery-build-prefetch")]


def test_a_native_build_that_fails_in_its_thread_runs_in_the_set_up(monkeypatch) -> None:
    _fake_keys(monkeypatch)
    monkeypatch.setattr(load_timing, "LOADER_MODULES", ())
    calls = _fake_builds(monkeypatch, fail_first=True)
    pre = KeyPrefetch.start("cpu", build=True)
    setup = load_timing.prepare_loader("cpu", pre)
    assert [(n, who) for n, who, _ in calls] == [("cpu_isa_probe", "surgery-build-prefetch"),
                                                 ("cpu_isa_probe", "MainThread")]
    assert "RuntimeError: no compiler" in setup.keys["failed"]["cpu_isa_probe"]


_BUILD_ALONE = """
    import json, sys
    import torch
    import surgery.runtime.apply
    from surgery.runtime.warm_loader import KeyPrefetch
    device = sys.argv[1]
    if device == "cuda":
        torch.cuda.init()
    pre = KeyPrefetch.start(device, build=True)
    started = set(sys.modules)
    pre.wait_build()
    if device == "cuda":
        from triton.runtime import driver
        made = vars(driver)  # triton 3.6+: _default; older: a LazyProxy's _obj
        cached = int(made.get("_default") is not None
                     or getattr(made.get("default"), "_obj", None) is not None)
    else:
        from torch._inductor import cpu_vec_isa
        cached = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
    print(json.dumps({"new": sorted(set(sys.modules) - started), "summary": pre.summary(),
                      "cached": cached}))
"""


def _build_alone(device: str) -> dict:
    """A fresh interpreter, empty inductor and Triton caches: the prefetch's native build alone,
    with the modules it imported in its thread and whether torch's or triton's cache holds it."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
               "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, "-c", textwrap.dedent(_BUILD_ALONE), device],
                             env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_cpu_build_thread_imports_no_module_and_fills_torchs_cache() -> None:
    """The real ISA probe, run in the prefetch thread, imports nothing (its modules came first,
    on the caller's thread: two threads importing torch's circular modules at once can deadlock
    in the import lock), and leaves torch's cached answer that the loader's own call reads."""
    got = _build_alone("cpu")
    assert got["new"] == [], got["new"][:20]
    assert "failed" not in got["summary"] and got["summary"]["build"]["cpu_isa_probe"] > 0
    assert got["cached"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_build_thread_imports_no_module_and_leaves_tritons_driver() -> None:
    """The same on CUDA: Triton's driver utilities, built in the thread, import no module of
    torch or triton there (CUDA_BUILD_MODULES came first) and leave Triton's driver made. The
    build's own product, the extension ``cuda_utils`` it loads (the H200 showed it, session 8
    call 3), and a leaf of the standard library it reads lazily cannot close an import cycle."""
    got = _build_alone("cuda")
    ours = [m for m in got["new"] if m.partition(".")[0] in ("torch", "triton", "surgery")]
    assert ours == [], got["new"][:20]
    assert "failed" not in got["summary"], got["summary"]
    assert got["summary"]["build"]["triton_driver"] > 0 and got["cached"] == 1


@pytest.mark.parametrize("admit, runners, starts", [
    pytest.param(True, {}, True, id="artifacts"),
    pytest.param(True, {"group": {"sig": object()}}, False, id="runners-for-all"),
    pytest.param(False, {}, False, id="refused"),
])
def test_the_prefetch_starts_once_the_bundle_is_admitted_before_its_mega_cache_load(
        monkeypatch, admit: bool, runners: dict, starts: bool) -> None:
    """The keys and the native build start right after the bundle's checks passed, so they run
    beside the Mega-Cache load too; never for a bundle that failed a check (nothing of it is
    trusted), nor when runners replace every artifact (they need neither)."""
    from surgery.runtime import cache

    order: list[str] = []
    artifacts = {"group": {"sig": (b"x", MODES, [])}}
    monkeypatch.setattr(cache, "_admit", lambda *a, **k: (
        ((b"", artifacts, runners, None), "") if admit else (None, "forged: bad MAC")))
    monkeypatch.setattr(cache, "load_megacache",
                        lambda path, blob: (order.append("mega-cache"), ("", {}))[1])
    monkeypatch.setattr(KeyPrefetch, "start", classmethod(
        lambda cls, device: (order.append("prefetch"), cls([], None))[1]))
    m = Manifest("v2:sha256:" + "0" * 64, [Region("block", ["a"])])
    with pytest.warns(Warning) if not admit else contextlib.nullcontext():
        record, pre = precompiled.load_for_apply("x.surgery.cache", manifest=m, overrides={},
                                                 device="cpu", notes=[])
    assert record.loaded is admit
    assert ("prefetch" in order) is starts, order
    if starts:
        assert order == ["prefetch", "mega-cache"]
    assert (pre is not None and pre.keys is not None) is starts


@contextlib.contextmanager
def _sleeping(seconds: float) -> Iterator[None]:
    time.sleep(seconds)
    yield


def test_kernels_load_without_a_compile_pool_on_cuda_only(monkeypatch) -> None:
    """An artifact's kernels are loaded with compile_threads 1 on CUDA (no pool is started for
    them), and with the configured threads on the CPU, whose C++ kernels build at load."""
    seen: list[int | None] = []

    def load(data: bytes, target: object) -> object:
        seen.append(inductor_config.compile_threads)
        return object()

    monkeypatch.setattr(precompiled, "_load_function", load)
    # inductor's config, patched its own way (monkeypatch's undo deletes a config key)
    with inductor_config.patch(compile_threads=8):
        for device in ("cuda", "cpu"):
            pre = precompiled.Loaded({"group": {"sig": (b"x", MODES, [])}}, device=device)
            assert list(pre.take("group", test_kernels_load_without_a_compile_pool_on_cuda_only))
        assert seen == [1, 8]
        assert inductor_config.compile_threads == 8  # put back
        with serial_kernel_loads("cuda"):
            assert inductor_config.compile_threads == 1


def test_manifest_backends_are_checked_without_listing_every_dynamo_backend(monkeypatch) -> None:
    """torch's list imports every backend module; a manifest's backend is one of the schema's
    fixed set, all registered by torch itself, so the list is asked only for other names."""
    enum = load_schema()["$defs"]["compile"]["properties"]["backend"]["enum"]
    assert sorted(compile_options.TORCH_BACKENDS) == sorted(enum)
    assert set(compile_options.TORCH_BACKENDS) <= set(torch._dynamo.list_backends(()))
    asked: list[int] = []
    real = torch._dynamo.list_backends

    def counting(*args: object, **kwargs: object) -> list[str]:
        asked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch._dynamo, "list_backends", counting)
    m = Manifest("v2:sha256:" + "0" * 64, [Region("block", ["a"])])
    for backend in compile_options.TORCH_BACKENDS:
        compile_options.plan_region(m, m.regions[0], overrides={"backend": backend},
                                    on_cuda=False)
    assert asked == []
    with pytest.raises(RegionError, match=r"not a torch\.compile backend"):
        compile_options.plan_region(m, m.regions[0], overrides={"backend": "no_such_backend"},
                                    on_cuda=False)
    assert asked == [1]


def test_the_module_doc_names_what_it_changes() -> None:
    doc = warm_loader.__doc__ or ""
    assert "compile_threads" in doc and "torch_key" in doc
    assert json.dumps(KeyPrefetch([], None).summary())  # a report can carry it


def test_mark_step_imports_no_cudagraph_trees_until_some_exist() -> None:
    """A fresh interpreter: surgery's mark_step before any cudagraph tree leaves inductor's
    cudagraph_trees unimported (0.2 s of a warm start's first frame, for a counter nothing
    reads); once the module is imported, each call moves torch's step counter as before."""
    code = textwrap.dedent("""
        import sys
        from surgery.runtime.apply import mark_step
        mark_step()
        print("imported" if "torch._inductor.cudagraph_trees" in sys.modules else "not imported")
        from torch._inductor import cudagraph_trees
        before = cudagraph_trees.MarkStepBox.mark_step_counter
        mark_step()
        print(before - cudagraph_trees.MarkStepBox.mark_step_counter)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["not", "imported", "1"], run.stdout


def test_a_group_makes_its_dynamo_callable_once_on_first_use(monkeypatch) -> None:
    """Made on first use, not at install; two threads' first calls make one (two would be two
    code objects, so dynamo would compile the same graph twice)."""
    made: list[int] = []
    real = torch.compile

    def slow_compile(*args: object, **kwargs: object) -> object:
        made.append(1)
        time.sleep(0.2)
        return real(*args, **kwargs)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    monkeypatch.setattr(torch, "compile", slow_compile)
    group = groups._Group.create(forward, bound=False, backend="eager", config_patches=None,
                                 fullgraph=True, dynamic=False)
    assert made == [] and group.compiled_fn is None
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(group.compiled)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [1] and got[0] is got[1] is group.compiled_fn


def test_a_region_is_planned_once_not_once_per_path(monkeypatch) -> None:
    """Each plan checks the region's tables and copies inductor's config: 0.21 s for the SDPA
    example's 80 paths on the H200. An apply plans each region once."""
    from torch import nn

    from surgery.formats.fingerprint import compute_fingerprint
    from surgery.runtime.apply import apply_manifest

    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    m = Manifest(compute_fingerprint(model.state_dict()),
                 [Region("linear", ["0", "1", "2"], compile={"backend": "eager"})])
    calls: list[str] = []
    real = compile_options.plan_region

    def counting(manifest: Manifest, region: Region, **kwargs: object) -> object:
        calls.append(region.kind)
        return real(manifest, region, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compile_options, "plan_region", counting)
    with apply_manifest(model, m, overrides={"on_cpu": "compile"}) as handle:
        assert [r.status for r in handle.report] == ["pending"] * 3
        assert len({id(r.options) for r in handle.report}) == 3  # each record its own copy
    assert calls == ["linear"]
