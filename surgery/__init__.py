"""surgery: make PyTorch models compile-ready for deployment.

The runtime API is imported lazily (PEP 562), so `import surgery` and the CLI's start-up do not
pay for `import torch` until a tensor is touched.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "compile_regions": "surgery.planning.compile_regions",
    "apply_manifest": "surgery.runtime.apply",
    "mark_step": "surgery.runtime.apply",
    "ApplyHandle": "surgery.runtime.apply",
    "RegionRecord": "surgery.runtime.apply",
    "load_manifest": "surgery.formats.manifest",
    "load_exported": "surgery.formats.source",
    "Exported": "surgery.formats.source",
    "Manifest": "surgery.formats.manifest",
    "Region": "surgery.formats.manifest",
    "SurgeryError": "surgery.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'surgery' has no attribute {name!r}")
