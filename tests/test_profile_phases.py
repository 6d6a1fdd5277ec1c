"""torch.compile compiling, compiled regions and the DataLoader in %%profile_gpu's categories and advice.

The compile traces are real (tests/data/README.md, "phase traces"): a live compile takes 6-20 s on
the 2-core VM, too slow for a test, so the rules are tested on what torch 2.13 recorded. The
DataLoader rule also runs live through IPython.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import nbaccel
from nbaccel.analysis import kernel_category, op_category
from nbaccel.analysis import phases
from nbaccel.contention import Contention
from text_helpers import unfolded

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def traces():
    return {name: nbaccel.load_trace(DATA / f"phase_{name}.json.gz") for name in
            ("compile_first_call", "compile_later_call", "dataloader_workers0", "dataloader_workers2")}


def _cats(result) -> dict[str, float]:
    return {c: t for c, t, _, _ in result.category_rows}


def _self_total_plus_gaps(result) -> float:
    return sum(result.op_columns["self_us"]) + sum(result.phase_times["data_loading_gaps"])


@pytest.mark.parametrize("name, category", [
    ("Scheduler.codegen (dynamo_timed)", "compiling"),
    ("async_compile.wait (dynamo_timed)", "compiling"),
    ("dynamo", "compiling"),
    ("inductor_compile", "compiling"),
    ("Torch-Compiled Region: 0/0", "compiled region"),
    ("CompiledFunction", "compiled region"),
    ("CompiledFunctionBackward", "compiled region"),
    ("autograd::engine::evaluate_function: CompiledFunctionBackward", "compiled region"),
    ("TorchDynamo Cache Lookup", "compiled region"),
    ("triton_poi_fused_add_0", "elementwise"),  # inductor's kernels keep their categories
    ("triton_red_fused_sum_1", "reduction"),
    ("aten::mm", "matmul/conv"),
])
def test_op_categories_of_torch_compile_events(name, category):
    assert op_category(name) == category


def test_gpu_kernel_categories_are_unchanged():
    assert kernel_category("triton_poi_fused_gelu_0") == "elementwise"
    assert kernel_category("triton_red_fused_sum_1") == "reduction"
    # a fused layer norm is a normalization, as the unfused kernels are (a CV trial: BatchNorm read "reduction")
    assert kernel_category("triton_per_fused_native_layer_norm_2") == "normalization"


def test_first_compiled_call_is_compiling_time_with_advice(traces):
    r = traces["compile_first_call"]
    compile_us = r.phase_times["compile_us"]
    assert compile_us / r.window_us > 0.99  # 20.2 s of a 20.2 s profile (a cold compile)
    cats = _cats(r)
    assert r.category_rows[0][0] == "compiling"
    # every op inside the compile ranges is compile work: their self times add up to the ranges
    assert cats["compiling"] == pytest.approx(compile_us, rel=1e-6)
    assert sum(cats.values()) == pytest.approx(_self_total_plus_gaps(r))
    advice = [a for a in r.advice if "torch.compile compiling" in a]
    assert advice == [f"{compile_us / 1e6:.2f} s (100%) of this profile was torch.compile compiling, not running "
                      "the cell: record a later step to see what the compiled code costs."]


def test_ops_traced_while_compiling_add_no_flops(traces):
    first, later = traces["compile_first_call"], traces["compile_later_call"]
    cols = first.op_columns
    fake = [i for i, (n, p) in enumerate(zip(cols["name"], first.op_phases)) if n == "aten::mm" and p == "compiling"]
    assert len(fake) >= 10  # dynamo and AOTAutograd traced the matmuls on fake tensors
    assert all(cols["flops"][i] is None for i in fake)
    assert first.header["flops"] == later.header["flops"] == 2 * 64 * 32 * 16 * 3  # the real mm: forward + 2 backward


def test_later_compiled_call_is_compiled_region_not_other(traces):
    r = traces["compile_later_call"]
    cats = _cats(r)
    assert r.category_rows[0][0] == "compiled region"
    assert cats["compiled region"] / sum(cats.values()) > 0.9  # the fused C++ kernels run inside CompiledFunction
    assert cats.get("other", 0.0) / sum(cats.values()) < 0.05
    assert r.phase_times["compile_us"] == 0 and not any("compil" in a for a in r.advice)


def test_live_profile_with_warmup_that_still_compiles_says_it_recompiled(traces):
    # A live profile's options, where the loaded trace has none recorded (warmup, steps: None)
    r = traces["compile_first_call"]
    r = dataclasses.replace(r, options=dataclasses.replace(r.options, warmup=0, steps=1))
    live = dataclasses.replace(r, loaded=None, options=dataclasses.replace(r.options, warmup=1))
    line = next(a for a in live.advice if "torch.compile compiling" in a)
    assert "it compiled again after 1 warm-up run: " in line and "TORCH_LOGS=recompiles" in line
    first = dataclasses.replace(r, loaded=None)
    assert "profile a later call (warmup=1 runs it" in next(a for a in first.advice if "torch.compile compiling" in a)
    from nbaccel.options import magic_spelling

    with magic_spelling(True):  # read while a magic runs, an API result keeps the API's spelling
        assert "(warmup=1 runs it" in next(a for a in dataclasses.replace(r, loaded=None).advice if "compiling" in a)
    again = dataclasses.replace(r, loaded=None, made_by="%%profile_gpu")  # as %%profile_gpu says it
    assert "profile a later call (--warmup 1 runs it" in next(a for a in again.advice if "compiling" in a)


def test_waiting_for_dataloader_workers_is_a_category_and_advice(traces):
    r = traces["dataloader_workers2"]
    t = r.phase_times
    assert t["data_loading_calls"] == 5 and t["data_loading_workers"]
    cats = _cats(r)
    # the main process waits in __next__ with no op running: all of it is data loading, counted once
    assert cats["data loading"] == pytest.approx(t["data_loading_us"], abs=1.0)
    assert sum(cats.values()) == pytest.approx(_self_total_plus_gaps(r))
    share = t["data_loading_us"] / r.window_us
    assert share >= 0.10
    line = next(a for a in r.advice if a.startswith("Waiting for the DataLoader"))
    assert line.startswith(f"Waiting for the DataLoader took {share:.0%} of the profiled time "
                           f"({t['data_loading_us'] / 1e3:,.1f} ms in 5 calls of __next__): its worker processes")
    assert "compete" not in line  # a loaded trace has no core count
    # the trace cannot say whether the workers persist (a trial's loader had it and was told to set it)
    assert "unless the loader has it already, persistent_workers=True (without it each pass" in unfolded(line)


def test_dataloader_advice_says_workers_compete_when_torch_threads_fill_the_cores(traces):
    r = traces["dataloader_workers2"]
    full = dataclasses.replace(r, contention=Contention(cores=2, threads=2))
    assert ("torch already runs 2 threads on the 2 CPU cores this process may use, so the workers compete with "
            "the compute for the cores") in next(a for a in full.advice if a.startswith("Waiting for the DataLoader"))
    room = dataclasses.replace(r, contention=Contention(cores=8, threads=2))
    assert "compete" not in next(a for a in room.advice if a.startswith("Waiting for the DataLoader"))


def test_single_process_dataloader_counts_its_ops_once(traces):
    r = traces["dataloader_workers0"]
    t = r.phase_times
    assert not t["data_loading_workers"]
    inside = [s for s, p in zip(r.op_columns["self_us"], r.op_phases) if p == "data loading"]
    assert len(inside) > 100  # collate's aten::stack, the dataset's indexing
    cats = _cats(r)
    # the ops inside __next__ and the time between them make up __next__'s duration, no more (to the
    # trace's rounding: Kineto writes times in us with 3 decimals)
    assert cats["data loading"] == pytest.approx(t["data_loading_us"], abs=1.0)
    assert sum(cats.values()) == pytest.approx(_self_total_plus_gaps(r))


def test_dataloader_gap_inside_an_enclosing_op_is_not_counted_twice():
    cols = {"name": ["outer", "aten::stack"], "pid": [1, 1], "tid": [1, 1], "ts_us": [0.0, 20.0],
            "dur_us": [100.0, 10.0], "parent": [-1, 0], "category": ["other", "memory copy"]}
    ann = {"name": ["enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"], "pid": [1], "tid": [1],
           "ts_us": [10.0], "dur_us": [50.0], "on_device": [False]}
    assert phases.data_loading_gaps(cols, ann) == [0.0]  # "outer"'s self time already holds it
    assert phases.op_phases(cols, ann) == [None, "data loading"]
    alone = {"name": ["aten::stack"], "pid": [1], "tid": [1], "ts_us": [20.0], "dur_us": [10.0], "parent": [-1]}
    assert phases.data_loading_gaps(alone, ann) == [40.0]


SLOW_LOADER = """
import time, torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self): return 8
    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.full((4,), float(i))
w = torch.randn(4, 4)
"""


def test_live_profile_of_a_slow_single_process_loader(run_cell, ip):
    run_cell(SLOW_LOADER)
    run_cell("%%profile_gpu -q -r prof\nfor xb in DataLoader(Slow(), batch_size=4):\n    (xb @ w).sum()")
    prof = ip.user_ns["prof"]
    t = prof.phase_times
    assert t["data_loading_calls"] == 3  # two batches and the call that ends the loop
    assert t["data_loading_us"] >= 8 * 5000  # the sleeps are inside __next__
    assert prof.category_rows[0][0] == "data loading"
    line = next(a for a in prof.advice if a.startswith("Waiting for the DataLoader"))
    assert "it loads each batch in this process" in line and "data loading" in str(prof)


def test_the_math_inside_an_attention_op_counts_as_attention(run_cell, ip):
    """A user trial: a transformer step read "attention 0.1 %": the CPU's scaled_dot_product_attention
    runs its math (bmm, softmax) as child ops, filed under matmul/conv and reduction."""
    import torch

    torch.manual_seed(0)
    ip.user_ns.update(layer=torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
                      x=torch.randn(8, 32, 64))
    run_cell("%%profile_gpu -q -r prof\nlayer(x).sum().backward()")
    prof = ip.user_ns["prof"]
    cols, cats = prof.op_columns, _cats(prof)
    inside = phases.inside_attention(cols["category"], cols["parent"], cols["name"])
    bmm_inside = sum(t for name, t, i in zip(cols["name"], cols["self_us"], inside) if i and name == "aten::bmm")
    assert bmm_inside > 0  # the forward's attention matmuls ran inside the SDPA op
    own = sum(t for c, t in zip(cols["category"], cols["self_us"]) if c == "attention")
    # and its backward: the autograd nodes of the ops it ran (BmmBackward0, SafeSoftmaxBackward0...)
    backward = phases.in_backward_of(cols, [i or c == "attention" for i, c in zip(inside, cols["category"])])
    assert {"BmmBackward0", "SafeSoftmaxBackward0"} <= {n for n, b in zip(cols["name"], backward) if b}
    assert not {n for n, b in zip(cols["name"], backward) if b} & {"AddmmBackward0", "MmBackward0", "LinearBackward0"}
    counted = sum(t for c, t, i, b in zip(cols["category"], cols["self_us"], inside, backward)
                  if c == "attention" or i or b)
    assert cats["attention"] == pytest.approx(counted) and counted >= own + bmm_inside
    # Every op inside the attention op is filed as attention, whatever the timing. (A share of the
    # measured time, asserted here before, fell under its bound when other programs took the CPU.)
    assert [p for p, i in zip(prof.op_phases, inside) if i] == ["attention"] * sum(inside)
    assert {"aten::bmm", "aten::_softmax"} <= {n for n, i in zip(cols["name"], inside) if i}


def test_the_projections_inside_the_attention_fast_path_are_matmuls(run_cell, ip):
    """A user trial: an eval-mode encoder read "attention 46%" (11% in train mode): nn.MultiheadAttention's
    inference fast path (aten::_native_multi_head_attention) runs the q/k/v and output projections inside it,
    as aten::mm / aten::addmm, two thirds of its FLOPs. They are matmul/conv, as beside the training path's
    attention op; its bmm and softmax stay attention."""
    import torch

    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 1).eval()
    ip.user_ns.update(enc=enc, x=torch.randn(4, 32, 64), torch=torch)
    run_cell("%%profile_gpu -q -r prof\nwith torch.no_grad():\n    y = enc(x)")
    prof = ip.user_ns["prof"]
    cols = prof.op_columns
    block = cols["name"].index("aten::_native_multi_head_attention")
    children = {cols["name"][i]: prof.op_phases[i] for i, p in enumerate(cols["parent"]) if p == block}
    assert children["aten::mm"] is None and children["aten::addmm"] is None  # their own category: matmul/conv
    assert children["aten::bmm"] == "attention" and children["aten::_softmax"] == "attention"
    grand = [prof.op_phases[i] for i, p in enumerate(cols["parent"]) if p >= 0 and cols["parent"][p] == block
             and cols["name"][p] == "aten::mm"]
    assert grand and set(grand) == {None}  # what a projection runs is not attention either
    cats = _cats(prof)
    mm_time = sum(t for n, t, p in zip(cols["name"], cols["self_us"], cols["parent"]) if p == block and n == "aten::mm")
    assert cats["matmul/conv"] >= mm_time > 0


def test_an_optimizer_steps_ops_count_as_optimizer_on_the_cpu(run_cell, ip):
    """A numbers audit: an MLP + AdamW step spent 35-49 % of its self time in AdamW's lerp_, addcdiv_,
    sqrt and mul_, filed under "elementwise": on the CPU torch.optim's for-loop update is plain aten
    ops, and only fused/foreach kernels' names say "optimizer". Ops inside an Optimizer.step range
    are the optimizer's; LBFGS's step runs the closure (forward and backward), so it is left out."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ip.user_ns.update(model=model, x=torch.randn(16, 32), opt=torch.optim.AdamW(model.parameters(), foreach=False),
                      lbfgs=torch.optim.LBFGS(model.parameters(), max_iter=2))
    run_cell("%%profile_gpu --warmup 1 -q -r prof\nopt.zero_grad()\nmodel(x).sum().backward()\nopt.step()")
    prof = ip.user_ns["prof"]
    cols = prof.op_columns
    ranges = phases.optimizer_step_ranges(prof._annotation_columns)
    assert ranges  # the AdamW step range
    inside = [p == "optimizer" for p in prof.op_phases]
    names_inside = {n for n, i in zip(cols["name"], inside) if i}
    assert {"aten::lerp_", "aten::addcdiv_"} <= names_inside and "aten::addmm" not in names_inside
    cats = _cats(prof)
    in_step = sum(t for t, i in zip(cols["self_us"], inside) if i)
    assert in_step > 0 and cats["optimizer"] == pytest.approx(in_step)
    # every op is counted once: the categories still add up to the self time
    assert sum(cats.values()) == pytest.approx(_self_total_plus_gaps(prof))
    # The table's category column keeps each op's kind, so the bars say why the two differ (a trial read
    # aten::add_ as "elementwise" in the table and its time under "optimizer")
    from nbaccel.render import profile as render_profile

    said = ("an op counts here under the phase it ran in (optimizer: inside Optimizer.step), whatever its kind in "
            "the op table's category column")
    assert render_profile.phase_note(prof) == said
    import html

    assert said in " ".join(str(prof).split()) and said in html.unescape(render_profile.categories_html(prof))
    assert prof.ops.set_index("name").loc["aten::lerp_", "category"] == "elementwise"
    # A closure step (Lightning calls every optimizer so): its range holds the forward and backward
    run_cell("%%profile_gpu -q -r stepped\n"
             "def closure():\n    opt.zero_grad()\n    loss = model(x).sum()\n    loss.backward()\n    return loss\n"
             "opt.step(closure)")
    closure = ip.user_ns["stepped"]
    assert "optimizer" not in {p for p in closure.op_phases}
    assert render_profile.phase_note(closure) is None  # no phase among the bars: nothing to explain
    assert _cats(closure).get("matmul/conv", 0) > 0
    run_cell("%%profile_gpu -q -r bfgs\n"
             "def closure():\n    lbfgs.zero_grad()\n    loss = model(x).sum()\n    loss.backward()\n    return loss\n"
             "lbfgs.step(closure)")
    bfgs = ip.user_ns["bfgs"]
    assert phases.optimizer_step_ranges(bfgs._annotation_columns) == {}
    assert "aten::addmm" not in {n for n, p in zip(bfgs.op_columns["name"], bfgs.op_phases) if p == "optimizer"}


def test_the_math_inside_a_norm_op_is_normalization():
    """A trial: nn.RMSNorm on the CPU read "normalization 2.0%, elementwise 75%": aten::rms_norm runs its math
    (pow, mean, rsqrt, mul) as child ops. Inside a norm op they are normalization (its backward: the next test)."""
    import torch

    norm, x = torch.nn.RMSNorm(512), torch.randn(16, 512)
    norm(x)
    with torch.no_grad(), nbaccel.profile() as prof:
        norm(x)
    cats = {c: share for c, _, _, share in prof.result.category_rows}
    assert cats.get("normalization", 0) > 95, cats
    cols = prof.result.op_columns
    inside = phases.inside_normalization(cols["category"], cols["parent"])
    assert any(inside[i] for i, n in enumerate(cols["name"]) if n in ("aten::pow", "aten::mean", "aten::rsqrt"))
    assert not any(inside[i] for i, n in enumerate(cols["name"]) if n == "aten::rms_norm")  # the op itself: its own
    assert phases.inside_normalization(["elementwise", "matmul/conv"], [-1, 0]) == [False, False]


def test_a_norm_ops_backward_is_normalization_too():
    """RMSNorm's backward on the CPU is the autograd nodes of its pow/mean/rsqrt/mul (PowBackward0...),
    outside any norm op: the breakdown filed the forward under normalization and the backward under
    elementwise and reduction. The nodes carry their forward ops' sequence numbers; the model's own
    Linear (before the norm) and its backward stay matmul/conv."""
    import torch

    torch.manual_seed(0)
    lin, norm, x = torch.nn.Linear(256, 512), torch.nn.RMSNorm(512), torch.randn(64, 256)
    norm(lin(x)).sum().backward()
    with nbaccel.profile() as prof:
        norm(lin(x)).sum().backward()
    r = prof.result
    cols = r.op_columns
    phase = {n: p for n, p in zip(cols["name"], r.op_phases) if n.endswith("Backward0") or n.endswith("Backward1")}
    assert all(phase[n] == "normalization" for n in ("PowBackward0", "RsqrtBackward0", "MeanBackward1")), phase
    assert phase["AddmmBackward0"] is None and phase["SumBackward0"] is None, phase
    cats = {c: share for c, _, _, share in r.category_rows}
    assert cats.get("elementwise", 0) < 15, cats
    seqless = dict(cols, sequence=[None] * len(cols["name"]))
    assert not any(phases.in_backward_of(seqless, [True] * len(cols["name"])))  # a trace without the numbers


def test_grad_clipping_is_not_the_optimizer_but_a_foreach_step_is():
    """A trial: clip_grad_norm_'s aten::_foreach_norm / _foreach_mul_ read as "optimizer" (the name pattern),
    though they run outside Optimizer.step; a foreach optimizer's own ops inside the step still are."""
    import torch

    m, x = torch.nn.Linear(64, 64), torch.randn(8, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, foreach=True)
    m(x).sum().backward()
    with nbaccel.profile() as prof:
        m(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    r = prof.result
    seen = {(n, p or c) for n, c, p in zip(r.op_columns["name"], r.op_columns["category"], r.op_phases)
            if n.startswith("aten::_foreach_")}
    assert ("aten::_foreach_norm", "reduction") in seen and ("aten::_foreach_mul_", "elementwise") in seen
    assert ("aten::_foreach_add_", "optimizer") in seen, seen
