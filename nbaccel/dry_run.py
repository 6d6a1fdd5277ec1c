"""A training step's activations, measured: the dry run behind `nbaccel.estimate`.

Activations are not guessed: one dry run of a training step on a copy of the model, at two smaller
batch sizes, measures them, in fp32 and under autocast: what the forward leaves alive for the
backward (the bytes alive at its end), the forward's and the backward's peaks and the optimizer
step's temporaries. On CUDA the measurement is the caching allocator's counters; elsewhere a
`LiveBytes` dispatch mode adds up the storages that ops create and drop (exact bytes of live
tensors, no allocator overhead). `ActivationFit` extrapolates each linearly to the requested batch.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from array import array
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .autocast_inside import AutocastInside
from .cell_reads import and_list
from .device import DTYPE_NAMES
from .eager_modes import EagerWhileActive
from .memory import cuda_counters, reset_cuda_peak
from .model_states import make_optimizers
from .options import in_magic, option
from .probe_inputs import cut_bags, example_tensors, find_bags
from .storages import optimizer_state_storage_bytes, storage_bytes, storage_keys, storages


class LiveBytes(AutocastInside, EagerWhileActive, TorchDispatchMode):
    """Peak bytes of the tensor storages created by ops while the mode is active.

    An op output whose storage is new (not one of the op's inputs' storages: views and in-place
    ops allocate nothing) is counted until its storage is freed (a weakref finalizer). Tensors that
    existed before (the parameters) are not counted. ``allocated`` is the sum of every new storage,
    freed or not: the bytes the block would touch if no freed block were ever reused. Ops that cast
    inside run cast, as without the mode (`AutocastInside`): under it torch.sparse.mm in a bf16 dry
    run raised, and nn.Bilinear's products were measured in fp32.

    With ``trace=True``, ``trace`` holds the live bytes at every op (the most while its outputs were counted)
    and ``trace_ops`` which op it was (the overload's ``id``): the moments at which a phase can peak
    (`moment_lines`). Plain ints in arrays, 16 bytes an op, so a large model's step costs little beside its
    tensors; off by default, so a long block measured for its peak alone does not grow them.
    """

    def __init__(self, trace: bool = False, mark: bool = False):
        super().__init__()
        self.tracing = trace
        # With ``mark`` (a profiler recording the allocator, `_OpScratch`): every op runs inside a profiler
        # range named `OP_MARK`, and ``trace_base`` holds the live bytes as it began, so that what the
        # allocator handed out inside it beyond its outputs (a kernel's scratch) can be added to its moment.
        self.marking = mark
        self.trace_base = array("q")
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.trace, self.trace_ops = array("q"), array("q")

    def __enter__(self):
        self.read_autocast()  # inside __torch_dispatch__ autocast reads off
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.marking:
            self.trace_base.append(self.current)
            with _op_range(OP_MARK):
                out = self.run_op(func, args, kwargs or {}, self.autocast_inside(func))
        else:
            out = self.run_op(func, args, kwargs or {}, self.autocast_inside(func))
        inputs = set()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                inputs |= storage_keys(t)
        top = self.current
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            for storage in storages(t):  # a sparse gradient (Embedding(sparse=True)): its indices and values
                key = storage._cdata
                if key in inputs or key in self._live:
                    continue
                size = storage.nbytes()
                self._live[key] = size
                self.current += size
                self.allocated += size
                self.peak = max(self.peak, self.current)
                top = max(top, self.current)
                weakref.finalize(storage, self._free, key)
        if self.tracing:
            self.trace.append(top)
            self.trace_ops.append(id(func))
        return out

    def _free(self, key):
        self.current -= self._live.pop(key, 0)



OP_MARK = "nbaccel::dry_run_op"
# A profiler range per op: torch's C++ one where this torch has it (1.1 µs a range against record_function's
# 10 µs, 20,000 empty ranges under a CPU profiler, torch 2.13), else the public one (the same events).
_op_range = getattr(torch._C._profiler, "_RecordFunctionFast", None) or torch.autograd.profiler.record_function
# How a profile refused while a dry run records in another thread names it (`recording.RECORDING`).
HOLDER = "a memory estimate's dry run"


class _OpScratch:
    """What torch's CPU allocator handed out inside each op of a dry run, its outputs included: the profiler's
    memory events (`tensor_peak.CpuTensorPeak`) in the ranges `LiveBytes` marks (``mark=True``).

    `LiveBytes` sees an op's outputs, not the scratch its kernel takes from the allocator and frees before it
    returns. oneDNN's bf16 matmuls on an AMX-BF16 host take scratch buffers (packed or reordered operands)
    of 9-141 KiB in a 64-128-8 MLP's step, whose size follows the kernel oneDNN picks for the shape, not a
    line in the batch: the last weight gradient's took 26,368 B at batch 2-32, 60,544 B at 48, 42,752 B
    at 64 and 75,520 B at 128. Its step peaked at that op, 26 KiB above what the outputs alone gave.

    ``peaks``: per marked op in order, the allocator's highest level inside it over its level as the op
    began; None where it could not be read (another profiler records, or the ranges did not match the ops).
    """

    def __init__(self):
        from .tensor_peak import CpuTensorPeak

        self._meter = CpuTensorPeak(HOLDER) if CpuTensorPeak.available() else None
        self.peaks: list[int] | None = None
        self.allocated = 0  # every byte the allocator handed out in the block

    @property
    def on(self) -> bool:
        return self._meter is not None and self._meter._prof is not None

    def __enter__(self):
        if self._meter is not None:
            self._meter.__enter__()
        return self

    def __exit__(self, *exc):
        if self._meter is None:
            return False
        from .tensor_peak import allocator_changes

        self._meter.__exit__(*exc)
        events = self._meter.events
        if events is None or exc[0] is not None:
            return False
        marks = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == OP_MARK)
        changes = allocator_changes(events)
        self.allocated = sum(n for _, n in changes if n > 0)
        peaks, level, i = [], 0, 0
        for start, end in marks:
            while i < len(changes) and changes[i][0] < start:
                level += changes[i][1]
                i += 1
            base = top = level
            while i < len(changes) and changes[i][0] <= end:
                level += changes[i][1]
                top = max(top, level)
                i += 1
            peaks.append(top - base)
        self.peaks = peaks
        return False


class EstimateError(ValueError):
    """Input the estimator cannot work with; the message says what to pass."""


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
    """Inputs for a batch of ``batch`` rows: rows of ``example`` repeated, or random for a Linear-first model.
    An nn.EmbeddingBag's flat (indices, offsets) pair is cut by bags instead (`probe_inputs.find_bags`)."""
    if isinstance(example, Mapping):  # keyword inputs (a Hugging Face-style batch): model(**batch), each value cut
        return {key: _example_batch(model, value, batch, device, name)[0] for key, value in example.items()}
    if example is not None:
        tensors = example if isinstance(example, (tuple, list)) else (example,)
        bags = find_bags(model, tensors)
        cut = cut_bags(tensors, bags, batch) if bags else {}
        out = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise EstimateError(f"{_example_option()} must be a tensor (or a tuple of tensors) whose first "
                                    "dimension is the batch")
            if i in cut:
                out.append(cut[i].to(device))
                continue
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


def _first_float(output) -> torch.Tensor | None:
    for t in tree_leaves(output if not hasattr(output, "logits") else output.logits):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


DEFAULT_LOSS = "the sum of the output (output.float().sum(): a loss that keeps nothing of its own)"
# A classifier or vocabulary head: a last dimension this wide is classes, and the default loss a cross-entropy.
HEAD_CLASSES = 1024
DEFAULT_HEAD_LOSS = ("a cross-entropy over the output's last dimension (F.cross_entropy(output.reshape(-1, classes), "
                     "class 0 for every row), for a last dimension of 1,024 or more")


MODEL_LOSS = ("the loss the model returned (output.loss / output['loss'], as a Hugging Face-style model computes it "
              "from the labels it was given)")


def model_loss(output) -> torch.Tensor | None:
    """The scalar loss a model returned with its output (HF's ``ModelOutput.loss``, a dict's ``"loss"``), or None.
    The default loss takes it: a cross-entropy over its logits would measure a second loss beside the model's own."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1 and loss.requires_grad:
        return loss
    return None


def _default_loss(output) -> torch.Tensor:
    own = model_loss(output)
    if own is not None:
        return own
    t = _first_float(output)
    if t is None:
        raise EstimateError("the model's output has no floating-point tensor to backpropagate from; pass "
                            + ("--loss NAME" if in_magic() else "loss_fn"))
    head = _head_shape(t)
    if is_head(head):
        # Logits this wide go to a cross-entropy, which keeps log_softmax's output for the backward (fp32 under
        # autocast) and makes the logits' gradient; the sum keeps neither (a 32,000-token model's step measured 3x
        # its prediction). So the dry run measures a cross-entropy. Every target is class 0: the values do not
        # change its memory, and zeros take nothing from the user's random generator.
        rows, classes = head
        return torch.nn.functional.cross_entropy(t.reshape(rows, classes),
                                                 torch.zeros(rows, dtype=torch.long, device=t.device))
    return t.float().sum()


def is_head(head: tuple[int, int] | None) -> bool:
    """Whether a `_head_shape` is a classifier's or vocabulary's (the default loss is then a cross-entropy)."""
    return head is not None and head[1] >= HEAD_CLASSES


def _head_shape(output) -> tuple[int, int] | None:
    """(rows, last dimension) of the output the default loss reads: the logits of a classifier or vocabulary
    head when the last dimension is its classes. None for an output of fewer than two dimensions."""
    t = _first_float(output)
    if t is None or t.dim() < 2 or not t.shape[-1]:
        return None
    return t.numel() // t.shape[-1], t.shape[-1]


def loss_takes_batch(loss_fn) -> bool:
    """Whether ``loss_fn`` is called as ``loss_fn(output, batch)``: two or more positional parameters without a
    default (a cross-entropy needs the targets, which come with the batch), else ``loss_fn(output)``."""
    import inspect

    # A loss module (nn.CrossEntropyLoss()) is called through Module.__call__(*args, **kwargs), which hides
    # its parameters: its forward's are the ones it takes (a trial's CrossEntropyLoss() was refused targets=).
    called = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        params = inspect.signature(called).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with the output alone
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return len(positional) >= 2


class _Peak:
    """Peak bytes created during a block: the CUDA allocator's counters, or `LiveBytes` elsewhere.

    Off CUDA, ``allocated`` is also set: all bytes the block's ops allocated (`LiveBytes.allocated`), and
    ``traces``: per phase, (the ops, the live bytes at its start and at every op) from `LiveBytes.trace`.
    On CUDA ``traces`` stays empty: the allocator's counters give a phase's peak, not its moments.
    """

    def __init__(self, device: torch.device):
        self.device, self.peak, self.allocated, self._mode = device, 0, None, None
        self.traces: list[tuple[array, array]] = []
        # Per phase: its peak (`phase`'s return; off CUDA raised at exit by the ops' scratch, `_OpScratch`).
        self.phase_peaks: list[int] = []
        # Off CUDA: the most bytes the ops' scratch added above what their outputs gave at any moment, and
        # whether it was read at all (False while another profiler records: the outputs alone then).
        self.scratch, self.scratch_read = 0, False
        self._bases: list[array] = []
        # Per phase, off CUDA: the gradients alive at each of its moments (`gradient_ready` marks them).
        self.grads: list[array] = []
        self._ready: list[tuple[int, int]] = []

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = cuda_counters(self.device)
            self._base = now.allocated
            reset_cuda_peak(self.device, now=now)
        else:
            self._scratch = _OpScratch().__enter__()
            self._mode = LiveBytes(trace=True, mark=self._scratch.on)
            self._mode.__enter__()
            self._start = 0
        return self

    def phase(self) -> int:
        """The peak since the last phase (over the base at enter); the next phase starts from now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = cuda_counters(self.device)
            peak = now.peak_allocated - self._base
            reset_cuda_peak(self.device, now=now)
            self.phase_peaks.append(peak)
            return peak
        mode = self._mode
        # The level at the phase's start is one of its moments (its peak is counted from it).
        self.traces.append((array("q", mode.trace_ops), array("q", [self._start]) + mode.trace))
        self.grads.append(_grads_per_moment(len(mode.trace) + 1, self._ready))
        self._bases.append(array("q", mode.trace_base))
        del mode.trace[:], mode.trace_ops[:], mode.trace_base[:], self._ready[:]
        self._start = mode.current
        peak, mode.peak = mode.peak, mode.current
        self.phase_peaks.append(peak)
        return peak

    @contextlib.contextmanager
    def autocast(self, dtype):
        """The forward's autocast (``dtype`` None: off), with `LiveBytes`, entered before it, told of it
        and of its end: it runs the ops that cast inside cast (`AutocastInside`), the forward's only."""
        try:
            with _autocast(self.device, dtype):
                if self._mode:
                    self._mode.read_autocast()
                yield
        finally:
            if self._mode:
                self._mode.read_autocast()

    def gradient_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (a post-accumulate-grad hook): it counts as a gradient at the
        phase's moments from the op that made it on, the ops done so far. What a sharded backward (ZeRO-2/3)
        keeps a share of: until then the same bytes are the backward's working memory, kept whole. A weight
        used twice (tied embeddings) gets one call: autograd sums its gradients before accumulating them."""
        if self._mode is not None:
            self._ready.append((len(self._mode.trace), storage_bytes(param.grad)))

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
            self._scratch.__exit__(*exc)
            self._add_scratch(self._scratch)
        return False

    def _add_scratch(self, scratch: _OpScratch) -> None:
        """Each op's moment raised to the live bytes as it began plus the allocator's peak inside it (its
        outputs and its kernel's scratch), and each phase's peak with it; untouched where the allocator's
        ranges were not read or do not match the ops one to one."""
        peaks = scratch.peaks
        if peaks is None or len(peaks) != sum(len(base) for base in self._bases):
            return
        k = 0
        for i, ((_, values), base) in enumerate(zip(self.traces, self._bases)):
            for j, start in enumerate(base):
                inside = start + peaks[k]
                k += 1
                if inside > values[j + 1]:
                    self.scratch = max(self.scratch, inside - values[j + 1])
                    values[j + 1] = inside
            self.phase_peaks[i] = max(self.phase_peaks[i], max(values))
        self.peak = self.phase_peaks[-1]
        self.allocated = max(self.allocated, scratch.allocated)
        self.scratch_read = True


def _grads_per_moment(moments: int, ready: list[tuple[int, int]]) -> array:
    """Gradient bytes alive at each of a phase's ``moments`` (0: its start; k: after its k-th op), from
    `_Peak.gradient_ready`'s (ops done, bytes) marks."""
    grads = array("q", bytes(8 * moments))
    for done, size in ready:
        grads[min(done, moments - 1)] += size
    for k in range(1, moments):
        grads[k] += grads[k - 1]
    return grads


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def _first_step(opt: torch.optim.Optimizer, replica: torch.nn.Module) -> None:
    """The dry run's first optimizer step, its failure said as the optimizer's: it was told to pass a
    batch the model accepts (a trial: Adam on an nn.Embedding(sparse=True) model, whose input was fine)."""
    try:
        opt.step()
    except (RuntimeError, ValueError, TypeError) as exc:
        sparse = any(p.grad is not None and p.grad.layout != torch.strided for p in replica.parameters())
        fix = (f"the model makes sparse gradients (nn.Embedding(sparse=True)): pass {option('optimizer', 'sparseadam')}"
               f" when all its gradients are sparse, else {option('optimizer', 'sgd')}, which takes both, or the "
               f"optimizer objects of the step ({several_optimizers()}), each over its own parameters" if sparse
               else f"pass an {option('optimizer')} that takes this model's parameters")
        raise EstimateError(f"the dry run's optimizer step ({type(opt).__name__}) failed after the forward and "
                            f"backward had run: {type(exc).__name__}: {exc}\n{fix}") from exc


def several_optimizers() -> str:
    """How to pass one optimizer per part of the model, as the caller spells it (the refusal and the estimate
    say it alike)."""
    return ("--optimizer opt_sp,opt for opt_sp = SparseAdam(the embeddings' parameters), opt = Adam(the rest)"
            if in_magic() else "optimizer=[SparseAdam(the embeddings' parameters), Adam(the rest)]")


def _probe(model, optimizer, example, batches, device, amp_dtype, loss_fn, name: str = "model", plan=None,
           targets=None, check: int | None = None, progress=None) -> dict:
    """Dry runs of a training step on a copy of the model: activations per batch, step temporaries.
    ``plan``: `model_states.optimizer_plan` (default ``optimizer`` over every trainable parameter).
    ``targets``: what a ``loss_fn(output, batch)`` gets as ``batch`` (cut to the probe rows like ``example``),
    instead of the model's inputs: the model is called with ``example`` alone, so labels cannot ride in it.
    ``progress(words)``: told before each step what it is (the estimate's progress note)."""
    progress = progress or (lambda words: None)
    replica = copy.deepcopy(model).to(device)
    replica.train()
    for p in replica.parameters():
        p.grad = None
    opts = make_optimizers(plan or [(optimizer, None)], list(model.parameters()), list(replica.parameters()))

    takes_batch, heads, model_losses = loss_takes_batch(loss_fn), [], []

    def forward_backward(b, meter=None):
        inputs = _example_batch(replica, example, b, device, name)
        with meter.autocast(amp_dtype) if meter else _autocast(device, amp_dtype):
            out = replica(**inputs) if isinstance(inputs, dict) else replica(*inputs)
            if meter:
                by_model = loss_fn is _default_loss and model_loss(out) is not None
                model_losses.append(by_model)
                heads.append(None if by_model else _head_shape(out))  # no cross-entropy over the logits was made
            if targets is not None:
                given = _example_batch(replica, targets, b, device, name)
                try:
                    loss = loss_fn(out, given[0] if isinstance(targets, torch.Tensor) else given)
                except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                    # the model ran: the loss refused the targets (a review: blamed on the model's input)
                    raise EstimateError(_loss_failure(loss_fn, out, given, exc)) from exc
            elif takes_batch:
                single = example is None or isinstance(example, torch.Tensor)
                try:
                    loss = loss_fn(out, inputs[0] if single else inputs)
                except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                    # the model ran: a loss that wants labels got the model's input (blamed on it before)
                    raise EstimateError(_loss_on_batch_failure(loss_fn, out, inputs, exc)) from exc
            else:
                loss = loss_fn(out)
            del out  # not held through the backward by this function (the real step's loss holds what it needs)
        # The forward's peak, and what it leaves alive for the backward: the activations (tensors saved
        # by autograd, the input batch, the loss; under autocast also the 16-bit copies of the weights).
        forward = (meter.phase(), meter.live()) if meter else None
        loss.backward()
        return forward

    # First step unmeasured: the optimizer allocates its state lazily, as in real training.
    progress(f"its first step, at batch {batches[0]} (unmeasured: the optimizer makes its state)")
    forward_backward(batches[0])
    for opt in opts:
        _first_step(opt, replica)
    replica.zero_grad(set_to_none=True)
    states_measured = sum(optimizer_state_storage_bytes(opt) for opt in opts)
    fwd, kept, bwd, allocated, sparse, sparse_params = [], [], [], [], [], set()
    fwd_traces, bwd_traces, bwd_grads = [], [], []
    step, step_allocated, scratch = [], [], []
    measuring: list[_Peak] = []  # the meter of the probe being measured, told when each gradient is ready
    hooks = [p.register_post_accumulate_grad_hook(lambda p: measuring and measuring[0].gradient_ready(p))
             for p in replica.parameters() if p.requires_grad]
    todo = list(batches)
    for b in todo:
        replica.zero_grad(set_to_none=True)
        progress(f"the step measured at batch {b}" + (" (a check of the first two)" if len(todo) > len(batches)
                                                      and b == todo[-1] else ""))
        with _Peak(device) as peak:
            measuring[:] = [peak]
            _, forward_kept = forward_backward(b, peak)
        measuring.clear()
        fwd.append(peak.phase_peaks[0])  # raised by the ops' scratch at exit, where the allocator was read
        scratch.append(peak.scratch if peak.scratch_read else None)
        kept.append(forward_kept)
        bwd.append(peak.peak)
        allocated.append(peak.allocated)
        if peak.traces:
            fwd_traces.append(peak.traces[0])
            bwd_traces.append(peak.traces[1])
            bwd_grads.append(peak.grads[1])
        # A sparse gradient (nn.Embedding/EmbeddingBag(sparse=True)) holds the batch's rows, not the whole
        # table: a trial's EmbeddingBag(200000, 256) was counted 195 MiB for 1.89 MiB. Measured, like the rest.
        grads = [(i, storage_bytes(p.grad)) for i, p in enumerate(replica.parameters())
                 if p.grad is not None and p.grad.layout != torch.strided]
        sparse_params = {i for i, _ in grads}
        sparse.append(sum(n for _, n in grads))
        # The step at every probe, over this batch's gradients: SparseAdam coalesces a sparse gradient and
        # builds temporaries the size of its values, so its step grows with the rows looked up (a trial:
        # 1.8 MiB predicted from one probe for 6.2-7.8 MiB measured at the batch).
        with _Peak(device) as peak:
            for opt in opts:
                opt.step()
        step.append(peak.peak)
        step_allocated.append(peak.allocated or 0)
        if peak.scratch_read and scratch[-1] is not None:
            scratch[-1] = max(scratch[-1], peak.scratch)
        if (len(todo) == len(batches) and b == todo[-1] and check and check > b
                and check_needed(max(s or 0 for s in scratch), max(fwd[-1], bwd[-1]))):
            todo.append(check)  # the kernels' scratch was a share of the peak that could move it: look once more
    for hook in hooks:
        hook.remove()
    replica.zero_grad(set_to_none=True)
    del replica, opts
    measured = {"forward": fwd, "kept": kept, "backward": bwd, "step": step, "allocated": allocated,
                "step_allocated": step_allocated, "sparse_grads": sparse, "heads": heads, "scratch": scratch}

    def fit(pair: slice) -> dict:
        """The figures of two of the probes, with their moments' lines."""
        at = todo[pair]
        return {"batches": at, **{key: values[pair] for key, values in measured.items()},
                "forward_lines": moment_lines(at, fwd_traces[pair]),
                "backward_lines": moment_lines(at, bwd_traces[pair]),
                "backward_grad_lines": grad_moment_lines(at, bwd_traces[pair], bwd_grads[pair])}

    out = fit(slice(0, 2))
    out.update(states_measured=states_measured, sparse_params=sparse_params, check=None, unrefitted=None,
               model_loss=bool(model_losses) and all(model_losses))
    if len(todo) > len(batches):
        out["check"] = _check_probe(todo, fwd, bwd, fwd_traces, bwd_traces)
        if out["check"]["refit"]:  # the lines through the two larger probes, the ones nearer the batch's kernels
            first = {key: out[key] for key in fit(slice(0, 2))}
            out.update(fit(slice(1, 3)), unrefitted=first)
    return out


# How far a check probe may land from the probes' lines before the lines are refitted through it.
CHECK_TOLERANCE = 0.01
# Scratch up to this many bytes takes no check probe, whatever its share: fp32 kernels took 1-2 KiB at the
# probes of a 64->128->8 MLP (AVX2 and AMX hosts), 2 % of a 97 KiB peak, and each such estimate paid a dry run
# at twice the larger probe's batch, and a line of method, to confirm its lines to the byte. The scratch that
# moved a step's peak (oneDNN's bf16 matmuls on AMX) took 26 KiB and more at the same probes.
CHECK_SCRATCH_FLOOR = 16 * 1024


def check_needed(scratch: int, peak: int) -> bool:
    """Whether the kernels' ``scratch`` at the probes (their most, in bytes) could move the probes' lines enough
    to look once more: over `CHECK_SCRATCH_FLOOR` and over `CHECK_TOLERANCE` of the larger probe's ``peak``."""
    return scratch > CHECK_SCRATCH_FLOOR and scratch > CHECK_TOLERANCE * peak


def _check_probe(batches, fwd, bwd, fwd_traces, bwd_traces) -> dict:
    """The forward's and the backward's peaks at the check batch (``batches[2]``), measured, against the highest
    of the first two probes' moments' lines there (the line through their peaks where the moments do not line
    up). ``refit``: either missed by more than `CHECK_TOLERANCE`; then the fit is the two larger probes'.

    A kernel's scratch (`_OpScratch`) is the one part of a step whose size is not its tensors' shapes: it
    follows the algorithm oneDNN picks for them, flat over some batches and then steeper (the MLP's last
    weight gradient in bf16 on AMX: 26,368 B at 2-32, 42,752 B at 64, 75,520 B at 128)."""
    out = {"batch": batches[2], "probes": list(batches[:2]), "phases": {}}
    for phase, peaks, traces in (("forward", fwd, fwd_traces), ("backward", bwd, bwd_traces)):
        lines = moment_lines(batches[:2], traces[:2])
        b = batches[2]
        intercept, slope = max(lines, key=lambda l: l[0] + l[1] * b) if lines else _line(batches[:2], peaks[:2])
        out["phases"][phase] = (int(intercept + slope * b), peaks[2])
    out["refit"] = any(abs(predicted - measured) > CHECK_TOLERANCE * max(measured, 1)
                       for predicted, measured in out["phases"].values())
    return out


def _line(batches, values) -> tuple[float, float]:
    """(intercept, slope) of the straight line through two measurements (slope clipped at 0)."""
    (b1, b2), (m1, m2) = batches[:2], values[:2]
    slope = max(0.0, (m2 - m1) / (b2 - b1))
    return max(0.0, m1 - slope * b1), slope


def moment_lines(batches, traces) -> list[tuple[float, float]] | None:
    """(intercept, slope) of the line through each moment of a phase at the two probes, from their traces
    (`_Peak.traces`); None where the traces do not line up (not the same ops in the same order: not the same
    graph, so no moment of one is a moment of the other) or were not taken (CUDA, one probe).

    The phase's peak at a batch is the highest of these lines there: a peak can move inside the phase as the
    batch grows (a vocabulary head's backward peaks at its end at small batches, with every gradient, and at
    its start at larger ones, with the logits' gradient), which one line through the two peaks cannot see.
    Only the lines no other beats in both intercept and slope are kept: the others are never the highest."""
    if not _aligned(batches, traces):
        return None
    (_, values1), (_, values2) = traces[:2]
    return _upper_lines({_line(batches, pair) for pair in zip(values1, values2)})


def _aligned(batches, traces) -> bool:
    """Whether two probes' traces ran the same ops in the same order (the same graph): then each moment of one
    is a moment of the other."""
    return len(traces) >= 2 and len(batches) >= 2 and traces[0][0] == traces[1][0]


def _upper_lines(lines) -> list[tuple[float, float]]:
    """The (intercept, slope) lines no other beats in both: the only ones that can be the highest at a batch."""
    kept, top = [], -1.0
    for intercept, slope in sorted(lines, key=lambda l: (-l[1], -l[0])):  # steepest first: kept if it starts
        if intercept > top:                                                # above every steeper one
            kept.append((intercept, slope))
            top = intercept
    return kept


def grad_moment_lines(batches, traces, grads) -> list[tuple[float, float, float, float]] | None:
    """Per moment of the backward, the line of the gradients alive then and the line of the rest (activations
    not yet freed, gradient temporaries, gradients not yet accumulated), as (gradients' intercept, slope,
    the rest's intercept, slope); None where `moment_lines` has none.

    A sharded backward (ZeRO-2/3) keeps 1/N of each gradient once it is accumulated, so its peak is the highest
    moment of (the rest + gradients / N): where the backward peaks before most gradients exist (a vocabulary
    head's, at the logits' gradient), the peak minus *all* the gradients undercounts it. Moments with the same
    gradients are pruned as `moment_lines` prunes, the others kept (one group per gradient accumulated)."""
    if not _aligned(batches, traces) or len(grads) < 2:
        return None
    (_, values1), (_, values2) = traces[:2]
    groups: dict[tuple[float, float], set] = {}
    for t1, t2, g1, g2 in zip(values1, values2, grads[0], grads[1]):
        groups.setdefault(_line(batches, (g1, g2)), set()).add(_line(batches, (t1 - g1, t2 - g2)))
    return [(gi, gs, ri, rs) for (gi, gs), rest in groups.items() for ri, rs in _upper_lines(rest)]


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
      the size of the parameters), activations all freed. Over sparse gradients they grow with the batch
      (SparseAdam coalesces the gradient and builds temporaries the size of its values), so they are
      measured at both probes and fitted too (`step_temporaries_at`).

    Each measured quantity is close to linear in the batch; the maximum of the phases is not, so each
    is fitted on its own (a straight line through the two probes) and the maximum is taken at the
    requested batch (`MemoryEstimate.per_gpu`). Nor is a phase's peak, where it moves inside the phase:
    off CUDA the forward's and the backward's are the highest of their moments' lines (`moment_lines`).
    """

    precision: str
    batches: list[int]
    forward: list[int]  # peak during the forward pass, over the model states, per probe batch
    backward: list[int]  # peak during the backward pass (activations still alive + gradients + temporaries)
    grad_bytes: int
    step_temporaries: int  # the optimizer step's temporaries at the first probe batch (`step_probes`: each)
    # Off CUDA: every byte the forward+backward allocated per probe batch, and the optimizer step's at the
    # first probe, freed or not (`LiveBytes.allocated`). None where the probes ran on CUDA.
    allocated: list[int] | None = None
    step_allocated: int | None = None
    # Bytes alive at the end of the forward, per probe batch: the activations it keeps for the backward.
    kept: list[int] | None = None
    # Bytes of the sparse gradients per probe batch (their indices and values); ``grad_bytes`` is then the
    # dense gradients alone. A sparse gradient grows with the batch (one row per lookup), so it is fitted too.
    sparse_grads: list[int] | None = None
    # The optimizer step's temporaries per probe batch, and (off CUDA) what it allocated; None: the first
    # probe's figures above stand for every batch.
    step_probes: list[int] | None = None
    step_allocated_probes: list[int] | None = None
    # (intercept, slope) per moment of the forward and of the backward (`moment_lines`); None: the line
    # through the phase's two peaks (CUDA probes, or probes whose ops did not line up).
    forward_lines: list[tuple[float, float]] | None = None
    backward_lines: list[tuple[float, float]] | None = None
    # Per moment of the backward, which gradients existed then (`grad_moment_lines`): what a sharded backward
    # keeps 1/N of. None (CUDA probes): the backward's peak minus (1 - 1/N) of all the gradients, a lower bound.
    backward_grad_lines: list[tuple[float, float, float, float]] | None = None

    def _sparse(self) -> bool:
        """Whether any gradient is sparse: then the gradients, and the step over them, grow with the batch."""
        return bool(self.sparse_grads) and any(self.sparse_grads)

    def _step_line(self, probes: list[int] | None, first: int) -> tuple[float, float]:
        """(intercept, slope) of a step figure: a line through the probes over sparse gradients, else flat.
        Over dense gradients the step sees only the parameters, their gradients and states, none of which
        grows with the batch: a line would turn a few bytes of difference between the probes into a slope
        (the largest probe's figure is kept, as one measurement after the probes once was)."""
        if not probes:
            return float(first), 0.0
        if not self._sparse():
            return float(max(probes)), 0.0
        return _line(self.batches, probes)

    def step_temporaries_at(self, batch: int) -> int:
        """The optimizer step's temporaries at ``batch`` (beside the gradients)."""
        intercept, slope = self._step_line(self.step_probes, self.step_temporaries)
        return int(intercept + slope * batch)

    def step_allocated_at(self, batch: int) -> int | None:
        """Bytes the optimizer step allocates at ``batch``, freed or not; None for CUDA probes."""
        if self.step_allocated is None:
            return None
        intercept, slope = self._step_line(self.step_allocated_probes, self.step_allocated)
        return int(intercept + slope * batch)

    @property
    def step_slope(self) -> float:
        """Bytes per sample of the optimizer step's phase: its gradients' and its temporaries' growth (0 over
        dense gradients)."""
        if not self._sparse():
            return 0.0
        return _line(self.batches, self.sparse_grads)[1] + self._step_line(self.step_probes, 0)[1]

    def grads_at(self, batch: int) -> int:
        """The gradients at ``batch``: the dense ones exactly, the sparse ones fitted through the probes."""
        if not self._sparse():
            return self.grad_bytes
        intercept, slope = _line(self.batches, self.sparse_grads)
        return int(self.grad_bytes + intercept + slope * batch)

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

    def _peak_line(self, peaks: list[int], lines, batch: int) -> tuple[float, float]:
        """(intercept, slope) of the line that gives a phase's peak at ``batch``: the highest of its moments'
        ``lines`` there (the steeper on a tie), else the line through its peaks at the probes."""
        if not lines:
            return _line(self.batches, peaks)
        return max(lines, key=lambda line: (line[0] + line[1] * batch, line[1]))

    def _forward_line(self, batch: int) -> tuple[float, float]:
        return self._peak_line(self.forward, self.forward_lines, batch)

    def _backward_line(self, batch: int) -> tuple[float, float]:
        return self._peak_line(self.backward, self.backward_lines, batch)

    @property
    def slopes(self) -> tuple[float, float]:
        """Bytes per sample of the forward's and of the backward's peak (the two phase lines through the
        probes' peaks; `slopes_at` a batch: of the moment that peaks there)."""
        return _line(self.batches, self.forward)[1], _line(self.batches, self.backward)[1]

    def slopes_at(self, batch: int) -> tuple[float, float]:
        """Bytes per sample of the forward's and of the backward's peak at ``batch``."""
        return self._forward_line(batch)[1], self._backward_line(batch)[1]

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
        intercept, slope = self._forward_line(batch)
        return max(int(intercept + slope * batch), self.at(batch))

    def backward_working_at(self, batch: int) -> int:
        """The backward's peak beside the gradients at ``batch``: activations not yet freed + gradient
        temporaries (the backward peak's line minus the gradients)."""
        intercept, slope = self._backward_line(batch)
        return int(max(0.0, intercept + slope * batch - self.grads_at(batch)))

    def backward_at(self, batch: int, grad_share: float = 1.0) -> int:
        """The backward's peak at ``batch`` over the model states, each gradient kept at ``grad_share`` of its
        size once accumulated (ZeRO-2/3 over N devices: 1/N).

        Whole gradients: the backward peak's line. Sharded: the highest moment of the rest + the share of the
        gradients alive then (`grad_moment_lines`), never below the peak minus the unkept share of every
        gradient (what CUDA probes, which have no moments, give), nor above the unsharded peak."""
        grads, working = self.grads_at(batch), self.backward_working_at(batch)
        whole = grads + working
        if grad_share >= 1.0:
            return whole
        floor = grad_share * grads + working
        if not self.backward_grad_lines:
            return int(floor)
        moments = max(ri + rs * batch + grad_share * (gi + gs * batch) for gi, gs, ri, rs in self.backward_grad_lines)
        return int(min(whole, max(floor, moments)))

    def phases(self, batch: int, grad_share: float = 1.0, step_temporaries: float | None = None) -> dict:
        """Each phase's peak over the model states at ``batch``, with each device keeping ``grad_share`` of
        the gradients (1: all of them; ZeRO-2/3 over N devices: 1/N) and the optimizer step's temporaries
        (default `step_temporaries_at` the batch)."""
        step = self.step_temporaries_at(batch) if step_temporaries is None else step_temporaries
        return {"forward": self.forward_at(batch), "backward": self.backward_at(batch, grad_share),
                "optimizer step": grad_share * self.grads_at(batch) + step}

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
        return int(intercept + slope * batch + (self.step_allocated_at(batch) or 0))

    def to_dict(self, batch: int | None = None) -> dict:
        """The fit's figures; the phases' per-sample growth at ``batch`` where given (`slopes_at`)."""
        slopes = self.slopes if batch is None else self.slopes_at(batch)
        return {"precision": self.precision, "probe_batches": self.batches, "measured_bytes": self.measured,
                "activation_bytes_per_sample": self.per_sample, "activation_fixed_bytes": self.fixed,
                "forward_peak_bytes": self.forward, "backward_peak_bytes": self.backward,
                "forward_peak_bytes_per_sample": slopes[0], "backward_peak_bytes_per_sample": slopes[1],
                "bytes_per_sample": max(slopes), "step_temporaries_bytes": self.step_temporaries,
                "step_temporaries_probe_bytes": self.step_probes,
                "allocated_bytes": self.allocated, "step_allocated_bytes": self.step_allocated,
                "step_allocated_probe_bytes": self.step_allocated_probes, "sparse_grad_bytes": self.sparse_grads}



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


def _shape(t):
    """A tensor's shape as an error quotes it, else its type's name."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _loss_failure(loss_fn, out, targets: tuple, exc: BaseException) -> str:
    """The loss failed on the model's output and the targets: both shapes, and the options that gave them."""
    first = _first_float(out)
    given = ", ".join(str(_shape(t)) for t in targets)
    loss, target = ("--loss", "--target") if in_magic() else ("loss_fn=", "targets=")
    return (f"the dry run's loss {getattr(loss_fn, '__name__', type(loss_fn).__name__)}(output, targets) failed: "
            f"{type(exc).__name__}: {exc}\nthe model's output has shape {_shape(first) if first is not None else '?'}, "
            f"the targets (cut to the probe's rows) {given}: pass {target} what {loss} takes with that output")


def _loss_on_batch_failure(loss_fn, out, inputs: tuple, exc: BaseException) -> str:
    """A two-argument loss, given no targets, failed on the model's output and input batch: it most likely
    wants labels, which the model's input cannot carry."""
    first = _first_float(out)
    loss, target = ("--loss", "--target NAME") if in_magic() else ("loss_fn=", "targets=")
    name = getattr(loss_fn, '__name__', type(loss_fn).__name__)
    return (f"the dry run's loss {name} takes two arguments and, with no {target} given, was called as "
            f"{name}(output, the model's input): {type(exc).__name__}: {exc}\nthe model's output has shape "
            f"{_shape(first) if first is not None else '?'}, its input {', '.join(str(_shape(t)) for t in inputs)}: "
            f"pass the labels {loss} takes as its second argument with {target} (a tensor whose first "
            "dimension is the batch, e.g. y for a classifier's cross-entropy)")


def _dry_run(model, optimizer, example, batches, device, amp_dtype, loss_fn, name, plan=None, targets=None,
             check=None, progress=None):
    """`_probe`, with a failure of the model on the probe input said as such: the user's error (e.g. a
    shape mismatch) shows the probe batch, not the batch they asked for, which is confusing alone.
    An `EstimateError` (docs/api.md: the estimate could not use the model's input), chained from the model's."""
    out_of_memory = None
    try:
        return _probe(model, optimizer, example, batches, device, amp_dtype, loss_fn, name, plan, targets, check,
                      progress)
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AssertionError, MemoryError) as exc:
        from .oom import is_oom

        if isinstance(exc, EstimateError):
            raise
        if is_oom(exc):  # MemoryError too
            said = str(exc).strip()
            out_of_memory = said.splitlines()[0] if said else type(exc).__name__
        else:
            _raise_model_failure(model, example, batches, amp_dtype, name, exc)
    # Raised out here, the OOM's traceback (and the probe's tensors its frames hold) is gone: a trial's
    # --batch 100000000000 got 20 frames ending in torch.arange, and under a watched budget an explanation
    # that took nbaccel's probe for the user's step.
    raise EstimateError(_probe_oom_words(batches, check, device, out_of_memory))


def _probe_oom_words(batches, check, device, torch_words: str) -> str:
    sizes = [*batches, *([check] if check else [])]
    fix = ("pass a smaller --batch" if in_magic()
           else "pass a smaller batch=, or smaller probe_batches= (two increasing sizes, e.g. (2, 4))")
    return (f"the dry run ran out of memory itself: it runs the step for real on probe batches of "
            f"{and_list([f'{b:,}' for b in sizes])} rows, smaller than the batch asked for, and the "
            f"{device.type.upper()} could not hold them ({torch_words}). A batch part of which does not fit "
            f"this device does not fit it whole; {fix} to estimate a size that runs here")


def _raise_model_failure(model, example, batches, amp_dtype, name, exc):
    """The model failed on the probe input: said with the probe batch and the shapes it was fed."""
    words, path, first = _layer_words(model, name)
    misfit = ""
    if example is None:
        # getattr: a failure before the input was made (the model's deepcopy) has no Linear behind it
        feed = (f"a random input of shape ({batches[0]}, {getattr(first, 'in_features', '?')}) made for its "
                f"first layer ({path}, an nn.Linear)")
    else:
        keyed = isinstance(example, Mapping)
        tensors = example_tensors(example)
        shapes = ", ".join((f"{key}=" if keyed else "") + str(tuple(t.shape))
                           for key, t in zip(example if keyed else range(len(tensors)), tensors))
        bags = find_bags(model, tensors)
        how = "cut" if all(t.dim() and t.shape[0] >= batches[0] for t in tensors) else "repeated"
        feed = f"the example (shape {shapes}) {how} to the probe batch of {batches[0]} rows"
        if bags:
            how = "cut" if bags.bags >= batches[0] else "repeated"
            feed = (f"the example (shape {shapes}) {how} to the probe batch of {batches[0]} bags "
                    f"({bags.words(name)})")
        takes = _layer_input(first)
        if takes and _layer_misfit(first, tensors[0]):
            misfit = f"the example has shape {tuple(tensors[0].shape)} and {words} takes {takes}\n"
    precision = "fp32" if amp_dtype is None else f"autocast {DTYPE_NAMES.get(amp_dtype, amp_dtype)}"
    raise EstimateError(
        f"the dry run of {name} on {feed} failed ({precision}): {type(exc).__name__}: {exc}\n{misfit}"
        + (f"pass --input a batch that {name} accepts (first dimension = batch; a dict of tensors for a model "
           "called as model(**batch))" if in_magic()
           else f"pass example= a batch that {name} accepts (first dimension = batch; a dict of tensors for a "
                "model called as model(**batch)), and loss_fn= if its output needs one")) from exc
