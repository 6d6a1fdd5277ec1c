"""FLOPs of one profiler op from its recorded shapes (``record_shapes=True``).

Why from shapes: Kineto traces carry no ``flops`` field even when the header says
``with_flops: 1`` (checked on all three reference traces), so FLOPs must be re-derived from
``args["Input Dims"]`` (and ``args["Concrete Inputs"]`` for stride/padding, recorded by recent
torch versions).  Conventions follow ``torch.utils.flop_counter``: a multiply-add is 2 FLOPs,
``addmm``/``baddbmm`` count only the matmul, attention counts the two batched matmuls and ignores
causal masking. Backward ops are counted too, as ``flop_counter`` does, so a training step's
FLOP/s includes them: attention backward is the five batched matmuls of the recompute and the
gradients; ``convolution_backward`` is one forward's worth per gradient it computes (input,
weight; from ``output_mask``). Backward matmuls show up as plain ``aten::mm`` already.

Beyond ``flop_counter``'s registry, with the same conventions (checked against it on the CPU in
``tests/test_flops_reference.py``): ``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its
backward), the CPU's attention kernel, which the registry lacks, so ``FlopCounterMode`` counts 0
for attention on the CPU; ``aten::_addmm_activation``, the fused linear + ReLU/GELU of
``nn.TransformerEncoderLayer``'s inference fast path (an addmm); ``aten::mv``/``aten::addmv``,
matrix-vector products (``A @ v`` and its backward); ``aten::dot``/``aten::vdot`` (``v @ v``);
recurrent layers (`rnn_flops`: LSTM, GRU, RNN); ``aten::_trilinear`` (`trilinear_flops`:
nn.Bilinear, forward and backward); torch's own CPU convolution kernels where oneDNN is not used
(bf16 on a CPU without bf16 units, float64, ``torch.backends.mkldnn`` off), which hold the time
under ``aten::_convolution``/``convolution_backward`` and so carry the FLOPs (the innermost op with a
formula counts, so ``_convolution`` then counts none): ``_slow_conv2d_forward``/``_backward`` (Conv1d/2d,
once per group), ``slow_conv3d_forward`` (Conv3d), ``slow_conv_dilated2d``/``3d`` and
``slow_conv_transpose2d``/``3d`` (once per group; their backward has no op of its own, so
``convolution_backward`` counts it). Also the GPU kernels under ``_convolution`` (cuDNN's transposed and
fused-ReLU ones, CUDA's depthwise, MIOpen's, MPS's) and NNPACK's, from their schemas' argument order
(`_CONV_ARGS`). A transposed convolution counts from the input side; dilation changes the output size
(read from stride/padding/dilation), not the work per output. Where the
registry is wrong, nbaccel is not: ``flop_counter`` counts a grouped
convolution's weight gradient ``groups`` times over (it multiplies by all input channels, not
those of one group).

Every function returns ``None`` when the shapes do not determine the answer; a made-up number
would end up in a FLOP/s figure.
"""
from __future__ import annotations

import ast
from math import prod
from typing import Any, Sequence

from .rnn_flops import RNN_OPS, rnn_flops
from .trilinear_flops import trilinear_flops

__all__ = ["op_flops", "dtype_of", "FLOP_OPS"]

Dims = Sequence[Sequence[int]]

# Input type strings as written by the profiler -> short dtype names used by peaks.py.
_TYPE_MAP = {
    "c10::bfloat16": "bf16",
    "c10::half": "fp16",
    "float": "fp32",
    "double": "fp64",
    "c10::float8_e4m3fn": "fp8",
    "c10::float8_e5m2": "fp8",
    "c10::float8_e4m3fnuz": "fp8",
    "c10::float8_e5m2fnuz": "fp8",
    "c10::float8_e8m0fnu": "fp8",
    "signed char": "int8",
    "c10::qint8": "int8",
}
# When an op mixes float types (fp8 matmul with fp32 scales, bf16 mats with fp32 bias), the
# narrowest one is what the math units run at.
_NARROWNESS = {"fp8": 0, "int8": 0, "fp16": 1, "bf16": 1, "fp32": 2, "fp64": 3}


def dtype_of(input_types: Sequence[str] | None) -> str | None:
    """Compute dtype of an op from its ``Input type`` list: ``"bf16"``, ``"fp16"``, ``"fp32"``...

    Non-float entries (``Scalar``, ``long int``, ``""``, ``TensorList``) are ignored; among
    float types the narrowest wins (an fp8 GEMM also takes fp32 scale tensors).
    """
    best = None
    for t in input_types or ():
        d = _TYPE_MAP.get(str(t).strip().lower())
        if d is not None and (best is None or _NARROWNESS[d] < _NARROWNESS[best]):
            best = d
    return best


def _shape(dims: Dims, i: int) -> list[int] | None:
    if dims is None or i >= len(dims):
        return None
    s = dims[i]
    if not isinstance(s, (list, tuple)) or not s:
        return None
    try:
        return [int(x) for x in s]
    except (TypeError, ValueError):
        return None


def _mm(a: list[int] | None, b: list[int] | None) -> int | None:
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return None
    (m, k), (k2, n) = a, b
    return 2 * m * k * n if k == k2 else None


def _mv(a: list[int] | None, v: list[int] | None) -> int | None:
    if a is None or v is None or len(a) != 2 or len(v) != 1:
        return None
    return 2 * a[0] * a[1] if a[1] == v[0] else None


def _bmm(a: list[int] | None, b: list[int] | None) -> int | None:
    if a is None or b is None or len(a) != 3 or len(b) != 3:
        return None
    (bs, m, k), (bs2, k2, n) = a, b
    return 2 * bs * m * k * n if k == k2 and bs == bs2 else None


def _broadcast(a: list[int], b: list[int]) -> list[int] | None:
    out = []
    for x, y in zip(reversed([1] * (len(b) - len(a)) + a), reversed([1] * (len(a) - len(b)) + b)):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return out[::-1]


def _matmul(a: list[int] | None, b: list[int] | None) -> int | None:
    """torch.matmul semantics: 1-D operands are promoted, batch dims broadcast."""
    if a is None or b is None:
        return None
    if len(a) == 1 and len(b) == 1:
        return 2 * a[0] if a == b else None
    a2 = [1] + a if len(a) == 1 else a
    b2 = b + [1] if len(b) == 1 else b
    m, k = a2[-2], a2[-1]
    k2, n = b2[-2], b2[-1]
    if k != k2:
        return None
    batch = _broadcast(a2[:-2], b2[:-2])
    return None if batch is None else 2 * prod(batch) * m * k * n


def _linear(x: list[int] | None, w: list[int] | None) -> int | None:
    if x is None or w is None or len(w) != 2 or x[-1] != w[1]:
        return None
    return 2 * prod(x[:-1]) * w[1] * w[0]


def _conv_arg(spec: dict, args: list, key: str) -> Any:
    """A convolution's argument ``key`` (its position in ``spec``, an `_CONV_ARGS` entry, or a value the
    overload fixes) from the parsed Concrete Inputs ``args``; None when not recorded."""
    pos = spec.get(key)
    if isinstance(pos, bool) or pos is None:
        return pos
    return args[pos] if pos < len(args) else None


# convolution_backward's `transposed` argument (grad_output, input, weight, bias_sizes, stride, padding,
# dilation, transposed, ...)
_CONV_BACKWARD_TRANSPOSED = 7


def conv_transposed(name: str, concrete: Sequence[Any] | None) -> bool | None:
    """Whether convolution op ``name`` is a transposed one, from the overload or its recorded Concrete
    Inputs (the ops that carry the FLOPs, ``aten::_convolution`` and ``convolution_backward``, say it
    only there); None when not known."""
    args = [parse_concrete(c) for c in (concrete or ())]
    if name == "aten::convolution_backward":
        value = args[_CONV_BACKWARD_TRANSPOSED] if len(args) > _CONV_BACKWARD_TRANSPOSED else None
    elif name in _CONV_ARGS:
        value = _conv_arg(_CONV_ARGS[name], args, "transposed")
    else:
        return None
    return value if isinstance(value, bool) else None


def parse_concrete(value: Any) -> Any:
    """'[2, 2]' -> [2, 2], '1' -> 1, 'same' -> 'same', '' -> None."""
    if value is None:
        return None
    if isinstance(value, (int, list, tuple)):
        return value
    text = str(value).strip()
    if not text:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text.strip("'\"")


def _expand(value: Any, n: int) -> list[int] | None:
    if isinstance(value, int):
        return [value] * n
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        return list(value) * n if len(value) == 1 else list(value)
    return None


# Argument positions of (stride, padding, dilation, transposed, output_padding, groups) for each
# convolution overload; transposed=True/False means the overload fixes it.
_CONV_ARGS = {
    "aten::convolution": dict(stride=3, padding=4, dilation=5, transposed=6, output_padding=7, groups=8),
    "aten::_convolution": dict(stride=3, padding=4, dilation=5, transposed=6, output_padding=7, groups=8),
    "aten::conv1d": dict(stride=3, padding=4, dilation=5, transposed=False, groups=6),
    "aten::conv2d": dict(stride=3, padding=4, dilation=5, transposed=False, groups=6),
    "aten::conv3d": dict(stride=3, padding=4, dilation=5, transposed=False, groups=6),
    "aten::conv_transpose1d": dict(stride=3, padding=4, output_padding=5, groups=6, dilation=7, transposed=True),
    "aten::conv_transpose2d": dict(stride=3, padding=4, output_padding=5, groups=6, dilation=7, transposed=True),
    "aten::conv_transpose3d": dict(stride=3, padding=4, output_padding=5, groups=6, dilation=7, transposed=True),
    "aten::cudnn_convolution": dict(padding=2, stride=3, dilation=4, groups=5, transposed=False),
    "aten::mkldnn_convolution": dict(padding=3, stride=4, dilation=5, groups=6, transposed=False),
    # torch's own CPU kernel (under aten::thnn_conv2d), where oneDNN is not used: a bf16 convolution on a
    # CPU without AVX512-BF16/AMX. (self, weight, kernel_size, bias, stride, padding): never dilated (no
    # dilation: 1) and called once per group with that group's channels, so its weight gives its FLOPs.
    "aten::_slow_conv2d_forward": dict(stride=4, padding=5, transposed=False),
    "aten::thnn_conv2d": dict(stride=4, padding=5, transposed=False),  # the op around _slow_conv2d_forward
    # The rest of torch's own kernels (profiled under aten::_convolution on torch 2.13's CPU: float64, bf16
    # without bf16 units, or torch.backends.mkldnn off; CUDA without cuDNN). (self, weight, kernel_size,
    # bias, stride, padding[, dilation]): the weight gives the channels of one group, and the dilated and
    # transposed ones are called once per group with that group's input and weight, so each call's weight
    # gives its own FLOPs. slow_conv3d (around slow_conv3d_forward) takes the whole input and the
    # grouped weight; its FLOPs are the same.
    "aten::slow_conv3d": dict(stride=4, padding=5, transposed=False),
    "aten::slow_conv3d_forward": dict(stride=4, padding=5, transposed=False),
    "aten::slow_conv_dilated2d": dict(stride=4, padding=5, dilation=6, transposed=False),
    "aten::slow_conv_dilated3d": dict(stride=4, padding=5, dilation=6, transposed=False),
    # (self, weight, kernel_size, bias, stride, padding, output_padding, dilation); transposed: counted from
    # the input side, so its FLOPs need no argument
    "aten::slow_conv_transpose2d": dict(stride=4, padding=5, output_padding=6, dilation=7, transposed=True),
    "aten::slow_conv_transpose3d": dict(stride=4, padding=5, output_padding=6, dilation=7, transposed=True),
    # CUDA's depthwise kernels (self, weight, kernel_size, bias, stride, padding, dilation)
    "aten::_conv_depthwise2d": dict(stride=4, padding=5, dilation=6, transposed=False),
    "aten::conv_depthwise3d": dict(stride=4, padding=5, dilation=6, transposed=False),
    "aten::_nnpack_spatial_convolution": dict(padding=3, stride=4, transposed=False),  # (input, weight, bias, ...)
    "aten::cudnn_convolution_transpose": dict(padding=2, output_padding=3, stride=4, dilation=5, groups=6,
                                              transposed=True),
    # fused convolution + (add +) ReLU (FX/inductor fusions): (self, weight, [z, alpha,] bias, stride, ...)
    "aten::cudnn_convolution_relu": dict(stride=3, padding=4, dilation=5, groups=6, transposed=False),
    "aten::cudnn_convolution_add_relu": dict(stride=5, padding=6, dilation=7, groups=8, transposed=False),
    "aten::miopen_convolution": dict(padding=3, stride=4, dilation=5, groups=6, transposed=False),
    "aten::miopen_depthwise_convolution": dict(padding=3, stride=4, dilation=5, groups=6, transposed=False),
    "aten::miopen_convolution_transpose": dict(padding=3, output_padding=4, stride=5, dilation=6, groups=7,
                                               transposed=True),
    "aten::miopen_convolution_relu": dict(stride=3, padding=4, dilation=5, groups=6, transposed=False),
    "aten::miopen_convolution_add_relu": dict(stride=5, padding=6, dilation=7, groups=8, transposed=False),
    "aten::_mps_convolution": dict(padding=3, stride=4, dilation=5, groups=6, transposed=False),
    "aten::_mps_convolution_transpose": dict(padding=2, output_padding=3, stride=4, dilation=5, groups=6,
                                             transposed=True),
}


def _conv(name: str, dims: Dims, concrete: Sequence[Any] | None, output_dims: Dims | None) -> int | None:
    x, w = _shape(dims, 0), _shape(dims, 1)
    if x is None or w is None or len(x) != len(w) or len(x) < 3:
        return None
    spec = _CONV_ARGS[name]
    args = [parse_concrete(c) for c in (concrete or ())]

    def arg(key: str) -> Any:
        return _conv_arg(spec, args, key)

    transposed = arg("transposed")
    if not isinstance(transposed, bool):
        return None
    nsp = len(x) - 2
    # torch.utils.flop_counter.conv_flop_count: spatial = output (forward) or input (transposed)
    if transposed:
        spatial = x[2:]
    else:
        out = _shape(output_dims, 0) if output_dims else None
        if out is not None and len(out) == len(x):
            spatial = out[2:]
        else:
            stride, padding, dilation = arg("stride"), arg("padding"), arg("dilation")
            stride = _expand(stride, nsp)
            dilation = _expand(dilation if dilation is not None else 1, nsp)
            if padding == "valid":
                padding = 0
            if padding == "same":
                spatial = x[2:]
            else:
                padding = _expand(padding, nsp)
                if stride is None or padding is None or dilation is None:
                    return None  # only dims recorded: output size unknown
                if not (len(stride) == len(padding) == len(dilation) == nsp):
                    return None
                spatial = [
                    (size + 2 * p - d * (k - 1) - 1) // s + 1
                    for size, p, d, k, s in zip(x[2:], padding, dilation, w[2:], stride)
                ]
    if any(s <= 0 for s in spatial):
        return None
    c_out, c_in_per_group, *kernel = w
    return 2 * x[0] * prod(spatial) * prod(kernel) * c_out * c_in_per_group


def _attention(q: list[int] | None, k: list[int] | None, v: list[int] | None, heads_first: bool,
               backward: bool = False) -> int | None:
    """Forward: 2*B*H*Lq*Lk*D (Q K^T) + 2*B*H*Lq*Lk*Dv (P V): 4*B*H*Lq*Lk*D when D == Dv.

    Backward (``flop_counter.sdpa_backward_flop_count``): the scores are recomputed (Q K^T), then
    dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q: 2*B*H*Lq*Lk*(3*D + 2*Dv).
    """
    if q is None or k is None or v is None or len(q) != 4 or len(k) != 4 or len(v) != 4:
        return None
    if heads_first:  # [B, H, L, D]
        b, h, lq, d = q
        lk, dv = k[2], v[3]
    else:  # [B, L, H, D] (flash / efficient attention kernels' own layout)
        b, lq, h, d = q
        lk, dv = k[1], v[3]
    if backward:
        return 2 * b * h * lq * lk * (3 * d + 2 * dv)
    return 2 * b * h * lq * lk * d + 2 * b * h * lq * lk * dv


def _fused_attention_block(x: list[int] | None, kv: list[int] | None, weights: list[list[int] | None]) -> int | None:
    """The matmuls of a fused attention block: every ``weights`` linear over the tokens of ``x``
    (``[B, L, E]``: the fast paths take batched, batch-first input only), plus Q K^T and P V between
    ``x`` and ``kv``'s sequence: ``4*B*Lq*Lk*E`` whatever the number of heads."""
    if x is None or kv is None or len(x) != 3 or len(kv) != 3 or kv[0] != x[0] or kv[2] != x[2]:
        return None
    if any(w is None or len(w) != 2 for w in weights):
        return None
    batch, lq, e = x
    return sum(2 * batch * lq * w[0] * w[1] for w in weights) + 4 * batch * lq * kv[1] * e


def _native_mha(dims: Dims) -> int | None:
    """``aten::_native_multi_head_attention`` (nn.MultiheadAttention's inference fast path): the q, k
    and v projections (thirds of ``qkv_weight``, over the query's and the key's tokens), the two
    attention matmuls and the output projection."""
    q, k, qkv_w, proj_w = _shape(dims, 0), _shape(dims, 1), _shape(dims, 5), _shape(dims, 7)
    if q is None or k is None or qkv_w is None or len(qkv_w) != 2 or qkv_w[0] % 3:
        return None
    third = [qkv_w[0] // 3, qkv_w[1]]
    core = _fused_attention_block(q, k, [third, proj_w])
    return None if core is None else core + 2 * (2 * k[0] * k[1] * third[0] * third[1])


def _encoder_layer(dims: Dims) -> int | None:
    """``aten::_transformer_encoder_layer_fwd`` (nn.TransformerEncoderLayer's inference fast path):
    self-attention (qkv and output projections, Q K^T, P V) and the two feed-forward linears."""
    src = _shape(dims, 0)
    weights = [_shape(dims, i) for i in (3, 5, 14, 16)]  # qkv, proj, ffn_1, ffn_2
    return _fused_attention_block(src, src, weights)


def _conv_backward(dims: Dims, concrete: Sequence[Any] | None, name: str = "aten::convolution_backward") -> int | None:
    """``convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask)``: each of grad_input and grad_weight costs
    one forward convolution, 2 * N * prod(weight) * prod(spatial), where spatial is the forward
    output's (= grad_output's) for a convolution and the input's for a transposed one.
    ``aten::_slow_conv2d_backward(grad_output, self, weight, kernel_size, stride, padding,
    output_mask)``, the CPU's fallback kernel inside it, is a plain (not transposed) one."""
    grad_out, x, w = _shape(dims, 0), _shape(dims, 1), _shape(dims, 2)
    if grad_out is None or x is None or w is None or not (len(grad_out) == len(x) == len(w) >= 3):
        return None
    args = [parse_concrete(c) for c in (concrete or ())]
    if name == "aten::_slow_conv2d_backward":
        transposed, mask = False, args[6] if len(args) > 6 else None
    else:
        transposed = conv_transposed(name, concrete)
        mask = args[10] if len(args) > 10 else None
    if not isinstance(transposed, bool) or not (isinstance(mask, (list, tuple)) and len(mask) >= 2):
        return None  # without output_mask we cannot tell which gradients were computed
    spatial = x[2:] if transposed else grad_out[2:]
    forward = 2 * x[0] * prod(w) * prod(spatial)
    return forward * sum(bool(m) for m in mask[:2])


_HEADS_FIRST_ATTN = {
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    # cuDNN's kernel op under _scaled_dot_product_cudnn_attention (H100/H200 bf16): counting it, the
    # innermost op, puts the FLOPs on the row that holds the device time (they were on its parent).
    "aten::_cudnn_attention_forward",
}
_SEQ_FIRST_ATTN = {"aten::_flash_attention_forward", "aten::_efficient_attention_forward"}
# Backward ops take (grad_out, query, key, value, ...): the shapes start one position later.
_HEADS_FIRST_ATTN_BWD = {
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_cudnn_attention_backward",  # (grad_out, query, key, value, out, logsumexp, ...)
}
_SEQ_FIRST_ATTN_BWD = {"aten::_flash_attention_backward", "aten::_efficient_attention_backward"}

#: Op names for which :func:`op_flops` knows a formula.
FLOP_OPS = frozenset(
    {"aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "aten::baddbmm",
     "aten::_addmm_activation", "aten::mv", "aten::addmv", "aten::addmv_",
     # addbmm (a sum of batched products) and the in-place forms (addbmm runs its batches as addmm_)
     "aten::addbmm", "aten::addmm_", "aten::baddbmm_", "aten::addbmm_",
     "aten::dot", "aten::vdot",  # 1-D products (`v @ v`, torch.inner); in no FLOP registry
     # int8 x int8 -> int32 and fp8 GEMMs, (M, K) x (K, N) with a multiply-add as 2 ops, as their peaks
     # (int8 TOPS, fp8 TFLOP/s) count them; torch._int_mm had none (a trial: "no FLOP formula matched")
     "aten::_int_mm", "aten::_scaled_mm",
     "aten::_trilinear"}  # nn.Bilinear
    | set(_CONV_ARGS)
    | _HEADS_FIRST_ATTN
    | _SEQ_FIRST_ATTN
    | _HEADS_FIRST_ATTN_BWD
    | _SEQ_FIRST_ATTN_BWD
    | {"aten::convolution_backward", "aten::_slow_conv2d_backward"}
    | RNN_OPS
    # Fused inference fast paths. In a trace their inner matmuls are recorded as child ops and
    # counted there (only the innermost op with a formula is counted); %%amp's op audit sees them whole.
    | {"aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention"}
)


# A complex multiply-add is 4 real multiplies and 4 adds: 8 FLOPs where a real one is 2 (a complex
# GEMM, cgemm/zgemm, does 4x the real work). torch runs a complex convolution as three real ones
# (Gauss's trick), which the trace and the op audit both see and count; the complex op around them
# (not counted itself: its children have formulas) says 3x, what they sum to.
COMPLEX_FACTOR = 4
COMPLEX_CONV_FACTOR = 3


def op_flops(
    name: str,
    input_dims: Dims | None,
    input_types: Sequence[str] | None = None,
    concrete_inputs: Sequence[Any] | None = None,
    output_dims: Dims | None = None,
) -> int | None:
    """FLOPs of op ``name`` (forward or backward) from its recorded ``Input Dims``, or ``None`` if unknown.

    ``input_types`` (the trace's ``Input type`` strings, or dtype names): a matmul on complex operands
    counts `COMPLEX_FACTOR` times the real count (a Fourier layer's complex einsum read 4x too few), a
    convolution `COMPLEX_CONV_FACTOR` times (the three real ones torch runs it as).
    ``concrete_inputs`` are the profiler's ``Concrete Inputs`` strings (stride,
    padding...), needed for convolution output sizes unless ``output_dims`` is known.
    Varlen (nested/cumulative-sequence) attention returns ``None``: its 3-D packed shapes do
    not give per-sequence lengths.
    """
    flops = _real_flops(name, input_dims, concrete_inputs, output_dims)
    if flops is not None and any("complex" in str(t).lower() for t in input_types or ()):
        conv = name in _CONV_ARGS or name in ("aten::convolution_backward", "aten::_slow_conv2d_backward")
        return flops * (COMPLEX_CONV_FACTOR if conv else COMPLEX_FACTOR)
    return flops


def _real_flops(name: str, input_dims: Dims | None, concrete_inputs: Sequence[Any] | None,
                output_dims: Dims | None) -> int | None:
    if name not in FLOP_OPS or not input_dims:
        return None
    s = lambda i: _shape(input_dims, i)  # noqa: E731 - tiny local accessor
    if name in ("aten::mm", "aten::_int_mm", "aten::_scaled_mm"):
        return _mm(s(0), s(1))
    if name in ("aten::addmm", "aten::_addmm_activation", "aten::addmm_"):
        return _mm(s(1), s(2))
    if name == "aten::mv":
        return _mv(s(0), s(1))
    if name in ("aten::addmv", "aten::addmv_"):
        return _mv(s(1), s(2))
    if name == "aten::bmm":
        return _bmm(s(0), s(1))
    if name in ("aten::baddbmm", "aten::baddbmm_", "aten::addbmm", "aten::addbmm_"):
        return _bmm(s(1), s(2))
    if name in ("aten::dot", "aten::vdot"):
        return _matmul(s(0), s(1)) if len(s(0) or ()) == 1 else None
    if name == "aten::matmul":
        return _matmul(s(0), s(1))
    if name == "aten::linear":
        return _linear(s(0), s(1))
    if name in _CONV_ARGS:
        return _conv(name, input_dims, concrete_inputs, output_dims)
    if name in _HEADS_FIRST_ATTN:
        return _attention(s(0), s(1), s(2), heads_first=True)
    if name in _SEQ_FIRST_ATTN:
        return _attention(s(0), s(1), s(2), heads_first=False)
    if name in _HEADS_FIRST_ATTN_BWD:
        return _attention(s(1), s(2), s(3), heads_first=True, backward=True)
    if name in _SEQ_FIRST_ATTN_BWD:
        return _attention(s(1), s(2), s(3), heads_first=False, backward=True)
    if name in ("aten::convolution_backward", "aten::_slow_conv2d_backward"):
        return _conv_backward(input_dims, concrete_inputs, name)
    if name in RNN_OPS:
        return rnn_flops(name, input_dims, concrete_inputs, parse_concrete)
    if name == "aten::_trilinear":
        return trilinear_flops([s(0), s(1), s(2)], concrete_inputs, parse_concrete)
    if name == "aten::_transformer_encoder_layer_fwd":
        return _encoder_layer(input_dims)
    if name == "aten::_native_multi_head_attention":
        return _native_mha(input_dims)
    return None
