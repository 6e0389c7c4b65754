"""Portable precompiled artifacts (surgery.runtime.portable): real blocks whose guards torch's AOT
path refused now precompile, run in a fresh process without dynamo, and match eager; what stands
in for the guards dropped (inlined source spans, the closure in the group's identity) is checked.

Backend aot_eager throughout: torch's AOT path serialises it like inductor, with no code
generation, so the tests stay quick; the inductor path is tests/test_precompiled.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
import zoo_models
from bundle_support import KEY_HEX, TWO_BLOCKS_SRC
from torch._dynamo.utils import counters

from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region, save_manifest
from surgery.planning.plan import plan_model
from surgery.runtime import bundle_parts, portable, precompiled
from surgery.runtime.apply import apply_manifest
from surgery.runtime.report import CacheIgnoredWarning, SurgeryWarning
from surgery.runtime.signing import ENV_KEY, ENV_KEY_FILE

AOT = {"backend": "aot_eager", "on_cpu": "compile"}
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(HERE, "tests")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# The deploying process: a new model, its eager output, then apply_manifest from the bundle and
# one run; what dynamo traced, what ran precompiled, and the difference from eager.
DEPLOY = textwrap.dedent('''
    import json, sys, torch, zoo_models
    from torch._dynamo.utils import counters
    from surgery.runtime.apply import apply_manifest
    case = zoo_models.CASES[sys.argv[1]]
    torch.manual_seed(0)
    model = case.build().eval()
    with torch.no_grad():
        want = case.run(model)
        h = apply_manifest(model, sys.argv[2], warmup=case.run, cache=True, passes=1,
                           overrides={"backend": "aot_eager", "on_cpu": "compile"})
        got = case.run(model)
    print(json.dumps({
        "frames": sum(counters["frames"].values()),
        "graphs": counters["stats"]["unique_graphs"] + counters["stats"]["calls_captured"],
        "precompiled": h.report.cache.precompiled, "reason": h.report.cache.reason,
        "notes": h.report.notes,
        "records": [[r.path, r.status, r.precompiled_runs, r.compiles]
                    for r in h.report.records],
        "diff": max(float((a - b).abs().max()) for a, b in zip(got, want))}))
''')


@pytest.fixture
def keyed(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv(ENV_KEY, KEY_HEX)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(("name", "blocks"), [
    # BertLayer.forward is transformers' checkpointing wrapper around a deprecate_kwarg
    # wrapper; its feed_forward_chunk's code is guarded by identity (apply_chunking_to_forward)
    pytest.param("hf_bert", ("BertLayer.forward",), id="transformers-BertModel"),
    # its single blocks (the plan's repeated blocks) guard their attention processor's
    # class's __call__.__code__
    pytest.param("flux", ("FluxSingleTransformerBlock.forward",),
                 id="diffusers-FluxTransformer2DModel"),
])
def test_real_blocks_precompile_and_a_fresh_process_traces_nothing(keyed, name, blocks) -> None:
    case = zoo_models.CASES[name]
    manifest = keyed / f"{name}.surgery.toml"
    save_manifest(plan_model(case.spec).manifest, str(manifest))
    torch.manual_seed(0)
    model = case.build().eval()
    with torch.no_grad():
        handle = apply_manifest(model, str(manifest), warmup=case.run, passes=1, overrides=AOT)
    meta = handle.save_cache().metadata
    handle.restore()
    record = meta[bundle_parts.PRECOMPILED_KEY]
    groups = {json.loads(e["group"])[1] for e in record["entries"]}
    assert groups == set(blocks), record["notes"]  # each block class precompiled, none refused
    assert all(e[bundle_parts.SOURCES_FIELD] for e in record["entries"])  # inlined code kept

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, HERE]),
           "TORCHINDUCTOR_CACHE_DIR": str(keyed / "inductor-deploy")}
    run = subprocess.run([sys.executable, "-c", DEPLOY, name, str(manifest)], cwd=keyed,
                         env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["precompiled"] == len(record["entries"]), got["reason"]
    assert got["frames"] == 0 and got["graphs"] == 0, got  # dynamo traced nothing
    assert all(status == "compiled" and runs > 0 and compiles == 0
               for _, status, runs, compiles in got["records"]), got["records"]
    assert got["diff"] <= 1e-6, got
    assert "CacheIgnoredWarning" not in run.stderr


# --- what replaces the guards dropped ------------------------------------------------------------

# Block.forward calls a helper; editing the helper leaves Block.forward's code (the group's
# identity) unchanged, so only the inlined-source check can tell the artifact is stale.
HELPER_SRC = TWO_BLOCKS_SRC.replace(
    "return x + self.b(torch.nn.functional.gelu(self.a(x)))", "return x + self.b(act(self.a(x)))"
).replace("class Block(nn.Module):", "def act(t):\n    return torch.nn.functional.gelu(t)\n\n"
          "class Block(nn.Module):") + "\nX = torch.randn(4, 16)\n"


def _helper_site(tmp: Path, src: str) -> types.ModuleType:
    (tmp / "helpermod.py").write_text(src)
    sys.modules.pop("helpermod", None)
    import importlib

    return importlib.import_module("helpermod")


def test_changed_inlined_code_is_stale_though_the_region_function_is_not(keyed, monkeypatch
                                                                          ) -> None:
    monkeypatch.syspath_prepend(str(keyed))
    monkeypatch.chdir(keyed)
    assert "return x + self.b(act(self.a(x)))" in HELPER_SRC
    mod = _helper_site(keyed, HELPER_SRC)
    model = mod.build().eval()
    m = Manifest(compute_fingerprint(model.state_dict()),
                 [Region("block", ["blocks.0", "blocks.1"])],
                 compile={**DEFAULT_COMPILE, "on_cpu": "compile"})
    save_manifest(m, "net.surgery.toml")
    with torch.no_grad():
        h = apply_manifest(model, "net.surgery.toml", warmup=lambda mm: mm(mod.X),
                           overrides=AOT, passes=2)
    h.save_cache()
    h.restore()
    torch._dynamo.reset()
    counters.clear()

    mod = _helper_site(keyed, HELPER_SRC.replace("gelu(t)", "silu(t)"))  # the helper only
    model = mod.build().eval()
    want = model(mod.X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            h = apply_manifest(model, "net.surgery.toml", warmup=lambda mm: mm(mod.X),
                               overrides=AOT, cache=True, passes=1)
            got = model(mod.X)
    h.restore()
    ours = [str(w.message) for w in caught if issubclass(w.category, SurgeryWarning)]
    assert all(issubclass(w.category, CacheIgnoredWarning) for w in caught
               if issubclass(w.category, SurgeryWarning))
    assert len(ours) == 1 and "helpermod lines" in ours[0] and "changed" in ours[0], ours
    assert h.report.cache.precompiled == 0  # type: ignore[union-attr]
    assert torch.equal(got, want)  # the new helper ran (compiled by dynamo), not the old one


def test_a_source_span_checks_the_lines_it_names(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = _helper_site(tmp_path, HELPER_SRC)
    lines = HELPER_SRC.splitlines()
    first = lines.index("def act(t):") + 1
    span = [mod.__name__, first, first + 2, portable._span_digest(mod, first, first + 2)]
    assert portable.sources_problem([span]) is None
    assert "changed" in str(portable.sources_problem([[*span[:3], "sha256:" + "0" * 64]]))
    assert "not imported" in str(portable.sources_problem([["no_such_mod_x", 1, 2, span[3]]]))


def test_a_decorators_closure_is_part_of_the_group_identity() -> None:
    """The guards on a wrapper's closure are dropped, so its values must name the group."""
    def deco(flag: bool):  # type: ignore[no-untyped-def]
        def wrap(fn):  # type: ignore[no-untyped-def]
            def forward(self, x):  # type: ignore[no-untyped-def]
                return fn(self, x) if flag else x
            return forward
        return wrap

    def inner(self, x):  # type: ignore[no-untyped-def]
        return x * 2

    on, off = deco(True)(inner), deco(False)(inner)
    assert on.__code__ is off.__code__  # one code: only the closure tells them apart
    assert precompiled.group_identity(on, "o") != precompiled.group_identity(off, "o")
    assert precompiled.group_identity(on, "o") == precompiled.group_identity(deco(True)(inner),
                                                                             "o")
    keep = portable.guard_filter_for(on)
    entry = types.SimpleNamespace(name="flag", guard_type="CONSTANT_MATCH", is_global=False,
                                  derived_guard_types=("BOOL_MATCH",), has_value=True,
                                  value=True)
    other = types.SimpleNamespace(**{**vars(entry), "name": "L['x']", "guard_type": "TENSOR_MATCH",
                                     "derived_guard_types": ()})
    assert keep([entry, other]) == [False, True]  # the closure's, dropped; the argument's, kept


@pytest.mark.parametrize("spans", [
    pytest.param([["m", 1, 2]], id="short"),
    pytest.param([["m", 3, 2, "sha256:" + "0" * 64]], id="lines-backwards"),
    pytest.param([["m", 1, 2, "md5:" + "0" * 64]], id="not-sha256"),
    pytest.param([["m\n", 1, 2, "sha256:" + "0" * 64]], id="name-not-printable"),
    pytest.param([["m", 1, 2, "sha256:" + "0" * 64]] * (bundle_parts.MAX_SOURCES + 1),
                 id="too-many"),
])
def test_a_malformed_source_span_refuses_the_record(spans) -> None:
    meta = {"format": bundle_parts.FORMAT_PRECOMPILED, bundle_parts.PRECOMPILED_KEY: {
        "format": 1, "bytes": 4, "notes": [], "entries": [
            {"group": "g", "signature": "s", "offset": 0, "bytes": 4, "sources": spans,
             "modes": {"grad": False, "inference": False, "autocast": []}}]}}
    with pytest.raises(bundle_parts.PrecompiledError, match="source"):
        bundle_parts.parse_precompiled(meta, b"abcd")
