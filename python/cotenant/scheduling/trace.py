"""Job traces for the scheduler: Tiresias' CSV format, with optional memory, role and utilization.

Columns (a header line names them; order is free):
  job_id, num_gpu, submit_time, iterations, model_name, duration, interval
      Tiresias' own (seconds; `duration` is the job's run time alone on
      `num_gpu` GPUs, `interval` is unused here);
  persistent_memory, peak_memory   optional, per GPU: bytes or sizes like "6GiB";
      default: the estimate for `model_name` in MODEL_MEMORY;
  role                             optional: guaranteed, opportunistic, or empty (the policy decides);
  utilization                      optional, in (0, 1]: the fraction of time the job keeps
      its GPUs busy alone (default 1, or the simulator's --utilization).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from cotenant.scheduling.state import ROLES

GiB = 1 << 30

REQUIRED = ("job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration")

# Per-GPU memory estimates for the models in Tiresias' traces, for traces that give none.
# persistent: fp32 weights, gradients and SGD momentum (12 bytes per parameter, parameter
# counts of the torchvision definitions); peak: that plus activations at a batch of 64 per GPU,
# an estimate, not a measurement. They matter only where memory decides (admission, packing)
# and for the bytes a suspend moves.
_PARAMETERS_M = {
    "alexnet": 61.1, "vgg11": 132.9, "vgg16": 138.4, "vgg19": 143.7, "googlenet": 6.6,
    "inception3": 27.2, "inception4": 42.7, "resnet50": 25.6, "resnet101": 44.5, "resnet152": 60.2,
}
_ACTIVATIONS_GIB = {
    "alexnet": 1.0, "vgg11": 5.0, "vgg16": 7.0, "vgg19": 8.0, "googlenet": 4.0,
    "inception3": 7.0, "inception4": 11.0, "resnet50": 9.0, "resnet101": 13.0, "resnet152": 18.0,
}
MODEL_MEMORY: Dict[str, Tuple[int, int]] = {
    name: (int(params * 1e6 * 12), int(params * 1e6 * 12 + _ACTIVATIONS_GIB[name] * GiB))
    for name, params in _PARAMETERS_M.items()
}
DEFAULT_MEMORY = (int(50e6 * 12), int(50e6 * 12 + 8 * GiB))  # a model the table does not know


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class TraceJob:
    job_id: int
    num_gpus: int
    submit_time: float     # seconds from the trace's start
    iterations: int
    model_name: str
    duration_s: float      # alone, on num_gpus GPUs
    persistent_bytes: int  # per GPU
    peak_bytes: int        # per GPU
    role: Optional[str] = None
    utilization: Optional[float] = None

    @property
    def iteration_s(self) -> float:
        return self.duration_s / max(1, self.iterations)


def read_trace(path: str) -> List[TraceJob]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
            fields = rows and list(rows[0].keys()) or []
    except OSError as error:
        raise TraceError(f"cannot read the trace {path}: {error.strerror}") from None
    except (UnicodeDecodeError, csv.Error) as error:
        raise TraceError(f"the trace {path} is not a CSV text file ({error}); give a trace in Tiresias' format, "
                         f"a header line ({','.join(REQUIRED)}) and one line per job") from None
    if not rows:
        raise TraceError(f"the trace {path} has no jobs: it needs a header line ({','.join(REQUIRED)}) and one "
                         "line per job")
    missing = [c for c in REQUIRED if c not in fields]
    if missing:
        raise TraceError(f"the trace {path} lacks the column(s) {', '.join(missing)}; its header must name "
                         f"{','.join(REQUIRED)} (Tiresias' format)")
    jobs = [_job(path, line, row) for line, row in enumerate(rows, start=2)]
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise TraceError(f"the trace {path} repeats a job_id; each job needs its own")
    return jobs


def _job(path: str, line: int, row: Dict[str, str]) -> TraceJob:
    def fail(column: str, must: str) -> TraceError:
        return TraceError(f"{path}, line {line}: {column} must be {must}, not {row.get(column)!r}")

    def number(column: str, minimum: float, whole: bool = False):
        try:
            value = float(row[column])
        except (TypeError, ValueError):
            raise fail(column, "a number") from None
        if not math.isfinite(value) or value < minimum or (whole and value != int(value)):
            raise fail(column, f"{'a whole number' if whole else 'a number'} of at least {minimum:g}")
        return int(value) if whole else value

    model = (row.get("model_name") or "").strip()
    persistent, peak = MODEL_MEMORY.get(model, DEFAULT_MEMORY)
    if (row.get("persistent_memory") or "").strip():
        persistent = _size(path, line, "persistent_memory", row["persistent_memory"])
    if (row.get("peak_memory") or "").strip():
        peak = _size(path, line, "peak_memory", row["peak_memory"])
    if peak < persistent:
        raise fail("peak_memory", f"at least persistent_memory ({persistent} bytes)")
    role = (row.get("role") or "").strip() or None
    if role is not None and role not in ROLES:
        raise fail("role", "guaranteed, opportunistic or empty")
    utilization = None
    if (row.get("utilization") or "").strip():
        utilization = number("utilization", 0.0)
        if not 0 < utilization <= 1:
            raise fail("utilization", "in (0, 1]")
    return TraceJob(
        job_id=number("job_id", 0, whole=True), num_gpus=number("num_gpu", 1, whole=True),
        submit_time=number("submit_time", 0.0), iterations=number("iterations", 1, whole=True),
        model_name=model, duration_s=number("duration", 0.001),
        persistent_bytes=persistent, peak_bytes=peak, role=role, utilization=utilization,
    )


def _size(path: str, line: int, column: str, text: str) -> int:
    from cotenant._core import parse_size  # the one parser for sizes

    try:
        return parse_size(text.strip())
    except ValueError as error:
        raise TraceError(f"{path}, line {line}: {column}: {error}") from None
