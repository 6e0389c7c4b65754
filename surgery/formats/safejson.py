"""JSON from files we did not write: bounded in size and depth, strict in what it accepts.

A safetensors header, a sharded index and the JSON inside safetensors metadata all come from
checkpoints downloaded from elsewhere. Python's ``json`` module is the wrong judge of them:

- 100k nested brackets raise ``RecursionError`` from deep inside the parser;
- ``NaN``, ``Infinity`` and ``-Infinity`` are accepted, although they are not JSON;
- a 5000-digit number raises a bare ``ValueError`` (Python's int-parsing limit);
- a duplicate key silently keeps the last value, so two readers of one file can disagree
  about what it says (safetensors' own parser refuses such a header).

`load_untrusted_json` checks the size first, then the nesting depth without recursion (strings
are blanked out, then innermost bracket pairs are removed one level a pass, all in C string
and regex code, so the cost is linear in the size times the small depth limit), and only then
parses,
refusing the constants on the way and counting object members against the colons written
to find duplicate keys. Every refusal is an `UntrustedJSONError`
whose message is one line; callers wrap it in the SurgeryError that names their file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

# A JSON string: a quote, then runs of plain characters or backslash escapes, then a quote.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")
# Deletes every ASCII character but the four brackets (str.translate is ~20x faster than a
# regex here); the few non-ASCII characters left outside strings go through _NOT_BRACKET.
_DROP_ASCII_NON_BRACKETS = str.maketrans("", "", "".join(chr(c) for c in range(128)
                                                         if chr(c) not in "[]{}"))


class UntrustedJSONError(ValueError):
    """JSON that is refused before or while parsing; the message is one line."""


def _outside_strings(text: str) -> str:
    """`text` with every string's contents removed, so only JSON's own punctuation is left."""
    if "\\" in text:  # escapes: a quote may sit inside a string, so match strings exactly
        return _STRING.sub('""', text)
    return "".join(text.split('"')[::2])  # no escapes: strings are the odd pieces (C speed)


def check_depth(text: str, *, max_depth: int, outside: str | None = None) -> None:
    """Refuse `text` if its brackets nest deeper than `max_depth`, without recursing.

    Brackets that do not balance count as too deep; the parser would refuse them anyway.
    `outside` is `_outside_strings(text)` when the caller has it already.
    """
    if outside is None:
        outside = _outside_strings(text)
    skeleton = _NOT_BRACKET.sub("", outside.translate(_DROP_ASCII_NON_BRACKETS))
    for _ in range(max_depth):
        if not skeleton:
            return
        shorter = _INNERMOST.sub("", skeleton)
        if shorter == skeleton:
            break  # nothing left to remove: the brackets do not balance
        skeleton = shorter
    if skeleton:
        raise UntrustedJSONError(f"it nests brackets more than {max_depth} deep, or they do "
                                 "not balance")


def _count_keys(obj: Any) -> int:
    """Members of every object in a parsed document (its depth is already bounded)."""
    items: Iterable[Any]
    if type(obj) is dict:
        n, items = len(obj), obj.values()
    elif type(obj) is list:
        n, items = 0, obj
    else:
        return 0
    for v in items:
        if type(v) is dict or type(v) is list:
            n += _count_keys(v)
    return n


def _refuse_constant(name: str) -> Any:
    raise UntrustedJSONError(f"it holds {name}, which is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UntrustedJSONError(f"it holds the number {text[:40]}, which is too large")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise UntrustedJSONError(f"key {key[:80]!r} appears twice in one object")
            seen.add(key)
    return out


def load_untrusted_json(raw: bytes | str, *, max_bytes: int, max_depth: int) -> Any:
    """Parse JSON from an untrusted file, refusing what a strict reader refuses.

    `max_bytes` and `max_depth` are the caller's limits, chosen far above anything legitimate.
    """
    if len(raw) > max_bytes:
        raise UntrustedJSONError(f"it is {len(raw)} bytes, more than the {max_bytes} allowed")
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UntrustedJSONError(f"it is not UTF-8 (byte {e.start})") from None
    else:
        text = raw
    outside = _outside_strings(text)
    check_depth(text, max_depth=max_depth, outside=outside)
    try:
        doc = json.loads(text, parse_constant=_refuse_constant, parse_float=_float)
        # Each member of an object has exactly one ':' outside strings. Fewer members parsed
        # than colons written means a key appeared twice and json kept only its last value.
        # (Counting is ~10x cheaper than an object_pairs_hook on every object; the hook runs
        # only to name the duplicate.)
        if _count_keys(doc) != outside.count(":"):
            json.loads(text, object_pairs_hook=_object, parse_constant=_refuse_constant,
                       parse_float=_float)
            raise UntrustedJSONError("a key appears twice in one object")
        return doc
    except UntrustedJSONError:
        raise
    except json.JSONDecodeError as e:
        raise UntrustedJSONError(f"it is not valid JSON ({e.msg} at line {e.lineno} column "
                                 f"{e.colno})") from None
    except ValueError:  # Python's limit on the digits of an int (sys.get_int_max_str_digits)
        raise UntrustedJSONError("it holds a number with too many digits") from None
    except RecursionError:  # defence in depth: check_depth already bounds the nesting
        raise UntrustedJSONError("it nests too deeply") from None
