"""The rules of a safetensors header, checked the way safetensors itself checks them.

A header that safetensors would refuse must not be planned, verified or exported here: a plan
made from it binds a manifest to a file nobody can load, and an export copies its byte ranges
into a new file. The rules (the format's spec and the reference loader, safetensors 0.8):

- the file starts with a little-endian u64 N, then N bytes of UTF-8 JSON (at most 100 MB),
  then the data region;
- the JSON is an object; each key names a tensor whose value holds ``dtype`` (one of a fixed
  list, case-sensitive), ``shape`` (a list of non-negative integers: not floats, not booleans)
  and ``data_offsets`` (two non-negative integers, relative to the data region);
- ``__metadata__``, if present, is null or an object of string -> string;
- sorted by offset, the tensors tile the data region exactly: each starts where the previous one
  ended (no overlap, no gap), each spans its element count times its dtype's size, and the last
  ends where the file ends.

Two more rules come from reading JSON safely: a key may appear only once in an object (the
loader would otherwise keep one value and this reader another), and nesting and numbers are
bounded (surgery.formats.safejson). Every refusal is a `HeaderProblem` with a one-line reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from surgery.formats.safejson import UntrustedJSONError, load_untrusted_json

# The format caps a header at 100 MB; a garbage file reads as an absurd length.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A header is at most 3 deep (object, tensor entry, shape list); unknown extra fields of an
# entry are tolerated by safetensors, so allow a little more than that, but never recursion.
MAX_HEADER_DEPTH = 16
METADATA_KEY = "__metadata__"
# Bits per element of every dtype safetensors 0.8 accepts (F4 and F6 pack below a byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}
# safetensors holds sizes and offsets in usize: anything at or above 2**64 overflows there.
_USIZE_LIMIT = 1 << 64


class HeaderProblem(ValueError):
    """Why a header is refused, in one line."""


@dataclass(frozen=True)
class ParsedHeader:
    """A header that passed every rule. Offsets are relative to the data region."""

    entries: list[tuple[int, int, str, tuple[int, ...], str]]  # (start, end, name, shape, dtype)
    metadata: dict[str, str]
    data_end: int  # where the last tensor ends, relative to the data region


def _is_uint(v: object) -> bool:
    return type(v) is int and 0 <= v < _USIZE_LIMIT


def _name(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:77] + "...")


def _numel(shape: list[int]) -> int:
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n >= _USIZE_LIMIT:
            raise OverflowError
    return n


def _metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HeaderProblem(f"{METADATA_KEY} is a {type(value).__name__}, not an object of "
                            "strings")
    if "dtype" in value or "data_offsets" in value:
        raise HeaderProblem(f"a tensor is named {METADATA_KEY!r}, which the format reserves "
                            "for metadata")
    for k, v in value.items():
        if not isinstance(v, str):
            raise HeaderProblem(f"{METADATA_KEY} value {_name(k)} is a {type(v).__name__}, "
                                "not a string")
    return value


def _entry(name: str, info: object) -> tuple[tuple[int, ...], str, tuple[int, int], int]:
    """(shape, dtype, offsets, byte size) of one tensor entry, or a HeaderProblem."""
    if not isinstance(info, dict):
        raise HeaderProblem(f"entry {_name(name)} is a {type(info).__name__}, not an object")
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in info]
    if missing:
        raise HeaderProblem(f"entry {_name(name)} has no {missing[0]!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        shown = repr(dtype)[:40] if isinstance(dtype, str) else type(dtype).__name__
        raise HeaderProblem(f"entry {_name(name)} has unknown dtype {shown} (safetensors knows "
                            f"{', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        bad = next((d for d in shape if not _is_uint(d)), None) if isinstance(shape, list) \
            else shape
        raise HeaderProblem(f"entry {_name(name)} has shape dimension {repr(bad)[:40]}; "
                            "dimensions are non-negative integers below 2**64")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))
            and offsets[0] <= offsets[1]):
        raise HeaderProblem(f"entry {_name(name)} has data_offsets {repr(offsets)[:60]}; they "
                            "are [start, end], two non-negative integers with start <= end")
    try:
        bits = _numel(shape) * DTYPE_BITS[dtype]
    except OverflowError:
        raise HeaderProblem(f"entry {_name(name)}: shape {shape!r:.60} overflows the size "
                            "safetensors can address") from None
    if bits % 8:
        raise HeaderProblem(f"entry {_name(name)}: {dtype} of shape {shape} does not end on a "
                            "byte boundary")
    start, end = offsets
    if end - start != bits // 8:
        raise HeaderProblem(f"entry {_name(name)}: data_offsets span {end - start} bytes but "
                            f"{dtype} of shape {shape} needs {bits // 8}")
    return tuple(shape), dtype, (start, end), bits // 8


def parse_header(raw: bytes, *, data_size: int) -> ParsedHeader:
    """Check a safetensors header's JSON against the format's rules.

    `data_size` is the size of the data region (file size - 8 - len(raw)): the tensors must
    tile it exactly, as safetensors requires.
    """
    stripped = raw.lstrip(b" \t\r\n")
    if not stripped.startswith(b"{"):
        raise HeaderProblem("header does not start with '{'")
    try:
        header = load_untrusted_json(raw, max_bytes=MAX_HEADER_BYTES, max_depth=MAX_HEADER_DEPTH)
    except UntrustedJSONError as e:
        raise HeaderProblem(f"header: {e}") from None
    if not isinstance(header, dict):
        raise HeaderProblem(f"header is a JSON {type(header).__name__}, not an object")
    metadata = _metadata(header.pop(METADATA_KEY, None))
    entries: list[tuple[int, int, str, tuple[int, ...], str]] = []
    for name, info in header.items():
        # The common, valid entry is checked inline (a function call per tensor costs more
        # than the checks); anything unusual goes through _entry, which names the problem.
        try:
            dtype, shape, span = info["dtype"], info["shape"], info["data_offsets"]
            bits = DTYPE_BITS[dtype] if type(dtype) is str else 0
            n = 1
            for d in shape:
                if type(d) is not int or d < 0 or n >= _USIZE_LIMIT:
                    n = -1  # not a plain valid shape (or overflowing): _entry says which
                    break
                n *= d
            start, end = span
            ok = (type(info) is dict and bits > 0 and bits % 8 == 0 and 0 <= n < _USIZE_LIMIT
                  and type(shape) is list and type(span) is list and type(start) is int
                  and type(end) is int and start >= 0 and end - start == n * bits // 8
                  and end < _USIZE_LIMIT)
        except (KeyError, TypeError, ValueError):
            ok = False
        if ok:
            entries.append((start, end, name, tuple(shape), dtype))
        else:
            shape_t, dtype, (start, end), _ = _entry(name, info)
            entries.append((start, end, name, shape_t, dtype))
    for _, _, name, _, _ in entries:
        if not name.isascii():  # JSON can escape a lone surrogate, which is not UTF-8
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise HeaderProblem(f"entry {_name(name)} is not valid Unicode (a lone "
                                    "surrogate); safetensors refuses it") from None
    entries.sort()  # by offset (a name breaks ties between zero-size tensors)
    end = _check_tiling(entries, data_size=data_size)
    return ParsedHeader(entries, metadata, end)


def _check_tiling(entries: list[tuple[int, int, str, tuple[int, ...], str]], *,
                  data_size: int) -> int:
    """Sorted by offset, each tensor starts where the previous ended; the last ends the file."""
    end = 0
    for start, stop, name, _, _ in entries:
        if start != end:
            what = "overlaps the tensor before it" if start < end else \
                f"leaves a gap of {start - end} bytes before it"
            raise HeaderProblem(f"entry {_name(name)} starts at byte {start}, which {what}; "
                                "tensors must be laid out back to back")
        end = stop
    if end > data_size:
        raise Truncated(end, data_size)
    if end < data_size:
        raise HeaderProblem(f"the tensors end at data byte {end} but the file holds "
                            f"{data_size}: {data_size - end} bytes no tensor covers")
    return end


class Truncated(HeaderProblem):
    """The header promises more data than the file holds: the copy was cut short."""

    def __init__(self, end: int, data_size: int) -> None:
        super().__init__(f"the header promises {end} bytes of data, the file holds {data_size}")
        self.end = end
        self.data_size = data_size
