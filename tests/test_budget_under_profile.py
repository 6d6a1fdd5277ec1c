"""A budget watching a cell that %%profile_gpu (or nbaccel.profile) profiles on the CPU: the process's
peak includes the events the profiler keeps in memory (a user trial: a CNN step added 120 MiB plainly,
180 MiB under %%profile_gpu, 494 MiB with --memory --warmup 1 --steps 3, and under a 400MiB budget the
profiled cell got a plain "over ... lower the batch"). Said, as a cell under %%amp is, and not failed."""

from __future__ import annotations

import warnings

import pytest
import torch

import nbaccel
from nbaccel.memory import current_rss, take_harness
from budget_helpers import MB, _no_stale_notes, budget_just_above_now, displayed_texts  # noqa: F401 - an autouse fixture
from text_helpers import unfolded

STEP = "big = torch.ones(40_000_000)  # 153 MiB\n(big * 2).sum()"


def test_strict_budget_says_a_profiled_cell_holds_the_profilers_events_and_does_not_fail_it(run_cell, ip):
    run_cell("import torch")
    run_cell(f"%memory_budget {budget_just_above_now(60)} --strict -q -r budget")
    result, captured = run_cell(f"%%profile_gpu -q --memory\n{STEP}")  # fails the test if marked failed
    assert result.success
    text = unfolded(displayed_texts(captured))
    assert "WARNING: over the memory budget" in text
    assert ("the cell ran under %%profile_gpu, so this peak includes the profiler's own memory: it keeps every "
            "recorded event") in text
    assert "more with --memory, --stack and more --warmup/--steps" in text
    assert "a strict budget does not fail it" in text and "this cell is marked as failed" not in text
    assert "fp32 and reduced-precision runs" not in text  # %%amp's words are not the profiler's
    history = ip.user_ns["budget"].history
    assert history["measured_under"].iloc[-1] == "%%profile_gpu" and history["status"].iloc[-1] == "over"
    run_cell("del big")
    run_cell("y = 1")  # a plain cell after it is not said to run under it
    assert ip.user_ns["budget"].history["measured_under"].isna().iloc[-1]
    run_cell("%memory_budget off")


def test_a_script_block_around_nbaccel_profile_warns_in_the_profilers_words():
    budget = nbaccel.memory_budget(current_rss() + 2 * MB, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with budget:
            with nbaccel.profile(device="cpu", stack=True) as prof:
                big = torch.ones(20_000_000)
                (big * 2).sum()
            del big
    said = [str(w.message) for w in caught if isinstance(w.message, nbaccel.BudgetWarning)]
    assert any("the cell ran under nbaccel.profile" in m and "memory=True, stack=True and more warmup/steps" in m
               for m in said), said
    assert budget.history.iloc[-1]["measured_under"] == "nbaccel.profile" and prof.result is not None
    assert take_harness() == (None, 0)  # the watcher took the note
