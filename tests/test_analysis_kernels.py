"""Kernel/op classification, checked against every labelled name of the shared data."""
import csv
from pathlib import Path

import pytest

from nbaccel.analysis import CATEGORIES, kernel_category, op_category, uses_tensor_cores

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
NAMES_CSV = DATA / "cuda_kernel_names.csv"


@pytest.fixture(scope="module")
def labelled_names():
    if not NAMES_CSV.exists():
        pytest.skip(f"reference data not found at {NAMES_CSV} (CI keeps a copy of shared/ at ../shared)")
    with open(NAMES_CSV, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_every_labelled_kernel_name_matches(labelled_names):
    assert len(labelled_names) == 362
    mismatches = []
    for row in labelled_names:
        expected = row["uses_tensor_cores"] == "yes"
        got = uses_tensor_cores(row["kernel_name"])
        if got is not expected:
            mismatches.append(f"{row['uses_tensor_cores']} != {got}: {row['kernel_name'][:160]}")
    assert not mismatches, "\n".join(mismatches)


def test_label_counts_are_the_documented_ones(labelled_names):
    yes = sum(uses_tensor_cores(r["kernel_name"]) is True for r in labelled_names)
    assert yes == 119


@pytest.mark.parametrize(
    "name",
    [
        "triton__0d1d2d3d4d5d6d7d8d9d10d11d12d13d14",  # old Inductor: op unknown
        "triton_tem_fused_mm_0",  # template matmul: TC only for fp16/bf16/tf32 inputs
        "nvjet_sm90_sss_128x128_64x4_1x2_h_bz_TNT",  # fp32-only nvjet (unobserved)
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x16_cublas",  # fp32 math xmma
        "my_custom_gemm_kernel",  # GEMM-looking, no known scheme
    ],
)
def test_unresolvable_names_are_none(name):
    assert uses_tensor_cores(name) is None


@pytest.mark.parametrize(
    "name, expected",
    [
        ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int>(int)", False),
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(int)", False),
        ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true>(Flash_bwd_params)", False),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<X>(Flash_bwd_params)", True),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", True),
        ("fmha_cutlassF_f32_aligned_64x64_rf_sm75(PyTorchMemEffAttention::AttentionKernel)", False),
        ("triton_poi_fused_add_0", False),
        ("triton_red_fused_sum_1", False),
        ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", True),
        ("volta_h884gemm_64x64_ldg8_nn", True),
        ("turing_i8816gemm_int8_128x128", True),
        ("void GammaBetaBackwardCUDAKernel<float, float>(long)", False),  # "mma" inside "Gamma"
    ],
)
def test_selected_rules(name, expected):
    assert uses_tensor_cores(name) is expected


@pytest.mark.parametrize(
    "name, category",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "matmul/conv"),
        ("volta_sgemm_128x64_nn", "matmul/conv"),
        ("void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, true, true>(int)", "matmul/conv"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>(Flash_fwd_params)", "attention"),
        ("fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext", "attention"),
        ("void cutlass::device_kernel<flash::FlashAttnBwdPreprocess<cute::tuple<cute::C<64>>>>(X)", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul> >(int)", "elementwise"),
        ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>(int)", "memory copy"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>(float*)", "memory copy"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4> >(X)", "reduction"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float>(X)", "reduction"),
        ("std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(X)", "normalization"),
        ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 128, true, 1, true>(cudnnTensorStruct, float const*)", "normalization"),
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
        ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(X)", "communication"),
        ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float>(int)", "optimizer"),
        ("Memcpy HtoD (Pageable -> Device)", "data transfer"),
        ("Memcpy DtoH (Device -> Pinned)", "data transfer"),
        ("Memcpy DtoD (Device -> Device)", "memory copy"),
        ("Memset (Device)", "memory copy"),
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(int)", "memory copy"),
        ("void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<long, int, int>::Policy800>(int*)", "other"),
    ],
)
def test_kernel_category(name, category):
    assert kernel_category(name) == category


def test_every_labelled_name_gets_a_valid_category(labelled_names):
    cats = {kernel_category(r["kernel_name"]) for r in labelled_names}
    assert cats <= set(CATEGORIES)
    # every tensor-core kernel is a matmul/conv or an attention kernel
    for r in labelled_names:
        if r["uses_tensor_cores"] == "yes":
            assert kernel_category(r["kernel_name"]) in ("matmul/conv", "attention"), r["kernel_name"][:120]


@pytest.mark.parametrize(
    "name, category",
    [
        ("aten::mm", "matmul/conv"),
        ("aten::addmm", "matmul/conv"),
        ("aten::bmm", "matmul/conv"),
        ("aten::linear", "matmul/conv"),
        ("aten::matmul", "matmul/conv"),
        ("aten::conv2d", "matmul/conv"),
        ("aten::convolution", "matmul/conv"),
        ("aten::cudnn_convolution", "matmul/conv"),
        # recurrent layers: their gates are matmuls (a trial's LSTM profile read "other 99.7%")
        ("aten::lstm", "matmul/conv"),
        ("aten::gru", "matmul/conv"),
        ("aten::mkldnn_rnn_layer", "matmul/conv"),
        ("aten::mkldnn_rnn_layer_backward", "matmul/conv"),
        ("aten::_cudnn_rnn", "matmul/conv"),
        ("aten::_cudnn_rnn_backward", "matmul/conv"),
        ("CudnnRnnBackward0", "matmul/conv"),
        ("aten::_thnn_fused_lstm_cell", "other"),  # the cell's pointwise gate kernel, not a GEMM
        ("aten::_cudnn_rnn_flatten_weight", "other"),  # a weight copy
        ("quantized::linear_prepack", "elementwise"),  # not a GEMM ("quant": the (de)quantize rule)
        ("quantized::conv2d_stride", "elementwise"),
        ("quantized::linear_relu_dynamic", "matmul/conv"),
        # a trial's op coverage check: in-place forms, fallback conv kernels, norm/softmax backward
        ("aten::addmv_", "matmul/conv"),
        ("aten::addbmm", "matmul/conv"),
        ("aten::_trilinear", "matmul/conv"),
        ("aten::slow_conv_dilated2d", "matmul/conv"),
        ("aten::slow_conv_transpose3d", "matmul/conv"),
        # every convolution op with a FLOP formula is a matmul/conv op (these two were "other")
        ("aten::miopen_depthwise_convolution", "matmul/conv"),
        ("aten::_mps_convolution_transpose", "matmul/conv"),
        ("aten::native_batch_norm_backward", "normalization"),
        ("aten::native_group_norm_backward", "normalization"),
        ("aten::_softmax_backward_data", "reduction"),
        ("aten::_safe_softmax", "reduction"),
        ("aten::sqrt_", "elementwise"),
        ("aten::sigmoid_", "elementwise"),
        ("aten::log1p", "elementwise"),
        ("aten::upsample_bilinear2d", "elementwise"),
        ("aten::_embedding_bag", "memory copy"),
        ("aten::addr", "other"),  # an outer product: no GEMM
        ("aten::lstm_mps", "other"),  # whole names only: no prefix match
        ("quantized::linear_dynamic", "matmul/conv"),  # quantize_dynamic's Linear (a trial: "elementwise 95%")
        ("quantized::conv2d.new", "matmul/conv"),
        ("aten::quantize_per_tensor", "elementwise"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("aten::_scaled_dot_product_flash_attention", "attention"),
        ("aten::_flash_attention_forward", "attention"),
        ("aten::_efficient_attention_forward", "attention"),
        ("aten::softmax", "reduction"),
        ("aten::_softmax", "reduction"),
        ("aten::sum", "reduction"),
        ("aten::mean", "reduction"),
        ("aten::layer_norm", "normalization"),
        ("aten::native_layer_norm", "normalization"),
        # a CV trial read a CNN's BatchNorm as "reduction 35-66%": norms are a category of their own;
        # a vector norm (torch.norm, linalg.vector_norm) is still a reduction
        ("aten::_native_batch_norm_legit_no_training", "normalization"),
        ("NativeBatchNormBackward0", "normalization"),
        ("NativeLayerNormBackward0", "normalization"),
        ("aten::rms_norm", "normalization"),
        ("aten::batch_norm_stats", "normalization"),  # SyncBatchNorm's pieces
        ("aten::batch_norm_gather_stats_with_counts", "normalization"),
        ("aten::batch_norm_backward_reduce", "normalization"),
        ("aten::norm", "reduction"),
        ("aten::linalg_vector_norm", "reduction"),
        ("LinalgVectorNormBackward0", "reduction"),
        ("aten::add", "elementwise"),
        ("aten::mul", "elementwise"),
        ("aten::relu", "elementwise"),
        ("aten::gelu", "elementwise"),
        ("aten::bernoulli_", "elementwise"),  # dropout's mask: one random number per element
        ("aten::normal_", "elementwise"),
        ("aten::native_dropout_backward", "elementwise"),
        ("aten::silu", "elementwise"),
        ("aten::copy_", "memory copy"),
        ("aten::to", "memory copy"),
        ("aten::contiguous", "memory copy"),
        ("aten::cat", "memory copy"),
        ("Optimizer.step#AdamW.step", "optimizer"),
        # a foreach op is the optimizer's inside Optimizer.step only (its phase); outside, grad clipping's
        ("aten::_foreach_add_", "elementwise"),
        ("aten::_foreach_norm", "reduction"),
        ("aten::_fused_adam_", "optimizer"),
        ("c10d::allreduce_", "communication"),
        ("nccl:all_reduce", "communication"),
        ("record_param_comms", "communication"),
        ("aten::view", "other"),
        ("aten::empty", "other"),
    ],
)
def test_op_category(name, category):
    assert op_category(name) == category


def test_analysis_modules_do_not_import_torch():
    # the analysis core must run where torch is absent or CPU-only (nbaccel.load_trace on a laptop)
    pkg = Path(__file__).resolve().parents[1] / "nbaccel" / "analysis"
    offenders = [p.name for p in pkg.glob("*.py")
                 if any(line.strip().startswith(("import torch", "from torch"))
                        for line in p.read_text(encoding="utf-8").splitlines())]
    assert not offenders
