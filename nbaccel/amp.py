"""``compare_amp``: the same code, fp32 against mixed precision, from the same starting state.

The order of runs is the method, so it is spelled out here:

1. Snapshot the state the code can touch (`snapshot.Snapshot`), on the host.
2. ``warmup`` rounds of (fp32, amp), output silenced: caches, cuBLAS handles, autotuning.
3. ``repeat`` timed rounds; the order inside a round alternates (fp32 first, then amp first) so a
   clock that drifts during the measurement does not favour one side.
4. One run per variant under the peak-memory meter, one per variant under the op audit (dtype per
   op, FLOPs, gradient hooks). These are separate because both meters perturb timing.
5. One last run under the recipe, with its output shown: the user's state afterwards is exactly
   that of one run of the code under the recipe.

Every run starts with ``snapshot.restore()`` and `TorchGlobals.restore()`: the same variables and
the same torch settings (grad mode, default dtype, autocast, TF32/cuDNN flags). If any run raises
(or is interrupted), both are restored -- the state from before the call -- and the exception
propagates unchanged.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from .device import DTYPE_NAMES, DeviceError, DeviceInfo, device_info, dtype_name, resolve_device
from .drift import compute_drift, has_nonfinite, runs_differ, to_host
from .flops import OpAudit, precision_summary
from .memory import PeakMemory, PeakMeter, format_bytes
from .options import in_magic, option, whole_number
from .precision import FP32, Recipe, TorchGlobals, apply_recipe, autocast_in_effect, describe, make_recipe
from .results import ResultMixin
from .snapshot import Snapshot, SnapshotTooLarge, available_host_memory, estimate_bytes
from .timing import Clock, Stats, format_seconds, speedup_is_uncertain

if TYPE_CHECKING:
    import pandas as pd


MIN_RUNS = 3  # timed runs per variant below which a speedup is marked uncertain (no spread to judge)
MEMORY_NOISE_FLOOR = 1 << 20  # fp32 peak below which a memory saving is not reported (allocator noise)


def planned_runs(warmup: int, repeat: int, baseline: bool = True) -> int:
    """How many times a comparison runs the code: per variant the warmup rounds, the timed runs, one
    memory run and one audited run; then the kept run."""
    return (2 if baseline else 1) * (warmup + repeat + 2) + 1


def _empty_frame() -> pd.DataFrame:
    import pandas as pd  # only when a result is made: `import nbaccel` stays free of pandas

    return pd.DataFrame()


@dataclass
class Variant:
    """Everything measured for one side of the comparison."""

    name: str
    recipe: Recipe
    times: Stats
    memory: PeakMemory | None = None
    ops: pd.DataFrame = field(default_factory=_empty_frame)
    flops: int = 0

    @property
    def median(self) -> float:
        return self.times.median

    @property
    def flops_per_second(self) -> float | None:
        return self.flops / self.median if self.flops and self.median > 0 else None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "recipe": self.recipe.label,
            "time": self.times.to_dict(),
            "memory": self.memory.to_dict() if self.memory else None,
            "flops": self.flops,
            "flops_per_second": self.flops_per_second,
            "ops": self.ops.to_dict(orient="records"),
        }


@dataclass
class AmpResult(ResultMixin):
    """fp32 vs mixed precision for one piece of code. Raw numbers in, everything else derived."""

    kind = "amp"

    device: DeviceInfo
    amp: Variant
    baseline: Variant | None
    warmup: int
    repeat: int
    timer_method: str
    drift: dict | None = None
    gradients: dict | None = None
    unaligned_matmuls: list = field(default_factory=list)
    snapshot_bytes: int = 0
    restored: bool = True  # False: --no-restore, runs continued from each other's state
    # Two runs under the recipe from the restored state gave different values: the code depends on
    # state the snapshot does not restore (an attribute of your own object, a file...).
    state_changed: bool = False
    nonfinite_result: bool = False  # the cell's value has inf/NaN under the recipe where fp32's is finite
    drift_skipped: str | None = None  # why there is no drift although both variants ran (nbaccel's failure)
    # Autocast already on around the call ({device type: dtype}): the recipes overrode it (see advise).
    outer_autocast: dict = field(default_factory=dict)
    value: object = field(default=None, repr=False)  # the kept run's value (not serialized)

    @property
    def speedup(self) -> float | None:
        """fp32 median time / amp median time (>1 means mixed precision is faster)."""
        if self.baseline is None or self.amp.median <= 0:
            return None
        return self.baseline.median / self.amp.median

    @property
    def speedup_uncertain(self) -> bool:
        """True when the ranking could flip on a re-run: the two IQRs overlap, or a variant has fewer
        than 3 timed runs (no spread to judge by)."""
        return self.baseline is not None and (_too_few_runs(self)
                                              or speedup_is_uncertain(self.baseline.times, self.amp.times))

    @property
    def memory_saving(self) -> float | None:
        """Fraction of the fp32 peak that the recipe saved (0.3 = 30 % less; negative = more), as
        measured, whatever the size: see `memory_comparable` before reading much into it."""
        if self.baseline is None or not self.baseline.memory or not self.amp.memory:
            return None
        base = self.baseline.memory.peak_bytes
        return (base - self.amp.memory.peak_bytes) / base if base > 0 else None

    @property
    def memory_comparable(self) -> bool:
        """Whether the fp32 peak is large enough (``MEMORY_NOISE_FLOOR``, 1 MiB) for the saving to
        mean something: below it, the CPU's RSS-based figures are allocator noise."""
        return (self.memory_saving is not None and self.baseline.memory.peak_bytes >= MEMORY_NOISE_FLOOR)

    @property
    def precision(self) -> dict:
        return precision_summary(self.amp.ops)

    @property
    def advice(self) -> list[str]:
        return advise(self)

    @property
    def noise_warnings(self) -> list[str]:
        notes = []
        for v in filter(None, (self.baseline, self.amp)):
            if v.times.noisy:
                notes.append(f"{v.name}: the IQR is {v.times.relative_spread:.0%} of the median; "
                             f"the machine is noisy, use a larger {option('repeat')}")
        if _too_few_runs(self):
            runs = min(len(self.baseline.times.times), len(self.amp.times.times))
            notes.append(f"only {runs} timed run{'s' if runs != 1 else ''} per variant: too few for a spread, the "
                         f"speedup is uncertain; use {option('repeat', 5)} or more")
        elif self.speedup_uncertain:
            notes.append("the two variants' IQRs overlap: the speedup could flip on a re-run")
        return notes

    def to_dataframe(self) -> pd.DataFrame:
        """One row per variant: time, spread, peak memory, FLOP/s."""
        import pandas as pd
        rows = []
        for v in filter(None, (self.baseline, self.amp)):
            rows.append({"variant": v.name, "recipe": v.recipe.label, "median_s": v.median, "iqr_s": v.times.iqr,
                         "runs": len(v.times.times), "peak_bytes": v.memory.peak_bytes if v.memory else None,
                         "flops": v.flops, "flops_per_s": v.flops_per_second})
        return pd.DataFrame(rows)

    def _payload(self) -> dict:
        return {
            "device": self.device.to_dict(),
            "warmup": self.warmup,
            "repeat": self.repeat,
            "timer_method": self.timer_method,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "amp": self.amp.to_dict(),
            "speedup": self.speedup,
            "speedup_uncertain": self.speedup_uncertain,
            "memory_saving": self.memory_saving,
            "drift": self.drift,
            "gradients": self.gradients,
            "precision": self.precision,
            "unaligned_matmuls": self.unaligned_matmuls,
            "snapshot_bytes": self.snapshot_bytes,
            "restored": self.restored,
            "state_changed": self.state_changed,
            "nonfinite_result": self.nonfinite_result,
            "drift_skipped": self.drift_skipped,
            "outer_autocast": self.outer_autocast,
            "advice": self.advice,
            "noise_warnings": self.noise_warnings,
        }


# --- the comparison ------------------------------------------------------------------------------

@contextlib.contextmanager
def _redirect():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


class _GradientProbe:
    """Post-accumulate hooks on every leaf tensor that requires grad: what backward produced."""

    def __init__(self, tensors):
        self.tensors = [t for t in tensors if t.is_leaf and t.requires_grad]
        self.grads: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self):
        for t in self.tensors:
            self._handles.append(t.register_post_accumulate_grad_hook(self._record))
        return self

    def _record(self, t):
        if t.grad is not None:
            self.grads[id(t)] = t.grad.detach().to("cpu", copy=True)

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _gradient_report(base: _GradientProbe | None, amp: _GradientProbe, recipe: Recipe, scaler_info: dict) -> dict | None:
    if not amp.grads:
        return None
    overflow_tensors = sum(1 for g in amp.grads.values() if not torch.isfinite(g).all())
    overflow_elements = sum(int((~torch.isfinite(g)).sum()) for g in amp.grads.values())
    underflow = nonzero = 0
    if base is not None:
        for key, g_amp in amp.grads.items():
            g_base = base.grads.get(key)
            if g_base is None or g_base.shape != g_amp.shape:
                continue
            mask = g_base != 0
            nonzero += int(mask.sum())
            underflow += int((mask & (g_amp == 0)).sum())
    return {
        "dtype": DTYPE_NAMES.get(recipe.autocast_dtype, "fp32"),
        "tensors_with_grad": len(amp.grads),
        "overflow_tensors": overflow_tensors,
        "overflow_elements": overflow_elements,
        "underflow_elements": underflow if base is not None else None,
        "underflow_fraction": underflow / nonzero if base is not None and nonzero else None,
        **scaler_info,
    }


def _scaler_scales(snapshot: Snapshot) -> list[float]:
    scales = []
    for obj, _ in snapshot.stateful:
        if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
            # get_scale() gives the initial scale for a scaler that has not stepped yet, so a step
            # skipped on the very first use is still seen as a drop.
            scales.append(float(obj.get_scale()))
    return scales


class _ScalerUse:
    """Counts ``GradScaler.scale`` calls of enabled scalers during one run.

    A scaler merely present in the namespace (say, from an earlier cell) says nothing about the
    step being measured: only a loss actually scaled in this run means the gradients were
    protected from fp16 underflow. The class attribute is patched for the run only and always put
    back, like every other global nbaccel touches.
    """

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        cls = torch.amp.GradScaler
        self._original = original = cls.__dict__["scale"]

        def scale(scaler, outputs, *args, **kwargs):
            if scaler.is_enabled():
                self.calls += 1
            return original(scaler, outputs, *args, **kwargs)

        scale.__wrapped__ = original
        cls.scale = scale
        return self

    def __exit__(self, *exc):
        torch.amp.GradScaler.scale = self._original
        return False


class _Cell:
    """The user's code, wrapped so that its own exceptions can be told from nbaccel's and placed
    in the run they came from. The exception itself passes through untouched."""

    def __init__(self, fn):
        self.fn = fn
        self.recipe: Recipe | None = None  # the recipe of the run in progress
        self.kept = False  # the run in progress is the kept one
        self.ran: set = set()  # recipes with at least one run that returned
        self.failure: tuple | None = None  # (exception, recipe, kept) of the run that raised

    def __call__(self):
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        try:
            value = self.fn()
        except BaseException as exc:  # KeyboardInterrupt too: an interrupted run is named like a failed one
            self.failure = (exc, self.recipe, self.kept)
            raise
        self.ran.add(self.recipe)
        return value

    def where(self, order) -> str:
        """Which run raised, e.g. "under bf16 autocast (it ran in fp32)"."""
        _, recipe, kept = self.failure
        where = _run_words(recipe)
        if kept:
            return where + " in the kept run (the measurement runs had succeeded)"
        others = [r for r in order if r != recipe and r in self.ran]
        if others:
            return where + f" (it ran {_run_words(others[0])})"
        if recipe in self.ran:
            return where + " (an earlier run of it had succeeded)"
        return where


def _run_words(recipe: Recipe) -> str:
    if recipe.autocast_dtype is not None:
        return f"under {DTYPE_NAMES[recipe.autocast_dtype]} autocast"
    return "under TF32" if recipe.tf32 else "in fp32"


def _safely(what: str, fn, *args):
    """(fn(*args), None), or (None, a reason) when nbaccel's own analysis fails: a value nbaccel
    cannot compare must never turn into a failure of the user's code."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - any failure here is nbaccel's, reported in the result
        return None, f"nbaccel could not {what} ({type(exc).__name__}: {exc})"


class _Runner:
    """Runs the code under one recipe from the snapshot; the small engine behind compare_amp."""

    def __init__(self, cell: _Cell, snapshot: Snapshot, torch_globals: TorchGlobals | None, clock: Clock,
                 device: torch.device, silence, on_first_run=None, runs_after_first: int = 0):
        self.cell, self.snapshot, self.torch_globals = cell, snapshot, torch_globals
        self.clock, self.device, self.silence = clock, device, silence
        self.on_first_run, self.runs_after_first = on_first_run, runs_after_first

    def start(self, recipe: Recipe, kept: bool = False) -> None:
        """Every run starts from the same variables and the same torch settings."""
        self.snapshot.restore()
        if self.torch_globals is not None:
            self.torch_globals.restore()
        self.cell.recipe, self.cell.kept = recipe, kept

    def timed(self, recipe: Recipe) -> float:
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.start(recipe)
        with self.silence(), apply_recipe(recipe):
            seconds, _ = self.clock.measure(self.cell)
        # The first run of a comparison is always a timed one (warmup or not). Reported here, after
        # the silenced block, so a note the callback prints reaches the user.
        if self.on_first_run is not None:
            report, self.on_first_run = self.on_first_run, None
            report(seconds, self.runs_after_first)
        return seconds

    def memory(self, recipe: Recipe) -> PeakMemory:
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.start(recipe)
        with self.silence(), apply_recipe(recipe), PeakMeter(self.device) as meter:
            self.cell()
        return meter.result

    def audited(self, recipe: Recipe):
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.start(recipe)
        probe = _GradientProbe(c.tensor for c in self.snapshot.tensors)
        audit = OpAudit()
        scales_before = _scaler_scales(self.snapshot)
        with self.silence(), apply_recipe(recipe), probe, audit, _ScalerUse() as scaler_use:
            value = self.cell()
        host = _safely("copy the result to the host", to_host, value)
        scales_after = _scaler_scales(self.snapshot)
        scaler_info = {
            "grad_scaler": scaler_use.calls > 0,
            # GradScaler halves its scale when it finds inf/NaN gradients and skips that optimizer step.
            "scaler_skipped_step": any(a < b for a, b in zip(scales_after, scales_before)) if scales_before else None,
        }
        return audit, probe, host, scaler_info


def compare_amp(
    fn: Callable[[], object],
    dtype: str = "auto",
    device="auto",
    tf32: bool = True,
    warmup: int = 1,
    repeat: int = 5,
    baseline: bool = True,
    namespace: dict | None = None,
    state=(),
    skip=lambda name: False,
    silence=None,
    show_output=None,
    clock: Clock | None = None,
    restore: bool = True,
    max_snapshot_fraction: float | None = 0.5,
    on_cell_error: Callable[[BaseException, str], None] | None = None,
    on_first_run: Callable[[float, int], None] | None = None,
) -> AmpResult:
    """Time ``fn`` in strict fp32 and under autocast (+TF32 on CUDA) from the same starting state.

    ``dtype``: ``bf16|fp16|auto``, or ``"tf32"`` for TF32 alone (no autocast; CUDA sm80+ only).
    fp32 is the baseline, so it is refused as the compared dtype.

    ``namespace``/``state``: what ``fn`` may change and must be restored before each run -- a
    dict of variables (the notebook's namespace) and/or objects (model, optimizer, ...). Without
    either, the *objects* ``fn`` can reach by name (its closure, and the globals named in its code
    and in the functions it calls) are snapshotted and restored in place; a global that the code
    *rebinds* (``count += 1`` inside a function) is not -- pass ``namespace=globals()`` for that.
    ``silence``: context-manager factory that hides the measurement runs' output;
    ``show_output``: the one for the kept run (default: output shown).
    ``restore=False``: no snapshot; every run continues from the state the previous one left
    (for state too large to copy -- the comparison is then between different starting states).
    ``max_snapshot_fraction``: refuse (`SnapshotTooLarge`) when the snapshot would take more than
    this share of the host's available memory, instead of swapping the machine to death.
    ``on_cell_error(exc, where)``: called when ``fn`` itself raises, before its exception
    propagates unchanged; ``where`` says which run raised ("under bf16 autocast (it ran in fp32)").
    An exception without this call came from nbaccel, not from ``fn``.
    ``on_first_run(seconds, runs_left)``: called once, after the first run, with its measured time
    and the number of runs still to come (`planned_runs` in all), so a caller can say how long the
    rest will take (``%%amp`` does, when that is long).
    Returns an `AmpResult`; the kept run's return value is ``result.value``.
    Under torchrun it measures the calling rank only; `nbaccel.distributed.compare_amp` (or
    ``gather_amp(result)``) gathers every rank's result (min/median/max, slowest rank).
    """
    __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
    if not callable(fn):
        raise TypeError(f"compare_amp runs a function several times; got a {type(fn).__name__} (the result of "
                        "calling it?): pass the function itself, e.g. compare_amp(train_step) or "
                        "compare_amp(lambda: train_step(batch))")
    whole_number("warmup", warmup, 0)
    whole_number("repeat", repeat, 1, why="; use at least 3 for a spread")
    dev = resolve_device(device)
    info = device_info(dev)
    if dtype_name(dtype) == FP32:
        raise DeviceError(f"{option('dtype', dtype)} compares fp32 with itself: fp32 is the baseline. Use "
                          f"{option('dtype', 'bf16')}, {option('dtype', 'fp16')}, {option('dtype', 'auto')}, or "
                          f"{option('dtype', 'tf32')} on an Ampere+ CUDA GPU")
    amp_recipe = make_recipe(dtype, dev, tf32=tf32)
    base_recipe = make_recipe(FP32, dev)
    outer_autocast = autocast_in_effect(dev.type)  # before any run: the user's, not ours
    torch_before = TorchGlobals()
    if namespace is None and not state:
        state = _referenced_objects(fn)
    if not restore:
        snapshot = Snapshot(namespace=None, skip=skip)
    else:
        _check_snapshot_size(namespace, state, skip, max_snapshot_fraction)
        snapshot = Snapshot.capture(namespace, objects=state, skip=skip)
    clock = clock or Clock(dev)
    cell = _Cell(fn)
    # Without restore, runs continue from each other's torch settings as from each other's variables.
    runner = _Runner(cell, snapshot, torch_before if restore else None, clock, dev, silence or _redirect,
                     on_first_run, planned_runs(warmup, repeat, baseline) - 1)
    order = [base_recipe, amp_recipe] if baseline else [amp_recipe]

    finished = False
    try:
        for _ in range(warmup):
            for recipe in order:
                runner.timed(recipe)
        times = {id(r): Stats() for r in order}
        for i in range(repeat):
            for recipe in (order if i % 2 == 0 else order[::-1]):
                times[id(recipe)].times.append(runner.timed(recipe))
        memory = {id(r): runner.memory(r) for r in order}
        audits = {id(r): runner.audited(r) for r in order}
        # The kept run: under the recipe, output shown, state left as one run leaves it.
        runner.start(amp_recipe, kept=True)
        with (show_output or contextlib.nullcontext)(), apply_recipe(amp_recipe):
            value = cell()
        result = _build_result(info, order, times, memory, audits, amp_recipe, base_recipe, baseline,
                               warmup, repeat, clock, snapshot, restore, value)
        result.outer_autocast = outer_autocast
        finished = True
    except BaseException as exc:  # KeyboardInterrupt too; re-raised unchanged
        if cell.failure is not None and cell.failure[0] is exc and on_cell_error is not None:
            on_cell_error(exc, cell.where(order))
        raise
    finally:
        if not finished:  # abandoned: the variables (unless restore=False) and torch's settings as before
            snapshot.restore()
            torch_before.restore()
    return result


def _build_result(info, order, times, memory, audits, amp_recipe, base_recipe, baseline, warmup, repeat,
                  clock, snapshot, restore, value) -> AmpResult:
    def variant(name, recipe):
        audit = audits[id(recipe)][0]
        return Variant(name, recipe, times[id(recipe)], memory[id(recipe)], audit.table(), audit.total_flops)

    amp_variant = variant(DTYPE_NAMES.get(amp_recipe.autocast_dtype, "tf32"), amp_recipe)
    base_variant = variant("fp32", base_recipe) if baseline else None
    amp_audit, amp_probe, (amp_value, amp_error), scaler_info = audits[id(amp_recipe)]
    base_probe = audits[id(base_recipe)][1] if baseline else None
    drift, why = None, amp_error
    if baseline:
        base_value, base_error = audits[id(base_recipe)][2]
        why = why or base_error
        if why is None:
            drift, why = _safely("compare the two results", compute_drift, base_value, amp_value)
    state_changed = False
    if restore and why is None:
        # Two runs under the recipe from the restored state (the audited one and the kept one) must
        # agree; if they do not, the code depends on state the snapshot does not restore.
        kept, _ = _safely("copy the result to the host", to_host, value)
        same, _ = _safely("compare the two results", compute_drift, amp_value, kept)
        state_changed = runs_differ(same, amp_recipe)
    if drift is not None:
        nonfinite = drift["amp_only_nonfinite"] > 0
    else:
        nonfinite = baseline and why is None and has_nonfinite(amp_value) and not has_nonfinite(audits[id(base_recipe)][2][0])
    return AmpResult(
        device=info,
        amp=amp_variant,
        baseline=base_variant,
        warmup=warmup,
        repeat=repeat,
        timer_method=clock.method,
        drift=drift,
        drift_skipped=why if baseline else None,
        gradients=_gradient_report(base_probe, amp_probe, amp_recipe, scaler_info),
        unaligned_matmuls=amp_audit.unaligned_matmuls(),
        snapshot_bytes=snapshot.nbytes,
        restored=restore,
        state_changed=state_changed,
        nonfinite_result=bool(nonfinite),
        value=value,
    )


def _check_snapshot_size(namespace, state, skip, fraction) -> None:
    if fraction is None:
        return
    available = available_host_memory()
    if available is None:
        return
    needed = estimate_bytes(namespace, state, skip)
    if needed > fraction * available:
        raise SnapshotTooLarge(
            f"restoring the state before each run needs a {format_bytes(needed)} host copy, more than "
            f"{format_bytes(int(fraction * available))} ({fraction:.2g} of the {format_bytes(available)} of memory "
            f"available); run without restoring ({option('no_restore', True) if in_magic() else 'restore=False'}: "
            "each run continues from the previous one's state), raise the limit "
            f"({option('max_snapshot', 0.9) if in_magic() else 'max_snapshot_fraction=0.9'}), or free memory first")


def _referenced_objects(fn) -> list:
    """Objects ``fn`` can reach by name: its closure and the globals its code (and the code of the
    functions it calls, two levels deep) refers to. Used when no namespace or state is given."""
    found, seen_code = [], set()

    def walk(func, depth):
        code = getattr(func, "__code__", None)
        if code is None or id(code) in seen_code or depth > 2:
            return
        seen_code.add(id(code))
        for cell in getattr(func, "__closure__", None) or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:
                continue
        globals_ = getattr(func, "__globals__", {})
        names = set(code.co_names)
        for const in code.co_consts:  # nested lambdas / comprehensions
            if hasattr(const, "co_names"):
                names.update(const.co_names)
        for name in names:
            if name in globals_:
                obj = globals_[name]
                if callable(obj) and hasattr(obj, "__code__"):
                    walk(obj, depth + 1)
                else:
                    found.append(obj)

    walk(fn, 0)
    for obj in list(found):
        if callable(obj) and hasattr(obj, "__code__"):
            walk(obj, 1)
    return found


def _state_reason(result: AmpResult) -> str | None:
    """Why the two variants' results may differ for reasons other than precision, if any."""
    if not result.restored:
        return "state was not restored between runs, so each run started from the state the one before left"
    if result.state_changed:
        return ("two runs under the recipe from the same restored state gave different results, so the cell "
                "depends on state nbaccel does not restore (attributes of your own objects, containers nested "
                "more than three deep, files...)")
    if result.amp.ops.empty:
        return "the cell ran no torch operators, so precision cannot have changed its result"
    return None


def _outer_autocast_note(result: AmpResult, dtype: str) -> str:
    """Why an autocast the user had on did not apply: each recipe sets its own precision."""
    on = ", ".join(f"autocast {d} ({t})" for t, d in result.outer_autocast.items())
    around = "%%amp" if in_magic() else "compare_amp"
    done = ["turned it off for the fp32 run (strict fp32)"] if result.baseline is not None else []
    done.append(f"ran the {dtype} run under {dtype} autocast" if result.amp.recipe.autocast_dtype is not None
                else f"turned it off for the {dtype.upper()} run")
    return (f"{on} was already on around {around} (a `with torch.autocast(...)`, or "
            f"`torch.autocast(...).__enter__()` in an earlier cell): nbaccel {' and '.join(done)}; "
            "it is on again for your own code.")


def _drift_differs(drift: dict | None) -> bool:
    return bool(drift) and bool(drift["max_abs"] > 0 or drift["amp_only_nonfinite"] or drift["fp32_only_nonfinite"])


def _too_few_runs(result: AmpResult) -> bool:
    return result.baseline is not None and min(len(result.baseline.times.times), len(result.amp.times.times)) < MIN_RUNS


def advise(result: AmpResult) -> list[str]:
    """One line per finding, each backed by a number in the result."""
    notes = []
    info, speedup = result.device, result.speedup
    dtype = result.amp.name
    autocast = result.amp.recipe.autocast_dtype is not None  # False for the TF32-only recipe
    label = f"{dtype} autocast" if autocast else dtype.upper()
    state_reason = _state_reason(result)
    drift = result.drift
    if result.outer_autocast:
        notes.append(_outer_autocast_note(result, dtype))
    if state_reason and _drift_differs(drift):
        # Precision is not to blame for a difference that state or plain Python made.
        verdict = ("the difference comes from state that changed between runs, not from precision"
                   if result.amp.ops.empty else "the difference may come from state that changed between runs "
                   "rather than from precision, so it is no measure of accuracy")
        notes.append(f"The fp32 and {dtype} results differ (max rel {drift['max_rel']:.1%}), but {state_reason}: "
                     f"{verdict}.")
    elif result.state_changed:
        notes.append(f"Careful: {state_reason}; the runs did not all start from the same state.")
    if result.nonfinite_result and not state_reason:
        n = drift["amp_only_nonfinite"] if drift else None
        where = f" ({n} element{'s' if n != 1 else ''})" if n else ""
        if dtype == "fp16":
            cause = (f"the forward pass overflowed (fp16's largest value is {torch.finfo(torch.float16).max:.0f}). "
                     "GradScaler cannot fix this; use bf16, or keep the overflowing op in fp32 "
                     "(torch.autocast(..., enabled=False)).")
        else:
            cause = ("an op overflowed or lost the precision it needed (a log or division of a value rounded to 0, "
                     "say); keep that op in fp32 (torch.autocast(..., enabled=False)).")
        notes.append(f"{dtype} produced inf/NaN where fp32 did not{where}: {cause}")
    if drift and drift["fp32_only_nonfinite"] and not state_reason:
        notes.append(f"fp32 produced inf/NaN where {dtype} did not ({drift['fp32_only_nonfinite']} "
                     f"element{'s' if drift['fp32_only_nonfinite'] != 1 else ''}); the drift figures leave those out.")
    if result.amp.ops.empty:
        notes.append("The cell ran no torch operators, so autocast had nothing to change: %%amp compares "
                     "torch code (the times are of plain Python).")
        speedup = None  # a "speedup" of plain Python is noise; say nothing more about it
    if result.nonfinite_result:
        speedup = None  # a wrong answer faster is not a finding: the overflow note above is the advice
    if speedup is not None and _too_few_runs(result):
        runs = min(len(result.baseline.times.times), len(result.amp.times.times))
        notes.append(f"{runs} timed run{'s' if runs != 1 else ''} per variant cannot rank the two "
                     f"({speedup:.2f}x measured): use {option('repeat', 5)} or more (at least {MIN_RUNS}).")
        speedup = None
    if speedup is not None:
        if speedup < 1.05:
            if info.type == "cpu" and not (info.has_bf16_units if dtype == "bf16" else info.has_fp16_units):
                notes.append(f"No speedup ({speedup:.2f}x): this CPU lacks {dtype} units (AMX / AVX512-{dtype.upper()}), "
                             "so autocast only adds casts. Measure on a GPU with Tensor Cores.")
            elif not result.precision["reduced"]:
                notes.append(f"No speedup ({speedup:.2f}x): no op ran in {dtype} -- autocast had nothing here to cast "
                             "(reductions and elementwise ops stay fp32); it speeds up matmuls and convolutions.")
            elif result.precision["reduced_flop_share"] is not None and result.precision["reduced_flop_share"] < 0.5:
                notes.append(f"No speedup ({speedup:.2f}x): only {result.precision['reduced_flop_share']:.0%} of the FLOPs "
                             f"ran in {dtype}; the time goes to ops autocast keeps in fp32.")
            else:
                notes.append(f"No speedup ({speedup:.2f}x): the work is too small or memory-bound for {dtype} to pay "
                             "for its casts; try a larger batch.")
        elif not result.speedup_uncertain:
            notes.append(f"{label} is {speedup:.2f}x faster here.")
    if result.unaligned_matmuls:
        dims = sorted({d for m in result.unaligned_matmuls for d in m["unaligned"]})[:6]
        notes.append("Matmul dims " + ", ".join(map(str, dims)) + " are not multiples of 8; pad them (e.g. to "
                     + ", ".join(str(-(-d // 8) * 8) for d in dims) + ") so Tensor Cores / AMX tiles are used fully.")
    heavy = result.precision["heavy_fp32"] if autocast else []
    if heavy:
        notes.append("Heavy ops still in fp32 under autocast: " + ", ".join(heavy)
                     + " (their inputs were cast back, or they ran outside the autocast region).")
    grads = result.gradients
    if grads and grads["dtype"] == "fp16" and not result.nonfinite_result:
        if grads["overflow_tensors"] and not grads["grad_scaler"]:
            notes.append(f"fp16 gradients overflowed (inf/NaN in {grads['overflow_tensors']} tensors): "
                         "use torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()).")
        elif grads["underflow_fraction"] and grads["underflow_fraction"] > 0.001 and not grads["grad_scaler"]:
            notes.append(f"{grads['underflow_fraction']:.1%} of the nonzero fp32 gradient entries became 0 in fp16 "
                         "(underflow): use torch.amp.GradScaler.")
        elif not grads["grad_scaler"]:
            notes.append("fp16 training without torch.amp.GradScaler: no overflow this step, but small gradients "
                         "can underflow later; GradScaler guards against it.")
    if drift and drift["max_rel"] > 0.05 and not state_reason:
        notes.append(f"The result moved by {result.drift['max_rel']:.1%} (relative) under {dtype}; check that "
                     "this accuracy is acceptable (e.g. keep loss/softmax in fp32).")
    mem = result.memory_saving
    if mem is not None and result.memory_comparable:
        if mem > 0.05:
            notes.append(f"Peak memory {mem:.0%} lower ({format_bytes(result.baseline.memory.peak_bytes)} -> "
                         f"{format_bytes(result.amp.memory.peak_bytes)}).")
        elif mem < -0.05 and autocast:
            notes.append(f"Peak memory {-mem:.0%} higher under {dtype}: autocast keeps casted copies of fp32 weights "
                         "for the backward pass.")
    if info.type == "cpu":
        notes.append(describe(info) + ". These are CPU figures, not GPU ones.")
    return notes


__all__ = ["compare_amp", "AmpResult", "Variant", "compute_drift", "format_seconds", "planned_runs"]
