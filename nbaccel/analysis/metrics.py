"""Figures computed from a :class:`~nbaccel.analysis.trace.TraceData`.

Conventions, chosen so numbers can be checked against the reference traces' README:

* Shares of "kernel time" (Tensor Core, communication) sum kernel ``dur`` with no overlap
  handling, like HTA and the traces README's ground truth.  Overlap matters for *busy* time,
  which is computed separately as a union of intervals.
* A figure that cannot be computed is ``None`` with a ``reason`` string, never 0: a CPU-only
  trace has no Tensor Core share, it does not have a 0 % one.
* Every figure is computed from the trace's column lists (`TraceData.column`), not its
  DataFrames: pandas' fixed cost per groupby was most of a CUDA profile's analysis time (~0.1 ms
  a call on a few hundred rows). The numbers are pandas' to the last bit (`.sums`: group totals
  Kahan-compensated like groupby ``sum``, column totals numpy's pairwise sum, descending sorts
  pandas' ``nargsort``), held to the former pandas code by tests/test_metrics_columns.py.
  Functions returning a DataFrame build it from their few result rows at the end.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .kernels import CATEGORIES
from .peaks import GpuPeaks, lookup_gpu, peak_flops
from .sums import desc_order, intervals_union, kahan_sum, pairwise_sum
from .trace import TraceData

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Share",
    "TensorCoreShare",
    "FlopsSummary",
    "busy_time",
    "tensor_core_share",
    "communication_share",
    "category_breakdown",
    "busy_rows",
    "category_rows",
    "kernel_rows",
    "activity_columns",
    "busiest_device",
    "op_table",
    "achieved_flops",
    "summary",
]


@dataclass
class Share:
    """``part_us / total_us`` as a fraction in [0, 1], or ``None`` with a ``reason``."""

    value: float | None
    part_us: float
    total_us: float
    reason: str | None = None

    @property
    def percent(self) -> float | None:
        return None if self.value is None else 100.0 * self.value


@dataclass
class TensorCoreShare(Share):
    """Tensor Core share of kernel time; kernels whose name cannot tell are counted as
    non-TC in ``value`` and reported in ``unknown_us`` / ``unknown_kernels``."""

    unknown_us: float = 0.0
    unknown_kernels: dict[str, float] = field(default_factory=dict)  # name -> summed dur (us)

    @property
    def unknown_share(self) -> float | None:
        return None if not self.total_us else self.unknown_us / self.total_us


_DEVICE_KINDS = ("kernels", "memcpy", "memset")


def activity_columns(trace: TraceData, names: tuple[str, ...], kinds: tuple[str, ...] = _DEVICE_KINDS) -> dict[str, list]:
    """Columns of kernels, memcpys and memsets (in that order, like `TraceData.device_activities`)
    concatenated into lists, without building a DataFrame."""
    out: dict[str, list] = {c: [] for c in names}
    for kind in kinds:
        if trace.count(kind):
            for c in names:
                out[c].extend(trace.column(kind, c))
    return out


def _groupby_keys(values: list) -> list:
    """A key column as pandas' groupby sees it: ints with a None become floats (None dropped later)."""
    if any(v is None for v in values) and all(isinstance(v, (int, float)) for v in values if v is not None):
        return [None if v is None else float(v) for v in values]
    return values


def busy_rows(trace: TraceData, by: str = "device") -> list[list]:
    """`busy_time` as row lists ([device[, stream], busy_us, activity_us, count, window_us,
    idle_fraction]), in key order. Computed once per trace and ``by`` (the header's busy fraction
    and the FLOP/s both need the per-device rows); callers only read them."""
    if by not in ("device", "stream"):
        raise ValueError("by must be 'device' or 'stream'")
    rows = trace.derived.get(("busy_rows", by))
    if rows is None:
        rows = trace.derived[("busy_rows", by)] = _busy_rows(trace, by)
    return rows


def _busy_rows(trace: TraceData, by: str) -> list[list]:
    keys = ["device"] if by == "device" else ["device", "stream"]
    cols = activity_columns(trace, (*keys, "ts_us", "dur_us"))
    ts, dur = cols["ts_us"], cols["dur_us"]
    if not ts:
        return []
    win = trace.window()
    window_us = (win[1] - win[0]) if win else 0.0
    key_cols = [_groupby_keys(cols[k]) for k in keys]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*key_cols)):
        if any(v is None or v != v for v in key):
            continue  # groupby drops missing keys
        groups.setdefault(key, []).append(i)
    rows = []
    for key in sorted(groups):
        members = groups[key]
        starts = [float(ts[i]) for i in members]
        durs = [float(dur[i]) for i in members]
        busy = intervals_union(starts, [s + d for s, d in zip(starts, durs)])
        rows.append(list(key) + [busy, pairwise_sum(durs), len(members), window_us,
                                 (1 - busy / window_us) if window_us > 0 else None])
    return rows


def busy_time(trace: TraceData, by: str = "device") -> pd.DataFrame:
    """Busy time per device (``by="device"``) or per (device, stream) (``by="stream"``).

    Busy = union of kernel, memcpy and memset intervals, so concurrent streams are not counted
    twice.  Columns: device[, stream], busy_us, activity_us (plain sum of durations), count,
    window_us (the whole trace window), idle_fraction (1 - busy/window).
    """
    import pandas as pd
    rows = busy_rows(trace, by)
    keys = ["device"] if by == "device" else ["device", "stream"]
    cols = keys + ["busy_us", "activity_us", "count", "window_us", "idle_fraction"]
    if not trace.has_device_activity:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    return pd.DataFrame(rows, columns=cols)


def _kernel_time(trace: TraceData):
    """(dur_us array, total) of the trace's kernels; total is what ``Series.sum()`` gives."""
    dur = np.asarray(trace.column("kernels", "dur_us"), dtype=float)
    return dur, float(dur.sum())


def tensor_core_share(trace: TraceData) -> TensorCoreShare:
    """Share of summed kernel time spent in kernels that use Tensor Cores (by name)."""
    n = trace.count("kernels")
    dur, total = _kernel_time(trace) if n else (None, 0.0)
    if not n or total <= 0:
        return TensorCoreShare(None, 0.0, 0.0, reason="the trace has no GPU kernels (CPU-only profile)")
    flags = trace.column("kernels", "tensor_cores")
    tc = float(dur[np.fromiter((f is True for f in flags), bool, n)].sum())
    unk_mask = np.fromiter((f is None or f != f for f in flags), bool, n)
    by_name: dict[str, list[float]] = {}
    for name, d, unk in zip(trace.column("kernels", "name"), dur.tolist(), unk_mask.tolist()):
        if unk:
            by_name.setdefault(name, []).append(d)
    names = sorted(by_name)  # groupby sorts its keys, then sort_values orders by time
    sums = [kahan_sum(by_name[nm]) for nm in names]
    return TensorCoreShare(
        tc / total, tc, total, None,
        unknown_us=float(dur[unk_mask].sum()),
        unknown_kernels={str(names[i]): float(sums[i]) for i in desc_order(sums)},
    )


def communication_share(trace: TraceData) -> Share:
    """Share of summed kernel time in communication kernels (NCCL, symmetric-memory all-reduce)."""
    n = trace.count("kernels")
    dur, total = _kernel_time(trace) if n else (None, 0.0)
    if not n or total <= 0:
        return Share(None, 0.0, 0.0, reason="the trace has no GPU kernels (CPU-only profile)")
    mask = np.fromiter((c == "communication" for c in trace.column("kernels", "category")), bool, n)
    comm = float(dur[mask].sum())
    return Share(comm / total, comm, total)


def category_rows(trace: TraceData, include_memory: bool = True) -> list[tuple[str, float, int, float]]:
    """`category_breakdown` as (category, time_us, count, percent) tuples, largest first."""
    kinds = _DEVICE_KINDS if include_memory else ("kernels",)
    cols = activity_columns(trace, ("category", "dur_us"), kinds)
    return category_totals(cols["category"], cols["dur_us"])


def category_totals(categories, times) -> list[tuple[str, float, int, float]]:
    """(category, total time, count, percent of all) per category, largest first; the device
    breakdown (kernel time) and the CPU one (self time) alike. Sums as pandas' groupby makes them
    (compensated per group, pairwise over groups), so the numbers equal the DataFrame API's."""
    members: dict[str, list[float]] = {}
    for cat, t in zip(categories, times):
        if cat is not None:
            members.setdefault(cat, []).append(float(t))
    if not members:
        return []
    cats = sorted(members)  # groupby sorts its keys
    sums = [kahan_sum(members[c]) for c in cats]
    total = pairwise_sum(sums)
    order = {c: i for i, c in enumerate(CATEGORIES)}
    rows = [(c, s, len(members[c]), 100.0 * s / total if total > 0 else 0.0) for c, s in zip(cats, sums)]
    return sorted(rows, key=lambda r: (-r[1], order.get(r[0], len(order))))  # stable, like lexsort


def category_breakdown(trace: TraceData, include_memory: bool = True) -> pd.DataFrame:
    """Device time per category (columns: category, time_us, count, percent), largest first.

    With ``include_memory`` memcpys/memsets are included (as "data transfer"/"memory copy");
    ``percent`` is of the summed durations of everything included.
    """
    import pandas as pd
    rows = category_rows(trace, include_memory)
    cols = ["category", "time_us", "count", "percent"]
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    return pd.DataFrame({
        "category": [r[0] for r in rows],
        "time_us": pd.Series([r[1] for r in rows], dtype="float64"),
        "count": pd.Series([r[2] for r in rows], dtype="int64"),
        "percent": pd.Series([r[3] for r in rows], dtype="float64"),
    })


def kernel_rows(trace: TraceData) -> list[tuple[str, int, float, str, bool | None]]:
    """Kernels aggregated by name: (name, calls, time_us, category, tensor_cores), most time
    first -- the rows of ``ProfileResult.kernels``."""
    n = trace.count("kernels")
    if not n:
        return []
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(trace.column("kernels", "name")):
        groups.setdefault(name, []).append(i)
    dur, cat, tcs = (trace.column("kernels", c) for c in ("dur_us", "category", "tensor_cores"))

    def first(col, rows):  # groupby first(): the first value that is not missing
        return next((col[i] for i in rows if not (col[i] is None or col[i] != col[i])), None)

    rows = [(name, len(m), kahan_sum(float(dur[i]) for i in m), first(cat, m), first(tcs, m))
            for name, m in groups.items()]
    return [rows[i] for i in desc_order([r[2] for r in rows])]


def _mode(values) -> Any:
    c = Counter(v for v in values if v is not None)
    return c.most_common(1)[0][0] if c else None


def op_table(trace: TraceData, sort_by: str | None = None, top: int | None = None) -> pd.DataFrame:
    """Ops aggregated by name, like ``prof.key_averages()`` plus FLOPs, largest ``sort_by`` first.

    Columns: name, category, calls, cpu_total_us, cpu_self_us, device_self_us (GPU time of
    kernels/memcpys the op launched itself), device_total_us (including its child ops),
    tc_device_us, dtype (most common), flops (sum over calls whose shapes give a formula),
    flops_per_s (flops / device_total_us; over cpu_total_us in a CPU-only trace),
    device_self_pct (of all device activity time), cpu_self_pct (of all op self time).

    ``sort_by`` (any column) defaults to ``device_self_us`` when the trace has device activity and
    to ``cpu_self_us`` when it has none: a CPU-only trace's device columns are 0 for every op, and
    sorting by them left the rows in first-seen order, so ``top`` could cut off the slowest ops.
    """
    import pandas as pd
    ops = trace.ops
    cols = ["name", "category", "calls", "cpu_total_us", "cpu_self_us", "device_self_us",
            "device_total_us", "tc_device_us", "dtype", "flops", "flops_per_s",
            "device_self_pct", "cpu_self_pct"]
    if not len(ops):
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    g = ops.groupby("name", sort=False)
    out = pd.DataFrame({
        "category": g["category"].first(),
        "calls": g.size(),
        "cpu_total_us": g["dur_us"].sum(),
        "cpu_self_us": g["self_us"].sum(),
        "device_self_us": g["device_self_us"].sum(),
        "device_total_us": g["device_total_us"].sum(),
        "tc_device_us": g["tc_device_us"].sum(),
        "dtype": g["math_dtype"].agg(_mode),
        "flops": g["flops"].sum(min_count=1),
    })
    acts = trace.device_activities()
    device_total = float(acts["dur_us"].sum()) if len(acts) else 0.0
    time_base = out["device_total_us"] if trace.has_device_activity else out["cpu_total_us"]
    out["flops_per_s"] = (out["flops"] / (time_base * 1e-6)).where(time_base > 0)
    out["device_self_pct"] = 100.0 * out["device_self_us"] / device_total if device_total > 0 else None
    self_total = float(ops["self_us"].sum())
    out["cpu_self_pct"] = 100.0 * out["cpu_self_us"] / self_total if self_total > 0 else None
    out = out.reset_index().rename(columns={"index": "name"})
    if sort_by is None:
        sort_by = "device_self_us" if trace.has_device_activity else "cpu_self_us"
    if sort_by not in out.columns:
        raise ValueError(f"sort_by must be one of {', '.join(out.columns)}")
    out = out.sort_values(sort_by, ascending=False, kind="stable").reset_index(drop=True)
    return out[cols].head(top) if top else out[cols]


@dataclass
class FlopsSummary:
    """Achieved FLOP/s of the traced region against the device peak for its dominant dtype.

    ``flops`` counts each op once (the innermost op with a shape formula). Two rates:
    ``flops_per_s`` over the device busy time (whole region), and ``matmul_flops_per_s`` over
    the device time of the counted ops only (how fast the matmul/attention kernels ran).  In a
    CPU-only trace the op *is* the compute, so ``matmul_flops_per_s`` uses the counted ops'
    CPU duration instead and ``time_base`` says ``"cpu"``.
    """

    flops: float
    flops_by_dtype: dict[str, float]
    dominant_dtype: str | None
    busy_us: float
    flops_per_s: float | None
    matmul_time_us: float
    matmul_flops_per_s: float | None
    gpu: GpuPeaks | None
    peak_flops_per_s: float | None
    fraction_of_peak: float | None
    matmul_fraction_of_peak: float | None
    reason: str | None = None
    time_base: str = "device"

    @property
    def peak_source(self) -> str | None:
        return self.gpu.source if self.gpu else None


def busiest_device(trace: TraceData):
    """The device with most summed kernel time (``groupby("device").sum().idxmax()``), or None."""
    per_device: dict = {}
    if trace.count("kernels"):
        for d, t in zip(_groupby_keys(trace.column("kernels", "device")), trace.column("kernels", "dur_us")):
            if d is not None and d == d:
                per_device.setdefault(d, []).append(float(t))
    if not per_device:
        return None
    keys = sorted(per_device)
    sums = [kahan_sum(per_device[d]) for d in keys]
    return keys[sums.index(max(sums))]  # idxmax: the first largest


def achieved_flops(trace: TraceData, device: int | None = None) -> FlopsSummary:
    """FLOPs from shapes, achieved FLOP/s, and the fraction of the GPU's dense peak.

    The device defaults to the one with most kernel time; its ``deviceProperties`` name is
    looked up in the peak table.  fp32 ops whose kernels used Tensor Cores count as tf32.
    """
    col = trace.op_columns  # lists, row-aligned with trace.ops
    counted = [i for i, c in enumerate(col["flops_counted"]) if c]
    flops_col = col["flops"]
    flops = pairwise_sum([flops_col[i] for i in counted]) if counted else 0.0
    members: dict[str, list] = {}
    for i in counted:
        d = col["math_dtype"][i]
        members.setdefault("unknown" if d is None or d != d else str(d), []).append(flops_col[i])
    by_dtype = {d: float(kahan_sum(members[d])) for d in sorted(members)}
    dominant = max(by_dtype, key=by_dtype.get) if by_dtype else None
    reasons = []
    if not flops:
        reasons.append("no op with a FLOP formula and recorded shapes (record_shapes=True?)")

    if device is None:
        device = busiest_device(trace)
    busy = 0.0
    if trace.has_device_activity:
        busy = pairwise_sum([r[1] for r in busy_rows(trace, by="device") if device is None or r[0] == device])
    else:
        reasons.append("no GPU activity in the trace: FLOP/s over device time is undefined")
    time_base = "device" if trace.has_device_activity else "cpu"
    time_col = col["device_total_us" if time_base == "device" else "dur_us"]
    matmul_us = pairwise_sum([time_col[i] for i in counted]) if counted else 0.0
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
    return FlopsSummary(
        flops=flops,
        flops_by_dtype=by_dtype,
        dominant_dtype=dominant,
        busy_us=busy,
        flops_per_s=rate,
        matmul_time_us=matmul_us,
        matmul_flops_per_s=mm_rate,
        gpu=gpu,
        peak_flops_per_s=peak,
        fraction_of_peak=(rate / peak) if rate and peak else None,
        matmul_fraction_of_peak=(mm_rate / peak) if mm_rate and peak else None,
        reason="; ".join(reasons) or None,
        time_base=time_base,
    )


def summary(trace: TraceData) -> dict[str, Any]:
    """JSON-safe headline numbers of a trace (for result objects, ``to_dict()`` and logs)."""
    tc = tensor_core_share(trace)
    comm = communication_share(trace)
    fl = achieved_flops(trace)
    bt = busy_time(trace)
    return {
        "source": trace.source,
        "device": trace.device_name(),
        "rank": trace.rank,
        "world_size": trace.world_size,
        "ops": trace.count("ops"),
        "kernels": trace.count("kernels"),
        "kernel_time_us": tc.total_us,
        "tensor_core_share": tc.value,
        "tensor_core_unknown_share": tc.unknown_share,
        "tensor_core_reason": tc.reason,
        "communication_share": comm.value,
        "idle_fraction": {str(r.device): r.idle_fraction for r in bt.itertuples()} if len(bt) else {},
        "flops": fl.flops,
        "dominant_dtype": fl.dominant_dtype,
        "flops_per_s": fl.flops_per_s,
        "peak_flops_per_s": fl.peak_flops_per_s,
        "fraction_of_peak": fl.fraction_of_peak,
        "flops_reason": fl.reason,
        "unlinked_kernels": int((trace.kernels["op_index"] < 0).sum()) if len(trace.kernels) else 0,
        "unknown_events": dict(trace.unknown_events),
    }
