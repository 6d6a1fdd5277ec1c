"""``python -m benchmarks``: the nbaccel reference suite.

    python -m benchmarks                          # full size, on the GPU if present (< 3 min)
    python -m benchmarks --size small             # CI smoke size (< 60 s on 2 CPU cores)
    python -m benchmarks --out results/suite.json # JSON + PNG plot (same name, .png)
    python -m benchmarks compare old.json new.json [--threshold 0.10]   # exit 1 on a regression, 2 on a bad file
    python -m benchmarks markdown suite.json      # the tables as Markdown, for docs/benchmarks.md
    python -m benchmarks.bench_amp                # issue 2's %%amp-vs-Timer benchmark
    python -m benchmarks.bench_attention          # the facts behind the attention advice, side by side
    python -m benchmarks.bench_cpu_fp16           # fp16 vs fp32 convolutions and matmuls on a CPU without AMX-FP16
"""

from __future__ import annotations

import argparse
import os
import sys

from . import allocator_note, pin_allocator, suite, workloads


def main(argv=None) -> int:
    if argv is None:
        pin_allocator("benchmarks")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks compare",
                                    description="Compare two suite JSON files; exit 1 on a regression.")
        p.add_argument("old")
        p.add_argument("new")
        p.add_argument("--threshold", type=float, default=0.10,
                       help="a median more than this fraction slower is a regression (default 0.10)")
        a = p.parse_args(argv[1:])
        try:
            old, new = suite.load(a.old), suite.load(a.new)
        except suite.SuiteFileError as exc:
            return _bad_file(p, exc)
        text, regressions = suite.compare(old, new, a.threshold)
        print(text)
        return 1 if regressions else 0
    if argv[:1] == ["markdown"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks markdown",
                                    description="Print a suite JSON file as Markdown tables (for docs/benchmarks.md).")
        p.add_argument("result")
        try:
            result = suite.load(p.parse_args(argv[1:]).result)
        except suite.SuiteFileError as exc:
            return _bad_file(p, exc)
        print(suite.markdown(result))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=suite.__doc__.split("\n\n")[0],
                                epilog="Subcommand: python -m benchmarks compare OLD.json NEW.json")
    p.add_argument("--size", choices=["small", "full"], default="full")
    p.add_argument("--device", default="auto", help="auto (GPU if present), cpu or cuda[:N]")
    p.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                   help="comma-separated subset of " + ",".join(workloads.WORKLOADS))
    p.add_argument("--out", default="benchmark-results/suite.json", help="JSON results path")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's default; 1 for --size small on the CPU)")
    a = p.parse_args(argv)
    names = [n for n in a.workloads.split(",") if n]
    unknown = set(names) - set(workloads.WORKLOADS)
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(workloads.WORKLOADS)}")
    result = suite.run(a.size, a.device, names, log=suite.default_log, threads=a.threads)
    result["allocator"] = allocator_note()
    print(suite.table(result))
    print(f"allocator: {result['allocator']}")
    suite.save(result, a.out)
    print(f"\nwrote {a.out}")
    if not a.no_plot:
        png = a.plot or os.path.splitext(a.out)[0] + ".png"
        try:
            suite.plot(result, png)
            print(f"wrote {png}")
        except ImportError as exc:  # matplotlib is in the [lab] and [test] extras, not a core dependency
            print(f"no plot: {exc} (pip install matplotlib)")
    return 0


def _bad_file(parser: argparse.ArgumentParser, exc: Exception) -> int:
    """One line naming the file, status 2 like argparse's own errors: compare's 1 means a regression,
    so a CI step must not read a missing or foreign file as one."""
    print(f"{parser.prog}: error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
