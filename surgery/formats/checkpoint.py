"""The I/O edge for checkpoints: read keys, shapes and dtypes; never execute a checkpoint.

- ``.safetensors``: the header only, parsed here, so no tensor data is read and torch is not
  imported.
- ``.pt`` / ``.pth`` / ``.ckpt`` / ``.bin``: ``torch.load(weights_only=True, mmap=True)``.
- a sharded checkpoint through its ``*.index.json``, whose shard names must stay in its folder.
- a DCP folder (``torch.distributed.checkpoint``) through its ``.metadata``, read as data
  (surgery.formats.dcp).
A state dict nested in a container (``state_dict``, ``model``, ``ema`` ...) is found and the
entry used is reported (surgery.formats.pickled).

Reading an export back lives here too: the manifest `surgery export` embedded in the metadata
(checked against its recorded sha256 and the schema) and the tensors, tied names restored.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from surgery.errors import CheckpointError, ManifestError
from surgery.formats.dcp import read_dcp
from surgery.formats.limits import read_regular
from surgery.formats.manifest import Manifest, parse_manifest
from surgery.formats.pickled import (
    _infos_from_state_dict,
    optimizer_entries,
    select_state_dict,
    torch_load_safely,
)
from surgery.formats.safejson import UntrustedJSONError, load_untrusted_json
from surgery.formats.st_file import read_aliases, read_safetensors_header, read_safetensors_layout
from surgery.formats.tensors import (
    INDEX_SUFFIX,
    META_MANIFEST_KEYS,
    META_MANIFEST_SHA256,
    CheckpointInfo,
    TensorInfo,
    _require_file,
    checkpoint_kind,
    embedded_entry,
)


def refuse_key_for_safetensors(path: str, key: str | None) -> None:
    """`--key` chooses a container entry; a safetensors file has none."""
    if key is not None:
        raise CheckpointError(f"{path}: --key does not apply to safetensors files",
                              path=path, hint="drop --key; a safetensors file is flat")


def read_checkpoint(path: str, *, key: str | None = None, kind: str | None = None
                    ) -> CheckpointInfo:
    """Read the keys, shapes and dtypes of any supported checkpoint (`kind`: not by suffix)."""
    kind = checkpoint_kind(path, kind=kind)
    if kind == "safetensors":
        refuse_key_for_safetensors(path, key)
        tensors, meta, _ = read_safetensors_header(path)
        return CheckpointInfo(path, kind, tensors, metadata=meta, files=[path])
    if kind == "pickle":
        obj = torch_load_safely(path)
        sd, entry, cands, ignored = select_state_dict(obj, path=path, key=key)
        optimizer = optimizer_entries(obj)
        others = {}
        for c in cands:
            if c != entry:
                cur: Any = obj
                for part in c.split("/"):
                    cur = cur[part]
                others[c] = [str(k) for k in cur]
        return CheckpointInfo(path, kind, _infos_from_state_dict(sd), entry=entry,
                              candidates=cands, files=[path], optimizer=optimizer,
                              ignored=[i for i in ignored if i not in optimizer], others=others)
    if kind == "dcp":
        return read_dcp(path, key=key)
    return _read_sharded(path, key=key)


# An index names one file per key; a real one for a million tensors is ~100 MB. Refuse more.
_MAX_INDEX_BYTES = 256 * 1024 * 1024
# {"metadata": {...}, "weight_map": {key: file}}: 2 deep; extra fields get a little room.
_MAX_INDEX_DEPTH = 8
_BAD_INDEX_HINT = "an index is JSON with a 'weight_map' of key -> shard file"


def _load_index(path: str) -> dict[str, Any]:
    """An index file's JSON object, read as untrusted input (bounded size and depth)."""
    _require_file(path)
    try:
        index = load_untrusted_json(read_regular(path, max_bytes=_MAX_INDEX_BYTES),
                                    max_bytes=_MAX_INDEX_BYTES, max_depth=_MAX_INDEX_DEPTH)
    except OverflowError as e:
        raise CheckpointError(f"{path}: not a valid sharded-checkpoint index ({e.args[0]} "
                              f"bytes, more than the {_MAX_INDEX_BYTES} allowed)", path=path,
                              hint=_BAD_INDEX_HINT) from None
    except OSError as e:  # NotRegularFile too: replaced by a FIFO or device after the check
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})", path=path) from None
    except UntrustedJSONError as e:
        raise CheckpointError(f"{path}: not a valid sharded-checkpoint index ({e})", path=path,
                              hint=_BAD_INDEX_HINT) from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{path}: not a valid sharded-checkpoint index (a JSON "
                              f"{type(index).__name__}, not an object)", path=path,
                              hint=_BAD_INDEX_HINT)
    return index


def _shard_path(path: str, base: str, key: str, name: str) -> str:
    """The shard file `name` as the index at `path` names it, kept inside the index's folder.

    A shard is a plain relative file name below the folder: no absolute path, no `..`, and not
    another index (an index naming itself, or two naming each other, would loop). Only the
    name is checked, not where a symlink leads: hub caches link shards into a blobs folder.
    """
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts \
            or "\0" in name or (len(name) > 1 and name[1] == ":"):
        raise CheckpointError(f"{path}: shard {name[:120]!r} of key {key[:80]!r} lies outside "
                              "the index's folder", path=path,
                              hint="shard names in an index are file names beside it")
    if name.endswith(INDEX_SUFFIX):
        raise CheckpointError(f"{path}: shard {name[:120]!r} is itself an index; an index "
                              "names shard files, not other indexes", path=path,
                              hint="point at the index that names the .safetensors/.bin shards")
    return os.path.join(base, os.path.normpath(name))


def read_index(path: str) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: key -> shard file (absolute path).

    The index is untrusted: its weight_map must be an object of string -> string, and every
    shard must be a file inside the index's folder (see `_shard_path`).
    """
    weight_map = _load_index(path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: not a valid sharded-checkpoint index (no 'weight_map' "
                              "object)", path=path, hint=_BAD_INDEX_HINT)
    base = os.path.dirname(os.path.abspath(path))
    out: dict[str, str] = {}
    resolved: dict[str, str] = {}
    for k, v in weight_map.items():
        if not isinstance(v, str):
            raise CheckpointError(f"{path}: weight_map[{k[:80]!r}] is a {type(v).__name__}, "
                                  "not a shard file name", path=path, hint=_BAD_INDEX_HINT)
        if v not in resolved:
            resolved[v] = _shard_path(path, base, k, v)
        out[k] = resolved[v]
    return out


def _read_sharded(path: str, *, key: str | None) -> CheckpointInfo:
    weight_map = read_index(path)
    shards = sorted(set(weight_map.values()))
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        sub = read_checkpoint(shard, key=key if checkpoint_kind(shard) == "pickle" else None)
        for k, v in sub.tensors.items():
            if k in tensors:
                raise CheckpointError(f"{path}: key {k!r} appears in two shards", path=path,
                                      hint="the shards overlap; re-export the checkpoint")
            tensors[k] = v
    missing = sorted(k for k in weight_map if k not in tensors)
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} key(s) listed in the index are in no shard: "
            + ", ".join(repr(k) for k in missing[:5]),
            path=path, hint="a shard is missing or stale; copy all shards together")
    return CheckpointInfo(path, "sharded", tensors, files=shards)


def read_embedded_manifest(path: str) -> Manifest | None:
    """The manifest that `surgery export --manifest` embedded in a file, or None if it has none.

    `path` is an exported ``.safetensors`` file or the ``*.index.json`` of a sharded export.
    Reads the header only and never imports torch, so the runtime can call it before building
    its model. The embedded text is checked against its recorded sha256 and against the schema.
    """

    found = read_embedded_manifest_entry(path)
    if found is None:
        return None
    key, text = found
    return parse_manifest(text, path=f"{path}[{key}]")


def read_embedded_manifest_text(path: str) -> str | None:
    """The embedded manifest's TOML text, checked against its recorded sha256 (not parsed).

    `surgery export --manifest` takes an export as its manifest and embeds this text as is.
    """

    found = read_embedded_manifest_entry(path)
    return None if found is None else found[1]


def read_embedded_manifest_entry(path: str) -> tuple[str, str] | None:
    """(metadata key, TOML text) of the embedded manifest, under any key set ever written."""

    if checkpoint_kind(path) == "sharded":
        meta = _index_metadata(path)
        if embedded_entry(meta, META_MANIFEST_KEYS) is None:
            shards = sorted(set(read_index(path).values()))
            meta = read_safetensors_layout(shards[0]).metadata if shards and \
                checkpoint_kind(shards[0]) == "safetensors" else {}
    elif checkpoint_kind(path) == "safetensors":
        meta = read_safetensors_layout(path).metadata
    else:
        return None  # a pickle cannot carry one; only `surgery export` output does
    found = embedded_entry(meta, META_MANIFEST_KEYS)
    if found is None:
        return None
    key, text = found
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    recorded = meta.get(META_MANIFEST_SHA256)
    if recorded is not None and recorded != digest:
        raise ManifestError(f"{path}: the embedded manifest does not match its recorded sha256",
                            path=path, hint="the file was edited after export; export it again")
    return key, text


def _index_metadata(path: str) -> dict[str, str]:
    """An index's ``metadata`` entries with scalar values, as strings (HF writes integers)."""
    meta = _load_index(path).get("metadata") or {}
    if not isinstance(meta, dict):
        return {}
    return {k: v if isinstance(v, str) else str(v) for k, v in meta.items()
            if isinstance(v, (str, int, float, bool))}


def load_export_tensors(path: str) -> dict[str, Any]:
    """Load a `surgery export` output (one file or a sharded index) as a state dict of tensors.

    Tied tensors stored once come back under every name, sharing one tensor, so
    ``model.load_state_dict(load_export_tensors(path), strict=True)`` works on the unwrapped model.
    """
    from safetensors.torch import load_file

    files = sorted(set(read_index(path).values())) if checkpoint_kind(path) == "sharded" \
        else [path]
    out: dict[str, Any] = {}
    for file in files:
        aliases = read_aliases(file, read_safetensors_layout(file).metadata)
        tensors = load_file(file)
        for alias, target in aliases.items():
            tensors[alias] = tensors[target]
        out.update(tensors)
    return out
