"""Time one run of a cell the way torch.utils.benchmark does: synchronized, repeated, robust stats.

* The device is synchronized before the clock starts and before it stops, so queued GPU work is
  charged to the run that queued it.
* On CUDA the interval is read from CUDA events (device time between the two syncs); on the CPU
  from ``time.perf_counter``.
* Summaries use the median and the interquartile range (IQR): a single descheduled run on a noisy
  machine moves the mean a lot and the median hardly at all.

The clock is injectable, so tests of everything built on top are deterministic.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

# torch.utils.benchmark warns when the IQR exceeds 10% of the median; we follow it.
NOISE_THRESHOLD = 0.10


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Measures one interval in seconds. Subclass or pass a callable for tests."""

    def __init__(self, device: torch.device, now: Callable[[], float] | None = None):
        self.device = device
        self._now = now or time.perf_counter
        self._use_events = device.type == "cuda" and now is None

    def measure(self, fn: Callable[[], object]) -> tuple[float, object]:
        """Run ``fn`` once and return (seconds, its return value)."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        synchronize(self.device)
        if self._use_events:
            # On the measured device's stream: a bare record() uses the *current* device's, so for
            # --device cuda:1 while cuda:0 is current it timed an empty stream (the host's launches).
            # The current device itself is left alone: the cell's own `.cuda()` means what it meant.
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            value = fn()
            end.record(stream)
            synchronize(self.device)
            return start.elapsed_time(end) / 1e3, value
        t0 = self._now()
        value = fn()
        synchronize(self.device)
        return self._now() - t0, value

    @property
    def method(self) -> str:
        if self._use_events:
            return "CUDA events between device synchronizations"
        return "time.perf_counter" + (" after torch.cuda.synchronize" if self.device.type == "cuda" else "")


@dataclass
class Stats:
    """Raw times of repeated runs and the robust summaries derived from them."""

    times: list[float] = field(default_factory=list)

    def _quantiles(self):
        if len(self.times) == 1:
            return self.times[0], self.times[0], self.times[0]
        q1, q2, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return q1, q2, q3

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def q1(self) -> float:
        return self._quantiles()[0]

    @property
    def q3(self) -> float:
        return self._quantiles()[2]

    @property
    def iqr(self) -> float:
        q1, _, q3 = self._quantiles()
        return q3 - q1

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def relative_spread(self) -> float:
        return self.iqr / self.median if self.median > 0 else 0.0

    @property
    def noisy(self) -> bool:
        return len(self.times) >= 2 and self.relative_spread > NOISE_THRESHOLD

    def to_dict(self) -> dict:
        return {"times_s": list(self.times), "median_s": self.median, "iqr_s": self.iqr, "n": len(self.times)}


def speedup_is_uncertain(base: Stats, other: Stats) -> bool:
    """True when the two interquartile ranges overlap, i.e. the ranking could flip on a re-run."""
    return other.q1 <= base.q3 and base.q1 <= other.q3 and abs(base.median - other.median) > 0


def format_ratio(value: float, firm: bool = True) -> str:
    """A speedup as shown: two decimals when firm ("1.38x"; under 0.1x two significant digits, "0.034x"), two
    significant digits when a flag qualifies it ("18x", "1.1x", "0.31x"): the second decimal of an uncertain
    or contended ratio is noise."""
    if firm:  # two significant digits under 0.1x: "0.03x" hid most of a 29.7x slowdown (a trial); "0.034x"
        return f"{value:.2f}x" if value >= 0.0995 else f"{value:.2g}x"
    return f"{value:.0f}x" if value >= 9.5 else f"{value:#.2g}x"


def format_seconds(seconds: float) -> str:
    """Three significant digits in the largest unit that keeps the number at least 1: ``0.9996``
    is "1 s" (not "1e+03 ms"), 1500 s is "1500 s" (not "1.5e+03 s")."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale * 0.9995 or unit == "ns":
            value = seconds / scale
            return f"{value:.0f} {unit}" if value >= 999.5 else f"{value:.3g} {unit}"
