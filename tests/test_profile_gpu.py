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
