"""``python -m nbaccel``: help without a command, and ``trace`` (what %profile_trace shows) in a terminal."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.__main__ import main

H200 = Path(__file__).parent / "data" / "h200_bf16_transformer_step.json.gz"


def test_no_command_shows_the_commands_instead_of_an_error(capsys):
    # A user trial: `python -m nbaccel` exited 2 with "the following arguments are required: command".
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "env" in out and "trace" in out and "usage: nbaccel" in out


def test_trace_prints_the_report_a_notebook_shows(capsys):
    assert main(["trace", str(H200), "--top", "3", "--sort", "flops"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nbaccel trace: loaded trace h200_bf16_transformer_step.json.gz -- recorded on NVIDIA H200")
    assert "top 3 of 94 rows by self FLOPs" in out and "Tensor Core share of kernel time: 45.3%" in out


def test_trace_filters_its_table_as_the_magics_do(capsys):
    assert main(["trace", str(H200), "--filter", "aten::(mm|addmm)", "--top", "1"]) == 0
    assert re.search(r"^top 1 of the \d+ rows matching 'aten::\(mm\|addmm\)' \(94 in all\) by self device",
                     capsys.readouterr().out, re.M)
    assert "--filter TEXT" in subprocess.run([sys.executable, "-m", "nbaccel", "trace", "-h"], capture_output=True,
                                             text=True, timeout=120).stdout


def test_trace_json_is_the_results_to_dict(capsys):
    assert main(["trace", str(H200), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["made_by"] == "trace" and data["header"]["kernels"] == 140


def test_trace_mistakes_are_one_line_with_the_options_as_typed(capsys, tmp_path):
    assert main(["trace", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.strip() == f"nbaccel trace: {tmp_path / 'missing.json'}: no such file or folder"
    assert main(["trace", str(H200), "--top", "0"]) == 2
    assert capsys.readouterr().err.strip() == "nbaccel trace: --top must be at least 1, got 0"


def test_the_module_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "nbaccel", "trace", str(H200), "--top", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("nbaccel trace: ") and not proc.stderr


def test_trace_takes_memory_and_stack_as_its_messages_say(capsys):
    # A user trial: "--sort memory needs --memory", then "unrecognized arguments: --memory"
    assert main(["trace", str(H200), "--sort", "memory"]) == 2
    assert "--sort memory needs --memory" in capsys.readouterr().err
    assert main(["trace", str(H200), "--sort", "memory", "--memory", "--top", "3"]) == 0
    assert "top 3 of 94 rows by self mem alloc" in capsys.readouterr().out
    assert main(["trace", str(H200), "--stack"]) == 2  # this trace was recorded without with_stack
    assert capsys.readouterr().err.startswith("nbaccel trace: --stack: ")


def test_an_unknown_trace_option_shows_the_trace_usage(capsys):
    # argparse said it under the top-level usage ("nbaccel [-h] [--version] {env,trace}"), no trace option in it
    try:
        main(["trace", str(H200), "--bogus"])
    except SystemExit as exc:
        assert exc.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nbaccel trace [-h] [--top TOP]") and "--memory" in err
    assert "nbaccel trace: error: unrecognized arguments: --bogus\n" in err  # nothing close: no guess
    # trial 34: "--tpo 3" got no "did you mean", as the magics give
    with pytest.raises(SystemExit):
        main(["trace", str(H200), "--tpo", "3"])
    assert "unrecognized arguments: --tpo 3 (did you mean --top?)" in capsys.readouterr().err


def test_trace_json_says_the_steps_the_trace_holds_not_the_default_options(capsys, tmp_path):
    # A script-user trial: a folder from profile(warmup=1, steps=3, trace=...) read "warmup": 0, "steps": 1
    # in --json, the defaults of options nbaccel never had for a trace it did not record.
    import torch

    import nbaccel

    with nbaccel.profile(warmup=1, steps=3, trace=str(tmp_path / "sched")) as prof:
        for _ in range(4):
            torch.ones(8, 8) @ torch.ones(8, 8)
            prof.step()
    assert main(["trace", str(tmp_path / "sched"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["options"]["warmup"] is None and data["options"]["steps"] is None  # not known from a file
    header = data["header"]
    assert header["steps"] == 3 and len(header["step_times_us"]) == 3
    assert header["warmup"] is None and header["first_step"] == 1  # ProfilerStep#1-#3: one step ran unrecorded
    assert main(["trace", str(tmp_path / "sched")]) == 0
    assert "(3 ProfilerStep ranges, #1-#3)" in capsys.readouterr().out.splitlines()[1]
