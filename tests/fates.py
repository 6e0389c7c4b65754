"""The one-fate check (issue 18): every module of a model is a region, inside a region, or under
``[[left_out]]`` with a reason; never two of these, never none. The root is the model itself,
never a region by contract, and is not counted.

A reason must be the planner's own: when the evidence plan is kept, no module may carry the
catch-all ``NAMES_LEFT_OUT`` (surgery.planning.compare), which ``complete_fates`` gives a module
that neither plan judged. Without this, a module the evidence planner lost (the issue's "a fixed
subtree that is not worth a graph vanishes") would still pass as left out, for a wrong reason."""

from __future__ import annotations

from typing import Any

from surgery.planning.compare import NAMES_LEFT_OUT


def assert_one_fate(model: Any, manifest: Any) -> dict[str, str]:
    """Assert the rule for every module of ``model``; returns left-out path -> reason."""
    # A piecewise block that stands by for its decoder stack (``fallback_for``) runs only when
    # the stack runs eager: its fate is "inside" the stack region, the one nesting apply accepts.
    regions = {p for r in manifest.regions if r.callable == "forward"
               and not (r.piecewise or {}).get("fallback_for") for p in r.paths}
    paths = [lo.path for lo in manifest.left_out]
    assert len(paths) == len(set(paths)), "a path is left out twice"
    left = {lo.path: lo.reason for lo in manifest.left_out}
    for path, _mod in model.named_modules():
        if not path:
            continue
        inside = [a for a in regions if path.startswith(f"{a}.")]
        fates = [f for f, yes in (("region", path in regions), ("inside", bool(inside)),
                                  ("left out", path in left)) if yes]
        assert len(fates) == 1, f"{path}: {fates or 'no fate'}"
        if path in left:
            assert left[path].strip(), f"{path} is left out without a reason"
    if (manifest.coverage or {}).get("chosen", "evidence") == "evidence":
        lost = sorted(p for p, why in left.items() if why == NAMES_LEFT_OUT)
        assert not lost, f"the evidence plan gave no reason of its own for {lost}"
    return left
