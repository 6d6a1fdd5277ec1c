"""Peak memory of one run, on the device that ran it, with the method that measured it.

CUDA: the caching allocator's own counters, reset before the run. ``allocated`` is what tensors
held at the peak; ``reserved`` is what the allocator took from the driver (what nvidia-smi and
the out-of-memory error see).

CPU: there is no allocator counter, so we read the process's resident set. On Linux,
writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark (VmHWM) to the current
RSS, and ``malloc_trim(0)`` first hands memory that glibc kept from earlier runs back to the OS,
so a run that reuses freed heap pages is still charged for touching them. The peak we report is
VmHWM after the run minus RSS before it: what the run added. Elsewhere a sampling thread reads
RSS every millisecond, which can miss a short spike; the method string says which was used.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from .device import device_index

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


@dataclass
class PeakMemory:
    """Bytes a run added at its peak, on one device, and how that was measured."""

    device: str
    peak_bytes: int
    method: str
    reserved_bytes: int | None = None  # CUDA only
    # The peak of each run when ``peak_bytes`` is their median (`median_of`); empty: one run.
    runs: tuple[int, ...] = ()
    # An allocator's count (CUDA's, torch's CPU allocator's: `nbaccel.tensor_peak`), which repeats run to
    # run; not the process's RSS, which moves with where the heap put earlier blocks.
    exact: bool = False

    @property
    def run_peaks(self) -> list[int]:
        """The peak of every run behind this figure (one run: just ``peak_bytes``)."""
        return list(self.runs) or [self.peak_bytes]

    @classmethod
    def median_of(cls, results: list[PeakMemory]) -> PeakMemory:
        """One figure for several runs of the same code: the run with the median peak (the lower middle
        one for an even count), every run's peak kept in ``runs``."""
        if len(results) == 1:
            return results[0]
        middle = sorted(results, key=lambda r: r.peak_bytes)[(len(results) - 1) // 2]
        return cls(middle.device, middle.peak_bytes, middle.method, middle.reserved_bytes,
                   tuple(r.peak_bytes for r in results), all(r.exact for r in results))

    def to_dict(self) -> dict:
        return {"device": self.device, "peak_bytes": self.peak_bytes, "reserved_bytes": self.reserved_bytes,
                "method": self.method, "runs_bytes": self.run_peaks, "exact": self.exact}


def _status_kibs(*fields: str) -> dict[str, int]:
    """Several ``/proc/self/status`` sizes (in bytes) from one read; a field that is not there is left out."""
    found = {}
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in fields:
                    found[name] = int(line.split()[1]) * 1024
                    if len(found) == len(fields):
                        break
    except OSError:
        return {}
    return found


def _status_kib(field: str) -> int | None:
    return _status_kibs(field).get(field)


def current_rss() -> int | None:
    return _status_kib("VmRSS")


@functools.lru_cache(maxsize=1)
def _libc():
    # find_library runs ldconfig (~1.5 ms): look it up once, so per-cell meters stay cheap.
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _libc_trim():
    return getattr(_libc(), "malloc_trim", None)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc_mallinfo2():
    fn = getattr(_libc(), "mallinfo2", None)  # glibc 2.33+
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


def malloc_held_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not got back, written or not: its mmapped chunks
    (``mallinfo2().hblkhd``: every allocation above its mmap threshold, 128 KiB rising to 32 MiB as
    large blocks are freed) plus what is in use in its heaps (``uordblks``, every arena: the tensors
    below the threshold, 64 x 16 MiB ``torch.empty`` grew it 1 GiB and RSS not at all). 5 µs, more
    where many freed chunks wait in malloc's free lists, which it walks. Address space as a whole
    (``VmSize``) is no measure of allocations: a new thread maps a 64 MiB malloc arena it may never fill
    (8 threads, 144 MiB here), and a library import maps its file. None without glibc's mallinfo2
    (musl, tcmalloc preloaded: their chunks are not glibc's and read 0, which only hides the note that
    uses this)."""
    fn = _libc_mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.hblkhd) + int(info.uordblks)


# A CPU block's RSS at its end this far above its start is trimmed and read again (`PeakMeter`): below it a
# "kept" figure is not said anyway (budget.PUSHED, the same 1 MiB).
KEPT_TRIM_BYTES = 2**20


def malloc_trim() -> None:
    """Hand the heap pages malloc keeps from freed memory back to the OS (glibc's ``malloc_trim(0)``); nothing
    elsewhere. Before a CPU meter, after the estimator's dry runs, on ``%memory_budget release``."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)


def _can_reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


# The meters measuring now. Starting a meter resets the device's peak counter (CUDA's
# reset_peak_memory_stats, the CPU's VmHWM), which would hide the peak reached before it from every
# meter around it: a budget watching a cell whose %%amp memory runs (or estimator) reset the peak saw
# only what came after the last reset. So a reset first folds the current peak into the open meters.
# Weakly held: a meter entered and never left (``memory_budget(...).__enter__()`` typed by hand, the
# object then dropped) leaves the set when the garbage collector frees it (an entered meter is in a
# reference cycle with its context generator), instead of folding peaks forever.
_open_meters: weakref.WeakSet[PeakMeter] = weakref.WeakSet()


def reset_cuda_peak(device: torch.device, now: CudaCounters | None = None) -> None:
    """``torch.cuda.reset_peak_memory_stats(device)``, the open meters on ``device`` keeping the peak so
    far (``now``: the counters, when the caller has just read them)."""
    gpu = device_index(device)
    around = [m for m in _open_meters if m.device.type == "cuda" and device_index(m.device) == gpu]
    if around:
        now = now or cuda_counters(device)
        for meter in around:
            meter.fold(now.peak_allocated, now.peak_reserved)
    torch.cuda.reset_peak_memory_stats(device)


def _reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS, the open CPU meters keeping the peak so far; False where the
    kernel does not allow it (no /proc: the RSS sampler is used instead, and nothing is reset)."""
    around = [m for m in _open_meters if m.device.type == "cpu"]
    if around:
        peak = _status_kib("VmHWM") or 0
        for meter in around:
            meter.fold(peak)
    return _can_reset_hwm()


class _RssSampler(threading.Thread):
    """Polls RSS while a run executes, for systems where the high-water mark cannot be reset."""

    def __init__(self, read, interval: float = 1e-3):
        super().__init__(daemon=True)
        self.read, self.interval = read, interval
        self.peak = read() or 0
        self._stop_event = threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            self.peak = max(self.peak, self.read() or 0)
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak, self.read() or 0)


def _rss_reader():
    reader = current_rss
    if reader() is None:
        try:
            import psutil  # optional: macOS and Windows
        except ImportError:
            return None
        process = psutil.Process()
        reader = lambda: process.memory_info().rss  # noqa: E731
    return reader


@dataclass(frozen=True)
class CudaCounters:
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


def cuda_counters(device: torch.device) -> CudaCounters:
    """The caching allocator's current and peak bytes, read once.

    ``torch.cuda.memory_allocated()`` and its siblings each flatten and sort the whole statistics
    dict (about 0.1-0.2 ms apiece); a per-cell watcher needs four of them, so it reads the nested
    dict once instead. The allocator counts on the host when memory is requested and freed, so no
    synchronize is needed for these numbers. Before CUDA is initialised there is nothing allocated.
    """
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:
        return CudaCounters(0, 0, 0, 0)
    allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return CudaCounters(allocated["current"], reserved["current"], allocated["peak"], reserved["peak"])


class PeakMeter:
    """Context manager: ``with PeakMeter(device) as meter: run()`` then read ``meter.result``.

    ``collect=False`` skips the full ``gc.collect()`` before a CPU run (tens of ms with torch
    loaded); per-cell watchers use it, since uncollected garbage only raises the baseline.

    On CUDA the run ends with a synchronize; an asynchronous error it raises (a kernel of the run
    failed) is raised from the exit after the result is read. ``sync=False`` skips the synchronize.
    """

    def __init__(self, device: torch.device, collect: bool = True, sync: bool = True):
        self.device = device
        self.collect = collect
        self.sync = sync
        self.result: PeakMemory | None = None
        self.before: CudaCounters | None = None  # CUDA: the counters read as the run began
        # What the device held when the run ended (CUDA: the counters, CPU: RSS), read with the peak: a
        # watcher tells a cell that freed memory from one that only held it.
        self.after: CudaCounters | None = None
        self.rss_after: int | None = None
        # CPU: what malloc's allocations (`malloc_held_bytes`: mmapped chunks and heap in use) grew by beyond
        # RSS: memory allocated and not yet written (torch.empty's pages become resident
        # when written), which RSS does not count yet. 0 where it cannot be read (no glibc mallinfo2).
        # ``unwritten_change`` is the same difference signed: negative where the run wrote or freed memory
        # left unwritten before it (a watcher keeps the running total: `budget.Watcher.unwritten_total`).
        self.unwritten_bytes = self.unwritten_change = 0
        # The highest peak counters read when a meter inside this one reset them (see _open_meters).
        self._folded = (0, 0)

    def fold(self, peak: int, peak_reserved: int = 0) -> None:
        self._folded = (max(self._folded[0], peak), max(self._folded[1], peak_reserved))

    @contextlib.contextmanager
    def _cuda(self):
        # The counters themselves need no synchronize (see cuda_counters); the one after the run keeps
        # an asynchronous error or the run's kernels from spilling into whatever is measured next.
        self.before = base = cuda_counters(self.device)
        reset_cuda_peak(self.device, now=base)
        try:
            yield
        except BaseException:
            self._end_cuda(base)  # the run's own error is the one to see, not a later one from the sync
            raise
        error = self._end_cuda(base)
        if error is not None:
            raise error

    def _end_cuda(self, base: CudaCounters) -> RuntimeError | None:
        """Synchronize and read the peak; returns the error the synchronize raised (a kernel of the run
        failed asynchronously: a device-side assert, an illegal address) after the result is read (the
        allocator counts on the host). ``sync=False`` meters skip it: once the CUDA context has failed,
        every later synchronize raises the same error again."""
        error = None
        if self.sync:
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as e:  # torch.AcceleratorError is one
                error = e
        self.after = after = cuda_counters(self.device)
        self.result = PeakMemory(
            device=str(self.device),
            peak_bytes=max(after.peak_allocated, self._folded[0]) - base.allocated,
            reserved_bytes=max(after.peak_reserved, self._folded[1]) - base.reserved,
            method="torch.cuda.max_memory_allocated after reset_peak_memory_stats (minus allocated before)",
            exact=True,
        )
        return error

    @contextlib.contextmanager
    def _cpu(self):
        if self.collect:
            gc.collect()
        malloc_trim()
        if _reset_cpu_peak():
            before, held_before = current_rss() or 0, malloc_held_bytes()
            try:
                yield
            finally:
                now = _status_kibs("VmHWM", "VmRSS")  # one read for both: this runs after every watched cell
                peak, self.rss_after = max(now.get("VmHWM", 0), self._folded[0]), now.get("VmRSS")
                if self.rss_after is not None and self.rss_after - before >= KEPT_TRIM_BYTES:
                    # What looks kept may be heap glibc holds from freed tensors: a training step that kept
                    # nothing read "80.6 MiB kept" (the step before it, the same work, none). Handed back
                    # first, so the RSS as the block ended is what it holds; only then, since a trim after
                    # a training step took up to 4 ms on the 2-core VM (docs/memory.md).
                    malloc_trim()
                    self.rss_after = _status_kibs("VmRSS").get("VmRSS", self.rss_after)
                # What malloc handed out beyond what became resident: allocated, not yet written. malloc_trim
                # above made the heap's free pages non-resident, so reusing them and writing grows RSS too.
                held_after = malloc_held_bytes()
                if None not in (held_before, held_after, self.rss_after):
                    # signed: a cell that writes (or frees) memory an earlier cell left unwritten lowers it
                    self.unwritten_change = (held_after - held_before) - (self.rss_after - before)
                    self.unwritten_bytes = max(0, self.unwritten_change)
                self.result = PeakMemory(
                    "cpu", max(0, peak - before),
                    "process peak RSS (VmHWM reset via /proc/self/clear_refs, malloc_trim first) minus RSS before",
                )
            return
        reader = _rss_reader()
        if reader is None:
            yield
            self.result = PeakMemory("cpu", 0, "unavailable: no /proc and no psutil; install psutil")
            return
        sampler = _RssSampler(reader)
        before = sampler.peak
        sampler.start()
        try:
            yield
        finally:
            peak, self.rss_after = sampler.stop(), reader()
            self.result = PeakMemory("cpu", max(0, peak - before),
                                     "process RSS sampled every 1 ms (may miss short spikes) minus RSS before")

    def __enter__(self):
        self._folded = (0, 0)  # a meter used again starts afresh
        self.after = self.rss_after = None
        self.unwritten_bytes = self.unwritten_change = 0
        self._cm = self._cuda() if self.device.type == "cuda" else self._cpu()
        self._cm.__enter__()  # resets the peak (folding it into the meters around) before joining them
        _open_meters.add(self)
        return self

    def __exit__(self, *exc):
        _open_meters.discard(self)
        return self._cm.__exit__(*exc)


@contextlib.contextmanager
def meter_series(device: torch.device):
    """Around several `PeakMeter` runs in a row: each CPU run starts with ``gc.collect()``, and a full
    collection walks every object the process tracks (0.1-0.2 s with torch, pandas and IPython loaded,
    more as a notebook session grows; a CPU ``%%amp`` made six of them). So: one full collection here,
    then ``gc.freeze()``, and each run's collection walks only the objects made since, which is where
    the earlier runs' garbage is. An object from before that dies inside in a reference cycle waits for
    the end (the same bytes under every run, so the peaks, taken over each run's start, are unchanged).
    A process that froze objects itself (``gc.get_freeze_count()``) is left as it is; a cell that calls
    ``gc.freeze()`` during the runs has its objects unfrozen with nbaccel's at the end."""
    if device.type == "cuda" or gc.get_freeze_count():
        yield
        return
    gc.collect()
    try:
        gc.freeze()  # inside the try: a Ctrl-C right after it still unfreezes (unfreezing nothing is harmless)
        yield
    finally:
        gc.unfreeze()


# A single letter is a binary unit, as docker (--memory 6g) and systemd (MemoryMax=6G) read it; nbaccel's
# own --enforce note tells users to write those. Kubernetes' Ki/Mi/Gi/Ti are binary too. No P/E letters:
# "2e" reads as an unfinished exponent.
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60,
         "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# Patterns for re.I: a number in any notation (6, 1.5, .8, 2e9) and a unit after it (B, KB..EB, KiB..EiB,
# K..T, Ki..Ti).
NUMBER_PATTERN = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?"
UNIT_PATTERN = r"[kmgtpe]i?b|[kmgt]i?|b"
MAX_BYTES = 2**64  # no machine's memory is larger: a size above it is a typo (17EiB), not a budget


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        # 1023.5 KiB and up reads "1 MiB", not "1.02e+03 KiB" (3 significant digits of 1023.4)
        if n < 1023.5 or unit == "EiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" or n >= 999.5 else f"{sign}{n:.3g} {unit}"
        n /= 1024
    return f"{sign}{n} B"


def byte_range(low: int, high: int) -> str:
    """"22-24.1 MiB", or one size when both ends read the same."""
    lo, hi = format_bytes(low), format_bytes(high)
    if lo == hi:
        return lo
    lo_number, _, lo_unit = lo.partition(" ")
    return f"{lo_number}-{hi}" if lo_unit == hi.partition(" ")[2] else f"{lo}-{hi}"


# Sizes are read by `budget.parse_budget` alone (the tables above are its): a second reader here took "1e9" as
# bytes where %memory_budget refuses it, and nothing in the package called it.
__all__ = ["PeakMemory", "PeakMeter", "meter_series", "format_bytes", "byte_range", "current_rss"]


# --- nbaccel's own runs inside a measured cell --------------------------------------------------

# The comparisons run since the budget watcher began the cell: who ran the first, host bytes of all.
# One slot, not a list: a script calling compare_amp in a loop with no budget watching must not grow it.
_harness: dict = {}


def note_harness(who: str, host_bytes: int) -> None:
    """compare_amp calls this: the code it was given ran several times (fp32 and the recipe, under the
    op audit) beside a host snapshot of its state, so a budget watching the cell measures nbaccel's
    comparison, not one plain run of the cell (a step that added 64 MiB added 271 MiB under %%amp)."""
    _harness.setdefault("who", who)
    _harness["bytes"] = _harness.get("bytes", 0) + int(host_bytes)


def take_harness() -> tuple[str | None, int]:
    """(who ran the first comparison noted since the last call, or None; their snapshots' bytes), and
    forget them (the watcher's begin and end)."""
    taken = (_harness.get("who"), _harness.get("bytes", 0))
    _harness.clear()
    return taken
