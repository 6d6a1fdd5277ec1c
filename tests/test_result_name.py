"""-r NAME must not replace a variable the cell itself assigns (a user trial: `%%amp -r loss` over
`loss = ...` left an AmpResult in `loss`, and the next `loss.backward()` failed)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

MAGICS = ["%%amp --repeat 3 -q", "%%profile_gpu -q"]


@pytest.mark.parametrize("magic", MAGICS)
@pytest.mark.parametrize("cell, line", [
    ("loss = x.sum()\nloss", 1),
    ("y = 1\nfor loss in [x.sum()]:\n    pass", 2),
    ("with open(__file__) as loss:\n    pass", 1),
    ("import math as loss", 1),
    ("def loss():\n    return 1", 1),
    ("(loss := x.sum())", 1),
    ("a, (b, loss) = 1, (2, 3)", 1),
    ("loss += 1", 1),
])
def test_a_result_name_the_cell_assigns_is_refused_before_the_cell_runs(run_cell, ip, magic, cell, line):
    run_cell("import torch\nx = torch.ones(3)\nloss = 'before'\nran = []")
    result, _ = run_cell(f"{magic} -r loss\nran.append(1)\n{cell}", expect_error=UsageError)
    message = str(result.error_in_exec)
    assert "would replace the variable 'loss' that the cell assigns" in message
    assert f"(line {line + 1})" in message and "-r loss_result" in message
    assert ip.user_ns["loss"] == "before" and ip.user_ns["ran"] == []


@pytest.mark.parametrize("magic", MAGICS)
def test_a_name_only_a_function_or_comprehension_in_the_cell_binds_is_free(run_cell, ip, magic):
    run_cell("import torch\nx = torch.ones(3)")
    run_cell(f"{magic} -r loss\ndef f():\n    loss = x.sum()\n    return loss\n[loss for loss in range(2)]\nf()")
    assert type(ip.user_ns["loss"]).__name__ in ("AmpResult", "ProfileResult")
