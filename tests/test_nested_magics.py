"""A measuring magic inside another is refused: the outer one runs its cell several times and
measures every run, so the inner one would be run and measured as its code (a user trial: %%amp
inside %%amp ran 15 x 15 cells and showed two meaningless reports)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

SETUP = "import torch\nx = torch.randn(64, 64)\nruns = []"


@pytest.mark.parametrize("outer, inner, fix", [
    ("%%amp --repeat 3", "%%amp --repeat 3", "remove one of the two %%amp lines"),
    ("%%amp --repeat 3", "%%profile_gpu", "use %%profile_gpu --amp bf16"),
    ("%%profile_gpu", "%%amp --repeat 3", "use %%profile_gpu --amp bf16"),
    ("%%profile_gpu", "%%profile_gpu", "remove one of the two %%profile_gpu lines"),
])
def test_written_as_the_cells_first_line_it_is_refused_before_anything_runs(run_cell, ip, outer, inner, fix):
    run_cell(SETUP)
    result, captured = run_cell(f"{outer}\n\n{inner}\nruns.append(1)\nx @ x", expect_error=UsageError)
    message = str(result.error_in_exec)
    outer_name, inner_name = outer.split()[0], inner.split()[0]
    assert message.startswith(f"{inner_name} cannot run inside {outer_name}") and fix in message, message
    # Nothing ran, and no note explains a run: the refusal is all.
    assert ip.user_ns["runs"] == [] and captured.stderr.strip() == f"UsageError: {message}"


@pytest.mark.parametrize("outer", ["%%amp --repeat 3 --warmup 0", "%%profile_gpu"])
def test_started_from_the_cells_code_it_is_refused_when_reached(run_cell, ip, outer):
    run_cell(SETUP)
    result, _ = run_cell(f"{outer}\nruns.append(1)\nget_ipython().run_cell_magic('amp', '--repeat 3', 'x @ x')",
                         expect_error=UsageError)
    assert str(result.error_in_exec).startswith(f"%%amp cannot run inside {outer.split()[0]}")
    # Not left behind: the magics run as before.
    run_cell("%%amp --repeat 3 -q\nx @ x")
    run_cell("%%profile_gpu -q\nx @ x")


def test_only_the_measuring_magics_themselves_are_refused(run_cell, ip):
    run_cell(SETUP)
    # %%amp-x is another magic's name (IPython would look up "amp-x"): not taken for %%amp
    result, _ = run_cell("%%profile_gpu -q\n%%amp-x\nruns.append(1)", expect_error=BaseException)
    assert "cannot run inside" not in str(result.error_in_exec or result.error_before_exec)
    run_cell("%%amp --repeat 3 -q\n# %%amp in a comment is not a magic\nx @ x")


def test_a_magic_that_failed_does_not_block_the_next_one(run_cell):
    run_cell(SETUP)
    run_cell("%%amp --repeat 3 -q\n1 / 0", expect_error=ZeroDivisionError)
    run_cell("%%profile_gpu -q\n1 / 0", expect_error=ZeroDivisionError)
    run_cell("%%amp --repeat 3 -q\nx @ x")


def test_compare_amp_inside_a_profile_is_said_in_both_reports():
    """A trial: `with nbaccel.profile(): compare_amp(step)` read "1 step" with first-step advice about AdamW
    for 17 runs and their restores, and compare_amp's times held the profiler's cost with no word of it."""
    import torch

    import nbaccel

    m, x = torch.nn.Linear(32, 32), torch.randn(16, 32)
    with nbaccel.profile() as prof:
        res = nbaccel.compare_amp(lambda: m(x).sum(), dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert res.under_profiler and res.to_dict()["under_profiler"] is True
    assert any(w.startswith("a torch profiler was recording during these runs") and "nbaccel.profile(amp=...)" in w
               for w in res.noise_warnings)
    note = next(a for a in prof.result.advice if a.startswith("This profile holds"))
    assert note.startswith("This profile holds 1 nbaccel.compare_amp call (11 runs): both variants' warmup, timed")
    # alone, neither says it
    alone = nbaccel.compare_amp(lambda: m(x).sum(), dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert not alone.under_profiler and not any("profiler was recording" in w for w in alone.noise_warnings)
    with nbaccel.profile() as plain:
        m(x).sum()
    assert not any(a.startswith("This profile holds") for a in plain.result.advice)


def test_a_profile_inside_a_profile_is_refused_as_already_running_before_its_code_runs(capsys):
    """A trial: the inner nbaccel.profile() was refused as "another torch profiler is already running (a `with
    torch.profiler.profile()` block or an earlier profile that was not stopped)", and the outer one then said
    "the profiled code raised ProfileError": the inner block's code never ran, and nothing else was wrong."""
    import torch

    import nbaccel
    from nbaccel.profile_options import ProfileError

    x, ran = torch.randn(8, 8), []
    with pytest.raises(ProfileError) as caught:
        with nbaccel.profile() as outer:
            x @ x
            with nbaccel.profile():
                ran.append(1)
    assert not ran
    message = str(caught.value)
    assert message.startswith("an nbaccel profile is already running: this nbaccel.profile() was started inside "
                              "another nbaccel.profile()'s with block") and "refused before its code ran" in message
    assert "Profile one or the other" in message and "torch.profiler.profile()" not in message
    said = capsys.readouterr().err
    assert "the profiled code raised" not in said
    assert said.startswith("nbaccel: a profile started inside this nbaccel.profile was refused before its code ran")
    assert "discarded" in said and repr(outer).startswith("<nbaccel.profile discarded")
    with nbaccel.profile() as after:  # nothing left behind
        x @ x
    assert after.result.op_count > 0


def test_a_profile_started_in_a_profiled_cell_or_around_one_is_refused_as_already_running(run_cell, ip):
    run_cell(SETUP + "\nimport nbaccel")
    result, captured = run_cell("%%profile_gpu\nx @ x\nwith nbaccel.profile():\n    runs.append(1)",
                                expect_error=Exception)
    assert str(result.error_in_exec).startswith("an nbaccel profile is already running: this nbaccel.profile() was "
                                                "started inside a %%profile_gpu cell")
    assert ip.user_ns["runs"] == [] and "the profiled code raised" not in captured.stderr
    assert "a profile started inside this %%profile_gpu was refused before its code ran" in captured.stderr
    # %%profile_gpu run from inside a with nbaccel.profile() block: a UsageError before its cell runs
    result, captured = run_cell("with nbaccel.profile():\n    get_ipython().run_cell_magic('profile_gpu', '', "
                                "'runs.append(1)')", expect_error=UsageError)
    assert str(result.error_in_exec).startswith("an nbaccel profile is already running: this %%profile_gpu cell was "
                                                "started inside another nbaccel.profile()'s with block")
    assert ip.user_ns["runs"] == []
    run_cell("%%profile_gpu -q\nx @ x")
