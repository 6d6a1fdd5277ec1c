"""nbaccel's FLOPs from recorded shapes against an independent count: torch's ``FlopCounterMode``.

``nbaccel.profile()`` re-derives each op's FLOPs from the profiler's ``Input Dims`` and counts
only the innermost op with a formula; ``FlopCounterMode`` sees the dispatched aten ops with their
real tensors. Both count a multiply-add as 2 FLOPs and ignore elementwise work, so on the same
workload they must agree per op and in total -- forward, under ``no_grad`` and forward+backward.

Where the registry has no formula or a wrong one, the reference is the same math written so the
registry can count it (each case says why):

* CPU attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) is missing from
  the registry, so ``FlopCounterMode`` counts 0; the reference registers torch's own formula of
  the CUDA flash kernel for it (and the forward is also checked against the math backend's bmms).
* A grouped convolution's backward: the registry counts the weight gradient ``groups`` times over,
  so the reference is the same convolution run as ``groups`` plain ones on channel slices.
* The CPU LSTM kernel (``mkldnn_rnn_layer``) has no formula there: the reference is the same LSTM
  with oneDNN switched off, which runs as ``aten::linear``/``mm`` calls the registry counts.
* The transformer layer's inference fast path (``_transformer_encoder_layer_fwd``) hides its
  matmuls from the mode (0 FLOPs): the reference is the same layer with grad enabled.
* ``A @ v`` runs as ``aten::mv``, which the registry lacks: the reference is ``A @ v[:, None]``.

Tiny shapes: the whole file runs in about two seconds.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import nbaccel
from nbaccel.device import device_info

aten = torch.ops.aten
pytestmark = [
    # torch.backends.mkldnn.flags() sets oneDNN's TF32 flag too, which warns on builds without Intel GPUs
    pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN:UserWarning"),
    pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN:UserWarning"),
]


def _as_raw(formula):
    """A registry formula (already shape-wrapped) as a custom_mapping entry that is not wrapped again."""
    def raw(*args, **kwargs):
        return formula(*args, **kwargs)
    raw._get_raw = True
    return raw


# torch's own attention formulas, registered for the CPU kernels the registry lacks.
_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _as_raw(flop_registry[aten._scaled_dot_product_flash_attention]),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _as_raw(flop_registry[aten._scaled_dot_product_flash_attention_backward]),
}
# nbaccel counts a convolution at the innermost op with a formula (mkldnn_convolution, _convolution, or
# the CPU's fallback kernels: _slow_conv2d_forward / _backward, slow_conv3d_forward, the dilated and the
# transposed ones); FlopCounterMode at aten.convolution(_backward).
_FALLBACK_CONV = ("aten::_slow_conv2d_forward", "aten::slow_conv3d_forward", "aten::slow_conv_dilated2d",
                  "aten::slow_conv_dilated3d", "aten::slow_conv_transpose2d", "aten::slow_conv_transpose3d")
_SAME_OP = {"aten::mkldnn_convolution": "aten::convolution", "aten::_convolution": "aten::convolution",
            **dict.fromkeys(_FALLBACK_CONV, "aten::convolution"),
            "aten::_slow_conv2d_backward": "aten::convolution_backward"}


def reference(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as mode:
        fn()
    per_op = {f"aten::{op.__name__}": n for op, n in mode.get_flop_counts().get("Global", {}).items() if n}
    return mode.get_total_flops(), per_op


def profiled(fn: Callable[[], object]) -> tuple[float, dict[str, int]]:
    """(header FLOPs, self FLOPs per op) of one profiled run, as %%profile_gpu shows them."""
    fn()  # first-call work (oneDNN primitive creation...) stays out of the profile
    with nbaccel.profile(device="cpu") as prof:
        fn()
    result = prof.result
    ops = result.ops.dropna(subset=["flops"])
    per_op = Counter()
    for name, flops in zip(ops["name"], ops["flops"]):
        per_op[_SAME_OP.get(name, name)] += int(flops)
    # The self-FLOPs column sums to the header: nothing counted twice, nothing dropped.
    assert sum(per_op.values()) == result.header["flops"]
    return result.header["flops"], dict(per_op)


def forward(module, *inputs):
    return lambda: module(*inputs)


def forward_backward(module, *inputs):
    def run():
        out = module(*inputs)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return run


class Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def _workloads() -> dict[str, tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    a, b, bias = _leaf(8, 16), _leaf(16, 12), torch.randn(8, 12)
    A, B, C = _leaf(3, 8, 16), _leaf(3, 16, 12), torch.randn(3, 8, 12)
    x1, x2, x3 = torch.randn(2, 4, 20), torch.randn(2, 4, 12, 12), torch.randn(2, 4, 6, 6, 6)
    q, k, v = _leaf(2, 3, 10, 8), _leaf(2, 3, 10, 8), _leaf(2, 3, 10, 8)
    seq = torch.randn(2, 10, 16)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    gru, rnn = nn.GRU(16, 24, 2, bidirectional=True), nn.RNN(16, 24)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    return {
        "linear 2-D": (nn.Linear(16, 32), (torch.randn(8, 16),)),
        "linear 3-D": (nn.Linear(16, 32), (torch.randn(4, 8, 16),)),
        "linear 3-D no bias": (nn.Linear(16, 32, bias=False), (torch.randn(4, 8, 16),)),
        "matmul 2-D": (Call(torch.matmul), (a, b)),
        "matmul 3-D @ 2-D": (Call(torch.matmul), (A, b)),
        "matmul broadcast 4-D": (Call(torch.matmul), (_leaf(2, 3, 8, 16), B)),
        "mm": (Call(torch.mm), (a, b)),
        "addmm": (Call(lambda a, b: torch.addmm(bias, a, b)), (a, b)),
        "bmm": (Call(torch.bmm), (A, B)),
        "baddbmm": (Call(lambda A, B: torch.baddbmm(C, A, B)), (A, B)),
        "einsum bij,bjk": (Call(lambda A, B: torch.einsum("bij,bjk->bik", A, B)), (A, B)),
        "einsum bhqd,bhkd": (Call(lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k)), (q, _leaf(2, 3, 7, 8))),
        "conv1d": (nn.Conv1d(4, 8, 3), (x1,)),
        "conv1d stride 2 pad 1 dil 2": (nn.Conv1d(4, 8, 3, stride=2, padding=1, dilation=2), (x1,)),
        "conv2d": (nn.Conv2d(4, 8, 3), (x2,)),
        "conv2d stride 2 pad 1": (nn.Conv2d(4, 8, 3, stride=2, padding=1), (x2,)),
        "conv2d dil 2 same": (nn.Conv2d(4, 8, 3, padding="same", dilation=2), (x2,)),
        "conv2d input grad": (nn.Conv2d(4, 8, 3, padding=1), (_leaf(2, 4, 12, 12),)),
        "conv3d pad 1": (nn.Conv3d(4, 8, 3, padding=1), (x3,)),
        "conv_transpose2d": (nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, output_padding=1), (x2,)),
        "sdpa": (Call(F.scaled_dot_product_attention), (q, k, v)),
        "sdpa causal": (Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), (q, k, v)),
        "sdpa bool mask": (Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=causal)), (q, k, v)),
        "multihead attention": (Call(lambda x: mha(x, x, x)[0]), (seq,)),
        "multihead attention no weights": (Call(lambda x: mha(x, x, x, need_weights=False)[0]), (seq,)),
        "transformer encoder layer": (nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), (seq,)),
        # On the CPU a GRU/RNN runs as aten::linear calls inside aten::gru: counted there, once
        "GRU 2 layers bidirectional": (Call(lambda x: gru(x)[0]), (_leaf(5, 2, 16),)),
        "RNN tanh": (Call(lambda x: rnn(x)[0]), (_leaf(5, 2, 16),)),
    }


WORKLOADS = _workloads()


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_forward_and_backward_match_flop_counter_per_op(name):
    module, inputs = WORKLOADS[name]
    for label, run in (("forward", forward(module, *inputs)), ("forward+backward", forward_backward(module, *inputs))):
        ref_total, ref_ops = reference(run)
        total, ops = profiled(run)
        assert ref_total > 0
        assert (total, ops) == (ref_total, ref_ops), f"{name}, {label}"


@pytest.mark.parametrize("name", ["linear 3-D", "conv2d stride 2 pad 1", "sdpa", "multihead attention"])
def test_no_grad_and_inference_mode_match_flop_counter(name):
    module, inputs = WORKLOADS[name]
    run = forward(module, *[t.detach() for t in inputs])
    with torch.no_grad():
        assert profiled(run) == reference(run)
    # Under inference_mode FlopCounterMode sees composites whole and counts their Python
    # decompositions, which may pick other kernels than the real run (bmm for mm): totals only.
    with torch.inference_mode():
        assert profiled(run)[0] == reference(run)[0]


def test_cpu_attention_forward_equals_the_math_backends_bmms():
    """The reference above registers torch's CUDA flash formula for the CPU kernel; the math
    backend, whose bmms the registry counts itself, gives the same forward count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 5)
    run = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
        run()
    assert profiled(run)[0] == mode.get_total_flops() == 2 * 2 * 3 * 10 * 7 * (8 + 5)


@pytest.mark.parametrize("conv, x", [
    (nn.Conv2d(4, 8, 3, groups=2, bias=False), torch.randn(2, 4, 12, 12)),
    (nn.Conv2d(4, 4, 3, groups=4, padding=1), torch.randn(2, 4, 12, 12, requires_grad=True)),  # depthwise
    (nn.Conv3d(4, 8, 3, stride=2, groups=2), torch.randn(2, 4, 6, 6, 6)),
    (nn.ConvTranspose2d(4, 8, 3, stride=2, groups=2), torch.randn(2, 4, 12, 12)),
], ids=["conv2d groups 2", "conv2d depthwise", "conv3d stride 2 groups 2", "conv_transpose2d groups 2"])
def test_grouped_convolution_equals_its_groups_run_apart(conv, x):
    """``flop_counter.conv_backward_flop`` counts the weight gradient with all input channels, not
    one group's: ``groups`` times the real work (an upstream fix, pytorch#183405, was not merged
    in the torch this runs on). The same convolution as ``groups`` plain convolutions on channel
    slices is counted right by the registry, and nbaccel's grouped count must equal it."""
    g = conv.groups
    functional = {nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d, nn.ConvTranspose2d: F.conv_transpose2d}[type(conv)]
    kwargs = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation)
    if isinstance(conv, nn.ConvTranspose2d):
        kwargs["output_padding"] = conv.output_padding

    def apart():
        xs, ws = x.chunk(g, dim=1), conv.weight.chunk(g, dim=0)
        return torch.cat([functional(xi, wi, None, **kwargs) for xi, wi in zip(xs, ws)], dim=1)

    for run, ref_run in ((forward(conv, x), apart), (forward_backward(conv, x), forward_backward(Call(apart)))):
        ref_total, ref_ops = reference(ref_run)
        assert profiled(run) == (ref_total, ref_ops)


def _lstm_case(**kwargs):
    torch.manual_seed(1)
    lstm = nn.LSTM(16, 24, **kwargs)
    layers = lstm.num_layers * (2 if lstm.bidirectional else 1)
    batch = 6 if lstm.batch_first else 2
    # Inputs and the initial state require grad: the fused kernels compute those gradients
    # whether asked or not, and the unfused reference computes them only when asked.
    h0, c0 = _leaf(layers, batch, lstm.proj_size or 24), _leaf(layers, batch, 24)
    return Call(lambda x: lstm(x, (h0, c0))[0]), _leaf(6, 2, 16)


@pytest.mark.parametrize("kwargs", [dict(num_layers=2), dict(bidirectional=True, bias=False), dict(batch_first=True),
                                    dict(proj_size=8)], ids=str)
@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN kernel", "unfused"])
def test_lstm_equals_its_unfused_matmuls(kwargs, onednn):
    """The CPU LSTM kernel (``mkldnn_rnn_layer``) against the same LSTM unfused (oneDNN off), whose
    ``aten::linear``/``mm`` calls the registry counts. Unfused, nbaccel counts those calls and not
    the ``aten::lstm`` around them (its formula would count the same work twice)."""
    module, x = _lstm_case(**kwargs)
    for run in (forward(module, x), forward_backward(module, x)):
        with torch.backends.mkldnn.flags(enabled=False):
            ref_total, _ = reference(run)
        with contextlib.nullcontext() if onednn else torch.backends.mkldnn.flags(enabled=False):
            total, ops = profiled(run)
        assert total == ref_total
        fused = onednn and "proj_size" not in kwargs  # oneDNN has no projections: torch falls back
        assert any(op.startswith("aten::mkldnn_rnn_layer") for op in ops) == fused


def test_packed_lstm_counts_its_matmuls_once():
    from torch.nn.utils.rnn import pack_padded_sequence

    lstm = nn.LSTM(16, 24)
    packed = pack_padded_sequence(torch.randn(10, 2, 16), [10, 7])
    run = lambda: lstm(packed)[0].data.sum().backward()  # noqa: E731
    assert profiled(run)[0] == reference(run)[0] > 0


def test_transformer_inference_fast_path_counts_its_fused_linear():
    """In eval mode under no_grad, ``nn.TransformerEncoderLayer`` runs one fused kernel whose
    first feed-forward linear is ``aten::_addmm_activation`` (linear + ReLU). The same layer with
    grad enabled takes the ordinary path: the math, and so the FLOPs, are the same."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0).eval()
    x = torch.randn(2, 10, 16)
    ref_total, _ = reference(forward(layer, x))
    with torch.no_grad():
        total, ops = profiled(forward(layer, x))
    assert "aten::_addmm_activation" in ops
    assert total == ref_total


def test_matrix_vector_product_counts_as_the_matrix_product():
    """``A @ v`` runs as ``aten::mv`` (no registry formula): as many FLOPs as ``A @ v[:, None]``.
    Its backward counts the matrix-vector product of v's gradient; A's gradient is an outer
    product (elementwise multiplies, not counted, as flop_counter counts no ``aten::mul``)."""
    A, v = _leaf(3, 8, 16), _leaf(16)
    assert profiled(lambda: A @ v)[0] == reference(lambda: A @ v[:, None])[0] == 2 * 24 * 16
    assert profiled(lambda: (A @ v).sum().backward())[0] == 2 * (2 * 24 * 16)


def test_the_amp_audit_counts_the_fused_fast_paths_as_their_ordinary_path():
    """%%amp's op audit (a TorchDispatchMode) sees the inference fast paths whole, without their inner
    matmuls (a trial's TransformerEncoder counted 0 FLOPs): nbaccel's formulas for the fused ops must
    give what FlopCounterMode counts on the same module's ordinary path (grad enabled)."""
    from nbaccel.flops import OpAudit

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0).eval()
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 10, 16)  # the fast paths take batched input only
    for run, fused in ((lambda: layer(x), "aten::_transformer_encoder_layer_fwd"),
                       (lambda: mha(x, x, x), "aten::_native_multi_head_attention")):
        ref_total, _ = reference(run)
        with torch.no_grad(), OpAudit() as audit:
            run()
        assert list(audit.table()["op"])[:1] == [fused]
        assert audit.total_flops == ref_total > 0


def test_the_amp_audit_counts_the_kernels_the_registry_lacks():
    """The audit falls back on nbaccel's formulas where flop_counter has none: oneDNN's LSTM layer
    and the CPU attention kernel counted 0 before."""
    from nbaccel.flops import OpAudit

    lstm, seq = nn.LSTM(16, 24, 2), torch.randn(10, 3, 16)
    with OpAudit() as audit:
        lstm(seq)
    assert "aten::mkldnn_rnn_layer" in set(audit.table()["op"])
    with torch.backends.mkldnn.flags(enabled=False):
        assert audit.total_flops == reference(lambda: lstm(seq))[0] > 0
    q = torch.randn(2, 4, 10, 8)
    with OpAudit() as audit:
        F.scaled_dot_product_attention(q, q, q)
    assert audit.total_flops == reference(lambda: F.scaled_dot_product_attention(q, q, q))[0] == 4 * 2 * 4 * 10 * 10 * 8


def test_the_amp_audit_reads_a_list_of_plain_values_as_the_profiler_does():
    """A review: the audit's fallback dropped every list argument, so cuDNN's RNN backward (CUDA only;
    no registry formula) lost `output_mask`, which says which gradients it computes, and counted 0. The
    same arguments through the profiler's path (concrete values as strings) and the audit's must agree."""
    from nbaccel.analysis.op_flops import op_flops
    from nbaccel.flops import _flops_of

    class Backward:  # stands in for torch.ops.aten._cudnn_rnn_backward.default: not in the registry
        overloadpacket = object()

    t = torch.empty
    # input, weight[], weight_stride0, weight_buf, hx, cx, output, grad_output, grad_hy, grad_cy, mode,
    # hidden_size, proj_size, num_layers, batch_first, dropout, train, bidirectional, batch_sizes,
    # dropout_state, reserve, output_mask
    args = [t(5, 3, 32), [t(256, 32), t(256, 64), t(256), t(256)], 4, t(10), t(1, 3, 64), t(1, 3, 64), t(5, 3, 64),
            t(5, 3, 64), None, None, 2, 64, 0, 1, False, 0.0, True, False, [], None, t(10), [True, True, True, True]]
    dims = [list(a.shape) if isinstance(a, torch.Tensor) else [list(w.shape) for w in a] if a is args[1] else []
            for a in args]
    strings = ["" if isinstance(a, torch.Tensor) or a is args[1] else str(a) for a in args]
    profiled = op_flops("aten::_cudnn_rnn_backward", dims, concrete_inputs=strings)
    assert _flops_of(Backward, "aten::_cudnn_rnn_backward", args, {}, None) == profiled > 0


def test_the_amp_audit_counts_a_grouped_convolution_as_the_profiler_does():
    """A numbers audit: %%amp counted a depthwise convolution's backward with the registry's formula
    (the weight gradient `groups` times over: 663,552 FLOPs) where %%profile_gpu counted 147,456 for
    the same step. The audit now uses nbaccel's formula first, the same as the profiler's."""
    from nbaccel.flops import OpAudit

    torch.manual_seed(0)
    dw, x = nn.Conv2d(8, 8, 3, groups=8, padding=1), torch.randn(2, 8, 16, 16)
    with OpAudit() as audit:
        dw(x).sum().backward()
    one_conv = 2 * 2 * 8 * 16 * 16 * 1 * 3 * 3  # 2 * N * C_out * H * W * (C_in / groups) * k * k
    assert audit.total_flops == 2 * one_conv  # the forward, and the weight gradient (x needs none)
    assert audit.total_flops == profiled(forward_backward(dw, x))[0]


@pytest.mark.skipif(not device_info("cpu").has_bf16_units,
                    reason="oneDNN has no bf16 LSTM on a CPU without AVX512-BF16 or AMX (torch raises 'could not "
                           "create a primitive descriptor'; tests/test_amp_magic.py checks what nbaccel says then)")
def test_the_amp_audit_reads_a_heavy_ops_precision_from_its_inputs():
    """A numbers audit: oneDNN's LSTM backward under bf16 autocast takes bf16 tensors and returns fp32
    gradients (for the fp32 weights); read from its output, the audit called 2/3 of the step's FLOPs
    fp32 ("only 33% of the FLOPs ran in bf16") where %%profile_gpu --amp bf16 said bf16."""
    from nbaccel.flops import OpAudit, precision_summary

    lstm, x = nn.LSTM(16, 24, batch_first=True), torch.randn(4, 10, 16)
    with torch.autocast("cpu", torch.bfloat16), OpAudit() as audit:
        out, _ = lstm(x)
        out.float().sum().backward()
    table = audit.table()
    heavy = table[table["heavy"]]
    assert set(heavy["op"]) >= {"aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward"}
    assert set(heavy["dtype"]) == {"bf16"}
    summary = precision_summary(table)
    assert summary["reduced_flop_share"] == 1.0 and summary["heavy_fp32"] == []
    # a cast is still filed under what it cast to
    assert {"bf16", "fp32"} <= set(table[table["op"] == "aten::_to_copy"]["dtype"])


def test_a_heavy_op_with_a_wider_mask_is_filed_under_its_narrowest_input():
    """A review: bf16 attention with an fp32 additive mask (larger than q, k and v) was filed as fp32
    when the largest input set the dtype; %%profile_gpu reads the narrowest."""
    from nbaccel.flops import OpAudit

    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    mask = torch.zeros(1, 2, 16, 16)  # fp32, 512 elements against q's 256
    with OpAudit() as audit:
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    table = audit.table()
    assert set(table[table["heavy"]]["dtype"]) == {"bf16"}


@pytest.mark.parametrize("n, in1, in2, out", [(32, 16, 24, 8), (7, 5, 3, 4), (5, 1, 9, 2)])
def test_the_amp_audit_counts_bilinear_as_the_bmm_calls_the_profiler_sees(n, in1, in2, out):
    """A trial: nn.Bilinear's aten::_trilinear (forward, and the three _trilinear calls of its backward)
    counted 0 FLOPs in %%amp's audit, which sees it whole, while %%profile_gpu counted the bmm calls a
    trace records under it. Both now agree, on the forward's hand count too: out * (2*n*in1*in2 + 2*n*in2)."""
    from nbaccel.flops import OpAudit

    bil, a, b = nn.Bilinear(in1, in2, out), _leaf(n, in1), _leaf(n, in2)
    step = lambda: bil(a, b).sum().backward()  # noqa: E731
    total, ops = profiled(step)
    assert set(ops) == {"aten::bmm"}  # the trace's children carry the FLOPs, the _trilinear rows none
    with OpAudit() as audit:
        step()
    table = audit.table()
    assert set(table[table["flops"] > 0]["op"]) == {"aten::_trilinear"}
    assert audit.total_flops == total
    with OpAudit() as audit:
        bil(a, b)
    assert audit.total_flops == profiled(lambda: bil(a, b))[0] == out * (2 * n * in1 * in2 + 2 * n * in2)


def test_one_dimensional_products_count_two_flops_per_element():
    """`v @ v`, torch.dot, torch.vdot and torch.inner run aten::dot / aten::vdot, which no registry
    counts: 2 FLOPs per element (a multiply-add), in both magics."""
    from nbaccel.flops import OpAudit

    v = torch.randn(1000)
    run = lambda: (torch.dot(v, v), torch.vdot(v, v), v @ v, torch.inner(v, v))  # noqa: E731
    assert profiled(run)[0] == 4 * 2000
    with OpAudit() as audit:
        run()
    assert audit.total_flops == 4 * 2000


def test_complex_matmuls_count_four_real_multiply_adds_and_complex_convolutions_their_three_real_ones():
    """A complex multiply-add is 8 real FLOPs (a real one 2): a Fourier layer's complex einsum read 4x too
    few in both magics. torch runs a complex convolution as three real ones, which both see and count."""
    from nbaccel.flops import OpAudit

    a, b = torch.randn(4, 8, 16, dtype=torch.cfloat), torch.randn(4, 16, 8, dtype=torch.cfloat)
    real = 2 * 4 * 8 * 16 * 8
    run = lambda: (torch.bmm(a, b), torch.einsum("bij,bjk->bik", a, b), a[0] @ b[0])  # noqa: E731
    expected = 4 * (real + real + real // 4)
    assert profiled(run)[0] == expected
    with OpAudit() as audit:
        run()
    assert audit.total_flops == expected
    x, w = torch.randn(2, 3, 16, 16, dtype=torch.cfloat), torch.randn(4, 3, 3, 3, dtype=torch.cfloat)
    conv = lambda: F.conv2d(x, w)  # noqa: E731
    one_real = profiled(lambda: F.conv2d(x.real.contiguous(), w.real.contiguous()))[0]
    assert profiled(conv)[0] == 3 * one_real > 0
    with nbaccel.profile(device="cpu") as prof:  # the complex op around them says what they sum to
        conv()
    ops = prof.result.op_columns
    assert ops["flops"][ops["name"].index("aten::conv2d")] == 3 * one_real
    with OpAudit() as audit:
        conv()
    assert audit.total_flops == 3 * one_real


@pytest.mark.skipif(device_info("cpu").has_bf16_units,
                    reason="this CPU has bf16 units: oneDNN runs the bf16 convolution, not torch's fallback kernel")
@pytest.mark.parametrize("conv, x", [
    (nn.Conv2d(4, 8, 3, stride=2, padding=1), torch.randn(2, 4, 12, 12)),
    (nn.Conv2d(4, 8, 3, padding=1), torch.randn(2, 4, 12, 12, requires_grad=True)),  # input grad too
    (nn.Conv1d(4, 8, 3), torch.randn(2, 4, 20)),  # run as a 2-D convolution
], ids=["conv2d stride 2 pad 1", "conv2d input grad", "conv1d"])
def test_a_bf16_convolution_on_a_cpu_without_bf16_units_counts_on_the_fallback_kernel(conv, x):
    """A trial on an AVX2-only CPU: under %%profile_gpu --amp bf16 a CNN's top row,
    aten::_slow_conv2d_forward (where oneDNN has no bf16 kernel), showed no FLOPs or FLOP/s; they sat
    on aten::_convolution around it, which holds none of the time. Now the fallback kernels carry
    them, once (the self-FLOPs sum to the header in `profiled`), and agree with FlopCounterMode."""
    def bf16(run):
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                run()
        return step

    for run in (bf16(forward(conv, x)), bf16(forward_backward(conv, x))):
        ref_total, ref_ops = reference(run)
        run()
        with nbaccel.profile(device="cpu") as prof:
            run()
        ops = prof.result.ops.dropna(subset=["flops"])
        assert "aten::_slow_conv2d_forward" in set(ops["name"])
        assert "aten::_convolution" not in set(ops["name"])  # no longer counted beside its kernel
        assert profiled(run) == (ref_total, ref_ops) and ref_total > 0
    assert "aten::_slow_conv2d_backward" in set(ops["name"])
    assert "aten::convolution_backward" not in set(ops["name"])


@pytest.mark.parametrize("conv, shape, kernel", [
    (nn.Conv2d(4, 8, 3, stride=2, padding=1, dilation=2), (2, 4, 12, 12), "slow_conv_dilated2d"),
    (nn.Conv2d(4, 8, 3, dilation=2, groups=2), (2, 4, 11, 11), "slow_conv_dilated2d"),  # once per group
    (nn.Conv1d(4, 8, 3, stride=2, dilation=3), (2, 4, 20), "slow_conv_dilated2d"),  # run as 2-D
    (nn.Conv3d(4, 8, 3, stride=2, padding=1, groups=2), (2, 4, 6, 6, 6), "slow_conv3d_forward"),
    (nn.Conv3d(4, 6, 3, padding=2, dilation=2), (2, 4, 6, 6, 6), "slow_conv_dilated3d"),
    (nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, output_padding=1), (2, 4, 6, 6), "slow_conv_transpose2d"),
    (nn.ConvTranspose2d(4, 8, 3, stride=2, dilation=2, groups=2), (2, 4, 6, 6), "slow_conv_transpose2d"),
    (nn.ConvTranspose1d(4, 6, 3, stride=3, output_padding=2), (2, 4, 10), "slow_conv_transpose2d"),
    (nn.ConvTranspose3d(4, 6, 3, stride=2, output_padding=1, groups=2), (2, 4, 4, 4, 4), "slow_conv_transpose3d"),
], ids=["conv2d stride 2 dil 2", "conv2d dil 2 groups 2", "conv1d dil 3", "conv3d groups 2", "conv3d dil 2",
        "conv_transpose2d output_padding", "conv_transpose2d dil 2 groups 2", "conv_transpose1d",
        "conv_transpose3d groups 2"])
@pytest.mark.parametrize("backend", ["float64", "oneDNN off", "bf16 autocast"])
def test_the_dilated_transposed_and_3d_fallback_kernels_carry_the_convolutions_flops(conv, shape, kernel, backend):
    """torch's own CPU kernels under aten::_convolution (float64; fp32 with oneDNN off; bf16 on a CPU
    without bf16 units) had no formula, so their FLOPs sat on aten::_convolution, which holds none of
    the time, and the kernel's row showed no FLOP/s. They now carry them, once (`profiled` checks the
    self FLOPs sum to the header), as many as FlopCounterMode counts. Their backward runs inside
    convolution_backward (no op of its own): one forward per gradient, 3x the forward with an input
    gradient, whatever the groups (FlopCounterMode counts a grouped weight gradient groups times)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    dtype = torch.float64 if backend == "float64" else torch.float32
    conv, x = conv.to(dtype), x.detach().to(dtype).requires_grad_()
    fallback = backend != "bf16 autocast" or not device_info("cpu").has_bf16_units

    def run(fn):
        def step():
            with (torch.autocast("cpu", dtype=torch.bfloat16) if backend == "bf16 autocast"
                  else contextlib.nullcontext()):
                fn()
        return step

    with torch.backends.mkldnn.flags(enabled=backend != "oneDNN off"):
        fwd, fwd_bwd = run(forward(conv, x)), run(forward_backward(conv, x))
        ref_total, ref_ops = reference(fwd)
        assert profiled(fwd) == (ref_total, ref_ops) and ref_total > 0
        with nbaccel.profile(device="cpu") as prof:
            fwd_bwd()
        assert profiled(fwd_bwd)[0] == 3 * ref_total
        if conv.groups == 1:
            assert profiled(fwd_bwd) == reference(fwd_bwd)
    counted = prof.result.ops.dropna(subset=["flops"])
    if fallback:
        assert set(counted["name"]) == {f"aten::{kernel}", "aten::convolution_backward"}
        # the dilated and transposed kernels run once per group; slow_conv3d_forward takes all groups
        calls = counted.set_index("name")["flops_calls"]
        assert calls[f"aten::{kernel}"] == (1 if kernel == "slow_conv3d_forward" else conv.groups)
