"""Predict the memory of a training step: exact model states, measured activations, sharding.

Three modules: this one (the result, `estimate_memory`, sharding), `nbaccel.model_states` and
`nbaccel.dry_run`.

* Parameters, gradients and optimizer states are exact arithmetic on the model's parameters
  (`nbaccel.model_states`: numel x element size; Adam/AdamW keep two moments like the parameter
  plus a 4-byte ``step`` per parameter tensor, on the host unless ``fused``/``capturable``; SGD with
  momentum one buffer; ...). The tests check these against what torch really allocates.
* Activations are not guessed (`nbaccel.dry_run`): one dry run of a training step on a copy of the model, at two
  smaller batch sizes (default an eighth and a quarter of the batch), measures them, in fp32 and under
  autocast. The activations are what the forward leaves alive for the backward (the bytes alive at its
  end); the dry run also measures the forward's and the backward's peaks and the optimizer step's
  temporaries. On CUDA the measurement is the caching allocator's counters; elsewhere a `LiveBytes`
  dispatch mode adds up the storages that ops create and drop (exact bytes of live tensors, no allocator
  overhead). Each is extrapolated *linearly* from the two probes to the requested batch (intercept +
  slope x batch), which the result states.
* On the host the prediction is the step's *tensor* peak. The process's RSS shows that when the
  heap returns freed blocks (glibc with a fixed ``MALLOC_MMAP_THRESHOLD_``: within 0.4 % on the
  benchmark's MLPs); glibc's default heap keeps freed tensors resident and reuses them only in
  part, so its RSS is higher by an amount that depends on where blocks land (the same step, five
  times: 1.5 to 2.2 times the predicted step part). It cannot exceed the sum of every tensor the
  step allocates (``total_no_reuse``, also fitted linearly); docs/memory.md has the measurements.
* A step's peak is ``params + buffers + optimizer states + max(forward, backward, optimizer step)``: the forward
  holds the activations (+ its temporaries) and no gradients yet; the backward the gradients + what it
  still holds (activations not yet freed, gradient temporaries); the optimizer step the gradients + its
  temporaries (foreach/fused kernels allocate some the size of the parameters while the activations are
  already freed, which dominates for small batches). The activations are therefore not a term of a sum
  with the gradients: ``per_gpu`` says which phase makes the peak (``peak_phase``).
* Per GPU over N GPUs (the batch is the global batch, split evenly): data parallel (DDP keeps
  gradient buckets, +1x gradients), ZeRO-1 (optimizer states / N), ZeRO-2 (+ gradients / N),
  ZeRO-3 / FSDP (+ parameters / N, plus the largest layer gathered twice for prefetch).
  These sharding formulas are the ZeRO paper's accounting (Rajbhandari et al., 2020); they
  leave out the CUDA context (~0.3-0.5 GiB per process) and allocator fragmentation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .keywords import explains_keywords
from .device import DTYPE_NAMES, DeviceError, device_info, dtype_name, resolve_device
from .dry_run import (CHECK_TOLERANCE, DEFAULT_HEAD_LOSS, DEFAULT_LOSS, MODEL_LOSS, PHASES, ActivationFit,
                      EstimateError, LiveBytes, _default_loss, _dry_run, _example_option, _line, is_head, loss_takes_batch,
                      several_optimizers)
from .memory import malloc_trim, current_rss, format_bytes
from .render.common import plural
from .model_states import (OPTIMIZERS, _largest_leaf_bytes, _optimizer_spec, closest_optimizer, make_optimizer,
                           optimizer_plan, optimizer_state_bytes, plan_name, plan_state_bytes)
from .options import a_type, in_magic, option
from .probe_inputs import example_rows, example_tensors, find_bags, graph_refusal
from .results import ResultMixin
from .snapshot import rng_kept

if TYPE_CHECKING:
    import pandas as pd

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STRATEGY_NAMES = {"ddp": "data parallel (DDP)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 / FSDP"}
# Every name the display prints, and their parts, read as the keys (in any case, spaces, '-' and '_' dropped):
# `per_gpu("bf16", "ZeRO-1", 2)`, copied from the table, was refused as "'zero-1' is not one of ...".
_STRATEGY_ALIASES = {"ddp": "ddp", "dataparallel": "ddp", "dataparallel(ddp)": "ddp", "zero1": "zero1",
                     "zero2": "zero2", "zero3": "zero3", "fsdp": "zero3", "zero3/fsdp": "zero3"}


def strategy_key(strategy) -> str:
    """The key of `STRATEGIES` that ``strategy`` names: a key, or a name the display prints ("ZeRO-1",
    "ZeRO-3 / FSDP", "FSDP", "data parallel (DDP)"), in any case."""
    key = _STRATEGY_ALIASES.get("".join(strategy.lower().replace("-", "").replace("_", "").split())
                                if isinstance(strategy, str) else None)
    if key is None:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(map(repr, STRATEGIES))} (also read: "
                         "'DDP', 'data parallel (DDP)', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3', 'ZeRO-3 / FSDP', 'FSDP', in any "
                         "case)")
    return key




# --- exact model states ----------------------------------------------------------------------------






# --- measured activations --------------------------------------------------------------------------



@dataclass
class MemoryEstimate(ResultMixin):
    """Predicted peak memory of a training step, per precision and per GPU under sharding."""

    kind = "estimate"

    model_name: str
    optimizer: str
    batch: int
    n_params: int
    n_trainable: int
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    state_host_bytes: int
    largest_layer_bytes: int
    fits: dict[str, ActivationFit]  # precision label -> measured activations
    budget_bytes: int | None
    budget_source: str
    probe_device: str
    method: str
    states_measured: int | None = None
    gpu_counts: tuple = GPU_COUNTS
    note: str = ""  # shown under the headline; the magic says here that a prediction watches nothing
    # The module's buffers (BatchNorm's running statistics, ...): state beside ``param_bytes``, in every step's
    # peak, never sharded (DDP broadcasts them, FSDP keeps them whole on each rank).
    buffer_bytes: int = 0
    # What the estimate assumed or measured that a figure alone does not say (the loss, the optimizer's
    # reading, sparse gradients), one line each, shown under the phases.
    assumptions: tuple = ()
    # The process's resident memory as the estimate began (CPU): a watched CPU budget compares the whole
    # process's peak RSS, this plus the step's tensors (a trial: "fits in 600 MiB (peak 449 MiB)", then each
    # step "829 MiB of 500 MiB" under %memory_budget, 425 MiB there before the step).
    process_rss_bytes: int | None = None
    # ... and as it ended, after handing the heap the dry runs freed back (``malloc_trim``): what stays is the
    # setup they did once for the process (a trial: 243 -> 469 -> 509 MiB over three estimates; torch's profiler
    # alone keeps ~72 MiB from its first run, docs/memory.md).
    process_rss_after_bytes: int | None = None

    def per_gpu(self, precision: str, strategy: str, n: int) -> dict:
        """Bytes per GPU for one configuration, by component.

        ``activations`` is what the forward keeps for the backward at the local batch. The peak (``total``)
        is params + buffers + optimizer + overhead + the largest phase (``peak_phase``): forward = activations +
        ``forward_temporaries``; backward = grads + ``backward_working`` (activations not yet freed and
        gradient temporaries at the backward's peak); optimizer step = grads + ``step_temporaries``.
        Sharded gradients (ZeRO-2/3) shrink the last two phases, not the forward, which has none; in the
        backward only those accumulated by its peak (`ActivationFit.backward_at`).
        """
        precision = self.precision_key(precision)
        strategy = strategy_key(strategy)
        if n > self.batch:
            raise ValueError(f"a global batch of {self.batch} cannot be split over {n} GPUs (each needs at least one "
                             f"sample): use at most {self.batch} GPUs, or a larger batch")
        fit = self.fits[precision]
        shard = n if n > 1 else 1
        local_batch = math.ceil(self.batch / n)
        params = self.param_bytes / shard if strategy == "zero3" else self.param_bytes
        all_grads = fit.grads_at(local_batch)  # sparse gradients grow with the (local) batch
        grad_share = 1 / shard if strategy in ("zero2", "zero3") else 1.0
        grads = all_grads * grad_share
        states = self.state_bytes / shard if strategy in ("zero1", "zero2", "zero3") else self.state_bytes
        extra = 0.0
        if strategy == "ddp" and n > 1:
            extra = all_grads  # gradient buckets (unless gradient_as_bucket_view=True)
        if strategy == "zero3" and n > 1:
            extra = 2 * self.largest_layer_bytes  # the unit being computed + the one prefetched
        # At the local batch, like the gradients it runs over (sparse ones grow with it); ZeRO shards the update.
        step_temp = fit.step_temporaries_at(local_batch) / (shard if strategy != "ddp" else 1)
        # The step's peak is that of its largest phase: the forward (activations, no gradients yet), the
        # backward (gradients + what it still holds) or the optimizer step (gradients + temporaries).
        phases = fit.phases(local_batch, grad_share, step_temp)
        peak_phase = max(PHASES, key=lambda k: phases[k])
        activations = fit.at(local_batch)
        held = params + self.buffer_bytes + states  # through the whole step
        total = held + extra + phases[peak_phase]
        # Host probes only, one process: the RSS the step can reach if glibc reuses no freed block.
        allocated = fit.allocated_at(local_batch) if n == 1 else None
        # Every live byte was allocated, so the bound is never below the peak; two lines fitted apart could
        # cross (a trial read "RSS can reach up to 199 MiB" under a 391 MiB peak, then from dense-sized
        # sparse gradients).
        no_reuse = None if allocated is None else max(held + allocated, total)
        return {"precision": precision, "strategy": strategy, "gpus": n, "batch_per_gpu": local_batch,
                "params": int(params), "buffers": self.buffer_bytes, "grads": int(grads), "optimizer": int(states),
                "activations": activations,
                "forward_temporaries": max(0, fit.forward_at(local_batch) - activations),
                # What the backward holds beside this device's gradients at its peak (sharded: gradients not
                # yet accumulated are here, whole).
                "backward_working": int(phases["backward"] - grads), "step_temporaries": int(step_temp),
                "overhead": int(extra), "peak_phase": peak_phase, "total": int(total),
                "total_no_reuse": None if no_reuse is None else int(no_reuse),
                "fits": self.budget_bytes is not None and total <= self.budget_bytes}

    def precision_key(self, precision: str) -> str:
        """The key of ``fits`` that ``precision`` names: the key itself ("fp32", "bf16 AMP"), or its dtype
        alone ("bf16", "torch.bfloat16": a new user's `single("bf16")` was a bare KeyError). The run
        without autocast is keyed by the model's own dtype ("fp32" for most models, "float64", or "bf16"
        for a bf16 model, whose dtype then names that run rather than "bf16 AMP")."""
        if precision in self.fits:
            return precision
        keys = list(self.fits)
        try:
            wanted = dtype_name(precision)
        except DeviceError:
            wanted = None
        if wanted in self.fits:  # a bf16 model's run without autocast is "bf16", beside "bf16 AMP"
            return wanted
        match = [k for k in keys if k.split()[0] == wanted]
        if len(match) == 1:
            return match[0]
        raise ValueError(f"precision {precision!r} is not one of this estimate's: {', '.join(map(repr, keys))}")

    @property
    def usable_gpu_counts(self) -> tuple[int, ...]:
        """The GPU counts of ``gpu_counts`` the global batch can be split over: at most one GPU per sample.
        Every strategy here is data parallel, so a batch of 16 on 32 GPUs would leave half of them without
        data (the table once had such rows, ``batch_per_gpu=1``, that the display did not show)."""
        return tuple(n for n in self.gpu_counts if n <= self.batch)

    def table(self) -> pd.DataFrame:
        """One row per precision, strategy and usable GPU count (`usable_gpu_counts`)."""
        import pandas as pd
        rows = [self.per_gpu(p, s, n) for p in self.fits for s in STRATEGIES for n in self.usable_gpu_counts
                if not (n == 1 and s != "ddp")]
        return pd.DataFrame(rows)

    to_dataframe = table

    def single(self, precision: str) -> dict:
        return self.per_gpu(precision, "ddp", 1)

    def min_gpus(self, precision: str) -> tuple[int, str] | None:
        """Fewest GPUs (and the simplest strategy at that count) whose per-GPU total fits the budget."""
        if self.budget_bytes is None:
            return None
        for n in self.usable_gpu_counts:
            for s in STRATEGIES:
                if (n > 1 or s == "ddp") and self.per_gpu(precision, s, n)["fits"]:
                    return n, s
        return None

    def most_gpus_text(self) -> str:
        """The largest GPU count tried, in words: "64 GPUs", or "16 GPUs (a batch of 16 splits over at most 16)"
        where the batch stopped the counts short."""
        most = self.usable_gpu_counts[-1]
        words = f"{most} GPU{'s' if most > 1 else ''}"
        return f"{words} (a batch of {self.batch} splits over at most {most})" if self.batch_limits_gpus else words

    @property
    def batch_limits_gpus(self) -> bool:
        """Whether the batch, not ``gpu_counts``, stopped the GPU counts tried (`usable_gpu_counts`)."""
        return self.usable_gpu_counts[-1] != self.gpu_counts[-1]

    @property
    def on_gpu(self) -> bool:
        """Whether the dry runs ran on a GPU (then the single-device figures are for one GPU)."""
        return self.probe_device.startswith("cuda")

    @property
    def summary(self) -> str:
        if self.budget_bytes is None:
            return "no budget to compare with"
        if not self.on_gpu:
            return self._host_summary()
        parts = []
        for p in self.fits:
            found = self.min_gpus(p)
            if found is None:
                parts.append(f"does not fit in {p} on {self.most_gpus_text()}")
            elif found[0] == 1:
                parts.append(f"fits on 1 GPU in {p}")
            else:
                parts.append(f"needs {found[0]} in {p} ({STRATEGY_NAMES[found[1]]})")
        return ", ".join(parts) + f" (budget {format_bytes(self.budget_bytes)} per GPU)"

    def _host_summary(self) -> str:
        """Measured on the CPU: whether one step fits the budget here, not "fits on 1 GPU" from host memory.
        Where it does not fit, the GPU count that would (with this budget per GPU) is a prediction."""
        parts, gpus = [], []
        for p in self.fits:
            one = self.single(p)
            parts.append(f"{'fits' if one['fits'] else 'does not fit'} in {p} (peak {format_bytes(one['total'])})")
            if not one["fits"]:
                found = self.min_gpus(p)
                gpus.append(f"{p} needs {found[0]} ({STRATEGY_NAMES[found[1]]})" if found else
                            f"{p} does not fit on {self.most_gpus_text()}")
        budget = format_bytes(self.budget_bytes)
        text = ", ".join(parts) + f" -- budget {budget} ({self.budget_source}), measured on {self.probe_device}"
        text += f"; on GPUs with {budget} each: {', '.join(gpus)}" if gpus else ""
        if self.process_rss_bytes:
            # Named neutrally: the same sentence serves %memory_budget and memory_budget() in a script.
            text += (f"; the peaks are the step's tensors, and a watched memory budget counts the process's whole "
                     f"RSS beside them: {format_bytes(self.process_rss_bytes)} before this estimate")
            after = self.process_rss_after_bytes
            if after:
                grew = after > self.process_rss_bytes  # "stays" only where something stayed (a trial: 347 -> 345)
                text += (f", {format_bytes(after)} after it"
                         + (" (what its dry runs set up once for the process stays)" if grew else ""))
            held = max(self.process_rss_bytes, after or 0)
            if held >= self.budget_bytes:  # "fits in fp32 (peak 40 MiB) -- budget 200 MiB" beside 286 MiB of RSS
                text += (f"; the process alone holds more than the {format_bytes(self.budget_bytes)} budget, so a "
                         "watched budget of that size is over before any step")
        return text

    def _payload(self) -> dict:
        return {"model": self.model_name, "optimizer": self.optimizer, "batch": self.batch, "n_params": self.n_params,
                "n_trainable": self.n_trainable, "param_bytes": self.param_bytes, "buffer_bytes": self.buffer_bytes,
                "grad_bytes": self.grad_bytes,
                "state_bytes": self.state_bytes, "state_host_bytes": self.state_host_bytes,
                "states_measured": self.states_measured, "largest_layer_bytes": self.largest_layer_bytes,
                "activations": {k: v.to_dict(self.batch) for k, v in self.fits.items()},
                "single_gpu": {k: self.single(k) for k in self.fits}, "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source, "summary": self.summary, "probe_device": self.probe_device,
                "method": self.method, "note": self.note, "process_rss_bytes": self.process_rss_bytes,
                "process_rss_after_bytes": self.process_rss_after_bytes, "assumptions": list(self.assumptions), "table": self.table().to_dict(orient="records")}


def _check_arguments(batch, example, probe_batches, amp_dtype, loss_fn, name, gpu_counts) -> None:
    """Wrong types named by argument (``batch='32'`` failed deep inside with "'<' not supported")."""
    def whole(value):
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(batch):
        raise TypeError(f"{option('batch')} takes the global batch size as a whole number such as 32, got "
                        f"{type(batch).__name__} {batch!r}")
    if batch < 1:
        raise ValueError(f"{option('batch')} must be at least 1, got {batch}")
    keyed = isinstance(example, Mapping)
    tensors = example_tensors(example)
    if example is not None and not ((tensors or not keyed) and all(isinstance(t, torch.Tensor) for t in tensors)):
        # A Hugging Face-style batch is a dict: the model is called as model(**batch) (a trial's dict was refused)
        got = ("a dict whose values are not all tensors: "
               + ", ".join(f"{k}={type(v).__name__}" for k, v in example.items()) if keyed else type(example).__name__)
        raise TypeError(f"{_example_option()} takes a tensor (or a tuple of tensors, passed as model(*example), or a "
                        f"dict of tensors, passed as model(**example)) whose first dimension is the batch, got {got}")
    if probe_batches is not None and (not isinstance(probe_batches, (list, tuple)) or not all(
            whole(b) for b in probe_batches)):
        raise TypeError(f"{option('probe_batches')} takes two increasing batch sizes such as (2, 4), got "
                        f"{probe_batches!r}")
    if amp_dtype not in ("auto", "bf16", "fp16"):
        raise ValueError(f"{option('amp_dtype')} takes 'auto', 'bf16' or 'fp16', got {amp_dtype!r}")
    if isinstance(loss_fn, type) and issubclass(loss_fn, torch.nn.Module):
        # the class is callable too: it was "made" with the output and failed at .backward() (a trial)
        made = f"{'nn.' if loss_fn.__module__.startswith('torch.nn') else ''}{loss_fn.__name__}()"
        raise TypeError(f"{'--loss' if in_magic() else 'loss_fn'} is the class {loss_fn.__name__}, not a loss: pass "
                        f"an instance, {made} (loss = {made}, then {_loss_option(named='loss')})")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{option('loss_fn')} takes a function output -> scalar loss, got {type(loss_fn).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"{option('name')} takes the model's name as a string, got {type(name).__name__}")
    if not isinstance(gpu_counts, (list, tuple, range)) or not gpu_counts or not all(whole(n) and n >= 1
                                                                                    for n in gpu_counts):
        raise TypeError(f"{option('gpu_counts')} takes GPU counts such as (1, 2, 4, 8), got {gpu_counts!r}")
    if min(gpu_counts) > batch:  # data parallel: each GPU takes at least one sample of the global batch
        raise ValueError(f"{option('gpu_counts')} {tuple(gpu_counts)} are all more GPUs than the batch of {batch} "
                         f"can be split over; give counts of at most {batch}")


def _check_parameters(model: torch.nn.Module, params: list, name: str) -> None:
    """What a training-step estimate needs from the model itself, said before the dry run fails on it."""
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in params):
        raise ValueError(f"{name} has lazy layers (nn.LazyLinear, ...) whose parameters do not exist yet: run one "
                         f"forward pass first ({name}(x)), then estimate")
    if not any(p.requires_grad for p in params):
        kind = type(model).__name__
        if not params:  # a trial passed its loss module (nn.CrossEntropyLoss) as the model
            loss = " (a loss goes in " + ("--loss" if in_magic() else "loss_fn=") + ")" if kind.endswith("Loss") else ""
            raise ValueError(f"{name} ({a_type(model)}) has no parameters, so a training step has nothing to update: "
                             f"estimate the model you train{loss}")
        raise ValueError(f"{name} has no trainable parameters (all requires_grad=False), so a training step has "
                         "nothing to update: the estimate is of a training step; for inference, run the forward in a "
                         "cell under a watched budget (%memory_budget 0.8), which measures each cell's peak")





def _own_precision(params: list) -> str:
    """The label of the run without autocast: the dtype most of the parameters' bytes are in, "fp32" for
    almost every model (a float64 model's rows and headline read "fp32" beside float64 bytes: a trial)."""
    sizes: dict = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
    dtype = max(sizes, key=sizes.get) if sizes else torch.float32
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@explains_keywords({"batch_size": "batch", "input": "example", "inputs": "example", "x": "example", "loss": "loss_fn",
                    "criterion": "loss_fn", "labels": "targets", "target": "targets", "y": "targets",
                    "dtype": "amp_dtype"})
def estimate_memory(model: torch.nn.Module, optimizer="adamw", batch: int = 32, example=None, budget=None,
                    device="auto", probe_batches=None, amp_dtype="auto", loss_fn=None, name: str = "model",
                    gpu_counts=GPU_COUNTS, targets=None, on_progress=None) -> MemoryEstimate:
    """Predict a training step's peak memory for ``model`` at ``batch``, in fp32 and under autocast.

    ``example``: a batch (tensor or tuple, first dimension = batch; a dict of tensors is passed as
    ``model(**example)``, a Hugging Face-style batch) to build probe inputs from;
    optional for models whose first layer is ``nn.Linear``. ``budget``: "24GiB" or a share such as 0.9 (read like
    ``memory_budget``'s; it may exceed this machine: a per-GPU memory); default
    the device's memory. ``device``: where the dry runs execute (a copy of the model goes there).
    ``loss_fn(output) -> scalar``, or ``loss_fn(output, batch)`` (two positional parameters without a default:
    ``batch`` is the probe batch as the model got it, a tensor or the tuple; or ``targets`` cut to the probe's rows
    when given: a tensor or tuple, first dimension = batch, e.g. the labels a cross-entropy needs, which cannot
    ride in ``example`` since the model is called with all of it): default the sum of the first
    floating-point output, which keeps no buffer of its own, or, when its last dimension has 1024 entries or
    more (a classifier or vocabulary head), a cross-entropy over that dimension (every row's target class 0),
    whose buffers the logits' size the dry run then measures; where the output carries its own scalar loss
    (``output.loss``, ``output["loss"]``: a model given its labels), that loss; the result says which.
    ``probe_batches``: the two dry-run batch sizes (default an eighth and a quarter of ``batch``).
    ``on_progress(words, seconds)``: called before each step of the dry runs with what it is ("the bf16 AMP
    dry run: the step measured at batch 64") and the seconds since the first began: the dry runs measure
    every op, so they take far longer than the steps themselves (a trial's CNN: 98.6 s, silent throughout).

    Off CUDA the predicted ``total`` counts tensor bytes; ``single(p)["total_no_reuse"]`` is the
    most the step can make the process's RSS reach (no freed block reused). glibc's default heap
    lands between the two (module docstring).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_arguments(batch, example, probe_batches, amp_dtype, loss_fn, name, gpu_counts)
    _check_targets(targets, loss_fn, model, example)
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"on_progress takes a function (words, seconds) or None, got {type(on_progress).__name__}")
    graph = graph_refusal(example, name)
    if graph:  # before the dry run: its error was an index out of bounds deep inside the model
        raise EstimateError(graph)
    if probe_batches is None:
        # An eighth and a quarter of the batch: CPU and GPU kernels change algorithm (and temporaries) with
        # the batch size, so probes far below it extrapolate from another regime (tests/test_estimate.py).
        probe_batches = (max(2, batch // 8), max(4, batch // 4))
    if len(probe_batches) != 2 or probe_batches[0] >= probe_batches[1] or probe_batches[0] < 1:
        raise ValueError(f"{option('probe_batches')} must be two increasing batch sizes, e.g. (2, 4), got "
                         f"{tuple(probe_batches)}")
    dev = resolve_device(device)
    info = device_info(dev)
    from .budget import parse_budget, share_reading

    if budget is None:
        budget_bytes, source = info.total_memory, (f"{info.label} memory" if dev.type == "cuda"
                                                   else "this host's physical memory")
    else:  # read like memory_budget's; a per-GPU budget may be larger than anything on this machine
        budget_bytes = parse_budget(budget, dev, limit=False)
        # a share says what it was a share of; a size is as typed ("the budget" read as one being watched)
        source = share_reading(budget, dev, info.total_memory) or "as given"
    params = list(model.parameters())
    _check_parameters(model, params, name)
    trainable = [p for p in params if p.requires_grad]
    # Parameters alone, as the headline counts them; buffers apart (they were once in "params": 81,720 B
    # beside 20,234 parameters of 80,936 B for a CNN with BatchNorm).
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffers = list(model.buffers())
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    plan = optimizer_plan(optimizer, params, name)
    state_device, state_host = plan_state_bytes(plan, params)
    if dev.type == "cpu":
        state_device, state_host = state_device + state_host, 0
    opt_name = plan_name(plan)
    own_loss, loss_words = loss_fn is not None, _loss_words(loss_fn, targets)
    loss_fn = loss_fn or _default_loss
    if amp_dtype == "auto":
        amp = torch.bfloat16 if (dev.type == "cpu" or info.supports_bf16) else torch.float16
    else:
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp_dtype]
    probe_batches = list(probe_batches)
    fits, states_measured, heads = {}, None, None
    probes = {}
    # Where the kernels took scratch (`dry_run._OpScratch`), one more probe at twice the larger one's batch
    # (at most half the batch) checks the lines; a miss refits them through the two larger probes.
    check = min(2 * probe_batches[1], batch // 2)
    process_rss = current_rss() if dev.type == "cpu" else None  # before the dry runs add their own
    started = time.perf_counter()
    with rng_kept():  # a prediction draws nothing from the user's random streams (dropout, a random input)
        for label, dtype in ((_own_precision(params), None), (f"{DTYPE_NAMES[amp]} AMP", amp)):
            progress = on_progress and (lambda words, label=label: on_progress(
                f"the {label} dry run: {words}", time.perf_counter() - started))
            probes[label] = _dry_run(model, optimizer, example, probe_batches, dev, dtype, loss_fn, name, plan,
                                     targets, check if check > probe_batches[1] else None, progress)
    process_rss_after = None
    if process_rss is not None:
        # The dry runs' freed heap would otherwise stay in the process, and a watched budget would charge the
        # next cell's headroom for it (4-18 ms here; each CPU meter trims before it runs anyway).
        malloc_trim()
        process_rss_after = current_rss()
    for label, probe in probes.items():
        allocated = None if dev.type == "cuda" else probe["allocated"]
        # Sparse gradients are measured (their rows), the dense ones exact arithmetic.
        dense_grads = sum(p.numel() * p.element_size() for i, p in enumerate(params)
                          if p.requires_grad and i not in probe["sparse_params"])
        fits[label] = _fit(label, probe, dense_grads, dev)
        if probe["unrefitted"]:  # what the first two probes alone gave, said beside the refit (`_check_notes`)
            probe["unrefitted_fit"] = _fit(label, probe["unrefitted"], dense_grads, dev)
        states_measured = probe["states_measured"]
        heads = heads or probe["heads"]
    notes = _optimizer_notes(model, plan, name) + _sparse_grad_notes(model, probe["sparse_params"], fits, batch)
    checks = _check_notes(probes, fits, batch)
    notes += [words for words, refit in checks if refit]
    bags = find_bags(model, example)
    if bags:  # the probes were cut by bags, not rows: said, since a row cut is what --input's help describes
        notes.append(f"input: {bags.words(name)} (probes of {probe_batches[0]} and {probe_batches[1]} bags)")
    if not own_loss and all(p["model_loss"] for p in probes.values()):  # the model's own output.loss
        loss_words = f"{MODEL_LOSS}, nbaccel's default when the output has one; pass another with {_loss_option()}"
    if not own_loss and _wide_head(heads):  # the dry run's default loss was a cross-entropy (`_default_loss`)
        loss_words = _loss_words(None, head=True)
        notes += _head_notes(heads, probe_batches, batch)
    grad_bytes = next(iter(fits.values())).grads_at(batch)
    meter = ("the CUDA caching allocator's counters (memory_allocated, max_memory_allocated)" if dev.type == "cuda"
             else "live tensor storages counted by a TorchDispatchMode, and inside each op its kernel's scratch "
                  "from torch's CPU allocator (profiler memory events; where no other profiler records) "
                  "(exact tensor bytes; the process's RSS "
                  "under glibc's default heap is higher by a placement-dependent amount, at most total_no_reuse: "
                  "every byte the step allocates, also fitted linearly)")
    tensors = plural(len(params), "parameter tensor") + (f" and {plural(len(buffers), 'buffer')}" if buffers else "")
    sparse = " (sparse gradients: measured in the dry run, fitted linearly)" if probe["sparse_params"] else ""
    # Over sparse gradients the step grows with the rows looked up; over dense ones it does not (`ActivationFit`).
    step_fit = ("fitted linearly (they grow with the sparse gradients)" if probe["sparse_params"]
                else "the same at any batch (dense gradients)")
    method = (f"params/buffers/grads/optimizer states: exact arithmetic on {tensors}{sparse}; activations "
              "(bytes alive at the end of the forward), the forward's and the backward's peaks: one dry training step "
              f"on a copy of the model at batches {probe_batches[0]} and {probe_batches[1]} on {dev} (by {meter}), "
              f"each extrapolated linearly to batch {batch}; loss: {loss_words}; optimizer step temporaries: "
              f"measured after each probe's backward, {step_fit}"
              + "".join(f"; {words}" for words, refit in checks if not refit)
              + "; sharding: ZeRO accounting, global batch split evenly; not included: CUDA context, allocator "
              "fragmentation")
    return MemoryEstimate(
        model_name=name, optimizer=opt_name, batch=batch, n_params=sum(p.numel() for p in params),
        n_trainable=sum(p.numel() for p in trainable), param_bytes=param_bytes, grad_bytes=grad_bytes,
        state_bytes=state_device, state_host_bytes=state_host, largest_layer_bytes=_largest_leaf_bytes(model),
        fits=fits, budget_bytes=budget_bytes, budget_source=source, probe_device=str(dev), method=method,
        states_measured=states_measured, gpu_counts=tuple(gpu_counts), buffer_bytes=buffer_bytes,
        assumptions=tuple(notes), process_rss_bytes=process_rss, process_rss_after_bytes=process_rss_after,
    )


def _check_targets(targets, loss_fn, model=None, example=None) -> None:
    """``targets`` go to the loss as its second argument: without a loss that takes two they would go nowhere.
    Their rows are the example's rows' targets: a different count is a mistake (a trial's targets of 3 rows
    beside an example of 8 were cut to the probes' rows without a word)."""
    if targets is None:
        return
    tensors = targets if isinstance(targets, (tuple, list)) else (targets,)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
        raise TypeError(f"{_target_option()} takes a tensor (or a tuple of tensors) whose first dimension is the "
                        f"batch, got {type(targets).__name__}")
    rows = example_rows(model, example) if example is not None and model is not None else None
    if rows is not None and any(t.shape[0] != rows for t in tensors):
        got = ", ".join(str(t.shape[0]) for t in tensors)
        example_words = "--input" if in_magic() else "example="
        raise ValueError(f"{_target_option()} has {got} rows but {example_words} has {rows}: the targets are the "
                         "labels of the example's rows, one row each; pass the labels of the same batch")
    if loss_fn is None or not loss_takes_batch(loss_fn):
        raise ValueError(f"{_target_option()} is the loss's second argument: pass a loss that takes (output, "
                         f"targets) with {_loss_option()}, e.g. def loss(output, y): return F.cross_entropy(output, y)")


def _target_option() -> str:
    return "--target NAME" if in_magic() else "targets="


def _loss_option(named: str | None = None) -> str:
    if named:
        return f"--loss {named}" if in_magic() else f"loss_fn={named}"
    return "--loss NAME (a function in the namespace)" if in_magic() else "loss_fn="


def _loss_words(loss_fn, targets=None, head: bool = False) -> str:
    """The loss the dry run used, as the method line says it (``head``: the default over a wide head)."""
    if loss_fn is None:
        default = DEFAULT_HEAD_LOSS if head else DEFAULT_LOSS
        return f"{default}, nbaccel's default; pass the real one with {_loss_option()}"
    called = (f"loss_fn(output, targets) ({_target_option()} cut to the probe's rows)" if targets is not None
              else "loss_fn(output, batch)" if loss_takes_batch(loss_fn) else "loss_fn(output)")
    return f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)}, called as {called}"


def _wide_head(heads: list) -> bool:
    """Whether the probes' output had a classifier's or vocabulary's last dimension (`dry_run.is_head`)."""
    return len(heads) >= 2 and all(map(is_head, heads))


def _fit(label: str, probe: dict, dense_grads: int, dev: torch.device) -> ActivationFit:
    """The `ActivationFit` of a dry run's two fitted probes (`dry_run._probe`)."""
    allocated = None if dev.type == "cuda" else probe["allocated"]
    step_allocated = None if allocated is None else probe["step_allocated"]
    return ActivationFit(label, probe["batches"], probe["forward"], probe["backward"], dense_grads,
                         probe["step"][0], allocated, None if step_allocated is None else step_allocated[0],
                         kept=probe["kept"], sparse_grads=probe["sparse_grads"] or None,
                         step_probes=probe["step"], step_allocated_probes=step_allocated,
                         forward_lines=probe["forward_lines"], backward_lines=probe["backward_lines"],
                         backward_grad_lines=probe["backward_grad_lines"])


def _check_notes(probes: dict, fits: dict, batch: int) -> list[tuple[str, bool]]:
    """Per precision whose probes' kernels took scratch: (the check probe's peaks against the lines and the fit
    kept, whether it refitted: an assumption then, else a word of the method) (`dry_run._check_probe`)."""
    notes = []
    for label, probe in probes.items():
        checked = probe.get("check")
        if not checked:
            continue
        (b1, b2), b3 = checked["probes"], checked["batch"]
        scratch = max(s or 0 for s in probe["scratch"])
        misses = ", ".join(f"{phase} {format_bytes(measured)} measured, {format_bytes(predicted)} from the lines "
                           f"({(predicted - measured) / max(measured, 1):+.1%})"
                           for phase, (predicted, measured) in checked["phases"].items())
        if checked["refit"]:
            refit, first = max(fits[label].phases(batch).values()), max(probe["unrefitted_fit"].phases(batch).values())
            verdict = (f"more than {CHECK_TOLERANCE:.0%} off: the kernels changed with the batch, so the fit is the "
                       f"line through batches {b2} and {b3}, nearer the batch's kernels; the step's peak over the "
                       f"model states at batch {batch}: {format_bytes(refit)} from it, {format_bytes(first)} from "
                       f"{b1} and {b2} ({(first - refit) / max(refit, 1):+.0%}): the estimate is this uncertain "
                       "(a kernel can change again between the check and the batch)")
        else:
            verdict = f"within {CHECK_TOLERANCE:.0%}: the fit through {b1} and {b2} kept"
        notes.append((f"{label}: the CPU kernels took scratch memory beside their outputs (up to "
                     f"{format_bytes(scratch)} at a probe), whose size follows the algorithm they pick for the "
                     f"shape, not the batch; a check probe at batch {b3}: {misses}; {verdict}", checked["refit"]))
    return notes


def _head_notes(heads: list, batches: list, batch: int) -> list[str]:
    """Under the default loss, a wide head's cross-entropy was measured, not the sum: said, with the logits'
    size (the sum kept none of its buffers: a vocabulary model's step peaked at 188 MiB against 63 MiB)."""
    classes = heads[0][1]
    intercept, slope = _line(batches, [rows for rows, _ in heads])
    rows = int(round(intercept + slope * batch))
    return [f"loss: the output's last dimension has {classes:,} entries (a classifier or vocabulary head?), so the "
            f"dry run's default loss was a cross-entropy over it, not the sum: what it holds (log_softmax's output, "
            f"kept for the backward, in float32 under autocast; the logits' gradient) is measured in the phases; the "
            f"logits are {rows:,} rows x {classes:,} at batch {batch}, {format_bytes(rows * classes * 4)} in float32 "
            f"(rows measured: {', '.join(f'{r:,}' for r, _ in heads)} at batch {', '.join(map(str, batches))}, "
            f"scaled linearly); a loss of your own (label smoothing, a chunked cross-entropy) can hold another "
            f"amount: pass it with {_loss_option()}, taking (output) or (output, batch), or (output, targets) with "
            f"{_target_option()}"]


def _optimizer_notes(model: torch.nn.Module, plan: list, name: str) -> list[str]:
    """What the optimizer(s) were read as: plain SGD's lack of state, and the parameters that optimizer
    objects leave out (they get no state here)."""
    notes = []
    if any(opt == "sgd" for opt, _ in plan):
        # A trial's `--optimizer sgd` read 0 B of state while its own SGD(momentum=0.9) kept 88.5 KiB.
        notes.append(f"optimizer: sgd means momentum=0, no state; {option('optimizer', 'sgd-momentum')} or your "
                     f"optimizer object ({option('optimizer', 'opt') if in_magic() else 'optimizer=opt'}) for SGD "
                     "with momentum (one buffer the size of the parameters)")
    if all(held is None for _, held in plan):
        return notes
    covered = {i for _, held in plan for i in (held or ())}
    named = list(model.named_parameters())
    trainable = [i for i, (_, p) in enumerate(named) if p.requires_grad]
    left = [named[i] for i in trainable if i not in covered]
    if left:
        kinds = ", ".join(type(opt).__name__ for opt, _ in plan)
        names = ", ".join(n for n, _ in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        size = format_bytes(sum(p.numel() * p.element_size() for _, p in left))
        notes.append(f"optimizer: the {kinds} passed update{'s' if len(plan) == 1 else ''} "
                     # of the trainable ones: a review's frozen first layer was counted as updated
                     f"{len(trainable) - len(left)} of {name}'s {len(trainable)} trainable parameter tensors; the "
                     f"other {len(left)} "
                     f"({names}: {size}) get no optimizer state in this estimate (their gradients are counted): "
                     f"pass every optimizer of the step ({several_optimizers()}) to count theirs")
    return notes


def _sparse_grad_notes(model: torch.nn.Module, sparse_params: set, fits: dict, batch: int) -> list[str]:
    """Where gradients are sparse: which, what the dry run measured, and the dense size they are not."""
    if not sparse_params:
        return []
    named = [(n, p) for i, (n, p) in enumerate(model.named_parameters()) if i in sparse_params]
    dense = sum(p.numel() * p.element_size() for _, p in named)
    fit = next(iter(fits.values()))
    at = fit.grads_at(batch) - fit.grad_bytes
    names = ", ".join(n for n, _ in named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return [f"grads: {names} get{'s' if len(named) == 1 else ''} sparse gradients (the rows the batch looks up): "
            f"measured {', '.join(format_bytes(b) for b in fit.sparse_grads)} at batch "
            f"{', '.join(map(str, fit.batches))} (indices and values), fitted linearly: {format_bytes(at)} at batch "
            f"{batch}, not the dense {format_bytes(dense)}"]


# The estimator's names in one place, wherever they are defined (the magic, the renderer and scripts
# import them from here).
__all__ = ["estimate_memory", "MemoryEstimate", "EstimateError", "ActivationFit", "LiveBytes", "optimizer_state_bytes",
           "make_optimizer", "closest_optimizer", "OPTIMIZERS", "PHASES", "STRATEGIES", "STRATEGY_NAMES"]
