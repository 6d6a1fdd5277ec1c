"""Property test: any sequence of magic calls leaves torch's global state as the user set it.

Hypothesis draws sequences of: the user changing global flags, and magic calls with random valid
options whose cells succeed, raise, or raise KeyboardInterrupt part-way through the runs. After
every step: torch's global state equals what the user set, IPython's event callbacks and
exception handlers are exactly the ones nbaccel documents (none from %%amp), a failed magic left
the namespace and RNG as before it, and a successful one applied the cell exactly once.
``NBACCEL_PROPERTY_EXAMPLES`` sets the number of sequences (CI: 20; the long run in docs/reliability.md: 300).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nbaccel.precision import global_state

EXAMPLES = int(os.environ.get("NBACCEL_PROPERTY_EXAMPLES", "20"))
RUNS = {"count": 0}


def _callbacks(ip):
    return {name: list(cbs) for name, cbs in ip.events.callbacks.items()}


class MagicSequences(RuleBasedStateMachine):
    ip = None  # set by the test below

    @initialize()
    def setup(self):
        self.ip.run_cell("import torch, types\nbox = types.SimpleNamespace(runs=0)\ncounter = 0\n"
                         "w = torch.zeros(4)\n")
        self.user_flags = {"benchmark": torch.backends.cudnn.benchmark, "grad": torch.is_grad_enabled(),
                           "deterministic": torch.backends.cudnn.deterministic}
        self.expected = global_state()
        self.callbacks = _callbacks(self.ip)
        self.custom = tuple(self.ip.custom_exceptions)
        RUNS["count"] += 1

    @rule(benchmark=st.booleans())
    def user_sets_cudnn_benchmark(self, benchmark):
        torch.backends.cudnn.benchmark = benchmark
        self.expected = global_state()

    @rule(dtype=st.sampled_from(["bf16", "auto"]), repeat=st.integers(1, 3), warmup=st.integers(0, 1),
          baseline=st.booleans(), fail=st.sampled_from([None, "error", "interrupt"]), fail_at=st.integers(1, 6),
          toggles=st.booleans())
    def amp(self, dtype, repeat, warmup, baseline, fail, fail_at, toggles):
        ns = self.ip.user_ns
        counter_before, w_before, rng_before = ns["counter"], ns["w"].clone(), torch.get_rng_state()
        deterministic_before = torch.backends.cudnn.deterministic
        raise_line = {None: "", "error": f"if box.runs == {fail_at}: raise ValueError('cell failed')\n",
                      "interrupt": f"if box.runs == {fail_at}: raise KeyboardInterrupt\n"}[fail]
        # A cell that flips a torch flag: each run must start from the flag as it was before the magic.
        toggle_line = "torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic\n" if toggles else ""
        cell = ("box.runs += 1\ncounter += 1\nw.add_(torch.rand(4))\n"
                "y = (torch.randn(8, 8) @ torch.randn(8, 8)).sum()\n" + toggle_line + raise_line)
        line = f"--dtype {dtype} --repeat {repeat} --warmup {warmup} -q" + ("" if baseline else " --no-baseline")
        ns["box"].runs = 0
        failed = None
        try:
            self.ip.run_cell_magic("amp", line, cell)
        except (ValueError, KeyboardInterrupt) as exc:
            failed = exc
        total_runs = ns["box"].runs
        if failed is not None:
            assert fail is not None and fail_at <= total_runs
            assert ns["counter"] == counter_before, "namespace changed by a failed magic"
            assert torch.equal(ns["w"], w_before), "tensor changed by a failed magic"
            assert torch.equal(torch.get_rng_state(), rng_before), "RNG changed by a failed magic"
            assert torch.backends.cudnn.deterministic == deterministic_before, "flag changed by a failed magic"
        else:
            assert ns["counter"] == counter_before + 1, "the cell must be applied exactly once"
            assert torch.backends.cudnn.deterministic == (deterministic_before != toggles), \
                "the cell's own flag change must be applied exactly once"
            self.expected = global_state()

    @rule(amp=st.sampled_from([None, "bf16"]), steps=st.integers(1, 2),
          fail=st.sampled_from([None, "error", "interrupt"]), fail_at=st.integers(1, 3))
    def profile(self, amp, steps, fail, fail_at):
        raise_line = {None: "", "error": f"if box.runs == {fail_at}: raise ValueError('cell failed')\n",
                      "interrupt": f"if box.runs == {fail_at}: raise KeyboardInterrupt\n"}[fail]
        cell = "box.runs += 1\ny = (torch.randn(8, 8) @ torch.randn(8, 8)).sum()\n" + raise_line
        line = f"--steps {steps} -q" + (f" --amp {amp}" if amp else "")
        self.ip.user_ns["box"].runs = 0
        try:
            self.ip.run_cell_magic("profile_gpu", line, cell)
        except (ValueError, KeyboardInterrupt):
            assert fail is not None and fail_at <= self.ip.user_ns["box"].runs
        assert not torch._C._autograd._profiler_enabled(), "a profiler was left running"

    @rule(budget=st.sampled_from(["2GiB", "0.5", "64MiB"]), strict=st.booleans())
    def budget_on_then_cells(self, budget, strict):
        self.ip.run_line_magic("memory_budget", f"{budget} -q" + (" --strict" if strict else ""))
        # While active, exactly nbaccel's two documented hooks are added, and one OOM handler.
        added = {name: len(cbs) - len(self.callbacks.get(name, [])) for name, cbs in _callbacks(self.ip).items()}
        assert added.get("pre_run_cell") == 1 and added.get("post_run_cell") == 1
        assert sum(added.values()) == 2
        self.ip.run_cell("small = torch.ones(1024)")
        self.ip.run_line_magic("memory_budget", "off -q")

    @rule()
    def unload_and_reload(self):
        self.ip.run_line_magic("unload_ext", "nbaccel")
        assert "amp" not in self.ip.magics_manager.magics["cell"]
        self.ip.run_line_magic("load_ext", "nbaccel")

    @invariant()
    def torch_state_is_what_the_user_set(self):
        if hasattr(self, "expected"):
            assert global_state() == self.expected

    @invariant()
    def no_hooks_or_handlers_left(self):
        if hasattr(self, "callbacks"):
            assert _callbacks(self.ip) == self.callbacks
            assert tuple(self.ip.custom_exceptions) == self.custom

    def teardown(self):
        if hasattr(self, "user_flags"):
            torch.backends.cudnn.benchmark = self.user_flags["benchmark"]
            torch.backends.cudnn.deterministic = self.user_flags["deterministic"]


def test_magic_sequences_leave_no_state_behind(ip):
    MagicSequences.ip = ip
    RUNS["count"] = 0
    runner = MagicSequences.TestCase
    runner.settings = settings(max_examples=EXAMPLES, stateful_step_count=6, deadline=None,
                               suppress_health_check=list(HealthCheck))
    runner().runTest()
    print(f"property test: {RUNS['count']} sequences")
    assert RUNS["count"] >= min(EXAMPLES, 5)
