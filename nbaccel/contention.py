"""How much CPU other programs took while a block ran: measured, so a timing can say it was contended.

A background training job, a second kernel or a compile on the same machine inflates a timing in a
way its spread does not show: if it runs through all the runs, every run is slower by about the same
amount and the IQR stays small. What the machine did meanwhile is in Linux's ``/proc/stat``:

* the busy time of each CPU this process may run on (``os.sched_getaffinity``): user + nice +
  system + irq + softirq + steal (steal is time the hypervisor gave another VM: contention too);
  idle and iowait are idle. Only those CPUs: a job pinned to other cores does not compete.
* minus this process's own CPU time (``time.process_time``: every thread, nanosecond clock) and
  its children's (see `ProcReader.ours`): a DataLoader worker is the cell's own work.
* minus, under a launcher that started several ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``), the
  other local ranks' CPU time (see `ProcReader.siblings`): the user's own launch shares the cores by
  design, so it is counted apart and said as such, not as "other programs".

What is left, divided by the wall time, is the number of cores other programs kept busy on
average. It is measured per named span and summed, so ``%%amp`` can tell fp32's runs from the
mixed-precision ones'. Where there is no ``/proc/stat`` (macOS, Windows) nothing is claimed.

The readers and the clock are injectable, so the arithmetic is tested without a busy machine.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from .timing import format_seconds

# Others must average at least a quarter of a core before a timing is called contended. Why this
# much: torch's CPU kernels run OpenMP parallel regions that wait for their slowest thread, so a
# quarter of one core taken from a torch thread can slow a region by up to a quarter -- well over
# the 10 % spread that already earns a noise warning (timing.NOISE_THRESHOLD); and the figure's own
# error stays well below it (summed short spans agreed with one span around them within 0.06 cores
# on the 2-core VM: docs/amp.md).
MIN_OTHERS_CORES = 0.25

# /proc/stat counts in ticks of 1/USER_HZ s (10 ms), per CPU: one tick of rounding on one core is
# already 0.05 cores over 0.2 s, and 0.5 cores over 20 ms, so below this much wall time a span's
# figure would be mostly rounding and is not given.
MIN_WINDOW_S = 0.2


def _user_hz() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): /proc is not there either
        return 100


def _local_world_size() -> int:
    """How many ranks the launcher (torchrun) started on this machine; 1 outside a launch."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _usable_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return None


class ProcReader:
    """Readings from Linux's /proc, in seconds. ``proc`` is the mount point (a test can point it at
    a fake tree); ``cpus`` the CPU numbers to count (default: those this process may run on)."""

    def __init__(self, proc: str = "/proc", cpus: set[int] | None = None):
        self.proc = proc
        self.cpus = _usable_cpus() if cpus is None else set(cpus)
        self.hz = _user_hz()
        own = os.getpid()
        # Live children are found through /proc/<pid>/task/<tid>/children where the kernel has it
        # (CONFIG_PROC_CHILDREN); without it (some VM kernels), one scan of /proc now finds the
        # descendants that already exist, e.g. DataLoader workers started by the warmup runs.
        self._children_files = os.path.exists(f"{proc}/{own}/task/{own}/children")
        launched = _local_world_size() > 1
        # one scan of /proc serves both: the descendants (without the children files) and the other ranks
        parents = self._parents() if launched or not self._children_files else {}
        self._known = set() if self._children_files else self._scan_descendants(own, parents)
        self.method = ("/proc/stat busy time of the usable cores (steal included) minus this process's and its "
                       "child processes' CPU time")
        if not self._children_files:
            self.method += ("; child processes started during the timed runs count as other programs (this "
                            "kernel has no /proc/<pid>/task/<tid>/children to find them)")
        # Under torchrun each local rank is a child of the one agent process. A trial's rank 0 read "other
        # programs used 1.4 of the 2 cores ... re-run when the machine is quiet", 1.0 of it rank 1.
        self.sibling_ranks = self._find_sibling_ranks(own, parents) if launched else []
        self._sibling_last: dict[int, float] = {}
        if self.sibling_ranks:
            self.method += ("; this launch's other ranks: its launcher's other child processes with "
                            "LOCAL_RANK set")

    def available(self) -> str | None:
        """Why nothing can be measured here, or None."""
        if not os.path.exists(f"{self.proc}/stat"):
            return "no /proc/stat on this OS"
        if not self.cpus:
            return "the CPUs this process may use are unknown"
        return None

    def busy(self) -> float:
        """CPU-seconds the usable CPUs have been busy since boot."""
        ticks = 0
        with open(f"{self.proc}/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu") or line.startswith(b"cpu "):
                    continue
                name, *values = line.split()
                if int(name[3:]) in self.cpus:
                    v = [int(x) for x in values]
                    ticks += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
        return ticks / self.hz

    def ours(self) -> float:
        """CPU-seconds of this process (all threads) and its descendants so far.

        Children that ended and were waited for (a non-persistent DataLoader's workers, a
        subprocess.run) are in getrusage(RUSAGE_CHILDREN). Live ones are read from their
        /proc/<pid>/stat, own and reaped-children time, so a child that ends between two readings
        moves from one term to the other without being counted twice. Not seen: a child started
        and still running inside a span on a kernel without the children files, and a child that
        outlived its parent (re-parented to init): those count as other programs."""
        import resource  # POSIX only: imported where /proc exists, never on Windows

        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = time.process_time() + usage.ru_utime + usage.ru_stime
        pids = self._descendants(os.getpid()) if self._children_files else self._known
        for pid in pids:
            total += self._pid_seconds(pid)
        return total

    def siblings(self) -> float:
        """CPU-seconds of the launch's other local ranks (found as the reader was made) and their live
        descendants so far. A rank that ended keeps its last reading: its time went to the launcher, which
        is not read, and dropping it would hand its whole lifetime to "other programs"."""
        for rank in self.sibling_ranks:
            pids = [rank, *self._descendants(rank)] if self._children_files else [rank]
            seconds = [self._pid_seconds(pid, ended=None) for pid in pids]
            if seconds[0] is not None:  # the rank itself still runs
                self._sibling_last[rank] = sum(x for x in seconds if x is not None)
        return sum(self._sibling_last.values())

    def _pid_seconds(self, pid: int, ended: float | None = 0.0) -> float | None:
        try:
            with open(f"{self.proc}/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:  # ended (and reaped: its time is in its parent's now)
            return ended
        fields = data[data.rindex(b")") + 2:].split()  # the name in (...) may hold spaces
        return sum(int(x) for x in fields[11:15]) / self.hz  # utime stime cutime cstime

    def _find_sibling_ranks(self, own: int, parents: dict[int, int]) -> list[int]:
        """The other children of this process's parent that carry the launch's ``LOCAL_WORLD_SIZE`` and a
        ``LOCAL_RANK``: the launch's other local ranks. The environment is checked because a parent such as
        a Jupyter server has other children (other kernels) that are other programs."""
        parent, size = os.getppid(), os.environ.get("LOCAL_WORLD_SIZE")
        found = []
        for pid, ppid in parents.items():
            if ppid != parent or pid == own:
                continue
            try:
                with open(f"{self.proc}/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:  # another user's process, or ended
                continue
            if f"LOCAL_WORLD_SIZE={size}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
                found.append(pid)
        return sorted(found)

    def _descendants(self, pid: int) -> list[int]:
        found, todo = [], [pid]
        while todo:
            parent = todo.pop()
            try:
                tasks = os.listdir(f"{self.proc}/{parent}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"{self.proc}/{parent}/task/{tid}/children") as f:
                        children = [int(c) for c in f.read().split()]
                except OSError:
                    continue
                found += children
                todo += children
        return found

    def _parents(self) -> dict[int, int]:
        """Every process's parent, from one scan of /proc/<pid>/stat."""
        parents = {}
        try:
            names = os.listdir(self.proc)
        except OSError:
            return parents
        for name in names:
            if name.isdigit():
                try:
                    with open(f"{self.proc}/{name}/stat", "rb") as f:
                        data = f.read()
                    parents[int(name)] = int(data[data.rindex(b")") + 2:].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        return parents

    def _scan_descendants(self, pid: int, parents: dict[int, int]) -> set[int]:
        found, todo = set(), [pid]
        while todo:
            parent = todo.pop()
            children = [p for p, pp in parents.items() if pp == parent and p not in found]
            found.update(children)
            todo += children
        return found


@dataclass
class Contention:
    """What other programs used during named spans (e.g. ``fp32``, ``bf16``); raw numbers in."""

    cores: int | None  # CPUs this process may run on
    threads: int | None  # torch's intra-op threads (what the timed code asks for on the CPU)
    wall_s: dict = field(default_factory=dict)  # span -> seconds of wall time, summed
    others_s: dict = field(default_factory=dict)  # span -> CPU-seconds used by other programs (signed sum)
    method: str = ""
    unknown: str | None = None  # why nothing was measured
    # The kernel's 1-minute load average as the meter was made, just before the measured code (``os.getloadavg``):
    # what a window too short for /proc/stat's ticks can still say about a busy machine (a trial's 65 ms profile
    # on a VM at load 3.9 on 2 cores ranked ops by the time slices they lost; its method line said "not measured").
    load_average: float | None = None
    # Under a launch of several ranks on this machine: how many other ranks, and their CPU-seconds per span,
    # kept out of ``others_s`` (the user's own launch is not "other programs").
    sibling_ranks: int = 0
    siblings_s: dict = field(default_factory=dict)

    def likely_contended(self) -> bool:
        """The load average says more tasks wanted to run than there are cores, counting one of this
        process's: others most likely took CPU time, though the window was too short to measure it."""
        return self.load_average is not None and bool(self.cores) and self.load_average >= self.cores + 1

    def others_cores(self, span: str | None = None) -> float | None:
        """Cores other programs kept busy on average during ``span`` (all spans: None), or None when
        not measured or the window is too short to tell (`MIN_WINDOW_S`)."""
        names = list(self.wall_s) if span is None else [span]
        wall = sum(self.wall_s.get(n, 0.0) for n in names)
        if self.unknown or wall < MIN_WINDOW_S:
            return None
        # Clamped: a negative sum (our own ticks rounded up, a counter reset) would say others gave
        # time back, and above the cores there is only rounding.
        return self._cores_of(self.others_s, names, wall)

    def siblings_cores(self, span: str | None = None) -> float | None:
        """Cores the launch's other local ranks kept busy on average during ``span`` (all: None); None
        outside a launch of several ranks, or where `others_cores` is None."""
        names = list(self.wall_s) if span is None else [span]
        wall = sum(self.wall_s.get(n, 0.0) for n in names)
        if not self.sibling_ranks or self.unknown or wall < MIN_WINDOW_S:
            return None
        return self._cores_of(self.siblings_s, names, wall)

    def _cores_of(self, seconds: dict, names: list, wall: float) -> float:
        value = max(0.0, sum(seconds.get(n, 0.0) for n in names) / wall)
        return min(value, float(self.cores)) if self.cores else value

    def slowdown_bound(self, span: str) -> float | None:
        """The most other programs' measured load could have slowed ``span``'s code: its threads had at
        least the cores the others left free, on average, so one thread is slowed by at most 1 / free
        cores, and threads that each had a free core not at all. None when not measured, when the others
        left under a quarter of a core, or when torch's threads outnumbered the free cores: then any
        slowdown is possible, as threads that share a core hold up every parallel region at its barrier
        (a trial's CNN step took 295 ms with 2 threads while another program kept one of 2 cores busy,
        15.8 ms with 1; a threads / free-cores bound of 2x let another trial claim a firm 34.79x)."""
        others = self.others_cores(span)
        if others is None or not self.cores:
            return None
        free = self.cores - others
        threads = min(self.threads or 1, self.cores)
        if free < 0.25 or (threads > 1 and free < threads):
            return None
        return max(1.0, 1 / free) if threads == 1 else 1.0

    def contended_spans(self) -> list[str | None]:
        """The figures (None = all spans together) that reach the threshold: others averaged at
        least `MIN_OTHERS_CORES`, and with torch's threads (and the launch's other ranks, which also
        want cores) they needed more cores than there are, so the scheduler had no idle core to put
        them on."""
        out = []
        for span in [None, *self.wall_s]:
            others = self.others_cores(span)
            ranks = self.siblings_cores(span) or 0.0
            if (others is not None and others >= MIN_OTHERS_CORES
                    and others + ranks + (self.threads or 1) > (self.cores or 1)):
                out.append(span)
        return out

    @property
    def contended(self) -> bool:
        return bool(self.contended_spans())

    def figures(self) -> str:
        """E.g. "0.7 of the 2 CPU cores this process may use (fp32 runs: 1.3, bf16 runs: 0.1)"."""
        total = self.others_cores()
        each = [f"{n} runs: {self.others_cores(n):.1f}" for n in self.wall_s if self.others_cores(n) is not None]
        of = (f"of the {self.cores} CPU core{'s' if self.cores != 1 else ''} this process may use" if self.cores
              else "CPU cores")
        return f"{total:.1f} {of}" + (f" ({', '.join(each)})" if len(each) > 1 else "")

    def summary(self, runs: str = "the timed runs", during: str = "") -> str:
        """For a method line: the figure and how it was made, or why there is none. ``runs`` names
        what was measured, ``during`` follows the figure (%%profile_gpu: " while the cell was profiled")."""
        if self.unknown:
            return f"contention: not measured ({self.unknown})"
        if self.others_cores() is None:
            wall = sum(self.wall_s.values())
            # format_seconds: a tiny step read "lasted 0 ms in all" (a user trial) with a fixed unit
            busy = (f"; the 1-minute load average was {self.load_average:.1f} on {self.cores} cores as they "
                    "began, so other programs were most likely taking CPU time" if self.likely_contended() else "")
            return (f"contention: not measured ({runs} lasted {format_seconds(wall)} in all, under the "
                    f"{MIN_WINDOW_S:g} s that /proc/stat's 10 ms ticks need{busy})")
        return (f"contention: other programs used {self.figures()}{during}, torch using {self.threads} thread{'s' if self.threads != 1 else ''}"
                f"{self._siblings_words()} ({self.method})")

    def _siblings_words(self) -> str:
        """", and this launch's 1 other rank on this machine 1.0 (counted apart)", or ""."""
        cores = self.siblings_cores()
        if cores is None:
            return ""
        n = self.sibling_ranks
        return f", and this launch's {n} other rank{'s' if n != 1 else ''} on this machine {cores:.1f} (counted apart)"

    def to_dict(self) -> dict:
        return {
            "measured": self.unknown is None,
            "unknown": self.unknown,
            "method": self.method,
            "cores": self.cores,
            "torch_threads": self.threads,
            "others_cores": self.others_cores(),
            "spans": {n: {"wall_s": self.wall_s[n], "others_cpu_s": self.others_s.get(n, 0.0),
                          "others_cores": self.others_cores(n), "sibling_ranks_cpu_s": self.siblings_s.get(n, 0.0),
                          "sibling_ranks_cores": self.siblings_cores(n)} for n in self.wall_s},
            "sibling_ranks": self.sibling_ranks,
            "sibling_ranks_cores": self.siblings_cores(),
            "contended": self.contended,
            "threshold_cores": MIN_OTHERS_CORES,
            "min_window_s": MIN_WINDOW_S,
            "load_average": self.load_average,
        }


class ContentionMeter:
    """Measures other programs' CPU use over named spans: ``with meter.span("fp32"): run()``.

    ``reader``: a `ProcReader` (the default). Tests pass scripted functions instead: ``busy()``,
    CPU-seconds the usable cores have been busy; ``ours()``, CPU-seconds of this process and its
    children; ``now()``, wall seconds; with ``cores``; and, for a launch of several local ranks,
    ``siblings()``, CPU-seconds of the other ranks, with their count ``sibling_ranks``. A reader that
    fails turns the measurement into "unknown" with the reason: measuring contention must never break
    the timing it describes.
    """

    def __init__(self, reader: ProcReader | None = None, *, busy: Callable[[], float] | None = None,
                 ours: Callable[[], float] | None = None, now: Callable[[], float] = time.perf_counter,
                 cores: int | None = None, threads: int | None = None, load: Callable[[], float] | None = None,
                 siblings: Callable[[], float] | None = None, sibling_ranks: int = 0):
        unknown, method = None, "injected readers"
        if busy is None or ours is None:
            load = load or _load_average
            reader = reader or ProcReader()
            unknown, method = reader.available(), reader.method
            busy, ours = busy or reader.busy, ours or reader.ours
            cores = cores if cores is not None else (len(reader.cpus) if reader.cpus else None)
            if reader.sibling_ranks and siblings is None:
                siblings, sibling_ranks = reader.siblings, len(reader.sibling_ranks)
        # torch's threads as the measured code ran: read again as each span ends, since the code may set
        # them (a cell's torch.set_num_threads(1) was reported "torch using 2 threads")
        self._threads = None
        if threads is None:
            import torch

            self._threads = torch.get_num_threads
            threads = self._threads()
        self._busy, self._ours, self._now = busy, ours, now
        self._siblings = siblings or (lambda: 0.0)
        # Read once, here: made before the measured code starts, so the reading is not inside a span
        # (the kernel's 1-minute average moves little between here and the first span).
        self.result = Contention(cores=cores, threads=threads, method=method, unknown=unknown,
                                 load_average=load() if load is not None and not unknown else None,
                                 sibling_ranks=sibling_ranks if siblings is not None else 0)

    @contextlib.contextmanager
    def span(self, name: str):
        if self.result.unknown:
            yield
            return
        start = self._read()
        try:
            yield
        finally:
            end = self._read()
            if self._threads is not None:
                self.result.threads = self._threads()
            if start is not None and end is not None:
                # Kept signed and clamped only in the sum (`Contention.others_cores`): a span shorter
                # than a 10 ms tick reads 0 or 10 ms of busy time against our exact CPU time, and
                # clamping each one would keep the +10 ms readings and drop the negative ones --
                # 1 ms spans on a quiet machine read as 0.9 cores of "others" that way.
                wall = end[0] - start[0]
                ranks = end[3] - start[3]
                others = (end[1] - start[1]) - (end[2] - start[2]) - ranks
                self.result.wall_s[name] = self.result.wall_s.get(name, 0.0) + wall
                self.result.others_s[name] = self.result.others_s.get(name, 0.0) + others
                if self.result.sibling_ranks:
                    self.result.siblings_s[name] = self.result.siblings_s.get(name, 0.0) + ranks

    def _read(self):
        try:
            return self._now(), self._busy(), self._ours(), self._siblings()
        except (OSError, ValueError, IndexError) as exc:
            self.result.unknown = f"reading /proc failed: {type(exc).__name__}: {exc}"
            return None


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; a system that cannot tell
        return None


__all__ = ["Contention", "ContentionMeter", "ProcReader", "MIN_OTHERS_CORES", "MIN_WINDOW_S"]


def warning_line(contention: Contention | None, during: str, effect: str, rerun: bool = True) -> str | None:
    """The WARNING line %%amp and %%profile_gpu show when other programs took the CPU (`Contention.contended`:
    `MIN_OTHERS_CORES` and more demand than cores), else None; ``during`` and ``effect`` word it per magic."""
    if contention is None or not contention.contended:
        return None
    return (f"other programs used {contention.figures()} {during}: {effect}"
            + (f"; re-run when the machine is quiet{_fewer_threads(contention)}" if rerun else ""))


def _fewer_threads(contention: Contention) -> str:
    """", or give torch only the cores left free: torch.set_num_threads(1)" where torch's threads outnumber
    them. torch's OpenMP threads wait for each other at every op, so one that shares its core slows them all:
    a trial's CNN step took 295 ms with 2 threads while another program kept 1 of 2 cores busy, 15.8 ms after
    torch.set_num_threads(1)."""
    others = contention.others_cores()
    if others is None or not contention.cores or not contention.threads:
        return ""
    free = max(1, round(contention.cores - others))
    if free >= contention.threads:
        return ""
    return (f", or give torch only the cores left free: torch.set_num_threads({free}) (it uses {contention.threads}; "
            f"torch.set_num_threads({contention.threads}) puts it back)")
