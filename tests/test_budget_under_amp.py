"""A budget watching a cell that %%amp (or compare_amp) runs: the peak is of the comparison's runs
beside its host snapshot, not of one plain run (a user trial: a step that added 64 MiB added 271 MiB
under %%amp, and --strict failed a "Run All" for a step that fits). Reported, not failed."""

from __future__ import annotations

import warnings

import pytest
import torch

import nbaccel
from nbaccel.memory import current_rss, take_harness
from budget_helpers import MB, _no_stale_notes, budget_just_above_now, displayed_texts  # noqa: F401 - an autouse fixture
from text_helpers import unfolded


SETUP = """
import torch
model = torch.nn.Linear(2048, 2048)   # 16 MiB of weights: the snapshot copies them
x = torch.randn(64, 2048)
"""
STEP = "%%amp --repeat 3 -q\nbig = torch.ones(40_000_000)  # 153 MiB\nmodel(x).sum()"


def test_strict_budget_reports_a_cell_under_amp_and_does_not_fail_it(run_cell, ip):
    run_cell(SETUP)
    run_cell(f"%memory_budget {budget_just_above_now(60)} --strict -q -r budget")
    result, captured = run_cell(STEP)  # fails the test if the cell was marked failed
    assert result.success
    text = unfolded(displayed_texts(captured))
    assert "WARNING: over the memory budget" in text
    assert "the cell ran under %%amp" in text and "host snapshot of your state" in text
    assert "a strict budget does not fail it" in text and "this cell is marked as failed" not in text
    row = ip.user_ns["budget"].history.iloc[-1]
    assert row["status"] == "over" and row["measured_under"] == "%%amp" and row["harness_bytes"] >= 16 * MB
    # the same step run plainly is held to the strict budget
    run_cell("del big")
    result, _ = run_cell("big = torch.ones(40_000_000)", expect_error=RuntimeError)
    assert type(result.error_in_exec).__name__ == "BudgetExceeded"
    run_cell("%memory_budget off")


def test_a_plain_cell_after_an_amp_cell_is_not_said_to_run_under_it(run_cell, ip):
    run_cell(SETUP)
    run_cell("%memory_budget 0.9 -q -r budget")
    run_cell("%%amp --repeat 3 -q\nmodel(x).sum()")
    run_cell("y = 1")
    history = ip.user_ns["budget"].history
    assert history["measured_under"].iloc[-2] == "%%amp" and history["measured_under"].isna().iloc[-1]
    run_cell("%memory_budget off")


def test_a_script_block_around_compare_amp_warns_instead_of_raising():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    budget = nbaccel.memory_budget(current_rss() + 2 * MB, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with budget:
            big = torch.ones(20_000_000)  # 76 MiB held through the comparison
            nbaccel.compare_amp(lambda: model(x).sum(), dtype="bf16", device="cpu", repeat=3, warmup=0)
            del big
    assert any("the cell ran under compare_amp" in str(w.message) for w in caught)
    assert budget.history.iloc[-1]["measured_under"] == "compare_amp"
    assert take_harness() == (None, 0)  # the watcher took the note


def test_comparisons_without_a_budget_leave_one_note_not_a_growing_list():
    x = torch.randn(8, 8)
    for _ in range(3):
        nbaccel.compare_amp(lambda: x @ x, dtype="bf16", device="cpu", repeat=3, warmup=0)
    who, nbytes = take_harness()
    assert who == "compare_amp" and nbytes > 0
    assert take_harness() == (None, 0)
