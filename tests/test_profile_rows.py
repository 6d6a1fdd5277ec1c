"""The display path of a profile (plain Python over column lists) gives the DataFrame path's numbers.

`%%profile_gpu` shows its header, top-K table, categories, shapes and advice from
`TraceData.op_columns` without pandas (pandas' fixed cost per call was most of the magic's
overhead on a ~100-op profile). The DataFrames (`group_ops`, `cpu_categories`, `achieved_flops`,
``result.table()``) stay what ``result.ops`` & co. return. These tests hold both to the same
values, bit for bit, on live CPU profiles and on the reference H100/A100/B200 traces.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import nbaccel
from nbaccel import profile_table as pt
from nbaccel.analysis import achieved_flops, load_trace
from nbaccel.profile import ProfileOptions, profile
from nbaccel.render import profile as render_profile

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
REFERENCE = ["tracelens_h100_Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
             "hta_a100_negative_queue_length_values_check_rank0.json.gz", "tracelens_b200_eager_trace.json.gz"]


def _same(a, b) -> bool:
    missing = [v is None or (isinstance(v, float) and math.isnan(v)) for v in (a, b)]
    if any(missing):
        return all(missing)
    if isinstance(a, (np.generic,)):
        a = a.item()
    if isinstance(b, (np.generic,)):
        b = b.item()
    return a == b


def assert_same_records(rows: list[dict], frame: pd.DataFrame):
    expected = frame.to_dict("records")
    assert len(rows) == len(expected)
    for i, (got, want) in enumerate(zip(rows, expected)):
        assert list(got) == list(want), f"row {i}: columns {list(got)} != {list(want)}"
        bad = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
        assert not bad, f"row {i} ({want.get('name')}): {bad}"


# --- the building blocks ---------------------------------------------------------------------------

def test_kahan_and_pairwise_sums_equal_pandas_bit_for_bit():
    rng = random.Random(3)
    values = [rng.random() * 10 ** rng.randint(-3, 6) for _ in range(3000)]
    values[::97] = [float("nan")] * len(values[::97])
    keys = [rng.randint(0, 4) for _ in values]
    frame = pd.DataFrame({"k": keys, "v": values})
    sums = frame.groupby("k")["v"].sum()
    for k, expected in sums.items():
        assert pt.kahan_sum(v for kk, v in zip(keys, values) if kk == k) == expected
    assert pt.pairwise_sum(values) == frame["v"].sum()
    # a naive left-to-right sum differs: the equality above is not a coincidence of the data
    assert sum(v for v in values if v == v) != frame["v"].sum()


def test_sort_rows_is_the_stable_nan_last_sort_of_sort_table():
    rng = random.Random(5)
    table = pd.DataFrame({"name": [f"op{i}" for i in range(200)],
                          "x": [rng.choice([1.0, 2.0, 3.5, float("nan"), 0.0]) for _ in range(200)]})
    rows = table.to_dict("records")
    for ascending in (False, True):
        got = [r["name"] for r in pt.sort_rows(rows, "x", ascending)]
        assert got == pt.sort_table(table, "x", ascending)["name"].tolist()


# --- whole profiles --------------------------------------------------------------------------------

def _live(workload, **options) -> nbaccel.ProfileResult:
    torch.manual_seed(0)
    with profile(options=ProfileOptions(device="cpu", **options)) as prof:
        workload()
    return prof.result


def _mlp():
    model = torch.nn.Sequential(torch.nn.Linear(1001, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    x, y = torch.randn(64, 1001), torch.randint(0, 10, (64,))
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _conv():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 30, 3), torch.nn.ReLU(), torch.nn.Conv2d(30, 16, 3))
    model(torch.randn(4, 3, 32, 32)).sum().backward()


def _many_small_ops():
    t = torch.ones(8)
    for _ in range(60):
        t = (t + 1).mul_(0.5).relu_().neg_()
    torch.randn(33, 17) @ torch.randn(17, 9)


_results: dict = {}


# Recorded torch.compile and DataLoader runs (tests/data/README.md): their categories hold phases
PHASES = {"compile": "phase_compile_first_call.json.gz", "DataLoader": "phase_dataloader_workers0.json.gz"}


@pytest.fixture(params=["mlp", "conv+memory+shapes", "small ops+amp", "H100", "A100", "B200", *PHASES])
def result(request):
    name = request.param
    if name not in _results:
        if name == "mlp":
            _results[name] = _live(_mlp)
        elif name == "conv+memory+shapes":
            _results[name] = _live(_conv, memory=True, shapes=True)
        elif name == "small ops+amp":
            _results[name] = _live(_many_small_ops, amp="bf16")
        elif name in PHASES:
            _results[name] = nbaccel.load_trace(Path(__file__).parent / "data" / PHASES[name])
        else:
            path = TRACES / REFERENCE[["H100", "A100", "B200"].index(name)]
            if not path.exists():
                pytest.skip(f"reference trace not found at {path}")
            _results[name] = nbaccel.load_trace(path)
    return _results[name]


def test_grouped_rows_equal_group_ops(result):
    device_total = result.device_time_us if result.on_device else 0.0
    for group in ("op", "op+shape"):
        assert_same_records(pt.group_rows(result.op_columns, group, device_total),
                            pt.group_ops(result.op_events, group, device_total))


def test_top_rows_equal_the_sorted_table(result):
    for sort in pt.SORT_COLUMNS:
        if (sort == "device" and not result.on_device) or (sort == "memory" and not result.options.memory):
            continue
        fresh = nbaccel.ProfileResult(**{f: getattr(result, f) for f in ("device", "trace", "op_extra", "loaded")},
                                      options=ProfileOptions(**{**result.options.to_dict(), "sort": sort, "top": 12}))
        assert_same_records(fresh.top_rows(12), fresh.table(top=12))
        assert len(fresh.grouped_rows()) == len(fresh.ops)


def test_category_rows_equal_the_categories_frame(result):
    cats = result.categories
    assert result.category_rows == [(r.category, float(r.time_us), int(r.count), float(r.percent))
                                    for r in cats.itertuples()]


def test_header_figures_equal_the_dataframe_formulas(result):
    trace = result.trace
    assert result.flops == achieved_flops(trace)
    ann = trace.annotations
    steps = ann[ann["name"].str.startswith("ProfilerStep#") & ~ann["on_device"].astype(bool)] if len(ann) else ann
    assert result.step_times_us == (steps.sort_values("ts_us", kind="stable")["dur_us"].tolist() if len(ann) else [])
    frames = [df for df in (trace.ops, trace.annotations, trace.kernels, trace.memcpy, trace.memset) if len(df)]
    assert trace.window() == (min(float(df["ts_us"].min()) for df in frames),
                              max(float((df["ts_us"] + df["dur_us"]).max()) for df in frames))
    assert result.op_count == len(trace.ops) and result.kernel_count == len(trace.kernels)
    # The header's "op calls" is the sum of the op table's calls column, re-dispatches not counted twice.
    assert result.header["ops"] == int(result.grouped("op")["calls"].sum()) <= result.op_count


def test_the_header_counts_op_calls_as_the_table_does():
    # Under autocast a wrapper re-dispatches one call (aten::copy_ inside aten::copy_, ...): the header
    # once said 29 ops beside a table whose calls summed to 27.
    r = _results.get("small ops+amp") or _live(_many_small_ops, amp="bf16")
    calls = sum(row["calls"] for row in r.grouped_rows("op"))
    assert r.header["ops"] == calls < r.op_count
    assert f"op calls / kernels: {calls:,} / 0" in render_profile.text(r)


def test_unaligned_shapes_from_columns_equal_the_dataframe_version(result):
    assert pt.unaligned_shapes(result.op_columns) == pt.unaligned_shapes(result.op_events)


def test_trace_columns_are_the_dataframe_columns():
    fresh = load_trace({"traceEvents": []})  # an empty trace has every kind, no rows
    assert fresh.count("ops") == 0 and len(fresh.ops) == 0 and fresh.window() is None
    result = _live(_mlp)
    t = result.trace
    for kind in ("ops", "annotations", "kernels", "memcpy", "memset"):
        cols = {c: list(v) for c, v in t.columns[kind].items()}
        frame = getattr(t, kind)
        assert t.count(kind) == len(frame)
        for c, values in cols.items():
            assert [_same(a, b) for a, b in zip(values, frame[c].tolist())] == [True] * len(values), (kind, c)


def test_the_display_of_a_cpu_profile_builds_no_dataframe():
    # The overhead target of %%profile_gpu depends on this: text and HTML come from column lists.
    result = _live(_mlp)
    text, html = render_profile.text(result), render_profile.html(result)
    assert "aten::addmm" in text and "aten::addmm" in html
    assert result.trace._frames == {}
    assert "op_events" not in result.__dict__ and "ops" not in result._grouped
    # ... and the DataFrames are still there when asked for
    assert "aten::addmm" in set(result.ops["name"]) and len(result.categories)


def test_text_and_html_are_the_same_from_python_or_pandas_tables(result, monkeypatch):
    from nbaccel import profile_result as profile_module
    shown = {}
    for limit in (10**9, 0):  # every profile through the Python tables, then every one through pandas
        monkeypatch.setattr(profile_module, "PYTHON_TABLE_OPS", limit)
        fresh = dataclasses.replace(result, _grouped={})
        assert fresh.python_tables is (limit > 0)
        shown[limit] = (render_profile.text(fresh), render_profile.html(fresh), fresh.header, fresh.advice)
    assert shown[10**9] == shown[0]


def test_the_garbage_collector_is_paused_only_while_a_trace_is_read(tmp_path):
    import gc

    from nbaccel.analysis.trace import TraceError, paused_gc

    seen = []
    with paused_gc():
        seen.append(gc.isenabled())
    assert seen == [False] and gc.isenabled()
    with pytest.raises(TraceError), paused_gc():
        raise TraceError("a bad trace")
    assert gc.isenabled()  # switched back on after an error too
    _live(_mlp)
    assert gc.isenabled()
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    with pytest.raises(TraceError):
        nbaccel.load_trace(bad)
    assert gc.isenabled()
    gc.disable()
    try:  # a user who switched it off keeps it off
        _live(_mlp)
        load_trace({"traceEvents": []})
        assert not gc.isenabled()
    finally:
        gc.enable()
