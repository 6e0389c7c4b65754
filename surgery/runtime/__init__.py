"""Deployment: `apply_manifest` compiles a manifest's regions in place, warms them up and
captures their CUDA graphs; the signed compile-cache bundle; the report. Depends on
surgery.formats (the manifest, the fingerprint) and surgery.runtime.graphs only: nothing here
imports planning, hygiene or the CLI (tests/test_layers.py checks it).

The entry points are imported on first use (PEP 562), so importing a torch-free module of this
package (the bundle reader `surgery verify` uses) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "apply_manifest": "surgery.runtime.apply",
    "ApplyHandle": "surgery.runtime.apply",
    "mark_step": "surgery.runtime.apply",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'surgery.runtime' has no attribute {name!r}")
