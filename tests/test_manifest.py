"""Manifest: TOML round trip, schema validation with TOML locations, fingerprint, schema lookup."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from surgery.errors import ManifestError, OutputExistsError
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import (
    DEFAULT_COMPILE,
    Manifest,
    Region,
    dumps_manifest,
    load_manifest,
    parse_manifest,
    save_manifest,
    schema_path,
)
from surgery.formats.tensors import TensorInfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP = "sha256:" + "0" * 64


def _manifest(**kw) -> Manifest:
    regions = kw.pop("regions", [Region(kind="frame_block", paths=["a.blocks.0", "a.blocks.1"])])
    return Manifest(fingerprint=FP, regions=regions, **kw)


def test_round_trip() -> None:
    m = _manifest(regions=[
        Region(kind="frame_block", paths=["a.0", "a.1"], module_class="Block", parameters=10),
        Region(kind="attn_pre", paths=["g.0.attn_pre"], callable="method", required=False,
               on_failure="error", compile={"backend": "aot_eager"}),
    ], model={"source": "x.safetensors", "prefix": "model."})
    back = parse_manifest(dumps_manifest(m))
    assert back.to_dict() == m.to_dict()
    assert back.region_compile(back.regions[1])["backend"] == "aot_eager"
    assert back.region_compile(back.regions[0]) == DEFAULT_COMPILE


@pytest.mark.parametrize(
    ("edit", "location", "line_text"),
    [
        pytest.param(lambda t: t.replace('"a.blocks.1"', '"a blocks.1"'),
                     "region[0].paths[1]", '"a blocks.1"', id="bad-path"),
        pytest.param(lambda t: t.replace("passes = 3", 'passes = "three"'),
                     "warmup.passes", "passes", id="wrong-type"),
        pytest.param(lambda t: t.replace('kind = "frame_block"', 'kind = "frame_block"\nfoo = 1'),
                     "region[0]", "[[region]]", id="unknown-key"),
        pytest.param(lambda t: t.replace('on_failure = "eager"', 'on_failure = "ignore"'),
                     "region[0].on_failure", "on_failure", id="bad-enum"),
        pytest.param(lambda t: t.replace('"a.blocks.1"', '"a.blocks.0"'),
                     "region[0].paths", "paths", id="duplicate-path"),
    ],
)
def test_schema_errors_point_at_the_toml_location(edit, location, line_text) -> None:
    text = edit(dumps_manifest(_manifest()))
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, path="m.toml")
    err = info.value
    assert err.location is not None and err.location.startswith(location)
    line_no = int(str(err).split(":")[1])
    assert line_text in text.splitlines()[line_no - 1]


def test_mode_with_options_is_rejected() -> None:
    m = _manifest(regions=[Region(kind="k", paths=["a"],
                                  compile={"options": {"max_autotune": True}})])
    m.compile["mode"] = "reduce-overhead"
    with pytest.raises(ManifestError, match="both 'mode' and 'options'"):
        dumps_manifest(m)


def test_not_toml_and_missing_file(tmp_path) -> None:
    with pytest.raises(ManifestError, match="not valid TOML"):
        parse_manifest("[[region]\n")
    with pytest.raises(ManifestError, match="no such manifest"):
        load_manifest(tmp_path / "nope.toml")
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ManifestError, match="not UTF-8"):
        load_manifest(binary)


def test_save_refuses_overwrite_and_is_atomic(tmp_path) -> None:
    out = tmp_path / "m.surgery.toml"
    save_manifest(_manifest(), str(out))
    before = out.read_text()
    with pytest.raises(OutputExistsError):
        save_manifest(_manifest(regions=[Region(kind="x", paths=["b"])]), str(out))
    assert out.read_text() == before
    bad = _manifest(regions=[Region(kind="x", paths=["not a path"])])
    with pytest.raises(ManifestError):
        save_manifest(bad, str(out), force=True)
    assert out.read_text() == before
    assert os.listdir(tmp_path) == ["m.surgery.toml"]  # no temp file left behind


def test_fingerprint_covers_keys_and_shapes_not_dtypes() -> None:
    import torch

    header = {"a.weight": TensorInfo((4, 2), "F32"), "b": TensorInfo((3,), "BF16")}
    live = {"b": torch.zeros(3, dtype=torch.bfloat16), "a.weight": torch.zeros(4, 2)}
    assert compute_fingerprint(header) == compute_fingerprint(live)
    assert compute_fingerprint(header).startswith("v2:sha256:")
    # A cast is the same model (surgery.formats.binding notes it); a shape or a key is not.
    assert compute_fingerprint(header) == compute_fingerprint(
        {**header, "b": TensorInfo((3,), "F16")})
    assert compute_fingerprint(header) != compute_fingerprint(
        {**header, "a.weight": TensorInfo((2, 4), "F32")})
    assert compute_fingerprint(header) != compute_fingerprint({"a.weight": header["a.weight"]})


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "manifests", "*.toml"))),
                         ids=os.path.basename)
def test_every_example_manifest_is_valid(path: str) -> None:
    m = load_manifest(path)
    assert m.regions and all(r.paths for r in m.regions)


def test_example_manifests_exist() -> None:
    assert len(glob.glob(os.path.join(ROOT, "manifests", "*.toml"))) >= 2


def test_schema_found_in_the_source_tree() -> None:
    assert schema_path().name == "manifest.schema.json"


def test_deployment_path_needs_no_tomli_w_or_click() -> None:
    code = ("import sys, surgery.formats.manifest as m; m.load_manifest(sys.argv[1]); "
            "bad = {'tomli_w', 'click'} & set(sys.modules); assert not bad, bad")
    path = glob.glob(os.path.join(ROOT, "manifests", "*.toml"))[0]
    subprocess.run([sys.executable, "-c", code, path], check=True)
