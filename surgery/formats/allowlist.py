"""What a manifest may set: compile settings are data picked from a fixed list, never code.

A manifest arrives from elsewhere (a hub, the header of an exported ``.safetensors``), so no
value in it may reach a command line, a config string or pickle. Inductor's config holds such
strings: the ``cpp.*`` flags are split with shlex into the C++ compiler's command line, so one
string value in a manifest ran a shell command in every compile (issue 10).

The schema (``schemas/manifest.schema.json``, ``$defs/compile``) is the one list: each compile
key and each inductor option a manifest may carry, with its type (a boolean, or a value from a
small enum; ``backend`` from a fixed set, not "any registered backend"). Everything else is
refused here, naming its location and the fix, before the general schema check runs, so the
message says *why* rather than "additional properties are not allowed".

What is not checked here: ``apply_manifest(..., overrides=...)``. Overrides come from the
deployer's code, which is trusted, and may pass any inductor option; the runtime still checks
that the option exists (surgery.runtime.compile_options).

To allow another setting, add it, typed, to the schema (a compile key also goes into
``surgery.runtime.compile_options.COMPILE_KEYS``); a test keeps the two in step.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A hostile value may be megabytes long; messages quote only its start.
_QUOTE = 60
# A key shown bare in a location; any other (a newline, a megabyte) is shown quoted and cut.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,60}")


@dataclass(frozen=True)
class Refusal:
    """One setting a manifest may not carry: where (TOML location), why, and the fix."""

    location: str
    message: str
    hint: str


def compile_specs(schema: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The schema of each compile key a manifest may set (``options`` included)."""
    return dict(schema["$defs"]["compile"]["properties"])


def option_specs(schema: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The schema of each inductor option a manifest may set under ``options``."""
    return dict(compile_specs(schema)["options"].get("properties", {}))


def allowed_backends(schema: Mapping[str, Any]) -> tuple[str, ...]:
    """The compile backends anything (manifest or code) may name."""
    return tuple(compile_specs(schema)["backend"]["enum"])


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE else text[:_QUOTE] + "...(cut)"


def _at(location: str, key: Any) -> str:
    return f"{location}.{key}" if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) \
        else f"{location}[{_quote(key)}]"


# The schema keywords a compile setting's spec may use; a spec with another keyword refuses every
# value, so an unvetted construct never lets a value through (a test keeps the schema to these).
SPEC_KEYWORDS = frozenset({"type", "enum", "minimum", "maximum", "description"})
_TYPES: dict[str, tuple[type, ...]] = {"boolean": (bool,), "string": (str,), "integer": (int,),
                                       "number": (int, float)}


def _fits(spec: Mapping[str, Any], value: Any) -> bool:
    """Whether ``value`` fits one setting's spec: type, enum and bounds (no jsonschema, which is
    for whole documents; these specs are flat)."""
    if set(spec) - SPEC_KEYWORDS:
        return False
    if "enum" in spec and not any(type(value) is type(c) and value == c for c in spec["enum"]):
        return False
    kind = spec.get("type")
    if kind is not None:
        if kind not in _TYPES or not isinstance(value, _TYPES[kind]):
            return False
        if kind != "boolean" and isinstance(value, bool):
            return False  # True is an int to Python, not to a schema
    if "minimum" in spec and not (isinstance(value, (int, float)) and value >= spec["minimum"]):
        return False
    return "maximum" not in spec or (isinstance(value, (int, float))
                                     and value <= spec["maximum"])


def _expected(spec: Mapping[str, Any]) -> str:
    if "enum" in spec:
        return "one of " + ", ".join(_quote(v) for v in spec["enum"])
    kind = spec.get("type")
    return f"a {kind}" if kind else "the type the schema names"


def _near(name: str, names: list[str]) -> str:
    hits = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean {hits[0]!r}?" if hits else ""


def compile_refusals(table: Any, *, schema: Mapping[str, Any], location: str
                     ) -> list[Refusal]:
    """What in one ``[compile]`` table (the manifest's or a region's) a manifest may not set.

    A table that is not a mapping is left to the schema check, which says so.
    """
    if not isinstance(table, Mapping):
        return []
    out: list[Refusal] = []
    specs = compile_specs(schema)
    for key, value in table.items():
        loc = _at(location, key)
        spec = specs.get(key) if isinstance(key, str) else None
        if spec is None:
            out.append(Refusal(
                loc, f"{loc}: {_quote(key)} is not a compile setting a manifest may carry"
                + _near(str(key), sorted(specs)),
                f"use one of {sorted(specs)}"))
        elif key == "options":
            out.extend(_option_refusals(value, schema=schema, location=loc))
        elif not _fits(spec, value):
            out.append(Refusal(loc, f"{loc}: {_quote(value)} is not allowed; a manifest may "
                                    f"set {key} to {_expected(spec)}",
                               f"set {key} to {_expected(spec)}"))
    return out


def _option_refusals(options: Any, *, schema: Mapping[str, Any], location: str
                     ) -> list[Refusal]:
    if not isinstance(options, Mapping):
        return []  # the schema says "is not of type 'object'"
    out: list[Refusal] = []
    specs = option_specs(schema)
    for name, value in options.items():
        loc = _at(location, name)
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None:
            out.append(Refusal(
                loc, f"{loc}: inductor option {_quote(name)} may not be set by a manifest (a "
                     "manifest is data; it may set only the listed booleans and enums)"
                + _near(str(name), sorted(specs)),
                "remove it (schemas/manifest.schema.json lists the options a manifest may "
                "set); a deployment that needs it passes it from code: "
                "apply_manifest(model, manifest, overrides={'mode': None, "
                f"'options': {{{_quote(name)}: ...}}}})"))
        elif not _fits(spec, value):
            out.append(Refusal(loc, f"{loc}: {_quote(value)} is not allowed; inductor option "
                                    f"{name!r} takes {_expected(spec)} in a manifest",
                               f"set it to {_expected(spec)}"))
    return out


def manifest_refusals(data: Any, *, schema: Mapping[str, Any]) -> list[Refusal]:
    """Every compile table of a manifest's data (top level and each region's), checked."""
    if not isinstance(data, Mapping):
        return []
    out = compile_refusals(data.get("compile"), schema=schema, location="compile")
    regions = data.get("region")
    if isinstance(regions, list):
        for i, region in enumerate(regions):
            if isinstance(region, Mapping):
                out.extend(compile_refusals(region.get("compile"), schema=schema,
                                            location=f"region[{i}].compile"))
                out.extend(_method_refusals(region, index=i))
    return out


def _method_refusals(region: Mapping[str, Any], *, index: int) -> list[Refusal]:
    """A method region names code to compile and call in place: never a dunder
    (``__init__``, ``__setattr__``). That nn.Module's own API (``state_dict``, ``to``) is
    refused too needs torch and the live class: surgery.runtime.resolve checks it."""
    paths = region.get("paths")
    if region.get("callable") != "method" or not isinstance(paths, list):
        return []
    out: list[Refusal] = []
    for j, path in enumerate(paths):
        name = path.rsplit(".", 1)[-1] if isinstance(path, str) else ""
        if name.startswith("__") and name.endswith("__"):
            loc = f"region[{index}].paths[{j}]"
            out.append(Refusal(loc, f"{loc}: {_quote(path)} names the special method {name!r}; "
                                    "a method region must be a plain method of the model's "
                                    "own class", "name a method the model's class defines "
                                                 "(e.g. attn_pre), or compile the module with "
                                                 'callable = "forward"'))
    return out
