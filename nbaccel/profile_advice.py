"""The profile's advice: one line per finding, each quoting the number that triggered it.

Every rule reads figures a `ProfileResult` also shows (op table, busy time, categories, kernels,
Tensor Core misses, unaligned shapes), so the reader can check the advice against the tables.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import numpy as np

from . import profile_table as pt
from .analysis.metrics import activity_columns
from .attention_advice import fallback_note, handwritten_note, inside_fallback
from .flops import padding_worth_it
from .options import in_magic, option
from .render.common import format_share
from .timing import format_seconds

if TYPE_CHECKING:
    from .profile_result import ProfileResult

# Advice thresholds. Each is a share of the profiled time; below it the finding is not worth a line.
FP32_MATMUL_SHARE = 0.20     # fp32 matmul/conv time above which autocast is worth trying
IDLE_SHARE = 0.30            # device idle fraction that points at the host (input pipeline, syncs)
SMALL_KERNEL_US = 10.0       # median kernel shorter than this, with many kernels per step ...
MANY_KERNELS = 200           # kernels per step
LAUNCH_IDLE_SHARE = 0.10     # ... and the GPU idle at least this much between them: launch-bound
TRANSFER_SHARE = 0.10        # host<->device copies as a share of device time
CONV_SHARE = 0.10            # conv share of device time for the cudnn.benchmark advice
# Elementwise kernels and on-device copies (not Inductor's, which are fused already) as a share of device time,
# past which fusing them is worth a line: they read and write whole tensors for little arithmetic, so memory
# bandwidth sets their time. The real traces: an H100 Qwen1.5-0.5B bf16 forward 61 %, nbaccel's H200 bf16
# transformer-layer step 41 %; an A100 training step 13 % and a B200 eager trace 16 % (matmuls lead there).
FUSION_SHARE = 0.40
# CPU: aten op calls under SMALL_OP_US of self time are "small". An op's fixed cost (Python binding,
# dispatcher, output allocation) is ~2.6 us in eager (an 8-element add + mul_ on the 2-core VM), ~1 us
# of it inside the op's self time: under 10 us that cost is a fifth or more of the op. The advice
# needs both: at least MANY_SMALL_OPS of them per step (fewer cost under ~0.3 ms a step in fixed
# costs, not worth a compile), and together at least SMALL_OP_SHARE of the self CPU time (what
# fusing them could work on; below a quarter other ops are the place to look). Counted per step,
# so --steps 2 gives the advice exactly when --steps 1 does (docs/profiling.md).
SMALL_OP_US = 10.0
MANY_SMALL_OPS = 100         # small aten op calls per step
SMALL_OP_SHARE = 0.25        # their self time as a share of all ops' self CPU time
# torch.compile compiling (a one-time cost, not the cell's) and waiting for the DataLoader, as shares
# of the wall time: from a tenth on they change what the tables say the cell costs.
COMPILE_SHARE = 0.10
DATA_LOADING_SHARE = 0.10
# An optimizer creating its state happens on its first step only (`phases.optimizer_state_rows`): the
# evidence that the profile holds a first call, whose one-time costs the trace cannot separate
# (oneDNN/cuDNN setup, allocator growth). Said when such steps are at least half of the profile's
# optimizer steps (a one-step profile of a first step: the small CNN's SGD made its momentum buffers
# in 80 us, 0.3% of a 31 ms step that took 20 ms the next time), or when creating the state took at
# least OPTIMIZER_STATE_SHARE of the wall time (the MLP's first AdamW step: 12 aten::zeros_like, 10%).
# Not for one first step among many: it hardly counts there (a loop of 20 of the MLP's AdamW steps from
# a fresh optimizer: 1 of 20 steps, 0.05% of the wall time; of 3 steps: 1 of 3, 2.8%).
OPTIMIZER_STATE_SHARE = 0.05
# Random-number ops (dropout's masks; torch.randn in the profiled code) as a share of the profiled op time:
# a trial's MLP with three Dropout layers spent 64% of its CPU step in aten::bernoulli_, with no advice.
RANDOM_SHARE = 0.20
# Dropout is counted whole: the outermost dropout op with its children (on the CPU aten::dropout is a
# bernoulli_ for the mask, then a div_ and a mul; with another program on a core a trial saw bernoulli_
# at 6% of a dropout-bound cell, mul and div_ at 94%).
_DROPOUT_OPS = frozenset({"aten::dropout", "aten::dropout_", "aten::feature_dropout", "aten::alpha_dropout",
                          "aten::native_dropout", "aten::bernoulli_", "aten::bernoulli"})
_RANDOM_OPS = frozenset({"aten::uniform_", "aten::normal_", "aten::random_", "aten::exponential_",
                         "aten::randperm", "aten::multinomial", "aten::randint"})
UNALIGNED_SHARE = 0.05       # below 5% of the time: listed, not advised on (%%amp: 5% of the FLOPs; a 10-class head is no target)
_CONV = re.compile("conv", re.IGNORECASE)


def _steps(result: ProfileResult) -> int:
    """Steps the profile analyses: the active steps of a live profile, the ProfilerStep ranges of a
    loaded trace (1 when it has none: the whole trace is one step)."""
    return max(1, len(result.step_times_us)) if result.loaded else result.options.steps


def _per_step(count: int, steps: int, noun: str) -> str:
    """"300 kernels", or "300 kernels per step (600 in 2 steps)": the rules count per step."""
    return f"{count / steps:,.0f} {noun} per step ({count:,} in {steps} steps)" if steps > 1 else f"{count:,} {noun}"


# The CPU's matrix tiles (AMX) take bf16, fp16 and int8; fp32 GEMMs run on vector units, where padding a
# dim to 8 fills no tile and only adds work (a user trial: 3 -> 8 input channels for an fp32 CNN would
# have made its first convolution 2.7x the work). The shapes table still lists them.
CPU_TILE_DTYPES = frozenset({"bf16", "fp16", "int8"})


def cpu_tile_dtypes(result: ProfileResult) -> frozenset:
    """The dtypes the profiled CPU's AMX tiles take: none on a CPU without AMX (an Ice Lake: a trial read
    "padded sizes count ... under bf16 autocast (AMX tiles)" there). AMX-INT8 is read from AMX-BF16: every
    AMX CPU so far (Sapphire/Emerald/Granite Rapids) has both. A loaded trace does not say which CPU
    recorded it: every tile dtype counts there."""
    if result.loaded:
        return CPU_TILE_DTYPES
    units = result.device.cpu_features
    return frozenset(d for d, unit in (("bf16", "amx_bf16"), ("fp16", "amx_fp16"), ("int8", "amx_bf16"))
                     if units.get(unit))


def padding_pays_here(result: ProfileResult, entry: dict) -> bool:
    """Whether padding an `unaligned` entry's dims fills tiles on the profiled device: always on a GPU
    (Tensor Cores), on the CPU only for the dtypes its AMX takes. The shapes list shows the others as
    what matters on a GPU (or under bf16 autocast on an AMX CPU), and the advice leaves them out."""
    return result.device.type != "cpu" or entry["dtype"] in cpu_tile_dtypes(result)


def _phase_notes(result: ProfileResult) -> list[str]:
    """torch.compile compiling, and waiting for the DataLoader: time that is not the cell's steady work."""
    notes = []
    times, wall = result.phase_times, result.window_us
    if wall <= 0:
        return notes
    share = times["compile_us"] / wall
    if share >= COMPILE_SHARE:
        if result.loaded is not None:
            fix = "record a later step to see what the compiled code costs"
        elif result.options.warmup:
            fix = (f"it compiled again after {result.options.warmup} warm-up run{'s' if result.options.warmup > 1 else ''}: "
                   "a changed input shape, dtype or Python value failed the compiled code's guards "
                   "(TORCH_LOGS=recompiles says which)")
        else:
            fix = (f"profile a later call ({option('warmup', 1)} runs it once before recording) to see what the "
                   "compiled code costs")
        notes.append(f"{times['compile_us'] / 1e6:.2f} s ({share:.0%}) of this profile was torch.compile compiling, "
                     f"not running the cell: {fix}.")
    notes += _first_call_notes(result)
    share = times["data_loading_us"] / wall
    if share >= DATA_LOADING_SHARE:
        calls = times["data_loading_calls"]
        head = (f"Waiting for the DataLoader took {share:.0%} of the profiled time "
                f"({times['data_loading_us'] / 1e3:,.1f} ms in {calls} call{'s' if calls != 1 else ''} of __next__)")
        if times["data_loading_workers"]:
            # The trace does not say whether the loader's workers persist (a trial's loader had
            # persistent_workers=True and was told to set it): the suggestion says when it applies.
            fix = ("its worker processes did not have the batches ready: more workers (num_workers), a larger "
                   "prefetch_factor" + (", pin_memory=True" if result.on_device else "") + ", and, unless the loader "
                   "has it already, persistent_workers=True (without it each pass over the loader starts and stops "
                   "its workers, and its first and last batches wait for that)")
            c = result.contention
            if c is not None and c.cores and c.threads and c.threads >= c.cores:
                fix += (f"; but torch already runs {c.threads} threads on the {c.cores} CPU cores this process may use, "
                        "so the workers compete with the compute for the cores: more workers add to that, fewer "
                        "torch threads (torch.set_num_threads) leave them room")
        else:
            fix = ("it loads each batch in this process, between the steps: num_workers > 0 loads the next batches "
                   "in worker processes while this one computes")
        notes.append(f"{head}: {fix}.")
    return notes


def _first_call_notes(result: ProfileResult) -> list[str]:
    """A profile of an optimizer's first step (it created its state), with how to profile a later one.

    (A first step much slower than the later ones of ``--steps 3`` was tried as evidence too, and
    dropped: the profiler's own first recorded step is slower, 0.9 / 0.3 / 0.4 ms for a warm 8-element
    add on the 2-core VM, and on a loaded machine a warm one came out over 5 ms and 1.5x slower.)"""
    times, wall, opts = result.phase_times, result.window_us, result.options
    state_us = times["optimizer_state_us"]
    first_steps, all_steps = times["optimizer_state_steps"], times["optimizer_steps"]
    if first_steps and (2 * first_steps >= all_steps or state_us / wall >= OPTIMIZER_STATE_SHARE):
        by = " and ".join(times["optimizer_state_by"])
        ops = ", ".join(f"{n} {name}" for name, n in sorted(times["optimizer_state_ops"].items()))
        ranges = ", ".join(f"Optimizer.step#{o}.step" for o in times["optimizer_state_by"])
        of = f"; {first_steps} of the profile's {all_steps} optimizer steps" if first_steps < all_steps else ""
        # the op table shows self time: AdamW's zeros_like is mostly its aten::fill_ row there (a user trial
        # read "aten::fill_ 46.6 ms" as the #2 op and could not tell where it came from)
        most = next(iter(times["optimizer_state_self"]), None)
        shown = f", most of it {most} in the op table" if most and most not in times["optimizer_state_ops"] else ""
        found = (f"This profile holds the first step of {by}: it created its state ({ops} in {ranges}: "
                 f"{format_seconds(state_us / 1e6)}, {format_share(state_us / wall)} of the wall time{shown}{of})")
        if opts.warmup and result.loaded is None:
            runs = f"{opts.warmup} warm-up run{'s' if opts.warmup > 1 else ''}"
            return [f"{found} after {runs}: an optimizer does that on its first step only, so the warm-up did not "
                    "step it, or the profiled code makes a new optimizer (or new parameters) each run; create it "
                    "once, outside the profiled code, to profile the steady step."]
        fix = ("record a later step" if result.loaded is not None else
               f"profile a later step ({option('warmup', 1)} runs the code once before recording)")
        return [f"{found}: an optimizer does that on its first step only, and a first call also pays one-time "
                f"setup the trace cannot separate ({setup_words(result)}), so these times are likely "
                f"higher than a later step's; {fix}."]
    return []


def setup_words(result: ProfileResult) -> str:
    """What a first call sets up, on the profiled device (the trace shows it only as slower ops)."""
    if result.on_device:
        return "cuDNN/cuBLAS handles and algorithm choice, the CUDA caching allocator's first blocks"
    return "oneDNN primitives, the allocator's first blocks"


def amp_comparison_name() -> str:
    """The mixed-precision comparison as the result's maker would run it: the magic or the API."""
    return "%%amp" if in_magic() else "nbaccel.compare_amp"


def _amp_words(result: ProfileResult) -> str:
    """`amp_comparison_name`, and profiling again under the recipe -- except for a loaded trace, which cannot be
    re-run from here."""
    again = "" if result.loaded else f" (or {option('amp', 'bf16')} here)"
    return amp_comparison_name() + again


def _random_notes(ops: dict, time_col: str, total: float, where: str, in_fallback: list[bool]) -> list[str]:
    """Dropout (whole: its op with the ops inside it) and random tensors made in the profiled code,
    when they are a fifth of the time. ``in_fallback``: per op, whether it runs inside the attention
    math fallback, whose dropout is its ``dropout_p`` argument (model.eval() leaves that as it is)."""
    inclusive = "device_total_us" if time_col == "device_self_us" else "dur_us"
    parent, names = ops["parent"], ops["name"]

    def outermost(i: int) -> bool:  # no dropout op around it (a bernoulli_ inside aten::dropout counts once)
        j = parent[i]
        while j >= 0:
            if names[j] in _DROPOUT_OPS:
                return False
            j = parent[j]
        return True

    notes = []
    for kind, column in ((_DROPOUT_OPS, inclusive), (_RANDOM_OPS, time_col)):
        times, calls, argument = {}, {}, False
        for i, name in enumerate(names):
            if name in kind and (kind is _RANDOM_OPS or outermost(i)):
                times[name] = times.get(name, 0.0) + ops[column][i]
                calls[name] = calls.get(name, 0) + 1
                argument = argument or (kind is _DROPOUT_OPS and in_fallback[i])
        share = pt.pairwise_sum(list(times.values())) / total
        if share < RANDOM_SHARE:
            continue
        mine = sorted(times, key=times.get, reverse=True)
        named = ", ".join(f"{n} {calls[n]} call{'s' if calls[n] != 1 else ''}" for n in mine[:3])
        if kind is _DROPOUT_OPS:
            off = ("model.eval() turns dropout off" + (
                   ", but not scaled_dot_product_attention's dropout_p argument, part of it here: pass 0.0 "
                   "outside training" if argument else ""))
            notes.append(f"Dropout takes {share:.0%} of {where} time ({named}, with the ops inside): if this is "
                         f"evaluation or inference, {off}; in training it is dropout's "
                         "cost, which torch.compile cuts by drawing the masks inside fused kernels.")
        else:
            notes.append(f"Making random tensors takes {share:.0%} of {where} time ({named}): if they stand in "
                         "for data (torch.randn batches), make them once before the profiled code.")
    return notes


def _in_attention(result: ProfileResult) -> list[bool]:
    """Per op row: whether it is, or runs inside, an attention op (its category or its phase)."""
    return [c == "attention" or p == "attention" for c, p in zip(result.op_columns["category"], result.op_phases)]


SLOW_FP16_CONV_SHARE = 0.2  # an fp16 convolution backward past this share of the time is named


def _fp32_matmul_notes(result: ProfileResult, ops: dict, time_col: str, total: float, where: str) -> list[str]:
    """"try %%amp" where fp32 matmul/conv ops are a fifth of the time, naming the ops counted with their
    shares, so that the line can be checked against the table and the bar (a trial read 45% here beside
    a 68% bar for einsum, whose own time the bar holds: its tensor-list input records no dtype),
    and not where it cannot help: under the recipe already (a trial's --amp bf16 profile was told to
    try --amp bf16), or inside an op whose matmuls stay fp32 under autocast (`kept_fp32`: cdist, and on
    the CPU the attention math fallback, which computes in fp32 whatever autocast casts)."""
    times: dict[str, float] = {}
    left_out: dict[tuple[str, str], float] = {}  # (op, the op around it that keeps it fp32) -> time
    names, kept, dtypes, spent = ops["name"], result.kept_fp32_by, ops["math_dtype"], ops[time_col]
    for i in [i for i, c in enumerate(ops["category"]) if c == "matmul/conv"]:  # a few rows of many
        # aten ops only: an autograd node's range (AddmmBackward0) is a wrapper whose aten::mm holds the work
        if dtypes[i] == "fp32" and names[i].startswith("aten::"):
            if kept[i] is None:
                times[names[i]] = times.get(names[i], 0.0) + spent[i]
            else:
                left_out[names[i], kept[i]] = left_out.get((names[i], kept[i]), 0.0) + spent[i]
    fp32 = pt.pairwise_sum(list(times.values()))
    if fp32 / total < FP32_MATMUL_SHARE:
        return []
    named = sorted(times, key=times.get, reverse=True)
    ran = ", ".join(f"{n} {format_share(times[n] / total)}" for n in named[:3])
    if len(named) > 3:
        ran += f", {len(named) - 3} more {format_share(pt.pairwise_sum([times[n] for n in named[3:]]) / total)}"
    # The table's row for an op holds all its calls: said, so that its share there adds up (a trial read
    # aten::bmm 3.4% in the table and 2.2% here, the rest inside the attention math fallback).
    shown = sorted(((key, t) for key, t in left_out.items() if t / total >= 0.001), key=lambda kt: kt[1], reverse=True)
    if shown:  # what would read "<0.1%" adds nothing a reader can check
        ran += "; not counted, as autocast cannot cast them: " + ", ".join(
            f"{n} {format_share(t / total)} inside {by}" for (n, by), t in shown)
    share = f"fp32 matmul/conv ops take {format_share(fp32 / total)} of {where} time ({ran})"
    if result.options.amp:
        return [f"{share} under the {result.options.amp} recipe: autocast left them in fp32 (ops on its fp32 list, "
                "inputs cast back to fp32, or code that turns autocast off around them); "
                f"{amp_comparison_name()}'s op table shows each op's dtype."]
    if result.on_device:
        return [f"{share}: try {_amp_words(result)} -- bf16/fp16 run on Tensor Cores."]
    if result.loaded:  # recorded on a machine this one cannot ask about
        return [f"{share}: try {_amp_words(result)} -- bf16 helps on CPUs with AMX/AVX512-BF16 units; "
                "on others its matmuls run emulated, slower than fp32."]
    if result.device.has_bf16_units:
        units = "AMX-BF16 tiles" if result.device.cpu_features.get("amx_bf16") else "AVX512-BF16 units"
        return [f"{share}: try {_amp_words(result)} -- this CPU's {units} run bf16 matmuls."]
    # a trial on an Ice Lake was sent to %%amp as the one fix for a step of many small matmuls
    # (emulated: on an AVX2-only EPYC a bf16 256^3 matmul took 17.8 ms against fp32's 1.0 ms, a trial)
    return [f"{share}; this CPU has no bf16 units (AMX / AVX512-BF16), so mixed precision would run these on "
            "emulated bf16 kernels, slower than fp32's: cut the matmul time itself (fewer, larger matmuls), or "
            "compare on a GPU."]


_MEMORY_BOUND = ("elementwise", "memory copy")


def _fusion_note(result: ProfileResult, ops: dict, total: float) -> str | None:
    """Unfused elementwise kernels and on-device copies past `FUSION_SHARE` of the device's kernel and copy time
    (the Breakdown's basis), naming the aten ops that launched most of them with their share of the op table's
    total; Inductor's kernels (``triton_*``) are left out: torch.compile fused those already."""
    cols = activity_columns(result.trace, ("name", "category", "dur_us"))  # kernels, memcpys, memsets
    spent = pt.pairwise_sum(cols["dur_us"])
    per_kind = {kind: pt.pairwise_sum([t for n, c, t in zip(cols["name"], cols["category"], cols["dur_us"])
                                       if c == kind and not (n or "").startswith("triton_")])
                for kind in _MEMORY_BOUND}
    unfused = pt.pairwise_sum(per_kind.values())
    if spent <= 0 or unfused / spent < FUSION_SHARE:
        return None
    times: dict[str, float] = {}
    for name, category, t in zip(ops["name"], ops["category"], ops["device_self_us"]):
        if category in _MEMORY_BOUND and t and name.startswith("aten::"):
            times[name] = times.get(name, 0.0) + t
    named = sorted(times, key=times.get, reverse=True)[:3]
    launched = f"; most from {', '.join(f'{n} {format_share(times[n] / total)}' for n in named)}" if named else ""
    split = ", ".join(f"{kind} {format_share(per_kind[kind] / spent)}" for kind in _MEMORY_BOUND if per_kind[kind])
    return (f"Elementwise kernels and on-device copies take {unfused / spent:.0%} of device time ({split}{launched}): "
            "each reads and writes whole tensors for little arithmetic, so memory bandwidth sets their time; "
            "torch.compile fuses chains of them (with the casts and copies between them) into fewer kernels.")


def _compare_amp_note(result: ProfileResult) -> str | None:
    """A profile around nbaccel.compare_amp records all its runs (a trial: 17 runs and the snapshot restores
    read as "1 step", with first-step advice about AdamW's state); compare_amp marks the trace (`amp.COMPARE_AMP_MARK`)."""
    from .amp import COMPARE_AMP_MARK  # lazily: amp imports this module's neighbours

    marks = [n for n in result.trace.column("annotations", "name") if str(n).startswith(COMPARE_AMP_MARK)]
    if not marks:
        return None
    return (f"This profile holds {len(marks)} nbaccel.compare_amp call{'s' if len(marks) > 1 else ''} "
            f"({', '.join(m[len(COMPARE_AMP_MARK):].strip(' ()') for m in marks)}): both variants' warmup, timed, "
            "memory and audited runs and the snapshot restores between them, not one step of the code. Profile the "
            f"code itself, under one recipe: {option('amp', 'bf16')}.")


def advise(result: ProfileResult) -> list[str]:
    """One line per finding, each quoting the number that triggered it."""
    notes = []
    ops = result.op_columns  # plain lists: a few hundred rows are summed faster than pandas sets up
    n_ops = len(ops["name"])
    on_device = result.on_device
    time_col = "device_self_us" if on_device else "self_us"
    total = result.time_total_us
    where = "device" if on_device else "CPU"
    if not n_ops:
        notes.append("No torch operators were recorded: torch.profiler sees torch work only, and only on the thread "
                     "that runs the code (not in threads it starts); for plain Python time use %prun or pyinstrument.")
    notes += _phase_notes(result)
    compare_amp = _compare_amp_note(result)
    if compare_amp:
        notes.append(compare_amp)
    if result.unrecorded_steps:  # a review: the later iterations of a step() loop went unmentioned
        o = result.options
        if o.scheduled:
            n = o.warmup + o.steps + result.unrecorded_steps
            first, last = o.warmup + 1, o.warmup + o.steps
            notes.append(f"prof.step() was called {n} times, and schedule(warmup={o.warmup}, active={o.steps}) "
                         f"recorded iteration{'s' if o.steps > 1 else ''} {first}{f'-{last}' if last > first else ''} "
                         f"only: {option('steps', n - o.warmup)} records all {n - o.warmup} after the warm-up.")
        else:
            n = result.unrecorded_steps + 1
            notes.append(f"prof.step() was called {n} times, and the default one step recorded the first iteration "
                         f"only (as torch's schedule(active=1) does): {option('steps', n)} records all {n}.")
    in_fallback = inside_fallback(ops)  # attention's math fallback: the ops inside it (its dropout, below)
    if n_ops and total > 0:
        notes += _fp32_matmul_notes(result, ops, time_col, total, where)
        for attention in (fallback_note(ops, total, on_device, where),
                          handwritten_note(ops, lambda: _in_attention(result), time_col, total, where, on_device)):
            if attention:
                notes.append(attention)
    busy = result.busy
    idle = 1 - busy["busy_fraction"] if busy and busy["busy_fraction"] is not None else None
    steps = _steps(result)
    n_kernels = result.kernel_count
    many_kernels = n_kernels >= MANY_KERNELS * steps
    kernel_median = float(np.median(result.trace.column("kernels", "dur_us"))) if many_kernels else None
    # Launch cost is host time, invisible in kernel durations; what shows it is the GPU waiting between
    # short kernels. A GPU kept busy by many short kernels is not launch-bound.
    launch_bound = bool(many_kernels and kernel_median < SMALL_KERNEL_US and idle is not None
                        and idle >= LAUNCH_IDLE_SHARE)
    if idle is not None and idle >= IDLE_SHARE and not launch_bound:  # launch-bound idle has its own line below
        notes.append(f"The GPU is idle {idle:.0%} of the profiled time: the input pipeline "
                     "(DataLoader workers, pin_memory) or host syncs (.item(), .cpu(), print of tensors) are "
                     "the bottleneck, not the GPU.")
    if many_kernels and kernel_median < SMALL_KERNEL_US:
        if launch_bound:
            notes.append(f"{_per_step(n_kernels, steps, 'kernels')} with a median of {kernel_median:.1f} µs each, "
                         f"and the GPU idle {idle:.0%} of the profiled time between them: the host cannot launch "
                         "them as fast as they run; try torch.compile (fewer, fused kernels), CUDA graphs "
                         "(mode='reduce-overhead') or a larger batch.")
    elif not on_device and total > 0 and n_ops >= MANY_SMALL_OPS * steps:
        # calls as the header and the table count them: a wrapper's re-dispatch of one call is not a
        # second one (a trial read "414 aten op calls" beside a header of 390 op calls)
        again = pt.redispatched(ops["parent"], ops["name"])
        small = [t for name, t, inner in zip(ops["name"], ops["self_us"], again)
                 if t < SMALL_OP_US and name.startswith("aten::") and not inner]
        small_us = pt.pairwise_sum(small)
        if len(small) >= MANY_SMALL_OPS * steps and small_us / total >= SMALL_OP_SHARE:
            notes.append(f"{_per_step(len(small), steps, 'aten op calls')} of under {SMALL_OP_US:.0f} µs self "
                         f"time each take {small_us / total:.0%} of the self CPU time: ops this short spend much of "
                         "their time in fixed per-op costs (Python binding, dispatch, allocation); try "
                         "torch.compile (fuses them) or give each op more work (larger tensors per op).")
    if n_ops and total > 0:
        notes += _random_notes(ops, time_col, total, where, in_fallback)
    if on_device and result.device_time_us > 0:
        transfer = pt.pairwise_sum([t for c, t, _, _ in result.category_rows if c == "data transfer"])
        if transfer / result.device_time_us >= TRANSFER_SHARE:
            notes.append(f"Host<->device copies take {transfer / result.device_time_us:.0%} of device time: keep "
                         "tensors on the GPU, use pin_memory=True and .to(device, non_blocking=True).")
        fusion = _fusion_note(result, ops, total)
        if fusion:
            notes.append(fusion)
        conv_share = pt.pairwise_sum(t for name, t in zip(ops["name"], ops["device_self_us"])
                                     if t > 0 and _CONV.search(name)) / result.device_time_us
        if conv_share >= CONV_SHARE and not result.cudnn_benchmark:
            state = "is off" if result.cudnn_benchmark is False else "is not recorded in the trace"
            notes.append(f"Convolutions take {conv_share:.0%} of device time and torch.backends.cudnn.benchmark "
                         f"{state}: with fixed input shapes, turn it on to let cuDNN pick the fastest algorithm.")
    misses = result.fp32_miss_rows if on_device else ()
    if misses:
        names = ", ".join(sorted({m[0] for m in misses}))
        notes.append(f"fp32 matmul/conv ops ran without Tensor Cores ({pt.pairwise_sum([m[4] for m in misses]):.0%} "
                     "of device time: "
                     f"{names}); enable TF32 (torch.backends.cuda.matmul.fp32_precision = 'tf32') or use "
                     f"{amp_comparison_name()}.")
    significant = [e for e in result.unaligned if (e["share"] or 0) >= UNALIGNED_SHARE and padding_pays_here(result, e)]
    pairs = {}
    for entry in significant:
        for dim, size in entry["unaligned"].items():
            if padding_worth_it(size, entry["multiple"]):  # 4 -> 8 would double the work
                pairs[size] = entry["pad_to"][dim]
    shown = sorted(pairs.items())[:6]
    if shown:
        notes.append("Matmul/conv dims not multiples of 8 (16 for int8): "
                     + ", ".join(f"{a} -> pad to {b}" for a, b in shown)
                     + ("; padded sizes fill Tensor Core tiles." if result.device.type != "cpu"
                        else "; padded sizes fill AMX tiles."))
    if result.options.amp == "fp16" and result.device.type == "cpu" and result.loaded is None \
            and not result.device.cpu_features.get("amx_fp16"):
        # as %%amp says it: fp16 without AMX-FP16 runs on vector units (1024^3: fp16 6.0 ms, fp32 6.1, bf16 1.6)
        bf16 = (f" It has AMX-BF16: {option('amp', 'bf16')} runs on its tiles."
                if result.device.cpu_features.get("amx_bf16") else "")
        # and its fp16 convolution weight gradient is far slower than fp32's (`benchmarks.bench_cpu_fp16`: 304x on
        # the project's VM): a trial's CNN step spent 99% of its time there, and the line said only "gain little"
        convs = [r for r in result.grouped_rows("op") if r["dtype"] == "fp16" and "convolution_backward" in r["name"]
                 and (r["percent"] or 0) >= 100 * SLOW_FP16_CONV_SHARE]
        slow = ("; oneDNN's fp16 convolution backward takes a far slower path than fp32's (here "
                + ", ".join(f"{r['name']} {r['percent']:.0f}% of CPU time" for r in convs) + ")") if convs else ""
        notes.append(f"This CPU has no AMX-FP16: the fp16 matmuls of {option('amp', 'fp16')} run on its vector units, "
                     f"which gain little over fp32{slow}.{bf16}")
    emulated = _emulated_bf16(result)
    if emulated:
        notes.append(emulated)
    busy = _busy_machine_note(result)
    if busy:
        notes.append(busy)
    one_function = _one_function_note(result, where)
    if one_function:
        notes.append(one_function)
    if result.device.type == "cpu" and result.loaded is None:
        notes.append("Profiled on the CPU (no CUDA device): times are CPU times; GPU figures need a GPU.")
    return notes


def _busy_machine_note(result: ProfileResult) -> str | None:
    """A profile too short to measure contention, on a machine whose load average says it was busy: how many
    steps would measure it (a trial: a 65 ms step on a VM at load 3.9 on 2 cores ranked aten::sqrt first at
    19.6 ms and a row of ops at 7.8 ms each, time slices lost to other programs, with no word on it)."""
    from .contention import MIN_WINDOW_S

    c = result.contention
    if c is None or c.unknown or c.others_cores() is not None or not c.likely_contended() or result.loaded:
        return None
    wall_s = sum(c.wall_s.values())
    steps = max(1, result.options.steps)
    needed = math.ceil(MIN_WINDOW_S / (wall_s / steps)) if wall_s > 0 else None
    more = (f" {option('steps', needed)} profiles long enough to measure it" if needed and needed > steps
            else " a longer profile measures it")
    return (f"The machine's 1-minute load average was {c.load_average:.1f} on the {c.cores} CPU cores this process "
            f"may use as the profile began, and the profiled {format_seconds(wall_s)} were too short to measure what "
            f"other programs took ({MIN_WINDOW_S:g} s is needed): op times here can include time slices lost to "
            f"them.{more}.")


# A --stack table whose first row is one function holding this share of the time says how to see its lines.
ONE_FUNCTION_SHARE = 0.8
_FUNCTION_ROW = re.compile(r"(?P<where>.+), line (?P<line>\d+): def (?P<func>[\w.]+)$")


def _one_function_note(result: ProfileResult, where: str) -> str | None:
    """Under --stack, a function's ops are charged to the function (Kineto records where it starts, not the
    line running): a trial's cell called train_step(), defined in an earlier cell, and got one row,
    "Cell In[3], line 1: def train_step", at >99.9%, which says nothing about where in it the time went."""
    if not result.options.stack or not result.op_count:
        return None
    rows = [r for r in result.grouped_rows("source") if r.get("percent")]
    top = max(rows, key=lambda r: r["percent"], default=None)
    found = _FUNCTION_ROW.match(str(top["source"])) if top else None
    if not found or top["percent"] < 100 * ONE_FUNCTION_SHARE:
        return None
    share = ">99.9%" if top["percent"] > 99.9 else f"{top['percent']:.0f}%"
    return (f"One function, {found['func']} ({found['where']}, line {found['line']}), holds {share} of the {where} "
            f"time: {option('stack', True)} charges a function's ops to the function, not to its lines (torch's Python "
            "tracer records where each function starts, not the line that runs). To see its lines, profile its "
            "body as the cell (each top-level statement is then a row of its own), or split it into smaller "
            "functions.")


EMULATED_BF16_SHARE = 0.2  # bf16 matmul/conv time past this share, on a CPU without bf16 units, is named


def _emulated_bf16(result: ProfileResult) -> str | None:
    """Under ``--amp bf16`` on a CPU with neither AMX nor AVX512-BF16: the bf16 matmuls and convolutions
    that run emulated kernels, and their share, when they dominate. A trial on an AVX2-only EPYC: 88-93% of
    an MLP's, a CNN's and a GRU's step was bf16 matmul/conv (a 256^3 bf16 matmul 17.8 ms, fp32 1.0 ms; convs
    fell back to torch's aten::_slow_conv2d_forward), and the only advice line was "Profiled on the CPU"."""
    if result.options.amp != "bf16" or result.device.type != "cpu" or result.loaded is not None \
            or result.device.has_bf16_units:
        return None
    rows = [r for r in result.grouped_rows("op") if r["dtype"] == "bf16" and r["category"] == "matmul/conv"]
    share = sum(r["percent"] or 0 for r in rows) / 100
    if share < EMULATED_BF16_SHARE:
        return None
    top = sorted((r for r in rows if (r["percent"] or 0) >= 0.5), key=lambda r: -r["percent"])[:3]
    named = ", ".join(f"{r['name']} {r['percent']:.0f}%" for r in top)
    fallback = ("; aten::_slow_conv2d_* is torch's fallback convolution: oneDNN has none in bf16 for this CPU"
                if any(r["name"].startswith("aten::_slow_conv2d") for r in rows) else "")
    return (f"This CPU has no bf16 units (AMX / AVX512-BF16): the bf16 matmuls and convolutions of "
            f"{option('amp', 'bf16')} take {share:.0%} of CPU time ({named}{fallback}) and run emulated kernels, "
            f"slower than fp32's; {amp_comparison_name()} measures by how much. bf16 pays on a GPU or a CPU with "
            "those units.")
