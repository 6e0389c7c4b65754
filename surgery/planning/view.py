"""The model view: what can be known of a model without running it. Pure: no I/O, no torch.

A checkpoint gives module paths (every key prefix) and the tensors each module owns; a live model
adds each module's class, the region-worthy methods its class defines, and the arguments its
``forward`` takes (surgery.planning.plan.view_from_module). Region finding
(surgery.planning.regions) asks a node for its children, subtree, sizes and these signs, so
everything here is answered from indexes built once: planning stays linear in the tensor count
(issue 10).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from surgery.formats.keys import module_paths
from surgery.formats.tensors import TensorInfo


@dataclass(frozen=True)
class ForwardArg:
    """One parameter of a module's ``forward`` (live models only), as inspect.signature shows it."""

    name: str
    required: bool  # no default: every caller passes it
    annotation: str = ""  # as written ("int", "Cache | None"), "" when absent


@dataclass
class ModuleNode:
    path: str
    cls: str | None = None  # class name, live models only
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # owned directly
    methods: frozenset[str] = frozenset()  # region-worthy methods the class defines
    forward_args: tuple[ForwardArg, ...] | None = None  # live models only; None: unknown
    library_layer: bool = False  # a torch.nn layer class (Linear, Conv2d, LayerNorm ...), live


@dataclass
class ModelView:
    """Module paths with their classes, owned tensors and methods; "" is the root.

    Region finding asks for a node's children and a subtree's tensors once per node, so both
    are answered from an index (parent -> children, built once) rather than a scan of every
    module: a scan per node made planning quadratic in the tensor count (issue 10: 8k tensors
    took 6.2 s, 100k did not finish in 600 s). The index is rebuilt when modules are added.
    """

    modules: dict[str, ModuleNode]
    live: bool = False
    # Whether a cache argument with a default (``cache=None``) marks a block as streaming. A
    # live model that says it cannot generate (transformers' ``can_generate()`` is False, as
    # for BertModel) never passes one, so its blocks keep their fixed shapes.
    optional_cache_streams: bool = True
    _kids: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)
    # (elements, tensors, owning modules) under each module: three dicts, filled together
    _numel: tuple[dict[str, int], ...] = field(default_factory=tuple, repr=False, compare=False)
    _indexed: int = field(default=-1, repr=False, compare=False)

    def _index(self) -> dict[str, list[str]]:
        if self._indexed != len(self.modules):
            kids: dict[str, list[str]] = {}
            for p in self.modules:
                if p:
                    kids.setdefault(p.rpartition(".")[0], []).append(p)
            self._kids, self._numel, self._indexed = kids, (), len(self.modules)
        return self._kids

    def child_index(self) -> dict[str, list[str]]:
        """Every module that has children -> its children (the index itself: do not modify)."""
        return self._index()

    def children(self, path: str) -> list[str]:
        """The direct children of `path` that are modules, in the view's order (a dict lookup)."""
        return list(self._index().get(path, ()))

    def subtree(self, path: str) -> Iterator[str]:
        """`path` and every module below it, parents before children (no scan of the view)."""
        kids = self._index()
        stack = [path]
        while stack:
            p = stack.pop()
            yield p
            stack.extend(reversed(kids.get(p, ())))

    def subtree_tensors(self, path: str) -> dict[str, TensorInfo]:
        """Tensors under `path`, keyed relative to it."""
        pre = len(path) + 1 if path else 0
        out: dict[str, TensorInfo] = {}
        for p in self.subtree(path):
            rel = p[pre:]
            for name, t in self.modules[p].tensors.items():
                out[f"{rel}.{name}" if rel else name] = t
        return out

    def numel(self, path: str) -> int:
        """Elements of the tensors under `path`: every subtree is summed once, then looked up."""
        return self._totals()[0][path] if path in self.modules else 0

    def has_tensors(self, path: str) -> bool:
        """Whether any tensor (even an empty one) lies under `path`."""
        return path in self.modules and self._totals()[1][path] > 0

    def owners(self, path: str) -> int:
        """How many modules at or under `path` own tensors (1: a single layer, or a leaf)."""
        return self._totals()[2][path] if path in self.modules else 0

    def _totals(self) -> tuple[dict[str, int], ...]:
        """(elements, tensors, owning modules) under each module, from one pass."""
        self._index()
        if not self._numel:
            numel: dict[str, int] = {}
            count: dict[str, int] = {}
            owners: dict[str, int] = {}
            for p, node in self.modules.items():
                numel[p] = sum([t.numel for t in node.tensors.values()])
                count[p] = len(node.tensors)
                owners[p] = 1 if node.tensors else 0
            # Deepest first, each module adds its sums to its parent's once: every parent
            # (one dot fewer) is still to come, so its sums are whole when it adds them on.
            by_depth: dict[int, list[str]] = {}
            for p in self.modules:
                if p:
                    by_depth.setdefault(p.count("."), []).append(p)
            for depth in sorted(by_depth, reverse=True):
                for p in by_depth[depth]:
                    up = p.rpartition(".")[0]
                    numel[up] += numel[p]
                    count[up] += count[p]
                    owners[up] += owners[p]
            self._numel = (numel, count, owners)
        return self._numel


def ancestors(path: str) -> Iterator[str]:
    """`path`, its parent, ... up to the root "" (a module's containers, innermost first)."""
    yield path
    while path:
        path = path.rpartition(".")[0]
        yield path


def view_from_tensors(tensors: Mapping[str, TensorInfo]) -> ModelView:
    """A view from a state dict's keys: every key prefix is a module.

    Every key prefix becomes a module path, so the keys are first held to the limits of
    `surgery.formats.keys.module_paths` (depth, length, and the total size of the distinct
    prefixes); a crafted header of distinct deep keys is refused, not stored 275 times over.
    """
    module_paths(tensors.keys())
    modules: dict[str, ModuleNode] = {"": ModuleNode("")}
    for key, info in tensors.items():
        mod, _, name = key.rpartition(".")
        if mod not in modules:
            prefix = ""
            for part in mod.split("."):
                prefix = f"{prefix}.{part}" if prefix else part
                modules.setdefault(prefix, ModuleNode(prefix))
        modules[mod].tensors[name] = info
    return ModelView(modules)


