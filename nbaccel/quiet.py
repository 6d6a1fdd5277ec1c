"""Hide the side channels of a measurement run that capturing stdout and stderr misses.

``%%amp`` and ``%%profile_gpu`` run a cell several times and show the output of one run (the kept
one, or the last). Capturing ``sys.stdout``/``sys.stderr`` hides prints, but not:

* logging: a ``StreamHandler`` keeps the stream it was given (``basicConfig(stream=sys.stderr)``),
  so every hidden run logged its lines (a 2-epoch cell under ``%%amp`` logged 26 of them);
* warnings: Python shows a warning once per code location, so the first hidden run used it up and
  the run the user sees showed none (torch's "lr_scheduler.step() before optimizer.step()");
* matplotlib figures: pyplot keeps every figure a run opens until something closes it, and the
  inline backend shows all open figures when the cell ends, so a plotting cell under ``%%amp``
  showed 15 identical figures (one per run). ``plt.show()`` in the cell displays and closes its
  figure inside the run, where the capture hides it; a figure left open was never hidden.

In a hidden run (`hiding_side_channels` wraps whatever silencer the caller passed), logging is
disabled, warnings are recorded and dropped without touching the once-per-location registries
(the "always" action keeps no record), and the pyplot figures the run opened are closed when it
ends (`new_figures_closed`; figures open before it are left alone). Restoring the filters when
the block ends also invalidates those registries (Python versions them with its filter list), so
the shown run warns as a plain run would -- and may repeat a warning an earlier cell already
showed once, as any change to the warning filters does.

Nor does capturing ``sys.stdout`` hide what is written to file descriptors 1 and 2 themselves: a
subprocess (``!cmd`` in terminal IPython is ``os.system``; ``subprocess.run``), C/C++ code, ``os.write``.
A user trial's ``!echo`` printed 15 times under ``%%amp``. ipykernel forwards fds 1 and 2 into the
cell's output too (its ``!cmd`` goes through ``sys.stdout``, which the capture hides, but a subprocess
or C code writes to the fd). So a hidden run also has fds 1 and 2 pointed at a file of the process's
(`fd_output_hidden`), replayed when the run fails; the kept run writes to them as a plain run does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings

from .signals import exit_again


@contextlib.contextmanager
def unlogged_and_unwarned():
    previous = logging.root.manager.disable  # the level the user's own logging.disable() set, if any
    try:
        # Inside the try: logging.disable sets the level, then clears the loggers' caches of what is
        # enabled (_clear_cache); a Ctrl-C between the two left logging switched off for good.
        logging.disable(logging.CRITICAL)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            yield
    finally:
        try:
            logging.disable(previous)
        except KeyboardInterrupt:  # the level is back, but the caches may still say "disabled": again
            logging.disable(previous)
            raise


def _open_figures() -> set:
    """pyplot's open figure managers; none when pyplot is not imported (nbaccel never imports it:
    a cell that plots has imported it, and one that does not should not pay for matplotlib)."""
    if "matplotlib.pyplot" not in sys.modules:
        return set()
    from matplotlib._pylab_helpers import Gcf  # pyplot's own registry, already loaded with it

    return set(Gcf.get_all_fig_managers())


@contextlib.contextmanager
def new_figures_closed():
    """Close the pyplot figures opened inside the block, also when it raises. Managers, not figure
    numbers, tell new from old: a run may close figure 1 and open a new figure 1."""
    before = _open_figures()
    try:
        yield
    finally:
        for manager in _open_figures() - before:  # the cell may have imported pyplot itself
            sys.modules["matplotlib.pyplot"].close(manager.canvas.figure)


_C_FFLUSH = []  # [libc fflush] once looked up, [None] where there is none to call


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: what C code (an extension's ``printf``) has buffered goes to the fd it was
    written for, before that fd is switched. Nothing where no C library can be found (Windows)."""
    if not _C_FFLUSH:
        try:
            import ctypes

            _C_FFLUSH.append(ctypes.CDLL(None).fflush)  # the process's own C library (POSIX)
        except (OSError, TypeError, AttributeError):  # Windows: CDLL(None) is refused
            _C_FFLUSH.append(None)
    if _C_FFLUSH[0] is not None:
        _C_FFLUSH[0](None)


def _flush_python_streams() -> None:
    """Flush the Python streams that write to fds 1 and 2 (the interpreter's own, and ``sys.stdout`` /
    ``sys.stderr`` when they are those fds: terminal IPython, a script). ipykernel's streams are not
    (they send messages), nor is a capture: flushing them would only cost time."""
    for stream in {id(s): s for s in (sys.__stdout__, sys.__stderr__, sys.stdout, sys.stderr)}.values():
        try:
            if stream is not None and stream.fileno() in (1, 2):
                stream.flush()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both; a closed stream
            pass


class fd_output_hidden:  # noqa: N801 - a context manager, named like the generator-based ones here
    """Point fds 1 and 2 at a file of this process's for the block, and back at what they were afterwards.

    The file is ``<tempdir>/nbaccel-hidden-run-<pid>-<random>.log``, made at the block's start and
    removed at its end. Not the null device: when the block raises, the last `REPLAYED_BYTES` it wrote are
    written to fd 2 after the fds are back -- a CUDA device-side assert prints its message (which
    assertion, which index) there and raises only "device-side assert triggered", and the first run
    of a ``%%amp`` comparison is a hidden one. If the process dies in the block (a segfault), the
    file stays, with faulthandler's dump in it. An interrupt replays nothing.

    Python's and C's buffers are flushed on the way in (earlier output goes where it was meant to) and
    on the way out (the block's own goes to the file). The fds are put back with ``dup2`` of copies
    taken on the way in, so whatever they were -- a terminal, ipykernel's pipe, the pipe of
    ``stderr_filter.dropped_stderr_lines`` around a profile -- they are again, and blocks nest. An fd
    that is not open, or a file that cannot be created, is left alone: the block runs, and its fd
    output shows as it did before this existed. The fds are the process's: for the block, what any
    thread writes to them goes to the file (a hidden run is short).
    A class, not a generator: a Ctrl-C that lands while the fds are put back must not leave fd 1 on
    the file for the rest of the session, so ``__exit__`` puts them back again before it lets the
    interrupt through. One at the first line of ``__exit__`` runs none of it: ``__exit__`` can be run
    again, and does nothing once it has run (`hiding_side_channels` does that).
    """

    def __init__(self):
        self._saved: list[tuple[int, int]] = []  # (fd, a copy of what it was)
        self._sink = None

    def __enter__(self):
        self._saved = []
        try:  # a file of its own: blocks may nest (a profile's hidden run inside a comparison's)
            self._sink, self.path = tempfile.mkstemp(prefix=f"nbaccel-hidden-run-{os.getpid()}-", suffix=".log")
        except OSError:
            self._sink = None
            return self
        try:
            _flush_python_streams()
            _flush_c_stdio()
            for fd in (1, 2):
                try:
                    copy = os.dup(fd)
                except OSError:  # not open (pythonw, a daemon)
                    continue
                self._saved.append((fd, copy))
                os.dup2(self._sink, fd)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._sink is None:
            return False
        try:
            if self._saved:
                _flush_python_streams()
                _flush_c_stdio()
        finally:
            try:
                self._put_back()
            except KeyboardInterrupt:
                self._put_back()  # idempotent: the copies are still open
                raise
            finally:
                for _, copy in self._saved:
                    os.close(copy)
                failed = exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
                try:
                    if failed and self._saved:
                        self._replay()
                finally:
                    os.close(self._sink)
                    self._saved, self._sink = [], None
                    try:  # not contextlib.suppress: a Ctrl-C at its first line would leave the file
                        os.unlink(self.path)
                    except OSError:
                        pass
        return False

    def _put_back(self) -> None:
        for fd, copy in self._saved:
            os.dup2(copy, fd)

    def _replay(self) -> None:
        end = os.lseek(self._sink, 0, os.SEEK_END)
        if not end:
            return
        os.lseek(self._sink, max(0, end - REPLAYED_BYTES), os.SEEK_SET)
        text = os.read(self._sink, REPLAYED_BYTES)
        cut = f"last {REPLAYED_BYTES // 1024} KiB of " if end > REPLAYED_BYTES else ""
        head = f"nbaccel: the failing hidden run wrote this ({cut}its fd 1 and 2 output):\n".encode()
        with contextlib.suppress(OSError):
            os.write(2, head + text + (b"" if text.endswith(b"\n") else b"\n"))


REPLAYED_BYTES = 16 * 1024  # a device-side assert's lines, a C library's error; not a whole log


def hiding_side_channels(silence):
    """``silence`` (a context-manager factory that hides a run's output: the magics' capture, a
    script's own) extended to fd-level output, logging, warnings and pyplot figures, so every
    caller's hidden runs get all of them. The fds are switched outside the silencer: the streams it
    replaces are flushed to the real fds first, and the block's leftovers to its file after.

    When the run raises, what it printed is shown after all of that is undone, as a plain cell shows
    its prints above its traceback (a trial's ``print("got here")`` before a shape mismatch vanished,
    which read as if the line before it never finished): the silencer's ``with`` value is read for
    ``stdout``/``stderr`` text (IPython's ``capture_output`` and nbaccel's own have both; a silencer
    without them replays nothing). An interrupt replays nothing."""

    @contextlib.contextmanager
    def hidden():
        captured = None
        fds, others = fd_output_hidden(), (silence(), unlogged_and_unwarned(), new_figures_closed())
        try:
            with fds, others[0] as captured, others[1], others[2]:
                yield
        except KeyboardInterrupt:
            # One at the first line of an __exit__ ran none of it: fd_output_hidden's left fds 1 and 2 on the
            # hidden run's file for the rest of the session (the cell's output, and every later cell's, went
            # there); contextlib's left logging off, or the silencer's capture on, until the garbage collector
            # closed the generator. Each is exited again; none does anything when it had exited.
            for context in reversed(others):
                exit_again(context)
            fds.__exit__(None, None, None)
            raise
        except BaseException:  # SystemExit too (argparse's usage line), as fd_output_hidden replays it
            replay_prints(captured)
            raise

    return hidden


def replay_prints(captured) -> None:
    """Write a failed hidden run's captured ``stdout``/``stderr`` text (its last `REPLAYED_BYTES`
    characters each) to the streams they were meant for, under one line saying whose they are."""
    for name in ("stdout", "stderr"):
        try:  # a silencer's own failure must never replace the run's exception
            text = getattr(captured, name, None)
        except Exception:  # noqa: BLE001
            continue
        if not isinstance(text, str) or not text:
            continue
        cut = f" (its last {REPLAYED_BYTES // 1024} KiB)" if len(text) > REPLAYED_BYTES else ""
        stream = getattr(sys, name)
        with contextlib.suppress(Exception):  # a closed or odd stream must not hide the run's own error
            stream.write(f"nbaccel: the failing run printed this to {name}{cut}:\n{text[-REPLAYED_BYTES:]}"
                         + ("" if text.endswith("\n") else "\n"))
            stream.flush()
