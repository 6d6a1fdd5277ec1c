"""A cell that raises under a magic shows the user's own lines, labelled with the cell's number.

IPython 9 advances ``execution_count`` before it runs a cell; a magic that compiled its cell
body with that count labelled the failing line ``Cell In[n+1]`` -- a cell that does not exist yet.
"""

from __future__ import annotations

import re

import pytest

from text_helpers import unfolded

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


# --- Ctrl-C: in the cell, the user's line; in nbaccel's own code, no frame of nbaccel's -----------

INTERRUPTED_CELLS = {
    # the 3rd run, a hidden one (%%amp restores the namespace, not the attributes of `box`)
    "amp": "%%amp --repeat 2 --warmup 0\nbox.runs += 1\nif box.runs == 3:\n    raise KeyboardInterrupt\n",
    "profile_gpu": "%%profile_gpu --warmup 1 --steps 2 -q\nbox.runs += 1\nif box.runs == 2:\n    raise KeyboardInterrupt\n",
}


@pytest.mark.parametrize("magic", sorted(INTERRUPTED_CELLS))
def test_an_interrupt_in_the_cell_shows_the_users_line(run_cell, magic):
    run_cell("import types\nbox = types.SimpleNamespace(runs=0)")
    result, captured = run_cell(INTERRUPTED_CELLS[magic], expect_error=KeyboardInterrupt)
    assert f"Cell In[{result.execution_count}], line 3" in captured.stdout, captured.stdout
    assert "----> 3     raise KeyboardInterrupt" in captured.stdout


def _interrupt_once(monkeypatch, owner, name, on_call=1):
    """Make ``owner.name`` raise KeyboardInterrupt on its ``on_call``-th call, as a Ctrl-C landing there does."""
    original, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == on_call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


def _no_frames(stdout: str) -> None:
    """IPython's rendering of an interrupt that shows the magic's line and nothing of nbaccel's."""
    assert "KeyboardInterrupt" in stdout
    assert "get_ipython().run_cell_magic(" in stdout, stdout
    assert "File " not in stdout and "nbaccel" not in stdout and "skipping hidden" not in stdout, stdout


def test_an_interrupt_while_amp_restores_its_snapshot_shows_no_nbaccel_frame(run_cell, ip, monkeypatch):
    # A user trial: Ctrl-C during %%amp --repeat 300 mostly lands in Snapshot.restore (restoring takes
    # time), and the good note was followed by ~25 lines through amp.py and snapshot.py: an nbaccel crash
    # to the user's eyes.
    from nbaccel.snapshot import Snapshot

    run_cell("import torch\nw = torch.ones(3)\ncounter = 0")
    _interrupt_once(monkeypatch, Snapshot, "restore", on_call=4)  # before the 4th run
    result, captured = run_cell("%%amp --repeat 3 --warmup 0\ncounter += 1\nw.mul_(2)\n", expect_error=KeyboardInterrupt)
    _no_frames(captured.stdout)
    assert "nbaccel %%amp: interrupted (KeyboardInterrupt) while nbaccel was comparing, not in the cell" in unfolded(captured.stderr)
    assert ip.user_ns["counter"] == 0 and ip.user_ns["w"].tolist() == [1.0, 1.0, 1.0], "the state is restored"
    assert isinstance(result.error_in_exec.__context__, KeyboardInterrupt), "the original stays reachable"


@pytest.mark.parametrize("where", ["step", "read"])
def test_an_interrupt_in_the_profiler_shows_no_nbaccel_frame_nor_blames_the_cell(run_cell, ip, monkeypatch, where):
    import importlib

    import torch

    if where == "step":  # Kineto's step, which stops the recording after the last active step
        _interrupt_once(monkeypatch, torch.profiler.profile, "step", on_call=2)
    else:  # reading the trace Kineto wrote, after every run
        _interrupt_once(monkeypatch, importlib.import_module("nbaccel.profile"), "_read_json")
    run_cell("counter = 0")
    _, captured = run_cell("%%profile_gpu --warmup 1 --steps 2 -q\ncounter += 1\n", expect_error=KeyboardInterrupt)
    _no_frames(captured.stdout)
    assert "the profiled code raised" not in unfolded(captured.stderr), captured.stderr
    said = {"step": "nbaccel: interrupted (KeyboardInterrupt) in nbaccel's profiler, not in the profiled code; the "
                    "profiler was stopped and the partial profile discarded.",
            "read": "nbaccel: interrupted (KeyboardInterrupt) while nbaccel read the profile, after the profiled code "
                    "had finished; the profile was discarded."}[where]
    assert said in unfolded(captured.stderr), captured.stderr
    assert ip.user_ns["counter"] == {"step": 2, "read": 3}[where]


def test_an_interrupt_during_the_audits_first_import_waits_for_it_to_finish():
    """A user trial: the first audited run imports torch._dynamo (1-2 s); a Ctrl-C landed inside that
    import (a hundred importlib frames) and once left it half done, so a later run raised AttributeError
    from inside torch. The import now comes whole before the audit; a Ctrl-C meanwhile is raised after
    it. A fresh interpreter: this one imported torch._dynamo long ago."""
    import subprocess
    import sys

    script = """
import os, signal, sys, threading, time
import torch
from nbaccel.flops import OpAudit
assert "torch._dynamo" not in sys.modules
threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()  # lands inside the import
try:
    with OpAudit():
        raise SystemExit("the audit began: the interrupt was lost")
except KeyboardInterrupt:
    import torch._dynamo
    assert torch._dynamo.config is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    print("interrupted after the import")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "interrupted after the import", done.stderr[-2000:]

@pytest.mark.parametrize("where", ["start", "stop", "validate"])
def test_an_interrupt_around_the_profiled_runs_is_said(run_cell, ip, monkeypatch, where):
    # A user trial: Ctrl-C 0.3 s into %%profile_gpu --warmup 1 --steps 3 (Kineto starting) was a bare
    # KeyboardInterrupt, no note: nothing said whether the cell had run.
    import sys

    import torch

    if where == "stop":
        _interrupt_after_stopping(monkeypatch)
    else:
        _interrupt_once(monkeypatch, torch.profiler.profile if where == "start" else
                        sys.modules["nbaccel.magics.profile"], where)
    run_cell("counter = 0")
    _, captured = run_cell("%%profile_gpu -q\ncounter += 1\n", expect_error=KeyboardInterrupt)
    _no_frames(captured.stdout)
    said = {"start": "nbaccel: interrupted (KeyboardInterrupt) while the profiler started, before the profiled code "
                     "ran; nothing was recorded",
            "stop": "nbaccel: interrupted (KeyboardInterrupt) while the profiler stopped, after the profiled code had "
                    "finished; the profile was discarded.",
            "validate": "nbaccel %%profile_gpu: interrupted (KeyboardInterrupt) while nbaccel checked the options; "
                        "the cell did not run"}[where]
    assert said in unfolded(captured.stderr), captured.stderr
    assert ip.user_ns["counter"] == (1 if where == "stop" else 0)


def _interrupt_after_stopping(monkeypatch):
    """A Ctrl-C at the end of torch.profiler.profile.stop: the profiler has stopped (one landing
    before it stops leaves it running, which torch's own code does too)."""
    import torch

    original = torch.profiler.profile.stop

    def stop(self):
        original(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.profiler.profile, "stop", stop)


def test_an_interrupt_after_the_profiled_code_raised_says_both(run_cell, monkeypatch):
    _interrupt_after_stopping(monkeypatch)
    _, captured = run_cell("%%profile_gpu -q\nraise ValueError('x')\n", expect_error=KeyboardInterrupt)
    assert ("interrupted (KeyboardInterrupt) while the profiler stopped, after the profiled code had raised ValueError"
            in unfolded(captured.stderr)), captured.stderr


@pytest.mark.parametrize("magic", ["%%amp --repeat 1 --warmup 0", "%%profile_gpu"])
def test_an_interrupt_while_the_result_is_shown_says_the_measurement_finished(run_cell, ip, monkeypatch, magic):
    import sys

    _interrupt_once(monkeypatch, sys.modules["nbaccel.render.display"], "display_result")
    _, captured = run_cell(f"{magic} -r res\nx = 1\n", expect_error=KeyboardInterrupt)
    _no_frames(captured.stdout)
    assert (f"nbaccel {magic.split()[0]}: interrupted (KeyboardInterrupt) while its result was shown, after the "
            "measured runs; the measurement had finished and its result is in res") in unfolded(captured.stderr)
    assert ip.user_ns["res"].value is None


def test_a_ctrl_c_held_over_the_import_goes_to_the_handler_that_was_there():
    """A review: the held Ctrl-C was always raised as KeyboardInterrupt, past a program's own SIGINT
    handler, and even where SIGINT was ignored."""
    import os
    import signal

    from nbaccel.flops import _sigint_held

    before = signal.getsignal(signal.SIGINT)
    got = []
    try:
        signal.signal(signal.SIGINT, lambda *args: got.append("own handler"))
        with _sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert got == []  # held until the block is done
        assert got == ["own handler"]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            with _sigint_held():
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("failing_run", [5, 6, 7, 8], ids=["audited fp32", "audited bf16", "memory fp32",
                                                            "memory bf16"])
def test_a_cell_failing_in_a_hidden_run_shows_no_nbaccel_frame(run_cell, ip, failing_run):
    """A fault-injection audit: a cell that raised in a memory or audited run showed nbaccel's frames
    (`memory_series`, the audits' dict comprehension) between the magic and the user's line."""
    from types import SimpleNamespace

    ip.user_ns["box"] = SimpleNamespace(runs=0)
    # --repeat 2, no warmup: 4 timed runs, then the 2 audited, then the 2 memory runs
    _, captured = run_cell(f"%%amp --repeat 2 --warmup 0\nbox.runs += 1\nif box.runs == {failing_run}:\n"
                           "    raise ValueError('boom')\n", expect_error=ValueError)
    assert "raise ValueError('boom')" in captured.stdout
    assert "nbaccel" not in re.sub(r"nbaccel %%amp: .*", "", captured.stdout).replace("%%amp", ""), captured.stdout


def test_a_second_profiler_in_the_cell_fails_at_its_line_and_at_nbaccels_check(run_cell):
    """A docs audit: reliability.md promised no frame of nbaccel's, and the second-profiler refusal shows
    one: IPython never hides the frame that raised. The traceback is the cell's `with` line, torch's
    profiler frames, and the check with its message, as reliability.md now says."""
    from nbaccel.profile_options import ProfileError

    run_cell("import torch\nxx = torch.ones(4, 4)")
    _, captured = run_cell("%%profile_gpu\nwith torch.profiler.profile():\n    xx @ xx\n", expect_error=ProfileError)
    shown = captured.stdout
    assert shown.index("----> 1 with torch.profiler.profile():") < shown.index("torch/profiler/profiler.py")
    assert shown.index("torch/profiler/profiler.py") < shown.index("nbaccel/profiler_guard.py")
    assert [line for line in shown.splitlines() if "nbaccel/" in line] == [
        line for line in shown.splitlines() if "profiler_guard.py" in line and line.startswith("File ")]
    assert "runs one profiler per process" in shown


def test_an_interrupt_in_the_estimates_dry_run_shows_no_nbaccel_frame(run_cell, ip, monkeypatch):
    """A trial: Ctrl-C during %memory_budget --model's dry runs (98.6 s for a small CNN) printed a 23-frame
    traceback through dry_run.LiveBytes.__torch_dispatch__. Now one line says what stopped and what is intact,
    torch's dispatch and autocast are as before, and the watched budget goes on."""
    import torch

    from nbaccel.dry_run import LiveBytes

    run_cell("%memory_budget 4GiB -q -r budget")
    run_cell("import torch\ntorch.manual_seed(0)\n"
             "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))\n"
             "before = [p.detach().clone() for p in model.parameters()]")
    _interrupt_once(monkeypatch, LiveBytes, "__torch_dispatch__", on_call=30)  # inside a measured step
    result, captured = run_cell("%memory_budget --model model --batch 64", expect_error=KeyboardInterrupt)
    assert "KeyboardInterrupt" in captured.stdout and "get_ipython().run_line_magic(" in captured.stdout
    assert "File " not in captured.stdout and "nbaccel" not in captured.stdout, captured.stdout
    assert ("nbaccel %memory_budget: interrupted (KeyboardInterrupt) during the estimate's dry runs; nothing was "
            "estimated; model, its optimizer and your variables are as they were (the dry runs use a copy)"
            in unfolded(captured.stderr)), captured.stderr
    assert all(torch.equal(p, b) for p, b in zip(ip.user_ns["model"].parameters(), ip.user_ns["before"]))
    assert torch._C._len_torch_dispatch_stack() == 0 and not torch.is_autocast_enabled("cpu")
    monkeypatch.undo()
    cells = len(ip.user_ns["budget"].history)
    run_cell("x = torch.ones(4)")  # the watcher still measures the next cell
    assert len(ip.user_ns["budget"].history) == cells + 1
    assert ip.user_ns["budget"].history.iloc[-1]["status"] == "ok"
