"""scaled_dot_product_attention's math fallback in a profile (nbaccel/attention_advice.py).

A trial: a cell of F.scaled_dot_product_attention with v's head dim 32 beside q's and k's 64 ran
torch's math fallback, and %%profile_gpu said "fp32 matmul/conv take 31% of CPU time: try %%amp";
under --amp bf16 it said the same, though the fallback computes bf16 in fp32 on the CPU. A training
nn.TransformerEncoderLayer (dropout 0.1 by default) takes the fallback on the CPU at every step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nbaccel
from nbaccel.attention_advice import MATH_FALLBACK, cpu_reasons, fallback_note
from text_helpers import unfolded

B, H, L, D = 2, 4, 128, 64
_MATH, _FLASH = 0, 1  # torch.nn.attention.SDPBackend.MATH, FLASH_ATTENTION


def _qkv(v_dim: int = D, dims: int = 4):
    shape = (B, H, L) if dims == 4 else (H, L)
    return torch.randn(*shape, D), torch.randn(*shape, D), torch.randn(*shape, v_dim)


# Each reason nbaccel names, the call that has it, and the same call without it.
_CASES = {
    "dropout_p=0.1": (lambda: (*_qkv(), 0.1), lambda: (*_qkv(), 0.0)),
    "head dims q 64, k 64, v 32": (lambda: (*_qkv(v_dim=32), 0.0), lambda: (*_qkv(), 0.0)),
    "3-D inputs": (lambda: (*_qkv(dims=3), 0.0), lambda: (*_qkv(), 0.0)),
}


def _profiled(q, k, v, dropout_p):
    with nbaccel.profile(device="cpu") as prof:
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    return prof.result


@pytest.mark.parametrize("reason", sorted(_CASES))
def test_each_reason_named_is_one_torch_itself_falls_back_on(reason):
    """The reasons come from the recorded arguments; each is checked against torch's own choice of
    kernel, so a torch that lifts one (a fused CPU kernel with dropout) fails here, not in a user's
    advice."""
    with_it, without = (make() for make in _CASES[reason])
    q, k, v, p = with_it
    assert torch._fused_sdp_choice(q, k, v, dropout_p=p) == _MATH
    assert torch._fused_sdp_choice(*without[:3], dropout_p=without[3]) == _FLASH
    result = _profiled(*with_it)
    rows = [i for i, n in enumerate(result.op_columns["name"]) if n == MATH_FALLBACK]
    assert rows
    reasons = cpu_reasons(result.op_columns["input_dims"][rows[0]], result.op_columns["concrete_inputs"][rows[0]])
    assert len(reasons) == 1 and reasons[0].startswith(reason)
    assert MATH_FALLBACK not in _profiled(*without).op_columns["name"]


def test_profile_gpu_names_the_fallback_instead_of_sending_the_user_to_amp(run_cell, ip):
    ip.user_ns.update(dict(zip("qkv", _qkv(v_dim=32))), torch=torch)
    _, out = run_cell("%%profile_gpu -r prof\nout = torch.nn.functional.scaled_dot_product_attention(q, k, v)")
    advice = ip.user_ns["prof"].advice
    line = next(a for a in advice if a.startswith("scaled_dot_product_attention ran torch's math fallback"))
    assert f"({MATH_FALLBACK}, 1 call, " in line and "head dims q 64, k 64, v 32" in line
    assert "computes bf16/fp16 in fp32, so autocast does not speed it up" in line
    assert "sdpa_kernel(SDPBackend.FLASH_ATTENTION)" in line
    # its bmm calls are matmul/conv ops in fp32, but autocast would not change them
    assert not any(a.startswith("fp32 matmul/conv ops take") for a in advice)
    shown = next(o.data for o in out.outputs if "text/html" in o.data)  # as the notebook shows it
    assert "math fallback" in unfolded(shown["text/plain"]) and "math fallback" in unfolded(shown["text/html"])


def test_a_fused_call_gets_no_fallback_line(run_cell, ip):
    ip.user_ns.update(dict(zip("qkv", _qkv())), torch=torch)
    run_cell("%%profile_gpu -q -r prof\nout = torch.nn.functional.scaled_dot_product_attention(q, k, v)")
    assert MATH_FALLBACK not in ip.user_ns["prof"].op_columns["name"]
    assert not any("math fallback" in a for a in ip.user_ns["prof"].advice)


def test_a_training_encoder_layer_takes_the_fallback_for_its_dropout(run_cell, ip):
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    ip.user_ns.update(layer=layer, x=torch.randn(4, 128, 64))
    run_cell("%%profile_gpu -q -r prof\nlayer(x).sum().backward()")
    line = next((a for a in ip.user_ns["prof"].advice if "math fallback" in a), None)
    ops = ip.user_ns["prof"].op_columns
    rows = [i for i, n in enumerate(ops["name"]) if n == MATH_FALLBACK]
    assert rows  # the layer's attention ran the fallback ...
    share = sum(ops["dur_us"][i] for i in rows) / ip.user_ns["prof"].time_total_us
    if share >= 0.10:  # ... and is named where it is a tenth of the time, with its dropout
        assert line is not None and "dropout_p=0.1" in line
    else:
        assert line is None


def test_under_the_recipe_fp32_matmuls_are_not_sent_to_the_recipe(run_cell, ip, cpu_with_bf16_and_fp16_units):
    """A trial's --amp bf16 profile was told "try %%amp (or --amp bf16 here)"."""
    ip.user_ns.update(w=torch.randn(256, 256), torch=torch)
    code = "with torch.autocast('cpu', enabled=False):\n    for _ in range(3): w @ w"
    run_cell("%%profile_gpu -q -r prof --amp bf16\n" + code)
    line = next(a for a in ip.user_ns["prof"].advice if a.startswith("fp32 matmul/conv ops take"))
    assert "(aten::mm " in line and "under the bf16 recipe: autocast left them in fp32" in line
    assert "try" not in line and "--amp" not in line
    run_cell("%%profile_gpu -q -r prof\n" + code)
    line = next(a for a in ip.user_ns["prof"].advice if a.startswith("fp32 matmul/conv ops take"))
    assert "try %%amp (or --amp bf16 here)" in line


def test_on_a_gpu_no_cpu_reason_is_given_and_torch_is_asked_instead():
    """CUDA's fused kernels have other conditions than the CPU's (flash takes dropout): nbaccel names
    none from the trace there, only the way to have torch say them."""
    ops = {"name": ["aten::scaled_dot_product_attention", MATH_FALLBACK], "parent": [-1, 0],
           "dur_us": [100.0, 90.0], "device_total_us": [80.0, 80.0],
           "input_dims": [[[2, 4, 8, 64]] * 3, [[2, 4, 8, 64], [2, 4, 8, 64], [2, 4, 8, 32]]],
           "concrete_inputs": [["", "", "", "", "0.1"], ["", "", "", "", "0.1"]]}
    line = fallback_note(ops, total=100.0, on_device=True, where="device")
    assert "80% of device time" in line and "dropout_p" not in line and "head dims" not in line
    assert "SDPBackend.EFFICIENT_ATTENTION" in line and "bf16/fp16 in fp32" not in line
    assert fallback_note(ops, total=1000.0, on_device=True, where="device") is None  # 8%: under a tenth


def test_a_dropout_argument_is_not_said_to_be_turned_off_by_eval(run_cell, ip):
    """A trial: an eval-mode model passing dropout_p=self.drop to F.scaled_dot_product_attention was told
    "model.eval() turns it off"; eval() changes no argument."""
    ip.user_ns.update(dict(zip("qkv", _qkv())), torch=torch)
    run_cell("%%profile_gpu -q -r prof\nout = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)")
    advice = ip.user_ns["prof"].advice
    line = next(a for a in advice if "math fallback" in a)
    assert "dropout_p=0.1 (the fused kernel takes no dropout: outside training pass 0.0" in line
    assert "model.eval()" not in line
    dropout = next((a for a in advice if a.startswith("Dropout takes")), None)
    if dropout is not None:  # the mask and scaling are a fifth of the time or more (they are on 2 cores)
        assert "but not scaled_dot_product_attention's dropout_p argument" in dropout


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_amp_names_the_fallback_as_why_attentions_matmuls_stayed_fp32(run_cell, ip, dtype,
                                                                     cpu_with_bf16_and_fp16_units):
    """A trial: %%amp on the fallback said "the time goes to ops autocast keeps in fp32" and "their inputs
    were cast back, or they ran outside the autocast region": autocast cast q, k and v, and the CPU's math
    fallback computed them in fp32."""
    ip.user_ns.update(dict(zip("qkv", _qkv(v_dim=32))), torch=torch)
    run_cell(f"%%amp -q -r res --dtype {dtype} --repeat 3\n"
             "out = torch.nn.functional.scaled_dot_product_attention(q, k, v)\nout.sum()")
    advice = ip.user_ns["res"].advice
    line = next(a for a in advice if a.startswith("scaled_dot_product_attention ran torch's math fallback"))
    assert f"on the CPU it computes {dtype} inputs in fp32, so its aten::bmm calls stayed fp32" in line
    # a trial followed "%%profile_gpu names the one here" to a profile that named none (under its 10% rule)
    assert "%%profile_gpu" not in line and "in train mode" in unfolded(line)
    assert not any("ops autocast keeps in fp32" in a for a in advice)
    heavy = next(a for a in advice if a.startswith("Heavy ops still in fp32"))
    assert "(the math fallback's bmm calls above among them; any others had their inputs cast back" in heavy
    # a fused call: nothing of the kind
    ip.user_ns.update(dict(zip("qkv", _qkv())))
    run_cell(f"%%amp -q -r res --dtype {dtype} --repeat 3\n"
             "out = torch.nn.functional.scaled_dot_product_attention(q, k, v)\nout.sum()")
    assert not any("math fallback" in a for a in ip.user_ns["res"].advice)


_HAND = """
s = q @ k.transpose(-2, -1) / 8.0
s = s.masked_fill(~mask, float("-inf"))
o = torch.softmax(s, dim=-1) @ v
"""


@pytest.mark.parametrize("cell", [
    _HAND,
    "o = torch.einsum('bhij,bhjd->bhid', (torch.einsum('bhid,bhjd->bhij', q, k) / 8).softmax(-1), v)",
    "o, w = mha(x, x, x)",  # need_weights=True, the default: bmm, softmax, bmm
])
def test_attention_written_out_by_hand_is_sent_to_sdpa(run_cell, ip, cell):
    """A trial: hand-written causal attention (46 ms where F.scaled_dot_product_attention(is_causal=True) took
    28 ms on the same shapes) got "try %%amp" alone."""
    q, k, v = _qkv()
    ip.user_ns.update(q=q, k=k, v=v, mask=torch.ones(L, L, dtype=torch.bool).tril(), torch=torch,
                      mha=torch.nn.MultiheadAttention(64, 4, batch_first=True), x=torch.randn(8, 128, 64))
    run_cell("%%profile_gpu -q -r prof\n" + cell)
    line = next(a for a in ip.user_ns["prof"].advice if a.startswith("Attention written out by hand"))
    assert "1 time, the first product " in line and "F.scaled_dot_product_attention(q, k, v" in line
    assert "need_weights=False" in line and "dropout_p=0 only" not in line


@pytest.mark.parametrize("cell", [
    "o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)",
    "o, w = mha(x, x, x, need_weights=False)",
    "p = torch.softmax(q @ k.transpose(-2, -1), -1)",  # no product by the probabilities
    "o = torch.softmax(q @ k.transpose(-2, -1), -1).sum(-1, keepdim=True) * (q @ q.transpose(-2, -1))",
])
def test_no_hand_written_attention_where_there_is_none(run_cell, ip, cell):
    q, k, v = _qkv()
    ip.user_ns.update(q=q, k=k, v=v, torch=torch, mha=torch.nn.MultiheadAttention(64, 4, batch_first=True),
                      x=torch.randn(8, 128, 64))
    run_cell("%%profile_gpu -q -r prof\n" + cell)
    assert not any(a.startswith("Attention written out by hand") for a in ip.user_ns["prof"].advice)


def test_hand_written_attention_with_dropout_is_told_the_cpu_kernel_takes_none(run_cell, ip):
    q, k, v = _qkv()
    ip.user_ns.update(q=q, k=k, v=v, torch=torch)
    run_cell("%%profile_gpu -q -r prof\n"
             "o = torch.nn.functional.dropout(torch.softmax(q @ k.transpose(-2, -1), -1), 0.1) @ v")
    line = next(a for a in ip.user_ns["prof"].advice if a.startswith("Attention written out by hand"))
    assert "(on the CPU with dropout_p=0 only: its fused kernel takes no dropout" in line



@pytest.mark.parametrize("cell", [
    "o = (x2 @ w1).softmax(-1) @ w2",  # a classifier's (bias-free Linear) probabilities times a matrix
    "o = (x2 @ router).softmax(-1) @ experts",  # an MoE router's gate weights times the experts' outputs
    "s = q @ k.transpose(-2, -1)\no = s.softmax(2) @ v",  # over the queries: no attention SDPA computes
])
def test_matmul_softmax_matmul_that_is_no_attention_is_not_called_attention(run_cell, ip, cell):
    """A review's false positives of the shape-only match."""
    q, k, v = _qkv()
    ip.user_ns.update(q=q, k=k, v=v, x2=torch.randn(2048, 256), w1=torch.randn(256, 1000), w2=torch.randn(1000, 128),
                      router=torch.randn(256, 8), experts=torch.randn(8, 256), torch=torch)
    run_cell("%%profile_gpu -q -r prof\n" + cell)
    assert not any(a.startswith("Attention written out by hand") for a in ip.user_ns["prof"].advice)
