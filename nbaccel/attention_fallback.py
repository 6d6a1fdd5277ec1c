"""``scaled_dot_product_attention``'s math fallback, found in a profile, and what made torch take it.

``F.scaled_dot_product_attention`` (and ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``,
which call it) runs a fused kernel where its conditions hold (CPU: flash; CUDA: flash,
memory-efficient, cuDNN) and otherwise ``aten::_scaled_dot_product_attention_math``: the
Lq x Lk score matrix in memory, with separate matmul, softmax and dropout ops. On the CPU the
fallback also computes bf16/fp16 inputs in fp32 (a trial's ``%%profile_gpu --amp bf16`` still
read its ``aten::bmm`` in fp32), so autocast does not speed it up: the fp32-matmul advice leaves
its ops out (`inside_fallback`) and this note says why instead.

A training ``nn.TransformerEncoderLayer`` takes the fallback on the CPU at every step: its
default dropout of 0.1 reaches the attention, and the CPU's fused kernel takes no dropout.

The reasons named are the CPU kernel's conditions that a trace records, each checked with torch
2.13's ``torch._fused_sdp_choice`` (tests/test_attention_fallback.py): ``dropout_p > 0``, q/k/v
head dims that differ, inputs that are not 4-D. Others (a last dim whose stride is not 1; on
CUDA, each kernel's own list) are not in the trace, and torch names them itself when asked: a call
run under ``torch.nn.attention.sdpa_kernel`` with only the fused backends allowed raises "No
available kernel" after a warning per reason.
"""

from __future__ import annotations

from .analysis.op_flops import parse_concrete
from .analysis.phases import inside_rows

MATH_FALLBACK = "aten::_scaled_dot_product_attention_math"
# The fallback's share of the profiled time from which it gets a line: a tenth, as the other
# share-based rules in profile_advice.
FALLBACK_SHARE = 0.10
_DROPOUT = 4  # position of dropout_p among the recorded arguments (q, k, v, attn_mask, dropout_p, ...)


def fallback_rows(names: list) -> list[int]:
    return [i for i, name in enumerate(names) if name == MATH_FALLBACK]


def inside_fallback(ops: dict) -> list[bool]:
    """Whether each op is the math fallback or runs inside it."""
    flags = [False] * len(ops["name"])
    rows = fallback_rows(ops["name"])
    for i in inside_rows(ops["parent"], rows) if rows else ():  # most profiles have none: no walk
        flags[i] = True
    return flags


def cpu_reasons(dims, concrete) -> list[str]:
    """What in one call's recorded arguments keeps the CPU's fused kernel away."""
    reasons = []
    args = [parse_concrete(c) for c in (concrete or ())]
    dropout = args[_DROPOUT] if len(args) > _DROPOUT else None
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
        # model.eval() does not change an argument: a trial's eval-mode GPT passed dropout_p=self.drop
        reasons.append(f"dropout_p={dropout:g} (the fused kernel takes no dropout: outside training pass 0.0, as "
                       "nn.MultiheadAttention does, e.g. dropout_p=self.p if self.training else 0.0)")
    shapes = [d for d in (dims or [])[:3] if isinstance(d, list) and d]
    if len(shapes) == 3:
        if any(len(s) != 4 for s in shapes):
            reasons.append(f"{len(shapes[0])}-D inputs (the fused kernel takes [batch, heads, seq, head dim])")
        elif len({s[-1] for s in shapes}) > 1:
            q, k, v = (s[-1] for s in shapes)
            reasons.append(f"head dims q {q}, k {k}, v {v} (the fused kernel needs one head dim for all three)")
    return reasons


def fallback_note(ops: dict, total: float, on_device: bool, where: str) -> str | None:
    """The line for a profile whose attention ran the math fallback for at least `FALLBACK_SHARE` of
    ``total`` (the time shares are of), else None."""
    rows = fallback_rows(ops["name"])
    if not rows or total <= 0:
        return None
    inclusive = ops["device_total_us"] if on_device else ops["dur_us"]
    share = sum(inclusive[i] for i in rows) / total
    if share < FALLBACK_SHARE:
        return None
    calls = f"{len(rows)} call{'s' if len(rows) != 1 else ''}"
    line = (f"scaled_dot_product_attention ran torch's math fallback ({MATH_FALLBACK}, {calls}, {share:.0%} of "
            f"{where} time in its forward), not a fused kernel: it holds the whole score matrix in memory and runs "
            "matmul, softmax and dropout as separate ops")
    if on_device:
        backends = "SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION"
        return (line + f". torch names its reasons if one call runs under torch.nn.attention.sdpa_kernel([{backends}]) "
                "(it raises after a warning per reason).")
    reasons = []
    for i in rows:
        for reason in cpu_reasons(ops["input_dims"][i], ops["concrete_inputs"][i]):
            if reason not in reasons:
                reasons.append(reason)
    line += "; on the CPU it computes bf16/fp16 in fp32, so autocast does not speed it up"
    recorded = f". Recorded here: {'; '.join(reasons)}" if reasons else ""
    return (line + recorded + ". torch names its reasons if one call runs under "
            "torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION) (it raises after a warning per reason).")
