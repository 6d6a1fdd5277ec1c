"""Measurements shared by ``bench_amp`` and the reference suite.

* `amp_variants` runs `nbaccel.compare_amp` (what ``%%amp`` runs) per precision variant.
* `timer_stats` times the same closure under the same recipe with
  ``torch.utils.benchmark.Timer``: the statement enters the recipe (``with recipe_ctx(): fn()``),
  the setup restores the same host snapshot that compare_amp restores, one run per sample
  (``timeit(number=1)``, which runs the statement twice untimed before each timed run), with the
  same repeat count and all of torch's threads
  (Timer defaults to one thread; compare_amp uses whatever torch is set to).
* `harness_overhead`, `comparison_cost` and `snapshot_cost` measure nbaccel itself.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time

import torch
from torch.utils.benchmark import Timer

import nbaccel
from nbaccel.amp import memory_runs, planned_runs
from nbaccel.analysis.peaks import lookup_gpu, peak_flops
from nbaccel.device import device_info
from nbaccel.precision import Recipe, apply_recipe, make_recipe
from nbaccel.snapshot import Snapshot
from nbaccel.timing import Clock

AGREEMENT_TOLERANCE = 0.10  # %%amp and Timer medians must agree within 10 %


def variants_for(device: torch.device) -> list[str]:
    """fp32 (strict), tf32 (CUDA sm80+ only), bf16 and fp16 autocast where the device can."""
    info = device_info(device)
    names = ["fp32"]
    if info.supports_tf32:
        names.append("tf32")
    if info.supports_bf16:
        names.append("bf16")
    if info.supports_fp16:
        names.append("fp16")
    return names


def recipe_for(name: str, device: torch.device) -> Recipe:
    """The recipe compare_amp applies for a variant: "fp32" strict, "tf32" alone, or autocast."""
    return make_recipe(name, device)


def amp_variants(workload, device, names, warmup, repeat) -> dict:
    """{variant name: nbaccel Variant} from compare_amp: fp32 is the baseline of the first call,
    each other variant is measured by compare_amp as the recipe side (interleaved with fp32 for
    the first one; the rest with ``baseline=False`` to save time)."""
    out = {}
    first = True
    for name in names:
        if name == "fp32":
            continue
        result = nbaccel.compare_amp(workload.fn, dtype=name, device=device, warmup=warmup, repeat=repeat,
                                     baseline=first, state=workload.state, show_output=_quiet)
        if first:
            out["fp32"] = result.baseline
            first = False
        out[name] = result.amp
    if not out and "fp32" in names:  # a device with no reduced precision at all
        raise RuntimeError(f"{device}: no autocast dtype to compare against")
    return out


def _quiet():
    import contextlib
    import io
    return contextlib.redirect_stdout(io.StringIO())


def _timer(workload, recipe: Recipe, snapshot: Snapshot, threads: int | None) -> Timer:
    return Timer(
        stmt="with recipe_ctx():\n    fn()",
        setup="snapshot.restore()",
        globals={"fn": workload.fn, "recipe_ctx": functools.partial(apply_recipe, recipe), "snapshot": snapshot},
        num_threads=threads or torch.get_num_threads(),
        label=workload.name, description=recipe.label,
    )


def timer_stats(workload, recipe: Recipe, warmup: int, repeat: int, threads: int | None = None) -> list[float]:
    """Per-run times (s) of ``workload.fn`` under ``recipe`` from torch.utils.benchmark.Timer."""
    return timer_stats_interleaved(workload, {"only": recipe}, repeat, threads)["only"]


def timer_stats_interleaved(workload, recipes: dict, repeat: int, threads: int | None = None) -> dict:
    """{name: per-run times} from torch.utils.benchmark.Timer, one sample per recipe per round,
    the order alternating each round -- the same interleaving compare_amp uses, so both timers
    see the same sequence of kernels (on CPUs with AMX, switching between AVX-512 fp32 and AMX
    bf16 code has a cost that a back-to-back Timer run would not pay)."""
    snapshot = Snapshot.capture(objects=workload.state)
    try:
        timers = {name: _timer(workload, recipe, snapshot, threads) for name, recipe in recipes.items()}
        samples = {name: [] for name in recipes}
        names = list(recipes)
        for i in range(repeat):
            for name in (names if i % 2 == 0 else names[::-1]):
                # timeit(number=1) first runs the statement twice untimed (with setup), so every
                # sample is warmed up.
                samples[name].append(timers[name].timeit(number=1).median)
        return samples
    finally:
        snapshot.restore()


def agreement(amp_median: float, timer_median: float) -> dict:
    ratio = amp_median / timer_median if timer_median > 0 else float("nan")
    return {"ratio": ratio, "pass": abs(ratio - 1.0) <= AGREEMENT_TOLERANCE}


def device_peak(device: torch.device, variant: str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of the device for a variant, and where it came from (or why there is none)."""
    info = device_info(device)
    if info.type != "cuda":
        return None, "peak unknown (CPU: no peak table for CPUs)"
    gpu = lookup_gpu(info.name, info.compute_capability, info.total_memory)
    if gpu is None:
        return None, f"peak unknown ({info.name} is not in nbaccel/data/gpu_peaks.csv)"
    peak = peak_flops(gpu, variant)
    if peak is None:
        return None, f"peak unknown ({gpu.gpu} has no {variant} figure)"
    return peak, f"{gpu.gpu} dense {variant} peak, {gpu.source}"


@contextlib.contextmanager
def torch_threads(threads: int | None, size: str, device: torch.device):
    """Set torch's CPU threads for a run and restore them. Default: as set, except ``small`` on
    the CPU, which uses 1 -- a smoke test, and on a shared CI machine multi-threaded OpenMP
    kernels stall by 10-100x whenever another process holds a core."""
    if threads is None and size == "small" and device.type == "cpu":
        threads = 1
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def median(xs) -> float:
    return statistics.median(xs)


# --- nbaccel's own costs ----------------------------------------------------------------------

class _TapClock(Clock):
    """compare_amp's own clock, plus the wall-clock instant each timed run's measurement began."""

    def __init__(self, device):
        super().__init__(device)
        self.starts: list[float] = []
        self.measured: list[float] = []

    def measure(self, fn):
        self.starts.append(time.perf_counter())
        seconds, value = super().measure(fn)
        self.measured.append(seconds)
        return seconds, value


def harness_overhead(device: torch.device, state=(), repeat: int = 50) -> dict:
    """Wall-clock cost of one compare_amp timed run beyond the run itself.

    compare_amp is given a clock that also notes when each timed run's measurement starts. The
    gap between two consecutive starts is the full wall clock of one timed run -- snapshot
    restore, recipe enter/exit, device sync, the clock, the run -- and the run's own measured time
    is subtracted. Median over ``2 * repeat - 1`` gaps.
    """
    trivial = (lambda: None) if not state else (lambda: state[0])
    clock = _TapClock(device)
    nbaccel.compare_amp(trivial, dtype="auto", device=device, warmup=0, repeat=repeat,
                        state=list(state) or [None], clock=clock)
    gaps = [b - a - m for a, b, m in zip(clock.starts, clock.starts[1:], clock.measured)]
    return {"overhead_s": statistics.median(gaps), "overhead_p90_s": sorted(gaps)[int(0.9 * (len(gaps) - 1))],
            "measured_run_s": statistics.median(clock.measured),
            "state_bytes": Snapshot.capture(objects=list(state)).nbytes if state else 0,
            "method": f"gap between consecutive timed runs' clock starts minus the run's measured time, "
                      f"median of {len(gaps)} gaps"}


def comparison_cost(device: torch.device, trials: int = 5) -> dict:
    """Wall clock of one whole comparison of a trivial cell, beside one full ``gc.collect()`` in the
    same process: each CPU memory run starts with a collection, and a full one walks every object the
    process tracks; since `nbaccel.memory.meter_series` a comparison pays one full collection, not one
    per memory run. Medians of ``trials``."""
    wholes, collects = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        nbaccel.compare_amp(lambda: None, dtype="auto", device=device, warmup=0, repeat=3, state=[None])
        wholes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gc.collect()
        collects.append(time.perf_counter() - t0)
    return {"comparison_s": statistics.median(wholes), "runs": planned_runs(0, 3, device=device),
            "memory_runs": 2 * memory_runs(device), "gc_collect_s": statistics.median(collects),
            "objects_tracked": len(gc.get_objects()),
            "method": f"compare_amp(lambda: None, warmup=0, repeat=3) wall clock and gc.collect() alone, "
                      f"median of {trials} each, alternating"}


def _model_of(nbytes: int, device) -> torch.nn.Module:
    """An MLP whose parameters (plus gradients of the same size) total about ``nbytes``."""
    width = 256
    layers = max(1, round(nbytes / 2 / 4 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    model(torch.randn(4, width, device=device)).sum().backward()  # gradients exist, as after a step
    return model


def snapshot_cost(device: torch.device, sizes_mb=(1, 16, 64), trials: int = 5) -> list[dict]:
    """Host snapshot capture and restore time for models of a few sizes (parameters + gradients)."""
    rows = []
    for mb in sizes_mb:
        model = _model_of(int(mb * 2**20), device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        caps, rests, snap = [], [], None
        for _ in range(trials):
            t0 = time.perf_counter()
            snap = Snapshot.capture(objects=[model, opt])
            caps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snap.restore()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rests.append(time.perf_counter() - t0)
        size = snap.nbytes / 2**20
        cap, rest = statistics.median(caps), statistics.median(rests)
        rows.append({"state_mib": size, "capture_s": cap, "restore_s": rest,
                     "capture_ms_per_mib": cap * 1e3 / size, "restore_ms_per_mib": rest * 1e3 / size})
        del model, opt, snap
    return rows
