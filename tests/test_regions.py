"""regions.find_regions on model views: named kinds, generic repeated blocks, nesting, globs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from surgery.errors import RegionError
from surgery.formats.tensors import TensorInfo
from surgery.planning.plan import view_from_module
from surgery.planning.regions import (
    ATTN_PRE,
    ATTN_PROJ,
    FFN_RESIDUAL,
    FRAME_BLOCK,
    PATCH_EMBED_BLOCK,
    REPEATED_BLOCK,
    find_regions,
    natural_key,
)
from surgery.planning.view import view_from_tensors


def _view(keys: dict[str, tuple[int, ...]]):
    return view_from_tensors({k: TensorInfo(s, "F32") for k, s in keys.items()})


def _block_keys(prefix: str, dim: int = 4, *, extra: tuple[str, ...] = ()) -> dict:
    names = ["norm1.weight", "attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight",
             "mlp.fc2.weight", *extra]
    return {f"{prefix}.{n}": (dim, dim) if "weight" in n and "norm" not in n else (dim,)
            for n in names}


def _kinds(found) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in found.regions:
        out.setdefault(c.kind, []).append(c.path)
    return out


def _assert_no_nesting(found) -> None:
    mods = [c.module_path for c in found.regions if c.callable == "forward"]
    for a in mods:
        for b in mods:
            assert a == b or not b.startswith(f"{a}."), f"{b} is nested in {a}"


def test_lingbot_layout_from_checkpoint_keys() -> None:
    keys: dict = {}
    for i in range(3):
        keys |= _block_keys(f"aggregator.frame_blocks.{i}")
        keys |= _block_keys(f"aggregator.patch_embed.blocks.{i}")
        keys |= _block_keys(f"aggregator.global_blocks.{i}")
    found = find_regions(_view(keys))
    kinds = _kinds(found)
    assert kinds[FRAME_BLOCK] == [f"aggregator.frame_blocks.{i}" for i in range(3)]
    assert kinds[PATCH_EMBED_BLOCK] == [f"aggregator.patch_embed.blocks.{i}" for i in range(3)]
    assert kinds[ATTN_PROJ] == [f"aggregator.global_blocks.{i}.attn.proj" for i in range(3)]
    assert REPEATED_BLOCK not in kinds  # streaming global blocks are never whole regions
    _assert_no_nesting(found)
    left = {(p, k): r for p, k, r in found.left_out}
    # attn.proj is proposed inside streaming blocks only (issue 12: no attn_proj noise elsewhere).
    assert not [p for p, k in left if k == ATTN_PROJ]
    assert "streaming" in left[("aggregator.global_blocks.0", REPEATED_BLOCK)]


@pytest.mark.parametrize(
    ("container", "n"),
    [
        pytest.param("transformer_blocks", 3, id="diffusers"),
        pytest.param("encoder.layer", 4, id="hf-bert"),
        pytest.param("model.layers", 2, id="hf-llama"),
        pytest.param("blocks", 3, id="timm"),
    ],
)
def test_generic_repeated_blocks_in_the_wild(container: str, n: int) -> None:
    keys = {"embed.weight": (10, 4)}
    for i in range(n):
        keys |= _block_keys(f"{container}.{i}")
    found = find_regions(_view(keys))
    kinds = _kinds(found)
    assert kinds == {REPEATED_BLOCK: [f"{container}.{i}" for i in range(n)]}
    # No streaming block here, so attn.proj is not even a candidate: nothing is left out, and
    # the example model's vocabulary (attn_proj) stays out of this plan (issue 12).
    assert found.left_out == []


def test_blocks_whose_structure_differs_slightly_are_one_repeated_block() -> None:
    # SD3: the last joint block has no context MLP.
    keys: dict = {}
    for i in range(4):
        extra = () if i == 3 else ("ff_context.net.0.weight", "ff_context.net.2.weight")
        keys |= _block_keys(f"transformer_blocks.{i}", extra=extra)
    kinds = _kinds(find_regions(_view(keys)))
    assert kinds[REPEATED_BLOCK] == [f"transformer_blocks.{i}" for i in range(4)]


def test_diffusers_two_containers_and_to_out() -> None:
    keys: dict = {}
    for i in range(2):
        keys |= {f"transformer_blocks.{i}.attn.to_out.0.weight": (4, 4),
                 f"transformer_blocks.{i}.attn.to_q.weight": (4, 4)}
        keys |= {f"single_transformer_blocks.{i}.attn.to_q.weight": (4, 4),
                 f"single_transformer_blocks.{i}.proj_mlp.weight": (8, 4)}
    kinds = _kinds(find_regions(_view(keys)))
    assert sorted(kinds[REPEATED_BLOCK]) == sorted(
        [f"transformer_blocks.{i}" for i in range(2)]
        + [f"single_transformer_blocks.{i}" for i in range(2)])


def test_a_single_numbered_child_is_not_repeated() -> None:
    kinds = _kinds(find_regions(_view(_block_keys("blocks.0"))))
    assert REPEATED_BLOCK not in kinds


def test_live_model_shows_method_regions_and_classes() -> None:
    from surgery.examples import tiny

    with torch.device("meta"):
        model = tiny()
    view, _ = view_from_module(model)
    found = find_regions(view)
    kinds = _kinds(found)
    assert kinds[ATTN_PRE] == [f"aggregator.global_blocks.{i}.attn_pre" for i in range(2)]
    assert kinds[FFN_RESIDUAL] == [f"aggregator.global_blocks.{i}.ffn_residual" for i in range(2)]
    # A method owns no submodule forward: attn.proj of the same block is still a region.
    assert kinds[ATTN_PROJ] == [f"aggregator.global_blocks.{i}.attn.proj" for i in range(2)]
    assert {c.cls for c in found.regions if c.kind == FRAME_BLOCK} == {"Block"}
    _assert_no_nesting(found)


def test_live_classes_split_repeated_blocks() -> None:
    class A(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)  # two layers: a block

    class B(A):
        pass

    model = nn.Module()
    model.layers = nn.ModuleList([A(), A(), B()])
    view, _ = view_from_module(model)
    found = find_regions(view)
    assert _kinds(found) == {REPEATED_BLOCK: ["layers.0", "layers.1"]}


def test_include_wins_and_exclude_drops() -> None:
    keys: dict = {}
    for i in range(2):
        keys |= _block_keys(f"aggregator.frame_blocks.{i}")
        keys |= _block_keys(f"aggregator.global_blocks.{i}")
    found = find_regions(_view(keys), include=["aggregator.global_blocks.*"],
                         exclude=["aggregator.frame_blocks.1"])
    kinds = _kinds(found)
    assert kinds["custom"] == ["aggregator.global_blocks.0", "aggregator.global_blocks.1"]
    assert kinds[FRAME_BLOCK] == ["aggregator.frame_blocks.0"]
    reasons = {p: r for p, _, r in found.left_out}
    assert reasons["aggregator.frame_blocks.1"] == \
        "excluded by --exclude 'aggregator.frame_blocks.1'"
    assert reasons["aggregator.global_blocks.0.attn.proj"].startswith("inside custom region")
    _assert_no_nesting(found)


@pytest.mark.parametrize(
    ("include", "exclude", "match"),
    [
        pytest.param(["aggregator.fram_blocks.*"], [], "--include", id="include-typo"),
        pytest.param([], ["nothing.*"], "--exclude", id="exclude-matches-nothing"),
    ],
)
def test_globs_that_match_nothing_fail_loudly(include, exclude, match) -> None:
    keys = _block_keys("aggregator.frame_blocks.0") | _block_keys("aggregator.frame_blocks.1")
    with pytest.raises(RegionError, match=match):
        find_regions(_view(keys), include=include, exclude=exclude)


def test_natural_order() -> None:
    paths = ["b.10", "b.2", "b.1"]
    assert sorted(paths, key=natural_key) == ["b.1", "b.2", "b.10"]


def test_fold_compiles_a_fixed_shape_container_as_one_region() -> None:
    from surgery.examples import tiny

    with torch.device("meta"):
        model = tiny()
    view, _ = view_from_module(model)
    found = find_regions(view, fold=True)
    kinds = _kinds(found)
    assert kinds["patch_embed"] == ["aggregator.patch_embed"]
    assert PATCH_EMBED_BLOCK not in kinds
    # Frame blocks live beside streaming global blocks under `aggregator`: not folded.
    assert kinds[FRAME_BLOCK] == ["aggregator.frame_blocks.0", "aggregator.frame_blocks.1"]
    reasons = {p: r for p, _, r in found.left_out}
    assert reasons["aggregator.patch_embed.blocks.1"] == \
        "folded into patch_embed region aggregator.patch_embed"
    _assert_no_nesting(found)


def test_fold_leaves_partial_or_root_block_lists_alone() -> None:
    keys: dict = {}
    for i in range(3):
        keys |= _block_keys(f"blocks.{i}")  # the container is the whole model: not folded
        keys |= _block_keys(f"encoder.layer.{i}")
    found = find_regions(_view(keys), fold=True, exclude=["encoder.layer.2"])
    kinds = _kinds(found)
    assert kinds[REPEATED_BLOCK] == ["blocks.0", "blocks.1", "blocks.2",
                                     "encoder.layer.0", "encoder.layer.1"]
    folded = find_regions(_view(keys), fold=True)
    assert _kinds(folded)["block_stack"] == ["encoder"]


# --- linear time (issue 10): counted operations, not timings ----------------------------------

class _CountingModules(dict):
    """A view's module table that counts the entries every full scan of it visits."""

    visited = 0

    def __iter__(self):
        for k in super().__iter__():
            type(self).visited += 1
            yield k

    def items(self):
        return [(k, self[k]) for k in self]

    def values(self):
        return [self[k] for k in self]

    def keys(self):
        return list(self)


def _work(n_blocks: int, monkeypatch, *, fold: bool = False) -> tuple[int, int]:
    """Module entries scanned and overlap checks made while finding regions of n blocks."""
    import surgery.planning.regions as regions

    keys: dict = {}
    for i in range(n_blocks):
        keys |= _block_keys(f"encoder.layer.{i}")
        keys |= _block_keys(f"decoder.blocks.{i}.inner.{i % 3}")
    view = _view(keys)
    view.modules = _CountingModules(view.modules)
    _CountingModules.visited = 0
    checks = 0
    real = regions._is_within

    def counting(inner: str, outer: str) -> bool:
        nonlocal checks
        checks += 1
        return real(inner, outer)

    monkeypatch.setattr(regions, "_is_within", counting)
    found = find_regions(view, fold=fold)
    assert len(found.regions) + len(found.left_out) >= n_blocks
    return _CountingModules.visited, checks


@pytest.mark.parametrize("fold", [pytest.param(False, id="plain"), pytest.param(True, id="fold")])
def test_region_finding_work_grows_linearly(monkeypatch, fold: bool) -> None:
    # Issue 10: ModelView.children scanned every module for every node, and each candidate was
    # compared with every accepted region, so 10x the blocks cost 100x the work. Counted here,
    # not timed: 10x the blocks may cost at most 15x the scanned entries and overlap checks.
    small_scan, small_checks = _work(40, monkeypatch, fold=fold)
    big_scan, big_checks = _work(400, monkeypatch, fold=fold)
    assert big_scan <= 15 * small_scan, (small_scan, big_scan)
    assert big_checks <= 15 * max(small_checks, 1), (small_checks, big_checks)


def test_children_and_subtrees_come_from_an_index_kept_current() -> None:
    from surgery.planning.view import ModuleNode

    view = _view(_block_keys("blocks.0") | _block_keys("blocks.1") | {"head.weight": (2, 2)})
    assert view.children("") == ["blocks", "head"]
    assert view.children("blocks") == ["blocks.0", "blocks.1"]
    assert view.children("blocks.0.attn") == ["blocks.0.attn.qkv", "blocks.0.attn.proj"]
    assert view.numel("blocks.0") == 4 * 16 + 4 and view.numel("head") == 4
    assert view.numel("") == 2 * (4 * 16 + 4) + 4
    assert set(view.subtree_tensors("blocks.1.mlp")) == {"fc1.weight", "fc2.weight"}
    # A live model adds parameter-free modules after the view is built: the index follows.
    view.modules["blocks.0.drop"] = ModuleNode("blocks.0.drop")
    assert "blocks.0.drop" in view.children("blocks.0")
    assert not view.has_tensors("blocks.0.drop") and view.has_tensors("blocks.0")


@pytest.mark.parametrize(
    ("key", "limit"),
    [
        pytest.param(".".join(["a"] * 300) + ".weight", "SURGERY_MAX_KEY_PARTS", id="too-deep"),
        pytest.param("a." + "x" * 5000, "SURGERY_MAX_KEY_CHARS", id="too-long"),
    ],
)
def test_absurd_keys_are_refused_in_one_line(key: str, limit: str) -> None:
    # Every key prefix becomes a module path: one key of depth d and length L costs d*L. The
    # view holds keys to the resource contract of surgery.formats.keys.module_paths (issue 22).
    from surgery.errors import EXIT_CANNOT_RUN
    from surgery.formats.keys import KeyLimitError

    with pytest.raises(KeyLimitError, match=limit) as e:
        _view({key: (1,)})
    assert "\n" not in e.value.message and len(e.value.message) < 200
    assert limit in (e.value.hint or "") and e.value.exit_code == EXIT_CANNOT_RUN
