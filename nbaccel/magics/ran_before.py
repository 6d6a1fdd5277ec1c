"""Whether a measuring magic's cell code ran before in this session: how a profile knows it is a first run.

A code's first run in a process pays one-off setup that later runs do not: oneDNN primitives and
cuDNN/cuBLAS handles made for its shapes and dtypes, the caching allocator's first blocks, lazy
imports, an optimizer's state. A trial stored ``%%profile_gpu -r a`` of a model's first run and
``--compare a`` of the same code read "14.2x faster". Nothing in the trace tells that setup apart
from the ops' own time, so the signal is the session's record of what ran:

* a plain cell (or the body of another cell magic, ``%%time``) in IPython's input history whose
  lines hold the cell's lines: the code ran, without an autocast recipe;
* an earlier ``%%profile_gpu`` or ``%%amp`` cell with the same lines, under the same recipe: these
  are read from `remember`'s record, not the history, because the recipe is in their options
  (a warm fp32 step's first run under ``--amp bf16`` read 5.3x slower, then 1.0x on the next run:
  bf16's primitives are set up anew).

Lines are compared stripped of indentation, comments and a leading assignment to plain names
(``loss = train_step()`` ran as ``train_step()``), blank lines dropped, so a cell that ran inside
an earlier cell's loop counts as run. It can be wrong both ways -- the same text over new
shapes, or a first run that is already warm through other code -- which is why a comparison says
"likely" and names the way to be sure (``--warmup 1``).
"""

from __future__ import annotations

import re

# (lines, recipe label or None) of every measuring-magic cell that ran in this process. Module-level on
# purpose: the setup it stands for (oneDNN's cache, the allocator) is the process's, and survives
# %reload_ext and %reset as the process does.
_ran: set[tuple[tuple[str, ...], str | None]] = set()

_OWN_MAGIC = re.compile(r"\A\s*%%(profile_gpu|amp)(?![\w-])")


# A trailing comment: a '#' after whitespace with no quote after it (one inside a string has its closing quote after it)
_TRAILING_COMMENT = re.compile(r"\s+#[^'\"]*$")


# A line's leading assignment to plain names (``loss = ``, ``a, b = ``; not ``==``, ``+=`` or ``x[0] =``): dropped,
# so that ``loss = train_step()`` matches a setup cell's ``train_step()`` (a trial's comparison called that profile
# a first run); it is the expression that runs.
_ASSIGNED_TO = re.compile(r"^[A-Za-z_]\w*(\s*,\s*[A-Za-z_]\w*)*\s*=(?!=)\s*")


def code_lines(source: str) -> tuple[str, ...]:
    """The lines that run, as compared: stripped, without blank and comment-only lines and trailing comments,
    and without a leading assignment to plain names (`_ASSIGNED_TO`)."""
    lines = (_ASSIGNED_TO.sub("", _TRAILING_COMMENT.sub("", line).strip()) for line in source.splitlines())
    return tuple(s for s in lines if s and not s.startswith("#"))


def _holds(outer: tuple[str, ...], inner: tuple[str, ...]) -> bool:
    n = len(inner)
    return n > 0 and any(outer[i:i + n] == inner for i in range(len(outer) - n + 1))


def _history_code(raw: str) -> tuple[str, ...]:
    """What a history entry ran: the cell, or a cell magic's body (its first line is the magic's)."""
    text = raw.lstrip("\n")
    if text.startswith("%%"):
        text = text.partition("\n")[2]
    return code_lines(text)


def ran_before(shell, cell: str, recipe: str | None) -> bool:
    """Whether ``cell``'s code ran earlier in this session under ``recipe`` (None: no autocast recipe)."""
    lines = code_lines(cell)
    if any(r == recipe and _holds(seen, lines) for seen, r in _ran):
        return True
    if recipe is not None:
        return False
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None) or []
    # this magic's own cells are in the record with their recipe (and the running cell is the last entry)
    return any(_holds(_history_code(raw), lines) for raw in history if not _OWN_MAGIC.match(raw))


def remember(cell: str, *recipes: str | None) -> None:
    """Record that ``cell`` ran under each of ``recipes``."""
    lines = code_lines(cell)
    for recipe in recipes:
        _ran.add((lines, recipe))
