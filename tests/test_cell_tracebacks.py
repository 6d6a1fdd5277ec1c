"""A cell that raises under a magic shows the user's own lines, labelled with the cell's number.

IPython 9 advances ``execution_count`` before it runs a cell; a magic that compiled its cell
body with that count labelled the failing line ``Cell In[n+1]`` -- a cell that does not exist yet.
"""

from __future__ import annotations

import re

import pytest

CELLS = {
    "amp": "%%amp --repeat 1 --warmup 0\nimport torch\na = torch.ones(3)\nraise ValueError('boom')\n",
    "profile_gpu": "%%profile_gpu -q\nimport torch\na = torch.ones(3)\nraise ValueError('boom')\n",
}


@pytest.mark.parametrize("magic", sorted(CELLS))
def test_failing_line_is_labelled_with_this_cells_number(run_cell, magic):
    run_cell("x = 1")  # the failing cell is not the first, so an off-by-one label shows
    result, captured = run_cell(CELLS[magic], expect_error=ValueError)
    labels = re.findall(r"Cell In\[(\d+)\], line (\d+)", captured.stdout)
    assert labels, captured.stdout
    # The user's raising line (line 3 of the body) is shown, under this cell's number.
    assert (str(result.execution_count), "3") in labels, labels
    assert {int(n) for n, _ in labels} == {result.execution_count}, labels
    assert "raise ValueError('boom')" in captured.stdout
    assert "contextlib" not in captured.stdout  # no frame of nbaccel's own decorators
