"""Reading plain-text reports in tests.

A text report folds its prose at 100 columns (`nbaccel.render.common.prose`), so a phrase of prose
(a method, an advice, a warning, a note) may span a line break and its hanging indent. Table rows are
never folded: search those as they are.
"""

from __future__ import annotations


def unfolded(text: str) -> str:
    """``text`` with every run of whitespace made one space: a phrase of prose is found wherever it was folded."""
    return " ".join(str(text).split())


def note_lines(text: str) -> list[str]:
    """The notes of a stderr text, one per item, each unfolded: a note folded by
    `nbaccel.render.common.note_on_stderr` continues on lines indented past its first."""
    notes: list[str] = []
    for line in str(text).splitlines():
        if line[:1].isspace() and notes:
            notes[-1] += " " + line.strip()
        else:
            notes.append(line)
    return [unfolded(n) for n in notes]
