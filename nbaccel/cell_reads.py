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
* Optimizers with no state yet: every run, restored to that, creates the state in its step, inside
  both variants' peaks and times; a later step has it already.
* Lazy modules not initialized yet (``nn.LazyLinear`` before its first forward), alone or in a dict,
  list or tuple: ``%%amp`` refuses them (`snapshot.refuse_uninitialized_lazy`), since their first
  forward initializes them in place and no snapshot could put that back.

All are found by reading the names the cell's code (and the functions it calls, two levels deep)
loads, as the snapshot's own walk does for state (`amp._referenced_objects`).
"""

from __future__ import annotations

import collections.abc
import dis
import io
import sys
import types

from .snapshot import lazy_members, uninitialized_lazy

_DEPTH = 2  # the cell, the functions it calls, the functions they call


def is_unrewindable(value) -> bool:
    """An iterator (a generator, a DataLoader iterator, ``iter(list)``): reading it consumes it.
    Files are left out: a log file a cell writes to is an iterator too, and reading lines from a
    file the cell opened itself starts afresh each run."""
    return isinstance(value, collections.abc.Iterator) and not isinstance(value, io.IOBase)


def is_compiled(value) -> bool:
    """A ``torch.compile`` result: an ``OptimizedModule``, a module after ``module.compile()``, or a
    function dynamo wrapped. Only the instance's own attributes are read (a namespace value's
    ``__getattr__`` is not run), and torch._dynamo is not imported (nothing is compiled unless it was)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if isinstance(optimized, type) and isinstance(value, optimized):  # a class, not its name: a user's own
        return True                                                   # "OptimizedModule" is not compiled
    try:
        attributes = object.__getattribute__(value, "__dict__")  # not a __getattr__ fallback: a Mock has all
    except (AttributeError, TypeError):
        return False
    return isinstance(attributes, dict) and (attributes.get("_compiled_call_impl") is not None
                                             or "_torchdynamo_orig_callable" in attributes)


def graphs_compiled() -> int:
    """How many graphs torch.compile has compiled in this process so far: read before and after runs, it
    tells a cell that compiles (``torch.compile(model)`` inside the cell, or a recompile when autocast
    changes its guards) from one that runs compiled code. 0 until torch._dynamo is imported (not
    imported here)."""
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0
    except Exception:  # a torch without these counters: no count, no note (nbaccel's reading never fails a run)
        return 0


def starts_workers(value) -> bool:
    """A DataLoader whose every iteration starts and stops worker processes (``num_workers > 0``
    without ``persistent_workers``). Read without importing torch.utils.data."""
    loader = sys.modules.get("torch.utils.data")
    return (loader is not None and isinstance(value, loader.DataLoader) and value.num_workers > 0
            and not value.persistent_workers)


# What a measured cell's report names (`amp.compare_amp`), by kind.
def has_uninitialized_lazy(value) -> bool:
    """A module holding lazy modules (``nn.LazyLinear``...) whose parameters are not initialized yet, or
    a dict, list or tuple of such modules (``models["a"](x)``; a review), one level deep."""
    return any(uninitialized_lazy(member) for _, member in lazy_members("", value))


def is_stateless_optimizer(value) -> bool:
    """An optimizer with trainable parameters and no state yet (no step taken): restored before every
    run, each run's step creates its state (AdamW: two buffers the size of the parameters), as a first
    step does and a later one does not (a trial: "+10% memory" on the first step, "-17%" on later ones)."""
    optim = sys.modules.get("torch.optim")
    return (optim is not None and isinstance(value, optim.Optimizer) and not value.state
            and any(p.requires_grad for group in value.param_groups for p in group["params"]))


KINDS = {"iterators": is_unrewindable, "compiled": is_compiled, "worker_loaders": starts_workers,
         "lazy_modules": has_uninitialized_lazy, "stateless_optimizers": is_stateless_optimizer}

_READS = {"LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_GLOBALS",
          "LOAD_FROM_DICT_OR_DEREF"}
_STORES = {"STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"}
_ATTRIBUTE_READS = {"LOAD_ATTR", "LOAD_METHOD"}
_ATTRIBUTE_DEPTH = 3  # trainer.model.encoder.layer: deeper chains are not followed


def _names_read(code: types.CodeType, names: set[str], own: set[str] | None = None) -> None:
    """The names ``code`` and the code nested in it (functions, lambdas, comprehensions) read as
    variables, and the attribute chains read from them (``trainer.model``, ``data.it``: a lazy module
    or an iterator one object away; a user trial) -- not names only assigned. With ``own`` (the cell's
    top level: its statements, then its last expression), a name or attribute the code stores before
    it reads it is the cell's own (``it = iter(data)`` then ``next(it)``; ``data.it = iter(x)``): the
    value an earlier run left in the namespace is not what the cell reads."""
    first: dict[str, str] = {}  # name -> "read" or "store", whichever the code does first
    reads: set[str] = set()
    chain = None  # the name or attribute chain the instruction before loaded, if any
    for ins in dis.get_instructions(code):
        loaded = None
        if ins.opname in _READS:
            loaded = ins.argval
        elif ins.opname in _ATTRIBUTE_READS and chain is not None and chain.count(".") < _ATTRIBUTE_DEPTH:
            loaded = f"{chain}.{ins.argval}"
        elif ins.opname in _STORES:
            first.setdefault(ins.argval, "store")
        elif ins.opname == "STORE_ATTR" and chain is not None:
            first.setdefault(f"{chain}.{ins.argval}", "store")
        if loaded is not None:
            reads.add(loaded)
            first.setdefault(loaded, "read")
        chain = loaded
    if own is not None:
        own.update(n for n, how in first.items() if how == "store")
    names.update(reads)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _names_read(const, names)


_MODULE_MEMBERS = ("_modules", "_parameters", "_buffers")  # where nn.Module keeps what `model.fc` returns


def _static_value(scope: dict, dotted: str):
    """The value ``trainer.model`` names, read from the objects' own ``__dict__`` (and an nn.Module's
    submodules, parameters and buffers) only: no property, ``__getattr__`` or descriptor of the user's
    runs, so reading it has no effects. None where a link is not an instance attribute (a method, a
    property, a library module's attribute)."""
    base, *attributes = dotted.split(".")
    value = scope.get(base)
    for attribute in attributes:
        if value is None or isinstance(value, (types.ModuleType, type)):
            return None
        try:
            own = object.__getattribute__(value, "__dict__")
        except (AttributeError, TypeError):
            return None
        if not isinstance(own, dict):
            return None
        members = [own] + [own[key] for key in _MODULE_MEMBERS if isinstance(own.get(key), dict)]
        value = next((m[attribute] for m in members if attribute in m), None)
    return value


def objects_read(fn, namespace: dict | None = None, kinds: dict | None = None) -> dict[str, dict[str, object]]:
    """{kind: {name: value}} for the values of each kind (`KINDS`: predicate per kind) that ``fn``
    reaches by name: its closure, and the names its code reads, looked up in ``namespace`` (the
    magic's user namespace) or else ``fn``'s globals. A code object held in the closure (the magic's
    compiled cell) is read as the cell's top level; a function reached is read too, two levels deep.
    One walk for every kind."""
    kinds = KINDS if kinds is None else kinds
    found: dict[str, dict[str, object]] = {kind: {} for kind in kinds}
    seen: set[int] = set()

    def note(name: str, value) -> bool:
        hits = [kind for kind, wanted in kinds.items() if wanted(value)]
        for kind in hits:
            found[kind].setdefault(name, value)
        return bool(hits)

    def walk(func, scope: dict, depth: int) -> None:
        code = getattr(func, "__code__", None)
        if code is None or id(code) in seen or depth > _DEPTH:
            return
        seen.add(id(code))
        names: set[str] = set()
        own: set[str] = set()
        _names_read(code, names, own)  # a function, as the cell: what it stores before reading is its own
        for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not assigned yet
                continue
            if isinstance(value, types.CodeType):
                _names_read(value, names, own)
            elif value is namespace or value is scope:
                continue  # the magic's cell function holds the whole namespace: its names are read above
            elif not note(name, value) and isinstance(value, types.FunctionType):
                walk(value, value.__globals__, depth + 1)
        for name in sorted(names - own):
            if any(name.startswith(mine + ".") for mine in own):  # `data = Data()` then `data.it`: the cell's own
                continue
            value = _static_value(scope, name)
            if not note(name, value) and isinstance(value, types.FunctionType):
                walk(value, value.__globals__, depth + 1)

    walk(fn, namespace if namespace is not None else getattr(fn, "__globals__", {}), 0)
    return found


def describe(name: str, value) -> str:
    """"`it` (a _SingleProcessDataLoaderIter)", "`model` (an OptimizedModule)", "`loader` (2 workers)"."""
    if starts_workers(value):
        return f"`{name}` ({value.num_workers} worker{'s' if value.num_workers > 1 else ''})"
    kind = type(value).__name__
    return f"`{name}` ({'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind})"


def take_first(descriptions: list[str]) -> str:
    """"`batch = next(loader_it)`" for the first of `describe`'s "`loader_it` (a ...)" descriptions."""
    name = descriptions[0].split("`")[1]
    return f"`batch = next({name})`"


def and_list(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


__all__ = ["objects_read", "KINDS", "graphs_compiled", "is_unrewindable", "is_compiled", "starts_workers", "describe", "take_first",
           "and_list"]
