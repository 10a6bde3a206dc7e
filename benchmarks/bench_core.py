#!/usr/bin/env python3
"""The allocator core on the simulated device: time per alloc+free pair and
the replay figures of every bundled trace.

    python benchmarks/bench_core.py [--pairs 200000] [--repeats 5] [--out benchmarks/results/core_simulated.json]

Time per call is measured inside C++ by the replay engine (steady_clock around
each CachingAllocator::allocate / free call, summed; the clock reads, about
20-40 ns per call, are included), never by Python loops. The size mix is the
empirical distribution of allocation sizes in the bundled traces (real model
runs, see docs/replay.md), replayed as a steady state: a working set of live
blocks where each step allocates one block and frees a random live one.

Writes {"device": "simulated (CPU: ...)", "torch": ..., "driver": null,
"benchmark": "core_simulated", "figures": {...}} and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = sorted(glob.glob(os.path.join(HERE, "traces", "*.jsonl.gz")))
FRAGMENTATION_TARGET = 1.10

from cotenant import _core  # noqa: E402
from cotenant.replay import load_trace, replay_trace  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version():
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


def size_mix(traces):
    """Every allocation size of the bundled traces (a multiset)."""
    sizes = []
    for trace in traces:
        sizes.extend(op[2] for op in trace.ops if op[0] == "alloc" and op[2] > 0)
    if not sizes:
        raise SystemExit("bench_core: the bundled traces hold no allocations; run scripts/make_traces.py")
    return sizes


def steady_state_ops(sizes, pairs: int, working_set: int, seed: int = 0):
    """A warm-up that fills the working set, then `pairs` of (alloc, free of a random live block)."""
    rng = random.Random(seed)
    ops, live, next_id = [], [], 1
    for _ in range(working_set):
        ops.append(("alloc", next_id, rng.choice(sizes), 0))
        live.append(next_id)
        next_id += 1
    warmup_ops = len(ops)
    for _ in range(pairs):
        ops.append(("alloc", next_id, rng.choice(sizes), 0))
        live.append(next_id)
        next_id += 1
        victim = live.pop(rng.randrange(len(live)))
        ops.append(("free", victim))
    return ops, warmup_ops


def measure_pairs(sizes, pairs: int, working_set: int, repeats: int):
    ops, warmup = steady_state_ops(sizes, pairs, working_set)
    warm_only = ops[:warmup]
    runs = []
    for _ in range(repeats):
        whole = _core.replay(ops)
        start = _core.replay(warm_only)  # subtract the warm-up's fills
        alloc_ns = (whole["alloc_ns_total"] - start["alloc_ns_total"]) / pairs
        free_ns = (whole["free_ns_total"] - start["free_ns_total"]) / pairs
        runs.append((alloc_ns + free_ns, alloc_ns, free_ns, whole["fragmentation"]))
    runs.sort()
    pair_ns, alloc_ns, free_ns, fragmentation = runs[len(runs) // 2]  # the median run
    return {
        "alloc_free_pair_ns": round(pair_ns, 1),
        "alloc_ns": round(alloc_ns, 1),
        "free_ns": round(free_ns, 1),
        "pair_ns_runs": [round(r[0], 1) for r in sorted(runs, key=lambda r: r[0])],
        "pairs": pairs,
        "working_set_blocks": working_set,
        "repeats": repeats,
        "size_mix": f"allocation sizes of the bundled traces ({len(sizes)} samples, "
                    f"median {int(statistics.median(sizes))} B, max {max(sizes)} B)",
        "steady_state_fragmentation": round(fragmentation, 4),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--working-set", type=int, default=512, help="live blocks in the steady state")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "core_simulated.json"))
    args = parser.parse_args(argv)

    traces = [load_trace(path) for path in TRACES]
    figures = {"alloc_free": measure_pairs(size_mix(traces), args.pairs, args.working_set, args.repeats)}
    figures["traces"] = {}
    for trace in traces:
        result = replay_trace(trace)
        figures["traces"][os.path.basename(trace.path)] = {
            key: result[key] for key in (
                "num_ops", "peak_allocated_bytes", "peak_reserved_bytes", "fragmentation", "spilled_bytes",
                "restored_bytes", "num_migrations", "ns_per_alloc", "ns_per_free", "num_ooms")
        }
    figures["fragmentation_target"] = FRAGMENTATION_TARGET
    figures["fragmentation_target_met"] = all(
        t["fragmentation"] <= FRAGMENTATION_TARGET for t in figures["traces"].values())

    report = {
        "device": f"simulated (CPU: {cpu_model()})",
        "torch": torch_version(),
        "driver": None,
        "benchmark": "core_simulated",
        "figures": figures,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")

    pair = figures["alloc_free"]
    print(f"{report['device']}, torch {report['torch']}")
    print(f"alloc+free pair: {pair['alloc_free_pair_ns']:.0f} ns (alloc {pair['alloc_ns']:.0f} ns, "
          f"free {pair['free_ns']:.0f} ns; median of {args.repeats} runs of {args.pairs} pairs, "
          f"{args.working_set} live blocks)")
    print()
    header = f"{'trace':<24}{'ops':>8}{'peak alloc':>14}{'peak reserved':>15}{'frag':>8}{'ns/alloc':>10}{'ns/free':>9}"
    print(header)
    print("-" * len(header))
    for name, t in figures["traces"].items():
        verdict = "" if t["fragmentation"] <= FRAGMENTATION_TARGET else f"  above the {FRAGMENTATION_TARGET:.2f} target"
        print(f"{name:<24}{t['num_ops']:>8}{_core.format_size(t['peak_allocated_bytes']):>14}"
              f"{_core.format_size(t['peak_reserved_bytes']):>15}{t['fragmentation']:>8.3f}"
              f"{t['ns_per_alloc']:>10.0f}{t['ns_per_free']:>9.0f}{verdict}")
    print(f"\nwrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
