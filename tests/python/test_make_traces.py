"""The bundled traces (scripts/make_traces.py's output) say where they came
from and mark the end of each pass of their workload's loop. The files are
only read: no model runs here."""

import gzip
import json
import os

import pytest

from script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_TRACES = load_script(os.path.join(REPO, "benchmarks", "bundled_traces.py")).synthetic()

# A loop needs a cold first pass and warm ones after it.
FEWEST_ITERATIONS = 6


def records(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_bundled_traces_include_workloads_of_varying_shapes():
    names = {os.path.basename(path).split(".")[0] for path in BUNDLED_TRACES}
    assert {"gpt_train_varlen", "gpt_train_buckets", "resnet_multiscale", "moe_train", "serve_varbatch",
            "detection_train"} <= names


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_opens_with_a_meta_line_naming_its_workload_and_command(path):
    meta = records(path)[0]
    assert meta["op"] == "meta"
    assert meta["trace"] == os.path.basename(path).split(".")[0]
    assert meta["workload"] and meta["torch"]
    assert meta["command"].startswith("python scripts/make_traces.py")


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_marks_as_many_iterations_as_its_meta_line_says(path):
    trace = records(path)
    marks = sum(1 for record in trace if record["op"] == "iteration")
    assert marks == trace[0]["iterations"]
    assert marks >= FEWEST_ITERATIONS


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_every_iteration_of_a_bundled_trace_allocates(path):
    # Marks bunched together would mean the profiler's ranges and allocations were put in the wrong order.
    allocations_per_iteration = [0]
    for record in records(path)[1:]:
        if record["op"] == "iteration":
            allocations_per_iteration.append(0)
        elif record["op"] == "alloc":
            allocations_per_iteration[-1] += 1
    assert min(allocations_per_iteration[:-1]) > 0


def test_the_bundled_traces_are_the_bundled_workloads_and_the_others_are_made_only_when_named():
    make_traces = load_script(os.path.join(REPO, "scripts", "make_traces.py"))
    names = sorted(os.path.basename(path).split(".")[0] for path in BUNDLED_TRACES)
    assert sorted(make_traces.bundled_workloads()) == names
    others = set(make_traces.WORKLOADS) - set(names)
    assert {"gpt_recorded_program", "gpt_train_lengths"} <= others
