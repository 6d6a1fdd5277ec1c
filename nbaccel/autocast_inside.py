"""Autocast inside a dispatch mode's ops, as the same code runs without the mode.

Inside ``__torch_dispatch__`` torch turns autocast off for what an op calls in turn. Most kernels call
nothing autocast acts on, and an op with an autocast rule was cast already and turned autocast off for
its inner calls itself. But an op without an autocast rule that calls ops autocast casts runs those
uncast under a dispatch mode: in fp32 where the code without the mode ran bf16, or with mixed dtypes
that raise. Both of nbaccel's dispatch modes that run a cell's math, `%%amp`'s op audit
(`flops.OpAudit`) and the estimator's `dry_run.LiveBytes`, run such ops with autocast back on.
"""

from __future__ import annotations

import contextlib

import torch

# The ops known to cast inside (each found by a trial):
# - aten::_transformer_encoder_layer_fwd: nn.TransformerEncoder's inference fast path, a fused op that
#   autocast passes through; under the audit it ran all fp32 while the timed runs ran it in bf16 (a trial
#   read "no op ran in bf16" and a drift of 0 beside a 2.2x bf16 speedup).
# - aten::_trilinear (nn.Bilinear, F.bilinear): runs its inner bmm calls cast; same symptom.
# - aten::_sparse_addmm (torch.sparse.mm of a sparse by a dense matrix): runs an addmm that autocast
#   casts; under a mode it returned fp32 beside the timed runs' bf16 or, for a bf16 dense operand (a
#   GNN's hidden state after an autocast Linear), raised "expected scalar type Float but found
#   BFloat16" in a cell that runs under autocast without the mode.
CASTS_INSIDE = frozenset({"aten::_transformer_encoder_layer_fwd", "aten::_trilinear", "aten::_sparse_addmm"})
AUTOCAST_KEYS = (("cpu", torch._C.DispatchKey.AutocastCPU), ("cuda", torch._C.DispatchKey.AutocastCUDA))


@contextlib.contextmanager
def autocast_keys_on(keys):
    """Autocast's dispatch keys no longer excluded in this thread for the block, as they were after."""
    saved = [(key, torch._C._dispatch_tls_is_dispatch_key_excluded(key),
              torch._C._dispatch_tls_is_dispatch_key_included(key)) for key in keys]
    try:
        for key in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        yield
    finally:
        for key, excluded, included in saved:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)
            torch._C._dispatch_tls_set_dispatch_key_included(key, included)


class AutocastInside:
    """For a TorchDispatchMode: `read_autocast` as the mode is entered (inside ``__torch_dispatch__``
    autocast reads off), then `run_op` each op, which turns autocast back on inside the ops of
    `CASTS_INSIDE`. Code that turns autocast off around such an op itself would see it on inside the op
    under the mode (autocast is read as the mode began)."""

    def read_autocast(self) -> None:
        self._autocast_keys = [key for device, key in AUTOCAST_KEYS if torch.is_autocast_enabled(device)]
        self._keys_for: dict = {}  # op -> the keys to turn back on inside it

    def autocast_inside(self, func) -> list:
        """The autocast keys to turn back on while ``func`` runs: those on as the mode began, for an op
        of `CASTS_INSIDE` without an autocast rule of its own. Only those: an op reached inside another
        autocast rule's region (cdist's fp32 rule over _cdist_forward) or the code's own
        autocast(enabled=False) must keep it off."""
        if func.name() not in CASTS_INSIDE:
            return []
        keys = self._keys_for.get(func)
        if keys is None:
            keys = self._keys_for[func] = [key for key in getattr(self, "_autocast_keys", ())
                                           if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)]
        return keys

    def run_op(self, func, args, kwargs, keys: list):
        """``func(*args, **kwargs)``, with ``keys`` (from `autocast_inside`) on inside it."""
        if not keys:
            return func(*args, **kwargs)
        with autocast_keys_on(keys):
            return func(*args, **kwargs)
