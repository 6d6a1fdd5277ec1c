"""``-h/--help`` on every magic prints its help and does nothing else; a wrong option says the fix."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError

from nbaccel.render.common import TEXT_WIDTH

# magic as typed, a cell for cell magics (None for line magics), options its help must list
MAGICS = {
    "%nbaccel_env": (None, ["--result", "--json", "--quiet"]),
    "%memory_budget": (None, ["--enforce", "--strict", "--near", "--model", "--result", "--quiet", "budget"]),
    "%profile_trace": (None, ["PATH", "--top", "--sort", "--rank", "--result", "--quiet"]),
    "%%amp": ("ran += 1", ["--dtype", "--device", "--no-tf32", "--warmup", "--repeat", "--result", "--quiet"]),
    "%%profile_gpu": ("ran += 1", ["--top", "--sort", "--memory", "--steps", "--trace", "--result", "--quiet"]),
}


def _source(magic: str, line: str) -> str:
    cell, _ = MAGICS[magic]
    return f"{magic} {line}" + (f"\n{cell}\n" if cell else "")


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("magic", list(MAGICS))
def test_help_prints_the_usage_and_runs_nothing(run_cell, ip, magic, flag):
    ip.user_ns["ran"] = 0
    result, captured = run_cell(_source(magic, flag))
    name = magic.lstrip("%")
    assert f"%{name} [-h]" in captured.stdout  # IPython's usage line, as `%name?` shows it
    assert "-h, --help" in captured.stdout and "show this help and do nothing else" in captured.stdout
    for option in MAGICS[magic][1]:
        assert option in captured.stdout, option
    doc = ip.magics_manager.magics["cell" if magic.startswith("%%") else "line"][name].__doc__
    # what `%name?` shows, less its reST literal-block marker ("::")
    assert captured.stdout.strip() == re.sub(r"^::\s*\n", "", doc.lstrip()).strip()
    assert result.result is None and not captured.outputs
    assert ip.user_ns["ran"] == 0, "the cell ran"
    # as wide as nbaccel's other text (a trial found a 103-column line in %%amp's docstring)
    wide = [line for line in captured.stdout.splitlines() if len(line) > TEXT_WIDTH]
    assert not wide, wide


def test_help_wins_over_other_options_and_a_missing_path(run_cell):
    _, captured = run_cell("%profile_trace --top 3 --help")
    assert "%profile_trace [-h]" in captured.stdout
    _, captured = run_cell("%memory_budget 6GiB --strict -h")
    assert "%memory_budget [-h]" in captured.stdout


def test_nbaccel_env_help_does_not_store_a_result(run_cell, ip):
    run_cell("%nbaccel_env -r env --help")
    assert "env" not in ip.user_ns


@pytest.mark.parametrize("magic, line, message", [
    ("%nbaccel_env", "--bogus", "unrecognized arguments: --bogus; see %nbaccel_env --help for the options"),
    ("%nbaccel_env", "--reslt x", "unrecognized arguments: --reslt x (did you mean --result?); "
                                  "see %nbaccel_env --help for the options"),
    ("%%profile_gpu", "--tpo 3", "unrecognized arguments: --tpo 3 (did you mean --top?); "
                                 "see %%profile_gpu --help for the options"),
    ("%%amp", "--dtpye bf16", "(did you mean --dtype?); see %%amp --help"),
    ("%profile_trace", "", "the following arguments are required: PATH; see %profile_trace --help"),
    # A dtype without its option (a user trial: "unrecognized arguments: bf16" and nothing more).
    ("%%amp", "bf16 --repeat 3", "unrecognized arguments: bf16 (did you mean --dtype bf16?)"),
    ("%%amp", "bfloat16", "(did you mean --dtype bf16?)"),
    ("%%amp", "torch.bfloat16", "(did you mean --dtype bf16?)"),
    ("%%amp", "fp8", "unrecognized arguments: fp8 (a dtype goes after --dtype, one of: bf16, fp16, auto, tf32)"),
    ("%%profile_gpu", "fp16", "(did you mean --amp fp16?)"),
    ("%%amp", "model", "unrecognized arguments: model; see %%amp --help"),  # not a dtype: no guess
    ("%%amp", "fp32", "(fp32 is what the reduced dtype is compared with or replaces; give that one: --dtype bf16)"),
    ("%memory_budget", "offf", "cannot read 'offf' as a budget; did you mean %memory_budget off"),
    ("%memory_budget", "of", "did you mean %memory_budget off"),
    # words and options for "remove it" that resemble no spelling of off (a user trial: the generic size error)
    ("%memory_budget", "none", "cannot read 'none' as a budget; did you mean %memory_budget off (removes the budget"),
    ("%memory_budget", "Clear", "did you mean %memory_budget off"),
    ("%memory_budget", "reset", "did you mean %memory_budget off"),
    ("%memory_budget", "stats", "did you mean %memory_budget status"),
    ("%memory_budget", "--off", "unrecognized arguments: --off (no dashes: %memory_budget off)"),
    ("%memory_budget", "--reset", "(the budget is removed without an option: %memory_budget off)"),
    ("%memory_budget", "--status", "(the status is shown by %memory_budget alone, or %memory_budget status)"),
    # A user trial: pasted from a document, "—repeat" got only "unrecognized arguments: —repeat 3".
    ("%%amp", "—repeat 3", "—repeat starts with an em dash (—), a typographic dash that documents put in place of "
                           "two hyphens; type the option with plain hyphens: --repeat; see %%amp --help"),
    ("%%amp", "--dtype bf16 –repeat=3", "starts with an en dash (–), a typographic dash that documents put in place "
                                        "of two hyphens; type the option with plain hyphens: --repeat=3"),
    ("%%amp", "—q", "plain hyphens: -q;"),  # a one-letter option has one hyphen
    ("%%profile_gpu", "—steps 2", "plain hyphens: --steps; see %%profile_gpu --help"),
    ("%memory_budget", "1GiB —strict", "plain hyphens: --strict; see %memory_budget --help"),
    ("%profile_trace", "t.json −−top 3", "a minus sign (−)"),
    ("%nbaccel_env", "—bogus", "plain hyphens: --bogus; see %nbaccel_env --help for the options"),
    # User trials: the closest spelling pointed away from the fix ("did you mean --result?" / "--top?").
    ("%%profile_gpu", "--repeat 3", "(%%profile_gpu has no --repeat: --steps N profiles N runs of the cell, after "
                                    "--warmup W unrecorded ones); see %%profile_gpu --help"),
    ("%%profile_gpu", "--dtype bf16", "(%%profile_gpu has no --dtype: --amp bf16, fp16 or auto profiles under the "
                                      "%%amp recipe)"),
    ("%%profile_gpu", "--dtype=bf16", "(%%profile_gpu has no --dtype: --amp bf16"),
    ("%%profile_gpu", "-n 3", "(%%profile_gpu has no -n, which is %timeit's: --steps N"),
    ("%%profile_gpu", "--no-restore", "(%%profile_gpu has no --no-restore: it restores nothing, its runs"),
    # "--repeat N times N runs per variant" read as a typo ("times" was the verb)
    ("%%amp", "--steps 3", "(%%amp has no --steps: --repeat N (N timed runs per variant, after --warmup W untimed "
                           "rounds)); see %%amp --help"),
    ("%%amp", "--amp bf16", "(%%amp has no --amp: --dtype bf16, fp16, auto or tf32 picks the recipe)"),
    # %%amp does list operators (res.amp.ops): it once said it "lists no operators"
    ("%%amp", "--top 5", "(%%amp has no --top: --top N is %%profile_gpu's, for its table of the slowest operators "
                         "(with --amp bf16 under the recipe); %%amp lists every operator it audited, with its dtype "
                         "and calls, in res.amp.ops (after -r res)); see %%amp --help"),
    ("%%amp", "--sort time", "(%%amp has no --sort: --sort is %%profile_gpu's, for its table of the slowest operators "
                             "(with --amp bf16 under the recipe); %%amp lists every operator it audited"),
    ("%%amp", "-n 3", "(%%amp has no -n, which is %timeit's: --repeat N (N timed runs per variant"),
    ("%%amp", "-n3", "(%%amp has no -n, which is %timeit's: --repeat N"),
    # -r is --result here, not %timeit's repeat count: a number after it means the count
    ("%%amp", "-r 3", "-r is --result NAME here (the variable to keep the result in), not %timeit's repeat count; "
                      "for 3 runs write --repeat 3"),
    ("%%profile_gpu", "-r3", "for 3 runs write --steps 3"),
])
def test_a_wrong_option_is_a_usage_error_with_the_fix(run_cell, ip, magic, line, message):
    ip.user_ns["ran"] = 0
    _, captured = run_cell(_source(magic, line), expect_error=UsageError)
    assert message in captured.stderr
    assert ip.user_ns["ran"] == 0


@pytest.mark.parametrize("magic, line, suggestion", [
    ("%%profile_gpu", "--step 3", "--steps"),  # argparse would have run it as --steps 3
    ("%%amp", "--rep 3", "--repeat"),
    ("%memory_budget", "1GiB --str", "--strict"),
])
def test_an_abbreviated_option_is_not_guessed(run_cell, ip, magic, line, suggestion):
    ip.user_ns["ran"] = 0
    result, captured = run_cell(_source(magic, line), expect_error=UsageError)
    message = str(result.error_in_exec or result.error_before_exec)
    assert "unrecognized arguments" in message and f"did you mean {suggestion}?" in message
    assert ip.user_ns["ran"] == 0
    if magic == "%memory_budget":
        run_cell("%memory_budget off -q")


def test_cell_magic_help_names_the_cell_magic(run_cell):
    # IPython's help formatter puts one "%" before a magic's name: the usage line read "%profile_gpu".
    _, captured = run_cell("%%profile_gpu -h\n1")
    assert captured.stdout.lstrip(": \n").startswith("%%profile_gpu [-h]")


def test_help_is_plain_text_not_restructuredtext(run_cell):
    # IPython's magic help is reST for `%name?`: it began with a stray "::" when printed for -h.
    _, captured = run_cell("%nbaccel_env -h")
    assert captured.stdout.lstrip().startswith("%nbaccel_env [-h]")


def test_help_shows_choices_and_optional_values_as_the_usage_line_does(run_cell):
    # IPython wraps them in <> for reST: "--sort <{cpu,self,...}>", "--amp <[DTYPE]>" (a user trial).
    _, captured = run_cell("%%profile_gpu -h\n1")
    lines = captured.stdout.splitlines()
    assert "<" not in captured.stdout.replace("<=", "")
    assert any(line.startswith("  --sort {cpu,self,device,calls,memory,flops}") for line in lines)
    amp, device = (next(line for line in lines if line.startswith(f"  --{o} ")) for o in ("amp", "device"))
    assert amp.startswith("  --amp [DTYPE]  ") and amp.index("profile under") == device.index("auto, cpu")


@pytest.mark.parametrize("source", ["%%amp -h", "%%amp --help", "%%profile_gpu -h", "%%profile_gpu --help\n",
                                    "%%amp -r res -q --help", "%%profile_gpu --top 3 -h"])
def test_help_prints_with_an_empty_cell_body(run_cell, ip, source):
    # IPython refuses an empty-bodied cell magic before calling it ("the cell body is empty"); help runs
    # no body, so it must print all the same.
    result, captured = run_cell(source)
    name = source.split()[0].lstrip("%")
    doc = ip.magics_manager.magics["cell"][name].__doc__
    assert captured.stdout.strip() == re.sub(r"^::\s*\n", "", doc.lstrip()).strip()
    assert result.result is None and not captured.outputs and "res" not in ip.user_ns


@pytest.mark.parametrize("source", ["%%amp", "%%amp -q", "%%profile_gpu --top 3", "%%amp -r '-h"])
def test_an_empty_body_without_help_is_still_refused_by_ipython(run_cell, source):
    result, captured = run_cell(source, expect_error=UsageError)
    assert "is a cell magic, but the cell body is empty" in str(result.error_in_exec or result.error_before_exec)
    assert "usage:" not in captured.stdout


def test_the_empty_body_help_transform_leaves_other_cells_alone():
    from nbaccel.magics.common import HelpWithoutBody

    alone = HelpWithoutBody(["amp"])
    assert alone(["%%amp -h\n"]) == ["%%amp -h\n", "\n"]
    for lines in (["%%amp -h\n", "x = 1\n"], ["%%time -h\n"], ["%amp -h\n"], ["x = '-h'\n"], [], ["%%amp\n"],
                  ["%%amp --hel\n"], ["%%amp -r 'a -h\n"]):
        assert alone(list(lines)) == lines


def test_unload_removes_the_transform_and_reload_adds_it_once(ip):
    from nbaccel.magics.common import HelpWithoutBody

    def ours():
        return [t for t in ip.input_transformers_cleanup if isinstance(t, HelpWithoutBody)]

    assert len(ours()) == 1
    ip.run_line_magic("reload_ext", "nbaccel")
    assert len(ours()) == 1
    ip.run_line_magic("unload_ext", "nbaccel")
    assert ours() == []
    ip.run_line_magic("load_ext", "nbaccel")  # the fixture unloads it again
    assert len(ours()) == 1


@pytest.mark.parametrize("magic, line, message", [
    # argparse keeps the last value silently: a line edited in place ran 5 where it said 3 first
    ("%%amp", "--repeat 3 --repeat 5", "--repeat given twice (3 and 5): keep one"),
    ("%%amp", "-r a --result b", "-r/--result given twice (a and b): keep one"),
    ("%%amp", "--dtype=bf16 --dtype fp16", "--dtype given twice (bf16 and fp16): keep one"),
    ("%%profile_gpu", "--amp bf16 --amp", "--amp given twice (bf16 and auto): keep one"),
    ("%%profile_gpu", "--steps 2 --top 3 --steps=4", "--steps given twice (2 and 4): keep one"),
    ("%profile_trace", "t.json --top 3 --top 5", "--top given twice (3 and 5): keep one"),
    ("%memory_budget", "1GiB --near 0.5 --near 0.9", "--near given twice (0.5 and 0.9): keep one"),
])
def test_a_valued_option_given_twice_is_refused(run_cell, ip, magic, line, message):
    ip.user_ns["ran"] = 0
    result, _ = run_cell(_source(magic, line), expect_error=UsageError)
    assert message in str(result.error_in_exec or result.error_before_exec)
    assert ip.user_ns["ran"] == 0


def test_the_same_value_twice_and_a_repeated_flag_pass(run_cell, ip):
    ip.user_ns["ran"] = 0
    run_cell("%%amp --repeat 1 --repeat=1 --warmup 0 -q -q\nran += 1")
    assert ip.user_ns["ran"] > 0
    # two spellings of one value are one value (a review: "--dtype given twice (bf16 and bfloat16)")
    ip.user_ns["ran"] = 0
    run_cell("%%amp --repeat 1 --warmup 0 -q --dtype bf16 --dtype bfloat16\nran += 1")
    run_cell("%%profile_gpu -q --sort FLOPS --sort flops\nran += 1")
    assert ip.user_ns["ran"] > 1


def test_nbaccel_env_takes_quiet_like_every_other_magic(run_cell, ip):
    # A user trial: "unrecognized arguments: -q", where every other magic takes it
    _, captured = run_cell("%nbaccel_env -q -r env")
    assert captured.stdout == "" and not captured.outputs
    assert type(ip.user_ns["env"]).__name__ == "EnvReport"
    result, _ = run_cell("%nbaccel_env -q --json", expect_error=UsageError)
    assert "--json prints the report and -q/--quiet shows nothing: give one" in str(result.error_in_exec)
    result, _ = run_cell("%nbaccel_env -q", expect_error=UsageError)  # it did nothing, silently
    assert "without -r NAME, keeps nothing: add -r NAME" in str(result.error_in_exec)
