"""Find controls in an ipywidgets tree the way a user finds them: by kind and label."""


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def control(box, cls_name, description):
    found = [w for w in walk(box) if type(w).__name__ == cls_name and getattr(w, "description", None) == description]
    assert len(found) == 1, f"no single {cls_name} {description!r}"
    return found[0]


def ops_table(box):
    """The profiler widget's operator table (an HTML widget), wherever the Operators tab holds it."""
    found = [w for w in walk(box) if "nbaccel-ops" in getattr(w, "_dom_classes", ())]
    assert len(found) == 1, "no single operator table"
    return found[0]


def header_buttons(box):
    """The profiler widget's column header buttons, left to right."""
    return [w for w in walk(box) if type(w).__name__ == "Button" and "nbaccel-th" in w._dom_classes]


def first_column(html: str) -> list[str]:
    """The names in a rendered table's first (name) column, as the reader sees them: unescaped, without
    the <wbr> break opportunities that `nbaccel.render.common.breakable` puts in long names."""
    import re
    from html import unescape

    return [unescape(n.replace("<wbr>", "")) for n in re.findall(r'<tr><td class="name">(.*?)</td>', html)]
