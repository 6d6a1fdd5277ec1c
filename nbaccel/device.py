"""Which device runs a cell, and what it can do.

Everything that depends on the hardware is decided here, once, so the capabilities
(`amp`, `profile`, `budget`) never test ``torch.cuda.is_available()`` themselves.
The same facts feed ``python -m nbaccel env`` and ``%nbaccel_env``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

import torch

from .options import option

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class DeviceError(ValueError):
    """A device or dtype the user asked for is not usable here; the message says what to do."""


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """Turn ``auto|cuda|cpu|cuda:N`` (any case: ``--device CPU`` like ``--dtype BF16``) into a
    torch.device, refusing what is not present."""
    if isinstance(spec, str):
        spec = spec.strip().lower()
    if spec is None or str(spec) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"unknown device {spec!r}; use auto, cpu or cuda[:N]") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{option('device', str(spec))} was asked for, but this torch ({torch.__version__}) sees no "
                f"CUDA GPU; use {option('device', 'cpu')} (or auto) here"
            )
        index = device_index(device)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"{spec} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise DeviceError(f"device type {device.type!r} is not supported yet; use cpu or cuda")
    return device


def device_index(device: torch.device) -> int | None:
    """A CUDA device's index, the current GPU for a bare ``cuda``; None for the CPU."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def cpu_flags() -> set[str]:
    """CPU feature flags from /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_feature(name: str) -> bool:
    probe = getattr(torch.cpu, f"_is_{name}_supported", None)
    if probe is not None:
        try:
            return bool(probe())
        except RuntimeError:
            return False
    return name in cpu_flags()


@dataclass(frozen=True)
class DeviceInfo:
    """The facts about one device that decide what a precision recipe can do on it."""

    type: str
    index: int | None
    name: str
    compute_capability: tuple[int, int] | None = None
    total_memory: int | None = None
    supports_bf16: bool = False
    supports_fp16: bool = False
    supports_tf32: bool = False
    tensor_cores: bool = False
    # CPU only: the units that make CPU autocast fast.
    cpu_features: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.type == "cuda":
            cc = ".".join(map(str, self.compute_capability or ()))
            return f"{self.name} (cuda:{self.index}, sm {cc})"
        return f"CPU: {self.name}"

    @property
    def has_bf16_units(self) -> bool:
        """Whether bf16 arithmetic is done by dedicated units (so autocast can speed things up)."""
        if self.type == "cuda":
            return self.tensor_cores and self.supports_bf16
        return bool(self.cpu_features.get("amx_bf16") or self.cpu_features.get("avx512_bf16"))

    @property
    def has_fp16_units(self) -> bool:
        if self.type == "cuda":
            return self.tensor_cores
        return bool(self.cpu_features.get("amx_fp16") or self.cpu_features.get("avx512_fp16"))

    def has_units(self, dtype: str) -> bool:
        """`has_bf16_units` for ``"bf16"``, `has_fp16_units` for ``"fp16"``."""
        return self.has_bf16_units if dtype == "bf16" else self.has_fp16_units

    def to_dict(self) -> dict:
        data = asdict(self)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return data


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device | str = "auto") -> DeviceInfo:
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cc = (props.major, props.minor)
        return DeviceInfo(
            type="cuda",
            index=device.index,
            name=props.name,
            compute_capability=cc,
            total_memory=props.total_memory,
            supports_bf16=_cuda_bf16(cc),
            supports_fp16=True,
            supports_tf32=cc >= (8, 0),  # TF32 arrived with Ampere
            tensor_cores=cc >= (7, 0),  # Volta and later
        )
    flags = cpu_flags()
    features = {
        "amx_bf16": "amx_bf16" in flags if flags else _cpu_feature("amx_tile"),
        "amx_fp16": _cpu_feature("amx_fp16"),
        "avx512_bf16": _cpu_feature("avx512_bf16"),
        "avx512_fp16": "avx512_fp16" in flags,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    return DeviceInfo(
        type="cpu",
        index=None,
        name=_cpu_name(),
        total_memory=_host_memory(),
        supports_bf16=True,  # CPU autocast always accepts bf16 (emulated without the units)
        supports_fp16=bool(features["amx_fp16"] or features["avx512_fp16"]),
        cpu_features=features,
    )


def _cuda_bf16(cc: tuple[int, int]) -> bool:
    """bf16 units on the device asked for: compute capability 8.0+ (Ampere), or any ROCm GPU.

    Not ``torch.cuda.is_bf16_supported()``: it answers for the *current* device, and by default also
    for emulated bf16 (a V100 or T4 runs it, slower than fp32), so ``auto`` picked bf16 there."""
    return cc >= (8, 0) or bool(torch.version.hip)


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def dtype_name(requested) -> str:
    """``bf16|fp16|auto|tf32|fp32`` from what people pass: those names in any case, their long
    spellings (bfloat16, float16, half, float32), a torch dtype (torch.bfloat16, torch.float16) or
    its name as code writes it (``"torch.bfloat16"``: ``--dtype torch.bfloat16`` in a magic)."""
    if isinstance(requested, torch.dtype):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        if requested not in names:
            raise DeviceError(f"dtype {requested} is not an autocast dtype; use torch.bfloat16, torch.float16, "
                              "'bf16', 'fp16' or 'auto'")
        return names[requested]
    if requested is None:
        return "auto"
    if not isinstance(requested, str):
        raise DeviceError(f"dtype must be 'bf16', 'fp16', 'auto' or 'tf32' (or a torch dtype), got {requested!r}")
    name = requested.strip().lower().removeprefix("torch.")
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    return aliases.get(name, name)


def nearest_dtype(requested: str, choices) -> str | None:
    """The one of ``choices`` that ``requested`` most likely misspells ("bfloat" -> bf16, "f16" -> fp16), or
    None (a trial typed "bfloat", and the list alone left them to work out which was meant)."""
    import difflib

    spellings = {**{c: c for c in choices}, "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    near = difflib.get_close_matches(str(requested).lower(), list(spellings), n=1, cutoff=0.6)
    return spellings[near[0]] if near and spellings[near[0]] in choices else None


def did_you_mean(name: str, requested: str, choices) -> str:
    """`` (did you mean dtype='bf16'?)`` after a refusal, or nothing."""
    meant = nearest_dtype(requested, choices)
    return f" (did you mean {option(name, meant)}?)" if meant else ""


def unknown_dtype(requested: str, name: str, choices: tuple[str, ...]) -> str:
    """The refusal of a dtype name nbaccel does not know, with the nearest known one when there is one."""
    listed = ", ".join(choices[:-1]) + f" or {choices[-1]}"
    return f"{option(name, requested)} is not an autocast dtype; use {listed}{did_you_mean(name, requested, choices)}"


def autocast_dtype(requested: str, info: DeviceInfo, name: str = "dtype", emulated: bool = False) -> torch.dtype:
    """Map ``bf16|fp16|auto`` to the autocast dtype for this device, or say why not (``name``: the
    option the user set, ``dtype`` of %%amp or ``amp`` of %%profile_gpu). ``emulated``: fp16 on a CPU
    without fp16 units is run, not refused (``%%amp --emulated``: its drift, overflow and underflow are
    fp16's; its times are the emulation's)."""
    requested = dtype_name(requested)
    if requested == "auto":
        if info.type == "cpu" or info.supports_bf16:
            return torch.bfloat16
        return torch.float16
    if requested not in _DTYPES:
        # compare_amp / %%amp (``dtype``) also take tf32 (TF32 alone, no autocast); the profiler's amp does not
        choices = ("bf16", "fp16", "auto", "tf32") if name == "dtype" else ("bf16", "fp16", "auto")
        raise DeviceError(unknown_dtype(requested, name, choices))
    dtype = _DTYPES[requested]
    if dtype is torch.bfloat16 and not info.supports_bf16:
        raise DeviceError(f"{info.name} has no bf16 support (needs compute capability 8.0+); "
                          f"use {option(name, 'fp16')}")
    if dtype is torch.float16 and not info.supports_fp16 and not (emulated and info.type == "cpu"):
        # bf16 is accepted without its units: torch's bf16 path stays usable there (a 512^3 matmul on an
        # Ice Lake: fp32 12 ms, bf16 19 ms, fp16 194 ms), so the drift can be read in a notebook.
        # %%amp shows bf16's drift; %%profile_gpu --amp shows no drift (a trial read one promised there)
        shows = "its drift" if name == "dtype" else "which ops run in it"
        either = ("" if info.has_bf16_units else
                  f" (it has no bf16 units either: bf16 shows {shows} here, not its speed; measure speed on a GPU)")
        # %%amp, compare_amp and precision take emulated: fp16's drift, and a training step's overflow/underflow
        # with or without a GradScaler, are numbers a CPU can measure before a GPU run. %%profile_gpu does
        # not: a profile of emulated kernels says nothing of fp16 hardware
        override = (f" (or add {option('emulated', True)} to see fp16's drift and gradient overflow/underflow here, in runs many "
                    "times slower: not its speed)" if name == "dtype" else "")
        raise DeviceError(
            "this CPU has no fp16 arithmetic units (AMX-FP16 or AVX512-FP16), so CPU fp16 autocast would only "
            f"emulate it, many times slower than fp32; use {option(name, 'bf16')} on the CPU{either}{override}"
        )
    return dtype
