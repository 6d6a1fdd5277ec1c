"""How the environment report looks."""

from .common import esc, table, text_table, wrap


def text(report) -> str:
    out = []
    for title, values in report.sections.items():
        out.append(f"[{title}]")
        out.append(text_table(["key", "value"], [[k, v] for k, v in values.items()], left=(0, 1)))
        out.append("")
    return "\n".join(out).rstrip()


def html(report) -> str:
    parts = [f"<h4>{esc(title)}</h4>" + table(["key", "value"], [[k, v] for k, v in values.items()],
                                                 name_columns=(), text_columns=(0, 1))
             for title, values in report.sections.items()]
    return wrap("".join(parts))


def widget(report):
    import ipywidgets as w

    return w.HTML(html(report))
