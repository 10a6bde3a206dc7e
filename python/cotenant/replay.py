"""Replay an allocation trace through cotenant's allocator on a simulated GPU.

    cotenant-replay TRACE [TRACE ...] [--device-capacity 16GiB] [--cap 6GiB]
                    [--cap-schedule "1200:4GiB,5000:none"] [--json]
    python -m cotenant.replay ...

A trace is either

* a PyTorch memory snapshot, the pickle ``torch.cuda.memory._dump_snapshot()``
  writes: the actions of its ``device_traces`` are replayed (see
  ``snapshot_ops``), or
* cotenant's JSON-lines format, one operation per line, optionally gzipped::

      {"op": "alloc", "id": 1, "size": 4096, "stream": 0}
      {"op": "free", "id": 1}
      {"op": "record_stream", "id": 1, "stream": 7}
      {"op": "cap", "bytes": "6GiB"}          (null removes the cap)
      {"op": "empty_cache"}
      {"op": "iteration"}                      (the end of one step of the job's loop)
      {"op": "meta", ...}                      (ignored: where the trace came from)

Sizes are ints of bytes or strings such as "6GiB" (the one size parser,
``cotenant._core.parse_size``). Blank lines and lines starting with ``#`` are
skipped.

The tool prints peak allocated and reserved bytes, fragmentation (peak
reserved / peak allocated), bytes spilled to the host and restored, page
migrations, driver page maps and unmaps, the per-iteration figures of a trace
with iteration marks, and nanoseconds per alloc and per free measured inside
the C++ allocator. For a snapshot whose trace has segment events it prints
PyTorch's own allocator beside cotenant's (see ``Trace.pytorch``). Errors in
a trace name the file and line; the exit code is 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "Trace",
    "TraceError",
    "load_trace",
    "parse_cap_schedule",
    "snapshot_ops",
    "replay_trace",
    "format_table",
    "main",
]

Op = Tuple[Any, ...]

_GZIP_MAGIC = b"\x1f\x8b"
_PICKLE_PROTOCOL_2_OR_LATER = b"\x80"
_NOT_A_TRACE = (
    "this is not a cotenant trace (JSON lines, optionally gzipped) or a PyTorch memory "
    "snapshot pickle (torch.cuda.memory._dump_snapshot())"
)


def _core():
    try:
        from cotenant import _core
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(
            f"cotenant's compiled module _core is missing ({error}); build it with "
            "`pip install --no-build-isolation .` in the source tree"
        ) from None
    return _core


class TraceError(ValueError):
    """A trace file cannot be read or replayed. ``where`` names the line or entry."""

    def __init__(self, path: str, where: Optional[str], problem: str):
        self.path = path
        self.where = where
        self.problem = problem
        location = f"{path}, {where}" if where else path
        super().__init__(f"{location}: {problem}")


@dataclass
class Trace:
    """Operations ready for ``cotenant._core.replay`` and where each came from."""

    path: str
    format: str  # "jsonl" or "snapshot"
    ops: List[Op] = field(default_factory=list)
    origins: List[str] = field(default_factory=list)  # "line 17", "device trace entry 3", ...
    # A snapshot's figures for PyTorch's own allocator over the same trace
    # (see ``_pytorch_figures``); None for JSON lines, which record no segments.
    pytorch: Optional[Dict[str, Any]] = None

    def add(self, op: Op, origin: str) -> None:
        self.ops.append(op)
        self.origins.append(origin)


# ---- reading ------------------------------------------------------------------


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise TraceError(path, None, f"cannot open the trace: {error.strerror}") from None
    if raw.startswith(_GZIP_MAGIC):
        # Member by member (gzip allows several), so that a truncated stream is
        # told apart from a corrupt one.
        chunks = []
        rest = raw
        try:
            while rest:
                decompressor = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
                chunks.append(decompressor.decompress(rest))
                if not decompressor.eof:
                    complete_lines = b"".join(chunks).count(b"\n")
                    raise TraceError(
                        path, None,
                        f"the gzip stream ends early: the file is truncated after line {complete_lines}; "
                        "copy or generate it again",
                    )
                rest = decompressor.unused_data
        except zlib.error as error:
            raise TraceError(path, None, f"the gzip data is corrupt ({error}); {_NOT_A_TRACE}") from None
        return b"".join(chunks)
    return raw


def load_trace(path: Union[str, os.PathLike]) -> Trace:
    """Reads a JSON-lines trace (plain or .gz) or a PyTorch memory snapshot pickle."""
    path = os.fspath(path)
    data = _read_bytes(path)
    if data.startswith(_PICKLE_PROTOCOL_2_OR_LATER):
        return _load_snapshot(path, data)
    return _load_jsonl(path, data)


def _size_field(core, path: str, where: str, record: Dict[str, Any], key: str, allow_none: bool = False):
    if key not in record:
        raise TraceError(path, where, f'the "{record.get("op")}" op needs a "{key}" field')
    value = record[key]
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TraceError(
            path, where,
            f'"{key}" must be an int of bytes or a size string like "6GiB", not {json.dumps(value)}',
        )
    if isinstance(value, int):
        if value < 0:
            raise TraceError(path, where, f'"{key}" cannot be negative (got {value})')
        if value >= 2**64:
            raise TraceError(path, where, f'"{key}" is too large (got {value}; the most is 2**64-1 bytes)')
        return value
    try:
        return core.parse_size(value)
    except core.Error as error:
        raise TraceError(path, where, str(error)) from None


def _int_field(path: str, where: str, record: Dict[str, Any], key: str, default: Optional[int] = None) -> int:
    if key not in record:
        if default is not None:
            return default
        raise TraceError(path, where, f'the "{record.get("op")}" op needs an "{key}" field')
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise TraceError(path, where, f'"{key}" must be an integer from 0 to 2**64-1, not {json.dumps(value)}')
    return value


def _load_jsonl(path: str, data: bytes) -> Trace:
    core = _core()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(path, None, f"the file is not UTF-8 text; {_NOT_A_TRACE}") from None
    trace = Trace(path=path, format="jsonl")
    lines = text.split("\n")
    ends_with_newline = text.endswith("\n")
    seen_record = False
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"line {number}"
        try:
            record = json.loads(stripped)
        except json.JSONDecodeError:
            if not seen_record:
                raise TraceError(path, where, f"the line is not JSON; {_NOT_A_TRACE}") from None
            if number == len(lines) and not ends_with_newline:
                raise TraceError(path, where, "the last line is cut off: the file is truncated") from None
            raise TraceError(path, where, "the line is not valid JSON") from None
        if not isinstance(record, dict) or "op" not in record:
            if not seen_record:
                raise TraceError(path, where, f'the line has no "op" field; {_NOT_A_TRACE}')
            raise TraceError(path, where, 'each line must be a JSON object with an "op" field')
        seen_record = True
        op = record["op"]
        if op == "alloc":
            trace.add(
                ("alloc", _int_field(path, where, record, "id"), _size_field(core, path, where, record, "size"),
                 _int_field(path, where, record, "stream", default=0)),
                where,
            )
        elif op == "free":
            trace.add(("free", _int_field(path, where, record, "id")), where)
        elif op == "record_stream":
            trace.add(("record_stream", _int_field(path, where, record, "id"),
                       _int_field(path, where, record, "stream")), where)
        elif op == "cap":
            key = "bytes" if "bytes" in record or "size" not in record else "size"
            cap = _size_field(core, path, where, record, key, allow_none=True)
            if cap == 0:
                raise TraceError(path, where, "a cap of 0 bytes is refused; give a positive size, or null for no cap")
            trace.add(("cap", cap), where)
        elif op == "empty_cache":
            trace.add(("empty_cache",), where)
        elif op == "iteration":
            trace.add(("iteration",), where)
        elif op == "meta":
            continue
        else:
            raise TraceError(
                path, where,
                f"unknown op {json.dumps(op)}; the ops are alloc, free, record_stream, cap, empty_cache, "
                "iteration, meta",
            )
    if not seen_record:
        raise TraceError(path, None, f"the file holds no operations; {_NOT_A_TRACE}")
    return trace


# ---- PyTorch memory snapshots -------------------------------------------------


class _PlainDataUnpickler(pickle.Unpickler):
    """A snapshot is plain dicts, lists, strings and numbers: refuse anything
    that would import code, so opening a file cannot run it."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the pickle refers to {module}.{name}")


def _load_snapshot(path: str, data: bytes) -> Trace:
    try:
        snapshot = _PlainDataUnpickler(io.BytesIO(data)).load()
    except EOFError:
        raise TraceError(path, None, "the pickle ends early: the file is truncated") from None
    except Exception as error:  # pickle raises many types for foreign or corrupt data
        raise TraceError(path, None, f"cannot read the pickle ({error}); {_NOT_A_TRACE}") from None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise TraceError(path, None, f'the pickle has no "device_traces" list; {_NOT_A_TRACE}')
    return snapshot_ops(snapshot, path=path)


def snapshot_ops(snapshot: Dict[str, Any], path: str = "<snapshot>", device: Optional[int] = None) -> Trace:
    """Turns a PyTorch memory snapshot's device trace into replay operations.

    ``device`` picks ``device_traces[device]``; by default the first device
    whose trace is not empty. The mapping:

    * ``alloc`` -> alloc (the block's address names it until it is freed);
    * ``free_completed`` (and ``free`` in older snapshots) -> free: the moment
      PyTorch's allocator got the block back, after any ``record_stream``
      events; ``free_requested`` is ignored because the block is not reusable
      yet;
    * ``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``:
      not replayed, they are PyTorch's allocator's own decisions, which
      cotenant's replaces; they give PyTorch's figures (``Trace.pytorch``);
      ``snapshot`` and ``oom`` markers are ignored.

    Iteration marks come from the snapshot's ``external_annotations``, which
    PyTorch records when history is turned on with
    ``global_record_annotations=True``: the end of each
    ``record_function("cotenant::iteration")`` range (what
    scripts/make_traces.py wraps each pass in), or, when there is none, the
    end of each ``optimizer.step()`` (PyTorch names its range
    ``Optimizer.step#<class>.step``). A mark goes before the first trace
    entry recorded after the range's end; an entry in the same microsecond
    counts as before it. Without annotations the replay has no iteration
    ops, and the allocator's step plan and cold-page rule, which act at
    iteration marks, do not run.

    The trace is a ring buffer (``max_entries``), so it may begin mid-run. A
    block freed in it but allocated before it began is allocated at the start
    of the replay, with the size its free reports. When the snapshot's segment
    list (the state at the dump) agrees with the trace's end, the blocks live
    at the dump that the trace never mentions were live all through it: they
    are allocated at the start too, with their requested sizes.
    """
    events = _device_trace(snapshot, path, device)
    if not isinstance(snapshot.get("external_annotations") or [], list):
        raise TraceError(path, None, f'the snapshot\'s "external_annotations" is not a list; {_NOT_A_TRACE}')
    blocks = _walk_blocks(events, path, _iteration_marks(snapshot, device))
    if not any(op[0] != "iteration" for op, _ in blocks.body):
        raise TraceError(path, None, "the snapshot's device trace has no alloc or free actions")
    segments = _walk_segments(events, path)
    dump = _dump_state(snapshot, device if device is not None else _first_traced_device(snapshot))
    live_all_through = _blocks_live_all_through(dump, blocks, segments) if dump else None
    for size, stream in live_all_through or ():
        blocks.allocated_before(size, stream, "the snapshot's segment list (a block live at the dump, "
                                              "allocated before the trace began)")

    trace = Trace(path=path, format="snapshot")
    for op, where in blocks.prologue + blocks.body:
        trace.add(op, where)
    live_before = sum(op[2] for op, _ in blocks.prologue)
    trace.pytorch = _pytorch_figures(segments, dump, live_all_through is not None, live_before,
                                    _peak_live_bytes(trace.ops))
    return trace


def _first_traced_device(snapshot: Dict[str, Any]) -> int:
    # A trace that is not a list counts as traced, so that _device_trace refuses it.
    traces = snapshot.get("device_traces") or []
    return next((i for i, t in enumerate(traces) if t or (t is not None and not isinstance(t, list))), 0)


# Annotation ranges whose end is an iteration mark, in order of preference:
# the first name (a prefix) that any annotation has is the one used.
_ITERATION_ANNOTATIONS = ("cotenant::iteration", "Optimizer.step#")


def _iteration_marks(snapshot: Dict[str, Any], device: Optional[int]) -> List[int]:
    """The times (microseconds) at which the snapshot's iteration ranges end, in order."""
    if device is None:
        device = _first_traced_device(snapshot)
    ends: Dict[str, List[int]] = {prefix: [] for prefix in _ITERATION_ANNOTATIONS}
    for annotation in snapshot.get("external_annotations") or []:
        if not isinstance(annotation, dict) or annotation.get("stage") != "END":
            continue
        name, when = annotation.get("name"), annotation.get("time_us")
        if not isinstance(name, str) or not isinstance(when, int) or annotation.get("device", device) != device:
            continue
        prefix = next((p for p in _ITERATION_ANNOTATIONS if name.startswith(p)), None)
        if prefix is not None:
            ends[prefix].append(when)
    return sorted(next((times for times in ends.values() if times), []))


def _device_trace(snapshot: Dict[str, Any], path: str, device: Optional[int]) -> List[Any]:
    traces = snapshot.get("device_traces") or []
    if device is None:
        device = _first_traced_device(snapshot)
    if device < len(traces) and traces[device] is not None and not isinstance(traces[device], list):
        raise TraceError(path, None, f"the snapshot's device_traces[{device}] is not a list of trace entries; "
                         f"{_NOT_A_TRACE}")
    if device >= len(traces) or not traces[device]:
        raise TraceError(path, None, "the snapshot's device trace is empty: record it with "
                         "torch.cuda.memory._record_memory_history() before the work you want to replay")
    events = traces[device]
    for index, event in enumerate(events):
        if not isinstance(event, dict) or "action" not in event:
            raise TraceError(path, f"device trace entry {index}", f'an entry without an "action"; {_NOT_A_TRACE}')
    return events


def _stream_of(record: Dict[str, Any]) -> int:
    stream = record.get("stream", 0)
    return stream if isinstance(stream, int) and stream >= 0 else 0


@dataclass
class _BlockWalk:
    """A device trace's alloc and free actions as replay ops, followed by address."""

    prologue: List[Tuple[Op, str]] = field(default_factory=list)  # blocks allocated before the trace began
    body: List[Tuple[Op, str]] = field(default_factory=list)
    live: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # address -> (id, requested bytes)
    freed: Dict[int, int] = field(default_factory=dict)  # address -> id of the last block freed there
    next_id: int = 1

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def allocated_before(self, size: int, stream: int, where: str) -> int:
        block_id = self.new_id()
        self.prologue.append((("alloc", block_id, size, stream), where))
        return block_id


def _walk_blocks(events: List[Dict[str, Any]], path: str, marks: Sequence[int] = ()) -> _BlockWalk:
    """The alloc and free actions as ops, with an iteration op at each of
    ``marks`` (times in microseconds) that falls inside the trace."""
    walk = _BlockWalk()
    times = [event.get("time_us") for event in events]
    marks = list(marks) if times and all(isinstance(when, int) for when in times) else []
    next_mark = next((i for i, when in enumerate(marks) if when >= times[0]), len(marks)) if marks else 0
    for index, event in enumerate(events):
        while next_mark < len(marks) and times[index] > marks[next_mark]:
            walk.body.append((("iteration",), f"the iteration range that ends before device trace entry {index}"))
            next_mark += 1
        action = event["action"]
        if action not in ("alloc", "free_completed", "free"):
            continue
        where = f"device trace entry {index}"
        address, size, stream = event.get("addr"), event.get("size"), event.get("stream", 0)
        if not isinstance(address, int) or not isinstance(size, int) or size < 0:
            raise TraceError(path, where, f'"{action}" needs an integer "addr" and "size"')
        if size >= 2**64:
            raise TraceError(path, where, f'"size" is too large (got {size}; the most is 2**64-1 bytes)')
        if isinstance(stream, int) and stream >= 2**64:
            raise TraceError(path, where, f'"stream" must be below 2**64, not {stream}')
        if action == "alloc":
            block_id = walk.new_id()
            walk.live[address] = (block_id, size)
            walk.body.append((("alloc", block_id, size, _stream_of(event)), where))
        elif address in walk.live:
            block_id, _ = walk.live.pop(address)
            walk.body.append((("free", block_id), where))
            walk.freed[address] = block_id
        elif address in walk.freed:
            # A second free of the same block: let the replay refuse it with this entry's position.
            walk.body.append((("free", walk.freed[address]), where))
        else:
            block_id = walk.allocated_before(size, _stream_of(event),
                                             f"{where} (a block allocated before the trace began)")
            walk.body.append((("free", block_id), where))
            walk.freed[address] = block_id
    for _ in range(next_mark, len(marks)):
        walk.body.append((("iteration",), "an iteration range that ends after the device trace's last entry"))
    return walk


# How each segment action changes PyTorch's reserved bytes: segment_alloc and
# segment_free are cudaMalloc and cudaFree of a whole segment; segment_map and
# segment_unmap map and unmap pages of an expandable segment.
_SEGMENT_ACTIONS = {"segment_alloc": +1, "segment_free": -1, "segment_map": +1, "segment_unmap": -1}


@dataclass
class _SegmentWalk:
    """PyTorch's reserved bytes over a device trace, relative to its start.

    Reserved bytes hold the live ones at every moment, so the trace also
    bounds what was reserved when it began: at least ``-lowest_bytes``, and at
    least the bytes live then plus ``live_excess_bytes``.
    """

    counts: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SEGMENT_ACTIONS, 0))
    net_bytes: int = 0          # reserved at the trace's end minus at its start
    lowest_bytes: int = 0       # the least reserved minus at the start (0 or less)
    highest_bytes: int = 0      # the most reserved minus at the start (0 or more)
    live_excess_bytes: int = 0  # the most that live bytes grew beyond reserved ones since the start (0 or more)

    def least_start_reserve(self, live_at_start: int) -> int:
        return max(-self.lowest_bytes, live_at_start + self.live_excess_bytes)


def _walk_segments(events: List[Dict[str, Any]], path: str) -> _SegmentWalk:
    walk = _SegmentWalk()
    live_bytes = 0  # live now minus at the start, in requested sizes as the trace records them
    for index, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            live_bytes += event["size"]
        elif action in ("free_completed", "free"):
            live_bytes -= event["size"]
        elif action in _SEGMENT_ACTIONS:
            size = event.get("size")
            if not isinstance(size, int) or size < 0:
                raise TraceError(path, f"device trace entry {index}", f'"{action}" needs an integer "size"')
            walk.counts[action] += 1
            walk.net_bytes += _SEGMENT_ACTIONS[action] * size
            walk.lowest_bytes = min(walk.lowest_bytes, walk.net_bytes)
            walk.highest_bytes = max(walk.highest_bytes, walk.net_bytes)
        walk.live_excess_bytes = max(walk.live_excess_bytes, live_bytes - walk.net_bytes)
    return walk


# Block states in a segment list that the trace has not seen a free_completed for.
_LIVE_BLOCK_STATES = ("active_allocated", "active_pending_free")


@dataclass
class _DumpState:
    """One device at the dump, from the snapshot's segment list."""

    reserved_bytes: int  # the sum of its segments' sizes (mapped bytes, for expandable segments)
    live_blocks: Dict[int, Tuple[int, int]]  # address -> (requested bytes, stream)


def _dump_state(snapshot: Dict[str, Any], device: int) -> Optional[_DumpState]:
    """None when the snapshot has no segment list, or one not shaped as torch writes it."""
    segments = snapshot.get("segments")
    if not isinstance(segments, list):
        return None
    state = _DumpState(reserved_bytes=0, live_blocks={})
    try:
        for segment in segments:
            if segment.get("device", device) != device:
                continue
            state.reserved_bytes += int(segment["total_size"])
            address = int(segment["address"])
            for block in segment.get("blocks", []):
                address = int(block.get("address", address))
                if block.get("state") in _LIVE_BLOCK_STATES:
                    requested = int(block.get("requested_size", block["size"]))
                    state.live_blocks[address] = (requested, _stream_of(segment))
                address += int(block["size"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return state


def _blocks_live_all_through(dump: _DumpState, blocks: _BlockWalk,
                             segments: _SegmentWalk) -> Optional[List[Tuple[int, int]]]:
    """The blocks live at the dump that the trace never mentions, as (requested
    bytes, stream): allocated before it began and live all through it. None
    when the segment list cannot be the state at the trace's end.

    It is when recording was still on at the dump (the documented order:
    ``_dump_snapshot`` before ``_record_memory_history(enabled=None)``). The
    checks: each block live at the trace's end is live at the dump with the
    same requested size; no block live at the dump sits where the trace freed
    a block and allocated none after; and the reserved bytes this implies at
    the trace's start are enough for what the trace shows (never negative,
    never below the live bytes).
    """
    for address, (_, size) in blocks.live.items():
        if address not in dump.live_blocks or dump.live_blocks[address][0] != size:
            return None
    unseen = []
    for address, (size, stream) in sorted(dump.live_blocks.items()):
        if address in blocks.freed and address not in blocks.live:
            return None
        if address not in blocks.live:
            unseen.append((size, stream))
    live_at_start = sum(op[2] for op, _ in blocks.prologue) + sum(size for size, _ in unseen)
    if dump.reserved_bytes - segments.net_bytes < segments.least_start_reserve(live_at_start):
        return None
    return unseen


def _peak_live_bytes(ops: Iterable[Op]) -> int:
    """The most bytes allocated and not yet freed at once, in the sizes the ops
    ask for: what a job needs, whichever allocator serves it."""
    sizes: Dict[int, int] = {}
    live = peak = 0
    for op in ops:
        if op[0] == "alloc":
            sizes[op[1]] = op[2]
            live += op[2]
            peak = max(peak, live)
        elif op[0] == "free":
            live -= sizes.pop(op[1], 0)
    return peak


def _pytorch_figures(segments: _SegmentWalk, dump: Optional[_DumpState], dump_agrees: bool, live_before: int,
                    peak_live: int) -> Dict[str, Any]:
    """PyTorch's own allocator over a snapshot's trace, from its segment events.

    ``peak_reserved_bytes`` is the most PyTorch held from the driver at once
    (segments, or mapped pages of expandable segments) within the trace,
    counting what was reserved when it began; ``fragmentation`` is that over
    ``peak_live_bytes``, the most bytes allocated and not yet freed at once in
    the replay's ops (requested sizes, as the trace records them), so that
    cotenant's figure over the same peak compares on equal terms.

    ``start`` says what was reserved when the trace began: "empty" (nothing:
    the trace covers the run from its start), "reconstructed" (the segment
    list at the dump less what the trace's segment events added), or
    "unknown" (no usable segment list: the least reserve the trace implies,
    so the peak is a lower bound over the traced window).
    """
    if not any(segments.counts.values()):
        return {"available": False,
                "reserved_at_dump_bytes": dump.reserved_bytes if dump else None,
                "reason": "no segment events in the snapshot's trace (segment_alloc/free, or segment_map/unmap "
                          "with expandable segments): PyTorch's own reserved bytes over it are unknown"}
    if dump_agrees:
        start_reserved = dump.reserved_bytes - segments.net_bytes
        start = "empty" if start_reserved == 0 and live_before == 0 else "reconstructed"
    else:
        start_reserved = segments.least_start_reserve(live_before)
        start = "unknown"
    peak_reserved = start_reserved + segments.highest_bytes
    return {
        "available": True,
        "start": start,
        "start_note": _start_note(start, dump, start_reserved, live_before),
        "start_reserved_bytes": start_reserved,
        "start_live_bytes": live_before,
        "reserved_at_dump_bytes": dump.reserved_bytes if dump else None,
        "peak_reserved_bytes": peak_reserved,
        "peak_live_bytes": peak_live,
        "fragmentation": peak_reserved / peak_live if peak_live else 0.0,
        "num_cuda_mallocs": segments.counts["segment_alloc"],
        "num_cuda_frees": segments.counts["segment_free"],
        "num_segment_maps": segments.counts["segment_map"],
        "num_segment_unmaps": segments.counts["segment_unmap"],
    }


def _start_note(start: str, dump: Optional[_DumpState], start_reserved: int, live_before: int) -> str:
    size = _core().format_size
    if start == "empty":
        return "the trace begins with nothing reserved: it covers the run from its start"
    if start == "reconstructed":
        return (f"the trace begins mid-run, with {size(start_reserved)} reserved and {size(live_before)} live: "
                "reconstructed from the segment list at the dump; both sides replay those live blocks")
    why = ("the snapshot has no segment list" if dump is None
           else "the segment list at the dump does not match the trace's end (recording stopped before the dump?)")
    return (f"{why}, so what was reserved before the trace began is unknown: PyTorch's peak is over the "
            f"traced window, from the least reserve the trace implies ({size(start_reserved)}), a lower bound")


# ---- cap schedules --------------------------------------------------------------


def parse_cap_schedule(text: str) -> List[Tuple[int, Optional[int]]]:
    """"OPINDEX:SIZE,..." (or a file holding that, with commas or newlines) ->
    [(op index, cap bytes or None)]. The cap applies before the trace's op with
    that 0-based index; SIZE "none" removes the cap."""
    core = _core()
    source = text
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as f:
                source = f.read()
        except UnicodeDecodeError:
            raise ValueError(f"the cap schedule file {text} is not UTF-8 text; it holds OPINDEX:SIZE entries "
                             'separated by commas or newlines, e.g. "1200:4GiB"') from None
    schedule = []
    entries = [e.strip() for e in source.replace("\n", ",").split(",")]
    for entry in entries:
        if not entry or entry.startswith("#"):
            continue
        index_text, sep, size_text = entry.partition(":")
        if not sep or not index_text.strip().isdigit():
            raise ValueError(
                f'cannot read cap schedule entry "{entry}": write OPINDEX:SIZE, e.g. "1200:4GiB" '
                '(the cap applies before op 1200) or "5000:none" to remove it'
            )
        size_text = size_text.strip()
        if size_text.lower() == "none":
            cap = None
        else:
            try:
                cap = core.parse_size(size_text)
            except core.Error as error:
                raise ValueError(f'cap schedule entry "{entry}": {error}') from None
            if cap == 0:
                raise ValueError(f'cap schedule entry "{entry}": a cap of 0 bytes is refused; use a positive size')
        schedule.append((int(index_text), cap))
    return sorted(schedule, key=lambda item: item[0])


def _with_schedule(trace: Trace, schedule: Sequence[Tuple[int, Optional[int]]]) -> Tuple[List[Op], List[str]]:
    ops: List[Op] = []
    origins: List[str] = []
    pending = list(schedule)
    for index, (op, origin) in enumerate(zip(trace.ops, trace.origins)):
        while pending and pending[0][0] <= index:
            at, cap = pending.pop(0)
            ops.append(("cap", cap))
            origins.append(f"--cap-schedule entry {at}:{cap}")
        ops.append(op)
        origins.append(origin)
    if pending:
        raise TraceError(trace.path, None, f"the cap schedule names op {pending[0][0]}, but the trace has only "
                         f"{len(trace.ops)} ops (indices 0 to {len(trace.ops) - 1})")
    return ops, origins


# ---- replaying ------------------------------------------------------------------


def replay_trace(
    trace: Trace,
    *,
    device_capacity: Union[int, str] = "16GiB",
    granularity: Union[int, str] = "2MiB",
    cap: Union[int, str, None] = None,
    cap_schedule: Sequence[Tuple[int, Optional[int]]] = (),
    host_capacity: Union[int, str] = "1TiB",
) -> Dict[str, Any]:
    """Replays a loaded trace; returns the figures (see ``cotenant._core.replay``)."""
    core = _core()
    ops, origins = _with_schedule(trace, cap_schedule)
    try:
        result = core.replay(ops, device_capacity=device_capacity, granularity=granularity,
                             host_capacity=host_capacity, cap=cap)
    except core.ReplayError as error:
        where = origins[error.op_index] if error.op_index < len(origins) else None
        raise TraceError(trace.path, where, error.reason) from None
    result["trace"] = trace.path
    result["format"] = trace.format
    result["device_capacity_bytes"] = core.parse_size(device_capacity) if isinstance(device_capacity, str) else device_capacity
    result["granularity_bytes"] = core.parse_size(granularity) if isinstance(granularity, str) else granularity
    result["initial_cap_bytes"] = core.parse_size(cap) if isinstance(cap, str) else cap
    result["cap_schedule"] = [[index, bytes_] for index, bytes_ in cap_schedule]
    result["pytorch"] = _beside_pytorch(trace.pytorch, result)
    return result


def _beside_pytorch(pytorch: Optional[Dict[str, Any]], result: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """PyTorch's figures, with cotenant's peak reserved over the same peak of
    live bytes (``cotenant_fragmentation``) to compare with PyTorch's."""
    if pytorch is None or not pytorch["available"]:
        return pytorch
    live = pytorch["peak_live_bytes"]
    return {**pytorch, "cotenant_fragmentation": result["peak_reserved_bytes"] / live if live else 0.0}


@dataclass
class _Row:
    """One line of the report table."""

    name: str
    value: str                     # cotenant's figure
    pytorch: Optional[str] = None  # PyTorch's figure beside it, where the trace gives one
    note: str = ""                 # what the figure means
    spans: bool = False            # a line of its own, outside the cotenant / PyTorch columns


def format_table(result: Dict[str, Any]) -> str:
    """The report of one replay: cotenant's figures, and PyTorch's beside them
    when the trace is a snapshot with segment events."""
    pytorch = result.get("pytorch")
    side_by_side = bool(pytorch and pytorch["available"])
    rows = _figure_rows(result, pytorch if side_by_side else None)
    if pytorch and not side_by_side:
        rows.append(_Row("PyTorch", _no_segment_events_line(pytorch), spans=True))
    return _render(rows, side_by_side)


def _figure_rows(result: Dict[str, Any], pytorch: Optional[Dict[str, Any]]) -> List[_Row]:
    size = _core().format_size
    cap = result.get("initial_cap_bytes")
    rows = [
        _Row("trace", f'{result["trace"]} ({result["format"]}, {result["num_ops"]} ops)', spans=True),
        _Row("device", f'{size(result["device_capacity_bytes"])}, {size(result["granularity_bytes"])} pages, '
                       f'cap {size(cap) if cap else "none"}'
                       + (f', {len(result["cap_schedule"])} scheduled cap changes' if result["cap_schedule"] else ""),
             spans=True),
    ]
    rows += _peak_rows(result, pytorch) + _at_peak_rows(result) + _spill_rows(result) + _driver_rows(result, pytorch)
    rows += _iteration_rows(result) + [
        _Row("ns/alloc", f'{result["ns_per_alloc"]:.0f}', note=f'({result["num_allocs"]} allocs)'),
        _Row("ns/free", f'{result["ns_per_free"]:.0f}', note=f'({result["num_frees"]} frees)'),
        _Row("OOMs", str(result["num_ooms"])),
    ]
    return rows + ([_Row("PyTorch start", pytorch["start_note"], spans=True)] if pytorch else [])


def _peak_rows(result: Dict[str, Any], pytorch: Optional[Dict[str, Any]]) -> List[_Row]:
    size = _core().format_size
    fragmentation = _Row("fragmentation", f'{result["fragmentation"]:.3f}', note="(peak reserved / peak allocated)")
    if not pytorch:
        return [_Row("peak allocated", size(result["peak_allocated_bytes"])),
                _Row("peak reserved", size(result["peak_reserved_bytes"])), fragmentation]
    live = size(pytorch["peak_live_bytes"])
    return [
        _Row("", "cotenant", "PyTorch"),
        _Row("peak live", live, live, "(requested bytes not yet freed, from the trace: the same for both)"),
        _Row("peak allocated", size(result["peak_allocated_bytes"]), note="(cotenant's blocks, rounded up to 512 B)"),
        _Row("peak reserved", size(result["peak_reserved_bytes"]), _pytorch_peak(pytorch)),
        _Row("reserved / live", f'{pytorch["cotenant_fragmentation"]:.3f}', f'{pytorch["fragmentation"]:.3f}',
             "(peak reserved / peak live: fragmentation on equal terms; lower is better)"),
        fragmentation,
    ]


def _at_peak_rows(result: Dict[str, Any]) -> List[_Row]:
    """Where peak reserved memory went, and the least fragmentation whole pages allow."""
    if result["peak_reserved_bytes"] == 0:
        return []
    size = _core().format_size
    return [
        _Row("fragmentation floor", f'{result["fragmentation_floor"]:.3f}',
             note="(peak allocated rounded up to whole pages: no placement goes below it)"),
        _Row("at peak reserved",
             f'{size(result["at_peak_live_bytes"])} live + {size(result["at_peak_partial_page_free_bytes"])} free in '
             f'used pages + {size(result["at_peak_free_page_bytes"])} in free pages',
             note=f'(reached by a {size(result["at_peak_request_bytes"])} allocation; '
                  f'largest hole then {size(result["at_peak_largest_hole_bytes"])})'),
    ]


def _spill_rows(result: Dict[str, Any]) -> List[_Row]:
    size = _core().format_size
    return [
        _Row("peak on device", size(result["peak_device_resident_bytes"])),
        _Row("host allocations", str(result["num_spilled_allocations"]),
             note="(placed on the host when made: no room under the cap)"),
        _Row("bytes spilled", size(result["spilled_bytes"])),
        _Row("bytes restored", size(result["restored_bytes"])),
        _Row("migrations", str(result["num_migrations"]), note=f'(page moves, in {result["num_safe_points"]} safe points)'),
    ]


def _driver_rows(result: Dict[str, Any], pytorch: Optional[Dict[str, Any]]) -> List[_Row]:
    if pytorch:
        maps_note, unmaps_note = ("(driver allocations: a page each for cotenant, a call each for PyTorch)",
                                  "(driver releases, counted the same way)")
    else:
        maps_note, unmaps_note = "(pages the driver mapped for allocations)", "(pages unmapped and released)"
    return [
        _Row("page maps", str(result["num_page_maps"]), pytorch and _pytorch_calls(pytorch, "maps"), maps_note),
        _Row("page unmaps", str(result["num_page_unmaps"]), pytorch and _pytorch_calls(pytorch, "unmaps"), unmaps_note),
        _Row("maps per peak page", f'{result["maps_per_peak_page"]:.2f}',
             note="(page maps / pages of peak reserved; 1 is the least, lower is better)"),
    ]


def _iteration_rows(result: Dict[str, Any]) -> List[_Row]:
    marks = result["num_iterations"]
    if marks < 2:
        why = "(the trace has no iteration marks)" if marks == 0 else "(steady figures need 2 iteration marks)"
        return [_Row("iterations", str(marks), note=why)]
    host_bytes = _core().format_size(int(round(result["steady_host_touched_bytes_per_iteration"])))
    moved_bytes = _core().format_size(int(round(result["steady_moved_bytes_per_iteration"])))
    live_bytes = _core().format_size(int(round(result["steady_host_live_bytes"])))
    live_floor = _core().format_size(int(round(result["steady_host_live_floor_bytes"])))
    return [
        _Row("iterations", str(marks), note=f"(steady figures: the mean over the last {max(1, marks // 2)})"),
        _Row("maps per iteration", f'{result["steady_maps_per_iteration"]:.2f}', note="(steady; 0 is the target)"),
        _Row("host bytes per iteration", host_bytes,
             note="(steady: live bytes on host pages that allocs and frees touched; lower is better)"),
        _Row("live bytes on the host", f"{live_bytes} (floor {live_floor})",
             note="(steady: live bytes on host pages, the mean over a step's ops, which kernels read across the "
                  "bus; the floor: live bytes over the cap; lower is better)"),
        _Row("bytes moved per iteration", moved_bytes,
             note="(steady: page moves to the host and back, each a copy; lower is better)"),
        _Row("safe points per iteration", f'{result["steady_safe_points_per_iteration"]:.2f}',
             note="(steady: safe points that moved pages, each a device synchronize on a GPU; lower is better)"),
    ]


def _pytorch_peak(pytorch: Dict[str, Any]) -> str:
    peak = _core().format_size(pytorch["peak_reserved_bytes"])
    return f"{peak} or more" if pytorch["start"] == "unknown" else peak


def _pytorch_calls(pytorch: Dict[str, Any], kind: str) -> str:
    """PyTorch's driver calls: cudaMalloc / cudaFree of whole segments, and
    maps / unmaps of ranges of expandable segments."""
    whole, ranges = (("num_cuda_mallocs", "num_segment_maps") if kind == "maps"
                     else ("num_cuda_frees", "num_segment_unmaps"))
    parts = []
    if pytorch[whole] or not pytorch[ranges]:
        parts.append(f'{pytorch[whole]} {"cudaMalloc" if kind == "maps" else "cudaFree"}')
    if pytorch[ranges]:
        parts.append(f"{pytorch[ranges]} {kind if pytorch[ranges] != 1 else kind[:-1]}")
    return " + ".join(parts)


def _no_segment_events_line(pytorch: Dict[str, Any]) -> str:
    at_dump = pytorch.get("reserved_at_dump_bytes")
    held = f"; it held {_core().format_size(at_dump)} reserved at the dump" if at_dump is not None else ""
    return pytorch["reason"] + held


def _render(rows: List[_Row], side_by_side: bool) -> str:
    width = max(len(row.name) for row in rows)
    if not side_by_side:
        return "\n".join(f"{row.name:<{width}}  {row.value}" + (f"  {row.note}" if row.note else "") for row in rows)
    columned = [row for row in rows if not row.spans]
    value_width = max(len(row.value) for row in columned)
    pytorch_width = max(len(row.pytorch or "") for row in columned)
    lines = []
    for row in rows:
        if row.spans:
            lines.append(f"{row.name:<{width}}  {row.value}")
        else:
            lines.append(f"{row.name:<{width}}  {row.value:<{value_width}}  {row.pytorch or '':<{pytorch_width}}  "
                         f"{row.note}".rstrip())
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cotenant-replay",
        description="Replay an allocation trace through cotenant's allocator on a simulated GPU and report "
                    "peaks, fragmentation, spill traffic and time per call.",
        epilog="Traces: PyTorch memory snapshot pickles (torch.cuda.memory._dump_snapshot()) or cotenant's "
               "JSON-lines format, optionally gzipped. See docs/replay.md.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s)")
    parser.add_argument("--device-capacity", default="16GiB", metavar="SIZE",
                        help="device memory of the simulated GPU (default 16GiB)")
    parser.add_argument("--granularity", default="2MiB", metavar="SIZE",
                        help="page size of the simulated GPU (default 2MiB, as on current GPUs)")
    parser.add_argument("--cap", default=None, metavar="SIZE",
                        help="initial cap on device-resident bytes (default: none)")
    parser.add_argument("--cap-schedule", default=None, metavar="SCHEDULE",
                        help='cap changes "OPINDEX:SIZE,..." applied before the op with that 0-based index '
                             '(SIZE "none" removes the cap), or a file holding such entries')
    parser.add_argument("--json", action="store_true", help="print one JSON object per trace instead of a table")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        core = _core()
    except ImportError as error:
        print(f"cotenant-replay: error: {error}", file=sys.stderr)
        return 2

    def fail(message: str) -> int:
        print(f"cotenant-replay: error: {message}", file=sys.stderr)
        return 2

    try:
        for option, value in (("--device-capacity", args.device_capacity), ("--granularity", args.granularity),
                              ("--cap", args.cap)):
            if value is not None and core.parse_size(value) == 0:
                return fail(f"{option} must be larger than 0 bytes")
        schedule = parse_cap_schedule(args.cap_schedule) if args.cap_schedule else []
    except (core.Error, ValueError, OSError) as error:
        return fail(str(error))

    for number, path in enumerate(args.traces):
        try:
            trace = load_trace(path)
            result = replay_trace(trace, device_capacity=args.device_capacity, granularity=args.granularity,
                                  cap=args.cap, cap_schedule=schedule)
        except TraceError as error:
            return fail(str(error))
        except core.Error as error:
            return fail(f"{path}: {error}")
        if args.json:
            print(json.dumps(result, sort_keys=True))
        else:
            if number:
                print()
            print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
