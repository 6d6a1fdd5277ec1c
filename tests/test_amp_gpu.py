"""%%amp / compare_amp on a real CUDA device. Skipped without one; the GPU check runs these."""

from __future__ import annotations

import pytest
import torch

import nbaccel
from nbaccel.precision import NEW_TF32_API

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _mm_dtypes(variant) -> set:
    return set(variant.ops[variant.ops["op"] == "aten::mm"]["dtype"])


def test_an_outer_cuda_autocast_does_not_reach_the_fp32_run():
    a = torch.randn(256, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        res = nbaccel.compare_amp(lambda: a @ a, dtype="bf16", device="cuda", repeat=3, warmup=0)
    assert _mm_dtypes(res.baseline) == {"fp32"} and _mm_dtypes(res.amp) == {"bf16"}
    assert res.outer_autocast == {"cuda": "bf16"}


@pytest.mark.skipif(not NEW_TF32_API, reason="the fp32_precision API is torch >= 2.9")
def test_a_tf32_setting_the_cell_makes_is_kept_and_the_recipes_other_is_not(ip, flags_set_by_the_cell):
    before = torch.backends.cuda.matmul.fp32_precision
    ip.run_cell("import torch\na = torch.randn(64, 64, device='cuda')")
    # The bf16 recipe sets both TF32 switches to tf32; the cell sets the cuDNN one itself.
    ip.run_cell_magic("amp", "--dtype bf16 --device cuda --repeat 3 -q",
                      "torch.backends.cudnn.conv.fp32_precision = 'ieee'\na @ a")
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == before


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_training_loop_under_the_cuda_recipe_trains_on_fresh_weights(dtype):
    """The CUDA side of tests/test_amp_training_loops.py: autocast caches weight casts on CUDA too."""
    def run(context):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 10).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
        losses = []
        with context():
            for _ in range(3):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses

    under_recipe = run(lambda: nbaccel.precision(dtype, device="cuda"))
    assert under_recipe[0] > under_recipe[1] > under_recipe[2], under_recipe


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_clock_times_the_measured_device_not_the_current_one():
    from nbaccel.timing import Clock

    a = torch.randn(4096, 4096, device="cuda:1")
    seconds, _ = Clock(torch.device("cuda:1")).measure(lambda: [a @ a for _ in range(10)])
    assert torch.cuda.current_device() == 0
    assert seconds > 1e-3  # ten 4096^3 GEMMs; an empty stream on cuda:0 times ~10 µs of launches


def test_one_cuda_memory_run_per_variant_because_the_allocator_peak_repeats():
    # %%amp measures the CUDA peak once per variant (nbaccel.amp.memory_runs) on the ground that
    # max_memory_allocated gives the same bytes for the same step from the same state; this checks
    # that ground on a real training step, over runs restored from one snapshot.
    from nbaccel.memory import PeakMeter
    from nbaccel.precision import apply_recipe, make_recipe
    from nbaccel.snapshot import Snapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    snapshot = Snapshot.capture(None, objects=(model, opt))
    for dtype in ("fp32", "bf16"):
        peaks = []
        for _ in range(4):
            snapshot.restore()
            with apply_recipe(make_recipe(dtype, torch.device("cuda"))), PeakMeter(torch.device("cuda")) as meter:
                step()
            peaks.append(meter.result.peak_bytes)
        assert len(set(peaks[1:])) == 1, (dtype, peaks)  # the first may still create optimizer state
    res = nbaccel.compare_amp(step, dtype="bf16", device="cuda", repeat=3, warmup=1, state=(model, opt))
    assert res.baseline.memory.run_peaks == [res.baseline.memory.peak_bytes] and res.memory_firm
    assert "1 run per variant (the allocator's counts repeat exactly)" in str(res)
