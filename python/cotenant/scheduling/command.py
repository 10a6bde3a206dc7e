"""`cotenant simulate`: run job traces through the scheduling policies on a simulated node,
or (--cluster) on a simulated cluster of nodes, with the same policy code."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

EXIT_USAGE = 2
ALL = "all"


def _policy_names(values: Optional[List[str]]) -> List[str]:
    from cotenant.scheduling.policies import POLICIES

    names: List[str] = []
    for value in values or [ALL]:
        for name in (n.strip() for n in value.split(",") if n.strip()):
            if name == ALL:
                names += [n for n in POLICIES if n not in names]
            elif name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)} or {ALL}")
            elif name not in names:
                names.append(name)
    return names


def _thresholds(text: str) -> tuple:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--las-thresholds takes GPU-seconds separated by commas, like 3600 or 600,3600; not {text!r}") from None


def _size(text: str) -> int:
    from cotenant._core import parse_size  # the one parser for sizes

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_simulate_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="run job traces through the scheduling policies on a simulated node",
        description="A discrete-event simulation of one node, with the coordinator's own policy code. Prints "
                    "a table per trace; --json and --plot write the figures and the JCT CDFs.")
    p.add_argument("--trace", action="append", required=True, metavar="FILE",
                   help="a job trace in Tiresias' CSV format (repeat for several); see docs/scheduling.md")
    p.add_argument("--policy", action="append", metavar="NAME",
                   help="fifo, las, timeslice, antman, or all (default); repeat or separate with commas")
    p.add_argument("--gpus", type=int, help="GPUs of the node (or, with --nodes, of each node)")
    p.add_argument("--cluster", metavar="FILE",
                   help="simulate a cluster described by a Tiresias cluster file (e.g. 1 switch of 32 nodes of 4 "
                        "GPUs) instead of one node; see docs/cluster.md")
    p.add_argument("--nodes", type=int, help="simulate a cluster of this many nodes of --gpus GPUs each")
    p.add_argument("--slow-nodes", type=int, default=0,
                   help="cluster: this many nodes have a slower GPU type (a model-dependent speed, "
                        "cotenant.cluster.topology); default 0")
    p.add_argument("--placement", choices=["blind", "allox", "both"], default="both",
                   help="cluster with slow nodes: place jobs on any free GPU (blind), bind them to GPU types by "
                        "AlloX's matching (allox, needs scipy), or run both (default)")
    p.add_argument("--gpu-memory", type=_size, default="80GiB", help="memory of each GPU (default 80GiB)")
    p.add_argument("--pcie-bandwidth", type=_size, default="54GB", metavar="SIZE",
                   help="host<->device bytes per second per GPU that suspend and resume move at (default 54GB: "
                        "pinned cudaMemcpy measured on an H100, PCIe 5.0 x16)")
    p.add_argument("--utilization", type=float, default=1.0,
                   help="fraction of time a job keeps its GPUs busy alone, for trace jobs that give none (default 1)")
    p.add_argument("--quantum", type=float, default=60.0, help="time-slice quantum in seconds (default 60)")
    p.add_argument("--las-thresholds", type=_thresholds, default=(3600.0,), metavar="GPU_S,...",
                   help="2D-LAS queue thresholds in GPU-seconds of attained service (default 3600)")
    p.add_argument("--starvation-factor", type=float, default=2.0,
                   help="2D-LAS: a job waiting this many times the service it got since its last promotion "
                        "goes back to the first queue; 0 turns promotion off (default 2)")
    p.add_argument("--json", metavar="PATH", help="write the figures and every job's completion time as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the JCT CDF of each policy as a PNG (needs matplotlib)")
    p.set_defaults(func=cmd_simulate)
    return p


def policy_options(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    return {
        "las": {"thresholds_gpu_s": tuple(args.las_thresholds), "starvation_factor": args.starvation_factor},
        "timeslice": {"quantum_s": args.quantum},
    }


def cmd_simulate(args: argparse.Namespace) -> int:
    from cotenant.scheduling.policies import make_policy
    from cotenant.scheduling.report import format_table, plot_jct_cdf, run_record, write_json
    from cotenant.scheduling.simulator import SimulationConfig, SimulationError, simulate
    from cotenant.scheduling.trace import read_trace

    try:
        names = _policy_names(args.policy)
        shape = cluster_shape(args)
        topology = {}
        if shape is not None:
            from cotenant.cluster.topology import relative_speed

            topology = {"gpus": shape.gpus(), "speed": relative_speed}
        elif args.gpus is None:
            raise ValueError("give the node's GPUs with --gpus N, or a cluster with --cluster FILE or --nodes N "
                             "--gpus M")
        config = SimulationConfig(gpu_count=shape.gpu_count if shape else args.gpus,
                                  gpu_memory_bytes=args.gpu_memory, pcie_bytes_per_s=float(args.pcie_bandwidth),
                                  default_utilization=args.utilization, **topology)
        options = policy_options(args)
        policies = [make_policy(name, **options.get(name, {})) for name in names]
        if shape is not None and shape.slow_nodes:
            policies = with_placements(policies, args.placement)
        traces = [(path, read_trace(path)) for path in args.trace]
    except ValueError as error:  # TraceError is one
        print(f"cotenant simulate: {error}", file=sys.stderr)
        return EXIT_USAGE
    runs = []
    for path, trace in traces:
        summaries = []
        for policy in policies:
            try:
                result = simulate(trace, policy, config)
            except SimulationError as error:
                print(f"cotenant simulate: {path}: {error}", file=sys.stderr)
                return 1
            runs.append(run_record(path, result))
            summaries.append(runs[-1]["summary"])
        refused = summaries[0]["refused"] if summaries else []
        where = shape.describe() if shape is not None else f"{args.gpus} GPUs"
        print(f"{path}: {len(trace)} jobs on {where}" +
              (f" ({len(refused)} refused: they need more GPUs or memory than the node has)" if refused else ""))
        print(format_table(summaries))
        print()
    if args.json:
        write_json(args.json, {"config": describe_config(args, names), "runs": runs})
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot_jct_cdf(runs, args.plot)
        except RuntimeError as error:
            print(f"cotenant simulate: {error}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0


def cluster_shape(args: argparse.Namespace):
    """The simulated cluster (--cluster FILE or --nodes N with --gpus M), or None for one node."""
    from cotenant.cluster.topology import ClusterShape, read_cluster

    if args.cluster and args.nodes is not None:
        raise ValueError("give the cluster either as --cluster FILE or as --nodes N --gpus M, not both")
    if args.cluster:
        return read_cluster(args.cluster, args.slow_nodes)
    if args.nodes is not None:  # 0 is refused by ClusterShape, not taken for "no --nodes"
        if args.gpus is None:
            raise ValueError("--nodes needs --gpus: the GPUs of each node")
        return ClusterShape(args.nodes, args.gpus, args.slow_nodes)
    if args.slow_nodes:
        raise ValueError("--slow-nodes needs a cluster: --cluster FILE or --nodes N --gpus M")
    return None


def with_placements(policies: List[Any], placement: str) -> List[Any]:
    """Each policy type-blind, with AlloX's matching in front, or both."""
    from cotenant.cluster.allox import TypeMatching

    chosen: List[Any] = []
    for policy in policies:
        if placement in ("blind", "both"):
            chosen.append(policy)
        if placement in ("allox", "both"):
            chosen.append(TypeMatching(policy))
    return chosen


def describe_config(args: argparse.Namespace, names: List[str]) -> Dict[str, Any]:
    shape = cluster_shape(args)
    return {
        "cluster": None if shape is None else {"nodes": shape.nodes, "gpus_per_node": shape.gpus_per_node,
                                               "slow_nodes": shape.slow_nodes, "placement": args.placement},
        "gpus": shape.gpu_count if shape else args.gpus, "gpu_memory_bytes": args.gpu_memory, "pcie_bytes_per_s": args.pcie_bandwidth,
        "default_utilization": args.utilization, "policies": names, "policy_options": policy_options(args),
    }
