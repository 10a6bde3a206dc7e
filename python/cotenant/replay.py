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
      {"op": "meta", ...}                      (ignored: where the trace came from)

Sizes are ints of bytes or strings such as "6GiB" (the one size parser,
``cotenant._core.parse_size``). Blank lines and lines starting with ``#`` are
skipped.

The tool prints peak allocated and reserved bytes, fragmentation (peak
reserved / peak allocated), bytes spilled to the host and restored, page
migrations, and nanoseconds per alloc and per free measured inside the C++
allocator. Errors in a trace name the file and line; the exit code is 2.
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
        elif op == "meta":
            continue
        else:
            raise TraceError(
                path, where,
                f"unknown op {json.dumps(op)}; the ops are alloc, free, record_stream, cap, empty_cache, meta",
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
      ignored, they are PyTorch's allocator's own decisions, which cotenant's
      replaces; ``snapshot`` and ``oom`` markers are ignored too.

    The trace is a ring buffer (``max_entries``): a block freed in it but
    allocated before it began is allocated at the start of the replay, with
    the size its free reports.
    """
    traces = snapshot.get("device_traces") or []
    if device is None:
        device = next((i for i, t in enumerate(traces) if t), 0)
    if device >= len(traces) or not traces[device]:
        raise TraceError(path, None, "the snapshot's device trace is empty: record it with "
                         "torch.cuda.memory._record_memory_history() before the work you want to replay")
    events = traces[device]

    trace = Trace(path=path, format="snapshot")
    live: Dict[int, int] = {}    # address -> id of the block living there
    freed: Dict[int, int] = {}   # address -> id of the last block freed there
    prologue: List[Tuple[Op, str]] = []
    body: List[Tuple[Op, str]] = []
    next_id = 1
    for index, event in enumerate(events):
        where = f"device trace entry {index}"
        if not isinstance(event, dict) or "action" not in event:
            raise TraceError(path, where, f'an entry without an "action"; {_NOT_A_TRACE}')
        action = event["action"]
        if action not in ("alloc", "free_completed", "free"):
            continue
        address, size = event.get("addr"), event.get("size")
        if not isinstance(address, int) or not isinstance(size, int) or size < 0:
            raise TraceError(path, where, f'"{action}" needs an integer "addr" and "size"')
        stream = event.get("stream", 0)
        stream = stream if isinstance(stream, int) and stream >= 0 else 0
        if action == "alloc":
            live[address] = next_id
            body.append((("alloc", next_id, size, stream), where))
            next_id += 1
        elif address in live:
            body.append((("free", live.pop(address)), where))
            freed[address] = body[-1][0][1]
        elif address in freed:
            # A second free of the same block: let the replay refuse it with this entry's position.
            body.append((("free", freed[address]), where))
        else:
            # Allocated before the ring buffer's window: it was live from the start.
            prologue.append((("alloc", next_id, size, stream),
                             f"{where} (a block allocated before the trace began)"))
            body.append((("free", next_id), where))
            freed[address] = next_id
            next_id += 1
    for op, where in prologue + body:
        trace.add(op, where)
    if not trace.ops:
        raise TraceError(path, None, "the snapshot's device trace has no alloc or free actions")
    return trace


# ---- cap schedules --------------------------------------------------------------


def parse_cap_schedule(text: str) -> List[Tuple[int, Optional[int]]]:
    """"OPINDEX:SIZE,..." (or a file holding that, with commas or newlines) ->
    [(op index, cap bytes or None)]. The cap applies before the trace's op with
    that 0-based index; SIZE "none" removes the cap."""
    core = _core()
    source = text
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            source = f.read()
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
    return result


def format_table(result: Dict[str, Any]) -> str:
    core = _core()
    size = core.format_size
    cap = result.get("initial_cap_bytes")
    rows = [
        ("trace", f'{result["trace"]} ({result["format"]}, {result["num_ops"]} ops)'),
        ("device", f'{size(result["device_capacity_bytes"])}, {size(result["granularity_bytes"])} pages, '
                   f'cap {size(cap) if cap else "none"}'
                   + (f', {len(result["cap_schedule"])} scheduled cap changes' if result["cap_schedule"] else "")),
        ("peak allocated", size(result["peak_allocated_bytes"])),
        ("peak reserved", size(result["peak_reserved_bytes"])),
        ("fragmentation", f'{result["fragmentation"]:.3f}  (peak reserved / peak allocated)'),
        ("peak on device", size(result["peak_device_resident_bytes"])),
        ("host allocations", f'{result["num_spilled_allocations"]}  (placed on the host: the cap was full)'),
        ("bytes spilled", size(result["spilled_bytes"])),
        ("bytes restored", size(result["restored_bytes"])),
        ("migrations", str(result["num_migrations"])),
        ("ns/alloc", f'{result["ns_per_alloc"]:.0f}  ({result["num_allocs"]} allocs)'),
        ("ns/free", f'{result["ns_per_free"]:.0f}  ({result["num_frees"]} frees)'),
        ("OOMs", str(result["num_ooms"])),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


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
