"""What holds memory now: the largest tensors, modules and optimizers reachable by name.

Sizes are the bytes of the *storages* behind the tensors, counted once per storage: a view
(``x[:10]``, ``w.t()``) costs nothing extra, and a tensor that is also a module's parameter is
reported as shared rather than counted twice. Containers (lists, tuples, dict values, nested up to
five levels) are included, because ``losses.append(loss)`` without ``.item()`` is a classic leak, and so
is IPython's output cache (``Out[n]``, ``_``), which keeps every displayed tensor alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .device import DTYPE_NAMES
from .memory import format_bytes as _fmt
from .storages import memory_blocks, storage_bytes


@dataclass
class Holder:
    """One name in the namespace and the device memory reachable from it."""

    name: str
    kind: str  # tensor | module | optimizer | container
    device: str
    dtype: str
    nbytes: int
    detail: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "device": self.device, "dtype": self.dtype,
                "bytes": self.nbytes, "detail": self.detail}


def _storages(tensors) -> dict:
    """{storage key: (bytes, device, dtype)} for the tensors, each storage once (the StorageImpl
    address identifies a storage while it is alive, on every device); a tensor split into parts
    (sparse, nested) is named by its own dtype, not its index parts' int64."""
    found = {}
    for tensor in tensors:
        # an uninitialized lazy parameter holds no memory (and refuses every operation)
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or torch.nn.parameter.is_lazy(tensor):
            continue
        dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).replace("torch.", ""))
        for key, nbytes, device in memory_blocks(tensor):
            found.setdefault(key, (nbytes, str(device), dtype))
    return found


def _describe(storages: dict) -> tuple[str, str]:
    devices = sorted({d for _, d, _ in storages.values()})
    dtypes = sorted({t for _, _, t in storages.values()})
    return (",".join(devices) or "-"), (",".join(dtypes) or "-")


def _module_tensors(module: torch.nn.Module):
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return params, list(module.buffers()), grads


def _optimizer_tensors(opt: torch.optim.Optimizer):
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _stateless(opt: torch.optim.Optimizer) -> str | None:
    """Why an optimizer never keeps state (plain SGD), or None."""
    if isinstance(opt, torch.optim.SGD) and not any(g.get("momentum", 0) for g in opt.param_groups):
        return "SGD without momentum keeps no state"
    return None


def _optimizer_detail(opt: torch.optim.Optimizer, states: dict) -> str:
    name = type(opt).__name__
    stateless = _stateless(opt)
    if stateless:
        return stateless
    # torch's state is a defaultdict: a step can leave empty entries behind, so count params with tensors.
    held = sum(1 for s in opt.state.values() if any(isinstance(v, torch.Tensor) for v in s.values()))
    if held:
        return f"{name} state for {held} param{'s' if held != 1 else ''}"
    return f"{name}: no state yet (it is created at the first step)"


# How far into nested lists, tuples and dicts the table looks, and at most how many items it reads
# below the top level (a top-level list, `losses` of 20,000 tensors, is read whole): a checkpoint
# `{"model": model.state_dict(), "opt": opt.state_dict()}` keeps Adam's moments four levels down
# (ckpt -> "opt" -> "state" -> 0 -> "exp_avg").
CONTAINER_DEPTH = 5
NESTED_ITEMS = 10_000


def _container_tensors(value) -> list:
    """The tensors in a list, tuple or dict, and in those nested in it (up to `CONTAINER_DEPTH` levels,
    `NESTED_ITEMS` items below the top): a checkpoint dict of state_dicts, a history of per-step dicts
    (a user trial's 12 MiB checkpoint was missing from the table one level deeper)."""
    found, left = [], [NESTED_ITEMS]

    def walk(container, depth: int) -> None:
        try:
            items = list(container.values() if isinstance(container, dict) else container)
        except TypeError:
            return
        for item in items:
            if depth > 1:
                left[0] -= 1
                if left[0] < 0:
                    return
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif depth < CONTAINER_DEPTH and isinstance(item, (list, tuple, dict)):
                walk(item, depth + 1)

    walk(value, 1)
    return found


def _named_values(namespace: dict, skip):
    for name, value in list(namespace.items()):
        if name == "Out" and isinstance(value, dict):
            for n, v in list(value.items()):
                yield f"Out[{n}]", v
        elif not skip(name):
            yield name, value


def _total(storages: dict) -> int:
    return sum(b for b, _, _ in storages.values())


def _split(storages: dict, counted: dict) -> tuple[dict, str]:
    """(the storages no earlier row counted, "shares 4 MiB with big" for the rest, or "")."""
    own = {k: v for k, v in storages.items() if k not in counted}
    shared = {k: v for k, v in storages.items() if k in counted}
    if not shared:
        return own, ""
    return own, f"shares {_fmt(_total(shared))} with {', '.join(sorted({counted[k] for k in shared}))}"


def _joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def frame_tensors(tracebacks) -> list[tuple[str, dict]]:
    """The tensors tracebacks (one, or several) keep alive through their functions' variables:
    [("t in boom", storages), ...], innermost frame last, each storage once. Module-level frames (a cell's own
    code) are left out: their variables are the namespace, listed by name. Modules and optimizers are not
    walked: a function's ``model`` is the namespace's too, almost always."""
    found, seen = [], set()
    for tb in tracebacks if isinstance(tracebacks, (list, tuple)) else [tracebacks]:
        found += _frames_tensors(tb, seen)
    return found


def _frames_tensors(tb, seen: set) -> list[tuple[str, dict]]:
    found = []
    while tb is not None:
        frame = tb.tb_frame
        tb = tb.tb_next
        if frame.f_locals is frame.f_globals:
            continue
        for var, value in list(frame.f_locals.items()):
            tensors = ([value] if isinstance(value, torch.Tensor) else
                       _container_tensors(value) if isinstance(value, (list, tuple, dict)) else [])
            storages = {k: v for k, v in _storages(tensors).items() if k not in seen}
            if storages:
                seen.update(storages)
                found.append((f"{var} in {frame.f_code.co_name}", storages))
    return found


def error_frames_holder(tb, counted: dict) -> Holder | None:
    """One row for what the last error's traceback keeps alive beyond the names (`frame_tensors`): IPython
    keeps the last error for %tb and %debug, so a cell that failed after allocating holds its memory until the
    next error (a trial: 300 MiB under a 600 MiB budget, and the table listed 25 MiB of it)."""
    parts = [(label, {k: v for k, v in storages.items() if k not in counted}) for label, storages in frame_tensors(tb)]
    parts = [(label, storages) for label, storages in parts if storages]
    if not parts:
        return None
    every = {k: v for _, storages in parts for k, v in storages.items()}
    device, dtype = _describe(every)
    parts.sort(key=lambda part: -_total(part[1]))
    shown = ", ".join(f"{label} {_fmt(_total(storages))}" for label, storages in parts[:3])
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return Holder(ERROR_FRAMES, "traceback", device, dtype, _total(every), shown + more)


# The name of the last error's row in "what holds memory now".
ERROR_FRAMES = "(last error)"


def namespace_holders(namespace: dict, top: int | None = 10, skip=lambda name: False, error_tb=None) -> list[Holder]:
    """The ``top`` largest holders of tensor memory in ``namespace``, largest first (None: all).

    Modules report parameters + buffers + gradients; optimizers their state tensors (Adam's
    moments...); tensors and containers (nested up to `CONTAINER_DEPTH` levels) their storages. Each
    storage is counted once, by the first row that holds it -- modules and optimizers first, the
    largest first (so `encoder = model.encoder` shares its bytes with `model`), then the other names
    in the namespace's order (views smaller than their storage after the rest), IPython's output
    cache (``Out[n]``) last -- and every later row that
    holds it says so in ``detail`` ("shares 4 MiB with big") with 0 bytes for it: the rows add up to
    what the names hold. (A container whose tensors are all counted already gets no row.) ``error_tb``: the
    last error's traceback, whose functions' variables get one more row (`error_frames_holder`).
    """
    counted: dict = {}  # storage key -> the name of the row that counts it
    rows: list[Holder] = []
    # sorted() is stable: the user's own names in their order, views of a larger storage after the rest
    # (`y = big[:2]`, named before `big`, took big's bytes), then the output cache's entries
    values = sorted(_named_values(namespace, skip), key=lambda item: (item[0].startswith("Out["), _part_of(item[1])))
    stateful, seen_objects = [], set()
    for name, value in values:
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) and id(value) not in seen_objects:
            seen_objects.add(id(value))  # a second name for the same model: not a second row
            if isinstance(value, torch.nn.Module):
                params, buffers, grads = _module_tensors(value)
                parts = {"params": _storages(params), "buffers": _storages(buffers), "grads": _storages(grads)}
            else:
                parts = {"state": _storages(_optimizer_tensors(value))}
            stateful.append((name, value, parts))
    stateful.sort(key=lambda item: -_total({k: v for part in item[2].values() for k, v in part.items()}))
    for name, value, parts in stateful:
        total = {k: v for part in parts.values() for k, v in part.items()}
        own, shared = _split(total, counted)
        counted.update(dict.fromkeys(own, name))
        if isinstance(value, torch.nn.Module):
            kind, (device, dtype) = "module", _describe(parts["params"] or total)
            detail = " + ".join(f"{label} {_fmt(_total(part))}" for label, part in parts.items() if part)
        else:
            kind, (device, dtype) = "optimizer", _describe(total)
            detail = _optimizer_detail(value, total)
        rows.append(Holder(name, kind, device, dtype, _total(own), _joined(detail, shared)))
    for name, value in values:
        if isinstance(value, torch.Tensor):
            tensors, kind = [value], "tensor"
        elif isinstance(value, (list, tuple, dict)) and not isinstance(value, str):
            tensors, kind = _container_tensors(value), "container"
            if not tensors:
                continue
        else:
            continue
        storages = _storages(tensors)
        own, shared = _split(storages, counted)
        counted.update(dict.fromkeys(own, name))
        device, dtype = _describe(storages)
        detail = (f"{len(tensors)} tensor{'s' if len(tensors) != 1 else ''}" if kind == "container"
                  else _view_detail(value, own))
        if own or kind == "tensor":
            rows.append(Holder(name, kind, device, dtype, _total(own), _joined(detail, shared)))
    held_by_error = error_frames_holder(error_tb, counted) if error_tb is not None else None
    if held_by_error is not None:
        rows.append(held_by_error)
    rows.sort(key=lambda h: h.nbytes, reverse=True)
    return rows[:top]


def _part_of(value) -> bool:
    """Whether ``value`` is a dense tensor smaller than the storage it views (a slice, a 0-d loss)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_nested:
        return False
    return value.numel() * value.element_size() < storage_bytes(value)


def unresident_line(holders: list[Holder], rss: int | None) -> str:
    """Where the namespace's host tensors add up to more than the process's RSS: pages never written
    (``torch.empty``) are not resident until touched. A trial's ``big = torch.empty(...)`` of 3.81 GiB sat
    in an OOM report under "allocated at the failure: 2.29 GiB (process RSS)", unexplained."""
    on_host = sum(h.nbytes for h in holders if h.device.split(":")[0] == "cpu")
    if rss is None or on_host <= rss:
        return ""
    return (f"the namespace's host tensors listed hold {_fmt(on_host)}, more than the process RSS of {_fmt(rss)}: "
            "pages a tensor has never written (torch.empty, untouched) are not resident yet, so the RSS counts "
            "less than they will take once written")


def _view_detail(tensor: torch.Tensor, storages: dict) -> str:
    """A tensor much smaller than the storage it keeps alive: say so, since that is the surprise.

    ``loss = nn.MSELoss()(x, y)`` is a 0-d tensor whose storage is the whole elementwise buffer
    (512 KiB for a 256x512 batch); keeping ``loss`` around keeps that buffer."""
    if tensor.layout != torch.strided or tensor.is_nested:  # a sparse tensor is no view: its parts are its memory
        return ""
    held = sum(b for b, _, _ in storages.values())
    own = tensor.numel() * tensor.element_size()
    if held < VIEW_NOTE_BYTES or held < 2 * own:
        return ""
    shape = "x".join(map(str, tensor.shape)) or "0-d"
    fix = ".item()" if tensor.numel() == 1 else ".clone()"
    return f"{shape} view of a {_fmt(held)} storage: {fix} frees the rest"


# Below this a kept storage is not worth a remark.
VIEW_NOTE_BYTES = 64 << 10

__all__ = ["ERROR_FRAMES", "Holder", "namespace_holders"]
