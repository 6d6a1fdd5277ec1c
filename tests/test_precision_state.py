"""Property tests: the float32 precision settings, over both of torch's API families, are put back
exactly as torch kept them -- by a recipe (`apply_recipe`) and by `TorchGlobals` -- and a recipe
leaves what one plain run of its body would leave.

Hypothesis draws a starting state (a few calls of the legacy setters and of the new API's
``fp32_precision`` setters, from torch's defaults: only states torch accepts), a recipe and a body
that makes at most one such call and then returns or raises. What torch keeps is read independently
of nbaccel (`_revealed`, which changes torch's settings to see the values its readings hide), so
the states compared include the legacy values torch refuses to read and a "none" that follows its
backend. ``NBACCEL_PROPERTY_EXAMPLES`` scales the number of examples (10 per unit; CI: 20).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbaccel.precision import (NEW_TF32_API, Recipe, TorchGlobals, _fp32_state, _write_fp32_state, apply_recipe,
                               global_state, make_recipe)

EXAMPLES = 10 * int(os.environ.get("NBACCEL_PROPERTY_EXAMPLES", "20"))

pytestmark = pytest.mark.skipif(not NEW_TF32_API, reason="the two API families are torch >= 2.9")

OPS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
CUDA = ("cudnn", "cuda.matmul", "cudnn.conv", "cudnn.rnn")  # torch refuses "bf16" for these


def _owner(path):
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def _set_precision(path, value):
    setattr(_owner(path), "fp32_precision", value)


def _set_mkldnn_backend(value):  # the attribute's setter writes the generic value; this writes oneDNN's own
    torch.backends.mkldnn.set_flags(_fp32_precision=value)


def _call(write) -> None:
    """One call a user's code can make: (what, value)."""
    what, value = write
    if what == "set_float32_matmul_precision":
        torch.set_float32_matmul_precision(value)
    elif what == "cuda.matmul.allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = value
    elif what == "cudnn.allow_tf32":
        torch.backends.cudnn.allow_tf32 = value
    elif what == "cudnn.benchmark":
        torch.backends.cudnn.benchmark = value
    elif what == "mkldnn.set_flags":
        _set_mkldnn_backend(value)
    else:
        _set_precision(what, value)


_legacy_writes = st.one_of(
    st.tuples(st.just("set_float32_matmul_precision"), st.sampled_from(["highest", "high", "medium"])),
    st.tuples(st.sampled_from(["cuda.matmul.allow_tf32", "cudnn.allow_tf32"]), st.booleans()))
_new_writes = st.one_of(
    st.tuples(st.sampled_from(["", "mkldnn", "mkldnn.set_flags", *OPS[3:]]),
              st.sampled_from(["none", "ieee", "tf32", "bf16"])),
    st.tuples(st.sampled_from(CUDA), st.sampled_from(["none", "ieee", "tf32"])))
WRITES = st.one_of(_legacy_writes, _new_writes)
BODY_WRITES = st.one_of(WRITES, st.tuples(st.just("cudnn.benchmark"), st.booleans()))

RECIPES = {
    "fp32 (cpu)": lambda: make_recipe("fp32", "cpu"),
    "bf16 autocast (cpu)": lambda: make_recipe("bf16", "cpu"),
    "tf32 (cuda)": lambda: Recipe("cuda", None, tf32=True, cudnn_benchmark=True),
    "fp32 (cuda)": lambda: Recipe("cuda", None, tf32=False, autocast_off=("cpu",)),
    "bf16 autocast + tf32": lambda: Recipe("cpu", torch.bfloat16, tf32=True),
    "bf16 autocast, cpu as the user has it": lambda: Recipe("cpu", torch.bfloat16, cpu_strict=False),
}


def _defaults() -> None:
    """torch's own defaults (as a fresh process has them)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    _set_precision("", "none")
    _set_precision("cudnn", "none")
    _set_mkldnn_backend("none")
    for path, value in zip(OPS, ("none", "tf32", "tf32", "none", "none", "none")):
        _set_precision(path, value)


def _start(writes) -> None:
    _defaults()
    for write in writes:
        _call(write)


def _follows(path, fallback_writer) -> bool:
    """Whether ``path``'s value is "none" (it reads whatever its fallback is set to)."""
    seen = []
    for probe in ("ieee", "tf32"):
        fallback_writer(probe)
        seen.append(_owner(path).fp32_precision)
    return seen == ["ieee", "tf32"]


def _revealed() -> dict:
    """What torch keeps, read without nbaccel and destructively (torch's settings are changed): every
    fp32_precision as set and both legacy values, also where torch refuses to read them."""
    state = {"cudnn.benchmark": torch.backends.cudnn.benchmark, "": torch.backends.fp32_precision}
    for path in ("cudnn", "mkldnn"):  # each before the ops whose "none" falls back to it: it is changed for them
        reading = _owner(path).fp32_precision
        state[path] = "none" if _follows(path, lambda v: _set_precision("", v)) else reading
    for path in OPS:
        reading = _owner(path).fp32_precision
        backend = (lambda v: _set_precision("cudnn", v)) if path in CUDA else _set_mkldnn_backend
        state[path] = "none" if _follows(path, backend) else reading
    for path in ("cuda.matmul", "mkldnn.matmul"):  # then torch reads the legacy value, whatever it is
        _set_precision(path, "ieee")
    state["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    for path in ("cudnn.conv", "cudnn.rnn"):
        _set_precision(path, "tf32")
    try:
        state["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32  # readable only where it is True
    except RuntimeError:
        state["cudnn.allow_tf32"] = False
    return state


def _readable(state: dict) -> set:
    return {key for key, value in state.items() if not (isinstance(value, str) and value.startswith("<unreadable"))}


@pytest.fixture(autouse=True)
def _quiet_and_put_back():
    saved = TorchGlobals()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast on a device type this build lacks, and the like
        yield
    saved.restore()


# --- the state as nbaccel sees it -----------------------------------------------------------------

def _as_revealed(fp32_state: dict) -> dict:
    """A `_fp32_state` in `_revealed`'s keys."""
    return {("" if key == "fp32_precision" else key.removesuffix(".fp32_precision")): value
            for key, value in fp32_state.items()}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.lists(WRITES, max_size=5), other=st.lists(WRITES, max_size=5))
def test_nbaccel_reads_what_torch_keeps_and_writes_it_back_exactly(start, other):
    _start(start)
    expected = _revealed()
    _start(start)
    readings, seen = global_state(), _fp32_state()
    assert {**_as_revealed(seen), "cudnn.benchmark": expected["cudnn.benchmark"]} == expected
    assert global_state() == readings and _revealed() == expected, "finding it out changed nothing"
    _start(other)  # written back over any other state: the same readings, the same hidden values
    _write_fp32_state(seen, _fp32_state())
    assert global_state() == readings and _revealed() == expected


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.lists(WRITES, max_size=5), body=st.lists(BODY_WRITES, max_size=3))
def test_torch_globals_put_back_exactly_what_torch_kept(start, body):
    _start(start)
    expected = _revealed()
    _start(start)
    readings, saved = global_state(), TorchGlobals()
    for write in body:
        _call(write)
    saved.restore()
    assert global_state() == readings and _revealed() == expected


# --- a recipe leaves what one plain run of its body leaves ----------------------------------------

class BodyFailed(Exception):
    pass


def _run(start, write, raises, recipe=None):
    """(global_state, what torch keeps) after the body ran from ``start``, under ``recipe`` or plainly,
    and (under a recipe) the fp32 state and cudnn.benchmark just before and after the body's call."""
    _start(start)
    inside = []

    def body():
        if recipe is not None:
            inside.append((_fp32_state(), torch.backends.cudnn.benchmark))
        if write is not None:
            _call(write)
        if recipe is not None:
            inside.append((_fp32_state(), torch.backends.cudnn.benchmark))
        if raises:
            raise BodyFailed

    try:
        if recipe is None:
            body()
        else:
            with apply_recipe(recipe):
                body()
    except BodyFailed:
        pass
    return global_state(), _revealed(), inside


ALL_CALLS = [  # every call BODY_WRITES draws, and none
    None, *[("set_float32_matmul_precision", v) for v in ("highest", "high", "medium")],
    *[(what, b) for what in ("cuda.matmul.allow_tf32", "cudnn.allow_tf32", "cudnn.benchmark") for b in (False, True)],
    *[(path, v) for path in ("", "mkldnn", "mkldnn.set_flags", *OPS[3:]) for v in ("none", "ieee", "tf32", "bf16")],
    *[(path, v) for path in CUDA for v in ("none", "ieee", "tf32")]]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.lists(WRITES, max_size=5), recipe=st.sampled_from(sorted(RECIPES)),
       write=st.none() | BODY_WRITES, raises=st.booleans())
def test_a_recipe_leaves_what_one_plain_run_of_the_body_leaves(start, recipe, write, raises):
    before_readings, before, _ = _run(start, None, False)
    plain_readings, plain, _ = _run(start, write, raises)
    readings, kept, (as_set, left) = _run(start, write, raises, RECIPES[recipe]())
    # Whatever happened: what torch could read before and after the plain run, it can read now.
    assert _readable(before_readings) & _readable(plain_readings) <= _readable(readings)
    if raises:
        assert kept == before and readings == before_readings, "everything as before"
        return
    if kept == plain:
        assert readings == plain_readings
        return
    # The recipe cannot tell calls apart that leave the same state under it (a call writing what the
    # recipe had set is not seen; mkldnn.matmul.fp32_precision = "tf32" under the TF32 recipe leaves
    # what torch.set_float32_matmul_precision("high") leaves): what it keeps is what one plain run of
    # one of them leaves.
    alike = [call for call in ALL_CALLS if call != write
             and _run(start, call, False, RECIPES[recipe]())[2] == [as_set, left]]
    assert alike, (write, kept, plain)
    assert any(_run(start, call, False)[:2] == (readings, kept) for call in alike), (write, alike, kept, plain)


def test_the_cpu_line_names_the_units_of_the_dtype_run():
    """A trial's bf16 advice read "reduced-precision units: amx_bf16, avx512_bf16, avx512_fp16"."""
    import dataclasses

    from nbaccel.device import device_info
    from nbaccel.precision import describe

    info = dataclasses.replace(device_info(torch.device("cpu")), cpu_features={
        "amx_bf16": True, "avx512_bf16": True, "amx_fp16": False, "avx512_fp16": True})
    assert describe(info, "bf16") == "CPU autocast (no GPU here); bf16 units: amx_bf16, avx512_bf16"
    assert describe(info, "fp16") == "CPU autocast (no GPU here); fp16 units: avx512_fp16"
    assert describe(info).endswith("reduced-precision units: amx_bf16, avx512_bf16, avx512_fp16")
    bare = dataclasses.replace(info, cpu_features={})
    assert describe(bare, "bf16").endswith("bf16 units: none, bf16 is emulated")
