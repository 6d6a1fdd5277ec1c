"""-r NAME must not replace a name the cell itself uses (user trials: `%%amp -r loss` over
`loss = ...` left an AmpResult in `loss`, and the next `loss.backward()` failed; `-r model` over a
cell calling `model(x)` broke every later run)."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

MAGICS = ["%%amp --repeat 3 -q", "%%profile_gpu -q"]


@pytest.mark.parametrize("magic", MAGICS)
@pytest.mark.parametrize("cell, uses, line", [
    ("loss = x.sum()\nloss", "assigns", 1),
    ("y = 1\nfor loss in [x.sum()]:\n    pass", "assigns", 2),
    ("with open(__file__) as loss:\n    pass", "assigns", 1),
    ("import math as loss", "assigns", 1),
    ("def loss():\n    return 1", "assigns", 1),
    ("(loss := x.sum())", "assigns", 1),
    ("a, (b, loss) = 1, (2, 3)", "assigns", 1),
    ("loss += 1", "assigns", 1),
    ("match 1:\n    case loss:\n        pass", "assigns", 2),
    ("def f():\n    global loss\n    loss = 2\nf()", "assigns", 3),
    ("x.sum() + len(loss)", "uses", 1),
    ("def f():\n    return loss\nf()", "uses", 2),
])
def test_a_result_name_the_cell_uses_is_refused_before_the_cell_runs(run_cell, ip, magic, cell, uses, line):
    run_cell("import torch\nx = torch.ones(3)\nloss = 'before'\nran = []")
    result, _ = run_cell(f"{magic} -r loss\nran.append(1)\n{cell}", expect_error=UsageError)
    message = str(result.error_in_exec)
    assert f"would replace 'loss', which the cell {uses} (line {line + 1})" in message
    assert "-r loss_result" in message
    assert ip.user_ns["loss"] == "before" and ip.user_ns["ran"] == []


@pytest.mark.parametrize("magic", MAGICS)
def test_a_name_only_a_function_or_comprehension_in_the_cell_binds_is_free(run_cell, ip, magic):
    run_cell("import torch\nx = torch.ones(3)")
    run_cell(f"{magic} -r loss\ndef f():\n    loss = x.sum()\n    return loss\n[loss for loss in range(2)]\nf()")
    assert type(ip.user_ns["loss"]).__name__ in ("AmpResult", "ProfileResult")


@pytest.mark.parametrize("name", ["Out", "In", "_", "__", "_i", "_oh", "_3", "_i7", "get_ipython", "exit"])
def test_ipythons_own_names_are_refused(run_cell, ip, name):
    result, _ = run_cell(f"%%amp --repeat 3 -q -r {name}\n1 + 1", expect_error=UsageError)
    assert "IPython's own" in str(result.error_in_exec)


@pytest.mark.parametrize("magic", MAGICS)
def test_a_variable_the_cell_reaches_only_through_a_function_is_not_replaced(run_cell, ip, magic):
    """Trial 34: ``%%amp -r model`` over ``train_step()``, which reads the global ``model``: the cell's text never
    names it, ``model`` became an AmpResult, and the next step failed ("'AmpResult' object is not callable")."""
    run_cell("import torch\nmodel = torch.nn.Linear(3, 1)\ndef train_step():\n    return model(torch.ones(3))\nran = []")
    result, _ = run_cell(f"{magic} -r model\nran.append(1)\ntrain_step()", expect_error=UsageError)
    message = str(result.error_in_exec)
    assert ("-r/--result model would replace the variable 'model', which holds a Linear (not an earlier nbaccel "
            "result), and code the cell calls may read it: choose another name, e.g. -r model_result, or `del model` "
            "first") in message
    assert isinstance(ip.user_ns["model"], torch.nn.Linear) and ip.user_ns["ran"] == []
    # an earlier result under the name is replaced, as re-running the cell does; so is None
    run_cell(f"{magic} -r res\ntrain_step()")
    first = ip.user_ns["res"]
    run_cell(f"{magic} -r res\ntrain_step()")
    assert ip.user_ns["res"] is not first
    run_cell("res = None")
    run_cell(f"{magic} -r res\ntrain_step()")
    assert ip.user_ns["res"] is not None
