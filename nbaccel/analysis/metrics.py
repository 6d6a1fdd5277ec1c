"""Figures computed from a :class:`~nbaccel.analysis.trace.TraceData`.

Conventions, chosen so numbers can be checked against the reference traces' README:

* Shares of "kernel time" (Tensor Core, communication) sum kernel ``dur`` with no overlap
  handling, like HTA and the traces README's ground truth.  Overlap matters for *busy* time,
  which is computed separately as a union of intervals.
* A figure that cannot be computed is ``None`` with a ``reason`` string, never 0: a CPU-only
  trace has no Tensor Core share, it does not have a 0 % one.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .kernels import CATEGORIES
from .peaks import GpuPeaks, lookup_gpu, peak_flops
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


def _intervals_union(starts: list[float], ends: list[float]) -> float:
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(zip(starts, ends)):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def busy_time(trace: TraceData, by: str = "device") -> pd.DataFrame:
    """Busy time per device (``by="device"``) or per (device, stream) (``by="stream"``).

    Busy = union of kernel, memcpy and memset intervals, so concurrent streams are not counted
    twice.  Columns: device[, stream], busy_us, activity_us (plain sum of durations), count,
    window_us (the whole trace window), idle_fraction (1 - busy/window).
    """
    import pandas as pd
    if by not in ("device", "stream"):
        raise ValueError("by must be 'device' or 'stream'")
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
        busy = _intervals_union(starts, ends)
        rows.append(list(key) + [busy, float(grp["dur_us"].sum()), len(grp), window_us,
                                 (1 - busy / window_us) if window_us > 0 else None])
    return pd.DataFrame(rows, columns=cols)


def tensor_core_share(trace: TraceData) -> TensorCoreShare:
    """Share of summed kernel time spent in kernels that use Tensor Cores (by name)."""
    k = trace.kernels if trace.count("kernels") else None  # a CPU-only trace never builds the frame
    total = float(k["dur_us"].sum()) if k is not None else 0.0
    if k is None or total <= 0:
        return TensorCoreShare(None, 0.0, 0.0, reason="the trace has no GPU kernels (CPU-only profile)")
    tc = float(k.loc[k["tensor_cores"].eq(True), "dur_us"].sum())
    unk = k[k["tensor_cores"].isna()]
    unknown = unk.groupby("name")["dur_us"].sum().sort_values(ascending=False)
    return TensorCoreShare(
        tc / total, tc, total, None,
        unknown_us=float(unk["dur_us"].sum()),
        unknown_kernels={str(n): float(v) for n, v in unknown.items()},
    )


def communication_share(trace: TraceData) -> Share:
    """Share of summed kernel time in communication kernels (NCCL, symmetric-memory all-reduce)."""
    k = trace.kernels if trace.count("kernels") else None
    total = float(k["dur_us"].sum()) if k is not None else 0.0
    if k is None or total <= 0:
        return Share(None, 0.0, 0.0, reason="the trace has no GPU kernels (CPU-only profile)")
    comm = float(k.loc[k["category"].eq("communication"), "dur_us"].sum())
    return Share(comm / total, comm, total)


def category_breakdown(trace: TraceData, include_memory: bool = True) -> pd.DataFrame:
    """Device time per category (columns: category, time_us, count, percent), largest first.

    With ``include_memory`` memcpys/memsets are included (as "data transfer"/"memory copy");
    ``percent`` is of the summed durations of everything included.
    """
    import pandas as pd
    acts = trace.device_activities() if include_memory else trace.kernels
    cols = ["category", "time_us", "count", "percent"]
    if not len(acts):
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    g = acts.groupby("category")["dur_us"].agg(["sum", "count"])
    total = float(g["sum"].sum())
    out = pd.DataFrame({
        "category": g.index,
        "time_us": g["sum"].values,
        "count": g["count"].values,
        "percent": (100.0 * g["sum"] / total).values if total > 0 else 0.0,
    })
    order = {c: i for i, c in enumerate(CATEGORIES)}
    out["_o"] = out["category"].map(order)
    return out.sort_values(["time_us", "_o"], ascending=[False, True]).drop(columns="_o").reset_index(drop=True)


def _mode(values) -> Any:
    c = Counter(v for v in values if v is not None)
    return c.most_common(1)[0][0] if c else None


def op_table(trace: TraceData, sort_by: str = "device_self_us", top: int | None = None) -> pd.DataFrame:
    """Ops aggregated by name, like ``prof.key_averages()`` plus FLOPs.

    Columns: name, category, calls, cpu_total_us, cpu_self_us, device_self_us (GPU time of
    kernels/memcpys the op launched itself), device_total_us (including its child ops),
    tc_device_us, dtype (most common), flops (sum over calls whose shapes give a formula),
    flops_per_s (flops / device_total_us; over cpu_total_us in a CPU-only trace),
    device_self_pct (of all device activity time), cpu_self_pct (of all op self time).
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


def achieved_flops(trace: TraceData, device: int | None = None) -> FlopsSummary:
    """FLOPs from shapes, achieved FLOP/s, and the fraction of the GPU's dense peak.

    The device defaults to the one with most kernel time; its ``deviceProperties`` name is
    looked up in the peak table.  fp32 ops whose kernels used Tensor Cores count as tf32.
    """
    ops = trace.ops
    counted = ops[ops["flops_counted"]] if len(ops) else ops
    flops = float(counted["flops"].sum()) if len(counted) else 0.0
    by_dtype: dict[str, float] = {}
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
        bt = busy_time(trace, by="device")
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
        "ops": int(len(trace.ops)),
        "kernels": int(len(trace.kernels)),
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
