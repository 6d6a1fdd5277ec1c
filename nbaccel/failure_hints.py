"""What to try when a cell fails only in reduced precision: torch's refusals, read and answered.

`%%amp` and `%%profile_gpu --amp` (and `compare_amp` from Python) add the hint to the message that
says which run raised; the cell's own exception is shown unchanged. Plain torch and the device
description only: no IPython, so scripts get the same words as a note on the exception.
"""

from __future__ import annotations

import re

from .device import device_info
from .options import option

# torch's words when a Python number is written into an fp16 tensor and is out of its range (at:: before 2.1).
_HALF_OVERFLOW = re.compile(r"cannot be converted to type (c10|at)::Half without overflow")

# oneDNN's refusal to build a kernel, naming its primitive ("... for the LSTM forward propagation primitive").
_NO_PRIMITIVE = re.compile(r"could not create a primitive descriptor for (?:the |an? )?(?P<what>[\w ]+?) "
                           r"(?:forward|backward)")


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or "" for an exception whose ``__str__`` raises (the user's: nbaccel only reads it)."""
    try:
        return str(exc)
    except Exception:  # an exception whose __str__ raises: nothing to read
        return ""


def failure_hint(exc: BaseException, device="cpu") -> str | None:
    """The fix for a cell that raised under autocast on ``device``, when nbaccel knows one, else None."""
    return overflow_hint(exc) or cpu_kernel_hint(exc, device)


def overflow_hint(exc: BaseException) -> str | None:
    """The fix for a number fp16 cannot hold, when ``exc`` is torch's refusal to write one, else None.

    The usual case is a mask's "minus infinity" (``scores.masked_fill(~mask, -1e9)``): fine in fp32,
    but under fp16 autocast ``scores`` is fp16, and torch raises rather than round -1e9 to -inf."""
    # the user's __str__ may raise: no hint then, rather than that error in place of theirs
    if not _HALF_OVERFLOW.search(message_of(exc)):
        return None
    return ("fp16's largest finite value is 65504, so a constant beyond it (such as -1e9 for a mask) cannot be "
            "written into an fp16 tensor: use torch.finfo(x.dtype).min (the most negative value x's own dtype "
            f"holds), or bf16 ({option('dtype', 'bf16')}), whose range is fp32's")


def cpu_kernel_hint(exc: BaseException, device="cpu") -> str | None:
    """The fix when oneDNN has no reduced-precision kernel for an op on this CPU, else None.

    CPU autocast sends nn.LSTM to oneDNN's bf16 RNN, which needs AVX512-BF16 or AMX: on a CPU with
    neither (AVX2-only machines: most laptops and older servers) torch raises "could not create a
    primitive descriptor for the LSTM forward propagation primitive", a message that names neither
    the dtype nor a way out. The same module runs in fp32 inside the autocast region."""
    found = _NO_PRIMITIVE.search(message_of(exc))
    if found is None:
        return None
    info = device_info(device)
    if info.type != "cpu":
        return None
    units = ("this CPU has neither AVX512-BF16 nor AMX, and oneDNN found no such kernel for it"
             if not info.has_bf16_units else "oneDNN has none for it on this CPU")
    what = found.group("what")
    module = "nn.LSTM" if what.upper() == "LSTM" else what
    return (f"oneDNN (torch's CPU kernels) could not build a reduced-precision {what} kernel: {units}. Keep that "
            f"module in fp32 inside the autocast region, e.g. `with torch.autocast('cpu', enabled=False): "
            f"out, _ = lstm(x.float())` around the {module} call; the rest of the cell still runs in reduced precision")
