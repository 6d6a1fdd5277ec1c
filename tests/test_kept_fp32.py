"""Matmuls inside an op autocast keeps in fp32 (nbaccel/kept_fp32.py).

A trial: %%profile_gpu of `torch.cdist(x, y)` (61-dim points) said "fp32 matmul/conv take 30% of
CPU time: try %%amp" and "K=63 -> 64 (for a GPU or bf16 autocast)", though --amp bf16 left that
mm in fp32: cdist is on autocast's fp32 list, and its mm's K is the points' dim + 2.
"""

from __future__ import annotations

import re

import pytest
import torch

import nbaccel
from nbaccel.kept_fp32 import KEPT_FP32, kept_fp32_by

_MATMULS = {"aten::mm", "aten::bmm", "aten::addmm"}
x, y, A = torch.randn(64, 61), torch.randn(64, 61), torch.randn(64, 64)
# each kept op's own call, and ops without an fp32 rule that run matmuls inside (autocast casts those)
_KEPT_CALLS = {"aten::cdist": lambda: torch.cdist(x, y), "aten::pinverse": lambda: torch.pinverse(x),
               # v's head dim beside q's and k's: the CPU's math fallback, which computes in fp32
               "aten::_scaled_dot_product_attention_math": lambda: torch.nn.functional.scaled_dot_product_attention(
                   A.view(1, 1, 64, 64), A.view(1, 1, 64, 64), A[:, :32].reshape(1, 1, 64, 32))}
_CAST_CALLS = {"aten::einsum": lambda: torch.einsum("ij,jk->ik", A, A),
               "aten::linalg_matrix_power": lambda: torch.linalg.matrix_power(A, 3),
               # pinverse's inner op, called on its own: no fp32 rule (a review found it listed)
               "aten::linalg_pinv": lambda: torch.linalg.pinv(x)}


def _matmul_rows_under_autocast(run):
    """(profile result, rows of the innermost matmul calls) of ``run`` under CPU bf16 autocast."""
    with nbaccel.profile(device="cpu", amp="bf16") as prof:
        run()
    ops = prof.result.op_columns
    inner = [i for i, name in enumerate(ops["name"]) if name in _MATMULS
             and not any(ops["parent"][j] == i and ops["name"][j] in _MATMULS for j in range(len(ops["name"])))]
    return prof.result, inner


@pytest.mark.parametrize("op", sorted(_KEPT_CALLS))
def test_each_listed_op_keeps_its_matmuls_in_fp32_under_autocast(op):
    assert op in KEPT_FP32["cpu"]
    result, rows = _matmul_rows_under_autocast(_KEPT_CALLS[op])
    assert rows and {result.op_columns["dtype"][i] for i in rows} == {"fp32"}
    assert all(result.kept_fp32_by[i] == op for i in rows)


@pytest.mark.parametrize("op", sorted(_CAST_CALLS))
def test_ops_that_pass_autocast_on_are_not_listed(op):
    result, rows = _matmul_rows_under_autocast(_CAST_CALLS[op])
    assert rows and {result.op_columns["dtype"][i] for i in rows} == {"bf16"}
    assert op not in KEPT_FP32["cpu"] and not any(result.kept_fp32_by[i] for i in rows)


def test_only_the_cdist_family_is_listed_for_cuda():
    """CUDA's autocast reference puts cdist on its fp32 list, not pinverse (its matmuls are cast there)."""
    assert KEPT_FP32["cuda"] == {"aten::cdist", "aten::_cdist_forward", "aten::_euclidean_dist"}
    ops = {"name": ["aten::pinverse", "aten::linalg_pinv", "aten::mm"], "parent": [-1, 0, 1]}
    assert kept_fp32_by(ops, "cuda") == [None, None, None]
    assert kept_fp32_by(ops, "cpu") == ["aten::pinverse"] * 3
    alone = {"name": ["aten::linalg_pinv", "aten::mm"], "parent": [-1, 0]}
    assert kept_fp32_by(alone, "cpu") == [None, None]


def test_profile_gpu_of_cdist_sends_nobody_to_amp_or_to_padding(run_cell, ip, cpu_with_bf16_and_fp16_units):
    ip.user_ns.update(x=torch.randn(1024, 61), y=torch.randn(1024, 61), torch=torch)
    _, out = run_cell("%%profile_gpu -r prof\nd = torch.cdist(x, y)")
    prof = ip.user_ns["prof"]
    assert not any(a.startswith("fp32 matmul/conv ops take") for a in prof.advice)
    assert not any("pad to" in a for a in prof.advice)
    [entry] = [e for e in prof.unaligned if e["op"] == "aten::mm"]
    assert entry["unaligned"] == {"K": 63} and entry["kept_fp32_by"] == "aten::cdist"
    text = " ".join(next(o.data for o in out.outputs if "text/plain" in o.data)["text/plain"].split())
    assert "K=63 -> 64 (inside aten::cdist, which autocast keeps in fp32: no tiles for it on the CPU)" in text
    assert "or under bf16 autocast (AMX tiles" not in text
    # a plain fp32 matmul beside it is still sent to %%amp
    ip.user_ns["w"] = torch.randn(768, 768)
    run_cell("%%profile_gpu -q -r prof\nd = torch.cdist(x, y)\nfor _ in range(4): w @ w")
    line = next(a for a in ip.user_ns["prof"].advice if a.startswith("fp32 matmul/conv ops take"))
    assert "aten::mm" in line and "try %%amp" in line
    # The table's aten::mm row holds the cdist's call too: the line says what it left out, so the shares add up
    # (a trial read aten::bmm 3.4% in the table and 2.2% in this line).
    prof = ip.user_ns["prof"]
    counted = float(re.search(r"\(aten::mm ([0-9.]+)%", line).group(1))
    inside = float(re.search(r"not counted, as autocast cannot cast them: aten::mm ([0-9.]+)% inside aten::cdist",
                             line).group(1))
    table = prof.ops.groupby("name")["percent"].sum()["aten::mm"]
    assert counted + inside == pytest.approx(table, abs=0.11)


def test_the_backward_of_a_kept_op_is_kept_too():
    """A trial's attention math fallback: its forward bmm were left out of "try %%amp", and the bmm of
    its BmmBackward0 nodes (fp32, as the forward's tensors are), a quarter of the time, counted in."""
    q = torch.randn(2, 2, 64, 64, requires_grad=True)
    v = torch.randn(2, 2, 64, 32, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with nbaccel.profile(device="cpu") as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, v).sum().backward()
        (w @ w).sum().backward()  # a matmul's own backward: castable
    ops, kept = prof.result.op_columns, prof.result.kept_fp32_by
    nodes = [i for i, name in enumerate(ops["name"]) if name in ("BmmBackward0", "MmBackward0")]
    by_node = {ops["name"][i]: {kept[j] for j, p in enumerate(ops["parent"]) if p == i} for i in nodes}
    assert by_node == {"BmmBackward0": {"aten::_scaled_dot_product_attention_math's backward"},
                       "MmBackward0": {None}}
    assert {kept[i] for i in nodes} == {"aten::_scaled_dot_product_attention_math's backward", None}
    # a trace without sequence numbers: the forward alone, as before
    seqless = dict(ops, sequence=[None] * len(ops["name"]))
    assert not any(k and k.endswith("backward") for k in kept_fp32_by(seqless, "cpu"))
