"""TOML is scanned in linear time before tomllib (issue 22): dotted keys and headers that made
tomllib take gigabytes or tens of seconds are refused first, from a manifest file and from the
manifest embedded in an export. The blow-ups run capped (tests/capped.py)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from surgery.errors import ManifestError
from surgery.formats.manifest import dumps_manifest, parse_manifest
from surgery.formats.tensors import META_MANIFEST
from surgery.formats.toml_scan import _STRINGS_AND_COMMENTS, blank_strings, key_parts, scan_toml
from tests.capped import snippet_capped, surgery_capped
from tests.test_untrusted_read import _manifest

ROOT = Path(__file__).resolve().parents[1]
GOOD = dumps_manifest(_manifest(3))


def _embed(path: Path, text: str) -> None:
    """A valid one-tensor safetensors file whose metadata carries `text` as its manifest."""
    header = {"__metadata__": {"format": "pt", META_MANIFEST: text},
              "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))


def _hostile(tmp_path: Path) -> list[Path]:
    dotted = tmp_path / "dotted.surgery.toml"  # 120 KB: tomllib kept every prefix (~1.5 GB)
    dotted.write_text(GOOD + "\n[zz]\n" + "a." * 60_000 + "a = 1\n")
    header = tmp_path / "header.surgery.toml"  # 200 KB: 22 s in tomllib
    header.write_text(GOOD + "\n[" + "a." * 100_000 + "a]\n")
    quoted = tmp_path / "quoted.surgery.toml"
    quoted.write_text(GOOD + "\n[zz]\n" + '"a".' * 40_000 + '"a" = 1\n')
    inline = tmp_path / "inline.surgery.toml"
    inline.write_text(GOOD + "\nzz = {" + "a . " * 40_000 + "a = 1}\n")
    embedded = tmp_path / "embedded.safetensors"
    _embed(embedded, GOOD + "\n[zz]\n" + "a." * 60_000 + "a = 1\n")
    return [dotted, header, quoted, inline, embedded]


def test_dotted_keys_and_headers_are_refused_before_tomllib(tmp_path: Path) -> None:
    files = _hostile(tmp_path)
    r = surgery_capped("check", *map(str, files), timeout=40)
    assert r.rc == 3 and "Traceback" not in r.output, r.output[-2000:]
    assert len(r.error_lines) == len(files), r.stderr[-3000:]
    for f, line in zip(files, r.error_lines, strict=True):
        assert str(f) in line and "SURGERY_MAX_TOML_KEY_PARTS" in line, line
        assert len(line) < 400
    assert r.wall_s < 20, r.wall_s


def test_the_embedded_manifest_is_scanned_by_load_exported(tmp_path: Path) -> None:
    f = tmp_path / "embedded.safetensors"
    _embed(f, GOOD + "\n[zz]\n" + "a." * 60_000 + "a = 1\n")
    r = snippet_capped(
        "import sys, surgery\n"
        "from surgery.errors import ManifestError\n"
        f"try:\n    surgery.load_exported({str(f)!r})\n"
        "except ManifestError as e:\n    print(e.message); sys.exit(3)\n", timeout=40)
    assert r.rc == 3, r.output[-2000:]
    assert "SURGERY_MAX_TOML_KEY_PARTS" in r.stdout


def test_raising_the_limit_lets_a_trusted_deep_key_through() -> None:
    text = GOOD + "\n[zz]\n" + "a." * 20 + "a = 1\n"
    with pytest.raises(ManifestError, match="SURGERY_MAX_TOML_KEY_PARTS") as info:
        parse_manifest(text)
    assert "SURGERY_MAX_TOML_KEY_PARTS=" in (info.value.hint or "")
    import os

    os.environ["SURGERY_MAX_TOML_KEY_PARTS"] = "32"
    try:  # past the scan: the schema now refuses the unknown table, in its own words
        with pytest.raises(ManifestError, match="zz"):
            parse_manifest(text)
    finally:
        del os.environ["SURGERY_MAX_TOML_KEY_PARTS"]


def test_a_long_bare_key_is_refused() -> None:
    with pytest.raises(ManifestError, match="SURGERY_MAX_TOML_KEY_CHARS"):
        parse_manifest(GOOD + "\n" + "k" * 5000 + " = 1\n")


def test_schema_errors_are_bounded(tmp_path: Path) -> None:
    """An array the bulk check does not cut, full of invalid items: one error, at once."""
    f = tmp_path / "many.surgery.toml"
    f.write_text(GOOD + "\n[coverage]\nremainder = [" + ", ".join(["{x = 1}"] * 100_000) + "]\n")
    r = surgery_capped("check", str(f), timeout=40)
    assert r.rc == 3 and len(r.error_lines) == 1, r.output[-2000:]
    assert "coverage" in r.error_lines[0] and len(r.error_lines[0]) < 600


def test_every_real_manifest_passes_the_scan() -> None:
    texts = [p.read_text() for p in [*ROOT.glob("manifests/*.toml"),
                                     *ROOT.glob("tests/golden/**/*.toml")]]
    assert texts, "no real manifests found"
    for text in texts:
        scan_toml(text)
        assert key_parts(text) <= 4  # the deepest key is region.compile.options
    big = dumps_manifest(_manifest(100_000))  # a 100k-path plan
    scan_toml(big)


@pytest.mark.parametrize("text", [
    pytest.param('a = "x # y" # "z\nb = 1', id="hash-in-string-quote-in-comment"),
    pytest.param("# say \"x\nk = 1 # \"\n", id="quote-in-comment"),
    pytest.param('k = "a\\"b.c.d" # e\n', id="escaped-quote"),
    pytest.param("k = 'it''s' \n", id="literal"),
    pytest.param('k = """a\n"b" ""\n""" # c\n', id="multi-line"),
    pytest.param("k = '''a\n'b'\n'''\n", id="multi-line-literal"),
    pytest.param('k = "unterminated\nq = 1\n', id="unterminated"),
])
def test_the_fast_blanking_agrees_with_the_tokenizer(text: str) -> None:
    assert blank_strings(text) == _STRINGS_AND_COMMENTS.sub('""', text)


def test_parse_time_grows_linearly() -> None:
    """parse_manifest (scan, tomllib, validation), the input doubled four times."""
    texts = [dumps_manifest(_manifest(n)) for n in (2000, 4000, 8000, 16000, 32000)]
    times = []
    for text in texts:
        t0 = time.perf_counter()
        parse_manifest(text)
        times.append(time.perf_counter() - t0)
    growth = len(texts[-1]) / len(texts[0])
    assert times[-1] / times[0] < growth * 2.5, times
    # The hostile shape grows linearly too (capped: without the scan it is quadratic in tomllib).
    r = snippet_capped(
        "import time\n"
        "from surgery.formats.manifest import parse_manifest\n"
        "from surgery.errors import ManifestError\n"
        "for n in (25_000, 50_000, 100_000, 200_000, 400_000):\n"
        "    t0 = time.perf_counter()\n"
        "    try:\n"
        "        parse_manifest('[' + 'a.' * n + 'a]\\n')\n"
        "    except ManifestError:\n"
        "        pass\n"
        "    print(time.perf_counter() - t0)\n", timeout=30)
    assert r.rc == 0, r.output[-2000:]
    scan = [float(x) for x in r.stdout.split()]
    assert scan[-1] / scan[0] < 16 * 2.5, scan
