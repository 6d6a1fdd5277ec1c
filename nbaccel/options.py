"""How an error names an option: ``--sort x`` under a magic, ``sort='x'`` from Python.

The magics are thin layers over the API, so the API's own checks serve both. A check names the
option with `option`; a magic runs inside `magic_spelling()` (`@magic_spelled`; the user's cell inside
`magic_spelling(False)`: an API call in the cell is Python), and the message then reads the way
the user typed the option (``%%profile_gpu --top 0`` -> "--top must be ...",
``nbaccel.profile(top=0)`` -> "top must be ...").
"""

from __future__ import annotations

import functools
import numbers
from contextvars import ContextVar

_IN_MAGIC: ContextVar[bool] = ContextVar("nbaccel_magic_spelling", default=False)
_NAME_ONLY = object()


def in_magic() -> bool:
    """Whether the code runs under a magic's spelling (for a hint that differs as a whole)."""
    return _IN_MAGIC.get()


# ``made_by`` of a result made by ``python -m nbaccel trace``: its header reads "nbaccel trace: ...".
CLI_TRACE = "trace"


def command_line_made(made_by: str) -> bool:
    """Whether a result's maker took its options on a command line (``--top``): a magic
    (``%%amp``, ``%profile_trace``) or ``python -m nbaccel trace``; else Python keywords (``top=``)."""
    return made_by.startswith("%") or made_by == CLI_TRACE


def a_type(value) -> str:
    """"a Tensor", "an int": the article and the type's name, for "x is a ..." errors ("is a int": a trial)."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def option(name: str, value=_NAME_ONLY) -> str:
    """``--name value`` (``--name`` for a flag set to True) inside a magic, ``name=value`` outside."""
    if _IN_MAGIC.get():
        flag = "--" + name.replace("_", "-")
        return flag if value is _NAME_ONLY or value is True else f"{flag} {value}"
    return name if value is _NAME_ONLY else f"{name}={value!r}"


def whole_number(name: str, value, minimum: int, error: type[Exception] = ValueError, why: str = "") -> int:
    """``value`` if it is an int of at least ``minimum``; else ``error`` naming the option.

    A magic's parser has already made an int; from Python, ``top="5"`` or ``steps=1.5`` would
    otherwise fail deep inside (a comparison of str and int, a schedule of 1.5 steps).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{option(name)} takes a whole number, got {value!r}")
    if value < minimum:
        raise error(f"{option(name)} must be at least {minimum}, got {value}{why}")
    return int(value)


class magic_spelling:  # noqa: N801 - a context manager used like a function: `with magic_spelling():`
    """Within this block, `option` spells options as a magic's command line does; ``active=False``
    switches back to Python's spelling.

    A class, not a contextlib generator: a Ctrl-C at the first line of contextlib's ``__exit__`` left
    the generator suspended, and when the garbage collector closed it, maybe much later, its cleanup set
    the spelling it had found -- for the user's cell inside a magic, the magic's, for every later error
    of the session. An exit skipped here leaves the value to the enclosing block's exit (`magic_spelled`
    puts it back in a ``finally`` of its own).
    """

    def __init__(self, active: bool = True):
        self.active = active
        self._previous: list = []

    def __enter__(self) -> "magic_spelling":
        self._previous.append(_IN_MAGIC.get())
        _IN_MAGIC.set(self.active)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _IN_MAGIC.set(self._previous.pop())
        return False


def magic_spelled(magic):
    """Decorate a magic method: its errors spell options as typed (``--top``). A plain function, not
    ``@magic_spelling()``: contextlib's decorator frame would show in the user's tracebacks."""
    @functools.wraps(magic)
    def spelled(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame from the user's traceback
        previous = _IN_MAGIC.get()
        try:  # set inside, put back with no Python call before it: no Ctrl-C leaves the magic's spelling on
            _IN_MAGIC.set(True)
            return magic(*args, **kwargs)
        finally:
            _IN_MAGIC.set(previous)

    return spelled
