"""The allocation traces bundled with cotenant, in one list for the
benchmarks, the tests and scripts/run_main.sh: the synthetic traces
scripts/make_traces.py writes (benchmarks/traces/*.jsonl.gz) and the
memory snapshots recorded on a GPU (benchmarks/traces/recorded/*.pickle.gz).

Run as a script, it prints every trace's path relative to the working
directory, one per line."""

import glob
import gzip
import json
import os
from typing import List

TRACES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces")


def synthetic() -> List[str]:
    """The synthetic traces, by name."""
    return sorted(glob.glob(os.path.join(TRACES_DIR, "*.jsonl.gz")))


def recorded() -> List[str]:
    """The recorded memory snapshots, by name."""
    return sorted(glob.glob(os.path.join(TRACES_DIR, "recorded", "*.pickle.gz")))


def every() -> List[str]:
    """The synthetic traces, then the recorded snapshots."""
    return synthetic() + recorded()


def training_loop(path: str) -> bool:
    """Whether a bundled trace's iterations are the steps of a training loop,
    the loops the target of no page map once warm is for. make_traces.py
    writes what an iteration is in the trace's meta record ("iteration =
    training step"; gpt_generate's are generated tokens and serve_varbatch's
    request batches, each free to need more memory than any before it); the
    recorded snapshots are training runs, named *_train*."""
    if path.endswith(".jsonl.gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            meta = json.loads(f.readline())
        return meta.get("op") == "meta" and meta.get("workload", "").endswith("iteration = training step")
    return "_train" in os.path.basename(path)


if __name__ == "__main__":
    print("\n".join(os.path.relpath(path) for path in every()))
