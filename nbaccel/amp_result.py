"""`AmpResult`: fp32 against mixed precision for one piece of code -- raw numbers in, everything
else derived (speedup, memory saving, noise warnings, advice). Made by `nbaccel.compare_amp`."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_map

from .contention import MIN_OTHERS_CORES, Contention, warning_line
from .device import DeviceInfo
from .flops import precision_summary
from .memory import PeakMemory, byte_range
from .options import option
from .precision import Recipe
from .results import ResultMixin
from .timing import Stats, format_ratio, speedup_is_uncertain

if TYPE_CHECKING:
    import pandas as pd


MIN_RUNS = 3  # timed runs per variant below which a speedup is marked uncertain (no spread to judge)
MEMORY_NOISE_FLOOR = 1 << 20  # fp32 peak below which a memory saving is not reported (allocator noise)
# A change of the peak smaller than this share reads as "the same": 3.99 MiB -> 4 MiB printed "+0%".
MEMORY_SAME = 0.005
REDUCED_DTYPES = ("bf16", "fp16")
NO_SPEEDUP_BELOW = 1.05  # a measured ratio under this is reported as no speedup
# A ratio this many times what other programs' measured load could cause (`AmpResult.beyond_contention`) is
# the variants' own, contention or not: 1.5 leaves room for load that came in bursts.
BEYOND_CONTENTION = 1.5
# A variant whose IQR is over half its median: the ranking may hold (the IQRs apart), the size does not
# (a trial under load read a firm "34.79x" from 3 runs whose IQR was 2511% of the median).
WIDE_SPREAD = 0.5


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
            "emulated": self.recipe.emulated,  # fp16 without the CPU's units: the times are not fp16's speed
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
    # Token agreement of the result's token ids (a generate loop's output; `drift.compare_tokens`), which
    # have no relative error: None where the result holds none.
    tokens: dict | None = None
    gradients: dict | None = None
    unaligned_matmuls: list = field(default_factory=list)
    snapshot_bytes: int = 0
    # seconds each restore of the snapshot took, before each run, in order (perf_counter): time the runs'
    # figures leave out; empty without a snapshot (restore=False) or for a result made by hand
    restore_times: list[float] = field(default_factory=list)
    restored: bool = True  # False: --no-restore, runs continued from each other's state
    # Two runs under the recipe from the restored state gave different values: the code depends on
    # state the snapshot does not restore (an attribute of your own object, a file...).
    state_changed: bool = False
    # The audited run under the recipe returned other dtypes than the kept run: an op ran otherwise under
    # the op audit (a TorchDispatchMode), so the per-op dtypes and FLOPs describe the audited run only;
    # the drift is the kept run's.
    audit_differs: bool = False
    # What the snapshot could not copy, so no run put it back, each with why: ["`bad` (never copied:
    # RuntimeError: ...)"] (`Snapshot.left_out`).
    not_copied: list[str] = field(default_factory=list)
    nonfinite_result: bool = False  # the cell's value has inf/NaN under the recipe where fp32's is finite
    drift_skipped: str | None = None  # why there is no drift although both variants ran (nbaccel's failure)
    # Autocast already on around the call ({device type: dtype}): the recipes overrode it (see advise).
    outer_autocast: dict = field(default_factory=dict)
    # Other programs' CPU use during the timed runs, per variant (None: made by hand, not measured).
    contention: Contention | None = None
    under_profiler: bool = False  # a torch profiler was recording the runs (its overhead is in the times)
    # The iterators the cell reads, described ("`it` (a generator)"): no snapshot rewinds them, so each
    # run took its own items (`nbaccel.cell_reads`).
    iterators: list[str] = field(default_factory=list)
    # The torch.compile'd models and functions it reads: the audit's dtypes, FLOPs and drift are eager's.
    compiled: list[str] = field(default_factory=list)
    # Graphs torch.compile compiled during the timed runs (`cell_reads.graphs_compiled`): those runs'
    # times include compiling, seconds where a compiled step takes milliseconds.
    compiled_while_timed: int = 0
    # DataLoaders it reads that start worker processes on every iteration: "`loader` (2 workers)".
    worker_loaders: list[str] = field(default_factory=list)
    # Optimizers it reads that had no state as it began, with the bytes of the state each run's step created
    # (restored stateless before every run): [("opt", "AdamW", 1048576)].
    optimizer_state_created: list[tuple[str, str, int]] = field(default_factory=list)
    # The user's settings that run fp32 math below IEEE fp32 (`precision.relaxed_fp32_settings`, as
    # code): the recipes did not use them (the fp32 run is strict), and the method line says so.
    fp32_overridden: list[str] = field(default_factory=list)
    # The same settings made by the cell itself, read as its fp32 run ended: that run's fp32 math was as they
    # ask, not strict (a trial's step began with torch.set_float32_matmul_precision("medium")).
    fp32_relaxed_by_cell: list[str] = field(default_factory=list)
    made_by: str = "compare_amp()"  # or "%%amp": what the header names (a script's report said "%%amp")
    value: object = field(default=None, repr=False)  # the kept run's value (not serialized)

    def __getattr__(self, name):
        # Only for names the class lacks. A new user reached for `res.ops`, as on a profile, and got a
        # bare AttributeError: each variant has its own op table.
        if name in ("ops", "flops", "times", "median", "memory"):
            raise AttributeError(f"an AmpResult has no {name!r}: each variant has its own -- "
                                 f"res.amp.{name} (the recipe) and res.baseline.{name} (fp32)")
        on_class = getattr(type(self), name, None)
        if isinstance(on_class, property):
            # Python comes here when a property's own code raised AttributeError: run it again so that
            # error (the real one, deep inside) is what the user sees, not "no attribute 'speedup'".
            return on_class.fget(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        return self.baseline is not None and (too_few_runs(self)
                                              or speedup_is_uncertain(self.baseline.times, self.amp.times))

    @property
    def spread_too_wide(self) -> list[str]:
        """The variants whose runs spread past `WIDE_SPREAD` (IQR / median), with enough runs to say so:
        their ratio is shown hedged, to two significant digits, whether or not the IQRs overlap."""
        if self.baseline is None or too_few_runs(self):
            return []
        return [v.name for v in (self.baseline, self.amp) if v.times.relative_spread > WIDE_SPREAD]

    @property
    def speedup_flags(self) -> list[str]:
        """What qualifies the measured speedup, as the headline says it: its variants' IQRs overlap (with the
        span they allow), a variant's runs spread past half its median (`spread_too_wide`), other programs took
        the CPU (`times_contended`), its reduced precision was emulated (``--emulated``: fp16 on a CPU without
        its units). Empty for a firm figure."""
        span = self.speedup_span
        uncertain = ("uncertain: " + "-".join(format_ratio(r, firm=False) for r in span) + " across the IQRs"
                     if span else "uncertain")
        wide = self.spread_too_wide
        noisy = "noisy: " + ", ".join(f"{v.name}'s IQR {v.times.relative_spread:.0%} of its median"
                                      for v in (self.baseline, self.amp) if v and v.name in wide)
        emulated = f"{self.amp.name} emulated: not its speed on fp16 hardware"
        return [w for w, on in ((uncertain, self.speedup_uncertain), (noisy, wide and not self.speedup_uncertain),
                                ("contended", self.times_contended), (emulated, self.amp.recipe.emulated)) if on]

    @property
    def speedup_firm(self) -> bool:
        """Whether the speedup can be read as the recipe's: claimed (`speedup_claimed`) and nothing qualifies
        it (`speedup_flags`). A trial's notebook printed ``speedup_uncertain`` False beside advice to re-run: the
        IQRs were apart, but other programs had taken a core."""
        return self.speedup_claimed and not self.speedup_flags

    @property
    def speedup_span(self) -> tuple[float, float] | None:
        """Where the ratio could lie on a re-run when the IQRs overlap (`speedup_uncertain` with enough runs):
        fp32's first quartile over the recipe's third, to fp32's third over the recipe's first. Overlapping
        IQRs put 1x inside it, which is the point: a trial read "speedup 17.78x (uncertain, contended)" as a
        figure good to two decimals."""
        if not self.speedup_uncertain or too_few_runs(self) or self.amp.times.q1 <= 0 or self.amp.times.q3 <= 0:
            return None
        base, amp = self.baseline.times, self.amp.times
        return base.q1 / amp.q3, base.q3 / amp.q1

    @property
    def memory_saving(self) -> float | None:
        """Fraction of the fp32 peak that the recipe saved (0.3 = 30 % less; negative = more), from the
        median peaks as measured, whatever the size: see `memory_firm` before reading much into it."""
        if self.baseline is None or not self.baseline.memory or not self.amp.memory:
            return None
        base = self.baseline.memory.peak_bytes
        return (base - self.amp.memory.peak_bytes) / base if base > 0 else None

    @property
    def memory_comparable(self) -> bool:
        """Whether the fp32 peak is large enough (``MEMORY_NOISE_FLOOR``, 1 MiB) for the saving to
        mean something: below it, figures are allocator noise (the CPU's RSS), or a few scalars and
        casts where a share of them means little."""
        return (self.memory_saving is not None and self.baseline.memory.peak_bytes >= MEMORY_NOISE_FLOOR)

    @property
    def memory_firm(self) -> bool:
        """Whether the measurement backs a memory difference: the peaks are `memory_comparable`, and a
        re-run would not reorder them -- on CUDA, whose allocator counts repeat exactly from run to run,
        always; for torch's CPU allocator (`PeakMemory.exact`), when every run of a variant counted the
        same; else (the process's RSS, which moves by a few MiB between runs) only when the ranges of the
        variants' memory runs (`nbaccel.amp.CPU_MEMORY_RUNS` each) do not overlap."""
        if not self.memory_comparable:
            return False
        base, amp = self.baseline.memory.run_peaks, self.amp.memory.run_peaks
        if self.baseline.memory.device.startswith("cuda"):
            return True
        if self.baseline.memory.exact and self.amp.memory.exact and len(set(base)) == len(set(amp)) == 1:
            return True
        return min(len(base), len(amp)) > 1 and (max(base) < min(amp) or max(amp) < min(base))

    @property
    def memory_same(self) -> bool:
        """A firm comparison whose medians differ by less than `MEMORY_SAME` (0.5 %): no change to report."""
        return self.memory_firm and abs(self.memory_saving) < MEMORY_SAME

    @property
    def baseline_reduced(self) -> list[str]:
        """The reduced dtypes ("bf16", "fp16") matmuls or convolutions ran in during the fp32 run: the cell
        turns on autocast or casts to them itself, so that run was not fp32 and the speedup, memory and
        drift compare the recipe with the cell's own precision. Empty when the fp32 run was fp32."""
        if self.baseline is None or self.baseline.ops.empty:
            return []
        ops = self.baseline.ops
        return sorted(set(ops[ops["heavy"] & ops["dtype"].isin(REDUCED_DTYPES)]["dtype"]))

    @property
    def nothing_cast(self) -> bool:
        """Torch operators ran under an autocast recipe, yet the recipe changed none of their math: none
        ran in reduced precision, and no heavy fp32 op ran where the recipe also switches TF32 or
        cudnn.benchmark on (CUDA: those speed up fp32 matmuls and convolutions by themselves). Both
        variants then ran the same kernels, so their times say nothing about the recipe (a user trial
        read "speedup 6.48x" on a cell of means and concatenations)."""
        recipe = self.amp.recipe
        if (recipe.autocast_dtype is None or self.amp.ops.empty or self.reduced_by_recipe or self.baseline_reduced
                or self.audit_differs):  # the audit did not see what the timed runs did
            return False  # (a cell running its own autocast has a flag of its own: `baseline_reduced`)
        return not ((recipe.tf32 or recipe.cudnn_benchmark) and self.precision["heavy_fp32"])

    @property
    def speedup_claimed(self) -> bool:
        """Whether the report states ``speedup`` as the recipe's: not with fewer than `MIN_RUNS` timed runs,
        where the recipe changed nothing (`nothing_cast`), where the fp32 run was not fp32
        (`baseline_reduced`) or where no torch op ran. ``speedup`` keeps the measured ratio either way;
        a table of results (`results_frame`) has both."""
        return (self.speedup is not None and not too_few_runs(self) and not self.nothing_cast
                and not self.baseline_reduced and not self.amp.ops.empty)

    @property
    def reduced_by_recipe(self) -> list[str]:
        """The ops that ran in reduced precision under the recipe but not in the fp32 run ("op (dtype)"):
        what the recipe changed. A cell that makes bf16 tensors itself (``x.to(torch.bfloat16)``) runs
        those ops in bf16 in both variants; a user trial was told "bf16 autocast is 1.80x faster" there."""
        def reduced(ops) -> set:
            if ops is None or ops.empty:
                return set()
            rows = ops[ops["dtype"].isin(REDUCED_DTYPES)]
            return set(zip(rows["op"], rows["dtype"]))

        base = reduced(self.baseline.ops) if self.baseline is not None else set()
        return sorted(f"{op} ({dtype})" for op, dtype in reduced(self.amp.ops) - base)

    @property
    def nothing_cast_words(self) -> str:
        """Why `nothing_cast`, in words: "no op ran in bf16", or that the bf16 ops ran in the fp32 run too."""
        name = self.amp.name
        if self.precision["reduced"]:
            return f"the recipe cast no op: the {name} ops ran in {name} in the fp32 run too"
        return f"no op ran in {name}"

    @property
    def speedup_from_noise(self) -> bool:
        """A speedup (at least `NO_SPEEDUP_BELOW`) measured where `nothing_cast`: run-to-run variation."""
        return self.nothing_cast and self.speedup is not None and self.speedup >= NO_SPEEDUP_BELOW

    @property
    def heavy_fp32_calls(self) -> list[str]:
        """The heavy ops that stayed fp32 under the recipe, each with its share of the op's calls where the
        op also ran in reduced precision ("aten::bmm (4 of 12 calls)"): the same name in both lists read as
        a contradiction (a user trial)."""
        ops = self.amp.ops
        out = []
        for op in self.precision["heavy_fp32"]:
            calls = ops[ops["op"] == op]
            fp32 = int(calls[calls["dtype"] == "fp32"]["calls"].sum())
            total = int(calls["calls"].sum())
            out.append(op if fp32 == total else f"{op} ({fp32} of {total} calls)")
        return out

    @property
    def precision(self) -> dict:
        return precision_summary(self.amp.ops)

    @property
    def advice(self) -> list[str]:
        from .amp_advice import advise  # the rules read this class: imported on use, not in a cycle

        with self._spelling():  # options as the maker took them: --repeat for %%amp's result
            return advise(self)

    @property
    def noise_warnings(self) -> list[str]:
        with self._spelling():
            return self._noise_warnings()

    def _noise_warnings(self) -> list[str]:
        notes = []
        # A trial read "other programs used 0.0 of the 2 CPU cores" beside an IQR of 100% as reassurance:
        # when the meter saw (almost) nobody else, the noise is said to come from somewhere it cannot see.
        others = self.contention.others_cores() if self.contention is not None else None
        idle = others is not None and others < MIN_OTHERS_CORES / 2
        unseen = (" (other programs on this machine used almost no CPU meanwhile: the variation is the "
                  "cell's own, or comes from what /proc/stat cannot see -- a VM's host, CPU frequency changes)"
                  if idle else "")
        for v in filter(None, (self.baseline, self.amp)):
            if v.times.noisy:
                notes.append(f"{v.name}: the IQR is {v.times.relative_spread:.0%} of the median; "
                             f"the machine is noisy, use a larger {option('repeat')}{unseen}")
        if too_few_runs(self):
            runs = min(len(self.baseline.times.times), len(self.amp.times.times))
            notes.append(f"only {runs} timed run{'s' if runs != 1 else ''} per variant: too few for a spread, the "
                         f"speedup is uncertain; use {option('repeat', 5)} or more")
        elif self.speedup_uncertain:
            notes.append("the two variants' IQRs overlap: the speedup could flip on a re-run")
        contended = self.contention_warning
        if contended:
            notes.append(contended)
        if self.under_profiler:
            notes.append("a torch profiler was recording during these runs (a profile around the comparison): its "
                         "per-op cost is in every time, more in the variant that runs more ops (the casts); compare "
                         "outside the profile, and profile one variant with "
                         + ("%%profile_gpu --amp" if self.made_by == "%%amp" else "nbaccel.profile(amp=...)"))
        return notes

    @property
    def beyond_contention(self) -> bool:
        """Whether the variants' ratio is more than other programs' measured load could make it: the
        slower variant's time is over `BEYOND_CONTENTION` times the most that load could slow it
        (`Contention.slowdown_bound`). A trial: fp16 20x slower than fp32 (a CPU without AMX-FP16)
        while others took one of the two cores was hedged as "re-run when the machine is quiet"."""
        speedup = self.speedup
        if not speedup or self.contention is None or self.speedup_uncertain or self.spread_too_wide:
            return False
        slower = "fp32" if speedup > 1 else self.amp.name
        bound = self.contention.slowdown_bound(slower)
        return bound is not None and max(speedup, 1 / speedup) > BEYOND_CONTENTION * bound

    @property
    def times_contended(self) -> bool:
        """Other programs' load may have moved the ratio: a contention warning, and a ratio it can explain.
        What hedges the verdict and marks the headline "(contended)" (a review: a 4x speedup beyond the load
        was still hedged, its warning saying the load could not cause it)."""
        return self.contention_warning is not None and not self.beyond_contention

    @property
    def contention_warning(self) -> str | None:
        """What other programs' CPU use did to the times, when it reached the threshold
        (`contention.MIN_OTHERS_CORES`, and more demand than cores), else None."""
        # On CUDA the kernels themselves run on the GPU, but launching them, the Python between them
        # and the data loading are host work that waits for a core like any CPU code.
        hurt = ("the times include that contention" if self.device.type == "cpu" else
                "the times include the host-side delays it causes (kernel launches, Python, data loading)")
        if self.beyond_contention:
            claim = (f"but the {max(self.speedup, 1 / self.speedup):.1f}x between the variants is more than that "
                     "load can cause")
        else:
            claim = "and the speedup may not hold" if self.baseline is not None else "and they may not hold"
        return warning_line(self.contention, "during the timed runs", f"{hurt} {claim}",
                            rerun=not self.beyond_contention)

    def __deepcopy__(self, memo):
        """A copy whose ``value`` is detached: the kept run's output usually carries a ``grad_fn``, and
        torch refuses to deepcopy a non-leaf tensor (``copy.deepcopy(res)`` failed on most results)."""
        value = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, self.value)
        copied = {f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self) if f.name != "value"}
        return type(self)(**copied, value=copy.deepcopy(value, memo))

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
            "made_by": self.made_by,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "amp": self.amp.to_dict(),
            "speedup": self.speedup,
            "speedup_uncertain": self.speedup_uncertain,
            "speedup_claimed": self.speedup_claimed,
            "speedup_flags": self.speedup_flags,
            "speedup_firm": self.speedup_firm,
            "memory_saving": self.memory_saving,
            "memory_firm": self.memory_firm,
            "drift": self.drift,
            "tokens": self.tokens,
            "gradients": self.gradients,
            "precision": self.precision,
            "baseline_reduced": self.baseline_reduced,
            "nothing_cast": self.nothing_cast,
            "reduced_by_recipe": self.reduced_by_recipe,
            "unaligned_matmuls": self.unaligned_matmuls,
            "snapshot_bytes": self.snapshot_bytes,
            "restore_times": self.restore_times,
            "restored": self.restored,
            "state_changed": self.state_changed,
            "audit_differs": self.audit_differs,
            "not_copied": self.not_copied,
            "iterators": self.iterators,
            "compiled": self.compiled,
            "compiled_while_timed": self.compiled_while_timed,
            "worker_loaders": self.worker_loaders,
            "optimizer_state_created": [{"name": name, "optimizer": kind, "bytes": n}
                                        for name, kind, n in self.optimizer_state_created],
            "nonfinite_result": self.nonfinite_result,
            "drift_skipped": self.drift_skipped,
            "outer_autocast": self.outer_autocast,
            "fp32_overridden": self.fp32_overridden,
            "fp32_relaxed_by_cell": self.fp32_relaxed_by_cell,
            "advice": self.advice,
            "noise_warnings": self.noise_warnings,
            "contention": self.contention.to_dict() if self.contention else None,
            "under_profiler": self.under_profiler,
        }


def too_few_runs(result: AmpResult) -> bool:
    return result.baseline is not None and min(len(result.baseline.times.times), len(result.amp.times.times)) < MIN_RUNS


def memory_ranges(result) -> str:
    """Each variant's memory runs: "fp32 22-24.1 MiB, bf16 21-25 MiB; 3 runs each"."""
    pair = (result.baseline, result.amp)
    parts = [f"{v.name} {byte_range(min(v.memory.run_peaks), max(v.memory.run_peaks))}" for v in pair]
    counts = [len(v.memory.run_peaks) for v in pair]
    each = f"{_runs(counts[0])} each" if counts[0] == counts[1] else f"{_runs(counts[0])} and {_runs(counts[1])}"
    return f"{', '.join(parts)}; {each}"


def _runs(n: int) -> str:
    return f"{n} run{'' if n == 1 else 's'}"


__all__ = ["AmpResult", "Variant", "MIN_RUNS", "NO_SPEEDUP_BELOW", "MEMORY_NOISE_FLOOR", "MEMORY_SAME",
           "REDUCED_DTYPES", "too_few_runs", "memory_ranges"]
