"""Read torch.profiler Chrome traces from disk without holding the whole document in memory.

``json.loads`` of a trace builds a Python dict per event before anything is analysed: about
5-6x the file size in RSS for a 100 MB trace (measured by ``benchmarks/bench_trace.py``), on
top of the tables built from it. Here the file is decoded in chunks and the ``traceEvents``
array is yielded one event at a time (``json.JSONDecoder.raw_decode``, the C scanner, on a
sliding text buffer), so only the current event and the analysis columns are alive.
``.json`` and gzip (by magic bytes, not by suffix) are read as streams.

Every failure is a `TraceError` naming the file and what was wrong: no such file, a directory,
an empty file, binary data, invalid JSON (with the character offset), a truncated gzip stream,
JSON that is not a trace.

Folders: `trace_files` finds ``*.json``/``*.json.gz`` traces and `peek_identity` reads a file's
``distributedInfo`` (rank, world size) and ``deviceProperties`` GPU names cheaply (from the top of
the file, where Kineto writes them; else from the last MiB, where some writers put their header
keys), the rank falling back to the file name (``rank-0.json.gz``, ``*.rank0.*``, ``rank_3``).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import socket
import time
import zlib
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .analysis.trace import TraceError

__all__ = ["TraceStream", "TraceIdentity", "trace_files", "peek_identity", "rank_from_name", "write_trace_bytes"]

_CHUNK = 1 << 20  # characters decoded per read; a Kineto event is at most a few kB
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*,")  # the comma after an event, with nothing cut off before it
_DECODER = json.JSONDecoder()


class TraceStream:
    """One trace file, decoded lazily.

    ``events()`` yields the ``traceEvents`` elements in file order; once it is exhausted,
    ``header`` holds every other top-level key (Kineto writes some before the events and some,
    e.g. ``baseTimeNanoseconds`` or, in TraceLens files, ``deviceProperties``, after them).
    ``peek_header()`` parses only up to the events.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.where = str(path)
        self.header: dict[str, Any] = {}
        self.event_count = 0
        self._check_file()

    def _check_file(self) -> None:
        p = self.path
        if not p.exists():
            raise TraceError(f"{self.where}: no such file")
        if p.is_dir():
            raise TraceError(f"{self.where}: is a directory, expected a .json or .json.gz trace file")
        if p.stat().st_size == 0:
            raise TraceError(f"{self.where}: file is empty, expected a torch.profiler JSON trace")

    # -- low level: a sliding window over the decoded text --

    def _open(self) -> None:
        try:
            raw = open(self.path, "rb")  # noqa: SIM115 - closed in _close
        except OSError as exc:
            raise TraceError(f"{self.where}: cannot read ({exc})") from exc
        self.gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        self._raw = raw
        binary = gzip.GzipFile(fileobj=raw, mode="rb") if self.gzipped else raw
        self._text = io.TextIOWrapper(binary, encoding="utf-8", errors="strict")
        self._buf, self._pos, self._eof, self._consumed = "", 0, False, 0

    def _close(self) -> None:
        try:
            self._text.close()
        finally:
            self._raw.close()

    def _fill(self) -> bool:
        """Append the next chunk to the buffer (dropping what was consumed); False at EOF."""
        if self._eof:
            return False
        try:
            chunk = self._text.read(_CHUNK)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise TraceError(f"{self.where}: truncated or corrupt gzip data ({exc})") from None
        except UnicodeDecodeError as exc:
            raise TraceError(f"{self.where}: not JSON text (binary data: {exc.reason})") from None
        except OSError as exc:
            raise TraceError(f"{self.where}: cannot read ({exc})") from None
        if not chunk:
            self._eof = True
            return False
        self._consumed += self._pos
        self._buf = self._buf[self._pos:] + chunk
        self._pos = 0
        return True

    def _peek(self) -> str:
        """The next non-whitespace character ('' at EOF), without consuming it."""
        while True:
            self._pos = _WS.match(self._buf, self._pos).end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill():
                return ""

    def _expect(self, chars: str, context: str) -> str:
        c = self._peek()
        if c == "" or c not in chars:
            self._bad(f"expected {' or '.join(repr(x) for x in chars)} {context}, found "
                      + (repr(c) if c else "the end of the file"))
        self._pos += 1
        return c

    def _value(self) -> Any:
        """Decode the next JSON value. A value that reaches the end of the buffer is re-read
        with more text, so a number or an object cut by the chunk boundary is never taken."""
        self._peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                if self._fill():
                    continue
                self._bad(exc.msg, self._consumed + exc.pos)
            if end >= len(self._buf) and self._fill():
                continue
            self._pos = end
            return value

    def _bad(self, what: str, offset: int | None = None) -> None:
        at = self._consumed + self._pos if offset is None else offset
        # Only an error at the very end of the data means the file was cut off; `{not json` is just bad.
        at_end = self._eof and (at >= self._consumed + len(self._buf.rstrip()) - 1
                                or what.startswith("Unterminated string"))
        cut = " (the file ends early: a trace cut off while writing looks like this)" if at_end else ""
        # json's own message may end in "at" already ("Unterminated string starting at").
        raise TraceError(f"{self.where}: not valid JSON: {what.removesuffix(' at')} at character {at:,}{cut}")

    # -- the document --

    def _top(self) -> str:
        c = self._peek()
        if c == "":
            raise TraceError(f"{self.where}: file is empty, expected a torch.profiler JSON trace")
        if c not in "{[":
            try:
                kind = type(self._value()).__name__
            except TraceError:
                raise TraceError(f"{self.where}: not JSON text (starts with {c!r})") from None
            raise TraceError(f"{self.where}: JSON is not a torch.profiler trace (top level is {kind}, "
                             "expected an object with 'traceEvents')")
        self._pos += 1
        return c

    def events(self) -> Iterator[Any]:
        """Yield every element of ``traceEvents``; fills ``header`` with the other keys."""
        self._open()
        try:
            top = self._top()
            if top == "[":  # Chrome "JSON Array Format": events only, no header
                yield from self._array(array_format=True)
                return
            seen_events = False
            if self._peek() == "}":
                self._pos += 1
            else:
                while True:
                    key = self._value()
                    if not isinstance(key, str):
                        self._bad("expected a string key")
                    self._expect(":", f"after the key {key!r}")
                    if key == "traceEvents" and self._peek() == "[":
                        self._pos += 1
                        seen_events = True
                        yield from self._array()
                    else:
                        self.header[key] = self._value()
                    if self._expect(",}", "between top-level keys") == "}":
                        break
            if not seen_events:
                found = ", ".join(sorted(map(str, self.header))[:8]) or "no keys"
                what = ("'traceEvents' is not a list" if "traceEvents" in self.header
                        else f"no 'traceEvents' list; found {found}")
                raise TraceError(f"{self.where}: JSON is not a torch.profiler trace ({what})")
            if self._peek() != "":
                self._bad("extra data after the top-level object")
        finally:
            self._close()

    def _array(self, array_format: bool = False) -> Iterator[Any]:
        if self._peek() == "]":
            self._pos += 1
            return
        decode, sep = _DECODER.raw_decode, _SEP.match
        while True:
            # Fast path (almost every event): "<ws>{...}<ws>," decoded straight from the buffer.
            # Anything else -- an event cut by the chunk end, the closing bracket, bad JSON --
            # goes through the careful _value/_expect path.
            buf, pos = self._buf, self._pos
            try:
                ev, end = decode(buf, _WS.match(buf, pos).end())
                m = sep(buf, end)
            except json.JSONDecodeError:
                m = None
            if m is not None:
                self._pos = m.end()
            else:
                ev = self._value()
            if array_format and self.event_count < 50 and not (isinstance(ev, dict) and "ph" in ev):
                raise TraceError(f"{self.where}: JSON is not a torch.profiler trace (a top-level list whose "
                                 f"element {self.event_count} is not a trace event)")
            self.event_count += 1
            yield ev
            if m is None and self._expect(",]", f"after event {self.event_count:,} of traceEvents") == "]":
                return

    def peek_header(self) -> dict[str, Any]:
        """Top-level keys written before ``traceEvents`` (stops there; the file is not read on)."""
        self._open()
        try:
            if self._top() == "[" or self._peek() == "}":
                return {}
            while True:
                key = self._value()
                self._expect(":", f"after the key {key!r}")
                if key == "traceEvents":
                    return self.header
                self.header[key] = self._value()
                if self._expect(",}", "between top-level keys") == "}":
                    return self.header
        finally:
            self._close()

    def tail_text(self, size: int = 1 << 20) -> str:
        """The last ``size`` characters of the decoded text (decompressing a gzip stream through)."""
        self._open()
        try:
            tail = ""
            while self._fill():
                tail = (tail + self._buf)[-size:]
                self._buf, self._pos = "", 0
            return tail
        finally:
            self._close()


# --- folders --------------------------------------------------------------------------------------

_TRACE_NAME = re.compile(r"\.json(\.gz)?$", re.IGNORECASE)
_RANK_NAME = re.compile(r"(?:^|[^a-z0-9])rank[-_.]?(\d+)(?:[^0-9]|$)", re.IGNORECASE)
_DIST_INFO = re.compile(r'"distributedInfo"\s*:\s*(\{[^{}]*\})')
# Kineto's deviceProperties entries hold only scalars: the list ends at the first ']'.
_DEVICE_PROPS = re.compile(r'"deviceProperties"\s*:\s*(\[[^\[\]]*\])')


def trace_files(folder: str | Path) -> list[Path]:
    """The trace files directly in ``folder`` (``*.json``, ``*.json.gz``), sorted by name.

    tensorboard_trace_handler names are ``{worker}.{unix ms}.pt.trace.json``, so name order is
    time order within one worker; HTA's are ``rank-N.json.gz``.
    """
    p = Path(folder).expanduser()
    if not p.exists():
        raise TraceError(f"{folder}: no such file or folder")
    files = sorted(f for f in p.iterdir() if f.is_file() and _TRACE_NAME.search(f.name))
    if not files:
        # A TensorBoard log folder keeps one subfolder per run: name the runs rather than merge them.
        runs = sorted(d.name for d in p.iterdir() if d.is_dir() and any(
            f.is_file() and _TRACE_NAME.search(f.name) for f in d.iterdir()))
        if runs:
            shown = ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
            raise TraceError(f"{folder}: no trace files directly in this folder, but its subfolders {shown} hold "
                             f"some (one run each, as TensorBoard's profiler writes them): load one, e.g. "
                             f"{Path(folder) / runs[0]}")
        others = sorted(f.name for f in p.iterdir())[:5]
        found = f" (found: {', '.join(others)})" if others else " (the folder is empty)"
        raise TraceError(f"{folder}: no trace files (*.json, *.json.gz) in this folder{found}")
    return files


def rank_from_name(name: str) -> int | None:
    m = _RANK_NAME.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TraceIdentity:
    """What a trace file's header says about the run that wrote it, read without its events.

    ``gpus`` are the distinct ``deviceProperties`` names, in order (the GPUs the process saw;
    empty when the file names none): one process writes the same list into every file.
    """

    rank: int | None
    world_size: int | None
    rank_from: str  # "distributedInfo", "file name" or "unknown"
    gpus: tuple[str, ...] = ()


def peek_identity(path: Path) -> TraceIdentity:
    """Rank, world size and GPU names of one trace file, without loading its events.

    Kineto writes these header keys before the events; TraceLens-style writers put them after,
    so when ``distributedInfo`` is not at the top the file's last MiB is searched too.
    """
    stream = TraceStream(path)
    header = stream.peek_header()
    info, props = header.get("distributedInfo"), header.get("deviceProperties")
    if not isinstance(info, dict):
        tail = stream.tail_text()
        info = _json_match(_DIST_INFO, tail)
        if not isinstance(props, list):
            props = _json_match(_DEVICE_PROPS, tail)
    gpus = tuple(dict.fromkeys(str(d["name"]) for d in props if isinstance(d, dict) and d.get("name"))) \
        if isinstance(props, list) else ()
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        ws = info.get("world_size")
        return TraceIdentity(info["rank"], ws if isinstance(ws, int) else None, "distributedInfo", gpus)
    rank = rank_from_name(path.name)
    return TraceIdentity(rank, None, "file name" if rank is not None else "unknown", gpus)


def _json_match(pattern: re.Pattern, text: str):
    """The JSON value ``pattern``'s first group finds in ``text``; None when absent or not JSON."""
    m = pattern.search(text)
    if not m:
        return None
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return None


# --- writing: one file per step ---------------------------------------------------------------

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "memcpy", "memset"}


def split_by_step(doc: dict) -> list[tuple[str, float | None, dict]]:
    """One trace per ``ProfilerStep#N``: (step name, start ts in us, trace dict).

    Host events go to the step whose window contains them; device events (kernels, copies) and
    their flow arrows follow the launch that queued them (same ``correlation``), because a
    kernel queued at the end of step N may run after step N+1 has begun on the host.
    Metadata events (process/thread names) go into every file.
    """
    events = doc.get("traceEvents", [])
    steps = sorted((float(e["ts"]), e["name"]) for e in events
                   if isinstance(e, dict) and e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("ProfilerStep#") and "ts" in e)
    if len(steps) <= 1:
        return [(steps[0][1] if steps else "trace", steps[0][0] if steps else None, doc)]
    starts = [s[0] for s in steps]

    def step_of(ts) -> int:
        return max(bisect_right(starts, float(ts)) - 1, 0)

    buckets: list[list] = [[] for _ in steps]
    common, deferred, corr_step = [], [], {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") == "M" or "ts" not in e:
            common.append(e)
        elif str(e.get("cat", "")).lower() in _DEVICE_CATS or e.get("cat") == "ac2g":
            deferred.append(e)
        else:
            k = step_of(e["ts"])
            buckets[k].append(e)
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                corr_step[corr] = k
    for e in deferred:
        corr = e.get("id") if e.get("cat") == "ac2g" else (e.get("args") or {}).get("correlation")
        buckets[corr_step.get(corr, step_of(e["ts"]))].append(e)
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    return [(name, start, {**header, "traceEvents": common + bucket}) for (start, name), bucket in zip(steps, buckets)]


def write_trace_bytes(data: bytes, path: str | Path) -> None:
    """Write a trace's JSON bytes to ``path``, gzipped for a ``.gz`` name, creating missing folders on
    the way; an OSError says what failed (``--trace`` warns, ``export_chrome_trace`` raises)."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(gzip.compress(data) if str(path).endswith(".gz") else data)


def worker_name() -> str:
    """``{host}_{pid}``: the start of this process's step trace files' names (`write_step_traces`)."""
    return f"{socket.gethostname()}_{os.getpid()}"


def write_step_traces(doc: dict, folder: str) -> list[str]:
    """Write one ``{host}_{pid}.{ms}.pt.trace.json`` per step into ``folder``.

    That is the naming of ``torch.profiler.tensorboard_trace_handler`` (worker name, then a
    millisecond timestamp as the span name), which TensorBoard's profiler plugin and Holistic
    Trace Analysis read. The timestamp is the step's start in Unix milliseconds (from the
    trace's ``baseTimeNanoseconds``), bumped by 1 ms when two steps start in the same millisecond
    so that names stay unique and sort in step order.
    """
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    worker = worker_name()
    base_ms = int(doc.get("baseTimeNanoseconds", 0)) // 1_000_000
    paths, last = [], -1
    for _name, start, part in split_by_step(doc):
        ms = base_ms + int(start // 1000) if start is not None and base_ms else int(time.time() * 1000)
        ms = max(ms, last + 1)
        last = ms
        path = out / f"{worker}.{ms}.pt.trace.json"
        if "traceName" in part:  # the file each step's trace is, not the temporary one Kineto wrote
            part = {**part, "traceName": str(path.resolve())}
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(part, fh)
        paths.append(str(path))
    return paths
