"""surgery.runtime.tree_guards: a one-path piecewise stack drops dynamo's guards on its module
tree and watches the dicts they read; any change to what they read goes back to full guards."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import surgery.runtime.tree_guards as tree_guards
from surgery.runtime.apply import apply_manifest
from tests.test_piecewise_stack import ON_CPU, generate, stack_plan, tiny_gpt2

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(tree_guards.DICT_VERSION is None,
                                 reason="this Python's dicts do not move their version tag")]

NEW = 8


def applied(watch: bool = True, dict_tags: bool = False) -> tuple[nn.Module, nn.Module, Any]:
    """(tiny GPT-2 with its stack region applied on the CPU, an eager copy, the handle).
    ``dict_tags``: dynamo's recursive dict tags on while it applies (torch 2.10/2.11's default,
    off in 2.14's), which leaves no watch; off here by default so that the watch is tested on
    every torch."""
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    ids = ids_of(1)
    old, tree_guards.WATCH_TREES = tree_guards.WATCH_TREES, watch
    try:
        with warnings.catch_warnings(), \
                torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=dict_tags):
            warnings.simplefilter("ignore")
            handle = apply_manifest(model, stack_plan(), overrides=ON_CPU, passes=1,
                                    warmup=lambda m: generate(m, ids, 2))
    finally:
        tree_guards.WATCH_TREES = old
    return model, ref, handle


def ids_of(batch: int) -> torch.Tensor:
    return torch.randint(0, 100, (batch, 8), generator=torch.Generator().manual_seed(batch))


def group_of(model: nn.Module) -> Any:
    slot = model.transformer.__dict__["forward"].__closure__[1].cell_contents
    return slot.group


def guard_lines(group: Any) -> int:
    code = group.compiled._torchdynamo_orig_callable.__code__
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    return sum(len(str(e.guard_manager).splitlines()) for e in entries)


def same_tokens(model: nn.Module, ref: nn.Module, batch: int = 1) -> None:
    """Tokens and every step's logits equal to eager's (bit for bit with aot_eager): a graph
    that baked a stale attribute (an ``eps``, a swapped activation) shows in the logits even
    where the argmax token does not move."""
    with torch.no_grad():
        got, want = (generate(m, ids_of(batch), NEW, output_logits=True) for m in (model, ref))
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))


def test_the_stack_drops_its_module_tree_guards_and_keeps_eagers_tokens() -> None:
    model, ref, handle = applied()
    full, fref, _ = applied(watch=False)
    same_tokens(model, ref)
    same_tokens(full, fref)
    watch = group_of(model).watch
    assert watch is not None and group_of(full).watch is None
    assert watch.dropped > 100 and watch.tensors and watch.dicts  # 2 layers: ~220 dropped
    # every parameter of the stack is in the one tensor check, none of the cache's tensors
    assert {id(p) for p in model.transformer.parameters()} == {id(t) for t in watch.tensors}
    assert guard_lines(group_of(model)) < 0.6 * guard_lines(group_of(full))
    rec = handle.report.by_path("transformer")
    assert rec.status == "compiled" and rec.compiles == 1, rec.reason


def test_with_dynamos_recursive_dict_tags_on_the_stack_keeps_full_guards_and_says_so() -> None:
    """torch 2.10/2.11 skip an unchanged module subtree by its dict tags, so a watch would only
    add its own check (benchmarks/RESULTS.md, x19g): no watch, full guards, a note; tokens and
    the recompile on a change are dynamo's own."""
    model, ref, handle = applied(dict_tags=True)
    rec = handle.report.by_path("transformer")
    assert group_of(model).watch is None
    assert tree_guards.DICT_TAGS_NOTE in rec.notes
    assert rec.status == "compiled" and rec.compiles == 1, rec.reason
    same_tokens(model, ref)
    watched, _, whandle = applied()  # the same apply with the flag off: watched, no note
    assert group_of(watched).watch is not None
    assert tree_guards.DICT_TAGS_NOTE not in whandle.report.by_path("transformer").notes
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        _set_eps(model)
        _set_eps(ref)
        same_tokens(model, ref)  # dynamo's own guard on eps recompiles
    assert rec.compiles == 2


def test_a_round_trip_through_train_keeps_the_watch_without_a_compile() -> None:
    model, ref, handle = applied()
    rec = handle.report.by_path("transformer")
    compiles = rec.compiles
    model.train()
    model.eval()  # the flags stored again: the dicts' tags moved, their items did not
    same_tokens(model, ref)
    assert group_of(model).watch is not None and rec.compiles == compiles


def test_inference_mode_after_no_grad_adds_a_tensor_check_not_a_full_guard() -> None:
    model, ref, _ = applied()
    with torch.inference_mode():
        got, want = generate(model, ids_of(1), NEW), generate(ref, ids_of(1), NEW)
    assert torch.equal(got.sequences, want.sequences)
    watch = group_of(model).watch
    assert watch is not None and len(watch.checks) == 2


def _set_eps(model: nn.Module) -> None:
    model.transformer.ln_f.eps = 0.5  # read by the graph as a constant (EQUALS_MATCH dropped)


def _swap_act(model: nn.Module) -> None:
    model.transformer.h[1].mlp.act = nn.ReLU()  # a submodule replaced (TYPE_MATCH dropped)


@pytest.mark.parametrize("change", [
    pytest.param(_set_eps, id="attribute"),
    pytest.param(_swap_act, id="submodule"),
    pytest.param(lambda m: m.transformer.ln_f.weight.requires_grad_(False),
                 id="parameter-metadata"),
])
def test_a_change_to_what_a_dropped_guard_read_compiles_again_with_full_guards(
        change: Any) -> None:
    """Each change here would make dynamo's dropped guard fail (a recompile): the watch sees
    it before the call, and the stack compiles again with full guards; tokens stay eager's
    with the same change."""
    model, ref, handle = applied()
    same_tokens(model, ref)
    change(model)
    change(ref)
    rec = handle.report.by_path("transformer")
    compiles = rec.compiles
    same_tokens(model, ref)
    assert group_of(model).watch is None
    assert rec.compiles == compiles + 1
    assert any("compiled again with dynamo's full guards" in n for n in rec.notes)
    same_tokens(model, ref, batch=2)  # from then on dynamo's own guards recompile as needed


def test_a_weight_moved_in_place_with_the_same_metadata_keeps_the_watch() -> None:
    model, ref, handle = applied()
    for m in (model, ref):
        with torch.no_grad():
            m.transformer.ln_f.weight.data = m.transformer.ln_f.weight.data * 2
    rec = handle.report.by_path("transformer")
    compiles = rec.compiles
    same_tokens(model, ref)
    assert group_of(model).watch is not None and rec.compiles == compiles


def test_a_group_of_several_paths_keeps_every_guard() -> None:
    """Blocks of one class share one compiled copy: a guard on one block's tree would not
    hold for another, so nothing is dropped there."""
    watch = tree_guards.TreeWatch(lambda: None, "self")
    entries = [type("E", (), {"guard_type": "TYPE_MATCH", "name": "self._modules['a']"})()]
    assert watch.filter(entries) == [True] and watch.dropped == 0


def _linear_wider(root: nn.Module) -> None:
    root.lin.in_features = 3


def _linear_swapped(root: nn.Module) -> None:
    root.lin = nn.Linear(2, 2)


def _flag_flipped(root: nn.Module) -> None:
    root.training = False


def _attribute_added(root: nn.Module) -> None:
    root.extra = 1


def _global_rebound(root: nn.Module) -> None:
    SCOPE["helper"] = nn.Linear(1, 1)


SCOPE: dict[str, Any] = {}


@pytest.mark.parametrize("guard, name, change", [
    pytest.param("EQUALS_MATCH", "self._modules['lin'].in_features", _linear_wider,
                 id="int-attribute"),
    pytest.param("TYPE_MATCH", "self._modules['lin']", _linear_swapped, id="submodule"),
    pytest.param("EQUALS_MATCH", "self.training", _flag_flipped, id="flag"),
    pytest.param("NOT_PRESENT_IN_GENERIC_DICT", "self", _attribute_added,
                 id="a-key-not-present"),
    pytest.param("TYPE_MATCH", "G['helper']._modules['inner']", _global_rebound,
                 id="global-chain"),
    pytest.param("TENSOR_MATCH", "self._modules['lin']._parameters['weight']",
                 lambda r: r.lin.weight.requires_grad_(False), id="parameter"),
    pytest.param("EQUALS_MATCH", "self._modules['lin'].forward", None, id="class-method"),
    pytest.param("EQUALS_MATCH", "self.items", None, id="list"),
    pytest.param("TYPE_MATCH", "type(self._modules['lin'])", None, id="not-a-chain"),
    pytest.param("EQUALS_MATCH", "self._modules['lin'].__dict__", None, id="dunder"),
    pytest.param("EQUALS_MATCH", "kwargs['x']", None, id="an-argument"),
    pytest.param("HASATTR", "self._modules['lin']", None, id="a-kind-not-covered"),
    pytest.param("NOT_PRESENT_IN_GENERIC_DICT", "G['torch']", None, id="a-python-module"),
    pytest.param("EQUALS_MATCH", "self.table", None, id="a-value-match-on-a-dict"),
])
def test_only_plain_chains_through_instance_dicts_to_covered_values_are_dropped(
        guard: str, name: str, change: Any) -> None:
    """A covered guard's watch holds while what it read is stored again unchanged, and fails
    once its chain or value changes; an uncovered one is kept (the filter says True)."""
    root = nn.Module()
    root.lin = nn.Linear(2, 2)
    root.items = [1, 2]
    root.table = {"a": 1}
    root.cache = torch.zeros(1)
    SCOPE.clear()
    SCOPE.update(helper=nn.Sequential(), torch=torch)
    SCOPE["helper"].inner = nn.ReLU()
    watch = tree_guards.TreeWatch(lambda: root, "self", scope=lambda: SCOPE)
    entry = type("E", (), {"guard_type": guard, "name": name})()
    assert watch.filter([entry]) == [change is None]
    if change is not None:
        assert watch.unchanged()
        root.lin.in_features = 2  # stored again, the same values: not a change
        root.training = True
        SCOPE["other"] = 1  # elsewhere in a read dict: not what the chain read
        root.cache = torch.ones(1)  # a new value at a key no chain steps through (a cache)
        assert watch.unchanged()
        change(root)
        assert not watch.unchanged()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU "
                    "machine (benchmarks/RESULTS.md has the last run)")
def test_on_cuda_the_watched_stack_replays_and_a_change_compiles_again() -> None:
    """On CUDA with the default backend and region capture: the stack's watch is on (its tree
    guards dropped), its pieces replay, tokens are eager's; a changed attribute the graph baked
    (ln_f.eps) ends the watch, and the tokens follow eager's with the same change."""
    model = tiny_gpt2().cuda()
    ref = copy.deepcopy(model)
    # the watch is off where dynamo's recursive dict tags are on (torch 2.11's default)
    with warnings.catch_warnings(), \
            torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=False):
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, stack_plan())
    ids = ids_of(1).cuda()
    stack = handle.report.by_path("transformer")
    with torch.no_grad():
        want = generate(ref, ids, NEW)
        assert torch.equal(generate(model, ids, NEW).sequences, want.sequences)
        replays = stack.cuda_graph_replays
        assert torch.equal(generate(model, ids, NEW).sequences, want.sequences)
        watch = group_of(model).watch
        assert watch is not None and watch.dropped > 100 and watch.tensors
        assert stack.cuda_graph_replays - replays >= 3 * (NEW - 1)
        _set_eps(model)
        _set_eps(ref)
        assert torch.equal(generate(model, ids, NEW).sequences,
                           generate(ref, ids, NEW).sequences)
    assert group_of(model).watch is None and stack.status == "compiled", stack.reason
