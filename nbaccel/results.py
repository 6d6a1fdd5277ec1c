"""What every result object shares: text, HTML and widget displays, and a JSON-safe dict.

Result objects keep raw numbers and derive the rest. They never import ipywidgets: rendering
lives in `nbaccel.render`, imported lazily, so a result can be built, pickled and printed in a
script or under torchrun with no frontend at all.
"""

from __future__ import annotations

import json

from . import __version__

SCHEMA_VERSION = 1


class ResultMixin:
    """Subclasses set ``kind`` and implement ``_payload()`` (their own JSON-safe fields)."""

    kind = "result"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "schema_version": SCHEMA_VERSION, "nbaccel_version": __version__, **self._payload()}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        from .render.text import render_text

        return render_text(self)

    def _repr_pretty_(self, printer, cycle):
        printer.text("<...>" if cycle else str(self))

    def _repr_html_(self) -> str:
        from .render.html import render_html

        return render_html(self)

    def show(self):
        """Display as an ipywidget where a widget frontend exists, else as HTML/text."""
        from .render.display import display_result

        display_result(self)
