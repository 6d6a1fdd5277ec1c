"""`TorchGlobals` puts back the process-wide settings beyond the precision ones: intra-op threads,
autograd's anomaly mode (and its check_nan), the default device, the oneDNN flags and cuBLAS's
reduced-precision reductions. A fault-injection audit found a failed ``%%amp`` leaving a cell's
``torch.set_num_threads(1)`` and ``torch.autograd.set_detect_anomaly(True)`` behind, and each run
starting from the previous run's values of them.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

import nbaccel
from nbaccel.precision import TorchGlobals

MATMUL = torch.backends.cuda.matmul


def _has(owner, name: str) -> bool:
    try:
        getattr(owner, name)
    except AttributeError:
        return False
    return True


def _settings() -> tuple:
    """The settings the audit found unrestored, read as torch keeps them."""
    return (torch.get_num_threads(), torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled(),
            torch.backends.mkldnn.enabled, MATMUL.allow_fp16_reduced_precision_reduction,
            MATMUL.allow_bf16_reduced_precision_reduction, torch.get_default_device())


def _change_them(threads: int = 1) -> None:
    torch.set_num_threads(threads)
    torch.autograd.set_detect_anomaly(True, check_nan=False)  # called as a function: stays on
    torch.backends.mkldnn.enabled = False
    MATMUL.allow_fp16_reduced_precision_reduction = False
    MATMUL.allow_bf16_reduced_precision_reduction = False
    torch.set_default_device("meta")


@pytest.fixture
def two_threads():
    """At least two intra-op threads, so a cell's set_num_threads(1) is a change."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    yield
    torch.set_num_threads(before)


def test_torch_globals_put_back_threads_anomaly_mode_default_device_and_backend_flags(two_threads):
    before, saved = _settings(), TorchGlobals()
    try:
        _change_them()
        assert _settings() != before
        saved.restore()
        assert _settings() == before
        assert not [mode for mode in _get_current_function_mode_stack()], \
            "no default device set: none is left, not a DeviceContext for the CPU that every torch call goes through"
    finally:
        saved.restore()


@pytest.mark.skipif(not _has(MATMUL, "allow_fp16_reduced_precision_reduction_split_k"),
                    reason="torch without the split-K companion")
def test_a_reduced_precision_reduction_comes_back_with_its_split_k_value():
    # Setting the flag to a bool sets split-K to True: written back as a bool, (False, False) came back (False, True).
    saved = TorchGlobals()
    try:
        MATMUL.allow_fp16_reduced_precision_reduction = (False, False)
        before = TorchGlobals()
        MATMUL.allow_fp16_reduced_precision_reduction = True
        before.restore()
        assert (MATMUL.allow_fp16_reduced_precision_reduction,
                MATMUL.allow_fp16_reduced_precision_reduction_split_k) == (False, False)
    finally:
        saved.restore()


def test_restoring_unchanged_threads_does_not_set_them(monkeypatch, two_threads):
    # torch.set_num_threads rebuilds the thread pools: before every run only where the cell changed it.
    calls = []
    original = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), original(n)))
    saved = TorchGlobals()
    saved.restore()
    assert calls == []
    threads = torch.get_num_threads()
    original(1)
    saved.restore()
    assert calls == [threads] and torch.get_num_threads() == threads


def test_every_run_starts_from_them_and_a_failed_comparison_leaves_them_as_before(two_threads):
    box = types.SimpleNamespace(runs=0, seen=[])

    def cell():
        box.runs += 1
        box.seen.append(_settings())
        _change_them()
        if box.runs == 2:
            raise ValueError("the second run failed")

    before = _settings()
    with pytest.raises(ValueError):
        nbaccel.compare_amp(cell, repeat=1, warmup=0)
    assert box.seen == [before, before], "the second run started from the first run's settings"
    assert _settings() == before


def test_a_successful_comparison_keeps_them_as_one_run_of_the_cell_leaves_them(two_threads, flags_set_by_the_cell):
    box = types.SimpleNamespace(seen=[])

    def cell():
        box.seen.append(_settings())
        torch.set_num_threads(1)
        torch.autograd.set_detect_anomaly(True, check_nan=False)
        torch.backends.mkldnn.enabled = False
        return torch.ones(2).sum()

    before = _settings()
    nbaccel.compare_amp(cell, repeat=3, warmup=0)
    assert set(box.seen) == {before}, "every run started from the settings before the call"
    assert torch.get_num_threads() == 1 and torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    assert not torch.backends.mkldnn.enabled


def test_the_audits_failed_amp_leaves_threads_and_anomaly_mode_as_before(run_cell, two_threads):
    cell = ("%%amp --repeat 1 --warmup 0\nimport builtins; builtins.runs = getattr(builtins, 'runs', 0) + 1\n"
            "torch.set_num_threads(1); torch.autograd.set_detect_anomaly(True)\nassert builtins.runs < 2\n")
    import builtins

    run_cell("import torch")
    threads = torch.get_num_threads()
    try:
        run_cell(cell, expect_error=AssertionError)
    finally:
        del builtins.runs
    assert torch.get_num_threads() == threads and not torch.is_anomaly_enabled()
