"""Where a manifest comes from, and where its region paths lead on a live model.

A manifest comes as a Manifest, a ``.surgery.toml`` path, an exported ``.safetensors`` file that
carries it, or ``$SURGERY_MANIFEST``. A region path that does not resolve is an error naming the
closest real name, since a misspelt path (``fnn_residual``) would otherwise compile nothing.
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from surgery.errors import FingerprintMismatchError, ManifestError, RegionError
from surgery.formats.binding import Binding, bind
from surgery.formats.checkpoint import read_embedded_manifest
from surgery.formats.fingerprint import compute_fingerprint, model_keys
from surgery.formats.keys import collision_error
from surgery.formats.manifest import Manifest, Region, load_manifest
from surgery.formats.ties import binding_variants, declared_ties, live_ties, ties_note
from surgery.runtime.distributed import wrapped_child, wrapper_child
from surgery.runtime.piecewise_stack import check_fallbacks, standby_nesting
from surgery.runtime.report import RegionRecord, SurgeryWarning

ENV_MANIFEST = "SURGERY_MANIFEST"
ManifestSource = Manifest | str | os.PathLike[str] | None


# --- manifest sources --------------------------------------------------------------------------

def resolve_manifest(source: ManifestSource) -> Manifest:
    """A Manifest from a Manifest, a ``.toml`` path, an exported ``.safetensors``, or the env."""
    if source is None:
        env = os.environ.get(ENV_MANIFEST, "").strip()
        if not env:
            raise ManifestError(
                f"no manifest was given and {ENV_MANIFEST} is not set",
                hint=f"pass apply_manifest(model, 'model{'.surgery.toml'}'), or set "
                     f"{ENV_MANIFEST}=/path/to/model.surgery.toml")
        source = env
    if isinstance(source, Manifest):
        return source
    path = os.fspath(source)
    if path.endswith((".safetensors", ".index.json")):  # an export, single file or sharded
        return _embedded_manifest(path)
    return load_manifest(path)


def _embedded_manifest(path: str) -> Manifest:
    found = read_embedded_manifest(path)  # checked against its sha256 and the schema
    if found is None:
        raise ManifestError(f"{path}: carries no embedded surgery manifest", path=path,
                            hint="export it with `surgery export`, or pass the .surgery.toml")
    return found


# Wrappers whose inner model is what a manifest's paths name: the class, the attribute that
# holds the model, and what it is. Its state dict still binds (the wrapper segments are
# canonicalised away), so without this check every path failed as "has no submodule".
_WRAPPERS: tuple[tuple[str, str, str], ...] = (
    ("OptimizedModule", "_orig_mod", "torch.compile(model): pass the uncompiled model; surgery "
     "compiles the regions itself"),
    ("AveragedModel", "module", "an AveragedModel (EMA / SWA): pass its .module"),
    ("DistributedDataParallel", "module", "a DDP wrapper: pass its .module"),
    ("DataParallel", "module", "a DataParallel wrapper: pass its .module"),
)
# apply_manifest takes these as they are: its paths resolve through their .module, and each
# rank applies to its own DDP model (surgery.runtime.distributed). Planning needs the inner one.
_DATA_PARALLEL = ("DistributedDataParallel", "DataParallel")


def refuse_wrapper(model: object, *, what: str, data_parallel_ok: bool = False) -> None:
    """A RegionError for a model that is a wrapper around the model to compile, or no module
    (DDP and DataParallel pass with `data_parallel_ok`)."""
    if not isinstance(model, nn.Module):
        raise RegionError(f"{what} takes an nn.Module, not a {type(model).__name__}",
                          hint="pass the model (for a pipeline, its .transformer or .unet)")
    for cls, attr, says in _WRAPPERS:
        if data_parallel_ok and cls in _DATA_PARALLEL:
            continue
        if type(model).__name__ == cls and isinstance(getattr(model, attr, None), nn.Module):
            raise RegionError(f"{what}: the model is {says}", hint=f"{what}(model.{attr}, ...)")


def bind_model(model: nn.Module, manifest: Manifest, *, strict: bool = True) -> Binding:
    """Bind the manifest to the live model: canonical keys and shapes, not dtypes (a cast model
    binds, with a note). A mismatch says what differs (surgery.formats.binding) and raises, or warns
    with ``strict=False``. A wrapper (torch.compile, AveragedModel) is refused first; DDP is
    applied through."""

    refuse_wrapper(model, what="apply_manifest", data_parallel_ok=True)
    # The same naming as plan and export: canonical keys, EMA bookkeeping left out. Outside
    # inference mode: a DTensor parameter (tensor parallel) cannot be detached inside it.
    with torch.inference_mode(False):
        sd = model.state_dict()
    mk = model_keys(list(sd))
    if mk.collisions:
        raise collision_error(mk.collisions, source="the live model")
    where = manifest.source_path or "the manifest"
    table = {c: sd[k] for k, c in mk.names.items()}
    binding = bind(manifest.fingerprint, manifest.model, table, where=where)
    if binding.matches:
        return binding
    tied = _bind_tied(model, manifest, table, where)
    if tied is not None:
        return tied
    msg = (f"{where} was planned for a different model (its fingerprint is "
           f"{manifest.fingerprint}, the live model's {binding.actual}): {binding.problem}")
    if strict:
        raise FingerprintMismatchError(msg, expected=manifest.fingerprint, actual=binding.actual,
                                       hint=binding.hint)
    warnings.warn(f"surgery: {msg} (strict=False: applying anyway)", SurgeryWarning,
                  stacklevel=3)
    binding.notes.append(f"fingerprint mismatch, applied anyway (strict=False): "
                         f"{binding.problem}")
    return binding


def _bind_tied(model: nn.Module, manifest: Manifest, table: dict, where: str) -> Binding | None:
    """A binding where the plan saw a tied parameter under fewer names (surgery.formats.ties)."""
    ties = live_ties(model)
    declared = declared_ties(model)
    for variant, left in binding_variants(table, ties, declared=declared):
        if compute_fingerprint(variant, canonical=True) != manifest.fingerprint:
            continue
        found = bind(manifest.fingerprint, manifest.model, variant, where=where)
        found.notes.insert(0, ties_note(left, {**ties, **declared}, where=where))
        return found
    return None


def check_fingerprint(model: nn.Module, manifest: Manifest, *, strict: bool = True) -> str:
    """The live model's fingerprint, once bound to the manifest (see bind_model)."""
    return bind_model(model, manifest, strict=strict).actual


# --- resolution --------------------------------------------------------------------------------

def closest_name(name: str, candidates: Sequence[str]) -> str | None:
    hits = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


def resolve_path(model: nn.Module, path: str, *, callable: str) -> tuple[nn.Module, str]:
    """(module, attribute name) for a region path, or RegionError naming the closest real name.

    ``forward`` paths are module paths; ``method`` paths end in a method of the module before.
    """
    parts = path.split(".")
    mod_parts = parts if callable == "forward" else parts[:-1]
    mod: nn.Module = model
    for i, seg in enumerate(mod_parts):
        child = wrapped_child(mod, seg)  # through DDP's .module and the like
        if child is None:
            children = dict(mod.named_children())
            here = ".".join(parts[:i]) or "the model"
            near = closest_name(seg, list(children))
            if near is None and callable == "forward" and i == len(mod_parts) - 1:
                near = closest_name(seg, _methods(mod))  # a method listed as a forward region
            guess = ".".join([*parts[:i], near, *parts[i + 1:]]) if near else None
            raise RegionError(
                f"region path {path!r} does not resolve: {here} ({type(mod).__name__}) has no "
                f"submodule {seg!r}" + (f"; did you mean {guess!r}?" if guess else
                                        f"; it has {sorted(children)[:8]}"),
                region=path, hint="fix the path in the manifest, or plan it again")
        mod = child
    if callable == "forward":
        return mod, "forward"
    name = parts[-1]
    owner = ".".join(parts[:-1]) or "the model"
    while _own_method(type(mod), name) is None and (inner := wrapper_child(mod)) is not None:
        mod = inner  # a method of the model itself, under DDP
    if isinstance(getattr(mod, name, None), nn.Module):
        raise RegionError(
            f"region path {path!r} names a submodule, not a method", region=path,
            hint=f"list {path!r} in a region with callable = \"forward\"")
    if (name.startswith("__") and name.endswith("__")) or hasattr(nn.Module, name):
        # A manifest is data: it may pick one of the model's own methods, never a special method
        # or nn.Module's API (__init__, __setattr__, state_dict, to), which apply would replace.
        raise RegionError(
            f"region path {path!r} names {name!r}, which is "
            + ("a special method" if name.startswith("__") else "nn.Module's own API")
            + f", not a method defined by {type(mod).__name__}", region=path,
            hint="a method region names a plain method of the model's own class (e.g. "
                 "attn_pre); to compile the whole module, use callable = \"forward\" on its path")
    attr = _own_method(type(mod), name)
    if attr is None:
        near = closest_name(name, _methods(mod))
        guess = f"{owner}.{near}" if near and owner != "the model" else near
        raise RegionError(
            f"region path {path!r} does not resolve: {owner} ({type(mod).__name__}) has no "
            f"method {name!r}" + (f"; did you mean {guess!r}?" if guess else ""),
            region=path, hint="fix the method name in the manifest, or plan it again")
    return mod, name


# Modules of the library base classes a model class inherits its hub and I/O API from
# (save_pretrained, push_to_hub, from_pretrained, generate ...): a manifest is data and may
# name a method of the model's own classes, never theirs, which write files or reach the hub.
LIBRARY_BASE_MODULES: tuple[str, ...] = (
    "transformers.modeling_utils", "transformers.generation", "transformers.integrations",
    "transformers.utils", "huggingface_hub", "diffusers.models.modeling_utils",
    "diffusers.configuration_utils", "diffusers.loaders", "diffusers.utils", "accelerate",
    "lightning", "pytorch_lightning", "peft",
)


def _library_base(klass: type) -> bool:
    module = getattr(klass, "__module__", "") or ""
    return any(module == m or module.startswith(m + ".") for m in LIBRARY_BASE_MODULES)


def _own_method(klass: type, name: str) -> object | None:
    """The plain function ``name`` that ``klass`` or a base below nn.Module defines, or None
    (a staticmethod, classmethod, property or instance attribute is not a method region, and
    neither is a method of a library base class: `LIBRARY_BASE_MODULES`)."""
    for base in klass.__mro__:
        if base in (nn.Module, object) or _library_base(base):
            return None
        if name in vars(base):
            found = vars(base)[name]
            return found if inspect.isfunction(found) else None
    return None


def _methods(mod: nn.Module) -> list[str]:
    names: set[str] = set()
    for klass in type(mod).__mro__:
        if klass in (nn.Module, object) or _library_base(klass):
            break
        names.update(n for n, v in vars(klass).items()
                     if not n.startswith("_") and inspect.isfunction(v))
    return sorted(names)


def resolve_regions(model: nn.Module, manifest: Manifest, records: list[Any]
                    ) -> list[tuple[Region, str, nn.Module, str]]:
    """``(region, path, module, name)`` of every region path of the manifest. An optional path
    that does not resolve gets a ``skipped`` record in ``records``; required ones that do not
    are raised together, in one RegionError."""
    resolved: list[tuple[Region, str, nn.Module, str]] = []
    problems: list[RegionError] = []
    for region in manifest.regions:
        for path in region.paths:
            try:
                mod, name = resolve_path(model, path, callable=region.callable)
            except RegionError as e:
                if region.required:
                    problems.append(e)
                else:
                    records.append(RegionRecord(path, region.kind, region.callable, "skipped",
                                                f"optional and not found: {e.message}"))
                continue
            resolved.append((region, path, mod, name))
    if problems:
        first = problems[0]
        more = "".join(f"\n  {p.message}" for p in problems[1:])
        raise RegionError(first.message + more, region=first.region, hint=first.hint)
    return resolved


def _check_nesting(resolved: list[tuple[Region, str, nn.Module, str]]) -> None:
    """A region inside a forward region would never run compiled: the outer graph inlines it.
    The one exception: a block standing by for its piecewise stack (runtime.piecewise_stack)."""
    check_fallbacks(resolved)
    # Each path's own prefixes are looked up in a dict: linear in the paths times their depth
    # (comparing every path with every forward path took 44 s for 8000 paths).
    forwards = {p: r for r, p, _, _ in resolved if r.callable == "forward"}
    for region, path, _, _ in resolved:
        owner = path if region.callable == "forward" else path.rsplit(".", 1)[0]
        parts = owner.split(".")
        for depth in range(len(parts), 0, -1):
            outer = ".".join(parts[:depth]) if depth < len(parts) else owner
            if outer != path and outer in forwards and \
                    not standby_nesting(region, path, outer, forwards[outer]):
                raise RegionError(
                    f"region path {path!r} is inside region {outer!r}: the outer graph would "
                    "inline it, so it would never run its own compiled code", region=path,
                    hint="keep one of the two (`surgery plan` resolves nesting)")


def callable_at(mod: nn.Module, name: str, *, path: str) -> tuple[Any, Any, bool, Any]:
    """``(own, eager, bound, function)`` of the callable a region replaces on ``mod.name``: what
    the instance dict holds (restored as it was), the callable itself, whether it is a method
    bound to ``mod``, and the plain function to compile. A slot of another live handle there is
    refused: two handles would each restore the other's wrapper."""
    own = vars(mod).get(name)
    if getattr(own, "__surgery_slot__", None) is not None:
        raise RegionError(f"region path {path!r} is already compiled by another "
                          "apply_manifest handle", region=path,
                          hint="restore() the first handle before applying again")
    eager = getattr(mod, name)
    bound = inspect.ismethod(eager) and eager.__self__ is mod
    return own, eager, bound, (eager.__func__ if bound else eager)
