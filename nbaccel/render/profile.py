"""How a `ProfileResult` looks: text, static HTML, and the JupyterLab widget.

The widget only re-renders the top-K rows of an already grouped table (grouping is cached on
the result), so sorting, filtering and regrouping stay interactive on profiles with tens of
thousands of op events.
"""

from __future__ import annotations

import math
import os

from ..analysis import CATEGORIES
from ..analysis.sums import desc_order
from ..memory import format_bytes
from ..options import option
from ..profile_result import step_numbers_text
from ..profile_table import gemm_dims, regex_error
from ..timing import format_seconds
from .common import (bar, bullet_list, esc, figures, format_share, labelled, method_html, prose, si, table, text_table,
                     wrap)

# (column of the table, header shown, kind) in display order; kind picks the formatter.
_COLUMNS = [
    ("source", "source line", "text"),
    ("name", "operator", "text"),
    ("shapes", "input shapes", "text"),
    ("calls", "calls", "int"),
    ("cpu_self_us", "self CPU", "time"),
    ("cpu_total_us", "CPU total", "time"),
    ("device_self_us", "self device", "device time"),
    ("device_total_us", "device total", "device time"),
    ("percent", "% of total", "pct"),
    ("flops", "self FLOPs", "flops"),  # each op's own, as the header counts them: `flops_basis`
    ("flops_per_s", "FLOP/s", "rate"),
    ("self_memory_bytes", "self mem alloc", "bytes"),
    ("memory_bytes", "mem alloc", "bytes"),
]
_TEXT_COLUMNS = {col for col, _, kind in _COLUMNS if kind == "text"}


def natural_ascending(col: str) -> bool:
    """A column's first order when chosen: names A to Z, numbers largest first (as headers sort elsewhere)."""
    return col in _TEXT_COLUMNS


def sort_label(key: str) -> str:
    """A --sort key as the table's column header says it: ``self`` -> "self CPU"."""
    from ..profile_table import SORT_COLUMNS

    column = SORT_COLUMNS.get(key, key)
    return next((label for col, label, _ in _COLUMNS if col == column), key)


def _time(us) -> str:
    return "-" if us is None or us != us else ("0" if us == 0 else format_seconds(us * 1e-6))


def _fmt(kind: str, value) -> str:
    if kind == "text":
        return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
    if kind == "int":
        return f"{int(value):,}"
    if kind == "time":
        return _time(value)
    if kind == "device time":  # an op that launched no kernel has no device time: "-", like its FLOPs
        return "-" if not value or value != value else _time(value)
    if kind == "pct":  # "<0.1%", not a "0.0%" that reads as none
        return "-" if value is None or value != value else format_share(value / 100.0)
    if kind == "flops":
        return si(value, "FLOP") if value else "-"
    if kind == "rate":
        return si(value, "FLOP/s") if value else "-"
    if kind == "bytes":
        return "-" if value is None or value != value else format_bytes(value)
    return str(value)


def visible_columns(result, group: str) -> list[tuple[str, str, str]]:
    """Columns worth showing: no device columns on a CPU profile, memory only with --memory."""
    cols = []
    for col, label, kind in _COLUMNS:
        if col == "source" and group != "source":
            continue
        if col == "shapes" and group != "op+shape":
            continue
        if col.startswith("device") and not result.on_device:
            continue
        if col.endswith("memory_bytes") and not result.options.memory:
            continue
        if col == "name" and group == "source":
            label = "costliest ops there"  # a source row is a cell line or a function (def line)
        if col == "calls" and group == "source":
            label = "op calls"  # every op call the line made (profile_table.group_ops), not how often it ran
        if col == "flops_per_s":
            label = f"FLOP/s ({'device' if result.on_device else 'CPU'} total)"  # the divisor: flops_rate_basis
        if col == "percent":  # "% of total" beside a CPU total column read as that column's share (a trial)
            label = "% of device" if result.on_device else "% of self CPU"
        cols.append((col, label, kind))
    return cols


# Why self FLOPs: the profiler records wrappers and the ops they run (aten::linear -> aten::addmm,
# aten::matmul -> aten::mm, autocast's matmul inside the user's), each with shapes a formula fits;
# a column that gave every op its formula's count listed the same work two or three times
# (profile_table.self_flops).
FLOPS_BASIS = ("FLOPs from input shapes (torch.utils.flop_counter conventions); the self FLOPs column is each "
               "op's own, counted as the header counts them: an op whose child op has a formula (aten::linear "
               "over aten::addmm) shows \"-\", so the column sums to the header's FLOPs")


def flops_rate_basis(result) -> str:
    """What the op table's FLOP/s column divides a row's FLOPs by (`profile_table.group_rows`)."""
    # over the calls that carry the FLOPs (`profile_table.flop_calls`), said where a row's are not all its calls
    # (the method paragraph ran 10-17 lines on every profile; this clause is for the few that have one)
    some = ("; where only some of an op row's calls carry its FLOPs (an aten::_convolution counts a transposed "
            "convolution's FLOPs itself, an ordinary one's on the op inside it), the figure is over those calls "
            "and says so: \"(2 of 13 calls)\"") if _some_rows_partly_counted(result) else ""
    if result.on_device:
        return ("FLOP/s column = the row's FLOPs / the device total time of the calls that carry them (summed "
                "durations of the kernels and copies the op and its child ops launched; \"-\" for an op that "
                "launched none)" + some)
    return ("FLOP/s column = the row's FLOPs / the CPU total time of the calls that carry them (the op's duration "
            "on the CPU, child ops included)" + some)


def _some_rows_partly_counted(result) -> bool:
    """Whether a row of the op table (grouped by op, every row) has a FLOP/s over only some of its calls.
    From the row lists: the display builds no DataFrame (`%%profile_gpu`'s overhead target)."""
    return any(_flops_coverage(r) for r in result.grouped_rows("op"))


def records(frame) -> list[dict]:
    """Table rows as dicts: `ProfileResult.top_rows` already are; a DataFrame is converted."""
    return frame if isinstance(frame, list) else frame.to_dict("records")


def _rows(result, frame, cols):
    by_op = all(col != "source" for col, _, _ in cols)  # a source row's calls are every op on the line
    return [[_fmt(kind, r[col]) + (_flops_coverage(r) if col == "flops_per_s" and by_op else "")
             for col, _, kind in cols] for r in records(frame)]


def _flops_coverage(row) -> str:
    """The " (2 of 13 calls)" after a FLOP/s that is over only some of the row's calls: the ones that carry
    its FLOPs (`profile_table.flop_calls`; an aten::_convolution counts a transposed convolution's FLOPs
    itself, an ordinary one's on the op inside it). Without it the figure read as all the calls' rate."""
    counted, calls, rate = row["flops_calls"], row["calls"], row["flops_per_s"]
    return f" ({int(counted):,} of {int(calls):,} calls)" if rate and rate == rate and 0 < counted < calls else ""


# --- the header ------------------------------------------------------------------------------------

def header_items(result) -> list[tuple[str, str]]:
    h = result.header
    # "no warm-up" where it is so: the step may be the code's first call (see `method`)
    steps = f"{h['steps']} step{'s' if h['steps'] > 1 else ''}" + (f" after {h['warmup']} warmup" if h["warmup"]
                                                                  else ", no warm-up")
    if result.loaded:
        # the numbers, not a warm-up count: #1-#3 says one step ran unrecorded first, which is all the file tells
        steps = (f"{h['steps']} ProfilerStep range{'s' if h['steps'] > 1 else ''}{step_numbers_text(result.step_numbers)}"
                 if h["steps"] else "no ProfilerStep ranges")
    # Wall time is the span of the recorded events: with none (a cell of plain Python) there is no
    # span to show, and "0" would read as a measurement.
    # The clock around the steps (the contention meter's span) still timed them: said, as the method says it
    # (a trial read "wall time: none recorded" above "the profiled steps lasted 323 µs").
    timed = sum(result.contention.wall_s.values()) if result.contention is not None else 0.0
    lasted = f"; the step{'s' if h['steps'] > 1 else ''} lasted {format_seconds(timed)}" if timed else ""
    wall = _time(h["wall_us"]) if h["ops"] or h["kernels"] else f"no op recorded{lasted}"
    items = [("wall time", f"{wall} ({steps})")]
    if result.on_device:
        items.append(("device time", _time(h["device_time_us"])))
        busy = h["device_busy_fraction"]
        items.append(("device busy", "-" if busy is None else f"{busy:.0%}"))
    else:
        items.append(("device time", "no GPU: CPU profiled"))
    items.append(("op calls / kernels", f"{h['ops']:,} / {h['kernels']:,}"))
    slowest = _slowest_item(result)
    if slowest:
        items.append(("slowest", slowest))
    if h["flops"]:
        # the total FLOPs too: the table's self FLOPs column sums to it
        items.append(("achieved", f"{si(h['flops_per_s'], 'FLOP/s')} ({si(h['flops'], 'FLOP')}, "
                                  f"{h['dominant_dtype']}, over {h['flops_per_s_basis']})"))
    else:
        items.append(("achieved", "no FLOP formula matched an op"))
    if h["fraction_of_peak"] is not None:
        items.append(("of peak", f"{h['fraction_of_peak']:.1%}"))
    if h.get("unknown_events"):
        kinds = ", ".join(sorted(result.trace.unknown_events, key=result.trace.unknown_events.get, reverse=True)[:3])
        items.append(("skipped", f"{h['unknown_events']:,} events of unknown kinds ({kinds})"))
    if result.loaded and result.loaded.get("skipped"):
        items.append(("not loaded", skipped_files_text(result.loaded["skipped"])))
    if result.loaded and result.loaded.get("far_apart"):
        items.append(("warning", result.loaded["far_apart"]))
    return items


def _slowest_item(result) -> str | None:
    """The slowest row in a few words, for the header: a trial found the slowest op at line 9 of the
    text (13 under a warning), below the fold of a notebook's output. By time, not by ``--sort``."""
    row = result.slowest_row() if result.op_count else None
    if not row or row.get("percent") is None or row["percent"] != row["percent"]:  # NaN: no share
        return None
    name = row.get("source") if result.options.group == "source" and row.get("source") else row["name"]
    basis = "device time" if result.on_device else "self CPU time"
    return f"{name} ({format_share(row['percent'] / 100.0)} of {basis})"


def skipped_files_text(skipped: dict) -> str:
    """The trace files a folder load left out, with why (a warning says it once; the result keeps it)."""
    shown = [f"{name} ({why})" for name, why in list(skipped.items())[:3]]
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return f"{len(skipped)} unreadable file{'s' if len(skipped) > 1 else ''} in the folder: " + "; ".join(shown) + more


def trace_line(result, perfetto: str = "ui.perfetto.dev") -> str:
    created = f"; created the folder {result.trace_created}" if result.trace_created else ""
    files = result.trace_files
    if len(files) < 2:
        return f"trace: {', '.join(files)}  (open at {perfetto}{created})"
    # A folder's files, one per step: their tensorboard_trace_handler names ({host}_{pid}.{ms}) did not say
    # which step each holds (a trial), so the line says what the names are and numbers them in step order.
    folder = os.path.dirname(files[0])
    named = [f"step {i} {os.path.basename(f)}" for i, f in enumerate(files, 1)]
    if len(named) > 6:
        named = [*named[:2], f"... ({len(named) - 3} more)", named[-1]]
    return (f"trace: {len(files)} files in {folder}{os.sep}, one per profiled step, named {{host}}_{{pid}}.{{ms}}"
            f".pt.trace.json (ms: the step's start in Unix milliseconds, so they sort in step order): "
            f"{', '.join(named)}  (open each at {perfetto}{created})")


def earlier_traces_note(result) -> str:
    """`%profile_trace FOLDER` reads a folder as one run: said when --trace FOLDER held others' files, which
    it then refuses (this process's earlier profiles: `trace_result._separate_runs`) or warns of (another
    process's: `_warn_if_several_processes`)."""
    n = len(result.trace_earlier)
    if not n:
        return ""
    return (f"the trace folder already held {n} trace file{'s' if n > 1 else ''} of other runs, which loading "
            "the folder cannot read as one run with this one (it stops, or warns, naming the files): give each "
            "run a folder of its own")


def title(result) -> str:
    h = result.header
    if result.loaded:
        where = f"recorded on {h['device']}" if result.on_device else "a CPU-only trace"
        return f"{result.made_by}: {h['profiled']} -- {where}; analysed from the file, not a live run"
    recipe = f", under {h['recipe']}" if h["recipe"] else ""
    return f"{result.made_by} on {h['device']} -- {h['profiled']}{recipe}"


def method(result) -> str:
    o = result.options
    if result.loaded:
        return ("torch.profiler Chrome trace recorded elsewhere, streamed from "
                + ", ".join(os.path.basename(f) for f in result.loaded["files"][:3])
                + (f" and {len(result.loaded['files']) - 3} more" if len(result.loaded["files"]) > 3 else "")
                + f" ({result.loaded['events']:,} events, {format_seconds(result.loaded['load_seconds'])}). Wall time = span of "
                f"the recorded events; device busy = union of kernel and copy intervals; {FLOPS_BASIS}; "
                + ("peak from the trace's deviceProperties GPU; Tensor Cores judged from kernel names" if result.on_device
                   else "no peak or Tensor Cores: a CPU-only trace (no kernels)")
                + "; events of "
                f"unknown kinds are counted and skipped; {flops_rate_basis(result)}; contention from other programs: "
                "not measured (loaded trace).")
    flags = ["record_shapes"] + (["profile_memory"] if o.memory else []) + (["with_stack"] if o.stack else [])
    acts = "CPU+CUDA" if result.device.type == "cuda" else "CPU"
    ran = o.warmup + o.steps + result.unrecorded_steps  # prof.step() past the schedule: ran, not recorded
    sched = (f"schedule(warmup={o.warmup}, active={o.steps}): the code ran {ran} times, "
             f"{o.steps} analysed" if o.scheduled else "one run")
    if not o.warmup:
        # A user trial profiled a CNN's first call: 49 ms, then 20 ms the next time, and nothing said why.
        sched += (", no warm-up: had the code not run before, its one-time setup (oneDNN/cuDNN, lazy optimizer "
                  f"state, allocator growth) is in these times, and {option('warmup', 1)} profiles a later run")
    contention = (result.contention.summary("the profiled steps", " while the cell was profiled")
                  if result.contention else "contention: not measured")
    # device busy and Tensor Cores only where there are kernels: a CPU profile has neither
    device = ("device busy = union of kernel and copy intervals; " if result.on_device else "")
    cores = "Tensor Cores judged from kernel names; " if result.on_device else ""
    return (f"torch.profiler (Kineto), {acts} activities, {', '.join(flags)}; {sched}; {contention}. Wall time = "
            f"span of the recorded events; self time = op duration minus its child ops; {device}{FLOPS_BASIS}; "
            f"{flops_rate_basis(result)}; {cores}categories by {'op/kernel' if result.on_device else 'op'} name.")


# --- sections --------------------------------------------------------------------------------------

def nothing_recorded(result) -> str | None:
    """The line a profile without a single op or kernel (a cell of plain Python) shows instead of
    an operator table and a time-by-category section with no rows; None when there is something.
    A user trial read the bare table header and "time by category:" as a display fault."""
    if result.op_count or result.kernel_count:
        return None
    what = "torch operators or GPU kernels" if result.device.type == "cuda" else "torch operators"
    return f"no {what} were recorded, so there is no operator table or time by category"


def category_rows(result):
    return result.category_rows


# On the CPU an op's phase (`analysis.phases.op_phases`) replaces its kind in the time by category: each
# phase, and what puts an op in it.
_PHASES = {"optimizer": "inside Optimizer.step", "data loading": "inside a DataLoader's __next__",
           "compiling": "inside torch.compile's compiling", "attention": "inside an attention op or its backward",
           "normalization": "inside a norm op or its backward"}


def phase_note(result) -> str | None:
    """Why an op's category in the table (its kind) can differ from the bar it counts in: a trial read
    aten::add_ as "elementwise" in the table and its time under "optimizer" in the bars."""
    if result.on_device:  # kernels are categorized by their kind alone
        return None
    present = [c for c, *_ in category_rows(result) if c in _PHASES]
    if not present:
        return None
    where = "; ".join(f"{c}: {_PHASES[c]}" for c in present)
    return (f"an op counts here under the phase it ran in ({where}), whatever its kind in "
            "the op table's category column")


def categories_html(result) -> str:
    rows = category_rows(result)
    if not rows:
        return "<i>no events recorded</i>"
    basis = "device time" if result.on_device else "self CPU time"
    top = max(r[3] for r in rows) or 1.0
    body = [[c, bar(p / top, 240) + f" {format_share(p / 100.0)}", _time(t), f"{n:,}"] for c, t, n, p in rows]
    note = phase_note(result)
    return (f'<div class="muted">share of {basis} per category</div>'
            + table(["category", "share", "time", "events"], body, name_columns=(), text_columns=(0,), raw_columns=(1,))
            + (f'<div class="muted">{esc(note)}</div>' if note else ""))


def tensor_core_lines(result) -> list[str]:
    tc = result.tensor_cores
    if tc.value is None:
        return [f"Tensor Core share: n/a -- {tc.reason}"]
    lines = [f"Tensor Core share of kernel time: {tc.value:.1%} ({_time(tc.part_us)} of {_time(tc.total_us)})"]
    if tc.unknown_us:
        lines.append(f"{_time(tc.unknown_us)} in kernels whose name does not tell (counted as non-Tensor-Core)")
    comm = result.communication
    if comm.value:
        lines.append(f"Communication (NCCL / all-reduce) share of kernel time: {comm.value:.1%} "
                     f"({_time(comm.part_us)} of {_time(comm.total_us)})")
    for name, shapes, calls, device_us, share in (result.fp32_miss_rows if result.on_device else ()):
        lines.append(f"fp32 without Tensor Cores: {name} [{shapes}] x{calls}: {_time(device_us)} ({share:.0%})")
    return lines


def stream_lines(result, limit: int = 8) -> list[str]:
    """Busy time per device stream, busiest first (a trace can have dozens of NCCL/side streams)."""
    rows = result.stream_rows if result.on_device else []
    if not rows:
        return []
    rows = [rows[i] for i in desc_order([r[2] for r in rows])]  # sort_values("busy_us", ascending=False)
    lines = [f"device {device} stream {stream}: busy {_time(busy)} ({1 - (math.nan if idle is None else idle):.0%} of the "
             f"{_time(window)} window), {int(count):,} kernels/copies"
             for device, stream, busy, _, count, window, idle in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"... and {len(rows) - limit} more streams")
    return lines


# Rows of the shapes list shown; the rest are counted ("... and 3 more") and all are in result.unaligned.
UNALIGNED_ROWS = 12


def _padding(dim: str, size: int, padded: int, multiple: int) -> str:
    """``C_in=3 -> 8``, and what it costs where the advice leaves it out (`flops.padding_worth_it`): a trial
    read "C_in=3 -> 8 (multiple of 8 for bf16)" for an RGB stem as advice to make that conv 2.7x the work."""
    from ..flops import padding_worth_it

    fix = f"{dim}={size} -> {padded}"
    return fix if padding_worth_it(size, multiple) else fix + f" (+{padded / size - 1:.0%} work: not worth it)"


def unaligned_lines(result, limit: int = UNALIGNED_ROWS) -> list[str]:
    """The shapes list: matmul/conv calls with dims to pad, most time first, ``limit`` of them.

    On a CPU profile an fp32 row is no task for now: fp32 GEMMs run on the vector units, where a
    padded dim fills no tile and only adds work (AMX takes bf16/fp16/int8). Such rows say where the
    padding would count -- on a GPU, or under bf16 autocast -- and one line before them says why.
    A user trial read "C_in=3 -> 8 (multiple of 8 for fp32)" on a CPU profile as advice."""
    from ..profile_advice import amp_comparison_name, cpu_tile_dtypes, padding_pays_here

    entries = result.unaligned
    where = "device" if result.on_device else "CPU"
    out = []
    # rows shown; one inside an op autocast keeps in fp32 says its own reason
    later = sorted({e["dtype"] for e in entries[:limit] if not padding_pays_here(result, e) and not e.get("kept_fp32_by")})
    amx_bf16 = "bf16" in cpu_tile_dtypes(result)
    if later:
        out.append(f"{'/'.join(later)} matmul/conv on the CPU run on the vector units, not on tiles: padding their "
                   "dims would only add work here. Their padded sizes count on a GPU (Tensor Cores)"
                   + (f" or under bf16 autocast (AMX tiles; {amp_comparison_name()}):" if amx_bf16 else
                      "; this CPU has no AMX tiles, so not here in any precision:"))
    for e in entries[:limit]:
        fixes = ", ".join(_padding(k, v, e["pad_to"][k], e["multiple"]) for k, v in e["unaligned"].items())
        share = f", {format_share(e['share'])} of {where} time" if e.get("share") is not None else ""
        when = (f"multiple of {e['multiple']} for {e['dtype']}" if padding_pays_here(result, e)
                # a trial's cdist read "K=63 -> 64 (for a GPU or bf16 autocast)": autocast keeps it fp32
                else f"inside {e['kept_fp32_by']}, which autocast keeps in fp32: no tiles for it on the CPU"
                if e.get("kept_fp32_by")
                else f"for a GPU or bf16 autocast; not {e['dtype']} on the CPU" if amx_bf16
                else "for a GPU; not on this CPU")
        out.append(f"{e['op']} [{e['shapes']}] x{e['calls']} ({_time(e['time_us'])}{share}): {fixes} ({when})")
    if len(entries) > limit:
        most = entries[limit - 1].get("share")
        each = f", each at most {format_share(most)} of {where} time" if most is not None else ""
        out.append(f"... and {len(entries) - limit} more{each} (result.unaligned lists them all)")
    if out:
        return out
    cols = result.op_columns
    matmuls = [i for i, cat in enumerate(cols["category"]) if cat == "matmul/conv"]
    if not matmuls:
        return ["no matmul/conv ops were recorded, so there are no shapes to pad"]
    sparse = cols.get("non_strided") or [False] * len(cols["name"])
    if all(sparse[i] for i in matmuls):
        return ["the matmul/conv ops took sparse (non-strided) operands: no tile shapes to pad, and no FLOPs "
                "counted from their dims"]
    if not any(gemm_dims(cols["name"][i], cols["input_dims"][i]) for i in matmuls if not sparse[i]):
        # a recurrent layer's matmuls run inside its op, whose inputs are no GEMM operands
        return ["no matmul/conv op here has operand shapes nbaccel reads (recurrent layers run their "
                "matmuls inside one op): no shapes to check for padding"]
    return ["all matmul/conv dims are multiples of 8 (16 for int8)"]


def kernel_rows(result, top=15):
    return [[name, f"{calls:,}", _time(time_us), category, {True: "yes", False: "no"}.get(tc, "unknown")]
            for name, calls, time_us, category, tc in result.kernel_rows[:top]]


# --- text ------------------------------------------------------------------------------------------

def rows_words(shown: int, matched: int, total: int, wanted: str = "") -> str:
    """How many rows a table shows, of how many that the filter kept, of all: "top 5 of 12 rows", "the 3
    rows matching 'mm' (40 in all)". The text's title and the widget's status line both say it (the widget
    read "3 of 3 rows matching "mm"" where the text read "the 3 rows matching 'mm'")."""
    if not wanted:
        return f"top {shown} of {total} rows"
    rows = f"{matched} rows" if matched > 1 else "1 row"
    kept = f"the {rows}" if matched == shown else f"top {shown} of the {rows}"
    return f"{kept} matching {wanted!r} ({total} in all)"


def no_match_words(total: int, group: str, wanted: str) -> str:
    """What a filter that kept no row says, and why where its regex is invalid."""
    broken = regex_error(wanted)
    return (f"no row of the {total} (grouped by {group}) has a name or source line matching {wanted!r}"
            + (f" (as a regex it is invalid: {broken}; it was looked for as plain text)" if broken else ""))


def table_title(shown: int, matched: int, total: int, order: str, group: str, wanted: str = "") -> str:
    """The line over an operator table: `rows_words`, the order and the grouping."""
    if wanted and not matched:
        return no_match_words(total, group, wanted)
    return f"{rows_words(shown, matched, total, wanted)} {order} (grouped by {group}):"


def shown_table(result) -> tuple[str, list[dict]]:
    """The table the report shows, --top rows of what --filter kept in the default sort, with its
    `table_title`: the rows filtered and sorted once for both."""
    kept = result.top_rows()
    frame = kept[:result.options.top]
    return table_title(len(frame), len(kept), len(result.grouped_rows()), f"by {sort_label(result.default_sort)}",
                       result.options.group, result.options.filter.strip()), frame


def _ops_text(result, frame, group: str) -> str:
    cols = visible_columns(result, group)
    return text_table([c[1] for c in cols], _rows(result, frame, cols),
                      left=tuple(i for i, c in enumerate(cols) if c[2] == "text"))


def _table_text(result) -> list[str]:
    title, frame = shown_table(result)
    return [title] + ([_ops_text(result, frame, result.options.group)] if frame else [])


def table_text(result, group: str | None = None, sort: str | None = None, ascending: bool = False,
               filter: str = "", top: int | None = None) -> str:  # noqa: A002 - table()'s word
    """`ProfileResult.table` as the text report prints its table, for a terminal or a script: a trial's
    ``print(prof.table(filter="mm"))`` came out as a DataFrame squashed to the terminal's width, with
    names cut and columns folded. The arguments are `table`'s, checked by it."""
    from ..options import whole_number
    from ..profile_options import ProfileError, table_sort

    if top is not None:  # first, as table(top=) checks it: the rest table() checks
        whole_number("top", top, 1, ProfileError)
    matching = result.table(group=group, sort=sort, ascending=ascending, filter=filter)
    frame = matching.head(top) if top else matching  # table(top=)'s cut, without filtering and sorting twice
    group = group or result.options.group
    order = f"by {sort_label(table_sort(sort) or result.default_sort)}{' ascending' if ascending else ''}"
    title = table_title(len(frame), len(matching), len(result.grouped(group)), order, group, (filter or "").strip())
    return "\n".join([title, _ops_text(result, frame, group)]) if len(frame) else title


def _category_text(result) -> list[str]:
    rows = category_rows(result)
    top = max((r[3] for r in rows), default=1.0) or 1.0
    width = max((len(r[0]) for r in rows), default=0)
    return [f"  {c.ljust(width)}  {'#' * max(1, round(30 * p / top))} {format_share(p / 100.0)}  ({_time(t)})" for c, t, n, p in rows]


def text(result) -> str:
    # The title as it is, and the tables and category bars; the figures folded between figures
    # (`figures`), notes, list entries, advice and the method as prose (`prose`). Not the trace line:
    # its paths are for copying.
    out = ["nbaccel " + title(result),
           figures(header_items(result)),
           prose(result.header["peak_note"])]
    if result.contention_warning:
        out.append(labelled("WARNING: ", result.contention_warning))
    out.append("")
    empty = nothing_recorded(result)
    if empty:
        out.append(prose(empty))
    else:
        out += _table_text(result) + ["", "time by category:", *_category_text(result)]
        out += [prose("  " + note) for note in [phase_note(result)] if note]
    if result.on_device:
        out += ["", "device busy per stream:", *(prose("  " + s) for s in stream_lines(result))]
    out += ["", *map(prose, tensor_core_lines(result))]
    out += ["", "shapes:", *(prose("  " + s) for s in unaligned_lines(result))]
    if result.advice:
        out += ["", *(labelled("advice: ", a) for a in result.advice)]
    if result.trace_files:
        out += ["", trace_line(result, "https://ui.perfetto.dev")]
        out += [prose(note) for note in [earlier_traces_note(result)] if note]
    out += ["", labelled("method: ", method(result))]
    return "\n".join(out)


# --- HTML ------------------------------------------------------------------------------------------

def header_html(result) -> str:
    kpis = "".join(f'<div class="kpi"><div class="muted">{esc(k)}</div><div class="big">{esc(v)}</div></div>'
                   for k, v in header_items(result))
    warning = (f'<div class="warn">WARNING: {esc(result.contention_warning)}</div>' if result.contention_warning
               else "")
    return f"<h4>{esc(title(result))}</h4>{kpis}<div class=\"muted\">{esc(result.header['peak_note'])}</div>{warning}"


# Widths of the widget's operator columns by kind: what their figures need at 13 px, with the cell
# padding, so numbers stay on one line. Text columns (operator, source line, input shapes) have none:
# they share what is left, at least `_TEXT_MIN_PX` each, and long names wrap inside them.
_KIND_PX = {"int": 80, "time": 96, "device time": 96, "pct": 180, "flops": 96, "rate": 150, "bytes": 110}
_TEXT_MIN_PX = 220


def _kind_px(kind: str) -> int | None:
    """A column kind's fixed width; None for text columns, which share what is left."""
    return None if kind == "text" else _KIND_PX.get(kind, 96)


def column_widths(cols) -> list[str | None]:
    """CSS widths of ``cols`` (`visible_columns`) for a fixed-layout table; None: a share of the rest."""
    return [f"{px}px" if (px := _kind_px(kind)) else None for _, _, kind in cols]


def grid_columns(cols) -> str:
    """The same widths as a CSS grid template: a row of header buttons over the table lines up with it
    (a fixed-layout table gives its width-less columns equal shares of the rest, as ``1fr`` does)."""
    return " ".join(w or "minmax(0, 1fr)" for w in column_widths(cols))


def min_table_px(cols) -> int:
    """The narrowest the table can be: fixed columns at their widths, text columns at `_TEXT_MIN_PX`."""
    return sum(_kind_px(kind) or _TEXT_MIN_PX for _, _, kind in cols)


def ops_table_html(result, frame, group: str, sort: tuple[str, bool] | None = None, empty: str | None = None,
                   fixed: bool = False) -> str:
    """The operator table; ``sort`` (column, ascending) marks the header the rows are sorted by (the
    "sort by" control sorts: a trial's user looked for it on the headers), ``empty`` is what a table
    without rows says. ``fixed``: the widget's table, in `column_widths` and without its <thead>: the
    widget's header buttons, laid out on the same widths, are its header."""
    cols = visible_columns(result, group)
    frame = records(frame)
    rows = _rows(result, frame, cols)
    # Bars on the share column make the ranking readable at a glance. They are scaled to the whole
    # (100 %), not to the largest row shown, so a filtered or ascending view is not misleading.
    pct_i = next((i for i, c in enumerate(cols) if c[0] == "percent"), None)
    if pct_i is not None:
        for row, p in zip(rows, [r["percent"] for r in frame]):
            row[pct_i] = (bar(p / 100.0, 100) + " " + esc(row[pct_i])) if p == p else esc(row[pct_i])
    text_cols = tuple(i for i, c in enumerate(cols) if c[2] == "text")
    sorted_i = next((i for i, c in enumerate(cols) if sort is not None and c[0] == sort[0]), None)
    return table([c[1] for c in cols], rows, name_columns=text_cols, raw_columns=(pct_i,) if pct_i is not None else (),
                 sorted_column=(sorted_i, sort[1]) if sorted_i is not None else None, empty=empty,
                 widths=column_widths(cols) if fixed else None, head=not fixed)


def details_html(result) -> str:
    time_by_category = [] if nothing_recorded(result) else ["<h4>Time by category</h4>", categories_html(result)]
    parts = [*time_by_category,
             *(["<h4>Device busy per stream</h4>", bullet_list(stream_lines(result))] if result.on_device else []),
             "<h4>Tensor Cores</h4>", bullet_list(tensor_core_lines(result)),
             "<h4>Matmul/conv shapes</h4>", bullet_list(unaligned_lines(result))]
    if result.kernel_count:
        parts += ["<h4>Top kernels</h4>", table(["kernel", "calls", "time", "category", "Tensor Cores"],
                                                kernel_rows(result), tall=True, text_columns=(3, 4))]
    return "".join(parts)


def html(result) -> str:
    group = result.options.group
    title, frame = shown_table(result)
    title = title.rstrip(":")
    advice = f"<h4>Advice</h4>{bullet_list(result.advice)}" if result.advice else ""
    trace = (f'<div class="muted">{esc(trace_line(result))}</div>'
             + (f'<div class="warn">{esc(earlier_traces_note(result))}</div>' if result.trace_earlier else "")
             if result.trace_files else "")
    empty = nothing_recorded(result)
    ops = (f"<p>{esc(empty)}</p>" if empty else f"<p>{esc(title)}</p>" if not frame else
           f"<h4>{esc(title[0].upper() + title[1:])}</h4>" + ops_table_html(result, frame, group))
    return wrap(header_html(result) + advice + ops + details_html(result) + trace + method_html(method(result)))


# --- widget ----------------------------------------------------------------------------------------

# Rows per page of a widget table. A loaded 100 MB trace can have thousands of op rows; an HTML
# table of all of them makes the frontend stall, so a table is only ever rendered one page at a time.
PAGE_SIZES = (10, 25, 50, 100, 200)


def page_controls(default: int = 25):
    """A rows-per-page dropdown and a page number box (1-based)."""
    import ipywidgets as w

    size = w.Dropdown(options=list(PAGE_SIZES), value=default, description="rows/page")
    page = w.BoundedIntText(value=1, min=1, max=1, description="page")
    return size, page


def page_of(frame, size: int, page: int):
    """(rows of page ``page``, the page actually shown, number of pages): never more than ``size`` rows."""
    pages = max(1, math.ceil(len(frame) / size))
    page = min(max(1, page), pages)
    start = (page - 1) * size
    return frame.iloc[start:start + size], page, pages


def page_note(page: int, pages: int, size: int, total: int) -> str:
    if pages <= 1:
        return ""
    start = (page - 1) * size
    return f" -- page {page} of {pages} (rows {start + 1:,}-{min(start + size, total):,})"


def widget(result):
    """Header, then tabs: Operators (sort / ascending / filter / top-K / group-by, paged, and a click on
    a column header sorts by it), Breakdown, Tensor Cores (and matmul shapes), Advice. Controls
    re-render only the visible page of rows."""
    import ipywidgets as w

    from ..profile_table import SORT_COLUMNS

    groups = ["op", "op+shape"] + (["source"] if result.options.stack else [])
    default_col = SORT_COLUMNS.get(result.default_sort, result.default_sort)

    def sort_options(grouping):  # the columns the table shows in that grouping, named as its headers name them
        return [(label, col) for col, label, _ in visible_columns(result, grouping)]

    sort = w.Dropdown(options=sort_options(result.options.group), value=default_col, description="sort by")
    ascending = w.Checkbox(value=False, description="ascending", indent=False)
    name_filter = w.Text(value=result.options.filter, placeholder="part of an op name or source line, or a regex", description="filter")
    n_rows = max(1, len(result.grouped(result.options.group)))
    # The K the user asked for (--top), not capped by the rows of the first grouping: a --stack
    # profile opens on a few source lines, and switching to "op" must still show --top rows.
    top = w.IntSlider(value=result.options.top, min=1, max=max(n_rows, result.options.top),
                      description="top K", continuous_update=False)
    group = w.ToggleButtons(options=groups, value=result.options.group, description="group by")
    size, page = page_controls()
    status = w.HTML()
    ops = w.HTML(layout=w.Layout(margin="0"))
    ops.add_class("nbaccel-ops")
    # The table's header is a row of buttons (an HTML table's <th> cannot talk to the kernel): a click
    # sorts by that column, a second click reverses. They sit on a grid of the table's own column widths
    # (`grid_columns`), in one box with the table, so both scroll sideways together in a narrow window.
    header = w.GridBox(layout=w.Layout(grid_gap="0", margin="0"))
    header.add_class("nbaccel-ops-header")
    table_box = w.VBox([header, ops], layout=w.Layout(width="100%", margin="0"))
    shown_cols: list[tuple[str, str, str]] = []
    updating = [False]  # setting page.value inside refresh must not re-enter it

    def build_header(grouping):
        """One button per column the grouping shows (switching "group by" changes the columns)."""
        for old in header.children:
            old.close()
        shown_cols[:] = visible_columns(result, grouping)
        buttons = []
        for col, label, kind in shown_cols:
            button = w.Button(description=label, layout=w.Layout(width="auto", height="auto", margin="0"))
            button.add_class("nbaccel-th")
            if kind == "text":
                button.add_class("text")
            button.on_click(lambda _, col=col: header_clicked(col))
            buttons.append(button)
        header.layout.grid_template_columns = grid_columns(shown_cols)
        px = min_table_px(shown_cols)
        table_box.layout.min_width, table_box.layout.max_width = f"{px}px", f"{max(px, 1100)}px"
        header.children = buttons

    def mark_header():
        """The sorted column's button says so (\u25b2 / \u25bc), as the static table's header does."""
        for button, (col, label, kind) in zip(header.children, shown_cols):
            if col == sort.value:
                button.description = label + (" \u25b2" if ascending.value else " \u25bc")
                button.tooltip = f"sorted by {label}; click to reverse"
                button.add_class("sorted")
            else:
                button.description = label
                button.tooltip = f"sort by {label} ({'A to Z' if kind == 'text' else 'largest first'})"
                button.remove_class("sorted")

    def header_clicked(col):
        # First click: the column in its natural order (as the "sort by" observer sets it); a second
        # click on the sorted column reverses it.
        ascending_now = not ascending.value if col == sort.value else natural_ascending(col)
        updating[0] = True
        try:
            sort.value, ascending.value = col, ascending_now
        finally:
            updating[0] = False
        render(new_order=True)

    def refresh(change=None):
        if updating[0]:
            return
        updating[0] = True
        try:
            if change is not None and change.owner is group:
                kept = sort.value
                sort.options = sort_options(group.value)
                build_header(group.value)
                if kept in {col for _, col in sort.options}:
                    sort.value = kept
                else:
                    # Back to the default column in its own order: the ascending tick a text column set
                    # (source line, input shapes: A to Z) stayed, and "top K" showed the cheapest ops.
                    sort.value = default_col
                    ascending.value = natural_ascending(default_col)
            if change is not None and change.owner is sort:
                ascending.value = natural_ascending(sort.value)
        finally:
            updating[0] = False
        render(new_order=change is not None and change.owner is not page)

    def render(new_order: bool):
        updating[0] = True
        try:
            grouped = result.grouped(group.value)
            top.max = max(len(grouped), top.value, 1)
            frame = result.table(group=group.value, sort=sort.value, ascending=ascending.value,
                                 filter=name_filter.value, top=None)
            limited = frame.head(top.value)
            if new_order:
                page.value = 1  # a new order or filter starts at its first page
            shown, current, pages = page_of(limited, size.value, page.value)
            page.max = pages
            page.value = current
            typed = name_filter.value.strip()
            # the order and grouping are the controls' own: the status line says the rows, as the text's title
            status.value = wrap(f'<span class="muted">{esc(rows_words(len(limited), len(frame), len(grouped), typed))}'
                                f"{page_note(current, pages, size.value, len(limited))}</span>")
            mark_header()
            ops.value = wrap(ops_table_html(
                result, shown, group.value, sort=(sort.value, ascending.value),
                empty=no_match_words(len(grouped), group.value, typed) if typed else None, fixed=True), "fill")
        finally:
            updating[0] = False

    build_header(group.value)
    for control in (sort, ascending, name_filter, top, group, size, page):
        control.observe(refresh, names="value")
    refresh()
    # Rows of controls wrap in a narrow window instead of squeezing the slider to a bare handle.
    top.layout = w.Layout(min_width="280px")
    row = w.Layout(flex_flow="row wrap")
    controls = w.VBox([w.HBox([sort, ascending, top], layout=row), w.HBox([name_filter, group], layout=row),
                       w.HBox([size, page], layout=row)])
    empty = nothing_recorded(result)  # then one line, not controls over a table without rows
    scroller = w.Box([table_box], layout=w.Layout(overflow="auto"))
    scroller.add_class("nbaccel-ops-scroll")
    operators = w.HTML(wrap(f"<p>{esc(empty)}</p>")) if empty else w.VBox([controls, status, scroller])
    breakdown = w.HTML(wrap((f"<p>{esc(empty)}</p>" if empty else categories_html(result))
                            + bullet_list(stream_lines(result))
                            + ("<h4>Top kernels</h4>" + table(["kernel", "calls", "time", "category", "Tensor Cores"],
                                                               kernel_rows(result), tall=True, text_columns=(3, 4))
                               if result.kernel_count else "")))
    cores = w.HTML(wrap("<h4>Tensor Cores</h4>" + bullet_list(tensor_core_lines(result))
                        + "<h4>Matmul/conv shapes</h4>" + bullet_list(unaligned_lines(result))))
    advice = w.HTML(wrap(bullet_list(result.advice) or "<i>nothing to report</i>"))
    tabs = w.Tab(children=[operators, breakdown, cores, advice])
    for i, name in enumerate(["Operators", "Breakdown", "Tensor Cores", "Advice"]):
        tabs.set_title(i, name)
    trace = (esc(trace_line(result)) + "<br>" + (esc(earlier_traces_note(result)) + "<br>" if result.trace_earlier
                                                   else "") if result.trace_files else "")
    # The trace line stays in view (its path is for copying); the method folds under it.
    footer = w.HTML(wrap((f'<div class="muted">{trace}</div>' if trace else "") + method_html(method(result))))
    box = w.VBox([w.HTML(wrap(header_html(result))), tabs, footer])
    box.add_class("nbaccel-profile")
    return box


__all__ = ["text", "html", "widget", "CATEGORIES"]
