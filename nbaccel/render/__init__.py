"""Turn result objects into text, static HTML and ipywidgets.

One module per capability (``amp``, ``profile``, ``budget``...), each with ``text(result)``,
``html(result)`` and ``widget(result)``; `display.display_result` picks the module by the
result's ``kind`` and sends one MIME bundle carrying all three, so every frontend shows
something true. Shared pieces (escaping, tables, bars, CSS) are in `common`.
"""

import importlib

_BY_KIND = {"amp": "amp", "profile": "profile", "budget": "budget", "estimate": "budget", "env": "env", "multirank": "multirank",
           "profile_compare": "profile_compare"}


def renderer(result):
    """The render module for a result (by its ``kind``)."""
    name = _BY_KIND.get(getattr(result, "kind", None))
    if name is None:
        raise TypeError(f"no renderer for {type(result).__name__}")
    return importlib.import_module(f"{__name__}.{name}")
