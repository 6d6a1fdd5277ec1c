"""``import nbaccel`` costs torch and little else: pandas is imported only when a result table is made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import nbaccel
import torch

assert "pandas" not in sys.modules, "import nbaccel imported pandas"
with nbaccel.precision("bf16", device="cpu"):
    (torch.ones(4, 4) @ torch.ones(4, 4)).sum()
assert "pandas" not in sys.modules, "nbaccel.precision imported pandas"
for heavy in ("IPython", "ipywidgets", "matplotlib", "scipy", "nbaccel.distributed"):  # torchrun's, on first use
    assert heavy not in sys.modules, heavy + " was imported by import nbaccel"
# Hidden runs close the pyplot figures they open, where the code has imported pyplot itself.
nbaccel.compare_amp(lambda: 1.0, device="cpu", warmup=0, repeat=1)
assert "matplotlib" not in sys.modules, "compare_amp imported matplotlib"

# A result table still works: pandas comes in then.
frame = nbaccel.results_frame([])
assert "pandas" in sys.modules and len(frame) == 0
print("ok")
"""


def test_import_nbaccel_does_not_import_pandas():
    # A fresh interpreter: the test process itself has pandas loaded long ago.
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


LOAD_EXT = """
import sys
from IPython.testing.globalipapp import start_ipython

ip = start_ipython()
assert "pandas" not in sys.modules
ip.run_line_magic("load_ext", "nbaccel")
# The first result a notebook shows needs both; importing them with the extension keeps the first
# widget from pausing for them (~0.4 s).
assert "pandas" in sys.modules and "ipywidgets" in sys.modules
print("ok")
"""


def test_load_ext_imports_what_the_first_display_needs():
    proc = subprocess.run([sys.executable, "-c", LOAD_EXT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


def test_the_errors_and_warnings_a_script_catches_are_top_level_names():
    # A user trial: nbaccel.profile.SharedTraceWarning was an AttributeError (nbaccel.profile is the
    # profiler class, which shadows its module), and help(nbaccel) named only compare_amp and precision.
    import nbaccel
    from nbaccel.budget import BudgetError
    from nbaccel.distributed import RankFailure

    caught = ("ProfileError", "DeviceError", "BudgetError", "BudgetExceeded", "EstimateError", "SnapshotTooLarge",
              "TraceError", "RankNotFound", "RankFailure", "RankMismatch", "NoProcessGroup", "TraceWarning", "SharedTraceWarning",
              "TraceSaveWarning",
              "BudgetWarning")
    for name in caught:
        assert name in nbaccel.__all__ and isinstance(getattr(nbaccel, name), type), name
        assert issubclass(getattr(nbaccel, name), Exception), name
    assert nbaccel.BudgetError is BudgetError and nbaccel.RankFailure is RankFailure
    assert issubclass(nbaccel.SharedTraceWarning, UserWarning)
    assert issubclass(nbaccel.RankNotFound, nbaccel.TraceError) and issubclass(nbaccel.RankNotFound, LookupError)
    for named in ("profile", "load_trace", "memory_budget", "nbaccel.distributed", "python -m nbaccel trace",
                  "SharedTraceWarning", *caught):
        assert named in nbaccel.__doc__, named
