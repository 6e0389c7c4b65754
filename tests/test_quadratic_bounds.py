"""What grew with the square of its input now grows linearly (issue 22): canonical_key's
per-pass strip, module paths of deep keys, resolving many region paths against a wide
container, and the nesting check. Reproducers of the memory blow-ups run capped."""

from __future__ import annotations

import gc
import json
import struct
import time
from pathlib import Path

import pytest
from torch import nn

from surgery.formats.keys import KeyLimitError, canonical_key, module_paths
from surgery.formats.manifest import Region
from surgery.runtime.distributed import wrapped_child
from surgery.runtime.resolve import _check_nesting, resolve_path
from tests.capped import surgery_capped


def _grows_linearly(fn, sizes: list[int]) -> list[float]:
    """Best of three per size (a shared 2-core machine is noisy): the input doubled four
    times, the time may grow at most ~3x faster than the input (square: 16x)."""
    times = []
    gc.collect()
    gc.disable()  # a collection landing in one size's run is not the code's cost
    try:
        for n in sizes:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn(n)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
    finally:
        gc.enable()
    assert times[-1] / max(times[0], 1e-4) < (sizes[-1] / sizes[0]) * 3, times
    return times


def test_canonical_key_is_linear_in_leading_module_segments() -> None:
    """`module.` x N: one strip a pass made a 140 KB key take 34 s."""
    _grows_linearly(lambda n: canonical_key("module." * n + "w"), [16000, 32000, 64000,
                                                                  128000, 256000])
    assert canonical_key("module." * 5 + "module") == "module"
    assert canonical_key("module._orig_mod.module.a.w") == "a.w"


def _st(path: Path, keys: list[str]) -> None:
    header = {k: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i, k in enumerate(keys)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * len(keys)))


def test_deep_and_exploding_keys_are_refused_within_the_cap(tmp_path: Path) -> None:
    """An 80 KB key of 40k dots (2 GB and 14.5 s in verify --manifest), and keys within the
    depth and length limits that share no prefix (every prefix stored): each refused in one line
    naming its limit, by plan and by verify --manifest."""
    deep = tmp_path / "deep.safetensors"
    _st(deep, ["a." * 40_000 + "w"])
    wide = tmp_path / "wide.safetensors"
    _st(wide, [f"k{i}." + "abcdefghij." * 29 + "w" for i in range(3000)])  # 1 MB of keys
    manifest = tmp_path / "m.surgery.toml"
    small = tmp_path / "small.safetensors"
    _st(small, ["blocks.0.w", "blocks.1.w"])
    r = surgery_capped("plan", str(small), "-o", str(manifest), cap=1_000_000_000)
    assert r.rc == 0, r.output
    for f, limit in ((deep, "SURGERY_MAX_KEY_"), (wide, "SURGERY_MAX_MODULE_PATHS_RATIO")):
        for cmd in (["plan", str(f), "-o", str(tmp_path / "x.surgery.toml")],
                    ["verify", "--manifest", str(manifest), str(f)]):
            r = surgery_capped(*cmd, cap=1_000_000_000, timeout=30)
            assert r.rc == 3 and "Traceback" not in r.output, (cmd, r.output[-1500:])
            assert limit in r.stderr, (cmd, r.stderr[-1500:])
            assert all(len(line) < 400 for line in r.error_lines)


def test_module_paths_are_bounded_by_their_keys() -> None:
    keys = [f"blocks.{i}.attn.proj.weight" for i in range(1000)]
    assert "blocks.999.attn.proj" in module_paths(keys)
    with pytest.raises(KeyLimitError, match="SURGERY_MAX_KEY_CHARS"):
        module_paths(["a" * 5000])
    keys_of = {n: [f"layers.{i}.mlp.fc{j}.weight" for i in range(n) for j in range(4)]
               for n in (1000, 2000, 4000, 8000, 16000)}
    _grows_linearly(lambda n: module_paths(keys_of[n]), sorted(keys_of))


class _Wide(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({f"b{i}": nn.Identity() for i in range(n)})


def test_resolving_many_paths_in_a_wide_container_is_linear() -> None:
    """8000 paths against an 8000-wide container took 44.5 s (named_children rebuilt per path,
    and the nesting check compared every path with every other)."""
    models = {n: _Wide(n) for n in (2000, 4000, 8000, 16000, 32000)}

    def resolve(n: int) -> None:
        model = models[n]
        resolved = []
        for i in range(n):
            mod, attr = resolve_path(model, f"blocks.b{i}", callable="forward")
            resolved.append((_Region(), f"blocks.b{i}", mod, attr))
        _check_nesting(resolved)

    _grows_linearly(resolve, sorted(models))
    assert wrapped_child(models[2000].blocks, "b7") is models[2000].blocks.b7


def _Region() -> Region:  # a real region, as apply hands the nesting check
    return Region(kind="repeated_block", paths=[])


def test_the_nesting_check_still_refuses_a_nested_path() -> None:
    from surgery.errors import RegionError

    model = _Wide(3)
    rows = [(_Region(), p, *resolve_path(model, p, callable="forward"))
            for p in ("blocks", "blocks.b1")]
    with pytest.raises(RegionError, match="inside region 'blocks'"):
        _check_nesting(rows)
