"""Find compile regions in a model view. Pure: no I/O, no torch.

A *model view* is what can be known of a model without running it: its module paths, their
classes (live models only), the tensors each module owns, and the region-worthy methods a class
defines (live models only). A checkpoint gives paths and tensors; a live model gives the rest.

Candidates, strongest first, and why:
1. ``--include`` globs: the user said so.
2. Named blocks (``frame_block``, ``patch_embed_block``): LingBot-Map's fixed-shape blocks.
3. Generic repeated blocks: children of a numbered container that share a class (live) or most
   of their tensor layout (checkpoint), such as diffusers ``transformer_blocks.N``, HF
   ``encoder.layer.N`` and timm ``blocks.N``. A whole block is a bigger graph than its parts.
4. Sub-block named kinds (``attn_pre``, ``ffn_residual``, ``attn_proj``): the fixed-shape parts
   of *streaming* blocks, whose attention over a growing KV cache changes shape every step.
   Streaming blocks are never generic regions, so on LingBot's ``global_blocks.N`` the named
   kinds win; where a whole block is a region, its ``attn.proj`` is left out.
No region lies inside another: a candidate nested in (or containing) a stronger one is left
out, and the plan records why.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from surgery.errors import ManifestError, RegionError
from surgery.formats.manifest import PIECEWISE_KIND, Manifest
from surgery.planning.blocks import (
    STREAMING_CONTAINERS,
    fixed_parts,
    single_layer,
    single_layer_reason,
    stream_reason,
)
from surgery.planning.view import ModelView, ModuleNode, ancestors, view_from_tensors

# The view and the block signs live in their own modules; they are re-exported here because
# callers (plan, tests) have always imported them from the region finder.
__all__ = [
    "ATTN_PRE", "ATTN_PROJ", "BLOCK_STACK", "CUSTOM", "FFN_RESIDUAL", "FIXED_PART", "FRAME_BLOCK",
    "METHOD_KINDS", "OUTPUTS_OUTLIVE_STEP", "PATCH_EMBED", "PATCH_EMBED_BLOCK", "REPEATED_BLOCK",
    "STREAMING_CONTAINERS", "Candidate", "Found", "ModelView", "ModuleNode", "find_regions",
    "natural_key", "view_from_tensors",
]

FRAME_BLOCK = "frame_block"
PATCH_EMBED_BLOCK = "patch_embed_block"
ATTN_PRE = "attn_pre"
FFN_RESIDUAL = "ffn_residual"
ATTN_PROJ = "attn_proj"
REPEATED_BLOCK = "repeated_block"
PATCH_EMBED = "patch_embed"
BLOCK_STACK = "block_stack"
CUSTOM = "custom"
# A fixed-shape part of a streaming block (GPT-2's `h.N.mlp` beside the attention that takes the
# KV cache): found from forward signatures, so only in a live model (surgery.planning.blocks).
FIXED_PART = "fixed_part"

# Methods that LingBot-Map's streaming blocks split out of their forward: fixed-shape pieces
# around the attention over the KV cache. They own no parameters, so only a live model shows them.
METHOD_KINDS: tuple[str, ...] = (ATTN_PRE, FFN_RESIDUAL)
# Attention output projections, the fixed-shape matmul inside a streaming block.
ATTN_PROJ_SUFFIXES: tuple[tuple[str, ...], ...] = (("attn", "proj"),)
# Whether a kind's outputs outlive the step. Under CUDA graphs an output lives in the graph's
# memory pool until the region's next replay overwrites it, so an output kept across steps (the
# k, v that attn_pre returns go into the KV cache) must be cloned outside the graph. Cloning
# where it is not needed is not free: a cloned output reaches the next graph as a non-pool input
# that is copied in again (cloning all 120 regions of the LingBot-size example cost about 7 ms a
# frame on an H200; benchmarks/RESULTS.md). Kinds not listed keep the manifest default (clone).
# This applies to the compiler's graphs; with capture = "region" surgery keeps a ring of output
# buffers instead (surgery.runtime.graphs.replay), and the plan clones nothing.
OUTPUTS_OUTLIVE_STEP: dict[str, bool] = {
    ATTN_PRE: True, FFN_RESIDUAL: False, ATTN_PROJ: False, FRAME_BLOCK: False,
    PATCH_EMBED_BLOCK: False, PATCH_EMBED: False,
}
# Two blocks count as the same repeated block when they share this much of their tensor layout
# (SD3's last block lacks the context MLP that the others have).
_SIMILARITY = 0.5

_PRIORITY = {CUSTOM: 0, PATCH_EMBED: 1, BLOCK_STACK: 1, FRAME_BLOCK: 1, PATCH_EMBED_BLOCK: 1,
             REPEATED_BLOCK: 2,
             ATTN_PRE: 3, FFN_RESIDUAL: 3, ATTN_PROJ: 3, FIXED_PART: 3}


@dataclass
class Candidate:
    kind: str
    path: str  # the compiled callable: a module path, or `<module path>.<method>`
    callable: str = "forward"
    group: str = ""  # regions of one kind split by this (container path for repeated blocks)
    cls: str | None = None

    @property
    def module_path(self) -> str:
        return self.path.rpartition(".")[0] if self.callable == "method" else self.path


@dataclass
class Found:
    regions: list[Candidate]
    left_out: list[tuple[str, str, str]]  # (path, kind, reason)


def _is_index(s: str) -> bool:
    return s.isdigit()


def _segments(path: str) -> list[str]:
    return path.split(".") if path else []


def natural_key(path: str) -> list[object]:
    """Sort `blocks.10` after `blocks.9`."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGIT_RUNS.split(path)]


_DIGIT_RUNS = re.compile(r"(\d+)")


def _named_kind(path: str) -> str | None:
    if not path.rpartition(".")[2].isdigit():
        return None  # most modules: not a numbered block
    seg = _segments(path)
    if len(seg) >= 2 and _is_index(seg[-1]):
        if seg[-2] == "frame_blocks":
            return FRAME_BLOCK
        if len(seg) >= 3 and seg[-3:-1] == ["patch_embed", "blocks"]:
            return PATCH_EMBED_BLOCK
    return None


def _is_streaming(view: ModelView, path: str) -> bool:
    return stream_reason(view, path) is not None


def _layout(view: ModelView, path: str) -> frozenset[tuple[str, str, tuple[int, ...]]]:
    """(module below `path`, tensor name, shape) of every tensor under `path`."""
    pre = len(path) + 1
    return frozenset([(p[pre:], name, t.shape) for p in view.subtree(path)
                      for name, t in view.modules[p].tensors.items()])


def _repeated_groups(view: ModelView) -> list[tuple[str, list[str]]]:
    """Numbered containers and the children that form one repeated block."""
    out: list[tuple[str, list[str]]] = []
    for path, kids in view.child_index().items():
        if len(kids) < 2 or not all(_is_index(k.rsplit(".", 1)[-1]) for k in kids):
            continue
        if view.live:
            common, _ = Counter(view.modules[k].cls for k in kids).most_common(1)[0]
            members = [k for k in kids if view.modules[k].cls == common]
        else:
            layouts = {k: _layout(view, k) for k in kids}
            ref = Counter(layouts.values()).most_common(1)[0][0]
            members = [k for k in kids if layouts[k] and
                       len(layouts[k] & ref) / max(1, len(layouts[k] | ref)) >= _SIMILARITY]
        members = [k for k in members if view.has_tensors(k)]
        if len(members) >= 2:
            out.append((path, members))
    return out


def _candidates(view: ModelView) -> tuple[list[Candidate], list[tuple[str, str, str]]]:
    found: dict[str, Candidate] = {}
    notes: list[tuple[str, str, str]] = []
    streaming: set[str] = set()
    for container, members in _repeated_groups(view):
        for m in members:
            layer = single_layer(view, m)
            if layer is not None:
                notes.append((m, REPEATED_BLOCK, single_layer_reason(layer)))
                continue
            reason = stream_reason(view, m)
            if reason is None:
                found[m] = Candidate(REPEATED_BLOCK, m, group=container, cls=view.modules[m].cls)
                continue
            notes.append((m, REPEATED_BLOCK, reason))
            streaming.add(m)
            if view.modules[m].methods:
                # LingBot's split: its methods are the fixed-shape parts, and they call the
                # submodules (ffn_residual calls mlp), so a submodule region would nest in them.
                continue
            skipped: list[tuple[str, str]] = []
            for part in fixed_parts(view, m, skipped):
                rel = part[len(m) + 1:]
                found[part] = Candidate(FIXED_PART, part, group=f"{container}.*.{rel}",
                                        cls=view.modules[part].cls)
            notes += [(p, FIXED_PART, why) for p, why in skipped]
    for path, node in view.modules.items():
        kind = _named_kind(path)
        if kind is not None:
            found[path] = Candidate(kind, path, cls=node.cls)
        if node.methods:
            streaming.add(path)
        for method in METHOD_KINDS:
            if method in node.methods:
                mp = f"{path}.{method}"
                found[mp] = Candidate(method, mp, callable="method", cls=node.cls)
    # attn.proj is the fixed-shape matmul of a streaming block's attention: proposed only there,
    # so models without streaming blocks (timm, diffusers) see no attn_proj candidates at all.
    for path in _attn_projs(view):
        if any(a in streaming or (a and _is_streaming(view, a))
               for a in ancestors(path.rpartition(".")[0])):
            found[path] = Candidate(ATTN_PROJ, path, cls=view.modules[path].cls)
    return list(found.values()), notes


def _attn_projs(view: ModelView) -> list[str]:
    out = []
    ends = tuple(".".join(s) for s in ATTN_PROJ_SUFFIXES)
    for path, node in view.modules.items():
        if not path.endswith(ends):
            continue  # (a cheap string test first: this runs for every module)
        seg = _segments(path)
        if any(tuple(seg[-len(s):]) == s for s in ATTN_PROJ_SUFFIXES) and \
                any(len(t.shape) == 2 for t in node.tensors.values()):
            out.append(path)
    return out


def _is_within(inner: str, outer: str) -> bool:
    """Whether module path `inner` is `outer` or lies inside it ("" is the root)."""
    return inner == outer or not outer or inner.startswith(f"{outer}.")


def _overlaps(a: Candidate, b: Candidate) -> bool:
    """Whether compiling both would nest one compiled callable inside the other.

    A module's forward contains everything below it. A method contains only what it calls, which
    a view cannot see, so a method overlaps only forwards at or above its own module; two
    methods of one module do not overlap.
    """
    if a.callable == "method" and b.callable == "method":
        return False
    if a.callable == "method":
        return _is_within(a.module_path, b.module_path)
    if b.callable == "method":
        return _is_within(b.module_path, a.module_path)
    return _is_within(a.path, b.path) or _is_within(b.path, a.path)


def _resolve(cands: Sequence[Candidate]) -> tuple[list[Candidate], list[tuple[str, str, str]]]:
    """Accept candidates strongest first; one that overlaps an accepted one is left out.

    Overlaps are found through two maps (accepted forwards by module path, and the first
    accepted region below each module path) walked along the candidate's ancestors, so each
    candidate costs its depth, not a comparison with every accepted region (`_overlaps` states
    the rule; issue 10's quadratic plan time was this pair of loops too).
    """
    order = sorted(cands, key=lambda c: (_PRIORITY.get(c.kind, 0), c.module_path.count("."),
                                         natural_key(c.path)))
    accepted: list[Candidate] = []
    left: list[tuple[str, str, str]] = []
    forward_at: dict[str, int] = {}  # module path -> index in `accepted` of its forward region
    first_below: dict[str, int] = {}  # module path -> first accepted region at or below it
    for c in order:
        mp = c.module_path
        hits = [forward_at[a] for a in ancestors(mp) if a in forward_at]
        if c.callable == "forward" and mp in first_below:
            hits.append(first_below[mp])
        if not hits:
            i = len(accepted)
            accepted.append(c)
            if c.callable == "forward":
                forward_at.setdefault(mp, i)
            for a in ancestors(mp):
                first_below.setdefault(a, i)
            continue
        clash = accepted[min(hits)]
        assert _overlaps(clash, c)
        where = "inside" if _is_within(mp, clash.module_path) else "contains"
        left.append((c.path, c.kind, f"{where} {clash.kind} region {clash.path}"))
    return accepted, left


def _match(patterns: Iterable[str], path: str) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(path, p)), None)


def _fold(view: ModelView, accepted: list[Candidate]
          ) -> tuple[list[Candidate], list[tuple[str, str, str]]]:
    """Replace the blocks of a fixed-shape container by the container itself.

    Under CUDA graphs every region call is a replay with its own bookkeeping, and the per-step
    cost grows faster than the number of regions, so one region for LingBot's 24 patch-embed
    blocks beats 24 (benchmarks/RESULTS.md). A container qualifies when every numbered child of
    its block list is a region, no other region lies inside it, it is not the whole model, and
    nothing inside it streams. Regions and streaming modules are counted per ancestor once,
    so the checks are lookups (linear in the view, issue 10).
    """
    by_list: dict[str, list[Candidate]] = {}
    for c in accepted:
        seg = _segments(c.path)
        if c.callable == "forward" and len(seg) >= 3 and _is_index(seg[-1]) and \
                c.kind in (PATCH_EMBED_BLOCK, REPEATED_BLOCK, FRAME_BLOCK, CUSTOM):
            by_list.setdefault(".".join(seg[:-1]), []).append(c)
    if not by_list:
        return list(accepted), []
    out = {id(c): c for c in accepted}
    inside: Counter[str] = Counter(a for c in accepted for a in ancestors(c.module_path))
    streams = {a for p in view.modules if p and _is_streaming(view, p) for a in ancestors(p)}
    left: list[tuple[str, str, str]] = []
    for blocks_path, members in by_list.items():
        container = blocks_path.rpartition(".")[0]
        numbered = [k for k in view.children(blocks_path) if _is_index(k.rsplit(".", 1)[-1])]
        if sorted(c.path for c in members) != sorted(numbered) or \
                inside[container] != len(members) or container in streams:
            continue
        kind = PATCH_EMBED if container.rsplit(".", 1)[-1] == "patch_embed" else BLOCK_STACK
        for c in members:
            del out[id(c)]
            inside.subtract(ancestors(c.module_path))
        folded = Candidate(kind, container, cls=view.modules[container].cls)
        out[id(folded)] = folded
        inside.update(ancestors(container))
        left += [(c.path, c.kind, f"folded into {kind} region {container}") for c in members]
    return list(out.values()), left


def find_regions(view: ModelView, *, include: Sequence[str] = (),
                 exclude: Sequence[str] = (), fold: bool = False) -> Found:
    """Candidates -> non-overlapping regions, plus what was left out and why.

    `include` globs add module (or `module.method`) paths as regions that win over every other
    candidate; `exclude` globs drop regions after nesting is resolved. A glob that matches
    nothing is an error, since a silent no-op is how regions go missing. `fold` compiles a
    fixed-shape container whose blocks are all regions as one region (see `_fold`).
    """
    cands, notes = _candidates(view)
    by_path = {c.path: c for c in cands}  # paths are unique: _candidates keys them by path
    for pattern in include:
        hits = [p for p in view.modules if p and fnmatch.fnmatchcase(p, pattern)]
        hits += [c.path for c in list(by_path.values()) if c.callable == "method"
                 and fnmatch.fnmatchcase(c.path, pattern)]
        if not hits:
            raise RegionError(f"--include {pattern!r} matches no module in the model",
                              region=pattern, hint=_closest_hint(view, pattern))
        for h in hits:
            old = by_path.pop(h, None)  # re-inserted last, as an include is the newest word
            by_path[h] = Candidate(CUSTOM, h, callable=old.callable if old else "forward",
                                   group=pattern, cls=old.cls if old else view.modules[h].cls)
    accepted, left = _resolve(list(by_path.values()))
    kept: list[Candidate] = []
    used: set[str] = set()
    for c in accepted:
        pat = _match(exclude, c.path)
        if pat is None:
            kept.append(c)
        else:
            used.add(pat)
            left.append((c.path, c.kind, f"excluded by --exclude {pat!r}"))
    if fold:  # after --exclude, so an excluded block keeps its container from folding
        kept, folded = _fold(view, kept)
        left += folded
    unused = [p for p in exclude if p not in used]
    if unused:
        raise RegionError(f"--exclude {unused[0]!r} matches no region of the plan",
                          region=unused[0], hint="run `surgery plan` without --exclude to see "
                          "the region paths, then exclude one of them (globs such as "
                          "'aggregator.frame_blocks.*' work)")
    kept.sort(key=lambda c: natural_key(c.path))
    left.extend(notes)
    left.sort(key=lambda t: natural_key(t[0]))
    return Found(kept, left)


def _closest_hint(view: ModelView, pattern: str) -> str:

    close = difflib.get_close_matches(pattern, [p for p in view.modules if p], n=1)
    near = f"; did you mean {close[0]!r}?" if close else ""
    return f"globs match dotted module paths such as 'aggregator.frame_blocks.*'{near}"


# Every kind surgery's planners write. A kind is a label (the report groups by it), except where
# it selects behaviour (piecewise, the clone defaults), so a misspelt one must not pass quietly.
PLANNED_KINDS: tuple[str, ...] = (
    FRAME_BLOCK, PATCH_EMBED_BLOCK, ATTN_PRE, FFN_RESIDUAL, ATTN_PROJ, REPEATED_BLOCK, PATCH_EMBED,
    BLOCK_STACK, CUSTOM, FIXED_PART, PIECEWISE_KIND, "observed")  # evidence.OBSERVED


def check_kinds(manifest: Manifest) -> None:
    """Refuse a region kind that reads as a misspelling of a planned kind (`repeated_blocks`).

    Other labels pass: an ``--include 'GLOB:method'`` region is named after its method.
    """
    for i, region in enumerate(manifest.regions):
        if region.kind in PLANNED_KINDS:
            continue
        close = difflib.get_close_matches(region.kind, PLANNED_KINDS, n=1, cutoff=0.8)
        if close:
            where = manifest.source_path or "manifest"
            raise ManifestError(
                f"{where}: region[{i}].kind = {region.kind!r} is not a kind surgery plans; "
                f"did you mean {close[0]!r}?", path=manifest.source_path,
                location=f"region[{i}].kind",
                hint=f"write kind = {close[0]!r} (the kinds: {', '.join(PLANNED_KINDS)})")
