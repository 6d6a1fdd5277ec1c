"""The reference suite: ``python -m benchmarks`` (see README, "Benchmarks").

For each workload (large GEMM, MLP training step, channels_last conv net training step,
transformer encoder layer training step) and each precision the device has (fp32 strict, TF32 on
CUDA sm80+, bf16 and fp16 autocast), side by side from one run:

* median time and spread as ``%%amp`` measures them (`nbaccel.compare_amp`), peak memory as
  ``%%amp`` measures it, and the median of ``torch.utils.benchmark.Timer`` on the same closure
  and recipe (agreement ratio, 10 % tolerance);
* FLOPs counted by nbaccel's op audit (torch's FLOP registry), achieved FLOP/s and the fraction
  of the device's dense peak for that precision (GPUs in nbaccel/data/gpu_peaks.csv; on a CPU
  "peak unknown" -- nbaccel has no CPU peak table and does not invent one);
* nbaccel's own overheads: the ``%%amp`` harness per run, and -- when their benchmark modules
  are present -- ``%%profile_gpu`` against bare torch.profiler, ``%memory_budget`` per cell and
  the widget build time for a large profile.

Writes JSON (``--out``) and a PNG plot; ``python -m benchmarks compare old.json new.json``
checks for regressions.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import math
import os
import platform
import sys
import time

import torch

from nbaccel.device import device_info, resolve_device
from nbaccel.memory import format_bytes
from nbaccel.timing import format_seconds

from . import measure, workloads

SCHEMA = 1

# Variants that are skipped on purpose, with the reason printed and stored.
SKIPS = {
    ("cpu", "conv", "fp16"): "CPU fp16 convolution has no fast kernel in this torch build (a probe on the "
                             "reference machine took ~47 s per training step); skipped to keep the suite short",
}


def machine() -> dict:
    info = device_info("auto")
    return {
        "date": _dt.date.today().isoformat(),
        "device": info.type,
        "device_name": info.name,
        "compute_capability": list(info.compute_capability) if info.compute_capability else None,
        "cpu": info.name if info.type == "cpu" else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Other processes on the machine distort every CPU figure (OpenMP threads stall on a busy core).
        "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def run_workload(name: str, dev: torch.device, size: str, log=print) -> dict:
    wl = workloads.build(name, dev, size)
    warmup, repeat = workloads.repeats(dev, size)
    names, skipped = [], {}
    for v in measure.variants_for(dev):
        reason = SKIPS.get((dev.type, name, v))
        if reason:
            skipped[v] = reason
        else:
            names.append(v)
    t0 = time.perf_counter()
    # Timer's samples bracket compare_amp's in time (half before, half after), so a change in
    # machine load during the workload weighs on both sides alike.
    first = repeat // 2
    timer = {v: measure.timer_stats(wl, measure.recipe_for(v, dev), warmup, first) if first else [] for v in names}
    amp = measure.amp_variants(wl, dev, names, warmup, repeat)
    for v in names:
        timer[v] += measure.timer_stats(wl, measure.recipe_for(v, dev), warmup, repeat - first)
    rows = []
    for v in names:
        variant = amp[v]
        times = timer[v]
        t_med = measure.median(times)
        agree = measure.agreement(variant.median, t_med)
        peak, peak_source = measure.device_peak(dev, v)
        fps = variant.flops_per_second
        rows.append({
            "variant": v, "recipe": variant.recipe.label,
            "amp_median_s": variant.median, "amp_iqr_s": variant.times.iqr, "amp_times_s": list(variant.times.times),
            "timer_median_s": t_med, "timer_times_s": times,
            "agreement_ratio": agree["ratio"], "agree": agree["pass"],
            "peak_bytes": variant.memory.peak_bytes if variant.memory else None,
            "memory_method": variant.memory.method if variant.memory else None,
            "flops": variant.flops, "flops_per_s": fps,
            "peak_flops": peak, "fraction_of_peak": fps / peak if fps and peak else None, "peak_source": peak_source,
        })
    log(f"  {name}: {len(rows)} variants in {time.perf_counter() - t0:.1f} s")
    return {"name": name, "description": wl.description, "warmup": warmup, "repeat": repeat,
            "variants": rows, "skipped": skipped}


# --- the other engineers' overhead benchmarks, used only if present ---------------------------

def _captured(fn, *args):
    """Run one of the other benchmarks' functions, keeping the line it prints as the summary."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        value = fn(*args)
    return value, buf.getvalue().strip()


def _profile_overhead(mod, dev, size):
    if dev.type != mod.DEVICE:
        raise RuntimeError(f"bench_profile measures on {mod.DEVICE}, the suite runs on {dev.type}")
    mod.REPEAT = 3 if size == "small" else 7
    width, batch = (256, 64) if size == "small" else (1024, 256)
    ratio, line = _captured(mod.overhead, f"MLP step, {width} wide, batch {batch}", mod.make_step(width, batch))
    return {"ratio": ratio, "summary": f"{ratio:.2f}x bare torch.profiler + key_averages "
                                       f"({line.split('|', 1)[-1].strip()}; median of {mod.REPEAT}, alternating)"}


def _widget_build(mod, dev, size):
    mod.REPEAT = 3 if size == "small" else 7
    (seconds, events), line = _captured(mod.widget_build)
    return {"seconds": seconds, "op_events": events, "summary": line}


def _budget_overhead(mod, dev, size):
    cells, repeats = (10, 3) if size == "small" else (50, 7)
    o = mod.cell_overhead(cells, repeats)
    ratio = o["watched_ms"] / o["plain_ms"] if o["plain_ms"] else None
    return {**o, "ratio": ratio,
            "summary": f"{o['overhead_ms']:.3f} ms per cell ({ratio:.2f}x a plain trivial cell: "
                       f"{o['plain_ms']:.3f} -> {o['watched_ms']:.3f} ms; median of {repeats} blocks of {cells} cells)"}


OPTIONAL = {
    # key: (module, function it needs, adapter, what it measures)
    "profile_gpu": ("benchmarks.bench_profile", "overhead", _profile_overhead, "%%profile_gpu vs bare torch.profiler"),
    "widget": ("benchmarks.bench_profile", "widget_build", _widget_build, "widget build time for a large profile"),
    "memory_budget": ("benchmarks.bench_budget", "cell_overhead", _budget_overhead, "%memory_budget per cell"),
}


def optional_overheads(dev: torch.device, size: str, log=print) -> tuple[dict, dict]:
    """Run the other engineers' overhead benchmarks when their modules exist in this checkout;
    return (results, {key: why it was not measured})."""
    results, missing = {}, {}
    for key, (module, func, adapter, what) in OPTIONAL.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing[key] = f"{what}: {module} is not in this version ({exc.__class__.__name__}: {exc})"
            continue
        if not hasattr(mod, func):
            missing[key] = f"{what}: {module} has no {func}() in this version"
            continue
        t0 = time.perf_counter()
        try:
            results[key] = {"what": what, **adapter(mod, dev, size)}
        except Exception as exc:  # one broken benchmark must not sink the suite; it is reported
            missing[key] = f"{what}: {module}.{func}() raised {exc.__class__.__name__}: {exc}"
            continue
        log(f"  {key}: {time.perf_counter() - t0:.1f} s")
    return results, missing


def run(size: str = "full", device="auto", names=workloads.WORKLOADS, log=print, threads: int | None = None) -> dict:
    """Run the suite. ``threads``: torch CPU threads for the run (see `measure.torch_threads`)."""
    dev = resolve_device(device)
    with measure.torch_threads(threads, size, dev):
        return _run(size, dev, names, log)


def _run(size, dev, names, log) -> dict:
    t0 = time.perf_counter()
    log(f"nbaccel reference suite, size {size}, on {device_info(dev).label}")
    result = {"schema": SCHEMA, "size": size, "machine": machine(), "workloads": []}
    for name in names:
        result["workloads"].append(run_workload(name, dev, size, log))
    harness = measure.harness_overhead(dev, repeat=20 if size == "small" else 50)
    harness["ratio_to_fp32_step"] = {w["name"]: harness["overhead_s"] / w["variants"][0]["amp_median_s"]
                                     for w in result["workloads"] if w["variants"]}
    result["overheads"] = {"amp_harness": harness}
    extra, missing = optional_overheads(dev, size, log)
    result["overheads"].update(extra)
    result["missing"] = missing
    result["elapsed_s"] = time.perf_counter() - t0
    result["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return result


# --- text, plot, comparison -----------------------------------------------------------------

def _flops(x):
    if not x:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}FLOP/s"
    return f"{x:.3g} FLOP/s"


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"nbaccel reference suite ({result['size']}) -- {m['device_name']} ({m['device']}), torch {m['torch']}, "
             f"{m['torch_threads']} threads, {m['date']}"
             + (f"; load average {m['load_avg_1m_at_start']:.2f} at start, {m.get('load_avg_1m_at_end') or 0:.2f} at end "
                f"({m['cpu_count']} CPUs)" if m.get("load_avg_1m_at_start") is not None else ""), ""]
    head = (f"{'workload':<12} {'variant':<6} {'%%amp median':>12} {'IQR':>9} {'Timer':>10} {'ratio':>6} {'agree':>5} "
            f"{'peak mem':>10} {'vs fp32':>7} {'FLOP/s':>14} {'of peak':>8}")
    lines.append(head)
    lines.append("-" * len(head))
    for w in result["workloads"]:
        base = next((r for r in w["variants"] if r["variant"] == "fp32"), None)
        for r in w["variants"]:
            speed = base["amp_median_s"] / r["amp_median_s"] if base and r["amp_median_s"] else None
            frac = f"{r['fraction_of_peak']:.1%}" if r["fraction_of_peak"] is not None else "unknown"
            lines.append(
                f"{w['name']:<12} {r['variant']:<6} {format_seconds(r['amp_median_s']):>12} "
                f"{format_seconds(r['amp_iqr_s']):>9} {format_seconds(r['timer_median_s']):>10} "
                f"{r['agreement_ratio']:>6.3f} {'PASS' if r['agree'] else 'FAIL':>5} {format_bytes(r['peak_bytes']):>10} "
                f"{(f'{speed:.2f}x' if speed else '-'):>7} {_flops(r['flops_per_s']):>14} {frac:>8}")
        for v, why in w["skipped"].items():
            lines.append(f"{w['name']:<12} {v:<6} skipped: {why}")
    lines.append("")
    for w in result["workloads"]:
        lines.append(f"  {w['name']}: {w['description']} (warmup {w['warmup']}, repeat {w['repeat']})")
    peaks = {r["peak_source"] for w in result["workloads"] for r in w["variants"]}
    lines += ["", "Peak FLOP/s: " + "; ".join(sorted(peaks))]
    o = result["overheads"]
    h = o["amp_harness"]
    lines += ["", "nbaccel overheads:",
              f"  %%amp harness per run: {h['overhead_s'] * 1e6:.0f} µs beyond the run ({h['method']}); "
              "as a fraction of one fp32 step: "
              + ", ".join(f"{k} {v:.2%}" for k, v in h["ratio_to_fp32_step"].items())]
    for key, value in o.items():
        if key == "amp_harness":
            continue
        summary = value.get("summary") or ", ".join(f"{k}={v}" for k, v in value.items()
                                                    if k != "what" and isinstance(v, (int, float, str)))
        lines.append(f"  {value['what']}: {summary}")
    for key, why in result.get("missing", {}).items():
        lines.append(f"  not measured -- {why}")
    fails = sum(1 for w in result["workloads"] for r in w["variants"] if not r["agree"])
    rows = sum(len(w["variants"]) for w in result["workloads"])
    lines += ["", f"%%amp vs Timer agreement: {rows - fails}/{rows} rows within 10 %; "
              f"suite took {result['elapsed_s']:.0f} s"]
    return "\n".join(lines)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(result: dict) -> str:
    """The suite's table as Markdown, for docs/benchmarks.md (``python -m benchmarks markdown FILE``)."""
    m = result["machine"]
    out = ["| workload | variant | %%amp median (IQR) | Timer median | ratio | within 10 % | peak memory | "
           "speedup vs fp32 | FLOP/s | of peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w in result["workloads"]:
        base = next((r for r in w["variants"] if r["variant"] == "fp32"), None)
        for r in w["variants"]:
            speed = base["amp_median_s"] / r["amp_median_s"] if base else None
            frac = f"{r['fraction_of_peak']:.1%}" if r["fraction_of_peak"] is not None else "peak unknown"
            out.append(f"| {w['name']} | {r['variant']} | {format_seconds(r['amp_median_s'])} "
                       f"({format_seconds(r['amp_iqr_s'])}) | {format_seconds(r['timer_median_s'])} | "
                       f"{r['agreement_ratio']:.2f} | {'PASS' if r['agree'] else 'FAIL'} | {format_bytes(r['peak_bytes'])} | "
                       f"{f'{speed:.2f}x' if speed else '-'} | {_flops(r['flops_per_s'])} | {frac} |")
        for v, why in w["skipped"].items():
            out.append(f"| {w['name']} | {v} | skipped: {why} | | | | | | | |")
    out += ["", "| nbaccel overhead | measured |", "|---|---|"]
    h = result["overheads"]["amp_harness"]
    out.append(f"| %%amp harness per run | {h['overhead_s'] * 1e6:.0f} µs beyond the run "
               f"({', '.join(f'{k} {v:.2%}' for k, v in h['ratio_to_fp32_step'].items())} of an fp32 step) |")
    for key, value in result["overheads"].items():
        if key != "amp_harness":
            out.append(f"| {value['what']} | {str(value.get('summary', '')).replace('|', '/')} |")
    for key, why in result.get("missing", {}).items():
        out.append(f"| {key} | not measured: {why} |")
    out.append("")
    out.append(f"Machine: {m['device_name']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads), torch "
               f"{m['torch']}, CUDA {m['cuda']}, Python {m['python']}; 1-minute load average "
               f"{_num(m.get('load_avg_1m_at_start'))} at start, {_num(m.get('load_avg_1m_at_end'))} at end; "
               f"suite took {result['elapsed_s']:.0f} s.")
    return "\n".join(out)


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = result["workloads"]
    variants = sorted({r["variant"] for w in ws for r in w["variants"]},
                      key=["fp32", "tf32", "bf16", "fp16"].index)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs, speed, ratio = [], [], []
        for j, w in enumerate(ws):
            base = next((r for r in w["variants"] if r["variant"] == "fp32"), None)
            row = next((r for r in w["variants"] if r["variant"] == v), None)
            if row and base:
                xs.append(j + i * width)
                speed.append(base["amp_median_s"] / row["amp_median_s"])
                ratio.append(row["agreement_ratio"])
        ax1.bar(xs, speed, width, label=v)
        ax2.bar(xs, ratio, width, label=v)
    for ax in (ax1, ax2):
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(ws))], [w["name"] for w in ws])
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_ylabel("speedup vs strict fp32 (%%amp medians)")
    ax1.legend()
    ax2.axhspan(0.9, 1.1, color="g", alpha=0.15, label="±10 %")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("%%amp median / Timer median (log)")
    m = result["machine"]
    fig.suptitle(f"nbaccel suite ({result['size']}): {m['device_name']}, torch {m['torch']}, {m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _index(result: dict) -> dict:
    out = {}
    for w in result["workloads"]:
        for r in w["variants"]:
            out[(w["name"], r["variant"])] = r["amp_median_s"]
    out[("overhead", "amp_harness")] = result["overheads"]["amp_harness"]["overhead_s"]
    return out


def compare(old: dict, new: dict, threshold: float = 0.10) -> tuple[str, list]:
    """Ratios new/old of every median both files have; a ratio above 1 + threshold is a regression."""
    a, b = _index(old), _index(new)
    lines, regressions = [], []
    if old["machine"]["device_name"] != new["machine"]["device_name"] or old.get("size") != new.get("size"):
        lines.append(f"warning: comparing {old['machine']['device_name']} ({old.get('size')}) with "
                     f"{new['machine']['device_name']} ({new.get('size')}); ratios mix machines or sizes")
    lines.append(f"{'workload':<12} {'variant':<12} {'old':>10} {'new':>10} {'new/old':>8}")
    for key in sorted(set(a) & set(b)):
        ratio = b[key] / a[key] if a[key] > 0 else math.inf
        bad = ratio > 1 + threshold
        if bad:
            regressions.append((key, ratio))
        lines.append(f"{key[0]:<12} {key[1]:<12} {format_seconds(a[key]):>10} {format_seconds(b[key]):>10} "
                     f"{ratio:>8.3f}{'  REGRESSION' if bad else ''}")
    for key in sorted(set(a) ^ set(b)):
        lines.append(f"{key[0]:<12} {key[1]:<12} only in {'old' if key in a else 'new'}")
    lines.append(f"{len(regressions)} regression(s) beyond {threshold:.0%}")
    return "\n".join(lines), regressions


class SuiteFileError(ValueError):
    """A file that is not a readable suite result, named in the message (the CLI prints it, exit 2)."""


def load(path: str) -> dict:
    """A suite result saved by `save`; `SuiteFileError` naming the file for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise SuiteFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SuiteFileError(f"{path}: not JSON ({exc})") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SCHEMA:
        raise SuiteFileError(f"{path}: not an nbaccel suite result (schema {schema!r}, expected {SCHEMA})")
    return data


def save(result: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    return path


def default_log(msg):
    print(msg, file=sys.stderr, flush=True)
