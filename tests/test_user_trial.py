"""What a hurried first user ran into (a new-user trial before release), held by tests."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import nbaccel
from nbaccel.timing import format_seconds
from text_helpers import unfolded


def test_syntax_error_in_a_magic_cell_is_a_usage_error_naming_the_line(ip):
    for magic in ("amp", "profile_gpu"):
        with pytest.raises(UsageError, match=r"SyntaxError in the cell .* line 2: loss = train_step\("):
            ip.run_cell_magic(magic, "", "x = 1\nloss = train_step(\n")


@pytest.mark.parametrize("magic", ["amp", "profile_gpu"])
@pytest.mark.parametrize("cell, message", [
    # What Python says, at the line of the opening bracket; IPython's parse said "(incomplete input) at line 2: "
    # for the first (a terminal cell ends in a blank line): no excerpt, the wrong line (a user trial).
    ("loss = train_step(\n\n", r"\('\(' was never closed\) at line 1: loss = train_step\(; fix it"),
    ("x = [1,\n     2,\n", r"\('\[' was never closed\) at line 1: x = \[1,; fix it"),
    ("s = \"\"\"abc\n", r"\(unterminated triple-quoted string literal \(detected at line 1\)\) at line 1: s = "),
])
def test_an_unclosed_bracket_is_reported_as_python_reports_it(ip, magic, cell, message):
    with pytest.raises(UsageError, match=r"^SyntaxError in the cell " + message):
        ip.run_cell_magic(magic, "", cell)


@pytest.mark.parametrize("body, message", [
    # These parse but fail to compile outside a function: they escaped as a SyntaxError through nbaccel and codeop.
    ("x = 1\nreturn x", r"\('return' outside function\) at line 2: return x; a cell's top level is not a function "
                        r"body: drop the return"),
    ("yield 1", r"\('yield' outside function\) at line 1: yield 1; .*put the code in a function"),
    ("import asyncio\nawait asyncio.sleep(0)", r"\('await' outside function\) at line 2: await asyncio.sleep\(0\); "
                                               r"nbaccel's cell magics run the cell as a plain function"),
])
@pytest.mark.parametrize("magic, options", [("amp", "--repeat 1"), ("profile_gpu", ""), ("profile_gpu", "--stack")])
def test_return_yield_await_at_the_top_of_a_cell_are_usage_errors(ip, magic, options, body, message):
    with pytest.raises(UsageError, match=r"^SyntaxError in the cell " + message):
        ip.run_cell_magic(magic, options, body)


@pytest.mark.parametrize("quote", ['"', "'"])
def test_quoted_values_lose_their_quotes(ip, tmp_path, quote):
    # IPython's parse_argstring keeps quotes: --trace "a b/t.json" made a folder named '"a' in the working
    # directory, and %memory_budget "6GiB" / -r "res" were refused.
    target = tmp_path / "my run" / "t.json"
    ip.user_ns["torch"] = torch
    ip.run_cell_magic("profile_gpu", f"-q -r {quote}prof{quote} --trace {quote}{target}{quote}", "torch.ones(4) + 1")
    assert ip.user_ns["prof"].trace_path == str(target) and target.is_file()
    ip.run_line_magic("profile_trace", f"{quote}{target}{quote} -q -r loaded")
    assert ip.user_ns["loaded"].op_count > 0
    ip.run_line_magic("memory_budget", f"{quote}6 GiB{quote} -q -r b")
    try:
        assert ip.user_ns["b"].budget_bytes == 6 * 2**30
        with pytest.raises(UsageError, match="a budget must be positive, got -5GB"):
            ip.run_line_magic("memory_budget", f"{quote}-5GB{quote}")
    finally:
        ip.run_line_magic("memory_budget", "off -q")


def test_an_unclosed_quote_is_a_usage_error(ip):
    with pytest.raises(UsageError, match=r"""cannot parse the options '--trace "x.json': No closing quotation"""):
        ip.run_cell_magic("profile_gpu", '--trace "x.json', "1")


def test_traceback_shows_the_users_line_not_nbaccel_internals(run_cell):
    run_cell("import torch\nx = torch.ones(3)")
    for magic in ("%%amp --repeat 1", "%%profile_gpu"):
        _, captured = run_cell(f"{magic}\ny = x * 2\nz = undefined_var + 1\n", expect_error=NameError)
        shown = captured.stdout + captured.stderr
        assert "z = undefined_var + 1" in shown, shown
        assert "Could not get source" not in shown
        assert "nbaccel/amp.py" not in shown and "nbaccel/timing.py" not in shown


def test_budget_with_a_space_before_the_unit(ip):
    ip.run_line_magic("memory_budget", "6 GB -q -r b")
    try:
        assert ip.user_ns["b"].to_dict()["budget_bytes"] == 6 * 10**9
    finally:
        ip.run_line_magic("memory_budget", "off -q")


def test_strict_says_failed_only_for_cells_that_fail(run_cell, ip):
    run_cell("import torch")
    run_cell("%memory_budget 1MiB --strict -q")  # the process is already far over 1 MiB
    try:
        result, captured = run_cell("y = 1")  # adds nothing: neither failed nor warned again
        text = "".join(o.data.get("text/plain", "") for o in captured.outputs)
        assert result.success and "marked as failed" not in text and "over the memory budget" not in text
    finally:
        run_cell("%memory_budget off -q")


def test_estimate_dry_run_is_not_held_against_the_budget(run_cell, ip):
    run_cell("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.Linear(2048, 8))")
    run_cell("%memory_budget 1MiB --strict -q")
    try:
        result, _ = run_cell("%memory_budget 8GiB --model model --batch 64 -q -r est")
        assert result.error_in_exec is None  # not a BudgetExceeded from nbaccel's own dry runs
        assert ip.user_ns["est"].to_dict()["kind"] == "estimate"
    finally:
        run_cell("%memory_budget off -q")


def test_plain_python_cells_get_honest_advice():
    result = nbaccel.compare_amp(lambda: sum(range(1000)), repeat=2, warmup=0, state=[None])
    assert result.amp.ops.empty
    assert any("no torch operators" in a for a in result.advice)
    assert not any("speedup" in a.lower() for a in result.advice)
    assert "no torch operators ran (plain Python timed:" in str(result) and "speedup" not in str(result).split("\n")[0]
    with nbaccel.profile() as prof:
        sum(range(1000))
    text = str(prof.result)
    assert "No torch operators were recorded" in text
    assert "no matmul/conv ops were recorded" in text
    # not "0", which reads as measured; the clock around the step timed it, as the method says
    lasted = format_seconds(prof.result.contention.wall_s["profiled steps"])
    assert f"wall time: no op recorded; the step lasted {lasted} (1 step, no warm-up)" in text
    assert f"the profiled steps lasted {lasted} in all" in unfolded(text)


def test_matrix_vector_products_are_not_told_to_pad():
    w, v = torch.randn(1000, 1000), torch.randn(1, 1000)
    with nbaccel.profile() as prof:
        v @ w
    assert not any(1 in e["unaligned"].values() for e in prof.result.unaligned)
    res = nbaccel.compare_amp(lambda: v @ w, repeat=1, warmup=0, state=[w, v])
    assert not any(1 in m["unaligned"] for m in res.unaligned_matmuls)


def test_a_budget_below_current_usage_says_so(ip):
    ip.run_line_magic("memory_budget", "1MiB -q -r s")
    try:
        assert "already over" in ip.user_ns["s"].note
    finally:
        ip.run_line_magic("memory_budget", "off -q")


def test_short_malformed_trace_is_not_called_truncated(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(nbaccel.TraceError) as err:
        nbaccel.load_trace(bad)
    assert "not valid JSON" in str(err.value) and "ends early" not in str(err.value)
