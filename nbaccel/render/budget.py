"""How budget results look: the per-cell gauge, the status, the OOM explanation, the estimate.

All four share ``kind`` "budget"/"estimate" (see `render.__init__`); ``view`` picks the layout.
The gauge is an HTML bar in an element with class ``nbaccel-gauge`` (and, as a widget, a
FloatProgress carrying the same class) so browser tests can find it. The CSS targets only the HTML
``span`` gauge: the page-wide style must not restyle the widget (it collapsed the FloatProgress bar to 0 px).
"""

from __future__ import annotations

from ..budget import PUSHED, harness_words, share_text
from ..holders import unresident_line
from ..memory import format_bytes
from ..timing import format_seconds
from .common import bullet_list, esc, folded, labelled, plural, prose, table, text_table, wrap

GAUGE_CSS = """
<style>
span.nbaccel-gauge {display: inline-block; width: 220px; height: 12px; background: rgba(127,127,127,0.2);
  vertical-align: middle; margin-right: 8px}
span.nbaccel-gauge > span {display: block; height: 12px; background: #4a90d9}
span.nbaccel-gauge.near > span {background: #d9a441}
span.nbaccel-gauge.over > span {background: #d9534f}
</style>
"""


def _view(result) -> str:
    return getattr(result, "view", "estimate")


# --- the per-cell gauge ------------------------------------------------------------------------------

def _gauge_bar(fraction: float | None, status: str) -> str:
    width = max(0.0, min(1.0, fraction or 0.0)) * 100
    colour = status.split()[-1]  # "already over" is coloured as over: the bar shows usage, not blame
    return (f'<span class="nbaccel-gauge {esc(colour)}" title="{share_text(fraction)}"><span style="width:{width:.0f}%">'
            '</span></span>')


def _text_gauge(fraction: float | None, width: int = 30) -> str:
    filled = int(round(max(0.0, min(1.0, fraction or 0.0)) * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _cell_line(r) -> str:
    extra = f", allocated peak {format_bytes(r.allocated_peak_bytes)}" if r.allocated_peak_bytes is not None else ""
    return (f"{format_bytes(r.used_bytes)} of {format_bytes(r.budget_bytes)} ({share_text(r.fraction)}); the cell "
            f"{r.change_words('added ')}{extra}")


def free_memory_hint(device: str) -> str:
    if device.startswith("cuda"):
        return "free memory (del, then torch.cuda.empty_cache() to hand cached blocks back) or lower the batch"
    return "free memory (del the large tensors; the CPU has no cache to empty) or lower the batch"


def cell_text(report) -> str:
    r = report.record
    head = "WARNING: over the memory budget" if report.over else "memory budget"
    lines = [f"{head} on {report.device}: {_text_gauge(r.fraction)} {_cell_line(r)}"]
    if r.harness:
        lines.append(prose(f"  {harness_words(r, report.device)}"))
    if report.over:
        lines.append(prose(f"  {_over_hint(report)}"))
    return "\n".join(lines)


def _over_hint(report) -> str:
    """What to do about a cell over the budget: in the text, the HTML and the widget alike (the HTML and
    the widget once showed only the figures)."""
    return (f"{free_memory_hint(report.device)}; `%memory_budget` shows what holds memory"
            + (" -- --strict: this cell is marked as failed" if report.strict else ""))


def _cell_notes(report) -> str:
    r = report.record
    notes = [harness_words(r, report.device)] if r.harness else []
    notes += [_over_hint(report)] if report.over else []
    return "".join(f"<div>{esc(n)}</div>" for n in notes)


def cell_html(report) -> str:
    r = report.record
    label = '<b class="warn">over the memory budget</b>' if report.over else "memory budget"
    return wrap(GAUGE_CSS + f"<div>{_gauge_bar(r.fraction, r.status)}{label} on {esc(report.device)}: "
                f"{esc(_cell_line(r))}</div>{_cell_notes(report)}")


def cell_widget(report):
    import ipywidgets as w

    r = report.record
    bar = w.FloatProgress(value=min(r.fraction or 0.0, 1.0), min=0.0, max=1.0,
                          bar_style="danger" if report.over else "warning", layout=w.Layout(width="220px"))
    bar.add_class("nbaccel-gauge")
    # Worded like the HTML and text gauges: a bare bar and "981 MiB of 1 GiB" does not say what it is.
    label = w.HTML(wrap(("<b class='warn'>over the memory budget</b>" if report.over else "memory budget")
                        + f" on {esc(report.device)}: " + esc(_cell_line(r))))
    gauge = w.HBox([bar, label])
    notes = _cell_notes(report)
    return w.VBox([gauge, w.HTML(wrap(notes))]) if notes else gauge


# --- status --------------------------------------------------------------------------------------------

HISTORY_HEADERS = ["cell", "peak used", "of budget", "added", "allocated peak", "status", "time"]
HOLDER_HEADERS = ["name", "kind", "device", "dtype", "bytes", "detail"]
HOLDER_WORDS = (0, 1, 2, 3, 5)  # the columns of words, left-aligned (the name is code)


RANK_HEADERS = ["rank", "host", "device", "peak used", "budget", "of budget", "status"]
_VERDICTS = {"over": "over the budget", "already over": "already over the budget as the block began (it added none)",
             "near": "near the budget ({near} of it or more)",
             "already near": "already near the budget as the block began (it added none)", "ok": "within the budget"}


def _ranks_named(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def ranks_verdict(rows) -> str:
    """One line for a gathered `nbaccel.distributed.memory_budget` report, worst status first:
    "over the budget on rank 1; within the budget on rank 0", or "... on every rank"."""
    by_status: dict[str, list[int]] = {}
    for row in rows:
        by_status.setdefault(row.get("status") or "not measured", []).append(row["rank"])
    near = share_text(next((row["near"] for row in rows if row.get("near") is not None), None))
    order = list(_VERDICTS)  # worst first
    parts = []
    for status in sorted(by_status, key=lambda s: order.index(s) if s in order else -1):
        words = _VERDICTS.get(status, status).format(near=near)
        parts.append(f"{words} on every rank" if len(by_status) == 1 and len(rows) > 1
                     else f"{words} on {_ranks_named(by_status[status])}")
    return "; ".join(parts)


def ranks_text(rows) -> str:
    """Every rank's budget, peak and status, in the columns and words of the status's history table."""
    table_rows = [[r["rank"], r.get("host", "?"), r.get("device", "?"),
                   format_bytes(r["peak_bytes"]) if r.get("peak_bytes") is not None else "-",
                   format_bytes(r["budget_bytes"]) if r.get("budget_bytes") is not None else "-",
                   share_text(r.get("fraction")), r.get("status") or "-"] for r in rows]
    table_lines = text_table(RANK_HEADERS, table_rows, left=(1, 2, 6)).splitlines()
    return "\n".join(["  per rank:", *("    " + line.rstrip() for line in table_lines),
                      prose("  " + ranks_verdict(rows))])


def _history_rows(records, last=10):
    return [[r.label, format_bytes(r.used_bytes), share_text(r.fraction), r.change_words(),
             format_bytes(r.allocated_peak_bytes) if r.allocated_peak_bytes is not None else "-",
             r.status + (f" (under {r.harness})" if r.harness else ""), format_seconds(r.seconds)]
            for r in records[-last:]]


def _unit(records) -> str:
    """What the rows are: notebook cells, or a script's `memory_budget` blocks ("block 1", ...)."""
    return "block" if records and all(r.label.startswith("block ") for r in records) else "cell"


def _history_headers(records) -> list[str]:
    return [_unit(records), *HISTORY_HEADERS[1:]]


def _history_title(records, last=10) -> str:
    return plural(len(records), _unit(records)) + " watched" + (f", the last {last}" if len(records) > last else "")


def _holder_rows(holders):
    return [[h.name, h.kind, h.device, h.dtype, format_bytes(h.nbytes), h.detail] for h in holders]


def _status_head(s, note: bool = True) -> str:
    """The status's first line; ``note=False``: without the note (`status_text` folds it below)."""
    note = note and s.note
    if not s.active:
        return f"memory budget: off ({s.device}){' -- ' + note if note else ''}"
    # Each mode says what it does: a bare "[soft]" left users guessing.
    # A script's memory_budget() measures each with block and checks it as the block exits: it has no cells.
    block = getattr(s, "unit", "cell") == "block"
    fails = "a with block that goes over raises BudgetExceeded" if block else "a cell that goes over fails"
    soft = ("soft: checked when each with block exits, a BudgetWarning when over" if block
            else "soft: checked after each cell, a warning when over")
    flags = [f for f, on in (("enforced: the allocator is capped", s.enforce), (f"strict: {fails}", s.strict)) if on]
    total = f" of {format_bytes(s.device_total)}" if s.device_total else ""
    return (f"memory budget {format_bytes(s.budget_bytes)}{total} on {s.device}"
            + (f" [{'; '.join(flags)}]" if flags else f" [{soft}]")
            + (f" -- {note}" if note else ""))


def _now_line(s) -> str:
    if s.allocated_now is not None:
        return f"now: {format_bytes(s.used_now)} reserved, {format_bytes(s.allocated_now)} allocated"
    unresident = unresident_line(s.holders, s.used_now)
    return f"now: process RSS {format_bytes(s.used_now)}" + (f" ({unresident})" if unresident else "")


def status_text(s) -> str:
    # A terminal's first line is the budget; the note (how a unit was read, why --enforce is soft, what a
    # new budget replaced) under it, folded.
    out = [_status_head(s, note=False), *([prose("  " + s.note)] if s.note else []), _now_line(s)]
    if s.records:
        out += ["", _history_title(s.records) + ":", text_table(_history_headers(s.records), _history_rows(s.records))]
    if s.holders:
        out += ["", "what holds memory now (largest first):", text_table(HOLDER_HEADERS, _holder_rows(s.holders),
                                                                                left=HOLDER_WORDS)]
    out += ["", labelled("method: ", s.method)]
    return "\n".join(out)


def status_html(s) -> str:
    parts = [f"<h4>{esc(_status_head(s))}</h4><div>{esc(_now_line(s))}</div>"]
    if s.records:
        last = s.records[-1]
        parts.append(GAUGE_CSS + f"<div>last {_unit(s.records)}: {_gauge_bar(last.fraction, last.status)}"
                     f"{esc(_cell_line(last))}</div>")
        parts.append(table(_history_headers(s.records), _history_rows(s.records), name_columns=(), text_columns=(0, 5)))
    if s.holders:
        parts.append("<h4>What holds memory now</h4>" + table(HOLDER_HEADERS, _holder_rows(s.holders),
                                                                           text_columns=HOLDER_WORDS[1:]))
    parts.append(f'<div class="muted">method: {esc(s.method)}</div>')
    return wrap("".join(parts))


# --- the out-of-memory explanation -------------------------------------------------------------------

def _oom_facts(e) -> list[str]:
    f = e.facts
    lines = [f"requested: {format_bytes(f.requested)}" if f.requested is not None else "requested: not in the message"]
    if f.outside_allocator:
        lines.insert(0, "source: CUDA (the runtime, cuBLAS or cuDNN), outside PyTorch's caching allocator; "
                        "the message gives no sizes")
    if e.limit_bytes is not None:
        lines.append(f"limit: {format_bytes(e.limit_bytes)} ({e.limit_source})")
    if e.budget_bytes is not None and e.limit_source != "the memory budget":
        lines.append(f"memory budget: {format_bytes(e.budget_bytes)}")
    if e.allocated_bytes is not None:
        lines.append(f"allocated at the failure: {format_bytes(e.allocated_bytes)} ({e.allocated_method})")
        unresident = unresident_line(e.holders, e.allocated_bytes) if e.device.split(":")[0] == "cpu" else ""
        if unresident:
            lines.append(unresident)
    if f.reserved_unallocated:
        lines.append(f"reserved but unallocated (cache): {format_bytes(f.reserved_unallocated)}")
    if f.capacity is not None:
        lines.append(f"GPU capacity {format_bytes(f.capacity)}, free {format_bytes(f.free)}")
    # Not where the sum reads as the request does, or as the request rounded another way: a trial's 9.09 TiB
    # request with 276 MiB allocated read "needed at least 9.1 TiB" two lines below "requested: 9.09 TiB".
    if e.needed_at_least is not None and e.needed_at_least - f.requested >= 0.01 * f.requested:
        lines.append(f"the step needed at least {format_bytes(e.needed_at_least)} (allocated + requested)")
    if e.location:
        lines.append(f"failed at {e.location}")
    return lines


def _suggestion_lines(e) -> list[str]:
    return [f"{s.action}" + (f" (saves ~{format_bytes(s.saving_bytes)})" if s.saving_bytes else "") + f": {s.detail}"
            for s in e.suggestions]


def _still_alive() -> str:
    """" -- the kernel is still alive" in IPython, where the session goes on; not in a script, which the error
    most likely ends (a trial's script printed it and exited with status 1)."""
    from .display import running_shell

    return " -- the kernel is still alive" if running_shell() is not None else ""


def oom_text(e) -> str:
    out = [f"OUT OF MEMORY on {e.device} ({e.error_type}){_still_alive()}", prose("  " + e.message[:300]), ""]
    out += map(prose, _oom_facts(e))
    if e.holders:
        out += ["", "largest holders in the namespace:", text_table(HOLDER_HEADERS, _holder_rows(e.holders),
                                                                          left=HOLDER_WORDS)]
    if e.suggestions:
        out += ["", "what to try:"] + [labelled("  - ", s) for s in _suggestion_lines(e)]
    return "\n".join(out)


def oom_html(e) -> str:
    parts = [f'<h4 class="warn">Out of memory on {esc(e.device)} ({esc(e.error_type)}) &mdash; the kernel is still '
             f'alive</h4><div class="muted">{esc(e.message[:300])}</div>', bullet_list(_oom_facts(e))]
    if e.holders:
        parts.append("<h4>Largest holders in the namespace</h4>" + table(HOLDER_HEADERS, _holder_rows(e.holders),
                                                                                   text_columns=HOLDER_WORDS[1:]))
    if e.suggestions:
        parts.append("<h4>What to try</h4>" + bullet_list(_suggestion_lines(e)))
    return wrap('<div class="nbaccel-oom">' + "".join(parts) + "</div>")


# --- the estimate ---------------------------------------------------------------------------------------

# "activations" is what the forward keeps for the backward; the peak is not a sum of the columns (the
# activations are freed while the gradients appear): "peak during" says which phase it is and what it holds.
# "buffers" (BatchNorm's running statistics, ...) only where the model has some: most have none.
ESTIMATE_HEADERS = ["precision", "params", "buffers", "grads", "optimizer", "activations", "peak during",
                    "peak (1 GPU)", "fits?", "fewest GPUs"]
_ESTIMATE_WORDS = ("precision", "peak during", "fits?", "fewest GPUs")  # left-aligned, wrapping as prose


def _estimate_columns(e) -> list[str]:
    return [h for h in ESTIMATE_HEADERS if h != "buffers" or e.buffer_bytes]


def _estimate_headers(e) -> list[str]:
    # The single-device figures are for the device the dry runs ran on: one GPU, or this host.
    if e.on_gpu:
        return _estimate_columns(e)
    return [{"peak (1 GPU)": f"peak ({e.probe_device})", "fewest GPUs": "GPUs if over"}.get(h, h)
            for h in _estimate_columns(e)]


def _states_words(e) -> str:
    """What a step holds throughout: "params + optimizer states", with the buffers where there are some."""
    return "params + buffers + optimizer states" if e.buffer_bytes else "params + optimizer states"


def _compared_with(e) -> str:
    what = e.budget_source if e.budget_bytes is None else f"{format_bytes(e.budget_bytes)} ({e.budget_source})"
    if e.on_gpu:
        return what
    return f"{what}, with the training step's tensors (the process itself and other programs need memory too)"


def _sharding_title(e) -> str:
    if e.on_gpu:
        return "per GPU when sharded over N GPUs (* = over the budget)"
    return (f"prediction for GPUs with activations measured on {e.probe_device}: per GPU when sharded over N GPUs "
            "(* = over the budget)")


def _estimate_rows(e):
    from ..estimate import STRATEGY_NAMES

    rows = []
    for p in e.fits:
        one = e.single(p)
        found = e.min_gpus(p)
        fewest = "-" if e.budget_bytes is None or (one["fits"] and not e.on_gpu) else (
            f"{found[0]} ({STRATEGY_NAMES[found[1]]})" if found else _none_fits(e))
        cells = {"precision": p, "params": format_bytes(one["params"]), "buffers": format_bytes(one["buffers"]),
                 "grads": format_bytes(one["grads"]), "optimizer": format_bytes(one["optimizer"]),
                 "activations": format_bytes(one["activations"]), "peak during": _peak_during(one),
                 "peak (1 GPU)": format_bytes(one["total"]), "fits?": "yes" if one["fits"] else "no",
                 "fewest GPUs": fewest}
        rows.append([cells[h] for h in _estimate_columns(e)])
    return rows


def _none_fits(e) -> str:
    """The "fewest GPUs" cell where no count tried fits: more than the most tried, unless the batch is what
    stopped the counts (more GPUs than samples is no data-parallel split)."""
    most = e.usable_gpu_counts[-1]
    return f"none: batch {e.batch} splits over at most {most}" if e.batch_limits_gpus else f"> {most}"


def _phase_parts(row) -> dict[str, str]:
    """What each phase holds beside the params and optimizer states, in words."""
    return {"forward": f"activations + {format_bytes(row['forward_temporaries'])} temporaries",
            "backward": f"grads + {format_bytes(row['backward_working'])} still held",
            "optimizer step": f"grads + {format_bytes(row['step_temporaries'])} temporaries"}


def _peak_during(row) -> str:
    """The phase that makes the step's peak (params + buffers + optimizer states + this)."""
    return f"{row['peak_phase']}: {_phase_parts(row)[row['peak_phase']]}"


def _sharding_counts(e, shown=(2, 4, 8)) -> list[int]:
    """The GPU counts the sharding table shows: 2, 4 and 8 where the estimate has them
    (`usable_gpu_counts`), else its first three counts above 1 (``gpu_counts=(1, 16)``: 16)."""
    multi = [n for n in e.usable_gpu_counts if n > 1]
    return [n for n in shown if n in multi] or multi[:3]


def _sharding_headers(e) -> list[str]:
    return ["precision", "strategy"] + [f"N={n}" for n in _sharding_counts(e)]


def _sharding_rows(e):
    from ..estimate import STRATEGIES, STRATEGY_NAMES

    rows = []
    for p in e.fits:
        for s in STRATEGIES:
            rows.append([p, STRATEGY_NAMES[s]] + [format_bytes(e.per_gpu(p, s, n)["total"]) + (
                "" if e.per_gpu(p, s, n)["fits"] else " *") for n in _sharding_counts(e)])
    return rows


def _fit_lines(e) -> list[str]:
    """How the activations were measured and extrapolated, one line per precision."""
    def per_sample(f):
        # The intercept where it shows in the figure at the batch (the loss's few bytes do not).
        fixed = f" + {format_bytes(f.fixed)} at any batch" if f.fixed > 0.01 * f.at(e.batch) else ""
        return f"{format_bytes(f.per_sample)}/sample{fixed}"

    return [f"{f.precision}: measured {', '.join(format_bytes(m) for m in f.measured)} at batch "
            f"{', '.join(map(str, f.batches))} ({per_sample(f)}); at batch {e.batch}: {format_bytes(f.at(e.batch))} "
            "(linear extrapolation)" for f in e.fits.values()]


def _phase_lines(e) -> list[str]:
    """Each phase of the step at the batch asked for: what it holds over params (+ buffers) + optimizer states."""
    from ..estimate import PHASES

    lines = []
    for p, f in e.fits.items():
        one = e.single(p)
        # Per-sample growth of each phase: the forward's and the backward's peak lines; the optimizer step grows
        # only over sparse gradients (they and its temporaries hold the rows looked up).
        forward, backward = f.slopes_at(e.batch)  # of the moment that peaks at the batch
        per = {"forward": forward, "backward": backward, "optimizer step": f.step_slope}
        parts = []
        for phase in PHASES:
            held = {"forward": one["activations"] + one["forward_temporaries"],
                    "backward": one["grads"] + one["backward_working"],
                    "optimizer step": one["grads"] + one["step_temporaries"]}[phase]
            grows = f", {format_bytes(per[phase])}/sample" if per[phase] else ""
            mark = " <- peak" if phase == one["peak_phase"] else ""
            parts.append(f"{phase} {format_bytes(held)} ({_phase_parts(one)[phase]}{grows}){mark}")
        lines.append(f"{p}: " + "; ".join(parts))
    return lines


_ACTIVATIONS = ("activations = what the forward keeps for the backward (tensors saved by autograd, the input batch; "
                "under autocast also 16-bit weight copies), one dry run per probe batch, fitted linearly:")


def _first_upper(text: str) -> str:
    """A title's first letter upper-cased for a heading (the text output keeps it in a sentence)."""
    return text[:1].upper() + text[1:]


def _phases_title(e) -> str:
    return (f"the step's peak at batch {e.batch} = {_states_words(e)} + the largest of its phases (the backward "
            "frees activations while the gradients appear; 'still held' = activations not yet freed and gradient "
            "temporaries):")


def _rss_line(e) -> list[str]:
    """Host probes: the RSS bound, since glibc's heap can hold more than the tensors do."""
    bounds = {p: e.single(p)["total_no_reuse"] for p in e.fits}
    if any(b is None for b in bounds.values()):
        return []
    return [f"process RSS can reach up to {', '.join(f'{format_bytes(b)} ({p})' for p, b in bounds.items())} "
            "if the heap reuses no freed block; glibc's default heap lands between the peak above and this"]


def _estimate_head(e) -> str:
    buffers = f" + {format_bytes(e.buffer_bytes)} of buffers" if e.buffer_bytes else ""
    return (f"{e.model_name}: {e.n_params:,} parameters ({e.n_trainable:,} trainable){buffers}, {e.optimizer}, "
            f"batch {e.batch} -- {e.summary}")


def estimate_text(e) -> str:
    # The tables as they are; the head and every line of prose folded (`prose`).
    out = [prose(_estimate_head(e))] + ([prose(e.note)] if e.note else [])
    out += ["", text_table(_estimate_headers(e), _estimate_rows(e)), ""]
    if _sharding_counts(e):
        out += [prose(_sharding_title(e) + ":"), text_table(_sharding_headers(e), _sharding_rows(e), left=(0, 1)), ""]
    else:
        out += [prose(_unsplit_line(e)), ""]
    out += [prose(_ACTIVATIONS)] + [prose("  " + line) for line in _fit_lines(e)]
    out += [prose(_phases_title(e))] + [prose("  " + line) for line in _phase_lines(e)]
    out += map(prose, list(e.assumptions) + _rss_line(e))
    out += ["", labelled("compared with: ", _compared_with(e)), labelled("method: ", e.method)]
    return "\n".join(out)


def _unsplit_line(e) -> str:
    """In place of the sharding table when no GPU count above 1 is left: the batch too small to split,
    or none asked for (``gpu_counts=(1,)``)."""
    if e.batch < 2:
        return f"no sharding table: a batch of {e.batch} cannot be split over 2 or more GPUs (one sample each at least)"
    return f"no sharding table: no GPU count above 1 was asked for (gpu_counts={tuple(e.gpu_counts)})"


def _fits_on_one(e) -> bool:
    """Every precision fits the budget on one device: the sharding table is then a plan, not a need."""
    return e.budget_bytes is not None and all(e.single(p)["fits"] for p in e.fits)


def estimate_html(e) -> str:
    # The verdict, the table and the caveats first; the sharding table folded when nothing needs it, and the
    # measurement's prose (a screenful on a tiny model, a trial) folded under the figures it explains.
    note = f'<div class="nbaccel-note">{esc(e.note)}</div>' if e.note else ""
    title = _sharding_title(e)
    if not _sharding_counts(e):
        sharding = f"<div>{esc(_unsplit_line(e))}</div>"
    else:
        sharded = table(_sharding_headers(e), _sharding_rows(e), name_columns=(), text_columns=(0, 1))
        unneeded = _fits_on_one(e)
        if unneeded:
            verb = "fits" if len(e.fits) == 1 else "fit"
            title = f"{title} -- not needed: {' and '.join(e.fits)} {verb} in the budget unsharded"
        sharding = folded(_first_upper(title), sharded, open_=not unneeded)
    how = (f"<div>{esc(_ACTIVATIONS)}</div>" + bullet_list(_fit_lines(e))
           + f"<div>{esc(_first_upper(_phases_title(e)))}</div>" + bullet_list(_phase_lines(e))
           + bullet_list(_rss_line(e))
           + f'<div class="muted">compared with: {esc(_compared_with(e))}; method: {esc(e.method)}</div>')
    return wrap(f"<h4>{esc(_estimate_head(e))}</h4>" + note
                + table(_estimate_headers(e), _estimate_rows(e), name_columns=(),
                        text_columns=tuple(i for i, h in enumerate(_estimate_columns(e)) if h in _ESTIMATE_WORDS))
                + bullet_list(list(e.assumptions)) + sharding
                + folded("How these figures were measured: activations, the step's phases, method", how))


# --- dispatch ---------------------------------------------------------------------------------------------

_TEXT = {"cell": cell_text, "status": status_text, "oom": oom_text, "estimate": estimate_text}
_HTML = {"cell": cell_html, "status": status_html, "oom": oom_html, "estimate": estimate_html}


def text(result) -> str:
    return _TEXT[_view(result)](result)


def html(result) -> str:
    return _HTML[_view(result)](result)


def widget(result):
    import ipywidgets as w

    if _view(result) == "cell":
        return cell_widget(result)
    return w.HTML(html(result))
