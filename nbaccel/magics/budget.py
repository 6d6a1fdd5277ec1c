"""``%memory_budget``: watch every cell's peak memory against a budget, explain out-of-memory errors,
and predict whether a model fits.

While a budget is set this class holds three things in the shell, and gives all three back on
``%memory_budget off`` and on ``%unload_ext nbaccel`` (`on_unload`):

* ``pre_run_cell`` / ``post_run_cell`` callbacks (the per-cell meter);
* a custom exception handler for out-of-memory errors (``shell.set_custom_exc``); the handler
  that was there before is kept, called for its own exception types, and put back;
* with ``--enforce`` on CUDA, the caching allocator's per-process cap.

``%reload_ext nbaccel`` unloads (all three are removed) and loads again: `on_unload` returns the
budget's settings and history, and the new instance's `on_load` re-arms them (hooks, handler and
cap installed afresh, so nothing is doubled).
"""

from __future__ import annotations

import ast
import difflib
import gc
import re
import sys
import time
from dataclasses import replace

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

import torch

from ..budget import (NEAR, PUSHED, usage_now, BudgetError, BudgetExceeded, CellReport, Watcher, apply_cap,
                      capped_devices, check_near, parse_budget, plural, release_cap, share_text, size_reading, status,
                      unwritten_words, verdict)
from ..device import DeviceError, resolve_device
from ..holders import ERROR_FRAMES, namespace_holders
from ..memory import malloc_trim, format_bytes
from ..oom import OOM_TYPES, explain_oom, is_oom
from ..options import a_type, magic_spelled
from ..render.common import prose
from ..render.display import display_result
from ..timing import format_seconds
from .common import (ProgressNote, check_name, comment_hinted, help_option, history_name, interrupted_in_nbaccel,
                     parse_line, split_line, store_result)

_NEGATIVE = re.compile(r"^-\.?[0-9]")
# Options that take a value: a negative number after one of them is that option's value (--near -0.5),
# not a negative budget.
_VALUE_OPTIONS = {"--device", "--near", "--model", "--optimizer", "--batch", "--input", "--loss", "--target", "-r",
                  "--result"}
# Options a user may expect that mean something else here, said instead of the closest spelling.
# "--estimate" (a user trial) read "did you mean --strict?": the estimate is asked for with --model.
OPTION_MEANINGS = dict.fromkeys(
    ("--estimate", "--predict", "--fit", "--fits"),
    "an estimate is asked for with --model NAME --batch N, e.g. %memory_budget --model model --batch 64")
# The words a user types to remove the budget or see it, for the magic's own "off" and "status".
SAME_AS = {**dict.fromkeys(("none", "clear", "reset", "remove", "stop", "disable", "unset"), "off"),
           **dict.fromkeys(("stats", "show", "info", "list"), "status")}
OPTION_MEANINGS.update({f"--{word}": "the budget is removed without an option: %memory_budget off"
                        for word, same in SAME_AS.items() if same == "off"} | {"--off": "no dashes: %memory_budget off"})
OPTION_MEANINGS.update({f"--{word}": "the status is shown by %memory_budget alone, or %memory_budget status"
                        for word in ("status", "stats", "show", "info")})
# The short flags a user guesses (a trial's -s was "unrecognized arguments"): this magic's long ones.
OPTION_MEANINGS.update({"-s": "the strict budget is --strict", "-e": "the enforced budget is --enforce",
                        "-n": "the gauge's threshold is --near (a share of the budget, e.g. --near 0.9)"})
# "--budget 2GiB" (a user trial) read "did you mean --quiet?": the budget is the magic's first word.
OPTION_MEANINGS.update(dict.fromkeys(
    ("--budget", "--size", "--limit", "--max", "--memory", "--set"),
    "the budget is written without an option: %memory_budget 2GiB"))
# An estimate whose dry runs have taken this long says what it is doing and how to stop it (a trial: a
# CNN's took 98.6 s without a word); %%amp's long-run note starts at the same 5 s.
LONG_ESTIMATE_SECONDS = 5.0
CPU_ENFORCE_NOTE = ("--enforce: the CPU allocator has no per-process cap, so only a soft budget (checked after each "
                    "cell) is possible here; for a hard limit start the kernel in a cgroup "
                    "(systemd-run --user -p MemoryMax=6G jupyter lab, or docker --memory 6g)")


def _device_hint(token: str) -> str | None:
    """``%memory_budget 2GiB cpu``: a device written without its option (a trial: argparse's "unrecognized
    arguments: cpu" alone)."""
    if re.fullmatch(r"(cpu|cuda(:\d+)?|gpu)", token, flags=re.I):
        device = "cuda" if token.lower() == "gpu" else token.lower()
        return f"a device goes after --device: --device {device}"
    return None


def _read_near(text: str) -> float:
    """--near's value as a share of the budget: 0.9, or 90%, as the budget itself reads 0.8 and 80% (`check_near`)."""
    try:
        return check_near(text)
    except BudgetError as exc:
        raise UsageError(str(exc)) from None


def _sgd_momentum(opt) -> str:
    """"(momentum=0.9)", or "(momentum=0.9 in 1 of its 2 groups)": read from the groups that have it (the first
    group, biases at momentum=0, read "SGD(momentum=0)" beside the weights' buffers)."""
    momenta = [g["momentum"] for g in opt.param_groups]
    share = "" if all(momenta) else f" in {sum(map(bool, momenta))} of its {len(momenta)} groups"
    return f"(momentum={next(m for m in momenta if m)}{share})"


@magics_class
class BudgetMagics(Magics):
    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.watcher: Watcher | None = None
        self.strict = False
        self.enforce = False
        self._saved_exc = None  # (custom_exceptions, CustomTB) from before our handler
        self._estimate = None  # the last MemoryEstimate: gives the OOM advice a measured bytes-per-sample

    # --- the magic ------------------------------------------------------------------------------------

    @magic_arguments()
    @help_option
    @argument("budget", nargs="?", default=None,
              help="6GiB, 6GB, 512MiB, 6G (= 6GiB, as docker and systemd read it), or a share of the device such as "
                   "0.8 or 80%% (the CPU: of physical memory); "
                   "'off' removes the budget and every hook; nothing (or 'status'): show the status; 'release': "
                   "drop the last error, whose traceback keeps its functions' tensors alive")
    @argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: cuda when present)")
    @argument("--enforce", action="store_true",
              help="CUDA: cap the allocator at the budget (set_per_process_memory_fraction), so a cell that "
                   "would exceed it fails fast; the CPU has no such cap (only a soft budget)")
    @argument("--strict", action="store_true",
              help="a cell that pushes usage over the budget is marked as failed (not one that only holds memory "
                   "from before it: 'already over')")
    @argument("--near", default=None,
              help=f"show a gauge after cells that used at least this share of the budget: 0.9 or 90%% "
                   f"(default {NEAR})")
    @argument("--model", default=None, metavar="NAME",
              help="predict the training memory of this nn.Module (BUDGET is then the per-GPU memory to compare "
                   "with, e.g. 80GiB, and does not start watching)")
    @argument("--optimizer", default=None,
              help="for --model (default adamw): adamw, adam, sgd (momentum=0: no state), sgd-momentum, adagrad, "
                   "rmsprop, sparseadam, none; or an optimizer variable (state for its own parameters), or several "
                   "(opt_sp,opt: SparseAdam for the embeddings, Adam for the rest)")
    @argument("--batch", type=int, default=None, help="for --model: the global batch size (default: the rows of --input)")
    @argument("--input", default=None, metavar="NAME",
              help="for --model: an example batch (tensor or tuple, first dim = batch; a dict of tensors is passed "
                   "as model(**batch); an nn.EmbeddingBag's flat "
                   "(indices, offsets) is cut by bags); needed unless the first layer is nn.Linear")
    @argument("--loss", default=None, metavar="NAME",
              help="for --model: the loss function in the namespace, called as NAME(output) or NAME(output, batch) "
                   "(batch: the --input rows of the dry run); default the output's sum, or a cross-entropy over "
                   "its last dimension when that has 1024 entries or more (a classifier or vocabulary head)")
    @argument("--target", default=None, metavar="NAME",
              help="for --loss: the targets (e.g. labels; first dim = batch), passed as NAME(output, targets) "
                   "cut to the dry run's rows: the model gets --input alone")
    @argument("-r", "--result", default=None, metavar="NAME", help="store the result (status or estimate) here")
    @argument("-q", "--quiet", action="store_true", help="do not display the status or estimate")
    @line_magic
    @magic_spelled  # errors name options as typed: --top, not top=
    @comment_hinted  # '--top 5#rows' refused: says a comment needs a space before '#'
    def memory_budget(self, line):
        """Watch each cell's peak memory against a budget; explain out-of-memory errors; predict fits.

            %memory_budget 6GiB            # from now on, every cell is measured against 6 GiB
            %memory_budget 0.8 --strict    # 80% of the device; going over fails the cell
            %memory_budget 20GiB --enforce # CUDA: the allocator is capped at 20 GiB
            %memory_budget                 # status (also: %memory_budget status): budget,
                                           # last cells' peaks, what holds memory now
            %memory_budget off             # remove the budget, its hooks, handler and cap
            %memory_budget release         # drop the last error and the tensors its traceback kept alive
            %memory_budget 80GiB --model model --optimizer adamw --batch 32 --input x

        After a cell: nothing when it stayed under --near (75%) of the budget, a gauge when above,
        a warning when over (an error with --strict). CUDA compares the allocator's peak reserved
        bytes, the CPU the process's peak RSS. An out-of-memory error in any cell is explained:
        the request, the limit, what was allocated, the largest tensors/modules/optimizers in the
        namespace, and what to try, with the expected saving. The result (-r) has ``.history``.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        # "6 GB" and "80 %" are what people type (and "12 parsecs" deserves the size error, not argparse's): a
        # number and the word or % after it are one size; argparse would see two positional arguments. Quoted,
        # not joined: an error then echoes "12 parsecs" as typed, not "12parsecs" (the parser takes the space).
        line = re.sub(r"^(\s*)(-?[0-9]*\.?[0-9]+\s+(?:[a-z]+\b|%))", r'\1"\2"', line, flags=re.I)
        line = re.sub(r"(--near(?:\s+|=)-?[0-9]*\.?[0-9]+)\s+%", r"\1%", line)  # "--near 90 %" too
        # argparse takes "-5GB" for an unknown option: name the real mistake first. Only a token in the
        # budget's place, though: "--near -0.5" is a bad --near, said below.
        try:
            tokens = split_line(line)  # as parse_line reads them: "-5GB" quoted is still -5GB
        except ValueError:
            tokens = []  # an unmatched quote: parse_line below says so
        for previous, token in zip([None] + tokens, tokens):
            if previous == "--near" and _NEGATIVE.match(token):
                _read_near(token)  # the range error: argparse would take "-50%" for an unknown option
            if _NEGATIVE.match(token) and previous not in _VALUE_OPTIONS:
                raise UsageError(f"a budget must be positive, got {token}; write e.g. 6GiB, 512MiB or 0.8")
        _check_names(tokens)
        args = parse_line(self.memory_budget, line, meanings=OPTION_MEANINGS, hint=_device_hint)
        if args is None:  # -h/--help: the help was printed
            return None
        check_name(args.result)
        if args.near is not None:
            args.near = _read_near(args.near)
        for_watching = [flag for flag, given in (("--strict", args.strict), ("--enforce", args.enforce),
                                                 ("--near", args.near is not None)) if given]
        if args.model is not None:
            if for_watching:  # a prediction watches nothing: these would be dropped unsaid
                raise UsageError(f"{_go(for_watching)} with a watched budget, not with --model (a prediction "
                                 f"watches no cell): run "
                                 f"%memory_budget 6GiB {' '.join(for_watching)} ... to watch, and the --model line "
                                 "without them to predict")
            return self._estimate_cmd(args)
        near = NEAR if args.near is None else args.near
        for_model = [name for name, value in (("--optimizer", args.optimizer), ("--batch", args.batch),
                                              ("--input", args.input), ("--loss", args.loss),
                                              ("--target", args.target))
                    if value is not None]
        if for_model:  # silently watching a budget instead of the prediction asked for would mislead
            raise UsageError(f"{_go(for_model)} with --model: "
                             "%memory_budget 80GiB --model model --batch 32 predicts that model's memory")
        words = {"off": "removes the budget and every hook", "status": "shows the budget and the cells watched",
                 "release": "drops the last error and what its traceback kept alive"}
        if args.budget is not None and args.budget.isalpha() and args.budget.lower() not in words:
            # none, clear, reset (a user trial) and stats mean a word they do not resemble
            meant = ([SAME_AS[args.budget.lower()]] if args.budget.lower() in SAME_AS else
                     difflib.get_close_matches(args.budget.lower(), list(words), n=1, cutoff=0.6))  # offf, of, statsu
            if meant:
                raise UsageError(f"cannot read {args.budget!r} as a budget; did you mean %memory_budget {meant[0]} "
                                 f"({words[meant[0]]})?")
        if args.budget is not None and args.budget.lower() == "status":
            args.budget = None  # the docs and the help call the bare line "the status": both spellings work
        watch_line = "%memory_budget 6GiB " + " ".join(f"--near {args.near:g}" if flag == "--near" else flag
                                                       for flag in for_watching)
        if args.budget is not None and args.budget.lower() == "release":
            extra = for_watching + (["-r"] if args.result else [])
            if extra:  # -q alone is taken: it only hides the line
                raise UsageError(f"release takes no {' or '.join(extra)} (it drops the last error, and stores and "
                                 "watches nothing): %memory_budget release")
            return self._release(args.quiet)
        if args.budget is not None and args.budget.lower() == "off":
            if for_watching:  # a trial's "off --strict" was taken silently, the flag dropped
                raise UsageError(f"{_go(for_watching)} with a budget to watch, not with off, which removes the "
                                 f"budget: {watch_line} watches one")
            had_budget = self.watcher is not None
            recorded = len(self.watcher.records) if had_budget else 0
            self.stop()
            note = (f"removed; {plural(recorded, 'cell')} had been watched" if had_budget
                    else "no budget was set: nothing to remove")
            result = status(None, torch.device("cpu"), note=note)
            return self._show(args, result)
        if args.budget is None:
            if for_watching:  # named as typed: a trial's "status --strict" was told of --enforce too
                raise UsageError(f"{_go(for_watching)} with a budget: {watch_line}")
            device = self.watcher.device if self.watcher and args.device == "auto" else self._device(args.device)
            return self._show(args, self._status(device))
        return self._start(args, near)

    def _device(self, spec):
        try:
            return resolve_device(spec)
        except DeviceError as exc:
            raise UsageError(str(exc)) from None

    def _status(self, device, note=""):
        gc.collect()  # an earlier error's traceback, garbage in a cycle, is no holder (see _post)
        return status(self.watcher, device, self.shell.user_ns, skip=history_name(self.shell), enforce=self.enforce,
                      strict=self.strict, note=note, error_tb=kept_tracebacks(self.shell))

    def _kept_by(self, error: BaseException | None):
        """The `Holder` row of what ``error``'s traceback alone keeps alive: storages a name in the namespace also
        holds are not kept by it (``release`` would free none of them), so they are counted as the status counts."""
        tb = getattr(error, "__traceback__", None)
        if tb is None:
            return None
        rows = namespace_holders(self.shell.user_ns, top=None, skip=history_name(self.shell), error_tb=tb)
        return next((row for row in rows if row.name == ERROR_FRAMES), None)

    def _release(self, quiet: bool) -> None:
        """``%memory_budget release``: drop every reference to the last error's traceback, so the frames it keeps
        (and the tensors in their variables) can be freed. %tb and %debug have nothing to show afterwards."""
        device = self.watcher.device if self.watcher else self._device("auto")
        before = usage_now(device)[0]
        words = drop_last_error(self.shell)
        gc.collect()
        malloc_trim()
        after = usage_now(device)[0]
        if quiet:
            return
        if words is None:
            print("nbaccel: no error to release (none since the kernel started, or released already)")
            return
        measured = "reserved" if device.type == "cuda" else "process RSS"
        print(prose(f"nbaccel: released the last error ({words}) and its traceback: {measured} "
                    f"{format_bytes(before)} -> {format_bytes(after)}; %tb and %debug have nothing to show now"))

    def _show(self, args, result):
        store_result(self.shell, args.result, result)
        if not args.quiet:
            display_result(result)
        elif result.note.startswith("--enforce"):
            print(result.note)

    def _start(self, args, near):
        device = self._device(args.device)
        try:
            budget = parse_budget(args.budget, device)
        except BudgetError as exc:
            raise UsageError(str(exc)) from None
        # Everything is validated: from here on the previous budget is replaced. The watcher comes
        # first: stop() releases every cap, so a cap applied before it would be undone at once
        # (a first `--enforce` once left the GPU uncapped that way).
        note, replaced = "", ""
        if self.watcher is not None and self.watcher.device == device:
            replaced = self._replaced(budget, args.strict, bool(args.enforce and device.type == "cuda"))
            self.watcher.budget, self.watcher.near = budget, near  # keep the history
        else:
            self.stop()
            self.watcher = Watcher(budget, device, near)
        if not args.enforce:
            release_cap()
        elif device.type == "cuda":
            fraction = apply_cap(device, budget)
            note = f"allocator capped at {fraction:.1%} of the GPU"
        else:
            note = CPU_ENFORCE_NOTE  # first: with -q, a note that starts with it is still printed
        self.strict, self.enforce = args.strict, bool(args.enforce and device.type == "cuda")
        self._install()
        notes = [note, size_reading(args.budget), replaced]  # 6G: say which G was meant
        used = usage_now(device)[0]
        if used > budget:
            notes.append(
                f"already over: {format_bytes(used)} in use now, more than the {format_bytes(budget)} budget, "
                "so every cell that adds memory will be reported over until memory is freed or the budget raised "
                "(a cell that adds none is recorded 'already over', and not failed)")
        self._show(args, self._status(device, "; ".join(filter(None, notes))))

    def _replaced(self, budget: int, strict: bool, enforce: bool) -> str:
        """What a new budget over a watched one changed: a mode the new line left out is dropped, and the
        rows kept in the history were held to the old budget (their "of budget" says so)."""
        old_mode, new_mode = _mode(self.strict, self.enforce), _mode(strict, enforce)
        if budget == self.watcher.budget and old_mode == new_mode:
            return ""
        rows = len(self.watcher.records)
        kept = ("" if not rows else "; the cell watched so far keeps the budget it was held to" if rows == 1 else
                f"; the {rows} cells watched so far keep the budget they were held to")
        return (f"replaces the budget of {format_bytes(self.watcher.budget)} ({old_mode}); this one is {new_mode}"
                + kept)

    # --- prediction -------------------------------------------------------------------------------------

    def _lookup(self, name, what):
        if not name.isidentifier() or name not in self.shell.user_ns:
            raise UsageError(f"{what} {name!r} names nothing in the namespace; define it first, or pass the "
                             "variable's name")
        return self.shell.user_ns[name]

    def _estimate_cmd(self, args):
        __tracebackhide__ = True  # noqa: F841 - an interrupt in the dry runs shows the magic's line alone
        from ..estimate import OPTIMIZERS, closest_optimizer, estimate_memory

        model = self._lookup(args.model, "--model")
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"--model {args.model} is {a_type(model)}, not a torch.nn.Module; pass the "
                             "variable holding the model")
        if args.batch is not None and args.batch < 1:
            raise UsageError(f"--batch is the global batch size, at least 1; got {args.batch}")
        optimizer = self._optimizer_arg(args.optimizer or "adamw", OPTIMIZERS, closest_optimizer)
        example = self._lookup(args.input, "--input") if args.input else None
        batch, batch_read = self._batch_arg(args, model, example)
        loss_fn = self._lookup(args.loss, "--loss") if args.loss else None
        if loss_fn is not None and not callable(loss_fn):
            second = "targets" if args.target else "batch"
            raise UsageError(f"--loss {args.loss} is {a_type(loss_fn)}, not a function: define "
                             f"def loss(output, {second}): return F.cross_entropy(...), or make loss = "
                             "nn.CrossEntropyLoss(), and pass --loss loss")
        targets = self._lookup(args.target, "--target") if args.target else None
        device = self._device(args.device)
        # A per-GPU memory to compare with (it may be larger than anything in this machine): estimate_memory
        # reads it like the API does; without one, the active budget.
        budget = args.budget
        if budget is None and self.watcher is not None:
            budget = f"{self.watcher.budget}B"
        note, started = ProgressNote(self.shell), time.perf_counter()

        def progress(words, seconds):
            if seconds >= LONG_ESTIMATE_SECONDS and not args.quiet:
                note.say(f"nbaccel %memory_budget: {format_seconds(seconds)} so far; now {words}. The dry runs "
                         f"measure every op of a training step on a copy of {args.model}, so they take far longer "
                         "than the step; Ctrl-C stops them and leaves the model, its optimizer and your variables "
                         "as they were.", at=seconds)

        result = None
        try:
            result = estimate_memory(model, optimizer=optimizer, batch=batch, example=example, budget=budget,
                                     device=device, name=args.model, loss_fn=loss_fn, targets=targets,
                                     on_progress=progress)
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt as exc:  # most likely in the dry runs' op-by-op measuring: nbaccel's frames
            raise interrupted_in_nbaccel(exc, "%memory_budget", "during the estimate's dry runs",
                                         f"nothing was estimated; {args.model}, its optimizer and your variables are "
                                         "as they were (the dry runs use a copy)") from None
        finally:
            if self.watcher is not None:
                # The estimate's dry runs are nbaccel's own work, not the user's cell: don't hold
                # them against the budget (an interrupted or refused one neither).
                self.watcher.abandon()
            elapsed = format_seconds(time.perf_counter() - started)
            note.finish(f"nbaccel %memory_budget: the dry runs took {elapsed} in all." if result is not None else
                        f"nbaccel %memory_budget: the dry runs stopped after {elapsed} (the note below says why).")
        if args.budget is None and self.watcher is not None:
            result = replace(result, budget_source="the budget being watched")
        mine = (self._own_optimizer(model, optimizer, args.model) if isinstance(optimizer, str)
                else self._other_optimizers(model, optimizer, args))
        result = replace(result, assumptions=tuple(filter(None, [batch_read])) + result.assumptions + tuple(mine))
        result = replace(result, note=self._prediction_note(args, device, result))
        self._estimate = result
        store_result(self.shell, args.result, result)
        if not args.quiet:
            display_result(result)

    def _optimizer_arg(self, text, names, closest):
        """A name (adamw, sgd, ...), an optimizer variable, or several variables "opt_sp,opt" (one optimizer per
        part of the model: SparseAdam for the embeddings, Adam for the rest)."""
        if text.lower() in names:
            return text
        parts = [part.strip() for part in text.split(",")]
        twice = sorted({part for part in parts if parts.count(part) > 1})
        if twice:  # a trial's opt_b,opt_b read "parameter 1 of em is in two of the optimizers passed (Adam and Adam)"
            raise UsageError(f"--optimizer {text}: {', '.join(twice)} is named twice; name each optimizer of the step "
                             "once")
        same = [(a, b) for i, a in enumerate(parts) for b in parts[i + 1:]
                if a in self.shell.user_ns and self.shell.user_ns.get(b) is self.shell.user_ns[a]]
        if same:  # an alias (opt = adam)
            raise UsageError(f"--optimizer {text}: {same[0][0]} and {same[0][1]} are the same optimizer; name it once")
        found = []
        for part in parts:
            if part not in self.shell.user_ns:  # most likely a misspelt name: list the names
                raise UsageError(f"--optimizer {part!r} is neither one of {', '.join(names)}{closest(part)} nor a "
                                 "variable in the namespace")
            value = self._lookup(part, "--optimizer")
            if not isinstance(value, torch.optim.Optimizer):
                raise UsageError(f"--optimizer takes one of {', '.join(names)}, an optimizer variable or several "
                                 f"(opt_sp,opt), got {part!r}: {a_type(value)}")
            found.append(value)
        return found[0] if len(found) == 1 else found

    def _namespace_optimizers(self):
        """(name, optimizer) of the namespace's optimizers, each object once: an alias (opt = adam) is the same
        optimizer (a review: summed with itself, and named beside itself in a command then refused)."""
        seen = set()
        for var, value in self.shell.user_ns.items():
            if not var.startswith("_") and isinstance(value, torch.optim.Optimizer) and id(value) not in seen:
                seen.add(id(value))
                yield var, value

    def _own_optimizer(self, model, named: str, name: str) -> list[str]:
        """The user's own optimizers over this model whose state differs from the name passed: a trial's
        `--optimizer sgd` read 0 B while `opt`, SGD(momentum=0.9) over the model, kept 88.5 KiB."""
        from ..model_states import _optimizer_spec, optimizer_plan, optimizer_state_bytes

        params = list(model.parameters())
        ids = {id(p) for p in params}
        guessed = sum(optimizer_state_bytes(params, named))
        mine = []  # (variable, kind, what it is, its state's bytes, params held) of each optimizer
        for var, value in self._namespace_optimizers():
            if not any(id(p) in ids for g in value.param_groups for p in g["params"]):
                continue
            try:
                kind = _optimizer_spec(value)[0]
                held = optimizer_plan(value, params)[0][1]
            except ValueError:
                continue
            hyper = _sgd_momentum(value) if kind == "sgd-momentum" else ""
            mine.append((var, kind, f"{type(value).__name__}{hyper} over {len(held)} of {name}'s {len(params)} "
                                    "parameter tensors",
                         sum(optimizer_state_bytes([params[i] for i in held], value)), set(held)))
        helds = [h for *_, h in mine]
        apart = sum(map(len, helds)) == len(set().union(*helds)) if helds else True
        mine = [m[:4] for m in mine]
        # one optimizer per part of the model (a trial got one note each): one note naming them together; two
        # over the same parameters (tried one after the other) are alternatives, each its own note (a review)
        if len(mine) > 1 and apart:
            total = sum(b for *_, b in mine)
            if total == guessed:
                return []
            return [f"your {' and '.join(f'{var} ({what})' for var, _, what, _ in mine)} keep "
                    f"{format_bytes(total)} of state together; this estimate assumes {named} ({format_bytes(guessed)}): "
                    f"pass --optimizer {','.join(var for var, *_ in mine)} to estimate yours"]
        return [f"your {var} is {what}, with {format_bytes(theirs)} of state; this estimate assumes {named} "
                f"({format_bytes(guessed)}): pass --optimizer {var} to estimate yours"
                for var, kind, what, theirs in mine if kind != named.lower() and theirs != guessed]

    def _other_optimizers(self, model, passed, args) -> list[str]:
        """The namespace's optimizers over the parameters the ones passed leave out (the dense half of a
        SparseAdam + Adam setup), by name: the command that counts their state too."""
        passed = passed if isinstance(passed, list) else [passed]
        params = list(model.parameters())
        covered = {id(p) for o in passed for g in o.param_groups for p in g["params"]}
        left = {id(p) for p in params if p.requires_grad and id(p) not in covered}
        others = [var for var, value in self._namespace_optimizers()
                  if all(value is not o for o in passed)
                  and any(id(p) in left for g in value.param_groups for p in g["params"])]
        if not left or not others:
            return []
        return [f"your {', '.join(others)} update{'s' if len(others) == 1 else ''} parameters of {args.model} that "
                f"--optimizer {args.optimizer} leaves out: --optimizer {','.join([args.optimizer] + others)} counts "
                "their state too"]

    @staticmethod
    def _batch_arg(args, model, example) -> tuple[int, str | None]:
        """--batch, or the rows of --input where it is left out (a trial's user passed the batch itself and was
        told to count it); the second value says it was read so, None when typed."""
        from ..probe_inputs import example_rows

        if args.batch is not None:
            return args.batch, None
        rows = None if example is None or not isinstance(model, torch.nn.Module) else example_rows(model, example)
        if not rows:
            raise UsageError("--model needs --batch N (the global batch size, at least 1)"
                             + (f": --input {args.input}'s tensors share no first dimension to read it from"
                                if example is not None else ""))
        return rows, (f"batch {rows}: the rows of --input {args.input} (no --batch given; --batch N predicts "
                      "another batch size)")

    def _prediction_note(self, args, device, estimate) -> str:
        """What a prediction leaves as it was: "budget 1 GiB" in its summary read as a budget now being
        watched, and a user expected the next cells to be measured."""
        watched = None if self.watcher is None else (
            f"the budget being watched ({format_bytes(self.watcher.budget)} on {self.watcher.device})")
        if args.budget is None and watched:
            note = f"a prediction, compared with {watched}, which stays as it was"
        else:
            compared = format_bytes(estimate.budget_bytes) + ("" if args.budget else f" ({estimate.budget_source})")
            note = f"a prediction, compared with {compared}: " + (
                f"{watched} stays as it was" if watched else
                f"no budget is being watched, so later cells are not measured; {self._watch_command(args, device)} "
                "starts watching")
        after = estimate.process_rss_after_bytes
        over = (f"the process's RSS is {format_bytes(after)} after the dry runs, over the watched "
                f"{format_bytes(self.watcher.budget)}: the next cells read 'already over' until memory is freed or "
                "the budget raised" if watched and after and self.watcher.device.type == "cpu"
                and after > self.watcher.budget else "")  # a trial's later cells read "already over" unexplained
        return "; ".join(filter(None, [note, over, size_reading(args.budget)]))

    @staticmethod
    def _watch_command(args, device) -> str:
        """The line that watches the size just compared with, where it is a budget this device can have
        (80GiB per GPU is none for a 16 GiB host: then a share)."""
        size = args.budget
        if size is not None:
            try:
                parse_budget(size, device)
            except BudgetError:
                size = None
        return f"%memory_budget {size or '0.8'}" + ("" if args.device == "auto" else f" --device {args.device}")

    # --- hooks ----------------------------------------------------------------------------------------------

    def _install(self):
        events = self.shell.events
        if self._pre not in events.callbacks["pre_run_cell"]:
            events.register("pre_run_cell", self._pre)
            events.register("post_run_cell", self._post)
        if self._saved_exc is None:
            self._saved_exc = (self.shell.custom_exceptions, self.shell.CustomTB)
            previous = tuple(self.shell.custom_exceptions or ())
            self.shell.set_custom_exc(tuple(dict.fromkeys(previous + OOM_TYPES)), self._on_exception)

    def stop(self):
        """Remove the hooks, the exception handler and the cap; forget the budget."""
        events = self.shell.events
        for name, callback in (("pre_run_cell", self._pre), ("post_run_cell", self._post)):
            if callback in events.callbacks[name]:
                events.unregister(name, callback)
        if self._saved_exc is not None:
            self.shell.custom_exceptions, self.shell.CustomTB = self._saved_exc
            self._saved_exc = None
        if self.watcher is not None:
            self.watcher.abandon()
        self.watcher = None
        self.strict = self.enforce = False
        if capped_devices():
            release_cap()

    def on_unload(self) -> dict | None:
        """Remove everything; return what ``%reload_ext`` re-arms (None when no budget is set)."""
        kept = None
        if self.watcher is not None:
            w = self.watcher
            kept = {"budget": w.budget, "device": w.device, "near": w.near, "records": w.records,
                    "unwritten": w.unwritten_total,
                    "strict": self.strict, "enforce": self.enforce, "estimate": self._estimate}
        self.stop()
        return kept

    def on_load(self, kept: dict | None = None) -> None:
        """After ``%reload_ext``: the budget that was active, with the same settings and history."""
        if not kept:
            return
        self.watcher = Watcher(kept["budget"], kept["device"], kept["near"])
        self.watcher.records, self.watcher.unwritten_total = kept["records"], kept["unwritten"]
        self.strict, self._estimate = kept["strict"], kept["estimate"]
        if kept["enforce"]:
            apply_cap(kept["device"], kept["budget"])
            self.enforce = True
        self._install()

    def _pre(self, info=None):
        if self.watcher is not None:
            self.watcher.begin(f"In[{self.shell.execution_count}]")

    def _post(self, result):
        if self.watcher is None:
            return
        error = getattr(result, "error_in_exec", None)
        # ipykernel has already advanced execution_count when pre_run_cell fires, IPython's terminal
        # has not; the ExecutionResult carries the number the frontend shows.
        count = getattr(result, "execution_count", None)
        failed_before = self.watcher.device_error
        record = self.watcher.end(error=error, label=f"In[{count}]" if count is not None else None)
        if error is not None:
            # The error before this one is garbage now, but in a reference cycle (its traceback's frames hold
            # it), which only a full collection frees: a trial's 300 MiB outlived a later KeyError's, unlisted.
            gc.collect()
        if self.watcher.device_error is not failed_before and error is None:
            self._show_late_device_error(result, record)
            return
        if record is not None and self._refused(result, record):
            self.watcher.drop(record)
            return
        # The status says whether the cell is to blame (`budget.verdict`): a cell that starts near or over and
        # adds nothing (`del x`) is "already near"/"already over", shown nothing and never failed, and the
        # history row says the same as what was (not) shown. An error cell's status is error/oom.
        if record is not None and record.status in ("error", "oom"):  # an oom's explanation gave its figures
            note = failed_cell_words(record, self.watcher.near, self._kept_by(error), peak=record.status == "error")
            if note:
                print(prose("nbaccel: " + note))
            return
        if record is not None and record.status != "over" and record.unwritten_would_exceed:
            print(prose("nbaccel: " + unwritten_words(record)))  # not over yet: said, never failed (the writing cell is, under --strict)
        if record is None or record.status not in ("near", "over"):
            return
        failing = record.status == "over" and self.strict and result.error_before_exec is None and not record.harness
        report = CellReport(record, str(self.watcher.device), strict=failing)
        display_result(report)
        if failing:
            exc = BudgetExceeded(f"{record.label} peaked at {format_bytes(record.used_bytes)}, over the strict budget "
                                 f"of {format_bytes(record.budget_bytes)} ({share_text(record.fraction)})")
            # Marking the result failed is what stops "Run All" in Jupyter (the kernel replies "error").
            result.error_in_exec = exc
            # Just "BudgetExceeded: ...": showtraceback(exception_only=True) would prefix IPython's
            # "An exception has occurred, use %tb to see the full traceback", and there is none to see.
            stb = self.shell.InteractiveTB.get_exception_only(BudgetExceeded, exc)
            self.shell._showtraceback(BudgetExceeded, exc, stb)  # the hook ipykernel sends as an error output

    def _show_late_device_error(self, result, record) -> None:
        """The synchronize after a cell that ran without an error raised a CUDA error: one of its kernels
        failed. Without nbaccel it would surface in whichever later cell waits for the GPU first, and be
        blamed on that one; here it is this cell's error output, and the cell is marked failed."""
        exc = self.watcher.device_error
        result.error_in_exec = exc  # stops "Run All": every later CUDA call fails the same way
        label = record.label if record is not None else "this cell"
        note = (f"nbaccel: the GPU reported this error as {label} ended (CUDA reports a kernel's failure when the "
                "host next waits for the GPU, so a kernel of this cell, or of an earlier one that never waited, "
                "failed). The CUDA context cannot be used again in this process: restart the kernel. The budget "
                "goes on measuring memory, without waiting for the GPU.")
        stb = [note] + self.shell.InteractiveTB.get_exception_only(type(exc), exc)
        self.shell._showtraceback(type(exc), exc, stb)

    def _refused(self, result, record) -> bool:
        """Whether the cell never ran (a syntax error) or was a magic refusing its line: no row for it
        (mistyped ``%memory_budget 0`` lines crowded the real cells out of the status's last 10).

        IPython's convention is that a magic raises UsageError for input it refuses, before it does anything.
        That says nothing of a cell's other lines (``x = big()`` above the magic ran), so only a cell that is
        one magic call qualifies. And not every UsageError comes first: nbaccel's own %%profile_gpu raises one
        after its runs when Kineto wrote an invalid trace, so a cell that added memory keeps its row.
        """
        if getattr(result, "error_before_exec", None) is not None:
            return True  # it never ran (a SyntaxError): a row "ok, added 0 B" said it did (a user trial)
        error = getattr(result, "error_in_exec", None)
        raw = getattr(getattr(result, "info", None), "raw_cell", None) or ""
        if not isinstance(error, UsageError) and "memory_budget" not in raw:
            return False  # most cells: not parsed at all (the watcher's cost is per cell)
        magic = _one_magic_call(self.shell, result)
        if magic == "memory_budget":
            # A status (or a new budget) is a question about the other cells, not one of them: its rows
            # crowded the last 10 (a trial). What it allocates is nbaccel's (the first status imports its
            # renderers: 1 MiB and more), never the user's code.
            return True
        return isinstance(error, UsageError) and record.added_bytes < PUSHED and magic is not None

    def _on_exception(self, shell, etype, value, tb, tb_offset=None):
        if not is_oom(value):
            previous_types, previous_handler = self._saved_exc or ((), None)
            if previous_types and isinstance(value, previous_types):
                return previous_handler(etype, value, tb, tb_offset=tb_offset)
            # Exactly what IPython does for an exception without a custom handler.
            shell.showtraceback(running_compiled_code=True)
            return None
        estimate = self._estimate
        per_sample = batch = precision = None
        if estimate is not None:
            # The first (fp32) fit's steeper phase (forward or backward peak): how fast the step grows with
            # the batch. Which precision the failed cell ran in is not known here; the advice names it.
            precision, fit = next(iter(estimate.fits.items()))
            per_sample, batch = int(max(fit.slopes_at(estimate.batch))) or None, estimate.batch
        explanation = explain_oom(value, self.shell.user_ns, budget=self.watcher.budget if self.watcher else None,
                                  tb=tb, skip=history_name(self.shell), per_sample_bytes=per_sample, batch=batch,
                                  per_sample_precision=precision or "fp32")
        display_result(explanation)
        # And the error itself, in one line, as the cell's error output: nbconvert, nbclient's
        # CellExecutionError and papermill read that, and showed an empty traceback without it (a user
        # trial). The full traceback is one `%tb` away: IPython's custom-handler path does not record
        # the exception where %tb (and %debug) look for it, so it is recorded here.
        sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = value
        stb = shell.InteractiveTB.get_exception_only(etype, value)
        shell._showtraceback(etype, value, stb)
        return None


def kept_tracebacks(shell) -> list:
    """The tracebacks IPython keeps: the last error's (sys.last_traceback: %tb, %debug) and the one its
    formatter printed last (``InteractiveTB.tb``), which an error it prints no traceback for (a magic's
    UsageError) does not replace (a trial's 300 MiB outlived a typo's error, unlisted)."""
    found = [getattr(sys, "last_traceback", None), getattr(shell.InteractiveTB, "tb", None)]
    return [tb for i, tb in enumerate(found) if tb is not None and all(tb is not other for other in found[:i])]


def drop_last_error(shell) -> str | None:
    """Drop what keeps the last error's traceback alive: sys.last_* (%tb, %debug), IPython's formatter's copy,
    and each exception's own ``__traceback__`` in its chain (the last cell's result keeps the exception).
    Returns "ValueError: ..." for the error dropped, None where there was none."""
    error = getattr(sys, "last_value", None)
    found = error is not None or getattr(sys, "last_traceback", None) is not None
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    words = _error_words(sys.last_value) if getattr(sys, "last_value", None) is not None else "its traceback"
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    if getattr(shell.InteractiveTB, "tb", None) is not None:  # AutoFormattedTB keeps the traceback it printed
        found = True
        shell.InteractiveTB.tb = None
    return words if found else None


def _error_words(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__  # not "KeyboardInterrupt: "
    return text if len(text) <= 80 else text[:77] + "..."


def failed_cell_words(record, near: float, held, peak: bool = True) -> str:
    """What a budget says of a cell that raised: a failed cell's status is "error", which shows nothing, and
    its peak may have gone over the budget before it failed (a trial: 684 MiB of 600 MiB, then every later
    cell "already over", silent); and its traceback keeps the tensors its functions made (IPython keeps the
    last error for %tb and %debug), which no ``del`` reaches: after an out-of-memory error (``peak`` False: its
    explanation gave the figures) those are the failed step's activations, and a retry fails again beside them.
    ``held``: the `Holder` row of what the traceback alone keeps (`BudgetMagics._kept_by`), or None."""
    would = verdict(record.before_bytes, record.added_bytes, record.budget_bytes, near) if peak else "ok"
    reached = (f", and its peak {'went over' if would == 'over' else 'came near'} the memory budget before it did: "
               f"{format_bytes(record.used_bytes)} of {format_bytes(record.budget_bytes)} "
               f"({share_text(record.fraction)}); it added {format_bytes(record.added_bytes)}"
               if would in ("over", "near") else "")
    kept = (f". Its traceback keeps {format_bytes(held.nbytes)} of tensors alive in its functions' variables "
            f"({held.detail}): IPython keeps the last error for %tb and %debug until the next one, and no del reaches "
            "them; %memory_budget release drops it" if held is not None and held.nbytes >= FRAMES_WORTH_SAYING else "")
    return f"{record.label} failed{reached}{kept}" if reached or kept else ""


# Tensors kept by a failed cell's frames below this are not worth a note.
FRAMES_WORTH_SAYING = 16 * 2**20


def _check_names(tokens: list[str]) -> None:
    """--input, --model, --loss and --target take a variable's name: ``--input (x, off)`` (a trial) read argparse's
    "unrecognized arguments: off)"."""
    for i, (previous, token) in enumerate(zip([None] + tokens, tokens)):
        if previous in ("--input", "--model", "--loss", "--target") and not token.isidentifier() and not token.startswith("-"):
            rest = tokens[i:]
            end = next((j for j, t in enumerate(rest) if t.endswith((")", "]"))), 0)
            typed = " ".join(rest[:end + 1])
            fix = (f"make a variable first (inp = {typed}), then {previous} inp" if previous == "--input" else
                   f"assign it to a variable first, then {previous} NAME")
            raise UsageError(f"{previous} takes a variable's name, got {typed!r}: {fix}")


def _go(options: list[str]) -> str:
    """["--strict"] -> "--strict goes"; ["--enforce", "--near"] -> "--enforce and --near go"."""
    return f"{' and '.join(options)} {'go' if len(options) > 1 else 'goes'}"


def _mode(strict: bool, enforce: bool) -> str:
    return "enforced" if enforce else "strict" if strict else "soft"


def _one_magic_call(shell, result) -> str | None:
    """The magic's name when the cell was a single magic call and nothing else: ``%memory_budget abc``,
    ``s = %memory_budget``, or a ``%%cell`` magic (its body is the magic's to run); else None."""
    raw = getattr(getattr(result, "info", None), "raw_cell", None)
    if not raw:
        return None
    try:
        body = ast.parse(shell.transform_cell(raw)).body
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], (ast.Expr, ast.Assign)):
        return None
    call = body[0].value  # get_ipython().run_line_magic('memory_budget', 'abc'), as IPython rewrote the line
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("run_line_magic", "run_cell_magic")
            and call.args and isinstance(call.args[0], ast.Constant)):
        return call.args[0].value
    return None
