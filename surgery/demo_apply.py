"""The deployment half of `make demo`: load an exported file, apply its manifest, report.

    python -m surgery.demo_apply EXPORTED.safetensors

The exported file carries its manifest, so `apply_manifest(model, path)` needs nothing else.
On a CPU the manifest's CUDA-graph regions would run eager, so the demo overrides the backend
with aot_eager to show every region compiled, in place, with the state-dict keys unchanged.
"""

from __future__ import annotations

import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from surgery import apply_manifest
    from surgery.checkpoint import load_exported
    from surgery.examples import tiny

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = args[0]
    model = tiny().eval()
    model.load_state_dict(load_exported(path), strict=True)
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


if __name__ == "__main__":
    sys.exit(main())
