"""The global scheduler's decisions, without Ray: AntMan's cluster policy over the node agents' reports.

`ClusterScheduler` keeps the cluster's jobs and the GPUs its node agents
report, and turns them into a NodeState over every GPU of every live node
(GPU i of the plan is `gpus[i]`, in node order), with each tenant's quota.
The scheduling policy (any of cotenant.scheduling.policies, by default
AntMan's packing, behind AlloX's matching where GPU types differ) returns a
plan; Amoeba's resizing (`elastic.resize`) follows; `decide` returns what
the runtime must do:

  start    place a waiting job's workers, one per GPU (guaranteed: gang-placed
           through a Ray placement group first, all or nothing)
  suspend  an opportunistic job is evicted: its workers suspend at their
           iteration boundary (memory to the host) and it waits again, bound
           to the GPUs its workers stay on (their memory is in that node's
           host memory)
  resume   a suspended job comes back on those GPUs, with all its workers
  upgrade  an opportunistic job becomes guaranteed where it runs (its tenant's
           quota freed up)
  grow / shrink   an elastic job gains or gives back workers
  stop     a suspended job failed because a GPU it is bound to is no longer on
           its node: its workers are stopped

No I/O and no clock (`now` comes in, seconds). Invariants: a job is in
exactly one state; a job whose workers are stopping holds its GPUs until
every worker reports itself suspended or stopped; jobs on a node whose agent
is lost are left alone (their coordinator and workers run on) and the
node's GPUs are out of every plan until its agent reports again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from cotenant.cluster.elastic import WorkerRange, resize
from cotenant.cluster.torchrun import LAUNCHERS, PLAIN
from cotenant.scheduling.admission import refusal
from cotenant.scheduling.state import (
    GUARANTEED, OPPORTUNISTIC, RUNNING, STOPPING, SUSPENDED, WAITING, GpuView, JobView, NodeState, TimeAccount,
)

FINISHED = "finished"
FAILED = "failed"

START, SUSPEND, RESUME, UPGRADE, GROW, SHRINK = "start", "suspend", "resume", "upgrade", "grow", "shrink"
STOP = "stop"  # a job the scheduler failed whose workers still run: stop them


@dataclass(frozen=True)
class Gpu:
    """One GPU as its node's agent reports it."""

    node: str
    index: int
    uuid: str
    gpu_type: str
    memory_bytes: Optional[int]
    free_bytes: Optional[int] = None
    utilization: Optional[float] = None
    # The workers (worker_name) its agent saw running on it when it measured; None: not said.
    # A measurement that misses a worker the scheduler placed there is stale: it is not used.
    running: Optional[FrozenSet[str]] = None


GpuKey = Tuple[str, int]  # (node, GPU index on that node)


def worker_name(job: str, index: int) -> str:
    """Worker `index` of cluster job `job`, as its node's coordinator knows it."""
    return f"{job}-w{index}"


@dataclass(frozen=True)
class JobSpec:
    """What a user submits: `cotenant cluster submit`."""

    name: str
    command: Tuple[str, ...]
    tenant: str = "default"
    min_gpus: int = 1
    max_gpus: int = 1                 # above min_gpus: an elastic job
    gpu_type: Optional[str] = None    # run only on this GPU type
    role: str = GUARANTEED            # asked for; beyond the tenant's quota it runs opportunistic
    speeds: Mapping[str, float] = field(default_factory=dict)  # relative throughput per GPU type
    persistent_bytes: int = 0         # per GPU
    peak_bytes: int = 0               # per GPU
    env: Mapping[str, str] = field(default_factory=dict)
    # plain: each worker is the command, told its RANK and WORLD_SIZE at start;
    # torchrun: each worker is a torchrun agent of one elastic rendezvous (cluster/torchrun.py)
    launcher: str = PLAIN

    def __post_init__(self) -> None:
        WorkerRange(self.min_gpus, self.max_gpus)  # checks the range
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"a job's launcher is one of {', '.join(LAUNCHERS)}, not {self.launcher!r}")
        if self.role not in (GUARANTEED, OPPORTUNISTIC):
            raise ValueError(f"a job's role is guaranteed or opportunistic, not {self.role!r}")
        if not self.command:
            raise ValueError(f"job {self.name!r} has no command")

    @property
    def elastic(self) -> bool:
        return self.max_gpus > self.min_gpus


@dataclass
class ClusterJob:
    job_id: int
    spec: JobSpec
    submitted_at: float
    status: str = WAITING
    gpus: Tuple[GpuKey, ...] = ()     # worker i runs on gpus[i]
    role: Optional[str] = None        # the role it runs in now
    share: float = 1.0
    node: Optional[str] = None        # a suspended job's memory is on this node
    attained_service: float = 0.0
    first_started_at: Optional[float] = None
    last_started_at: Optional[float] = None
    last_stopped_at: Optional[float] = None
    finished_at: Optional[float] = None
    waited_s: float = 0.0
    marks: Dict[str, float] = field(default_factory=dict)
    stopping: Tuple[GpuKey, ...] = ()  # workers leaving (shrink), holding their GPUs until they stop
    evictions: int = 0
    reason: str = ""
    suspended_on: Tuple[GpuKey, ...] = ()  # a suspended job's workers stay on these GPUs: it resumes there

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def worker_gpus(self) -> Tuple[GpuKey, ...]:
        """Where its worker processes are, worker i on the i-th: running or leaving, or where it was
        suspended."""
        return self.suspended_on if self.status == SUSPENDED else self.gpus + self.stopping


@dataclass(frozen=True)
class Action:
    kind: str
    job: ClusterJob
    # start, resume: all its GPUs; grow: the new ones; shrink: the leaving ones; stop: its workers' GPUs
    gpus: Tuple[GpuKey, ...] = ()


class ClusterScheduler:
    def __init__(self, policy, quotas: Optional[Mapping[str, int]] = None) -> None:
        self.policy = policy
        self.quotas: Optional[Dict[str, int]] = dict(quotas) if quotas is not None else None
        self.jobs: Dict[int, ClusterJob] = {}
        self.nodes: Dict[str, List[Gpu]] = {}   # live nodes and their GPUs
        self.lost: Dict[str, List[Gpu]] = {}    # nodes whose agent stopped answering
        self.next_id = 1
        self._time = TimeAccount()

    # --- nodes ---------------------------------------------------------------------

    def node_reported(self, node: str, gpus: Sequence[Gpu]) -> bool:
        """An agent's report; True when the node (re)joins."""
        joined = node not in self.nodes
        self.nodes[node] = sorted(gpus, key=lambda g: g.index)
        self.lost.pop(node, None)
        return joined

    def node_lost(self, node: str) -> bool:
        """The node's agent did not answer; True when the node was live until now."""
        gpus = self.nodes.pop(node, None)
        if gpus is None:
            return False
        self.lost[node] = gpus
        return True

    # --- jobs ----------------------------------------------------------------------

    def submit(self, spec: JobSpec, now: float) -> ClusterJob:
        return self.submit_all([spec], now)[0]

    def submit_all(self, specs: Sequence[JobSpec], now: float) -> List[ClusterJob]:
        """Submits the jobs together, all or none: a name an unfinished job has, or one given twice
        among them, refuses every one."""
        taken = {j.name for j in self.jobs.values() if j.status not in (FINISHED, FAILED)}
        for spec in specs:
            if spec.name.isdigit():  # `cluster cancel 12` means job id 12
                raise ValueError(f"the job name {spec.name!r} is a number, which would be taken for a job id; "
                                 f"use e.g. 'job-{spec.name}'")
            if spec.name in taken:
                raise ValueError(f"a job named {spec.name!r} is already in the cluster; choose another --name")
            taken.add(spec.name)
        self.advance(now)
        jobs = []
        for spec in specs:
            jobs.append(ClusterJob(self.next_id, spec, now))
            self.next_id += 1
            self.jobs[jobs[-1].job_id] = jobs[-1]
        return jobs

    def find(self, ref: str) -> Optional[ClusterJob]:
        """A number is a job id, anything else a name (names are never numbers); the newest job of
        that name."""
        if ref.isdigit():
            return self.jobs.get(int(ref))
        for job in sorted(self.jobs.values(), key=lambda j: -j.job_id):
            if job.name == ref:
                return job
        return None

    def expected_workers(self) -> Dict[str, Set[str]]:
        """node -> the names of the worker processes the jobs have there (running, leaving, or
        suspended). A worker a node agent started that is not among them is a stray."""
        expected: Dict[str, Set[str]] = {}
        for job in self.jobs.values():
            for i, (node, _) in enumerate(job.worker_gpus):
                expected.setdefault(node, set()).add(worker_name(job.name, i))
        return expected

    def ended(self, job: ClusterJob, now: float, failed: bool = False, reason: str = "") -> None:
        """Every worker of the job exited (or it was cancelled)."""
        self.advance(now)
        job.status, job.finished_at, job.reason = (FAILED if failed else FINISHED), now, reason
        job.gpus, job.stopping = (), ()

    def stopped(self, job: ClusterJob, now: float) -> None:
        """Every worker of an evicted job reports itself suspended: its GPUs are free."""
        if job.status == STOPPING:
            self.advance(now)
            job.node = job.gpus[0][0] if job.gpus else None
            job.suspended_on = job.gpus
            job.status, job.gpus, job.role, job.last_stopped_at = SUSPENDED, (), None, now

    def workers_left(self, job: ClusterJob, gpus: Sequence[GpuKey]) -> None:
        """Workers a shrink stopped have exited: their GPUs are free."""
        job.stopping = tuple(g for g in job.stopping if g not in gpus)

    def unplace(self, job: ClusterJob) -> None:
        """A start the runtime could not carry out (its placement group was not granted, an agent died
        before it started the workers): it waits again, and a job this start was the first of has never
        started."""
        job.status, job.gpus, job.role = (SUSPENDED if job.first_started_at and job.node else WAITING), (), None
        if job.status == WAITING and job.first_started_at is not None and job.first_started_at == job.last_started_at:
            job.first_started_at = job.last_started_at = None

    # --- across a restart of the scheduler -------------------------------------------

    def to_state(self) -> Dict[str, Any]:
        """The jobs, quotas and time account as JSON-ready fields (the nodes are learnt again from
        their agents' reports)."""
        return {"next_id": self.next_id, "quotas": self.quotas, "accounted_at": self._time.at,
                "jobs": [_job_fields(job) for job in self.jobs.values()]}

    def shape(self) -> Tuple[Any, ...]:
        """What a restart must not lose: the jobs, their states, GPUs and roles, and the quotas (not
        the time accounts, which change every tick)."""
        return (self.next_id, tuple(sorted((self.quotas or {}).items())),
                tuple((j.job_id, j.status, j.gpus, j.stopping, j.suspended_on, j.role, j.share, j.node,
                       j.evictions) for j in self.jobs.values()))

    def restore(self, state: Mapping[str, Any]) -> None:
        """Takes back to_state's jobs, each in the state it was in; their workers are followed again
        from the next reports."""
        jobs = [_job_from_fields(entry) for entry in state.get("jobs", [])]  # all read before any is taken
        self.next_id = max([self.next_id, int(state.get("next_id", 1))] + [job.job_id + 1 for job in jobs])
        if "quotas" in state:  # newer than the ones the scheduler was started with (set_quota)
            self.quotas = dict(state["quotas"]) if state["quotas"] is not None else None
        self._time.at = state.get("accounted_at", self._time.at)
        self.jobs.update((job.job_id, job) for job in jobs)

    # --- accounting ----------------------------------------------------------------

    def advance(self, now: float) -> None:
        self._time.advance(now, self.jobs.values(), lambda job: len(job.gpus) * job.share)

    # --- decisions -----------------------------------------------------------------

    def gpu_keys(self) -> List[GpuKey]:
        return [(node, g.index) for node in sorted(self.nodes) for g in self.nodes[node]]

    def state(self, now: float) -> NodeState:
        keys = self.gpu_keys()
        placed: Dict[GpuKey, List[str]] = {}
        for job in self.jobs.values():
            if job.status == RUNNING:
                for index, key in enumerate(job.gpus):
                    placed.setdefault(key, []).append(worker_name(job.name, index))

        def view(g: Gpu) -> GpuView:
            # Measured before a worker placed on it was running there: the measurement says
            # nothing about that worker, so the policy goes by what the jobs declare.
            stale = g.running is not None and not set(placed.get((g.node, g.index), ())) <= g.running
            return GpuView(node=g.node, gpu_type=g.gpu_type, memory_bytes=g.memory_bytes,
                           free_bytes=None if stale else g.free_bytes, utilization=None if stale else g.utilization)

        gpus = tuple(view(g) for node in sorted(self.nodes) for g in self.nodes[node])
        slot = {key: i for i, key in enumerate(keys)}
        views = tuple(self._view(job, slot) for job in self._schedulable())
        # Workers a shrink is stopping hold their GPUs until they have stopped: a stopping
        # stand-in (negative id) blocks them for the policy.
        views += tuple(JobView(job_id=-job.job_id, num_gpus=len(job.stopping), status=STOPPING,
                               gpus=tuple(slot[g] for g in job.stopping), running_role=job.role)
                       for job in self._schedulable() if job.stopping)
        memories = [g.memory_bytes for g in gpus]
        memory = min(memories) if memories and all(m is not None for m in memories) else None
        return NodeState(now, len(keys), memory, views, gpus=gpus, quotas=self.quotas)

    def _schedulable(self) -> List[ClusterJob]:
        """Unfinished jobs all of whose GPUs a live node reports. The others (on a lost node, or on
        a GPU its node no longer lists) are left alone: out of every plan until their workers exit."""
        live = set(self.nodes)
        present = set(self.gpu_keys())
        return [j for j in self.jobs.values() if j.status not in (FINISHED, FAILED)
                and all(key in present for key in j.gpus + j.stopping)
                and (j.status != SUSPENDED or (j.node in live or j.node is None)
                     and all(key in present for key in j.suspended_on))]

    def _fail_stranded(self, now: float) -> List[ClusterJob]:
        """Fails each suspended job a GPU of which its live node no longer reports: its workers can
        resume only where they are (their CUDA contexts, their memory in that node's host memory),
        so it would wait for that GPU forever. Returns them: their workers are still to be stopped."""
        present = set(self.gpu_keys())
        stranded = [j for j in self.jobs.values() if j.status == SUSPENDED and j.suspended_on
                    and all(node in self.nodes for node, _ in j.suspended_on)
                    and not all(key in present for key in j.suspended_on)]
        for job in stranded:
            gone = ", ".join(f"GPU {index} of node {node}" for node, index in job.suspended_on
                             if (node, index) not in present)
            self.ended(job, now, failed=True, reason=(
                f"{gone} is no longer there, and a suspended job resumes only on the GPUs it was suspended on; "
                "submit it again (from its checkpoint)"))
        return stranded

    def _fits_with_lost_nodes(self, view: JobView) -> bool:
        """Whether a job the live nodes cannot hold fits once the lost nodes are back (their agents
        are started again): it waits rather than failing."""
        if not self.lost:
            return False
        every = [g for gpus in list(self.nodes.values()) + list(self.lost.values()) for g in gpus]
        memories = [g.memory_bytes for g in every]
        memory = max(memories) if all(m is not None for m in memories) else None
        return refusal(view, len(every), memory) is None

    def _view(self, job: ClusterJob, slot: Dict[GpuKey, int]) -> JobView:
        s = job.spec
        running = job.status in (RUNNING, STOPPING)
        # A suspended job comes back on the GPUs its workers stay on (their memory is in that node's
        # host memory, their processes on those devices), with all of them: an elastic job too.
        bound = job.suspended_on if job.status == SUSPENDED else ()
        width = len(job.gpus) if running else len(bound) or s.min_gpus
        return JobView(
            job_id=job.job_id, num_gpus=width, submit_time=job.submitted_at,
            persistent_bytes=s.persistent_bytes, peak_bytes=max(s.peak_bytes, s.persistent_bytes),
            role=OPPORTUNISTIC if s.role == OPPORTUNISTIC else None, status=job.status,
            gpus=tuple(slot[g] for g in job.gpus), share=job.share, running_role=job.role,
            attained_service=job.attained_service, first_started_at=job.first_started_at,
            last_started_at=job.last_started_at, last_stopped_at=job.last_stopped_at, waited_s=job.waited_s,
            marks=dict(job.marks), tenant=s.tenant if s.role == GUARANTEED else None, gpu_type=s.gpu_type,
            node=job.node if job.status == SUSPENDED and not bound else None, speeds=dict(s.speeds),
            bound_gpus=tuple(slot.get(g, -1) for g in bound),
        )

    def decide(self, now: float) -> List[Action]:
        """Asks the policy, then Amoeba's resizing; applies both and returns what the runtime must do."""
        self.advance(now)
        actions = [Action(STOP, job, job.suspended_on) for job in self._fail_stranded(now)]
        keys = self.gpu_keys()
        state = self.state(now)
        if not state.gpu_count:
            return actions
        plan = self.policy.plan(state)
        for job_id, reason in plan.refused.items():
            if self._fits_with_lost_nodes(state.job(job_id)):
                continue  # the policy sees only the live nodes: it waits for a lost one to report again
            self.ended(self.jobs[job_id], now, failed=True, reason=reason)
        for job_id, marks in plan.marks.items():
            self.jobs[job_id].marks = dict(marks)
        for view in state.jobs:
            job = self.jobs.get(view.job_id)
            if job is not None and job.status == RUNNING and job.job_id not in plan.placements:
                job.status = STOPPING
                job.evictions += 1
                actions.append(Action(SUSPEND, job))
        for job_id, placement in plan.placements.items():
            job = self.jobs[job_id]
            gpus = tuple(keys[i] for i in placement.gpus)
            if job.status in (WAITING, SUSPENDED):
                kind = START if job.status == WAITING else RESUME
                if kind == RESUME and sorted(gpus) == sorted(job.suspended_on):
                    gpus = job.suspended_on  # worker i where it was
                job.status, job.gpus, job.last_started_at = RUNNING, gpus, now
                job.role, job.share = placement.role, placement.share
                if job.first_started_at is None:
                    job.first_started_at = now
                actions.append(Action(kind, job, gpus))
            elif job.status == RUNNING:
                if job.role == OPPORTUNISTIC and placement.role == GUARANTEED:
                    actions.append(Action(UPGRADE, job))
                job.role, job.share = placement.role, placement.share
        ranges = {j.job_id: WorkerRange(j.spec.min_gpus, j.spec.max_gpus) for j in self.jobs.values()
                  if j.spec.elastic and not j.stopping}
        for job_id, indices in resize(state, plan, ranges).items():
            job = self.jobs[job_id]
            new = tuple(keys[i] for i in indices)
            if len(new) > len(job.gpus):
                actions.append(Action(GROW, job, new[len(job.gpus):]))
            else:
                job.stopping = job.gpus[len(new):]
                actions.append(Action(SHRINK, job, job.stopping))
            job.gpus = new
        return actions

    # --- status --------------------------------------------------------------------

    def status(self) -> Dict[str, object]:
        nodes = []
        for node, gpus in sorted(list(self.nodes.items()) + [(n, g) for n, g in self.lost.items()]):
            nodes.append({"node": node, "live": node in self.nodes, "gpus": [_gpu_status(g) for g in gpus]})
        jobs = []
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            jobs.append({
                "job_id": job.job_id, "name": job.name, "tenant": job.spec.tenant, "state": job.status,
                "role": job.role or job.spec.role, "asked_role": job.spec.role,
                "gpus": [list(g) for g in job.gpus], "workers": len(job.gpus),
                "range": [job.spec.min_gpus, job.spec.max_gpus], "gpu_type": job.spec.gpu_type,
                "launcher": job.spec.launcher,
                "node": job.node, "evictions": job.evictions, "reason": job.reason,
                "attained_gpu_s": round(job.attained_service, 3), "waited_s": round(job.waited_s, 3),
            })
        return {"nodes": nodes, "jobs": jobs, "quotas": self.quotas}


def _gpu_status(gpu: Gpu) -> Dict[str, object]:
    fields = dict(gpu.__dict__)
    if gpu.running is not None:
        fields["running"] = sorted(gpu.running)
    return fields


_GPU_KEY_FIELDS = ("gpus", "stopping", "suspended_on")


def _job_fields(job: ClusterJob) -> Dict[str, Any]:
    values = asdict(job)
    values["spec"] = {**values["spec"], "command": list(job.spec.command)}
    for name in _GPU_KEY_FIELDS:
        values[name] = [list(key) for key in getattr(job, name)]
    return values


def _job_from_fields(entry: Mapping[str, Any]) -> ClusterJob:
    spec_names = {f.name for f in fields(JobSpec)}
    spec = {k: v for k, v in entry["spec"].items() if k in spec_names}
    spec["command"] = tuple(spec["command"])
    values = {k: v for k, v in entry.items() if k in {f.name for f in fields(ClusterJob)}}
    values["spec"] = JobSpec(**spec)
    for name in _GPU_KEY_FIELDS:
        values[name] = tuple((str(node), int(index)) for node, index in values.get(name, ()))
    return ClusterJob(**values)
