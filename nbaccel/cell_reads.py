"""What a measured cell reads by name that changes what a comparison means.

* Iterators: state no snapshot can put back. ``xb, yb = next(it)`` in a ``%%amp`` cell takes a new
  batch in every run: the variants compare different data, and the user's iterator moves on by all
  the runs' worth (a user trial: 17 batches gone from a DataLoader iterator, then ``StopIteration``
  from a short one). A generator or a DataLoader iterator cannot be copied or rewound, so nbaccel
  names them instead.
* DataLoaders that start worker processes on every iteration: each run of a cell that loops over
  one pays the workers' start and stop (a user trial: fp32 585 ms with 2 workers, 193 ms with none),
  which the comparison would otherwise blame on the work being too small for the recipe.
* torch.compile'd models and functions: the timed runs run the compiled code, but the op audit
  records the eager ops (``aten::gelu`` where inductor fuses it), so its dtypes, FLOPs and drift are
  eager's.

Both are found by reading the names the cell's code (and the functions it calls, two levels deep)
loads, as the snapshot's own walk does for state (`amp._referenced_objects`).
"""

from __future__ import annotations

import collections.abc
import io
import sys
import types
from typing import Callable

_DEPTH = 2  # the cell, the functions it calls, the functions they call


def is_unrewindable(value) -> bool:
    """An iterator (a generator, a DataLoader iterator, ``iter(list)``): reading it consumes it.
    Files are left out: a log file a cell writes to is an iterator too, and reading lines from a
    file the cell opened itself starts afresh each run."""
    return isinstance(value, collections.abc.Iterator) and not isinstance(value, io.IOBase)


def is_compiled(value) -> bool:
    """A ``torch.compile`` result: an ``OptimizedModule``, or a function dynamo wrapped. Read without
    importing torch._dynamo (nothing is compiled unless it was imported)."""
    if "torch._dynamo" not in sys.modules:
        return False
    return type(value).__name__ == "OptimizedModule" or hasattr(value, "_torchdynamo_orig_callable")


def _names_loaded(code: types.CodeType, names: set[str]) -> None:
    names.update(code.co_names)  # globals and attributes: a superset, looked up in the namespace below
    for const in code.co_consts:  # nested functions, lambdas and comprehensions
        if isinstance(const, types.CodeType):
            _names_loaded(const, names)


def iterators_read(fn, namespace: dict | None = None) -> dict[str, object]:
    """{name: iterator} for the iterators ``fn`` reaches by name (see `objects_read`)."""
    return objects_read(fn, namespace, is_unrewindable)


def starts_workers(value) -> bool:
    """A DataLoader whose every iteration starts and stops worker processes (``num_workers > 0``
    without ``persistent_workers``). Read without importing torch.utils.data."""
    loader = sys.modules.get("torch.utils.data")
    return (loader is not None and isinstance(value, loader.DataLoader) and value.num_workers > 0
            and not value.persistent_workers)


def worker_loaders_read(fn, namespace: dict | None = None) -> dict[str, object]:
    """{name: DataLoader} for the loaders ``fn`` reaches by name that start workers per iteration."""
    return objects_read(fn, namespace, starts_workers)


def compiled_read(fn, namespace: dict | None = None) -> dict[str, object]:
    """{name: compiled model or function} that ``fn`` reaches by name (see `objects_read`)."""
    return objects_read(fn, namespace, is_compiled)


def objects_read(fn, namespace: dict | None, wanted: Callable[[object], bool]) -> dict[str, object]:
    """{name: value} for the ``wanted`` values ``fn`` reaches by name: its closure, and the names its
    code loads, looked up in ``namespace`` (the magic's user namespace) or else ``fn``'s globals. A
    code object held in the closure (the magic's compiled cell) is read like ``fn``'s own code; a
    function reached is read too, two levels deep."""
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
            elif wanted(value):
                found.setdefault(name, value)
            elif isinstance(value, types.FunctionType):
                walk(value, value.__globals__, depth + 1)
        for name in sorted(names):
            value = scope.get(name)
            if wanted(value):
                found.setdefault(name, value)
            elif isinstance(value, types.FunctionType):
                walk(value, value.__globals__, depth + 1)

    walk(fn, namespace if namespace is not None else getattr(fn, "__globals__", {}), 0)
    return found


def describe(name: str, value) -> str:
    """"`it` (a _SingleProcessDataLoaderIter)", "`model` (an OptimizedModule)"."""
    kind = type(value).__name__
    return f"`{name}` ({'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind})"


def and_list(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


__all__ = ["iterators_read", "compiled_read", "worker_loaders_read", "starts_workers", "objects_read", "is_unrewindable", "is_compiled", "describe",
           "and_list"]
