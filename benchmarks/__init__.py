"""nbaccel benchmarks: `python -m benchmarks` (reference suite), `python -m benchmarks.bench_amp` (issue 2)."""
