"""Fuzz the magics' argument lines: every line is accepted as documented, a UsageError, or -h/--help.

The measurement itself is replaced by a recorder, so thousands of lines run in seconds and
"accepted" means: the magic reached the API with valid, documented values. A rejected line must
never run the cell. ``NBACCEL_FUZZ_EXAMPLES`` sets the number of lines per magic (CI: 300).
"""

from __future__ import annotations

import os
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import nbaccel.magics.amp as amp_magic
import nbaccel.magics.profile as profile_magic

EXAMPLES = int(os.environ.get("NBACCEL_FUZZ_EXAMPLES", "300"))

OPTIONS = ["--dtype", "--device", "--no-tf32", "--warmup", "--repeat", "--no-baseline", "--no-restore",
           "--max-snapshot", "-r", "--result", "-q", "--quiet",
           # other magics' options, typed into the wrong magic
           "--top", "--sort", "--trace", "--steps", "--enforce", "--strict", "--model", "--batch", "--amp",
           "--memory", "--shapes", "--stack", "--near", "--optimizer", "--input", "off", "6GiB", "512MB", "0.8",
           "-5GB", "12 parsecs", "1e40GiB", "-h", "--help"]
VALUES = st.one_of(
    st.sampled_from(["bf16", "fp16", "auto", "fp8", "cpu", "cuda", "cuda:7", "mps", "0", "-1", "1e309", "nan",
                     "99999999999999999999", "x y", "'", '"', "\u00e9\u00e8", "\U0001f525", "", "res", "1abc"]),
    st.integers(min_value=-10**12, max_value=10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=8),
)
TOKENS = st.lists(st.one_of(st.sampled_from(OPTIONS), VALUES), max_size=7)


def _line(tokens) -> str:
    # Some lines are quoted properly, some are raw (unmatched quotes stay in).
    return " ".join(tokens)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, fn, **kwargs):
        self.calls.append(kwargs)
        raise _Accepted(kwargs)


class _Accepted(Exception):
    pass


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=TOKENS)
def test_amp_lines_are_accepted_as_documented_or_usage_errors(ip, monkeypatch, tokens):
    recorder = Recorder()
    monkeypatch.setattr(amp_magic, "compare_amp", recorder)
    ip.user_ns["ran"] = 0
    line = _line(tokens)
    try:
        with capture_output() as out:
            ip.run_cell_magic("amp", line, "ran += 1")
    except UsageError:
        assert not recorder.calls, f"a rejected line reached the API: {line!r}"
        assert ip.user_ns["ran"] == 0, f"a rejected line ran the cell: {line!r}"
        return
    except _Accepted as accepted:
        kwargs = accepted.args[0]
        assert kwargs["dtype"] in ("bf16", "fp16", "auto", "tf32")
        assert kwargs["repeat"] >= 1 and kwargs["warmup"] >= 0
        assert 0 < kwargs["max_snapshot_fraction"] <= 1
        assert kwargs["device"].type in ("cpu", "cuda")
        return
    # -h/--help: the help was printed instead, and nothing ran
    assert out.stdout.lstrip().startswith("%%") and "--help" in out.stdout, line  # the usage line
    assert not recorder.calls and ip.user_ns["ran"] == 0, line


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=TOKENS)
def test_profile_lines_are_accepted_as_documented_or_usage_errors(ip, monkeypatch, tokens):
    recorder = Recorder()
    monkeypatch.setattr(profile_magic, "profile_function", lambda fn, options, **kw: recorder(fn, options=options))
    ip.user_ns["ran"] = 0
    line = _line(tokens)
    try:
        with capture_output() as out:
            ip.run_cell_magic("profile_gpu", line, "ran += 1")
    except UsageError:
        assert not recorder.calls, f"a rejected line reached the API: {line!r}"
        assert ip.user_ns["ran"] == 0, f"a rejected line ran the cell: {line!r}"
        return
    except _Accepted as accepted:
        options = accepted.args[0]["options"]
        assert options.steps >= 1 and options.warmup >= 0 and options.top >= 1
        assert options.amp in (None, "bf16", "fp16", "auto")
        return
    # -h/--help: the help was printed instead, and nothing ran
    assert out.stdout.lstrip().startswith("%%") and "--help" in out.stdout, line  # the usage line
    assert not recorder.calls and ip.user_ns["ran"] == 0, line


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=TOKENS)
def test_memory_budget_lines_are_accepted_or_usage_errors(ip, tokens):
    line = _line(tokens)
    before = {name: list(cbs) for name, cbs in ip.events.callbacks.items()}
    try:
        ip.run_line_magic("memory_budget", line + " -q")
    except UsageError:
        # A rejected line changes nothing: no hook was added.
        assert {name: list(cbs) for name, cbs in ip.events.callbacks.items()} == before, line
        return
    # Accepted: whatever it installed, "off" removes all of it.
    ip.run_line_magic("memory_budget", "off -q")
    assert {name: list(cbs) for name, cbs in ip.events.callbacks.items()} == before, line


@pytest.mark.parametrize("line", ["1e309", "1e309GiB", "99999999999999999999TiB"])
def test_absurd_budgets_are_usage_errors(ip, line):
    # Found by a long fuzz run: 1e309 overflowed to inf and int(inf) raised OverflowError.
    with pytest.raises(UsageError):
        ip.run_line_magic("memory_budget", line)


@pytest.mark.parametrize("line", ["--dtype 'bf16", '--result "a b', "-r ''", "--repeat 1e3", "--warmup=-3"])
def test_quoting_mistakes(ip, line):
    with pytest.raises(UsageError):
        ip.run_cell_magic("amp", line, "1")


def test_shlex_sanity():
    # The fuzzer's raw lines include unmatched quotes on purpose; IPython's parser must cope.
    with pytest.raises(ValueError):
        shlex.split("'")
