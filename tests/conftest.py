"""Shared fixtures: a real IPython shell with nbaccel loaded, and a guard on torch's global state."""

from __future__ import annotations

import gc
import logging
from unittest import mock

import pytest
import torch
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

from nbaccel.precision import TorchGlobals, global_state


def _process_state() -> dict:
    """Process-wide hooks nbaccel sets while it measures: the optimizer step hook that keeps autocast's
    weight casts fresh, logging switched off for hidden runs, the peak meters measuring now, and the
    objects a series of meters froze out of the garbage collector's walks."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from nbaccel.memory import _open_meters

    return {"optimizer_step_hooks": len(_global_optimizer_post_hooks), "logging.disable": logging.root.manager.disable,
            "open peak meters": len(_open_meters), "objects frozen out of gc": gc.get_freeze_count()}


@pytest.fixture(autouse=True)
def torch_state_unchanged():
    """Every test must leave torch's global flags, autocast and profiler exactly as it found them,
    and nbaccel's process-wide hooks removed."""
    before, hooks_before = global_state(), _process_state()
    yield
    assert global_state() == before, "a test (or nbaccel) left torch's global state changed"
    assert _process_state() == hooks_before, "a test (or nbaccel) left a process-wide hook behind"


@pytest.fixture
def flags_set_by_the_cell():
    """For a test whose cell sets torch flags on purpose and keeps them (a successful magic keeps
    what the cell did): puts them back afterwards, so `torch_state_unchanged` still guards the rest."""
    saved = TorchGlobals()
    yield
    saved.restore()


@pytest.fixture
def cpu_with_bf16_and_fp16_units(monkeypatch):
    """nbaccel reads this CPU as one with AMX-BF16, AVX512-BF16 and AVX512-FP16 (the VM the project
    was first built on), whatever the machine has: for tests of what nbaccel says and does on such a
    CPU (fp16 accepted, no "lacks bf16 units" verdict), not of those units' speed. Torch's CPU autocast
    runs fp16 and bf16 on any CPU, only slower without the units; the tests' shapes are tiny.
    A CPU without them (an Ice Lake: AVX512 but no BF16/FP16) refuses fp16 and says its bf16 kernels are emulated."""
    import nbaccel.device as device

    flags = device.cpu_flags() | {"amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16"}
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    monkeypatch.setattr(device, "_cpu_feature", lambda name: name in flags)


@pytest.fixture
def cpu_without_bf16_units(monkeypatch):
    """nbaccel reads this CPU as one with neither AMX nor AVX512-BF16/FP16 (an AVX2-only AMD EPYC, a CI
    machine of the project's), whatever the machine has: for what nbaccel says there. The kernels torch
    runs stay the machine's own."""
    import nbaccel.device as device

    flags = device.cpu_flags() - {"amx_bf16", "amx_tile", "amx_fp16", "avx512_bf16", "avx512_fp16"}
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    monkeypatch.setattr(device, "_cpu_feature", lambda name: name in flags)


@pytest.fixture(scope="session")
def _ipython():
    # start_ipython() makes IPython's test shell once per process and returns None ever after; a
    # benchmark run in-process earlier (bench_budget) may have made it already.
    return start_ipython() or get_ipython()


@pytest.fixture
def ip(_ipython):
    """A real InteractiveShell with nbaccel loaded and a clean user namespace."""
    shell = _ipython
    shell.run_line_magic("load_ext", "nbaccel")
    yield shell
    shell.run_line_magic("unload_ext", "nbaccel")
    # reset() ends with a full gc.collect(), which walks every object this process tracks (0.2-0.5 s
    # once torch, IPython, pandas and JupyterLab's modules are in; nearly 200 tests use this shell).
    # The collector's own generational runs free the same garbage later. Not with a GPU: a test's CUDA
    # tensors in reference cycles would stay in the allocator for the next test's memory figures.
    if torch.cuda.is_available():
        shell.reset(new_session=False)
        return
    with mock.patch.object(gc, "collect", lambda generation=2: 0):
        shell.reset(new_session=False)


@pytest.fixture
def run_cell(ip):
    """Run a cell; return (ExecutionResult, captured output) and fail loudly on unexpected errors."""
    from IPython.utils.capture import capture_output

    def run(source: str, expect_error: type[BaseException] | None = None):
        with capture_output(display=True) as captured:
            result = ip.run_cell(source, silent=False, store_history=True)
        error = result.error_in_exec or result.error_before_exec
        if expect_error is None and error is not None:
            raise error
        if expect_error is not None:
            assert isinstance(error, expect_error), f"expected {expect_error.__name__}, got {error!r}"
        return result, captured

    return run


@pytest.fixture
def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
