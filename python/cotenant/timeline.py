"""`cotenant timeline`: each job's memory and compute share over time, from the coordinator's history."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Dict, Iterable, List


class HistoryError(ValueError):
    """A file that is not a coordinator history; the message names it and what to give instead."""


_SAMPLE_KEYS = ("t", "job", "role", "device_bytes", "host_bytes", "share")


def _not_a_history(path: str, why: str) -> HistoryError:
    return HistoryError(f"{path} is not a coordinator history ({why}); give the coordinator's "
                        "<socket>.history.jsonl, or leave out --history to ask the running coordinator")


def load_history(path: str) -> List[Dict[str, Any]]:
    """The records of a coordinator's history file (JSON lines). A line that
    is not JSON is skipped (a kill -9 cuts the last one short); a line that is
    JSON but no history record, or bytes that are not text, raise HistoryError.
    OSError when the file cannot be read."""
    records = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError:
            raise _not_a_history(path, "it is not UTF-8 text") from None
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill -9
        if not isinstance(record, dict) or not isinstance(record.get("t"), (int, float)):
            raise _not_a_history(path, f"line {number} is not a record with a time \"t\"")
        if "device_bytes" in record and any(key not in record for key in _SAMPLE_KEYS):
            missing = ", ".join(key for key in _SAMPLE_KEYS if key not in record)
            raise _not_a_history(path, f"line {number} is a sample without {missing}")
        records.append(record)
    return records


def _gpu(record: Dict[str, Any]) -> str:
    """The GPU a record is about: its key (UUID), else the index older histories recorded."""
    return str(record.get("gpu_key", record.get("gpu")))


def plot(records: Iterable[Dict[str, Any]], output: str) -> int:
    """Writes a PNG with, per GPU, device/host bytes and caps (top) and shares (bottom).
    Returns the number of samples plotted."""
    records = list(records)
    fig = figure(records)  # first: it says which extra to install when matplotlib is missing
    import matplotlib.pyplot as plt

    fig.savefig(output, dpi=100, bbox_inches="tight")  # the legends sit outside the plots: keep them in the file
    plt.close(fig)
    return sum(1 for r in records if "device_bytes" in r)


def figure(records: Iterable[Dict[str, Any]]):
    """The timeline as a matplotlib figure. Each plot's legend sits to its right,
    outside the axes, so it never covers a line however many jobs there are."""
    from cotenant._extras import require

    matplotlib = require("matplotlib", "timeline", "cotenant timeline")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    samples = [r for r in records if "device_bytes" in r]
    events = [r for r in records if r.get("event")]
    gpus = sorted({_gpu(r) for r in samples}) or ["0"]
    t0 = min((r["t"] for r in samples), default=0.0)
    fig, axes = plt.subplots(2, len(gpus), figsize=(13 * len(gpus), 7), sharex="col", squeeze=False)
    gib = float(1 << 30)
    for column, gpu in enumerate(gpus):
        by_job: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        for r in samples:
            if _gpu(r) == gpu:
                by_job[f"{r['job']} ({r['role']})"].append(r)
        memory, share = axes[0][column], axes[1][column]
        for index, (label, rows) in enumerate(sorted(by_job.items())):
            color = f"C{index}"
            t = [r["t"] - t0 for r in rows]
            memory.plot(t, [r["device_bytes"] / gib for r in rows], color=color, label=f"{label} device")
            memory.plot(t, [r["host_bytes"] / gib for r in rows], color=color, linestyle=":", label=f"{label} host")
            capped = [(x, r["cap"] / gib) for x, r in zip(t, rows) if r.get("cap") is not None]
            if capped:
                memory.step([c[0] for c in capped], [c[1] for c in capped], where="post", color=color,
                            linestyle="--", alpha=0.6, label=f"{label} cap")
            share.step(t, [r["share"] for r in rows], where="post", color=color, label=label)
        for e in events:
            if e.get("gpu") is not None and _gpu(e) == gpu:
                memory.axvline(e["t"] - t0, color="grey", linewidth=0.8, alpha=0.5)
        memory.set_title(f"GPU {gpu}")
        memory.set_ylabel("memory (GiB)")
        memory.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        share.set_ylabel("compute share")
        share.set_ylim(-0.05, 1.05)
        share.set_xlabel("time (s)")
        share.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig
