"""``compare_amp``: the same code, fp32 against mixed precision, from the same starting state.

The order of runs is the method, so it is spelled out here:

1. Snapshot the state the code can touch (`snapshot.Snapshot`), on the host.
2. ``warmup`` rounds of (fp32, amp), output silenced: caches, cuBLAS handles, autotuning.
3. ``repeat`` timed rounds; the order inside a round alternates (fp32 first, then amp first) so a
   clock that drifts during the measurement does not favour one side. Around each timed run,
   `contention.ContentionMeter` measures how much CPU other programs took, per variant.
4. Runs under the peak-memory meter (one per variant on CUDA, `CPU_MEMORY_RUNS` interleaved on the
   CPU, whose peak RSS moves between runs), one per variant under the op audit (dtype per op,
   FLOPs, gradient hooks). These are separate because both meters perturb timing.
5. One last run under the recipe, with its output shown: the user's state afterwards is exactly
   that of one run of the code under the recipe.

Every run starts with ``snapshot.restore()`` and `TorchGlobals.restore()`: the same variables and
the same torch settings (grad mode, default dtype, autocast, TF32/cuDNN flags); with
``restore=False`` there is no snapshot, but torch's settings are still put back. If any run raises
(or is interrupted), both are restored -- the state from before the call -- and the exception
propagates unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import io
import math
import re
import statistics
import time
from typing import Callable

import torch

from .keywords import explains_keywords
from .amp_advice import advise
from .amp_result import MEMORY_NOISE_FLOOR, MEMORY_SAME, MIN_RUNS, AmpResult, Variant
from .cell_reads import KINDS, and_list, describe, graphs_compiled, objects_read, take_first
from .contention import ContentionMeter
from .device import DTYPE_NAMES, DeviceError, device_info, dtype_name, resolve_device
# overflow_hint: docs/amp.md names it nbaccel.amp.overflow_hint
from .failure_hints import failure_hint, message_of as _message, overflow_hint  # noqa: F401
from .drift import compare_tokens, compute_drift, leaf_dtypes, leaf_magnitudes, resolution, runs_differ, to_host
from .flops import OpAudit, switching_ops
from .holders import namespace_holders
from .memory import PeakMemory, PeakMeter, format_bytes, meter_series, note_harness
from .options import in_magic, option, whole_number
from .precision import (FP32, Recipe, TorchGlobals, apply_recipe, autocast_in_effect, make_recipe,
                        relaxed_fp32_settings)
from .quiet import hiding_side_channels
from .storages import optimizer_state_storage_bytes
from .snapshot import (Snapshot, SnapshotTooLarge, available_host_memory, distinct_failures, estimate_bytes,
                       refuse_uninitialized_lazy)
from .tensor_peak import MAX_OPS, CpuTensorPeak
from .profile_options import profiler_running
from .timing import Clock, Stats


# The CPU's peak (the process's peak RSS) moves by a few MiB between runs of the same cell: with one
# memory run per variant, five comparisons of the quickstart's training step read anything from 31 %
# saved to 28 % more (docs/amp.md, "Peak memory"). So the CPU takes the median of several memory
# runs per variant and calls a difference firm only when the variants' ranges do not overlap. On
# CUDA, max_memory_allocated counts the bytes the run's tensors ask the caching allocator for: the
# same ops from the same state ask for the same bytes (cuDNN's autotuning is done in the warmup), so
# one run per variant is enough there.
CPU_MEMORY_RUNS = 3


def memory_runs(device, allocator: bool = True) -> int:
    """Runs per variant under the peak-memory meter on ``device``: 1 for an allocator's counts (CUDA's;
    torch's CPU allocator, ``allocator``, `CpuTensorPeak`), which repeat; `CPU_MEMORY_RUNS` for the
    process's memory (a cell of more than `tensor_peak.MAX_OPS` ops, or while another profiler records)."""
    return 1 if torch.device(device).type == "cuda" or allocator else CPU_MEMORY_RUNS


def planned_runs(warmup: int, repeat: int, baseline: bool = True, device="auto", allocator: bool = True) -> int:
    """How many times a comparison on ``device`` runs the code: per variant the warmup rounds, the timed
    runs, one audited run and the memory runs (`memory_runs`; ``allocator=False``: the process's memory
    is measured, 2 x 2 runs more on the CPU); then the kept run."""
    device = resolve_device(device) if device == "auto" else device  # a count: "cuda" needs no GPU to be read
    return (2 if baseline else 1) * (warmup + repeat + memory_runs(device, allocator) + 1) + 1


# --- the comparison ------------------------------------------------------------------------------

class _Printed:
    """What a hidden run printed (``stdout``, ``stderr`` text): shown if the run fails (`quiet.replay_prints`)."""

    def __init__(self, out: io.StringIO, err: io.StringIO):
        self._out, self._err = out, err

    stdout = property(lambda self: self._out.getvalue())
    stderr = property(lambda self: self._err.getvalue())


@contextlib.contextmanager
def _redirect():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield _Printed(out, err)


class _GradientProbe:
    """Post-accumulate hooks on every leaf tensor that requires grad: what backward produced; and, as the
    run ends, what the step did to each such tensor that got a gradient (``updates``: after minus before,
    ``before`` being the snapshot's copies, `_TensorCopy`)."""

    def __init__(self, copies):
        copies = [c for c in copies if c.tensor.is_leaf and c.tensor.requires_grad]
        self.tensors = [c.tensor for c in copies]
        self.grads: dict[int, torch.Tensor] = {}
        self.updates: dict[int, torch.Tensor | None] = {}
        self._before = {id(c.tensor): c.data for c in copies if c.overlap is None}
        self._handles = []

    def __enter__(self):
        for t in self.tensors:
            self._handles.append(t.register_post_accumulate_grad_hook(self._record))
        return self

    def _record(self, t):
        if t.grad is not None:
            grad = t.grad.detach().to("cpu", copy=True)
            # A sparse gradient (nn.Embedding(sparse=True)): its values are the entries (isfinite and
            # comparisons refuse a sparse tensor); coalesced, so two runs' entries line up by index.
            self.grads[id(t)] = grad.coalesce() if grad.layout == torch.sparse_coo else grad

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if exc[0] is None:
            self._read_updates()
        self._before.clear()  # the snapshot's own copies: not kept alive by the probe

    def _read_updates(self):
        """Each updated tensor's step, after minus before, subtracted in float64: two fp32 values' difference
        is exact there (in fp32 a 1e-7 step on a weight of 0.1 would be rounded by 7%), then kept in fp32."""
        for t in self.tensors:
            before = self._before.get(id(t))
            if (id(t) not in self.grads or before is None or t.layout != torch.strided or t.is_nested
                    or t.shape != before.shape or t.dtype != before.dtype
                    or not (t.is_floating_point() or t.is_complex())):
                continue
            wide, kept = ((torch.complex128, torch.complex64) if t.is_complex() else (torch.float64, torch.float32))
            kept = t.dtype if t.dtype in (torch.float64, torch.complex128) else kept
            step = t.detach().to("cpu", wide) - before.to(wide)
            # None: not moved (no optimizer step, or one a GradScaler skipped), without a copy of zeros
            self.updates[id(t)] = step.to(kept) if bool(step.any()) else None


def _entries(grad: torch.Tensor) -> torch.Tensor:
    """The entries of a gradient as recorded: a sparse one's values, a dense one itself."""
    return grad.values() if grad.layout == torch.sparse_coo else grad


def _same_entries(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two runs' gradients hold the same entries in the same places (their values line up)."""
    if a.layout != b.layout or a.shape != b.shape:
        return False
    return a.layout != torch.sparse_coo or torch.equal(a.indices(), b.indices())


def _gradient_report(base: _GradientProbe | None, amp: _GradientProbe, recipe: Recipe, scaler_info: dict,
                     switches: list[str] = ()) -> dict | None:
    """Overflow, underflow and switched-off gradient entries of the recipe's audited run against fp32's.
    ``switches``: the ops of the audit that zero a gradient by a comparison (`flops.switching_ops`)."""
    if not amp.grads:
        return None
    overflow_tensors = sum(1 for g in amp.grads.values() if not torch.isfinite(_entries(g)).all())
    overflow_elements = sum(int((~torch.isfinite(_entries(g))).sum()) for g in amp.grads.values())
    # bf16 has fp32's range: an entry nonzero in fp32 and 0 under bf16 underflowed only if fp32's value
    # was below bf16's smallest normal number; a larger one was switched off, a ReLU, max or dropout
    # whose input changed sign with rounding (a numbers audit: 1,548 "underflowed" bf16 entries were 6
    # ReLU units flipping). fp16 cannot be judged so: its underflow happens in the activations'
    # gradients, and a weight's gradient summed over a large batch of them is far above fp16's smallest
    # normal number (a review: 16 entries lost to 1e-9 activation gradients read as "switched off").
    # There every zeroed entry counts as underflow, which GradScaler addresses.
    dtype = recipe.autocast_dtype or torch.float32
    tiny = torch.finfo(dtype).tiny if dtype == torch.bfloat16 else math.inf
    underflow = switched = nonzero = 0
    switched_largest, switched_sum, switched_count = 0.0, 0.0, 0  # the fp32 sizes: of them, of their tensors'
    relative: list[float] = []  # per gradient tensor: ||amp - fp32|| / ||fp32||, over the entries finite in both
    stepped = _relative_errors(base.updates, amp.updates) if base is not None else []
    if base is not None:
        for key, g_amp in amp.grads.items():
            g_base = base.grads.get(key)
            if g_base is None or not _same_entries(g_base, g_amp):
                continue
            g_base, g_amp = _entries(g_base), _entries(g_amp)
            error = _relative_error(g_amp, g_base)
            if error is not None:
                relative.append(error)
            mask = g_base != 0
            nonzero += int(mask.sum())
            zeroed = mask & (g_amp == 0)
            small = g_base.abs() < tiny
            underflow += int((zeroed & small).sum())
            off = zeroed & ~small
            if bool(off.any()):
                switched += int(off.sum())
                switched_largest = max(switched_largest, float(g_base[off].abs().max()))
                switched_sum += float(g_base[mask].abs().double().sum())
                switched_count += int(mask.sum())
    return {
        "dtype": DTYPE_NAMES.get(recipe.autocast_dtype, "fp32"),
        "tensors_with_grad": len(amp.grads),
        "overflow_tensors": overflow_tensors,
        "overflow_elements": overflow_elements,
        "underflow_elements": underflow if base is not None else None,
        "underflow_fraction": underflow / nonzero if base is not None and nonzero else None,
        "switched_off_elements": switched if base is not None else None,
        # how large they were in fp32, beside the mean nonzero fp32 magnitude of the tensors they are in:
        # far smaller, they are the small end of a sum that rounding or cancellation took to 0
        "switched_off_largest": switched_largest if switched else None,
        "switched_off_typical": switched_sum / switched_count if switched else None,
        # the ops seen that zero a gradient by a comparison of their input: the other cause they can have
        "switch_ops": list(switches),
        # fp32 values under this count as underflow when they became 0 (bf16); None: every zeroed one (fp16)
        "underflow_below": tiny if tiny < math.inf else None,
        # How far the step's gradients moved, not only its loss (a trial's training step had drift on the loss
        # alone): each tensor's error as a share of its fp32 size. Not with a GradScaler, whose scale in each
        # run nbaccel does not read, so the two runs' gradients may be scaled apart.
        "relative_error": None if scaler_info.get("grad_scaler") else _spread_of(relative),
        # ... and how far the step the optimizer took moved: each updated tensor's step (after minus before)
        # against fp32's. A GradScaler's unscaled gradients are what the step used, so it is given there too
        # (gradient drift is not); a step the scaler skipped reads 100%.
        "update_error": _spread_of(stepped),
        **scaler_info,
    }


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """||a - b|| / ||b|| over the entries finite in both, in float64 (complex128 for complex: .double() drops
    an imaginary part); None where b is 0 there."""
    finite = torch.isfinite(a) & torch.isfinite(b)
    wide = torch.complex128 if b.is_complex() else torch.float64
    reference = b[finite].to(wide)
    size = float(reference.norm())
    return float((a[finite].to(wide) - reference).norm()) / size if size > 0 else None


def _relative_errors(base: dict, amp: dict) -> list[float]:
    """Per tensor both runs updated, fp32's step moving it: the recipe's step's relative error (`_relative_error`);
    1 (100%) where the recipe's did not move it."""
    out = []
    for key, a in amp.items():
        b = base.get(key)
        if b is None or (a is not None and a.shape != b.shape):
            continue
        error = 1.0 if a is None else _relative_error(a, b)
        if error is not None:
            out.append(error)
    return out


def _spread_of(errors: list[float]) -> dict | None:
    return {"median": statistics.median(errors), "max": max(errors), "tensors": len(errors)} if errors else None


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
        """Which run raised, e.g. "in the bf16 autocast run (the fp32 run had succeeded)"."""
        _, recipe, kept = self.failure
        name = _run_name(recipe)
        if kept:
            return f"in the kept {name} run (the measurement runs had succeeded)"
        others = [r for r in order if r != recipe and r in self.ran]
        if others and recipe in self.ran:
            return f"in {_a(name)} run (earlier {name} and {_run_name(others[0])} runs had succeeded)"
        if others:
            return f"in the {name} run (the {_run_name(others[0])} run had succeeded)"
        if recipe in self.ran:
            return f"in {_a(name)} run (an earlier one had succeeded)"
        return f"in the {name} run"


def _amp_name(recipe: Recipe) -> str:
    """The mixed-precision variant's name: "bf16", "fp16", or "tf32" for TF32 alone."""
    return DTYPE_NAMES.get(recipe.autocast_dtype, "tf32")


def _a(name: str) -> str:
    """"an fp32", "a bf16 autocast": the article as the name is read aloud (ef-pee, bee-ef, tee-ef)."""
    return ("an " if name.startswith("f") else "a ") + name


def _run_name(recipe: Recipe) -> str:
    """"bf16 autocast", "TF32" or "fp32": the run's name in "the cell raised X in the ... run"."""
    if recipe.autocast_dtype is not None:
        return f"{DTYPE_NAMES[recipe.autocast_dtype]} autocast"
    return "TF32" if recipe.tf32 else "fp32"


def _safely(what: str, fn, *args):
    """(fn(*args), None), or (None, a reason) when nbaccel's own analysis fails: a value nbaccel
    cannot compare must never turn into a failure of the user's code."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - any failure here is nbaccel's, reported in the result
        return None, f"nbaccel could not {what} ({type(exc).__name__}: {exc})"


class _MeterStopped(Exception):
    """The cell's own profiler stopped `CpuTensorPeak`'s (torch has one per process)."""


def _takes_three(callback) -> bool:
    """Whether ``on_first_run`` takes the restore time as a third argument (it was (seconds, runs_left))."""
    try:
        inspect.signature(callback).bind(0.0, 0, 0.0)
    except (TypeError, ValueError):  # two parameters, or no signature to read (a builtin)
        return False
    return True


class _Runner:
    """Runs the code under one recipe from the snapshot; the small engine behind compare_amp."""

    def __init__(self, cell: _Cell, snapshot: Snapshot, torch_globals: TorchGlobals, clock: Clock,
                 device: torch.device, silence, on_first_run=None, runs_after_first: int = 0):
        self.cell, self.snapshot, self.torch_globals = cell, snapshot, torch_globals
        self.clock, self.device, self.silence = clock, device, silence
        self.on_first_run, self.runs_after_first = on_first_run, runs_after_first
        self._report_restore = on_first_run is not None and _takes_three(on_first_run)  # read once
        self._reported: set = set()  # the variants whose first run on_first_run was told of
        self._runs = 0  # runs so far, for the runs still to come
        self.relaxed_by_cell: dict[int, list[str]] = {}  # id(recipe) -> the fp32 settings its audited run ended with
        self.meter: ContentionMeter | None = None  # set for the timed rounds only, not the warmup
        self.names: dict = {}  # id(recipe) -> the variant's name, the meter's span
        # The restores of the variables before each run, timed (perf_counter: the host's copy, whatever
        # clock times the runs), which the runs' times leave out. A user trial's 1.15 GiB snapshot (Embedding(400000, 256,
        # sparse=True) + SparseAdam) made --repeat 5 of a 7 ms step take 8.49 s with no long-run note,
        # which estimated from the run alone.
        # Each restore is timed (the first one for the long-run note, all of them for the advice): on
        # the project's VM that trial's restores took 0.55 to 2.97 s each, one run to the next.
        self.restore_times: list[float] = []

    def start(self, recipe: Recipe, kept: bool = False) -> None:
        """Every run starts from the same variables and the same torch settings."""
        began = time.perf_counter()
        self.snapshot.restore()
        self.restore_times.append(time.perf_counter() - began)
        self.torch_globals.restore()
        self.cell.recipe, self.cell.kept = recipe, kept

    def timed(self, recipe: Recipe) -> float:
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.start(recipe)
        with self.silence(), apply_recipe(recipe), self._contention(recipe):
            seconds, _ = self.clock.measure(self.cell)
        self._runs += 1
        # The first run of each variant is a timed one (warmup or not), the first of all first. Reported here,
        # after the silenced block, so a note the callback prints reaches the user. Each variant's: a trial's
        # fp16 runs took 74x the first (fp32) run's time, and the note estimated from that one alone never came.
        if self.on_first_run is not None and id(recipe) not in self._reported:
            self._reported.add(id(recipe))
            left = self.runs_after_first + 1 - self._runs
            if self._report_restore:
                self.on_first_run(seconds, left, self.restore_times[0] if self.restore_times else 0.0)
            else:
                self.on_first_run(seconds, left)
        return seconds

    def _contention(self, recipe: Recipe):
        # Inside the recipe and the silencing, around the clock only: the window is the timed one,
        # and the snapshot restore before it (this process's work anyway) stays out.
        if self.meter is None:
            return contextlib.nullcontext()
        return self.meter.span(self.names[id(recipe)])

    def memory(self, recipe: Recipe, keep_value: bool = False, tensors: bool = False) -> tuple[PeakMemory, object]:
        """(the run's peak memory, a host copy of its value when ``keep_value``, else None). ``tensors``:
        torch's CPU allocator (`CpuTensorPeak`) instead of the process's memory; `_MeterStopped` when
        the cell's own profiler stopped that meter."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.start(recipe)
        meter = (CpuTensorPeak("an AMP comparison's memory meter (%%amp or compare_amp)") if tensors
                 else PeakMeter(self.device))
        with self.silence(), apply_recipe(recipe), meter:
            value = self.cell()
        if meter.result is None:
            raise _MeterStopped
        return meter.result, (_safely("copy the result to the host", to_host, value)[0] if keep_value else None)

    def memory_series(self, order: list, base_recipe: Recipe, keep_fp32: bool, ops: int) -> tuple[dict, object]:
        """The memory runs, interleaved and alternating like the timed runs: ({id(recipe): [PeakMemory]},
        a host copy of the first fp32 run's value when ``keep_fp32``). On the CPU, for a cell of at most
        `tensor_peak.MAX_OPS` ops (``ops``: the audited runs' most), torch's allocator is measured, one
        run per variant (its counts repeat, as CUDA's do); else, or if that meter cannot measure (the
        cell's own profiler stopped it, a profile the cell starts refused to run under it), the process's
        memory is, `memory_runs` per variant, for every run (the two do not compare)."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        why = None  # why the process's memory is measured on the CPU, for the method line
        if self.device.type == "cpu" and ops > MAX_OPS:
            why = f"the cell ran {ops:,} ops, more than the {MAX_OPS:,} torch's allocator meter records"
        elif self.device.type == "cpu" and not CpuTensorPeak.available():
            why = "another profiler was recording, and torch runs one at a time"
        tensors = self.device.type == "cpu" and why is None
        while True:
            peaks, fp32_again = {id(r): [] for r in order}, None
            failure = self.cell.failure
            try:
                with meter_series(self.device):
                    for i in range(memory_runs(self.device, allocator=tensors)):
                        for recipe in (order if i % 2 == 0 else order[::-1]):
                            first_fp32 = keep_fp32 and recipe is base_recipe and i == 0
                            peak, value = self.memory(recipe, keep_value=first_fp32, tensors=tensors)
                            peaks[id(recipe)].append(peak)
                            fp32_again = value if first_fp32 else fp32_again
                break
            except _MeterStopped:
                tensors, why = False, "the cell's own profiler stopped torch's allocator meter"
            except Exception as exc:
                if not (tensors and "profiler" in _message(exc).lower()):
                    raise
                # A profiler of the cell's own (nbaccel.profile, torch's) refused to start under the
                # allocator meter's: measured again without it; a second failure goes to the user.
                tensors, self.cell.failure = False, failure
                why = "a profiler the cell starts cannot run under torch's allocator meter"
        if why is not None:
            peaks = {key: [dataclasses.replace(p, method=f"{p.method} (not torch's allocator: {why})") for p in runs]
                     for key, runs in peaks.items()}
        return peaks, fp32_again

    def audited(self, recipe: Recipe, keep_embedding_ids: bool = True):
        """The recipe's run under `OpAudit`; ``keep_embedding_ids``: whether its audit keeps the prompt's
        token ids (`drift.compare_tokens` reads the fp32 run's only)."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.start(recipe)
        probe = _GradientProbe(self.snapshot.tensors)
        audit = OpAudit(keep_embedding_ids)
        scales_before = _scaler_scales(self.snapshot)
        with self.silence(), apply_recipe(recipe), probe, audit, _ScalerUse() as scaler_use:
            value = self.cell()
            if recipe.autocast_dtype is None:  # read before the recipe puts its own settings back
                # The cell's own torch.set_float32_matmul_precision("medium"): the fp32 run was not strict.
                self.relaxed_by_cell[id(recipe)] = relaxed_fp32_settings(self.device.type)
        host = _safely("copy the result to the host", to_host, value)
        # read now, while the value's tensors are alive: the audit keys them weakly
        magnitudes = _safely("read the result's magnitudes", leaf_magnitudes, value, audit.magnitude_of)[0] or {}
        dtypes = _safely("read the result's dtypes", leaf_dtypes, value)[0]
        scales_after = _scaler_scales(self.snapshot)
        scaler_info = {
            "grad_scaler": scaler_use.calls > 0,
            # GradScaler halves its scale when it finds inf/NaN gradients and skips that optimizer step.
            "scaler_skipped_step": any(a < b for a, b in zip(scales_after, scales_before)) if scales_before else None,
        }
        return audit, probe, host, scaler_info, magnitudes, dtypes


@explains_keywords({"steps": "repeat", "number": "repeat", "runs": "repeat", "iterations": "repeat", "iters": "repeat",
                    "n": "repeat", "warmups": "warmup", "warm_up": "warmup", "precision": "dtype", "amp": "dtype"})
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
    contention_meter: ContentionMeter | None = None,
    emulated: bool = False,
) -> AmpResult:
    """Time ``fn`` in strict fp32 and under autocast (+TF32 on CUDA) from the same starting state.

    ``dtype``: ``bf16|fp16|auto``, or ``"tf32"`` for TF32 alone (no autocast; CUDA sm80+ only).
    fp32 is the baseline, so it is refused as the compared dtype.

    ``namespace``/``state``: what ``fn`` may change and must be restored before each run -- a
    dict of variables (the notebook's namespace) and/or objects (model, optimizer, ...). Without
    either, the *objects* ``fn`` can reach by name (its closure, and the globals named in its code
    and in the functions it calls) are snapshotted and restored in place; a global that the code
    *rebinds* (``count += 1`` inside a function) is not -- pass ``namespace=globals()`` for that.
    ``silence``: context-manager factory that hides the measurement runs' output (default: stdout and
    stderr); those runs also neither log, nor use up warnings, nor leave pyplot figures open, nor write to
    fds 1 and 2 (subprocesses, C code), whichever is passed (`nbaccel.quiet`);
    ``show_output``: the one for the kept run (default: output shown).
    ``restore=False``: no snapshot of the variables; every run continues from the variables the
    previous one left (for state too large to copy -- the comparison is then between different
    starting states). torch's global settings are still put back before each run.
    ``max_snapshot_fraction``: refuse (`SnapshotTooLarge`) when the snapshot would take more than
    this share of the host's available memory, instead of swapping the machine to death.
    ``on_cell_error(exc, where)``: called when ``fn`` itself raises, before its exception
    propagates unchanged; ``where`` says which run raised ("in the bf16 autocast run (the fp32 run had succeeded)").
    Without it, the exception gets that as a note (``add_note``), shown under its traceback.
    An exception without this call came from nbaccel, not from ``fn``.
    ``on_first_run(seconds, runs_left)``: called after the first run of each variant (first the fp32
    one, then the recipe's), with its measured time and the number of runs still to come
    (`planned_runs` in all), so a caller can say how long the rest will take (``%%amp`` does, when
    that is long; a variant can be far slower than the other); one that takes a third argument gets
    the seconds the first restore of the variables took (0 without a snapshot), which each run pays too.
    ``contention_meter``: what measures other programs' CPU use during the timed runs (default: a
    `ContentionMeter` reading /proc; tests inject scripted readers).
    ``emulated=True``: ``dtype="fp16"`` runs on a CPU without fp16 units (AMX-FP16 / AVX512-FP16) instead of
    being refused: the drift and a training step's gradient overflow/underflow are fp16's, the times are
    the emulation's, many times fp32's, and the result says so.
    Returns an `AmpResult`; the kept run's return value is ``result.value``.
    Under torchrun it measures the calling rank only; `nbaccel.distributed.compare_amp` (or
    ``gather_amp(result)``) gathers every rank's result (min/median/max, slowest rank).
    """
    __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
    state, dev, info, amp_recipe, base_recipe = _checked(fn, dtype, device, tf32, warmup, repeat, baseline,
                                                         restore, namespace, state, max_snapshot_fraction,
                                                         on_cell_error, on_first_run, emulated)
    outer_autocast = autocast_in_effect(dev.type)  # before any run: the user's, not ours
    fp32_overridden = relaxed_fp32_settings(dev.type)  # likewise
    torch_before = TorchGlobals()
    if namespace is None and not state:
        state = _referenced_objects(fn)
    # What the report names (cell_reads.py); nbaccel's own reading never fails the user's comparison.
    reads = _safely("read the names the cell uses", objects_read, fn, namespace)[0] or dict.fromkeys(KINDS, {})
    if not restore:
        snapshot = Snapshot(namespace=None, skip=skip)
    else:
        for name, module in reads["lazy_modules"].items():
            refuse_uninitialized_lazy(name, module)
        _check_snapshot_size(namespace, state, skip, max_snapshot_fraction)
        snapshot = Snapshot.capture(namespace, objects=state, skip=skip)
    note_harness("%%amp" if in_magic() else "compare_amp", snapshot.nbytes)
    # Inside a profiler (a trial: `with nbaccel.profile(): compare_amp(step)`), its overhead is in every
    # timed run, and the profile holds all the runs: this report says so, and a mark in the trace lets
    # the profile's say so too (`profile_advice._compare_amp_note`).
    under_profiler = profiler_running()
    if under_profiler:
        with torch.profiler.record_function(f"{COMPARE_AMP_MARK} ({planned_runs(warmup, repeat, baseline, dev)} runs)"):
            pass
    iterators = [describe(name, it) for name, it in reads["iterators"].items()]
    compiled = [describe(name, model) for name, model in reads["compiled"].items()]
    loaders = [describe(name, loader) for name, loader in reads["worker_loaders"].items()]
    clock = clock or Clock(dev)
    cell = _Cell(fn)
    # torch's settings are put back before every run also with restore=False: that skips the copy of
    # the variables (too large to copy), and costs nothing here. Without it, a run that turned grad mode
    # off left it off for the next, and its error was blamed on that run (a user trial).
    runner = _Runner(cell, snapshot, torch_before, clock, dev, hiding_side_channels(silence or _redirect),
                     on_first_run, planned_runs(warmup, repeat, baseline, dev) - 1)
    order = [base_recipe, amp_recipe] if baseline else [amp_recipe]

    graphs_at_start = graphs_compiled()
    try:
        for _ in range(warmup):
            for recipe in order:
                runner.timed(recipe)
        times = {id(r): Stats() for r in order}
        # Made here, after the warmup: a DataLoader's workers started by it are found as ours.
        runner.meter = contention_meter or ContentionMeter()
        runner.names = {id(base_recipe): "fp32", id(amp_recipe): _amp_name(amp_recipe)}
        graphs_before_timed = graphs_compiled()
        for i in range(repeat):
            for recipe in (order if i % 2 == 0 else order[::-1]):
                times[id(recipe)].times.append(runner.timed(recipe))
        compiled_while_timed = graphs_compiled() - graphs_before_timed
        # The audit first: its op count decides how the memory runs measure (`memory_series`).
        audits = {}
        for recipe in order:  # a loop, not a comprehension: its frame would show in the cell's traceback
            audits[id(recipe)] = runner.audited(recipe, keep_embedding_ids=recipe is base_recipe)
        ops = max(audit.calls for audit, *_ in audits.values())
        peaks, fp32_again = runner.memory_series(order, base_recipe, keep_fp32=restore, ops=ops)
        memory = {key: PeakMemory.median_of(runs) for key, runs in peaks.items()}
        # The kept run: under the recipe, output shown, state left as one run leaves it.
        runner.start(amp_recipe, kept=True)
        with (show_output or contextlib.nullcontext)(), apply_recipe(amp_recipe):
            value = cell()
        result = _build_result(info, order, times, memory, audits, amp_recipe, base_recipe, baseline,
                               warmup, repeat, clock, snapshot, restore, value, fp32_again)
        result.outer_autocast, result.fp32_overridden = outer_autocast, fp32_overridden
        result.fp32_relaxed_by_cell = runner.relaxed_by_cell.get(id(base_recipe), []) if baseline else []
        result.restore_times = runner.restore_times if restore else []
        if graphs_compiled() > graphs_at_start and not compiled:  # torch.compile called inside the cell
            compiled = ["the code the cell compiles"]
        result.iterators, result.compiled, result.worker_loaders = iterators, compiled, loaders
        if restore:  # restored stateless before every run, each run's step created the state (the kept one too)
            result.optimizer_state_created = [
                (name, type(opt).__name__, optimizer_state_storage_bytes(opt))
                for name, opt in reads["stateless_optimizers"].items() if opt.state]
        result.compiled_while_timed = compiled_while_timed
        result.contention = runner.meter.result
        result.under_profiler = under_profiler
    except BaseException as exc:  # KeyboardInterrupt too; re-raised unchanged
        def add_note(error: BaseException, note: str) -> None:
            # add_note raises TypeError where the user's code set __notes__ to something not a list
            # (a tuple, None); that must not replace the user's exception, nor the note be lost (the
            # magic reads NOT_RESTORED back): the notes become a list, what was there first.
            if not hasattr(error, "add_note"):  # Python 3.10: no notes
                return
            try:
                error.add_note(note)
            except TypeError:
                old = getattr(error, "__notes__", None)
                old = [] if old is None else list(old) if isinstance(old, (list, tuple)) else [old]
                with contextlib.suppress(Exception):  # a type that refuses the attribute: left as it is
                    error.__notes__ = [*old, note]

        # Abandoned: the variables (unless restore=False) and torch's settings as before, first, so
        # the notes below say what is true.
        try:
            problem = _put_back(snapshot, torch_before, dev)
        except KeyboardInterrupt as again:  # a second Ctrl-C while the variables are put back (that takes a while)
            if restore:
                add_note(again, INTERRUPTED_RESTORE)
            raise
        # An iterator the runs used up is not put back (a trial: "your variables ... as they were" above the
        # note saying the runs used it up): noted first, so the line about the variables can say so.
        used_up = isinstance(exc, StopIteration) and iterators and cell.ran and hasattr(exc, "add_note")
        if used_up:
            add_note(exc, used_up_note(iterators))
        if cell.failure is not None and cell.failure[0] is exc:
            if on_cell_error is not None:
                on_cell_error(exc, cell.where(order))
            elif hasattr(exc, "add_note"):  # a script has no magic to say which run: the traceback does
                restored = ("torch's settings are as before the call, your variables not all (see the next note)"
                            if problem else f"torch's settings are as before the call, your variables too except "
                            f"{and_list(iterators)}, which the runs used up (the note above)" if restore and used_up
                            else "your variables and torch's settings are as before the call" if restore
                            else "torch's settings are as before the call (restore=False: variables keep what the runs did)")
                # "interrupted" for Ctrl-C, as the magic says it: "raised in the fp32 run" read as a bug (a trial)
                what = "interrupted (KeyboardInterrupt)" if isinstance(exc, KeyboardInterrupt) else "raised"
                add_note(exc, f"nbaccel.compare_amp: {what} {cell.where(order)}; {restored}")
                hint = failure_hint(exc, dev)
                if hint:
                    add_note(exc, f"nbaccel.compare_amp: {hint}")
        if problem and hasattr(exc, "add_note"):
            add_note(exc, problem)
        snapshot.release()  # put back (or not restorable): the traceback must not keep the copies alive
        raise
    return result


COMPARE_AMP_MARK = "nbaccel.compare_amp"  # a range in a profile around which compare_amp ran (`profile_advice`)
USED_UP = "the comparison's runs used it up"  # the mark of `used_up_note` among an exception's notes


def _checked(fn, dtype, device, tf32, warmup, repeat, baseline, restore, namespace, state, max_snapshot_fraction,
             on_cell_error, on_first_run, emulated=False):
    """Everything `compare_amp` refuses before it runs ``fn``: (state, device, its info, the recipes).
    Apart so that `check_compare_amp` (nbaccel.distributed) can refuse on every rank before any runs."""
    __tracebackhide__ = True  # noqa: F841 - the refusal reads as compare_amp's, as it was before
    _check_function(fn)
    whole_number("warmup", warmup, 0)
    whole_number("repeat", repeat, 1, why="; use at least 3 for a spread")
    _check_arguments(tf32=tf32, baseline=baseline, restore=restore, namespace=namespace, state=state,
                     max_snapshot_fraction=max_snapshot_fraction, on_cell_error=on_cell_error,
                     on_first_run=on_first_run, emulated=emulated)
    if state and not isinstance(state, (list, tuple)):
        state = (state,)  # one object (state=model) is what was meant
    if isinstance(device, int) and not isinstance(device, bool):
        # A trial's compare_amp(fn, "bf16", 3) meant repeat=3 and was told "device='3' was asked for, but this
        # torch sees no CUDA GPU" (torch reads an int as a CUDA index). nbaccel's devices are named: a number here
        # is a misplaced count far more often than a GPU.
        if device < 1:  # torch's way to write cuda:0, and no count compare_amp takes (a review)
            raise DeviceError(f"device={device}: nbaccel names its devices: device='cuda:{device}' for that GPU")
        raise DeviceError(f"device={device}: compare_amp's third argument is the device; pass repeat={device} (or "
                          f"warmup={device}) by keyword, e.g. compare_amp(fn, {dtype!r}, repeat={device}); for a GPU, "
                          f"name it: device='cuda:{device}'")
    dev = resolve_device(device)
    info = device_info(dev)
    if dtype_name(dtype) == FP32:
        raise DeviceError(f"{option('dtype', dtype)} compares fp32 with itself: fp32 is the baseline. Use "
                          f"{option('dtype', 'bf16')}, {option('dtype', 'fp16')}, {option('dtype', 'auto')}, or "
                          f"{option('dtype', 'tf32')} on an Ampere+ CUDA GPU")
    amp_recipe = make_recipe(dtype, dev, tf32=tf32, emulated=emulated)
    base_recipe = make_recipe(FP32, dev)
    return state, dev, info, amp_recipe, base_recipe


def check_compare_amp(*args, **kwargs) -> None:
    """Raise what ``compare_amp(*args, **kwargs)`` would refuse before running its function, without running it.

    `nbaccel.distributed.compare_amp` checks on every rank and agrees on the outcome first: a bad device on
    one rank raised there after the others had started ``fn`` and its collectives, which then waited out the
    process group's timeout (a trial)."""
    compare_amp.check_keywords(kwargs)  # steps=3: "did you mean repeat=3?", as compare_amp itself says it
    bound = inspect.signature(compare_amp).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    _checked(a["fn"], a["dtype"], a["device"], a["tf32"], a["warmup"], a["repeat"], a["baseline"], a["restore"],
             a["namespace"], a["state"], a["max_snapshot_fraction"], a["on_cell_error"], a["on_first_run"],
             a["emulated"])


def used_up_note(iterators: list[str]) -> str:
    """Why a cell that takes one item per run raised StopIteration under the comparison."""
    return (f"nbaccel: {and_list(iterators)} {'is an iterator' if len(iterators) == 1 else 'are iterators'} the cell "
            f"takes items from, and {USED_UP} (no snapshot can rewind an iterator). Take "
            f"the batch before the magic ({take_first(iterators)}) and use `batch` in the cell.")


# The start of the note `_put_back` adds to the user's exception when the variables could not be put back.
NOT_RESTORED = "nbaccel: your variables could not be fully restored"


INTERRUPTED_RESTORE = (f"{NOT_RESTORED}: a second interrupt stopped nbaccel while it put them back. Models, "
                       "optimizers and tensors may be partly as before the call and partly as the runs left them: "
                       "re-create them (or reload a checkpoint) before going on. torch's settings are as before the call.")


def not_restored(exc: BaseException) -> bool:
    """Whether `_put_back` noted on ``exc`` that the variables could not be fully restored. The cell may
    have set ``__notes__`` to anything (None, a number, items whose ``__str__`` raises): nbaccel's own
    notes are strings, and reading the rest must not replace the cell's exception."""
    return _noted(exc, lambda n: n.startswith(NOT_RESTORED))


def used_up(exc: BaseException) -> bool:
    """Whether ``exc`` carries `used_up_note` (an iterator the runs used up), read as `not_restored` reads."""
    return _noted(exc, lambda n: USED_UP in n)


def _noted(exc: BaseException, test) -> bool:
    notes = getattr(exc, "__notes__", ())
    return isinstance(notes, (list, tuple)) and any(isinstance(n, str) and test(n) for n in notes)


def _put_back(snapshot: Snapshot, torch_before: TorchGlobals, device: torch.device) -> str | None:
    """Restore the variables and torch's settings after an exception abandoned a comparison; None, or
    the note for that exception (a `RestoreNote`, starting with `NOT_RESTORED`) when the variables could
    not all be put back.

    An object that refuses to be put back (a dict subclass whose ``clear()`` raises once the cell has
    run) does not stop the rest: `Snapshot.restore` puts back all it can, and the note names exactly
    what it could not, and why. The user's exception stays the one raised (it once became nbaccel's
    error, "a bug in nbaccel", and the note said every variable was back when the list and the RNG after
    that object were not).

    The restore allocates (an optimizer's ``load_state_dict`` puts its moments back on the device) while
    the exception's traceback still holds the failed run's frames, so near the memory limit it can run
    out of memory. Then what can be dropped goes, and it is tried once more: garbage (``gc.collect()``),
    the allocator's cached blocks, and each optimizer's current state before its saved one is loaded.
    The frames stay: they are the user's code and torch's (nbaccel's own hold none of the run's
    tensors), and ``%debug`` needs them. If it still runs out of memory, the user's exception stays the
    one raised, with the returned note, rather than nbaccel's out-of-memory error with the user's as
    its ``__context__``. A failure outside any one object's restore is nbaccel's, and raised.
    """
    from .oom import is_oom
    from .snapshot import RestoreFailure, RestoreNote, describe_failures, restore_failures

    def attempt(drop_state_first: bool) -> list:
        try:
            snapshot.restore(drop_state_first=drop_state_first)
        except Exception as error:  # noqa: BLE001 - what the restore could not put back is said, not raised
            failures = restore_failures(error)
            if failures:
                return failures
            if not is_oom(error):
                raise
            return [RestoreFailure(None, error)]  # from a restore that does not say which object
        return []

    try:
        failures = attempt(False)
        if any(is_oom(f.error) for f in failures):
            _free_memory(device)
            failures = attempt(True)
    finally:
        torch_before.restore()
    # What the capture could not copy was never put back either: "as before the call" is not promised for it.
    failures = failures + list(getattr(snapshot, "left_out", ()))
    if not failures:
        return None
    names = [f.what for f in failures if f.what is not None]
    oom = next((f.error for f in failures if is_oom(f.error)), None)
    if oom is None:
        return RestoreNote(f"{NOT_RESTORED}: not put back (each keeps what the runs did to it): "
                           f"{describe_failures(failures)}. Everything else, and torch's settings, are as before "
                           "the call.", names)
    first = str(oom).strip().splitlines()[0] if str(oom).strip() else ""
    which = (f"Not put back: {describe_failures(failures)}; everything else is as before the call. Re-create those"
             if names else "Models, optimizers and tensors may be partly as before the call and partly as the "
             "failed run left them: re-create them")
    return RestoreNote(f"{NOT_RESTORED}: putting back their saved state ran out of memory ({type(oom).__name__}: "
                       f"{first[:200]}). {which} (or reload a checkpoint) before going on. torch's settings are as "
                       "before the call.", names)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):  # a context the error broke: the second restore says what it can
            torch.cuda.empty_cache()


def _build_result(info, order, times, memory, audits, amp_recipe, base_recipe, baseline, warmup, repeat,
                  clock, snapshot, restore, value, fp32_again=None) -> AmpResult:
    def variant(name, recipe):
        audit = audits[id(recipe)][0]
        return Variant(name, recipe, times[id(recipe)], memory[id(recipe)], audit.table(), audit.total_flops)

    amp_variant = variant(_amp_name(amp_recipe), amp_recipe)
    base_variant = variant("fp32", base_recipe) if baseline else None
    amp_audit, amp_probe, (amp_value, amp_error), scaler_info, amp_magnitudes, amp_dtypes = audits[id(amp_recipe)]
    base_probe = audits[id(base_recipe)][1] if baseline else None
    # The audit is a TorchDispatchMode, and torch runs a few ops otherwise under one: torch.sparse.mm
    # under autocast returns fp32 there and bf16 without it (a user trial: "no op ran in bf16", drift 0,
    # beside a bf16 result). Then the drift is the kept run's, which ran as the timed runs did.
    kept_dtypes = _safely("read the result's dtypes", leaf_dtypes, value)[0]
    # Leaf by leaf, over results of one structure: a result that grew between the runs (a list the
    # snapshot does not restore) is state that changed, for the check below, not the audit's doing.
    audit_differs = (None not in (amp_dtypes, kept_dtypes) and len(amp_dtypes) == len(kept_dtypes)
                     and any(a != k for a, k in zip(amp_dtypes, kept_dtypes) if a is not None and k is not None))
    if audit_differs and amp_error is None:
        amp_value, amp_error = _safely("copy the result to the host", to_host, value)
    drift, tokens, why = None, None, amp_error
    if baseline:
        (base_value, base_error), base_magnitudes = audits[id(base_recipe)][2], audits[id(base_recipe)][4]
        why = why or base_error
        if why is None:
            # near 0 is judged against the fp32 run's values, at the recipe's rounding (drift.py)
            drift, why = _safely("compare the two results", compute_drift, base_value, amp_value, base_magnitudes,
                                 resolution(amp_recipe))
        if why is None:
            # token ids (a generate loop's output): integers, no relative error, so whether the tokens agree
            prompts = audits[id(base_recipe)][0].embedding_ids  # an embedding looked up: the ids are text
            tokens, tokens_why = _safely("compare the two results' token ids", compare_tokens, base_value, amp_value,
                                         prompts, bool(prompts))
            if drift is None and tokens is None:
                why = tokens_why
    state_changed = False
    if restore and why is None and not audit_differs:
        # Two runs under the recipe from the restored state (the audited one and the kept one) must
        # agree; if they do not, the code depends on state the snapshot does not restore.
        kept, _ = _safely("copy the result to the host", to_host, value)
        same, _ = _safely("compare the two results", compute_drift, amp_value, kept, amp_magnitudes,
                          resolution(amp_recipe))
        state_changed = runs_differ(same, amp_recipe)
        if baseline and not state_changed and fp32_again is not None:
            # Two fp32 runs repeat far more closely than two reduced-precision ones, so they catch a
            # change the bf16 tolerance (4 units of 2**-8) lets through: the next batch's loss from
            # an iterator the snapshot cannot rewind moves it by ~1.5 %, not 3 %.
            again, _ = _safely("compare the two results", compute_drift, base_value, fp32_again, base_magnitudes,
                               resolution(base_recipe))
            state_changed = runs_differ(again, base_recipe)
    if baseline and drift is None and why is None and amp_value is None:
        # said, not left out: a user whose drift line vanished took it for a bug
        why = ("nothing to compare: the code returned no value; end the cell with the loss or the output, or "
               "return it from the function")
    elif baseline and drift is None and why is None and tokens is None:  # token ids alone: compared as tokens
        why = ("the result holds no float tensor, array or number that both runs returned with the same shape, "
               "and no token ids (integer tensors other than token ids, bool tensors, arrays of either and other "
               "objects are not compared): return the loss or the output to see the drift")
    # With both variants, a missing drift now always has its reason above: inf/NaN is read from the drift only.
    nonfinite = drift is not None and drift["amp_only_nonfinite"] > 0
    return AmpResult(
        device=info,
        amp=amp_variant,
        baseline=base_variant,
        warmup=warmup,
        repeat=repeat,
        timer_method=clock.method,
        drift=drift,
        tokens=tokens,
        drift_skipped=why if baseline else None,
        gradients=_gradient_report(base_probe, amp_probe, amp_recipe, scaler_info, switching_ops(amp_variant.ops)),
        unaligned_matmuls=amp_audit.unaligned_matmuls(),
        snapshot_bytes=snapshot.nbytes,
        restored=restore,
        state_changed=state_changed,
        audit_differs=audit_differs,
        not_copied=distinct_failures(snapshot.left_out),
        nonfinite_result=bool(nonfinite),
        made_by="%%amp" if in_magic() else "compare_amp()",
        value=value,
    )


def _check_function(fn) -> None:
    """``fn`` is called with no arguments, many times, and must run its work when called."""
    if not callable(fn):
        raise TypeError(f"compare_amp runs a function several times; got a {type(fn).__name__} (the result of "
                        "calling it?): pass the function itself, e.g. compare_amp(train_step) or "
                        "compare_amp(lambda: train_step(batch))")
    if isinstance(fn, torch.nn.Module):
        raise TypeError(f"compare_amp calls fn() with no arguments; got a {type(fn).__name__} module, which needs "
                        "its input: pass compare_amp(lambda: model(x))")
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "a generator" if inspect.isgeneratorfunction(fn) else "a coroutine"
        raise TypeError(f"compare_amp times what fn() does when called, but {fn.__name__}() returns {kind} and "
                        "runs nothing until it is iterated or awaited: pass a plain function")
    try:
        inspect.signature(fn).bind()
    except TypeError as exc:
        raise TypeError(f"compare_amp calls fn() with no arguments, and {getattr(fn, '__name__', 'fn')} needs some "
                        f"({exc}): bind them, e.g. compare_amp(lambda: fn(model, batch))") from None
    except ValueError:  # no signature to read (some builtins): calling it will tell
        pass


def _check_arguments(*, tf32, baseline, restore, namespace, state, max_snapshot_fraction, on_cell_error,
                     on_first_run, emulated=False) -> None:
    """Types that would otherwise fail deep inside, or pass as truthy strings (baseline="False")."""
    for name, value in (("tf32", tf32), ("baseline", baseline), ("restore", restore), ("emulated", emulated)):
        if not isinstance(value, bool):
            raise TypeError(f"{option(name)} takes True or False, got {value!r}")
    if namespace is not None and not isinstance(namespace, dict):
        raise TypeError(f"namespace takes a dict of variables (e.g. globals()) or None, got a {type(namespace).__name__}")
    if isinstance(state, (str, bytes, dict)):
        raise TypeError(f"state takes the objects to restore (model, optimizer, ...) as a tuple, got a "
                        f"{type(state).__name__}; a dict of variables goes in namespace=")
    if max_snapshot_fraction is not None and (isinstance(max_snapshot_fraction, bool)
                                              or not isinstance(max_snapshot_fraction, (int, float))
                                              or not 0 < max_snapshot_fraction <= 1):
        raise ValueError("max_snapshot_fraction takes a share of available host memory between 0 and 1 (or None "
                         f"for no limit), got {max_snapshot_fraction!r}")  # the magic checks --max-snapshot itself
    if on_cell_error is not None and not callable(on_cell_error):
        raise TypeError(f"on_cell_error takes a function (exc, where) or None, got a {type(on_cell_error).__name__}")
    # was "'int' object is not callable" from deep inside, after the first fp32 run (a trial)
    if on_first_run is not None and not callable(on_first_run):
        raise TypeError(f"on_first_run takes a function (seconds, runs_left[, restore_seconds]) or None, got "
                        f"{type(on_first_run).__name__} {on_first_run!r}")


def _check_snapshot_size(namespace, state, skip, fraction) -> None:
    if fraction is None:
        return
    available = available_host_memory()
    if available is None:
        return
    needed = estimate_bytes(namespace, state, skip)
    if needed > fraction * available:
        largest = _largest_in_snapshot(namespace, skip)
        raise SnapshotTooLarge(
            f"restoring the state before each run needs a {format_bytes(needed)} host copy, more than "
            f"{format_bytes(int(fraction * available))} ({fraction:.2g} of the {format_bytes(available)} of memory "
            f"available){'. ' + largest if largest else ''}. Free memory first"
            f"{' (`del` what the cell does not need)' if largest else ''}, run without restoring "
            f"({option('no_restore', True) if in_magic() else 'restore=False'}: each run continues from the previous "
            "one's state), or raise the limit "
            f"({option('max_snapshot', 0.9) if in_magic() else 'max_snapshot_fraction=0.9'})")


def _largest_in_snapshot(namespace, skip) -> str:
    """The names the snapshot copies most of, for its refusal: the whole namespace is copied, so a
    dataset the cell never reads can be what is too large, and ``del`` of it is the fix."""
    if namespace is None:
        return ""
    holders = [h for h in namespace_holders(namespace, top=3, skip=skip) if h.nbytes]
    if not holders:
        return ""
    names = ", ".join(f"{h.name} ({format_bytes(h.nbytes)} {h.kind})" for h in holders)
    return f"The largest copies (every tensor in the namespace is copied, whatever the cell reads): {names}"


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


# AmpResult, its constants and advice live in amp_result / amp_advice; named here as well because a
# comparison's user meets them together.
__all__ = ["compare_amp", "planned_runs", "memory_runs", "CPU_MEMORY_RUNS", "AmpResult",
           "Variant", "advise", "MIN_RUNS", "MEMORY_NOISE_FLOOR", "MEMORY_SAME"]
