"""What each operator of a run really computed: its dtype, its FLOPs, and its matmul shapes.

Autocast decides per operator whether to cast, so "the cell ran in bf16" is never the whole
truth. `OpAudit` is a ``TorchDispatchMode``: it sits below autocast in the dispatcher and sees
every aten op *after* autocast cast its inputs, in forward and backward alike. For each op it
records the output dtype and the FLOPs: by torch's FLOP registry (the one
``torch.utils.flop_counter.FlopCounterMode`` uses; a multiply-add counts as 2 FLOPs), and for ops
it lacks by nbaccel's formulas from the argument shapes (``analysis.op_flops``, which the profiler
uses too): CPU attention, oneDNN's LSTM, the fused TransformerEncoderLayer / MultiheadAttention
inference fast paths, whose matmuls run inside one op the mode sees whole.

Under ``torch.inference_mode()`` the autograd dispatch keys are skipped, so composite ops
(``aten::linear``, ``aten::matmul``, ``aten::conv2d``, ``aten::scaled_dot_product_attention``,
``aten::einsum``...) reach the mode whole instead of as the ``addmm`` / ``mm`` / ``convolution``
they run as, and none of them is in the FLOP registry. Like ``FlopCounterMode``, the audit then
runs the op's own decomposition (the very kernel the op would run) with itself re-entered, so it
sees and counts the ops underneath, and an inference-mode cell reads exactly as under
``no_grad()``. Each aten op is seen once either way: under grad or ``no_grad`` the composite is
decomposed before it reaches the mode, and inside ``__torch_dispatch__`` the mode is off, so a
composite and its children are never both recorded.

It also follows small results back to the values they were computed from (`magnitude_of`): a
sum of LayerNorm outputs up to 4.8 came to 4e-4, whose relative drift under bf16 is rounding of
those values, not a measure of accuracy (``drift.compute_drift``).

An audited run is slower than a plain one, so it is never the run that is timed.
"""

from __future__ import annotations

import functools
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakTensorKeyDictionary

from .analysis.op_flops import op_flops
from .autocast_inside import AUTOCAST_KEYS, CASTS_INSIDE, AutocastInside
from .eager_modes import EagerWhileActive
from .device import DTYPE_NAMES
from .signals import sigint_held as _sigint_held  # here first; tests and callers import it from here too

if TYPE_CHECKING:
    import pandas as pd

# Ops that dominate training time and that Tensor Cores / AMX accelerate in reduced precision.
HEAVY_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::convolution",
    "aten::convolution_backward",
    "aten::_convolution", "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    # fused inference fast paths of nn.TransformerEncoderLayer / nn.MultiheadAttention (their matmuls inside)
    "aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention",
    "aten::_trilinear",  # nn.Bilinear's batched products
    # attention's and recurrent layers' backward kernels, and the recurrent layers' own (oneDNN, cuDNN)
    "aten::_scaled_dot_product_flash_attention_backward", "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward", "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_flash_attention_backward", "aten::_efficient_attention_backward",
    "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward", "aten::_cudnn_rnn", "aten::_cudnn_rnn_backward",
})
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"})
# View and bookkeeping ops say nothing about arithmetic precision; leaving them out keeps the table readable.
_IGNORED = frozenset({"aten::t", "aten::view", "aten::detach", "aten::expand", "aten::_unsafe_view", "aten::transpose",
                      "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::slice",
                      "aten::select", "aten::alias", "aten::reshape", "aten::lift_fresh"})


def _import_what_dispatch_modes_need() -> None:
    """The first dispatch mode entered in a process imports torch._dynamo (1-2 s, with sympy). In
    %%amp that is the first audited run, and a trial's Ctrl-C landed in that import: a hundred
    importlib frames, and once a half-imported torch._dynamo that made a later run raise
    AttributeError from inside torch. So it is imported before the audit begins, whole."""
    if "torch._dynamo" not in sys.modules:
        with _sigint_held():
            import torch._dynamo  # noqa: F401


# Outputs of at most this many elements (a loss, a sum, a few metrics) get the magnitude of the values
# they were computed from: a result that small can be a cancellation; a larger one is judged by its
# own largest element.
SMALL_RESULT = 16


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in ``t`` (0.0 when there is none)."""
    a = t.detach().abs()
    return float(torch.where(torch.isfinite(a), a, 0).amax()) if a.numel() else 0.0


def _has_shape(value) -> bool:
    """Whether ``value`` is no tensor, or a dense one whose sizes are its shape (strided, or oneDNN's
    blocked layout): a nested tensor's raise ("NestedTensorImpl doesn't support sizes"), a sparse one's
    are not its operand's (its FLOPs would be a dense one's, and padding advice for it wrong)."""
    if not isinstance(value, torch.Tensor):
        return True
    return value.layout in (torch.strided, torch._mkldnn) and not value.is_nested


# The first embedding lookups whose ids the audit keeps (a prompt, a position embedding looked up before
# the token one), and the most ids it copies of one: a prompt, not a training batch.
EMBEDDING_IDS_KEPT = 4
EMBEDDING_IDS_SIZE = 1 << 16


def dtype_name(dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", "") if dtype is not None else "none")


@dataclass
class _OpRecord:
    calls: int = 0
    flops: int = 0
    input_dtypes: set = field(default_factory=set)
    shapes: set = field(default_factory=set)  # matmul operand shapes, for the multiple-of-8 check


class OpAudit(AutocastInside, EagerWhileActive, TorchDispatchMode):
    """Records (op, output dtype) -> calls, FLOPs and matmul shapes for everything run inside it."""

    def __init__(self, keep_embedding_ids: bool = True):
        super().__init__()
        self.records: dict[tuple[str, str], _OpRecord] = defaultdict(_OpRecord)
        self.calls = 0  # every op dispatched, views included: how much a per-op meter would record
        # small float output -> the largest magnitude among it and the values it was computed from,
        # following small inputs back to what made them (sum -> detach -> div); a Python number from
        # .item() is keyed by its value
        self._magnitudes = WeakTensorKeyDictionary()
        self._number_magnitudes: dict[float, float] = {}
        self.read_autocast()  # again as the audit begins (`AutocastInside`)
        self._depth = 0  # how many times the audit is entered: it re-enters itself to decompose an op
        # host copies of the ids the first few embedding lookups took: a generate loop's prompt, which
        # the token comparison leaves out of its counts (`drift.compare_tokens`)
        self.embedding_ids: list[torch.Tensor] = []
        # ``keep_embedding_ids=False``: the reduced-precision run's audit, whose prompt is the fp32 run's
        # (the same starting state), so its copies would only be host memory and time
        self._embedding_ids_wanted = EMBEDDING_IDS_KEPT if keep_embedding_ids else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        if func not in flop_registry and not types:
            # A composite op seen whole (inference mode, see the module docstring): record what it
            # decomposes into instead; NotImplemented means it has no decomposition. Not for a tensor
            # subclass's op (``types``: a jagged nested tensor): its decomposition reaches the same op
            # on the same subclass, and the audit recursed until Python's limit (a user trial's
            # `nt @ w`); the subclass runs it whole, as in the timed runs.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        keys = self.autocast_inside(func)
        out = self.run_op(func, args, kwargs, keys)
        self._follow_magnitudes(func, args, kwargs, out)  # views and detach too: they pass a result on
        # "aten::mm", as torch.profiler and the dispatcher's schemas name ops, so %%amp's op table and
        # %%profile_gpu's read the same.
        name = f"{func.namespace}::{func.overloadpacket.__name__}"
        if name in _IGNORED or func.namespace == "profiler":  # record_function markers, not math
            return out
        if name == "aten::embedding" and len(self.embedding_ids) < self._embedding_ids_wanted:
            self._keep_ids(args[1] if len(args) > 1 else kwargs.get("indices"))
        flat_in, _ = tree_flatten((args, kwargs))
        # An op that casts inside ran its math in autocast's dtype, whatever it returns (_trilinear's
        # bf16 bmm calls sum into an fp32 result)
        ran = self._cast_dtype(keys, flat_in) if keys else _dtype_ran(name, flat_in, out)
        record = self.records[(name, dtype_name(ran) if ran is not None else _no_tensor_out(func, args, kwargs, out))]
        record.calls += 1
        record.input_dtypes.update(dtype_name(t.dtype) for t in flat_in if isinstance(t, torch.Tensor))
        dense = all(map(_has_shape, flat_in))  # read once: the FLOPs and the shapes both need it
        record.flops += _flops_of(func, name, args, kwargs, out, dense)
        if name in MATMUL_OPS and len(record.shapes) < 32 and dense:
            shapes = tuple(tuple(t.shape) for t in flat_in if isinstance(t, torch.Tensor))
            record.shapes.add(shapes)
        return out

    def _keep_ids(self, ids) -> None:
        if (isinstance(ids, torch.Tensor) and ids.dim() in (1, 2) and 0 < ids.numel() <= EMBEDDING_IDS_SIZE
                and ids.layout == torch.strided and not ids.is_nested
                and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
            self.embedding_ids.append(ids.detach().to("cpu", copy=True))

    def __enter__(self):
        # Autocast as the code runs it, read as the audit begins: inside __torch_dispatch__ (where the
        # audit re-enters itself to decompose an op) autocast reads off.
        if not self._depth:
            _import_what_dispatch_modes_need()
            self.read_autocast()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        # A Ctrl-C in torch's __exit__ left the audit on torch's mode stack, and every later op of the
        # session ran through it: at its first line nothing was undone, at its _pop_mode the flags it
        # keeps were put back but the mode not popped. Held, and finished after one that still got in
        # (one at the first line of this __exit__ is undone by the recipe around the audit:
        # `precision.apply_recipe._exit_modes_left`).
        flags, depth = len(self.old_dispatch_mode_flags), torch._C._len_torch_dispatch_stack()
        try:
            with _sigint_held():
                return super().__exit__(*exc)
        except KeyboardInterrupt:
            if len(self.old_dispatch_mode_flags) == flags:  # nothing undone yet
                super().__exit__(*exc)
            elif torch._C._len_torch_dispatch_stack() == depth:  # the flags put back, the mode still on
                _pop_mode()
                self.leave_eager_stance()
            raise
        finally:
            self._depth -= 1

    @staticmethod
    def _cast_dtype(keys: list, flat_in: list):
        """The dtype autocast casts to on the device of the op's first tensor, among the autocast keys
        the op ran with (`AutocastInside.autocast_inside`)."""
        device = next((t.device.type for t in flat_in if isinstance(t, torch.Tensor)), "cpu")
        key = dict(AUTOCAST_KEYS).get(device)
        return torch.get_autocast_dtype(device) if key in keys else None

    def _follow_magnitudes(self, func, args, kwargs, out) -> None:
        small = [t for t in tree_flatten(out)[0]
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and 0 < t.numel() <= SMALL_RESULT]
        if not small and not isinstance(out, float):  # a float: .item() (aten::_local_scalar_dense)
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # reading a value would break the capture of a CUDA graph
        try:
            sources = self._scaled_sources(func, args, kwargs)
            if sources is None:
                sources = 0.0
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        sources = max(sources, self._source_size(t))
            if isinstance(out, float):
                self._number_magnitudes[out] = max(abs(out), sources)
            for t in small:  # each output its own size: nll_loss's second one is a count, not data
                self._magnitudes[t] = max(_largest(t), sources)
        except Exception:  # noqa: BLE001 - sparse, meta or subclass tensors: no magnitude, never a failed cell
            pass

    def _source_size(self, t) -> float:
        """The magnitude at which an input carries rounding: what made it (`magnitude_of`), its own
        largest element for data the audit did not see made, 0 for an exact value (a lone number made
        elsewhere is a constant, not rounded data; an integer tensor, a count)."""
        if not isinstance(t, torch.Tensor):
            return 0.0
        known = self._magnitudes.get(t)
        if known is not None:
            return known
        return _largest(t) if t.is_floating_point() and t.numel() > 1 else 0.0

    def _scaled_sources(self, func, args, kwargs) -> float | None:
        """For a product or quotient of small values, the magnitude its inputs' rounding reaches it at:
        the rounding carried through the scaling, not the largest magnitude met on the way. A user
        trial's cross_entropy(..., label_smoothing=0.1) sums 700 x 5000 log-probabilities (3.04e7)
        and divides that by 700 and by 5000 classes: the loss, 8.66, read as near 0 "next to values
        up to 3.04e+07", where the sum's rounding reaches it as 3.04e7 / 700 x 2e-5 = 0.87. For
        z = a * b the error is |b| e_a + |a| e_b; for a / b, e_a / |b| + |a| e_b / b^2 (e: each
        magnitude, `_source_size`; |a| its largest element, |b| the divisor's smallest): a cancellation
        scaled afterwards stays as near 0 as it was. None for any other op (the largest magnitude is taken)."""
        name = func.overloadpacket.__name__.rstrip("_")
        if func.namespace != "aten" or name not in ("mul", "div") or len(args) != 2 or kwargs.get("rounding_mode"):
            return None
        sizes = []
        for x in args:
            if isinstance(x, bool) or not isinstance(x, (int, float, torch.Tensor)):
                return None
            if isinstance(x, torch.Tensor):
                if x.is_complex() or x.numel() == 0:
                    return None
                a = x.detach().abs().double()
                sizes.append((float(a.amax()), float(a.amin()), self._source_size(x)))
            else:
                sizes.append((abs(x), abs(x), 0.0))
        (a_max, _, e_a), (b_max, b_min, e_b) = sizes
        if not all(map(math.isfinite, (a_max, b_max, e_a, e_b))):
            return None
        if name == "mul":
            return e_a * b_max + a_max * e_b
        if b_min == 0:  # a division by 0 somewhere: no scale to carry
            return None
        return e_a / b_min + a_max * e_b / (b_min * b_min)

    def magnitude_of(self, value) -> float | None:
        """For a small float result of the audited run (a tensor of at most `SMALL_RESULT` elements,
        or a number from ``.item()``): the largest magnitude among it and the values it was computed
        from, back through the small results that led to it; None for anything else."""
        if isinstance(value, torch.Tensor):
            return self._magnitudes.get(value)
        if isinstance(value, float):
            return self._number_magnitudes.get(value)
        return None

    def table(self) -> pd.DataFrame:
        import pandas as pd
        rows = [
            {"op": op, "dtype": dtype, "calls": r.calls, "flops": r.flops, "heavy": op in HEAVY_OPS,
             "input_dtypes": ",".join(sorted(r.input_dtypes))}
            for (op, dtype), r in self.records.items()
        ]
        frame = pd.DataFrame(rows, columns=["op", "dtype", "calls", "flops", "heavy", "input_dtypes"])
        return frame.sort_values(["heavy", "flops", "calls"], ascending=False, ignore_index=True)

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.records.values())

    def unaligned_matmuls(self, multiple: int = 8) -> list[dict]:
        """Matmul operand dims that are not multiples of ``multiple`` (Tensor Cores want 8 for fp16/bf16)."""
        found = []
        for (op, dtype), r in self.records.items():
            if dtype not in AUTOCAST_DTYPES:  # a float64, complex or integer matmul: no padding puts it on tiles
                continue
            for shapes in r.shapes:
                # dims of 1 are matrix-vector products: padding them would only add work
                dims = sorted({d for shape in shapes for d in shape[-2:] if d > 1 and d % multiple})
                if dims:
                    found.append({"op": op, "shapes": [list(s) for s in shapes], "unaligned": dims,
                                  "pad_to": [pad_to_multiple(d, multiple) for d in dims],
                                  # per call: how much of the work padding could speed up
                                  "flops": op_flops(op.replace(".", "::", 1), [list(s) for s in shapes])})
        return found


# The dtypes autocast works with (fp32 ops it casts, the bf16/fp16 they become) and Tensor Cores and AMX
# tiles take (fp32 through TF32 on a GPU): the only ones padding advice is for. A heavy op in any other
# (float64, complex) is one autocast leaves alone.
AUTOCAST_DTYPES = frozenset({"fp32", "bf16", "fp16"})


def _dtype_ran(name: str, flat_in: list, out) -> torch.dtype | None:
    """The precision an op's math ran in. A heavy op's is its narrowest floating input's, as
    %%profile_gpu reads it from a trace: oneDNN's LSTM backward takes bf16 tensors and hands back fp32
    gradients for the fp32 weights (read from the output, its 16 MFLOP of bf16 math were fp32, and the
    advice blamed autocast), and bf16 attention may take an fp32 mask larger than q, k and v. Other
    ops' is their output's (a cast's is what it cast to), as is that of ops that cast inside
    (`autocast_inside.CASTS_INSIDE`)."""
    if name in HEAVY_OPS and name not in CASTS_INSIDE:
        floats = [t.dtype for t in flat_in if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floats:
            return min(floats, key=lambda d: torch.finfo(d).bits)
    flat_out, _ = tree_flatten(out)
    tensors = [t for t in flat_out if isinstance(t, torch.Tensor)]
    return next((t.dtype for t in tensors if t.is_floating_point()), tensors[0].dtype if tensors else None)


def _no_tensor_out(func, args, kwargs, out) -> str:
    """The output dtype column of an op that returned no tensor, which read "none": what it returned. A
    Python number is "Python float" (``.item()``, aten::_local_scalar_dense: the value is read to the host,
    exactly as the tensor held it; its dtype is in the input dtypes column), "Python bool" (aten::equal).
    An op that returns nothing and writes tensors it was given (an optimizer's aten::_foreach_add_) ran in
    those tensors' dtype; one that writes none (an assert) has "no output"."""
    if isinstance(out, (bool, int, float, complex)):
        return f"Python {type(out).__name__}"
    if isinstance(out, torch.SymInt):  # pragma: no cover - symbolic shapes: under torch.compile's tracing
        return "Python int"
    written = [args[i] if i < len(args) else kwargs.get(name) for i, name in _written_arguments(func)]
    tensors = [t for t in tree_flatten(written)[0] if isinstance(t, torch.Tensor)]
    if tensors:
        return dtype_name(next((t.dtype for t in tensors if t.is_floating_point()), tensors[0].dtype))
    return "no output"


@functools.lru_cache(maxsize=None)
def _written_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func``'s schema says it writes. Cached per op: an optimizer's
    step calls its foreach ops once per parameter group every step, and the schema never changes."""
    return tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def _flops_of(func, name: str, args, kwargs, out, dense: bool | None = None) -> int:
    """The op's FLOPs: nbaccel's formula from the argument shapes, the one %%profile_gpu applies to
    the same op in a trace (so the two magics agree; it also covers what torch's flop_counter lacks:
    CPU attention, fused inference fast paths, oneDNN's LSTM, and counts a grouped convolution's
    weight gradient once where the registry counts it ``groups`` times), else torch's formula, else 0.
    0 for an op on a sparse (or nested) operand: its dims are not its work, as %%profile_gpu reads it.
    ``dense``: whether every operand is dense (`_has_shape`), where the caller knows it already."""
    try:
        if dense is None:
            dense = all(map(_has_shape, tree_flatten((args, kwargs))[0]))
        if not dense:
            return 0
        # as the profiler records them: each argument's shape (a list of shapes for a tensor list,
        # [] for a non-tensor) and the non-tensor values
        dims = [list(a.shape) if isinstance(a, torch.Tensor)
                else [list(t.shape) for t in a] if isinstance(a, (list, tuple)) and a
                and all(isinstance(t, torch.Tensor) for t in a) else [] for a in args]
        # lists of plain values stay (cuDNN RNN backward's output_mask says which gradients it computes)
        concrete = [None if isinstance(a, torch.Tensor) or (isinstance(a, (list, tuple))
                                                            and any(isinstance(t, torch.Tensor) for t in a))
                    else a for a in args]
        types = [str(a.dtype) if isinstance(a, torch.Tensor) else "" for a in args]  # complex: 4x (op_flops)
        own = op_flops(name, dims, types, concrete_inputs=concrete)
        if own is not None:
            return own
        counter = flop_registry.get(func.overloadpacket)
        return int(counter(*args, **kwargs, out_val=out)) if counter is not None else 0
    except Exception:  # noqa: BLE001 - a FLOP formula that does not fit must not break the user's cell
        return 0


def pad_to_multiple(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


# Padding a dim adds its share of work to the matmul: 1001 -> 1008 is 0.7% more, 61 -> 64 5%, but 4 -> 8
# doubles it (a trial's decoder was told to pad M=4, its batch size, to 8). Past this share the padded
# tiles cost more than the aligned ones save, and the advice leaves the dim out (the shapes list keeps it).
MAX_PADDING_OVERHEAD = 0.25


def padding_worth_it(n: int, multiple: int = 8) -> bool:
    """Whether padding ``n`` to a multiple of ``multiple`` adds at most `MAX_PADDING_OVERHEAD` of its work."""
    return pad_to_multiple(n, multiple) <= n * (1 + MAX_PADDING_OVERHEAD)


# Matrix products on integer or quantized operands, with the width of their weights: autocast casts
# float32 ops only and leaves these alone. The audit records them, but neither as heavy (their output
# is fp32 for quantize_dynamic's linear, whose int8 weights sit in a packed object, not a tensor) nor
# with FLOPs, and a trial's quantize_dynamic(model)(x) and torch._int_mm(a, b) cells were told
# "autocast had nothing here to cast (it leaves reductions, elementwise ops ...)" of nothing but matmuls.
QUANTIZED_MATMULS = {
    "quantized::linear_dynamic": "int8", "quantized::linear": "int8", "quantized::linear_relu": "int8",
    "quantized::linear_relu_dynamic": "int8", "quantized::linear_dynamic_fp16": "fp16 (packed)",
    "quantized::conv1d": "int8", "quantized::conv2d": "int8", "quantized::conv3d": "int8",
    "quantized::conv2d_relu": "int8", "quantized::conv_transpose2d": "int8",
    "aten::_int_mm": "int8", "aten::_weight_int8pack_mm": "int8", "aten::_weight_int4pack_mm": "int4",
    "aten::_weight_int4pack_mm_for_cpu": "int4",
}


def integer_matmuls(table: pd.DataFrame) -> dict[str, str]:
    """{op: the width it computes in} for the audit's integer and quantized matrix products: the ops of
    `QUANTIZED_MATMULS`, and heavy ops (``aten::mm`` ...) that ran on integer tensors."""
    if table.empty:
        return {}
    found = {}
    for op, dtype, heavy in table[["op", "dtype", "heavy"]].itertuples(index=False):
        if op in QUANTIZED_MATMULS:
            found[op] = QUANTIZED_MATMULS[op]
        elif heavy and dtype.startswith(("int", "uint", "qint", "quint")):
            found[op] = dtype
    return found


# Ops that pass a gradient through or zero it by a comparison of their input (a ReLU's sign, a max's
# winner, a dropout's mask, a clamp's bounds): where rounding moves the input across the line, a
# gradient entry of normal size becomes exactly 0. The gradient report names them as a cause of such
# zeros only where the audit saw one: a trial's LSTM + Linear (none of these) read "a ReLU, max or
# dropout whose input flipped sign" of 81 entries that bf16 rounding in sums had made 0.
SWITCH_OPS = frozenset({
    "aten::relu", "aten::relu_", "aten::threshold", "aten::threshold_", "aten::threshold_backward",
    "aten::relu6", "aten::hardtanh", "aten::hardtanh_", "aten::hardtanh_backward",
    "aten::clamp", "aten::clamp_", "aten::clamp_min", "aten::clamp_min_", "aten::clamp_max", "aten::clamp_max_",
    "aten::max", "aten::min", "aten::amax", "aten::amin", "aten::maximum", "aten::minimum",
    "aten::max_pool1d", "aten::max_pool2d", "aten::max_pool3d", "aten::max_pool2d_with_indices",
    "aten::max_pool3d_with_indices", "aten::max_pool2d_with_indices_backward",
    "aten::max_pool3d_with_indices_backward", "aten::adaptive_max_pool1d", "aten::adaptive_max_pool2d",
    "aten::adaptive_max_pool3d", "aten::adaptive_max_pool2d_backward", "aten::adaptive_max_pool3d_backward",
    "aten::mkldnn_max_pool2d", "aten::mkldnn_max_pool2d_backward",
    "aten::dropout", "aten::native_dropout", "aten::native_dropout_backward", "aten::feature_dropout",
    "aten::alpha_dropout", "aten::_fused_dropout", "aten::_masked_scale",
    "aten::topk", "aten::sort", "aten::kthvalue", "aten::median", "aten::nanmedian",
})


def switching_ops(table: pd.DataFrame) -> list[str]:
    """The `SWITCH_OPS` the audit recorded, by name."""
    return [] if table.empty else sorted(set(table["op"]) & SWITCH_OPS)


REDUCED = {"bf16", "fp16"}


def precision_summary(table: pd.DataFrame) -> dict:
    """Which ops ran in reduced precision, and which heavy ones stayed in fp32."""
    if table.empty:
        return {"reduced": [], "heavy_fp32": [], "reduced_flop_share": None}
    reduced = table[table["dtype"].isin(REDUCED)]
    heavy_fp32 = table[(table["dtype"] == "fp32") & table["heavy"]]
    total = int(table["flops"].sum())
    return {
        "reduced": sorted(set(reduced["op"])),
        "heavy_fp32": sorted(set(heavy_fp32["op"])),
        "reduced_flop_share": (int(reduced["flops"].sum()) / total) if total else None,
    }
