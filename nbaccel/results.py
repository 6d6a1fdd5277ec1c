"""What every result object shares: text, HTML and widget displays, and a JSON-safe dict.

Result objects keep raw numbers and derive the rest. They never import ipywidgets: rendering
lives in `nbaccel.render`, imported lazily, so a result can be built, pickled and printed in a
script or under torchrun with no frontend at all.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import TYPE_CHECKING

from . import __version__
from .options import command_line_made, magic_spelling

if TYPE_CHECKING:
    import pandas as pd

SCHEMA_VERSION = 1


class ResultMixin:
    """Subclasses set ``kind`` and implement ``_payload()`` (their own JSON-safe fields)."""

    kind = "result"

    def to_dict(self) -> dict:
        """The result as plain JSON: NaN and inf become None (JSON has neither; ``json.dumps``
        would write the non-standard ``NaN`` that other readers refuse)."""
        with self._spelling():
            payload = {"kind": self.kind, "schema_version": SCHEMA_VERSION, "nbaccel_version": __version__,
                       **self._payload()}
        return json_safe(payload)

    def _spelling(self):
        """Advice and warnings are worded when read, and name options (`nbaccel.options.option`) the way
        the result's maker took them: ``--repeat`` for a ``%%amp`` result printed later from Python (it
        read "use a larger repeat" under a header saying %%amp), ``repeat`` for ``compare_amp``'s."""
        made_by = getattr(self, "made_by", None)
        return magic_spelling(command_line_made(made_by)) if isinstance(made_by, str) else contextlib.nullcontext()

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        from .render.text import render_text

        with self._spelling():
            return render_text(self)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # IPython's pretty printer walks the MRO and stops at the first class that defines
        # __repr__ or _repr_pretty_: a result dataclass's generated __repr__ would win over the
        # mixin's, and `res` at a terminal prompt would print a field dump instead of the report.
        cls._repr_pretty_ = ResultMixin._repr_pretty_

    def _repr_pretty_(self, printer, cycle):
        printer.text("<...>" if cycle else str(self))

    def _repr_html_(self) -> str:
        from .render.html import render_html

        with self._spelling():
            return render_html(self)

    def show(self):
        """Display as an ipywidget where a widget frontend exists, else as HTML/text."""
        from .render.display import display_result

        with self._spelling():
            display_result(self)


def json_safe(value):
    """``value`` with every NaN/inf float (also numpy's) as None, numpy scalars and arrays as Python
    numbers and lists, walking dicts, lists and tuples (tuples become lists, as JSON makes them)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":  # np.float64(...), an array
        return json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# Headline fields per kind, as dotted paths into ``to_dict()``; `results_frame` reads these, so a
# saved notebook's results load the same way in later nbaccel versions.
_HEADLINES = {
    "amp": {"device": "device", "device_name": "device.name", "dtype": "amp.name", "speedup": "speedup", "speedup_claimed": "speedup_claimed",
            # the headline's hedge ("(uncertain)": the IQRs overlap), kept when results are saved
            "speedup_uncertain": "speedup_uncertain", "memory_saving": "memory_saving", "memory_firm": "memory_firm",
            "fp32_median_s": "baseline.time.median_s", "amp_median_s": "amp.time.median_s",
            "drift_max_rel": "drift.max_rel"},
    "profile": {"device": "device", "device_name": "device.name", "dtype": "header.dominant_dtype", "wall_us": "header.wall_us", "device_time_us": "header.device_time_us",
                "flops_per_s": "header.flops_per_s", "fraction_of_peak": "header.fraction_of_peak",
                "tensor_core_share": "tensor_cores.share"},
    # %memory_budget's results share kind "budget"; their ``view`` says which one (status, cell, oom).
    "budget": {"device": "device", "budget_bytes": "budget_bytes", "used_now": "used_now"},
    "budget.cell": {"device": "device", "cell": "cell", "budget_bytes": "budget_bytes", "used_bytes": "used_bytes",
                    "added_bytes": "added_bytes", "status": "status"},
    "budget.oom": {"device": "device", "error_type": "error_type", "requested_bytes": "facts.requested",
                   "allocated_bytes": "allocated_bytes", "limit_bytes": "limit_bytes", "location": "location"},
    "estimate": {"device": "probe_device", "model": "model", "batch": "batch", "budget_bytes": "budget_bytes",
                 "fp32_peak_bytes": "single_gpu.fp32.total", "fits_fp32": "single_gpu.fp32.fits"},
    "multirank": {"world_size": "world_size", "straggler_rank": "straggler.rank",
                  "straggler_step_us": "straggler.step_time_us", "excess_fraction": "straggler.excess_fraction"},
    "env": {"torch": "sections.software.torch", "cuda": "sections.software.CUDA (torch built with)"},
    # nbaccel.distributed's gathered reports: medians across ranks and the rank that held them back
    "compare_amp_ranks": {"world_size": "world_size", "dtype": "dtype", "speedup_median": "summary.speedup.median",
                          "speedup_min": "summary.speedup.min", "slowest_rank": "summary.speedup.slowest_rank",
                          "fp32_median_s": "summary.fp32_median_s.median",
                          "amp_median_s": "summary.amp_median_s.median",
                          "amp_peak_bytes_max": "summary.amp_peak_bytes.max"},
    "profile_ranks": {"world_size": "world_size", "window_us_median": "summary.window_us.median",
                      "window_us_max": "summary.window_us.max", "slowest_rank": "summary.window_us.slowest_rank",
                      "device_time_us_median": "summary.device_time_us.median"},
    "memory_budget_ranks": {"world_size": "world_size", "peak_bytes_median": "summary.peak_bytes.median",
                            "peak_bytes_max": "summary.peak_bytes.max", "max_rank": "summary.peak_bytes.max_rank",
                            "over_ranks": "over_ranks"},
}


def _device_spec(info: dict) -> str | None:
    """"cpu", "cuda:0": one spelling in the ``device`` column for every kind (a trial's frame read "AMD EPYC",
    "CPU: AMD EPYC" and "cpu" for one CPU, so a filter by device found a third of the rows)."""
    kind, index = info.get("type"), info.get("index")
    return None if kind is None else f"{kind}:{index}" if index is not None else kind


def _dig(data, path):
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def results_frame(records) -> pd.DataFrame:
    """One row per saved result (dicts from ``to_dict()``, JSON strings, or result objects).

    Records from any schema version load: unknown kinds keep their generic columns, and fields a
    version did not have are left empty, so notebooks saved by older nbaccel still compare.
    """
    import pandas as pd
    # one result, or one of nbaccel.distributed's reports (a to_dict() without iteration): a one-row frame
    if isinstance(records, (str, dict, ResultMixin)) or (hasattr(records, "to_dict") and not hasattr(records, "__iter__")):
        records = [records]  # one result: a one-row frame, not "'AmpResult' object is not iterable"
    if records is None or not hasattr(records, "__iter__"):
        raise TypeError(f"results_frame takes results, their to_dict() or to_json(), or a list of them; got "
                        f"{type(records).__name__}")
    rows = []
    for i, record in enumerate(records):
        if isinstance(record, str):
            try:
                record = json.loads(record)
            except json.JSONDecodeError:
                raise ValueError(f"record {i} is a string that is not JSON ({record[:60]!r}): pass to_json() "
                                 "output; to read a file, json.load(open(path)) first") from None
        elif hasattr(record, "to_dict"):
            record = record.to_dict()
        if not isinstance(record, dict) or "kind" not in record:
            raise ValueError(f"record {i} is not a saved nbaccel result (no 'kind'): pass results, their "
                             f"to_dict() or to_json(); got {type(record).__name__} {str(record)[:60]}")
        row = {"kind": record.get("kind"), "schema_version": record.get("schema_version", 0),
               "nbaccel_version": record.get("nbaccel_version")}
        view = record.get("view")
        if view is not None:
            row["view"] = view
        headlines = _HEADLINES.get(f"{row['kind']}.{view}") or _HEADLINES.get(row["kind"], {})
        for column, path in headlines.items():
            row[column] = _dig(record, path)
        if isinstance(row.get("device"), dict):  # a DeviceInfo's to_dict(): its spec, as the budgets' rows read
            row["device"] = _device_spec(row["device"])
        rows.append(row)
    frame = pd.DataFrame(rows)
    # Ranks and counts stay whole numbers where another kind's row leaves them empty (pandas' NaN would make
    # them floats: a trial's slowest_rank read 1.0 beside a profile's row).
    for column in frame.columns:
        if (column.endswith("_rank") or column == "world_size") and frame[column].dtype.kind == "f":
            values = frame[column].dropna()
            if (values == values.round()).all():
                frame[column] = frame[column].astype("Int64")
    return frame
