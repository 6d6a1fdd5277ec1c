"""Errors name an option the way the user wrote it: ``--top`` under a magic, ``top=`` in Python."""

from __future__ import annotations

import gzip
import re

import pytest
import torch
from IPython.core.error import UsageError

import nbaccel
from nbaccel.device import DeviceError
from nbaccel.options import magic_spelling, option
from nbaccel.profile import ProfileError


def test_option_spelling_inside_and_outside_a_magic():
    assert (option("sort", "x"), option("memory", True), option("top")) == ("sort='x'", "memory=True", "top")
    with magic_spelling():
        assert (option("sort", "x"), option("memory", True), option("max_snapshot")) == \
            ("--sort x", "--memory", "--max-snapshot")
        with magic_spelling(False):
            assert option("top", 0) == "top=0"
    assert option("top", 0) == "top=0"  # the block put the spelling back


@pytest.mark.parametrize("kwargs, said", [
    ({"sort": "x"}, "sort='x' is not a sort key"),
    ({"sort": "memory"}, "sort='memory' needs memory=True"),
    ({"top": 0}, "top must be at least 1"),
    ({"amp": "fp8"}, "amp='fp8' is not supported; use one of: bf16, fp16, auto"),
    ({"trace": "/proc/version/x.json"}, "trace='/proc/version/x.json': cannot write into /proc/version"),
])
def test_python_api_errors_use_keyword_arguments(kwargs, said):
    with pytest.raises(ProfileError) as info:
        with nbaccel.profile(**kwargs):
            pass
    assert said in str(info.value) and "--" not in str(info.value)


def test_compare_amp_names_its_dtype_argument():
    # tf32 listed: compare_amp takes it, and the message said only "bf16, fp16 or auto" (a user trial)
    with pytest.raises(DeviceError, match=r"dtype='fp8' is not an autocast dtype; use bf16, fp16, auto or tf32$"):
        nbaccel.compare_amp(lambda: None, dtype="fp8")


def test_a_misspelt_dtype_is_told_the_one_it_most_likely_meant(run_cell, ip):
    """A trial: precision("bfloat") listed the choices without fp32 (which precision takes) and left the reader
    to work out which one was meant."""
    with pytest.raises(DeviceError, match=re.escape("dtype='bfloat' is not an autocast dtype; use bf16, fp16, auto, "
                                                    "tf32 or fp32 (did you mean dtype='bf16'?)")):
        nbaccel.precision("bfloat")
    with pytest.raises(DeviceError, match=re.escape("dtype='f16' is not an autocast dtype; use bf16, fp16, auto or "
                                                    "tf32 (did you mean dtype='fp16'?)")):
        nbaccel.compare_amp(lambda: None, dtype="f16")
    with pytest.raises(ProfileError, match=re.escape("(did you mean amp='bf16'?)")):
        nbaccel.profile(amp="bf-16")
    with nbaccel.precision("fp32") as recipe:  # the choice the refusal lists, taken
        assert recipe.autocast_dtype is None
    for cell, said in (("%%amp --dtype bfloat\n1", "--dtype bfloat is not supported; use one of: bf16, fp16, auto, "
                                                     "tf32 (did you mean --dtype bf16?)"),
                       ("%%profile_gpu --amp bfloat\n1", "--amp bfloat is not supported; use one of: bf16, fp16, "
                                                          "auto (did you mean --amp bf16?)")):
        result, _ = run_cell(cell, expect_error=UsageError)
        assert str(result.error_before_exec or result.error_in_exec) == said


@pytest.mark.parametrize("cell, said", [
    ("%%profile_gpu --sort memory\n1", "--sort memory needs --memory"),
    ("%%profile_gpu --top 0\n1", "--top must be at least 1"),
    ("%%profile_gpu --trace /proc/version/x.json\n1", "--trace /proc/version/x.json: cannot write into"),
])
def test_magic_errors_use_the_command_line_options(run_cell, cell, said):
    result, _ = run_cell(cell, expect_error=UsageError)
    assert said in str(result.error_before_exec or result.error_in_exec)


def test_api_called_inside_a_magics_cell_speaks_python(run_cell, ip):
    run_cell("%%amp --repeat 1 --warmup 0 -q\nimport nbaccel\ntry:\n    nbaccel.profile(top=0).__enter__()\n"
             "except Exception as exc:\n    said = str(exc)")
    assert ip.user_ns["said"].startswith("top must be at least 1")


def test_profile_trace_magic_names_its_rank_option(run_cell, tmp_path):
    one_file = "tests/data/h200_bf16_transformer_step.json.gz"
    result, _ = run_cell(f"%profile_trace {one_file} --rank 5 -q", expect_error=UsageError)
    assert str(result.error_in_exec).startswith("--rank 5 selects a rank in a folder")
    (tmp_path / "w.pt.trace.json").write_bytes(gzip.decompress(open(one_file, "rb").read()))
    result, _ = run_cell(f"%profile_trace {tmp_path} --rank 5 -q", expect_error=UsageError)
    assert str(result.error_in_exec).endswith("load it without --rank")


@pytest.mark.parametrize("kwargs, said", [
    ({"top": "5"}, "top takes a whole number, got '5'"),
    ({"steps": 1.5}, "steps takes a whole number, got 1.5"),
    ({"warmup": True}, "warmup takes a whole number, got True"),
    ({"trace": 3}, "trace takes a file or folder path, got 3"),
])
def test_wrong_types_in_the_profile_api_say_what_the_argument_takes(kwargs, said):
    with pytest.raises(ProfileError, match=re.escape(said)):
        with nbaccel.profile(**kwargs):
            pass


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """The two results with a ``table()``: a live profile, and a two-rank folder loaded as one."""
    import json

    with nbaccel.profile() as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    folder = tmp_path_factory.mktemp("job")
    for rank, name in enumerate(["aten::add", "aten::mm"]):
        ev = {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": 0, "dur": 1 + rank}
        (folder / f"rank-{rank}.json").write_text(json.dumps({"traceEvents": [ev]}))
    job = nbaccel.load_trace(folder)
    assert type(job).__name__ == "MultiRankResult"
    return {"profile": prof.result, "multirank": job}


@pytest.mark.parametrize("kind", ["profile", "multirank"])
@pytest.mark.parametrize("kwargs, said", [
    ({"top": -1}, "top must be at least 1, got -1"),  # pandas' head(-1) once dropped the last row instead
    ({"top": 0}, "top must be at least 1, got 0"),
    ({"top": "5"}, "top takes a whole number, got '5'"),
    ({"top": True}, "top takes a whole number, got True"),  # head(True) was one row
    ({"top": 2.0}, "top takes a whole number, got 2.0"),
    ({"filter": 3}, "filter takes the text to look for in the names, got 3"),
    ({"filter": None}, "filter takes the text to look for in the names, got None"),
    ({"sort": "nope"}, "sort='nope' is neither a sort key (cpu, self, device, calls, memory, flops) nor a column"),
    ({"sort": 3}, "sort=3 is neither a sort key"),
    ({"group": "line"}, "group='line' is not a grouping; use one of: op, op+shape, source"),
    ({"ascending": "yes"}, "ascending takes True or False, got 'yes'"),
])
def test_result_tables_refuse_what_they_cannot_mean_in_the_same_words(tables, kind, kwargs, said):
    result = tables[kind]
    assert len(result.table(top=1)) == 1
    with pytest.raises(ProfileError, match="^" + re.escape(said)):
        result.table(**kwargs)


@pytest.mark.parametrize("kwargs", [{"top": "5"}, {"filter": 3}, {"group": "line"}])
def test_one_rank_of_a_multirank_table_is_checked_the_same(tables, kwargs):
    job = tables["multirank"]
    with pytest.raises(ProfileError) as merged:
        job.table(**kwargs)
    with pytest.raises(ProfileError) as one:
        job.table(rank=0, **kwargs)
    assert str(one.value) == str(merged.value)


@pytest.mark.parametrize("kind", ["profile", "multirank"])
def test_result_tables_still_take_sort_keys_columns_and_groupings(tables, kind):
    result = tables[kind]
    assert list(result.table(sort="name", ascending=True)["name"]) == sorted(result.table()["name"])
    assert len(result.table(sort="calls", group="op+shape", filter="", top=1)) == 1
    # as profile(sort=...) and the magics read them (a review: "neither a sort key nor a column")
    assert result.table(sort="FLOPS").equals(result.table(sort="flops"))
    assert result.table(sort="count").equals(result.table(sort="calls"))


@pytest.mark.parametrize("spec", ["CPU", " cpu ", "Auto"])
def test_device_names_are_read_in_any_case_like_dtypes(spec):
    from nbaccel.device import resolve_device

    expected = "cpu" if "cpu" in spec.lower() or not torch.cuda.is_available() else "cuda"
    assert resolve_device(spec).type == expected


def test_an_unknown_device_names_the_choices():
    from nbaccel.device import resolve_device

    with pytest.raises(DeviceError, match="unknown device 'tpu'; use auto, cpu or cuda"):
        resolve_device("TPU")


def test_a_profile_error_raised_by_the_cell_is_the_cells_own(run_cell):
    # The magic turns nbaccel's own ProfileErrors into UsageErrors; one the cell raises (its own
    # nbaccel.profile call) is the user's exception and stays what it is.
    result, _ = run_cell("%%profile_gpu -q\nimport nbaccel\nnbaccel.profile(top=0).__enter__()",
                         expect_error=ProfileError)
    assert not isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec).startswith("top must be at least 1")


def test_the_noise_warning_names_repeat_as_the_caller_writes_it():
    from nbaccel.timing import Stats

    x = torch.randn(4, 4)
    result = nbaccel.compare_amp(lambda: x @ x, repeat=3, warmup=0)
    result.baseline.times = Stats([0.010, 0.020, 0.030, 0.040])  # IQR far above 10 % of the median
    assert any(w.endswith("the machine is noisy, use a larger repeat") for w in result.noise_warnings)
    with magic_spelling():  # an API result read while a magic runs: still the API's spelling
        assert any(w.endswith("the machine is noisy, use a larger repeat") for w in result.noise_warnings)
    result.made_by = "%%amp"  # the magic's result, read anywhere: the magic's spelling
    assert any(w.endswith("the machine is noisy, use a larger --repeat") for w in result.noise_warnings)


def test_a_noisy_run_beside_an_idle_machine_says_the_noise_came_from_elsewhere():
    # A trial read "other programs used 0.0 of the 2 CPU cores" beside an IQR of 100 % as reassurance.
    from nbaccel.contention import Contention
    from nbaccel.timing import Stats

    x = torch.randn(4, 4)
    result = nbaccel.compare_amp(lambda: x @ x, repeat=3, warmup=0)
    result.baseline.times = Stats([0.010, 0.020, 0.030, 0.040])
    result.contention = Contention(cores=2, threads=2, wall_s={"fp32": 1.0, "bf16": 1.0},
                                   others_s={"fp32": 0.01, "bf16": 0.0})
    noisy = next(w for w in result.noise_warnings if "the machine is noisy" in w)
    assert noisy.endswith("(other programs on this machine used almost no CPU meanwhile: the variation is the cell's "
                          "own, or comes from what /proc/stat cannot see -- a VM's host, CPU frequency changes)")
    result.contention = Contention(cores=2, threads=1, wall_s={"fp32": 1.0}, others_s={"fp32": 0.2})  # seen: no aside
    assert next(w for w in result.noise_warnings if "noisy" in w).endswith("use a larger repeat")


@pytest.mark.parametrize("cell, said", [
    # A user trial: "--dtype fp32 is not supported" named a spelling not typed, and gave no reason.
    ("%%amp --dtype float32\nran += 1", "--dtype float32 compares fp32 with itself: fp32 is the baseline. Use "
                                        "--dtype bf16"),
    ("%%amp --dtype torch.float32\nran += 1", "--dtype torch.float32 compares fp32 with itself"),
    ("%%amp --dtype FP8\nran += 1", "--dtype FP8 is not supported; use one of: bf16, fp16, auto, tf32"),
    ("%%profile_gpu --amp float32\nran += 1", "--amp fp32: fp32 is what runs without --amp; leave it out"),
])
def test_an_fp32_dtype_says_why_in_the_words_typed(run_cell, ip, cell, said):
    ip.user_ns["ran"] = 0
    result, _ = run_cell(cell, expect_error=UsageError)
    assert said in str(result.error_before_exec or result.error_in_exec)
    assert ip.user_ns["ran"] == 0, "refused before the cell ran"


@pytest.mark.parametrize("typed, key", [("FLOPS", "flops"), ("Self", "self"), ("self_cpu_time_total", "self"),
                                        ("cpu_time_total", "cpu"), ("count", "calls"), ("gpu", "device"),
                                        ("self-cuda-time-total", "device")])
def test_sort_keys_are_read_in_any_case_and_in_torchs_words(typed, key):
    # A user trial: --sort FLOPS and torch's sort_by names were refused with only the list of keys.
    assert nbaccel.profile(sort=typed).options.sort == key
    loaded = nbaccel.load_trace("tests/data/h200_bf16_transformer_step.json.gz", sort=typed)
    assert loaded.options.sort == key


def test_profile_gpu_sorts_by_a_key_typed_in_capitals(run_cell, ip):
    run_cell("%%profile_gpu --sort FLOPS -q -r prof\nimport torch\ntorch.ones(4, 4) @ torch.ones(4, 4)")
    assert ip.user_ns["prof"].options.sort == "flops"


@pytest.mark.parametrize("typed, said", [
    ("time", "--sort time is not a sort key; did you mean --sort device (own GPU time), self (own CPU time) or cpu"),
    ("cuda_time_total", "did you mean --sort device (each op's own device time, torch's self_cuda_time_total: "
                        "nbaccel has no total-device-time sort)?"),
    ("cpu_memory_usage", "did you mean --sort memory (each op's own allocations"),
    ("bogus", "--sort bogus is not a sort key; use one of: cpu, self, device, calls, memory, flops"),
])
def test_a_sort_word_with_several_meanings_is_suggested_not_guessed(run_cell, ip, typed, said):
    ip.user_ns["ran"] = 0
    result, _ = run_cell(f"%%profile_gpu --sort {typed}\nran += 1", expect_error=UsageError)
    assert said in str(result.error_in_exec or result.error_before_exec)
    assert ip.user_ns["ran"] == 0
    result, _ = run_cell(f"%profile_trace tests/data/h200_bf16_transformer_step.json.gz --sort {typed} -q",
                         expect_error=UsageError)
    assert said in str(result.error_in_exec or result.error_before_exec)


def test_a_comment_after_the_options_is_a_comment(run_cell, ip):
    """As in the design's own examples (`%memory_budget 6GiB        # every later cell ...`): a trailing
    comment was "unrecognized arguments: # every later cell ...". A shell's rule: a # starting a word
    outside quotes; `run#1.json` and a quoted "#" stay."""
    from nbaccel.magics.common import split_line

    assert split_line('--trace run#1.json --sort "a # b"  # the rest') == ["--trace", "run#1.json", "--sort", "a # b"]
    run_cell("%memory_budget 4GiB --device cpu -q -r b  # every later cell is measured against it")
    try:
        assert ip.user_ns["b"].budget_bytes == 4 * 2**30
    finally:
        run_cell("%memory_budget off -q")
    run_cell("import torch\nx = torch.ones(4, 4)")
    run_cell("%%amp --repeat 3 --warmup 0 -q -r res  # fp32 vs bf16\nx @ x")
    assert ip.user_ns["res"].amp.name == "bf16"


def test_a_comment_right_after_a_flag_is_a_comment(run_cell, ip):
    """`-q#note` was "argument -q/--quiet: ignored explicit argument '#note'" (a shell would keep the # in the
    word; after a flag, which takes no value, only a comment was meant). A value keeps its #."""
    run_cell("import torch\nx = torch.ones(4, 4)")
    run_cell("%%profile_gpu -q#just the op table later\nx @ x")
    run_cell("%%amp --repeat 3 --warmup 0 -r res -q#fp32 vs bf16\nx @ x")
    assert ip.user_ns["res"].amp.name == "bf16"
    run_cell("%%amp --repeat 3 --warmup 0 -q#x -r res2\nx @ x")  # the rest of the line is the comment
    assert "res2" not in ip.user_ns
    result, _ = run_cell("%nbaccel_env -r env_q -q#quiet")
    assert result.success and "env_q" in ip.user_ns


@pytest.mark.parametrize("line, said", [
    ("%%profile_gpu --top 5#rows\nx @ x", "argument --top: invalid int value: '5#rows'"),
    ("%%profile_gpu --top=5#rows\nx @ x", "argument --top: invalid int value: '5#rows'"),
    ("%%profile_gpu --device cpu#here\nx @ x", "unknown device 'cpu#here'"),
    ("%%amp --repeat 3#runs\nx @ x", "argument --repeat: invalid int value: '3#runs'"),
    ("%memory_budget 6GiB#big", "cannot read '6GiB#big' as a budget"),
    ("%nbaccel_env -r env#1", "-r/--result takes a Python variable name, got 'env#1'"),
    ("%profile_trace tests/data/h200_bf16_transformer_step.json.gz --top 3#x", "invalid int value: '3#x'"),
])
def test_a_value_refused_for_its_hash_says_a_comment_needs_a_space(run_cell, ip, line, said):
    run_cell("import torch\nx = torch.ones(4, 4)")
    result, _ = run_cell(line, expect_error=UsageError)
    message = str(result.error_in_exec or result.error_before_exec)
    head = line.split("\n")[0].split()[-1].split("=")[-1]
    value, _, tail = head.partition("#")
    assert said in message and message.endswith(
        f"(if #{tail} was meant as a comment, put a space before it: {value} #{tail})"), message


@pytest.mark.parametrize("cell, said", [
    # a trial: a NameError ('no') in the fp32 run, and "SyntaxError ... at line 2: --top 3; fix it"
    ("%%amp --repeat 3\nran += 1\n--no-baseline", "'--no-baseline' on the cell's last line is an option of %%amp: "
                                                   "options go on the magic's line (%%amp --no-baseline), the code below it"),
    ("%%profile_gpu\nran += 1\n--top 3", "'--top 3' on the cell's last line is an option of %%profile_gpu: options go "
                                          "on the magic's line (%%profile_gpu --top 3), the code below it"),
    ("%%profile_gpu\n--sort=calls\nran += 1", "'--sort=calls' on the cell's first line is an option of %%profile_gpu"),
    # and IPython's "the cell body is empty" for code on the magic's line
    ("%%amp ran.__add__(1)", "unrecognized arguments: ran.__add__(1) (code goes in the cell, on the lines below %%amp "
                             "and its options)"),
    ("%%profile_gpu --top 3 ran.__add__(1)", "(code goes in the cell, on the lines below %%profile_gpu and its options)"),
    # a trial 33 matmul, with no call or bracket to tell it by: IPython's "the cell body is empty" alone
    ("%%amp ran @ ran", "unrecognized arguments: ran @ ran (code goes in the cell, on the lines below %%amp"),
    ("%%profile_gpu -q ran + 1", "unrecognized arguments: ran + 1 (code goes in the cell, on the lines below"),
])
def test_options_or_code_on_the_wrong_side_of_the_magic_line_say_where_they_go(run_cell, ip, cell, said):
    run_cell("ran = 0")
    result, _ = run_cell(cell, expect_error=UsageError)
    assert said in str(result.error_in_exec or result.error_before_exec)
    assert ip.user_ns["ran"] == 0


def test_a_cell_line_that_only_looks_like_a_short_option_is_code(run_cell, ip):
    run_cell("import torch\nx = torch.ones(4, 4)")
    run_cell("%%amp --repeat 3 --warmup 0 -q -r res\ny = x @ x\n-y")  # -y: the negated result, no option
    assert ip.user_ns["res"].value.sum().item() == -64
    # an empty body with options only: IPython's own refusal stands
    result = ip.run_cell("%%amp --repeat 3")
    assert "cell body is empty" in str(result.error_in_exec or result.error_before_exec)


def test_a_value_with_a_hash_that_is_accepted_keeps_it(run_cell, ip, tmp_path):
    run_cell("import torch\nx = torch.ones(4, 4)")
    run_cell(f"%%profile_gpu -q --trace {tmp_path}/run#1.json\nx @ x")
    assert (tmp_path / "run#1.json").is_file()


@pytest.mark.parametrize("kind", ["profile", "multirank"])
@pytest.mark.parametrize("kwargs, said", [
    ({"sort": "memory"}, "sort='memory' needs the memory a profile records with memory=True, and this one was made "
                         "without it: profile again with memory=True"),
    ({"sort": "self_memory_bytes"}, "sort='self_memory_bytes' needs the memory a profile records with memory=True"),
    ({"sort": "device"}, "sort='device' needs device time, and this profile has none (it ran on the CPU, or its trace "
                         "has no kernels): use sort='self' or sort='cpu'"),
    ({"sort": "gpu"}, "sort='device' needs device time"),  # read as profile() reads it
    ({"sort": "device_total_us"}, "sort='device_total_us' needs device time"),
    ({"group": "source"}, "group='source' needs the source lines a profile records with stack=True, and this one was "
                          "made without it"),
])
def test_result_tables_refuse_what_the_profile_did_not_record_as_profile_does(tables, kind, kwargs, said):
    """A user trial: table(sort="memory") without memory=True and sort="device" on a CPU profile came back in
    first-seen order (all zeros), group="source" without stack=True as one row named 'aten::fill_, aten::mul_,
    aten::sqrt'; profile(), load_trace() and the CLI refuse the same options."""
    result = tables[kind]
    with pytest.raises(ProfileError, match="^" + re.escape(said)):
        result.table(**kwargs)
    if kind == "multirank":  # one rank of it, the same
        with pytest.raises(ProfileError, match="^" + re.escape(said)):
            result.table(rank=0, **kwargs)


def test_result_tables_take_what_the_profile_recorded():
    with nbaccel.profile(memory=True) as mem:
        torch.ones(64, 64) @ torch.ones(64, 64)
    memory = mem.result.table(sort="memory")
    assert list(memory["self_memory_bytes"]) == sorted(memory["self_memory_bytes"], reverse=True)
    with nbaccel.profile(stack=True) as stacked:
        torch.ones(4, 4) @ torch.ones(4, 4)
    assert len(stacked.result.table(group="source")) >= 1


@pytest.mark.parametrize("call, said", [
    # torch.profiler's own names, the likeliest from a torch user's fingers
    (lambda: nbaccel.profile(record_shapes=True), "profile() has no record_shapes= argument: did you mean shapes=True?"),
    (lambda: nbaccel.profile(with_stack=True), "profile() has no with_stack= argument: did you mean stack=True?"),
    (lambda: nbaccel.profile(profile_memory=True), "profile() has no profile_memory= argument: did you mean memory=True?"),
    (lambda: nbaccel.profile(repeat=3), "profile() has no repeat= argument: did you mean steps=3?"),
    # a trial: compare_amp(fn, steps=3) was Python's bare "got an unexpected keyword argument 'steps'"
    (lambda: nbaccel.compare_amp(lambda: None, steps=3), "compare_amp() has no steps= argument: did you mean repeat=3?"),
    (lambda: nbaccel.compare_amp(lambda: None, number=3), "compare_amp() has no number= argument: did you mean repeat=3?"),
    (lambda: nbaccel.estimate_memory(torch.nn.Linear(2, 2), batch_size=8),
     "estimate_memory() has no batch_size= argument: did you mean batch=8?"),
    (lambda: nbaccel.memory_budget(limit="2GiB"), "memory_budget() has no limit= argument: did you mean budget='2GiB'?"),
    (lambda: nbaccel.precision(amp="bf16"), "precision() has no amp= argument: did you mean dtype='bf16'?"),
    (lambda: nbaccel.profile(tops=3), "profile() has no tops= argument: did you mean top=3?"),  # the nearest name
    (lambda: nbaccel.profile(zzz=1), "profile() has no zzz= argument; it takes device, top, sort, memory, shapes, "),
])
def test_an_unknown_keyword_is_told_the_argument_meant(call, said):
    with pytest.raises(TypeError) as info:
        call()
    assert str(info.value).startswith(said), str(info.value)


def test_the_checked_functions_keep_their_signature_and_run_as_before():
    import inspect

    assert list(inspect.signature(nbaccel.compare_amp).parameters)[:3] == ["fn", "dtype", "device"]
    # a class is checked in a __new__ of its own, which must not hide __init__'s signature (nbaccel.distributed
    # compares the options it binds across ranks) nor add a frame to __init__'s warnings (their stacklevel)
    assert list(inspect.signature(nbaccel.profile).parameters)[:3] == ["device", "top", "sort"]
    assert list(inspect.signature(nbaccel.precision).parameters)[0] == "dtype"
    assert nbaccel.compare_amp.__name__ == "compare_amp" and "strict fp32" in nbaccel.compare_amp.__doc__
    with nbaccel.precision(dtype="fp32") as recipe:
        assert recipe.autocast_dtype is None
