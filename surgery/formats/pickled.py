"""torch.save files: loaded only with `torch.load(weights_only=True)` after the pickle probe has
classified them, then searched for the state dict (a container's `state_dict`, `model`, `ema`
...) and for optimizer state, which is reported and ignored.
"""

from __future__ import annotations

import pickle
import struct
import warnings
from collections.abc import Mapping
from typing import Any

from surgery.errors import CheckpointError
from surgery.formats.pickle_bounds import check_loaded_tensors, check_pickle_file
from surgery.formats.pickle_probe import explain_refusal, plain_types_allowed, probe_format
from surgery.formats.tensors import TensorInfo, _require_file, normalize_dtype

# Container entries that commonly hold the state dict, in the order we prefer them when a file
# holds several (the online weights before EMA copies).
CONTAINER_ENTRIES: tuple[str, ...] = (
    "state_dict", "model", "model_state_dict", "module", "net", "network", "params",
    "ema", "model_ema", "ema_state_dict", "ema_model",
)


def torch_load_safely(path: str) -> Any:
    """``torch.load(weights_only=True)``, with mmap where the format allows it.

    The file's bytes are classified first (surgery.formats.pickle_probe): a file that is neither a
    zip archive nor a pickle never reaches torch, and a legacy pickle is loaded without mmap. The
    plain-data classes frameworks save beside the weights (timm's `args` Namespace:
    surgery.formats.pickle_probe) are allowed as data for this load only. Every failure becomes a
    CheckpointError; a pickle that names code becomes an UnsafeCheckpointError. torch's own
    message advises turning weights_only off: that advice is never passed on, because it would
    execute the file.
    """
    size = _require_file(path)
    with open(path, "rb") as f:
        head = f.read(512)
    fmt = probe_format(path, head, size)
    check_pickle_file(path, fmt=fmt, size=size)  # bounded before torch reads it

    import torch

    try:
        with warnings.catch_warnings(), plain_types_allowed():
            # torch warns about pickle protocols and the like on stderr; the CLI owns stderr.
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location="cpu", weights_only=True,
                                  mmap=fmt == "zip")
            except RuntimeError as e:
                # Only the zip format can be memory-mapped; should torch disagree about which
                # format this is, it loads without mmap.
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise explain_refusal(path, fmt, str(e)) from None
    except EOFError:
        raise CheckpointError(f"{path}: truncated: its pickle ends early", path=path,
                              hint="the copy was cut short; save or copy it again") from None
    except (RuntimeError, ValueError, OSError, AttributeError, KeyError, IndexError,
            TypeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError,
            RecursionError) as e:
        what = _first_line(str(e)) or e.__class__.__name__
        if fmt == "zip" and ("zip" in what.lower() or "central directory" in what):
            what = f"truncated or corrupt zip archive: {what}"
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({what})", path=path,
                              hint="the file is corrupt, truncated or not a checkpoint; "
                              "save or copy it again") from None


def _first_line(msg: str) -> str:
    """torch's first sentence, one line: its messages run on with advice over several lines."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return lines[0].split(". ")[0][:200] if lines else ""


def _is_tensor(v: object) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype")


def _is_state_dict(obj: object) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(_is_tensor(v) for v in obj.values())


def select_state_dict(obj: object, *, path: str, key: str | None = None
                      ) -> tuple[Mapping[str, Any], str | None, list[str], list[str]]:
    """Find the state dict in a loaded object: (state dict, entry used, candidates, ignored).

    `key` chooses an entry; nested entries are written ``outer/inner``. Its tensors are held to
    surgery.formats.pickle_bounds (no stride-0 blow-up, no meta or nested tensors).
    """
    found = _select_state_dict(obj, path=path, key=key)
    check_loaded_tensors(found[0], path=path)
    return found


def _select_state_dict(obj: object, *, path: str, key: str | None
                       ) -> tuple[Mapping[str, Any], str | None, list[str], list[str]]:
    if key is not None:
        cur: Any = obj
        for part in key.split("/"):
            if not isinstance(cur, Mapping) or part not in cur:
                have = sorted(str(k) for k in cur) if isinstance(cur, Mapping) else []
                raise CheckpointError(f"{path}: no entry {key!r} in the checkpoint", path=path,
                                      hint=f"entries here: {', '.join(have[:20]) or '(none)'}")
            cur = cur[part]
        if not _is_state_dict(cur):
            raise CheckpointError(f"{path}: entry {key!r} is not a state dict of tensors",
                                  path=path, hint="choose an entry that maps names to tensors")
        return cur, key, [key], []
    if _is_state_dict(obj):
        return obj, None, [], []  # type: ignore[return-value]
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict",
                              path=path, hint="save model.state_dict() rather than the model")
    candidates = _find_candidates(obj, "")
    if not candidates:
        raise CheckpointError(f"{path}: no state dict of tensors found in it", path=path,
                              hint=f"top-level entries: {', '.join(sorted(map(str, obj))[:20])}")
    rank = {name: i for i, name in enumerate(CONTAINER_ENTRIES)}
    chosen = min(candidates, key=lambda c: (c.count("/"), rank.get(c.split("/")[-1], 99)))
    cur = obj
    for part in chosen.split("/"):
        cur = cur[part]
    ignored = sorted(str(k) for k, v in obj.items() if not _is_tensor(v)
                     and not any(c == k or c.startswith(f"{k}/") for c in candidates))
    return cur, chosen, candidates, ignored


def _is_optimizer_state(obj: object) -> bool:
    """An ``optimizer.state_dict()``: per-parameter ``state`` and ``param_groups``. Its
    ``state/N`` entries are dicts of tensors (exp_avg ...) but no model's weights."""
    return isinstance(obj, Mapping) and isinstance(obj.get("state"), Mapping) and \
        isinstance(obj.get("param_groups"), (list, tuple))


def optimizer_entries(obj: object) -> dict[str, int]:
    """Top-level entries holding optimizer state (one or a list of them): entry -> states."""
    out: dict[str, int] = {}
    if not isinstance(obj, Mapping):
        return out
    for k, v in obj.items():
        states = v if isinstance(v, (list, tuple)) else [v]
        if states and all(_is_optimizer_state(o) for o in states):
            out[str(k)] = sum(len(o["state"]) for o in states)
    return out


def _find_candidates(obj: Mapping[Any, Any], prefix: str, depth: int = 0) -> list[str]:
    out: list[str] = []
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if _is_optimizer_state(v):
            continue
        if _is_state_dict(v):
            out.append(name)
        elif isinstance(v, Mapping) and depth < 2:
            out.extend(_find_candidates(v, f"{name}/", depth + 1))
    return out


def _infos_from_state_dict(sd: Mapping[str, Any]) -> dict[str, TensorInfo]:
    return {str(k): TensorInfo(tuple(v.shape), normalize_dtype(v.dtype)) for k, v in sd.items()}
