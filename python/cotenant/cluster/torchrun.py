"""Elastic cluster jobs through torch.distributed's elastic launch (`torchrun`).

With `--launcher torchrun`, each cluster worker of a job is one torchrun agent
(`python -m torch.distributed.run --nnodes=MIN:MAX --nproc-per-node=1`), and
the agent's one child is `cotenant run ... -- the command`: the child, not the
agent, is the job its node's coordinator knows, under the worker's name
(`<job>-w<i>`). The agents of a job meet in one c10d rendezvous whose store
the cotenant node agent of worker 0's node hosts (`host_store`) from the
job's start to its end: every torchrun agent is a client of it, so no agent's
exit or restart takes the store down, and its port is bound once, by the
process that keeps it (no port found free, released, then bound again).

  scale out  the scheduler starts one more agent; it waits in the rendezvous
             until the running agents see it (every `MONITOR_INTERVAL_S`),
             stop their children and form a new round with it: every child
             restarts with the new RANK and WORLD_SIZE.
  scale in   the scheduler stops the leaving agents (SIGTERM: the agent stops
             its child and leaves the rendezvous open for the rest); the
             children that stay fail in their next collective, their agents
             restart them (one of `MAX_RESTARTS` each) in a new round once the
             leavers' heartbeats have expired (`KEEP_ALIVE_S` x
             `KEEP_ALIVE_ATTEMPTS`).

That is torchrun's elastic contract: the script resumes from its own
checkpoint in every round; the job is never failed. A child that restarts
registers again under the same name (the coordinator reclaims the old one
within a tick, long before the new round starts).

`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is what lets an agent join a running
job. By default (torch 2.4 and later) the agents share one TCP store between
the rendezvous and the children, and an agent computes where it is only once,
in its first round: a late agent then waits in `RendezvousStoreInfo.build` for
the store address under its round's key, which the running agents, having
computed theirs in round 0, never write; it times out after `read_timeout`
(60 s) and the running agents with it. Without sharing, every round's rank 0
publishes a fresh address for that round.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Sequence

PLAIN = "plain"
TORCHRUN = "torchrun"
LAUNCHERS = (PLAIN, TORCHRUN)

# Seconds. A joining agent waits until a running agent looks (MONITOR_INTERVAL_S);
# a round closes LAST_CALL_S after its first node is in, or at once with MAX nodes;
# a stopped agent counts as gone KEEP_ALIVE_S x KEEP_ALIVE_ATTEMPTS after its last heartbeat.
MONITOR_INTERVAL_S = 0.5
LAST_CALL_S = 1
KEEP_ALIVE_S = 1
KEEP_ALIVE_ATTEMPTS = 3
# Each scale in costs every staying agent one restart; a scale out costs none.
MAX_RESTARTS = 100

ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_id(job: str, job_id: int) -> str:
    """The rendezvous of one submission of a job: a job resubmitted under its name meets no stale round."""
    return f"{job}-{job_id}"


def agent_command(worker_argv: Sequence[str], *, min_nodes: int, max_nodes: int, endpoint: str, rdzv_id: str,
                  local_addr: str, max_restarts: int = MAX_RESTARTS) -> List[str]:
    """The torchrun agent of one worker; `worker_argv` is the child it starts (`cotenant run ... -- cmd`).
    `endpoint` is a store `host_store` keeps."""
    conf = {
        "is_host": 0,  # said, not guessed (an agent on the store's machine would host one): host_store hosts it
        "last_call_timeout": LAST_CALL_S,
        "keep_alive_interval": KEEP_ALIVE_S,
        "keep_alive_max_attempt": KEEP_ALIVE_ATTEMPTS,
    }
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={min_nodes}:{max_nodes}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        f"--max-restarts={max_restarts}", f"--monitor-interval={MONITOR_INTERVAL_S}",
        f"--local-addr={local_addr}",
        "--no-python", *worker_argv,
    ]


def agent_env() -> Dict[str, str]:
    return dict(ENV)


def host_store(address: str, timeout_s: float = 60.0):
    """A rendezvous store served from this process on `address`, at a port the system picks as it binds
    (nothing can take it in between); the store lives as long as the returned object. `endpoint(store)`
    is what the agents are given."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(address, 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def endpoint(store) -> str:
    """host:port of a store `host_store` made."""
    return f"{store.host}:{store.port}"
