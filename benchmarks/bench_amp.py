"""Issue 2's benchmark: does ``%%amp`` measure what ``torch.utils.benchmark.Timer`` measures?

    python -m benchmarks.bench_amp            # ~1-2 min on 2 CPU cores
    python -m benchmarks.bench_amp --small    # seconds (CI smoke)

For a 2048x2048 matmul, an MLP training step and a small conv net training step it prints
`compare_amp`'s median (what ``%%amp`` reports) and Timer's median for fp32 and bf16 on the same
closure and recipe, with the same warmup/repeat counts, and whether they agree within 10 %, beside
how many cores other programs kept busy meanwhile (`nbaccel.contention`, over both measurements of
the workload): a disagreement on a contended machine says little about either timer.
Then nbaccel's own costs: the harness wall clock per run beyond the run itself (target: under
1 ms plus the snapshot copy), a whole comparison of a trivial cell beside one full garbage
collection, and the snapshot capture/restore cost per MiB of state.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from nbaccel.contention import MIN_OTHERS_CORES, ContentionMeter
from nbaccel.device import resolve_device
from nbaccel.timing import format_seconds

from . import allocator_note, measure, pin_allocator, workloads

# bench_amp's own sizes: issue 2 fixes the matmul at 2048x2048 on every device.
AMP_SIZES = {
    "full": {"gemm": {"n": 2048}, "mlp": {"batch": 256, "width": 1024, "depth": 3},
             "conv": {"batch": 16, "channels": 32, "hw": 64}},
    "small": {"gemm": {"n": 256}, "mlp": {"batch": 32, "width": 128, "depth": 2},
              "conv": {"batch": 4, "channels": 8, "hw": 16}},
}


def run(size: str = "full", device="auto", dtype: str = "bf16", warmup: int = 1, repeat: int = 21,
        threads: int | None = None) -> dict:
    """``threads``: torch CPU threads (restored after); default as set, 1 for ``small`` on the CPU."""
    dev = resolve_device(device)
    with measure.torch_threads(threads, size, dev):
        return _run(size, dev, dtype, warmup, repeat)


def _run(size, dev, dtype, warmup, repeat) -> dict:
    rows = []
    meter = ContentionMeter()  # one span per workload, around both timers' runs
    for name, shape in AMP_SIZES[size].items():
        wl = workloads._BUILDERS[name](dev, **shape)
        with meter.span(name):
            variants = measure.amp_variants(wl, dev, ["fp32", dtype], warmup, repeat)
            timer_times = measure.timer_stats_interleaved(
                wl, {v: measure.recipe_for(v, dev) for v in variants}, repeat)
        others = meter.result.others_cores(name)
        for vname, variant in variants.items():
            t_med = measure.median(timer_times[vname])
            agree = measure.agreement(variant.median, t_med)
            rows.append({"workload": name, "description": wl.description, "variant": vname,
                         "amp_median_s": variant.median, "amp_iqr_s": variant.times.iqr,
                         "timer_median_s": t_med, "ratio": agree["ratio"], "pass": agree["pass"],
                         "others_cores": others})
        del wl
    overhead = measure.harness_overhead(dev)
    state_model = measure._model_of(16 * 2**20, dev)
    overhead_state = measure.harness_overhead(dev, state=[state_model], repeat=10)
    comparison = measure.comparison_cost(dev)
    snap = measure.snapshot_cost(dev, sizes_mb=(1, 16, 64) if size == "full" else (1, 4))
    return {"device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "warmup": warmup, "repeat": repeat, "rows": rows, "harness": overhead,
            "harness_with_state": overhead_state, "comparison": comparison, "snapshot": snap,
            "contention": meter.result.to_dict(),
            "contended": [w for w in meter.result.contended_spans() if w is not None]}


def report(res: dict) -> str:
    out = [f"%%amp (compare_amp) vs torch.utils.benchmark.Timer on {res['device']}, torch {res['torch']}, "
           f"{res['threads']} threads, warmup {res['warmup']}, repeat {res['repeat']} (one run per sample)", ""]
    out.append(f"{'workload':<8} {'variant':<7} {'%%amp median':>13} {'(IQR)':>10} {'Timer median':>13} "
               f"{'ratio':>6}  agree<=10%  others")
    for r in res["rows"]:
        others = "n/a" if r["others_cores"] is None else f"{r['others_cores']:.2f}"
        out.append(f"{r['workload']:<8} {r['variant']:<7} {format_seconds(r['amp_median_s']):>13} "
                   f"{format_seconds(r['amp_iqr_s']):>10} {format_seconds(r['timer_median_s']):>13} "
                   f"{r['ratio']:>6.3f}  {'PASS' if r['pass'] else 'FAIL':<10}  {others:>6}")
    c = res["contention"]
    out.append(f"others: cores other programs kept busy on average while the workload was measured, of the "
               f"{c['cores']} this process may use ({c['method'] if c['measured'] else 'not measured: ' + c['unknown']})")
    if res["contended"]:
        out.append(f"contended (as %%amp warns: others >= {MIN_OTHERS_CORES} cores, and with torch's threads more than "
                   f"the cores): {', '.join(res['contended'])} -- their times and ratios include other programs' load")
    h, hs = res["harness"], res["harness_with_state"]
    out += ["", "Harness overhead per run (" + h["method"] + "):",
            f"  trivial fn, no state: {h['overhead_s'] * 1e6:.0f} µs per run (p90 {h['overhead_p90_s'] * 1e6:.0f} µs) "
            f"(target < 1 ms: {'PASS' if h['overhead_s'] < 1e-3 else 'FAIL'})",
            f"  trivial fn + {hs['state_bytes'] / 2**20:.1f} MiB model state: {hs['overhead_s'] * 1e3:.2f} ms per run "
            "(includes the snapshot restore)"]
    c = res["comparison"]
    out += [f"  whole comparison of a trivial cell ({c['runs']} runs, {c['memory_runs']} of them memory runs): "
            f"{c['comparison_s'] * 1e3:.0f} ms; one full gc.collect() in this process ({c['objects_tracked']:,} "
            f"objects tracked): {c['gc_collect_s'] * 1e3:.0f} ms ({c['method']})" + (
                "; the CPU memory runs share one full collection" if res["device"] == "cpu" else "")]
    out += ["", "Snapshot cost (host copy of parameters + gradients; median of 5):",
            f"  {'state':>9} {'capture':>10} {'restore':>10} {'capture/MiB':>12} {'restore/MiB':>12}"]
    for s in res["snapshot"]:
        out.append(f"  {s['state_mib']:>6.1f} MiB {format_seconds(s['capture_s']):>10} {format_seconds(s['restore_s']):>10} "
                   f"{s['capture_ms_per_mib']:>9.3f} ms {s['restore_ms_per_mib']:>9.3f} ms")
    fails = [r for r in res["rows"] if not r["pass"]]
    out += ["", f"Agreement: {len(res['rows']) - len(fails)}/{len(res['rows'])} rows within 10 %"
            + ("" if not fails else " -- FAIL rows usually mean a noisy machine; rerun with more --repeat")]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_amp", description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (CI smoke test)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--repeat", type=int, default=21,
                   help="timed runs per variant (default 21: on a 2-vCPU machine, 7 leave medians ~15%% apart)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    res = run("small" if a.small else "full", a.device, a.dtype, repeat=a.repeat)
    res["allocator"] = allocator_note()
    print(report(res))
    print(f"allocator: {res['allocator']}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    pin_allocator("benchmarks.bench_amp")
    sys.exit(main())
