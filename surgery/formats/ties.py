"""Tied and shared weights: one tensor under several names, and the writers that keep one name.

A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``; an ALBERT-style
block shared by two paths) is one tensor that the live model's ``state_dict()`` lists under
every name. Writers disagree about which names reach the file:

- ``torch.save(model.state_dict())`` keeps every name (they share one storage);
- transformers' ``save_pretrained`` leaves out the names its class declares in
  ``_tied_weights_keys`` (``{"lm_head.weight": "transformer.wte.weight"}``; a list of names
  before transformers 5);
- safetensors' ``save_model`` (what a diffusers model with shared weights must use, since
  ``save_pretrained`` refuses shared tensors) keeps the alphabetically first name of each group;
- ``surgery export`` stores the bytes once and lists the other names in ``surgery.aliases``.

The fingerprint covers names and shapes, so the same model read from two of these files gave
two fingerprints, and a manifest planned from a save_pretrained folder never bound to the model
loaded from it. Two rules make a tied parameter count as one tensor:

1. **Binding accepts a live name that aliases a planned one.** When the live model's fingerprint
   differs, `binding_variants` leaves its aliases out the ways the writers above do (the declared
   `_tied_weights_keys`, then the first name of each group, then the alphabetically first), and
   a variant whose fingerprint is the manifest's binds, with a note naming the names left out.
   Which names alias is read from the model itself: parameters and buffers that are one object
   under several names (`live_ties`; this works on the meta device, where storages are empty),
   and the class's `_tied_weights_keys` where both names exist.
2. **A plan from a live model records its ties** (``tied = {alias = "source"}`` in ``[model]``,
   `TIED_FIELD`). `verify` and `export` with that manifest put back an alias that the checkpoint
   left out before comparing fingerprints (`restore_ties`), and `export` stores it as an alias,
   so ``load_exported`` gives every name and ``load_state_dict(strict=True)`` works.

A manifest is untrusted: `restore_ties` only adds a name the checkpoint lacks whose source it
holds, with the source's shape, so a hostile ``tied`` table can change the fingerprint (and
fail binding) but cannot point an alias at a tensor that does not exist. The schema bounds its
size. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from surgery.formats.keys import canonical_key

# The [model] field a plan from a live model writes: {alias: source}, canonical names.
TIED_FIELD = "tied"

T = TypeVar("T")


def declared_ties(model: Any) -> dict[str, str]:
    """{alias: source} from the class's ``_tied_weights_keys`` (transformers), exact names only.

    transformers 5 declares a dict {target: source}; earlier releases a list of target names
    (patterns, some of them regexes) whose source is the input embedding: those give no source
    and are left to the object identity in `live_ties`.
    """
    declared = getattr(type(model), "_tied_weights_keys", None)
    if not isinstance(declared, Mapping):
        return {}
    return {str(k): str(v) for k, v in declared.items()
            if isinstance(k, str) and isinstance(v, str) and k != v}


def live_ties(model: Any) -> dict[str, str]:
    """{alias: source} of a live model, canonical names: one tensor object under several names.

    The source is the first name in the model's own order (the one ``save_pretrained`` keeps,
    and what `restore_ties` needs to be present). Declared ties whose two names both exist in
    the state dict are added, in their declared direction.
    """
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if tensor is None:
            continue
        c = canonical_key(name)
        source = first.setdefault(id(tensor), c)
        if source != c:
            ties[c] = source
    names = {canonical_key(k) for k, _ in named}
    for alias, source in declared_ties(model).items():
        if alias in names and source in names and alias not in ties and source not in ties:
            ties[alias] = source
    return ties


def restore_ties(table: Mapping[str, T], tied: object) -> tuple[dict[str, T], dict[str, str]]:
    """`table` plus each alias of `tied` it lacks whose source it holds; and those aliases.

    `tied` comes from a manifest (untrusted): anything but a mapping of strings is ignored.
    """
    out = dict(table)
    restored: dict[str, str] = {}
    if not isinstance(tied, Mapping):
        return out, restored
    pairs = sorted((a, s) for a, s in tied.items() if isinstance(a, str) and isinstance(s, str))
    for alias, source in pairs:
        if alias not in out and source in table:
            out[alias] = table[source]
            restored[alias] = source
    return out, restored


def binding_variants(table: Mapping[str, T], ties: Mapping[str, str], *,
                     declared: Mapping[str, str] | None = None
                     ) -> Iterator[tuple[dict[str, T], list[str]]]:
    """The live `table` with tied names left out, as each writer leaves them out.

    Yields (table, names left out), each distinct variant once: the declared aliases
    (save_pretrained); every alias but the first name of its group; every name but the
    alphabetically first of its group (safetensors' save_model).
    """
    groups: dict[str, list[str]] = {}
    for alias, source in ties.items():
        if alias in table and source in table:
            groups.setdefault(source, [source]).append(alias)
    if not groups:
        return
    rules: list[list[str]] = []
    if declared:
        rules.append(sorted(a for a in declared if a in table and declared[a] in table))
    rules.append(sorted(a for members in groups.values() for a in members[1:]))
    rules.append(sorted(a for members in groups.values() for a in sorted(members)[1:]))
    seen: set[tuple[str, ...]] = set()
    for left in rules:
        if not left or tuple(left) in seen:
            continue
        seen.add(tuple(left))
        drop = set(left)
        yield {k: v for k, v in table.items() if k not in drop}, left


def ties_note(left: list[str], ties: Mapping[str, str], *, where: str) -> str:
    """The binding note when a variant matched: which names were bound as one tensor."""
    shown = ", ".join(f"{a} (= {ties.get(a, '?')})" for a in left[:3])
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    return (f"{where} leaves out {len(left)} tied name(s) the live model has: {shown}{more}; "
            "they are one tensor with a planned name (save_pretrained and safetensors' "
            "save_model store tied weights once), so the model binds")
