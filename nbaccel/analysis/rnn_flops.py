"""FLOPs of recurrent layers (LSTM, GRU, RNN) from their recorded shapes.

Why a formula is possible: every gate of every step is a matmul with one of the layer's weight
matrices, and the profiler records those matrices' shapes (``Tensor[]`` arguments come as a list
of shapes). Per token (a time step of one sequence) and per layer and direction, the input
projection costs ``2 * (gates*H) * I_layer`` and the recurrent one ``2 * (gates*H) * H_r``, plus
``2 * P * H`` for an LSTM projection (``proj_size``); that is 2 FLOPs per element of each 2-D
weight matrix. So, whatever the gate count (4 LSTM, 3 GRU, 1 RNN), layers or directions::

    forward = 2 * tokens * sum(rows * cols of the 2-D weight matrices)

with ``tokens`` = T * B for a padded batch (``[T, B, I]`` or batch-first ``[B, T, I]``) and the
packed length for a ``PackedSequence`` (``[N, I]``). As everywhere in nbaccel (and
``torch.utils.flop_counter``), biases, gate nonlinearities and the elementwise cell update are
not counted: they are O(gates*H) per token next to O(gates*H*(I+H)) for the matmuls.

Backward is twice the forward: the gradient w.r.t. the gate inputs (through ``W_ih`` and
``W_hh``) and w.r.t. the weights each repeat every forward matmul once. The fused kernels
compute the first unconditionally (oneDNN's LSTM backward always produces ``diff_src``; PyTorch
runs cuDNN's backward-data pass "unconditionally, because it mutates reserve"), and the second
when the weights need a gradient (``_cudnn_rnn_backward``'s ``output_mask[3]``).

Which ops record this:

* ``aten::lstm`` / ``aten::gru`` / ``aten::rnn_tanh`` / ``aten::rnn_relu``: the layer call, on
  every device. On the CPU a GRU or RNN (and an LSTM with ``proj_size`` or a packed input) runs
  as ``aten::linear``/``aten::mm`` calls nested inside it, which are counted instead (only the
  innermost op with a formula counts), so this formula counts only where nothing inside does.
* ``aten::mkldnn_rnn_layer`` (+ ``_backward``): the CPU LSTM, one call per layer and direction.
  Only ``weight0``/``weight1`` (W_ih, W_hh) are read: without biases the two bias slots carry
  other tensors.
* ``aten::_cudnn_rnn`` (+ ``_backward``): CUDA, the whole stack in one call; checked against the
  op schema (``input, weight[], ...``), not yet against a recorded CUDA trace.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

__all__ = ["RNN_OPS", "rnn_flops"]

_LAYER_OPS = frozenset({"aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu"})
_MKLDNN = "aten::mkldnn_rnn_layer"
_MKLDNN_BWD = "aten::mkldnn_rnn_layer_backward"
_CUDNN = "aten::_cudnn_rnn"
_CUDNN_BWD = "aten::_cudnn_rnn_backward"
RNN_OPS = _LAYER_OPS | {_MKLDNN, _MKLDNN_BWD, _CUDNN, _CUDNN_BWD}
_CUDNN_BWD_MASK = 21  # position of output_mask (input, hx, cx, weight) in _cudnn_rnn_backward


def _dims(value: Any) -> list[int] | None:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(x, int) for x in value):
        return None
    return list(value)


def _tokens(dims: Sequence[Any]) -> int | None:
    """Sequence steps times batch: [T, B, I] and [B, T, I] alike, or a packed [N, I]."""
    x = _dims(dims[0]) if dims else None
    return prod(x[:-1]) if x is not None and len(x) in (2, 3) else None


def _matrix_elements(shapes: Sequence[Any]) -> int | None:
    """Elements of the 2-D weight matrices in a ``Tensor[]`` argument (biases are 1-D)."""
    if not isinstance(shapes, (list, tuple)):
        return None
    mats = [s for s in map(_dims, shapes) if s is not None and len(s) == 2]
    return sum(r * c for r, c in mats) if mats else None


def _forward(dims: Sequence[Any], weights: Sequence[Any] | None) -> int | None:
    tokens, elements = _tokens(dims), _matrix_elements(weights or [])
    return None if tokens is None or elements is None else 2 * tokens * elements


def rnn_flops(name: str, dims: Sequence[Any], concrete: Sequence[Any] | None,
              parse: Callable[[Any], Any]) -> int | None:
    """FLOPs of recurrent op ``name`` (one of `RNN_OPS`), or None if the shapes do not fit.

    ``parse`` turns one ``Concrete Inputs`` string into a value (op_flops' parser).
    """
    if not dims:
        return None
    if name in _LAYER_OPS:
        # .input(input [T,B,I], hx, params, ...) or .data(data [N,I], batch_sizes, hx, params, ...)
        x = _dims(dims[0])
        at = 2 if x is not None and len(x) == 3 else 3
        return _forward(dims, dims[at] if len(dims) > at else None)
    if name in (_MKLDNN, _MKLDNN_BWD):
        fwd = _forward(dims, dims[1:3])  # weight0/weight1 (backward: weight1/weight2) = W_ih, W_hh
        return fwd if name == _MKLDNN or fwd is None else 2 * fwd
    if name not in (_CUDNN, _CUDNN_BWD):
        return None
    fwd = _forward(dims, dims[1] if len(dims) > 1 else None)  # _cudnn_rnn(input, weight[], ...)
    if name == _CUDNN or fwd is None:
        return fwd
    mask = parse(concrete[_CUDNN_BWD_MASK]) if concrete and len(concrete) > _CUDNN_BWD_MASK else None
    if not (isinstance(mask, (list, tuple)) and len(mask) == 4):
        return None  # without output_mask we cannot tell whether the weight gradients ran
    return fwd * (2 if mask[3] else 1)
