"""`surgery plan --model F --input G`: the evidence plan end to end, and its manifest fields."""

from __future__ import annotations

import warnings

import pytest
import torch
from click.testing import CliRunner

from surgery.cli import cli
from surgery.formats.manifest import dumps_manifest, load_manifest, parse_manifest
from surgery.planning.plan import plan_model
from surgery.runtime.signatures import SignatureCheck, UnplannedSignatureWarning, signature_check

SDPA = "surgery.examples:tiny_sdpa"
STEP = "surgery.examples:stream_step"


@pytest.fixture(scope="module")
def sdpa_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    out = tmp_path_factory.mktemp("plan") / "sdpa.surgery.toml"
    res = CliRunner().invoke(cli, ["plan", "--model", SDPA, "--input", STEP, "--steps", "5",
                                   "-o", str(out)])
    return res, str(out)


def test_plan_input_writes_evidence_and_prints_coverage(sdpa_plan) -> None:  # type: ignore[no-untyped-def]
    res, out = sdpa_plan
    assert res.exit_code == 0, res.output
    assert "coverage: " in res.output and "of the eager step inside regions" in res.output
    assert "eager " in res.output  # the remainders
    assert "region graphs about " in res.output and "capture pool not estimated" in res.output
    m = load_manifest(out)  # validates against the schema
    paths = {p: r for r in m.regions for p in r.paths}
    # (Which small regions pass the time floor depends on this machine's clock; the shared
    # RoPE and the pose branch are checked untimed in test_shared_rope_and_heads_untimed.)
    assert "depth_head" in paths and "aggregator.frame_blocks.0" in paths
    left = {lo.path: lo.reason for lo in m.left_out}
    assert "attribute `kv_cache`" in left["aggregator.global_blocks.0.attn"]
    assert "attribute `kv_cache`" in left["camera_head"]
    assert "`cache` grew every step (0 to 8 tensors)" in left["camera_head.trunk.0"]
    assert m.coverage is not None and 0 < m.coverage["covered_share"] <= 1
    assert m.coverage["input"] == STEP and m.coverage["steps"] == 5
    # What region graphs will hold (surgery.planning.graph_estimate), in the schema's keys.
    assert m.coverage["graph_bytes"] == (m.coverage["graph_outputs_bytes"]
                                         + m.coverage["graph_static_inputs_bytes"]) > 0
    assert m.coverage["graph_bytes_unshared"] >= m.coverage["graph_bytes"]
    assert "peak_estimate_bytes" not in m.coverage  # measured on CUDA only
    ev = paths["depth_head"].evidence
    assert ev is not None and ev["signatures"][0].startswith("feats=list(4)[f32[1,6,32]")
    # Same model, same fingerprint as a names-only plan: the weights were not changed.
    assert m.fingerprint == plan_model(SDPA).manifest.fingerprint
    # ...and the same key brief, from which a later fingerprint mismatch is explained.
    assert m.model["keys"] == plan_model(SDPA).manifest.model["keys"] and m.model["dtypes"]


def test_manifest_round_trips_evidence_and_coverage(sdpa_plan) -> None:  # type: ignore[no-untyped-def]
    _, out = sdpa_plan
    m = load_manifest(out)
    again = parse_manifest(dumps_manifest(m))
    assert again.coverage == m.coverage
    assert [r.evidence for r in again.regions] == [r.evidence for r in m.regions]


def test_schema_rejects_a_bad_coverage(sdpa_plan) -> None:  # type: ignore[no-untyped-def]
    from surgery.errors import ManifestError

    _, out = sdpa_plan
    with open(out) as f:
        text = f.read().replace("covered_share = ", "covered_share = 7", 1)
    with pytest.raises(ManifestError, match="covered_share"):
        parse_manifest(text)


def test_input_without_model_is_a_usage_error() -> None:
    res = CliRunner().invoke(cli, ["plan", "x.safetensors", "--input", STEP])
    assert res.exit_code == 2
    assert "--input drives a live model" in res.output


def test_fold_with_input_is_a_usage_error() -> None:
    res = CliRunner().invoke(cli, ["plan", "--model", SDPA, "--input", STEP, "--fold"])
    assert res.exit_code == 2
    assert "--fold does nothing with --input" in res.output


def test_bad_input_is_one_line_exit_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "--input",
                                   "surgery.examples:no_such", "-o", str(tmp_path / "m.toml")])
    assert res.exit_code == 3
    assert "--input 'surgery.examples:no_such'" in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "m.toml").exists()


def test_failing_step_is_one_line_exit_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "--input",
                                   "surgery.examples:tiny", "-o", str(tmp_path / "m.toml")])
    assert res.exit_code == 3
    assert "the --input step failed" in res.output
    assert not (tmp_path / "m.toml").exists()


def test_signature_check_warns_once_on_an_unplanned_signature() -> None:
    lin = torch.nn.Linear(4, 4)
    with torch.no_grad():
        planned = "input=f32[2,4], no_grad"
        check = signature_check({"signatures": [planned]}, "lin", lin.forward)
        assert isinstance(check, SignatureCheck)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check.check((torch.zeros(2, 4),), {})  # planned: silent
        with pytest.warns(UnplannedSignatureWarning, match=r"input=f32\[3,4\]"):
            check.check((torch.zeros(3, 4),), {})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check.check((torch.zeros(5, 4),), {})  # once per path
    assert signature_check(None, "lin", lin.forward) is None


def test_shared_rope_and_heads_untimed() -> None:
    from surgery.examples import stream_step, tiny_sdpa
    from surgery.planning.evidence import choose_regions
    from surgery.planning.observe import observe

    obs = observe(tiny_sdpa().eval(), stream_step, steps=3, timed_steps=0)
    choice = choose_regions(obs)
    # The shared RoPE runs inside frame-block regions and in eager global blocks: a region,
    # seen at its one registered path.
    assert "aggregator.rope" in choice.regions
    assert choice.evidence["aggregator.rope"]["calls_per_step"] == 8.0
    assert {"camera_head.pose_branch", "aggregator.global_blocks.1.mlp",
            "camera_head.trunk.1.mlp", "aggregator.patch_embed"} <= set(choice.regions)
    assert not any(r.startswith("camera_head.trunk.1.") and r.count(".") == 2
                   for r in choice.regions if not r.endswith(".mlp"))


def test_apply_warns_once_on_a_signature_the_plan_never_saw() -> None:
    from surgery import apply_manifest
    from surgery.planning.observed import manifest_from_evidence, watch_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                torch.nn.Linear(8, 4)).eval()
    outer = torch.nn.Sequential(model, torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                           torch.nn.ReLU())).eval()

    def step(m: torch.nn.Module) -> None:
        with torch.no_grad():
            m(torch.randn(2, 4))

    w = watch_model(outer, step, steps=2, timed_steps=0)
    manifest = manifest_from_evidence(w, source="test")
    assert [p for r in manifest.regions for p in r.paths] == ["0", "1"]
    handle = apply_manifest(outer, manifest, overrides={"backend": "eager", "on_cpu": "compile"})
    try:
        with torch.no_grad():
            with warnings.catch_warnings():
                warnings.simplefilter("error", UnplannedSignatureWarning)
                outer(torch.randn(2, 4))  # planned
            with pytest.warns(UnplannedSignatureWarning, match=r"region path '0'.*f32\[5,4\]"):
                outer(torch.randn(5, 4))
            with warnings.catch_warnings():
                warnings.simplefilter("error", UnplannedSignatureWarning)
                outer(torch.randn(7, 4))  # once per path
    finally:
        handle.restore()


def test_plan_input_json_follows_the_plan_output_schema(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    from pathlib import Path

    import jsonschema

    res = CliRunner().invoke(cli, ["plan", "--model", "surgery.examples:tiny", "--input", STEP,
                                   "--steps", "2", "-o", str(tmp_path / "t.toml"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    schema = json.loads((Path(__file__).parents[1] / "schemas" /
                         "plan-output.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert 0 < doc["coverage"]["covered_share"] <= 1
    assert doc["coverage"]["steps"] == 2


def test_include_glob_colon_method_makes_any_method_a_region() -> None:
    from surgery.examples import stream_step, tiny_sdpa
    from surgery.planning.observed import manifest_from_evidence, watch_model

    inc = ["aggregator.global_blocks.*.attn:qkv_heads"]
    w = watch_model(tiny_sdpa().eval(), stream_step, steps=3, timed_steps=0, include=inc)
    m = manifest_from_evidence(w, source="t", include=inc)
    regions = {p: r for r in m.regions for p in r.paths}
    qkv = regions["aggregator.global_blocks.1.attn.qkv_heads"]
    assert qkv.callable == "method" and qkv.kind == "qkv_heads"
    assert qkv.evidence is not None and len(qkv.evidence["signatures"]) == 1
    # The shared RoPE now runs only inside regions (frame blocks, qkv_heads): not a region.
    left = {lo.path: lo.reason for lo in m.left_out}
    assert "aggregator.rope" not in regions
    assert left["aggregator.rope"].startswith("runs only inside region ")


def test_include_colon_method_that_matches_nothing_is_an_error() -> None:
    from surgery.errors import RegionError
    from surgery.examples import stream_step, tiny_sdpa
    from surgery.planning.observed import watch_model

    with pytest.raises(RegionError, match="has a method 'nope'"):
        watch_model(tiny_sdpa(), stream_step, steps=1, include=["aggregator.*:nope"])
