"""Classify CUDA kernels and profiler ops from their names alone.

Why names: a torch.profiler trace records no hardware counters, so whether a kernel ran on
Tensor Cores has to be read from the library naming conventions (cuBLAS, cuDNN, CUTLASS,
xmma, nvjet, FlashAttention, TRT-LLM).  The rules below are the ones documented, with
evidence, in ``shared/data/README.md`` ("Kernel naming conventions found"); every rule is
checked against all 362 labelled names of ``cuda_kernel_names.csv`` in the tests.

``uses_tensor_cores`` answers ``True``/``False``, or ``None`` when the name cannot tell
(old Inductor ``triton__0d1d2d...`` names, Triton template matmuls, fp32-only nvjet, and
GEMM-looking names that match no known scheme).  Guessing there would silently bias the
Tensor Core share, so callers report those kernels separately.
"""
from __future__ import annotations

import functools
import re

from .phases import COMPILED, COMPILING, is_compiled_region, is_compiling

__all__ = [
    "uses_tensor_cores",
    "kernel_category",
    "op_category",
    "CATEGORIES",
]

#: Every category that ``kernel_category``/``op_category`` can return, in display order.
CATEGORIES = (
    "matmul/conv",
    "attention",
    "elementwise",
    "normalization",
    "reduction",
    "memory copy",
    "data transfer",
    "communication",
    "optimizer",
    "data loading",  # the rest from here on: CPU op rows only (nbaccel.analysis.phases)
    "compiled region",
    "compiling",
    "other",
)

# --- Tensor Core rules -----------------------------------------------------------------

# Names that contain GEMM/attention-looking words but are not matmuls (README rule 8/6 traps).
_TC_TRAPS = re.compile(
    r"fbgemm|split_embedding|reshape_and_cache"
    r"|FlashAttnBwdPreprocess|FlashAttnBwdPostprocess"
    # FA2 backward helpers: rowwise dot(dO, O), dQ/dKV dtype conversion, accumulator clearing
    r"|flash_bwd_dot_do_o|flash_bwd_convert_dq|flash_bwd_convert_dkv|flash_bwd_clear_dkvaccum"
)

# Kernel families that are known not to use Tensor Cores even though they do matmul-ish work
# (README rule 8): fp32 SIMT GEMMs and cuDNN fp32 conv algorithms, GEMV/dot, split-K reduce.
_NOT_TC = re.compile(
    r"_simt_|sgemm|dgemm|gcgemm|scudnn|gemv|gemmk1_kernel|gemmSN_|dot_kernel|reduce_1Block_kernel"
    r"|splitKreduce|ReduceSplitK|epilogue::impl::globalKernel|winograd|fft2d_|fft_|im2col"
    r"|implicit_convolve_sgemm|explicit_convolve_sgemm|dgrad_engine|wgrad_alg0_engine"
    r"|compute\w*OffsetsKernel|cask_cudnn"
    r"|dpsk::grouped_gemm::cuda::utils::"  # tensormap setup / transpose helpers of the FP8 GEMM
)

# MMA instruction-shape tokens (NVIDIA PyProf tc.py list, plus WMMA 161616). The lookarounds
# keep them from matching inside longer numbers such as template arguments.
_MMA_TOKEN = re.compile(r"(?<![0-9])(?:[hsci]884|[hsc]1688|i8816|16816|161616)(?![0-9])|hmma")

# cuBLAS/cuDNN xmma kernels, CUTLASS tensor-op classes, CuTe/CUTLASS-3 MMA atoms, wgmma.
_XMMA = re.compile(r"xmma_(?:gemm|sparse|fprop|dgrad|wgrad|implicit|warp_specialized)")
_XMMA_FP32_MATH = re.compile(r"_f32f32_f32f32_f32_")  # inferred {in}{out}_{math}{accum}: fp32 math
_CUTLASS_TENSOROP = re.compile(
    r"tensorop|MmaTensorOp|OpClassTensorOp|GmmaWarpSpecialized|MainloopSm90|MainloopSm100"
    r"|SM80_16x8x\d+_|SM90_64x\d+x\d+_|SM100_MMA|wgmma|tcgen05|warpgroupsize"
)

# Fused attention (README rule 6). FA2 vendored in PyTorch, FA3, TRT-LLM fmha, flashinfer prefill.
_ATTN_TC = re.compile(
    r"flash_fwd|flash_bwd|flash::compute_attn|FlashAttnFwd|FlashAttnBwd|fmha|flashinfer::\w*Prefill"
    r"|cudnn_generated_\w*sdpa|_sdpa_\w*wgmma"
)
# xformers / PyTorch mem-efficient attention: fp32 uses SIMT before sm80 and everything on sm50.
_MEMEFF_SIMT = re.compile(r"fmha_cutlass[FB]\w*(?:_f32\w*_sm(?:50|70|75)|_sm50)")

# Blackwell block-scaled / low-precision batched GEMMs from TRT-LLM (README rule 7).
_SM100_BMM = re.compile(r"^bmm_\w*(?:E4m3|E5m2|E2m1|Bfloat16|Fp16|MxInt4)\w*_sm1\d\d")
_DPSK_FP8 = re.compile(r"dpsk::grouped_gemm::cuda::\w*fp8\w*::GemmKernel")

# nvjet_{sm100_}?{type letters}_... ; letters: h fp16, t bf16, s fp32, q fp8 (inferred).
_NVJET = re.compile(r"^nvjet_(?:sm\d+_)?([a-z]+)_")

# Old Inductor names do not say what they compute; triton_tem_* are template matmuls whose
# tensor-core use depends on input dtype (README rule 9).
_TRITON_UNKNOWN = re.compile(r"^triton__\d|^triton_tem_|^triton_(?:mm|bmm)")
_TRITON_NOT_TC = re.compile(r"^triton_(?:poi|red|per)_")

# Anything still looking like a matmul after all rules: we cannot tell.
# Word-ish boundaries so "GammaBeta" or "typeConvert" do not count as GEMM-like.
_GEMM_LIKE = re.compile(r"(?<![a-z])(?:gemm|mma|matmul|conv(?:olution)?)(?![a-z])", re.IGNORECASE)


# Cached: the trace loader asks once per kernel *event* (tens of thousands in a big trace, a few
# hundred distinct names), and each call runs up to a dozen regexes over names of up to 1.8k chars.
@functools.lru_cache(maxsize=16384)
def uses_tensor_cores(kernel_name: str) -> bool | None:
    """Whether a CUDA kernel runs on Tensor Cores, judged from its name.

    Returns ``True``/``False``, or ``None`` when the name does not say (old Inductor
    ``triton__0d1d...``, ``triton_tem_*``, fp32-only ``nvjet``, unknown GEMM-like names).
    Rule order matters: traps first (``fbgemm`` contains "gemm"), then known non-TC
    families, then positive evidence.
    """
    name = kernel_name or ""
    if _TC_TRAPS.search(name):
        return False
    if _TRITON_NOT_TC.search(name):
        return False
    if _TRITON_UNKNOWN.search(name):
        return None
    m = _NVJET.search(name)
    if m:
        letters = m.group(1)
        # fp32-only nvjet (e.g. "sss") was never observed; its math type is unknown.
        return True if set(letters) - {"s"} else None
    if _MEMEFF_SIMT.search(name):
        return False
    if _ATTN_TC.search(name):
        return True
    if _SM100_BMM.search(name) or _DPSK_FP8.search(name):
        return True
    if _XMMA.search(name):
        return None if _XMMA_FP32_MATH.search(name) else True
    if _MMA_TOKEN.search(name) or _CUTLASS_TENSOROP.search(name):
        return True
    if _NOT_TC.search(name):
        return False
    if _GEMM_LIKE.search(name):
        return None
    # Elementwise, reductions, copies, NCCL, optimizers, sort/scan...: no MMA instructions.
    return False


# --- Categories ------------------------------------------------------------------------

_COMM = re.compile(
    # lookbehind: "small_reduce" is not an all-reduce
    r"nccl|(?<![a-z])all_?(?:reduce|gather)|reduce_?scatter|alltoall|all_to_all|SendRecv|nvshmem"
    r"|cross_device_reduce|multimem|c10d::|record_param_comms|symm_mem::",
    re.IGNORECASE,
)
_OPTIMIZER = re.compile(
    r"multi_tensor_apply|fused_adam|_fused_adam|fused_sgd|adamw?_|Adam\w*Functor|Optimizer\.step"
    r"|_foreach_|optimizer",
    re.IGNORECASE,
)
_ATTENTION_K = re.compile(
    r"flash_fwd|flash_bwd|flash::|FlashAttn|fmha|flashinfer::\w*(?:Prefill|Decode|Attention)"
    r"|paged_attention|attention|_sdpa|mha_",
    re.IGNORECASE,
)
_MATMUL_K = re.compile(
    # "cutlass::bfloat16_t" / "typeConvert" appear in non-GEMM signatures: match kernel entry points
    r"gemm|gemv|xmma|cutlass_|cutlass\w*::(?:Kernel|device_kernel)|nvjet|^bmm_|cudnn|conv(?!ert)|winograd|fft2d|im2col|splitKreduce"
    r"|dot_kernel|reduce_1Block_kernel|epilogue::impl::globalKernel|triton_tem_|magma",
    re.IGNORECASE,
)
# Batch/layer/group/RMS norms: a category of their own, not "reduction" (a CV trial read a CNN's "reduction
# 35-66%" as sums and means; it was BatchNorm forward and backward). Before the reduction patterns,
# which also match them ("norm", "GammaBeta"); a vector norm (torch.linalg.vector_norm) stays a reduction.
_NORM_K = re.compile(
    r"bn_fw|bn_bw|batch_?norm|BatchNorm|layer_?norm|LayerNorm|GammaBeta|rms_?norm|RMSNorm|RmsNorm"
    r"|group_?norm|GroupNorm|instance_?norm|RowwiseMoments",
    re.IGNORECASE,
)
_REDUCTION_K = re.compile(
    r"reduce|softmax|norm(?!al)|GammaBeta|bn_fw|bn_bw|cross_entropy|nll_loss|triton_red_|triton_per_"
    r"|argmax|argmin|topk|cumsum|DeviceReduce|sum_functor|MeanOps"
    r"|max_?pool|avg_?pool|adaptive_\w*pool",  # a pooling window is a small reduction
    re.IGNORECASE,
)
_COPY_K = re.compile(
    r"copy|CatArray|cat_|transpose|permute|nchwToNhwc|nhwcToNchw|gather|scatter|_page_"
    r"|index(?:_select|Select|_elementwise|_put|_kernel|_add|_copy|_fill)|linearize_index"
    r"|reshape_and_cache|Memset",
    re.IGNORECASE,
)
_ELEMENTWISE_K = re.compile(
    r"elementwise|triton_poi_|Functor|rotary|silu|gelu|relu|sigmoid|tanh|act_and_mul|quant"
    r"|fill|dropout|where|clamp|masked_fill",
    re.IGNORECASE,
)
_TRANSFER = re.compile(r"Memcpy\s*(?:HtoD|DtoH|HtoH|PtoP)", re.IGNORECASE)
_DEVICE_COPY = re.compile(r"Memcpy\s*DtoD|Memset", re.IGNORECASE)


@functools.lru_cache(maxsize=16384)  # ~0.3 ms a name (long C++ templates, many patterns); a model reruns the same kernels
def kernel_category(kernel_name: str) -> str:
    """Coarse category of a GPU activity (kernel, memcpy or memset) from its name.

    One of :data:`CATEGORIES`.  Order matters: communication before reductions
    ("all_reduce"), copies before elementwise (ATen copies run inside
    ``elementwise_kernel<... direct_copy_kernel ...>``), attention before matmul
    (FlashAttention kernels are templated on ``cutlass::``).
    """
    name = kernel_name or ""
    if _TRANSFER.search(name):
        return "data transfer"
    if _DEVICE_COPY.search(name):
        return "memory copy"
    if _COMM.search(name):
        return "communication"
    if _OPTIMIZER.search(name):
        return "optimizer"
    if re.search(r"reshape_and_cache", name):
        return "memory copy"
    if _ATTENTION_K.search(name) or "cudnn::fusion::" in name:
        # incl. FA backward pre/post-processing and cuDNN SDPA's helpers (compute_dot_do_o,
        # convert_dq_to_16bits: seen on an H200, cuDNN 9.19): part of attention, not TC
        return "attention"
    if "philox::unpack" in name:
        return "other"  # RNG seed unpacking for dropout (unpack_cudnn), not a cuDNN matmul
    if re.search(r"fbgemm|split_embedding", name):
        return "other"  # embedding lookups/bucketize: neither GEMM nor plain copy
    if _NORM_K.search(name):
        return "normalization"  # before matmul: cuDNN batch-norm signatures mention cudnnTensorStruct
    if re.search(r"nchwToNhwc|nhwcToNchw", name):
        return "memory copy"  # cuDNN layout conversion, not a conv
    if uses_tensor_cores(name) is True or _MATMUL_K.search(name):
        return "matmul/conv"
    if _REDUCTION_K.search(name):
        return "reduction"
    if _COPY_K.search(name):
        return "memory copy"
    if _ELEMENTWISE_K.search(name):
        return "elementwise"
    return "other"


# CPU op names (aten::..., autograd nodes, custom ops) -> category.
_OP_MATMUL = re.compile(
    r"^aten::(?:mm|addmm_?|bmm|baddbmm_?|addbmm_?|matmul|linear|_scaled_mm|_int_mm|addmv_?|mv|dot|vdot|einsum"
    r"|chain_matmul|linalg_multi_dot|linalg_vecdot|_trilinear|bilinear"
    r"|conv\w*|_convolution\w*|convolution\w*|cudnn_convolution\w*|mkldnn_convolution"
    r"|_conv_depthwise2d|miopen_convolution\w*|_addmm_activation|tensordot"
    # the CPU's fallback convolution kernels (dilated, transposed, float64): a trial read 94.5% "other"
    r"|slow_conv\w*|_slow_conv2d\w*|thnn_conv\w*|_nnpack_spatial_convolution"
    # ROCm's depthwise and Apple's MPS convolutions (FLOPs in op_flops; a name rule missed them)
    r"|miopen_depthwise_convolution|_mps_convolution\w*"
    # whole recurrent layers: their gates are matmuls (a trial's LSTM read "other 99.7%", and no matmul
    # advice); not the cells' fused gate kernels (_thnn_fused_lstm_cell: pointwise) nor weight copies
    r"|lstm|gru|rnn_tanh|rnn_relu|mkldnn_rnn_layer|mkldnn_rnn_layer_backward|_cudnn_rnn|_cudnn_rnn_backward"
    r"|miopen_rnn|miopen_rnn_backward)$"
    r"|^(?:Mm|Addmm|Bmm|Baddbmm|Convolution|Linear|Matmul|MkldnnRnnLayer|CudnnRnn|MiopenRnn)Backward\d*$"
    # quantized modules' GEMMs (quantize_dynamic's Linear); not their weights' prepack/unpack or
    # accessors ("quant" alone is an elementwise (de)quantize)
    r"|^quantized::(?:linear(?:_relu)?(?:_dynamic)?(?:_fp16)?|conv[123]d(?:_relu)?|conv_transpose[123]d"
    r"|matmul)(?:\.\w+)?$",
)
_OP_ATTENTION = re.compile(
    r"scaled_dot_product|_flash_attention|_efficient_attention|flash_attn|attention",
    re.IGNORECASE,
)
_OP_NORM = re.compile(
    r"^aten::(?:layer_norm|native_layer_norm|group_norm|native_group_norm|batch_norm|native_batch_norm"
    r"|_batch_norm\w*|cudnn_batch_norm|miopen_batch_norm|_native_batch_norm_legit\w*|instance_norm"
    r"|rms_norm|_fused_rms_norm"
    # SyncBatchNorm's pieces (a trial read them as "other")
    r"|batch_norm_stats|batch_norm_elemt|batch_norm_gather_stats\w*|batch_norm_update_stats"
    r"|batch_norm_backward_reduce|batch_norm_backward_elemt"
    # their backward kernels and autograd nodes, as their forward ones
    r"|native_batch_norm_backward|batch_norm_backward|cudnn_batch_norm_backward|native_group_norm_backward"
    r"|native_layer_norm_backward|_fused_rms_norm_backward)$"
    r"|rms_norm|layer_norm|(?:BatchNorm|LayerNorm|GroupNorm|RmsNorm)\w*Backward",
)
_OP_REDUCTION = re.compile(
    r"^aten::(?:_?softmax|_?log_softmax|sum|mean|norm|linalg_vector_norm"
    r"|var|std|var_mean|prod|max|min|amax|amin|argmax|argmin|cumsum"
    r"|logsumexp|topk|cross_entropy_loss|nll_loss\w*|binary_cross_entropy\w*|mse_loss|all|any"
    r"|max_pool\w*|avg_pool\w*|adaptive_\w*pool\w*"  # pooling: a reduction over each window
    # softmax's backward kernels, as its forward ones
    r"|_safe_softmax|_softmax_backward_data|_log_softmax_backward_data)$"
    r"|Softmax|NormBackward|SumBackward|MeanBackward|MaxPool\w*Backward|AvgPool\w*Backward",
)
_OP_ELEMENTWISE = re.compile(
    r"^aten::(?:add|sub|rsub|mul|div|relu|gelu|silu|sigmoid|tanh|exp"
    r"|log|log2|log10|log1p|expm1|exp2|pow|rsqrt|sqrt|neg|abs|sign|clamp\w*|where|masked_fill\w*|fill|zero"
    r"|tan|atan|atan2|asin|acos|sinh|cosh|asinh|acosh|atanh|erfc|erfinv|hardsigmoid|relu6|selu|celu"
    r"|prelu|_prelu_kernel|logit|xlogy|nan_to_num|copysign|hypot|lgamma|digamma|true_divide|floor_divide"
    r"|tanh_backward|hardtanh_backward|leaky_relu_backward|elu_backward|softplus_backward"
    r"|hardswish_backward|hardsigmoid_backward|mish_backward|upsample_\w+|_upsample_\w+"
    r"|dropout|native_dropout|threshold\w*|leaky_relu|hardtanh|addcmul\w*|addcdiv\w*|lerp\w*|sin|cos"
    r"|eq|ne|lt|le|gt|ge|logical_\w+|bitwise_\w+|maximum|minimum|reciprocal|square|erf|floor|ceil"
    r"|round|sigmoid_backward|gelu_backward|silu_backward|threshold_backward|mish|softplus"
    r"|hardswish|elu|glu|sgn|trunc|frac|remainder|fmod|clone|zeros_like|ones_like"
    # random numbers, one per element (dropout's mask is aten::bernoulli_: a trial's top op, was "other")
    # (each name also in place: sqrt_, sigmoid_, tanh_... were "other")
    r"|bernoulli|uniform|normal|random|exponential|native_dropout_backward)_?$"
    r"|rotary|act_and_mul|quant",
)
_OP_COPY = re.compile(
    r"^aten::(?:copy_|to|_to_copy|contiguous|cat|_cat|stack|clone|index_select|gather|scatter\w*"
    r"|index|index_put_?|_index_put_impl_|embedding|embedding_dense_backward|repeat\w*|pad"
    r"|embedding_bag|_embedding_bag\w*|embedding_backward|embedding_renorm_"
    r"|constant_pad_nd|narrow_copy|masked_select|take|flip|roll|_unsafe_index\w*)$"
    r"|reshape_and_cache|Memcpy|Memset",
)


@functools.lru_cache(maxsize=16384)  # once per op event otherwise (100k+ in a big trace)
def op_category(op_name: str) -> str:
    """Coarse category of a CPU-side profiler op (``aten::addmm``, ``Optimizer.step#Adam.step``...).

    Views and allocations (``aten::view``, ``aten::empty``) land in ``"other"``: they launch
    no device work, so putting them anywhere else would inflate that category's op count.
    """
    name = op_name or ""
    # torch.compile's own ranges before the rest: "compile_fx_inner (dynamo_timed)" is no matmul
    if is_compiling(name):
        return COMPILING
    if is_compiled_region(name):
        return COMPILED
    if _COMM.search(name):
        return "communication"
    if name.startswith("aten::_foreach_"):
        # a foreach op is the optimizer's only inside Optimizer.step, which its phase says (`phases.op_phases`);
        # outside, it is grad clipping's norms and scaling (a trial read clip_grad_norm_ as "optimizer")
        return "reduction" if name.startswith("aten::_foreach_norm") else "elementwise"
    if _OPTIMIZER.search(name):
        return "optimizer"
    if _OP_ATTENTION.search(name) and "reshape_and_cache" not in name:
        return "attention"
    if _OP_MATMUL.search(name):
        return "matmul/conv"
    if _OP_NORM.search(name):
        return "normalization"
    if _OP_REDUCTION.search(name):
        return "reduction"
    if _OP_COPY.search(name):
        return "memory copy"
    if _OP_ELEMENTWISE.search(name):
        return "elementwise"
    if name.startswith("triton_poi_"):
        return "elementwise"
    if name.startswith(("triton_red_", "triton_per_")):
        return "reduction"
    return "other"
