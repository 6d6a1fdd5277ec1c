"""Several results in one output, next to each other (e.g. bf16 vs fp16, before vs after a fix)."""

from __future__ import annotations

import contextlib

from . import renderer
from .common import wrap


def side_by_side(*results):
    """Return an object that displays ``results`` in columns: widgets in an HBox in JupyterLab,
    a flex row of their HTML elsewhere, and their texts one after another in a terminal."""
    if not results:
        raise ValueError("side_by_side needs at least one result")
    if len(results) == 1 and isinstance(results[0], (list, tuple)):
        results = tuple(results[0])  # side_by_side([a, b]) means side_by_side(a, b)
    for i, result in enumerate(results):
        try:
            renderer(result)
        except TypeError:  # refused now, not when the row is shown
            raise TypeError(f"side_by_side takes nbaccel results (compare_amp, profile().result, load_trace, "
                            f"budget.status(), estimate_memory, env_report); argument {i + 1} is not one "
                            f"({type(result).__name__})") from None
    return _Row(results)


def _render(result, how: str):
    """One result's text, html or widget, its options spelled as its maker took them (`ResultMixin._spelling`)."""
    spelling = result._spelling() if hasattr(result, "_spelling") else contextlib.nullcontext()
    with spelling:
        return getattr(renderer(result), how)(result)


class _Row:
    def __init__(self, results):
        self.results = results

    def __str__(self) -> str:
        return "\n\n".join(_render(r, "text") for r in self.results)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def _repr_html_(self) -> str:
        columns = "".join(f'<div style="flex:1; min-width:0; overflow-x:auto">{_render(r, "html")}</div>'
                          for r in self.results)
        return wrap(f'<div style="display:flex; gap:16px; align-items:flex-start">{columns}</div>')

    def widget(self):
        import ipywidgets as w

        box = w.HBox([_render(r, "widget") for r in self.results])
        box.add_class("nbaccel-side-by-side")
        return box

    def _repr_mimebundle_(self, include=None, exclude=None):
        from .display import widgets_available

        bundle = {"text/plain": str(self), "text/html": self._repr_html_()}
        if widgets_available():
            widget_bundle = self.widget()._repr_mimebundle_()
            widget_bundle.pop("text/plain", None)
            bundle.update(widget_bundle)
        return bundle
