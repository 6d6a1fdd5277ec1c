"""How a `MultiRankResult` (a folder of per-rank traces) looks: text, static HTML, widget.

The rank table comes first because the question for a distributed job is "which rank holds the
others up": step time per rank, and how each rank's device time splits into compute, exposed
communication and idle. The op table below it is merged over ranks or one rank's (widget
dropdown), paged like the single-trace widget.
"""

from __future__ import annotations

import os

from . import profile as single
from ..timing import format_seconds
from ..trace_result import STRAGGLER_MIN_EXCESS
from .common import bar, bullet_list, esc, labelled, prose, table, text_table, wrap

_SPLIT = (("compute_pct", "compute", "#4a90d9"), ("communication_pct", "communication", "#d98c4a"),
          ("idle_pct", "idle", "#bbbbbb"))


def title(result) -> str:
    ws = result.world_size
    n = len(result.ranks)
    of = f" of world size {ws}" if ws else ""
    # A CPU-only trace's device name is already a phrase ("recorded on the CPU (...)"), not a GPU.
    where = (f"on {', '.join(result.gpus)}" if result.on_device
             else "recorded on the CPU (no device activity in the traces)")
    return (f"{result.made_by} {os.path.basename(os.path.normpath(result.folder))}/ -- {n} ranks{of} {where}; "
            "analysed from the files, not a live run")


def straggler_lines(result) -> list[str]:
    s = result.straggler
    t = single._time
    excess = f"+{s['excess_fraction']:.1%}" if s["excess_fraction"] is not None else "n/a"
    if s["named"]:
        lines = [f"slowest rank: {s['rank']} -- step time {t(s['step_time_us'])}, {excess} ({t(s['excess_us'])}) "
                 f"over the median of the other ranks ({t(s['others_median_us'])}); fastest: rank "
                 f"{s['fastest_rank']} ({t(s['fastest_step_time_us'])})"]
    else:
        # Naming a rank for a difference a re-run can reverse sent a trial chasing noise (a CPU trace's "+0.9%
        # (164 us)"); trace_result.STRAGGLER_MIN_EXCESS says why 5%.
        spread = f"{s['spread_fraction']:.1%}" if s["spread_fraction"] is not None else "n/a"
        lines = [f"no straggler: the ranks' step times are within {spread} of each other "
                 f"({t(s['fastest_step_time_us'])} to {t(s['step_time_us'])}); the slowest, rank {s['rank']}, is "
                 f"{excess} over the median of the others, under the {STRAGGLER_MIN_EXCESS:.0%} that names a straggler"]
    if not result.on_device:
        lines.append("no device activity in these traces, so the compute / communication / idle split (of device "
                     "time) is empty; step times are from the CPU timeline")
    elif s["most_compute_rank"] is None:
        lines.append("every rank has the same compute time")
    elif not s["named"]:  # a synchronous job's collectives even out step times: compute can still tell
        lines.append(f"rank {s['most_compute_rank']} has the most compute time: in a synchronous job the others wait "
                     "for it in their communication kernels, which evens out the step times")
    elif s["most_compute_rank"] != s["rank"]:
        lines.append(f"rank {s['most_compute_rank']} has the most compute time: in a synchronous job the others wait "
                     "for it in their communication kernels, so it may be the real straggler")
    else:
        least = s["least_communication_rank"]
        comm = (f"rank {least} has the least exposed communication" if least is not None
                else "every rank has the same exposed communication")
        lines.append(f"rank {s['rank']} also has the most compute time; {comm} (ranks that wait for others show it as "
                     "communication time)")
    unknown = int(result.per_rank["unknown_events"].sum())
    if unknown:
        lines.append(f"{unknown:,} events of unknown kinds were counted and skipped")
    if result.skipped:
        lines.append(single.skipped_files_text(result.skipped))
    return lines


def rank_rows(result) -> list[list[str]]:
    t = single._time

    def split(us, pct) -> str:
        # CPU-only traces have no device time to split: "idle 6.12 ms (100%)" under the line saying the
        # split is empty read as a rank that did nothing.
        return f"{t(us)} ({pct:.0f}%)" if result.on_device else "-"

    return [[str(r.rank), f"{r.files}", f"{r.steps}" if r.steps else "-", t(r.step_time_us),
             split(r.compute_us, r.compute_pct), split(r.communication_us, r.communication_pct),
             split(r.idle_us, r.idle_pct), f"{r.kernels:,}", f"{r.ops:,}"]
            for r in result.per_rank.itertuples()]


# "op calls", as the single-trace header says it: the column is the same count (`MultiRankResult.per_rank`).
_RANK_HEADERS = ["rank", "files", "steps", "step time", "compute", "communication", "idle", "kernels", "op calls"]


def method(result) -> str:
    return ("One trace per rank (distributedInfo.rank, else the file name); files of one rank are its steps, read as "
            "one trace. Step time = mean ProfilerStep duration (the trace window when there is none). Over the steps: "
            "compute = union of non-communication kernels and copies; communication = time only NCCL/all-reduce "
            "kernels run (hidden communication is not counted); idle = no device activity. The merged op table sums "
            f"calls and times over ranks. Loaded in {format_seconds(result.load_seconds)}.")


# --- text -------------------------------------------------------------------------------------------

def _merged_table(result):
    """The merged op table the report shows (--top rows of what --filter kept), with the line over it."""
    matching = result.table(filter=result.options.filter)
    frame = matching.head(result.options.top)
    order = f"merged over {len(result.ranks)} ranks by {single.sort_label(result.default_sort)}"
    return frame, single.table_title(len(frame), len(matching), len(result.ops), order, result.options.group,
                                     result.options.filter.strip())


def text(result) -> str:
    out = ["nbaccel " + title(result), *map(prose, straggler_lines(result)), ""]
    out.append(text_table(_RANK_HEADERS, rank_rows(result), left=()))
    first = next(iter(result.ranks.values()))
    group = result.options.group
    cols = single.visible_columns(first, group)
    frame, title_line = _merged_table(result)
    out += ["", title_line]
    if len(frame):
        out.append(text_table([c[1] for c in cols], single._rows(first, frame, cols),
                              left=tuple(i for i, c in enumerate(cols) if c[2] == "text")))
    out += ["", labelled("method: ", method(result))]
    return "\n".join(out)


# --- HTML -------------------------------------------------------------------------------------------

def _split_bar(row) -> str:
    return "".join(f'<span class="bar" style="width:{getattr(row, col) * 2:.0f}px;background:{color}" '
                   f'title="{label} {getattr(row, col):.1f}%"></span>' for col, label, color in _SPLIT)


def ranks_html(result) -> str:
    rows = rank_rows(result)
    slow = result.straggler["rank"] if result.straggler["named"] else None  # no "(slowest)" for noise
    longest = float(result.per_rank["step_time_us"].max()) or 1.0
    body = []
    for row, r in zip(rows, result.per_rank.itertuples()):
        marker = " (slowest)" if r.rank == slow else ""
        body.append([esc(row[0] + marker), esc(row[1]), esc(row[2]),
                     bar(r.step_time_us / longest, 120) + " " + esc(row[3]),
                     _split_bar(r) if result.on_device else "-", *map(esc, row[4:])])
    legend = " ".join(f'<span class="bar" style="width:10px;background:{c}"></span> {label}' for _, label, c in _SPLIT)
    return (f'<div class="muted">device time over the steps: {legend}</div>'
            + table(["rank", "files", "steps", "step time", "split", *_RANK_HEADERS[4:]], body,
                    name_columns=(), raw_columns=tuple(range(10))))


def header_html(result) -> str:
    return f"<h4>{esc(title(result))}</h4>" + bullet_list(straggler_lines(result))


def html(result) -> str:
    first = next(iter(result.ranks.values()))
    group = result.options.group
    frame, title_line = _merged_table(result)
    return wrap(header_html(result) + ranks_html(result)
                + f"<h4>{esc(title_line.rstrip(':'))}</h4>"
                + (single.ops_table_html(first, frame, group) if len(frame) else "")
                + f'<div class="muted">method: {esc(method(result))}</div>')


# --- widget -----------------------------------------------------------------------------------------

def widget(result):
    """Header + rank table, then the op table with a rank selector (merged or one rank), sort,
    filter and paging. Only the visible page of rows is rendered."""
    import ipywidgets as w

    from ..profile_table import SORT_COLUMNS

    first = next(iter(result.ranks.values()))
    group = result.options.group
    cols = single.visible_columns(first, group)
    rank = w.Dropdown(options=[("all ranks (merged)", -1)] + [(f"rank {r}", r) for r in result.ranks],
                      value=-1, description="ranks")
    sort = w.Dropdown(options=[(label, col) for col, label, _ in cols],  # named as the table's headers are
                      value=SORT_COLUMNS.get(result.default_sort, result.default_sort), description="sort by")
    ascending = w.Checkbox(value=False, description="ascending", indent=False)
    name_filter = w.Text(value=result.options.filter, placeholder="part of an op name, or a regex", description="filter")
    size, page = single.page_controls()
    status, ops = w.HTML(), w.HTML()
    updating = [False]

    def refresh(change=None):
        if updating[0]:
            return
        updating[0] = True
        try:
            which = None if rank.value == -1 else rank.value
            frame = result.table(rank=which, group=group, sort=sort.value, ascending=ascending.value,
                                 filter=name_filter.value)
            if change is not None and change.owner is not page:
                page.value = 1
            shown, current, pages = single.page_of(frame, size.value, page.value)
            page.max = pages
            page.value = current
            label = "merged over all ranks" if which is None else f"of rank {which}"
            status.value = wrap(f'<span class="muted">{len(frame)} rows {label}'
                                + single.page_note(current, pages, size.value, len(frame)) + "</span>")
            ops.value = wrap(single.ops_table_html(result.ranks[which] if which is not None else first, shown, group))
        finally:
            updating[0] = False

    for control in (rank, sort, ascending, name_filter, size, page):
        control.observe(refresh, names="value")
    refresh()
    controls = w.VBox([w.HBox([rank, sort, ascending]), w.HBox([name_filter, size, page])])
    box = w.VBox([w.HTML(wrap(header_html(result) + ranks_html(result))), controls, status, ops,
                  w.HTML(wrap(f'<div class="muted">method: {esc(method(result))}</div>'))])
    box.add_class("nbaccel-multirank")
    return box


__all__ = ["text", "html", "widget"]
