"""Pickle checkpoints are bounded by their size (issue 22): each blow-up runs capped.

Every reproducer runs `surgery` in a subprocess under a memory cap and a timeout
(tests/capped.py): without the bound each one allocates 2 GB or more, so a regression fails
here (MemoryError or the cap) instead of taking the machine.
"""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch

from surgery.formats.pickle_bounds import check_pickle_file, scan_pickle
from tests.capped import HEADROOM, assert_refused, surgery_capped

BIG = 2_300_000_000  # what each crafted file asks for: above the child's HEADROOM (1 GB)


def _long1(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _legacy_call(module: str, name: str, n: int) -> bytes:
    """A protocol-2 pickle of `module.name(n)`: a 30-byte legacy `.pt`."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + _long1(n) + b"\x85R."


def test_allocating_pickles_are_refused(tmp_path: Path) -> None:
    """Constructors called with a huge int, and a legacy storage id whose numel is beyond the
    file (torch allocates it before reading the bytes): each file is under 1 KB."""
    files = []
    for module, name in (("builtins", "bytearray"), ("torch", "FloatTensor"),
                         ("torch.storage", "UntypedStorage")):
        f = tmp_path / f"{name}.pt"
        f.write_bytes(_legacy_call(module, name, BIG))
        files.append(f)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(4)}, good, _use_new_zipfile_serialization=False)
    raw = good.read_bytes()
    # The storage id's numel is the BININT1 4 before its views (None) and TUPLE: 600M floats.
    i = raw.index(b"K\x04Nt")
    bad = tmp_path / "numel.pt"
    bad.write_bytes(raw[:i] + b"J" + struct.pack("<i", 600_000_000) + raw[i + 2:])
    files.append(bad)
    assert all(f.stat().st_size < 1000 for f in files)
    assert min(BIG, 600_000_000 * 4) > HEADROOM  # unbounded, each would pass the cap
    r = surgery_capped("verify", *map(str, files))  # one process verifies every file
    assert r.rc == 3, r.output
    assert "Traceback" not in r.output
    assert len(r.error_lines) == len(files), r.stderr
    for f, line in zip(files, r.error_lines, strict=True):
        assert str(f) in line and "SURGERY_MAX_PICKLE_ALLOC_RATIO" in line, line
    assert surgery_capped("verify", str(good)).rc == 0


def _deflated_data_pkl(path: Path, tail: int) -> None:
    """A real checkpoint whose data.pkl is DEFLATE-compressed with `tail` zeros after STOP
    (streamed in 16 MB chunks: the test itself never holds the inflated bytes)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    zeros = bytes(16 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for info in src.infolist():
            data = src.read(info)
            if not info.filename.endswith("data.pkl"):
                out.writestr(info, data)  # stored, as torch wrote it
                continue
            with out.open(info.filename, "w", force_zip64=True) as w:
                w.write(data)
                for _ in range(tail // len(zeros)):
                    w.write(zeros)


def test_deflate_bomb_data_pkl_is_refused(tmp_path: Path) -> None:
    """A 5 MB file whose data.pkl inflates to 1.2 GB: refused from the central directory."""
    f = tmp_path / "bomb.pt"
    _deflated_data_pkl(f, 1_200_000_000)
    assert f.stat().st_size < 6_000_000
    line = assert_refused(surgery_capped("verify", str(f)), names="SURGERY_MAX_ZIP_RATIO")
    assert "data.pkl" in line


def test_stride0_tensor_is_refused_unless_the_limit_is_raised(tmp_path: Path) -> None:
    f = tmp_path / "expanded.pt"
    torch.save({"w": torch.zeros(1).expand(600_000_000)}, f)
    assert f.stat().st_size < 4000
    for cmd in (["verify", str(f)], ["verify", "--deep", str(f)],
                ["export", str(f), "-o", str(tmp_path / "out.safetensors")]):
        assert_refused(surgery_capped(*cmd), names="SURGERY_MAX_EXPAND_RATIO")
    assert not (tmp_path / "out.safetensors").exists()
    # A small expanded tensor, with the limit raised by a user who trusts it, is materialised.
    small = tmp_path / "small.pt"
    torch.save({"w": torch.ones(1).expand(400_000)}, small)
    assert_refused(surgery_capped("verify", str(small)), names="SURGERY_MAX_EXPAND_RATIO")
    out = tmp_path / "small.safetensors"
    r = surgery_capped("export", str(small), "-o", str(out),
                       env={"SURGERY_MAX_EXPAND_RATIO": "500000"})
    assert r.rc == 0, r.output
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["w"], torch.ones(400_000))


def test_meta_and_nested_tensors_are_refused_in_one_line(tmp_path: Path) -> None:
    meta = tmp_path / "meta.pt"
    torch.save({"w": torch.empty(3, device="meta")}, meta)
    assert_refused(surgery_capped("verify", str(meta)), names="meta device")


def test_real_checkpoints_pass_every_pickle_bound(tmp_path: Path) -> None:
    """A timm model's state dict, zip and legacy, with tied (shared-storage) views."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10)
    sd = dict(model.state_dict())
    sd["tied"] = sd["head.weight"]
    sd["view"] = sd["head.weight"][:3]
    for legacy in (False, True):
        f = tmp_path / f"m{legacy}.pt"
        torch.save(sd, f, _use_new_zipfile_serialization=not legacy)
        check_pickle_file(str(f), fmt="pickle" if legacy else "zip", size=f.stat().st_size)


def _state_dict_pickle(n: int) -> bytes:
    """What a state dict's pickle looks like to the walk (keys, tuples, ints, memo), made by
    pickle itself: torch.save of 80k tensors costs more than the test may."""
    import pickle

    return pickle.dumps({f"layers.{i}.weight": ("storage", i, str(i), "cpu", 4, (i, 1))
                         for i in range(n)}, protocol=2)


def test_scan_time_and_memory_grow_linearly() -> None:
    """The pickle walk, the input doubled four times: time and peak grow about linearly.

    (Peak memory is traced at the two ends only: tracemalloc slows the walk 15x.)
    """
    raws = [_state_dict_pickle(n) for n in (1000, 2000, 4000, 8000, 16000)]
    times = []
    for raw in raws:
        t0 = time.perf_counter()
        scan_pickle(io.BytesIO(raw), end=len(raw), budget=1 << 40, pickles=5)
        times.append(time.perf_counter() - t0)
    peaks = []
    for raw in (raws[0], raws[-1]):
        tracemalloc.start()
        scan_pickle(io.BytesIO(raw), end=len(raw), budget=1 << 40, pickles=5)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    growth = len(raws[-1]) / len(raws[0])
    assert times[-1] / times[0] < growth * 2.5, times
    assert peaks[1] / max(peaks[0], 1) < growth * 2.5, peaks
