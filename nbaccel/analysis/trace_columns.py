"""From a trace's raw event columns to the analysed ones: op nesting and self time, which op
launched each kernel, per-op device time, FLOPs and dtypes, kernel categories and Tensor Cores.

`nbaccel.analysis.trace` reads the events into plain column lists and calls these; the
DataFrames (`FRAME_BUILDERS`) are built only when a `TraceData` frame is first read.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .kernels import kernel_category, op_category, uses_tensor_cores
from .op_flops import dtype_of, op_flops
from .phases import compile_flags

if TYPE_CHECKING:
    import pandas as pd

_MEMCPY_KIND = re.compile(r"Memcpy\s+(HtoD|DtoH|DtoD|HtoH|PtoP|HtoA|AtoH|AtoD|DtoA)", re.IGNORECASE)


# --- op nesting, self time, launch links ---------------------------------------------------

@dataclass
class Nesting:
    parent: list[int]
    self_us: list[float]
    # per thread: sorted op starts and row ids, for "innermost op enclosing time t" queries
    threads: dict[tuple, tuple[list[float], list[int]]]


def nest_ops(op: dict[str, list]) -> Nesting:
    """Parent and self time of every op by interval nesting on its (pid, tid).

    Ops on one thread form a tree in time (Kineto records them as RAII ranges); sorting by
    (start, -duration) puts parents before children, and a stack sweep finds each op's
    innermost enclosing op.  Self time = duration minus the direct children's overlap.
    """
    n = len(op["name"])
    parent = [-1] * n
    self_us = list(op["dur_us"])
    by_thread: dict[tuple, list[int]] = {}
    for i in range(n):
        by_thread.setdefault((op["pid"][i], op["tid"][i]), []).append(i)
    ts, dur = op["ts_us"], op["dur_us"]
    threads = {}
    for key, rows in by_thread.items():
        rows.sort(key=lambda i: (ts[i], -dur[i]))
        stack: list[int] = []
        for i in rows:
            start, end = ts[i], ts[i] + dur[i]
            while stack and ts[stack[-1]] + dur[stack[-1]] <= start:
                stack.pop()
            if stack:
                p = stack[-1]
                parent[i] = p
                self_us[p] -= min(end, ts[p] + dur[p]) - start
            stack.append(i)
        threads[key] = ([ts[i] for i in rows], rows)
    return Nesting(parent, [max(0.0, s) for s in self_us], threads)


def innermost_op(threads: Mapping, parent, end, key: tuple, t: float) -> int:
    """Innermost op on thread ``key`` whose range contains time ``t``, or -1.

    ``threads``: per thread, (op starts sorted, parents first; their row ids); ``parent[i]`` the
    enclosing op of row ``i`` (-1 at the top); ``end(i)`` when row ``i`` ends. Shared by the
    loader (kernel launches -> ops) and the profile tables (memory events -> ops).
    """
    entry = threads.get(key)
    if entry is None:
        return -1
    starts, rows = entry
    j = bisect_right(starts, t) - 1
    if j < 0:
        return -1
    i = int(rows[j])
    # The last op starting before t may have ended; its ancestors are the other candidates.
    while i >= 0 and end(i) < t:
        i = int(parent[i])
    return i


def _innermost_op(nest: Nesting, ts: list, dur: list, key: tuple, t: float) -> int:
    return innermost_op(nest.threads, nest.parent, lambda i: ts[i] + dur[i], key, t)


def link_gpu(gpu: dict, op: dict, runtime: dict, nest: Nesting) -> list[tuple[int, str | None]]:
    """For each GPU activity: (row of launching op or -1, how it was linked).

    1. ``External id`` equal to a cpu_op's ``External id`` (recent Kineto).  Old Kineto copies
       the correlation id into ``External id``; then it names no op and is ignored.
    2. Else the ``cuda_runtime``/``cuda_driver`` launch with the same ``correlation``: its own
       ``External id``, or the innermost op enclosing the launch call on its thread.
    3. Else -1: e.g. work queued before the profiler started (436 kernels of the H100 trace).
    """
    ext_to_op: dict[Any, int] = {}
    for i, x in enumerate(op["external_id"]):
        if x is not None:
            prev = ext_to_op.get(x)
            # duplicates would be nested ranges; the later-starting one is the inner one
            if prev is None or op["ts_us"][i] >= op["ts_us"][prev]:
                ext_to_op[x] = i
    out = []
    for ext, corr in zip(gpu["external_id"], gpu["correlation"]):
        if ext is not None and ext != corr and ext in ext_to_op:
            out.append((ext_to_op[ext], "external_id"))
            continue
        launch = runtime.get(corr) if corr is not None else None
        if launch is None:
            out.append((-1, None))
            continue
        pid, tid, t, rext = launch
        if rext is not None and rext != corr and rext in ext_to_op:
            out.append((ext_to_op[rext], "correlation"))
            continue
        i = _innermost_op(nest, op["ts_us"], op["dur_us"], (pid, tid), t)
        out.append((i, "correlation" if i >= 0 else None))
    return out


def build_op_columns(op: dict, nest: Nesting, gpu: dict, links: list) -> dict[str, list]:
    """The ``ops`` columns as lists; `_ops_frame` turns them into the DataFrame."""
    n = len(op["name"])
    parent = nest.parent
    dev_self = [0.0] * n
    dev_total = [0.0] * n
    tc_total = [0.0] * n
    for (i, _), kind, name, dur in zip(links, gpu["kind"], gpu["name"], gpu["dur_us"]):
        if i < 0:
            continue
        dev_self[i] += dur
        tc = kind == "kernel" and uses_tensor_cores(name) is True
        j = i
        while j >= 0:
            dev_total[j] += dur
            if tc:
                tc_total[j] += dur
            j = parent[j]
    flops = [None if sparse else op_flops(nm, d, t, c) for nm, d, t, c, sparse in zip(
        op["name"], op["input_dims"], op["input_types"], op["concrete_inputs"], op["non_strided"])]
    # Ops recorded while torch.compile compiles trace the model on fake tensors (shapes, no data):
    # no math ran, so they have no FLOPs (analysis/phases.py).
    compiling = compile_flags(op["name"], parent)
    flops = [None if c else f for f, c in zip(flops, compiling)]
    # Count FLOPs once: aten::linear -> aten::addmm both have a formula; only the innermost
    # op with a formula is counted in totals (as torch.utils.flop_counter counts dispatched ops).
    has_flop_child = [False] * n
    for i in range(n):
        if flops[i] is not None:
            j = parent[i]
            while j >= 0 and not has_flop_child[j]:
                has_flop_child[j] = True
                j = parent[j]
    dtypes = [dtype_of(t) for t in op["input_types"]]
    # fp32 matmuls that ran on tensor cores ran as TF32 (cuBLAS/cuDNN with allow_tf32).
    math_dtype = [("tf32" if d == "fp32" and tc_total[i] > 0 else d) for i, d in enumerate(dtypes)]
    return {
        "name": op["name"],
        "pid": op["pid"],
        "tid": op["tid"],
        "ts_us": op["ts_us"],
        "dur_us": op["dur_us"],
        "self_us": nest.self_us,
        "external_id": op["external_id"],
        "input_dims": op["input_dims"],
        "input_types": op["input_types"],
        "concrete_inputs": op["concrete_inputs"],
        "non_strided": op["non_strided"],
        "sequence": op.get("sequence") or [None] * n,
        "forward_tid": op.get("forward_tid") or [None] * n,
        "category": [op_category(x) for x in op["name"]],
        "parent": parent,
        "compiling": compiling,  # in a torch.compile range (analysis/phases.py); kept for the categories
        "dtype": dtypes,
        "flops": flops,
        "flops_counted": [f is not None and not has_flop_child[i] for i, f in enumerate(flops)],
        "device_self_us": dev_self,
        "device_total_us": dev_total,
        "tc_device_us": tc_total,
        "math_dtype": math_dtype,
    }


_FLOAT_OP_COLUMNS = ("ts_us", "dur_us", "self_us", "flops", "device_self_us", "device_total_us", "tc_device_us")


def _ops_frame(cols: dict[str, list]) -> pd.DataFrame:
    import pandas as pd

    data = {}
    for name, values in cols.items():
        if name in _FLOAT_OP_COLUMNS:
            data[name] = pd.Series(values, dtype="float64")
        elif name == "parent":
            data[name] = pd.Series(values, dtype="int64")
        else:
            data[name] = values
    return pd.DataFrame(data)


_GPU_COMMON = ["name", "device", "stream", "ts_us", "dur_us", "correlation", "external_id",
               "op_index", "op_name", "link", "category"]
_GPU_LAYOUT = {
    "kernels": _GPU_COMMON + ["tensor_cores", "grid", "block"],
    "memcpy": _GPU_COMMON + ["bytes", "kind"],
    "memset": _GPU_COMMON + ["bytes"],
}


def build_gpu_columns(gpu: dict, links: list, op_names: list) -> dict[str, dict[str, list]]:
    """Kernel, memcpy and memset columns as lists (``kernels``/``memcpy``/``memset``)."""
    tc_cache: dict[str, bool | None] = {}
    cat_cache: dict[str, str] = {}
    rows: dict[str, dict[str, list]] = {}
    for idx, kind in enumerate(gpu["kind"]):
        name = gpu["name"][idx]
        op_i, link = links[idx]
        r = rows.setdefault(kind, {k: [] for k in (
            "name", "device", "stream", "ts_us", "dur_us", "correlation", "external_id",
            "op_index", "op_name", "link", "category", "tensor_cores", "grid", "block",
            "bytes", "kind")})
        if name not in cat_cache:
            cat_cache[name] = kernel_category(name)
            tc_cache[name] = uses_tensor_cores(name) if kind == "kernel" else False
        r["name"].append(name)
        r["device"].append(gpu["device"][idx])
        r["stream"].append(gpu["stream"][idx])
        r["ts_us"].append(gpu["ts_us"][idx])
        r["dur_us"].append(gpu["dur_us"][idx])
        r["correlation"].append(gpu["correlation"][idx])
        r["external_id"].append(gpu["external_id"][idx])
        r["op_index"].append(op_i)
        r["op_name"].append(op_names[op_i] if op_i >= 0 else None)
        r["link"].append(link)
        r["category"].append(cat_cache[name])
        r["tensor_cores"].append(tc_cache[name])
        r["grid"].append(gpu["grid"][idx])
        r["block"].append(gpu["block"][idx])
        r["bytes"].append(gpu["bytes"][idx])
        m = _MEMCPY_KIND.search(name) if kind == "memcpy" else None
        r["kind"].append(f"{m.group(1)[0].upper()}to{m.group(1)[-1].upper()}" if m else None)

    out = {}
    for kind, plural in (("kernel", "kernels"), ("memcpy", "memcpy"), ("memset", "memset")):
        data = rows.get(kind)
        out[plural] = {c: (data[c] if data else []) for c in _GPU_LAYOUT[plural]}
    return out


def _gpu_frame(kind: str, cols: dict[str, list]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame({c: cols[c] for c in _GPU_LAYOUT[kind]})
    df["ts_us"] = df["ts_us"].astype("float64")
    df["dur_us"] = df["dur_us"].astype("float64")
    df["op_index"] = df["op_index"].astype("int64")
    if kind == "kernels":
        df["tensor_cores"] = df["tensor_cores"].astype(object)
    return df


def _annotations_frame(cols: dict[str, list]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(cols)


FRAME_BUILDERS = {
    "ops": _ops_frame,
    "kernels": lambda cols: _gpu_frame("kernels", cols),
    "memcpy": lambda cols: _gpu_frame("memcpy", cols),
    "memset": lambda cols: _gpu_frame("memset", cols),
    "annotations": _annotations_frame,
}
