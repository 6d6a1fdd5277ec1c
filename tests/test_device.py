"""What device.py decides about a GPU that is not here: torch.cuda's device queries are faked."""

from __future__ import annotations

import types

import pytest
import torch

from nbaccel.device import DeviceError, autocast_dtype, device_info


@pytest.fixture
def gpus(monkeypatch):
    """cuda:0 a V100 (sm 7.0), cuda:1 an H100 (sm 9.0); the *current* device is the H100, and torch's
    is_bf16_supported() says yes, as it does there (and, with emulation, on the V100 too)."""
    props = {0: types.SimpleNamespace(name="Tesla V100-SXM2-16GB", major=7, minor=0, total_memory=16 * 2**30),
             1: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props[torch.device(d).index])
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d=None: (props[torch.device(d).index].major, props[torch.device(d).index].minor))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)
    return props


def test_auto_picks_fp16_on_a_gpu_without_bf16_units(gpus):
    v100 = device_info(torch.device("cuda", 0))
    assert v100.compute_capability == (7, 0) and v100.tensor_cores
    assert not v100.supports_bf16 and not v100.has_bf16_units and v100.has_fp16_units
    assert autocast_dtype("auto", v100) is torch.float16
    with pytest.raises(DeviceError, match=r"Tesla V100-SXM2-16GB has no bf16 support \(needs compute capability 8.0\+\)"):
        autocast_dtype("bf16", v100)
    assert autocast_dtype("fp16", v100) is torch.float16


def test_auto_picks_bf16_on_an_ampere_or_later_gpu(gpus):
    h100 = device_info(torch.device("cuda", 1))
    assert h100.supports_bf16 and h100.has_bf16_units and h100.supports_tf32
    assert autocast_dtype("auto", h100) is torch.bfloat16


def test_the_answer_is_for_the_device_asked_for_not_the_current_one(gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # current: the V100
    assert device_info(torch.device("cuda", 1)).supports_bf16
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # current: the H100
    assert not device_info(torch.device("cuda", 0)).supports_bf16
