"""keys.py: the segment catalogue, canonical keys, collisions and grouped findings (pure)."""

from __future__ import annotations

import pytest

from surgery.errors import KeyCollisionError
from surgery.formats.keys import (
    CODES,
    SEGMENTS,
    canonical_key,
    canonical_map,
    check_keys,
    common_attribute_prefix,
    export_command,
    find_collisions,
    is_bookkeeping,
    module_paths,
    segments_in,
    strip_prefix,
)


@pytest.mark.parametrize("key,canonical", [
    pytest.param("blocks.0.attn.proj.weight", "blocks.0.attn.proj.weight", id="clean"),
    pytest.param("_orig_mod.blocks.0.weight", "blocks.0.weight", id="compile-leading"),
    pytest.param("aggregator.frame_blocks.0._orig_mod.attn.proj.weight",
                 "aggregator.frame_blocks.0.attn.proj.weight", id="compile-middle"),
    pytest.param("module.head.bias", "head.bias", id="ddp"),
    pytest.param("module._orig_mod.head.bias", "head.bias", id="ddp-of-compile"),
    pytest.param("_orig_mod.module.head.bias", "head.bias", id="compile-of-ddp"),
    pytest.param("module.module.head.bias", "head.bias", id="ddp-of-averaged"),
    pytest.param("_orig_mod.module._orig_mod.x.y", "x.y", id="three-deep"),
    pytest.param("layers.3._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.w",
                 "layers.3.mlp.w", id="fsdp-and-ac"),
    pytest.param("_forward_module.model.w", "model.w", id="lightning-deepspeed"),
    pytest.param("encoder.module.weight", "encoder.module.weight", id="own-attribute-module"),
    pytest.param("module", "module", id="bare-module"),
    pytest.param("n_averaged", "n_averaged", id="bookkeeping-kept"),
])
def test_canonical_key(key: str, canonical: str) -> None:
    assert canonical_key(key) == canonical
    assert canonical_key(canonical) == canonical  # idempotent


def test_every_segment_names_its_wrapper_and_has_a_code() -> None:
    for seg in SEGMENTS:
        assert seg.wrapper and seg.where in {"anywhere", "leading", "leftover"}
        assert seg.name in CODES.values()
    assert len(set(CODES)) == len(CODES)
    assert CODES["SG001"] == "_orig_mod" and CODES["SG002"] == "module"


@pytest.mark.parametrize("key,names", [
    pytest.param("a._orig_mod.b", ["_orig_mod"], id="orig-mod"),
    pytest.param("_orig_mod.module.a", ["_orig_mod", "module"], id="module-after-strip"),
    pytest.param("encoder.module.w", [], id="deep-module-not-flagged"),
    pytest.param("fsdp._flat_param", ["_flat_param"], id="flat-param"),
    pytest.param("n_averaged", ["n_averaged"], id="n-averaged"),
])
def test_segments_in(key: str, names: list[str]) -> None:
    assert [s.name for s in segments_in(key)] == names


def test_collisions_list_both_originals() -> None:
    keys = ["x.weight", "module.x.weight", "y.bias"]
    assert find_collisions(keys) == {"x.weight": ["module.x.weight", "x.weight"]}
    with pytest.raises(KeyCollisionError) as e:
        canonical_map(keys)
    assert "'module.x.weight' + 'x.weight' -> 'x.weight'" in str(e.value)
    assert canonical_map(["_orig_mod.a", "b"]) == {"_orig_mod.a": "a", "b": "b"}


def test_816_findings_are_one_group() -> None:
    keys = [f"aggregator.frame_blocks.{i}._orig_mod.p{j}.weight"
            for i in range(24) for j in range(34)]
    assert len(keys) == 816
    findings = check_keys(keys, source="ckpt/model.pt")
    assert len(findings) == 1
    f = findings[0]
    assert (f.code, f.severity, f.count) == ("SG001", "error", 816)
    assert f.wrapper == "torch.compile (OptimizedModule)"
    assert f.examples[0] == ("aggregator.frame_blocks.0._orig_mod.p0.weight -> "
                             "aggregator.frame_blocks.0.p0.weight")
    assert len(f.examples) == 3
    assert f.fix == "surgery export ckpt/model.pt -o ckpt/model.clean.safetensors"
    assert "keys" not in f.to_dict() and len(f.to_dict(all_keys=True)["keys"]) == 816


@pytest.mark.parametrize("keys,codes", [
    pytest.param(["a.w", "b.w"], [], id="clean"),
    pytest.param(["module._orig_mod.a.w"], ["SG001", "SG002"], id="stacked"),
    pytest.param(["a._fsdp_wrapped_module.w"], ["SG003"], id="fsdp"),
    pytest.param(["a._checkpoint_wrapped_module.w"], ["SG004"], id="checkpoint-wrapper"),
    pytest.param(["_forward_module.a.w"], ["SG005"], id="forward-module"),
    pytest.param(["_fsdp_wrapped_module._flat_param"], ["SG003", "SG006"], id="flat-param"),
    pytest.param(["module.a.w", "n_averaged"], ["SG002", "SG007"], id="averaged"),
    pytest.param(["module.a.w", "a.w"], ["SG002", "SG008"], id="ema-beside-online"),
])
def test_check_keys_codes(keys: list[str], codes: list[str]) -> None:
    assert [f.code for f in check_keys(keys)] == codes


def test_collision_finding_names_both_keys_and_a_fix() -> None:
    (_, f) = check_keys(["module.a.w", "a.w"], source="m.pt")
    assert f.keys == ["a.w", "module.a.w"]
    assert f.examples == ["a.w + module.a.w -> a.w"]
    assert "--prefix module." in f.fix


@pytest.mark.parametrize("keys,prefix,kept,outside", [
    pytest.param(["model.a.w", "model.b.w", "loss.w"], "model.",
                 {"model.a.w": "a.w", "model.b.w": "b.w"}, ["loss.w"], id="lightning"),
    pytest.param(["_orig_mod.model.a.w"], "model", {"_orig_mod.model.a.w": "a.w"}, [],
                 id="compiled-lightning-no-dot"),
    pytest.param(["model._orig_mod.a.w"], "model.", {"model._orig_mod.a.w": "a.w"}, [],
                 id="compiled-inner"),
    pytest.param(["module.a.w", "a.w"], "module.", {"module.a.w": "a.w"}, ["a.w"],
                 id="pick-ema-copy"),
])
def test_strip_prefix(keys, prefix, kept, outside) -> None:
    assert strip_prefix(keys, prefix) == (kept, outside)


def test_helpers() -> None:
    assert common_attribute_prefix(["model.a", "model.b.c"]) == "model."
    assert common_attribute_prefix(["model.a", "head.b"]) is None
    assert module_paths(["a.b.w", "c"]) == {"", "a", "a.b"}
    assert is_bookkeeping("n_averaged") and is_bookkeeping("module.n_averaged")
    assert not is_bookkeeping("stats.n_averaged")
    assert export_command("x/m.safetensors", key="ema", prefix="model.") == (
        "surgery export x/m.safetensors --key ema --prefix model. -o x/m.clean.safetensors")
