"""The plain nbaccel.profile(trace=...) under torchrun: every rank would write the same file, so
it says so. torch.distributed is faked (initialized, world size 2) while the profile is built."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import nbaccel
from nbaccel.profile import SharedTraceWarning


def _fake_world(monkeypatch, world: int = 2, rank: int = 0) -> None:
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: world)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)


def _profile_to(path) -> list[warnings.WarningMessage]:
    # Only built, not entered: with a faked process group torch's profiler would ask it for its
    # backend on start. The check runs where the trace path is given.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nbaccel.profile(trace=str(path))
    return [w for w in caught if issubclass(w.category, SharedTraceWarning)]


def test_one_trace_path_on_several_ranks_warns_and_points_at_nd_profile(tmp_path, monkeypatch):
    _fake_world(monkeypatch)
    (w,) = _profile_to(tmp_path / "x.json")
    message = str(w.message)
    assert "x.json" in message and "2 ranks" in message and "overwrites" in message
    assert "nbaccel.distributed.profile" in message
    assert w.filename == __file__  # points at the caller's line, not nbaccel's


def test_profile_with_a_trace_still_runs_without_a_process_group(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedTraceWarning)
        with nbaccel.profile(trace=str(tmp_path / "x.json")) as prof:
            torch.ones(4).sum()
    assert prof.result is not None and (tmp_path / "x.json").exists()


@pytest.mark.parametrize("name, world", [("x.rank1.json", 2), ("x.json", 1)])
def test_per_rank_path_or_single_process_does_not_warn(tmp_path, monkeypatch, name, world):
    _fake_world(monkeypatch, world=world, rank=1)
    assert _profile_to(tmp_path / name) == []


def test_without_a_process_group_it_does_not_warn(tmp_path):
    assert _profile_to(tmp_path / "x.json") == []


def test_a_folder_shared_by_the_ranks_does_not_warn(tmp_path, monkeypatch):
    # Its files are named {host}_{pid}.{ms}.pt.trace.json: every rank adds its own, none is overwritten.
    _fake_world(monkeypatch)
    assert _profile_to(tmp_path / "steps") == []


def test_torchrun_without_a_process_group_still_warns_of_one_shared_file(tmp_path, monkeypatch):
    # torchrun sets RANK / WORLD_SIZE for every worker, whether or not the script calls init_process_group.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (w,) = _profile_to(tmp_path / "one.json")
    assert "2 ranks" in str(w.message) and "overwrites" in str(w.message)
    assert _profile_to(tmp_path / "one.rank1.json") == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _profile_to(tmp_path / "one.json") == []


def test_the_folder_is_looked_at_when_the_profile_starts(tmp_path):
    # A file another rank writes into the folder while this profile runs is not an earlier run, and
    # the folder missing at the start is the one this run created, whoever made it first.
    folder = tmp_path / "runs" / "steps"
    with nbaccel.profile(trace=str(folder)) as prof:
        folder.mkdir(parents=True)
        (folder / "otherhost_1.1.pt.trace.json").write_text("{}")
        torch.ones(4).sum()
    assert prof.result.trace_earlier == [] and prof.result.trace_created == str(tmp_path / "runs")
    with nbaccel.profile(trace=str(folder)) as again:
        torch.ones(4).sum()
    assert sorted(again.result.trace_earlier) == sorted(str(f) for f in folder.iterdir()
                                                        if str(f) not in again.result.trace_files)
    assert len(again.result.trace_earlier) == 2 and again.result.trace_created is None


def test_a_folder_listing_that_fails_leaves_no_profiler_lock_behind(tmp_path, monkeypatch):
    """A review: the trace folder was listed after the process-wide recording lock was taken and before
    the try that releases it; a listing that raised (a Ctrl-C on a slow share) left every later profile
    refused as "another nbaccel.profile is recording in another thread"."""
    import sys

    profile_module = sys.modules["nbaccel.profile"]  # nbaccel.profile is the class

    def interrupted(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile_module, "_earlier_traces", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with nbaccel.profile(trace=str(tmp_path / "runs")):
            pass
    monkeypatch.undo()
    with nbaccel.profile() as prof:
        torch.ones(2) + 1
    assert prof.result is not None
    # A folder that is writable but cannot be listed: nothing is known to be earlier, the profile runs.
    monkeypatch.setattr(Path, "iterdir", lambda self: (_ for _ in ()).throw(PermissionError(13, "denied")))
    assert profile_module._earlier_traces(str(tmp_path)) == []


def test_under_torchrun_other_ranks_files_of_this_launch_are_not_earlier_runs(tmp_path, monkeypatch):
    """A rank whose profile started after another rank had written its files into the shared folder
    said they were "other runs" (the listing is taken as the profile starts). Files of other
    processes written since the launch started (the workers' parent, torchrun's agent) are this
    launch's; older files, and this process's own, are earlier runs."""
    import os
    import socket
    import sys
    import time

    profile_module = sys.modules["nbaccel.profile"]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    started = profile_module._launch_started()  # the start of pytest's parent, however long ago
    assert started is not None and started <= time.time()
    folder = tmp_path / "steps"
    folder.mkdir()
    sibling = folder / "otherhost_4242.1.pt.trace.json"  # another rank's, written just now
    sibling.write_text("{}")
    old = folder / "otherhost_17.1.pt.trace.json"  # a run before this launch
    old.write_text("{}")
    before_launch = started - 60
    os.utime(old, (before_launch, before_launch))
    own = folder / f"{socket.gethostname()}_{os.getpid()}.1.pt.trace.json"  # this process, earlier
    own.write_text("{}")
    monkeypatch.setenv("WORLD_SIZE", "1")
    single = profile_module._earlier_traces(str(folder))
    assert single == sorted(map(str, (sibling, old, own)))  # one process: every file is another run's
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert profile_module._earlier_traces(str(folder)) == sorted(map(str, (old, own)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a multi-process folder's TraceWarning is another test's
        with nbaccel.profile(trace=str(folder)) as prof:
            torch.ones(4).sum()
    assert sorted(prof.result.trace_earlier) == sorted(map(str, (old, own)))


@pytest.mark.parametrize("name", ["run.json", "run.json.gz", "steps"])
def test_a_saved_trace_is_named_as_the_file_it_is(tmp_path, name):
    """Trial 34: the saved trace's traceName was nbaccel's temporary file (/tmp/nbaccel_profile_....json)."""
    import gzip
    import json

    import nbaccel

    with nbaccel.profile(device="cpu", trace=str(tmp_path / name)) as prof:
        torch.ones(8) @ torch.ones(8)
    for f in prof.result.trace_files:
        data = gzip.open(f).read() if f.endswith(".gz") else open(f, "rb").read()
        assert json.loads(data)["traceName"] == str(Path(f).resolve())
