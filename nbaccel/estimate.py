"""Predict the memory of a training step: exact model states, measured activations, sharding.

* Parameters, gradients and optimizer states are exact arithmetic on the model's parameters
  (numel x element size; Adam/AdamW keep two moments like the parameter plus a 4-byte ``step``
  per parameter tensor, on the host unless ``fused``/``capturable``; SGD with momentum one
  buffer; ...). The tests check these against what torch really allocates.
* Activations are not guessed: one dry run of a training step on a copy of the model, at two
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

import copy
import difflib
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .device import DTYPE_NAMES, DeviceError, device_info, dtype_name, resolve_device
from .memory import cuda_counters, format_bytes, reset_cuda_peak
from .options import in_magic, option
from .results import ResultMixin

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


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created by ops while the mode is active.

    An op output whose storage is new (not one of the op's inputs' storages: views and in-place
    ops allocate nothing) is counted until its storage is freed (a weakref finalizer). Tensors that
    existed before (the parameters) are not counted. ``allocated`` is the sum of every new storage,
    freed or not: the bytes the block would touch if no freed block were ever reused.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in inputs or key in self._live:
                    continue
                size = storage.nbytes()
                self._live[key] = size
                self.current += size
                self.allocated += size
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.current -= self._live.pop(key, 0)


# --- exact model states ----------------------------------------------------------------------------

class EstimateError(ValueError):
    """Input the estimator cannot work with; the message says what to pass."""


OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adagrad", "rmsprop", "none")
# Subclasses first (AdamW is an Adam): a subclass of these keeps the same state.
_KNOWN = ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd"),
          (torch.optim.Adagrad, "adagrad"), (torch.optim.RMSprop, "rmsprop"))


def closest_optimizer(name: str) -> str:
    """" (did you mean adam?)" for a misspelt optimizer name, or ""."""
    close = difflib.get_close_matches(name.lower(), OPTIMIZERS, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _optimizer_spec(optimizer) -> tuple[str, dict]:
    """Name and hyper-parameters, from a name or an optimizer instance."""
    if isinstance(optimizer, torch.optim.Optimizer):
        name = next((n for cls, n in _KNOWN if isinstance(optimizer, cls)), None)
        if name is None:
            raise ValueError(f"the state size of {type(optimizer).__name__} is not known here (Adam, AdamW, SGD, "
                             f"Adagrad and RMSprop are); pass {option('optimizer')} with the closest of "
                             f"{', '.join(OPTIMIZERS)} (e.g. adam for an optimizer with two moments)")
        group = optimizer.param_groups[0]
        if name == "sgd" and group.get("momentum", 0):
            name = "sgd-momentum"
        return name, dict(group)
    if optimizer is not None and not isinstance(optimizer, str):
        raise TypeError(f"{option('optimizer')} takes one of {', '.join(OPTIMIZERS)} or a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    name = (optimizer or "none").lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}{closest_optimizer(name)}; use one of: "
                         f"{', '.join(OPTIMIZERS)}")
    return name, {}


def optimizer_state_bytes(params, optimizer="adamw") -> tuple[int, int]:
    """(bytes on the parameters' device, bytes on the host) of the optimizer's state, exactly.

    ``step`` counters are 4-byte float32 tensors, one per parameter tensor, on the host unless
    the optimizer is ``fused`` or ``capturable`` (then on the parameter's device).
    """
    name, hyper = _optimizer_spec(optimizer)
    params = [p for p in params if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    steps_on_device = bool(hyper.get("fused") or hyper.get("capturable"))
    per_param = {"adamw": 2 + bool(hyper.get("amsgrad")), "adam": 2 + bool(hyper.get("amsgrad")),
                 "sgd": 0, "sgd-momentum": 1, "adagrad": 1, "none": 0,
                 "rmsprop": 1 + bool(hyper.get("momentum")) + bool(hyper.get("centered"))}[name]
    has_step = name in ("adamw", "adam", "adagrad", "rmsprop")
    step = 4 * len(params) if has_step else 0
    device_bytes = per_param * nbytes + (step if steps_on_device else 0)
    host_bytes = 0 if steps_on_device else step
    return device_bytes, host_bytes


def make_optimizer(optimizer, params):
    name, hyper = _optimizer_spec(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        # param_groups hold keys the constructor does not take (AdamW's 'decoupled_weight_decay',
        # a scheduler's 'initial_lr'): pass only what it accepts. What decides memory (foreach, fused,
        # capturable, amsgrad, momentum, centered) are constructor arguments, so they are kept.
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            hyper = {k: v for k, v in hyper.items() if k in accepted}
        keep = {k: v for k, v in hyper.items() if k not in ("self", "params")}
        return cls(params, **keep)
    return {"adamw": lambda: torch.optim.AdamW(params), "adam": lambda: torch.optim.Adam(params),
            "sgd": lambda: torch.optim.SGD(params, lr=0.01), "sgd-momentum": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            "adagrad": lambda: torch.optim.Adagrad(params), "rmsprop": lambda: torch.optim.RMSprop(params),
            "none": lambda: None}[name]()


def _largest_leaf_bytes(model: torch.nn.Module) -> int:
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()]
    return max(sizes, default=0)


# --- measured activations --------------------------------------------------------------------------

def _first_layer(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """(qualified name, module) of the model's first layer: the first module without submodules that holds
    parameters (a model's own parameter, a class token, is not a layer: a trial was told its first layer was
    the model itself). MultiheadAttention holds its in-projection itself: the first module with parameters of
    its own. ("", model) for a model that is one layer."""
    return next(((n, m) for n, m in model.named_modules()
                 if next(m.parameters(recurse=False), None) is not None
                 and (m is not model or next(m.children(), None) is None)), ("", model))


def _layer_path(model: torch.nn.Module, name: str, qualified: str) -> str:
    """The layer as the user reaches it in Python: ``model[0]``, ``model.layers[0].self_attn``. The
    qualified name alone ("0", "here it is 0 (Conv2d)") read as a count, not as the Sequential's first child."""
    expr, module = name, model
    for part in qualified.split(".") if qualified else ():
        if isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)) and part.isdigit():
            expr += f"[{part}]"
        elif part.isidentifier():
            expr += f".{part}"
        else:  # a ModuleDict key such as "conv-1"
            return f"{name}.get_submodule({qualified!r})"
        module = module._modules[part]
    return expr


def _layer_words(model: torch.nn.Module, name: str) -> tuple[str, str, torch.nn.Module]:
    """("its first layer, model[0] (a Conv2d),", "model[0]", the layer), or ("model itself (a Conv2d)",
    "model", model) for a model that is one layer."""
    qualified, layer = _first_layer(model)
    kind = type(layer).__name__
    what = f"({'an' if kind[0] in 'AEIOU' else 'a'} {kind})"
    if not qualified:
        return f"{name} itself {what}", name, layer
    path = _layer_path(model, name, qualified)
    return f"its first layer, {path} {what},", path, layer


def _layer_input(layer: torch.nn.Module) -> str | None:
    """The input shape ``layer`` takes, in words ("(batch, 3, height, width)"), where nbaccel knows it."""
    if isinstance(layer, torch.nn.Linear):
        return f"(batch, ..., {layer.in_features})"
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        dims = {1: "length", 2: "height, width", 3: "depth, height, width"}.get(len(layer.kernel_size))
        return f"(batch, {layer.in_channels}, {dims})" if dims else None
    if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return f"(batch, sequence) of integer token ids below {layer.num_embeddings}"
    return None


def _pass_example() -> str:
    """How to pass an example batch: ``--input x`` under the magic, ``example=x`` from Python."""
    return "--input x" if _example_option().startswith("--") else "example=x"


def _example_batch(model: torch.nn.Module, example, batch: int, device: torch.device, name: str = "model"):
    """Inputs for a batch of ``batch`` rows: rows of ``example`` repeated, or random for a Linear-first model."""
    if example is not None:
        tensors = example if isinstance(example, (tuple, list)) else (example,)
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise EstimateError(f"{_example_option()} must be a tensor (or a tuple of tensors) whose first "
                                    "dimension is the batch")
            rows = torch.arange(batch, device=t.device) % t.shape[0]
            out.append(t[rows].to(device))
        return tuple(out)
    first = _first_layer(model)[1]
    if isinstance(first, torch.nn.Linear):
        return (torch.randn(batch, first.in_features, device=device, dtype=first.weight.dtype),)
    words, path, layer = _layer_words(model, name)
    takes = _layer_input(layer)
    raise EstimateError(f"cannot make an input for {name}: nbaccel makes one only when the first layer is an "
                        f"nn.Linear, and {words} is not; pass an example batch ({_pass_example()}) whose first "
                        "dimension is the batch" + (f" ({path} takes {takes})" if takes else ""))


def _default_loss(output) -> torch.Tensor:
    for t in tree_leaves(output if not hasattr(output, "logits") else output.logits):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.float().sum()
    raise EstimateError("the model's output has no floating-point tensor to backpropagate from; pass loss_fn")


class _Peak:
    """Peak bytes created during a block: the CUDA allocator's counters, or `LiveBytes` elsewhere.

    Off CUDA, ``allocated`` is also set: all bytes the block's ops allocated (`LiveBytes.allocated`).
    """

    def __init__(self, device: torch.device):
        self.device, self.peak, self.allocated = device, 0, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = cuda_counters(self.device)
            self._base = now.allocated
            reset_cuda_peak(self.device, now=now)
        else:
            self._mode = LiveBytes()
            self._mode.__enter__()
        return self

    def phase(self) -> int:
        """The peak since the last phase (over the base at enter); the next phase starts from now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = cuda_counters(self.device)
            peak = now.peak_allocated - self._base
            reset_cuda_peak(self.device, now=now)
            return peak
        peak, self._mode.peak = self._mode.peak, self._mode.current
        return peak

    def live(self) -> int:
        """Bytes alive now that were created since enter (the model states that existed before are not counted)."""
        if self.device.type == "cuda":
            return cuda_counters(self.device).allocated - self._base
        return self._mode.current

    def __exit__(self, *exc):
        self.peak = self.phase()
        if self.device.type != "cuda":
            self.allocated = self._mode.allocated
            self._mode.__exit__(*exc)
        return False


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def _probe(model, optimizer, example, batches, device, amp_dtype, loss_fn, name: str = "model") -> dict:
    """Dry runs of a training step on a copy of the model: activations per batch, step temporaries."""
    replica = copy.deepcopy(model).to(device)
    replica.train()
    for p in replica.parameters():
        p.grad = None
    opt = make_optimizer(optimizer, [p for p in replica.parameters() if p.requires_grad])

    def forward_backward(b, meter=None):
        inputs = _example_batch(replica, example, b, device, name)
        with _autocast(device, amp_dtype):
            loss = loss_fn(replica(*inputs))
        # The forward's peak, and what it leaves alive for the backward: the activations (tensors saved
        # by autograd, the input batch, the loss; under autocast also the 16-bit copies of the weights).
        forward = (meter.phase(), meter.live()) if meter else None
        loss.backward()
        return forward

    # First step unmeasured: the optimizer allocates its state lazily, as in real training.
    forward_backward(batches[0])
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    states_measured = sum(t.untyped_storage().nbytes() for s in (opt.state.values() if opt else [])
                          for t in s.values() if isinstance(t, torch.Tensor))
    fwd, kept, bwd, allocated = [], [], [], []
    for b in batches:
        replica.zero_grad(set_to_none=True)
        with _Peak(device) as peak:
            forward_peak, forward_kept = forward_backward(b, peak)
        fwd.append(forward_peak)
        kept.append(forward_kept)
        bwd.append(peak.peak)
        allocated.append(peak.allocated)
    step, step_allocated = 0, 0
    if opt is not None:
        with _Peak(device) as peak:
            opt.step()
        step, step_allocated = peak.peak, peak.allocated
    replica.zero_grad(set_to_none=True)
    del replica, opt
    return {"forward": fwd, "kept": kept, "backward": bwd, "step": step, "states_measured": states_measured,
            "allocated": allocated, "step_allocated": step_allocated}


def _line(batches, values) -> tuple[float, float]:
    """(intercept, slope) of the straight line through two measurements (slope clipped at 0)."""
    (b1, b2), (m1, m2) = batches[:2], values[:2]
    slope = max(0.0, (m2 - m1) / (b2 - b1))
    return max(0.0, m1 - slope * b1), slope


PHASES = ("forward", "backward", "optimizer step")


@dataclass
class ActivationFit:
    """What a training step holds beside the model states, measured at two small batches and fitted linearly.

    A step goes through three phases, each with its own peak over the parameters and optimizer states:

    * forward: the activations (what the forward keeps for the backward: tensors saved by autograd, the
      input batch, the loss; under autocast also 16-bit copies of the weights), plus the forward's
      temporaries at its peak. No gradients yet (``zero_grad(set_to_none=True)``, torch's default).
    * backward: the gradients appear while the activations are freed. Its peak is the gradients plus
      the backward's *working memory*: the activations not yet freed and the gradient temporaries.
    * optimizer step: the gradients plus the step's temporaries (foreach/fused kernels allocate some
      the size of the parameters), activations all freed.

    Each measured quantity is close to linear in the batch; the maximum of the phases is not, so each
    is fitted on its own (a straight line through the two probes) and the maximum is taken at the
    requested batch (`MemoryEstimate.per_gpu`).
    """

    precision: str
    batches: list[int]
    forward: list[int]  # peak during the forward pass, over the model states, per probe batch
    backward: list[int]  # peak during the backward pass (activations still alive + gradients + temporaries)
    grad_bytes: int
    step_temporaries: int
    # Off CUDA: every byte the forward+backward allocated per probe batch, and the optimizer step's,
    # freed or not (`LiveBytes.allocated`). None where the probes ran on CUDA.
    allocated: list[int] | None = None
    step_allocated: int | None = None
    # Bytes alive at the end of the forward, per probe batch: the activations it keeps for the backward.
    kept: list[int] | None = None

    @property
    def measured(self) -> list[int]:
        """The activations measured at each probe batch: what the forward left alive for the backward."""
        return list(self.kept if self.kept is not None else self.forward)

    def _kept_line(self) -> tuple[float, float]:
        return _line(self.batches, self.measured)

    @property
    def per_sample(self) -> float:
        """Activation bytes per sample (the slope of the activations' line)."""
        return self._kept_line()[1]

    @property
    def fixed(self) -> float:
        """Activation bytes that do not grow with the batch (the line's intercept; under autocast mostly
        the 16-bit copies of the weights, which the backward needs)."""
        return self._kept_line()[0]

    @property
    def slopes(self) -> tuple[float, float]:
        """Bytes per sample of the forward's and of the backward's peak (the two phase lines)."""
        return _line(self.batches, self.forward)[1], _line(self.batches, self.backward)[1]

    @property
    def slope(self) -> float:
        """Bytes per sample of the phase whose peak grows fastest with the batch (forward or backward)."""
        return max(self.slopes)

    def at(self, batch: int) -> int:
        """The activations at ``batch``: what the forward keeps for the backward (linear through the probes)."""
        intercept, slope = self._kept_line()
        return int(intercept + slope * batch)

    def forward_at(self, batch: int) -> int:
        """The forward's peak at ``batch`` over the model states: activations + the forward's temporaries."""
        intercept, slope = _line(self.batches, self.forward)
        return max(int(intercept + slope * batch), self.at(batch))

    def backward_working_at(self, batch: int) -> int:
        """The backward's peak beside the gradients at ``batch``: activations not yet freed + gradient
        temporaries (the backward peak's line minus the gradients)."""
        intercept, slope = _line(self.batches, self.backward)
        return int(max(0.0, intercept + slope * batch - self.grad_bytes))

    def phases(self, batch: int, grads: float | None = None, step_temporaries: float | None = None) -> dict:
        """Each phase's peak over the model states at ``batch``, with ``grads`` bytes of gradients per
        device (default all of them; ZeRO-2/3 keep a shard) and the optimizer step's temporaries."""
        grads = self.grad_bytes if grads is None else grads
        step = self.step_temporaries if step_temporaries is None else step_temporaries
        return {"forward": self.forward_at(batch), "backward": grads + self.backward_working_at(batch),
                "optimizer step": grads + step}

    def allocated_at(self, batch: int) -> int | None:
        """Bytes a whole step allocates at ``batch`` (forward + backward, line through the probes, plus the
        optimizer step's), as if no freed block were reused; None for CUDA probes.

        What a step can add to the process's RSS at most: every page it touches belongs to a tensor it
        allocated. glibc's heap keeps freed blocks resident and reuses them only partly, so the
        measured RSS lands between the live-tensor peak and this bound (docs/memory.md).
        """
        if self.allocated is None:
            return None
        intercept, slope = _line(self.batches, self.allocated)
        return int(intercept + slope * batch + (self.step_allocated or 0))

    def to_dict(self) -> dict:
        return {"precision": self.precision, "probe_batches": self.batches, "measured_bytes": self.measured,
                "activation_bytes_per_sample": self.per_sample, "activation_fixed_bytes": self.fixed,
                "forward_peak_bytes": self.forward, "backward_peak_bytes": self.backward,
                "forward_peak_bytes_per_sample": self.slopes[0], "backward_peak_bytes_per_sample": self.slopes[1],
                "bytes_per_sample": self.slope, "step_temporaries_bytes": self.step_temporaries,
                "allocated_bytes": self.allocated, "step_allocated_bytes": self.step_allocated}


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

    def per_gpu(self, precision: str, strategy: str, n: int) -> dict:
        """Bytes per GPU for one configuration, by component.

        ``activations`` is what the forward keeps for the backward at the local batch. The peak (``total``)
        is params + buffers + optimizer + overhead + the largest phase (``peak_phase``): forward = activations +
        ``forward_temporaries``; backward = grads + ``backward_working`` (activations not yet freed and
        gradient temporaries at the backward's peak); optimizer step = grads + ``step_temporaries``.
        Sharded gradients (ZeRO-2/3) shrink the last two phases, not the forward, which has none.
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
        grads = self.grad_bytes / shard if strategy in ("zero2", "zero3") else self.grad_bytes
        states = self.state_bytes / shard if strategy in ("zero1", "zero2", "zero3") else self.state_bytes
        extra = 0.0
        if strategy == "ddp" and n > 1:
            extra = self.grad_bytes  # gradient buckets (unless gradient_as_bucket_view=True)
        if strategy == "zero3" and n > 1:
            extra = 2 * self.largest_layer_bytes  # the unit being computed + the one prefetched
        step_temp = fit.step_temporaries / (shard if strategy != "ddp" else 1)
        # The step's peak is that of its largest phase: the forward (activations, no gradients yet), the
        # backward (gradients + what it still holds) or the optimizer step (gradients + temporaries).
        phases = fit.phases(local_batch, grads, step_temp)
        peak_phase = max(PHASES, key=lambda k: phases[k])
        activations = fit.at(local_batch)
        held = params + self.buffer_bytes + states  # through the whole step
        total = held + extra + phases[peak_phase]
        # Host probes only, one process: the RSS the step can reach if glibc reuses no freed block.
        allocated = fit.allocated_at(local_batch) if n == 1 else None
        return {"precision": precision, "strategy": strategy, "gpus": n, "batch_per_gpu": local_batch,
                "params": int(params), "buffers": self.buffer_bytes, "grads": int(grads), "optimizer": int(states),
                "activations": activations,
                "forward_temporaries": max(0, fit.forward_at(local_batch) - activations),
                "backward_working": fit.backward_working_at(local_batch), "step_temporaries": int(step_temp),
                "overhead": int(extra), "peak_phase": peak_phase, "total": int(total),
                "total_no_reuse": None if allocated is None else int(held + allocated),
                "fits": self.budget_bytes is not None and total <= self.budget_bytes}

    def precision_key(self, precision: str) -> str:
        """The key of ``fits`` that ``precision`` names: the key itself ("fp32", "bf16 AMP"), or its dtype
        alone ("bf16", "torch.bfloat16": a new user's `single("bf16")` was a bare KeyError)."""
        if precision in self.fits:
            return precision
        keys = list(self.fits)
        try:
            wanted = dtype_name(precision)
        except DeviceError:
            wanted = None
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
        return text + (f"; on GPUs with {budget} each: {', '.join(gpus)}" if gpus else "")

    def _payload(self) -> dict:
        return {"model": self.model_name, "optimizer": self.optimizer, "batch": self.batch, "n_params": self.n_params,
                "n_trainable": self.n_trainable, "param_bytes": self.param_bytes, "buffer_bytes": self.buffer_bytes,
                "grad_bytes": self.grad_bytes,
                "state_bytes": self.state_bytes, "state_host_bytes": self.state_host_bytes,
                "states_measured": self.states_measured, "largest_layer_bytes": self.largest_layer_bytes,
                "activations": {k: v.to_dict() for k, v in self.fits.items()},
                "single_gpu": {k: self.single(k) for k in self.fits}, "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source, "summary": self.summary, "probe_device": self.probe_device,
                "method": self.method, "note": self.note, "table": self.table().to_dict(orient="records")}


def _check_arguments(batch, example, probe_batches, amp_dtype, loss_fn, name, gpu_counts) -> None:
    """Wrong types named by argument (``batch='32'`` failed deep inside with "'<' not supported")."""
    def whole(value):
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(batch):
        raise TypeError(f"{option('batch')} takes the global batch size as a whole number such as 32, got "
                        f"{type(batch).__name__} {batch!r}")
    if batch < 1:
        raise ValueError(f"{option('batch')} must be at least 1, got {batch}")
    tensors = example if isinstance(example, (tuple, list)) else (example,)
    if example is not None and not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{_example_option()} takes a tensor (or a tuple of tensors) whose first dimension is the "
                        f"batch, got {type(example).__name__}")
    if probe_batches is not None and (not isinstance(probe_batches, (list, tuple)) or not all(
            whole(b) for b in probe_batches)):
        raise TypeError(f"{option('probe_batches')} takes two increasing batch sizes such as (2, 4), got "
                        f"{probe_batches!r}")
    if amp_dtype not in ("auto", "bf16", "fp16"):
        raise ValueError(f"{option('amp_dtype')} takes 'auto', 'bf16' or 'fp16', got {amp_dtype!r}")
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
        what = "no parameters" if not params else "no trainable parameters (all requires_grad=False)"
        raise ValueError(f"{name} has {what}, so a training step has nothing to update: estimate the model you "
                         "train, or use torch.no_grad() memory tools for inference")


def _example_option() -> str:
    """How the example batch is passed: ``--input x`` under the magic, ``example=`` from Python."""
    return "--input" if option("example").startswith("--") else "example"


def _layer_misfit(layer: torch.nn.Module, t: torch.Tensor) -> bool:
    """Whether tensor ``t`` cannot be ``layer``'s batched input, for the layers `_layer_input` describes
    (False where nbaccel does not know what the layer takes)."""
    if isinstance(layer, torch.nn.Linear):
        return t.dim() < 2 or t.shape[-1] != layer.in_features
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        return t.dim() != len(layer.kernel_size) + 2 or t.shape[1] != layer.in_channels
    if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return t.is_floating_point() or t.is_complex()
    return False


def _dry_run(model, optimizer, example, batches, device, amp_dtype, loss_fn, name):
    """`_probe`, with a failure of the model on the probe input said as such: the user's error (e.g. a
    shape mismatch) shows the probe batch, not the batch they asked for, which is confusing alone.
    An `EstimateError` (docs/api.md: the estimate could not use the model's input), chained from the model's."""
    try:
        return _probe(model, optimizer, example, batches, device, amp_dtype, loss_fn, name)
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AssertionError) as exc:
        from .oom import is_oom

        if is_oom(exc) or isinstance(exc, EstimateError):
            raise
        words, path, first = _layer_words(model, name)
        misfit = ""
        if example is None:
            # getattr: a failure before the input was made (the model's deepcopy) has no Linear behind it
            feed = (f"a random input of shape ({batches[0]}, {getattr(first, 'in_features', '?')}) made for its "
                    f"first layer ({path}, an nn.Linear)")
        else:
            tensors = example if isinstance(example, (tuple, list)) else (example,)
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            how = "cut" if all(t.dim() and t.shape[0] >= batches[0] for t in tensors) else "repeated"
            feed = f"the example (shape {shapes}) {how} to the probe batch of {batches[0]} rows"
            takes = _layer_input(first)
            if takes and _layer_misfit(first, tensors[0]):
                misfit = f"the example has shape {tuple(tensors[0].shape)} and {words} takes {takes}\n"
        precision = "fp32" if amp_dtype is None else f"autocast {DTYPE_NAMES.get(amp_dtype, amp_dtype)}"
        raise EstimateError(
            f"the dry run of {name} on {feed} failed ({precision}): {type(exc).__name__}: {exc}\n{misfit}"
            + (f"pass --input a batch that {name} accepts (first dimension = batch)" if in_magic()
               else f"pass example= a batch that {name} accepts (first dimension = batch), and loss_fn= if its "
                    "output needs one")) from exc


def estimate_memory(model: torch.nn.Module, optimizer="adamw", batch: int = 32, example=None, budget=None,
                    device="auto", probe_batches=None, amp_dtype="auto", loss_fn=None, name: str = "model",
                    gpu_counts=GPU_COUNTS) -> MemoryEstimate:
    """Predict a training step's peak memory for ``model`` at ``batch``, in fp32 and under autocast.

    ``example``: a batch (tensor or tuple, first dimension = batch) to build probe inputs from;
    optional for models whose first layer is ``nn.Linear``. ``budget``: "24GiB" or a share such as 0.9 (read like
    ``memory_budget``'s; it may exceed this machine: a per-GPU memory); default
    the device's memory. ``device``: where the dry runs execute (a copy of the model goes there).
    ``loss_fn(output) -> scalar``: default the sum of the first floating-point output.
    ``probe_batches``: the two dry-run batch sizes (default an eighth and a quarter of ``batch``).

    Off CUDA the predicted ``total`` counts tensor bytes; ``single(p)["total_no_reuse"]`` is the
    most the step can make the process's RSS reach (no freed block reused). glibc's default heap
    lands between the two (module docstring).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_arguments(batch, example, probe_batches, amp_dtype, loss_fn, name, gpu_counts)
    if probe_batches is None:
        # An eighth and a quarter of the batch: CPU and GPU kernels change algorithm (and temporaries) with
        # the batch size, so probes far below it extrapolate from another regime (tests/test_estimate.py).
        probe_batches = (max(2, batch // 8), max(4, batch // 4))
    if len(probe_batches) != 2 or probe_batches[0] >= probe_batches[1] or probe_batches[0] < 1:
        raise ValueError(f"{option('probe_batches')} must be two increasing batch sizes, e.g. (2, 4), got "
                         f"{tuple(probe_batches)}")
    dev = resolve_device(device)
    info = device_info(dev)
    from .budget import parse_budget

    if budget is None:
        budget_bytes, source = info.total_memory, (f"{info.label} memory" if dev.type == "cuda"
                                                   else "this host's physical memory")
    else:  # read like memory_budget's; a per-GPU budget may be larger than anything on this machine
        budget_bytes = parse_budget(budget, dev, limit=False)
        source = "as given"  # not "the budget": that read as a budget now being watched
    params = list(model.parameters())
    _check_parameters(model, params, name)
    trainable = [p for p in params if p.requires_grad]
    # Parameters alone, as the headline counts them; buffers apart (they were once in "params": 81,720 B
    # beside 20,234 parameters of 80,936 B for a CNN with BatchNorm).
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffers = list(model.buffers())
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    state_device, state_host = optimizer_state_bytes(trainable, optimizer)
    if dev.type == "cpu":
        state_device, state_host = state_device + state_host, 0
    opt_name = _optimizer_spec(optimizer)[0]
    loss_fn = loss_fn or _default_loss
    if amp_dtype == "auto":
        amp = torch.bfloat16 if (dev.type == "cpu" or info.supports_bf16) else torch.float16
    else:
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp_dtype]
    probe_batches = list(probe_batches)
    fits, states_measured = {}, None
    for label, dtype in (("fp32", None), (f"{DTYPE_NAMES[amp]} AMP", amp)):
        probe = _dry_run(model, optimizer, example, probe_batches, dev, dtype, loss_fn, name)
        allocated = None if dev.type == "cuda" else probe["allocated"]
        fits[label] = ActivationFit(label, probe_batches, probe["forward"], probe["backward"], grad_bytes, probe["step"],
                                    allocated, None if allocated is None else probe["step_allocated"],
                                    kept=probe["kept"])
        states_measured = probe["states_measured"]
    meter = ("the CUDA caching allocator's counters (memory_allocated, max_memory_allocated)" if dev.type == "cuda"
             else "live tensor storages counted by a TorchDispatchMode (exact tensor bytes; the process's RSS "
                  "under glibc's default heap is higher by a placement-dependent amount, at most total_no_reuse: "
                  "every byte the step allocates, also fitted linearly)")
    tensors = f"{len(params)} parameter tensors" + (f" and {len(buffers)} buffers" if buffers else "")
    method = (f"params/buffers/grads/optimizer states: exact arithmetic on {tensors}; activations "
              "(bytes alive at the end of the forward), the forward's and the backward's peaks: one dry training step "
              f"on a copy of the model at batches {probe_batches[0]} and {probe_batches[1]} on {dev} (by {meter}), "
              f"each extrapolated linearly to batch {batch}; optimizer step temporaries: measured once after them; "
              "sharding: ZeRO accounting, global batch split evenly; not included: CUDA context, allocator "
              "fragmentation")
    return MemoryEstimate(
        model_name=name, optimizer=opt_name, batch=batch, n_params=sum(p.numel() for p in params),
        n_trainable=sum(p.numel() for p in trainable), param_bytes=param_bytes, grad_bytes=grad_bytes,
        state_bytes=state_device, state_host_bytes=state_host, largest_layer_bytes=_largest_leaf_bytes(model),
        fits=fits, budget_bytes=budget_bytes, budget_source=source, probe_device=str(dev), method=method,
        states_measured=states_measured, gpu_counts=tuple(gpu_counts), buffer_bytes=buffer_bytes,
    )


__all__ = ["estimate_memory", "MemoryEstimate", "ActivationFit", "LiveBytes", "optimizer_state_bytes", "OPTIMIZERS",
           "PHASES"]
