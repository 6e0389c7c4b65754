"""The model's fingerprint and the canonical names it is computed over.

A checkpoint's keys may carry wrapper segments (`_orig_mod.` ...), EMA bookkeeping and an
attribute prefix; `model_keys` maps them onto the unwrapped model's names, and
`compute_fingerprint` hashes those names with their shapes. plan, verify, export and the runtime's
binding check all use these two, so a manifest and its checkpoint agree however each was read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from surgery.formats.keys import (
    canonical_key,
    collision_error,
    is_bookkeeping,
    strip_prefix,
)
from surgery.formats.safe_write import write_text_atomic as write_text_atomic
from surgery.formats.tensors import TensorInfo

# The prefix of the current fingerprint format. A manifest whose fingerprint is a bare
# "sha256:..." was written by an earlier surgery (v1: tab-separated records that also covered
# dtypes); surgery.formats.binding still accepts one that matches, see there.
FINGERPRINT_PREFIX = "v2:sha256:"


def compute_fingerprint(tensors: Mapping[str, Any], *, canonical: bool = False) -> str:
    """The model's fingerprint: sha256 over its canonical keys and shapes, in key order.

    Why these and only these. The fingerprint binds a manifest to *a model*, and region paths
    follow from keys and shapes; a cast (bf16 deployment of an fp32 checkpoint) or ``.to(device)``
    is the same model, so dtype and device are left out (surgery.formats.binding notes a dtype
    change). Keys are canonical (wrapper segments such as ``_orig_mod.`` stripped), so a model with
    hand-swapped compiled blocks still matches. Each record is a JSON array ``[key, shape]``, so
    no key, whatever characters it holds, can read as two records. ``tensors`` maps key -> any
    object with ``.shape`` (TensorInfo or torch.Tensor); nothing here imports torch.

    `canonical=True` is the caller's word that the keys are canonical already (the planner's
    and verify's tables, built by surgery.formats.fingerprint.model_keys, which refuses collisions):
    they are hashed as they are, without stripping them again.
    """
    names: dict[str, str] = {}
    clashes: dict[str, list[str]] = {}
    for key in () if canonical else tensors:
        c = canonical_key(key)
        if c in names:
            clashes.setdefault(c, [names[c]]).append(key)
        names[c] = key
    if clashes:
        raise collision_error(clashes)
    # Each record is the compact JSON text of [key, shape], spelled out here because
    # json.dumps costs a new encoder per call: ["key",[2,3]]. The key goes through json's own
    # ASCII string encoder; ints print the same in JSON and Python. JSON text never holds a raw
    # newline: it ends each record.
    quote = encode_basestring_ascii
    table = tensors if canonical else {c: tensors[k] for c, k in names.items()}
    text = "".join([
        f"[{quote(c)},[{','.join([str(int(d)) for d in table[c].shape])}]]\n"
        for c in sorted(table)])
    return f"{FINGERPRINT_PREFIX}{hashlib.sha256(text.encode()).hexdigest()}"


@dataclass
class ModelKeys:
    """How a checkpoint's keys map onto the unwrapped model's keys.

    `names` maps each original key that belongs to the model to its canonical name; `dropped`
    lists keys that do not (EMA bookkeeping, keys outside `--prefix`), with the reason.
    """

    names: dict[str, str]
    dropped: dict[str, str]
    collisions: dict[str, list[str]]


def model_keys(keys: list[str], *, prefix: str | None = None) -> ModelKeys:
    """Canonical names of the model's keys: wrappers stripped, `prefix` selected and removed."""
    dropped: dict[str, str] = {}
    keep = []
    for k in keys:
        if is_bookkeeping(k):
            dropped[k] = "EMA bookkeeping (AveragedModel n_averaged), not a model weight"
        else:
            keep.append(k)
    if prefix:
        names, outside = strip_prefix(keep, prefix)
        for k in outside:
            dropped[k] = f"outside --prefix {prefix}"
        # `--prefix ema.` on an AveragedModel under `ema.` leaves its counter as `n_averaged`.
        for k in [k for k, c in names.items() if is_bookkeeping(c)]:
            del names[k]
            dropped[k] = "EMA bookkeeping (AveragedModel n_averaged), not a model weight"
    else:
        names = {k: canonical_key(k) for k in keep}
    # Two keys share a name only where one of them changed: group the changed ones, then add
    # an unchanged key that already has their name (one pass over the few changed keys).
    groups: dict[str, list[str]] = {}
    for k, c in names.items():
        if c != k:
            groups.setdefault(c, []).append(k)
    for c, ks in groups.items():
        if names.get(c) == c:
            ks.append(c)
    collisions = {c: sorted(ks) for c, ks in sorted(groups.items()) if len(ks) > 1}
    return ModelKeys(names, dropped, collisions)


def model_fingerprint(tensors: Mapping[str, TensorInfo], *, prefix: str | None = None
                      ) -> str | None:
    """The fingerprint of the unwrapped model a checkpoint holds (None if keys collide).

    This is the fingerprint `export` writes and a manifest planned for the checkpoint carries:
    canonical keys, bookkeeping left out.
    """
    mk = model_keys(list(tensors), prefix=prefix)
    if mk.collisions:
        return None
    return compute_fingerprint({c: tensors[k] for k, c in mk.names.items()}, canonical=True)
