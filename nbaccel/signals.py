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
import inspect
import sys
from typing import Callable


class sigint_held:  # noqa: N801 - a context manager used like a function: `with sigint_held():`
    """A Ctrl-C waits until the block is done, then goes to the handler that was there before (Python's
    KeyboardInterrupt, or the program's own; none if it ignored SIGINT). Main thread only: elsewhere
    Python delivers no signals anyway, and one not installed from Python is left alone.

    Only for short blocks (a teardown's steps, an import that must not be left half done): a long
    one would make Ctrl-C look dead.

    A class calling ``_signal`` (the C functions that ``signal.signal`` and ``signal.getsignal`` wrap in
    Python code for their enums): between the handler's swap and its swap back no Python function of
    its own runs but ``__exit__`` itself. A real Ctrl-C cannot raise at its first line (the handler then
    is this one), but another KeyboardInterrupt can (a fault injector's, raised as a function starts),
    and the block then ends without putting the handler back: every later Ctrl-C would be caught here
    and never delivered. So the handler checks that the block may still run (the frame that entered it
    is on the stack); if not, it ends the hold itself and passes the signal on. (A Ctrl-C that comes
    while that frame still runs after such an exception is lost: nbaccel's holding functions let the
    exception through at once, or after running their teardown a second time.)
    """

    def __enter__(self) -> "sigint_held":
        self._caught: list = []
        self._owner = sys._getframe(1)  # the frame whose `with` holds SIGINT
        self._previous = _signal.getsignal(_signal.SIGINT)
        if self._previous is None:  # installed outside Python: it could not be put back
            self._held = False
            self._owner = None
            return self
        try:
            _signal.signal(_signal.SIGINT, self._caught_one)
            self._held = True
        except ValueError:  # not the main thread (of the main interpreter): no signal is delivered here
            self._held = False
            self._owner = None
        return self

    def _caught_one(self, signum, frame) -> None:
        running = sys._getframe(1)
        while running is not None and running is not self._owner:
            running = running.f_back
        if running is not None:  # the block still runs: the signal waits for its end
            self._caught.append((signum, frame))
            return
        # The block is over, and its __exit__ never ran: the hold ends now, and the signal goes on.
        _signal.signal(_signal.SIGINT, self._previous)
        self._held, self._owner = False, None
        self._deliver(signum, frame)

    def _deliver(self, signum, frame) -> None:
        if callable(self._previous):
            self._previous(signum, frame)  # signal.default_int_handler raises KeyboardInterrupt
        elif self._previous == _signal.SIG_DFL:
            raise KeyboardInterrupt

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._held:
            return False
        _signal.signal(_signal.SIGINT, self._previous)  # no Python call before this line (see the class)
        self._held, self._owner = False, None  # the frame and its locals are not kept alive
        if self._caught:
            self._deliver(*self._caught[0])
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


def exit_again(context) -> None:
    """After a KeyboardInterrupt came out of ``context``'s ``with``: exit it once more if it may not have
    exited. One raised at the first line of its ``__exit__`` ran none of it, and a
    ``contextlib.contextmanager`` then stays suspended at its ``yield`` until the garbage collector
    closes it, maybe much later (logging switched off, fds 1 and 2 on a hidden run's file until then).
    Only such a generator-based one still suspended is exited; any other is left alone (one that can be
    exited again safely, like `quiet.fd_output_hidden`, is exited by its caller directly)."""
    gen = getattr(context, "gen", None)
    if inspect.isgenerator(gen) and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
        context.__exit__(None, None, None)
