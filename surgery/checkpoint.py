"""The I/O edge for checkpoints: read keys, shapes and dtypes; never execute a checkpoint.

- ``.safetensors``: the header only, parsed here, so no tensor data is read and torch is not
  imported.
- ``.pt`` / ``.pth`` / ``.ckpt`` / ``.bin``: ``torch.load(weights_only=True, mmap=True)``.
- a sharded checkpoint through its ``*.index.json``.
A state dict nested in a container (``state_dict``, ``model``, ``ema`` ...) is found and the
entry used is reported.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from surgery.errors import CheckpointError
from surgery.pickle_probe import explain_refusal, probe_format
from surgery.safejson import UntrustedJSONError, load_untrusted_json
from surgery.st_header import DTYPE_BITS, MAX_HEADER_BYTES, HeaderProblem, Truncated, parse_header

if TYPE_CHECKING:
    from surgery.manifest import Manifest

SAFETENSORS_SUFFIXES = (".safetensors",)
# `.pth.tar` (and `.tar`) is what timm's train.py names its checkpoints: a torch.save zip file.
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
# The kinds a file can be read as; `kind=` (the CLI's --format) names one when the suffix cannot.
KINDS: tuple[str, ...] = ("safetensors", "pickle", "sharded")
INDEX_SUFFIX = ".index.json"

# Container entries that commonly hold the state dict, in the order we prefer them when a file
# holds several (the online weights before EMA copies).
CONTAINER_ENTRIES: tuple[str, ...] = (
    "state_dict", "model", "model_state_dict", "module", "net", "network", "params",
    "ema", "model_ema", "ema_state_dict", "ema_model",
)

# torch dtype names -> safetensors header names, so fingerprints agree whichever side read them.
_TORCH_TO_ST: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
    "complex128": "C128",
}
_ST_DTYPES = frozenset(_TORCH_TO_ST.values()) | frozenset(DTYPE_BITS)
# Bytes per element of each safetensors dtype (to check data_offsets against shapes).
_ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "C64": 8, "C128": 16,
}
# Metadata keys that `surgery export` writes into every safetensors file (and the index of a
# sharded export). `format=pt` is what safetensors' own torch loader expects.
META_FORMAT = "format"
META_FINGERPRINT = "surgery.fingerprint"
META_MANIFEST = "surgery.manifest"  # the manifest's TOML text, exactly as its file holds it
META_MANIFEST_SHA256 = "surgery.manifest_sha256"  # sha256 of that text (UTF-8), hex
META_ALIASES = "surgery.aliases"  # JSON {alias: stored key}: tied tensors stored once
META_SOURCE = "surgery.source"  # the file it was exported from (base name)
META_DROPPED = "surgery.dropped"  # JSON list of keys left out (e.g. EMA `n_averaged`)
META_VERSION = "surgery.version"

# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER = MAX_HEADER_BYTES


def normalize_dtype(dtype: object) -> str:
    """'torch.float32', torch.float32 or 'F32' -> 'F32' (the safetensors spelling)."""
    s = str(dtype)
    if s in _ST_DTYPES:
        return s
    s = s.removeprefix("torch.")
    return _TORCH_TO_ST.get(s, s.upper())


class TensorInfo(NamedTuple):
    """Shape and dtype of one tensor, without its data.

    A named tuple rather than a frozen dataclass: a header of a million tensors makes a million
    of them, and a tuple is built at C speed (a frozen dataclass's __init__ cost 0.4 s more per
    million on the 2-core CI machine).
    """

    shape: tuple[int, ...]
    dtype: str  # safetensors spelling, e.g. "F32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class CheckpointInfo:
    """What reading a checkpoint found: its tensors and how they were found."""

    path: str
    format: str  # "safetensors" | "pickle" | "sharded"
    tensors: dict[str, TensorInfo]
    entry: str | None = None  # the container entry the state dict came from, if any
    candidates: list[str] = field(default_factory=list)  # every entry that held a state dict
    ignored: list[str] = field(default_factory=list)  # non-tensor entries beside it
    optimizer: dict[str, int] = field(default_factory=dict)  # entry -> optimizer param states
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    files: list[str] = field(default_factory=list)


def checkpoint_kind(path: str, *, kind: str | None = None) -> str:
    """'safetensors', 'pickle' or 'sharded' from the file name (or `kind`, when given).

    Raises on a suffix it does not know: a file is read only as the kind it is named or said to
    be, never guessed from its bytes.
    """
    if kind is not None:
        if kind not in KINDS:
            raise CheckpointError(f"{path}: unknown checkpoint kind {kind!r}", path=path,
                                  hint=f"one of {', '.join(KINDS)}")
        return kind
    name = os.path.basename(path)
    if name.endswith(INDEX_SUFFIX):
        return "sharded"
    if name.endswith(SAFETENSORS_SUFFIXES):
        return "safetensors"
    if name.endswith(PICKLE_SUFFIXES):
        return "pickle"
    raise CheckpointError(
        f"{path}: unknown checkpoint type {os.path.splitext(name)[1] or '(no suffix)'!r}",
        path=path,
        hint="give a .safetensors, .pt/.pth/.pth.tar/.ckpt/.bin file or a sharded *.index.json, "
        "name the format with --format safetensors|torch|index, "
        "or plan a live model with --model package.module:factory",
    )


def _require_file(path: str) -> int:
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file", path=path, hint="check the path")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not a regular file", path=path,
                              hint="give the checkpoint file, or its *.index.json if sharded")
    return os.path.getsize(path)


@dataclass(frozen=True)
class SafetensorsLayout:
    """Where each tensor's bytes lie in a safetensors file (offsets are absolute)."""

    tensors: dict[str, TensorInfo]
    offsets: dict[str, tuple[int, int]]  # name -> (start, end), absolute file offsets
    metadata: dict[str, str]
    data_start: int


def read_safetensors_layout(path: str) -> SafetensorsLayout:
    """Parse a safetensors header into shapes, dtypes and absolute byte ranges. No torch import.

    The header is held to the rules safetensors itself enforces (surgery.st_header): a header
    it would refuse is refused here too, as one CheckpointError, so nothing is planned, verified
    or exported from a file that cannot be loaded. A garbage file reads as an absurd header
    length; a truncated file can keep an intact header, so the tensors' end is compared with
    the file size.
    """
    size = _require_file(path)
    bad = f"{path}: not a valid safetensors file"
    if size < 8:
        raise CheckpointError(f"{bad} ({'empty' if size == 0 else f'only {size} bytes'})",
                              path=path, hint="the file is empty or truncated; re-export it")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > _MAX_HEADER or n > size - 8:
            raise CheckpointError(f"{bad} (header length {n} does not fit a {size}-byte file)",
                                  path=path, hint="the file is corrupt, truncated or not "
                                  "safetensors; re-export it")
        raw = f.read(n)
    try:
        parsed = parse_header(raw, data_size=size - 8 - n)
    except Truncated as e:
        raise CheckpointError(
            f"{path}: truncated: the header promises {8 + n + e.end} bytes, the file has {size}",
            path=path, hint="the copy was cut short; copy or export it again") from None
    except HeaderProblem as e:
        raise CheckpointError(f"{bad} ({e})", path=path,
                              hint="safetensors would refuse it too; re-export it from its "
                              "source") from None
    base = 8 + n
    tensors = {name: TensorInfo(shape, dtype) for _, _, name, shape, dtype in parsed.entries}
    offsets = {name: (base + lo, base + hi) for lo, hi, name, _, _ in parsed.entries}
    metadata = dict(parsed.metadata)
    _expand_aliases(path, tensors, offsets, metadata)
    return SafetensorsLayout(tensors, offsets, metadata, 8 + n)


def read_aliases(path: str, metadata: Mapping[str, str]) -> dict[str, str]:
    """The ``surgery.aliases`` metadata of an export: {alias: stored key}, checked as data.

    The text comes from the file, so it is parsed as untrusted JSON (bounded, no duplicates)
    and must be an object of string -> string.
    """
    raw = metadata.get(META_ALIASES)
    if not raw:
        return {}
    try:
        aliases = load_untrusted_json(raw, max_bytes=_MAX_HEADER, max_depth=2)
    except UntrustedJSONError as e:
        raise CheckpointError(f"{path}: metadata {META_ALIASES!r} is not valid: {e}", path=path,
                              hint="the file is corrupt; re-export it") from None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"{path}: metadata {META_ALIASES!r} is not a JSON object of "
                              "names", path=path, hint="the file is corrupt; re-export it")
    return aliases


def _expand_aliases(path: str, tensors: dict[str, TensorInfo],
                    offsets: dict[str, tuple[int, int]], metadata: dict[str, str]) -> None:
    """Add the tied keys that `surgery export` stored once back under their own names.

    Without this, a file exported from a model with tied weights would show fewer keys than the
    model's state dict, and its fingerprint would not match the manifest planned for it.
    """
    for alias, target in read_aliases(path, metadata).items():
        if target not in tensors:
            raise CheckpointError(f"{path}: alias {alias!r} points at {target!r}, which the file "
                                  "does not hold", path=path, hint="re-export the checkpoint")
        if alias not in tensors:
            tensors[alias] = tensors[target]
            offsets[alias] = offsets[target]


def read_safetensors_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse a safetensors header: (tensors, metadata, data start offset). No torch import.

    Tied keys that `surgery export` stored once (metadata ``surgery.aliases``) are listed under
    their own names too, as the model's state dict lists them.
    """
    layout = read_safetensors_layout(path)
    return layout.tensors, layout.metadata, layout.data_start


def torch_load_safely(path: str) -> Any:
    """``torch.load(weights_only=True)``, with mmap where the format allows it.

    The file's bytes are classified first (surgery.pickle_probe): a file that is neither a zip
    archive nor a pickle never reaches torch, and a legacy pickle is loaded without mmap. Every
    failure becomes a CheckpointError; a pickle that names code becomes an
    UnsafeCheckpointError. torch's own message advises turning weights_only off: that advice is
    never passed on, because it would execute the file.
    """
    size = _require_file(path)
    with open(path, "rb") as f:
        head = f.read(512)
    fmt = probe_format(path, head, size)
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols and the like on stderr; the CLI owns stderr.
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location="cpu", weights_only=True,
                                  mmap=fmt == "zip")
            except RuntimeError as e:
                # Only the zip format can be memory-mapped; should torch disagree about which
                # format this is, it loads without mmap.
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise explain_refusal(path, fmt, str(e)) from None
    except EOFError:
        raise CheckpointError(f"{path}: truncated: its pickle ends early", path=path,
                              hint="the copy was cut short; save or copy it again") from None
    except (RuntimeError, ValueError, OSError, AttributeError, KeyError, IndexError,
            TypeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError,
            RecursionError) as e:
        what = _first_line(str(e)) or e.__class__.__name__
        if fmt == "zip" and ("zip" in what.lower() or "central directory" in what):
            what = f"truncated or corrupt zip archive: {what}"
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({what})", path=path,
                              hint="the file is corrupt, truncated or not a checkpoint; "
                              "save or copy it again") from None


def _first_line(msg: str) -> str:
    """torch's first sentence, one line: its messages run on with advice over several lines."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return lines[0].split(". ")[0][:200] if lines else ""


def _is_tensor(v: object) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype")


def _is_state_dict(obj: object) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(_is_tensor(v) for v in obj.values())


def select_state_dict(obj: object, *, path: str, key: str | None = None
                      ) -> tuple[Mapping[str, Any], str | None, list[str], list[str]]:
    """Find the state dict in a loaded object: (state dict, entry used, candidates, ignored).

    `key` chooses an entry; nested entries are written ``outer/inner``.
    """
    if key is not None:
        cur: Any = obj
        for part in key.split("/"):
            if not isinstance(cur, Mapping) or part not in cur:
                have = sorted(str(k) for k in cur) if isinstance(cur, Mapping) else []
                raise CheckpointError(f"{path}: no entry {key!r} in the checkpoint", path=path,
                                      hint=f"entries here: {', '.join(have[:20]) or '(none)'}")
            cur = cur[part]
        if not _is_state_dict(cur):
            raise CheckpointError(f"{path}: entry {key!r} is not a state dict of tensors",
                                  path=path, hint="choose an entry that maps names to tensors")
        return cur, key, [key], []
    if _is_state_dict(obj):
        return obj, None, [], []  # type: ignore[return-value]
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict",
                              path=path, hint="save model.state_dict() rather than the model")
    candidates = _find_candidates(obj, "")
    if not candidates:
        raise CheckpointError(f"{path}: no state dict of tensors found in it", path=path,
                              hint=f"top-level entries: {', '.join(sorted(map(str, obj))[:20])}")
    rank = {name: i for i, name in enumerate(CONTAINER_ENTRIES)}
    chosen = min(candidates, key=lambda c: (c.count("/"), rank.get(c.split("/")[-1], 99)))
    cur = obj
    for part in chosen.split("/"):
        cur = cur[part]
    ignored = sorted(str(k) for k, v in obj.items() if not _is_tensor(v)
                     and not any(c == k or c.startswith(f"{k}/") for c in candidates))
    return cur, chosen, candidates, ignored


def _is_optimizer_state(obj: object) -> bool:
    """An ``optimizer.state_dict()``: per-parameter ``state`` and ``param_groups``. Its
    ``state/N`` entries are dicts of tensors (exp_avg ...) but no model's weights."""
    return isinstance(obj, Mapping) and isinstance(obj.get("state"), Mapping) and \
        isinstance(obj.get("param_groups"), (list, tuple))


def optimizer_entries(obj: object) -> dict[str, int]:
    """Top-level entries holding optimizer state (one or a list of them): entry -> states."""
    out: dict[str, int] = {}
    if not isinstance(obj, Mapping):
        return out
    for k, v in obj.items():
        states = v if isinstance(v, (list, tuple)) else [v]
        if states and all(_is_optimizer_state(o) for o in states):
            out[str(k)] = sum(len(o["state"]) for o in states)
    return out


def _find_candidates(obj: Mapping[Any, Any], prefix: str, depth: int = 0) -> list[str]:
    out: list[str] = []
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if _is_optimizer_state(v):
            continue
        if _is_state_dict(v):
            out.append(name)
        elif isinstance(v, Mapping) and depth < 2:
            out.extend(_find_candidates(v, f"{name}/", depth + 1))
    return out


def _infos_from_state_dict(sd: Mapping[str, Any]) -> dict[str, TensorInfo]:
    return {str(k): TensorInfo(tuple(v.shape), normalize_dtype(v.dtype)) for k, v in sd.items()}


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
        return CheckpointInfo(path, kind, _infos_from_state_dict(sd), entry=entry,
                              candidates=cands, files=[path], optimizer=optimizer,
                              ignored=[i for i in ignored if i not in optimizer])
    return _read_sharded(path, key=key)


# An index names one file per key; a real one for a million tensors is ~100 MB. Refuse more.
_MAX_INDEX_BYTES = 256 * 1024 * 1024
# {"metadata": {...}, "weight_map": {key: file}}: 2 deep; extra fields get a little room.
_MAX_INDEX_DEPTH = 8
_BAD_INDEX_HINT = "an index is JSON with a 'weight_map' of key -> shard file"


def _load_index(path: str) -> dict[str, Any]:
    """An index file's JSON object, read as untrusted input (bounded size and depth)."""
    size = _require_file(path)
    if size > _MAX_INDEX_BYTES:
        raise CheckpointError(f"{path}: not a valid sharded-checkpoint index ({size} bytes, "
                              f"more than the {_MAX_INDEX_BYTES} allowed)", path=path,
                              hint=_BAD_INDEX_HINT)
    try:
        with open(path, "rb") as f:
            index = load_untrusted_json(f.read(), max_bytes=_MAX_INDEX_BYTES,
                                        max_depth=_MAX_INDEX_DEPTH)
    except OSError as e:
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
    from surgery.manifest import parse_manifest

    text = read_embedded_manifest_text(path)
    if text is None:
        return None
    return parse_manifest(text, path=f"{path}[{META_MANIFEST}]")


def read_embedded_manifest_text(path: str) -> str | None:
    """The embedded manifest's TOML text, checked against its recorded sha256 (not parsed).

    `surgery export --manifest` takes an export as its manifest and embeds this text as is.
    """
    import hashlib

    from surgery.errors import ManifestError

    if checkpoint_kind(path) == "sharded":
        meta = _index_metadata(path)
        if META_MANIFEST not in meta:
            shards = sorted(set(read_index(path).values()))
            meta = read_safetensors_layout(shards[0]).metadata if shards and \
                checkpoint_kind(shards[0]) == "safetensors" else {}
    elif checkpoint_kind(path) == "safetensors":
        meta = read_safetensors_layout(path).metadata
    else:
        return None  # a pickle cannot carry one; only `surgery export` output does
    text = meta.get(META_MANIFEST)
    if text is None:
        return None
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    recorded = meta.get(META_MANIFEST_SHA256)
    if recorded is not None and recorded != digest:
        raise ManifestError(f"{path}: the embedded manifest does not match its recorded sha256",
                            path=path, hint="the file was edited after export; export it again")
    return text


def _index_metadata(path: str) -> dict[str, str]:
    """An index's ``metadata`` entries with scalar values, as strings (HF writes integers)."""
    meta = _load_index(path).get("metadata") or {}
    if not isinstance(meta, dict):
        return {}
    return {k: v if isinstance(v, str) else str(v) for k, v in meta.items()
            if isinstance(v, (str, int, float, bool))}


def load_exported(path: str) -> dict[str, Any]:
    """Load a `surgery export` output (one file or a sharded index) as a state dict of tensors.

    Tied tensors stored once come back under every name, sharing one tensor, so
    ``model.load_state_dict(load_exported(path), strict=True)`` works on the unwrapped model.
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
