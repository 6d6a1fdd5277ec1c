"""Two profiles of one cell, op by op: which ops got slower or faster, and which are new.

The question it answers is the one `%%amp` leaves when bf16 is no faster: *which* op lost. A
profile under ``--amp bf16`` alone cannot say (it has no fp32 times to hold its own against),
and two tables read by eye hide a 2 ms op among fifty rows. Made by `compare_profiles` and
``%%profile_gpu --compare NAME``.

Method: each op's self time (device self time when both profiles have device activity, else self
CPU time) summed per op name and divided by the profile's recorded steps, so ``--steps 1`` and
``--steps 5`` compare. Self times, not totals: a parent's total holds its children's, and summing
totals would count a matmul once per wrapper. An op is called slower or faster only when its time
changed by `MIN_RATIO` or more *and* by at least `MIN_SHARE` of the larger profile's op time: one
profiled step on a busy host varies by ~10-20% (docs/benchmarks.md), and a 3x change of a 20 us
op is not what the cell's time is made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .results import ResultMixin

if TYPE_CHECKING:
    import pandas as pd

    from .profile_result import ProfileResult

__all__ = ["compare_profiles", "ProfileComparison", "MIN_RATIO", "MIN_SHARE"]

MIN_RATIO = 1.25  # slower: after >= 1.25x before; faster: after <= before / 1.25
MIN_SHARE = 0.02  # and the change is at least 2% of the larger profile's op time per step


def _steps(result: ProfileResult) -> int:
    """Recorded steps: the ProfilerStep markers (a schedule's active steps), 1 for a bare trace."""
    return max(1, len(result.step_times_us))


def _label(default: str, result: ProfileResult) -> str:
    return result.recipe_label or default


@dataclass
class ProfileComparison(ResultMixin):
    """``before`` against ``after``, per op name, per step. ``rows`` are dicts (largest change first);
    ``ops`` is the same as a DataFrame; ``slower``/``faster``/``new``/``gone`` the rows called out."""

    kind = "profile_compare"

    before: ProfileResult = field(repr=False)
    after: ProfileResult = field(repr=False)
    labels: tuple[str, str]
    time_column: str  # "device_self_us" or "cpu_self_us"
    rows: list[dict] = field(default_factory=list)
    made_by: str = "compare_profiles()"

    @property
    def on_device(self) -> bool:
        return self.time_column == "device_self_us"

    @property
    def steps(self) -> tuple[int, int]:
        return _steps(self.before), _steps(self.after)

    @property
    def step_time_us(self) -> tuple[float | None, float | None]:
        """Each profile's median recorded step (its whole window for a trace without step markers)."""
        def median(result):
            times = sorted(result.step_times_us)
            if not times:
                return result.window_us or None
            mid = len(times) // 2
            return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        return median(self.before), median(self.after)

    @property
    def op_time_us(self) -> tuple[float, float]:
        """Sum of the ops' self times per step, each profile."""
        return (sum(r["before_us"] for r in self.rows), sum(r["after_us"] for r in self.rows))

    def _called(self, test) -> list[dict]:
        floor = MIN_SHARE * max(self.op_time_us)
        return [r for r in self.rows if abs(r["change_us"]) >= floor and test(r)]

    @property
    def slower(self) -> list[dict]:
        return self._called(lambda r: r["before_us"] > 0 and r["after_us"] >= MIN_RATIO * r["before_us"]
                            and r["before_calls"])

    @property
    def faster(self) -> list[dict]:
        return self._called(lambda r: r["after_calls"] and r["after_us"] * MIN_RATIO <= r["before_us"])

    @property
    def new(self) -> list[dict]:
        """Ops only ``after`` ran (autocast's casts, a fused kernel that replaced others)."""
        return self._called(lambda r: not r["before_calls"])

    @property
    def gone(self) -> list[dict]:
        return self._called(lambda r: not r["after_calls"])

    @property
    def ops(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.rows, columns=_COLUMNS)

    def to_dataframe(self) -> pd.DataFrame:
        return self.ops

    def _payload(self) -> dict:
        return {"labels": list(self.labels), "time_column": self.time_column, "steps": list(self.steps),
                "step_time_us": list(self.step_time_us), "op_time_us": list(self.op_time_us),
                "ops": self.rows, "slower": [r["name"] for r in self.slower],
                "faster": [r["name"] for r in self.faster], "new": [r["name"] for r in self.new],
                "gone": [r["name"] for r in self.gone], "made_by": self.made_by}


_COLUMNS = ["name", "category", "before_calls", "after_calls", "before_us", "after_us", "change_us", "ratio"]


def _per_op(result: ProfileResult, column: str) -> dict[str, dict]:
    steps = _steps(result)
    ops: dict[str, dict] = {}
    for row in result.grouped_rows("op"):
        entry = ops.setdefault(row["name"], {"category": row["category"], "calls": 0, "us": 0.0})
        entry["calls"] += int(row["calls"])
        entry["us"] += float(row[column] or 0.0)
    for entry in ops.values():
        entry["calls"] /= steps
        entry["us"] /= steps
    return ops


def compare_profiles(before: ProfileResult, after: ProfileResult, *, labels: tuple[str, str] | None = None,
                     made_by: str = "compare_profiles()") -> ProfileComparison:
    """``after`` against ``before``, op by op, per step: e.g. a profile without and one with ``amp="bf16"``.

    Both must come from the same kind of device (two CPU profiles, or two CUDA ones; a loaded trace
    counts by the device it was recorded on). Device self times are compared where both profiles have
    device activity, else self CPU times. ``labels`` name the two in the display (default: the autocast
    recipe of a profile made under one, e.g. "autocast bf16 (cpu)", else "before" and "after").
    """
    from .profile_result import ProfileResult

    for name, value in (("before", before), ("after", after)):
        if not isinstance(value, ProfileResult):
            raise TypeError(f"compare_profiles takes two ProfileResults (nbaccel.profile(...).result, "
                            f"%%profile_gpu -r NAME, load_trace(...)); {name} is {type(value).__name__}")
    if before.device.type != after.device.type:
        raise ValueError(f"compare_profiles compares two profiles of one kind of device: before was recorded on "
                         f"{before.device.type}, after on {after.device.type}; their op times do not compare")
    column = "device_self_us" if before.on_device and after.on_device else "cpu_self_us"
    a, b = _per_op(before, column), _per_op(after, column)
    rows = []
    for name in {**a, **b}:
        x, y = a.get(name), b.get(name)
        before_us, after_us = (x["us"] if x else 0.0), (y["us"] if y else 0.0)
        rows.append({"name": name, "category": (y or x)["category"],
                     "before_calls": x["calls"] if x else 0, "after_calls": y["calls"] if y else 0,
                     "before_us": before_us, "after_us": after_us, "change_us": after_us - before_us,
                     "ratio": after_us / before_us if x and y and before_us > 0 else None})
    rows.sort(key=lambda r: -abs(r["change_us"]))
    labels = tuple(labels) if labels else (_label("before", before), _label("after", after))
    if len(labels) != 2 or not all(isinstance(s, str) and s for s in labels):
        raise ValueError(f"labels are two names, one per profile, e.g. ('fp32', 'bf16'); got {labels!r}")
    return ProfileComparison(before=before, after=after, labels=labels, time_column=column, rows=rows,
                             made_by=made_by)
