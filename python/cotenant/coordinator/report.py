"""A job's report, checked before the coordinator uses it.

A job writes its own block, so what it reports is input like any request: a
job that reports inf, NaN or a negative size must not break `status`,
`history` or the policies for the other jobs. check() keeps each field whose
new value is a number of the field's kind and, where it is not, the job's last
good value for that field (or none).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

_MAX_COUNT = 2**63 - 1

# Non-negative integers: bytes, counters, ids, nanoseconds.
_COUNTS = frozenset({
    "pid", "uid", "device", "device_bytes", "host_bytes", "host_pool_bytes", "allocated_bytes", "cached_bytes", "reserved_bytes",
    "peak_allocated_bytes", "spilled_bytes", "restored_bytes", "pending_migration_bytes", "num_migrations",
    "iteration_count", "iteration_last_ns", "iteration_ewma_ns", "iteration_p99_ns",
    "iteration_total_ns",
    "applied_command_sequence", "apply_errors", "heartbeat_ns",
})
_DURATIONS_US: frozenset = frozenset()                                 # finite, >= 0 (none left: times are ns counts)
_FRACTIONS = frozenset({"applied_share", "effective_share"})           # in [0, 1]
_OPTIONAL_BYTES = frozenset({"applied_memory_cap", "host_room_bytes"})  # None = no cap / unknown
_NAMES = frozenset({"role", "state"})                                  # from the layout's own enums


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def _is_finite_non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def valid(field: str, value: Any) -> bool:
    """Whether `value` is acceptable for the report field `field`."""
    if field in _COUNTS:
        return _is_count(value)
    if field in _DURATIONS_US:
        return _is_finite_non_negative(value)
    if field in _FRACTIONS:
        return _is_finite_non_negative(value) and value <= 1
    if field in _OPTIONAL_BYTES:
        return value is None or _is_count(value)
    if field in _NAMES:
        return isinstance(value, str) and value.isprintable() and len(value) <= 32
    # A field added to the layout later: any JSON-safe scalar.
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) <= _MAX_COUNT
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and value.isprintable() and len(value) <= 256


def check(new: Dict[str, Any], last: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """(the report to use, the fields of `new` that were refused)."""
    checked: Dict[str, Any] = {}
    refused: List[str] = []
    for field, value in new.items():
        if valid(field, value):
            checked[field] = value
        else:
            refused.append(field)
            if field in last:
                checked[field] = last[field]
    return checked, refused
