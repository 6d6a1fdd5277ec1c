"""GPU-trace analysis core: kernel classification, peaks, FLOPs from shapes, trace metrics.

Python and numpy over column lists (pandas only where a DataFrame is asked for); these modules
import no torch, though importing them as ``nbaccel.analysis`` runs ``nbaccel/__init__.py``, which
does. Traces recorded elsewhere are analysed on any machine, no GPU needed; the live
``%%profile_gpu`` uses the same code on the trace it just exported.
"""
from .kernels import CATEGORIES, kernel_category, op_category, uses_tensor_cores
from .metrics import (
    FlopsSummary,
    Share,
    TensorCoreShare,
    achieved_flops,
    busy_time,
    category_breakdown,
    communication_share,
    op_table,
    summary,
    tensor_core_share,
)
from .op_flops import FLOP_OPS, dtype_of, op_flops
from .peaks import GpuPeaks, load_peak_table, lookup_gpu, normalize_dtype, peak_flops
from .trace import TraceData, TraceError, TraceWarning, load_trace

__all__ = [
    "CATEGORIES",
    "FLOP_OPS",
    "FlopsSummary",
    "GpuPeaks",
    "Share",
    "TensorCoreShare",
    "TraceData",
    "TraceError",
    "TraceWarning",
    "achieved_flops",
    "busy_time",
    "category_breakdown",
    "communication_share",
    "dtype_of",
    "kernel_category",
    "load_peak_table",
    "load_trace",
    "lookup_gpu",
    "normalize_dtype",
    "op_category",
    "op_flops",
    "op_table",
    "peak_flops",
    "summary",
    "tensor_core_share",
    "uses_tensor_cores",
]
