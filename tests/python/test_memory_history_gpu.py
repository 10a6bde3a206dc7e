"""torch.cuda.memory._record_memory_history() under cotenant, on a GPU: the
trace and the frames PyTorch's memory_viz reads, spills shown as device
memory unmapped and host memory mapped at the same addresses, the snapshot
file, and out-of-memory snapshots with the history intact.

Each test runs its job in a fresh process from a script file, so stack
frames name that file and its lines."""

import textwrap

import pytest
from fresh_process import run_json

pytestmark = pytest.mark.gpu

MIB = 1 << 20
HOST_STREAM = -1  # the stream host-resident memory reports (docs/allocator.md, "Memory history")


def run_job(tmp_path, body, timeout=300):
    """Runs `body` (after enabling cotenant) from tmp_path/history_job.py and
    returns (the JSON object it prints last, the script's path)."""
    code = "import json, pickle, torch, cotenant\ncotenant.enable()\n" + textwrap.dedent(body)
    out = run_json(code, directory=str(tmp_path), name="history_job.py", timeout=timeout)
    return out, str(tmp_path / "history_job.py")


def line_of(script, marker):
    """The 1-based line of the script that contains `marker`."""
    with open(script) as f:
        for number, line in enumerate(f, start=1):
            if marker in line:
                return number
    raise AssertionError(f"{marker!r} is not in {script}")


def test_recording_traces_allocations_and_frees_with_frames_in_the_job_script(tmp_path):
    out, script = run_job(tmp_path, """
        torch.cuda.memory._record_memory_history(max_entries=100000)
        enabled = torch._C._cuda_isHistoryEnabled()
        freed = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # MARK-freed
        freed_ptr = freed.data_ptr()
        del freed
        kept = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")  # MARK-kept
        snap = torch.cuda.memory._snapshot()
        trace = snap["device_traces"][0]
        def brief(e):
            return {"action": e["action"], "addr": e.get("addr"), "size": e["size"], "stream": e["stream"],
                    "frames": [(f["filename"], f["line"]) for f in e.get("frames", [])]}
        blocks = [dict(b, frames=[(f["filename"], f["line"]) for f in b.get("frames", [])])
                  for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        print(json.dumps({"enabled": enabled, "freed_ptr": freed_ptr, "kept_ptr": kept.data_ptr(),
                          "trace": [brief(e) for e in trace],
                          "blocks": [{"address": b["address"], "size": b["size"], "frames": b["frames"]}
                                     for b in blocks],
                          "segments_total": sum(s["total_size"] for s in snap["segments"]),
                          "reserved": torch.cuda.memory_reserved()}))
    """)
    assert out["enabled"] is True
    trace = out["trace"]
    actions_at_freed = [e["action"] for e in trace if e["addr"] == out["freed_ptr"] and e["action"] in (
        "alloc", "free_requested", "free_completed")]
    assert actions_at_freed[:3] == ["alloc", "free_requested", "free_completed"]
    alloc = next(e for e in trace if e["action"] == "alloc" and e["addr"] == out["freed_ptr"])
    assert alloc["size"] == 3 * MIB
    assert [script, line_of(script, "MARK-freed")] in alloc["frames"]
    assert any(e["action"] == "segment_map" and e["stream"] != HOST_STREAM for e in trace)
    assert trace[-1]["action"] == "snapshot"
    kept = [b for b in out["blocks"] if b["address"] == out["kept_ptr"]]
    assert len(kept) == 1 and kept[0]["size"] == 5 * MIB
    assert [script, line_of(script, "MARK-kept")] in kept[0]["frames"]
    # Segments are the mapped pages: their sizes add up to the reserved bytes.
    assert out["segments_total"] == out["reserved"]


def test_stopping_the_recording_empties_the_trace(tmp_path):
    out, _ = run_job(tmp_path, """
        torch.cuda.memory._record_memory_history()
        x = torch.empty(1 << 20, device="cuda")
        torch.cuda.memory._record_memory_history(enabled=None)
        y = torch.empty(1 << 20, device="cuda")
        snap = torch.cuda.memory._snapshot()
        print(json.dumps({"enabled": torch._C._cuda_isHistoryEnabled(),
                          "entries": len(snap["device_traces"][0]),
                          "frames": [len(b.get("frames", [])) for s in snap["segments"] for b in s["blocks"]
                                     if b["state"] == "active_allocated"]}))
    """)
    assert out["enabled"] is False
    assert out["entries"] == 0
    assert out["frames"] and all(n == 0 for n in out["frames"])


def test_a_spill_shows_as_device_unmap_then_host_map_and_host_segments_in_the_snapshot(tmp_path):
    out, _ = run_job(tmp_path, """
        torch.cuda.memory._record_memory_history(max_entries=100000)
        x = torch.ones(32 << 20, dtype=torch.uint8, device="cuda")
        ptr = x.data_ptr()
        cotenant.set_memory_cap("8MiB")
        cotenant.safe_point()
        snap = torch.cuda.memory._snapshot()
        trace = snap["device_traces"][0]
        segments = [{"address": s["address"], "total_size": s["total_size"], "stream": s["stream"],
                     "allocated": [b["address"] for b in s["blocks"] if b["state"] == "active_allocated"]}
                    for s in snap["segments"]]
        moves = [(a["action"], a["stream"], b["action"], b["stream"], a["addr"], a["size"])
                 for a, b in zip(trace, trace[1:]) if a["addr"] == b.get("addr")
                 and (a["action"], b["action"]) == ("segment_unmap", "segment_map")]
        print(json.dumps({"ptr": ptr, "moves": moves, "segments": segments,
                          "host_bytes": cotenant.memory_stats()["host_bytes"],
                          "reserved": torch.cuda.memory_reserved(),
                          "mode": cotenant.memory_stats()["mode"], "sum": int(x.sum().item())}))
    """)
    if out["mode"] != "remap":
        pytest.skip("this GPU has no host virtual memory management: live pages cannot move")
    assert out["sum"] == 32 * MIB
    to_host = [m for m in out["moves"] if m[1] != HOST_STREAM and m[3] == HOST_STREAM]
    assert sum(m[5] for m in to_host) >= 24 * MIB
    assert all(out["ptr"] <= m[4] < out["ptr"] + 32 * MIB for m in to_host)
    host_segments = [s for s in out["segments"] if s["stream"] == HOST_STREAM]
    assert out["host_bytes"] >= 24 * MIB
    # The segments add up to what is reserved; a block part on the host and part on the device belongs to the
    # segment of the page it starts on (docs/allocator.md, "Memory history"), so host segments hold at least
    # the host bytes.
    assert sum(s["total_size"] for s in out["segments"]) == out["reserved"]
    assert sum(s["total_size"] for s in host_segments) >= out["host_bytes"]
    # The tensor is one block in exactly one segment, whichever residency it starts in.
    assert sum(s["allocated"].count(out["ptr"]) for s in out["segments"]) == 1


def test_dump_snapshot_writes_a_pickle_that_memory_viz_renders(tmp_path):
    out, _ = run_job(tmp_path, """
        from torch.cuda import _memory_viz
        torch.cuda.memory._record_memory_history()
        xs = [torch.empty(n, device="cuda") for n in (1000, 1 << 20, 4 << 20)]
        del xs[1]
        torch.cuda.memory._dump_snapshot("snapshot.pickle")
        with open("snapshot.pickle", "rb") as f:
            snap = pickle.load(f)
        html = _memory_viz.trace_plot(snap)
        text = _memory_viz.trace(snap)
        print(json.dumps({"actions": sorted({e["action"] for e in snap["device_traces"][0]}),
                          "html": len(html), "text_has_alloc": " = " in text}))
    """)
    assert {"alloc", "free_requested", "free_completed", "segment_map", "snapshot"} <= set(out["actions"])
    assert out["html"] > 0 and out["text_has_alloc"]


def test_an_out_of_memory_observer_sees_the_history_up_to_the_oom(tmp_path):
    out, script = run_job(tmp_path, """
        torch.cuda.memory._record_memory_history(max_entries=100000)
        before = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")  # MARK-before
        seen = {}
        def observer(device, alloc, device_alloc, device_free):
            seen["args"] = [alloc, device_alloc, device_free]
            snap = torch.cuda.memory._snapshot()
            trace = snap["device_traces"][device]
            seen["actions"] = [e["action"] for e in trace]
            seen["oom_size"] = next(e["size"] for e in reversed(trace) if e["action"] == "oom")
            seen["before_frames"] = [[f["filename"], f["line"]] for e in trace
                                     if e["action"] == "alloc" and e["addr"] == before.data_ptr()
                                     for f in e["frames"]]
        torch._C._cuda_attach_out_of_memory_observer(observer)
        raised = False
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # more than any GPU's address space
        except torch.OutOfMemoryError:
            raised = True
        print(json.dumps(dict(seen, raised=raised)))
    """)
    assert out["raised"] is True
    assert "oom" in out["actions"] and "alloc" in out["actions"]
    assert out["actions"].index("alloc") < out["actions"].index("oom")
    assert out["oom_size"] == 1 << 50
    # As PyTorch calls it: the size that failed, the memory the process may use, the free memory.
    alloc, allowed, free = out["args"]
    assert alloc == 1 << 50 and 0 < free <= allowed
    assert [script, line_of(script, "MARK-before")] in out["before_frames"]
