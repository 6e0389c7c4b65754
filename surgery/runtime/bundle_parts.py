"""The two parts of a format-3 bundle's blob, and the record that indexes the precompiled part.

Format 2 (surgery.runtime.bundle) signs one blob: torch's Mega-Cache. Format 3 signs the same
framing, whose blob is the Mega-Cache part followed by the precompiled part
(surgery.runtime.precompiled: torch's AOT-compiled functions, back to back). The metadata says
where they split: its ``precompiled`` record (PRECOMPILED_KEY) holds ``format``
(PRECOMPILED_FORMAT); ``bytes``, the part's length (the blob's last bytes); ``entries``, per
artifact ENTRY_FIELDS (group identity text, signature text, the grad / inference / autocast
modes it was traced and must be loaded under, offset, length) and, since the guard filter of
surgery.runtime.portable, SOURCES_FIELD (the source spans inlined into it: [module, first line,
last line, "sha256:..."], checked against this process's modules before it is loaded; an entry
written before has none, and is read as before); and ``notes``, what was left to the Mega-Cache
part and why.

Record format 2 (PRECOMPILED_FORMAT_AOTI, written only when the bundle holds one) adds entries
whose KIND_FIELD is AOTI_KIND: an AOTInductor package (a zip with a shared library,
surgery.runtime.aoti_bundle) instead of a pickled artifact, with AOTI_FIELDS: ``constants``, the
weights it takes as [fqn, [shape, strides, dtype, device type]] (checked against the module's
before any is handed over), and ``inputs``, how many tensors it takes; SOURCES_FIELD is required
in such an entry (the code the package embodies, checked before it is loaded); AOTI_LOADER_FIELD,
optional, names how it is loaded (one of AOTI_LOADERS; absent: "package", as entries written
before the field). Record format 3 (PRECOMPILED_FORMAT_AOTI_RUNNER) is written when an entry's
loader is "runner", so that a reader of formats 1-2, which knows no loader field and would load
it with the package loader (the one that crashed), refuses the record whole. An entry without
KIND_FIELD is a torch AOT artifact, as in format 1. A reader
of format 1 only refuses format 2 whole.

Both parts are under the one HMAC and ``format`` is in the signed metadata, so a format-3 file
cannot be passed off as format 2 or cut into one. The record is the key holder's, yet every
field is checked (types, bounds, order, modes from fixed lists): a builder's bug becomes an
ignored bundle, never an exception in a deployment. Nothing here imports torch (``surgery
verify`` reads bundles without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FORMAT_PRECOMPILED = 3  # the bundle format whose blob is a Mega-Cache part, then this part
PRECOMPILED_KEY = "precompiled"
PRECOMPILED_FORMAT = 1
PRECOMPILED_FORMAT_AOTI = 2  # entries may be AOTInductor packages
PRECOMPILED_FORMAT_AOTI_RUNNER = 3  # ... and one is loaded by the "runner" loader
READ_PRECOMPILED_FORMATS = (PRECOMPILED_FORMAT, PRECOMPILED_FORMAT_AOTI,
                            PRECOMPILED_FORMAT_AOTI_RUNNER)
KIND_FIELD = "kind"  # optional in an entry; absent: a torch AOT artifact
AOTI_KIND = "aoti"
AOTI_FIELDS = ("constants", "inputs")
# Optional in an AOTInductor entry: how the proving child loaded the package, one of AOTI_LOADERS
# (surgery.runtime.aoti_bundle); absent (every entry written before it): the package loader.
AOTI_LOADER_FIELD = "loader"
AOTI_LOADERS = ("package", "runner")
MAX_CONSTANTS = 4096  # weights one package may take
MAX_RANK = 16
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
                 "uint8", "bool")
WEIGHT_DEVICES = ("cpu", "cuda")
ENTRY_FIELDS = ("group", "signature", "modes", "offset", "bytes")
SOURCES_FIELD = "sources"  # optional in an entry (absent in bundles written before it)
MAX_SOURCES = 2048  # spans one entry may list (a BERT layer inlines a few dozen)
_DIGEST = "sha256:"
# An entry's modes: {"grad": bool, "inference": bool, "autocast": [[device, dtype], ...]}.
AUTOCAST_DEVICES = ("cpu", "cuda")
AUTOCAST_DTYPES = ("bfloat16", "float16", "float32")
# Bounds on what a record may claim (a LingBot-Map size plan has 17 groups, one signature each).
MAX_ENTRIES = 4096
_MAX_TEXT = 8192


class PrecompiledError(ValueError):
    """The precompiled record of a signed bundle does not have the shape surgery writes."""


def split_blob(meta: Mapping[str, Any], blob: bytes) -> tuple[bytes, bytes]:
    """(Mega-Cache part, precompiled part) of a verified bundle's blob; the second is empty
    for format 2. Raises PrecompiledError when a format-3 record cannot say where they split."""
    if meta.get("format") != FORMAT_PRECOMPILED:
        return blob, b""
    record = meta.get(PRECOMPILED_KEY)
    n = record.get("bytes") if isinstance(record, dict) else None
    if type(n) is not int or not 0 <= n <= len(blob):
        raise PrecompiledError("the precompiled record does not give the length of its part "
                               "of the blob")
    return blob[:len(blob) - n], blob[len(blob) - n:]


Parsed = dict[str, dict[str, tuple[bytes, dict[str, Any], tuple[tuple[Any, ...], ...]]]]
# {group identity: {signature text: (package bytes, modes, constants, inputs, loader, source
# spans)}}
AotiParsed = dict[str, dict[str, tuple[bytes, dict[str, Any], list[list[Any]], int, str,
                                       tuple[tuple[Any, ...], ...]]]]


def parse_precompiled(meta: Mapping[str, Any], section: bytes) -> Parsed:
    """{group identity: {signature text: (artifact bytes, modes, inlined source spans)}} of a
    verified bundle ({} for format 2). Raises PrecompiledError naming the first problem."""
    return parse_parts(meta, section)[0]


def parse_aoti(meta: Mapping[str, Any], section: bytes) -> AotiParsed:
    """The AOTInductor packages of a verified bundle ({} when it has none)."""
    return parse_parts(meta, section)[1]


def parse_parts(meta: Mapping[str, Any], section: bytes) -> tuple[Parsed, AotiParsed]:
    """(torch AOT artifacts, AOTInductor packages) of a verified bundle's precompiled part.
    Raises PrecompiledError naming the first problem."""
    if meta.get("format") != FORMAT_PRECOMPILED:
        return {}, {}
    record = meta.get(PRECOMPILED_KEY)
    fmt = record.get("format") if isinstance(record, dict) else None
    if fmt not in READ_PRECOMPILED_FORMATS or type(fmt) is not int:
        raise PrecompiledError(f"precompiled record format {str(fmt)[:20]!r}, this surgery "
                               f"reads formats {READ_PRECOMPILED_FORMATS}")
    assert isinstance(record, dict)
    entries = record.get("entries")
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise PrecompiledError(f"precompiled entries are not a list of at most {MAX_ENTRIES}")
    if record.get("bytes") != len(section):
        raise PrecompiledError(f"the precompiled part is {len(section)} bytes, its record "
                               f"says {str(record.get('bytes'))[:20]}")
    out: Parsed = {}
    aoti: AotiParsed = {}
    end = 0
    for e in entries:
        if not isinstance(e, dict) or not all(k in e for k in ENTRY_FIELDS):
            raise PrecompiledError(f"a precompiled entry lacks one of {', '.join(ENTRY_FIELDS)}")
        group, sig, modes, off, n = (e[k] for k in ENTRY_FIELDS)
        if not _modes_ok(modes):
            raise PrecompiledError("a precompiled entry's modes are not the grad, inference "
                                   "and autocast record surgery writes")
        if not (isinstance(group, str) and isinstance(sig, str) and len(group) <= _MAX_TEXT
                and len(sig) <= _MAX_TEXT):
            raise PrecompiledError("a precompiled entry's group or signature is not short text")
        if not (type(off) is int and type(n) is int and off == end and n > 0
                and off + n <= len(section)):
            raise PrecompiledError("a precompiled entry's offset or length is outside its "
                                   "part, or entries overlap")
        end = off + n
        kind = e.get(KIND_FIELD)
        if kind is not None and (fmt == PRECOMPILED_FORMAT or kind != AOTI_KIND):
            raise PrecompiledError(f"a precompiled entry's kind is {str(kind)[:20]!r} (only "
                                   f"{AOTI_KIND!r}, in record format {PRECOMPILED_FORMAT_AOTI}+)")
        if kind == AOTI_KIND:
            if sig in aoti.setdefault(group, {}):
                raise PrecompiledError("two AOTInductor packages for one group and signature")
            if SOURCES_FIELD not in e:
                raise PrecompiledError(f"an AOTInductor entry lacks {SOURCES_FIELD}")
            loader = e.get(AOTI_LOADER_FIELD, AOTI_LOADERS[0])
            if loader not in AOTI_LOADERS or (loader != AOTI_LOADERS[0] and
                                              fmt != PRECOMPILED_FORMAT_AOTI_RUNNER):
                raise PrecompiledError(f"an AOTInductor entry's loader is not one of "
                                       f"{', '.join(AOTI_LOADERS)} (a non-default one only in "
                                       f"record format {PRECOMPILED_FORMAT_AOTI_RUNNER})")
            aoti[group][sig] = (section[off:off + n], modes, *_aoti_fields(e), loader,
                                _sources(e[SOURCES_FIELD]))
            continue
        if sig in out.setdefault(group, {}):
            raise PrecompiledError("two precompiled entries for one group and signature")
        out[group][sig] = (section[off:off + n], modes, _sources(e.get(SOURCES_FIELD, [])))
    if end != len(section):
        raise PrecompiledError("the precompiled part has bytes no entry covers")
    return {k: v for k, v in out.items() if v}, aoti


def record_format(entries: list[dict[str, Any]]) -> int:
    """The record format a list of entries is written in (2 only with an AOTInductor one, 3
    only with one whose loader is not the package loader)."""
    if any(e.get(AOTI_LOADER_FIELD, AOTI_LOADERS[0]) != AOTI_LOADERS[0] for e in entries):
        return PRECOMPILED_FORMAT_AOTI_RUNNER
    aoti = any(e.get(KIND_FIELD) == AOTI_KIND for e in entries)
    return PRECOMPILED_FORMAT_AOTI if aoti else PRECOMPILED_FORMAT


def _ints(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and len(v) <= MAX_RANK and (n is None or len(v) == n) and all(
        type(x) is int and 0 <= x < 2**48 for x in v)


def _aoti_fields(e: Mapping[str, Any]) -> tuple[list[list[Any]], int]:
    """An AOTInductor entry's weights and input count, checked (see the module doc)."""
    if not all(k in e for k in AOTI_FIELDS):
        raise PrecompiledError(f"an AOTInductor entry lacks one of {', '.join(AOTI_FIELDS)}")
    consts, inputs = e["constants"], e["inputs"]
    if type(inputs) is not int or not 0 <= inputs <= MAX_ENTRIES:
        raise PrecompiledError("an AOTInductor entry's input count is not a small integer")
    if not isinstance(consts, list) or len(consts) > MAX_CONSTANTS:
        raise PrecompiledError(f"an AOTInductor entry's constants are not a list of at most "
                               f"{MAX_CONSTANTS}")
    seen = set()
    for c in consts:
        ok = isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and \
            0 < len(c[0]) <= 400 and c[0].isprintable() and c[0] not in seen and \
            isinstance(c[1], list) and len(c[1]) == 4 and _ints(c[1][0]) and \
            _ints(c[1][1], len(c[1][0])) and c[1][2] in WEIGHT_DTYPES and \
            c[1][3] in WEIGHT_DEVICES
        if not ok:
            raise PrecompiledError("an AOTInductor entry's constant is not [fqn, [shape, "
                                   "strides, dtype, device]]")
        seen.add(c[0])
    return consts, inputs


def _sources(spans: Any) -> tuple[tuple[Any, ...], ...]:
    """An entry's inlined source spans, checked: [module, first, last, "sha256:<64 hex>"]."""
    if not isinstance(spans, list) or len(spans) > MAX_SOURCES:
        raise PrecompiledError(f"a precompiled entry's sources are not a list of at most "
                               f"{MAX_SOURCES} spans")
    out = []
    for sp in spans:
        ok = isinstance(sp, list) and len(sp) == 4 and isinstance(sp[0], str) and \
            0 < len(sp[0]) <= 200 and sp[0].isprintable() and \
            type(sp[1]) is int and type(sp[2]) is int and 1 <= sp[1] <= sp[2] <= 10**7 and \
            isinstance(sp[3], str) and sp[3].startswith(_DIGEST) and \
            len(sp[3]) == len(_DIGEST) + 64 and \
            all(c in "0123456789abcdef" for c in sp[3][len(_DIGEST):])
        if not ok:
            raise PrecompiledError("a precompiled entry's source span is not [module, first "
                                   "line, last line, sha256 digest]")
        out.append(tuple(sp))
    return tuple(out)


def _modes_ok(modes: Any) -> bool:
    if not isinstance(modes, dict) or set(modes) != {"grad", "inference", "autocast"}:
        return False
    cast = modes["autocast"]
    return type(modes["grad"]) is bool and type(modes["inference"]) is bool and \
        isinstance(cast, list) and len(cast) <= len(AUTOCAST_DEVICES) and all(
            isinstance(c, list) and len(c) == 2 and c[0] in AUTOCAST_DEVICES
            and c[1] in AUTOCAST_DTYPES for c in cast)


def count_entries(meta: Mapping[str, Any]) -> int:
    """How many precompiled artifacts a verified bundle's record lists (0 for format 2)."""
    record = meta.get(PRECOMPILED_KEY)
    entries = record.get("entries") if isinstance(record, dict) else None
    return len(entries) if isinstance(entries, list) else 0
