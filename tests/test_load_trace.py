"""nbaccel.load_trace and %profile_trace: real H100/A100/B200 traces, multi-rank folders, bad input.

The reference traces live in ../shared/data/traces (CI keeps shared/ at ../shared); tests that
need them skip with the path they looked at. Multi-rank and step folders are written to tmp_path
from a real trace (rank 1 = rank 0 with every time stretched) or from the benchmark's generator.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import warnings
import re
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError

import nbaccel
from nbaccel import trace_io
from nbaccel.profile import ProfileResult
from nbaccel.trace_io import write_step_traces
from nbaccel.render import display as display_module
from nbaccel.render import multirank as render_multirank
from nbaccel.render import profile as render_profile
from nbaccel.trace_result import MultiRankResult, TraceError, load_trace
from widget_helpers import control, first_column, ops_table, walk
from text_helpers import note_lines, unfolded

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TRACES = SHARED / "traces"
H100 = "tracelens_h100_Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"
A100 = "hta_a100_negative_queue_length_values_check_rank0.json.gz"
B200 = "tracelens_b200_eager_trace.json.gz"

_cache: dict = {}


def real_path(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"reference trace not found at {path} (CI keeps a copy of shared/ at ../shared)")
    return path


def real(name: str) -> ProfileResult:
    if name not in _cache:
        _cache[name] = load_trace(real_path(name))
    return _cache[name]


def labels() -> dict[str, bool]:
    path = SHARED / "cuda_kernel_names.csv"
    if not path.exists():
        pytest.skip(f"kernel labels not found at {path}")
    with open(path, newline="") as fh:
        return {row["kernel_name"]: row["uses_tensor_cores"] == "yes" for row in csv.DictReader(fh)}


# --- one real trace through the API ------------------------------------------------------------------


@pytest.mark.parametrize("name, gpu, ops, kernels, rank", [
    (H100, "NVIDIA H100 80GB HBM3", 4186, 1465, None),
    (A100, "NVIDIA A100-SXM4-80GB", 25185, 6080, 0),
    (B200, "NVIDIA B200", 4809, 768, 0),
])
def test_real_trace_is_a_profile_result_that_says_it_was_loaded(name, gpu, ops, kernels, rank):
    r = real(name)
    assert isinstance(r, ProfileResult) and r.kind == "profile"
    assert r.op_count == ops and r.kernel_count == kernels
    assert r.device.name == gpu and r.device.type == "cuda"
    assert r.loaded["rank"] == rank and r.loaded["unknown_event_count"] == 0
    text = str(r)
    first = text.splitlines()[0]
    assert f"loaded trace {name}" in first and gpu in first and "not a live run" in first
    assert "%%profile_gpu" not in first  # a loaded trace is never presented as a live run
    if rank is not None:
        assert f"rank {rank} of {r.trace.world_size}" in first
    assert "loaded trace" in r._repr_html_()
    assert json.loads(json.dumps(r.to_dict(), allow_nan=False))["loaded"]["gpu"] == gpu


@pytest.mark.parametrize("name", [H100, A100, B200])
def test_tensor_core_share_matches_the_labelled_kernel_names(name):
    r = real(name)
    known = labels()
    k = r.trace.kernels
    # Ground truth straight from the CSV labels: kernel time of names labelled "yes" over all kernel time.
    by_csv = k.loc[k["name"].map(lambda n: known.get(n) is True), "dur_us"].sum() / k["dur_us"].sum()
    assert r.tensor_cores.value == pytest.approx(by_csv, abs=1e-9)
    expected = {H100: 0.3664, A100: 0.2965, B200: 0.5970}[name]  # shared/data/traces/README.md
    assert r.tensor_cores.value == pytest.approx(expected, abs=5e-5)
    kernels = r.kernels
    assert int(kernels["calls"].sum()) == r.kernel_count
    labelled = kernels[kernels["name"].isin(known)]
    assert (labelled["tensor_cores"] == labelled["name"].map(known)).all()


def test_h100_operator_table_flops_and_peak():
    r = load_trace(real_path(H100), shapes=True)
    ops = r.table(group="op")
    calls = dict(zip(ops["name"], ops["calls"]))
    assert calls["aten::mm"] == 96 and calls["aten::addmm"] == 72 and calls["aten::_flash_attention_forward"] == 24
    assert ops.iloc[0]["device_self_us"] == ops["device_self_us"].max()  # default sort: device time
    t = r.table(group="op+shape")
    row = lambda name, shapes: t[(t["name"] == name) & (t["shapes"] == shapes)].iloc[0]  # noqa: E731
    # Hand-computed: 2*M*K*N for a GEMM; 4*B*H*S*S*D for flash attention (B, S, H, D layout).
    cases = [
        (row("aten::mm", "8944x1024, 1024x2816"), 48, 2 * 8944 * 1024 * 2816),
        (row("aten::addmm", "1024, 8944x1024, 1024x1024, -, -"), 72, 2 * 8944 * 1024 * 1024),
        (row("aten::_flash_attention_forward", "16x559x16x64, 16x559x16x64, 16x559x16x64, -, -, -, -, -, -, -, -, -, "
                                               "-, -, -"), 24, 4 * 16 * 16 * 559 * 559 * 64),
    ]
    for r_, calls_, per_call in cases:
        assert r_["calls"] == calls_
        assert r_["flops"] == calls_ * per_call
        assert r_["flops_per_s"] == pytest.approx(calls_ * per_call / (r_["device_total_us"] * 1e-6))
    assert cases[0][0]["flops_per_s"] == pytest.approx(6.105e14, rel=1e-3)  # 610 TFLOP/s on 4.06 ms
    h = r.header
    assert h["dominant_dtype"] == "bf16" and h["peak_flops_per_s"] == pytest.approx(989.4e12)
    assert h["fraction_of_peak"] == pytest.approx(h["flops_per_s"] / 989.4e12)
    assert h["step_times_us"] == [pytest.approx(47151.395)] and h["steps"] == 1


@pytest.mark.parametrize("name", [H100, A100, B200, "h200"])
def test_the_flops_column_sums_to_the_header_in_every_grouping(name):
    # aten::linear / aten::matmul rows once repeated their aten::addmm / aten::mm children's FLOPs:
    # sorted by FLOPs the column summed to more than the step did. Each op's own FLOPs now.
    r = load_trace(Path(__file__).parent / "data" / "h200_bf16_transformer_step.json.gz") if name == "h200" \
        else real(name)
    for group in ("op", "op+shape"):  # (recorded without stacks: group="source" is refused, test_option_spelling)
        assert r.table(group=group)["flops"].sum() == pytest.approx(r.header["flops"], rel=1e-12), group
    by_name = r.table(group="op").set_index("name")["flops"]
    if "aten::linear" in by_name:
        assert by_name["aten::linear"] != by_name["aten::linear"]  # NaN: its addmm / mm carry them


def test_a100_communication_share_and_streams():
    r = real(A100)
    assert r.communication.percent == pytest.approx(47.41, abs=0.01)
    assert "Communication (NCCL / all-reduce) share of kernel time: 47.4%" in str(r)
    streams = r.streams
    assert len(streams) > 1 and (streams["busy_us"] <= streams["window_us"]).all()
    assert r.header["peak_flops_per_s"] == pytest.approx(156e12)  # TF32: the fp32 GEMMs ran on Tensor Cores


def test_kernels_keep_their_launching_op():
    r = real(H100)
    k = r.trace.kernels
    gemm = k[k["name"].str.startswith("sm90_xmma_gemm")]
    assert set(gemm["op_name"].dropna()) <= {"aten::mm", "aten::addmm", "aten::bmm"}
    assert (k["op_index"] < 0).sum() == 436  # queued before the window (traces README)


# --- the streaming reader ------------------------------------------------------------------------


def test_streaming_gives_the_same_trace_at_every_chunk_boundary(tmp_path, monkeypatch):
    """Events and header keys cut at every possible place by the read chunk must decode the same."""
    events = [{"ph": "X", "cat": "cpu_op", "name": f"aten::mm{i}", "pid": 1, "tid": 1, "ts": 10.0 * i, "dur": 5.5,
               "args": {"External id": i, "Input Dims": [[4, 8], [8, 16]], "Input type": ["float", "float"]}}
              for i in range(6)]
    events.append({"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7, "ts": 12.0,
                   "dur": 3.25, "args": {"device": 0, "stream": 7, "correlation": 99, "External id": 2}})
    doc = {"schemaVersion": 1, "traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB",
           "computeMajor": 8, "computeMinor": 0, "totalGlobalMem": 84990623744}], "baseTimeNanoseconds": 123456789012}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=1))
    reference = load_trace(path)
    for chunk in (1, 2, 3, 7, 64):
        monkeypatch.setattr(trace_io, "_CHUNK", chunk)
        stream = trace_io.TraceStream(path)
        assert list(stream.events()) == events
        assert stream.header == {k: v for k, v in doc.items() if k != "traceEvents"}
    r = load_trace(path)
    assert r.op_count == reference.op_count == 6 and r.kernel_count == 1
    assert r.device.name == "NVIDIA A100-SXM4-80GB"  # deviceProperties written after the events
    assert r.trace.kernels.iloc[0]["op_name"] == "aten::mm2"


def test_gzip_and_plain_json_load_the_same(tmp_path):
    src = real_path(H100)
    plain = tmp_path / "h100.json"
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    a, b = load_trace(plain), real(H100)
    assert a.op_count == b.op_count and a.kernel_count == b.kernel_count
    assert a.tensor_cores.value == b.tensor_cores.value
    # Export of a loaded trace copies its file (the parsed document is not kept in memory).
    out = a.export_chrome_trace(str(tmp_path / "again.json.gz"))
    assert load_trace(out).op_count == a.op_count


def test_unknown_event_kinds_are_counted_and_shown(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 0, "dur": 4, "args": {}},
              {"ph": "X", "cat": "quantum_flux", "name": "x", "pid": 1, "tid": 1, "ts": 1, "dur": 1},
              {"ph": "X", "cat": "quantum_flux", "name": "y", "pid": 1, "tid": 1, "ts": 2, "dur": 1},
              "not an event"]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = load_trace(path)
    assert r.trace.unknown_events == {"quantum_flux": 2, "<not an object>": 1}
    assert r.header["unknown_events"] == 3
    assert "skipped: 3 events of unknown kinds (quantum_flux" in str(r)
    assert r.device.type == "cpu" and "a CPU-only trace" in str(r)


# --- folders: steps of one rank, several ranks -------------------------------------------------------


def test_step_files_of_one_rank_load_as_one_trace_with_its_steps(tmp_path):
    from benchmarks.bench_trace import make_trace

    single = tmp_path / "whole.json"
    make_trace(str(single), target_mb=1.5)
    whole = load_trace(single)
    doc = json.loads(single.read_text())
    folder = tmp_path / "steps"
    files = write_step_traces(doc, str(folder))  # what %%profile_gpu --trace DIR writes
    assert len(files) == len(whole.step_times_us) >= 2
    r = load_trace(folder)
    assert isinstance(r, ProfileResult)
    assert r.step_times_us == whole.step_times_us
    assert r.kernel_count == whole.kernel_count and r.op_count == whole.op_count
    assert r.tensor_cores.value == pytest.approx(whole.tensor_cores.value)
    assert f"({len(files)} step files)" in str(r).splitlines()[0]


def _stretched(doc: dict, factor: float, rank: int, **dist_info) -> dict:
    """A copy of ``doc`` as another rank that is ``factor`` times slower in everything (``dist_info``:
    more distributedInfo keys)."""
    t0 = min(e["ts"] for e in doc["traceEvents"] if "ts" in e)
    events = []
    for e in doc["traceEvents"]:
        e = dict(e)
        if "ts" in e:
            e["ts"] = t0 + (e["ts"] - t0) * factor
        if "dur" in e:
            e["dur"] = e["dur"] * factor
        events.append(e)
    return {**doc, "traceEvents": events,
            "distributedInfo": {**doc.get("distributedInfo", {}), "rank": rank, **dist_info}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """rank-0.json.gz = the real A100 trace; rank-1.json.gz = the same, 25 % slower."""
    src = real_path(A100)
    folder = tmp_path_factory.mktemp("job")
    (folder / "rank-0.json.gz").write_bytes(src.read_bytes())
    doc = json.loads(gzip.decompress(src.read_bytes()))
    with gzip.open(folder / "rank-1.json.gz", "wt", compresslevel=1) as fh:
        json.dump(_stretched(doc, 1.25, 1), fh)
    return folder, load_trace(folder)


def test_two_rank_folder_names_the_straggler(two_ranks):
    folder, r = two_ranks
    assert isinstance(r, MultiRankResult) and r.kind == "multirank"
    assert list(r.ranks) == [0, 1] and r.world_size == 16
    s = r.straggler
    assert s["rank"] == 1 and s["fastest_rank"] == 0 and s["most_compute_rank"] == 1
    assert s["excess_fraction"] == pytest.approx(0.25, abs=1e-6)
    pr = r.per_rank.set_index("rank")
    assert pr.loc[0, "steps"] == 5 and pr.loc[0, "step_basis"] == "mean ProfilerStep"
    assert pr.loc[1, "step_time_us"] == pytest.approx(1.25 * pr.loc[0, "step_time_us"])
    for rank in (0, 1):
        row = pr.loc[rank]
        assert row["compute_us"] + row["communication_us"] + row["idle_us"] == pytest.approx(row["span_us"])
        assert 0 < row["communication_us"] <= row["communication_kernel_us"]
    text = str(r)
    assert re.search(r"slowest rank: 1 -- step time .*\+25\.0%", unfolded(text))
    assert "2 ranks of world size 16 on NVIDIA A100-SXM4-80GB" in text and "not a live run" in text
    row = nbaccel.results_frame(r).iloc[0]  # a saved multi-rank result names its straggler
    assert (row["kind"], row["world_size"], row["straggler_rank"]) == ("multirank", 16, 1)
    assert row["excess_fraction"] == pytest.approx(0.25, abs=1e-6)
    merged = r.table()
    one = r.ranks[0].table()
    calls = dict(zip(merged["name"], merged["calls"]))
    assert calls["aten::mm"] == 2 * dict(zip(one["name"], one["calls"]))["aten::mm"]
    assert r.table(rank=1)["device_self_us"].sum() == pytest.approx(1.25 * one["device_self_us"].sum())
    data = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert data["straggler"]["rank"] == 1 and len(data["per_rank"]) == 2


def test_the_rank_tables_op_calls_are_each_ranks_header_and_table_calls(two_ranks):
    # The rank table's "ops" were op events (25,185 on A100 rank 0) beside a single-rank header
    # saying "op calls / kernels: 25,105 / ...": a re-dispatch is part of its parent's call.
    _, r = two_ranks
    pr = r.per_rank.set_index("rank")
    for k, one in r.ranks.items():
        assert pr.loc[k, "ops"] == r.table(rank=k)["calls"].sum() == one.header["ops"] == 25_105
        assert one.op_count == 25_185  # the events, nested re-dispatches included
    head, dashes, *rows = render_multirank.text(r).split("\n\n")[1].splitlines()
    assert head.split()[-2:] == ["op", "calls"] and rows[0].split()[-1] == "25,105"
    assert "<th class=\"\">op calls</th>" in r._repr_html_()


def _redispatch_trace(rank: int) -> str:
    """aten::matmul re-dispatched inside itself (as autocast does) around an aten::mm: 3 op events, 2 calls."""
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}
    return json.dumps({"distributedInfo": {"rank": rank, "world_size": 2},
                       "traceEvents": [op("aten::matmul", 0, 10), op("aten::matmul", 1, 8), op("aten::mm", 2, 5)]})


def test_a_re_dispatch_is_one_op_call_in_the_rank_table(tmp_path):
    for rank in (0, 1):
        _write(tmp_path / f"rank-{rank}.json", _redispatch_trace(rank))
    r = load_trace(tmp_path)
    for k, one in r.ranks.items():
        assert one.op_count == 3
        assert r.per_rank.set_index("rank").loc[k, "ops"] == r.table(rank=k)["calls"].sum() == one.header["ops"] == 2


def test_rank_option_loads_one_rank(two_ranks):
    folder, _ = two_ranks
    r = load_trace(folder, rank=1)
    assert isinstance(r, ProfileResult) and r.loaded["rank"] == 1
    with pytest.raises(TraceError, match=r"no trace of rank 7 in this folder \(ranks found: 0, 1\)"):
        load_trace(folder, rank=7)


def test_rank_option_on_a_folder_without_ranks_says_so(tmp_path):
    _write(tmp_path / "w.1.pt.trace.json", _op_trace("aten::add"))
    with pytest.raises(TraceError, match="its traces carry no rank .*load it without rank$"):
        load_trace(tmp_path, rank=5)


@pytest.mark.parametrize("path", [3, None, 10**30, b"x.json", ""])
def test_path_that_is_not_a_file_name_is_a_trace_error(path):
    with pytest.raises(TraceError, match=r"^path takes a trace file or a folder of them \(a str or pathlib\.Path\)"):
        load_trace(path)


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_special_file_is_a_trace_error():
    with pytest.raises(TraceError, match=r"^/dev/null: not a regular file or a folder"):
        load_trace("/dev/null")


@pytest.mark.parametrize("rank", ["1", 1.0, True, -1])
def test_rank_that_is_not_a_whole_number_is_refused(two_ranks, rank):
    from nbaccel.profile import ProfileError

    folder, _ = two_ranks
    with pytest.raises(ProfileError, match=r"^rank (takes a whole number|must be at least 0)"):
        load_trace(folder, rank=rank)


def test_stack_with_shapes_is_refused_when_loading_too(ip):
    # As for a live profile: two groupings of one table, and --shapes was silently dropped.
    from nbaccel.profile import ProfileError

    path = Path(__file__).parent / "data" / "h200_bf16_transformer_step.json.gz"
    with pytest.raises(ProfileError, match=r"^stack=True and shapes=True both choose how the table is grouped"):
        load_trace(path, stack=True, shapes=True)
    with pytest.raises(UsageError, match=r"^--stack and --shapes both choose how the table is grouped"):
        ip.run_line_magic("profile_trace", f"{path} --stack --shapes -q")


def test_rank_in_a_folder_without_readable_traces_names_the_files_error(tmp_path):
    (tmp_path / "a.json").write_text("not json")
    with pytest.raises(TraceError, match=r"a\.json: not (valid )?JSON") as info:
        load_trace(tmp_path, rank=0)
    assert "ranks found" not in str(info.value)


def test_cpu_only_ranks_name_no_compute_rank_and_read_well(tmp_path):
    # gloo DDP on the CPU: every rank's device compute is 0, so no rank "has the most compute time".
    for rank, dur in ((0, 10), (1, 30)):
        ev = {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": 0, "dur": dur}
        _write(tmp_path / f"rank-{rank}.json",
               json.dumps({"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": [ev]}))
    r = load_trace(tmp_path)
    assert r.straggler["most_compute_rank"] is None and r.straggler["least_communication_rank"] is None
    text = str(r)
    assert "most compute time" not in text and "no device activity in these traces" in text
    assert "2 ranks of world size 2 recorded on the CPU" in text and " on recorded" not in text
    # The empty split shows as "-", not as "idle 30 us (100%)" under the line saying it is empty.
    rank_lines = [line.split() for line in text.splitlines() if re.match(r"\s*[01]\s+1\s", line)]
    assert len(rank_lines) == 2 and all(line[5:8] == ["-", "-", "-"] for line in rank_lines), rank_lines
    assert "(100%)" not in r._repr_html_() and "idle 100.0%" not in r._repr_html_()
    with pytest.raises(LookupError, match=r"^no rank 7 in this result; ranks: 0, 1$") as info:
        r.table(rank=7)
    assert isinstance(info.value, TraceError) and not isinstance(info.value, KeyError)


def test_tensorboard_names_use_distributed_info(tmp_path):
    """tensorboard_trace_handler names carry no rank: it comes from distributedInfo, even when
    written after the events (as TraceLens writes its header)."""
    doc = json.loads(gzip.decompress(real_path(H100).read_bytes()))
    for rank, factor in ((0, 1.0), (1, 1.1)):
        d = _stretched(doc, factor, rank)
        d["distributedInfo"]["world_size"] = 2
        (tmp_path / f"host-a_{100 + rank}.1700000000{rank}.pt.trace.json").write_text(json.dumps(d))
    ident = trace_io.peek_identity(next(tmp_path.glob("*_101.*")))
    assert (ident.rank, ident.world_size) == (1, 2)
    r = load_trace(tmp_path)
    assert isinstance(r, MultiRankResult) and r.straggler["rank"] == 1
    assert r.straggler["excess_fraction"] == pytest.approx(0.10, abs=1e-6)


# --- through the magic -----------------------------------------------------------------------------


def test_magic_shows_a_loaded_trace(run_cell, ip):
    path = real_path(H100)
    _, captured = run_cell(f"%profile_trace {path} --top 3 -r tr")
    data = [o.data for o in captured.outputs if "text/html" in o.data][0]
    text = data["text/plain"]
    assert "loaded trace " + H100 in text and "NVIDIA H100 80GB HBM3" in text
    assert "top 3 of" in text and "Tensor Core share of kernel time: 36.6%" in text
    assert "989 TFLOP/s" in text  # the recorded GPU's bf16 peak
    tr = ip.user_ns["tr"]
    assert isinstance(tr, ProfileResult) and tr.options.top == 3


def test_gpu_shapes_list_keeps_its_rows_and_states_their_share():
    # A GPU trace's padding rows are tasks as they were (Tensor Cores take fp32 via TF32); each now says
    # its share of the device time, the order it is listed in.
    r = real(A100)
    lines = render_profile.unaligned_lines(r)
    assert lines[0] == ("aten::mm [64x4096, 4096x2798] x5 (732 µs, 0.2% of device time): N=2798 -> 2800 "
                        "(multiple of 8 for fp32)")
    assert len(lines) == 5 and all(line.endswith("(multiple of 8 for fp32)") for line in lines)


def test_magic_sort_and_quiet(run_cell, ip):
    path = real_path(B200)
    _, captured = run_cell(f"%profile_trace {path} --sort calls -q -r tr")
    assert not [o for o in captured.outputs if "text/html" in o.data]
    calls = ip.user_ns["tr"].ops["calls"].tolist()
    assert calls == sorted(calls, reverse=True)


def test_magic_multi_rank_folder(run_cell, ip, two_ranks):
    folder, _ = two_ranks
    _, captured = run_cell(f"%profile_trace {folder} -r job")
    text = [o.data for o in captured.outputs if "text/html" in o.data][0]["text/plain"]
    assert "slowest rank: 1" in text and isinstance(ip.user_ns["job"], MultiRankResult)
    run_cell(f"%profile_trace {folder} --rank 0 -q -r r0")
    assert ip.user_ns["r0"].loaded["rank"] == 0


def test_a_loaded_trace_names_what_loaded_it(tmp_path, run_cell, ip):
    # A user trial: load_trace(file).made_by said "profile()", and a folder's report was headed
    # "%profile_trace job/" from a plain script.
    single = _write(tmp_path / "step.json", _op_trace("aten::mm"))
    job = _mkdir(tmp_path / "job")
    for rank in (0, 1):
        _write(job / f"rank-{rank}.json", _op_trace("aten::add", distributedInfo={"rank": rank, "world_size": 2}))
    for path, head in ((single, "{}: loaded trace step.json -- "), (job, "{} job/ -- 2 ranks of world size 2")):
        api = load_trace(path)
        run_cell(f"%profile_trace {path} -q -r tr")
        magic = ip.user_ns["tr"]
        for result, made_by in ((api, "load_trace()"), (magic, "%profile_trace")):
            assert result.made_by == made_by and result.to_dict()["made_by"] == made_by
            assert str(result).startswith("nbaccel " + head.format(made_by))
            assert f"<h4>{head.format(made_by)}" in result._repr_html_()
            for one in getattr(result, "ranks", {}).values():
                assert one.made_by == made_by


def test_magic_help_is_accurate(ip):
    doc = ip.magics_manager.magics["line"]["profile_trace"].__doc__
    for option in ("PATH", "--top", "--sort", "--filter", "--shapes", "--stack", "--memory", "--rank", "--result",
                   "--quiet"):
        assert option in doc, option


# --- bad input ----------------------------------------------------------------------------------------


def _truncated_gz(tmp_path):
    data = gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": i,
                                                      "dur": 1, "pid": 1, "tid": 1} for i in range(2000)]}).encode())
    path = tmp_path / "cut.json.gz"
    path.write_bytes(data[: len(data) // 2])
    return path


BAD = {
    "missing": (lambda d: d / "nope.json", r"nope\.json: no such file"),
    "not json": (lambda d: _write(d / "notes.json", "hello, world"), r"notes\.json: not JSON text"),
    "binary": (lambda d: _write(d / "blob.json", b"\x00\xff\xfe\x01" * 10), r"blob\.json: not JSON text \(binary"),
    "empty": (lambda d: _write(d / "empty.json", ""), r"empty\.json: file is empty"),
    "not a trace": (lambda d: _write(d / "config.json", '{"lr": 0.1, "epochs": 3}'),
                    r"config\.json: JSON is not a torch.profiler trace \(no 'traceEvents' list; found epochs, lr\)"),
    "top-level number": (lambda d: _write(d / "n.json", "42"), r"n\.json: JSON is not a torch.profiler trace \(top"),
    "no profiler events": (lambda d: _write(d / "chrome.json", json.dumps({"traceEvents": [
        {"ph": "X", "cat": "blink", "name": "Paint", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]})),
        r"chrome\.json: JSON is not a torch.profiler trace \(no cpu_op or kernel events; found blink x1\)"),
    "truncated json": (lambda d: _write(d / "cut.json", '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "na'),
                       r"cut\.json: not valid JSON: Unterminated string starting at character 46 \(the file ends early"),
    "truncated gz": (_truncated_gz, r"cut\.json\.gz: truncated or corrupt gzip data"),
    "empty folder": (lambda d: _mkdir(d / "runs"), r"runs: no trace files \(\*\.json, \*\.json\.gz\) in this folder "
                                                   r"\(the folder is empty\)"),
    "folder of other files": (lambda d: _write(_mkdir(d / "logs") / "train.log", "x").parent,
                              r"logs: no trace files .*found: train\.log"),
    "tensorboard log folder": (lambda d: _write(_mkdir(_mkdir(d / "log") / "resnet18") / "w.1.pt.trace.json",
                                                _op_trace("aten::add")).parent.parent,
                               r"log: no trace files directly in this folder, but its subfolders resnet18 hold some "
                               r".*load one, e\.g\. .*log/resnet18$"),
}


def _write(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_trace_error_naming_the_file(tmp_path, case):
    make, message = BAD[case]
    path = make(tmp_path)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


@pytest.mark.parametrize("case", ["missing", "not a trace", "truncated gz", "empty folder"])
def test_bad_input_is_a_usage_error_from_the_magic(ip, tmp_path, case):
    make, message = BAD[case]
    path = make(tmp_path)
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("profile_trace", str(path))


def test_folder_mixing_ranked_and_unranked_files_is_refused(tmp_path):
    ev = {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 0, "dur": 1}
    _write(tmp_path / "rank-0.json", json.dumps({"traceEvents": [ev]}))
    _write(tmp_path / "mystery.json", json.dumps({"traceEvents": [ev]}))
    with pytest.raises(TraceError, match=r"cannot tell the rank of mystery\.json"):
        load_trace(tmp_path)


# --- a folder with some bad files: the good ones load, each bad one is a warning naming it -----------


def _op_trace(name: str, **header) -> str:
    ev = {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": 0, "dur": 1}
    return json.dumps({**header, "traceEvents": [ev]})


def _job_with_bad_files(folder: Path) -> Path:
    """rank-0 and rank-1 are good; notes.json is not JSON, config.json is JSON but not a trace,
    rank-2.json has a good start (its rank is known) but is cut off."""
    folder.mkdir()
    _write(folder / "rank-0.json", _op_trace("aten::add"))
    _write(folder / "rank-1.json", _op_trace("aten::mm"))
    _write(folder / "notes.json", "hello, world")
    _write(folder / "config.json", '{"lr": 0.1, "epochs": 3}')
    _write(folder / "rank-2.json", '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "na')
    return folder


BAD_IN_JOB = {
    "config.json": "JSON is not a torch.profiler trace (no 'traceEvents' list; found epochs, lr)",
    "notes.json": "not JSON text (starts with 'h')",
    "rank-2.json": "not valid JSON: ",
}


def test_folder_skips_bad_files_with_a_warning_naming_each(tmp_path):
    folder = _job_with_bad_files(tmp_path / "job")
    with pytest.warns(nbaccel.trace_result.TraceWarning) as caught:
        r = load_trace(folder)
    assert isinstance(r, MultiRankResult) and sorted(r.ranks) == [0, 1]
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 3
    for message, (name, why) in zip(messages, sorted(BAD_IN_JOB.items())):
        assert message.startswith(f"skipped {folder / name}: {why}"), message
        assert message.endswith("the folder's other trace files were loaded")
    assert sorted(r.skipped) == sorted(BAD_IN_JOB)
    assert r.skipped["rank-2.json"].endswith("(the file ends early: a trace cut off while writing looks like this)")
    assert r.to_dict()["skipped"] == r.skipped
    # the result says so too, not only the once-per-session warning
    assert "3 unreadable files in the folder: config.json (JSON is not a torch.profiler trace" in unfolded(r)
    assert "3 unreadable files in the folder" in r._repr_html_()


def test_step_folder_skips_a_bad_step_file(tmp_path):
    # Files without a rank are steps of one run: a broken one is left out of the chain.
    _write(tmp_path / "w.1.pt.trace.json", _op_trace("aten::add"))
    _write(tmp_path / "w.2.pt.trace.json", '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "na')
    _write(tmp_path / "w.3.pt.trace.json", _op_trace("aten::mm"))
    with pytest.warns(nbaccel.trace_result.TraceWarning, match=r"skipped .*w\.2\.pt\.trace\.json: not valid JSON"):
        r = load_trace(tmp_path)
    assert isinstance(r, ProfileResult)
    assert [Path(f).name for f in r.loaded["files"]] == ["w.1.pt.trace.json", "w.3.pt.trace.json"]
    assert sorted(r.ops["name"]) == ["aten::add", "aten::mm"]
    assert list(r.loaded["skipped"]) == ["w.2.pt.trace.json"]
    assert "not loaded: 1 unreadable file in the folder: w.2.pt.trace.json (not valid JSON" in str(r)


def test_folder_of_good_files_warns_nothing(tmp_path):
    _write(tmp_path / "rank-0.json", _op_trace("aten::add"))
    _write(tmp_path / "rank-1.json", _op_trace("aten::mm"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = load_trace(tmp_path)
    assert r.skipped == {}


def test_folder_with_no_loadable_file_is_an_error_listing_each(tmp_path):
    _write(tmp_path / "notes.json", "hello, world")
    _write(tmp_path / "rank-0.json", '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "na')
    with pytest.raises(TraceError, match=r"none of its 2 trace files could be loaded: .*notes\.json: not JSON text"
                                         r".*; .*rank-0\.json: not valid JSON"):
        load_trace(tmp_path)
    # One file that cannot be read: its own error, as for a single file.
    (tmp_path / "notes.json").unlink()
    with pytest.raises(TraceError, match=r"rank-0\.json: not valid JSON"):
        load_trace(tmp_path)


def test_rank_option_skips_a_bad_file_of_other_ranks(tmp_path):
    folder = _job_with_bad_files(tmp_path / "job")
    with pytest.warns(nbaccel.trace_result.TraceWarning):
        r = load_trace(folder, rank=1)
    assert isinstance(r, ProfileResult) and r.loaded["files"] == [str(folder / "rank-1.json")]
    with pytest.raises(TraceError, match=r"rank-2\.json: not valid JSON"):
        load_trace(folder, rank=2)


def test_magic_loads_the_good_files_and_says_which_were_skipped(run_cell, ip, tmp_path):
    folder = _job_with_bad_files(tmp_path / "job")
    for _ in range(2):  # said on every run, not once per session like a plain warning
        _, captured = run_cell(f"%profile_trace {folder} -r job")
        lines = [line for line in note_lines(captured.stderr) if line.startswith("Warning: skipped")]
        assert len(lines) == 3, captured.stderr
        for line, (name, why) in zip(sorted(lines), sorted(BAD_IN_JOB.items())):
            assert line.startswith(f"Warning: skipped {folder / name}: {why}"), line
        assert isinstance(ip.user_ns["job"], MultiRankResult) and sorted(ip.user_ns["job"].ranks) == [0, 1]
        assert [o for o in captured.outputs if "text/html" in o.data]


def test_magic_folder_with_no_loadable_file_is_a_usage_error(ip, tmp_path):
    _write(tmp_path / "notes.json", "hello, world")
    _write(tmp_path / "config.json", '{"lr": 0.1}')
    with pytest.raises(UsageError, match=r"none of its 2 trace files could be loaded"):
        ip.run_line_magic("profile_trace", str(tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    ({"top": 0}, "top must be at least 1"),
    ({"sort": "bogus"}, "is not a sort key"),
    ({"sort": "memory"}, "needs memory=True"),
])
def test_bad_options(kwargs, message):
    from nbaccel.profile import ProfileError

    with pytest.raises(ProfileError, match=message):
        load_trace(real_path(H100), **kwargs)


@pytest.mark.parametrize("line, message", [("", "the following arguments are required: PATH"),
                                           ("x.json --top 0", "--top must be at least 1"),
                                           ("x.json -r 1abc", "-r/--result takes a Python variable name"),
                                           ("'unclosed.json", "check the quotes")])
def test_bad_magic_lines(ip, line, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_line_magic("profile_trace", line)


# --- widgets page their tables ---------------------------------------------------------------------


def _rows(html: str) -> list[str]:
    return first_column(html)


def test_profile_widget_renders_one_page_at_a_time():
    r = load_trace(real_path(A100), top=15)
    box = render_profile.widget(r)
    tab = next(w for w in walk(box) if type(w).__name__ == "Tab")
    ops = ops_table(box)
    top = control(box, "IntSlider", "top K")
    size = control(box, "Dropdown", "rows/page")
    page = control(box, "BoundedIntText", "page")
    top.value = top.max  # every one of the 143 rows is in play ...
    assert top.value == len(r.grouped("op")) > 100
    size.value = 25
    first = _rows(ops.value)
    assert len(first) == 25  # ... but only one page is rendered
    assert page.max == -(-top.value // 25)
    page.value = 2
    second = _rows(ops.value)
    assert len(second) == 25 and not set(first) & set(second)
    assert second == r.table().iloc[25:50]["name"].tolist()
    page.value = page.max
    assert 0 < len(_rows(ops.value)) <= 25
    control(box, "Dropdown", "sort by").value = "calls"  # a new order starts at page 1
    assert page.value == 1 and _rows(ops.value)[0] == r.table(sort="calls").iloc[0]["name"]


def test_multirank_widget_switches_ranks_and_pages(two_ranks, monkeypatch):
    _, r = two_ranks
    box = render_multirank.widget(r)
    ranks = control(box, "Dropdown", "ranks")
    size = control(box, "Dropdown", "rows/page")
    ops = [w for w in walk(box) if type(w).__name__ == "HTML"][-2]
    size.value = 10
    merged = _rows(ops.value)
    assert len(merged) == 10 and merged == r.table().head(10)["name"].tolist()
    ranks.value = 1
    assert _rows(ops.value) == r.table(rank=1).head(10)["name"].tolist()
    header = [w for w in walk(box) if type(w).__name__ == "HTML"][0].value
    assert "slowest rank: 1" in header and "(slowest)" in header
    monkeypatch.setattr(display_module, "WIDGETS", "always")
    bundle = display_module.mime_bundle(r)
    assert {"text/plain", "text/html", "application/vnd.jupyter.widget-view+json"} <= set(bundle)


def test_filter_picks_the_table_rows_of_a_trace_and_of_merged_ranks(two_ranks, run_cell, ip):
    """%%profile_gpu took --filter, %profile_trace and load_trace did not: a job's few matmuls among 143 op rows
    were found by scrolling. The header's figures stay the whole trace's."""
    folder, whole = two_ranks
    wanted = "aten::(mm|addmm)"
    one = load_trace(folder / "rank-0.json.gz", filter=wanted, top=1)
    assert one.options.filter == wanted and str(one).count("matching 'aten::(mm|addmm)'") == 1
    assert re.search(r"top 1 of the 2 rows matching 'aten::\(mm\|addmm\)' \(\d+ in all\) by self device", str(one))
    job = load_trace(folder, filter=wanted)
    merged = whole.table(filter=wanted)
    assert len(merged) == 2 and set(merged["name"]) == {"aten::mm", "aten::addmm"}
    lines = render_multirank.text(job).splitlines()
    at = next(i for i, line in enumerate(lines) if "merged over" in line)
    assert lines[at] == (f"the 2 rows matching 'aten::(mm|addmm)' ({len(whole.ops)} in all) merged over 2 ranks by "
                         "self device (grouped by op):")
    assert [line.split()[0] for line in lines[at + 3:at + 5]] == list(merged["name"]) and lines[at + 5] == ""
    assert job.header == whole.header if hasattr(job, "header") else job.per_rank.equals(whole.per_rank)
    html = render_multirank.html(job)
    assert "<h4>the 2 rows matching &#x27;aten::(mm|addmm)&#x27;" in html and first_column(html)[-2:] == list(merged["name"])
    box = render_multirank.widget(job)
    assert control(box, "Text", "filter").value == wanted
    assert _rows([w for w in walk(box) if type(w).__name__ == "HTML"][-2].value) == list(merged["name"])
    nothing = render_multirank.text(load_trace(folder, filter="no such op"))
    assert f"no row of the {len(whole.ops)} (grouped by op) has a name or source line matching 'no such op'" in nothing
    assert "operator " not in nothing  # no table header over no rows
    run_cell(f"%profile_trace {folder} --filter mm -q -r job")
    assert ip.user_ns["job"].options.filter == "mm"
    with pytest.raises(nbaccel.ProfileError, match=r"^filter takes the text to look for in the names, got 3$"):
        load_trace(folder, filter=3)


def test_load_trace_is_exported():
    assert nbaccel.load_trace is load_trace and nbaccel.MultiRankResult is MultiRankResult


def test_kernel_names_are_classified_once_per_name(tmp_path):
    """A big trace repeats a few hundred kernel names tens of thousands of times; the Tensor Core
    classifier (a dozen regexes over names up to 1.8k chars) must run once per distinct name."""
    from nbaccel.analysis.kernels import op_category, uses_tensor_cores

    events = []
    for i in range(300):
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0 * i, "dur": 5,
                       "args": {"External id": i}})
        events.append({"ph": "X", "cat": "kernel", "name": f"ampere_sgemm_{i % 3}_nn", "pid": 0, "tid": 7,
                       "ts": 10.0 * i + 1, "dur": 2, "args": {"device": 0, "stream": 7, "External id": i,
                                                               "correlation": 10_000 + i}})
    path = tmp_path / "repeat.json"
    path.write_text(json.dumps({"traceEvents": events}))
    uses_tensor_cores.cache_clear()
    op_category.cache_clear()
    load_trace(path)
    assert uses_tensor_cores.cache_info().misses == 3
    assert op_category.cache_info().misses == 1


def _op_at(name: str, ts: float) -> str:  # one op event at time ts (µs)
    return json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts,
                                        "dur": 100}]})


def test_files_of_separate_runs_in_one_folder_are_flagged(tmp_path):
    # A new user's folder of unrelated traces was chained into one run: "wall time: 41.3 s".
    _write(tmp_path / "monday.json", _op_at("aten::add", 0))
    _write(tmp_path / "tuesday.json", _op_at("aten::mm", 86_400e6))
    with pytest.warns(nbaccel.trace_result.TraceWarning, match=r"its 2 files are up to 86,400\.0 s apart .*look like separate runs"):
        result = load_trace(tmp_path)
    assert "separate runs" in result.loaded["far_apart"]
    assert "warning: its 2 files are up to" in str(result)
    assert "(2 files)" in result.loaded["label"] and "step files" not in result.loaded["label"]


def test_step_files_of_one_run_are_not_flagged(tmp_path):
    _write(tmp_path / "w.1.pt.trace.json", _op_at("aten::add", 0))
    _write(tmp_path / "w.2.pt.trace.json", _op_at("aten::mm", 200))
    with warnings.catch_warnings():
        warnings.simplefilter("error", nbaccel.trace_result.TraceWarning)
        result = load_trace(tmp_path)
    assert "far_apart" not in result.loaded


def test_unranked_step_files_of_several_processes_are_flagged(tmp_path):
    # torchrun without init_process_group, both workers profiling into one trace=FOLDER: the two
    # pids' files were read as "2 step files" of one process, chained in file-name order.
    _write(tmp_path / "host_101.1000.pt.trace.json", _op_at("aten::add", 0))
    _write(tmp_path / "host_202.1000.pt.trace.json", _op_at("aten::mm", 200))
    with pytest.warns(nbaccel.trace_result.TraceWarning) as caught:
        load_trace(tmp_path)
    (message,) = [str(w.message) for w in caught]
    assert "carry no rank but come from 2 different processes (host_101, host_202" in message
    assert "one folder per process" in message and "init_process_group" in message
    assert caught[0].filename == __file__
    _write(tmp_path / "host_101.1000.pt.trace.json", _op_at("aten::add", 0))
    (tmp_path / "host_202.1000.pt.trace.json").rename(tmp_path / "host_101.1001.pt.trace.json")
    with warnings.catch_warnings():  # one process's steps: nothing to say
        warnings.simplefilter("error", nbaccel.trace_result.TraceWarning)
        load_trace(tmp_path)


def test_two_profiles_written_milliseconds_apart_are_not_read_as_one_run(tmp_path, capsys):
    # A script-user trial: two profile(trace=DIR) ~20 ms apart loaded as "2 step files" of one run, no warning.
    from nbaccel.__main__ import main

    folder = tmp_path / "runs"
    for _ in range(2):
        with nbaccel.profile(trace=str(folder)):
            torch.ones(8, 8) @ torch.ones(8, 8)
    first, second = sorted(f.name for f in folder.iterdir())
    message = (rf"runs: the trace files of process {os.getpid()} on .* hold 2 separate profiles, not the steps of one "
               rf"run \({re.escape(second)}: ProfilerStep numbers start again \(#0 after #0\)\): profile 1: "
               rf"{re.escape(first)} \(ProfilerStep#0\); profile 2: {re.escape(second)} \(ProfilerStep#0\)\. .*Load "
               r"each on its own: one file, or one folder per profile")
    with pytest.raises(nbaccel.trace_result.SeparateRuns, match=message):
        load_trace(folder)
    assert main(["trace", str(folder)]) == 2
    assert re.fullmatch(f"nbaccel trace: {re.escape(str(tmp_path))}/{message}\n", capsys.readouterr().err)
    assert load_trace(folder / second).step_numbers == [0]  # each file still loads on its own


def _steps_file(numbers: list[int], ts: float, trace_id: str | None = None, pid: int = 7) -> str:
    """One file of ``ProfilerStep#N`` ranges (each with an op), 1 ms apart from ``ts`` (µs), by process ``pid``."""
    events = []
    for i, n in enumerate(numbers):
        start = ts + 1000 * i
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": pid, "tid": 1,
                    "ts": start, "dur": 900},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": 1, "ts": start + 1, "dur": 800}]
    return json.dumps({**({"trace_id": trace_id} if trace_id else {}), "traceEvents": events})


def test_a_schedules_cycle_files_are_one_run_and_restarted_step_numbers_two(tmp_path):
    # tensorboard_trace_handler under schedule(wait=1, warmup=1, active=2, repeat=2): a file per cycle, each
    # its own trace_id, torch's step count going on (#2-#3, #6-#7): one run, as it loaded before.
    cycles = _mkdir(tmp_path / "cycles")
    _write(cycles / "w_7.1000.pt.trace.json", _steps_file([2, 3], 0, "A"))
    _write(cycles / "w_7.1100.pt.trace.json", _steps_file([6, 7], 100_000, "B"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", nbaccel.trace_result.TraceWarning)
        result = load_trace(cycles)
    assert result.step_numbers == [2, 3, 6, 7] and result.header["first_step"] == 2
    # two torch profilers of one schedule each, 20 ms apart: the count starts again in the second
    again = _mkdir(tmp_path / "again")
    _write(again / "w_7.1000.pt.trace.json", _steps_file([1, 2], 0, "A"))
    _write(again / "w_7.1020.pt.trace.json", _steps_file([1, 2], 20_000, "B"))
    with pytest.raises(TraceError, match=r"hold 2 separate profiles.*\(#1 after #2\)\): profile 1: w_7\.1000\.pt\.trace"
                                         r"\.json \(ProfilerStep#1-#2\); profile 2: w_7\.1020\.pt\.trace\.json"):
        load_trace(again)
    # two unscheduled profiles (no ProfilerStep), two Kineto sessions
    plain = _mkdir(tmp_path / "plain")
    for name, trace_id, ts in (("run0.json", "A", 0), ("run1.json", "B", 20_000)):
        _write(plain / name, json.dumps({"trace_id": trace_id, **json.loads(_op_at("aten::mm", ts))}))
    with pytest.raises(TraceError, match=r"hold 2 separate profiles, .*\(run1\.json: different Kineto trace_ids"):
        load_trace(plain)


def test_two_profiles_of_one_rank_name_the_rank(tmp_path):
    for name, rank, ts in (("rank0.a.json", 0, 0), ("rank0.b.json", 0, 5000), ("rank1.json", 1, 0)):
        doc = json.loads(_steps_file([0], ts))
        _write(tmp_path / name, json.dumps({"distributedInfo": {"rank": rank, "world_size": 2}, **doc}))
    with pytest.raises(TraceError, match=r": rank 0's trace files \(process 7\) hold 2 separate profiles, .*profile 1: "
                                         r"rank0\.a\.json \(ProfilerStep#0\); profile 2: rank0\.b\.json"):
        load_trace(tmp_path)  # refused, not rank 0 skipped as unreadable and rank 1 shown alone


def test_separate_runs_of_one_rank_name_the_rank(tmp_path):
    _write(tmp_path / "rank0.a.json", _on(None, rank=0, world=2))
    _write(tmp_path / "rank0.b.json", _on(None, rank=0, world=2, ts=86_400e6))
    _write(tmp_path / "rank1.json", _on(None, rank=1, world=2))
    with pytest.warns(nbaccel.trace_result.TraceWarning, match=r"\(rank 0\): its 2 files are up to"):
        load_trace(tmp_path)


def _on(gpu: str | None, rank: int | None = None, world: int | None = None, ts: float = 0,
        header_last: bool = False) -> str:
    """One op's trace recorded on ``gpu`` (deviceProperties; None: none named), as ``rank`` of ``world``;
    ``header_last``: those keys after the events, where TraceLens writes them."""
    header = {"deviceProperties": [{"id": 0, "name": gpu, "computeMajor": 8, "computeMinor": 0}]} if gpu else {}
    if rank is not None:
        header["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    events = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts,
                               "dur": 100}]}
    return json.dumps({**events, **header} if header_last else {**header, **events})


@pytest.mark.parametrize("header_last", [False, True])
def test_files_naming_different_gpus_are_not_joined_into_one_run(tmp_path, header_last):
    # A user trial: an A100 and a B200 trace in one folder became "rank 0 of 16 -- recorded on
    # NVIDIA A100-SXM4-80GB", the B200's FLOPs judged against the A100's peak.
    _write(tmp_path / "monday.json", _on("NVIDIA A100-SXM4-80GB", header_last=header_last))
    _write(tmp_path / "tuesday.json", _on("NVIDIA B200", ts=200, header_last=header_last))
    message = (r"these trace files are not one run \(the files without a rank name different GPUs\): "
               r"NVIDIA A100-SXM4-80GB, no world size: monday\.json; NVIDIA B200, no world size: tuesday\.json\. "
               r"Load each run on its own: one file, or one folder per run")
    with pytest.raises(TraceError, match=message):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match=message):  # --rank does not get around it
        load_trace(tmp_path, rank=0)


def test_ranks_of_different_world_sizes_are_not_one_job(tmp_path):
    _write(tmp_path / "rank-0.json", _on("NVIDIA H100 80GB HBM3", rank=0, world=16))
    _write(tmp_path / "rank-1.json", _on("NVIDIA H100 80GB HBM3", rank=1, world=8))
    with pytest.raises(TraceError, match=r"not one run \(different world sizes: 8, 16\): NVIDIA H100 80GB HBM3, world "
                                         r"size 16: rank-0\.json; NVIDIA H100 80GB HBM3, world size 8: rank-1\.json"):
        load_trace(tmp_path)


def test_the_same_rank_of_two_jobs_on_different_gpus_is_refused_from_the_real_traces(tmp_path, ip):
    # The finding's folder: the A100 trace (rank 0 of 16) and the B200 trace (rank 0 of 8).
    for name in (A100, B200):
        (tmp_path / name).write_bytes(real_path(name).read_bytes())
    message = (r"not one run \(different world sizes: 8, 16; rank 0's files name different GPUs\): NVIDIA "
               r"A100-SXM4-80GB, world size 16: hta_a100.*; NVIDIA B200, world size 8: tracelens_b200")
    with pytest.raises(TraceError, match=message):
        load_trace(tmp_path)
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("profile_trace", str(tmp_path))


def test_one_runs_files_still_load_when_they_name_gpus(tmp_path):
    # Step files of one process name the same GPUs; a file naming none contradicts nothing; ranks of
    # one job may sit on different GPU models.
    steps = _mkdir(tmp_path / "steps")
    _write(steps / "w.1.pt.trace.json", _on("NVIDIA H200", ts=0))
    _write(steps / "w.2.pt.trace.json", _on("NVIDIA H200", ts=200))
    _write(steps / "w.3.pt.trace.json", _on(None, ts=400))
    assert load_trace(steps).loaded["files"] == [str(f) for f in sorted(steps.iterdir())]
    job = _mkdir(tmp_path / "job")
    _write(job / "nbaccel.rank0.pt.trace.json", _on("NVIDIA A100-SXM4-80GB", rank=0, world=2))
    _write(job / "nbaccel.rank1.pt.trace.json", _on("NVIDIA H100 80GB HBM3", rank=1, world=2))
    result = load_trace(job)
    assert isinstance(result, MultiRankResult) and sorted(result.ranks) == [0, 1]


def test_the_merged_op_table_is_the_sum_of_the_ranks_tables(tmp_path):
    """Each rank's ops point at their parents by row; merged, rank 1's pointed into rank 0's rows, so
    its re-dispatches and source-line totals were judged against the wrong ops. (Two different traces:
    a copy of one rank has the same rows where the wrong pointers land.)"""
    for rank, name in enumerate((A100, B200)):
        doc = json.loads(gzip.decompress(real_path(name).read_bytes()))
        with gzip.open(tmp_path / f"rank-{rank}.json.gz", "wt", compresslevel=1) as fh:
            # as two ranks of one job (their own world sizes, 16 and 8, would be refused as two jobs)
            json.dump(_stretched(doc, 1.0, rank, world_size=2), fh)
    r = load_trace(tmp_path)
    keys = ["name", "shapes", "source"]
    for group in ("op", "op+shape"):  # (these traces were recorded without stacks: no source lines)
        merged = r.table(group=group).set_index(keys).sort_index()
        per_rank = [r.table(rank=k, group=group).set_index(keys) for k in r.ranks]
        for column in ("calls", "cpu_self_us", "cpu_total_us", "device_total_us"):
            summed = per_rank[0][column].add(per_rank[1][column], fill_value=0).sort_index()
            assert merged[column].tolist() == pytest.approx(summed.tolist()), (group, column)


def test_a_folder_with_an_unranked_trace_of_another_gpu_says_so_first(tmp_path):
    """A user trial: the H100 trace (no rank) beside the B200 one (rank 0) was refused for the H100 file's
    missing rank only; that the two name different GPUs is the likelier story, and said first."""
    for name in (H100, B200):
        (tmp_path / name).write_bytes(real_path(name).read_bytes())
    with pytest.raises(TraceError, match=r"not one run \(the files name different GPUs\): NVIDIA B200.*NVIDIA H100"):
        load_trace(tmp_path)


def test_stack_on_a_trace_recorded_without_stacks_says_so(ip, tmp_path):
    """Was: a table of one "(no user frame)" row, as if the code had no source lines."""
    from nbaccel.profile import ProfileError

    with_stacks, without = tmp_path / "stacks.json", tmp_path / "plain.json"

    def cell():
        return torch.ones(32, 32) @ torch.ones(32, 32)

    for path, stack in ((with_stacks, True), (without, False)):
        with nbaccel.profile(stack=stack, trace=str(path)):
            cell()
    sources = load_trace(with_stacks, stack=True).table()["source"].tolist()
    assert any("test_load_trace.py" in s for s in sources), sources
    with pytest.raises(ProfileError, match=r"^stack=True: plain\.json holds no Python stack events, so it was recorded "
                                           r"without with_stack=True .*; load it without stack=True"):
        load_trace(without, stack=True)
    with pytest.raises(UsageError, match=r"^--stack: plain\.json holds no Python stack events.*without --stack"):
        ip.run_line_magic("profile_trace", f"{without} --stack -q")
    assert load_trace(without).op_count > 0


def test_a_trace_folder_that_held_other_runs_says_so_when_written(tmp_path):
    """A trial reused --trace runs/prof1 for three profiles; nothing said the folder now held three runs,
    which %profile_trace then read as one."""
    from nbaccel.render import profile as render_profile_

    folder = tmp_path / "prof1"
    with nbaccel.profile(trace=str(folder)) as first:
        torch.ones(4) + 1
    assert first.result.trace_earlier == []
    assert "already held" not in render_profile_.text(first.result)
    with nbaccel.profile(trace=str(folder)) as second:
        torch.ones(4) + 1
    assert second.result.trace_earlier == first.result.trace_files
    note = ("the trace folder already held 1 trace file of other runs, which loading the folder cannot read as one "
            "run with this one (it stops, or warns, naming the files): give each run a folder of its own")
    assert note in " ".join(render_profile_.text(second.result).split())
    assert note in render_profile_.html(second.result)
    assert second.result.to_dict()["trace_earlier"] == first.result.trace_files


def test_a_cpu_only_trace_claims_no_gpu_peak_in_its_method(tmp_path):
    from nbaccel.render import profile as render_profile_

    path = tmp_path / "cpu.json"
    with nbaccel.profile(trace=str(path)):
        torch.ones(4) + 1
    method = render_profile_.method(load_trace(path))
    assert "deviceProperties" not in method and "no peak or Tensor Cores: a CPU-only trace (no kernels)" in method


def test_the_method_line_gives_a_quick_load_its_digits():
    # A user trial: "(3,301 events, 0.0 s)"; a fast load is read in ms or µs.
    result = nbaccel.load_trace("tests/data/h200_bf16_transformer_step.json.gz")
    result.loaded["load_seconds"] = 0.0123
    assert "events, 12.3 ms). Wall time" in unfolded(str(result))


def _cpu_job(folder: Path, step_us: list[float]) -> MultiRankResult:
    for rank, dur in enumerate(step_us):
        events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0,
                   "dur": dur},
                  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1, "dur": dur - 2}]
        (folder / f"rank-{rank}.json").write_text(json.dumps({"traceEvents": events}))
    return load_trace(folder)


def test_ranks_within_a_few_percent_name_no_straggler(tmp_path):
    """A user trial: two CPU ranks 0.9% (164 us) apart read "slowest rank: 1 -- ... +0.9% over the median of
    the other ranks", which a re-run can reverse. Under 5% (trace_result.STRAGGLER_MIN_EXCESS) no rank is named."""
    from nbaccel.render import multirank as render_multirank

    (tmp_path / "close").mkdir()
    close = _cpu_job(tmp_path / "close", [18_000.0, 18_164.0])
    assert close.straggler["rank"] == 1 and not close.straggler["named"]
    text = unfolded(str(close))
    assert "slowest rank" not in text and "(slowest)" not in render_multirank.html(close)
    assert re.search(r"no straggler: the ranks' step times are within 0\.9% of each other \(18 ms to 18\.2 ms\); "
                     r"the slowest, rank 1, is \+0\.9% over the median of the others, under the 5% that names a "
                     r"straggler", text), text
    (tmp_path / "apart").mkdir()
    apart = _cpu_job(tmp_path / "apart", [18_000.0, 19_800.0])  # 10%: named, as before
    assert apart.straggler["named"]
    assert re.search(r"slowest rank: 1 -- step time .*\+10\.0%", unfolded(str(apart)))
    assert "(slowest)" in render_multirank.html(apart)
