"""Find controls in an ipywidgets tree the way a user finds them: by kind and label."""


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def control(box, cls_name, description):
    found = [w for w in walk(box) if type(w).__name__ == cls_name and getattr(w, "description", None) == description]
    assert len(found) == 1, f"no single {cls_name} {description!r}"
    return found[0]


def first_column(html: str) -> list[str]:
    """The names in a rendered table's first (name) column, as the reader sees them: unescaped, without
    the <wbr> break opportunities that `nbaccel.render.common.breakable` puts in long names."""
    import re
    from html import unescape

    return [unescape(n.replace("<wbr>", "")) for n in re.findall(r'<tr><td class="name">(.*?)</td>', html)]
