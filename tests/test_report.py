"""The apply report (surgery.runtime.report): what `print(handle.report)` shows, the counters'
names, and the one warning when regions run eager for want of CUDA (issue 12, defect 13, friction
1)."""

from __future__ import annotations

import warnings

import pytest
import torch

from surgery import examples
from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region
from surgery.runtime.apply import apply_manifest
from surgery.runtime.report import ApplyReport, EagerOnCpuWarning, RegionRecord

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _manifest(model: torch.nn.Module, **compile_: object) -> Manifest:
    regions = [
        Region("frame_block", [f"aggregator.frame_blocks.{i}" for i in range(2)]),
        Region("attn_pre", [f"aggregator.global_blocks.{i}.attn_pre" for i in range(2)],
               callable="method"),
        Region("gone", ["aggregator.nothing_here"], required=False),
    ]
    return Manifest(compute_fingerprint(model.state_dict()), regions,
                    compile={**DEFAULT_COMPILE, "backend": "aot_eager", **compile_})


def test_print_report_is_a_table_per_kind_with_reasons() -> None:
    model = examples.tiny().eval()
    x = model.example_input()
    with torch.no_grad():
        handle = apply_manifest(model, _manifest(model, on_cpu="compile"),
                                warmup=lambda m: m(x), passes=2)
    with handle:
        text = str(handle.report)
    assert "object at 0x" not in text
    lines = text.splitlines()
    assert lines[0] == ("surgery: 5 region path(s): 4 compiled, 0 pending, 0 eager, 1 skipped "
                        "(2 warm-up pass(es))")
    header = lines[1].split()
    assert header[:7] == ["kind", "paths", "compiled", "pending", "eager", "skipped", "calls"]
    assert "CUDA-graph" in lines[1] and "compiled runs" in lines[1] and "recompiles" in lines[1]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:6]}
    assert rows["frame_block"][:5] == ["2", "2", "0", "0", "0"]
    assert rows["frame_block"][5] == "4"  # calls: 2 paths x 2 passes
    assert rows["gone"][:5] == ["1", "0", "0", "0", "1"]
    assert rows["total"][:5] == ["5", "4", "0", "0", "1"]
    assert any(ln.startswith("  skipped: aggregator.nothing_here: optional and not found")
               for ln in lines), text


def test_counters_have_distinct_names_and_the_old_ones_still_work() -> None:
    rec = RegionRecord("a", "k", "forward", "compiled")
    rec.graphs_run += 2  # how code written against the old names counts
    rec.graph_replays += 3
    assert (rec.compiled_runs, rec.cuda_graph_replays) == (2, 3)
    assert (rec.graphs_run, rec.graph_replays) == (2, 3)
    report = ApplyReport([rec])
    assert "compiled_runs=2" in report.summary() and "graphs_run" not in report.summary()
    assert repr(report).startswith("<ApplyReport: 1 region path(s), 1 compiled")


def test_regions_eager_for_want_of_cuda_warn_once_naming_the_setting() -> None:
    model = examples.tiny().eval()
    with pytest.warns(EagerOnCpuWarning) as got:
        handle = apply_manifest(model, _manifest(model))  # on_cpu = "eager", the default
    mine = [w for w in got if issubclass(w.category, EagerOnCpuWarning)]
    assert len(mine) == 1
    assert "4 region path(s)" in str(mine[0].message)
    assert 'on_cpu = "compile"' in str(mine[0].message)
    assert any('on_cpu = "compile"' in n for n in handle.report.notes)
    assert 'note: 4 region path(s)' in str(handle.report)
    handle.restore()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerOnCpuWarning)
        apply_manifest(model, _manifest(model, on_cpu="compile")).restore()
