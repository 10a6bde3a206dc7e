"""A process of another uid cannot change anyone's cap or share (SO_PEERCRED checks).

Needs root (to run a client as another uid with setpriv) and an interpreter that
uid may execute; skipped with the reason otherwise.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from coordinator_harness import MiB, Node, readable_code_copy, wait_until

OTHER_UID = 65534  # nobody
OTHER_GID = 65534  # nogroup

# A client with no cotenant import: the other uid may not be able to read the sources.
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


def _other_uid_python():
    if os.geteuid() != 0:
        return None, "needs root to run a client as another uid (setpriv --reuid)"
    if shutil.which("setpriv") is None:
        return None, "setpriv (util-linux) is not installed"
    for candidate in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_GID}", "--clear-groups",
                                candidate, "-c", "pass"], capture_output=True)
        if probe.returncode == 0:
            return candidate, ""
    return None, f"no Python interpreter that uid {OTHER_UID} may execute"


PYTHON, SKIP_REASON = _other_uid_python()
pytestmark = [pytest.mark.multiuser, pytest.mark.skipif(PYTHON is None, reason=SKIP_REASON or "")]


def as_other_uid(socket_path, requests, groups=False):
    command = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_GID}"]
    command += [f"--groups={OTHER_GID}"] if groups else ["--clear-groups"]
    out = subprocess.run(command + [PYTHON, "-c", RAW_CLIENT, socket_path, json.dumps(requests)],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


CHANGES = [
    {"op": "set_cap", "job": "o", "memory_cap": 8 * MiB},
    {"op": "set_share", "job": "o", "share": 0.0},
    {"op": "command", "job": "o", "command": "suspend"},
]


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def test_other_uid_cannot_connect_to_the_0660_socket(node):
    node.start_coordinator()
    assert oct(os.stat(node.socket).st_mode & 0o777) == "0o660"
    result = as_other_uid(node.socket, [{"op": "status"}])
    assert result.get("connect_error") == 13  # EACCES


def test_other_uid_cannot_change_caps_or_shares_even_through_a_world_writable_socket(node):
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=32)
    node.start_job("opportunistic", "o", hold_mib=32)
    before = node.job("o")
    os.chmod(node.socket, 0o666)  # take the file mode out of the way: SO_PEERCRED must still refuse
    replies = as_other_uid(node.socket, CHANGES)["replies"]
    assert [r["error"]["code"] for r in replies] == ["permission_denied"] * 3
    assert all(f"uid {OTHER_UID}" in r["error"]["message"] for r in replies)
    after = node.job("o")
    assert after["user_cap"] is None and not after["share_pinned"] and after["state"] != "suspended"
    assert after["cap"] == before["cap"] or after["cap"] >= 2 * MiB


def _admin_group_name():
    import grp

    try:
        return grp.getgrgid(OTHER_GID).gr_name
    except KeyError:
        pytest.skip(f"gid {OTHER_GID} has no group name to pass as --group")


def test_member_of_the_admin_group_may_change_caps(node):
    node.args += ["--group", _admin_group_name()]
    node.start_coordinator()
    node.start_job("opportunistic", "o", hold_mib=32)
    replies = as_other_uid(node.socket, CHANGES[:2], groups=True)["replies"]
    assert all(r["ok"] for r in replies), replies
    assert wait_until(lambda: node.job("o")["applied_cap"] == 8 * MiB)


def test_job_of_another_uid_gets_its_own_block_and_runs_under_the_coordinator(node):
    node.args += ["--group", _admin_group_name()]
    node.start_coordinator()
    code = readable_code_copy()
    try:
        job = node.start_job("opportunistic", "theirs", hold_mib=48, python=PYTHON, code_dir=code,
                             prefix=["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_GID}",
                                     f"--groups={OTHER_GID}"])
        assert job.registration["name"] == "theirs"
        assert os.stat("/dev/shm" + job.registration["block_name"]).st_uid == OTHER_UID
        assert wait_until(lambda: node.job("theirs")["device_bytes"] == 48 * MiB), node.read_log()
        assert node.job("theirs")["uid"] == OTHER_UID
    finally:
        shutil.rmtree(code)  # a running job has already loaded what it needs
