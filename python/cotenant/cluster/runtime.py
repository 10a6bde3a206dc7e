"""The cluster scheduler on Ray: a node agent per node and one global scheduler, both Ray actors.

  NodeAgent        pinned to its node (NodeAffinitySchedulingStrategy, not soft).
                   Reports every GPU (UUID, type, memory, free memory,
                   utilization: nvidia-smi where there is one, else the node's
                   Ray labels and its coordinator's view) and every worker it
                   runs, as the node's cotenant coordinator sees them; starts
                   workers under `cotenant run`, and suspends, resumes,
                   upgrades and stops them through the coordinator.
  GlobalScheduler  holds ClusterScheduler (scheduler.py) and, every tick,
                   collects the agents' reports, decides and carries out the
                   actions. A guaranteed job's GPUs are reserved all at once
                   by a Ray placement group whose bundles are pinned to the
                   chosen nodes (label `ray.io/node-id`): the group is granted
                   whole or not at all, and only then do its workers start.
                   It starts the agent of every node with GPUs, and starts it
                   again (after `agent_restart_s`) when it has died.

Workers: a job of n GPUs has n workers, worker i on the i-th of its GPUs,
named `<job>-w<i>` at the node's coordinator; each gets COTENANT_CLUSTER_JOB
in its environment, and RANK, WORLD_SIZE and LOCAL_RANK as of its start. A job
launched through torchrun (cluster/torchrun.py) has a torchrun agent as each
worker, whose child is the job at the coordinator; torchrun sets the ranks, and
sets them again in every rendezvous round.

Nodes declare their GPUs to Ray as usual (`ray start --num-gpus N`), and may
label their type and memory where nvidia-smi cannot tell:
`--labels cotenant.io/gpu-type=A100,cotenant.io/gpu-memory=80GiB`.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from cotenant.cluster import torchrun
from cotenant.cluster.scheduler import (
    FAILED, FINISHED, GROW, RESUME, SHRINK, START, STOP, SUSPEND, UPGRADE, Action, ClusterJob, ClusterScheduler,
    Gpu, GpuKey, JobSpec, worker_name,
)
from cotenant.scheduling.state import GUARANTEED, OPPORTUNISTIC, RUNNING, STOPPING, SUSPENDED

NAMESPACE = "cotenant"
SCHEDULER_NAME = "cotenant-scheduler"
LABEL_GPU_TYPE = "cotenant.io/gpu-type"
LABEL_GPU_MEMORY = "cotenant.io/gpu-memory"
NODE_ID_LABEL = "ray.io/node-id"
STOP_GRACE_S = 5.0  # a stopped worker's SIGTERM, then SIGKILL
WORKERS_FILE = "workers.json"  # in an agent's log directory: the workers it runs, for the agent after it
# The global scheduler's state, in the Ray cluster's own key-value store (the GCS, namespace NAMESPACE):
# a scheduler Ray restarts, or one `cotenant cluster up` starts after it died, takes its jobs back.
STATE_KEY = "scheduler-state"
STATE_VERSION = 1
SAVE_EVERY_S = 5.0  # the time accounts at least this often; any change of a job at once
READ_STATE_FOR_S = 30.0  # a scheduler starting tries this long to read the saved state (the GCS restarting)


def ray_module():
    from cotenant._extras import require

    return require("ray", "cluster", "cotenant cluster")


def agent_name(node_id: str) -> str:
    return f"cotenant-agent-{node_id}"


# --- the node agent ------------------------------------------------------------------------


class NodeAgent:
    """One per node; every method is called by the global scheduler."""

    def __init__(self, node_id: str, socket: Optional[str] = None, log_dir: Optional[str] = None) -> None:
        self.node_id = node_id
        self.socket = socket
        # Each worker's stdout and stderr: <log_dir>/<node id>/<worker>.log, a directory per node so that
        # a log_dir on a shared file system keeps each node's logs apart.
        self.log_dir = os.path.join(log_dir or os.path.join("/tmp", "cotenant-cluster"), node_id)
        os.makedirs(self.log_dir, exist_ok=True)
        # The worker processes this agent runs, by name: its own children, and those an agent before it
        # on this node started (read from WORKERS_FILE: a restarted agent takes them over).
        self.workers: Dict[str, Any] = {}
        self.workers_file = os.path.join(self.log_dir, WORKERS_FILE)
        self._adopt()
        # worker -> the command (suspend, resume) it was sent before it registered at the coordinator:
        # delivered in the first report that finds it registered
        self.pending: Dict[str, str] = {}
        self.stores: Dict[str, Any] = {}  # rdzv_id -> the rendezvous store of a torchrun job, hosted here
        self.inventory = self._inventory()

    def pid(self) -> int:
        return os.getpid()

    def _adopt(self) -> None:
        """Takes over the live workers an agent before this one on the node started (it died; they ran
        on): they are followed and stopped as this agent's own, through /proc."""
        try:
            with open(self.workers_file) as f:
                saved = json.load(f)
            for worker, (pid, started) in saved.items():
                process = _Adopted(int(pid), int(started))
                if process.started > 0 and process.poll() is None:  # 0 would accept any process of that pid
                    self.workers[str(worker)] = process
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as error:
            print(f"cotenant node agent: {self.workers_file} does not read ({error}): the workers an agent "
                  f"before this one started are not taken over; stop them by hand", file=sys.stderr)
        self._save_workers()

    def _save_workers(self) -> None:
        """Writes the live workers (pid and start time, which tells a reused pid apart) for an agent
        that takes over from this one."""
        from cotenant.coordinator.daemon import process_start_ticks

        live = {}
        for worker, process in self.workers.items():
            started = process_start_ticks(process.pid)
            if started and process.poll() is None:
                live[worker] = [process.pid, started]
        temporary = f"{self.workers_file}.{os.getpid()}"
        with open(temporary, "w") as f:
            json.dump(live, f)
        os.replace(temporary, self.workers_file)

    def _inventory(self) -> List[Dict[str, Any]]:
        measured = _nvidia_smi(["index", "uuid", "name", "memory.total"])
        if measured:
            return [{"index": int(i), "uuid": u, "gpu_type": n, "memory_bytes": int(m) << 20} for i, u, n, m in measured]
        ray = ray_module()
        node = next(n for n in ray.nodes() if n["NodeID"] == self.node_id)
        labels = node.get("Labels") or {}
        memory = None
        if labels.get(LABEL_GPU_MEMORY):
            from cotenant._core import parse_size

            memory = parse_size(labels[LABEL_GPU_MEMORY])
        count = int(node["Resources"].get("GPU", 0))
        gpu_type = labels.get(LABEL_GPU_TYPE, "gpu")
        return [{"index": i, "uuid": f"{self.node_id[:16]}-gpu{i}", "gpu_type": gpu_type, "memory_bytes": memory}
                for i in range(count)]

    def report(self) -> Dict[str, Any]:
        from cotenant.coordinator import client

        try:
            view = client.status(self.socket)
            coordinator = "up"
        except (client.CoordinatorError, client.CoordinatorUnavailable, OSError) as error:
            view, coordinator = {"jobs": []}, f"unreachable: {error}"
        jobs = view["jobs"]
        self._deliver_pending({job["name"] for job in jobs})
        used: Dict[int, int] = collections.defaultdict(int)
        busy: Dict[int, float] = collections.defaultdict(float)
        running: Dict[int, List[str]] = collections.defaultdict(list)  # what the measurement covers
        for job in jobs:
            used[job["gpu"]] += job.get("device_bytes", 0)
            if job.get("state") == "running":
                busy[job["gpu"]] += 1.0 if job["role"] == GUARANTEED else job.get("share", 0.0)
                running[job["gpu"]].append(job["name"])
        utilization = {int(i): float(u) / 100 for i, u in _nvidia_smi(["index", "utilization.gpu"])}
        # The coordinator knows the node's GPUs by UUID where NVML is there: its word wins.
        uuids = {g["index"]: g["uuid"] for g in view.get("gpus", []) if g.get("uuid") and g.get("index") is not None}
        gpus = []
        for g in self.inventory:
            memory = g["memory_bytes"]
            free = None if memory is None else max(0, memory - used[g["index"]])
            gpus.append({**g, "uuid": uuids.get(g["index"], g["uuid"]), "free_bytes": free,
                         "utilization": utilization.get(g["index"], min(1.0, busy[g["index"]])),
                         "running": sorted(running[g["index"]])})
        workers: Dict[str, Dict[str, Any]] = {}
        for job in jobs:
            workers[job["name"]] = {"state": job["state"], "pid": job["pid"], "gpu": job["gpu"], "exit": None}
        for name, process in self.workers.items():
            code = process.poll()
            entry = workers.setdefault(name, {"state": "starting", "pid": process.pid, "gpu": None, "exit": None})
            entry["own"] = True  # started by this agent (a coordinator's other jobs are not the cluster's)
            if code is not None:
                adopted = isinstance(process, _Adopted)  # its exit status is unknown: not this agent's child
                entry.update(state="exited", exit=None if adopted else code, exit_unknown=adopted)
        return {"node": self.node_id, "pid": os.getpid(), "coordinator": coordinator, "gpus": gpus,
                "workers": workers, "rendezvous": sorted(self.stores)}

    def logs(self, job: str, tail_bytes: int) -> Dict[str, str]:
        """The last tail_bytes of the log (stdout and stderr) of each of the job's workers that ran on
        this node, by worker name."""
        prefix, found = f"{job}-w", {}
        for entry in sorted(os.listdir(self.log_dir)):
            worker = entry[:-len(".log")]
            if not (entry.endswith(".log") and worker.startswith(prefix) and worker[len(prefix):].isdigit()):
                continue
            with open(os.path.join(self.log_dir, entry), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
                found[worker] = f.read().decode(errors="replace")
        return found

    def address(self) -> str:
        """This node's address, as Ray knows it."""
        return ray_module().util.get_node_ip_address()

    def rendezvous_endpoint(self, rdzv_id: str) -> str:
        """host:port of the rendezvous store of a torchrun job whose worker 0 is here: hosted by this
        agent until close_rendezvous(rdzv_id)."""
        if rdzv_id not in self.stores:
            self.stores[rdzv_id] = torchrun.host_store(self.address())
        return torchrun.endpoint(self.stores[rdzv_id])

    def close_rendezvous(self, rdzv_id: str) -> None:
        """The job ended: its store goes."""
        self.stores.pop(rdzv_id, None)

    def start(self, worker: str, command: Sequence[str], gpu: int, role: str, env: Mapping[str, str],
              rendezvous: Optional[Mapping[str, Any]] = None) -> int:
        """Starts `cotenant run ... -- command`; with `rendezvous` (torchrun.agent_command's options), a
        torchrun agent whose child that is. A live process this agent started under the same name is
        stopped first: a scheduler that died between starting a job's workers and saving starts them
        again."""
        if worker in self.workers and self.workers[worker].poll() is None:
            self.stop(worker)
        argv = [sys.executable, "-m", "cotenant.cli", "run", f"--{role}", "--device", str(gpu), "--name", worker]
        if self.socket:
            argv += ["--socket", self.socket]
        argv += ["--", *command]
        if rendezvous is not None:
            argv = torchrun.agent_command(argv, local_addr=self.address(), **rendezvous)
            env = {**env, **torchrun.agent_env()}
        log = open(os.path.join(self.log_dir, f"{worker}.log"), "ab")
        process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.workers[worker] = process
        self._save_workers()
        return process.pid

    def command(self, worker: str, command: str) -> bool:
        """suspend or resume, through the coordinator. A worker this agent started that has not
        registered yet (its process is starting) gets the command once it has: a scale-in or an
        eviction right after a start is not lost. False: no such worker."""
        from cotenant.coordinator import client

        try:
            client.send_command(worker, command, self.socket)
            self.pending.pop(worker, None)
            return True
        except client.CoordinatorError:
            process = self.workers.get(worker)
            if process is None or process.poll() is not None:
                return False
            self.pending[worker] = command  # the latest wins: a resume after a suspend cancels it
            return True

    def _deliver_pending(self, registered: set) -> None:
        from cotenant.coordinator import client

        for worker, command in list(self.pending.items()):
            process = self.workers.get(worker)
            if process is None or process.poll() is not None:
                del self.pending[worker]  # stopped or exited before it registered
            elif worker in registered:
                try:
                    client.send_command(worker, command, self.socket)
                    del self.pending[worker]
                except client.CoordinatorError:
                    pass  # it left again between the status and the command: the next report retries

    def upgrade(self, worker: str) -> None:
        """Guaranteed from now on: a full compute share, no memory cap."""
        from cotenant.coordinator import client

        client.set_share(worker, 1.0, self.socket)
        client.set_cap(worker, None, self.socket)

    def stop(self, worker: str, pid: Optional[int] = None) -> None:
        """SIGTERM to the worker's process group; SIGKILL to it and its children's groups (a torchrun
        agent's child leads its own) after STOP_GRACE_S, on a thread: the agent goes on reporting."""
        process = self.workers.pop(worker, None)
        self.pending.pop(worker, None)
        if process is not None:
            self._save_workers()
        target = process.pid if process is not None else pid
        if not target:
            return
        children = _children(target)
        _signal_groups([target], signal.SIGTERM)
        if process is not None:
            threading.Thread(target=_reap, args=(process, [target, *children]), daemon=True,
                             name=f"stop-{worker}").start()


class _Adopted:
    """A worker process that an earlier agent on this node started: not this agent's child, so it is
    followed through /proc. poll() and wait() as subprocess.Popen's, but an ended process's exit status
    is unknown (poll() gives 0)."""

    def __init__(self, pid: int, started: int) -> None:
        self.pid, self.started = pid, started

    def poll(self) -> Optional[int]:
        from cotenant.coordinator.daemon import process_alive

        return None if process_alive(self.pid, self.started) else 0

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return 0


def group_name(job: ClusterJob) -> str:
    """The name of the placement group reserving a guaranteed job's GPUs."""
    return f"cotenant-{job.name}-{job.job_id}"


def _children(pid: int) -> List[int]:
    found: List[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        pass
    return found


def _signal_groups(groups: Sequence[int], sig: int) -> None:
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(process: subprocess.Popen, groups: Sequence[int]) -> None:
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_groups(groups, signal.SIGKILL)
        process.wait()


def _nvidia_smi(fields: Sequence[str]) -> List[Tuple[str, ...]]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [tuple(part.strip() for part in line.split(",")) for line in out.strip().splitlines()]
    return [r for r in rows if len(r) == len(fields)]


# --- the global scheduler ---------------------------------------------------------------------


class GlobalScheduler:
    """AntMan's global scheduler; a threaded Ray actor whose own thread ticks."""

    def __init__(self, policy: str = "antman", quotas: Optional[Mapping[str, int]] = None,
                 socket: Optional[str] = None, node_sockets: Optional[Mapping[str, str]] = None,
                 tick_s: float = 0.25, agent_timeout_s: float = 2.0, agent_restart_s: float = 5.0,
                 gang_timeout_s: float = 10.0, stray_grace_s: float = 10.0, log_dir: Optional[str] = None) -> None:
        from cotenant.cluster.allox import TypeMatching
        from cotenant.scheduling.policies import make_policy

        self.core = ClusterScheduler(TypeMatching(make_policy(policy)), quotas)
        self.policy_name = policy
        self.socket, self.node_sockets = socket, dict(node_sockets or {})
        self.tick_s, self.agent_timeout_s, self.agent_restart_s = tick_s, agent_timeout_s, agent_restart_s
        self.gang_timeout_s, self.stray_grace_s, self.log_dir = gang_timeout_s, stray_grace_s, log_dir
        self.agents: Dict[str, Any] = {}
        self.agent_died_at: Dict[str, float] = {}
        self.reports: Dict[str, Dict[str, Any]] = {}
        self.groups: Dict[int, Any] = {}      # job_id -> its placement group
        # job_id -> its gang, asked of Ray and not granted yet; the job holds its GPUs in the plan meanwhile
        self.reserving: Dict[int, _Gang] = {}
        # job_id -> (node, host:port) of a torchrun job's rendezvous store, which that node's agent hosts
        self.rendezvous: Dict[int, Tuple[str, str]] = {}
        self.leaving: Dict[int, Dict[str, Tuple[GpuKey, bool]]] = {}  # shrink: worker -> (GPU, suspend sent)
        self.strays: Dict[Tuple[str, str], Tuple[int, float]] = {}  # (node, worker) -> (pid, seen first)
        self.events: collections.deque = collections.deque(maxlen=1000)
        self.event_count = 0
        self.lock = threading.RLock()
        self.started = time.monotonic()
        self.saved_shape: Optional[Tuple[Any, ...]] = None
        self.saved_at = 0.0
        self.running = True
        self._load()
        self.thread = threading.Thread(target=self._loop, name="cotenant-scheduler", daemon=True)
        self.thread.start()

    # --- requests ---------------------------------------------------------------------

    def submit(self, specs: Sequence[JobSpec]) -> List[Dict[str, Any]]:
        """Submits several jobs at once (they are matched together), all or none; returns their ids and
        names."""
        with self.lock:
            now = self._now()
            jobs = self.core.submit_all(specs, now)
            answers = []
            for job in jobs:
                self._event("job submitted", job=job.name, tenant=job.spec.tenant,
                            gpus=f"{job.spec.min_gpus}-{job.spec.max_gpus}", role=job.spec.role)
                answer = {"job_id": job.job_id, "name": job.name}
                note = self._quota_note(job.spec)
                if note:
                    answer["note"] = note
                    self._event("guaranteed beyond its quota", job=job.name, reason=note)
                answers.append(answer)
            self._save()
            return answers

    def _quota_note(self, spec: JobSpec) -> str:
        """Why a job asked as guaranteed can never be, under the quotas now: its tenant has none (a
        typo in --tenant reads the same), or less than the job's fewest GPUs. Empty when it can."""
        quotas = self.core.quotas
        if quotas is None or spec.role != GUARANTEED:
            return ""
        quota = quotas.get(spec.tenant)
        if quota is not None and quota >= spec.min_gpus:
            return ""
        known = ", ".join(f"{t}={n}" for t, n in sorted(quotas.items())) or "none"
        held = f"has no quota (quotas: {known})" if quota is None else \
            f"has a quota of {quota} GPUs, fewer than the job's {spec.min_gpus}"
        return (f"tenant {spec.tenant!r} {held}: the job runs opportunistic (evictable) until "
                f"`cotenant cluster up --quota {spec.tenant}=GPUS` gives it room")

    def job_name(self, ref: str) -> str:
        """The name of the job `ref` names (a name or an id); ValueError when there is none."""
        with self.lock:
            return self._find(ref).name

    def _find(self, ref: str) -> ClusterJob:
        job = self.core.find(ref)
        if job is None:
            what = f"with id {ref}" if ref.isdigit() else f"named {ref!r}"
            raise ValueError(f"no cluster job {what}; `cotenant cluster status` lists them")
        return job

    def cancel(self, ref: str) -> Dict[str, Any]:
        with self.lock:
            job = self._find(ref)
            if job.status in (FINISHED, FAILED):  # cancelling it again would make a failure read as finished
                how = f"{job.status} ({job.reason})" if job.reason else job.status
                raise ValueError(f"job {job.name!r} has already {how}; nothing to cancel")
            self._stop_workers(job)
            self.core.ended(job, self._now(), reason="cancelled")
            self._release_group(job)
            self._close_rendezvous(job)
            self._event("job cancelled", job=job.name)
            self._save()
            return {"job": job.name, "state": job.status}

    def set_quota(self, tenant: str, gpus: int) -> None:
        with self.lock:
            if self.core.quotas is None:
                self.core.quotas = {}
            self.core.quotas[tenant] = gpus
            self._save()

    def status(self) -> Dict[str, Any]:
        with self.lock:
            view = self.core.status()
            view["policy"] = self.policy_name
            view["events"] = list(self.events)[-50:]
            return view

    def history(self) -> List[Dict[str, Any]]:
        with self.lock:
            return list(self.events)

    def shutdown(self) -> None:
        self.running = False

    def pid(self) -> int:
        return os.getpid()

    def down(self, grace_s: float = STOP_GRACE_S + 2.0) -> Dict[str, Any]:
        """`cotenant cluster down`: cancels every unfinished job, waits up to grace_s for their
        workers to exit, stops the node agents and the loop, and forgets the saved state. The caller
        then kills this actor."""
        ray = ray_module()
        with self.lock:
            self.running = False
            live = [job for job in self.core.jobs.values() if job.status not in (FINISHED, FAILED)]
            stopping = {worker_name(job.name, i) for job in live for i in range(len(job.worker_gpus))}
            for job in live:
                self.cancel(job.name)
            agents = dict(self.agents)
        deadline = time.monotonic() + grace_s
        left: List[str] = []
        while True:
            left = []
            for node, agent in agents.items():
                try:
                    report = ray.get(agent.report.remote(), timeout=self.agent_timeout_s)
                except Exception:
                    continue  # an agent that does not answer has nothing left to stop
                left += [w for w, s in report["workers"].items() if w in stopping and s["state"] != "exited"]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for agent in agents.values():
            try:
                ray.kill(agent, no_restart=True)
            except Exception:
                pass
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(STATE_KEY, namespace=NAMESPACE)
        return {"cancelled": [job.name for job in live], "agents": len(agents), "workers_left": sorted(left)}

    # --- across a restart -------------------------------------------------------------------

    def _save(self) -> None:
        """Saves the state a restarted scheduler needs when any job changed (the time accounts every
        SAVE_EVERY_S); a failure is an event, and the next tick tries again."""
        if not self.running:
            return  # `down` forgets the state; a last tick must not save it again
        shape = (self.core.shape(), tuple(sorted(self.groups)), tuple(sorted(self.reserving)),
                 tuple(sorted(self.rendezvous.items())), repr(sorted(self.leaving.items())), self.event_count)
        if shape == self.saved_shape and time.monotonic() - self.saved_at < SAVE_EVERY_S:
            return
        state = {"version": STATE_VERSION, "now": self._now(), "wall": time.time(), "core": self.core.to_state(),
                 "groups": {str(job_id): group_name(self.core.jobs[job_id]) for job_id in self.groups},
                 "reserving": {str(job_id): [group_name(self.core.jobs[job_id]), gang.kind]
                               for job_id, gang in self.reserving.items()},
                 "rendezvous": {str(job_id): list(entry) for job_id, entry in self.rendezvous.items()},
                 "leaving": {str(job_id): {w: [list(key), sent] for w, (key, sent) in leaving.items()}
                             for job_id, leaving in self.leaving.items()},
                 "events": list(self.events)}
        try:
            from ray.experimental import internal_kv

            internal_kv._internal_kv_put(STATE_KEY, json.dumps(state), namespace=NAMESPACE)
        except Exception as error:
            self._event("state not saved", error=f"{type(error).__name__}: {error}")
            return
        self.saved_shape, self.saved_at = shape, time.monotonic()

    def _load(self) -> None:
        """Takes back what the scheduler before this one saved: its jobs in their states, its clock,
        the placement groups of its running guaranteed jobs (looked up by name), the rendezvous
        stores and leaving workers it followed, and its events."""
        from ray.experimental import internal_kv
        from ray.util.placement_group import get_placement_group

        raw = _read_saved_state(internal_kv)
        if not raw:
            return
        try:  # all of it read before any of it is taken: a state that does not read leaves a fresh scheduler
            state = json.loads(raw)
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"saved by another version of cotenant (format {state.get('version')!r})")
            core = ClusterScheduler(self.core.policy, self.core.quotas)
            core.restore(state["core"])
            # The clock goes on from the saved time, counting the time the scheduler was away.
            away = float(state["now"]) + max(0.0, time.time() - float(state["wall"]))
            rendezvous = {int(job_id): (str(node), str(endpoint))
                          for job_id, (node, endpoint) in state.get("rendezvous", {}).items()}
            leaving = {int(job_id): {w: ((str(key[0]), int(key[1])), bool(sent)) for w, (key, sent) in workers.items()}
                       for job_id, workers in state.get("leaving", {}).items()}
            groups = {int(job_id): str(name) for job_id, name in state.get("groups", {}).items()}
            reserving = {int(job_id): (str(name), str(kind))
                         for job_id, (name, kind) in state.get("reserving", {}).items()}
            events = list(state.get("events", []))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            internal_kv._internal_kv_put(STATE_KEY + "-unread", raw, namespace=NAMESPACE)  # for a person to read
            self._event("saved state not restored", error=f"{type(error).__name__}: {error}",
                        kept_as=STATE_KEY + "-unread",
                        fix="the jobs it held run on unmanaged: stop their workers by hand and submit them again")
            return
        self.core, self.started = core, time.monotonic() - away
        self.rendezvous, self.leaving = rendezvous, leaving
        self.events.extend(events)
        for job_id, name in groups.items():
            try:
                self.groups[job_id] = get_placement_group(name)
            except ValueError:
                self._event("placement group gone", group=name, reason="its GPUs are no longer reserved")
        # A gang still waiting for Ray: its start never happened. The job waits again (as a gang not
        # granted does); left RUNNING with no worker, it would read as finished.
        from ray.util.placement_group import remove_placement_group

        for job_id, (name, kind) in reserving.items():
            try:
                remove_placement_group(get_placement_group(name))
            except ValueError:
                pass
            job = self.core.jobs.get(job_id)
            if job is not None and job.status == RUNNING:
                self._undo(job, kind)
        live = sum(job.status not in (FINISHED, FAILED) for job in self.core.jobs.values())
        self._event("scheduler restored", jobs=live, groups=len(self.groups))

    # --- the loop ------------------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _event(self, event: str, **fields: Any) -> None:
        self.events.append({"t": round(self._now(), 3), "event": event, **fields})
        self.event_count += 1

    def _loop(self) -> None:
        while self.running:
            try:
                self.tick()
            except Exception as error:  # the loop must outlive one bad tick; the event says what failed
                self._event("tick failed", error=f"{type(error).__name__}: {error}")
            time.sleep(self.tick_s)

    def tick(self) -> None:
        ray = ray_module()
        self._ensure_agents(ray)
        refs = {node: agent.report.remote() for node, agent in self.agents.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.agent_timeout_s) \
            if refs else ([], [])
        reports: Dict[str, Dict[str, Any]] = {}
        failed: List[str] = []
        for node, ref in refs.items():
            if ref not in ready:
                failed.append(node)
                continue
            try:
                reports[node] = ray.get(ref)
            except Exception:  # the actor died (kill -9) or is restarting
                failed.append(node)
        with self.lock:
            now = self._now()
            for node in failed:
                if self.core.node_lost(node):
                    self._event("node lost", node=node, reason="its agent did not answer")
                self.agents.pop(node, None)
                self.agent_died_at.setdefault(node, time.monotonic())
            for node, report in reports.items():
                gpus = [Gpu(node=node, index=g["index"], uuid=g["uuid"], gpu_type=g["gpu_type"],
                            memory_bytes=g["memory_bytes"], free_bytes=g["free_bytes"],
                            utilization=g["utilization"], running=frozenset(g["running"]))
                        for g in report["gpus"]]
                if self.core.node_reported(node, gpus):
                    self._event("node joined", node=node, gpus=len(gpus), agent_pid=report["pid"])
                self.reports[node] = report
            self._follow_workers(now)
            self._stop_strays(reports, now)
            # After the workers are followed: a worker started now is in no report of this tick.
            self._follow_reservations(ray)
            for action in self.core.decide(now):
                self._carry_out(action, ray)
            self._save()

    def _ensure_agents(self, ray) -> None:
        """An agent on every live node with GPUs: started when missing, again a while after it died."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or not node["Resources"].get("GPU") or node_id in self.agents:
                continue
            died = self.agent_died_at.get(node_id)
            if died is not None and time.monotonic() - died < self.agent_restart_s:
                continue
            try:
                agent = ray.get_actor(agent_name(node_id), namespace=NAMESPACE)
                ray.get(agent.pid.remote(), timeout=self.agent_timeout_s)
            except Exception:
                agent = ray.remote(NodeAgent).options(
                    name=agent_name(node_id), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                    max_restarts=0, get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(node_id, self.node_sockets.get(node_id, self.socket), self.log_dir)
            self.agents[node_id] = agent
            self.agent_died_at.pop(node_id, None)

    # --- what the workers did -------------------------------------------------------------

    def _worker(self, job: ClusterJob, index: int, key: GpuKey) -> Optional[Dict[str, Any]]:
        report = self.reports.get(key[0])
        if report is None:
            return None
        name = worker_name(job.name, index)
        if name not in report["workers"] and report.get("coordinator") != "up":
            return None  # the coordinator that lists the node's workers did not answer: unknown, not gone
        return report["workers"].get(name, {"state": "gone", "exit": None})

    def _follow_workers(self, now: float) -> None:
        for job in list(self.core.jobs.values()):
            # Where its workers are: running or stopping on its GPUs, suspended on those it left.
            keys = job.suspended_on if job.status == SUSPENDED else job.gpus
            if job.status not in (RUNNING, STOPPING, SUSPENDED) or any(g[0] not in self.core.nodes for g in keys):
                continue
            if job.job_id in self.reserving and self.reserving[job.job_id].kind != UPGRADE:
                continue  # placed, its workers not started (or resumed) until Ray grants its gang
            states = [self._worker(job, i, key) for i, key in enumerate(keys)]
            if any(s is None for s in states):
                continue
            if all(s["state"] in ("exited", "gone") for s in states):
                codes = [s["exit"] for s in states if s["exit"] not in (None, 0)]
                status = f"exit status {codes[0]}" if codes else ""
                if not codes and any(s.get("exit_unknown") for s in states):
                    status = "exit status unknown: its node agent was started again while it ran"
                if job.status == SUSPENDED:  # nothing is left to resume
                    self.core.ended(job, now, failed=True, reason="its workers exited while it was suspended" +
                                    (f" ({status})" if status else ""))
                else:
                    self.core.ended(job, now, failed=bool(codes), reason=status)
                self._wrap_up(job)
            elif job.status == STOPPING and all(s["state"] == "suspended" for s in states):
                self.core.stopped(job, now)
                self._event("job evicted", job=job.name, node=job.node)
        for job_id, leaving in list(self.leaving.items()):
            job = self.core.jobs[job_id]
            for worker, (key, _) in list(leaving.items()):
                report = self.reports.get(key[0])
                if key[0] not in self.core.nodes or report is None or key[0] not in self.agents:
                    continue  # its node's agent has not answered: unknown, not gone (its GPU stays held)
                state = report["workers"].get(worker)
                if state is None and report.get("coordinator") != "up":
                    continue  # the coordinator that lists the node's workers did not answer
                state = state or {"state": "gone"}
                if state["state"] == "suspended" or state["state"] in ("exited", "gone"):
                    self.agents[key[0]].stop.remote(worker, state.get("pid"))
                    del leaving[worker]
                    self.core.workers_left(job, [key])
                    self._event("worker left", job=job.name, worker=worker, node=key[0])
            if not leaving:
                del self.leaving[job_id]

    def _stop_strays(self, reports: Mapping[str, Dict[str, Any]], now: float) -> None:
        """Stops the workers an agent started that no job has on its node any more: started by a
        scheduler that died before saving, left by a shrink or eviction it had not saved, or missed by a
        stop sent while their agent did not answer. A worker is stopped once it has been a stray (the
        same process) for stray_grace_s: a report taken before a cancel or a shrink stopped it is not
        enough."""
        expected = self.core.expected_workers()
        seen = set()
        for node, report in reports.items():
            for worker, state in report["workers"].items():
                if not state.get("own") or state["state"] == "exited" or worker in expected.get(node, ()):
                    continue
                key = (node, worker)
                seen.add(key)
                pid, since = self.strays.get(key, (None, now))
                if pid != state["pid"]:
                    self.strays[key] = (state["pid"], now)  # a new process: its grace starts now
                elif now - since >= self.stray_grace_s:
                    self.agents[node].stop.remote(worker, state["pid"])
                    del self.strays[key]
                    self._event("stray worker stopped", worker=worker, node=node, pid=state["pid"],
                                reason="no job of this scheduler's has that worker on that node")
        for key in [k for k in self.strays if k not in seen and k[0] in reports]:
            del self.strays[key]

    def _wrap_up(self, job: ClusterJob) -> None:
        """A job the scheduler has ended: its placement group and rendezvous store go."""
        self._release_group(job)
        self._close_rendezvous(job)
        self._event("job ended", job=job.name, state=job.status, reason=job.reason)

    # --- actions ------------------------------------------------------------------------

    def _carry_out(self, action: Action, ray) -> None:
        job = action.job
        pending = self.reserving.get(job.job_id)
        if pending is not None and action.kind != STOP and self._withdraw(job, pending.kind, action.kind):
            return
        if action.kind == START:
            if job.role == GUARANTEED and not self._reserve(job, job.gpus, START, ray):
                return
            self._start(job, ray)
        elif action.kind == RESUME:
            if job.role == GUARANTEED and not self._reserve(job, job.gpus, RESUME, ray):
                return
            self._resume(job)
        elif action.kind == SUSPEND:
            self._release_group(job)
            self._each_worker(job, lambda agent, w: agent.command.remote(w, "suspend"))
            self._event("job evicting", job=job.name, reason="a guaranteed job needs its GPUs")
        elif action.kind == UPGRADE:
            if not self._reserve(job, job.gpus, UPGRADE, ray):
                return
            self._upgrade(job)
        elif action.kind == GROW:
            first = len(job.gpus) - len(action.gpus)
            self._start_workers(job, [(first + i, key) for i, key in enumerate(action.gpus)], ray)
            self._event("job grew", job=job.name, workers=len(job.gpus))
        elif action.kind == STOP:
            self._stop_workers(job, action.gpus)
            self._wrap_up(job)
        elif action.kind == SHRINK:
            leaving = self.leaving.setdefault(job.job_id, {})
            first = len(job.gpus)
            for i, key in enumerate(action.gpus):
                worker = worker_name(job.name, first + i)
                leaving[worker] = (key, True)
                if job.spec.launcher == torchrun.TORCHRUN:
                    # Its agent stops its child and leaves; the staying agents re-form without it.
                    self.agents[key[0]].stop.remote(worker)
                else:
                    self.agents[key[0]].command.remote(worker, "suspend")  # at its next iteration boundary
            self._event("job shrinking", job=job.name, workers=len(job.gpus))

    def _start(self, job: ClusterJob, ray) -> None:
        try:
            self._start_workers(job, list(enumerate(job.gpus)), ray)
        except Exception as error:  # an agent died since its report: the job did not start
            gpus = [list(g) for g in job.gpus]
            self._stop_workers(job)  # those that did
            self._release_group(job)
            self.core.unplace(job)
            self._event("job not started", job=job.name, gpus=gpus, reason=f"{type(error).__name__}: {error}; "
                        "it waits")
            return
        self._event("job started", job=job.name, role=job.role, gpus=[list(g) for g in job.gpus])

    def _resume(self, job: ClusterJob) -> None:
        self._each_worker(job, lambda agent, w: agent.command.remote(w, "resume"))
        self._event("job resumed", job=job.name, gpus=[list(g) for g in job.gpus])

    def _upgrade(self, job: ClusterJob) -> None:
        self._each_worker(job, lambda agent, w: agent.upgrade.remote(w))
        self._event("job upgraded", job=job.name, tenant=job.spec.tenant)

    def _reserve(self, job: ClusterJob, gpus: Sequence[GpuKey], kind: str, ray) -> bool:
        """Asks Ray for a placement group of the job's GPUs, one bundle per node pinned to it; all or
        nothing. True when Ray has granted it now; otherwise the gang waits (self.reserving) and
        _follow_reservations carries out `kind` (START, RESUME, UPGRADE) once it is granted, at a later
        tick, or gives it up after gang_timeout_s. The tick never waits for Ray here: it holds the lock
        that status, submit and cancel take, and each ungranted gang used to hold them (and every other
        decision) for the whole timeout, at every tick while Ray could not grant it."""
        from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

        try:  # left by a scheduler that died between reserving and saving: it holds the GPUs
            remove_placement_group(get_placement_group(group_name(job)))
        except ValueError:
            pass
        per_node: Dict[str, int] = collections.Counter(node for node, _ in gpus)
        nodes = sorted(per_node)
        group = placement_group([{"GPU": float(per_node[n])} for n in nodes], strategy="PACK",
                                bundle_label_selector=[{NODE_ID_LABEL: n} for n in nodes],
                                name=group_name(job), lifetime="detached")  # outlives a scheduler restart
        if _granted(group):
            self._release_group(job)
            self.groups[job.job_id] = group
            return True
        self.reserving[job.job_id] = _Gang(group, time.monotonic() + self.gang_timeout_s, kind)
        return False

    def _follow_reservations(self, ray) -> None:
        """Each waiting gang Ray has granted since: its action is carried out. One not granted within
        gang_timeout_s is given up: its job waits again (an upgrade: it runs on, opportunistic)."""
        for job_id, gang in list(self.reserving.items()):
            job = self.core.jobs[job_id]
            if job.status != RUNNING or (gang.kind == UPGRADE and job.role != GUARANTEED):
                # The core moved it on meanwhile (a node lost, a plan that keeps it opportunistic).
                self._release_group(job)
            elif _granted(gang.group):
                del self.reserving[job_id]
                self._release_group(job)
                self.groups[job_id] = gang.group
                {START: lambda: self._start(job, ray), RESUME: lambda: self._resume(job),
                 UPGRADE: lambda: self._upgrade(job)}[gang.kind]()
            elif time.monotonic() >= gang.give_up_at:
                gpus = [list(g) for g in job.gpus]
                self._release_group(job)
                self._undo(job, gang.kind)
                self._event("gang not granted", job=job.name, gpus=gpus,
                            reason="Ray could not reserve every GPU at once; it waits")
            elif not gang.announced:  # a tick has gone by: more than Ray's usual moment
                gang.announced = True
                self._event("gang waiting", job=job.name, gpus=[list(g) for g in job.gpus],
                            reason="Ray has not reserved every GPU at once yet; it waits up to "
                                   f"{self.gang_timeout_s:g} s")

    def _withdraw(self, job: ClusterJob, kind: str, then: str) -> bool:
        """The plan changed (`then`: an eviction, a resize) for a job whose gang Ray has not granted:
        the gang is given up. A start or resume that never happened is undone, and nothing is left to
        evict or resize (True: `then` is done); an upgrade leaves the job opportunistic, and `then`
        goes on (False)."""
        self._release_group(job)
        self._undo(job, kind)
        if kind == UPGRADE:
            return False
        if then == SUSPEND:
            job.evictions -= 1  # it never ran on these GPUs
        job.stopping = ()
        self._event("gang withdrawn", job=job.name, reason=f"the plan changed ({then}) before Ray granted it; "
                    "it waits")
        return True

    def _undo(self, job: ClusterJob, kind: str) -> None:
        """What a gang given up leaves of the action it was to carry out: a start or resume never
        happened (the job waits again); an upgrade never did (it runs on, opportunistic)."""
        if kind == UPGRADE:
            job.role = OPPORTUNISTIC
        else:
            self.core.unplace(job)

    def _release_group(self, job: ClusterJob) -> None:
        """Its placement group goes, granted or still waiting."""
        from ray.util.placement_group import remove_placement_group

        group = self.groups.pop(job.job_id, None)
        if group is not None:
            remove_placement_group(group)
        waiting = self.reserving.pop(job.job_id, None)
        if waiting is not None:
            remove_placement_group(waiting.group)

    def _start_workers(self, job: ClusterJob, workers: Sequence[Tuple[int, GpuKey]], ray) -> None:
        world = len(job.gpus)
        local: Dict[str, int] = collections.Counter()
        rendezvous = self._rendezvous(job, ray) if job.spec.launcher == torchrun.TORCHRUN else None
        calls = []
        for index, (node, gpu) in workers:
            env = {**job.spec.env, "COTENANT_CLUSTER_JOB": job.name}
            if rendezvous is None:  # under torchrun, torchrun sets the ranks, in every round
                env.update(RANK=str(index), WORLD_SIZE=str(world), LOCAL_RANK=str(local[node]))
            local[node] += 1
            calls.append(self.agents[node].start.remote(worker_name(job.name, index), list(job.spec.command), gpu,
                                                        job.role or job.spec.role, env, rendezvous))
        ray.get(calls)

    def _rendezvous(self, job: ClusterJob, ray) -> Dict[str, Any]:
        """A torchrun job's rendezvous: its store, hosted by the agent of worker 0's node from the job's
        first start to its end."""
        rdzv_id = torchrun.run_id(job.name, job.job_id)
        if job.job_id not in self.rendezvous:
            node = job.gpus[0][0]
            self.rendezvous[job.job_id] = (node, ray.get(self.agents[node].rendezvous_endpoint.remote(rdzv_id)))
        return {"min_nodes": job.spec.min_gpus, "max_nodes": job.spec.max_gpus,
                "endpoint": self.rendezvous[job.job_id][1], "rdzv_id": rdzv_id}

    def _close_rendezvous(self, job: ClusterJob) -> None:
        """The job ended: the agent that hosts its rendezvous store (if any) lets it go."""
        entry = self.rendezvous.pop(job.job_id, None)
        if entry is not None and entry[0] in self.agents:
            self.agents[entry[0]].close_rendezvous.remote(torchrun.run_id(job.name, job.job_id))

    def _each_worker(self, job: ClusterJob, call) -> None:
        for i, (node, _) in enumerate(job.gpus):
            agent = self.agents.get(node)
            if agent is not None:
                call(agent, worker_name(job.name, i))

    def _stop_workers(self, job: ClusterJob, gpus: Optional[Sequence[GpuKey]] = None) -> None:
        """Stops worker i on gpus[i]: by default where the job's workers are (running, leaving, or
        suspended)."""
        for i, (node, _) in enumerate(job.worker_gpus if gpus is None else gpus):
            agent = self.agents.get(node)
            if agent is not None:
                agent.stop.remote(worker_name(job.name, i))


@dataclass
class _Gang:
    """A guaranteed job's gang, asked of Ray and not granted yet."""

    group: Any         # its placement group
    give_up_at: float  # time.monotonic() past which it is given up
    kind: str          # what is carried out once Ray grants it: START, RESUME or UPGRADE
    announced: bool = False  # its "gang waiting" event is out


def _granted(group) -> bool:
    """Whether Ray has reserved every bundle of the placement group; never waits (no task either, as
    group.ready() would start one). A GCS that does not answer: not yet."""
    try:
        return bool(group.wait(timeout_seconds=0))
    except Exception:
        return False


def _read_saved_state(internal_kv) -> Optional[bytes]:
    """The saved state (None: there is none), read again for READ_STATE_FOR_S while the GCS does not
    answer. A scheduler that started without it would forget every job it held: it does not start."""
    deadline = time.monotonic() + READ_STATE_FOR_S
    while True:
        try:
            return internal_kv._internal_kv_get(STATE_KEY, namespace=NAMESPACE)
        except Exception as error:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cotenant scheduler cannot read its saved state from the Ray cluster's GCS (key "
                    f"{STATE_KEY!r}, namespace {NAMESPACE!r}) after {READ_STATE_FOR_S:.0f} s: "
                    f"{type(error).__name__}: {error}. It does not start without it, so as not to forget "
                    f"the jobs it holds; start it again with `cotenant cluster up` once the GCS answers") from error
            time.sleep(min(1.0, READ_STATE_FOR_S / 10))


# --- connecting -----------------------------------------------------------------------------


def connect(address: Optional[str] = None):
    """Joins the running Ray cluster (address, else RAY_ADDRESS, else the local one)."""
    ray = ray_module()
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 logging_level="warning", log_to_driver=False)
    return ray


def scheduler_handle(ray):
    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise LookupError("no cotenant scheduler runs on this Ray cluster; start one with `cotenant cluster up`") \
            from None


def start_scheduler(ray, **options: Any):
    """The global scheduler, detached (it outlives the command that started it); an existing one is
    kept. Ray restarts it when its process dies, and it takes its jobs back from the saved state."""
    return ray.remote(GlobalScheduler).options(
        name=SCHEDULER_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=8,
        max_restarts=-1, get_if_exists=True,
    ).remote(**options)
