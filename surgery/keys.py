"""Wrapper segments in state-dict keys: the catalogue, canonical keys and collisions. Pure, no I/O.

Training stacks wrap models, and each wrapper leaves a segment in every key it covers. A
deployable checkpoint is *prefix-free*: none of these segments anywhere in its keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from surgery.errors import KeyCollisionError


@dataclass(frozen=True)
class Segment:
    """One wrapper segment: its name, the wrapper that adds it, and where it counts."""

    name: str
    wrapper: str
    # "anywhere": at any level of the key; "leading": only as the first segment once the
    # "anywhere" segments are gone; "leftover": cannot be stripped, only reported.
    where: str


# Inserted by torch.compile's OptimizedModule (`torch.compile(module)` swapped into a parent).
# Regional compile that swaps blocks leaves it in the middle of a key.
ORIG_MOD = Segment("_orig_mod", "torch.compile (OptimizedModule)", "anywhere")
# Inserted by FSDP1's FullyShardedDataParallel wrapper around each wrapped submodule.
FSDP_WRAPPED = Segment("_fsdp_wrapped_module", "FSDP1 (FullyShardedDataParallel)", "anywhere")
# Inserted by the activation-checkpoint wrapper (checkpoint_wrapper) around each block.
CHECKPOINT_WRAPPED = Segment(
    "_checkpoint_wrapped_module", "activation checkpointing (checkpoint_wrapper)", "anywhere"
)
# Inserted by older Lightning strategies (DeepSpeed) around the LightningModule.
FORWARD_MODULE = Segment("_forward_module", "Lightning + DeepSpeed (_forward_module)", "anywhere")
# Inserted by DDP / DataParallel / AveragedModel / EMA copies. A model may own an attribute
# named `module` deeper down, so only a leading one counts.
MODULE = Segment("module", "DDP / DataParallel / AveragedModel (module.)", "leading")
# FSDP1's flattened parameter: the per-parameter keys are gone and cannot be recovered here.
FLAT_PARAM = Segment("_flat_param", "FSDP1 flat parameters (use_orig_params=False)", "leftover")
# AveragedModel's step counter, saved next to the averaged weights.
N_AVERAGED = Segment("n_averaged", "AveragedModel / EMA bookkeeping", "leftover")

STRIPPABLE: tuple[Segment, ...] = (ORIG_MOD, FSDP_WRAPPED, CHECKPOINT_WRAPPED, FORWARD_MODULE)
SEGMENTS: tuple[Segment, ...] = (*STRIPPABLE, MODULE, FLAT_PARAM, N_AVERAGED)
_ANYWHERE = frozenset(s.name for s in STRIPPABLE)


def canonical_key(key: str) -> str:
    """Strip wrapper segments from one key, in any stacking order, until nothing changes."""
    parts = key.split(".")
    while True:
        before = len(parts)
        parts = [p for p in parts if p not in _ANYWHERE]
        if len(parts) > 1 and parts[0] == MODULE.name:
            parts = parts[1:]
        if len(parts) == before:
            return ".".join(parts)


def segments_in(key: str) -> list[Segment]:
    """The wrapper segments that make `key` non-canonical, or are leftovers, in key order."""
    parts = key.split(".")
    found: list[Segment] = []
    by_name = {s.name: s for s in (*STRIPPABLE, FLAT_PARAM, N_AVERAGED)}
    for p in parts:
        if p in by_name and by_name[p] not in found:
            found.append(by_name[p])
    # A leading `module` counts once the anywhere-segments are removed.
    rest = [p for p in parts if p not in _ANYWHERE]
    if len(rest) > 1 and rest[0] == MODULE.name:
        found.append(MODULE)
    return found


def find_collisions(keys: Iterable[str]) -> dict[str, list[str]]:
    """Canonical keys that two or more original keys would collapse into, with those originals."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(canonical_key(k), []).append(k)
    return {c: sorted(orig) for c, orig in sorted(groups.items()) if len(orig) > 1}


def canonical_map(keys: Iterable[str]) -> dict[str, str]:
    """Map every original key to its canonical key. Refuses (raises) when keys would collide."""
    keys = list(keys)
    collisions = find_collisions(keys)
    if collisions:
        shown = "; ".join(" + ".join(repr(k) for k in ks) + f" -> {c!r}" for c, ks in
                          list(collisions.items())[:5])
        more = f" (and {len(collisions) - 5} more)" if len(collisions) > 5 else ""
        raise KeyCollisionError(
            f"{len(collisions)} canonical key(s) would merge two originals: {shown}{more}",
            collisions=collisions,
            hint="the checkpoint holds two copies of the model (e.g. an EMA `module.` copy next "
            "to the online weights); select one with --prefix or --key before exporting",
        )
    return {k: canonical_key(k) for k in keys}


def common_attribute_prefix(keys: Iterable[str]) -> str | None:
    """The attribute prefix (e.g. ``model.``) shared by every key, if there is one.

    A LightningModule saves its inner model as ``model.<...>``; deployment loads the inner model,
    so the plan must be made for the keys without that prefix.
    """
    first: str | None = None
    for k in keys:
        head = k.split(".", 1)[0] if "." in k else None
        if head is None:
            return None
        if first is None:
            first = head
        elif head != first:
            return None
    return f"{first}." if first is not None else None
