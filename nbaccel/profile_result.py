"""`ProfileResult`: one profile -- the parsed trace, and every table and figure derived from it.

Made by `nbaccel.profile` (a live profile) and `nbaccel.load_trace` (a trace recorded elsewhere)
from the same `TraceData`. Nothing is computed until it is read; what a display shows is
computed from the trace's column lists in plain Python, the DataFrames on first access (the
method and its measurements: the `nbaccel.profile` docstring, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import profile_table as pt
from .analysis import (FlopsSummary, TraceData, achieved_flops, category_breakdown, communication_share, load_trace,
                       tensor_core_share)
from .analysis import phases
from .analysis.metrics import activity_columns, busy_rows, category_rows, kernel_rows
from .contention import Contention, warning_line
from .device import DeviceInfo
from .op_attribution import memory_by_op, source_by_op
from .precision import Recipe
from .profile_advice import advise
from .kept_fp32 import kept_fp32_by
from .profile_options import ProfileError, ProfileOptions, check_table_args, check_table_fits, table_sort
from .results import ResultMixin
from .trace_io import write_trace_bytes

if TYPE_CHECKING:
    import pandas as pd

# Up to this many op events the displayed tables are built in plain Python (pandas' fixed cost per
# groupby/sort is most of the time on a few hundred rows); above it, with pandas (its vectorized
# groupby is faster per row). Both give the same numbers: tests/test_profile_rows.py.
PYTHON_TABLE_OPS = 5000



@dataclass
class ProfileResult(ResultMixin):
    """One profile: the parsed trace, and every table and figure derived from it.

    ``ops`` (DataFrame, grouped as the options asked), ``table(...)`` for any grouping/sort/filter,
    ``categories``, ``tensor_cores``, ``unaligned``, ``advice``, ``header``, ``trace_path``,
    ``export_chrome_trace(path)``, ``to_dict()``. Times are microseconds in the DataFrames.

    Everything is computed on first access and cached. What a display needs (``header``,
    ``top_rows()``, ``category_rows``, ``unaligned``, ``advice``) is computed with plain Python
    over the trace's column lists (`op_columns`); the DataFrames (``ops``, ``op_events``,
    ``categories``, ``table()``) are built with pandas when first asked for. Both give the same
    numbers (see `nbaccel.profile_table`).
    """

    kind = "profile"

    device: DeviceInfo
    options: ProfileOptions
    trace: TraceData = field(repr=False)
    # Per-op columns beyond trace.ops (``source`` with --stack, memory with --memory), row-aligned.
    op_extra: dict = field(default_factory=dict, repr=False)
    recipe_label: str | None = None
    cudnn_benchmark: bool | None = False  # None: unknown (a loaded trace does not record it)
    trace_path: str | None = None
    trace_files: list = field(default_factory=list)
    doc: dict = field(default=None, repr=False)  # the raw Chrome trace, for export_chrome_trace
    value: object = field(default=None, repr=False)  # last run's value (not serialized)
    # Set for a trace recorded elsewhere (nbaccel.load_trace): file(s), GPU, rank, skipped events.
    # None for a live profile; renderers and advice read it to say which of the two they show.
    loaded: dict | None = None
    # Other programs' CPU use during the active steps (a live profile); None for a loaded trace.
    contention: Contention | None = None
    made_by: str = "profile()"  # or "%%profile_gpu"; a loaded trace: "load_trace()", "%profile_trace"
    trace_created: str | None = None  # the outermost folder that writing the trace created, if any
    trace_earlier: list = field(default_factory=list)  # trace files --trace FOLDER held already (other runs)
    unrecorded_steps: int = 0  # prof.step() calls after the default one step ended the recording
    # Likely the code's first run in the process, one-off setup (oneDNN/cuDNN, allocator growth) in its times:
    # %%profile_gpu sets it (no --warmup, and the cell's code had not run in the session under this recipe:
    # nbaccel.magics.ran_before); None where nothing tells (the API, a loaded trace). compare_profiles says so.
    first_run: bool | None = None
    _grouped: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_trace(cls, doc: dict, info: DeviceInfo, options: ProfileOptions, recipe: Recipe | None = None,
                   cudnn_benchmark: bool = False, trace_path: str | None = None, trace_files=(),
                   contention: Contention | None = None, **fields) -> "ProfileResult":
        """Analyse a parsed Chrome trace (live, or recorded elsewhere) into a result; ``fields``: more
        of the result's own fields (``made_by``, ``trace_created``)."""
        return cls.from_trace_data(load_trace(doc), doc.get("traceEvents", []), info, options, recipe=recipe,
                                   cudnn_benchmark=cudnn_benchmark, trace_path=trace_path,
                                   trace_files=trace_files, doc=doc, contention=contention, **fields)

    @classmethod
    def from_trace_data(cls, trace: TraceData, events, info: DeviceInfo, options: ProfileOptions,
                        recipe: Recipe | None = None, cudnn_benchmark: bool | None = False,
                        trace_path: str | None = None, trace_files=(), doc: dict | None = None,
                        loaded: dict | None = None, contention: Contention | None = None,
                        **fields) -> "ProfileResult":
        """A result from an already parsed `TraceData`. ``events`` (raw Chrome events) are only
        read for ``options.stack`` (python_function frames) and ``options.memory`` ([memory]
        events); `nbaccel.load_trace` streams big files and passes just those events."""
        extra = {}
        if options.stack:
            extra["source"] = source_by_op(events, trace.ops)
        if options.memory:
            self_mem, total_mem = memory_by_op(events, trace.ops, device="cuda" if info.type == "cuda" else "cpu")
            extra["self_memory_bytes"], extra["memory_bytes"] = self_mem, total_mem
        return cls(device=info, options=options, trace=trace, op_extra=extra,
                   recipe_label=recipe.label if recipe else None, cudnn_benchmark=cudnn_benchmark,
                   trace_path=trace_path, trace_files=list(trace_files), doc=doc, loaded=loaded,
                   contention=contention, **fields)

    # -- per-op rows --

    @functools.cached_property
    def op_columns(self) -> dict[str, list]:
        """Every op event as column lists: `TraceData.op_columns` (+ source, memory; ``shapes``
        is added by `op_shapes` only when a table groups by shape)."""
        cols = dict(self.trace.op_columns)
        for key, values in self.op_extra.items():
            cols[key] = values.tolist() if isinstance(values, np.ndarray) else list(values)
        return cols

    @functools.cached_property
    def op_shapes(self) -> list[str]:
        """Input shapes of every op as text ("64x1001, 300x1001"); the op+shape grouping key."""
        shapes = self.op_columns.get("shapes")
        if shapes is None:
            shapes = self.op_columns["shapes"] = [pt._shape_text(d) for d in self.op_columns["input_dims"]]
        return shapes

    @property
    def python_tables(self) -> bool:
        """Whether the display's tables are computed in plain Python (the usual live profile) or
        with pandas (above `PYTHON_TABLE_OPS` op events, where pandas' vectorized groupby wins)."""
        return self.op_count <= PYTHON_TABLE_OPS

    @functools.cached_property
    def op_events(self) -> pd.DataFrame:
        """One row per op event: ``trace.ops`` + shapes (+ source, memory); a DataFrame."""
        ops = self.trace.ops
        extra = {"shapes": self.op_shapes, **self.op_extra}
        return ops.assign(**extra) if len(ops) else ops.assign(**{k: [] for k in extra})

    # -- headline numbers --

    @property
    def on_device(self) -> bool:
        return self.trace.has_device_activity

    @functools.cached_property
    def window_us(self) -> float:
        win = self.trace.window()
        return (win[1] - win[0]) if win else 0.0

    @functools.cached_property
    def _step_marks(self) -> list[tuple[float, float, str]]:
        """(start, duration, name) of each recorded step (the host's ``ProfilerStep#`` ranges), in order."""
        t = self.trace
        return sorted((float(ts), float(dur), str(name)) for name, ts, dur, dev in
                      zip(*(t.column("annotations", c) for c in ("name", "ts_us", "dur_us", "on_device")))
                      if str(name).startswith("ProfilerStep#") and not dev)

    @property
    def _steps(self) -> list[tuple[float, float]]:
        """(start, duration) of each recorded step, in order."""
        return [(ts, dur) for ts, dur, _ in self._step_marks]

    @functools.cached_property
    def step_numbers(self) -> list[int]:
        """The N of each recorded ``ProfilerStep#N``, in time order. torch numbers every ``prof.step()``
        call from 0, recorded or not, so the first one is how many steps ran before the recording began
        (a schedule's skip_first + wait + warmup, nbaccel's warmup)."""
        return [int(n) for *_, name in self._step_marks for n in [name[len("ProfilerStep#"):]] if n.isdigit()]

    @property
    def step_ranges_us(self) -> list[tuple[float, float]]:
        """(start, end) of each recorded step, in order."""
        return [(ts, ts + dur) for ts, dur in self._steps]

    @property
    def step_times_us(self) -> list[float]:
        return [dur for _, dur in self._steps]  # the recorded durations, not end - start (float rounding)

    @functools.cached_property
    def device_time_us(self) -> float:
        if not self.on_device:
            return 0.0
        return pt.pairwise_sum(activity_columns(self.trace, ("dur_us",))["dur_us"])

    @functools.cached_property
    def busy(self) -> dict | None:
        """Device busy time (union of kernels and copies) against the profile's window, or None on CPU."""
        if not self.on_device:
            return None
        busy = pt.pairwise_sum([r[1] for r in busy_rows(self.trace)])
        return {"busy_us": busy, "window_us": self.window_us,
                "busy_fraction": busy / self.window_us if self.window_us > 0 else None}

    @functools.cached_property
    def flops(self) -> FlopsSummary:
        return achieved_flops(self.trace)

    @property
    def kernel_count(self) -> int:
        return self.trace.count("kernels")

    @property
    def op_count(self) -> int:
        """Op events in the trace, nested ones included (a re-dispatch too)."""
        return self.trace.count("ops")

    @property
    def op_calls(self) -> int:
        """Op calls as the operator table counts them: every op event but a wrapper's re-dispatch of
        the same call (autocast's ``aten::matmul`` inside ``aten::matmul``), so the header's number is
        the sum of the table's calls column (a trial read 16 in the header beside 15 calls)."""
        return sum(row["calls"] for row in self.grouped_rows("op"))

    @functools.cached_property
    def header(self) -> dict:
        fl = self.flops
        busy = self.busy
        rate = fl.flops / (self.window_us * 1e-6) if fl.flops and self.window_us > 0 else None
        if self.on_device:
            peak_note = (f"{fl.fraction_of_peak:.1%} of the {fl.gpu.gpu} dense {fl.dominant_dtype} peak "
                         f"({fl.peak_flops_per_s / 1e12:.0f} TFLOP/s)" if fl.fraction_of_peak is not None
                         else f"fraction of peak unknown: {fl.reason}")
        else:
            peak_note = "peak unknown: nbaccel has no peak table for CPUs, so no fraction of peak is shown"
        return {
            "device": self.device.label,
            "profiled": (self.loaded["label"] if self.loaded else
                         "CUDA + CPU" if self.device.type == "cuda" else "CPU only (no CUDA device: CPU ops profiled)"),
            "recipe": self.recipe_label,
            "wall_us": self.window_us,
            # a loaded trace: the ProfilerStep ranges it holds (nbaccel writes one even for an unscheduled
            # profile; 0 for a trace from plain torch.profiler without a schedule)
            "steps": len(self.step_times_us) if self.loaded else self.options.steps,
            "unknown_events": int(sum(self.trace.unknown_events.values())),
            # a loaded trace holds no warm-up (it ran unrecorded) and no record of the schedule: None, and
            # first_step says how many steps came before the recording, which is what the file tells
            "warmup": None if self.loaded else self.options.warmup,
            "first_step": self.step_numbers[0] if self.step_numbers else None,
            "step_times_us": self.step_times_us,
            "device_time_us": self.device_time_us if self.on_device else None,
            "device_busy_fraction": busy["busy_fraction"] if busy else None,
            "ops": self.op_calls,
            "kernels": self.kernel_count,
            "flops": fl.flops,
            "dominant_dtype": fl.dominant_dtype,
            "flops_per_s": fl.flops_per_s if self.on_device else rate,
            "flops_per_s_basis": "device busy time" if self.on_device else "wall time",
            "matmul_flops_per_s": fl.matmul_flops_per_s,
            "peak_flops_per_s": fl.peak_flops_per_s,
            "fraction_of_peak": fl.fraction_of_peak,
            "peak_note": peak_note,
        }

    # -- tables --

    @property
    def default_sort(self) -> str:
        return self.options.sort or ("device" if self.device.type == "cuda" else "self")

    def grouped_rows(self, group: str | None = None) -> list[dict]:
        """`grouped` as row dicts, in first-appearance order (plain Python for op / op+shape)."""
        group = group or self.options.group
        key = ("rows", group)
        if key not in self._grouped:
            if group == "source" or not self.python_tables:
                self._grouped[key] = self.grouped(group).to_dict("records")
            else:
                if group == "op+shape":
                    self.op_shapes  # noqa: B018 - adds the shapes column
                self._grouped[key] = pt.group_rows(self.op_columns, group,
                                                   self.device_time_us if self.on_device else 0.0)
        return self._grouped[key]

    def top_rows(self, top: int | None = None) -> list[dict]:
        """The displayed table: rows of the options' grouping that its --filter keeps, in the default sort,
        first ``top``.

        The same rows, in the same order, as ``table(filter=options.filter, top=top)``, without pandas."""
        rows = pt.filter_rows(self.grouped_rows(), self.options.filter)
        rows = pt.sort_rows(rows, pt.SORT_COLUMNS.get(self.default_sort, self.default_sort))
        return rows[:top] if top else rows

    def slowest_row(self) -> dict | None:
        """The row with the largest share of the time the percent column is of (device time on a GPU
        profile, self CPU time otherwise), whatever ``--sort`` ordered the table by: a trial's
        ``--sort cpu`` header named aten::dropout (0.1%) as the slowest while aten::bernoulli_ held 25%."""
        rows = pt.sort_rows(self.grouped_rows(), pt.SORT_COLUMNS["device" if self.on_device else "self"])
        return rows[0] if rows else None

    def grouped(self, group: str) -> pd.DataFrame:
        """The unsorted table for one grouping, computed once (the widget regroups often)."""
        if group not in self._grouped:
            self._grouped[group] = pt.group_ops(self.op_events, group, self.device_time_us if self.on_device else 0.0)
        return self._grouped[group]

    def table(self, group: str | None = None, sort: str | None = None, ascending: bool = False,
              filter: str = "", top: int | None = None) -> pd.DataFrame:  # noqa: A002 - the user's word
        """The operator table grouped by ``op|op+shape|source``, sorted by a --sort key or any column."""
        sort = table_sort(sort)
        check_table_args(group, sort, ascending, filter, top)
        # device time as validate() allows sort="device": a CUDA profile (a loaded one: its trace has kernels)
        check_table_fits(group, sort, device_time=self.on_device, memory=self.options.memory,
                         stack=self.options.stack)
        return pt.select(self.grouped(group or self.options.group), sort or self.default_sort, ascending, filter, top)

    def table_text(self, group: str | None = None, sort: str | None = None, ascending: bool = False,
                   filter: str = "", top: int | None = None) -> str:  # noqa: A002 - the user's word
        """`table` laid out as the text report's table (full names, aligned columns), to print in a
        terminal or a script: ``print(prof.table_text(filter="mm", top=5))``."""
        from .render.profile import table_text

        return table_text(self, group=group, sort=sort, ascending=ascending, filter=filter, top=top)

    @property
    def ops(self) -> pd.DataFrame:
        """Every operator row, grouped as the options asked, in the default sort order."""
        return self.table()

    def to_dataframe(self) -> pd.DataFrame:
        return self.ops

    @functools.cached_property
    def categories(self) -> pd.DataFrame:
        """Time per category (device time on CUDA, self CPU time on the CPU), largest first; on the CPU
        torch.compile's compiling and the DataLoader's time are categories of their own (`phase_times`)."""
        if self.on_device:
            return category_breakdown(self.trace)  # built from category_rows' few rows
        return pt.cpu_categories(self.op_events, self.op_phases, self.phase_times["data_loading_gaps"])

    @functools.cached_property
    def category_rows(self) -> list[tuple[str, float, int, float]]:
        """``categories`` as (category, time_us, count, percent) tuples, largest first."""
        if self.on_device:
            return category_rows(self.trace)
        if not self.python_tables:
            cats = self.categories
            return [(r.category, float(r.time_us), int(r.count), float(r.percent)) for r in cats.itertuples()]
        return [(c, float(t), int(n), float(p)) for c, t, n, p in
                pt.cpu_category_rows(self.op_columns, self.op_phases, self.phase_times["data_loading_gaps"])]

    @functools.cached_property
    def op_phases(self) -> list[str | None]:
        """Each op event's phase: "compiling", "data loading", "attention" (inside an attention op) or None
        (`nbaccel.analysis.phases`)."""
        return phases.op_phases(self.op_columns, self._annotation_columns)

    @functools.cached_property
    def _annotation_columns(self) -> dict[str, list]:
        return {c: self.trace.column("annotations", c) for c in ("name", "pid", "tid", "ts_us", "dur_us", "on_device")}

    @functools.cached_property
    def phase_times(self) -> dict:
        """What the advice quotes: torch.compile's compile time (union of its outermost ranges, us, and
        how many), the DataLoader's ``__next__`` time (union, us), its calls, whether it had worker
        processes, and the part of it no op covers (``data_loading_gaps``, per call); the optimizers'
        state creation (`phases.optimizer_state_rows`: its ops' summed CPU durations, us, their names
        and calls, the self time of the ops in them by name -- how the op table shows them --, the
        optimizer classes, the ``Optimizer.step`` ranges it happened in) and how many
        ``Optimizer.step`` ranges the trace holds."""
        ann = self._annotation_columns
        compiling = phases.compile_ranges(self.op_columns, self.op_columns["compiling"])
        loaders = phases.dataloader_ranges(ann)
        names = [n for n, dev in zip(ann["name"], ann["on_device"]) if not dev and phases.is_dataloader(n)]
        cols = self.op_columns
        state = phases.optimizer_state_rows(cols, ann)
        state_ops: dict[str, int] = {}
        for i in state:
            state_ops[cols["name"][i]] = state_ops.get(cols["name"][i], 0) + 1
        return {
            "optimizer_state_us": pt.pairwise_sum([cols["dur_us"][i] for i in state]),
            "optimizer_state_ops": state_ops,
            "optimizer_state_self": phases.self_time_by_name(cols, phases.inside_rows(cols["parent"], state))
            if state else {},
            "optimizer_state_by": sorted({by for by, _ in state.values()}),
            "optimizer_state_steps": len({step for _, step in state.values()}),
            "optimizer_steps": len(phases.optimizer_steps(ann)),
            "compile_us": phases.union_us(compiling),
            "compiles": len(compiling),
            "data_loading_us": phases.union_us([r for rs in loaders.values() for r in rs]),
            "data_loading_calls": len(names),
            "data_loading_workers": any("MultiProcessing" in n for n in names),
            "data_loading_gaps": phases.data_loading_gaps(self.op_columns, ann) if names else [],
        }

    @functools.cached_property
    def tensor_cores(self):
        """`TensorCoreShare` of device kernel time; ``value`` is None (with a reason) on the CPU."""
        return tensor_core_share(self.trace)

    @functools.cached_property
    def streams(self) -> pd.DataFrame:
        """Busy time per (device, stream): union of its kernels and copies, idle fraction of the window.
        No rows on the CPU, with its columns (it was a frame without columns there: ``streams[["stream",
        "busy_us"]]`` failed on the CPU only)."""
        import pandas as pd
        return pd.DataFrame(self.stream_rows, columns=["device", "stream", "busy_us", "activity_us", "count",
                                                       "window_us", "idle_fraction"])

    @functools.cached_property
    def stream_rows(self) -> list[list]:
        """`streams` as row lists (device, stream, busy_us, activity_us, count, window_us, idle_fraction)."""
        return busy_rows(self.trace, by="stream") if self.on_device else []

    @functools.cached_property
    def communication(self):
        """`Share` of kernel time in communication kernels (NCCL, all-reduce); None on the CPU."""
        return communication_share(self.trace)

    @functools.cached_property
    def fp32_misses(self) -> pd.DataFrame:
        """`profile_table.fp32_tensor_core_misses`; on the CPU no rows, with its columns, as a GPU profile
        without misses (it had no columns there: ``fp32_misses[["name", "share"]]`` failed on the CPU only)."""
        import pandas as pd
        return pt.fp32_tensor_core_misses(self.op_columns) if self.on_device else pd.DataFrame(
            columns=pt.FP32_MISS_COLUMNS)

    @functools.cached_property
    def fp32_miss_rows(self) -> list[tuple[str, str, int, float, float]]:
        """`fp32_misses` as (name, shapes, calls, device_us, share) tuples (empty on the CPU)."""
        return pt.fp32_miss_rows(self.op_columns) if self.on_device else []

    @functools.cached_property
    def unaligned(self) -> list[dict]:
        """Matmul/conv calls with dims to pad (`profile_table.unaligned_shapes`), each with its
        ``share`` of the time the advice weighs it against: device time on a GPU profile, self CPU
        time on the CPU. Listed on any device; `profile_advice.padding_pays_here` says which count now."""
        return pt.unaligned_shapes(self.op_columns, self.time_total_us, self.kept_fp32_by)

    @functools.cached_property
    def kept_fp32_by(self) -> list[str | None]:
        """Per op row, the op around it that autocast keeps in fp32 (`kept_fp32`: cdist's matmul), or
        None: its matmuls stay fp32 under any recipe."""
        return kept_fp32_by(self.op_columns, "cuda" if self.on_device else "cpu")

    @property
    def time_total_us(self) -> float:
        """What a share of "the time" is of: all device time on a GPU profile, all ops' self CPU time on the CPU."""
        if self.on_device:
            return self.device_time_us
        return pt.pairwise_sum(self.op_columns["self_us"]) if self.op_count else 0.0

    @functools.cached_property
    def kernels(self) -> pd.DataFrame:
        """Device kernels aggregated by name: calls, time, category, Tensor Cores."""
        import pandas as pd

        rows = self.kernel_rows
        if not rows:
            return pd.DataFrame(columns=["name", "calls", "time_us", "category", "tensor_cores"])
        return pd.DataFrame({"name": [r[0] for r in rows], "calls": pd.Series([r[1] for r in rows], dtype="int64"),
                             "time_us": pd.Series([r[2] for r in rows], dtype="float64"),
                             "category": [r[3] for r in rows],
                             "tensor_cores": pd.Series([r[4] for r in rows], dtype=object)})

    @functools.cached_property
    def kernel_rows(self) -> list[tuple[str, int, float, str, bool | None]]:
        """`kernels` as (name, calls, time_us, category, tensor_cores) tuples, most time first."""
        return kernel_rows(self.trace)

    @functools.cached_property
    def advice(self) -> list[str]:
        with self._spelling():  # options as the maker took them: --top for %%profile_gpu's result
            return advise(self)

    @property
    def contention_warning(self) -> str | None:
        """What other programs' CPU use did to the times, when it reached %%amp's threshold
        (`contention.MIN_OTHERS_CORES`, and more demand than cores), else None."""
        hurt = ("the CPU times include that contention" if self.device.type == "cpu" else
                "the CPU times and the device's idle gaps include the host-side delays it causes "
                "(kernel launches, Python, data loading); kernel durations do not")
        return warning_line(self.contention, "while the cell was profiled", hurt)

    # -- export --

    def export_chrome_trace(self, path: str) -> str:
        """Write the Chrome/Perfetto trace to ``path`` and return it; open the file at ui.perfetto.dev.

        A name ending in ``.gz`` (``step.json.gz``) is written gzipped, any other as plain JSON. Missing
        folders on the way are created, as ``--trace`` / ``trace=`` creates them. A path that cannot be
        written (a folder of that name, a read-only place such as ``/proc``, a full disk) raises
        `ProfileError` naming the path and the reason. A loaded trace (`nbaccel.load_trace`) is copied
        from its file, which must be one file, not a folder of steps.
        """
        if self.doc is None:  # a loaded trace: copy its file rather than keep the parsed document
            return _copy_trace_file(self.trace_files, path)
        return _write_trace(json.dumps(self.doc).encode(), path)

    def _payload(self) -> dict:
        def clean(frame: pd.DataFrame) -> list[dict]:
            return json.loads(frame.to_json(orient="records")) if len(frame) else []

        tc = self.tensor_cores
        return {
            "device": self.device.to_dict(),
            "options": self.options.to_dict(),
            "header": self.header,  # made JSON-safe by ResultMixin.to_dict
            "ops": clean(self.ops),
            "categories": clean(self.categories),
            "tensor_cores": {"share": tc.value, "tensor_core_us": tc.part_us, "kernel_us": tc.total_us,
                             "unknown_us": tc.unknown_us, "reason": tc.reason},
            "communication_share": self.communication.value,
            "fp32_without_tensor_cores": clean(self.fp32_misses),
            "unaligned": self.unaligned,
            "kernels": clean(self.kernels),
            "advice": self.advice,
            "cudnn_benchmark": self.cudnn_benchmark,
            "trace_path": self.trace_path,
            "trace_files": self.trace_files,
            "trace_created": self.trace_created,
            "trace_earlier": list(self.trace_earlier),
            "unrecorded_steps": self.unrecorded_steps,
            "first_run": self.first_run,
            "made_by": self.made_by,
            "loaded": self.loaded,
            "contention": self.contention.to_dict() if self.contention else None,
        }


def _copy_trace_file(sources: list, path: str) -> str:
    if len(sources) != 1:
        raise ProfileError(f"this result was loaded from {len(sources)} files ({', '.join(map(str, sources[:3]))}"
                           f"{', ...' if len(sources) > 3 else ''}); open those in Perfetto, one per step")
    with open(sources[0], "rb") as fh:
        data = fh.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return _write_trace(data, path)


def _write_trace(data: bytes, path: str) -> str:
    """Write a trace's JSON to ``path`` (gzipped for a ``.gz`` name), creating missing folders on the
    way. pathlib's own FileNotFoundError for a new folder read as if the trace were missing (a user
    trial), so every failure is a `ProfileError` that names the path and the reason."""
    try:
        write_trace_bytes(data, path)
    except OSError as exc:
        # the part that failed: a folder on the way (/proc/runs) or the file itself
        raise ProfileError(f"cannot write the trace to {path}: could not create {exc.filename or path} "
                           f"({exc.strerror or exc}); choose another path") from None
    return str(path)


def step_numbers_text(numbers: list[int]) -> str:
    """", #1-#3" (consecutive), ", #2, #3, #6, #7" (a schedule's cycles), ", #2 ... #40"; "" for none."""
    if not numbers:
        return ""
    if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f", #{numbers[0]}" + (f"-#{numbers[-1]}" if len(numbers) > 1 else "")
    if len(numbers) <= 4:
        return ", " + ", ".join(f"#{n}" for n in numbers)
    return f", #{numbers[0]} ... #{numbers[-1]}"
