"""The coordinator with several real users (docs/coordinator.md, "Security model").

Runs as root: the set-up makes two users, cotenant-t2 and cotenant-t3, both in
the group cotenant-tg (useradd/groupadd, once per machine; they stay, since
concurrent test runs share them), and runs their processes with setpriv.
`nobody` stands for a user outside the group. Skipped with the reason where
the tests do not run as root or the tools are missing.
"""

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys

import pytest

from cotenant import _core
from cotenant.coordinator import client, paths
from coordinator_harness import MiB, Node, readable_code_copy, wait_until

NOBODY_UID = 65534
USERS = ("cotenant-t2", "cotenant-t3")
GROUP = "cotenant-tg"

pytestmark = pytest.mark.multiuser

# A client with no cotenant import, for users who cannot read the sources.
RAW_CLIENT = r"""
import json, socket, sys
path, requests = sys.argv[1], json.loads(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
except OSError as e:
    print(json.dumps({"connect_error": e.errno})); sys.exit(0)
f = s.makefile("rb")
replies = []
for i, r in enumerate(requests, 1):
    s.sendall((json.dumps(dict(r, v=1, id=i)) + "\n").encode())
    replies.append(json.loads(f.readline()))
print(json.dumps({"replies": replies}))
"""


def _python_for(uid, gid):
    for candidate in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                                candidate, "-c", "import sys; assert sys.version_info[:2] == %r" %
                                (sys.version_info[:2],)], capture_output=True)
        if probe.returncode == 0:
            return candidate
    return None


def _ensure_users():
    """Makes the test users and group where they are missing; returns the reason when it cannot."""
    if os.geteuid() != 0:
        return "needs root to create users and run processes as them (useradd, setpriv)"
    for tool in ("setpriv", "useradd", "groupadd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    subprocess.run(["groupadd", "-f", GROUP], capture_output=True)
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                                   "--user-group", "--groups", GROUP, name], capture_output=True, text=True)
            if made.returncode != 0:
                try:
                    pwd.getpwnam(name)  # made meanwhile by a concurrent run
                except KeyError:
                    return f"useradd {name} failed: {made.stderr.strip()}"
    return ""


class User:
    def __init__(self, name):
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid

    def prefix(self):
        """Runs a command as this user, with its groups (cotenant-tg among them)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]


class Users:
    def __init__(self, python):
        self.t2, self.t3 = User(USERS[0]), User(USERS[1])
        self.group = grp.getgrnam(GROUP)
        self.python = python
        self.code = readable_code_copy()

    def run(self, user, argv, env=None, timeout=60):
        return subprocess.run(user.prefix() + [self.python, *argv], capture_output=True, text=True,
                              timeout=timeout, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": self.code, **(env or {})})

    def raw(self, user, socket_path, requests):
        out = self.run(user, ["-c", RAW_CLIENT, socket_path, json.dumps(requests)])
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def cli(self, user, *args, env=None, timeout=60):
        return self.run(user, ["-m", "cotenant.cli", *args], env=env, timeout=timeout)


@pytest.fixture(scope="module")
def users():
    reason = _ensure_users()
    if reason:
        pytest.skip(reason)
    t2 = User(USERS[0])
    python = _python_for(t2.uid, t2.gid)
    if python is None:
        pytest.skip(f"no Python {sys.version_info[0]}.{sys.version_info[1]} that {USERS[0]} may execute")
    made = Users(python)
    yield made
    shutil.rmtree(made.code)


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


CHANGES = [
    {"op": "set_cap", "job": "mine", "memory_cap": 8 * MiB},
    {"op": "set_share", "job": "mine", "share": 0.0},
    {"op": "command", "job": "mine", "command": "suspend"},
]


def start_job_as(users, node, user, name, **kw):
    return node.start_job("opportunistic", name, hold_mib=32, python=users.python, code_dir=users.code,
                          prefix=user.prefix(), **kw)


# --- who may reach the socket ---------------------------------------------------------------------


def test_a_user_outside_the_group_cannot_connect_to_the_0660_socket(users, node):
    node.args += ["--group", GROUP]
    node.start_coordinator()
    assert oct(os.stat(node.socket).st_mode & 0o777) == "0o660"
    nobody = User(pwd.getpwuid(NOBODY_UID).pw_name)
    assert users.raw(nobody, node.socket, [{"op": "status"}]).get("connect_error") == 13  # EACCES


def test_a_group_member_finds_a_root_coordinator_on_the_default_path(users, node):
    run_dir = os.path.join(node.directory, "run")
    node.socket = os.path.join(run_dir, "coordinator.sock")
    node.args += ["--group", GROUP]
    env = {"COTENANT_RUN_DIR": run_dir}
    node.start_coordinator(env=env)
    info = os.stat(run_dir)
    assert oct(info.st_mode & 0o777) == "0o750" and info.st_gid == users.group.gr_gid
    # t2 has a private runtime directory of its own, as a login session gives it.
    runtime = os.path.join(node.directory, "t2-runtime")
    os.mkdir(runtime, 0o700)
    os.chown(runtime, users.t2.uid, users.t2.gid)
    job = start_job_as(users, node, users.t2, "found", socket=None, env={**env, "XDG_RUNTIME_DIR": runtime})
    assert job.registration["socket_path"] == node.socket
    assert node.job("found")["uid"] == users.t2.uid


def test_a_job_of_another_user_gets_its_own_block_and_runs_under_the_coordinator(users, node):
    node.args += ["--group", GROUP]
    node.start_coordinator()
    job = start_job_as(users, node, users.t2, "theirs")
    assert os.stat("/dev/shm" + job.registration["block_name"]).st_uid == users.t2.uid
    assert wait_until(lambda: node.job("theirs")["device_bytes"] == 32 * MiB), node.read_log()
    assert node.job("theirs")["uid"] == users.t2.uid


# --- who may change which job ------------------------------------------------------------------


def test_only_the_jobs_owner_or_root_may_change_it_and_every_member_may_read_it(users, node):
    node.args += ["--group", GROUP]
    node.start_coordinator()
    start_job_as(users, node, users.t2, "mine")
    node.start_job("opportunistic", "roots", hold_mib=32)
    before = node.job("mine")

    other = users.raw(users.t3, node.socket, [{"op": "status"}] + CHANGES)["replies"]
    assert {j["name"] for j in other[0]["jobs"]} == {"mine", "roots"}  # reading is for every member
    assert [r["error"]["code"] for r in other[1:]] == ["permission_denied"] * 3
    assert all(f"uid {users.t3.uid} may not change job 'mine'" in r["error"]["message"] and
               f"belongs to uid {users.t2.uid}" in r["error"]["message"] for r in other[1:])
    after = node.job("mine")
    assert after["user_cap"] is None and not after["share_pinned"] and after["state"] != "suspended"
    assert after["cap"] == before["cap"] or after["cap"] >= 2 * MiB

    cli = users.cli(users.t3, "suspend", "mine", "--socket", node.socket)
    assert cli.returncode == 1 and "may not change job 'mine'" in cli.stderr and "Traceback" not in cli.stderr

    owner = users.raw(users.t2, node.socket, [CHANGES[0], {"op": "set_cap", "job": "roots", "memory_cap": 8 * MiB}])
    assert owner["replies"][0]["ok"]  # the owner, from another process than the job's
    assert owner["replies"][1]["error"]["code"] == "permission_denied"
    assert client.set_share("mine", 0.5, node.socket)["pinned"]  # root may
    assert wait_until(lambda: node.job("mine")["applied_cap"] == 8 * MiB)


def test_a_user_outside_the_group_cannot_change_jobs_even_through_a_world_writable_socket(users, node):
    node.start_coordinator()
    os.chmod(node.socket, 0o666)  # take the file mode out of the way: SO_PEERCRED must still refuse
    start_job_as(users, node, users.t2, "mine")
    replies = users.raw(users.t3, node.socket, CHANGES)["replies"]
    assert [r["error"]["code"] for r in replies] == ["permission_denied"] * 3


# --- the client checks who serves the socket ---------------------------------------------------------

FAKE_COORDINATOR = r"""
import json, os, socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX); s.bind(path); os.chmod(path, 0o666); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    f = c.makefile("rb")
    line = f.readline()
    if line:
        request = json.loads(line)
        c.sendall((json.dumps({"v": 1, "id": request["id"], "ok": True, "coordinator": {"pid": 1},
                               "gpus": [], "jobs": [], "job_id": 1, "name": "x", "block": "/x",
                               "memory_cap": None, "share": 1.0, "admitted": True}) + "\n").encode())
    c.close()
"""


@pytest.fixture
def fake_coordinator(users, node):
    """A coordinator impostor run by cotenant-t3 in a directory of its own; yields its socket."""
    directory = os.path.join(node.directory, "t3")
    os.mkdir(directory, 0o755)
    os.chown(directory, users.t3.uid, users.t3.gid)
    path = os.path.join(directory, "c.sock")
    fake = subprocess.Popen(users.t3.prefix() + [users.python, "-c", FAKE_COORDINATOR, path],
                            stdout=subprocess.PIPE, text=True)
    assert fake.stdout.readline().strip() == "ready"
    yield path
    fake.send_signal(signal.SIGKILL)
    fake.wait()


def test_the_client_refuses_a_coordinator_served_by_another_user(users, fake_coordinator, monkeypatch):
    monkeypatch.delenv("COTENANT_COORDINATOR_USER", raising=False)
    with pytest.raises(client.UntrustedCoordinator, match=f"served by uid {users.t3.uid} \\(cotenant-t3\\)"):
        client.status(fake_coordinator)
    with pytest.raises(client.UntrustedCoordinator):
        client.register("opportunistic", 0, name="victim", socket=fake_coordinator)
    as_t2 = users.cli(users.t2, "status", "--socket", fake_coordinator)
    assert as_t2.returncode == 1 and "impersonating" in as_t2.stderr and "Traceback" not in as_t2.stderr
    # A node that runs its coordinator as a service account names it:
    monkeypatch.setenv("COTENANT_COORDINATOR_USER", "cotenant-t3")
    assert client.status(fake_coordinator)["jobs"] == []


# --- the run directory ----------------------------------------------------------------------------


def test_a_coordinator_refuses_a_run_directory_another_user_made_and_follows_none_of_its_links(users, node):
    # t3 makes the directory a service account (t2) would use, and plants a link to t2's file.
    shared = os.path.join(node.directory, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    os.chown(shared, users.t3.uid, users.t3.gid)
    home = os.path.join(node.directory, "t2-home")
    os.mkdir(home, 0o755)
    os.chown(home, users.t2.uid, users.t2.gid)
    victim = os.path.join(home, ".bashrc")
    with open(victim, "w") as f:
        f.write("# t2's shell start-up\n")
    os.chown(victim, users.t2.uid, users.t2.gid)
    for suffix in (".state.json", ".state.json.tmp", ".history.jsonl"):
        os.symlink(victim, os.path.join(shared, "c.sock" + suffix))
        os.lchown(os.path.join(shared, "c.sock" + suffix), users.t2.uid, users.t2.gid)
    out = users.cli(users.t2, "coordinator", "--socket", os.path.join(shared, "c.sock"), "--gpu-memory", "1GiB",
                    timeout=30)
    assert out.returncode != 0
    assert f"belongs to uid {users.t3.uid} (cotenant-t3)" in out.stderr and "Traceback" not in out.stderr
    with open(victim) as f:
        assert f.read() == "# t2's shell start-up\n"
    assert not os.path.exists(os.path.join(shared, "c.sock"))


def test_a_user_coordinator_with_no_private_directory_asks_for_a_socket_instead_of_using_tmp(users):
    fallback = f"/tmp/cotenant-{users.t2.uid}"
    shutil.rmtree(fallback, ignore_errors=True)
    try:
        out = users.cli(users.t2, "coordinator", "--gpu-memory", "1GiB", timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("the coordinator started on a default path under /tmp")
    finally:
        exists = os.path.exists(fallback)
        shutil.rmtree(fallback, ignore_errors=True)
    assert out.returncode == 2 and "give --socket" in out.stderr
    assert not exists


# --- resource limits hold per user ------------------------------------------------------------------

HOLD_CONNECTIONS = r"""
import socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
held, deadline = [], time.monotonic() + 20
while len(held) < n and time.monotonic() < deadline:
    s = socket.socket(socket.AF_UNIX); s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:  # the listen queue is full: retry
        s.close(); time.sleep(0.001); continue
    held.append(s)
print(len(held), flush=True)
time.sleep(600)
"""


def test_another_users_idle_connections_do_not_lock_anyone_else_out(users, node):
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    node.args += ["--group", GROUP]
    node.start_coordinator(prefix=["prlimit", "--nofile=1024:1024"])  # the daemon's descriptors are few
    hog = subprocess.Popen(["prlimit", "--nofile=4096:4096"] + users.t3.prefix() +
                           [users.python, "-c", HOLD_CONNECTIONS, node.socket, "1100"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert int(hog.stdout.readline()) == 1100
        view = client.status(node.socket)  # root is served while t3 holds its connections
        assert view["coordinator"]["pid"] == node.coordinator.pid
        assert users.raw(users.t2, node.socket, [{"op": "hello"}])["replies"][0]["ok"]
        assert node.coordinator.poll() is None
    finally:
        hog.send_signal(signal.SIGKILL)
        hog.wait()


# --- what another user plants is neither adopted nor used --------------------------------------


PLANT_BLOCK = r"""
import sys
from cotenant import _core
prefix, pid = sys.argv[1], int(sys.argv[2])
for i in range(1, 41):  # a forged guaranteed job of uid 0 for each job id a restart could look for
    _core.JobBlock.create(prefix + str(i), job_id=i, job_name="forged", role="guaranteed", device=0, pid=pid,
                          uid=0).close()
print("planted")
"""


def test_blocks_another_user_plants_are_neither_adopted_nor_removed_on_restart(users, node):
    node.args += ["--group", GROUP]
    node.start_coordinator()
    real = node.start_job("guaranteed", "real", hold_mib=16)
    prefix = "/" + paths.job_block_prefix(node.socket)
    planted = users.run(users.t2, ["-c", PLANT_BLOCK, prefix, str(real.pid)])
    assert planted.stdout.strip() == "planted", planted.stderr
    try:
        node.kill_coordinator()
        node.start_coordinator()
        jobs = node.status()["jobs"]
        assert [(j["name"], j["job_id"], j["uid"]) for j in jobs] == [("real", real.registration["job_id"], 0)]
        assert '"blocks of other users ignored"' in node.read_log()
        assert all(os.stat("/dev/shm" + prefix + str(i)).st_uid == users.t2.uid for i in range(1, 41))
    finally:
        for i in range(1, 41):
            _core.shm_unlink(prefix + str(i))


OPEN_SEGMENT = r"""
import sys
from cotenant import _core
try:
    _core.GpuPeerSegment.open(sys.argv[1], 0)
    print("opened")
except _core.Error as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("mode", [0o644, 0o666])
def test_a_gpu_segment_another_user_created_first_is_refused_with_its_owner_named(users, mode):
    name = _core.GpuPeerSegment.default_name(0, users.t3.uid)
    _core.GpuPeerSegment.remove(name)
    squat = users.run(users.t2, ["-c", f"import os; fd = os.open('/dev/shm{name}', os.O_CREAT | os.O_RDWR, {mode:#o}); "
                                       f"os.fchmod(fd, {mode:#o})"])
    assert squat.returncode == 0, squat.stderr
    try:
        victim = users.run(users.t3, ["-c", OPEN_SEGMENT, name])
        assert victim.stdout.startswith("refused:"), victim.stdout + victim.stderr
        assert f"belongs to {users.t2.name}, not to {users.t3.name}" in victim.stdout or (
            mode == 0o644 and "Permission denied" in victim.stdout)
        assert "COTENANT_GPU_SEGMENT" in victim.stdout
        assert os.path.getsize("/dev/shm" + name) == 0  # nothing written into the squatter's object
    finally:
        _core.GpuPeerSegment.remove(name)


GROUP_SEGMENT = r"""
import json, os, sys, time
from cotenant import _core
name, gid, role = sys.argv[1], int(sys.argv[2]), sys.argv[3]
segment = _core.GpuPeerSegment.open(name, 0, gpu_uuid="GPU-0000aaaa-1111-2222-3333-444455556666", group=gid)
if role == "guaranteed":
    segment.claim_guaranteed()
    print("claimed", flush=True)
    time.sleep(30)
else:
    print(json.dumps({"opening": segment.opening, "guaranteed_pid": segment.view()["guaranteed"]["pid"]}))
"""


def test_jobs_of_two_users_in_one_group_meet_in_the_gpus_group_segment(users):
    gid = users.group.gr_gid
    name = _core.GpuPeerSegment.default_name(0, gpu_uuid="GPU-0000aaaa-1111-2222-3333-444455556666", group=gid)
    assert name.endswith(f"-g{gid}")
    _core.GpuPeerSegment.remove(name)
    holder = subprocess.Popen(users.t2.prefix() + [users.python, "-c", GROUP_SEGMENT, name, str(gid), "guaranteed"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": users.code})
    try:
        assert holder.stdout.readline().strip() == "claimed", holder.stderr.read()
        info = os.stat("/dev/shm" + name)
        assert (info.st_uid, info.st_gid, oct(info.st_mode & 0o777)) == (users.t2.uid, gid, "0o660")
        seen = users.run(users.t3, ["-c", GROUP_SEGMENT, name, str(gid), "opportunistic"])
        assert seen.returncode == 0, seen.stderr
        view = json.loads(seen.stdout)
        assert view == {"opening": "attached", "guaranteed_pid": holder.pid}, view
    finally:
        holder.kill()
        holder.wait()
        _core.GpuPeerSegment.remove(name)
