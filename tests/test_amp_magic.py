"""%%amp through a real InteractiveShell: options, restore guarantees, faults, display."""

from __future__ import annotations

import json
import re

import pytest
import torch
from IPython.core.error import UsageError

import nbaccel
import nbaccel.snapshot
from nbaccel.render import display as display_module
from text_helpers import note_lines, unfolded

TRAIN = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
x = torch.randn(32, 64)
y = torch.randint(0, 8, (32,))
counter = 0
losses = []
w0 = model[0].weight.detach().clone()
"""

STEP = """%%amp --repeat 3 --warmup 1 -r res {opts}
counter += 1
opt.zero_grad()
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
opt.step()
sched.step()
losses.append(loss.item())
print("printed by the cell")
loss
"""


def test_training_step_is_applied_exactly_once(ip, run_cell):
    run_cell(TRAIN)
    result, captured = run_cell(STEP.format(opts=""))
    ns = ip.user_ns
    assert ns["counter"] == 1
    assert len(ns["losses"]) == 1
    assert ns["sched"].last_epoch == 1
    assert ns["opt"].param_groups[0]["lr"] == pytest.approx(0.05)
    # Exactly one SGD step from w0: recompute it by hand under the same recipe.
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    ref.load_state_dict({k: v for k, v in ref.state_dict().items()})
    ref[0].weight.data.copy_(ns["w0"])
    assert not torch.equal(ns["model"][0].weight, ns["w0"]), "the kept run must have stepped the model"
    momentum = ns["opt"].state[ns["model"][0].weight]["momentum_buffer"]
    # After one step with momentum 0.9 from an empty buffer, the buffer equals the gradient.
    torch.testing.assert_close(ns["model"][0].weight, ns["w0"] - 0.1 * momentum)
    # The cell's output is shown once, and its last value is the cell's result.
    assert captured.stdout.count("printed by the cell") == 1
    assert isinstance(result.result, torch.Tensor)
    res = ns["res"]
    assert res.baseline is not None and len(res.baseline.times.times) == 3
    assert res.speedup is not None and res.speedup > 0


def test_namespace_bindings_restored_between_runs(run_cell, ip):
    run_cell("n = 0\nitems = []\n")
    run_cell("%%amp --repeat 2 --warmup 0 -q\nn = n + 1\nnew_name = n\nitems.append(n)\n")
    assert ip.user_ns["n"] == 1
    assert ip.user_ns["items"] == [1]
    assert ip.user_ns["new_name"] == 1


def test_mime_bundle_has_widget_html_and_text(run_cell, monkeypatch):
    monkeypatch.setattr(display_module, "WIDGETS", "always")
    run_cell(TRAIN)
    _, captured = run_cell(STEP.format(opts=""))
    bundles = [o.data for o in captured.outputs if "text/html" in o.data]
    assert bundles, "no rich output was displayed"
    data = bundles[0]
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "speedup" in data["text/html"]
    assert "speedup" in data["text/plain"] and "fp32" in data["text/plain"]


def test_quiet_displays_nothing_but_stores_result(run_cell, ip):
    run_cell(TRAIN)
    _, captured = run_cell(STEP.format(opts="-q"))
    assert not [o for o in captured.outputs if "text/html" in o.data]
    assert ip.user_ns["res"].amp.name in ("bf16", "fp16")


def test_no_baseline_runs_only_the_recipe(run_cell, ip):
    run_cell(TRAIN)
    run_cell(STEP.format(opts="--no-baseline -q"))
    res = ip.user_ns["res"]
    assert res.baseline is None and res.speedup is None
    assert ip.user_ns["counter"] == 1


@pytest.mark.parametrize("dtype, expected", [
    ("bfloat16", torch.bfloat16),
    ("torch.bfloat16", torch.bfloat16), ("torch.float16", torch.float16),  # as code writes them (a user trial)
])
def test_long_dtype_names_work_in_the_magic(run_cell, ip, dtype, expected, cpu_with_bf16_and_fp16_units):
    run_cell("import torch\nx = torch.randn(16, 16)")
    run_cell(f"%%amp --dtype {dtype} --device cpu --repeat 1 --warmup 0 -q -r res\nx @ x")
    assert ip.user_ns["res"].amp.recipe.autocast_dtype is expected


def test_bf16_ops_reported_on_cpu(run_cell, ip):
    run_cell(TRAIN)
    run_cell(STEP.format(opts="--dtype bf16 --device cpu -q"))
    res = ip.user_ns["res"]
    assert "aten::addmm" in res.precision["reduced"]
    assert res.amp.flops > 0
    assert res.drift is not None and res.drift["max_rel"] < 0.1
    assert any("CPU" in a for a in res.advice)
    assert res.gradients["tensors_with_grad"] == 4


@pytest.mark.parametrize("line, message", [
    ("--dtype fp8", "--dtype fp8 is not supported"),
    ("--repeat 0", "--repeat must be at least 1"),
    ("--warmup -1", "--warmup must be at least 0"),
    ("--bogus", "unrecognized arguments"),
    ("-r 1abc", "-r/--result takes a Python variable name"),
    ("-r class", "-r/--result takes a Python variable name, got 'class'"),
    ("-r __builtins__", "would replace one of Python's own names"),
])
def test_bad_input_is_a_usage_error_and_the_cell_does_not_run(run_cell, ip, line, message):
    run_cell("ran = 0")
    _, captured = run_cell(f"%%amp {line}\nran += 1\n", expect_error=UsageError)
    assert ip.user_ns["ran"] == 0
    assert message in unfolded(captured.stderr) + captured.stdout  # what IPython shows the user
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("amp", line, "ran += 1")
    assert ip.user_ns["ran"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_gpu_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="sees no CUDA GPU"):
        ip.run_cell_magic("amp", "--device cuda", "1")
    with pytest.raises(UsageError, match="TF32 needs a CUDA GPU"):
        ip.run_cell_magic("amp", "--dtype tf32", "1")


def test_empty_cell_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="needs code"):
        ip.run_cell_magic("amp", "", "  \n")
    # A user trial: a comment-only %%amp cell ran 21 times and reported "plain Python timed: 0.77x".
    with pytest.raises(UsageError, match=r"needs code in the cell below the magic line \(it has only comments\)"):
        ip.run_cell_magic("amp", "", "# model(x) once it is defined\n  # nothing else\n")


def test_fp16_on_a_cpu_without_fp16_units_is_refused(ip, monkeypatch):
    import nbaccel.magics.amp as amp_magic
    from nbaccel.device import DeviceInfo

    monkeypatch.setattr(amp_magic, "device_info", lambda d: DeviceInfo("cpu", None, "old cpu", supports_bf16=True))
    with pytest.raises(UsageError, match="no fp16 arithmetic units") as refused:
        ip.run_cell_magic("amp", "--dtype fp16 --device cpu", "1")
    # A trial on an Ice Lake: told to use bf16, which has no units there either.
    emulated = (" (or add --emulated to see fp16's drift and gradient overflow/underflow here, in runs many times "
                "slower: not its speed)")
    assert str(refused.value).endswith("use --dtype bf16 on the CPU (it has no bf16 units either: bf16 shows its drift "
                                       "here, not its speed; measure speed on a GPU)" + emulated)
    with_bf16 = DeviceInfo("cpu", None, "newer cpu", supports_bf16=True, cpu_features={"amx_bf16": True})
    monkeypatch.setattr(amp_magic, "device_info", lambda d: with_bf16)
    with pytest.raises(UsageError, match=r"many times slower than fp32; use --dtype bf16 on the CPU \(or add --emulated"):
        ip.run_cell_magic("amp", "--dtype fp16 --device cpu", "1")


def test_emulated_fp16_gives_its_gradient_report_on_a_cpu_without_fp16_units(run_cell, ip, cpu_without_bf16_units):
    """The fp16 training report (overflow, underflow, GradScaler) was out of reach on every CPU without fp16 units,
    this project's CI among them: --emulated runs it, and every place the speed shows says it is not fp16's."""
    import nbaccel

    run_cell("import torch\ntorch.manual_seed(0)\nm = torch.nn.Linear(16, 4)\nx = torch.randn(8, 16)\n"
             "opt = torch.optim.SGD(m.parameters(), lr=0.1)")
    step = "opt.zero_grad()\nloss = m(x).square().mean()\nloss.backward()\nopt.step()\nloss"
    result, _ = run_cell(f"%%amp --dtype fp16 --repeat 3 --warmup 0\n{step}", expect_error=UsageError)
    assert "or add --emulated" in str(result.error_in_exec)
    run_cell(f"%%amp --dtype fp16 --emulated --repeat 3 --warmup 0 -q -r res\n{step}")
    res = ip.user_ns["res"]
    assert res.amp.name == "fp16" and res.amp.recipe.emulated and res.to_dict()["amp"]["emulated"] is True
    text = unfolded(str(res))
    assert re.search(r"fp16 +autocast fp16 \(cpu, emulated\)", text)
    assert "fp16 emulated: not its speed on fp16 hardware" in text.splitlines()[0]
    assert "overflow (inf/NaN): 0 tensors" in text and "underflow:" in text
    assert any(a.startswith("fp16 training without torch.amp.GradScaler") for a in res.advice)
    # the API's spelling: emulated=True, named so in the refusal
    m, x = ip.user_ns["m"], ip.user_ns["x"]
    with pytest.raises(nbaccel.DeviceError, match=r"or add emulated=True to see fp16's drift"):
        nbaccel.compare_amp(lambda: m(x), dtype="fp16", device="cpu", repeat=3)
    with pytest.raises(TypeError, match=r"emulated takes True or False, got 'yes'"):
        nbaccel.compare_amp(lambda: m(x), dtype="fp16", device="cpu", repeat=3, emulated="yes")
    assert nbaccel.compare_amp(lambda: m(x), dtype="fp16", device="cpu", repeat=3, warmup=0, emulated=True).amp.recipe.emulated


def test_fp16_refused_by_profile_gpu_promises_no_drift(ip, cpu_without_bf16_units):
    # A trial: %%profile_gpu --amp fp16 was told "bf16 shows its drift here"; a profile shows no drift.
    with pytest.raises(UsageError) as refused:
        ip.run_cell_magic("profile_gpu", "--amp fp16 --device cpu", "1")
    assert str(refused.value).endswith("use --amp bf16 on the CPU (it has no bf16 units either: bf16 shows which ops "
                                       "run in it here, not its speed; measure speed on a GPU)"), str(refused.value)


def test_exception_in_cell_restores_state_and_propagates(run_cell, ip):
    run_cell(TRAIN)
    # A plain object's attributes are not snapshotted (documented), so it counts the runs.
    run_cell("import types\nbox = types.SimpleNamespace(runs=0)\ncalls = []")
    cell = "%%amp --repeat 2\nbox.runs += 1\ncalls.append(1)\ncounter += 1\nmodel[0].weight.data.add_(1.0)\n" \
           "if box.runs == 3: raise RuntimeError('boom in run 3')\n"
    result, _ = run_cell(cell, expect_error=RuntimeError)
    assert "boom in run 3" in str(result.error_in_exec)
    ns = ip.user_ns
    assert ns["counter"] == 0
    assert ns["calls"] == [], "the namespace must be the one from before the magic"
    torch.testing.assert_close(ns["model"][0].weight, ns["w0"])


def test_keyboard_interrupt_restores_state_and_is_reraised(ip, run_cell):
    run_cell(TRAIN)
    run_cell("import types\nbox = types.SimpleNamespace(runs=0)\nk = 0")
    # Interrupt the 4th run, in the middle of the timed rounds, while autocast is on.
    cell = "k += 1\nbox.runs += 1\nmodel[0].weight.data.mul_(3.0)\nlosses.append(0)\n" \
           "if box.runs == 4: raise KeyboardInterrupt\n"
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("amp", "--repeat 2 -q", cell)
    assert ip.user_ns["k"] == 0
    assert ip.user_ns["losses"] == []
    torch.testing.assert_close(ip.user_ns["model"][0].weight, ip.user_ns["w0"])


def test_cell_with_ipython_syntax_and_no_final_expression(run_cell, ip):
    run_cell("import torch")
    run_cell("%%amp --repeat 2 -q -r r2\na = torch.ones(4) @ torch.ones(4)\n%time b = 1\n")
    assert ip.user_ns["b"] == 1
    assert ip.user_ns["r2"].drift is None


def test_help_is_accurate(ip):
    doc = ip.magics_manager.magics["cell"]["amp"].__doc__
    for option in ("--dtype", "--device", "--no-tf32", "--warmup", "--repeat", "--no-baseline", "--result", "--quiet"):
        assert option in doc


def test_unload_removes_magics_and_reload_works(ip):
    assert "amp" in ip.magics_manager.magics["cell"]
    ip.run_line_magic("unload_ext", "nbaccel")
    assert "amp" not in ip.magics_manager.magics["cell"]
    assert "nbaccel_env" not in ip.magics_manager.magics["line"]
    ip.run_line_magic("load_ext", "nbaccel")
    assert "amp" in ip.magics_manager.magics["cell"]


def test_env_magic_shows_report(run_cell, ip):
    _, captured = run_cell("%nbaccel_env -r env")
    text = captured.outputs[0].data["text/plain"]
    assert "torch" in text and "AMX-BF16" in text and "float32_matmul_precision" in text
    assert ip.user_ns["env"].to_dict()["kind"] == "env"
    # A user trial: `python -m nbaccel env --json` exists, `%nbaccel_env --json` was refused.
    _, captured = run_cell("%nbaccel_env --json")
    assert not captured.outputs and json.loads(captured.stdout)["kind"] == "env"


def test_large_state_is_refused_with_the_alternatives(run_cell, ip):
    run_cell(TRAIN)
    with pytest.raises(UsageError, match=r"more than \d+ B \(1e-12 of the .*--no-restore.*--max-snapshot 0\.9"):
        ip.run_cell_magic("amp", "--max-snapshot 1e-12", "counter += 1")  # not "more than 0% of"
    assert ip.user_ns["counter"] == 0
    # What is copied is named, largest first: a dataset the cell never reads can be what is too large.
    run_cell("dataset = torch.zeros(1_000_000)")
    with pytest.raises(UsageError, match=re.escape(
            "The largest copies (every tensor in the namespace is copied, whatever the cell reads): dataset "
            "(3.81 MiB tensor), model (") + r".*\. Free memory first \(`del` what the cell does not need\)"):
        ip.run_cell_magic("amp", "--max-snapshot 1e-12", "counter += 1")
    with pytest.raises(nbaccel.snapshot.SnapshotTooLarge, match=r"restore=False.*max_snapshot_fraction=0\.9"):
        nbaccel.compare_amp(lambda: None, namespace=ip.user_ns, max_snapshot_fraction=1e-12)
    with pytest.raises(UsageError, match="fraction"):
        ip.run_cell_magic("amp", "--max-snapshot 2", "counter += 1")


def test_max_snapshot_reads_a_percentage_as_the_budget_does(run_cell, ip):
    # A docs trial: `--max-snapshot 50%` got argparse's "invalid float value: '50%'", while %memory_budget and
    # its --near read 50% as 0.5. Now it is read the same way, and a range error keeps the notation typed.
    run_cell(TRAIN)
    with pytest.raises(UsageError, match=r"more than \d+ B \(1e-12 of the "):
        ip.run_cell_magic("amp", "--max-snapshot 1e-10%", "counter += 1")
    run_cell("%%amp --max-snapshot 50% --repeat 1 --warmup 0 -q -r res\ncounter += 1\n")
    assert ip.user_ns["counter"] == 1
    with pytest.raises(UsageError, match=r"between 0% and 100% \(0 excluded\), got 150%"):
        ip.run_cell_magic("amp", "--max-snapshot 150%", "counter += 1")
    with pytest.raises(UsageError, match=r"such as 0\.5 or 50%, got 'half'"):
        ip.run_cell_magic("amp", "--max-snapshot half", "counter += 1")
    assert ip.user_ns["counter"] == 1


def test_no_restore_runs_continue_from_each_other(run_cell, ip):
    run_cell(TRAIN)
    run_cell("%%amp --no-restore --repeat 2 --warmup 0 -q -r res\ncounter += 1\n")
    # 2 timed + 1 audit + 1 memory (torch's CPU allocator) run per variant, then the kept run
    assert ip.user_ns["counter"] == 2 * 4 + 1 == nbaccel.amp.planned_runs(0, 2, device="cpu")
    assert "NOT restored" in unfolded(str(ip.user_ns["res"]))  # folded where the CPU's name is long


# --- found by a new-user trial --------------------------------------------------------------------


@pytest.mark.parametrize("last", ["np.ones(3)", "{'a': np.ones(2)}", "[np.ones(2)]", "(x @ x).float().numpy()"])
def test_a_numpy_result_is_compared_like_a_tensor(run_cell, ip, last):
    # Was: TypeError "only 0-dimensional arrays can be converted to Python scalars" from nbaccel's
    # own comparison, reported as "the cell raised TypeError".
    run_cell("import numpy as np, torch\nx = torch.randn(8, 8)")
    result, captured = run_cell(f"%%amp --repeat 3 -q -r res\n{last}")
    res = ip.user_ns["res"]
    assert res.drift is not None and res.drift["max_rel"] < 0.05
    assert "raised" not in unfolded(captured.stderr)
    assert result.result is not None


def test_nbaccel_failing_while_comparing_is_not_blamed_on_the_cell(run_cell, ip, monkeypatch):
    import nbaccel.amp as amp_module

    run_cell("counter = 0")
    # A comparison nbaccel cannot make: the result still comes, with the reason.
    monkeypatch.setattr(amp_module, "compute_drift", lambda base, amp: 1 / 0)
    run_cell("%%amp --repeat 3 -q -r res\ncounter += 1\n1.5")
    res = ip.user_ns["res"]
    assert res.drift is None and "nbaccel could not compare" in res.drift_skipped
    assert "not computed" in str(res) and ip.user_ns["counter"] == 1
    # A failure of nbaccel outside the cell: said so, variables as before the magic.
    monkeypatch.setattr(amp_module, "_build_result", lambda *a, **k: {}["nbaccel bug"])
    _, captured = run_cell("%%amp --repeat 3 -q\ncounter += 1\n1.5", expect_error=KeyError)
    assert "nbaccel itself failed" in unfolded(captured.stderr) and "the cell raised" not in unfolded(captured.stderr)
    assert ip.user_ns["counter"] == 1


def test_nan_in_the_same_place_is_no_drift_and_the_result_is_json(run_cell, ip):
    import json

    run_cell("import torch\nx = torch.randn(8, 8)")
    _, captured = run_cell("%%amp --repeat 3 -r res\ntorch.tensor([float('nan'), 1.0]) * x.sum()")
    res = ip.user_ns["res"]
    assert res.drift["max_rel"] < 0.05 and res.drift["amp_only_nonfinite"] == 0
    assert "nan" not in str(res).split("\n")[0]  # the headline said "drift max rel nan"
    data = json.loads(json.dumps(res.to_dict(), allow_nan=False))
    assert data["drift"]["leaves"][0]["base"] is None  # the NaN element of a 1-element leaf would be None


def test_a_list_inside_a_dict_is_restored(run_cell, ip):
    run_cell("history = {'loss': [], 'deep': {'x': [0]}}")
    run_cell("%%amp --repeat 3 -q -r res\nhistory['loss'].append(1)\nhistory['deep']['x'].append(1)\n"
             "len(history['loss']) + len(history['deep']['x'])")
    assert ip.user_ns["history"] == {"loss": [1], "deep": {"x": [0, 1]}}  # exactly one run's effect
    res = ip.user_ns["res"]
    assert res.drift["max_abs"] == 0 and not res.state_changed
    assert not any("differ" in a or "moved by" in a for a in res.advice)


def test_a_variable_that_cannot_be_put_back_is_named_and_the_rest_restored(run_cell, ip):
    """A fault-injection audit: an object whose restore fails (a dict subclass whose clear() refuses after
    the run) stopped the restore there, so `seen` kept the run's append and the RNG stayed advanced,
    while the magic said "a bug in nbaccel ... your variables ... are as they were before the magic"."""
    run_cell("import torch\nclass Settings(dict):\n    frozen = False\n    def clear(self):\n"
             "        if Settings.frozen: raise TypeError('frozen')\n        super().clear()\n"
             "cfg = Settings(lr=.1); seen = []; torch.manual_seed(0)")
    _, captured = run_cell("%%amp --repeat 1 --warmup 0\nseen.append(torch.rand(1).item()); Settings.frozen = True\n"
                           "(torch.ones(4) * 2).sum()", expect_error=Exception)
    run_cell("Settings.frozen = False\nnext_draw = torch.rand(1).item()\ntorch.manual_seed(0)")
    assert ip.user_ns["seen"] == [] and ip.user_ns["next_draw"] == ip.user_ns["torch"].rand(1).item()
    err = unfolded(captured.stderr)
    assert ("nbaccel %%amp: between two runs nbaccel could not put back `cfg` (TypeError: frozen), so the comparison "
            "was abandoned: torch's global settings") in err
    assert "and so are your variables except `cfg`, which could not be put back (see the note under the error)" in err
    assert "bug in nbaccel" not in err and "your variables and torch's" not in err


UNUSUAL = """
import threading, torch
class Listed(list):
    def __copy__(self): raise TypeError('no copy')
class Odd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
    def parameters(self, recurse=True): raise RuntimeError('nope')
class Weird:
    @property
    def __class__(self): raise RuntimeError('no class')
class Lr:
    def __init__(self): self.lock = threading.Lock()
    def __call__(self, epoch): return 1.0
m = torch.nn.Linear(2, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
o.param_groups[0]['lock'] = threading.Lock()
sched = torch.optim.lr_scheduler.LambdaLR(o, Lr())
emb = torch.nn.Embedding(10, 3, sparse=True)
emb(torch.tensor([1, 2])).sum().backward()  # a sparse gradient
things = {'expanded': torch.zeros(1, 64).expand(32, 64), 'sparse': torch.eye(4).to_sparse().requires_grad_(),
          'nested': torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]), 'listed': Listed([1]),
          'odd': Odd(), 'weird': Weird()}
a = torch.randn(8, 8)
"""


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_unusual_objects_the_cell_never_touches_do_not_fail_the_magic(run_cell, ip):
    """A fault-injection audit: each of these anywhere in the namespace failed every %%amp with "this is a
    bug in nbaccel ... run the cell without %%amp", though the cell never touched them."""
    run_cell(UNUSUAL)
    _, captured = run_cell("%%amp --repeat 2 --warmup 0 -q -r res\n(a @ a).sum()")
    assert "nbaccel" not in unfolded(captured.stderr) and not ip.user_ns["res"].state_changed
    run_cell("%%amp --repeat 2 --warmup 0 -q\no.step()\nsched.step()\nthings['listed'].append(2)\no.param_groups[0]['lr']")
    assert ip.user_ns["sched"].last_epoch == 1 and ip.user_ns["things"]["listed"] == [1, 2]


def test_generator_objects_advance_by_exactly_one_run(run_cell, ip):
    run_cell("import random, numpy as np, torch\ng = torch.Generator().manual_seed(0)\nr = np.random.default_rng(0)\n"
             "pr = random.Random(0)")
    run_cell("%%amp --repeat 1 --warmup 0 -q\na = torch.rand(1, generator=g); b = r.random(); c = pr.random()\n"
             "(torch.ones(4) * 2).sum()")
    run_cell("after = (torch.rand(1, generator=g).item(), r.random(), pr.random())\n"
             "g0, r0, pr0 = torch.Generator().manual_seed(0), np.random.default_rng(0), random.Random(0)\n"
             "second = (torch.rand(2, generator=g0)[1].item(), r0.random(2)[1], [pr0.random(), pr0.random()][1])")
    assert ip.user_ns["after"] == ip.user_ns["second"]  # the kept run drew the first; 12 runs drew 12 before


def test_a_graph_built_before_the_magic_still_backpropagates(run_cell, ip):
    """Restoring a tensor (copy_) bumped its version counter before every run: any %%amp, even on a cell
    that never touches them, made an earlier cell's `loss.backward()` fail ("modified by an inplace
    operation ... is at version 11"). A tensor the kept run really changes in place still moves."""
    run_cell("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(16, 4)\nx = torch.randn(8, 16)\n"
             "loss = model(x).pow(2).mean()\na = torch.randn(32, 32)\n"
             "b = torch.randn(4, requires_grad=True)\nc = torch.ones(4)\npending = (b * c).sum()")
    versions = {name: ip.user_ns[name]._version for name in ("x", "a", "c")}
    run_cell("%%amp --repeat 1 --warmup 0 -q\n(a @ a).sum()")
    assert {name: ip.user_ns[name]._version for name in versions} == versions
    run_cell("loss.backward()")
    assert ip.user_ns["model"].weight.grad is not None
    run_cell("%%amp --repeat 1 --warmup 0 -q\nc.mul_(2)\nc.sum()")
    assert ip.user_ns["c"].tolist() == [2.0] * 4 and ip.user_ns["c"]._version == versions["c"] + 1
    run_cell("pending.backward()", expect_error=RuntimeError)  # autograd still sees the kept run's write


def test_an_inference_tensor_from_an_earlier_cell_is_restored(run_cell, ip):
    # A tensor made under inference_mode can only change in place inside it: restoring it between
    # runs raised "Inplace update to inference tensor outside InferenceMode" and failed every later %%amp.
    run_cell("import torch\nwith torch.inference_mode():\n    preds = torch.zeros(3)")
    run_cell("%%amp --repeat 2 --warmup 0 -q -r res\nwith torch.inference_mode():\n    preds += 1\npreds")
    assert ip.user_ns["preds"].tolist() == [1.0, 1.0, 1.0]  # exactly one run's effect


def test_state_nbaccel_cannot_restore_is_not_blamed_on_precision(run_cell, ip):
    run_cell("import types\ntr = types.SimpleNamespace(steps=0)")
    run_cell("%%amp --repeat 2 -q -r res\ntr.steps += 1\ntr.steps")
    res = ip.user_ns["res"]
    assert res.state_changed
    advice = " ".join(res.advice)
    assert "moved by" not in advice
    assert "state that changed between runs, not from precision" in advice
    # With torch ops and --no-restore: the difference may be state, and the advice says so.
    run_cell("import torch\nw = torch.ones(4)")
    run_cell("%%amp --repeat 3 --no-restore -q -r res\nw.mul_(1.5)\nw.sum()")
    advice = " ".join(ip.user_ns["res"].advice)
    assert "moved by" not in advice and "variables were not restored" in advice
    assert "rather than from precision" in advice


def test_no_torch_ops_and_equal_results_give_no_drift_advice(run_cell, ip):
    run_cell("%%amp --repeat 3 -q -r res\nsum(range(10))")
    advice = ip.user_ns["res"].advice
    assert any("no torch operators" in a for a in advice)
    assert not any("moved by" in a or "differ" in a for a in advice)


def test_a_failure_only_under_autocast_says_which_run_raised(run_cell, ip):
    run_cell("import torch\nx = torch.randn(4, 4)\ncounter = 0")
    result, captured = run_cell("%%amp --repeat 3\ncounter += 1\n(x @ x).numpy().sum()", expect_error=TypeError)
    assert "BFloat16" in str(result.error_in_exec)  # the user's exception, unchanged
    assert "the cell raised TypeError in the bf16 autocast run (the fp32 run had succeeded)" in unfolded(captured.stderr)
    assert ip.user_ns["counter"] == 0


def test_an_fp16_overflow_says_what_to_write_instead(run_cell, ip, cpu_with_bf16_and_fp16_units):
    # A user trial: "value cannot be converted to type c10::Half without overflow" from an attention mask.
    run_cell("import torch\nq = torch.randn(2, 4, 8)\nmask = torch.rand(2, 4, 4) > 0.5")
    result, captured = run_cell("%%amp --dtype fp16 --repeat 3 --warmup 0\nscores = q @ q.transpose(1, 2)\n"
                                "scores.masked_fill(~mask, -1e9)", expect_error=RuntimeError)
    assert "c10::Half without overflow" in str(result.error_in_exec)  # the user's exception, unchanged
    assert ("in the fp16 autocast run (the fp32 run had succeeded); the comparison was abandoned" in unfolded(captured.stderr)
            and "Hint: fp16's largest finite value is 65504, so a constant beyond it (such as -1e9 for a mask) cannot "
                "be written into an fp16 tensor: use torch.finfo(x.dtype).min" in unfolded(captured.stderr)
            and "or bf16 (--dtype bf16), whose range is fp32's." in unfolded(captured.stderr)), captured.stderr


# torch's words on a CPU with neither AVX512-BF16 nor AMX, for an nn.LSTM under bf16 autocast (a CI machine,
# AMD EPYC with AVX2 only): they name neither the dtype nor a way out.
ONEDNN_LSTM = ("could not create a primitive descriptor for the LSTM forward propagation primitive. Run workload "
               "with environment variable ONEDNN_VERBOSE=all to get additional diagnostic information.")


def test_a_cpu_kernel_oneDNN_cannot_build_in_bf16_says_how_to_keep_it_in_fp32(run_cell, ip, cpu_without_bf16_units):
    # As the real LSTM fails there (test_an_lstm_on_a_cpu_without_bf16_units_gets_the_hint runs it where it does).
    run_cell(f"import torch\nmessage = {ONEDNN_LSTM!r}")
    cell = "if torch.is_autocast_enabled('cpu'):\n    raise RuntimeError(message)\n"
    hint = ("Hint: oneDNN (torch's CPU kernels) could not build a reduced-precision LSTM kernel: this CPU has "
            "neither AVX512-BF16 nor AMX, and oneDNN found no such kernel for it. Keep that module in fp32 inside the "
            "autocast region, e.g. `with torch.autocast('cpu', enabled=False): out, _ = lstm(x.float())` around the "
            "nn.LSTM call; the rest of the cell still runs in reduced precision.")
    result, captured = run_cell("%%amp --repeat 3 --warmup 0\n" + cell, expect_error=RuntimeError)
    assert str(result.error_in_exec) == ONEDNN_LSTM  # the user's exception, unchanged
    assert "in the bf16 autocast run (the fp32 run had succeeded)" in unfolded(captured.stderr) and hint in unfolded(captured.stderr)
    result, captured = run_cell("%%profile_gpu --amp bf16\n" + cell, expect_error=RuntimeError)
    assert "the profiled code raised RuntimeError" in unfolded(captured.stderr) and hint in unfolded(captured.stderr)
    # Another failure under autocast gets no such hint
    _, captured = run_cell("%%amp --repeat 3 --warmup 0\nif torch.is_autocast_enabled('cpu'):\n    raise "
                           "RuntimeError('primitive')", expect_error=RuntimeError)
    assert "Hint:" not in unfolded(captured.stderr)


def test_compare_amp_notes_the_cpu_kernel_hint_on_the_exception(cpu_without_bf16_units):
    import torch

    import nbaccel

    def step():
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError(ONEDNN_LSTM)

    with pytest.raises(RuntimeError) as caught:
        nbaccel.compare_amp(step, "bf16", repeat=3, warmup=0)
    notes = caught.value.__notes__
    assert any(n.startswith("nbaccel.compare_amp: oneDNN (torch's CPU kernels) could not build a reduced-precision "
                            "LSTM kernel") for n in notes), notes


def _has_bf16_units() -> bool:
    from nbaccel.device import device_info

    return device_info("cpu").has_bf16_units


@pytest.mark.skipif(_has_bf16_units(), reason="oneDNN runs a bf16 LSTM on a CPU with AVX512-BF16 or AMX; "
                                              "the simulated refusal above covers the hint there")
def test_an_lstm_on_a_cpu_without_bf16_units_gets_the_hint(run_cell, ip):
    run_cell("import torch\nlstm, x = torch.nn.LSTM(16, 24, batch_first=True), torch.randn(4, 10, 16)")
    result, captured = run_cell("%%amp --repeat 3 --warmup 0\nout, _ = lstm(x)", expect_error=RuntimeError)
    assert "could not build a reduced-precision LSTM kernel" in unfolded(captured.stderr)
    # and the fix it names runs
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -q -r res\nwith torch.autocast('cpu', enabled=False):\n"
                           "    out, _ = lstm(x.float())\n(out @ torch.randn(24, 5)).sum()")
    assert ip.user_ns["res"].speedup > 0


def test_one_timed_run_is_not_a_speedup_claim(run_cell, ip):
    run_cell("import torch")
    _, captured = run_cell("%%amp --repeat 1 --warmup 0 -r res\ntorch.ones(64, 64) @ torch.ones(64, 64)")
    res = ip.user_ns["res"]
    assert res.speedup_uncertain
    assert not any("faster here" in a or "No speedup" in a for a in res.advice)
    shown = captured.outputs[0].data["text/plain"]  # rendered inside the magic: options as typed there
    assert "--repeat 5 or more" in shown
    # Was: "speedup 2.85x (uncertain, contended)" in the headline, while docs/amp.md promised that a
    # speedup from fewer than 3 timed runs is not claimed. Now the headline and the KPI say so.
    assert "speedup not claimed (1 timed run per variant; use --repeat 5)" in shown.splitlines()[0]
    assert f"speedup {res.speedup:.2f}x" not in shown
    html = captured.outputs[0].data["text/html"]
    assert '<div class="big warn nbaccel-speedup">not claimed</div>' in html
    assert "(1 timed run per variant; use --repeat 5)" in html and f"{res.speedup:.2f}x</div>" not in html
    from nbaccel.render import amp as amp_render

    with res._spelling():  # as show() builds it
        kpi = amp_render.widget(res).children[0].value
    assert "not claimed</div>" in kpi and "(1 timed run per variant; use --repeat 5)" in kpi
    # Read from Python later, still the magic's spelling: the way to act on it is to re-run the magic.
    assert any("--repeat 5" in a for a in res.advice) and any("--repeat 5" in w for w in res.noise_warnings)
    assert "no warmup, 1 timed run per variant, interleaved" in unfolded(shown)
    _, captured = run_cell("%%amp --repeat 2 --warmup 0 -q -r res\ntorch.ones(64, 64) @ torch.ones(64, 64)")
    assert "speedup not claimed (2 timed runs per variant; use --repeat 5)" in str(ip.user_ns["res"])


def test_method_line_without_a_baseline_is_not_interleaved(run_cell):
    _, captured = run_cell("%%amp --repeat 2 --warmup 1 --no-baseline\n1 + 1")
    shown = captured.outputs[0].data["text/plain"]
    assert "1 warmup round, 2 timed runs per variant (bf16 only, no fp32 baseline)" in unfolded(shown)
    assert "interleaved" not in shown


def test_help_usage_line_reads_as_the_cell_magic(run_cell):
    _, captured = run_cell("%%amp -h\n1")
    assert captured.stdout.lstrip(": \n").startswith("%%amp [-h]")


def test_flags_the_cell_sets_are_kept_like_one_run_of_the_cell(run_cell, ip, flags_set_by_the_cell):
    # Was: cudnn.benchmark set by the cell was reverted by the recipe's exit, deterministic kept.
    run_cell("import torch")
    run_cell("%%amp --repeat 3 -q\ntorch.backends.cudnn.benchmark = True\ntorch.backends.cudnn.deterministic = True\n"
             "torch.ones(4).sum()")
    assert torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic


def test_autocast_left_on_by_an_earlier_cell_does_not_leak_into_the_fp32_run(run_cell, ip):
    run_cell("import torch\nx = torch.randn(32, 32)\nac = torch.autocast('cpu')\nac.__enter__()")
    try:
        _, captured = run_cell("%%amp --repeat 3 -r res\nx @ x")
        assert torch.is_autocast_enabled("cpu"), "the earlier cell's autocast is the user's: it stays on"
    finally:
        ip.user_ns["ac"].__exit__(None, None, None)
    res = ip.user_ns["res"]
    ops = res.baseline.ops
    assert set(ops[ops["op"] == "aten::mm"]["dtype"]) == {"fp32"}
    shown = captured.outputs[0].data["text/plain"]
    assert "autocast bf16 (cpu) was already on around %%amp" in unfolded(shown)


def test_a_failed_amp_puts_torchs_global_settings_back_and_says_so(run_cell, ip):
    # Was: "your variables are as they were before the magic", with grad mode off and float64 left.
    run_cell("import types, torch\nbox = types.SimpleNamespace(runs=0)")
    cell = ("%%amp --repeat 3\nbox.runs += 1\ntorch.set_grad_enabled(False)\ntorch.set_default_dtype(torch.float64)\n"
            "torch.backends.cudnn.deterministic = True\nif box.runs == 3: raise ValueError('boom in run 3')\n")
    _, captured = run_cell(cell, expect_error=ValueError)
    assert torch.is_grad_enabled() and torch.get_default_dtype() is torch.float32
    assert not torch.backends.cudnn.deterministic
    assert "your variables and torch's global settings (grad mode, default dtype" in unfolded(captured.stderr)


def test_a_failed_amp_without_restore_does_not_promise_the_variables(run_cell, ip):
    run_cell("import torch\ncounter = 0")
    _, captured = run_cell("%%amp --repeat 3 --no-restore\ncounter += 1\nif counter == 2: raise ValueError('x')\n",
                           expect_error=ValueError)
    assert ip.user_ns["counter"] == 2
    assert "your variables keep what the runs did (--no-restore)" in unfolded(captured.stderr)
    assert "your variables are as they were" not in unfolded(captured.stderr)


def test_an_interrupted_run_gets_the_same_note_and_state_is_restored(run_cell, ip):
    # Was: no note at all (compare_amp caught Exception only), though docs/amp.md promised one.
    run_cell("import types, torch\nbox = types.SimpleNamespace(runs=0)\nk = 0")
    cell = ("%%amp --repeat 3\nk += 1\nbox.runs += 1\ntorch.set_grad_enabled(False)\n"
            "if box.runs == 6: raise KeyboardInterrupt\n")
    _, captured = run_cell(cell, expect_error=KeyboardInterrupt)
    assert ("nbaccel %%amp: the cell was interrupted (KeyboardInterrupt) in an fp32 run (earlier fp32 and bf16 autocast runs had succeeded); "
            "the comparison was abandoned: your variables and torch's global settings") in unfolded(captured.stderr)
    assert ip.user_ns["k"] == 0 and torch.is_grad_enabled()


def test_an_interrupt_outside_the_cell_is_not_blamed_on_it(run_cell, ip, monkeypatch):
    import nbaccel.amp as amp_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    run_cell("counter = 0")
    monkeypatch.setattr(amp_module, "_build_result", interrupted)  # Ctrl-C while nbaccel sums up
    _, captured = run_cell("%%amp --repeat 3 -q\ncounter += 1\n1.5", expect_error=KeyboardInterrupt)
    assert ("nbaccel %%amp: interrupted (KeyboardInterrupt) while nbaccel was comparing, not in the cell"
            in unfolded(captured.stderr))
    assert "the cell was interrupted" not in unfolded(captured.stderr) and ip.user_ns["counter"] == 0


def test_a_second_interrupt_while_the_variables_are_put_back_is_said(run_cell, ip, monkeypatch):
    # Restoring takes a while, so a user who pressed Ctrl-C may press it again while nbaccel puts the
    # variables back. The note said "your variables ... are as they were" though they were not.
    from nbaccel.snapshot import Snapshot

    original, calls = Snapshot.restore, []

    def restore(self, *args, **kwargs):
        calls.append(1)
        if len(calls) in (4, 5):  # before the 4th run, then the put-back after it
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    run_cell("import torch\nw = torch.ones(3)\ncounter = 0")
    monkeypatch.setattr(Snapshot, "restore", restore)
    _, captured = run_cell("%%amp --repeat 3 --warmup 0\ncounter += 1\nw.mul_(2)\n", expect_error=KeyboardInterrupt)
    assert ip.user_ns["counter"] == 1, "the put-back was interrupted: the 3rd run's state stays"
    assert "your variables and torch's global settings" not in unfolded(captured.stderr), captured.stderr
    assert ("are as they were before the magic, but not all your variables: putting them back was interrupted (see "
            "the note under the error)") in unfolded(captured.stderr)
    assert "nbaccel: your variables could not be fully restored: a second interrupt stopped nbaccel" in captured.stdout
    assert "File " not in captured.stdout, "still no nbaccel frame"


def test_a_long_comparison_says_after_its_first_run_how_long_the_rest_takes(run_cell, monkeypatch):
    # Was: a 0.5 s cell ran 17 times (10.6 s) without a word.
    import re

    from nbaccel.magics import amp as amp_magic

    monkeypatch.setattr(amp_magic, "LONG_RUN_SECONDS", 0.2)  # instead of 5 s, to keep the test short
    run_cell("import time")
    _, captured = run_cell("%%amp --repeat 4 --warmup 1\ntime.sleep(0.02)")  # not -q: it hides the note
    notes = [line for line in note_lines(captured.stderr) if "more runs" in line]
    assert len(notes) == 1
    # 2 x (1 warmup + 4 timed + 1 audited + 1 memory) + the kept run = 15, one done.
    first, rest = (float(v) for v in re.search(r"the first run took ([\d.]+) ms; 14 more runs .* take about "
                                               r"([\d.]+) ms at that pace: longer if the other variant is slower, "
                                               r"shorter where the first run paid one-time setup\.",
                                               notes[0]).groups())
    # measured, not guessed: the first run's pace, plus the restore each run pays (left unsaid below a tenth of
    # a run; on a busy machine that tenth moved the estimate 1.1% from 14 x the first run)
    assert 20 <= first < 500 and 14 * first * 0.99 <= rest <= 14 * first * (1 + amp_magic.RESTORE_WORTH_SAYING) * 1.01
    assert "--repeat 3 --warmup 0 (11 runs in all)" in notes[0]
    # A cell whose 15 runs stay under the threshold gets no note.
    _, captured = run_cell("%%amp --repeat 4 --warmup 1\n1 + 1")
    assert "more runs" not in unfolded(captured.stderr)


def test_a_variant_far_slower_than_the_first_run_revises_the_note(run_cell, ip, monkeypatch):
    """A trial: fp16 convolutions ran 74x the first (fp32) run's time, 57.7 s in all, and the note, estimated
    from that first run alone (1.6 s), never came. The recipe's first run is reported too."""
    from nbaccel.magics import amp as amp_magic

    monkeypatch.setattr(amp_magic, "LONG_RUN_SECONDS", 0.5)
    run_cell("import time, torch\n"
             "def slow(fp32, bf16):\n    time.sleep(bf16 if torch.is_autocast_enabled('cpu') else fp32)")
    # a 1 ms fp32 run says nothing; the 150 ms bf16 one does, at the two first runs' mean pace
    _, captured = run_cell("%%amp --repeat 3 --warmup 0\nslow(0.001, 0.15)")
    notes = [line for line in note_lines(captured.stderr) if "more runs" in line]
    assert len(notes) == 1, captured.stderr
    assert re.search(r"the first fp32 run took [\d.]+ ms and the first mixed-precision one [\d.]+ ms; 9 more runs .* take about "
                     r"[\d.]+ (ms|s) at their mean pace", notes[0]), notes[0]
    # a note already said is said again only when the estimate grew by half (60 ms, then 300 ms)
    _, captured = run_cell("%%amp --repeat 3 --warmup 0\nslow(0.06, 0.3)")
    notes = [line for line in note_lines(captured.stderr) if "more runs" in line]
    assert len(notes) == 2 and "the first run took" in notes[0] and "the first fp32 run took" in notes[1]
    # in a kernel: one display, revised in place, then emptied into how long the runs took
    monkeypatch.setattr(ip, "kernel", object(), raising=False)
    updates = []
    monkeypatch.setattr("IPython.display.DisplayHandle.update", lambda self, obj, **kw: updates.append(obj))
    _, captured = run_cell("%%amp --repeat 3 --warmup 0\nslow(0.06, 0.3)")
    shown = [o.data["text/plain"] for o in captured.outputs if "more runs" in o.data.get("text/plain", "")]
    assert len(shown) == 1 and "the first run took" in shown[0]
    assert len(updates) == 2 and "the first mixed-precision one" in updates[0]["text/plain"]
    assert updates[1]["text/plain"].startswith("nbaccel %%amp: the 11 runs took")



def test_restoring_the_variables_counts_in_the_long_run_note_and_earns_advice_when_it_dominates(
        run_cell, ip, monkeypatch):
    # A user trial: Embedding(400000, 256, sparse=True) + SparseAdam, a 1.15 GiB snapshot: --repeat 5 of a 7 ms
    # step took 8.49 s (0.25 s with --no-restore), and no long-run note came: it estimated from the run alone.
    # Here each restore is made to take 60 ms more (a sleep), beside a cell of microseconds.
    import time

    from nbaccel.magics import amp as amp_magic

    restore = nbaccel.snapshot.Snapshot.restore

    def slow_restore(self, *args, **kwargs):
        restore(self, *args, **kwargs)
        time.sleep(0.06)

    monkeypatch.setattr(nbaccel.snapshot.Snapshot, "restore", slow_restore)
    monkeypatch.setattr(amp_magic, "LONG_RUN_SECONDS", 0.2)  # 11 runs x 60 ms pass it; 11 runs of 1 + 1 do not
    run_cell("import torch\nx = torch.ones(4)")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\nx.sum()")
    note = next(line for line in note_lines(captured.stderr) if "more runs" in line)
    restored = float(re.search(r"and restoring your variables before it ([\d.]+) ms, as before each run; 10 more "
                               r"runs", note).group(1))
    assert 60 <= restored < 1000, note
    res = ip.user_ns["res"]
    assert len(res.restore_times) == 11 and min(res.restore_times) >= 0.06  # measured, one per run
    line = unfolded(next(a for a in res.advice if a.startswith("Restoring your variables")))
    assert re.match(r"Restoring your variables before each run \(a [\d.]+ B host snapshot\) took [\d.]+ m?s in all "
                    r"over 11 runs \([\d.]+ ms to [\d.]+ ms each\), where the slower variant's median run takes", line), line
    assert "--no-restore skips it, at a cost: each run then starts from what the one before left" in line
    # Without a snapshot nothing is restored, and nothing is said.
    run_cell("%%amp --repeat 3 --warmup 0 --no-restore -q -r res\nx.sum()")
    assert ip.user_ns["res"].restore_times == [] and not any("Restoring" in a for a in ip.user_ns["res"].advice)


def test_in_a_kernel_the_long_run_note_becomes_how_long_the_runs_took(run_cell, ip, monkeypatch):
    # As a stderr line the note stayed under the result as a red box after the runs it announced;
    # emptied, it left an empty output in the saved notebook.
    from nbaccel.magics import amp as amp_magic

    monkeypatch.setattr(amp_magic, "LONG_RUN_SECONDS", 0.05)
    monkeypatch.setattr(ip, "kernel", object(), raising=False)  # what a Jupyter kernel's shell has
    updates = []
    monkeypatch.setattr("IPython.display.DisplayHandle.update", lambda self, obj, **kw: updates.append(obj))
    run_cell("import time")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0\ntime.sleep(0.02)")  # not -q: it hides the note
    shown = [o.data["text/plain"] for o in captured.outputs if "more runs" in o.data.get("text/plain", "")]
    assert len(shown) == 1 and "more runs" not in unfolded(captured.stderr)
    # 2 x (0 warmup + 3 timed + 1 audited + 1 memory) + the kept run = 11
    assert len(updates) == 1 and re.fullmatch(r"nbaccel %%amp: the 11 runs took [\d.]+ (ms|s) in all\.",
                                              updates[0]["text/plain"]), updates
    took = float(updates[0]["text/plain"].split(" took ")[1].split()[0])
    assert took >= 15 * 20 if updates[0]["text/plain"].endswith("ms in all.") else took >= 0.3  # 15 sleeps of 20 ms

    updates.clear()
    run_cell("import torch")
    run_cell("%%amp --repeat 3 --warmup 0\ntime.sleep(0.02)\nif torch.is_autocast_enabled('cpu'): 1 / 0",
             expect_error=ZeroDivisionError)  # fails in the first bf16 run, after the note
    # failed: the note says the runs stopped, the error and its note below say why
    assert len(updates) == 1 and re.fullmatch(r"nbaccel %%amp: the runs stopped after [\d.]+ (ms|s) \(the note "
                                              r"below says why\)\.", updates[0]["text/plain"]), updates


@pytest.mark.parametrize("kernel", [False, True], ids=["terminal", "kernel"])
def test_quiet_hides_the_long_run_note_too(run_cell, ip, monkeypatch, kernel):
    # A user trial: "%%amp -q" still printed "the first run took 370 ms; 14 more runs ...".
    from nbaccel.magics import amp as amp_magic

    monkeypatch.setattr(amp_magic, "LONG_RUN_SECONDS", 0.05)
    if kernel:
        monkeypatch.setattr(ip, "kernel", object(), raising=False)  # the note would be a display there
    run_cell("import time")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -q\ntime.sleep(0.02)")
    assert unfolded(captured.stderr) == "" and captured.outputs == []


def test_a_semicolon_after_the_last_expression_hides_its_value_as_under_time(run_cell, ip):
    run_cell("import torch\nx = torch.ones(3)")
    result, captured = run_cell("%%amp --repeat 3 -q -r res\nx.sum();  # hidden, as IPython does")
    assert result.result is None and "Out[" not in captured.stdout
    assert float(ip.user_ns["res"].value) == 3.0  # the result object still has it
    result, captured = run_cell("%%amp --repeat 3 -q\nx.sum()")
    assert float(result.result) == 3.0 and "Out[" in captured.stdout


MiB = 1 << 20


@pytest.fixture
def scripted_peaks(monkeypatch):
    """Replaces %%amp's peak-memory meter: each memory run reads the next scripted peak of its
    variant (told apart by CPU autocast, on when the meter starts), in the order the runs come."""
    import nbaccel.amp as amp_module
    from nbaccel.memory import PeakMemory

    script = {"fp32": [], "bf16": [], "order": []}

    class ScriptedMeter:
        # Scripts the process's memory (`PeakMeter`, 3 runs per variant): torch's allocator meter stands
        # aside as it does while another profiler records.
        available = staticmethod(lambda: False)

        def __init__(self, device=None, collect=True):
            self.result = None

        def __enter__(self):
            self.name = "bf16" if torch.is_autocast_enabled("cpu") else "fp32"
            return self

        def __exit__(self, *exc):
            script["order"].append(self.name)
            self.result = PeakMemory("cpu", int(script[self.name].pop(0) * MiB), "scripted peak")
            return False

    monkeypatch.setattr(amp_module, "PeakMeter", ScriptedMeter)  # the process's memory
    monkeypatch.setattr(amp_module, "CpuTensorPeak", ScriptedMeter)  # torch's CPU allocator
    return script


def test_cpu_memory_overlapping_across_runs_is_no_firm_difference(run_cell, scripted_peaks):
    # Was: one memory run per variant, "memory used +10% vs fp32" and "autocast keeps casted copies of
    # fp32 weights", from peaks that moved by 4 MiB between runs of the same cell.
    scripted_peaks.update(fp32=[20, 24, 21], bf16=[23, 20.5, 25])
    run_cell("import torch\nx = torch.randn(64, 64)")
    _, captured = run_cell("%%amp --dtype bf16 --repeat 3 --warmup 0 -r res\n(x @ x).sum()")
    res = run_cell("res")[0].result
    # three runs per variant, interleaved and alternating like the timed ones
    assert scripted_peaks["order"] == ["fp32", "bf16", "bf16", "fp32", "fp32", "bf16"]
    assert res.baseline.memory.peak_bytes == 21 * MiB and res.amp.memory.peak_bytes == 23 * MiB  # the medians
    assert res.memory_comparable and not res.memory_firm
    shown = captured.stdout + str(res) + res._repr_html_()
    assert "peak memory: no firm difference (fp32 20-24 MiB, bf16 20.5-25 MiB; 3 runs each)" in shown
    assert "memory used" not in shown and "casted copies" not in shown and "higher under" not in shown
    # the HTML and widget KPI: the verdict in large type, the ranges under it
    assert '<div class="big">no firm difference</div><div class="muted">(fp32 20-24 MiB' in res._repr_html_()
    assert any(a.startswith("No firm memory difference: the median peaks differ by 10% (21 MiB -> 23 MiB), but the "
                            "runs overlap (fp32 20-24 MiB, bf16 20.5-25 MiB; 3 runs each)") for a in res.advice)
    method = unfolded(str(res).split("method: ")[1])
    assert ("median of 3 runs per variant, interleaved: fp32 20-24 MiB (spread 4 MiB), bf16 20.5-25 MiB (spread "
            "4.5 MiB); a difference is firm when the ranges do not overlap") in method
    assert res.to_dict()["baseline"]["memory"]["runs_bytes"] == [20 * MiB, 24 * MiB, 21 * MiB]
    assert res.to_dict()["memory_firm"] is False


def test_cpu_memory_runs_apart_are_a_firm_difference(run_cell, scripted_peaks):
    scripted_peaks.update(fp32=[20, 20.2, 20.1], bf16=[15, 15.3, 15.1])
    run_cell("import torch\nx = torch.randn(64, 64)")
    run_cell("%%amp --dtype bf16 --repeat 3 --warmup 0 -q -r res\n(x @ x).sum()")
    res = run_cell("res")[0].result
    assert res.memory_firm and "memory saved 25%" in str(res)
    assert "Peak memory 25% lower (20.1 MiB -> 15.1 MiB)." in res.advice
    # higher under bf16, apart: said, with its usual cause named as such, not asserted
    scripted_peaks.update(fp32=[20, 20.2, 20.1], bf16=[25, 25.3, 25.1])
    run_cell("%%amp --dtype bf16 --repeat 3 --warmup 0 -q -r res\n(x @ x).sum()")
    res = run_cell("res")[0].result
    assert "memory used +25% vs fp32" in str(res)
    assert ("Peak memory 25% higher under bf16 (20.1 MiB -> 25.1 MiB). A common cause (not measured here): "
            "autocast makes bf16 copies of the inputs of each op it casts, beside the fp32 originals the cell "
            "still holds.") in res.advice  # forward only: no weight copies kept for a backward
    run_cell("w = torch.randn(64, 64, requires_grad=True)")
    scripted_peaks.update(fp32=[20, 20.2, 20.1], bf16=[25, 25.3, 25.1])
    run_cell("%%amp --dtype bf16 --repeat 3 --warmup 0 -q -r res\n(x @ w).sum().backward()")
    res = run_cell("res")[0].result
    assert ("Peak memory 25% higher under bf16 (20.1 MiB -> 25.1 MiB). A common cause (not measured here): "
            "autocast keeps bf16 copies of fp32 weights for the backward pass.") in res.advice


def test_a_memory_change_under_half_a_percent_reads_as_the_same(run_cell, scripted_peaks):
    # Was: "memory used +0% vs fp32" for 3.99 MiB -> 4 MiB.
    scripted_peaks.update(fp32=[3.99] * 3, bf16=[4.0] * 3)
    run_cell("import torch\nx = torch.randn(64, 64)")
    run_cell("%%amp --dtype bf16 --repeat 3 --warmup 0 -q -r res\n(x @ x).sum()")
    res = run_cell("res")[0].result
    assert res.memory_firm and res.memory_same
    text = str(res)
    assert "peak memory: the same (3.99 MiB -> 4 MiB)" in text and "+0%" not in text and "memory used" not in text


def test_the_method_line_says_how_the_achieved_column_is_made(run_cell, ip):
    # Was: an "achieved" FLOP/s column with no word on what was counted or divided by which time.
    run_cell("import torch\nx = torch.randn(64, 64)")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\n(x @ x).sum()")
    res = ip.user_ns["res"]
    flops = 2 * 64 * 64 * 64  # one 64x64 @ 64x64 matmul: a multiply-add is 2 FLOPs
    assert res.baseline.flops == flops and res.baseline.flops_per_second == pytest.approx(flops / res.baseline.median)
    method = unfolded(captured.outputs[0].data["text/plain"].split("method: ")[1])
    assert ("achieved: the FLOPs of the matmul, convolution, attention and recurrent ops (the formulas %%profile_gpu "
            "uses, torch.utils.flop_counter's where nbaccel has none; a multiply-add is 2; elementwise ops and "
            "reductions are not counted) in each variant's audited run, divided by that variant's median timed "
            "run") in method
    assert "achieved: the FLOPs" in captured.outputs[0].data["text/html"]


def test_a_cell_that_takes_batches_from_an_iterator_is_told_so(run_cell, ip):
    """A user trial: `xb = next(it)` in a %%amp cell took 17 batches from a DataLoader iterator while
    the report said the variables were as after one run, and the drift read as precision's."""
    run_cell("import torch\nloader = torch.utils.data.DataLoader(torch.randn(400, 8), batch_size=4)\n"
             "it = iter(loader)\nm = torch.nn.Linear(8, 1)")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\nxb = next(it)\nm(xb).sum()")
    res = ip.user_ns["res"]
    assert res.iterators == ["`it` (a _SingleProcessDataLoaderIter)"] and res.to_dict()["iterators"] == res.iterators
    assert res.advice[0].startswith("`it` (a _SingleProcessDataLoaderIter) is an iterator the cell takes items from")
    assert "take it before the magic (`batch = next(it)`)" in res.advice[0]
    assert "(state changed between runs)" in str(res).splitlines()[0]
    assert "state changed between runs</div>" in captured.outputs[0].data["text/html"]
    # A batch taken before the magic is a plain tensor: nothing to say.
    run_cell("batch = next(it)")
    run_cell("%%amp --repeat 3 --warmup 0 -q -r res2\nm(batch).sum()")
    res2 = ip.user_ns["res2"]
    assert res2.iterators == [] and "state changed" not in str(res2) and "iterator" not in " ".join(res2.advice)


def test_an_iterator_the_runs_use_up_is_named_in_the_error(run_cell, ip):
    run_cell("import torch\ndef batches():\n    for _ in range(4):\n        yield torch.randn(4, 8)\n"
             "gen = batches()\nm = torch.nn.Linear(8, 1)\ndef step():\n    return m(next(gen)).sum()")
    result, captured = run_cell("%%amp --repeat 3 --warmup 0\nstep()", expect_error=StopIteration)
    assert "the cell raised StopIteration in " in unfolded(captured.stderr)
    notes = result.error_in_exec.__notes__
    assert any(n.startswith("nbaccel: `gen` (a generator) is an iterator the cell takes items from, and the "
                            "comparison's runs used it up") for n in notes), notes
    # a trial: the line above the traceback said "your variables ... are as they were before the magic"
    assert ("and so are your variables except the iterator the runs used up (see the note under the error)"
            in unfolded(captured.stderr)), captured.stderr
    # and from Python, the note about the variables says it too
    ip.user_ns["gen"] = ip.user_ns["batches"]()
    with pytest.raises(StopIteration) as info:
        nbaccel.compare_amp(ip.user_ns["step"], repeat=3, warmup=0, namespace=ip.user_ns)
    assert any("your variables too except `gen` (a generator), which the runs used up (the note above)" in n for n in info.value.__notes__), \
        info.value.__notes__


def iterators_read(fn, namespace=None):
    from nbaccel.cell_reads import objects_read

    return objects_read(fn, namespace)["iterators"]


def test_files_and_reiterable_loaders_are_not_iterators_to_warn_about(tmp_path):
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115 - a file the cell writes to is an iterator too
    loader = [1, 2, 3]
    it = iter(loader)

    def cell():
        log.write("x")
        return sum(loader)

    def inner():
        return next(it)

    def outer():
        return inner()

    try:
        assert iterators_read(cell) == {}
        assert iterators_read(outer) == {"it": it}  # reached through the function the cell calls
        assert iterators_read(lambda: next(it)) == {"it": it}
    finally:
        log.close()


def test_only_names_the_cell_reads_are_iterators_it_takes_from(run_cell, ip):
    """A review: the names were the code's co_names -- names it assigns and attribute names too. A cell
    making its own iterator (`it = iter(data)`) was told it took items from the `it` an earlier run
    left in the namespace, and `obj.gen` named a global generator `gen`."""
    run_cell("import torch\ndata = [torch.ones(2)] * 50\nm = torch.nn.Linear(2, 1)\n"
             "def gen_fn():\n    yield 1\ngen = gen_fn()\nclass Obj:\n    gen = 3\nobj = Obj()")
    for _ in range(2):  # the second time an `it` from the first is in the namespace
        run_cell("%%amp --repeat 3 --warmup 0 -q -r res\nit = iter(data)\nm(next(it)).sum() + obj.gen")
        assert ip.user_ns["res"].iterators == []
    run_cell("it = iter(data)")
    run_cell("%%amp --repeat 3 --warmup 0 -q -r res\nm(next(it)).sum()")
    assert ip.user_ns["res"].iterators == ["`it` (a list_iterator)"]


def test_a_module_compiled_in_place_is_found():
    import torch

    from nbaccel.cell_reads import is_compiled

    model = torch.nn.Linear(2, 2)
    assert not is_compiled(model)
    model.compile(backend="eager")  # the module stays a Linear; no compile happens until it is called
    assert is_compiled(model) and is_compiled(torch.compile(lambda x: x, backend="eager"))
    from unittest import mock

    assert not is_compiled(mock.Mock())  # attributes read statically: a Mock has every attribute


def test_torch_compile_inside_the_cell_is_said_and_compiling_in_timed_runs_voids_the_speedup(run_cell, ip):
    """A review: `cm = torch.compile(model)` inside a %%amp cell was not flagged at all; with
    --warmup 0 the timed runs compiled (seconds against milliseconds) and the verdict read that as
    the recipe's speed. Compiling is counted from torch.compile's own graph counter."""
    import torch

    run_cell("import torch\nm = torch.nn.Linear(16, 16)\nx = torch.randn(4, 16)")
    try:
        torch._dynamo.reset()
        run_cell("%%amp --repeat 3 --warmup 0 --dtype bf16 -q -r cold\ncm = torch.compile(m, backend='eager')\n"
                 "cm(x).sum()")
        cold = ip.user_ns["cold"]
        # fp32 and bf16 each compile once (autocast is in the guards), both in their first timed run
        assert cold.compiled_while_timed == 2 and cold.to_dict()["compiled_while_timed"] == 2
        note = next(a for a in cold.advice if a.startswith("torch.compile compiled 2 graphs during the timed runs"))
        assert "raise --warmup (now 0)" in note
        verdicts = [a for a in cold.advice if "x faster" in a or a.startswith("No speedup") or "cannot rank" in a]
        assert verdicts == []  # no verdict on the compiler's time
        assert cold.compiled == ["the code the cell compiles"]
        torch._dynamo.reset()
        run_cell("%%amp --repeat 3 --warmup 1 --dtype bf16 -q -r warm\ncm = torch.compile(m, backend='eager')\n"
                 "cm(x).sum()")
        warm = ip.user_ns["warm"]
        assert warm.compiled_while_timed == 0 and not any("during the timed runs" in a for a in warm.advice)
        assert warm.compiled == ["the code the cell compiles"]  # the audit still records eager ops
        assert any(a.startswith("the code the cell compiles is torch.compile'd") for a in warm.advice)
    finally:
        torch._dynamo.reset()
    run_cell("%%amp --repeat 3 --warmup 0 --dtype bf16 -q -r plain\nm(x).sum()")
    assert ip.user_ns["plain"].compiled_while_timed == 0 and ip.user_ns["plain"].compiled == []


def test_an_inference_mode_cell_gets_its_flops_and_reduced_precision_share(run_cell, ip):
    # Under inference_mode the audit's dispatch mode saw aten::linear whole, which has no FLOP
    # formula: 0 FLOPs, "achieved" n/a, no reduced-precision share, linear not a heavy op.
    run_cell("import torch, torch.nn as nn\n"
             "m = nn.Sequential(nn.Linear(128, 500), nn.ReLU(), nn.Linear(500, 4)).eval()\n"
             "X = torch.randn(64, 128)")
    _, out = run_cell("%%amp --dtype bf16 --device cpu --repeat 1 --warmup 0 -r res\n"
                      "with torch.inference_mode():\n    preds = m(X)")
    res = ip.user_ns["res"]
    flops = 2 * 64 * (128 * 500 + 500 * 4)
    assert res.baseline.flops == res.amp.flops == flops
    assert res.precision["reduced_flop_share"] == 1.0 and "aten::addmm" in res.precision["reduced"]
    assert "share of FLOPs in reduced precision: 100%" in out.outputs[0].data["text/plain"]
    assert sorted(m["unaligned"] for m in res.unaligned_matmuls) == [[4, 500], [500]]  # padding advice sees them
    # the same cell under no_grad reads the same
    run_cell("%%amp --dtype bf16 --device cpu --repeat 1 --warmup 0 -q -r res2\n"
             "with torch.no_grad():\n    preds = m(X)")
    assert ip.user_ns["res2"].amp.ops[["op", "dtype", "calls", "flops"]].equals(
        res.amp.ops[["op", "dtype", "calls", "flops"]])


def test_a_stored_result_names_options_as_its_magic_took_them(run_cell, ip):
    """A user trial: a %%amp result kept with -r and printed later read "use a larger repeat" (Python's
    spelling, from the cell that printed it) under a header saying %%amp."""
    import torch

    ip.user_ns.update(torch=torch, w=torch.randn(16, 16))
    run_cell("%%amp --repeat 2 --warmup 0 -q -r res\n(w @ w).sum()")
    _, out = run_cell("print(res)")
    assert "nbaccel %%amp" in out.stdout and "use --repeat 5" in out.stdout and "repeat=5" not in out.stdout
    assert any("--repeat 5" in a for a in ip.user_ns["res"].to_dict()["advice"])
    assert "use --repeat 5" in ip.user_ns["res"]._repr_html_()
    row = nbaccel.side_by_side(ip.user_ns["res"], ip.user_ns["res"])  # rendered by the row, not the result
    assert "use --repeat 5" in str(row) and "repeat=5" not in str(row) + row._repr_html_()
    # The API's result reads as Python, even when shown while a magic's spelling is on.
    from nbaccel.options import magic_spelling

    api = nbaccel.compare_amp(lambda: (ip.user_ns["w"] @ ip.user_ns["w"]).sum(), repeat=2, warmup=0)
    with magic_spelling():
        assert "repeat=5" in str(api) and "--repeat" not in str(api)


def test_the_fp32_row_is_strict_fp32_under_the_users_medium_matmul_precision(run_cell, ip, flags_set_by_the_cell):
    # Was (a user trial, AMX CPU): with torch.set_float32_matmul_precision("medium") the "fp32" runs
    # read "medium" inside the cell and ran their matmuls in bf16 (error vs float64 0.26, not 5e-5);
    # the row said fp32 and nothing said otherwise.
    run_cell("import types, torch\ntorch.manual_seed(0)\na = torch.randn(256, 256); b = torch.randn(256, 256)\n"
             "ref = a.double() @ b.double()\nbox = types.SimpleNamespace(seen=[])\n"
             "torch.set_float32_matmul_precision('medium')")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\nc = a @ b\n"
                           "box.seen.append((torch.is_autocast_enabled('cpu'), torch.get_float32_matmul_precision(),"
                           " float((c.double() - ref).abs().max())))\nc")
    fp32 = [seen for seen in ip.user_ns["box"].seen if not seen[0]]
    assert len(fp32) == 3 + 1 + 1  # timed, audited, memory
    assert {precision for _, precision, _ in fp32} == {"highest"}
    assert max(error for _, _, error in fp32) < 1e-3  # strict fp32 (bf16 math: about 0.2)
    assert torch.get_float32_matmul_precision() == "medium", "the user's setting is back"
    shown = captured.outputs[0].data["text/plain"]
    assert 'not as your torch.set_float32_matmul_precision("medium") asks' in unfolded(shown)


def test_no_restore_still_puts_torchs_settings_back_before_every_run(run_cell, ip, flags_set_by_the_cell):
    # Was (a user trial): --no-restore also stopped restoring torch's settings, so after the first run
    # every run -- fp32 ones too -- ran with grad off and "medium" matmuls the cell had left.
    run_cell("import types, torch\nbox = types.SimpleNamespace(seen=[])")
    run_cell("%%amp --repeat 3 --warmup 0 --no-restore -q\n"
             "box.seen.append((torch.is_grad_enabled(), torch.get_float32_matmul_precision()))\n"
             "torch.set_grad_enabled(False)\ntorch.set_float32_matmul_precision('medium')\n"
             "torch.ones(8, 8) @ torch.ones(8, 8)")
    seen = ip.user_ns["box"].seen
    assert len(seen) == nbaccel.amp.planned_runs(0, 3, device="cpu")
    assert set(seen) == {(True, "highest")}
    # The kept run's own changes stay, as after one run of the cell (as without --no-restore).
    assert not torch.is_grad_enabled() and torch.get_float32_matmul_precision() == "medium"


def test_no_restore_on_a_training_step_that_turns_grad_off_is_not_blamed_on_bf16(run_cell, ip, flags_set_by_the_cell):
    # Was: "the cell raised RuntimeError in the bf16 autocast run (the fp32 run had succeeded) ...
    # element 0 of tensors does not require grad": the fp32 run had left grad mode off.
    run_cell(TRAIN)
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 --no-restore -r res\nopt.zero_grad()\n"
                           "loss = torch.nn.functional.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n"
                           "torch.set_grad_enabled(False)  # for an evaluation after it\nloss")
    assert "raised" not in unfolded(captured.stderr)
    res = ip.user_ns["res"]
    assert "torch's settings were put back before each run" in unfolded(res)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # torch 2.13 deprecates quantized tensors
@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated")  # and its eager quantization API
def test_int8_matmuls_are_named_as_what_autocast_leaves_alone(run_cell, ip):
    # A user trial: quantize_dynamic(model)(x) and torch._int_mm(a, b) were told "autocast had nothing here
    # to cast (it leaves reductions, elementwise ops and ops such as mv ...)": the cells were all matmuls.
    run_cell("import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
             "model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))\n"
             "q = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)\n"
             "x = torch.randn(16, 64)\n"
             "a = torch.randint(-128, 127, (32, 64), dtype=torch.int8)\n"
             "b = torch.randint(-128, 127, (64, 32), dtype=torch.int8)")
    for cell, op in (("q(x)", "quantized::linear_dynamic"), ("torch._int_mm(a, b)", "aten::_int_mm")):
        run_cell(f"%%amp --dtype bf16 --device cpu --repeat 3 --warmup 0 -q -r res\n{cell}")
        line = unfolded(next(a for a in ip.user_ns["res"].advice if a.startswith("No speedup")))
        assert f"the matmuls here are int8 ({op}): autocast casts float32 ops only and leaves integer and " \
               "quantized ops alone; compare bf16 on the fp32 version" in line, line
        assert "nothing here to cast" not in line


def test_gradient_entries_zeroed_without_a_relu_are_not_blamed_on_one(run_cell, ip):
    # A user trial: a packed LSTM + Linear (no ReLU, max or dropout) read "switched off: 81 entries ... (a
    # ReLU, max or dropout whose input flipped sign with rounding)"; they were small entries of sums that
    # bf16 rounding cancelled. Here w's gradient is 1.0 - 0.999 in fp32 and 1 - 1 in bf16.
    run_cell("import torch\nw = torch.nn.Parameter(torch.ones(1, 1))\nX = torch.tensor([[1.0], [-0.999]])")
    _, captured = run_cell("%%amp --dtype bf16 --device cpu --repeat 3 --warmup 0 -r res\n"
                           "w.grad = None\nloss = torch.mm(X, w).sum()\nloss.backward()\nloss")
    g = ip.user_ns["res"].gradients
    assert g["switched_off_elements"] == 1 and g["switch_ops"] == []
    assert g["switched_off_largest"] == pytest.approx(1e-3, rel=1e-3)
    text = " ".join(captured.outputs[0].data["text/plain"].split())
    assert ("switched off: 1 entry of normal size in fp32 became 0 in bf16 (rounding or cancellation in a sum made "
            "them exactly 0 (the op audit saw no ReLU, max or dropout); in fp32 they were at most 0.001") in text
    assert "flipped sign" not in text


def test_the_gradscaler_line_says_the_underflow_measured_this_step(run_cell, ip, cpu_with_bf16_and_fp16_units):
    # A user trial: "underflow: 2081 entries nonzero in fp32 became 0 in fp16 (0.054%)", then "fp16 training
    # without torch.amp.GradScaler: no overflow this step, but small gradients can underflow later".
    # Here big's 4096 gradient entries are of normal size; tiny's one is 1e-9 x 4, lost in fp16.
    run_cell("import torch\nbig = torch.nn.Parameter(torch.ones(64, 64))\ntiny = torch.nn.Parameter(torch.ones(1, 1))\n"
             "x, z = torch.ones(8, 64), torch.ones(4, 1)")
    run_cell("%%amp --dtype fp16 --device cpu --repeat 3 --warmup 0 -q -r res\nbig.grad = tiny.grad = None\n"
             "loss = torch.mm(x, big).float().sum() + torch.mm(z, tiny).float().sum() * 1e-9\nloss.backward()")
    res = ip.user_ns["res"]
    g = res.gradients
    assert g["underflow_elements"] == 1 and 0 < g["underflow_fraction"] < 0.001
    line = unfolded(next(a for a in res.advice if a.startswith("fp16 training without")))
    assert line == ("fp16 training without torch.amp.GradScaler: no overflow this step, and 1 gradient entry (0.024% of "
                    "the nonzero ones) underflowed to 0 this step: a GradScaler scales the loss so they stay "
                    "representable."), line


def test_a_gradscaler_under_bf16_is_said_to_be_unneeded(run_cell, ip):
    # The scaler guards fp16's narrow range; bf16 has fp32's, and the scaler's inf/NaN check costs per step.
    run_cell("import torch\ntorch.manual_seed(0)\nm = torch.nn.Linear(16, 4)\n"
             "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nscaler = torch.amp.GradScaler('cpu')\nx = torch.randn(8, 16)")
    step = ("opt.zero_grad()\nloss = m(x).float().pow(2).mean()\nscaler.scale(loss).backward()\n"
            "scaler.step(opt)\nscaler.update()")
    run_cell(f"%%amp --dtype bf16 --device cpu --repeat 3 --warmup 0 -q -r res\n{step}")
    line = unfolded(next(a for a in ip.user_ns["res"].advice if "GradScaler" in a))
    assert line.startswith("The cell scales its loss with a torch.amp.GradScaler, which bf16 does not need: bf16 has "
                           "fp32's exponent range (smallest normal 1.2e-38, largest 3.4e+38)"), line
    assert "(aten::_amp_foreach_non_finite_check_and_unscale_: 1 call in this step)" in line
    assert "torch.amp.GradScaler(enabled=False)" in line
    # Without a scaler, or a scaler made with enabled=False: nothing to say.
    run_cell("scaler = torch.amp.GradScaler('cpu', enabled=False)")
    run_cell(f"%%amp --dtype bf16 --device cpu --repeat 3 --warmup 0 -q -r res\n{step}")
    assert not any("GradScaler" in a for a in ip.user_ns["res"].advice)


def test_a_sum_that_cancels_to_near_0_is_not_read_as_a_100_percent_drift(run_cell, ip):
    # Was (a user trial): "drift max rel 1.00e+00" and "The result moved by 100.0% (relative) under
    # bf16" for out.sum() of a TransformerEncoderLayer: fp32 4.3e-4 from outputs up to 4.8, bf16 0.0.
    run_cell("import torch\ntorch.manual_seed(0)\n"
             "layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)\n"
             "src = torch.randn(4, 16, 64)")
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\nout = layer(src)\nout.sum()")
    res = ip.user_ns["res"]
    shown = captured.outputs[0].data
    assert "(result near 0, no relative figure)" in shown["text/plain"]
    assert "moved by" not in shown["text/plain"] and "drift max rel" not in shown["text/plain"]
    assert "result near 0: max abs" in shown["text/html"]
    near = next(a for a in res.advice if "is near 0" in a)
    assert "bf16's resolution at that size is" in near and "Judge accuracy on a result of normal size" in near


def test_a_cell_that_changes_a_modules_structure_does_it_once(run_cell, ip):
    """A user trial: a hook registered in the cell was registered 17 times (once per run), and a cell
    whose bf16 run failed after weight_norm left the model broken while the note said "restored"."""
    run_cell("import torch\nfrom torch import nn\nmodel = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))\n"
             "x = torch.randn(4, 8)\ncalls = []")
    run_cell("%%amp --repeat 3 --warmup 0 -q\nmodel[0].register_forward_hook(lambda m, i, o: calls.append(1))\n"
             "model(x).sum()")
    assert len(ip.user_ns["model"][0]._forward_hooks) == 1 and len(ip.user_ns["calls"]) == 1
    run_cell("%%amp --repeat 3 --warmup 0 -q\nnn.utils.parametrizations.weight_norm(model[2])\n"
             "if torch.is_autocast_enabled('cpu'): raise ValueError('fails in bf16')\nmodel(x).sum()",
             expect_error=ValueError)
    assert type(ip.user_ns["model"][2]) is torch.nn.Linear and ip.user_ns["model"](ip.user_ns["x"]).shape == (4, 2)
    with pytest.raises(UsageError, match=r"`lazy` has lazy parameters not initialized yet \(a LazyLinear\).*--no-restore"):
        run_cell("lazy = nn.LazyLinear(2)")
        ip.run_cell_magic("amp", "--repeat 3", "lazy(x)")
    # one the cell does not read is left alone (the magic's cell function holds the whole namespace)
    run_cell("%%amp --repeat 3 --warmup 0 -q -r res\nx @ x.T")
    assert ip.user_ns["res"].drift["compared"] == 16


def test_a_greedy_decodes_tokens_are_compared_position_by_position(run_cell, ip):
    """A generate loop's LongTensor read "drift not computed (the result holds no float tensor ...)": integers
    have no relative error. The report now says whether bf16 produced the same tokens, and where each
    sequence first took another one (tests/token_model.py: bf16 picks 6 after 5 where fp32 picks 7)."""
    from token_model import SOURCE, decode

    run_cell(SOURCE)
    _, captured = run_cell("%%amp --repeat 3 --warmup 0 -r res\nout = model.generate(ids, max_new_tokens=6)\nout")
    prompts = [[0, 1], [2, 3], [4, 5], [6, 7]]
    fp32, bf16 = ([decode(p, 6, bf16=b) for p in prompts] for b in (False, True))
    assert torch.equal(ip.user_ns["out"], torch.tensor(bf16))  # the kept run is the recipe's
    res = ip.user_ns["res"]
    tokens = res.tokens
    (leaf,) = tokens["leaves"]
    # the prompt (what the model's embedding took first) is left out: 4 sequences x 6 new tokens
    assert leaf["prompt"] == 2 and tokens["compared"] == 24
    assert tokens["agree"] == sum(f == b for fs, bs in zip(fp32, bf16) for f, b in zip(fs[2:], bs[2:])) == 12
    # 0, 1 -> 2 3 4 5 | 7 vs 6; 2, 3 -> 4 5 | ...; 4, 5 -> | 7 vs 6; 6, 7 -> 0 1 2 3 4 5, never reaching a 5 first
    assert leaf["first_divergence"] == [4, 2, 0, None] and tokens["diverged"] == 3
    assert res.drift is None and res.drift_skipped is None  # not "not computed": the tokens are the comparison
    shown = captured.outputs[0].data
    text = unfolded(shown["text/plain"])
    assert text.split(" method: ")[0].count("not computed") == 0
    assert shown["text/plain"].splitlines()[0].endswith("tokens agree 50% (3 of 4 sequences diverge)")
    assert ("tokens of the result: agree at 50% of the 24 new tokens; 3 of 4 sequences diverge, first after 2 of "
            "6 new tokens (median of the 3)") in text
    assert "tokens (fp32 vs bf16)" in shown["text/html"] and "agree 50%" in shown["text/html"]
    assert json.loads(res.to_json())["tokens"]["leaves"][0]["first_divergence"] == [4, 2, 0, None]

    # Identical tokens: a prompt whose path never reaches 5 in 4 new tokens
    run_cell("%%amp --repeat 3 --warmup 0 -q -r same\nmodel.generate(ids[3:], max_new_tokens=4)")
    same = ip.user_ns["same"]
    assert same.tokens["agree"] == same.tokens["compared"] == 4 and same.tokens["diverged"] == 0
    assert "tokens identical" in str(same).splitlines()[0]
    assert "tokens of the result: identical in both runs (1 sequence x 4 new tokens)" in unfolded(same)


def test_a_decode_that_stops_at_another_length_is_said_not_a_crash(run_cell, ip):
    """fp32 reaches the end token 0 one step before bf16 (3 4 5 7 0 against 3 4 5 6 7 0): the two results
    have other shapes, which the report says, comparing the positions both have."""
    from token_model import SOURCE, decode

    run_cell(SOURCE)
    run_cell("%%amp --repeat 3 --warmup 0 -q -r res\nmodel.generate(torch.tensor([[3]]), 10, eos_token_id=0)")
    assert decode([3], 10, False, eos=0) == [3, 4, 5, 7, 0] and decode([3], 10, True, eos=0) == [3, 4, 5, 6, 7, 0]
    res = ip.user_ns["res"]
    (leaf,) = res.tokens["leaves"]
    assert leaf["lengths_differ"] and (leaf["fp32_length"], leaf["amp_length"]) == (4, 5)
    assert leaf["compared"] == 4 and leaf["agree"] == 2 and leaf["first_divergence"] == [2]
    assert str(res).splitlines()[0].endswith("tokens agree 50% (the sequence diverges, lengths differ)")
    assert ("tokens of the result: lengths differ (generation stopped at another length): fp32 has 4 new tokens per "
            "sequence, bf16 5; over the first 4: agree at 50% of the 4 new tokens; the sequence diverges after 2 of "
            "4 new tokens") in unfolded(res)


def test_an_optimizer_without_state_is_named_as_a_first_step(run_cell, ip):
    """A trial: %%amp on an AdamW MLP's first step read "memory used +10% vs fp32", on its later steps "memory
    saved 17%", with nothing to say why: restored stateless before every run, each run's step created AdamW's
    state (two buffers the size of the parameters). The report says so, with the bytes, and how to measure a
    steady step; once the optimizer has state, nothing is said."""
    run_cell("import torch\ntorch.manual_seed(0)\n"
             "m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))\n"
             "x = torch.randn(32, 64)\nopt = torch.optim.AdamW(m.parameters())\n"
             "params = sum(p.numel() for p in m.parameters())")
    _, captured = run_cell("%%amp --repeat 3 -r first\nopt.zero_grad()\nm(x).sum().backward()\nopt.step()")
    first = ip.user_ns["first"]
    params = ip.user_ns["params"]
    # exp_avg and exp_avg_sq in fp32 per parameter, plus one step counter per parameter tensor
    assert first.optimizer_state_created == [("opt", "AdamW", 2 * 4 * params + 4 * 4)]
    note = next(a for a in first.advice if a.startswith("`opt` (AdamW, "))
    assert re.fullmatch(r"`opt` \(AdamW, [\d.]+ KiB of state\) had no state when the cell began, so every run's step "
                        r"created it, as a first step does: that allocation is in both variants' peaks and times, and a "
                        r"later step, which has the state already, can compare otherwise\. To measure a steady step, run "
                        r"the step once before %%amp \(the variables are restored before every run, so a warm-up run "
                        r"does not help\); the kept run left it with state\.", note), note
    assert "had no state when the cell began" in unfolded(captured.outputs[0].data["text/plain"])
    saved = first.to_dict()["optimizer_state_created"]
    assert saved == [{"name": "opt", "optimizer": "AdamW", "bytes": 2 * 4 * params + 4 * 4}]
    assert len(ip.user_ns["opt"].state) == 4  # the kept run's step, as one step leaves it
    run_cell("%%amp --repeat 3 -q -r later\nopt.zero_grad()\nm(x).sum().backward()\nopt.step()")
    later = ip.user_ns["later"]
    assert later.optimizer_state_created == [] and not any("had no state" in a for a in later.advice)
    # --no-restore: only the first run created it, and no note claims every run did
    run_cell("opt2 = torch.optim.AdamW(m.parameters())")
    run_cell("%%amp --repeat 3 -q --no-restore -r unrestored\nopt2.zero_grad()\nm(x).sum().backward()\nopt2.step()")
    assert ip.user_ns["unrestored"].optimizer_state_created == []
