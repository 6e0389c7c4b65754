"""A manifest is data, never code: compile settings come from an allowlist (issue 10, part 1).

The attack: inductor's ``cpp.enable_floating_point_contract_flag`` is pasted into the C++
compiler's command line and split with shlex, so a manifest that sets it to
``off -wrapper '/bin/sh,-c,CMD;exec "$0" "$@"'`` runs CMD at every C++ compile. Each test
below gives that manifest to one entry point and checks that it is refused, naming the key,
and that the marker file CMD would create does not exist. The one slow test is the control: the
same flag given to torch.compile directly does create the marker, so the attack is live on this
torch and the refusals are what stop it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch import nn

from surgery.cli import cli
from surgery.errors import ManifestError, RegionError
from surgery.formats import allowlist
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import (
    DEFAULT_COMPILE,
    Manifest,
    Region,
    dumps_manifest,
    load_manifest,
    load_schema,
    parse_manifest,
)
from surgery.runtime.apply import apply_manifest
from surgery.runtime.compile_options import COMPILE_KEYS, plan_region
from surgery.runtime.resolve import resolve_path

FLAG = "cpp.enable_floating_point_contract_flag"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def attack_value(marker: Path) -> str:
    return f"off -wrapper '/bin/sh,-c,touch {marker};exec \"$0\" \"$@\"'"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x)))

    def mix(self, x: torch.Tensor) -> torch.Tensor:  # a plain method of the model's own class
        return self.a(x) * 2

    @staticmethod
    def helper(x: torch.Tensor) -> torch.Tensor:
        return x


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _clean_manifest(model: nn.Module) -> Manifest:
    return Manifest(compute_fingerprint(model.state_dict()), [Region("lin", ["a", "b"])],
                    compile={**DEFAULT_COMPILE, "on_cpu": "compile", "capture": "compiler"})


def _attack_toml(model: nn.Module, marker: Path, *, where: str = "compile") -> str:
    """A valid manifest's TOML with the cpp flag added (to [compile] or a region's compile)."""
    text = dumps_manifest(_clean_manifest(model))
    line = f'options = {{ "{FLAG}" = {json.dumps(attack_value(marker))} }}\n'
    if where == "compile":
        return text.replace("[compile]\n", "[compile]\n" + line, 1)
    return text.replace("[[region]]\n", "[[region]]\ncompile = { " + line.strip() + " }\n", 1)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


def _refused(text: str) -> None:
    assert FLAG in text, text
    assert "may not be set by a manifest" in text and "overrides=" in text, text
    assert "Traceback" not in text


@pytest.mark.parametrize("where", ["compile", "region"])
def test_check_refuses_the_cpp_flag_attack(tmp_path, marker, where) -> None:
    path = tmp_path / "evil.surgery.toml"
    path.write_text(_attack_toml(_net(), marker, where=where))
    r = CliRunner().invoke(cli, ["check", str(path)])
    assert r.exit_code == 3, r.output
    _refused(r.output)
    assert not marker.exists()


def test_verify_with_the_attack_manifest_exits_3(tmp_path, marker) -> None:
    model = _net()
    ckpt = tmp_path / "net.safetensors"
    save_file(model.state_dict(), str(ckpt))
    path = tmp_path / "evil.surgery.toml"
    path.write_text(_attack_toml(model, marker))
    r = CliRunner().invoke(cli, ["verify", str(ckpt), "--manifest", str(path)])
    assert r.exit_code == 3, r.output
    _refused(r.output)
    assert not marker.exists()


def test_apply_manifest_refuses_the_attack_file(tmp_path, marker) -> None:
    model = _net()
    path = tmp_path / "evil.surgery.toml"
    path.write_text(_attack_toml(model, marker))
    x = torch.randn(2, 8)
    with pytest.raises(ManifestError) as info, torch.no_grad():
        apply_manifest(model, str(path), warmup=lambda m: m(x))
    _refused(str(info.value))
    assert info.value.location == f"compile.options.{FLAG}"
    assert not marker.exists()
    assert "forward" not in vars(model.a)  # nothing was installed


def test_apply_manifest_refuses_the_attack_embedded_in_a_safetensors(tmp_path, marker) -> None:
    """The downloaded weights file alone: its header carries the manifest (as `surgery export`
    writes it, sha256 included), so the attacker needs no second file."""
    import hashlib

    model = _net()
    text = _attack_toml(model, marker)
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path), metadata={
        "surgery.formats.manifest": text,
        "surgery.manifest_sha256": hashlib.sha256(text.encode()).hexdigest()})
    x = torch.randn(2, 8)
    with pytest.raises(ManifestError) as info, torch.no_grad():
        apply_manifest(model, str(path), warmup=lambda m: m(x))
    _refused(str(info.value))
    r = CliRunner().invoke(cli, ["check", str(path)])  # check reads an export's manifest too
    assert r.exit_code == 3, r.output
    _refused(r.output)
    assert not marker.exists()


def test_an_in_memory_manifest_is_checked_too(marker) -> None:
    """A Manifest built from untrusted data without the reader (Manifest.from_dict) still
    cannot carry the flag: apply checks its tables again, before anything is installed."""
    model = _net()
    m = _clean_manifest(model)
    m.compile["options"] = {FLAG: attack_value(marker)}
    with pytest.raises(RegionError, match="may not be set by a manifest"):
        apply_manifest(model, m)
    assert "forward" not in vars(model.a)
    assert not marker.exists()


def test_overrides_from_code_may_pass_other_inductor_options() -> None:
    """The deployer's code is trusted: an override may set an option no manifest may."""
    model = _net()
    m = _clean_manifest(model)
    plan = plan_region(m, m.regions[0], overrides={"options": {FLAG: "fast"}}, on_cuda=False)
    assert plan.config_patches is not None and plan.config_patches[FLAG] == "fast"


@pytest.mark.parametrize(("table", "location", "text"), [
    pytest.param({"backend": "openxla"}, "compile.backend", "'openxla' is not allowed",
                 id="backend-outside-the-fixed-set"),
    pytest.param({"options": {"max_autotune": "yes"}}, "compile.options.max_autotune",
                 "takes a boolean", id="option-of-the-wrong-type"),
    pytest.param({"options": {"max_autotune_gemm_search_space": "ALL"}},
                 "compile.options.max_autotune_gemm_search_space", "one of 'DEFAULT'",
                 id="enum-outside-its-values"),
    pytest.param({"options": {"max_autotune_gemm_backends": "ATEN"}},
                 "compile.options.max_autotune_gemm_backends", "may not be set by a manifest",
                 id="free-string-option"),
    pytest.param({"fullgraph": "true"}, "compile.fullgraph", "a manifest may set fullgraph",
                 id="string-for-a-boolean"),
    pytest.param({"bakend": "inductor"}, "compile.bakend", "did you mean 'backend'",
                 id="unknown-key"),
    pytest.param({"options": {"a\nb" * 100: True}}, "compile.options[", "(cut)",
                 id="hostile-key-is-quoted-and-cut"),
])
def test_each_refusal_names_the_key(table, location, text) -> None:
    data = _clean_manifest(_net()).to_dict()
    data["compile"] = {**data["compile"], **table}
    with pytest.raises(ManifestError) as info:
        parse_manifest(_dump(data), path="m.toml")
    assert info.value.location is not None and info.value.location.startswith(location)
    assert text in info.value.message and "\n" not in info.value.message
    assert info.value.hint


def _dump(data: dict) -> str:
    import tomli_w

    return tomli_w.dumps(data)


def test_allowed_settings_still_load(tmp_path) -> None:
    data = _clean_manifest(_net()).to_dict()
    data["compile"]["options"] = {"max_autotune": True, "triton.cudagraphs": False,
                                  "max_autotune_gemm_search_space": "EXHAUSTIVE"}
    data["compile"].pop("mode", None)
    data["region"][0]["compile"] = {"backend": "aot_eager"}
    path = tmp_path / "ok.surgery.toml"
    path.write_text(_dump(data))
    m = load_manifest(path)
    assert m.compile["options"]["max_autotune"] is True


def test_the_allowlist_is_the_schema_and_every_option_exists() -> None:
    """One list: the schema's compile keys are COMPILE_KEYS, and every inductor option it
    allows is a real boolean or enum option of this torch's inductor."""
    from torch._inductor import config as inductor_config

    schema = load_schema()
    assert set(allowlist.compile_specs(schema)) == set(COMPILE_KEYS)
    for name, spec in allowlist.compile_specs(schema).items():
        if name != "options":  # a table, checked by its own list below
            assert set(spec) <= allowlist.SPEC_KEYWORDS, (name, spec)
    valid = inductor_config.get_config_copy()
    for name, spec in allowlist.option_specs(schema).items():
        assert name in valid, name
        assert spec.get("type") == "boolean" or "enum" in spec, (name, spec)
        assert isinstance(valid[name], bool) == (spec.get("type") == "boolean"), name
    assert allowlist.allowed_backends(schema) == ("inductor", "cudagraphs", "aot_eager", "eager")


# --- method regions: only plain methods of the model's own class ------------------------------

@pytest.mark.parametrize("name", ["__init__", "__setattr__", "state_dict", "to", "forward",
                                  "load_state_dict", "register_forward_hook", "_apply"])
def test_method_regions_refuse_dunders_and_module_api(name) -> None:
    with pytest.raises(RegionError) as info:
        resolve_path(_net(), name, callable="method")
    assert "not a method defined by Net" in info.value.message
    assert "callable = \"forward\"" in (info.value.hint or "")


def test_method_regions_refuse_what_is_not_a_plain_function() -> None:
    with pytest.raises(RegionError, match="has no method 'helper'"):
        resolve_path(_net(), "helper", callable="method")  # a staticmethod
    assert resolve_path(_net(), "mix", callable="method")[1] == "mix"


def test_check_refuses_a_dunder_method_region(tmp_path) -> None:
    model = _net()
    m = _clean_manifest(model)
    m.regions = [Region("init", ["a.__init__"], callable="method")]
    data = m.to_dict()
    path = tmp_path / "m.surgery.toml"
    path.write_text(_dump(data))
    r = CliRunner().invoke(cli, ["check", str(path)])
    assert r.exit_code == 3, r.output
    assert "region[0].paths[0]" in r.output and "'__init__'" in r.output


# --- the control: the attack is live on this torch, so the refusals above matter ------------

@pytest.mark.slow
def test_control_the_flag_reaches_the_compiler_when_code_passes_it(tmp_path, marker,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled = torch.compile(_net(), options={FLAG: attack_value(marker)})
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    assert marker.exists(), "the flag no longer reaches the C++ compiler: update the docstring"
    os.unlink(marker)
