"""The facts behind ``%%profile_gpu``'s and ``%%amp``'s attention advice, measured side by side.

    python -m benchmarks.bench_attention            # ~20 s on 2 CPU cores
    python -m benchmarks.bench_attention --device cuda

Each line is two closures timed in one run by ``torch.utils.benchmark.Timer.blocked_autorange``
(which synchronizes CUDA; median of its blocks, with the IQR), and their ratio:

1. attention written out by hand (``softmax(q @ k^T / sqrt(d) + causal mask) @ v``) against
   ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``: what the "attention written out
   by hand" advice sends the reader to;
2. SDPA's math fallback (forced with ``sdpa_kernel(SDPBackend.MATH)``) against its default, fused
   kernel on the same call: what the fallback advice is about;
3. a causal SDPA forward + backward in fp32 against the same under bf16 autocast: on the CPU the
   bf16 flash-attention backward was several times slower than fp32 (a user trial's GPT step), the
   case ``%%amp``'s "an op runs slower in bf16 here" clause is for.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer


def _time(fn, min_run_time: float) -> tuple[float, float]:
    m = Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
    return m.median, m.iqr


def _line(label: str, a: tuple[str, object], b: tuple[str, object], min_run_time: float) -> float:
    (name_a, fn_a), (name_b, fn_b) = a, b
    fn_a(), fn_b()  # first calls (oneDNN primitives, allocator) outside the timing
    ta, ia = _time(fn_a, min_run_time)
    tb, ib = _time(fn_b, min_run_time)
    print(f"{label}: {name_a} {ta * 1e3:.2f} ms (IQR {ia * 1e3:.2f}), {name_b} {tb * 1e3:.2f} ms "
          f"(IQR {ib * 1e3:.2f}): {ta / tb:.2f}x")
    return ta / tb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--min-run-time", type=float, default=1.0, help="seconds per closure (Timer.blocked_autorange)")
    a = p.parse_args(argv)
    dev, t = a.device, a.min_run_time
    torch.manual_seed(0)
    b, h, n, d = 4, 8, 128, 64
    q, k, v = (torch.randn(b, h, n, d, device=dev) for _ in range(3))
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()

    def by_hand():
        s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    print(f"device {dev}, torch {torch.__version__}, threads {torch.get_num_threads()}, q/k/v {b}x{h}x{n}x{d} fp32")
    _line("1. causal attention", ("by hand", by_hand), ("F.scaled_dot_product_attention", sdpa), t)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def math_only():
        with sdpa_kernel(SDPBackend.MATH):  # what the fallback runs, on the same call
            return F.scaled_dot_product_attention(q, k, v)

    _line("2. SDPA", ("math fallback", math_only), ("default (fused)", lambda: F.scaled_dot_product_attention(q, k, v)), t)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def step(dtype):
        def run():
            with torch.autocast(dev.split(":")[0], dtype=dtype, enabled=dtype is not None):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            out.float().sum().backward()
        return run

    _line("3. causal SDPA forward + backward", ("bf16 autocast", step(torch.bfloat16)), ("fp32", step(None)), t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
