"""Capture what running a cell would change, and put it back, so every measured run starts equal.

``%%amp`` runs a training step many times. Without restoring, the fp32 baseline would train the
model and the bf16 run would start from different weights, optimizer moments and RNG streams,
and the user would end up with a model stepped twenty times. A `Snapshot` holds, on the host:

* the namespace bindings (``x = x + 1`` rebinds; we rebind back and drop new names);
* every tensor reachable from it -- namespace tensors, module parameters and buffers, optimizer
  parameters -- with its ``.grad``; restored *in place*, so ``model`` and the optimizer keep
  pointing at the same Parameter objects;
* each module's own attributes (`_ModuleLayout`): its class, which Parameter, buffer and submodule
  objects it holds, its hooks and ``training`` flag -- so a cell that registers a hook, prunes,
  adds a parametrization (``weight_norm`` swaps the class) or assigns a new Parameter does it
  once per run, not once more each run;
* optimizer / LR scheduler / GradScaler state (their ``state_dict``);
* shallow copies of lists, dicts, sets and bytearrays up to three levels deep (``losses.append(...)``,
  ``history['loss'].append(...)``) and copies of numpy arrays;
* the python, numpy, torch CPU and CUDA RNG states, and the states of generator objects reachable like
  the variables above (``torch.Generator``, ``numpy.random.default_rng()``, ``random.Random()``).

Host copies keep the snapshot out of the device-memory figures. What is *not* covered (an object
of a user class mutated in place, files written) is listed in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import random
import re
import sys
import types
from dataclasses import dataclass, field

import torch

from .options import in_magic, option

try:  # numpy is a torch dependency in practice, but not a hard one
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

# What the capture does not look into (immutable, or code); matched on type(obj) (see `_visit`).
_NOT_WALKED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float, bool,
               type(None))
_MAX_DEPTH = 3  # how deep into lists/dicts/tuples we look for tensors and modules (and copy containers)
# Items copied for containers below the top level, in all: a namespace holding thousands of big
# nested lists would otherwise double its memory; beyond this, nested containers are not restored.
_MAX_NESTED_ITEMS = 1_000_000


def _is_scheduler_type(kind: type) -> bool:
    schedulers = torch.optim.lr_scheduler
    return issubclass(kind, (schedulers.LRScheduler, schedulers.ReduceLROnPlateau))  # not one class before torch 2.2


def _is_grad_scaler(obj) -> bool:
    return isinstance(obj, torch.amp.GradScaler)


def _host_clone(t: torch.Tensor) -> torch.Tensor:
    if t.layout == torch._mkldnn:  # a oneDNN tensor (CPU only) has no strides for .to(copy=True) to allocate
        return t.detach().clone()
    return t.detach().to("cpu", copy=True)


# Restoring a tensor writes into it (copy_), and every in-place write bumps its version counter, which
# autograd checks against the version each saved tensor had when a graph saved it: an earlier cell's
# `loss = model(x)...` then failed its `loss.backward()` after any %%amp, even one on an unrelated cell
# ("modified by an inplace operation ... is at version 11"). After the copy the data is exactly what it
# was when the snapshot was taken, so the counter goes back to its value then. (Skipping the copy for a
# tensor whose version did not move is not safe: `w.data.mul_(2)` changes w's values without bumping
# w's counter.) torch 2.13 takes sequences; earlier releases took one tensor and one int.
_SET_VERSION = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _set_version(t: torch.Tensor, version: int | None) -> None:
    """Never raises: the values are back either way; where the counter cannot be set, only a graph saved
    before the magic sees it moved, as it did before this was done."""
    if _SET_VERSION is None or version is None:
        return
    try:
        if t._version == version:
            return
        try:
            _SET_VERSION((t,), (version,))
        except TypeError:  # torch before the sequence form: (tensor, version)
            _SET_VERSION(t, version)
    except Exception:  # noqa: BLE001 - see above
        pass


def _nbytes(t: torch.Tensor) -> int:
    """``t.nbytes``, also for a sparse COO tensor (which refuses it: its indices and values are counted)."""
    if t.layout == torch.sparse_coo:
        return _nbytes(t._indices()) + _nbytes(t._values())
    try:
        return t.nbytes
    except (RuntimeError, NotImplementedError):  # a layout or subclass without it: its storage, if any
        try:
            return t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return 0


def _deepcopy_or_same(value):
    """``copy.deepcopy``, except that a part it refuses (a lock, a generator, an open file: held by an
    LambdaLR's callable object or kept in an optimizer's param group) is kept as the object itself, as a
    variable bound to it is: its binding is restored, what is done to it in place is not. deepcopy's
    refusal used to fail the whole comparison as "a bug in nbaccel"."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - whatever deepcopy raised: copy the parts it can
        if type(value) is dict:
            return {k: _deepcopy_or_same(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(_deepcopy_or_same(v) for v in value)
        return value


def _deep_host_copy(value):
    """deepcopy that moves tensors to the host (state_dicts may hold CUDA tensors)."""
    if isinstance(value, torch.Tensor):
        return _host_clone(value)
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the dict's type, e.g. GradScaler's defaultdicts
        out.clear()
        out.update((k, _deep_host_copy(v)) for k, v in value.items())
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_deep_host_copy(v) for v in value)
    return _deepcopy_or_same(value)


class _SavedGroups(list):
    """An optimizer's saved ``param_groups``. ``Optimizer.load_state_dict`` deep-copies them, and an entry
    deepcopy refuses (a lock kept in a group) made every restore of that optimizer fail: such an entry
    is kept by reference (`_deepcopy_or_same`); every other group is copied as torch would."""

    def __deepcopy__(self, memo):
        try:
            return copy.deepcopy(list(self), memo)
        except Exception:  # noqa: BLE001 - as in _deepcopy_or_same
            return [_deepcopy_or_same(group) for group in self]


def _overlaps(t: torch.Tensor) -> bool:
    """Whether some of ``t``'s elements are one memory location (an expanded tensor's are)."""
    return t.layout == torch.strided and not t.is_nested and torch._debug_has_internal_overlap(t) == 1


def _span(t: torch.Tensor) -> int:
    """How many consecutive storage elements ``t`` reaches, from its offset (strides are never negative)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


@dataclass
class _TensorCopy:
    tensor: torch.Tensor
    data: torch.Tensor
    grad: torch.Tensor | None
    requires_grad: bool
    version: int | None = None  # its version counter at capture (`_set_version`)
    # (shape, stride, storage offset) of a tensor whose elements share memory: `data` is then its storage
    # from the offset on (`_span` elements), not its elements (see `capture`)
    overlap: tuple | None = None

    @classmethod
    def capture(cls, t: torch.Tensor) -> "_TensorCopy":
        grad = _host_clone(t.grad) if t.is_leaf and t.grad is not None else None
        overlap = None
        if _overlaps(t):
            # An expanded tensor (torch.zeros(1, 64).expand(32, 64)): several elements are one memory
            # location, and copy_ into it refuses ("more than one element of the written-to tensor refers
            # to a single memory location"). The memory it reaches is copied and put back instead.
            overlap = (tuple(t.shape), t.stride(), t.storage_offset())
            data = _host_clone(t.detach().as_strided((_span(t),), (1,), t.storage_offset()))
        else:
            data = _host_clone(t)
        return cls(t, data, grad, t.requires_grad, _version_of(t), overlap)

    def restore(self):
        t = self.tensor
        # A tensor made under torch.inference_mode() (an earlier cell's `preds`) can only be
        # updated in place inside inference mode; outside it copy_ raises.
        with torch.inference_mode() if t.is_inference() else torch.no_grad():
            if self.overlap is not None:
                shape, stride, offset = self.overlap
                if (tuple(t.shape), t.stride(), t.storage_offset()) != self.overlap:
                    t.as_strided_(shape, stride, offset)
                t.as_strided((self.data.numel(),), (1,), offset).copy_(self.data)
            elif t.is_nested:  # no .shape to compare; copy_ refuses a changed structure (then said by restore)
                t.copy_(self.data)
            elif t.shape == self.data.shape and t.dtype == self.data.dtype:
                t.copy_(self.data)
            else:  # the cell resized or re-typed it in place
                t.data = self.data.to(t.device, copy=True)
        _set_version(t, self.version)
        if t.is_leaf:
            t.requires_grad_(self.requires_grad)
            if self.grad is None:
                t.grad = None
            elif t.grad is not None and t.grad.shape == self.grad.shape:
                t.grad.copy_(self.grad)
            else:
                t.grad = self.grad.to(t.device, copy=True)


# What every Module keeps in its __dict__ (parameters, buffers, submodules, hooks, training):
# `_ModuleLayout` restores those, the dicts and sets among them in place (the same objects, their
# contents put back, so hook handles, which hold a weak reference to their dict, stay valid). The
# rest is the model's own code's: bound back by the layout, its values visited like variables.
_MODULE_OWN = frozenset(vars(torch.nn.Module()))


def _capture_groups(optimizer: torch.optim.Optimizer) -> tuple:
    """Which groups the optimizer holds and which tensors each group's "params" holds: a cell's
    ``add_param_group`` (unfreezing a backbone) made ``load_state_dict`` refuse the saved state ("a
    different number of parameter groups", called a bug in nbaccel), and a cell that swapped a group's
    params left every later run training other tensors (a trial)."""
    groups = optimizer.param_groups
    return groups, list(groups), [(g, dict(g), g["params"], list(g["params"])) for g in groups]


def _restore_groups(optimizer: torch.optim.Optimizer, saved: tuple) -> None:
    groups, members, contents = saved
    optimizer.param_groups = groups
    groups[:] = members
    for group, items, params, held in contents:
        group.clear()
        group.update(items)  # the original "params" list object among them
        params[:] = held


@dataclass
class _ModuleLayout:
    """One module's class and own attributes, restored in place."""
    cls: type
    attributes: dict  # name -> value as captured
    contents: list  # (container, shallow copy) for torch's own dicts and sets among them (`_MODULE_OWN`)

    @classmethod
    def capture(cls, module: torch.nn.Module) -> "_ModuleLayout":
        attributes = dict(vars(module))
        contents = [(v, copy.copy(v)) for k, v in attributes.items()
                    if k in _MODULE_OWN and isinstance(v, (dict, set))]
        return cls(type(module), attributes, contents)

    def restore(self, module: torch.nn.Module) -> None:
        if type(module) is not self.cls:  # torch.nn.utils.parametrize swapped in a subclass
            module.__class__ = self.cls
        own = vars(module)  # not setattr: Module.__setattr__ would re-file Parameters and Modules
        for name in [k for k in own if k not in self.attributes]:
            del own[name]
        own.update(self.attributes)
        for container, saved in self.contents:
            if container or saved:  # most are empty hook dicts: restoring 400 modules took 2x as long
                _restore_container(container, saved)


@dataclass
class Snapshot:
    """Host-side copy of a namespace's restorable state. Build with `Snapshot.capture`."""

    namespace: dict | None
    bindings: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)
    modules: list = field(default_factory=list)  # (submodule, _ModuleLayout)
    optimizer_groups: list = field(default_factory=list)  # (optimizer, _capture_groups(optimizer))
    stateful: list = field(default_factory=list)  # (object, host state_dict copy)
    containers: list = field(default_factory=list)  # (container, shallow copy)
    generators: list = field(default_factory=list)  # (random number generator object, its state)
    rng: dict = field(default_factory=dict)
    nbytes: int = 0
    skip: object = None  # names (IPython's history: _, _i, Out...) that restore leaves alone
    dry: bool = False  # only count the bytes a capture would copy (see `estimate_bytes`)
    nested_items: int = 0  # items copied for containers below the top level (see _MAX_NESTED_ITEMS)
    # id(object) -> where the capture found it (`_path_text`), for the objects above: a restore that
    # fails for one names the variable ("cfg", "model.0.weight", "history['loss']").
    paths: dict = field(default_factory=dict)
    # What the capture could not copy (a RestoreFailure each, `copied` False): not restored between runs;
    # if the cell depends on it, two runs from the restored state differ and the result says so.
    left_out: list = field(default_factory=list)

    @classmethod
    def capture(cls, namespace: dict | None = None, objects=(), skip=lambda name: False,
                dry: bool = False) -> "Snapshot":
        """Snapshot ``namespace`` (a dict of bindings) and/or explicit ``objects``."""
        snap = cls(namespace=namespace, skip=skip, dry=dry)
        seen: set[int] = set()
        if namespace is not None:
            snap.bindings = {k: v for k, v in namespace.items() if not skip(k)}
            for name, value in snap.bindings.items():
                snap._visit(value, seen, 0, name, top_level=True)
        for obj in objects:
            snap._visit(obj, seen, 0, f"<{type(obj).__name__}>", top_level=True)  # no name: its type
        if not dry:
            for hooks in _process_wide_hooks():
                snap.containers.append((hooks, copy.copy(hooks)))
                snap.paths[id(hooks)] = "torch's process-wide hooks"
            snap.rng = _capture_rng()
        return snap

    def _add_tensor(self, t: torch.Tensor, seen: set[int], path):
        # A lazy module's uninitialized parameter has no values to copy (and refuses .detach()); a cell
        # that reads such a module is refused before the snapshot (`refuse_uninitialized_lazy`).
        if id(t) in seen or t.is_meta or torch.nn.parameter.is_lazy(t):
            return
        seen.add(id(t))
        try:
            if self.dry:
                grad = t.grad if t.is_leaf and t.grad is not None else None
                data = _span(t) * t.element_size() if _overlaps(t) else _nbytes(t)
                self.nbytes += data + (_nbytes(grad) if grad is not None else 0)
                return
            copied = _TensorCopy.capture(t)
        except Exception as error:  # noqa: BLE001 - a tensor nbaccel cannot copy is left out, and said
            self.left_out.append(RestoreFailure(_path_text(path), error, copied=False))
            return
        self.tensors.append(copied)
        self.paths[id(t)] = path
        self.nbytes += _nbytes(copied.data) + (_nbytes(copied.grad) if copied.grad is not None else 0)

    def _visit(self, obj, seen: set[int], depth: int, path, top_level: bool = False):
        # type(), not isinstance(): isinstance reads obj.__class__, which a user's property may make raise;
        # nor do copy.copy or a module's own parameters() run (a user's override refused): any object in
        # the namespace is captured, or left out and named, never a failure of the comparison.
        kind = type(obj)
        if issubclass(kind, _NOT_WALKED):
            return
        if issubclass(kind, torch.Tensor):
            self._add_tensor(obj, seen, path)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        try:
            self._walk(obj, kind, seen, depth, path, top_level)
        except Exception as error:  # noqa: BLE001 - an object nbaccel cannot copy is left out, and said
            self.left_out.append(RestoreFailure(_path_text(path), error, copied=False))

    def _walk(self, obj, kind: type, seen: set[int], depth: int, path, top_level: bool):
        if issubclass(kind, torch.nn.Module):
            module = torch.nn.Module  # its own methods: a model's override of parameters() is not called
            for name, t in itertools.chain(module.named_parameters(obj), module.named_buffers(obj)):
                self._add_tensor(t, seen, (path, ".", name))
            for name, m in module.named_modules(obj):
                where = (path, ".", name) if name else path
                if not self.dry:
                    self.modules.append((m, _ModuleLayout.capture(m)))
                    self.paths[id(m)] = where
                # The attributes a model's own code keeps (self.mask = torch.ones(...), self.history = []):
                # their values, as for a namespace variable (a trial's counter tensor went up 17 times).
                for name, value in vars(m).items():
                    if name not in _MODULE_OWN:
                        self._visit(value, seen, depth + 1, (where, ".", name))
        elif issubclass(kind, torch.optim.Optimizer):
            for i, group in enumerate(obj.param_groups):
                for j, p in enumerate(group["params"]):
                    self._add_tensor(p, seen, (path, ".", f"param_groups[{i}]['params'][{j}]"))
            # its groups and its state, or neither (a user's state_dict() that raised)
            groups = None if self.dry else _capture_groups(obj)
            self._add_state(obj, obj.state_dict(), path, optimizer=True)
            if not self.dry:
                self.optimizer_groups.append((obj, groups))
        elif _is_scheduler_type(kind) or issubclass(kind, torch.amp.GradScaler):
            self._add_state(obj, obj.state_dict() if _is_scheduler_type(kind) else dict(vars(obj)), path)
        elif _is_generator_type(kind):
            # A generator object of the user's (torch.Generator, numpy's default_rng(), random.Random()):
            # its state, as the process-wide ones' (it advanced once per run: 12 draws after a %%amp).
            state = _generator_state(obj)
            self.nbytes += _nbytes(state) if isinstance(state, torch.Tensor) else 0
            if not self.dry:
                self.generators.append((obj, state))
                self.paths[id(obj)] = path
        elif np is not None and issubclass(kind, np.ndarray):
            if obj.flags.writeable:
                self.nbytes += obj.nbytes
                if not self.dry:
                    self.containers.append((obj, obj.copy()))
                    self.paths[id(obj)] = path
        elif issubclass(kind, (list, dict, set, bytearray)) and depth < _MAX_DEPTH:
            # The base type's own methods copy and list the contents: a subclass's __copy__ or
            # __reduce_ex__ (one refused) and its own values() or __iter__ are not called.
            base = next(b for b in (dict, list, set, bytearray) if issubclass(kind, b))
            size = base.__len__(obj)
            # Every container we walk through is copied (shallow), not only the top-level ones:
            # `history = {'loss': []}` then `history['loss'].append(x)` mutates a nested list.
            if top_level or self.nested_items + size <= _MAX_NESTED_ITEMS:
                if not top_level:
                    self.nested_items += size
                if not self.dry:
                    self.containers.append((obj, base.copy(obj)))
                    self.paths[id(obj)] = path
            if base is bytearray:
                return
            items = dict.items(obj) if base is dict else enumerate(base.__iter__(obj))
            for key, item in list(itertools.islice(items, 10_000)):
                self._visit(item, seen, depth + 1, (path, "[]", key))
        elif issubclass(kind, tuple) and depth < _MAX_DEPTH:
            for i, item in enumerate(tuple.__iter__(obj)):
                self._visit(item, seen, depth + 1, (path, "[]", i))

    def _add_state(self, obj, state: dict, path, optimizer: bool = False):
        if self.dry:
            self.nbytes += sum(_nbytes(t) for t in _tensors_in(state))
            return
        copied = _deep_host_copy(state)
        if optimizer:
            copied["param_groups"] = _SavedGroups(copied["param_groups"])
        self.nbytes += sum(_nbytes(t) for t in _tensors_in(copied))
        self.stateful.append((obj, copied))
        self.paths[id(obj)] = path

    def release(self) -> None:
        """Drop the host copies (once nothing will be restored from them): a failed comparison's traceback keeps
        its frames, and through them this snapshot, alive until the next error (a trial's failed %%amp kept a
        200 MiB copy, "216 MiB kept", that nothing under the error explained)."""
        for copies in (self.bindings, self.rng, self.tensors, self.modules, self.optimizer_groups, self.stateful,
                       self.containers, self.generators):
            copies.clear()

    def describe_left_out(self) -> str | None:
        """What the capture could not copy, so no run puts back, with why (None when nothing): for the
        result of a comparison, e.g. "`thing` (never copied: RuntimeError: ...)"."""
        return describe_failures(self.left_out) if self.left_out else None

    def _failure(self, obj, error: Exception) -> "RestoreFailure":
        path = self.paths.get(id(obj))
        return RestoreFailure(_path_text(path) if path is not None else f"<{type(obj).__name__}>", error)

    def restore(self, drop_state_first: bool = False):
        """Put everything back. Safe to call many times; each call restores the same state.
        An empty snapshot (``Snapshot(None)``, the restore-free mode) restores nothing.

        ``drop_state_first`` (after an out-of-memory error): an optimizer's current state is dropped
        before its saved state is loaded, so its old and restored moments are never on the device
        together. Not by default: a ``load_state_dict`` that refuses would leave the optimizer empty.

        An object that cannot be put back (a dict subclass whose ``clear()`` refuses once the cell has
        run) does not stop the rest: everything else is restored, and then `RestoreIncomplete` names
        what was not (or, when one of them ran out of memory, that error is raised, with the list in
        `restore_failures`). A failed restore once stopped at the first such object and the variables
        after it (lists, the RNG) kept what the run did, while the magic said all were put back.
        A KeyboardInterrupt stops it at once."""
        if not self.rng:
            return
        if self.namespace is not None:
            for name in [k for k in self.namespace if k not in self.bindings and not self.skip(k)]:
                del self.namespace[name]  # a name the cell created
            self.namespace.update(self.bindings)
        def stateful(obj, state):
            if drop_state_first and isinstance(obj, torch.optim.Optimizer):
                obj.state.clear()
            _restore_stateful(obj, state)

        # (the object restored, how), in order: param groups before load_state_dict, which needs them
        steps = [*((c.tensor, c.restore) for c in self.tensors),
                 *((m, functools.partial(layout.restore, m)) for m, layout in self.modules),
                 *((o, functools.partial(_restore_groups, o, g)) for o, g in self.optimizer_groups),
                 *((o, functools.partial(stateful, o, st)) for o, st in self.stateful),
                 *((c, functools.partial(_restore_container, c, saved)) for c, saved in self.containers),
                 *((g, functools.partial(_set_generator_state, g, st)) for g, st in self.generators)]
        failures = []
        for obj, put_back in steps:
            try:
                put_back()
            except Exception as error:  # noqa: BLE001 - collected, the rest restored, then raised
                failures.append(self._failure(obj, error))
        try:
            _restore_rng(self.rng)
        except Exception as error:  # noqa: BLE001 - collected as above
            failures.append(RestoreFailure("the random number generators' state", error))
        if failures:
            raise_failures(failures)


@dataclass
class RestoreFailure:
    """One object a restore could not put back: where it was found (``cfg``, ``model.0.weight``; None
    when not known), and why; ``copied`` False for one the capture could not copy (`Snapshot.left_out`)."""
    what: str | None
    error: BaseException
    copied: bool = True

    def __str__(self) -> str:
        why = _why(self.error) if self.copied else f"never copied: {_why(self.error)}"
        return f"`{self.what}` ({why})" if self.what is not None else why


def _why(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > 200:
        # cut at the end of a sentence or a word, not mid-word (torch's dispatcher messages run long)
        cut = first[:200]
        end = cut.rfind(". ")
        first = cut[:end + 1] if end >= 40 else cut.rsplit(" ", 1)[0] + " ..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class RestoreIncomplete(Exception):
    """`Snapshot.restore` put back everything it could, but not ``failures`` (`RestoreFailure` each)."""

    def __init__(self, failures: list):
        super().__init__(f"nbaccel could not put back {describe_failures(failures)}; everything else was put back")
        self.failures = failures


def distinct_failures(failures: list) -> list[str]:
    """One entry per object, as in ["`cfg` (TypeError: frozen)", "`opt` (...)"] (a failed layout and a
    failed ``load_state_dict`` of one optimizer are one)."""
    first = {}
    for failure in failures:
        first.setdefault(failure.what, failure)
    return [str(f) for f in first.values()]


def describe_failures(failures: list) -> str:
    """`distinct_failures` in one line: "`cfg` (TypeError: frozen), `opt` (...)"."""
    return ", ".join(distinct_failures(failures))


def raise_failures(failures: list):
    """Raise what `Snapshot.restore` reports for ``failures``: `RestoreIncomplete`, or the first
    out-of-memory error among them (the machine's, which nbaccel's out-of-memory handling and %%budget
    recognise by its type), carrying the list in `restore_failures`."""
    from .oom import is_oom

    oom = next((f.error for f in failures if is_oom(f.error)), None)
    if oom is not None:
        oom._nbaccel_restore_failures = failures
        raise oom
    raise RestoreIncomplete(failures) from failures[0].error


def restore_failures(error: BaseException) -> list:
    """The objects a failed `Snapshot.restore` could not put back, from what it raised (empty when it
    raised something else)."""
    if isinstance(error, RestoreIncomplete):
        return error.failures
    return list(getattr(error, "_nbaccel_restore_failures", ()))


def _path_text(path) -> str:
    """``("history", "[]", "loss")`` nested in tuples -> ``history['loss']``; a string as it is."""
    steps = []
    while isinstance(path, tuple):
        path, how, key = path
        steps.append(f".{key}" if how == "." else f"[{key!r}]")
    return path + "".join(reversed(steps))


class RestoreNote(str):
    """The note `amp._put_back` adds to an abandoned comparison's exception when the variables could not
    all be put back (a str, as ``add_note`` takes), with ``names``: the variables not put back, for the
    magic's own line."""

    names: tuple = ()

    def __new__(cls, text: str, names=()):
        note = super().__new__(cls, text)
        # the variable each failed object was found under: `model` for `model.0.weight`
        note.names = tuple(dict.fromkeys(re.split(r"[.\[]", name, maxsplit=1)[0] for name in names))
        return note


def not_put_back(exc: BaseException) -> tuple:
    """The variables a `RestoreNote` on ``exc`` names (empty when there is none)."""
    notes = getattr(exc, "__notes__", ())
    if not isinstance(notes, (list, tuple)):  # a cell may set __notes__ to anything (None, a number)
        return ()
    return next((note.names for note in notes if isinstance(note, RestoreNote)), ())


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def estimate_bytes(namespace: dict | None = None, objects=(), skip=lambda name: False) -> int:
    """Bytes a `Snapshot.capture` of the same arguments would copy to the host, without copying."""
    return Snapshot.capture(namespace, objects, skip, dry=True).nbytes


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class SnapshotTooLarge(ValueError):
    """The state to snapshot is larger than the allowed share of free host memory."""


class LazyModuleNotReady(ValueError):
    """A module to snapshot has lazy parameters (``nn.LazyLinear``...) not yet initialized."""


def uninitialized_lazy(value) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) for each lazy module (``nn.LazyLinear``...) in ``value`` whose parameters are
    not initialized yet; empty for anything else."""
    if not isinstance(value, torch.nn.Module):
        return []
    from torch.nn.modules.lazy import LazyModuleMixin

    return [(path, m) for path, m in value.named_modules()
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]


def lazy_members(name: str, value) -> list[tuple[str, object]]:
    """What the lazy-module check looks at: ``value`` itself, or one level into a dict, list or tuple
    (``models["a"]``), each with the name code would write (at most 1000)."""
    if isinstance(value, dict):
        return [(f"{name}[{key!r}]", v) for key, v in itertools.islice(value.items(), 1000)]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(itertools.islice(value, 1000))]
    return [(name, value)]


def refuse_uninitialized_lazy(name: str, value) -> None:
    """Raise `LazyModuleNotReady` for a module the code reads (or a dict, list or tuple of modules:
    ``models["a"](x)``) whose lazy parameters are not initialized: the first forward turns them into
    ordinary ones in place, so no snapshot could put them back and every later run would start from
    the weights (and training) of the first. torch's own advice for lazy modules is a dry-run forward.
    (A lazy module the code does not read is left alone: the magic snapshots the whole namespace, and
    a review found an unrelated one refusing every cell.)"""
    for name, module in lazy_members(name, value):
        lazy = uninitialized_lazy(module)
        if not lazy:
            continue
        path, first = lazy[0]
        where = f"its {type(first).__name__} at .{path}" if path else f"a {type(first).__name__}"
        more = f" and {len(lazy) - 1} more" if len(lazy) > 1 else ""
        raise LazyModuleNotReady(
            f"`{name}` has lazy parameters not initialized yet ({where}{more}): the first run would initialize "
            "them and every later run start from its weights. Run one forward pass first (e.g. "
            f"`{name}(x)` in a cell above), or run without restoring "
            f"({option('no_restore', True) if in_magic() else 'restore=False'})")


def _restore_stateful(obj, state):
    if _is_grad_scaler(obj):
        # GradScaler.load_state_dict refuses the empty state of a scaler that has not stepped yet,
        # and its lazily created tensors live in private attributes; restore the attributes.
        for key, value in state.items():
            current = getattr(obj, key, None)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                value = value.to(current.device, copy=True)
            elif isinstance(value, torch.Tensor):
                value = value.clone()
            else:
                value = _deepcopy_or_same(value)
            setattr(obj, key, value)
        for key in [k for k in vars(obj) if k not in state]:
            delattr(obj, key)
        return
    obj.load_state_dict(_deep_host_copy(state) if isinstance(obj, torch.optim.Optimizer) else _deepcopy_or_same(state))


def _process_wide_hooks() -> list[dict]:
    """torch's process-wide hook registries: ``register_module_forward_hook`` and its kin (every
    module's forward, backward and registration), and the optimizers' global step hooks. A cell that
    registers one adds it once per run: restored with the variables, as a module's own hooks are (a
    cell's global forward hook otherwise ran once per run on every later forward)."""
    registries = []
    for name in ("torch.nn.modules.module", "torch.optim.optimizer"):  # both imported with torch
        module = sys.modules.get(name)
        registries += [v for k, v in vars(module or types).items() if k.startswith("_global_") and isinstance(v, dict)]
    return registries


def _restore_container(container, saved):
    if np is not None and isinstance(container, np.ndarray):
        if container.shape == saved.shape:
            container[...] = saved
    elif isinstance(container, (list, bytearray)):
        container[:] = saved
    elif isinstance(container, dict):
        container.clear()
        container.update(saved)
    elif isinstance(container, set):
        container.clear()
        container.update(saved)


def _is_generator_type(kind: type) -> bool:
    """torch.Generator, numpy's Generator, BitGenerator and RandomState, random.Random (not SystemRandom,
    which has no state: it reads the OS's)."""
    if issubclass(kind, torch.Generator):
        return True
    if np is not None and issubclass(kind, (np.random.Generator, np.random.BitGenerator, np.random.RandomState)):
        return True
    return issubclass(kind, random.Random) and not issubclass(kind, random.SystemRandom)


def _generator_state(generator):
    if isinstance(generator, torch.Generator):
        return generator.get_state()  # a copy, on the host
    if np is not None and isinstance(generator, np.random.Generator):
        return generator.bit_generator.state  # a new dict each time
    if np is not None and isinstance(generator, np.random.BitGenerator):
        return generator.state
    if np is not None and isinstance(generator, np.random.RandomState):
        return generator.get_state(legacy=False)
    return generator.getstate()


def _set_generator_state(generator, state) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif np is not None and isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif np is not None and isinstance(generator, np.random.BitGenerator):
        generator.state = state
    elif np is not None and isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)


@contextlib.contextmanager
def rng_kept():
    """A block that draws random numbers on nbaccel's behalf (the estimator's dry runs: a Dropout's
    masks, a random probe input) leaves the python, numpy, torch and CUDA generators as it found them:
    the user's next ``torch.randn`` or dropout mask is the one it would have been without it."""
    state = _capture_rng()
    try:
        yield
    finally:
        _restore_rng(state)


def _capture_rng() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])

