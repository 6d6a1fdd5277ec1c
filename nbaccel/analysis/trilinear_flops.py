"""FLOPs of ``aten::_trilinear``: ``nn.Bilinear`` / ``F.bilinear`` forward, and its own backward.

``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim)`` lines its three operands
up in one index space (each unsqueezed at its ``expand`` dims), then, for each index ``k`` of
``unroll_dim``, multiplies ``i1`` by ``i2`` summing the ``sumdim`` dims that ``i3`` lacks, and the
result by ``i3`` summing the rest (ATen's ``Linear.cpp``, two ``sumproduct_pair`` calls per ``k``).
A ``sumproduct_pair`` with dims to sum is one ``bmm``; without, an elementwise ``mul`` that
nbaccel, like ``flop_counter``, does not count. So the count is that of the ``bmm`` calls a trace
records under the op: for ``nn.Bilinear(in1, in2, out)`` on N rows,
``out * (2*N*in1*in2 + 2*N*in2)``. ``%%profile_gpu`` counts those child ``bmm`` rows (only the
innermost op with a formula is counted); ``%%amp``'s op audit sees the op whole and counts this.
The backward is three more ``_trilinear`` calls (one per operand's gradient), counted alike.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

_SUMDIM, _UNROLL = 6, 7  # positions of sumdim and unroll_dim among the op's arguments
_UNROLL_DEFAULT = 1  # the schema's default: a call that leaves it out (F.bilinear's) passes 7 arguments


def _lined_up(shape: list[int], expand: Sequence[int], total: int) -> list[int] | None:
    """``shape`` unsqueezed at the ``expand`` dims, as ``_trilinear`` does, in a ``total``-dim space."""
    if len(shape) + len(expand) != total:
        return None
    sizes, it = [], iter(shape)
    for d in range(total):
        sizes.append(1 if d in expand else next(it))
    return sizes


def _sumproduct_pair(left: list[int], right: list[int], sum_dims: set[int]) -> tuple[int, list[int]]:
    """The FLOPs of one ``sumproduct_pair`` (the bmm it runs; 0 for a plain mul) and its result's
    sizes (summed dims kept as 1). A summed dim only one side has is summed beforehand, by a
    reduction, and leaves the matmul."""
    out = [1 if d in sum_dims else max(a, b) for d, (a, b) in enumerate(zip(left, right))]
    if not sum_dims:
        return 0, out
    batch = rows = cols = inner = 1
    for d, (a, b) in enumerate(zip(left, right)):
        if d in sum_dims:
            inner *= a if a != 1 and b != 1 else 1
        elif a != 1 and b != 1:
            batch *= a
        elif a != 1:
            rows *= a
        else:
            cols *= b
    return 2 * batch * rows * cols * inner, out


def trilinear_flops(shapes: list[list[int] | None], concrete: Sequence[Any] | None,
                    parse: Callable[[Any], Any]) -> int | None:
    """FLOPs of ``aten::_trilinear`` from its three operand shapes and its recorded list arguments
    (``concrete``: the profiler's Concrete Inputs strings, or the values themselves); None when
    they are not all known or do not fit together."""
    args = [parse(c) for c in (concrete or ())]
    if len(shapes) < 3 or any(s is None for s in shapes) or len(args) < _UNROLL:
        return None
    expands, sumdim = args[3:6], args[_SUMDIM]
    unroll = args[_UNROLL] if len(args) > _UNROLL else _UNROLL_DEFAULT
    lists = [*expands, sumdim]
    if not all(isinstance(v, (list, tuple)) and all(isinstance(d, int) for d in v) for v in lists) \
            or not isinstance(unroll, int):
        return None
    total = len(shapes[0]) + len(expands[0])
    lined = [_lined_up(s, e, total) for s, e in zip(shapes, expands)]
    if any(s is None for s in lined) or not 0 <= unroll < total:
        return None
    i1, i2, i3 = lined
    summed = {d % total for d in sumdim} - {unroll}
    sum_12 = {d for d in summed if d in expands[2]}  # the dims i3 lacks are summed in the first product
    unroll_size = max(i1[unroll], i2[unroll], i3[unroll])
    # each k of unroll_dim sees its operands narrowed to size 1 there
    i1, i2, i3 = ([1 if d == unroll else n for d, n in enumerate(s)] for s in (i1, i2, i3))
    first, buf = _sumproduct_pair(i1, i2, sum_12)
    second, _ = _sumproduct_pair(buf, i3, summed - sum_12)
    return unroll_size * (first + second) if prod(i1) and prod(i2) and prod(i3) else 0
