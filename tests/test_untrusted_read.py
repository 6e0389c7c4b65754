"""Hostile checkpoints, indexes and manifests (issue 10, reading side).

Every bad input becomes one SurgeryError whose message is one line (exit 3 in the CLI), never
a traceback, a RecursionError or a hang; a pickle that names code is refused and a marker
file proves its payload never ran.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import copyreg
import io
import json
import os
import pathlib
import pickle
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surgery.cli import cli
from surgery.errors import CheckpointError, ManifestError, SurgeryError, UnsafeCheckpointError
from surgery.formats.checkpoint import read_checkpoint, read_index
from surgery.formats.manifest import Manifest, Region, dumps_manifest, parse_manifest
from surgery.formats.st_file import read_safetensors_layout
from tests.capped import case_bounds

FUZZ = settings(max_examples=1000, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def assert_one_line_exit_3(r) -> str:
    """Exit 3, no traceback, one `error:` line (and at most its `fix:` line)."""
    out = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert r.exit_code == 3, out
    assert "Traceback" not in out
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, lines
    assert all(ln.startswith(("error: ", "  fix: ")) for ln in lines), lines
    return errors[0]


def assert_one_line(err: SurgeryError) -> None:
    assert "\n" not in err.message and "\r" not in err.message, err.message
    assert err.hint is None or "\n" not in err.hint


# --- safetensors headers -----------------------------------------------------------------------

def write_st(path: Path, header: bytes | str | dict, data: bytes = b"") -> str:
    raw = header if isinstance(header, bytes) else \
        (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def T(**kw) -> dict:
    return {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], **kw}


ONE = b"\0" * 4
BAD_HEADERS = [
    pytest.param(b"", b"garbage text that is not safetensors\n", "header length",
                 id="absurd-header-length"),
    pytest.param("[]", b"", "start with '{'", id="not-an-object"),
    pytest.param('"x"', b"", "start with '{'", id="a-json-string"),
    pytest.param('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", b"", "deep",
                 id="100k-deep"),
    pytest.param('{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', ONE,
                 "Infinity", id="shape-infinity"),
    pytest.param('{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', ONE,
                 "NaN", id="shape-nan"),
    pytest.param('{"a": {"dtype": "F32", "shape": [' + "7" * 5000 + '], "data_offsets": [0, 4]}}',
                 ONE, "digits", id="5000-digit-dim"),
    pytest.param({"a": T(shape=[1.9])}, ONE, "dimension 1.9", id="dim-1.9-not-1"),
    pytest.param({"a": T(shape=[1.0])}, ONE, "dimension 1.0", id="dim-1.0"),
    pytest.param({"a": T(shape=[-1])}, ONE, "dimension -1", id="negative-dim"),
    pytest.param({"a": T(shape=[True])}, ONE, "dimension True", id="bool-dim"),
    pytest.param({"a": T(shape=[2 ** 64])}, ONE, "dimension", id="dim-past-u64"),
    pytest.param({"a": T(shape=[2 ** 40, 2 ** 40])}, ONE, "overflows", id="numel-overflow"),
    pytest.param({"a": T(dtype="X")}, ONE, "unknown dtype 'X'", id="unknown-dtype"),
    pytest.param({"a": T(dtype="f32")}, ONE, "unknown dtype 'f32'", id="lowercase-dtype"),
    pytest.param({"a": T(dtype=["F32"])}, ONE, "unknown dtype", id="dtype-list"),
    pytest.param({"a": T(), "b": T()}, ONE, "overlaps", id="overlapping-offsets"),
    pytest.param({"a": T(), "b": T(data_offsets=[2, 6])}, b"\0" * 6, "overlaps",
                 id="partly-overlapping"),
    pytest.param({"a": T(data_offsets=[4, 8])}, b"\0" * 8, "gap", id="gap-before"),
    pytest.param({"a": T(data_offsets=[4, 0])}, ONE, "start <= end", id="reversed-offsets"),
    pytest.param({"a": T(data_offsets=[0, 4, 8])}, ONE, "data_offsets", id="three-offsets"),
    pytest.param({"a": T(data_offsets=[0, 8])}, b"\0" * 8, "needs 4", id="offsets-not-shape"),
    pytest.param({"a": T(dtype="F4", shape=[3], data_offsets=[0, 2])}, b"\0" * 2,
                 "byte boundary", id="subbyte-misaligned"),
    pytest.param('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                 '"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8,
                 "appears twice", id="duplicate-tensor"),
    pytest.param('{"a": {"dtype": "F32", "dtype": "I8", "shape": [1], "data_offsets": [0, 4]}}',
                 ONE, "appears twice", id="duplicate-field"),
    pytest.param({"__metadata__": T()}, b"", "reserves", id="tensor-named-__metadata__"),
    pytest.param({"__metadata__": {"format": 1}}, b"", "not a string", id="metadata-int"),
    pytest.param({"__metadata__": ["x"]}, b"", "not an object", id="metadata-list"),
    pytest.param({"a": {"dtype": "F32", "shape": [1]}}, ONE, "no 'data_offsets'",
                 id="missing-field"),
    pytest.param({"a": [1]}, ONE, "not an object", id="entry-list"),
    pytest.param('{"__metadata__": {"k": "a:b", "k": "c"}}', b"", "appears twice",
                 id="duplicate-in-metadata"),
    pytest.param({"a": T()}, b"\0" * 2, "truncated", id="truncated-data"),
    pytest.param({"a": T()}, b"\0" * 12, "no tensor covers", id="trailing-bytes"),
    pytest.param(b'{"\xff": 1}', b"", "UTF-8", id="not-utf8"),
    pytest.param('{"a": 1} x', b"", "not valid JSON", id="trailing-junk"),
]


# safetensors keeps the last of two equal metadata keys; refusing it here is deliberate, since
# two readers of one file could otherwise disagree about its (embedded manifest) metadata.
STRICTER_THAN_SAFETENSORS = {"duplicate-in-metadata"}


@pytest.mark.parametrize(("header", "data", "match"), BAD_HEADERS)
def test_headers_safetensors_refuses_are_refused(tmp_path, header, data, match) -> None:
    if header == b"":
        path = tmp_path / "m.safetensors"
        path.write_bytes(data)
        path = str(path)
    else:
        path = write_st(tmp_path / "m.safetensors", header, data)
    with pytest.raises(CheckpointError) as info:
        read_safetensors_layout(path)
    assert match in info.value.message
    assert_one_line(info.value)


def test_refused_headers_are_refused_by_safetensors_too(tmp_path) -> None:
    """The rules are safetensors' own: every refused header is one it will not open."""
    from safetensors import safe_open

    for p in BAD_HEADERS:
        if p.id in STRICTER_THAN_SAFETENSORS:
            continue
        header, data, _ = p.values
        path = str(tmp_path / "m.safetensors")
        if header == b"":
            Path(path).write_bytes(data)
        else:
            write_st(Path(path), header, data)
        with pytest.raises(Exception), safe_open(path, framework="np") as f:  # noqa: B017
            list(f.keys())  # (safetensors' own error type varies by case)


def test_depth_is_checked_before_parsing(tmp_path, monkeypatch) -> None:
    """Nesting is refused by the pre-parse check, not by catching the parser's RecursionError."""
    import surgery.formats.safejson as safejson

    path = write_st(tmp_path / "m.safetensors", '{"a": ' + "[" * 30 + "]" * 30 + "}")
    parsed: list[int] = []
    monkeypatch.setattr(safejson.json, "loads", lambda *a, **k: parsed.append(1))
    with pytest.raises(CheckpointError, match="more than 16 deep"):
        read_safetensors_layout(path)
    assert not parsed


@pytest.mark.parametrize(("header", "data", "keys"), [
    pytest.param({"b": T(data_offsets=[4, 8]), "a": T()}, b"\0" * 8, {"a", "b"},
                 id="header-order-differs-from-offset-order"),
    pytest.param({"a": T(shape=[0], data_offsets=[0, 0]), "b": T()}, ONE, {"a", "b"},
                 id="zero-size-tensor"),
    pytest.param({"a": T(shape=[])}, ONE, {"a"}, id="scalar"),
    pytest.param({"__metadata__": None}, b"", set(), id="null-metadata"),
    pytest.param({"a": T(dtype="F8_E8M0", shape=[4])}, ONE, {"a"}, id="newer-dtype"),
    pytest.param({"a": T(extra={"x": [1.5]})}, ONE, {"a"}, id="unknown-field-tolerated"),
    pytest.param(" " * 3 + json.dumps({"a": T()}) + " " * 5, ONE, {"a"}, id="padded"),
    pytest.param({"__metadata__": {"k": 'a:b "c": {d}'}, "x:y": T()}, ONE, {"x:y"},
                 id="colons-quotes-brackets-in-strings"),
])
def test_headers_safetensors_accepts_still_read(tmp_path, header, data, keys) -> None:
    path = write_st(tmp_path / "m.safetensors", header, data)
    assert set(read_safetensors_layout(path).tensors) == keys


@pytest.mark.parametrize("command", ["plan", "verify", "export"])
@pytest.mark.parametrize("case", ["100k-deep", "shape-infinity", "5000-digit-dim",
                                  "overlapping-offsets", "tensor-named-__metadata__"])
def test_cli_refuses_bad_headers_with_exit_3(tmp_path, command, case) -> None:
    header, data, match = next(p.values for p in BAD_HEADERS if p.id == case)
    path = write_st(tmp_path / "m.safetensors", header, data)
    out = str(tmp_path / ("o.toml" if command == "plan" else "o.safetensors"))
    args = [command, path] + (["-o", out] if command != "verify" else [])
    line = assert_one_line_exit_3(run(*args))
    assert match in line
    assert not os.path.exists(out)


def test_aliases_metadata_is_untrusted_json(tmp_path) -> None:
    deep = "[" * 50_000 + "]" * 50_000
    for value, match in [(deep, "deep"), ('{"a": ["b"]}', "object of names"),
                         ('{"a": "b", "a": "c"}', "twice")]:
        path = write_st(tmp_path / "m.safetensors",
                        {"__metadata__": {"surgery.aliases": value}, "b": T()}, ONE)
        with pytest.raises(CheckpointError) as info:
            read_safetensors_layout(path)
        assert match in info.value.message
        assert_one_line(info.value)


# --- sharded indexes ---------------------------------------------------------------------------

def write_index(path: Path, weight_map: object, **extra: object) -> str:
    path.write_text(json.dumps({"metadata": {"total_size": 4}, "weight_map": weight_map,
                                **extra}))
    return str(path)


@pytest.mark.parametrize(("weight_map", "match"), [
    pytest.param({"a": "m.index.json"}, "itself an index", id="names-itself"),
    pytest.param({"a": "../evil.safetensors"}, "lies outside", id="dotdot"),
    pytest.param({"a": "sub/../../evil.safetensors"}, "lies outside", id="dotdot-inside"),
    pytest.param({"a": "{abs}"}, "lies outside", id="absolute"),
    pytest.param({"a": ""}, "lies outside", id="empty-name"),
    pytest.param(["a.safetensors"], "weight_map", id="weight-map-list"),
    pytest.param({"a": 3}, "not a shard file name", id="value-int"),
    pytest.param({"a": ["x.safetensors"]}, "not a shard file name", id="value-list"),
])
def test_index_refusals(tmp_path, weight_map, match) -> None:
    """The escaping shard exists and is valid: only the name check stops it being read."""
    evil = write_st(tmp_path / "evil.safetensors", {"a": T()}, ONE)
    (tmp_path / "idx" / "sub").mkdir(parents=True)
    if isinstance(weight_map, dict):
        weight_map = {k: evil if v == "{abs}" else v for k, v in weight_map.items()}
    path = write_index(tmp_path / "idx" / "m.index.json", weight_map)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    assert match in info.value.message
    assert_one_line(info.value)


def test_two_indexes_naming_each_other_are_refused(tmp_path) -> None:
    a = write_index(tmp_path / "a.index.json", {"x": "b.index.json"})
    write_index(tmp_path / "b.index.json", {"x": "a.index.json"})
    line = assert_one_line_exit_3(run("verify", a))
    assert "itself an index" in line
    assert_one_line_exit_3(run("plan", a, "-o", str(tmp_path / "o.toml")))


@pytest.mark.parametrize("text,match", [
    pytest.param('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "deep", id="deep"),
    pytest.param('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "twice",
                 id="duplicate-key"),
    pytest.param('{"weight_map": {"a": NaN}}', "NaN", id="nan"),
    pytest.param("[1, 2]", "not an object", id="list"),
])
def test_index_json_is_untrusted(tmp_path, text, match) -> None:
    path = tmp_path / "m.index.json"
    path.write_text(text)
    with pytest.raises(CheckpointError) as info:
        read_index(str(path))
    assert match in info.value.message
    assert_one_line(info.value)


def test_index_size_is_bounded(tmp_path, monkeypatch) -> None:
    import surgery.formats.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "_MAX_INDEX_BYTES", 100)
    path = write_index(tmp_path / "m.index.json", {f"k{i}": "a.safetensors" for i in range(20)})
    with pytest.raises(CheckpointError, match="more than the 100 allowed"):
        read_index(path)


def test_index_shard_in_subfolder_and_symlink_still_read(tmp_path) -> None:
    """Hub caches keep shards as symlinks into a blobs folder: names are checked, not links."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap" / "sub").mkdir(parents=True)
    write_st(tmp_path / "blobs" / "abc", {"a": T()}, ONE)
    os.symlink(tmp_path / "blobs" / "abc", tmp_path / "snap" / "sub" / "s.safetensors")
    path = write_index(tmp_path / "snap" / "m.index.json", {"a": "sub/s.safetensors"})
    assert set(read_checkpoint(path).tensors) == {"a"}


# --- manifests ---------------------------------------------------------------------------------

def _manifest(n: int = 2) -> Manifest:
    return Manifest(fingerprint="sha256:" + "0" * 64,
                    regions=[Region(kind="block", paths=[f"blocks.{i}" for i in range(n)])])


@pytest.mark.parametrize("text,match", [
    pytest.param("a = " + "[" * 1000 + "]" * 1000, "nest too deeply", id="1000-deep-array"),
    pytest.param("a = " + "[" * 100_000 + "]" * 100_000, "nest too deeply", id="100k-deep-array"),
    pytest.param("a = " + "{b = " * 1000 + "1" + "}" * 1000, "nest too deeply",
                 id="1000-deep-inline-table"),
    pytest.param("a = " + "9" * 5000, "SURGERY_MAX_TOML_KEY_CHARS", id="5000-digit-int"),
    pytest.param("a = [\n1,\n", "not valid TOML", id="unclosed"),
])
def test_manifest_text_that_breaks_tomllib(text, match) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, path="m.toml")
    assert match in info.value.message
    assert_one_line(info.value)


def test_cli_check_and_verify_refuse_a_deep_manifest(tmp_path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    m = tmp_path / "m.surgery.toml"
    m.write_text("a = " + "[" * 1000 + "]" * 1000)
    assert "nest too deeply" in assert_one_line_exit_3(run("check", str(m)))
    ck = str(tmp_path / "c.safetensors")
    save_file({"w": np.zeros(2, dtype=np.float32)}, ck)
    assert "nest too deeply" in assert_one_line_exit_3(run("verify", ck, "--manifest", str(m)))


def test_manifest_size_is_bounded(tmp_path, monkeypatch) -> None:
    import surgery.formats.manifest as manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 1000)
    text = dumps_manifest(_manifest(200))
    with pytest.raises(ManifestError, match="more than the 1000"):
        parse_manifest(text)
    path = tmp_path / "m.surgery.toml"
    path.write_text(text)
    with pytest.raises(ManifestError, match="more than the 1000"):
        manifest.load_manifest(path)


def test_schema_sees_one_path_of_each_region(monkeypatch) -> None:
    """The cause of minutes at 1e6 paths: jsonschema walked each path (~100 us each)."""
    import jsonschema

    seen: list[int] = []
    real = jsonschema.Draft202012Validator.iter_errors

    def spy(self, instance, *a, **kw):
        seen.append(sum(len(r["paths"]) for r in instance["region"]))
        return real(self, instance, *a, **kw)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "iter_errors", spy)
    m = parse_manifest(dumps_manifest(_manifest(50_000)))
    assert len(m.regions[0].paths) == 50_000
    assert seen and max(seen) == 1


@pytest.mark.parametrize(("edit", "location", "match"), [
    pytest.param(lambda t: t.replace('"blocks.4000"', '"blocks 4000"'), "region[0].paths[4000]",
                 "not a dotted module path", id="bad-path-deep-in-list"),
    pytest.param(lambda t: t.replace('"blocks.4000"', '"blocks.3"'), "region[0].paths",
                 "listed twice", id="duplicate-deep-in-list"),
    pytest.param(lambda t: t.replace('"blocks.4000"', "4000"), "region[0].paths[4000]",
                 "not of type 'string'", id="int-path"),
    pytest.param(lambda t: t + '\n[[left_out]]\npath = "x"\nkind = "k"\nreason = "r"\n'
                 '[[left_out]]\npath = "y"\nkind = 3\nreason = "r"\n', "left_out[1].kind",
                 "not of type 'string'", id="left-out-bad-entry"),
])
def test_long_lists_are_still_checked_in_full(edit, location, match) -> None:
    text = edit(dumps_manifest(_manifest(5000)))
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, path="m.toml")
    assert info.value.location == location and match in info.value.message


def test_path_with_newline_is_refused() -> None:
    data = _manifest(3).to_dict()
    data["region"][0]["paths"][1] = "blocks.1\nblocks.9"
    from surgery.formats.manifest import validate

    with pytest.raises(ManifestError, match=r"region\[0\]\.paths\[1\]"):
        validate(data)


def test_too_many_regions(monkeypatch) -> None:
    import surgery.formats.manifest_bulk as bulk

    monkeypatch.setattr(bulk, "MAX_REGIONS", 3)
    m = Manifest(fingerprint="sha256:" + "0" * 64,
                 regions=[Region(kind=f"k{i}", paths=[f"p{i}"]) for i in range(4)])
    with pytest.raises(ManifestError, match="4 regions, more than the 3"):
        parse_manifest(dumps_manifest(m))


# --- hypothesis fuzz ---------------------------------------------------------------------------

# Strategies are built from small fixed alphabets: hypothesis's recursive and text strategies
# cost more to draw than the readers cost to run, and the CI machine has 2 cores.
LEAF = st.sampled_from([None, True, False, 0, 1, 4, 8, -1, 1.9, 1.0, 2 ** 64, 10 ** 30, "F32",
                        "F4", "x", "", "a", "__metadata__"])
KEYS = st.sampled_from(["a", "b", "__metadata__", "dtype", "shape", "data_offsets", "x"])
JSON = st.one_of(LEAF, st.lists(LEAF, max_size=3), st.dictionaries(KEYS, LEAF, max_size=3),
                 st.dictionaries(KEYS, st.lists(LEAF, max_size=3), max_size=3))
ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F4", "x", "f32"]),
    "shape": st.lists(st.sampled_from([0, 1, 2, 3, -1, 1.9, True, 2 ** 64]), max_size=3),
    "data_offsets": st.lists(st.sampled_from([0, 1, 2, 4, 8, 12, 16, -1]), max_size=3)})
HEADER = st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), ENTRY | JSON,
                         max_size=4).map(lambda h: json.dumps(h).encode())
TOKENS = st.lists(st.sampled_from([
    b"{", b"}", b"[", b"]", b",", b":", b'"a"', b'"b"', b'"dtype"', b'"F32"', b'"shape"',
    b'"data_offsets"', b'"__metadata__"', b"0", b"4", b"-1", b"1.9", b"NaN", b"Infinity",
    b"null", b"true", b"1e999", b"9" * 40, b'"', b"\\", b"\xff", b" "]), max_size=40).map(b"".join)
PIECES = st.sampled_from([b"", b"[", b"{", b"]", b"}", b",", b'"', b"NaN", b"9" * 30, b"\xff"])
EDITS = st.lists(st.tuples(st.integers(0, 10_000), PIECES), max_size=3)


def _mutate(raw: bytes, edits: list[tuple[int, bytes]]) -> bytes:
    for pos, piece in edits:
        pos %= max(len(raw), 1)
        raw = raw[:pos] + piece + raw[pos + 1:]
    return raw


@FUZZ
@given(raw=HEADER | TOKENS | st.binary(max_size=48), edits=EDITS,
       length=st.sampled_from(["exact", "exact", "exact", "+1", "-1", "huge", "zero"]),
       pad=st.integers(0, 40))
def test_fuzz_safetensors_header(tmp_path, raw, edits, length, pad) -> None:
    raw = _mutate(raw, edits)
    n = {"exact": len(raw), "+1": len(raw) + 1, "-1": max(len(raw) - 1, 0), "huge": 2 ** 63,
         "zero": 0}[length]
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", n) + raw + bytes(pad))
    with case_bounds(max_s=1.0):
        try:
            read_safetensors_layout(str(path))
        except CheckpointError as e:
            assert_one_line(e)


SHARDS = st.sampled_from(["a.safetensors", "../a.safetensors", "/a.safetensors",
                          "i.index.json", "b.bin", "x.txt", "", "sub/a.safetensors"])


@FUZZ
@given(doc=st.fixed_dictionaries(
    {"weight_map": st.dictionaries(KEYS, SHARDS | LEAF, max_size=4) | JSON},
    optional={"metadata": JSON}) | JSON, edits=EDITS)
def test_fuzz_index(tmp_path, doc, edits) -> None:
    path = tmp_path / "i.index.json"
    path.write_bytes(_mutate(json.dumps(doc).encode(), edits))
    if not (tmp_path / "a.safetensors").exists():
        write_st(tmp_path / "a.safetensors", {"a": T()}, ONE)
    with case_bounds(max_s=1.0):
        try:
            read_checkpoint(str(path))
        except CheckpointError as e:
            assert_one_line(e)


_VALID_MANIFEST = dumps_manifest(_manifest(3)).encode()
TOML_TOKENS = st.lists(st.sampled_from([
    "[", "]", "{", "}", "[[region]]", "=", "a", "paths", '"x"', "'y'", "1", "9" * 30, "nan",
    "inf", ",", "\n", " ", "#", '"""', "true", "1979-05-27", ".",
    "a.a.a.a.a.a.a.a.a", "[a.b.c]", "'" * 3]), max_size=40).map("".join)
FIELDS = st.sampled_from(["schema_version", "model", "compile", "warmup", "region",
                          "left_out", "extra"])


@FUZZ
@given(kind=st.sampled_from(["mutated", "tokens", "structured"]), edits=EDITS,
       tokens=TOML_TOKENS, field=FIELDS, value=JSON.filter(lambda v: v is not None))
def test_fuzz_manifest_loader(kind, edits, tokens, field, value) -> None:
    import tomli_w

    if kind == "tokens":
        text = tokens
    elif kind == "structured":
        doc = _manifest(2).to_dict()
        doc[field] = value
        try:
            text = tomli_w.dumps(doc)
        except (TypeError, ValueError):
            return  # tomli-w cannot write this value; the mutated and token cases cover text
    else:
        text = _mutate(_VALID_MANIFEST, edits).decode("utf-8", errors="replace")
    with case_bounds(max_s=1.0):  # issue 22: time and peak memory per case are bounded too
        try:
            parse_manifest(text, path="m.toml")
        except ManifestError as e:
            assert_one_line(e)


# --- malicious pickles -------------------------------------------------------------------------

class Call:
    """Pickles as `fn(*args)`: what an attacker's __reduce__ returns."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _zip(obj: object, **kw) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def _legacy(obj: object) -> bytes:
    return _zip(obj, _use_new_zipfile_serialization=False)


def _ext_pickle(marker: str) -> bytes:
    copyreg.add_extension("os", "system", 0x5EC1)
    try:
        return pickle.dumps(Call(os.system, f"touch {marker}"), protocol=2)
    finally:
        copyreg.remove_extension("os", "system", 0x5EC1)


W = torch.zeros(2)


def corpus(marker: str) -> dict[str, bytes]:
    """At least 15 payloads that each create `marker` when unpickled by plain pickle."""
    m = marker
    py = f"open({m!r}, 'w').close()"
    sh = f"touch {m}"
    return {
        "zip-os-system.pt": _zip({"w": W, "x": Call(os.system, sh)}),
        "legacy-os-system.pt": _legacy({"w": W, "x": Call(os.system, sh)}),
        "zip-builtins-open.pth": _zip(Call(builtins.open, m, "w")),
        "zip-exec.bin": _zip({"w": W, "x": Call(builtins.exec, py)}),
        "zip-eval.ckpt": _zip({"w": W, "x": Call(builtins.eval, py)}),
        "zip-nested-state_dict.ckpt": _zip({"state_dict": {"w": W, "x": Call(exec, py)},
                                            "epoch": 3}),
        "legacy-nested-in-list.pth": _legacy({"model": {"w": W}, "extra": [Call(exec, py)]}),
        "zip-subprocess.pt": _zip({"w": W, "x": Call(subprocess.call, ["touch", m])}),
        "zip-protocol4.pt": _zip({"w": W, "x": Call(exec, py)}, pickle_protocol=4),
        "lightning-hparams.ckpt": _zip({"state_dict": {"w": W},
                                        "hyper_parameters": {"lr": Call(eval, py)}}),
        "raw-global-reduce.pt": f"cos\nsystem\n(S'{sh}'\ntR.".encode(),
        "raw-getattr-import.pt": ("cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntR"
                                  f"S'system'\ntR(S'{sh}'\ntR.").encode(),
        "raw-inst.bin": f"(S'{sh}'\nios\nsystem\n.".encode(),
        "raw-obj.pt": f"(cos\nsystem\nS'{sh}'\no.".encode(),
        "raw-stack-global-p4.pt": pickle.dumps(Call(os.system, sh), protocol=4),
        "raw-ext-opcode.pt": _ext_pickle(m),
        "polyglot-pickle-then-zip.pt": f"cos\nsystem\n(S'{sh}'\ntR.".encode()
        + _zip({"w": W}),
        "polyglot-p2-then-zip.pth": pickle.dumps(Call(exec, py), protocol=2) + _zip({"w": W}),
        # argparse.Namespace and pathlib paths load as data (surgery.formats.pickle_probe): what
        # they hold is still refused, and their constructors reach no other callable.
        "timm-args-holding-code.pth.tar": _zip({"state_dict": {"w": W},
                                                "args": argparse.Namespace(x=Call(os.system, sh))}),
        "timm-args-path-of-code.pth.tar": _zip(
            {"state_dict": {"w": W}, "args": Call(pathlib.PurePosixPath, Call(eval, py))}),
        "raw-namespace-reduce.pt": f"cargparse\nNamespace\n(cos\nsystem\n(S'{sh}'\ntRtR.".encode(),
    }


def _unsafe_load(path: Path) -> None:
    """What a user told to pass weights_only=False would run (never done outside this test)."""
    copyreg.add_extension("os", "system", 0x5EC1)
    try:
        torch.load(path, weights_only=False)
    finally:
        copyreg.remove_extension("os", "system", 0x5EC1)


def _wait_for(path: Path) -> bool:
    import time

    for _ in range(100):
        if path.exists():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pickles(tmp_path) -> tuple[Path, dict[str, Path]]:
    marker = tmp_path / "ran.marker"
    files = {}
    for name, blob in corpus(str(marker)).items():
        (tmp_path / name).write_bytes(blob)
        files[name] = tmp_path / name
    return marker, files


def test_corpus_payloads_are_live(pickles) -> None:
    """Each payload really runs when loaded unsafely, so the refusal tests can fail."""
    marker, files = pickles
    assert len(files) >= 15
    for name, path in files.items():
        marker.unlink(missing_ok=True)
        with contextlib.suppress(Exception):  # the payload ran; what follows may not parse
            _unsafe_load(path)
        assert _wait_for(marker), f"{name}: payload did not run when loaded unsafely"
        marker.unlink()


@pytest.mark.parametrize("command", ["plan", "verify", "export"])
def test_corpus_refused_by_every_command(pickles, tmp_path, command) -> None:
    marker, files = pickles
    for name, path in files.items():
        out = tmp_path / f"{name}.out{'.toml' if command == 'plan' else '.safetensors'}"
        args = [command, str(path)] + (["-o", str(out)] if command != "verify" else [])
        line = assert_one_line_exit_3(run(*args))
        assert "would run code" in line, (name, line)
        assert "weights_only" not in line
        assert not out.exists()
    assert not marker.exists(), "a payload ran"


def test_corpus_refused_as_unsafe_by_the_library(pickles) -> None:
    marker, files = pickles
    for name, path in files.items():
        with pytest.raises(UnsafeCheckpointError) as info:
            read_checkpoint(str(path))
        assert_one_line(info.value)
        assert name and "weights_only=False" not in str(info.value)
    assert not marker.exists()


# --- files that are not checkpoints at all ------------------------------------------------------

def _good_zip() -> bytes:
    return _zip({"w": W})


@pytest.mark.parametrize(("content", "match"), [
    pytest.param(b"garbage\n", "not a PyTorch checkpoint: it is neither a zip archive nor a "
                 "pickle", id="garbage-issue-12-defect-5"),
    pytest.param(b"", "empty file", id="empty"),
    pytest.param(b"<html>not found</html>", "neither a zip archive nor a pickle", id="html"),
    pytest.param(_good_zip()[:200], "truncated or corrupt zip archive", id="truncated-zip"),
    pytest.param(_legacy({"w": W})[:40], "truncated", id="truncated-legacy"),
    pytest.param(b"\x80\x02", "truncated", id="only-proto"),
    pytest.param(b"S'just a string'\n.", "STRING", id="protocol-0-data-only"),
])
def test_files_that_are_not_checkpoints(tmp_path, content, match) -> None:
    path = tmp_path / "fake.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(str(path))
    assert not isinstance(info.value, UnsafeCheckpointError)
    assert match in info.value.message
    assert "run code" not in info.value.message
    assert_one_line(info.value)
    line = assert_one_line_exit_3(run("plan", str(path), "-o", str(tmp_path / "o.toml")))
    assert "run code" not in line


def test_legacy_format_loads_without_mmap(tmp_path) -> None:
    path = tmp_path / "legacy.pt"
    path.write_bytes(_legacy({"w": W}))
    assert set(read_checkpoint(str(path)).tensors) == {"w"}


def test_a_zip_without_data_pkl_is_not_a_checkpoint(tmp_path) -> None:
    path = tmp_path / "docs.bin"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("word/document.xml", "<w/>")
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(str(path))
    assert not isinstance(info.value, UnsafeCheckpointError)
    assert_one_line(info.value)
