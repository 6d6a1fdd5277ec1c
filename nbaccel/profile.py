"""``nbaccel.profile``: run code under ``torch.profiler`` and say where the time goes.

How a profile is made (the method, spelled out because every number depends on it):

1. Refuse to start if a profiler is already running (``torch._C._autograd._profiler_enabled()``):
   two Kineto sessions cannot share the process, and the second would silently get nothing.
2. ``torch.profiler.profile`` with CPU activities, plus CUDA on a CUDA device, and always
   ``record_shapes=True``: FLOPs and the matmul padding advice are computed from input shapes.
   ``--warmup W --steps S`` becomes ``schedule(wait=0, warmup=W, active=S, repeat=1)``; the code
   runs W+S times, like a training loop, and only the S active steps are recorded. Without a
   schedule the code is one step, a ``ProfilerStep#0`` range, so the wall time covers all of it. Re-running
   is the point (a step's cost is only visible after warm-up) and it changes your state W+S
   times, exactly as W+S iterations of your loop would. Nothing is restored afterwards.
3. After the last step the device is synchronized and the profiler stopped; the Chrome trace
   is exported by Kineto (C++, fast) and parsed by `nbaccel.analysis` -- the same loader,
   kernel classifier (Tensor Cores, categories), FLOP formulas and peak table that analyse
   traces from other machines. The live CUDA path therefore runs through code that is tested
   on real H100/A100/B200 traces. ``key_averages()`` is never called (it re-parses every event
   in Python; the trace loader is what gives kernels, links and categories).
   Nothing more is computed until it is read: what a display shows (header, top-K table,
   categories, shapes, advice) is computed from the loader's column lists in plain Python, and
   the DataFrames (``result.ops``, ``categories``, ``op_events``) are built on first access. On
   a ~100-op CPU profile, loading the parsed trace + analysis + text + HTML takes about 1.2 ms
   instead of about 19 ms when everything was built with pandas (docs/benchmarks.md).
   Around the active steps, one `contention.ContentionMeter` span measures the CPU time other
   programs used meanwhile (as ``%%amp`` does around its timed runs): on a loaded machine the
   per-op CPU times are inflated and the result says so, with the same threshold.
4. If the code raises (or is interrupted), the profiler is stopped, the partial profile is
   discarded with a message, and the exception propagates. Autocast, TF32 and every other
   flag the ``--amp`` recipe set are restored in ``finally``.

Kineto prints ``USDT: ... profiler_start`` / ``profiler_stop`` lines straight to file
descriptor 2 on every start and stop, whatever ``KINETO_LOG_LEVEL`` says (checked on torch
2.13). ipykernel forwards fd 2 into the cell's output, so they would appear under every
profiled cell. `quiet_kineto` captures fd 2 only around our own start/step/stop calls (never
around user code) and re-emits every line that is not one of those two markers.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from .keywords import explains_keywords
from .analysis.trace import paused_gc
from .contention import ContentionMeter
from .device import device_info, resolve_device
from .failure_hints import failure_hint
from .memory import note_harness
from .options import in_magic, option
from .precision import apply_recipe, make_recipe
from .profile_options import ProfileError, ProfileOptions, check_options, trace_is_file, validate
from .profile_result import ProfileResult
from .profiler_guard import SecondProfilerGuard
from .quiet import hiding_side_channels
from .recording import RECORDING
from .render.common import note_on_stderr
from .signals import exit_again, finish, sigint_held
from .stderr_filter import dropped_stderr_lines
from .trace_io import _RANK_NAME, worker_name, write_step_traces, write_trace_bytes

# --- Kineto's fd-2 chatter -----------------------------------------------------------------------

_KINETO_NOISE = re.compile(rb"^(?:USDT|STAGE):\S+ \S+ \d+:\d+ \S+\] ")


@contextlib.contextmanager
def quiet_kineto():
    """Drop Kineto's start/stop marker lines from fd 2 during our own profiler calls; keep the rest.

    Also hides torch's once-per-process "Profiler clears events at the end of each cycle" warning
    (2.11+): nbaccel's schedule has one cycle, so it is untrue here. (``acc_events=True`` would
    silence it too, but makes ``stop()`` parse every event into FunctionEvents eagerly -- tens of
    ms with record_shapes -- while nbaccel reads the exported trace instead.)
    """
    shown = getattr(torch.profiler.profiler, "_WARNINGS_SHOWN", None)
    shown_before = set(shown) if isinstance(shown, set) else None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_CYCLE_WARNING)
            filtered = dropped_stderr_lines(_KINETO_NOISE.match)
            filtered.__enter__()
            try:
                yield
            finally:
                # Not a `with`: a Ctrl-C at the first line of its __exit__ would leave fd 2 on the filter's
                # pipe; run again, it ends what is left of it (nothing once it has ended).
                try:
                    filtered.__exit__(None, None, None)
                except KeyboardInterrupt:
                    filtered.__exit__(None, None, None)
                    raise
    finally:
        if shown_before is not None:  # a hidden warning must still reach the user's own profilers
            shown.difference_update({m for m in shown - shown_before if re.match(_CYCLE_WARNING, m)})


_CYCLE_WARNING = r"Warning: Profiler clears events"


def _quietly(call: Callable[[], object]) -> None:
    """``call()`` inside `quiet_kineto`. Not a plain ``with``: an interrupt at the first line of contextlib's
    ``__exit__`` left the generator suspended, fd 2 on the filter's pipe until the garbage collector
    closed it; its exit is run again then (`signals.exit_again`)."""
    quieted = quiet_kineto()
    try:
        with quieted:
            call()
    except KeyboardInterrupt:
        exit_again(quieted)
        raise

_UNKNOWN_BLOCK = b"Memory block of unknown size was allocated before the profiling started"


def drop_unknown_block_warning(enabled: bool = True):
    """While ``memory=True`` (``--memory``) profiles the code, drop torch's "Memory block of unknown
    size was allocated before the profiling started" line from fd 2; pass everything else on.

    torch's CPU allocator logs that line (a C++ ``LOG(WARNING)`` written straight to fd 2, so no
    Python warning filter sees it) the first time, then every 1000th time, that a tensor allocated
    before the profiler started is freed while it records memory -- which is what ``x = ...`` in
    the profiled code does to the old ``x``. The memory columns simply do not count such frees;
    the line only alarms.
    """
    if not enabled:
        return contextlib.nullcontext()
    return dropped_stderr_lines(lambda line: _UNKNOWN_BLOCK in line)


# --- the profile ---------------------------------------------------------------------------------

# One nbaccel recorder per process (`recording`); kept under its old name for the modules that read it.
_RECORDING = RECORDING


def _profile_words(who: str) -> str:
    return "%%profile_gpu cell" if who == PROFILE_MAGIC else "nbaccel.profile()"


def _nested(who: str) -> ProfileError | None:
    """The refusal of a profile started while this thread's nbaccel profile records, else None; the
    outer profile is the error's ``_nbaccel_outer`` (its ``__exit__`` then says what happened, not that
    "the profiled code raised").

    Unchecked, the inner one was refused as "another torch profiler is already running ... (a `with
    torch.profiler.profile()` block or an earlier profile that was not stopped)", and the outer one said
    "the profiled code raised ProfileError" (a trial): neither said that the inner profile's code never ran."""
    outer = _RECORDING.profile_in_this_thread()
    if outer is None:
        return None
    inner = _profile_words(who)
    around = ("a %%profile_gpu cell" if outer._guard._who == PROFILE_MAGIC
              else "another nbaccel.profile()'s with block")
    error = ProfileError(
        f"an nbaccel profile is already running: this {inner} was started inside {around}, and torch runs one "
        "profiler per process, so it was refused before its code ran. Profile one or the other: take the code "
        f"out of the outer profile to profile it on its own, or remove this {inner}"
        + ("" if who == PROFILE_MAGIC else " (its code then runs in the outer profile, where "
                                           "result.table(filter='...') picks out its ops)"))
    error._nbaccel_outer = outer
    return error


# Who ran the cell, as a watching memory budget names it (`memory.note_harness`): "under %%profile_gpu".
PROFILE_MAGIC, PROFILE_API = "%%profile_gpu", "nbaccel.profile"


def harness_words(who: str) -> str:
    """Why a budget's figure for a profiled cell is the profiler's as well as the code's (`budget.harness_words`)."""
    more = ("--memory, --stack and more --warmup/--steps" if who == PROFILE_MAGIC
            else "memory=True, stack=True and more warmup/steps")
    return (f"the cell ran under {who}, so this peak includes the profiler's own memory: it keeps every recorded "
            f"event (ops, input shapes, and with them memory events and Python frames) in memory until the profile "
            f"is read, more with {more} -- not the peak of one plain run: a strict budget does not fail it -- run "
            "the cell plainly to check it against the budget")

@explains_keywords({"record_shapes": "shapes", "with_stack": "stack", "profile_memory": "memory", "repeat": "steps",
                    "active": "steps", "iterations": "steps", "dtype": "amp", "sort_by": "sort", "row_limit": "top"})
class profile:  # noqa: N801 - a context manager used like a function: `with nbaccel.profile():`
    """Profile the body of a ``with`` block; the analysis is ``.result`` afterwards.

    >>> with nbaccel.profile(top=10) as prof:
    ...     train_step(model, batch)
    >>> prof.result.ops.head()

    With ``warmup``/``steps``, call ``prof.step()`` at the end of each iteration (like
    ``torch.profiler``): ``warmup`` iterations run unrecorded, the next ``steps`` are analysed.
    Raises `ProfileError` when made if an option is wrong whatever the machine (``top=0``,
    ``amp="fp8"``, ``stack`` with ``shapes``), and on entry if it cannot work here (no CUDA
    device, an unwritable ``trace``, another profiler running); see the module docstring for
    the method. ``amp`` takes the spellings `nbaccel.precision` takes (``"bfloat16"``,
    ``torch.float16``).
    """

    def __init__(self, device="auto", *, top: int = 15, sort: str | None = None, memory: bool = False,
                 shapes: bool = False, stack: bool = False, warmup: int = 0, steps: int = 1,
                 trace: str | None = None, amp: str | None = None, filter: str = "",  # noqa: A002
                 options: ProfileOptions | None = None, contention_meter: ContentionMeter | None = None):
        if isinstance(device, int) and not isinstance(device, bool) and options is None:
            # profile(10) meant top=10 (a trial) and was "unknown device '10'": the device is the one positional.
            if device < 1:  # torch's way to write cuda:0, and no count a profile takes (a review)
                raise ProfileError(f"device={device}: nbaccel names its devices: device='cuda:{device}' for that GPU")
            raise ProfileError(f"device={device}: the device is profile()'s only positional argument; pass top={device} "
                               f"(or steps={device}) by keyword, e.g. nbaccel.profile(top={device}); for a GPU, name "
                               f"it: device='cuda:{device}'")
        if options is None and (isinstance(device, bool) or not isinstance(device, (str, torch.device))):
            # profile(model) built a profile "ready (Linear(...), 1 step)" and failed at the with line with the
            # model lowercased as a device name (a trial)
            what = f"{type(device).__name__} {device!r}" if not isinstance(device, torch.nn.Module) else \
                f"a {type(device).__name__} (the model)"
            raise ProfileError(f"device takes 'auto', 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {what}; the "
                               "code to profile goes inside the block: with nbaccel.profile() as prof: model(x)")
        if isinstance(trace, os.PathLike):  # a pathlib.Path: the result's text and JSON hold the path as text
            trace = os.fspath(trace)
        self.options = options or ProfileOptions(top=top, sort=sort, memory=memory, shapes=shapes, stack=stack,
                                                 warmup=warmup, steps=steps, trace=trace, amp=amp,
                                                 device=str(device), filter=filter)
        check_options(self.options)  # what needs no machine fails here; the rest when the block starts
        if self.options.trace:
            _warn_if_shared_trace(self.options.trace)
        self._result: ProfileResult | None = None
        # "ready" (made), "recording" (in the block), "done" (.result made) or "discarded" (the block raised)
        self._state = "ready"
        self.steps_done = 0
        self._prof = None
        # What a started profile must undo, each cleared once undone (`_stop` runs again after an interrupt):
        self._holds_lock = False  # _RECORDING
        self._profiler_state = None  # torch's profiler: None (off), "starting", "on" or "stopping"
        self._kineto_quieted = None  # quiet_kineto() around the profiler's stop, entered
        self._entered = False  # __enter__ returned: the code ran
        self._unknown_block_filter = None  # drop_unknown_block_warning, entered
        self._recipe_context: apply_recipe | None = None  # the --amp recipe, entered
        # refuses a torch profiler the profiled code starts (it ended this one's session: a segfault)
        self._guard = SecondProfilerGuard(lambda: getattr(self._prof, "profiler", None),
                                          "%%profile_gpu" if in_magic() else "nbaccel.profile")
        # Other programs' CPU use during the active steps: one span around them all (two /proc
        # readings, ~55 us each), never per op. Tests pass a meter with scripted readers.
        self._meter = contention_meter
        self._span = None
        self._step_range = None  # an unscheduled profile's ProfilerStep#0 range, open while the code runs
        self._earlier, self._created = [], None  # the trace folder as the profile started (_trace_folder_before)
        # An exception raised by nbaccel's own code inside the block (the profiler's step, the magic's
        # loop between runs), not by the profiled code: __exit__ must not blame the code for it.
        self._own_failure: BaseException | None = None

    def check(self) -> "profile":
        """Everything entering the block can refuse on (the device, the ``amp`` recipe, an unwritable
        ``trace``, another profiler running), checked without starting anything.

        `nbaccel.distributed.profile` calls it on every rank and agrees on the outcome before any rank
        starts its profiler, so that nbaccel's exchange between the ranks is not recorded as part of
        the profile. ``__enter__`` checks again (a profiler may have started in between).
        """
        nested = _nested(self._guard._who)
        if nested is not None:
            raise nested
        self.device, self.info, self.recipe = validate(self.options)
        # validate's check reads the calling thread's profiler state only; Kineto has one session per
        # process, and two threads profiling at once crashed the process.
        if _RECORDING.locked():
            raise ProfileError(_RECORDING.refusal(f"this {_profile_words(self._guard._who)}"))
        return self

    def __enter__(self) -> "profile":
        try:
            return self._enter()
        except KeyboardInterrupt:
            # Starting Kineto takes a while on a first profile (~0.3 s): a Ctrl-C there was a bare
            # KeyboardInterrupt with no note (a user trial), where every later one says where it landed.
            note_on_stderr("nbaccel: interrupted (KeyboardInterrupt) while the profiler started, before the profiled code ran; "
                           "nothing was recorded, and torch's settings are as they were")
            raise

    def _enter(self) -> "profile":
        opts = self.options
        self.check()
        # Each `with` is a profile of its own: a second use of the object counted on from the first's steps.
        self.steps_done, self._own_failure, self._result, self._entered = 0, None, None, False
        # What the trace folder holds and lacks as the profile starts, not after the code ran: under
        # torchrun the other ranks write their files into the same folder meanwhile, and they are not
        # earlier runs (nor is which rank "created the folder" worth a race). Read before the lock is
        # taken: a listing that fails (a folder without read permission, a Ctrl-C on a slow share) left
        # it held, and every later profile in the process was "another thread is recording".
        self._earlier, self._created = _trace_folder_before(opts.trace)
        with sigint_held():  # taken and noted together: a Ctrl-C in between would leave it held for good
            self._holds_lock = _RECORDING.take(
                "a %%profile_gpu cell" if self._guard._who == PROFILE_MAGIC else "an nbaccel.profile() block",
                profile=self)
        if not self._holds_lock:  # taken since check() by another thread
            raise ProfileError(_RECORDING.refusal(f"this {_profile_words(self._guard._who)}"))
        try:
            self._start(opts)
        except BaseException:
            self._stop(*sys.exc_info())  # what was started, and the lock
            raise
        if self.device.type == "cpu":
            # A budget watching this cell (%memory_budget, memory_budget()) measures the process (RSS) on the
            # CPU, and so counts the events the profiler keeps in memory until it is read: a trial's CNN step
            # added 120 MiB plainly, 180 MiB under %%profile_gpu and 494 MiB with --memory --warmup 1 --steps 3,
            # and was told "over ... lower the batch". Noted as compare_amp notes its comparison, so the budget
            # says why and a strict one does not fail the cell. (A CUDA budget measures device memory, which
            # the profiler's host-side events do not use: nothing to note there.)
            note_harness(PROFILE_MAGIC if in_magic() else PROFILE_API, 0)
        self._entered = True
        self._state = "recording"
        return self

    @property
    def result(self) -> ProfileResult:
        """The `ProfileResult`, made when the ``with`` block ends.

        Before that it was a silent None (a user trial read ``prof.result`` inside the block and got
        ``'NoneType' object has no attribute 'ops'``); now an AttributeError says when it comes."""
        if self._result is not None:
            return self._result
        if self._state == "recording":
            why = "the profile is still recording: read prof.result after the with block ends"
        elif self._state == "discarded":
            why = ("its with block raised (the profiled code raised or was interrupted, or .step() was called too "
                   "few times), so the partial profile was discarded: run the block again")
        else:
            why = ("this profile has not run yet: use it as `with nbaccel.profile(...) as prof:` and read prof.result "
                   "after the block")
        raise AttributeError(f"nbaccel.profile has no .result yet: {why}")

    @result.setter
    def result(self, value: ProfileResult) -> None:
        self._result = value

    def __repr__(self) -> str:
        """Its state and where the result is, as MemoryBudget's repr says (printed, it was the default
        ``<nbaccel.profile.profile object at 0x...>``)."""
        opts = self.options
        device = getattr(self, "device", None) or opts.device
        steps = f"{opts.steps} step{'s' if opts.steps != 1 else ''}" + (f" after {opts.warmup} warmup" if opts.warmup
                                                                          else "")
        what = f"{device}, {steps}" + "".join(f", {flag}" for flag in ("memory", "shapes", "stack")
                                              if getattr(opts, flag) is True)
        if self._result is not None:
            return (f"<nbaccel.profile done ({what}): .result holds the ProfileResult, "
                    f"{self._result.op_count} op events>")
        if self._state == "recording" and not opts.scheduled and self.steps_done:  # the first step() ended it
            return (f"<nbaccel.profile recorded its one step ({what}); the block runs on unrecorded: .result holds "
                    "the ProfileResult when the with block ends>")
        if self._state == "recording":
            calls = f", {self.steps_done} of {opts.warmup + opts.steps} .step() calls so far" if opts.scheduled else ""
            return (f"<nbaccel.profile recording ({what}){calls}: .result holds the ProfileResult when the with "
                    "block ends>")
        if self._state == "discarded":
            return f"<nbaccel.profile discarded ({what}): its with block raised, so there is no .result>"
        return f"<nbaccel.profile ready ({what}): use it in a with block; .result holds the ProfileResult after it>"

    def _start(self, opts: ProfileOptions) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = None
        if opts.scheduled:
            with warnings.catch_warnings():
                # "won't be using warmup": --warmup 0 is the user's explicit choice, not a mistake.
                warnings.simplefilter("ignore", UserWarning)
                schedule = torch.profiler.schedule(wait=0, warmup=opts.warmup, active=opts.steps, repeat=1)
        self._cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
        self._prof = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True,
                                            profile_memory=opts.memory, with_stack=opts.stack)
        # Entered first, left last (in _stop, after the profiler stopped): the line comes from frees.
        unknown_block_filter = drop_unknown_block_warning(enabled=opts.memory)
        unknown_block_filter.__enter__()
        self._unknown_block_filter = unknown_block_filter
        self._profiler_state = "starting"  # an interrupt inside start() may come after the profiler is on
        _quietly(self._prof.start)
        self._profiler_state = "on"
        self._guard.install()  # a profiler the code starts now would end this one's session
        if self.recipe is not None:
            recipe_context = apply_recipe(self.recipe)
            recipe_context.__enter__()
            self._recipe_context = recipe_context
            self._cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
        self._meter = self._meter or ContentionMeter()
        if not opts.warmup:
            self._open_span()
        if not opts.scheduled:
            # One step without a schedule is recorded as torch's schedule records each step: a
            # ProfilerStep range around the code. Without it the trace spans only its first to last
            # op, and "wall time" (and FLOP/s over it) left out the Python, I/O and sleeps before the
            # first op and after the last (a trial: 6.6 ms for a 212 ms block).
            step_range = torch.profiler.record_function("ProfilerStep#0")
            step_range.__enter__()
            self._step_range = step_range

    def _open_span(self) -> None:
        self._span = self._meter.span("profiled steps")
        self._span.__enter__()

    def _close_span(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)

    def step(self) -> None:
        """End one iteration (``prof.step()`` of torch.profiler): advances warmup -> active steps."""
        if self._state == "ready":  # was "'NoneType' object has no attribute 'step'" (a trial)
            raise RuntimeError("prof.step() ends a step of a running profile: call it inside "
                               "`with nbaccel.profile(steps=N) as prof:`, once per iteration")
        if self._state in ("done", "discarded"):  # was ignored without a word (a review)
            raise RuntimeError("prof.step() after the with block: the profile has ended"
                               + (", and its result is prof.result" if self._state == "done" else "")
                               + "; call prof.step() inside the block, once per iteration")
        self.steps_done += 1
        try:
            self._step()
        except BaseException as exc:  # a Ctrl-C in Kineto's step (it stops the recording after the last one)
            self._own_failure = exc
            raise

    def _step(self) -> None:
        if self.options.scheduled:
            # The span opens as the last warmup step ends and closes as the last active step ends,
            # before the profiler's step() that stops the recording (its post-processing is not the cell).
            if self.steps_done == self.options.warmup:
                self._open_span()
            elif self.steps_done == self.options.warmup + self.options.steps:
                self._close_span()
            _quietly(self._prof.step)
        elif self.steps_done == 1:
            # steps=1 records one step, as torch's schedule(active=1) would: the first prof.step() ends the
            # recording. It recorded every iteration of a loop calling step() and said "1 step" (a trial: 3
            # iterations' ops, FLOPs and wall time under a header of one).
            self._end_recording()

    def _end_recording(self) -> None:
        """Stop recording before the block ends (what `_stop` does but the recipe, lock and filter, which
        stay until the block's exit)."""
        self._end_step_range()
        self._close_span()
        self._guard.remove()
        self._stop_profiler()

    def _stop(self, exc_type=None, exc=None, tb=None) -> None:
        """Stop recording and undo what `_start` did: the step range, the ``--amp`` recipe, the profiler,
        the stderr filter, the lock. ``exc_*``: the block's exception, if any (the recipe keeps a flag
        the code set only when it succeeded).

        A Ctrl-C that cut this short left the profiler running (with ``--stack`` its Python tracer as
        ``sys.setprofile``; a segfault as the process exited), autocast on, the recording lock held
        (every later profile refused) and fd 2 on the filter's pipe. So the steps run with SIGINT
        held, each is done once (its reference is cleared when it is), and this runs again when an
        interrupt still got in (`signals.finish`; `__exit__` and `profile_function` call it again
        after one at their first line): the interrupt is raised when everything is undone."""
        finish(self._stop_steps, exc_type, exc, tb)

    def _end_step_range(self) -> None:
        """End an unscheduled profile's ProfilerStep#0 range, once."""
        if self._step_range is not None:
            if self.device.type == "cuda":  # the step ends when its kernels do, as its wall time says
                torch.cuda.synchronize(self.device)
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _stop_steps(self, exc_type, exc, tb) -> None:
        try:
            self._end_step_range()
        finally:
            self._stop_recording(exc_type, exc, tb)

    def _stop_recording(self, exc_type, exc, tb) -> None:
        try:
            if self._recipe_context is not None:
                # The exception, if any, goes to the recipe: it keeps flags the code set only on success.
                self._recipe_context.__exit__(exc_type, exc, tb)
                self._recipe_context = None
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every queued kernel belongs to this profile
            self._close_span()  # still open without a schedule, or when the code raised
            self._guard.remove()  # before the stop: torch's own calls of the stop need no guard, later ones none
            try:
                self._stop_profiler()
            finally:
                try:
                    if self._unknown_block_filter is not None:
                        self._unknown_block_filter.__exit__(None, None, None)
                        self._unknown_block_filter = None
                finally:
                    if self._holds_lock:
                        _RECORDING.release()
                        self._holds_lock = False

    def _stop_profiler(self) -> None:
        if self._profiler_state is not None:
            # An interrupted start() or stop() left torch's profiler on or off: stop() only while it is
            # on (a second stop() past the point where the first switched it off would fail).
            if self._profiler_state != "on" and not torch.autograd._profiler_enabled():
                self._profiler_state = None
            else:
                if self._kineto_quieted is None:
                    quieted = quiet_kineto()
                    try:
                        quieted.__enter__()
                        self._kineto_quieted = quieted
                    except Exception:  # noqa: BLE001 - a filter that cannot start must not keep the profiler on
                        pass  # stopped unfiltered: Kineto's marker line shows
                step_range = getattr(self._prof, "step_rec_fn", None)
                if step_range is not None and getattr(step_range, "record", True) is None:
                    # An interrupt at the start of torch's own step range (in prof.step()) left it not entered,
                    # and stop() failed on it (AssertionError) before stopping anything: the profiler ran on.
                    self._prof.step_rec_fn = None
                self._profiler_state = "stopping"
                self._prof.stop()
                if torch.autograd._profiler_enabled():
                    # An interrupt in prof.step() cut short the stop that ends the active steps after torch's
                    # schedule had moved on: stop() then found nothing to do, and the profiler ran on.
                    self._prof.stop_trace()
                self._profiler_state = None
        # Its own step: after an interrupt between the stop and this exit, the exit runs without a second stop.
        if self._kineto_quieted is not None:
            self._kineto_quieted.__exit__(None, None, None)
            self._kineto_quieted = None

    def _left_to_stop(self) -> bool:
        """Whether some of `_stop`'s work is still to do (it never ran, or an interrupt stopped it)."""
        return bool(self._holds_lock or self._profiler_state is not None or self._kineto_quieted is not None
                    or self._step_range is not None or self._recipe_context is not None
                    or self._unknown_block_filter is not None)

    def _stop_after_interrupt(self, interrupt: KeyboardInterrupt) -> None:
        """After ``interrupt`` came out of the ``with`` block: if it landed at the first line of `__exit__`,
        none of it ran, and the profiler, the recipe's flags and the lock are still on; stop them, and
        say so as `__exit__` would. Nothing when `__exit__` ran (the code's own interrupt, or one later)."""
        if not self._left_to_stop():
            return
        self._state = "discarded"
        self._stop(type(interrupt), interrupt, interrupt.__traceback__)
        if not self._entered:  # in __enter__, which said so
            return
        body = interrupt.__context__  # what the block raised, if anything, as __exit__ was called
        code = ("had finished" if body is None else "had been interrupted" if isinstance(body, KeyboardInterrupt)
                else f"had raised {type(body).__name__}")
        self._say_interrupted("while the profiler stopped", code)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._state = "discarded"  # until a result is made below
        try:
            self._stop(exc_type, exc, tb)
        except Exception:
            if exc_type is None:
                raise
        except KeyboardInterrupt:
            # One at the first line of _stop (or of finish) skipped all of it: run it now (nothing if it ran).
            self._stop(exc_type, exc, tb)
            # the code's own failure is not said below then: this note says both
            code = ("had finished" if exc_type is None else "had been interrupted"
                    if issubclass(exc_type, KeyboardInterrupt) else f"had raised {exc_type.__name__}")
            self._say_interrupted("while the profiler stopped", code)
            raise
        if exc_type is not None:
            if exc is self._own_failure:
                what = ("interrupted (KeyboardInterrupt) in nbaccel's profiler" if isinstance(exc, KeyboardInterrupt)
                        else f"nbaccel's profiler failed ({exc_type.__name__})")
                note_on_stderr(f"nbaccel: {what}, not in the profiled code; the profiler was stopped and the partial profile "
                               f"discarded. {self._what_stays()}")
                return False
            runs = self.options.warmup + self.options.steps
            which = f" in run {self.steps_done + 1} of {runs}" if runs > 1 else ""
            if getattr(exc, "_nbaccel_outer", None) is self:  # its error says why; this one was stopped
                note_on_stderr(f"nbaccel: a profile started inside this {self._guard._who}{which} was refused before its "
                               f"code ran (one profiler at a time: the error below says what to do); this {self._guard._who} "
                               f"was stopped there and its partial profile discarded. {self._what_stays()}")
                return False
            what = ("was interrupted (KeyboardInterrupt)" if issubclass(exc_type, KeyboardInterrupt)
                    else f"raised {exc_type.__name__}")  # worded as %%amp words an interrupt
            hint = failure_hint(exc, self.device) if exc is not None else None
            note_on_stderr(f"nbaccel: the profiled code {what}{which}; the profiler was stopped and the "
                           f"partial profile discarded. {self._what_stays()}" + (f" Hint: {hint}." if hint else ""))
            return False
        needed = self.options.warmup + self.options.steps
        if self.options.scheduled and self.steps_done < needed:
            active = max(0, self.steps_done - self.options.warmup)
            # "no active step was completed" was said of warmup=1, steps=2 with 2 calls: one was
            done = (f"only {active} of the {self.options.steps} active steps {'was' if active == 1 else 'were'} completed"
                    if active
                    else "so no active step was completed")
            # With none at all, the loop is what is missing (a trial's with-block ran its code once, no loop):
            # the fix in code, not only the count.
            how = ("; call prof.step() at the end of each iteration of a loop that runs the code "
                   f"{needed} times or more (`for _ in range({needed}): ...; prof.step()`), or drop warmup= and "
                   "steps= to profile the block once" if not self.steps_done else "")
            raise ProfileError(f"profile(warmup={self.options.warmup}, steps={self.options.steps}) needs {needed} "
                               f"calls to .step(); got {self.steps_done}, {done}{how}")
        try:
            self.result = self._build()
            self._state = "done"
        except KeyboardInterrupt:
            self._say_interrupted("while nbaccel read the profile")
            raise
        return False

    def _say_interrupted(self, when: str, code: str = "had finished") -> None:
        """A Ctrl-C after the code's last run, in nbaccel's own work: said, as the code's own failures are."""
        note_on_stderr(f"nbaccel: interrupted (KeyboardInterrupt) {when}, after the profiled code {code}; the profile "
                       f"was discarded. {self._what_stays()}")

    def _what_stays(self) -> str:
        # A profile keeps the runs' effects (no snapshot): the message must not suggest otherwise.
        undone = (f"; only the {option('amp')} recipe's own flags (autocast, TF32, cudnn.benchmark) were put back"
                  if self.recipe is not None else "")
        return ("What the runs did to your variables and to torch's settings (grad mode, default dtype...) is "
                f"not undone{undone}.")

    def _build(self) -> "ProfileResult":
        opts = self.options
        # Kineto exports to a temporary file that we parse; the user's --trace is written from it
        # afterwards, so a path that fails at write time (checked writable, yet refused: /sys, a
        # full disk) costs the trace file, never the profile.
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix="nbaccel_profile_")
        os.close(fd)
        with paused_gc():  # the parsed trace is thousands of small containers: see paused_gc
            try:
                self._prof.export_chrome_trace(tmp)
                doc = _read_json(tmp)
                files, created = _save_trace(tmp, doc, opts.trace, self._created) if opts.trace else ([], None)
            finally:
                os.unlink(tmp)
            return ProfileResult.from_trace(doc, self.info, opts, recipe=self.recipe,
                                            cudnn_benchmark=self._cudnn_benchmark,
                                            trace_path=opts.trace if files else None, trace_files=files,
                                            contention=self._meter.result, trace_created=created,
                                            trace_earlier=[f for f in self._earlier if str(f) not in files],
                                            made_by="%%profile_gpu" if in_magic() else "profile()",
                                            # a loop that calls step() past the schedule's steps (a trial: 10
                                            # calls under warmup=1, steps=2 read "the code ran 3 times")
                                            unrecorded_steps=max(0, self.steps_done - (opts.warmup + opts.steps
                                                                                       if opts.scheduled else 1)))


def _trace_folder_before(target: str | None) -> tuple[list[str], str | None]:
    """As a profile starts: (the trace files ``--trace FOLDER`` holds already, the outermost folder
    that saving the trace will create). Without a trace: nothing."""
    if not target:
        return [], None
    path = Path(target).expanduser()
    created = _first_missing(path.parent if trace_is_file(target) else path)
    return ([] if trace_is_file(target) else _earlier_traces(target)), (str(created) if created is not None else None)


def _earlier_traces(folder: str) -> list[str]:
    """Trace files already in ``--trace FOLDER`` before this profile writes its own: loading the folder
    (``%profile_trace``) reads every file in it as steps of one run, so the result says they are there
    (a trial's folder, reused, gathered three runs' files without a word).

    Under torchrun the other ranks' files of this launch are not earlier runs, even when a rank
    finished before this one started: files of other processes written since the launch started
    (`_launch_started`) are left out. This process's own files are earlier runs whenever written."""
    path = Path(folder).expanduser()
    launch, own = _launch_started(), worker_name() + "."
    try:
        files = [f for f in path.iterdir() if f.name.endswith((".json", ".json.gz")) and f.is_file()]
        if launch is not None:
            files = [f for f in files if f.name.startswith(own) or f.stat().st_mtime < launch]
        return sorted(str(f) for f in files)
    except OSError:  # not there yet, or writable but not listable (chmod 333): nothing known to be earlier
        return []


def _launch_started() -> float | None:
    """Under torchrun (``WORLD_SIZE`` > 1): when this launch started, in Unix seconds, as the start of
    the workers' parent (torchrun's agent, started before every worker; read from Linux's /proc, as ps
    reads it). None for a single process, or where it cannot be read."""
    if _rank_and_world()[1] <= 1:
        return None
    try:
        with open(f"/proc/{os.getppid()}/stat") as fh:  # the command may hold spaces: fields after ")"
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:  # as ps does: the time since, not /proc/stat's btime (VMs drift)
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder on the way to ``folder`` that does not exist yet (what ``mkdir -p`` creates)."""
    missing = None
    for p in (folder, *folder.parents):
        if p.exists():
            break
        missing = p
    return missing


def _save_trace(exported: str, doc: dict, target: str, created: str | None) -> tuple[list[str], str | None]:
    """Write --trace (one file, or one file per step in a folder): (the files written, ``created``: the
    outermost folder missing when the profile started, so a mistyped path's new folders are said, not
    left unseen). A failure is reported as a warning with the way out, and the profile is kept."""
    path = Path(target).expanduser()
    try:
        if not trace_is_file(target):
            return write_step_traces(doc, target), created
        write_trace_bytes(_renamed(Path(exported).read_bytes(), exported, path), path)
        return [target], created
    except OSError as exc:
        lost = f"nbaccel could not write the trace to {target} ({exc.strerror or exc}); the profile is shown without it"
        if created is not None and Path(created).exists():  # made on the way before the write failed
            lost += f" (the folder {created} was created on the way and is left there)"
        if in_magic():  # a warning would show nbaccel's file, line and source to a notebook user
            note_on_stderr(f"{lost}: keep the result with -r NAME and save it with "
                           "NAME.export_chrome_trace('another/path.json')")
            return [], None
        with warnings.catch_warnings():
            warnings.simplefilter("always", TraceSaveWarning)  # every time: a lost file is never old news
            warnings.warn(f"{lost}: save it with result.export_chrome_trace('another/path.json')",
                          TraceSaveWarning, stacklevel=4)
        return [], None


def _renamed(data: bytes, exported: str, path: Path) -> bytes:
    """The exported trace with its ``traceName`` (the file Kineto wrote: nbaccel's temporary one, which a trial found
    in the saved trace) made the file it is saved as. One bytes replace of that exact JSON string, at the end of
    the file where Kineto writes it: no parse and re-dump of a trace of many MB."""
    old = b'"traceName": ' + json.dumps(exported).encode()
    at = data.rfind(old)
    if at < 0:  # another Kineto's layout: left as it is
        return data
    return data[:at] + b'"traceName": ' + json.dumps(str(path.resolve())).encode() + data[at + len(old):]


class SharedTraceWarning(UserWarning):
    """Under torchrun, every rank writes its trace to the same file."""


def _rank_and_world() -> tuple[int, int]:
    """This process's (rank, world size): the process group's, else torchrun's RANK / WORLD_SIZE
    environment (set for every worker, with or without init_process_group), else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:  # not torchrun's numbers: nothing to say about ranks
        return 0, 1


def _warn_if_shared_trace(target: str) -> None:
    """Under torchrun every rank runs the same ``trace=`` line, so one file path means the ranks
    overwrite each other's file and the last to finish wins, silently. A path that names this
    rank (``rank3``, as nbaccel.distributed.trace_path writes) is per rank already, and so is a
    folder: its files are named after the host and process (``{host}_{pid}.{ms}.pt.trace.json``),
    so every rank adds its own and none is overwritten."""
    rank, world = _rank_and_world()
    if world < 2 or not trace_is_file(target):
        return
    if any(int(r) == rank for r in _RANK_NAME.findall(str(target))):
        return
    # The warnings module shows it once per call site: a profiled loop does not repeat it.
    warnings.warn(f"trace={target!r}: torchrun runs {world} ranks and every rank writes its "
                  "trace to this same file, so the last rank to finish overwrites the others. Use "
                  "nbaccel.distributed.profile(directory), which writes one file per rank "
                  "(<directory>/nbaccel.rank<r>.pt.trace.json), a folder (one file per process), or put the rank "
                  "in the name", SharedTraceWarning, stacklevel=3)


class TraceSaveWarning(UserWarning):
    """The profile was made, but its --trace file could not be written."""


def profile_function(fn: Callable[[], object], options: ProfileOptions | None = None, silence=None,
                     contention_meter: ContentionMeter | None = None, **kwargs) -> "ProfileResult":
    """Run ``fn`` warmup+steps times under the profiler and return the `ProfileResult`.

    ``silence``: context-manager factory that hides the output of every run but the last (the
    magic passes IPython's capture); those runs also neither log, nor use up warnings, nor leave pyplot
    figures open, nor write to fds 1 and 2 (subprocesses, C code) (`nbaccel.quiet`).
    The last run's return value is ``result.value``.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
    options = options or ProfileOptions(**kwargs)
    runs = options.warmup + options.steps
    hidden = hiding_side_channels(silence) if silence is not None else None
    raised = []  # what fn itself raised; anything else in the block is nbaccel's (prof.step marks its own)

    def code():
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        try:
            return fn()
        except BaseException as exc:  # noted, then re-raised unchanged
            raised.append(exc)
            raise

    prof = profile(options=options, contention_meter=contention_meter)
    try:
        with prof:
            value = None
            quiet = None
            try:
                for i in range(runs):
                    quiet = hidden() if hidden is not None and i < runs - 1 else contextlib.nullcontext()
                    with quiet:
                        value = code()
                    if options.scheduled:  # one unscheduled step ends in the block's exit, where a Ctrl-C is said as such
                        prof.step()
            except BaseException as exc:  # a Ctrl-C between runs, in the hiding: the profile must not blame fn
                if not any(exc is e for e in raised):
                    prof._own_failure = exc
                if isinstance(exc, KeyboardInterrupt):  # one at the first line of the hidden run's exit
                    exit_again(quiet)
                raise
    except KeyboardInterrupt as exc:
        # One that landed at the first line of prof.__exit__ ran none of it: the profiler would run on.
        prof._stop_after_interrupt(exc)
        raise
    prof.result.value = value
    return prof.result


def _read_json(path: str) -> dict:
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        # Seen with torch 2.13: Kineto does not escape '"' in record_function names.
        raise ProfileError(f"torch.profiler wrote a trace that is not valid JSON ({exc}); a record_function "
                           "name containing a double quote causes this -- rename it") from exc


# --- GPU self-check ------------------------------------------------------------------------------

def tensor_core_check(n: int = 4096, repeat: int = 5, device="cuda") -> dict:
    """Profile a bf16 GEMM and an fp32 GEMM with TF32 off on CUDA; return their Tensor Core shares.

    Expected on Volta+ (bf16 needs Ampere+): bf16 near 1.0, strict fp32 near 0.0. A GPU check
    script prints this; it is also the ``gpu`` test of tests/test_profile_gpu.py.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ProfileError("tensor_core_check needs a CUDA device")
    out = {"device": device_info(dev).label, "n": n}
    for label, dtype, recipe in (("bf16", torch.bfloat16, None), ("fp32", torch.float32, make_recipe("fp32", dev))):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        with contextlib.ExitStack() as stack:
            if recipe is not None:
                stack.enter_context(apply_recipe(recipe))  # strict IEEE fp32: TF32 off
            a @ b  # warm up cuBLAS outside the profile
            torch.cuda.synchronize(dev)
            with profile(device=dev) as prof:
                for _ in range(repeat):
                    a @ b
        tc = prof.result.tensor_cores
        out[label] = {"tensor_core_share": tc.value, "kernel_us": tc.total_us,
                      "kernels": prof.result.kernels["name"].head(3).tolist(),
                      "fraction_of_peak": prof.result.header["fraction_of_peak"]}
    return out


# ProfileResult, ProfileOptions and ProfileError live in their own modules; named here too because
# a profile's user meets them together.
__all__ = ["profile", "profile_function", "ProfileResult", "ProfileOptions", "ProfileError", "TraceSaveWarning",
           "SharedTraceWarning", "tensor_core_check", "quiet_kineto"]

