"""One nbaccel recorder per process (`nbaccel.recording`): a refusal names the recorder in the way."""

import threading

import pytest
import torch

import nbaccel
from nbaccel.profile_options import ProfileError
from nbaccel.recording import RECORDING, RecorderLock
from nbaccel.tensor_peak import CpuTensorPeak


def test_lock_remembers_its_holder_until_released():
    lock = RecorderLock()
    assert lock.take("a test recorder")
    assert not lock.take("a second one")  # non-blocking: refused, the first holder kept
    assert (lock.what, lock.thread_id, lock.thread_name) == (
        "a test recorder", threading.get_ident(), threading.current_thread().name)
    assert lock.profile_in_this_thread() is None  # held, but not by a profile
    lock.release()
    assert not lock.locked() and lock.what is None and lock.thread_id is None


def test_profile_in_this_thread_is_none_from_another_thread():
    lock, seen = RecorderLock(), []
    marker = object()
    assert lock.take("a profile", profile=marker)
    try:
        assert lock.profile_in_this_thread() is marker
        worker = threading.Thread(target=lambda: seen.append(lock.profile_in_this_thread()))
        worker.start()
        worker.join(30)
        assert seen == [None]
    finally:
        lock.release()


def _held_in_thread(enter, name):
    """Runs ``with enter():`` in a thread named ``name`` until the returned event is set."""
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with enter():
            inside.set()
            leave.wait(30)

    worker = threading.Thread(target=hold, name=name)
    worker.start()
    assert inside.wait(30)
    return worker, leave


def test_profile_refused_while_a_memory_meter_records_elsewhere_names_the_meter():
    """The refusal said "another nbaccel.profile is recording" whoever held the lock: %%amp's CPU memory
    meter and the memory estimate's dry runs take it too."""
    worker, leave = _held_in_thread(lambda: CpuTensorPeak("the test's memory meter"), "meter-thread")
    try:
        with pytest.raises(ProfileError) as err:
            with nbaccel.profile():
                raise AssertionError("the refused profile's code ran")
        words = str(err.value)
        assert words.startswith('the test\'s memory meter is recording in another thread ("meter-thread")')
        assert "this nbaccel.profile() was refused before its code ran" in words
        assert "once that one has finished" in words
    finally:
        leave.set()
        worker.join(30)
    assert not RECORDING.locked()
    with nbaccel.profile() as prof:  # free again
        torch.ones(4) + 1
    assert prof.result.op_count > 0


def test_profile_refused_while_a_dry_run_records_elsewhere_names_the_dry_run():
    """The estimate's dry runs (`dry_run._OpScratch`) were named "nbaccel's CPU memory meter", %%amp's words."""
    from nbaccel import dry_run

    worker, leave = _held_in_thread(dry_run._OpScratch, "estimate-thread")
    try:
        with pytest.raises(ProfileError) as err:
            with nbaccel.profile():
                pass
        assert str(err.value).startswith(
            'a memory estimate\'s dry run is recording in another thread ("estimate-thread")')
    finally:
        leave.set()
        worker.join(30)
    assert not RECORDING.locked()


def test_memory_meter_stands_aside_while_a_profile_records_elsewhere():
    worker, leave = _held_in_thread(nbaccel.profile, "profile-thread")
    try:
        assert RECORDING.what == "an nbaccel.profile() block" and RECORDING.thread_name == "profile-thread"
        with CpuTensorPeak() as meter:
            torch.ones(1000) + 1
        assert meter.result is None  # no measure, and the profile's holder untouched
        assert RECORDING.what == "an nbaccel.profile() block"
    finally:
        leave.set()
        worker.join(30)
    assert not RECORDING.locked() and RECORDING.what is None
