"""How an `AmpResult` looks: text, static HTML, and the JupyterLab widget."""

from __future__ import annotations

from ..memory import format_bytes
from ..timing import format_seconds
from .common import bullet_list, esc, si, table, text_table, wrap


def _flops(v) -> str:
    return si(v.flops_per_second, "FLOP/s") if v.flops_per_second else "n/a"


def _variant_rows(result):
    rows = []
    for v in filter(None, (result.baseline, result.amp)):
        rows.append([
            v.name, v.recipe.label, format_seconds(v.median), format_seconds(v.times.iqr), len(v.times.times),
            format_bytes(v.memory.peak_bytes) if v.memory else "n/a", _flops(v),
        ])
    return rows


HEADERS = ["variant", "recipe", "median", "IQR", "runs", "peak memory", "achieved"]


def headline(result) -> str:
    parts = []
    if result.speedup is not None:
        parts.append(f"speedup {result.speedup:.2f}x" + (" (uncertain)" if result.speedup_uncertain else ""))
    if result.memory_saving is not None:
        label, value = memory_change(result.memory_saving)
        parts.append(f"{label} {value}")
    if result.drift:
        parts.append(f"drift max rel {result.drift['max_rel']:.2e}")
    return ", ".join(parts) or f"{result.amp.name} only (no baseline)"


def memory_change(saving: float) -> tuple[str, str]:
    """("memory saved", "30%"), or ("memory used", "+700% vs fp32") when the recipe took more:
    a "saving" of -700% reads as a typo."""
    if saving >= 0:
        return "memory saved", f"{saving:.0%}"
    return "memory used", f"+{-saving:.0%} vs fp32"


def method(result) -> str:
    mem = result.amp.memory.method if result.amp.memory else "not measured"
    state = (f"state restored from a {format_bytes(result.snapshot_bytes)} host snapshot before each run"
             if result.restored else "state NOT restored (--no-restore): each run continued from the previous one")
    return (f"{result.warmup} warmup + {result.repeat} timed runs per variant, interleaved; timer: {result.timer_method}; "
            f"memory: {mem}; {state}")


def _gradient_lines(result) -> list[str]:
    g = result.gradients
    if not g:
        return []
    lines = [f"{g['tensors_with_grad']} tensors got gradients; overflow (inf/NaN): {g['overflow_tensors']} tensors, "
             f"{g['overflow_elements']} elements"]
    if g["underflow_fraction"] is not None:
        lines.append(f"underflow: {g['underflow_elements']} entries nonzero in fp32 became 0 in {g['dtype']} "
                     f"({g['underflow_fraction']:.3%})")
    lines.append("GradScaler: " + ("used" if g["grad_scaler"] else "not used")
                 + (" -- it skipped this step (inf/NaN found)" if g.get("scaler_skipped_step") else ""))
    return lines


def _precision_lines(result) -> list[str]:
    p = result.precision
    lines = [f"ran in reduced precision: {', '.join(p['reduced']) or 'none'}"]
    if p["reduced_flop_share"] is not None:
        lines.append(f"share of FLOPs in reduced precision: {p['reduced_flop_share']:.0%}")
    if p["heavy_fp32"]:
        lines.append(f"heavy ops that stayed fp32: {', '.join(p['heavy_fp32'])}")
    return lines


def text(result) -> str:
    out = [f"nbaccel %%amp on {result.device.label}: {headline(result)}", "",
           text_table(HEADERS, _variant_rows(result)), ""]
    out += _precision_lines(result)
    out += _gradient_lines(result)
    if result.drift:
        out.append(f"drift of the result: max abs {result.drift['max_abs']:.3e}, max rel {result.drift['max_rel']:.3e}")
    for note in result.noise_warnings:
        out.append("WARNING: " + note)
    if result.advice:
        out.append("")
        out += ["advice: " + a for a in result.advice]
    out += ["", "method: " + method(result)]
    return "\n".join(out)


def _kpis(result) -> str:
    kpis = []
    if result.speedup is not None:
        cls = "big warn" if result.speedup_uncertain else "big"
        kpis.append(f'<div class="kpi"><div class="muted">speedup</div><div class="{cls} nbaccel-speedup">'
                    f'{result.speedup:.2f}x</div></div>')
    if result.memory_saving is not None:
        label, value = memory_change(result.memory_saving)
        kpis.append(f'<div class="kpi"><div class="muted">peak {label}</div><div class="big">{value}</div></div>')
    if result.drift:
        kpis.append(f'<div class="kpi"><div class="muted">drift (max rel)</div><div class="big">'
                    f'{result.drift["max_rel"]:.1e}</div></div>')
    return "".join(kpis)


def summary_html(result) -> str:
    noise = "".join(f'<div class="warn">{esc(n)}</div>' for n in result.noise_warnings)
    return (f"<h4>%%amp on {esc(result.device.label)}</h4>{_kpis(result)}"
            + table(HEADERS, _variant_rows(result), name_columns=(0, 1)) + noise)


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
    return [[r.op, r.dtype, r.calls, f"{r.flops:,}", r.input_dtypes] for r in frame.itertuples()]


OPS_HEADERS = ["op", "output dtype", "calls", "FLOPs", "input dtypes"]


def details_html(result) -> str:
    sections = ["<h4>Precision per operator (under the recipe)</h4>", bullet_list(_precision_lines(result)),
                table(OPS_HEADERS, ops_rows(result)[:40])]
    if result.gradients:
        sections += ["<h4>Gradients</h4>", bullet_list(_gradient_lines(result))]
    return "".join(sections)


def html(result) -> str:
    advice = f"<h4>Advice</h4>{bullet_list(result.advice)}" if result.advice else ""
    return wrap(summary_html(result) + advice + details_html(result)
                + f'<div class="muted">method: {esc(method(result))}</div>')


def widget(result):
    import ipywidgets as w

    summary = w.HTML(wrap(summary_html(result)))
    advice = w.HTML(wrap(bullet_list(result.advice) or "<i>nothing to report</i>"))
    choose = w.ToggleButtons(options=[("all ops", "all"), ("reduced precision", "reduced"), ("fp32", "fp32"),
                                      ("heavy", "heavy")], value="all", description="show")
    ops = w.HTML()

    def refresh(_=None):
        ops.value = wrap(bullet_list(_precision_lines(result)) + table(OPS_HEADERS, ops_rows(result, choose.value)))

    choose.observe(refresh, names="value")
    refresh()
    grads = w.HTML(wrap(bullet_list(_gradient_lines(result)) or "<i>the cell computed no gradients</i>"))
    tabs = w.Tab(children=[advice, w.VBox([choose, ops]), grads])
    for i, title in enumerate(["Advice", "Operators", "Gradients"]):
        tabs.set_title(i, title)
    footer = w.HTML(wrap(f'<div class="muted">method: {esc(method(result))}</div>'))
    box = w.VBox([summary, tabs, footer])
    box.add_class("nbaccel-amp")
    return box
