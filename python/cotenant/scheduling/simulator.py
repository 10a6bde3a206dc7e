"""A discrete-event simulator of one node, driving the real policy objects.

The clock is virtual: it jumps from event to event (a job arrives, finishes,
reaches the iteration boundary where it was told to stop, finishes moving its
memory, or a policy asked to be woken). At every event the simulator hands
the policy a `NodeState` and applies the `Plan` it returns, the same objects
and calls the coordinator's queue uses; nothing here decides who runs.

The model of a job:
  * it needs `duration_s` seconds of work alone on its GPUs; packed next to a
    guaranteed job it progresses at the compute share the policy gave it
    (a guaranteed job keeps full speed: the launch gate protects it);
  * a preempted job runs on to its next iteration boundary (Gandiva's
    switching point, where only persistent memory is live), then its
    persistent memory moves to the host (`persistent_bytes / bandwidth`,
    every GPU over its own link, in parallel) and its GPUs are free; it
    resumes on those same GPUs (its processes stay there), first moves the
    memory back, then computes. Those copies are the only cost of a
    preemption: cotenant keeps the addresses, so there is no checkpoint and
    no restart;
  * attained service is GPU-seconds times the compute share, counted while the
    job computes.

A cluster (cotenant.cluster.simulate) is the same simulation over every GPU
of every node: `SimulationConfig.gpus` says each GPU's node and type, and
`speed(job, gpu_type)` how fast a job runs on a type relative to the trace's
duration (a gang job runs at the pace of its slowest GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from cotenant.scheduling.admission import fits_together
from cotenant.scheduling.state import (
    GUARANTEED, RUNNING, STOPPING, SUSPENDED, WAITING, GpuView, JobView, NodeState, Plan,
)
from cotenant.scheduling.trace import TraceJob

GiB = 1 << 30
_EPS = 1e-9
_WORK_TOLERANCE_S = 1e-6
_MAX_PLANS_PER_INSTANT = 16  # applying a plan frees or fills GPUs; the policy is asked again until it settles


class SimulationError(RuntimeError):
    """The policy asked for something impossible, or the simulation cannot progress."""


@dataclass(frozen=True)
class SimulationConfig:
    gpu_count: int
    gpu_memory_bytes: Optional[int] = 80 * GiB
    # Host <-> device bytes per second per GPU for suspend and resume. Default: the pinned
    # cudaMemcpy rate measured on an H100 (PCIe 5.0 x16) by benchmarks/bench_allocator.py.
    pcie_bytes_per_s: float = 54e9
    default_utilization: float = 1.0  # for trace jobs that give none
    gpus: Tuple[GpuView, ...] = ()    # a cluster: each GPU's node and type (gpu_count of them)
    speed: Optional[Callable[[TraceJob, str], float]] = None  # relative speed on a GPU type (default 1)

    def __post_init__(self) -> None:
        if self.gpus and len(self.gpus) != self.gpu_count:
            raise ValueError(f"gpus describes {len(self.gpus)} GPUs and gpu_count is {self.gpu_count}")
        if self.gpu_count < 1:
            raise ValueError(f"a node needs at least 1 GPU, not {self.gpu_count}")
        if not self.pcie_bytes_per_s > 0:
            raise ValueError(f"the PCIe bandwidth must be positive, not {self.pcie_bytes_per_s}")
        if not 0 < self.default_utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], not {self.default_utilization}")


@dataclass
class _Job:
    spec: TraceJob
    utilization: float
    status: str = WAITING
    gpus: tuple = ()
    share: float = 1.0
    running_role: Optional[str] = None
    done_s: float = 0.0               # solo seconds of work done
    attained: float = 0.0             # GPU-seconds x share
    first_started_at: Optional[float] = None
    last_started_at: Optional[float] = None
    last_stopped_at: Optional[float] = None
    waited_s: float = 0.0
    computes_from: float = 0.0        # a resume's copy ends here
    boundary_at: float = math.inf     # STOPPING: reaches its iteration boundary
    released_at: float = math.inf     # STOPPING: its memory is on the host, its GPUs free
    finished_at: Optional[float] = None
    preemptions: int = 0
    suspended_on: Tuple[int, ...] = ()  # SUSPENDED: its processes stay on these GPUs, it resumes there
    bytes_moved: int = 0
    switch_s: float = 0.0
    marks: Dict[str, float] = field(default_factory=dict)

    @property
    def job_id(self) -> int:
        return self.spec.job_id

    speed: float = 1.0                # on the GPUs it holds, relative to the trace's duration
    speeds: Dict[str, float] = field(default_factory=dict)  # per GPU type of the cluster

    def view(self) -> JobView:
        s = self.spec
        return JobView(
            job_id=s.job_id, num_gpus=s.num_gpus, submit_time=s.submit_time, persistent_bytes=s.persistent_bytes,
            peak_bytes=s.peak_bytes, role=s.role, utilization=self.utilization, status=self.status,
            gpus=self.gpus, share=self.share, running_role=self.running_role, attained_service=self.attained,
            first_started_at=self.first_started_at, last_started_at=self.last_started_at,
            last_stopped_at=self.last_stopped_at, waited_s=self.waited_s, marks=dict(self.marks),
            speeds=self.speeds, remaining_s=max(0.0, s.duration_s - self.done_s),
            bound_gpus=self.suspended_on if self.status == SUSPENDED else (),
        )

    def computing_until(self, t: float) -> float:
        return min(t, self.boundary_at) if self.status == STOPPING else t

    def rate(self) -> float:
        """Solo seconds of work done per second."""
        return self.share * self.speed if self.status in (RUNNING, STOPPING) else 0.0


@dataclass
class JobResult:
    job_id: int
    num_gpus: int
    submit_time: float
    first_started_at: Optional[float]
    finished_at: Optional[float]
    preemptions: int
    bytes_moved: int
    refused: str = ""

    @property
    def jct_s(self) -> Optional[float]:
        return None if self.finished_at is None else self.finished_at - self.submit_time

    @property
    def queueing_s(self) -> Optional[float]:
        return None if self.first_started_at is None else self.first_started_at - self.submit_time


@dataclass
class SimulationResult:
    policy: str
    gpu_count: int
    jobs: List[JobResult]
    held_gpu_s: float      # GPU-seconds some job held a GPU
    busy_gpu_s: float      # GPU-seconds of computation (utilization x share)
    switch_s: float        # seconds spent moving memory for suspend and resume
    plans: int             # policy decisions asked for

    def summary(self) -> Dict[str, object]:
        finished = [j for j in self.jobs if j.finished_at is not None]
        jcts = sorted(j.jct_s for j in finished)
        queueing = [j.queueing_s for j in finished]
        start = min((j.submit_time for j in finished), default=0.0)
        end = max((j.finished_at for j in finished), default=0.0)
        makespan = end - start
        capacity = self.gpu_count * makespan
        return {
            "policy": self.policy, "gpus": self.gpu_count, "jobs": len(finished),
            "refused": sorted(j.job_id for j in self.jobs if j.refused),
            "avg_jct_s": _mean(jcts), "median_jct_s": _percentile(jcts, 50), "p95_jct_s": _percentile(jcts, 95),
            "makespan_s": makespan, "avg_queueing_s": _mean(queueing),
            "gpu_time_utilization": self.held_gpu_s / capacity if capacity else 0.0,
            "compute_utilization": self.busy_gpu_s / capacity if capacity else 0.0,
            "preemptions": sum(j.preemptions for j in self.jobs),
            "bytes_moved": sum(j.bytes_moved for j in self.jobs), "switch_s": self.switch_s,
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class Simulator:
    def __init__(self, trace: Sequence[TraceJob], policy, config: SimulationConfig) -> None:
        self.policy = policy
        self.config = config
        types = sorted({g.gpu_type for g in config.gpus})
        self.pending = sorted(
            (_Job(spec, spec.utilization if spec.utilization is not None else config.default_utilization,
                  speeds={t: self._speed(spec, t) for t in types} if len(types) > 1 else {})
             for spec in trace), key=lambda j: (j.spec.submit_time, j.job_id))
        self.active: Dict[int, _Job] = {}
        self.done: List[_Job] = []
        self.refused: Dict[int, str] = {}
        self.now = 0.0
        self.wake_at: Optional[float] = None
        self.held_gpu_s = 0.0
        self.busy_gpu_s = 0.0
        self.switch_s = 0.0
        self.plans = 0

    def _speed(self, spec: TraceJob, gpu_type: str) -> float:
        speed = 1.0 if self.config.speed is None else self.config.speed(spec, gpu_type)
        if not speed > 0:
            raise SimulationError(f"job {spec.job_id} has speed {speed} on GPU type {gpu_type!r}; it must be > 0")
        return speed

    # --- the event loop ------------------------------------------------------------

    def run(self) -> SimulationResult:
        if self.pending:
            self.now = self.pending[0].spec.submit_time
        while self.pending or self.active:
            self._handle_events()
            self._decide()
            if not self.pending and not self.active:
                break
            upcoming = self._next_event()
            if upcoming is None:
                stuck = ", ".join(str(j) for j in sorted(self.active))
                raise SimulationError(f"policy {self.policy.name!r} leaves jobs {stuck} waiting with nothing "
                                      "running and nothing to wait for")
            self._advance(upcoming)
        return self._result()

    def _handle_events(self) -> None:
        while self.pending and self.pending[0].spec.submit_time <= self.now + _EPS:
            job = self.pending.pop(0)
            self.active[job.job_id] = job
        for job in list(self.active.values()):
            if job.status in (RUNNING, STOPPING) and job.done_s >= job.spec.duration_s - _WORK_TOLERANCE_S:
                job.finished_at = self.now
                job.status = "finished"
                self.done.append(self.active.pop(job.job_id))
            elif job.status == STOPPING and job.released_at <= self.now + _EPS:
                job.bytes_moved += job.spec.persistent_bytes * job.spec.num_gpus
                self.switch_s += job.released_at - job.boundary_at
                job.status = SUSPENDED
                job.suspended_on, job.gpus = job.gpus, ()
                job.running_role = None
                job.last_stopped_at = self.now

    def _state(self) -> NodeState:
        return NodeState(self.now, self.config.gpu_count, self.config.gpu_memory_bytes,
                         tuple(j.view() for j in self.active.values()), gpus=self.config.gpus)

    def _decide(self) -> None:
        self.wake_at = None
        for _ in range(_MAX_PLANS_PER_INSTANT):
            plan = self.policy.plan(self._state())
            self.plans += 1
            changed = self._apply(plan)
            self.wake_at = plan.wake_at
            if not changed:
                return
            self._handle_events()  # a job stopped at a boundary with nothing to copy is gone at once
        raise SimulationError(f"policy {self.policy.name!r} did not settle at t={self.now:.3f} s: every plan "
                              "changes what the previous one decided")

    def _apply(self, plan: Plan) -> bool:
        changed = False
        for job_id, reason in plan.refused.items():
            job = self.active.pop(job_id, None)
            if job is not None:
                self.refused[job_id] = reason
                self.done.append(job)
                changed = True
        for job_id, marks in plan.marks.items():
            if job_id in self.active:
                self.active[job_id].marks = dict(marks)
        for job in self.active.values():
            if job.status == RUNNING and job.job_id not in plan.placements:
                self._stop(job)
                changed = True
        for job_id, placement in plan.placements.items():
            job = self.active[job_id]
            if job.status == RUNNING:
                if tuple(placement.gpus) != tuple(job.gpus):
                    raise SimulationError(f"policy {self.policy.name!r} moved running job {job_id} from GPUs "
                                          f"{job.gpus} to {placement.gpus}; running jobs stay where they are")
                if (placement.share, placement.role) != (job.share, job.running_role):
                    job.share, job.running_role = placement.share, placement.role
                    changed = True
            elif job.status in (WAITING, SUSPENDED):
                if job.status == SUSPENDED and sorted(placement.gpus) != sorted(job.suspended_on):
                    raise SimulationError(f"policy {self.policy.name!r} resumed job {job_id} on GPUs "
                                          f"{tuple(placement.gpus)}; it was suspended on {job.suspended_on}, where "
                                          "its processes and their memory stay, so it resumes there")
                self._start(job, placement)
                changed = True
            else:
                raise SimulationError(f"policy {self.policy.name!r} placed job {job_id}, which is {job.status}")
        self._check_gpus()
        return changed

    def _start(self, job: _Job, placement) -> None:
        job.gpus, job.share, job.running_role = tuple(placement.gpus), placement.share, placement.role
        if self.config.gpus:
            job.speed = min(self._speed(job.spec, self.config.gpus[g].gpu_type) for g in job.gpus)
        copy_s = 0.0
        if job.status == SUSPENDED:
            copy_s = job.spec.persistent_bytes / self.config.pcie_bytes_per_s
            job.bytes_moved += job.spec.persistent_bytes * job.spec.num_gpus
            self.switch_s += copy_s
        job.status = RUNNING
        job.computes_from = self.now + copy_s
        job.boundary_at = job.released_at = math.inf
        if job.first_started_at is None:
            job.first_started_at = self.now
        job.last_started_at = self.now

    def _stop(self, job: _Job) -> None:
        """Runs on to its iteration boundary, then moves its persistent memory to the host."""
        job.preemptions += 1
        start = max(self.now, job.computes_from)
        rate = job.rate()
        iteration = job.spec.iteration_s
        into = math.fmod(job.done_s, iteration)
        to_boundary = 0.0 if into < _WORK_TOLERANCE_S or iteration - into < _WORK_TOLERANCE_S or rate <= 0 \
            else (iteration - into) / rate
        job.boundary_at = start + to_boundary
        job.released_at = job.boundary_at + job.spec.persistent_bytes / self.config.pcie_bytes_per_s
        job.status = STOPPING

    def _check_gpus(self) -> None:
        """Every GPU's residents satisfy Salus' condition, with at most one guaranteed job."""
        per_gpu: Dict[int, List[_Job]] = {}
        for job in self.active.values():
            if job.status in (RUNNING, STOPPING):
                for gpu in job.gpus:
                    if not 0 <= gpu < self.config.gpu_count:
                        raise SimulationError(f"policy {self.policy.name!r} placed job {job.job_id} on GPU {gpu}, "
                                              f"which this node of {self.config.gpu_count} GPUs does not have")
                    per_gpu.setdefault(gpu, []).append(job)
        for gpu, jobs in per_gpu.items():
            guaranteed = [j.job_id for j in jobs if j.running_role == GUARANTEED]
            if len(guaranteed) > 1:
                raise SimulationError(f"policy {self.policy.name!r} put guaranteed jobs {guaranteed} on GPU {gpu}")
            if not fits_together([j.view() for j in jobs], self.config.gpu_memory_bytes):
                raise SimulationError(f"policy {self.policy.name!r} put jobs {[j.job_id for j in jobs]} on GPU "
                                      f"{gpu}, which do not fit together (Salus' condition)")

    def _next_event(self) -> Optional[float]:
        times = []
        if self.pending:
            times.append(self.pending[0].spec.submit_time)
        for job in self.active.values():
            if job.status in (RUNNING, STOPPING):
                rate = job.rate()
                start = max(self.now, job.computes_from)
                if rate > 0:
                    finish = start + (job.spec.duration_s - job.done_s) / rate
                    if job.status == RUNNING or finish <= job.boundary_at:
                        times.append(finish)
                if job.status == STOPPING:
                    times.append(job.released_at)
        if self.wake_at is not None:
            times.append(self.wake_at)
        future = [t for t in times if t > self.now + _EPS]
        return min(future) if future else None

    def _advance(self, until: float) -> None:
        span = until - self.now
        occupied = set()
        for job in self.active.values():
            if job.status in (WAITING, SUSPENDED):
                job.waited_s += span
                continue
            occupied.update(job.gpus)
            begin = max(self.now, job.computes_from)
            end = job.computing_until(until)
            computing = max(0.0, end - begin)
            work = min(computing * job.rate(), job.spec.duration_s - job.done_s)
            job.done_s += work
            if job.rate() > 0:
                held = work / job.speed  # seconds x share
                job.attained += job.spec.num_gpus * held
                self.busy_gpu_s += job.spec.num_gpus * job.utilization * held
        self.held_gpu_s += len(occupied) * span
        self.now = until

    def _result(self) -> SimulationResult:
        jobs = [
            JobResult(job_id=j.job_id, num_gpus=j.spec.num_gpus, submit_time=j.spec.submit_time,
                      first_started_at=j.first_started_at, finished_at=j.finished_at, preemptions=j.preemptions,
                      bytes_moved=j.bytes_moved, refused=self.refused.get(j.job_id, ""))
            for j in sorted(self.done, key=lambda j: j.job_id)
        ]
        return SimulationResult(self.policy.name, self.config.gpu_count, jobs, self.held_gpu_s, self.busy_gpu_s,
                                self.switch_s, self.plans)


def simulate(trace: Sequence[TraceJob], policy, config: SimulationConfig) -> SimulationResult:
    return Simulator(trace, policy, config).run()
