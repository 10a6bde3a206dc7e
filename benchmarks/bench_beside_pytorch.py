#!/usr/bin/env python3
"""cotenant's allocator beside PyTorch's own on the same trace, on the CPU.

    python benchmarks/bench_beside_pytorch.py [--tool build/core/pytorch_replay]
        [--out benchmarks/results/beside_pytorch.json] [TRACE ...]

Each trace (by default every bundled one; any file cotenant-replay reads) is
replayed three times:
  cotenant            cotenant's CachingAllocator on the simulated device
                      (cotenant.replay.replay_trace, what cotenant-replay runs)
  pytorch             PyTorch's CUDA caching allocator with its defaults
  pytorch expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PyTorch's runs are libc10_cuda.so of the installed torch wheel, unchanged,
driven by pytorch_replay (benchmarks/pytorch_allocator, built by CMake with
the core) over the fake CUDA runtime and driver of tests/fake_cuda: its
cudaMalloc, cudaFree, cuMemMap and cuMemUnmap calls are counted there.

Figures per allocator:
  fragmentation        peak reserved / peak allocated, the same denominator for
                       all three: the peak of live bytes with each request
                       rounded up to 512 (cotenant's statistic; PyTorch's own
                       counts a large block's unsplit tail as allocated too)
  obtained per peak    device memory the allocator took from the driver over
                       the run / its peak reserved: 1.00 when it never gave
                       memory back to take it again (cotenant's maps per peak page)
  driver calls         cotenant: page maps (2 MiB each); PyTorch: cudaMalloc
                       calls, or cuMemMap calls with expandable segments
  new pages/warm iter  device memory taken from the driver per iteration, in
                       2 MiB pages (cotenant's page maps per warm iteration),
                       the mean over the last half of the iterations

Each trace is also recorded as a PyTorch memory snapshot by PyTorch itself
(pytorch_allocator/snapshot_over_fake.py: torch over the same fake runtime,
torch.cuda.memory._record_memory_history, torch.empty and del, then
_dump_snapshot), with each configuration, and read back the way
cotenant-replay reads a snapshot (cotenant.replay.load_trace). The check: the
PyTorch figures read from the snapshot's segment events (peak reserved, peak
of requested bytes, cudaMalloc and cudaFree calls) equal PyTorch's own
memory_stats() and the fake's counts, and cotenant replaying the snapshot
(iteration marks read from its annotations) gives the same peak allocated
and reserved bytes, page maps and iterations as replaying the trace. --no-snapshots skips
it (a torch wheel without CUDA cannot record one).

What it does not compare: time (the fake's calls cost nothing, a GPU's do)
and spill (PyTorch has none: over its limit it raises OutOfMemoryError).

Writes {"device": "simulated (CPU: ...)", "torch": ..., "benchmark":
"beside_pytorch", "figures": {...}} and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
EXPANDABLE = "expandable_segments:True"
# PyTorch's two configurations: name -> PYTORCH_CUDA_ALLOC_CONF
PYTORCH_CONFIGS = {"pytorch": "", "pytorch_expandable": EXPANDABLE}
PAGE = 2 << 20  # cotenant's page, the replay's default granularity

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "pytorch_allocator"))
import bundled_traces  # noqa: E402
from result_file import cpu_model, torch_version  # noqa: E402

TRACES = bundled_traces.synthetic()
from over_fake import default_pytorch_replay as default_tool  # noqa: E402
from over_fake import fake_cudart_beside  # noqa: E402
from snapshot_over_fake import record as record_snapshot  # noqa: E402

from cotenant.replay import Trace, load_trace, replay_trace  # noqa: E402


def operations_text(trace: Trace) -> str:
    """The trace's allocations, frees and iteration marks in pytorch_replay's
    input format. Cap changes and other operations have no PyTorch counterpart."""
    lines = []
    for op in trace.ops:
        if op[0] == "alloc":
            lines.append(f"a {op[1]} {op[2]} {op[3]}")
        elif op[0] == "free":
            lines.append(f"f {op[1]}")
        elif op[0] == "iteration":
            lines.append("i")
    return "\n".join(lines) + "\n"


def run_pytorch(tool: str, ops_text: str, alloc_conf: str) -> Dict[str, Any]:
    """PyTorch's allocator over the operations: pytorch_replay's JSON. Raises
    RuntimeError with its message when it fails or the fake saw a call it
    does not model."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    done = subprocess.run([tool], input=ops_text, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        detail = done.stderr.strip().splitlines()[:3] or done.stdout.strip().splitlines()[-1:]
        raise RuntimeError(f"{tool} (PYTORCH_CUDA_ALLOC_CONF={alloc_conf!r}) failed with exit status "
                           f"{done.returncode}: {' / '.join(detail)}")
    return json.loads(done.stdout)


def warm_mean(per_iteration: Sequence[float]) -> Optional[float]:
    """The mean over the last half of the iterations; None under 2 iterations
    (cotenant's replay reports its steady state the same way)."""
    if len(per_iteration) < 2:
        return None
    warm = per_iteration[len(per_iteration) // 2:]
    return sum(warm) / len(warm)


def pytorch_figures(raw: Dict[str, Any], expandable: bool, peak_allocated: int) -> Dict[str, Any]:
    """PyTorch's figures, its fragmentation over `peak_allocated` (cotenant's)."""
    reserved = raw["peak_reserved_bytes"]
    calls = raw["cu_mem_map_calls"] if expandable else raw["cuda_malloc_calls"]
    return {
        "own_peak_allocated_bytes": raw["peak_allocated_bytes"],
        "peak_reserved_bytes": reserved,
        "fragmentation": reserved / peak_allocated if peak_allocated else 0.0,
        "obtained_per_peak": raw["device_bytes_obtained"] / reserved if reserved else 0.0,
        "driver_calls": calls,
        "driver_call": "cuMemMap" if expandable else "cudaMalloc",
        "frees_to_driver": raw["cu_mem_unmap_calls"] if expandable else raw["cuda_free_calls"],
        "new_calls_per_warm_iteration": warm_mean(raw["new_memory_calls_per_iteration"]),
        "new_pages_per_warm_iteration": warm_mean([b / PAGE for b in raw["new_device_bytes_per_iteration"]]),
        "num_alloc_retries": raw["num_alloc_retries"],
    }


def cotenant_figures(result: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "own_peak_allocated_bytes": result["peak_allocated_bytes"],
        "peak_reserved_bytes": result["peak_reserved_bytes"],
        "fragmentation": result["fragmentation"],
        "obtained_per_peak": result["maps_per_peak_page"],
        "driver_calls": result["num_page_maps"],
        "driver_call": "cuMemMap (2 MiB)",
        "frees_to_driver": result["num_page_unmaps"],
        "new_calls_per_warm_iteration": result["steady_maps_per_iteration"],
        "new_pages_per_warm_iteration": result["steady_maps_per_iteration"],
    }


def compare(trace: Trace, tool: str, result: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The three replays of one trace (`result`: cotenant's, when already
    replayed), and whether cotenant's peak reserved (so its fragmentation) is
    at most each of PyTorch's."""
    result = result or replay_trace(trace)
    figures = {"peak_allocated_bytes": result["peak_allocated_bytes"], "cotenant": cotenant_figures(result)}
    ops_text = operations_text(trace)
    for name, conf in PYTORCH_CONFIGS.items():
        raw = run_pytorch(tool, ops_text, conf)
        figures[name] = pytorch_figures(raw, conf == EXPANDABLE, result["peak_allocated_bytes"])
    ours = figures["cotenant"]["peak_reserved_bytes"]
    figures["reserved_at_most"] = {name: ours <= figures[name]["peak_reserved_bytes"] for name in PYTORCH_CONFIGS}
    return figures


# cotenant's figures that replaying a snapshot must give as replaying its trace does
SAME_AS_TRACE = ("peak_allocated_bytes", "peak_reserved_bytes", "num_page_maps", "num_iterations")


def snapshot_check(trace_path: str, ours_on_trace: Dict[str, Any], fake_dir: str, work_dir: str) -> Dict[str, Any]:
    """Each PyTorch configuration's snapshot of the trace, recorded by PyTorch
    over the fake, read back as cotenant-replay reads it, beside what PyTorch
    and the fake counted while recording it, and cotenant's replay of it
    beside cotenant's replay of the trace."""
    checks: Dict[str, Any] = {}
    name = os.path.basename(trace_path).split(".")[0]
    for config, conf in PYTORCH_CONFIGS.items():
        out = os.path.join(work_dir, f"{name}-{config}.pickle")
        recorded = record_snapshot(trace_path, out, fake_dir, expandable_segments=conf == EXPANDABLE)
        snapshot = load_trace(out)
        read = snapshot.pytorch
        stats, fake = recorded["memory_stats"], recorded["fake"]
        ours = replay_trace(snapshot)
        expected = {
            "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
            "peak_live_bytes": stats["requested_bytes.all.peak"],
            "num_cuda_mallocs": fake["cuda_malloc_calls"],
            "num_cuda_frees": fake["cuda_free_calls"],
        }
        checks[config] = {
            "read_from_snapshot": {key: read.get(key) for key in (*expected, "start", "num_segment_maps")},
            "recorded": {**expected, "cu_mem_map_calls": fake["cu_mem_map_calls"]},
            "agrees": read.get("available") is True and all(read.get(k) == v for k, v in expected.items()),
            "cotenant_on_snapshot": {key: ours[key] for key in SAME_AS_TRACE},
            "cotenant_as_on_trace": all(ours[key] == ours_on_trace[key] for key in SAME_AS_TRACE),
        }
    return checks


def print_snapshot_table(traces: Dict[str, Dict[str, Any]]) -> None:
    header = (f"{'trace':<20}{'snapshot of':<20}{'peak reserved read / own':>26}{'peak requested read / own':>27}"
              f"{'cudaMalloc read / fake':>24}{'agrees':>8}{'cotenant same':>14}")
    print(header)
    print("-" * len(header))
    for name, t in traces.items():
        for config, c in t.get("snapshot", {}).items():
            read, own = c["read_from_snapshot"], c["recorded"]
            print(f"{name.split('.')[0] if config == 'pytorch' else '':<20}{config.replace('_', ' '):<20}"
                  f"{read['peak_reserved_bytes'] / 2**20:>13.1f} / {own['peak_reserved_bytes'] / 2**20:.1f} MiB"
                  f"{read['peak_live_bytes'] / 2**20:>14.1f} / {own['peak_live_bytes'] / 2**20:.1f} MiB"
                  f"{read['num_cuda_mallocs']:>16} / {own['num_cuda_mallocs']:<5}"
                  f"{'yes' if c['agrees'] else 'NO':>8}{'yes' if c['cotenant_as_on_trace'] else 'NO':>13}")
    print("(read: cotenant.replay's reading of the snapshot PyTorch recorded; own: PyTorch's memory_stats() and "
          "the fake's cudaMalloc count while it recorded; cotenant same: cotenant's peak allocated and reserved, "
          "page maps and iterations replaying the snapshot equal those replaying the trace)")


def print_table(traces: Dict[str, Dict[str, Any]]) -> None:
    header = (f"{'trace':<20}{'allocator':<20}{'peak reserved':>14}{'frag':>7}{'obtained/peak':>15}"
              f"{'driver calls':>24}{'new pages/warm iter':>21}")
    print(header)
    print("-" * len(header))
    for name, t in traces.items():
        for allocator in ("cotenant", *PYTORCH_CONFIGS):
            f = t[allocator]
            warm = f["new_pages_per_warm_iteration"]
            calls = f"{f['driver_calls']} {f['driver_call'].split()[0]}"
            print(f"{name.split('.')[0] if allocator == 'cotenant' else '':<20}{allocator.replace('_', ' '):<20}"
                  f"{f['peak_reserved_bytes'] / 2**20:>10.1f} MiB{f['fragmentation']:>7.3f}"
                  f"{f['obtained_per_peak']:>15.2f}{calls:>24}{'-' if warm is None else f'{warm:.2f}':>21}")
    print("(frag: peak reserved / peak allocated; obtained/peak: device memory taken from the driver over the "
          "run / peak reserved; new pages/warm iter: 2 MiB pages of device memory taken from the driver per "
          "iteration, mean over the last half)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", metavar="TRACE", help="trace files (default: every bundled trace)")
    parser.add_argument("--tool", default=default_tool(), help="pytorch_replay (default: %(default)s)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "beside_pytorch.json"))
    parser.add_argument("--no-snapshots", action="store_true",
                        help="do not record PyTorch snapshots of the traces to check cotenant-replay's reading")
    args = parser.parse_args(argv)
    if not os.access(args.tool, os.X_OK):
        parser.error(f"{args.tool} is not built: build the core with CMake (scripts/test.sh does, into "
                     "build/core) next to a torch wheel with CUDA, or give its path with --tool")

    traces = {}
    fake_dir = fake_cudart_beside(args.tool)
    with tempfile.TemporaryDirectory(prefix="cotenant-snapshots-") as work_dir:
        for path in args.traces or TRACES:
            trace = load_trace(path)
            ours = replay_trace(trace)
            figures = compare(trace, args.tool, ours)
            if not args.no_snapshots:
                figures["snapshot"] = snapshot_check(path, ours, fake_dir, work_dir)
            traces[os.path.basename(path)] = figures
    report = {
        "device": f"simulated (CPU: {cpu_model()}); PyTorch's allocator over the fake CUDA runtime",
        "torch": torch_version(),
        "driver": None,
        "benchmark": "beside_pytorch",
        "figures": {"traces": traces},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"{report['device']}, torch {report['torch']}")
    print_table(traces)
    above = [name for name, t in traces.items() if not all(t["reserved_at_most"].values())]
    print(f"cotenant's fragmentation is above PyTorch's on: {', '.join(above) if above else 'none'}")
    if not args.no_snapshots:
        print()
        print_snapshot_table(traces)
        wrong = [f"{name} ({config})" for name, t in traces.items() for config, c in t["snapshot"].items()
                 if not (c["agrees"] and c["cotenant_as_on_trace"])]
        print(f"snapshots read differently from what PyTorch counted or from their trace: "
              f"{', '.join(wrong) if wrong else 'none'}")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
