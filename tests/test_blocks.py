"""surgery.planning.blocks through find_regions: blocks that cannot pay (one layer) or cannot hold
one shape (a cache, state or per-instance index in forward) are never whole regions (issue 11 E)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from surgery.formats.tensors import TensorInfo
from surgery.planning.plan import plan_checkpoint, view_from_module
from surgery.planning.regions import ATTN_PROJ, FIXED_PART, REPEATED_BLOCK, find_regions
from surgery.planning.view import view_from_tensors


def _kinds(found) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in found.regions:
        out.setdefault(c.kind, []).append(c.path)
    return out


def _left(found) -> dict[str, str]:
    return {p: r for p, _, r in found.left_out}


class Mlp(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CacheAttention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, kv_cache: list) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        kv_cache.append((k, v))
        ks = torch.cat([k for k, _ in kv_cache], 1)
        vs = torch.cat([v for _, v in kv_cache], 1)
        return self.proj(torch.softmax(q @ ks.transpose(1, 2), -1) @ vs)


class CameraBlock(nn.Module):
    """LingBot's camera trunk block: a growing KV cache and an integer block index."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = CacheAttention(d), Mlp(d)

    def forward(self, x: torch.Tensor, kv_cache: list, global_idx: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), kv_cache)
        return x + self.mlp(self.norm2(x))


class IndexedBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) * (layer_idx + 1)


class PlainBlock(IndexedBlock):
    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                index: torch.Tensor | None = None) -> torch.Tensor:
        return hidden_states + self.mlp(self.norm(hidden_states))


class OptionalCacheBlock(IndexedBlock):
    def forward(self, x: torch.Tensor,  # type: ignore[override]
                cache: object | None = None) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class OwnWeights(nn.Module):
    """A model's own leaf block that owns its weights directly: a whole block, not one op."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, d))
        self.w2 = nn.Parameter(torch.randn(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1) @ self.w2


def _model(**lists: nn.Module) -> nn.Module:
    m = nn.Module()
    for name, mod in lists.items():
        setattr(m, name, mod)
    return m


def _live(model: nn.Module):
    view, _ = view_from_module(model)
    return find_regions(view)


@pytest.mark.parametrize(
    ("layers", "cls"),
    [
        pytest.param([nn.Conv2d(4, 4, 3) for _ in range(3)], "Conv2d", id="conv2d"),
        pytest.param([nn.ConvTranspose2d(4, 4, 2) for _ in range(2)], "ConvTranspose2d",
                     id="conv-transpose"),
        pytest.param([nn.Linear(4, 4) for _ in range(3)], "Linear", id="linear"),
        pytest.param([nn.LayerNorm(4) for _ in range(3)], "LayerNorm", id="norm"),
        pytest.param([nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()) for _ in range(2)], "Conv2d",
                     id="conv-and-activation"),
    ],
)
def test_a_single_layer_is_never_a_repeated_block(layers, cls) -> None:
    # LingBot's depth head: its Conv2d / ConvTranspose2d lists were planned as regions.
    found = _live(_model(head=nn.Module(), convs=nn.ModuleList(layers)))
    assert REPEATED_BLOCK not in _kinds(found)
    left = _left(found)
    assert left["convs.0"] == (f"a single {cls}: one op gains nothing as a region and costs a "
                               "graph launch")


def test_single_layers_in_a_checkpoint_and_real_blocks_beside_them() -> None:
    keys = {f"head.convs.{i}.{n}": TensorInfo((4, 4, 3, 3) if n == "weight" else (4,), "F32")
            for i in range(3) for n in ("weight", "bias")}
    keys |= {f"blocks.{i}.{m}.weight": TensorInfo((4, 4), "F32")
             for i in range(2) for m in ("fc1", "fc2")}
    found = find_regions(view_from_tensors(keys))
    assert _kinds(found) == {REPEATED_BLOCK: ["blocks.0", "blocks.1"]}
    assert _left(found)["head.convs.2"].startswith("a single layer:")


class Conv1D(nn.Module):
    """transformers' GPT-2 layer: a Linear with its weight transposed, not a torch.nn class."""

    def __init__(self, nf: int = 8, nx: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)


def test_a_models_own_leaf_block_stays_a_block_and_its_own_layer_does_not() -> None:
    found = _live(_model(blocks=nn.ModuleList([OwnWeights(), OwnWeights()]),
                         projs=nn.ModuleList([Conv1D(), Conv1D()])))
    assert _kinds(found) == {REPEATED_BLOCK: ["blocks.0", "blocks.1"]}
    assert _left(found)["projs.0"].startswith("a single Conv1D:")


def test_streaming_blocks_are_left_out_and_planned_as_their_fixed_parts() -> None:
    # The camera trunk of LingBot-Map: each block attends over its own KV cache and takes its
    # index. Whole blocks recompiled every step; the MLP and the attention's projection hold.
    found = _live(_model(trunk=nn.ModuleList([CameraBlock() for _ in range(4)])))
    kinds = _kinds(found)
    assert REPEATED_BLOCK not in kinds
    assert kinds[FIXED_PART] == [f"trunk.{i}.mlp" for i in range(4)]
    assert kinds[ATTN_PROJ] == [f"trunk.{i}.attn.proj" for i in range(4)]
    assert "'kv_cache'" in _left(found)["trunk.0"]
    assert "streaming block" in _left(found)["trunk.0"]


class InnerCacheAttention(CacheAttention):
    """The SDPA build's attention: the KV cache lives inside the module, not in its arguments."""

    def __init__(self, d: int = 8) -> None:
        super().__init__(d)
        self.cache: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, self.cache)


class InnerCacheBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn, self.mlp = InnerCacheAttention(d), Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


def test_a_block_streaming_by_name_only_gets_no_parts() -> None:
    # A live `global_blocks.N` whose cache hides inside its attention: its forward arguments
    # show nothing, so no child can be called fixed-shape; only attn.proj is planned.
    found = _live(_model(global_blocks=nn.ModuleList([InnerCacheBlock(), InnerCacheBlock()])))
    assert _kinds(found) == {ATTN_PROJ: ["global_blocks.0.attn.proj", "global_blocks.1.attn.proj"]}
    assert "streaming" in _left(found)["global_blocks.0"]


def test_a_per_instance_index_makes_a_block_streaming() -> None:
    found = _live(_model(layers=nn.ModuleList([IndexedBlock() for _ in range(3)])))
    assert _kinds(found) == {FIXED_PART: ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]}
    reason = _left(found)["layers.1"]
    assert "per-instance index 'layer_idx'" in reason and "recompiles" in reason


def test_signatures_not_names_decide() -> None:
    # `hidden_states` is not state, and an `index` annotated as a tensor is data: whole blocks.
    found = _live(_model(layers=nn.ModuleList([PlainBlock() for _ in range(2)])))
    assert _kinds(found) == {REPEATED_BLOCK: ["layers.0", "layers.1"]}
    # The same layout in a checkpoint says nothing about signatures: whole blocks too.
    sd = _model(layers=nn.ModuleList([CameraBlock(), CameraBlock()])).state_dict()
    ckpt = view_from_tensors({k: TensorInfo(tuple(v.shape), "F32") for k, v in sd.items()})
    assert _kinds(find_regions(ckpt)) == {REPEATED_BLOCK: ["layers.0", "layers.1"]}


class _Generates(nn.Module):
    generates = True

    @classmethod
    def can_generate(cls) -> bool:
        return cls.generates


class _Encoder(_Generates):
    generates = False


@pytest.mark.parametrize(
    ("root", "streams"),
    [
        pytest.param(nn.Module, True, id="unknown-model"),
        pytest.param(_Generates, True, id="generates"),
        pytest.param(_Encoder, False, id="cannot-generate"),
    ],
)
def test_an_optional_cache_streams_unless_the_model_never_generates(root, streams) -> None:
    # BertLayer.forward takes `cache=None` in transformers 5; BertModel never passes one.
    model = root()
    model.layers = nn.ModuleList([OptionalCacheBlock() for _ in range(2)])
    kinds = _kinds(_live(model))
    if streams:
        assert kinds == {FIXED_PART: ["layers.0.mlp", "layers.1.mlp"]}
    else:
        assert kinds == {REPEATED_BLOCK: ["layers.0", "layers.1"]}


def _save_keys(path, keys: list[str]) -> None:
    from safetensors.torch import save_file

    save_file({k: torch.zeros(2, 2) for k in keys}, str(path))


def test_the_example_models_vocabulary_stays_out_of_other_plans(tmp_path) -> None:
    # Issue 12 friction 2: every checkpoint plan ended with "a checkpoint cannot show methods
    # (attn_pre, ffn_residual)", and timm plans listed attn_proj left-outs.
    timm_like = [f"blocks.{i}.{n}.weight" for i in range(3)
                 for n in ("norm1", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    _save_keys(tmp_path / "vit.safetensors", timm_like)
    vit = plan_checkpoint(str(tmp_path / "vit.safetensors"))
    assert not [n for n in vit.notes if "attn_pre" in n or "methods" in n]
    assert not [lo for lo in vit.manifest.left_out if lo.kind == ATTN_PROJ]
    assert {r.kind for r in vit.manifest.regions} == {REPEATED_BLOCK}

    lingbot_like = [k.replace("blocks.", "aggregator.global_blocks.") for k in timm_like]
    _save_keys(tmp_path / "lingbot.safetensors", lingbot_like)
    stream = plan_checkpoint(str(tmp_path / "lingbot.safetensors"))
    assert [n for n in stream.notes if "cannot show their fixed-shape methods" in n]
    assert {r.kind for r in stream.manifest.regions} == {ATTN_PROJ}
