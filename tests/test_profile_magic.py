"""%%profile_gpu through a real InteractiveShell: every option, the CPU fallback, traces, faults, widget."""

from __future__ import annotations

import json
import re
from html import unescape as html_unescape
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError

import nbaccel
from nbaccel.analysis import load_trace
from nbaccel.device import cpu_flags, device_info
from nbaccel.render import display as display_module
from nbaccel.render import profile as render_profile
from widget_helpers import control, first_column, header_buttons, ops_table, walk
from text_helpers import unfolded

SETUP = """
import torch
torch.manual_seed(0)
a = torch.randn(1000, 1000)
b = torch.randn(1000, 1001)
m = torch.nn.Linear(64, 10)
x = torch.randn(32, 64)
runs = 0
"""

CELL = """%%profile_gpu {opts}
runs += 1
print("printed by the cell")
y = a @ b
z = m(x).relu().sum()
z
"""


def profile_cell(run_cell, ip, opts="-q -r prof"):
    run_cell(SETUP)
    result, captured = run_cell(CELL.format(opts=opts))
    return ip.user_ns.get("prof"), result, captured


def bundle(captured):
    rich = [o.data for o in captured.outputs if "text/html" in o.data]
    assert rich, "no rich output was displayed"
    return rich[0]


# --- what it shows -------------------------------------------------------------------------------


def test_default_profile_on_cpu_says_so_and_shows_full_names(run_cell, ip):
    prof, result, captured = profile_cell(run_cell, ip, opts="-r prof")
    data = bundle(captured)
    text = data["text/plain"]
    assert "CPU only (no CUDA device: CPU ops profiled)" in text
    assert "aten::mm" in text and "aten::addmm" in text
    assert "peak unknown" in text
    assert "CPU only" in data["text/html"]
    # The cell ran once, its output shown once, its last value is the cell's value.
    assert ip.user_ns["runs"] == 1
    assert captured.stdout.count("printed by the cell") == 1
    assert isinstance(result.result, torch.Tensor)
    assert prof.value is result.result
    ops = prof.ops
    assert len(ops) > 5 and ops["cpu_self_us"].is_monotonic_decreasing  # default sort: self CPU time
    assert ops.iloc[0]["name"] == "aten::mm"  # the 1000x1000x1001 matmul dominates
    assert prof.header["flops"] >= 2 * 1000 * 1000 * 1001  # FLOPs from shapes, the matmul counted once
    assert prof.header["device_time_us"] is None and prof.tensor_cores.value is None


def test_categories_add_up_and_matmul_dominates(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip)
    cats = prof.categories
    assert cats.iloc[0]["category"] == "matmul/conv"
    assert cats["percent"].sum() == pytest.approx(100.0)
    assert set(cats["category"]) <= set(nbaccel.analysis.CATEGORIES)
    assert "time by category" in str(prof) and "matmul/conv" in str(prof)


def test_shape_advice_pads_1001_to_1008(run_cell, ip, cpu_with_bf16_and_fp16_units):
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --amp bf16")
    mm = [e for e in prof.unaligned if e["op"] == "aten::mm" and e["shapes"] == "1000x1000, 1000x1001"]
    assert mm and mm[0]["unaligned"] == {"N": 1001} and mm[0]["pad_to"] == {"N": 1008} and mm[0]["dtype"] == "bf16"
    assert any("1001 -> pad to 1008" in a for a in prof.advice)
    assert "N=1001 -> 1008" in unfolded(prof)


def test_a_dim_whose_padding_would_double_the_work_is_listed_not_advised(run_cell, ip, cpu_with_bf16_and_fp16_units):
    """M=4 (a batch of 4 rows per product) padded to 8 doubles the matmul: listed in the shapes, no advice."""
    ip.user_ns.update(a=torch.randn(48, 4, 512, dtype=torch.bfloat16), b=torch.randn(48, 512, 512, dtype=torch.bfloat16),
                      torch=torch)
    run_cell("%%profile_gpu -q -r prof\nfor _ in range(3): torch.bmm(a, b)")
    prof = ip.user_ns["prof"]
    assert [e["unaligned"] for e in prof.unaligned if e["op"] == "aten::bmm"] == [{"M": 4}]
    assert not any(a.startswith("Matmul/conv dims not multiples of 8") for a in prof.advice)


def test_fp32_on_the_cpu_is_not_told_to_pad(run_cell, ip):
    # A user trial: an fp32 CNN on the CPU was told "3 -> pad to 8 ... fill Tensor Core / AMX tiles";
    # AMX has no fp32 tiles, and 8 input channels would make the first convolution 2.7x the work.
    prof, _, _ = profile_cell(run_cell, ip)
    assert any(e["unaligned"] == {"N": 1001} and e["dtype"] == "fp32" for e in prof.unaligned)
    assert "N=1001 -> 1008" in unfolded(prof)  # still listed under the shapes
    assert not any("pad to" in a for a in prof.advice)


def test_cpu_shapes_list_says_fp32_padding_counts_on_a_gpu_or_under_bf16(run_cell, ip, cpu_with_bf16_and_fp16_units):
    # A user trial: a CPU profile listed "C_in=3 -> 8 (multiple of 8 for fp32)" and "N=10 -> 16" as if
    # they were things to do; fp32 fills no tile on the CPU (AMX takes bf16/fp16/int8).
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --device cpu")
    lines = render_profile.unaligned_lines(prof)
    row = next(line for line in lines if "N=1001 -> 1008" in line)
    assert row.endswith("(for a GPU or bf16 autocast; not fp32 on the CPU)") and "multiple of" not in row
    assert lines[0].startswith("fp32 matmul/conv on the CPU run on the vector units, not on tiles") and \
        "on a GPU (Tensor Cores) or under bf16 autocast" in lines[0]
    assert unfolded(row) in unfolded(prof) and "not fp32 on the CPU" in prof._repr_html_()
    # The comparison to run is named as the result's maker would run it (a trial: "%%amp" from Python).
    assert "autocast (AMX tiles; %%amp):" in unfolded(prof)
    with nbaccel.profile(device="cpu") as api:
        ip.user_ns["a"] @ ip.user_ns["b"]
    assert "autocast (AMX tiles; nbaccel.compare_amp):" in unfolded(api.result)
    # Under bf16 autocast the CPU's AMX tiles do take the op: a task for now, said as before.
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --device cpu --amp bf16")
    row = next(line for line in render_profile.unaligned_lines(prof) if "N=1001 -> 1008" in line)
    assert row.endswith("(multiple of 8 for bf16)")


def test_a_listed_padding_that_adds_over_a_quarter_of_the_work_says_so(run_cell, ip):
    """A trial: under --amp bf16 an RGB stem's conv read "C_in=3 -> 8 (multiple of 8 for bf16)", advice to
    make it 2.7x the work; the advice leaves such dims out (flops.padding_worth_it), and so the list says."""
    ip.user_ns.update(stem=torch.nn.Conv2d(3, 16, 3, padding=1), img=torch.randn(2, 3, 16, 16), torch=torch)
    run_cell("%%profile_gpu -q -r prof --amp bf16 --device cpu\nstem(img)")
    row = next(line for line in render_profile.unaligned_lines(ip.user_ns["prof"]) if "C_in=3" in line)
    assert "C_in=3 -> 8 (+167% work: not worth it)" in row
    assert not any("3 -> pad to 8" in a for a in ip.user_ns["prof"].advice)
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --device cpu --amp bf16")
    assert any("N=1001 -> 1008 (" in line and "not worth it" not in line
               for line in render_profile.unaligned_lines(prof))


def test_on_a_cpu_without_amx_padding_counts_only_on_a_gpu(run_cell, ip):
    """A trial on an Ice Lake (no AMX) read "padded sizes count ... under bf16 autocast (AMX tiles)"."""
    import dataclasses

    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --device cpu --amp bf16")
    prof.device = dataclasses.replace(prof.device, cpu_features={"amx_bf16": False, "amx_fp16": False})
    prof.__dict__.pop("advice", None)  # cached: read again for this CPU
    lines = render_profile.unaligned_lines(prof)
    row = next(line for line in lines if "N=1001 -> 1008" in line)
    assert row.endswith("(for a GPU; not on this CPU)")
    assert lines[0] == ("bf16 matmul/conv on the CPU run on the vector units, not on tiles: padding their dims would "
                        "only add work here. Their padded sizes count on a GPU (Tensor Cores); this CPU has no AMX "
                        "tiles, so not here in any precision:")
    assert not any("pad to" in a for a in prof.advice)


def test_shapes_list_is_ordered_by_share_of_the_time_and_capped(run_cell, ip):
    run_cell("import torch\nws = [(torch.randn(256, n), torch.randn(n, 8 + 64 * i)) for i, n in enumerate(range(9, 41, 2))]")
    run_cell("%%profile_gpu -q -r prof --device cpu\nfor a, b in ws:\n    a @ b\n")
    prof = ip.user_ns["prof"]
    found = prof.unaligned
    assert len(found) == 16
    total = sum(prof.op_columns["self_us"])
    assert [e["share"] for e in found] == sorted((e["share"] for e in found), reverse=True)
    assert all(e["share"] == pytest.approx(e["time_us"] / total) for e in found)
    lines = render_profile.unaligned_lines(prof)
    rows = [line for line in lines if line.startswith("aten::")]
    assert len(rows) == render_profile.UNALIGNED_ROWS == 12
    assert f"{found[0]['share']:.1%} of CPU time" in rows[0]
    assert lines[-1].startswith("... and 4 more, each at most ") and lines[-1].endswith(
        "of CPU time (result.unaligned lists them all)")


@pytest.mark.parametrize("share, advised", [(0.03, False), (0.10, True)])
def test_shape_advice_only_for_unaligned_ops_taking_five_percent_of_the_time(run_cell, ip, share, advised, cpu_with_bf16_and_fp16_units):
    """As %%amp's 5 %-of-FLOPs rule: a 10-class output layer is listed under shapes, not advised on."""
    from nbaccel.profile_advice import advise

    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --amp bf16")  # bf16: AMX tiles to fill
    total = sum(prof.op_columns["self_us"])
    entry = dict(prof.unaligned[0], time_us=share * total, share=share)
    prof.__dict__["unaligned"] = [entry]  # a cached property: this profile's one unaligned op, at that share
    assert any("pad to" in line for line in advise(prof)) == advised


@pytest.mark.parametrize("body, kind", [
    ("torch.nn.functional.dropout(big, 0.5)", "dropout"),
    ("torch.nn.functional.dropout(big, 0.5, training=False) * 2", None),  # eval: no masks
    ("torch.randn(1000, 1000) @ torch.ones(1000, 8)", "random"),
])
def test_random_number_ops_get_advice_when_they_are_a_fifth_of_the_time(run_cell, ip, body, kind):
    """A trial's MLP with three Dropout layers spent 64% of its CPU step in aten::bernoulli_ and the
    advice said nothing about it; dropout counts whole (another trial, with a busy core: bernoulli_ 6%,
    its div_ and mul 94% of a dropout-bound cell)."""
    from nbaccel.profile_advice import _DROPOUT_OPS, _RANDOM_OPS, RANDOM_SHARE

    run_cell("import torch\nbig = torch.ones(1000, 1000)")
    run_cell(f"%%profile_gpu -q -r prof\n{body}")
    prof = ip.user_ns["prof"]
    cols = prof.op_columns
    total = sum(cols["self_us"])
    dropout = sum(t for n, t in zip(cols["name"], cols["dur_us"]) if n == "aten::dropout") / total
    random = sum(t for n, t in zip(cols["name"], cols["self_us"]) if n in _RANDOM_OPS) / total
    lines = [a for a in prof.advice if a.startswith(("Dropout takes", "Making random tensors takes"))]
    if kind == "dropout":
        assert "aten::dropout" in _DROPOUT_OPS and dropout >= RANDOM_SHARE  # far above it: the whole cell
        assert lines == [f"Dropout takes {dropout:.0%} of CPU time (aten::dropout 1 call, with the ops inside): if "
                         "this is evaluation or inference, model.eval() turns dropout off; in training it is "
                         "dropout's cost, which torch.compile cuts by drawing the masks inside fused kernels."]
    elif kind == "random":
        assert random >= RANDOM_SHARE
        assert lines == [f"Making random tensors takes {random:.0%} of CPU time (aten::normal_ 1 call): if they "
                         "stand in for data (torch.randn batches), make them once before the profiled code."]
    else:
        assert lines == [] and dropout < 0.05 and random == 0  # eval: aten::dropout returns its input


SMALL_OPS_CELL = """%%profile_gpu -q -r prof --steps {steps}
t = tiny
for _ in range(40):
    t = (t + 1).mul_(0.5)
{big}
"""


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("big, advised", [("", True), ("big.mul_(1.0001)", False)])
def test_small_op_advice_is_about_their_share_of_the_time_per_step(run_cell, ip, steps, big, advised):
    """Hundreds of tiny ops per step get the advice when they are the time, not when one 4000x4000
    mul_ is; and --steps 2 says what --steps 1 says (the rule used to count ops over all steps:
    2 x 400 tiny ops beside the mul_ got it, 400 alone did not)."""
    from nbaccel.profile_advice import SMALL_OP_SHARE, SMALL_OP_US
    from nbaccel.profile_table import redispatched

    run_cell("import torch\ntiny = torch.ones(8)\nbig = torch.ones(4000, 4000)")
    # A tiny op descheduled by another program is no longer under SMALL_OP_US: on a loaded machine the
    # tiny-ops cell is re-profiled (up to 3 times) until its tiny ops measured as tiny.
    for _ in range(3):
        run_cell(SMALL_OPS_CELL.format(steps=steps, big=big))
        prof = ip.user_ns["prof"]
        cols = prof.op_columns
        again = redispatched(cols["parent"], cols["name"])  # one call, as the header counts calls
        small = sum(t for n, t, inner in zip(cols["name"], cols["self_us"], again)
                    if n.startswith("aten::") and t < SMALL_OP_US and not inner)
        share = small / sum(cols["self_us"])
        lines = [a for a in prof.advice if "aten op calls" in a]
        assert bool(lines) == (share >= SMALL_OP_SHARE)  # the advice follows its rule on the measured times
        if (share >= SMALL_OP_SHARE) == advised:
            break
    assert (share >= SMALL_OP_SHARE) == advised  # the cells are far from the threshold on a quiet machine
    assert bool(lines) == advised
    if advised:
        assert f"take {share:.0%} of the self CPU time" in lines[0]
        assert ("per step (" in lines[0]) == (steps > 1)
        # never more calls than the header's op calls (a trial read 414 beside 390)
        total = re.search(r"\(([\d,]+) in \d+ steps\)", lines[0]) or re.match(r"([\d,]+) aten op calls", lines[0])
        assert 0 < int(total.group(1).replace(",", "")) <= prof.op_calls


@pytest.mark.parametrize("key, column", [("calls", "calls"), ("flops", "flops"), ("cpu", "cpu_total_us"),
                                         ("self", "cpu_self_us")])
def test_sort_option(run_cell, ip, key, column):
    prof, _, _ = profile_cell(run_cell, ip, opts=f"-q -r prof --sort {key}")
    values = prof.ops[column].fillna(-1).tolist()
    assert values == sorted(values, reverse=True)
    assert prof.default_sort == key


def test_top_limits_the_displayed_rows(run_cell, ip):
    prof, _, captured = profile_cell(run_cell, ip, opts="-r prof --top 2")
    text = bundle(captured)["text/plain"]
    assert "top 2 of" in text
    table = text.split("rows by self CPU")[1].split("time by category")[0]
    assert len([line for line in table.splitlines() if line.startswith("aten::")]) == 2
    assert len(prof.ops) > 2  # the result keeps every row


def test_memory_option_records_allocations(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --memory --sort memory")
    mm = prof.ops.set_index("name").loc["aten::mm"]
    assert mm["self_memory_bytes"] >= 1000 * 1001 * 4  # the fp32 result of a @ b
    assert prof.ops["self_memory_bytes"].fillna(-1).is_monotonic_decreasing  # --sort memory: self bytes
    assert "mem alloc" in str(prof)


def test_without_memory_there_is_no_memory_column(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip)
    assert prof.ops["memory_bytes"].isna().all()
    assert "mem alloc" not in str(prof)


def test_shapes_groups_by_input_shape(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --shapes")
    assert prof.options.group == "op+shape"
    rows = prof.ops[prof.ops["name"] == "aten::mm"]
    assert "1000x1000, 1000x1001" in set(rows["shapes"])
    assert "input shapes" in str(prof)


def test_stack_groups_by_cell_line(run_cell, ip):
    prof, result, _ = profile_cell(run_cell, ip, opts="-q -r prof --stack")
    table = prof.ops
    # named as IPython's tracebacks name a cell's line, like the rows of the functions it calls (a trial read
    # "cell line 3: ..." beside "Cell In[2], line 1: def step")
    cell = f"Cell In[{result.execution_count}]"
    assert table.iloc[0]["source"] == f"{cell}, line 3: y = a @ b"
    assert "aten::mm" in table.iloc[0]["name"]
    lines = set(table["source"])
    assert f"{cell}, line 4: z = m(x).relu().sum()" in lines
    # Every op call the line made: aten::matmul, the aten::mm it runs, ... (the CPU total counts them once).
    made = (prof.op_events["source"] == f"{cell}, line 3: y = a @ b").sum()
    assert made > 1 and table.iloc[0]["calls"] == made
    assert table.iloc[0]["cpu_total_us"] == prof.op_events.set_index("name").loc["aten::matmul", "dur_us"]


def test_stack_op_calls_count_the_ops_the_line_made(run_cell, ip):
    # A user trial read "1" op call beside a line's three costliest ops (aten::addmm, aten::t,
    # aten::copy_) and "14" beside loss.backward(): the column counted the line's outermost ops only
    # (aten::linear; the autograd engine's nodes), not the ops whose names it showed.
    prof, result, captured = profile_cell(run_cell, ip, opts="-r prof --stack")
    by_line = prof.table(group="source").set_index("source")
    events = prof.op_events
    line = f"Cell In[{result.execution_count}], line 4: z = m(x).relu().sum()"
    # its op events, less re-dispatches (an op inside an op of its name is one call, as in the op grouping)
    again = nbaccel.profile_table.redispatched(events["parent"].tolist(), events["name"].tolist())
    made = sum(1 for src, inner in zip(events["source"], again) if src == line and not inner)
    assert made > 3 and by_line.loc[line, "calls"] == made
    assert by_line["calls"].sum() == prof.table(group="op")["calls"].sum()  # the same calls, grouped otherwise
    text = bundle(captured)["text/plain"]
    assert "op calls" in next(r for r in text.splitlines() if r.startswith("source line"))  # the table's header
    row = next(r for r in text.splitlines() if r.startswith(line))
    assert f" {made} " in row
    assert ">op calls<" in bundle(captured)["text/html"]
    box = render_profile.widget(prof)  # its header and its "sort by" name the column as the table does
    assert "op calls" in _headers(box) and ("op calls", "calls") in control(box, "Dropdown", "sort by").options


def test_autocast_redispatch_is_one_call_of_the_op(run_cell, ip):
    # Under autocast aten::matmul runs again (in bf16) inside the aten::matmul the cell called; the
    # table once showed 2 calls, twice the FLOPs and a CPU total longer than the wall time.
    run_cell(SETUP)
    run_cell("%%profile_gpu -q -r prof --amp bf16\nc = (a @ a).sum()\n")
    prof = ip.user_ns["prof"]
    matmul = prof.ops.set_index("name").loc["aten::matmul"]
    assert matmul["calls"] == 1 and matmul["dtype"] == "bf16"
    # the FLOPs are the aten::mm's inside, counted once there (self FLOPs)
    assert matmul["flops"] != matmul["flops"] and prof.ops.set_index("name").loc["aten::mm", "flops"] == 2 * 1000**3
    assert matmul["cpu_total_us"] <= prof.window_us
    assert prof.table(group="op+shape").set_index("name").loc["aten::matmul", "calls"] == 1


def test_stack_attributes_a_last_expression_to_its_cell_line(run_cell, ip):
    # The cell's last expression is evaluated apart (its value is the cell's result); its own
    # module-level frame once hid the line: the table said "<ipython-input-..>(0): <module>".
    run_cell(SETUP)
    result, _ = run_cell("%%profile_gpu -q -r prof --stack\ncount = 1\n(a @ b).sum()\n")
    sources = set(ip.user_ns["prof"].ops["source"])
    assert sources == {f"Cell In[{result.execution_count}], line 2: (a @ b).sum()"}, sources


def test_stack_attributes_ops_to_user_functions(run_cell, ip):
    run_cell(SETUP)
    defined, _ = run_cell("x = 1\ndef helper(t):\n    return (t @ t).sum()\n")
    run_cell("%%profile_gpu -q -r prof --stack\nhelper(a)\n")
    sources = ip.user_ns["prof"].ops["source"].tolist()
    # Named like IPython's tracebacks name the cell, not by its code name (<ipython-input-..>
    # here, /tmp/ipykernel_../...py in a kernel), which no reader can map to a cell.
    assert f"Cell In[{defined.execution_count}], line 2: def helper" in sources, sources


def test_the_header_names_the_slowest_row_within_the_first_lines(run_cell, ip):
    """A trial: the text put the slowest op on line 9 (13 under a warning), below a notebook output's fold. The
    header names the table's first row with its share; under --stack, its source line."""
    prof, result, captured = profile_cell(run_cell, ip, opts="-r prof")
    first = prof.top_rows(1)[0]
    text = captured.outputs[0].data["text/plain"].splitlines()
    said = f"slowest: {first['name']} ({first['percent']:.1f}% of self CPU time)"
    assert any(said in line for line in text[:4]), text[:6]
    assert said.split(": ", 1)[1] in bundle(captured)["text/html"]
    # the share column says whose share it is: "% of total" beside "CPU total" read as that column's (a trial)
    header = next(line for line in text if line.startswith("operator "))
    assert "% of self CPU" in header and "% of total" not in header
    assert ("% of self CPU", "percent") in control(render_profile.widget(prof), "Dropdown", "sort by").options
    prof, result, captured = profile_cell(run_cell, ip, opts="-q -r prof --stack")
    top = prof.top_rows(1)[0]
    assert f"slowest: {top['source']} (" in unfolded(str(prof)) and top["source"].startswith("Cell In[")


def test_the_slowest_row_is_by_time_whatever_the_sort(run_cell, ip):
    """A trial's --sort cpu header named aten::dropout (0.1% of self CPU time) "slowest" because it headed the
    table by CPU total, while aten::bernoulli_ held 25%: the header's slowest row is by self time."""
    for sort in ("calls", "cpu"):
        prof, result, captured = profile_cell(run_cell, ip, opts=f"-q -r prof --sort {sort}")
        by_self = max(prof.top_rows(), key=lambda row: row["cpu_self_us"])
        assert f"slowest: {by_self['name']} ({by_self['percent']:.1f}% of self CPU time)" in unfolded(str(prof))
        assert prof.slowest_row()["name"] == by_self["name"]
        if sort == "calls":  # the table's first row is another op here, so the check above can fail
            assert prof.top_rows(1)[0]["name"] != by_self["name"]


def test_filter_shows_only_the_matching_rows_in_text_html_and_widget(run_cell, ip):
    """Outside JupyterLab (the HTML and text fallbacks) no filter box exists: --filter narrows the shown table
    there, and opens the widget's box with it. The header stays the whole profile's."""
    prof, result, captured = profile_cell(run_cell, ip, opts="-r prof --filter aten::(mm|addmm|linear)")
    names = [row["name"] for row in prof.top_rows()]
    assert sorted(names) == ["aten::addmm", "aten::linear", "aten::mm"]
    total = len(prof.grouped_rows())
    assert total > 10 and len(prof.ops) == total  # a view: ops and table() keep every row
    text = captured.outputs[0].data["text/plain"]
    assert (f"the 3 rows matching 'aten::(mm|addmm|linear)' ({total} in all) by self CPU (grouped by op):"
            in text)
    table = text.split("(grouped by op):\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert [line.split()[0] for line in table] == names
    assert f"slowest: {prof.slowest_row()['name']}" in unfolded(text)
    html = bundle(captured)["text/html"]
    assert first_column(html) == names and "The 3 rows matching" in html_unescape(html)
    assert control(render_profile.widget(prof), "Text", "filter").value == "aten::(mm|addmm|linear)"
    # --top still limits, and a filter that keeps nothing says so instead of an empty table
    prof, _, captured = profile_cell(run_cell, ip, opts="-r prof --filter aten:: --top 2")
    assert f"top 2 of the {len(prof.top_rows())} rows matching 'aten::' ({total} in all)" in str(prof)
    prof, _, captured = profile_cell(run_cell, ip, opts="-r prof --filter conv2d")
    said = f"no row of the {total} (grouped by op) has a name or source line matching 'conv2d'"
    assert said in captured.outputs[0].data["text/plain"] and said in html_unescape(bundle(captured)["text/html"])
    with pytest.raises(nbaccel.ProfileError, match="filter takes the text to look for in the names, got 3"):
        nbaccel.profile(filter=3)


def test_stack_says_how_to_see_the_lines_of_a_function_that_holds_the_time(run_cell, ip):
    """A trial: a cell calling train_step(), defined in an earlier cell, got one --stack row, "def train_step",
    at >99.9%, and no word on why its lines were not there."""
    run_cell(SETUP)
    defined, _ = run_cell("def train_step():\n    y = a @ b\n    return (y @ y.T).sum()\n")
    _, captured = run_cell("%%profile_gpu -r prof --stack\ntrain_step()\n")
    prof = ip.user_ns["prof"]
    note = next(a for a in prof.advice if a.startswith("One function"))
    assert re.fullmatch(rf"One function, train_step \(Cell In\[{defined.execution_count}\], line 1\), holds "
                        r"(>99\.9|\d+)% of the CPU time: --stack charges a function's ops to the function, not to its "
                        r"lines \(torch's Python tracer records where each function starts, not the line that runs\)\. "
                        r"To see its lines, profile its body as the cell \(each top-level statement is then a row of "
                        r"its own\), or split it into smaller functions\.", note), note
    assert "One function, train_step" in unfolded(bundle(captured)["text/plain"])
    # its body as the cell: a row per line, and no such note
    run_cell("%%profile_gpu -q -r prof --stack\ny = a @ b\n(y @ y.T).sum()\n")
    assert not any(a.startswith("One function") for a in ip.user_ns["prof"].advice)
    # without --stack there are no source rows to speak of
    run_cell("%%profile_gpu -q -r prof\ntrain_step()\n")
    assert not any(a.startswith("One function") for a in ip.user_ns["prof"].advice)
    # from Python the option is spelled as a keyword
    import nbaccel
    with nbaccel.profile(stack=True) as p:
        ip.user_ns["train_step"]()
    assert any(a.startswith("One function, train_step") and "stack=True charges" in a for a in p.result.advice)


def test_warmup_and_steps_run_the_cell_that_many_times(run_cell, ip):
    prof, _, captured = profile_cell(run_cell, ip, opts="-q -r prof --warmup 2 --steps 3")
    assert ip.user_ns["runs"] == 5  # documented: the cell runs warmup + steps times, like a loop
    assert captured.stdout.count("printed by the cell") == 1  # only the last run's output is shown
    assert len(prof.step_times_us) == 3  # only the active steps are in the profile
    calls = prof.ops.set_index("name").loc["aten::mm", "calls"]
    assert calls == 3


def test_trace_file_is_valid_chrome_json_with_the_cells_ops(run_cell, ip, tmp_path):
    path = tmp_path / "step.json"
    prof, _, captured = profile_cell(run_cell, ip, opts=f"-r prof --trace {path}")
    doc = json.loads(path.read_text())
    names = {e.get("name") for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::mm", "aten::addmm", "aten::relu"} <= names
    assert prof.trace_path == str(path)
    assert str(path) in bundle(captured)["text/plain"] and "ui.perfetto.dev" in bundle(captured)["text/plain"]
    # export_chrome_trace writes the same trace; the analysis loader reads it back.
    out = prof.export_chrome_trace(str(tmp_path / "again.json.gz"))
    assert set(load_trace(out).ops["name"]) == set(load_trace(str(path)).ops["name"])


def test_trace_gz_file(run_cell, ip, tmp_path):
    path = tmp_path / "step.json.gz"
    profile_cell(run_cell, ip, opts=f"-q -r prof --trace {path}")
    assert "aten::mm" in set(load_trace(str(path)).ops["name"])


def test_trace_file_in_folders_that_do_not_exist_yet(run_cell, ip, tmp_path):
    # As for a folder of steps, missing folders on the way are created (a new user was told to
    # "create it first" for a file, while a folder name was created for them).
    path = tmp_path / "runs" / "today" / "step.json.gz"
    _, _, captured = profile_cell(run_cell, ip, opts=f"-q -r prof --trace {path}")
    prof = ip.user_ns["prof"]
    # -q hides the report, not the folders made on the disk (a trial: -q --trace into a new folder said nothing)
    said = [line for line in captured.stdout.splitlines() if line.startswith("nbaccel")]
    assert said == [f"nbaccel %%profile_gpu: wrote {path}; created the folder {tmp_path / 'runs'}"]
    assert path.is_file() and prof.trace_path == str(path)
    # Said, so a mistyped path's new folders are seen (a user trial: /nonexistent/dir was made silently).
    assert prof.trace_created == str(tmp_path / "runs")
    assert f"(open at https://ui.perfetto.dev; created the folder {tmp_path / 'runs'})" in str(prof)
    assert f"created the folder {tmp_path / 'runs'}" in prof._repr_html_()
    # A folder that was there already: nothing said.
    _, _, captured = profile_cell(run_cell, ip, opts=f"-q -r prof --trace {tmp_path / 'runs' / 'again.json'}")
    assert ip.user_ns["prof"].trace_created is None and "created the folder" not in str(ip.user_ns["prof"])
    assert "nbaccel" not in captured.stdout  # -q: quiet
    folder = tmp_path / "steps" / "run1"  # a folder of steps
    profile_cell(run_cell, ip, opts=f"-q -r prof --warmup 1 --steps 1 --trace {folder}")
    assert ip.user_ns["prof"].trace_created == str(tmp_path / "steps")


def test_export_chrome_trace_creates_missing_folders(tmp_path):
    # A user trial: --trace made the folders, result.export_chrome_trace('out/nested/e.json') raised
    # pathlib's FileNotFoundError. A loaded trace (copied from its file) is written the same way.
    with nbaccel.profile() as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    path = tmp_path / "out" / "nested" / "e.json"
    assert prof.result.export_chrome_trace(str(path)) == str(path)
    assert "aten::mm" in set(load_trace(str(path)).ops["name"])
    copy = tmp_path / "again" / "deeper" / "e.json.gz"
    assert nbaccel.load_trace(str(path)).export_chrome_trace(str(copy)) == str(copy)
    assert "aten::mm" in set(load_trace(str(copy)).ops["name"])


def test_a_pathlib_trace_path_is_text_in_the_result(tmp_path):
    # A trial: profile(trace=Path(...)) wrote the trace, then print(result) raised "expected str instance,
    # PosixPath found" and to_json() "Object of type PosixPath is not JSON serializable".
    with nbaccel.profile(trace=tmp_path / "p.json") as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    result = prof.result
    assert result.trace_path == str(tmp_path / "p.json") and str(tmp_path / "p.json") in str(result)
    assert json.loads(result.to_json())["trace_path"] == str(tmp_path / "p.json")


@pytest.mark.parametrize("device", [torch.nn.Linear(4, 4), 1.5, [1], True])
def test_a_profile_of_something_that_is_no_device_is_refused_when_made(device):
    # A trial: profile(model) was made ("ready (Linear(...), 1 step)") and failed at the with line, the model
    # lowercased as a device name: "unknown device 'linear(in_features=4, ...'".
    from nbaccel.profile import ProfileError

    with pytest.raises(ProfileError, match=r"device takes 'auto', 'cpu', 'cuda' or 'cuda:N' \(or a torch.device\), "
                                           r"got .*; the code to profile goes inside the block"):
        nbaccel.profile(device)


@pytest.mark.parametrize("where", ["proc", "file"])
def test_export_chrome_trace_that_cannot_be_written_names_the_path(tmp_path, where):
    # Not pathlib's FileNotFoundError (which reads as if the trace were missing): what failed, and the fix.
    from nbaccel.profile import ProfileError

    with nbaccel.profile() as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    if where == "proc":
        if not Path("/proc/self").exists():
            pytest.skip("no /proc here")
        path, failed = "/proc/nbaccel_test/e.json", "/proc/nbaccel_test"
    else:
        (tmp_path / "a_file").write_text("")
        path, failed = str(tmp_path / "a_file" / "e.json"), str(tmp_path / "a_file")
    with pytest.raises(ProfileError, match=f"cannot write the trace to {re.escape(path)}: could not create "
                                                   f"{re.escape(failed)} .*choose another path"):
        prof.result.export_chrome_trace(path)

def test_a_trace_folders_step_files_are_named_and_numbered_in_the_report(tmp_path):
    """A trial: profile(steps=3, trace=folder) listed three {host}_{pid}.{ms} names, none saying which step
    it holds; the line says how they are named and numbers them in step order (the layout is kept)."""
    folder = tmp_path / "runs"
    with nbaccel.profile(steps=3, warmup=1, trace=str(folder)) as prof:
        for _ in range(4):
            torch.ones(8, 8) @ torch.ones(8, 8)
            prof.step()
    files = prof.result.trace_files
    assert len(files) == 3 and sorted(files) == files  # the ms names sort in step order
    line = next(ln for ln in str(prof.result).splitlines() if ln.startswith("trace: "))
    assert line.startswith(f"trace: 3 files in {folder}/, one per profiled step, named {{host}}_{{pid}}.{{ms}}"
                           ".pt.trace.json (ms: the step's start in Unix milliseconds, so they sort in step order): "
                           + ", ".join(f"step {i} {Path(f).name}" for i, f in enumerate(files, 1))), line
    assert line.endswith(f"(open each at https://ui.perfetto.dev; created the folder {folder})")
    assert "one per profiled step" in prof.result._repr_html_()
    for i, f in enumerate(files, 1):  # each file holds the step it is numbered as (#0 was the warm-up)
        doc = json.loads(Path(f).read_text())
        assert [e["name"] for e in doc["traceEvents"]
                if str(e.get("name", "")).startswith("ProfilerStep#")] == [f"ProfilerStep#{i}"]
    with nbaccel.profile(trace=str(tmp_path / "one")) as single:  # one step: the file alone, as before
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert f"trace: {single.result.trace_files[0]}  (open at" in str(single.result)


def test_trace_folder_has_one_file_per_step_in_tensorboard_layout(run_cell, ip, tmp_path):
    folder = tmp_path / "runs" / "profile"
    prof, _, _ = profile_cell(run_cell, ip, opts=f"-q -r prof --warmup 1 --steps 3 --trace {folder}")
    files = sorted(folder.iterdir())
    assert len(files) == 3 and [str(f) for f in files] == sorted(prof.trace_files)
    for f in files:
        assert re.fullmatch(r".+_\d+\.\d+\.pt\.trace\.json", f.name), f.name
        doc = json.loads(f.read_text())
        steps = [e["name"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
        assert len(steps) == 1
        assert "aten::mm" in {e.get("name") for e in doc["traceEvents"]}
    assert len({f.name.split(".")[1] for f in files}) == 3  # distinct span names


@pytest.mark.parametrize("amp", ["bf16", "bfloat16", "BF16", "torch.bfloat16"])  # the long names, as %%amp --dtype takes them
def test_amp_profiles_under_the_recipe_and_restores_it(run_cell, ip, amp):
    prof, _, _ = profile_cell(run_cell, ip, opts=f"-q -r prof --amp {amp}")
    assert "autocast bf16" in prof.header["recipe"]
    mm = prof.op_events[prof.op_events["name"] == "aten::mm"]
    assert set(mm["dtype"]) == {"bf16"}
    assert not torch.is_autocast_enabled("cpu")
    assert "autocast bf16" in str(prof)


def test_amp_keeps_the_flags_the_cell_sets(run_cell, ip, flags_set_by_the_cell):
    # Was: cudnn.benchmark set by the cell was reverted by the --amp recipe's exit.
    run_cell(SETUP)
    run_cell("%%profile_gpu --amp bf16 -q\ntorch.backends.cudnn.benchmark = True\ny = a @ b\n")
    assert torch.backends.cudnn.benchmark
    # A cell that raises gets the recipe's flags back, whatever it set.
    run_cell("%%profile_gpu --amp bf16 -q\ntorch.backends.cudnn.benchmark = False\n1 / 0\n",
             expect_error=ZeroDivisionError)
    assert torch.backends.cudnn.benchmark


def test_a_semicolon_after_the_last_expression_hides_its_value(run_cell, ip):
    run_cell(SETUP)
    result, captured = run_cell("%%profile_gpu -q -r prof\n(a @ b).sum();")
    assert result.result is None and "Out[" not in captured.stdout
    assert ip.user_ns["prof"].value is not None
    result, captured = run_cell("%%profile_gpu -q\n(a @ b).sum()")
    assert isinstance(result.result, torch.Tensor) and "Out[" in captured.stdout


def test_a_cell_without_torch_ops_says_so_instead_of_empty_sections(run_cell, ip):
    # A user trial: a cell of plain Python showed a table header without rows and a bare
    # "time by category:" before the advice, read as a display fault.
    _, captured = run_cell("%%profile_gpu -r prof\nx = sum(range(1000))\n")
    said = "were recorded, so there is no operator table or time by category"
    text, html = bundle(captured)["text/plain"], bundle(captured)["text/html"]
    assert said in text and "time by category:" not in text and "top 0 of 0" not in text and "\ncalls" not in text and " calls  " not in text
    assert said in html and "<table" not in html and "Time by category" not in html
    assert "advice: No torch operators were recorded" in text  # what to use instead is still said
    box = render_profile.widget(ip.user_ns["prof"])
    tab = next(w for w in walk(box) if type(w).__name__ == "Tab")
    assert said in tab.children[0].value and said in tab.children[1].value  # Operators, Breakdown
    assert not [w for w in walk(box) if type(w).__name__ == "Dropdown"]  # no controls over no rows


def test_device_cpu_and_quiet(run_cell, ip):
    _, _, captured = profile_cell(run_cell, ip, opts="-q -r prof --device cpu")
    assert not [o for o in captured.outputs if "text/html" in o.data]
    assert ip.user_ns["prof"].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_gpu_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="sees no CUDA GPU"):
        ip.run_cell_magic("profile_gpu", "--device cuda", "1")


def test_flops_per_s_column_says_it_divides_by_cpu_total_time(run_cell, ip):
    prof, _, captured = profile_cell(run_cell, ip, opts="-r prof")
    text = bundle(captured)["text/plain"]
    assert "FLOP/s (CPU total)" in text.split("time by category")[0]
    assert ("FLOP/s column = the row's FLOPs / the CPU total time of the calls that carry them"
            in unfolded(text.split("method: ")[1]))
    assert "FLOP/s (CPU total)" in bundle(captured)["text/html"]
    mm = prof.ops.set_index("name").loc["aten::mm"]
    assert mm["flops_calls"] == mm["calls"]
    assert mm["flops_per_s"] == pytest.approx(mm["flops"] / (mm["cpu_total_us"] * 1e-6))
    # The method paragraph ran 17 lines on every profile: on the CPU it leaves out the kernels' terms, and the
    # some-of-the-calls clause where no row has one (the UNet below has)
    method = unfolded(text.split("method: ")[1])
    assert "device busy" not in method and "Tensor Cores judged" not in method and "calls)" not in method
    assert method.endswith("categories by op name.")


UNET = """
import torch
from torch import nn
torch.manual_seed(0)
def block(i, o):
    return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU(), nn.Conv2d(o, o, 3, padding=1), nn.ReLU()]
net = nn.Sequential(*block(3, 8), nn.MaxPool2d(2), *block(8, 16), nn.ConvTranspose2d(16, 8, 2, stride=2),
                    *block(8, 8), nn.Conv2d(8, 3, 1))
x = torch.randn(2, 3, 32, 32)
"""


def test_a_row_whose_flops_cover_some_of_its_calls_is_timed_over_those_and_says_so(run_cell, ip):
    # A user trial's UNet: aten::_convolution counts a ConvTranspose2d's FLOPs itself and an ordinary
    # convolution's on the aten::mkldnn_convolution inside it. Its FLOP/s divided the transposed calls'
    # FLOPs by all the calls' time (998 MFLOP/s for their own 7.64 GFLOP/s) and read as all the calls' rate.
    run_cell(UNET)
    _, captured = run_cell("%%profile_gpu -r prof\nwith torch.no_grad():\n    net(x)")
    prof = ip.user_ns["prof"]
    ops = prof.ops.set_index("name")
    conv, transposed = ops.loc["aten::_convolution"], ops.loc["aten::conv_transpose2d"]
    assert conv["calls"] == ops.loc["aten::conv2d", "calls"] + transposed["calls"]
    assert 0 < conv["flops_calls"] == transposed["calls"] < conv["calls"]
    events = prof.op_events
    carried = events[(events["name"] == "aten::_convolution") & events["flops_counted"].astype(bool)]
    assert conv["flops_per_s"] == pytest.approx(conv["flops"] / (carried["dur_us"].sum() * 1e-6))
    inner = ops.loc["aten::mkldnn_convolution"]  # every call carries its FLOPs: no note
    assert inner["flops_calls"] == inner["calls"]
    note = f"({conv['flops_calls']} of {conv['calls']} calls)"
    data = bundle(captured)
    line = next(r for r in data["text/plain"].splitlines() if r.startswith("aten::_convolution "))
    assert line.endswith(render_profile._fmt("rate", conv["flops_per_s"]) + " " + note)
    assert "calls)" not in next(r for r in data["text/plain"].splitlines() if r.startswith("aten::mkldnn_conv"))
    assert note in data["text/html"]
    assert 'and says so: "(2 of 13 calls)"' in unfolded(data["text/plain"].split("method: ")[1])
    box = render_profile.widget(prof)
    assert any(note in w.value for w in walk(box) if type(w).__name__ == "HTML")
    assert {r["name"]: r["flops_calls"] for r in prof.to_dict()["ops"]}["aten::_convolution"] == conv["flops_calls"]


def test_to_dict_is_json_safe(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --memory --stack")
    data = json.loads(json.dumps(prof.to_dict(), allow_nan=False))
    assert data["kind"] == "profile" and data["schema_version"] >= 1
    assert data["ops"] and data["categories"] and data["advice"]
    assert data["options"]["memory"] is True


# --- the widget, as a user drives it -------------------------------------------------------------


def _ops_html(box):
    """The operator table's HTML, without the <wbr> break opportunities in long names (not text)."""
    tab = next(w for w in walk(box) if type(w).__name__ == "Tab")
    return ops_table(box).value.replace("<wbr>", "")


def _headers(box):
    """The operator table's column headers (the widget's header buttons), as they read."""
    return [b.description for b in header_buttons(box)]


def _first_column(html):
    return first_column(html)


def test_widget_controls_change_the_table(run_cell, ip, monkeypatch):
    monkeypatch.setattr(display_module, "WIDGETS", "always")
    prof, result, captured = profile_cell(run_cell, ip, opts="-r prof --stack")
    assert "application/vnd.jupyter.widget-view+json" in bundle(captured)
    box = render_profile.widget(prof)
    group = control(box, "ToggleButtons", "group by")
    assert group.value == "source"
    assert _first_column(_ops_html(box))[0] == f"Cell In[{result.execution_count}], line 3: y = a @ b"

    group.value = "op"
    names = _first_column(_ops_html(box))
    assert names[0] == "aten::mm"

    sort = control(box, "Dropdown", "sort by")
    sort.value = "calls"
    by_calls = _first_column(_ops_html(box))
    assert by_calls != names
    calls = prof.table(group="op", sort="calls")
    assert by_calls[0] == calls.iloc[0]["name"]

    control(box, "Checkbox", "ascending").value = True
    assert _first_column(_ops_html(box))[0] == prof.table(group="op", sort="calls", ascending=True).iloc[0]["name"]

    name_filter = control(box, "Text", "filter")
    name_filter.value = "mm"
    filtered = _first_column(_ops_html(box))
    assert filtered and all("mm" in n for n in filtered)
    status = [w for w in walk(box) if type(w).__name__ == "HTML" and "rows matching" in w.value]
    # worded as the text's title (it read "3 of 3 rows matching "mm""), order and grouping left to the controls
    rows = "1 row" if len(filtered) == 1 else f"{len(filtered)} rows"
    assert status and f"the {rows} matching &#x27;mm&#x27; ({len(prof.grouped('op'))} in all)" in status[0].value
    name_filter.value = "aten::(mm"  # matches nothing, as plain text or as the regex it fails to be
    said = html_unescape(_ops_html(box))
    assert (f"no row of the {len(prof.grouped('op'))} (grouped by op) has a name or source line matching 'aten::(mm' "
            "(as a regex it is invalid: missing )") in said
    name_filter.value = ""

    top = control(box, "IntSlider", "top K")
    top.value = 1
    assert len(_first_column(_ops_html(box))) == 1

    group.value = "op+shape"
    assert "input shapes" in _headers(box) and "1000x1000, 1000x1001" in _ops_html(box)


def test_widget_top_k_sort_choices_and_name_order_follow_the_grouping(run_cell, ip):
    # From a JupyterLab trial: a --stack profile opened on 2 source lines and its top-K slider
    # stayed at 2 for every grouping; "input shapes" was offered where no shapes column shows;
    # sorting by operator went Z to A.
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --stack --top 8")
    box = render_profile.widget(prof)
    group, sort = control(box, "ToggleButtons", "group by"), control(box, "Dropdown", "sort by")
    assert control(box, "IntSlider", "top K").value == 8
    group.value = "op"
    assert len(_first_column(_ops_html(box))) == min(8, len(prof.table(group="op")))
    assert "shapes" not in {col for _, col in sort.options} and "source" not in {col for _, col in sort.options}
    group.value = "op+shape"
    sort.value = "shapes"
    assert control(box, "Checkbox", "ascending").value  # a text column: A to Z
    group.value = "op"
    assert sort.value == "cpu_self_us" and "shapes" not in {col for _, col in sort.options}  # back to the default
    sort.value = "name"
    names = _first_column(_ops_html(box))
    assert names == sorted(names) and control(box, "Checkbox", "ascending").value
    sort.value = "calls"
    assert not control(box, "Checkbox", "ascending").value  # numbers: largest first


def test_widget_switching_to_a_grouping_without_the_sorted_text_column_sorts_largest_first_again(run_cell, ip):
    # From a JupyterLab trial: sort by "source line" (a text column ticks "ascending": A to Z), then
    # group by "op": the sort went back to self CPU but "ascending" stayed ticked, so "top K" listed the
    # cheapest ops (aten::fill_ 5 us first) under a "self CPU \u25b2" header nobody had asked for.
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --stack --top 3")
    box = render_profile.widget(prof)
    group, sort = control(box, "ToggleButtons", "group by"), control(box, "Dropdown", "sort by")
    ascending = control(box, "Checkbox", "ascending")
    sort.value = "source"
    assert ascending.value
    group.value = "op"
    assert sort.value == "cpu_self_us" and not ascending.value
    html = _ops_html(box)
    assert "self CPU \u25bc" in _headers(box) and "self CPU \u25b2" not in _headers(box)
    assert _first_column(html) == list(prof.table(group="op").head(3)["name"])  # the costliest three
    # A column both groupings show keeps the order the user chose.
    sort.value = "calls"
    ascending.value = True
    group.value = "op+shape"
    assert sort.value == "calls" and ascending.value


def _header(box, label):
    """The header button whose column is ``label`` (with or without its sort arrow)."""
    found = [b for b in header_buttons(box) if b.description.rstrip(" \u25b2\u25bc") == label]
    assert len(found) == 1, f"no single header button {label!r}: {_headers(box)}"
    return found[0]


def test_widget_column_headers_sort_on_click_and_reverse_on_a_second(run_cell, ip):
    # From a trial: users clicked the operator table's column headers and nothing happened (only the
    # "sort by" dropdown sorted). The headers are buttons now: a click sorts, a second reverses.
    prof, _, _ = profile_cell(run_cell, ip)
    box = render_profile.widget(prof)
    sort, ascending = control(box, "Dropdown", "sort by"), control(box, "Checkbox", "ascending")
    cols = render_profile.visible_columns(prof, "op")
    assert [b.description.rstrip(" \u25b2\u25bc") for b in header_buttons(box)] == [label for _, label, _ in cols]
    assert "self CPU \u25bc" in _headers(box)  # the default order, marked as the static table marks it
    assert "<thead>" not in _ops_html(box)  # the buttons are the header ...
    assert "<thead>" in prof._repr_html_() and 'class="fixed"' not in prof._repr_html_()  # ... not in static HTML

    _header(box, "calls").click()  # numbers: largest first
    assert (sort.value, ascending.value) == ("calls", False)
    assert _first_column(_ops_html(box)) == list(prof.table(group="op", sort="calls").head(25)["name"])
    assert "calls \u25bc" in _headers(box) and "self CPU" in _headers(box)  # the old column lost its arrow

    _header(box, "calls").click()  # the same column again: reversed
    assert (sort.value, ascending.value) == ("calls", True)
    assert _first_column(_ops_html(box)) == list(prof.table(group="op", sort="calls", ascending=True)
                                                 .head(25)["name"])
    assert "calls \u25b2" in _headers(box)

    _header(box, "operator").click()  # names: A to Z
    names = _first_column(_ops_html(box))
    assert (sort.value, ascending.value) == ("name", True) and names == sorted(names)
    _header(box, "operator").click()
    assert _first_column(_ops_html(box)) == list(prof.table(group="op", sort="name", ascending=False)
                                                 .head(25)["name"]) and not ascending.value

    # The dropdown and the checkbox drive the header's arrow too.
    sort.value = "cpu_total_us"
    assert "CPU total \u25bc" in _headers(box) and "operator" in _headers(box)
    ascending.value = True
    assert "CPU total \u25b2" in _headers(box)
    _header(box, "CPU total").click()  # a click on the sorted column reverses what the checkbox set
    assert not ascending.value and "CPU total \u25bc" in _headers(box)


def test_widget_header_click_starts_at_the_first_page(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip)
    box = render_profile.widget(prof)
    control(box, "Dropdown", "rows/page").value = 10
    page = control(box, "BoundedIntText", "page")
    page.value = 2
    assert page.value == 2
    _header(box, "calls").click()
    assert page.value == 1
    assert _first_column(_ops_html(box)) == list(prof.table(group="op", sort="calls").head(10)["name"])


def test_widget_header_follows_the_grouping_and_lines_up_with_the_table(run_cell, ip):
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --stack")
    box = render_profile.widget(prof)
    group = control(box, "ToggleButtons", "group by")
    grid = next(w for w in walk(box) if type(w).__name__ == "GridBox")
    for grouping in ("source", "op+shape", "op"):
        group.value = grouping
        cols = render_profile.visible_columns(prof, grouping)
        assert [b.description.rstrip(" \u25b2\u25bc") for b in header_buttons(box)] == [c[1] for c in cols]
        # The grid of buttons and the table's <colgroup> have the same widths, one per column shown.
        html = _ops_html(box)
        widths = re.findall(r'<col(?: style="width:([^"]+)")?>', html)
        template = grid.layout.grid_template_columns.replace("minmax(0, 1fr)", "*").split()
        assert [w or "*" for w in widths] == template and len(template) == len(cols)
        assert 'table class="fixed"' in html
        first_row = re.search(r"<tbody><tr>(.*?)</tr>", html).group(1)
        assert first_row.count("<td") == len(cols)
    group.value = "op+shape"
    _header(box, "input shapes").click()
    shapes = list(prof.table(group="op+shape", sort="shapes", ascending=True)
                  .head(min(25, control(box, "IntSlider", "top K").value))["shapes"])
    assert control(box, "Dropdown", "sort by").value == "shapes" and "input shapes \u25b2" in _headers(box)
    rows = re.findall(r"<tr>(.*?)</tr>", _ops_html(box))
    shown = [html_unescape(re.findall(r"<td[^>]*>(.*?)</td>", r)[1]) for r in rows]  # operator, input shapes
    assert shown == shapes and shapes == sorted(shapes)
    group.value = "source"  # no shapes column there: back to the default, and its button says so
    assert "self CPU \u25bc" in _headers(box) and "input shapes" not in _headers(box)


def test_widget_long_names_are_whole_in_the_fixed_table(run_cell, ip):
    # Fixed column widths must not cut a name: it wraps inside its column (break opportunities after
    # "::" and "_"), every character still in the cell.
    run_cell(SETUP)
    run_cell("%%profile_gpu -q -r prof\nimport torch.nn.functional as F\n"
             "p = F.max_pool2d(torch.randn(1, 3, 16, 16, requires_grad=True), 2, return_indices=True)[0]"
             ".sum().backward()\n")
    prof = ip.user_ns["prof"]
    box = render_profile.widget(prof)
    control(box, "IntSlider", "top K").value = control(box, "IntSlider", "top K").max
    control(box, "Dropdown", "rows/page").value = 200
    names = _first_column(_ops_html(box))
    longest = max(prof.table(group="op", top=None)["name"], key=len)
    assert len(longest) > 30 and longest in names


def test_tiny_shares_read_under_a_tenth_of_a_percent_not_zero(run_cell, ip):
    # From a JupyterLab trial: ops of a few microseconds showed "0.0%" in the "% of total" column (and a
    # 2.37 us "data transfer" category "0.0%"), which reads as none; nbaccel says "<0.1%" elsewhere.
    # --warmup 1: run first, alone, the cell's first Linear call sets oneDNN up and no op was under 0.05%
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --warmup 1")
    box = render_profile.widget(prof)
    control(box, "IntSlider", "top K").value = control(box, "IntSlider", "top K").max
    control(box, "Dropdown", "rows/page").value = 200
    html = _ops_html(box)
    shares = re.findall(r'</span> ([^<]*%)</td>', html)
    table = prof.table(group="op", top=None)
    assert len(shares) == len(table)
    tiny = [s for s, p in zip(shares, table["percent"]) if 0 < p < 0.05]
    assert tiny and set(tiny) == {"&lt;0.1%"}, shares
    zero = re.compile(r"(?<![\d.])0\.0%")  # not the tail of a "20.0%" (a CI run read one)
    assert not zero.search(html) and not zero.search(prof._repr_html_()) and not zero.search(str(prof))
    for s, p in zip(shares, table["percent"]):
        if p >= 0.1:
            assert s == f"{p:.1f}%"


def test_widget_builds_with_breakdown_and_advice_tabs(run_cell, ip, cpu_with_bf16_and_fp16_units):
    prof, _, _ = profile_cell(run_cell, ip, opts="-q -r prof --amp bf16")
    box = render_profile.widget(prof)
    tab = next(w for w in walk(box) if type(w).__name__ == "Tab")
    assert [tab.get_title(i) for i in range(4)] == ["Operators", "Breakdown", "Tensor Cores", "Advice"]
    assert "matmul/conv" in tab.children[1].value
    assert "1008" in tab.children[2].value and "1008" in tab.children[3].value


# --- bad input and faults ------------------------------------------------------------------------


@pytest.mark.parametrize("line, message", [
    ("--steps 0", "--steps must be at least 1"),
    ("--top 0", "--top must be at least 1"),
    ("--warmup -1", "--warmup must be at least 0"),
    ("--sort bogus", "--sort bogus is not a sort key; use one of: cpu, self, device"),
    ("--sort device", "--sort device needs a CUDA device"),
    ("--sort memory", "--sort memory needs --memory"),
    # The word as typed, then what it was read as (it named the mapped key only: "--sort device").
    ("--sort gpu", "--sort gpu (device time) needs a CUDA device"),
    ("--sort DEVICE", "--sort DEVICE needs a CUDA device"),
    ("--sort self_cpu_memory_usage", "--sort self_cpu_memory_usage (memory) needs --memory"),
    ("--amp fp8", "--amp fp8 is not supported"),
    ("--bogus", "unrecognized arguments"),
    ("-r 1abc", "-r/--result takes a Python variable name"),
    ("-r for", "-r/--result takes a Python variable name, got 'for'"),
    ("-r __builtins__", "would replace one of Python's own names"),
    ("-r print", "-r/--result print would replace one of Python's own names"),
    ("--trace /proc/version/trace.json", "cannot write into /proc/version (a file, not a folder)"),
    ("--trace /proc/version", "exists and is not a folder"),
    # Root passes os.access everywhere; /proc refuses new files (the trace was lost after the run).
    ("--trace /proc/nope.json", "--trace /proc/nope.json: cannot write into /proc ("),
    ("--trace /proc/steps", "--trace /proc/steps: cannot write into /proc ("),
    # Two groupings of one table: --shapes was silently dropped (a user trial). The fix is in the message.
    ("--stack --shapes", "--stack and --shapes both choose how the table is grouped (--stack: by source line, "
                         "--shapes: by op and input shapes); give one. A --stack profile can show the op+shape "
                         "grouping afterwards: keep the result with -r NAME and call NAME.table(group='op+shape')"),
])
def test_bad_input_is_a_usage_error_before_the_cell_runs(ip, line, message):
    if "device" in line and torch.cuda.is_available():
        pytest.skip("--sort device is valid on a CUDA machine")
    ip.user_ns["ran"] = 0
    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_cell_magic("profile_gpu", line, "ran += 1")
    assert ip.user_ns["ran"] == 0


def test_stack_with_shapes_is_refused_by_the_api_before_the_code_runs():
    from nbaccel.profile import ProfileError

    ran = []
    with pytest.raises(ProfileError, match=re.escape(
            "stack=True and shapes=True both choose how the table is grouped") + ".*give one.*"
            + re.escape("result.table(group='op+shape')")):
        with nbaccel.profile(stack=True, shapes=True):
            ran.append(1)
    assert not ran


@pytest.mark.parametrize("kwargs, message", [
    (dict(top=0), "top must be at least 1, got 0"),
    (dict(steps=0), "steps must be at least 1"),
    (dict(amp="fp8"), "amp='fp8' is not supported; use one of: bf16, fp16, auto"),
    (dict(amp="fp32"), "amp='fp32': fp32 is what runs without amp; leave it out"),
    (dict(sort="memory"), "sort='memory' needs memory=True"),
    (dict(stack=True, shapes=True), "stack=True and shapes=True both choose"),
])
def test_an_option_wrong_on_any_machine_is_refused_when_the_profile_is_made(kwargs, message):
    """As nbaccel.precision('fp8') is: a script learns it at the line that made the object."""
    from nbaccel.profile import ProfileError

    with pytest.raises(ProfileError, match=re.escape(message)):
        nbaccel.profile(**kwargs)


@pytest.mark.parametrize("spelling", ["bfloat16", "BF16", torch.bfloat16, "torch.bfloat16"])
def test_amp_takes_the_dtype_spellings_precision_takes(spelling):
    with nbaccel.profile(amp=spelling) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert prof.options.amp == "bf16" and prof.result.recipe_label.startswith("autocast bf16")
    from nbaccel.profile import profile_function

    assert profile_function(lambda: torch.ones(8, 8) @ torch.ones(8, 8), amp=spelling).options.amp == "bf16"


def test_unwritable_trace_folder_is_refused(ip, tmp_path, monkeypatch):
    from nbaccel import profile_options

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(profile_options.tempfile, "TemporaryFile", refuse)
    ip.user_ns["ran"] = 0
    with pytest.raises(UsageError, match=f"cannot write into {tmp_path} \\(Permission denied\\); choose another path"):
        ip.run_cell_magic("profile_gpu", f"--trace {tmp_path}/t.json", "ran += 1")
    assert ip.user_ns["ran"] == 0


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc here")
def test_a_trace_under_proc_is_refused_saying_why_before_the_code_runs(ip):
    """A trial: --trace /proc/x.json was refused with "(No such file or directory)" about a folder that
    exists: /proc takes no new files, which the refusal now says, with the fix."""
    from nbaccel.profile import ProfileError

    ip.user_ns["ran"] = 0
    said = r"cannot write into /proc \(a virtual file system of the kernel, such as /proc, which takes no new files"
    with pytest.raises(UsageError, match=r"--trace /proc/nbaccel_x\.json: " + said + r".*choose another path"):
        ip.run_cell_magic("profile_gpu", "--trace /proc/nbaccel_x.json", "ran += 1")
    assert ip.user_ns["ran"] == 0
    ran = []
    with pytest.raises(ProfileError, match=r"trace='/proc/nbaccel_x\.json': " + said):
        with nbaccel.profile(trace="/proc/nbaccel_x.json"):
            ran.append(1)
    assert not ran


def test_a_trace_name_that_reads_as_a_file_is_asked_about(run_cell, ip, tmp_path):
    """A trial: --trace out.txt made a folder named out.txt with the trace inside it."""
    ip.user_ns["ran"] = 0
    with pytest.raises(UsageError, match=r"--trace .*out\.txt: a name not ending in \.json is a folder .* out\.txt reads as "
                                         r"a file name\. For one file use out\.json \(or out\.json\.gz\); for a folder, a "
                                         r"name without an extension or with a trailing /"):
        ip.run_cell_magic("profile_gpu", f"--trace {tmp_path}/out.txt", "ran += 1")
    assert ip.user_ns["ran"] == 0 and not (tmp_path / "out.txt").exists()
    # a trailing / says "folder"; so does a folder that exists; ".2" is no file extension
    for name in ("out.txt/", "run1.2"):
        run_cell(f"%%profile_gpu -q --trace {tmp_path}/{name}\nran += 1")
        assert (tmp_path / name.rstrip("/")).is_dir()
    run_cell(f"%%profile_gpu -q --trace {tmp_path}/out.txt\nran += 1")  # exists now, as a folder
    assert ip.user_ns["ran"] == 3


@pytest.mark.parametrize("name", ["t.json", "t.json.gz", "steps"])
def test_a_trace_that_fails_to_write_keeps_the_profile(run_cell, ip, tmp_path, monkeypatch, name):
    # A new user's `--trace /sys/run.json` (writable by the check, refused by the kernel at write
    # time) lost the profile behind a traceback. Now only the file is lost, with a line that says so.
    import sys

    module = sys.modules["nbaccel.profile"]  # the module, not the function nbaccel.profile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(module.Path, "write_bytes", refuse)
    monkeypatch.setattr(module, "write_step_traces", refuse)
    target = tmp_path / name
    ip.user_ns["torch"] = torch
    for attempt in range(2):  # said every time, not once per session
        _, captured = run_cell(f"%%profile_gpu -q -r prof --trace {target}\nx = torch.ones(64, 64) @ torch.ones(64, 64)")
        err = unfolded(captured.stderr)
        # a plain line, not a warning that shows nbaccel's file and source line
        assert f"could not write the trace to {target} (Permission denied); the profile is shown without it: keep " \
               "the result with -r NAME and save it with NAME.export_chrome_trace(" in err
        assert "TraceSaveWarning" not in err and "profile.py" not in err
    prof = ip.user_ns["prof"]
    assert prof.op_count > 0 and prof.trace_path is None and prof.trace_files == []
    assert not target.exists()
    # The API (a script) gets a TraceSaveWarning it can filter, pointing at the caller's line.
    with pytest.warns(module.TraceSaveWarning, match=f"could not write the trace to {target} .Permission denied") as got:
        with nbaccel.profile(trace=str(target)):
            torch.ones(8) + 1
    assert got[0].filename == __file__
    # A file whose folders were made on the way says so (the write failed after them).
    if name.endswith(".json"):
        nested = tmp_path / "new" / "deeper" / name
        _, captured = run_cell(f"%%profile_gpu -q --trace {nested}\nx = torch.ones(8) + 1")
        assert f"(the folder {tmp_path / 'new'} was created on the way and is left there)" in unfolded(captured.stderr)


def test_empty_cell_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="needs code"):
        ip.run_cell_magic("profile_gpu", "", "  \n")
    # A user trial: a comment-only %%amp cell ran 21 times and reported "plain Python timed: 0.77x".
    with pytest.raises(UsageError, match=r"needs code in the cell below the magic line \(it has only comments\)"):
        ip.run_cell_magic("profile_gpu", "", "# model(x) once it is defined\n  # nothing else\n")


def test_a_running_profiler_is_refused(ip):
    ip.user_ns["ran"] = 0
    with torch.profiler.profile():
        with pytest.raises(UsageError, match="another torch profiler is already running"):
            ip.run_cell_magic("profile_gpu", "", "ran += 1")
    assert ip.user_ns["ran"] == 0


def test_cell_that_raises_stops_the_profiler_and_propagates(run_cell, ip):
    run_cell(SETUP)
    result, captured = run_cell("%%profile_gpu --amp bf16 --warmup 1 --steps 2 -r prof\nruns += 1\ny = a @ b\n"
                                "if runs == 2: raise ValueError('boom in run 2')\n", expect_error=ValueError)
    assert "boom in run 2" in str(result.error_in_exec)
    assert "raised ValueError in run 2 of 3; the profiler was stopped and the partial profile discarded" in unfolded(captured.stderr)
    # No snapshot here: the note must not promise a restore that did not happen.
    assert ("What the runs did to your variables and to torch's settings (grad mode, default dtype...) is not "
            "undone; only the --amp recipe's own flags (autocast, TF32, cudnn.benchmark) were put back."
            in unfolded(captured.stderr))
    assert "prof" not in ip.user_ns
    assert not torch._C._autograd._profiler_enabled()
    assert not torch.is_autocast_enabled("cpu")
    # The next profile works.
    run_cell("%%profile_gpu -q -r prof\ny = a @ b\n")
    assert ip.user_ns["prof"].ops.iloc[0]["name"] == "aten::mm"


def test_keyboard_interrupt_stops_the_profiler_and_is_reraised(ip, run_cell, capsys):
    run_cell(SETUP)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("profile_gpu", "--steps 3 -q", "runs += 1\nif runs == 2: raise KeyboardInterrupt\n")
    assert ip.user_ns["runs"] == 2
    assert not torch._C._autograd._profiler_enabled()
    # Worded as %%amp words it (a trial: "raised KeyboardInterrupt" beside %%amp's "was interrupted").
    assert "nbaccel: the profiled code was interrupted (KeyboardInterrupt) in run 2 of 3;" in capsys.readouterr().err


def test_kineto_start_stop_lines_do_not_leak_to_stderr(run_cell, ip, capfd):
    run_cell(SETUP)
    capfd.readouterr()
    run_cell("%%profile_gpu -q --warmup 1 --steps 2\ny = a @ b\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err


def test_other_stderr_lines_are_kept_by_the_filter(capfd):
    import os
    import sys

    quiet_kineto = sys.modules["nbaccel.profile"].quiet_kineto
    with quiet_kineto():
        os.write(2, b"USDT:2026-11-29 23:43:40 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert "a real warning" in err and "profiler_start" not in err


def test_help_is_accurate(ip):
    doc = ip.magics_manager.magics["cell"]["profile_gpu"].__doc__
    for option in ("--top", "--sort", "--memory", "--shapes", "--stack", "--warmup", "--steps", "--trace", "--amp",
                   "--device", "--result", "--quiet", "W+S times"):
        assert option in doc, option


def test_unload_removes_the_magic(ip):
    assert "profile_gpu" in ip.magics_manager.magics["cell"]
    ip.run_line_magic("unload_ext", "nbaccel")
    assert "profile_gpu" not in ip.magics_manager.magics["cell"]
    ip.run_line_magic("load_ext", "nbaccel")
    assert "profile_gpu" in ip.magics_manager.magics["cell"]


# --- the plain API -------------------------------------------------------------------------------


def test_context_manager_api_for_scripts():
    a = torch.randn(64, 72)
    with nbaccel.profile(top=5) as prof:
        (a @ a.T).relu()
    result = prof.result
    assert isinstance(result, nbaccel.ProfileResult)
    assert {"aten::mm", "aten::relu"} <= set(result.ops["name"])
    assert "CPU only" in str(result) and "<table>" in result._repr_html_()


def test_context_manager_with_steps_needs_step_calls():
    from nbaccel.profile import ProfileError

    with pytest.raises(ProfileError, match=r"needs 3 calls to \.step\(\); got 1, so no active step was completed"):
        with nbaccel.profile(warmup=1, steps=2) as prof:
            torch.ones(3) + 1
            prof.step()
    assert not torch._C._autograd._profiler_enabled()
    # a trial: two calls read "so no active step was completed" although one was
    with pytest.raises(ProfileError, match="got 2, only 1 of the 2 active steps was completed"):
        with nbaccel.profile(warmup=1, steps=2) as prof:
            for _ in range(2):
                torch.ones(3) + 1
                prof.step()
    with nbaccel.profile(warmup=1, steps=2) as prof:
        for _ in range(3):
            torch.ones(3) + 1
            prof.step()
    assert len(prof.result.step_times_us) == 2


def test_the_default_one_step_ends_at_the_first_step_call():
    """A trial: a loop calling prof.step() under the default steps=1 recorded all 3 iterations (3x the op
    calls, FLOPs and wall time) under a header of "1 step". One step is recorded, as schedule(active=1) would."""
    a = torch.randn(64, 64)
    with nbaccel.profile() as once:
        a @ a
    with nbaccel.profile() as loop:
        for _ in range(3):
            a @ a
            loop.step()
        assert not torch._C._autograd._profiler_enabled()  # stopped at the first step(), the block goes on
    assert loop.steps_done == 3 and len(loop.result.step_times_us) == 1
    assert loop.result.op_calls == once.result.op_calls
    mm = lambda r: next(row for row in r.grouped_rows("op") if row["name"] == "aten::mm")  # noqa: E731
    assert mm(loop.result)["calls"] == 1 and mm(loop.result)["flops"] == mm(once.result)["flops"]
    # the recipe stays on for the rest of the block, and comes off at its end
    with nbaccel.profile(amp="bf16") as amp:
        a @ a
        amp.step()
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_torch_cycle_warning_hidden_during_our_calls_only():
    # torch 2.11 on an H200 warned "Profiler clears events at the end of each cycle" through
    # %%profile_gpu, whose schedule has one cycle. Hidden inside nbaccel's calls, and not marked as
    # shown, so the user's own multi-cycle profiler still gets it.
    import warnings

    from torch.profiler import profiler as torch_profiler

    from nbaccel.profile import quiet_kineto

    message = "Warning: Profiler clears events at the end of each cycle. (test)"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_kineto():
            torch_profiler._warn_once(message)
        assert not seen
        assert message not in torch_profiler._WARNINGS_SHOWN
        torch_profiler._warn_once(message)
        assert [str(w.message) for w in seen] == [message]
    torch_profiler._WARNINGS_SHOWN.discard(message)


_UNKNOWN_BLOCK_SCRIPT = r"""
import os, torch
from IPython.testing.globalipapp import start_ipython

# Control: plain torch.profiler logs the line (C++, straight to fd 2) for frees of tensors made
# before it started -- the first time, then every 1000th.
keep = [torch.ones(16) for _ in range(2500)]
with torch.profiler.profile(profile_memory=True):
    keep.clear()
os.write(2, b"=== magic\n")
ip = start_ipython()
ip.run_line_magic("load_ext", "nbaccel")
ip.run_cell("import os, torch\nkeep = [torch.ones(16) for _ in range(2500)]")
result = ip.run_cell("%%profile_gpu --memory -q -r p\nos.write(2, b'the cell wrote this\\n')\nkeep.clear()\n"
                     "os.write(2, b'the cell ends\\n')\nlen(keep)\n")
assert result.success and result.result == 0, result
assert ip.user_ns["p"].options.memory
os.write(2, b"=== api\n")
import nbaccel
keep = [torch.ones(16) for _ in range(2500)]
with nbaccel.profile(memory=True) as prof:
    os.write(2, b"the block wrote this\n")
    keep.clear()
assert prof.result.options.memory
os.write(2, b"=== done\n")
"""


def test_memory_profile_drops_torchs_unknown_block_line_and_nothing_else(tmp_path):
    # The magic and the API (nbaccel.profile(memory=True)) both filter it.
    # A fresh process: torch logs the line only every 1000th time per process.
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unknown_block.py"
    script.write_text(_UNKNOWN_BLOCK_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    control, rest = proc.stderr.split("=== magic\n")
    magic, rest = rest.split("=== api\n")
    api, _ = rest.split("=== done\n")
    line = "Memory block of unknown size was allocated before the profiling started"
    assert line in control, proc.stderr  # this torch does log it (else the check below proves nothing)
    assert line not in magic, magic
    assert "the cell wrote this\nthe cell ends\n" in magic
    assert line not in api and "the block wrote this\n" in api, api


def test_a_profile_in_another_thread_is_refused_not_crashed():
    # The "already running" check reads the calling thread's state; two threads profiling at once
    # segfaulted the process inside Kineto.
    import threading

    from nbaccel.profile import ProfileError

    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with nbaccel.profile():
            inside.set()
            leave.wait(30)

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        assert inside.wait(30)
        with pytest.raises(ProfileError, match=r"an nbaccel.profile\(\) block is recording in another thread \("):
            with nbaccel.profile():
                pass
    finally:
        leave.set()
        worker.join(30)
    with nbaccel.profile() as prof:  # free again once the other thread is done
        torch.ones(4) + 1
    assert prof.result.op_count > 0


def test_profile_flags_take_booleans():
    from nbaccel.profile import ProfileError

    with pytest.raises(ProfileError, match="memory takes True or False, got 'no'"):
        nbaccel.profile(memory="no").__enter__()
    with nbaccel.profile() as prof:  # the refusal left nothing held
        torch.ones(4) + 1
    assert prof.result is not None


def test_the_flops_column_is_each_ops_own_and_sums_to_the_header(run_cell, ip):
    from nbaccel.render.common import si
    # aten::linear, aten::matmul and autocast's outer matmul once repeated the FLOPs of the
    # aten::addmm / aten::mm inside them: sorted by FLOPs the column summed to more than the step.
    run_cell("import torch\ntorch.manual_seed(0)\nm = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), "
             "torch.nn.Linear(128, 8))\nx = torch.randn(32, 64)\nw = torch.randn(64, 64)")
    _, captured = run_cell("%%profile_gpu --sort flops --amp bf16 -r prof\n"
                           "loss = m(x @ w).sum()\nloss.backward()")
    prof = ip.user_ns["prof"]
    ops = prof.ops.set_index("name")
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast("cpu", dtype=torch.bfloat16):
        ip.user_ns["m"](ip.user_ns["x"] @ ip.user_ns["w"]).sum().backward()
    assert prof.header["flops"] == counter.get_total_flops()  # forward and backward, each op once
    assert ops["flops"].sum() == prof.header["flops"]
    assert ops.loc["aten::addmm", "flops"] == 2 * 32 * (64 * 128 + 128 * 8)
    assert ops.loc["aten::linear", "flops"] != ops.loc["aten::linear", "flops"]  # NaN: its addmm has them
    assert ops.loc["aten::matmul", "flops"] != ops.loc["aten::matmul", "flops"]
    assert [r["flops"] for r in prof.to_dict()["ops"]] == [None if f != f else f for f in prof.ops["flops"]]
    text = bundle(captured)["text/plain"]
    table = text.split("time by category")[0]
    assert "self FLOPs" in table and re.search(r"aten::linear .* - ", table)
    assert f"({si(prof.header['flops'], 'FLOP')}, " in text.split("method: ")[0]
    assert "the column sums to the header's FLOPs" in unfolded(text.split("method: ")[1])


def test_the_mixed_precision_advice_names_what_its_maker_would_run(run_cell, ip, tmp_path,
                                                                  cpu_with_bf16_and_fp16_units):
    """A user trial: `nbaccel.profile()` and a loaded trace were told "try %%amp (or --amp bf16 here)"."""
    w = torch.randn(512, 512)
    ip.user_ns["w"] = w
    run_cell("%%profile_gpu -q -r prof --trace " + str(tmp_path / "t.json") + "\nfor _ in range(3): w @ w")
    magic = next(a for a in ip.user_ns["prof"].advice if a.startswith("fp32 matmul/conv ops take"))
    assert "try %%amp (or --amp bf16 here) -- " in magic
    # the units are this CPU's, known: no "on others its matmuls run emulated" hedge (a trial on an AMX CPU)
    assert magic.endswith("-- this CPU's AMX-BF16 tiles run bf16 matmuls.")
    with nbaccel.profile() as prof:
        for _ in range(3):
            w @ w
    api = next(a for a in prof.result.advice if a.startswith("fp32 matmul/conv ops take"))
    assert "try nbaccel.compare_amp (or amp='bf16' here) -- " in api
    loaded = next(a for a in nbaccel.load_trace(str(tmp_path / "t.json")).advice
                  if a.startswith("fp32 matmul/conv ops take"))
    assert "try nbaccel.compare_amp -- " in loaded  # a file cannot be profiled again under a recipe
    # On a CPU without bf16 units (a trial's Ice Lake) mixed precision is not the fix to try.
    import dataclasses

    result = prof.result
    result.device = dataclasses.replace(result.device, cpu_features={"amx_bf16": False, "avx512_bf16": False})
    result.__dict__.pop("advice", None)
    line = next(a for a in result.advice if a.startswith("fp32 matmul/conv ops take"))
    assert re.search(r"of CPU time \(aten::mm \d+\.\d%[^)]*\); this CPU", line)
    assert line.endswith("this CPU has no bf16 units (AMX / AVX512-BF16), so mixed precision would run these on "
                         "emulated bf16 kernels, slower than fp32's: cut the matmul time itself (fewer, larger "
                         "matmuls), or compare on a GPU.")


def test_bf16_on_a_cpu_without_bf16_units_names_its_emulated_matmuls(run_cell, ip, cpu_without_bf16_units):
    """A trial on an AVX2-only EPYC: --amp bf16 spent 88-93% of an MLP's, a CNN's and a GRU's step in bf16
    matmuls and convolutions (a bf16 256^3 matmul 17.8 ms, fp32 1.0 ms), and the advice said only "Profiled
    on the CPU"."""
    run_cell("import torch\nmlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), "
             "torch.nn.Linear(256, 256))\ny = torch.randn(64, 256)")
    run_cell("%%profile_gpu --amp bf16 -q -r prof\nmlp(y).sum().backward()")
    prof = ip.user_ns["prof"]
    line = next(a for a in prof.advice if a.startswith("This CPU has no bf16 units"))
    rows = [r for r in prof.grouped_rows("op") if r["dtype"] == "bf16" and r["category"] == "matmul/conv"]
    share = sum(r["percent"] for r in rows) / 100
    assert share >= 0.2  # two 256x256 Linear layers and their backward: the step's math
    assert (f"the bf16 matmuls and convolutions of --amp bf16 take {share:.0%} of CPU time (aten::" in line
            and line.endswith("run emulated kernels, slower than fp32's; %%amp measures by how much. bf16 pays on "
                              "a GPU or a CPU with those units.")), line
    # without --amp, no such line
    run_cell("%%profile_gpu -q -r plain\nmlp(y).sum().backward()")
    assert not any(a.startswith("This CPU has no bf16 units:") for a in ip.user_ns["plain"].advice)


def test_a_profile_object_used_twice_counts_each_use_on_its_own():
    # A review: steps_done went on from the first use (3, then 6), so a use that never called .step()
    # was not refused.
    from nbaccel.profile import ProfileError

    prof = nbaccel.profile(device="cpu", warmup=1, steps=2)
    for _ in range(2):
        with prof:
            for _ in range(3):
                torch.ones(4).sum()
                prof.step()
        assert prof.steps_done == 3 and prof.result is not None
    with pytest.raises(ProfileError, match=r"needs 3 calls to \.step\(\); got 0") as info:
        with prof:
            torch.ones(4).sum()
    # with no call at all the fix is the loop, said in code (a trial was told only the count)
    assert "call prof.step() at the end of each iteration" in str(info.value)
    assert "for _ in range(3): ...; prof.step()" in str(info.value)


def test_wall_time_covers_the_code_not_only_its_ops():
    """A trial: a block that slept 200 ms before its one matmul read "wall time 6.65 ms", and its
    "achieved FLOP/s over wall time" was 32x too high: the window ran from the first op to the last."""
    import time

    a = torch.randn(64, 64)
    with nbaccel.profile() as prof:
        time.sleep(0.2)
        a @ a
        time.sleep(0.05)
    header = prof.result.header
    assert header["wall_us"] >= 250_000 and header["steps"] == 1
    assert prof.result.step_times_us == [pytest.approx(header["wall_us"], rel=0.01)]
    assert header["flops_per_s"] == pytest.approx(2 * 64**3 / (header["wall_us"] * 1e-6))
    table = prof.result.table()
    assert not table["name"].str.startswith("ProfilerStep").any()  # the range is not an op row


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_matmul_cell_counts_no_dense_flops_and_offers_no_padding(run_cell, ip):
    """A user trial read "achieved: 364 GFLOP/s" on a 2-core CPU for sparse matmuls counted as dense ones."""
    run_cell("import torch\ntorch.manual_seed(0)\nn = 2000\n"
             "sp = torch.sparse_coo_tensor(torch.stack([torch.arange(n), torch.randperm(n)]), torch.randn(n), (n, n), "
             "check_invariants=True)"
             ".coalesce()\ncsr = sp.to_sparse_csr()\nd = torch.randn(n, 64)")
    run_cell("%%profile_gpu --top 3 -q -r prof\na = torch.sparse.mm(sp, d)\nb = csr @ d")
    text = unfolded(ip.user_ns["prof"])
    assert "achieved: no FLOP formula matched an op" in text and "GFLOP" not in text
    assert "the matmul/conv ops took sparse (non-strided) operands: no tile shapes to pad" in text
    # %%amp's op audit counts none either (its FLOP share and achieved FLOP/s read the same formulas)
    res = nbaccel.compare_amp(lambda: torch.mm(ip.user_ns["sp"], ip.user_ns["d"]), dtype="bf16", device="cpu",
                              repeat=2, warmup=0)
    assert res.baseline.flops == res.amp.flops == 0


def test_a_recurrent_layer_is_matmul_time_and_its_shapes_are_said_to_be_unread(run_cell, ip):
    """A user trial: an LSTM's profile read "other 99.7%" and "no matmul/conv ops were recorded" beside
    mkldnn_rnn_layer rows with FLOPs, so the matmul advice never fired for a recurrent model."""
    run_cell("import torch\ntorch.manual_seed(0)\nlstm = torch.nn.LSTM(8, 16, num_layers=2)\nseq = torch.randn(20, 4, 8)")
    run_cell("%%profile_gpu -q -r prof --device cpu --warmup 1\no, _ = lstm(seq)\no.sum().backward()")
    prof = ip.user_ns["prof"]
    shares = {category: percent for category, _, _, percent in prof.category_rows}
    assert max(shares, key=shares.get) == "matmul/conv" and shares.get("other", 0) < 50
    text = unfolded(prof)
    assert "no matmul/conv op here has operand shapes nbaccel reads (recurrent layers" in text
    assert "fp32 matmul/conv ops take" in text


@pytest.mark.parametrize("opts, starts", [
    ("", "with torch.profiler.profile() as mine:"),
    ("--warmup 1 --steps 2", "with torch.autograd.profiler.profile() as mine:"),
])
def test_a_profiler_the_cell_starts_is_refused_not_a_crash(run_cell, ip, opts, starts):
    """A user trial: a cell that ran its own torch profiler ended nbaccel's Kineto session, and reading the
    trace killed the kernel with a segmentation fault (in the warm-up steps too, where nothing afterwards
    can tell). The cell's profiler now fails as it starts, and the profile is discarded."""
    from nbaccel.profile_options import ProfileError

    prepare, start = (torch.autograd.profiler.profile.__dict__[n] for n in ("_prepare_trace", "_start_trace"))
    run_cell("import torch\nx = torch.randn(32, 32)")
    result, out = run_cell(f"%%profile_gpu {opts}\n{starts}\n    x @ x", expect_error=ProfileError)
    assert "torch runs one profiler per process" in str(result.error_in_exec)
    assert "the partial profile discarded" in unfolded(out.stderr)
    assert not torch.autograd._profiler_enabled()
    assert torch.autograd.profiler.profile.__dict__["_prepare_trace"] is prepare  # the guard is gone
    assert torch.autograd.profiler.profile.__dict__["_start_trace"] is start
    run_cell(f"{starts}\n    x @ x")  # the user's own profiler works again outside
    run_cell("%%profile_gpu -q -r prof\nx @ x")  # and so does the next profile
    assert ip.user_ns["prof"].op_calls > 0
    with nbaccel.profile(device="cpu"), pytest.raises(ProfileError, match="nbaccel.profile is profiling this code"):
        with torch.profiler.profile():
            pass


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_a_onednn_convolution_keeps_its_flops():
    """A review: the sparse-operand rule (dims without strides) took oneDNN's tensors, dense but strideless,
    for sparse ones, and counted a to_mkldnn() convolution as 0 FLOPs in both magics."""
    from torch.utils import mkldnn as mkldnn_utils

    from nbaccel.flops import OpAudit

    torch.manual_seed(0)
    conv = mkldnn_utils.to_mkldnn(torch.nn.Conv2d(3, 8, 3))
    x = torch.randn(2, 3, 16, 16).to_mkldnn()
    expected = 2 * 2 * 8 * 3 * 3 * 3 * 14 * 14
    with nbaccel.profile(device="cpu") as prof:
        conv(x)
    assert prof.result.flops.flops == expected
    audit = OpAudit()
    with audit:
        conv(x)
    assert audit.total_flops == expected


def test_a_transposed_convolution_pads_its_own_output_channels():
    """A user trial: ConvTranspose1d(6, 10) was told "C_out=6 -> 8" (its C_in): the ops that carry the
    FLOPs (aten::_convolution, convolution_backward) are not named "transpose"; their argument says it."""
    torch.manual_seed(0)
    conv, x = torch.nn.ConvTranspose1d(6, 10, 3), torch.randn(2, 6, 20, requires_grad=True)
    with nbaccel.profile(device="cpu") as prof:
        conv(x).sum().backward()
    rows = prof.result.unaligned
    assert rows and all(r["dims"]["C_out"] == 10 for r in rows), rows
    assert all(r["pad_to"].get("C_out") == 16 for r in rows if "C_out" in r["unaligned"])


def test_profile_under_fp16_on_a_cpu_without_amx_fp16_says_so(run_cell, ip, monkeypatch):
    """A trial: %%profile_gpu --amp fp16 never said that this CPU has no fp16 matrix units (%%amp does)."""
    import nbaccel.device as device

    flags = device.cpu_flags() | {"amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16"}
    flags -= {"amx_fp16"}
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    monkeypatch.setattr(device, "_cpu_feature", lambda name: name in flags)
    ip.user_ns.update(w=torch.randn(256, 256), torch=torch)
    run_cell("%%profile_gpu -q -r prof --amp fp16\nfor _ in range(3): w @ w")
    assert ("This CPU has no AMX-FP16: the fp16 matmuls of --amp fp16 run on its vector units, which gain little "
            "over fp32. It has AMX-BF16: --amp bf16 runs on its tiles.") in ip.user_ns["prof"].advice
    run_cell("%%profile_gpu -q -r prof --amp bf16\nfor _ in range(3): w @ w")
    assert not any("AMX-FP16" in a for a in ip.user_ns["prof"].advice)


# oneDNN picks its fp16 convolution by the CPU it really runs on: without AVX512-FP16 torch takes its own
# _slow_conv2d path (forward 84% of the step on an AMD EPYC), and the faked flags cannot change that.
@pytest.mark.skipif("avx512_fp16" not in cpu_flags(),
                    reason="needs a CPU with AVX512-FP16 (oneDNN's fp16 convolution path), not faked flags")
def test_profile_under_fp16_names_the_slow_fp16_convolution_backward(run_cell, ip, monkeypatch):
    import nbaccel.device as device

    flags = device.cpu_flags() - {"amx_fp16"} | {"amx_bf16", "amx_tile", "avx512_bf16"}
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    monkeypatch.setattr(device, "_cpu_feature", lambda name: name in flags)
    # A trial's CNN step under --amp fp16 spent 99% in the fp16 convolution backward (304x fp32's weight
    # gradient: benchmarks.bench_cpu_fp16), and the line said only "gain little over fp32".
    ip.user_ns.update(conv=torch.nn.Conv2d(16, 16, 3, padding=1), x=torch.randn(4, 16, 32, 32))  # ~60% there
    run_cell("%%profile_gpu -q -r prof --amp fp16\nconv(x).sum().backward()")
    line = next(a for a in ip.user_ns["prof"].advice if "AMX-FP16" in a)
    assert re.search(r"which gain little over fp32; oneDNN's fp16 convolution backward takes a far slower path than "
                     r"fp32's \(here aten::convolution_backward \d+% of CPU time\)\. It has AMX-BF16", line), line


def test_the_profile_object_says_its_state_and_where_the_result_is():
    """A user trial: printing nbaccel.profile(...) gave the default object repr, and prof.result was a
    silent None before and inside the with block ('NoneType' object has no attribute 'ops')."""
    prof = nbaccel.profile(device="cpu", warmup=1, steps=2, memory=True)
    assert repr(prof) == ("<nbaccel.profile ready (cpu, 2 steps after 1 warmup, memory): use it in a with block; "
                          ".result holds the ProfileResult after it>")
    with pytest.raises(AttributeError, match=r"no \.result yet: this profile has not run yet: use it as `with"):
        prof.result  # noqa: B018
    with pytest.raises(RuntimeError, match=r"call it inside `with nbaccel.profile\(steps=N\) as prof:`"):
        prof.step()  # before the block: was "'NoneType' object has no attribute 'step'"
    with prof:
        torch.ones(4).sum()
        prof.step()
        assert repr(prof) == ("<nbaccel.profile recording (cpu, 2 steps after 1 warmup, memory), 1 of 3 .step() calls "
                              "so far: .result holds the ProfileResult when the with block ends>")
        with pytest.raises(AttributeError, match=r"still recording: read prof\.result after the with block ends"):
            prof.result  # noqa: B018
        for _ in range(2):
            torch.ones(4).sum()
            prof.step()
    assert repr(prof).startswith("<nbaccel.profile done (cpu, 2 steps after 1 warmup, memory): .result holds the "
                                 "ProfileResult, ") and isinstance(prof.result, nbaccel.ProfileResult)
    done = prof.result
    with pytest.raises(RuntimeError, match=re.escape("prof.step() after the with block: the profile has ended, and its "
                                                     "result is prof.result; call prof.step() inside the block")):
        prof.step()  # after the block: was ignored without a word
    assert prof.result is done and prof.steps_done == 3  # nothing changed
    with pytest.raises(ValueError):
        with prof:  # a second use that raises leaves no result of the first behind
            raise ValueError("boom")
    assert "discarded" in repr(prof) and not hasattr(prof, "result")
    with pytest.raises(AttributeError, match=r"its with block raised .* run the block again"):
        prof.result  # noqa: B018


def test_a_step_loop_under_the_default_one_step_says_what_went_unrecorded():
    """A review: after the first prof.step() ended the recording, the repr still said "recording", and
    nothing said that the loop's later iterations were not in the profile."""
    a = torch.randn(16, 16)
    with nbaccel.profile() as prof:
        for i in range(3):
            a @ a
            prof.step()
            if i == 0:
                assert repr(prof).startswith("<nbaccel.profile recorded its one step (")
    assert prof.result.unrecorded_steps == 2
    assert ("prof.step() was called 3 times, and the default one step recorded the first iteration only (as "
            "torch's schedule(active=1) does): steps=3 records all 3.") in prof.result.advice
    with nbaccel.profile() as once:
        a @ a
    assert once.result.unrecorded_steps == 0 and not any("prof.step() was called" in n for n in once.result.advice)


def test_a_step_loop_past_the_schedule_says_what_went_unrecorded():
    """A trial: 10 prof.step() calls under warmup=1, steps=2 gave unrecorded_steps 0, no advice, and a method
    line saying "the code ran 3 times, 2 analysed"."""
    from nbaccel.render.profile import method

    a = torch.randn(16, 16)
    with nbaccel.profile(warmup=1, steps=2) as prof:
        for _ in range(10):
            a @ a
            prof.step()
    result = prof.result
    assert result.unrecorded_steps == 7
    assert ("prof.step() was called 10 times, and schedule(warmup=1, active=2) recorded iterations 2-3 only: "
            "steps=9 records all 9 after the warm-up.") in result.advice
    assert "schedule(warmup=1, active=2): the code ran 10 times, 2 analysed" in method(result)
    with nbaccel.profile(warmup=1, steps=2) as exact:
        for _ in range(3):
            a @ a
            exact.step()
    assert exact.result.unrecorded_steps == 0 and not any("prof.step() was called" in n for n in exact.result.advice)


@pytest.mark.skipif(device_info("cpu").has_bf16_units,
                    reason="this CPU has bf16 units: oneDNN runs the bf16 convolutions, not torch's fallback kernel")
def test_profile_under_bf16_puts_a_cnns_flops_on_the_fallback_convolution_rows(run_cell, ip):
    """A trial on an AVX2-only CPU: the top rows of %%profile_gpu --amp bf16 on a CNN,
    aten::_slow_conv2d_forward / _backward, showed no FLOPs or FLOP/s (they sat on the wrappers)."""
    run_cell("import torch\nnet = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), "
             "torch.nn.Conv2d(16, 16, 3, padding=1))\nx = torch.randn(8, 3, 32, 32)")
    run_cell("%%profile_gpu --amp bf16 -q -r prof\nnet(x).float().sum().backward()")
    table = ip.user_ns["prof"].table().set_index("name")
    forward = 2 * 8 * 32 * 32 * 16 * 9 * (3 + 16)  # 2 * N * H * W * C_out * k * k * C_in, both layers
    # backward: the first layer's weight gradient (x needs none), the second's input and weight gradients
    backward = 2 * 8 * 32 * 32 * 16 * 9 * (3 + 2 * 16)
    assert table.loc["aten::_slow_conv2d_forward", "flops"] == forward
    assert table.loc["aten::_slow_conv2d_backward", "flops"] == backward
    assert (table.loc[["aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward"], "flops_per_s"] > 0).all()
    # counted once: not again on the wrappers around them
    assert table.loc[["aten::_convolution", "aten::convolution_backward"], "flops"].isna().all()
    assert ip.user_ns["prof"].header["flops"] == forward + backward
