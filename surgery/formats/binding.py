"""How a manifest binds to a model, and what to say when it does not.

The fingerprint (surgery.formats.fingerprint.compute_fingerprint) covers canonical keys and shapes.
Two things ride beside it in the manifest's ``[model]`` table, written by ``plan``:

- ``keys``: the keys in brief, one entry per key pattern, shape and count
  (``"blocks.N.attn.qkv.weight [192,64] x4"``). A fingerprint is a hash and says only *that*
  models differ; from the brief a mismatch says *what* differs: keys renamed on load (transformers
  renames ``encoder.layer.N`` to ``layers.N``), keys missing or unexpected, shapes changed.
- ``dtypes``: tensors per dtype. A model cast since the plan (fp32 checkpoint, bf16 deployment)
  binds, and the difference is a note, not a refusal.

Old manifests carry a bare ``sha256:`` fingerprint of the first format (tab-separated records
over keys, shapes *and dtypes*). They are accepted when that older hash matches, with a note to
plan again: exported ``.safetensors`` files embed their manifest, and refusing every one of them
after an upgrade would break deployments while protecting nothing (the fingerprint catches
mistakes; it is not a signature: whoever edits a manifest can rewrite it). When the older hash
does not match, the error says why it cannot tell more and how to plan again.

Nothing here imports torch: ``verify`` of a header uses it too.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from surgery.formats.fingerprint import FINGERPRINT_PREFIX, compute_fingerprint
from surgery.formats.keys import canonical_key
from surgery.formats.tensors import normalize_dtype

LEGACY_PREFIX = "sha256:"
# A key part that is all digits (the index of a numbered copy), between dots or at an end.
_NUMBERED_PART = re.compile(r"(?<![^.])\d+(?![^.])")
SHOWN = 3  # examples per kind of difference in a message


def key_summary(tensors: Mapping[str, Any], *, canonical: bool = False) -> list[str]:
    """One entry per (canonical key pattern, shape), with how many keys have it.

    `canonical=True`: the keys are canonical already (see compute_fingerprint)."""
    sub = _NUMBERED_PART.sub
    name = (lambda k: k) if canonical else canonical_key
    counts: Counter[tuple[str, tuple[int, ...]]] = Counter(
        [(sub("N", name(k)), tuple(map(int, t.shape))) for k, t in tensors.items()])
    return [f"{p} [{','.join(map(str, shape))}] x{n}"
            for (p, shape), n in sorted(counts.items())]


def dtype_counts(tensors: Mapping[str, Any]) -> dict[str, int]:
    """Tensors per dtype, in the safetensors spelling (F32, BF16 ...)."""

    return dict(sorted(Counter(normalize_dtype(t.dtype) for t in tensors.values()).items()))


def binding_fields(tensors: Mapping[str, Any], *, canonical: bool = False) -> dict[str, Any]:
    """What ``plan`` writes beside the fingerprint: the key brief and the dtype counts."""
    return {"keys": key_summary(tensors, canonical=canonical), "dtypes": dtype_counts(tensors)}


def legacy_fingerprint(tensors: Mapping[str, Any]) -> str:
    """The first fingerprint format, kept only to recognise manifests written with it."""

    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        shape = ",".join(str(int(d)) for d in t.shape)
        h.update(f"{key}\t{shape}\t{normalize_dtype(t.dtype)}\n".encode())
    return f"{LEGACY_PREFIX}{h.hexdigest()}"


@dataclass
class Binding:
    """Whether a model matches a manifest, and what to tell the user either way."""

    matches: bool
    actual: str  # the model's fingerprint (current format)
    problem: str = ""  # when it does not match: what differs, one line
    hint: str = ""
    notes: list[str] = field(default_factory=list)  # when it matches: what is worth saying


def bind(expected: str, model_table: Mapping[str, Any], tensors: Mapping[str, Any], *,
         where: str = "the manifest", live: str = "the live model") -> Binding:
    """Compare a manifest's fingerprint (and brief) with a model's canonical tensors."""
    actual = compute_fingerprint(tensors)
    if expected == actual:
        return Binding(True, actual, notes=_dtype_notes(model_table.get("dtypes"), tensors, live))
    replan = ("plan the manifest again from this model (`surgery plan --model pkg.mod:factory`, "
              "or the checkpoint it loads), or pass strict=False to apply it anyway")
    if not expected.startswith(FINGERPRINT_PREFIX):  # the first format
        if expected == legacy_fingerprint(tensors):
            return Binding(True, actual, notes=[
                f"{where} carries a fingerprint of the first format (keys, shapes and dtypes); "
                "it matches. Plan it again for a v2 fingerprint, which binds keys and shapes "
                "only, so that the manifest also applies to the model cast to bf16/fp16"])
        return Binding(False, actual, hint=replan, problem=(
            f"{where} carries a fingerprint of surgery's first format, which covered dtypes as "
            f"well as keys and shapes, and {live} does not match it: a different model, or the "
            "same one cast since it was planned; that format records no key brief, so what "
            "differs cannot be listed"))
    planned = model_table.get("keys")
    if not isinstance(planned, list) or not planned:
        return Binding(False, actual, hint=replan, problem=(
            f"{where} records no key brief (`keys` in [model]), so what differs cannot be "
            "listed"))
    lines, renamed = explain([str(e) for e in planned], key_summary(tensors), live=live)
    if renamed:
        replan = ("plan from the live model with --model (`surgery plan --model "
                  "pkg.mod:factory`), whose keys are the ones apply_manifest sees; or pass "
                  "strict=False to apply it anyway")
    return Binding(False, actual, hint=replan, problem="; ".join(lines) or (
        f"{where}'s key brief agrees with {live}, so its fingerprint was edited by hand or "
        "written by another tool"))


def _parse(entries: list[str]) -> dict[str, dict[str, int]]:
    """pattern -> {shape: count}; entries that do not parse are skipped (hostile input)."""
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        parts = e.rsplit(" ", 2)
        if len(parts) != 3 or not parts[2].startswith("x") or not parts[2][1:].isdigit():
            continue
        out.setdefault(parts[0], {})[parts[1]] = int(parts[2][1:])
    return out


def _stem(a: str, b: str) -> tuple[str, str]:
    """The renamed part of two patterns: up to their first N when both have one, else what is
    left once their common trailing segments are dropped."""
    pa, pb = a.split("."), b.split(".")
    if "N" in pa and "N" in pb:
        return ".".join(pa[:pa.index("N") + 1]), ".".join(pb[:pb.index("N") + 1])
    while len(pa) > 1 and len(pb) > 1 and pa[-1] == pb[-1]:
        pa, pb = pa[:-1], pb[:-1]
    return ".".join(pa), ".".join(pb)


def _profile(shapes: dict[str, int]) -> str:
    return " / ".join(f"{shape} x{n}" for shape, n in sorted(shapes.items()))


def _examples(names: list[str], table: dict[str, dict[str, int]]) -> str:
    shown = ", ".join(f"{n!r} (x{sum(table[n].values())})" for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more pattern(s)" if len(names) > SHOWN else "")


def explain(planned: list[str], live_entries: list[str], *, live: str = "the live model"
            ) -> tuple[list[str], bool]:
    """What differs between two key briefs, as short sentences; and whether keys look renamed."""
    plan, now = _parse(planned), _parse(live_entries)
    missing = sorted(set(plan) - set(now))
    unexpected = sorted(set(now) - set(plan))
    lines: list[str] = []
    # Renames keep shapes: pair missing and unexpected patterns with the same shapes and counts.
    by_profile: dict[tuple[tuple[str, int], ...], list[str]] = {}
    for p in unexpected:
        by_profile.setdefault(tuple(sorted(now[p].items())), []).append(p)
    stems: Counter[tuple[str, str]] = Counter()
    paired = 0
    for p in missing:
        candidates = by_profile.get(tuple(sorted(plan[p].items())))
        if candidates:
            stems[_stem(p, candidates.pop(0))] += 1
            paired += 1
    renamed = paired > 0 and 2 * paired >= max(len(missing), len(unexpected))
    if renamed:
        top = ", ".join(f"{a!r} -> {b!r}" for (a, b), _ in stems.most_common(SHOWN))
        lines.append(f"{live}'s keys look renamed: {top}"
                     + (f" ({len(stems) - SHOWN} more)" if len(stems) > SHOWN else ""))
    if missing:
        n = sum(sum(plan[p].values()) for p in missing)
        lines.append(f"{n} key(s) of the plan are missing from {live}: "
                     + _examples(missing, plan))
    if unexpected:
        n = sum(sum(now[p].values()) for p in unexpected)
        lines.append(f"{n} key(s) of {live} are not in the plan: " + _examples(unexpected, now))
    changed = sorted(p for p in set(plan) & set(now) if plan[p] != now[p])
    if changed:
        shown = ", ".join(f"{p!r} {_profile(plan[p])} planned, {_profile(now[p])} now"
                          for p in changed[:SHOWN])
        lines.append(f"shapes or counts differ in {len(changed)} key pattern(s): {shown}"
                     + (" ..." if len(changed) > SHOWN else ""))
    return lines, renamed


def _dtype_notes(planned: Any, tensors: Mapping[str, Any], live: str) -> list[str]:
    """A note when the model was cast since the plan (it binds: keys and shapes match)."""
    if not isinstance(planned, Mapping) or not planned:
        return []
    now = dtype_counts(tensors)
    if dict(planned) == now:
        return []

    def fmt(d: Mapping[str, Any]) -> str:
        return ", ".join(f"{k} x{v}" for k, v in sorted(d.items()))

    return [f"dtypes differ from the plan ({fmt(planned)}; {live}: {fmt(now)}): it binds by "
            "keys and shapes, and the regions compile for the dtypes they are called with"]
