"""%memory_budget through a real InteractiveShell: hooks, measurement, gauges, strict, OOM, faults."""

from __future__ import annotations

import html
import re

import pytest
import torch
from IPython.core.error import UsageError

from nbaccel.memory import current_rss, format_bytes
from nbaccel.render import display as display_module
from text_helpers import note_lines, unfolded

MB = 10**6


def _nbaccel_callbacks(ip):
    return [cb for name in ("pre_run_cell", "post_run_cell") for cb in ip.events.callbacks[name]
            if "nbaccel" in getattr(cb, "__module__", "") or "nbaccel" in type(getattr(cb, "__self__", None)).__module__]


def _texts(captured):
    return "\n".join(o.data.get("text/plain", "") for o in captured.outputs)


def _budget_above_now(extra_mb: int) -> str:
    """A budget ``extra_mb`` above what this process holds now (CPU budgets are absolute RSS)."""
    return f"{(current_rss() + extra_mb * MB) // MB}MB"


def test_set_registers_hooks_and_off_removes_them(ip, run_cell):
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()
    run_cell("%memory_budget 0.9 -q")
    assert len(_nbaccel_callbacks(ip)) == 2
    assert torch.OutOfMemoryError in ip.custom_exceptions and RuntimeError in ip.custom_exceptions
    run_cell("%memory_budget 0.8 -q")  # replacing the budget does not register twice
    assert len(_nbaccel_callbacks(ip)) == 2
    run_cell("%memory_budget off -q")
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()


def test_unload_removes_hooks_and_handler(ip, run_cell):
    run_cell("%memory_budget 0.9 -q")
    ip.run_line_magic("unload_ext", "nbaccel")
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()
    assert "memory_budget" not in ip.magics_manager.magics["line"]
    ip.run_line_magic("load_ext", "nbaccel")
    assert "memory_budget" in ip.magics_manager.magics["line"]


def _budget_magics(ip):
    return ip.magics_manager.registry["BudgetMagics"]


def test_reload_keeps_the_budget_its_settings_and_history(ip, run_cell):
    run_cell(f"%memory_budget {_budget_above_now(4000)} --strict --near 0.6 -q -r before")
    run_cell("x = 1")
    before = ip.user_ns["before"]
    assert len(before.records) == 1
    old = _budget_magics(ip)
    run_cell("%reload_ext nbaccel")
    new = _budget_magics(ip)
    assert new is not old and old.watcher is None and old._saved_exc is None
    # The hooks are the new instance's, once each; the old instance's are gone.
    callbacks = _nbaccel_callbacks(ip)
    assert len(callbacks) == 2 and all(cb.__self__ is new for cb in callbacks)
    assert len(ip.custom_exceptions) == len(set(ip.custom_exceptions))
    assert torch.OutOfMemoryError in ip.custom_exceptions
    run_cell("y = 2")
    run_cell("%memory_budget -q -r after")
    after = ip.user_ns["after"]
    assert after.active and after.budget_bytes == before.budget_bytes
    assert after.strict and after.near == 0.6 and after.device == before.device
    run_cell("z = 3")
    # x = 1, then y = 2 and z = 3 (a live list: it has grown since; the status cell is no row of its own);
    # the reload cell itself is not measured (its meter was stopped with the old hooks).
    assert after.records[0].label == before.records[0].label and len(after.records) == 3
    assert after.records is before.records  # a status kept in a variable goes on growing, as without a reload
    # A second reload is the same: still one set of hooks.
    run_cell("%reload_ext nbaccel")
    assert len(_nbaccel_callbacks(ip)) == 2


def test_unload_then_load_forgets_the_budget(ip, run_cell):
    run_cell("%memory_budget 0.9 -q")
    run_cell("%unload_ext nbaccel")
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()
    run_cell("%load_ext nbaccel")
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()
    run_cell("%memory_budget -q -r st")
    assert not ip.user_ns["st"].active
    # ... and a reload after that has nothing to re-arm either.
    run_cell("%reload_ext nbaccel")
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()


def test_reload_without_a_budget_installs_nothing(ip, run_cell):
    run_cell("%reload_ext nbaccel")
    assert not _nbaccel_callbacks(ip) and ip.custom_exceptions == ()
    assert "memory_budget" in ip.magics_manager.magics["line"]


@pytest.fixture
def user_handler(ip):
    """A custom exception handler of the user's own (ZeroDivisionError), there before the budget:
    yields (what it saw, the shell's handler state before the budget); removed afterwards."""
    seen = []
    ip.set_custom_exc((ZeroDivisionError,), lambda shell, et, ev, tb, tb_offset=None: seen.append(ev))
    try:
        yield seen, (ip.custom_exceptions, ip.CustomTB)
    finally:
        ip.set_custom_exc((), None)


def test_reload_keeps_a_previous_custom_handler_chained_once(ip, run_cell, user_handler):
    seen, before = user_handler
    run_cell("%memory_budget 0.9 -q")
    run_cell("%reload_ext nbaccel")
    run_cell("%reload_ext nbaccel")
    assert ip.custom_exceptions.count(ZeroDivisionError) == 1
    run_cell("1/0", expect_error=ZeroDivisionError)
    assert len(seen) == 1
    run_cell("%memory_budget off -q")
    assert (ip.custom_exceptions, ip.CustomTB) == before


def test_a_previous_custom_handler_keeps_working_and_is_restored(ip, run_cell, user_handler):
    seen, before = user_handler
    run_cell("%memory_budget 0.9 -q")
    run_cell("1/0", expect_error=ZeroDivisionError)
    assert len(seen) == 1
    run_cell("%memory_budget off -q")
    assert (ip.custom_exceptions, ip.CustomTB) == before


def test_known_allocation_is_measured_within_10_percent(ip, run_cell):
    run_cell("import torch\n%memory_budget 0.9 -q -r budget")
    run_cell("x = torch.ones(100_000_000)  # 400 MB, every page touched")
    history = ip.user_ns["budget"].history
    row = history.iloc[-1]
    assert row["status"] == "ok"
    assert abs(row["added_bytes"] - 400 * MB) < 0.1 * 400 * MB, row
    assert row["used_bytes"] >= row["added_bytes"] and row["budget_bytes"] == ip.user_ns["budget"].budget_bytes
    assert list(history.columns[:3]) == ["cell", "used_bytes", "fraction"]


def test_well_under_the_budget_shows_nothing(run_cell):
    run_cell("%memory_budget 0.9 -q")
    _, captured = run_cell("a = 1 + 1")
    assert not captured.outputs and not captured.stdout


@pytest.fixture
def cell_widget_labels(monkeypatch):
    """Widgets forced on; returns a function giving the HTML texts of the n-th per-cell gauge widget shown,
    as a user sees them."""
    from nbaccel.render import budget as budget_render
    from widget_helpers import walk

    monkeypatch.setattr(display_module, "WIDGETS", "always")
    shown = []
    real = budget_render.cell_widget
    monkeypatch.setattr(budget_render, "cell_widget", lambda report: shown.append(real(report)) or shown[-1])
    return lambda n=0: [w.value for w in walk(shown[n]) if type(w).__name__ == "HTML"]


def test_near_the_budget_shows_a_gauge(run_cell, cell_widget_labels):
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(450)} -q")
    _, captured = run_cell("x = torch.ones(100_000_000)\ndel x")
    data = [o.data for o in captured.outputs]
    assert data, "no gauge was shown"
    assert "nbaccel-gauge" in data[0]["text/html"]
    assert re.search(r"\[#+\.*\] .* of .*\(\d+%\)", data[0]["text/plain"])
    assert "application/vnd.jupyter.widget-view+json" in data[0]
    assert "WARNING" not in data[0]["text/plain"]
    # the widget as a user sees it says what the bar is, like the HTML and text gauges
    labels = cell_widget_labels()
    assert any("memory budget on cpu:" in v for v in labels), labels


def test_over_a_soft_budget_warns_and_the_cell_succeeds(ip, run_cell):
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(150)} -q -r b")
    result, captured = run_cell("x = torch.ones(100_000_000)\ndone = True")
    assert result.success and ip.user_ns["done"]
    assert "WARNING: over the memory budget" in _texts(captured)
    assert "the CPU has no cache to empty" in _texts(captured) and "cuda" not in _texts(captured)
    assert ip.user_ns["b"].history.iloc[-1]["status"] == "over"


def test_over_the_budget_the_html_and_widget_say_what_to_do_too(run_cell, cell_widget_labels):
    """A trial: the text said "free memory (del the large tensors ...)", the HTML and the widget only
    "over the memory budget ... the cell added 2.34 GiB"."""
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(150)} -q")
    _, captured = run_cell("x = torch.ones(100_000_000)")
    hint = "free memory (del the large tensors; the CPU has no cache to empty) or lower the batch"
    assert hint in captured.outputs[0].data["text/html"]
    assert any(hint in v for v in cell_widget_labels())
    run_cell("del x")


def test_over_a_strict_budget_fails_the_cell(ip, run_cell):
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(150)} --strict -q -r b")
    result, captured = run_cell("x = torch.ones(100_000_000)\ndone = True", expect_error=RuntimeError)
    assert type(result.error_in_exec).__name__ == "BudgetExceeded"
    assert "over the strict budget" in str(result.error_in_exec)
    assert ip.user_ns["done"], "the cell itself ran to the end; only its verdict is an error"
    shown = captured.stdout + unfolded(captured.stderr)
    assert "BudgetExceeded: In[" in shown and "use %tb" not in shown  # no traceback to point to
    # A cell that starts over the budget but adds nothing (freeing memory) is neither failed nor warned
    # (a new user read "WARNING: over" after `del x` as "the del did not work"), and its row says the
    # same: "already over", not "over".
    _, captured = run_cell("del x")
    assert "over the memory budget" not in _texts(captured)
    run_cell("pass")
    statuses = list(ip.user_ns["b"].history["status"])
    # Back under the budget (a budget 150 MB above a large process's RSS leaves it near, from before the cell).
    assert statuses[-3:-1] == ["over", "already over"] and statuses[-1] in ("ok", "already near")


def test_memory_reserved_but_not_yet_written_is_said_on_the_cell_that_reserved_it(ip, run_cell):
    """A trial: ``x = torch.empty(3 GiB)`` passed a 1 GB strict budget in silence (its pages are not
    resident until written) and the cell that filled it was failed, as if it had made the tensor."""
    from nbaccel.memory import malloc_held_bytes

    if malloc_held_bytes() is None:
        pytest.skip("no glibc mallinfo2 here")
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(300)} --strict -q -r b")
    result, captured = run_cell("x = torch.empty(600_000_000, dtype=torch.uint8)")
    assert result.error_in_exec is None  # not over yet: said, not failed
    said = unfolded(captured.stdout)
    assert re.search(r"In\[\d+\] reserved 5\d\d MiB that is not yet resident", said), said
    assert "over the" in said and "counts in the cell that writes it" in said
    row = ip.user_ns["b"].history.iloc[-1]
    assert row["status"] in ("ok", "near", "already near") and row["unwritten_bytes"] >= 500 * 2**20
    result, captured = run_cell("x.fill_(1); None", expect_error=RuntimeError)
    assert type(result.error_in_exec).__name__ == "BudgetExceeded"
    assert "not yet resident" not in captured.stdout  # written now: its own verdict, no second note
    run_cell("del x")
    # Below the threshold, or written at once: nothing to say.
    for cell in ("y = torch.empty(100_000_000, dtype=torch.uint8)", "z = torch.zeros(50_000_000, dtype=torch.uint8)"):
        _, captured = run_cell(cell)
        assert "not yet resident" not in captured.stdout, cell


def test_history_and_live_output_agree_on_a_cell_that_frees_memory(ip, run_cell):
    """A user trial: after `del b` under a soft budget nothing was shown, but its history row read "over",
    added "0 B" -- the cell that fixed the problem was blamed for it. And after a strict failure a
    `print('c' in dir())` cell was recorded "over" too."""
    import gc

    run_cell("import torch, gc")
    run_cell(f"%memory_budget {_budget_above_now(150)} -q -r budget")
    _, captured = run_cell("b = torch.ones(200 * 2**20, dtype=torch.uint8)")
    assert "WARNING: over the memory budget" in _texts(captured)
    _, captured = run_cell("del b; gc.collect()")
    assert not captured.outputs  # nothing live ...
    row = ip.user_ns["budget"].history.iloc[-1]
    assert row["status"] == "already over" and row["added_bytes"] < 2**20  # ... and the row does not blame it
    assert 190 * 2**20 < row["freed_bytes"] < 220 * 2**20, row
    _, captured = run_cell("%memory_budget")
    (line,) = [ln for ln in _texts(captured).splitlines() if ln.startswith(f"In[{row['cell'][3:-1]}]")]
    assert re.search(r"freed 2\d\d MiB\s+-\s+already over", line), line
    gc.collect()
    run_cell(f"%memory_budget {_budget_above_now(150)} --strict -q")
    run_cell("c = torch.ones(200 * 2**20, dtype=torch.uint8)", expect_error=RuntimeError)  # BudgetExceeded
    result, captured = run_cell("print('c' in dir())")  # holds c, adds nothing: not failed, not warned
    assert result.success and captured.stdout == "True\n" and not captured.outputs
    assert ip.user_ns["budget"].history.iloc[-1]["status"] == "already over"
    run_cell("del c")


def test_out_of_memory_is_explained_and_the_kernel_lives_on(ip, run_cell):
    run_cell("import torch\nmodel = torch.nn.Linear(512, 512)\nopt = torch.optim.AdamW(model.parameters())\n"
             "big = torch.zeros(2_000_000)")
    run_cell("%memory_budget 0.9 -q -r b")
    result, captured = run_cell("z = torch.empty(2**50, dtype=torch.uint8)", expect_error=RuntimeError)
    text = _texts(captured)
    assert "OUT OF MEMORY on cpu" in text and "kernel is still alive" in text
    assert "requested: 1 PiB" in text  # 2**50 bytes, read from the allocator's message
    assert "allocated at the failure" in text and "limit:" in text
    # the failing line, named like IPython names the cell (not /tmp/ipykernel_../...py)
    assert f"Cell In[{result.execution_count}], line 1: z = torch.empty(2**50" in text
    assert re.search(r"big\s+tensor\s+cpu\s+fp32\s+7.63 MiB", text)
    assert re.search(r"model\s+module\s+cpu\s+fp32", text)
    assert "check the shape" in text
    assert "Traceback" not in captured.stdout + unfolded(captured.stderr)
    # The error in one line as the cell's error output (nbclient / nbconvert showed an empty traceback).
    assert re.search(r"^RuntimeError: .*(not enough memory|DefaultCPUAllocator)", captured.stdout, re.M), captured.stdout
    run_cell("alive = 1")
    assert ip.user_ns["alive"] == 1
    assert list(ip.user_ns["b"].history["status"])[-2:] == ["oom", "ok"]
    _, shown = run_cell("%tb")  # the full traceback, as the docs promise
    assert "z = torch.empty(2**50" in shown.stdout and "No traceback available" not in shown.stdout, shown.stdout


def _normalise(text):
    return re.sub(r"In\[\d+\]|ipython-input-\d+-[0-9a-f]+|line \d+", "#", text)


@pytest.mark.parametrize("cell, error", [("raise RuntimeError('boom')", RuntimeError), ("1/0", ZeroDivisionError)])
def test_other_exceptions_are_shown_unchanged(ip, run_cell, cell, error):
    _, plain = run_cell(cell, expect_error=error)
    run_cell("%memory_budget 0.9 -q -r b")
    result, watched = run_cell(cell, expect_error=error)
    assert _normalise(watched.stdout) == _normalise(plain.stdout) and "Traceback" in watched.stdout
    assert not watched.outputs
    assert ip.user_ns["b"].history.iloc[-1]["status"] == "error"


def test_syntax_error_cell_keeps_the_bookkeeping(ip, run_cell):
    run_cell("%memory_budget 0.9 -q -r b")
    run_cell("x = (", expect_error=SyntaxError)
    run_cell("y = 2")
    statuses = list(ip.user_ns["b"].history["status"])
    assert statuses == ["ok"]  # y = 2 measured as usual; the cell that never ran has no row


def test_a_refused_magic_line_is_not_a_watched_cell(ip, run_cell):
    # Mistyped %memory_budget lines were recorded as watched cells with status "error" and crowded the real
    # cells out of the status's last 10. A magic that refuses its line with a UsageError ran nothing of the user's.
    run_cell("%memory_budget 0.9 -q -r b")
    run_cell("x = 1")
    for line in ("0", "1.5", "abc", "150%", "2GiB --batch 4"):
        run_cell(f"%memory_budget {line}", expect_error=UsageError)
    run_cell("%%amp --dtype nope\nx + 1", expect_error=UsageError)  # any magic's refusal, a cell magic's too
    run_cell("x = (1", expect_error=SyntaxError)  # never ran: was a row "ok, added 0 B" (a user trial)
    run_cell("y = 2")
    _, captured = run_cell("%memory_budget")
    assert "2 cells watched:" in _texts(captured)
    # nor is a status cell one (a trial: status rows crowded the last 10 too); `s = %memory_budget` neither
    run_cell("s = %memory_budget")
    _, captured = run_cell("%memory_budget")
    assert "2 cells watched:" in _texts(captured)
    records = ip.user_ns["b"].records
    assert len(records) == 2 and "error" not in [r.status for r in records]  # x = 1, y = 2


def test_user_code_before_a_refused_magic_line_is_still_watched(ip, run_cell):
    # The refusal is the magic's, but the line before it ran (and may have allocated): the cell is the user's.
    run_cell("%memory_budget 0.9 -q -r b")
    run_cell("z = 3\n%memory_budget abc", expect_error=UsageError)
    assert ip.user_ns["z"] == 3 and ip.user_ns["b"].records[-1].status == "error"


def test_a_magic_that_refuses_after_running_code_is_still_watched(ip, run_cell):
    # Not every UsageError comes before any work: nbaccel's own %%profile_gpu raises one after the runs when
    # Kineto wrote an invalid trace. A refused cell that added memory keeps its row.
    held = []

    def grabby(line):
        held.append(torch.ones(25_000_000))  # 100 MB
        raise UsageError("refused after running")

    ip.register_magic_function(grabby, magic_name="grabby_test")
    try:
        run_cell("%memory_budget 0.9 -q -r b")
        run_cell("%grabby_test", expect_error=UsageError)
    finally:
        del ip.magics_manager.magics["line"]["grabby_test"]
        held.clear()
    record = ip.user_ns["b"].records[-1]
    assert record.status == "error" and record.added_bytes > 50 * MB and "refused after running" in record.error


@pytest.mark.parametrize("line, message", [
    ("-5GB", "must be positive"),
    ("12 parsecs", "cannot read '12 parsecs'"),  # a number and a word are one size, like "6 GB", echoed as typed
    ("12parsecs", "cannot read '12parsecs'"),
    ("999TiB", "larger than this host's physical memory"),
    ("1PiB", "larger than this host's physical memory"),  # was "cannot read '1PiB'"
    ("--model nothing --batch 4", "names nothing"),
    ("--model n --batch 4", "is an int, not a torch.nn.Module"),
    ("--model model", "needs --batch"),
    ("--model model --input pair", "--input pair's tensors share no first dimension"),  # (x, lengths): no batch to read
    ("--model model --batch -4", "--batch is the global batch size, at least 1; got -4"),  # was "needs --batch"
    ("--model model --batch 0", "at least 1; got 0"),
    ("--model model --batch 4 --optimizer adam2", r"neither one of adamw, .* \(did you mean adam\?\)"),
    ("--near 3 1GiB", "--near is a share"),
    ("--strict", "--strict goes with a budget: %memory_budget 6GiB --strict"),
])
def test_bad_input_is_a_usage_error_and_the_previous_budget_stays(ip, run_cell, line, message):
    run_cell("import torch\nn = 3\nmodel = torch.nn.Linear(4, 4)\npair = (torch.ones(6, 4), torch.ones(2))")
    run_cell("%memory_budget 0.5 -q -r before")
    budget = ip.user_ns["before"].budget_bytes
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("memory_budget", line)
    run_cell("%memory_budget -q -r after")
    assert ip.user_ns["after"].budget_bytes == budget and ip.user_ns["after"].active
    assert len(_nbaccel_callbacks(ip)) == 2


def test_the_batch_is_read_from_the_input_when_left_out_and_said_so(ip, run_cell):
    # A trial's user passed --input with the batch itself and was told "--model needs --batch"
    run_cell("import torch\nmodel = torch.nn.Linear(8, 4)\nx = torch.randn(12, 8)\nids = {'input': torch.randn(5, 8)}")
    _, captured = run_cell("%memory_budget 1GiB --model model --input x -r e")
    assert ip.user_ns["e"].batch == 12
    assert "batch 12: the rows of --input x (no --batch given" in _texts(captured)
    _, captured = run_cell("%memory_budget 1GiB --model model --input x --batch 40 -r typed")
    assert ip.user_ns["typed"].batch == 40 and "rows of --input" not in _texts(captured)
    run_cell("class Keyed(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
             "        self.lin = torch.nn.Linear(8, 4)\n    def forward(self, input):\n        return self.lin(input)\n"
             "keyed = Keyed()")
    run_cell("%memory_budget 1GiB --model keyed --input ids -q -r d")
    assert ip.user_ns["d"].batch == 5  # a dict batch: its tensors' rows


def test_enforce_on_the_cpu_says_only_a_soft_budget_is_possible(ip, run_cell):
    _, captured = run_cell("%memory_budget 0.9 --enforce -r s")
    assert "only a soft budget" in _texts(captured) and "cgroup" in _texts(captured)
    assert ip.user_ns["s"].enforce is False


def test_status_lists_cells_and_what_holds_memory(ip, run_cell):
    run_cell("import torch\nmodel = torch.nn.Linear(1000, 1000)\nacts = [torch.ones(1000) for _ in range(3)]")
    run_cell("%memory_budget 4GiB -q")
    run_cell("t = torch.ones(10)")
    _, captured = run_cell("%memory_budget -r s")
    s = ip.user_ns["s"]
    assert s.active and s.budget_bytes == 4 * 2**30
    assert [r.label for r in s.records][-1].startswith("In[")
    names = [h.name for h in s.holders]
    assert names[0] == "model" and "acts" in names
    text = _texts(captured)
    assert "memory budget 4 GiB" in text and "what holds memory now" in text and "model" in text
    assert s.to_dict()["kind"] == "budget" and s.to_dict()["view"] == "status"


def test_status_without_a_budget(run_cell, ip):
    _, captured = run_cell("%memory_budget")
    assert "memory budget: off" in _texts(captured)
    assert not _nbaccel_callbacks(ip)


def test_status_by_name_is_the_bare_line(run_cell, ip):
    """The docs and the help call bare `%memory_budget` "the status"; a user trial's `%memory_budget status` was
    refused ("cannot read 'status' as a budget")."""
    _, captured = run_cell("%memory_budget status")
    assert "memory budget: off" in _texts(captured)
    run_cell("%memory_budget 0.9 -q")
    run_cell("import torch\nm = torch.nn.Linear(4, 2)")
    _, captured = run_cell("%memory_budget Status -r s")
    s = ip.user_ns["s"]
    assert s.active and s.view == "status" and "1 cell watched:" in _texts(captured)
    _, captured = run_cell("%memory_budget status -q")
    assert not captured.outputs and ip.user_ns["s"] is s  # -q hides it; nothing else changed
    for line, message in [("statsu", "did you mean %memory_budget status (shows the budget"),
                          ("status --strict", "--strict goes with a budget: %memory_budget 6GiB --strict"),
                          ("status --near 0.5", "--near goes with a budget: %memory_budget 6GiB --near 0.5"),
                          ("off --strict", "--strict goes with a budget to watch, not with off, which removes"),
                          ("status --model m --batch 2", "cannot read 'status' as a budget")]:  # a prediction
        _, captured = run_cell(f"%memory_budget {line}", expect_error=UsageError)
        assert message in unfolded(captured.stderr), (line, captured.stderr)
    assert ip.user_ns["s"] is s and _nbaccel_callbacks(ip)  # refused: the budget still watches
    run_cell("%memory_budget off -q")
    assert not _nbaccel_callbacks(ip)


def test_estimate_magic(ip, run_cell):
    run_cell("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 128), "
             "torch.nn.ReLU(), torch.nn.Linear(128, 8))\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)")
    _, captured = run_cell("%memory_budget 80GiB --model model --optimizer opt --batch 256 -r est")
    est = ip.user_ns["est"]
    n = 64 * 128 + 128 + 128 * 8 + 8
    assert est.n_params == n and est.param_bytes == 4 * n and est.grad_bytes == 4 * n
    assert est.optimizer == "sgd-momentum" and est.state_bytes == 4 * n  # one momentum buffer
    assert est.budget_bytes == 80 * 2**30 and est.summary.startswith("fits in fp32") and "GPU" not in est.summary
    assert "budget 80 GiB (as given), measured on cpu" in _texts(captured)  # was "(the budget)": see below
    assert "prediction for GPUs" in _texts(captured) and "linear extrapolation" in _texts(captured)
    assert not _nbaccel_callbacks(ip), "a prediction does not start watching"


def test_an_estimate_leaves_the_next_cells_random_numbers_as_they_were(ip, run_cell):
    # "a prediction watches nothing", yet the next cell's torch.randn (and every dropout mask after it) came out
    # different from a notebook without the estimate: its dry runs of a Dropout model drew from torch's generator.
    run_cell("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5))\n"
             "x = torch.randn(32, 64)")
    run_cell("torch.manual_seed(1)\nexpected = torch.randn(4)")
    run_cell("torch.manual_seed(1)")
    run_cell("%memory_budget 1GiB --model model --batch 32 --input x -q")
    run_cell("drawn = torch.randn(4)")
    assert torch.equal(ip.user_ns["drawn"], ip.user_ns["expected"])


def _estimate_renderings(ip, captured, name):
    """The estimate as a terminal, a static page and the widget show it."""
    from nbaccel.render import budget as budget_render

    shown = [o.data for o in captured.outputs]
    assert len(shown) == 1
    return shown[0]["text/plain"], shown[0]["text/html"], budget_render.widget(ip.user_ns[name]).value


@pytest.fixture
def mlp(run_cell):
    run_cell("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 64))\nx = torch.randn(32, 64)")


def test_an_estimate_says_it_watches_nothing(ip, run_cell, mlp):
    # "... -- budget 1 GiB (the budget), measured on cpu" read as a budget set: a user expected the next
    # cells to be watched, and a 2 GiB cell went unflagged.
    _, captured = run_cell("%memory_budget 1GiB --model model --batch 32 --input x -r est")
    for shown in map(unfolded, _estimate_renderings(ip, captured, "est")):
        assert "a prediction, compared with 1 GiB: no budget is being watched, so later cells are not measured; " \
               "%memory_budget 1GiB starts watching" in shown
        assert "(the budget)" not in shown
    assert "budget 1 GiB (as given), measured on cpu" in ip.user_ns["est"].summary
    assert ip.user_ns["est"].to_dict()["note"].startswith("a prediction, compared with 1 GiB")
    assert not _nbaccel_callbacks(ip)  # as it says


@pytest.mark.parametrize("typed, share", [("0.5", 0.5), ("50%", 0.5), ("50 %", 0.5), (".25", 0.25)])
def test_an_estimate_against_a_share_says_what_it_is_a_share_of(ip, run_cell, mlp, typed, share):
    # A trial: "%memory_budget 0.5 --model m ..." said "budget 11.8 GiB (as given)"; the user gave 0.5.
    from nbaccel.budget import device_memory

    total = device_memory(torch.device("cpu"))
    _, captured = run_cell(f"%memory_budget {typed} --model model --batch 32 --input x -r est")
    said = (f"{format_bytes(int(share * total))} ({typed} of this host's {format_bytes(total)} "  # as typed
            "of physical memory)")
    assert f"budget {said}, measured on cpu" in ip.user_ns["est"].summary
    assert f"compared with: {said}, with the training step's tensors" in unfolded(_texts(captured))
    assert "as given" not in _texts(captured)


def test_an_estimate_leaves_the_watched_budget_as_it_was(ip, run_cell, mlp):
    run_cell("%memory_budget 4GiB -q")
    _, captured = run_cell("%memory_budget 1GiB --model model --batch 32 --input x -r est")
    for shown in map(unfolded, _estimate_renderings(ip, captured, "est")):
        assert "a prediction, compared with 1 GiB: the budget being watched (4 GiB on cpu) stays as it was" in shown
    # Without a size, the prediction is compared with the watched budget, and says so.
    _, captured = run_cell("%memory_budget --model model --batch 32 --input x -r est")
    assert "budget 4 GiB (the budget being watched), measured on cpu" in ip.user_ns["est"].summary
    assert "a prediction, compared with the budget being watched (4 GiB on cpu), which stays as it was" in \
        unfolded(_texts(captured))
    run_cell("%memory_budget -q -r s")
    assert ip.user_ns["s"].active and ip.user_ns["s"].budget_bytes == 4 * 2**30


def test_an_estimate_against_more_than_this_host_suggests_a_budget_that_can_be_watched(ip, run_cell, mlp):
    _, captured = run_cell("%memory_budget 80G --model model --batch 32 --input x")
    text = unfolded(_texts(captured))
    # 80 GiB per GPU is no budget for this host: the command offered must be one that works here.
    assert "no budget is being watched, so later cells are not measured; %memory_budget 0.8 starts watching" in text
    assert "80G read as 80 GiB" in text


def test_an_estimate_shows_the_same_activations_and_peak_phase_in_every_rendering(ip, run_cell, mlp):
    """The activations column is what the forward keeps (the fit line's figure at the batch), and the peak
    is not a sum of the columns: every rendering names the phase that makes it and what it holds."""
    from nbaccel.memory import format_bytes

    _, captured = run_cell("%memory_budget 1GiB --model model --batch 32 --input x -r est")
    est = ip.user_ns["est"]
    one, fit = est.single("fp32"), est.fits["fp32"]
    phase = one["peak_phase"]
    held = {"forward": f"activations + {format_bytes(one['forward_temporaries'])} temporaries",
            "backward": f"grads + {format_bytes(one['backward_working'])} still held",
            "optimizer step": f"grads + {format_bytes(one['step_temporaries'])} temporaries"}[phase]
    for shown in map(unfolded, _estimate_renderings(ip, captured, "est")):
        assert "peak during" in shown
        assert f"{phase}: {held}" in shown
        assert f"at batch 32: {format_bytes(one['activations'])} (linear extrapolation)" in shown
        assert "what the forward keeps for the backward" in shown
    assert one["activations"] == fit.at(32) and "bytes alive at the end of the forward" in est.method


def test_unwritten_memory_of_earlier_cells_counts_in_the_note(ip, run_cell):
    """Two cells of ``torch.empty(200 MB)`` under a budget 300 MiB above the process: each alone fits once
    written, both do not. The second cell's note said only its own 200 MB ("would hold about" was under the
    budget's line it then named as crossed); the watcher now keeps the tally, and writing or freeing lowers it."""
    from nbaccel.memory import malloc_held_bytes

    if malloc_held_bytes() is None:
        pytest.skip("no glibc mallinfo2 here")
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(300)} -q -r b")
    try:
        _, captured = run_cell("a = torch.empty(200_000_000, dtype=torch.uint8)")
        assert "not yet resident" not in captured.stdout  # 200 MB written still fits
        _, captured = run_cell("c = torch.empty(200_000_000, dtype=torch.uint8)")
        said = unfolded(captured.stdout)
        assert re.search(r"In\[\d+\] reserved 1\d\d MiB that is not yet resident, about 3\d\d MiB with what "
                         r"earlier cells reserved \(", said), said
        assert "make the tensors smaller, or del some" in said
        totals = list(ip.user_ns["b"].history["unwritten_total_bytes"])
        assert totals[-1] >= 370 * 2**20 and totals[-2] >= 180 * 2**20
        run_cell("a.fill_(1); None")  # written: resident now, no longer pending
        run_cell("del c")
        totals = list(ip.user_ns["b"].history["unwritten_total_bytes"])
        assert 180 * 2**20 <= totals[-2] <= 200 * 2**20 and totals[-1] <= 10 * 2**20, totals
    finally:
        run_cell("a = c = None")
        run_cell("%memory_budget off")


def test_a_block_that_reserves_unwritten_memory_is_warned_not_failed():
    import warnings

    import nbaccel
    from nbaccel.memory import malloc_held_bytes

    if malloc_held_bytes() is None:
        pytest.skip("no glibc mallinfo2 here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nbaccel.memory_budget(current_rss() + 300 * MB, strict=True) as b:
            x = torch.empty(600_000_000, dtype=torch.uint8)
    said = [str(w.message) for w in caught if issubclass(w.category, nbaccel.BudgetWarning)]
    assert len(said) == 1 and said[0].startswith("block 1 reserved 5") and "not yet resident" in said[0], said
    assert b.history["status"].iloc[-1] != "over"
    del x


def test_a_scripts_warning_says_what_the_block_added_and_whether_the_process_was_over_already():
    """A trial's BudgetWarning gave the peak only: not what the block added, nor that the process alone was over."""
    import warnings

    import nbaccel

    def warned(budget, work):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with nbaccel.memory_budget(f"{budget}B"):
                work()
        return [str(w.message) for w in caught if issubclass(w.category, nbaccel.BudgetWarning)]

    [over] = warned(current_rss() + 50 * MB, lambda: torch.ones(100_000_000).add_(1))
    kept = r"( at its peak and kept ([\d.]+ [KM]iB|none))?"  # the 1-dim result is freed as the block ends
    assert re.search(r"over the budget of [\d.]+ MiB \(\d+%\); the block added 38\d MiB" + kept + "$", over), over
    held = torch.ones(100 * 2**20, dtype=torch.uint8).add_(1)
    [both] = warned(current_rss() - 50 * MB, lambda: torch.ones(100_000_000).add_(1))
    assert re.search(r"; the block added 38\d MiB" + kept + r"; the process already held [\d.]+ MiB as it began, "
                     r"which alone is over the budget$", both), both
    del held


def test_script_context_manager():
    import warnings

    import nbaccel
    from nbaccel.budget import BudgetExceeded, BudgetWarning

    tight = current_rss() + 150 * MB
    budget = nbaccel.memory_budget(f"{tight}B")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with budget:
            x = torch.ones(100_000_000)
        del x
    assert any(issubclass(w.category, BudgetWarning) for w in caught)
    with pytest.raises(BudgetExceeded):
        with nbaccel.memory_budget(f"{current_rss() + 150 * MB}B", strict=True):
            y = torch.ones(100_000_000)
    del y
    with pytest.raises(RuntimeError) as info:
        with budget:
            torch.empty(2**50, dtype=torch.uint8)
    assert budget.last_oom is not None and "OUT OF MEMORY" in "".join(info.value.__notes__)
    assert list(budget.history["status"]) == ["over", "oom"]
    with pytest.raises(nbaccel.budget.BudgetError, match="only a soft budget"):
        nbaccel.memory_budget("1GiB", enforce=True)


def test_a_script_budget_status_speaks_of_with_blocks_not_cells(ip, run_cell):
    # A trial: memory_budget(...).status() in a script said "checked after each cell" and "peak RSS per cell";
    # a script has no cells: the budget is checked as each with block exits.
    import nbaccel

    for strict in (False, True):
        budget = nbaccel.memory_budget("1GiB", device="cpu", strict=strict)
        for _ in range(2):  # before any block, and after one
            text = str(budget.status())
            head = text.splitlines()[0]
            assert head.endswith("[soft: checked when each with block exits, a BudgetWarning when over]" if not strict
                                 else "[strict: a with block that goes over raises BudgetExceeded]"), head
            assert "cell" not in text and "per with block" in budget.status().method, text
            assert budget.status().to_dict()["unit"] == "block"
            with budget:
                torch.ones(8).sum()
    with pytest.raises(nbaccel.budget.BudgetError, match=r"only a soft budget \(checked when the with block exits\)"):
        nbaccel.memory_budget("1GiB", enforce=True)
    # the magic's status still speaks of cells
    _, captured = run_cell(f"%memory_budget {_budget_above_now(4000)} -r s")
    assert _texts(captured).splitlines()[0].endswith("[soft: checked after each cell, a warning when over]")
    assert "per cell" in ip.user_ns["s"].method and ip.user_ns["s"].to_dict()["unit"] == "cell"
    run_cell("%memory_budget off")


def test_a_script_block_that_only_holds_memory_is_not_failed():
    """The scripts' blocks follow the cells' rule: a block that starts over a strict budget and adds nothing
    is "already over", without a BudgetExceeded or a warning (it raised one for memory held before it)."""
    import warnings

    import nbaccel

    held = torch.ones(200 * 2**20, dtype=torch.uint8)
    with nbaccel.memory_budget(0.9):  # a first run of the body and the meter maps a page or two: not measured here
        held[:8].tolist()
    budget = nbaccel.memory_budget(f"{current_rss() - 100 * MB}B", strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with budget:
            held[:8].tolist()
        del held
    assert not caught and list(budget.history["status"]) == ["already over"]


def test_enforce_cap_bookkeeping_with_a_stand_in_gpu(ip, monkeypatch):
    """The order of cap and watcher in `%memory_budget --enforce`, on a CPU machine: torch.cuda's
    cap calls are recorded instead of made. An H200 run found that a first `--enforce` left the GPU
    uncapped (the cap was applied, then released by the stop() that made the new watcher)."""
    import nbaccel.budget as budget
    import nbaccel.magics.budget as magic

    total = 80 * 2**30
    fractions = []
    monkeypatch.setattr(magic, "resolve_device", lambda spec: torch.device("cuda", 0) if "cuda" in str(spec)
                        else torch.device("cpu"))
    monkeypatch.setattr(budget, "device_memory", lambda device: total)
    monkeypatch.setattr(budget, "usage_now", lambda device: (0, 0))
    monkeypatch.setattr(magic, "usage_now", lambda device: (0, 0))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: fractions.append((f, i)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=None: 1.0, raising=False)

    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    assert budget.capped_devices() == [0] and fractions[-1] == (2**30 / total, 0)
    ip.run_line_magic("memory_budget", "2GiB --enforce --device cuda -q")  # a new size re-caps
    assert budget.capped_devices() == [0] and fractions[-1] == (2 * 2**30 / total, 0)
    ip.run_line_magic("memory_budget", "2GiB --device cuda -q")  # the same budget, soft: cap released
    assert budget.capped_devices() == [] and fractions[-1] == (1.0, 0)
    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    ip.run_line_magic("memory_budget", "off -q")
    assert budget.capped_devices() == [] and fractions[-1] == (1.0, 0)


def _stand_in_gpu(monkeypatch, sync):
    """cuda:0 for the watcher on a CPU machine: empty allocator counters, ``sync`` as torch.cuda.synchronize."""
    import nbaccel.budget as budget
    import nbaccel.magics.budget as magic
    import nbaccel.memory as memory

    monkeypatch.setattr(magic, "resolve_device", lambda spec: torch.device("cuda", 0) if "cuda" in str(spec)
                        else torch.device("cpu"))
    monkeypatch.setattr(budget, "device_memory", lambda device: 80 * 2**30)
    for module in (budget, magic):
        monkeypatch.setattr(module, "usage_now", lambda device: (0, 0))
    for module in (budget, memory):
        monkeypatch.setattr(module, "cuda_counters", lambda device: memory.CudaCounters(0, 0, 0, 0))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)


def test_a_kernel_failing_after_the_cell_is_that_cells_error(ip, run_cell, monkeypatch):
    """A device-side assert surfaces at the next synchronize, which is the watcher's after the cell: it
    came out as IPython's "Error in callback" traceback through nbaccel, cell after cell (a failed CUDA
    context raises again at every synchronize), the cell shown as fine. Now it is the cell's error, once,
    and later cells are measured without synchronizing."""
    syncs, failed = [], []

    def sync(device=None):
        syncs.append(device)
        if failed:
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    _stand_in_gpu(monkeypatch, sync)
    run_cell("%memory_budget 1GiB --device cuda -q -r b")
    run_cell("x = 1")
    assert syncs and list(ip.user_ns["b"].history["status"]) == ["ok"]
    failed.append(True)
    result, captured = run_cell("y = 2", expect_error=torch.AcceleratorError)
    shown = captured.stdout + unfolded(captured.stderr)
    assert "the GPU reported this error as In[" in shown and "restart the kernel" in shown
    assert "AcceleratorError: CUDA error: device-side assert triggered" in shown
    assert "Error in callback" not in shown and ip.user_ns["y"] == 2
    n = len(syncs)
    result, captured = run_cell("z = 3")  # no error: the context's failure was this cell's, shown once
    assert len(syncs) == n and "Error in callback" not in captured.stdout + unfolded(captured.stderr)
    history = ip.user_ns["b"].history
    assert list(history["status"])[-2:] == ["error", "ok"]
    assert "device-side assert" in list(history["error"])[-2]


def test_a_block_whose_kernels_fail_raises_in_a_script(monkeypatch):
    """``with memory_budget(...)`` in a script: the failure the exit's synchronize finds is raised there."""
    import nbaccel

    def sync(device=None):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    _stand_in_gpu(monkeypatch, sync)
    import nbaccel.budget as budget

    monkeypatch.setattr(budget, "resolve_device", lambda spec: torch.device("cuda", 0))
    b = nbaccel.memory_budget("1GiB", device="cuda")
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        with b:
            pass
    with b:  # the context has failed: later blocks are measured without synchronizing
        pass
    assert list(b.history["status"]) == ["error", "ok"]


def test_enforced_caps_nest(ip, monkeypatch):
    """A `memory_budget(..., enforce=True)` block inside `%memory_budget --enforce` on the same GPU: the
    block's exit put the GPU back to 1.0 while the magic still said enforce=True. Now it puts back the
    cap in force before it; `off` (and unload) still removes every cap nbaccel set, open blocks' too."""
    import nbaccel
    import nbaccel.budget as budget
    import nbaccel.magics.budget as magic

    total = 80 * 2**30
    fractions = []
    cuda0 = torch.device("cuda", 0)
    for module in (magic, budget):
        monkeypatch.setattr(module, "resolve_device", lambda spec: cuda0 if "cuda" in str(spec) else torch.device("cpu"))
    monkeypatch.setattr(budget, "device_memory", lambda device: total)
    monkeypatch.setattr(budget, "usage_now", lambda device: (0, 0))
    monkeypatch.setattr(magic, "usage_now", lambda device: (0, 0))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: fractions.append((f, i)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=None: 0.9, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class NoWatcher:  # the block's peak meter needs a real GPU; the caps are what is tested here
        records = []
        device_error = None

        def begin(self, label):
            pass

        def end(self, error=None):
            return None

    def block(size, device="cuda"):
        b = nbaccel.memory_budget(size, device=device, enforce=True)
        b.watcher = NoWatcher()
        return b

    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    assert fractions[-1] == (2**30 / total, 0)
    with block("2GiB"):
        assert fractions[-1] == (2 * 2**30 / total, 0)
        with block("512MiB", device="cuda:0"):  # a bare "cuda" and "cuda:0" are the same GPU
            assert fractions[-1] == (2**29 / total, 0)
        assert fractions[-1] == (2 * 2**30 / total, 0)
    assert fractions[-1] == (2**30 / total, 0) and budget.capped_devices() == [0]
    ip.run_line_magic("memory_budget", "-q -r now")
    assert ip.user_ns["now"].enforce
    ip.run_line_magic("memory_budget", "off -q")  # the fraction from before nbaccel, not 1.0
    assert fractions[-1] == (0.9, 0) and budget.capped_devices() == []

    with block("2GiB"):  # no magic cap: back to what was there before
        assert fractions[-1] == (2 * 2**30 / total, 0)
    assert fractions[-1] == (0.9, 0) and budget.capped_devices() == []

    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    with block("2GiB"):
        ip.run_line_magic("memory_budget", "off -q")  # off inside a block removes the block's cap too
        assert fractions[-1] == (0.9, 0) and budget.capped_devices() == []
    assert fractions[-1] == (0.9, 0) and budget.capped_devices() == []  # and the block's end keeps it off

    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    b = block("2GiB")
    b.__enter__()
    ip.run_line_magic("unload_ext", "nbaccel")
    try:
        assert fractions[-1] == (0.9, 0) and budget.capped_devices() == []
    finally:
        ip.run_line_magic("load_ext", "nbaccel")
    b.__exit__(None, None, None)
    assert budget.capped_devices() == []

    # A device without an index is the current GPU for capping and releasing alike (release took GPU 0).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    budget.apply_cap(torch.device("cuda"), 2**30)
    assert budget.capped_devices() == [1] and fractions[-1] == (2**30 / total, 1)
    budget.release_cap(torch.device("cuda"))
    assert budget.capped_devices() == [] and fractions[-1] == (0.9, 1)


def test_off_without_a_budget_says_there_was_none(ip, run_cell):
    result, captured = run_cell("%memory_budget off")
    text = "".join(o.data.get("text/plain", "") for o in captured.outputs)
    assert "no budget was set: nothing to remove" in text and "removed" not in text


@pytest.mark.parametrize("line, message", [
    # A number without a unit reads the same in any notation: at most 1 is a share, above 1 is refused
    # with the sizes it could mean (2e9 was taken as bytes, 2000000000 offered "2000000000GiB").
    ("2e9", r"^2e9 has no unit: write 2GB \(= 2,000,000,000 bytes\) or 1.86GiB; a number without a unit is a "
            r"share of this host's physical memory"),
    ("2000000000", r"^2000000000 has no unit: write 2GB \(= 2,000,000,000 bytes\) or 1.86GiB"),
    ("12", r"^12 has no unit: write 12% for 12 % of this host's physical memory, or a size: 12GiB, 12GB or 12MiB"),
    # a small or fractional number is more likely a size (a trial's 1.5 was offered 1.5 % first)
    ("1.5", r"^1.5 has no unit: write 1.5GiB, 1.5GB or 1.5MiB, or 1.5% for 1.5 % of this host's physical memory; "),
    ("2", r"^2 has no unit: write 2GiB, 2GB or 2MiB, or 2% for 2 % of"),
    ("0.5B", r"a budget under 1 MiB cannot hold a Python process .*did you mean 0.5GB\?"),
    ("1B", r"did you mean 1GB\?"),
    ("2GiB --near -0.5", r"^--near is a share of the budget between 0 and 1, got -0.5"),
    ("--near -.5 2GiB", r"^--near is a share"),
    # --near reads a percentage as the budget does; its range error is in the notation typed
    ("2GiB --near 150%", r"^--near is a share of the budget between 0% and 100%, got 150%$"),
    ("2GiB --near 0%", r"^--near is a share of the budget between 0% and 100%, got 0%$"),
    ("2GiB --near -50%", r"^--near is a share of the budget between 0% and 100%, got -50%$"),
    ("2GiB --near ninety", r"^--near takes a share of the budget such as 0.9 or 90%, got 'ninety'$"),
    # digit separators (a trial's 2,000MB read "cannot read"): the thing to drop, with what follows then
    ("2,000MB", r"^cannot read '2,000MB' as a budget: write it without digit separators, 2000MB$"),
    ("2_000_000_000", r"^write '2_000_000_000' without digit separators \('2000000000'\); then: 2000000000 has no "
                      r"unit: write 2GB"),
    ("1,5GB", r"^cannot read '1,5GB' as a budget; write e.g."),  # a decimal comma is no separator
    ("2GiB -s", r"unrecognized arguments: -s \(the strict budget is --strict\)"),
    # a percentage typed without its sign (a trial's --near 50): both spellings meant, not only the range
    ("2GiB --near 50", r"^--near is a share of the budget between 0 and 1, got 50 \(for 50%: 0.5 or 50%\)$"),
    ("-5GB", "a budget must be positive, got -5GB"),
    ("--strict -0.5", "a budget must be positive, got -0.5"),
    ("2GiB --device -1", "device"),
    ("0%", r"^a budget must be positive, got 0%; write e.g. 80% \(a share of this host's physical memory\) or 6GiB$"),
    ("150%", r"^150% is more than all of this host's physical memory: a share is at most 100%"),
    ("-5%", r"^a budget must be positive, got -5%"),
    ("2GiB -r -1", "-r/--result takes a Python variable name"),
    # Prediction options without --model once started a plain watch and dropped them unsaid.
    ("6GiB --batch 32", r"^--batch goes with --model: %memory_budget 80GiB --model model --batch 32"),
    ("6GiB --optimizer sgd --input x", r"^--optimizer and --input go with --model"),
    # ... and the watching options with --model (a prediction watches no cell)
    ("80GiB --model m --batch 8 --strict", r"^--strict goes with a watched budget, not with --model"),
    ("80GiB --model m --batch 8 --enforce --near 0.5", r"^--enforce and --near go with a watched budget, not with "
                                                       r"--model .*%memory_budget 6GiB --enforce --near \.\.\. to watch"),
])
def test_budget_text_is_read_consistently_and_errors_blame_the_right_option(ip, run_cell, line, message):
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("memory_budget", line)
    assert not _nbaccel_callbacks(ip)


@pytest.mark.parametrize("near, share", [("90%", 0.9), ("90 %", 0.9), ("=90%", 0.9), ("0.9", 0.9), ("100%", 1.0),
                                          ("=.6", 0.6)])
def test_near_takes_a_percentage_as_the_budget_does(ip, run_cell, near, share):
    # A trial: "%memory_budget 8GiB --near 90%" got argparse's "argument --near: invalid float value: '90%'",
    # though the budget on the same line reads 80%.
    sep = "" if near.startswith("=") else " "
    run_cell(f"%memory_budget {_budget_above_now(4000)} --near{sep}{near} -q -r s")
    assert ip.user_ns["s"].near == pytest.approx(share)


@pytest.mark.parametrize("line, letter", [("1G", "G"), ("1g", "g"), ("1 G", "G")])
def test_a_single_letter_unit_is_read_as_binary_and_the_status_says_so(ip, run_cell, line, letter):
    # docker --memory 1g and systemd MemoryMax=1G (what the --enforce note suggests) mean GiB; "1G" was refused.
    _, captured = run_cell(f"%memory_budget {line} -r s")
    assert ip.user_ns["s"].budget_bytes == 2**30
    head, note = _texts(captured).splitlines()[:2]
    assert head.startswith("memory budget 1 GiB of ") and head.endswith(
        "[soft: checked after each cell, a warning when over]")
    assert note == f"  {line} read as 1 GiB, as docker and systemd read {letter} (write 1GB for 1,000,000,000 bytes)"  # as typed


@pytest.mark.parametrize("line, size, read", [("2Gb", 2 * 10**9, "2 GB"), ("2gb", 2 * 10**9, "2 GB"),
                                               ("2 Gib", 2 * 2**30, "2 GiB")])
def test_a_lowercase_b_is_read_as_bytes_and_the_status_says_so(ip, run_cell, line, size, read):
    # "6Gb" was silently 6 GB: right for memory (nobody means gigabits), but b is bits by convention.
    _, captured = run_cell(f"%memory_budget {line} -r s")
    assert ip.user_ns["s"].budget_bytes == size
    note = _texts(captured).splitlines()[1]
    assert note == f"  {line} read as {read} (bytes; a lowercase b usually means bits)"  # as typed: "2 Gib"
    _, captured = run_cell("%memory_budget 2GB -r s")  # a capital B is bytes as written: nothing to say
    assert ip.user_ns["s"].budget_bytes == 2 * 10**9 and "bits" not in _texts(captured)


@pytest.mark.parametrize("line", ["0.8", "8e-1", ".8", "80e-2", "80%", "80 %"])
def test_a_share_in_any_notation(ip, run_cell, line):
    from nbaccel.budget import device_memory

    run_cell(f"%memory_budget {line} -q -r s")
    assert ip.user_ns["s"].budget_bytes == int(0.8 * device_memory(torch.device("cpu")))


def test_batch_below_one_names_batch(ip, run_cell):
    run_cell("import torch\nmodel = torch.nn.Linear(4, 4)")
    with pytest.raises(UsageError, match=r"--batch"):
        ip.run_line_magic("memory_budget", "--model model --batch -3")


def test_counts_are_singular_or_plural(ip, run_cell):
    run_cell("%memory_budget 0.9 -q")
    run_cell("x = 1")
    _, captured = run_cell("%memory_budget -r s")
    assert "1 cell watched:" in _texts(captured)  # the `x = 1` cell (the status cell is still running)
    run_cell("y = 2")
    _, captured = run_cell("%memory_budget")
    assert "2 cells watched:" in _texts(captured)  # x = 1, y = 2: status cells are no rows
    _, captured = run_cell("%memory_budget off")
    assert "removed; 2 cells had been watched" in _texts(captured)
    run_cell("%memory_budget 0.9 -q")
    run_cell("x = 1")
    _, captured = run_cell("%memory_budget off")
    assert "removed; 1 cell had been watched" in _texts(captured)


def test_estimate_magic_with_an_adamw_object_and_a_bad_input(ip, run_cell):
    # AdamW objects failed with "unexpected keyword argument 'decoupled_weight_decay'"; a wrong --input
    # showed torch's shape error with the internal probe batch and no word about the dry run.
    run_cell("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 64))\n"
             "opt = torch.optim.AdamW(model.parameters())\nx = torch.randn(32, 64)\nbad = torch.randn(32, 3)")
    run_cell("%memory_budget 4GiB --model model --optimizer opt --batch 32 --input x -q -r est")
    est = ip.user_ns["est"]
    assert est.optimizer == "adamw" and est.budget_bytes == 4 * 2**30
    with pytest.raises(UsageError, match=r"^the dry run of model on the example \(shape \(32, 3\)\) cut to the probe "
                                         r"batch of 4 rows failed.*\nthe example has shape \(32, 3\) and its first "
                                         r"layer, model\[0\] \(a Linear\), takes \(batch, \.\.\., 64\)\n"
                                         r"pass --input a batch that model accepts") as info:
        ip.run_line_magic("memory_budget", "4GiB --model model --batch 32 --input bad")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # a UsageError, no traceback chain


def test_results_frame_takes_the_context_manager_as_its_status():
    import nbaccel

    with nbaccel.memory_budget(0.9) as budget:
        pass
    row = nbaccel.results_frame([budget]).iloc[0]
    assert row["kind"] == "budget" and row["budget_bytes"] == budget.budget


def test_results_frame_names_the_dtype_a_profile_ran_in():
    import torch

    import nbaccel

    with nbaccel.profile(amp="bf16") as prof:
        torch.nn.Linear(64, 64)(torch.randn(8, 64))
    assert nbaccel.results_frame(prof.result).iloc[0]["dtype"] == "bf16"


def test_a_new_budget_over_a_watched_one_says_what_it_replaced(run_cell, ip):
    """A review: a new budget kept the old rows (89 %, 117 % of the old budget) and dropped --strict silently."""
    run_cell("%memory_budget 0.9 --strict -q")
    run_cell("x = 1")
    _, captured = run_cell("%memory_budget 0.8")
    text = _texts(captured)
    assert "replaces the budget of" in text and "(strict); this one is soft" in text
    assert "the cell watched so far keeps the budget it was held to" in unfolded(text)
    _, captured = run_cell("%memory_budget 0.8")  # the same again: nothing replaced
    assert "replaces" not in _texts(captured)
    run_cell("%memory_budget off")


def test_asking_for_an_estimate_by_another_name_says_how(ip):
    # A user trial: "%memory_budget --estimate --model m --batch 64" answered "did you mean --strict?".
    with pytest.raises(UsageError, match=r"unrecognized arguments: --estimate \(an estimate is asked for with "
                                         r"--model NAME --batch N"):
        ip.run_line_magic("memory_budget", "--estimate --model m --batch 64")
    with pytest.raises(UsageError, match=r"did you mean --strict\?"):  # a real misspelling still gets its match
        ip.run_line_magic("memory_budget", "1GiB --strictt")


def test_a_budget_given_as_an_option_says_it_is_the_first_word(ip):
    # A user trial: "%memory_budget --budget 2GiB" answered "did you mean --quiet?".
    for line in ("--budget 2GiB", "--budget=2GiB", "--limit 2GiB"):
        with pytest.raises(UsageError, match=r"\(the budget is written without an option: %memory_budget 2GiB\)"):
            ip.run_line_magic("memory_budget", line)
    assert ip.find_line_magic("memory_budget").__self__.watcher is None  # nothing was set


def test_estimate_with_sgd_names_the_users_sgd_with_momentum(ip, run_cell):
    """A user trial: --optimizer sgd (no momentum: 0 B) beside their own opt = SGD(momentum=0.9), which the status
    showed with 88.5 KiB of state; nothing said the two differ."""
    run_cell("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 128), "
             "torch.nn.ReLU(), torch.nn.Linear(128, 8))\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)")
    _, captured = run_cell("%memory_budget --model model --optimizer sgd --batch 64 -r est")
    n = 64 * 128 + 128 + 128 * 8 + 8
    for shown in _estimate_renderings(ip, captured, "est"):
        shown = unfolded(html.unescape(shown))
        assert "sgd means momentum=0, no state; --optimizer sgd-momentum or your optimizer object (--optimizer opt)" \
            in shown
        assert (f"your opt is SGD(momentum=0.9) over 4 of model's 4 parameter tensors, with {format_bytes(4 * n)} of "
                "state; this estimate assumes sgd (0 B): pass --optimizer opt to estimate yours") in shown


def test_estimate_names_the_users_sgd_by_its_groups_momentum(ip, run_cell):
    """The note read the first param group: an SGD whose biases' group (first) has momentum=0 and whose weights'
    group has 0.9 was "SGD(momentum=0) ... with 36 KiB of state"; its state is the weights' buffers."""
    run_cell("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 128), "
             "torch.nn.ReLU(), torch.nn.Linear(128, 8))\n"
             "biases = [p for n, p in model.named_parameters() if n.endswith('bias')]\n"
             "weights = [p for n, p in model.named_parameters() if n.endswith('weight')]\n"
             "opt = torch.optim.SGD([{'params': biases}, {'params': weights, 'momentum': 0.9}], lr=0.1)")
    _, captured = run_cell("%memory_budget --model model --optimizer sgd --batch 64 -r est")
    weights = 64 * 128 + 128 * 8
    for shown in _estimate_renderings(ip, captured, "est"):
        assert (f"your opt is SGD(momentum=0.9 in 1 of its 2 groups) over 4 of model's 4 parameter tensors, with "
                f"{format_bytes(4 * weights)} of state; this estimate assumes sgd (0 B)") in unfolded(html.unescape(shown))
    run_cell("%memory_budget --model model --optimizer opt --batch 64 -q -r own")
    assert ip.user_ns["own"].state_bytes == ip.user_ns["own"].states_measured == 4 * weights


def test_estimate_with_one_of_two_optimizers_respects_its_parameters(ip, run_cell):
    """A user trial: --optimizer opt_sp, a SparseAdam over the embeddings only, was rebuilt over every parameter
    and refused, telling the user to pass sparseadam (what they had passed)."""
    run_cell("import torch\ntorch.manual_seed(0)\nclass M(torch.nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n"
             "        self.emb = torch.nn.EmbeddingBag(5000, 32, sparse=True)\n        self.fc = torch.nn.Linear(32, 4)\n"
             "    def forward(self, x):\n        return self.fc(self.emb(x))\n"
             "m = M()\nx = torch.randint(0, 5000, (16, 10))\nopt_sp = torch.optim.SparseAdam(list(m.emb.parameters()))\n"
             "opt = torch.optim.SGD(m.fc.parameters(), lr=0.1, momentum=0.9)")
    _, captured = run_cell("%memory_budget --model m --optimizer opt_sp --batch 16 --input x -r est")
    est = ip.user_ns["est"]
    assert est.state_bytes == 2 * 5000 * 32 * 4
    text = unfolded(_estimate_renderings(ip, captured, "est")[0])
    assert "the other 2 (fc.weight, fc.bias" in text and "get no optimizer state in this estimate" in text
    assert "your opt updates parameters of m that --optimizer opt_sp leaves out: --optimizer opt_sp,opt" in text
    run_cell("%memory_budget --model m --optimizer opt_sp,opt --batch 16 --input x -q -r both")
    both = ip.user_ns["both"]
    assert both.optimizer == "sparseadam+sgd-momentum" and both.state_bytes == 2 * 5000 * 32 * 4 + (32 * 4 + 4) * 4
    assert not any("optimizer" in line for line in both.assumptions)
    # a trial: --optimizer sgd named each of the two as "pass --optimizer opt_sp" / "... opt", neither alone right
    run_cell("%memory_budget --model m --optimizer sgd --batch 16 --input x -q -r plain")
    notes = [line for line in ip.user_ns["plain"].assumptions if line.startswith("your ")]
    assert len(notes) == 1 and notes[0].startswith("your opt_sp (SparseAdam over 1 of m's 3 parameter tensors) and "
                                                   "opt (SGD(momentum=0.9) over 2 of m's 3 parameter tensors) keep ")
    assert notes[0].endswith("this estimate assumes sgd (0 B): pass --optimizer opt_sp,opt to estimate yours")
    with pytest.raises(UsageError, match="--optimizer opt,opt: opt is named twice"):
        ip.run_line_magic("memory_budget", "--model m --optimizer opt,opt --batch 16 --input x")
    # a review: an alias was summed with itself and the command it suggested was refused; two optimizers over
    # the same parameters are alternatives (one note each), not parts of one step
    run_cell("alias = opt\nother = torch.optim.Adam(m.fc.parameters())")
    with pytest.raises(UsageError, match="--optimizer opt_sp,opt,alias: opt and alias are the same optimizer"):
        ip.run_line_magic("memory_budget", "--model m --optimizer opt_sp,opt,alias --batch 16 --input x")
    run_cell("%memory_budget --model m --optimizer sgd --batch 16 --input x -q -r plain")
    notes = [line for line in ip.user_ns["plain"].assumptions if line.startswith("your ")]
    assert len(notes) == 3 and not any(" and alias" in n or "alias (" in n for n in notes), notes
    assert any(n.startswith("your other is Adam over 2 of m's 3") for n in notes), notes


def test_estimate_takes_the_loss_from_the_namespace(ip, run_cell):
    """A user trial: loss_fn existed in Python only, and the magic's display never said which loss it assumed."""
    run_cell("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Embedding(2000, 32), "
             "torch.nn.Linear(32, 2000))\nx = torch.randint(0, 2000, (16, 12))\n"
             "def ce(out, batch):\n    return torch.nn.functional.cross_entropy(out.flatten(0, 1), batch.flatten())\n"
             "n = 3")
    _, captured = run_cell("%memory_budget --model model --batch 16 --input x -r est")
    text = unfolded(_estimate_renderings(ip, captured, "est")[0])
    assert "pass it with --loss NAME (a function in the namespace)" in text
    assert "loss: a cross-entropy over the output's last dimension" in text  # 2,000 classes: a vocabulary
    _, captured = run_cell("%memory_budget --model model --batch 16 --input x --loss ce -r real")
    assert "loss: ce, called as loss_fn(output, batch)" in ip.user_ns["real"].method
    assert not ip.user_ns["real"].assumptions
    for line, says in (("--model model --batch 16 --input x --loss n", "--loss n is an int, not a function"),
                       ("--model model --batch 16 --input x --loss nothing", "--loss 'nothing' names nothing"),
                       ("6GiB --loss ce", "--loss goes with --model")):
        with pytest.raises(UsageError, match=re.escape(says)):
            ip.run_line_magic("memory_budget", line)


def test_estimate_takes_the_targets_apart_from_the_input(ip, run_cell):
    """A review: loss_fn(output, batch) got the model's own inputs, so a classifier's labels had nowhere to go
    (example=(x, y) called the model with both). --target / targets= hand them to the loss alone."""
    run_cell("import torch\nimport torch.nn.functional as F\ntorch.manual_seed(0)\n"
             "clf = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2000))\n"
             "x = torch.randn(64, 32)\ny = torch.randint(0, 2000, (64,))\n"
             "def ce(out, labels):\n    return F.cross_entropy(out, labels)\ndef total(out):\n    return out.sum()")
    run_cell("%memory_budget --model clf --batch 2048 --input x --loss ce --target y -q -r real")
    run_cell("%memory_budget --model clf --batch 2048 --input x -q -r default")
    real, default = ip.user_ns["real"], ip.user_ns["default"]
    assert "loss: ce, called as loss_fn(output, targets) (--target NAME cut to the probe's rows)" in real.method
    # 2,000 classes: the default is a cross-entropy too (class 0 for every row), and a target's value does not
    # change what it holds (the sum it replaced kept none of it: 2048 x 2000 x 4 B of log_softmax at least);
    # they differ by the int64 targets' rows the dry run cuts from --target (8 B a row)
    assert abs(real.single("fp32")["total"] - default.single("fp32")["total"]) <= 8 * 2048
    # a loss that refuses the targets is said as such, not as the model's input failing (a review)
    run_cell("ybad = torch.randint(0, 2000, (64, 3))")
    with pytest.raises(UsageError, match=r"the dry run's loss ce\(output, targets\) failed: RuntimeError: .*\n"
                                         r"the model's output has shape \(\d+, 2000\), the targets \(cut to the "
                                         r"probe's rows\) \(\d+, 3\): pass --target what --loss takes"):
        ip.run_line_magic("memory_budget", "--model clf --batch 64 --input x --loss ce --target ybad")
    for line, says in (("--model clf --batch 64 --input x --target y", "--target NAME is the loss's second argument"),
                       ("--model clf --batch 64 --input x --loss total --target y",
                        "--target NAME is the loss's second argument"),
                       ("--model clf --batch 64 --input x --loss ce --target nothing", "--target 'nothing' names "),
                       ("6GiB --target y", "--target goes with --model")):
        with pytest.raises(UsageError, match=re.escape(says)):
            ip.run_line_magic("memory_budget", line)


def test_a_loss_module_takes_the_targets_and_without_them_is_told_to(ip, run_cell):
    """A user trial: --loss ce --target yb with ce = nn.CrossEntropyLoss() was refused ("--target NAME is the
    loss's second argument"): a module's signature is Module.__call__(*args, **kwargs), its forward's is
    (input, target). Without --target the loss got the model's input and the error blamed --input."""
    run_cell("import torch\ntorch.manual_seed(0)\n"
             "clf = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
             "xb = torch.randn(64, 32)\nyb = torch.randint(0, 10, (64,))\nce = torch.nn.CrossEntropyLoss()\n"
             "def ce_fn(out, labels):\n    return torch.nn.functional.cross_entropy(out, labels)")
    run_cell("%memory_budget --model clf --batch 256 --input xb --loss ce --target yb -q -r module")
    run_cell("%memory_budget --model clf --batch 256 --input xb --loss ce_fn --target yb -q -r function")
    module, function = ip.user_ns["module"], ip.user_ns["function"]
    assert "loss: CrossEntropyLoss, called as loss_fn(output, targets)" in module.method
    # the module and the function compute the same loss: the same dry run, the same bytes
    assert module.single("fp32")["total"] == function.single("fp32")["total"]
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("memory_budget", "--model clf --batch 256 --input xb --loss ce")
    said = str(refused.value)
    assert re.search(r"the dry run's loss CrossEntropyLoss takes two arguments and, with no --target NAME given, was "
                     r"called as CrossEntropyLoss\(output, the model's input\): RuntimeError: .*\nthe model's output "
                     r"has shape \(\d+, 10\), its input \(\d+, 32\): pass the labels --loss takes as its second "
                     r"argument with --target NAME", said), said
    assert "pass --input a batch" not in said


def test_a_loss_class_a_loss_as_the_model_and_targets_of_other_rows_are_refused_saying_so(ip, run_cell):
    """A trial: --loss ce_cls (nn.CrossEntropyLoss, the class) was a traceback from torch ("'CrossEntropyLoss'
    object has no attribute 'backward'"); --target with 3 rows beside an --input of 8 was cut without a word;
    --model ce read "use torch.no_grad() memory tools for inference"; a non-function --loss beside --target
    showed a def loss(output, batch) template."""
    run_cell("import torch\nclf = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))\n"
             "x = torch.randn(8, 8)\ny = torch.randint(0, 3, (8,))\nce_cls = torch.nn.CrossEntropyLoss\n"
             "ce = torch.nn.CrossEntropyLoss()\nlossval = 3.0")
    for line, said in (
            ("--model clf --batch 32 --input x --loss ce_cls --target y",
             "--loss is the class CrossEntropyLoss, not a loss: pass an instance, nn.CrossEntropyLoss() (loss = "
             "nn.CrossEntropyLoss(), then --loss loss)"),
            ("--model clf --batch 32 --input x --loss ce --target y3",
             "--target NAME has 3 rows but --input has 8: the targets are the labels of the example's rows, one row "
             "each; pass the labels of the same batch"),
            ("--model ce --batch 32", "ce (a CrossEntropyLoss) has no parameters, so a training step has nothing to "
                                      "update: estimate the model you train (a loss goes in --loss)"),
            ("--model clf --batch 32 --input x --loss lossval --target y",
             "--loss lossval is a float, not a function: define def loss(output, targets): return "
             "F.cross_entropy(...), or make loss = nn.CrossEntropyLoss(), and pass --loss loss")):
        run_cell("y3 = y[:3]")
        with pytest.raises(UsageError) as refused:
            ip.run_line_magic("memory_budget", line)
        assert str(refused.value) == said, str(refused.value)
    import nbaccel  # the API says the same in its own words
    with pytest.raises(TypeError, match=re.escape("loss_fn is the class CrossEntropyLoss, not a loss: pass an "
                                                  "instance, nn.CrossEntropyLoss() (loss = nn.CrossEntropyLoss(), "
                                                  "then loss_fn=loss)")):
        nbaccel.estimate_memory(ip.user_ns["clf"], batch=32, example=ip.user_ns["x"], loss_fn=ip.user_ns["ce_cls"])
    with pytest.raises(ValueError, match=re.escape("targets= has 3 rows but example= has 8")):
        nbaccel.estimate_memory(ip.user_ns["clf"], batch=32, example=ip.user_ns["x"], loss_fn=ip.user_ns["ce"],
                                targets=ip.user_ns["y3"])


@pytest.mark.parametrize("kernel", [False, True], ids=["terminal", "kernel"])
def test_a_long_estimate_says_what_it_is_doing_and_how_to_stop_it(ip, run_cell, monkeypatch, kernel):
    """A trial: %memory_budget --model ran 98.6 s for a small CNN without a word. Past LONG_ESTIMATE_SECONDS the
    estimate says, before each dry-run step, how long so far and which step comes; in a kernel one display
    updated in place and, at the end, how long the dry runs took; in a terminal a few lines, each at least
    twice as late as the one before."""
    from nbaccel.magics import budget as budget_magic

    monkeypatch.setattr(budget_magic, "LONG_ESTIMATE_SECONDS", 0.0)  # every step, to keep the test short
    updates = []
    if kernel:
        monkeypatch.setattr(ip, "kernel", object(), raising=False)
        monkeypatch.setattr("IPython.display.DisplayHandle.update", lambda self, obj, **kw: updates.append(obj))
    run_cell("import torch\ntorch.manual_seed(0)\n"
             "net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))")
    _, captured = run_cell("%memory_budget --model net --batch 64 -r est")
    said = (note_lines(captured.stderr) if not kernel else
            [o.data["text/plain"] for o in captured.outputs if "so far" in o.data.get("text/plain", "")]
            + [u["text/plain"] for u in updates])
    step = (r"nbaccel %memory_budget: [\d.]+ (µs|ms|s) so far; now the (fp32|bf16 AMP) dry run: (its first step, at "
            r"batch 8 \(unmeasured: the optimizer makes its state\)|the step measured at batch (8|16|32)( \(a check of "
            r"the first two\))?)\. The dry runs measure every op of a training step on a copy of net, so they take "
            r"far longer than the step; Ctrl-C stops them and leaves the model, its optimizer and your variables as "
            r"they were\.")
    if kernel:
        assert len(said) >= 6 and said[0].startswith("nbaccel %memory_budget: ") and "the fp32 dry run: its first" \
            in said[0]
        assert all(re.fullmatch(step, line) for line in said[:-1]), said
        assert any("bf16 AMP dry run: the step measured" in line for line in said)
        assert re.fullmatch(r"nbaccel %memory_budget: the dry runs took [\d.]+ (ms|s) in all\.", said[-1]), said
    else:
        assert 1 <= len(said) <= 6 and all(re.fullmatch(step, line) for line in said), captured.stderr
        seconds = [float(re.search(r"([\d.]+) (ms|µs|s) so far", line).group(1)) * {"µs": 1e-6, "ms": 1e-3, "s": 1}[
            re.search(r"([\d.]+) (ms|µs|s) so far", line).group(2)] for line in said]
        assert all(later >= 2 * earlier * 0.999 for earlier, later in zip(seconds, seconds[1:])), said
    assert ip.user_ns["est"].single("fp32")["total"] > 0
    if kernel:  # a dry run that fails after the note says it stopped, not how long "the dry runs took"
        updates.clear()
        run_cell("def bad_loss(out, batch):\n    raise ValueError('not this loss')")
        run_cell("%memory_budget --model net --batch 64 --loss bad_loss", expect_error=UsageError)
        assert re.fullmatch(r"nbaccel %memory_budget: the dry runs stopped after [\d.]+ (µs|ms|s) \(the note below "
                            r"says why\)\.", updates[-1]["text/plain"]), updates
    # -q: no note; and below the threshold none either
    updates.clear()
    _, captured = run_cell("%memory_budget --model net --batch 64 -q")
    assert "so far" not in unfolded(captured.stderr) and captured.outputs == [] and updates == []
    monkeypatch.setattr(budget_magic, "LONG_ESTIMATE_SECONDS", 600.0)
    _, captured = run_cell("%memory_budget --model net --batch 64 -r est")
    assert "so far" not in unfolded(captured.stderr) and not any("so far" in str(o.data) for o in captured.outputs)
    assert updates == []


@pytest.mark.parametrize("line, said", [("2GiB cpu", "--device cpu"), ("2GiB cuda:1", "--device cuda:1"),
                                        ("4GiB GPU", "--device cuda")])
def test_a_device_without_its_option_is_told_where_it_goes(ip, line, said):
    """A trial: %memory_budget 2GiB cpu was argparse's "unrecognized arguments: cpu" alone."""
    with pytest.raises(UsageError, match=re.escape(f"(a device goes after --device: {said})")):
        ip.run_line_magic("memory_budget", line)
    with pytest.raises(UsageError) as other:  # another stray word keeps argparse's words
        ip.run_line_magic("memory_budget", "2GiB banana")
    assert "unrecognized arguments: banana; see %memory_budget --help" in str(other.value)


def test_input_takes_a_variable_name_not_an_expression(ip, run_cell):
    """A user trial: --input (x, off) failed with argparse's "unrecognized arguments: off)"."""
    run_cell("import torch\nmodel = torch.nn.Linear(4, 4)\nx = torch.randn(8, 4)\noff = torch.zeros(8)")
    with pytest.raises(UsageError, match=re.escape("--input takes a variable's name, got '(x, off)': make a variable "
                                                   "first (inp = (x, off)), then --input inp")):
        ip.run_line_magic("memory_budget", "--model model --batch 8 --input (x, off)")
    with pytest.raises(UsageError, match=re.escape("--model takes a variable's name, got 'nets[0]'")):
        ip.run_line_magic("memory_budget", "--model nets[0] --batch 8")


def test_estimate_cuts_a_flat_embedding_bag_input_by_bags_and_refuses_a_graph(ip, run_cell):
    """Reproduced: --input (indices, offsets) of an EmbeddingBag was cut row by row ("offsets[-1] can not be greater
    than input's length 32 but got offsets[-1] of 927"), and a GNN's (x, edge_index) read "IndexError: index 714 is
    out of bounds for dimension 0 with size 125", both with "pass --input a batch that ... accepts"."""
    run_cell("import torch\ntorch.manual_seed(0)\nclass Bag(torch.nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n"
             "        self.emb = torch.nn.EmbeddingBag(50000, 32, mode='sum')\n        self.fc = torch.nn.Linear(32, 4)\n"
             "    def forward(self, feats, offsets):\n        return self.fc(self.emb(feats, offsets))\n"
             "m = Bag()\nlens = torch.randint(20, 41, (256,))\n"
             "offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])\n"
             "inp = (torch.randint(0, 50000, (int(lens.sum()),)), offsets)\n"
             "class GNN(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
             "        self.lin = torch.nn.Linear(16, 32)\n    def forward(self, x, edge_index):\n"
             "        h = self.lin(x)\n        return torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]])\n"
             "g = GNN()\ngraph = (torch.randn(1000, 16), torch.randint(0, 1000, (2, 5000)))")
    _, captured = run_cell("%memory_budget 1GiB --model m --batch 256 --input inp -r est")
    assert ip.user_ns["est"].batch == 256
    for shown in _estimate_renderings(ip, captured, "est"):
        assert ("input: m's nn.EmbeddingBag input (--input's tensor 0: indices, --input's tensor 1: offsets) is 256 "
                "bags; a probe of k bags is offsets[:k] and indices[:offsets[k]] (probes of 32 and 64 bags)") in \
            unfolded(html.unescape(shown))
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("memory_budget", "1GiB --model g --batch 1000 --input graph")
    assert str(refused.value) == (
        "--input's tensor 1 (shape (2, 5000)) holds indices into the 1,000 rows of --input's tensor 0 (a graph's "
        "edge_index over its nodes), so g's input has no batch dimension: cutting the nodes to a smaller probe batch "
        "leaves edges pointing past the end, and the estimator fits its prediction through two such probes. Measure "
        "the step instead: %memory_budget 0.9, then run one training step on the full graph in a cell: %memory_budget "
        "status shows that cell's measured peak (peak used; added: what the cell added)")


def _folds(page: str) -> list[tuple[str, bool, str]]:
    """(summary, open?, folded text) of each <details> of a page, as a browser would fold them."""
    from html.parser import HTMLParser

    class Folds(HTMLParser):
        def __init__(self):
            super().__init__()
            self.found, self.depth, self.in_summary = [], 0, False

        def handle_starttag(self, tag, attrs):
            if tag == "details":
                self.depth += 1
                self.found.append(["", "open" in dict(attrs), ""])
            self.in_summary = self.in_summary or tag == "summary"

        def handle_endtag(self, tag):
            self.depth -= tag == "details"
            self.in_summary = self.in_summary and tag != "summary"

        def handle_data(self, data):
            if self.depth:
                self.found[-1][0 if self.in_summary else 2] += data

    parser = Folds()
    parser.feed(page)
    return [tuple(f) for f in parser.found]


def test_an_estimate_page_shows_the_figures_and_folds_the_method(ip, run_cell, mlp):
    # A trial: a tiny model's estimate filled a screen, most of it how the figures were measured. On a page
    # (and the widget) the verdict and the table stay in view; the sharding table folds when nothing needs it.
    from nbaccel.render import budget as budget_render

    run_cell("%memory_budget 1GiB --model model --batch 32 --input x -r est")
    page = budget_render.widget(ip.user_ns["est"]).value
    (sharding, sharding_open, sharded), (how, how_open, method) = _folds(page)
    assert "not needed: fp32 and bf16 AMP fit in the budget unsharded" in sharding and not sharding_open
    assert "ZeRO-3 / FSDP" in sharded
    assert how.startswith("How these figures were measured") and not how_open
    assert "method: params/buffers/grads/optimizer states" in unfolded(method)
    outside = page.split("<details")[0]
    assert "fits in fp32" in outside and "peak during" in outside and "method:" not in outside
    assert "method: " in budget_render.text(ip.user_ns["est"])  # a terminal has no folds: the text keeps it all

    run_cell("big = torch.nn.Linear(1024, 1024)\nxb = torch.randn(8, 1024)")
    run_cell("%memory_budget 8MiB --model big --batch 8 --input xb -r est")  # 4 MiB of weights, 16+ with adamw
    (sharding, sharding_open, _), _ = _folds(budget_render.widget(ip.user_ns["est"]).value)
    assert sharding_open and "not needed" not in sharding  # over the budget on one device: the plan is the answer


@pytest.mark.parametrize("raised", ["ValueError('after allocating')", "KeyboardInterrupt"])
def test_a_failed_cell_says_it_went_over_and_what_its_traceback_keeps_until_released(ip, run_cell, raised):
    """A trial: a step that allocated 300 MiB and then raised (or was interrupted) under a 600 MiB --strict budget
    showed its traceback alone; the history read "error" at 114%, every later cell "already over" in silence,
    and the 300 MiB stayed held by the error's traceback, which the holders table did not list."""
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(200)} --strict -q")
    run_cell(f"def boom():\n    t = torch.ones(300 * 2**20 // 4)\n    raise {raised}")
    try:
        _check_failed_cell_and_release(ip, run_cell, raised)
    finally:  # the 300 MiB would stay held for the tests after this one
        run_cell("%memory_budget release -q")
        run_cell("%memory_budget off -q")


def _check_failed_cell_and_release(ip, run_cell, raised):
    result, captured = run_cell("boom()", expect_error=BaseException)
    said = unfolded(captured.stdout)
    count = result.execution_count
    assert re.search(rf"nbaccel: In\[{count}\] failed, and its peak went over the memory budget before it did: "
                     r"[\d.]+ [MG]iB of [\d.]+ [MG]iB \(1\d\d%\); it added 30\d MiB\. Its traceback keeps 300 MiB of tensors "
                     r"alive in its functions' variables \(t in boom 300 MiB\): IPython keeps the last error for %tb and "
                     r"%debug until the next one, and no del reaches them; %memory_budget release drops it", said), said
    _, captured = run_cell("%memory_budget")
    rows = [line.split() for line in captured.outputs[0].data["text/plain"].splitlines()]
    assert ["(last", "error)", "traceback", "cpu", "fp32", "300", "MiB", "t", "in", "boom", "300", "MiB"] in rows
    before = current_rss()
    _, captured = run_cell("%memory_budget release")
    assert current_rss() < before - 250 * MB
    assert re.fullmatch(rf"nbaccel: released the last error \({'ValueError: after allocating' if 'Value' in raised else 'KeyboardInterrupt'}\) "
                        r"and its traceback: process RSS [\d.]+ [MG]iB -> [\d.]+ [MG]iB; %tb and %debug have nothing to show "
                        r"now", unfolded(captured.stdout).strip()), captured.stdout
    _, captured = run_cell("%memory_budget release")
    assert "no error to release" in captured.stdout
    _, captured = run_cell("%tb")
    assert "No traceback available" in captured.stdout + unfolded(captured.stderr)
    for line, named in (("release --strict", "--strict"), ("release -r b", "-r")):
        with pytest.raises(UsageError, match=f"^release takes no {named} \\(it drops the last error"):
            ip.run_line_magic("memory_budget", line)


def test_a_failed_cell_that_held_little_gets_no_note(ip, run_cell):
    run_cell("import torch")
    run_cell(f"%memory_budget {_budget_above_now(200)} -q")
    _, captured = run_cell("def small():\n    t = torch.ones(1000)\n    raise ValueError('x')\nsmall()",
                           expect_error=ValueError)
    assert "nbaccel:" not in captured.stdout
    _, captured = run_cell("%memory_budget")
    rows = [line.split() for line in captured.outputs[0].data["text/plain"].splitlines()]
    assert ["(last", "error)", "traceback", "cpu", "fp32", "3.91", "KiB", "t", "in", "small", "3.91", "KiB"] in rows
    run_cell("%memory_budget off -q")


def test_an_out_of_memory_cell_says_what_its_traceback_keeps(ip, run_cell):
    """After an out-of-memory error the failed step's frames (its activations) stay alive with the error: a
    retry then fails beside them. The explanation gives the figures; one line under it says what is kept."""
    run_cell("import torch")
    run_cell("%memory_budget 0.9 -q")
    run_cell("def step():\n    acts = torch.ones(50 * 2**20 // 4)\n    return torch.empty(2**50, dtype=torch.uint8)")
    try:
        _, captured = run_cell("step()", expect_error=RuntimeError)
        said = unfolded(captured.stdout)
        assert re.search(r"nbaccel: In\[\d+\] failed\. Its traceback keeps 50 MiB of tensors alive in its functions' "
                         r"variables \(acts in step 50 MiB\)", said), said
        assert "its peak went" not in said  # the explanation above has the figures
    finally:
        run_cell("%memory_budget release -q")
        run_cell("%memory_budget off -q")


def test_an_earlier_errors_memory_is_listed_or_freed_when_a_later_error_comes(ip, run_cell):
    """A trial: a cell failed holding 300 MiB, then a typo (`%memory_budget releas`) failed too; the status then
    listed nothing while RSS stayed 300 MiB up. IPython's formatter keeps the traceback it printed last (for
    %debug), which a magic's UsageError, printed without one, does not replace: it is listed and released. A
    later error with a traceback replaces it, and the first is then garbage in a reference cycle, collected."""
    run_cell("import torch")
    run_cell("%memory_budget 0.9 -q")
    run_cell("def boom():\n    t = torch.ones(300 * 2**20 // 4)\n    raise ValueError('held')")
    try:
        run_cell("boom()", expect_error=ValueError)
        run_cell("%memory_budget releas", expect_error=UsageError)
        _, captured = run_cell("%memory_budget")
        rows = [line.split() for line in captured.outputs[0].data["text/plain"].splitlines()]
        assert ["(last", "error)", "traceback", "cpu", "fp32", "300", "MiB", "t", "in", "boom", "300", "MiB"] in rows
        held = current_rss()
        run_cell("{}['k']", expect_error=KeyError)  # printed with a traceback: the formatter lets the first go
        assert current_rss() < held - 250 * MB  # freed as that error came, not at some later collection
    finally:
        run_cell("%memory_budget release -q")
        run_cell("%memory_budget off -q")


def test_an_estimate_that_leaves_the_process_over_a_watched_budget_says_so(ip, run_cell, mlp):
    """A trial: the estimate's dry runs (torch's profiler setting up once) took the process over the watched
    budget, and every later cell read "already over", unexplained. Here the budget is below the RSS already."""
    run_cell(f"%memory_budget {_budget_above_now(-20)} -q")
    try:
        _, captured = run_cell("%memory_budget 1GiB --model model --batch 32 --input x")
        said = unfolded(captured.outputs[0].data["text/plain"])
        assert re.search(r"the process's RSS is [\d.]+ [MG]iB after the dry runs, over the watched [\d.]+ [MG]iB: the "
                         r"next cells read 'already over' until memory is freed or the budget raised", said), said
        run_cell("%memory_budget 0.9 -q")
        _, captured = run_cell("%memory_budget 1GiB --model model --batch 32 --input x")
        assert "after the dry runs, over" not in unfolded(captured.outputs[0].data["text/plain"])
    finally:
        run_cell("%memory_budget off -q")


def test_a_failed_cell_whose_tensors_a_name_also_holds_gets_no_traceback_note(ip, run_cell):
    """The traceback keeps a function's variable alive only where no name in the namespace holds it too:
    `step(big)` failing holds nothing that release would free, and the note must not say it does."""
    run_cell("import torch\nbig = torch.ones(300 * 2**20 // 4)")
    run_cell("%memory_budget 0.9 -q")
    run_cell("def step(t):\n    raise ValueError('x')")
    try:
        _, captured = run_cell("step(big)", expect_error=ValueError)
        assert "traceback keeps" not in captured.stdout
    finally:
        run_cell("%memory_budget release -q")
        run_cell("%memory_budget off -q")
        run_cell("del big")
