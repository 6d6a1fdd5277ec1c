"""Explain an out-of-memory error: what was asked for, what was held, by whom, and what to try.

The numbers come from three places, each named in the explanation:

* the error message itself (torch's CUDA caching allocator and CPU allocator both print the
  request size; the CUDA one also the capacity, the free memory, what PyTorch allocated and
  reserved, and the cap when ``set_per_process_memory_fraction`` is in force);
* the device counters read while the failing frames are still alive (the traceback keeps the
  cell's locals, so ``torch.cuda.memory_allocated()`` is what was allocated at the failure);
* the namespace (`holders.namespace_holders`).

The suggestions are sized from those numbers. They are bounds, not promises, and say so: the
memory in flight at the failure (what was allocated, plus the request, minus what names hold) is
a lower bound of what the failing step needed.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field

import torch

from .cells import cell_label
from .holders import Holder, namespace_holders
from .memory import UNITS, current_rss, format_bytes
from .results import ResultMixin

# What ``shell.set_custom_exc`` is given. RuntimeError and MemoryError are broader than OOM: the
# handler checks `is_oom` and shows every other error exactly as IPython would.
OOM_TYPES = (torch.OutOfMemoryError, RuntimeError, MemoryError)

_CPU_MARK = "can't allocate memory"
# Out of memory outside PyTorch's caching allocator: the CUDA runtime (context, kernel launch, a
# library's own cudaMalloc; torch raises torch.AcceleratorError, a RuntimeError, or a plain one) and
# cuBLAS / cuDNN failing to allocate a handle or workspace. These messages carry no sizes.
_CUDA_RUNTIME_MARKS = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
_SIZE = r"([0-9]*\.?[0-9]+)\s*(bytes|B|KiB|MiB|GiB|TiB|PiB|EiB)"


def is_oom(exc: BaseException) -> bool:
    """CUDA ``torch.OutOfMemoryError``, the CPU allocator's RuntimeError, Python's MemoryError, or a
    RuntimeError (``torch.AcceleratorError`` included) saying the CUDA runtime, cuBLAS or cuDNN ran out
    of memory outside the caching allocator."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return _CPU_MARK in text or "CUDA out of memory" in text or _outside_allocator(text)


def _outside_allocator(text: str) -> bool:
    """A CUDA out-of-memory message from outside the caching allocator (no sizes in it)."""
    return any(mark in text for mark in _CUDA_RUNTIME_MARKS)


def _size(number: str, unit: str) -> int:
    # a size read from an error message is what it is: no budget checks (parse_budget refuses 0 and > 16 EiB)
    return int(float(number) * UNITS["b" if unit.lower() == "bytes" else unit.lower()])


def _find(pattern: str, text: str) -> int | None:
    match = re.search(pattern.replace("SIZE", _SIZE), text)
    return _size(match.group(1), match.group(2)) if match else None


@dataclass
class OomFacts:
    """What an out-of-memory message says, in bytes (None where the message does not say)."""

    source: str  # "cuda" | "cpu" | "python"
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None  # by PyTorch, at the failure
    reserved_unallocated: int | None = None
    process_in_use: int | None = None
    allowed: int | None = None  # the per-process cap, when one was set
    gpu: int | None = None
    # the CUDA runtime, cuBLAS or cuDNN failed outside PyTorch's caching allocator (no sizes in the message)
    outside_allocator: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse_oom_message(text: str) -> OomFacts:
    """Read the sizes out of torch's (and numpy's) out-of-memory messages.

    Understands the CUDA caching allocator's message since torch 2.1 ("Tried to allocate 2.00 GiB.
    GPU 0 has a total capacity of ... of which ... is free. ... Of the allocated memory ... is
    allocated by PyTorch, and ... is reserved by PyTorch but unallocated."), the older one
    ("Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.2 GiB already allocated;
    ... free; ... allowed; ... reserved in total by PyTorch)"), the CPU allocator's ("you tried to
    allocate 1125899906842624 bytes") and numpy's ("Unable to allocate 8.00 EiB for an array").
    An out-of-memory error from outside the caching allocator ("CUDA error: out of memory",
    CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED) is CUDA's with no sizes at all.
    """
    if _outside_allocator(text) and "Tried to allocate" not in text:
        gpu = re.search(r"GPU (\d+)", text)
        return OomFacts("cuda", gpu=int(gpu.group(1)) if gpu else None, outside_allocator=True)
    if "CUDA out of memory" in text or "Tried to allocate" in text:
        gpu = re.search(r"GPU (\d+)", text)
        facts = OomFacts("cuda", requested=_find(r"Tried to allocate SIZE", text), gpu=int(gpu.group(1)) if gpu else None)
        facts.capacity = _find(r"total capacity of SIZE", text) or _find(r"SIZE total capacity", text)
        facts.free = _find(r"of which SIZE is free", text) or _find(r"SIZE free", text)
        facts.allocated = _find(r"SIZE is allocated by PyTorch", text) or _find(r"SIZE already allocated", text)
        facts.reserved_unallocated = _find(r"SIZE is reserved by PyTorch but unallocated", text)
        old_reserved = _find(r"SIZE reserved in total by PyTorch", text)
        if facts.reserved_unallocated is None and old_reserved is not None and facts.allocated is not None:
            facts.reserved_unallocated = max(0, old_reserved - facts.allocated)
        facts.process_in_use = _find(r"this process has SIZE memory in use", text)
        facts.allowed = _find(r"SIZE allowed", text)
        return facts
    if _CPU_MARK in text:
        match = re.search(r"allocate (\d+) bytes", text)
        return OomFacts("cpu", requested=int(match.group(1)) if match else None)
    return OomFacts("python", requested=_find(r"Unable to allocate SIZE", text))


@dataclass
class Suggestion:
    action: str
    saving_bytes: int | None
    detail: str

    def to_dict(self) -> dict:
        return {"action": self.action, "saving_bytes": self.saving_bytes, "detail": self.detail}


@dataclass
class OomExplanation(ResultMixin):
    """Why a cell ran out of memory, with sized suggestions. Rendered by `render.budget`."""

    kind = "budget"
    view = "oom"

    error_type: str
    message: str
    device: str
    facts: OomFacts
    limit_bytes: int | None
    limit_source: str
    allocated_bytes: int | None
    allocated_method: str
    holders: list[Holder] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    location: str | None = None
    budget_bytes: int | None = None

    @property
    def needed_at_least(self) -> int | None:
        """Allocated at the failure + the request: a lower bound of what the step needed."""
        if self.facts.requested is None:
            return None
        return (self.allocated_bytes or 0) + self.facts.requested

    def _payload(self) -> dict:
        return {"view": self.view, "error_type": self.error_type, "message": self.message, "device": self.device,
                "facts": self.facts.to_dict(), "limit_bytes": self.limit_bytes, "limit_source": self.limit_source,
                "allocated_bytes": self.allocated_bytes, "allocated_method": self.allocated_method,
                "needed_at_least": self.needed_at_least, "budget_bytes": self.budget_bytes,
                "holders": [h.to_dict() for h in self.holders],
                "suggestions": [s.to_dict() for s in self.suggestions], "location": self.location}


def _user_location(tb) -> str | None:
    """The innermost frame outside torch and site-packages: the line of the user's code that failed."""
    if tb is None:
        return None
    frames = [f for f in traceback.extract_tb(tb)
              if "site-packages" not in f.filename and "/torch/" not in f.filename and "/nbaccel/" not in f.filename]
    if not frames:
        return None
    f = frames[-1]
    return f"{cell_label(f.filename)}, line {f.lineno}: {(f.line or '').strip()}"


def _device_of(facts: OomFacts) -> torch.device:
    if facts.source != "cuda":
        return torch.device("cpu")
    # A message without a GPU number (the CUDA runtime's) is the current device's: "cuda", not a guessed index.
    return torch.device("cuda", facts.gpu) if facts.gpu is not None else torch.device("cuda")


def _allocated_now(device: torch.device, facts: OomFacts) -> tuple[int | None, str]:
    if device.type == "cuda":
        if facts.allocated is not None:
            return facts.allocated, "the CUDA error message (allocated by PyTorch at the failure)"
        return torch.cuda.memory_allocated(device), "torch.cuda.memory_allocated() while the failing frames were alive"
    rss = current_rss()
    return rss, "process RSS (/proc/self/status VmRSS) while the failing frames were alive"


def _limit(device: torch.device, facts: OomFacts, budget: int | None, host_total: int | None) -> tuple[int | None, str]:
    if facts.allowed:
        return facts.allowed, "the per-process cap (set_per_process_memory_fraction, from the message)"
    if budget:
        return budget, "the memory budget"
    if facts.capacity:
        return facts.capacity, "the GPU's total capacity (from the message)"
    if device.type == "cuda":  # a message without sizes: the device's own figures, never the host's
        return _cuda_limit(device)
    return host_total, "the host's physical memory"


def _cuda_limit(device: torch.device) -> tuple[int | None, str]:
    """The device's capacity (or the per-process cap in force on it), read from torch; (None, why) when
    even that fails (a CUDA context broken by the error)."""
    try:
        total = torch.cuda.get_device_properties(device).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = float(getter(device)) if getter else 1.0
    except Exception:  # noqa: BLE001 - the explanation must not fail where the user's code did
        return None, "not known (the message has no sizes and the device could not be read)"
    if fraction < 1.0:
        return int(total * fraction), "the per-process cap (get_per_process_memory_fraction, read after the failure)"
    return total, "the GPU's total memory (torch.cuda.get_device_properties)"


def suggest(exp: OomExplanation, per_sample_bytes: int | None = None, batch: int | None = None,
            per_sample_precision: str = "fp32") -> list[Suggestion]:
    """Sized suggestions from an explanation's numbers (and, if known, a measured bytes-per-sample)."""
    out: list[Suggestion] = []
    limit, requested = exp.limit_bytes, exp.facts.requested
    on_device = [h for h in exp.holders if h.device.split(":")[0] == exp.device.split(":")[0]]
    states = sum(h.nbytes for h in on_device if h.kind in ("module", "optimizer"))
    loose = [h for h in on_device if h.kind not in ("module", "optimizer") and h.nbytes > 0]
    held = states + sum(h.nbytes for h in loose)
    need = exp.needed_at_least
    if exp.facts.outside_allocator:
        out.append(Suggestion(
            "torch.cuda.empty_cache() before the step", None,
            "the allocation that failed was made outside PyTorch's caching allocator (the CUDA runtime, or a "
            "cuBLAS/cuDNN handle or workspace), which cannot use the memory the allocator keeps cached: free "
            "the cache first, or leave room beside it (a smaller batch or budget)"))
    if requested is not None and limit is not None and requested > limit:
        out.append(Suggestion("check the shape", None,
                              f"one allocation of {format_bytes(requested)} is larger than the whole limit "
                              f"({format_bytes(limit)}): no setting (precision, batch, sharding) makes it fit; a "
                              "dimension is too large (batch, sequence length, vocabulary) or a shape is wrong"))
        return out
    # Memory in flight = what the step had allocated beyond the named objects, plus the request.
    in_flight = max(0, need - held) if need is not None else None
    if limit is not None and need is not None and in_flight:
        room = limit - held
        fraction = room / in_flight if in_flight else None
        if fraction is not None and fraction > 0:
            detail = (f"activations scale with the batch: at most {min(fraction, 1):.0%} of the current batch fits "
                      f"({format_bytes(room)} left beside {format_bytes(held)} held by names, for at least "
                      f"{format_bytes(in_flight)} in flight); an upper bound, since the step may have needed more")
            if per_sample_bytes and batch:
                fits = int(room // per_sample_bytes)
                detail = (f"the estimate measured {format_bytes(per_sample_bytes)} per sample in {per_sample_precision} "
                          f"(the steeper of the forward's and the backward's peaks): at most batch {fits} fits (was "
                          f"{batch}); " + detail)
            out.append(Suggestion("smaller batch", int(in_flight - room) if in_flight > room else None, detail))
        else:
            out.append(Suggestion("free memory first", None,
                                  f"names already hold {format_bytes(held)} of the {format_bytes(limit)} limit: "
                                  "no batch size fits until something below is freed"))
    if in_flight:
        out.append(Suggestion("mixed precision (torch.autocast bf16/fp16)", in_flight // 2,
                              f"matmul/conv activations are kept in 16 bits: up to half of the "
                              f"{format_bytes(in_flight)} in flight (measure with %%amp)"))
        out.append(Suggestion("gradient checkpointing (torch.utils.checkpoint per block)", in_flight,
                              f"stores only block inputs and recomputes the rest in backward (about one extra forward): "
                              f"saves most of the {format_bytes(in_flight)} of activations in flight"))
    for h in loose[:3]:
        hint = "%reset -f out" if h.name.startswith("Out[") else f"del {h.name}"
        out.append(Suggestion(hint, h.nbytes, f"{h.name} holds {format_bytes(h.nbytes)} ({h.kind}, {h.dtype})"))
    if exp.device.startswith("cuda") and exp.facts.reserved_unallocated:
        out.append(Suggestion("torch.cuda.empty_cache() / PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                              exp.facts.reserved_unallocated,
                              f"{format_bytes(exp.facts.reserved_unallocated)} is reserved by PyTorch but unallocated "
                              "(the allocator already retried after freeing its cache, so this is fragmentation)"))
    if exp.device.startswith("cuda") and states and limit and need:
        for n in (2, 4, 8, 16):
            per_gpu = need - states + states / n
            if per_gpu <= limit:
                out.append(Suggestion(f"shard across {n} GPUs (FSDP / ZeRO-3)", int(states - states / n),
                                      f"parameters, gradients and optimizer states ({format_bytes(states)}) split {n} ways: "
                                      f"about {format_bytes(per_gpu)} per GPU (plus one layer gathered at a time)"))
                break
    return out


def explain_oom(exc: BaseException, namespace: dict | None = None, budget: int | None = None, tb=None,
                skip=lambda name: False, per_sample_bytes: int | None = None, batch: int | None = None,
                top: int = 8, per_sample_precision: str = "fp32") -> OomExplanation:
    """Build the explanation for an out-of-memory exception (call it while the traceback is alive).
    ``per_sample_bytes``: what the step needs per sample of ``batch`` (an estimate's, measured in
    ``per_sample_precision``), for the largest batch that fits."""
    from .device import _host_memory

    message = str(exc)
    facts = parse_oom_message(message)
    device = _device_of(facts)
    allocated, method = _allocated_now(device, facts)
    limit, source = _limit(device, facts, budget, _host_memory())
    exp = OomExplanation(
        error_type=type(exc).__name__, message=message.split("If reserved but unallocated")[0].strip(),
        device=str(device), facts=facts, limit_bytes=limit, limit_source=source, allocated_bytes=allocated,
        allocated_method=method, holders=namespace_holders(namespace or {}, top=top, skip=skip),
        location=_user_location(tb if tb is not None else exc.__traceback__), budget_bytes=budget,
    )
    exp.suggestions = suggest(exp, per_sample_bytes, batch, per_sample_precision)
    return exp


__all__ = ["OOM_TYPES", "is_oom", "parse_oom_message", "OomFacts", "OomExplanation", "Suggestion", "explain_oom",
           "suggest"]
