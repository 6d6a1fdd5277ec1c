"""Iterators a measured cell reads: state that no snapshot can put back.

``xb, yb = next(it)`` in a ``%%amp`` cell takes a new batch in every run: the variants compare
different data, and the user's iterator moves on by all the runs' worth (a user trial: 17 batches
gone from a DataLoader iterator, then ``StopIteration`` from a short one). A generator or a
DataLoader iterator cannot be copied or rewound, so nbaccel names them instead: found by reading
the names the cell's code (and the functions it calls, two levels deep) loads, as the snapshot's
own walk does for state (`amp._referenced_objects`).
"""

from __future__ import annotations

import collections.abc
import io
import types

_DEPTH = 2  # the cell, the functions it calls, the functions they call


def is_unrewindable(value) -> bool:
    """An iterator (a generator, a DataLoader iterator, ``iter(list)``): reading it consumes it.
    Files are left out: a log file a cell writes to is an iterator too, and reading lines from a
    file the cell opened itself starts afresh each run."""
    return isinstance(value, collections.abc.Iterator) and not isinstance(value, io.IOBase)


def _names_loaded(code: types.CodeType, names: set[str]) -> None:
    names.update(code.co_names)  # globals and attributes: a superset, looked up in the namespace below
    for const in code.co_consts:  # nested functions, lambdas and comprehensions
        if isinstance(const, types.CodeType):
            _names_loaded(const, names)


def iterators_read(fn, namespace: dict | None = None) -> dict[str, object]:
    """{name: iterator} for the iterators ``fn`` reaches by name: its closure, and the names its code
    loads, looked up in ``namespace`` (the magic's user namespace) or else ``fn``'s globals. A code
    object held in the closure (the magic's compiled cell) is read like ``fn``'s own code."""
    found: dict[str, object] = {}
    seen: set[int] = set()

    def walk(func, scope: dict, depth: int) -> None:
        code = getattr(func, "__code__", None)
        if code is None or id(code) in seen or depth > _DEPTH:
            return
        seen.add(id(code))
        names: set[str] = set()
        _names_loaded(code, names)
        for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not assigned yet
                continue
            if isinstance(value, types.CodeType):
                _names_loaded(value, names)
            elif is_unrewindable(value):
                found.setdefault(name, value)
            elif isinstance(value, types.FunctionType):
                walk(value, value.__globals__, depth + 1)
        for name in sorted(names):
            value = scope.get(name)
            if is_unrewindable(value):
                found.setdefault(name, value)
            elif isinstance(value, types.FunctionType):
                walk(value, value.__globals__, depth + 1)

    walk(fn, namespace if namespace is not None else getattr(fn, "__globals__", {}), 0)
    return found


def describe(name: str, value) -> str:
    """"`it` (a _SingleProcessDataLoaderIter)"."""
    return f"`{name}` (a {type(value).__name__})"


def and_list(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


__all__ = ["iterators_read", "is_unrewindable", "describe", "and_list"]
