"""A cell that is a training loop, or that reads the next batch from an iterator, under %%amp.

Two findings of a user trial: several optimizer steps under the one autocast region the recipe
wraps around a cell trained on stale weights (autocast's weight-cast cache), and a value that moved
because the cell read a new batch was blamed on bf16 (the bf16 tolerance let a 1.5 % change through).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import nbaccel
from text_helpers import note_lines


def _model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model, opt, x, y


def _epoch(model, opt, x, y, forward_context=None, steps=3):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with forward_context() if forward_context else torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_loop_of_optimizer_steps_trains_under_the_recipe_as_with_autocast_around_the_forward():
    model, opt, x, y = _model_and_data()
    with nbaccel.precision("bf16", device="cpu"):
        under_recipe = _epoch(model, opt, x, y)
    model, opt, x, y = _model_and_data()
    forward_only = _epoch(model, opt, x, y, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert under_recipe[0] > under_recipe[1] > under_recipe[2]  # stale weights gave three equal losses
    for a, b in zip(under_recipe, forward_only):
        assert abs(a - b) < 1e-3 * abs(b)


def test_the_step_hook_is_gone_after_the_recipe_whatever_happened():
    hooks_before = len(_global_optimizer_post_hooks)
    with nbaccel.precision("bf16", device="cpu"):
        assert len(_global_optimizer_post_hooks) == hooks_before + 1
    assert len(_global_optimizer_post_hooks) == hooks_before
    try:
        with nbaccel.precision("bf16", device="cpu"):
            raise ValueError("the cell failed")
    except ValueError:
        pass
    assert len(_global_optimizer_post_hooks) == hooks_before
    with nbaccel.precision("fp32", device="cpu"):  # no autocast, no cache to clear, no hook
        assert len(_global_optimizer_post_hooks) == hooks_before


def test_compare_amp_of_an_epoch_reports_a_small_drift_not_a_precision_failure():
    model, opt, x, y = _model_and_data()
    res = nbaccel.compare_amp(lambda: torch.tensor(_epoch(model, opt, x, y)), dtype="bf16", device="cpu",
                              repeat=3, warmup=0)
    assert res.value[0] > res.value[1] > res.value[2]
    assert res.drift["max_rel"] < 0.01  # was 0.53: the bf16 losses never moved
    assert not res.state_changed


def test_the_next_batch_from_an_iterator_is_state_that_changed_not_bf16_drift():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    # Batches whose losses differ by ~1 %: under the 3 % that two bf16 runs may differ by, far over
    # what two fp32 runs may. A generator cannot be copied, so the snapshot cannot rewind it.
    base = torch.randn(32, 64)
    batches = (base * (1 + 0.01 * i) for i in range(1000))

    def step():
        with torch.no_grad():
            return model(next(batches)).square().mean()

    res = nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert res.state_changed
    assert res.advice[0].startswith("`batches` (a generator) is an iterator the cell takes items from")
    assert "(state changed between runs)" in str(res).splitlines()[0]


def test_a_cell_with_fixed_data_is_not_said_to_depend_on_state():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(64, 10), torch.randn(32, 64)
    res = nbaccel.compare_amp(lambda: model(x).square().mean(), dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert not res.state_changed


def test_an_epoch_cell_under_the_magic_prints_falling_losses(run_cell, ip):
    run_cell("""
import torch
torch.manual_seed(0)
model = torch.nn.Linear(64, 10)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
""")
    _, out = run_cell("""%%amp --dtype bf16 --repeat 3 -q -r res
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("losses", losses)
""")
    losses = ip.user_ns["losses"]
    assert losses[0] > losses[1] > losses[2], out
    assert not ip.user_ns["res"].state_changed


def test_a_cell_that_turns_on_autocast_itself_is_told_its_fp32_run_was_not_fp32(run_cell, ip):
    run_cell("""
import torch
torch.manual_seed(0)
model, x = torch.nn.Linear(64, 64), torch.randn(32, 64)
""")
    _, out = run_cell("""%%amp --dtype bf16 --repeat 3 -r res
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(x)
out.float().sum()
""")
    advice = ip.user_ns["res"].advice
    assert any("The fp32 run was not fp32" in line and "addmm" in line for line in advice), advice
    shown = out.outputs[0].data
    assert "The fp32 run was not fp32" in shown["text/plain"]
    assert "The fp32 run was not fp32" in shown["text/html"]
    # Was only in the advice: the headline showed speedup and drift unflagged and the table called
    # the row "fp32". Now both say so where a quick reader looks.
    text = shown["text/plain"]
    assert ": fp32 run not fp32 (the cell runs bf16 itself): speedup" in text.splitlines()[0]
    fp32_row = next(line for line in text.splitlines() if line.startswith("fp32 "))
    assert "fp32 + the cell's own bf16" in fp32_row
    assert '<div class="muted">fp32 run</div><div class="big warn">not fp32</div>' in shown["text/html"]
    assert "fp32 + the cell&#x27;s own bf16" in shown["text/html"] or "fp32 + the cell's own bf16" in shown["text/html"]
    assert ip.user_ns["res"].to_dict()["baseline_reduced"] == ["bf16"]


def test_a_plain_fp32_cell_gets_no_such_note():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(64, 64), torch.randn(32, 64)
    res = nbaccel.compare_amp(lambda: model(x).sum(), dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert not any("was not fp32" in line for line in res.advice)
    assert res.baseline_reduced == [] and "not fp32" not in str(res) and "cell's own" not in str(res)


def test_a_step_with_sparse_gradients_is_compared_and_applied_once():
    """A user trial: nn.Embedding(sparse=True) gives a sparse gradient, and the gradient report's
    isfinite() refused it, so every %%amp of such a step failed as "a bug in nbaccel"."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(1000, 16, sparse=True), torch.nn.Linear(16, 4)
    sparse_opt, dense_opt = torch.optim.SparseAdam(list(emb.parameters())), torch.optim.Adam(head.parameters())
    idx = torch.randint(0, 1000, (32,))

    def step():
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss = head(emb(idx)).pow(2).mean()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        return loss.detach()

    res = nbaccel.compare_amp(step, repeat=2, warmup=0,
                              namespace={"emb": emb, "head": head, "sparse_opt": sparse_opt, "dense_opt": dense_opt})
    assert res.gradients["tensors_with_grad"] == 3 and res.gradients["overflow_tensors"] == 0
    assert res.gradients["underflow_elements"] == 0  # the sparse entries compared by index: none zeroed
    assert emb.weight.grad.layout == torch.sparse_coo
    assert sparse_opt.state[emb.weight]["step"] == 1  # as after exactly one step


def test_tensors_made_bf16_in_an_earlier_cell_are_named_as_a_cause(run_cell, ip):
    """A trial: q, k, v made bf16 in an earlier cell were told "the cell turns on torch.autocast or casts to
    bf16 itself ... take the autocast out of the cell", though it did neither."""
    run_cell("import torch\na, b = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()")
    run_cell("%%amp -q -r res --repeat 3\n(a @ b).float().sum()")
    line = next(x for x in ip.user_ns["res"].advice if x.startswith("The fp32 run was not fp32"))
    assert "or works on bf16 tensors made earlier (a model or inputs converted with .to() in an earlier cell)" in line
    assert line.endswith("give the cell fp32 tensors and model, without an autocast or cast of its own, to compare "
                         "against fp32.")


def test_gradient_and_update_drift_from_runs_on_other_batches_are_flagged():
    """Trial 34: "gradient drift against fp32: ... median 148.36%" from runs that each took another batch from an
    iterator, flagged nowhere but in the headline's result drift."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter([torch.randn(8, 16) for _ in range(40)])

    def step():
        opt.zero_grad()
        loss = model(next(batches)).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    res = nbaccel.compare_amp(step, dtype="bf16", device="cpu", repeat=3, warmup=0)
    assert res.iterators and res.gradients["relative_error"] and res.gradients["update_error"]
    lines = [line for line in note_lines(str(res)) if "drift against fp32" in line]
    assert len(lines) == 2 and all(line.endswith("(state changed between runs: not a measure of precision)")
                                   for line in lines), lines
