"""apply_manifest under torch.distributed (issue 24), on 2 gloo ranks on the CPU.

One manifest, planned on the unwrapped timm ViT, is applied on each rank to the model under DDP,
FSDP2 (``fully_shard`` per block and at the root) and tensor parallelism (``parallelize_module``:
each block's MLP column/row-wise). Every case must match single-process eager, keep its
state-dict keys, and run compiled code in every region; the reports gather on rank 0. One
spawn runs all three (tests/dist_workers.py), so the set costs one start-up of two processes.
The same run saves the FSDP2 model with ``torch.distributed.checkpoint.save``, and the folder
is planned, verified and exported here (the DCP reader's own tests are in tests/test_dcp.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dist_workers  # noqa: E402

from surgery.formats.manifest import dumps_manifest  # noqa: E402
from surgery.planning.plan import plan_model  # noqa: E402

pytest.importorskip("timm", reason="needs timm (installed by `make install`'s dev extra)")
pytestmark = pytest.mark.skipif(
    not dist_workers.dist.is_available() or not dist_workers.dist.is_gloo_available(),
    reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    manifest = plan_model("dist_workers:timm_vit").manifest
    assert [p for r in manifest.regions for p in r.paths] == ["blocks.0", "blocks.1"]
    return dist_workers.spawn(dist_workers.apply_all, str(out), dumps_manifest(manifest),
                              str(out / "dcp"))


def _case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    got = [r[name] for r in ranks]
    for rank, g in enumerate(got):
        assert "error" not in g, f"rank {rank}: {g.get('error')}"
    return got


def _applied_like_eager(got: list[dict[str, Any]]) -> None:
    for g in got:
        assert g["diff"] < 1e-4, g["diff"]
        assert g["keys_same"]
        assert g["paths"] == ["blocks.0", "blocks.1"]
        assert g["statuses"] == ["compiled", "compiled"], g["statuses"]
        assert all(n > 0 for n in g["compiled_runs"])
    gathered = got[0]["gathered"]
    assert [r["rank"] for r in gathered] == [0, 1]
    assert all(r["counts"]["compiled"] == 2 for r in gathered)
    assert got[1]["gathered"] is None  # only rank 0 receives


@pytest.mark.slow  # one spawn of 2 ranks for all five: ~100 s on 2 cores
def test_ddp_paths_resolve_through_module(ranks: list[dict[str, Any]]) -> None:
    got = _case(ranks, "ddp")
    _applied_like_eager(got)
    assert all(g["grads_equal_across_ranks"] and g["grad_norm"] > 0 for g in got)


@pytest.mark.slow  # one spawn of 2 ranks for all five: ~100 s on 2 cores
def test_fsdp2_hooks_run_around_compiled_blocks(ranks: list[dict[str, Any]]) -> None:
    got = _case(ranks, "fsdp2")
    _applied_like_eager(got)
    for g in got:
        assert g["sharded_at_rest"] and g["resharded_after"]
        # Inside the region the weight is the whole, unsharded tensor (qkv of dim 192).
        assert g["in_region"] == ["Parameter", [576, 192]], g["in_region"]
        # FSDP2's all-gathers ran for the compiled model as for the eager one.
        eager, applied = g["collectives"]
        assert eager > 0 and applied == eager


@pytest.mark.slow  # one spawn of 2 ranks for all five: ~100 s on 2 cores
def test_tensor_parallel_blocks_compile_with_their_collectives(
        ranks: list[dict[str, Any]]) -> None:
    got = _case(ranks, "tp")
    _applied_like_eager(got)
    for g in got:
        eager, applied = g["collectives"]
        # The row-wise all-reduce runs inside each compiled block: one per block (two blocks).
        # Eager DTensor's own plan is not the yardstick: under inference_mode torch 2.14 turns
        # each block's Partial -> Replicate into three all-gathers on gloo (its alltoall
        # fallback; 6 for the two blocks), torch 2.13 into one all-reduce (2).
        assert applied == len(g["paths"]) == 2 and eager >= applied, (eager, applied)


@pytest.mark.slow  # one spawn of 2 ranks for all five: ~100 s on 2 cores
def test_a_region_holding_a_collective_is_never_captured(ranks: list[dict[str, Any]]) -> None:
    for g in _case(ranks, "tp"):
        off, on = g["capture"]["off"], g["capture"]["on"]
        # The evidence: captured as on one GPU, the capture call issues its collective twice.
        assert off["captures"] == 1 and off["per_call"][1] == 2 * off["per_call"][0] > 0
        # ... and a replay issues it behind the group's back (its sequence number stays).
        assert off["per_call"][2] == 0
        # The rule: no capture, one collective per call, and the reason recorded.
        assert on["captures"] == 0 and on["per_call"] == [on["per_call"][0]] * 3
        assert "collective" in on["disabled"] and "without a graph" in on["disabled"]


def test_gather_outside_a_job_returns_this_report() -> None:
    from surgery.runtime.report import ApplyReport, RegionRecord

    report = ApplyReport([RegionRecord("blocks.0", "block", "forward", "compiled")])
    (only,) = report.gather()
    assert only["rank"] == 0 and only["records"][0]["path"] == "blocks.0"


def test_resolve_steps_through_wrappers_only_where_the_path_needs_it() -> None:
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from surgery.runtime.resolve import resolve_path

    inner = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2)))
    dp = nn.DataParallel(inner)
    assert resolve_path(dp, "1", callable="forward")[0] is inner[1]
    # A canonical path skips _checkpoint_wrapped_module, and reaches the wrapped Linear.
    mod = nn.Module()
    mod.block = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2)))
    got, _ = resolve_path(mod, "block.0", callable="forward")
    assert got is mod.block._checkpoint_wrapped_module[0]
    # A child that happens to be called `module` is a real segment, not a wrapper.
    own = nn.Module()
    own.module = nn.Linear(2, 2)
    with pytest.raises(Exception, match="does not resolve"):
        resolve_path(own, "weight_proj", callable="forward")


@pytest.mark.slow  # one spawn of 2 ranks for all five: ~100 s on 2 cores
def test_a_dcp_save_of_the_fsdp2_model_plans_verifies_and_exports(
        ranks: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    import torch

    from surgery.formats.source import load_exported, resolve_checkpoint
    from surgery.hygiene.export import export_checkpoint
    from surgery.hygiene.verify import verify_checkpoint
    from surgery.planning.plan import plan_checkpoint

    _case(ranks, "fsdp2")
    folder = ranks[0]["fsdp2"]["dcp_dir"]
    resolved = resolve_checkpoint(folder)
    assert (resolved.path, resolved.kind) == (folder, "dcp")
    planned = plan_checkpoint(folder, kind=resolved.kind)
    assert [p for r in planned.manifest.regions for p in r.paths] == ["blocks.0", "blocks.1"]
    manifest = str(tmp_path_factory.mktemp("dcp_out") / "vit.surgery.toml")
    from surgery.formats.manifest import save_manifest

    save_manifest(planned.manifest, manifest)
    report = verify_checkpoint(folder, manifest=manifest, kind="dcp", deep=True)
    assert report.clean and report.entry == "model" and report.format == "dcp"
    out = os.path.join(os.path.dirname(manifest), "vit.safetensors")
    result = export_checkpoint(folder, out=out, manifest=manifest, kind="dcp",
                               max_shard_size=200_000)
    assert result.index is not None and len(result.files) > 1  # sharded, streamed per tensor
    state, embedded = load_exported(result.index)
    model = dist_workers.timm_vit()
    model.load_state_dict(state, strict=True)
    expected = dist_workers.timm_vit().state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert embedded is not None and embedded.fingerprint == planned.manifest.fingerprint
