"""A trace nbaccel recorded on an H200 (tests/data/README.md): Hopper kernel names as cuBLAS 13 and
cuDNN 9.19 spell them today (nvjet_sm90_*, sdpa_sm90_flash_*_wgmma), through the same loader and
classifier as a live %%profile_gpu. The figures are what nbaccel reported on that machine."""

from pathlib import Path

import pytest

import nbaccel
from nbaccel.analysis.kernels import kernel_category, uses_tensor_cores

TRACE = Path(__file__).parent / "data" / "h200_bf16_transformer_step.json.gz"


@pytest.fixture(scope="module")
def h200():
    return nbaccel.load_trace(TRACE, shapes=True)


def test_counts_device_and_peak(h200):
    assert (h200.op_count, h200.kernel_count) == (1098, 140)
    assert h200.device.name == "NVIDIA H200"
    h = h200.header
    assert h["steps"] == 2 and h["dominant_dtype"] == "bf16"
    assert h["peak_flops_per_s"] == 989e12  # H200 SXM dense bf16, nbaccel/data/gpu_peaks.csv
    assert h["fraction_of_peak"] == pytest.approx(h["flops_per_s"] / 989e12)


def test_tensor_core_share_as_reported_on_the_machine(h200):
    assert h200.tensor_cores.value == pytest.approx(0.4527, abs=5e-5)
    k = h200.kernels
    nvjet = k[k["name"].str.startswith("nvjet_sm90_")]
    assert len(nvjet) == 6 and nvjet["tensor_cores"].all()  # every cuBLAS GEMM of a bf16 step
    sdpa = k[k["name"].str.contains("sdpa_sm90_flash")]
    assert len(sdpa) == 2 and sdpa["tensor_cores"].all()  # cuDNN flash attention, fprop + bprop (wgmma)
    assert not k[k["name"].str.contains("at::native::")]["tensor_cores"].any()


def test_cudnn_attention_helpers_are_attention_not_matmul():
    assert kernel_category("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, "
                           "void*, void*, unsigned int)") == "attention"
    assert kernel_category("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)") \
        == "attention"
    assert kernel_category("at::cuda::philox::unpack_cudnn(at::PhiloxCudaState, long*, long*)") == "other"
    assert uses_tensor_cores("at::cuda::philox::unpack_cudnn(at::PhiloxCudaState, long*, long*)") is not True


def test_gemm_flops_by_hand(h200):
    t = h200.table(group="op+shape")
    row = t[(t["name"] == "aten::addmm") & (t["shapes"] == "4096, 8192x1024, 1024x4096, -, -")].iloc[0]
    # linear1 of the layer: 16*512 = 8192 tokens, 1024 -> 4096; 2 active steps
    assert row["calls"] == 2 and row["flops"] == 2 * 2 * 8192 * 1024 * 4096


def test_cudnn_attention_flops_sit_on_the_ops_that_hold_the_device_time(h200):
    # _scaled_dot_product_cudnn_attention(_backward) run aten::_cudnn_attention_forward(_backward),
    # which hold the kernels: the FLOPs were on the parents' rows (0 device self time), "-" on these.
    t = h200.table(group="op").set_index("name")
    b, h, s, d = 16, 16, 512, 64
    forward = 2 * 2 * b * h * s * s * d  # Q K^T and P V, torch.utils.flop_counter's sdpa formula
    assert t.loc["aten::_cudnn_attention_forward", "flops"] == 2 * forward  # 2 active steps
    assert t.loc["aten::_cudnn_attention_backward", "flops"] == 2 * forward * 5 // 2  # 5 products
    assert t.loc[["aten::_scaled_dot_product_cudnn_attention",
                  "aten::_scaled_dot_product_cudnn_attention_backward"], "flops"].isna().all()
    assert h200.header["flops"] == 1_254_130_450_432  # counted once, as before


def test_an_op_recorded_inside_itself_is_one_call(h200):
    # Autocast re-dispatches aten::mm inside aten::mm: counted twice (as key_averages() does), the
    # mm row once showed 30 calls and 1.55 TFLOP, more than the whole step's 1.25 TFLOP.
    mm = h200.table(group="op").set_index("name").loc["aten::mm"]
    assert mm["calls"] == 16
    assert mm["flops"] <= h200.header["flops"]
    assert mm["device_total_us"] <= h200.device_time_us
    assert mm["dtype"] == "bf16"


@pytest.mark.parametrize("source", ["h200", "h100"])
def test_device_activities_equal_the_concat_of_kernels_copies_and_sets(h200, source):
    import pandas as pd

    if source == "h100":
        shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
        files = sorted(shared.glob("*h100*")) if shared.exists() else []
        if not files:
            pytest.skip("../shared/data/traces is not beside this checkout")
        trace = nbaccel.load_trace(files[0]).trace
    else:
        trace = h200.trace
    cols = ["name", "device", "stream", "ts_us", "dur_us", "category", "op_index"]
    parts = [df[cols].assign(kind=kind) for kind, df in
             (("kernel", trace.kernels), ("memcpy", trace.memcpy), ("memset", trace.memset)) if len(df)]
    expected = pd.concat(parts, ignore_index=True)
    pd.testing.assert_frame_equal(trace.device_activities(), expected)
    assert trace.device_activities() is trace.device_activities()  # built once


def test_flops_per_s_column_divides_by_device_total_time_and_says_so(h200):
    from nbaccel.render import profile as render_profile

    text = str(h200)
    assert "FLOP/s (device total)" in text.split("time by category")[0]
    assert ("FLOP/s column = the row's FLOPs / the device total time of the calls that carry them"
            in render_profile.method(h200))
    rows = h200.ops[h200.ops["flops"] > 0]
    with_time = rows[rows["device_total_us"] > 0]
    assert len(with_time)
    expected = with_time["flops"] / (with_time["device_total_us"] * 1e-6)
    assert list(with_time["flops_per_s"]) == pytest.approx(list(expected))
