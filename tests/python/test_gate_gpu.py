"""The launch gate on a real GPU: two real processes on one device, the
opportunistic one makes progress, pauses when its share goes to 0 and
resumes when it is raised. Marked `gpu`: skipped, with the reason shown, on
machines without one."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.gpu

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import cotenant
    role, progress_path = sys.argv[1], sys.argv[2]
    cotenant.enable(role=role, device=0)
    x = torch.randn(2048, 2048, device="cuda")
    steps = 0
    while True:
        if role == "guaranteed":
            with cotenant.gate.iteration():
                for _ in range(4):
                    y = x @ x
                torch.cuda.synchronize()
            time.sleep(0.005)  # leaves the GPU idle about half the time
        else:
            y = x @ x
            torch.cuda.synchronize()
        steps += 1
        if steps % 5 == 0:
            with open(progress_path + ".tmp", "w") as f:
                json.dump({"steps": steps, "time": time.time(), "gate": cotenant.gate.stats()}, f)
            os.replace(progress_path + ".tmp", progress_path)
""")


def read_progress(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return condition()


@pytest.fixture
def pair(tmp_path):
    from cotenant import _core as core

    segment = f"/cotenant-test-gpu-gate-{os.getpid()}"
    core.GpuPeerSegment.remove(segment)
    env = dict(os.environ, COTENANT_GPU_SEGMENT=segment)
    paths = {role: str(tmp_path / f"{role}.json") for role in ("guaranteed", "opportunistic")}
    processes = [subprocess.Popen([sys.executable, "-c", WORKER, role, paths[role]], env=env)
                 for role in ("guaranteed", "opportunistic")]
    try:
        yield core, segment, paths
    finally:
        for p in processes:
            p.kill()
            p.wait(10)
        core.GpuPeerSegment.remove(segment)


def test_opportunistic_process_progresses_pauses_and_resumes(pair):
    core, segment_name, paths = pair
    assert wait_for(lambda: read_progress(paths["guaranteed"]), 120), "the guaranteed job made no progress"
    first = wait_for(lambda: read_progress(paths["opportunistic"]), 120)
    assert first, "the opportunistic job made no progress"

    segment = core.GpuPeerSegment.open(segment_name, 0)
    view = segment.view()
    assert view["guaranteed"]["live"]
    assert view["guaranteed"]["iterations"]["iterations"] > 0
    (slot,) = [o["slot"] for o in view["opportunistic"] if o["live"]]
    moving = wait_for(lambda: (read_progress(paths["opportunistic"]) or {}).get("steps", 0) > first["steps"], 30)
    assert moving, "the opportunistic job stopped before it was paused"

    segment.set_share(slot, 0.0)  # as the coordinator pauses it
    time.sleep(1.0)  # ops already admitted finish
    paused_at = read_progress(paths["opportunistic"])["steps"]
    time.sleep(2.0)
    assert read_progress(paths["opportunistic"])["steps"] <= paused_at + 5, "share 0 did not pause the job"
    guaranteed_before = read_progress(paths["guaranteed"])["steps"]
    time.sleep(1.0)
    assert read_progress(paths["guaranteed"])["steps"] > guaranteed_before, "the guaranteed job stalled"

    segment.set_share(slot, 1.0)
    resumed = wait_for(lambda: read_progress(paths["opportunistic"])["steps"] > paused_at + 10, 30)
    assert resumed, "raising the share did not resume the job"
    stats = read_progress(paths["opportunistic"])["gate"]
    assert stats["role"] == "opportunistic"
    assert stats["admitted_ops"] > 0
    assert stats["waits_paused"] > 0


def test_explicit_gate_and_graph_replay_are_admitted_as_one_op():
    script = textwrap.dedent("""
        import os, torch, cotenant
        cotenant.enable(role="opportunistic", device=0)
        x = torch.randn(256, 256, device="cuda")
        before = cotenant.gate.stats()["admitted_ops"]
        with cotenant.gate():
            y = x @ x; z = y + 1   # ATen ops inside the explicit gate: one admission
        assert cotenant.gate.stats()["admitted_ops"] == before + 1, cotenant.gate.stats()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(2): y = x @ x
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = x @ x
        before = cotenant.gate.stats()["admitted_ops"]
        g.replay()
        assert cotenant.gate.stats()["admitted_ops"] == before + 1, cotenant.gate.stats()
        # Replays back to back, no ATen op between them: each is its own admission (the
        # first one's work is enqueued when it returns, not at the next ATen op's exit).
        before = cotenant.gate.stats()["admitted_ops"]
        for _ in range(3):
            g.replay()
        assert cotenant.gate.stats()["admitted_ops"] == before + 3, cotenant.gate.stats()
        print("ok")
    """)
    from cotenant import _core as core

    segment = f"/cotenant-test-gpu-explicit-{os.getpid()}"
    env = dict(os.environ, COTENANT_GPU_SEGMENT=segment)
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    finally:
        core.GpuPeerSegment.remove(segment)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout
