"""How the environment report looks."""

from ..environment import ByteSizes
from .common import esc, table, text_table, wrap


def _shown(value) -> str:
    """A flag read as a named pair ({"enabled": False, "dtype": torch.bfloat16}) as "False (dtype: torch.bfloat16)":
    the flag first, as torch's getter gives it, its companion named."""
    if isinstance(value, ByteSizes):  # {"physical_bytes": ..., ...} as "16 GiB physical, 3 GiB available, ..."
        return value.words()
    if not isinstance(value, dict):
        return value
    (_, first), *rest = value.items()
    return f"{first} ({', '.join(f'{name}: {v}' for name, v in rest)})"


def _rows(values: dict) -> list:
    return [[key, _shown(value)] for key, value in values.items()]


def text(report) -> str:
    out = []
    for title, values in report.sections.items():
        out.append(f"[{title}]")
        out.append(text_table(["key", "value"], _rows(values), left=(0, 1)))
        out.append("")
    return "\n".join(out).rstrip()


def html(report) -> str:
    parts = [f"<h4>{esc(title)}</h4>" + table(["key", "value"], _rows(values),
                                                 name_columns=(), text_columns=(0, 1))
             for title, values in report.sections.items()]
    return wrap("".join(parts))


def widget(report):
    import ipywidgets as w

    return w.HTML(html(report))
