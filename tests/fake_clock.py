"""A deterministic clock for compare_amp tests: each run of a recipe takes a scripted time."""

from __future__ import annotations

import torch

from nbaccel.timing import Clock


class FakeClock(Clock):
    def __init__(self, seconds_for):
        super().__init__(torch.device("cpu"))
        self.seconds_for = seconds_for

    def measure(self, fn):
        value = fn()
        return self.seconds_for(), value
