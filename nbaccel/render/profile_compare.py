"""How a `ProfileComparison` looks: the step times, the ops called out, then every op's change.

The called-out lines come first because they are the answer ("aten::bmm 3.1x slower under bf16");
the table under them is the evidence, largest change first, so nothing is hidden by a threshold.
"""

from __future__ import annotations

from ..profile_compare import MIN_RATIO, MIN_SHARE
from .common import esc, figures, labelled, prose, table, text_table, wrap
from .profile import _time

NAMED = 5  # ops named per called-out line


def title(c) -> str:
    return f"{c.made_by}: {c.labels[1]} against {c.labels[0]}, op by op"


def _ratio(before, after) -> str:
    if not before or not after:
        return "-"
    # "0.61x" read as "61% of the time" to some and "0.61x the speed" to others: words say which way
    return f"{times(after / before)} slower" if after >= before else f"{times(before / after)} faster"


def times(ratio: float) -> str:
    """``3.14x``, ``1,350x`` (not 3 significant digits' ``1.35e+03x``)."""
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def _change(us: float) -> str:
    return ("+" if us > 0 else "-" if us < 0 else "") + _time(abs(us))


def summary_items(c) -> list[tuple[str, str]]:
    (sa, sb), (oa, ob) = c.step_time_us, c.op_time_us
    a, b = c.labels
    return [("step time", f"{_time(sa)} -> {_time(sb)} ({_ratio(sa, sb)})"),
            ("ops' self time", f"{_time(oa)} -> {_time(ob)} ({_ratio(oa, ob)})"),
            ("compared", "device self time" if c.on_device else "self CPU time")]


def _names(rows, what) -> str:
    shown = ", ".join(what(r) for r in rows[:NAMED])
    return shown + (f" and {len(rows) - NAMED} more" if len(rows) > NAMED else "")


def finding_lines(c) -> list[str]:
    a, b = c.labels
    total = max(c.op_time_us) or 1.0

    def changed(r) -> str:  # "aten::mm 3.1x slower (1 ms -> 3.1 ms)"
        return f"{r['name']} {_ratio(r['before_us'], r['after_us'])} ({_time(r['before_us'])} -> {_time(r['after_us'])})"

    def alone(side):  # "aten::sort 29 ms (68%)", of the one profile that ran it
        return lambda r: f"{r['name']} {_time(r[side])} ({r[side] / total:.0%})"

    kinds = ((f"slower in {b}", c.slower, changed), (f"only in {b}", c.new, alone("after_us")),
             (f"faster in {b}", c.faster, changed), (f"only in {a}", c.gone, alone("before_us")))
    lines = [f"{label}: " + _names(rows, what) for label, rows, what in kinds if rows]
    if not lines:
        lines.append(f"no op changed by {MIN_RATIO:.2f}x and by {MIN_SHARE:.0%} of the ops' time or more: the "
                     "difference is spread over many ops, or within one profile's noise (the table has every op)")
    else:
        called = c.slower + c.new + c.faster + c.gone
        rest = sum(r["change_us"] for r in c.rows) - sum(r["change_us"] for r in called)
        lines.append(f"ops' time per step changed by {_change(c.op_time_us[1] - c.op_time_us[0])}: the ops above "
                     f"{_change(sum(r['change_us'] for r in called))}, all others together {_change(rest)}")
    for label, result in zip(c.labels, (c.before, c.after)):
        if result.contention_warning:  # the two ran at different moments: load in one skews the ratios
            lines.append(f"{label}: {result.contention_warning}")
    return lines


def method(c) -> str:
    na, nb = c.steps
    steps = f"{na} and {nb} recorded steps" if na != nb else f"{na} recorded step{'s' if na > 1 else ''} each"
    return (f"Each op's {'device self time' if c.on_device else 'self CPU time'} (its duration minus its child ops'), "
            f"summed per op name and divided by the profile's recorded steps ({steps}); step time = median "
            f"ProfilerStep. An op is named only when its time changed by {MIN_RATIO:.2f}x or more and by at least "
            f"{MIN_SHARE:.0%} of the larger profile's op time: one profiled step varies by 10-20% on a busy host, so "
            "profile both with --steps 5 (or steps=5) for steadier times, and with --warmup 1 (warmup=1) where the "
            "code had not run before: a first run holds one-time setup (oneDNN/cuDNN, allocator growth) that the "
            "other may not. The two profiles ran at different moments: other programs' load is in one and not "
            "the other.")


_HEADERS = ["op", "category", "calls", "{a}", "{b}", "ratio", "change"]


def _top(c) -> int:
    return c.after.options.top or 15  # as many rows as the profile's own table (--top)


def _rows(c) -> list[list[str]]:
    def calls(r):
        x, y = (f"{v:g}" for v in (r["before_calls"], r["after_calls"]))
        return x if x == y else f"{x} -> {y}"
    return [[r["name"], r["category"], calls(r), _time(r["before_us"]) if r["before_calls"] else "-",
             _time(r["after_us"]) if r["after_calls"] else "-", _ratio(r["before_us"], r["after_us"]),
             _change(r["change_us"])] for r in c.rows[:_top(c)]]


def _headers(c) -> list[str]:
    return [h.format(a=c.labels[0], b=c.labels[1]) for h in _HEADERS]


def text(c) -> str:
    out = [prose(title(c)), figures(summary_items(c)), ""]
    out += [labelled("  - ", line) for line in finding_lines(c)]
    out += ["", f"ops by change per step ({min(_top(c), len(c.rows))} of {len(c.rows)}; every op in result.ops):",
            text_table(_headers(c), _rows(c), left=(0, 1)), "", labelled("method: ", method(c))]
    return "\n".join(out)


def html(c) -> str:
    kpis = "".join(f'<span class="kpi">{esc(k)}<br><b>{esc(v)}</b></span>' for k, v in summary_items(c))
    findings = "<ul>" + "".join(f"<li>{esc(line)}</li>" for line in finding_lines(c)) + "</ul>"
    rows = table(_headers(c), _rows(c), name_columns=(0,), text_columns=(1,))
    return wrap(f"<h4>{esc(title(c))}</h4><div>{kpis}</div>{findings}"
                f"<div class='muted'>ops by change per step ({min(_top(c), len(c.rows))} of {len(c.rows)}; every op "
                f"in result.ops)</div>{rows}<p class='muted'>{esc(method(c))}</p>")


def widget(c):
    import ipywidgets as w

    return w.HTML(html(c))
