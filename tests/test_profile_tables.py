"""The pure parts of %%profile_gpu, without a GPU: the CUDA path on synthetic and real GPU traces.

A live CUDA profile goes through `ProfileResult.from_trace` exactly like these tests do; only
the Kineto recording itself needs the device (tests/test_profile_gpu.py).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from nbaccel import op_attribution
from nbaccel import profile_table as pt
from nbaccel.device import DeviceInfo
from nbaccel.profile import ProfileOptions, ProfileResult
from nbaccel.profile_options import ProfileError
from nbaccel.trace_io import split_by_step, write_step_traces
from nbaccel.render import profile as render_profile

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
H100 = TRACES / "tracelens_h100_Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"

GPU = DeviceInfo("cuda", 0, "NVIDIA H100 80GB HBM3", compute_capability=(9, 0), supports_bf16=True,
                 supports_fp16=True, supports_tf32=True, tensor_cores=True)

BF16_GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
FP32_GEMM = "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nn_align1>(cutlass_80_simt_sgemm_128x128_8x4_nn_align1::Params)"
RELU = "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::launch_clamp_scalar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)"


def synthetic_cuda_trace(idle_gap_us: float = 0.0, relu_us: float = 10.0, relu_kernel: str = RELU) -> dict:
    """Two steps of: H2D copy (100 us), a bf16 GEMM (Tensor Cores), an fp32 GEMM 1000x1000x1001 (SIMT), a relu
    (``relu_us`` long, named ``relu_kernel``)."""
    ev, t, corr = [], 0.0, 0
    ev.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}})

    def op(name, ts, dur, ext, dims=None, types=None):
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                   "args": {"External id": ext, "Input Dims": dims or [], "Input type": types or []}})

    def launch(cat, name, ts, dur, ext, gpu_ts, gpu_dur):
        nonlocal corr
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts,
                   "dur": dur, "args": {"correlation": corr, "External id": ext}})
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": gpu_ts, "dur": gpu_dur,
                   "args": {"device": 0, "stream": 7, "correlation": corr, "External id": ext}})
        ev.append({"ph": "s", "cat": "ac2g", "id": corr, "pid": 1, "tid": 1, "ts": ts, "name": "ac2g"})

    ext = 0
    for step in range(2):
        start = t
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                   "ts": start, "dur": 400.0 + idle_gap_us, "args": {}})
        ext += 1
        op("aten::copy_", t + 1, 20, ext, [[1000, 1000], [1000, 1000]], ["float", "float"])
        launch("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", t + 2, 5, ext, t + 10, 100)
        ext += 1
        op("aten::mm", t + 30, 20, ext, [[1024, 1024], [1024, 1024]], ["c10::BFloat16", "c10::BFloat16"])
        launch("kernel", BF16_GEMM, t + 32, 5, ext, t + 50, 100)
        ext += 1
        op("aten::mm", t + 60, 20, ext, [[1000, 1000], [1000, 1001]], ["float", "float"])
        launch("kernel", FP32_GEMM, t + 62, 5, ext, t + 150 + idle_gap_us, 200)
        ext += 1
        op("aten::relu", t + 90, 10, ext, [[1000, 1001]], ["float"])
        # Launched at the end of the step: runs after the host has started the next step.
        launch("kernel", relu_kernel, t + 92, 5, ext, t + 395 + idle_gap_us, relu_us)
        t += 400.0 + idle_gap_us
    return {"schemaVersion": 1, "traceEvents": ev, "baseTimeNanoseconds": 1_790_000_000_000_000_000,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "computeMajor": 9, "computeMinor": 0,
                                  "totalGlobalMem": 85_000_000_000}]}


def cuda_result(**kw) -> ProfileResult:
    return ProfileResult.from_trace(synthetic_cuda_trace(**kw), GPU, ProfileOptions(device="cuda"))


def test_cuda_tables_from_a_synthetic_trace():
    r = cuda_result()
    assert r.on_device and r.default_sort == "device"
    ops = r.ops
    assert ops["device_self_us"].is_monotonic_decreasing
    mm = ops.set_index("name").loc["aten::mm"]
    assert mm["device_self_us"] == pytest.approx(2 * (100 + 200))
    assert mm["calls"] == 4
    assert r.device_time_us == pytest.approx(2 * (100 + 100 + 200 + 10))
    assert ops["percent"].sum() == pytest.approx(100.0)


def test_cuda_tensor_core_share_and_fp32_misses():
    r = cuda_result()
    assert r.tensor_cores.value == pytest.approx(200 / (200 + 400 + 20))
    misses = r.fp32_misses
    assert list(misses["name"]) == ["aten::mm"] and misses.iloc[0]["shapes"] == "1000x1000, 1000x1001"
    assert misses.iloc[0]["device_us"] == pytest.approx(400)
    assert any("without Tensor Cores" in a and "TF32" in a for a in r.advice)
    kernels = r.kernels.set_index("name")
    assert kernels.loc[BF16_GEMM, "tensor_cores"] is True and kernels.loc[FP32_GEMM, "tensor_cores"] is False


def test_a_cpu_profile_has_the_gpu_tables_with_their_columns():
    """On a CPU profile `fp32_misses` and `streams` were DataFrames without columns (`kernels` had its
    columns): ``df.columns`` / ``df[["name", "share"]]`` code written on a GPU failed on a laptop."""
    import torch

    from nbaccel.profile import profile

    with profile(options=ProfileOptions(device="cpu")) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    cpu, gpu = prof.result, cuda_result()
    assert not cpu.on_device
    for table in ("fp32_misses", "streams", "kernels"):
        frame = getattr(cpu, table)
        assert frame.empty and list(frame.columns) == list(getattr(gpu, table).columns), table
    assert list(cpu.fp32_misses.columns) == ["name", "shapes", "calls", "device_us", "share"]
    assert cpu.streams[["stream", "busy_us"]].empty


def test_cuda_categories_and_transfer_advice():
    r = cuda_result()
    cats = r.categories.set_index("category")
    assert cats.loc["matmul/conv", "time_us"] == pytest.approx(600)
    assert cats.loc["data transfer", "time_us"] == pytest.approx(200)
    assert cats.loc["elementwise", "time_us"] == pytest.approx(20)
    share = 200 / r.device_time_us
    assert any(f"copies take {share:.0%}" in a for a in r.advice)


def test_fusion_advice_where_unfused_elementwise_kernels_lead():
    """Elementwise kernels and on-device copies past 40 % of device time: torch.compile, naming the ops that
    launched them; not for Inductor's own kernels (fused already), nor below the share."""
    def fusion(r):
        return [a for a in r.advice if a.startswith("Elementwise kernels")]

    assert not fusion(cuda_result())  # 20 of 820 us
    heavy = cuda_result(relu_us=700.0)  # 1,400 of 2,200 us
    [line] = fusion(heavy)
    assert line.startswith("Elementwise kernels and on-device copies take 64% of device time (elementwise 63.6%; "
                           "most from aten::relu ") and "torch.compile fuses" in line
    assert not fusion(cuda_result(relu_us=700.0, relu_kernel="triton_poi_fused_relu_0"))


def test_fusion_advice_on_the_real_traces():
    """The H100 Qwen forward (bf16 eager: 38 % elementwise, 23 % copies) gets the line; it names its largest
    elementwise ops as the op table shows them. Traces whose matmuls lead (A100, B200) do not."""
    import nbaccel

    qwen = nbaccel.load_trace(Path(__file__).resolve().parents[1] / "notebooks" / "data" / "h100_qwen_inference.json.gz")
    [line] = [a for a in qwen.advice if a.startswith("Elementwise kernels")]
    assert "take 61% of device time (elementwise 38.4%, memory copy 22.8%; most from aten::mul 14.8%" in line
    for name in ("hta_a100_negative_queue_length_values_check_rank0.json.gz", "tracelens_b200_eager_trace.json.gz"):
        if not (TRACES / name).exists():
            continue  # ../shared/data beside the checkout (docs/trace_analysis.md)
        assert not [a for a in nbaccel.load_trace(TRACES / name).advice if a.startswith("Elementwise kernels")], name


def test_cuda_idle_advice_only_when_the_device_waits():
    busy = cuda_result()
    idle = cuda_result(idle_gap_us=2000.0)
    assert not any("idle" in a for a in busy.advice)
    frac = 1 - idle.busy["busy_fraction"]
    assert frac > 0.5
    assert any(f"idle {frac:.0%}" in a for a in idle.advice)


def test_cuda_header_has_fraction_of_peak_from_the_gpu_table():
    r = cuda_result()
    h = r.header
    assert h["device_time_us"] == pytest.approx(820) and h["kernels"] == 6
    assert h["peak_flops_per_s"] and 0 < h["fraction_of_peak"] < 1
    assert "H100" in h["peak_note"]


def test_cuda_render_shows_device_columns_and_kernels():
    r = cuda_result()
    text = render_profile.text(r)
    assert "self device" in text and "Tensor Core share of kernel time: 32.3%" in text
    html = render_profile.html(r).replace("<wbr>", "")  # break opportunities in long names, not text
    assert "Top kernels" in html and "sm90_xmma_gemm_bf16bf16" in html
    box = render_profile.widget(r)
    assert box is not None


def test_split_by_step_keeps_late_kernels_with_their_launch():
    doc = synthetic_cuda_trace()
    parts = split_by_step(doc)
    assert [name for name, _, _ in parts] == ["ProfilerStep#0", "ProfilerStep#1"]
    for _, _, part in parts:
        kernels = [e["name"] for e in part["traceEvents"] if e.get("cat") == "kernel"]
        assert sorted(kernels) == sorted([BF16_GEMM, FP32_GEMM, RELU])
        assert any(e.get("ph") == "M" for e in part["traceEvents"])
        assert part["deviceProperties"] == doc["deviceProperties"]


def test_write_step_traces_names_files_like_tensorboard_trace_handler(tmp_path):
    files = write_step_traces(synthetic_cuda_trace(), str(tmp_path / "out"))
    assert len(files) == 2
    stamps = [int(Path(f).name.split(".")[1]) for f in files]
    assert stamps[1] > stamps[0] and stamps[0] // 1000 == 1_790_000_000  # Unix ms of the step start
    for f in files:
        assert json.loads(Path(f).read_text())["traceEvents"]


def test_real_h100_trace_through_the_profile_result():
    if not H100.exists():
        pytest.skip(f"reference trace not found at {H100} (CI keeps a copy of shared/ at ../shared)")
    with gzip.open(H100, "rt") as fh:
        doc = json.load(fh)
    r = ProfileResult.from_trace(doc, GPU, ProfileOptions(device="cuda", shapes=True))
    # Ground truth from shared/data/traces/README.md: 36.64 % of kernel time on Tensor Cores.
    assert r.tensor_cores.value == pytest.approx(0.3664, abs=0.001)
    cats = r.categories.set_index("category")
    assert cats["percent"].sum() == pytest.approx(100.0)
    assert cats.loc["matmul/conv", "time_us"] == pytest.approx(12_793.4, abs=1)  # the cuBLAS GEMMs (README table)
    assert r.header["fraction_of_peak"] is not None and r.header["dominant_dtype"] == "bf16"
    # A 3.5 us bmm with K=1 is listed under shapes but is too small to be advice.
    assert any(e["op"] == "aten::bmm" for e in r.unaligned)
    assert not any("pad to" in a for a in r.advice)
    assert "aten::addmm" in set(r.ops["name"])
    assert render_profile.text(r) and render_profile.html(r)


# --- the pure helpers ----------------------------------------------------------------------------

def _ops(rows):
    """A TraceData.ops-like frame from (name, ts, dur, self, parent) tuples on one thread."""
    frame = pd.DataFrame(rows, columns=["name", "ts_us", "dur_us", "self_us", "parent"])
    n = len(frame)
    return frame.assign(pid=1, tid=1, input_dims=[None] * n, device_self_us=0.0, device_total_us=0.0,
                        tc_device_us=0.0, flops=float("nan"), flops_counted=False, category="other",
                        math_dtype=None, dtype=None)


def test_memory_is_charged_to_the_innermost_op_and_rolled_up():
    ops = _ops([("outer", 0, 100, 50, -1), ("inner", 10, 20, 20, 0), ("later", 200, 10, 10, -1)])
    events = [{"name": "[memory]", "pid": 1, "tid": 1, "ts": 15, "args": {"Bytes": 1000}},
              {"name": "[memory]", "pid": 1, "tid": 1, "ts": 50, "args": {"Bytes": 24}},
              {"name": "[memory]", "pid": 1, "tid": 1, "ts": 60, "args": {"Bytes": -1000}},  # a free
              {"name": "[memory]", "pid": 1, "tid": 1, "ts": 150, "args": {"Bytes": 8}}]  # between ops
    self_b, total_b = op_attribution.memory_by_op(events, ops)
    assert list(self_b) == [24, 1000, 0]
    assert list(total_b) == [1024, 1000, 0]


def test_memory_counts_the_profiled_devices_bytes_only():
    # A CUDA profile added host and device allocations together (an audit of the CUDA paths).
    ops = _ops([("aten::mm", 0, 100, 100, -1)])
    events = [{"name": "[memory]", "pid": 1, "tid": 1, "ts": 10, "args": {"Bytes": 4096, "Device Type": 1}},
              {"name": "[memory]", "pid": 1, "tid": 1, "ts": 20, "args": {"Bytes": 64, "Device Type": 0}}]
    assert list(op_attribution.memory_by_op(events, ops, device="cuda")[0]) == [4096]
    assert list(op_attribution.memory_by_op(events, ops, device="cpu")[0]) == [64]


def test_user_frames():
    assert op_attribution.is_user_frame("<cell>(3): <module>")
    assert op_attribution.is_user_frame("/tmp/ipykernel_12/3456.py(5): train_step")
    assert op_attribution.is_user_frame("/home/me/project/model.py(40): forward")
    assert not op_attribution.is_user_frame("torch/nn/modules/module.py(1779): _call_impl")
    assert not op_attribution.is_user_frame("/usr/lib/python3.11/site-packages/numpy/core.py(3): f")
    assert not op_attribution.is_user_frame("<built-in method matmul of type object at 0x7f>")
    assert not op_attribution.is_user_frame("nn.Module: Linear_0")


def test_source_grouping_counts_every_op_call_and_nested_time_once():
    ops = _ops([("aten::linear", 0, 100, 10, -1), ("aten::addmm", 5, 90, 90, 0), ("aten::relu", 120, 10, 10, -1)])
    events = [{"cat": "user_annotation", "name": "cell line 1: y = m(x)", "pid": 1, "tid": 1, "ts": 0, "dur": 110},
              {"cat": "python_function", "name": "torch/nn/functional.py(1): relu", "pid": 1, "tid": 1,
               "ts": 115, "dur": 20},
              {"cat": "python_function", "name": "/home/me/m.py(7): act", "pid": 1, "tid": 1, "ts": 112, "dur": 30}]
    ops = ops.assign(source=op_attribution.source_by_op(events, ops))
    assert list(ops["source"]) == ["cell line 1: y = m(x)"] * 2 + ["/home/me/m.py, line 7: def act"]
    table = pt.group_ops(ops, "source").set_index("source")
    line = table.loc["cell line 1: y = m(x)"]
    # two op calls (aten::linear and its aten::addmm), whose time is the linear's 100 us, not 190
    assert line["calls"] == 2 and line["cpu_total_us"] == 100 and line["cpu_self_us"] == 100
    assert line["name"].startswith("aten::addmm")


@pytest.mark.parametrize("name", ["Cell In[7], line 1: y = m(x)", "cell line 1: y = m(x)"],
                         ids=["named-as-ipython", "before"])
def test_a_cell_line_range_is_a_source_in_either_spelling(name):
    """--stack's ranges are named "Cell In[7], line 1: ..." (as the functions' rows are); traces recorded before
    named them "cell line 1: ...", and load as such. A user's own range of another name is no source."""
    ops = _ops([("aten::linear", 0, 100, 10, -1), ("aten::relu", 120, 10, 10, -1)])
    events = [{"cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": 0, "dur": 110},
              {"cat": "user_annotation", "name": "my range 1: relu", "pid": 1, "tid": 1, "ts": 115, "dur": 20}]
    assert op_attribution.source_by_op(events, ops) == [name, None]
    assert op_attribution.cell_line_label(7, 1, "y = m(x)") == "Cell In[7], line 1: y = m(x)"
    assert op_attribution.cell_line_label(None, 1, "y = m(x)") == "cell line 1: y = m(x)"


def test_unaligned_shapes_use_16_for_int8_and_skip_aligned():
    ops = _ops([("aten::mm", 0, 10, 10, -1), ("aten::mm", 20, 10, 10, -1), ("aten::_int_mm", 40, 10, 10, -1),
                ("aten::convolution", 60, 10, 10, -1)])
    ops = ops.assign(category="matmul/conv", flops_counted=True, dtype=["fp32", "fp32", "int8", "bf16"],
                     input_dims=[[[64, 64], [64, 64]], [[1000, 1000], [1000, 1001]], [[32, 24], [24, 48]],
                                 [[8, 3, 32, 32], [64, 3, 3, 3]]])
    found = {e["op"]: e for e in pt.unaligned_shapes(ops)}
    assert found["aten::mm"]["pad_to"] == {"N": 1008}
    assert found["aten::_int_mm"]["multiple"] == 16 and found["aten::_int_mm"]["pad_to"] == {"K": 32}
    assert found["aten::convolution"]["unaligned"] == {"C_in": 3} and found["aten::convolution"]["pad_to"] == {"C_in": 8}


def test_convolution_backward_and_transposed_convolutions_read_their_own_channels():
    """convolution_backward takes (grad_output, input, weight): read as a forward convolution's (input,
    weight), a batch of 10 became "C_out=10 -> 16" and grad_output's channels became C_in."""
    ops = _ops([("aten::convolution_backward", 0, 10, 10, -1), ("aten::convolution", 20, 10, 10, -1),
                ("aten::conv_transpose2d", 40, 10, 10, -1)])
    ops = ops.assign(category="matmul/conv", flops_counted=True, dtype="bf16",
                     input_dims=[[[10, 64, 8, 8], [10, 24, 8, 8], [64, 24, 3, 3]],
                                 [[10, 24, 8, 8], [64, 24, 3, 3]],
                                 [[10, 64, 8, 8], [64, 12, 3, 3]]])  # transposed: weight (C_in, C_out, k, k)
    found = {e["op"]: e for e in pt.unaligned_shapes(ops)}
    assert "aten::convolution_backward" not in found and "aten::convolution" not in found  # 24 and 64: aligned
    assert found["aten::conv_transpose2d"]["unaligned"] == {"C_out": 12}


def test_unaligned_shapes_carry_their_share_and_come_most_time_then_most_flops_first():
    ops = _ops([("aten::mm", 0, 10, 10, -1), ("aten::mm", 20, 30, 30, -1), ("aten::mm", 60, 10, 10, -1)])
    ops = ops.assign(category="matmul/conv", flops_counted=True, dtype="fp32", flops=[2e3, 6e3, 9e3],
                     input_dims=[[[9, 8], [8, 8]], [[8, 8], [8, 9]], [[8, 10], [10, 8]]])
    found = pt.unaligned_shapes(ops, total_us=100.0)
    assert [e["shapes"] for e in found] == ["8x8, 8x9", "8x10, 10x8", "9x8, 8x8"]  # 30 us; then 10 us, more FLOPs first
    assert [e["share"] for e in found] == [0.3, 0.1, 0.1] and [e["flops"] for e in found] == [6e3, 9e3, 2e3]
    assert pt.unaligned_shapes(ops)[0]["share"] is None  # no total given: no share to state


def test_filter_is_plain_text_or_a_regex_and_sort_handles_text_columns():
    table = pd.DataFrame({"name": ["aten::mm", "aten::add_", "Optimizer.step#SGD.step", "aten::addmm", "forward"],
                          "source": [None, None, None, None, "model.py(12): forward"], "calls": [1, 3, 2, 1, 1]})
    assert list(pt.filter_table(table, "MM")["name"]) == ["aten::mm", "aten::addmm"]
    assert list(pt.filter_table(table, "add_")["name"]) == ["aten::add_"]
    assert list(pt.filter_table(table, "[")["name"]) == []  # not a valid regex: plain text, no error
    assert list(pt.filter_table(table, "py(")["name"]) == ["forward"]
    # a lab trial typed a regex and was told nothing matched
    assert list(pt.filter_table(table, "aten::(mm|addmm)$")["name"]) == ["aten::mm", "aten::addmm"]
    assert list(pt.filter_table(table, "^ATEN::ADD")["name"]) == ["aten::add_", "aten::addmm"]
    # a source line is still found as typed, though as a regex "(12)" would not match its parentheses
    assert list(pt.filter_table(table, "model.py(12)")["name"]) == ["forward"]
    assert list(pt.sort_table(table, "name", ascending=True)["name"])[0] == "aten::add_"
    with pytest.raises(ValueError):
        pt.sort_table(table, "nope")


def _short_kernels_trace(period_us: float, kernels: int = 250, kernel_us: float = 5.0) -> dict:
    """One step of ``kernels`` relu launches, each kernel ``kernel_us`` long, one launched every ``period_us``."""
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
          {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0.0,
           "dur": kernels * period_us + 20, "args": {}}]
    for i in range(kernels):
        t = i * period_us
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::relu", "pid": 1, "tid": 1, "ts": t + 0.5,
                   "dur": 3.0, "args": {"External id": i + 1}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 1,
                   "dur": 2.0, "args": {"correlation": i + 1, "External id": i + 1}})
        ev.append({"ph": "X", "cat": "kernel", "name": RELU, "pid": 0, "tid": 7, "ts": t + 10, "dur": kernel_us,
                   "args": {"device": 0, "stream": 7, "correlation": i + 1, "External id": i + 1}})
    return {"schemaVersion": 1, "traceEvents": ev,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "computeMajor": 9, "computeMinor": 0,
                                  "totalGlobalMem": 85_000_000_000}]}


@pytest.mark.parametrize("period_us, launch_bound", [(8.0, True), (5.0, False)])
def test_many_short_kernels_are_called_launch_bound_only_when_the_gpu_waits_between_them(period_us, launch_bound):
    r = ProfileResult.from_trace(_short_kernels_trace(period_us), GPU, ProfileOptions(device="cuda"))
    advice = " ".join(r.advice)
    assert ("the host cannot launch them as fast as they run" in advice) == launch_bound, (r.busy, advice)
    assert "input pipeline" not in advice  # the idle the launches explain is not blamed on the DataLoader


def _conv_row_ops(device: bool = False):
    """An aten::_convolution row of 3 calls as a UNet records them: 2 ordinary convolutions whose FLOPs
    are counted on the aten::mkldnn_convolution inside them, and a ConvTranspose2d that oneDNN runs with no
    op with a formula inside (an aten::empty for its output), so its FLOPs are counted on the
    aten::_convolution itself. Times in us; on ``device`` the same times are device totals too."""
    ops = _ops([("aten::_convolution", 0, 100, 10, -1), ("aten::mkldnn_convolution", 5, 90, 90, 0),
                ("aten::_convolution", 200, 100, 10, -1), ("aten::mkldnn_convolution", 205, 90, 90, 2),
                ("aten::_convolution", 400, 20, 5, -1), ("aten::empty", 402, 15, 15, 4)])
    ops = ops.assign(flops=[1e6, 1e6, 1e6, 1e6, 4e5, float("nan")],
                     flops_counted=[False, True, False, True, True, False], category="matmul/conv")
    if device:
        ops = ops.assign(device_total_us=ops["dur_us"], device_self_us=ops["self_us"])
    return ops


@pytest.mark.parametrize("device", [False, True])
def test_flops_per_s_is_over_the_calls_that_carry_the_flops(device):
    # Was: the transposed call's 400 kFLOP over all 3 calls' 220 us (1.82 GFLOP/s) for its own 20 us (20 GFLOP/s).
    ops = _conv_row_ops(device)
    device_total = float(ops["device_self_us"].sum()) if device else 0.0
    frame = pt.group_ops(ops, "op", device_total).set_index("name")
    conv, inner = frame.loc["aten::_convolution"], frame.loc["aten::mkldnn_convolution"]
    assert (conv["calls"], conv["flops_calls"], conv["flops"]) == (3, 1, 4e5)
    assert conv["flops_per_s"] == pytest.approx(4e5 / 20e-6)
    assert (inner["calls"], inner["flops_calls"]) == (2, 2) and inner["flops_per_s"] == pytest.approx(2e6 / 180e-6)
    assert frame.loc["aten::empty", "flops_calls"] == 0
    cols = {c: ops[c].tolist() for c in ops} | {"shapes": [""] * len(ops)}
    for group in ("op", "op+shape"):  # the display's rows: the same numbers
        rows = {r["name"]: r for r in pt.group_rows(cols, group, device_total)}
        assert (rows["aten::_convolution"]["flops_calls"], rows["aten::_convolution"]["flops_per_s"]) == (
            1, conv["flops_per_s"])
    # a source line's FLOPs over the same counted ops' time: 2.4 MFLOP over 200 us, not its 220 us
    line = pt.group_ops(ops.assign(source="cell line 1: y = net(x)"), "source", device_total).iloc[0]
    assert line["flops_calls"] == 3 and line["flops_per_s"] == pytest.approx(2.4e6 / 200e-6)


def test_a_redispatched_call_carrying_the_flops_is_one_call():
    # autocast's aten::matmul re-dispatched inside the user's: the inner one carries the FLOPs, 1 call
    ops = _ops([("aten::matmul", 0, 100, 10, -1), ("aten::matmul", 5, 80, 80, 0)]).assign(
        flops=[2e6, 2e6], flops_counted=[False, True])
    row = pt.group_ops(ops, "op").iloc[0]
    assert (row["calls"], row["flops_calls"]) == (1, 1) and row["flops_per_s"] == pytest.approx(2e6 / 80e-6)


def test_the_coverage_note_stands_beside_a_rate_only():
    # a CPU op in a CUDA profile has no device time, so no FLOP/s: "-", not "- (1 of 3 calls)"
    note = render_profile._flops_coverage
    assert note({"flops_calls": 1, "calls": 3, "flops_per_s": 2e10}) == " (1 of 3 calls)"
    assert note({"flops_calls": 1, "calls": 3, "flops_per_s": float("nan")}) == ""
    assert note({"flops_calls": 3, "calls": 3, "flops_per_s": 2e10}) == ""


def test_table_text_prints_a_filtered_table_with_full_names_and_what_it_left_out():
    """A trial's print(prof.table(filter="mm")) in a terminal was a DataFrame squashed to its width, names cut
    and columns folded; table_text lays the same rows out as the report does, and says what it kept."""
    r = cuda_result()
    total = len(r.table())
    mm = r.table(filter="mm|relu")
    assert len(mm) == 2 and total == 3
    lines = r.table_text(filter="mm|relu").splitlines()
    assert lines[0] == "the 2 rows matching 'mm|relu' (3 in all) by self device (grouped by op):"
    assert lines[1].split()[:2] == ["operator", "calls"] and "% of device" in lines[1]
    assert [line.split()[0] for line in lines[3:]] == list(mm["name"])  # full names, the table's order
    one = r.table_text(filter="mm|relu", top=1).splitlines()
    assert one[0].startswith("top 1 of the 2 rows matching") and len(one) == 4
    assert r.table_text(filter="relu").startswith("the 1 row matching 'relu' (3 in all)")
    assert r.table_text(sort="calls", top=2, ascending=True).splitlines()[0] == \
        f"top 2 of {total} rows by calls ascending (grouped by op):"
    assert [line.split()[0] for line in r.table_text(sort="calls", top=2, ascending=True).splitlines()[3:]] == \
        list(r.table(sort="calls", top=2, ascending=True)["name"])  # the rows table(top=) keeps, in its order
    assert r.table_text(filter="no such op") == \
        f"no row of the {total} (grouped by op) has a name or source line matching 'no such op'"
    with pytest.raises(ProfileError, match="top must be at least 1"):  # table()'s checks, not a pandas error
        r.table_text(top=0)


def test_a_filter_that_is_a_broken_regex_and_matches_nothing_says_why():
    """A trial's --filter "aten::(mm" (a missing parenthesis) read "no row ... matching 'aten::(mm'", nothing of the
    typo: it is looked for as plain text, and the line says so with the regex's error."""
    r = cuda_result()
    assert r.table_text(filter="aten::(mm") == (
        f"no row of the {len(r.table())} (grouped by op) has a name or source line matching 'aten::(mm' (as a regex it "
        "is invalid: missing ), unterminated subpattern at position 6; it was looked for as plain text)")
    assert "invalid" not in r.table_text(filter="no such op")  # a plain word: no regex to blame
