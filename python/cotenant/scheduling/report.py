"""The simulator's outputs: a table per run, JSON, and a plot of JCT CDFs per policy."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

from cotenant.scheduling.simulator import SimulationResult

COLUMNS = ("policy", "jobs", "avg JCT", "vs FIFO", "median JCT", "p95 JCT", "makespan", "avg queueing",
           "GPU-time util", "compute util", "preemptions", "moved")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _bytes(value: int) -> str:
    from cotenant._core import format_size  # the one formatter

    return format_size(value)


def table_rows(summaries: Sequence[Dict[str, Any]]) -> List[List[str]]:
    """One row per policy; `vs FIFO` is FIFO's average JCT over the policy's (above 1: better)."""
    fifo = next((s for s in summaries if s["policy"] == "fifo"), None)
    rows = []
    for s in summaries:
        ratio = f"{fifo['avg_jct_s'] / s['avg_jct_s']:.2f}x" if fifo and s["avg_jct_s"] else "-"
        rows.append([
            s["policy"], str(s["jobs"]), _duration(s["avg_jct_s"]), ratio, _duration(s["median_jct_s"]),
            _duration(s["p95_jct_s"]), _duration(s["makespan_s"]), _duration(s["avg_queueing_s"]),
            f"{s['gpu_time_utilization']:.0%}", f"{s['compute_utilization']:.0%}", str(s["preemptions"]),
            _bytes(s["bytes_moved"]),
        ])
    return rows


def format_table(summaries: Sequence[Dict[str, Any]], markdown: bool = False) -> str:
    rows = [list(COLUMNS)] + table_rows(summaries)
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def run_record(trace: str, result: SimulationResult) -> Dict[str, Any]:
    return {
        "trace": trace, "summary": result.summary(),
        "jct_s": [j.jct_s for j in result.jobs if j.jct_s is not None],
        "refused": {str(j.job_id): j.refused for j in result.jobs if j.refused},
    }


def write_json(path: str, payload: Dict[str, Any]) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")


def plot_jct_cdf(runs: Sequence[Dict[str, Any]], path: str) -> None:
    """One panel per (trace, GPU count), one JCT CDF line per policy. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib, or leave out --plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["trace"], run["summary"]["gpus"]), []).append(run)
    columns = min(2, len(groups))
    rows = (len(groups) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4 * rows), squeeze=False)
    for axis, ((trace, gpus), members) in zip(axes.flat, groups.items()):
        for run in members:
            jcts = sorted(run["jct_s"])
            if not jcts:
                continue
            fractions = [(i + 1) / len(jcts) for i in range(len(jcts))]
            axis.step([j / 60 for j in jcts], fractions, where="post", label=run["summary"]["policy"])
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("job completion time (minutes, log scale)")
        axis.set_ylabel("fraction of jobs")
        axis.set_title(f"{os.path.basename(trace)}, {gpus} GPUs", fontsize=10)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(groups):]:
        axis.set_visible(False)
    figure.tight_layout()
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
