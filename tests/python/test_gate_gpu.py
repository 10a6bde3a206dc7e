"""The launch gate on a real GPU: two real processes on one device, the
opportunistic one makes progress, pauses when its share goes to 0 and
resumes when it is raised. Marked `gpu`: skipped, with the reason shown, on
machines without one."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import cotenant
    assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
    role, progress_path = cotenant.gate.role(), sys.argv[1]
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


def test_opportunistic_process_progresses_pauses_and_resumes(tmp_path):
    """Two jobs `cotenant run` starts on the GPU; the coordinator's share of 0
    stops the opportunistic one at its next op while the guaranteed one goes
    on, a share of 1 resumes it. (tests/python/test_torch_over_fake.py runs
    the same with copies over the fake CUDA runtime.)"""
    from coordinator_harness import check_the_share_pauses_and_resumes, guaranteed_and_opportunistic

    env = {k: v for k, v in os.environ.items() if not k.startswith("COTENANT_")}
    with guaranteed_and_opportunistic(WORKER, env, tmp_path) as (sock, paths):
        check_the_share_pauses_and_resumes(sock, paths, start_timeout=120, settle_s=1.0, pause_s=2.0)


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
