"""%%profile_gpu on a real CUDA device. Skipped without one; the GPU check runs these."""

from __future__ import annotations

import pytest
import torch

import nbaccel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tensor_core_share_of_bf16_and_strict_fp32_gemms():
    import sys

    check = sys.modules["nbaccel.profile"].tensor_core_check(n=2048)
    print(check)
    assert check["bf16"]["tensor_core_share"] > 0.9
    assert check["fp32"]["tensor_core_share"] < 0.1


def test_cuda_profile_has_kernels_device_time_and_busy_fraction():
    a = torch.randn(1024, 1001, device="cuda")
    with nbaccel.profile(device="cuda") as prof:
        for _ in range(5):
            (a @ a.T).relu_()
    r = prof.result
    assert r.on_device and r.kernel_count >= 10
    assert r.header["device_time_us"] > 0 and 0 < r.header["device_busy_fraction"] <= 1
    assert r.ops.iloc[0]["device_self_us"] > 0
    assert any(e["unaligned"] == {"K": 1001} for e in r.unaligned)


@pytest.mark.parametrize("weights_need_grad", [True, False])
def test_cudnn_lstm_flops_from_the_recorded_shapes(weights_need_grad):
    # The _cudnn_rnn formulas (nbaccel.analysis.rnn_flops) were written from the op schema on a
    # machine without a GPU: forward 2 FLOPs per weight-matrix element per token, backward the same
    # for the input gradient plus the same again when the weights need a gradient (output_mask[3]).
    lstm = torch.nn.LSTM(256, 512, num_layers=2).cuda().requires_grad_(weights_need_grad)
    x = torch.randn(50, 16, 256, device="cuda", requires_grad=True)
    lstm(x)[0].sum().backward()  # cuDNN plans outside the profile
    with nbaccel.profile(device="cuda") as prof:
        lstm(x)[0].sum().backward()
    forward = 2 * 50 * 16 * sum(p.numel() for p in lstm.parameters() if p.dim() == 2)
    flops = prof.result.ops.set_index("name")["flops"]
    print(flops.dropna())
    assert flops["aten::_cudnn_rnn"] == forward
    assert flops["aten::_cudnn_rnn_backward"] == forward * (2 if weights_need_grad else 1)
    assert prof.result.header["flops"] == forward * (3 if weights_need_grad else 2)
