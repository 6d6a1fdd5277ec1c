"""nbaccel's dispatch modes leave torch.compile'd code compiled (`nbaccel.eager_modes`).

A trial: after one %%amp (its op audit is a TorchDispatchMode) a compiled encoder ran eagerly for the rest
of the session, and so did a fresh torch.compile of another module of the same class; the estimator's dry
run did the same. A counting backend shows whether the compiled graph runs, without inductor's compile time.
"""

from __future__ import annotations

import pytest
import torch

import nbaccel
from nbaccel.dry_run import LiveBytes
from nbaccel.flops import OpAudit


class Counting:
    def __init__(self):
        self.runs = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run

    def graph_runs(self, fn, *args) -> int:
        before = self.runs
        fn(*args)
        return self.runs - before


def _model():
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))


@pytest.fixture
def compiled():
    torch._dynamo.reset()  # no skip marks or graphs from other tests
    backend = Counting()
    model = torch.compile(_model(), backend=backend)
    x = torch.randn(4, 16)
    assert backend.graph_runs(model, x) == 1  # compiles and runs its graph
    yield backend, model, x
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", [OpAudit, LiveBytes])
def test_compiled_code_runs_eagerly_under_a_mode_and_compiled_after_it(compiled, mode):
    backend, model, x = compiled
    with mode():
        assert backend.graph_runs(model, x) == 0  # eager while the mode is on, as dynamo would run it anyway
    assert backend.graph_runs(model, x) == 1
    # the code object is not marked skipped: a new compile of the same class compiles
    other = torch.compile(_model(), backend=backend)
    assert backend.graph_runs(other, x) == 1


def test_compare_amp_leaves_the_model_compiled(compiled):
    backend, model, x = compiled
    nbaccel.compare_amp(lambda: model(x), dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert backend.graph_runs(model, x) == 1


def test_estimate_memory_leaves_the_model_compiled(compiled):
    backend, model, x = compiled
    nbaccel.estimate_memory(model, optimizer="sgd", batch=4, example=x, device="cpu")
    assert backend.graph_runs(model, x) == 1


def test_the_stance_is_put_back_when_the_code_raises(compiled):
    backend, model, x = compiled
    with pytest.raises(ZeroDivisionError):
        with OpAudit():
            1 / 0
    assert backend.graph_runs(model, x) == 1
