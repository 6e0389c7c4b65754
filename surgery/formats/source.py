"""Which file an argument names: a checkpoint file or model folder, a manifest or an export.

Contract:
- A file is used as given. Its kind comes from its suffix (checkpoint.checkpoint_kind) or from
  the format the user names (`--format safetensors|torch|index`), never from its bytes.
- A folder holding ``.metadata`` is a DCP checkpoint (torch.distributed.checkpoint) and is read
  as itself (surgery.formats.dcp).
- A folder (what ``save_pretrained`` writes in transformers and diffusers) resolves to the one
  weights file in it, by the names those libraries write. Safetensors wins over pickle, as it
  does when those libraries load a folder; a sharded ``*.index.json`` stands for its shards.
- A folder holding two or more candidates of the same standing is refused with the list, so the
  user names one; a guess would plan or export the wrong model without a word.
- A manifest argument is a ``.surgery.toml`` or an export that embeds one (``.safetensors``, a
  sharded ``*.index.json``), as `apply_manifest` takes it; reading it never imports torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

from surgery.errors import CheckpointError, ManifestError, ModelSourceError
from surgery.formats.checkpoint import (
    load_export_tensors,
    read_embedded_manifest,
    read_embedded_manifest_text,
)
from surgery.formats.dcp import METADATA_NAME, is_dcp_folder
from surgery.formats.manifest import Manifest, parse_manifest, read_manifest_file
from surgery.formats.tensors import (
    INDEX_SUFFIX,
    PICKLE_SUFFIXES,
    SAFETENSORS_SUFFIXES,
    checkpoint_kind,
)

# The CLI's --format names -> checkpoint kinds (checkpoint.KINDS).
FORMATS: dict[str, str] = {"safetensors": "safetensors", "torch": "pickle", "index": "sharded",
                           "dcp": "dcp"}

# What save_pretrained writes for one file of weights: transformers (model.*, pytorch_model.*)
# and diffusers (diffusion_pytorch_model.*). Sharded saves write NAME.index.json instead.
_PRETRAINED_NAMES: tuple[str, ...] = (
    "model.safetensors", "diffusion_pytorch_model.safetensors",
    "pytorch_model.bin", "diffusion_pytorch_model.bin",
)


@dataclass(frozen=True)
class ResolvedSource:
    """The checkpoint file to read, its kind (None: from its suffix) and how it was found."""

    path: str
    kind: str | None
    note: str | None = None  # e.g. "DIR is a folder: using DIR/model.safetensors"


def format_kind(format: str | None) -> str | None:
    """The checkpoint kind a --format name selects (None: from the file's suffix)."""
    if format is None:
        return None
    if format not in FORMATS:
        raise CheckpointError(f"unknown --format {format!r}", path="",
                              hint=f"one of {', '.join(FORMATS)}")
    return FORMATS[format]


def _standing(name: str) -> int | None:
    """0 for safetensors weights, 1 for pickle weights, None for anything else in a folder."""
    if name.endswith(INDEX_SUFFIX):
        inner = name[: -len(INDEX_SUFFIX)]
        return 0 if inner.endswith(SAFETENSORS_SUFFIXES) else 1
    if name in _PRETRAINED_NAMES:
        return 0 if name.endswith(SAFETENSORS_SUFFIXES) else 1
    return None


def folder_candidates(folder: str) -> list[str]:
    """The weights files a folder offers, best first (base names)."""
    names = sorted(os.listdir(folder))
    found = [n for n in names if os.path.isfile(os.path.join(folder, n))
             and _standing(n) is not None]
    if not found:
        # Not a save_pretrained folder: accept one lone checkpoint file of any known suffix.
        found = [n for n in names if os.path.isfile(os.path.join(folder, n))
                 and n.endswith((*SAFETENSORS_SUFFIXES, *PICKLE_SUFFIXES))]
        return found
    return sorted(found, key=lambda n: (_standing(n), names.index(n)))


# The denoisers first: they are what a pipeline's compile regions are for.
_PIPELINE_FIRST = ("transformer", "unet", "prior", "decoder")


def _pipeline_models(folder: str) -> list[str]:
    """The subfolders of a pipeline folder that hold weights, denoisers first (else [])."""
    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        return []
    subs = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n))
                  and any(_standing(f) is not None for f in os.listdir(os.path.join(folder, n))))
    return sorted(subs, key=lambda n: (n not in _PIPELINE_FIRST, n))


def resolve_checkpoint(path: str, *, format: str | None = None) -> ResolvedSource:
    """The file to read for `path` (a file, or a save_pretrained folder) and its kind."""
    kind = format_kind(format)
    if not os.path.exists(path):  # before the suffix: "no such file" says more than its type
        raise CheckpointError(f"{path}: no such file or folder", path=path,
                              hint="check the path")
    if not os.path.isdir(path):
        return ResolvedSource(path, kind)
    if is_dcp_folder(path) and kind in (None, "dcp"):
        return ResolvedSource(path, "dcp")  # a DCP save is the folder itself
    if kind == "dcp":
        raise CheckpointError(f"{path}: not a DCP checkpoint (no {METADATA_NAME} in it)",
                              path=path, hint="give the folder torch.distributed.checkpoint."
                              "save wrote, which holds .metadata and *.distcp files")
    found = folder_candidates(path)
    if not found:
        models = _pipeline_models(path)
        if models:  # a diffusers pipeline: one save_pretrained folder per model inside it
            shown = ", ".join(os.path.join(path, m, "") for m in models[:6])
            raise CheckpointError(
                f"{path}: a pipeline folder (model_index.json), not one model; its models are "
                f"in {shown}", path=path,
                hint=f"plan one model of it, e.g. surgery plan {os.path.join(path, models[0], '')}"
                " (the denoiser: transformer/ or unet/)")
        raise CheckpointError(
            f"{path}: a folder with no checkpoint in it", path=path,
            hint="give the weights file itself; a save_pretrained folder holds model.safetensors, "
            "diffusion_pytorch_model.safetensors, pytorch_model.bin or a *.index.json")
    best = [n for n in found if _standing(n) == _standing(found[0])]
    if len(best) > 1:
        listed = ", ".join(found)
        raise CheckpointError(
            f"{path}: a folder holding {len(found)} checkpoints ({listed}); which one?",
            path=path, hint=f"give the file itself, e.g. {os.path.join(path, found[0])}")
    chosen = os.path.join(path, found[0])
    skipped = found[1:]
    also = f" (not {', '.join(skipped)})" if skipped else ""
    return ResolvedSource(chosen, kind, f"{path} is a folder: using {chosen}{also}")


# --- manifests --------------------------------------------------------------------------------

def load_manifest_file(path: str) -> Manifest:
    """A manifest from a ``.surgery.toml`` file or the export (``.safetensors``, sharded
    ``*.index.json``) that embeds one, as `apply_manifest` accepts. Never imports torch."""
    return parse_manifest(read_manifest_text(path), path=path)


def read_manifest_text(path: str) -> str:
    """The manifest's TOML text, from its file or from the export that embeds it."""
    if path.endswith((".safetensors", INDEX_SUFFIX)) and os.path.isfile(path):
        text = read_embedded_manifest_text(path)
        if text is None:
            raise ManifestError(f"{path}: carries no embedded surgery manifest", path=path,
                                hint="export it with `surgery export --manifest M`, or pass "
                                "the .surgery.toml")
        return text
    return read_manifest_file(path)


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
    return Exported(load_export_tensors(p), manifest)


def load_factory(spec: str) -> Any:
    """Resolve ``package.module:factory`` (the current folder is importable, as with python -m)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ModelSourceError(f"--model {spec!r} is not of the form package.module:factory",
                               hint="e.g. --model surgery.examples:tiny")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ModelSourceError(f"--model {spec!r}: cannot import {mod_name!r}: "
                               f"{e.__class__.__name__}: {e}",
                               hint="check the module name and that it imports on its own"
                               ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelSourceError(f"--model {spec!r}: {mod_name!r} has no attribute {part!r}",
                                   hint="name a function or class that returns an nn.Module"
                                   ) from None
        except Exception as e:  # a lazy module (transformers) imports the name on access
            raise ModelSourceError(
                f"--model {spec!r}: {mod_name}.{part} exists but fails to import: "
                f"{e.__class__.__name__}: {' '.join(str(e).split())[:300]}",
                hint=f"run `python -c \"from {mod_name} import {part}\"` to see why: usually "
                     "a dependency of that package that is missing or built for another torch"
            ) from None
    if not callable(obj):
        raise ModelSourceError(f"--model {spec!r} is not callable",
                               hint="name a function or class that returns an nn.Module")
    return obj
