"""Precompiled bundles (format 3): region code that runs without dynamo, and what is refused.

One test compiles with inductor on the CPU, in two fresh processes (`surgery warm --step`, then
a deployment with an empty TORCHINDUCTOR_CACHE_DIR): the proof that the deploying process traces
no frame at all (torch's dynamo counters) and matches eager. The others use backend aot_eager,
which torch's AOT path serialises too and which needs no code generation.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from bundle_support import EMPTY_BLOB, KEY, TWO_BLOCKS_SRC, signed_site
from click.testing import CliRunner
from torch._dynamo.utils import counters

from surgery.cli import cli
from surgery.formats.manifest import load_manifest
from surgery.runtime import bundle, bundle_parts, cache, call_example, precompiled
from surgery.runtime.apply import apply_manifest
from surgery.runtime.report import CacheIgnoredWarning, SurgeryWarning

AOT = {"backend": "aot_eager", "on_cpu": "compile"}
MODES = {"grad": False, "inference": False, "autocast": []}
ATTACKER_KEY = bytes(range(32))
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = Path(HERE) / "tests" / "golden"

# Two identical blocks (one compiled group) and a STEP, as `plan --input` and `warm --step` take.
MODEL_SRC = TWO_BLOCKS_SRC + textwrap.dedent('''
    X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def step(model):
        with torch.no_grad():
            return model(X)

    def step_inference(model):  # X is a normal tensor, the blocks' outputs inference tensors
        with torch.inference_mode():
            return model(X)

    def example(model):
        return X
''')

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """tmp_path holding premod.py and net.surgery.toml (inductor on the CPU); cwd there."""
    return signed_site(tmp_path, monkeypatch, "premod", MODEL_SRC)


def _pythonpath(site: Path) -> str:
    """The site and the repo first, then the caller's entries (on the GPU machine jsonschema
    and tomli-w come from one of them)."""
    return os.pathsep.join([str(site), HERE, os.environ.get("PYTHONPATH", "")])


def _premod():  # type: ignore[no-untyped-def]
    import premod  # type: ignore[import-not-found]

    return importlib.reload(premod)


def _frames() -> int:
    """Frames dynamo traced and graphs it captured (torch's AOT path counts only the second)."""
    return int(sum(counters["frames"].values()) + counters["stats"]["unique_graphs"] +
               counters["stats"]["calls_captured"])


def _save(site: Path, step: str = "step") -> dict:
    """Apply with aot_eager, warm up, save the bundle beside the manifest; its metadata."""
    mod = _premod()
    model = mod.build().eval()
    with torch.no_grad():
        handle = apply_manifest(model, "net.surgery.toml", warmup=getattr(mod, step),
                                overrides=AOT, passes=2)
    saved = handle.save_cache()
    handle.restore()
    torch._dynamo.reset()  # what a fresh process starts from: no compiled frame, no counter
    counters.clear()
    return saved.metadata


def _deploy(site: Path, *, passes: int = 1, step: str = "step"
            ) -> tuple[list[str], object, torch.Tensor]:
    """A new model from the bundle: (our warnings, report, the difference from eager)."""
    mod = _premod()
    model = mod.build().eval()
    want = model(mod.X)
    run = getattr(mod, step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            handle = apply_manifest(model, "net.surgery.toml", warmup=run, overrides=AOT,
                                    cache=True, passes=passes)
            got = run(model)
    handle.restore()
    mine = [w for w in caught if issubclass(w.category, SurgeryWarning)]
    assert all(issubclass(w.category, CacheIgnoredWarning) for w in mine), mine
    return [str(w.message) for w in mine], handle.report, (got - want).abs().max()


# --- the proof: a fresh process traces nothing -------------------------------------------------

DEPLOY_SRC = textwrap.dedent('''
    import json, torch, premod
    from torch._dynamo.utils import counters
    from surgery.runtime.apply import apply_manifest
    model = premod.build().eval()
    want = model(premod.X)
    with torch.no_grad():
        h = apply_manifest(model, "net.surgery.toml", warmup=premod.step, cache=True, passes=1)
        got = premod.step(model)
    result = {
        "frames": sum(counters["frames"].values()), "graphs": counters["stats"]["unique_graphs"]
        + counters["stats"]["calls_captured"],
        "precompiled": h.report.cache.precompiled, "reason": h.report.cache.reason,
        "records": [[r.status, r.precompiled_runs, r.compiles] for r in h.report.records],
        "same": torch.equal(got, want), "close": torch.allclose(got, want, atol=1e-5)}
    h.restore()
    # The same regions compiled by dynamo, as a cold start does (the code is generated again
    # here: nothing of the bundle is used): the same kernels, so the same bits.
    torch._dynamo.reset()
    with torch.no_grad():
        h = apply_manifest(model, "net.surgery.toml", warmup=premod.step, passes=1)
        cold = premod.step(model)
    result["cold_compiles"] = sum(r.compiles for r in h.report.records)
    result["same_as_cold"] = torch.equal(got, cold)
    print(json.dumps(result))
''')


@pytest.mark.slow
def test_fresh_process_runs_the_precompiled_bundle_with_no_dynamo_frame(site) -> None:
    """`surgery warm --step` (inductor, its own cache dir) writes a format-3 bundle; a fresh
    process with an empty cache dir and that bundle traces 0 frames, compiles 0 graphs, runs
    every region compiled, matches eager, and is bit-identical to the same regions compiled
    by dynamo there (a cold start's code: the artifact is not a different graph)."""
    (site / "deploy.py").write_text(DEPLOY_SRC)
    env = {**os.environ, "PYTHONPATH": _pythonpath(site),
           "TORCHINDUCTOR_CACHE_DIR": str(site / "inductor-warm")}
    warm = subprocess.run(
        [sys.executable, "-m", "surgery", "warm", "--model", "premod:build", "--manifest",
         "net.surgery.toml", "--step", "premod:step", "--steps", "2", "--device", "cpu",
         "--json"], cwd=site, env=env, capture_output=True, text=True, timeout=400)
    assert warm.returncode == 0, warm.stderr[-3000:]
    made = json.loads(warm.stdout)
    assert made["metadata"]["format"] == bundle_parts.FORMAT_PRECOMPILED
    entries = made["metadata"]["precompiled"]["entries"]
    assert len(entries) == 1, made["metadata"]["precompiled"]  # two blocks, one group
    assert "Block.forward" in entries[0]["group"]

    env["TORCHINDUCTOR_CACHE_DIR"] = str(site / "inductor-deploy")  # empty: nothing to hit
    run = subprocess.run([sys.executable, "deploy.py"], cwd=site, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["precompiled"] == 1, got["reason"]
    assert got["frames"] == 0 and got["graphs"] == 0, got  # dynamo traced nothing
    assert got["records"] == [["compiled", 2, 0], ["compiled", 2, 0]], got
    assert got["close"], got
    assert got["cold_compiles"] >= 1 and got["same_as_cold"], got  # bit-identical to cold
    assert "CacheIgnoredWarning" not in run.stderr


@pytest.mark.parametrize(("step", "entries"), [
    pytest.param("step", 1, id="no_grad"),
    # block 0 sees the normal X, block 1 an inference tensor: two signatures, two artifacts
    pytest.param("step_inference", 2, id="inference_mode"),
])
def test_precompiled_code_runs_without_dynamo_and_matches_eager(site, step, entries) -> None:
    meta = _save(site, step)
    assert meta["format"] == bundle_parts.FORMAT_PRECOMPILED
    assert bundle_parts.count_entries(meta) == entries
    seen = bundle.check_beside(load_manifest("net.surgery.toml"))  # what `surgery verify` notes
    assert seen is not None and seen.state == "fits", seen
    assert f"{entries} precompiled region artifact(s)" in seen.reason
    ours, report, diff = _deploy(site, step=step)
    assert ours == []
    assert _frames() == 0
    assert report.cache.precompiled == entries and report.cache.precompiled_unused == 0  # type: ignore[attr-defined]
    assert [(r.status, r.precompiled_runs, r.compiles) for r in report.records] == \
        [("compiled", 2, 0), ("compiled", 2, 0)]  # type: ignore[attr-defined]
    assert diff == 0  # aot_eager runs the same ops as eager


def test_the_load_is_broken_down_per_artifact_after_a_one_time_setup(site) -> None:
    """The loader's imports run once, on their own clock, before the first artifact; each
    artifact then has its own seconds and torch's phases, under its group."""
    _save(site, "step_inference")  # two signatures: two artifacts in one group
    mod = _premod()
    model = mod.build().eval()
    with torch.no_grad():
        handle = apply_manifest(model, "net.surgery.toml", warmup=mod.step_inference,
                                overrides=AOT, cache=True, passes=1)
    handle.restore()
    loaded = handle.precompiled
    assert loaded is not None and "imports" in loaded.setup.steps
    (group,) = precompiled.group_breakdown(handle.groups, loaded)
    arts = group["artifacts"]
    assert [(a["group"], a["signature"]) for a in arts] == [("Block.forward", 0),
                                                             ("Block.forward", 1)]
    assert all(a["seconds"] > 0 for a in arts)
    # each figure is rounded to the millisecond
    assert group["load_s"] >= sum(a["seconds"] for a in arts) - 1e-3 * (len(arts) + 1)


def test_an_artifact_that_does_not_load_back_is_not_written(site, monkeypatch) -> None:
    """Each artifact is loaded once where it is built: one torch cannot load (here, a loader
    that raises) is left to the Mega-Cache part with a note, never written to fail later."""
    def refuse(data, target):  # type: ignore[no-untyped-def]
        raise RuntimeError("cannot rebuild a guard")

    monkeypatch.setattr(precompiled, "_load_function", refuse)
    meta = _save(site)
    record = meta[bundle_parts.PRECOMPILED_KEY]
    assert record["entries"] == []
    assert any("cannot rebuild a guard" in n for n in record["notes"]), record["notes"]


def test_a_call_outside_the_artifacts_guards_compiles_with_dynamo(site) -> None:
    """A new signature has no artifact: dynamo compiles it, as without a bundle. Until then
    the group has not even made its torch.compile-d callable (whose first call imports dynamo's
    backend wrappers, which precompiled code does not use)."""
    _save(site)
    mod = _premod()
    model = mod.build().eval()
    x = torch.randn(7, 16)
    with torch.no_grad():
        handle = apply_manifest(model, "net.surgery.toml", warmup=mod.step, overrides=AOT,
                                cache=True, passes=1)
        assert _frames() == 0
        assert [g.compiled_fn for g in handle.groups] == [None]
        got = model(x)
        assert _frames() > 0 and handle.report.records[0].compiles == 1
        assert handle.groups[0].compiled_fn is not None
        handle.restore()
        torch.testing.assert_close(got, model(x))


def test_old_bundle_without_precompiled_part_still_loads(site) -> None:
    """--no-precompile (or a torch without the AOT path) writes format 2, read as before."""
    mod = _premod()
    model = mod.build().eval()
    with torch.no_grad():
        handle = apply_manifest(model, "net.surgery.toml", warmup=mod.step, overrides=AOT,
                                passes=2)
    saved = handle.save_cache(precompile=False)
    handle.restore()
    torch._dynamo.reset()
    counters.clear()
    assert saved.metadata["format"] == bundle.FORMAT_VERSION
    ours, report, _ = _deploy(site)
    assert ours == [] and report.cache.loaded and report.cache.precompiled == 0  # type: ignore[attr-defined]
    assert _frames() > 0  # the Mega-Cache part still has dynamo trace


# --- stale and forged ---------------------------------------------------------------------------

def test_stale_code_is_ignored_with_one_warning(site) -> None:
    """The block's code changed since the bundle was built (same weights, same manifest): its
    artifact matches no group, so dynamo compiles the new code, and one warning says why."""
    _save(site)
    (site / "premod.py").write_text(MODEL_SRC.replace("gelu", "silu"))
    ours, report, diff = _deploy(site)
    assert len(ours) == 1 and "match no region group" in ours[0], ours
    assert report.cache.precompiled == 0 and report.cache.precompiled_unused == 1  # type: ignore[attr-defined]
    assert _frames() > 0 and diff == 0  # the new code ran, compiled by dynamo


class _Touch:
    """A pickle that creates ``path`` when it is loaded: the payload of a forged artifact."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _forge(site: Path, meta: dict, *, key: bytes) -> Path:
    """The genuine record, its one artifact replaced by a payload, signed with ``key``."""
    marker = site / "PWNED"
    payload = pickle.dumps(_Touch(marker))
    entry = meta["precompiled"]["entries"][0]
    meta = {**meta, "precompiled": {**meta["precompiled"], "bytes": len(payload),
                                    "entries": [{**entry, "offset": 0, "bytes": len(payload)}]}}
    bundle.write_bundle(str(site / "net.surgery.cache"), EMPTY_BLOB + payload, meta, key=key)
    return marker


def test_forged_precompiled_artifact_never_reaches_torch(site) -> None:
    """An attacker who knows the layout and the record, without the key: ignored, with one
    warning, and its pickle never runs."""
    marker = _forge(site, _save(site), key=ATTACKER_KEY)
    ours, report, diff = _deploy(site)
    assert len(ours) == 1 and "signature does not verify" in ours[0], ours
    assert not marker.exists(), "a forged artifact was unpickled"
    assert report.cache.loaded is False and diff == 0  # type: ignore[attr-defined]


def test_control_a_signed_payload_is_unpickled(site) -> None:
    """The control for the test above: signed with the deployer's key, the same payload does
    reach torch's loader (so that test would catch a skipped signature check)."""
    marker = _forge(site, _save(site), key=KEY)
    ours, _, diff = _deploy(site)
    assert marker.exists()
    assert len(ours) == 1 and "torch could not load one" in ours[0], ours
    assert diff == 0  # it was not a compiled function: the group compiled with dynamo


@pytest.mark.parametrize("damage", [
    pytest.param({"bytes": 5}, id="length-differs"),
    pytest.param({"format": 99}, id="record-format"),
    pytest.param({"entries": "x"}, id="entries-not-a-list"),
    pytest.param({"entries": [{"group": "g", "signature": "s", "modes": MODES, "offset": 0}]},
                 id="no-length"),
    pytest.param({"entries": [{"group": "g", "signature": "s", "modes": MODES, "offset": 1,
                               "bytes": 3}]}, id="gap"),
    pytest.param({"entries": [{"group": 1, "signature": "s", "modes": MODES, "offset": 0,
                               "bytes": 4}]}, id="group-not-text"),
    pytest.param({"entries": [{"group": "g", "signature": "s", "offset": 0, "bytes": 4,
                               "modes": {**MODES, "autocast": [["cpu", "__class__"]]}}]},
                 id="autocast-dtype-not-listed"),
    pytest.param({"entries": [{"group": "g", "signature": "s", "offset": 0, "bytes": 4,
                               "modes": {**MODES, "grad": 1}}]}, id="modes-not-bool"),
    pytest.param({"entries": [{"group": "g", "signature": "s", "modes": MODES, "offset": 0,
                               "bytes": 2},
                              {"group": "g", "signature": "s", "modes": MODES, "offset": 2,
                               "bytes": 2}]}, id="duplicate"),
])
def test_a_malformed_signed_record_is_ignored_not_raised(site, damage) -> None:
    m = load_manifest("net.surgery.toml")
    meta = cache.bundle_metadata(m, overrides=AOT, env=cache.environment(device="cpu"),
                                 artifacts={})
    record = {"format": 1, "bytes": 4, "entries": [
        {"group": "g", "signature": "s", "modes": MODES, "offset": 0, "bytes": 4}],
        "notes": [], **damage}
    meta.update(format=bundle_parts.FORMAT_PRECOMPILED, precompiled=record)
    bundle.write_bundle("net.surgery.cache", EMPTY_BLOB + b"abcd", meta, key=KEY)
    ours, report, diff = _deploy(site)
    assert len(ours) == 1 and "refused" in ours[0], ours
    assert report.cache.loaded is False and diff == 0  # type: ignore[attr-defined]


# --- the layouts ever written -------------------------------------------------------------------

def test_golden_format_2_bundle_still_reads_and_loads(site, monkeypatch) -> None:
    """tests/golden/format2.surgery.cache was written by the format-2 writer (before the
    precompiled part), signed with bundle_support.KEY, for tests/golden/format2.surgery.toml."""
    meta, blob = bundle.read_bundle(str(GOLDEN / "format2.surgery.cache"), key=KEY)
    assert meta["format"] == 2 and blob == EMPTY_BLOB
    monkeypatch.setattr(cache, "environment", lambda device: dict(meta["env"]))
    opened = cache.open_bundle(str(GOLDEN / "format2.surgery.cache"),
                               manifest=load_manifest(str(GOLDEN / "format2.surgery.toml")),
                               overrides=meta["overrides"], device="cpu")
    assert opened.loaded, opened.reason
    assert opened.precompiled == {}


def test_format_3_layout_reads_back() -> None:
    meta, blob = bundle.read_bundle(str(GOLDEN / "format3.surgery.cache"), key=KEY)
    mega, section = bundle_parts.split_blob(meta, blob)
    assert mega == EMPTY_BLOB
    assert bundle_parts.parse_precompiled(meta, section) == {"g": {"s": (b"artifact", MODES, ())}}


def test_format_3_layout_with_inlined_sources_reads_back() -> None:
    """tests/golden/format3-sources.surgery.cache: a format-3 entry with the optional SOURCES_FIELD
    of surgery.runtime.portable (written since; the layout above, without it, still reads)."""
    meta, blob = bundle.read_bundle(str(GOLDEN / "format3-sources.surgery.cache"), key=KEY)
    _, section = bundle_parts.split_blob(meta, blob)
    assert bundle_parts.parse_precompiled(meta, section) == {
        "g": {"s": (b"artifact", MODES, (("premod", 3, 9, "sha256:" + "cd" * 32),))}}


def test_a_format_3_bundle_cannot_be_cut_to_format_2(site) -> None:
    """The format is inside the signed metadata: rewriting it breaks the signature."""
    data = (GOLDEN / "format3.surgery.cache").read_bytes()
    cut = data.replace(b'"format": 3', b'"format": 2')
    assert cut != data
    (site / "cut.surgery.cache").write_bytes(cut)
    with pytest.raises(bundle.CacheSignatureError, match="does not verify"):
        bundle.read_bundle(str(site / "cut.surgery.cache"), key=KEY)


# --- examples: what is kept to precompile a signature ------------------------------------------

def test_an_example_keeps_layout_and_modes_not_tensors() -> None:
    x = torch.randn(3, 4).t()  # not contiguous, and not an inference tensor
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.randn(2)
        ex = call_example.Example.of((x, 2, None), {"scale": 0.5, "pair": (y, "s")})
    assert ex is not None and ex.inference and ex.autocast == (("cpu", torch.bfloat16),)
    with ex.modes():
        (a, n, none), kw = ex.build()
        assert torch.is_inference_mode_enabled() and torch.is_autocast_enabled("cpu")
        # dynamo guards on which tensors are inference tensors: kept as they were
        assert not a.is_inference() and kw["pair"][0].is_inference()
    assert (a.shape, a.stride(), n, none, kw["scale"], kw["pair"][1]) == \
        (x.shape, x.stride(), 2, None, 0.5, "s")
    assert not any(isinstance(v, torch.Tensor) for v in vars(ex).values())
    assert call_example.Example.of((object(),), {}) is None  # not rebuildable: not precompiled


# --- region graphs: the first call captures when nothing compiles in it -------------------------

class _Graph:
    def __init__(self, work) -> None:  # type: ignore[no-untyped-def]
        self.replay = work


class _Capturer:
    device = -1

    def __init__(self) -> None:
        import weakref

        self.owned = weakref.WeakValueDictionary()  # type: ignore[var-annotated]

    def capture(self, work):  # type: ignore[no-untyped-def]
        work()
        return _Graph(work)


@pytest.mark.parametrize(("ready", "captured_after"), [
    pytest.param(True, 1, id="precompiled-first-call"),
    pytest.param(False, 2, id="second-call"),
])
def test_precompiled_code_is_captured_on_its_first_call(ready: bool, captured_after: int) -> None:
    from surgery.runtime.graphs.replay import RegionGraphs

    lin = torch.nn.Linear(4, 3)
    g = RegionGraphs(lin, _Capturer(), lambda a, k: lin(*a, **k), clone_outputs=False,
                     warn=print)
    g.ready = lambda a, k: ready
    runs = []

    def run_compiled(a, k):  # type: ignore[no-untyped-def]
        runs.append(1)
        return lin(*a, **k), True

    x = torch.randn(2, 4)
    with torch.no_grad():
        for call in range(1, 4):
            out = g((x,), {}, run_compiled).clone()  # released at once: no output set held
            torch.testing.assert_close(out, lin(x))
            assert g.captures == (1 if call >= captured_after else 0)
    assert g.replays == 3 - captured_after


# --- surgery warm: the STEP form and the old form ----------------------------------------------

WARM = ["warm", "--model", "premod:build", "--manifest", "net.surgery.toml", "--device", "cpu",
        "--overrides", "backend=aot_eager", "--overrides", "on_cpu=compile"]


def test_warm_takes_the_step_plan_takes(site) -> None:
    r = CliRunner().invoke(cli, [*WARM, "--step", "premod:step", "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert "1 precompiled region artifact(s)" in r.output and "note:" not in r.output


def test_warm_old_input_form_works_with_a_note(site) -> None:
    r = CliRunner().invoke(cli, [*WARM, "--input", "premod:example"])
    assert r.exit_code == 0, r.output
    assert "note: --input here names an example-input factory" in r.output


def test_warm_help_teaches_the_step_form_and_a_private_key() -> None:
    """`surgery warm --help` is where a new user learns both (issue 23)."""
    r = CliRunner().invoke(cli, ["warm", "--help"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "--step takes the same STEP as `surgery plan --input`" in text
    assert "--steps times" in text and "the older --input FACTORY form still works" in text
    assert "--step surgery.examples:stream_step --steps 4" in text  # the example uses it
    assert "(umask 077; python -c" in text  # the recipe makes a key file warm accepts


@pytest.mark.parametrize("extra", [
    pytest.param([], id="neither"),
    pytest.param(["--step", "premod:step", "--input", "premod:example"], id="both"),
])
def test_warm_needs_exactly_one_driver(site, extra) -> None:
    r = CliRunner().invoke(cli, [*WARM, *extra])
    assert r.exit_code == 2 and "exactly one of them" in r.output, r.output
    assert not (site / "net.surgery.cache").exists()


def test_warm_steps_must_be_positive(site) -> None:
    r = CliRunner().invoke(cli, [*WARM, "--step", "premod:step", "--steps", "0"])
    assert r.exit_code == 2 and "--steps" in r.output, r.output


def test_warm_bad_step_names_the_flag(site) -> None:
    r = CliRunner().invoke(cli, [*WARM, "--step", "premod:nope"])
    assert r.exit_code == 3 and "--step" in r.output and "Traceback" not in r.output, r.output


# --- CUDA: a warm start captures its graphs on the first pass and replays -----------------------

def _cuda_cold() -> tuple[Any, Any, Any, Any]:
    """The premod net on CUDA (in the `site` folder), applied cold with 3 warm-up passes:
    (the module, its input on CUDA, the step, the handle). Skips without torch's precompile."""
    if missing := precompiled.api_missing():
        pytest.skip(missing)
    mod = _premod()
    x = mod.X.cuda()

    def step(m):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return m(x)

    model = mod.build().cuda().eval()
    with torch.no_grad():
        handle = apply_manifest(model, "net.surgery.toml", warmup=step, passes=3)
    return mod, x, step, handle


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_warm_start_captures_on_the_first_pass_and_replays(site) -> None:
    mod, x, step, handle = _cuda_cold()
    assert all(r.graphs_captured >= 1 for r in handle.report.records)
    handle.save_cache()
    handle.restore()
    torch._dynamo.reset()
    counters.clear()

    model = mod.build().cuda().eval()
    want = model(x)
    with torch.no_grad():
        handle = apply_manifest(model, "net.surgery.toml", warmup=step, cache=True, passes=1)
        records = handle.report.records
        assert handle.report.cache.precompiled >= 1, handle.report.cache.reason  # type: ignore[union-attr]
        assert all(r.graphs_captured == 1 for r in records), [r.notes for r in records]
        got = step(model)
    assert all(r.cuda_graph_replays >= 1 for r in records)
    assert _frames() == 0
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    with contextlib.suppress(Exception):
        handle.restore()


CUDA_DEPLOY_SRC = textwrap.dedent('''
    import json, torch, premod
    from torch._dynamo.utils import counters
    from torch._inductor import async_compile
    from surgery.runtime.apply import apply_manifest
    x = premod.X.cuda()
    model = premod.build().cuda().eval()
    want = model(x)
    with torch.no_grad():
        h = apply_manifest(model, "net.surgery.toml", cache=True)
        got = model(x)
        got = model(x)  # the second call replays
    setup = h.precompiled.setup if h.precompiled is not None else None
    print(json.dumps({
        "precompiled": h.report.cache.precompiled, "reason": h.report.cache.reason,
        "frames": sum(counters["frames"].values()),
        "replays": [r.cuda_graph_replays for r in h.report.records],
        "keys": setup.keys if setup else {}, "steps": setup.steps if setup else {},
        "pools": len(getattr(async_compile, "_pool_set", ())),
        "ready_future": getattr(async_compile.AsyncCompile, "_ready_future", None) is not None,
        "close": torch.allclose(got, want, atol=2e-3, rtol=2e-3)}))
''')


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fresh_process_loads_without_a_compile_pool_with_keys_hashed_beside(site) -> None:
    """A fresh CUDA process (empty inductor and Triton caches) warm-starts from the bundle with
    torch's and triton's keys hashed in surgery's thread (runtime.warm_loader), no compile pool
    started for the artifact's kernels, nothing traced, graphs replayed, outputs as eager."""
    _, _, _, handle = _cuda_cold()
    assert handle.save_cache().metadata[bundle_parts.PRECOMPILED_KEY]["entries"]
    handle.restore()
    (site / "deploy_cuda.py").write_text(CUDA_DEPLOY_SRC)
    cache = site / "inductor-cuda-deploy"
    env = {**os.environ, "PYTHONPATH": _pythonpath(site),
           "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    run = subprocess.run([sys.executable, "deploy_cuda.py"], cwd=site, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["precompiled"] == 1, got["reason"]
    assert got["frames"] == 0 and all(n >= 1 for n in got["replays"]), got
    assert "torch_key" in got["keys"].get("keys", {}), got  # hashed in the thread
    assert "keys_wait" in got["steps"], got
    assert "triton_driver" in got["keys"].get("build", {}), got  # built in the thread, beside
    assert "failed" not in got["keys"], got
    assert got["pools"] == 0 and not got["ready_future"], got  # no compile pool started
    assert got["close"], got


def test_a_groups_identity_does_not_follow_reference_counts() -> None:
    """marshal marks objects referenced more than once, so its bytes (and a digest of them)
    change when anything else holds one of the code's constants; the identity must not."""
    scope: dict = {}
    exec("def forward(x):\n    return x * 2.75 + len(('unique-constant-7', 3.5))\n", scope)
    fn = scope["forward"]
    before = precompiled.group_identity(fn, "opts")
    keep = list(fn.__code__.co_consts)  # one more reference to each constant
    assert precompiled.group_identity(fn, "opts") == before
    assert keep
