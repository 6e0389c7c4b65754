"""`make demo`'s two model-side halves, on the example model.

    python -m surgery.examples OUT.pt                     # the hand-compiled checkpoint
    python -m surgery.examples.demo EXPORTED.safetensors  # deploy the export

First half: LingBot-Map's hand-written regional-compile recipe (`swap_in_compiled_blocks`),
whose saved state dict carries `_orig_mod.` in the middle of its keys: the checkpoint `surgery
plan`, `verify` and `export` then work on. Second half (`main`): load the export, apply the
manifest it carries (`apply_manifest(model, path)` needs nothing else), compare with eager.
On a CPU the manifest's CUDA-graph regions would run eager, so the demo overrides the backend
with aot_eager to show every region compiled, in place, with the state-dict keys unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from surgery import apply_manifest
from surgery.examples import ExampleModel, GlobalBlock, lingbot, tiny
from surgery.formats.source import load_exported


def main(argv: list[str] | None = None) -> int:
    """`python -m surgery.examples.demo EXPORTED.safetensors`: apply, compare, report."""

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = args[0]
    model = tiny().eval()
    model.load_state_dict(load_exported(path).state_dict, strict=True)
    frames = [model.example_input(seed=i) for i in range(3)]
    with torch.no_grad():
        expected = [model(x) for x in frames]
    model.reset_stream()
    keys = list(model.state_dict())

    def warmup(m: torch.nn.Module) -> None:
        m(frames[0])
        model.reset_stream()  # warm-up frames are not part of the stream

    overrides = {"backend": "aot_eager", "on_cpu": "compile"}
    # Said, not silent: without these the CPU runs the CUDA-graph regions eager (issue 12).
    print(f"overrides over the manifest's [compile] (this is a CPU demo): {overrides}")
    with torch.no_grad(), apply_manifest(model, path, warmup=warmup, overrides=overrides) as h:
        got = [model(x) for x in frames]
        print(h.report)
        assert list(model.state_dict()) == keys, "state-dict keys changed"
    diff = max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))
    print(f"outputs match eager (max abs diff {diff:.2e}); state-dict keys unchanged "
          f"({len(keys)}); restored")
    return 0 if diff < 1e-4 else 1



def swap_in_compiled_blocks(model: ExampleModel, **compile_kwargs: Any) -> ExampleModel:
    """LingBot-Map's hand-written recipe, module part: swap modules for compiled ones in place.

    Frame blocks, patch-embed blocks and every global block's `attn.proj` are replaced in their
    parents by `torch.compile(module, **compile_kwargs)`, so a state dict saved afterwards gains
    `_orig_mod.` in the middle of its keys. `torch.compile` is lazy: nothing compiles until the
    model runs.
    """
    agg = model.aggregator
    for blocks in (agg.frame_blocks, agg.patch_embed.blocks):
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i], **compile_kwargs)  # type: ignore[assignment]
    for blk in agg.global_blocks:
        assert isinstance(blk, GlobalBlock)
        blk.attn.proj = torch.compile(blk.attn.proj, **compile_kwargs)  # type: ignore[assignment]
    return model


def save_hand_compiled_checkpoint(path: str, *, size: str = "tiny") -> int:
    """Save the example model the way a hand-written regional-compile recipe leaves it.

    Returns how many keys carry `_orig_mod.`.
    """
    sd = swap_in_compiled_blocks(tiny() if size == "tiny" else lingbot()).state_dict()
    torch.save({"state_dict": sd, "epoch": 1}, path)
    return sum("_orig_mod." in k for k in sd)


def save_main(argv: list[str] | None = None) -> None:
    """`python -m surgery.examples OUT.pt`: write the demo's hand-compiled checkpoint."""

    ap = argparse.ArgumentParser(prog="python -m surgery.examples",
                                 description=save_main.__doc__)
    ap.add_argument("out", help="where to write the .pt checkpoint")
    ap.add_argument("--size", choices=["tiny", "lingbot"], default="tiny")
    args = ap.parse_args(argv)
    n = save_hand_compiled_checkpoint(args.out, size=args.size)
    print(f"wrote {args.out}: the {args.size} example model as a hand-written regional "
          f"compile saves it ({n} keys with _orig_mod.)")


if __name__ == "__main__":
    sys.exit(main())
