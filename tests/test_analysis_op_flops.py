"""FLOPs from recorded shapes, against hand-computed values (multiply-add = 2 FLOPs)."""
import pytest

from nbaccel.analysis import dtype_of, op_flops


def test_mm_family():
    assert op_flops("aten::mm", [[4, 5], [5, 6]]) == 2 * 4 * 5 * 6
    # real aten::addmm from the H100 trace (bias, mat1, mat2, beta, alpha)
    assert op_flops("aten::addmm", [[1024], [8944, 1024], [1024, 1024], [], []]) == 18_756_927_488
    # real aten::mm from the H100 trace (MLP up-projection): 2 * 8944 * 1024 * 2816
    assert op_flops("aten::mm", [[8944, 1024], [1024, 2816]]) == 51_581_550_592
    assert op_flops("aten::bmm", [[1, 32, 1], [1, 1, 559]]) == 2 * 1 * 32 * 1 * 559  # H100 trace: 35776
    assert op_flops("aten::baddbmm", [[8, 3, 5], [8, 3, 4], [8, 4, 5], [], []]) == 2 * 8 * 3 * 4 * 5
    assert op_flops("aten::mm", [[4, 5], [6, 7]]) is None  # inner dims disagree


def test_linear_and_matmul():
    # real aten::linear from the H100 trace: x [16, 559, 1024] @ W[1024, 1024]^T
    assert op_flops("aten::linear", [[16, 559, 1024], [1024, 1024], [1024]]) == 2 * 16 * 559 * 1024 * 1024
    assert op_flops("aten::matmul", [[16, 559, 1024], [1024, 1024]]) == 2 * 16 * 559 * 1024 * 1024
    assert op_flops("aten::matmul", [[7], [7]]) == 14  # dot
    assert op_flops("aten::matmul", [[3, 7], [7]]) == 2 * 3 * 7  # matrix-vector
    assert op_flops("aten::matmul", [[2, 1, 3, 4], [5, 4, 6]]) == 2 * (2 * 5) * 3 * 4 * 6  # broadcast
    assert op_flops("aten::matmul", [[2, 3, 4], [3, 4, 6]]) is None  # batch dims cannot broadcast


def test_convolution_needs_stride_and_padding():
    dims = [[2, 3, 16, 16], [8, 3, 3, 3], [8], [], [], [], []]
    # stride 2, padding 1 -> 8x8 output: 2 * N * Cout * Hout * Wout * Cin/groups * kh * kw
    expected = 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3
    assert op_flops("aten::conv2d", dims, concrete_inputs=["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "1"]) == expected
    conv_dims = dims + [[], []]
    conc = ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]
    assert op_flops("aten::convolution", conv_dims, concrete_inputs=conc) == expected
    # only dims recorded (older torch): output size unknown ...
    assert op_flops("aten::conv2d", dims) is None
    # ... unless the output shape is known
    assert op_flops("aten::conv2d", dims, output_dims=[[2, 8, 8, 8]]) == expected
    # padding="same" keeps the spatial size (stride 1)
    assert op_flops("aten::conv2d", dims, concrete_inputs=["", "", "", "[1, 1]", "same", "[1, 1]", "1"]) == (
        2 * 2 * 8 * 16 * 16 * 3 * 3 * 3
    )


def test_grouped_and_transposed_convolution():
    # depthwise: 32 channels, groups=32 -> weight [32, 1, 3, 3]; stride 1 pad 1 on 10x10
    dims = [[1, 32, 10, 10], [32, 1, 3, 3], [], [], [], [], []]
    conc = ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "32"]
    assert op_flops("aten::conv2d", dims, concrete_inputs=conc) == 2 * 1 * 32 * 10 * 10 * 1 * 9
    # transposed (torch.utils.flop_counter uses the input spatial size): weight [Cin, Cout, k, k]
    tdims = [[1, 4, 5, 5], [4, 6, 3, 3], [], [], [], [], [], [], []]
    tconc = ["", "", "", "[2, 2]", "[0, 0]", "[1, 1]", "True", "[0, 0]", "1"]
    assert op_flops("aten::convolution", tdims, concrete_inputs=tconc) == 2 * 1 * 5 * 5 * 9 * 4 * 6


def test_attention():
    # real ops from the H100 trace: B=16, H=16, L=559, D=64
    qkv = [[16, 16, 559, 64]] * 3
    expected = 4 * 16 * 16 * 559 * 559 * 64
    assert op_flops("aten::scaled_dot_product_attention", qkv + [[], [], [], [], []]) == expected
    assert op_flops("aten::_scaled_dot_product_flash_attention", qkv + [[], [], [], []]) == expected
    # _flash_attention_forward takes [B, L, H, D]
    assert op_flops("aten::_flash_attention_forward", [[16, 559, 16, 64]] * 3 + [[]] * 12) == expected
    assert op_flops("aten::_efficient_attention_forward", [[16, 559, 16, 64]] * 3) == expected
    # cross attention with Dv != D: 2*B*H*Lq*Lk*(D + Dv)
    assert op_flops("aten::scaled_dot_product_attention", [[1, 2, 8, 4], [1, 2, 16, 4], [1, 2, 16, 6]]) == (
        2 * 1 * 2 * 8 * 16 * 4 + 2 * 1 * 2 * 8 * 16 * 6
    )


def test_unknown_ops_and_bad_dims():
    assert op_flops("aten::add", [[4, 4], [4, 4]]) is None
    assert op_flops("aten::mm", None) is None
    assert op_flops("aten::mm", [[], []]) is None
    assert op_flops("aten::linear", [[4, 5], [6, 7], [6]]) is None


@pytest.mark.parametrize(
    "types, dtype",
    [
        (["c10::BFloat16", "c10::BFloat16", "c10::BFloat16", "Scalar", "Scalar"], "bf16"),
        (["float", "float"], "fp32"),
        (["c10::Half", "c10::Half"], "fp16"),
        (["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", "float", "float"], "fp8"),  # scales are fp32
        (["c10::Float8_e4m3fn", "c10::BFloat16", "float"], "fp8"),
        (["long int", "Scalar", ""], None),
        (["double"], "fp64"),
        ([], None),
        (None, None),
    ],
)
def test_dtype_of(types, dtype):
    assert dtype_of(types) == dtype


def _profiled_and_counted(fn):
    """(FLOPs nbaccel derives from a real CPU trace's recorded shapes, per op name;
    torch.utils.flop_counter's count of the same code, per op name)."""
    import json
    import tempfile

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from nbaccel.profile import quiet_kineto

    with FlopCounterMode(display=False) as counter:
        fn()
    with quiet_kineto():
        with torch.profiler.profile(record_shapes=True) as prof:
            fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    ours = {}
    for e in events:
        args = e.get("args", {})
        flops = op_flops(e.get("name", ""), args.get("Input Dims"), args.get("Input type"),
                         args.get("Concrete Inputs"))
        if flops is not None:
            ours[e["name"]] = ours.get(e["name"], 0) + flops
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return ours, counted


def test_backward_ops_match_torch_flop_counter():
    # A training step's FLOP/s must include conv and attention backward (backward matmuls are
    # plain aten::mm already); the formulas agree with torch.utils.flop_counter on real ops.
    import torch

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(4, 8, 32, 32, requires_grad=True)
    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))

    def step():
        conv(x).sum().backward()
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    from torch.utils.flop_counter import sdpa_backward_flop_count

    ours, counted = _profiled_and_counted(step)
    assert ours["aten::convolution_backward"] == counted["aten.convolution_backward"] \
        == 2 * (2 * 4 * 32 * 32 * 16 * 8 * 3 * 3)  # grad_input + grad_weight, each one forward
    # FlopCounterMode does not see the CPU flash kernel, so compare with its formula directly
    sdpa_bwd = ours["aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert sdpa_bwd == sdpa_backward_flop_count(*[q.shape] * 4) == 2 * 2 * 4 * 64 * 64 * (3 * 32 + 2 * 32)


def test_convolution_backward_follows_output_mask_and_groups():
    dims = [[4, 16, 32, 32], [4, 8, 32, 32], [16, 4, 3, 3], [], [], [], [], [], [], [], []]
    concrete = ["", "", "", "[16]", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "2", "[True, True, True]"]
    forward = 2 * 4 * 32 * 32 * 16 * 4 * 3 * 3  # groups=2: 4 input channels per group
    assert op_flops("aten::convolution_backward", dims, None, concrete) == 2 * forward
    first_layer = concrete[:10] + ["[False, True, True]"]  # no grad_input for the network's input
    assert op_flops("aten::convolution_backward", dims, None, first_layer) == forward
    assert op_flops("aten::convolution_backward", dims, None, concrete[:10]) is None  # mask unknown
    assert op_flops("aten::convolution_backward", dims[:2]) is None


def test_attention_backward_from_a_real_h200_trace_shape():
    # aten::_scaled_dot_product_cudnn_attention_backward from tests/data/h200_bf16_transformer_step:
    # grad_out, q, k, v, out [16, 16, 512, 64], logsumexp [16, 16, 512, 1]
    dims = [[16, 16, 512, 64]] * 5 + [[16, 16, 512, 1]] + [[]] * 10
    assert op_flops("aten::_scaled_dot_product_cudnn_attention_backward", dims) == \
        2 * 16 * 16 * 512 * 512 * (3 * 64 + 2 * 64)
    # the seq-first kernels' own layout [B, L, H, D]
    seq_first = [[16, 512, 16, 64]] * 5
    assert op_flops("aten::_flash_attention_backward", seq_first) == 2 * 16 * 16 * 512 * 512 * 5 * 64


def test_fused_linear_and_matrix_vector_products():
    # aten::_addmm_activation (bias, mat1, mat2): TransformerEncoderLayer's fast-path linear + ReLU
    assert op_flops("aten::_addmm_activation", [[32], [20, 16], [16, 32], [], [], []]) == 2 * 20 * 16 * 32
    assert op_flops("aten::mv", [[24, 16], [16]]) == 2 * 24 * 16
    # aten::addmv_ as aten::mv records it (self, mat, vec, beta, alpha)
    assert op_flops("aten::addmv_", [[24], [24, 16], [16], [], []]) == 2 * 24 * 16
    assert op_flops("aten::mv", [[24, 16], [15]]) is None


# Recurrent layers: 2 FLOPs per weight-matrix element per token (T*B), whatever the gate count.
LSTM_PARAMS = [[96, 16], [96, 24], [96], [96], [96, 24], [96, 24], [96], [96]]  # 2 layers, H=24, I=16
LSTM_FORWARD = 2 * (10 * 2) * (96 * 16 + 96 * 24 + 96 * 24 + 96 * 24)


def test_rnn_layer_ops_from_recorded_cpu_shapes():
    # aten::lstm.input(input [T=10, B=2, I], hx [h0, c0], params, has_biases, num_layers, ...)
    lstm = [[10, 2, 16], [[2, 2, 24], [2, 2, 24]], LSTM_PARAMS, [], [], [], [], [], []]
    assert op_flops("aten::lstm", lstm) == LSTM_FORWARD
    # aten::lstm.data (packed: data [17 tokens, I], batch_sizes, hx, params, ...)
    packed = [[17, 16], [10], [[1, 2, 24], [1, 2, 24]], [[96, 16], [96, 24], [96], [96]], [], [], [], [], []]
    assert op_flops("aten::lstm", packed) == 2 * 17 * (96 * 16 + 96 * 24)
    # GRU (3 gates) and an LSTM with projections (w_hr [P=8, H=24]) need nothing special
    assert op_flops("aten::gru", [[5, 3, 16], [1, 3, 24], [[72, 16], [72, 24], [72], [72]]]) == \
        2 * 15 * (72 * 16 + 72 * 24)
    proj = [[10, 2, 16], [[1, 2, 8], [1, 2, 24]], [[96, 16], [96, 8], [96], [96], [8, 24]]]
    assert op_flops("aten::lstm", proj) == 2 * 20 * (96 * 16 + 96 * 8 + 8 * 24)
    assert op_flops("aten::lstm", [[10, 2, 16], [[2, 2, 24]], [[96], [96]]]) is None  # no matrices
    assert op_flops("aten::rnn_tanh", [[10, 2, 16]]) is None


def test_mkldnn_rnn_layer_reads_only_the_two_weight_matrices():
    # Bidirectional without biases: the bias slots (weight2/3) carry the reverse direction's matrices.
    layer = [[10, 2, 16], [96, 16], [96, 24], [96, 16], [96, 24], [2, 24], [2, 24]] + [[]] * 9
    assert op_flops("aten::mkldnn_rnn_layer", layer) == 2 * 20 * (96 * 16 + 96 * 24)
    backward = [[10, 2, 16], [96, 16], [96, 24], [96], [96], [2, 24], [2, 24], [10, 2, 24], [2, 24], [2, 24],
                [10, 2, 24]] + [[]] * 11 + [[53248]]
    assert op_flops("aten::mkldnn_rnn_layer_backward", backward) == 2 * 2 * 20 * (96 * 16 + 96 * 24)


def test_cudnn_rnn_from_its_schema():
    # _cudnn_rnn(input, weight[], weight_stride0, weight_buf, hx, cx, mode, hidden_size, proj_size,
    #            num_layers, batch_first, dropout, train, bidirectional, batch_sizes, dropout_state)
    forward = [[10, 2, 16], LSTM_PARAMS, [], [25344], [2, 2, 24], [2, 2, 24]] + [[]] * 10
    assert op_flops("aten::_cudnn_rnn", forward) == LSTM_FORWARD
    # _cudnn_rnn_backward(input, weight[], weight_stride0, weight_buf, hx, cx, output, grad_output,
    #   grad_hy, grad_cy, mode, ..., reserve, output_mask[input, hx, cx, weight]): backward-data
    # always runs (one forward's worth), backward-weights when output_mask[3].
    dims = [[10, 2, 16], LSTM_PARAMS, [], [25344], [2, 2, 24], [2, 2, 24], [10, 2, 24], [10, 2, 24],
            [], [], [], [], [], [], [], [], [], [], [], [], [1024], []]
    concrete = [""] * 10 + ["2", "24", "0", "2", "False", "0.", "True", "False", "[]", "", "",
                            "[True, True, True, True]"]
    assert op_flops("aten::_cudnn_rnn_backward", dims, None, concrete) == 2 * LSTM_FORWARD
    frozen = concrete[:21] + ["[True, True, True, False]"]
    assert op_flops("aten::_cudnn_rnn_backward", dims, None, frozen) == LSTM_FORWARD
    assert op_flops("aten::_cudnn_rnn_backward", dims, None, concrete[:21]) is None  # mask unknown


def test_int8_and_fp8_gemms_count_their_multiply_adds():
    """A trial: torch._int_mm (int8 x int8 -> int32) read "no FLOP formula matched an op", its shapes checked
    for padding (16 for int8) but its work uncounted. 2 ops per multiply-add, as the int8 TOPS peaks count."""
    assert op_flops("aten::_int_mm", [[1000, 1024], [1024, 1000]]) == 2 * 1000 * 1024 * 1000
    assert op_flops("aten::_scaled_mm", [[64, 128], [128, 32], [], [], [], []]) == 2 * 64 * 128 * 32
    assert op_flops("aten::_int_mm", [[64, 128], [127, 32]]) is None  # inner dims disagree


def test_a_profiled_int_mm_is_counted_as_int8():
    import torch

    import nbaccel

    a = torch.randint(-128, 127, (64, 128), dtype=torch.int8)
    b = torch.randint(-128, 127, (128, 32), dtype=torch.int8)
    with nbaccel.profile() as prof:
        torch._int_mm(a, b)
    row = next(r for r in prof.result.grouped_rows("op") if r["name"] == "aten::_int_mm")
    assert row["flops"] == 2 * 64 * 128 * 32 and row["dtype"] == "int8"


# aten::_slow_conv2d_forward / _backward as a CPU trace records them (shapes and Concrete Inputs
# copied from a bf16 Conv2d(4, 8, 3, stride=2, padding=1) on an AVX2-only CPU, where oneDNN has no
# bf16 convolution and torch falls back to its own kernel under aten::_convolution / convolution_backward).
_SLOW_FWD_DIMS = [[2, 4, 12, 12], [8, 4, 3, 3], [], [8], [], []]
_SLOW_FWD_CONCRETE = ["", "", "[3, 3]", "", "[2, 2]", "[1, 1]"]
_SLOW_BWD_DIMS = [[2, 8, 6, 6], [2, 4, 12, 12], [8, 4, 3, 3], [], [], [], []]
_SLOW_BWD_CONCRETE = ["", "", "", "[3, 3]", "[2, 2]", "[1, 1]", "[True, True, True]"]
_SLOW_FWD_FLOPS = 2 * 2 * 6 * 6 * 8 * 4 * 3 * 3  # 2 * N * Hout * Wout * Cout * Cin * kh * kw


def test_the_cpus_fallback_convolution_kernels_have_flops():
    assert op_flops("aten::_slow_conv2d_forward", _SLOW_FWD_DIMS, concrete_inputs=_SLOW_FWD_CONCRETE) == _SLOW_FWD_FLOPS
    assert op_flops("aten::_slow_conv2d_forward", _SLOW_FWD_DIMS) is None  # stride, padding unknown
    # backward: one forward per gradient computed (input, weight), as flop_counter counts convolution_backward
    assert op_flops("aten::_slow_conv2d_backward", _SLOW_BWD_DIMS, None, _SLOW_BWD_CONCRETE) == 2 * _SLOW_FWD_FLOPS
    first_layer = _SLOW_BWD_CONCRETE[:6] + ["[False, True, True]"]
    assert op_flops("aten::_slow_conv2d_backward", _SLOW_BWD_DIMS, None, first_layer) == _SLOW_FWD_FLOPS
    assert op_flops("aten::_slow_conv2d_backward", _SLOW_BWD_DIMS, None, _SLOW_BWD_CONCRETE[:6]) is None


def test_the_fallback_kernel_carries_the_flops_its_outer_convolution_held():
    """A trace of the fallback's nesting: the FLOPs are counted once, on the kernels that hold the time,
    not on aten::_convolution / convolution_backward (which have formulas too) as well."""
    from nbaccel.analysis import load_trace

    ev, conv_conc = [], ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "False", "False",
                         "True", "True"]
    bwd_conc = ["", "", "", "[8]", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1", "[True, True, True]"]
    for name, ts, dur, dims, conc in [
        ("aten::_convolution", 0, 100, _SLOW_FWD_DIMS[:2] + [[8]] + [[]] * 10, conv_conc),
        ("aten::thnn_conv2d", 1, 98, _SLOW_FWD_DIMS, _SLOW_FWD_CONCRETE),
        ("aten::_slow_conv2d_forward", 2, 96, _SLOW_FWD_DIMS, _SLOW_FWD_CONCRETE),
        ("aten::convolution_backward", 200, 100, _SLOW_BWD_DIMS[:3] + [[]] * 8, bwd_conc),
        ("aten::_slow_conv2d_backward", 201, 98, _SLOW_BWD_DIMS, _SLOW_BWD_CONCRETE),
    ]:
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                   "args": {"Input Dims": dims, "Input type": ["c10::BFloat16"] * 2, "Concrete Inputs": conc}})
    ops = load_trace({"schemaVersion": 1, "traceEvents": ev}).ops
    counted = dict(zip(ops["name"][ops["flops_counted"]], ops["flops"][ops["flops_counted"]]))
    assert counted == {"aten::_slow_conv2d_forward": _SLOW_FWD_FLOPS, "aten::_slow_conv2d_backward": 2 * _SLOW_FWD_FLOPS}


# The convolution kernels torch dispatches to below aten::_convolution, by backend. Each has a formula,
# whose argument positions are read from the op's own schema (native_functions.yaml) here.
_CONV_KERNELS = [
    # CPU (and CUDA without cuDNN) fallbacks: torch 2.13 profiles these on the CPU for float64, bf16
    # without bf16 units, or with torch.backends.mkldnn off
    "aten::thnn_conv2d", "aten::_slow_conv2d_forward", "aten::slow_conv3d", "aten::slow_conv3d_forward",
    "aten::slow_conv_dilated2d", "aten::slow_conv_dilated3d", "aten::slow_conv_transpose2d",
    "aten::slow_conv_transpose3d", "aten::_nnpack_spatial_convolution", "aten::mkldnn_convolution",
    # CUDA, ROCm, MPS
    "aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::cudnn_convolution_relu",
    "aten::cudnn_convolution_add_relu", "aten::_conv_depthwise2d", "aten::conv_depthwise3d",
    "aten::miopen_convolution", "aten::miopen_convolution_transpose", "aten::miopen_depthwise_convolution",
    "aten::miopen_convolution_relu", "aten::miopen_convolution_add_relu",
    "aten::_mps_convolution", "aten::_mps_convolution_transpose",
]


@pytest.mark.parametrize("name", _CONV_KERNELS)
def test_every_convolution_kernel_reads_its_arguments_where_its_schema_has_them(name):
    import torch

    from nbaccel.analysis.kernels import op_category
    from nbaccel.analysis.op_flops import _CONV_ARGS

    packet = getattr(torch.ops.aten, name.split("::")[1])
    overload = getattr(packet, "default" if "default" in packet.overloads() else packet.overloads()[0])
    args = [a.name for a in overload._schema.arguments]
    assert args[1] == "weight" and args[0] in ("self", "input")  # the shapes `_conv` reads
    spec = _CONV_ARGS[name]
    assert isinstance(spec["transposed"], bool) and spec["transposed"] == ("transpose" in name)
    for key, pos in spec.items():
        if key != "transposed":
            assert args[pos] == key, (name, key, args)
    # a kernel without dilation (or groups) in its schema is never dilated (grouped: its weight says)
    assert ("dilation" in spec) == ("dilation" in args) and ("stride" in spec) == ("stride" in args)
    assert op_category(name) == "matmul/conv"  # the op tables' category, and unaligned-shape advice


def test_the_dilated_and_transposed_fallback_kernels_count_as_the_convolution():
    # slow_conv_dilated2d(self, weight, kernel_size, bias, stride, padding, dilation): one group's call
    # of a Conv2d(4, 8, 3, stride=2, padding=1, dilation=2, groups=2) on 11x11 -> 5x5 output
    dims = [[2, 2, 11, 11], [4, 2, 3, 3], [], [4], [], [], []]
    conc = ["", "", "[3, 3]", "", "[2, 2]", "[1, 1]", "[2, 2]"]
    per_group = 2 * 2 * 5 * 5 * 4 * 2 * 3 * 3  # 2 * N * Hout * Wout * Cout/g * Cin/g * kh * kw
    assert op_flops("aten::slow_conv_dilated2d", dims, concrete_inputs=conc) == per_group
    assert op_flops("aten::slow_conv_dilated2d", dims) is None  # stride, padding unknown
    # dilation 1 would read a 6x6 output: dilation changes the output size, not the MACs per output
    undilated = conc[:6] + ["[1, 1]"]
    assert op_flops("aten::slow_conv_dilated2d", dims, concrete_inputs=undilated) == per_group * 36 // 25
    # 3-D: (2, 4, 9, 9, 9), k=3, dilation 2, stride 1, no padding -> 5x5x5
    dims3 = [[2, 4, 9, 9, 9], [6, 4, 3, 3, 3], [], [], [], [], []]
    conc3 = ["", "", "[3, 3, 3]", "", "[1, 1, 1]", "[0, 0, 0]", "[2, 2, 2]"]
    assert op_flops("aten::slow_conv_dilated3d", dims3, concrete_inputs=conc3) == 2 * 2 * 125 * 6 * 4 * 27
    # slow_conv3d_forward: the whole input, the grouped weight (groups=2: 2 input channels per group)
    dims3g = [[2, 4, 7, 7, 7], [8, 2, 3, 3, 3], [], [8], [], []]
    conc3g = ["", "", "[3, 3, 3]", "", "[2, 2, 2]", "[1, 1, 1]"]
    assert op_flops("aten::slow_conv3d_forward", dims3g, concrete_inputs=conc3g) == 2 * 2 * 64 * 8 * 2 * 27
    # transposed (self, weight [Cin/g, Cout/g, k, k], ...): from the input side, whatever the stride,
    # output_padding or dilation
    tdims = [[2, 2, 5, 5], [2, 4, 3, 3], [], [4], [], [], [], []]
    tconc = ["", "", "[3, 3]", "", "[2, 2]", "[0, 0]", "[1, 1]", "[2, 2]"]
    assert op_flops("aten::slow_conv_transpose2d", tdims, concrete_inputs=tconc) == 2 * 2 * 25 * 9 * 2 * 4
    assert op_flops("aten::slow_conv_transpose2d", tdims) == 2 * 2 * 25 * 9 * 2 * 4  # needs no argument
    assert op_flops("aten::slow_conv_transpose3d", [[1, 3, 4, 4, 4], [3, 5, 2, 2, 2]]) == 2 * 64 * 8 * 3 * 5


def test_the_gpu_convolution_kernels_read_their_own_argument_order():
    # cudnn_convolution_transpose(self, weight, padding, output_padding, stride, dilation, groups, ...)
    dims = [[2, 8, 6, 6], [8, 3, 3, 3]]
    conc = ["", "", "[1, 1]", "[1, 1]", "[2, 2]", "[1, 1]", "2", "False", "False", "True"]
    assert op_flops("aten::cudnn_convolution_transpose", dims, concrete_inputs=conc) == 2 * 2 * 36 * 9 * 8 * 3
    # cudnn_convolution_add_relu(self, weight, z, alpha, bias, stride, padding, dilation, groups):
    # stride 2, padding 0 on 9x9 with k=3 -> 4x4 (read as padding 2, stride 0 it would be None)
    dims = [[1, 4, 9, 9], [6, 4, 3, 3], [1, 6, 4, 4], [], [6], [], [], [], []]
    conc = ["", "", "", "1", "", "[2, 2]", "[0, 0]", "[1, 1]", "1"]
    assert op_flops("aten::cudnn_convolution_add_relu", dims, concrete_inputs=conc) == 2 * 16 * 9 * 6 * 4
    # miopen_convolution(self, weight, bias, padding, stride, dilation, groups, ...): padding 0, stride 2
    dims = [[1, 4, 9, 9], [6, 4, 3, 3], [6], [], [], [], [], [], []]
    conc = ["", "", "", "[0, 0]", "[2, 2]", "[1, 1]", "1", "False", "False"]
    assert op_flops("aten::miopen_convolution", dims, concrete_inputs=conc) == 2 * 16 * 9 * 6 * 4
    # _nnpack_spatial_convolution(input, weight, bias, padding, stride): never dilated
    assert op_flops("aten::_nnpack_spatial_convolution", dims[:3] + [[], []],
                    concrete_inputs=["", "", "", "[1, 1]", "[1, 1]"]) == 2 * 81 * 9 * 6 * 4
