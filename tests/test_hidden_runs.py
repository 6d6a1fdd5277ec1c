"""What the hidden measurement runs of %%amp and %%profile_gpu must not show or use up: logging
from every run, warnings spent in a hidden run so the shown run had none, and every run's
matplotlib figure (user trials)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import sys
import types
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


# --- fd-level output: subprocesses, C code, os.write ------------------------------------------------

@pytest.fixture
def terminal_streams(ip, monkeypatch):
    """The shell as terminal IPython runs it: sys.stdout/sys.stderr write to fds 1 and 2 (pytest's capfd
    then sees everything at the fd), and ``!cmd`` is ``os.system``-like (ipykernel's goes through
    sys.stdout, which the capture already hides)."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        monkeypatch.setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True))
    monkeypatch.setattr(ip, "system", ip.system_raw)


FD_CELL = """{magic}
import os, subprocess
libc.fprintf(c_stdout, b"c-stdio\\n")  # C's stdio: buffered until flushed
!echo from-the-shell
subprocess.run("echo subprocess-err >&2", shell=True)
os.write(1, b"os-write-1\\n")
os.write(2, b"os-write-2\\n")
print("printed")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX shell in the cell")
@pytest.mark.parametrize("magic", ["%%amp --repeat 3 --warmup 0 -q", "%%profile_gpu --warmup 1 --steps 2 -q",
                                   "%%profile_gpu --memory --warmup 1 --steps 2 -q"])  # inside the fd-2 filter
def test_fd_output_of_the_hidden_runs_is_hidden_too(ip, terminal_streams, capfd, magic):
    # A user trial: `!echo hello-from-shell` under %%amp --repeat 3 --warmup 0 printed 15 times, the
    # cell's print once. Now every run but the kept one is hidden at the fds too.
    import ctypes

    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    # A C stream on fd 1, fully buffered (fd 1 is no terminal here) whatever PYTHONUNBUFFERED did to C's stdout.
    ip.user_ns.update(libc=libc, c_stdout=ctypes.c_void_p(libc.fdopen(1, b"w")))
    capfd.readouterr()
    result = ip.run_cell(FD_CELL.format(magic=magic), store_history=True)
    libc.fflush(None)  # the kept run's line, still in the buffer
    out, err = capfd.readouterr()
    assert result.success, (out, err)
    assert (out.count("from-the-shell"), out.count("os-write-1"), out.count("printed")) == (1, 1, 1), out
    assert out.count("c-stdio") == 1, out  # the hidden runs' lines were flushed into their file
    assert (err.count("subprocess-err"), err.count("os-write-2")) == (1, 1), err
    os.write(1, b"fd 1 is back\n")
    os.write(2, b"fd 2 is back\n")
    out, err = capfd.readouterr()
    assert (out, err) == ("fd 1 is back\n", "fd 2 is back\n")


@pytest.mark.parametrize("magic", ["%%amp --repeat 3 --warmup 0", "%%profile_gpu --warmup 1 --steps 2"])
def test_a_hidden_run_that_raises_is_still_reported_at_the_fds(ip, terminal_streams, capfd, magic):
    # The note and the traceback come after the hidden run's fds are put back: in terminal IPython
    # they are written to fds 1 and 2.
    ip.run_cell("import types\nbox = types.SimpleNamespace(runs=0)")
    capfd.readouterr()
    result = ip.run_cell(f"{magic}\nbox.runs += 1\nif box.runs == 2:\n    raise ValueError('boom in a hidden run')\n",
                         store_history=True)
    out, err = capfd.readouterr()
    assert isinstance(result.error_in_exec, ValueError)
    assert "ValueError: boom in a hidden run" in out and "raise ValueError('boom in a hidden run')" in out, out
    assert "raised ValueError in run 2 of 3" in err or "raised ValueError in the bf16 autocast run" in err, err


def test_a_failing_hidden_runs_fd_output_is_shown_after_it(ip, terminal_streams, capfd):
    # A CUDA device-side assert prints which assertion failed at fd level and raises only "device-side
    # assert triggered"; %%amp's first run is a hidden one, so that message was dropped with the run.
    ip.run_cell("import os, types\nbox = types.SimpleNamespace(runs=0)")
    capfd.readouterr()
    result = ip.run_cell("%%amp --repeat 3 --warmup 0\nbox.runs += 1\nos.write(2, b'Assertion `t < n_classes` "
                         "failed.\\n')\nif box.runs == 2:\n    raise RuntimeError('device-side assert triggered')\n")
    out, err = capfd.readouterr()
    assert isinstance(result.error_in_exec, RuntimeError)
    assert err.count("Assertion `t < n_classes` failed.") == 1, err  # run 1 ran fine (hidden), run 2 failed: shown
    assert "nbaccel: the failing hidden run wrote this (its fd 1 and 2 output):\nAssertion `t < n_classes` failed.\n" \
        in err
    leftover = [f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"nbaccel-hidden-run-{os.getpid()}-")]
    assert not leftover  # removed after each hidden run


@pytest.mark.parametrize("magic, run", [("%%amp --repeat 3 --warmup 0", "fp32 run"),
                                        ("%%profile_gpu --warmup 1 --steps 2", "run 2 of 3")])
def test_what_a_failing_hidden_run_printed_is_shown_as_a_plain_cell_shows_it(run_cell, ip, magic, run):
    """A trial: print("got here") before a shape mismatch vanished under both magics, which read as if
    the line before it never finished. The runs that succeed stay hidden."""
    run_cell("import types\nbox = types.SimpleNamespace(runs=0)")
    _, captured = run_cell(f"{magic}\nbox.runs += 1\nprint('got here', box.runs)\nimport sys\n"
                           "print('to stderr', file=sys.stderr)\nif box.runs == 2:\n    raise ValueError('shape')\n",
                           expect_error=ValueError)
    assert captured.stdout.startswith("nbaccel: the failing run printed this to stdout:\ngot here 2\n")
    assert "nbaccel: the failing run printed this to stderr:\nto stderr\n" in captured.stderr
    assert "got here 1" not in captured.stdout + captured.stderr and run in captured.stderr


def test_compare_amp_in_a_script_shows_what_a_failing_run_printed(capsys):
    box = types.SimpleNamespace(runs=0)  # not restored between runs (a list would be)

    def step():
        box.runs += 1
        print("step", box.runs)
        if box.runs == 2:
            raise ValueError("second run")

    with pytest.raises(ValueError):
        nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0)
    out = capsys.readouterr().out
    assert out == "nbaccel: the failing run printed this to stdout:\nstep 2\n"


def test_a_silencer_without_captured_text_replays_nothing(capsys):
    @contextlib.contextmanager
    def mine():
        with contextlib.redirect_stdout(io.StringIO()):
            yield  # None: nothing to replay

    def step():
        print("x")
        raise ValueError("first run")

    with pytest.raises(ValueError):
        nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0, silence=mine)
    assert "failing run printed" not in capsys.readouterr().out


def test_compare_amp_in_a_script_hides_the_hidden_runs_fd_output(capfd):
    def step():
        os.write(1, b"step\n")
        return 1.0

    nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert capfd.readouterr().out == "step\n"  # the kept run's


def test_without_the_fds_the_hidden_runs_still_run(monkeypatch, capsys):
    # No file for the output, an fd that is not open (pythonw), a sys.stdout without fileno (capsys): the
    # block runs and nothing is switched.
    from nbaccel.quiet import fd_output_hidden

    def what(fd):  # the file an fd is open on
        return os.fstat(fd).st_dev, os.fstat(fd).st_ino

    real_dup = os.dup
    monkeypatch.setattr(os, "dup", lambda fd: (_ for _ in ()).throw(OSError(9, "Bad file descriptor")) if fd == 1
                        else real_dup(fd))
    before = what(1), what(2)
    with fd_output_hidden():
        print("through sys.stdout")
        assert what(1) == before[0] and what(2) != before[1]  # only fd 2 was open to switch
    assert (what(1), what(2)) == before
    monkeypatch.setattr(os, "open", lambda *args, **kwargs: (_ for _ in ()).throw(OSError(13, "no temporary folder")))
    with fd_output_hidden():
        assert (what(1), what(2)) == before
    assert capsys.readouterr().out == "through sys.stdout\n"
