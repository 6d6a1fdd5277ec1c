"""Drop chosen lines that C++ code (Kineto, torch's allocator) writes straight to fd 2.

Python's warning filters never see such lines: they bypass ``sys.stderr``. While the context is
active, fd 2 goes through a pipe that a thread reads line by line, forwarding everything else to
the real fd 2 as it comes (so a long cell's own output still shows live) and dropping the lines
``drop`` accepts. A process started inside that keeps the pipe keeps being forwarded.

Setting up and undoing run with SIGINT held (`signals.sigint_held`), and every fd, the thread and
fd 2's switch are noted as they are made, so that an interrupt that still gets in (before the hold
began, or raised at a Python function's first line inside, as a fault injector does) leaves no
thread, no pipe and no fd 2 on the pipe: a fault-injection audit's Ctrl-C in ``thread.start()``
(which the old code called, with ``os.dup2`` onto the pipe, before its ``try``) left a thread and
four fds per interrupted profile, and once fd 2 on the pipe for good.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Callable

from .signals import sigint_held


@contextlib.contextmanager
def dropped_stderr_lines(drop: Callable[[bytes], bool]):
    filtering = _Filter(drop)
    try:
        with sigint_held():
            filtering.start()
        yield
    finally:
        try:  # `signals.finish`, inlined: an interrupt at finish's own first line would skip everything
            with sigint_held():
                filtering.stop()
        except KeyboardInterrupt:
            with sigint_held():
                filtering.stop()  # what the interrupt left
            raise


class _Filter:
    """fd 2 through a pipe and a forwarding thread; `stop` undoes what `start` did, and can run again."""

    def __init__(self, drop: Callable[[bytes], bool]):
        self.drop = drop
        self.target = self.read_end = self.write_end = self.saved = None  # fds, each None until opened
        self.thread: threading.Thread | None = None
        self.thread_started = False  # thread.start() returned
        # Whoever takes it closes read_end and target: the thread as it starts, or `stop` when start()
        # was cut short and the thread may never run (then the thread, if it runs after all, does nothing).
        self._claim = threading.Lock()

    def start(self) -> None:
        try:
            sys.stderr.flush()
            self.target = os.dup(2)
            self.read_end, self.write_end = os.pipe()
        except (OSError, ValueError, AttributeError):  # no real fd 2 (embedded interpreter), or no pipe:
            return  # nothing to filter (stop() closes what was opened)
        self.saved = os.dup(2)
        self.thread = threading.Thread(target=self._forward, name="nbaccel-stderr-filter", daemon=True)
        self.thread.start()
        self.thread_started = True
        os.dup2(self.write_end, 2)
        os.close(self.write_end)
        self.write_end = None

    def _forward(self) -> None:
        if not self._claim.acquire(blocking=False):  # stop() found start() cut short and closed the ends
            return
        pending = b""
        try:
            while chunk := os.read(self.read_end, 1 << 16):
                *lines, pending = re.split(rb"(?<=[\n\r])", pending + chunk)
                self._write_all(b"".join(line for line in lines if not self.drop(line)))
            if pending and not self.drop(pending):
                self._write_all(pending)
        except OSError:
            pass
        finally:
            os.close(self.read_end)
            os.close(self.target)

    def _write_all(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.target, data):]

    def stop(self) -> None:
        """Undo `start` (all of it, or what it got to); run again after an interrupt, it does what is left."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        if self.saved is not None:
            os.dup2(self.saved, 2)  # the pipe's last write end (unless a child kept one): the thread ends
            os.close(self.saved)
            self.saved = None
        if self.write_end is not None:
            os.close(self.write_end)
            self.write_end = None
        if self.thread_started:
            self.thread.join(timeout=1.0)
        elif self._claim.acquire(blocking=False):  # no thread ran, nor will: its ends are closed here
            for fd in (self.read_end, self.target):
                if fd is not None:
                    os.close(fd)
            self.read_end = self.target = None
