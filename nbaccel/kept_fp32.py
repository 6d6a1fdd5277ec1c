"""Matmuls that autocast leaves in fp32 because an op around them is on its fp32 list.

Autocast acts on the outermost op that has a rule: ``torch.cdist`` is on the fp32 list (CUDA's and
the CPU's), so the ``aten::mm`` it runs inside ``aten::_euclidean_dist`` stays fp32 under any
recipe, and its K is the points' dim + 2 (the squared norms ride along). A trial's profile of a
cdist cell read "fp32 matmul/conv take 30% of CPU time: try %%amp" and "K=63 -> 64", though
``--amp bf16`` left that mm in fp32. An op without a rule of its own passes autocast on to what
it calls (``einsum``'s ``bmm``, ``linalg_matrix_power``'s ``mm`` run in bf16), so only the ops
listed here keep their matmuls in fp32; tests/test_kept_fp32.py checks each against torch's
autocast on the CPU. On CUDA only the cdist family is listed: its fp32 rule is in torch's autocast
op reference; ``pinverse`` has none there, so its matmuls are cast. The CPU's attention math
fallback is listed too: not for an autocast rule, but because it computes in fp32 whatever its
inputs' dtype, which is the same for the advice ("try %%amp" cannot help it).
"""

from __future__ import annotations

from .analysis.phases import backward_node_makers, inside_rows

_CDIST = frozenset({"aten::cdist", "aten::_cdist_forward", "aten::_euclidean_dist"})
# pinverse is on the CPU's fp32 list; linalg_pinv, which it calls, is not: torch.linalg.pinv's own mm runs in
# bf16 under autocast, and only the linalg_pinv inside a pinverse is kept (by the pinverse around it)
# scaled_dot_product_attention's math fallback on the CPU computes bf16/fp16 inputs in fp32 (attention_advice):
# autocast casts q, k and v, and its bmm calls still run in fp32. On CUDA it runs in the inputs' dtype.
KEPT_FP32 = {"cpu": _CDIST | {"aten::pinverse", "aten::_scaled_dot_product_attention_math"}, "cuda": _CDIST}


def kept_fp32_by(ops: dict, device_type: str) -> list[str | None]:
    """For each op: the outermost op around it (or itself) that autocast keeps in fp32 on
    ``device_type``, whose matmuls stay fp32 whatever the recipe; "<op>'s backward" for the autograd
    nodes such an op's forward made and the ops nested in them (their inputs are the forward's fp32
    tensors: a trial's attention fallback had its forward bmm left out of "try %%amp" and its
    BmmBackward0's bmm, a quarter of the time, counted in); None for the others."""
    kept = KEPT_FP32.get(device_type, _CDIST)
    names, parent = ops["name"], ops["parent"]
    out: list[str | None] = [None] * len(names)
    if kept.isdisjoint(names):  # most profiles have none: a C-speed scan, no walk
        return out
    for i in inside_rows(parent, [j for j, name in enumerate(names) if name in kept]):
        j = i
        while j >= 0:
            if names[j] in kept:
                out[i] = names[j]
            j = parent[j]
    makers = backward_node_makers(ops, lambda row: out[row] is not None)
    for i in inside_rows(parent, makers):
        j = i
        while j not in makers:  # the node it is nested in
            j = parent[j]
        out[i] = f"{out[makers[j]]}'s backward"
    return out
