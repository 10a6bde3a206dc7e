"""The coordinator's control-plane protocol: versioned JSON messages over a Unix socket.

Framing: one JSON object per line (UTF-8, ``\\n``-terminated). A request
is at most ``MAX_MESSAGE_BYTES`` bytes including the newline; a reply (a
status of many jobs, a long history) at most ``MAX_REPLY_BYTES``. Every request carries the
protocol version ``v``, a request ``id`` that strictly increases on its
connection, and an ``op``. Every reply echoes ``v`` and ``id`` (``id`` is null
when the request was too broken to have one) and has ``ok``; a failed
request gets ``{"ok": false, "error": {"code": ..., "message": ...}}`` and the
connection stays usable, except after an oversized message (the stream can
no longer be split into lines, so it is closed after the error reply).

Sizes travel as integers of bytes (``null`` = no cap): clients parse size
strings such as "6GiB" with the one parser before sending.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Container, Dict, Optional, Tuple

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_REPLY_BYTES = 32 * 1024 * 1024
MAX_NAME_BYTES = 63  # the job block stores 63 bytes of name (UTF-8)

ROLES = ("guaranteed", "opportunistic", "cap_only")
COMMANDS = ("spill_all", "restore_all", "suspend", "resume")

# Error codes a reply can carry.
BAD_JSON = "bad_json"
BAD_REQUEST = "bad_request"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_OP = "unknown_op"
OUT_OF_ORDER = "out_of_order"
TOO_LARGE = "too_large"
PERMISSION_DENIED = "permission_denied"
NO_SUCH_JOB = "no_such_job"
ADMISSION_REFUSED = "admission_refused"
RESOURCE_EXHAUSTED = "resource_exhausted"  # e.g. /dev/shm is full
BUSY = "busy"  # this uid has too many connections open: retry after closing some
INTERNAL = "internal_error"
UNTRUSTED_COORDINATOR = "untrusted_coordinator"  # raised by the client, never sent


class ProtocolError(Exception):
    """A request the coordinator refuses; becomes an error reply."""

    def __init__(self, code: str, message: str, request_id: Optional[int] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def _int(minimum: int = 0, maximum: int = 2**63 - 1):
    def check(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum

    check.describe = f"an integer from {minimum} to {maximum}"
    return check


def _optional(inner):
    def check(value: Any) -> bool:
        return value is None or inner(value)

    check.describe = f"null or {inner.describe}"
    return check


def _string(max_bytes: int):
    def check(value: Any) -> bool:
        return isinstance(value, str) and value.isprintable() and 0 < len(value.encode()) <= max_bytes

    check.describe = f"a printable string of 1 to {max_bytes} bytes (UTF-8)"
    return check


def job_name_problem(name: Any) -> Optional[str]:
    """Why `name` cannot name a job (a sentence that says what to do), or None.
    Lengths are in bytes, as the job's block stores them; a number is refused
    because `set-cap 3` means job id 3."""
    if not isinstance(name, str) or not name:
        return f"a job name must be a non-empty string, not {name!r}"
    if not name.isprintable():
        return f"the job name {name!r} holds unprintable characters; use letters, digits and punctuation"
    size = len(name.encode())
    if size > MAX_NAME_BYTES:
        return (f"the job name {name!r} is {size} bytes in UTF-8; a name may be at most {MAX_NAME_BYTES} bytes: "
                "shorten it")
    if name.isdigit():
        return f"the job name {name!r} is a number, which would be taken for a job id; use e.g. 'job-{name}'"
    return None


def unique_name(name: str, taken: Container[str], tag: int) -> str:
    """`name`, or, when it is taken, `name-<tag>` (then `name-<tag>.2`, ...):
    never a name another job holds, which another user may have registered
    first so that commands by that name would reach their job. The whole
    name fits MAX_NAME_BYTES."""
    candidate, attempt = name, 1
    while candidate in taken:
        suffix = f"-{tag}" if attempt == 1 else f"-{tag}.{attempt}"
        room = MAX_NAME_BYTES - len(suffix)
        candidate = name.encode()[:room].decode(errors="ignore") + suffix
        attempt += 1
    return candidate


def _job_name(value: Any) -> bool:
    return job_name_problem(value) is None


_job_name.describe = (f"a printable name of 1 to {MAX_NAME_BYTES} bytes (UTF-8) that is not a number "
                      "(numbers are job ids)")


def _gpu_uuid(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("GPU-") and value.isprintable() and len(value.encode()) <= 47


_gpu_uuid.describe = "a GPU UUID as NVML writes it, \"GPU-\" and at most 43 more characters"


def _choice(options):
    def check(value: Any) -> bool:
        return isinstance(value, str) and value in options

    check.describe = "one of " + ", ".join(repr(o) for o in options)
    return check


def _fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1


_fraction.describe = "a number from 0 to 1"


def _share_or_auto(value: Any) -> bool:
    return value == "auto" or _fraction(value)


_share_or_auto.describe = "a number from 0 to 1, or \"auto\""

_BYTES = _int(1)


def _cap_value(value: Any) -> bool:
    """A memory cap on the wire: bytes (int >= 1), null, or a cap's text that
    cotenant._core.Cap reads ("6GiB", "0.5", "50%", "none")."""
    if value is None or _BYTES(value):
        return True
    if not isinstance(value, str) or not 0 < len(value) <= 32:
        return False
    from cotenant import _core  # the one parser for caps (no torch)

    try:
        _core.Cap(value)
    except _core.Error:
        return False
    return True


_cap_value.describe = 'bytes (an int >= 1), null, or a cap such as "6GiB", "0.5" or "none"'
_JOB_REF = _string(MAX_NAME_BYTES)  # a job name or its decimal id

# op -> {field: (check, required)}. Fields not listed are refused.
SCHEMA: Dict[str, Dict[str, tuple]] = {
    "hello": {},
    "register": {
        "role": (_choice(ROLES), True),
        "device": (_int(0, 1023), True),
        "name": (_job_name, False),
        "memory_cap": (_cap_value, False),
        "persistent_bytes": (_int(0), False),
        "device_total_bytes": (_int(1), False),
        "gpu_uuid": (_gpu_uuid, False),  # the physical GPU; the coordinator keys GPUs by it
    },
    "unregister": {},
    "status": {},
    "history": {"since": (_int(0), False), "limit": (_int(1, 50000), False)},
    "set_cap": {"job": (_JOB_REF, True), "memory_cap": (_cap_value, True)},
    "set_share": {"job": (_JOB_REF, True), "share": (_share_or_auto, True)},
    "command": {"job": (_JOB_REF, True), "command": (_choice(COMMANDS), True)},
    # The job queue (queue.py): a process asks for GPUs and polls until it is admitted.
    "submit": {
        "name": (_job_name, False),
        "role": (_choice(ROLES), False),
        "gpus": (_int(1, 1024), False),
        "persistent_bytes": (_int(0), False),
        "peak_bytes": (_int(0), False),
    },
    "queue_state": {"ticket": (_int(1), True)},
    "cancel": {"job": (_JOB_REF, True)},
}
QUEUE_OPS = frozenset({"submit", "queue_state", "cancel"})

# Ops that change a job: only the job's owner (its uid), root or the
# coordinator's own uid may (docs/coordinator.md, "Security model").
ADMIN_OPS = frozenset({"set_cap", "set_share", "command"})


@dataclass
class Request:
    id: int
    op: str
    args: Dict[str, Any] = field(default_factory=dict)


def encode(message: Dict[str, Any], limit: int = MAX_MESSAGE_BYTES) -> bytes:
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(data) > limit:
        raise ProtocolError(TOO_LARGE, f"the message is {len(data)} bytes, more than the {limit} allowed")
    return data


def parse_request(line: bytes) -> Request:
    """Validates one request line; raises ProtocolError naming what is wrong."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(TOO_LARGE, f"the request is {len(line)} bytes, more than the {MAX_MESSAGE_BYTES} allowed")
    try:
        message = json.loads(line.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError(BAD_JSON, f"the request is not valid UTF-8 JSON: {error}") from None
    if not isinstance(message, dict):
        raise ProtocolError(BAD_REQUEST, "a request must be a JSON object with v, id and op")
    request_id = message.get("id")
    if not (isinstance(request_id, int) and not isinstance(request_id, bool) and 0 <= request_id < 2**63):
        raise ProtocolError(BAD_REQUEST, "the request needs an integer id from 0 to 2**63-1")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported; this coordinator speaks version {PROTOCOL_VERSION}: "
            "run the job and the coordinator from the same cotenant version",
            request_id,
        )
    op = message.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op!r}; known ops: {', '.join(sorted(SCHEMA))}", request_id)
    schema = SCHEMA[op]
    args = {k: v for k, v in message.items() if k not in ("v", "id", "op")}
    for name in args:
        if name not in schema:
            raise ProtocolError(BAD_REQUEST, f"op {op!r} takes no field {name!r}", request_id)
    for name, (check, required) in schema.items():
        if name not in args:
            if required:
                raise ProtocolError(BAD_REQUEST, f"op {op!r} needs the field {name!r} ({check.describe})", request_id)
            continue
        if not check(args[name]):
            raise ProtocolError(
                BAD_REQUEST, f"field {name!r} of op {op!r} must be {check.describe}, not {args[name]!r}", request_id
            )
    return Request(id=request_id, op=op, args=args)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def reply_ok(request_id: Optional[int], **fields: Any) -> Dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields}


def reply_error(request_id: Optional[int], code: str, message: str) -> Dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": {"code": code, "message": message}}


def request(op: str, request_id: int, **fields: Any) -> Dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "op": op, **fields}


def peer_credentials(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from
    the kernel (SO_PEERCRED): for a server, who connected; for a client, who
    created the listening socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)
