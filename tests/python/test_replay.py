"""cotenant-replay: trace formats, the report, and errors that name the line."""

import gzip
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

from cotenant import _core
from cotenant import replay
from script_loader import load_script

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BUNDLED = load_script(os.path.join(REPO, "benchmarks", "bundled_traces.py"))
SYNTHETIC_TRACES = _BUNDLED.synthetic()
# PyTorch memory snapshots of real training runs on a GPU (record_snapshots.py).
RECORDED_SNAPSHOTS = _BUNDLED.recorded()
BUNDLED_TRACES = SYNTHETIC_TRACES + RECORDED_SNAPSHOTS


def write_jsonl(path, records, compress=False):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def table_cells(out):
    """The report table as {row name: its cells}: a line splits at runs of two or more spaces."""
    return {cells[0]: cells[1:] for cells in (re.split(r" {2,}", line) for line in out.splitlines())}


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


def test_an_initial_cap_holds_at_the_next_safe_point(tmp_path, capsys):
    # Between safe points the device may run over the cap by the pages of the
    # allocations made since (docs/allocator.md, "Placement"); at one it holds.
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS[:8] + [{"op": "iteration"}])
    code, out, _ = run_main(capsys, trace, "--json", "--cap", "4MiB")
    assert code == 0
    result = json.loads(out)
    assert result["num_ooms"] == 0
    assert result["final_stats"]["device_resident_bytes.current"] <= 4 * MiB
    assert result["final_stats"]["host_resident_bytes.current"] >= 12 * MiB


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


# ---- iteration marks and driver figures ------------------------------------------------


def loop_of(iterations, block_bytes=2 * MiB, blocks=1):
    """A job's loop: each iteration allocates `blocks` blocks, frees them and ends with a mark."""
    records, next_id = [], 1
    for _ in range(iterations):
        ids = list(range(next_id, next_id + blocks))
        next_id += blocks
        records += [{"op": "alloc", "id": i, "size": block_bytes} for i in ids]
        records += [{"op": "free", "id": i} for i in ids] + [{"op": "iteration"}]
    return records


def test_an_iteration_line_becomes_an_iteration_op_named_by_its_line(tmp_path):
    trace = replay.load_trace(write_jsonl(tmp_path / "t.jsonl", loop_of(2)))
    assert trace.ops[2] == ("iteration",) and trace.ops[5] == ("iteration",)
    assert trace.origins[5] == "line 6"
    assert [op[0] for op in trace.ops].count("iteration") == 2


def test_a_loop_that_reuses_its_blocks_maps_pages_only_in_its_first_iteration(tmp_path, capsys):
    code, out, _ = run_main(capsys, write_jsonl(tmp_path / "t.jsonl", loop_of(6)), "--json")
    assert code == 0
    result = json.loads(out)
    assert result["num_iterations"] == 6
    assert len(result["maps_per_iteration"]) == len(result["host_touched_bytes_per_iteration"]) == 6
    assert result["maps_per_iteration"][0] >= 1
    assert result["steady_maps_per_iteration"] == 0
    assert result["steady_host_touched_bytes_per_iteration"] == 0
    assert result["num_page_maps"] == sum(result["maps_per_iteration"])
    assert result["maps_per_peak_page"] == pytest.approx(
        result["num_page_maps"] / (result["peak_reserved_bytes"] / (2 * MiB)))


def test_the_report_says_where_peak_reserved_memory_went(tmp_path, capsys):
    # A 3 MiB block and a 1 MiB block fill pages 0-1; the 3 MiB one is freed,
    # and a 3.5 MiB block fits no hole: it maps pages 2-3 while page 0 stays
    # mapped and free. At that peak (8 MiB): 4.5 MiB live, 1.5 MiB free in the
    # three pages the live blocks touch, one free page (2 MiB).
    records = [{"op": "alloc", "id": 1, "size": 3 * MiB}, {"op": "alloc", "id": 2, "size": MiB},
               {"op": "free", "id": 1}, {"op": "alloc", "id": 3, "size": 3 * MiB + MiB // 2},
               {"op": "free", "id": 2}, {"op": "free", "id": 3}]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    code, out, _ = run_main(capsys, path, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["peak_reserved_bytes"] == 8 * MiB
    assert result["at_peak_live_bytes"] == 4 * MiB + MiB // 2
    assert result["at_peak_partial_page_free_bytes"] == MiB + MiB // 2
    assert result["at_peak_free_page_bytes"] == 2 * MiB
    assert result["at_peak_request_bytes"] == 3 * MiB + MiB // 2
    assert result["at_peak_largest_hole_bytes"] == 3 * MiB
    assert result["fragmentation_floor"] == pytest.approx(6 / 4.5)  # 4.5 MiB live needs 3 pages
    code, out, _ = run_main(capsys, path)
    rows = table_cells(out)
    assert rows["fragmentation floor"][0] == "1.333"
    assert rows["at peak reserved"][0] == "4.50 MiB live + 1.50 MiB free in used pages + 2.00 MiB in free pages"
    assert "3.50 MiB allocation; largest hole then 3.00 MiB" in rows["at peak reserved"][1]


def test_blocks_on_host_pages_count_as_host_bytes_touched_per_iteration(tmp_path, capsys):
    # Each iteration frees the last one's two 2 MiB blocks and allocates two
    # more: under a 2 MiB cap one of the two lives on the host, so each
    # iteration after the first touches at least 2 MiB of host pages.
    records, previous = [], []
    for first in range(1, 9, 2):
        records += [{"op": "free", "id": i} for i in previous]
        previous = [first, first + 1]
        records += [{"op": "alloc", "id": i, "size": 2 * MiB} for i in previous] + [{"op": "iteration"}]
    code, out, _ = run_main(capsys, write_jsonl(tmp_path / "t.jsonl", records), "--json", "--cap", "2MiB")
    assert code == 0
    result = json.loads(out)
    assert result["spilled_bytes"] + result["num_spilled_allocations"] > 0
    assert all(touched >= 2 * MiB for touched in result["host_touched_bytes_per_iteration"][1:])
    assert result["steady_host_touched_bytes_per_iteration"] >= 2 * MiB
    # The first squeeze moves the older block's page out; later iterations
    # reuse both pages where they lie, so they move nothing.
    assert result["moved_bytes_per_iteration"] == [2 * MiB, 0, 0, 0]
    assert sum(result["moved_bytes_per_iteration"]) == result["spilled_bytes"] + result["restored_bytes"]
    assert result["steady_moved_bytes_per_iteration"] == 0


def test_a_capped_training_loop_keeps_little_more_than_the_floor_on_the_host_and_maps_nothing_once_warm():
    # resnet_train under a cap of half its peak. Kernels read live host pages
    # across the bus (on a GPU a capped step's time followed the bytes kept
    # there, docs/allocator.md), so a warm loop moves its blocks on host pages
    # into free device pages' places at safe points: 92 MiB live on the host
    # on average over a step against a floor of 70 (live bytes over the cap),
    # where keeping the layout as it lay held 130. What it trades: 15 safe
    # points and 426 MiB of page moves a warm step (0 and 0 before). Once
    # warm it still maps no page.
    trace = replay.load_trace(next(path for path in SYNTHETIC_TRACES if path.endswith("resnet_train.jsonl.gz")))
    cap = replay.replay_trace(trace)["peak_allocated_bytes"] // 2
    result = replay.replay_trace(trace, cap=cap)
    assert result["num_iterations"] == len(result["safe_points_per_iteration"]) == 8
    assert len(result["host_live_bytes_per_iteration"]) == len(result["host_live_floor_bytes_per_iteration"]) == 8
    assert sum(result["safe_points_per_iteration"]) <= result["num_safe_points"]
    floor = result["steady_host_live_floor_bytes"]
    assert floor > 0
    assert floor <= result["steady_host_live_bytes"] <= 1.5 * floor
    assert result["steady_maps_per_iteration"] == 0
    assert result["steady_safe_points_per_iteration"] <= 16
    assert result["steady_moved_bytes_per_iteration"] <= 512 * MiB


def test_the_table_shows_driver_and_steady_iteration_figures(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", loop_of(6))
    _, out, _ = run_main(capsys, trace, "--json")
    result = json.loads(out)
    code, out, _ = run_main(capsys, trace)
    assert code == 0
    rows = table_cells(out)
    assert rows["page maps"][0] == str(result["num_page_maps"])
    assert rows["page unmaps"][0] == str(result["num_page_unmaps"])
    assert rows["maps per peak page"][0] == f'{result["maps_per_peak_page"]:.2f}'
    assert rows["iterations"] == ["6", "(steady figures: the mean over the last 3)"]
    assert rows["maps per iteration"][0] == "0.00"
    assert rows["host bytes per iteration"][0] == "0 B"
    assert rows["bytes moved per iteration"][0] == "0 B"
    assert rows["safe points per iteration"][0] == "0.00"


def test_the_table_says_when_a_trace_has_no_iteration_marks(tmp_path, capsys):
    code, out, _ = run_main(capsys, write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS))
    assert code == 0
    assert "(the trace has no iteration marks)" in out
    assert "maps per iteration" not in out


def test_json_lines_traces_have_no_pytorch_figures(tmp_path, capsys):
    code, out, _ = run_main(capsys, write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS), "--json")
    assert code == 0
    result = json.loads(out)
    assert result["pytorch"] is None
    assert result["steady_maps_per_iteration"] is None
    assert result["num_page_maps"] >= 8


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
        ([{"op": "alloc", "id": 1, "size": 4096}, {"op": "resize", "id": 1}], 2, "empty_cache, iteration, meta"),
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


def timed(action, addr, size, time_us):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us}


def annotation(name, stage, time_us, device=0):
    return {"name": name, "stage": stage, "device": device, "time_us": time_us}


def step(name, start, end):
    return [annotation(name, "START", start), annotation(name, "END", end)]


# Two passes of a loop (t = 10..19 and 20..29), each allocating and freeing one block.
TWO_PASSES = [timed("alloc", 0x1000, MiB, 11), timed("free_completed", 0x1000, MiB, 12),
              timed("alloc", 0x1000, MiB, 21), timed("free_completed", 0x1000, MiB, 22)]


def test_snapshot_iteration_marks_come_from_the_ends_of_annotated_ranges():
    data = snapshot(TWO_PASSES)
    data["external_annotations"] = step("cotenant::iteration", 10, 19) + step("cotenant::iteration", 20, 29)
    trace = replay.snapshot_ops(data)
    assert [op[0] for op in trace.ops] == ["alloc", "free", "iteration", "alloc", "free", "iteration"]
    assert "before device trace entry 2" in trace.origins[2]
    assert "after the device trace's last entry" in trace.origins[5]
    assert replay.replay_trace(trace)["num_iterations"] == 2


def test_snapshot_iteration_marks_fall_back_to_optimizer_steps():
    data = snapshot(TWO_PASSES)
    data["external_annotations"] = (step("Optimizer.step#AdamW.step", 15, 16) + step("forward", 20, 21)
                                    + step("Optimizer.step#AdamW.step", 25, 26))
    ops = [op[0] for op in replay.snapshot_ops(data).ops]
    assert ops == ["alloc", "free", "iteration", "alloc", "free", "iteration"]
    # cotenant::iteration ranges, where there are any, are the marks; the optimizer's are then not counted twice.
    data["external_annotations"] += step("cotenant::iteration", 10, 29)
    assert [op[0] for op in replay.snapshot_ops(data).ops] == ["alloc", "free", "alloc", "free", "iteration"]


def test_snapshot_iteration_marks_keep_to_the_trace_and_its_device():
    data = snapshot(TWO_PASSES)
    data["external_annotations"] = (step("cotenant::iteration", 1, 5)     # ended before the trace's window
                                    + step("cotenant::iteration", 6, 12)  # same microsecond as entry 1: after it
                                    + [annotation("cotenant::iteration", "END", 21, device=1)])  # another GPU
    ops = [op[0] for op in replay.snapshot_ops(data).ops]
    assert ops == ["alloc", "free", "iteration", "alloc", "free"]


def test_snapshot_without_times_or_annotations_has_no_iteration_marks():
    untimed = snapshot([{k: v for k, v in e.items() if k != "time_us"} for e in TWO_PASSES])
    untimed["external_annotations"] = step("cotenant::iteration", 10, 19)
    assert all(op[0] != "iteration" for op in replay.snapshot_ops(untimed).ops)
    assert all(op[0] != "iteration" for op in replay.snapshot_ops(snapshot(TWO_PASSES)).ops)


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


@pytest.mark.parametrize("data, words", [
    # A device trace that is not a list of entries: TypeError: 'int' object is not iterable.
    ({"device_traces": [5]}, ["device_traces[0]", "not a list"]),
    # Annotations that are not a list: the same TypeError.
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 10, "time_us": 1}]], "external_annotations": 5},
     ["external_annotations", "not a list"]),
    # Sizes and streams past 64 bits: pybind11's "Unable to cast Python instance of type <class 'int'>".
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 2**70}]]}, ["device trace entry 0", '"size"']),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 10, "stream": 2**70}]]},
     ["device trace entry 0", '"stream"']),
])
def test_a_snapshot_with_malformed_fields_is_refused_naming_them(tmp_path, capsys, data, words):
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(data))
    code, _, err = run_main(capsys, path)
    assert code == 2
    for word in words:
        assert word in err, err


def test_an_allocation_too_large_for_any_device_is_an_oom_not_a_crash(tmp_path):
    # Rounding 2**64-1 bytes up to a block wrapped around to a small size: the
    # replay crashed with SIGSEGV inside _core.
    trace = write_jsonl(tmp_path / "huge.jsonl", [{"op": "alloc", "id": 1, "size": 2**64 - 1}])
    done = subprocess.run([sys.executable, "-m", "cotenant.replay", "--json", trace],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert json.loads(done.stdout)["num_ooms"] == 1


def test_a_truncated_snapshot_is_reported(tmp_path, capsys):
    data = pickle.dumps(snapshot([{"action": "alloc", "addr": i, "size": 512, "stream": 0} for i in range(100)]))
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[: len(data) // 2])
    code, _, err = run_main(capsys, path)
    assert code == 2
    assert "truncated" in err


# ---- PyTorch beside cotenant ----------------------------------------------------------


def event(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


def segment(address, blocks, expandable=False):
    """One entry of a snapshot's segment list; blocks are (size, requested size, state) from its start."""
    entries, at = [], address
    for size, requested, state in blocks:
        entries.append({"address": at, "size": size, "requested_size": requested, "state": state})
        at += size
    return {"device": 0, "address": address, "total_size": at - address, "stream": 0,
            "is_expandable": expandable, "blocks": entries}


def write_snapshot(tmp_path, events, segments, name="snapshot.pickle"):
    path = tmp_path / name
    data = {"device_traces": [events]}
    if segments is not None:
        data["segments"] = segments
    path.write_bytes(pickle.dumps(data))
    return path


def replay_json(capsys, path):
    code, out, err = run_main(capsys, path, "--json")
    assert code == 0, err
    return json.loads(out)


# From process start, with cudaMalloc'd segments: 20 MiB then 12 MiB reserved
# (32 MiB at the peak) for 22 MiB live at the peak; the 12 MiB segment is freed.
SEG_A, SEG_B = 0x1000000, 0x3000000
FROM_THE_START = [
    event("segment_alloc", SEG_A, 20 * MiB), event("alloc", SEG_A, 4 * MiB), event("alloc", SEG_A + 4 * MiB, 6 * MiB),
    event("segment_alloc", SEG_B, 12 * MiB), event("alloc", SEG_B, 12 * MiB),
    event("free_requested", SEG_B, 12 * MiB), event("free_completed", SEG_B, 12 * MiB),
    event("free_completed", SEG_A, 4 * MiB), event("free_completed", SEG_A + 4 * MiB, 6 * MiB),
    event("segment_free", SEG_B, 12 * MiB),
]
AT_THE_END = [segment(SEG_A, [(20 * MiB, 0, "inactive")])]


def test_pytorch_figures_come_from_the_segment_events_of_a_trace_from_process_start(tmp_path, capsys):
    result = replay_json(capsys, write_snapshot(tmp_path, FROM_THE_START, AT_THE_END))
    pytorch = result["pytorch"]
    assert pytorch["available"] and pytorch["start"] == "empty"
    assert pytorch["start_reserved_bytes"] == 0 and pytorch["start_live_bytes"] == 0
    assert pytorch["peak_reserved_bytes"] == 32 * MiB
    assert pytorch["peak_live_bytes"] == 22 * MiB
    assert pytorch["fragmentation"] == pytest.approx(32 / 22)
    assert pytorch["cotenant_fragmentation"] == pytest.approx(result["peak_reserved_bytes"] / (22 * MiB))
    assert (pytorch["num_cuda_mallocs"], pytorch["num_cuda_frees"]) == (2, 1)
    assert (pytorch["num_segment_maps"], pytorch["num_segment_unmaps"]) == (0, 0)
    assert pytorch["reserved_at_dump_bytes"] == 20 * MiB


def test_the_table_puts_pytorch_in_a_second_column(tmp_path, capsys):
    path = write_snapshot(tmp_path, FROM_THE_START, AT_THE_END)
    result = replay_json(capsys, path)
    code, out, _ = run_main(capsys, path)
    assert code == 0
    rows = table_cells(out)
    assert rows[""] == ["cotenant", "PyTorch"]
    assert rows["peak live"][:2] == ["22.00 MiB", "22.00 MiB"]
    assert rows["peak reserved"] == [_core.format_size(result["peak_reserved_bytes"]), "32.00 MiB"]
    assert rows["reserved / live"][:2] == [f'{result["pytorch"]["cotenant_fragmentation"]:.3f}', "1.455"]
    assert rows["page maps"][:2] == [str(result["num_page_maps"]), "2 cudaMalloc"]
    assert rows["page unmaps"][:2] == [str(result["num_page_unmaps"]), "1 cudaFree"]
    assert "covers the run from its start" in rows["PyTorch start"][0]


def test_pytorch_figures_of_expandable_segments_count_maps_and_unmaps(tmp_path, capsys):
    base = 0x10000000
    events = [
        event("segment_map", base, 20 * MiB), event("alloc", base, 6 * MiB), event("alloc", base + 6 * MiB, 10 * MiB),
        event("segment_map", base + 20 * MiB, 20 * MiB), event("alloc", base + 20 * MiB, 16 * MiB),
        event("free_completed", base, 6 * MiB), event("free_completed", base + 6 * MiB, 10 * MiB),
        event("free_completed", base + 20 * MiB, 16 * MiB), event("segment_unmap", base + 20 * MiB, 20 * MiB),
    ]
    path = write_snapshot(tmp_path, events, [segment(base, [(20 * MiB, 0, "inactive")], expandable=True)])
    pytorch = replay_json(capsys, path)["pytorch"]
    assert pytorch["start"] == "empty"
    assert (pytorch["num_segment_maps"], pytorch["num_segment_unmaps"]) == (2, 1)
    assert (pytorch["num_cuda_mallocs"], pytorch["num_cuda_frees"]) == (0, 0)
    assert pytorch["peak_reserved_bytes"] == 40 * MiB
    assert pytorch["fragmentation"] == pytest.approx(40 / 32)
    _, out, _ = run_main(capsys, path)
    rows = table_cells(out)
    assert rows["page maps"][1] == "2 maps" and rows["page unmaps"][1] == "1 unmap"


# A window that begins mid-run: before it, segment A (20 MiB) held block X
# (4 MiB, freed in the trace) and block Y (live all through, seen only in the
# segment list), and segment C (8 MiB, cached) existed; the trace frees C,
# cudaMallocs D (30 MiB) for block Z and frees Z. Reserved at its start:
# 20 + 8 = 28 MiB; at the peak 20 + 30 = 50 MiB.
SEG_C, SEG_D = 0x5000000, 0x7000000
Y_REQUESTED = 2 * MiB - 100
MID_RUN = [
    event("free_completed", SEG_A, 4 * MiB), event("segment_free", SEG_C, 8 * MiB),
    event("segment_alloc", SEG_D, 30 * MiB), event("alloc", SEG_D, 30 * MiB),
    event("free_requested", SEG_D, 30 * MiB), event("free_completed", SEG_D, 30 * MiB),
]
MID_RUN_AT_THE_END = [
    segment(SEG_A, [(4 * MiB, 0, "inactive"), (2 * MiB, Y_REQUESTED, "active_allocated"), (14 * MiB, 0, "inactive")]),
    segment(SEG_D, [(30 * MiB, 30 * MiB, "inactive")]),
]


def test_a_window_that_begins_mid_run_is_reconstructed_from_the_segment_list(tmp_path, capsys):
    path = write_snapshot(tmp_path, MID_RUN, MID_RUN_AT_THE_END)
    trace = replay.load_trace(path)
    live_all_through = [(op, origin) for op, origin in zip(trace.ops, trace.origins) if "segment list" in origin]
    assert [op[2] for op, _ in live_all_through] == [Y_REQUESTED]
    result = replay_json(capsys, path)
    pytorch = result["pytorch"]
    assert pytorch["start"] == "reconstructed"
    assert pytorch["start_reserved_bytes"] == 28 * MiB
    assert pytorch["start_live_bytes"] == 4 * MiB + Y_REQUESTED
    assert pytorch["peak_reserved_bytes"] == 50 * MiB
    assert pytorch["peak_live_bytes"] == 30 * MiB + Y_REQUESTED
    assert result["peak_allocated_bytes"] == 32 * MiB  # cotenant replays Y too (2 MiB - 100 rounds up to 2 MiB)
    _, out, _ = run_main(capsys, path)
    assert "begins mid-run, with 28.00 MiB reserved" in table_cells(out)["PyTorch start"][0]


def test_a_window_without_a_segment_list_gives_a_lower_bound_over_the_traced_window(tmp_path, capsys):
    path = write_snapshot(tmp_path, MID_RUN, segments=None)
    trace = replay.load_trace(path)
    assert not any("segment list" in origin for origin in trace.origins)  # Y cannot be known
    result = replay_json(capsys, path)
    pytorch = result["pytorch"]
    assert pytorch["start"] == "unknown"
    # The least that fits the trace: segment C's 8 MiB had to exist before it was freed.
    assert pytorch["start_reserved_bytes"] == 8 * MiB
    assert pytorch["peak_reserved_bytes"] == 30 * MiB
    _, out, _ = run_main(capsys, path)
    rows = table_cells(out)
    assert rows["peak reserved"][1] == "30.00 MiB or more"
    assert "no segment list" in rows["PyTorch start"][0] and "lower bound" in rows["PyTorch start"][0]


def test_the_lower_bound_counts_blocks_placed_in_memory_reserved_before_the_window(tmp_path, capsys):
    # Block X (4 MiB) is freed, then 8 MiB are allocated before any segment
    # event: at least 8 MiB were reserved when the trace began.
    events = [event("free_completed", SEG_A, 4 * MiB), event("alloc", SEG_A, 4 * MiB),
              event("alloc", SEG_A + 4 * MiB, 4 * MiB), event("segment_alloc", SEG_D, 20 * MiB),
              event("alloc", SEG_D, 20 * MiB)]
    pytorch = replay_json(capsys, write_snapshot(tmp_path, events, segments=None))["pytorch"]
    assert pytorch["start_reserved_bytes"] == 8 * MiB
    assert pytorch["peak_reserved_bytes"] == 28 * MiB


@pytest.mark.parametrize("at_the_end", [
    # a block live at the dump where the trace freed X and allocated nothing after
    [segment(SEG_A, [(4 * MiB, 4 * MiB, "active_allocated"), (16 * MiB, 0, "inactive")]),
     segment(SEG_D, [(30 * MiB, 0, "inactive")])],
    # nothing reserved at the dump, though the trace's segment events add 22 MiB
    [],
], ids=["freed-block-live-at-dump", "too-little-reserved"])
def test_a_segment_list_that_disagrees_with_the_trace_end_is_not_used(tmp_path, capsys, at_the_end):
    path = write_snapshot(tmp_path, MID_RUN, at_the_end)
    assert not any("segment list" in origin for origin in replay.load_trace(path).origins)
    pytorch = replay_json(capsys, path)["pytorch"]
    assert pytorch["start"] == "unknown"
    assert "does not match the trace's end" in pytorch["start_note"]


def test_a_block_live_at_the_trace_end_must_be_live_at_the_dump(tmp_path, capsys):
    events = [event("segment_alloc", SEG_A, 20 * MiB), event("alloc", SEG_A, 4 * MiB)]
    pytorch = replay_json(capsys, write_snapshot(tmp_path, events, AT_THE_END))["pytorch"]
    assert pytorch["start"] == "unknown"


def test_a_snapshot_without_segment_events_says_so_in_one_line(tmp_path, capsys):
    events = [e for e in FROM_THE_START if not e["action"].startswith("segment")]
    path = write_snapshot(tmp_path, events, AT_THE_END)
    pytorch = replay_json(capsys, path)["pytorch"]
    assert pytorch["available"] is False
    assert pytorch["reserved_at_dump_bytes"] == 20 * MiB
    code, out, _ = run_main(capsys, path)
    assert code == 0
    pytorch_lines = [line for line in out.splitlines() if "PyTorch" in line]
    assert len(pytorch_lines) == 1
    assert pytorch_lines[0].startswith("PyTorch") and "no segment events" in pytorch_lines[0]
    assert "20.00 MiB reserved at the dump" in pytorch_lines[0]
    assert "peak live" not in out  # no second column


# ---- the bundled traces ---------------------------------------------------------------


def test_the_project_bundles_traces():
    assert len(SYNTHETIC_TRACES) >= 3 and len(RECORDED_SNAPSHOTS) >= 2


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_replays_cleanly(path):
    result = replay.replay_trace(replay.load_trace(path))
    assert result["num_ooms"] == 0
    assert result["num_allocs"] > 1000
    assert result["fragmentation"] >= 1.0
    if path in SYNTHETIC_TRACES:  # a recorded snapshot ends with the model's tensors still live
        assert result["num_allocs"] == result["num_frees"]
        assert result["final_stats"]["allocated_bytes.all.current"] == 0


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_under_half_its_peak_cap_spills_without_oom(path):
    trace = replay.load_trace(path)
    peak = replay.replay_trace(trace)["peak_allocated_bytes"]
    trace.add(("iteration",), "a safe point after the trace")
    result = replay.replay_trace(trace, cap=peak // 2)
    assert result["num_ooms"] == 0
    assert result["spilled_bytes"] > 0 or result["num_spilled_allocations"] > 0
    assert result["final_stats"]["device_resident_bytes.current"] <= peak // 2  # the cap holds at a safe point


# The target is 1.05 (docs/allocator.md, "Placement"). Best-fit placement in
# one arena misses it on these traces: a step allocates a block a little
# larger than every hole (the logits, an expert's tokens, a grown KV cache)
# and maps fresh pages while the holes stay mapped. strict: a fix makes
# these pass and fail here.
FRAGMENTATION_ABOVE_TARGET = {"gpt_generate.jsonl.gz", "gpt_train.jsonl.gz", "gpt_train_buckets.jsonl.gz",
                              "gpt_train_varlen.jsonl.gz", "moe_train.jsonl.gz"}


@pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.xfail(strict=True, reason="known: docs/allocator.md, Placement"))
    if os.path.basename(path) in FRAGMENTATION_ABOVE_TARGET else path
    for path in BUNDLED_TRACES], ids=os.path.basename)
def test_bundled_trace_fragmentation_meets_the_1_05_target(path):
    result = replay.replay_trace(replay.load_trace(path))
    assert result["fragmentation"] <= 1.05, f"peak reserved / peak allocated = {result['fragmentation']:.3f}"


@pytest.mark.parametrize("path", RECORDED_SNAPSHOTS, ids=os.path.basename)
def test_a_recorded_snapshot_reserves_less_than_pytorchs_own_allocator_did(path):
    result = replay.replay_trace(replay.load_trace(path))
    pytorch = result["pytorch"]
    assert pytorch["available"] and pytorch["start"] == "empty", pytorch  # recorded from the run's start
    assert result["fragmentation"] <= min(1.05, pytorch["fragmentation"])
    assert result["peak_reserved_bytes"] <= pytorch["peak_reserved_bytes"]
    assert result["maps_per_peak_page"] <= 2.0


@pytest.mark.parametrize("path", BUNDLED_TRACES, ids=os.path.basename)
def test_bundled_trace_peak_reserved_is_its_live_slack_and_free_pages(path):
    result = replay.replay_trace(replay.load_trace(path))
    parts = (result["at_peak_live_bytes"], result["at_peak_partial_page_free_bytes"], result["at_peak_free_page_bytes"])
    assert sum(parts) == result["peak_reserved_bytes"]
    assert all(part >= 0 for part in parts)
    assert 1.0 <= result["fragmentation_floor"] <= result["fragmentation"]


# Training loops map nothing once warm, resnet_multiscale (a different
# resolution each step, so no step repeats the one before) included since a
# request that best fit would place over an unmapped page takes a mapped hole
# that holds it (docs/allocator.md, "Placement").
TRAINING_TRACES = [path for path in BUNDLED_TRACES if _BUNDLED.training_loop(path)]


def test_the_training_loops_are_every_bundled_trace_but_generation_and_serving():
    assert {os.path.basename(path) for path in BUNDLED_TRACES if path not in TRAINING_TRACES} == {
        "gpt_generate.jsonl.gz", "serve_varbatch.jsonl.gz"}


@pytest.mark.parametrize("path", TRAINING_TRACES, ids=os.path.basename)
def test_bundled_training_trace_maps_no_page_once_warm(path):
    result = replay.replay_trace(replay.load_trace(path))
    assert result["steady_maps_per_iteration"] == 0, result["maps_per_iteration"]


def test_a_cap_schedule_file_that_is_not_text_is_named(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", EIGHT_BLOCKS)
    schedule = tmp_path / "schedule.bin"
    schedule.write_bytes(b"\xc9\x00\xff")
    code, _, err = run_main(capsys, trace, "--cap-schedule", str(schedule))
    assert code == 2
    assert str(schedule) in err and "OPINDEX:SIZE" in err, err
