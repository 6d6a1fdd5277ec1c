"""Load a torch.profiler (Kineto) Chrome trace into pandas DataFrames.

Used by the live ``%%profile_gpu`` (which exports a trace and reads it back) and by
``nbaccel.load_trace`` for traces recorded on other machines, so it must accept whatever
Kineto versions write: ``.json`` or ``.json.gz`` (detected by magic bytes, not the suffix),
lower-case ``cat`` values (``cpu_op``, ``kernel``) and the 2021 ones (``Operator``, ``Kernel``),
kernels whose ``External id`` is a real op id (recent Kineto) or just a copy of the correlation
id (the A100 reference trace), and kernels with no launching op at all (work queued before the
profiling window opened).  Unknown event kinds are counted in ``TraceData.unknown_events`` and
skipped; only input that is not a profiler trace at all raises :class:`TraceError`.

Parsing is one pass of plain loops over the event dicts into column lists (building
DataFrames row by row would make the 25 MB A100 trace take minutes instead of about a second).
"""
from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import zlib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .kernels import op_category
from .phases import foreach_rows_outside_steps
from .trace_columns import FRAME_BUILDERS, build_gpu_columns, build_op_columns, link_gpu, nest_ops

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TraceError", "TraceWarning", "TraceData", "load_trace", "paused_gc"]


class TraceError(ValueError):
    """The input is missing, unreadable, or not a torch.profiler Chrome trace."""


class TraceWarning(UserWarning):
    """A file in a folder of traces could not be read and was skipped; the others were loaded."""


# Kineto category spellings, old and new, mapped to one canonical kind.
_KIND = {
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "cuda_runtime": "runtime",
    "runtime": "runtime",
    "cuda_driver": "runtime",
    "user_annotation": "annotation",
    "gpu_user_annotation": "gpu_annotation",
}
# Categories we recognise but do not need (host Python stack, memory events, flows, spans...).
_KNOWN_UNUSED = {
    "python_function", "python", "cpu_instant_event", "ac2g", "trace", "overhead", "fwdbwd",
    "forward_backward", "async", "mtia_runtime", "mtia_ccp_events", "privateuse1_runtime",
    "privateuse1_driver", "gpu_instant_event", "cuda_sync", "cuda_event", "memory",
    "kineto", "external", "python_function_stack",
}



_ACTIVITY_COLUMNS = ("name", "device", "stream", "ts_us", "dur_us", "category", "op_index")


class TraceData:
    """A parsed trace: one DataFrame per event kind plus header information.

    DataFrames (times in microseconds, as in the trace):

    * ``ops``: name, pid, tid, ts_us, dur_us, self_us, external_id, input_dims, input_types,
      concrete_inputs, non_strided (a sparse operand: no FLOPs), category, parent (row of the
      enclosing op on the same thread, -1 if none), dtype, flops, flops_counted, device_self_us,
      device_total_us, tc_device_us, math_dtype.
    * ``kernels``: name, device, stream, ts_us, dur_us, correlation, external_id, op_index,
      op_name, link, tensor_cores, category, grid, block.
    * ``memcpy``: same launch columns plus bytes and kind (HtoD/DtoH/DtoD/...).
    * ``memset``: name, device, stream, ts_us, dur_us, bytes, correlation, external_id,
      op_index, op_name, link, category.
    * ``annotations``: record_function / ProfilerStep ranges (name, pid, tid, ts_us, dur_us,
      on_device).

    The loader fills plain column lists (``columns[kind][column]``, same names and values as
    the DataFrames) and each DataFrame is built from them on first access: building five
    DataFrames costs several milliseconds, more than parsing a ~100-op trace, and a live
    ``%%profile_gpu`` display reads most figures straight from the lists (``op_columns``).
    Frames passed to the constructor are used as given.
    """

    _KINDS = ("ops", "kernels", "memcpy", "memset", "annotations")

    def __init__(self, ops: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                 memcpy: pd.DataFrame | None = None, memset: pd.DataFrame | None = None,
                 annotations: pd.DataFrame | None = None, device_properties: list[dict] | None = None,
                 metadata: dict[str, Any] | None = None, event_counts: Counter | None = None,
                 unknown_events: Counter | None = None, source: str | None = None,
                 columns: dict[str, dict[str, list]] | None = None):
        self._frames: dict[str, pd.DataFrame] = {}
        self._window: tuple[float, float] | None | bool = False  # not computed yet
        self._activities: pd.DataFrame | None = None
        self.derived: dict = {}  # figures computed once from the (immutable) columns, e.g. busy rows
        for kind, frame in zip(self._KINDS, (ops, kernels, memcpy, memset, annotations)):
            if frame is not None:
                self._frames[kind] = frame
        self.columns: dict[str, dict[str, list]] = columns or {}
        missing = [k for k in self._KINDS if k not in self._frames and k not in self.columns]
        if missing:
            raise TypeError(f"TraceData needs a DataFrame or columns for: {', '.join(missing)}")
        self.device_properties = list(device_properties or [])
        self.metadata = dict(metadata or {})
        self.event_counts = event_counts if event_counts is not None else Counter()
        self.unknown_events = unknown_events if unknown_events is not None else Counter()
        self.source = source

    def __repr__(self) -> str:
        return (f"TraceData(source={self.source!r}, ops={self.count('ops')}, kernels={self.count('kernels')}, "
                f"memcpy={self.count('memcpy')}, memset={self.count('memset')})")

    def _frame(self, kind: str) -> pd.DataFrame:
        frame = self._frames.get(kind)
        if frame is None:
            frame = self._frames[kind] = FRAME_BUILDERS[kind](self.columns[kind])
        return frame

    ops = property(lambda self: self._frame("ops"), doc="One row per cpu_op event (see the class docstring).")
    kernels = property(lambda self: self._frame("kernels"), doc="One row per GPU kernel.")
    memcpy = property(lambda self: self._frame("memcpy"), doc="One row per GPU memcpy.")
    memset = property(lambda self: self._frame("memset"), doc="One row per GPU memset.")
    annotations = property(lambda self: self._frame("annotations"), doc="record_function / ProfilerStep ranges.")

    def count(self, kind: str) -> int:
        """Rows of one kind (``ops``, ``kernels``, ...) without building its DataFrame."""
        cols = self.columns.get(kind)
        if kind not in self._frames and cols is not None:
            return len(next(iter(cols.values()))) if cols else 0
        return len(self._frame(kind))

    def column(self, kind: str, name: str) -> list:
        """One column as a list, from the loader's lists when the DataFrame was never needed."""
        cols = self.columns.get(kind)
        if cols is not None and name in cols:
            return cols[name]
        return self._frame(kind)[name].tolist()

    @property
    def op_columns(self) -> dict[str, list]:
        """The ``ops`` columns as lists (row i of each list is row i of ``ops``)."""
        cols = self.columns.get("ops")
        if cols is None:
            cols = self.columns["ops"] = {c: self.ops[c].tolist() for c in self.ops.columns}
        return cols

    @property
    def rank(self) -> int | None:
        return self.metadata.get("rank")

    @property
    def world_size(self) -> int | None:
        return self.metadata.get("world_size")

    @property
    def has_device_activity(self) -> bool:
        return bool(self.count("kernels") or self.count("memcpy") or self.count("memset"))

    def device_activities(self) -> pd.DataFrame:
        """Kernels, memcpys and memsets in one frame (name, device, stream, ts_us, dur_us,
        category, op_index, kind) - the input for busy time and category breakdowns.

        Built once and shared (callers only read it): the concat is the costliest step of a CUDA
        profile's analysis, and the header, busy time, FLOP/s and breakdowns each need it."""
        if self._activities is None:
            self._activities = self._concat_activities()
        return self._activities

    def _concat_activities(self) -> pd.DataFrame:
        # From the loader's column lists: pd.concat of the three frames cost ~40 ms on a 140-kernel
        # H200 profile (object columns), a list extend and one DataFrame about 1 ms.
        import pandas as pd

        data: dict[str, list] = {c: [] for c in _ACTIVITY_COLUMNS}
        kinds: list[str] = []
        for kind, plural in (("kernel", "kernels"), ("memcpy", "memcpy"), ("memset", "memset")):
            n = self.count(plural)
            if n:
                for c in _ACTIVITY_COLUMNS:
                    data[c].extend(self.column(plural, c))
                kinds.extend([kind] * n)
        if not kinds:
            return pd.DataFrame({c: pd.Series(dtype=object) for c in (*_ACTIVITY_COLUMNS, "kind")})
        df = pd.DataFrame({**data, "kind": kinds})
        return df.astype({"ts_us": "float64", "dur_us": "float64", "op_index": "int64"})

    def window(self) -> tuple[float, float] | None:
        """(start, end) in us over ops, annotations and device activity; None if empty."""
        if self._window is False:
            starts, ends = [], []
            for kind in ("ops", "annotations", "kernels", "memcpy", "memset"):
                if self.count(kind):
                    ts = np.asarray(self.column(kind, "ts_us"), dtype=float)
                    dur = np.asarray(self.column(kind, "dur_us"), dtype=float)
                    starts.append(float(ts.min()))
                    ends.append(float((ts + dur).max()))
            self._window = (min(starts), max(ends)) if starts else None
        return self._window

    def device_name(self, device: int | None = None) -> str | None:
        """GPU name from ``deviceProperties`` (first device if ``device`` is None)."""
        for props in self.device_properties:
            if device is None or props.get("id") == device:
                return props.get("name")
        return None

    def device_props(self, device: int | None = None) -> dict | None:
        for props in self.device_properties:
            if device is None or props.get("id") == device:
                return props
        return None


# --- reading -----------------------------------------------------------------------------

@contextlib.contextmanager
def paused_gc():
    """Suspend Python's cyclic garbage collector while a trace's objects are created.

    ``json.loads`` and the loader create several containers per event (the event dict, its
    args, the shape lists). Such an allocation burst triggers collection after collection, and
    each full collection walks every object alive in the process -- torch's and the user's
    too: on a 4 MB, 10,000-event trace the parse took 120 ms with the collector on and 42 ms
    with it off, and up to 3x more in a busier process. Nothing made here forms a reference
    cycle, so collection can wait until the trace is read; the collector is switched back on
    afterwards (only if it was on). It is process-wide: other threads collect no cycles during
    that time either, which for a parse lasting milliseconds to seconds is harmless.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _read_json(path: Path) -> Any:
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    if path.is_dir():
        raise TraceError(f"{path}: is a directory, expected a .json or .json.gz trace file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from exc
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise TraceError(f"{path}: truncated or corrupt gzip data ({exc})") from exc
    if not raw.strip():
        raise TraceError(f"{path}: file is empty, expected a torch.profiler JSON trace")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not JSON text (binary data: {exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise TraceError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "a trace cut off while writing looks like this"
        ) from exc


def _events_of(doc: Any, where: str) -> tuple[list, dict]:
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
        if not isinstance(events, list):
            keys = ", ".join(sorted(map(str, doc))[:8]) or "no keys"
            raise TraceError(
                f"{where}: JSON is not a torch.profiler trace (no 'traceEvents' list; found {keys})"
            )
        return events, doc
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and "ph" in e for e in doc[:50]):
        return doc, {}  # Chrome "JSON Array Format": events only, no header
    raise TraceError(
        f"{where}: JSON is not a torch.profiler trace (top level is {type(doc).__name__}, "
        "expected an object with 'traceEvents')"
    )


def _num(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def load_trace(source: str | os.PathLike | Mapping | list) -> TraceData:
    """Parse a torch.profiler Chrome trace (path to ``.json``/``.json.gz``, or parsed JSON)."""
    if isinstance(source, (str, os.PathLike)):
        where = str(source)
    elif isinstance(source, (Mapping, list)):
        where = "<dict>"
    else:
        raise TraceError(f"expected a path or a parsed trace dict, got {type(source).__name__}")
    with paused_gc():
        doc = _read_json(Path(source)) if isinstance(source, (str, os.PathLike)) else source
        events, header = _events_of(doc, where)
        return _build(events, header, where if isinstance(source, (str, os.PathLike)) else None)


def _non_strided(name: str, args: Mapping) -> bool:
    """Whether an op took a sparse tensor (COO, CSR, ...): the profiler records its dims but no strides.
    Its FLOPs are not those of its dims (a 2000x2000 sparse matrix with 2000 nonzeros read as a dense
    one: 1 TFLOP/s on a 2-core CPU, a user trial), nor do its dims want padding. oneDNN's tensors have
    no strides either, but are dense: they go to its own ops (``aten::mkldnn_convolution``), left out."""
    if "mkldnn" in name:
        return False
    dims, strides = args.get("Input Dims"), args.get("Input Strides")
    if not isinstance(dims, list) or not isinstance(strides, list) or len(dims) != len(strides):
        return False  # older traces record no strides
    for d, s in zip(dims, strides):  # a plain loop: 0.6 us per op on the H200 trace, about half of any()'s
        if not s and d and isinstance(d, list) and isinstance(s, list):
            return True
    return False


def _build(events: list, header: Mapping, source: str | None) -> TraceData:
    counts: Counter = Counter()
    unknown: Counter = Counter()
    op_cols: dict[str, list] = {k: [] for k in (
        "name", "pid", "tid", "ts_us", "dur_us", "external_id", "input_dims", "input_types",
        "concrete_inputs", "non_strided", "sequence", "forward_tid")}
    gpu: dict[str, list] = {k: [] for k in (
        "kind", "name", "device", "stream", "ts_us", "dur_us", "correlation", "external_id",
        "bytes", "grid", "block")}
    ann: dict[str, list] = {k: [] for k in ("name", "pid", "tid", "ts_us", "dur_us", "on_device")}
    runtime: dict[Any, tuple] = {}  # correlation -> (pid, tid, ts, external id)

    for ev in events:
        if not isinstance(ev, dict):
            unknown["<not an object>"] += 1
            continue
        cat = ev.get("cat")
        key = cat.lower() if isinstance(cat, str) else None
        counts[cat if isinstance(cat, str) else str(cat)] += 1
        kind = _KIND.get(key)
        if kind is None:
            if cat is not None and key not in _KNOWN_UNUSED:
                unknown[str(cat)] += 1
            continue
        if ev.get("ph", "X") != "X":
            continue  # kineto writes complete events; anything else under these cats is noise
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
        if ts is None or dur is None:
            unknown[f"{cat} without ts/dur"] += 1
            continue
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        name = str(ev.get("name", ""))
        if kind == "cpu_op":
            op_cols["name"].append(name)
            op_cols["pid"].append(ev.get("pid"))
            op_cols["tid"].append(ev.get("tid"))
            op_cols["ts_us"].append(ts)
            op_cols["dur_us"].append(dur)
            op_cols["external_id"].append(args.get("External id"))
            op_cols["input_dims"].append(args.get("Input Dims"))
            op_cols["input_types"].append(args.get("Input type"))
            op_cols["concrete_inputs"].append(args.get("Concrete Inputs"))
            op_cols["non_strided"].append(_non_strided(name, args))
            # autograd's sequence number: a backward node has its forward op's (and the forward's thread)
            op_cols["sequence"].append(args.get("Sequence number"))
            op_cols["forward_tid"].append(args.get("Fwd thread id"))
        elif kind in ("kernel", "memcpy", "memset"):
            gpu["kind"].append(kind)
            gpu["name"].append(name)
            gpu["device"].append(args.get("device", ev.get("pid")))
            gpu["stream"].append(args.get("stream", ev.get("tid")))
            gpu["ts_us"].append(ts)
            gpu["dur_us"].append(dur)
            gpu["correlation"].append(args.get("correlation"))
            gpu["external_id"].append(args.get("External id"))
            gpu["bytes"].append(args.get("bytes"))
            gpu["grid"].append(args.get("grid"))
            gpu["block"].append(args.get("block"))
        elif kind == "runtime":
            corr = args.get("correlation")
            if corr is not None:
                runtime[corr] = (ev.get("pid"), ev.get("tid"), ts, args.get("External id"))
        else:  # annotations
            ann["name"].append(name)
            ann["pid"].append(ev.get("pid"))
            ann["tid"].append(ev.get("tid"))
            ann["ts_us"].append(ts)
            ann["dur_us"].append(dur)
            ann["on_device"].append(kind == "gpu_annotation")

    nesting = nest_ops(op_cols)
    links = link_gpu(gpu, op_cols, runtime, nesting)
    columns = {"ops": build_op_columns(op_cols, nesting, gpu, links), "annotations": ann,
               **build_gpu_columns(gpu, links, op_cols["name"])}
    _foreach_kernels_by_their_op(columns["kernels"], op_cols, ann)
    return TraceData(
        columns=columns,
        device_properties=list(header.get("deviceProperties") or []),
        metadata=_metadata(header),
        event_counts=counts,
        unknown_events=unknown,
        source=source,
    )


def _foreach_kernels_by_their_op(kernels: dict, op_cols: dict, ann: dict) -> None:
    """A foreach op's kernels outside the optimizer's step take the op's category: ``multi_tensor_apply_kernel``
    is named "optimizer" by `kernel_category` (the foreach optimizers' update, Adam's default on CUDA), but
    ``clip_grad_norm_`` runs the same kernel for its norms and scaling, which the device breakdown then filed
    under the optimizer (the host side already read those ops as reduction/elementwise, `op_category`)."""
    if "optimizer" not in kernels["category"]:
        return
    rows = foreach_rows_outside_steps(op_cols, ann)
    cats = kernels["category"]
    for k, (op_i, cat) in enumerate(zip(kernels["op_index"], cats)):
        if cat == "optimizer" and op_i in rows:
            cats[k] = op_category(op_cols["name"][op_i])


def _metadata(header: Mapping) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    dist = header.get("distributedInfo")
    if isinstance(dist, dict):
        meta["rank"] = dist.get("rank")
        meta["world_size"] = dist.get("world_size")
        meta["backend"] = dist.get("backend")
    for k in ("schemaVersion", "cuda_runtime_version", "cuda_driver_version", "cupti_version",
              "record_shapes", "with_flops", "with_stack", "profile_memory", "displayTimeUnit",
              "baseTimeNanoseconds", "trace_id", "host_name"):
        if k in header:
            meta[k] = header[k]
    if isinstance(header.get("metadata"), dict):
        meta["user_metadata"] = header["metadata"]
    return meta
