"""How a `ProfileComparison` looks: the step times, the ops called out, then every op's change.

The called-out lines come first because they are the answer ("aten::bmm 3.1x slower under bf16");
the table under them is the evidence, largest change first, so nothing is hidden by a threshold.
"""

from __future__ import annotations

from ..options import option
from ..profile_advice import setup_words
from ..profile_compare import MIN_SHARE
from .common import esc, figures, labelled, prose, table, text_table, wrap
from .profile import _time

NAMED = 5  # ops named per called-out line


def title(c) -> str:
    return f"{c.made_by}: {c.labels[1]} against {c.labels[0]}, op by op"


def _ratio(before, after) -> str:
    if not after or before is None:
        return "-"
    if not before:
        return "from 0"  # an op that took no self time before (a no-op cast) and does now
    if abs(after / before - 1) < 0.005:
        return "the same"  # not "1x faster" (a trial)
    # "0.61x" read as "61% of the time" to some and "0.61x the speed" to others: words say which way
    return f"{times(after / before)} slower" if after >= before else f"{times(before / after)} faster"


def times(ratio: float) -> str:
    """``3.14x``, ``1,350x`` (not 3 significant digits' ``1.35e+03x``)."""
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def _change(us: float) -> str:
    return ("+" if us > 0 else "-" if us < 0 else "") + _time(abs(us))


def first_run_note(c) -> str | None:
    """"a was a first run: setup included", for the headline figure and the table's title; None when neither was."""
    names = [label for label, first in zip(c.labels, c.first_runs) if first]
    if not names:
        return None
    return " and ".join(names) + (" was a first run" if len(names) == 1 else " were first runs") + ": setup included"


def contended_note(c) -> str | None:
    """"a ran while other programs used 1.0 of the 2 CPU cores", for the headline beside `first_run_note`; None
    when neither profile was contended. The two profiles ran at different moments, so load in one skews every
    ratio: a trial's baseline, recorded while another process kept a core busy, read "14.9x faster" for a 1.3x
    change, and the contention was the fifth line under it."""
    named = [f"{label} ran while other programs used {result.contention.figures()}"
             for label, result in zip(c.labels, (c.before, c.after)) if _contended(result)]
    return "; ".join(named) or None


def _contended(result) -> bool:
    return result.contention is not None and result.contention.contended


def first_run_lines(c) -> list[str]:
    """The caveat on a side that was likely its code's first run: the headline it qualifies, why, and how to be sure.

    A first run's step holds one-off setup the trace cannot tell from the ops' own time (a trial read
    "14.2x faster" of identical code whose stored profile was its first run); the setup makes the other
    side read faster than it is, or this side slower."""
    a, b = c.labels
    again = c.made_by.startswith("%%")  # the labels are the variable's name and "this run"
    before_us, after_us = c.step_time_us
    step = _ratio(before_us, after_us)
    faster = bool(before_us and after_us) and step.endswith("faster")
    if all(c.first_runs):
        return [_both_first_runs(c, step, again)]
    lines = []
    for i, result in enumerate((c.before, c.after)):
        if not c.first_runs[i]:
            continue
        why = f"its code's first run{_unseen_words(result)}: one-off setup ({setup_words(result)}) is in its times"
        # "but" where the setup may explain the headline: after faster than a first-run before, or a first-run
        # after slower; "and" where the headline stands against it (the true change is larger)
        join = "but" if faster == (i == 0) and step not in ("the same", "-") else "and"
        if i == 0:
            fix = (f"re-record it with %%profile_gpu --warmup 1 -r {a}" if again else
                   "profile it again with %%profile_gpu --warmup 1")
            lines.append(f"mean step {step} in {b}, {join} {a} was likely recorded on {why}, which makes {b} "
                         f"read faster than it is; {fix}, and compare again")
        else:
            fix = "run the cell again (or with --warmup 1)" if again else "profile it again with %%profile_gpu --warmup 1"
            lines.append(f"mean step {step} in {b}, {join} it was likely {why}, which makes it read slower than it "
                         f"is; {fix}, and compare again")
    return lines


def _unseen_words(result, under: bool = True) -> str:
    """Why a side reads as a first run, as what nbaccel saw, not as a fact (`magics.ran_before`): a trial's setup cell
    had called the step through other lines, and "not run earlier in this session" was wrong. ``under``: name the
    recipe first (" under autocast bf16 (cpu) (...)"), where the side's label does not."""
    recipe = result.recipe_label
    if not recipe:
        return " (no --warmup, and no earlier cell in the input history holds this code's lines)"
    if under:
        return f" under {recipe} (no --warmup, and no earlier %%profile_gpu or %%amp cell ran this code under it)"
    return f" (no --warmup, and no earlier %%profile_gpu or %%amp cell ran this code under {recipe})"


def _both_first_runs(c, step: str, again: bool) -> str:
    """One line where both sides were likely first runs: the setup is in both, in amounts that differ, so
    neither "reads faster" nor "reads slower" holds alone (a trial got both, in two lines, one after the other)."""
    a, b = c.labels
    whys = "; ".join(f"{label}{_unseen_words(result, under=False)}" for label, result in zip(c.labels, (c.before, c.after)))
    fix = (f"re-record {a} with %%profile_gpu --warmup 1 -r {a}, run this cell again" if again else
           "profile both again with %%profile_gpu --warmup 1")
    return (f"mean step {step} in {b}, but both were likely their code's first runs ({whys}): one-off setup "
            f"({setup_words(c.after)}) is in both, in amounts that differ, so the ratio says little about the ops; "
            f"{fix}, and compare again")


def _maybe_setup(c, side: int) -> str:
    """The qualifier of a called-out line that a first run's setup, or other programs' load, may explain: ops
    faster in or only in a 'before' that was one (or contended), slower in or only in an 'after' that was."""
    causes = [cause for cause, on in (("first-run setup", c.first_runs[side]),
                                      ("contention", _contended((c.before, c.after)[side]))) if on]
    return f" (maybe {' or '.join(causes)}: see above)" if causes else ""


def summary_items(c) -> list[tuple[str, str]]:
    (sa, sb), (oa, ob) = c.step_time_us, c.op_time_us
    a, b = c.labels
    note = "; ".join(filter(None, (first_run_note(c), contended_note(c))))
    return [("mean step time", f"{_time(sa)} -> {_time(sb)} ({_ratio(sa, sb)}" + (f"; {note})" if note else ")")),
            ("ops' self time", f"{_time(oa)} -> {_time(ob)} ({_ratio(oa, ob)})"),
            ("compared", "device self time" if c.on_device else "self CPU time")]


def _names(rows, what) -> str:
    shown = ", ".join(what(r) for r in rows[:NAMED])
    return shown + (f" and {len(rows) - NAMED} more" if len(rows) > NAMED else "")


def moved_words(r) -> str:
    """What happened under an op judged by its total time: "its work moved to aten::_slow_conv2d_backward, new
    under it" (its self time fell), "it took on the work of ..." (rose), or which child ops changed."""
    def names(ops):  # the one with the most time under it (an aten::_nnpack_available check beside it is noise)
        more = len(ops) - 1
        return ops[0] + (f" (and {more} other op{'s' if more > 1 else ''})" if more else "")
    new, gone = r.get("children_new") or [], r.get("children_gone") or []
    if new and r["after_us"] < r["before_us"]:
        return f"its work moved to {names(new)}, new under it"
    if gone and r["after_us"] > r["before_us"]:
        return f"it took on the work of {names(gone)}, no longer under it"
    return "its child ops changed: " + "; ".join(
        part for part in (new and f"{names(new)} new under it", gone and f"{names(gone)} no longer under it") if part)


def finding_lines(c) -> list[str]:
    a, b = c.labels

    def changed(r) -> str:  # "aten::mm 3.1x slower (1 ms -> 3.1 ms)"
        if c.judged_by_total(r):  # its self time alone would say the opposite, or too much (see `moved`)
            x, y = r["before_total_us"], r["after_total_us"]
            return f"{r['name']} {_ratio(x, y)} in total ({_time(x)} -> {_time(y)}; {moved_words(r)})"
        return f"{r['name']} {_ratio(r['before_us'], r['after_us'])} ({_time(r['before_us'])} -> {_time(r['after_us'])})"

    def unclear(r) -> str:  # a moved op whose total changed too little, or within its spread, to be named either way
        x, y = r["before_total_us"], r["after_total_us"]
        return f"{r['name']} (total {_time(x)} -> {_time(y)}, {_ratio(x, y)}; {moved_words(r)})"

    def alone(side, i):  # "aten::sort 29 ms (68%)", of the one profile that ran it (was: of the larger)
        return lambda r: f"{r['name']} {_time(r[side])} ({r[side] / (c.op_time_us[i] or 1.0):.0%})"

    kinds = ((f"slower in {b}{_maybe_setup(c, 1)}", c.slower, changed),
             (f"only in {b}{_maybe_setup(c, 1)}", c.new, alone("after_us", 1)),
             (f"faster in {b}{_maybe_setup(c, 0)}", c.faster, changed),
             (f"only in {a}{_maybe_setup(c, 0)}", c.gone, alone("before_us", 0)),
             (f"no clear change in total in {b}", c.unclear, unclear))
    # Other programs' load first, beside the first-run caveat: both qualify every ratio under them.
    caveats = first_run_lines(c) + [f"{label}: {result.contention_warning}" for label, result
                                    in zip(c.labels, (c.before, c.after)) if result.contention_warning]
    lines = caveats + [f"{label}: " + _names(rows, what) for label, rows, what in kinds if rows]
    if len(lines) == len(caveats):
        lines.append(f"no op changed by {c.min_ratio:.2f}x and by {MIN_SHARE:.0%} of the ops' time or more"
                     + (", beyond its step-to-step spread" if c.spread_checked else "")
                     + ": the difference is spread over many ops, or within the noise (the table has every op)")
    else:
        called = c.slower + c.new + c.faster + c.gone + c.unclear
        rest = sum(r["change_us"] for r in c.rows) - sum(r["change_us"] for r in called)
        lines.append(f"ops' time per step changed by {_change(c.op_time_us[1] - c.op_time_us[0])}: the ops above "
                     f"{_change(sum(r['change_us'] for r in called))}, all others together {_change(rest)}")
    if not c.spread_checked and (c.slower or c.faster or c.moved):
        lines.append(f"from {'one step' if 1 in c.steps else 'steps'} without a spread to check them against: "
                     f"profile both with {option('steps', 5)} to name only changes beyond each op's step-to-step noise")
    return lines


def method(c) -> str:
    na, nb = c.steps
    steps = f"{na} and {nb} recorded steps" if na != nb else f"{na} recorded step{'s' if na > 1 else ''} each"
    noise = (f"and its per-step times in the two do not overlap (every step of one beyond every step of the other)"
             if c.spread_checked else
             f"(one profiled step varies by 10-20% on a busy host; with {option('steps', 5)} on both, an op is also "
             "checked against its step-to-step spread)")
    return (f"Each op's {'device self time' if c.on_device else 'self CPU time'} (its duration minus its child ops'), "
            f"summed per op name and divided by the profile's recorded steps ({steps}); step time = mean "
            f"ProfilerStep. An op is named only when its time changed by {c.min_ratio:.2f}x or more and by at least "
            f"{MIN_SHARE:.0%} of the larger profile's op time, {noise}. An op whose child ops changed (names new "
            "under it, or gone) is judged by its total time (its duration, children included) by the same rules: its "
            "self time falls when its work moves to a new child, and rises when it takes over a gone one's. "
            f"Profile both with {option('warmup', 1)} "
            "where the code had not run before: a first run holds one-time setup (oneDNN/cuDNN, allocator growth) "
            "that the other may not. The two profiles ran at different moments: other programs' load is in one "
            "and not the other.")


# "calls per step": a trial read "1" beside a profile of 2 steps as the profile's count
_HEADERS = ["op", "category", "calls per step", "{a}", "{b}", "ratio", "change"]


def _top(c) -> int:
    return c.after.options.top or 15  # as many rows as the profile's own table (--top)


def _rows(c) -> list[list[str]]:
    def calls(r):
        x, y = (f"{v:g}" for v in (r["before_calls"], r["after_calls"]))
        return x if x == y else f"{x} -> {y}"

    def ratio(r):
        # "from 0" is for an op both ran; one only one profile ran has no ratio (a review: "from 0" beside "-")
        if not (r["before_calls"] and r["after_calls"]):
            return "-"
        if c.judged_by_total(r):  # as the findings judge it: its self ratio ("980x faster") is not the op's
            return f"{_ratio(r['before_total_us'], r['after_total_us'])} in total"
        return _ratio(r["before_us"], r["after_us"])
    return [[r["name"], r["category"], calls(r), _time(r["before_us"]) if r["before_calls"] else "-",
             _time(r["after_us"]) if r["after_calls"] else "-", ratio(r), _change(r["change_us"])]
            for r in c.rows[:_top(c)]]


def _headers(c) -> list[str]:
    return [h.format(a=c.labels[0], b=c.labels[1]) for h in _HEADERS]


def _every_op(c) -> str:
    # in a notebook "result" was the profile -r stored, whose .ops is its own table (a trial)
    where = "every op: nbaccel.compare_profiles(...).ops" if c.made_by.startswith("%%") else "every op in result.ops"
    note = first_run_note(c)  # the table's ratios read "faster" too
    return where + (f"; {note}" if note else "")


def text(c) -> str:
    out = [prose(title(c)), figures(summary_items(c)), ""]
    out += [labelled("  - ", line) for line in finding_lines(c)]
    out += ["", f"ops by change per step ({min(_top(c), len(c.rows))} of {len(c.rows)}; {_every_op(c)}):",
            text_table(_headers(c), _rows(c), left=(0, 1)), "", labelled("method: ", method(c))]
    return "\n".join(out)


def html(c) -> str:
    kpis = "".join(f'<span class="kpi">{esc(k)}<br><b>{esc(v)}</b></span>' for k, v in summary_items(c))
    findings = "<ul>" + "".join(f"<li>{esc(line)}</li>" for line in finding_lines(c)) + "</ul>"
    rows = table(_headers(c), _rows(c), name_columns=(0,), text_columns=(1,))
    return wrap(f"<h4>{esc(title(c))}</h4><div>{kpis}</div>{findings}"
                f"<div class='muted'>ops by change per step ({min(_top(c), len(c.rows))} of {len(c.rows)}; "
                f"{esc(_every_op(c))})</div>{rows}<p class='muted'>{esc(method(c))}</p>")


def widget(c):
    import ipywidgets as w

    return w.HTML(html(c))
