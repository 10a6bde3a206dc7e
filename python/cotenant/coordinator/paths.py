"""Where the coordinator's socket and state live."""

from __future__ import annotations

import hashlib
import os

SOCKET_ENV = "COTENANT_SOCKET"


def default_socket_path() -> str:
    """$COTENANT_SOCKET, else $XDG_RUNTIME_DIR/cotenant/coordinator.sock, else
    /run/cotenant/coordinator.sock when /run/cotenant is (or can be made)
    writable, else /tmp/cotenant-<uid>/coordinator.sock."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "cotenant", "coordinator.sock")
    run_dir = "/run/cotenant"
    if os.access(run_dir, os.W_OK) or (not os.path.exists(run_dir) and os.access("/run", os.W_OK)):
        return os.path.join(run_dir, "coordinator.sock")
    return os.path.join("/tmp", f"cotenant-{os.getuid()}", "coordinator.sock")


def node_key(socket_path: str) -> str:
    """A short key that names this coordinator's shared-memory blocks, so two
    coordinators (different sockets) on one machine never adopt each other's jobs."""
    return hashlib.sha1(os.path.abspath(socket_path).encode()).hexdigest()[:10]


def job_block_prefix(socket_path: str) -> str:
    return f"cotenant-{node_key(socket_path)}-job-"


def job_block_name(socket_path: str, job_id: int) -> str:
    return "/" + job_block_prefix(socket_path) + str(job_id)


def state_path(socket_path: str) -> str:
    return socket_path + ".state.json"


def history_path(socket_path: str) -> str:
    return socket_path + ".history.jsonl"
