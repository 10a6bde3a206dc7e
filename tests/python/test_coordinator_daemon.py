"""The coordinator daemon with simulated job processes (real client, shared memory,
CachingAllocator on the SimulatedBackend), including kill -9 fault injection."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from cotenant import _core
from cotenant.coordinator import client
from coordinator_harness import MiB, Node, child_env, wait_until


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def test_status_lists_registered_jobs_with_their_allocator_numbers(node):
    node.start_coordinator()
    g = node.start_job("guaranteed", "train-a", hold_mib=256)
    o = node.start_job("opportunistic", "train-b", hold_mib=128)
    assert wait_until(lambda: (node.job("train-a") or {}).get("device_bytes") == 256 * MiB)
    assert wait_until(lambda: (node.job("train-b") or {}).get("allocated_bytes") == 128 * MiB)
    a, b = node.job("train-a"), node.job("train-b")
    assert (a["pid"], a["role"], a["gpu"]) == (g.pid, "guaranteed", 0)
    assert (b["pid"], b["role"]) == (o.pid, "opportunistic")
    assert a["cap"] is not None and b["cap"] is not None
    assert a["cap"] + b["cap"] <= 1024 * MiB - 128 * MiB  # the headroom stays free
    # The node's host headroom reaches each job at registration (the harness runs with 0).
    assert g.registration["host_headroom_bytes"] == 0 and o.registration["host_headroom_bytes"] == 0


def test_guaranteed_burst_shrinks_opportunistic_cap_then_grows_guaranteed_cap(node):
    node.start_coordinator()
    g = node.start_job("guaranteed", "g", hold_mib=256)
    node.start_job("opportunistic", "o", hold_mib=512)
    assert wait_until(lambda: (node.job("o") or {}).get("device_bytes", 0) >= 256 * MiB)
    cap_before = node.job("g")["cap"]
    g.burst(512)  # the guaranteed job now needs 768 MiB of the 896 MiB usable
    assert wait_until(lambda: node.job("g")["device_bytes"] == 768 * MiB and node.job("g")["host_bytes"] == 0,
                      timeout=5), node.status()
    o = node.job("o")
    assert o["host_bytes"] >= 384 * MiB  # the opportunistic job's pages spilled
    assert o["device_bytes"] <= o["cap"]
    assert node.job("g")["cap"] > cap_before
    assert o["device_bytes"] + node.job("g")["device_bytes"] <= 896 * MiB
    # Ordering: the guaranteed cap grew only into memory the opportunistic job had given
    # up: every record that shows it above where it was before the burst shows it fitting
    # beside what the opportunistic job held (which only shrinks from then on). Either
    # job's device bytes may pass its own cap between two of its safe points, so their
    # sum alone may pass 896 MiB for a moment. The burst can finish within one history
    # interval: wait for a record of both.
    def grown():
        samples = {}
        for r in client.history(node.socket):
            if "device_bytes" in r:
                samples.setdefault(r["t"], {})[r["job"]] = r
        return [(s["g"]["cap"], s["o"]["device_bytes"]) for s in samples.values()
                if len(s) == 2 and s["g"]["cap"] > cap_before]

    assert wait_until(lambda: grown(), timeout=5)
    assert all(cap + held <= 896 * MiB for cap, held in grown()), grown()


def test_a_squeeze_that_would_pin_the_hosts_headroom_is_held_back_and_shown():
    # A host headroom larger than any node: no squeeze may pin anything.
    node = Node(host_headroom="1024TiB")
    try:
        node.start_coordinator()
        # o holds less than the burst margin its first cap leaves it, so it never
        # spills by itself (a job growing past its own cap is not a squeeze).
        o_job = node.start_job("opportunistic", "o", hold_mib=192)
        assert o_job.registration["host_headroom_bytes"] == 1024 << 40  # what the job then keeps too
        g = node.start_job("guaranteed", "g", hold_mib=256)
        assert wait_until(lambda: (node.job("g") or {}).get("device_bytes", 0) == 256 * MiB)
        assert node.job("o")["device_bytes"] == 192 * MiB and node.job("o")["squeeze_held_back_bytes"] == 0
        g.burst(512)  # g needs more than the GPU: the plan squeezes o to its minimum cap
        assert wait_until(lambda: node.job("o")["squeeze_held_back_bytes"] >= 180 * MiB, timeout=5), \
            (node.status()["jobs"], node.read_log())
        time.sleep(0.5)  # ten ticks: the cap stays up
        o, g_now = node.job("o"), node.job("g")
        assert o["host_bytes"] == 0 and o["device_bytes"] == 192 * MiB and o["cap"] >= 192 * MiB
        # The guaranteed cap grew only into memory free on the device: g spills past it itself.
        assert g_now["cap"] + o["device_bytes"] <= 896 * MiB and g_now["host_bytes"] > 0
        host = node.status()["host"]
        assert host["held_back_bytes"] == o["squeeze_held_back_bytes"] and host["headroom_bytes"] == 1024 << 40
        assert "squeezes held back by" in host["note"] and "host_headroom" in host["note"]
        assert "squeeze held back by host memory" in node.read_log()
    finally:
        node.close()


def test_a_job_whose_own_limit_is_near_is_squeezed_only_as_far_as_it_can_pin(node):
    # o may pin 64 MiB (as in a container whose memory cgroup is near its limit); the node has room.
    node.start_coordinator()
    node.start_job("opportunistic", "o", hold_mib=192, env={"SIMULATED_HOST_CAPACITY_MIB": "64"})
    g = node.start_job("guaranteed", "g", hold_mib=256)
    assert wait_until(lambda: (node.job("o") or {}).get("host_room_bytes") == 64 * MiB), node.status()["jobs"]
    g.burst(512)  # the plan would squeeze o to its minimum cap: 190 MiB to pin
    # It gets the cap its 64 MiB can reach, and reaches it: not a cap it would stay above forever.
    assert wait_until(lambda: node.job("o")["host_bytes"] == 64 * MiB and node.job("o")["device_bytes"] == 128 * MiB,
                      timeout=5), node.status()["jobs"]
    assert wait_until(lambda: node.job("o")["host_room_bytes"] == 0), node.status()["jobs"]
    time.sleep(0.3)
    o = node.job("o")
    assert o["cap"] >= o["device_bytes"] == 128 * MiB and o["pending_migration_bytes"] == 0
    assert o["squeeze_held_back_bytes"] >= 120 * MiB
    assert "squeeze held back by host memory" in node.read_log()


def test_jobs_of_one_memory_cgroup_on_two_gpus_share_its_room(node):
    # Every job here runs in this test's cgroup, as the ranks of one container do: one room between them.
    # Each simulated job's own figure counts only its own pins, so sharing is the coordinator's doing.
    node.start_coordinator()
    near = {"SIMULATED_HOST_CAPACITY_MIB": "64"}
    node.start_job("opportunistic", "o0", hold_mib=192, env={**near, "COTENANT_DEVICE": "0"})
    g0 = node.start_job("guaranteed", "g0", hold_mib=256, env={"COTENANT_DEVICE": "0"})
    node.start_job("opportunistic", "o1", hold_mib=192, env={**near, "COTENANT_DEVICE": "1"})
    g1 = node.start_job("guaranteed", "g1", hold_mib=256, env={"COTENANT_DEVICE": "1"})
    assert wait_until(lambda: all((node.job(n) or {}).get("host_room_bytes") is not None
                                  for n in ("o0", "g0", "o1", "g1"))), node.status()["jobs"]
    g0.burst(512)
    assert wait_until(lambda: node.job("o0")["host_bytes"] == 64 * MiB and node.job("o0")["host_room_bytes"] == 0,
                      timeout=5), [{k: j[k] for k in ("name", "cap", "device_bytes", "host_bytes", "host_room_bytes",
                                                   "squeeze_held_back_bytes", "pending_migration_bytes")}
                                   for j in node.status()["jobs"]]
    g1.burst(512)
    assert wait_until(lambda: node.job("o1")["squeeze_held_back_bytes"] >= 180 * MiB, timeout=5), node.status()["jobs"]
    time.sleep(0.3)
    o1 = node.job("o1")
    assert o1["host_bytes"] == 0 and o1["device_bytes"] == 192 * MiB and o1["host_room_bytes"] == 64 * MiB


def _fake_cgroup_fs(root, room_bytes, usage_bytes=1 << 30):
    """A cgroup filesystem under `root` in which this process's memory cgroup, and so its children's, has a
    limit leaving `room_bytes`: v1's memory controller where /proc/self/cgroup names one, else v2. Returns the
    cgroup's path and a function that sets its usage (as the kernel charges what its processes pin)."""
    with open("/proc/self/cgroup") as f:
        lines = [line.split(":", 2) for line in f.read().splitlines()]
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    if v1:
        top, path, limit_file, usage_file = root / "memory", v1[0], "memory.limit_in_bytes", "memory.usage_in_bytes"
    else:
        top, path, limit_file, usage_file = root, [p for i, c, p in lines if i == "0" and not c][0], "memory.max", \
            "memory.current"
    directory = top / path.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    limit = usage_bytes + room_bytes
    (directory / limit_file).write_text(f"{limit}\n")
    (directory / "memory.stat").write_text("inactive_file 0\ntotal_inactive_file 0\n")

    def set_usage(usage):
        (directory / usage_file).write_text(f"{usage}\n")

    set_usage(usage_bytes)
    return path, set_usage


def test_a_limited_memory_cgroup_the_coordinator_reads_bounds_the_squeezes_of_the_jobs_under_it(tmp_path):
    # The job reports a roomy host (1 TiB): only the cgroup the coordinator reads (the one every process here
    # is under) bounds its squeeze. Ranks in sibling cgroups under one limit share it the same way
    # (test_policy.py: test_ranks_in_sibling_cgroups_share_the_room_of_the_limited_cgroup_above_them).
    path, set_usage = _fake_cgroup_fs(tmp_path / "cgroup", 0)
    node = Node(extra_args=("--memory-cgroup-root", str(tmp_path / "cgroup")))
    try:
        node.start_coordinator()
        node.start_job("opportunistic", "o", hold_mib=192)
        g = node.start_job("guaranteed", "g", hold_mib=256)
        assert node.job("o")["memory_cgroups"] == [{"path": path, "room_bytes": 0}]
        assert node.job("o")["host_room_bytes"] > 1 << 39
        g.burst(512)  # the plan squeezes o by about 190 MiB; the cgroup is at its limit
        assert wait_until(lambda: node.job("o")["squeeze_held_back_bytes"] >= 180 * MiB, timeout=5), \
            node.status()["jobs"]
        time.sleep(0.3)
        assert node.job("o")["host_bytes"] == 0 and node.job("o")["device_bytes"] == 192 * MiB
        set_usage(0)  # the cgroup's processes free its 1 GiB: room for the squeeze
        assert wait_until(lambda: node.job("o")["host_bytes"] >= 180 * MiB, timeout=5), node.status()["jobs"]
        assert node.job("o")["squeeze_held_back_bytes"] == 0
        assert node.job("o")["memory_cgroups"] == [{"path": path, "room_bytes": 1 << 30}]
    finally:
        node.close()


def test_guaranteed_slowdown_cuts_the_opportunistic_share(node):
    node.start_coordinator()
    g = node.start_job("guaranteed", "g", hold_mib=64, iteration_us=5000)
    node.start_job("opportunistic", "o", hold_mib=64)
    assert wait_until(lambda: node.job("o")["share"] >= 0.1, timeout=10), node.status()
    g.set_iteration_us(10000)  # twice its baseline
    peak = node.job("o")["share"]
    assert wait_until(lambda: node.job("o")["share"] < peak / 1.9, timeout=5), node.status()


def test_a_guaranteed_job_still_slow_with_its_neighbour_paused_gets_a_new_baseline_and_the_neighbour_its_share(node):
    # The guaranteed job's steps double for good (a phase with longer
    # sequences): the share policy halves the opportunistic share to 0, and
    # the job stays twice its baseline with no one beside it. Its baseline is
    # measured again, and the neighbour climbs back; before, it stayed at 0
    # for as long as the guaranteed job ran.
    node.args += ["--share-interval-s", "0.05"]
    node.start_coordinator()
    g = node.start_job("guaranteed", "g", hold_mib=16, iteration_us=5000)
    node.start_job("opportunistic", "o", hold_mib=16)
    assert wait_until(lambda: node.job("o")["share"] >= 0.1, timeout=10), node.status()
    first = node.job("g")["baseline_us"]
    assert 4000 <= first <= 7000, node.status()
    g.set_iteration_us(10000)
    assert wait_until(lambda: node.job("o")["share"] == 0.0, timeout=10), node.status()
    assert wait_until(lambda: (node.job("g")["baseline_us"] or 0) >= 8000 and node.job("o")["share"] > 0,
                      timeout=10), node.status()
    assert "baseline measured again" in node.read_log()


def test_a_guaranteed_job_that_only_marks_iterations_gets_a_baseline_and_protection(node):
    # The simulated job marks iteration ends only (as `with cotenant.iteration():`
    # does): its iteration times are the tracker's, reported in its block.
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=64, iteration_us=4000)
    assert wait_until(lambda: node.job("g")["baseline_us"] is not None, timeout=15), node.status()
    g = node.job("g")
    assert g["iteration_count"] > 0
    assert 3000 <= g["baseline_us"] <= 40000  # measured, not declared: about 4 ms a step
    assert g["slowdown"] is not None


def test_a_guaranteed_job_whose_iterations_stop_during_its_baseline_does_not_pause_the_others_for_good(node):
    # Its baseline needs 13 iterations; stopped after the first few (SIGSTOP,
    # a hang, a long phase without steps), it held every opportunistic job of
    # its GPU at share 0 for as long as it stayed stopped.
    node.args += ["--baseline-timeout-s", "2"]
    node.start_coordinator()
    g = node.start_job("guaranteed", "g", hold_mib=16, iteration_us=100000)
    node.start_job("opportunistic", "o", hold_mib=16)
    assert wait_until(lambda: node.job("g")["iteration_count"] >= 1, timeout=10), node.status()
    os.kill(g.pid, signal.SIGSTOP)
    try:
        assert node.job("g")["baseline_us"] is None and node.job("o")["share"] == 0.0
        assert wait_until(lambda: node.job("o")["share"] > 0, timeout=8), node.status()
    finally:
        os.kill(g.pid, signal.SIGCONT)
    # Iterating again, it pauses the others until its solo baseline is measured.
    assert wait_until(lambda: node.job("g")["baseline_us"] is not None or node.job("o")["share"] == 0.0,
                      timeout=10), node.status()
    assert wait_until(lambda: node.job("g")["baseline_us"] is not None, timeout=15), node.status()


def test_the_coordinator_share_reaches_the_job_through_its_block_only(node):
    node.start_coordinator()
    o = node.start_job("opportunistic", "o", hold_mib=32)
    client.set_share("o", 0.3, node.socket)
    assert wait_until(lambda: node.job("o")["applied_share"] == 0.3)
    assert node.job("o")["effective_share"] == pytest.approx(0.3)
    block = _core.JobBlock.open(o.registration["block_name"])
    assert block.control()["share"] == 0.3
    block.close()
    # The per-GPU segment has no share field for anyone to write.
    assert not [name for name, _, _ in _core.gpu_block_layout() if "share" in name]


def test_set_cap_takes_a_fraction_of_the_gpu(node):
    node.start_coordinator()  # a 1 GiB GPU
    node.start_job("opportunistic", "o", hold_mib=32)
    reply = client.set_cap("o", "0.25", node.socket)
    assert reply["user_cap"] == 256 * MiB
    assert wait_until(lambda: node.job("o")["applied_cap"] is not None and node.job("o")["applied_cap"] <= 256 * MiB)
    with pytest.raises(ValueError, match="6 apples"):
        client.set_cap("o", "6 apples", node.socket)


def test_killed_coordinator_leaves_jobs_running_with_last_cap_and_share_and_restart_readopts_them(node):
    node.start_coordinator()
    g = node.start_job("guaranteed", "g", hold_mib=128)
    o = node.start_job("opportunistic", "o", hold_mib=128)
    client.set_cap("o", 64 * MiB, node.socket)
    client.set_share("o", 0.3, node.socket)
    assert wait_until(lambda: node.job("o")["applied_cap"] == 64 * MiB and node.job("o")["applied_share"] == 0.3)
    node.kill_coordinator()

    time.sleep(0.5)
    assert g.alive() and o.alive()
    block = _core.JobBlock.open(o.registration["block_name"])
    control, report = block.control(), wait_until(block.report)  # None while the job's writer is mid-update
    assert (control["memory_cap"], control["share"]) == (64 * MiB, 0.3)
    assert report["applied_memory_cap"] == 64 * MiB and report["applied_share"] == 0.3
    assert report["device_bytes"] <= 64 * MiB
    beat = block.heartbeat_ns()
    assert wait_until(lambda: block.heartbeat_ns() > beat)  # the job side keeps publishing
    block.close()

    started = time.monotonic()
    node.start_coordinator(wait=False)
    view = wait_until(lambda: (s := node.answers()) and len(s["jobs"]) == 2 and s, timeout=5, interval=0.005)
    readopted_after = time.monotonic() - started
    assert view, node.read_log()
    assert {j["name"] for j in view["jobs"]} == {"g", "o"}
    assert all(j["adopted"] for j in view["jobs"])
    o_view = node.job("o")
    assert (o_view["user_cap"], o_view["share"], o_view["share_pinned"]) == (64 * MiB, 0.3, True)
    # Within 1 s of launching the new coordinator, interpreter start-up included.
    assert readopted_after < 1.0
    assert '"job re-adopted"' in node.read_log()


def test_a_restart_on_the_same_socket_reached_through_a_symbolic_link_readopts_the_jobs(node):
    # /var/run is a link to /run on most systems: the same socket, state file
    # and lock, spelled another way, must not lose the running jobs.
    link = node.directory + "-link"
    os.symlink(node.directory, link)
    real = node.socket
    try:
        node.start_coordinator()
        node.start_job("opportunistic", "o", hold_mib=32)
        client.set_cap("o", 64 * MiB, node.socket)
        node.kill_coordinator()
        node.socket = os.path.join(link, os.path.basename(real))
        node.start_coordinator()
        view = node.job("o")
        assert view is not None, node.read_log()
        assert view["adopted"] and view["user_cap"] == 64 * MiB
    finally:
        node.socket = real
        os.unlink(link)


def test_an_unreadable_state_file_is_kept_aside_named_and_no_running_job_block_is_removed(node):
    # A disk error or a hand edit: the coordinator cannot tell its jobs' blocks
    # from leftovers, so it removes none, says so, and keeps the file for
    # reading by hand instead of overwriting it with its next save.
    node.start_coordinator()
    o = node.start_job("opportunistic", "o", hold_mib=32)
    node.kill_coordinator()
    state = node.socket + ".state.json"
    with open(state, "wb") as f:
        f.write(b'{"1": {"name": "o", "blo')  # cut short
    node.start_coordinator()
    assert node.status()["jobs"] == []
    assert o.registration["block_name"].lstrip("/") in [b.lstrip("/") for b in node.blocks()]
    log = node.read_log()
    assert '"state file unreadable"' in log and "is not JSON" in log
    kept = [n for n in os.listdir(node.directory) if ".state.json.unreadable-" in n]
    assert len(kept) == 1
    with open(os.path.join(node.directory, kept[0]), "rb") as f:
        assert f.read() == b'{"1": {"name": "o", "blo'


def test_job_killed_with_sigkill_is_reclaimed_within_one_second(node):
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=128)
    o = node.start_job("opportunistic", "o", hold_mib=256)
    assert wait_until(lambda: node.job("o") is not None and node.job("o")["device_bytes"] > 0)
    g_cap_before = node.job("g")["cap"]
    assert len(node.blocks()) == 2
    o.kill(reap=False)  # a zombie until reaped: still counts as dead
    killed = time.monotonic()
    assert wait_until(lambda: node.job("o") is None, timeout=2)
    assert time.monotonic() - killed < 1.0
    assert len(node.blocks()) == 1
    assert wait_until(lambda: node.job("g")["cap"] > g_cap_before)  # the memory went back to the guaranteed job


def test_opportunistic_job_whose_persistent_memory_can_never_fit_is_refused_with_the_reason(node):
    node.start_coordinator()
    job = node.start_job("opportunistic", "huge", persistent_mib=2048, expect_registration=False)
    assert job.process.wait(timeout=10) != 0
    assert node.job("huge") is None
    assert "job refused" in node.read_log()
    with pytest.raises(client.AdmissionRefused, match="exceeds what this GPU can ever give"):
        client.register("opportunistic", 0, name="huge", socket=node.socket, persistent_bytes="2GiB")


def test_opportunistic_job_is_queued_until_its_persistent_memory_fits(node):
    node.start_coordinator()
    g = node.start_job("guaranteed", "g", hold_mib=64)
    g.burst(512)
    assert wait_until(lambda: node.job("g")["device_bytes"] >= 576 * MiB)
    o = node.start_job("opportunistic", "o", hold_mib=32, persistent_mib=400)
    assert o.registration["admitted"] is False
    view = node.job("o")
    assert view["state"] == "queued" and "does not fit" in view["queue_reason"] and view["share"] == 0
    g.burst(0)
    assert wait_until(lambda: node.job("o")["state"] != "queued", timeout=5), node.status()


def test_register_returns_none_when_no_coordinator_runs(node):
    assert client.register("opportunistic", 0, socket=node.socket) is None


def test_second_coordinator_on_the_same_socket_refuses_to_start(node):
    node.start_coordinator()
    second = subprocess.run([sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", node.socket],
                            env=child_env(), capture_output=True, text=True, timeout=30)
    assert second.returncode != 0
    assert "already serves" in second.stderr
    assert node.answers()


def test_random_kill_points_never_crash_a_job_and_state_recovers(node):
    rng = random.Random(20260522)
    node.start_coordinator()
    live = [node.start_job("guaranteed", "g", hold_mib=128)]
    for step in range(14):
        action = rng.choice(["kill_coordinator", "kill_job", "start_job", "burst", "kill_during_registration"])
        if action == "kill_during_registration":
            job = node.spawn_job("opportunistic", f"r{step}", hold_mib=32)
            time.sleep(rng.uniform(0, 0.4))
            node.kill_coordinator()
            node.start_coordinator()
            if job.wait_started().get("registration"):
                live.append(job)  # registered before the kill: must be re-adopted
            else:
                assert job.process.wait(timeout=10) == 0  # ran on its own and finished: no crash
        elif action == "kill_coordinator" and node.coordinator.poll() is None:
            time.sleep(rng.uniform(0, 0.2))
            node.kill_coordinator()
        elif action == "kill_job" and len(live) > 1:
            victim = live.pop(rng.randrange(1, len(live)))
            victim.kill()
        elif action == "start_job" and node.coordinator.poll() is None:
            live.append(node.start_job("opportunistic", f"o{step}", hold_mib=rng.choice([32, 64, 128])))
        elif action == "burst":
            live[0].burst(rng.choice([0, 256, 512]))
        if node.coordinator.poll() is not None:
            node.start_coordinator()
        # Invariants: every job we did not kill still runs; the coordinator lists exactly them.
        assert all(job.alive() for job in live), f"step {step}: a job crashed"
        expected = {job.registration["name"] for job in live}
        assert wait_until(lambda: {j["name"] for j in node.status()["jobs"]} == expected, timeout=2), (
            step, action, node.status(), node.read_log())
        assert len(node.blocks()) == len(live)


def test_metrics_endpoint_serves_job_gauges(node):
    import socket as socket_module

    with socket_module.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node.args += ["--metrics-port", str(port)]
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=64)

    def scrape():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return ""

    text = wait_until(lambda: (t := scrape()) and 'cotenant_job_device_bytes{gpu="index:0",job="g",role="guaranteed"} 6.7108864e+07' in t and t)
    assert text, scrape()
    assert "cotenant_job_memory_cap_bytes" in text
    # Spill and restore bytes and page moves, per job and per GPU.
    client.set_cap("g", "32MiB", socket=node.socket)
    wanted = ['cotenant_job_spilled_bytes{gpu="index:0",job="g",role="guaranteed"} 3.3554432e+07',
              'cotenant_job_page_moves{gpu="index:0",job="g",role="guaranteed"} 16.0',
              'cotenant_gpu_spilled_bytes{gpu="index:0"} 3.3554432e+07',
              'cotenant_gpu_host_bytes{gpu="index:0"} 3.3554432e+07',
              'cotenant_gpu_page_moves{gpu="index:0"} 16.0']
    assert wait_until(lambda: all(w in scrape() for w in wanted)), scrape()
    assert "cotenant_job_restored_bytes" in scrape() and "cotenant_gpu_restored_bytes" in scrape()
    # Raised again: the pages come back and their host pages stay pinned with the job, under its cap.
    client.set_cap("g", "128MiB", socket=node.socket)
    kept = ['cotenant_job_host_pool_bytes{gpu="index:0",job="g",role="guaranteed"} 3.3554432e+07',
            'cotenant_gpu_host_pool_bytes{gpu="index:0"} 3.3554432e+07',
            'cotenant_gpu_host_bytes{gpu="index:0"} 0.0']
    assert wait_until(lambda: all(w in scrape() for w in kept)), scrape()
    assert node.job("g")["host_pool_bytes"] == 32 * MiB
    # The node's host memory: what the jobs pin (the kept pages), and what the node has.
    assert "cotenant_node_host_pinned_bytes 3.3554432e+07" in scrape()
    assert "cotenant_node_host_available_bytes" in scrape()
    host = node.status()["host"]
    assert host["pinned_by_jobs_bytes"] == 32 * MiB and host["squeezable_bytes"] == 0  # no opportunistic job
    assert 0 < host["available_bytes"] <= host["total_bytes"]


def test_coordinator_logs_are_json_lines(node):
    node.start_coordinator()
    node.start_job("guaranteed", "g")
    assert wait_until(lambda: "job registered" in node.read_log())
    events = [json.loads(line) for line in node.read_log().splitlines() if line.startswith("{")]
    registered = [e for e in events if e["event"] == "job registered"]
    assert registered and registered[0]["job"] == "g" and registered[0]["role"] == "guaranteed"


def test_cli_status_set_cap_set_share_and_timeline(node, tmp_path):
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=64)
    node.start_job("opportunistic", "o", hold_mib=64)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "cotenant.cli", *args, "--socket", node.socket],
                              env=child_env(), capture_output=True, text=True, timeout=30)

    assert cli("set-cap", "o", "100MiB").returncode == 0
    assert cli("set-share", "o", "0.25").returncode == 0
    assert wait_until(lambda: node.job("o")["applied_cap"] == 100 * MiB)
    table = cli("status")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    gpu_line, note = lines[:2]  # the simulated jobs report no GPU UUID
    assert gpu_line.startswith("index:0 (index 0): 1.00 GiB total") and "for 2 jobs" in gpu_line
    assert note.startswith("  note: index:0: the job reported no GPU UUID")
    header, *rows = lines[lines.index("") + 1:]
    assert header.split()[:5] == ["GPU", "JOB", "PID", "ROLE", "STATE"]
    o_row = next(r for r in rows if r.startswith("index:0") and "o (" in r)
    assert "100.00 MiB" in o_row and "0.25*" in o_row and " throttled " in o_row
    as_json = json.loads(cli("status", "--json").stdout)
    assert {j["name"] for j in as_json["jobs"]} == {"g", "o"}
    bad = cli("set-share", "o", "1.5")
    assert bad.returncode != 0 and "from 0 (paused) to 1" in bad.stderr
    missing = cli("set-cap", "nobody", "1GiB")
    assert missing.returncode == 1 and "no job named 'nobody'" in missing.stderr
    time.sleep(0.6)  # a few history samples
    png = tmp_path / "timeline.png"
    drawn = cli("timeline", "-o", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cotenant_run_enables_the_child_through_environment_variables(node):
    script = ("import os, json, sys; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('COTENANT_')}));"
              "print(os.environ['PYTHONPATH'])")
    out = subprocess.run(
        [sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", "--cap", "2GiB", "--name", "sidecar",
         "--device", "1", "--socket", node.socket, "--allow-uncapped", "--", sys.executable, "-c", script],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    variables, pythonpath = out.stdout.splitlines()[-2:]
    variables = json.loads(variables)
    assert variables.pop("COTENANT_JOB_PID").isdigit()  # the job's pid: its children are not jobs
    assert variables == {
        "COTENANT_ENABLE": "1", "COTENANT_ROLE": "opportunistic", "COTENANT_MEMORY_CAP": str(2 << 30),
        "COTENANT_DEVICE": "1", "COTENANT_SOCKET": node.socket, "COTENANT_JOB_NAME": "sidecar",
        "COTENANT_ALLOW_UNCAPPED": "1",
    }
    assert pythonpath.split(os.pathsep)[0].endswith(os.path.join("cotenant", "_autoenable"))


def test_cotenant_run_refuses_a_bad_cap_before_starting_the_child():
    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--guaranteed", "--cap", "lots", "--", "true"],
                         env=child_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "lots" in out.stderr and "Traceback" not in out.stderr


def test_cotenant_run_cap_only_gives_the_child_a_cap_and_no_role():
    script = "import os; print(os.environ.get('COTENANT_ROLE', '-'), os.environ['COTENANT_MEMORY_CAP'])"
    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--cap-only", "--cap", "6GiB", "--",
                          sys.executable, "-c", script],
                         env={**child_env(), "COTENANT_ROLE": "guaranteed", "COTENANT_DISABLE": "1"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-", str(6 << 30)]


def test_cotenant_run_takes_a_fraction_of_the_gpu_and_the_child_reads_it_the_same_way():
    script = ("import os; from cotenant import api; cap = api.to_cap(os.environ['COTENANT_MEMORY_CAP']);"
              "print(os.environ['COTENANT_MEMORY_CAP'], cap.resolve(16 << 30))")
    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", "--cap", "0.5", "--",
                          sys.executable, "-c", script], env={**child_env(), "COTENANT_DISABLE": "1"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.5", str(8 << 30)]


def test_suspend_moves_all_memory_to_the_host_and_resume_brings_it_back(node):
    node.start_coordinator()
    node.start_job("opportunistic", "o", hold_mib=96)
    assert wait_until(lambda: node.job("o")["device_bytes"] == 96 * MiB)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "cotenant.cli", *args, "--socket", node.socket],
                              env=child_env(), capture_output=True, text=True, timeout=30)

    assert cli("suspend", "o").returncode == 0
    assert wait_until(lambda: node.job("o")["state"] == "suspended"), node.status()
    o = node.job("o")
    assert o["device_bytes"] == 0 and o["host_bytes"] == 96 * MiB
    assert cli("resume", "o").returncode == 0
    assert wait_until(lambda: node.job("o")["state"] == "running" and node.job("o")["device_bytes"] == 96 * MiB)
    assert node.job("o")["host_bytes"] == 0


def test_a_job_suspended_by_a_coordinator_that_died_runs_on_its_own_and_is_suspended_again_on_its_return(node):
    node.args += ["--jobs-on-their-own-after-s", "1"]
    node.start_coordinator()
    o = node.start_job("opportunistic", "o", hold_mib=96)
    assert wait_until(lambda: node.job("o")["device_bytes"] == 96 * MiB)
    client.send_command("o", "suspend", node.socket)
    assert wait_until(lambda: node.job("o")["state"] == "suspended"), node.status()
    node.kill_coordinator()
    killed = time.monotonic()
    block = _core.JobBlock.open(o.registration["block_name"])

    def report():
        return block.report() or {}

    assert block.coordinator_heartbeat()["silence_limit_ns"] == 1_000_000_000
    assert report().get("state") == "suspended"  # the limit has not passed yet
    assert wait_until(lambda: report().get("state") == "running" and report().get("device_bytes") == 96 * MiB,
                      timeout=10), report()
    assert time.monotonic() - killed >= 1.0
    assert report()["host_bytes"] == 0 and report()["effective_share"] == 1.0
    assert "has not heard from the coordinator" in node.read_log()
    block.close()

    node.start_coordinator()  # adopts the job, whose suspension it never lifted
    assert wait_until(lambda: (j := node.job("o")) and j["state"] == "suspended" and j["device_bytes"] == 0,
                      timeout=10), node.status()
    assert "hears the coordinator again" in node.read_log()
    client.send_command("o", "resume", node.socket)
    assert wait_until(lambda: node.job("o")["state"] == "running" and node.job("o")["device_bytes"] == 96 * MiB)
    assert o.alive()


def test_job_on_a_gpu_the_coordinator_does_not_manage_is_refused_with_the_managed_list(node):
    node.args += ["--gpus", "0,1"]
    node.start_coordinator()
    with pytest.raises(client.CoordinatorError, match=r"manages GPUs \[0, 1\], not GPU 3"):
        client.register("guaranteed", 3, socket=node.socket)
    assert client.register("guaranteed", 1, name="on-one", socket=node.socket).name == "on-one"


def test_status_larger_than_the_request_limit_still_arrives(node):
    node.start_coordinator()
    for i in range(120):  # registrations from this process, one per GPU index
        client.register("opportunistic", i, name=f"job-with-a-long-name-number-{i:03d}", socket=node.socket)
    view = client.status(node.socket)
    assert len(view["jobs"]) == 120
    assert len(json.dumps(view)) > 64 * 1024


def test_sigterm_stops_the_coordinator_but_leaves_jobs_and_their_blocks(node):
    node.start_coordinator()
    job = node.start_job("opportunistic", "o", hold_mib=32)
    node.coordinator.send_signal(signal.SIGTERM)
    assert node.coordinator.wait(timeout=10) == 0
    assert not os.path.exists(node.socket)
    assert job.alive() and len(node.blocks()) == 1
    assert '"coordinator stopped"' in node.read_log()


@pytest.mark.parametrize("flag,variable,size,bad_size", [
    ("--persistent", "COTENANT_PERSISTENT_MEMORY", "10GiB", "heaps"),  # for admission
    ("--host-reserve", "COTENANT_HOST_RESERVE", "4GiB", "lots"),
    ("--host-headroom", "COTENANT_HOST_HEADROOM", "8GiB", "some"),
])
def test_cotenant_run_passes_a_size_to_the_job_and_refuses_a_bad_one(flag, variable, size, bad_size):
    script = f"import os; print(os.environ.get({variable!r}))"
    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", flag, size,
                          "--", sys.executable, "-c", script], env={**child_env(), "COTENANT_DISABLE": "1"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == size
    bad = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", flag, bad_size,
                          "--", "true"], env=child_env(), capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and bad_size in bad.stderr


def test_two_commands_sent_before_the_job_applies_the_first_both_take_effect_in_order(node):
    # The block holds one command and the job applies the newest it finds: a suspend and then a
    # spill written while the job did not poll (stopped here; two commands inside one 2 ms poll
    # do the same) left only the spill, acknowledged both, and the job ran on, never suspended.
    node.start_coordinator()
    job = node.start_job("opportunistic", "o", hold_mib=32)
    assert wait_until(lambda: node.job("o")["device_bytes"] == 32 * MiB)
    os.kill(job.process.pid, signal.SIGSTOP)
    try:
        first = client.send_command("o", "suspend", node.socket)
        second = client.send_command("o", "spill_all", node.socket)
    finally:
        os.kill(job.process.pid, signal.SIGCONT)
    assert second["sequence"] == first["sequence"] + 1
    assert wait_until(lambda: node.job("o")["state"] == "suspended"), node.status()
    assert wait_until(lambda: node.job("o").get("applied_command_sequence") == second["sequence"]), node.status()
    assert '"waited": true' in node.read_log()
