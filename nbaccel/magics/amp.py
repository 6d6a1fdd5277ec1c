"""``%%amp``: the cell in fp32 and under autocast (+TF32), from the same starting state."""

from __future__ import annotations

import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..budget import checked_share
from ..amp import MIN_RUNS, compare_amp, not_restored, planned_runs, used_up
from ..failure_hints import failure_hint
from ..cell_reads import and_list
from ..device import DeviceError, autocast_dtype, device_info, did_you_mean, dtype_name, resolve_device
from ..options import magic_spelled, whole_number
from ..precision import make_recipe
from ..render.common import note_on_stderr
from ..snapshot import (LazyModuleNotReady, SnapshotTooLarge, describe_failures, not_put_back,
                        restore_failures)
from ..timing import format_seconds
from .common import (cell_function, check_name, check_name_free, comment_hinted, dtype_hint, help_option, history_name,
                     interrupt_without_frames, interrupted_in_nbaccel, ProgressNote, output_can_be_silenced, parse_line,
                     refuse_empty_cell, refuse_options_in_cell, refuse_nested_cell_magic, show_result, silenced,
                     sole_measuring_magic)
from .ran_before import remember

DTYPES = ("bf16", "fp16", "auto", "tf32")
# A comparison projected (from its measured first run) to take longer than this says so, with a
# shorter line to run instead: the cell runs planned_runs(...) times, 15 with the defaults.
LONG_RUN_SECONDS = 5.0
# The restore before each run is named in that note when it is at least this share of a run's time.
RESTORE_WORTH_SAYING = 0.1


@magics_class
class AmpMagics(Magics):
    # IPython's help formatter prefixes the usage line with "%", right for a line magic only; the
    # name "%amp" makes it read "%%amp [-h] ..." as the cell magic is typed.
    @output_can_be_silenced  # outermost: IPython reads the mark from the method it registered
    @magic_arguments(name="%amp")  # IPython puts one % before the usage line: %%amp
    @help_option
    @argument("--dtype", default="auto",
              help="autocast dtype: bf16, fp16 or auto (bf16 where supported, else fp16); tf32 = no autocast, "
                   "TF32 only (CUDA sm80+)")
    @argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: cuda when present)")
    @argument("--no-tf32", action="store_true", help="leave TF32 off for the mixed-precision run (CUDA, Ampere+)")
    @argument("--warmup", type=int, default=1, help="untimed rounds of both variants first (default 1)")
    @argument("--repeat", type=int, default=5, help="timed runs per variant (default 5)")
    @argument("--no-baseline", action="store_true", help="run only the mixed-precision variant (no fp32 comparison)")
    @argument("--emulated", action="store_true",
              help="run --dtype fp16 on a CPU without fp16 units (AMX-FP16/AVX512-FP16) rather than refuse it: its "
                   "drift and gradient overflow/underflow are fp16's, its times the emulation's (many times fp32's)")
    @argument("--no-restore", action="store_true",
              help="do not snapshot/restore your variables between runs (for state too large to copy; each "
                   "run then continues from the previous one's; torch's settings are still put back)")
    @argument("--max-snapshot", default="0.5", metavar="FRACTION",
              help="refuse when the state snapshot would exceed this fraction of available host memory: 0.5 or "
                   "50%% (default 0.5)")
    @argument("-r", "--result", default=None, metavar="NAME", help="store the AmpResult in this variable")
    @argument("-q", "--quiet", action="store_true",
              help="do not display the result, nor the note on how long a long comparison will take")
    @cell_magic
    @magic_spelled  # errors name options as typed: --top, not top=
    @comment_hinted  # '--top 5#rows' refused: says a comment needs a space before '#'
    def amp(self, line, cell):
        """Run the cell in strict fp32 and under torch.autocast (+TF32 on CUDA), from the same state.

        Shows time per variant (median, IQR), speedup, peak memory and its saving, drift of the
        cell's last value, which ops ran in reduced precision, gradient overflow/underflow (fp16),
        FLOP/s and advice. Before every run the namespace, tensors, modules, optimizers,
        schedulers, GradScalers, RNG states and torch's global settings (grad mode, default dtype,
        autocast, TF32/cuDNN flags, threads...) are restored, so afterwards your variables are
        exactly as after one run of the cell under the recipe.

            %%amp --dtype bf16 --repeat 10 -r res
            loss = train_step(model, batch)
            loss
        """
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        try:
            args, device, run = self._checked(line, cell)
        except KeyboardInterrupt as exc:  # a first call's device reading (CUDA starting) can take seconds
            raise interrupted_in_nbaccel(exc, "%%amp", "while nbaccel checked the options and the device, before "
                                         "any run", "the cell did not run") from None
        if args is None:  # -h/--help: the help was printed
            return None
        cell_errors = []  # (exception, which run) when the cell itself raised
        notes = ProgressNote(self.shell)  # the long-run note, replaced when the comparison ends
        firsts, announced = [], []  # each variant's first run (fp32's first); the estimates said so far

        def note_long_run(seconds, runs_left, restore_seconds):
            firsts.append(seconds)
            note = _note_long_run(firsts, runs_left, args, device, restore_seconds, announced)
            if note is not None:  # a second one (the variant's first run revised it) replaces the first
                notes.say(note)

        started, finished = time.perf_counter(), False
        with sole_measuring_magic("amp"):
            try:
                result = compare_amp(
                    run, dtype=args.dtype, device=device, tf32=not args.no_tf32, warmup=args.warmup,
                    repeat=args.repeat, baseline=not args.no_baseline, namespace=self.shell.user_ns,
                    skip=history_name(self.shell), silence=silenced, restore=not args.no_restore,
                    max_snapshot_fraction=args.max_snapshot, emulated=args.emulated,
                    on_cell_error=lambda exc, where: cell_errors.append((exc, where)),
                    on_first_run=None if args.quiet else note_long_run,  # -q: a progress note is output too
                )
                finished = True
            except BaseException as exc:  # KeyboardInterrupt too: noted, then re-raised unchanged
                cells_own = bool(cell_errors) and cell_errors[-1][0] is exc
                if not cells_own and isinstance(exc, (SnapshotTooLarge, LazyModuleNotReady, DeviceError)):
                    raise UsageError(str(exc)) from None
                note_on_stderr(_abandon_note(exc, cell_errors[-1][1] if cells_own else None, args.no_restore, device))
                if isinstance(exc, KeyboardInterrupt) and not cells_own:
                    raise interrupt_without_frames(exc) from None  # the note says it all; no nbaccel frames
                raise
            finally:
                # The runs it announced are over: it says how long they took, or that they stopped (an
                # emptied note left a blank output above the error in the saved notebook; a trial).
                elapsed = format_seconds(time.perf_counter() - started)
                # the process's memory (not an allocator's count) took more memory runs than planned
                allocator = not finished or result.amp.memory is None or result.amp.memory.exact
                runs = planned_runs(args.warmup, args.repeat, not args.no_baseline, device, allocator=allocator)
                done = (f"nbaccel %%amp: the {runs} runs took {elapsed} in all." if finished else
                        f"nbaccel %%amp: the runs stopped after {elapsed} (the note below says why).")
                notes.finish(done)
        # the fp32 baseline is the cell as a plain run is (no autocast): a later profile of it is not a first run
        remember(cell, *([None] if result.baseline is not None else []), result.amp.recipe.label)
        show_result(self.shell, "%%amp", result, args.result, args.quiet)
        return result.value

    def _checked(self, line, cell):
        """(the parsed options, the device, the cell as a function), every refusal a UsageError, before
        anything runs; (None, None, None) after -h."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        args = parse_line(self.amp, line, hint=dtype_hint("--dtype", DTYPES, dtype_name))
        if args is None:  # -h/--help: the help was printed
            return None, None, None
        typed, args.dtype = args.dtype, dtype_name(args.dtype)  # bfloat16, float16, half: the long names work too
        fp32 = args.dtype == "fp32"
        if fp32:
            # compare_amp's own reason ("fp32 is the baseline"), in the words the user typed: the magic's
            # "--dtype fp32 is not supported" named a spelling nobody wrote (--dtype float32) and no reason
            args.dtype = typed
        elif args.dtype not in DTYPES:
            raise UsageError(f"--dtype {typed} is not supported; use one of: {', '.join(DTYPES)}"
                             f"{did_you_mean('dtype', typed, DTYPES)}")
        # compare_amp checks these too, but its ValueError would surface after the snapshot, as nbaccel's own
        whole_number("repeat", args.repeat, 1, UsageError)
        whole_number("warmup", args.warmup, 0, UsageError)
        check_name(args.result, counts="--repeat")
        # read as %memory_budget reads a share ('0.5', '50%'): argparse's float gave "invalid float value: '50%'"
        args.max_snapshot = checked_share(args.max_snapshot, "--max-snapshot", "a fraction of available host memory",
                                          "0.5 or 50%", UsageError, zero=" (0 excluded)")
        refuse_empty_cell(self.shell, "amp", cell)
        refuse_options_in_cell(self.amp, cell)
        refuse_nested_cell_magic("amp", cell)
        check_name_free(self.shell, args.result, cell)
        try:
            device = resolve_device(args.device)
            if args.dtype == "tf32":
                make_recipe("tf32", device)
            elif not fp32:  # compare_amp refuses fp32 itself, before anything runs
                autocast_dtype(args.dtype, device_info(device), emulated=args.emulated)
        except DeviceError as exc:
            raise UsageError(str(exc)) from None
        return args, device, cell_function(self.shell, cell)


def _note_long_run(firsts: list[float], runs_left: int, args, device, restore_seconds: float = 0.0,
                   announced: list | None = None) -> str | None:
    """After each variant's first run (``firsts``: their times so far): when all runs together will take
    long, the note that says so, and how to shorten it; None when there is nothing (new) to say.
    ``restore_seconds``: what restoring the variables took before the first run, which every run pays too.
    ``announced``: the estimates said so far (appended to): a later one is said only when it is half as
    long again, so a terminal does not get two lines for one estimate.

    In a Jupyter kernel the note is a display that the magic empties when the runs are over (as a
    stderr line it stayed under the result as a red box); elsewhere it is a line on stderr."""
    announced = [] if announced is None else announced
    seconds = firsts[0]
    # the runs to come alternate between the variants: at their first runs' mean pace (a trial's fp16
    # conv runs took 74x the fp32 one's, and a note estimated from that one alone never came)
    each = sum(firsts) / len(firsts) + restore_seconds
    if each * (runs_left + len(firsts)) <= LONG_RUN_SECONDS:
        return None
    if announced and each * runs_left < 1.5 * announced[-1]:
        return None
    announced.append(each * runs_left)
    # Not "up to": the other variant's runs can be far slower (a trial: fp16 convolutions on a CPU without
    # AMX-FP16, 20x fp32: "up to about 9.85 s" announced, 84.9 s taken), and the first run also pays one-time
    # costs (oneDNN/cuDNN setup, a torch.compile in the cell compiling), so the rest can be far quicker
    # (a trial: "about 54 s" announced, 4.9 s in all).
    # Restoring the snapshot comes before every run, untimed: a trial's 1.15 GiB one made a 7 ms step's
    # comparison take 8.49 s, and the note, estimated from the run alone, never came.
    restoring = (f" and restoring your variables before it {format_seconds(restore_seconds)}, as before each run"
                 if restore_seconds >= RESTORE_WORTH_SAYING * each else "")
    took = (f"the first run took {format_seconds(seconds)}{restoring}" if len(firsts) == 1 else
            f"the first fp32 run took {format_seconds(firsts[0])} and the first mixed-precision one "
            f"{format_seconds(firsts[1])}{restoring}")
    pace = ("at that pace: longer if the other variant is slower, shorter where the first run paid one-time setup"
            if len(firsts) == 1 else "at their mean pace (shorter where the first runs paid one-time setup)")
    note = (f"nbaccel %%amp: {took}; {runs_left} more runs (warmup, timed, memory and audited runs per variant, "
            f"then the kept run) take about {format_seconds(each * runs_left)} {pace}.")
    fewer = _fewer_runs(args, device)
    if fewer:
        note += f" For fewer: {fewer}."
    return note


def _fewer_runs(args, device) -> str | None:
    """Options for fewer runs that still give a spread (MIN_RUNS timed runs per variant), if any."""
    repeat, warmup = min(args.repeat, MIN_RUNS), 0
    changes = [f"--repeat {repeat}"] * (repeat != args.repeat) + [f"--warmup {warmup}"] * (warmup != args.warmup)
    if not changes:
        return None
    return f"{' '.join(changes)} ({planned_runs(warmup, repeat, not args.no_baseline, device)} runs in all)"


def _abandon_note(exc: BaseException, where: str | None, no_restore: bool, device) -> str:
    """The line for a comparison that did not finish: who failed, and what was put back.
    ``where`` is the run the cell failed in, or None when the cell did not fail."""
    # compare_amp restores torch's settings either way; the variables only when it snapshotted them.
    settings = ("torch's global settings (grad mode, default dtype and device, autocast, TF32, cuDNN and oneDNN "
                "flags, matmul precision, threads, anomaly mode)")
    names = not_put_back(exc)  # what `_put_back` could not restore (the rest it did)
    state = (f"{settings} are as they were before the magic; your variables keep what the runs did (--no-restore)"
             if no_restore else
             f"{settings} are as they were before the magic, and so are your variables except "
             f"{and_list([f'`{n}`' for n in names])}, which could not be put back (see the note under the error)"
             if names else
             f"{settings} are as they were before the magic, but not all your variables: putting them back "
             f"{'was interrupted' if isinstance(exc, KeyboardInterrupt) else 'ran out of memory too'} (see the note "
             "under the error)" if not_restored(exc) else
             f"{settings} are as they were before the magic, and so are your variables except the iterator the "
             "runs used up (see the note under the error)" if used_up(exc)
             else
             f"your variables and {settings} are as they were before the magic")
    if where is not None:
        what = ("was interrupted (KeyboardInterrupt)" if isinstance(exc, KeyboardInterrupt)
                else f"raised {type(exc).__name__}")
        hint = failure_hint(exc, device)
        return (f"nbaccel %%amp: the cell {what} {where}; the comparison was abandoned: {state}."
                + (f" Hint: {hint}." if hint else ""))
    if not isinstance(exc, Exception):  # Ctrl-C while nbaccel's own code ran: nobody's bug
        return (f"nbaccel %%amp: interrupted ({type(exc).__name__}) while nbaccel was comparing, not in the cell; "
                f"the comparison was abandoned: {state}.")
    failures = restore_failures(exc)
    if failures:  # putting the variables back between runs failed for some object (the rest was put back)
        return (f"nbaccel %%amp: between two runs nbaccel could not put back {describe_failures(failures)}, so the "
                f"comparison was abandoned: {state}. --no-restore compares without putting variables back.")
    # Not the cell: nbaccel itself failed. Say so, rather than blame the user's code.
    return (f"nbaccel %%amp: nbaccel itself failed while comparing ({type(exc).__name__}); this is a bug in nbaccel, "
            f"not in your cell. {state[0].upper() + state[1:]}; run the cell without %%amp meanwhile.")
