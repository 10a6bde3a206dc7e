"""cotenant-replay: trace formats, the report, and errors that name the line."""

import glob
import gzip
import json
import os
import pickle
import subprocess
import sys

import pytest

from cotenant import _core
from cotenant import replay

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_TRACES = sorted(glob.glob(os.path.join(REPO, "benchmarks", "traces", "*.jsonl.gz")))


def write_jsonl(path, records, compress=False):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def run_main(capsys, *argv):
    code = replay.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


EIGHT_BLOCKS = [{"op": "alloc", "id": i, "size": 2 * MiB, "stream": 0} for i in range(1, 9)] + [
    {"op": "free", "id": i} for i in range(1, 9)
]


# ---- the report ---------------------------------------------------------------------


def test_replay_prints_every_figure_of_the_table(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS)
    code, out, _ = run_main(capsys, trace, "--device-capacity", "1GiB")
    assert code == 0
    for row in ("peak allocated", "peak reserved", "fragmentation", "bytes spilled", "bytes restored",
                "migrations", "ns/alloc", "ns/free"):
        assert row in out
    assert "16.00 MiB" in out  # eight 2 MiB blocks live at the peak


def test_replay_json_output_has_the_figures(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl.gz", EIGHT_BLOCKS, compress=True)
    code, out, _ = run_main(capsys, trace, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["peak_allocated_bytes"] == 16 * MiB
    assert result["peak_reserved_bytes"] >= 16 * MiB
    assert result["fragmentation"] == pytest.approx(result["peak_reserved_bytes"] / (16 * MiB))
    assert result["num_allocs"] == result["num_frees"] == 8
    assert result["ns_per_alloc"] > 0 and result["ns_per_free"] > 0
    assert result["format"] == "jsonl"


def test_cap_schedule_spills_and_restores_live_blocks(tmp_path, capsys):
    allocs = EIGHT_BLOCKS[:8]
    frees = EIGHT_BLOCKS[8:]
    trace = write_jsonl(tmp_path / "t.jsonl", allocs + [{"op": "empty_cache"}] + frees)
    code, out, _ = run_main(capsys, trace, "--json", "--cap-schedule", "8:4MiB,9:none")
    assert code == 0
    result = json.loads(out)
    assert result["spilled_bytes"] >= 12 * MiB
    assert result["restored_bytes"] >= 12 * MiB
    assert result["num_migrations"] >= 12


def test_cap_schedule_can_come_from_a_file(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS)
    schedule = tmp_path / "schedule.txt"
    schedule.write_text("# op index: cap\n8:4MiB\n")
    code, out, _ = run_main(capsys, trace, "--json", "--cap-schedule", schedule)
    assert code == 0
    assert json.loads(out)["spilled_bytes"] >= 12 * MiB


def test_initial_cap_places_over_cap_allocations_on_the_host(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS[:8])
    code, out, _ = run_main(capsys, trace, "--json", "--cap", "4MiB")
    assert code == 0
    result = json.loads(out)
    assert result["peak_device_resident_bytes"] <= 4 * MiB
    assert result["num_ooms"] == 0


def test_cap_ops_in_a_trace_accept_size_strings_and_null(tmp_path, capsys):
    records = EIGHT_BLOCKS[:8] + [{"op": "cap", "bytes": "4MiB"}, {"op": "cap", "bytes": None}]
    trace = write_jsonl(tmp_path / "t.jsonl", [{"op": "meta", "made_by": "hand"}] + records)
    code, out, _ = run_main(capsys, trace, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["spilled_bytes"] >= 12 * MiB and result["restored_bytes"] >= 12 * MiB


def test_python_m_cotenant_replay_runs_the_tool(tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS)
    done = subprocess.run([sys.executable, "-m", "cotenant.replay", trace, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_allocs"] == 8


# ---- errors in traces and options -------------------------------------------------------


@pytest.mark.parametrize(
    "records, line, problem",
    [
        ([{"op": "alloc", "id": 1, "size": 4096}, {"op": "free", "id": 2}], 2, "id 2, which is not live"),
        ([{"op": "alloc", "id": 1, "size": 4096}, {"op": "free", "id": 1}, {"op": "free", "id": 1}], 3,
         "double free"),
        ([{"op": "alloc", "id": 1, "size": 4096}, {"op": "alloc", "id": 1, "size": 4096}], 2, "live"),
        ([{"op": "alloc", "id": 1, "size": "6 GB?"}], 1, "6 GB?"),
        ([{"op": "alloc", "id": 1, "size": -1}], 1, "negative"),
        ([{"op": "alloc", "id": 1}], 1, '"size"'),
        ([{"op": "alloc", "id": 1, "size": 4096}, {"op": "cap", "bytes": 0}], 2, "0 bytes"),
        ([{"op": "alloc", "id": 1, "size": 4096}, {"op": "resize", "id": 1}], 2, "unknown op"),
        ([{"op": "alloc", "id": 1, "size": 4096}, "{not json"], 2, "not valid JSON"),
    ],
)
def test_trace_errors_name_the_line_and_exit_2(tmp_path, capsys, records, line, problem):
    trace = write_jsonl(tmp_path / "bad.jsonl", ["# a comment line"] + records)
    code, _, err = run_main(capsys, trace)
    assert code == 2
    assert f"bad.jsonl, line {line + 1}:" in err  # +1: the comment line
    assert problem in err


def test_a_truncated_gzip_trace_is_reported_as_truncated(tmp_path, capsys):
    full = write_jsonl(tmp_path / "full.jsonl.gz", EIGHT_BLOCKS * 50, compress=True)
    data = open(full, "rb").read()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    code, _, err = run_main(capsys, cut)
    assert code == 2
    assert "truncated" in err


def test_a_cut_off_last_line_is_reported_as_truncated(tmp_path, capsys):
    trace = tmp_path / "cut.jsonl"
    trace.write_text('{"op": "alloc", "id": 1, "size": 4096}\n{"op": "free", "i')
    code, _, err = run_main(capsys, trace)
    assert code == 2
    assert "line 2" in err and "truncated" in err


@pytest.mark.parametrize(
    "content",
    [b"hello, this is a text file\n", bytes(range(256)) * 4, b'{"name": "not a trace"}\n', b"", b"\n\n"],
)
def test_a_file_that_is_not_a_trace_is_refused(tmp_path, capsys, content):
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    code, _, err = run_main(capsys, path)
    assert code == 2
    assert "not a cotenant trace" in err


def test_a_missing_file_is_reported(tmp_path, capsys):
    code, _, err = run_main(capsys, tmp_path / "nowhere.jsonl")
    assert code == 2
    assert "cannot open" in err


@pytest.mark.parametrize(
    "option, value, problem",
    [("--cap", "6 GB?", "6 GB?"), ("--cap", "0", "larger than 0"), ("--device-capacity", "-1", "negative"),
     ("--granularity", "3MiB", "power of two"), ("--cap-schedule", "12", "OPINDEX:SIZE"),
     ("--cap-schedule", "3:abc", "abc"), ("--cap-schedule", "99:1GiB", "only 16 ops")],
)
def test_bad_options_are_refused_with_exit_2(tmp_path, capsys, option, value, problem):
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS)
    code, _, err = run_main(capsys, trace, option, value)
    assert code == 2
    assert problem in err


def test_cli_errors_print_no_traceback_from_a_subprocess(tmp_path):
    trace = write_jsonl(tmp_path / "t.jsonl", [{"op": "free", "id": 3}])
    done = subprocess.run([sys.executable, "-m", "cotenant.replay", trace],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "line 1" in done.stderr


# ---- PyTorch memory snapshots ---------------------------------------------------------


def snapshot(events):
    return {"segments": [], "device_traces": [events]}


def test_snapshot_actions_map_alloc_to_alloc_and_free_completed_to_free(tmp_path, capsys):
    events = [
        {"action": "segment_alloc", "addr": 0x1000, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 4 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x500000, "size": 6 * MiB, "stream": 7},
        {"action": "free_requested", "addr": 0x1000, "size": 4 * MiB, "stream": 0},
        {"action": "free_completed", "addr": 0x1000, "size": 4 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 2 * MiB, "stream": 0},  # the address is reused
        {"action": "free_completed", "addr": 0x1000, "size": 2 * MiB, "stream": 0},
        {"action": "free_completed", "addr": 0x500000, "size": 6 * MiB, "stream": 7},
        {"action": "segment_free", "addr": 0x1000, "size": 20 * MiB, "stream": 0},
    ]
    trace = replay.snapshot_ops(snapshot(events))
    assert trace.ops == [("alloc", 1, 4 * MiB, 0), ("alloc", 2, 6 * MiB, 7), ("free", 1),
                         ("alloc", 3, 2 * MiB, 0), ("free", 3), ("free", 2)]

    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot(events)))
    code, out, _ = run_main(capsys, path, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["format"] == "snapshot"
    assert result["peak_allocated_bytes"] == 10 * MiB


def test_snapshot_block_freed_before_its_alloc_was_recorded_is_live_from_the_start():
    events = [
        {"action": "alloc", "addr": 0x9000, "size": MiB, "stream": 0},
        {"action": "free_completed", "addr": 0x4000, "size": 8 * MiB, "stream": 0},  # allocated earlier
        {"action": "free_completed", "addr": 0x9000, "size": MiB, "stream": 0},
    ]
    trace = replay.snapshot_ops(snapshot(events))
    assert trace.ops[0] == ("alloc", 2, 8 * MiB, 0)
    assert "before the trace began" in trace.origins[0]
    result = replay.replay_trace(trace)
    assert result["peak_allocated_bytes"] == 9 * MiB


def test_snapshot_double_free_names_the_device_trace_entry(tmp_path, capsys):
    events = [
        {"action": "alloc", "addr": 0x9000, "size": MiB, "stream": 0},
        {"action": "free_completed", "addr": 0x9000, "size": MiB, "stream": 0},
        {"action": "free_completed", "addr": 0x9000, "size": MiB, "stream": 0},
    ]
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot(events)))
    code, _, err = run_main(capsys, path)
    assert code == 2
    assert "device trace entry 2" in err and "double free" in err


class NotPlainData:
    pass


def test_a_pickle_that_would_import_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[NotPlainData()]]}))
    code, _, err = run_main(capsys, path)
    assert code == 2
    assert "not a cotenant trace" in err


def test_a_truncated_snapshot_is_reported(tmp_path, capsys):
    data = pickle.dumps(snapshot([{"action": "alloc", "addr": i, "size": 512, "stream": 0} for i in range(100)]))
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[: len(data) // 2])
    code, _, err = run_main(capsys, path)
    assert code == 2
    assert "truncated" in err


# ---- the bundled traces ---------------------------------------------------------------


def test_the_project_bundles_traces():
    assert len(BUNDLED_TRACES) >= 3


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_replays_cleanly(path):
    result = replay.replay_trace(replay.load_trace(path))
    assert result["num_ooms"] == 0
    assert result["num_allocs"] > 1000
    assert result["num_allocs"] == result["num_frees"]
    assert result["fragmentation"] >= 1.0
    assert result["final_stats"]["allocated_bytes.all.current"] == 0


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_under_half_its_peak_cap_spills_without_oom(path):
    trace = replay.load_trace(path)
    peak = replay.replay_trace(trace)["peak_allocated_bytes"]
    result = replay.replay_trace(trace, cap=peak // 2)
    assert result["num_ooms"] == 0
    assert result["peak_device_resident_bytes"] <= peak // 2 + 2 * MiB
    assert result["num_spilled_allocations"] > 0


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_fragmentation_meets_the_1_10_target(path):
    result = replay.replay_trace(replay.load_trace(path))
    assert result["fragmentation"] <= 1.10, f"peak reserved / peak allocated = {result['fragmentation']:.3f}"
