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
   compared: what the step adds over the model states (gradients + max(activations, optimizer
   temporaries)), and the whole peak (parameters + states + that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nbaccel.device import resolve_device
from nbaccel.estimate import estimate_memory
from nbaccel.memory import PeakMeter, format_bytes


def cell_overhead(cells: int, repeats: int) -> dict:
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
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


def estimator_error(width: int, depth: int, batch: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = _mlp(width, depth).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, width, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().sum().backward()
        opt.step()

    step()  # states now exist, as in steady-state training
    opt.zero_grad(set_to_none=True)
    with PeakMeter(device) as meter:
        step()
    opt.zero_grad(set_to_none=True)
    measured_added = meter.result.peak_bytes
    del x
    est = estimate_memory(model, optimizer="adamw", batch=batch, device=device)
    one = est.single("fp32")
    predicted_added = one["grads"] + max(one["activations"], one["step_temporaries"])
    states = est.param_bytes + est.state_bytes
    return {"model": f"MLP width {width} x {depth + 1} layers", "params": est.n_params, "batch": batch,
            "probe_batches": est.fits["fp32"].batches, "measured_step_bytes": measured_added,
            "predicted_step_bytes": predicted_added,
            "step_error": (predicted_added - measured_added) / measured_added,
            "peak_error": (predicted_added - measured_added) / (measured_added + states),
            "method": meter.result.method}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--cells", type=int, default=50, help="cells per block (default 50)")
    parser.add_argument("--repeats", type=int, default=11, help="blocks per side (default 11)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    cells, repeats = (10, 3) if args.small else (args.cells, args.repeats)
    overhead = cell_overhead(cells, repeats)
    sizes = [(256, 2, 128), (512, 2, 256)] if args.small else [(1024, 3, 512), (2048, 3, 1024)]
    errors = [estimator_error(w, d, b, device) for w, d, b in sizes]
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
        print(f"{e['model']} ({e['params']:,} params), batch {e['batch']} (probes {e['probe_batches']}): "
              f"step measured {format_bytes(e['measured_step_bytes'])}, predicted "
              f"{format_bytes(e['predicted_step_bytes'])} -> error {e['step_error']:+.1%} of the step, "
              f"{e['peak_error']:+.1%} of the whole peak")
    print(f"measured by: {errors[0]['method']}")
    return results


if __name__ == "__main__":
    main()
