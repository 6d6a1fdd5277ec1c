"""Small helpers shared by the renderers: HTML escaping, tables with bars, the stylesheet; plain-text
tables and prose folded for a terminal (`text_table`, `prose`)."""

from __future__ import annotations

import html as _html
import re
import textwrap

# Secondary text fades the theme's own text colour (opacity) rather than naming a grey: #777 read at 4.5:1 on
# white and 4.2:1 on JupyterLab's dark background (a trial), under WCAG's 4.5:1 for body text. The warning
# colour has a dark-theme variant (JupyterLab marks its theme on <body>, VS Code by class); both keep 4.5:1.
CSS = """
<style>
.nbaccel {font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px; line-height: 1.4;
  max-width: min(1100px, 100%); box-sizing: border-box; overflow-wrap: break-word}
.widget-html-content:has(> .nbaccel) {flex-shrink: 1; min-width: 0; max-width: 100%}
.nbaccel h4 {margin: 4px 0 6px 0}
.nbaccel .scroll {overflow-x: auto; max-width: 100%}
.nbaccel .scroll.tall {max-height: 420px; overflow-y: auto}
.nbaccel table {border-collapse: collapse; margin: 4px 0}
.nbaccel th, .nbaccel td {padding: 2px 8px; text-align: right; border-bottom: 1px solid var(--jp-border-color2, #ddd);
  vertical-align: top; white-space: nowrap}
.nbaccel th {cursor: default; background: rgba(127,127,127,0.08); white-space: normal; min-width: 4.5em}
.nbaccel td.name, .nbaccel th.name {text-align: left; white-space: normal; overflow-wrap: break-word; min-width: 16em;
  max-width: 48em; font-family: var(--jp-code-font-family, monospace)}
.nbaccel td.text, .nbaccel th.text {text-align: left; white-space: normal}
.nbaccel th.sorted {text-decoration: underline}
.nbaccel table.fixed {table-layout: fixed; width: 100%}
.nbaccel table.fixed td {white-space: normal; min-width: 0; max-width: none}
.nbaccel.fill {max-width: none}
.widget-html-content:has(> .nbaccel.fill) {flex: 1 1 auto; width: 100%}
.nbaccel-profile .jupyter-button.nbaccel-th {height: auto; min-height: var(--jp-widgets-inline-height, 28px);
  margin: 0; padding: 2px 8px; white-space: normal; overflow: visible; text-overflow: clip;
  overflow-wrap: break-word; line-height: 1.3; text-align: right; font-weight: 600; border-radius: 0}
.nbaccel-profile .jupyter-button.nbaccel-th.text {text-align: left}
.nbaccel-profile .jupyter-button.nbaccel-th.sorted {text-decoration: underline}
.nbaccel .big {font-size: 22px; font-weight: 600}
.nbaccel .muted {opacity: 0.72}
.nbaccel .warn {color: #a65200}
body[data-jp-theme-light="false"] .nbaccel .warn, body.vscode-dark .nbaccel .warn,
body.vscode-high-contrast .nbaccel .warn {color: #f2a65a}
.nbaccel .bar {display: inline-block; height: 9px; background: #4a90d9; vertical-align: middle}
.nbaccel .kpi {display: inline-block; margin-right: 28px; vertical-align: top}
.nbaccel ul {margin: 2px 0 2px 18px; padding: 0}
.nbaccel details {margin: 6px 0}
.nbaccel details > summary {cursor: pointer; font-weight: 600}
.nbaccel-amp .widget-tab > .lm-TabBar, .nbaccel-profile .widget-tab > .lm-TabBar,
.nbaccel-amp .widget-tab > .lm-TabBar > .lm-TabBar-content,
.nbaccel-profile .widget-tab > .lm-TabBar > .lm-TabBar-content {height: auto; flex-wrap: wrap}
.nbaccel-amp .widget-tab > .lm-TabBar .lm-TabBar-tab,
.nbaccel-profile .widget-tab > .lm-TabBar .lm-TabBar-tab {flex: 0 0 auto; min-width: max-content}
</style>
"""


def esc(value) -> str:
    return _html.escape(str(value))


def bar(fraction: float, width: int = 80) -> str:
    fraction = 0.0 if fraction is None or fraction != fraction else max(0.0, min(1.0, fraction))
    return f'<span class="bar" style="width:{fraction * width:.0f}px"></span>'


_BREAK_AFTER = re.compile(r"(::|_|\.|/|,|<)")


def breakable(name) -> str:
    """Escaped, with a line-break opportunity after ``::``, ``_``, ``.``, ``/``, ``,`` and ``<``: a long
    code name wraps as "aten::max_pool2d_with_indices_<br>backward", not "...backwa<br>rd"."""
    marked = _BREAK_AFTER.sub("\\1\0", str(name))  # a NUL marks each place; escaping leaves it alone
    return esc(marked).replace("\0", "<wbr>")


def table(headers: list[str], rows: list[list], name_columns=(0,), raw_columns=(), tall: bool = False,
          text_columns=(), sorted_column: tuple[int, bool] | None = None, empty: str | None = None,
          widths: list[str | None] | None = None, head: bool = True) -> str:
    """An HTML table; cells in ``raw_columns`` are inserted as HTML, the rest escaped.

    Numbers never wrap. ``name_columns`` hold code names (operators, kernels, variables): left,
    in code font, at least 16em wide and wrapping after ``::``/``_``/``.`` (`breakable`), so in a
    narrow window the table scrolls sideways instead of breaking "operator" into "ope/rat/or".
    ``text_columns`` hold words (a recipe, a status): left-aligned, wrapping as prose. ``tall``: at
    most 420 px high, scrolling (kernel names are C++ templates hundreds of characters long).
    ``sorted_column``: (index, ascending) marks the header the rows are sorted by. ``empty``: what
    one row says when there are none (a filter that matched nothing). ``widths``: one CSS width per
    column (None: an equal share of what the others leave), laid out with ``table-layout: fixed`` over
    the whole width, so columns stay where a row of controls drawn above the table puts its headers
    (the profiler widget's header buttons: `column_widths`); ``head=False`` leaves out the <thead>
    those controls stand in for.
    """
    def kind(i: int) -> str:
        return "name" if i in name_columns else "text" if i in text_columns else ""

    heads = []
    for i, h in enumerate(headers):
        label, cls = esc(h), kind(i)
        if sorted_column is not None and sorted_column[0] == i:
            label += " \u25b2" if sorted_column[1] else " \u25bc"
            cls += " sorted"
        heads.append(f'<th class="{cls.strip()}">{label}</th>')
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            content = cell if i in raw_columns else breakable(cell) if i in name_columns else esc(cell)
            cells.append(f'<td class="{kind(i)}">{content}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    if not rows and empty:
        body.append(f'<tr><td class="text muted" colspan="{len(headers)}">{esc(empty)}</td></tr>')
    thead = f'<thead><tr>{"".join(heads)}</tr></thead>' if head else ""
    if widths is None:
        return (f'<div class="scroll{" tall" if tall else ""}"><table>{thead}'
                f"<tbody>{''.join(body)}</tbody></table></div>")
    cols = "".join(f'<col style="width:{w}">' if w else "<col>" for w in widths)
    return (f'<div class="scroll{" tall" if tall else ""}"><table class="fixed"><colgroup>{cols}</colgroup>{thead}'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def bullet_list(items) -> str:
    return "<ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>" if items else ""


def method_html(method: str, before: str = "") -> str:
    """A report's method folded under "How these figures were measured" (``before``: HTML over it in the fold,
    e.g. the trace line): a %%profile_gpu page ended in 13-16 lines of it, between the user and the next cell."""
    return folded("How these figures were measured", f'<div class="muted">{before}method: {esc(method)}</div>')


def folded(summary: str, inner: str, open_: bool = False) -> str:
    """A section a reader opens when they want it (HTML ``<details>``, which JupyterLab, VS Code, nbviewer and
    GitHub all show folded): the how-it-was-measured prose under the figures, so the figures come first."""
    return f'<details{" open" if open_ else ""}><summary>{esc(summary)}</summary>{inner}</details>'


def wrap(inner: str, cls: str = "") -> str:
    return CSS + f'<div class="nbaccel{" " + cls if cls else ""}">{inner}</div>'


def text_table(headers: list[str], rows: list[list], left=(0,)) -> str:
    """Fixed-width text table; no cell is truncated. Columns in ``left`` are left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        # rstrip: a left-aligned last column padded every line with trailing spaces (a terminal trial)
        lines.append("  ".join(c.ljust(w) if i in left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# Plain text is read in terminals (`python -m nbaccel trace PATH`, `print(result)` in a script, logs), where a
# 600-character method line was one huge line. Prose is folded at this width; a table row never is: a table
# is aligned columns, one line per row, and a folded row would break every column under it.
TEXT_WIDTH = 100


def prose(line: str, hang: int = 4) -> str:
    """One line of free text (a method, an advice, a note, a list entry) folded at `TEXT_WIDTH` columns,
    each further line indented ``hang`` spaces past the line's own indent: a folded note never reads as
    the next note, nor as an entry of the list under it (entries are indented 2, so a note's further
    lines are at 4 and an entry's at 6). A line that fits comes back as it was. Words are never split,
    nor at hyphens (``--repeat``, ``AMX/AVX512-BF16``): a path or an op name longer than the width stays
    whole on its own line."""
    if len(line) <= TEXT_WIDTH:
        return line
    indent = line[:len(line) - len(line.lstrip(" "))]
    return textwrap.fill(line.strip(), TEXT_WIDTH, initial_indent=indent, subsequent_indent=indent + " " * hang,
                         break_long_words=False, break_on_hyphens=False)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 cell``, ``2 cells``; ``words`` where adding an s is wrong."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def note_on_stderr(text: str) -> None:
    """A note beside a magic's output (a failure, a Ctrl-C, long work in progress) on stderr, each line
    folded as `prose` folds it: a terminal showed a 361-character note as one line (a trial), and a
    script's log reads the same. Flushed: the work or the traceback it announces comes next."""
    import sys

    print("\n".join(prose(line) for line in text.split("\n")), file=sys.stderr, flush=True)


def figures(items) -> str:
    """``key: value`` pairs joined by " | ", a new line (indented 2) begun between pairs, never inside one,
    where the next pair would pass `TEXT_WIDTH`: a report's line of figures stays a row of figures."""
    lines = [""]
    for key, value in items:
        part = f"{key}: {value}"
        if lines[-1] and len(lines[-1]) + 3 + len(part) > TEXT_WIDTH:
            lines.append("  " + part)
        else:
            lines[-1] = f"{lines[-1]} | {part}" if lines[-1] else part
    return "\n".join(lines)


def labelled(label: str, text: str) -> str:
    """``label + text`` as `prose`, further lines aligned under the text, so a bullet's label stands out:
    ``labelled("advice: ", ...)``, ``labelled("  - ", ...)``."""
    return prose(label + text, hang=len(label.lstrip(" ")))


def si(value, unit: str) -> str:
    """``1.31e12, "FLOP/s"`` -> ``"1.31 TFLOP/s"``; ``-`` for a missing value."""
    if value is None or value != value:
        return "-"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_share(fraction: float, digits: int = 1) -> str:
    """A share as nbaccel quotes it: "12.3%" (``digits`` decimals), never rounded to a "0.0%" that
    reads as none or a "100.0%" that reads as all unless it is: "<0.1%", 399 of 400 at ``digits=0``
    "99.8%" (one more decimal before giving up), 3999.9 of 4000 ">99.9%"."""
    if fraction == 0:
        return "0%"
    if fraction == 1:
        return f"{fraction:.{digits}%}"
    for places in range(digits, max(digits, 1) + 1):
        text = f"{fraction:.{places}%}"
        if text not in (f"{0:.{places}%}", f"{1:.{places}%}"):
            return text
    return "<0.1%" if fraction < 0.5 else ">99.9%"
