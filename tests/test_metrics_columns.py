"""The CUDA analysis computed from column lists gives the former pandas code's results exactly.

`nbaccel.analysis.metrics` (busy time, Tensor Core and communication shares, categories,
achieved FLOP/s), `profile_table.fp32_tensor_core_misses` and ``ProfileResult.kernels`` /
``streams`` / ``busy`` / ``device_time_us`` used to be pandas groupbys over ``trace.kernels``,
``device_activities()`` and ``trace.ops``; they now work from `TraceData.column` lists (pandas'
fixed cost per call was most of a CUDA profile's analysis). The pandas versions are kept here,
verbatim, as the reference: frames must be equal with ``assert_frame_equal`` and floats equal
bit for bit, on the H200 fixture, the H100/A100 (both ranks of a 2-rank folder)/B200 reference
traces and the synthetic CUDA traces of tests/test_profile_tables.py.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pandas as pd
import pytest
from test_load_trace import _stretched
from test_profile_tables import GPU, synthetic_cuda_trace

import nbaccel
from nbaccel import profile_table as pt
from nbaccel.analysis import (CATEGORIES, TraceData, achieved_flops, busy_time, category_breakdown,
                              communication_share, load_trace, tensor_core_share)
from nbaccel.analysis.metrics import Share, TensorCoreShare, busiest_device
from nbaccel.analysis.sums import intervals_union
from nbaccel.analysis.peaks import lookup_gpu, peak_flops
from nbaccel.profile import ProfileOptions, ProfileResult
from nbaccel.render import profile as render_profile

HERE = Path(__file__).resolve().parent
TRACES = HERE.parents[1] / "shared" / "data" / "traces"
H200 = HERE / "data" / "h200_bf16_transformer_step.json.gz"
H100 = "tracelens_h100_Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"
A100 = "hta_a100_negative_queue_length_values_check_rank0.json.gz"
B200 = "tracelens_b200_eager_trace.json.gz"


# --- the former pandas implementations (the reference) ---------------------------------------------

def old_busy_time(trace, by="device"):
    keys = ["device"] if by == "device" else ["device", "stream"]
    acts = trace.device_activities()
    cols = keys + ["busy_us", "activity_us", "count", "window_us", "idle_fraction"]
    if not len(acts):
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    win = trace.window()
    window_us = (win[1] - win[0]) if win else 0.0
    rows = []
    for key, grp in acts.groupby(keys, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        starts = grp["ts_us"].tolist()
        ends = (grp["ts_us"] + grp["dur_us"]).tolist()
        busy = intervals_union(starts, ends)
        rows.append(list(key) + [busy, float(grp["dur_us"].sum()), len(grp), window_us,
                                 (1 - busy / window_us) if window_us > 0 else None])
    return pd.DataFrame(rows, columns=cols)


def old_tensor_core_share(trace):
    k = trace.kernels if trace.count("kernels") else None
    total = float(k["dur_us"].sum()) if k is not None else 0.0
    if k is None or total <= 0:
        return TensorCoreShare(None, 0.0, 0.0, reason="the trace has no GPU kernels (CPU-only profile)")
    tc = float(k.loc[k["tensor_cores"].eq(True), "dur_us"].sum())
    unk = k[k["tensor_cores"].isna()]
    unknown = unk.groupby("name")["dur_us"].sum().sort_values(ascending=False)
    return TensorCoreShare(tc / total, tc, total, None, unknown_us=float(unk["dur_us"].sum()),
                           unknown_kernels={str(n): float(v) for n, v in unknown.items()})


def old_communication_share(trace):
    k = trace.kernels if trace.count("kernels") else None
    total = float(k["dur_us"].sum()) if k is not None else 0.0
    if k is None or total <= 0:
        return Share(None, 0.0, 0.0, reason="the trace has no GPU kernels (CPU-only profile)")
    comm = float(k.loc[k["category"].eq("communication"), "dur_us"].sum())
    return Share(comm / total, comm, total)


def old_category_breakdown(trace, include_memory=True):
    acts = trace.device_activities() if include_memory else trace.kernels
    cols = ["category", "time_us", "count", "percent"]
    if not len(acts):
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    g = acts.groupby("category")["dur_us"].agg(["sum", "count"])
    total = float(g["sum"].sum())
    out = pd.DataFrame({"category": g.index, "time_us": g["sum"].values, "count": g["count"].values,
                        "percent": (100.0 * g["sum"] / total).values if total > 0 else 0.0})
    order = {c: i for i, c in enumerate(CATEGORIES)}
    out["_o"] = out["category"].map(order)
    return out.sort_values(["time_us", "_o"], ascending=[False, True]).drop(columns="_o").reset_index(drop=True)


def old_achieved_flops(trace, device=None):
    ops = trace.ops
    counted = ops[ops["flops_counted"]] if len(ops) else ops
    flops = float(counted["flops"].sum()) if len(counted) else 0.0
    by_dtype = {}
    if len(counted):
        for d, v in counted.groupby(counted["math_dtype"].fillna("unknown"))["flops"].sum().items():
            by_dtype[str(d)] = float(v)
    dominant = max(by_dtype, key=by_dtype.get) if by_dtype else None
    reasons = []
    if not flops:
        reasons.append("no op with a FLOP formula and recorded shapes (record_shapes=True?)")
    k = trace.kernels
    if device is None and len(k):
        device = k.groupby("device")["dur_us"].sum().idxmax()
    busy = 0.0
    if trace.has_device_activity:
        bt = old_busy_time(trace, by="device")
        sel = bt[bt["device"] == device] if device is not None else bt
        busy = float(sel["busy_us"].sum())
    else:
        reasons.append("no GPU activity in the trace: FLOP/s over device time is undefined")
    time_base = "device" if trace.has_device_activity else "cpu"
    time_col = "device_total_us" if time_base == "device" else "dur_us"
    matmul_us = float(counted[time_col].sum()) if len(counted) else 0.0
    rate = flops / (busy * 1e-6) if busy > 0 and flops else None
    mm_rate = flops / (matmul_us * 1e-6) if matmul_us > 0 and flops else None
    gpu = None
    if trace.has_device_activity:
        props = trace.device_props(device) or {}
        name = props.get("name")
        cc = (props["computeMajor"], props["computeMinor"]) if "computeMajor" in props else None
        gpu = lookup_gpu(name, cc, props.get("totalGlobalMem"))
        if gpu is None:
            reasons.append(f"no peak figures for device {name!r} in gpu_peaks.csv")
    peak = peak_flops(gpu, dominant) if gpu and dominant else None
    if gpu and dominant and peak is None:
        reasons.append(f"gpu_peaks.csv has no {dominant} peak for {gpu.gpu}")
    return dict(flops=flops, flops_by_dtype=by_dtype, dominant_dtype=dominant, busy_us=busy, flops_per_s=rate,
                matmul_time_us=matmul_us, matmul_flops_per_s=mm_rate, gpu=gpu, peak_flops_per_s=peak,
                fraction_of_peak=(rate / peak) if rate and peak else None,
                matmul_fraction_of_peak=(mm_rate / peak) if mm_rate and peak else None,
                reason="; ".join(reasons) or None, time_base=time_base)


def old_fp32_tensor_core_misses(ops, min_share=0.01):
    cols = ["name", "shapes", "calls", "device_us", "share"]
    if not len(ops):
        return pd.DataFrame(columns=cols)
    total = float(ops["device_self_us"].sum())
    sel = ops[(ops["category"] == "matmul/conv") & (ops["math_dtype"] == "fp32") & (ops["device_self_us"] > 0)
              & (ops["tc_device_us"] <= 0)]
    if not len(sel) or total <= 0:
        return pd.DataFrame(columns=cols)
    sel = sel.assign(shapes=[pt._shape_text(d) for d in sel["input_dims"]])
    g = sel.groupby(["name", "shapes"], sort=False)
    out = pd.DataFrame({"calls": g.size(), "device_us": g["device_self_us"].sum()}).reset_index()
    out["share"] = out["device_us"] / total
    return out[out["share"] >= min_share].sort_values("device_us", ascending=False).reset_index(drop=True)[cols]


def old_kernels(result):
    if not result.kernel_count:
        return pd.DataFrame(columns=["name", "calls", "time_us", "category", "tensor_cores"])
    k = result.trace.kernels
    g = k.groupby("name", sort=False)
    out = pd.DataFrame({"calls": g.size(), "time_us": g["dur_us"].sum(), "category": g["category"].first(),
                        "tensor_cores": g["tensor_cores"].first()}).reset_index()
    return out.sort_values("time_us", ascending=False).reset_index(drop=True)


def old_device_time_us(result):
    acts = result.trace.device_activities()
    return float(acts["dur_us"].sum()) if len(acts) else 0.0


# --- the traces ---------------------------------------------------------------------------------------

def _doc(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def _reference(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"reference trace not found at {path} (CI keeps a copy of shared/ at ../shared)")
    return path


def _a100_rank(rank: int) -> dict:
    doc = _doc(_reference(A100))
    return doc if rank == 0 else _stretched(doc, 1.25, 1)  # rank 1 of test_load_trace's 2-rank folder


def _from_frames(doc: dict) -> TraceData:
    """The same trace built from DataFrames (TraceData's other constructor): no column lists."""
    t = load_trace(doc)
    return TraceData(ops=t.ops, kernels=t.kernels, memcpy=t.memcpy, memset=t.memset, annotations=t.annotations,
                     device_properties=t.device_properties, metadata=t.metadata)


SOURCES = {
    "h200": lambda: _doc(H200),
    "h100": lambda: _doc(_reference(H100)),
    "a100_rank0": lambda: _a100_rank(0),
    "a100_rank1": lambda: _a100_rank(1),
    "b200": lambda: _doc(_reference(B200)),
    "synthetic": lambda: synthetic_cuda_trace(),
    "synthetic_idle": lambda: synthetic_cuda_trace(idle_gap_us=2000.0),
}
_cache: dict = {}


@pytest.fixture(params=[*SOURCES, "synthetic_frames"])
def trace(request) -> TraceData:
    name = request.param
    if name not in _cache:
        _cache[name] = _from_frames(synthetic_cuda_trace()) if name == "synthetic_frames" else load_trace(SOURCES[name]())
    return _cache[name]


def _result(trace: TraceData) -> ProfileResult:
    return ProfileResult(device=GPU, options=ProfileOptions(device="cuda"), trace=trace)


# --- the comparisons ----------------------------------------------------------------------------------

def test_busy_time_equals_the_pandas_groupby(trace):
    for by in ("device", "stream"):
        pd.testing.assert_frame_equal(busy_time(trace, by), old_busy_time(trace, by))


def test_tensor_core_and_communication_shares_equal_pandas(trace):
    new, old = tensor_core_share(trace), old_tensor_core_share(trace)
    assert dataclasses.asdict(new) == dataclasses.asdict(old)
    assert list(new.unknown_kernels) == list(old.unknown_kernels)  # same order too
    assert dataclasses.asdict(communication_share(trace)) == dataclasses.asdict(old_communication_share(trace))


def test_category_breakdown_equals_pandas(trace):
    for include_memory in (True, False):
        pd.testing.assert_frame_equal(category_breakdown(trace, include_memory),
                                      old_category_breakdown(trace, include_memory))


def test_busiest_device_is_the_groupby_idxmax(trace):
    k = trace.kernels
    assert busiest_device(trace) == k.groupby("device")["dur_us"].sum().idxmax()


def test_achieved_flops_equals_pandas(trace):
    assert dataclasses.asdict(achieved_flops(trace)) == {
        k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in old_achieved_flops(trace).items()}


def test_profile_result_tables_equal_pandas(trace):
    r = _result(trace)
    old_ops = r.op_events  # trace.ops + shapes, what fp32_misses used to read
    for min_share in (0.01, 0.0, 1e-4):
        pd.testing.assert_frame_equal(pt.fp32_tensor_core_misses(r.op_columns, min_share),
                                      old_fp32_tensor_core_misses(old_ops, min_share))
    pd.testing.assert_frame_equal(r.fp32_misses, old_fp32_tensor_core_misses(old_ops))
    pd.testing.assert_frame_equal(r.kernels, old_kernels(r))
    pd.testing.assert_frame_equal(r.streams, old_busy_time(trace, by="stream"))
    pd.testing.assert_frame_equal(r.categories, old_category_breakdown(trace))
    assert r.device_time_us == old_device_time_us(r)
    assert r.busy["busy_us"] == float(old_busy_time(trace)["busy_us"].sum())
    # the display's row lists are the frames' rows
    assert r.category_rows == [(c.category, float(c.time_us), int(c.count), float(c.percent))
                               for c in r.categories.itertuples()]
    assert [list(x) for x in r.kernel_rows] == r.kernels.values.tolist()


def test_display_lines_read_like_the_frames(trace):
    r = _result(trace)
    bt = old_busy_time(trace, by="stream").sort_values("busy_us", ascending=False)
    limit = 8
    want = [f"device {s.device} stream {s.stream}: busy {render_profile._time(s.busy_us)} ({1 - s.idle_fraction:.0%} "
            f"of the {render_profile._time(s.window_us)} window), {int(s.count):,} kernels/copies"
            for s in bt.head(limit).itertuples()]
    if len(bt) > limit:
        want.append(f"... and {len(bt) - limit} more streams")
    assert render_profile.stream_lines(r, limit) == want
    assert render_profile.kernel_rows(r, 15) == [
        [k.name, f"{k.calls:,}", render_profile._time(k.time_us), k.category,
         {True: "yes", False: "no"}.get(k.tensor_cores, "unknown")] for k in old_kernels(r).head(15).itertuples()]


def test_cpu_profile_flops_equal_pandas():
    """A CPU-only trace (no device activity): achieved_flops is what ProfileResult.flops shows there too."""
    import torch
    a = torch.randn(64, 72)
    with nbaccel.profile(device="cpu") as prof:
        for _ in range(3):
            torch.relu(a @ a.T)
    trace = prof.result.trace
    assert dataclasses.asdict(prof.result.flops) == dataclasses.asdict(achieved_flops(trace))
    assert dataclasses.asdict(achieved_flops(trace)) == old_achieved_flops(trace)
    assert busy_time(trace).empty and category_breakdown(trace).empty
    assert tensor_core_share(trace).value is None
