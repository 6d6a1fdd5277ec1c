"""nbaccel: PyTorch mixed precision, profiling and memory, one magic away in Jupyter.

The magics (``%load_ext nbaccel``: ``%%amp``, ``%%profile_gpu``, ``%profile_trace``,
``%memory_budget``, ``%nbaccel_env``) are thin layers over this plain Python API, which also works
in scripts and under torchrun::

    res = nbaccel.compare_amp(lambda: train_step(model, batch), dtype="bf16")   # AmpResult
    with nbaccel.precision("bf16"):                     # the recipe alone, no comparison
        ...
    with nbaccel.profile(steps=3) as prof:              # torch.profiler; prof.result: ProfileResult
        for _ in range(3):
            train_step(model, batch); prof.step()
    nbaccel.compare_profiles(before, after)             # two ProfileResults op by op (%%profile_gpu --compare)
    nbaccel.load_trace("run.pt.trace.json.gz")          # a trace recorded elsewhere
    with nbaccel.memory_budget("6GiB"): ...             # peak memory against a budget
    nbaccel.estimate_memory(model, batch=32)            # MemoryEstimate, before running it
    nbaccel.env_report()                                # versions, device, precision flags

Also ``results_frame`` (saved results into one DataFrame) and ``side_by_side``. Under torchrun,
``nbaccel.distributed`` has the same calls, gathered on rank 0. In a shell:
``python -m nbaccel env`` and ``python -m nbaccel trace PATH``.

Errors and warnings a script may catch, all top-level names here: `ProfileError`, `DeviceError`,
`BudgetError`, `BudgetExceeded`, `EstimateError`, `SnapshotTooLarge`, `LazyModuleNotReady`, `TraceError`, `RankNotFound`,
`RankFailure`, `RankMismatch`, `NoProcessGroup`; `TraceWarning`, `SharedTraceWarning`, `TraceSaveWarning`, `BudgetWarning`.
(``nbaccel.profile`` is the profiler, not its module: its warnings are ``nbaccel.SharedTraceWarning``.)
See docs/api.md.
"""

__version__ = "0.1.0"

from .amp import AmpResult, compare_amp  # noqa: E402
from .budget import MemoryBudget, memory_budget  # noqa: E402
from .estimate import MemoryEstimate, estimate_memory  # noqa: E402
from .environment import env_report  # noqa: E402
from .precision import precision  # noqa: E402
from .profile import ProfileResult, profile  # noqa: E402
from .profile_compare import ProfileComparison, compare_profiles  # noqa: E402
from .render.side_by_side import side_by_side  # noqa: E402
from .results import results_frame  # noqa: E402
from .trace_result import MultiRankResult, RankNotFound, TraceError, TraceWarning, load_trace  # noqa: E402
# What a script catches, importable from here: the modules that define them are shadowed or internal
# (``nbaccel.profile`` is the profiler class, so nbaccel.profile.SharedTraceWarning was an AttributeError).
from .budget import BudgetError, BudgetExceeded, BudgetWarning  # noqa: E402
from .device import DeviceError  # noqa: E402
from .estimate import EstimateError  # noqa: E402
from .profile import SharedTraceWarning, TraceSaveWarning  # noqa: E402
from .profile_options import ProfileError  # noqa: E402
from .snapshot import LazyModuleNotReady, SnapshotTooLarge  # noqa: E402

__all__ = ["compare_amp", "AmpResult", "memory_budget", "MemoryBudget", "estimate_memory", "MemoryEstimate", "precision", "profile", "ProfileResult", "compare_profiles", "ProfileComparison", "env_report", "results_frame", "side_by_side", "load_trace", "MultiRankResult",
           "TraceError", "RankNotFound", "TraceWarning", "load_ipython_extension",
           "unload_ipython_extension",
           # errors and warnings
           "ProfileError", "DeviceError", "BudgetError", "BudgetExceeded", "EstimateError", "SnapshotTooLarge",
           "LazyModuleNotReady", "RankFailure", "RankMismatch", "NoProcessGroup", "SharedTraceWarning", "TraceSaveWarning", "BudgetWarning"]



def __getattr__(name: str):
    # nbaccel.distributed's errors without importing it with every `import nbaccel`: it is for torchrun.
    if name in ("RankFailure", "RankMismatch", "NoProcessGroup"):
        from . import distributed
        return getattr(distributed, name)
    raise AttributeError(f"module 'nbaccel' has no attribute {name!r}")


_registered: dict = {}
_transformers: list = []  # input transformers the load added to the shell, removed by the unload

# ``%reload_ext nbaccel`` is unload, ``importlib.reload(nbaccel)``, load. The reload runs this file
# again in the same module namespace, so what `unload_ipython_extension` left there is still
# present: taking it here (and only here) is how a reload hands the magics' state (an active
# ``%memory_budget``) to the new load. A plain ``%unload_ext`` leaves it pending; the next
# ``%load_ext`` without a reload discards it.
_handed_over: dict = globals().pop("_unloaded_state", None) or {}


def load_ipython_extension(ipython):
    """``%load_ext nbaccel``: register the magics (imported here, so ``import nbaccel`` stays light).

    After ``%reload_ext`` each magic's ``on_load`` gets the state its ``on_unload`` returned
    (an active memory budget is re-armed with the same settings); otherwise None.
    """
    global _handed_over
    from .magics import MAGIC_CLASSES

    _import_for_display()

    handed_over, _handed_over = _handed_over, {}
    globals().pop("_unloaded_state", None)
    for cls in MAGIC_CLASSES:
        instance = cls(ipython)
        ipython.register_magics(instance)
        _registered[cls] = instance
    for cls, instance in _registered.items():
        hook = getattr(instance, "on_load", None)
        if hook:
            hook(handed_over.get(cls.__name__))
    from .magics.common import HelpWithoutBody

    help_alone = HelpWithoutBody(name for instance in _registered.values() for name in instance.magics["cell"])
    ipython.input_transformers_cleanup.append(help_alone)
    _transformers.append(help_alone)


def _import_for_display() -> None:
    """In a notebook every result is shown as a pandas-backed widget: import pandas and ipywidgets
    now, with the extension, so the first result does not pause ~0.4 s for them (measured: first
    widget of a 10,000-op profile 460-590 ms without, 60 ms with). Scripts that only
    ``import nbaccel`` never pay for this."""
    import importlib

    for name in ("pandas", "ipywidgets"):
        try:
            importlib.import_module(name)
        except ImportError:  # ipywidgets is optional: results fall back to HTML and text
            pass


def unload_ipython_extension(ipython):
    """``%unload_ext nbaccel``: remove every magic, hook and cap the extension installed."""
    manager = ipython.magics_manager
    state = {}
    for cls, instance in list(_registered.items()):
        hook = getattr(instance, "on_unload", None)
        if hook:
            kept = hook()
            if kept is not None:
                state[cls.__name__] = kept
        for kind, names in instance.magics.items():
            for name in names:
                manager.magics[kind].pop(name, None)
        manager.registry.pop(cls.__name__, None)
        _registered.pop(cls)
    for transformer in _transformers:
        if transformer in ipython.input_transformers_cleanup:
            ipython.input_transformers_cleanup.remove(transformer)
    _transformers.clear()
    globals()["_unloaded_state"] = state  # settings only: every hook, handler and cap is gone
