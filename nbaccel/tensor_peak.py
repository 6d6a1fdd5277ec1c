"""The peak of torch's CPU allocator during a run: what ``%%amp`` measures on the CPU.

The process's peak RSS, measured before, depended on where glibc's heap had put earlier runs' blocks:
within one comparison the runs agreed to a few KiB, and a numbers audit found one cell's "firm" bf16
saving of 16-23 % in three comparisons out of four, while fresh processes measured bf16 above fp32.
torch's CPU allocator reports every allocation and free to the profiler (``profile_memory``): summed in
order, they give the bytes of tensor memory a run added at its peak, op-internal scratch included,
the same from run to run, and what ``torch.cuda.max_memory_allocated`` counts on a GPU. Memory that
does not come from torch's allocator (Python objects, a library's own buffers) is not in it.

The profiler is torch's one per process, so this meter stands aside (`CpuTensorPeak.available`) while
another profile records; a cell that starts a profiler of its own stops this one (`valid` then says so,
and ``%%amp`` measures process memory instead).
"""

from __future__ import annotations

import torch

from .memory import PeakMemory
from .profile import _RECORDING, quiet_kineto
from .profile_options import profiler_running

METHOD = ("peak of torch's CPU allocator minus its level before (each allocation and free, recorded by "
          "torch.profiler with profile_memory; what torch.cuda.max_memory_allocated counts on a GPU; memory "
          "outside torch's allocator, such as Python objects, is not in it)")


class CpuTensorPeak:
    """``with CpuTensorPeak() as meter: run()`` then ``meter.result`` (a `PeakMemory`), or None when the
    run stopped the profiler (``meter.valid`` is False)."""

    def __init__(self):
        self.result: PeakMemory | None = None
        self.valid = False
        self._prof = None
        self._locked = False

    @staticmethod
    def available() -> bool:
        """No profiler recording in this process (another thread's nbaccel.profile, a user's own)."""
        return not profiler_running() and not _RECORDING.locked()

    def __enter__(self) -> "CpuTensorPeak":
        self._locked = _RECORDING.acquire(blocking=False)  # an nbaccel.profile in another thread waits its turn
        if not self._locked or profiler_running():  # taken since `available`: no measure (valid stays False)
            self._release()
            return self
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        try:
            with quiet_kineto():
                self._prof.__enter__()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        try:
            # A profiler the cell started and stopped inside this one ends this one's session too.
            self.valid = profiler_running()
            with quiet_kineto():
                self._prof.__exit__(*exc)
            if self.valid and exc[0] is None:
                self.result = PeakMemory("cpu", _peak_added(self._prof), METHOD, exact=True)
        finally:
            self._release()

    def _release(self) -> None:
        if self._locked:
            _RECORDING.release()
            self._locked = False


def _peak_added(prof) -> int:
    """The highest running sum of the CPU allocator's allocations (+) and frees (-), in time order,
    from the start (0: a run that only freed memory added none)."""
    cpu = torch.autograd.DeviceType.CPU
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == cpu)
    level = peak = 0
    for _, nbytes in changes:
        level += nbytes
        peak = max(peak, level)
    return peak


__all__ = ["CpuTensorPeak", "METHOD"]
