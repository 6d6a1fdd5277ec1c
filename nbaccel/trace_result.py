"""``nbaccel.load_trace``: analyse torch.profiler traces recorded elsewhere (issue 8).

A trace from a cluster job, a nightly run or a colleague becomes the same `ProfileResult` a
live ``%%profile_gpu`` returns (operator table, kernels with their launching op, categories,
device busy/idle, Tensor Core share, FLOPs from shapes against the recorded GPU's peak), and
a folder of per-rank traces becomes a `MultiRankResult` (per-rank step time, compute /
communication / idle split, the straggler, op tables per rank and merged).

How a path is read:

* **A file** (``.json`` or ``.json.gz``): one `ProfileResult`. The file is streamed
  (`nbaccel.trace_io`) into the analysis loader, so memory stays a small multiple of the file.
* **A folder**: every ``*.json``/``*.json.gz`` directly inside it. Each file's rank comes from
  its ``distributedInfo.rank`` (what Kineto records under torch.distributed), else from its name
  (``rank-0.json.gz``, ``*.rank3.*``). Files of the same rank are *steps of one run* and are
  read as one trace (their events chained), which is exactly what ``%%profile_gpu --trace DIR``
  splits into per-step files: loading the folder gives back the profile with all its
  ``ProfilerStep`` ranges. Several distinct ranks give a `MultiRankResult`; ``rank=N`` picks
  one rank's files and returns its `ProfileResult`. Files with a rank mixed with files without
  one are refused (nbaccel cannot tell which process they belong to), and so are files that
  cannot be one run: different world sizes, one rank's files naming different GPUs, or one process's
  files holding separate profiles (`_separate_runs`: step numbers that start again).

Bad input is a `TraceError` naming the file and the problem; in a folder, an unreadable file is
skipped instead (a `TraceWarning` naming it, ``skipped`` in the result) and the others load.
Unknown event kinds are counted (``result.trace.unknown_events``, shown in the header) and skipped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import profile_table as pt
from .analysis.metrics import busiest_device
from .analysis.sums import intervals_union
from .analysis.trace import TraceData, TraceError, TraceWarning, _build, _metadata, paused_gc
from .device import DeviceInfo
from .options import in_magic, option, whole_number
from .profile_options import (ProfileError, ProfileOptions, check_filter, check_grouping, check_sort, check_table_args,
                              check_table_fits, sort_name, table_sort)
from .profile_result import ProfileResult, step_numbers_text
from .results import ResultMixin
from .trace_io import TraceIdentity, TraceStream, peek_identity, trace_files

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["load_trace", "MultiRankResult", "RankNotFound", "SeparateRuns", "TraceError", "TraceWarning"]


@contextlib.contextmanager
def trace_warnings_said(say):
    """Run the block with each `TraceWarning` (a skipped file, steps far apart) said by ``say(message)``
    when it ends, also when it raises: every one every time (a warning shown once per session would hide
    it on the next run of a cell) and as a plain line, not a source location. Other warnings go through
    the user's filters as usual. For ``%profile_trace`` and ``python -m nbaccel trace``."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TraceWarning)
            yield
    finally:
        for w in caught:
            if issubclass(w.category, TraceWarning):
                say(str(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


# The slowest rank is named the straggler only when its step time is at least this much over the median
# of the other ranks. Below it the ranks' step times differ by what runs of one step differ by: a trial's
# two-rank CPU traces named "slowest rank: 1 -- +0.9% (164 us)", which a re-run can reverse. 5% is half of
# the spread that nbaccel's timing already calls noisy (timing.NOISE_THRESHOLD, 10% IQR/median), and a
# straggler worth chasing in a synchronous job costs every rank its excess per step, so it is larger.
STRAGGLER_MIN_EXCESS = 0.05


class SeparateRuns(TraceError):
    """One process's files in a folder that hold separate profiles, not the steps of one (`_separate_runs`).
    Refused for the whole load, not skipped as an unreadable file is: each file reads well on its own."""


class RankNotFound(TraceError, LookupError):
    """``MultiRankResult.table(rank=N)`` for a rank the result does not hold. A TraceError as
    ``load_trace(rank=N)``'s is, and a LookupError as the KeyError it once was (whose message
    Python shows quoted)."""


def load_trace(path: str | os.PathLike, *, rank: int | None = None, top: int = 15, sort: str | None = None,
               shapes: bool = False, stack: bool = False, memory: bool = False, filter: str = ""):  # noqa: A002
    """Load a torch.profiler Chrome trace file, or a folder of them, for analysis.

    Returns a `ProfileResult` (the type ``%%profile_gpu`` returns) for one file or one rank,
    a `MultiRankResult` for a folder holding several ranks. ``top``/``sort``/``shapes`` set the
    shown table like the magic's options, and ``filter`` keeps the table's rows whose op name (or source line)
    holds it or matches it as a regex, as ``%%profile_gpu --filter`` does; ``stack`` groups by recorded Python source
    (with_stack traces) and ``memory`` charges recorded ``[memory]`` events to ops -- both keep
    those raw events, so they are off by default. Raises `TraceError` for input that is not a
    readable profiler trace, `ProfileError` for options that cannot apply.
    """
    whole_number("top", top, 1, ProfileError)
    check_filter(filter)
    sort = sort_name(sort)  # FLOPS, gpu, self_cpu_time_total: as profile() reads them
    check_sort(sort)
    if sort == "memory" and not memory:
        raise ProfileError(f"{option('sort', 'memory')} needs {option('memory', True)}: memory events are only read "
                           "when asked")
    check_grouping(stack, shapes)
    if rank is not None:
        whole_number("rank", rank, 0, ProfileError)  # rank="1" would otherwise be "not found" among ranks 0, 1
    p = _trace_location(path)
    # made_by: what the report is headed with and to_dict() keeps; the magic calls this under its spelling.
    made_by = "%profile_trace" if in_magic() else "load_trace()"
    opts = dict(top=top, sort=sort, shapes=shapes, stack=stack, memory=memory, filter=filter, made_by=made_by)
    if p.is_file():
        if rank is not None:
            raise ProfileError(f"{option('rank', rank)} selects a rank in a folder of traces; {path} is one file")
        return _load_rank([p], opts, source=str(path))
    skipped: dict[Path, TraceError] = {}
    groups = _group_by_rank(p, skipped)
    t0 = time.perf_counter()
    if rank is not None and groups:  # no readable trace at all: the files' own errors below say why
        if rank not in groups:
            if set(groups) == {None}:
                raise TraceError(f"{path}: its traces carry no rank (one process's run), so there is no rank "
                                 f"{rank}; load it without {option('rank')}")
            have = ", ".join(str(r) for r in sorted(groups, key=lambda r: (r is None, r or 0)))
            raise TraceError(f"{path}: no trace of rank {rank} in this folder (ranks found: {have})")
        groups = {rank: groups[rank]}
    results = {}
    for r, files in sorted(groups.items(), key=lambda item: (item[0] is None, item[0] or 0)):
        loaded = _load_skipping(files, opts, str(path), skipped)
        if loaded is not None:
            results[r] = loaded
    if not results:
        errors = [exc for _, exc in sorted(skipped.items())]
        if len(errors) == 1:
            raise errors[0]
        raise TraceError(f"{path}: none of its {len(errors)} trace files could be loaded: "
                         + "; ".join(dict.fromkeys(map(str, errors))))
    for f, exc in sorted(skipped.items()):
        warnings.warn(f"skipped {f}: {_reason(f, exc)}; the folder's other trace files were loaded",
                      TraceWarning, stacklevel=2)
    if None in results:
        _warn_if_several_processes(str(path), results[None].trace_files)
    reasons = {f.name: _reason(f, exc) for f, exc in sorted(skipped.items())}
    if len(results) == 1:
        (result,) = results.values()
        result.loaded["skipped"] = reasons
        return result
    return MultiRankResult(folder=str(path), ranks=results, load_seconds=time.perf_counter() - t0, skipped=reasons,
                           made_by=made_by)


def _trace_location(path) -> Path:
    """``path`` as an existing trace file or folder, or a `TraceError` naming what it takes."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        # Path(3) / Path(None) would raise pathlib's TypeError, and Path("") is the current folder.
        raise TraceError(f"path takes a trace file or a folder of them (a str or pathlib.Path), got {path!r:.80}")
    p = Path(path).expanduser()
    if not p.exists():
        raise TraceError(f"{path}: no such file or folder")
    if not (p.is_file() or p.is_dir()):
        # /dev/null, a FIFO: listing it as a folder would raise NotADirectoryError.
        raise TraceError(f"{path}: not a regular file or a folder; path takes a trace file (.json, .json.gz) "
                         "or a folder of them")
    return p


def _reason(f: Path, exc: TraceError) -> str:
    text = str(exc)
    return text[len(str(f)) + 2:] if text.startswith(f"{f}: ") else text


def _readable(files: list[Path], skipped: dict) -> list[Path]:
    """The files whose JSON streams through as a trace; the others go to ``skipped`` (file -> error).
    A full read of each file: only called once something in a folder has already failed."""
    good = []
    for f in files:
        try:
            for _ in TraceStream(f).events():
                pass
        except TraceError as exc:
            skipped[f] = exc
        else:
            good.append(f)
    return good


def _load_skipping(files: list[Path], opts: dict, source: str, skipped: dict) -> ProfileResult | None:
    """`_load_rank`, leaving out the files that cannot be read (into ``skipped``); None if none can."""
    try:
        return _load_rank(files, opts, source=source)
    except SeparateRuns:
        raise
    except TraceError as exc:
        if len(files) == 1:
            skipped[files[0]] = exc
            return None
        good = _readable(files, skipped)
        if len(good) == len(files):  # every file reads on its own: the error is about them together
            skipped.update(dict.fromkeys(files, exc))
            return None
    return _load_skipping(good, opts, source, skipped) if good else None


def _group_by_rank(folder: Path, skipped: dict) -> dict[int | None, list[Path]]:
    """Trace files by rank; a file whose start cannot be read goes to ``skipped`` (file -> error).
    Files that cannot be one run are refused (`_refuse_other_runs`)."""
    groups: dict[int | None, list[Path]] = {}
    identities: dict[Path, TraceIdentity] = {}
    for f in trace_files(folder):
        try:
            identities[f] = peek_identity(f)
        except TraceError as exc:
            skipped[f] = exc
            continue
        groups.setdefault(identities[f].rank, []).append(f)
    if None in groups and len(groups) > 1:
        # Unranked JSON next to ranked traces is often not a trace at all (a config, a metrics
        # dump): those are skipped like unreadable files; real traces without a rank are refused.
        unranked = _readable(groups.pop(None), skipped)
        if unranked:
            groups[None] = unranked
    if None in groups and len(groups) > 1:
        # Files of different GPUs are the likelier story (two jobs' traces in one folder): said first.
        _refuse_other_runs(folder, {_ALL: [f for fs in groups.values() for f in fs]}, identities)
        unknown = ", ".join(f.name for f in groups[None][:4])
        raise TraceError(f"{folder}: cannot tell the rank of {unknown} (no distributedInfo.rank and no 'rank' in "
                         "the name) while other files have one; move them out or load them one by one")
    _refuse_other_runs(folder, groups, identities)
    return groups


_ALL = "all"  # `_refuse_other_runs` group key: every file, ranked or not


def _refuse_other_runs(folder: Path, groups: dict, identities: dict) -> None:
    """A `TraceError` when the folder's files cannot all be one run, listing what each names.

    Only what cannot hold within one run is refused: one job has one world size, and one process
    (one rank's files, or the unranked step files of one run) sees the same GPUs in every file it
    writes. Ranks on different GPU models are allowed (a job may span them), and files far apart
    in time stay a warning (`_far_apart`): a profiler schedule's cycles of one long job are too.
    """
    files = [f for fs in groups.values() for f in fs]
    sizes = sorted({identities[f].world_size for f in files} - {None})
    reasons = [f"different world sizes: {', '.join(map(str, sizes))}"] if len(sizes) > 1 else []
    for r, fs in groups.items():
        if len({identities[f].gpus for f in fs} - {()}) > 1:  # a file naming no GPU contradicts none
            whose = "the files" if r is _ALL else f"rank {r}'s files" if r is not None else "the files without a rank"
            reasons.append(f"{whose} name different GPUs")
    if not reasons:
        return
    by_kind: dict[str, list[str]] = {}
    for f in files:
        ident = identities[f]
        gpus = " + ".join(ident.gpus) or "no GPU named"
        size = f"world size {ident.world_size}" if ident.world_size else "no world size"
        by_kind.setdefault(f"{gpus}, {size}", []).append(f.name)
    listing = "; ".join(f"{kind}: {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                        for kind, names in by_kind.items())
    raise TraceError(f"{folder}: these trace files are not one run ({'; '.join(reasons)}): {listing}. "
                     "Load each run on its own: one file, or one folder per run (a folder holds one job's "
                     "per-rank files, or one process's step files)")


# --- one rank: a file, or the step files of one process ------------------------------------------

# ``{host}_{pid}.{ms}.pt.trace.json``: the worker name of tensorboard_trace_handler and ``--trace FOLDER``
_WORKER_NAME = re.compile(r"^(.+_\d+)\.\d+\.pt\.trace\.json(?:\.gz)?$")


def _warn_if_several_processes(source: str, files: list[str]) -> None:
    """Unranked step files of several processes (torchrun without init_process_group, every worker
    writing into one ``trace=FOLDER``) read as the steps of one run, chained in file-name order:
    said, with the worker names that tell them apart."""
    workers = sorted({m.group(1) for m in (_WORKER_NAME.match(Path(f).name) for f in files) if m})
    if len(workers) < 2:
        return
    shown = ", ".join(workers[:4]) + (f" and {len(workers) - 4} more" if len(workers) > 4 else "")
    warnings.warn(f"{source}: its trace files carry no rank but come from {len(workers)} different processes "
                  f"({shown}: host_pid in their names), and were read as the steps of one run, chained in file-name "
                  "order. Keep one folder per process, or call torch.distributed.init_process_group before "
                  "profiling so that each file names its rank (then the folder loads one rank per process)",
                  TraceWarning, stacklevel=3)


def _side_event(ev: dict, stack: bool, memory: bool) -> bool:
    """Raw events the tables need beyond what the analysis loader keeps (see ProfileResult)."""
    cat = ev.get("cat")
    if stack and (cat == "python_function" or cat == "user_annotation"):
        return True
    return memory and ev.get("name") == "[memory]"


def _load_rank(files: list[Path], opts: dict, source: str) -> ProfileResult:
    t0 = time.perf_counter()
    streams = [TraceStream(f) for f in files]
    side: list = []
    keep = opts["stack"] or opts["memory"]

    spans: list[tuple[float, float]] = []  # each file's first and last event time, for _far_apart
    marks = [_FileMarks() for _ in files]  # each file's process and step numbers, for _separate_runs
    marking = len(files) > 1  # one file is one run: its events need no marks

    def events():
        for stream, mark in zip(streams, marks):
            first = last = None
            for ev in stream.events():
                if keep and isinstance(ev, dict) and _side_event(ev, opts["stack"], opts["memory"]):
                    side.append(ev)
                ts = ev.get("ts") if isinstance(ev, dict) else None
                if isinstance(ts, (int, float)):
                    first, last = (ts if first is None else first), ts
                    if marking:
                        mark.see(ev)
                yield ev
            if first is not None:
                spans.append((float(min(first, last)), float(max(first, last))))

    # The analysis loader's one-pass builder consumes the event stream directly. Its header
    # argument is read only after the events, but the streams fill theirs while being read, so
    # device properties and rank are set from the complete header afterwards.
    with paused_gc():  # one container per event and argument: see paused_gc
        trace = _build(events(), {}, str(files[0]) if len(files) == 1 else source)
    header = streams[0].header
    trace.device_properties = list(header.get("deviceProperties") or [])
    trace.metadata = _metadata(header)
    if marking:
        for stream, mark in zip(streams, marks):
            mark.trace_id, mark.host = stream.header.get("trace_id"), stream.header.get("host_name")
        _separate_runs(files, marks, source, trace.rank)
    if not trace.count("ops") and not trace.has_device_activity:
        kinds = ", ".join(f"{k} x{n}" for k, n in trace.event_counts.most_common(6)) or "no events"
        where = files[0] if len(files) == 1 else source
        raise TraceError(f"{where}: JSON is not a torch.profiler trace (no cpu_op or kernel events; found {kinds})")
    info = _device_info(trace)
    gpu = info.name if info.type == "cuda" else None
    rank, world = trace.rank, trace.world_size
    apart = _far_apart(spans)
    where = files[0].name if len(files) == 1 else \
        f"{Path(source).name}/ ({len(files)} {'files' if apart else 'step files'})"
    label = f"loaded trace {where}"
    if rank is not None:
        label += f", rank {rank}" + (f" of {world}" if world else "")
    unknown = dict(trace.unknown_events)
    loaded = {
        "label": label,
        "source": source,
        "files": [str(f) for f in files],
        "gpu": gpu,
        "rank": rank,
        "world_size": world,
        "events": int(sum(trace.event_counts.values())),
        "unknown_events": unknown,
        "unknown_event_count": int(sum(unknown.values())),
        "bytes": int(sum(f.stat().st_size for f in files)),
        "load_seconds": time.perf_counter() - t0,
    }
    _check_side_events(side, opts, where)
    options = ProfileOptions(top=opts["top"], sort=opts["sort"], memory=opts["memory"], shapes=opts["shapes"],
                             stack=opts["stack"], filter=opts["filter"], device=info.type,
                             warmup=None, steps=None)  # not known: the header's steps are what the trace holds
    if options.sort == "device" and info.type != "cuda":
        raise ProfileError(f"{option('sort', 'device')} needs device activity; {where} has no kernels (a CPU-only "
                           f"trace): use {option('sort', 'self')} or {option('sort', 'cpu')}")
    if apart:
        loaded["far_apart"] = apart
        whose = f" (rank {rank})" if rank is not None else ""  # a folder of ranks warns once per rank
        warnings.warn(f"{source}{whose}: {apart}", TraceWarning, stacklevel=3)
    result = ProfileResult.from_trace_data(trace, side, info, options, cudnn_benchmark=None,
                                           trace_path=source, trace_files=[str(f) for f in files], loaded=loaded,
                                           made_by=opts["made_by"])
    loaded["load_seconds"] = time.perf_counter() - t0
    return result


@dataclass
class _FileMarks:
    """What tells one file's profile from another's: the process (pid of its ProfilerStep ranges, else of
    its first op; Kineto's header ``host_name``), its first event time, its ``ProfilerStep#N`` numbers and
    Kineto's ``trace_id`` (one per profiling session)."""

    pid: object = None
    host: object = None
    first_ts: float | None = None
    steps: list = field(default_factory=list)
    trace_id: object = None

    def see(self, ev: dict) -> None:
        if self.first_ts is None or ev["ts"] < self.first_ts:
            self.first_ts = float(ev["ts"])
        cat, name = ev.get("cat"), str(ev.get("name", ""))
        if cat == "user_annotation" and name.startswith("ProfilerStep#") and name[13:].isdigit():
            self.steps.append(int(name[13:]))
            self.pid = ev.get("pid")
        elif self.pid is None and cat == "cpu_op":
            self.pid = ev.get("pid")


def _starts_a_profile(before: _FileMarks, mark: _FileMarks) -> str | None:
    """Why ``mark``'s file, the next in time of one process after ``before``'s, cannot be a later step of
    the same profile; None when it can. torch numbers one profiler's steps on from 0 across all the files
    it writes (a schedule's cycles: #2-#3, then #6-#7), so numbers that start again mean a new profiler. A
    file without steps is a whole unscheduled profile: beside another Kineto session (another trace_id) it
    is a profile of its own (nbaccel's per-step files share their profile's trace_id). Not a gap in time:
    a schedule's cycles may be hours apart, two profiles milliseconds."""
    if before.steps and mark.steps:
        if min(mark.steps) <= max(before.steps):
            return f"ProfilerStep numbers start again (#{min(mark.steps)} after #{max(before.steps)})"
        return None
    if before.trace_id and mark.trace_id and before.trace_id != mark.trace_id:
        return "different Kineto trace_ids, " + ("neither" if not (before.steps or mark.steps) else "not both") + \
            " with ProfilerStep ranges (a schedule's every file has them)"
    return None


def _steps_text(numbers: list) -> str:
    """"ProfilerStep#0", "ProfilerStep#1-#3", "ProfilerStep#2, #3, #6, #7" (`step_numbers_text`'s notation)."""
    return "ProfilerStep" + step_numbers_text(sorted(numbers))[2:] if numbers else "no ProfilerStep ranges"


def _separate_runs(files: list[Path], marks: list[_FileMarks], source: str, rank) -> None:
    """A `SeparateRuns` error when one process's files hold several profiles (two ``profile(trace=DIR)``
    into one folder, milliseconds apart), naming each profile's files: chained, their wall time, step
    times and FLOP/s would mix the profiles. Files of different processes are `_warn_if_several_processes`'."""
    by_process: dict = {}
    for f, mark in zip(files, marks):
        by_process.setdefault((mark.host, mark.pid), []).append((f, mark))
    for (host, pid), entries in by_process.items():
        entries.sort(key=lambda e: (e[1].first_ts is None, e[1].first_ts or 0.0))  # stable: name order
        profiles, reasons = [[entries[0]]], []
        for (_, before), (f, mark) in zip(entries, entries[1:]):
            why = _starts_a_profile(before, mark)
            if why:
                profiles.append([])
                reasons.append(f"{f.name}: {why}")
            profiles[-1].append((f, mark))
        if len(profiles) == 1:
            continue
        process = " ".join([f"process {pid}" if isinstance(pid, int) else "one process", f"on {host}" if host else ""])
        whose = f"rank {rank}'s trace files ({process.strip()})" if rank is not None else f"the trace files of {process.strip()}"
        listing = "; ".join(
            f"profile {i}: " + ", ".join(f.name for f, _ in p[:3]) + (f" and {len(p) - 3} more" if len(p) > 3 else "")
            + f" ({_steps_text([n for _, m in p for n in m.steps])})" for i, p in enumerate(profiles, 1))
        raise SeparateRuns(f"{source}: {whose} hold {len(profiles)} separate profiles, not the steps "
                           f"of one run ({'; '.join(reasons)}): {listing}. Chained, their wall time, step times and "
                           "FLOP/s would mix the profiles. Load each on its own: one file, or one folder per profile")


def _check_side_events(side: list, opts: dict, where) -> None:
    """``stack`` on a trace recorded without Python stacks: said, instead of a table of one
    "(no user frame)" row. (``memory`` is not refused alike: a trace recorded with it where
    nothing was allocated has no [memory] events either, and its zeros are then true.)"""
    if opts["stack"] and not any(ev.get("cat") == "python_function" for ev in side):
        raise ProfileError(f"{option('stack', True)}: {where} holds no Python stack events, so it was recorded "
                           f"without with_stack=True (%%profile_gpu --stack) and has no source lines to group by; "
                           f"load it without {option('stack', True)}, or record it again with that option")


def _far_apart(spans: list[tuple[float, float]]) -> str | None:
    """A note when the files of one rank are far apart in time: steps of one run (what
    ``--trace DIR`` writes) follow each other, separate runs are seconds to days apart, and
    chained they give a wall time and FLOP/s that span the gaps."""
    if len(spans) < 2:
        return None
    spans = sorted(spans)
    gap = max(b[0] - a[1] for a, b in zip(spans, spans[1:]))
    typical = statistics.median(end - start for start, end in spans)
    if gap < max(1e6, 10 * typical):  # microseconds: over 1 s, and 10 files' length
        return None
    return (f"its {len(spans)} files are up to {gap / 1e6:,.1f} s apart (each spans ~{typical / 1e3:,.1f} ms): "
            "they look like separate runs, not steps of one; the wall time and FLOP/s span the gaps. "
            "Load one file, or keep one run per folder")


def _device_info(trace: TraceData) -> DeviceInfo:
    """The recorded device as a `DeviceInfo`: the GPU with most kernel time, from deviceProperties."""
    if not trace.has_device_activity:
        return DeviceInfo(type="cpu", index=None, name="recorded on the CPU (no device activity in the trace)")
    device = busiest_device(trace)
    props = trace.device_props(device) or trace.device_props() or {}
    cc = (int(props["computeMajor"]), int(props["computeMinor"])) if "computeMajor" in props else None
    try:
        index = int(device) if device is not None else None
    except (TypeError, ValueError):
        index = None
    return DeviceInfo(type="cuda", index=index, name=props.get("name") or "GPU not named (no deviceProperties)",
                      compute_capability=cc, total_memory=props.get("totalGlobalMem"),
                      supports_bf16=bool(cc and cc >= (8, 0)), supports_fp16=bool(cc and cc >= (5, 3)),
                      supports_tf32=bool(cc and cc >= (8, 0)), tensor_cores=bool(cc and cc >= (7, 0)))


# --- several ranks ---------------------------------------------------------------------------------

def _rank_of_extreme(per_rank, column: str, largest: bool) -> int | None:
    """The rank with the largest (smallest) ``column``; None when all ranks are equal, where
    naming one would point at a rank for nothing."""
    values = per_rank[column]
    if values.max() == values.min():
        return None
    i = values.idxmax() if largest else values.idxmin()
    return int(per_rank.loc[int(i), "rank"])


def time_split(result: ProfileResult) -> dict:
    """Compute / exposed communication / idle time of one rank's device over its steps.

    The span is the ``ProfilerStep`` ranges (first start to last end) when the trace has them,
    else the whole trace window. Compute = union of every non-communication activity (kernels,
    copies, memsets); communication = time when only NCCL / all-reduce kernels run (communication
    hidden under compute is not a cost); idle = nothing runs. The three add up to the span.
    """
    trace = result.trace
    ann = trace.annotations
    steps = ann[ann["name"].str.startswith("ProfilerStep#") & ~ann["on_device"].astype(bool)] if len(ann) else ann
    if len(steps):
        lo, hi = float(steps["ts_us"].min()), float((steps["ts_us"] + steps["dur_us"]).max())
        basis = f"{len(steps)} ProfilerStep range{'s' if len(steps) > 1 else ''}"
    else:
        win = trace.window() or (0.0, 0.0)
        lo, hi, basis = win[0], win[1], "trace window (no ProfilerStep ranges)"
    acts = trace.device_activities()
    span = max(hi - lo, 0.0)
    out = {"span_us": span, "basis": basis, "compute_us": 0.0, "communication_us": 0.0, "idle_us": span,
           "communication_kernel_us": 0.0}
    if not len(acts) or span <= 0:
        return out
    s = np.clip(acts["ts_us"].to_numpy(float), lo, hi)
    e = np.clip((acts["ts_us"] + acts["dur_us"]).to_numpy(float), lo, hi)
    comm = acts["category"].eq("communication").to_numpy()
    busy = intervals_union(s.tolist(), e.tolist())  # concurrent streams count once
    compute = intervals_union(s[~comm].tolist(), e[~comm].tolist())
    out.update(compute_us=compute, communication_us=busy - compute, idle_us=span - busy,
               communication_kernel_us=float((e[comm] - s[comm]).sum()))
    return out


@dataclass
class MultiRankResult(ResultMixin):
    """Per-rank traces of one distributed job, side by side.

    ``ranks`` maps rank -> `ProfileResult` (each with every table of a single trace);
    ``per_rank`` is the step time and compute / communication / idle split per rank;
    ``straggler`` names the slowest rank and by how much; ``table(rank=None)`` is the op table
    merged over ranks (or one rank's). Times are microseconds.
    """

    kind = "multirank"

    folder: str
    ranks: dict = field(repr=False)
    load_seconds: float = 0.0
    skipped: dict = field(default_factory=dict)  # file name -> why it was not loaded
    made_by: str = "load_trace()"  # or "%profile_trace": what the title names
    _grouped: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def options(self) -> ProfileOptions:
        return next(iter(self.ranks.values())).options

    @property
    def world_size(self) -> int | None:
        sizes = {r.trace.world_size for r in self.ranks.values() if r.trace.world_size}
        return max(sizes) if sizes else None

    @property
    def gpus(self) -> list[str]:
        return sorted({r.device.name for r in self.ranks.values()})

    @functools.cached_property
    def per_rank(self) -> pd.DataFrame:
        """One row per rank: step time (mean ProfilerStep duration, else the trace window), the
        device split over the steps (compute, exposed communication, idle) and counts (``ops``: op
        calls, the rank's ``header["ops"]``; ``kernels``: kernel events)."""
        import pandas as pd
        rows = []
        for rank, res in self.ranks.items():
            split = time_split(res)
            steps = res.step_times_us
            step = statistics.fmean(steps) if steps else res.window_us
            span = split["span_us"] or 1.0
            rows.append({
                "rank": rank, "files": len(res.trace_files), "gpu": res.device.name if res.on_device else None,
                "steps": len(steps), "step_time_us": step,
                "step_basis": "mean ProfilerStep" if steps else "trace window",
                "span_us": split["span_us"], "compute_us": split["compute_us"],
                "communication_us": split["communication_us"], "idle_us": split["idle_us"],
                "compute_pct": 100 * split["compute_us"] / span,
                "communication_pct": 100 * split["communication_us"] / span,
                "idle_pct": 100 * split["idle_us"] / span,
                "communication_kernel_us": split["communication_kernel_us"],
                # Op calls as the rank's own header and operator table count them (the sum of its calls
                # column), not op events: a re-dispatch is part of its parent's call (A100 rank 0: 25,105
                # calls in 25,185 events), and the rank table sat beside a header that said 25,105.
                "ops": res.op_calls, "kernels": res.kernel_count,
                "unknown_events": res.header["unknown_events"],
            })
        return pd.DataFrame(rows)

    @functools.cached_property
    def straggler(self) -> dict:
        """The slowest rank by step time, and how much slower than the median of the others.

        In a synchronous job the collectives make every rank wait for the slowest one, so the
        straggler is usually also the rank with the most compute and the least exposed
        communication; ``most_compute`` is named separately in case the two differ. Both are None
        when every rank has the same figure (CPU-only traces: 0 compute on every rank).
        """
        pr = self.per_rank
        i = int(pr["step_time_us"].idxmax())
        slow = pr.loc[i]
        others = pr.drop(index=i)
        median = float(others["step_time_us"].median()) if len(others) else float(slow["step_time_us"])
        fastest = pr.loc[int(pr["step_time_us"].idxmin())]
        excess = (float(slow["step_time_us"]) / median - 1) if median > 0 else None
        return {
            "rank": int(slow["rank"]),
            "step_time_us": float(slow["step_time_us"]),
            "others_median_us": median,
            "excess_us": float(slow["step_time_us"]) - median,
            "excess_fraction": excess,
            # Whether the slowest rank is slow enough to be called the straggler (`STRAGGLER_MIN_EXCESS`).
            "named": excess is not None and excess >= STRAGGLER_MIN_EXCESS,
            # (slowest - fastest) / fastest: "the ranks are within X% of each other" when none is named
            "spread_fraction": (float(slow["step_time_us"]) / float(fastest["step_time_us"]) - 1)
            if float(fastest["step_time_us"]) > 0 else None,
            "fastest_rank": int(fastest["rank"]),
            "fastest_step_time_us": float(fastest["step_time_us"]),
            "most_compute_rank": _rank_of_extreme(pr, "compute_us", largest=True),
            "least_communication_rank": _rank_of_extreme(pr, "communication_us", largest=False),
        }

    # -- tables --

    def grouped(self, group: str = "op") -> pd.DataFrame:
        """The op table merged over every rank (sums of calls and times; FLOP/s over the summed device time)."""
        import pandas as pd
        if group not in self._grouped:
            frames, offset = [], 0
            for k, r in self.ranks.items():
                # `parent` is a row number within the rank's own events: shifted past the rows before it,
                # or rank 1's re-dispatch and source-line checks looked at rank 0's ops.
                parent = r.op_events["parent"]
                frames.append(r.op_events.assign(rank=k, parent=parent.where(parent < 0, parent + offset)))
                offset += len(r.op_events)
            merged = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
            device_total = sum(r.device_time_us for r in self.ranks.values() if r.on_device)
            self._grouped[group] = pt.group_ops(merged, group, device_total)
        return self._grouped[group]

    @property
    def on_device(self) -> bool:
        return any(r.on_device for r in self.ranks.values())

    @property
    def default_sort(self) -> str:
        return self.options.sort or ("device" if self.on_device else "self")

    def table(self, rank: int | None = None, group: str | None = None, sort: str | None = None,
              ascending: bool = False, filter: str = "", top: int | None = None) -> pd.DataFrame:  # noqa: A002
        """Op table of one rank (``rank=N``) or merged over all ranks (``rank=None``)."""
        sort = table_sort(sort)
        check_table_args(group, sort, ascending, filter, top)
        if rank is not None:
            if rank not in self.ranks:
                raise RankNotFound(f"no rank {rank} in this result; ranks: {', '.join(map(str, self.ranks))}")
            return self.ranks[rank].table(group=group, sort=sort, ascending=ascending, filter=filter, top=top)
        check_table_fits(group, sort, device_time=self.on_device, memory=self.options.memory, stack=self.options.stack)
        return pt.select(self.grouped(group or self.options.group), sort or self.default_sort, ascending, filter, top)

    @property
    def ops(self) -> pd.DataFrame:
        return self.table()

    def to_dataframe(self) -> pd.DataFrame:
        return self.per_rank

    def _payload(self) -> dict:
        def clean(frame):
            import json

            return json.loads(frame.to_json(orient="records")) if len(frame) else []

        return {
            "folder": self.folder,
            "world_size": self.world_size,
            "gpus": self.gpus,
            "per_rank": clean(self.per_rank),
            "straggler": self.straggler,  # made JSON-safe by ResultMixin.to_dict
            "ops": clean(self.table(top=self.options.top)),
            "ranks": {str(k): r.header for k, r in self.ranks.items()},
            "files": {str(k): r.trace_files for k, r in self.ranks.items()},
            "skipped": dict(self.skipped),
            "made_by": self.made_by,
        }
