"""Peak table lookup: device-name matching and FLOP/s per dtype from the packaged CSV."""
import csv
from pathlib import Path

import pytest

from nbaccel.analysis import GpuPeaks, load_peak_table, lookup_gpu, peak_flops

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PACKAGED = Path(__file__).resolve().parents[1] / "nbaccel" / "data" / "gpu_peaks.csv"


@pytest.mark.parametrize(
    "device_name, row",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB"),
        ("NVIDIA A100-PG509-200", "A100 SXM4 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("NVIDIA B200", "B200"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("NVIDIA H200", "H200 SXM"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10G", "A10G (AWS)"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"),
    ],
)
def test_lookup_known_names(device_name, row):
    gpu = lookup_gpu(device_name)
    assert isinstance(gpu, GpuPeaks)
    assert gpu.gpu == row
    assert gpu.device_name == device_name
    assert gpu.source  # every row cites where its numbers come from


@pytest.mark.parametrize(
    "device_name",
    ["NVIDIA H800", "NVIDIA H200 NVL", "NVIDIA H100", "NVIDIA GB200", "Tesla V100-DGXS-32GB",
     "NVIDIA GeForce RTX 3090 Ti", "AMD Instinct MI300X", "", None],
)
def test_unknown_or_ambiguous_names_get_none(device_name):
    # not in the table (or ambiguous): no borrowed numbers
    assert lookup_gpu(device_name) is None


def test_compute_capability_and_memory_checks():
    assert lookup_gpu("NVIDIA H100 80GB HBM3", (9, 0)).gpu == "H100 SXM"
    assert lookup_gpu("NVIDIA H100 80GB HBM3", "9.0").gpu == "H100 SXM"
    assert lookup_gpu("NVIDIA H100 80GB HBM3", (8, 0)) is None  # inconsistent -> reject
    assert lookup_gpu("NVIDIA A100-SXM4", total_memory_bytes=84990623744).gpu == "A100 SXM4 80GB"
    assert lookup_gpu("NVIDIA A100-SXM4", total_memory_bytes=42_300_000_000).gpu == "A100 SXM4 40GB"
    assert lookup_gpu("NVIDIA GH200 480GB", total_memory_bytes=102e9).gpu == "GH200 (96GB HBM3)"


def test_peak_flops_values_in_flops_per_second():
    h100 = lookup_gpu("NVIDIA H100 80GB HBM3")
    assert peak_flops(h100, "bf16") == pytest.approx(989.4e12)
    assert peak_flops(h100, "fp16") == pytest.approx(989.4e12)
    assert peak_flops(h100, "tf32") == pytest.approx(494.7e12)
    assert peak_flops(h100, "fp32") == pytest.approx(67e12)
    assert peak_flops(h100, "fp8") == pytest.approx(1978.9e12)
    assert peak_flops(h100, "int8") == pytest.approx(1978.9e12)
    h200 = lookup_gpu("NVIDIA H200")
    assert peak_flops(h200, "bf16") == pytest.approx(989e12)
    assert h200.memory_gb == 141
    a100 = lookup_gpu("NVIDIA A100-SXM4-80GB")
    assert peak_flops(a100, "tf32") == pytest.approx(156e12)
    assert peak_flops(a100, "bfloat16") == pytest.approx(312e12)
    assert peak_flops(a100, "fp8") is None  # no FP8 on Ampere
    b200 = lookup_gpu("NVIDIA B200")
    assert peak_flops(b200, "bf16") == pytest.approx(2250e12)
    v100 = lookup_gpu("Tesla V100-SXM2-16GB")
    assert peak_flops(v100, "fp16") == pytest.approx(125e12)
    assert peak_flops(v100, "bf16") is None  # Volta tensor cores have no bf16 mode
    assert peak_flops(v100, "tf32") is None
    assert peak_flops(h100, "fp64") is None  # no column
    assert peak_flops(None, "bf16") is None


def test_packaged_table_is_the_shared_one():
    shared = DATA / "gpu_peaks.csv"
    if not shared.exists():
        pytest.skip(f"reference data not found at {shared}")
    assert PACKAGED.read_bytes() == shared.read_bytes()


def test_table_rows_all_have_sources():
    table = load_peak_table()
    assert len(table) == 19
    with open(PACKAGED, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert all(r["source"].strip() for r in rows)
    assert "H200 SXM" in table
