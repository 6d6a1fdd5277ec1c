"""Loading a large recorded trace: time and peak memory of ``nbaccel.load_trace`` (issue 8).

A synthetic torch.profiler trace of about ``--mb`` MB (default 100) is written to a temporary
folder (never to the repository). It has the shape of a real CUDA training trace: per step a
``ProfilerStep#N`` range; per layer ``aten::linear`` -> ``aten::addmm`` with ``Input Dims`` /
``Input type`` (record_shapes), ``cudaLaunchKernel`` with a correlation id, the kernel (cuBLAS
sm90 xmma name, grid/block/occupancy args like Kineto writes), an ``ac2g`` flow pair, an
elementwise op + kernel, ``python_function`` frames (with_stack) and an NCCL all-reduce per
step, so every branch of the loader is exercised at realistic event sizes.

Each measurement runs in a fresh Python process so its peak RSS (``ru_maxrss``) is its own:
the figure reported is the peak during the load minus the RSS just before it (imports done),
and its ratio to the file size. Three loaders are measured on the same file:

* ``nbaccel.load_trace(path)``: the streaming reader (events decoded one at a time and
  dropped once their columns are taken) + ``ProfileResult`` (tables, header, categories).
* ``nbaccel.analysis.load_trace(path)``: the analysis loader alone, which ``json.loads`` the
  whole document first (what ``%%profile_gpu`` does for its own, small, traces).
* the same streaming load of the ``.json.gz`` version of the file.

Run: python -m benchmarks.bench_trace [--mb 100] [--keep DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

GEMM = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas")
ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, "
               "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, "
               "at::detail::Array<char*, 3> >(int, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
               "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3>)")
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def _kernel_args(corr: int, ext: int) -> dict:
    return {"queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": corr, "registers per thread": 168,
            "shared memory": 213248, "blocks per SM": 0.76, "warps per SM": 3.04, "grid": [132, 1, 1],
            "block": [384, 1, 1], "est. achieved occupancy %": 6, "External id": ext}


def make_trace(path: str, target_mb: float = 100.0, rank: int = 0, world_size: int = 1,
               stretch: float = 1.0) -> dict:
    """Write a synthetic Kineto trace of about ``target_mb`` MB; return counts of what it holds.

    ``stretch`` multiplies every time and duration (a slower rank for multi-rank tests).
    Events are written one per line as they are made, so generating 100 MB needs little memory.
    """
    target = int(target_mb * 1e6)
    header = {"schemaVersion": 1,
              "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912,
                                    "computeMajor": 9, "computeMinor": 0, "maxThreadsPerBlock": 1024,
                                    "numSms": 132, "regsPerBlock": 65536, "sharedMemPerBlock": 49152}],
              "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size},
              "record_shapes": 1, "with_stack": 1}
    counts = {"steps": 0, "ops": 0, "kernels": 0, "gemms": 0, "events": 0}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps(header)[:-1] + ', "traceEvents": [\n')
        fh.write(json.dumps({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}))
        ts, ext, corr, written, step = 1_000_000.0, 1, 1, 0, 0
        m, k, n = 16384, 1024, 4096
        gemm_dur = 2.0 * m * k * n / 500e12 * 1e6  # us at 500 TFLOP/s
        while written < target:
            step_start = ts
            events = []
            for layer in range(200):
                t0 = ts
                events.append({"ph": "X", "cat": "python_function", "name": f"model.py({40 + layer}): forward",
                               "pid": 1, "tid": 1, "ts": t0 - 1, "dur": 60, "args": {"Python id": layer,
                                                                                    "Python parent id": 1}})
                events.append({"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": t0,
                               "dur": 40, "args": {"External id": ext, "Record function id": 0,
                                                   "Input Dims": [[m, k], [n, k], [n]],
                                                   "Input type": ["c10::BFloat16"] * 3, "Ev Idx": ext}})
                events.append({"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1,
                               "ts": t0 + 5, "dur": 30, "args": {"External id": ext + 1, "Record function id": 0,
                                                                 "Input Dims": [[n], [m, k], [k, n], [], []],
                                                                 "Input type": ["c10::BFloat16"] * 3 + ["Scalar"] * 2,
                                                                 "Concrete Inputs": ["", "", "", "1", "1"],
                                                                 "Ev Idx": ext + 1}})
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": t0 + 10, "dur": 6, "args": {"External id": ext + 1, "cbid": 211,
                                                                 "correlation": corr}})
                events.append({"ph": "X", "cat": "kernel", "name": GEMM, "pid": 0, "tid": 7, "ts": t0 + 20,
                               "dur": gemm_dur, "args": _kernel_args(corr, ext + 1)})
                events.append({"ph": "s", "id": corr, "pid": 1, "tid": 1, "ts": t0 + 10, "cat": "ac2g",
                               "name": "ac2g"})
                events.append({"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": t0 + 20, "cat": "ac2g",
                               "name": "ac2g", "bp": "e"})
                events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": t0 + 45,
                               "dur": 12, "args": {"External id": ext + 2, "Record function id": 0,
                                                   "Input Dims": [[m, n], []],
                                                   "Input type": ["c10::BFloat16", "Scalar"], "Ev Idx": ext + 2}})
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": t0 + 48, "dur": 5, "args": {"External id": ext + 2, "cbid": 211,
                                                                 "correlation": corr + 1}})
                events.append({"ph": "X", "cat": "kernel", "name": ELEMENTWISE, "pid": 0, "tid": 7,
                               "ts": t0 + 20 + gemm_dur + 1, "dur": 90.0,
                               "args": _kernel_args(corr + 1, ext + 2)})
                counts["ops"] += 3
                counts["kernels"] += 2
                counts["gemms"] += 1
                ext += 3
                corr += 2
                ts = max(t0 + 60, t0 + 20 + gemm_dur + 92)
            events.append({"ph": "X", "cat": "kernel", "name": NCCL, "pid": 0, "tid": 9, "ts": ts, "dur": 2000.0,
                           "args": {**_kernel_args(corr, 0), "stream": 9}})
            corr += 1
            counts["kernels"] += 1
            ts += 2001
            events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                           "ts": step_start - 2, "dur": ts - step_start + 2, "args": {"External id": 0}})
            step += 1
            if stretch != 1.0:
                for ev in events:
                    ev["ts"] = 1_000_000.0 + (ev["ts"] - 1_000_000.0) * stretch
                    if "dur" in ev:
                        ev["dur"] *= stretch
            chunk = "".join(",\n" + json.dumps(ev) for ev in events)
            fh.write(chunk)
            written += len(chunk)
            counts["events"] += len(events)
        counts["steps"] = step
        fh.write('\n], "traceName": "synthetic", "displayTimeUnit": "ms", "baseTimeNanoseconds": 1700000000000000000}\n')
    return counts


_MEASURE = r"""
import json, resource, sys, time
mode, path = sys.argv[1], sys.argv[2]
import nbaccel, nbaccel.analysis, nbaccel.render.profile  # imports are not part of the load
def rss_kb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
before = rss_kb()
t0 = time.perf_counter()
if mode == "stream":
    r = nbaccel.load_trace(path)
    text = str(r)  # the header, top table, categories: what the magic displays
    n_ops, n_kernels = r.op_count, r.kernel_count
else:
    t = nbaccel.analysis.load_trace(path)
    n_ops, n_kernels = len(t.ops), len(t.kernels)
elapsed = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
print(json.dumps({"mode": mode, "seconds": elapsed, "rss_before_mb": before / 1024, "peak_rss_mb": peak / 1024,
                  "added_mb": (peak - before) / 1024, "ops": n_ops, "kernels": n_kernels}))
"""


def measure(mode: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, mode, path], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="size of the synthetic trace in MB (default 100)")
    p.add_argument("--keep", default=None, help="write the trace here and keep it (default: a temp folder)")
    p.add_argument("--no-baseline", action="store_true", help="skip the json.loads analysis loader")
    a = p.parse_args(argv)
    folder = a.keep or tempfile.mkdtemp(prefix="nbaccel_bench_trace_")
    os.makedirs(folder, exist_ok=True)
    try:
        path = os.path.join(folder, "synthetic.pt.trace.json")
        t0 = time.perf_counter()
        counts = make_trace(path, a.mb)
        size = os.path.getsize(path)
        print(f"wrote {path}: {size / 1e6:.1f} MB, {counts['events']:,} events, {counts['ops']:,} ops, "
              f"{counts['kernels']:,} kernels, {counts['steps']} steps ({time.perf_counter() - t0:.1f} s)")
        gz = path + ".gz"
        with open(path, "rb") as src, gzip.open(gz, "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        runs = [("stream", path, size), ("stream", gz, size)]
        if not a.no_baseline:
            runs.append(("json.loads", path, size))
        print(f"{'loader':<34} {'file':<10} {'time':>8} {'peak RSS added':>15} {'x file':>7}")
        for mode, target, raw in runs:
            r = measure(mode, target)
            label = "nbaccel.load_trace (streaming)" if mode == "stream" else "analysis.load_trace (json.loads)"
            kind = ".json.gz" if target.endswith(".gz") else ".json"
            print(f"{label:<34} {kind:<10} {r['seconds']:>7.1f}s {r['added_mb']:>12.0f} MB {r['added_mb'] * 2**20 / raw:>6.1f}x"
                  f"   ({r['ops']:,} ops, {r['kernels']:,} kernels)")
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
