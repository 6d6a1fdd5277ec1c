"""The environment report: what ``python -m nbaccel env`` and ``%nbaccel_env`` print.

Versions, the device and what it supports, and the global precision flags as they are now --
the first thing to paste into a bug report, and the facts behind every speedup nbaccel shows.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from . import __version__
from .device import device_info
from .precision import global_state
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
    return str(value)


def _yes(flag) -> str:
    return "yes" if flag else "no"


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
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            gpu = device_info(f"cuda:{index}")
            sections[f"cuda:{index}"] = {
                "name": gpu.name,
                "compute capability": ".".join(map(str, gpu.compute_capability)),
                "memory": f"{gpu.total_memory / 2**30:.1f} GiB",
                "Tensor Cores": _yes(gpu.tensor_cores),
                "bf16": _yes(gpu.supports_bf16),
                "fp16": _yes(gpu.supports_fp16),
                "TF32": _yes(gpu.supports_tf32),
            }
        try:
            sections["software"]["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else "n/a"
        except RuntimeError:
            pass
    else:
        sections["gpu"] = {"CUDA available": "no -- nbaccel measures on the CPU (CPU autocast, CPU profiler, process RSS)"}
    sections["global precision flags (now)"] = dict(global_state())
    return EnvReport(sections)
