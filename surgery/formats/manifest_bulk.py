"""The long lists of a manifest, checked in linear time before the schema sees a sample of them.

jsonschema costs ~100-300 us per array item on this machine (each ``$ref`` is resolved
anew), so a manifest with 1e6 region paths took minutes to validate. The schema stays the
contract; this module applies its rules for the two lists that grow with the model (each
region's ``paths``, and ``left_out``) in plain Python, then hands jsonschema a view of the
manifest in which each such list is cut to one item, so the schema still checks everything
else (and the item kept) with its own messages.

Limits, far above any real plan (a plan groups a model's paths into one region per kind and
container, so even a 1M-tensor model has a few dozen regions):
- at most `MAX_REGIONS` regions; a manifest's text at most `MAX_MANIFEST_BYTES`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_MANIFEST_BYTES = 128 * 1024 * 1024
MAX_REGIONS = 10_000
# The schema's `dotted_path` ($defs), applied to the whole string (the schema's `$` would also
# accept one trailing newline, which no module path has).
_DOTTED_PATH = re.compile(r"[A-Za-z_0-9]+(?:\.[A-Za-z_0-9]+)*")
# The same, over paths joined by newlines: one C call checks a whole list.
_DOTTED_LINES = re.compile(r"[A-Za-z_0-9]+(?:[.\n][A-Za-z_0-9]+)*")
_LEFT_OUT_FIELDS = frozenset({"path", "kind", "reason"})


@dataclass(frozen=True)
class BulkProblem:
    """One rule broken in a long list: where (TOML location), what, and the fix."""

    location: str
    message: str
    hint: str | None = None


def _check_paths(i: int, paths: list[Any]) -> BulkProblem | None:
    """The schema's rules for one region's paths: strings, dotted paths, each listed once.

    The common case (all fine) runs in C: one type scan, one regex over the joined paths, one
    set. Only a failure walks the list in Python, to name the first bad item.
    """
    if set(map(type, paths)) <= {str}:
        joined = "\n".join(paths)
        if joined.count("\n") == len(paths) - 1 and _DOTTED_LINES.fullmatch(joined) \
                and len(set(paths)) == len(paths):
            return None
    seen: set[str] = set()
    for j, p in enumerate(paths):
        if not isinstance(p, str):
            return BulkProblem(f"region[{i}].paths[{j}]", f"{p!r:.80} is not of type 'string'")
        if not _DOTTED_PATH.fullmatch(p):
            return BulkProblem(f"region[{i}].paths[{j}]", f"{p!r:.120} is not a dotted module "
                               "path (letters, digits and _ separated by dots)")
        if p in seen:
            return BulkProblem(f"region[{i}].paths", f"path {p!r:.120} is listed twice",
                               hint="list each compiled callable once")
        seen.add(p)
    return None


def duplicate_across_regions(regions: list[Mapping[str, Any]]) -> BulkProblem | None:
    """A path listed in two regions (checked after the schema, so each `paths` is valid)."""
    every = [p for region in regions for p in region["paths"]]
    if len(set(every)) == len(every):
        return None
    seen: dict[str, str] = {}
    for i, region in enumerate(regions):
        for j, p in enumerate(region["paths"]):
            loc = f"region[{i}].paths[{j}]"
            if p in seen:
                return BulkProblem(loc, f"path {p!r} is already listed at {seen[p]}",
                                   hint="list each compiled callable once")
            seen[p] = loc
    return None


def _left_out_ok(lo: Any) -> bool:
    return isinstance(lo, Mapping) and lo.keys() == _LEFT_OUT_FIELDS and \
        all(isinstance(v, str) for v in lo.values())


def check_bulk(data: Mapping[str, Any]) -> tuple[BulkProblem | None, dict[str, Any], int]:
    """(problem or None, the view jsonschema validates, left_out index its sample came from).

    The view shares everything with `data` except the long lists, which it cuts to one item:
    the first, or for ``left_out`` the first that breaks the schema, so the schema's message
    names it (the caller maps its index back with the returned offset).
    """
    view = dict(data)
    regions = data.get("region")
    if isinstance(regions, list):
        if len(regions) > MAX_REGIONS:
            return BulkProblem("region", f"{len(regions)} regions, more than the {MAX_REGIONS} "
                               "a manifest may hold",
                               hint="a plan makes one region per kind of block; merge regions "
                               "of one kind into one list of paths"), view, 0
        cut = []
        for i, region in enumerate(regions):
            if isinstance(region, Mapping) and isinstance(region.get("paths"), list):
                problem = _check_paths(i, region["paths"])
                if problem is not None:
                    return problem, view, 0
                region = {**region, "paths": region["paths"][:1]}
            cut.append(region)
        view["region"] = cut
    left = data.get("left_out")
    offset = 0
    if isinstance(left, list) and left:
        offset = next((i for i, lo in enumerate(left) if not _left_out_ok(lo)), 0)
        view["left_out"] = left[offset:offset + 1]
    return None, view, offset
