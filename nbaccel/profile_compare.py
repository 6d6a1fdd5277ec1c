"""Two profiles of one cell, op by op: which ops got slower or faster, and which are new.

The question it answers is the one `%%amp` leaves when bf16 is no faster: *which* op lost. A
profile under ``--amp bf16`` alone cannot say (it has no fp32 times to hold its own against),
and two tables read by eye hide a 2 ms op among fifty rows. Made by `compare_profiles` and
``%%profile_gpu --compare NAME``.

Method: each op's self time (device self time when both profiles have device activity, else self
CPU time) summed per op name and divided by the profile's recorded steps, so ``--steps 1`` and
``--steps 5`` compare. Self times, not totals: a parent's total holds its children's, and summing
totals would count a matmul once per wrapper. An op is named only when its time changed by at least
`MIN_SHARE` of the larger profile's op time (a 3x change of a 20 us op is not what the cell's time is
made of) and beyond the noise: where both profiles recorded two or more steps, its per-step times in
the two must not overlap (every step of one above every step of the other) and differ by
`MIN_RATIO_CHECKED`; with one step in either there is no spread to read, and the change must reach
`MIN_RATIO` (a trial compared a profile with one of the same code and read ops "1.28x slower" and
"0.29x" from steps that varied that much).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .results import ResultMixin

if TYPE_CHECKING:
    import pandas as pd

    from .profile_result import ProfileResult

__all__ = ["compare_profiles", "ProfileComparison", "MIN_RATIO", "MIN_RATIO_CHECKED", "MIN_SHARE"]

MIN_RATIO = 1.25  # one step in a profile: slower means after >= 1.25x before; faster, after <= before / 1.25
# With per-step spreads that do not overlap the change is the code's, and a large op's 1.2x is named (a trial's
# convolution_backward +20.6 ms at 1.2x was left in "all others together", half the change).
MIN_RATIO_CHECKED = 1.1
MIN_SHARE = 0.02  # and the change is at least 2% of the larger profile's op time per step


def _steps(result: ProfileResult) -> int:
    """Recorded steps: the ProfilerStep markers (a schedule's active steps), 1 for a bare trace."""
    return max(1, len(result.step_times_us))


def _label(default: str, result: ProfileResult) -> str:
    return result.recipe_label or default


def _per_step(result: ProfileResult, column: str) -> dict[str, list[float]] | None:
    """{op name: its self time in each recorded step}, or None for fewer than two steps (no spread)."""
    import bisect

    steps = result.step_ranges_us
    if len(steps) < 2:
        return None
    starts = [a for a, _ in steps]
    cols = result.op_columns
    times = cols["self_us"] if column == "cpu_self_us" else cols[column]
    out: dict[str, list[float]] = {}
    for name, ts, spent in zip(cols["name"], cols["ts_us"], times):
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= steps[i][1]:
            out.setdefault(name, [0.0] * len(steps))[i] += float(spent or 0.0)
    return out


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
    spread_checked: bool = False  # both profiles had >= 2 steps: each row has before_steps / after_steps

    @property
    def on_device(self) -> bool:
        return self.time_column == "device_self_us"

    @property
    def steps(self) -> tuple[int, int]:
        return _steps(self.before), _steps(self.after)

    @property
    def step_time_us(self) -> tuple[float | None, float | None]:
        """Each profile's mean recorded step (its whole window for a trace without step markers): a mean,
        as the ops' times per step are (a median beside them read 1.12x faster against ops 1.02x slower)."""
        def mean(result):
            times = result.step_times_us
            return sum(times) / len(times) if times else (result.window_us or None)
        return mean(self.before), mean(self.after)

    @property
    def first_runs(self) -> tuple[bool, bool]:
        """Whether ``before`` and ``after`` were likely their code's first run (`ProfileResult.first_run`):
        one-off setup is in its times, and a step or op that reads faster (or slower) may be that setup.
        Unknown (a profile of the API, a loaded trace) counts as not."""
        return tuple(bool(getattr(r, "first_run", None)) for r in (self.before, self.after))

    @property
    def op_time_us(self) -> tuple[float, float]:
        """Sum of the ops' self times per step, each profile."""
        return (sum(r["before_us"] for r in self.rows), sum(r["after_us"] for r in self.rows))

    @property
    def min_ratio(self) -> float:
        return MIN_RATIO_CHECKED if self.spread_checked else MIN_RATIO

    def _called(self, test) -> list[dict]:
        floor = MIN_SHARE * max(self.op_time_us)
        return [r for r in self.rows if abs(r["change_us"]) >= floor and test(r)]

    def _apart(self, r, slower: bool) -> bool:
        """The two profiles' per-step times do not overlap (True without steps to check)."""
        if not self.spread_checked:
            return True
        low, high = (r["before_steps"], r["after_steps"]) if slower else (r["after_steps"], r["before_steps"])
        return max(low) < min(high)

    @property
    def slower(self) -> list[dict]:
        # an op of 0 self time before (a no-op aten::to that launches a cast kernel under autocast) counts too
        return self._called(lambda r: r["before_calls"] and r["after_calls"]
                            and r["after_us"] >= self.min_ratio * r["before_us"] and self._apart(r, True))

    @property
    def faster(self) -> list[dict]:
        return self._called(lambda r: r["before_calls"] and r["after_calls"]
                            and r["after_us"] * self.min_ratio <= r["before_us"] and self._apart(r, False))

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

        return pd.DataFrame(self.rows, columns=_COLUMNS + (["before_steps", "after_steps"] if self.spread_checked else []))

    def to_dataframe(self) -> pd.DataFrame:
        return self.ops

    def _payload(self) -> dict:
        return {"labels": list(self.labels), "time_column": self.time_column, "steps": list(self.steps),
                "spread_checked": self.spread_checked, "first_runs": list(self.first_runs),
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

    from .trace_result import MultiRankResult

    for name, value in (("before", before), ("after", after)):
        if isinstance(value, MultiRankResult):
            raise TypeError(f"compare_profiles takes two ProfileResults; {name} is a MultiRankResult (a folder of "
                            f"ranks): pass one rank's, {name}.ranks[r]")
        if not isinstance(value, ProfileResult):
            raise TypeError(f"compare_profiles takes two ProfileResults (nbaccel.profile(...).result, "
                            f"%%profile_gpu -r NAME, load_trace(...)); {name} is {type(value).__name__}")
    if before.device.type != after.device.type:
        raise ValueError(f"compare_profiles compares two profiles of one kind of device: before was recorded on "
                         f"{before.device.type}, after on {after.device.type}; their op times do not compare")
    column = "device_self_us" if before.on_device and after.on_device else "cpu_self_us"
    a, b = _per_op(before, column), _per_op(after, column)
    sa, sb = _per_step(before, column), _per_step(after, column)
    checked = sa is not None and sb is not None
    rows = []
    for name in {**a, **b}:
        x, y = a.get(name), b.get(name)
        before_us, after_us = (x["us"] if x else 0.0), (y["us"] if y else 0.0)
        rows.append({"name": name, "category": (y or x)["category"],
                     "before_calls": x["calls"] if x else 0, "after_calls": y["calls"] if y else 0,
                     "before_us": before_us, "after_us": after_us, "change_us": after_us - before_us,
                     "ratio": after_us / before_us if x and y and before_us > 0 else None})
        if checked:
            rows[-1]["before_steps"] = sa.get(name, [0.0] * _steps(before))
            rows[-1]["after_steps"] = sb.get(name, [0.0] * _steps(after))
    rows.sort(key=lambda r: -abs(r["change_us"]))
    given = labels
    labels = tuple(labels) if isinstance(labels, (tuple, list)) else (_label("before", before), _label("after", after))
    if given is not None and not isinstance(given, (tuple, list)) or len(labels) != 2 \
            or not all(isinstance(s, str) and s for s in labels) \
            or given is not None and labels[0] == labels[1]:  # 'ab' was read as ('a', 'b') (a trial); "x", "x" too
        raise ValueError(f"labels are two names, one per profile, e.g. ('fp32', 'bf16'); got {given!r}")
    return ProfileComparison(before=before, after=after, labels=labels, time_column=column, rows=rows,
                             made_by=made_by, spread_checked=checked)
