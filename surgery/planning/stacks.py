"""Plan a decoder stack as one piecewise region when its blocks are piecewise (``--piecewise``).

Why. A piecewise region per block enters dynamo once per block per step; a region over the
module that runs the blocks (GPT-2's ``transformer``, Llama's ``model``) enters it once a step
(surgery.runtime.piecewise_stack has the measured reason and the runtime side).

Which module. After surgery.planning.streaming made a group of blocks piecewise, the stack is
the parent of their container when, by names:

- the group holds every item of one numbered container (``transformer.h.0`` ... ``h.11``), so
  the stack's graph holds no block that is not piecewise;
- the parent's forward takes a transformers ``Cache`` argument named as a cache (``cache``,
  ``past_key_values``): its tensors are (batch, heads, length, head_dim) and dim 2 is marked
  dynamic, as for the blocks; the split then finds every block's cache ops from that dim (a
  parent without one is no decoder stack, and nothing is said about it);
- the parent is not the model's root (a root's forward computes the loss and the logits over
  the vocabulary with ``logits_to_keep``: more branches, no more host time to save).

``drop_stacks`` turns such a manifest back into the per-block layout (a benchmark's baseline).

Whether the stack really traces as one graph is known only when dynamo traces it, so the block
regions stay in the manifest, each standing by for the stack (``fallback_for``): if the stack
runs eager (a graph break in mask creation, a branch on the cache length), its blocks run
piecewise as they did before. A stack the names rule refuses keeps the per-block regions, with
the reason under ``[[left_out]]`` at the stack's path.
"""

from __future__ import annotations

from collections.abc import Mapping

from surgery.formats.manifest import (
    PIECEWISE_FALLBACK_FOR,
    PIECEWISE_KIND,
    LeftOut,
    Manifest,
    Region,
)
from surgery.planning.blocks import is_cache_arg
from surgery.planning.view import ModelView

# The dim that grows in a transformers Cache's tensors: (batch, heads, length, head_dim).
STACK_CACHE_DIM = 2
# Graphs a stack region may compile: a prefill and a decode graph for each batch size and grad
# mode a caller uses (no_grad, inference_mode), and a prompt length that turns dynamic.
STACK_MAX_COMPILES = 16


def stack_cache_arg(view: ModelView, path: str) -> str | None:
    """The stack's forward argument that is a transformers Cache, by name and annotation."""
    for arg in view.modules[path].forward_args or ():
        if is_cache_arg(arg.name) and arg.name != "cache_position" and \
                "Cache" in arg.annotation and "bool" not in arg.annotation:
            return arg.name
    return None


def _why_not_stack(view: ModelView, region: Region, stack: str, container: str) -> str | None:
    items = set(view.children(container))
    if items != set(region.paths):
        return (f"not one piecewise stack: {len(region.paths)} of the {len(items)} items of "
                f"{container!r} are piecewise blocks; they stay per-block regions")
    return None


def plan_stacks(manifest: Manifest, view: ModelView, *,
                refused: Mapping[str, str] | None = None) -> list[str]:
    """Add a stack region over each piecewise block group that qualifies, in place; its blocks
    stand by for it. A stack in ``refused`` (surgery.planning.piecewise_probe saw it fall back)
    is not added: its blocks stay piecewise regions of their own, the reason under
    ``[[left_out]]`` at the stack's path. Returns notes for the plan's output."""
    notes: list[str] = []
    blocks = [r for r in manifest.regions if r.kind == PIECEWISE_KIND and r.piecewise
              and PIECEWISE_FALLBACK_FOR not in r.piecewise and not r.compile]
    for region in blocks:
        containers = {p.rsplit(".", 1)[0] for p in region.paths if "." in p}
        if len(containers) != 1:
            continue
        (container,) = containers
        stack = container.rsplit(".", 1)[0] if "." in container else ""
        if not stack or stack not in view.modules:
            continue  # the container is the root's: the root is no stack (see the docstring)
        arg = stack_cache_arg(view, stack)
        if arg is None:
            continue  # no decoder stack: nothing to mark dynamic on its forward
        why = (refused or {}).get(stack) or _why_not_stack(view, region, stack, container)
        if why is not None:
            manifest.left_out.append(LeftOut(stack, PIECEWISE_KIND, why))
            continue
        inside = [r for r in manifest.regions if r is not region and r.callable == "forward"
                  and any(p == stack or p.startswith(stack + ".") for p in r.paths)]
        for other in inside:  # embeddings, ln_f: the stack's graph covers them
            manifest.left_out += [LeftOut(p, other.kind, f"inside piecewise region {stack}")
                                  for p in other.paths]
            manifest.regions.remove(other)
        region.piecewise = {**(region.piecewise or {}), PIECEWISE_FALLBACK_FOR: [stack]}
        manifest.regions.append(Region(
            kind=PIECEWISE_KIND, paths=[stack], module_class=view.modules[stack].cls,
            parameters=view.numel(stack), compile={"max_signatures": STACK_MAX_COMPILES},
            piecewise={"split_ops": list(region.piecewise["split_ops"]),
                       "dynamic": [f"{arg}:{STACK_CACHE_DIM}"]}))
        notes.append(f"--piecewise: the {len(region.paths)} piecewise blocks of {container} run "
                     f"as one piecewise region {stack} (one graph a step, split at attention "
                     "and the cache); each block stands by for it and runs piecewise if it "
                     "runs eager")
    return notes


def counted_regions(manifest: Manifest) -> list[Region]:
    """The regions that count for coverage: blocks standing by for a stack count as the stack."""
    return [r for r in manifest.regions
            if not (r.piecewise and PIECEWISE_FALLBACK_FOR in r.piecewise)]


def drop_stacks(manifest: Manifest) -> Manifest:
    """The per-block layout of a plan (in place): no stack regions, no standby keys."""
    stacks = {r.piecewise[PIECEWISE_FALLBACK_FOR][0] for r in manifest.regions
              if r.piecewise and PIECEWISE_FALLBACK_FOR in r.piecewise}
    manifest.regions = [r for r in manifest.regions if not (r.kind == PIECEWISE_KIND and
                                                            r.paths == [s for s in r.paths
                                                                        if s in stacks])]
    for r in manifest.regions:
        if r.piecewise:
            r.piecewise.pop(PIECEWISE_FALLBACK_FOR, None)
    return manifest
