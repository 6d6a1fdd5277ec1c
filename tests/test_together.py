"""The magics together: budget watching amp and profile, inside %%capture and %%time, side by side."""

from __future__ import annotations

import torch

import nbaccel
from nbaccel.render import display as display_module

SETUP = """
import torch, types
box = types.SimpleNamespace(runs=0)
model = torch.nn.Linear(64, 64)
x = torch.randn(32, 64)
"""


def test_budget_counts_an_amp_cell_once_not_once_per_run(ip, run_cell):
    run_cell(SETUP)
    run_cell("%memory_budget 8GiB -q")
    try:
        run_cell("%%amp --repeat 3 --warmup 1 -q\nbox.runs += 1\nmodel(x).sum()")
        run_cell("%%profile_gpu --amp bf16 --steps 2 -q\nbox.runs += 1\nmodel(x).sum()")
        _, captured = run_cell("%memory_budget -r status")
        history = ip.user_ns["status"].history
    finally:
        run_cell("%memory_budget off -q")
    assert ip.user_ns["box"].runs > 3  # many measured runs happened ...
    # ... yet each cell is one row of the budget's history: the amp cell and the profile cell, not one
    # row per measured run (nor one for the status cell, which asks about them).
    assert len(history) == 2, history
    assert (history["status"] == "ok").all()


def test_magics_inside_capture(ip, run_cell):
    run_cell(SETUP)
    run_cell("%%capture cap\n%%amp --repeat 1 --warmup 0 -r res\nprint('hello')\nmodel(x).sum()")
    cap = ip.user_ns["cap"]
    assert "hello" in cap.stdout
    assert any("speedup" in o.data.get("text/plain", "") for o in cap.outputs)
    assert ip.user_ns["res"].speedup is not None


def test_time_around_the_python_api(ip, run_cell):
    run_cell(SETUP)
    run_cell("import nbaccel")
    _, captured = run_cell("%%time\nr = nbaccel.compare_amp(lambda: model(x).sum(), repeat=1, warmup=0)\n"
                           "p = None\nwith nbaccel.profile() as prof:\n    model(x).sum()\n")
    assert "Wall time" in captured.stdout
    assert ip.user_ns["prof"].result.ops.shape[0] > 0


def test_load_unload_load_again(ip, run_cell):
    run_cell(SETUP)
    run_cell("%memory_budget 8GiB -q")
    ip.run_line_magic("unload_ext", "nbaccel")
    assert not [cb for cb in ip.events.callbacks["post_run_cell"] if "nbaccel" in getattr(cb, "__module__", "")]
    ip.run_line_magic("load_ext", "nbaccel")
    run_cell("%%amp --repeat 1 --warmup 0 -q -r again\nmodel(x).sum()")
    assert ip.user_ns["again"].amp.name == "bf16"


def test_two_results_side_by_side(ip, run_cell, monkeypatch):
    monkeypatch.setattr(display_module, "WIDGETS", "always")
    model, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    bf16 = nbaccel.compare_amp(lambda: model(x).sum(), dtype="bf16", repeat=1, warmup=0)
    with nbaccel.profile() as prof:
        model(x).sum()
    row = nbaccel.side_by_side(bf16, prof.result)
    bundle = row._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"].count("nbaccel") >= 2 and "speedup" in bundle["text/html"]
    assert "aten::" in bundle["text/plain"] and "speedup" in bundle["text/plain"]
    assert len(row.widget().children) == 2
