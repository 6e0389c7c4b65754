"""Real signals to a real `surgery export` process: SIGKILL at random points and in the publish,
SIGTERM while writing. The destination holds nothing or the complete file, never a part.

The exporting process runs the real CLI through a small driver that slows each tensor copy
(so a random kill lands inside the write), or SIGKILLs itself right after the k-th publish
call (a point a random kill almost never hits: the publish is a few system calls).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from surgery.formats.atomic import OLD_MARK, TEMP_MARK
from tests.test_atomic import make_source, tensors

ROOT = str(Path(__file__).resolve().parents[1])
RUNS = 6  # SIGKILLs per layout: bounded time (each run is a fresh interpreter)

DRIVER = r"""
import os, sys, time
import surgery.formats.stream as st

delay = float(os.environ.get("SLOW_TENSOR", "0"))
real_write_to = st.SafetensorsSource.write_to

def slow_write_to(self, name, fd, *, advance):
    time.sleep(delay)
    real_write_to(self, name, fd, advance=advance)

st.SafetensorsSource.write_to = slow_write_to

kill_after = int(os.environ.get("KILL_AFTER_PUBLISH", "0"))
if kill_after:
    calls = 0
    real_link, real_replace = os.link, os.replace

    def counted(real):
        def call(src, dst, *args, **kwargs):
            global calls
            out = real(src, dst, *args, **kwargs)
            if not str(dst).split("/")[-1].startswith("."):  # a publish, not a temp link
                calls += 1
                if calls == kill_after:
                    os.kill(os.getpid(), 9)
            return out
        return call

    os.link, os.replace = counted(real_link), counted(real_replace)

from surgery.cli import cli
cli(sys.argv[1:], prog_name="surgery")
"""


def export(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    if not driver.exists():
        driver.write_text(DRIVER)
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.Popen([sys.executable, str(driver), "export", *args], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ours(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if TEMP_MARK in n or OLD_MARK in n)


def published(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def assert_complete(folder: Path, seed: int, *, sharded: bool) -> None:
    expected = tensors(n=8, size=16_384, seed=seed)
    files = [folder / "model.safetensors"]
    if sharded:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = [folder / n for n in sorted(set(index["weight_map"].values()))]
    got: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    assert set(got) == set(expected)
    assert all(np.array_equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("sharded", [pytest.param(False, id="single"),
                                     pytest.param(True, id="sharded")])
def test_sigkill_at_random_points_leaves_nothing_or_complete(tmp_path, sharded) -> None:
    src = make_source(tmp_path, seed=3, n=8, size=16_384)
    out = tmp_path / "out"
    out.mkdir()
    args = [src, "-o", str(out / "model.safetensors"),
            *(["--max-shard-size", "140KB"] if sharded else [])]
    env = {"SLOW_TENSOR": "0.05"}
    t0 = time.monotonic()
    ref = export(tmp_path, *args, "--force", env=env)
    assert ref.wait(120) == 0, ref.stderr.read() if ref.stderr else ""
    duration = time.monotonic() - t0
    for name in published(out):
        os.unlink(out / name)
    rng = random.Random(1234 + sharded)
    outcomes = {"nothing": 0, "complete": 0}
    for run in range(RUNS):
        p = export(tmp_path, *args, env=env)
        if run % 3 == 0:  # anywhere from the start
            time.sleep(rng.uniform(0.0, duration))
        else:  # once it writes: 8 tensors x 50 ms, then the publish
            while not ours(out) and p.poll() is None:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait(60)
        names = published(out)
        if not names:
            outcomes["nothing"] += 1
        elif sharded and "model.safetensors.index.json" not in names:
            # Killed inside the publish (microseconds wide): shards without their index. Each
            # is still a hard link of a temp of the dead run, which is what lets the next run
            # prove it is the dead run's and take it back (checked below).
            temp_inodes = {(out / t).stat().st_ino for t in ours(out)}
            assert all((out / n).stat().st_ino in temp_inodes for n in names), names
            outcomes["partial, taken back by the rerun"] = outcomes.get(
                "partial, taken back by the rerun", 0) + 1
        else:
            # Everything is there and loads: never a partial file.
            assert_complete(out, 3, sharded=sharded)
            outcomes["complete"] += 1
        # The next run cleans up whatever the killed one left, then writes the whole output.
        temps_before = ours(out)
        rerun = export(tmp_path, *args, "--force")
        assert rerun.wait(120) == 0, rerun.stderr.read() if rerun.stderr else ""
        assert ours(out) == []
        err = rerun.stderr.read() if rerun.stderr else ""
        for t in temps_before:
            assert t in err, (t, err)  # each removed temp is named
        assert_complete(out, 3, sharded=sharded)
        for name in published(out):
            os.unlink(out / name)
    print(outcomes)
    assert sum(outcomes.values()) == RUNS, outcomes


def test_sigkill_in_the_middle_of_publishing_shards_is_named_then_replaced(tmp_path) -> None:
    """Killed after 2 of 4 files are published: shards without an index. The next run without
    --force names them and leaves them (a forged temp name must never make a run delete a
    shard, issue 22); a run with --force replaces them and removes every temp."""
    src = make_source(tmp_path, seed=3, n=8, size=16_384)
    out = tmp_path / "out"
    out.mkdir()
    args = [src, "-o", str(out / "model.safetensors"), "--max-shard-size", "140KB"]
    p = export(tmp_path, *args, env={"KILL_AFTER_PUBLISH": "2"})
    assert p.wait(120) == -signal.SIGKILL
    left = published(out)
    assert len(left) == 2 and "model.safetensors.index.json" not in left
    rerun = export(tmp_path, *args)
    assert rerun.wait(120) == 3
    err = rerun.stderr.read() or ""
    assert "left alone" in err and "already exists" in err, err
    assert published(out) == left
    forced = export(tmp_path, *args, "--force")
    assert forced.wait(120) == 0, forced.stderr.read() if forced.stderr else ""
    assert ours(out) == []
    assert_complete(out, 3, sharded=True)


def test_sigkill_in_forced_publish_puts_the_previous_set_back(tmp_path) -> None:
    """A --force run killed halfway through replacing a sharded set: the next run restores
    the previous shards (kept as hard links) byte for byte before doing anything."""
    out = tmp_path / "out"
    out.mkdir()
    dest = str(out / "model.safetensors")
    first = export(tmp_path, make_source(tmp_path, seed=4, n=8, size=16_384), "-o", dest,
                   "--max-shard-size", "140KB")
    assert first.wait(120) == 0
    before = {n: (out / n).read_bytes() for n in published(out)}
    src5 = make_source(tmp_path, seed=5, n=8, size=16_384)
    p = export(tmp_path, src5, "-o", dest, "--max-shard-size", "140KB", "--force",
               env={"KILL_AFTER_PUBLISH": "2"})
    assert p.wait(120) == -signal.SIGKILL
    assert {n: (out / n).read_bytes() for n in published(out)} != before  # half replaced
    # Any write to that destination first repairs it; a refused one (no --force) too.
    again = export(tmp_path, src5, "-o", dest, "--max-shard-size", "140KB")
    assert again.wait(120) == 3
    assert "already exists" in (again.stderr.read() or "")
    assert {n: (out / n).read_bytes() for n in published(out)} == before
    assert ours(out) == []


def test_sigterm_removes_temps_and_exits_143(tmp_path) -> None:
    src = make_source(tmp_path, seed=3, n=8, size=16_384)
    out = tmp_path / "out"
    out.mkdir()
    p = export(tmp_path, src, "-o", str(out / "model.safetensors"), env={"SLOW_TENSOR": "1"})
    deadline = time.monotonic() + 120
    while not ours(out):  # wait until it is writing
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143
    err = p.stderr.read() if p.stderr else ""
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert os.listdir(out) == []


def test_two_concurrent_cli_exports_one_succeeds_one_exit_3(tmp_path) -> None:
    """Two real processes export to one destination at once: one writes it, the other exits
    3 with "already exists" (refused at its start or at its publish), and nothing else is
    left in the folder."""
    srcs = [make_source(tmp_path, seed=s, n=8, size=16_384) for s in (6, 7)]
    out = tmp_path / "out"
    out.mkdir()
    dest = str(out / "model.safetensors")
    env = {"SLOW_TENSOR": "0.02"}
    procs = [export(tmp_path, s, "-o", dest, "--max-shard-size", "140KB", env=env)
             for s in srcs]
    codes = [p.wait(120) for p in procs]
    assert sorted(codes) == [0, 3], codes
    loser = procs[codes.index(3)]
    assert "already exists" in (loser.stderr.read() if loser.stderr else "")
    assert ours(out) == []
    assert_complete(out, (6, 7)[codes.index(0)], sharded=True)
