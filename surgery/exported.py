"""`surgery.load_exported(path)`: the deployment side of `surgery export`.

An export is one artifact: prefix-free safetensors (one file, or shards behind an index) with
the manifest it was bound to embedded in its metadata. Loading it gives both halves, so a
deployment needs one path: the weights for ``load_state_dict`` and the manifest for
``apply_manifest``. The manifest's embedded text is checked against its recorded sha256 and the
schema; the tensors are read with safetensors, never with pickle.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from surgery.checkpoint import checkpoint_kind, read_embedded_manifest
from surgery.checkpoint import load_exported as _load_tensors
from surgery.errors import CheckpointError
from surgery.manifest import Manifest
from surgery.source import resolve_checkpoint


class Exported(NamedTuple):
    """What an export holds: ``state_dict, manifest = surgery.load_exported(path)``."""

    state_dict: dict[str, Any]  # name -> torch.Tensor; tied names share one tensor
    manifest: Manifest | None  # None when it was exported without --manifest


def load_exported(path: str | os.PathLike[str]) -> Exported:
    """Load an export (a ``.safetensors`` file, a sharded ``*.index.json``, or the folder that
    holds one) as its state dict and its embedded manifest.

    ``model.load_state_dict(state_dict, strict=True)`` fits the unwrapped model, and
    ``apply_manifest(model, manifest)`` compiles its regions (the manifest's fingerprint binds
    it to these weights).
    """
    p = resolve_checkpoint(os.fspath(path)).path
    if checkpoint_kind(p) not in ("safetensors", "sharded"):
        raise CheckpointError(f"{p}: not a safetensors export", path=p,
                              hint=f"export it first: surgery export {p} -o model.safetensors")
    manifest = read_embedded_manifest(p)
    return Exported(_load_tensors(p), manifest)
