"""A measuring magic inside another is refused: the outer one runs its cell several times and
measures every run, so the inner one would be run and measured as its code (a user trial: %%amp
inside %%amp ran 15 x 15 cells and showed two meaningless reports)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

SETUP = "import torch\nx = torch.randn(64, 64)\nruns = []"


@pytest.mark.parametrize("outer, inner, fix", [
    ("%%amp --repeat 3", "%%amp --repeat 3", "remove one of the two %%amp lines"),
    ("%%amp --repeat 3", "%%profile_gpu", "use %%profile_gpu --amp bf16"),
    ("%%profile_gpu", "%%amp --repeat 3", "use %%profile_gpu --amp bf16"),
    ("%%profile_gpu", "%%profile_gpu", "remove one of the two %%profile_gpu lines"),
])
def test_written_as_the_cells_first_line_it_is_refused_before_anything_runs(run_cell, ip, outer, inner, fix):
    run_cell(SETUP)
    result, captured = run_cell(f"{outer}\n\n{inner}\nruns.append(1)\nx @ x", expect_error=UsageError)
    message = str(result.error_in_exec)
    outer_name, inner_name = outer.split()[0], inner.split()[0]
    assert message.startswith(f"{inner_name} cannot run inside {outer_name}") and fix in message, message
    # Nothing ran, and no note explains a run: the refusal is all.
    assert ip.user_ns["runs"] == [] and captured.stderr.strip() == f"UsageError: {message}"


@pytest.mark.parametrize("outer", ["%%amp --repeat 3 --warmup 0", "%%profile_gpu"])
def test_started_from_the_cells_code_it_is_refused_when_reached(run_cell, ip, outer):
    run_cell(SETUP)
    result, _ = run_cell(f"{outer}\nruns.append(1)\nget_ipython().run_cell_magic('amp', '--repeat 3', 'x @ x')",
                         expect_error=UsageError)
    assert str(result.error_in_exec).startswith(f"%%amp cannot run inside {outer.split()[0]}")
    # Not left behind: the magics run as before.
    run_cell("%%amp --repeat 3 -q\nx @ x")
    run_cell("%%profile_gpu -q\nx @ x")


def test_only_the_measuring_magics_themselves_are_refused(run_cell, ip):
    run_cell(SETUP)
    # %%amp-x is another magic's name (IPython would look up "amp-x"): not taken for %%amp
    result, _ = run_cell("%%profile_gpu -q\n%%amp-x\nruns.append(1)", expect_error=BaseException)
    assert "cannot run inside" not in str(result.error_in_exec or result.error_before_exec)
    run_cell("%%amp --repeat 3 -q\n# %%amp in a comment is not a magic\nx @ x")


def test_a_magic_that_failed_does_not_block_the_next_one(run_cell):
    run_cell(SETUP)
    run_cell("%%amp --repeat 3 -q\n1 / 0", expect_error=ZeroDivisionError)
    run_cell("%%profile_gpu -q\n1 / 0", expect_error=ZeroDivisionError)
    run_cell("%%amp --repeat 3 -q\nx @ x")
