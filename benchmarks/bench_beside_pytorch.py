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

What it does not compare: time (the fake's calls cost nothing, a GPU's do)
and spill (PyTorch has none: over its limit it raises OutOfMemoryError).

Writes {"device": "simulated (CPU: ...)", "torch": ..., "benchmark":
"beside_pytorch", "figures": {...}} and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRACES = sorted(glob.glob(os.path.join(HERE, "traces", "*.jsonl.gz")))
EXPANDABLE = "expandable_segments:True"
# PyTorch's two configurations: name -> PYTORCH_CUDA_ALLOC_CONF
PYTORCH_CONFIGS = {"pytorch": "", "pytorch_expandable": EXPANDABLE}
PAGE = 2 << 20  # cotenant's page, the replay's default granularity

sys.path.insert(0, HERE)
from result_file import cpu_model, torch_version  # noqa: E402

from cotenant.replay import Trace, load_trace, replay_trace  # noqa: E402


def default_tool() -> str:
    """Where the core build puts pytorch_replay: $COTENANT_PYTORCH_REPLAY, or
    build/core/pytorch_replay (scripts/test.sh's core build)."""
    return os.environ.get("COTENANT_PYTORCH_REPLAY") or os.path.join(ROOT, "build", "core", "pytorch_replay")


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


def compare(trace: Trace, tool: str) -> Dict[str, Any]:
    """The three replays of one trace, and whether cotenant's peak reserved
    (so its fragmentation) is at most each of PyTorch's."""
    result = replay_trace(trace)
    figures = {"peak_allocated_bytes": result["peak_allocated_bytes"], "cotenant": cotenant_figures(result)}
    ops_text = operations_text(trace)
    for name, conf in PYTORCH_CONFIGS.items():
        raw = run_pytorch(tool, ops_text, conf)
        figures[name] = pytorch_figures(raw, conf == EXPANDABLE, result["peak_allocated_bytes"])
    ours = figures["cotenant"]["peak_reserved_bytes"]
    figures["reserved_at_most"] = {name: ours <= figures[name]["peak_reserved_bytes"] for name in PYTORCH_CONFIGS}
    return figures


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
    args = parser.parse_args(argv)
    if not os.access(args.tool, os.X_OK):
        parser.error(f"{args.tool} is not built: build the core with CMake (scripts/test.sh does, into "
                     "build/core) next to a torch wheel with CUDA, or give its path with --tool")

    traces = {}
    for path in args.traces or TRACES:
        traces[os.path.basename(path)] = compare(load_trace(path), args.tool)
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
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
