"""`surgery warm`: build the model, apply its manifest, warm up, and save the compile-cache bundle.

The bundle's format and its checks live in surgery.cache; this is the command's work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from surgery.cache import SavedBundle, default_bundle_path
from surgery.errors import CacheBundleError, OutputExistsError, SurgeryError


@dataclass
class WarmResult:
    bundle: SavedBundle
    report: Any  # the ApplyReport of the warm-up
    seconds: float  # apply + warm-up


def _same_file(a: str, b: str) -> bool:
    """Whether `a` and `b` name one file (through symlinks and hard links too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _call_with(model: Any, example: Any) -> Any:
    if isinstance(example, Mapping):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


def warm_start(model_spec: str, *, manifest: str, input_spec: str, device: str | None = None,
               dtype: str | None = None, out: str | None = None, force: bool = False,
               overrides: Mapping[str, Any] | None = None) -> WarmResult:
    """Build the model, apply the manifest, warm up with the example input, save the bundle.

    ``input_spec`` names a factory that receives the model and returns its input (a tensor,
    a tuple of positional arguments or a dict of keyword arguments). Warm-up runs under
    ``torch.no_grad()``, as inference does: grad mode is part of what dynamo guards on.
    """
    import torch

    from surgery.apply import apply_manifest, resolve_manifest
    from surgery.plan import load_factory

    m = resolve_manifest(manifest)
    target = out or default_bundle_path(m.source_path or manifest)
    if _same_file(target, manifest):
        raise SurgeryError(f"output {target!r} is the manifest being warmed",
                           hint="write the bundle elsewhere with -o (default: beside the "
                                "manifest, as STEM.surgery.cache); inputs are never modified")
    if os.path.exists(target) and not force:
        raise OutputExistsError(target)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise CacheBundleError("--device cuda was asked for, but torch sees no CUDA device",
                               path=target, hint="run on a GPU machine, or pass --device cpu")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    factory = load_factory(model_spec)
    make_input: Callable[[Any], Any] = load_factory(input_spec)
    try:
        model = factory()
    except Exception as e:  # the user's factory may fail in any way
        from surgery.errors import ModelSourceError

        raise ModelSourceError(f"--model {model_spec!r}: the factory failed: "
                               f"{type(e).__name__}: {e}",
                               hint="make the factory build the model without arguments"
                               ) from None
    model = model.to(device=dev, dtype=dtypes[dtype] if dtype else None).eval()
    example = make_input(model)
    # torch records every artifact of the process; the bundle should hold this model's only.
    try:
        from torch.compiler._cache import CacheArtifactManager

        CacheArtifactManager.clear()
    except ImportError:  # torch < 2.7: save_bundle says so below
        pass
    started = time.perf_counter()
    with torch.no_grad():
        handle = apply_manifest(model, m, warmup=lambda mod: _call_with(mod, example),
                                overrides=overrides)
    seconds = time.perf_counter() - started
    if not handle.report.with_status("compiled"):
        handle.restore()
        eager = handle.report.with_status("eager")
        why = f" ({eager[0].path}: {eager[0].reason})" if eager else ""
        raise CacheBundleError(
            f"no region ran compiled code in warm-up, so there is nothing to cache{why}",
            path=target, hint="on the CPU, CUDA-graph regions run eager: pass --overrides "
            "on_cpu=compile (and the same overrides to apply_manifest), or warm up on the GPU")
    saved = handle.save_cache(target, force=force)
    handle.restore()
    return WarmResult(saved, handle.report, seconds)
