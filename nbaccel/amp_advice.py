"""The advice of a `%%amp` comparison: one line per finding, each backed by a number in the result."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .amp_result import MIN_RUNS, NO_SPEEDUP_BELOW, REDUCED_DTYPES, memory_ranges, too_few_runs
from .cell_reads import and_list, take_first
from .drift import (ids_noun, near_zero_figures, reduced_float_leaves, relative_words, resolution, share_words,
                    tokens_differ)
from .flops import AUTOCAST_DTYPES, integer_matmuls, padding_worth_it
from .memory import format_bytes
from .timing import format_ratio, format_seconds
from .options import in_magic, option
from .precision import describe

if TYPE_CHECKING:
    from .amp_result import AmpResult


def _state_reason(result: AmpResult) -> str | None:
    """Why the two variants' results may differ for reasons other than precision, if any."""
    if not result.restored:
        return ("your variables were not restored between runs (no snapshot), so each run started from the "
                "variables the one before left")
    if result.iterators:
        return (f"the cell takes items from {and_list(result.iterators)}, which no snapshot can rewind, so each run "
                "had its own items")
    if result.state_changed:
        return ("two runs with the same settings from the same restored state gave different results, so the "
                "cell depends on state nbaccel does not restore (an iterator it takes the next batch from, "
                "attributes of your own objects, containers nested more than three deep, files...)")
    if result.amp.ops.empty:
        return "the cell ran no torch operators, so precision cannot have changed its result"
    return None


def _iterator_note(iterators: list[str]) -> str:
    """The runs took their own items from the user's iterator (`nbaccel.cell_reads`)."""
    one = len(iterators) == 1
    return (f"{and_list(iterators)} {'is an iterator' if one else 'are iterators'} the cell takes items from, and no "
            f"snapshot can rewind {'it' if one else 'them'}: every run took its own items, so the variants compared "
            f"different data, and {'it has' if one else 'they have'} moved on by all the runs' items, not one run's. "
            f"To compare on one batch, take it before the magic ({take_first(iterators)}) and use `batch` in the cell.")


def _worker_loader_note(loaders: list[str]) -> str:
    """Each run of a cell that loops over these loaders starts and stops their workers."""
    one = len(loaders) == 1
    s = "s" if one else ""
    return (f"The DataLoader{'' if one else 's'} {and_list(loaders)} start{s} and stop{s} "
            f"{'its' if one else 'their'} worker processes on every iteration: if the cell loops over "
            f"{'it' if one else 'them'}, each run's time includes that (the same cost in both variants, so "
            "it dilutes the speedup). To time the step, take a batch before the magic, or make the loader "
            "with persistent_workers=True.")


def _first_step_note(created: list[tuple[str, str, int]]) -> str:
    """The optimizers had no state as the cell began: each run's step created it, as only a first step does
    (a trial: memory +10% vs fp32 on an AdamW MLP's first step, -17% on its later ones)."""
    one = len(created) == 1
    what = and_list([f"`{name}` ({kind}, {format_bytes(n)} of state)" for name, kind, n in created])
    return (f"{what} had no state when the cell began, so every run's step created it, as a first step does: that "
            f"allocation is in both variants' peaks and times, and a later step, which has the state already, can "
            f"compare otherwise. To measure a steady step, run the step once before "
            f"{'%%amp' if in_magic() else 'compare_amp'} (the variables are restored before every run, so a warm-up "
            f"run does not help); the kept run left {'it' if one else 'them'} with state.")


def _compiled_note(compiled: list[str]) -> str:
    """The timed runs run compiled code; the op audit sees eager ops."""
    return (f"{and_list(compiled)} {'is' if len(compiled) == 1 else 'are'} torch.compile'd: the times and peak "
            "memory are the compiled code's, but the op audit records the eager ops, so the dtypes per op, "
            "the FLOPs and the drift above are eager's (the default backend, inductor, fuses elementwise ops "
            "and may keep their intermediates in fp32).")


def _compiled_while_timed_note(result: AmpResult) -> str:
    """Compiling inside the timed runs: their times are the compiler's, not the step's."""
    n, warmup = result.compiled_while_timed, result.warmup
    return (f"torch.compile compiled {n} graph{'s' if n != 1 else ''} during the timed runs, so their times "
            "include compiling (seconds, where a compiled step takes milliseconds) and the speedup above is "
            f"no measure of the step: compile before the cell, or raise {option('warmup')} (now {warmup}) so "
            "that each variant compiles in a warm-up run (autocast is part of torch.compile's guards: the "
            "fp32 and the reduced-precision runs compile separately).")


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


def _relaxed_in_baseline(result: AmpResult) -> str:
    """The fp32 run is strict fp32 around the cell, but a cell that sets a lower fp32 precision itself runs its
    fp32 matmuls as that asks (bf16 passes on the CPU's oneDNN, TF32 on CUDA): the comparison is then with that,
    not with IEEE fp32, and nothing else in the report would say so (a trial read "strict fp32")."""
    settings = " and ".join(result.fp32_relaxed_by_cell)
    what = "TF32 (or bf16) passes" if result.device.type == "cuda" else "oneDNN's bf16 passes"
    around = "%%amp" if in_magic() else "compare_amp"
    return (f"The fp32 run was not strict fp32: the cell itself calls {settings}, so its fp32 matmuls ran with "
            f"{what} there; the speedup and drift compare the recipe with that setting, not with IEEE fp32. Make the "
            f"setting in a cell of its own, before {around}, to compare against strict fp32 (the fp32 run then "
            "overrides it, and says so).")


def _reduced_in_baseline(result: AmpResult) -> str | None:
    """The fp32 run is strict fp32 around the cell, but a cell that enters autocast itself (or casts
    the model to bf16) still runs its matmuls in reduced precision there: then both runs are the same
    code, and a speedup or drift near 1x / 0 says nothing about mixed precision."""
    if not result.baseline_reduced:
        return None
    ops = result.baseline.ops
    reduced = ops[ops["heavy"] & ops["dtype"].isin(REDUCED_DTYPES)]
    dtypes = " and ".join(result.baseline_reduced)
    names = ", ".join(sorted(set(reduced["op"]))[:3])
    calls = int(reduced["calls"].sum())
    what = "matmul/conv/attention" if any("attention" in n for n in reduced["op"]) else "matmul/conv"
    return (f"The fp32 run was not fp32: {calls} {what} call{'s' if calls != 1 else ''} ({names}) ran in "
            f"{dtypes} there too -- the cell turns on torch.autocast, casts to {dtypes} itself, or works on "
            f"{dtypes} tensors made earlier (a model or inputs converted with .to() in an earlier cell). Both runs then "
            "run reduced-precision code, so the speedup, memory and drift compare the recipe with the cell's own "
            "precision, not with fp32; give the cell fp32 tensors and model, without an autocast or cast of its "
            "own, to compare against fp32.")


def _near_zero_notes(result: AmpResult, drift: dict, dtype: str) -> list[str]:
    """For a near-zero result whose relative change would have read as an alarm: what it measures.
    A sum of normalized outputs cancels to about 0 (a user trial: "moved by 100%")."""
    notes = []
    for leaf in drift["leaves"]:
        if leaf.get("near_zero") and leaf["max_rel"] > 0.05:
            name = "The result" if leaf["name"] == "value" else f"The result {leaf['name']}"
            figures = near_zero_figures(leaf, dtype, resolution(result.amp.recipe))
            notes.append(f"{name} is near 0 ({figures}): its relative change under {dtype} "
                         f"({relative_words(leaf['max_rel'], '.1%')}) measures that rounding, not {dtype}'s accuracy on your data; "
                         f"the absolute change is {leaf['max_abs']:.2e}. Judge accuracy on a result of normal size "
                         f"(the output itself, or a loss); if this near-0 value itself matters, {dtype} is too "
                         "coarse for it.")
    return notes


def _tokens_size(tokens: dict) -> str:
    """How far two runs' token ids differ, for the state note: "tokens agree at 87%"."""
    words = tokens["tokens"]  # integers without an embedding lookup are no text (`drift.compare_tokens`)
    if not tokens["comparable"]:
        return "another number of token sequences" if words else "another number of rows of integer ids"
    if tokens["agree"] == tokens["compared"]:
        return "token sequences of other lengths" if words else "rows of integer ids of other lengths"
    return f"{ids_noun(tokens)} agree at {share_words(tokens['agree'], tokens['compared'])}"


def _drift_differs(drift: dict | None) -> bool:
    return bool(drift) and bool(drift["max_abs"] > 0 or drift["amp_only_nonfinite"] or drift["fp32_only_nonfinite"])


# Unaligned matmuls doing less than this share of the FLOPs are not worth padding (a 10-class output
# layer was advised on in every model); the result still lists them all.
UNALIGNED_FLOP_SHARE = 0.05


def _significant_unaligned(result: AmpResult) -> list[dict]:
    total = result.amp.flops or 0
    return [m for m in result.unaligned_matmuls
            if m.get("flops") is None or not total or m["flops"] / total >= UNALIGNED_FLOP_SHARE]


def _what_padding_feeds(info, dtype: str) -> str:
    """Which units want the padded dims: a CPU without matrix units for the dtype gains nothing from it
    (a trial on an Ice Lake read "so Tensor Cores / AMX tiles are used fully" beside "this CPU lacks bf16
    units"; %%profile_gpu says "for a GPU or bf16 autocast" there)."""
    if info.type != "cpu":
        return "so Tensor Cores are used fully"
    if info.cpu_features.get(f"amx_{dtype}"):
        return "so AMX tiles here (and a GPU's Tensor Cores) are used fully"
    return f"for a GPU's Tensor Cores (this CPU has no AMX for {dtype}: no gain here)"


def _unfirm_timing(result: AmpResult) -> str | None:
    """Why the times cannot rank the two variants, with what to do about it; None when they can.
    A slowdown earns the same hedge as a speedup: contention or overlapping IQRs move either way."""
    # contention that cannot explain the ratio (`AmpResult.beyond_contention`) does not make it unfirm
    overlap = result.speedup_uncertain
    contended = result.times_contended
    wide = result.spread_too_wide
    if not overlap and not contended and not wide:
        return None
    spread = f"{' and '.join(wide)}'s runs varied by more than half {'their medians' if len(wide) > 1 else 'its median'}"
    reasons = [w for w, on in (("the two variants' IQRs overlap", overlap), (spread, wide and not overlap),
                               ("other programs competed for the CPU", contended)) if on]
    fix = " and ".join(f for f, on in (("when the machine is quiet", contended),
                                       (f"with a larger {option('repeat')}", overlap or wide)) if on)
    return f"{' and '.join(reasons)} (see the warning{'s' if len(reasons) > 1 else ''}): re-run {fix}"


def _beyond_autocast(result: AmpResult) -> dict[str, list[str]]:
    """{dtype: heavy ops} for the matmuls and convolutions that ran in a floating dtype autocast leaves
    alone (float64, complex; `flops.AUTOCAST_DTYPES` are the ones it works with): it casts float32 ops only."""
    ops = result.amp.ops
    if ops.empty:
        return {}
    found: dict[str, list[str]] = {}
    for op, dtype in ops.loc[ops["heavy"], ["op", "dtype"]].itertuples(index=False):
        if dtype not in AUTOCAST_DTYPES and dtype.startswith(("float", "complex")):  # not an integer matmul
            found.setdefault(dtype, []).append(op)
    return found


def _why_nothing_cast(result: AmpResult) -> str:
    """Which reason `_nothing_to_cast` gives: "own" (the cell's own bf16 ops), "wide" (every heavy op in
    float64/complex), "fp32" (heavy ops kept in fp32: the verdict names them, so the "Heavy ops still in
    fp32" line is left out), "integer" (its matmuls are integer or quantized ones, `flops.integer_matmuls`),
    or "none" (no op autocast casts)."""
    if result.precision["reduced"]:
        return "own"
    if result.precision["heavy_fp32"]:  # before "wide": the fp32 ones are the finding
        return "fp32"
    if _beyond_autocast(result):
        return "wide"
    return "integer" if integer_matmuls(result.amp.ops) else "none"


def _nothing_to_cast(result: AmpResult) -> str:
    why = _why_nothing_cast(result)
    if why == "own":  # the cell's own bf16 tensors: the same ops in both variants
        return result.nothing_cast_words + " (autocast casts matmuls and convolutions)"
    if why == "wide":
        # A trial's float64 Linear was told "reductions and elementwise ops stay fp32" of a matmul.
        beyond = _beyond_autocast(result)
        ran = "; ".join(f"{', '.join(sorted(set(ops)))} in {dtype}" for dtype, ops in beyond.items())
        fix = ("convert the model and its inputs with .float() to compare" if "float64" in beyond else
               "complex values have no bf16 or fp16 form, so mixed precision does not apply to them")
        return (f"{result.nothing_cast_words} -- autocast casts float32 ops only, and the matmuls and convolutions "
                f"here ran in {ran}: {fix}")
    if why == "fp32":
        # A trial's cell turned autocast off around its matmul: "nothing here to cast" read as "no matmul".
        return (f"{result.nothing_cast_words} -- its matmuls and convolutions ({', '.join(result.heavy_fp32_calls)}) "
                "stayed fp32 under the recipe: the cell runs them outside autocast (torch.autocast(..., "
                "enabled=False) around them) or casts their inputs back to fp32")
    if why == "integer":
        # A trial's quantize_dynamic(model)(x) and torch._int_mm cells were told "autocast had nothing here to
        # cast (it leaves reductions, elementwise ops ...)": they were all matmuls, int8 ones.
        found = integer_matmuls(result.amp.ops)
        widths = sorted(set(found.values()))
        return (f"{result.nothing_cast_words} -- the matmuls here are {' and '.join(widths)} ({', '.join(sorted(found))}): "
                "autocast casts float32 ops only and leaves integer and quantized ops alone; compare "
                f"{result.amp.name} on the fp32 version (the model before quantizing, float32 tensors) instead")
    # autocast is per thread: a trial's matmuls in threads the cell started were neither cast nor audited
    # (a trial's torch.mv, cdist and linalg cells read "reductions and elementwise ops stay fp32" alone)
    return (f"{result.nothing_cast_words} -- autocast had nothing here to cast (it leaves reductions, elementwise "
            "ops and ops such as mv, dot, cdist and linalg in fp32); it speeds up matrix products and "
            "convolutions, those of the thread that runs the cell (not of threads it starts)")


def _without_units(info, dtype: str) -> str:
    """Beside a gain on a CPU without matrix units for the dtype: what it can (not) be. A trial on an Ice
    Lake read "bf16 autocast measured 1.79x faster" under contention, and 0.46x in a later cell."""
    if info.type != "cpu" or dtype not in ("bf16", "fp16") or info.has_units(dtype):
        return ""
    return (f" This CPU has no {dtype} units (AMX / AVX512-{dtype.upper()}): its {dtype} matmuls are emulated, so a "
            "gain here comes from moving half-size tensors, or from noise; not from faster math.")


def _same_kernels(result: AmpResult, speedup: float, dtype: str) -> str:
    """The verdict where the recipe cast nothing: whatever the ratio, it is noise, so it is shown as a flagged
    one is (two significant digits): "the 1.02x" had read as a measured 2%."""
    return (f"No speedup: {_nothing_to_cast(result)}. Both variants ran the same kernels, so the "
            f"{format_ratio(speedup, firm=False)} between their times is run-to-run variation, not an effect of {dtype}.")


# scaled_dot_product_attention's math path is the one caller of aten::_safe_softmax (torch 2.13; flex
# attention's eager path is the other): the op audit sees it where the math fallback ran.
_MATH_ATTENTION_MARK = "aten::_safe_softmax"


def _cpu_attention_fallback(result: AmpResult) -> bool:
    """Whether the recipe's run took scaled_dot_product_attention's math fallback on the CPU with its
    matmuls left in fp32: the fallback computes bf16/fp16 inputs in fp32 there (attention_advice.py),
    and a trial's %%amp blamed "ops autocast keeps in fp32" and "inputs cast back" for it."""
    ops = result.amp.ops
    return (result.device.type == "cpu" and not ops.empty and _MATH_ATTENTION_MARK in set(ops["op"])
            and "aten::bmm" in result.precision["heavy_fp32"])


def _compare_how(dtype: str) -> str:
    """How to find the op that lost: two profiles of the cell, compared op by op (`profile_compare`)."""
    if in_magic():
        return (f"%%profile_gpu -r p32 on the cell, then %%profile_gpu --amp {dtype} --compare p32, names the ops "
                "that got slower")
    return (f'profiling the code with nbaccel.profile() and with nbaccel.profile(amp="{dtype}"), then '
            "nbaccel.compare_profiles(first.result, second.result), names the ops that got slower")


def _attention_fallback_note(dtype: str) -> str:
    return (f"scaled_dot_product_attention ran torch's math fallback ({_MATH_ATTENTION_MARK} is its op), not a "
            f"fused kernel: on the CPU it computes {dtype} inputs in fp32, so its aten::bmm calls stayed fp32 "
            "under autocast. Common causes: dropout_p > 0 (the CPU's fused kernel takes no dropout; "
            "nn.TransformerEncoderLayer and nn.MultiheadAttention pass theirs, 0.1 by default, in train mode), q/k/v "
            "head dims that differ, inputs that are not 4-D; one call under "
            "torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION) makes torch say which.")


MUCH_SLOWER = 0.5  # a speedup under this is a slowdown of 2x or more: "gain little" no longer says it


def _fp16_conv_backward(result: AmpResult) -> list[str]:
    """The fp16 convolution backward ops of the audit (the CPU's slow fp16 path), as their names."""
    ops = result.amp.ops
    if ops.empty:
        return []
    rows = ops.loc[ops["heavy"] & (ops["dtype"] == "fp16"), "op"]
    return sorted({op for op in rows if "convolution_backward" in op})


def _no_speedup(result: AmpResult, speedup: float, dtype: str) -> str:
    """The advice for a speedup under `NO_SPEEDUP_BELOW` (1.05x). A cause read from the op audit or the
    CPU's features is a fact whatever the timing; "too small or memory-bound" is read from the timing
    itself, so it is said only when the times are firm (no overlap, no contention)."""
    info, precision = result.device, result.precision
    hedge = _unfirm_timing(result)
    if info.type == "cpu" and not info.has_units(dtype):
        # Not "only adds casts": on an AVX2-only EPYC the casts were 1.8% of a bf16 MLP step and its emulated
        # bf16 aten::mm 15.7x fp32's (a trial); on an Ice Lake too the kernels, not the casts, are the cost.
        fact = (f"this CPU lacks {dtype} units (AMX / AVX512-{dtype.upper()}), so its {dtype} matmuls and convolutions "
                "run emulated kernels, slower than fp32's, and autocast adds casts. "
                "Measure on a GPU with Tensor Cores.")
    elif info.type == "cpu" and dtype == "fp16" and not info.cpu_features.get("amx_fp16"):
        # AVX512-FP16 counts as fp16 units, but without AMX-FP16 oneDNN's fp16 matmuls run on vector
        # units (on the project's VM, Sapphire Rapids: a 1024^3 matmul in fp16 6.0 ms, fp32 6.1 ms,
        # bf16 on AMX 1.6 ms), so "try a larger batch" sent a trial user the wrong way. Its fp16
        # convolution weight gradient is far worse (`python -m benchmarks.bench_cpu_fp16`: 304x fp32 there),
        # which a trial's CNN step met as fp16 20x slower than fp32, and "gain little" was no description.
        fact = ("this CPU has no AMX-FP16 (matrix units for fp16): its fp16 matmuls run on AVX512-FP16 "
                "vector units, which gain little over fp32")
        if speedup < MUCH_SLOWER and hedge is None:  # read from the times: said only when they are firm (a review)
            convs = _fp16_conv_backward(result)
            fact = (f"fp16 is {1 / speedup:.1f}x slower than fp32 here. " + fact[0].upper() + fact[1:]
                    + (", and oneDNN's fp16 convolution backward (here: " + ", ".join(convs) + ") takes a far slower "
                       "path than fp32's" if convs else ", and some of its fp16 kernels take far slower paths")
                    + f"; {_compare_how(dtype)}")
        fact += (f". It has AMX-BF16: use {option('dtype', 'bf16')}." if info.cpu_features.get("amx_bf16")
                 else ".")
    elif precision["reduced_flop_share"] is not None and precision["reduced_flop_share"] < 0.5:
        # the fallback's bmm calls are among the fp32 ones, not known to be all of them (a review: a cell's own
        # bmm under autocast(enabled=False) beside it had 8x their FLOPs)
        fact = (f"only {precision['reduced_flop_share']:.0%} of the FLOPs ran in {dtype}; "
                + ("its heavy ops ran in fp32, scaled_dot_product_attention's math fallback among them (see below)."
                   if _cpu_attention_fallback(result) else "the time goes to ops autocast keeps in fp32."))
    else:
        fact = None  # the cause below is inferred from the times
    if fact is None and result.worker_loaders:  # the start-up named above, not the batch size
        fact = ("the DataLoader workers' start and stop (see above) may be most of each run; time the step "
                "without them before reading a speedup.")
    if hedge is None:
        # "try a larger batch" alone sent a trial's GPT step there, whose bf16 slowdown was one op (the CPU's
        # bf16 flash-attention backward, 8.7x its fp32 time) at any batch size
        return f"No speedup ({format_ratio(speedup)}): " + (fact or f"the work is too small or memory-bound for {dtype} to "
                                                   f"pay for its casts (try a larger batch), or an op runs slower in "
                                                   f"{dtype} here: {_compare_how(dtype)}.")
    note = f"No speedup measured ({format_ratio(speedup, firm=False)}), but {hedge}."  # hedged: two digits
    return note + (" " + _sentence(fact) if fact else "")


def _sentence(text: str) -> str:
    """``text`` as a sentence's start: its first letter upper-cased, but not a dtype's ("Fp16 is ...": a review)."""
    return text if text.startswith(("fp16", "bf16", "fp32", "tf32")) else text[0].upper() + text[1:]


# GradScaler's check of the gradients (GradScaler.unscale_), as the op audit names it.
_SCALER_CHECK = "aten::_amp_foreach_non_finite_check_and_unscale_"


def _bf16_scaler_note(result: AmpResult) -> str:
    """A GradScaler used under bf16: not needed there, and not free."""
    ops = result.amp.ops
    calls = int(ops.loc[ops["op"] == _SCALER_CHECK, "calls"].sum()) if not ops.empty else 0
    seen = f" ({_SCALER_CHECK}: {calls} call{'s' if calls != 1 else ''} in this step)" if calls else ""
    bf16 = torch.finfo(torch.bfloat16)
    return (f"The cell scales its loss with a torch.amp.GradScaler, which bf16 does not need: bf16 has fp32's exponent "
            f"range (smallest normal {bf16.tiny:.2g}, largest {bf16.max:.2g}), so its gradients do not underflow or "
            f"overflow as fp16's do. The scaler still checks every gradient for inf/NaN{seen} and reads the result "
            "on the host in scaler.step() each step; for bf16, make it with torch.amp.GradScaler(enabled=False) "
            "(the same code, every call a pass-through) or drop it.")


# Restores of the variables taking this many times as long as the runs (at the slower variant's median
# run each), and RESTORE_NOTE_SECONDS in all, earn an advice line: the comparison's time is mostly restoring.
RESTORE_DOMINATES = 2.0
RESTORE_NOTE_SECONDS = 0.5


def _restore_note(result: AmpResult) -> str | None:
    """When restoring the snapshot costs far more than the runs: what that did to the comparison's time,
    and the ways out. A user trial: Embedding(400000, 256, sparse=True) + SparseAdam, a 1.15 GiB snapshot;
    --repeat 5 of a 7 ms step took 8.49 s, 0.25 s with --no-restore."""
    restores = result.restore_times
    medians = [v.median for v in (result.baseline, result.amp) if v is not None and v.times.times]
    if not restores or not medians:
        return None
    spent, run = sum(restores), max(medians)
    if spent < RESTORE_NOTE_SECONDS or spent < RESTORE_DOMINATES * run * len(restores):
        return None
    each = (format_seconds(restores[0]) if len(restores) == 1 else
            f"{format_seconds(min(restores))} to {format_seconds(max(restores))} each")
    return (f"Restoring your variables before each run (a {format_bytes(result.snapshot_bytes)} host snapshot) took "
            f"{format_seconds(spent)} in all over {len(restores)} runs ({each}), where the slower variant's median run "
            f"takes {format_seconds(run)}: the comparison's time went mostly to restoring. "
            f"{'--no-restore' if in_magic() else 'restore=False'} skips it, at a cost: each run then starts from what "
            "the one before left, so the variants do not start from the same state and the drift and gradients "
            "compare different steps. Or make the snapshot smaller: del the tensors the cell does not use (every "
            "tensor in the namespace is copied), or keep large state, such as a big embedding table and its "
            "optimizer state, out of the namespace the cell runs in.")


def _reduced_result_note(result: AmpResult) -> str | None:
    """The kept run ran under the recipe, so what it returned is in its dtype: said, since the cell's output
    (and ``res.value``) reads like the cell's own result and later fp32 work on it rounds to bf16 (a trial
    kept an inference cell's bf16 logits with nothing saying so)."""
    if result.amp.recipe.autocast_dtype is None:
        return None
    reduced = reduced_float_leaves(result.value)
    if not reduced:
        return None
    dtypes = and_list(sorted({str(dtype).replace("torch.", "") for _, dtype in reduced}))
    where = "The cell's output" if in_magic() else "res.value"
    paths = [path for path, _ in reduced]
    what = (f"{where} is {dtypes}" if paths == ["value"] else
            f"{where} holds {dtypes} tensors ({and_list(paths[:3])}{f' and {len(paths) - 3} more' if len(paths) > 3 else ''})")
    return (f"{what}: it is the kept {result.amp.name} run's. Call .float() on it before fp32 work, or run the "
            "code without the recipe; what the code assigned holds that run's values too.")


def advise(result: AmpResult) -> list[str]:
    """One line per finding, each backed by a number in the result."""
    notes = []
    info, speedup = result.device, result.speedup
    dtype = result.amp.name
    autocast = result.amp.recipe.autocast_dtype is not None  # False for the TF32-only recipe
    label = f"{dtype} autocast" if autocast else dtype.upper()
    state_reason = _state_reason(result)
    drift = result.drift
    if result.iterators:
        notes.append(_iterator_note(result.iterators))
    if result.worker_loaders:
        notes.append(_worker_loader_note(result.worker_loaders))
    if result.optimizer_state_created:
        notes.append(_first_step_note(result.optimizer_state_created))
    if result.compiled_while_timed:
        notes.append(_compiled_while_timed_note(result))
        speedup = None  # the compiler's time, not the step's: the note is the finding, not a speed verdict
    if result.compiled:
        notes.append(_compiled_note(result.compiled))
    if result.outer_autocast:
        notes.append(_outer_autocast_note(result, dtype))
    if result.fp32_relaxed_by_cell:
        notes.append(_relaxed_in_baseline(result))
    own = _reduced_in_baseline(result)
    if own:
        notes.append(own)
        speedup = None  # the same code timed twice: the note above is the finding, not a speed verdict
    if state_reason and (_drift_differs(drift) or tokens_differ(result.tokens)):
        # Precision is not to blame for a difference that state or plain Python made.
        verdict = ("the difference comes from state that changed between runs, not from precision"
                   if result.amp.ops.empty else "the difference may come from state that changed between runs "
                   "rather than from precision, so it is no measure of accuracy")
        size = (_tokens_size(result.tokens) if not _drift_differs(drift)
                else f"max rel {drift['max_rel']:.1%}" if drift["max_rel"] is not None
                else f"max abs {drift['max_abs']:.2e}")
        notes.append(f"The fp32 and {dtype} results differ ({size}), but {state_reason}: "
                     f"{verdict}.")
    elif result.state_changed and not result.iterators:  # the iterator line says it
        notes.append(f"Careful: {state_reason}; the runs did not all start from the same state.")
    if result.audit_differs:
        notes.append(f"The audited {dtype} run returned other dtypes than the kept run: an op ran otherwise under the "
                     "op audit (a TorchDispatchMode; torch.sparse.mm does under autocast), so the dtypes per op, the "
                     "share of FLOPs in reduced precision and the gradient report describe the audited run, not the "
                     "timed ones. The drift compares the fp32 run with the kept run, which ran as the timed ones.")
    kept = _reduced_result_note(result)
    if kept:
        notes.append(kept)
    if result.not_copied and result.restored:
        # Said after a comparison that succeeded too (an abandoned one's note names them already): the
        # promise "your variables as after one run" does not hold for these.
        it = "it" if len(result.not_copied) == 1 else "them"
        notes.append(f"Not restored between runs (nbaccel could not copy {it}): {', '.join(result.not_copied)}. If "
                     f"the cell changes {it}, each run started from what the run before left, and {it} now "
                     f"{'holds' if it == 'it' else 'hold'} what all the runs did, not one run.")
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
        notes.append("The cell ran no torch operators (on the thread that runs it: autocast and the op audit do not "
                     "reach threads it starts), so autocast had nothing to change: %%amp compares torch code (the "
                     "times are of plain Python).")
        speedup = None  # a "speedup" of plain Python is noise; say nothing more about it
    heavy_named = False  # whether the verdict below names the heavy ops that stayed fp32
    if result.nothing_cast and speedup is not None:
        # A fact of the op audit, whatever the times: before "too few runs to rank", which left a cell
        # whose recipe cast nothing without the reason (its tests passed or failed with the timing).
        notes.append(_same_kernels(result, speedup, dtype))
        heavy_named = _why_nothing_cast(result) == "fp32"
        speedup = None
    if result.nonfinite_result:
        speedup = None  # a wrong answer faster is not a finding: the overflow note above is the advice
    if speedup is not None and too_few_runs(result):
        runs = min(len(result.baseline.times.times), len(result.amp.times.times))
        notes.append(f"{runs} timed run{'s' if runs != 1 else ''} per variant cannot rank the two "
                     f"({format_ratio(speedup)} measured): use {option('repeat', 5)} or more (at least {MIN_RUNS}).")
        speedup = None
    if speedup is not None:
        if speedup < NO_SPEEDUP_BELOW:
            notes.append(_no_speedup(result, speedup, dtype))
        else:
            unfirm = _unfirm_timing(result)
            if unfirm is None:
                line = f"{label} is {speedup:.2f}x faster here."
            elif not result.speedup_uncertain and not result.spread_too_wide:
                # Not "is faster": the warning says other programs took the CPU during the timed runs.
                line = (f"{label} measured {format_ratio(speedup, firm=False)} faster, but while other programs "
                        "competed for the CPU (see the warning): re-run when the machine is quiet before relying on it.")
            else:  # the headline says "uncertain"; the advice says why and what settles it (a trial found it silent)
                line = f"{label} measured {format_ratio(speedup, firm=False)} faster, but {unfirm} before relying on it."
            notes.append(line + _without_units(info, dtype))
    unaligned = _significant_unaligned(result)
    dims = sorted({d for m in unaligned for d in m["unaligned"] if padding_worth_it(d)})[:6]
    if dims:
        notes.append("Matmul dims " + ", ".join(map(str, dims)) + " are not multiples of 8; pad them (e.g. to "
                     + ", ".join(str(-(-d // 8) * 8) for d in dims) + ") " + _what_padding_feeds(info, dtype) + ".")
    heavy = result.heavy_fp32_calls if autocast else []
    # The fallback's bmm calls are among the fp32 ones, not known to be all of them: the op audit cannot tell
    # them from the cell's own (a review: a bmm under autocast(enabled=False) beside it, 8x their FLOPs).
    fallback = bool(heavy) and autocast and _cpu_attention_fallback(result)
    if fallback:
        notes.append(_attention_fallback_note(dtype))
    if heavy and not heavy_named:
        why = ("the math fallback's bmm calls above among them; any others had their inputs cast back, or ran "
               "outside the autocast region" if fallback else "their inputs were cast back, or they ran outside the "
               "autocast region")
        notes.append("Heavy ops still in fp32 under autocast: " + ", ".join(heavy) + f" ({why}).")
    grads = result.gradients
    if grads and grads["dtype"] == "fp16" and not result.nonfinite_result:
        if grads["overflow_tensors"] and not grads["grad_scaler"]:
            notes.append(f"fp16 gradients overflowed (inf/NaN in {grads['overflow_tensors']} tensors): "
                         "use torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()).")
        elif grads["underflow_fraction"] and grads["underflow_fraction"] > 0.001 and not grads["grad_scaler"]:
            notes.append(f"{grads['underflow_fraction']:.1%} of the nonzero fp32 gradient entries became 0 in fp16 "
                         "(underflow): use torch.amp.GradScaler.")
        elif not grads["grad_scaler"] and grads["underflow_elements"]:
            # measured in this very step: a trial read "small gradients can underflow later" right under
            # "underflow: 2081 entries nonzero in fp32 became 0 in fp16 (0.054%)"
            n = grads["underflow_elements"]
            notes.append(f"fp16 training without torch.amp.GradScaler: no overflow this step, and {n} gradient "
                         f"entr{'y' if n == 1 else 'ies'} ({grads['underflow_fraction']:.3%} of the nonzero ones) "
                         "underflowed to 0 this step: a GradScaler scales the loss so they stay representable.")
        elif not grads["grad_scaler"]:
            notes.append("fp16 training without torch.amp.GradScaler: no overflow this step, but small gradients "
                         "can underflow later; GradScaler guards against it.")
    if grads and grads["dtype"] == "bf16" and grads["grad_scaler"]:
        notes.append(_bf16_scaler_note(result))
    if drift and drift["max_rel"] is not None and drift["max_rel"] > 0.05 and not state_reason:
        notes.append(f"The result moved by {result.drift['max_rel']:.1%} (relative) under {dtype}; check that "
                     "this accuracy is acceptable (e.g. keep loss/softmax in fp32).")
    if drift and not state_reason:
        notes += _near_zero_notes(result, drift, dtype)
    mem = result.memory_saving
    if mem is not None and result.memory_comparable:
        sizes = f"{format_bytes(result.baseline.memory.peak_bytes)} -> {format_bytes(result.amp.memory.peak_bytes)}"
        if not result.memory_firm and abs(mem) > 0.05:
            notes.append(f"No firm memory difference: the median peaks differ by {abs(mem):.0%} ({sizes}), but the "
                         f"runs overlap ({memory_ranges(result)}); the process's peak RSS moves by that much "
                         "between runs of the same cell.")
        elif result.memory_firm and mem > 0.05:
            notes.append(f"Peak memory {mem:.0%} lower ({sizes}).")
        elif result.memory_firm and mem < -0.05 and autocast:
            # The peak is measured, what filled it is not: the usual cause is named as one, not asserted.
            # weights copies need a backward to keep them: a trial's forward-only attention cell (no
            # weights at all) was told of them
            cause = (f"autocast keeps {dtype} copies of fp32 weights for the backward pass" if result.gradients else
                     f"autocast makes {dtype} copies of the inputs of each op it casts, beside the fp32 originals "
                     "the cell still holds")
            notes.append(f"Peak memory {-mem:.0%} higher under {dtype} ({sizes}). A common cause (not measured "
                         f"here): {cause}.")
    restoring = _restore_note(result)
    if restoring:
        notes.append(restoring)
    if info.type == "cpu":
        notes.append(describe(info, dtype) + ". These are CPU figures, not GPU ones.")
    return notes


__all__ = ["advise"]
