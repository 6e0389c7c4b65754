"""The linear-time shortcuts in key handling give the same answers as the plain definitions.

Issue 10's scale targets (100k tensors planned in under 3 s) made keys.canonical_key and
segments_in skip keys that hold no catalogued segment, made collision finding look only at keys
that change, and spelled the fingerprint's JSON records out by hand. Each shortcut is checked
here against the definition it replaces, on generated keys built from the catalogue's own
segment names (so wrapped, stacked, near-miss and clean keys all occur).
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from surgery.formats.fingerprint import FINGERPRINT_PREFIX, compute_fingerprint, model_keys
from surgery.formats.keys import (
    _ANY_SEGMENT,
    _ANYWHERE,
    MODULE,
    N_AVERAGED,
    SEGMENTS,
    canonical_key,
    find_collisions,
    is_bookkeeping,
    segments_in,
)

NAMES = [s.name for s in SEGMENTS]
# Near misses: segment names inside a longer part, which must never count.
PARTS = st.sampled_from([*NAMES, *NAMES, "x" + NAMES[0], NAMES[1] + "s", "modules", "0", "12",
                         "blocks", "attn", "weight", "é", "a\tb", "n\n", ""])
KEYS = st.lists(PARTS, min_size=1, max_size=6).map(".".join)


def reference_canonical(key: str) -> str:
    """The definition: strip anywhere-segments and one leading `module` until nothing changes."""
    parts = key.split(".")
    while True:
        before = len(parts)
        parts = [p for p in parts if p not in _ANYWHERE]
        if len(parts) > 1 and parts[0] == MODULE.name:
            parts = parts[1:]
        if len(parts) == before:
            return ".".join(parts)


def reference_collisions(keys: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(reference_canonical(k), []).append(k)
    return {c: sorted(ks) for c, ks in sorted(groups.items()) if len(ks) > 1}


@settings(max_examples=500, deadline=None)
@given(KEYS)
def test_canonical_key_matches_its_definition(key: str) -> None:
    assert canonical_key(key) == reference_canonical(key)
    if _ANY_SEGMENT.search(key) is None:  # the shortcut's condition
        assert segments_in(key) == [] and canonical_key(key) == key
    assert is_bookkeeping(key) == (key.split(".")[-1] == N_AVERAGED.name
                                   and reference_canonical(key) == N_AVERAGED.name)


@settings(max_examples=300, deadline=None)
@given(st.lists(KEYS, max_size=12, unique=True))
def test_collisions_match_grouping_every_key(keys: list[str]) -> None:
    expected = reference_collisions(keys)
    assert find_collisions(keys) == expected
    assert find_collisions(iter(keys)) == expected  # a one-pass iterable works too
    kept = [k for k in keys if not is_bookkeeping(k)]
    assert model_keys(keys).collisions == reference_collisions(kept)


def test_collision_with_a_key_that_is_already_canonical() -> None:
    """`blocks.0.w` does not change, but `_orig_mod.blocks.0.w` becomes it: both are named."""
    keys = ["blocks.0.w", "_orig_mod.blocks.0.w", "head.b"]
    assert find_collisions(keys) == {"blocks.0.w": ["_orig_mod.blocks.0.w", "blocks.0.w"]}
    assert model_keys(keys).collisions == find_collisions(keys)


def reference_fingerprint(tensors: dict[str, SimpleNamespace]) -> str:
    h = hashlib.sha256()
    for c in sorted(tensors):
        record = [c, [int(d) for d in tensors[c].shape]]
        h.update(json.dumps(record, ensure_ascii=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return f"{FINGERPRINT_PREFIX}{h.hexdigest()}"


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: canonical_key(k) == k),
                       st.lists(st.integers(0, 2**40), max_size=4), max_size=8))
def test_fingerprint_records_are_json_dumps(shapes: dict[str, list[int]]) -> None:
    """Any key (quotes, backslashes, control and non-ASCII characters) hashes as json.dumps."""
    tensors = {k: SimpleNamespace(shape=tuple(v)) for k, v in shapes.items()}
    assert compute_fingerprint(tensors) == reference_fingerprint(tensors)
    # the planner's shortcut for keys it has canonicalised already hashes the same records
    assert compute_fingerprint(tensors, canonical=True) == reference_fingerprint(tensors)
