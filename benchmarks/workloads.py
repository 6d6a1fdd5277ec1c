"""The reference workloads: what the benchmarks run, at sizes scaled to the device.

Each workload is a closure ``fn`` (one GEMM, or one full training step: forward, loss, backward,
optimizer step) plus the objects it mutates (``state``), so `nbaccel.compare_amp` can restore
them before every run and ``torch.utils.benchmark.Timer`` can do the same in its ``setup``.

Sizes are per (device type, size): ``small`` is a CI smoke size, ``full`` is the reference size.
The CPU full sizes are chosen so the whole suite fits in about 3 minutes on 2 cores; the CUDA
full sizes are large enough that a data-center GPU is compute-bound (8192^3 GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

WORKLOADS = ("gemm", "mlp", "conv", "transformer")

# (device type, size) -> per-workload shapes.
SIZES = {
    ("cpu", "small"): {
        "gemm": {"n": 512},
        "mlp": {"batch": 64, "width": 256, "depth": 2},
        "conv": {"batch": 8, "channels": 16, "hw": 32},
        "transformer": {"batch": 4, "seq": 64, "d_model": 128, "nhead": 4, "ff": 512},
    },
    ("cpu", "full"): {
        "gemm": {"n": 2048},
        "mlp": {"batch": 512, "width": 1024, "depth": 3},
        "conv": {"batch": 16, "channels": 32, "hw": 64},
        "transformer": {"batch": 8, "seq": 128, "d_model": 512, "nhead": 8, "ff": 2048},
    },
    ("cuda", "small"): {
        "gemm": {"n": 2048},
        "mlp": {"batch": 1024, "width": 1024, "depth": 3},
        "conv": {"batch": 32, "channels": 64, "hw": 64},
        "transformer": {"batch": 8, "seq": 256, "d_model": 512, "nhead": 8, "ff": 2048},
    },
    ("cuda", "full"): {
        "gemm": {"n": 8192},
        "mlp": {"batch": 8192, "width": 4096, "depth": 4},
        "conv": {"batch": 128, "channels": 128, "hw": 64},
        "transformer": {"batch": 16, "seq": 1024, "d_model": 1024, "nhead": 16, "ff": 4096},
    },
}

# Timing repeats per (device type, size): (warmup, repeat).
REPEATS = {
    ("cpu", "small"): (2, 5),
    ("cpu", "full"): (1, 5),
    ("cuda", "small"): (2, 10),
    ("cuda", "full"): (3, 20),
}


@dataclass
class Workload:
    name: str
    description: str
    fn: Callable[[], object]
    state: list = field(default_factory=list)  # what fn mutates (restored before every run)


def gemm(device, n: int) -> Workload:
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    return Workload("gemm", f"{n}x{n} @ {n}x{n} matmul", lambda: a @ b, [a, b])


def _training_step(model, inputs, target, loss_fn, lr=1e-3):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), target)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, [model, opt, inputs, target]


def mlp(device, batch: int, width: int, depth: int) -> Workload:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 16)).to(device)
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, 16, (batch,), device=device)
    fn, state = _training_step(model, x, y, nn.functional.cross_entropy)
    return Workload("mlp", f"MLP {depth}x{width} (GELU), batch {batch}, SGD step", fn, state)


def conv(device, batch: int, channels: int, hw: int) -> Workload:
    torch.manual_seed(0)
    c = channels
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 16),
    ).to(device).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, hw, hw, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 16, (batch,), device=device)
    fn, state = _training_step(model, x, y, nn.functional.cross_entropy)
    return Workload("conv", f"4-conv net ({c}/{2 * c} ch, BN, channels_last), {batch}x3x{hw}x{hw}, SGD step", fn, state)


def transformer(device, batch: int, seq: int, d_model: int, nhead: int, ff: int) -> Workload:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True).to(device)
    x = torch.randn(batch, seq, d_model, device=device)
    target = torch.randn(batch, seq, d_model, device=device)
    fn, state = _training_step(layer, x, target, nn.functional.mse_loss)
    return Workload("transformer", f"TransformerEncoderLayer d{d_model} h{nhead} ff{ff}, {batch}x{seq} tokens, SGD step",
                    fn, state)


_BUILDERS = {"gemm": gemm, "mlp": mlp, "conv": conv, "transformer": transformer}


def build(name: str, device: torch.device, size: str = "full") -> Workload:
    return _BUILDERS[name](device, **SIZES[(device.type, size)][name])


def repeats(device: torch.device, size: str) -> tuple[int, int]:
    return REPEATS[(device.type, size)]
