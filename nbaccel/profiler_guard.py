"""Refuse a second torch profiler while nbaccel's records.

Kineto keeps one profiling session per process. A profiler that the profiled code starts and stops
itself (``with torch.profiler.profile():`` or ``torch.autograd.profiler.profile()`` in the cell) ends
nbaccel's session with its own, and reading nbaccel's trace afterwards crashed the process with a
segmentation fault (a user trial: the kernel died, in ``export_chrome_trace``). Nothing afterwards can
tell that it happened during the warm-up steps, so the second profiler is stopped as it starts: while
`SecondProfilerGuard` is installed, torch's ``autograd.profiler.profile`` (which every torch profiler
is built on) refuses to prepare or start any profiler but nbaccel's own, with a `ProfileError` that
says why. The profiled code then fails where its profiler starts (its ``with`` line; under a schedule
that begins with ``wait`` steps, its first recording ``step()``), and the profile is discarded as for
any failure of the code. Installed and removed as single attribute assignments, so a Ctrl-C cannot leave
half of it behind.
"""

from __future__ import annotations

import torch

from .profile_options import ProfileError

_GUARDED = ("_prepare_trace", "_start_trace")  # what __enter__ and torch.profiler's start() call


class SecondProfilerGuard:
    """``install()`` while nbaccel's profiler records, ``remove()`` before it stops. ``own()`` returns
    nbaccel's own ``torch.autograd.profiler.profile`` object (torch.profiler makes it, and may make a
    new one between steps): calls on it pass."""

    def __init__(self, own, who: str):
        self._own, self._who = own, who
        self._saved: dict = {}

    def install(self) -> None:
        cls = torch.autograd.profiler.profile
        for name in _GUARDED:
            original = cls.__dict__.get(name)
            if original is None or name in self._saved:  # another torch: nothing to guard there
                continue
            self._saved[name] = original
            setattr(cls, name, self._guarded(original))

    def _guarded(self, original):
        def guarded(prof, *args, **kwargs):
            if prof is not self._own():
                raise ProfileError(
                    f"{self._who} is profiling this code, and torch runs one profiler per process: a second one "
                    "(torch.profiler.profile or torch.autograd.profiler.profile) started inside it would end "
                    f"{self._who}'s recording and crash the process when its trace is read. Take the profiler "
                    f"out of the code, or run the code without {self._who} to use your own.")
            return original(prof, *args, **kwargs)
        return guarded

    def remove(self) -> None:
        cls = torch.autograd.profiler.profile
        while self._saved:
            name, original = self._saved.popitem()
            setattr(cls, name, original)


__all__ = ["SecondProfilerGuard"]
