"""What `nbaccel.profile` and ``%%profile_gpu`` can be asked, and whether it can run here.

`ProfileOptions` is the whole request (what to record, how to show it); `validate` checks it
against this machine and process before any code runs -- bad values, a device that is not
there, an unwritable ``--trace``, a profiler already running -- and raises `ProfileError`
naming the fix, spelled the way the caller typed it (``top=`` in Python, ``--top`` in a magic).
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import profile_table as pt
from .device import DeviceError, DeviceInfo, device_info, did_you_mean, dtype_name, resolve_device
from .options import in_magic, option, whole_number
from .precision import Recipe, make_recipe

DTYPES = ("bf16", "fp16", "auto")


class ProfileError(RuntimeError):
    """The profile cannot run as asked; the message says what to change. Raised before any code runs."""


# --- options -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileOptions:
    """What to record and how to show it. ``sort=None`` means device time on CUDA, else self CPU."""

    top: int = 15
    sort: str | None = None
    memory: bool = False
    shapes: bool = False
    stack: bool = False
    # None in a loaded trace's options: nbaccel did not record it, and its header says what the trace holds
    warmup: int | None = 0
    steps: int | None = 1
    trace: str | None = None
    amp: str | None = None
    device: str = "auto"
    # Rows of the shown table: names (or source lines) holding this text or matching it as a regex. A view,
    # like top: result.ops and table() keep every row, and the header's figures are the whole profile's.
    filter: str = ""  # noqa: A003 - the table()'s and the widget's word
    # The sort word as typed (``gpu``, ``self_cuda_time_total``), for refusals that name what the user
    # wrote rather than the key it was read as; not an option of its own.
    sort_as_typed: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        # amp in the recipe's name whoever made the options (profile(), profile_function, the magic)
        object.__setattr__(self, "amp", amp_name(self.amp))
        object.__setattr__(self, "sort_as_typed", self.sort)
        object.__setattr__(self, "sort", sort_name(self.sort))

    @property
    def group(self) -> str:  # stack with shapes is refused (check_grouping)
        return "source" if self.stack else "op+shape" if self.shapes else "op"

    @property
    def scheduled(self) -> bool:
        return bool(self.warmup) or (self.steps or 1) > 1

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k, f in self.__dataclass_fields__.items() if f.init}


def trace_is_file(path: str) -> bool:
    """``--trace x.json`` / ``x.json.gz`` is one file; any other name is a folder (one file per step)."""
    return str(path).endswith((".json", ".json.gz"))


# An extension of letters (.txt, .trace, .gz, .pt): a name that reads as a file. Not ".2" (a folder "run1.2").
_FILE_SUFFIX = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,5}")


def check_trace_path(path: str) -> None:
    """Refuse a --trace path that cannot be written, before the code runs (not after a long step).
    Missing folders on the way are fine, for a file as for a folder of steps: they are created
    when the trace is saved (like tensorboard_trace_handler does)."""
    p = Path(path).expanduser()
    if trace_is_file(path):
        if p.is_dir():
            raise ProfileError(f"{option('trace', path)} is a folder; give a file name ending in .json, or a folder name "
                               "without .json for one file per step")
        if p.exists() and not os.access(p, os.W_OK):
            raise ProfileError(f"{option('trace', path)}: not writable; choose another path")
        folder = p.parent
    else:
        if p.exists() and not p.is_dir():
            raise ProfileError(f"{option('trace', path)} exists and is not a folder; a name without .json is a folder "
                               "(one trace file per step), a name ending in .json is one file")
        if not p.exists() and not str(path).endswith(("/", os.sep)) and _FILE_SUFFIX.fullmatch(p.suffix):
            # a trial's --trace out.txt made a folder named out.txt: a name that reads as a file is asked about
            raise ProfileError(f"{option('trace', path)}: a name not ending in .json is a folder (one trace file per "
                               f"step), and {p.name} reads as a file name. For one file use {p.stem}.json (or "
                               f"{p.stem}.json.gz); for a folder, a name without an extension or with a trailing / "
                               f"({path}/)")
        folder = p
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ProfileError(f"{option('trace', path)}: cannot write into {ancestor} (a file, not a folder); "
                           "choose another path")
    # os.access says yes to root everywhere, /proc and read-only mounts included: only creating a
    # file there tells (it is removed at once; nothing the user named is created or touched).
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.ENOENT:  # the folder is there, yet a new file in it "does not exist": /proc
            why = ("a virtual file system of the kernel, such as /proc, which takes no new files: a trace "
                   "needs a folder on disk, e.g. runs/ under the working directory")
        raise ProfileError(f"{option('trace', path)}: cannot write into {ancestor} ({why}); "
                           "choose another path") from None


def check_grouping(stack, shapes) -> None:
    """Refuse ``stack`` with ``shapes``: each picks how the table is grouped (by source line, by op and
    input shapes), and the table has one grouping. Unchecked, ``--shapes`` was silently dropped (a
    user trial). A ``stack`` result can show the op+shape grouping afterwards, which the message says."""
    if not (stack is True and shapes is True):
        return
    later = ("keep the result with -r NAME and call NAME.table(group='op+shape') (a single profile's widget also "
             "has 'group by' buttons)" if in_magic() else "result.table(group='op+shape')")
    raise ProfileError(f"{option('stack', True)} and {option('shapes', True)} both choose how the table is grouped "
                       f"({option('stack', True)}: by source line, {option('shapes', True)}: by op and input shapes); "
                       f"give one. A {option('stack', True)} profile can show the op+shape grouping afterwards: "
                       f"{later}")


def profiler_running() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


def table_sort(sort):
    """``table(sort=...)``: a column name as it is, else read as `sort_name` reads ``sort=`` (``"FLOPS"``,
    ``"gpu"``: the profile and the magics took them, ``table()`` refused them; a review)."""
    return sort if sort in pt.COLUMNS else sort_name(sort)


# --filter's help, the same under %%profile_gpu, %profile_trace and `python -m nbaccel trace`.
FILTER_HELP = ("show only the table rows whose op name (or source line) holds TEXT, or matches it as a regex "
               "(aten::(mm|addmm)); the header's figures stay the whole profile's")


def check_filter(text) -> None:
    if not isinstance(text, str):
        raise ProfileError(f"{option('filter')} takes the text to look for in the names, got {text!r}")


def check_table_args(group, sort, ascending, filter, top) -> None:  # noqa: A002 - the user's word
    """Refuse, with `ProfileError`, what ``table()`` could not mean -- for a live profile and a merged
    multi-rank one alike. Unchecked, ``top=-1`` reached pandas' ``head(-1)`` (all rows but the
    last), ``top=True`` became one row and ``filter=3`` an AttributeError deep in the filter."""
    if top is not None:
        whole_number("top", top, 1, ProfileError)
    check_filter(filter)
    if group is not None and group not in pt.GROUPS:
        raise ProfileError(f"{option('group', group)} is not a grouping; use one of: {', '.join(pt.GROUPS)}")
    if sort is not None and sort not in pt.SORT_COLUMNS and sort not in pt.COLUMNS:
        raise ProfileError(f"{option('sort', sort)} is neither a sort key ({', '.join(pt.SORT_COLUMNS)}) "
                           f"nor a column ({', '.join(pt.COLUMNS)})")
    if not isinstance(ascending, bool):
        raise ProfileError(f"{option('ascending')} takes True or False, got {ascending!r}")


_MEMORY_SORTS = ("memory", "self_memory_bytes", "memory_bytes")
_DEVICE_SORTS = ("device", "device_self_us", "device_total_us")


def check_table_fits(group, sort, *, device_time: bool, memory: bool, stack: bool) -> None:
    """Refuse, with `ProfileError`, a ``table()`` grouping or sort the profile has no data for, as
    `check_options` / `validate` / `load_trace` refuse the same options when a profile is made.

    ``sort`` is read already (`table_sort`): a key or a column. ``device_time``: the profile has a
    device's times (a CUDA profile or a trace with kernels); ``memory``, ``stack``: it was made with
    them. Unchecked, a user trial got ``sort="memory"`` without ``memory=True`` and ``sort="device"`` on
    a CPU profile as rows in first-seen order (every value 0), and ``group="source"`` without
    ``stack=True`` as one bogus row named 'aten::fill_, aten::mul_, aten::sqrt'."""
    if sort in _MEMORY_SORTS and not memory:
        raise ProfileError(f"{option('sort', sort)} needs the memory a profile records with {option('memory', True)}, "
                           f"and this one was made without it: profile again with {option('memory', True)} (a saved "
                           "trace: load_trace(path, memory=True))")
    if sort in _DEVICE_SORTS and not device_time:
        raise ProfileError(f"{option('sort', sort)} needs device time, and this profile has none (it ran on the CPU, "
                           f"or its trace has no kernels): use {option('sort', 'self')} or {option('sort', 'cpu')}")
    if group == "source" and not stack:
        raise ProfileError(f"{option('group', group)} needs the source lines a profile records with "
                           f"{option('stack', True)}, and this one was made without it: profile again with "
                           f"{option('stack', True)} (a saved trace: load_trace(path, stack=True)), or group by "
                           "'op' or 'op+shape'")


def check_options(options: ProfileOptions) -> None:
    """The checks that need neither the machine nor the process: run when a profile is made
    (``nbaccel.profile(top=0)`` fails there, as ``nbaccel.precision("fp8")`` does, not at the
    ``with`` line), and again by `validate`."""
    whole_number("top", options.top, 1, ProfileError)
    check_filter(options.filter)
    whole_number("steps", options.steps, 1, ProfileError, why=": the profile needs an active step")
    whole_number("warmup", options.warmup, 0, ProfileError)
    for flag in ("memory", "shapes", "stack"):  # memory="no" reached torch's ProfilerConfig as a type error
        if not isinstance(getattr(options, flag), bool):
            raise ProfileError(f"{option(flag)} takes True or False, got {getattr(options, flag)!r}")
    check_grouping(options.stack, options.shapes)
    if options.trace is not None and not isinstance(options.trace, (str, os.PathLike)):
        raise ProfileError(f"{option('trace')} takes a file or folder path, got {options.trace!r}")
    check_sort(options.sort)
    if options.sort == "memory" and not options.memory:
        raise ProfileError(f"{_sort_as_typed(options, 'memory')} needs {option('memory', True)} (memory is only recorded "
                           "with profile_memory)")
    if options.amp == "fp32":  # "not supported" gave no reason (a user trial, as %%amp's --dtype float32)
        raise ProfileError(f"{option('amp', options.amp)}: fp32 is what runs without {option('amp')}; leave it out "
                           f"to profile the code as it is, or give a reduced dtype: {', '.join(DTYPES)}")
    if options.amp is not None and options.amp not in DTYPES:
        raise ProfileError(f"{option('amp', options.amp)} is not supported; use one of: {', '.join(DTYPES)}"
                           f"{did_you_mean('amp', options.amp, DTYPES)}")


# Sort words with one meaning here: torch's key_averages().table(sort_by=...) names and plain words, read
# in any case (a user trial: FLOPS, gpu, self_cpu_time_total were refused with only the list of keys).
SORT_ALIASES = {
    "self_cpu_time_total": "self", "self_cpu_time": "self", "self_cpu": "self",
    "cpu_time_total": "cpu", "cpu_time": "cpu", "cpu_total": "cpu",
    "self_cuda_time_total": "device", "self_device_time_total": "device", "self_cuda": "device",
    "self_device": "device", "gpu": "device", "cuda": "device",
    "count": "calls", "call": "calls",
    "self_cpu_memory_usage": "memory", "self_cuda_memory_usage": "memory", "self_device_memory_usage": "memory",
    "flop": "flops",
}
_OWN_DEVICE = "device (each op's own device time, torch's self_cuda_time_total: nbaccel has no total-device-time sort)"
_OWN_MEMORY = ("memory (each op's own allocations, torch's self_*_memory_usage: nbaccel has no sort by memory "
               "with children)")
# Words that could mean more than one key, or a key of a different kind: suggested, never guessed.
SORT_SUGGESTIONS = {
    "time": "device (own GPU time), self (own CPU time) or cpu (CPU time with children)",
    "total": "cpu (CPU time with children) or device (own GPU time)",
    **dict.fromkeys(("cuda_time_total", "device_time_total", "cuda_time", "device_time"), _OWN_DEVICE),
    **dict.fromkeys(("cpu_memory_usage", "cuda_memory_usage", "device_memory_usage", "mem"), _OWN_MEMORY),
}


def _sort_word(sort: str) -> str:
    return sort.strip().lower().replace("-", "_")


def _sort_as_typed(options: ProfileOptions, meaning: str) -> str:
    """``--sort gpu (device time)``: the word the user wrote, and what it was read as when that differs."""
    typed = options.sort_as_typed if isinstance(options.sort_as_typed, str) else options.sort
    said = option("sort", typed)
    return said if _sort_word(typed) == options.sort else f"{said} ({meaning})"


def sort_name(sort):
    """``sort=`` as a sort key: any case (``FLOPS``), and the words that can only mean one key
    (`SORT_ALIASES`); anything else is left as given, for `check_sort` to refuse in the words typed."""
    if not isinstance(sort, str):
        return sort
    word = _sort_word(sort)
    return word if word in pt.SORT_COLUMNS else SORT_ALIASES.get(word, sort)


def check_sort(sort) -> None:
    """Refuse what `sort_name` could not read: with the key it probably meant, then the list."""
    if sort is None or sort in pt.SORT_COLUMNS:
        return
    meant = SORT_SUGGESTIONS.get(_sort_word(sort)) if isinstance(sort, str) else None
    meant = f"did you mean {option('sort')} {meant}? " if meant else ""
    raise ProfileError(f"{option('sort', sort)} is not a sort key; {meant}use one of: {', '.join(pt.SORT_COLUMNS)}")


def amp_name(amp) -> str | None:
    """``amp=`` as the recipe names it: the long spellings and torch dtypes (``"bfloat16"``,
    ``torch.float16``) work as in ``%%amp`` and `nbaccel.precision`; others are left for
    `check_options` to refuse with the list."""
    if amp is None:
        return None
    try:
        return dtype_name(amp)
    except DeviceError:
        return amp


def validate(options: ProfileOptions) -> tuple[torch.device, DeviceInfo, Recipe | None]:
    """Check every option against this machine; raise `ProfileError` naming the fix."""
    check_options(options)
    try:
        dev = resolve_device(options.device)
        info = device_info(dev)
        recipe = make_recipe(options.amp, dev, name="amp") if options.amp else None
    except DeviceError as exc:
        raise ProfileError(str(exc)) from None
    if options.sort == "device" and dev.type != "cuda":
        raise ProfileError(f"{_sort_as_typed(options, 'device time')} needs a CUDA device; this profile runs on "
                           f"the CPU: use {option('sort', 'self')} or {option('sort', 'cpu')}")
    if options.trace:
        check_trace_path(options.trace)
    if profiler_running():
        raise ProfileError("another torch profiler is already running in this process (a `with "
                           "torch.profiler.profile()` block or an earlier profile that was not stopped); "
                           "stop it first: two profilers cannot record at the same time")
    return dev, info, recipe
