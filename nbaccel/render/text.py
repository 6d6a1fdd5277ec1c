"""Plain-text rendering entry point (terminals, logs, nbval, ``print(result)``)."""

from . import renderer


def render_text(result) -> str:
    return renderer(result).text(result)
