"""`surgery.compile_regions(model, step=None, overrides=None)`: plan live, apply, return the handle.

Shown on a timm ViT (names only), a transformers GPT-2 driven through `generate()` (evidence
from the step), and a diffusers DiT in a denoising loop (evidence), as users drive them.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import surgery
from surgery.cli import cli
from surgery.errors import RegionError

zoo = pytest.importorskip("zoo_models")

AOT = {"backend": "aot_eager", "on_cpu": "compile", "mode": None, "options": None}


def _compiled(handle) -> int:
    return sum(1 for r in handle.report if r.status == "compiled" and r.compiled_runs > 0)


def _saved_manifest_applies(handle, tmp_path, build) -> None:
    """The plan is reviewable: saved, it checks clean and applies to a fresh model."""
    path = tmp_path / "plan.surgery.toml"
    handle.save_manifest(path)
    r = CliRunner().invoke(cli, ["check", str(path)])
    assert r.exit_code == 0, r.output
    with surgery.apply_manifest(build().eval(), str(path), overrides=AOT) as again:
        assert len(again.report) == len(handle.report)


def test_timm_vit_from_names(tmp_path, fresh_dynamo) -> None:
    model = zoo.timm_vit().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        with surgery.compile_regions(model, overrides=AOT) as handle:
            got = model(x)  # no step: the regions compile on this first call
            assert _compiled(handle) == 2
            assert sorted(r.path for r in handle.report) == ["blocks.0", "blocks.1"]
    torch.testing.assert_close(got, want)
    assert handle.restored and "forward" not in model.blocks[0].__dict__
    _saved_manifest_applies(handle, tmp_path, zoo.timm_vit)


def test_gpt2_generate_from_evidence(tmp_path, fresh_dynamo) -> None:
    model = zoo.gpt2().eval()
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))

    def step(m):
        with torch.no_grad():
            return m.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)

    want = step(model)
    handle = surgery.compile_regions(model, step, overrides=AOT, steps=2, passes=2)
    try:
        assert handle.manifest.coverage and handle.manifest.coverage["covered_share"] > 0
        assert all(r.evidence for r in handle.manifest.regions)
        assert _compiled(handle) >= 1, handle.report.summary()
        # the plan records GPT-2's tie, so an export bound to it keeps lm_head.weight
        assert handle.manifest.model["tied"] == {"lm_head.weight": "transformer.wte.weight"}
        torch.testing.assert_close(step(model), want)
    finally:
        handle.restore()
    _saved_manifest_applies(handle, tmp_path, zoo.gpt2)


def test_diffusers_dit_denoising_loop_from_evidence(fresh_dynamo) -> None:
    model = zoo.dit().eval()
    g = torch.Generator().manual_seed(0)
    start, cls = torch.randn(1, 4, 8, 8, generator=g), torch.tensor([2])

    def denoise(m):
        lat = start
        with torch.inference_mode():
            for t in (9, 1):
                eps = m(lat, timestep=torch.tensor([t]), class_labels=cls, return_dict=False)[0]
                lat = lat - 0.1 * eps[:, :4]
        return lat

    want = denoise(model)
    with surgery.compile_regions(model, denoise, overrides=AOT, steps=2, passes=2) as handle:
        assert _compiled(handle) >= 2, handle.report.summary()
        torch.testing.assert_close(denoise(model), want)


def test_wrappers_and_empty_plans_are_refused() -> None:
    model = zoo.timm_vit().eval()
    with pytest.raises(RegionError, match=r"torch.compile\(model\)") as info:
        surgery.compile_regions(torch.compile(model))
    assert "model._orig_mod" in info.value.hint
    with pytest.raises(RegionError, match="AveragedModel") as info:
        surgery.compile_regions(torch.optim.swa_utils.AveragedModel(model))
    assert "model.module" in info.value.hint
    with pytest.raises(RegionError, match="not a function"):
        surgery.compile_regions(lambda x: x)
    with pytest.raises(RegionError, match="found no region in Linear"):
        surgery.compile_regions(torch.nn.Linear(4, 4))


@pytest.mark.cuda
def test_on_cuda_the_step_warms_up_and_captures_region_graphs(fresh_dynamo) -> None:
    """On the GPU the watched step is also the warm-up that captures each region's CUDA graph;
    the next calls replay them, in bf16 under inference_mode, at two batch sizes."""
    model = zoo.dit().to("cuda", torch.bfloat16).eval()
    cls = torch.tensor([2, 5], device="cuda")
    lats = {b: torch.randn(b, 4, 8, 8, device="cuda", dtype=torch.bfloat16) for b in (1, 2)}

    def denoise(m, b=2):
        lat = lats[b]
        with torch.inference_mode():
            for t in (9, 1):
                eps = m(lat, timestep=torch.full((b,), t, device="cuda"), class_labels=cls[:b],
                        return_dict=False)[0]
                lat = lat - 0.1 * eps[:, :4]
        return lat

    want = {b: denoise(model, b) for b in (1, 2)}
    with surgery.compile_regions(model, denoise, steps=2) as handle:
        captured = sum(r.graphs_captured for r in handle.report)
        assert captured >= 2, handle.report.summary()
        for b in (2, 1, 2):
            torch.testing.assert_close(denoise(model, b), want[b], atol=3e-2, rtol=3e-2)
        assert sum(r.cuda_graph_replays for r in handle.report) > 0, handle.report.summary()
