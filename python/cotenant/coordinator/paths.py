"""Where the coordinator's socket and state live."""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Optional

SOCKET_ENV = "COTENANT_SOCKET"
RUN_DIR_ENV = "COTENANT_RUN_DIR"                   # the node's run directory, default /run/cotenant
COORDINATOR_USER_ENV = "COTENANT_COORDINATOR_USER"  # a service account clients trust besides root
SOCKET_NAME = "coordinator.sock"


def node_socket_path() -> str:
    """The node's coordinator: $COTENANT_RUN_DIR/coordinator.sock, by default
    /run/cotenant/coordinator.sock (only root can make /run/cotenant, so no
    other user can squat it)."""
    from cotenant import settings

    return os.path.join(settings.get("run_dir") or "/run/cotenant", SOCKET_NAME)


def user_socket_path() -> Optional[str]:
    """A user's own coordinator, in the private $XDG_RUNTIME_DIR; None without one."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "cotenant", SOCKET_NAME)
    return None


def default_socket_path() -> str:
    """Where a job or a command looks for the coordinator: $COTENANT_SOCKET;
    else the user's own coordinator ($XDG_RUNTIME_DIR/cotenant/coordinator.sock)
    when one listens there; else the node's (/run/cotenant/coordinator.sock).
    Never a path under /tmp, which another user could have made first."""
    explicit = _explicit_socket()
    if explicit:
        return explicit
    own = user_socket_path()
    if own is not None and _is_socket(own):
        return own
    return node_socket_path()


def default_serving_path() -> Optional[str]:
    """Where `cotenant coordinator` serves without --socket: $COTENANT_SOCKET;
    root: the node's path; another user: their own $XDG_RUNTIME_DIR, else the
    node's path when its directory is theirs (a service account given
    /run/cotenant). None when there is no such place (the caller says to give --socket)."""
    explicit = _explicit_socket()
    if explicit:
        return explicit
    node = node_socket_path()
    if os.geteuid() == 0:
        return node
    own = user_socket_path()
    if own is not None:
        return own
    try:
        if os.stat(os.path.dirname(node)).st_uid == os.geteuid():
            return node
    except OSError:
        pass
    return None


def _explicit_socket() -> Optional[str]:
    """$COTENANT_SOCKET, or COTENANT_CONF's socket: key."""
    from cotenant import settings

    return settings.get("socket")


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def node_key(socket_path: str) -> str:
    """A short key that names this coordinator's shared-memory blocks, so two
    coordinators (different sockets) on one machine never adopt each other's jobs.
    Keyed by the socket's directory as it really is (links resolved): one socket
    reached by two spellings (/var/run is a link to /run) has one state file and
    one lock, so it must name its blocks one way too, or a restart adopts none."""
    path = os.path.abspath(socket_path)
    directory, base = os.path.split(path)
    return hashlib.sha1(os.path.join(os.path.realpath(directory), base).encode()).hexdigest()[:10]


def job_block_prefix(socket_path: str) -> str:
    return f"cotenant-{node_key(socket_path)}-job-"


def job_block_name(socket_path: str, job_id: int, owner_token: int) -> str:
    """A job's block: the job id and the block's random owner token, so no
    other user can create a job's name before the coordinator does."""
    return "/" + job_block_prefix(socket_path) + f"{job_id}-{owner_token:016x}"


# Files next to the socket, in its run directory (rundir.py).
STATE_SUFFIX = ".state.json"
HISTORY_SUFFIX = ".history.jsonl"
LOCK_SUFFIX = ".lock"


def state_path(socket_path: str) -> str:
    return socket_path + STATE_SUFFIX


def history_path(socket_path: str) -> str:
    return socket_path + HISTORY_SUFFIX
