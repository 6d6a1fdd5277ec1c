"""Which storages hold a tensor's memory, for every layout.

A strided tensor's memory is its storage. A sparse tensor has none that torch will show
(``untyped_storage()`` raises "Cannot access storage of SparseTensorImpl"): its memory is the
storages of its indices and values. A wrapper subclass (a jagged nested tensor) keeps its memory in
the inner tensors ``__tensor_flatten__`` names. Everything that counts bytes per storage (what holds
memory now, the estimator's dry run) goes through `dense_parts`, so one sparse gradient (an
``nn.Embedding(sparse=True)``) cannot make it raise.
"""

from __future__ import annotations

import torch

# The dense parts of each sparse layout, by the accessor that returns each.
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def dense_parts(t: torch.Tensor):
    """The strided tensors whose storages hold ``t``'s memory: ``t`` itself, a sparse tensor's indices
    and values, a wrapper subclass's inner tensors."""
    parts = _SPARSE_PARTS.get(t.layout)
    if parts:
        for part in parts:
            yield from dense_parts(getattr(t, part)())
    elif type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        for attr in inner:
            value = getattr(t, attr, None)
            if isinstance(value, torch.Tensor):
                yield from dense_parts(value)
    else:
        yield t


def storages(t: torch.Tensor):
    """The ``UntypedStorage`` objects behind ``t`` (see `dense_parts`); a part whose storage cannot be
    read (a subclass without one) is skipped: it holds nothing nbaccel can count."""
    for part in dense_parts(t):
        try:
            yield part.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue


def memory_blocks(t: torch.Tensor) -> list[tuple]:
    """(identity, bytes, device) of each block of memory behind ``t``: its storages (see `storages`), or
    for a oneDNN tensor (``to_mkldnn()``), which has no storage to show, the tensor itself."""
    if t.layout == torch._mkldnn:
        return [(("mkldnn", id(t)), t.numel() * t.element_size(), t.device)]
    return [(s._cdata, s.nbytes(), s.device) for s in storages(t)]


def storage_keys(t: torch.Tensor) -> set:
    """Identities of the memory behind ``t`` (`memory_blocks`): a storage's StorageImpl address, unique
    while it is alive, on every device (meta included)."""
    return {key for key, _, _ in memory_blocks(t)}


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory behind ``t`` (`memory_blocks`), each block once."""
    return sum({key: nbytes for key, nbytes, _ in memory_blocks(t)}.values())


def optimizer_state_storage_bytes(optimizer) -> int:
    """Bytes the tensors of an optimizer's state hold now (AdamW: exp_avg, exp_avg_sq, step), measured: the
    estimator's dry run reads its probe optimizers' state with it, ``%%amp`` the state the cell's step made."""
    return sum(storage_bytes(t) for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


__all__ = ["dense_parts", "memory_blocks", "optimizer_state_storage_bytes", "storage_bytes", "storage_keys",
           "storages"]
