"""benchmarks/bench_beside_pytorch.py and pytorch_replay: PyTorch's own CUDA
caching allocator (the wheel's libc10_cuda.so) replaying traces over the fake
CUDA runtime, beside cotenant's allocator on the same traces."""

import json
import os
import pickle
import subprocess
import sys

import pytest

from script_loader import load_script

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "benchmarks", "bench_beside_pytorch.py")
OVER_FAKE_DIR = os.path.join(HERE, "..", "..", "benchmarks", "pytorch_allocator")
RECORDER = os.path.join(OVER_FAKE_DIR, "snapshot_over_fake.py")
sys.path.insert(0, OVER_FAKE_DIR)
import over_fake  # noqa: E402

bench_traces = load_script(os.path.join(HERE, "..", "..", "benchmarks", "bundled_traces.py"))

TRACES = bench_traces.synthetic()
MiB = 1 << 20


@pytest.fixture(scope="module")
def bench():
    return load_script(PATH)


@pytest.fixture(scope="module")
def tool(bench):
    path = bench.default_tool()
    if not os.access(path, os.X_OK):
        pytest.skip(f"pytorch_replay is not built at {path}: the core's CMake build makes it next to a torch "
                    "wheel with CUDA (scripts/test.sh builds it and sets COTENANT_PYTORCH_REPLAY)")
    return path


def run(tool, text, conf=""):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    return subprocess.run([tool], input=text, capture_output=True, text=True, env=env)


# A request up to 1 MiB takes a 2 MiB segment of PyTorch's small pool; one of
# 1-10 MiB a 20 MiB segment of its large pool; a larger one fits what is left
# of that segment before any new cudaMalloc (c10/cuda/CUDACachingAllocator.cpp).
SEGMENT_RULES = "a 1 1048576 0\na 2 5000000 0\na 3 12000000 0\nf 1\nf 2\nf 3\ni\na 4 1048576 0\na 5 5000000 0\ni\n"


def test_pytorchs_segment_rules_hold_in_the_replay(tool):
    done = run(tool, SEGMENT_RULES)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["cuda_malloc_calls"] == 2
    assert figures["peak_reserved_bytes"] == 22 * MiB
    assert figures["peak_device_bytes"] == 22 * MiB  # the fake driver's count agrees with PyTorch's
    assert figures["new_memory_calls_per_iteration"] == [2, 0]  # the second pass reuses the cached blocks
    assert figures["new_device_bytes_per_iteration"] == [22 * MiB, 0]
    assert figures["cuda_free_calls"] == 0 and figures["cu_mem_map_calls"] == 0
    assert figures["fake_cuda_violations"] == []


def test_expandable_segments_map_pages_instead_of_cuda_malloc(tool):
    done = run(tool, SEGMENT_RULES, "expandable_segments:True")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["cuda_malloc_calls"] == 0
    assert figures["cu_mem_map_calls"] >= 2
    assert figures["device_bytes_obtained"] == figures["peak_reserved_bytes"]
    assert figures["fake_cuda_violations"] == []


def test_a_malformed_operation_is_named(tool):
    done = run(tool, "a 1 4096 0\nf 2\n")
    assert done.returncode == 1
    assert "free of id 2, which is not live" in done.stderr
    done = run(tool, "x\n")
    assert done.returncode == 1
    assert "unknown operation 'x'" in done.stderr


def test_the_operations_text_keeps_allocations_frees_and_marks(bench):
    trace = bench.load_trace(TRACES[0])
    text = bench.operations_text(trace).splitlines()
    kinds = [op[0] for op in trace.ops if op[0] in ("alloc", "free", "iteration")]
    assert len(text) == len(kinds)
    first = next(op for op in trace.ops if op[0] == "alloc")
    assert text[kinds.index("alloc")] == f"a {first[1]} {first[2]} {first[3]}"
    assert text.count("i") == kinds.count("iteration")


def test_warm_mean_is_the_last_half(bench):
    assert bench.warm_mean([9, 9, 1, 3]) == 2.0
    assert bench.warm_mean([5]) is None


_COMPARED = {}


def compared(bench, tool, path):
    if path not in _COMPARED:
        _COMPARED[path] = bench.compare(bench.load_trace(path), tool)
    return _COMPARED[path]


# cotenant's peak reserved is above PyTorch's default allocator on these
# traces: one page on gpt_train_varlen and 2 on moe_train (steps whose
# tensors change size with the sequence length or an expert's load form no
# plan, and best fit keeps every layout they reach mapped):
# docs/allocator.md, "Beside PyTorch's allocator".
ABOVE_PYTORCH = {("gpt_train_varlen.jsonl.gz", "pytorch"), ("moe_train.jsonl.gz", "pytorch")}


def reserved_cases():
    for path in TRACES:
        for config in ("pytorch", "pytorch_expandable"):
            marks = ()
            if (os.path.basename(path), config) in ABOVE_PYTORCH:
                marks = pytest.mark.xfail(strict=True, reason="known: docs/allocator.md, Beside PyTorch's allocator")
            yield pytest.param(path, config, marks=marks, id=f"{os.path.basename(path)}-{config}")


@pytest.mark.parametrize("path, config", list(reserved_cases()))
def test_cotenant_reserves_no_more_than_pytorch(bench, tool, path, config):
    figures = compared(bench, tool, path)
    assert figures["cotenant"]["peak_reserved_bytes"] <= figures[config]["peak_reserved_bytes"]
    assert figures["reserved_at_most"][config]


def test_the_benchmark_writes_every_allocators_figures(bench, tool, tmp_path, capsys):
    out = tmp_path / "beside.json"
    assert bench.main(["--tool", tool, "--out", str(out), TRACES[0]]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "beside_pytorch"
    trace = report["figures"]["traces"][os.path.basename(TRACES[0])]
    for allocator in ("cotenant", "pytorch", "pytorch_expandable"):
        figures = trace[allocator]
        assert figures["peak_reserved_bytes"] >= trace["peak_allocated_bytes"] > 0
        assert figures["fragmentation"] == pytest.approx(figures["peak_reserved_bytes"] / trace["peak_allocated_bytes"])
        assert figures["obtained_per_peak"] >= 1.0
    assert trace["pytorch"]["driver_call"] == "cudaMalloc"
    assert trace["pytorch_expandable"]["driver_call"] == "cuMemMap"
    assert "cotenant" in capsys.readouterr().out


def test_a_missing_tool_is_named_with_the_fix(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tool", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.json")])
    assert "is not built" in capsys.readouterr().err


# ---- snapshots PyTorch records over the fake --------------------------------------------------


@pytest.fixture(scope="module")
def fake_dir(tool):
    return over_fake.fake_cudart_beside(tool)


def trace_path(name):
    return next(path for path in TRACES if os.path.basename(path) == name)


def test_snapshots_pytorch_records_read_as_pytorch_counted(bench, tool, fake_dir, tmp_path):
    """torch itself, over the fake, records the snapshot; cotenant.replay's
    reading of it gives what PyTorch's memory_stats() and the fake counted, and
    cotenant's replay of it (iteration marks from its annotations) gives what
    cotenant's replay of the trace does."""
    path = trace_path("resnet_train.jsonl.gz")
    trace = bench.load_trace(path)
    ours = bench.replay_trace(trace)
    checks = bench.snapshot_check(path, ours, fake_dir, str(tmp_path))
    for config in ("pytorch", "pytorch_expandable"):
        check = checks[config]
        assert check["agrees"], check
        assert check["cotenant_as_on_trace"], (check["cotenant_on_snapshot"], ours)
        assert check["read_from_snapshot"]["start"] == "empty"
        assert check["cotenant_on_snapshot"]["num_iterations"] == trace.ops.count(("iteration",)) > 0
    assert checks["pytorch"]["read_from_snapshot"]["num_cuda_mallocs"] > 0
    assert checks["pytorch_expandable"]["read_from_snapshot"]["num_cuda_mallocs"] == 0
    assert checks["pytorch_expandable"]["read_from_snapshot"]["num_segment_maps"] > 0


def live_peak_of_the_last(ops, entries):
    """The most bytes live at once (each rounded up to 512, as cotenant
    counts them) over the ops behind the last `entries` entries of a
    snapshot's device trace: an allocation is one entry, a free two
    (free_requested, free_completed)."""
    ops = [op for op in ops if op[0] in ("alloc", "free")]
    first, need = len(ops), entries
    while need > 0:
        first -= 1
        need -= 1 if ops[first][0] == "alloc" else 2
    sizes, live, peak = {}, 0, 0
    for index, op in enumerate(ops):
        if op[0] == "alloc":
            sizes[op[1]] = (op[2] + 511) // 512 * 512
            live += sizes[op[1]]
        else:
            live -= sizes.pop(op[1])
        if index >= first - 1:
            peak = max(peak, live)
    return peak


def test_a_ring_buffer_snapshot_begins_with_the_blocks_live_then(bench, fake_dir, tmp_path):
    """_record_memory_history(max_entries=N) keeps the last N entries; the
    blocks live when they begin are rebuilt from the segment list and the
    frees, so cotenant's replay sees the live bytes the run had."""
    recorder = bench.record_snapshot
    path = trace_path("gpt_train_varlen.jsonl.gz")
    out = str(tmp_path / "window.pickle")
    recorded = recorder(path, out, fake_dir, expandable_segments=True, max_entries=3000)
    assert recorded["fake_cuda_violations"] == []
    snapshot = bench.load_trace(out)
    assert bench.replay_trace(snapshot)["peak_allocated_bytes"] == live_peak_of_the_last(
        bench.load_trace(path).ops, 3000)
    # PyTorch mapped all its pages before the window: its reserved bytes over it are unknown, and said so.
    assert snapshot.pytorch["available"] is False
    assert snapshot.pytorch["reserved_at_dump_bytes"] == recorded["memory_stats"]["reserved_bytes.all.current"]


def test_a_window_with_segment_events_reconstructs_what_was_reserved_before_it(bench, fake_dir, tmp_path):
    path = trace_path("serve_varbatch.jsonl.gz")
    whole = str(tmp_path / "whole.pickle")
    bench.record_snapshot(path, whole, fake_dir)
    with open(whole, "rb") as f:
        events = pickle.load(f)["device_traces"][0]
    last_segment = max(i for i, e in enumerate(events) if e["action"] == "segment_alloc")
    entries = len(events) - last_segment + 50  # the window holds the last cudaMalloc and a little before it
    window = str(tmp_path / "window.pickle")
    recorded = bench.record_snapshot(path, window, fake_dir, max_entries=entries)
    with open(window, "rb") as f:
        kept = pickle.load(f)["device_traces"][0]
    added = sum(e["size"] for e in kept if e["action"] == "segment_alloc")
    assert added > 0
    figures = bench.load_trace(window).pytorch
    stats = recorded["memory_stats"]
    assert figures["start"] == "reconstructed"
    assert figures["start_reserved_bytes"] == stats["reserved_bytes.all.current"] - added
    assert figures["peak_reserved_bytes"] == stats["reserved_bytes.all.peak"]  # PyTorch freed no segment


def test_the_recorder_refuses_a_torch_that_does_not_see_the_fake(fake_dir, tmp_path):
    """Without the fake preloaded, torch would see no device (or a real GPU):
    the child stops before it imports torch or records anything."""
    library = over_fake.fake_library(fake_dir)
    unloaded = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    env = dict(unloaded, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "never.pickle"
    done = subprocess.run([sys.executable, RECORDER, "--child", library, TRACES[0], str(out)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert "is not preloaded, so torch would not see the fake CUDA device" in done.stderr
    assert not out.exists()
    # Preloaded, the same command records.
    env = over_fake.environment(library, unloaded)
    done = subprocess.run([sys.executable, RECORDER, "--child", library, TRACES[0], str(out), "--max-entries", "10"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert out.exists()


def test_the_recorder_names_a_missing_fake_with_the_fix(bench, tmp_path):
    with pytest.raises(ValueError, match="no fake libcudart.so.N in .*--fake-cudart"):
        bench.record_snapshot(TRACES[0], str(tmp_path / "x.pickle"), str(tmp_path))
