"""What the hidden measurement runs of %%amp and %%profile_gpu must not show or use up: logging
from every run, warnings spent in a hidden run so the shown run had none, and every run's
matplotlib figure (user trials)."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest

import nbaccel

SETUP = """
import io, logging, warnings
import torch
log_stream = io.StringIO()
log = logging.getLogger("nbaccel-trial")
log.handlers[:] = [logging.StreamHandler(log_stream)]  # keeps its stream, as basicConfig(stream=sys.stderr) does
log.setLevel(logging.INFO)
log.propagate = False
model = torch.nn.Linear(8, 2)
x = torch.randn(4, 8)
"""

CELL = """{magic}
log.info("logged by the cell")
warnings.warn("warned by the cell", UserWarning)
model(x).sum()
"""


@pytest.mark.parametrize("magic", ["%%amp --repeat 3 -q", "%%profile_gpu --warmup 1 --steps 2 -q"])
def test_a_cell_logs_once_and_its_warning_still_shows(run_cell, ip, magic):
    run_cell(SETUP)
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # once per code location, as in a kernel
        # Printed to the sys.stderr of the moment, as in a kernel (pytest records them instead),
        # so a warning a hidden run used up never reaches the cell's output.
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        _, out = run_cell(CELL.format(magic=magic))
    logged = ip.user_ns["log_stream"].getvalue()
    assert logged.count("logged by the cell") == 1, logged
    assert out.stderr.count("UserWarning: warned by the cell") == 1, out.stderr


@pytest.mark.filterwarnings("ignore:warned by the cell")  # the kept run warns, as it should
def test_the_users_own_logging_disable_level_is_put_back(run_cell):
    logging.disable(logging.WARNING)
    try:
        run_cell(SETUP)
        run_cell(CELL.format(magic="%%amp --repeat 3 -q"))
        assert logging.root.manager.disable == logging.WARNING
    finally:
        logging.disable(logging.NOTSET)


def test_compare_amp_in_a_script_hides_the_measurement_runs_logging(caplog):
    log = logging.getLogger("nbaccel-script")
    def step():
        log.warning("step logged")
        return 1.0

    with caplog.at_level(logging.WARNING, logger="nbaccel-script"):
        nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert [r.message for r in caplog.records if r.name == "nbaccel-script"] == ["step logged"]  # the kept run


def _own_silencer():
    import contextlib
    import io

    @contextlib.contextmanager
    def silence():  # a script's own: stdout only, nothing about logging or warnings
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    return silence


@pytest.mark.parametrize("api", ["compare_amp", "profile_function"])
def test_a_silencer_the_caller_passes_hides_logging_and_keeps_the_warning_too(caplog, api):
    log = logging.getLogger("nbaccel-script")

    def step():
        log.warning("step logged")
        warnings.warn("warned by the step", UserWarning)
        return 1.0

    with caplog.at_level(logging.WARNING, logger="nbaccel-script"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # once per code location: a hidden run must not use it up
        if api == "compare_amp":
            nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0, silence=_own_silencer())
        else:
            from nbaccel.profile import profile_function
            profile_function(step, warmup=1, steps=2, device="cpu", silence=_own_silencer())
    assert [r.message for r in caplog.records if r.name == "nbaccel-script"] == ["step logged"]  # the shown run
    assert [str(w.message) for w in seen if "warned by the step" in str(w.message)] == ["warned by the step"]


@pytest.mark.parametrize("magic", ["%%amp --repeat 3 --warmup 0 -q", "%%profile_gpu --warmup 1 --steps 2 -q"])
def test_only_the_shown_runs_figure_stays_open(run_cell, ip, magic):
    # A user trial: under %matplotlib inline, which shows every open figure when the cell ends,
    # the cell below showed 15 identical figures under %%amp and 3 under %%profile_gpu.
    plt = pytest.importorskip("matplotlib.pyplot")
    earlier = plt.figure()  # open before the cell: not the hidden runs' to close
    try:
        run_cell("import matplotlib.pyplot as plt\nimport torch\nraw = torch.randn(200, 3)")
        run_cell(f"{magic}\nfig, ax = plt.subplots(); ax.plot(raw[:100, 0])")
        kept = ip.user_ns["fig"]  # the shown run assigned it last
        assert plt.get_fignums() == [earlier.number, kept.number]
    finally:
        plt.close("all")


def test_compare_amp_in_a_script_leaves_the_kept_runs_figure_only():
    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []

    def step():
        figures.append(plt.figure())
        return 1.0

    try:
        nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0)
        assert plt.get_fignums() == [figures[-1].number]  # the kept run's, the last
    finally:
        plt.close("all")
