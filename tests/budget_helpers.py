"""What the budget-under-a-harness tests share: a budget just above the process's memory now, and the
text a cell displayed."""

from __future__ import annotations

from nbaccel.memory import current_rss

MB = 2**20


def budget_just_above_now(extra_mb: int) -> str:
    return f"{(current_rss() + extra_mb * MB) // MB}MB"


def displayed_texts(captured) -> str:
    return "\n".join(o.data.get("text/plain", "") for o in captured.outputs)
