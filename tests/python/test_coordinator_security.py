"""The coordinator against a careless or hostile user of its own uid: planted
links, bad numbers and names, lost acknowledgements, two coordinators at once,
floods of connections, a full /dev/shm, and errors that must be messages.
The rules are docs/coordinator.md's "Security model"; the tests that need
other uids are in test_permissions.py."""

import http.client
import json
import os
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import warnings

import pytest

from cotenant import _core
from cotenant.coordinator import client, paths, protocol
from coordinator_harness import MiB, Node, child_env, connect_raw, read_json, wait_until


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "cotenant.cli", *args], env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


def raw_request(socket_path, **message):
    with connect_raw(socket_path) as sock:
        sock.sendall(json.dumps({"v": 1, "id": 1, **message}).encode() + b"\n")
        return json.loads(sock.makefile("rb").readline())


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the run directory: no link followed, no directory another user could change ---------------


def test_a_link_planted_as_the_state_files_temporary_is_not_followed(node, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, node.socket + ".state.json.tmp")
    node.start_coordinator()
    node.start_job("opportunistic", "o", hold_mib=16)  # a registration writes the state
    assert victim.read_text() == "precious"
    state = os.stat(paths.state_path(node.socket), follow_symlinks=False)
    assert stat.S_ISREG(state.st_mode)


def test_a_link_planted_as_the_history_file_stops_the_coordinator_with_a_message(node, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, paths.history_path(node.socket))
    node.start_coordinator(wait=False)
    assert node.coordinator.wait(timeout=30) != 0
    log = node.read_log()
    assert "is a symbolic link" in log and "Traceback" not in log
    assert victim.read_text() == "precious"
    assert not os.path.exists(node.socket)


def test_a_link_planted_as_the_state_file_is_neither_read_nor_written_through(node, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(json.dumps({"_next_job_id": 1000}))
    os.symlink(victim, paths.state_path(node.socket))
    node.start_coordinator()
    reg = client.register("opportunistic", 0, name="first", socket=node.socket)
    assert reg.job_id == 1  # the planted "_next_job_id" was not read
    assert json.loads(victim.read_text()) == {"_next_job_id": 1000}


def test_a_run_directory_other_users_may_write_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    out = cli("coordinator", "--socket", str(run / "c.sock"), "--gpu-memory", "1GiB", timeout=30)
    assert out.returncode != 0
    assert "writable by other users" in out.stderr and "Traceback" not in out.stderr
    assert os.listdir(run) == []


def test_a_new_run_directory_is_0750_and_given_to_the_group(tmp_path):
    group = _some_group_other_than_ours()
    node = Node(extra_args=["--group", group.gr_name])
    node.socket = str(tmp_path / "run" / "c.sock")
    try:
        node.start_coordinator()
        run = os.stat(tmp_path / "run")
        assert stat.S_IMODE(run.st_mode) == 0o750 and run.st_gid == group.gr_gid
        sock = os.stat(node.socket)
        assert stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_gid == group.gr_gid
    finally:
        node.close()


def _some_group_other_than_ours():
    import grp

    for group in grp.getgrall():
        if group.gr_gid != os.getegid() and (os.geteuid() == 0 or group.gr_gid in os.getgroups()):
            return group
    pytest.skip("this user may give files to no group but its own")


# --- where clients look: no /tmp fallback ------------------------------------------------------


def test_default_socket_path_is_the_environment_then_a_running_own_coordinator_then_the_nodes(
        monkeypatch, tmp_path):
    monkeypatch.setenv("COTENANT_SOCKET", "/somewhere/c.sock")
    assert paths.default_socket_path() == "/somewhere/c.sock"
    monkeypatch.delenv("COTENANT_SOCKET")
    monkeypatch.delenv("COTENANT_RUN_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    # No coordinator of one's own runs: the node's (a root coordinator) is the one to find.
    assert paths.default_socket_path() == "/run/cotenant/coordinator.sock"
    (tmp_path / "cotenant").mkdir()
    own = socket.socket(socket.AF_UNIX)
    own.bind(str(tmp_path / "cotenant" / "coordinator.sock"))
    try:
        assert paths.default_socket_path() == str(tmp_path / "cotenant" / "coordinator.sock")
    finally:
        own.close()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("COTENANT_RUN_DIR", str(tmp_path / "node"))
    assert paths.default_socket_path() == str(tmp_path / "node" / "coordinator.sock")


def test_a_user_coordinator_with_no_private_directory_has_no_default_place(monkeypatch, tmp_path):
    monkeypatch.delenv("COTENANT_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("COTENANT_RUN_DIR", str(tmp_path))  # a directory this user does not own
    uid = os.stat(tmp_path).st_uid + 1
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    assert paths.default_serving_path() is None  # never /tmp/cotenant-<uid>, which another user can make first
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.default_serving_path() == str(tmp_path / "cotenant" / "coordinator.sock")


# --- per-job validation: one job's numbers cannot break the view of everyone ---------------------


def test_a_job_reporting_inf_or_nan_breaks_neither_status_nor_history(node):
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=32)
    bad = node.start_job("opportunistic", "bad", hold_mib=32)
    bad.set_iteration_us("inf")
    time.sleep(1.5)  # it reports inf within a second
    json.dumps(client.status(node.socket), allow_nan=False)  # raises on inf or NaN
    bad.set_iteration_us("nan")
    time.sleep(1.5)
    view = client.status(node.socket)
    json.dumps(view, allow_nan=False)  # raises on inf or NaN
    assert {j["name"] for j in view["jobs"]} == {"g", "bad"}
    json.dumps(client.history(node.socket), allow_nan=False)
    table = cli("status", "--socket", node.socket)
    assert table.returncode == 0 and "bad (" in table.stdout
    with open(paths.history_path(node.socket)) as f:
        for line in f:
            json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the history file"))
    assert node.job("bad")["invalid_reports"] >= 2 and node.job("g")["invalid_reports"] == 0
    warned = [line for line in node.read_log().splitlines() if "job reported invalid numbers" in line]
    assert len(warned) == 1  # once per job, however many reports


_SPINNING_JOB = r"""
import ctypes, json, mmap, os, socket, struct, sys
from cotenant import _core
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(json.dumps({"v": 1, "id": 1, "op": "register", "role": "opportunistic", "device": 0,
                      "name": "spin"}).encode() + b"\n")
name = json.loads(s.makefile("rb").readline())["block"]
block = _core.JobBlock.open(name)
with open("/dev/shm" + name, "r+b") as f:
    words = mmap.mmap(f.fileno(), 0)
# The report's sequence: the one word that, made odd, hides the report.
for offset in range(0, len(words), 8):
    (saved,) = struct.unpack_from("<Q", words, offset)
    struct.pack_into("<Q", words, offset, saved | 1)
    hidden = block.report() is None
    struct.pack_into("<Q", words, offset, saved)
    if hidden and saved % 2 == 0:
        break
word = ctypes.c_uint64.from_buffer(words, offset)  # one 8-byte store per write (struct zeroes first)
word.value = saved | 1
print("spinning", flush=True)
while True:  # odd and moving: a writer that never finishes but never stalls either
    word.value += 2
"""


def test_a_job_that_keeps_its_report_mid_update_and_moving_cannot_wedge_the_coordinator(node):
    # The coordinator and the hostile job share one CPU, so at every try the
    # coordinator's read sees the sequence has moved on: it must still give up
    # after its 2 ms and serve everyone else.
    cpu = min(os.sched_getaffinity(0))
    node.start_coordinator(prefix=("taskset", "-c", str(cpu)))
    node.start_job("guaranteed", "g", hold_mib=32)
    spinner = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", _SPINNING_JOB, node.socket],
                               env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout.readline().strip() == "spinning"
        time.sleep(0.5)  # many ticks
        started = time.monotonic()
        view = client.status(node.socket)  # gives up after 5 s
        assert {j["name"] for j in view["jobs"]} == {"g", "spin"}
        assert time.monotonic() - started < 2
    finally:
        spinner.kill()
        spinner.wait()


def test_a_job_that_shrinks_its_block_cannot_kill_the_coordinator(node):
    # A job may write its block (it owns it under a root coordinator), so it
    # may also ftruncate it; the coordinator's next touch of a lost page
    # raised SIGBUS and took every job's coordinator down.
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=32)
    with connect_raw(node.socket) as sock:
        sock.sendall(json.dumps({"v": 1, "id": 1, "op": "register", "role": "opportunistic", "device": 0,
                                 "name": "shrinker"}).encode() + b"\n")
        block = json.loads(sock.makefile("rb").readline())["block"]
        os.truncate("/dev/shm" + block, 0)
        time.sleep(0.5)  # ten ticks, each reading (and planning) the shrunk block
        assert node.coordinator.poll() is None, "the coordinator died: " + node.read_log()
        assert {j["name"] for j in node.status()["jobs"]} == {"g", "shrinker"}
        client.set_share("shrinker", 0.5, socket=node.socket)  # recorded; the block cannot take it
        with pytest.raises(client.CoordinatorError, match="lost its pages"):
            client.send_command("shrinker", "suspend", socket=node.socket)
        assert client.set_cap("g", "300MiB", socket=node.socket)["user_cap"] == 300 * MiB
        assert wait_until(lambda: node.job("g")["applied_cap"] is not None
                          and node.job("g")["applied_cap"] <= 300 * MiB)
    assert node.coordinator.poll() is None


def test_report_check_keeps_the_last_valid_value_of_each_refused_field():
    from cotenant.coordinator import report

    last = {"iteration_ewma_ns": 900_000, "device_bytes": 4 * MiB}
    new = {"iteration_ewma_ns": -1, "device_bytes": -1, "host_bytes": 2 * MiB,
           "applied_share": 1.5, "effective_share": float("nan")}
    checked, refused = report.check(new, last)
    assert checked == {"iteration_ewma_ns": 900_000, "device_bytes": 4 * MiB, "host_bytes": 2 * MiB}
    assert sorted(refused) == ["applied_share", "device_bytes", "effective_share", "iteration_ewma_ns"]


# --- names in bytes; ids and names never confused ----------------------------------------------


def test_a_name_of_at_most_63_characters_but_more_than_63_bytes_is_refused_at_registration(node):
    node.start_coordinator()
    name = "é" * 32  # 32 characters, 64 bytes
    with pytest.raises(ValueError, match="64 bytes in UTF-8; a name may be at most 63 bytes"):
        client.register("opportunistic", 0, name=name, socket=node.socket)
    reply = raw_request(node.socket, op="register", role="opportunistic", device=0, name=name)
    assert reply["error"]["code"] == protocol.BAD_REQUEST and "63 bytes" in reply["error"]["message"]
    assert node.status()["jobs"] == []
    out = cli("run", "--opportunistic", "--name", name, "--", "true")
    assert out.returncode == 2 and "at most 63 bytes" in out.stderr


def test_a_duplicate_name_is_renamed_within_63_bytes_and_stored_whole(node):
    node.start_coordinator()
    name = "é" * 31  # 62 bytes
    first = client.register("opportunistic", 0, name=name, socket=node.socket)
    second = client.register("opportunistic", 1, name=name, socket=node.socket)
    assert first.name == name and second.name != name
    assert len(second.name.encode()) <= 63 and second.name.endswith(f"-{second.job_id}")
    assert _core.JobBlock.open(second.block_name).identity()["name"] == second.name


def test_a_unique_name_skips_every_name_taken_and_fits_63_bytes():
    # One rule for registered and queued jobs (the queue renamed to name[:50]-ticket, unchecked).
    from cotenant.coordinator.protocol import MAX_NAME_BYTES, unique_name

    assert unique_name("a", set(), 3) == "a"
    assert unique_name("a", {"a"}, 3) == "a-3"
    assert unique_name("a", {"a", "a-3"}, 3) == "a-3.2"
    assert unique_name("a", {"a", "a-3", "a-3.2"}, 3) == "a-3.3"
    long = "é" * 31 + "x"  # 63 bytes
    renamed = unique_name(long, {long, long[:-2] + "-7"}, 7)
    assert renamed not in (long, long[:-2] + "-7") and len(renamed.encode()) <= MAX_NAME_BYTES
    assert renamed.endswith("-7.2")


def test_a_renamed_duplicate_never_takes_the_name_another_job_already_holds(node):
    # Renaming a duplicate "a" to "a-<id>" must not hand out a name someone
    # registered first: a command by that name would reach the other job.
    node.start_coordinator()
    squatter = client.register("opportunistic", 0, name="a-3", socket=node.socket)  # job 1
    first = client.register("opportunistic", 1, name="a", socket=node.socket)        # job 2
    second = client.register("opportunistic", 2, name="a", socket=node.socket)       # job 3
    assert second.job_id == 3
    names = [job["name"] for job in client.status(node.socket)["jobs"]]
    assert len(names) == len(set(names)) == 3, names
    assert second.name not in (squatter.name, first.name) and len(second.name.encode()) <= 63
    client.set_cap(second.name, 64 * MiB, node.socket)
    caps = {job["job_id"]: job["user_cap"] for job in client.status(node.socket)["jobs"]}
    assert caps == {squatter.job_id: None, first.job_id: None, second.job_id: 64 * MiB}


def test_a_name_that_is_a_number_is_refused_so_a_number_always_means_a_job_id(node):
    node.start_coordinator()
    with pytest.raises(ValueError, match="would be taken for a job id"):
        client.register("opportunistic", 0, name="3", socket=node.socket)
    reply = raw_request(node.socket, op="register", role="opportunistic", device=0, name="3")
    assert reply["error"]["code"] == protocol.BAD_REQUEST
    jobs = [client.register("opportunistic", d, name=f"n{d}", socket=node.socket) for d in range(3)]
    assert client.set_cap(str(jobs[2].job_id), 64 * MiB, node.socket)["job"] == "n2"
    with pytest.raises(client.CoordinatorError, match="no job with id 99"):
        client.set_cap("99", 64 * MiB, node.socket)


# --- durable acknowledgement ---------------------------------------------------------------------


def test_an_acknowledged_set_cap_or_set_share_survives_a_kill_right_after_the_reply(node):
    node.start_coordinator()
    job_id = str(node.start_job("opportunistic", "o", hold_mib=16).registration["job_id"])

    def saved():
        with open(paths.state_path(node.socket)) as f:
            return json.load(f)[job_id]

    for trial in range(3):
        client.set_cap("o", (100 + trial) * MiB, node.socket)
        node.kill_coordinator()  # well within one 50 ms tick of the reply
        assert saved()["user_cap"] == (100 + trial) * MiB
        node.start_coordinator()
        client.set_share("o", 0.25 + trial / 10, node.socket)
        node.kill_coordinator()
        assert saved()["pinned_share"] == 0.25 + trial / 10
        node.start_coordinator()


def test_the_state_file_and_its_directory_are_fsynced_before_the_write_returns(tmp_path, monkeypatch):
    from cotenant.coordinator.rundir import RunDirectory

    run = RunDirectory(str(tmp_path / "run" / "c.sock"))
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        info = os.fstat(fd)
        synced.append((info.st_dev, info.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        run.write_durably(paths.STATE_SUFFIX, b'{"a": 1}')
    finally:
        run.close()
    state = os.stat(tmp_path / "run" / ("c.sock" + paths.STATE_SUFFIX))
    directory = os.stat(tmp_path / "run")
    assert synced == [(state.st_dev, state.st_ino), (directory.st_dev, directory.st_ino)]


# --- one coordinator per socket -------------------------------------------------------------------


def test_two_coordinators_started_together_leave_exactly_one_serving(node, tmp_path):
    # nvidia-smi taking a second widens the window between the checks and the bind.
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nsleep 1\necho '0, 1024'\n")
    fake.chmod(0o755)
    env = {**child_env(), "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    command = [sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", node.socket]
    both = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        assert wait_until(lambda: any(p.poll() is not None for p in both), timeout=20), "both still run"
        loser = next(p for p in both if p.poll() is not None)
        winner = next(p for p in both if p is not loser)
        assert loser.returncode != 0 and "already serves" in loser.stderr.read()
        assert winner.poll() is None and wait_until(node.answers, timeout=10)
        assert os.path.exists(node.socket)
    finally:
        for p in both:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_stopping_a_coordinator_leaves_a_socket_it_did_not_create(node):
    node.start_coordinator()
    os.unlink(node.socket)
    other = socket.socket(socket.AF_UNIX)
    other.bind(node.socket)
    other.listen()
    try:
        node.coordinator.send_signal(signal.SIGTERM)
        assert node.coordinator.wait(timeout=10) == 0
        assert os.path.exists(node.socket)
        connect_raw(node.socket).close()  # still the other listener's
    finally:
        other.close()


def test_sighup_stops_the_coordinator_cleanly(node):
    node.start_coordinator()
    job = node.start_job("opportunistic", "o", hold_mib=16)
    node.coordinator.send_signal(signal.SIGHUP)
    assert node.coordinator.wait(timeout=10) == 0
    assert not os.path.exists(node.socket)
    assert '"coordinator stopped"' in node.read_log()
    assert job.alive() and len(node.blocks()) == 1


# --- many clients at once; enable() never silently unmanaged --------------------------------------


def test_300_clients_at_once_all_get_through_when_the_coordinator_resumes(node):
    node.start_coordinator()
    results = [None] * 300

    def ask(i):
        try:
            with client.CoordinatorClient(node.socket, timeout=30) as c:  # room for a loaded machine
                results[i] = c.request("status")["coordinator"]["pid"]
        except Exception as error:  # noqa: BLE001 - recorded for the assertion
            results[i] = repr(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(results))]
    node.coordinator.send_signal(signal.SIGSTOP)  # accepts nothing: every connection waits in the queue
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
    finally:
        node.coordinator.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(timeout=30)
    failures = [r for r in results if r != node.coordinator.pid]
    assert not failures, f"{len(failures)} of {len(results)} failed, e.g. {failures[:3]}"


class _NoGpuExtension:
    """What _join_coordinator needs of cotenant._C, without a GPU."""

    HAS_JOB_CHANNEL = False

    @staticmethod
    def device_total_bytes(device):
        return 1 << 30


def test_enable_says_loudly_when_a_coordinator_socket_is_there_but_cannot_be_joined(node, caplog):
    from cotenant import api

    dead = socket.socket(socket.AF_UNIX)
    dead.bind(node.socket)  # a socket file nobody listens on: a coordinator died
    dead.close()
    with pytest.warns(RuntimeWarning, match="runs WITHOUT the coordinator"):
        api._join_coordinator(_NoGpuExtension(), "opportunistic", 0, "j", node.socket, None)
    # Also logged, on the "cotenant" logger (shown on stderr where logging is not configured).
    assert any(r.name == "cotenant" and r.levelname == "WARNING" and "runs WITHOUT the coordinator" in r.getMessage()
               for r in caplog.records)
    os.unlink(node.socket)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no coordinator was started: quiet, as documented
        api._join_coordinator(_NoGpuExtension(), "opportunistic", 0, "j", node.socket, None)


class _BlockOutOfReach(_NoGpuExtension):
    """A job whose /dev/shm is not the coordinator's (a container that shares
    the socket only): the block the registration names cannot be opened."""

    @staticmethod
    def set_host_headroom(bytes_):
        pass

    @staticmethod
    def start_job_channel(block_name, device):
        raise RuntimeError(f"could not open shared memory '{block_name}': No such file or directory")


def test_enable_runs_on_its_own_and_says_so_when_its_job_block_cannot_be_opened(node, caplog, monkeypatch):
    from cotenant import api

    monkeypatch.setattr(api._state, "job_channel", False)
    monkeypatch.setattr(api._state, "registration", None)
    monkeypatch.setattr(api._state, "coordinator_host_headroom", None)
    node.start_coordinator()
    with pytest.warns(RuntimeWarning, match="runs WITHOUT the coordinator: could not open shared memory"):
        api._join_coordinator(_BlockOutOfReach(), "opportunistic", 0, "j", node.socket, None)
    assert not api._state.job_channel and api._state.registration is None
    assert api._state.coordinator_host_headroom is None  # the coordinator's setting went with it
    assert any(r.name == "cotenant" and "runs WITHOUT the coordinator" in r.getMessage() for r in caplog.records)


# --- resource limits ------------------------------------------------------------------------------


def test_a_silent_connection_is_closed_after_the_idle_timeout(node):
    node.args += ["--idle-timeout", "0.5"]
    node.start_coordinator()
    with connect_raw(node.socket) as silent:
        silent.settimeout(30)
        assert silent.recv(1) == b""  # closed by the coordinator
    assert node.answers()


def test_connections_beyond_the_per_uid_limit_are_refused_as_busy_until_some_close(node):
    node.args += ["--max-connections-per-uid", "8"]
    node.start_coordinator()
    held = [connect_raw(node.socket) for _ in range(8)]
    try:
        for i, sock in enumerate(held):  # each answered: all eight are counted
            sock.sendall(json.dumps({"v": 1, "id": 1, "op": "hello"}).encode() + b"\n")
            assert json.loads(sock.makefile("rb").readline())["ok"]
        with connect_raw(node.socket) as extra:
            reply = json.loads(extra.makefile("rb").readline())
        assert reply["error"]["code"] == protocol.BUSY and "--max-connections-per-uid" in reply["error"]["message"]
    finally:
        held.pop().close()
    try:
        assert client.status(node.socket)["jobs"] == []  # one slot free again: served
    finally:
        for sock in held:
            sock.close()


def test_a_thousand_idle_connections_of_one_user_hold_no_more_than_its_quota(node):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} descriptors; the test needs 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    node.start_coordinator()
    pid = node.coordinator.pid
    flood = []
    try:
        for _ in range(1000):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(5)
            try:
                sock.connect(node.socket)
            except OSError:
                sock.close()
                continue
            flood.append(sock)
        # The coordinator closes what is over the quota (64) at once; it keeps a few descriptors of its own.
        assert wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) < 64 + 40, timeout=10), (
            len(os.listdir(f"/proc/{pid}/fd")))
        assert node.coordinator.poll() is None
        assert len(node.read_log()) < 16 * 1024  # the refusals are logged, but not a line each
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert wait_until(node.answers, timeout=10)


def _listening_addresses(port):
    """The local addresses of TCP sockets listening on `port` (hex, as /proc/net/tcp* shows them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    local, _remote, state = line.split()[1:4]
                    address, hex_port = local.split(":")
                    if state == "0A" and int(hex_port, 16) == port:
                        found.append(address)
        except FileNotFoundError:
            pass
    return found


def test_metrics_listen_on_the_loopback_address_only_by_default(node):
    port = free_port()
    node.args += ["--metrics-port", str(port)]
    node.start_coordinator()
    assert wait_until(lambda: _listening_addresses(port), timeout=10)
    assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1
    assert b"cotenant_jobs" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()


def test_a_silent_metrics_connection_is_closed_after_the_idle_timeout(node):
    port = free_port()
    node.args += ["--metrics-port", str(port), "--idle-timeout", "0.5"]
    node.start_coordinator()
    assert wait_until(lambda: _listening_addresses(port), timeout=10)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
        assert silent.recv(1) == b""


def test_the_metrics_port_serves_at_most_16_connections_at_once(node):
    port = free_port()
    node.args += ["--metrics-port", str(port)]
    node.start_coordinator()
    assert wait_until(lambda: _listening_addresses(port), timeout=10)
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(16)]
    try:
        time.sleep(0.5)  # all sixteen taken by the server's threads
        with socket.create_connection(("127.0.0.1", port), timeout=30) as extra:
            assert extra.recv(1) == b""  # closed at once, not after the 30 s idle timeout
    finally:
        for sock in held:
            sock.close()

    def scrape():  # a slot frees once its server thread sees the close: until then a scrape is turned away
        try:
            return b"cotenant_jobs" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        except (OSError, http.client.HTTPException):
            return False

    assert wait_until(scrape, timeout=10)


# --- errors are messages ----------------------------------------------------------------------------


def test_a_busy_metrics_port_stops_the_coordinator_with_a_message(node):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node.args += ["--metrics-port", str(port)]
        node.start_coordinator(wait=False)
        assert node.coordinator.wait(timeout=30) != 0
    log = node.read_log()
    assert f"cannot serve metrics on 127.0.0.1:{port}" in log and "Traceback" not in log
    assert not os.path.exists(node.socket)


def test_a_bad_metrics_port_is_a_usage_error():
    out = cli("coordinator", "--socket", "/nonexistent/c.sock", "--metrics-port", "70000")
    assert out.returncode == 2 and "from 1 to 65535" in out.stderr


def test_a_hung_coordinator_gives_the_cli_a_message(node):
    node.start_coordinator()
    node.coordinator.send_signal(signal.SIGSTOP)
    try:
        out = cli("status", "--socket", node.socket)
    finally:
        node.coordinator.send_signal(signal.SIGCONT)
    assert out.returncode == 1
    assert "did not answer within 5 s" in out.stderr and "Traceback" not in out.stderr


# --- a full /dev/shm -------------------------------------------------------------------------------


def _small_dev_shm_prefix():
    """Runs a command with its own /dev/shm of 64 KiB, filled up; None where
    no private mount namespace can be made (needs root)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    script = ("mount --make-rprivate / && mount -t tmpfs -o size=64k tmpfs /dev/shm && "
              "{ head -c 1M /dev/zero > /dev/shm/filler 2>/dev/null; exec \"$@\"; }")  # no subshell: the command is the pid
    probe = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", "true"], capture_output=True)
    return ["unshare", "-m", "sh", "-c", script, "sh"] if probe.returncode == 0 else None


def test_a_full_dev_shm_refuses_the_registration_with_a_message_and_the_coordinator_goes_on(node):
    prefix = _small_dev_shm_prefix()
    if prefix is None:
        pytest.skip("needs root and unshare(1) to give the coordinator a small /dev/shm")
    node.start_coordinator(prefix=prefix)
    with pytest.raises(client.CoordinatorError) as refused:
        client.register("opportunistic", 0, name="j", socket=node.socket)
    assert refused.value.code == protocol.RESOURCE_EXHAUSTED
    assert "No space left on device" in str(refused.value) and "/dev/shm is full" in str(refused.value)
    assert node.status()["jobs"] == []  # still serving
    assert node.coordinator.poll() is None


def test_opening_a_gpu_segment_on_a_full_dev_shm_is_an_error_not_a_sigbus():
    prefix = _small_dev_shm_prefix()
    if prefix is None:
        pytest.skip("needs root and unshare(1) to give the job a small, full /dev/shm")
    code = ("from cotenant import _core\n"
            "try:\n"
            "    _core.GpuPeerSegment.open('/cotenant-full-shm-test', 0)\n"
            "except _core.Error as e:\n"
            "    print('ERROR', e)\n")
    ran = subprocess.run([*prefix, sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, f"the job died (status {ran.returncode}): {ran.stderr}"
    assert ran.stdout.startswith("ERROR") and "/dev/shm" in ran.stdout, ran.stdout + ran.stderr


# --- restart: only what the durable state names is adopted ------------------------------------


def _restart(node):
    node.kill_coordinator()
    node.start_coordinator()


def test_a_block_planted_under_the_coordinators_prefix_is_never_adopted_or_read(node):
    node.start_coordinator()
    real = node.start_job("guaranteed", "real", hold_mib=16)
    real_id = real.registration["job_id"]
    prefix = "/" + paths.job_block_prefix(node.socket)
    # A forged guaranteed job of uid 0 that claims the real job's id, and 40
    # blocks stuck mid-update (their report seqlock odd), all of this uid.
    forged = _core.JobBlock.create(prefix + f"{real_id}-{0:016x}", job_id=real_id, job_name="forged",
                                   role="guaranteed", device=0, pid=os.getpid(), uid=0)
    stuck = [_core.JobBlock.create(prefix + f"{900 + i}", job_id=900 + i, job_name=f"stuck{i}",
                                   role="guaranteed", device=0, pid=os.getpid(), uid=0) for i in range(40)]
    for block in stuck:
        block.close()
    forged.close()
    started = time.monotonic()
    _restart(node)
    took = time.monotonic() - started
    jobs = node.status()["jobs"]
    assert [(j["job_id"], j["name"], j["uid"]) for j in jobs] == [(real_id, "real", os.getuid())]
    assert took < 5.0, f"start-up took {took:.1f} s"
    # Leftovers of this uid that the state does not name are removed; the real block stays.
    assert node.blocks() == [real.registration["block_name"].lstrip("/")]
    assert '"leftover job block removed"' in node.read_log()


def test_a_block_named_by_the_state_but_with_another_owner_token_is_not_adopted(node):
    node.start_coordinator()
    job = node.start_job("opportunistic", "o", hold_mib=16)
    name = job.registration["block_name"]
    node.kill_coordinator()
    # Replaced while the coordinator was down: same name, same identity, another token.
    old = _core.JobBlock.open(name)
    identity = old.identity()
    old.unlink()
    _core.JobBlock.create(name, job_id=identity["job_id"], job_name="o", role="guaranteed", device=0,
                          pid=job.pid, uid=identity["uid"], owner_token=12345).close()
    node.start_coordinator()
    assert node.status()["jobs"] == []
    assert "its owner token or job id is not the one this coordinator recorded" in node.read_log()


def test_identity_on_restart_comes_from_the_state_not_from_the_block_a_job_can_write(node):
    node.start_coordinator()
    job = node.start_job("opportunistic", "o", hold_mib=16)
    node.kill_coordinator()
    state_file = node.socket + ".state.json"
    with open(state_file) as f:
        state = json.load(f)
    entry = state[str(job.registration["job_id"])]
    assert entry["owner_token"] and entry["block"] == job.registration["block_name"]
    assert entry["pid_start_ticks"] > 0
    node.start_coordinator()
    view = node.job("o")
    assert view is not None and view["adopted"] and view["role"] == "opportunistic" and view["uid"] == os.getuid()


def test_commands_reach_the_job_after_a_restart_that_found_its_control_section_mid_update(node):
    import mmap

    node.start_coordinator()
    node.start_job("opportunistic", "o", hold_mib=16)
    for command, state in (("suspend", "suspended"), ("resume", "running")):
        client.send_command("o", command, node.socket)
        assert wait_until(lambda: node.job("o")["state"] == state), node.status()
    block = node.job("o")["block"]
    node.kill_coordinator()
    # A coordinator killed inside a write of the control section leaves its
    # sequence odd: the restarted one cannot read the section back. Its own
    # command count then started over below the 2 commands the job had
    # applied, and the job ignored every command until the count caught up.
    with open("/dev/shm" + block, "r+b") as f:
        words = mmap.mmap(f.fileno(), 0)
    for offset in range(0, 512, 8):
        (saved,) = struct.unpack_from("<Q", words, offset)
        if saved % 2 or not saved:
            continue
        struct.pack_into("<Q", words, offset, saved | 1)
        try:
            probe = _core.JobBlock.open(block)
        except _core.Error:  # a header word: not the one
            hidden = False
        else:
            hidden = probe.control()["command_sequence"] != 2
            probe.close()
        if hidden:
            break
        struct.pack_into("<Q", words, offset, saved)
    else:
        pytest.fail("no word of the block hides its control section")
    node.start_coordinator()
    client.send_command("o", "suspend", node.socket)
    assert wait_until(lambda: node.job("o")["state"] == "suspended"), node.status()


def test_block_names_cannot_be_created_in_advance(node):
    prefix = "/" + paths.job_block_prefix(node.socket)
    # What a squatter could guess: every job id in turn.
    squatted = [_core.JobBlock.create(prefix + str(i), job_id=i, job_name="squat", role="guaranteed", device=0,
                                      pid=os.getpid(), uid=0) for i in range(1, 6)]
    try:
        node.start_coordinator()
        jobs = [node.start_job("opportunistic", f"o{i}", hold_mib=8) for i in range(3)]
        names = [j.registration["block_name"] for j in jobs]
        assert all(n.startswith(prefix) and len(n.rsplit("-", 1)[1]) == 16 for n in names)
        assert len(set(names)) == 3
    finally:
        for block in squatted:
            block.unlink()


# --- a live process that stops answering keeps its job and its memory ---------------------------


def test_a_stopped_job_is_kept_with_its_memory_and_comes_back_when_continued(node):
    node.start_coordinator()
    o = node.start_job("opportunistic", "o", hold_mib=96)
    assert wait_until(lambda: node.job("o")["device_bytes"] >= 96 * MiB)
    held = node.job("o")["device_bytes"]
    os.kill(o.pid, signal.SIGSTOP)
    try:
        # Past the 3 s heartbeat limit: the job is paused, not reclaimed.
        assert wait_until(lambda: node.job("o") and node.job("o")["state"] == "paused", timeout=8), node.read_log()
        time.sleep(1.0)
        view = node.job("o")
        assert view is not None and view["device_bytes"] == held
        assert os.path.exists("/dev/shm" + o.registration["block_name"])
        # Its memory stays in the plan: a guaranteed job on a 1 GiB GPU with
        # 128 MiB headroom gets no cap that counts the paused job's memory as free.
        node.start_job("guaranteed", "g", hold_mib=16)
        assert wait_until(lambda: (node.job("g") or {}).get("cap") is not None), node.read_log()
        assert node.job("g")["cap"] + held <= 1024 * MiB - 128 * MiB
    finally:
        os.kill(o.pid, signal.SIGCONT)
    assert wait_until(lambda: node.job("o")["state"] not in ("paused", "unresponsive"), timeout=5), node.read_log()
    assert '"job silent, kept"' in node.read_log() and '"job heard again"' in node.read_log()
    assert '"job reclaimed"' not in node.read_log()


def test_a_job_whose_pid_now_names_another_process_is_reclaimed():
    from cotenant.coordinator import daemon

    me = os.getpid()
    ticks = daemon.process_start_ticks(me)
    assert ticks > 0
    assert daemon.process_alive(me, ticks)
    assert not daemon.process_alive(me, ticks + 1)  # the same pid, started at another time: another process
    assert daemon.process_alive(me)                 # no start time recorded: the pid alone


def test_a_job_that_exits_while_no_coordinator_runs_leaves_no_block(node):
    node.start_coordinator()
    registration = client.register("opportunistic", 0, name="short", socket=node.socket)
    channel = registration.open_channel()
    node.kill_coordinator()  # and none starts again on this path
    assert os.path.exists("/dev/shm" + registration.block_name)
    channel.close()  # the job ends
    assert not os.path.exists("/dev/shm" + registration.block_name)
    assert node.blocks() == []


def test_jobs_beyond_the_per_uid_limit_are_refused_and_the_others_go_on(node):
    node.args += ["--max-jobs-per-uid", "2"]
    node.start_coordinator()
    client.register("opportunistic", 0, name="a", socket=node.socket)
    client.register("opportunistic", 1, name="b", socket=node.socket)
    with pytest.raises(client.CoordinatorError, match=r"uid \d+ already has 2 jobs registered.*--max-jobs-per-uid"):
        client.register("opportunistic", 2, name="c", socket=node.socket)
    reply = raw_request(node.socket, op="register", role="opportunistic", device=3, name="d")
    assert reply["error"]["code"] == protocol.RESOURCE_EXHAUSTED
    assert sorted(job["name"] for job in node.status()["jobs"]) == ["a", "b"]  # nothing lost, nothing half made
    blocks = [name for name in os.listdir("/dev/shm") if name.startswith(paths.job_block_prefix(node.socket))]
    assert len(blocks) == 2, blocks
    client.set_cap("a", 64 * MiB, node.socket)  # the jobs held go on being served
    assert raw_request(node.socket, op="unregister")["ok"]  # this process's two jobs end
    assert client.register("opportunistic", 2, name="c", socket=node.socket).name == "c"


_HOLD_A_TICKET = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.sendall(json.dumps({"v": 1, "id": 1, "op": "submit", "name": sys.argv[2], "gpus": 1}).encode() + b"\\n")
print(sock.makefile("rb").readline().decode().strip(), flush=True)
sys.stdin.read()  # holds the ticket while the test runs
"""


def test_queued_tickets_beyond_the_per_uid_limit_are_refused(node):
    node.args += ["--max-jobs-per-uid", "1"]
    node.start_coordinator()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_TICKET, node.socket, "held"], env=child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline())["ok"]
        reply = raw_request(node.socket, op="submit", name="more", gpus=1)
        assert reply["error"]["code"] == protocol.RESOURCE_EXHAUSTED
        assert "already holds 1 tickets" in reply["error"]["message"] and "--max-jobs-per-uid" in reply["error"]["message"]
        assert [q["name"] for q in node.status()["queue"]] == ["held"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert wait_until(lambda: not node.status()["queue"], timeout=30)  # its process gone: the ticket goes
    assert raw_request(node.socket, op="submit", name="more", gpus=1)["ok"]


def test_gpu_totals_reported_by_jobs_that_ended_are_not_kept_for_good(node):
    # Without a GPU listing, a job's registration tells the coordinator its GPU's
    # size. One user registering and leaving again under ever new GPU UUIDs made
    # every one a lasting entry of the state file, rewritten (and fsynced) at
    # every registration and administrator change: it grew without bound.
    node.args = ["--headroom", "128MiB", "--memory-host-headroom", "0"]  # no --gpu-memory
    node.start_coordinator()
    for round in range(3):
        for device in range(100):
            reply = raw_request(node.socket, op="register", role="opportunistic", device=device,
                                gpu_uuid=f"GPU-{round:04d}{device:04d}-fake", device_total_bytes=1 << 30)
            assert reply["ok"], reply
        assert raw_request(node.socket, op="unregister")["ok"]
    def kept():
        return (read_json(paths.state_path(node.socket)) or {}).get("_gpu_totals", {})

    wait_until(lambda: len(kept()) < 10)  # the state is saved within a tick of the last job's end
    assert len(kept()) < 10, f"{len(kept())} GPU totals kept for GPUs no job runs on"
    # A GPU a job runs on keeps the size its job reported.
    client.register("opportunistic", 0, name="later", socket=node.socket, gpu_uuid="GPU-real",
                    device_total_bytes=2 << 30)
    assert next(g for g in node.status()["gpus"] if g["gpu"] == "GPU-real")["total_bytes"] == 2 << 30
    assert kept().get("GPU-real") == 2 << 30


@pytest.mark.parametrize("uid_offset, start_offset, ends", [(0, 0, True), (1, 0, False), (0, 1, False)])
def test_unregister_ends_only_the_jobs_of_the_asking_process_by_pid_uid_and_start_time(uid_offset, start_offset,
                                                                                      ends):
    # A reused pid names another process (another start time), possibly of another user: its
    # unregister must not end a job whose own process died and was not reaped yet.
    from types import SimpleNamespace

    from cotenant.coordinator.daemon import Coordinator, process_start_ticks

    me, uid = os.getpid(), os.getuid()
    job = SimpleNamespace(name="j", pid=me, uid=uid + uid_offset, pid_start_ticks=process_start_ticks(me) + start_offset)
    reclaimed = []
    stand_in = SimpleNamespace(jobs={1: job}, _reclaim=lambda j, reason: reclaimed.append(j.name))
    request = protocol.Request(id=1, op="unregister")
    if ends:
        assert Coordinator._dispatch(stand_in, request, me, uid, 0)["ok"]
    else:
        with pytest.raises(protocol.ProtocolError, match="has no registered job to unregister"):
            Coordinator._dispatch(stand_in, request, me, uid, 0)
    assert reclaimed == (["j"] if ends else [])


_HOLD_A_JOB = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.sendall(json.dumps({"v": 1, "id": 1, "op": "register", "role": "opportunistic", "device": 0,
                         "gpu_uuid": sys.argv[2], "device_total_bytes": int(sys.argv[3])}).encode() + b"\\n")
print(sock.makefile("rb").readline().decode().strip(), flush=True)
sys.stdin.read()  # holds the job while the test runs
"""


def test_jobs_that_disagree_on_their_gpus_size_leave_the_least_they_said(node):
    # Without a GPU listing the jobs' registrations say how large their GPU is: a later job saying
    # more must not raise it (the coordinator would hand out memory the GPU lacks); one saying less
    # lowers it.
    node.args = ["--headroom", "128MiB", "--memory-host-headroom", "0"]  # no --gpu-memory
    node.start_coordinator()
    uuid = "GPU-00000000-size-test"
    holders = []
    try:
        for size in (32 << 30, 64 << 30, 16 << 30):
            holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_JOB, node.socket, uuid, str(size)],
                                      env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            holders.append(holder)
            assert json.loads(holder.stdout.readline())["ok"]
            expected = min(32 << 30, size)
            assert wait_until(lambda: (read_json(paths.state_path(node.socket)) or {}).get("_gpu_totals", {})
                              .get(uuid) == expected, timeout=10), (size, read_json(paths.state_path(node.socket)))
    finally:
        for holder in holders:
            holder.stdin.close()
            holder.wait(timeout=30)
