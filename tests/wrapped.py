"""State dicts produced by the REAL training wrappers around the tiny example model.

Every builder returns (wrapped state dict, the unwrapped model) so a test can assert that the
clean key set equals the unwrapped model's, and that export loads back with strict=True.
torch.compile uses backend="eager": the key segments come from OptimizedModule regardless.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.optim.swa_utils import AveragedModel

from surgery.examples import tiny
from surgery.examples.demo import swap_in_compiled_blocks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiny()


def _compile(m: nn.Module) -> nn.Module:
    return torch.compile(m, backend="eager")  # type: ignore[return-value]


def _regional(m: nn.Module) -> nn.Module:
    """LingBot-Map's recipe: swap blocks and attn.proj for OptimizedModules in their parents."""
    return swap_in_compiled_blocks(m, backend="eager")  # type: ignore[arg-type]


@contextlib.contextmanager
def gloo_group() -> Iterator[None]:
    """A one-process gloo group over loopback, so DDP can wrap a CPU model."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp(m: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(m)


def _named_parameters(m: nn.Module) -> dict[str, torch.Tensor]:
    # checkpoint_wrapper hides its segment from state_dict() with a hook, but not from
    # named_parameters(), which hand-rolled savers (optimizer maps, FSDP utils) use.
    return {k: v.detach() for k, v in m.named_parameters()}


def _ckpt_blocks(m: nn.Module) -> nn.Module:
    agg = m.aggregator  # type: ignore[attr-defined]
    for i in range(len(agg.frame_blocks)):
        agg.frame_blocks[i] = checkpoint_wrapper(agg.frame_blocks[i])
    return m


Builder = Callable[[], tuple[dict[str, torch.Tensor], nn.Module]]


def _sd(wrap: Callable[[nn.Module], nn.Module], *, named: bool = False) -> Builder:
    def build() -> tuple[dict[str, torch.Tensor], nn.Module]:
        plain = _model()
        clean = _model()
        clean.load_state_dict(plain.state_dict())
        wrapped = wrap(plain)
        sd = _named_parameters(wrapped) if named else dict(wrapped.state_dict())
        return sd, clean

    return build


# name -> (builder, finding codes verify must report, needs a process group)
BUILDERS: dict[str, tuple[Builder, set[str], bool]] = {
    "compile-whole": (_sd(_compile), {"SG001"}, False),
    "compile-regional": (_sd(_regional), {"SG001"}, False),
    "ddp": (_sd(_ddp), {"SG002"}, True),
    "ddp-of-compile": (_sd(lambda m: _ddp(_compile(m))), {"SG001", "SG002"}, True),
    "compile-of-ddp": (_sd(lambda m: _compile(_ddp(m))), {"SG001", "SG002"}, True),
    "ddp-of-regional": (_sd(lambda m: _ddp(_regional(m))), {"SG001", "SG002"}, True),
    "averaged": (_sd(AveragedModel), {"SG002", "SG007"}, False),
    "averaged-of-compile": (_sd(lambda m: AveragedModel(_compile(m))),
                            {"SG001", "SG002", "SG007"}, False),
    "checkpoint-wrapper": (_sd(_ckpt_blocks, named=True), {"SG004"}, False),
    "compile-of-checkpoint-wrapper": (_sd(lambda m: _compile(_ckpt_blocks(m)), named=True),
                                      {"SG001", "SG004"}, False),
    "ddp-of-checkpoint-wrapper": (_sd(lambda m: _ddp(_ckpt_blocks(m)), named=True),
                                  {"SG002", "SG004"}, True),
}
