"""Smoke tests of the benchmarks: they run, and what they write is well-formed and honest.
No timing assertions: benchmarks are not unit tests."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nbaccel
from benchmarks import __main__ as cli
from benchmarks import bench_amp, measure, suite
from nbaccel.device import DeviceError

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_suite():
    return suite.run("small", "cpu", ["gemm", "conv"], log=lambda msg: None)


def test_suite_rows_are_complete(small_suite):
    assert small_suite["schema"] == suite.SCHEMA and small_suite["size"] == "small"
    m = small_suite["machine"]
    assert m["device"] == "cpu" and m["torch"] == torch.__version__ and m["date"]
    names = [w["name"] for w in small_suite["workloads"]]
    assert names == ["gemm", "conv"]
    for w in small_suite["workloads"]:
        assert w["variants"][0]["variant"] == "fp32"
        for r in w["variants"]:
            assert r["amp_median_s"] > 0 and r["timer_median_s"] > 0
            assert len(r["amp_times_s"]) == len(r["timer_times_s"]) == w["repeat"]
            assert math.isclose(r["agreement_ratio"], r["amp_median_s"] / r["timer_median_s"])
            assert r["agree"] == (abs(r["agreement_ratio"] - 1) <= 0.10)
            assert r["peak_bytes"] is not None and r["memory_method"]
            assert r["flops"] > 0 and r["flops_per_s"] == pytest.approx(r["flops"] / r["amp_median_s"])
            # a CPU has no peak table: nothing invented
            assert r["peak_flops"] is None and r["fraction_of_peak"] is None
            assert r["peak_source"].startswith("peak unknown")


def test_gemm_flops_are_the_textbook_count(small_suite):
    gemm = small_suite["workloads"][0]
    n = 512  # workloads.SIZES[("cpu", "small")]["gemm"]
    assert all(r["flops"] == 2 * n**3 for r in gemm["variants"])


def test_skips_and_missing_benchmarks_are_stated(small_suite):
    conv = small_suite["workloads"][1]
    if torch.device("cpu").type == "cpu" and "fp16" in measure.variants_for(torch.device("cpu")):
        assert "fp16" in conv["skipped"] and "fp16" not in [r["variant"] for r in conv["variants"]]
    text = suite.table(small_suite)
    # Every optional benchmark is in this checkout, so each must have run: a "missing" one here is
    # a benchmark that raised (the %memory_budget one did, whenever a test shell existed before it).
    assert set(small_suite["overheads"]) >= set(suite.OPTIONAL) and not small_suite["missing"], small_suite["missing"]
    h = small_suite["overheads"]["amp_harness"]
    assert h["overhead_s"] > 0 and set(h["ratio_to_fp32_step"]) == {"gemm", "conv"}
    assert text.count("PASS") + text.count("FAIL") >= sum(len(w["variants"]) for w in small_suite["workloads"])
    assert "peak unknown" in text


def test_a_benchmark_that_cannot_run_is_stated_not_fatal(small_suite, monkeypatch):
    monkeypatch.setattr(suite, "OPTIONAL", {
        "gone": ("benchmarks.no_such_module", "f", None, "a removed benchmark"),
        "broken": ("benchmarks.measure", "harness_overhead", lambda mod, dev, size: 1 / 0, "a broken one")})
    results, missing = suite.optional_overheads(torch.device("cpu"), "small", log=lambda msg: None)
    assert results == {}
    assert missing["gone"].startswith("a removed benchmark: benchmarks.no_such_module is not in this version")
    assert missing["broken"] == ("a broken one: benchmarks.measure.harness_overhead() raised "
                                 "ZeroDivisionError: division by zero")
    text = suite.table({**small_suite, "missing": missing})
    assert all("not measured -- " + why in text for why in missing.values())


def test_json_plot_and_compare(small_suite, tmp_path, capsys):
    old = suite.save(small_suite, str(tmp_path / "old.json"))
    assert suite.load(old)["workloads"][0]["name"] == "gemm"
    png = suite.plot(small_suite, str(tmp_path / "suite.png"))
    assert Path(png).read_bytes()[:8] == PNG_MAGIC
    assert cli.main(["compare", old, old]) == 0
    assert "0 regression(s)" in capsys.readouterr().out
    slower = json.loads(Path(old).read_text())
    slower["workloads"][1]["variants"][0]["amp_median_s"] *= 1.5
    new = suite.save(slower, str(tmp_path / "new.json"))
    assert cli.main(["compare", old, new]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "1 regression(s)" in out and "1.500" in out
    assert cli.main(["compare", old, new, "--threshold", "0.6"]) == 0


def test_markdown_table(small_suite, tmp_path, capsys):
    md = suite.markdown(small_suite)
    rows = [line for line in md.splitlines() if line.startswith("| gemm |")]
    assert len(rows) == len(small_suite["workloads"][0]["variants"])
    assert all(line.count("|") == 11 for line in rows) and "peak unknown" in rows[0]
    assert "| %%amp harness per run |" in md and "load average" in md
    path = suite.save(small_suite, str(tmp_path / "s.json"))
    assert cli.main(["markdown", path]) == 0 and capsys.readouterr().out.strip() == md.strip()


def test_compare_refuses_foreign_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(suite.SuiteFileError, match=r"x\.json: not an nbaccel suite result \(schema None, expected"):
        suite.load(str(bad))


BAD_SUITE_FILES = {
    "missing": (None, r"cannot read it \(No such file or directory\)"),
    "not JSON": ("not json", r"not JSON \(Expecting value"),
    "binary": (b"\xff\xfe\x00", r"not JSON \('utf-8' codec can't decode"),
    "foreign JSON": ('{"lr": 0.1}', r"not an nbaccel suite result \(schema None, expected 1\)"),
    "a JSON list": ("[1, 2]", r"not an nbaccel suite result \(schema None, expected 1\)"),
}


@pytest.mark.parametrize("case", list(BAD_SUITE_FILES))
@pytest.mark.parametrize("command", ["compare", "markdown"])
def test_a_file_that_is_no_suite_result_is_one_line_and_status_2(tmp_path, capsys, command, case):
    """A user trial: `compare x.json /nonexist.json` printed a FileNotFoundError traceback (a
    JSONDecodeError for a non-JSON file), and a foreign JSON file exited 1, compare's "regression"."""
    import re

    content, why = BAD_SUITE_FILES[case]
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    elif content is not None:
        bad.write_text(content)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"schema": suite.SCHEMA}))
    args = [command, str(good), str(bad)] if command == "compare" else [command, str(bad)]
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert re.match(rf"python -m benchmarks {command}: error: {re.escape(str(bad))}: {why}", err), err


def test_cli_writes_json_and_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "OPTIONAL", {})  # the other benchmarks already ran in small_suite
    out = tmp_path / "r" / "s.json"
    assert cli.main(["--size", "small", "--workloads", "gemm", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "gemm" in stdout and "agreement" in stdout
    assert json.loads(out.read_text())["workloads"][0]["name"] == "gemm"
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit) as exc:
        cli.main(["--workloads", "nope"])
    assert exc.value.code == 2 and "unknown workload" in capsys.readouterr().err


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--size" in proc.stdout and "compare" in proc.stdout


def test_bench_amp_small():
    res = bench_amp.run("small", "cpu", repeat=3)
    assert [(r["workload"], r["variant"]) for r in res["rows"]] == [
        (w, v) for w in ("gemm", "mlp", "conv") for v in ("fp32", "bf16")]
    assert all(r["amp_median_s"] > 0 and r["timer_median_s"] > 0 for r in res["rows"])
    assert res["harness"]["overhead_s"] > 0 and res["harness_with_state"]["state_bytes"] > 8 * 2**20
    assert all(s["capture_ms_per_mib"] > 0 and s["restore_ms_per_mib"] > 0 for s in res["snapshot"])
    c = res["comparison"]
    assert c["comparison_s"] > 0 and c["gc_collect_s"] > 0 and c["runs"] == 11 and c["memory_runs"] == 2
    text = bench_amp.report(res)
    assert "whole comparison of a trivial cell (11 runs, 2 of them memory runs)" in text
    assert "Timer median" in text and "Harness overhead" in text and "restore/MiB" in text
    assert "others: cores other programs kept busy" in text and "others_cores" in res["rows"][0]
    assert text.count("PASS") + text.count("FAIL") >= len(res["rows"]) + 1


def test_timer_statement_applies_the_recipe():
    """Timer must run the closure under the same autocast recipe compare_amp uses."""
    seen = []
    wl = type("W", (), {"name": "probe", "state": [], "fn": staticmethod(
        lambda: seen.append(torch.is_autocast_enabled("cpu")))})
    measure.timer_stats(wl, measure.recipe_for("bf16", torch.device("cpu")), warmup=0, repeat=2)
    measure.timer_stats(wl, measure.recipe_for("fp32", torch.device("cpu")), warmup=0, repeat=2)
    # Timer.timeit(number=1) runs the statement 3 times (2 untimed warmups); 2 samples each
    assert seen == [True] * 6 + [False] * 6


def test_tf32_variant_needs_cuda():
    with pytest.raises(DeviceError, match="TF32"):
        nbaccel.compare_amp(lambda: None, dtype="tf32", device="cpu")


def test_the_attention_benchmark_prints_its_three_ratios(capsys):
    from benchmarks import bench_attention

    assert bench_attention.main(["--min-run-time", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["1. causal attention", "2. SDPA",
                                                         "3. causal SDPA forward + backward"]
    assert all(line.endswith("x") and float(line.rsplit(": ", 1)[1][:-1]) > 0 for line in lines[1:])


def test_the_cpu_fp16_benchmark_prints_its_five_ratios(capsys):
    from benchmarks import bench_cpu_fp16

    assert bench_cpu_fp16.main(["--min-run-time", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["1. conv forward", "2. conv input gradient",
                                                         "3. conv weight gradient", "4. matmul 1024^3",
                                                         "5. matmul 1024^3"]
    assert all(line.endswith("x") and float(line.rsplit(": ", 1)[1][:-1]) > 0 for line in lines[1:])
