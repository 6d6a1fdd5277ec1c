"""A memory budget: measure the peak of every cell (or ``with`` block) and compare it with a limit.

What is compared with the budget is the device's peak during the cell, in absolute terms (not
what the cell added), because the budget is for the process:

* CUDA: the caching allocator's peak *reserved* bytes (``max_memory_reserved`` after
  ``reset_peak_memory_stats``): that is what ``nvidia-smi`` and the out-of-memory check see, and
  what ``set_per_process_memory_fraction`` caps. The peak *allocated* bytes (what tensors held)
  are recorded beside it.
* CPU: the process's peak resident set (VmHWM, reset per cell through ``/proc/self/clear_refs``
  after ``malloc_trim``; `memory.PeakMeter`). The CPU has no per-process allocator cap, so a CPU
  budget is soft: it is checked after the cell, never enforced during it.

``--enforce`` on CUDA calls ``torch.cuda.set_per_process_memory_fraction(budget / total)``.
torch before 2.7 has no getter for that fraction, so nbaccel remembers what it set and puts back
the value it read before (where the getter exists) or 1.0 (no cap, torch's default) on release.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .keywords import explains_keywords
from .device import DeviceError, device_index, device_info, resolve_device
from .holders import Holder, namespace_holders
from .memory import (MAX_BYTES, NUMBER_PATTERN, UNIT_PATTERN, UNITS, PeakMeter, cuda_counters, current_rss,
                     format_bytes, take_harness)
from .options import in_magic, option
from .render.common import plural
from .results import ResultMixin

if TYPE_CHECKING:
    import pandas as pd

NEAR = 0.75  # a cell that used at least this share of the budget gets a gauge
# A cell whose peak rose at least this much above the usage it started from pushed usage up; less is noise
# (any Python code moves RSS by a few pages). See `verdict`.
PUSHED = 2**20
# Unwritten memory (see `CellRecord.unwritten_would_exceed`) below this is not worth a note, and a cell that
# adds less than UNWRITTEN_CELL_WORTH to it gets none (the earlier cell that reserved it was told).
UNWRITTEN_WORTH_SAYING = 256 * 2**20
UNWRITTEN_CELL_WORTH = 64 * 2**20


class BudgetError(ValueError):
    """Input a budget cannot be made of; the message says what to write instead."""


class BudgetExceeded(RuntimeError):
    """A cell went over a strict budget (``--strict`` / ``strict=True``)."""


class BudgetWarning(UserWarning):
    """A block went over a soft budget (the script-side counterpart of the cell warning)."""


def device_memory(device: torch.device) -> int | None:
    """Total memory of a device: the GPU's capacity, or the host's physical memory for the CPU."""
    return device_info(device).total_memory


MIN_BUDGET = 2**20  # below this no Python process fits: a unit was mistyped (1B for 1GB)


def _size_text(value: float, units) -> str:
    """``2e9`` -> ``2GB`` (3 significant digits) in the largest of ``units`` that gives at least 1."""
    for unit, size in units:
        if value >= size or unit == units[-1][0]:
            n = value / size
            return (f"{n:.3g}" if n < 1000 else f"{n:.0f}") + unit
    raise AssertionError


_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _quote(text: str) -> str:
    return text if in_magic() else repr(text)


def _unitless_fix(raw: str, value: float, where: str) -> str:
    """The message for a bare number above 1: a share is at most 1, so a unit was left out."""
    share = f"a number without a unit is a share of {where} (at most 1, e.g. 0.8)"
    if value >= MIN_BUDGET:  # a byte count: say it in units
        decimal, binary = _size_text(value, _DECIMAL), _size_text(value, _BINARY)
        first, second = (binary, decimal) if float(binary[:-3]) * dict(_BINARY)[binary[-3:]] == value else \
            (decimal, binary)
        return f"{raw} has no unit: write {_quote(first)} (= {value:,.0f} bytes) or {_quote(second)}; {share}"
    # `%memory_budget 50` most likely meant 50 %, which is one keystroke away; 2 or 1.5 a size (a trial's 1.5
    # was offered 1.5 % first)
    if value <= 100 and value >= 10 and value == int(value):
        return (f"{raw} has no unit: write {_quote(raw + '%')} for {raw} % of {where}, or a size: "
                f"{_quote(raw + 'GiB')}, {_quote(raw + 'GB')} or {_quote(raw + 'MiB')}; a number without a unit is a "
                "share of at most 1, e.g. 0.8")
    percent = f", or {_quote(raw + '%')} for {raw} % of {where}" if value <= 100 else ""
    return (f"{raw} has no unit: write {_quote(raw + 'GiB')}, {_quote(raw + 'GB')} or {_quote(raw + 'MiB')}{percent}; "
            f"{share}")


def _too_large(size: float, where: str, total: int, device: torch.device, raw: str | None = None) -> BudgetError:
    # The size as the user wrote it first: a trial's "6TB" was echoed as "5.46 TiB", a number they never typed.
    asked = f"{raw} ({format_bytes(size)})" if raw and format_bytes(size) != raw else format_bytes(size)
    return BudgetError(f"a budget of {asked} is larger than {where} ({format_bytes(total)} on "
                       f"{device}); use at most {format_bytes(total)}, or a share such as 0.9")


def _not_positive(raw: str, where: str) -> BudgetError:
    """The one refusal of a zero or negative budget (``-5GB``, ``0``, ``0.00``, ``0%``, ``-5%``, ``0GiB``);
    its share example is in the notation the user wrote (``80%`` after a percentage)."""
    share = _quote("80%") if raw.endswith("%") else "0.8"
    return BudgetError(f"a budget must be positive, got {raw}; write e.g. {share} (a share of {where}) or "
                       f"{_quote('6GiB')}")


def _sized(raw: str, where: str, total: int | None, device: torch.device) -> int:
    """A budget with a unit (``6GiB``, ``1PiB``) -> bytes. Refuses sizes under 1 MiB (a unit was
    mistyped: ``1B`` for ``1GB``) and, when ``total`` is given, sizes larger than it, however large
    (``1e30GB`` is larger than the host, not unreadable)."""
    sized = re.fullmatch(rf"({NUMBER_PATTERN})\s*({UNIT_PATTERN})", raw, flags=re.I)
    if sized is None:
        raise BudgetError(f"cannot read {raw!r} as a budget; write e.g. {_quote('6GiB')}, {_quote('6GB')}, "
                          f"{_quote('512MiB')}, or 0.8 (a share of {where})")
    number, unit = sized.groups()
    value = float(number) * UNITS[unit.lower()]
    if not math.isfinite(value):  # 1e309GiB
        raise BudgetError(f"{raw} is not a finite size; write e.g. {_quote('6GiB')} or 0.8 (a share of {where})")
    if value == 0:  # 0GiB: no bigger unit makes it a budget
        raise _not_positive(raw, where)
    if value < MIN_BUDGET:  # 1B, 0.5B, 512KiB
        bigger = {"b": "GB", "kb": "MB", "kib": "MiB", "k": "M", "ki": "Mi",
                  "mb": "GB", "mib": "GiB", "m": "G", "mi": "Gi"}.get(unit.lower(), "GiB")
        rss = current_rss()
        raise BudgetError(f"{raw} is {format_bytes(int(value))}: a budget under 1 MiB cannot hold a Python process"
                          + (f" (this one uses {format_bytes(rss)} now)" if rss else "")
                          + f"; did you mean {_quote(number + bigger)}?")
    if total and value > total:
        raise _too_large(value, where, total, device, raw)
    if value > MAX_BYTES:  # where no total was given to compare with (a per-GPU budget of estimate_memory)
        raise BudgetError(f"{raw!r} is larger than any machine's memory; write e.g. {_quote('6GiB')}")
    return int(value)


def size_reading(text) -> str:
    """How a unit that reads two ways was read, for the status line; "" otherwise.

    A single letter: ``6G`` -> "6G read as 6 GiB, ...". docker, systemd and Kubernetes disagree on what
    ``G`` means (Kubernetes: 10**9); nbaccel reads it as docker and systemd do, since its own --enforce
    note tells users to write ``MemoryMax=6G``, and says so.

    A lowercase b after a prefix (``6Gb``, ``512mb``, ``6Gib``): b is bits by convention, but nobody sizes
    memory in gigabits, so it is read as bytes, like ``6GB`` (units are read in any case) -- and said, since
    that is a reading, not what the text says: "6Gb read as 6 GB (bytes; a lowercase b usually means bits)"."""
    if not isinstance(text, str):
        return ""
    letter = re.fullmatch(rf"\s*({NUMBER_PATTERN})\s*([kmgt])\s*", text, flags=re.I)
    if letter is not None:
        number, unit = letter[1], letter[2].upper()
        decimal = float(number) * 1000 ** ("KMGT".index(unit) + 1)
        return (f"{text.strip()} read as {number} {unit}iB, as docker and systemd read {letter[2]} "
                f"(write {number}{unit}B for {decimal:,.0f} bytes)")
    bits = re.fullmatch(rf"\s*({NUMBER_PATTERN})\s*([kmgtpe]i?b)\s*", text, flags=re.I)
    if bits is not None and bits[2].endswith("b"):  # the b as typed: 6GB and 6gB are bytes as written
        number, unit = bits[1], bits[2]
        read = unit[0].upper() + unit[1:-1].lower() + "B"  # Gb -> GB, gib -> GiB
        return f"{text.strip()} read as {number} {read} (bytes; a lowercase b usually means bits)"
    return ""


def _share(raw: str, share: float, where: str, total: int | None) -> int:
    """A share in (0, 1] of the device (``0.8``, ``80%``) -> bytes: the one range check of both notations."""
    if share <= 0:
        raise _not_positive(raw, where)
    if share > 1:
        # Above 1 a bare number is a size that lost its unit (2e9, 12), so its fix offers sizes; a
        # percentage cannot be one, so its fix is a smaller percentage.
        if not raw.endswith("%"):
            raise BudgetError(_unitless_fix(raw, share, where))
        raise BudgetError(f"{raw} is more than all of {where}: a share is at most 100%; write e.g. "
                          f"{_quote('80%')}, or a size such as {_quote('6GiB')}")
    if not total:
        raise BudgetError(f"the size of {where} is unknown here, so a share cannot be used; give a size "
                          f"({_quote('6GiB')})")
    size = int(share * total)
    if size < MIN_BUDGET:
        raise BudgetError(f"a share of {raw} is {format_bytes(size)} of {where}: a budget under 1 MiB cannot "
                          "hold a Python process; use a share such as 0.8")
    return size


def read_share(text: str) -> tuple[float, bool] | None:
    """A share as text: ``"0.8"`` -> (0.8, False), ``"80%"`` or ``"80 %"`` -> (0.8, True: a percentage), a sign
    kept for the range error; None for any other text. The one reading of the notation for a budget, a
    share budget's wording (`share_reading`) and ``--near`` (`check_near`)."""
    raw = text.strip()
    percent = re.fullmatch(rf"(-?{NUMBER_PATTERN})\s*%", raw, flags=re.I)
    if percent:
        return float(percent[1]) / 100, True
    if re.fullmatch(rf"-?{NUMBER_PATTERN}", raw, flags=re.I):
        return float(raw), False
    return None


# a comma or underscore between digits with three digits after it: 2,000MB, 2_000_000_000 (not 1,5GB)
_DIGIT_SEPARATOR = re.compile(r"(?<=[0-9])[,_](?=[0-9]{3}(?:[^0-9]|$))")


def parse_budget(text, device: torch.device, total: int | None = None, limit: bool = True) -> int:
    """``"6GiB"``, ``"6GB"``, ``"512MiB"``, ``"6G"`` (= 6GiB, see `size_reading`) -> bytes; a number without a
    unit is a share of the device.

    ``0.8``, ``8e-1``, ``.8``, ``80%`` (and the numbers 0.8, 1) are shares in (0, 1]. Text without a unit
    above 1 (``2000000000``, ``2e9``, ``12``: the magic's line) is refused with the sizes it could
    have meant; a Python number above 1 is bytes (``6 * 2**30``, ``2e9``), like torch's APIs.
    Raises `BudgetError` (with the fix) for negative or zero sizes, unknown units, budgets under
    1 MiB (``1B`` for ``1GB``) and, with ``limit``, budgets larger than the device.
    """
    where = "the GPU" if device.type == "cuda" else "this host's physical memory"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TypeError(f"{option('budget')} takes a size such as '6GiB' or a share such as 0.8, got "
                          f"{type(text).__name__} {text!r}")
    if isinstance(text, str) and _DIGIT_SEPARATOR.search(text):
        # a trial's 2,000MB and 2_000_000_000 were "cannot read": the separators are the thing to drop
        plain = _DIGIT_SEPARATOR.sub("", text).strip()
        try:
            parse_budget(plain, device, total, limit)
        except BudgetError as exc:
            raise BudgetError(f"write {text.strip()!r} without digit separators ({plain!r}); then: {exc}") from None
        raise BudgetError(f"cannot read {text.strip()!r} as a budget: write it without digit separators, "
                          f"{_quote(plain)}")
    total = device_memory(device) if total is None else total
    number = text if isinstance(text, (int, float)) else None
    if number is None and re.fullmatch(NUMBER_PATTERN, text.strip(), flags=re.I):
        number = float(text)
    if number is not None and not math.isfinite(number):  # 1e309, float("inf"): no size to suggest
        raise BudgetError(f"{text if in_magic() else option('budget', text)} is not a finite number; write e.g. {_quote('6GiB')} or 0.8 "
                          f"(a share of {where})")
    if isinstance(text, (int, float)) and text > 1:
        # From Python a number above 1 is bytes, as in torch's own memory APIs (6 * 2**30, 2e9);
        # only text (the magic's line) without a unit is ambiguous, and refused below.
        size = int(text)
        if size < MIN_BUDGET:
            raise BudgetError(f"{option('budget', text)} is {text:g} bytes: a budget under 1 MiB cannot hold a "
                              f"Python process (from Python a number above 1 is bytes) -- did you mean '{text:g}GiB'?")
        if limit and total and size > total:
            raise _too_large(size, where, total, device)
        return size
    raw = text.strip() if isinstance(text, str) else repr(text)
    if raw.startswith("-"):  # no pattern below reads a sign
        raise _not_positive(raw, where)
    share = read_share(raw)
    if share is not None:  # 80% is the share 0.8, with the same range
        return _share(raw, share[0], where, total)  # at most the total
    return _sized(raw, where, total if limit else None, device)  # checks the size against total itself


def share_reading(text, device: torch.device, total: int | None = None) -> str:
    """How a share budget (``0.5``, ``50%``, the number 0.5; already read by `parse_budget`) came to its size,
    in the words typed: "0.5 of this host's 23.5 GiB of physical memory", "50% of the GPU's 79.2 GiB";
    "" for a size, which is its own reading. (A trial's estimate of ``0.5`` said "11.8 GiB (as given)".)"""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        return ""
    if isinstance(text, (int, float)):
        typed = repr(text) if 0 < text <= 1 else ""  # from Python a number above 1 is bytes
    else:
        typed = text.strip() if read_share(text) else ""
    total = device_memory(device) if total is None else total
    if not typed or not total:
        return ""
    if device.type == "cuda":
        return f"{typed} of the GPU's {format_bytes(total)}"
    return f"{typed} of this host's {format_bytes(total)} of physical memory"


def checked_share(text: str, name: str, what: str, example: str, error: type[Exception] = BudgetError,
                  zero: str = "") -> float:
    """``text`` read as a share in (0, 1] (`read_share`: ``"0.9"``, ``"90%"``), else ``error`` saying so in the
    notation typed: "NAME takes WHAT such as EXAMPLE, got 'x'", "NAME is WHAT between 0% and 100%ZERO, got 150%".
    For ``--near`` and ``%%amp --max-snapshot``."""
    read = read_share(text)
    if read is None:
        raise error(f"{name} takes {what} such as {example}, got {text!r}")
    share, percent = read
    if not 0 < share <= 1:  # also refuses NaN
        bounds = "0% and 100%" if percent else "0 and 1"
        raise error(f"{name} is {what} between {bounds}{zero}, got {text.strip()}{_percent_meant(share, percent)}")
    return share


def _percent_meant(share: float, percent: bool) -> str:
    """A share typed as a percentage without its % sign (a trial's ``--near 50``): the two spellings meant."""
    return f" (for {share:g}%: {share / 100:g} or {share:g}%)" if not percent and 1 < share <= 100 else ""


def check_near(near) -> float:
    """``near`` (``--near``): the share of the budget from which a cell gets a gauge, in (0, 1]: a number, or
    text as the budget itself is read (``"0.9"``, ``"90%"``; a trial's ``--near 90%`` got argparse's "invalid
    float value", and ``near="90%"`` a TypeError). A range error is in the notation given."""
    if isinstance(near, str):
        return checked_share(near, option("near"), "a share of the budget", "0.9 or 90%")
    if isinstance(near, bool) or not isinstance(near, (int, float)):
        raise TypeError(f"{option('near')} takes a share of the budget between 0 and 1 such as 0.75 (or '75%'), got "
                        f"{type(near).__name__} {near!r}")
    if not 0 < near <= 1:  # also refuses NaN
        raise BudgetError(f"{option('near')} is a share of the budget between 0 and 1, got {near}"
                          f"{_percent_meant(near, False)}")
    return near


def share_text(fraction: float | None) -> str:
    """``0.93`` -> ``93%``; ``n/a`` without a budget; ``12x`` from ten times the budget on, where a
    percentage would be a long number that reads as a glitch."""
    if fraction is None or fraction != fraction:
        return "n/a"
    return f"{fraction:.0%}" if fraction < 10 else f"{fraction:,.0f}x"


# --- per-cell measurement ------------------------------------------------------------------------

@dataclass
class CellRecord:
    """One watched cell (or block): its peaks, the budget it was held to, and the verdict."""

    label: str
    budget_bytes: int
    used_bytes: int  # compared with the budget: CUDA peak reserved / CPU peak RSS (absolute)
    added_bytes: int  # what the cell added over the device's usage before it
    allocated_peak_bytes: int | None  # CUDA only: peak of what tensors held
    before_bytes: int
    seconds: float
    status: str  # ok | near | over | already near | already over | error | oom (see `verdict`)
    error: str | None = None
    method: str = ""
    # "%%amp" / "compare_amp": the peak is of its comparison runs, not one plain run; "%%profile_gpu" /
    # "nbaccel.profile": it includes the profiler's recorded events
    harness: str | None = None
    harness_bytes: int = 0  # the host snapshot that comparison held (process memory: counted by a CPU budget)
    after_bytes: int | None = None  # usage when the cell ended (CUDA reserved / CPU RSS); None: not read
    # CPU: memory the cell allocated but left unwritten (torch.empty), not in RSS until written (PeakMeter)
    unwritten_bytes: int = 0
    # ... and what every watched cell so far left unwritten, the cells since that wrote or freed some taken
    # off (`Watcher.unwritten_total`): two cells of torch.empty(1 GiB) are 2 GiB that will become resident.
    # Never below the cell's own: the tally adds the cell's signed change to a total that is at least 0.
    unwritten_total_bytes: int = 0

    @property
    def unwritten_would_exceed(self) -> bool:
        """Whether memory the cell reserved but has not written yet takes the process over the budget
        once written: ``x = torch.empty(3 * 2**30, dtype=torch.uint8)`` passed a 1 GB strict budget, and
        the cell that filled it was blamed. Counted with what earlier cells left unwritten (two cells of
        torch.empty(200 MB) under a budget 300 MiB away), but told only on a cell that added some of it. Under
        `UNWRITTEN_WORTH_SAYING` in all it is not worth a note: a tensor written partway, or glibc keeping a
        freed chunk's pages."""
        return (self.unwritten_bytes >= UNWRITTEN_CELL_WORTH
                and self.unwritten_total_bytes >= UNWRITTEN_WORTH_SAYING
                and self.unwritten_written_bytes > self.budget_bytes)

    @property
    def unwritten_written_bytes(self) -> int:
        """What the process would hold once the unwritten memory is written: its usage at the cell's end
        (its peak where that was not read) plus the unwritten bytes."""
        held = self.after_bytes if self.after_bytes is not None else self.used_bytes
        return held + self.unwritten_total_bytes

    def change_words(self, added: str = "") -> str:
        """What the cell did to usage, for the "added" column: its peak over the start ("700 MiB"), and what
        it gave back by its end where that is more than noise ("freed 700 MiB" for ``del b``, which added 0 B).
        A cell that rose and came back down says how much it kept: a user trial re-ran ``emb = Embedding(...)``,
        read "added 390 MiB" and saw the usage unchanged (the new table is made before the old one is dropped).
        ``added`` goes before the first figure ("added 700 MiB") in a sentence."""
        grew = added + format_bytes(self.added_bytes)
        if self.freed_bytes < PUSHED:
            kept = None if self.after_bytes is None else max(0, self.after_bytes - self.before_bytes)
            if kept is None or self.added_bytes < PUSHED or self.added_bytes - kept < PUSHED:
                return grew
            kept = format_bytes(kept) if kept >= PUSHED else "none"
            return f"{grew} at its peak and kept {kept}" if added else f"{grew}, {kept} kept"
        freed = f"freed {format_bytes(self.freed_bytes)}"
        return freed if self.added_bytes < PUSHED else f"{grew}, {freed}"

    @property
    def freed_bytes(self) -> int:
        """What the cell gave back: usage at its start minus usage at its end (0 when it ended higher).
        ``added_bytes`` is the peak over the start, so it is 0 for a cell that only freed memory."""
        return max(0, self.before_bytes - self.after_bytes) if self.after_bytes is not None else 0

    @property
    def fraction(self) -> float | None:
        """Used / budget; None without a budget (never NaN: it would show as "nan%")."""
        return self.used_bytes / self.budget_bytes if self.budget_bytes else None

    def to_dict(self) -> dict:
        return {"cell": self.label, "used_bytes": self.used_bytes, "fraction": self.fraction,
                "added_bytes": self.added_bytes, "allocated_peak_bytes": self.allocated_peak_bytes,
                "before_bytes": self.before_bytes, "budget_bytes": self.budget_bytes, "status": self.status,
                "seconds": self.seconds, "error": self.error, "measured_under": self.harness,
                "harness_bytes": self.harness_bytes, "after_bytes": self.after_bytes, "freed_bytes": self.freed_bytes,
                "unwritten_bytes": self.unwritten_bytes, "unwritten_total_bytes": self.unwritten_total_bytes}


def verdict(before: int, added: int, budget: int, near: float) -> str:
    """A cell's status from the usage it started from (``before``) and what its peak added over that
    (``added``; the peak is ``before + added``).

    ``over`` / ``near`` blame the cell: its peak went over (came near) the budget and it either added
    memory (`PUSHED` or more) or started below the line. A cell that started over (near) the budget and
    added less is ``already over`` (``already near``): the memory was held before it ran (``del x`` after
    an over cell, a status query), so it gets no warning, no gauge and no ``--strict`` failure -- the
    live output and the history say the same.
    """
    used = before + added
    if used > budget:
        return "already over" if before > budget and added < PUSHED else "over"
    if used >= near * budget:
        return "already near" if before >= near * budget and added < PUSHED else "near"
    return "ok"


def unwritten_words(record: CellRecord) -> str:
    """The note for a cell whose reserved, still unwritten memory will take the process over the budget."""
    earlier = record.unwritten_total_bytes - record.unwritten_bytes >= UNWRITTEN_CELL_WORTH
    # "about": the total is a tally, lowered by any cell whose RSS grew by more than malloc handed out
    in_all = f", about {format_bytes(record.unwritten_total_bytes)} with what earlier cells reserved" if earlier else ""
    return (f"{record.label} reserved {format_bytes(record.unwritten_bytes)} that is not yet resident{in_all} "
            "(torch.empty and friends leave pages unwritten, and the process's RSS counts a page once it is "
            f"written): written, the process would hold about {format_bytes(record.unwritten_written_bytes)}, over "
            f"the {format_bytes(record.budget_bytes)} budget. It counts in the cell that writes it: make the "
            + ("tensors smaller, or del some" if earlier else "tensor smaller, or del it"))


def harness_words(record: CellRecord, device: str) -> str:
    """Why a cell measured under a comparison is reported, not failed: its peak is nbaccel's."""
    from .profile import PROFILE_API, PROFILE_MAGIC
    from .profile import harness_words as profiler_words

    if record.harness in (PROFILE_MAGIC, PROFILE_API):  # the profiler's recorded events, not a comparison's runs
        return profiler_words(record.harness)
    snapshot = (f" beside its {format_bytes(record.harness_bytes)} host snapshot of your state"
                if record.harness_bytes and not device.startswith("cuda") else "")
    return (f"the cell ran under {record.harness}, so this is the peak of its fp32 and reduced-precision runs"
            f"{snapshot}, not of one plain run: a strict budget does not fail it -- run the cell plainly to "
            "check it against the budget")


def usage_now(device: torch.device) -> tuple[int, int | None]:
    """(what is compared with the budget, allocated) right now."""
    if device.type == "cuda":
        counters = cuda_counters(device)
        return counters.reserved, counters.allocated
    return current_rss() or 0, None


class Watcher:
    """Measures consecutive cells: ``begin(label)`` before one, ``end(...)`` after it.

    A cell that never ends (``post_run_cell`` not called: an IPython that skips it after a syntax
    error, as older ones did; 9.x calls it, and the magic drops that row) is dropped at the next
    ``begin``, so the bookkeeping never carries a stale meter into the next cell.
    """

    def __init__(self, budget: int, device: torch.device, near: float = NEAR):
        self.budget, self.device, self.near = budget, device, near
        self.records: list[CellRecord] = []
        self._meter: PeakMeter | None = None
        self._label = ""
        self._before = (0, None)
        self._t0 = 0.0
        # The asynchronous CUDA error the synchronize after a cell raised (a kernel failed: a device-side
        # assert, an illegal address). The context cannot be used again, and every later synchronize
        # raises it anew, so from then on the meters skip it: a later `print(1)` is not failed for it.
        self.device_error: RuntimeError | None = None
        # CPU: what the watched cells allocated and left unwritten, as a running tally of each cell's signed
        # `PeakMeter.unwritten_change`, never below 0. A cell whose RSS grew by more than malloc handed out
        # (Python objects in pymalloc's arenas, a library loaded) lowers it too: it errs low, never high.
        self.unwritten_total = 0

    def begin(self, label: str) -> None:
        self.abandon()
        take_harness()  # a comparison noted before this cell is not this cell's
        # collect=False: a full gc.collect() costs tens of ms per cell; garbage only raises the baseline.
        meter = PeakMeter(self.device, collect=False, sync=self.device_error is None)
        meter.__enter__()
        self._meter, self._label = meter, label
        # On CUDA the meter has just read the counters: reuse them rather than read twice per cell.
        before = meter.before
        self._before = (before.reserved, before.allocated) if before is not None else usage_now(self.device)
        self._t0 = time.perf_counter()

    def abandon(self) -> None:
        """Stop a pending measurement without recording it."""
        meter, self._meter = self._meter, None
        if meter is not None:
            self._exit(meter)

    def _exit(self, meter: PeakMeter) -> RuntimeError | None:
        """End ``meter``; returns the asynchronous CUDA error its synchronize raised, if any (kept in
        ``device_error``)."""
        try:
            meter.__exit__(None, None, None)
        except RuntimeError as e:
            if self.device.type != "cuda":
                raise  # only CUDA's synchronize reports a run's failure late
            self.device_error = e
            return e
        return None

    def drop(self, record: CellRecord) -> None:
        """Take back a record that should not count (a cell whose magic refused its line). The list itself
        is kept: statuses hold it and go on growing."""
        self.records.remove(record)

    def end(self, error: BaseException | None = None, label: str | None = None) -> CellRecord | None:
        """Finish the pending measurement; ``label`` replaces the one given to `begin` (the cell's
        execution count is only reliable once the cell has run)."""
        meter, self._meter = self._meter, None
        if meter is None:
            return None
        seconds = time.perf_counter() - self._t0
        late = self._exit(meter)
        if error is None:  # a kernel of the cell failed after the cell returned: the cell's error
            error = late
        peak = meter.result
        before, before_alloc = self._before
        if self.device.type == "cuda":
            # PeakMeter reports deltas over what was allocated/reserved before the cell.
            added = peak.reserved_bytes or 0
            allocated = (before_alloc or 0) + peak.peak_bytes
            after = meter.after.reserved if meter.after is not None else None
        else:
            added, allocated, after = peak.peak_bytes, None, meter.rss_after
        used = before + added
        from .oom import is_oom

        if error is not None:
            status = "oom" if is_oom(error) else "error"
        else:
            status = verdict(before, added, self.budget, self.near)
        harness, harness_bytes = take_harness()
        record = CellRecord(label or self._label, self.budget, used, added, allocated, before, seconds, status,
                            f"{type(error).__name__}: {error}"[:200] if error is not None else None, peak.method,
                            harness=harness, harness_bytes=harness_bytes, after_bytes=after,
                            unwritten_bytes=meter.unwritten_bytes,
                            unwritten_total_bytes=self._tally_unwritten(meter))
        self.records.append(record)
        return record

    def _tally_unwritten(self, meter: PeakMeter) -> int:
        self.unwritten_total = max(0, self.unwritten_total + meter.unwritten_change)
        return self.unwritten_total


# --- the CUDA cap ----------------------------------------------------------------------------------

@dataclass
class _DeviceCaps:
    """nbaccel's caps on one GPU. ``%memory_budget --enforce`` sets one that lasts (``lasting``); each
    ``memory_budget(..., enforce=True)`` block adds its own for its duration (``blocks``, in the order
    entered). The last block's cap is in force, else the lasting one, else what was there before."""

    before: float  # the fraction in force before nbaccel capped this GPU
    lasting: float | None = None
    blocks: list = field(default_factory=list)  # [token, fraction] of the open blocks

    def in_force(self) -> float:
        if self.blocks:
            return self.blocks[-1][1]
        return self.lasting if self.lasting is not None else self.before


_caps: dict[int, _DeviceCaps] = {}  # device index -> nbaccel's caps on it


def _cap_fraction(device: torch.device, budget: int) -> float:
    if device.type != "cuda":
        raise BudgetError(f"{option('enforce', True)} needs a CUDA device: the CPU allocator has no per-process cap, so on the CPU "
                          f"only a soft budget ({'checked after each cell' if in_magic() else 'checked when the with block exits'}) is possible; for a hard host limit run "
                          "the kernel under a cgroup (systemd-run -p MemoryMax=6G, docker --memory 6g)")
    return min(1.0, budget / device_memory(device))


def _caps_of(index: int) -> _DeviceCaps:
    if index not in _caps:
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.7
        _caps[index] = _DeviceCaps(float(getter(index)) if getter else 1.0)
    return _caps[index]


def _set(index: int) -> None:
    """Put the fraction that should be in force on ``index`` into torch; forget a GPU nbaccel no longer caps."""
    caps = _caps[index]
    torch.cuda.set_per_process_memory_fraction(caps.in_force(), index)
    if caps.lasting is None and not caps.blocks:
        del _caps[index]


def apply_cap(device: torch.device, budget: int) -> float:
    """Cap the caching allocator of ``device`` at ``budget`` bytes until `release_cap` (``%memory_budget
    --enforce``; a new call replaces the cap); returns the fraction set. An open `push_cap` block's cap
    stays in force until the block ends, then this one does."""
    fraction = _cap_fraction(device, budget)
    index = device_index(device)
    _caps_of(index).lasting = fraction
    _set(index)
    return fraction


def push_cap(device: torch.device, budget: int) -> tuple[int, object]:
    """Cap ``device`` at ``budget`` bytes for a block; `pop_cap` with the returned handle puts back the
    cap that was in force before (a ``%memory_budget --enforce`` one, or an outer block's), not 1.0."""
    fraction = _cap_fraction(device, budget)
    index = device_index(device)
    token = object()
    _caps_of(index).blocks.append([token, fraction])
    _set(index)
    return index, token


def pop_cap(handle: tuple[int, object]) -> None:
    """End a `push_cap` block's cap. A no-op when `release_cap` already removed it (``%memory_budget off``
    inside the block): what off removed stays removed."""
    index, token = handle
    caps = _caps.get(index)
    if caps is None or not any(entry[0] is token for entry in caps.blocks):
        return
    caps.blocks = [entry for entry in caps.blocks if entry[0] is not token]
    _set(index)


def release_cap(device: torch.device | None = None) -> None:
    """Remove every cap nbaccel set on ``device`` (all GPUs when None), open blocks' too, and put back
    the fraction in force before nbaccel's first one."""
    indices = list(_caps) if device is None else [device_index(device)]
    for index in indices:
        caps = _caps.pop(index, None)
        if caps is not None:
            torch.cuda.set_per_process_memory_fraction(caps.before, index)


def capped_devices() -> list[int]:
    return sorted(_caps)


# --- results ---------------------------------------------------------------------------------------

def history_frame(records: list[CellRecord]) -> pd.DataFrame:
    import pandas as pd
    columns = ["cell", "used_bytes", "fraction", "added_bytes", "allocated_peak_bytes", "before_bytes",
               "budget_bytes", "status", "seconds", "error", "measured_under", "harness_bytes", "after_bytes",
               "freed_bytes", "unwritten_bytes", "unwritten_total_bytes"]
    return pd.DataFrame([r.to_dict() for r in records], columns=columns)


def usage_method(device: torch.device, unit: str = "cell") -> str:
    """How a peak is measured, per ``unit``: a notebook's cell, or a script's ``with`` block."""
    per = "per cell" if unit == "cell" else "per with block"
    if device.type == "cuda":
        return (f"peak reserved bytes of the CUDA caching allocator {per} (max_memory_reserved after "
                "reset_peak_memory_stats); peak allocated shown beside it")
    return (f"process peak RSS {per} (VmHWM reset through /proc/self/clear_refs after malloc_trim; "
            "a 1 ms RSS sampler where that is unavailable)")


@dataclass
class BudgetStatus(ResultMixin):
    """The state of a budget: its size, the cells measured so far, and what holds memory now."""

    kind = "budget"
    view = "status"

    active: bool
    device: str
    budget_bytes: int | None
    device_total: int | None
    enforce: bool = False
    strict: bool = False
    near: float = NEAR
    records: list[CellRecord] = field(default_factory=list)  # the watcher's own list: a live view until `off` (-r at set time)
    holders: list[Holder] = field(default_factory=list)
    used_now: int | None = None
    allocated_now: int | None = None
    note: str = ""
    # What is measured one at a time: "cell" (%memory_budget) or "block" (memory_budget() in a script, which
    # checks when each with block exits: its status said "checked after each cell" in a script, a trial)
    unit: str = "cell"

    @property
    def history(self) -> pd.DataFrame:
        """One row per watched cell: peak used, share of the budget, what it added, verdict."""
        return history_frame(self.records)

    @property
    def method(self) -> str:
        return usage_method(torch.device(self.device), self.unit)

    def to_dataframe(self) -> pd.DataFrame:
        return self.history

    def _payload(self) -> dict:
        return {"view": self.view, "active": self.active, "device": self.device, "budget_bytes": self.budget_bytes,
                "device_total": self.device_total, "enforce": self.enforce, "strict": self.strict, "near": self.near,
                "history": [r.to_dict() for r in self.records], "holders": [h.to_dict() for h in self.holders],
                "used_now": self.used_now, "allocated_now": self.allocated_now, "note": self.note,
                "unit": self.unit, "method": self.method}


@dataclass
class CellReport(ResultMixin):
    """What is shown after a cell that came near or went over the budget (a gauge or a warning)."""

    kind = "budget"
    view = "cell"

    record: CellRecord
    device: str
    strict: bool = False

    @property
    def over(self) -> bool:
        return self.record.status == "over"

    def _payload(self) -> dict:
        return {"view": self.view, "device": self.device, "strict": self.strict, **self.record.to_dict(),
                "method": self.record.method}


def status(watcher: Watcher | None, device: torch.device, namespace: dict | None = None, skip=lambda n: False,
           enforce: bool = False, strict: bool = False, note: str = "", unit: str = "cell",
           error_tb=None) -> BudgetStatus:
    used, allocated = usage_now(device)
    return BudgetStatus(
        active=watcher is not None, device=str(device), budget_bytes=watcher.budget if watcher else None,
        device_total=device_memory(device), enforce=enforce, strict=strict,
        near=watcher.near if watcher else NEAR, records=watcher.records if watcher else [],
        holders=namespace_holders(namespace or {}, skip=skip, error_tb=error_tb), used_now=used, allocated_now=allocated, note=note,
        unit=unit,
    )


# --- scripts: a context manager --------------------------------------------------------------------

def over_budget_words(record: CellRecord) -> str:
    """A script's BudgetWarning (and BudgetExceeded): the peak, what the block itself added, and where the
    process alone was over the budget before it (a trial's warning gave the peak only). A block that adds
    nothing to a process already over is "already over", and not warned of (as a cell is not)."""
    message = (f"{record.label} peaked at {format_bytes(record.used_bytes)}, over the budget of "
               f"{format_bytes(record.budget_bytes)} ({share_text(record.fraction)}); the block "
               f"{record.change_words('added ')}")
    if record.before_bytes > record.budget_bytes:
        message += (f"; the process already held {format_bytes(record.before_bytes)} as it began, which alone is over "
                    "the budget")
    return message


@explains_keywords({"limit": "budget", "size": "budget"})
class MemoryBudget:
    """``with memory_budget("6GiB") as b: train_step()``: each ``with`` block is one row of
    ``b.history``. Over budget: a `BudgetWarning` (or `BudgetExceeded` with ``strict=True``).
    Out of memory inside: the exception propagates with the explanation added as a note
    (``b.last_oom`` keeps it). ``enforce=True`` caps the CUDA allocator for the block's duration."""

    def __init__(self, budget, device="auto", strict: bool = False, enforce: bool = False, near: float = NEAR,
                 namespace: dict | None = None):
        for name, value in (("strict", strict), ("enforce", enforce)):
            if not isinstance(value, bool):
                raise TypeError(f"{option(name)} takes True or False, got {type(value).__name__} {value!r}")
        near = check_near(near)
        if namespace is not None and not isinstance(namespace, dict):
            raise TypeError(f"{option('namespace')} takes a dict (e.g. globals()) or None, got "
                            f"{type(namespace).__name__}")
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"{option('device')} takes 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got "
                            f"{type(device).__name__} {device!r}")
        try:
            self.device = resolve_device(device)
        except DeviceError as exc:
            raise BudgetError(str(exc)) from None
        self.budget = parse_budget(budget, self.device)
        if enforce and self.device.type != "cuda":
            apply_cap(self.device, self.budget)  # raises the explanation of why not
        self.strict, self.enforce, self.namespace = strict, enforce, namespace
        self.watcher = Watcher(self.budget, self.device, near)
        self.last_oom = None
        self._caps_open: list = []  # `push_cap` handles of the open blocks (re-entered: one each)
        # The BudgetWarning points at the user's `with` line: 2 when the user's `with` exits this object,
        # more when a wrapper's context managers stand between (nbaccel.distributed.memory_budget).
        self._stacklevel = 2

    @property
    def history(self) -> pd.DataFrame:
        return history_frame(self.watcher.records)

    def status(self) -> BudgetStatus:
        return status(self.watcher, self.device, self.namespace, enforce=self.enforce, strict=self.strict,
                      unit="block")

    def to_dict(self) -> dict:
        """``status().to_dict()``: so ``results_frame([..., budget])`` takes the context manager too."""
        return self.status().to_dict()

    def __repr__(self) -> str:
        mode = "enforced" if self.enforce else "strict" if self.strict else "soft"
        return (f"<nbaccel memory_budget {format_bytes(self.budget)} on {self.device} ({mode}), "
                f"{plural(len(self.watcher.records), 'block')} measured; .history has them>")

    def __enter__(self):
        if self.enforce:
            self._caps_open.append(push_cap(self.device, self.budget))
        self.watcher.begin(f"block {len(self.watcher.records) + 1}")
        return self

    def __exit__(self, etype, exc, tb):
        failed_before = self.watcher.device_error
        try:
            record = self.watcher.end(error=exc)
        finally:
            if self._caps_open:  # the cap in force before the block: %memory_budget --enforce's, or none
                pop_cap(self._caps_open.pop())
        if exc is None and self.watcher.device_error is not failed_before:
            raise self.watcher.device_error  # the block's kernels failed: a script must not go on unaware
        from .oom import explain_oom, is_oom

        if exc is not None and is_oom(exc):
            self.last_oom = explain_oom(exc, self.namespace, budget=self.budget, tb=tb)
            if hasattr(exc, "add_note"):
                exc.add_note(str(self.last_oom))
            return False
        if exc is None and record is not None and record.status == "over":
            message = over_budget_words(record)
            if record.harness:
                message += "; " + harness_words(record, str(self.device))
            if self.strict and not record.harness:
                raise BudgetExceeded(message)
            warnings.warn(message, BudgetWarning, stacklevel=self._stacklevel)
        elif exc is None and record is not None and record.unwritten_would_exceed:
            warnings.warn(unwritten_words(record), BudgetWarning, stacklevel=self._stacklevel)
        return False


@explains_keywords({"limit": "budget", "size": "budget"})
def memory_budget(budget, device="auto", strict: bool = False, enforce: bool = False, near: float = NEAR,
                  namespace: dict | None = None) -> MemoryBudget:
    """A budget for scripts; see `MemoryBudget`. ``budget``: "6GiB", "6GB", "512MiB", "6G" (= 6GiB), a share of
    the device such as 0.8 or "80%" (a number up to 1), or a number of bytes above 1 (``6 * 2**30``, ``2e9``), as
    in torch's memory APIs. (The magic's text has no such bytes: ``%memory_budget 2e9`` asks for a unit.)"""
    return MemoryBudget(budget, device, strict=strict, enforce=enforce, near=near, namespace=namespace)


__all__ = ["memory_budget", "MemoryBudget", "BudgetStatus", "CellReport", "CellRecord", "Watcher", "parse_budget",
           "verdict", "PUSHED",
           "BudgetError", "BudgetExceeded", "BudgetWarning", "apply_cap", "push_cap", "pop_cap", "release_cap",
           "device_memory", "plural",
           "share_text", "check_near", "size_reading", "MIN_BUDGET"]
