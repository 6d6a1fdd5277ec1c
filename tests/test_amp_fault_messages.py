"""What ``%%amp`` and `compare_amp` say when a run fails in an unusual way, found by a fault-injection
audit: the user's exception is the one raised, whatever it does when read, and a Ctrl-C before any
run gets the one-line note the other interrupts get."""

from __future__ import annotations

import sys

import pytest

import nbaccel
from nbaccel.amp import overflow_hint
from text_helpers import unfolded

UNPRINTABLE = "class Unprintable(Exception):\n    def __str__(self):\n        raise ValueError('no text')\n"


def test_an_exception_whose_str_raises_is_no_overflow_and_no_error():
    namespace: dict = {}
    exec(UNPRINTABLE, namespace)
    assert overflow_hint(namespace["Unprintable"]()) is None


def test_a_cell_exception_whose_str_raises_stays_the_one_raised(run_cell, ip, capsys):
    # Was: the magic's hint read str(exc), and the ValueError from the user's __str__ replaced their exception.
    # (ip.run_cell itself: under the run_cell fixture's capture_output, IPython's own rendering of such an
    # exception fails and reports that ValueError, with or without %%amp.)
    run_cell(UNPRINTABLE + "counter = 0")
    capsys.readouterr()
    result = ip.run_cell("%%amp --repeat 1 --warmup 0\ncounter += 1\nraise Unprintable()\n")
    assert type(result.error_in_exec) is ip.user_ns["Unprintable"]
    assert ("nbaccel %%amp: the cell raised Unprintable in the fp32 run; the comparison was abandoned"
            in capsys.readouterr().err)
    assert ip.user_ns["counter"] == 0


class NotesNotAList(Exception):
    pass


@pytest.mark.parametrize("notes", [("the user's note",), None, 5])
def test_compare_amp_notes_an_exception_whose_notes_are_not_a_list(notes):
    # Was: add_note's TypeError ("__notes__ is not a list") replaced the user's exception.
    def cell():
        exc = NotesNotAList("x")
        exc.__notes__ = notes
        raise exc

    with pytest.raises(NotesNotAList) as raised:
        nbaccel.compare_amp(cell, repeat=1, warmup=0)
    kept = [] if notes is None else list(notes) if isinstance(notes, tuple) else [notes]
    assert raised.value.__notes__[:len(kept)] == kept, "what the user's code put there comes first"
    assert raised.value.__notes__[len(kept)] == ("nbaccel.compare_amp: raised in the fp32 run; your variables and "
                                                 "torch's settings are as before the call")


@pytest.mark.parametrize("notes", ["None", "5", "('the user\\'s note',)"])
def test_the_magic_reads_notes_that_are_not_a_list_without_failing(run_cell, notes):
    # Was: with __notes__ None or a number, reading them for the note raised TypeError in place of the ValueError.
    result, captured = run_cell(f"%%amp --repeat 1 --warmup 0\nexc = ValueError('v')\nexc.__notes__ = {notes}\n"
                                "raise exc\n", expect_error=ValueError)
    assert "nbaccel %%amp: the cell raised ValueError in the fp32 run; the comparison was abandoned: your variables " \
           "and torch's global settings" in unfolded(captured.stderr)


@pytest.mark.parametrize("where", ["resolve_device", "device_info", "cell_function"])
def test_an_interrupt_while_amp_checks_its_options_and_device_is_said(run_cell, ip, monkeypatch, where):
    # Was: a bare KeyboardInterrupt through nbaccel's frames, with no word on whether the cell had run
    # (resolving the device starts CUDA on a first call: seconds).
    module = sys.modules["nbaccel.magics.amp"]
    original = getattr(module, where)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    run_cell("counter = 0")
    monkeypatch.setattr(module, where, interrupted)
    _, captured = run_cell("%%amp --repeat 1 --warmup 0\ncounter += 1\n", expect_error=KeyboardInterrupt)
    assert ("nbaccel %%amp: interrupted (KeyboardInterrupt) while nbaccel checked the options and the device, "
            "before any run; the cell did not run") in unfolded(captured.stderr), captured.stderr
    assert "File " not in captured.stdout and "nbaccel" not in captured.stdout, captured.stdout
    assert ip.user_ns["counter"] == 0
    monkeypatch.setattr(module, where, original)
    run_cell("%%amp --repeat 1 --warmup 0 -q\ncounter += 1\n")  # and the next one runs
    assert ip.user_ns["counter"] == 1
