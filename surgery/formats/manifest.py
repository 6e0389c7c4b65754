"""The manifest: dataclasses, TOML read/write, schema validation and the fingerprint.

Reading needs only tomllib (tomli below Python 3.11) and jsonschema, so the deployment path does
not need tomli-w or click; writing imports tomli-w when it is called.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from surgery.errors import ManifestError
from surgery.formats.allowlist import manifest_refusals
from surgery.formats.limits import NotRegularFile, limit, printable, raise_hint, read_regular
from surgery.formats.manifest_bulk import MAX_MANIFEST_BYTES, check_bulk, duplicate_across_regions
from surgery.formats.safe_write import write_text_atomic
from surgery.formats.toml_scan import TomlProblem, scan_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python < 3.11
    import tomli as tomllib

SCHEMA_VERSION = 1
SCHEMA_NAME = "manifest.schema.json"
MANIFEST_SUFFIX = ".surgery.toml"

# Defaults follow the measurements (DESIGN.md, benchmarks/RESULTS.md): on a launch-bound streaming
# model, regional compile without CUDA graphs ran slower than eager (31 ms vs 17.5 ms), and with
# inductor's cudagraph trees each of LingBot-Map's 120 region calls a frame cost 80-140 us of host
# time in dynamo and tree bookkeeping. So surgery captures the graphs itself, one per region path
# (capture = "region", surgery.runtime.graphs.replay), and replays them without entering dynamo.
# Outputs a KV cache keeps are cloned outside the graph so the next replay cannot overwrite them
# (#152887).
DEFAULT_COMPILE: dict[str, Any] = {
    "backend": "inductor",
    "capture": "region",
    "fullgraph": True,
    "dynamic": False,
    "emulate_precision_casts": True,
    "clone_outputs": True,
    "on_cpu": "eager",
}
# A region of this kind is a streaming block compiled piecewise (surgery.runtime.piecewise); its
# `piecewise` table may name split ops from this list only, and where its cache is.
PIECEWISE_KIND = "piecewise"
PIECEWISE_SPLIT_OPS: tuple[str, ...] = (
    "scaled_dot_product_attention", "cat", "stack", "index_select", "index_copy",
    "index_copy_", "index_put", "index_put_", "gather", "scatter", "narrow",
)
PIECEWISE_DEFAULT_SPLIT_OPS: tuple[str, ...] = ("scaled_dot_product_attention",)
# Key of a piecewise table: the region stands by for these piecewise regions (a decoder stack
# whose blocks it is) and runs only when they run eager (surgery.runtime.piecewise_stack).
PIECEWISE_FALLBACK_FOR = "fallback_for"
# Every key a piecewise table may hold.
PIECEWISE_KEYS: tuple[str, ...] = ("split_ops", "dynamic", PIECEWISE_FALLBACK_FOR)
# LingBot-Map's recipe: warm-up passes each opened with cudagraph_mark_step_begin().
DEFAULT_WARMUP: dict[str, Any] = {"passes": 3, "mark_step": True}


@dataclass
class Region:
    """One compile region: a kind and the explicit dotted path of every compiled callable."""

    kind: str
    paths: list[str]
    callable: str = "forward"  # "forward" | "method"
    required: bool = True
    on_failure: str = "eager"  # "eager" | "error"
    module_class: str | None = None
    parameters: int | None = None
    compile: dict[str, Any] = field(default_factory=dict)  # per-region overrides
    # What a run showed (plan --input): observed signatures, calls a step, share of step time.
    evidence: dict[str, Any] | None = None
    # kind = "piecewise": where the block splits and what grows (surgery.runtime.piecewise):
    # {"split_ops": [...], "dynamic": ["past_key_values:2", "self.attn.kv_cache"]}, and for the
    # blocks of a piecewise decoder stack "fallback_for": ["transformer"] (its path).
    piecewise: dict[str, Any] | None = None
    # plan --input: its signatures differ only in sizes, in these argument dims; it compiles once
    # with dynamic shapes, and its recorded signatures show `*` there.
    dynamic: bool = False
    dynamic_dims: dict[str, list[int]] = field(default_factory=dict)
    # Regions of one function and weight layout share compiled code unless their groups differ
    # (plan --input names one when it splits such paths by signature to keep each in budget).
    group: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "callable": self.callable,
                             "required": self.required, "on_failure": self.on_failure}
        if self.module_class is not None:
            d["class"] = self.module_class
        if self.parameters is not None:
            d["parameters"] = self.parameters
        if self.compile:
            d["compile"] = dict(self.compile)
        if self.dynamic:
            d["dynamic"] = True
            d["dynamic_dims"] = {k: list(v) for k, v in self.dynamic_dims.items()}
        if self.group is not None:
            d["group"] = self.group
        d["paths"] = list(self.paths)
        if self.evidence is not None:
            d["evidence"] = dict(self.evidence)
        if self.piecewise is not None:
            d["piecewise"] = {k: list(v) for k, v in self.piecewise.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Region:
        return cls(kind=d["kind"], paths=list(d["paths"]), callable=d.get("callable", "forward"),
                   required=d.get("required", True), on_failure=d.get("on_failure", "eager"),
                   module_class=d.get("class"), parameters=d.get("parameters"),
                   compile=dict(d.get("compile", {})),
                   evidence=dict(d["evidence"]) if "evidence" in d else None,
                   piecewise=dict(d["piecewise"]) if "piecewise" in d else None,
                   dynamic=bool(d.get("dynamic", False)),
                   dynamic_dims={k: list(v) for k, v in d.get("dynamic_dims", {}).items()},
                   group=d.get("group"))


@dataclass
class LeftOut:
    """A candidate the plan did not make a region, and why."""

    path: str
    kind: str
    reason: str


@dataclass
class Manifest:
    fingerprint: str
    regions: list[Region]
    compile: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_COMPILE))
    warmup: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_WARMUP))
    left_out: list[LeftOut] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)  # source, prefix, class, counts
    schema_version: int = SCHEMA_VERSION
    # plan --input: how the run was made and the share of its eager step time inside regions.
    coverage: dict[str, Any] | None = None
    source_path: str | None = None  # where it was read from, if anywhere (not serialised)

    def to_dict(self) -> dict[str, Any]:
        model = {k: v for k, v in self.model.items() if v is not None and k != "fingerprint"}
        d: dict[str, Any] = {
            "schema_version": self.schema_version,
            "model": {"fingerprint": self.fingerprint, **model},
            "compile": dict(self.compile),
            "warmup": dict(self.warmup),
            "region": [r.to_dict() for r in self.regions],
        }
        if self.left_out:
            d["left_out"] = [vars(lo).copy() for lo in self.left_out]
        if self.coverage is not None:
            d["coverage"] = dict(self.coverage)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        model = dict(d["model"])
        return cls(
            fingerprint=model.pop("fingerprint"),
            regions=[Region.from_dict(r) for r in d["region"]],
            compile=dict(d.get("compile", {})),
            warmup=dict(d.get("warmup", {})),
            left_out=[LeftOut(**lo) for lo in d.get("left_out", [])],
            model=model,
            schema_version=d["schema_version"],
            coverage=dict(d["coverage"]) if "coverage" in d else None,
        )

    def region_compile(self, region: Region) -> dict[str, Any]:
        """The compile settings of one region: the defaults with its overrides on top."""
        return {**self.compile, **region.compile}


# --- fingerprint -------------------------------------------------------------------------------


# --- schema ------------------------------------------------------------------------------------

def schema_path() -> Path:
    """The shipped schema. A wheel maps it into the package; an editable install does not, so the
    repository's top-level ``schemas/`` is the fallback."""
    here = Path(__file__).resolve().parents[1]  # the surgery package (formats/ is below it)
    for candidate in (here / "schemas" / SCHEMA_NAME, here.parent / "schemas" / SCHEMA_NAME):
        if candidate.is_file():
            return candidate
    raise ManifestError(f"the manifest schema {SCHEMA_NAME} is missing from the installation",
                        hint="reinstall surgery (pip install --force-reinstall surgery)")


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    with open(schema_path(), encoding="utf-8") as f:
        schema: dict[str, Any] = json.load(f)
    return schema


def format_location(parts: Any) -> str:
    """['region', 2, 'paths', 0] -> 'region[2].paths[0]' (how TOML users name it)."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def validate(data: Mapping[str, Any], *, path: str | None = None, text: str | None = None) -> None:
    """Validate a manifest's data against the schema, and the rules the schema cannot say.

    Errors name the TOML location of the problem, and its line when the text is known.
    """
    import jsonschema

    # The long lists (paths, left_out) are checked here in linear time; jsonschema sees a view
    # with one item of each, since it costs ~100 us an item (surgery.formats.manifest_bulk).
    problem, view, left_offset = check_bulk(data)
    if problem is not None:
        _raise(f"{problem.location}: {problem.message}", path=path, location=problem.location,
               text=text, hint=problem.hint)
    # Compile settings first: a setting outside the allowlist is refused with why (a manifest
    # is data, surgery.formats.allowlist), not with the schema's "additional properties" wording.
    refused = manifest_refusals(data, schema=load_schema())
    if refused:
        first = refused[0]
        _raise(first.message, path=path, location=first.location, text=text,
               more=len(refused) - 1, hint=first.hint)
    validator = jsonschema.Draft202012Validator(load_schema())
    # iter_errors is lazy: keep at most SURGERY_MAX_ERRORS of them (an array of a million bad
    # items kept every error, 2.2 GB from 600 KB), and report the best of those.
    cap = limit("ERRORS")
    errors = sorted(itertools.islice(validator.iter_errors(view), cap),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        e = jsonschema.exceptions.best_match(errors) or errors[0]
        parts = list(e.absolute_path)
        if parts[:1] == ["left_out"] and len(parts) > 1:
            parts[1] += left_offset  # the view holds one left_out entry: name it as in the file
        loc = format_location(parts)
        # The next problems too, up to two: "(and 1 more problem(s))" alone hid a misspelt
        # [compil] table behind "'compile' is a required property".
        others = [f"{format_location(list(x.absolute_path))}: {x.message}"
                  for x in errors if x is not e][:2]
        _raise(f"{loc}: {e.message}", path=path, location=loc, text=text,
               more=len(errors) - 1, at_least=len(errors) == cap, others=others)
    dup = duplicate_across_regions(data.get("region", []))
    if dup is not None:
        _raise(f"{dup.location}: {dup.message}", path=path, location=dup.location, text=text,
               hint=dup.hint)
    for i, region in enumerate(data.get("region", [])):
        comp = {**data.get("compile", {}), **region.get("compile", {})}
        if ("mode" in region.get("compile", {}) and "options" in comp) or \
                ("options" in region.get("compile", {}) and "mode" in comp):
            loc = f"region[{i}].compile"
            _raise(f"{loc}: sets both 'mode' and 'options', which torch.compile refuses",
                   path=path, location=loc, text=text,
                   hint="keep one: mode='reduce-overhead' is options={'triton.cudagraphs': true}")
    comp = data.get("compile", {})
    if "mode" in comp and "options" in comp:
        _raise("compile: sets both 'mode' and 'options', which torch.compile refuses",
               path=path, location="compile", text=text,
               hint="keep one: mode='reduce-overhead' is options={'triton.cudagraphs': true}")


def _raise(msg: str, *, path: str | None, location: str, text: str | None, more: int = 0,
           hint: str | None = None, at_least: bool = False, others: Sequence[str] = ()) -> None:
    line = _line_of(text, location) if text else None
    where = f"{path or 'manifest'}" + (f":{line}" if line else "")
    rest = more - len(others)
    extra = "".join(f"; also {printable(o)}" for o in others) + (
        f" (and {'at least ' if at_least else ''}{rest} more problem(s))" if rest > 0 else "")
    msg = printable(msg)  # a schema message quotes the value: one line, cut
    raise ManifestError(f"{where}: {msg}{extra}", path=path, location=location,
                        hint=hint or "edit the manifest, or plan it again with `surgery plan`")


def _line_of(text: str, location: str) -> int | None:
    """Best-effort 1-based line of a location such as ``region[2].paths[0]`` in tomli-w layout."""
    tokens: list[str | int] = [int(i) if i else n for n, i in
                               re.findall(r"([A-Za-z_][A-Za-z_0-9]*)|\[(\d+)\]", location)]
    lines = text.splitlines()
    lo, hi = 0, len(lines)
    if not tokens or not isinstance(tokens[0], str):
        return None
    name = tokens.pop(0)
    if tokens and isinstance(tokens[0], int):  # an array of tables: [[name]] number n
        n = tokens.pop(0)
        headers = [i for i, ln in enumerate(lines) if ln.strip() == f"[[{name}]]"]
        if n >= len(headers):
            return None
        lo = headers[n]
    else:
        header = next((i for i, ln in enumerate(lines) if ln.strip() == f"[{name}]"), None)
        if header is None:  # a top-level key
            tokens.insert(0, name)
        else:
            lo = header
    hi = next((i for i in range(lo + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    line = lo
    if tokens and isinstance(tokens[0], str):
        key = re.compile(rf"^\s*{re.escape(str(tokens.pop(0)))}\s*=")
        line = next((i for i in range(lo, hi) if key.match(lines[i])), lo)
        if tokens and isinstance(tokens[0], int) and lines[line].rstrip().endswith("["):
            line = min(line + 1 + tokens[0], hi - 1)
    return line + 1


# --- read / write ------------------------------------------------------------------------------

def parse_manifest(text: str, *, path: str | None = None) -> Manifest:
    """Parse and validate manifest TOML text.

    The text is untrusted (it may come from a downloaded checkpoint's metadata): it is bounded
    in size, and what tomllib cannot survive (nesting deep enough to exhaust the recursion
    limit, an integer past Python's digit limit) becomes a one-line ManifestError.
    """
    where = path or "manifest"
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(text)} characters, more than the "
                            f"{MAX_MANIFEST_BYTES} a manifest may hold", path=path,
                            hint="a manifest lists module paths; is this the right file?")
    try:
        scan_toml(text)  # linear; what tomllib would spend quadratic memory or time on
    except TomlProblem as e:
        raise ManifestError(f"{where}: refused before parsing: {e}", path=path,
                            hint=raise_hint(e.limit)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = " ".join(str(e).split())  # tomllib puts the location on the same line, keep one
        raise ManifestError(f"{where}: not valid TOML: {msg}", path=path,
                            hint="fix the TOML syntax at that line") from None
    except RecursionError:
        raise ManifestError(f"{where}: not a manifest: its arrays or tables nest too deeply "
                            "to read", path=path,
                            hint="a manifest nests at most a few levels; is this the right "
                            "file?") from None
    except ValueError as e:  # e.g. an integer with more digits than Python will parse
        raise ManifestError(f"{where}: not a manifest: {' '.join(str(e).split())[:160]}",
                            path=path, hint="fix the value, or plan the manifest again") from None
    validate(data, path=path, text=text)
    m = Manifest.from_dict(data)
    m.source_path = path
    return m


def read_manifest_file(path: str | os.PathLike[str]) -> str:
    """A manifest file's text: a regular file, read to its size (never past the bound)."""
    p = os.fspath(path)
    try:
        raw = read_regular(p, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(f"{p}: no such manifest", path=p,
                            hint="plan one with `surgery plan CHECKPOINT`") from None
    except NotRegularFile as e:
        raise ManifestError(f"{e}; a manifest is a file", path=p,
                            hint="give the path of a .surgery.toml file") from None
    except OverflowError as e:
        raise ManifestError(f"{p}: {e.args[0]} bytes, more than the {MAX_MANIFEST_BYTES} a "
                            "manifest may hold", path=p,
                            hint="a manifest lists module paths; is this the right file?") from None
    except OSError as e:
        raise ManifestError(f"{p}: cannot read: {e.strerror}", path=p) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{p}: not a text file (not UTF-8)", path=p,
                            hint="a manifest is TOML text written by `surgery plan`") from None


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a manifest file."""
    p = os.fspath(path)
    return parse_manifest(read_manifest_file(p), path=p)


def dumps_manifest(manifest: Manifest) -> str:
    """Validate, then render as TOML (tomli-w)."""
    import tomli_w

    data = manifest.to_dict()
    validate(data)
    header = ("# surgery manifest: compile regions of one model, bound to its checkpoint by the\n"
              "# fingerprint. Review and diff it like code; `surgery check` validates it.\n")
    return header + tomli_w.dumps(data)


def save_manifest(manifest: Manifest, path: str, *, force: bool = False) -> None:
    write_text_atomic(path, dumps_manifest(manifest), force=force)
