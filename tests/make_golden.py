"""Regenerate the golden manifests of the tiny example model (`make golden`).

Review the result as a diff: a change here is a change in what `surgery plan` writes.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden")
CHECKPOINT_NAME = "tiny.safetensors"


def golden_texts() -> dict[str, str]:
    """File name -> manifest text, planned from a tiny checkpoint and from the live model."""
    from safetensors.torch import save_file

    from surgery.examples import tiny
    from surgery.formats.manifest import dumps_manifest
    from surgery.planning.plan import plan_checkpoint, plan_model

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, CHECKPOINT_NAME)
        save_file(tiny().state_dict(), ckpt)
        from_ckpt = dumps_manifest(plan_checkpoint(ckpt).manifest)
    from_live = dumps_manifest(plan_model("surgery.examples:tiny").manifest)
    # a piecewise region (issue 19): its [region.piecewise] table is a layout of its own
    piecewise = dumps_manifest(plan_model("surgery.examples:tiny_sdpa", piecewise=True).manifest)
    return {"tiny-checkpoint.surgery.toml": from_ckpt, "tiny-live.surgery.toml": from_live,
            "tiny-sdpa-piecewise.surgery.toml": piecewise}


def main() -> None:
    os.makedirs(GOLDEN, exist_ok=True)
    for name, text in golden_texts().items():
        with open(os.path.join(GOLDEN, name), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote tests/golden/{name}", file=sys.stderr)


if __name__ == "__main__":
    main()
