"""Tables behind ``%%profile_gpu``, built from a parsed trace (`nbaccel.analysis.TraceData`).

numpy, pandas (where a DataFrame is built), the analysis package and `nbaccel.flops.pad_to_multiple`
(so torch is imported, through `nbaccel.flops`); no IPython. Everything here is tested on CPU with
synthetic event lists and on the reference GPU traces, so the CUDA path of a live profile runs
through exactly the code the tests exercise. Each table exists twice, as a DataFrame (the API's
``result.ops``, ``table()``) and as plain rows (what a display shows, without pandas' fixed cost);
see "the same tables from plain column lists" below. Which op a memory event or a source line
belongs to is `nbaccel.op_attribution`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from .analysis import CATEGORIES
from .analysis.sums import desc_order, kahan_sum, pairwise_sum  # noqa: F401 - used here and re-exported
from .analysis.metrics import category_totals
from .analysis.op_flops import conv_transposed
from .analysis.phases import DATA_LOADING
from .flops import pad_to_multiple

if TYPE_CHECKING:
    import pandas as pd

GROUPS = ("op", "op+shape", "source")

# Columns of every grouped table, in display order. Times are microseconds, memory bytes.
COLUMNS = ["name", "shapes", "source", "category", "calls", "cpu_self_us", "cpu_total_us", "device_self_us",
           "device_total_us", "percent", "flops", "flops_calls", "flops_per_s", "self_memory_bytes", "memory_bytes",
           "dtype"]

# --sort key -> column (documented in the magic's help). "device" is the op's own device time
# (kernels it launched itself), which sums to the device total like "self" does for the CPU.
SORT_COLUMNS = {
    "cpu": "cpu_total_us",
    "self": "cpu_self_us",
    "device": "device_self_us",
    "calls": "calls",
    "memory": "self_memory_bytes",  # like key_averages' self memory: a wrapper op's children don't count
    "flops": "flops",
}


# --- grouped tables ------------------------------------------------------------------------------

def _shape_text(dims) -> str:
    if not isinstance(dims, (list, tuple)):
        return ""
    return ", ".join("x".join(map(str, d)) if isinstance(d, (list, tuple)) and d else "-" for d in dims)


def _mode(series: pd.Series):
    values = series.dropna()
    return values.mode().iloc[0] if len(values) else None


def group_ops(ops: pd.DataFrame, group: str = "op", device_total_us: float = 0.0) -> pd.DataFrame:
    """Aggregate op rows (`TraceData.ops` plus ``source``/memory columns) into a table.

    ``op``: one row per op name, like ``key_averages()``. ``op+shape``: per (name, input shapes),
    like ``key_averages(group_by_input_shape=True)``. Unlike ``key_averages()``, an op recorded
    inside an op of the same row (autocast and other dispatcher wrappers re-dispatch
    ``aten::matmul`` as a nested ``aten::matmul``) is the same call: it adds its self time, but
    not a call, total time or total memory (see `redispatched`). ``source``: per user
    source line; ``calls`` counts every op call made on the line, nested ones included, as the
    other groupings count them (so the rows' calls add up to the same total), while total time
    and memory count only ops whose parent is on another line, so an ``aten::linear`` and the
    ``aten::addmm`` inside it are not counted twice. (Calls once counted only those outermost ops:
    a user trial read "1" beside the line's three costliest ops, none of them the one counted.)
    ``flops`` is, in every grouping, the rows' *self* FLOPs: only the ops the header counts (the
    innermost op with a formula), so an ``aten::linear`` whose ``aten::addmm`` carries the FLOPs
    shows none and the column sums to the header's total (`self_flops`). ``flops_calls``: how many
    of the row's calls carry those FLOPs, and ``flops_per_s`` divides the FLOPs by those calls' own
    time (device total on a GPU profile, CPU total on the CPU), not by all the row's: an
    ``aten::_convolution`` row holds a ConvTranspose2d's FLOPs (oneDNN runs it with no op inside) beside
    ordinary convolutions whose FLOPs sit on the op inside them, and a UNet's 2 transposed calls'
    FLOPs over all 13 calls' time read 998 MFLOP/s for 7.64 GFLOP/s (see `flop_calls`).
    ``percent`` is each row's share of all device time (GPU profile) or all self CPU time.
    """
    import pandas as pd
    if group not in GROUPS:
        raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {group!r}")
    if not len(ops):
        return pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS})
    frame = ops
    if "shapes" not in frame:
        frame = frame.assign(shapes=[_shape_text(d) for d in frame["input_dims"]])
    if "source" not in frame:
        frame = frame.assign(source=None)
    for col in ("self_memory_bytes", "memory_bytes"):
        if col not in frame:
            frame = frame.assign(**{col: np.nan})
    if group == "source":
        frame = frame.assign(source=frame["source"].fillna("(no user frame)"))
        src = frame["source"].to_numpy()
        parent = frame["parent"].to_numpy()
        top = np.array([p < 0 or src[p] != src[i] for i, p in enumerate(parent)], dtype=bool)
        again = np.array(redispatched(parent.tolist(), list(zip(src, frame["name"]))), dtype=bool)
        frame = frame.assign(_call=~again, _top_dur=np.where(top, frame["dur_us"], 0.0),
                             _top_dev=np.where(top, frame["device_total_us"], 0.0),
                             _top_mem=np.where(top, frame["memory_bytes"].fillna(0.0), 0.0),
                             **_flops_columns(frame, again))
        g = frame.groupby("source", sort=False)
        out = pd.DataFrame({
            # the line's three costliest ops by self time: what the line spends its time in
            "name": g[["name", "self_us"]].apply(
                lambda d: ", ".join(d.groupby("name")["self_us"].sum().nlargest(3).index)),
            "calls": g["_call"].sum(),  # every op call on the line: what its costliest ops are drawn from
            "cpu_self_us": g["self_us"].sum(),
            "cpu_total_us": g["_top_dur"].sum(),
            "device_self_us": g["device_self_us"].sum(),
            "device_total_us": g["_top_dev"].sum(),
            "flops": g["_flops"].sum(min_count=1),
            "flops_calls": g["_flop_call"].sum(),
            "_flops_us": g["_flops_us"].sum(min_count=1),
            "_flops_dev": g["_flops_dev"].sum(min_count=1),
            "self_memory_bytes": g["self_memory_bytes"].sum(min_count=1),
            "memory_bytes": g["_top_mem"].sum(),
            "category": g["category"].agg(_mode),
            "dtype": g["math_dtype"].agg(_mode),
        }).reset_index()
        out["shapes"] = ""
        if frame["memory_bytes"].isna().all():
            out["memory_bytes"] = np.nan
    else:
        keys = ["name"] if group == "op" else ["name", "shapes"]
        again = np.array(redispatched(frame["parent"].tolist(), frame["name"].tolist()
                                      if group == "op" else list(zip(frame["name"], frame["shapes"]))), dtype=bool)
        once = ~again
        frame = frame.assign(_call=once, _dur=frame["dur_us"].where(once, 0.0),
                             _dev=frame["device_total_us"].where(once, 0.0),
                             **_flops_columns(frame, again), _mem=frame["memory_bytes"].where(once),
                             _inner_dtype=frame["math_dtype"].where(again))
        g = frame.groupby(keys, sort=False)
        out = pd.DataFrame({
            "calls": g["_call"].sum(),
            "cpu_self_us": g["self_us"].sum(),
            "cpu_total_us": g["_dur"].sum(),
            "device_self_us": g["device_self_us"].sum(),
            "device_total_us": g["_dev"].sum(),
            "flops": g["_flops"].sum(min_count=1),
            "flops_calls": g["_flop_call"].sum(),
            "_flops_us": g["_flops_us"].sum(min_count=1),
            "_flops_dev": g["_flops_dev"].sum(min_count=1),
            "self_memory_bytes": g["self_memory_bytes"].sum(min_count=1),
            "memory_bytes": g["_mem"].sum(min_count=1),
            "category": g["category"].first(),
            # The dtype the math ran in: a re-dispatch's (autocast's bf16 matmul inside the fp32 call).
            "dtype": g["_inner_dtype"].first().fillna(g["math_dtype"].first()),
        }).reset_index()
        if group == "op":
            out["shapes"] = ""
        out["source"] = None
    on_device = device_total_us > 0
    time = out["_flops_dev"] if on_device else out["_flops_us"]  # the counted calls' time: `flop_calls`
    out["flops_per_s"] = (out["flops"] / (time * 1e-6)).where(time > 0)
    base = device_total_us if on_device else float(frame["self_us"].sum())
    share = out["device_self_us"] if on_device else out["cpu_self_us"]
    out["percent"] = 100.0 * share / base if base > 0 else np.nan
    return out[COLUMNS]


def self_flops(frame: pd.DataFrame) -> pd.Series:
    """Each op event's own FLOPs: its formula's count where the header counts it (the innermost
    op with a formula, ``flops_counted``), else NaN. A wrapper (``aten::linear`` over
    ``aten::addmm``, ``aten::matmul`` over ``aten::mm``, autocast's outer ``aten::matmul``) would
    otherwise repeat its children's FLOPs, and a table sorted by FLOPs would list the same work
    two or three times."""
    return frame["flops"].where(frame["flops_counted"].astype(bool))


def _flops_columns(frame: pd.DataFrame, again) -> dict:
    """`group_ops`' per-event FLOP columns: self FLOPs, whether the event is a call that carries
    them (`flop_calls`), and the counted events' own CPU and device time (NaN elsewhere, so a
    row's sums are over exactly the events `group_rows` sums)."""
    counted = frame["flops_counted"].astype(bool)
    return {"_flops": self_flops(frame),
            "_flop_call": flop_calls(frame["parent"].tolist(), list(again), counted.tolist()),
            "_flops_us": frame["dur_us"].where(counted), "_flops_dev": frame["device_total_us"].where(counted)}


def sort_table(table: pd.DataFrame, column: str, ascending: bool = False) -> pd.DataFrame:
    import pandas as pd
    if column not in table.columns:
        raise ValueError(f"cannot sort by {column!r}; columns: {', '.join(table.columns)}")
    numeric = pd.api.types.is_numeric_dtype(table[column])
    key = None if numeric else (lambda s: s.astype(str).str.lower().where(s.notna()))
    return table.sort_values(column, ascending=ascending, kind="stable", na_position="last",
                             key=key).reset_index(drop=True)


_REGEX_SIGNS = set("|()[]{}*+?^$\\")


def _as_regex(text: str):
    """(the compiled pattern, case-insensitive, or None; why ``text`` is no regex, or None): only text written
    with regex signs is read as one, and "[" or "c++" that fail to compile are plain text."""
    if not _REGEX_SIGNS & set(text):
        return None, None
    try:
        return re.compile(text, re.IGNORECASE), None
    except re.error as exc:
        return None, str(exc)


def name_matcher(text: str):
    """Whether a name (or source line) holds ``text``, case-insensitive, or, where ``text`` reads as a
    regular expression, matches it. A lab trial typed ``aten::(mm|addmm)`` and was told no operator matches.
    Both, not the regex alone: a source line's ``model.py(12)`` is a regex that no longer matches itself."""
    text = text.strip()
    pattern, _ = _as_regex(text)
    return lambda s: text.lower() in s.lower() or (pattern is not None and pattern.search(s) is not None)


def regex_error(text: str) -> str | None:
    """Why ``text``, written with regex signs, is no regular expression ("missing ), unterminated subpattern
    at position 6"), for a filter that matched nothing: `name_matcher` then searched it as plain text alone,
    and "no row matching 'aten::(mm'" said nothing of the typo. None where it is one, or has no regex signs."""
    return _as_regex((text or "").strip())[1]


def filter_table(table: pd.DataFrame, text: str) -> pd.DataFrame:
    """Rows whose name or source line `name_matcher` matches (each on its own, so "^" and "$" anchor at
    the name's ends); all rows for an empty ``text``."""
    if not (text or "").strip():
        return table
    matches = name_matcher(text)
    keep = np.zeros(len(table), dtype=bool)
    for column in ("name", "source"):
        keep |= table[column].fillna("").astype(str).map(matches).to_numpy(dtype=bool)
    return table[keep].reset_index(drop=True)


def filter_rows(rows: list[dict], text: str) -> list[dict]:
    """`filter_table` over row dicts."""
    if not (text or "").strip():
        return rows
    matches = name_matcher(text)
    return [r for r in rows if any(isinstance(r.get(c), str) and matches(r[c]) for c in ("name", "source"))]


def select(frame: pd.DataFrame, sort: str, ascending: bool = False, filter: str = "",  # noqa: A002
           top: int | None = None) -> pd.DataFrame:
    """Filter, then sort by a --sort key (cpu, self, ...) or any column name, then keep ``top`` rows."""
    frame = sort_table(filter_table(frame, filter), SORT_COLUMNS.get(sort, sort), ascending)
    return frame.head(top) if top else frame


# --- categories, Tensor Cores, shapes --------------------------------------------------------------

def cpu_categories(ops: pd.DataFrame, phases: list | None = None, gaps: list | None = None) -> pd.DataFrame:
    """Self CPU time per op category (self times add up to the profiled CPU time exactly; with
    ``gaps``, the DataLoader time no op covers is added as "data loading").

    ``phases`` (`nbaccel.analysis.phases.op_phases`, row-aligned): an op's phase ("compiling",
    "data loading") replaces its own category. ``gaps``: time inside DataLoader ranges that no op
    covers, each one more "data loading" entry. See `cpu_category_rows`.
    """
    import pandas as pd
    cols = ["category", "time_us", "count", "percent"]
    if not len(ops) and not gaps:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    frame = ops[["category", "self_us"]]
    if phases is not None:
        frame = frame.assign(category=[p or c for p, c in zip(phases, frame["category"])])
    if gaps:
        frame = pd.concat([frame, pd.DataFrame({"category": [DATA_LOADING] * len(gaps), "self_us": gaps})],
                          ignore_index=True)
    g = frame.groupby("category")["self_us"].agg(["sum", "count"])
    total = float(g["sum"].sum())
    out = pd.DataFrame({"category": g.index, "time_us": g["sum"].to_numpy(), "count": g["count"].to_numpy()})
    out["percent"] = 100.0 * out["time_us"] / total if total > 0 else 0.0
    order = {c: i for i, c in enumerate(CATEGORIES)}
    out["_o"] = out["category"].map(order)
    return out.sort_values(["time_us", "_o"], ascending=[False, True]).drop(columns="_o").reset_index(drop=True)


def fp32_miss_rows(ops, min_share: float = 0.01) -> list[tuple[str, str, int, float, float]]:
    """Heavy fp32 matmul/conv ops that ran on the device without Tensor Core kernels, as
    (name, shapes, calls, device_us, share) tuples, most device time first.

    They are eligible (TF32 on Ampere+, or autocast to bf16/fp16) but used SIMT kernels.
    Only ops that launched kernels themselves are considered (``device_self_us`` > 0), so an
    ``aten::linear`` wrapping an ``aten::addmm`` is reported once. ``min_share``: of device time.
    ``ops``: column lists (`TraceData.op_columns`) or a DataFrame of the op rows.
    """
    return _fp32_misses(ops, min_share)[0]


def _fp32_misses(ops, min_share: float) -> tuple[list, bool]:
    """(`fp32_miss_rows`, whether any op was a candidate before the ``min_share`` cut)."""
    if not len(ops["name"]):
        return [], False
    col = ops.__getitem__ if isinstance(ops, dict) else (lambda c: ops[c].tolist())  # lists or a DataFrame
    dev_self, tc = col("device_self_us"), col("tc_device_us")
    total = pairwise_sum(dev_self)
    sel = [i for i, (cat, dt) in enumerate(zip(col("category"), col("math_dtype")))
           if cat == "matmul/conv" and dt == "fp32" and dev_self[i] > 0 and tc[i] <= 0]
    if not sel or total <= 0:
        return [], False
    names, dims = col("name"), col("input_dims")
    groups: dict[tuple, list[float]] = {}  # first appearance order, like groupby(sort=False)
    for i in sel:
        groups.setdefault((names[i], _shape_text(dims[i])), []).append(dev_self[i])
    rows = []
    for (name, shapes), times in groups.items():
        device_us = kahan_sum(times)
        if device_us / total >= min_share:
            rows.append((name, shapes, len(times), device_us, device_us / total))
    return [rows[i] for i in desc_order([r[3] for r in rows])], True


FP32_MISS_COLUMNS = ["name", "shapes", "calls", "device_us", "share"]


def fp32_tensor_core_misses(ops, min_share: float = 0.01) -> pd.DataFrame:
    """`fp32_miss_rows` as a DataFrame (columns name, shapes, calls, device_us, share)."""
    import pandas as pd
    rows, candidates = _fp32_misses(ops, min_share)
    if not candidates:
        return pd.DataFrame(columns=FP32_MISS_COLUMNS)
    return pd.DataFrame({  # typed even when min_share left no row, as the groupby's frame was
        "name": pd.Series([r[0] for r in rows], dtype="str"),
        "shapes": pd.Series([r[1] for r in rows], dtype="str"),
        "calls": pd.Series([r[2] for r in rows], dtype="int64"),
        "device_us": pd.Series([r[3] for r in rows], dtype="float64"),
        "share": pd.Series([r[4] for r in rows], dtype="float64"),
    })


def gemm_dims(name: str, dims, concrete=None) -> dict | None:
    """The (M, K, N) of a matmul op, or the channels of a convolution, from its input dims (and, for a
    convolution, its Concrete Inputs, which say whether it is transposed)."""
    def shape(i):
        if not isinstance(dims, (list, tuple)) or i >= len(dims):
            return None
        s = dims[i]
        return [int(x) for x in s] if isinstance(s, (list, tuple)) and s else None

    base = name.split("::")[-1]
    if base in ("mm", "bmm", "matmul", "_int_mm", "_scaled_mm"):
        a, b = shape(0), shape(1)
    elif base in ("addmm", "baddbmm", "addbmm"):
        a, b = shape(1), shape(2)
    elif base == "linear":
        a, w = shape(0), shape(1)
        if a is None or w is None or len(w) != 2:
            return None
        return {"M": int(np.prod(a[:-1])) if len(a) > 1 else 1, "K": a[-1], "N": w[0]}
    elif "conv" in base:
        # convolution_backward takes (grad_output, input, weight, ...): its input and weight come second
        # (read as (input, weight), the batch size passed for C_out and was "padded").
        x, w = (shape(1), shape(2)) if base.endswith("_backward") else (shape(0), shape(1))
        if x is None or w is None or len(w) < 3:
            return None
        # Implicit GEMM: K = C_in/groups * kernel volume, N = C_out; the channels are what to pad. A
        # transposed convolution's weight is (C_in, C_out/groups, ...).
        # (by name, conv_transpose2d; else by the argument of _convolution / convolution_backward, which
        # carry the FLOPs: read by name alone, a ConvTranspose1d(6, 10) was told to pad C_out=6)
        transposed = "transpose" in base or conv_transposed(name, concrete) is True
        c_out = w[1] if transposed else w[0]
        return {"C_in": x[1] if len(x) > 1 else None, "C_out": c_out}
    else:
        return None
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return None
    return {"M": a[-2], "K": a[-1], "N": b[-1]}


def unaligned_shapes(ops, total_us: float | None = None, kept_fp32_by: list | None = None) -> list[dict]:
    """Matmul/conv calls whose GEMM dims are not multiples of 8 (16 for int8), with padded sizes.

    Tensor Cores (and CPU AMX tiles, which take bf16/fp16/int8 but not fp32) process fixed-size
    tiles; a dim of 1001 runs as 1008 with the tail wasted, and cuBLAS may fall back to slower
    kernels for odd leading dimensions. Each distinct (op, shapes) is listed once, with its calls,
    time (device total on a GPU profile, CPU total on the CPU), self FLOPs and, given the profile's
    ``total_us``, ``share`` of it (else None); most time first, then most FLOPs. ``ops``: the op
    rows as a DataFrame or as column lists (`TraceData.op_columns`). ``kept_fp32_by``: per row, the
    op around it that autocast keeps in fp32 (`nbaccel.kept_fp32`), noted as the entry's ``kept_fp32_by``.
    """
    if not len(ops["name"]):
        return []
    col = ops.__getitem__ if isinstance(ops, dict) else (lambda c: ops[c].tolist())  # lists or a DataFrame
    names, dims_col, dtypes = col("name"), col("input_dims"), col("dtype")
    # a merged or hand-made table may lack them: convolutions are then read by name alone
    concrete = col("concrete_inputs") if "concrete_inputs" in ops else [None] * len(names)
    dev_total, dur, flops = col("device_total_us"), col("dur_us"), col("flops")
    found: dict[tuple, dict] = {}
    on_device = any(v > 0 for v in col("device_self_us"))
    for i, (cat, counted) in enumerate(zip(col("category"), col("flops_counted"))):
        if cat != "matmul/conv" or not counted:
            continue
        name, input_dims, dtype = names[i], dims_col[i], dtypes[i]
        dims = gemm_dims(name, input_dims, concrete[i])
        if not dims:
            continue
        multiple = 16 if dtype == "int8" else 8
        # A dim of 1 is a matrix-vector product: no tile to fill, padding would only add work.
        bad = {k: v for k, v in dims.items() if v is not None and v > 1 and v % multiple}
        if not bad:
            continue
        key = (name, _shape_text(input_dims))
        entry = found.setdefault(key, {
            "op": name, "shapes": key[1], "dtype": dtype, "multiple": multiple, "dims": dims,
            "unaligned": bad, "pad_to": {k: pad_to_multiple(v, multiple) for k, v in bad.items()},
            "calls": 0, "time_us": 0.0, "flops": 0.0, "kept_fp32_by": kept_fp32_by[i] if kept_fp32_by else None})
        entry["calls"] += 1
        entry["time_us"] += float(dev_total[i] if on_device else dur[i])
        entry["flops"] += 0.0 if _isnan(flops[i]) else float(flops[i])  # counted ops only: their self FLOPs
    for entry in found.values():
        entry["share"] = entry["time_us"] / total_us if total_us else None
    return sorted(found.values(), key=lambda e: (-e["time_us"], -e["flops"]))


# --- the same tables from plain column lists -------------------------------------------------------
#
# A live %%profile_gpu shows a top-K table, categories and advice computed from a few hundred op
# rows. pandas spends ~0.1 ms per groupby/sort/assign whatever the size, which added up to ~10 ms
# per profile, so the display path computes them with plain Python over `TraceData.op_columns`.
# The results are the same numbers as the DataFrame functions above, to the last bit: group sums
# use pandas' Kahan-compensated summation, totals numpy's pairwise sum, sorts are stable with NaN
# last like ``sort_values(kind="stable")`` (tests/test_profile_rows.py compares both on real
# profiles and reference traces). The DataFrames (`group_ops`, `cpu_categories`) remain what
# ``result.ops`` / ``result.categories`` return, built on first access.

def _isnan(value) -> bool:
    return value is None or value != value


def redispatched(parent: list, keys: list) -> list[bool]:
    """Whether each op was recorded inside an op of the same table row (same name, or name and
    shapes): a wrapper's re-dispatch of one call (autocast runs ``aten::matmul`` again, in bf16,
    inside the fp32 ``aten::matmul`` the user called), not a second call. Counting both, as
    ``key_averages()`` does, doubles the row's calls, total time and FLOPs."""
    return [p >= 0 and keys[p] == keys[i] for i, p in enumerate(parent)]


def flop_calls(parent: list, again: list, counted: list) -> list[bool]:
    """Whether each op is the first counted op (`self_flops`) of its call (the call itself, or the
    call it re-dispatches: `redispatched`), so a row's count of them is how many of its calls carry
    its FLOPs. Those calls' time is what the row's FLOP/s divides by: a row's FLOPs may come from
    only some of its calls (an ``aten::_convolution`` counts a transposed convolution's FLOPs itself,
    an ordinary one's on the op inside it), and dividing by all the calls' time read a UNet's
    transposed convolutions at 998 MFLOP/s for 7.64 GFLOP/s. Counted ops never nest (the innermost
    op with a formula), so their times add up without counting any twice."""
    seen = set()
    first = [False] * len(counted)
    for i, c in enumerate(counted):
        if c:
            j = i
            while again[j]:
                j = parent[j]
            first[i] = j not in seen
            seen.add(j)
    return first


def group_rows(cols: dict, group: str = "op", device_total_us: float = 0.0) -> list[dict]:
    """`group_ops` for ``op`` and ``op+shape`` over column lists: one dict per row, COLUMNS keys.

    ``cols`` holds `TraceData.op_columns` plus ``shapes`` (and ``self_memory_bytes`` /
    ``memory_bytes`` when recorded). Rows come in order of first appearance, like
    ``groupby(sort=False)``.
    """
    if group not in ("op", "op+shape"):
        raise ValueError(f"group_rows handles op and op+shape, not {group!r} (use group_ops)")
    names = cols["name"]
    n = len(names)
    if not n:
        return []
    keys = names if group == "op" else list(zip(names, cols["shapes"]))
    members: dict = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    again = redispatched(cols["parent"], keys)
    nan = float("nan")
    self_us, dur, dev_self, dev_total = cols["self_us"], cols["dur_us"], cols["device_self_us"], cols["device_total_us"]
    flops, counted, category, math_dtype = cols["flops"], cols["flops_counted"], cols["category"], cols["math_dtype"]
    self_mem, mem = cols.get("self_memory_bytes"), cols.get("memory_bytes")
    on_device = device_total_us > 0
    base = device_total_us if on_device else pairwise_sum(self_us)
    flop_call = flop_calls(cols["parent"], again, counted)

    def total(column, rows, min_count=False):
        if column is None:
            return nan
        if min_count and all(_isnan(column[i]) for i in rows):
            return nan
        return kahan_sum(column[i] for i in rows)

    def first(column, rows):
        return next((column[i] for i in rows if not _isnan(column[i])), None)

    out = []
    for key, rows in members.items():
        calls = [i for i in rows if not again[i]]  # a re-dispatch is part of its parent's call
        with_flops = [i for i in rows if counted[i]]
        row = {
            "name": key if group == "op" else key[0],
            "shapes": "" if group == "op" else key[1],
            "source": None,
            "category": first(category, rows),
            "calls": len(calls),
            "cpu_self_us": total(self_us, rows),
            "cpu_total_us": total(dur, calls),
            "device_self_us": total(dev_self, rows),
            "device_total_us": total(dev_total, calls),
            "flops": total(flops, with_flops, min_count=True),  # self FLOPs (`self_flops`)
            "flops_calls": sum(flop_call[i] for i in rows),
            "self_memory_bytes": total(self_mem, rows, min_count=True),
            "memory_bytes": total(mem, calls, min_count=True),
            # The dtype the math ran in: a re-dispatch's (autocast's bf16 matmul inside the fp32 call).
            "dtype": first(math_dtype, [i for i in rows if again[i]]) or first(math_dtype, rows),
        }
        # over the time of the calls that carry the FLOPs, not all the row's (`flop_calls`)
        time = total(dev_total if on_device else dur, with_flops, min_count=True)
        row["flops_per_s"] = row["flops"] / (time * 1e-6) if time > 0 else nan
        share = row["device_self_us"] if on_device else row["cpu_self_us"]
        row["percent"] = 100.0 * share / base if base > 0 else nan
        out.append({c: row[c] for c in COLUMNS})
    return out


def sort_rows(rows: list[dict], column: str, ascending: bool = False) -> list[dict]:
    """`sort_table` for a numeric column over row dicts: stable, NaN last, either direction."""
    present = [r for r in rows if not _isnan(r[column])]
    missing = [r for r in rows if _isnan(r[column])]
    return sorted(present, key=lambda r: r[column], reverse=not ascending) + missing


def cpu_category_rows(cols: dict, phases: list | None = None, gaps: list | None = None) -> list[tuple[str, float, int, float]]:
    """`cpu_categories` as (category, time_us, count, percent) tuples, largest first.

    An op's phase (compiling, data loading) replaces its category, and the DataLoader's uncovered
    time (``gaps``) is added as "data loading": each moment is counted once, in one category."""
    cats = cols["category"] if phases is None else [p or c for p, c in zip(phases, cols["category"])]
    gaps = list(gaps or ())
    return category_totals(list(cats) + [DATA_LOADING] * len(gaps), list(cols["self_us"]) + gaps)
