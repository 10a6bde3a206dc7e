"""Every scheduling policy on the real 60-job Tiresias trace and on generated traces,
on one node of 4 and of 8 GPUs (the simulator; no GPU needed, seconds of CPU).

    python benchmarks/bench_scheduling.py [--out benchmarks/results]

Writes scheduling.json (every run's figures and job completion times) and
scheduling.png (JCT CDFs), and prints the tables of docs/scheduling.md.
The generated traces are under benchmarks/traces/jobs/ (remade with --regenerate,
by cotenant.scheduling.tracegen with the seeds below).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

from cotenant.scheduling import tracegen  # noqa: E402
from cotenant.scheduling.policies import make_policy  # noqa: E402
from cotenant.scheduling.report import format_table, plot_jct_cdf, run_record, write_json  # noqa: E402
from cotenant.scheduling.simulator import SimulationConfig, simulate  # noqa: E402
from cotenant.scheduling.trace import read_trace  # noqa: E402

TIRESIAS_60 = os.environ.get("COTENANT_TIRESIAS_TRACE",
                             os.path.join(ROOT, "benchmarks", "traces", "jobs", "tiresias_60_job.csv"))
JOBS_DIR = os.path.join(ROOT, "benchmarks", "traces", "jobs")
GENERATED = {  # name: (jobs, gpus, load, seed, opportunistic fraction)
    "generated_4gpu_load1.3.csv": (120, 4, 1.3, 11, 0.0),
    "generated_8gpu_load1.3.csv": (120, 8, 1.3, 12, 0.0),
    "generated_8gpu_load2.0_opportunistic.csv": (120, 8, 2.0, 13, 0.3),
}
POLICIES = ("fifo", "las", "timeslice", "antman")
PCIE_MEMCPY = 54e9       # pinned cudaMemcpy on an H100 (benchmarks/results/allocator-*.json)
PCIE_COTENANT_SPILL = 2.5e9  # cotenant's own spill rate in that same run


def experiments():
    """(label, trace, gpus, SimulationConfig kwargs) of each table."""
    runs = [(f"tiresias_60_job.csv, {g} GPUs", TIRESIAS_60, g, {}) for g in (4, 8)]
    runs += [("tiresias_60_job.csv, 8 GPUs, utilization 0.5", TIRESIAS_60, 8, {"default_utilization": 0.5})]
    runs += [("tiresias_60_job.csv, 8 GPUs, suspend/resume at 2.5 GB/s", TIRESIAS_60, 8,
              {"pcie_bytes_per_s": PCIE_COTENANT_SPILL})]
    for name, (_, gpus, _, _, _) in GENERATED.items():
        runs.append((f"{name}, {gpus} GPUs", os.path.join(JOBS_DIR, name), gpus, {}))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--regenerate", action="store_true", help="remake the generated traces")
    args = parser.parse_args()
    for name, (jobs, gpus, load, seed, opportunistic) in GENERATED.items():
        path = os.path.join(JOBS_DIR, name)
        if args.regenerate or not os.path.exists(path):
            tracegen.write(tracegen.generate(jobs, gpus, load, seed, opportunistic=opportunistic), path)
    records, plotted = [], []
    for label, path, gpus, overrides in experiments():
        config = SimulationConfig(gpu_count=gpus, pcie_bytes_per_s=overrides.get("pcie_bytes_per_s", PCIE_MEMCPY),
                                  default_utilization=overrides.get("default_utilization", 1.0))
        trace = read_trace(path)
        runs = [run_record(os.path.basename(path), simulate(trace, make_policy(p), config)) for p in POLICIES]
        summaries = [r["summary"] for r in runs]
        refused = summaries[0]["refused"]
        print(f"### {label}" + (f" ({len(refused)} jobs wider than the node refused)" if refused else ""))
        print()
        print(format_table(summaries, markdown=True))
        print()
        records.append({"label": label, "config": {"gpus": gpus, "gpu_memory_bytes": config.gpu_memory_bytes,
                                                    "pcie_bytes_per_s": config.pcie_bytes_per_s,
                                                    "default_utilization": config.default_utilization},
                        "runs": runs})
        if not overrides:
            plotted += runs
    json_path = os.path.join(args.out, "scheduling.json")
    write_json(json_path, {"benchmark": "scheduling", "policies": list(POLICIES), "experiments": records})
    plot_jct_cdf(plotted, os.path.join(args.out, "scheduling.png"))
    print(f"wrote {json_path} and scheduling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
