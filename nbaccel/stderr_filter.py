"""Drop chosen lines that C++ code (Kineto, torch's allocator) writes straight to fd 2.

Python's warning filters never see such lines: they bypass ``sys.stderr``. While the context is
active, fd 2 goes through a pipe that a thread reads line by line, forwarding everything else to
the real fd 2 as it comes (so a long cell's own output still shows live) and dropping the lines
``drop`` accepts. A process started inside that keeps the pipe keeps being forwarded.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Callable


@contextlib.contextmanager
def dropped_stderr_lines(drop: Callable[[bytes], bool]):
    try:
        sys.stderr.flush()
        target = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield  # no real fd 2 (embedded interpreter): nothing to filter
        return
    try:
        read_end, write_end = os.pipe()
    except OSError:
        os.close(target)
        yield
        return

    def write_all(data: bytes) -> None:
        while data:
            data = data[os.write(target, data):]

    def forward() -> None:
        pending = b""
        try:
            while chunk := os.read(read_end, 1 << 16):
                *lines, pending = re.split(rb"(?<=[\n\r])", pending + chunk)
                write_all(b"".join(line for line in lines if not drop(line)))
            if pending and not drop(pending):
                write_all(pending)
        except OSError:
            pass
        finally:
            os.close(read_end)
            os.close(target)

    saved = os.dup(2)
    thread = threading.Thread(target=forward, name="nbaccel-stderr-filter", daemon=True)
    thread.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end (unless a child kept one): the thread ends
        os.close(saved)
        thread.join(timeout=1.0)
