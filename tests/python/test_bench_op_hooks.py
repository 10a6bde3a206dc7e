"""benchmarks/bench_op_hooks.py: the CPU cost of cotenant's op hooks per mode,
torch over the fake CUDA runtime (a short run: the figures' values are the
benchmark's business, what each mode's hooks do is checked here)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "benchmarks")
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, "pytorch_allocator"))
import bench_op_hooks  # noqa: E402
import over_fake  # noqa: E402


def test_figures_and_table_compare_each_mode_with_plain_pytorch():
    runs = {
        "plain": {"tiny_op_us": 1.5, "step_us": 2000.0, "runtime_calls_per_op": 0.0},
        "enabled": {"tiny_op_us": 1.75, "step_us": 2500.0, "runtime_calls_per_op": 0.0, "ops_per_step": 243,
                    "markers_per_step": 0.0},
        "guaranteed": {"tiny_op_us": 2.0, "step_us": 3000.0, "runtime_calls_per_op": 0.1, "ops_per_step": 243,
                       "markers_per_step": 40.0},
    }
    figures = bench_op_hooks.figures(runs)
    assert figures == pytest.approx({"enabled.overhead_us_per_op": 0.25, "enabled.step_ratio": 1.25,
                                     "guaranteed.overhead_us_per_op": 0.5, "guaranteed.step_ratio": 1.5})
    lines = bench_op_hooks.table(runs, figures)
    assert len(lines) == 4 and lines[3].split()[:6] == ["guaranteed", "2.00", "+0.50", "3000", "1.500", "243"]


def test_a_short_run_shows_what_each_modes_hooks_do(tmp_path):
    try:
        fake_dir = os.path.dirname(over_fake.fake_library())
    except ValueError as error:
        pytest.skip(f"{error} (COTENANT_PYTORCH_REPLAY names the core build's pytorch_replay)")
    out = tmp_path / "op_hooks.json"
    result = subprocess.run([sys.executable, os.path.join(BENCH, "bench_op_hooks.py"), "--fake-cudart", fake_dir,
                             "--ops", "2000", "--steps", "4", "--repeats", "1", "--rounds", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert set(runs) == set(bench_op_hooks.MODES)
    # One interception point counts the same outermost ops in every mode.
    counts = {runs[mode]["ops_per_step"] for mode in ("enabled", "guaranteed", "opportunistic")}
    assert len(counts) == 1 and counts.pop() > 50
    # Without a role an op makes no CUDA call; the guaranteed job's tracker
    # records its markers from the exit hook, at most one per 50 µs.
    assert runs["enabled"]["runtime_calls_per_op"] == 0 and runs["enabled"]["markers_per_step"] == 0
    assert runs["guaranteed"]["markers_per_step"] > 0 and runs["guaranteed"]["runtime_calls_per_op"] > 0
    # CPU ops pass an opportunistic job's gate unadmitted: no marker, no CUDA call.
    assert runs["opportunistic"]["runtime_calls_per_op"] == 0
    assert set(data["figures"]) == {f"{mode}.{name}" for mode in ("enabled", "guaranteed", "opportunistic")
                                    for name in ("overhead_us_per_op", "step_ratio")}
