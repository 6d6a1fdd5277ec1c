"""Time that is not the cell's own math: torch.compile compiling, compiled regions, the DataLoader,
the optimizer's step.

Found by the names torch (2.13) gives its profiler events, recorded on the CPU and checked against
the reference CUDA traces (tests/data/README.md, "phase traces"):

* **compiling**: dynamo and inductor wrap each compile step in a ``cpu_op`` range named
  ``"<step> (dynamo_timed)"`` (``Scheduler.codegen (dynamo_timed)``, ``async_compile.wait
  (dynamo_timed)``...), inside outer ranges named ``dynamo`` (the frame's compile, forward graph)
  and ``inductor_compile`` (also the backward graph's, compiled lazily inside
  ``CompiledFunctionBackward`` on the first backward). Every op recorded inside such a range is
  compile work: dynamo and AOTAutograd trace the model on fake tensors (shapes, no data), so those
  ``aten::mm`` calls did no math and their FLOPs are not counted.
* **compiled region**: the compiled code's runtime wrappers (``Torch-Compiled Region: 0/0``,
  ``CompiledFunction``, ``CompiledFunctionBackward``, guard checks). On the CPU inductor's fused
  C++ kernels run inside them without an op of their own (the ``## Call CompiledFxGraph ... ##``
  range around them is a ``user_annotation``, not an op), so their time is these ops' self time.
  On CUDA the fused ``triton_*`` kernels are device activities with their own categories.
* **data loading**: a DataLoader iterator's ``__next__`` is a ``record_function`` range
  (``enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__``), a ``user_annotation``, so no
  op table row holds its time. With workers it is the main process waiting for a batch (plus the
  workers' start and shutdown in the first and last call); without workers the loading itself, the
  collate's ``aten::stack`` ops nested inside it.

* **optimizer step**: ``Optimizer.step#<Class>.step`` is a ``user_annotation`` range too. On the CPU
  torch.optim's default for-loop update is plain ops (``aten::lerp_``, ``aten::addcdiv_``...), whose
  names do not say "optimizer" as fused and foreach kernels' do: the ops inside the range are the
  optimizer's, unless the range holds a matmul, convolution or attention op: then the step ran a
  closure (LBFGS; ``optimizer.step(closure)``, as PyTorch Lightning calls it), the model's forward and
  backward, and its ops keep their own categories.
* **optimizer state**: ``torch.optim`` optimizers create their state lazily, in their first
  ``step()``, inside its ``Optimizer.step#<Class>.step`` range (a ``user_annotation``): Adam, AdamW,
  NAdam, RAdam, Adamax, RMSprop, Adadelta, Rprop, ASGD, Adafactor call ``aten::zeros_like`` /
  ``aten::zeros`` / ``aten::full_like`` / ``aten::new_zeros`` (fused AdamW too), SGD with momentum
  ``aten::clone`` (its momentum buffer). Recorded on torch 2.13 (CPU), steps 1-3 of each: those ops
  ran in the first step only, and none of them in a later step, while Rprop and Adafactor clone on
  every step (so ``aten::clone`` counts for SGD only). Another optimizer class counts only
  ``zeros_like`` / ``full_like`` (a per-step ``torch.zeros(1)`` is scratch). LBFGS is left out: its step runs the closure,
  the model's forward and backward, inside the range. On CUDA only later steps were checked: the
  A100 reference trace's five ``Optimizer.step#FusedAdam.step`` (apex) hold none of these ops.

`op_phases` names each op's phase (None for the cell's own work); `data_loading_gaps` is the time
inside DataLoader ranges that no op covers. Together they give the CPU category breakdown those
times, each counted once: an op's self time goes to its phase instead of its own category.
`optimizer_state_rows` finds the ops that created optimizer state (the advice's evidence that a
profile holds an optimizer's first step).
"""

from __future__ import annotations

import bisect
import re

from .sums import intervals_union

COMPILING = "compiling"
COMPILED = "compiled region"
DATA_LOADING = "data loading"
OPTIMIZER = "optimizer"  # the category kernels.op_category gives fused and foreach optimizer ops

# The outer compile ranges and every dynamo_timed step (the steps are nested in the outer ones; the
# outer ones alone would miss a step recorded without them, e.g. a recompile started elsewhere).
_COMPILE = re.compile(r" \(dynamo_timed\)$|^(?:dynamo|inductor_compile|entire_frame_compile|entire_backward_compile"
                      r"|backend_compile|compile_fx_inner)$")
_COMPILED = re.compile(r"^Torch-Compiled Region|CompiledFunction|^## Call CompiledFxGraph|^TorchDynamo Cache Lookup$"
                       r"|^AOTDispatcher Runtime Wrapper|^Pregraph bytecode$")
_DATALOADER = re.compile(r"^enumerate\(DataLoader\)#")
_OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#(.+)\.step$")
_STATE_OPS = frozenset({"aten::zeros_like", "aten::zeros", "aten::full_like", "aten::new_zeros"})
# The torch.optim classes whose first and later steps were recorded (module docstring). Another
# optimizer may make scratch tensors in every step (timm's Lamb: ``torch.zeros(1)`` for the grad
# norm, read as "first step" in every profile of it by a review): only ops shaped like a parameter
# count for it.
_CHECKED = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adadelta", "Rprop", "ASGD", "Adafactor")
_STATE_OPS_BY_OPTIMIZER = {**dict.fromkeys(_CHECKED, _STATE_OPS), "SGD": _STATE_OPS | {"aten::clone"},
                           "LBFGS": frozenset()}
_PARAMETER_SHAPED = frozenset({"aten::zeros_like", "aten::full_like"})


def is_compiling(name: str) -> bool:
    return bool(_COMPILE.search(name or ""))


def is_compiled_region(name: str) -> bool:
    return bool(_COMPILED.search(name or ""))


def is_dataloader(name: str) -> bool:
    return bool(_DATALOADER.search(str(name or "")))


def compile_flags(names: list, parent: list) -> list[bool]:
    """Whether each op is a compile range or recorded inside one (``parent``: row of the enclosing op)."""
    return _self_or_ancestor(parent, lambda j: is_compiling(names[j]))


def _self_or_ancestor(parent: list, is_it) -> list[bool]:
    """Whether each op, or one of the ops it is nested in, ``is_it(row)``; each row looked at once."""
    return _nearest_verdict(parent, lambda j: True if is_it(j) else None)


def _nearest_verdict(parent: list, verdict) -> list[bool]:
    """For each op, the ``verdict(row)`` (True / False; None: none, look further out) of the op itself
    or of the nearest op it is nested in that has one, False where none has; each row looked at once."""
    flags: list = [None] * len(parent)
    for i in range(len(parent)):
        chain = []
        j = i
        while j >= 0 and flags[j] is None:
            found = verdict(j)
            if found is not None:
                flags[j] = found
                break
            chain.append(j)
            j = parent[j]
        inside = j >= 0 and flags[j]
        for k in chain:
            flags[k] = inside
    return flags


def inside_rows(parent: list, rows) -> list[int]:
    """``rows`` and every op nested in one of them (``parent``: row of the enclosing op)."""
    rows = set(rows)
    return [i for i, f in enumerate(_self_or_ancestor(parent, rows.__contains__)) if f]


def self_time_by_name(cols: dict, rows: list[int]) -> dict[str, float]:
    """Self time (us) of ``rows`` summed by op name, largest first."""
    out: dict[str, float] = {}
    for i in rows:
        out[cols["name"][i]] = out.get(cols["name"][i], 0.0) + cols["self_us"][i]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def compile_ranges(cols: dict, flags: list[bool]) -> list[tuple[float, float]]:
    """(start, end) of each outermost compile range: a compile op whose parent is not one."""
    parent, ts, dur = cols["parent"], cols["ts_us"], cols["dur_us"]
    return [(ts[i], ts[i] + dur[i]) for i, f in enumerate(flags)
            if f and (parent[i] < 0 or not flags[parent[i]])]


def dataloader_ranges(ann: dict) -> dict[tuple, list[tuple[float, float]]]:
    """Host DataLoader ``__next__`` ranges per (pid, tid), sorted by start."""
    return {k: [r[:2] for r in v] for k, v in _host_ranges(ann, is_dataloader).items()}


def _host_ranges(ann: dict, is_it) -> dict[tuple, list[tuple[float, float, str]]]:
    """Host annotation ranges whose name ``is_it``, per (pid, tid): (start, end, name), sorted by start."""
    out: dict[tuple, list] = {}
    for name, pid, tid, ts, dur, dev in zip(ann["name"], ann["pid"], ann["tid"], ann["ts_us"], ann["dur_us"],
                                            ann["on_device"]):
        if not dev and is_it(name):
            out.setdefault((pid, tid), []).append((float(ts), float(ts) + float(dur), str(name)))
    return {k: sorted(v) for k, v in out.items()}


def optimizer_steps(ann: dict) -> list[str]:
    """The optimizer class of each host ``Optimizer.step#<Class>.step`` range, in no set order."""
    return [m.group(1) for name, dev in zip(ann["name"], ann["on_device"])
            if not dev and (m := _OPTIMIZER_STEP.match(str(name or "")))]


def optimizer_state_rows(cols: dict, ann: dict) -> dict[int, tuple]:
    """The ops that created optimizer state (see the module docstring), row -> (optimizer class, its
    step range as (pid, tid, start)): each such op inside an ``Optimizer.step#<Class>.step`` range on
    its thread, outermost only (the ``aten::zero_`` inside ``aten::zeros_like`` is part of it, not
    another one)."""
    steps = _host_ranges(ann, lambda name: bool(_OPTIMIZER_STEP.match(str(name or ""))))
    if not steps:
        return {}
    starts = {k: [r[0] for r in v] for k, v in steps.items()}
    names, found = cols["name"], {}
    for i, name in enumerate(names):
        key = (cols["pid"][i], cols["tid"][i])
        if (name not in _STATE_OPS and name != "aten::clone") or key not in steps:
            continue
        ts, end = cols["ts_us"][i], cols["ts_us"][i] + cols["dur_us"][i]
        k = bisect.bisect_right(starts[key], ts) - 1
        if k < 0 or end > steps[key][k][1]:
            continue
        optimizer = _OPTIMIZER_STEP.match(steps[key][k][2]).group(1)
        if name in _STATE_OPS_BY_OPTIMIZER.get(optimizer, _PARAMETER_SHAPED):
            found[i] = (optimizer, (*key, steps[key][k][0]))
    outermost = {}
    for i, optimizer in found.items():
        j = cols["parent"][i]
        while j >= 0 and j not in found:
            j = cols["parent"][j]
        if j < 0:
            outermost[i] = optimizer
    return outermost


def _inside(ranges: list[tuple[float, float]], starts: list[float], ts: float, end: float) -> bool:
    k = bisect.bisect_right(starts, ts) - 1
    return k >= 0 and end <= ranges[k][1]


# Attention ops that hold their q/k/v and output projections too: nn.MultiheadAttention's inference fast
# path (eval, no grad) runs them as aten::mm / aten::addmm inside it, where the training path runs them as
# aten::linear beside the attention op. A trial's eval-mode encoder read "attention 46%" (in train: 11%),
# two thirds of it the projections' matmuls.
_ATTENTION_BLOCKS = frozenset({"aten::_native_multi_head_attention"})
_PROJECTIONS = frozenset({"aten::mm", "aten::addmm", "aten::linear", "aten::_addmm_activation", "aten::matmul"})


def inside_attention(categories: list, parent: list, names: list | None = None) -> list[bool]:
    """Whether each op runs inside an attention op (``parent``: row of the enclosing op). The CPU's
    ``scaled_dot_product_attention`` runs its math as child ops (``aten::bmm``, ``aten::_softmax``...):
    a user trial read "attention 0.1 %" for a transformer whose attention matmuls were filed under
    matmul/conv. (CUDA's breakdown is by kernel, and its fused attention kernels are attention already.)
    The projections inside an attention block (`_ATTENTION_BLOCKS`, given ``names``) are not its
    attention: they, and what they run, keep their own categories."""
    blocks = names is not None and not _ATTENTION_BLOCKS.isdisjoint(names)  # C-speed: most profiles have none
    projections = set()  # rows of projections inside an attention block
    if blocks:
        for i, name in enumerate(names):
            if name in _PROJECTIONS:
                j = parent[i]
                while j >= 0 and categories[j] != "attention":
                    j = parent[j]
                if j >= 0 and names[j] in _ATTENTION_BLOCKS:
                    projections.add(i)
    # whether what each op runs is attention's: the nearest attention op (yes) or projection (no) around it
    scope = _nearest_verdict(parent, lambda j: True if categories[j] == "attention" else False if j in projections
                             else None)
    return [p >= 0 and bool(scope[p]) and i not in projections for i, p in enumerate(parent)]


def inside_normalization(categories: list, parent: list) -> list[bool]:
    """Whether each op runs inside a normalization op: the CPU's ``aten::rms_norm`` (nn.RMSNorm) runs its math as
    child ops (``aten::pow``, ``mean``, ``rsqrt``, ``mul``), and a trial read RMSNorm's forward as "elementwise"
    beside "normalization 2%". (Its backward runs as the autograd nodes of those ops, outside any norm op:
    `in_backward_of` finds them.)"""
    if "normalization" not in categories:  # C-speed: most profiles have no norm op
        return [False] * len(parent)
    scope = _nearest_verdict(parent, lambda j: True if categories[j] == "normalization" else None)
    return [p >= 0 and bool(scope[p]) for p in parent]


def backward_node_makers(cols: dict, wanted=None) -> dict[int, int]:
    """Autograd node row -> the row of the forward op that made it: the node carries the forward op's
    sequence number (the profiler's "Sequence number"; forward ops have "Fwd thread id" 0, a backward
    node the forward thread's), and so does every op recorded until the next node is made, so a node's
    forward op is the last forward op with its number that started before it (that op, or one nested in
    it). ``wanted(row)``: keep only the nodes whose maker it accepts. Empty for a trace without the numbers."""
    seq, fwd = cols.get("sequence"), cols.get("forward_tid")
    if not seq or all(s is None for s in seq):
        return {}
    maker: dict = {}  # sequence number -> row of the last forward op with it so far
    nodes: dict[int, int] = {}
    for i in sorted(range(len(seq)), key=cols["ts_us"].__getitem__):
        if seq[i] is None:
            continue
        if not fwd[i]:
            maker[seq[i]] = i
        elif seq[i] in maker and (wanted is None or wanted(maker[seq[i]])):
            nodes[i] = maker[seq[i]]
    return nodes


def in_backward_of(cols: dict, forward: list[bool]) -> list[bool]:
    """Whether each op runs in the backward of an op flagged in ``forward``: the autograd nodes those
    ops made (`backward_node_makers`) and every op nested in one. A CPU RMSNorm's backward is the nodes
    of its ``pow``/``mean``/``rsqrt``/``mul`` (``PowBackward0``...), outside any norm op: a trial's
    breakdown filed it under elementwise and reduction, the forward under normalization."""
    n = len(cols["name"])
    nodes = backward_node_makers(cols, forward.__getitem__) if any(forward) else {}
    if not nodes:
        return [False] * n
    return _nearest_verdict(cols["parent"], lambda j: True if j in nodes else None)


def optimizer_step_ranges(ann: dict) -> dict[tuple, list[tuple[float, float]]]:
    """Host ``Optimizer.step#<Class>.step`` ranges per (pid, tid), sorted by start; LBFGS's left out
    (its step runs the closure: the model's forward and backward are not optimizer work)."""
    def is_step(name) -> bool:
        m = _OPTIMIZER_STEP.match(str(name or ""))
        return bool(m) and m.group(1) != "LBFGS"

    return {k: [r[:2] for r in v] for k, v in _host_ranges(ann, is_step).items()}


def foreach_rows_outside_steps(cols: dict, ann: dict) -> set[int]:
    """Rows of the ``aten::_foreach_*`` ops outside every ``Optimizer.step`` range on their thread:
    grad clipping's norms and scaling (``clip_grad_norm_``'s ``_foreach_norm`` and ``_foreach_mul_``),
    a cell's own foreach math. On CUDA their kernels are the optimizers' ``multi_tensor_apply_kernel``,
    whose name alone reads as an optimizer's (see `trace._foreach_kernels_by_their_op`)."""
    ranges = optimizer_step_ranges(ann)
    starts = {key: [r[0] for r in rs] for key, rs in ranges.items()}
    rows = set()
    for i, name in enumerate(cols["name"]):
        if not name.startswith("aten::_foreach_"):
            continue
        key, ts = (cols["pid"][i], cols["tid"][i]), cols["ts_us"][i]
        if key not in ranges or not _inside(ranges[key], starts[key], ts, ts + cols["dur_us"][i]):
            rows.add(i)
    return rows


# Ops no optimizer update runs: a step range that holds one ran the model (a closure: LBFGS, and
# ``optimizer.step(closure)`` as PyTorch Lightning calls every optimizer).
_MODEL_MATH = frozenset({"matmul/conv", "attention"})


def _without_model_math(ranges: dict[tuple, list[tuple[float, float]]], cols: dict) -> dict:
    """The step ranges in which no matmul, convolution or attention op ran (a review: Adam.step(closure)
    filed the forward's and backward's matmuls, the whole step, under optimizer)."""
    closures = set()
    for i, category in enumerate(cols["category"]):
        key = (cols["pid"][i], cols["tid"][i])
        if category not in _MODEL_MATH or key not in ranges:
            continue
        ts = cols["ts_us"][i]
        closures.update((key, r) for r in ranges[key] if r[0] <= ts and ts + cols["dur_us"][i] <= r[1])
    kept = {key: [r for r in rs if (key, r) not in closures] for key, rs in ranges.items()}
    return {key: rs for key, rs in kept.items() if rs}


def op_phases(cols: dict, ann: dict) -> list[str | None]:
    """Each op's phase: COMPILING (in a compile range), DATA_LOADING (in a DataLoader range on its
    thread), OPTIMIZER (in an ``Optimizer.step`` range on its thread: on the CPU the optimizers'
    for-loop update is plain ``aten::lerp_``/``addcdiv_``/``sqrt`` ops, a numbers audit's AdamW step
    spent 35-49 % of its time there, all filed under "elementwise"), "attention" (inside an attention
    op: its math, or in its backward), "normalization" (inside a norm op or its backward: RMSNorm's math
    on the CPU), else None. Compiling wins: a DataLoader never runs inside a compile."""
    flags = cols["compiling"] if "compiling" in cols else compile_flags(cols["name"], cols["parent"])
    cats = cols["category"]
    attention = inside_attention(cats, cols["parent"], cols["name"])
    norm = inside_normalization(cats, cols["parent"])
    # and their backward, which runs outside them (autograd nodes of the ops they ran)
    attention_bw = in_backward_of(cols, [a or c == "attention" for a, c in zip(attention, cats)])
    norm_bw = in_backward_of(cols, [m or c == "normalization" for m, c in zip(norm, cats)])
    attention = [a or b for a, b in zip(attention, attention_bw)]
    norm = [m or b for m, b in zip(norm, norm_bw)]
    ranges = {DATA_LOADING: dataloader_ranges(ann), OPTIMIZER: _without_model_math(optimizer_step_ranges(ann), cols)}
    starts = {phase: {k: [r[0] for r in v] for k, v in by_thread.items()} for phase, by_thread in ranges.items()}
    out: list[str | None] = []
    for i, f in enumerate(flags):
        key = (cols["pid"][i], cols["tid"][i])
        ts, end = cols["ts_us"][i], cols["ts_us"][i] + cols["dur_us"][i]
        inside = next((phase for phase, by_thread in ranges.items()
                       if key in by_thread and _inside(by_thread[key], starts[phase][key], ts, end)), None)
        out.append(COMPILING if f else inside or ("attention" if attention[i] else "normalization" if norm[i] else None))
    return out


def data_loading_gaps(cols: dict, ann: dict) -> list[float]:
    """Per DataLoader range, the time no op on its thread covers (waiting for a worker, Python
    code of the dataset and sampler): what the op rows leave out."""
    loaders = dataloader_ranges(ann)
    gaps = []
    for key, ranges in loaders.items():
        spans = sorted((cols["ts_us"][i], cols["ts_us"][i] + cols["dur_us"][i])
                       for i in range(len(cols["name"])) if (cols["pid"][i], cols["tid"][i]) == key)
        op_starts = [s for s, _ in spans]
        reach_before, furthest = [], float("-inf")  # furthest end of the ops starting up to each one
        for _, e in spans:
            furthest = max(furthest, e)
            reach_before.append(furthest)
        for start, end in ranges:
            k = bisect.bisect_right(op_starts, start)
            # An op that began before the range and runs into it covers that part (the range is then
            # inside the op, whose self time already holds it).
            reach = max(start, min(reach_before[k - 1], end)) if k else start
            covered = reach - start
            for s, e in spans[k:]:
                if s >= end:
                    break
                s, e = max(s, reach), min(e, end)
                if e > s:
                    covered += e - s
                    reach = e
            gaps.append(max(0.0, end - start - covered))
    return gaps


def union_us(ranges: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    return intervals_union([s for s, _ in ranges], [e for _, e in ranges])
