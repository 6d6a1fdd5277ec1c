"""Apply a mixed-precision recipe and put every global flag back afterwards.

A recipe touches process-wide torch state: autocast, TF32 for matmul and cuDNN, float32 matmul
precision (the CPU's too: strict IEEE for the ops it leaves in fp32) and ``cudnn.benchmark``. A
notebook kernel lives for hours, so a cell that raises or is interrupted must not leave any of it
changed. `precision()` saves what it touches and restores it in ``finally`` -- all of it when the
body raised; when it succeeded, a setting the body changed itself stays, as running that code once
would leave it. `TorchGlobals` captures the wider set a
cell can change (grad mode, default dtype, ...) so ``%%amp`` can start every run from it.

torch 2.9 added a new API for the precision of fp32 ops (``torch.backends.*.fp32_precision``, per
backend and op) beside the legacy one (``set_float32_matmul_precision``, ``allow_tf32``), whose
setters write the new values too, and made reading a legacy setting an error when the two disagree.
So a recipe writes both families (the legacy one first, then the per-op values), to settings they
agree on, and puts them back as torch keeps them, not as they read (`_fp32_state`): a "none" that
falls back to its backend's value stays one, and a legacy value torch refuses to show comes back as
it was.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .keywords import explains_keywords
from .device import (DTYPE_NAMES, DeviceError, DeviceInfo, autocast_dtype, device_info, dtype_name, resolve_device,
                     unknown_dtype)
from .options import option
from .signals import finish, sigint_held

NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@dataclass(frozen=True)
class Recipe:
    """What a mixed-precision run changes. ``None`` means: leave that setting alone."""

    device_type: str
    autocast_dtype: torch.dtype | None
    # CUDA's fp32 matmuls and cuDNN convolutions/RNNs. True: TF32; False: strict IEEE fp32; None: as
    # the user has them.
    tf32: bool | None = None
    cudnn_benchmark: bool | None = None
    # Device types whose autocast is forced off inside the recipe: an autocast the user left on
    # around it must not turn the fp32 baseline (or the other device's ops) into reduced precision.
    autocast_off: tuple[str, ...] = ()
    # The CPU's (oneDNN's) fp32 matmuls, convolutions and RNNs in strict IEEE fp32 (True), or as the
    # user has them (False). torch.set_float32_matmul_precision("medium") makes oneDNN run fp32
    # matmuls in bf16 on a CPU with AMX: a user trial's "fp32" baseline was bf16 math, labelled fp32.
    # There is no TF32 on a CPU to trade for speed, so every recipe keeps the ops it leaves in fp32 exact.
    cpu_strict: bool = True
    # fp16 autocast on a CPU without fp16 units (``%%amp --emulated``): its numbers are fp16's, its times
    # the emulation's, and the label says so wherever the recipe is named
    emulated: bool = False

    @property
    def label(self) -> str:
        parts = []
        if self.autocast_dtype is not None:
            where = f"{self.device_type}, emulated" if self.emulated else self.device_type
            parts.append(f"autocast {DTYPE_NAMES[self.autocast_dtype]} ({where})")
        if self.tf32:
            parts.append("TF32 matmul+cuDNN")
        elif self.tf32 is False:
            parts.append("strict fp32 (TF32 off)" if self.device_type == "cuda" else "strict fp32")
        if self.cudnn_benchmark:
            parts.append("cudnn.benchmark")
        return " + ".join(parts) or "fp32"


FP32 = "fp32"
TF32 = "tf32"


def make_recipe(dtype: str = "auto", device="auto", tf32: bool = True, cudnn_benchmark: bool | None = None,
                name: str = "dtype", emulated: bool = False) -> Recipe:
    """Build the recipe ``%%amp`` uses: autocast at ``dtype`` plus Tensor Core settings on CUDA.

    ``dtype="fp32"`` gives the baseline: no autocast, TF32 off on CUDA and the CPU's oneDNN at IEEE
    fp32, so the comparison is against strict IEEE fp32 whatever the user's flags say (on CUDA too
    when the CPU is compared: a CPU cell can reach CUDA tensors). TF32 only exists on CUDA
    (Ampere+), so an autocast recipe elsewhere leaves CUDA's TF32 alone (None).
    ``name`` is the option an error names (``dtype``, or ``amp`` for the profiler); ``emulated``: see
    `device.autocast_dtype`.
    """
    dev = resolve_device(device)
    info = device_info(dev)
    dtype = dtype_name(dtype)
    tf32_setting = bool(tf32) if info.supports_tf32 else None
    if dtype == TF32:  # TF32 alone, no autocast: the "free" Tensor Core speedup for fp32 code
        if not info.supports_tf32:
            raise DeviceError(f"TF32 needs a CUDA GPU of compute capability 8.0+; {info.label} has none. "
                              f"Use {option(name, 'bf16')} here")
        return Recipe(dev.type, None, tf32=True, autocast_off=autocast_device_types(dev.type))
    if dtype == FP32:
        return Recipe(dev.type, None, tf32=False, autocast_off=autocast_device_types(dev.type))
    reduced = autocast_dtype(dtype, info, name, emulated=emulated)
    return Recipe(
        device_type=dev.type,
        autocast_dtype=reduced,
        emulated=reduced is torch.float16 and dev.type == "cpu" and not info.has_fp16_units,
        tf32=tf32_setting,
        cudnn_benchmark=cudnn_benchmark,
        autocast_off=tuple(t for t in autocast_device_types(dev.type) if t != dev.type),
    )


def autocast_device_types(device_type: str) -> tuple[str, ...]:
    """The device types whose autocast can change code that runs on ``device_type``: the CPU always
    (a CUDA cell still runs host-side ops), CUDA wherever torch can use it (a CPU cell can still
    touch CUDA tensors), and the device itself."""
    types = ["cpu"]
    if torch.cuda.is_available():
        types.append("cuda")
    if device_type not in types:
        types.append(device_type)
    return tuple(types)


def autocast_in_effect(device_type: str) -> dict[str, str]:
    """Autocast already on for code that runs on ``device_type``: {device type: dtype name}."""
    return {t: DTYPE_NAMES.get(torch.get_autocast_dtype(t), str(torch.get_autocast_dtype(t)))
            for t in autocast_device_types(device_type) if torch.is_autocast_enabled(t)}


# --- torch's settings as (read, write) pairs ---------------------------------------------------

_UNREADABLE = object()  # a reading torch refused (the two TF32 API families mixed)


def _reading(read):
    try:
        return read()
    except RuntimeError:
        return _UNREADABLE


def _readings(knobs: dict) -> dict:
    return {name: _reading(read) for name, (read, _) in knobs.items()}


def _attribute_knob(owner, name: str):
    return (lambda: getattr(owner, name)), (lambda v: setattr(owner, name, v))


def _autocast_knob(device_type: str):
    """One device type's autocast as (enabled, dtype)."""
    def write(state):
        enabled, dtype = state
        torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_enabled(device_type, enabled)

    return (lambda: (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))), write


def _deterministic_algorithms():
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _write_changed(knobs: dict, values: dict) -> None:
    """Write each of ``values`` whose setting reads otherwise now, in the knobs' order."""
    for name, (read, write) in knobs.items():
        if name in values and _reading(read) != values[name]:
            write(values[name])


# --- the float32 precision settings, as torch keeps them ---------------------------------------
#
# torch keeps (on torch >= 2.9): one fp32_precision per (backend, op) -- the generic one ("" here),
# CUDA's and oneDNN's backend-wide ones ("cudnn", "mkldnn") and six per-op ones -- where an op's
# "none" falls back to its backend's value and that to the generic one; and two legacy values behind
# set_float32_matmul_precision and cudnn.allow_tf32. A reading gives what an op comes to after the
# fallbacks, and a legacy reading raises where the per-op values disagree with the legacy value.
# Writing back readings loses both what is hidden (a "none" that follows its backend turns into a
# fixed value; a legacy value torch refuses to show comes back as a guess), so a state here is what
# torch keeps: every fp32_precision as set (its "raw" value) and the two legacy values, found out
# where the readings alone do not say (`_fp32_state`), and written back exactly (`_write_fp32_state`).

_FMP = "float32_matmul_precision"
_CUDNN_TF32 = "cudnn.allow_tf32"

# torch >= 2.9's fp32_precision settings under torch.backends ("" is the generic one), each after the
# one its "none" falls back to.
_FP32_PRECISION_PATHS = ("", "cudnn", "cuda.matmul", "cudnn.conv", "cudnn.rnn",
                         "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
# The per-op values a recipe sets: CUDA's by the recipe's ``tf32``, the CPU's (oneDNN) by its ``cpu_strict``.
_CUDA_OP_PATHS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn")
_CPU_OP_PATHS = ("mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
# fallback -> the settings whose "none" falls back to it (CUDA's and oneDNN's ops to their backend's
# value, those two to the generic one), in the order they are found out.
_FALLING_BACK = {"": ("cudnn", "mkldnn"), "cudnn": _CUDA_OP_PATHS, "mkldnn": _CPU_OP_PATHS}


def _key(path: str) -> str:
    return f"{path}.fp32_precision" if path else "fp32_precision"


_KEYS = {path: _key(path) for path in _FP32_PRECISION_PATHS}

# What each legacy setter writes beside its own value (torch 2.9-2.13, aten/src/ATen/Context.cpp):
# set_float32_matmul_precision(p) sets cuda.matmul and mkldnn.matmul as here; cuda.matmul.allow_tf32 = b
# sets the matmul precision ("high" if b else "highest") and cuda.matmul alone; cudnn.allow_tf32 = b sets
# cudnn.conv and cudnn.rnn to "tf32" if b else "none".
_MATMUL_PRECISION_WRITES = {"highest": ("ieee", "ieee"), "high": ("tf32", "tf32"), "medium": ("tf32", "bf16")}


@functools.lru_cache(maxsize=None)
def _fp32_precision_owner(path: str):
    """The object holding ``path``'s fp32_precision (``torch.backends.mkldnn.matmul``): found once, as
    a recipe reads each of them at least twice per run (walking the path each time cost ~70 us a run)."""
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def _fp32_precision_knob(path: str):
    owner = _fp32_precision_owner(path)
    return (lambda: owner.fp32_precision), (lambda v: setattr(owner, "fp32_precision", v))


def _write_raw(path: str, value: str) -> None:
    if path == "mkldnn":  # the attribute's setter writes the generic value (torch 2.9-2.13); this one is oneDNN's
        torch.backends.mkldnn.set_flags(_fp32_precision=value)
    else:
        setattr(_fp32_precision_owner(path), "fp32_precision", value)


def _fp32_state() -> dict:
    """The float32 precision settings as torch keeps them: {_FMP: "highest"|"high"|"medium",
    _CUDNN_TF32: bool} and, on torch >= 2.9, every fp32_precision as set, keyed like `global_state`.

    Costs a reading of each where they say it all (the usual case); where they do not, torch's state
    is changed for a moment and put back: a value that reads the same as the one its "none" would
    fall back to is checked against a different fallback, and a legacy value torch refuses to read
    is found with the per-op values it is checked against set for a moment (both matmuls "ieee",
    which any matmul precision agrees with; cudnn.conv and .rnn "tf32", readable only beside True).
    """
    state = {_FMP: _reading(torch.get_float32_matmul_precision),
             _CUDNN_TF32: _reading(lambda: torch.backends.cudnn.allow_tf32)}
    if not NEW_TF32_API:
        return state
    shown = {path: _fp32_precision_owner(path).fp32_precision for path in _FP32_PRECISION_PATHS}
    state.update({_KEYS[path]: value for path, value in shown.items()})
    for fallback, paths in _FALLING_BACK.items():  # each after its fallback: a check writes that back
        alike = [path for path in paths if shown[path] != "none" and shown[path] == shown[fallback]]
        for path in _following(fallback, alike, shown[fallback], state) if alike else ():
            state[_KEYS[path]] = "none"
    if state[_FMP] is _UNREADABLE:
        state[_FMP] = _with_raw(state, {"cuda.matmul": "ieee", "mkldnn.matmul": "ieee"},
                               torch.get_float32_matmul_precision)
    if state[_CUDNN_TF32] is _UNREADABLE:
        state[_CUDNN_TF32] = _with_raw(state, {"cudnn.conv": "tf32", "cudnn.rnn": "tf32"},
                                      lambda: _reading(lambda: torch.backends.cudnn.allow_tf32) is True)
    return state


def _following(fallback: str, paths: list, shown: str, state: dict) -> list:
    """Those of ``paths`` that are "none", following ``fallback`` (all read ``shown``, as it does):
    the fallback (its value as set is in ``state``) is set to another value for a moment."""
    other = "tf32" if shown == "ieee" else "ieee"
    return _with_raw(state, {fallback: other},
                     lambda: [path for path in paths if _fp32_precision_owner(path).fp32_precision == other])


def _with_raw(state: dict, values: dict, read):
    """``read()`` with the fp32_precision ``values`` (path -> value) set, then their values in ``state`` back."""
    try:
        for path, value in values.items():
            _write_raw(path, value)
        return read()
    finally:
        try:  # a Ctrl-C here would leave a setting at the value it was read against, not the user's
            with sigint_held():
                for path in values:
                    _write_raw(path, state[_KEYS[path]])
        except KeyboardInterrupt:
            for path in values:
                _write_raw(path, state[_KEYS[path]])
            raise


def _write_fp32_state(target: dict, current: dict) -> None:
    """Make torch's float32 precision settings ``target`` (from `_fp32_state`), writing only what
    differs from ``current``: the legacy values first, as their setters rewrite per-op values, then
    each fp32_precision, fallbacks before the ops that fall back to them."""
    current = dict(current)
    if target[_FMP] != current[_FMP]:
        torch.set_float32_matmul_precision(target[_FMP])
        if NEW_TF32_API:
            current[_KEYS["cuda.matmul"]], current[_KEYS["mkldnn.matmul"]] = _MATMUL_PRECISION_WRITES[target[_FMP]]
    if target[_CUDNN_TF32] != current[_CUDNN_TF32]:
        torch.backends.cudnn.allow_tf32 = target[_CUDNN_TF32]
        if NEW_TF32_API:
            current[_KEYS["cudnn.conv"]] = current[_KEYS["cudnn.rnn"]] = "tf32" if target[_CUDNN_TF32] else "none"
    if NEW_TF32_API:
        for path, key in _KEYS.items():
            if target[key] != current[key]:
                _write_raw(path, target[key])


def _resolved_fp32_precision(path: str) -> str:
    """What an op's fp32 precision comes to: its own value, else its backend's, else the generic one."""
    backend, _ = path.split(".")
    for owner in (path, "cudnn" if backend in ("cuda", "cudnn") else backend, ""):
        value = _reading(_fp32_precision_knob(owner)[0])
        if value not in ("none", _UNREADABLE):
            return value
    return "ieee"


def relaxed_fp32_settings(device_type: str) -> list[str]:
    """The user's settings, as code, that run fp32 matmuls, convolutions or RNNs on ``device_type``
    below IEEE fp32 where torch's defaults would not: what the fp32 recipe overrides, for the report
    (``['torch.set_float32_matmul_precision("medium")']``). TF32 on the CPU is not one: oneDNN uses
    it on Intel GPUs only; nor cuDNN's TF32, on by torch's default."""
    found = []
    legacy = _reading(torch.get_float32_matmul_precision)
    if legacy == "medium" or (legacy == "high" and device_type == "cuda"):
        found.append(f'torch.set_float32_matmul_precision("{legacy}")')
    if NEW_TF32_API:
        if device_type == "cuda":
            relaxed = {"cuda.matmul": "tf32"} if legacy not in ("high", "medium") else {}
        else:
            relaxed = {path: "bf16" for path in _CPU_OP_PATHS if not (path == "mkldnn.matmul" and legacy == "medium")}
        for path, low in relaxed.items():
            if _resolved_fp32_precision(path) == low:
                found.append(f'torch.backends.{path}.fp32_precision = "{low}"')
    return found


def global_state() -> dict:
    """Every global torch setting a recipe, a profile or a budget could change, as plain values.

    Readings torch refuses (the mixed-API error) are recorded as the error text, so the state can
    still be compared before and after.
    """
    readers = {
        "autocast.cpu": _autocast_knob("cpu")[0],
        "autocast.cuda": _autocast_knob("cuda")[0],
        "autocast.cache": torch.is_autocast_cache_enabled,
        "cudnn.benchmark": lambda: torch.backends.cudnn.benchmark,
        "cudnn.deterministic": lambda: torch.backends.cudnn.deterministic,
        "cudnn.enabled": lambda: torch.backends.cudnn.enabled,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "grad_enabled": torch.is_grad_enabled,
        "default_dtype": torch.get_default_dtype,
        "deterministic_algorithms": _deterministic_algorithms,
        "profiler_enabled": torch._C._autograd._profiler_enabled,
    }
    # The rest `TorchGlobals` puts back (threads, anomaly mode, default device, ...), where this torch has them.
    readers.update({name: read for name, (read, _) in _global_knobs().items() if name not in readers})
    if NEW_TF32_API:
        for path in _FP32_PRECISION_PATHS:
            readers[f"{path}.fp32_precision" if path else "fp32_precision"] = _fp32_precision_knob(path)[0]
    state = {}
    for key, read in readers.items():
        try:
            state[key] = read()
        except RuntimeError as exc:
            state[key] = f"<unreadable: {str(exc)[:60]}>"
    return state


# --- what a cell can change, put back between runs ---------------------------------------------

class TorchGlobals:
    """torch's process-wide settings that code can change, captured when made, put back on demand:
    grad mode, autograd's anomaly mode, default dtype and device, deterministic algorithms, the cuDNN
    and oneDNN flags, cuBLAS's reduced-precision reductions, the number of intra-op threads, TF32 and
    float32 matmul precision (both API families) and autocast per device type.

    ``%%amp`` runs a cell many times: `Snapshot` puts the variables back before each run, this puts
    torch's settings back, so a cell that calls ``torch.set_grad_enabled(False)`` cannot change the
    runs after it, and an abandoned comparison leaves torch as it found it.
    """

    def __init__(self):
        self._knobs = _global_knobs()
        self._values = _readings(self._knobs)
        self._fp32 = _fp32_state()

    def restore(self) -> None:
        _write_changed(self._knobs, self._values)
        _write_fp32_state(self._fp32, _fp32_state())
        # Autocast casts weights once per region and keeps the copies until the outermost region
        # exits; a run that entered autocast and never left would hand stale casts of the weights
        # the snapshot just put back to the next run.
        torch.clear_autocast_cache()


def _global_knobs() -> dict:
    """name -> (read, write) of every setting `TorchGlobals` restores but the float32 precision ones
    (`_fp32_state`), in the order it writes them; those this torch lacks are left out. No write here
    changes another's setting, so the order only groups them: autograd, tensor defaults, backend
    flags, threads, autocast."""
    knobs = {
        "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
        "anomaly_mode": _anomaly_knob(),
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "default_device": _default_device_knob(),
        "deterministic_algorithms": (_deterministic_algorithms,
                                     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        **{f"cudnn.{flag}": _attribute_knob(torch.backends.cudnn, flag)
           for flag in ("benchmark", "deterministic", "enabled")},
        **{f"mkldnn.{flag}": _optional_attribute_knob(torch.backends.mkldnn, flag)
           for flag in ("enabled", "deterministic")},
        **{f"cuda.matmul.allow_{dtype}_reduced_precision_reduction": _reduced_precision_reduction_knob(dtype)
           for dtype in ("fp16", "bf16")},
        "cuda.matmul.allow_fp16_accumulation": _optional_attribute_knob(torch.backends.cuda.matmul,
                                                                        "allow_fp16_accumulation"),
        # Written like the rest only where it changed: torch.set_num_threads rebuilds the intra-op
        # pools (OpenMP, MKL), which would cost every run otherwise.
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
    }
    knobs.update({f"autocast.{t}": _autocast_knob(t) for t in ("cpu", "cuda")})  # cuda's is settable anywhere
    knobs["autocast.cache"] = (torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled)
    return {name: knob for name, knob in knobs.items() if knob is not None}


def _optional_attribute_knob(owner, name: str):
    """`_attribute_knob`, or None where this torch lacks the setting (torch.backends.cuda.matmul's
    unknown names raise AttributeError, a module's too)."""
    try:
        getattr(owner, name)
    except AttributeError:
        return None
    return _attribute_knob(owner, name)


def _anomaly_knob():
    """Autograd's anomaly mode as (enabled, check_nan): ``torch.autograd.set_detect_anomaly(True)``
    called as a function stays on, and makes every backward record and check its graph."""
    if not hasattr(torch, "is_anomaly_check_nan_enabled"):  # torch without check_nan: the mode alone
        return torch.is_anomaly_enabled, torch.autograd.set_detect_anomaly
    return ((lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())),
            lambda v: torch.autograd.set_detect_anomaly(v[0], check_nan=v[1]))


def _reduced_precision_reduction_knob(dtype: str):
    """cuBLAS's reduced-precision reductions in fp16/bf16 GEMMs, with their split-K companion where
    torch has one: setting the flag to a bool also sets split-K to True, so both are read and written
    together (a tuple, which the setter takes) or a user's (False, False) would come back (False, True)."""
    matmul, name = torch.backends.cuda.matmul, f"allow_{dtype}_reduced_precision_reduction"
    knob = _optional_attribute_knob(matmul, name)
    if knob is None or _optional_attribute_knob(matmul, f"{name}_split_k") is None:
        return knob
    return (lambda: (getattr(matmul, name), getattr(matmul, f"{name}_split_k"))), (lambda v: setattr(matmul, name, v))


def _default_device_knob():
    """``torch.set_default_device``'s device as set, None where none is (torch's default, the CPU).

    Read from where torch keeps it (a thread-local in recent torch, the module global itself before)
    rather than from ``torch.get_default_device()``, which reads "cpu" for none: writing that back
    would install a DeviceContext, a TorchFunctionMode every torch call then goes through."""
    if not hasattr(torch, "set_default_device"):
        return None
    if hasattr(torch, "_GLOBAL_DEVICE_CONTEXT"):
        def read():
            held = torch._GLOBAL_DEVICE_CONTEXT  # read each time: older torch rebinds it
            return getattr(getattr(held, "device_context", held), "device", None)

        return read, torch.set_default_device
    if hasattr(torch, "get_default_device"):  # torch moved it: the reading, with "cpu" as none set
        cpu = torch.device("cpu")
        return torch.get_default_device, lambda v: torch.set_default_device(None if v == cpu else v)
    return None


# --- the recipe as a context --------------------------------------------------------------------

# What `precision` takes: the autocast dtypes, TF32 alone, and strict fp32.
PRECISION_DTYPES = ("bf16", "fp16", "auto", "tf32", "fp32")


@explains_keywords({"amp": "dtype", "precision": "dtype"})
class precision:  # noqa: N801 - a context manager used like a function: `with nbaccel.precision("bf16"):`
    """Run the body under a mixed-precision recipe; every flag it set is restored on exit (except
    one the body changed itself, see `apply_recipe`).

    >>> with nbaccel.precision("bf16"):
    ...     loss = model(x).sum()

    ``with`` gives the `Recipe` that was applied, so scripts can log what ran. The arguments are
    checked when it is made, and one object can be entered again (``amp = precision("bf16")``,
    then ``with amp:`` in a loop), like `nbaccel.profile` and `nbaccel.memory_budget`. ``emulated=True``
    runs fp16 on a CPU without fp16 units, as `compare_amp` does (its numbers are fp16's, at emulation's speed).
    """

    def __init__(self, dtype: str = "auto", device="auto", tf32: bool = True, cudnn_benchmark: bool | None = None,
                 recipe: Recipe | None = None, emulated: bool = False):
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe takes a Recipe (from nbaccel.precision.make_recipe), got {recipe!r}; for a "
                            "dtype write precision('bf16')")
        for name, value in (("tf32", tf32), ("emulated", emulated)):
            if not isinstance(value, bool):
                raise TypeError(f"{option(name)} takes True or False, got {value!r}")
        if cudnn_benchmark is not None and not isinstance(cudnn_benchmark, bool):  # torch's own error came on entry
            raise TypeError(f"{option('cudnn_benchmark')} takes True, False or None (left as it is), got "
                            f"{cudnn_benchmark!r}")
        if recipe is None and dtype_name(dtype) not in PRECISION_DTYPES:
            # precision() also takes fp32 (strict IEEE fp32, %%amp's baseline): its refusal lists it
            raise DeviceError(unknown_dtype(dtype_name(dtype), "dtype", PRECISION_DTYPES))
        self.recipe = recipe or make_recipe(dtype, device, tf32, cudnn_benchmark, emulated=emulated)
        self._active: list = []

    def __enter__(self) -> Recipe:
        context = apply_recipe(self.recipe)
        context.__enter__()
        self._active.append(context)
        return self.recipe

    def __exit__(self, exc_type, exc, tb) -> bool:
        return bool(self._active.pop().__exit__(exc_type, exc, tb))


class apply_recipe:  # noqa: N801 - a context manager used like a function: `with apply_recipe(recipe):`
    """Enter a `Recipe`: flags first, autocast innermost; unwind in reverse, whatever happens.

    On exit each setting the recipe manages (every float32 precision setting, ``cudnn.benchmark``,
    the autocast it sets) goes back to its value from before -- except, when the body succeeded, one
    that no longer holds the value the recipe set: the body changed it
    (``torch.backends.cudnn.benchmark = True`` in the cell), and code run once under the recipe
    keeps what it did (see `_kept_fp32_state` for the legacy setters). When the body raises, every
    setting goes back, and a torch dispatch mode the body entered and left on torch's stack is
    exited (`_exit_modes_left`).

    A class, not a generator, so that its teardown can run again: a Ctrl-C that landed as autocast's
    own ``__exit__`` started left autocast on (and its nesting level up, so its weight-cast cache was
    never cleared again) for the rest of the session. The setting up and the undoing run with SIGINT
    held; each step of the undoing is done once, and ``__exit__`` run again after an interrupt still
    got in (at its first line: `nbaccel.profile` does that) does what is left (`signals.finish`).
    """

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def __enter__(self) -> Recipe:
        recipe = self.recipe
        self._before = _fp32_state()
        self._as_set = _recipe_fp32_state(recipe, self._before)
        benchmark = _attribute_knob(torch.backends.cudnn, "benchmark")
        self._watched = {"cudnn.benchmark": benchmark,
                         **{f"autocast.{t}": _autocast_knob(t) for t in _autocast_types(recipe)}}
        self._benchmark_before = benchmark[0]()
        self._modes_before = torch._C._len_torch_dispatch_stack()
        # The undoing's steps, each cleared once done (see `_undo`).
        self._autocasts: list = []  # autocast contexts entered, innermost last
        self._hook = None  # the optimizer step hook
        self._body_changed: tuple | None = None  # (settings the body changed, fp32 state after it) once read
        self._undone = False
        try:
            with sigint_held():
                _write_fp32_state(self._as_set, self._before)
                if recipe.cudnn_benchmark is not None:
                    benchmark[1](recipe.cudnn_benchmark)
                for context in _autocast_contexts(recipe):  # torch.autocast's own exit restores autocast
                    context.__enter__()
                    self._autocasts.append(context)
                if recipe.autocast_dtype is not None:
                    self._hook = _fresh_casts_after_optimizer_steps()
                self._watched_as_set = _readings(self._watched)
        except BaseException:  # the recipe could not be set (or a Ctrl-C came): everything as before
            finish(self._undo, True)
            raise
        return recipe

    def __exit__(self, exc_type, exc, tb) -> bool:
        failed = exc_type is not None
        try:  # `signals.finish`, inlined: an interrupt at finish's own first line would skip everything
            with sigint_held():
                self._undo(failed)
        except KeyboardInterrupt:
            with sigint_held():
                self._undo(failed)  # what the interrupt left
            raise
        return False

    def _undo(self, failed: bool) -> None:
        """Put back what the recipe set; called again after an interrupt, it does only what is left."""
        if self._undone:
            return
        first_try = self._body_changed is None
        if first_try:  # read before anything is undone: what the body set itself
            if failed:
                self._body_changed = ({}, None)
            else:
                changed = {name: value for name, value in _readings(self._watched).items()
                           if value != self._watched_as_set[name]}
                self._body_changed = (changed, _fp32_state())
        changed, after = self._body_changed
        while self._autocasts:  # innermost first; removed only once it has exited
            self._autocasts[-1].__exit__(None, None, None)
            self._autocasts.pop()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if failed:
            self._exit_modes_left()
        target = self._before if after is None else _kept_fp32_state(self._before, self._as_set, after)
        # Writes only what differs from the state now: read again on a second try (the first may have written
        # some); on the first, `after` is that state (autocast's exits change none of it).
        _write_fp32_state(target, after if first_try and after is not None else _fp32_state())
        benchmark = self._watched["cudnn.benchmark"]
        if benchmark[0]() != (kept := changed.get("cudnn.benchmark", self._benchmark_before)):
            benchmark[1](kept)
        for name, value in changed.items():  # autocast the body turned on or off itself
            if name != "cudnn.benchmark":
                self._watched[name][1](value)
        self._undone = True

    def _exit_modes_left(self) -> None:
        """Exit the torch dispatch modes (``TorchDispatchMode``) the failed body left on torch's stack.

        A Ctrl-C that lands as a mode's ``with`` ends, at the first line of its ``__exit__``, leaves the
        mode on the stack, and every later op of the session runs through it: %%amp's `flops.OpAudit`
        (the innermost context of its audited run, which the recipe encloses) did that. A body that
        raised has no use for a mode it entered."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

        while (depth := torch._C._len_torch_dispatch_stack()) > self._modes_before:
            mode = _get_current_dispatch_mode()
            with contextlib.suppress(Exception):  # its own __exit__ first: a mode may keep state of its own
                mode.__exit__(None, None, None)
            if torch._C._len_torch_dispatch_stack() >= depth:
                _pop_mode()
                # popped past its own __exit__: dynamo's stance it set goes back too (nbaccel.eager_modes)
                with contextlib.suppress(Exception):
                    getattr(mode, "leave_eager_stance", lambda: None)()


def _fresh_casts_after_optimizer_steps():
    """Clear autocast's weight-cast cache after every ``optimizer.step()`` in the body; returns the
    hook's handle (``.remove()``).

    Inside one autocast region torch caches the reduced-precision copy of each weight (a leaf that
    requires grad) and never checks whether the weight changed since. A cell that is a training loop
    -- several ``opt.step()`` under the one autocast the recipe wraps around the whole cell -- would
    then run every forward after the first with the first step's weights: the loss stops moving and
    the drift blames bf16. torch's own advice is to wrap only the forward pass; the cache is cleared
    when that region exits. A global step hook gives the whole-cell region the same freshness (it
    covers GradScaler.step too, which calls ``optimizer.step``). A hand-written in-place update
    (``p -= lr * p.grad``) is not an optimizer step and is not seen: docs/amp.md says so.
    """
    return register_optimizer_step_post_hook(lambda optimizer, args, kwargs: torch.clear_autocast_cache())


def _recipe_fp32_state(recipe: Recipe, before: dict) -> dict:
    """The float32 precision settings under ``recipe`` (a `_fp32_state`), from the user's ``before``.

    Both API families are written, so that code in the cell reads the recipe's settings through
    either and torch never finds them mixed (it raises on reading the legacy ones then): the legacy
    matmul precision is "high" where CUDA's matmuls run TF32, "highest" where they are strict. The
    per-op values say the rest (the CPU's "ieee" beside "high"); each is set at the op itself, so no
    backend-wide or generic value the user set ("none" falls back to those) can reach it. What the
    recipe leaves alone keeps its value, also a per-op value a legacy setter it calls rewrites.
    """
    state = dict(before)
    if recipe.tf32 is not None:
        state[_FMP] = "high" if recipe.tf32 else "highest"
        state[_CUDNN_TF32] = recipe.tf32
    elif recipe.cpu_strict and before[_FMP] == "medium":
        # "medium" is TF32 for CUDA's matmuls, which this recipe leaves alone, and bf16 for the
        # CPU's, which it does not: "high" is the same on CUDA and leaves the CPU's in fp32.
        state[_FMP] = "high"
    if NEW_TF32_API:
        if recipe.tf32 is not None:
            state.update({_KEYS[path]: "tf32" if recipe.tf32 else "ieee" for path in _CUDA_OP_PATHS})
        if recipe.cpu_strict:
            state.update({_KEYS[path]: "ieee" for path in _CPU_OP_PATHS})
    return state


def _kept_fp32_state(before: dict, as_set: dict, after: dict) -> dict:
    """The float32 precision settings after a body that succeeded: each one the body changed (it no
    longer holds the recipe's value) as the body left it, the others as ``before``.

    A legacy setter writes several settings at once, some maybe to the values the recipe had set:
    ``torch.set_float32_matmul_precision("high")`` under the TF32 recipe changes only mkldnn.matmul's
    value, and with the others put back torch would refuse every legacy reading from then on. So
    where the body changed settings a legacy setter writes and left all of them as a call of that
    setter leaves them, they all stay as the body left it: as one plain run of that call would.
    """
    changed = {key for key, value in after.items() if value != as_set[key]}
    if NEW_TF32_API and changed:
        changed |= _left_by_a_legacy_setter(after, changed)
    return {key: after[key] if key in changed else value for key, value in before.items()}


def _left_by_a_legacy_setter(after: dict, changed: set) -> set:
    """The settings of ``after`` (a `_fp32_state`) that a legacy setter's call may have written,
    where some of them are ``changed`` and all are as that call leaves them."""
    cuda, cpu, conv, rnn = (_KEYS[path] for path in ("cuda.matmul", "mkldnn.matmul", "cudnn.conv", "cudnn.rnn"))
    found = set()
    if changed & {_FMP, cuda, cpu} and (after[cuda], after[cpu]) == _MATMUL_PRECISION_WRITES[after[_FMP]]:
        found |= {_FMP, cuda, cpu}  # torch.set_float32_matmul_precision(...)
    elif changed & {_FMP, cuda} and after[_FMP] != "medium" and after[cuda] == _MATMUL_PRECISION_WRITES[after[_FMP]][0]:
        found |= {_FMP, cuda}  # torch.backends.cuda.matmul.allow_tf32 = ...
    if changed & {_CUDNN_TF32, conv, rnn} and after[conv] == after[rnn] == ("tf32" if after[_CUDNN_TF32] else "none"):
        found |= {_CUDNN_TF32, conv, rnn}  # torch.backends.cudnn.allow_tf32 = ...
    return found


def _autocast_types(recipe: Recipe) -> list[str]:
    return list(recipe.autocast_off) + ([recipe.device_type] if recipe.autocast_dtype is not None else [])


def _autocast_contexts(recipe: Recipe) -> list:
    contexts = [torch.autocast(t, enabled=False) for t in recipe.autocast_off]
    if recipe.autocast_dtype is not None:
        contexts.append(torch.autocast(recipe.device_type, dtype=recipe.autocast_dtype))
    return contexts


def describe(info: DeviceInfo, dtype: str | None = None) -> str:
    """One line on what autocast can do on this device, for headers and advice. ``dtype`` ("bf16", "fp16"): name
    that dtype's CPU units only (a trial's bf16 advice listed avx512_fp16)."""
    if info.type == "cpu":
        kinds = [dtype] if dtype in ("bf16", "fp16") else ["bf16", "fp16"]
        units = [f"{unit}_{kind}" for kind in kinds for unit in ("amx", "avx512") if info.cpu_features.get(f"{unit}_{kind}")]
        which = f"{dtype} units" if len(kinds) == 1 else "reduced-precision units"
        return f"CPU autocast (no GPU here); {which}: " + (", ".join(units) if units else f"none, {kinds[0]} is emulated")
    return f"CUDA autocast on {info.name}; Tensor Cores: {'yes' if info.tensor_cores else 'no'}"
