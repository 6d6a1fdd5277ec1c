"""``nbaccel.profile``: run code under ``torch.profiler`` and say where the time goes.

How a profile is made (the method, spelled out because every number depends on it):

1. Refuse to start if a profiler is already running (``torch._C._autograd._profiler_enabled()``):
   two Kineto sessions cannot share the process, and the second would silently get nothing.
2. ``torch.profiler.profile`` with CPU activities, plus CUDA on a CUDA device, and always
   ``record_shapes=True``: FLOPs and the matmul padding advice are computed from input shapes.
   ``--warmup W --steps S`` becomes ``schedule(wait=0, warmup=W, active=S, repeat=1)``; the code
   runs W+S times, like a training loop, and only the S active steps are recorded. Re-running
   is the point (a step's cost is only visible after warm-up) and it changes your state W+S
   times, exactly as W+S iterations of your loop would. Nothing is restored afterwards.
3. After the last step the device is synchronized and the profiler stopped; the Chrome trace
   is exported by Kineto (C++, fast) and parsed by `nbaccel.analysis` -- the same loader,
   kernel classifier (Tensor Cores, categories), FLOP formulas and peak table that analyse
   traces from other machines. The live CUDA path therefore runs through code that is tested
   on real H100/A100/B200 traces. ``key_averages()`` is never called (it re-parses every event
   in Python; the trace loader is what gives kernels, links and categories).
   Nothing more is computed until it is read: what a display shows (header, top-K table,
   categories, shapes, advice) is computed from the loader's column lists in plain Python, and
   the DataFrames (``result.ops``, ``categories``, ``op_events``) are built on first access. On
   a ~100-op CPU profile, loading the parsed trace + analysis + text + HTML takes about 1.2 ms
   instead of about 19 ms when everything was built with pandas (docs/benchmarks.md).
4. If the code raises (or is interrupted), the profiler is stopped, the partial profile is
   discarded with a message, and the exception propagates. Autocast, TF32 and every other
   flag the ``--amp`` recipe set are restored in ``finally``.

Kineto prints ``USDT: ... profiler_start`` / ``profiler_stop`` lines straight to file
descriptor 2 on every start and stop, whatever ``KINETO_LOG_LEVEL`` says (checked on torch
2.13). ipykernel forwards fd 2 into the cell's output, so they would appear under every
profiled cell. `quiet_kineto` captures fd 2 only around our own start/step/stop calls (never
around user code) and re-emits every line that is not one of those two markers.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from . import profile_table as pt
from .analysis import (FlopsSummary, TraceData, achieved_flops, category_breakdown, communication_share, load_trace,
                       tensor_core_share)
from .analysis.metrics import activity_columns, busy_rows, category_rows, kernel_rows
from .analysis.trace import paused_gc
from .device import DeviceError, DeviceInfo, device_info, resolve_device
from .options import option, whole_number
from .precision import Recipe, apply_recipe, make_recipe
from .results import ResultMixin
from .stderr_filter import dropped_stderr_lines

if TYPE_CHECKING:
    import pandas as pd

DTYPES = ("bf16", "fp16", "auto")


class ProfileError(RuntimeError):
    """The profile cannot run as asked; the message says what to change. Raised before any code runs."""


# --- options -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileOptions:
    """What to record and how to show it. ``sort=None`` means device time on CUDA, else self CPU."""

    top: int = 15
    sort: str | None = None
    memory: bool = False
    shapes: bool = False
    stack: bool = False
    warmup: int = 0
    steps: int = 1
    trace: str | None = None
    amp: str | None = None
    device: str = "auto"

    @property
    def group(self) -> str:
        return "source" if self.stack else "op+shape" if self.shapes else "op"

    @property
    def scheduled(self) -> bool:
        return self.warmup > 0 or self.steps > 1

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def trace_is_file(path: str) -> bool:
    """``--trace x.json`` / ``x.json.gz`` is one file; any other name is a folder (one file per step)."""
    return str(path).endswith((".json", ".json.gz"))


def check_trace_path(path: str) -> None:
    """Refuse a --trace path that cannot be written, before the code runs (not after a long step).
    Missing folders on the way are fine, for a file as for a folder of steps: they are created
    when the trace is saved (like tensorboard_trace_handler does)."""
    p = Path(path).expanduser()
    if trace_is_file(path):
        if p.is_dir():
            raise ProfileError(f"{option('trace', path)} is a folder; give a file name ending in .json, or a folder name "
                               "without .json for one file per step")
        if p.exists() and not os.access(p, os.W_OK):
            raise ProfileError(f"{option('trace', path)}: not writable; choose another path")
        folder = p.parent
    else:
        if p.exists() and not p.is_dir():
            raise ProfileError(f"{option('trace', path)} exists and is not a folder; a name without .json is a folder "
                               "(one trace file per step), a name ending in .json is one file")
        folder = p
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise ProfileError(f"{option('trace', path)}: cannot write into {ancestor}"
                           f"{'' if ancestor.is_dir() else ' (a file, not a folder)'}; choose another path")


def profiler_running() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


def validate(options: ProfileOptions) -> tuple[torch.device, DeviceInfo, Recipe | None]:
    """Check every option against this machine; raise `ProfileError` naming the fix."""
    whole_number("top", options.top, 1, ProfileError)
    whole_number("steps", options.steps, 1, ProfileError, why=": the profile needs an active step")
    whole_number("warmup", options.warmup, 0, ProfileError)
    if options.trace is not None and not isinstance(options.trace, (str, os.PathLike)):
        raise ProfileError(f"{option('trace')} takes a file or folder path, got {options.trace!r}")
    if options.sort is not None and options.sort not in pt.SORT_COLUMNS:
        raise ProfileError(f"{option('sort', options.sort)} is not a sort key; use one of: {', '.join(pt.SORT_COLUMNS)}")
    try:
        dev = resolve_device(options.device)
        info = device_info(dev)
        recipe = make_recipe(options.amp, dev, name="amp") if options.amp else None
    except DeviceError as exc:
        raise ProfileError(str(exc)) from None
    if options.sort == "device" and dev.type != "cuda":
        raise ProfileError(f"{option('sort', 'device')} needs a CUDA device; this profile runs on the CPU: use "
                           f"{option('sort', 'self')} or {option('sort', 'cpu')}")
    if options.sort == "memory" and not options.memory:
        raise ProfileError(f"{option('sort', 'memory')} needs {option('memory', True)} (memory is only recorded "
                           "with profile_memory)")
    if options.amp and options.amp not in DTYPES:
        raise ProfileError(f"{option('amp', options.amp)} is not supported; use one of: {', '.join(DTYPES)}")
    if options.trace:
        check_trace_path(options.trace)
    if profiler_running():
        raise ProfileError("another torch profiler is already running in this process (a `with "
                           "torch.profiler.profile()` block or an earlier profile that was not stopped); "
                           "stop it first: two profilers cannot record at the same time")
    return dev, info, recipe


# --- Kineto's fd-2 chatter -----------------------------------------------------------------------

_KINETO_NOISE = re.compile(rb"^(?:USDT|STAGE):\S+ \S+ \d+:\d+ \S+\] ")


@contextlib.contextmanager
def quiet_kineto():
    """Drop Kineto's start/stop marker lines from fd 2 during our own profiler calls; keep the rest.

    Also hides torch's once-per-process "Profiler clears events at the end of each cycle" warning
    (2.11+): nbaccel's schedule has one cycle, so it is untrue here. (``acc_events=True`` would
    silence it too, but makes ``stop()`` parse every event into FunctionEvents eagerly -- tens of
    ms with record_shapes -- while nbaccel reads the exported trace instead.)
    """
    shown = getattr(torch.profiler.profiler, "_WARNINGS_SHOWN", None)
    shown_before = set(shown) if isinstance(shown, set) else None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_CYCLE_WARNING)
            with dropped_stderr_lines(_KINETO_NOISE.match):
                yield
    finally:
        if shown_before is not None:  # a hidden warning must still reach the user's own profilers
            shown.difference_update({m for m in shown - shown_before if re.match(_CYCLE_WARNING, m)})


_CYCLE_WARNING = r"Warning: Profiler clears events"

_UNKNOWN_BLOCK = b"Memory block of unknown size was allocated before the profiling started"


def drop_unknown_block_warning(enabled: bool = True):
    """While ``memory=True`` (``--memory``) profiles the code, drop torch's "Memory block of unknown
    size was allocated before the profiling started" line from fd 2; pass everything else on.

    torch's CPU allocator logs that line (a C++ ``LOG(WARNING)`` written straight to fd 2, so no
    Python warning filter sees it) the first time, then every 1000th time, that a tensor allocated
    before the profiler started is freed while it records memory -- which is what ``x = ...`` in
    the profiled code does to the old ``x``. The memory columns simply do not count such frees;
    the line only alarms.
    """
    if not enabled:
        return contextlib.nullcontext()
    return dropped_stderr_lines(lambda line: _UNKNOWN_BLOCK in line)


# --- the profile ---------------------------------------------------------------------------------

class profile:  # noqa: N801 - a context manager used like a function: `with nbaccel.profile():`
    """Profile the body of a ``with`` block; the analysis is ``.result`` afterwards.

    >>> with nbaccel.profile(top=10) as prof:
    ...     train_step(model, batch)
    >>> prof.result.ops.head()

    With ``warmup``/``steps``, call ``prof.step()`` at the end of each iteration (like
    ``torch.profiler``): ``warmup`` iterations run unrecorded, the next ``steps`` are analysed.
    Raises `ProfileError` on entry if the options cannot work here; see the module docstring
    for the method.
    """

    def __init__(self, device="auto", *, top: int = 15, sort: str | None = None, memory: bool = False,
                 shapes: bool = False, stack: bool = False, warmup: int = 0, steps: int = 1,
                 trace: str | None = None, amp: str | None = None, options: ProfileOptions | None = None):
        self.options = options or ProfileOptions(top=top, sort=sort, memory=memory, shapes=shapes, stack=stack,
                                                 warmup=warmup, steps=steps, trace=trace, amp=amp,
                                                 device=str(device))
        self.result: ProfileResult | None = None
        self.steps_done = 0
        self._prof = None
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "profile":
        opts = self.options
        self.device, self.info, self.recipe = validate(opts)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = None
        if opts.scheduled:
            with warnings.catch_warnings():
                # "won't be using warmup": --warmup 0 is the user's explicit choice, not a mistake.
                warnings.simplefilter("ignore", UserWarning)
                schedule = torch.profiler.schedule(wait=0, warmup=opts.warmup, active=opts.steps, repeat=1)
        self._cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
        self._prof = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True,
                                            profile_memory=opts.memory, with_stack=opts.stack)
        # Entered first, left last (in _stop, after the profiler stopped): the line comes from frees.
        self._unknown_block_filter = drop_unknown_block_warning(enabled=opts.memory)
        self._unknown_block_filter.__enter__()
        try:
            with quiet_kineto():
                self._prof.start()
        except BaseException:
            self._unknown_block_filter.__exit__(None, None, None)
            raise
        self._stack = contextlib.ExitStack()
        try:
            if self.recipe is not None:
                self._stack.enter_context(apply_recipe(self.recipe))
                self._cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
        except BaseException:
            self._stop()
            raise
        return self

    def step(self) -> None:
        """End one iteration (``prof.step()`` of torch.profiler): advances warmup -> active steps."""
        self.steps_done += 1
        if self.options.scheduled:
            with quiet_kineto():
                self._prof.step()

    def _stop(self) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
        finally:
            self._stack = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every queued kernel belongs to this profile
            try:
                with quiet_kineto():
                    self._prof.stop()
            finally:
                self._unknown_block_filter.__exit__(None, None, None)

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._stop()
        except Exception:
            if exc_type is None:
                raise
        if exc_type is not None:
            runs = self.options.warmup + self.options.steps
            which = f" in run {self.steps_done + 1} of {runs}" if runs > 1 else ""
            print(f"nbaccel: the profiled code raised {exc_type.__name__}{which}; the profiler was stopped and the "
                  "partial profile discarded.", file=sys.stderr)
            return False
        needed = self.options.warmup + self.options.steps
        if self.options.scheduled and self.steps_done < needed:
            raise ProfileError(f"profile(warmup={self.options.warmup}, steps={self.options.steps}) needs {needed} "
                               f"calls to .step(); got {self.steps_done}, so no active step was completed")
        self.result = self._build()
        return False

    def _build(self) -> "ProfileResult":
        opts = self.options
        # Kineto exports to a temporary file that we parse; the user's --trace is written from it
        # afterwards, so a path that fails at write time (checked writable, yet refused: /sys, a
        # full disk) costs the trace file, never the profile.
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix="nbaccel_profile_")
        os.close(fd)
        with paused_gc():  # the parsed trace is thousands of small containers: see paused_gc
            try:
                self._prof.export_chrome_trace(tmp)
                doc = _read_json(tmp)
                files = _save_trace(tmp, doc, opts.trace) if opts.trace else []
            finally:
                os.unlink(tmp)
            return ProfileResult.from_trace(doc, self.info, opts, recipe=self.recipe,
                                            cudnn_benchmark=self._cudnn_benchmark,
                                            trace_path=opts.trace if files else None, trace_files=files)


def _save_trace(exported: str, doc: dict, target: str) -> list[str]:
    """Write --trace (one file, or one file per step in a folder); the files written. A failure
    is reported as a warning with the way out, and the profile is kept."""
    try:
        if not trace_is_file(target):
            return write_step_traces(doc, target)
        path = Path(target).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        if str(path).endswith(".gz"):
            path.write_bytes(gzip.compress(Path(exported).read_bytes()))
        else:
            shutil.copyfile(exported, path)
        return [target]
    except OSError as exc:
        with warnings.catch_warnings():
            warnings.simplefilter("always", TraceSaveWarning)  # every time: a lost file is never old news
            warnings.warn(f"nbaccel could not write the trace to {target} ({exc.strerror or exc}); the profile "
                          "is shown without it: save it with result.export_chrome_trace('another/path.json')",
                          TraceSaveWarning, stacklevel=4)
        return []


class TraceSaveWarning(UserWarning):
    """The profile was made, but its --trace file could not be written."""


def profile_function(fn: Callable[[], object], options: ProfileOptions | None = None, silence=None,
                     **kwargs) -> "ProfileResult":
    """Run ``fn`` warmup+steps times under the profiler and return the `ProfileResult`.

    ``silence``: context-manager factory that hides the output of every run but the last (the
    magic passes IPython's capture); the last run's return value is ``result.value``.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
    options = options or ProfileOptions(**kwargs)
    runs = options.warmup + options.steps
    with profile(options=options) as prof:
        value = None
        for i in range(runs):
            quiet = silence() if silence is not None and i < runs - 1 else contextlib.nullcontext()
            with quiet:
                value = fn()
            prof.step()
    prof.result.value = value
    return prof.result


def _read_json(path: str) -> dict:
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        # Seen with torch 2.13: Kineto does not escape '"' in record_function names.
        raise ProfileError(f"torch.profiler wrote a trace that is not valid JSON ({exc}); a record_function "
                           "name containing a double quote causes this -- rename it") from exc


# --- trace files ---------------------------------------------------------------------------------

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "memcpy", "memset"}


def split_by_step(doc: dict) -> list[tuple[str, float | None, dict]]:
    """One trace per ``ProfilerStep#N``: (step name, start ts in us, trace dict).

    Host events go to the step whose window contains them; device events (kernels, copies) and
    their flow arrows follow the launch that queued them (same ``correlation``), because a
    kernel queued at the end of step N may run after step N+1 has begun on the host.
    Metadata events (process/thread names) go into every file.
    """
    events = doc.get("traceEvents", [])
    steps = sorted((float(e["ts"]), e["name"]) for e in events
                   if isinstance(e, dict) and e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("ProfilerStep#") and "ts" in e)
    if len(steps) <= 1:
        return [(steps[0][1] if steps else "trace", steps[0][0] if steps else None, doc)]
    starts = [s[0] for s in steps]

    def step_of(ts) -> int:
        return max(bisect_right(starts, float(ts)) - 1, 0)

    buckets: list[list] = [[] for _ in steps]
    common, deferred, corr_step = [], [], {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") == "M" or "ts" not in e:
            common.append(e)
        elif str(e.get("cat", "")).lower() in _DEVICE_CATS or e.get("cat") == "ac2g":
            deferred.append(e)
        else:
            k = step_of(e["ts"])
            buckets[k].append(e)
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                corr_step[corr] = k
    for e in deferred:
        corr = e.get("id") if e.get("cat") == "ac2g" else (e.get("args") or {}).get("correlation")
        buckets[corr_step.get(corr, step_of(e["ts"]))].append(e)
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    return [(name, start, {**header, "traceEvents": common + bucket}) for (start, name), bucket in zip(steps, buckets)]


def write_step_traces(doc: dict, folder: str) -> list[str]:
    """Write one ``{host}_{pid}.{ms}.pt.trace.json`` per step into ``folder``.

    That is the naming of ``torch.profiler.tensorboard_trace_handler`` (worker name, then a
    millisecond timestamp as the span name), which TensorBoard's profiler plugin and Holistic
    Trace Analysis read. The timestamp is the step's start in Unix milliseconds (from the
    trace's ``baseTimeNanoseconds``), bumped by 1 ms when two steps start in the same millisecond
    so that names stay unique and sort in step order.
    """
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    worker = f"{socket.gethostname()}_{os.getpid()}"
    base_ms = int(doc.get("baseTimeNanoseconds", 0)) // 1_000_000
    paths, last = [], -1
    for _name, start, part in split_by_step(doc):
        ms = base_ms + int(start // 1000) if start is not None and base_ms else int(time.time() * 1000)
        ms = max(ms, last + 1)
        last = ms
        path = out / f"{worker}.{ms}.pt.trace.json"
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(part, fh)
        paths.append(str(path))
    return paths


# --- the result ----------------------------------------------------------------------------------

# Advice thresholds. Each is a share of the profiled time; below it the finding is not worth a line.
FP32_MATMUL_SHARE = 0.20     # fp32 matmul/conv time above which autocast is worth trying
IDLE_SHARE = 0.30            # device idle fraction that points at the host (input pipeline, syncs)
SMALL_KERNEL_US = 10.0       # median kernel shorter than this, with many kernels: launch-bound
MANY_KERNELS = 200
TRANSFER_SHARE = 0.10        # host<->device copies as a share of device time
CONV_SHARE = 0.10            # conv share of device time for the cudnn.benchmark advice
SMALL_OP_US = 20.0           # CPU: median self time of ops below which dispatch overhead dominates
MANY_OPS = 500
UNALIGNED_SHARE = 0.01       # unaligned matmuls below 1% of the time are listed, not advised on

# Up to this many op events the displayed tables are built in plain Python (pandas' fixed cost per
# groupby/sort is most of the time on a few hundred rows); above it, with pandas (its vectorized
# groupby is faster per row). Both give the same numbers: tests/test_profile_rows.py.
PYTHON_TABLE_OPS = 5000
_CONV = re.compile("conv", re.IGNORECASE)


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
    _grouped: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_trace(cls, doc: dict, info: DeviceInfo, options: ProfileOptions, recipe: Recipe | None = None,
                   cudnn_benchmark: bool = False, trace_path: str | None = None, trace_files=()) -> "ProfileResult":
        """Analyse a parsed Chrome trace (live, or recorded elsewhere) into a result."""
        return cls.from_trace_data(load_trace(doc), doc.get("traceEvents", []), info, options, recipe=recipe,
                                   cudnn_benchmark=cudnn_benchmark, trace_path=trace_path,
                                   trace_files=trace_files, doc=doc)

    @classmethod
    def from_trace_data(cls, trace: TraceData, events, info: DeviceInfo, options: ProfileOptions,
                        recipe: Recipe | None = None, cudnn_benchmark: bool | None = False,
                        trace_path: str | None = None, trace_files=(), doc: dict | None = None,
                        loaded: dict | None = None) -> "ProfileResult":
        """A result from an already parsed `TraceData`. ``events`` (raw Chrome events) are only
        read for ``options.stack`` (python_function frames) and ``options.memory`` ([memory]
        events); `nbaccel.load_trace` streams big files and passes just those events."""
        extra = {}
        if options.stack:
            extra["source"] = pt.source_by_op(events, trace.ops)
        if options.memory:
            self_mem, total_mem = pt.memory_by_op(events, trace.ops)
            extra["self_memory_bytes"], extra["memory_bytes"] = self_mem, total_mem
        return cls(device=info, options=options, trace=trace, op_extra=extra,
                   recipe_label=recipe.label if recipe else None, cudnn_benchmark=cudnn_benchmark,
                   trace_path=trace_path, trace_files=list(trace_files), doc=doc, loaded=loaded)

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
    def step_times_us(self) -> list[float]:
        t = self.trace
        steps = [(ts, dur) for name, ts, dur, dev in zip(*(t.column("annotations", c) for c in
                                                             ("name", "ts_us", "dur_us", "on_device")))
                 if str(name).startswith("ProfilerStep#") and not dev]
        return [float(dur) for _, dur in sorted(steps, key=lambda s: s[0])]

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
        return self.trace.count("ops")

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
            # a loaded trace: the ProfilerStep ranges it holds (0 when it was recorded without a schedule)
            "steps": len(self.step_times_us) if self.loaded else self.options.steps,
            "unknown_events": int(sum(self.trace.unknown_events.values())),
            "warmup": self.options.warmup,
            "step_times_us": self.step_times_us,
            "device_time_us": self.device_time_us if self.on_device else None,
            "device_busy_fraction": busy["busy_fraction"] if busy else None,
            "ops": self.op_count,
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
        """The displayed table: rows of the options' grouping in the default sort, first ``top``.

        The same rows, in the same order, as ``table(top=top)``, without pandas."""
        rows = pt.sort_rows(self.grouped_rows(), pt.SORT_COLUMNS.get(self.default_sort, self.default_sort))
        return rows[:top] if top else rows

    def grouped(self, group: str) -> pd.DataFrame:
        """The unsorted table for one grouping, computed once (the widget regroups often)."""
        if group not in self._grouped:
            self._grouped[group] = pt.group_ops(self.op_events, group, self.device_time_us if self.on_device else 0.0)
        return self._grouped[group]

    def table(self, group: str | None = None, sort: str | None = None, ascending: bool = False,
              filter: str = "", top: int | None = None) -> pd.DataFrame:  # noqa: A002 - the user's word
        """The operator table grouped by ``op|op+shape|source``, sorted by a --sort key or any column."""
        if top is not None:
            whole_number("top", top, 1, ProfileError)
        if not isinstance(filter, str):
            raise ProfileError(f"filter takes the text to look for in the names, got {filter!r}")
        return pt.select(self.grouped(group or self.options.group), sort or self.default_sort, ascending, filter, top)

    @property
    def ops(self) -> pd.DataFrame:
        """Every operator row, grouped as the options asked, in the default sort order."""
        return self.table()

    def to_dataframe(self) -> pd.DataFrame:
        return self.ops

    @functools.cached_property
    def categories(self) -> pd.DataFrame:
        """Time per category (device time on CUDA, self CPU time on the CPU), largest first."""
        if self.on_device:
            return category_breakdown(self.trace)  # built from category_rows' few rows
        return pt.cpu_categories(self.op_events)

    @functools.cached_property
    def category_rows(self) -> list[tuple[str, float, int, float]]:
        """``categories`` as (category, time_us, count, percent) tuples, largest first."""
        if self.on_device:
            return category_rows(self.trace)
        if not self.python_tables:
            cats = self.categories
            return [(r.category, float(r.time_us), int(r.count), float(r.percent)) for r in cats.itertuples()]
        return [(c, float(t), int(n), float(p)) for c, t, n, p in pt.cpu_category_rows(self.op_columns)]

    @functools.cached_property
    def tensor_cores(self):
        """`TensorCoreShare` of device kernel time; ``value`` is None (with a reason) on the CPU."""
        return tensor_core_share(self.trace)

    @functools.cached_property
    def streams(self) -> pd.DataFrame:
        """Busy time per (device, stream): union of its kernels and copies, idle fraction of the window."""
        import pandas as pd
        if not self.on_device:
            return pd.DataFrame()
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
        import pandas as pd
        return pt.fp32_tensor_core_misses(self.op_columns) if self.on_device else pd.DataFrame()

    @functools.cached_property
    def fp32_miss_rows(self) -> list[tuple[str, str, int, float, float]]:
        """`fp32_misses` as (name, shapes, calls, device_us, share) tuples (empty on the CPU)."""
        return pt.fp32_miss_rows(self.op_columns) if self.on_device else []

    @functools.cached_property
    def unaligned(self) -> list[dict]:
        return pt.unaligned_shapes(self.op_columns)

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
        return advise(self)

    # -- export --

    def export_chrome_trace(self, path: str) -> str:
        """Write the Chrome/Perfetto trace (``.json``, or gzipped ``.json.gz``); open it at ui.perfetto.dev."""
        if self.doc is None:  # a loaded trace: copy its file rather than keep the parsed document
            return _copy_trace_file(self.trace_files, path)
        data = json.dumps(self.doc).encode()
        if str(path).endswith(".gz"):
            data = gzip.compress(data)
        Path(path).expanduser().write_bytes(data)
        return str(path)

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
            "loaded": self.loaded,
        }


def _copy_trace_file(sources: list, path: str) -> str:
    if len(sources) != 1:
        raise ProfileError(f"this result was loaded from {len(sources)} files ({', '.join(map(str, sources[:3]))}"
                           f"{', ...' if len(sources) > 3 else ''}); open those in Perfetto, one per step")
    with open(sources[0], "rb") as fh:
        data = fh.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    Path(path).expanduser().write_bytes(data)
    return str(path)


# --- advice --------------------------------------------------------------------------------------

def advise(result: ProfileResult) -> list[str]:
    """One line per finding, each quoting the number that triggered it."""
    notes = []
    ops = result.op_columns  # plain lists: a few hundred rows are summed faster than pandas sets up
    n_ops = len(ops["name"])
    on_device = result.on_device
    time_col = "device_self_us" if on_device else "self_us"
    total = result.device_time_us if on_device else pt.pairwise_sum(ops["self_us"]) if n_ops else 0.0
    where = "device" if on_device else "CPU"
    if not n_ops:
        notes.append("No torch operators were recorded: torch.profiler sees torch work only; for plain Python "
                     "time use %prun or pyinstrument.")
    if n_ops and total > 0:
        fp32 = pt.pairwise_sum(t for t, c, d in zip(ops[time_col], ops["category"], ops["math_dtype"])
                               if c == "matmul/conv" and d == "fp32")
        if fp32 / total >= FP32_MATMUL_SHARE:
            hint = ("bf16/fp16 run on Tensor Cores" if on_device else
                    "bf16 helps on CPUs with AMX/AVX512-BF16 units; on others it only adds casts")
            notes.append(f"fp32 matmul/conv take {fp32 / total:.0%} of {where} time: try %%amp "
                         f"(or --amp bf16 here) -- {hint}.")
    busy = result.busy
    if busy and busy["busy_fraction"] is not None and 1 - busy["busy_fraction"] >= IDLE_SHARE:
        notes.append(f"The GPU is idle {1 - busy['busy_fraction']:.0%} of the profiled time: the input pipeline "
                     "(DataLoader workers, pin_memory) or host syncs (.item(), .cpu(), print of tensors) are "
                     "the bottleneck, not the GPU.")
    n_kernels = result.kernel_count
    kernel_median = float(np.median(result.trace.column("kernels", "dur_us"))) if n_kernels >= MANY_KERNELS else None
    if n_kernels >= MANY_KERNELS and kernel_median < SMALL_KERNEL_US:
        notes.append(f"{n_kernels} kernels with a median of {kernel_median:.1f} µs each: launch overhead "
                     "dominates; try torch.compile (fuses elementwise ops) or a larger batch.")
    elif not on_device and n_ops >= MANY_OPS:
        leaf = [t for name, t in zip(ops["name"], ops["self_us"]) if name.startswith("aten::")]
        median = float(np.median(leaf)) if leaf else None
        if leaf and median < SMALL_OP_US:
            notes.append(f"{len(leaf)} aten ops with a median self time of {median:.1f} µs: "
                         "per-op dispatch overhead dominates; try torch.compile or larger tensors per op.")
    if on_device and result.device_time_us > 0:
        transfer = pt.pairwise_sum([t for c, t, _, _ in result.category_rows if c == "data transfer"])
        if transfer / result.device_time_us >= TRANSFER_SHARE:
            notes.append(f"Host<->device copies take {transfer / result.device_time_us:.0%} of device time: keep "
                         "tensors on the GPU, use pin_memory=True and .to(device, non_blocking=True).")
        conv_share = pt.pairwise_sum(t for name, t in zip(ops["name"], ops["device_self_us"])
                                     if t > 0 and _CONV.search(name)) / result.device_time_us
        if conv_share >= CONV_SHARE and not result.cudnn_benchmark:
            state = "is off" if result.cudnn_benchmark is False else "is not recorded in the trace"
            notes.append(f"Convolutions take {conv_share:.0%} of device time and torch.backends.cudnn.benchmark "
                         f"{state}: with fixed input shapes, turn it on to let cuDNN pick the fastest algorithm.")
    misses = result.fp32_miss_rows if on_device else ()
    if misses:
        names = ", ".join(sorted({m[0] for m in misses}))
        notes.append(f"fp32 matmul/conv ops ran without Tensor Cores ({pt.pairwise_sum([m[4] for m in misses]):.0%} "
                     "of device time: "
                     f"{names}); enable TF32 (torch.backends.cuda.matmul.fp32_precision = 'tf32') or use %%amp.")
    significant = [e for e in result.unaligned if total > 0 and e["time_us"] / total >= UNALIGNED_SHARE]
    if significant:
        pairs = {}
        for entry in significant:
            for dim, size in entry["unaligned"].items():
                pairs[size] = entry["pad_to"][dim]
        shown = sorted(pairs.items())[:6]
        notes.append("Matmul/conv dims not multiples of 8 (16 for int8): "
                     + ", ".join(f"{a} -> pad to {b}" for a, b in shown)
                     + "; padded sizes fill Tensor Core / AMX tiles.")
    if result.device.type == "cpu" and result.loaded is None:
        notes.append("Profiled on the CPU (no CUDA device): times are CPU times; GPU figures need a GPU.")
    return notes


# --- GPU self-check ------------------------------------------------------------------------------

def tensor_core_check(n: int = 4096, repeat: int = 5, device="cuda") -> dict:
    """Profile a bf16 GEMM and an fp32 GEMM with TF32 off on CUDA; return their Tensor Core shares.

    Expected on Volta+ (bf16 needs Ampere+): bf16 near 1.0, strict fp32 near 0.0. A GPU check
    script prints this; it is also the ``gpu`` test of tests/test_profile_gpu.py.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ProfileError("tensor_core_check needs a CUDA device")
    out = {"device": device_info(dev).label, "n": n}
    for label, dtype, recipe in (("bf16", torch.bfloat16, None), ("fp32", torch.float32, make_recipe("fp32", dev))):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        with contextlib.ExitStack() as stack:
            if recipe is not None:
                stack.enter_context(apply_recipe(recipe))  # strict IEEE fp32: TF32 off
            a @ b  # warm up cuBLAS outside the profile
            torch.cuda.synchronize(dev)
            with profile(device=dev) as prof:
                for _ in range(repeat):
                    a @ b
        tc = prof.result.tensor_cores
        out[label] = {"tensor_core_share": tc.value, "kernel_us": tc.total_us,
                      "kernels": prof.result.kernels["name"].head(3).tolist(),
                      "fraction_of_peak": prof.result.header["fraction_of_peak"]}
    return out


__all__ = ["profile", "profile_function", "ProfileResult", "ProfileOptions", "ProfileError", "TraceSaveWarning", "advise",
           "tensor_core_check", "split_by_step", "write_step_traces", "quiet_kineto"]
