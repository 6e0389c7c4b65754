"""The package's layering, read from its import graph (ast only), so the layout cannot rot.

Layers, lowest first; a module imports only from its own layer or lower ones:

    surgery (the lazy API), surgery.errors
    surgery.formats          checkpoints, the writer, the manifest, keys and the fingerprint
    surgery.runtime.graphs   CUDA-graph capture and replay: nothing else from surgery
    surgery.runtime          apply_manifest, slots, resolve, compile options, report, the bundle
    surgery.planning         the model view, region finding, plan
    surgery.hygiene          verify and export
    surgery.cli              the only printer; surgery.examples, imported by nothing

Also: no import cycle (type-only imports count too), no import inside a function except a heavy
or optional dependency (torch, triton, numpy, safetensors' torch loader, jsonschema, tomli-w,
importlib.metadata) or
a surgery module that imports torch, from a module that does not (the CLI stays torch-free until
a command needs torch), and modules of 100 to 400 lines.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "surgery"

LAYERS = [
    ("surgery.errors", "surgery"),
    ("surgery.formats",),
    ("surgery.runtime.graphs",),
    ("surgery.runtime",),
    ("surgery.planning",),
    ("surgery.hygiene",),
    ("surgery.cli", "surgery.examples", "surgery.__main__"),
]
# Heavy or optional dependencies, and importlib.metadata (~70 ms: it imports the email package),
# which only a bundle check needs.
HEAVY = ("torch", "triton", "numpy", "safetensors.torch", "jsonschema", "tomli_w",
         "importlib.metadata")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = modules()


def layer(mod: str) -> int:
    best = (-1, -1)  # (length of the matching prefix, layer)
    for i, names in enumerate(LAYERS):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and len(n) > best[0]:
                best = (len(n), i)
    assert best[1] >= 0, f"{mod} is in no layer: add it to LAYERS"
    return best[1]


def _target(node: ast.ImportFrom | ast.Import) -> list[str]:
    """The surgery modules an import statement loads (``from pkg import mod`` names a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "surgery"]
    if node.level or not node.module or node.module.split(".")[0] != "surgery":
        return []
    out = [node.module]
    out += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
    return out


def imports(path: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module-level imports, imports inside functions) as (module, line), stdlib included."""
    tree = ast.parse(path.read_text())
    inner: list[tuple[str, int]] = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    inner += [(a.name, node.lineno) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    inner += [(m, node.lineno) for m in _target(node) or [node.module]]
    inner_lines = {ln for _, ln in inner}
    top: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if node.__class__ in (ast.Import, ast.ImportFrom) and node.lineno not in inner_lines:
            if isinstance(node, ast.Import):
                top += [(a.name, node.lineno) for a in node.names]
            elif not node.level and node.module:
                top += [(m, node.lineno) for m in _target(node) or [node.module]]
    return top, inner


GRAPH = {m: imports(p) for m, p in MODULES.items()}


def surgery_edges(mod: str) -> set[str]:
    return {t for t, _ in GRAPH[mod][0] if t in MODULES and t != mod}


def test_every_import_points_down() -> None:
    bad = []
    for mod in MODULES:
        for t, line in GRAPH[mod][0] + GRAPH[mod][1]:
            if t not in MODULES or t == mod:
                continue
            if layer(t) > layer(mod):
                bad.append(f"{mod}:{line} imports {t} (a higher layer)")
            if t.startswith("surgery.examples") and not mod.startswith("surgery.examples"):
                bad.append(f"{mod}:{line} imports {t} (examples are imported by nothing)")
            if mod.startswith("surgery.runtime.graphs") and not (
                    t.startswith("surgery.runtime.graphs") or t == "surgery.errors"):
                bad.append(f"{mod}:{line} imports {t} (graphs depend on nothing above them)")
    assert not bad, "\n".join(bad)


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(surgery_edges(m)):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t):], t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def pulls_torch() -> set[str]:
    """Surgery modules whose import (module level, transitively) imports torch."""
    direct = {m for m in MODULES if any(t == "torch" or t.startswith("torch.")
                                        for t, _ in GRAPH[m][0])}
    out = set(direct)
    changed = True
    while changed:
        changed = False
        for m in MODULES:
            if m not in out and surgery_edges(m) & out:
                out.add(m)
                changed = True
    return out


def test_imports_inside_functions_only_defer_heavy_dependencies() -> None:
    torchy = pulls_torch()
    bad = []
    for mod in MODULES:
        for t, line in GRAPH[mod][1]:
            heavy = any(t == h or t.startswith(h + ".") for h in HEAVY)
            defers_torch = t in MODULES and t in torchy and mod not in torchy
            if not (heavy or defers_torch):
                bad.append(f"{mod}:{line} imports {t} inside a function")
    assert not bad, "\n".join(bad)


def test_modules_are_100_to_400_lines() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()
             if p.name not in ("__init__.py", "__main__.py")}
    bad = {m: n for m, n in sizes.items() if not 100 <= n <= 400}
    assert not bad, bad


def test_the_layering_check_sees_a_violation(tmp_path: Path) -> None:
    """The check above is not vacuous: an upward import in a runtime module is caught."""
    mod = "surgery.runtime.report"
    saved = GRAPH[mod]
    GRAPH[mod] = (saved[0] + [("surgery.planning.plan", 1)], saved[1])
    try:
        with pytest.raises(AssertionError, match=r"imports surgery\.planning\.plan"):
            test_every_import_points_down()
    finally:
        GRAPH[mod] = saved


def _fresh(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    return out.split()


@pytest.mark.parametrize("entry", ["surgery.runtime", "surgery.runtime.apply"])
def test_the_runtime_imports_no_planning_hygiene_or_cli(entry: str) -> None:
    loaded = _fresh(f"import {entry}, sys; "
                    "print(*sorted(m for m in sys.modules if m.startswith('surgery')))")
    assert entry in loaded
    offline = [m for m in loaded if m.startswith(("surgery.planning", "surgery.hygiene",
                                                   "surgery.cli", "surgery.examples"))]
    assert not offline, offline
