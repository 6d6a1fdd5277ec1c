"""The peak of torch's CPU allocator during a run: what ``%%amp`` measures on the CPU.

The process's peak RSS, measured before, depended on where glibc's heap had put earlier runs' blocks:
within one comparison the runs agreed to a few KiB, and a numbers audit found one cell's "firm" bf16
saving of 16-23 % in three comparisons out of four, while fresh processes measured bf16 above fp32.
torch's CPU allocator reports every allocation and free to the profiler (``profile_memory``): summed in
order, they give the bytes of tensor memory a run added at its peak, op-internal scratch included,
the same from run to run, and what ``torch.cuda.max_memory_allocated`` counts on a GPU. Memory that
does not come from torch's allocator (Python objects, a library's own buffers) is not in it.

The profiler is torch's one per process, so this meter stands aside (`CpuTensorPeak.available`) while
another profile records; a cell that starts a profiler of its own stops this one (no result then), and
one that refuses to profile under it fails; ``%%amp`` then measures the process's memory for every run.
It costs per allocation, so ``%%amp`` uses it for cells of up to `MAX_OPS` ops.
"""

from __future__ import annotations

import torch

from .memory import PeakMemory
from .profile import quiet_kineto
from .profile_options import profiler_running
from .recording import RECORDING
from .signals import sigint_held

METHOD = ("peak of torch's CPU allocator minus its level before (each allocation and free, recorded by "
          "torch.profiler with profile_memory; what torch.cuda.max_memory_allocated counts on a GPU; memory "
          "outside torch's allocator, such as Python objects, is not in it)")


# The profiler keeps every allocation event until it stops (about 2 KB each: a loop of 100,000 small ops
# made 600,000 events, 1.2 GiB and 8 s). Above this many ops in the audited run, %%amp measures the
# process's memory instead (a typical training step has a few thousand; the method line says which).
MAX_OPS = 10_000


class CpuTensorPeak:
    """``with CpuTensorPeak() as meter: run()`` then ``meter.result`` (a `PeakMemory`), or None when the
    meter could not measure (another profile started meanwhile, or the run's own profiler stopped it)."""

    def __init__(self, what: str = "nbaccel's CPU memory meter"):
        self.what = what  # how a profile refused meanwhile in another thread names this meter (`RECORDING`)
        self.result: PeakMemory | None = None
        # With a result: the profiler's events, read once (building them costs per event), for a caller
        # that reads more than the peak from them (`dry_run._OpScratch`: the allocator's level per op).
        self.events: list | None = None
        self._prof = None
        self._locked = False

    @staticmethod
    def available() -> bool:
        """No profiler recording in this process: this thread's (a user's own, an nbaccel.profile around
        the call), or another thread's (torch's process-wide flag; two at once crash the process)."""
        return not (_profiler_on() or RECORDING.locked())

    def __enter__(self) -> "CpuTensorPeak":
        with sigint_held():  # a Ctrl-C while Kineto starts left the profiler on, or the lock taken, for good
            self._locked = RECORDING.take(self.what)  # an nbaccel.profile in another thread waits
            if not self._locked or _profiler_on():
                self._release()  # taken since `available`: no measure (result stays None)
                return self
            try:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True)
                with quiet_kineto():
                    self._prof.__enter__()
            except BaseException:
                self._stop()
                raise
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        with sigint_held():  # stopped whatever happens: a profiler left on records every later op
            # A profiler the cell started and stopped inside this one ends this one's session too.
            valid = profiler_running()
            self._stop()
            if valid and exc[0] is None:
                self.events = self._prof.profiler.kineto_results.events()
                self.result = PeakMemory("cpu", _peak_added(self.events), METHOD, exact=True)

    def _stop(self) -> None:
        try:
            if self._prof is not None and profiler_running():
                with quiet_kineto():
                    self._prof.__exit__(None, None, None)
        finally:
            self._release()

    def _release(self) -> None:
        if self._locked:
            RECORDING.release()
            self._locked = False


def _profiler_on() -> bool:
    """A profiler records: this thread's, or another thread's (torch's process-wide flag)."""
    return profiler_running() or torch.autograd.profiler._is_profiler_enabled


def allocator_changes(events) -> list[tuple[int, int]]:
    """(time in ns, bytes: + allocated, - freed) of each of torch's CPU allocator's events, in time order."""
    cpu = torch.autograd.DeviceType.CPU
    return sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == cpu)


def _peak_added(events) -> int:
    """The highest running sum of the CPU allocator's allocations (+) and frees (-), in time order,
    from the start (0: a run that only freed memory added none)."""
    level = peak = 0
    for _, nbytes in allocator_changes(events):
        level += nbytes
        peak = max(peak, level)
    return peak


__all__ = ["CpuTensorPeak", "METHOD", "MAX_OPS"]
