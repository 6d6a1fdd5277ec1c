"""Ctrl-C while nbaccel undoes what it did.

CPython turns a pending SIGINT into ``KeyboardInterrupt`` wherever it checks for signals: as a
Python function starts (3.11), after a call returns, at the end of a loop's pass. A teardown that a
KeyboardInterrupt cuts short leaves process-wide state behind for the rest of the kernel's life (a
profiler running, autocast on, fd 2 on a pipe), so the short steps of a teardown run with SIGINT
held (`sigint_held`), and a teardown is written so that it can simply be run again when an
interrupt still got in (before the hold began, or raised by other means): each step is done once,
and the interrupt is raised when everything is undone (`finish`).
"""

from __future__ import annotations

import _signal  # signal's C functions, see sigint_held
from typing import Callable


class sigint_held:  # noqa: N801 - a context manager used like a function: `with sigint_held():`
    """A Ctrl-C waits until the block is done, then goes to the handler that was there before (Python's
    KeyboardInterrupt, or the program's own; none if it ignored SIGINT). Main thread only: elsewhere
    Python delivers no signals anyway, and one not installed from Python is left alone.

    Only for short blocks (a teardown's steps, an import that must not be left half done): a long
    one would make Ctrl-C look dead.

    A class calling ``_signal`` (the C functions that ``signal.signal`` and ``signal.getsignal`` wrap in
    Python code for their enums): between the handler's swap and its swap back no Python function of
    its own runs, so no KeyboardInterrupt raised as one starts (a fault injector's) can leave Ctrl-C
    swallowed for good. A real Ctrl-C cannot land there: the handler then is this one.
    """

    def __enter__(self) -> "sigint_held":
        self._caught: list = []
        self._previous = _signal.getsignal(_signal.SIGINT)
        if self._previous is None:  # installed outside Python: it could not be put back
            self._held = False
            return self
        try:
            _signal.signal(_signal.SIGINT, self._caught_one)
            self._held = True
        except ValueError:  # not the main thread (of the main interpreter): no signal is delivered here
            self._held = False
        return self

    def _caught_one(self, *args) -> None:
        self._caught.append(args)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._held:
            return False
        _signal.signal(_signal.SIGINT, self._previous)
        self._held = False
        if self._caught:
            if callable(self._previous):
                self._previous(*self._caught[0])  # signal.default_int_handler raises KeyboardInterrupt
            elif self._previous == _signal.SIG_DFL:
                raise KeyboardInterrupt
        return False


def finish(teardown: Callable, *args) -> None:
    """Run ``teardown(*args)`` with SIGINT held; if a KeyboardInterrupt still comes out of it (one pending
    before the hold began), run it once more to do what it left, then raise the interrupt.

    ``teardown`` must be safe to run again after a run that an interrupt stopped anywhere: each of its
    steps marks itself done when it is (a reference set to None, a flag), and skips itself then. One
    that lands at the first line of `finish` itself stops it before anything ran: the caller runs it
    again then (``nbaccel.profile.__exit__`` does), or inlines these lines (`precision.apply_recipe`)."""
    try:
        with sigint_held():
            teardown(*args)
    except KeyboardInterrupt:
        with sigint_held():
            teardown(*args)
        raise
