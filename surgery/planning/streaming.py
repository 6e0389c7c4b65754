"""Plan streaming blocks as ``piecewise`` regions (surgery.runtime.piecewise) instead of leaving
them out. Opt-in: ``plan --piecewise`` (``plan_model(..., piecewise=True)``).

Which blocks. A block the plan left out as streaming (surgery.planning.blocks: its forward takes
a cache, or it sits in ``global_blocks``), or, from evidence, one whose subtree changed a cache
attribute in every step, becomes one piecewise region when its cache can be located:

- a forward argument named as a cache (``past_key_values``, ``cache``, ``layer_past`` ...). A
  transformers ``Cache`` (by its annotation) holds (batch, heads, length, head_dim) tensors, so
  its dim 2 is recorded as the dim that grows (``"cache:2"``) and marked dynamic at run time;
- an instance attribute of the block or one of its submodules named as a cache (the SDPA
  example's ``attn.kv_cache``), recorded without a dim (``"self.attn.kv_cache"``): a list cache
  grows in length, not in a tensor dim, and the cache's tensors mark the split points only.

Per-instance index. A block whose forward takes a per-instance int (the SDPA example's camera
trunk: ``cache[global_idx]`` is its slot) traces graphs of its own per instance: dynamo
specializes the int (it indexes a Python list), so its guards pick the instance's graphs, all in
the group's one code object. The runtime supports that as is: each path counts its own
compiles against its own budget, and the group raises dynamo's recompile limit to the sum of
the paths' budgets (surgery.runtime.piecewise). So such a block is planned piecewise when its
group's instances x ``INDEXED_GRAPHS_PER_INSTANCE`` stay within ``INDEXED_GRAPH_BUDGET``, with
``max_signatures`` set to the per-instance figure (a list cache compiles once per length until
its window is full; a window longer than that demotes the path at run time, with the reason).
Past the budget it keeps today's treatment, with the figures in its reason. An index that only
selects the block's slot of its list cache (``cache[global_idx]`` and no other use, found in the
forward's source by surgery.runtime.index_select) never reaches dynamo: the runtime passes the
slot, the instances share their graphs, and the group is planned whatever its size.

Which blocks keep today's treatment, with the reason added under ``[[left_out]]``: a block whose
forward takes a per-instance index in a group too large for the budget, and a block whose cache
cannot be located. Regions inside a block that becomes piecewise (its
``fixed_part``/``attn_proj`` children, evidence regions) are dropped: no region lies inside
another; the block's region covers them.

**Light pieces under region capture** (``light_pieces_plan``). With ``capture = "region"``
(the default) and the inductor backend, a piecewise region, and every ordinary region of the
same module class (it shares the piecewise region's pieces at run time,
surgery.runtime.shared_pieces, which needs the same backend), compile with
``LIGHT_PIECE_BACKEND`` (``aot_eager``: dynamo's and AOTAutograd's trace, no kernel build) as a
``[region.compile] backend``, written into the manifest where a reviewer sees it. The rule is
about the cold start, and it holds for any model, because of where a piecewise plan's speed
comes from: each piece replays as one CUDA graph, so the host work between the pieces, which
the names-only plan pays for every op it leaves eager, is gone whatever compiled the piece;
inductor adds the fusion of each piece's own kernels on top. The pieces, though, are the
compiles the names-only plan does not make, or makes whole: one block split at attention is
two inductor compiles with their own fixed costs, where the names-only plan compiled that
class once (on the H200, the SDPA example's pieces took 5.5 s against 2.7 s for its frame block
whole). So with inductor the piecewise plan's cold start came out behind the names-only plan's
(41.6 against 32.9 s), and with light pieces ahead of it in one call (37.5 against 40.5 s) at
1.82x its speed (27.2 against 49.5 ms a frame) and 95% coverage. What it costs is that fusion:
the same plan with inductor pieces ran 2.8-3.5x names-only in another call. A user who pays the
cold start for it sets ``backend = "inductor"`` on the region's compile table (kept as given:
the planner never overrides a backend a region names). Without region capture, aot_eager's
per-op launches would cost the host what inductor saves, so nothing changes there. A decoder
stack (surgery.planning.stacks: GPT-2's ``transformer``) and the blocks standing by for it keep
the plan's backend: their pieces are weighed one by one at run time by
surgery.runtime.compile_start (a piece under a tenth of its graph's work, or launch-bound by
size, compiles light; GPT-2's decode at batch 1 builds no inductor code that way), which knows
the pieces' sizes, where a plan made from names does not; a prefill-sized step keeps its
middle piece's fusion there.

What a name cannot decide: a graph break or a branch on the cache length inside the block.
The evidence planner runs the user's step once with the planned piecewise regions on aot_eager
(surgery.planning.piecewise_probe) and plans again with the blocks that fell back ``refused``:
each keeps today's treatment, with the runtime's reason under ``[[left_out]]``. A names-only
plan (a factory or a checkpoint, no step) cannot trace, so there it is checked at run time: the
block runs eager with the reason in its record (never a crash), and the plan's notes say so.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from surgery.formats.manifest import (
    PIECEWISE_DEFAULT_SPLIT_OPS,
    PIECEWISE_FALLBACK_FOR,
    PIECEWISE_KIND,
    LeftOut,
    Manifest,
    Region,
)
from surgery.planning.blocks import is_cache_arg, is_index_arg
from surgery.planning.regions import natural_key
from surgery.planning.stacks import counted_regions, plan_stacks
from surgery.planning.view import ModelView
from surgery.runtime.index_select import find_index_select

# What light pieces compile with: runtime.compile_start's LIGHT_PIECE_BACKEND (not imported from
# there: that module imports torch, which `surgery plan` of a checkpoint must not pay for).
LIGHT_PIECE_BACKEND = "aot_eager"
# The dim that grows in a transformers Cache's tensors: (batch, heads, length, head_dim).
HF_CACHE_LENGTH_DIM = 2
# How deep the search for cache attributes goes below the block (attn.kv_cache is one level).
_ATTR_DEPTH = 3
# How a left-out reason says "streaming": by names (surgery.planning.blocks) or by evidence
# (surgery.planning.evidence: Python state changed, or the ops inside changed with the same
# arguments).
_STREAMING_SIGNS = ("streaming block", "changed its attribute", "state kept between calls")
# Graphs one instance of a block with a per-instance index may compile (its region's
# max_signatures): a list cache changes the graph's structure once per length until its window
# is full (the SDPA example's camera trunk keeps 16 frames). The runtime compiles a further
# length only once two calls in a row show it (runtime/cache_sources: the first frame's and the
# full window's graphs, however many streams), so the bound, the window's lengths plus room, is
# what a cache whose structure does hold between calls could still reach.
INDEXED_GRAPHS_PER_INSTANCE = 20
# Graphs all instances of one such group may compile together (one code object; the runtime's
# recompile limit for a piecewise group is at most 256).
INDEXED_GRAPH_BUDGET = 128
# What a names-only piecewise plan says, since it cannot trace (surgery.planning.piecewise_probe).
NAMES_ONLY_NOTE = ("--piecewise from names: no step runs at plan time, so a graph break or a "
                   "branch on the cache length inside a piecewise block is checked at run time "
                   "(the block then runs eager, with the reason in the report); plan --input "
                   "STEP checks it before writing the manifest")


def cache_sources(block: Any, view: ModelView, path: str) -> list[str]:
    """Where the block's cache is, as manifest ``dynamic`` sources (may be empty)."""
    out: list[str] = []
    for arg in view.modules[path].forward_args or ():
        # `use_cache` is a flag and `cache_position` an index tensor, not caches
        if is_cache_arg(arg.name) and arg.name != "cache_position" and \
                not arg.name.startswith("use_") and "bool" not in arg.annotation:
            dim = f":{HF_CACHE_LENGTH_DIM}" if "Cache" in arg.annotation else ""
            out.append(arg.name + dim)
    for name, mod in block.named_modules():
        if name.count(".") >= _ATTR_DEPTH:
            continue
        for attr in vars(mod):
            if is_cache_arg(attr) and not attr.startswith("_"):
                out.append(".".join(["self", *filter(None, name.split(".")), attr]))
    return out


def _why_not(sources: Sequence[str]) -> str | None:
    if not sources:
        return "not piecewise: no cache argument or cache attribute was found to split at"
    return None


def index_arg(view: ModelView, path: str) -> str | None:
    """The name of the block's per-instance int argument (``global_idx``), if it takes one."""
    return next((a.name for a in view.modules[path].forward_args or () if is_index_arg(a)), None)


def _only_selects(block: Any, sources: Sequence[str]) -> bool:
    """The block's index only selects its slot of a list-cache argument (runtime.index_select)."""
    lists = [s for s in sources if ":" not in s and not s.startswith("self.")]
    return find_index_select(block.forward, (), lists) is not None


def _over_budget(index: str, instances: int) -> str | None:
    """Why a group of blocks with a per-instance index is too large to trace per instance."""
    graphs = instances * INDEXED_GRAPHS_PER_INSTANCE
    if graphs <= INDEXED_GRAPH_BUDGET:
        return None
    return (f"not piecewise: its forward takes a per-instance index {index!r}, so each instance "
            f"would trace graphs of its own: {instances} instances x "
            f"{INDEXED_GRAPHS_PER_INSTANCE} graphs = {graphs}, over the budget of "
            f"{INDEXED_GRAPH_BUDGET}")


def plan_piecewise(manifest: Manifest, model: Any, view: ModelView, *,
                   exclude: Sequence[str] = (), refused: Mapping[str, str] | None = None
                   ) -> list[str]:
    """Make the streaming blocks left out of ``manifest`` piecewise regions, in place.

    A block matching an ``exclude`` glob stays out. A block (or a stack) in ``refused`` keeps
    today's treatment, its reason added under ``[[left_out]]`` (surgery.planning.piecewise_probe
    found it cannot trace as one graph).

    Returns notes for the plan's output (how many blocks, which kept their treatment and why).
    """
    # blocks: items of a numbered container (`global_blocks.3`, `h.0`), as the planner's are
    candidates = sorted({lo.path for lo in manifest.left_out if lo.path in view.modules
                         and lo.path.rsplit(".", 1)[-1].isdigit()
                         and not any(fnmatch.fnmatchcase(lo.path, g) for g in exclude)
                         and any(s in lo.reason for s in _STREAMING_SIGNS)}, key=natural_key)
    # the outermost candidates only: a block, not its attention as well
    blocks = [p for p in candidates if not any(p.startswith(o + ".") for o in candidates)]
    groups: dict[tuple[str | None, tuple[str, ...]], list[str]] = {}
    kept: dict[str, str] = {}
    for path in blocks:
        try:
            block = model.get_submodule(path)
        except AttributeError:
            continue
        sources = cache_sources(block, view, path)
        why = (refused or {}).get(path) or _why_not(sources)
        if why is not None:
            kept[path] = why
            continue
        groups.setdefault((view.modules[path].cls, tuple(sources)), []).append(path)
    indexed: set[tuple[str | None, tuple[str, ...]]] = set()
    for key, paths in list(groups.items()):
        index = index_arg(view, paths[0])
        if index is None:
            continue
        # an index the runtime keeps from dynamo: the instances share graphs, any count fits
        why = None if _only_selects(model.get_submodule(paths[0]), key[1]) else \
            _over_budget(index, len(paths))
        if why is not None:
            kept.update(dict.fromkeys(paths, why))
            del groups[key]
        else:
            indexed.add(key)
    chosen = {p for paths in groups.values() for p in paths}
    inside = [r for r in manifest.regions
              if any(_within(_owner(r, p), b) for p in r.paths for b in chosen)]
    for region in inside:
        dropped = [p for p in region.paths if any(_within(_owner(region, p), b) for b in chosen)]
        region.paths = [p for p in region.paths if p not in dropped]
        manifest.left_out += [LeftOut(p, region.kind, "inside piecewise region " +
                                      next(b for b in chosen if _within(_owner(region, p), b)))
                              for p in dropped]
    manifest.regions = [r for r in manifest.regions if r.paths]
    manifest.left_out = [lo for lo in manifest.left_out if lo.path not in chosen
                         and not any(lo.path.startswith(b + ".") and
                                     any(s in lo.reason for s in _STREAMING_SIGNS)
                                     for b in chosen)]
    for lo in manifest.left_out:
        if lo.path in kept:
            lo.reason = f"{lo.reason}; {kept[lo.path]}"
    for (cls, found), paths in groups.items():
        params = sum(view.numel(p) for p in paths)
        # an indexed group: each path a budget for its list cache's structures
        budget = {"max_signatures": INDEXED_GRAPHS_PER_INSTANCE} if (cls, found) in indexed \
            else {}
        manifest.regions.append(Region(
            kind=PIECEWISE_KIND, paths=sorted(paths, key=natural_key), module_class=cls,
            parameters=params, compile=budget,
            piecewise={"split_ops": list(PIECEWISE_DEFAULT_SPLIT_OPS), "dynamic": list(found)}))
    notes = plan_stacks(manifest, view, refused=refused) if chosen else []
    notes += light_pieces_plan(manifest) if chosen else []
    manifest.regions.sort(key=lambda r: natural_key(r.paths[0]))
    if chosen:
        manifest.model["covered_parameters"] = _covered(manifest, view)
    if chosen:
        notes.insert(0, f"{len(chosen)} streaming block(s) planned piecewise (e.g. "
                     f"{min(chosen, key=natural_key)}): one graph each, split at attention and "
                     "the cache; the fixed-shape pieces run as region graphs")
    elif blocks:
        notes.append(f"--piecewise: none of the {len(blocks)} streaming block(s) could be "
                     f"planned piecewise (e.g. {blocks[0]}: {kept.get(blocks[0], '?')})")
    else:
        notes.append("--piecewise: the plan left out no streaming block, so nothing is piecewise")
    return notes


def light_pieces_plan(manifest: Manifest) -> list[str]:
    """Under region capture with inductor, make the piecewise regions and the ordinary regions
    of their classes compile with ``LIGHT_PIECE_BACKEND``, in place (see the module docstring);
    a region that names its own backend keeps it. Returns the plan's note (one, or none)."""
    plan = manifest.compile
    if plan.get("capture") != "region" or plan.get("backend", "inductor") != "inductor" or \
            plan.get("mode") is not None:
        return []
    stacks = {p for r in manifest.regions for p in (r.piecewise or {}).get(
        PIECEWISE_FALLBACK_FOR, ())}
    blocks = [r for r in manifest.regions if r.kind == PIECEWISE_KIND and not
              stacks.intersection(r.paths) and PIECEWISE_FALLBACK_FOR not in (r.piecewise or {})]
    classes = {r.module_class for r in blocks if r.module_class is not None}
    light = [r for r in manifest.regions if "backend" not in r.compile and
             (r in blocks or (r.kind != PIECEWISE_KIND and r.callable == "forward"
                              and r.module_class in classes))]
    for region in light:
        region.compile = {**region.compile, "backend": LIGHT_PIECE_BACKEND}
    if not light:
        return []
    shared = sum(1 for r in light if r.kind != PIECEWISE_KIND)
    also = f" and {shared} region(s) sharing their pieces" if shared else ""
    return [f"{len(light)} region(s) compile {LIGHT_PIECE_BACKEND} (light pieces): the "
            f"piecewise region(s){also}"
            "; each piece replays as a CUDA graph, so the step keeps its capture and loses only "
            "inductor's fusion inside the pieces, for a cold start under the names-only plan's "
            "(set backend = \"inductor\" in a region's [region.compile] for the fusion)"]


def _owner(region: Region, path: str) -> str:
    return path if region.callable == "forward" else path.rsplit(".", 1)[0]


def _within(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def _covered(manifest: Manifest, view: ModelView) -> int:
    return sum(view.numel(p) for r in counted_regions(manifest) if r.callable == "forward"
               for p in r.paths if p in view.modules)



def region_paths(manifest: Manifest) -> list[str]:
    """Every region path (methods too), as evidence coverage counts them."""
    return [p for r in manifest.regions for p in r.paths]
