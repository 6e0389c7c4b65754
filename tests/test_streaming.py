"""plan --piecewise (surgery.planning.streaming): streaming blocks become piecewise regions that
apply_manifest runs with no code from the user."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from click.testing import CliRunner

from surgery.cli import cli
from surgery.formats.manifest import PIECEWISE_KIND, Manifest, validate
from surgery.planning.plan import compile_defaults, plan_model, plan_module, view_from_module
from surgery.planning.streaming import (
    INDEXED_GRAPHS_PER_INSTANCE,
    LIGHT_PIECE_BACKEND,
    light_pieces_plan,
    plan_piecewise,
)
from surgery.runtime import compile_start
from surgery.runtime.apply import apply_manifest

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ON_CPU = {"backend": "aot_eager", "on_cpu": "compile"}


def _round_trip(m: Manifest) -> Manifest:
    data = m.to_dict()
    validate(data)
    return Manifest.from_dict(data)


def test_names_plan_makes_sdpa_streaming_blocks_piecewise_and_they_apply() -> None:
    result = plan_model("surgery.examples:tiny_sdpa", piecewise=True)
    m = _round_trip(result.manifest)
    pw = [r for r in m.regions if r.kind == PIECEWISE_KIND]
    assert len(pw) == 2 and pw[0].paths == ["aggregator.global_blocks.0",
                                            "aggregator.global_blocks.1"]
    assert pw[0].piecewise == {"split_ops": ["scaled_dot_product_attention"],
                               "dynamic": ["self.attn.kv_cache"]}
    # one set of graphs shared by the instances: the default budget; light pieces under region
    # capture (planning/streaming.light_pieces_plan)
    assert pw[0].compile == {"backend": LIGHT_PIECE_BACKEND}
    # the camera trunk takes a per-instance index, which only selects its slot: the instances
    # share their graphs (runtime/index_select), with the per-instance budget on the region
    assert pw[1].paths == ["camera_head.trunk.0", "camera_head.trunk.1"]
    assert pw[1].piecewise == {"split_ops": ["scaled_dot_product_attention"],
                               "dynamic": ["cache"]}
    assert pw[1].compile == {"max_signatures": INDEXED_GRAPHS_PER_INSTANCE,
                             "backend": LIGHT_PIECE_BACKEND}
    paths = [p for r in m.regions for p in r.paths]
    assert not any(p.startswith(("aggregator.global_blocks.", "camera_head.trunk."))
                   and p.count(".") > 2 for p in paths)  # attn.proj, mlp are inside now
    left = {lo.path: lo.reason for lo in m.left_out}
    assert "inside piecewise region aggregator.global_blocks.0" in \
        left["aggregator.global_blocks.0.attn.proj"]
    assert "inside piecewise region camera_head.trunk.1" in left["camera_head.trunk.1.mlp"]
    assert "camera_head.trunk.0" not in left
    assert any("4 streaming block(s) planned piecewise" in n for n in result.notes)

    from surgery.examples import tiny_sdpa

    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    ref = copy.deepcopy(model)
    m.fingerprint = result.manifest.fingerprint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, m, overrides=ON_CPU)
    with torch.no_grad():
        for s in range(3):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k])
    for p in pw[0].paths + pw[1].paths:
        rec = handle.report.by_path(p)
        assert rec.status == "compiled" and rec.pieces == 2, rec.reason


def test_indexed_camera_trunk_compiles_no_graph_while_its_window_fills() -> None:
    """The camera trunk (``cache[global_idx]``, a 16-frame list window) planned piecewise, over
    20 frames of tiny_sdpa: outputs and caches match eager every frame; dynamo compiles the
    first frame's graph, then nothing while the window fills (a list length seen once runs the
    block eager), then one graph when the full window recurs, then nothing. The instances share
    their graphs: ``global_idx`` only selects the block's slot, so the compiled calls get the
    slot, not the index (surgery.runtime.index_select); without that, one graph per instance."""
    from torch._dynamo.utils import counters

    from surgery.examples import tiny_sdpa

    result = plan_model("surgery.examples:tiny_sdpa", piecewise=True)
    m = _round_trip(result.manifest)
    m.fingerprint = result.manifest.fingerprint
    m.regions = [r for r in m.regions if r.paths[0].startswith("camera_head.trunk.")]
    assert len(m.regions) == 1 and m.regions[0].kind == PIECEWISE_KIND
    torch.manual_seed(0)
    model = tiny_sdpa().eval()
    window = model.camera_head.window
    assert window == 16
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, m, overrides=ON_CPU)
    paths = m.regions[0].paths
    graphs = []  # dynamo's unique graphs after each frame
    with torch.no_grad():
        for s in range(20):
            x = model.example_input(seed=s)
            got, want = model(x), ref(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k])
            for slot, ref_slot in zip(model.camera_head.kv_cache, ref.camera_head.kv_cache,
                                      strict=True):
                assert len(slot) == len(ref_slot) == min(s + 1, window)
                torch.testing.assert_close(torch.cat(slot, 3), torch.cat(ref_slot, 3))
            graphs.append(counters["stats"]["unique_graphs"])
    assert len(paths) == 2
    assert len(set(graphs[:window + 1])) == 1, graphs  # frames 0-16: the first graph only
    assert graphs[window + 1] == graphs[0] + 1, graphs  # the full window, once for both
    assert graphs[-1] == graphs[window + 1], graphs  # and never again
    recs = [handle.report.by_path(p) for p in paths]
    assert [r.compiles for r in recs] == [2, 0]  # the second instance runs the first's graphs
    for rec in recs:
        assert rec.status == "compiled", rec.reason
        assert any("only selects cache[global_idx]" in n for n in rec.notes), rec.notes
        assert rec.new_structure_calls == window  # lengths 1-16 before the append, once each
        assert rec.compiled_calls == 20 - window and rec.eager_calls == window


def test_an_index_that_only_selects_is_planned_past_the_per_instance_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``cache[global_idx]`` is the index's only use: the instances share their graphs, so the
    group is planned whatever instances x per-instance graphs would be."""
    import surgery.planning.streaming as streaming

    monkeypatch.setattr(streaming, "INDEXED_GRAPH_BUDGET", INDEXED_GRAPHS_PER_INSTANCE)
    m = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    assert [r.paths[0] for r in m.regions if r.kind == PIECEWISE_KIND] == \
        ["aggregator.global_blocks.0", "camera_head.trunk.0"]


def test_indexed_blocks_over_the_budget_keep_their_treatment_with_the_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import surgery.planning.streaming as streaming
    import surgery.runtime.index_select as index_select

    monkeypatch.setattr(streaming, "INDEXED_GRAPH_BUDGET", INDEXED_GRAPHS_PER_INSTANCE)
    monkeypatch.setattr(index_select, "SELECT_SLOTS", False)  # each instance its own graphs
    result = plan_model("surgery.examples:tiny_sdpa", piecewise=True)
    m = result.manifest
    assert [r.paths[0] for r in m.regions if r.kind == PIECEWISE_KIND] == \
        ["aggregator.global_blocks.0"]
    left = {lo.path: lo.reason for lo in m.left_out}
    assert ("not piecewise: its forward takes a per-instance index 'global_idx', so each "
            f"instance would trace graphs of its own: 2 instances x "
            f"{INDEXED_GRAPHS_PER_INSTANCE} graphs") in left["camera_head.trunk.0"]
    assert any(r.kind == "fixed_part" and "camera_head.trunk.0.mlp" in r.paths
               for r in m.regions)  # today's treatment: its fixed children stay regions


def test_names_plan_of_gpt2_locates_its_cache_and_generates_the_same_tokens() -> None:
    transformers = pytest.importorskip("transformers")
    result = plan_model("tests.test_streaming:tiny_gpt2", piecewise=True)
    m = _round_trip(result.manifest)
    # the blocks, standing by for the stack region over `transformer` (tests/test_piecewise_stack)
    stack, pw = [r for r in m.regions if r.kind == PIECEWISE_KIND]
    assert stack.paths == ["transformer"] and pw.paths == ["transformer.h.0", "transformer.h.1"]
    assert pw.piecewise["fallback_for"] == ["transformer"]
    (source,) = pw.piecewise["dynamic"]  # `use_cache` is a flag, not a cache
    assert source.endswith(":2") and source.split(":")[0] in ("cache", "past_key_values",
                                                              "layer_past")
    assert not any(r.kind == "fixed_part" for r in m.regions)  # h.N.mlp is inside now
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    assert isinstance(model, transformers.PreTrainedModel)
    ids = torch.randint(2, 100, (1, 4), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, m, overrides=ON_CPU)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False),
                           ref.generate(ids, max_new_tokens=8, do_sample=False))
    assert handle.report.by_path("transformer").status == "compiled"
    assert all(r.status == "pending" and "stands by" in r.reason for r in handle.report
               if r.path != "transformer"), [r.reason for r in handle.report]


def tiny_gpt2() -> torch.nn.Module:
    """A --model factory: GPT-2 at test size, random weights."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=64, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_plan_without_streaming_blocks_says_nothing_is_piecewise() -> None:
    result = plan_model("surgery.examples:tiny_sdpa", piecewise=True,
                        exclude=["aggregator.global_blocks.*", "camera_head.*"])
    assert not any(r.kind == PIECEWISE_KIND for r in result.manifest.regions)
    assert "--piecewise: the plan left out no streaming block" in result.notes[-1]


def test_cli_piecewise_needs_a_live_model(tmp_path: object) -> None:
    res = CliRunner().invoke(cli, ["plan", "model.safetensors", "--piecewise"])
    assert res.exit_code == 2
    assert "--piecewise needs a live model" in res.output


def test_piecewise_plan_compiles_its_pieces_light_under_region_capture() -> None:
    """The piecewise regions, and the ordinary region of their class that shares their pieces
    (the frame blocks, RopeBlock), compile with the light backend under region capture; the other
    regions, the names-only plan and a plan with the compiler's own graphs keep inductor; a region
    that names its backend keeps it."""
    result = plan_model("surgery.examples:tiny_sdpa", piecewise=True)
    backends = {(r.kind, r.module_class): r.compile.get("backend")
                for r in result.manifest.regions}
    assert backends == {("frame_block", "RopeBlock"): LIGHT_PIECE_BACKEND,
                        ("piecewise", "RopeBlock"): LIGHT_PIECE_BACKEND,
                        ("piecewise", "CameraBlock"): LIGHT_PIECE_BACKEND,
                        ("patch_embed_block", "VitBlock"): None,
                        ("repeated_block", "FusionBlock"): None}, backends
    assert any("3 region(s) compile aot_eager (light pieces)" in n for n in result.notes)
    assert LIGHT_PIECE_BACKEND == compile_start.LIGHT_PIECE_BACKEND  # one light backend
    names = plan_model("surgery.examples:tiny_sdpa").manifest
    assert all("backend" not in r.compile for r in names.regions)  # names-only: unchanged
    compiler = plan_model("surgery.examples:tiny_sdpa", piecewise=True,
                          compile=compile_defaults(capture="compiler")).manifest
    assert all("backend" not in r.compile for r in compiler.regions)  # no region graphs
    bare = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    for r in bare.regions:
        r.compile = {k: v for k, v in r.compile.items() if k != "backend"}
    bare.compile = {**bare.compile, "capture": "compiler"}  # the compiler's graphs, no mode
    assert light_pieces_plan(bare) == []
    assert all("backend" not in r.compile for r in bare.regions)
    # a region that names its backend keeps it; the rule adds no second note
    m = plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest
    for r in m.regions:
        r.compile = {**r.compile, "backend": "inductor"}
    assert light_pieces_plan(m) == []
    assert {r.compile["backend"] for r in m.regions} == {"inductor"}


def test_light_pieces_on_transformers_gpt2_blocks_make_eagers_tokens() -> None:
    """The light-piece rule on a package's model: transformers' GPT-2 whose stack is refused
    (its blocks piecewise regions of their own, so the rule applies to them), deployed and
    driven by generate() at a varying batch, fp32 under no_grad and bf16 under inference_mode:
    the blocks compile aot_eager, run their compiled graph, and make eager's tokens."""
    pytest.importorskip("transformers")
    for dtype, mode, batch in ((torch.float32, torch.no_grad, 1),
                               (torch.bfloat16, torch.inference_mode, 3)):
        torch._dynamo.reset()
        model = tiny_gpt2().to(dtype)
        ref = copy.deepcopy(model)
        m = Manifest.from_dict(plan_module(model, source="tiny_gpt2").manifest.to_dict())
        view, _ = view_from_module(model)
        notes = plan_piecewise(m, model, view, refused={"transformer": "not piecewise: R"})
        blocks = [r for r in m.regions if r.kind == PIECEWISE_KIND]
        assert [r.paths for r in blocks] == [["transformer.h.0", "transformer.h.1"]], notes
        assert blocks[0].compile.get("backend") == LIGHT_PIECE_BACKEND, blocks[0].compile
        ids = torch.randint(2, 100, (batch, 5), generator=torch.Generator().manual_seed(batch))
        with mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = apply_manifest(model, m, overrides={"on_cpu": "compile"})
            got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            records = [handle.report.by_path(p) for p in blocks[0].paths]
            handle.restore()
        assert torch.equal(got, want), (dtype, batch)
        assert all(r.status == "compiled" and r.backend == LIGHT_PIECE_BACKEND
                   and r.compiled_calls > 0 for r in records), \
            [(r.status, r.backend, r.compiled_calls) for r in records]


def test_golden_piecewise_manifest_reads_back() -> None:
    """The [region.piecewise] layout of tests/golden (make golden) keeps reading."""
    import os

    from surgery.runtime.resolve import resolve_manifest

    path = os.path.join(os.path.dirname(__file__), "golden", "tiny-sdpa-piecewise.surgery.toml")
    m = resolve_manifest(path)
    pw = {r.module_class: r for r in m.regions if r.kind == PIECEWISE_KIND}
    assert sorted(pw) == ["CameraBlock", "RopeBlock"]  # global blocks, and the indexed trunk
    assert pw["RopeBlock"].piecewise == {"split_ops": ["scaled_dot_product_attention"],
                                         "dynamic": ["self.attn.kv_cache"]}
    assert pw["CameraBlock"].piecewise == {"split_ops": ["scaled_dot_product_attention"],
                                           "dynamic": ["cache"]}
    assert pw["CameraBlock"].compile == {"max_signatures": 20, "backend": "aot_eager"}
    assert pw["RopeBlock"].compile == {"backend": "aot_eager"}  # light pieces (x19s)


def test_evidence_plan_makes_the_growing_cache_blocks_piecewise() -> None:
    """plan --input --piecewise: the blocks whose cache the run saw grow become piecewise, the
    evidence regions inside them are dropped, and the coverage counts the piecewise blocks."""
    from surgery.planning.observed import plan_observed

    result = plan_observed("surgery.examples:tiny_sdpa", input_spec="surgery.examples:stream_step",
                           steps=3, timed_steps=1, piecewise=True)
    m = _round_trip(result.manifest)
    (pw,) = [r for r in m.regions if r.kind == PIECEWISE_KIND]
    assert pw.paths == ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]
    # plan --input probed them (surgery.planning.piecewise_probe): both traced as one graph
    assert any(n.startswith("piecewise probe (one step on aot_eager): 2 path(s) traced")
               for n in result.notes), result.notes
    assert pw.piecewise["dynamic"] == ["self.attn.kv_cache"]
    paths = [p for r in m.regions for p in r.paths]
    assert not any(p.startswith("aggregator.global_blocks.0.") for p in paths)
    assert m.coverage is not None and m.coverage["covered_share"] > 0
