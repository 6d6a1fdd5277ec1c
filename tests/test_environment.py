"""The env report's NVIDIA driver version, read from /proc/driver/nvidia/version (faked here)."""
from __future__ import annotations

import json
import re

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
    report = env_report()
    assert report.sections["software"]["driver"] == "550.54.15"
    assert json.loads(report.to_json())["sections"]["cuda:0"]["memory"] == {"total_bytes": 141 * 2**30}
    assert re.search(r"\nmemory +141 GiB total\n", str(report))
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


def test_paired_flags_name_their_second_half_in_every_form(monkeypatch):
    """A trial read "autocast.cpu (False, torch.bfloat16)" and "anomaly_mode (False, True)": which half is the
    mode? Each pair shows the flag first and names its companion; --json keeps both halves by name."""
    from nbaccel.render import env as render_env

    torch.use_deterministic_algorithms(False, warn_only=True)
    try:
        report = env_report()
    finally:
        torch.use_deterministic_algorithms(False)
    flags = report.sections["global precision flags (now)"]
    text = render_env.text(report)
    assert "autocast.cpu                                        False (dtype: torch.bfloat16)" in text
    assert "deterministic_algorithms                            False (warn_only: True)" in text
    if "anomaly_mode" in flags and isinstance(flags["anomaly_mode"], dict):  # torch with check_nan
        assert "False (check_nan: True)" in text
    assert "(False," not in text and "(True," not in text
    assert "False (dtype: torch.bfloat16)" in render_env.html(report)
    payload = report.to_dict()["sections"]["global precision flags (now)"]
    assert payload["autocast.cpu"] == {"enabled": False, "dtype": "torch.bfloat16"}
    assert payload["deterministic_algorithms"] == {"enabled": False, "warn_only": True}
    assert payload["float32_matmul_precision"] == torch.get_float32_matmul_precision()  # a single value stays one


def test_the_cpu_section_gives_the_memory_a_budget_is_measured_against(monkeypatch):
    """%memory_budget 50% reads "of this host's 23.5 GiB of physical memory": the report had no memory line.
    The report shows it as words; --json gives each size in bytes (it gave the words, which no script can
    compare)."""
    from nbaccel.render import env as render_env

    monkeypatch.setattr(environment, "available_host_memory", lambda: 3 * 2**30)
    monkeypatch.setattr(environment, "current_rss", lambda: 300 * 2**20)
    cpu = DeviceInfo("cpu", None, "a CPU", cpu_features={"capability": "AVX2"}, total_memory=16 * 2**30)
    monkeypatch.setattr(environment, "device_info", lambda spec: cpu)
    report = env_report()
    assert re.search(r"\nmemory +16 GiB physical, 3 GiB available, 300 MiB RSS of this process\n", render_env.text(report))
    assert "16 GiB physical, 3 GiB available, 300 MiB RSS of this process" in render_env.html(report)
    assert json.loads(report.to_json())["sections"]["cpu"]["memory"] == {
        "physical_bytes": 16 * 2**30, "available_bytes": 3 * 2**30, "process_rss_bytes": 300 * 2**20}
    monkeypatch.setattr(environment, "available_host_memory", lambda: None)  # no /proc/meminfo
    monkeypatch.setattr(environment, "current_rss", lambda: None)
    assert env_report().sections["cpu"]["memory"] == {"physical_bytes": 16 * 2**30}
    monkeypatch.setattr(environment, "device_info", lambda spec: DeviceInfo("cpu", None, "a CPU", cpu_features={}))
    assert "memory" not in env_report().sections["cpu"]
