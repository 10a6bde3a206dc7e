"""Every scheduling policy on a simulated cluster: Tiresias' 60-job trace on the 32-node,
4-GPU cluster it comes with, and on a heterogeneous variant (half the nodes, every other
one, with a slower GPU type), type-blind and with AlloX's matching (the simulator; no GPU,
no Ray, seconds of CPU).

    python benchmarks/bench_cluster.py [--out benchmarks/results]

The trace offers that cluster about 12% of its GPU-time, so nobody queues on it; the
same jobs with their arrivals 10x closer together (submit_time / 10, about 1.2x the
cluster's GPU-time) are where the policies and the placement differ. Writes
cluster.json (every run's figures and job completion times) and cluster.png (JCT CDFs),
and prints the tables of docs/cluster.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

from cotenant.cluster.allox import TypeMatching  # noqa: E402
from cotenant.cluster.topology import read_cluster, relative_speed  # noqa: E402
from cotenant.scheduling.policies import make_policy  # noqa: E402
from cotenant.scheduling.report import format_table, plot_jct_cdf, run_record, write_json  # noqa: E402
from cotenant.scheduling.simulator import SimulationConfig, simulate  # noqa: E402
from cotenant.scheduling.trace import read_trace  # noqa: E402

JOBS_DIR = os.path.join(ROOT, "benchmarks", "traces", "jobs")
TRACE = os.path.join(JOBS_DIR, "tiresias_60_job.csv")
CLUSTER = os.path.join(JOBS_DIR, "tiresias_cluster_n32g4.csv")
POLICIES = ("fifo", "las", "timeslice", "antman")
PCIE_MEMCPY = 54e9  # pinned cudaMemcpy on an H100 (benchmarks/results/allocator-*.json)
COMPRESSION = 10.0


def experiments():
    """(label, arrival compression, slow nodes) of each table."""
    for compression in (1.0, COMPRESSION):
        for slow in (0, 16):
            label = "tiresias_60_job.csv on n32g4" + (", half the nodes slow" if slow else "")
            if compression != 1.0:
                label += f", arrivals {compression:g}x closer"
            yield label, compression, slow


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    jobs = read_trace(TRACE)
    records, plotted = [], []
    for label, compression, slow in experiments():
        shape = read_cluster(CLUSTER, slow_nodes=slow)
        trace = [dataclasses.replace(j, submit_time=j.submit_time / compression) for j in jobs]
        config = SimulationConfig(gpu_count=shape.gpu_count, pcie_bytes_per_s=PCIE_MEMCPY, gpus=shape.gpus(),
                                  speed=relative_speed)
        policies = [make_policy(p) for p in POLICIES]
        if slow:
            policies = [q for p in policies for q in (p, TypeMatching(p))]
        runs = [run_record(label, simulate(trace, policy, config)) for policy in policies]
        print(f"### {label}")
        print()
        print(format_table([r["summary"] for r in runs], markdown=True))
        print()
        records.append({"label": label, "config": {"nodes": shape.nodes, "gpus_per_node": shape.gpus_per_node,
                                                    "slow_nodes": slow, "arrival_compression": compression,
                                                    "gpu_memory_bytes": config.gpu_memory_bytes,
                                                    "pcie_bytes_per_s": config.pcie_bytes_per_s},
                        "runs": runs})
        if compression != 1.0:
            plotted += runs
    json_path = os.path.join(args.out, "cluster.json")
    write_json(json_path, {"benchmark": "cluster", "policies": list(POLICIES), "experiments": records})
    plot_jct_cdf(plotted, os.path.join(args.out, "cluster.png"))
    print(f"wrote {json_path} and cluster.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
