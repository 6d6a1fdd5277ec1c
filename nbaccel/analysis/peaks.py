"""Peak FLOP/s of known NVIDIA GPUs, for "achieved vs peak" figures.

The numbers live in ``nbaccel/data/gpu_peaks.csv`` (dense, sourced per row; see
``nbaccel/data/README.md``).  Nothing is hard-coded here: a GPU that is not in the table gets
``None``, never a neighbour's numbers, because a wrong peak makes every utilisation figure wrong
while looking authoritative.

Device names are matched the way Lightning's ``get_available_flops`` does (substrings of the
lower-cased ``torch.cuda.get_device_name()`` / trace ``deviceProperties[].name``), with memory
size used only to split variants that share a name stem (A100 40 GB vs 80 GB, GH200 96 vs 141 GB).
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["GpuPeaks", "lookup_gpu", "peak_flops", "load_peak_table", "normalize_dtype"]

_CSV = Path(__file__).resolve().parents[1] / "data" / "gpu_peaks.csv"


@dataclass(frozen=True)
class GpuPeaks:
    """One row of the peak table. TFLOPS/TOPS as published (dense); ``None`` = unsupported."""

    gpu: str
    compute_capability: str
    fp32_tflops: float | None
    tf32_tflops: float | None
    fp16_bf16_tflops: float | None
    fp8_tflops: float | None
    int8_tops: float | None
    memory_gb: float | None
    bandwidth_tbs: float | None
    source: str
    device_name: str | None = None  # the name string that was matched, if any

    @property
    def cc_tuple(self) -> tuple[int, int]:
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)


def _num(text: str) -> float | None:
    text = (text or "").strip()
    return float(text) if text else None


@lru_cache(maxsize=None)
def load_peak_table(path: str | None = None) -> dict[str, GpuPeaks]:
    """Rows of ``gpu_peaks.csv`` keyed by their ``gpu`` column (cached: read once)."""
    rows: dict[str, GpuPeaks] = {}
    with open(path or _CSV, newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            rows[r["gpu"]] = GpuPeaks(
                gpu=r["gpu"],
                compute_capability=r["compute_capability"],
                fp32_tflops=_num(r["fp32_tflops"]),
                tf32_tflops=_num(r["tf32_tflops_dense"]),
                fp16_bf16_tflops=_num(r["fp16_bf16_tflops_dense"]),
                fp8_tflops=_num(r["fp8_tflops_dense"]),
                int8_tops=_num(r["int8_tops_dense"]),
                memory_gb=_num(r["memory_gb"]),
                bandwidth_tbs=_num(r["bandwidth_tbs"]),
                source=r["source"],
            )
    return rows


def _row_key(name: str, total_memory_bytes: int | None) -> str | None:
    """Map a device name to a table row, or None when the table has no matching row."""
    n = name.lower()
    big = total_memory_bytes is not None and total_memory_bytes > 60e9
    # Order matters: "gh200" contains "h200", "gb200" contains "b200", "a100" contains "a10".
    if "gh200" in n:
        if "hbm3e" in n or "144g" in n or "141g" in n or (
            total_memory_bytes is not None and total_memory_bytes > 120e9
        ):
            return "GH200 (141GB HBM3e)"
        if "96g" in n or "hbm3" in n or total_memory_bytes is not None:
            return "GH200 (96GB HBM3)"
        return None
    if "h200" in n:
        return None if "nvl" in n else "H200 SXM"  # H200 NVL is not in the table
    if "h100" in n:
        if "nvl" in n:
            return None
        if "pcie" in n or "hbm2e" in n:
            return "H100 PCIe"
        if "hbm3" in n or "sxm" in n:
            return "H100 SXM"
        return None  # bare "H100": SXM and PCIe differ by 30 %, do not guess
    if "gb200" in n:
        return None
    if "b200" in n:
        return "B200"
    if "a100" in n:
        if "pg509-200" in n:  # HTA trace: 40 GB A100 SXM4 board (42.3e9 B)
            return "A100 SXM4 40GB"
        if "80gb" in n:
            eighty = True
        elif "40gb" in n:
            eighty = False
        else:
            eighty = big
        pcie = "pcie" in n
        return f"A100 {'PCIe' if pcie else 'SXM4'} {'80GB' if eighty else '40GB'}"
    if "a10g" in n:
        return "A10G (AWS)"
    if re.search(r"\ba10\b", n):
        return "A10"
    if "l40s" in n:
        return "L40S"
    if re.search(r"\bl4\b", n):
        return "L4"
    if re.search(r"\bt4\b", n):
        return "T4"
    if re.search(r"rtx 3090(?! ti)", n):  # 3090 Ti has different clocks
        return "GeForce RTX 3090"
    if re.search(r"rtx 4090(?! d)", n):
        return "GeForce RTX 4090"
    if "v100" in n:
        if "pcie" in n:
            return "V100 PCIe"
        if "sxm2" in n or "sxm" in n:
            return "V100 SXM2"
        return None  # e.g. V100-DGXS (DGX Station clocks differ), V100S: not in the table
    return None


def lookup_gpu(
    name: str | None,
    compute_capability: str | tuple[int, int] | float | None = None,
    total_memory_bytes: int | None = None,
) -> GpuPeaks | None:
    """Peak numbers for a device name such as ``"NVIDIA H100 80GB HBM3"``, or ``None``.

    ``compute_capability`` (``"9.0"``, ``(9, 0)`` or ``9.0``) is a consistency check: when given
    and different from the matched row's, the match is rejected (a renamed or unknown part).
    ``total_memory_bytes`` only splits memory variants of the same chip.
    """
    if not name:
        return None
    key = _row_key(name, total_memory_bytes)
    if key is None:
        return None
    row = load_peak_table().get(key)
    if row is None:
        return None
    if compute_capability is not None:
        if isinstance(compute_capability, tuple):
            cc = f"{compute_capability[0]}.{compute_capability[1]}"
        else:
            cc = f"{float(compute_capability):.1f}"
        if cc != row.compute_capability:
            return None
    return GpuPeaks(**{**row.__dict__, "device_name": name})


_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp8": "fp8", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8",
    "torch.float8_e4m3fn": "fp8", "torch.float8_e5m2": "fp8",
    "int8": "int8", "torch.int8": "int8",
}


def normalize_dtype(dtype: object) -> str | None:
    """``"bfloat16"``, ``torch.bfloat16`` or ``"bf16"`` -> ``"bf16"``; unknown -> None."""
    return _DTYPE_ALIASES.get(str(dtype).lower())


def peak_flops(gpu: GpuPeaks | None, dtype: object) -> float | None:
    """Dense peak in FLOP/s (not TFLOP/s) of ``gpu`` for ``dtype``, or ``None``.

    fp32 is the CUDA-core rate; tf32/bf16/fp16/fp8 are tensor-core rates with fp32 accumulate;
    int8 is ops/s.  bf16 is ``None`` before Ampere: the V100/T4 column is fp16 only.
    """
    if gpu is None:
        return None
    d = normalize_dtype(dtype)
    if d is None:
        return None
    if d == "bf16" and gpu.cc_tuple < (8, 0):
        return None
    value = {
        "fp32": gpu.fp32_tflops,
        "tf32": gpu.tf32_tflops,
        "bf16": gpu.fp16_bf16_tflops,
        "fp16": gpu.fp16_bf16_tflops,
        "fp8": gpu.fp8_tflops,
        "int8": gpu.int8_tops,
    }[d]
    return None if value is None else value * 1e12
