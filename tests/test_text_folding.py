"""Plain-text reports in a terminal: prose folded at 100 columns, table rows never.

``python -m nbaccel trace PATH`` and ``print(result)`` in a script showed a method line of 300-900
characters as one line. Every kind's text now folds its prose (method, advice, warnings, notes, list
entries) with a hanging indent (`render.common.prose`) and leaves each table row on one line, aligned.
Each check below renders a real result twice, folded and at an unlimited width, and compares them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.render import amp as render_amp
from nbaccel.render import budget as render_budget
from nbaccel.render import common
from nbaccel.render import multirank as render_multirank
from nbaccel.render import profile as render_profile
from nbaccel.render.common import TEXT_WIDTH, figures, labelled, prose

H200 = Path(__file__).parent / "data" / "h200_bf16_transformer_step.json.gz"
MiB = 2**20


# --- the helper ------------------------------------------------------------------------------------


def test_a_line_that_fits_is_left_as_it_was():
    for line in ("method: short", "  aten::mm [2x2] x1", "x" * TEXT_WIDTH, ""):
        assert prose(line) == line == labelled("", line)


def test_prose_folds_at_the_width_under_its_label_and_loses_no_word():
    text = " ".join(f"word{i}" for i in range(60)) + " --repeat AMX/AVX512-BF16 torch.utils.flop_counter"
    folded = labelled("advice: ", text).splitlines()
    assert len(folded) > 1 and all(len(line) <= TEXT_WIDTH for line in folded)
    assert folded[0].startswith("advice: word0 ")
    # further lines under the text, not under the label: the next "advice:" stands out
    assert all(line.startswith(" " * 8) and line[8] != " " for line in folded[1:])
    assert " ".join(folded).split() == ("advice: " + text).split()
    assert "--repeat" in " ".join(folded).split() and "AMX/AVX512-BF16" in " ".join(folded).split()


def test_an_indented_entry_keeps_its_indent_and_hangs_past_it():
    entry = "  aten::mm [64x10, 10x1024] x1 (140 µs, 1.2% of CPU time): " + "K=10 -> 16 " * 12
    lines = prose(entry).splitlines()
    # further lines deeper than the next entry's start, and than a folded note's (4) above the list
    assert lines[0].startswith("  aten::mm ") and all(line.startswith(" " * 6) and line[6] != " "
                                                      for line in lines[1:])
    note = prose("activations = what the forward keeps for the backward, " * 3 + "fitted linearly:").splitlines()
    assert all(line.startswith(" " * 4) and line[4] != " " for line in note[1:])
    bullet = labelled("  - ", "smaller batch: " + "the estimate measured 1 MiB per sample " * 4)
    assert all(line.startswith("    ") and line[4] != " " for line in bullet.splitlines()[1:])


def test_figures_fold_between_figures_never_inside_one():
    items = [("wall time", "12.9 ms (2 ProfilerStep ranges)"), ("device time", "4.64 ms"), ("device busy", "36%"),
             ("op calls / kernels", "1,052 / 140"), ("achieved", "270 TFLOP/s (1.25 TFLOP, bf16, over device busy time)"),
             ("of peak", "27.3%")]
    lines = figures(items).splitlines()
    assert lines == ["wall time: 12.9 ms (2 ProfilerStep ranges) | device time: 4.64 ms | device busy: 36%",
                     "  op calls / kernels: 1,052 / 140 | achieved: 270 TFLOP/s (1.25 TFLOP, bf16, over device busy time)",
                     "  of peak: 27.3%"]
    assert all(len(line) <= TEXT_WIDTH for line in lines)
    assert figures(items[:2]) == "wall time: 12.9 ms (2 ProfilerStep ranges) | device time: 4.64 ms"


def test_a_word_longer_than_the_width_stays_whole():
    path = "/tmp/" + "d" * 120 + "/rank-0.json.gz"
    lines = prose(f"1 unreadable file in the folder: {path} (not valid JSON)").splitlines()
    assert lines == ["1 unreadable file in the folder:", "    " + path, "    (not valid JSON)"]


# --- every kind's text -----------------------------------------------------------------------------


def _folds_prose_only(monkeypatch, module, render, head_lines: int = 1, keep=lambda line: False):
    """Render folded and unfolded; check what changed is only the folding of long prose lines.

    ``head_lines``: the report's head (its title), never folded;
    ``keep``: other lines left whole on purpose (a trace line's paths)."""
    tables: list[str] = []
    real_table = module.text_table

    def recording_table(*args, **kwargs):
        out = real_table(*args, **kwargs)
        tables.extend(out.splitlines())
        return out

    monkeypatch.setattr(module, "text_table", recording_table)
    folded = render()
    monkeypatch.setattr(common, "TEXT_WIDTH", 10**9)
    flat = render()
    monkeypatch.setattr(common, "TEXT_WIDTH", TEXT_WIDTH)
    lines = folded.splitlines()
    # Only whitespace differs (and the " | " between two figures where a line of figures was folded),
    # and a long prose line was there to fold.
    assert [w for w in folded.split() if w != "|"] == [w for w in flat.split() if w != "|"]
    assert len(lines) > len(flat.splitlines())
    # Table rows unchanged: each row still one line, as text_table made it (and aligned, so as long).
    assert tables and all(row.rstrip() in (line.rstrip() for line in lines) for row in tables)
    assert lines[:head_lines] == flat.splitlines()[:head_lines]
    rows = {row.rstrip() for row in tables}
    too_long = [line for line in lines[head_lines:]
                if len(line) > TEXT_WIDTH and line.rstrip() not in rows and not keep(line)
                and " " in line.strip()]  # a single word (a path) longer than the width stays whole
    assert not too_long
    return folded


def test_amp_text_folds_its_advice_and_method(monkeypatch):
    x, w = torch.randn(64, 1001), torch.randn(1001, 64)
    res = nbaccel.compare_amp(lambda: (x @ w).relu().sum(), dtype="bf16", device="cpu", repeat=2, warmup=0)
    text = _folds_prose_only(monkeypatch, render_amp, lambda: render_amp.text(res))
    assert "\nmethod: " in text and "\nadvice: " in text


def test_a_live_cpu_profile_folds_its_notes_shapes_and_method(monkeypatch):
    a, b = torch.randn(300, 1000), torch.randn(1000, 1001)
    with nbaccel.profile() as prof:
        torch.mm(a, b)
    text = _folds_prose_only(monkeypatch, render_profile, lambda: render_profile.text(prof.result), head_lines=1)
    shapes = text.split("\nshapes:\n")[1].split("\n\n")[0].splitlines()
    # the CPU note over the shapes list and its entries: folded, each further line hanging past the entry
    assert len(shapes) > 2 and all(line.startswith(" " * 6) for line in shapes if not line.startswith("  aten::")
                                   and not line.startswith("  fp32"))


def test_a_loaded_gpu_trace_folds_its_advice_and_method_but_not_its_trace_line(monkeypatch):
    res = nbaccel.load_trace(H200)
    text = _folds_prose_only(monkeypatch, render_profile, lambda: render_profile.text(res), head_lines=1,
                             keep=lambda line: line.startswith("trace: "))
    assert "device busy per stream:" in text and "\nadvice: " in text


def test_a_multi_rank_report_folds_its_notes_and_method(monkeypatch, tmp_path):
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    for rank in (0, 1):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({
            "distributedInfo": {"rank": rank, "world_size": 2},
            "traceEvents": [op("aten::matmul", 0, 10 * (rank + 1)), op("aten::mm", 1, 5)]}))
    (tmp_path / "notes.json").write_text("hello, world")  # a skipped file: a long note
    with pytest.warns(nbaccel.TraceWarning):
        res = nbaccel.load_trace(tmp_path)
    text = _folds_prose_only(monkeypatch, render_multirank, lambda: render_multirank.text(res))
    assert "1 unreadable file in the folder: notes.json" in text


def test_a_budget_status_folds_its_method(monkeypatch):
    with nbaccel.memory_budget(0.9) as mb:
        pass
    status = mb.status()
    _folds_prose_only(monkeypatch, render_budget, lambda: render_budget.text(status))


def test_a_cell_over_the_budget_folds_its_hints(monkeypatch):
    from nbaccel.budget import CellRecord, CellReport

    record = CellRecord("In[1]", 800 * MiB, 1000 * MiB, 300 * MiB, None, 700 * MiB, 0.1, "over",
                        harness="compare_amp", harness_bytes=200 * MiB)
    report = CellReport(record, "cpu", strict=True)
    folded = render_budget.text(report)
    monkeypatch.setattr(common, "TEXT_WIDTH", 10**9)
    flat = render_budget.text(report)
    assert folded.split() == flat.split() and len(folded.splitlines()) > len(flat.splitlines())
    assert folded.splitlines()[0] == flat.splitlines()[0]  # the gauge line: the cell's head
    assert all(len(line) <= TEXT_WIDTH for line in folded.splitlines()[1:])


def test_an_out_of_memory_explanation_folds_its_message_and_suggestions(monkeypatch):
    from nbaccel.memory import current_rss
    from nbaccel.oom import explain_oom

    model = torch.nn.Linear(1000, 1000)
    loose = torch.zeros(2_000_000)
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       f"you tried to allocate {100 * MiB} bytes. Error code 12 (Cannot allocate memory)")
    exp = explain_oom(exc, {"model": model, "loose": loose}, budget=current_rss() + 50 * MiB)
    text = _folds_prose_only(monkeypatch, render_budget, lambda: render_budget.text(exp))
    assert "\nwhat to try:\n  - " in text


def test_a_memory_estimate_folds_its_prose_not_its_tables(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    est = nbaccel.estimate_memory(model, optimizer="adamw", batch=32, example=torch.randn(8, 64), device="cpu",
                                  budget="1GiB")
    # Its head is a sentence ("fits in fp32 ..., fits in bf16 AMP ... -- budget ..."): folded too.
    text = _folds_prose_only(monkeypatch, render_budget, lambda: render_budget.text(est), head_lines=0)
    assert text.startswith("model: 4,810 parameters (4,810 trainable), adamw, batch 32 -- fits in fp32")
    assert "\ncompared with: " in text and "\nmethod: " in text


def test_notes_on_stderr_are_folded_line_by_line(capsys):
    """A trial's terminal showed the long-run note (361 characters) and failure notes as one line each."""
    long = "nbaccel %%amp: " + "the comparison was abandoned " * 8
    common.note_on_stderr(long + "\nsecond line\n  an entry")
    err = capsys.readouterr().err.splitlines()
    assert all(len(line) <= TEXT_WIDTH for line in err)
    assert err[0].startswith("nbaccel %%amp: ") and err[1].startswith("    abandoned the")  # hanging indent
    assert err[-2:] == ["second line", "  an entry"]  # its own lines kept


def test_a_failed_cells_note_fits_the_terminal(run_cell):
    run_cell("import torch\nx = torch.randn(4, 4)")
    _, captured = run_cell("%%amp --repeat 1 --warmup 0\nraise ValueError('no')\n", expect_error=ValueError)
    notes = [line for line in captured.stderr.splitlines() if line]
    assert notes[0].startswith("nbaccel %%amp: the cell raised ValueError in the fp32 run") and len(notes) > 1
    assert all(len(line) <= TEXT_WIDTH for line in notes), captured.stderr
