"""Issue 4's benchmark: what ``%memory_budget`` costs per cell, and how close its predictions are.

    python -m benchmarks.bench_budget            # ~30 s on 2 CPU cores
    python -m benchmarks.bench_budget --small    # seconds (CI smoke)

1. Per-cell overhead of the watcher (pre/post_run_cell hooks + the peak meter): the same trivial
   cell is run through a real InteractiveShell in alternating blocks with and without a budget,
   ``--repeats`` blocks of ``--cells`` cells each; the per-cell time is each block's mean, and the
   overhead is the difference of the medians over blocks (target: under 1 ms).
2. The estimator's error: for two MLP sizes, `estimate_memory` (probes at 1/8 and 1/4 of the
   batch) against a measured training step at the full batch (step 2, so optimizer states exist).
   Measured: `PeakMeter` on the device (CPU: peak RSS over the step; CUDA: allocator peak);
   compared: what the step adds over the model states (its largest phase: the forward's activations,
   the backward's gradients + what it still holds, or the optimizer step's gradients + temporaries),
   and the whole peak (parameters + states + that).
   On a Linux host the step is measured twice over, because glibc's heap decides how much of it
   the RSS shows: ``--step-repeats`` times in this process (glibc's defaults: freed tensors stay
   resident and are reused only in part; min/median/max reported), and as many times in a child
   process with ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed threshold: every tensor from 128 KiB up is
   its own mapping, returned on free, so RSS follows the live tensors). The default-heap
   measurement is also checked against the estimate's no-reuse bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from nbaccel.device import resolve_device
from nbaccel.estimate import estimate_memory
from nbaccel.memory import PeakMeter, format_bytes


def cell_overhead(cells: int, repeats: int) -> dict:
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or get_ipython()  # None if a test shell exists already: that one, then
    ip.run_line_magic("load_ext", "nbaccel")
    source = "a = 1 + 1"

    def block() -> float:
        start = time.perf_counter()
        for _ in range(cells):
            ip.run_cell(source, store_history=True)
        return (time.perf_counter() - start) / cells

    ip.run_line_magic("memory_budget", "0.9 -q")
    block()  # warm both paths once
    ip.run_line_magic("memory_budget", "off -q")
    block()
    plain, watched = [], []
    for i in range(repeats):
        # Alternate which goes first so drift in the machine does not favour one side.
        for watch in ((False, True) if i % 2 == 0 else (True, False)):
            if watch:
                ip.run_line_magic("memory_budget", "0.9 -q")
                watched.append(block())
                ip.run_line_magic("memory_budget", "off -q")
            else:
                plain.append(block())
    ip.run_line_magic("unload_ext", "nbaccel")
    p, w = statistics.median(plain), statistics.median(watched)
    return {"cells_per_block": cells, "blocks": repeats, "plain_ms": p * 1e3, "watched_ms": w * 1e3,
            "overhead_ms": (w - p) * 1e3}


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


# A fixed mmap threshold also switches off glibc's dynamic one (mallopt(3)), which otherwise rises to
# the largest freed block (up to 32 MiB) and moves every tensor below it onto the retained heap.
RETURNING_HEAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def measure_step(width: int, depth: int, batch: int, device: torch.device, repeats: int) -> tuple[list[int], str]:
    """Bytes one AdamW training step adds at its peak, ``repeats`` times (step 1 unmeasured: states exist)."""
    torch.manual_seed(0)
    model = _mlp(width, depth).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, width, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().sum().backward()
        opt.step()

    step()
    peaks = []
    for _ in range(repeats):
        opt.zero_grad(set_to_none=True)
        with PeakMeter(device) as meter:
            step()
        peaks.append(meter.result.peak_bytes)
    return peaks, meter.result.method


def _measure_in_child(width: int, depth: int, batch: int, repeats: int, env: dict) -> list[int]:
    code = (f"import json, torch; from benchmarks.bench_budget import measure_step; "
            f"print(json.dumps(measure_step({width}, {depth}, {batch}, torch.device('cpu'), {repeats})[0]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def _spread(peaks: list[int]) -> dict:
    return {"min": min(peaks), "median": int(statistics.median(peaks)), "max": max(peaks)}


def estimator_error(width: int, depth: int, batch: int, device: torch.device, repeats: int = 5) -> dict:
    peaks, method = measure_step(width, depth, batch, device, repeats)
    torch.manual_seed(0)
    est = estimate_memory(_mlp(width, depth).to(device), optimizer="adamw", batch=batch, device=device)
    one = est.single("fp32")
    states = est.param_bytes + est.buffer_bytes + est.state_bytes
    predicted = one["total"] - states  # the step's largest phase (``one["peak_phase"]``)
    measured = statistics.median(peaks)
    out = {"model": f"MLP width {width} x {depth + 1} layers", "params": est.n_params, "batch": batch,
           "probe_batches": est.fits["fp32"].batches, "predicted_step_bytes": predicted,
           "measured_step_bytes": _spread(peaks), "step_error": (predicted - measured) / measured,
           "peak_error": (predicted - measured) / (measured + states), "method": method}
    if device.type == "cpu" and sys.platform.startswith("linux"):
        bound = one["total_no_reuse"] - states
        returning = statistics.median(_measure_in_child(width, depth, batch, repeats, RETURNING_HEAP))
        out.update({"no_reuse_bound_bytes": bound, "within_bound": predicted <= min(peaks) and max(peaks) <= bound,
                    "returning_heap_step_bytes": returning,
                    "returning_heap_step_error": (predicted - returning) / returning})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--cells", type=int, default=50, help="cells per block (default 50)")
    parser.add_argument("--repeats", type=int, default=11, help="blocks per side (default 11)")
    parser.add_argument("--step-repeats", type=int, default=5, help="measured steps per model (default 5)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    cells, repeats = (10, 3) if args.small else (args.cells, args.repeats)
    overhead = cell_overhead(cells, repeats)
    sizes = [(256, 2, 128), (512, 2, 256)] if args.small else [(1024, 3, 512), (2048, 3, 1024)]
    errors = [estimator_error(w, d, b, device, args.step_repeats) for w, d, b in sizes]
    results = {"device": str(device), "overhead": overhead, "estimator": errors}
    if args.json:
        print(json.dumps(results, indent=2))
        return results
    o = overhead
    print(f"per-cell overhead of the watcher on {device}: {o['overhead_ms']:.3f} ms "
          f"(plain {o['plain_ms']:.3f} ms vs watched {o['watched_ms']:.3f} ms per cell; median of {o['blocks']} "
          f"blocks of {o['cells_per_block']} cells each side, interleaved) -- target < 1 ms: "
          f"{'met' if o['overhead_ms'] < 1 else 'NOT met'}")
    for e in errors:
        m = e["measured_step_bytes"]
        print(f"{e['model']} ({e['params']:,} params), batch {e['batch']} (probes {e['probe_batches']}): "
              f"predicted {format_bytes(e['predicted_step_bytes'])} for the step")
        if "returning_heap_step_bytes" in e:
            print(f"  heap that returns freed tensors (MALLOC_MMAP_THRESHOLD_=131072): measured "
                  f"{format_bytes(e['returning_heap_step_bytes'])} -> error {e['returning_heap_step_error']:+.1%}")
        print(f"  {'glibc default heap' if 'returning_heap_step_bytes' in e else 'measured'}: "
              f"{format_bytes(m['median'])} (min {format_bytes(m['min'])}, max {format_bytes(m['max'])}, "
              f"{args.step_repeats} steps) -> error {e['step_error']:+.1%} of the step, "
              f"{e['peak_error']:+.1%} of the whole peak (median)")
        if "no_reuse_bound_bytes" in e:
            print(f"  no-reuse bound {format_bytes(e['no_reuse_bound_bytes'])}: every measured step between the "
                  f"prediction and the bound: {'yes' if e['within_bound'] else 'NO'}")
    print(f"measured by: {errors[0]['method']}")
    return results


if __name__ == "__main__":
    main()
