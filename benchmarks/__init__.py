"""nbaccel benchmarks: `python -m benchmarks` (reference suite), `python -m benchmarks.bench_amp` (issue 2)."""

import os
import sys

# glibc returns a freed allocation above its mmap threshold to the OS, and the next run of the
# same shapes page-faults it back in: on the CPU a 2048x2048 bf16 matmul then takes either ~13 or
# ~26 ms depending on the allocator's history, in *both* timers. Pinning the thresholds keeps
# freed memory in the heap, so the two timers are compared on the same footing. A notebook's
# default allocator shows that bimodality; docs/benchmarks.md says so. Opt out: NBACCEL_SYSTEM_MALLOC=1.
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def pin_allocator(module: str) -> None:
    """Re-exec ``python -m module`` with glibc's allocator pinned (Linux only; once)."""
    if (sys.platform != "linux" or os.environ.get("NBACCEL_SYSTEM_MALLOC") == "1"
            or all(os.environ.get(k) == v for k, v in PINNED_MALLOC.items())):
        return
    env = dict(os.environ, **PINNED_MALLOC)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def allocator_note() -> str:
    pinned = all(os.environ.get(k) == v for k, v in PINNED_MALLOC.items())
    return ("glibc malloc pinned (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_=4 GiB: freed tensors stay in the heap)"
            if pinned else "system malloc defaults")
