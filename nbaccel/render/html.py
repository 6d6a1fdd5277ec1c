"""Static HTML rendering entry point (nbconvert exports, VS Code, Colab, GitHub previews)."""

from . import renderer


def render_html(result) -> str:
    return renderer(result).html(result)
