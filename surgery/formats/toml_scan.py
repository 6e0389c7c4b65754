"""A linear-time scan of manifest TOML text, before tomllib sees it.

tomllib is not bounded by its input in two places, both reached from a few KB of text:

- a dotted key ``a.a.a...a = 1`` makes it keep every prefix of the key (each prefix a tuple of
  the parts before it), so memory grows with the square of the key's length: 20 KB took
  418 MB, 200 KB was killed at 24 GB;
- a table header ``[a.a.a...]`` costs time that grows with the square of its length (200 KB
  took 22 s).

The same text reaches tomllib from a manifest file and from the manifest embedded in an
exported ``.safetensors`` (`check`, `verify --manifest`, `load_exported`, `apply_manifest`).
Real manifests need little of TOML's freedom: their deepest key is ``region.compile.options``
(3 parts) and their longest key an option name of ~40 characters; module paths are *values*
(quoted strings), never keys.

So `scan_toml` first blanks every string and comment to ``""`` (one regex pass that tokenizes
TOML's four string forms and its comments the way TOML does, left to right, in C), and then, on
what is left, refuses:

- a run of more than ``SURGERY_MAX_TOML_KEY_PARTS`` dotted parts (a bare word, a number or a
  blanked quoted key, joined by ``.``): keys and headers, and, harmlessly, any value shaped
  like one (a float has two parts);
- a bare word longer than ``SURGERY_MAX_TOML_KEY_CHARS`` (a quoted key's length is its
  string's; its cost in tomllib is linear).

Both searches are regexes whose work per starting position is bounded by the limit, so the
scan is linear in the text: ~0.1 s for a 30 MB manifest of 1M paths on the 2-core CI machine.
A refusal is a `TomlProblem` whose message names the limit and its environment variable.
"""

from __future__ import annotations

import re
from functools import lru_cache

from surgery.formats.limits import env_var, limit

# TOML's strings and comments, in the order a TOML reader tries them at one position:
# multi-line basic and literal strings, then one-line basic and literal strings, then comments.
_STRINGS_AND_COMMENTS = re.compile(
    r'"""(?:[^"\\]|\\.|"(?!""))*"""'
    r"|'''.*?'''"
    r'|"(?:[^"\\\n]|\\.)*"'
    r"|'[^'\n]*'"
    r"|#[^\n]*",
    re.DOTALL)
_PART = r'(?:[A-Za-z0-9_-]+|"")'
_NOT_WORD = re.compile(r"[^A-Za-z0-9_-]+")


class TomlProblem(ValueError):
    """Why the text is refused before tomllib, in one line; `limit` names the bound."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.limit = name


@lru_cache(maxsize=8)
def _too_many_parts(parts: int) -> re.Pattern[str]:
    """A run of `parts` dots (`parts + 1` parts). The search starts only at a dot (found at C
    speed: a manifest's skeleton has few), and each start reads at most `parts` parts ahead."""
    return re.compile(rf"\.[ \t]*(?:{_PART}[ \t]*\.[ \t]*){{{parts - 1}}}{_PART}")


def blank_strings(text: str) -> str:
    """`text` with every string and comment replaced by ``""``: only TOML's structure is left.

    An unterminated string is left as it is: tomllib refuses the text for it. What tomli-w
    writes (basic strings without escapes, comments without quotes) is blanked by splitting at
    the quotes, 10x faster than the regex; anything else goes through the regex.
    """
    if "\\" not in text and "'" not in text and '"""' not in text:
        outside = text.split('"')[::2]
        if len(outside) * 2 - 1 == text.count('"') + 1:  # every string closed
            skeleton = '""'.join(outside)
            if "#" not in skeleton:
                return skeleton
            # A quote inside a comment pairs with the next quote and leaves the comment with
            # a blank string on its line: only then is the slow tokenizer needed.
            if _QUOTE_IN_COMMENT.search(skeleton) is None:
                return _COMMENT.sub('""', skeleton)
    return _STRINGS_AND_COMMENTS.sub('""', text)


_COMMENT = re.compile(r"#[^\n]*")
_QUOTE_IN_COMMENT = re.compile(r'#[^\n]*""')


def scan_toml(text: str) -> None:
    """Refuse TOML text whose keys are deeper or longer than the limits; linear time."""
    skeleton = blank_strings(text)
    parts = limit("TOML_KEY_PARTS")
    m = _too_many_parts(parts).search(skeleton)
    if m is not None:
        line = skeleton.count("\n", 0, m.start()) + 1
        run = m.group(0)
        shown = run[:40] + "..." if len(run) > 40 else run
        raise TomlProblem(f"line {line}: a dotted key of more than {parts} parts "
                          f"({shown!r}), beyond the limit of {parts} "
                          f"({env_var('TOML_KEY_PARTS')}); a manifest's deepest key has 3",
                          "TOML_KEY_PARTS")
    chars = limit("TOML_KEY_CHARS")
    longest = max(_NOT_WORD.split(skeleton), key=len)
    if len(longest) > chars:
        line = skeleton.count("\n", 0, skeleton.find(longest)) + 1
        raise TomlProblem(f"line {line}: a bare key or value of {len(longest)} characters "
                          f"({longest[:40]!r}...), beyond the limit of {chars} "
                          f"({env_var('TOML_KEY_CHARS')}); a manifest's longest key has ~40",
                          "TOML_KEY_CHARS")


def key_parts(text: str) -> int:
    """The most dotted parts of any run in `text` outside strings (for tests and benchmarks)."""
    runs = re.findall(rf"{_PART}(?:[ \t]*\.[ \t]*{_PART})*", blank_strings(text))
    return max((len(re.findall(_PART, r)) for r in runs), default=0)
