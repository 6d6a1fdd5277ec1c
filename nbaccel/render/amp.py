"""How an `AmpResult` looks: text, static HTML, and the JupyterLab widget."""

from __future__ import annotations

from ..amp_result import MEMORY_NOISE_FLOOR, memory_ranges, too_few_runs
from ..drift import divergence_verb, ids_noun, near_zero_figures, relative_words, resolution, share_words, token_figures
from ..memory import byte_range, format_bytes
from ..options import option
from ..timing import format_ratio, format_seconds
from .common import bullet_list, esc, labelled, method_html, plural, prose, si, table, text_table, wrap


def _flops(v) -> str:
    return si(v.flops_per_second, "FLOP/s") if v.flops_per_second else "n/a"


def _variant_rows(result):
    rows = []
    for v in filter(None, (result.baseline, result.amp)):
        recipe = v.recipe.label
        if v is result.baseline and result.fp32_relaxed_by_cell:  # the cell set its own fp32 precision
            # the setting itself is in the advice: in the table it made a 150-column row (a trial)
            recipe = "fp32 as the cell sets it"
        if v is result.baseline and result.baseline_reduced:  # the cell's own autocast / casts ran inside it
            recipe += f" + the cell's own {' and '.join(result.baseline_reduced)}"
        rows.append([
            v.name, recipe, format_seconds(v.median),
            format_seconds(v.times.iqr) if len(v.times.times) > 1 else "n/a", len(v.times.times),
            format_bytes(v.memory.peak_bytes) if v.memory else "n/a", _flops(v),
        ])
    return rows


HEADERS = ["variant", "recipe", "median", "IQR", "runs", "peak memory", "achieved"]


def _no_torch_ops(result) -> bool:
    """No torch operator ran in either variant: the times are of plain Python, autocast changed nothing."""
    return result.amp.ops.empty and (result.baseline is None or result.baseline.ops.empty)


def speedup_figure(result, flags: list[str] | None = None) -> str:
    """The measured speedup with the precision its flags (`AmpResult.speedup_flags`, read here unless given) allow:
    `timing.format_ratio`."""
    return format_ratio(result.speedup, firm=not (result.speedup_flags if flags is None else flags))


def headline(result) -> str:
    parts = []
    if result.speedup is not None:
        if _no_torch_ops(result):
            parts.append(f"no torch operators ran (plain Python timed: {result.speedup:.2f}x, not an autocast effect)")
        elif result.nothing_cast:
            parts.append(f"speedup not claimed ({_nothing_cast(result)})")
        elif too_few_runs(result):
            parts.append(f"speedup not claimed ({_too_few(result)})")
        else:
            flags = result.speedup_flags
            parts.append(f"speedup {speedup_figure(result, flags)}" + (f" ({', '.join(flags)})" if flags else ""))
    memory = memory_summary(result)
    if memory:
        parts.append(" ".join(memory))
    if result.drift:
        parts.append(drift_summary(result))
    if result.tokens:
        parts.append(tokens_summary(result))
    # One flag before every figure it qualifies: speedup, memory and drift all compare the recipe with
    # the cell's own reduced precision, not with fp32 (the first advice line says how).
    flag = f"fp32 run not fp32 (the cell runs {' and '.join(result.baseline_reduced)} itself): " \
        if result.baseline_reduced else ""
    return flag + (", ".join(parts) or f"{result.amp.name} only (no baseline)")


def _nothing_cast(result) -> str:
    """Why a ratio measured where the recipe changed no op is not claimed, either way (the advice says more)."""
    return f"{result.nothing_cast_words}; {result.speedup:.2f}x measured"


def _too_few(result) -> str:
    """Why a speedup from under MIN_RUNS timed runs per variant is not claimed (docs/amp.md, --repeat):
    with no spread to judge by, a single descheduled run decides the ranking."""
    runs = min(len(result.baseline.times.times), len(result.amp.times.times))
    return f"{plural(runs, 'timed run')} per variant; use {option('repeat', 5)}"


def _contended(result) -> bool:
    """Other programs took a material share of the CPU during the timed runs (see the warning), enough to
    explain the ratio (`AmpResult.times_contended`)."""
    return result.times_contended


def memory_summary(result) -> tuple[str, str] | None:
    """(label, value) of the peak-memory comparison for the headline and the KPI, or None.

    A saving is shown only when the measurement backs it (`AmpResult.memory_firm`). Below
    ``MEMORY_NOISE_FLOOR`` (1 MiB of fp32 peak) the CPU's RSS figures are allocator noise, and
    "memory saved -600%" from 12 KiB vs 40 KiB says nothing about the recipe; above it, CPU peaks
    whose runs overlap are "no firm difference", with the ranges that say why."""
    if result.baseline is None or not result.baseline.memory or not result.amp.memory:
        return None
    base, amp = result.baseline.memory.peak_bytes, result.amp.memory.peak_bytes
    if not result.memory_comparable:
        # also when fp32's peak measured 0 B (a tiny CPU cell: no saving is defined, the sizes still are)
        if max(base, amp) < MEMORY_NOISE_FLOOR:
            return "peak memory:", f"both under {format_bytes(MEMORY_NOISE_FLOOR)}"
        return "peak memory:", f"{format_bytes(base)} -> {format_bytes(amp)}"
    if not result.memory_firm:
        return "peak memory:", f"no firm difference ({memory_ranges(result)})"
    if result.memory_same:
        return "peak memory:", f"the same ({format_bytes(base)} -> {format_bytes(amp)})"
    return memory_change(result.memory_saving)


def drift_summary(result) -> str:
    d = result.drift
    if _all_near_zero(d):  # no relative figure means anything: the absolute one is the figure
        text = f"drift max abs {d['max_abs']:.2e} (result near 0, no relative figure)"
    else:
        text = f"drift max rel {_max_rel(d, '.2e')}"
    if d.get("amp_only_nonfinite"):
        text += f" ({result.amp.name} has inf/NaN where fp32 has none)"
    flag = _drift_flag(result)
    return text + (f" ({flag})" if flag else "")


def tokens_summary(result) -> str:
    """The token agreement for the headline: "tokens agree 87% (3 of 4 sequences diverge)"."""
    t = result.tokens
    text, detail = _tokens_kpi(t)
    text = f"{ids_noun(t)} {text}"
    flag = _drift_flag(result)
    return text + "".join(f" ({w})" for w in (detail, flag) if w)


def _tokens_kpi(t: dict) -> tuple[str, str | None]:
    """(the figure, what qualifies it) of a result's token agreement: ("agree 87%", "3 of 4 sequences diverge")."""
    words = t["tokens"]
    if not t["comparable"]:
        return "not compared", f"another number of {'sequences' if words else 'rows'}"
    lengths = "lengths differ" if t["lengths_differ"] else None
    if t["agree"] == t["compared"]:
        return ("agree where both have them" if lengths else "identical"), lengths
    if not words:  # no sequences to diverge: the entries that differ
        differ = t["compared"] - t["agree"]
        return (f"agree {share_words(t['agree'], t['compared'])}",
                ", ".join(filter(None, (f"{differ} of {t['compared']} differ{'s' if differ == 1 else ''}", lengths))))
    n = t["sequences"]
    verb = divergence_verb(any(leaf.get("prompt") for leaf in t["leaves"] if leaf["comparable"]))
    diverged = (f"the sequence {verb}s" if n == 1 else
                f"{t['diverged']} of {n} sequences {verb}{'s' if t['diverged'] == 1 else ''}")
    return f"agree {share_words(t['agree'], t['compared'])}", ", ".join(filter(None, (diverged, lengths)))


def _drift_flag(result) -> str | None:
    """Flagged where the drift is read: between runs from different states it is no measure of precision."""
    if not result.restored:
        return "variables not restored"
    return "state changed between runs" if result.iterators or result.state_changed else None


def _max_rel(drift: dict, spec: str) -> str:
    """The max relative error, or "n/a" when no element was finite in both runs to compare, or when
    every result is near 0 (drift.py: its relative error is rounding of the values it came from)."""
    return "n/a" if drift.get("compared") == 0 or drift["max_rel"] is None else format(drift["max_rel"], spec)


def _all_near_zero(drift: dict) -> bool:
    return drift.get("compared") != 0 and drift["max_rel"] is None


def _near_zero_words(result, leaf: dict) -> str:
    return near_zero_figures(leaf, result.amp.name, resolution(result.amp.recipe))


def memory_change(saving: float) -> tuple[str, str]:
    """("memory saved", "30%"), or ("memory used", "+700% vs fp32") when the recipe took more:
    a "saving" of -700% reads as a typo."""
    if saving >= 0:
        return "memory saved", f"{saving:.0%}"
    return "memory used", f"+{-saving:.0%} vs fp32"


def method(result) -> str:
    mem = f"{result.amp.memory.method}; {_memory_runs(result)}" if result.amp.memory else "not measured"
    state = (f"state restored from a {format_bytes(result.snapshot_bytes)} host snapshot before each run"
             if result.restored else "variables NOT restored (--no-restore): each run continued from the variables "
             "the previous one left; torch's settings were put back before each run")
    runs = (f"{plural(result.warmup, 'warmup round') if result.warmup else 'no warmup'}, "
            f"{plural(result.repeat, 'timed run')} per variant"
            + (", interleaved" if result.baseline is not None else f" ({result.amp.name} only, no fp32 baseline)"))
    contention = result.contention.summary() if result.contention else "contention: not measured"
    return (f"{runs}; timer: {result.timer_method}; {contention}; memory: {mem}; {ACHIEVED_METHOD}; {state}"
            + _fp32_overridden(result))


def _fp32_overridden(result) -> str:
    """The user's own reduced fp32 precision, which the comparison did not use: said, since their
    "fp32" elsewhere is not the fp32 here (a user trial's "medium" ran fp32 matmuls in bf16)."""
    if not result.fp32_overridden:
        return ""
    where = [w for w, on in (("the fp32 run", result.baseline is not None),
                             ("the ops autocast leaves in fp32", result.device.type == "cpu"
                              and result.amp.recipe.autocast_dtype is not None)) if on]
    if not where:  # CUDA without a baseline: the recipe's TF32 is no strict fp32 to tell of
        return ""
    return (f"; fp32 math: strict IEEE fp32 in {' and '.join(where)}, not as your "
            f"{' and '.join(result.fp32_overridden)} asks (back in place now)")


# What the "achieved" column divides by what (flops.OpAudit counts with nbaccel's shape formulas, as
# %%profile_gpu does, and torch's FLOP registry for the ops it has none for).
ACHIEVED_METHOD = ("achieved: the FLOPs of the matmul, convolution, attention and recurrent ops (the formulas "
                   "%%profile_gpu uses, torch.utils.flop_counter's where nbaccel has none; a multiply-add is 2; "
                   "elementwise ops and reductions are not counted) in each variant's audited run, divided by that "
                   "variant's median timed run")


def _memory_runs(result) -> str:
    """How many memory runs each figure is, and how far they spread: a CPU peak moves between runs."""
    variants = [v for v in (result.baseline, result.amp) if v is not None and v.memory]
    runs = max(len(v.memory.run_peaks) for v in variants)
    if runs == 1:
        why = " (the allocator's counts repeat exactly)" if all(v.memory.exact for v in variants) else ""
        return f"1 run per variant{why}"
    spreads = ", ".join(f"{v.name} {byte_range(min(v.memory.run_peaks), max(v.memory.run_peaks))} (spread "
                        f"{format_bytes(max(v.memory.run_peaks) - min(v.memory.run_peaks))})" for v in variants)
    firm = ("a difference is firm when each variant's runs counted the same (an allocator's counts repeat run "
            "to run) or the ranges do not overlap" if all(v.memory.exact for v in variants)
            else "a difference is firm when the ranges do not overlap")
    return f"median of {runs} runs per variant{', interleaved' if len(variants) > 1 else ''}: {spreads}; {firm}"


def _switch_words(ops: list[str]) -> str:
    """The switching ops the audit saw, as the cause names them: "aten::relu or aten::threshold_backward"."""
    shown = ops[:3] + ([f"{len(ops) - 3} more"] if len(ops) > 3 else [])
    return "an op such as " + " or ".join(shown) if len(ops) > 1 else ops[0]


def _switched_cause(g: dict) -> str:
    """Why gradient entries of normal size became exactly 0, from what the audit saw: a ReLU, max or
    dropout only where it saw one (`flops.SWITCH_OPS`); else rounding or cancellation in a sum (a trial's
    LSTM + Linear, 81 entries of 1e-9..6e-7 beside a typical 5e-6, read "a ReLU, max or dropout")."""
    sizes = ""
    if g.get("switched_off_largest") is not None:
        sizes = (f"; in fp32 they were at most {g['switched_off_largest']:.2g}, where the nonzero entries of "
                 f"their tensors average {g['switched_off_typical']:.2g}")
    if g.get("switch_ops"):
        return (f"{_switch_words(g['switch_ops'])} whose input flipped sign or order with rounding, or rounding "
                f"and cancellation in a sum{sizes}")
    return f"rounding or cancellation in a sum made them exactly 0 (the op audit saw no ReLU, max or dropout){sizes}"


def _gradient_lines(result) -> list[str]:
    g = result.gradients
    if not g:
        return []
    lines = [f"{g['tensors_with_grad']} tensors got gradients; overflow (inf/NaN): {g['overflow_tensors']} tensors, "
             f"{g['overflow_elements']} elements"]
    # the result's drift flag, on these too: a trial's "median 148.36%" came from runs that each took another
    # batch from an iterator, with nothing beside it to say so
    flag = _drift_flag(result)
    flag = f" ({flag}: not a measure of precision)" if flag else ""
    moved = g.get("relative_error")
    if moved:
        lines.append(f"gradient drift against fp32: relative error (each tensor's L2 norm of the difference over its "
                     f"fp32 norm) median {moved['median']:.2%}, max {moved['max']:.2%}, over "
                     f"{plural(moved['tensors'], 'tensor')}{flag}")
    stepped = g.get("update_error")
    if stepped:
        lines.append(f"update drift against fp32: relative error of each tensor's step (after minus before: the L2 "
                     f"norm of the difference over fp32's step) median {stepped['median']:.2%}, max "
                     f"{stepped['max']:.2%}, over {plural(stepped['tensors'], 'tensor')}{flag}")
    if g["underflow_fraction"] is not None:
        n = g["underflow_elements"]
        below = g.get("underflow_below")
        switches = g.get("switch_ops", [])
        which = (f"; only values under {g['dtype']}'s smallest normal number ({below:.2g}) count" if below is not None
                 else f"; some may be {_switch_words(switches)} whose input flipped sign with rounding"
                 if n and switches else "")
        lines.append(f"underflow: {n} {'entry' if n == 1 else 'entries'} nonzero in fp32 became 0 in {g['dtype']} "
                     f"({g['underflow_fraction']:.3%}){which}")
    switched = g.get("switched_off_elements")
    if switched:  # not underflow: said apart, so GradScaler is not taken for the cure
        lines.append(f"switched off: {switched} {'entry' if switched == 1 else 'entries'} of normal size in fp32 "
                     f"became 0 in {g['dtype']} ({_switched_cause(g)}; not underflow)")
    lines.append("GradScaler: " + ("used" if g["grad_scaler"] else "not used")
                 + (" -- it skipped this step (inf/NaN found)" if g.get("scaler_skipped_step") else ""))
    return lines


def _precision_lines(result) -> list[str]:
    p = result.precision
    # the op audit's view; where its run differed from the timed ones, the line says whose it is
    where = " (in the audited run, which differed from the timed ones: see the advice)" if result.audit_differs else ""
    lines = [f"ran in reduced precision{where}: {', '.join(p['reduced']) or 'none'}"]
    if p["reduced_flop_share"] is not None:
        lines.append(f"share of FLOPs in reduced precision: {p['reduced_flop_share']:.0%}")
    if p["heavy_fp32"]:
        lines.append(f"heavy ops that stayed fp32: {', '.join(result.heavy_fp32_calls)}")
    return lines


def text(result) -> str:
    # The headline and the table as they are; the notes, warnings, advice and method folded (`prose`).
    out = [f"nbaccel {result.made_by} on {result.device.label}: {headline(result)}", "",
           text_table(HEADERS, _variant_rows(result)), ""]
    out += map(prose, _precision_lines(result) + _gradient_lines(result) + _drift_lines(result))
    out += [labelled("WARNING: ", note) for note in result.noise_warnings]
    if result.advice:
        out.append("")
        out += [labelled("advice: ", a) for a in result.advice]
    out += ["", labelled("method: ", method(result))]
    return "\n".join(out)


def _drift_lines(result) -> list[str]:
    d = result.drift
    if d is None:
        return ([f"drift of the result: not computed ({result.drift_skipped})"] if result.drift_skipped
                else []) + _token_lines(result)
    if d.get("compared") == 0:
        lines = ["drift of the result: n/a (no element is finite in both runs)"]
    else:
        lines = [f"drift of the result: max abs {d['max_abs']:.3e}, max rel {_max_rel(d, '.3e')}"
                 + (" (where both are finite)" if d.get("amp_only_nonfinite") or d.get("fp32_only_nonfinite") else "")]
        for leaf in d["leaves"]:
            if leaf.get("near_zero") and leaf["max_abs"] > 0:  # an unchanged near-0 value needs no words
                name = "" if leaf["name"] == "value" else f" {leaf['name']}"
                lines.append(f"near 0:{name} {_near_zero_words(result, leaf)}: its relative change "
                             f"({relative_words(leaf['max_rel'], '.2e')}) is left out, its absolute change is "
                             f"{leaf['max_abs']:.2e}")
    if d.get("amp_only_nonfinite"):
        lines.append(f"{result.amp.name} produced inf/NaN where fp32 did not: {d['amp_only_nonfinite']} element(s)")
    if d.get("fp32_only_nonfinite"):
        lines.append(f"fp32 produced inf/NaN where {result.amp.name} did not: {d['fp32_only_nonfinite']} element(s)")
    return lines + _token_lines(result)


def _token_lines(result) -> list[str]:
    """One line per token-id leaf of the result (`drift.compare_tokens`)."""
    t = result.tokens
    if not t:
        return []
    return [f"{ids_noun(leaf)} of the result"
            f"{'' if leaf['name'] == 'value' else ' ' + leaf['name']}: "
            f"{token_figures(leaf, result.amp.name)}" for leaf in t["leaves"]]


def _kpis(result) -> str:
    kpis = []
    if result.baseline_reduced:  # first: it qualifies every figure after it
        kpis.append(f'<div class="kpi"><div class="muted">fp32 run</div><div class="big warn">not fp32</div>'
                    f'<div class="muted">(the cell runs {esc(" and ".join(result.baseline_reduced))} itself)</div></div>')
    too_few = result.speedup is not None and too_few_runs(result) and not _no_torch_ops(result)
    unclaimed = (_nothing_cast(result) if result.nothing_cast and result.speedup is not None
                 else _too_few(result) if too_few else None)
    if unclaimed:
        kpis.append(f'<div class="kpi"><div class="muted">speedup</div><div class="big warn nbaccel-speedup">'
                    f'not claimed</div><div class="muted">({esc(unclaimed)})</div></div>')
    elif result.speedup is not None:
        cls = "big warn" if result.speedup_uncertain or _no_torch_ops(result) or _contended(result) else "big"
        label = "speedup (no torch ops ran)" if _no_torch_ops(result) else "speedup"
        # The flags in words too: the orange alone is lost where nbaccel's <style> is stripped (GitHub,
        # nbviewer), and a trial read an uncertain 1.20x there as a firm claim.
        flags = result.speedup_flags
        flag = f'<div class="muted warn">({", ".join(flags)})</div>' if flags else ""
        kpis.append(f'<div class="kpi"><div class="muted">{label}</div><div class="{cls} nbaccel-speedup">'
                    f'{speedup_figure(result, flags)}</div>{flag}</div>')
    memory = memory_summary(result)
    if memory:
        label, value = memory
        label = label.rstrip(":") if label.startswith("peak") else f"peak {label}"
        # "no firm difference (fp32 20-24 MiB, ...)": the verdict in large type, the ranges under it
        value, _, detail = value.partition(" (")
        detail = f'<div class="muted">({esc(detail)}</div>' if detail else ""
        kpis.append(f'<div class="kpi"><div class="muted">{esc(label)}</div><div class="big">{esc(value)}</div>'
                    f'{detail}</div>')
    if result.drift:
        flag = _drift_flag(result)
        near_zero = (f'<div class="muted">(result near 0: max abs {result.drift["max_abs"]:.1e})</div>'
                     if _all_near_zero(result.drift) else "")
        kpis.append(f'<div class="kpi"><div class="muted">drift (max rel)</div><div class="big">'
                    f'{_max_rel(result.drift, ".1e")}</div>' + near_zero
                    + (f'<div class="muted warn">{esc(flag)}</div>' if flag else "") + '</div>')
        if result.drift.get("amp_only_nonfinite"):
            kpis.append(f'<div class="kpi"><div class="muted">inf/NaN only in {esc(result.amp.name)}</div>'
                        f'<div class="big warn">{result.drift["amp_only_nonfinite"]}</div></div>')
    if result.tokens:
        value, detail = _tokens_kpi(result.tokens)
        flag = _drift_flag(result)
        cls = "big" if value == "identical" else "big warn"
        kpis.append(f'<div class="kpi"><div class="muted">tokens (fp32 vs {esc(result.amp.name)})</div>'
                    f'<div class="{cls}">{esc(value)}</div>'
                    + (f'<div class="muted">({esc(detail)})</div>' if detail else "")
                    + (f'<div class="muted warn">{esc(flag)}</div>' if flag else "") + '</div>')
    return "".join(kpis)


def summary_html(result) -> str:
    noise = "".join(f'<div class="warn">{esc(n)}</div>' for n in result.noise_warnings)
    return (f"<h4>{esc(result.made_by)} on {esc(result.device.label)}</h4>{_kpis(result)}"
            + table(HEADERS, _variant_rows(result), name_columns=(), text_columns=(0, 1)) + noise)


def ops_rows(result, which="all"):
    frame = result.amp.ops
    if frame.empty:
        return []
    if which == "reduced":
        frame = frame[frame["dtype"].isin(["bf16", "fp16"])]
    elif which == "fp32":
        frame = frame[frame["dtype"] == "fp32"]
    elif which == "heavy":
        frame = frame[frame["heavy"]]
    return [[r.op, r.dtype, r.calls, si(r.flops, "FLOP") if r.flops else "-", r.input_dtypes] for r in frame.itertuples()]


OPS_HEADERS = ["op", "output dtype", "calls", "FLOPs", "input dtypes"]


def details_html(result) -> str:
    sections = ["<h4>Precision per operator (under the recipe)</h4>", bullet_list(_precision_lines(result)),
                table(OPS_HEADERS, ops_rows(result)[:40], text_columns=(1, 4))]
    drift = _drift_lines(result)
    if drift:
        sections += ["<h4>Drift of the result (fp32 vs the recipe)</h4>", bullet_list(drift)]  # token ids too
    if result.gradients:
        sections += ["<h4>Gradients</h4>", bullet_list(_gradient_lines(result))]
    return "".join(sections)


def html(result) -> str:
    advice = f"<h4>Advice</h4>{bullet_list(result.advice)}" if result.advice else ""
    return wrap(summary_html(result) + advice + details_html(result) + method_html(method(result)))


def widget(result):
    import ipywidgets as w

    summary = w.HTML(wrap(summary_html(result)))
    advice = w.HTML(wrap(bullet_list(result.advice) or "<i>nothing to report</i>"))
    choose = w.ToggleButtons(options=[("all ops", "all"), ("reduced precision", "reduced"), ("fp32", "fp32"),
                                      ("heavy", "heavy")], value="all", description="show")
    ops = w.HTML()

    def refresh(_=None):
        ops.value = wrap(bullet_list(_precision_lines(result))
                         + table(OPS_HEADERS, ops_rows(result, choose.value), text_columns=(1, 4)))

    choose.observe(refresh, names="value")
    refresh()
    grads = w.HTML(wrap(bullet_list(_gradient_lines(result)) or "<i>the cell computed no gradients</i>"))
    tabs = w.Tab(children=[advice, w.VBox([choose, ops]), grads])
    for i, title in enumerate(["Advice", "Operators", "Gradients"]):
        tabs.set_title(i, title)
    footer = w.HTML(wrap(method_html(method(result))))
    box = w.VBox([summary, tabs, footer])
    box.add_class("nbaccel-amp")
    return box
