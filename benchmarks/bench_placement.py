#!/usr/bin/env python3
"""Every bundled trace, synthetic and recorded, replayed by the allocator
core of an earlier commit ("before") and by this tree's ("after"), on the
same operations in the same run.

    python benchmarks/bench_placement.py [--before d7d7ed6] [--before-core PATH] [--repeats 3]
                                         [--out benchmarks/results/placement_before_after.json]

The default "before" is commit d7d7ed6: separate 2 MiB / 20 MiB /
per-request segments, cached pages unmapped whenever reserved memory would
pass 1.05x the peak of live bytes, and allocations over a cap placed on the
host. Its core's Python module (`_core`) is built from `git archive REV`
into a temporary folder with cmake, and ninja where there is one (about 30 s
on two cores; needs git history, fmt and torch's pybind11, as the tree's own
build does), unless --before-core names one already built.

Each trace is read once, by this tree's parser (cotenant.replay.load_trace);
both cores replay the same operations, each in a child process of its own
(two builds of one extension module do not share a process), on a
simulated 16 GiB device with 2 MiB pages: uncapped, and with the cap at
half the trace's peak of allocated bytes. Each replay runs --repeats times;
the run with the median alloc+free time counts, and every other figure must
be the same in every run (the placement is deterministic).

Writes {"device", "torch", "driver": null, "benchmark":
"placement_before_after", "how", "before_commit", "before": {trace:
{"uncapped": figures, "half_cap": figures}}, "after": {...}} and prints the
before -> after table of the README.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEFORE_COMMIT = "d7d7ed6"
DEVICE_CAPACITY = 16 << 30
GRANULARITY = 2 << 20
HOST_CAPACITY = 1 << 40
MIB = 1 << 20
# Figures that vary from run to run; every other one must not.
TIMES = ("alloc_ns_total", "free_ns_total", "ns_per_alloc", "ns_per_free")

sys.path.insert(0, HERE)
import bundled_traces  # noqa: E402
from result_file import cpu_model, torch_version, write_json  # noqa: E402


def trace_name(path: str) -> str:
    """gpt_train for .../gpt_train.jsonl.gz, resnet50_train-h100 for a recording."""
    return os.path.basename(path).split(".")[0]


# ---- the child: one core, every trace ------------------------------------------------


def load_core(path: str):
    """The _core extension module at `path` (any build of it)."""
    spec = importlib.util.spec_from_file_location("_core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path} is not a Python extension module; pass the _core*.so file a build made")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_median(core, ops, cap: Optional[int], repeats: int) -> Dict[str, Any]:
    """The run with the median alloc+free time of `repeats` replays, after
    checking that every other figure is the same in each."""
    runs = [core.replay(ops, device_capacity=DEVICE_CAPACITY, granularity=GRANULARITY,
                        host_capacity=HOST_CAPACITY, cap=cap) for _ in range(repeats)]
    steady = [{k: v for k, v in run.items() if k not in TIMES} for run in runs]
    if any(other != steady[0] for other in steady[1:]):
        raise SystemExit(f"{core.__file__}: a replay gave different figures from one run to the next")
    runs.sort(key=lambda run: run["ns_per_alloc"] + run["ns_per_free"])
    median = runs[len(runs) // 2]
    median.pop("final_stats", None)  # the allocator's statistics at the end: not a placement figure
    return median


def child(core_path: str, ops_path: str, out_path: str, repeats: int) -> int:
    core = load_core(core_path)
    with open(ops_path, "rb") as f:
        traces: Dict[str, List[Tuple]] = pickle.load(f)
    results = {}
    for name, ops in traces.items():
        uncapped = replay_median(core, ops, None, repeats)
        half_cap = replay_median(core, ops, uncapped["peak_allocated_bytes"] // 2, repeats)
        results[name] = {"uncapped": uncapped, "half_cap": half_cap}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


def replay_with(core_path: str, ops_path: str, repeats: int) -> Dict[str, Any]:
    """Every trace in `ops_path` replayed by the core at `core_path`, in a child process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", core_path, ops_path, out.name,
                        "--repeats", str(repeats)], check=True)
        with open(out.name, encoding="utf-8") as f:
            return json.load(f)


# ---- the before core ---------------------------------------------------------------------


def build_core(commit: str, work: str) -> str:
    """Builds the _core module of `commit` under `work`; returns its path."""
    source, build = os.path.join(work, "source"), os.path.join(work, "build")
    os.makedirs(source)
    archive = subprocess.run(["git", "-C", REPO, "archive", commit], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {commit} failed ({archive.stderr.decode().strip()}): run this in a clone "
                         f"of cotenant that has commit {commit}, or pass --before-core with a built _core module")
    subprocess.run(["tar", "-x", "-C", source], input=archive.stdout, check=True)
    print(f"building the _core module of {commit} in {build} ...", flush=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    try:
        subprocess.run(["cmake", "-S", source, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                        "-DCOTENANT_BUILD_TESTS=OFF", "-DCOTENANT_BUILD_PYTHON=ON", "-DCOTENANT_BUILD_TORCH=OFF",
                        f"-DPython3_EXECUTABLE={sys.executable}"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", build, "--target", "_core"], check=True, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"building the core of {commit} failed: cmake exited with status {error.returncode} "
                         "(its message is above); install what it names, or pass --before-core with a _core "
                         f"module built from {commit} elsewhere") from None
    except OSError as error:
        raise SystemExit(f"building the core of {commit} needs cmake ({error}): install cmake, or pass "
                         f"--before-core with a _core module built from {commit} elsewhere") from None
    built = [os.path.join(root, name) for root, _, names in os.walk(build) for name in names
             if name.startswith("_core") and name.endswith(".so")]
    if len(built) != 1:
        raise SystemExit(f"the build of {commit} made {len(built)} _core modules, expected one: {built}")
    return built[0]


# ---- the table ---------------------------------------------------------------------------


def row_figures(result: Dict[str, Any]) -> Dict[str, float]:
    """The README's columns for one trace under one core."""
    uncapped, half = result["uncapped"], result["half_cap"]
    return {
        "fragmentation": uncapped["fragmentation"],
        "page maps": uncapped["num_page_maps"],
        "maps per peak page": uncapped["maps_per_peak_page"],
        "maps per warm iteration": uncapped["steady_maps_per_iteration"],
        "host MiB touched per warm iteration (cap 1/2 peak)": half["steady_host_touched_bytes_per_iteration"] / MIB,
        "MiB moved (cap 1/2 peak)": (half["spilled_bytes"] + half["restored_bytes"]) / MIB,
        "ns alloc+free": uncapped["ns_per_alloc"] + uncapped["ns_per_free"],
    }


FORMATS = {"fragmentation": "{:.3f}", "page maps": "{:.0f}", "maps per peak page": "{:.2f}",
           "maps per warm iteration": "{:.2f}", "host MiB touched per warm iteration (cap 1/2 peak)": "{:.0f}",
           "MiB moved (cap 1/2 peak)": "{:.0f}", "ns alloc+free": "{:.0f}"}


def table(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    lines = ["| trace | " + " | ".join(FORMATS) + " |", "|---|" + "---|" * len(FORMATS)]
    for name in after:
        old, new = row_figures(before[name]), row_figures(after[name])
        cells = [f"{fmt.format(old[key])} → {fmt.format(new[key])}" for key, fmt in FORMATS.items()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE_COMMIT, help="the commit whose core is 'before'")
    parser.add_argument("--before-core", help="a _core module already built from that commit (skips the build)")
    parser.add_argument("--repeats", type=int, default=3, help="replays of each trace; the median time counts")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "placement_before_after.json"))
    parser.add_argument("--child", nargs=3, metavar=("CORE", "OPS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1 run per trace")
    if args.child:
        return child(*args.child, args.repeats)

    from cotenant import _core as after_core
    from cotenant.replay import load_trace

    with tempfile.TemporaryDirectory(prefix="cotenant-placement-") as work:
        before_core = args.before_core or build_core(args.before, work)
        ops_path = os.path.join(work, "ops.pickle")
        with open(ops_path, "wb") as f:
            pickle.dump({trace_name(path): load_trace(path).ops for path in bundled_traces.every()}, f)
        before = replay_with(os.path.abspath(before_core), ops_path, args.repeats)
        after = replay_with(after_core.__file__, ops_path, args.repeats)

    report = {
        "device": f"simulated (CPU: {cpu_model()}), {DEVICE_CAPACITY >> 30} GiB device, {GRANULARITY >> 20} MiB pages",
        "torch": torch_version(),
        "driver": None,
        "benchmark": "placement_before_after",
        "before_commit": args.before,
        "how": (f"each bundled trace (bundled_traces.every()) replayed by the _core of commit {args.before} "
                "('before') and of this tree ('after'), on the same operations, uncapped and with cap = "
                f"peak_allocated_bytes // 2; the median of {args.repeats} runs by alloc+free time"),
        "before": before,
        "after": after,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(report, args.out)
    print(f"{report['device']}, torch {report['torch']}; before = {args.before}, after = this tree")
    print("\n".join(table(before, after)))
    print(f"\nwrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
