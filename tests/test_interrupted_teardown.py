"""A Ctrl-C that lands while a magic undoes what it did (its teardown) must still leave the process as
the magic found it, and the cell must still read as interrupted (the KeyboardInterrupt is raised after
the cleanup, never swallowed).

CPython 3.11 turns a pending SIGINT into KeyboardInterrupt where it checks for signals: as a Python
function starts, among other places. The tests raise one there deterministically (`interrupt_at`: a
trace function that raises at the first call of the named function, or as a chosen line of it
starts), through a real IPython shell, and compare what a teardown could leave behind before and
after: autocast (and its nesting), the profiler and its Python tracer, nbaccel's recording lock,
torch's dispatch-mode stack, logging, fds 1 and 2, the stderr filter's threads and pipes, the
measuring-magic guard and the option spelling. The autouse fixture in conftest.py checks torch's
global flags and the optimizer step hooks on top.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore")


@contextlib.contextmanager
def interrupt_at(file_suffix: str, func: str, after: str | None = None, nth: int = 1):
    """Raise KeyboardInterrupt once, at the ``nth`` call of ``func`` in a file whose name ends with
    ``file_suffix``; with ``after`` (a piece of that function's source), as the line after the one
    holding it starts instead. Yields a list that holds True once it was raised."""
    raised = []
    target = None
    calls = 0

    def local(frame, event, arg):
        if raised or event != "line" or frame.f_lineno <= target:
            return local
        raised.append(True)
        sys.settrace(None)
        raise KeyboardInterrupt

    def trace(frame, event, arg):
        nonlocal target, calls
        code = frame.f_code
        if raised or event != "call" or code.co_name != func or not code.co_filename.endswith(file_suffix):
            return None
        calls += 1
        if calls < nth:
            return None
        if after is None:
            raised.append(True)
            sys.settrace(None)
            raise KeyboardInterrupt
        lines, first = inspect.getsourcelines(code)
        target = first + next(i for i, text in enumerate(lines) if after in text)
        return local

    sys.settrace(trace)
    try:
        yield raised
    finally:
        sys.settrace(None)


@contextlib.contextmanager
def interrupt_at_an_exit(is_it):
    """Raise KeyboardInterrupt once, at the first line of an ``__exit__`` whose ``self`` ``is_it``:
    none of that context's cleanup runs. Yields a list that holds True once it was raised."""
    raised = []

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__exit__" and is_it(frame.f_locals.get("self")):
            raised.append(True)
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(trace)
    try:
        yield raised
    finally:
        sys.settrace(None)


def interrupt_at_the_exit_of(generator_name: str):
    """`interrupt_at_an_exit` of a ``@contextlib.contextmanager`` function named ``generator_name``."""
    return interrupt_at_an_exit(
        lambda context: isinstance(context, contextlib._GeneratorContextManager)
        and getattr(getattr(context, "gen", None), "__name__", None) == generator_name)


def _autocast_nesting() -> int:
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level - 1


def _filter_threads() -> int:
    return sum(t.name == "nbaccel-stderr-filter" for t in threading.enumerate())


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _hidden_run_files() -> set[str]:
    import tempfile

    return {f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"nbaccel-hidden-run-{os.getpid()}-")}


def left_behind() -> dict:
    """What a magic's teardown could leave changed in the process (beyond conftest's global_state)."""
    from nbaccel.magics.common import _measuring
    from nbaccel.options import in_magic
    from nbaccel.profile import _RECORDING

    for _ in range(200):  # a filter thread ends when its pipe closes: give it a moment
        if not _filter_threads():
            break
        time.sleep(0.01)
    return {
        "autocast cpu": torch.is_autocast_enabled("cpu"), "autocast nesting": _autocast_nesting(),
        "profiler": torch.autograd._profiler_enabled(), "sys.getprofile": sys.getprofile(),
        "recording lock held": _RECORDING.locked(), "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "logging.disable": logging.root.manager.disable,
        "a logger's warnings enabled": logging.getLogger("nbaccel.test").isEnabledFor(logging.WARNING),
        "fd 1": os.readlink("/proc/self/fd/1"), "fd 2": os.readlink("/proc/self/fd/2"),
        "stderr filter threads": _filter_threads(), "open fds": _open_fds(),
        "hidden-run files": _hidden_run_files(), "measuring": list(_measuring), "in_magic": in_magic(),
        "SIGINT handler": signal.getsignal(signal.SIGINT), "sys.stdout": sys.stdout, "sys.stderr": sys.stderr,
    }


def interrupted_run(run_cell, cell: str, file_suffix: str, func: str, after: str | None = None, nth: int = 1):
    """Run ``cell`` once uninterrupted (first-call costs and lazily opened files out of the way), then
    with a KeyboardInterrupt at ``func`` (`interrupt_at`; for ``file_suffix="contextlib.py"``, ``func``
    names the generator whose contextlib ``__exit__`` it lands at: `interrupt_at_the_exit_of`); return
    (what changed, captured output of the second run)."""
    run_cell(cell)
    before = left_behind()
    injected = interrupt_at_the_exit_of(func) if file_suffix == "contextlib.py" else interrupt_at(file_suffix, func,
                                                                                                    after, nth)
    with injected as raised:
        result, captured = run_cell(cell, expect_error=KeyboardInterrupt)  # the cell reads as interrupted
    assert raised, f"{func} in {file_suffix} was never called"
    after_run = left_behind()
    changed = {key: (value, after_run[key]) for key, value in before.items() if after_run[key] != value}
    return changed, captured


PROFILE = "%%profile_gpu --amp bf16 --stack -q\ny = x @ x\n"
AMP = "%%amp --warmup 0 --repeat 1 -q\ny = x @ x\ny.sum()\n"


@pytest.fixture
def x(ip):
    ip.user_ns["x"] = torch.randn(64, 64)


# --- %%profile_gpu's teardown ------------------------------------------------------------------

@pytest.mark.parametrize("file_suffix, func", [
    ("torch/amp/autocast_mode.py", "__exit__"),   # the recipe's autocast, as the profile stops
    ("nbaccel/profile.py", "__exit__"),           # the profile's own __exit__, at its first line
    ("nbaccel/profile.py", "_stop"),
    ("nbaccel/profile.py", "_stop_recording"),
    ("torch/profiler/profiler.py", "stop"),       # torch's profiler stop, at its first line
])
def test_a_ctrl_c_while_a_profile_stops_still_stops_everything(run_cell, x, file_suffix, func):
    """A fault-injection audit: a Ctrl-C at autocast's __exit__ left autocast on; one at the first line of
    profile.__exit__ left the profiler running (its Python tracer as sys.setprofile), autocast on, the
    CPU's fp32 precision changed, the optimizer step hook registered, the recording lock held, fd 2 on
    the stderr filter's pipe, and a segfault at exit."""
    changed, captured = interrupted_run(run_cell, PROFILE, file_suffix, func)
    assert changed == {}
    assert "nbaccel: interrupted (KeyboardInterrupt)" in captured.stderr


# --- the recipe (nbaccel.precision, %%amp's runs, %%profile_gpu --amp) -------------------------------

def test_a_ctrl_c_as_the_recipes_autocast_exits_still_puts_everything_back():
    """The recipe's own teardown, from Python: autocast off again at its nesting level (a level left up
    means its weight-cast cache is never cleared again), the optimizer step hook removed, the CPU's fp32
    precision back; the interrupt still raised."""
    import nbaccel
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks, nesting = len(_global_optimizer_post_hooks), _autocast_nesting()
    with pytest.raises(KeyboardInterrupt), interrupt_at("torch/amp/autocast_mode.py", "__exit__"):
        with nbaccel.precision("bf16", "cpu"):
            assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    assert _autocast_nesting() == nesting
    assert len(_global_optimizer_post_hooks) == hooks


def test_a_ctrl_c_while_a_setting_is_put_back_after_a_check_leaves_it_as_the_user_set_it():
    """Reading the fp32 precision settings sets one for a moment where a reading cannot tell "none" from
    a value (here oneDNN's backend value "ieee", the same as its ops read): a Ctrl-C as it was put back
    left it at the value it was checked against ("tf32"), for every later CPU op."""
    from nbaccel.precision import _fp32_state

    before = torch.backends.mkldnn.fp32_precision
    torch.backends.mkldnn.set_flags(_fp32_precision="ieee")
    try:
        with pytest.raises(KeyboardInterrupt), interrupt_at("nbaccel/precision.py", "_write_raw", nth=2):
            _fp32_state()  # _write_raw: 1st sets "tf32" for the check, 2nd puts "ieee" back
        assert torch.backends.mkldnn.fp32_precision == "ieee"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.mkldnn.set_flags(_fp32_precision=before)


@pytest.mark.parametrize("file_suffix, func, nth", [
    ("contextlib.py", "quiet_kineto", 1),               # the stderr filter around the profiler's start
    ("torch/autograd/profiler.py", "__enter__", 2),     # torch's own step range, in prof.step()
    ("torch/profiler/profiler.py", "stop_trace", 1),    # the stop that ends the active steps, in prof.step()
])
def test_a_ctrl_c_around_a_scheduled_profiles_steps_still_stops_everything(run_cell, x, file_suffix, func, nth):
    """The sweep of a profile with a warmup step: one at the first line of quiet_kineto's contextlib exit
    left fd 2 on the filter's pipe; one at the start of torch's step range in prof.step() left it not
    entered, and torch's stop() asserted on it before stopping anything; one in the stop that ends the
    active steps (in prof.step(), after torch's schedule had moved on) left stop() nothing to do: in
    both, the profiler ran on."""
    changed, _ = interrupted_run(run_cell, "%%profile_gpu --warmup 1 -q\ny = x @ x\n", file_suffix, func, nth=nth)
    assert changed == {}


# --- %%amp's audited run ---------------------------------------------------------------------------

@pytest.mark.parametrize("file_suffix, func", [
    ("nbaccel/flops.py", "__exit__"),                 # OpAudit's own, at its first line
    ("torch/utils/_python_dispatch.py", "__exit__"),  # torch's TorchDispatchMode.__exit__
    ("torch/utils/_python_dispatch.py", "_pop_mode"),  # after torch put its flags back
])
def test_a_ctrl_c_as_the_op_audit_ends_leaves_no_dispatch_mode_on(run_cell, x, file_suffix, func):
    """The audit: one at OpAudit.__exit__ (or in torch's __exit__ under it) left it on torch's dispatch-mode
    stack, and every later op of the session ran through a stale audit."""
    changed, _ = interrupted_run(run_cell, "%%amp --warmup 0 --repeat 1 -q\ny = x @ x\n", file_suffix, func)
    assert changed == {}
    from torch.utils import _python_dispatch

    assert not _python_dispatch._is_in_torch_dispatch_mode  # torch's own flag, put back with the mode
    # and dynamo's stance, which the audit sets to force_eager while it is on (nbaccel.eager_modes)
    from torch._dynamo.eval_frame import _stance

    assert _stance.stance == "default"


def test_a_mode_a_failed_body_left_on_the_stack_is_exited_by_the_recipe():
    """What undoes the first case above: a Ctrl-C at the first line of OpAudit.__exit__ runs none of it,
    and the recipe around the audit exits the mode its failed body left on torch's stack."""
    import nbaccel
    from nbaccel.flops import OpAudit

    audit = OpAudit()
    with pytest.raises(RuntimeError), nbaccel.precision("bf16", "cpu"):
        audit.__enter__()  # and never left, as after a Ctrl-C at the first line of its __exit__
        raise RuntimeError("the body failed")
    assert torch._C._len_torch_dispatch_stack() == 0
    assert audit._depth == 0
    from torch._dynamo.eval_frame import _stance

    assert _stance.stance == "default" and not audit._eager_stances


# --- hidden runs (nbaccel.quiet) ---------------------------------------------------------------------

def test_a_ctrl_c_as_a_hidden_run_puts_fds_1_and_2_back_still_puts_them_back(run_cell, x):
    """The audit: one at the first line of fd_output_hidden.__exit__ left fds 1 and 2 on
    /tmp/nbaccel-hidden-run-*.log for the rest of the session."""
    changed, _ = interrupted_run(run_cell, AMP, "nbaccel/quiet.py", "__exit__")
    assert changed == {}


@pytest.mark.parametrize("cell, generator", [
    (AMP, "unlogged_and_unwarned"),    # logging off, warnings recorded
    ("%%profile_gpu --warmup 1 -q\ny = x @ x\n", "hidden"),   # a profile's hidden warmup run, all of the above
])
def test_a_ctrl_c_at_the_first_line_of_a_hidden_runs_context_exit_still_undoes_it(run_cell, x, cell, generator):
    """A sweep of one KeyboardInterrupt at each function start of a hidden run's end: one at the first line
    of contextlib's __exit__ left that generator suspended (logging off, stdout captured, fds 1 and 2 on
    the hidden run's file) until the garbage collector closed it."""
    changed, _ = interrupted_run(run_cell, cell, "contextlib.py", generator)
    assert changed == {}


def test_a_ctrl_c_at_the_first_line_of_the_silencers_exit_gives_stdout_back(ip, x):
    """The same for the magics' silencer (IPython's capture of stdout, stderr and displays): sys.stdout
    stayed the capture's buffer, and every later print of the session vanished. Run without the tests'
    own capture around the cell, which would put sys.stdout back itself."""
    before = sys.stdout, sys.stderr
    with interrupt_at_the_exit_of("silenced") as raised:
        result = ip.run_cell(AMP)
    assert raised and isinstance(result.error_in_exec, KeyboardInterrupt)
    assert (sys.stdout, sys.stderr) == before


@pytest.mark.parametrize("file_suffix, func", [
    ("IPython/utils/capture.py", "__exit__"),       # at the first line of the capture's exit
    ("IPython/core/displaypub.py", "__init__"),     # in its __enter__, after sys.stdout was replaced
    ("IPython/core/displayhook.py", "__init__"),
])
def test_a_ctrl_c_in_ipythons_capture_of_a_hidden_run_gives_stdout_back(ip, x, file_suffix, func):
    """The sweep: IPython's capture_output replaces sys.stdout, then builds its display publisher and
    hook; a Ctrl-C there (or at its __exit__'s first line) left sys.stdout its buffer for good."""
    before = sys.stdout, sys.stderr, sys.displayhook, ip.display_pub
    with interrupt_at(file_suffix, func) as raised:
        result = ip.run_cell(AMP)
    assert raised and isinstance(result.error_in_exec, KeyboardInterrupt)
    assert (sys.stdout, sys.stderr, sys.displayhook, ip.display_pub) == before


def test_a_ctrl_c_as_a_hidden_run_removes_its_file_leaves_no_file():
    """Its file was removed inside contextlib.suppress(OSError): a Ctrl-C at the first line of
    suppress.__init__ (the first contextlib call of the exit) left it in the temp folder."""
    from nbaccel.quiet import fd_output_hidden

    fds = fd_output_hidden()
    fds.__enter__()
    try:
        with interrupt_at("contextlib.py", "__init__"):
            fds.__exit__(None, None, None)
    except KeyboardInterrupt:
        pass
    fds.__exit__(None, None, None)  # what hiding_side_channels does after an interrupt: nothing left to do
    assert not os.path.exists(fds.path)
    assert _hidden_run_files() == set()


@pytest.mark.parametrize("nth", [1, 2])  # as logging is switched off for a hidden run, as it is switched back on
def test_a_ctrl_c_in_logging_disable_leaves_logging_on(run_cell, x, nth):
    """The audit: one at logging's _clear_cache (called by logging.disable(CRITICAL) before the try that
    switched it back on) left logging.root.manager.disable at 50 for good; one as it was switched back on
    left the loggers' caches saying their levels were disabled."""
    # the cell logs: in a hidden run its logger caches its level as disabled
    cell = "%%amp --warmup 0 --repeat 1 -q\nimport logging\nlogging.getLogger('nbaccel.test').warning('run')\ny = x @ x\n"
    changed, _ = interrupted_run(run_cell, cell, "logging/__init__.py", "_clear_cache", nth=nth)
    assert changed == {}


# --- the stderr filter around the profiler's own calls (nbaccel.stderr_filter) -------------------

@pytest.mark.parametrize("file_suffix, func", [
    ("threading.py", "wait"),    # in thread.start(): the thread runs, start() never returns
    ("threading.py", "start"),   # before the thread exists
    ("nbaccel/stderr_filter.py", "stop"),
])
def test_a_ctrl_c_as_the_stderr_filter_starts_or_stops_leaves_no_thread_pipe_or_fd_2_on_it(run_cell, x, file_suffix,
                                                                                          func):
    """The audit: thread.start() and os.dup2(write_end, 2) ran before the try; a Ctrl-C in start() (five
    interrupted profiles) left five nbaccel-stderr-filter threads and about 20 fds, and once fd 2 on the
    pipe."""
    for _ in range(3):
        changed, _ = interrupted_run(run_cell, "%%profile_gpu -q\ny = x @ x\n", file_suffix, func)
        assert changed == {}


# --- the magics' own guards ----------------------------------------------------------------------

@pytest.mark.parametrize("file_suffix, func, after", [
    ("nbaccel/magics/common.py", "sole_measuring_magic", "_measuring.append(name)"),
    ("nbaccel/options.py", "spelled", "_IN_MAGIC.set(True)"),          # magic_spelled, around the magic
    ("nbaccel/options.py", "__enter__", "_IN_MAGIC.get()"),            # magic_spelling, around the cell
])
def test_a_ctrl_c_right_after_a_magic_marks_itself_running_leaves_no_mark(run_cell, x, file_suffix, func, after):
    """The audit: one between the mark and the try that removes it (the line after it, where CPython
    checks for signals after a call) left _measuring == ['amp'], every later %%amp and %%profile_gpu
    refused as nested, or in_magic() True, every later API error spelled as a magic's option."""
    changed, _ = interrupted_run(run_cell, AMP, file_suffix, func, after=after)
    assert changed == {}
    run_cell(AMP)  # not refused as nested


# --- the hold itself (nbaccel.signals) -----------------------------------------------------------

def test_a_hold_whose_exit_never_ran_passes_the_next_ctrl_c_on():
    """A KeyboardInterrupt raised at the first line of sigint_held.__exit__ (a fault injector's: a real
    Ctrl-C is caught by the hold there) ended the block with the hold's handler still installed, and
    every later Ctrl-C of the session was caught and never delivered."""
    from nbaccel.signals import sigint_held

    def held():
        with sigint_held():
            pass

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt), interrupt_at("nbaccel/signals.py", "__exit__"):
            held()
        assert signal.getsignal(signal.SIGINT) is not before  # left installed: what the handler now checks
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # delivered, not held
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_held_ctrl_c_inside_the_block_still_waits_for_its_end():
    from nbaccel.signals import sigint_held

    def inner():  # the signal is handled in a frame below the one that holds it
        signal.raise_signal(signal.SIGINT)
        return "ran on"

    with pytest.raises(KeyboardInterrupt):
        with sigint_held():
            assert inner() == "ran on"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_as_the_cells_spelling_ends_leaves_no_magic_spelling_behind(run_cell, x, ip):
    """The cell runs in magic_spelling(False) inside the magic's spelling. As a contextlib generator, a
    Ctrl-C at the first line of its exit left it suspended, and when the garbage collector closed it its
    cleanup set the value it had found: the magic's spelling, for every later error of the session."""
    import gc

    from nbaccel.options import in_magic, magic_spelling

    def is_the_cells_spelling(context) -> bool:
        return isinstance(context, magic_spelling) or getattr(getattr(context, "gen", None), "__name__", "") == "magic_spelling"

    with interrupt_at_an_exit(is_the_cells_spelling) as raised:
        run_cell(AMP, expect_error=KeyboardInterrupt)
    assert raised
    sys.last_type = sys.last_value = sys.last_traceback = None  # what kept the interrupted frames alive
    ip.run_cell("1")  # a next cell, as the user would run
    gc.collect()
    assert in_magic() is False
