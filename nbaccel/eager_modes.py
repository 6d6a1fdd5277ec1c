"""nbaccel's dispatch modes run torch.compile'd code eagerly, without turning its compilation off for good.

Why: a ``TorchDispatchMode`` on the stack makes dynamo skip the frame it is asked to run, and the skip
is recorded on the *code object* for every later call ("non-infra torch dispatch mode present"; torch
2.13, ``convert_frame``: ``ConvertFrameReturn``'s default strategy skips "for all future intercepted
frames too"). %%amp's op audit and the estimator's byte counter are such modes: a trial's compiled
encoder ran eagerly for the rest of the session after one %%amp, and so did every other compiled
module of the same class (they share ``forward``'s code). Under ``torch.compiler.set_stance(
"force_eager")`` dynamo's frame callback is not installed at all, so no frame is offered to it and
nothing is marked: the audited call runs eagerly (as it did anyway) and the next call runs the
compiled graph again.
"""

from __future__ import annotations

import contextlib

import torch


def _force_eager():
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class EagerWhileActive:
    """Mixin for a ``TorchDispatchMode`` (first in the bases): compiled code runs eagerly while the mode
    is on, and compiled again after it."""

    def __enter__(self):
        stance = _force_eager()
        stance.__enter__()
        self.__dict__.setdefault("_eager_stances", []).append(stance)
        try:
            return super().__enter__()
        except BaseException:
            self._eager_stances.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        depth = torch._C._len_torch_dispatch_stack()
        try:
            return super().__exit__(*exc)
        finally:
            # Only once the mode is off the stack: a Ctrl-C at the first line of torch's __exit__ leaves it
            # on, and OpAudit exits it again (a second pop here emptied the list: IndexError for the Ctrl-C)
            if torch._C._len_torch_dispatch_stack() < depth:
                self.leave_eager_stance()

    def leave_eager_stance(self) -> None:
        """Put dynamo's stance back, once per enter: for a mode taken off the stack another way (`_pop_mode`)."""
        stances = self.__dict__.get("_eager_stances")
        if stances:
            stances.pop().__exit__(None, None, None)


__all__ = ["EagerWhileActive"]
