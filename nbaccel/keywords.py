"""Unknown keyword arguments of the public API, answered with the one that was meant.

Python's own "compare_amp() got an unexpected keyword argument 'steps'" names the mistake but not the fix,
and the likeliest mistakes are names from neighbouring tools: torch.profiler's ``record_shapes``,
``with_stack`` and ``profile_memory`` for `nbaccel.profile`'s ``shapes``, ``stack`` and ``memory``;
``steps`` or timeit's ``number`` for `compare_amp`'s ``repeat`` (a trial). The check runs before the call,
on the keywords' names alone (a set lookup), so a call that is right pays nothing measurable.
"""

from __future__ import annotations

import difflib
import functools
import inspect


def explains_keywords(meant: dict[str, str] | None = None):
    """Decorate a function, or a class (its ``__init__``'s keywords), so that an unknown keyword raises a
    TypeError naming the argument meant: ``meant`` maps other tools' names to ours; otherwise the closest
    name, if any. A class is checked in a ``__new__`` added for it, not by wrapping ``__init__``: a warning
    that ``__init__`` raises with a ``stacklevel`` then still points at the caller's line."""
    meant = meant or {}

    def decorate(target):
        func = target.__init__ if isinstance(target, type) else target
        params = inspect.signature(func).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return target  # **kwargs takes any name: nothing to check here
        names = [n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL and n != "self"]
        known = set(names)
        owner = func.__qualname__.removesuffix(".__init__")

        def check(kwargs) -> None:
            unknown = [k for k in kwargs if k not in known]
            if unknown:
                raise TypeError(_words(owner, unknown[0], kwargs[unknown[0]], names, meant))

        if isinstance(target, type):
            def __new__(cls, *args, **kwargs):  # noqa: N807 - the class's own constructor hook
                __tracebackhide__ = True  # noqa: F841 - IPython hides this frame: the error is the caller's line
                check(kwargs)
                return object.__new__(cls)

            # inspect.signature(cls) reads a class's own __new__ before its __init__: it is told __init__'s, so
            # signature-based callers (nbaccel.distributed comparing options across ranks) see the real ones.
            __new__.__signature__ = inspect.signature(func)
            target.__new__ = __new__
            return target

        @functools.wraps(func)
        def checked(*args, **kwargs):
            __tracebackhide__ = True  # noqa: F841 - IPython hides this frame: the error is the caller's line
            check(kwargs)
            return func(*args, **kwargs)

        checked.check_keywords = check  # for a caller that checks the arguments before calling (nd.compare_amp)
        return checked

    return decorate


def _words(owner: str, typed: str, value, names: list[str], meant: dict[str, str]) -> str:
    ours = meant.get(typed) or next(iter(difflib.get_close_matches(typed, names, n=1, cutoff=0.6)), None)
    if ours is None:
        return f"{owner}() has no {typed}= argument; it takes {', '.join(names)}"
    return f"{owner}() has no {typed}= argument: did you mean {ours}={value!r}? (it takes {', '.join(names)})"
