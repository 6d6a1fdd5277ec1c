"""What ``%%amp`` and `compare_amp` say when a run fails in an unusual way, found by a fault-injection
audit: the user's exception is the one raised, whatever it does when read, and a Ctrl-C before any
run gets the one-line note the other interrupts get."""

from __future__ import annotations

from nbaccel.amp import overflow_hint

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
