"""Who records with torch's profiler in this process: one nbaccel recorder at a time, whichever thread.

torch's profiler (Kineto) holds one session per process, and two threads profiling at once crashed
the process; `torch.autograd._profiler_enabled()` reads the calling thread's state only. nbaccel's
recorders (`profile`, and `tensor_peak.CpuTensorPeak` under ``%%amp`` and the memory estimate's dry
runs) take `RECORDING` first. It keeps what holds it and in which thread, so that a refusal names
the recorder that is in the way, and a profile started inside this thread's own is told it is nested.
"""

from __future__ import annotations

import threading


class RecorderLock:
    """A non-blocking lock that remembers its holder: ``what`` (words for a refusal), its thread, and the
    `profile` object when one holds it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.what: str | None = None
        self.thread_name: str | None = None
        self.thread_id: int | None = None
        self.profile = None

    def take(self, what: str, profile=None) -> bool:
        """True when taken (the caller must `release`); False while another recorder holds it."""
        if not self._lock.acquire(blocking=False):
            return False
        thread = threading.current_thread()
        self.what, self.thread_name, self.thread_id, self.profile = what, thread.name, thread.ident, profile
        return True

    def release(self) -> None:
        self.what = self.thread_name = self.thread_id = self.profile = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def profile_in_this_thread(self):
        """The nbaccel `profile` recording in the calling thread, else None."""
        if self.profile is not None and self.thread_id == threading.get_ident():
            return self.profile
        return None

    def refusal(self, refused: str) -> str:
        """Why ``refused`` ("this nbaccel.profile()", ...) could not start while the holder records elsewhere."""
        holder = self.what or "another nbaccel recorder"
        thread = f' ("{self.thread_name}")' if self.thread_name else ""
        return (f"{holder} is recording in another thread{thread} of this process; torch's profiler (Kineto) "
                f"holds one session per process, so {refused} was refused before its code ran: run it once that "
                "one has finished, or profile one thread at a time")


RECORDING = RecorderLock()
