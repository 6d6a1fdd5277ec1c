"""Trace loading and metrics, on the three real reference traces and on small synthetic ones."""
import gzip
import json
import time
from pathlib import Path

import pandas as pd
import pytest

from nbaccel.analysis import (
    TraceError,
    achieved_flops,
    busy_time,
    category_breakdown,
    communication_share,
    load_trace,
    op_table,
    summary,
    tensor_core_share,
)

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
H100 = "tracelens_h100_Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"
A100 = "hta_a100_negative_queue_length_values_check_rank0.json.gz"
B200 = "tracelens_b200_eager_trace.json.gz"

_cache = {}


def _real(name):
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"reference trace not found at {path} (CI keeps a copy of shared/ at ../shared)")
    if name not in _cache:
        t0 = time.perf_counter()
        trace = load_trace(path)
        elapsed = time.perf_counter() - t0
        print(f"\nloaded {name}: {elapsed:.2f} s, {len(trace.ops)} ops, {len(trace.kernels)} kernels")
        _cache[name] = (trace, elapsed)
    return _cache[name]


@pytest.fixture(params=[H100, A100, B200], ids=["h100", "a100", "b200"])
def any_real(request):
    return _real(request.param)


def test_load_time_is_reasonable(any_real):
    trace, elapsed = any_real
    assert elapsed < 30, f"loading took {elapsed:.1f} s"
    assert len(trace.ops) and len(trace.kernels)
    assert not trace.unknown_events  # every kind in these traces is recognised


# Ground truth from shared/data/traces/README.md (summed kernel dur, no overlap handling).
@pytest.mark.parametrize(
    "name, total_us, tc_us, share_pct",
    [(H100, 45432.7, 16645.4, 36.64), (A100, 401445.0, 119020.0, 29.65), (B200, 10862.9, 6485.4, 59.70)],
)
def test_tensor_core_share_matches_readme(name, total_us, tc_us, share_pct):
    trace, _ = _real(name)
    tc = tensor_core_share(trace)
    assert tc.total_us == pytest.approx(total_us, abs=0.05)
    assert tc.part_us == pytest.approx(tc_us, abs=0.05)
    assert round(tc.percent, 2) == share_pct
    assert tc.reason is None


def test_unknown_tensor_core_kernels_reported_separately():
    trace, _ = _real(A100)
    tc = tensor_core_share(trace)
    # README: 81 old-style triton__0d1d2d... kernel events, 7,072 us, unlabelled
    assert tc.unknown_us == pytest.approx(7072.0)
    assert all(n.startswith("triton__") for n in tc.unknown_kernels)
    assert int(trace.kernels["tensor_cores"].isna().sum()) == 81
    assert tensor_core_share(_real(H100)[0]).unknown_us == 0


def test_communication_share():
    a100, _ = _real(A100)
    comm = communication_share(a100)
    assert round(comm.percent, 1) == 47.4  # ncclKernel_SendRecv: 190,345 us of 401,445 us
    assert comm.part_us == pytest.approx(190345.0)
    assert communication_share(_real(H100)[0]).value == 0.0
    b200 = communication_share(_real(B200)[0])
    assert b200.part_us > 2119.5  # multimem_all_reduce (2,119.5 us) + NCCL all-gather
    assert 0.19 < b200.value < 0.21


def test_metadata_and_device_properties():
    a100, _ = _real(A100)
    assert (a100.rank, a100.world_size) == (0, 16)
    assert a100.device_name(0) == "NVIDIA A100-SXM4-80GB"
    b200, _ = _real(B200)
    assert (b200.rank, b200.world_size) == (0, 8)
    h100, _ = _real(H100)
    assert h100.world_size is None
    assert h100.device_name() == "NVIDIA H100 80GB HBM3"
    assert h100.metadata["cuda_runtime_version"] == 12040


def test_kernel_to_op_linking():
    h100, _ = _real(H100)
    k = h100.kernels
    # README: 436 of 1,465 kernels have no External id and no cuda_runtime launch
    assert int((k["op_index"] < 0).sum()) == 436
    assert set(k.loc[k["op_index"] >= 0, "link"]) == {"external_id"}
    flash = k[k["name"].str.contains("flash_fwd_kernel") & (k["op_index"] >= 0)]
    assert len(flash) == 24  # one per aten::_flash_attention_forward call in the window
    assert set(flash["op_name"]) == {"aten::_flash_attention_forward"}
    # A100: kernel External id is a copy of the correlation id, so linking goes via cuda_runtime
    a100, _ = _real(A100)
    ka = a100.kernels
    linked = ka[ka["op_index"] >= 0]
    assert set(linked["link"]) == {"correlation"}
    assert len(linked) > 5000
    mm = ka[ka["op_name"] == "aten::mm"]
    assert len(mm) and mm["tensor_cores"].eq(True).any()


def test_memcpy_and_memset_frames():
    a100, _ = _real(A100)
    assert a100.memcpy["kind"].value_counts().to_dict() == {"DtoD": 1280, "HtoD": 80, "DtoH": 30}
    assert len(a100.memset) == 277
    h100, _ = _real(H100)
    assert h100.memcpy["kind"].tolist() == ["DtoH"]
    assert set(h100.memcpy.columns) >= {"name", "device", "stream", "ts_us", "dur_us", "bytes", "kind", "op_name"}


def test_self_time_never_exceeds_duration(any_real):
    trace, _ = any_real
    ops = trace.ops
    assert (ops["self_us"] <= ops["dur_us"] + 1e-6).all()
    assert (ops["self_us"] >= 0).all()
    # ops with children: self strictly smaller
    parents = set(ops.loc[ops["parent"] >= 0, "parent"])
    row = ops.loc[sorted(parents)[0]]
    assert row["self_us"] < row["dur_us"]


def test_busy_time_single_stream_equals_sum():
    h100, _ = _real(H100)
    bt = busy_time(h100)
    assert len(bt) == 1
    # one stream: activities cannot overlap, so the union equals the plain sum
    assert bt.loc[0, "busy_us"] == pytest.approx(bt.loc[0, "activity_us"], rel=1e-6)
    assert 0 < bt.loc[0, "idle_fraction"] < 1
    a100, _ = _real(A100)
    per_stream = busy_time(a100, by="stream")
    per_device = busy_time(a100)
    assert len(per_stream) == 6  # kernel streams 7, 27, 84, 285, 363 + memcpy stream 25
    # overlapping streams: device busy time is less than the sum over streams
    assert per_device.loc[0, "busy_us"] < per_stream["busy_us"].sum()


def test_category_breakdown_sums_to_100(any_real):
    trace, _ = any_real
    cb = category_breakdown(trace)
    assert cb["percent"].sum() == pytest.approx(100.0)
    kern = category_breakdown(trace, include_memory=False)
    assert kern["time_us"].sum() == pytest.approx(trace.kernels["dur_us"].sum())


def test_op_table_and_flops_h100():
    h100, _ = _real(H100)
    table = op_table(h100)
    row = table.set_index("name")
    assert row.loc["aten::mm", "calls"] == 96
    assert row.loc["aten::addmm", "calls"] == 72
    assert row.loc["aten::linear", "calls"] == 168
    # every aten::addmm in this trace is [8944,1024] x [1024,1024]
    assert row.loc["aten::addmm", "flops"] == 72 * 2 * 8944 * 1024 * 1024
    assert row.loc["aten::addmm", "dtype"] == "bf16"
    assert row.loc["aten::addmm", "device_self_us"] > 0
    assert row.loc["aten::linear", "device_total_us"] >= row.loc["aten::addmm", "device_total_us"]
    fl = achieved_flops(h100)
    # counted once: leaf ops only (linear/matmul/sdpa wrappers are not added again)
    leaves = ["aten::mm", "aten::addmm", "aten::bmm", "aten::_flash_attention_forward"]
    assert fl.flops == pytest.approx(row.loc[leaves, "flops"].sum())
    assert fl.dominant_dtype == "bf16"
    assert fl.gpu.gpu == "H100 SXM"
    assert fl.peak_flops_per_s == pytest.approx(989.4e12)
    assert 0 < fl.fraction_of_peak < fl.matmul_fraction_of_peak < 1
    assert fl.peak_source and "Lightning" in fl.peak_source


def test_op_table_of_a_cpu_trace_puts_the_slowest_ops_first():
    """A CPU-only trace has no device time: sorted by it (the old default), the rows came out in
    first-seen order and op_table(t, top=N) could leave out the slowest ops (a user trial)."""
    doc = {"traceEvents": [_op("aten::t", 0, 5, 1), _op("aten::expand", 10, 3, 2), _op("aten::addmm", 20, 400, 3),
                           _op("aten::relu", 500, 50, 4)]}
    trace = load_trace(doc)
    assert not trace.has_device_activity
    assert op_table(trace, top=2)["name"].tolist() == ["aten::addmm", "aten::relu"]
    assert op_table(trace)["cpu_self_us"].tolist() == [400, 50, 5, 3]
    # an explicit sort is still the user's
    assert op_table(trace, sort_by="device_self_us")["name"].tolist()[:2] == ["aten::t", "aten::expand"]
    h100, _ = _real(H100)  # with device time the default stays the device's
    assert op_table(h100, top=5)["device_self_us"].is_monotonic_decreasing


def test_fp32_ops_on_tensor_cores_count_as_tf32():
    a100, _ = _real(A100)
    fl = achieved_flops(a100)
    assert fl.gpu.gpu == "A100 SXM4 80GB"
    assert fl.dominant_dtype == "tf32"  # fp32 aten::mm running cutlass s1688 (TF32) kernels
    assert fl.peak_flops_per_s == pytest.approx(156e12)


def test_summary_is_json_safe(any_real):
    trace, _ = any_real
    s = summary(trace)
    json.dumps(s)
    assert s["kernels"] == len(trace.kernels)


# --- synthetic traces ------------------------------------------------------------------------

def _op(name, ts, dur, ext, tid=1, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": ext, **args}}


def _kernel(name, ts, dur, corr, ext=None, stream=7):
    args = {"device": 0, "stream": stream, "correlation": corr}
    if ext is not None:
        args["External id"] = ext
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


SYNTHETIC = {
    "schemaVersion": 1,
    "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "computeMajor": 9, "computeMinor": 0,
                          "totalGlobalMem": 150_000_000_000}],
    "distributedInfo": {"backend": "nccl", "rank": 3, "world_size": 4},
    "traceEvents": [
        _op("aten::linear", 0, 100, 1, **{"Input Dims": [[8, 16], [32, 16], [32]],
                                          "Input type": ["c10::BFloat16"] * 3}),
        _op("aten::addmm", 10, 30, 2, **{"Input Dims": [[32], [8, 16], [16, 32], [], []],
                                         "Input type": ["c10::BFloat16"] * 3 + ["Scalar"] * 2}),
        _op("aten::empty", 20, 10, 3),
        _op("aten::relu", 50, 10, 4),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 25,
         "dur": 2, "args": {"correlation": 101}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": 55,
         "dur": 2, "args": {"correlation": 102, "External id": 4}},
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_cublas",
                100, 10, 100, ext=2),
        _kernel("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)",
                105, 15, 101, ext=101, stream=8),  # old-Kineto style: External id == correlation
        _kernel("triton__0d1d2d", 200, 10, 999),  # no launch record at all
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7,
         "ts": 115, "dur": 3, "args": {"device": 0, "stream": 7, "correlation": 102, "bytes": 64}},
        {"ph": "X", "cat": "mystery_kind", "name": "?", "pid": 1, "tid": 1, "ts": 0, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::broken", "pid": 1, "tid": 1},  # no ts/dur
        "not an event",
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
        {"ph": "f", "cat": "ac2g", "id": 100, "pid": 0, "tid": 7, "ts": 100},
    ],
}


@pytest.fixture
def synthetic():
    return load_trace(json.loads(json.dumps(SYNTHETIC)))


def test_synthetic_nesting_and_self_time(synthetic):
    ops = synthetic.ops.set_index("name")
    assert ops.loc["aten::linear", "self_us"] == 100 - 30 - 10
    assert ops.loc["aten::addmm", "self_us"] == 30 - 10
    assert ops.loc["aten::empty", "self_us"] == 10
    names = synthetic.ops["name"].tolist()
    assert synthetic.ops.loc[names.index("aten::empty"), "parent"] == names.index("aten::addmm")


def test_synthetic_linking(synthetic):
    k = synthetic.kernels.set_index("correlation")
    assert k.loc[100, "op_name"] == "aten::addmm" and k.loc[100, "link"] == "external_id"
    # External id == correlation names no op: fall back to the innermost op around the launch
    assert k.loc[101, "op_name"] == "aten::empty" and k.loc[101, "link"] == "correlation"
    assert k.loc[999, "op_index"] == -1 and pd.isna(k.loc[999, "op_name"])
    assert synthetic.memcpy.loc[0, "op_name"] == "aten::relu"
    assert synthetic.memcpy.loc[0, "kind"] == "HtoD"


def test_synthetic_unknown_events_are_counted_not_fatal(synthetic):
    assert synthetic.unknown_events["mystery_kind"] == 1
    assert synthetic.unknown_events["cpu_op without ts/dur"] == 1
    assert synthetic.unknown_events["<not an object>"] == 1
    assert "ac2g" not in synthetic.unknown_events


def test_synthetic_metrics(synthetic):
    bt = busy_time(synthetic)
    # union of [100,110], [105,120], [115,118], [200,210] = 30 us over the window [0, 210]
    assert bt.loc[0, "busy_us"] == pytest.approx(30)
    assert bt.loc[0, "idle_fraction"] == pytest.approx(1 - 30 / 210)
    tc = tensor_core_share(synthetic)
    assert tc.value == pytest.approx(10 / 35)
    assert tc.unknown_us == 10
    fl = achieved_flops(synthetic)
    assert fl.flops == 2 * 8 * 16 * 32  # addmm counted, linear (its parent) not again
    assert fl.gpu.gpu == "H200 SXM"
    assert fl.peak_flops_per_s == pytest.approx(989e12)
    assert fl.flops_per_s == pytest.approx(fl.flops / 30e-6)
    assert (synthetic.rank, synthetic.world_size) == (3, 4)


def test_old_kineto_category_names():
    doc = {"traceEvents": [
        {"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 10,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 2, "dur": 1,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "Kernel", "name": "volta_sgemm_128x64_nn", "pid": 0, "tid": 7, "ts": 20,
         "dur": 4, "args": {"device": 0, "stream": 7, "correlation": 5}},
    ]}
    trace = load_trace(doc)
    assert trace.kernels.loc[0, "op_name"] == "aten::mm"
    assert trace.kernels.loc[0, "tensor_cores"] is False
    assert tensor_core_share(trace).value == 0.0


# --- bad input -------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such file") as exc:
        load_trace(tmp_path / "nope.json")
    assert "nope.json" in str(exc.value)


def test_not_json(tmp_path):
    p = tmp_path / "notes.json"
    p.write_text("this is not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(p)
    e = tmp_path / "empty.json"
    e.write_text("")
    with pytest.raises(TraceError, match="empty"):
        load_trace(e)


def test_json_that_is_not_a_trace(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"lr": 0.1, "epochs": 3}))
    with pytest.raises(TraceError, match="not a torch.profiler trace") as exc:
        load_trace(p)
    assert "config.json" in str(exc.value)
    with pytest.raises(TraceError, match="not a torch.profiler trace"):
        load_trace([1, 2, 3])
    with pytest.raises(TraceError):
        load_trace(42)


def test_truncated_gzip(tmp_path):
    blob = gzip.compress(json.dumps(SYNTHETIC).encode())
    p = tmp_path / "cut.json.gz"
    p.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TraceError, match="truncated or corrupt gzip") as exc:
        load_trace(p)
    assert "cut.json.gz" in str(exc.value)
    # a complete gzip without the .gz suffix still loads (detected by magic bytes)
    q = tmp_path / "whole.json"
    q.write_bytes(blob)
    assert len(load_trace(q).kernels) == 3


def test_trace_error_is_a_value_error():
    assert issubclass(TraceError, ValueError)


# --- the profiler on this machine --------------------------------------------------------------

def test_cpu_only_torch_profiler_trace(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
    x = torch.randn(2, 3, 16, 16)
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        conv(x)
        torch.mm(a, b)
    path = tmp_path / "cpu_trace.json"
    prof.export_chrome_trace(str(path))

    trace = load_trace(path)
    assert len(trace.ops) > 0 and len(trace.kernels) == 0
    assert not trace.has_device_activity
    tc = tensor_core_share(trace)
    assert tc.value is None and "no GPU kernels" in tc.reason
    assert communication_share(trace).value is None
    assert busy_time(trace).empty and category_breakdown(trace).empty
    table = op_table(trace).set_index("name")
    assert table.loc["aten::mm", "flops"] == 2 * 4 * 5 * 6
    assert table.loc["aten::conv2d", "flops"] == 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3
    assert table.loc["aten::conv2d", "category"] == "matmul/conv"
    fl = achieved_flops(trace)
    assert fl.flops == 2 * 4 * 5 * 6 + 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3  # conv counted once
    assert fl.flops_per_s is None and fl.time_base == "cpu" and fl.matmul_flops_per_s > 0
    assert fl.reason and "no GPU activity" in fl.reason
    json.dumps(summary(trace))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_operand_gives_no_flops_and_no_shapes_to_pad(tmp_path):
    """A user trial: a 2000x2000 sparse matrix with 2000 nonzeros times a dense 2000x64 one was counted as
    a dense matmul (1.02 GFLOP, "1.09 TFLOP/s" on a 2-core CPU), and its sparse 4x4 operand was given
    padding advice. The profiler records a sparse operand's dims but no strides: that marks it."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    n = 2000
    sp = torch.sparse_coo_tensor(torch.stack([torch.arange(n), torch.randperm(n)]), torch.randn(n), (n, n),
                                 check_invariants=True)
    sp, d, a = sp.coalesce(), torch.randn(n, 64), torch.randn(4, 5)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.sparse.mm(sp, d)
        sp.to_sparse_csr() @ d
        torch.mm(a, a.T)  # dense: counted
    path = tmp_path / "sparse.json"
    prof.export_chrome_trace(str(path))
    trace = load_trace(path)
    ops = trace.op_columns
    sparse = {name for name, flag in zip(ops["name"], ops["non_strided"]) if flag}
    assert {"aten::_sparse_mm", "aten::addmm"} <= sparse and "aten::mm" in ops["name"]
    assert achieved_flops(trace).flops == 2 * 4 * 5 * 4  # the dense mm alone
    assert all(f is None for f, flag in zip(ops["flops"], ops["non_strided"]) if flag)


def test_grad_clippings_foreach_kernels_are_not_the_optimizers():
    """clip_grad_norm_ on CUDA runs multi_tensor_apply_kernel, the foreach optimizers' kernel, for its norms
    (_foreach_norm) and scaling (_foreach_mul_): the device breakdown filed them under "optimizer". Outside an
    Optimizer.step range they take their op's category; the step's own foreach kernels stay the optimizer's."""
    norm = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous "
            "namespace)::NormType)1, float, 1, 1, 0>, float*, int>(T1, T2, T3...)")
    scale = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
             "TensorListMetadata<1>, at::native::(anonymous namespace)::BinaryOpScalarTensorFunctor<float, 1, 1, 0>, "
             "std::multiplies<float>, float*>(T1, T2, T3...)")
    update = scale.replace("TensorListMetadata<1>", "TensorListMetadata<2>").replace("multiplies", "plus")

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts,
                "dur": 2, "args": {"correlation": corr}}

    events = [
        _op("aten::_foreach_norm", 0, 10, 1), launch(1, 11), _kernel(norm, 100, 50, 11),
        _op("aten::_foreach_mul_", 20, 10, 2), launch(21, 12), _kernel(scale, 200, 30, 12),
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "pid": 1, "tid": 1, "ts": 40,
         "dur": 30, "args": {}},
        _op("aten::_foreach_add_", 45, 10, 3), launch(46, 13), _kernel(update, 300, 20, 13),
    ]
    trace = load_trace({"traceEvents": events})
    assert list(trace.kernels["category"]) == ["reduction", "elementwise", "optimizer"]
    frame = category_breakdown(trace)
    assert dict(zip(frame["category"], frame["time_us"])) == {"reduction": 50, "elementwise": 30, "optimizer": 20}
