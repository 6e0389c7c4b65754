"""Where a decode step's host time goes: one profiled call, split into the shares issue 19b
measured by hand (used by gpu_piecewise.py's ``--profile``).

One call is timed (the pieces by a timer around ``StaticPiece.__call__``), another runs under
``cProfile``, whose shares are of the profiled time (profiling slows Python more than C, and
its cumulative times are unreliable under frames dynamo runs, so only self times are used):

- ``dynamo_entry``: self time of eval_frame.py's ``compile_wrapper``, the wrapper that enters a
  compiled function (frame entry and the guard check of the entry that hits run in C under
  it; the ``disable`` wrappers around compiled pieces are not counted here);
- ``pieces``: time inside surgery's static pieces (``StaticPiece.__call__``, ops included), of
  the timed call's wall time;
- ``attention``: self time of the ``scaled_dot_product_attention`` builtin (between pieces);
- ``surgery``: self time of surgery's own modules outside the pieces (the piecewise wrappers,
  the split glue);
- ``rest``: everything else (HF's generate loop, logits, sampling, eager ops).

``dynamo_entries_per_token`` counts calls of that wrapper per token: 1 for a stack region, one
per block for per-block regions.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")
_SURGERY = os.sep + "surgery" + os.sep
_PIECE = "piece_replay.py"


def _entry(key: tuple[str, int, str]) -> bool:
    """The wrapper that enters a torch.compile'd function (not the `disable` wrappers)."""
    return key[0].endswith(_EVAL_FRAME) and key[2] == "compile_wrapper"


def _timed_pieces(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall s of fn(), s inside surgery's static pieces), timing StaticPiece.__call__ itself:
    cProfile's cumulative times are unreliable under frames dynamo runs."""
    from surgery.runtime.piecewise_split import StaticPiece

    inner = StaticPiece.__call__
    spent = [0.0]

    def timed(self: Any, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(self, *args)
        finally:
            spent[0] += time.perf_counter() - t

    StaticPiece.__call__ = timed  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, spent[0]
    finally:
        StaticPiece.__call__ = inner  # type: ignore[method-assign]


def host_profile(fn: Callable[[], Any], *, tokens: int) -> dict[str, Any]:
    """Time one ``fn()`` (a generate of ``tokens`` new tokens) and profile another; their
    shares and counts."""
    wall, pieces = _timed_pieces(fn)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = \
        pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1e-9
    entry = sum(v[2] for k, v in stats.items() if _entry(k))
    entries = sum(v[1] for k, v in stats.items() if _entry(k))
    attention = sum(v[2] for k, v in stats.items()
                    if k[0] == "~" and "scaled_dot_product_attention" in k[2])
    # surgery's self time outside the pieces (a piece's own frames are inside `pieces`)
    own = sum(v[2] for k, v in stats.items() if _SURGERY in k[0] and not (
        k[0].endswith(_PIECE) and k[2] in ("__call__", "run", "ensure")))
    share = {"dynamo_entry": entry / total, "pieces": pieces / wall,
             "attention": attention / total, "surgery": own / total}
    share["rest"] = max(0.0, 1.0 - sum(share.values()))
    return {"wall_ms_per_token": round(wall * 1e3 / tokens, 3),
            "profiled_ms_per_token": round(total * 1e3 / tokens, 3),
            "dynamo_entries_per_token": round(entries / tokens, 2),
            "host_shares": {k: round(v, 3) for k, v in share.items()}}
