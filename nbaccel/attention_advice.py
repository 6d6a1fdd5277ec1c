"""Attention in a profile that could run faster: ``scaled_dot_product_attention``'s math fallback
(and what made torch take it), and attention written out by hand.

``F.scaled_dot_product_attention`` (and ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``,
which call it) runs a fused kernel where its conditions hold (CPU: flash; CUDA: flash,
memory-efficient, cuDNN) and otherwise ``aten::_scaled_dot_product_attention_math``: the
Lq x Lk score matrix in memory, with separate matmul, softmax and dropout ops. On the CPU the
fallback also computes bf16/fp16 inputs in fp32 (a trial's ``%%profile_gpu --amp bf16`` still
read its ``aten::bmm`` in fp32), so autocast does not speed it up: the fp32-matmul advice leaves
its ops out (it is among `kept_fp32`'s ops on the CPU) and this note says why instead.

Attention written out by hand -- ``softmax(q @ k.transpose(-2, -1) / sqrt(d)) @ v``, its einsum form,
and ``nn.MultiheadAttention`` asked for its weights (``need_weights=True``, the default) -- runs the
same separate ops (`handwritten_note`): found as a batched matmul whose Lq x Lk result a softmax over
its last dim takes, and a batched matmul that takes the softmax's Lq x Lk output, on one thread,
outside any attention op. (Unbatched 2-D attention, one head and one sequence, is left out: it is
an mm -> softmax -> mm like a classifier's or an MoE router's.) ``python -m benchmarks.bench_attention``
measures the two side by side (a causal 4x8x128x64 fp32 attention by hand: 1.48x SDPA's time on
the project's 2-core VM, docs/benchmarks.md).

A training ``nn.TransformerEncoderLayer`` takes the fallback on the CPU at every step: its
default dropout of 0.1 reaches the attention, and the CPU's fused kernel takes no dropout.

The reasons named are the CPU kernel's conditions that a trace records, each checked with torch
2.13's ``torch._fused_sdp_choice`` (tests/test_attention_advice.py): ``dropout_p > 0``, q/k/v
head dims that differ, inputs that are not 4-D. Others (a last dim whose stride is not 1; on
CUDA, each kernel's own list) are not in the trace, and torch names them itself when asked: a call
run under ``torch.nn.attention.sdpa_kernel`` with only the fused backends allowed raises "No
available kernel" after a warning per reason.
"""

from __future__ import annotations

from .analysis.op_flops import parse_concrete
from .analysis.phases import inside_rows

MATH_FALLBACK = "aten::_scaled_dot_product_attention_math"
# The share of the profiled time from which the fallback, or attention written by hand, gets a line: a
# tenth, as the other share-based rules in profile_advice.
ATTENTION_SHARE = 0.10
_DROPOUT = 4  # position of dropout_p among the recorded arguments (q, k, v, attn_mask, dropout_p, ...)


def fallback_rows(names: list) -> list[int]:
    return [i for i, name in enumerate(names) if name == MATH_FALLBACK]


def inside_fallback(ops: dict) -> list[bool]:
    """Whether each op is the math fallback or runs inside it."""
    flags = [False] * len(ops["name"])
    if MATH_FALLBACK not in ops["name"]:  # most profiles have none: a C-speed scan, no walk
        return flags
    for i in inside_rows(ops["parent"], fallback_rows(ops["name"])):
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
    """The line for a profile whose attention ran the math fallback for at least `ATTENTION_SHARE` of
    ``total`` (the time shares are of), else None."""
    if MATH_FALLBACK not in ops["name"] or total <= 0:
        return None
    rows = fallback_rows(ops["name"])
    inclusive = ops["device_total_us"] if on_device else ops["dur_us"]
    share = sum(inclusive[i] for i in rows) / total
    if share < ATTENTION_SHARE:
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


# The innermost batched matmul ops. Batched only: a classifier's or an MoE router's `(x @ W).softmax(-1) @ E`
# is an mm -> softmax -> mm too (a review found both called attention); attention has heads or a batch.
_PRODUCTS = frozenset({"aten::bmm", "aten::baddbmm"})
_SOFTMAX = "aten::_softmax"  # what softmax(), F.softmax and Tensor.softmax run: (self, dim, half_to_float)


def _operands(name: str, dims) -> tuple[list, list] | None:
    """The two matrix operands of a product row (baddbmm's come after the input it adds to)."""
    shapes = list(dims or [])[1:3] if name == "aten::baddbmm" else list(dims or [])[:2]
    if len(shapes) == 2 and all(isinstance(d, list) and len(d) >= 2 for d in shapes):
        return shapes[0], shapes[1]
    return None


def handwritten_attention(ops: dict, in_attention: list) -> list[tuple[int, int]]:
    """(first product row, second product row) of each attention written out by hand: a matmul whose
    result's last two dims a softmax takes, then a matmul whose first operand has them, on one thread,
    none of them inside an attention op (``in_attention``: per row, whether it runs inside one)."""
    names, dims = ops["name"], ops["input_dims"]
    concrete = ops.get("concrete_inputs") or [None] * len(names)  # softmax's dim is recorded there
    threads: dict = {}
    for i, name in enumerate(names):
        if (name in _PRODUCTS or name == _SOFTMAX) and not in_attention[i]:
            threads.setdefault((ops["pid"][i], ops["tid"][i]), []).append(i)
    found = []
    for rows in threads.values():
        rows.sort(key=lambda i: ops["ts_us"][i])
        last = pending = None  # (row, its result's last two dims); (that row, the softmax's last two dims)
        for i in rows:
            if names[i] == _SOFTMAX:
                shape = (dims[i] or [None])[0]
                scores = tuple(shape[-2:]) if isinstance(shape, list) and len(shape) >= 2 else None
                # over the keys, the last dim: a softmax over the queries (dim 1) is no attention SDPA computes
                dim = parse_concrete(concrete[i][1]) if concrete[i] and len(concrete[i]) > 1 else None
                last_dim = isinstance(dim, int) and scores is not None and dim in (-1, len(shape) - 1)
                pending = (last[0], scores) if last and last_dim and last[1] == scores else None
                continue
            operands = _operands(names[i], dims[i])
            if operands is None:
                last = pending = None
                continue
            a, b = operands
            if pending and (a[-2], a[-1]) == pending[1]:
                found.append((pending[0], i))
                pending = None
            last = (i, (a[-2], b[-1]))
    return found


def handwritten_note(ops: dict, in_attention, time_col: str, total: float, where: str,
                     on_device: bool) -> str | None:
    """The line for hand-written attention taking at least `ATTENTION_SHARE` of ``total``, else None.
    ``in_attention()`` gives the per-row flags `handwritten_attention` needs, asked only when a softmax ran."""
    if _SOFTMAX not in ops["name"] or total <= 0:  # a C-speed scan: most profiles have no softmax
        return None
    pairs = handwritten_attention(ops, in_attention())
    if not pairs:
        return None
    ts, dur, key = ops["ts_us"], ops["dur_us"], lambda i: (ops["pid"][i], ops["tid"][i])
    windows: dict = {}
    for first, second in pairs:
        windows.setdefault(key(first), []).append((ts[first], ts[second] + dur[second]))
    spent, dropout = 0.0, False  # the own time of the ops from the first product's start to the second one's end
    for i in range(len(ops["name"])):
        for start, end in windows.get(key(i), ()):
            if start <= ts[i] and ts[i] + dur[i] <= end:
                spent += ops[time_col][i]
                dropout = dropout or "dropout" in ops["name"][i] or "bernoulli" in ops["name"][i]
                break
    share = spent / total
    if share < ATTENTION_SHARE:
        return None
    a, b = _operands(ops["name"][pairs[0][0]], ops["input_dims"][pairs[0][0]])
    product = " @ ".join("x".join(map(str, d)) for d in (a, b))
    times = f"{len(pairs)} time{'s' if len(pairs) != 1 else ''}"
    # with dropout on the attention weights, the CPU's SDPA runs its math fallback (see above): no gain there
    caveat = (" (on the CPU with dropout_p=0 only: its fused kernel takes no dropout, and the attention here "
              "drops some)" if dropout and not on_device else "")
    return (f"Attention written out by hand (a matmul, a softmax of its result and a matmul by that, outside "
            f"scaled_dot_product_attention: {times}, the first product {product}) takes {share:.0%} of {where} "
            "time in its forward: F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...) runs it as one "
            f"fused kernel{caveat}, without the score matrix in memory. (nn.MultiheadAttention runs this way when it "
            "returns its weights, need_weights=True, its default: if this is one, pass need_weights=False.)")
