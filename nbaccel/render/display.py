"""Show a result: one MIME bundle with the widget, static HTML and plain text.

JupyterLab renders the widget; frontends without a widget manager (nbconvert, GitHub, VS Code
without the extension) fall back to the HTML; terminals and nbval read text/plain. If building
the widget fails, the result is still shown as HTML/text: rendering must never hide a measurement.
"""

from __future__ import annotations

import logging
import os

from . import renderer

log = logging.getLogger("nbaccel")

# "auto": widgets when running in a Jupyter kernel; "always"/"never" force it (tests, exports).
WIDGETS = os.environ.get("NBACCEL_WIDGETS", "auto")


def widgets_available() -> bool:
    if WIDGETS == "never":
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    if WIDGETS == "always":
        return True
    return in_kernel(running_shell())


def running_shell():
    """The running IPython shell, or None (a plain script, or no IPython installed)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def in_kernel(shell) -> bool:
    """Whether ``shell`` runs in a Jupyter kernel (a frontend with a widget manager and live outputs),
    not in a terminal IPython."""
    return shell is not None and getattr(shell, "kernel", None) is not None


def mime_bundle(result) -> dict:
    module = renderer(result)
    bundle = {}
    try:
        bundle["text/plain"] = module.text(result)
    except Exception as exc:  # noqa: BLE001 - a rendering bug must not hide the numbers
        log.warning("nbaccel: text rendering failed (%s); showing HTML/widget", exc)
        # every frontend needs a text/plain; this one says where the numbers are
        bundle["text/plain"] = (f"<{type(result).__name__}: the text report failed ({type(exc).__name__}: {exc}); "
                                "the numbers are in the result's attributes and to_dict()>")
    try:
        bundle["text/html"] = module.html(result)
    except Exception as exc:  # noqa: BLE001 - a rendering bug must not hide the numbers
        log.warning("nbaccel: HTML rendering failed (%s); showing text only", exc)
    if widgets_available():
        try:
            widget = module.widget(result)
            widget_bundle = widget._repr_mimebundle_()
            if widget_bundle:
                widget_bundle.pop("text/plain", None)
                bundle.update(widget_bundle)
        except Exception as exc:  # noqa: BLE001
            log.warning("nbaccel: widget rendering failed (%s); showing HTML/text", exc)
    return bundle


def display_result(result, display=None) -> None:
    if display is None:
        if running_shell() is None:  # a plain script: IPython's display() would print the bundle's dict
            print(renderer(result).text(result))
            return
        from IPython.display import display
    display(mime_bundle(result), raw=True)
