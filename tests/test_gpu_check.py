"""scripts/gpu_check.py: the CPU dry run end to end (CI), and the isolation of a failing check."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_writes_a_report(tmp_path):
    stem = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(stem)], cwd=ROOT,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((stem.with_suffix(".json")).read_text())
    env = report["environment"]
    assert report["dry_run"] is True and report["size"] == "small" and env["date"] and env["torch"]
    checks = report["checks"]
    for name in ("gemm_bf16_throughput", "amp_tf32", "amp_fp16_gradscaler", "profile_tensor_cores",
                 "budget_enforce_oom"):
        assert checks[name]["status"] == "skipped" and "--dry-run" in checks[name]["summary"]
    assert checks["gpu_tests"]["status"] == "pass", checks["gpu_tests"]
    assert checks["benchmark_suite"]["status"] == "pass", checks["benchmark_suite"]
    suite = json.loads(Path(checks["benchmark_suite"]["details"]["json"]).read_text())
    assert suite["size"] == "small" and len(suite["workloads"]) == 4
    assert all(t["status"] == "skipped" for t in report["targets"].values())
    md = stem.with_suffix(".md").read_text()
    assert md.startswith("# nbaccel GPU check") and "| amp_tf32 | SKIPPED |" in md and "## Benchmark suite" in md
    assert "no failures" in proc.stdout


def test_a_raising_check_is_reported_not_fatal(tmp_path):
    mod = _load()

    def boom(args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    mod.CHECKS["boom"] = (boom, False, 5)
    result = tmp_path / "r.json"
    assert mod._child(types.SimpleNamespace(run_check="boom", result_file=str(result))) == 0
    r = json.loads(result.read_text())
    assert r["status"] == "error" and "illegal memory access" in r["summary"] and "Traceback" in r["details"]["traceback"]


def test_spent_budget_skips_instead_of_running(tmp_path):
    mod = _load()
    args = types.SimpleNamespace(dry_run=False, cuda=False, budget=1.0, outdir=str(tmp_path), size="small")
    r = mod.run_check("benchmark_suite", args, deadline=time.monotonic() - 1)
    assert r["status"] == "skipped" and "budget" in r["summary"]
    r = mod.run_check("amp_tf32", args, deadline=time.monotonic() + 100)
    assert r["status"] == "skipped" and "no CUDA" in r["summary"]


def test_h200_targets_are_judged_only_on_an_h200(tmp_path):
    mod = _load()
    suite = {"workloads": [
        {"name": "transformer", "variants": [{"variant": "fp32", "amp_median_s": 6.0},
                                             {"variant": "bf16", "amp_median_s": 1.0}]},
        {"name": "gemm", "variants": [{"variant": "bf16", "amp_median_s": 1.0, "fraction_of_peak": 0.5,
                                       "peak_source": "H200 SXM dense bf16 peak"}]}]}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    checks = {"gemm_bf16_throughput": {"status": "pass", "details": {"fraction_of_peak": 0.69,
                                                                     "peak_source": "H200 SXM datasheet"}}}
    h200 = mod.targets(path, {"cuda_available": True, "gpu": "NVIDIA H200"}, dry_run=False, checks=checks)
    assert h200["transformer_bf16_speedup"]["status"] == "pass"
    gemm = h200["gemm_bf16_fraction_of_peak"]
    assert gemm["status"] == "fail" and "69.0%" in gemm["summary"] and "50.0%" in gemm["summary"]
    other = mod.targets(path, {"cuda_available": True, "gpu": "NVIDIA A100-SXM4-80GB"}, dry_run=False, checks=checks)
    assert all(t["status"] == "skipped" and "not judged" in t["summary"] for t in other.values())
    no_check = mod.targets(path, {"cuda_available": True, "gpu": "NVIDIA H200"}, dry_run=False, checks={})
    assert no_check["gemm_bf16_fraction_of_peak"]["status"] == "skipped"


def test_the_report_is_written_after_every_check_so_a_killed_run_keeps_its_results(tmp_path, monkeypatch):
    # The device's time limit kills a run without warning; the report used to be written only at the end.
    mod = _load()
    stem = tmp_path / "r"
    seen = []

    def run_check(name, args, deadline):
        if seen:
            raise KeyboardInterrupt  # the kill, in the second check
        seen.append(name)
        return {"status": "pass", "summary": f"{name} measured"}

    monkeypatch.setattr(mod, "run_check", run_check)
    try:
        mod.main(["--dry-run", "--out", str(stem), "--only", "gpu_tests,budget_enforce_oom"])
    except KeyboardInterrupt:
        pass
    report = json.loads(stem.with_suffix(".json").read_text())
    first = seen[0]  # in CHECKS order
    assert report["complete"] is False and report["checks"] == {first: {"status": "pass",
                                                                        "summary": f"{first} measured"}}
    assert "INCOMPLETE" in stem.with_suffix(".md").read_text()


def test_a_notebook_runs_cell_by_cell_and_honours_raises_exception(tmp_path):
    """The notebooks check: a cell tagged raises-exception must raise; any other error is the failure."""
    mod = _load()

    def notebook(cells):
        path = tmp_path / f"nb{len(list(tmp_path.iterdir()))}.ipynb"
        path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": src, "metadata": {"tags": tags}}
                                              for src, tags in cells]}))
        return path

    good = mod.run_notebook(notebook([("x = 1", []), ("1 / 0", ["raises-exception"]), ("y = x + 1", [])]), 60)
    assert good["failed"] is None and good["cells"] == 3 and good["cuda_used"] is False
    bad = mod.run_notebook(notebook([("x = 1", []), ("undefined_name", []), ("y = 2", [])]), 60)
    assert bad["failed"]["cell"] == 1 and "NameError" in bad["failed"]["error"]
    quiet = mod.run_notebook(notebook([("x = 1", ["raises-exception"])]), 60)
    assert quiet["failed"]["cell"] == 0 and "no error" in quiet["failed"]["error"]
