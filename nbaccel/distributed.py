"""nbaccel under ``torchrun``: every rank measures itself, rank 0 sees them all.

Nothing here runs unless the user calls it; ``nbaccel.compare_amp`` itself never talks to other
ranks (it measures the calling rank only). Under ``torch.distributed``, call the wrappers::

    import nbaccel.distributed as nd
    res = nd.compare_amp(lambda: train_step(ddp_model, batch), dtype="bf16")   # on every rank
    if nd.rank() == 0:
        print(res.report)            # min / median / max across ranks, slowest rank named

    with nd.profile("runs/prof") as prof:     # runs/prof/nbaccel.rank{r}.pt.trace.json per rank
        train_step(ddp_model, batch)
    with nd.memory_budget("6GiB") as b:       # per-rank budget, peak and ok/near/over, gathered as b.report
        train_step(ddp_model, batch)
    gc.collect(); dist.destroy_process_group()  # at the end: else a rank can abort at exit (docs/api.md)

or `gather_amp` / `gather` on a result you already have.

How it avoids hangs, and where it cannot: results are exchanged with ``all_gather_object`` on a
gloo (CPU) group -- the default group when it is gloo, otherwise one created once with
``new_group(backend="gloo")`` -- so NCCL is never asked to move Python objects. Before any result
is exchanged, every rank contributes an ok/error flag (`run_all`): if the code raised on any rank,
*every* rank raises (the failing rank its own exception, the others `RankFailure` naming the
failed ranks) instead of the healthy ranks waiting forever in a gather the failed rank never
reaches. That rescues code that makes no collectives of its own (a per-rank forward pass, a
bad option, a local computation).

It cannot rescue code that makes its own collectives, which is most training steps: with a DDP
model, a rank that raises *before* the all-reduce in ``backward()`` (a bad batch, an OOM in the
forward pass) leaves the other ranks waiting inside that all-reduce, which nbaccel cannot reach
-- its flags are only exchanged after the code returns. The same holds for a rank that dies or is
interrupted (KeyboardInterrupt is never caught). Those ranks wait until the process group's
timeout (30 minutes by default) and then fail with a backend error ("Connection closed by peer",
"timeout"); the failed rank, whose exchange then fails too, raises its own exception with a note
saying so. What you can do: pass a shorter timeout when you measure,
``dist.init_process_group(..., timeout=datetime.timedelta(seconds=60))``; look in torchrun's
output for the rank whose error is not a backend error; and check the step once on one rank
without DDP (``nbaccel.compare_amp`` on the plain model) before measuring it under DDP.

`profile` and `memory_budget` measure only the body: each rank first builds and checks its profiler
or budget (and `profile` its trace folder), the ranks agree on that (`_measured`), and only then
does each start measuring. nbaccel's own exchange was once inside the profile (a rank's
``all_gather_object`` wait for the other, ~6 of a 21 ms step), and a folder one rank could not
create left the others waiting out the group's timeout.

Every rank must pass the same options: the wrappers exchange them before anything runs and raise
`RankMismatch` on every rank, naming the options and the ranks, when they differ (``device`` may
differ: each rank may name its own GPU). Different ``repeat``/``warmup`` would run DDP's
collectives a different number of times on each rank and hang; a different ``dtype`` would merge
two measurements into one report.

Traces go one file per rank, ``<dir>/<name>.rank<r>.pt.trace.json``: the file names Holistic
Trace Analysis globs for, and each trace carries ``distributedInfo.rank`` (written by Kineto
whenever torch.distributed is initialized), which is what HTA reads the rank from.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shlex
import socket
import statistics
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["is_distributed", "rank", "world_size", "run_all", "gather", "gather_amp", "compare_amp", "profile",
           "memory_budget", "RankFailure", "RankMismatch", "NoProcessGroup", "RankReport", "BudgetReport",
           "trace_path", "summarize"]

_CPU_GROUPS: dict = {}


class RankFailure(RuntimeError):
    """Raised on the healthy ranks when the measured code, or nbaccel's preparation for it (``starting``),
    raised on other ranks."""

    def __init__(self, failures: dict[int, str], starting: str | None = None, gathering: str | None = None):
        self.failures = dict(failures)
        ranks = ", ".join(map(str, sorted(failures)))
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        # Said apart: a preparation that failed must not read as the user's code failing (it never ran).
        what = (f"{starting} could not start on rank(s) {ranks}, so the code ran on no rank" if starting
                else f"{gathering} was refused on rank(s) {ranks}, so nothing was gathered" if gathering
                else f"the measured code raised on rank(s) {ranks}, so no result was gathered")
        super().__init__(f"{what} ({detail})")


class RankMismatch(ValueError):
    """Raised on every rank, before anything runs, when the ranks passed different options."""

    def __init__(self, what: str, differences: dict[str, dict[int, object]]):
        self.differences = {name: dict(per_rank) for name, per_rank in differences.items()}
        detail = "; ".join(f"{name}: {_by_value(per_rank)}" for name, per_rank in differences.items())
        if "call" in differences:  # the ranks are not even in the same nbaccel call: their options do not compare
            super().__init__(f"the ranks made different nbaccel.distributed calls at the same point ({detail}); "
                             "every rank must make the same calls in the same order (their exchanges pair up one "
                             "for one), so nothing ran")
            return
        super().__init__(f"{what} needs the same options on every rank (their runs, and the collectives in them, "
                         f"pair up one for one), but they differ: {detail}. Pass the same values on every rank "
                         "(only device may differ).")


class NoProcessGroup(RuntimeError):
    """torchrun started several ranks, but no process group is initialised: the ranks cannot be gathered."""


def _by_value(per_rank: dict[int, object]) -> str:
    """{0: 3, 1: 5, 2: 3} -> "3 (ranks 0, 2), 5 (rank 1)" (one part per value, not per rank)."""
    groups: dict[str, list[int]] = {}
    for r, value in sorted(per_rank.items()):
        groups.setdefault(repr(value), []).append(r)
    return ", ".join(f"{value} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                     for value, rs in groups.items())


def _differences(options: dict[int, dict]) -> dict[str, dict[int, object]]:
    """{rank: {option: value}} -> only the options whose value is not the same on every rank."""
    names = sorted({name for opts in options.values() for name in opts})
    per_name = {name: {r: opts.get(name) for r, opts in options.items()} for name in names}
    return {name: per_rank for name, per_rank in per_name.items() if len(set(map(repr, per_rank.values()))) > 1}


_PLAIN = (str, int, float, bool, type(None))


def _options(func, *args, **kwargs) -> dict:
    """The plain-valued arguments of ``func(*args, **kwargs)``, defaults filled in, to compare
    across ranks. ``device`` is left out (each rank may name its own GPU), and so are callables
    and state objects (they are different objects on every rank by nature)."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return {}  # the call itself refuses these arguments, and that error is agreed on like any other
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name != "device" and isinstance(value, _PLAIN)}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _torchrun_env() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun sets them for every worker, with or without a process group;
    (0, 1) outside torchrun or where they are not whole numbers."""
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def rank() -> int:
    """This process's rank: the process group's, else torchrun's ``RANK`` (0 outside torchrun).

    Under torchrun without ``init_process_group`` it once said 0 in every process (a user trial: both
    ranks printed as rank 0), so ``if nd.rank() == 0:`` ran on every rank."""
    return dist.get_rank() if is_distributed() else _torchrun_env()[0]


def world_size() -> int:
    """The process group's size, else torchrun's ``WORLD_SIZE`` (1 outside torchrun)."""
    return dist.get_world_size() if is_distributed() else _torchrun_env()[1]


def _need_group(what: str) -> None:
    """Refuse to gather when torchrun started several ranks but no process group exists.

    Without a group every process measured itself as a world of one: a user trial under
    ``torchrun --nproc_per_node=2`` got "across 1 rank(s)" from both ranks, and `profile` wrote
    ``nbaccel.rank0.pt.trace.json`` from both, one silently overwriting the other. Nothing could
    be gathered, so the call is refused before anything runs, on every rank (each sees the same
    environment), naming the fix."""
    if is_distributed():
        return
    this, world = _torchrun_env()
    if world > 1:
        raise NoProcessGroup(
            f"torchrun started {world} ranks (this is rank {this}) but no process group is initialised, so "
            f"{what} cannot gather them: call torch.distributed.init_process_group('gloo') (CPU) or "
            "init_process_group('nccl') (GPUs) first; to measure each process on its own, call nbaccel's plain "
            "functions instead (nbaccel.compare_amp, nbaccel.profile, nbaccel.memory_budget)")


def cpu_group():
    """A gloo process group over all ranks (the default group when it is already gloo)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")  # collective: every rank gets here together
    return _CPU_GROUPS[key]


def _all_gather(obj, group=None) -> list:
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj, group=group if group is not None else cpu_group())
    return out


def run_all(fn, group=None, *, options: dict | None = None, what: str = "this call", starting: bool = False):
    """Run ``fn()`` on this rank, then agree with every rank on whether all succeeded.

    Returns ``fn()``'s value when every rank succeeded. Otherwise raises on every rank: the rank
    whose code raised re-raises its own exception (with a note naming the other failed ranks),
    the others raise `RankFailure`. Only ``Exception`` is caught; KeyboardInterrupt propagates.
    ``options`` (plain values) travel in the same exchange, with ``what`` (the call): when either
    differs between ranks, every rank raises `RankMismatch` naming the call, the options and the
    ranks. ``starting``: ``fn`` is ``what``'s own preparation, not the user's code, and
    `RankFailure` says so.
    """
    _need_group(what if what != "this call" else "nbaccel.distributed.run_all")
    error, value = None, None
    try:
        value = fn()
    except Exception as exc:  # exchanged below, then re-raised unchanged on this rank
        error = exc
    try:
        status = _all_gather((rank(), None if error is None else f"{type(error).__name__}: {error}", options,
                              what), group)
    except Exception as exchange_error:
        if error is None:
            raise
        # The process-group timeout, from either side of a failure in the code's own collectives:
        # this rank failed and the others were left waiting in them, or another rank failed and this
        # one's error is the backend's ("Connection closed by peer"). The exception is kept either way.
        _note(error, f"nbaccel.distributed: the ranks could not agree on errors afterwards "
                     f"({type(exchange_error).__name__}: {exchange_error}). If this error is a timeout or a "
                     "closed connection, another rank probably failed: look for its traceback in torchrun's "
                     "output; otherwise the other ranks were probably left waiting in the code's own collectives")
        raise error from None
    failures = {r: msg for r, msg, _, _ in status if msg is not None}
    if error is not None:
        others = {r: m for r, m in failures.items() if r != rank()}
        if others:
            _note(error, f"nbaccel.distributed: also failed on rank(s) {sorted(others)}")
        raise error
    calls = {r: call for r, _, _, call in status}
    if len(set(calls.values())) > 1:  # one rank in nd.profile, another in nd.compare_amp: nothing pairs up
        raise RankMismatch(what, {"call": calls})
    if failures:
        raise RankFailure(failures, what if starting else None)
    differences = _differences({r: opts or {} for r, _, opts, _ in status})
    if differences:
        raise RankMismatch(what, differences)
    return value


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(text)


# --- gathered reports ---------------------------------------------------------------------------

def summarize(values: dict[int, float], higher_is_slower: bool = True) -> dict:
    """{rank: value} -> min / median / max, the ranks holding them, and the slowest rank (the largest
    value by default; the smallest for a speedup, ``higher_is_slower=False``)."""
    if not values:
        return {"min": None, "median": None, "max": None, "min_rank": None, "max_rank": None, "slowest_rank": None,
                "spread": None}
    ordered = sorted(values.items(), key=lambda kv: kv[1])
    slowest = ordered[-1][0] if higher_is_slower else ordered[0][0]
    lo, hi = ordered[0][1], ordered[-1][1]
    return {"min": lo, "median": statistics.median(values.values()), "max": hi, "min_rank": ordered[0][0],
            "max_rank": ordered[-1][0], "slowest_rank": slowest, "spread": (hi - lo) / lo if lo else None}


_HIGHER_IS_FASTER = {"speedup"}  # every other gathered metric is a time or a size: larger is slower / bigger


@dataclass
class RankReport:
    """One metric table across ranks. ``ranks`` is one dict per rank (rank order); ``metrics``
    names the numeric fields summarized (larger = slower / bigger)."""

    kind: str
    ranks: list[dict]
    metrics: list[str]
    units: dict = field(default_factory=dict)
    see_also: str | None = None  # a line under the table: where the rest is (the traces' own analysis)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def stats(self, metric: str) -> dict:
        # A speedup's slowest rank is its smallest (to_dict()'s "slowest_rank" once named the largest).
        return summarize({r["rank"]: r[metric] for r in self.ranks if r.get(metric) is not None},
                         higher_is_slower=metric not in _HIGHER_IS_FASTER)

    @property
    def summary(self) -> dict:
        return {m: self.stats(m) for m in self.metrics}

    def to_dict(self) -> dict:
        """Plain JSON, as a result's (``results_frame`` reads its headline: medians, the slowest rank)."""
        from .results import SCHEMA_VERSION, json_safe
        from . import __version__

        dtypes = {r.get("amp_dtype") for r in self.ranks}
        agreed = {"dtype": dtypes.pop()} if len(dtypes) == 1 and None not in dtypes else {}
        return json_safe({"kind": f"{self.kind}_ranks", "schema_version": SCHEMA_VERSION,
                          "nbaccel_version": __version__, "world_size": self.world_size, **agreed,
                          "ranks": self.ranks, "summary": self.summary, "units": self.units})

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        # "max on": the rank holding the largest value, the slowest for a time but the best for a speedup
        # (the column was "max at (slowest / largest)", which a trial read as wrong on the speedup row).
        lines = [f"nbaccel {self.kind} across {self.world_size} rank(s):",
                 f"  {'metric':<22} {'min':>12} {'median':>12} {'max':>12}  max on"]
        for m in self.metrics:
            s = self.stats(m)
            if s["min"] is None:
                continue
            fmt = _formatter(self.units.get(m))
            lines.append(f"  {self.label(m):<22} {fmt(s['min']):>12} {fmt(s['median']):>12} {fmt(s['max']):>12}  "
                         f"{self._max_at(s, fmt)}")
        if self.see_also:
            lines.append(f"  {self.see_also}")
        return "\n".join(lines)

    def label(self, metric: str) -> str:
        """A metric's name as a reader says it: its unit is in the figures (``fp32_median_s`` shown as
        "11.3 ms" read as a mistake), and an AMP row names its dtype ("bf16 median", not "amp median")."""
        unit = self.units.get(metric)
        suffix = {"s": "_s", "us": "_us", "bytes": "_bytes"}.get(unit, "")
        name = metric[: -len(suffix)] if suffix and metric.endswith(suffix) else metric
        dtypes = {r.get("amp_dtype") for r in self.ranks} - {None}
        if name.startswith("amp_") and len(dtypes) == 1:
            name = f"{dtypes.pop()}_{name[4:]}"
        return name.replace("_", " ")

    def _max_at(self, s: dict, fmt=str) -> str:
        # Equal as shown, not only to the bit: a trial's speedups 2.2600001x and 2.26x both read "2.26x", and
        # "max on rank 1" singled out a rank for a difference the row does not show.
        if (s["min"] == s["max"] or fmt(s["min"]) == fmt(s["max"])) and self.world_size > 1:
            return "equal on every rank"  # naming one would single out a rank for nothing
        return f"rank {s['max_rank']} ({self.ranks[s['max_rank']].get('host', '?')})"


def _formatter(unit):
    from .memory import format_bytes
    from .timing import format_seconds

    if unit == "s":
        return format_seconds
    if unit == "bytes":
        return format_bytes
    if unit == "us":
        return lambda v: format_seconds(v / 1e6)
    if unit == "x":
        return lambda v: f"{v:.2f}x"
    return lambda v: f"{v:.3g}"


def _ident() -> dict:
    return {"rank": rank(), "host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": int(os.environ.get("LOCAL_RANK", rank()))}


_REFUSED = "_nbaccel_refused"  # the exchanged row's error, if the rank could not make its row


def _gather_rows(make_row, group=None, what: str = "nbaccel.distributed.gather") -> list[dict]:
    """Every rank's ``make_row()`` (a dict), with its rank, host and pid, in rank order.

    A row one rank cannot make (gather_amp(None)) raises there, and `RankFailure` on the others, in the same
    exchange: it raised on that rank alone, before the exchange, and left the others waiting in it (a trial)."""
    _need_group(what)
    error, row = None, {}
    try:
        row = make_row()
        if not isinstance(row, dict):
            raise TypeError(f"{what} takes a dict of this rank's figures ({{metric: value}}), got "
                            f"{type(row).__name__}")
    except Exception as exc:  # exchanged below, then re-raised unchanged on this rank
        error, row = exc, {}
    rows = _all_gather({**_ident(), **row, _REFUSED: None if error is None else f"{type(error).__name__}: {error}"},
                       group)
    refused = {r["rank"]: r[_REFUSED] for r in rows if r[_REFUSED] is not None}
    if error is not None:
        if len(refused) > 1:
            _note(error, f"nbaccel.distributed: also refused on rank(s) {sorted(set(refused) - {rank()})}")
        raise error
    if refused:
        raise RankFailure(refused, gathering=what)
    return sorted(({k: v for k, v in r.items() if k != _REFUSED} for r in rows), key=lambda r: r["rank"])


def gather(kind: str, local: dict, metrics: list[str], units: dict | None = None, group=None) -> RankReport:
    """All-gather one dict per rank into a `RankReport` (available on every rank)."""
    return RankReport(kind, _gather_rows(lambda: local, group), metrics, units or {})


def amp_row(result) -> dict:
    row = {"amp_dtype": result.amp.name, "amp_median_s": result.amp.median,
           "amp_peak_bytes": result.amp.memory.peak_bytes if result.amp.memory else None,
           "device": result.device.label}
    if result.baseline is not None:
        row.update({"fp32_median_s": result.baseline.median, "speedup": result.speedup,
                    "speedup_uncertain": result.speedup_uncertain,
                    "fp32_peak_bytes": result.baseline.memory.peak_bytes if result.baseline.memory else None})
    # What the rank's own report warned of (spread, too few runs, overlapping IQRs, contention): a
    # gathered speedup without them read as firm where no rank's own report was (a user trial).
    row["warnings"] = result.noise_warnings
    if result.nothing_cast and result.speedup is not None:  # the rank's own headline does not claim it either
        row["warnings"].append(f"{result.nothing_cast_words}: the {result.speedup:.2f}x between the variants is "
                               "not the recipe's (they ran the same kernels)")
    return row


_AMP_METRICS = ["fp32_median_s", "amp_median_s", "speedup", "fp32_peak_bytes", "amp_peak_bytes"]
_AMP_UNITS = {"fp32_median_s": "s", "amp_median_s": "s", "speedup": "x", "fp32_peak_bytes": "bytes",
              "amp_peak_bytes": "bytes"}


def gather_amp(result, group=None) -> RankReport:
    """Gather an `AmpResult` from every rank (call on every rank) into a `RankReport`. Anything else is a
    TypeError on its rank and `RankFailure` on the others, not a hang."""
    def row() -> dict:
        from .amp_result import AmpResult

        if isinstance(result, DistributedAmp):
            raise TypeError("gather_amp takes an AmpResult; this DistributedAmp is already gathered: its table is "
                            ".report (this rank's AmpResult is .local)")
        if not isinstance(result, AmpResult):
            raise TypeError(f"gather_amp takes the AmpResult nbaccel.compare_amp returned on this rank, got "
                            f"{type(result).__name__}")
        return amp_row(result)

    return RankReport("compare_amp", _gather_rows(row, group, "nbaccel.distributed.gather_amp"), _AMP_METRICS,
                      _AMP_UNITS)


@dataclass
class DistributedAmp:
    local: object  # this rank's AmpResult
    report: RankReport

    def to_dict(self) -> dict:
        """The gathered report's `RankReport.to_dict`, with this rank's own result under ``"local"``."""
        return {**self.report.to_dict(), "local": self.local.to_dict()}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        """The gathered table, headed by the recipe every rank ran (the options were agreed on)."""
        ranks = self.report.ranks
        dtypes = sorted({str(r.get("amp_dtype")) for r in ranks})
        lines = [str(self.report)]
        uncertain = [r["rank"] for r in ranks if r.get("speedup_uncertain")]
        if uncertain:
            which = "every rank" if len(uncertain) == len(ranks) else "rank " + ", ".join(map(str, uncertain))
            lines.append(f"  speedup uncertain on {which}: a re-run could reorder the variants there (warnings below)")
        lines += [f"  WARNING rank {r['rank']}: {w}" for r in ranks for w in r.get("warnings") or []]
        # A row without fp32_median_s ran with baseline=False (agreed on every rank): no fp32 to be against.
        against = ("against strict fp32" if any(r.get("fp32_median_s") is not None for r in ranks)
                   else "only (no fp32 baseline)")
        lines.append(f"  recipe: {', '.join(dtypes)} {against} on every rank")
        # A trial read rank 0's "speedup 0.31x" with no reason given: the device, and where the reason is.
        devices = _by_value({r["rank"]: r.get("device") for r in ranks}).replace("'", "")
        lines.append(f"  devices: {devices}" if len({r.get('device') for r in ranks}) > 1
                     else f"  device: {ranks[0].get('device')} on every rank")
        lines.append("  why, and how it was measured: print(res.local), this rank's own report (its advice, its "
                     "method)")
        return "\n".join(lines)


def compare_amp(fn, *args, group=None, **kwargs) -> DistributedAmp:
    """`nbaccel.compare_amp` on every rank, errors agreed on first (`run_all`), then gathered.

    Every rank must call it with the same arguments: if ``fn`` contains collectives (DDP's
    backward), all ranks run it the same number of times, so those collectives pair up. The
    arguments are compared first, and differing ones raise `RankMismatch` on every rank before
    ``fn`` runs anywhere; so do arguments that ``nbaccel.compare_amp`` refuses on any rank (a device that
    rank cannot use, a dtype, a count), raised there as its own error and on the others as `RankFailure`.
    """
    from .amp import check_compare_amp, compare_amp as _compare_amp

    # The arguments are checked on every rank, and agreed on, before fn runs on any: a device one rank
    # refused raised there while the others ran fn into DDP's all-reduce and waited out the group's timeout.
    run_all(lambda: check_compare_amp(fn, *args, **kwargs), group,
            options=_options(_compare_amp, fn, *args, **kwargs), what="nbaccel.distributed.compare_amp",
            starting=True)
    local = run_all(lambda: _compare_amp(fn, *args, **kwargs), group)
    return DistributedAmp(local, gather_amp(local, group))


def trace_path(directory: str, name: str = "nbaccel", rank_: int | None = None) -> str:
    """``<directory>/<name>.rank<r>.pt.trace.json`` -- one file per rank, as HTA expects."""
    r = rank() if rank_ is None else rank_
    return os.path.join(directory, f"{name}.rank{r}.pt.trace.json")


@contextlib.contextmanager
def profile(directory: str, name: str = "nbaccel", group=None, **kwargs):
    """`nbaccel.profile` on every rank, its trace written to `trace_path`; afterwards ``.report``
    holds each rank's profiled window and device/CPU time, gathered (``.result`` is this rank's).

    If the options are refused or the body raises on any rank, every rank raises (see `run_all`),
    after its profiler stopped.
    """
    from .profile import profile as _profile
    from .profile_options import ProfileError

    def prepare():
        # The arguments too are checked here, so that a rank refusing them raises on every rank.
        if isinstance(directory, bool) or not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"nbaccel.distributed.profile takes the folder for the per-rank traces first, e.g. "
                            f"profile('runs/prof'); got {directory!r}")
        if "trace" in kwargs:  # each rank's file is named here; a shared path would be overwritten by every rank
            raise TypeError("nbaccel.distributed.profile names each rank's trace itself (in the folder given "
                            "first); leave out trace=")
        folder = os.fspath(directory)
        if folder.endswith((".json", ".json.gz")) and not os.path.isdir(folder):
            # A trial's nd.profile("runs/prof.json") made a folder named prof.json, holding the traces.
            stem = os.path.basename(folder).split(".json")[0]
            raise ProfileError(f"nbaccel.distributed.profile takes a folder and writes one trace per rank in it, but "
                               f"{folder!r} reads as a file's name: pass the folder, and name= for the files' "
                               f"prefix: profile({os.path.dirname(folder) or '.'!r}, name={stem!r}) writes "
                               f"{trace_path(os.path.dirname(folder) or '.', stem)} on this rank (rank {rank()})")
        # On every rank before any starts its profiler, so a folder one rank cannot make (its parent a
        # file, /proc) raises on every rank at once, not after the others waited out the group's timeout.
        # check() refuses such a trace path as profile(trace=...) does, with the path and the fix (an
        # os.makedirs here raised a bare "No such file or directory" for /proc); the folders are made when
        # the trace is saved, so the report says which it created (made here, they were never said).
        return _profile(trace=trace_path(directory, name), **kwargs).check()

    with _measured(prepare, group, _options(_profile, **kwargs), "nbaccel.distributed.profile") as prof:
        yield prof
    res = prof.result
    row = {"trace": trace_path(directory, name), "window_us": res.window_us,
           "device_time_us": res.device_time_us if res.on_device else None, "top_op": _top_op(res.ops)}
    prof.report = gather("profile", row, ["window_us", "device_time_us"],
                         {"window_us": "us", "device_time_us": "us"}, group)
    # The table gives each rank's window and top op only; the per-rank op analysis (the slowest rank, compute,
    # communication and idle time) is the traces' own, and a trial's report did not say where to find it.
    folder = shlex.quote(os.fspath(directory))
    prof.report.see_also = (f"every rank's trace analysed together: python -m nbaccel trace {folder} "
                            f"(in a notebook: %profile_trace {folder})")


def _top_op(ops) -> str | None:
    return str(ops.iloc[0]["name"]) if len(ops) else None


def _reraise(error):
    if error is not None:
        raise error


@contextlib.contextmanager
def _ranks_agree(group):
    """Run the body; then every rank learns whether any rank's body raised, and all raise together
    (the body's own error where it had one), so no rank waits in a later collective forever."""
    error = None
    try:
        yield
    except Exception as exc:  # agreed on with the other ranks below, then re-raised
        error = exc
    run_all(lambda: _reraise(error), group)


@contextlib.contextmanager
def _measured(prepare, group, options: dict, what: str):
    """Build and check the measuring context ``prepare()`` on every rank, then run the body in it.

    ``prepare()`` does everything entering can refuse on, and that is agreed on, together with the
    ``options``, *before* any rank enters: a bad or differing option on one rank raises on every
    rank there, so no rank runs the body alone and waits for the others in a later gather. Nothing
    collective runs between entering and the body, nor between the body and leaving: nbaccel's own
    exchange (a wait for the slowest rank) would be profiled or measured as the body's. The body's
    errors are agreed on after the context exited (the profiler has stopped, the budget has
    recorded the block). Entering can still fail after the check (a profiler started in between);
    that is agreed on after the body, like the body's own errors.
    """
    measuring = run_all(prepare, group, options=options, what=what, starting=True)
    with _ranks_agree(group), measuring:
        yield measuring


@dataclass
class BudgetReport(RankReport):
    """The gathered `memory_budget` report: the peak's min / median / max, then every rank's budget,
    peak and status in the words of ``%memory_budget``'s history (ok / near / over / already ...). A share budget
    (0.8) is a different size on a smaller GPU, and a summary of peaks alone cannot say which rank
    went over its own budget."""

    def __str__(self) -> str:
        from .render.budget import ranks_text

        return f"{super().__str__()}\n{ranks_text(self.ranks)}"

    def to_dict(self) -> dict:
        return {**super().to_dict(), "over_ranks": [r["rank"] for r in self.ranks if r.get("status") == "over"]}


@contextlib.contextmanager
def memory_budget(budget, group=None, **kwargs):
    """`nbaccel.memory_budget` on every rank; afterwards ``.report`` (a `BudgetReport`) holds every
    rank's budget, peak of the block and status (ok / near / over / already ...), and the peak's min / median /
    max with the rank of the largest named.

    A budget refused on any rank ("8 parsecs") raises on every rank before the body runs."""
    from .budget import memory_budget as _memory_budget

    def prepare():
        mb = _memory_budget(budget, **kwargs)
        # __exit__, _measured, its contextlib exit, this generator, its contextlib exit: the user's line
        mb._stacklevel = 6
        return mb

    with _measured(prepare, group,
                   _options(_memory_budget, budget, **kwargs), "nbaccel.distributed.memory_budget") as mb:
        yield mb
    rec = mb.watcher.records[-1] if mb.watcher.records else None
    row = {"peak_bytes": rec.used_bytes if rec else None, "budget_bytes": mb.budget,
           "fraction": rec.fraction if rec else None, "status": rec.status if rec else None,
           "near": mb.watcher.near, "device": str(mb.device)}
    mb.report = BudgetReport("memory_budget", _gather_rows(lambda: row, group), ["peak_bytes"],
                             {"peak_bytes": "bytes"})
