"""The environment report: what ``python -m nbaccel env`` and ``%nbaccel_env`` print.

Versions, the device and what it supports, and the global precision flags as they are now --
the first thing to paste into a bug report, and the facts behind every speedup nbaccel shows.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass

import torch

from . import __version__
from .device import device_info
from .memory import current_rss, format_bytes
from .precision import global_state
from .snapshot import available_host_memory
from .results import ResultMixin


@dataclass
class EnvReport(ResultMixin):
    kind = "env"
    sections: dict

    def _payload(self) -> dict:
        return {"sections": {k: {kk: _plain(vv) for kk, vv in v.items()} for k, v in self.sections.items()}}


def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return str(value)


# The flags torch reads and sets as a pair (`precision.global_state`), with each half's name: the report showed
# "(False, torch.bfloat16)" and "(True, True)", which says nothing of which half is which.
_PAIR_NAMES = {"autocast.": ("enabled", "dtype"), "deterministic_algorithms": ("enabled", "warn_only"),
               "anomaly_mode": ("enabled", "check_nan"), "_reduced_precision_reduction": ("allowed", "split_k")}


def _named_pair(key: str, value):
    """A pair-valued flag as {name: value} (`_PAIR_NAMES`); any other value as it is."""
    if not (isinstance(value, tuple) and len(value) == 2):
        return value
    names = next((names for part, names in _PAIR_NAMES.items() if part in key), ("value", "second"))
    return dict(zip(names, value))


class ByteSizes(dict):
    """Sizes in bytes under machine-readable names (``physical_bytes``, ...): --json gives the numbers, which a
    script can compare (it gave "16 GiB physical, ..." as prose), and the report shows them as one row of words
    (`words`)."""

    LABELS = {"physical_bytes": "physical", "available_bytes": "available",
              "process_rss_bytes": "RSS of this process", "total_bytes": "total"}

    def words(self) -> str:
        return ", ".join(f"{format_bytes(size)} {self.LABELS.get(name, name)}" for name, size in self.items())


def _memory_row(total: int | None) -> ByteSizes | None:
    """The host's memory as the budgets see it: physical (``total``), available now (MemAvailable), this
    process's RSS."""
    if not total:
        return None
    sizes = ByteSizes(physical_bytes=total)
    available, rss = available_host_memory(), current_rss()
    if available:
        sizes["available_bytes"] = available
    if rss:
        sizes["process_rss_bytes"] = rss
    return sizes


def _yes(flag) -> str:
    return "yes" if flag else "no"


NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"


def nvidia_driver_version(path: str | None = None) -> str | None:
    """The NVIDIA kernel driver's version, e.g. "550.54.15", from the first line of
    /proc/driver/nvidia/version (Linux: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ...", or
    "... Open Kernel Module for x86_64  550.54.15 ..."); None where there is no such file or line. torch has
    no getter for it (``torch.cuda.driver_version`` does not exist in torch 2.13). Never raises."""
    try:
        with open(path or NVIDIA_VERSION_FILE, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except (OSError, ValueError):
        return None
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)\b", first)
    return match.group(1) if match else None


def env_report() -> EnvReport:
    software = {
        "nbaccel": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA (torch built with)": torch.version.cuda or "none (CPU build)",
        "cuDNN": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "n/a",
        "platform": platform.platform(),
    }
    sections = {"software": software}
    cpu = device_info("cpu")
    sections["cpu"] = {
        "name": cpu.name,
        "ISA level used by torch": cpu.cpu_features.get("capability"),
        "AMX-BF16": _yes(cpu.cpu_features.get("amx_bf16")),
        "AVX512-BF16": _yes(cpu.cpu_features.get("avx512_bf16")),
        "AMX-FP16": _yes(cpu.cpu_features.get("amx_fp16")),
        "AVX512-FP16": _yes(cpu.cpu_features.get("avx512_fp16")),
        "threads": torch.get_num_threads(),
    }
    memory = _memory_row(cpu.total_memory)
    if memory:
        sections["cpu"]["memory"] = memory
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            gpu = device_info(f"cuda:{index}")
            sections[f"cuda:{index}"] = {
                "name": gpu.name,
                "compute capability": ".".join(map(str, gpu.compute_capability)),
                "memory": ByteSizes(total_bytes=gpu.total_memory),
                "Tensor Cores": _yes(gpu.tensor_cores),
                "bf16": _yes(gpu.supports_bf16),
                "fp16": _yes(gpu.supports_fp16),
                "TF32": _yes(gpu.supports_tf32),
            }
        sections["software"]["driver"] = nvidia_driver_version() or "not known"
    else:
        sections["gpu"] = {"CUDA available": "no -- nbaccel measures on the CPU (CPU autocast, CPU profiler, process RSS)"}
    sections["global precision flags (now)"] = {key: _named_pair(key, value) for key, value in global_state().items()}
    return EnvReport(sections)
