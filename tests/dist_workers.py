"""What each rank runs in tests/test_distributed.py: 2 gloo processes on the CPU.

`spawn` starts the ranks with torch.multiprocessing (no launcher of our own) and returns what
each wrote. `apply_all` applies one manifest, planned on the unwrapped timm ViT, to the model
wrapped three ways (DDP, FSDP2, tensor parallel), and saves the FSDP2 model with DCP; every
result is plain JSON so that the test process asserts on it.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

CPU_OVERRIDES = {"on_cpu": "compile", "backend": "aot_eager"}
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., dict[str, Any]], port: int, out: str,
           args: tuple[Any, ...], world: int, backend: str) -> None:
    from conftest import _let_torchvision_import_on_cpu_torch  # timm imports torchvision

    _let_torchvision_import_on_cpu_torch()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def spawn(fn: Callable[..., dict[str, Any]], out: str, *args: Any, world: int = WORLD,
          backend: str = "gloo") -> list[dict[str, Any]]:
    """Run ``fn(rank, *args)`` on `world` ranks (gloo, or nccl with one GPU each); the results,
    by rank."""
    mp.start_processes(_entry, args=(fn, free_port(), out, args, world, backend), nprocs=world,
                       join=True, start_method="spawn")
    results = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def timm_vit() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, depth=2, num_classes=10).eval()


def image() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _keys(model: nn.Module) -> list[str]:
    return list(model.state_dict())


def _outcome(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A scenario's result, or its error: one broken scenario must not hide the others."""
    torch._dynamo.reset()
    try:
        return fn()
    except Exception:
        return {"error": traceback.format_exc()[-3000:]}


def _applied(model: nn.Module, wrapped: nn.Module, manifest: Any, x: torch.Tensor,
             ref: torch.Tensor, mode: Callable[[], Any] = torch.no_grad) -> dict[str, Any]:
    from surgery import apply_manifest
    from surgery.runtime.graphs.collectives import collective_count

    keys = _keys(wrapped)
    with mode():
        wrapped(x)  # FSDP2's lazy init issues collectives of its own on the first call
        before = collective_count()
        wrapped(x)
        eager_collectives = collective_count() - before  # type: ignore[operator]
        handle = apply_manifest(wrapped, manifest, overrides=CPU_OVERRIDES,
                                warmup=lambda m: m(x), passes=2)
        before = collective_count()
        y = wrapped(x)
        applied_collectives = collective_count() - before  # type: ignore[operator]
    gathered = handle.report.gather()
    return {"diff": (y - ref).abs().max().item(), "keys_same": _keys(wrapped) == keys,
            "statuses": [r.status for r in handle.report],
            "compiled_runs": [r.compiled_runs for r in handle.report],
            "paths": [r.path for r in handle.report], "gathered": gathered,
            "collectives": [eager_collectives, applied_collectives], "handle": handle}


def _ddp(manifest: Any, x: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    model = timm_vit()
    ddp = nn.parallel.DistributedDataParallel(model)
    out = _applied(model, ddp, manifest, x, ref)
    # A training step through DDP with the regions compiled: DDP's gradient hooks still run.
    ddp.train()
    ddp(x).sum().backward()
    grad = model.head.weight.grad
    assert grad is not None
    mine = grad.clone()
    dist.all_reduce(grad, op=dist.ReduceOp.MAX)
    out["grads_equal_across_ranks"] = bool(torch.equal(grad, mine))
    out["grad_norm"] = mine.norm().item()
    out.pop("handle").restore()
    return out


def _fsdp2(manifest: Any, x: torch.Tensor, ref: torch.Tensor, dcp_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = timm_vit()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = isinstance(model.blocks[0].attn.qkv.weight, DTensor)
    seen: list[Any] = []

    def check(mod: nn.Module, args: Any) -> None:  # runs after FSDP2's own pre-forward hook
        w = mod.attn.qkv.weight
        seen.append([type(w).__name__, list(w.shape)])

    hooks = [b.register_forward_pre_hook(check) for b in model.blocks]
    out = _applied(model, model, manifest, x, ref)
    handle = out.pop("handle")
    out["sharded_at_rest"] = sharded
    out["in_region"] = seen[-1]
    out["resharded_after"] = isinstance(model.blocks[0].attn.qkv.weight, DTensor)
    for h in hooks:
        h.remove()
    handle.restore()
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=dcp_dir)
    out["dcp_dir"] = dcp_dir
    return out


def _tp(manifest: Any, x: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = timm_vit()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        parallelize_module(block.mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    # Applied and bound inside inference_mode, as a server does (DTensor parameters cannot be
    # detached there: binding reads the state dict outside it). FSDP2 itself fails under
    # inference_mode (torch 2.13), so it runs under no_grad.
    out = _applied(model, model, manifest, x, ref, mode=torch.inference_mode)
    out.pop("handle").restore()
    out["capture"] = _tp_capture(model, x)
    return out


def _tp_capture(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Region graphs on a TP block, with a capturer that runs the work as CUDA graphs do: the
    collectives each call issues with the rule off (the evidence), and what the rule does."""
    import weakref

    from surgery.runtime.graphs import replay
    from surgery.runtime.graphs.collectives import collective_count

    class RunCapturer:  # what CudaCapturer does on the host: run the work once, then record it
        device = -1

        def __init__(self) -> None:
            self.owned: Any = weakref.WeakValueDictionary()

        def capture(self, work: Callable[[], None]) -> Any:
            work()
            return type("G", (), {"replay": lambda self: None})()

    block = model.blocks[0]
    compiled = torch.compile(block.forward, backend="aot_eager")
    h = model._pos_embed(model.patch_embed(x))  # what the first block is given

    def run(args: Any, kwargs: Any) -> Any:
        return compiled(*args, **kwargs), True

    out: dict[str, Any] = {}
    for rule in (False, True):
        if not rule:
            real = replay.collective_counts
            replay.collective_counts = lambda: None  # the rule off: capture as on one GPU
        g = replay.RegionGraphs(block, RunCapturer(), lambda a, k: compiled(*a, **k),
                                clone_outputs=False, warn=lambda m: None)
        per_call = []
        with torch.no_grad():
            for _ in range(3):
                before = collective_count()
                g((h,), {}, run)
                per_call.append(collective_count() - before)  # type: ignore[operator]
        if not rule:
            replay.collective_counts = real
        out["on" if rule else "off"] = {"per_call": per_call, "captures": g.captures,
                                        "disabled": g.disabled}
    return out


def apply_all(rank: int, manifest_text: str, dcp_dir: str) -> dict[str, Any]:
    from surgery.formats.manifest import parse_manifest

    manifest = parse_manifest(manifest_text, path="vit.surgery.toml")
    x = image()
    with torch.no_grad():
        ref = timm_vit()(x)
    return {"ddp": _outcome(lambda: _ddp(manifest, x, ref)),
            "fsdp2": _outcome(lambda: _fsdp2(manifest, x, ref, dcp_dir)),
            "tp": _outcome(lambda: _tp(manifest, x, ref))}


# --- on GPUs (tests/test_distributed_cuda.py) -------------------------------------------------

def cuda_case(rank: int, kind: str, manifest_text: str, device: str = "cuda"
              ) -> dict[str, Any]:
    """One wrapping on CUDA (bf16, inference_mode), with the manifest's own settings (region
    CUDA graphs): how each region ran, its captures and replays, and the difference from eager.
    ``device="cpu"`` runs the same steps in fp32 with CPU_OVERRIDES (a dry run of the code)."""
    from torch.distributed.device_mesh import init_device_mesh

    from surgery import apply_manifest
    from surgery.formats.manifest import parse_manifest

    world = dist.get_world_size()
    manifest = parse_manifest(manifest_text, path="vit.surgery.toml")
    cuda = device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    x = image().to(dev, dtype)
    model = timm_vit().to(dev, dtype)
    with torch.inference_mode():
        ref = model(x).float()
    if kind == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if cuda else None)
    elif kind in ("fsdp2", "fsdp2-reshard"):
        from torch.distributed.fsdp import fully_shard

        # "fsdp2": each block stays unsharded after its forward (the inference setting), so its
        # parameters keep their addresses; "fsdp2-reshard" (fully_shard's default below the
        # root) frees them after each forward and re-gathers them into new memory.
        mesh = init_device_mesh(device, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=kind == "fsdp2-reshard")
        wrapped = fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device, (world,))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"fc1": ColwiseParallel(),
                                                 "fc2": RowwiseParallel()})
        wrapped = model
    keys = list(wrapped.state_dict())
    # FSDP2 fails under inference_mode (torch 2.13: its unshard keeps version counters, which
    # inference tensors lack), so it runs under no_grad, where region graphs capture too.
    with torch.no_grad() if kind.startswith("fsdp2") else torch.inference_mode():
        handle = apply_manifest(wrapped, manifest, warmup=lambda m: m(x),
                                overrides=None if cuda else CPU_OVERRIDES)
        outs = [wrapped(x).float() for _ in range(6)]
    if cuda:
        torch.cuda.synchronize()
    gathered = handle.report.gather()
    rel = max(((o - ref).abs().max() / ref.abs().max()).item() for o in outs)
    return {"rel": rel, "keys_same": list(wrapped.state_dict()) == keys,
            "statuses": [r.status for r in handle.report],
            "captured": [r.graphs_captured for r in handle.report],
            "replays": [r.cuda_graph_replays for r in handle.report],
            "notes": [n for r in handle.report for n in r.notes],
            "gathered": None if gathered is None else len(gathered)}
