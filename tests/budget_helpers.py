"""What the budget-under-a-harness tests share: a budget just above the process's memory now, the text a
cell displayed, and no harness note left over from another test (import `_no_stale_notes`: autouse)."""

from __future__ import annotations

import pytest

from nbaccel.memory import current_rss, take_harness

MB = 2**20


def budget_just_above_now(extra_mb: int) -> str:
    return f"{(current_rss() + extra_mb * MB) // MB}MB"


def displayed_texts(captured) -> str:
    return "\n".join(o.data.get("text/plain", "") for o in captured.outputs)


@pytest.fixture(autouse=True)
def _no_stale_notes():
    take_harness()
    yield
    take_harness()
