"""A bounded soak of the coordinator (docs/coordinator.md, "Security model"):
for COTENANT_SOAK_S seconds (default 120) hostile clients hammer its Unix
socket and its loopback metrics port while jobs start, die by SIGKILL and
take commands, and the coordinator itself is killed with SIGKILL and
restarted. At the end every acknowledged command is in force, every job that
was not killed is still managed, and no block is left behind.
"""

import json
import os
import random
import socket
import threading
import time

import pytest

from cotenant.coordinator import client
from coordinator_harness import MiB, Node, wait_until

SOAK_S = float(os.environ.get("COTENANT_SOAK_S", "120"))

pytestmark = pytest.mark.soak


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# What a hostile or broken client sends: none of it names a real job.
HOSTILE_LINES = [
    b"not json\n",
    b"{}\n",
    b'{"v": 1, "id": 1}\n',
    b'{"v": 99, "id": 1, "op": "status"}\n',
    b'{"v": 1, "id": 1, "op": "set_cap", "job": "nosuchjob", "memory_cap": "6 apples"}\n',
    b'{"v": 1, "id": 1, "op": "set_share", "job": "nosuchjob", "share": 1e999}\n',
    b'{"v": 1, "id": 1, "op": "register", "args": {"role": "guaranteed", "device": -1}}\n',
    b'{"v": 1, "id": 1, "op": "register", "args": {"role": "opportunistic", "device": 0, "name": "\xff\xfe"}}\n',
    b'{"v": 1, "id": [], "op": "command", "job": 7, "command": "rm -rf /"}\n',
    b"[" * 10000 + b"\n",
    b"x" * (1 << 17) + b"\n",
    b'{"v": 1, "id": 1, "op": "status"}',  # no newline: then silence
]


def _hostile(socket_path, metrics_port, stop, seed, counts):
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            if rng.random() < 0.2:
                with socket.create_connection(("127.0.0.1", metrics_port), timeout=1) as s:
                    s.sendall(rng.choice([b"GET /metrics HTTP/1.0\r\n\r\n", b"\x00" * 4096, b"GET /" + b"a" * 9000]))
                    s.recv(1 << 16)
            else:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1)
                    s.connect(socket_path)
                    for _ in range(rng.randint(0, 3)):
                        s.sendall(rng.choice(HOSTILE_LINES))
                    if rng.random() < 0.5:
                        s.recv(1 << 16)
            counts["sent"] += 1
        except OSError:
            counts["refused"] += 1  # the coordinator is down, busy, or closed on us: all allowed
            time.sleep(0.01)


class Expectations:
    """What each job's cap and share may be: the last acknowledged value, or
    (when the reply was lost) the one attempted since."""

    def __init__(self):
        self.caps, self.shares = {}, {}

    def attempt(self, table, name, value, acknowledged):
        if acknowledged:
            table[name] = {value}
        else:
            table.setdefault(name, {None if table is self.caps else 1.0}).add(value)

    def check(self, view):
        name = view["name"]
        problems = []
        if name in self.caps and view["user_cap"] not in self.caps[name]:
            problems.append(f"{name}: user cap {view['user_cap']} not in {self.caps[name]}")
        if name in self.shares and (view["share"] not in self.shares[name] or not view["share_pinned"]):
            problems.append(f"{name}: share {view['share']} (pinned {view['share_pinned']}) not in {self.shares[name]}")
        return problems


def test_hostile_clients_job_churn_and_coordinator_kills_lose_nothing():
    rng = random.Random(20261123)
    port = _free_port()
    node = Node(extra_args=["--metrics-port", str(port)])
    stop = threading.Event()
    counts = {"sent": 0, "refused": 0}
    hostiles = [threading.Thread(target=_hostile, args=(node.socket, port, stop, seed, counts), daemon=True)
                for seed in range(2)]
    live = {}  # name -> SimulatedJob, every job a coordinator acknowledged and that was not killed
    expect = Expectations()
    rounds = {"coordinator_kills": 0, "jobs_started": 0, "jobs_killed": 0, "commands_acknowledged": 0}
    try:
        node.start_coordinator()
        live["g"] = node.start_job("guaranteed", "g", hold_mib=64)
        for thread in hostiles:
            thread.start()
        deadline = time.monotonic() + SOAK_S
        step = 0
        while time.monotonic() < deadline:
            step += 1
            action = rng.choices(["start", "kill_job", "command", "command_then_kill", "kill_coordinator",
                                  "register_during_kill"], weights=[4, 3, 6, 1, 1, 1])[0]
            if action == "start" and len(live) < 6:
                name = f"o{step}"
                job = node.start_job("opportunistic", name, hold_mib=rng.choice([16, 32, 64]))
                live[name] = job
                rounds["jobs_started"] += 1
            elif action == "kill_job" and len(live) > 1:
                name = rng.choice(sorted(n for n in live if n != "g"))
                live.pop(name).kill()
                expect.caps.pop(name, None)
                expect.shares.pop(name, None)
                rounds["jobs_killed"] += 1
            elif action in ("command", "command_then_kill"):
                name = rng.choice(sorted(live))
                if rng.random() < 0.5:
                    value, table, send = rng.choice([None, 32 * MiB, 48 * MiB, 96 * MiB]), expect.caps, client.set_cap
                else:
                    value, table, send = rng.choice([0.0, 0.25, 0.5, 1.0]), expect.shares, client.set_share
                try:
                    send(name, value, node.socket)
                    acknowledged = True
                    rounds["commands_acknowledged"] += 1
                except (client.CoordinatorError, client.CoordinatorUnavailable, OSError):
                    acknowledged = False
                expect.attempt(table, name, value, acknowledged)
                if action == "command_then_kill":
                    node.kill_coordinator()  # right after the reply: an acknowledged change must survive
                    rounds["coordinator_kills"] += 1
            elif action == "kill_coordinator":
                time.sleep(rng.uniform(0, 0.3))
                node.kill_coordinator()
                rounds["coordinator_kills"] += 1
            elif action == "register_during_kill" and len(live) < 6:
                name = f"r{step}"
                job = node.spawn_job("opportunistic", name, hold_mib=16)
                time.sleep(rng.uniform(0, 0.4))
                node.kill_coordinator()
                rounds["coordinator_kills"] += 1
                node.start_coordinator()
                if job.wait_started().get("registration"):
                    live[name] = job  # acknowledged before the kill: must be adopted
                else:
                    assert job.process.wait(timeout=20) == 0  # ran on its own and finished: no crash
            if node.coordinator.poll() is not None:
                node.start_coordinator()
            crashed = {name: job.process.returncode for name, job in live.items() if not job.alive()}
            assert not crashed, f"step {step} ({action}): jobs died (name: exit status) {crashed}\n{node.read_log()}"
        stop.set()
        for thread in hostiles:
            thread.join(timeout=10)

        # Settled: the coordinator lists exactly the live jobs, with every
        # acknowledged command in force, and /dev/shm holds exactly their blocks.
        assert node.coordinator.poll() is None, node.read_log()
        names = set(live)
        assert wait_until(lambda: {j["name"] for j in node.status()["jobs"]} == names, timeout=15), (
            names, [j["name"] for j in node.status()["jobs"]], node.read_log())
        problems = [p for view in node.status()["jobs"] for p in expect.check(view)]
        assert not problems, problems
        blocks = {job.registration["block_name"].lstrip("/") for job in live.values()}
        assert wait_until(lambda: set(node.blocks()) == blocks, timeout=10), (node.blocks(), blocks)
        assert all(job.alive() for job in live.values())
        # The soak did what it says, not a quiet minute.
        assert counts["sent"] > 100, counts
        assert rounds["coordinator_kills"] >= 3 and rounds["jobs_killed"] >= 3, rounds
        assert rounds["commands_acknowledged"] >= 10, rounds
        print(json.dumps({"soak_s": SOAK_S, **rounds, "hostile_connections": counts["sent"]}))
    finally:
        stop.set()
        node.close()
