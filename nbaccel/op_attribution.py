"""Which op a raw trace event belongs to: memory events and Python source frames.

Two things the analysis loader (`nbaccel.analysis`) does not keep, and that a live profile
needs, are recovered here from the raw Chrome events:

* ``[memory]`` instant events (``profile_memory=True``, ``--memory``): each allocation is charged
  to the innermost op enclosing it on the same thread, as ``key_averages()`` does.
* ``python_function`` events (``with_stack=True``, ``--stack``): each op is charged to the
  innermost *user* frame enclosing it (the notebook cell or the user's own files, not
  torch/IPython/nbaccel), named as IPython's tracebacks name cells (``Cell In[3], line 2``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from .analysis.trace_columns import innermost_op
from .cells import cell_label, notebook_cells

if TYPE_CHECKING:
    import pandas as pd

# The record_function ranges that %%profile_gpu --stack puts around each cell statement are named as
# IPython's tracebacks name a cell's line, "Cell In[7], line 2: y = m(x)", like the rows of the functions the
# cell calls ("Cell In[3], line 1: def step"; a trial read the two forms side by side). Traces recorded
# before were "cell line 2: ...", still read as such; a range whose cell number is unknown is named so.
CELL_LINE = "cell line "
_CELL_RANGE = re.compile(r"(cell line |Cell In\[\d+\], line )\d+: ")


def cell_line_label(cell: int | None, lineno: int, text: str) -> str:
    """The range's name for line ``lineno`` (its source ``text``) of cell ``cell``."""
    return f"Cell In[{cell}], line {lineno}: {text}" if cell is not None else f"{CELL_LINE}{lineno}: {text}"


def is_cell_line(name: str) -> bool:
    """Whether a ``user_annotation`` name is one of those ranges (either spelling)."""
    return bool(_CELL_RANGE.match(name))


class OpIndex:
    """Find the innermost op enclosing a timestamp on one thread (ops nest in time per thread)."""

    def __init__(self, ops: pd.DataFrame):
        self._ts = ops["ts_us"].to_numpy(dtype=float) if len(ops) else np.zeros(0)
        self._end = self._ts + (ops["dur_us"].to_numpy(dtype=float) if len(ops) else 0)
        self._parent = ops["parent"].to_numpy() if len(ops) else np.zeros(0, dtype=int)
        self._threads: dict[tuple, tuple[list[float], list[int]]] = {}
        if len(ops):
            order = np.lexsort((-self._end, self._ts))  # by start, parents (longer) first
            keys = list(zip(ops["pid"].tolist(), ops["tid"].tolist()))
            for i in order.tolist():
                starts, rows = self._threads.setdefault(keys[i], ([], []))
                starts.append(self._ts[i])
                rows.append(i)

    def innermost(self, pid, tid, t: float) -> int:
        return innermost_op(self._threads, self._parent, self._end.__getitem__, (pid, tid), t)


# Kineto's ``[memory]`` events say where the bytes live: "Device Type" 0 is the host, 1 is CUDA.
_MEMORY_DEVICE_TYPE = {"cpu": 0, "cuda": 1}


def memory_by_op(events: list, ops: pd.DataFrame, index: OpIndex | None = None,
                 device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """(self allocated bytes, allocated bytes including child ops) per op row, on ``device``
    ("cuda": device memory, the scarce one on a GPU profile; "cpu": host memory). A CUDA op
    allocates on both (host-side bookkeeping, pinned staging): summed, they were neither.

    Allocated = the sum of positive ``[memory]`` events (frees are not subtracted: the column
    answers "how much did this op allocate", which is what drives peak memory).
    """
    wanted = _MEMORY_DEVICE_TYPE[device]
    n = len(ops)
    self_bytes = np.zeros(n)
    if not n:
        return self_bytes, self_bytes.copy()
    index = index or OpIndex(ops)
    for ev in events:
        if not isinstance(ev, dict) or ev.get("name") != "[memory]":
            continue
        args = ev.get("args") or {}
        nbytes = args.get("Bytes")
        if not isinstance(nbytes, (int, float)) or nbytes <= 0:
            continue
        if args.get("Device Type", wanted) != wanted:  # a trace without the field: all of it is the one device
            continue
        i = index.innermost(ev.get("pid"), ev.get("tid"), float(ev.get("ts", 0)))
        if i >= 0:
            self_bytes[i] += nbytes
    total = self_bytes.copy()
    parent = ops["parent"].to_numpy()
    # Children start after their parents, so walking rows by start time in reverse pushes each
    # op's total into its parent after all of its own children have been added.
    for i in np.argsort(ops["ts_us"].to_numpy(), kind="stable")[::-1]:
        p = parent[i]
        if p >= 0:
            total[p] += total[i]
    return self_bytes, total


_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")
# Frames that are never "the user's line": the framework, the notebook machinery, the stdlib.
_NOT_USER = re.compile(
    r"(^|/)(torch|torchvision|nbaccel|IPython|ipykernel|traitlets|tornado|zmq|asyncio|concurrent|threading"
    r"|contextlib|runpy|functools|typing)(/|\.py)|site-packages|dist-packages|/lib/python3|^<built-in|^<frozen"
)


def is_user_frame(name: str) -> bool:
    """Whether a ``python_function`` event name (``file(line): func``) is the user's own code."""
    m = _FRAME.match(name or "")
    return bool(m) and not _NOT_USER.search(m.group("file"))


def _is_source_event(ev) -> bool:
    cat = ev.get("cat")
    if cat == "python_function":
        return is_user_frame(ev.get("name", ""))
    return cat == "user_annotation" and is_cell_line(str(ev.get("name", "")))


def source_by_op(events: list, ops: pd.DataFrame) -> list[str | None]:
    """The innermost user source enclosing each op, or None.

    Sources are the user's own functions (``file(line): func``, where ``line`` is the ``def``
    line: Kineto's Python tracer records function starts) and the ``cell line N: ...`` ranges
    that ``%%profile_gpu --stack`` wraps around each statement of the cell (``Cell In[7], line 2: ...``).
    """
    frames: dict[tuple, list[tuple[float, float, str]]] = {}
    for ev in events:
        if isinstance(ev, dict) and _is_source_event(ev):
            ts, dur = ev.get("ts"), ev.get("dur")
            if isinstance(ts, (int, float)) and isinstance(dur, (int, float)):
                frames.setdefault((ev.get("pid"), ev.get("tid")), []).append((float(ts), float(ts + dur), ev["name"]))
    out: list[str | None] = [None] * len(ops)
    if not frames or not len(ops):
        return out
    for key in frames:
        frames[key].sort(key=lambda f: (f[0], -f[1]))
    keys = list(zip(ops["pid"].tolist(), ops["tid"].tolist()))
    ts_list = ops["ts_us"].tolist()
    # Sweep each thread's ops in time order against its frames, keeping a stack of open frames.
    by_thread: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        by_thread.setdefault(k, []).append(i)
    for key, rows in by_thread.items():
        fr = frames.get(key)
        if not fr:
            continue
        rows.sort(key=lambda i: ts_list[i])
        stack: list[tuple[float, float, str]] = []
        j = 0
        for i in rows:
            t = ts_list[i]
            while j < len(fr) and fr[j][0] <= t:
                while stack and stack[-1][1] < fr[j][0]:
                    stack.pop()
                stack.append(fr[j])
                j += 1
            while stack and stack[-1][1] < t:
                stack.pop()
            out[i] = _innermost_source(stack)
    cells = notebook_cells()
    names = {name: frame_label(name, cells) for name in set(out) if name}
    return [names.get(name, name) for name in out]


def frame_label(name: str, cells: dict[str, int]) -> str:
    """A Python frame as the source column shows it: ``/tmp/ipykernel_1/456.py(4): f`` -> ``Cell In[3],
    line 4: def f`` (IPython's traceback words for a notebook cell), ``model.py(40): forward`` ->
    ``model.py, line 40: def forward``. The line is where the function starts (Kineto records no
    other), so the row says ``def``: a JupyterLab trial read "line 11: forward" as the line that ran.
    ``<listcomp>``, ``<lambda>``, ``<module>`` keep their names (their start is the line they run on).
    Other names (the cell's own ``Cell In[n], line N: ...`` ranges) are unchanged."""
    m = _FRAME.match(name)
    if not m:
        return name
    func = m.group("func")
    what = func if func.startswith("<") else f"def {func}"
    return f"{cell_label(m.group('file'), cells)}, line {m.group('line')}: {what}"


def _innermost_source(stack: list[tuple[float, float, str]]) -> str | None:
    """The innermost open source, except a module-level frame inside a ``cell line`` range: the
    magic evaluates the cell's last expression inside its range, so the expression's own
    ``<module>`` frame opens after it and would hide the line it belongs to."""
    for k in range(len(stack) - 1, -1, -1):
        name = stack[k][2]
        if name.endswith("<module>") and any(is_cell_line(frame[2]) for frame in stack[:k]):
            continue
        return name
    return None
