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

Every run starts with ``snapshot.restore()``. If any run raises (or is interrupted), the snapshot
is restored -- the state from before the call -- and the exception propagates unchanged.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from .device import DTYPE_NAMES, DeviceInfo, device_info, resolve_device
from .flops import OpAudit, precision_summary
from .memory import PeakMemory, PeakMeter, format_bytes
from .precision import FP32, Recipe, apply_recipe, describe, make_recipe
from .results import ResultMixin
from .snapshot import Snapshot, SnapshotTooLarge, available_host_memory, estimate_bytes
from .timing import Clock, Stats, format_seconds, speedup_is_uncertain

if TYPE_CHECKING:
    import pandas as pd


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
    nonfinite_result: bool = False  # the cell's value is inf/NaN under the recipe but finite in fp32
    value: object = field(default=None, repr=False)  # the kept run's value (not serialized)

    @property
    def speedup(self) -> float | None:
        """fp32 median time / amp median time (>1 means mixed precision is faster)."""
        if self.baseline is None or self.amp.median <= 0:
            return None
        return self.baseline.median / self.amp.median

    @property
    def speedup_uncertain(self) -> bool:
        return self.baseline is not None and speedup_is_uncertain(self.baseline.times, self.amp.times)

    @property
    def memory_saving(self) -> float | None:
        """Fraction of the fp32 peak that the recipe saved (0.3 = 30 % less; negative = more)."""
        if self.baseline is None or not self.baseline.memory or not self.amp.memory:
            return None
        base = self.baseline.memory.peak_bytes
        return (base - self.amp.memory.peak_bytes) / base if base > 0 else None

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
                             "the machine is noisy, use more --repeat")
        if self.speedup_uncertain:
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
            "nonfinite_result": self.nonfinite_result,
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


def _to_host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64) if value.is_floating_point() else value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value) if not hasattr(value, "_fields") else tuple(_to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar
        return float(value)
    return value


def _leaves(value, prefix="value"):
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{prefix}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}[{k!r}]")
    else:
        yield prefix, value


def _nonfinite(value) -> bool:
    """Whether any float leaf of a (host) value is inf or NaN."""
    for _, leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all():
            return True
        if isinstance(leaf, float) and not math.isfinite(leaf):
            return True
    return False


def compute_drift(base, amp) -> dict | None:
    """Max abs / relative error between the two variants' results, per tensor or number leaf."""
    base, amp = _to_host(base), _to_host(amp)
    leaves = []
    for (path, b), (_, a) in zip(_leaves(base), _leaves(amp)):
        if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and b.shape == a.shape and b.is_floating_point():
            if b.numel() == 0:
                continue
            diff = (a.double() - b.double()).abs()
            scale = b.double().abs().max().item()
            leaves.append({"name": path, "shape": list(b.shape), "max_abs": diff.max().item(),
                           "max_rel": diff.max().item() / scale if scale else math.inf if diff.max() else 0.0,
                           "base": b.item() if b.numel() == 1 else None, "amp": a.item() if a.numel() == 1 else None})
        elif isinstance(b, (int, float)) and isinstance(a, (int, float)) and not isinstance(b, bool):
            d = abs(float(a) - float(b))
            leaves.append({"name": path, "shape": [], "max_abs": d, "max_rel": d / abs(b) if b else (math.inf if d else 0.0),
                           "base": float(b), "amp": float(a)})
    if not leaves:
        return None
    worst = max(leaves, key=lambda leaf: leaf["max_rel"])
    return {"leaves": leaves, "max_abs": max(leaf["max_abs"] for leaf in leaves), "max_rel": worst["max_rel"]}


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


class _Runner:
    """Runs the code under one recipe from the snapshot; the small engine behind compare_amp."""

    def __init__(self, fn, snapshot: Snapshot, clock: Clock, device: torch.device, silence):
        self.fn, self.snapshot, self.clock, self.device, self.silence = fn, snapshot, clock, device, silence

    def timed(self, recipe: Recipe) -> float:
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.snapshot.restore()
        with self.silence(), apply_recipe(recipe):
            seconds, _ = self.clock.measure(self.fn)
        return seconds

    def memory(self, recipe: Recipe) -> PeakMemory:
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.snapshot.restore()
        with self.silence(), apply_recipe(recipe), PeakMeter(self.device) as meter:
            self.fn()
        return meter.result

    def audited(self, recipe: Recipe):
        __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
        self.snapshot.restore()
        probe = _GradientProbe(c.tensor for c in self.snapshot.tensors)
        audit = OpAudit()
        scales_before = _scaler_scales(self.snapshot)
        with self.silence(), apply_recipe(recipe), probe, audit, _ScalerUse() as scaler_use:
            value = self.fn()
        value = _to_host(value)
        scales_after = _scaler_scales(self.snapshot)
        scaler_info = {
            "grad_scaler": scaler_use.calls > 0,
            # GradScaler halves its scale when it finds inf/NaN gradients and skips that optimizer step.
            "scaler_skipped_step": any(a < b for a, b in zip(scales_after, scales_before)) if scales_before else None,
        }
        return audit, probe, value, scaler_info


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
) -> AmpResult:
    """Time ``fn`` in strict fp32 and under autocast (+TF32 on CUDA) from the same starting state.

    ``dtype``: ``bf16|fp16|auto``, or ``"tf32"`` for TF32 alone (no autocast; CUDA sm80+ only).

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
    Returns an `AmpResult`; the kept run's return value is ``result.value``.
    Under torchrun it measures the calling rank only; `nbaccel.distributed.compare_amp` (or
    ``gather_amp(result)``) gathers every rank's result (min/median/max, slowest rank).
    """
    __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
    if not callable(fn):
        raise TypeError(f"compare_amp runs a function several times; got a {type(fn).__name__} (the result of "
                        "calling it?): pass the function itself, e.g. compare_amp(train_step) or "
                        "compare_amp(lambda: train_step(batch))")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}; use at least 3 for a spread")
    dev = resolve_device(device)
    info = device_info(dev)
    amp_recipe = make_recipe(dtype, dev, tf32=tf32)
    base_recipe = make_recipe(FP32, dev)
    if namespace is None and not state:
        state = _referenced_objects(fn)
    if not restore:
        snapshot = Snapshot(namespace=None, skip=skip)
    else:
        _check_snapshot_size(namespace, state, skip, max_snapshot_fraction)
        snapshot = Snapshot.capture(namespace, objects=state, skip=skip)
    clock = clock or Clock(dev)
    runner = _Runner(fn, snapshot, clock, dev, silence or _redirect)
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
        snapshot.restore()
        with (show_output or contextlib.nullcontext)(), apply_recipe(amp_recipe):
            value = fn()
        finished = True
    finally:
        if not finished:
            snapshot.restore()

    def variant(name, recipe):
        audit = audits[id(recipe)][0]
        return Variant(name, recipe, times[id(recipe)], memory[id(recipe)], audit.table(), audit.total_flops)

    amp_variant = variant(DTYPE_NAMES.get(amp_recipe.autocast_dtype, "tf32"), amp_recipe)
    base_variant = variant("fp32", base_recipe) if baseline else None
    amp_audit, amp_probe, amp_value, scaler_info = audits[id(amp_recipe)]
    base_probe = audits[id(base_recipe)][1] if baseline else None
    return AmpResult(
        device=info,
        amp=amp_variant,
        baseline=base_variant,
        warmup=warmup,
        repeat=repeat,
        timer_method=clock.method,
        drift=compute_drift(audits[id(base_recipe)][2], amp_value) if baseline else None,
        gradients=_gradient_report(base_probe, amp_probe, amp_recipe, scaler_info),
        unaligned_matmuls=amp_audit.unaligned_matmuls(),
        snapshot_bytes=snapshot.nbytes,
        restored=restore,
        nonfinite_result=baseline and _nonfinite(amp_value) and not _nonfinite(audits[id(base_recipe)][2]),
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
            f"{fraction:.0%} of the {format_bytes(available)} of memory available; run without restoring "
            "(--no-restore: each run continues from the previous one's state), raise the limit "
            "(--max-snapshot 0.9), or free memory first")


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


def advise(result: AmpResult) -> list[str]:
    """One line per finding, each backed by a number in the result."""
    notes = []
    info, speedup = result.device, result.speedup
    dtype = result.amp.name
    autocast = result.amp.recipe.autocast_dtype is not None  # False for the TF32-only recipe
    label = f"{dtype} autocast" if autocast else dtype.upper()
    if result.nonfinite_result:
        limit = f" (fp16's largest value is {torch.finfo(torch.float16).max:.0f})" if dtype == "fp16" else ""
        notes.append(f"The result is inf/NaN under {dtype} but finite in fp32: the forward pass overflowed{limit}. "
                     "GradScaler cannot fix this; use bf16, or keep the overflowing op in fp32 "
                     "(torch.autocast(..., enabled=False)).")
    if result.amp.ops.empty:
        notes.append("The cell ran no torch operators, so autocast had nothing to change: %%amp compares "
                     "torch code (the times are of plain Python).")
        speedup = None  # a "speedup" of plain Python is noise; say nothing more about it
    if result.nonfinite_result:
        speedup = None  # a wrong answer faster is not a finding: the overflow note above is the advice
    if speedup is not None:
        if speedup < 1.05:
            if info.type == "cpu" and not (info.has_bf16_units if dtype == "bf16" else info.has_fp16_units):
                notes.append(f"No speedup ({speedup:.2f}x): this CPU lacks {dtype} units (AMX / AVX512-{dtype.upper()}), "
                             "so autocast only adds casts. Measure on a GPU with Tensor Cores.")
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
    if result.drift and result.drift["max_rel"] > 0.05:
        notes.append(f"The result moved by {result.drift['max_rel']:.1%} (relative) under {dtype}; check that "
                     "this accuracy is acceptable (e.g. keep loss/softmax in fp32).")
    mem = result.memory_saving
    if mem is not None and result.baseline and result.baseline.memory.peak_bytes > 1 << 20:
        if mem > 0.05:
            notes.append(f"Peak memory {mem:.0%} lower ({format_bytes(result.baseline.memory.peak_bytes)} -> "
                         f"{format_bytes(result.amp.memory.peak_bytes)}).")
        elif mem < -0.05 and autocast:
            notes.append(f"Peak memory {-mem:.0%} higher under {dtype}: autocast keeps casted copies of fp32 weights "
                         "for the backward pass.")
    if info.type == "cpu":
        notes.append(describe(info) + ". These are CPU figures, not GPU ones.")
    return notes


__all__ = ["compare_amp", "AmpResult", "Variant", "compute_drift", "format_seconds"]
