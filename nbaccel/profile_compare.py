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

Self time misleads where work moved between an op and its children: on a CPU without bf16 units,
``aten::convolution_backward`` under bf16 hands its work to a new child ``aten::_slow_conv2d_backward``,
and its self time fell 80x while the convolution backward got slower (a user trial). So an op whose
self time would be named slower or faster, but under which child op names appeared or vanished
(`children_new`, `children_gone`: its direct children, through autocast's re-dispatch of it), is
judged by its total time instead (`moved`), under the same share, ratio and spread rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .results import ResultMixin

if TYPE_CHECKING:
    import pandas as pd

    from .profile_result import ProfileResult

__all__ = ["compare_profiles", "ProfileComparison", "MIN_RATIO", "MIN_RATIO_CHECKED", "MIN_SHARE"]

# self time column -> the total time column of the same op (its duration, children included)
TOTALS = {"cpu_self_us": "cpu_total_us", "device_self_us": "device_total_us"}
_EVENT_TOTALS = {"cpu_self_us": "dur_us", "device_self_us": "device_total_us"}  # the same, per op event

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


def _owners(cols: dict) -> list[int]:
    """Per op event, the call it is a child of (-1 for a top-level op, or for a re-dispatch: autocast runs
    ``aten::linear`` again inside the ``aten::linear`` called, and that inner one's children are the call's)."""
    names, parent = cols["name"], cols["parent"]

    def call(i):
        while parent[i] >= 0 and names[parent[i]] == names[i]:
            i = parent[i]
        return i
    return [-1 if p < 0 or names[p] == names[i] else call(p) for i, p in enumerate(parent)]


def _per_step(result: ProfileResult, column: str) -> tuple[dict[str, list[float]], dict[str, list[float]]] | None:
    """({op name: its self time in each recorded step}, {op name: its total time in each step}), or None for
    fewer than two steps (no spread). A total counts calls only, not their re-dispatches (as `group_rows`)."""
    import bisect

    steps = result.step_ranges_us
    if len(steps) < 2:
        return None
    starts = [a for a, _ in steps]
    cols = result.op_columns
    times = cols["self_us"] if column == "cpu_self_us" else cols[column]
    totals, parent, names = cols[_EVENT_TOTALS[column]], cols["parent"], cols["name"]
    own: dict[str, list[float]] = {}
    whole: dict[str, list[float]] = {}
    for i, (name, ts, spent) in enumerate(zip(names, cols["ts_us"], times)):
        k = bisect.bisect_right(starts, ts) - 1
        if k >= 0 and ts <= steps[k][1]:
            own.setdefault(name, [0.0] * len(steps))[k] += float(spent or 0.0)
            if parent[i] < 0 or names[parent[i]] != name:
                whole.setdefault(name, [0.0] * len(steps))[k] += float(totals[i] or 0.0)
    return own, whole


@dataclass
class ProfileComparison(ResultMixin):
    """``before`` against ``after``, per op name, per step. ``rows`` are dicts (largest change first);
    ``ops`` is the same as a DataFrame; ``slower``/``faster``/``new``/``gone`` the rows called out;
    ``moved`` those of them (or of neither) judged by total time, their child ops having changed."""

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

    def _verdict(self, r, total: bool = False) -> str | None:
        """"slower", "faster" or None for an op both ran, by its self time (or its total): the change is at least
        `MIN_SHARE` of the larger profile's op time, `min_ratio` and, with steps, beyond their spread."""
        key = "total_" if total else ""
        before, after = r.get(f"before_{key}us"), r.get(f"after_{key}us")
        if not (r["before_calls"] and r["after_calls"]) or before is None or after is None \
                or abs(after - before) < MIN_SHARE * max(self.op_time_us):
            return None
        # an op of 0 self time before (a no-op aten::to that launches a cast kernel under autocast) counts too
        for way, low, high in (("slower", before, after), ("faster", after, before)):
            if high >= self.min_ratio * low and self._apart(r, way == "slower", key):
                return way
        return None

    def _apart(self, r, slower: bool, key: str = "") -> bool:
        """The two profiles' per-step times do not overlap (True without steps to check)."""
        if not self.spread_checked:
            return True
        b, a = r[f"before_{key}steps"], r[f"after_{key}steps"]
        low, high = (b, a) if slower else (a, b)
        return max(low) < min(high)

    def judged_by_total(self, r) -> bool:
        """Whether ``r`` is judged by its total time: its self time changed enough to be named, and child op names
        appeared or vanished under it, so its work may have moved to them or from them (see the module doc)."""
        return bool(r.get("children_new") or r.get("children_gone")) and self._verdict(r) is not None

    def verdict(self, r) -> str | None:
        """"slower", "faster" or None: how ``r`` is called out (new and gone ops aside)."""
        return self._verdict(r, total=self.judged_by_total(r))

    @property
    def slower(self) -> list[dict]:
        return [r for r in self.rows if self.verdict(r) == "slower"]

    @property
    def faster(self) -> list[dict]:
        return [r for r in self.rows if self.verdict(r) == "faster"]

    @property
    def moved(self) -> list[dict]:
        """Ops judged by their total time (`judged_by_total`): in ``slower`` or ``faster`` where their total
        changed past the rules, in neither where it did not (their self time's change alone is not the op's)."""
        return [r for r in self.rows if self.judged_by_total(r)]

    @property
    def unclear(self) -> list[dict]:
        """The `moved` ops whose total changed too little, or within its spread, to be called either way."""
        return [r for r in self.moved if self.verdict(r) is None]

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

        steps = ["before_steps", "after_steps", "before_total_steps", "after_total_steps"]
        return pd.DataFrame(self.rows, columns=_COLUMNS + (steps if self.spread_checked else []))

    def to_dataframe(self) -> pd.DataFrame:
        return self.ops

    def _payload(self) -> dict:
        return {"labels": list(self.labels), "time_column": self.time_column, "steps": list(self.steps),
                "spread_checked": self.spread_checked, "first_runs": list(self.first_runs),
                "step_time_us": list(self.step_time_us), "op_time_us": list(self.op_time_us),
                "ops": self.rows, "slower": [r["name"] for r in self.slower],
                "faster": [r["name"] for r in self.faster], "new": [r["name"] for r in self.new],
                "gone": [r["name"] for r in self.gone],
                "moved": [{"name": r["name"], "total": self.verdict(r)} for r in self.moved], "made_by": self.made_by}


_COLUMNS = ["name", "category", "before_calls", "after_calls", "before_us", "after_us", "change_us", "ratio",
            "before_total_us", "after_total_us", "children_new", "children_gone"]


def _per_op(result: ProfileResult, column: str) -> dict[str, dict]:
    """{op name: category, calls, self and total time per step, {direct child op name: its total time per step}}."""
    steps = _steps(result)
    ops: dict[str, dict] = {}
    for row in result.grouped_rows("op"):
        entry = ops.setdefault(row["name"], {"category": row["category"], "calls": 0, "us": 0.0, "total_us": 0.0,
                                             "children": {}})
        entry["calls"] += int(row["calls"])
        entry["us"] += float(row[column] or 0.0)
        entry["total_us"] += float(row[TOTALS[column]] or 0.0)
    cols = result.op_columns
    names, totals = cols["name"], cols[_EVENT_TOTALS[column]]
    for i, owner in enumerate(_owners(cols)):
        if owner >= 0 and names[owner] in ops:
            children = ops[names[owner]]["children"]
            children[names[i]] = children.get(names[i], 0.0) + float(totals[i] or 0.0)
    for entry in ops.values():
        entry["calls"] /= steps
        entry["us"] /= steps
        entry["total_us"] /= steps
        entry["children"] = {name: us / steps for name, us in entry["children"].items()}
    return ops


def _only_in(one: dict, other: dict) -> list[str]:
    """Child op names under ``one`` and not under ``other``, most time first."""
    return sorted((name for name in one if name not in other), key=lambda name: -one[name])


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
                     "ratio": after_us / before_us if x and y and before_us > 0 else None,
                     "before_total_us": x["total_us"] if x else 0.0, "after_total_us": y["total_us"] if y else 0.0,
                     # only for an op both ran: one only one profile ran is new or gone with all its children
                     "children_new": _only_in(y["children"], x["children"]) if x and y else [],
                     "children_gone": _only_in(x["children"], y["children"]) if x and y else []})
        if checked:
            for key, (per_a, per_b) in (("", (sa[0], sb[0])), ("total_", (sa[1], sb[1]))):
                rows[-1][f"before_{key}steps"] = per_a.get(name, [0.0] * _steps(before))
                rows[-1][f"after_{key}steps"] = per_b.get(name, [0.0] * _steps(after))
    rows.sort(key=lambda r: -abs(r["change_us"]))
    given = labels
    labels = tuple(labels) if isinstance(labels, (tuple, list)) else (_label("before", before), _label("after", after))
    if given is not None and not isinstance(given, (tuple, list)) or len(labels) != 2 \
            or not all(isinstance(s, str) and s for s in labels) \
            or given is not None and labels[0] == labels[1]:  # 'ab' was read as ('a', 'b') (a trial); "x", "x" too
        raise ValueError(f"labels are two names, one per profile, e.g. ('fp32', 'bf16'); got {given!r}")
    return ProfileComparison(before=before, after=after, labels=labels, time_column=column, rows=rows,
                             made_by=made_by, spread_checked=checked)
