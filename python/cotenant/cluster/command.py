"""`cotenant cluster up|submit|status|logs|cancel|down`: the global scheduler on a Ray cluster."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

from cotenant.cluster.torchrun import LAUNCHERS, PLAIN

EXIT_USAGE = 2


class ClusterCommandError(RuntimeError):
    """A cluster command that cannot go on; the message says why and what to do."""


def _worker_range(text: str) -> Tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--gpus takes a count like 4 or a range like 2-8 (at least 1); not {text!r}")
    return low, high


def _quota(text: str) -> Tuple[str, int]:
    tenant, _, gpus = text.partition("=")
    if not tenant or not gpus.isdigit():
        raise argparse.ArgumentTypeError(f"--quota takes TENANT=GPUS, like research=16; not {text!r}")
    return tenant, int(gpus)


def _speed(text: str) -> Tuple[str, float]:
    gpu_type, _, value = text.partition("=")
    try:
        speed = float(value)
    except ValueError:
        speed = 0.0
    if not gpu_type or not speed > 0:
        raise argparse.ArgumentTypeError(f"--speed takes GPU_TYPE=THROUGHPUT with a positive number, like "
                                         f"A100=3.1; not {text!r}")
    return gpu_type, speed


def _seconds(option: str):
    """An argparse type: a number of seconds above 0 for `option`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{option} takes a number of seconds above 0, like 30; not {text!r}")
        return value
    return parse


def add_cluster_command(subparsers) -> None:
    p = subparsers.add_parser("cluster", help="schedule jobs across nodes: AntMan's global scheduler on Ray",
                              description="The global scheduler and a node agent per node, on Ray; see "
                                          "docs/cluster.md.")
    sub = p.add_subparsers(dest="cluster_command", required=True)

    def with_address(q: argparse.ArgumentParser) -> argparse.ArgumentParser:
        q.add_argument("--address", help="the Ray cluster (default: $RAY_ADDRESS, else the one this machine runs)")
        return q

    def with_job(q: argparse.ArgumentParser) -> argparse.ArgumentParser:
        q.add_argument("job", help="the job's name or id, as `cotenant cluster status` shows it")
        return with_address(q)

    q = with_address(sub.add_parser("up", help="start Ray (or attach to a running Ray) and the global scheduler",
                                        description="Start Ray (or attach to a running Ray) and the global scheduler."))
    q.add_argument("--policy", default="antman", help="the scheduling policy: antman (default), fifo, las, timeslice")
    q.add_argument("--quota", type=_quota, action="append", default=[], metavar="TENANT=GPUS",
                   help="GPUs a tenant may hold as guaranteed; beyond it its jobs run opportunistic (repeat)")
    q.add_argument("--socket", help="the cotenant coordinator's socket on every node (default: the node's "
                                    "default, /run/cotenant/coordinator.sock)")
    q.add_argument("--gang-timeout", type=_seconds("--gang-timeout"), default=10.0, metavar="SECONDS",
                   help="how long Ray may take to reserve all of a guaranteed job's GPUs at once before the job "
                        "goes back to waiting (default 10; more on clusters whose nodes are slow to answer)")
    q.add_argument("--agent-timeout", type=_seconds("--agent-timeout"), default=2.0, metavar="SECONDS",
                   help="how long the scheduler waits for a node agent's answer before it counts the node as not "
                        "answering (default 2)")
    q.set_defaults(func=cmd_up)

    q = with_address(sub.add_parser("submit", help="submit a job to the cluster",
                                        description="Submit a job to the cluster."))
    role = q.add_mutually_exclusive_group(required=True)
    role.add_argument("--guaranteed", action="store_true", help="within the tenant's quota: gang-placed, never evicted")
    role.add_argument("--opportunistic", action="store_true", help="runs on spare capacity; may be evicted")
    q.add_argument("--tenant", default="default", help="whose quota it counts against (default: default)")
    q.add_argument("--gpus", type=_worker_range, default=(1, 1), metavar="N|MIN-MAX",
                   help="GPUs (one worker each), or a range for an elastic job (default 1)")
    q.add_argument("--gpu-type", help="run only on this GPU type")
    q.add_argument("--speed", type=_speed, action="append", default=[], metavar="TYPE=THROUGHPUT",
                   help="the job's throughput on a GPU type, measured or declared, for placement across types "
                        "(repeat)")
    q.add_argument("--persistent", help="memory each worker holds for life, e.g. 10GiB")
    q.add_argument("--peak", help="each worker's peak memory, e.g. 30GiB")
    q.add_argument("--name", help="the job's name (default: the program's name and a number)")
    q.add_argument("--launcher", choices=LAUNCHERS, default=PLAIN,
                   help="plain (default): each worker runs the command, told its RANK and WORLD_SIZE at start; "
                        "torchrun: each worker is a torchrun agent of one elastic rendezvous, and a resize "
                        "restarts the command on every worker with the new world (it resumes from its checkpoint)")
    q.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    q.set_defaults(func=cmd_submit)

    q = with_address(sub.add_parser("status", help="nodes, GPUs and jobs as the global scheduler sees them",
                                        description="Nodes, GPUs and jobs as the global scheduler sees them."))
    q.add_argument("--json", action="store_true", help="print the scheduler's view as JSON")
    q.set_defaults(func=cmd_status)

    q = with_job(sub.add_parser("logs", help="the end of each worker's output (stdout and stderr)",
                                        description="The end of the output (stdout and stderr) of each worker "
                                                    "of a job, running or ended, from the live nodes it ran on."))
    q.add_argument("--tail", default="16KiB", help="how much of each worker's log to show (default 16KiB)")
    q.set_defaults(func=cmd_logs)

    q = with_job(sub.add_parser("cancel", help="cancel a job: its workers stop, its GPUs are free",
                                        description="Cancel a job: its workers stop (running or suspended), "
                                                    "its GPUs are free."))
    q.set_defaults(func=cmd_cancel)

    q = with_address(sub.add_parser("down", help="cancel every job, stop the scheduler and the node agents",
                                        description="Cancel every job (its workers stop), stop the node agents "
                                                    "and the global scheduler, and forget the scheduler's saved "
                                                    "state. Ray and the nodes' coordinators go on running."))
    q.set_defaults(func=cmd_down)


def _connect(address: Optional[str]):
    from cotenant.cluster import runtime

    runtime.ray_module()  # says which extra to install when Ray is missing
    address = address or os.environ.get("RAY_ADDRESS") or None
    problem = f"no Ray cluster answers at {address or 'this machine'}; start one with `cotenant cluster up` (or " \
              "`ray start --head`), or give --address"
    if address and address != "auto" and not _answers(address):
        raise ClusterCommandError(problem)  # Ray itself would retry for minutes
    try:
        return runtime.connect(address)
    except ConnectionError:
        raise ClusterCommandError(problem) from None


def _answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something listens at a Ray address (host:port)."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterCommandError(f"--address takes HOST:PORT, like 10.0.0.1:6379; not {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _scheduler(address: Optional[str]):
    from cotenant.cluster import runtime

    ray = _connect(address)
    try:
        return ray, runtime.scheduler_handle(ray)
    except LookupError as error:
        raise ClusterCommandError(str(error)) from None


def _call(ray, ref):
    """The scheduler's answer; its refusals (ValueError) and its death as errors that say what to do."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, ValueError):
            raise ValueError(str(cause)) from None
        raise
    except ray.exceptions.RayActorError:
        raise ClusterCommandError("the global scheduler died while answering; Ray starts it again and it takes its "
                                  "jobs back: run the command again in a few seconds") from None


def cmd_up(args: argparse.Namespace) -> int:
    from cotenant.cluster import runtime
    from cotenant.scheduling.policies import POLICIES

    if args.policy not in POLICIES:
        raise ClusterCommandError(f"unknown policy {args.policy!r}; choose one of {', '.join(POLICIES)}")
    ray_module = runtime.ray_module()
    if not args.address and not os.environ.get("RAY_ADDRESS") and not _ray_running(ray_module):
        _start_ray_head()
    ray = _connect(args.address)
    try:
        runtime.scheduler_handle(ray)
        already = True
    except LookupError:
        already = False
    if already:
        print("a cotenant scheduler runs on this Ray cluster already: it keeps its policy and timeouts (quotas "
              "given here apply); `cotenant cluster down` first to start one with others", file=sys.stderr)
    scheduler = runtime.start_scheduler(ray, policy=args.policy, quotas=dict(args.quota) or None, socket=args.socket,
                                        gang_timeout_s=args.gang_timeout, agent_timeout_s=args.agent_timeout)
    for tenant, gpus in args.quota:
        ray.get(scheduler.set_quota.remote(tenant, gpus))
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sum(int(n["Resources"].get("GPU", 0)) for n in nodes)
    print(f"cotenant scheduler ({args.policy}) on a Ray cluster of {len(nodes)} node(s), {gpus} GPU(s); "
          "`cotenant cluster status` shows the nodes once their agents report")
    return 0


def _ray_running(ray) -> bool:
    try:
        from ray._private.services import find_gcs_addresses  # a local cluster's address file, if any

        return bool(find_gcs_addresses())
    except Exception:
        return False


def _start_ray_head() -> None:
    ray_cli = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.exists(ray_cli):
        raise ClusterCommandError("no `ray` command next to this Python; pip install 'cotenant[cluster]'")
    done = subprocess.run([ray_cli, "start", "--head", "--disable-usage-stats"], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterCommandError(f"`ray start --head` failed: {done.stderr.strip().splitlines()[-1:]}")


def cmd_submit(args: argparse.Namespace) -> int:
    from cotenant.cli import command_after_dashes
    from cotenant.cluster.scheduler import JobSpec

    command = command_after_dashes(args, "cluster submit")
    if command is None:
        return EXIT_USAGE
    sizes = {}
    for option in ("persistent", "peak"):
        text = getattr(args, option)
        if text:
            from cotenant._core import parse_size

            sizes[option] = parse_size(text)
    name = args.name or f"{os.path.basename(command[0])}-{os.getpid()}"
    from cotenant.coordinator.protocol import job_name_problem

    problem = job_name_problem(name) or job_name_problem(name + "-w000")
    if problem:
        raise ValueError(f"--name: {problem}")
    spec = JobSpec(name=name, command=tuple(command), tenant=args.tenant, min_gpus=args.gpus[0],
                   max_gpus=args.gpus[1], gpu_type=args.gpu_type,
                   role="guaranteed" if args.guaranteed else "opportunistic", speeds=dict(args.speed),
                   persistent_bytes=sizes.get("persistent", 0), peak_bytes=sizes.get("peak", 0),
                   env={"PWD": os.getcwd()}, launcher=args.launcher)
    ray, scheduler = _scheduler(args.address)
    submitted = _call(ray, scheduler.submit.remote([spec]))[0]
    print(f"{submitted['name']}: submitted as job {submitted['job_id']}")
    if submitted.get("note"):
        print(f"note: {submitted['note']}", file=sys.stderr)
    return 0


NODE_COLUMNS = ("NODE", "LIVE", "GPU", "UUID", "TYPE", "MEMORY", "FREE", "UTIL")
JOB_COLUMNS = ("JOB", "TENANT", "STATE", "ROLE", "WORKERS", "RANGE", "GPUS", "EVICTIONS")


def format_status(view: Dict[str, Any]) -> str:
    from cotenant.cli import _format_size

    nodes: List[List[str]] = [list(NODE_COLUMNS)]
    for node in view["nodes"]:
        for g in node["gpus"]:
            util = "-" if g["utilization"] is None else f"{g['utilization']:.0%}"
            nodes.append([node["node"][:12], "yes" if node["live"] else "LOST", str(g["index"]), g["uuid"],
                          g["gpu_type"], _format_size(g["memory_bytes"]), _format_size(g["free_bytes"]), util])
    jobs: List[List[str]] = [list(JOB_COLUMNS)]
    for j in view["jobs"]:
        gpus = ",".join(f"{node[:8]}:{index}" for node, index in j["gpus"]) or "-"
        jobs.append([j["name"], j["tenant"], j["state"], j["role"], str(j["workers"]), "-".join(map(str, j["range"])),
                     gpus, str(j["evictions"])])
    lines = [f"policy: {view['policy']}; quotas: " + (", ".join(f"{t}={n}" for t, n in sorted(view["quotas"].items()))
                                                      if view.get("quotas") else "none")]
    for table in (nodes, jobs):
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines.append("")
        lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in table]
    if len(nodes) == 1:
        lines.append("(no node agent has reported yet)")
    if len(jobs) == 1:
        lines.append("(no jobs)")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    ray, scheduler = _scheduler(args.address)
    view = _call(ray, scheduler.status.remote())
    print(json.dumps(view, indent=2) if args.json else format_status(view))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from cotenant._core import parse_size
    from cotenant.cluster import runtime

    tail = parse_size(args.tail)
    ray, scheduler = _scheduler(args.address)
    name = _call(ray, scheduler.job_name.remote(args.job))
    found: Dict[str, Tuple[str, str]] = {}
    for node in ray.nodes():
        if not node.get("Alive") or not node["Resources"].get("GPU"):
            continue
        try:
            agent = ray.get_actor(runtime.agent_name(node["NodeID"]), namespace=runtime.NAMESPACE)
            logs = ray.get(agent.logs.remote(name, tail), timeout=10)
        except Exception:  # no agent there (yet), or it does not answer: its node's logs are not shown
            continue
        found.update((worker, (node["NodeID"], text)) for worker, text in logs.items())
    if not found:
        print(f"{name}: no worker log on any live node yet (each worker logs on its node, in the agent's "
              "log directory)")
        return 0
    for worker in sorted(found, key=lambda w: int(w.rpartition("-w")[2])):
        node, text = found[worker]
        print(f"==> {worker} (node {node[:12]}) <==")
        print(text, end="" if text.endswith("\n") or not text else "\n")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    ray, scheduler = _scheduler(args.address)
    done = _call(ray, scheduler.cancel.remote(args.job))
    print(f"{done['job']}: cancelled")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    ray, scheduler = _scheduler(args.address)
    done = _call(ray, scheduler.down.remote())
    ray.kill(scheduler, no_restart=True)
    jobs = ", ".join(done["cancelled"]) or "none"
    print(f"cotenant scheduler stopped, with {done['agents']} node agent(s); jobs cancelled: {jobs}")
    if done["workers_left"]:
        print(f"cotenant cluster: workers still exiting: {', '.join(done['workers_left'])}", file=sys.stderr)
        return 1
    return 0
