"""Overhead of %%profile_gpu, printed in one run.

1. The same cell (a small MLP training step on CPU, or CUDA when present) profiled two ways:
   bare ``torch.profiler.profile`` + ``key_averages()`` (what a user would otherwise do), and
   ``nbaccel.profile`` + analysis + rendering (text and HTML, what the magic displays).
   Each variant is timed end to end with time.perf_counter, alternating the two, REPEAT times
   after one warm-up of each; the ratio of medians is reported (target <= 1.15x).
2. The time to build the widget from a profile of about 10,000 op events (target < 0.5 s):
   the ProfileResult is built once from a real profile, then ``render.profile.widget`` is timed
   (median of REPEAT builds); the analysis time of that profile is printed beside it.

Run: python benchmarks/bench_profile.py  [NBACCEL_BENCH_REPEAT=N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import nbaccel  # noqa: F401
from nbaccel.profile import ProfileOptions, profile, quiet_kineto
from nbaccel.render import profile as render_profile

REPEAT = int(os.environ.get("NBACCEL_BENCH_REPEAT", "7"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_step(width: int, batch: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def bare(step):
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with quiet_kineto():  # same stderr handling on both sides; it is not what is measured
        prof = torch.profiler.profile(activities=activities)
        prof.start()
    step()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    with quiet_kineto():
        prof.stop()
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def ours(step):
    with profile(device=DEVICE) as prof:
        step()
    result = prof.result
    render_profile.text(result)
    render_profile.html(result)


def overhead(label, step):
    for fn in (bare, ours):
        fn(step)  # warm-up: first Kineto start, imports, caches
    times = {bare: [], ours: []}
    for i in range(REPEAT):
        for fn in ((bare, ours) if i % 2 == 0 else (ours, bare)):
            t0 = time.perf_counter()
            fn(step)
            times[fn].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    step()
    cell = time.perf_counter() - t0
    b, o = statistics.median(times[bare]), statistics.median(times[ours])
    print(f"{label:<34} cell alone {cell * 1e3:8.1f} ms | bare profiler + key_averages {b * 1e3:8.1f} ms | "
          f"nbaccel profile + analysis + render {o * 1e3:8.1f} ms | ratio {o / b:.2f}x")
    return o / b


def widget_build():
    def many_ops():
        t = torch.ones(8)
        for _ in range(770):  # 13 op events per iteration (ops and their inner ops): ~10,000
            t = (t + 1).mul_(0.5).relu_().neg_()

    with profile(options=ProfileOptions(device="cpu")) as prof:
        many_ops()
    result = prof.result
    t0 = time.perf_counter()
    with profile(options=ProfileOptions(device="cpu")) as again:
        many_ops()
    analysed = time.perf_counter() - t0
    times = []
    for _ in range(REPEAT):
        fresh = type(result)(**{**result.__dict__, "_grouped": {}})  # no cached tables: a first display
        for key in [k for k in list(fresh.__dict__) if k in ("header", "categories", "tensor_cores", "unaligned",
                                                               "fp32_misses", "kernels", "flops", "busy", "advice")]:
            fresh.__dict__.pop(key, None)
        t0 = time.perf_counter()
        render_profile.widget(fresh)
        times.append(time.perf_counter() - t0)
    print(f"widget from a profile of {result.op_count:,} op events: median {statistics.median(times) * 1e3:.0f} ms "
          f"(min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f}) over {REPEAT} builds; "
          f"recording + analysing that profile took {analysed * 1e3:.0f} ms")
    return statistics.median(times), result.op_count


def main():
    print(f"torch {torch.__version__}, device {DEVICE}, {os.cpu_count()} CPUs, {REPEAT} alternating repeats, medians")
    ratios = {}
    ratios["mlp 1024 wide, batch 256"] = overhead("MLP step, 1024 wide, batch 256", make_step(1024, 256))
    ratios["mlp 256 wide, batch 64"] = overhead("MLP step, 256 wide, batch 64 (tiny)", make_step(256, 64))
    # nbaccel's cost is mostly fixed (trace export and parse, tables, rendering): a larger step shows
    # where the ratio is heading for real training steps.
    ratios["mlp 4096 wide, batch 512"] = overhead("MLP step, 4096 wide, batch 512", make_step(4096, 512))
    seconds, n = widget_build()
    ok = ratios["mlp 1024 wide, batch 256"] <= 1.15 and seconds < 0.5
    print(f"targets: ratio <= 1.15x on the 1024-wide step, widget < 0.5 s: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
