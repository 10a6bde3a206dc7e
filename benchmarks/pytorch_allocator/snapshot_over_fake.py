#!/usr/bin/env python3
"""A PyTorch memory snapshot of a trace, recorded by PyTorch itself, on the CPU.

    python benchmarks/pytorch_allocator/snapshot_over_fake.py TRACE OUT.pickle
        [--fake-cudart DIR] [--expandable-segments] [--max-entries N]
        [--device-capacity BYTES]

A child Python process imports torch with the fake CUDA runtime of
tests/fake_cuda as its libcudart (DIR/libcudart.so.N, preloaded; DIR also
holds the libcuda.so.1 link torch's lazy driver stubs open), turns PyTorch's
memory history on (torch.cuda.memory._record_memory_history, no stack
frames, global_record_annotations=True), replays the trace's allocations and
frees as torch.empty(SIZE, dtype=torch.uint8, device="cuda") and del, each on
its stream, each pass between two iteration marks inside
torch.profiler.record_function("cotenant::iteration") (the range whose end
cotenant-replay reads as a mark, as scripts/make_traces.py made the bundled
traces), and writes the snapshot with torch.cuda.memory._dump_snapshot while recording is still on.
torch.empty launches no kernel, so the fake serves all of it. The snapshot is
PyTorch's own file, as a user on a GPU would record it: segment events,
segment list and all, from PyTorch's recorder and allocator, unchanged.

It prints one JSON object: PyTorch's memory_stats() at the end (peak and
current reserved bytes, segments allocated), the calls the fake counted
(cudaMalloc, cudaFree, cuMemMap, cuMemUnmap, device bytes handed out) and the
fake's violations (any call it does not model; the exit status is then 1).
bench_beside_pytorch.py checks cotenant-replay's reading of each snapshot
against these figures.

DIR defaults to the fake_cudart directory next to pytorch_replay
($COTENANT_PYTORCH_REPLAY, or build/core/pytorch_replay). The child refuses to
run unless the device torch sees is the fake, so it never touches a real GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from over_fake import (NotPreloaded, check_torch_sees_the_fake, default_fake_cudart, environment,  # noqa: E402
                       fake_library, open_preloaded)

DEFAULT_CAPACITY = 16 << 30  # as pytorch_replay: expandable segments reserve address space the device's size
ITERATION_RANGE = "cotenant::iteration"  # what cotenant.replay reads as an iteration mark
STATS = ("reserved_bytes.all.peak", "reserved_bytes.all.current", "allocated_bytes.all.peak",
         "requested_bytes.all.peak", "segment.all.allocated", "num_alloc_retries", "num_ooms")
FAKE_CALLS = {"cuda_malloc_calls": "cudaMalloc", "cuda_free_calls": "cudaFree", "cu_mem_map_calls": "cuMemMap",
              "cu_mem_unmap_calls": "cuMemUnmap"}


def record(trace_path: str, out: str, fake_dir: Optional[str] = None, expandable_segments: bool = False,
           max_entries: Optional[int] = None, device_capacity: int = DEFAULT_CAPACITY) -> Dict[str, Any]:
    """Records the snapshot of `trace_path` into `out` in a child process and
    returns its figures. RuntimeError with the child's message when it fails."""
    library = fake_library(fake_dir or default_fake_cudart())
    env = environment(library)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" if expandable_segments else ""
    command = [sys.executable, os.path.abspath(__file__), "--child", library, trace_path, out,
               "--device-capacity", str(device_capacity)]
    if max_entries is not None:
        command += ["--max-entries", str(max_entries)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        detail = done.stderr.strip().splitlines()[-3:] or lines[-1:]
        raise RuntimeError(f"recording {trace_path} over the fake CUDA runtime failed with exit status "
                           f"{done.returncode}: {' / '.join(detail)}")
    return json.loads(lines[-1])


# ---- the child: torch over the fake -----------------------------------------------------------


def _child(library: str, trace_path: str, out: str, max_entries: Optional[int], capacity: int) -> int:
    try:
        fake = open_preloaded(library, capacity)
    except NotPreloaded as error:
        print(error, file=sys.stderr)
        return 2

    import torch  # after the reset: torch starts on the configured device

    from cotenant.replay import load_trace

    try:
        check_torch_sees_the_fake(torch)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 2
    trace = load_trace(trace_path)
    torch.cuda.memory._record_memory_history(context=None, stacks="python", global_record_annotations=True,
                                             max_entries=max_entries if max_entries else sys.maxsize)
    streams: Dict[int, torch.cuda.Stream] = {0: torch.cuda.default_stream()}
    live: Dict[Any, torch.Tensor] = {}
    # Each pass between the trace's iteration marks runs inside
    # record_function("cotenant::iteration"), as scripts/make_traces.py ran it;
    # a range opens at the pass's first operation, so every mark is where the trace has one.
    in_pass: Optional[torch.profiler.record_function] = None
    for op in trace.ops:
        if op[0] == "iteration":
            if in_pass is None:
                in_pass = torch.profiler.record_function(ITERATION_RANGE).__enter__()
            in_pass.__exit__(None, None, None)
            in_pass = None
        elif op[0] in ("alloc", "free"):
            if in_pass is None:
                in_pass = torch.profiler.record_function(ITERATION_RANGE).__enter__()
            if op[0] == "alloc":
                _, block_id, size, stream = op[:4]
                if stream not in streams:
                    streams[stream] = torch.cuda.Stream()
                with torch.cuda.stream(streams[stream]):
                    live[block_id] = torch.empty(size, dtype=torch.uint8, device="cuda")
            else:
                del live[op[1]]
    torch.cuda.memory._dump_snapshot(out)  # before a pass left open ends: the trace has no mark there
    if in_pass is not None:
        in_pass.__exit__(None, None, None)
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled=None)
    figures = {
        "snapshot": out,
        "torch": torch.__version__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "max_entries": max_entries,
        "memory_stats": {key: stats.get(key, 0) for key in STATS},
        "fake": {key: fake.calls(entry) for key, entry in FAKE_CALLS.items()},
        "device_bytes_obtained": fake.device_bytes_created(),
        "fake_cuda_violations": fake.violations(),
    }
    print(json.dumps(figures))
    return 1 if figures["fake_cuda_violations"] else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child = argparse.ArgumentParser()
        child.add_argument("library")
        child.add_argument("trace")
        child.add_argument("out")
        child.add_argument("--max-entries", type=int)
        child.add_argument("--device-capacity", type=int, default=DEFAULT_CAPACITY)
        a = child.parse_args(argv[1:])
        return _child(a.library, a.trace, a.out, a.max_entries, a.device_capacity)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", metavar="TRACE", help="any trace cotenant-replay reads")
    parser.add_argument("out", metavar="OUT.pickle")
    parser.add_argument("--fake-cudart", metavar="DIR", help="the fake's directory (default: next to pytorch_replay)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="record with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--max-entries", type=int, metavar="N",
                        help="keep only the last N trace entries, as _record_memory_history(max_entries=N) does")
    parser.add_argument("--device-capacity", type=int, default=DEFAULT_CAPACITY, metavar="BYTES")
    args = parser.parse_args(argv)
    if args.max_entries is not None and args.max_entries < 1:
        parser.error(f"--max-entries {args.max_entries}: give at least 1")
    try:
        figures = record(args.trace, args.out, args.fake_cudart, args.expandable_segments, args.max_entries,
                         args.device_capacity)
    except (ValueError, RuntimeError) as error:
        print(f"snapshot_over_fake: {error}", file=sys.stderr)
        return 1
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
