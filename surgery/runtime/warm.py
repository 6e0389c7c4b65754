"""`surgery warm`: build the model, apply its manifest, warm up, and save the compile-cache bundle.

The bundle's format and its checks live in surgery.runtime.cache and surgery.runtime.bundle, its
precompiled part in surgery.runtime.precompiled; this is the command's work. Warm-up runs either
a STEP, the same callable ``surgery plan --input`` takes (it receives the model and runs one
step: a streaming model shows every signature only over several steps), ``steps`` times; or, the
older form, the model called on what an example-input factory returns.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from surgery.errors import (
    CacheBundleError,
    CheckpointError,
    ModelSourceError,
    OutputExistsError,
    SurgeryError,
)
from surgery.formats.checkpoint import read_index
from surgery.formats.source import load_factory
from surgery.formats.tensors import INDEX_SUFFIX
from surgery.runtime.apply import apply_manifest
from surgery.runtime.bundle import default_bundle_path
from surgery.runtime.cache import SavedBundle
from surgery.runtime.resolve import resolve_manifest
from surgery.runtime.signing import ENV_KEY_FILE, require_key

# What `warm --input` says since `--step` exists: the two commands' --input differ.
OLD_INPUT_NOTE = ("--input here names an example-input factory (the older form, still "
                  "supported); `surgery plan --input` takes a STEP, and so does `warm --step`")


@dataclass
class WarmResult:
    bundle: SavedBundle
    report: Any  # the ApplyReport of the warm-up
    seconds: float  # apply + warm-up
    notes: list[str] = field(default_factory=list)


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


def _inputs(manifest: str, *, key_file: str | None, factories: list[Callable[..., Any]]
            ) -> list[str]:
    """Every file warm reads: the manifest (and the shards of a sharded export's index), the
    key file, and the modules of the factories. The bundle may overwrite none of them."""
    # The key files: the one given and the environment's, even when another key is used
    # (issue 22: `warm -o $SURGERY_CACHE_KEY_FILE --force` overwrote the signing key).
    keys = [k for k in (key_file, os.environ.get(ENV_KEY_FILE)) if k]
    files = [manifest, *keys]
    if manifest.endswith(INDEX_SUFFIX):
        # Read as every index is (bounded, shards kept in its folder); a broken one is reported
        # by reading the manifest, here it only adds names.
        with contextlib.suppress(CheckpointError):
            files += sorted(set(read_index(manifest).values()))
    for factory in factories:
        module = sys.modules.get(getattr(factory, "__module__", "") or "")
        file = getattr(module, "__file__", None)
        if file:
            files.append(str(file))
    return files


def _refuse_overwriting_inputs(target: str, inputs: list[str]) -> None:
    """--force replaces an old bundle, never the manifest or anything else warm reads."""
    real = os.path.realpath(target)
    for i, path in enumerate(inputs):
        if os.path.realpath(path) == real or _same_file(target, path):
            what = "the manifest being warmed" if i == 0 else f"{path!r}, an input of this command"
            raise CacheBundleError(
                f"output {target!r} is {what}: writing the bundle there would destroy it",
                path=target, hint="write the bundle elsewhere with -o (default: beside the "
                                  "manifest, as STEM.surgery.cache); inputs are never modified")


def warm_start(model_spec: str, *, manifest: str, input_spec: str | None = None,
               step_spec: str | None = None, steps: int | None = None,
               device: str | None = None, dtype: str | None = None, out: str | None = None,
               force: bool = False, overrides: Mapping[str, Any] | None = None,
               key_file: str | None = None, precompile: bool = True, aoti: bool = False
               ) -> WarmResult:
    """Build the model, apply the manifest, warm up, save the bundle.

    The bundle is signed with the deployer's key (``key_file``, else $SURGERY_CACHE_KEY or
    $SURGERY_CACHE_KEY_FILE: surgery.runtime.signing); without one nothing is compiled and a
    CacheKeyError says how to make one. The output may not be any file this command reads.

    Exactly one of ``step_spec`` and ``input_spec``. ``step_spec`` names a STEP, a callable
    that receives the model and runs one step (what ``surgery plan --input`` takes); it runs
    ``steps`` times (default: the manifest's ``warmup.passes``). ``input_spec`` names a factory
    that receives the model and returns its input (a tensor, a tuple of positional arguments or
    a dict of keyword arguments), the older form. Warm-up runs under ``torch.no_grad()``, as
    inference does: grad mode is part of what dynamo guards on. With ``precompile`` the
    bundle also holds each group's code compiled ahead of time (surgery.runtime.precompiled);
    with ``aoti``, an AOTInductor package for each too (surgery.runtime.aoti_build).
    """
    import torch

    if (step_spec is None) == (input_spec is None):
        raise ModelSourceError("give either a STEP (--step PKG.MOD:STEP) or an example-input "
                               "factory (--input PKG.MOD:FACTORY), not both or neither",
                               hint="--step surgery.examples:stream_step runs one streaming "
                                    "step per warm-up pass")
    if steps is not None and steps < 1:
        raise ModelSourceError(f"--steps {steps}: at least one warm-up step is needed",
                               hint="use --steps 2 or more (a CUDA graph is captured on a "
                                    "signature's second call)")

    m = resolve_manifest(manifest)
    target = out or default_bundle_path(m.source_path or manifest)
    _refuse_overwriting_inputs(target, _inputs(manifest, key_file=key_file, factories=[]))
    key = require_key(key_file)  # before any work: an unsigned bundle is never written
    if os.path.exists(target) and not force:
        raise OutputExistsError(target)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise CacheBundleError("--device cuda was asked for, but torch sees no CUDA device",
                               path=target, hint="run on a GPU machine, or pass --device cpu")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    factory = load_factory(model_spec)
    driver: Callable[[Any], Any] = _load_driver(step_spec or input_spec or "", step=bool(
        step_spec))
    _refuse_overwriting_inputs(target, _inputs(manifest, key_file=key_file,
                                               factories=[factory, driver]))
    try:
        model = factory()
    except Exception as e:  # the user's factory may fail in any way

        raise ModelSourceError(f"--model {model_spec!r}: the factory failed: "
                               f"{type(e).__name__}: {e}",
                               hint="make the factory build the model without arguments"
                               ) from None
    model = model.to(device=dev, dtype=dtypes[dtype] if dtype else None).eval()
    notes: list[str] = []
    if step_spec is not None:
        def warmup(mod: Any) -> Any:
            return driver(mod)
    else:
        notes.append(OLD_INPUT_NOTE)
        example = _model_step(lambda: driver(model), input_spec or "", dtype=dtype)

        def warmup(mod: Any) -> Any:
            return _call_with(mod, example)
    # torch records every artifact of the process; the bundle should hold this model's only.
    try:
        from torch.compiler._cache import CacheArtifactManager

        CacheArtifactManager.clear()
    except ImportError:  # torch < 2.7: save_bundle says so below
        pass
    started = time.perf_counter()
    with torch.no_grad():
        handle = _model_step(lambda: apply_manifest(model, m, warmup=warmup,
                                                    overrides=overrides, passes=steps),
                             step_spec or input_spec or "", dtype=dtype)
    seconds = time.perf_counter() - started
    if not handle.report.with_status("compiled"):
        handle.restore()
        eager = handle.report.with_status("eager")
        why = f" ({eager[0].path}: {eager[0].reason})" if eager else ""
        raise CacheBundleError(
            f"no region ran compiled code in warm-up, so there is nothing to cache{why}",
            path=target, hint="on the CPU, CUDA-graph regions run eager: pass --overrides "
            "on_cpu=compile (and the same overrides to apply_manifest), or warm up on the GPU")
    try:
        saved = handle.save_cache(target, force=force, key=key, precompile=precompile,
                                  aoti=aoti)
    finally:
        handle.restore()
    return WarmResult(saved, handle.report, seconds, notes)


def _model_step(run: Callable[[], Any], spec: str, *, dtype: str | None) -> Any:
    """Run the user's step (or input factory): what it raises is the user's, not a surgery bug.

    apply_manifest lets through only what the model's own code raises (a region that fails to
    compile falls back to eager), so an exception here is the step's. The commonest one: the
    model was cast with --dtype while the input factory still returns float32 tensors.
    """
    try:
        return run()
    except SurgeryError:
        raise
    except Exception as e:  # the user's model and step may fail in any way
        text = " ".join(str(e).split())[:300]
        hint = "run the step on its own, eager, to see the failure"
        if dtype and any(w in text for w in ("dtype", "Half", "BFloat16", "Float", "Double")):
            hint = (f"--dtype {dtype} casts the model; make the example inputs match it "
                    f"(e.g. return x.to(next(model.parameters()).dtype))")
        raise ModelSourceError(f"the warm-up step {spec!r} failed in the model: "
                               f"{type(e).__name__}: {text}", hint=hint) from None


def _load_driver(spec: str, *, step: bool) -> Callable[[Any], Any]:
    """The STEP (``--step``) or the example-input factory (``--input``), named by its flag."""
    flag = "--step" if step else "--input"
    try:
        return load_factory(spec)  # type: ignore[no-any-return]
    except ModelSourceError as e:
        raise ModelSourceError(str(e).replace("--model", flag, 1),
                               hint="name a callable that takes the model and runs one step, "
                               "e.g. --step surgery.examples:stream_step" if step else e.hint
                               ) from None
