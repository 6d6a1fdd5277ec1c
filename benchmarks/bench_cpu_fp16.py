"""The facts behind ``%%amp``'s and ``%%profile_gpu``'s fp16-on-the-CPU advice, measured side by side.

    python -m benchmarks.bench_cpu_fp16            # ~15 s on 2 CPU cores

On a CPU without AMX-FP16 (this project's VM has AMX-BF16 and AVX512-FP16 only), fp16 matmuls run on
vector units and gain little over fp32, and oneDNN's fp16 convolution *weight gradient* takes a path
far slower than fp32's (a user trial's CNN step ran 20x slower under ``--dtype fp16``). Each line
times two closures in one run (``torch.utils.benchmark.Timer.blocked_autorange``: median of its
blocks, with the IQR) and prints their ratio: a 3x3 convolution's forward, input gradient and weight
gradient in fp16 against fp32; a 1024^3 matmul in fp16 and in bf16 against fp32.
"""

from __future__ import annotations

import argparse

import torch

from .bench_attention import _line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_fp16", description=__doc__.split("\n\n")[0])
    p.add_argument("--min-run-time", type=float, default=1.0, help="seconds per closure (Timer.blocked_autorange)")
    t = p.parse_args(argv).min_run_time
    torch.manual_seed(0)
    x32, w32 = torch.randn(8, 32, 32, 32), torch.randn(32, 32, 3, 3)
    grad32 = torch.randn(8, 32, 32, 32)

    def conv(dtype, mask):
        x, w, g = (v.to(dtype) for v in (x32, w32, grad32))
        if mask is None:
            return lambda: torch.nn.functional.conv2d(x, w, padding=1)
        # the backward of conv2d(x, w, padding=1), one gradient at a time: [input, weight, bias]
        return lambda: torch.ops.aten.convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                           mask)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, conv 8x32x32x32 * 32x32x3x3 (padding 1)")
    _line("1. conv forward", ("fp16", conv(torch.float16, None)), ("fp32", conv(torch.float32, None)), t)
    _line("2. conv input gradient", ("fp16", conv(torch.float16, [True, False, False])),
          ("fp32", conv(torch.float32, [True, False, False])), t)
    _line("3. conv weight gradient", ("fp16", conv(torch.float16, [False, True, False])),
          ("fp32", conv(torch.float32, [False, True, False])), t)
    a32 = torch.randn(1024, 1024)
    a16, ab = a32.half(), a32.bfloat16()
    _line("4. matmul 1024^3", ("fp16", lambda: a16 @ a16), ("fp32", lambda: a32 @ a32), t)
    _line("5. matmul 1024^3", ("bf16", lambda: ab @ ab), ("fp32", lambda: a32 @ a32), t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
