"""How a manifest binds to a model (surgery.formats.binding, compute_fingerprint): issue 10's
encoding and canonical keys, issue 11 D's casts, issue 12's "what differs" on a mismatch."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from surgery import examples
from surgery.errors import FingerprintMismatchError
from surgery.examples import demo
from surgery.formats.binding import binding_fields, explain, key_summary, legacy_fingerprint
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import Manifest, Region, dumps_manifest, parse_manifest
from surgery.formats.tensors import TensorInfo
from surgery.runtime.apply import apply_manifest
from surgery.runtime.resolve import bind_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _manifest_for(model: nn.Module, paths: list[str], **model_table: object) -> Manifest:
    sd = model.state_dict()
    m = Manifest(compute_fingerprint(sd), [Region("block", paths)],
                 model={**binding_fields(sd), **model_table})
    m.compile["backend"] = "aot_eager"
    return m


# --- the encoding (issue 10) -------------------------------------------------------------------

def test_a_key_holding_a_tab_and_a_newline_does_not_collide_with_two_keys() -> None:
    one = {"a\t1\tF32\nb": TensorInfo((2,), "F32")}
    two = {"a": TensorInfo((1,), "F32"), "b": TensorInfo((2,), "F32")}
    assert legacy_fingerprint(one) == legacy_fingerprint(two)  # the first format's flaw
    assert compute_fingerprint(one) != compute_fingerprint(two)


@pytest.mark.parametrize("one,two", [
    pytest.param({'a",[1]],["b': (3,)}, {"a": (1,), "b": (3,)}, id="json-quote"),
    pytest.param({"a\t1\nb": (2,)}, {"a": (1,), "b": (2,)}, id="tab-newline"),
    pytest.param({"a": (12,)}, {"a": (1, 2)}, id="shape-digits"),
    pytest.param({"a.1": (1,)}, {"a": (1,), "1": (1,)}, id="dotted"),
])
def test_records_cannot_run_together(one: dict[str, tuple[int, ...]],
                                     two: dict[str, tuple[int, ...]]) -> None:
    def infos(d: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
        return {k: TensorInfo(v, "F32") for k, v in d.items()}

    assert compute_fingerprint(infos(one)) != compute_fingerprint(infos(two))


def test_fingerprint_is_over_canonical_keys_and_stays_torch_free() -> None:
    sd = examples.tiny().state_dict()
    swapped = demo.swap_in_compiled_blocks(examples.tiny()).state_dict()
    assert any("_orig_mod." in k for k in swapped)
    assert compute_fingerprint(swapped) == compute_fingerprint(sd)
    code = ("import sys\n"
            "from surgery.formats.checkpoint import TensorInfo\n"
            "from surgery.formats.binding import bind, binding_fields\n"
            "from surgery.formats.fingerprint import compute_fingerprint\n"
            "t = {'a._orig_mod.w': TensorInfo((2, 3), 'BF16')}\n"
            "fp = compute_fingerprint(t)\n"
            "assert bind(fp, binding_fields(t), {'a.w': TensorInfo((2, 3), 'F32')}).matches\n"
            "assert 'torch' not in sys.modules, 'imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_live_model_with_hand_swapped_compiled_blocks_matches_its_manifest() -> None:
    """The recipe that swaps torch.compile-d blocks into their parents leaves `_orig_mod.` in
    the live keys; the manifest planned from the clean model still binds."""
    from surgery.planning.plan import plan_model

    manifest = plan_model("surgery.examples:tiny").manifest
    live = demo.swap_in_compiled_blocks(examples.tiny())
    assert any("_orig_mod." in k for k in live.state_dict())
    binding = bind_model(live, manifest)
    assert binding.matches and binding.actual == manifest.fingerprint


# --- casts bind (issue 11 D) -------------------------------------------------------------------

@pytest.mark.parametrize("cast", [
    pytest.param(lambda m: m.to(torch.bfloat16), id="bf16"),
    pytest.param(lambda m: m.half(), id="fp16"),
    pytest.param(lambda m: m.to("meta"), id="to-device"),
])
def test_a_manifest_planned_in_float32_binds_the_cast_model_with_a_note(cast) -> None:
    from surgery.planning.plan import plan_model

    manifest = parse_manifest(dumps_manifest(plan_model("surgery.examples:tiny").manifest))
    model = cast(examples.tiny())
    binding = bind_model(model, manifest)
    assert binding.matches
    if next(model.parameters()).dtype != torch.float32:
        assert any("dtypes differ from the plan (F32 x79" in n for n in binding.notes), \
            binding.notes
    else:
        assert binding.notes == []


def test_apply_manifest_on_a_bf16_model_planned_in_fp32() -> None:
    torch.manual_seed(0)
    fp32 = examples.tiny().eval()
    m = _manifest_for(fp32, ["aggregator.frame_blocks.0"])
    model = examples.tiny().to(torch.bfloat16).eval()
    x = model.example_input().to(torch.bfloat16)
    with torch.no_grad():
        handle = apply_manifest(model, m, overrides={"on_cpu": "compile"},
                                warmup=lambda mdl: mdl(x), passes=1)
    with handle:
        assert handle.report.by_path("aggregator.frame_blocks.0").status == "compiled"
        assert any("dtypes differ from the plan" in n for n in handle.report.notes)
        assert "dtypes differ" in handle.report.summary()


# --- a mismatch says what differs (issue 12, defect 12) ----------------------------------------

class _Attn(nn.Module):
    def __init__(self, names: tuple[str, str]) -> None:
        super().__init__()
        for n in names:
            setattr(self, n, nn.Linear(8, 8))


class _Saved(nn.Module):
    """Keys as saved: encoder.layer.N.attention.attention.query.*"""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(nn.Module() for _ in range(3))
        for blk in self.encoder.layer:
            blk.attention = nn.Module()
            blk.attention.attention = _Attn(("query", "key"))
        self.head = nn.Linear(8, 2)


class _Renamed(nn.Module):
    """The same weights renamed on load: layers.N.attention.q_proj.*"""

    def __init__(self, head: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(3))
        for blk in self.layers:
            blk.attention = _Attn(("q_proj", "k_proj"))
        self.head = nn.Linear(8, head)


def test_renamed_live_keys_are_named_with_the_fix() -> None:
    m = _manifest_for(_Saved(), ["head"])
    with pytest.raises(FingerprintMismatchError) as e:
        apply_manifest(_Renamed(), m)
    msg, hint = e.value.message, e.value.hint or ""
    assert "keys look renamed: 'encoder.layer.N' -> 'layers.N'" in msg, msg
    assert "--model" in hint and "plan the manifest again" not in hint
    assert "\n" not in msg


def test_missing_unexpected_and_reshaped_keys_are_listed_sorted_with_counts() -> None:
    saved = _Saved()
    m = _manifest_for(saved, ["head"])
    live = _Saved()
    live.head = nn.Linear(8, 5)  # shape differs
    live.extra = nn.Linear(8, 8)  # unexpected
    del live.encoder.layer[2].attention.attention.key  # missing (one of three)
    with pytest.raises(FingerprintMismatchError) as e:
        bind_model(live, m)
    msg = e.value.message
    assert "look renamed" not in msg
    assert "2 key(s) of the live model are not in the plan: 'extra.bias' (x1), 'extra.weight'" \
        in msg, msg
    # One layer of three lost its key: the pattern's shapes stay, its count drops.
    assert ("shapes or counts differ in 4 key pattern(s): "
            "'encoder.layer.N.attention.attention.key.bias' [8] x3 planned, [8] x2 now") in msg
    lines, renamed = explain(key_summary(saved.state_dict()), key_summary(live.state_dict()))
    assert not renamed
    assert lines[-1].endswith("'head.bias' [2] x1 planned, [5] x1 now ..."), lines


def test_strict_false_warns_with_the_difference_and_notes_it() -> None:
    m = _manifest_for(_Saved(), ["head"])
    with pytest.warns(UserWarning, match="look renamed"):
        handle = apply_manifest(_Renamed(), m, strict=False)
    assert any("applied anyway" in n for n in handle.report.notes)
    handle.restore()


def test_a_manifest_without_a_key_brief_says_so() -> None:
    m = _manifest_for(_Saved(), ["head"])
    m.model.pop("keys")
    with pytest.raises(FingerprintMismatchError, match="records no key brief"):
        bind_model(_Renamed(), m)


# --- manifests of the first format -------------------------------------------------------------

def test_a_first_format_manifest_that_matches_applies_with_a_note() -> None:
    model = examples.tiny()
    m = _manifest_for(model, ["aggregator.frame_blocks.0"])
    m.fingerprint = legacy_fingerprint(model.state_dict())
    m = parse_manifest(dumps_manifest(m))  # the schema accepts it
    binding = bind_model(model, m)
    assert binding.matches and any("first format" in n for n in binding.notes)
    with pytest.raises(FingerprintMismatchError, match="first format, which covered dtypes"):
        bind_model(examples.tiny().to(torch.bfloat16), m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_manifest(model, m).restore()


def test_verify_and_export_say_what_differs(tmp_path) -> None:
    from safetensors.torch import save_file

    from surgery.errors import FingerprintMismatchError as Mismatch
    from surgery.formats.manifest import save_manifest
    from surgery.hygiene import export_checkpoint, verify_checkpoint

    man = tmp_path / "m.surgery.toml"
    save_manifest(_manifest_for(_Saved(), ["head"]), str(man))
    ckpt = tmp_path / "renamed.safetensors"
    save_file(_Renamed().state_dict(), str(ckpt))
    report = verify_checkpoint(str(ckpt), manifest=str(man))
    (sg101,) = [f for f in report.findings if f.code == "SG101"]
    assert "keys look renamed: 'encoder.layer.N' -> 'layers.N'" in sg101.title, sg101.title
    with pytest.raises(Mismatch, match="look renamed"):
        export_checkpoint(str(ckpt), out=str(tmp_path / "out.safetensors"), manifest=str(man))
