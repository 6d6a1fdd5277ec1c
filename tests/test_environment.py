"""The env report's NVIDIA driver version, read from /proc/driver/nvidia/version (faked here)."""

from __future__ import annotations

import pytest
import torch

import nbaccel.environment as environment
from nbaccel.device import DeviceInfo
from nbaccel.environment import env_report, nvidia_driver_version

PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
               "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16-I3-C07-3-1)"
        "  Thu Jul 10 2025\nGCC version:  gcc version 13.3.0\n")
ARM = "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.86.10  Release Build\n"


@pytest.mark.parametrize("text, version", [(PROPRIETARY, "550.54.15"), (OPEN, "580.159.04"), (ARM, "570.86.10"),
                                           ("", None), ("something else entirely 1.2.3\n", None),
                                           ("GCC version:  gcc version 12.2.0\n" + PROPRIETARY, None)])
def test_the_driver_version_is_read_from_the_first_line(tmp_path, text, version):
    path = tmp_path / "version"
    path.write_text(text)
    assert nvidia_driver_version(str(path)) == version


def test_no_file_or_an_unreadable_one_is_not_known_and_never_raises(tmp_path):
    assert nvidia_driver_version(str(tmp_path / "missing")) is None
    assert nvidia_driver_version(str(tmp_path)) is None  # a directory: IsADirectoryError
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00NVRM")
    assert nvidia_driver_version(str(tmp_path / "binary")) is None


def test_the_report_shows_it_with_a_gpu(tmp_path, monkeypatch):
    """torch 2.13 has no torch.cuda.driver_version, so the report said "n/a" on every GPU machine."""
    path = tmp_path / "version"
    path.write_text(PROPRIETARY)
    cpu = DeviceInfo("cpu", None, "a CPU", cpu_features={"capability": "AVX2"})
    gpu = DeviceInfo("cuda", 0, "NVIDIA H200", compute_capability=(9, 0), total_memory=141 * 2**30,
                     supports_bf16=True, supports_fp16=True, supports_tf32=True, tensor_cores=True)
    monkeypatch.setattr(environment, "device_info", lambda spec: gpu if str(spec).startswith("cuda") else cpu)
    monkeypatch.setattr(environment, "global_state", lambda: {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(environment, "NVIDIA_VERSION_FILE", str(path))
    assert env_report().sections["software"]["driver"] == "550.54.15"
    monkeypatch.setattr(environment, "NVIDIA_VERSION_FILE", str(tmp_path / "missing"))
    assert env_report().sections["software"]["driver"] == "not known"


@pytest.mark.parametrize("args", [["env"], ["env", "--json"]])
def test_the_cli_stops_quietly_when_its_reader_has_gone(args):
    """A user trial: `python -m nbaccel env | head -1` ended with a BrokenPipeError traceback. Here
    the pipe's reading end is closed before the report is written, as when the reader exits first."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "nbaccel", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 1  # as Python's own exit status on EPIPE (its docs' "Note on SIGPIPE")
