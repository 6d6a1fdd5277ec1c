"""What every magic shares: turning a cell into a function, storing results, refusing bad input."""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import difflib
import functools
import keyword
import linecache
import re
import symtable
import sys
import types
from typing import Callable

from IPython.core import magic as ipython_magic
from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, real_name
from IPython.utils.capture import capture_output
from IPython.utils.process import arg_split

from ..options import magic_spelling
from ..results import ResultMixin
from ..render.common import note_on_stderr


#: Mark a cell magic whose value a ';' after the cell's last expression hides, as under ``%%time``:
#: IPython's run_cell_magic then returns None (the magic still runs, and ``-r`` still stores). An
#: IPython without the mark leaves the value shown, as a cell magic always was.
output_can_be_silenced = getattr(ipython_magic, "output_can_be_silenced", lambda magic: magic)


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
    code = compile_cell(shell, module, filename, "exec")
    expr = compile_cell(shell, last, filename, "eval") if last is not None else None
    ns = shell.user_ns

    def run_cell():
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame; the user's own lines remain
        with magic_spelling(False):  # nbaccel's API called in the cell is Python: errors say top=, not --top
            exec(code, shell.user_global_ns, ns)  # noqa: S102 - running the user's own cell is the point
            return eval(expr, shell.user_global_ns, ns) if expr is not None else None  # noqa: S307

    return run_cell


class ProgressNote:
    """A magic's note on long work in progress: in a Jupyter kernel one display, updated in place and
    replaced by ``finish``'s line when the work is over (a stderr line stayed under the result as a red
    box); elsewhere lines on stderr, flushed, each at most ``every`` times later than the one before, so
    a terminal does not fill up."""

    def __init__(self, shell, every: float = 2.0):
        self.shell, self.every, self._handle, self._said_at = shell, every, None, None

    def say(self, text: str, at: float | None = None) -> None:
        """Show ``text``; ``at`` (seconds so far) paces the terminal's lines (None: always)."""
        from ..render.display import in_kernel

        if not in_kernel(self.shell):
            if at is not None and self._said_at is not None and at < self.every * self._said_at:
                return
            self._said_at = at if at is not None else 0.0
            note_on_stderr(text)
        elif self._handle is not None:
            self._handle.update({"text/plain": text}, raw=True)
        else:
            from IPython.display import display

            self._handle = display({"text/plain": text}, raw=True, display_id=True)

    def finish(self, text: str) -> None:
        """The work is over: the kernel's note says ``text`` instead (nothing when nothing was said)."""
        if self._handle is not None:
            self._handle.update({"text/plain": text}, raw=True)


def interrupt_without_frames(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """A fresh KeyboardInterrupt, with ``exc``'s notes, for a Ctrl-C that landed in nbaccel's own code
    (restoring a snapshot, reading a trace) rather than in the cell; the magic raises it ``from None``
    after its note. IPython then shows the magic's line and ``KeyboardInterrupt``, not 25 lines through
    nbaccel's internals that read as a crash of nbaccel (a user trial). The original stays reachable as
    ``__context__``. An interrupt inside the cell is re-raised as it is: its traceback shows the user's line.

    Raised from the magic, the traceback still ends in the magic's frame, and IPython shows the frame an
    exception was raised in even when it is hidden (``__tracebackhide__``, IPython 9). So the exception
    renders itself through IPython's ``_render_traceback_`` protocol (the one ipyparallel's remote errors
    use): IPython's own formatting, of the traceback cut after the last frame that is not hidden."""
    fresh = KeyboardInterrupt(*exc.args)
    for note in getattr(exc, "__notes__", ()):
        fresh.add_note(note)
    fresh._render_traceback_ = lambda: _without_hidden_tail(fresh)
    return fresh


def interrupted_in_nbaccel(exc: KeyboardInterrupt, magic: str, when: str, state: str) -> KeyboardInterrupt:
    """The note for a Ctrl-C in a magic's own work around the measured runs (checking its options
    before them, showing the result after), printed now; returns the frameless interrupt to raise
    ``from None``. Unnoted, these were a bare KeyboardInterrupt that did not say whether the cell ran."""
    note_on_stderr(f"nbaccel {magic}: interrupted (KeyboardInterrupt) {when}; {state}")
    return interrupt_without_frames(exc)


def show_result(shell, magic: str, result, name: str | None, quiet: bool) -> None:
    """Store the result (-r NAME), then display it unless -q. The measuring is over by then: an
    interrupt while the (widget) display is built says that the result is complete, and where it is."""
    __tracebackhide__ = True  # noqa: F841 - IPython hides nbaccel's frames from the user's traceback
    store_result(shell, name, result)
    if quiet:
        return
    try:
        from ..render.display import display_result

        display_result(result)
    except KeyboardInterrupt as exc:
        kept = f" and its result is in {name}" if name else "; its result was not kept (-r NAME keeps it)"
        raise interrupted_in_nbaccel(exc, magic, "while its result was shown, after the measured runs",
                                     f"the measurement had finished{kept}") from None


def _without_hidden_tail(exc: BaseException) -> list[str]:
    try:
        from IPython import get_ipython

        formatter = get_ipython().InteractiveTB
        tb = exc.__traceback__
        # Hiding on (IPython's default): nbaccel's frames at the end are cut. The user turned it off
        # (skip_hidden False): every frame, as IPython would show them.
        if getattr(formatter, "skip_hidden", True):
            entries = []
            while tb is not None:
                entries.append(tb)
                tb = tb.tb_next
            while entries and entries[-1].tb_frame.f_locals.get("__tracebackhide__"):
                entries.pop()
            for entry in reversed(entries):  # rebuilt, not cut in place: %debug still has every frame
                tb = types.TracebackType(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        return formatter.structured_traceback(type(exc), exc, tb)
    except Exception:  # noqa: BLE001 - IPython prints "Unexpected exception formatting exception" otherwise
        return ["\n".join([type(exc).__name__, *getattr(exc, "__notes__", ())])]


def refuse_empty_cell(shell, magic: str, cell: str) -> None:
    """A cell with nothing to run (blank, or only comments) is refused: a comment-only %%amp cell ran 21
    times and reported a "0.77x" for plain Python, with noise warnings, for code that does nothing."""
    try:
        empty = not ast.parse(shell.transform_cell(cell)).body
    except SyntaxError:
        return  # parse_cell points at the line
    if empty:
        only = " (it has only comments)" if cell.strip() else ""
        raise UsageError(f"%%{magic} needs code in the cell below the magic line{only}")


def option_strings(magic) -> list[str]:
    """Every option a magic takes, as typed (``-q``, ``--quiet``, ...), in its parser's order."""
    return [o for action in magic.parser._actions for o in action.option_strings]


def refuse_options_in_cell(magic, cell: str) -> None:
    """An option of the magic on the cell's first or last code line is refused, saying where it goes: a hurried
    ``--no-baseline`` under the code was a NameError ('no') in the fp32 run, ``--top 3`` a SyntaxError in the
    cell (a trial). Only ``--long`` options: ``-q`` or ``-r`` alone may be code (a negated variable)."""
    options = {o for o in option_strings(magic) if o.startswith("--")}
    lines = [(i, line.strip()) for i, line in enumerate(cell.splitlines())
             if line.strip() and not line.strip().startswith("#")]
    for i, line in dict.fromkeys(lines[:1] + lines[-1:]):
        word = re.split(r"[\s=]", line, maxsplit=1)[0]
        if word in options:
            where = "first" if (i, line) == lines[0] else "last"
            name = magic_name(magic)
            raise UsageError(f"{line!r} on the cell's {where} line is an option of {name}: options go on the magic's "
                             f"line ({name} {line}), the code below it")


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
        raise _syntax_usage_error(_plain_syntax_error(exc, source)) from None
    filename = shell.compile.cache(source, cell_number(shell), raw_code=cell)
    return source, tree, filename


def compile_cell(shell, node, filename: str, mode: str):
    """Compile part of a parsed cell. ``return``, ``yield`` and top-level ``await`` parse but do
    not compile outside a function: the same UsageError as any other syntax error, not a
    traceback through nbaccel and codeop."""
    try:
        return shell.compile(node, filename, mode)
    except SyntaxError as exc:
        raise _syntax_usage_error(exc, linecache.getline(filename, exc.lineno or 0)) from None


def _plain_syntax_error(exc: SyntaxError, source: str) -> SyntaxError:
    """Python's own error for ``source`` where IPython's says only "incomplete input".

    IPython's compiler parses with codeop's allow-incomplete-input flag (made for a prompt that waits
    for more lines), so an unclosed bracket read "(incomplete input) at line 2: " -- the blank line
    after the cell, no excerpt. A plain parse says "'(' was never closed" at the bracket's line."""
    if exc.msg != "incomplete input":
        return exc
    try:
        ast.parse(source)
    except SyntaxError as plain:
        return plain
    return exc


def _syntax_usage_error(exc: SyntaxError, line: str = "") -> UsageError:
    # compiled from an AST, the error has no text: the line comes from the cell (see parse_cell)
    where = f"line {exc.lineno}: {(exc.text or line).strip()}" if exc.lineno else "the cell"
    why = ""
    if "await" in (exc.msg or ""):
        # IPython runs a plain cell with top-level await as a coroutine; a measured cell is a function
        why = ("; nbaccel's cell magics run the cell as a plain function, so top-level await cannot run under them "
               "(call the synchronous code, or profile inside the coroutine with nbaccel's API)")
    elif exc.msg and "'return' outside function" in exc.msg:
        why = "; a cell's top level is not a function body: drop the return (the value of the cell's last line is kept)"
    elif exc.msg and "outside function" in exc.msg:
        why = "; a cell's top level is not a function body: put the code in a function"
    return UsageError(f"SyntaxError in the cell ({exc.msg}) at {where}{why}; fix it and run again")


def cell_number(shell) -> int:
    """The number of the cell being run, as its prompt shows it (``In [n]``).

    IPython 9 advances ``execution_count`` before running a cell (IPython 8 after), so the
    count alone labels the user's lines one cell ahead in a traceback; the running cell's
    ExecutionResult carries the number the frontend shows.
    """
    running = getattr(shell.displayhook, "exec_result", None)
    number = getattr(running, "execution_count", None)
    return number if number is not None else shell.execution_count


@contextlib.contextmanager
def silenced():
    """Hide stdout, stderr and rich displays of the measurement runs (the API adds logging, warnings and
    pyplot figures: `nbaccel.quiet`).

    Not a ``with``: IPython's capture replaces sys.stdout first and then builds its display publisher
    and hook (traitlets, dozens of Python calls), so a Ctrl-C inside its ``__enter__`` left sys.stdout its
    buffer with no ``__exit__`` to come, and one at the first line of its ``__exit__`` did the same: every
    later print of the session vanished. Its ``__exit__`` puts back what ``__enter__`` saved, so it is
    run whatever happened, and once more after an interrupt."""
    capture = capture_output(stdout=True, stderr=True, display=True)
    try:
        yield capture.__enter__()  # its stdout/stderr: a failing run's prints are shown (`quiet.hiding_side_channels`)
    finally:
        try:
            _uncapture(capture)
        except KeyboardInterrupt:
            _uncapture(capture)
            raise


def _uncapture(capture) -> None:
    try:
        capture.__exit__(None, None, None)
    except AttributeError:  # its __enter__ stopped before saving the display hook, which it had not replaced
        pass


# --- one measuring magic at a time -------------------------------------------------------------

#: The measuring magic whose cell is running now. Each runs its cell several times and measures
#: every run, so one nested in another would be run, and measured, as the outer one's code.
_measuring: list[str] = []
_NESTED_CELL = re.compile(r"\A(?:\s*\n)?%%(amp|profile_gpu)(?![\w-])")  # after blank lines, as IPython reads a cell magic


def _nested_error(outer: str, inner: str) -> UsageError:
    instead = (f"remove one of the two %%{inner} lines" if outer == inner else
               "to profile the cell under the mixed-precision recipe, use %%profile_gpu --amp bf16 (or fp16) alone")
    return UsageError(f"%%{inner} cannot run inside %%{outer}: %%{outer} measures every run of its cell (and may run "
                      f"it several times), so the runs of %%{inner} would be measured as the cell's code; {instead}")


def refuse_nested_cell_magic(name: str, cell: str) -> None:
    """A measuring magic written as the first line of this one's cell: refused before anything runs."""
    nested = _NESTED_CELL.match(cell)
    if nested:
        raise _nested_error(name, nested.group(1))


@contextlib.contextmanager
def sole_measuring_magic(name: str):
    """Refuse a measuring magic started from a running one's cell (``run_cell_magic`` in its code),
    when the run reaches it; `refuse_nested_cell_magic` catches the written one earlier."""
    if _measuring:
        raise _nested_error(_measuring[-1], name)
    depth = len(_measuring)
    try:  # appended inside: a Ctrl-C between the append and the try refused every later magic as nested
        _measuring.append(name)
        yield
    finally:
        del _measuring[depth:]


def store_result(shell, name: str | None, result) -> None:
    if name:
        shell.user_ns[name] = result


def check_name(name: str | None, counts: str | None = None) -> None:
    """-r NAME must be a variable the user can then type: not a keyword (``for`` could only be
    reached through globals()), not a dunder (``__builtins__`` replaced breaks the kernel), not a
    builtin (``print``, ``len``: shadowed for the rest of the session).

    ``counts``: the magic's option for how many runs (``--repeat``), named when the "name" is a
    number: ``-r 3`` is %timeit's repeat count, and was refused as "a Python variable name"."""
    if name is None:
        return
    if counts is not None and name.isdigit():
        raise UsageError(f"-r is --result NAME here (the variable to keep the result in), not %timeit's repeat count; "
                         f"for {name} runs write {counts} {name}")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"-r/--result takes a Python variable name, got {name!r}")
    if name in _IPYTHON_NAMES or re.fullmatch(r"_i?\d+|_+", name):
        # IPython rewrites _ / Out / _3 after every cell; a result there is gone or breaks the history
        raise UsageError(f"-r/--result {name} would replace one of IPython's own names (its input/output history "
                         "or shell); choose another, e.g. -r res")
    if (name.startswith("__") and name.endswith("__")) or hasattr(builtins, name):
        # `-r print` would hide print() for the rest of the session ("'ProfileResult' object is not callable")
        raise UsageError(f"-r/--result {name} would replace one of Python's own names; choose another, e.g. -r res")


_IPYTHON_NAMES = frozenset({"In", "Out", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "get_ipython", "exit", "quit"})


def check_name_free(shell, name: str | None, cell: str) -> None:
    """-r NAME must not be a name the cell itself uses: the result is stored after the cell ran, so
    ``%%amp -r loss`` over ``loss = ...`` turned ``loss`` into an AmpResult and the next
    ``loss.backward()`` failed, and ``-r model`` over a cell calling ``model(x)`` broke every later
    run. Refused before anything runs; a cell that does not parse is left to the parse that follows
    (it says where the syntax error is)."""
    if name is None:
        return
    try:
        source = shell.transform_cell(cell)
        uses = _module_level_uses(symtable.symtable(source, "<cell>", "exec"), name)
    except SyntaxError:
        return
    if uses is None:
        _refuse_replacing_a_variable(shell, name)
        return
    line = min((node.lineno for node in ast.walk(ast.parse(source)) if _names(node, name)), default=None)
    where = f" (line {line})" if line else ""
    raise UsageError(f"-r/--result {name} would replace {name!r}, which the cell {uses}{where}: the result is stored "
                     f"after the cell runs; choose another name, e.g. -r {name}_result")


def _refuse_replacing_a_variable(shell, name: str) -> None:
    """-r NAME over a variable that holds something other than an earlier nbaccel result (or None): code the
    cell calls may read it as a global, which its text does not show (a trial's ``%%amp -r model`` over
    ``train_step(...)``, which reads ``model``, left ``model`` an AmpResult: "'AmpResult' object is not
    callable" in the next step). An earlier result under the name is replaced, as re-running a cell does."""
    if name not in shell.user_ns:
        return
    value = shell.user_ns[name]
    if value is None or isinstance(value, ResultMixin):
        return
    raise UsageError(f"-r/--result {name} would replace the variable {name!r}, which holds a {type(value).__name__} "
                     f"(not an earlier nbaccel result), and code the cell calls may read it: choose another name, "
                     f"e.g. -r {name}_result, or `del {name}` first")


def _module_level_uses(table: symtable.SymbolTable, name: str) -> str | None:
    """"assigns" / "uses" when the cell's namespace name ``name`` is bound or read by the cell -- at
    its top level, or as a global inside its functions, classes and comprehensions (symtable knows
    the scopes: a function's own local ``loss`` is not the notebook's) -- else None."""
    for symbol in table.get_symbols():
        if symbol.get_name() != name:
            continue
        top = table.get_type() == "module"
        if top or symbol.is_global():
            if symbol.is_assigned() or symbol.is_imported() or (top and symbol.is_namespace()):
                return "assigns"
            if symbol.is_referenced():
                return "uses"
    for child in table.get_children():
        found = _module_level_uses(child, name)
        if found:
            return found
    return None


def _names(node: ast.AST, name: str) -> bool:
    """Whether ``node`` names ``name``: a variable, a def/class, an import, a match capture."""
    if isinstance(node, ast.Name):
        return node.id == name
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    if isinstance(node, (ast.MatchAs, ast.MatchStar)):
        return node.name == name
    return False


class _HelpRequested(Exception):
    pass


class _HelpAction(argparse.Action):
    """``-h/--help``: argparse's own help action prints and then calls ``sys.exit``, which a magic
    must not do; this one stops the parse and lets `parse_line` print the help."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        raise _HelpRequested


#: The first ``@argument`` of every nbaccel magic (IPython's magic parsers have no ``-h``).
help_option = argument("-h", "--help", action=_HelpAction, help="show this help and do nothing else")


_BRACKETED = r"<([\[{][^<>\n]*[\]}])>"


def plain_help(text: str) -> str:
    """A magic's help without the <> IPython wraps around a value that is not a plain name, for reST
    ("--sort <{cpu,self}>", "--amp <[DTYPE]>"; a user trial found them odd): the usage line shows the
    plain form. The option's help text stays in its column. Used for ``-h`` and for ``%name?``."""
    text = re.sub(_BRACKETED + r"(?= )", r"\1  ", text)
    return re.sub(_BRACKETED, r"\1", text)


def magic_name(magic) -> str:
    """``%name`` or ``%%name``, as the user types it."""
    name = real_name(magic)
    owner = getattr(magic, "__self__", None)
    is_cell = owner is not None and name in getattr(owner, "magics", {}).get("cell", {})
    return ("%%" if is_cell else "%") + name


def split_line(line: str) -> list[str]:
    """A magic's line as a POSIX shell splits it, quotes removed: IPython's parse_argstring keeps them,
    so --trace "my run/t.json" made a folder named '"my run' and %memory_budget "6GiB" was unreadable.
    A trailing ``# comment`` goes, as in a shell (``%memory_budget 6GiB  # for the big model`` was
    "unrecognized arguments: # for..."). An unmatched quote raises ValueError."""
    return arg_split(_without_comment(line), posix=True, strict=True)


def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes (a shell's rule: ``run#1.json`` and
    ``"a # b"`` keep theirs)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _comment_cut(tokens: list[str], options) -> list[str]:
    """``tokens`` up to a ``#`` written right after one of the magic's options: ``-q#skip it`` is ``-q``
    and a comment (was "argument -q: ignored explicit argument '#skip'"). A value keeps its ``#``
    (``--trace run#1.json``, ``-r res#2``): a shell keeps it too, and `comment_hinted` says more when
    such a value is refused."""
    for i, token in enumerate(tokens):
        head, sharp, _ = token.partition("#")
        if sharp and head in options:
            return tokens[:i] + [head]
    return tokens


def comment_hinted(magic):
    """Decorate a magic method: a refusal that quotes a word with a ``#`` inside it (``--top 5#rows``,
    ``%memory_budget 6GiB#big``) adds that a comment needs a space before it. A shell's rule, which
    `split_line` follows, reads such a ``#`` as part of the word; the user meant a comment."""
    @functools.wraps(magic)
    def hinted(self, line, *cell):
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame from the user's traceback
        try:
            return magic(self, line, *cell)
        except UsageError as exc:
            hint = _comment_hint(line, str(exc))
            if hint is None:
                raise
            raise UsageError(f"{exc} {hint}") from None

    return hinted


def _comment_hint(line: str, message: str) -> str | None:
    try:
        tokens = split_line(line)
    except ValueError:
        return None
    for token in tokens:
        head, sharp, tail = token.partition("#")
        value = head.partition("=")[2] if head.startswith("-") else head  # --top=5#rows: the value is 5#rows
        if sharp and value and f"{value}#{tail}" in message:
            return f"(if #{tail} was meant as a comment, put a space before it: {value} #{tail})"
    return None


class HelpWithoutBody:
    """An input transformer (IPython's ``input_transformers_cleanup``) for ``%%amp -h`` alone in a cell.

    IPython refuses a cell magic whose body is empty before it calls the magic ("%%amp is a cell
    magic, but the cell body is empty"), so ``-h``/``--help`` -- which never runs the body -- could
    not print the help there. For a cell that is only the first line of one of ``names`` with
    ``-h`` or ``--help`` among its options, this adds an empty line as the body; the magic then
    prints its help (`parse_line`) and returns. The same for code written on the magic's line
    (``%%amp step()``, a trial): the magic then says the code goes below it. Every other cell passes
    unchanged, an empty-bodied cell magic with only options included: IPython's refusal is right there.
    """

    def __init__(self, names):
        self.names = frozenset(names)

    def __call__(self, lines: list[str]) -> list[str]:
        if not lines or not lines[0].startswith("%%") or "".join(lines[1:]):
            return lines
        name, _, options = lines[0][2:].rstrip().partition(" ")  # as IPython's cell_magic transform splits it
        if name not in self.names:
            return lines
        try:
            tokens = split_line(options)
        except ValueError:  # an unmatched quote: the magic would say so, but IPython stops first
            return lines
        code = any(not t.startswith("-") and _CODE_LIKE.search(t) for t in tokens)  # %%amp step(): `parse_line`
        if "-h" not in tokens and "--help" not in tokens and not code:
            return lines
        return [lines[0].rstrip("\n") + "\n", "\n"]


# A word on a cell magic's line that is code, not an option's value: a call, an index, an assignment, a
# matmul, or a binary operator standing alone (a trial's `%%amp x @ x` read only IPython's "the cell body
# is empty"). Not "/" or "%": option values hold paths and "50%".
_CODE_LIKE = re.compile(r"[()\[\]=@]|^(\*\*?|\+|<<|>>|[<>|&^])$")


_DTYPE_LIKE = re.compile(r"(torch\.)?(b?f(p|loat)?|bfloat|half|tf|int|double|auto)\d*", re.I)


def dtype_hint(option_name: str, accepted, normalise: Callable[[str], str]):
    """A `parse_line` hint for a dtype written without its option (``%%amp bf16``)."""
    def hint(token: str) -> str | None:
        if not _DTYPE_LIKE.fullmatch(token):
            return None
        name = normalise(token)
        if name in accepted:
            return f"did you mean {option_name} {name}?"
        if name == "fp32":
            return f"fp32 is what the reduced dtype is compared with or replaces; give that one: {option_name} bf16"
        return f"a dtype goes after {option_name}, one of: {', '.join(accepted)}"
    return hint


# Documents and web pages turn "--" into a typographic dash; pasted into a magic's line, "—repeat" was
# a stray word to argparse ("unrecognized arguments: —repeat 3", nothing more: a user trial).
_DASHES = {"\u2014": "an em dash", "\u2013": "an en dash", "\u2212": "a minus sign", "\u2012": "a figure dash",
           "\u2015": "a horizontal bar", "\u2010": "a Unicode hyphen", "\u2011": "a non-breaking hyphen"}
_DASHED_WORD = re.compile(f"[-{''.join(_DASHES)}]+(?=[A-Za-z])")


def refuse_typographic_dash(magic, tokens: list[str]) -> None:
    """A UsageError for the first token that starts like an option but with a typographic dash, with
    the option as it is typed. Checked before parsing: an option taking a value could have swallowed it."""
    options = set(option_strings(magic))
    for token in tokens:
        start = _DASHED_WORD.match(token)
        dash = next((c for c in start.group() if c in _DASHES), None) if start else None
        if dash is None:
            continue
        name, equals, value = token[start.end():].partition("=")
        meant = "-" + name if len(name) == 1 and "-" + name in options else "--" + name  # -q, -r: one hyphen
        # parse_line adds "see %%amp --help", which also covers a name that is no option at all
        raise UsageError(f"{token} starts with {_DASHES[dash]} ({dash}), a typographic dash that documents put in "
                         f"place of two hyphens; type the option with plain hyphens: {meant}{equals}{value}")


def _same_value(action: argparse.Action, value: str):
    """A value as the magic reads it, so two spellings of one (``--dtype bf16 --dtype bfloat16``,
    ``--sort FLOPS --sort flops``) are one value, not "given twice" (a review)."""
    from ..device import dtype_name
    from ..profile_options import sort_name

    read = {"dtype": dtype_name, "amp": dtype_name, "sort": sort_name}.get(action.dest)
    try:
        return read(value) if read else value
    except Exception:  # noqa: BLE001 - a value the magic refuses later, in its own words
        return value


def refuse_repeated_values(parser: argparse.ArgumentParser, tokens: list[str]) -> None:
    """A UsageError for an option that takes a value given twice with different values: argparse keeps
    the last one silently (``--repeat 3 ... --repeat 5`` ran 5), which a line edited in place invites.
    The same value twice, and a repeated flag (``-q -q``), change nothing and pass. Run after a
    successful parse, so every option here is real and has its value."""
    valued = {o: action for action in parser._actions for o in action.option_strings if action.nargs != 0}
    seen: dict[argparse.Action, tuple[str, str]] = {}
    i = 0
    while i < len(tokens) and tokens[i] != "--":
        token, i = tokens[i], i + 1
        name, equals, value = token.partition("=")
        if not equals and not token.startswith("--") and token[:2] in valued and len(token) > 2:
            name, equals, value = token[:2], "=", token[2:]  # -r3
        action = valued.get(name)
        if action is None:
            continue
        if not equals:
            # --amp alone (or before another option) is its const, --amp auto
            bare = action.nargs == "?" and (i == len(tokens) or tokens[i].startswith("-"))
            value = str(action.const) if bare else tokens[i]
            i += not bare
        if action in seen and _same_value(action, seen[action][1]) != _same_value(action, value):
            first, then = seen[action]
            spelled = name if first == name else f"{first}/{name}"
            raise UsageError(f"{spelled} given twice ({then} and {value}): keep one")
        seen[action] = (name, value)


# Options of one measuring magic typed under the other (and %timeit's -n), by the magic that lacks
# them: said instead of the closest spelling, which misled ("%%profile_gpu --repeat 3": "did you mean
# --result?"; "--dtype bf16": "did you mean --top?"; user trials). Consulted by every parse_line.
_STEPS = "--steps N profiles N runs of the cell, after --warmup W unrecorded ones"
_REPEAT = "--repeat N (N timed runs per variant, after --warmup W untimed rounds)"
# %%amp does list operators (its "ran in reduced precision" line, the widget's Operators tab): "lists no
# operators" sent a newcomer away from res.amp.ops.
_PROFILE_ONLY = ("%%profile_gpu's, for its table of the slowest operators (with --amp bf16 under the recipe); %%amp "
                 "lists every operator it audited, with its dtype and calls, in res.amp.ops (after -r res)")
CROSS_MAGIC = {
    "profile_gpu": {
        "--repeat": f"%%profile_gpu has no --repeat: {_STEPS}",
        "-n": f"%%profile_gpu has no -n, which is %timeit's: {_STEPS}",
        "--number": f"%%profile_gpu has no --number: {_STEPS}",
        "--dtype": "%%profile_gpu has no --dtype: --amp bf16, fp16 or auto profiles under the %%amp recipe",
        "--no-tf32": "%%profile_gpu has no --no-tf32: without --amp the cell runs under your own TF32 settings",
        "--no-baseline": "%%profile_gpu has no --no-baseline: it profiles one variant, the cell as it is (or --amp)",
        "--no-restore": "%%profile_gpu has no --no-restore: it restores nothing, its runs (--warmup W, --steps S) "
                        "keep their effects",
        "--max-snapshot": "%%profile_gpu has no --max-snapshot: it takes no snapshot, its runs keep their effects",
    },
    "amp": {
        "--steps": f"%%amp has no --steps: {_REPEAT}",
        "-n": f"%%amp has no -n, which is %timeit's: {_REPEAT}",
        "--number": f"%%amp has no --number: {_REPEAT}",
        "--amp": "%%amp has no --amp: --dtype bf16, fp16, auto or tf32 picks the recipe",
        "--top": f"%%amp has no --top: --top N is {_PROFILE_ONLY}",
        "--sort": f"%%amp has no --sort: --sort is {_PROFILE_ONLY}",
        "--trace": "%%amp has no --trace: %%profile_gpu --amp bf16 --trace PATH records one under the recipe",
        "--memory": "%%amp has no --memory: it always measures each variant's peak memory",
    },
}


def parse_line(magic, line: str, hint: Callable[[str], str | None] | None = None,
               meanings: dict[str, str] | None = None):
    """IPython's ``parse_argstring`` with quotes removed, ``-h/--help`` and clearer mistakes.

    ``-h``/``--help`` prints the magic's help (what ``%name?`` shows) and returns None: the
    caller returns at once and a cell magic does not run its cell. A wrong option is a
    UsageError that names the closest real option and points to ``--help``; a shell-quoting
    mistake (an unmatched quote) is a UsageError too, where IPython's own parser lets shlex's
    ValueError escape as a traceback. ``hint(token)``: for a stray word (not an option), what the
    user probably meant (``bf16`` -> "did you mean --dtype bf16?"), or None. An option written with a
    typographic dash (``—repeat``, pasted from a document) is refused with its plain spelling. ``meanings``: options a
    user may expect that mean something else here (``--estimate`` -> how to ask for an estimate),
    said instead of the closest spelling (``--estimate`` is closest to ``--strict``).
    """
    # argparse would take "--step 3" as "--steps 3"; a magic that silently guesses is worse than one
    # that says "did you mean --steps?" (below).
    magic.parser.allow_abbrev = False
    options = option_strings(magic)
    try:
        tokens = _comment_cut(split_line(line), options)
        refuse_typographic_dash(magic, tokens)
        args = magic.parser.parse_args(tokens)
        refuse_repeated_values(magic.parser, tokens)
        return args
    except _HelpRequested:
        # IPython formats a magic's help as reST for `%name?` (a "::" literal-block marker, then
        # the usage indented); printed as the answer to -h, it reads as plain text.
        print(plain_help(re.sub(r"^::\s*\n", "", magic.parser.format_help().lstrip()).rstrip()))
        return None
    except ValueError as exc:
        raise UsageError(f"cannot parse the options {line!r}: {exc}; check the quotes") from None
    except UsageError as exc:
        message = str(exc)
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            meanings = {**CROSS_MAGIC.get(magic.__name__, {}), **(meanings or {})}
            for token in message[len(prefix):].split():
                # --repeat=3, and -n3 (a short option with its value attached)
                name = token[:2] if re.match(r"-[A-Za-z]\d", token) else token.split("=")[0]
                if name in meanings:
                    meant = meanings[name]
                elif token.startswith("-"):
                    close = difflib.get_close_matches(token.split("=")[0], options, n=1)
                    meant = f"did you mean {close[0]}?" if close else None
                else:
                    meant = hint(token) if hint is not None else None
                    if meant is None and magic_name(magic).startswith("%%") and _CODE_LIKE.search(token):
                        # %%amp step(): code on the magic's line (IPython's own "the cell body is empty" came
                        # first: `HelpWithoutBody` lets such a line through)
                        meant = f"code goes in the cell, on the lines below {magic_name(magic)} and its options"
                if meant:
                    message += f" ({meant})"
                    break
        raise UsageError(f"{message}; see {magic_name(magic)} --help for the options") from None
