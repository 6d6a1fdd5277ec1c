"""What every magic shares: turning a cell into a function, storing results, refusing bad input."""

from __future__ import annotations

import ast
import re

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring
from IPython.utils.capture import capture_output


# IPython's own history bindings: a snapshot must neither restore nor delete them.
_HISTORY = re.compile(r"^(_+|_i+|_i?\d+|_[oid]h|In|Out|exit|quit|get_ipython)$")


def history_name(shell):
    hidden = shell.user_ns_hidden

    def skip(name: str) -> bool:
        return name in hidden or name.startswith("__") or bool(_HISTORY.match(name))

    return skip


def cell_function(shell, cell: str):
    """Compile a cell into a zero-argument function that runs it in the user namespace and
    returns the value of its last expression (like IPython's ``%%time``), or None."""
    source, tree, filename = parse_cell(shell, cell)
    body, last = tree.body, None
    if body and isinstance(body[-1], ast.Expr):
        last = ast.Expression(body[-1].value)
        body = body[:-1]
    module = ast.Module(body=body, type_ignores=[])
    code = shell.compile(module, filename, "exec")
    expr = shell.compile(last, filename, "eval") if last is not None else None
    ns = shell.user_ns

    def run_cell():
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame; the user's own lines remain
        exec(code, shell.user_global_ns, ns)  # noqa: S102 - running the user's own cell is the point
        return eval(expr, shell.user_global_ns, ns) if expr is not None else None  # noqa: S307

    return run_cell


def parse_cell(shell, cell: str):
    """Transform and parse a cell like IPython does: returns (source, AST, filename).

    The source is registered in IPython's linecache under ``filename``, so a traceback from the
    cell shows the user's lines (not "Could not get source"). A syntax error is a UsageError
    that points at the line, before anything runs.
    """
    source = shell.transform_cell(cell)
    try:
        tree = shell.transform_ast(shell.compile.ast_parse(source))
    except SyntaxError as exc:
        where = f"line {exc.lineno}: {(exc.text or '').strip()}" if exc.lineno else "the cell"
        raise UsageError(f"SyntaxError in the cell ({exc.msg}) at {where}; fix it and run again") from None
    filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
    return source, tree, filename


def silenced():
    """Hide stdout, stderr and rich displays of the measurement runs."""
    return capture_output(stdout=True, stderr=True, display=True)


def store_result(shell, name: str | None, result) -> None:
    if name:
        shell.user_ns[name] = result


def check_name(name: str | None) -> None:
    if name is not None and not name.isidentifier():
        raise UsageError(f"-r/--result takes a Python variable name, got {name!r}")


def positive(value: int, option: str, minimum: int = 1) -> int:
    if value < minimum:
        raise UsageError(f"{option} must be at least {minimum}, got {value}")
    return value


def parse_line(magic, line: str):
    """``parse_argstring`` that also turns shell-quoting mistakes (an unmatched quote) into a
    UsageError; IPython's own parser lets shlex's ValueError escape as a traceback."""
    try:
        return parse_argstring(magic, line)
    except ValueError as exc:
        raise UsageError(f"cannot parse the options {line!r}: {exc}; check the quotes") from None
