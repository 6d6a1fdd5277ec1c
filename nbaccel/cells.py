"""Name a notebook cell's code the way IPython's tracebacks do: ``Cell In[3]``.

IPython compiles each cell under a code name (``<ipython-input-3-..>`` in a terminal,
``/tmp/ipykernel_123/456.py`` in a kernel) and keeps the map from code name to cell number.
Frames, profiler source lines and out-of-memory locations carry the code name, which no reader
can map to a cell.
"""

from __future__ import annotations

import sys


def notebook_cells() -> dict[str, int]:
    """IPython's map from the code name of each cell run so far to its number; empty outside IPython."""
    ipython = sys.modules.get("IPython")  # never imported for a script that had not already
    shell = ipython.get_ipython() if ipython is not None else None
    return dict(getattr(getattr(shell, "compile", None), "_filename_map", None) or {})


def cell_label(filename: str, cells: dict[str, int] | None = None) -> str:
    """``Cell In[3]`` for a notebook cell's code name; any other file name unchanged."""
    cells = notebook_cells() if cells is None else cells
    return f"Cell In[{cells[filename]}]" if filename in cells else filename
