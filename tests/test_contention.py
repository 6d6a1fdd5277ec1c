"""Contention: other programs' CPU use during the timed runs, measured (nbaccel.contention) and
reported by %%amp and %%profile_gpu. Scripted readers for the arithmetic; real busy processes for the mechanism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import nbaccel
from nbaccel.contention import MIN_OTHERS_CORES, MIN_WINDOW_S, Contention, ContentionMeter, ProcReader
from nbaccel.render import amp as amp_render
from nbaccel.render import profile as profile_render
from fake_clock import FakeClock
from text_helpers import unfolded

linux_only = pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
                                reason="contention is measured from Linux's /proc")


class Script:
    """Readers whose values advance by a fixed step at every reading: 'busy' and 'ours' in CPU-seconds
    per second of the scripted wall clock."""

    def __init__(self, busy_rate, ours_rate, step=0.1):
        self.t = self.busy = self.ours = 0.0
        self.busy_rate, self.ours_rate, self.step = busy_rate, ours_rate, step

    def now(self):
        # Every reading is (now, busy, ours): the clock moves first, the counters follow it.
        self.t += self.step
        rate = self.busy_rate() if callable(self.busy_rate) else self.busy_rate
        self.busy += rate * self.step
        self.ours += self.ours_rate * self.step
        return self.t

    def meter(self, cores=2, threads=2, load=None):
        return ContentionMeter(busy=lambda: self.busy, ours=lambda: self.ours, now=self.now, cores=cores,
                               threads=threads, load=load)


def test_busy_others_are_the_busy_time_minus_ours_per_second():
    script = Script(busy_rate=1.8, ours_rate=1.0)
    meter = script.meter()
    for _ in range(3):
        with meter.span("fp32"):
            pass
    c = meter.result
    assert c.wall_s["fp32"] == pytest.approx(0.3)
    assert c.others_cores("fp32") == pytest.approx(0.8)
    assert c.others_cores() == pytest.approx(0.8)
    assert c.contended and c.contended_spans() == [None, "fp32"]


def test_an_idle_machine_is_not_contended():
    script = Script(busy_rate=1.0, ours_rate=1.0)
    meter = script.meter()
    for name in ("fp32", "bf16", "fp32", "bf16"):
        with meter.span(name):
            pass
    assert meter.result.others_cores() == pytest.approx(0.0)
    assert not meter.result.contended


def test_others_fitting_beside_torchs_threads_are_not_contention():
    # 0.8 cores of others on 4 cores while torch uses 2 threads: the scheduler had idle cores for them.
    script = Script(busy_rate=2.8, ours_rate=2.0)
    meter = script.meter(cores=4, threads=2)
    for _ in range(3):
        with meter.span("fp32"):
            pass
    assert meter.result.others_cores() == pytest.approx(0.8)
    assert not meter.result.contended
    # ... and below the threshold on a full machine neither.
    small = Contention(cores=2, threads=2, wall_s={"fp32": 1.0}, others_s={"fp32": MIN_OTHERS_CORES * 0.9})
    assert not small.contended


def test_negative_deltas_are_clamped_to_nothing():
    # Our own time grew more than the machine's busy time (ticks rounded, a counter reset).
    script = Script(busy_rate=0.5, ours_rate=1.0)
    meter = script.meter()
    for _ in range(3):
        with meter.span("fp32"):
            pass
    assert meter.result.others_cores() == 0.0
    assert not meter.result.contended


def test_spans_shorter_than_a_tick_sum_signed_before_the_clamp():
    # A quiet machine, this process busy on one core, timed in 1 ms spans: /proc/stat moves in 10 ms
    # ticks, so one span in ten reads +10 ms of busy time and the rest read none, against our exact
    # 1 ms each. Clamping span by span kept the +9 ms and dropped the -1 ms: 0.9 cores of "others".
    clock = {"t": 0.0}

    def busy():
        return 0.010 * (clock["t"] // 0.010)

    meter = ContentionMeter(busy=busy, ours=lambda: clock["t"], now=lambda: clock["t"], cores=2, threads=2)
    for _ in range(300):
        with meter.span("fp32"):
            clock["t"] += 0.001
    assert meter.result.wall_s["fp32"] == pytest.approx(0.3)
    assert meter.result.others_cores("fp32") == pytest.approx(0.0, abs=0.04)  # one tick of rounding at most


def test_zero_or_short_wall_time_gives_no_figure():
    c = Contention(cores=2, threads=2, wall_s={"fp32": 0.0}, others_s={"fp32": 0.5})
    assert c.others_cores() is None and not c.contended
    c = Contention(cores=2, threads=2, wall_s={"fp32": MIN_WINDOW_S / 2}, others_s={"fp32": 0.1})
    assert c.others_cores("fp32") is None
    assert "contention: not measured (the timed runs lasted 100 ms in all" in c.summary()
    # a tiny step read "lasted 0 ms in all" (a user trial): the figure keeps its digits
    c = Contention(cores=2, threads=2, wall_s={"profiled steps": 0.00042}, others_s={})
    assert "contention: not measured (the timed runs lasted 420 µs in all" in c.summary()


def test_missing_proc_is_unknown_and_claims_nothing(tmp_path):
    meter = ContentionMeter(ProcReader(proc=str(tmp_path), cpus={0}))
    with meter.span("fp32"):
        time.sleep(MIN_WINDOW_S)
    c = meter.result
    assert c.unknown == "no /proc/stat on this OS"
    assert c.others_cores() is None and not c.contended and c.wall_s == {}
    assert c.summary() == "contention: not measured (no /proc/stat on this OS)"
    assert c.to_dict()["measured"] is False


def test_a_reader_that_fails_makes_it_unknown_not_an_error():
    def broken():
        raise OSError("gone")

    meter = ContentionMeter(busy=broken, ours=lambda: 0.0, cores=2, threads=2)
    with meter.span("fp32"):
        pass
    assert meter.result.unknown == "reading /proc failed: OSError: gone"
    assert not meter.result.contended


def test_proc_files_are_read_for_the_usable_cpus_only(tmp_path):
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # user nice system idle iowait irq softirq steal guest guest_nice
    (tmp_path / "stat").write_text("cpu  999 0 0 0 0 0 0 0 0 0\n"
                                   "cpu0 10 1 2 500 7 3 4 5 0 0\n"
                                   "cpu1 100 0 0 400 0 0 0 0 0 0\n"
                                   "cpu2 1000 0 0 0 0 0 0 0 0 0\n"
                                   "intr 1 2 3\n")
    reader = ProcReader(proc=str(tmp_path), cpus={0, 1})
    assert reader.available() is None
    # idle and iowait are not busy; steal is; cpu2 is not this process's to use
    assert reader.busy() == pytest.approx((10 + 1 + 2 + 3 + 4 + 5 + 100) / hz)
    # a process name may hold spaces and parentheses: the fields are read after the last ')'
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text("77 (a (b) c) S 1 77 77 0 -1 0 0 0 0 0 30 20 6 4 20 0 1 0\n")
    assert reader._pid_seconds(77) == pytest.approx((30 + 20 + 6 + 4) / hz)
    assert reader._pid_seconds(78) == 0.0  # ended: its time is in its parent's now


def test_without_children_files_the_descendants_alive_at_the_start_are_found(tmp_path):
    # Some kernels (CONFIG_PROC_CHILDREN off) have no /proc/<pid>/task/<tid>/children: one scan of
    # every /proc/<pid>/stat finds this process's children and theirs by parent pid.
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    me = os.getpid()

    def proc(pid, ppid, ticks):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python) S {ppid} 0 0 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0\n")

    proc(me, 1, 0)
    proc(me + 100001, me, 30)  # a worker
    proc(me + 100002, me + 100001, 20)  # the worker's own child
    proc(me + 100003, 1, 500)  # another program
    reader = ProcReader(proc=str(tmp_path), cpus={0})
    assert reader._known == {me + 100001, me + 100002}
    before = time.process_time()
    assert reader.ours() >= before + (30 + 20) / hz
    assert "child processes started during the timed runs count as other programs" in reader.method


def _scripted_amp(busy_rate, device_threads=2, cores=2, **kwargs):
    """compare_amp on a real cell with a fake clock and scripted contention readers."""
    script = Script(busy_rate=busy_rate, ours_rate=1.0)
    clock = FakeClock(lambda: 0.010 if torch.is_autocast_enabled("cpu") else 0.030)
    x = torch.randn(16, 64)
    w = torch.randn(64, 64)
    return nbaccel.compare_amp(lambda: (x @ w).sum(), repeat=4, warmup=0, clock=clock,
                               contention_meter=script.meter(cores=cores, threads=device_threads), **kwargs)


def test_the_warning_suggests_fewer_threads_only_where_torch_has_more_than_the_free_cores():
    from nbaccel.contention import Contention, warning_line

    def line(cores, threads, others):
        c = Contention(cores=cores, threads=threads, wall_s={"fp32": 1.0}, others_s={"fp32": others})
        return warning_line(c, "during the timed runs", "the times include it")

    assert line(2, 2, 1.0).endswith("re-run when the machine is quiet, or give torch only the cores left free: "
                                    "torch.set_num_threads(1) (it uses 2; torch.set_num_threads(2) puts it back)")
    assert line(16, 16, 6.0).endswith("torch.set_num_threads(10) (it uses 16; torch.set_num_threads(16) puts it back)")
    assert line(4, 1, 3.5).endswith("re-run when the machine is quiet")  # one thread: nothing to give back
    assert line(2, 2, 1.9).endswith("torch.set_num_threads(1) (it uses 2; torch.set_num_threads(2) puts it back)")


def test_amp_warns_with_the_figures_per_variant_in_text_html_and_widget():
    # The fp32 runs were contended (others 1.3 cores), the bf16 ones were not (0.1): exactly what
    # makes a large, confident, bogus speedup.
    result = _scripted_amp(lambda: 1.1 if torch.is_autocast_enabled("cpu") else 2.3)
    c = result.contention
    assert c.others_cores("fp32") == pytest.approx(1.3) and c.others_cores("bf16") == pytest.approx(0.1)
    warning = ("other programs used 0.7 of the 2 CPU cores this process may use (fp32 runs: 1.3, bf16 runs: 0.1) "
               "during the timed runs: the times include that contention and the speedup may not hold; "
               "re-run when the machine is quiet, or give torch only the cores left free: torch.set_num_threads(1) "
               "(it uses 2; torch.set_num_threads(2) puts it back)")
    assert result.noise_warnings == [warning]
    assert result.contention_warning == warning
    text = unfolded(result)
    assert "WARNING: " + warning in text
    assert "speedup 3.0x (contended)" in text
    assert "is 3.00x faster here" not in text and "measured 3.0x faster, but while other programs" in text
    method = text.split("method: ")[1]
    assert "contention: other programs used 0.7 of the 2 CPU cores" in method and "torch using 2 threads" in method
    html = result._repr_html_()
    assert warning in html and "contention: other programs used" in html
    box = amp_render.widget(result)
    assert warning in box.children[0].value and "contention: other programs used" in box.children[-1].value
    data = json.loads(result.to_json(allow_nan=False))["contention"]
    assert data["contended"] is True and data["cores"] == 2 and data["torch_threads"] == 2
    assert data["spans"]["fp32"]["others_cores"] == pytest.approx(1.3)
    assert data["spans"]["bf16"]["others_cores"] == pytest.approx(0.1)
    assert data["threshold_cores"] == MIN_OTHERS_CORES


def test_amp_on_a_quiet_machine_says_it_measured_and_warns_nothing():
    result = _scripted_amp(1.0)
    assert result.contention_warning is None and result.noise_warnings == []
    assert "is 3.00x faster here" in " ".join(result.advice)
    assert "contention: other programs used 0.0 of the 2 CPU cores" in unfolded(str(result).split("method: ")[1])
    assert result.to_dict()["contention"]["contended"] is False


def test_cuda_wording_names_the_host_side_delays():
    import dataclasses

    result = _scripted_amp(2.0)
    result.device = dataclasses.replace(result.device, type="cuda")
    assert "the times include the host-side delays it causes (kernel launches, Python, data loading)" in \
        result.contention_warning


def test_a_result_made_without_a_meter_says_contention_was_not_measured():
    result = _scripted_amp(2.0)
    result.contention = None
    assert result.contention_warning is None
    assert "contention: not measured" in amp_render.method(result)
    assert result.to_dict()["contention"] is None


# --- %%profile_gpu: one span around the active steps ----------------------------------------------

PROFILE_SETUP = "import torch\nx = torch.randn(32, 32)\nruns = 0"
PROFILE_CELL = "%%profile_gpu {opts} -r prof\nruns += 1\n(x @ x).sum()\n"


def _scripted_profile(run_cell, ip, monkeypatch, busy_rate, opts="", step=0.3, at=None, load=None):
    """%%profile_gpu through the shell with the meter's readers scripted (ours: 1 core, busy: busy_rate)."""
    script = Script(busy_rate=busy_rate, ours_rate=1.0, step=step)
    if at is not None:  # note how many runs of the cell had happened at each reading
        tick = script.now
        script.now = lambda: (at.append(ip.user_ns["runs"]), tick())[1]
    monkeypatch.setattr(sys.modules["nbaccel.profile"], "ContentionMeter", lambda: script.meter(load=load))
    run_cell(PROFILE_SETUP)
    _, captured = run_cell(PROFILE_CELL.format(opts=opts))
    return ip.user_ns["prof"], captured


def test_profile_warns_with_the_figure_in_text_html_widget_and_dict(run_cell, ip, monkeypatch):
    prof, captured = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=2.0)
    warning = ("other programs used 1.0 of the 2 CPU cores this process may use while the cell was profiled: the "
               "CPU times include that contention; re-run when the machine is quiet, or give torch only the cores "
               "left free: torch.set_num_threads(1) (it uses 2; torch.set_num_threads(2) puts it back)")
    assert prof.contention_warning == warning
    data = [o.data for o in captured.outputs if "text/html" in o.data][0]
    text = unfolded(data["text/plain"])
    assert "WARNING: " + warning in text
    method = text.split("method: ")[1]
    assert ("contention: other programs used 1.0 of the 2 CPU cores this process may use while the cell was "
            "profiled, torch using 2 threads (injected readers)") in method
    assert warning in data["text/html"] and "contention: other programs used 1.0" in data["text/html"]
    box = profile_render.widget(prof)
    assert warning in box.children[0].value and "contention: other programs used 1.0" in box.children[-1].value
    saved = json.loads(prof.to_json(allow_nan=False))["contention"]
    assert saved["contended"] is True and saved["others_cores"] == pytest.approx(1.0)
    assert list(saved["spans"]) == ["profiled steps"] and saved["threshold_cores"] == MIN_OTHERS_CORES


def test_profile_on_a_quiet_machine_states_the_figure_and_warns_nothing(run_cell, ip, monkeypatch):
    prof, captured = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=1.1)
    text = captured.outputs[0].data["text/plain"]
    assert prof.contention_warning is None and "WARNING" not in text
    assert "contention: other programs used 0.1 of the 2 CPU cores" in unfolded(text.split("method: ")[1])
    assert prof.to_dict()["contention"]["contended"] is False


def test_a_short_profile_says_contention_was_not_measured(run_cell, ip, monkeypatch):
    prof, captured = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=2.0, step=0.05)
    assert prof.contention_warning is None
    assert ("contention: not measured (the profiled steps lasted 50 ms in all, under the 0.2 s"
            in unfolded(captured.outputs[0].data["text/plain"].split("method: ")[1]))


def test_a_short_profile_on_a_busy_machine_says_so_from_the_load_average(run_cell, ip, monkeypatch):
    """A trial: a 65 ms step on a VM at load 3.9 on 2 cores ranked the ops by the time slices they lost, and the
    method line said only "not measured". The kernel's 1-minute load average, read as the meter is made, says
    the machine was busy; the advice says how many steps would measure it. Below cores + 1 nothing is said."""
    prof, captured = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=2.0, step=0.05, load=lambda: 3.9)
    method = unfolded(captured.outputs[0].data["text/plain"].split("method: ")[1])
    assert ("contention: not measured (the profiled steps lasted 50 ms in all, under the 0.2 s that /proc/stat's "
            "10 ms ticks need; the 1-minute load average was 3.9 on 2 cores as they began, so other programs were "
            "most likely taking CPU time)") in method
    note = next(a for a in prof.advice if a.startswith("The machine's 1-minute load average"))
    assert note == ("The machine's 1-minute load average was 3.9 on the 2 CPU cores this process may use as the "
                    "profile began, and the profiled 50 ms were too short to measure what other programs took (0.2 s "
                    "is needed): op times here can include time slices lost to them. --steps 4 profiles long enough "
                    "to measure it.")
    assert prof.to_dict()["contention"]["load_average"] == 3.9
    for load in (2.9, None):  # one runnable task above the cores is this process's own; no reading: no claim
        prof, captured = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=2.0, step=0.05,
                                           load=(lambda: load) if load else None)
        assert not any(a.startswith("The machine's") for a in prof.advice)
        assert "load average" not in captured.outputs[0].data["text/plain"]


def test_the_span_covers_the_active_steps_only_and_is_read_twice(run_cell, ip, monkeypatch):
    # --warmup 2 --steps 3: read once after the 2 warmup runs, once after the 5th run; never per op
    at = []
    prof, _ = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=1.0, opts="--warmup 2 --steps 3", at=at)
    assert ip.user_ns["runs"] == 5 and at == [2, 5]
    assert prof.contention.wall_s == {"profiled steps": pytest.approx(0.3)}


def test_profile_on_cuda_says_kernel_durations_are_not_affected(run_cell, ip, monkeypatch):
    import dataclasses

    prof, _ = _scripted_profile(run_cell, ip, monkeypatch, busy_rate=2.0)
    prof.device = dataclasses.replace(prof.device, type="cuda")
    assert "host-side delays it causes (kernel launches, Python, data loading); kernel durations do not" in \
        prof.contention_warning


def test_a_loaded_trace_claims_no_contention_figure():
    loaded = nbaccel.load_trace(os.path.join(os.path.dirname(__file__), "data", "h200_bf16_transformer_step.json.gz"))
    assert loaded.contention is None and loaded.contention_warning is None
    assert "contention from other programs: not measured (loaded trace)" in profile_render.method(loaded)
    assert "WARNING" not in str(loaded) and loaded.to_dict()["contention"] is None


# --- real processes -------------------------------------------------------------------------------

@pytest.fixture
def other_programs():
    """Start busy loops that are not this process's descendants (another program, as far as the
    meter can tell): a short-lived parent starts them and exits, so they are re-parented away."""
    pids = []

    def start(n=1):
        code = ("import subprocess, sys\n"
                f"for _ in range({n}):\n"
                "    print(subprocess.Popen([sys.executable, '-c', 'while True: pass'], stdin=subprocess.DEVNULL, "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
        pids.extend(int(p) for p in out.stdout.split())
        time.sleep(0.3)  # the interpreters start spinning
        return pids

    yield start
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@linux_only
def test_a_busy_program_is_measured(other_programs):
    other_programs(1)
    meter = ContentionMeter()
    with meter.span("sleep"):
        time.sleep(1.0)
    # Sleeping, this process leaves its cores to the busy loop (and whatever else runs here): the
    # loop alone keeps one core busy, at least its fair share of one among any others' load.
    assert meter.result.others_cores() >= 0.5


@linux_only
def test_a_busy_child_is_counted_as_ours():
    # A DataLoader worker is the cell's own work: a child's CPU time goes to "ours", not to others.
    # Checked against the child's own counters, which holds however loaded the machine is.
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        reader = ProcReader()
        child_before, ours_before = reader._pid_seconds(child.pid), reader.ours()
        time.sleep(0.7)
        ours_after, child_after = reader.ours(), reader._pid_seconds(child.pid)
    finally:
        child.kill()
        child.wait()
    assert child_after - child_before > 0.05, "the child did not run"
    assert ours_after - ours_before >= (child_after - child_before) - 0.03  # 10 ms ticks, read twice each


@linux_only
def test_amp_magic_warns_when_other_programs_compete(run_cell, other_programs):
    # Two busy loops: with torch's threads they need more cores than a 2-core CI machine has, and
    # on a larger machine at least the two cores they keep busy are counted.
    if 2 + torch.get_num_threads() <= len(os.sched_getaffinity(0)):
        pytest.skip("this machine has idle cores for two busy loops beside torch's threads")
    other_programs(2)
    run_cell("import time, torch\nx = torch.randn(64, 64)")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\ntime.sleep(0.1)\n(x @ x).sum()\n")
    text = unfolded(captured.outputs[0].data["text/plain"])
    assert "WARNING: other programs used" in text and "re-run when the machine is quiet" in text
    assert "contention: other programs used" in text.split("method: ")[1]


@linux_only
def test_profile_magic_warns_when_other_programs_compete(run_cell, other_programs):
    if 2 + torch.get_num_threads() <= len(os.sched_getaffinity(0)):
        pytest.skip("this machine has idle cores for two busy loops beside torch's threads")
    other_programs(2)
    run_cell("import time, torch\nx = torch.randn(64, 64)")
    _, captured = run_cell("%%profile_gpu\ntime.sleep(0.3)\n(x @ x).sum()\n")
    text = unfolded(captured.outputs[0].data["text/plain"])
    assert "WARNING: other programs used" in text and "while the cell was profiled" in text
    assert "contention: other programs used" in text.split("method: ")[1]


def test_a_contended_slowdown_is_not_given_a_confident_cause():
    # Was: "No speedup (0.33x): the work is too small or memory-bound ... try a larger batch" while
    # the warning above it said other programs took the CPU from the bf16 runs.
    script = Script(busy_rate=lambda: 2.3 if torch.is_autocast_enabled("cpu") else 1.1, ours_rate=1.0)
    clock = FakeClock(lambda: 0.030 if torch.is_autocast_enabled("cpu") else 0.010)
    x, w = torch.randn(16, 64), torch.randn(64, 64)
    result = nbaccel.compare_amp(lambda: (x @ w).sum(), repeat=4, warmup=0, clock=clock,
                                 contention_meter=script.meter(cores=2, threads=2))
    assert result.contention_warning is not None and not result.speedup_uncertain
    advice = " ".join(result.advice)
    assert ("No speedup measured (0.33x), but other programs competed for the CPU (see the warning): re-run when "
            "the machine is quiet.") in advice
    assert "No speedup (" not in advice and "memory-bound" not in advice and "larger batch" not in advice


def test_the_thread_count_is_the_one_the_measured_code_ran_with():
    """A trial: a cell that called torch.set_num_threads(1) read "torch using 2 threads" (the count was read
    before the cell ran). It is read again as each span ends; one thread is "1 thread"."""
    script = Script(busy_rate=1.0, ours_rate=1.0, step=0.5)
    before = torch.get_num_threads()
    meter = ContentionMeter(busy=lambda: script.busy, ours=lambda: script.ours, now=script.now, cores=2)
    try:
        with meter.span("fp32"):
            torch.set_num_threads(1)
    finally:
        torch.set_num_threads(before)
    assert meter.result.threads == 1 and "torch using 1 thread (" in meter.result.summary()
    assert ContentionMeter(busy=lambda: 0.0, ours=lambda: 0.0, now=script.now, cores=2, threads=2).result.threads == 2


# --- a launch of several ranks on one machine (torchrun) ---------------------------------------------

def test_the_launchs_other_ranks_are_counted_apart_from_other_programs():
    """A trial under torchrun (2 ranks, 2 cores): rank 0 read "other programs used 1.4 of the 2 cores ...
    re-run when the machine is quiet", 1.0 of it rank 1. The other ranks' CPU time is kept apart and said so."""
    script = Script(busy_rate=2.0, ours_rate=1.0)
    ranks = {"s": 0.0}

    def siblings():
        ranks["s"] = script.t * 0.9  # the other rank kept 0.9 of a core busy
        return ranks["s"]

    meter = ContentionMeter(busy=lambda: script.busy, ours=lambda: script.ours, now=script.now, cores=2, threads=1,
                            siblings=siblings, sibling_ranks=1)
    for _ in range(3):
        with meter.span("fp32"):
            pass
    c = meter.result
    assert c.others_cores() == pytest.approx(0.1) and c.siblings_cores() == pytest.approx(0.9)
    assert not c.contended
    assert ("contention: other programs used 0.1 of the 2 CPU cores this process may use, torch using 1 thread, "
            "and this launch's 1 other rank on this machine 0.9 (counted apart) (injected readers)") == c.summary()
    data = c.to_dict()
    assert data["sibling_ranks"] == 1 and data["sibling_ranks_cores"] == pytest.approx(0.9)
    assert data["spans"]["fp32"]["sibling_ranks_cpu_s"] == pytest.approx(0.27)
    # Others that do compete still warn, with the ranks' cores in the demand: 0.3 + 0.9 + 1 thread > 2 cores.
    script2 = Script(busy_rate=2.2, ours_rate=1.0)
    meter = ContentionMeter(busy=lambda: script2.busy, ours=lambda: script2.ours, now=script2.now, cores=2,
                            threads=1, siblings=lambda: script2.t * 0.9, sibling_ranks=1)
    for _ in range(3):
        with meter.span("fp32"):
            pass
    assert meter.result.others_cores() == pytest.approx(0.3) and meter.result.contended
    assert meter.result.figures() == "0.3 of the 2 CPU cores this process may use"


def test_outside_a_launch_no_rank_is_named():
    c = Script(busy_rate=1.5, ours_rate=1.0).meter().result
    assert c.sibling_ranks == 0 and c.siblings_cores() is None and "rank" not in c.summary()


def _fake_proc(tmp_path, me, parent, procs):
    """A /proc tree: pid -> (ppid, ticks, environ entries)."""
    (tmp_path / "stat").write_text("cpu0 0 0 0 0 0 0 0 0 0 0\n")
    for pid, (ppid, ticks, env) in {me: (parent, 0, ["LOCAL_WORLD_SIZE=2", "LOCAL_RANK=0"]), **procs}.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python) S {ppid} 0 0 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0\n")
        (tmp_path / str(pid) / "environ").write_bytes(b"\0".join(e.encode() for e in env) + b"\0")


def test_the_other_ranks_are_the_launchers_children_with_the_launchs_environment(tmp_path, monkeypatch):
    # A Jupyter server's other kernels are its children too, and they are other programs: the environment tells.
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    me, parent = os.getpid(), os.getppid()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rank1, kernel, stranger = me + 100001, me + 100002, me + 100003
    _fake_proc(tmp_path, me, parent, {rank1: (parent, 40, ["LOCAL_WORLD_SIZE=2", "LOCAL_RANK=1"]),
                                      kernel: (parent, 500, ["JPY_PARENT_PID=1"]),
                                      stranger: (1, 900, ["LOCAL_WORLD_SIZE=2", "LOCAL_RANK=1"])})
    reader = ProcReader(proc=str(tmp_path), cpus={0})
    assert reader.sibling_ranks == [rank1]
    assert reader.siblings() == pytest.approx(40 / hz)
    assert "this launch's other ranks: its launcher's other child processes with LOCAL_RANK set" in reader.method
    # The rank ends: its last reading stays, so its lifetime is not handed to "other programs".
    (tmp_path / str(rank1) / "stat").unlink()
    assert reader.siblings() == pytest.approx(40 / hz)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ProcReader(proc=str(tmp_path), cpus={0}).sibling_ranks == []


@linux_only
def test_a_busy_sibling_rank_is_measured_apart(tmp_path):
    """Two real processes started by one parent with torchrun's variables: the one that measures sees the
    other's busy loop as this launch's rank, not as another program."""
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], env={**env, "LOCAL_RANK": "1"})
    code = ("import json, time\nfrom nbaccel.contention import ContentionMeter\n"
            "meter = ContentionMeter(threads=1)\n"
            "with meter.span('sleep'):\n    time.sleep(1.0)\n"
            "print(json.dumps(meter.result.to_dict()))\n")
    try:
        time.sleep(0.3)  # the loop starts spinning
        out = subprocess.run([sys.executable, "-c", code], env={**env, "LOCAL_RANK": "0"}, capture_output=True,
                             text=True, timeout=60, check=True)
    finally:
        busy.kill()
        busy.wait()
    data = json.loads(out.stdout)
    assert data["sibling_ranks"] == 1
    # The loop keeps one core busy, at least its fair share of one among anything else running here (what
    # else runs is not this test's to bound: a CI run beside another test suite read others at 1.0 too).
    assert data["sibling_ranks_cores"] >= 0.5
