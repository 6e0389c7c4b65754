"""Wrapper segments in state-dict keys: the catalogue, canonical keys and collisions. Pure, no I/O.

Training stacks wrap models, and each wrapper leaves a segment in every key it covers. A
deployable checkpoint is *prefix-free*: none of these segments anywhere in its keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from surgery.errors import KeyCollisionError, SurgeryError
from surgery.formats.limits import env_var, limit, printable, raise_hint


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
# The segments segments_in reports wherever they stand (built once: it runs for every key).
_FOUND_BY_NAME = {s.name: s for s in (*STRIPPABLE, FLAT_PARAM)}
# Any catalogued segment as a whole dot-separated part of a key. A key it does not match is
# canonical and carries no segment, so the per-part work below runs only for the (rare) keys
# that do: one C-level search instead of a split and a scan per key, which is what keeps a
# 1M-tensor header's checks linear and cheap (issue 10).
_ANY_SEGMENT = re.compile(
    r"(?:^|\.)(?:" + "|".join(re.escape(s.name) for s in SEGMENTS) + r")(?:\.|$)")


def canonical_key(key: str) -> str:
    """Strip wrapper segments from one key, in any stacking order, until nothing changes."""
    if _ANY_SEGMENT.search(key) is None:
        return key
    # Removing the anywhere-segments is done in one pass (it cannot expose more of them), then
    # every leading `module` at once: stripping one a pass was quadratic (a 140 KB key, 34 s).
    parts = [p for p in key.split(".") if p not in _ANYWHERE]
    lead = 0
    while len(parts) - lead > 1 and parts[lead] == MODULE.name:
        lead += 1
    return ".".join(parts[lead:])


def segments_in(key: str) -> list[Segment]:
    """The wrapper segments that make `key` non-canonical, or are leftovers, in key order."""
    if _ANY_SEGMENT.search(key) is None:
        return []
    parts = key.split(".")
    found: list[Segment] = []
    for p in parts:
        if p in _FOUND_BY_NAME and _FOUND_BY_NAME[p] not in found:
            found.append(_FOUND_BY_NAME[p])
    # A leading `module` counts once the anywhere-segments are removed.
    rest = [p for p in parts if p not in _ANYWHERE]
    if len(rest) > 1 and rest[0] == MODULE.name:
        found.append(MODULE)
    # AveragedModel's counter sits at the top of its state dict; a model's own buffer of that
    # name deeper down is the model's business.
    if is_bookkeeping(key):
        found.append(N_AVERAGED)
    return found


def find_collisions(keys: Iterable[str]) -> dict[str, list[str]]:
    """Canonical keys that two or more original keys would collapse into, with those originals."""
    # Two canonical keys never merge, so only keys that change can collide: with one another,
    # or with a key that is already their canonical form.
    keys = keys if isinstance(keys, (list, tuple, set, dict)) else list(keys)
    groups: dict[str, list[str]] = {}
    for k in keys:
        if _ANY_SEGMENT.search(k) is not None:
            c = canonical_key(k)
            if c != k:
                groups.setdefault(c, []).append(k)
    if not groups:
        return {}
    present = keys if isinstance(keys, (set, dict)) else set(keys)
    for c, originals in groups.items():
        if c in present and canonical_key(c) == c:
            originals.append(c)
    return {c: sorted(orig) for c, orig in sorted(groups.items()) if len(orig) > 1}


def collision_error(collisions: dict[str, list[str]], *, source: str = "") -> KeyCollisionError:
    """The error for keys that would merge into one, listing both originals of each merge."""
    items = list(collisions.items())
    shown = "; ".join(" + ".join(repr(k) for k in ks) + f" -> {c!r}" for c, ks in items[:5])
    more = f" (and {len(items) - 5} more)" if len(items) > 5 else ""
    where = f"{source}: " if source else ""
    return KeyCollisionError(
        f"{where}{len(items)} key(s) would merge into one: {shown}{more}",
        collisions=collisions,
        hint="the file holds two copies of the model (e.g. an EMA `module.` copy beside the "
        "online weights): pick one with --prefix module. or --key ENTRY",
    )


def canonical_map(keys: Iterable[str]) -> dict[str, str]:
    """Map every original key to its canonical key. Refuses (raises) when keys would collide."""
    keys = list(keys)
    collisions = find_collisions(keys)
    if collisions:
        raise collision_error(collisions)
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


# --- findings ----------------------------------------------------------------------------------

# Stable finding codes. They are part of the CLI contract (CI logs grep for them): never renumber,
# only add. SG0xx: key hygiene; SG1xx: the manifest against the checkpoint; SG2xx: tensor data;
# SG3xx: the compile-cache bundle beside the manifest (notes only: a bundle is an optimisation).
CODES: dict[str, str] = {
    "SG001": ORIG_MOD.name,
    "SG002": MODULE.name,
    "SG003": FSDP_WRAPPED.name,
    "SG004": CHECKPOINT_WRAPPED.name,
    "SG005": FORWARD_MODULE.name,
    "SG006": FLAT_PARAM.name,
    "SG007": N_AVERAGED.name,
    "SG008": "collision",
    "SG009": "attribute-prefix",
    "SG010": "unchecked-entry",
    "SG101": "fingerprint",
    "SG102": "region-path",
    "SG201": "non-finite",
    "SG202": "float64",
    "SG203": "shared-storage",
    "SG301": "cache-bundle-fits",
    "SG302": "cache-bundle-ignored",
}
_CODE_OF_SEGMENT = {name: code for code, name in CODES.items()}

ERROR = "error"  # makes `verify` exit 1
NOTE = "note"  # shown, but the checkpoint still counts as clean

# How many example keys a grouped finding shows; `--all` shows every key.
EXAMPLES = 3


@dataclass
class Finding:
    """One kind of problem, grouped: 816 `_orig_mod` keys are one finding with count 816.

    `keys` holds every affected key (for `--all`), `examples` a few of them rendered as
    ``original -> canonical`` (or whatever explains the problem best).
    """

    code: str
    severity: str
    title: str
    wrapper: str | None
    keys: list[str]
    fix: str
    examples: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.keys)

    def to_dict(self, *, all_keys: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "code": self.code, "severity": self.severity, "title": self.title,
            "wrapper": self.wrapper, "count": self.count, "examples": list(self.examples),
            "fix": self.fix,
        }
        if all_keys:
            d["keys"] = list(self.keys)
        if self.detail:
            d["detail"] = dict(self.detail)
        return d


def export_command(source: str, *, key: str | None = None, prefix: str | None = None) -> str:
    """The `surgery export` command line that fixes key findings in `source`."""
    stem = source
    for suffix in (".index.json", ".safetensors", ".ckpt", ".pth", ".pt", ".bin"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    extra = (f" --key {key}" if key else "") + (f" --prefix {prefix}" if prefix else "")
    return f"surgery export {source}{extra} -o {stem}.clean.safetensors"


def check_keys(keys: Iterable[str], *, source: str = "CHECKPOINT", key: str | None = None,
               prefix: str | None = None) -> list[Finding]:
    """Key-hygiene findings for a checkpoint's keys, one per segment kind, in code order.

    Pure: `source`, `key` and `prefix` only shape the fix command shown to the user.
    """
    keys = list(keys)
    fix = export_command(source, key=key, prefix=prefix)
    by_segment: dict[str, list[str]] = {}
    for k in keys:
        for seg in segments_in(k):
            by_segment.setdefault(seg.name, []).append(k)
    findings: list[Finding] = []
    for seg in (ORIG_MOD, MODULE, FSDP_WRAPPED, CHECKPOINT_WRAPPED, FORWARD_MODULE):
        hit = by_segment.get(seg.name)
        if not hit:
            continue
        where = "leading" if seg.where == "leading" else "anywhere in the key"
        findings.append(Finding(
            _CODE_OF_SEGMENT[seg.name], ERROR, f"wrapper segment `{seg.name}.` ({where})",
            seg.wrapper, hit, fix, [f"{k} -> {canonical_key(k)}" for k in hit[:EXAMPLES]]))
    flat = by_segment.get(FLAT_PARAM.name)
    if flat:
        findings.append(Finding(
            "SG006", ERROR, "FSDP1 flat parameters: the per-parameter keys are gone",
            FLAT_PARAM.wrapper, flat,
            "re-save from the training job with FSDP use_orig_params=True or a full state dict "
            "(torch.distributed.checkpoint.state_dict.get_model_state_dict), then "
            + fix.split(" -o ")[0] + " -o ...",
            flat[:EXAMPLES]))
    averaged = averaged_prefixes(keys)
    for p in averaged:  # an AveragedModel under an attribute (`ema.module.`)
        inner = [k for k in keys if k.startswith(f"{p}.{MODULE.name}.")]
        at = f"{p}.{N_AVERAGED.name}"
        findings.append(Finding(
            "SG002", ERROR, f"wrapper segment `module.` of an AveragedModel under `{p}.`",
            MODULE.wrapper, inner, f"{export_command(source, key=key, prefix=p + '.')}  "
            f"(exports the averaged weights as the model; {at} is left out)",
            [f"{k} -> {canonical_key(k[len(p) + 1:])} (with --prefix {p}.)"
             for k in inner[:EXAMPLES]]))
        by_segment.setdefault(N_AVERAGED.name, []).append(at)
    bookkeeping = by_segment.get(N_AVERAGED.name)
    if bookkeeping:
        findings.append(Finding(
            "SG007", ERROR, "EMA bookkeeping saved with the weights (not part of the model)",
            N_AVERAGED.wrapper, bookkeeping,
            (export_command(source, key=key, prefix=averaged[0] + ".") if averaged and not prefix
             else fix) + "  (export leaves it out)",
            bookkeeping[:EXAMPLES]))
    collisions = find_collisions(k for k in keys if not is_bookkeeping(k))
    if collisions:
        flat_keys = [k for ks in collisions.values() for k in ks]
        findings.append(Finding(
            "SG008", ERROR, "keys that would merge into one when the wrappers are stripped",
            "two copies of the model in one file (e.g. an EMA `module.` copy beside the "
            "online weights)",
            flat_keys,
            f"keep one copy: {export_command(source, key=key, prefix='module.')} exports the "
            "`module.` copy; or re-save only the weights you deploy",
            [" + ".join(ks) + f" -> {c}" for c, ks in list(collisions.items())[:EXAMPLES]],
            {"collisions": collisions}))
    return findings


def averaged_prefixes(keys: Iterable[str]) -> list[str]:
    """Attribute paths an AveragedModel sits under: ``P.n_averaged`` beside ``P.module.*`` keys.

    A training module that keeps ``self.ema = AveragedModel(self.model)`` saves ``model.*``,
    ``ema.module.*`` and ``ema.n_averaged``; the `module.` there is the wrapper's, not the model's.
    """
    keys = keys if isinstance(keys, (list, tuple, set)) else list(keys)
    suffix = f".{N_AVERAGED.name}"
    tops = {k[: -len(suffix)] for k in keys if k.endswith(suffix) and k != suffix[1:]}
    if not tops:
        return []
    inside = {p for p in tops for k in keys if k.startswith(f"{p}.{MODULE.name}.")}
    return sorted(inside)


def is_bookkeeping(key: str) -> bool:
    """True for EMA bookkeeping keys (`n_averaged`), which belong to no model parameter."""
    return key.endswith(N_AVERAGED.name) and canonical_key(key) == N_AVERAGED.name


def strip_prefix(keys: Iterable[str], prefix: str) -> tuple[dict[str, str], list[str]]:
    """Select the keys under an attribute prefix (e.g. a LightningModule's ``model.``).

    Returns (original key -> canonical key without the prefix, keys outside the prefix). A key
    is under the prefix when the original key starts with it (so ``--prefix module.`` picks the
    EMA/DDP copy out of a file that also holds the online weights) or, failing that, when its
    canonical key does (so ``_orig_mod.model.x`` is under ``model.``).
    """
    if not prefix.endswith("."):
        prefix += "."
    kept: dict[str, str] = {}
    outside: list[str] = []
    for k in keys:
        if k.startswith(prefix) and len(k) > len(prefix):
            kept[k] = canonical_key(k[len(prefix):])
            continue
        c = canonical_key(k)
        if c.startswith(prefix) and len(c) > len(prefix):
            kept[k] = c[len(prefix):]
        else:
            outside.append(k)
    return kept, outside


class KeyLimitError(SurgeryError):
    """Keys beyond the resource contract (surgery.formats.limits): too long, too deep, or
    implying far more module paths than their own size."""


def module_paths(keys: Iterable[str]) -> set[str]:
    """Every module path the keys imply: ``a.b.weight`` -> {"", "a", "a.b"}.

    A checkpoint cannot show modules that own no parameters or buffers (an activation, a
    dropout), so a path missing here may still exist on the live model. Bounded: a key of more
    than SURGERY_MAX_KEY_PARTS parts or SURGERY_MAX_KEY_CHARS characters is refused, and so are
    keys whose distinct prefixes add up to more than SURGERY_MAX_MODULE_PATHS_RATIO times their
    own size (real keys share their prefixes: well under 1x).
    """
    out: set[str] = {""}
    depth_limit, chars_limit = limit("KEY_PARTS"), limit("KEY_CHARS")
    ratio = limit("MODULE_PATHS_RATIO")
    budget = 1 << 20  # characters a small file may imply whatever its shape
    for k in keys:
        if len(k) > chars_limit:
            raise KeyLimitError(f"key {printable(k, max_chars=60)} is {len(k)} characters, "
                                f"beyond the limit of {chars_limit} "
                                f"({env_var('KEY_CHARS')})", hint=raise_hint("KEY_CHARS"))
        parts = k.split(".")[:-1]
        if len(parts) >= depth_limit:
            raise KeyLimitError(f"key {printable(k, max_chars=60)} has {len(parts) + 1} dotted "
                                f"parts, beyond the limit of {depth_limit} "
                                f"({env_var('KEY_PARTS')})", hint=raise_hint("KEY_PARTS"))
        budget += ratio * len(k)
        prefix = ""
        for p in parts:
            prefix = f"{prefix}.{p}" if prefix else p
            if prefix not in out:
                out.add(prefix)
                budget -= len(prefix)
        if budget < 0:
            raise KeyLimitError(
                f"the keys imply module paths of more than {ratio}x their own size (keys that "
                f"share no prefix, each deeply nested), beyond the limit "
                f"({env_var('MODULE_PATHS_RATIO')})", hint=raise_hint("MODULE_PATHS_RATIO"))
    return out
