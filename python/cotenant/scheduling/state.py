"""What a scheduling policy sees and what it decides.

A policy is a pure function from a `NodeState` to a `Plan`: no I/O, no
clock (the state carries `now`), no memory of its own between calls. What a
policy must remember between decisions (Tiresias' promotions) it returns in
`Plan.marks` and gets back in the next state's `JobView.marks`. The host that
applies plans, the discrete-event simulator or the coordinator's queue, keeps
the accounting every policy reads: attained service, when a job last started
and stopped, how long it has waited.

The same policies schedule a cluster (cotenant.cluster): the state then
lists every GPU of every node in `NodeState.gpus` (its node, type and what the
node's agent measured), jobs carry a tenant and may be bound to a GPU type or
a node, and tenants have guaranteed-GPU quotas. A node's own state leaves all
of that empty and nothing changes for it.

Units: seconds for times, bytes for memory (per GPU), GPU-seconds for service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Tuple

from cotenant.coordinator.policy import GUARANTEED, OPPORTUNISTIC

# A job's life, as a policy sees it.
WAITING = "waiting"      # submitted, never started
RUNNING = "running"      # holds its GPUs and computes
STOPPING = "stopping"    # told to stop: runs to its iteration boundary, then its memory moves to the host;
                         # it still holds its GPUs and the policy cannot place anything there yet
SUSPENDED = "suspended"  # ran before; its memory is on the host and it holds no GPU

ROLES = (GUARANTEED, OPPORTUNISTIC)



class TimeAccount:
    """Accounts the time between calls, for a queue of jobs: waiting time
    while a job waits or is suspended, attained service (GPU-seconds at its
    share) while it runs. One rule for the node's queue and the cluster's."""

    def __init__(self) -> None:
        self.at: Optional[float] = None  # accounted up to this time; kept across a restart

    def advance(self, now: float, jobs: Iterable[Any], service_rate: Callable[[Any], float]) -> None:
        """service_rate(job): GPUs times compute share of a running job."""
        if self.at is None:
            self.at = now
        span = max(0.0, now - self.at)
        self.at = now
        for job in jobs:
            if job.status in (WAITING, SUSPENDED):
                job.waited_s += span
            elif job.status in (RUNNING, STOPPING):
                job.attained_service += span * service_rate(job)

@dataclass(frozen=True)
class JobView:
    """One job of the node, as the host accounts for it."""

    job_id: int
    num_gpus: int = 1
    submit_time: float = 0.0
    persistent_bytes: int = 0   # per GPU: parameters, optimizer state; what a suspend moves
    peak_bytes: int = 0         # per GPU: persistent plus the largest ephemeral working set
    role: Optional[str] = None  # None: the policy decides (AntMan: guaranteed once GPUs are free for it)
    utilization: float = 1.0    # the fraction of time it keeps its GPUs busy when alone, in (0, 1]
    status: str = WAITING
    gpus: Tuple[int, ...] = ()  # the GPUs it holds (RUNNING, STOPPING)
    share: float = 1.0          # compute share it runs at now: 1 alone, less packed next to a guaranteed job
    running_role: Optional[str] = None  # the role it runs in now (RUNNING, STOPPING)
    attained_service: float = 0.0       # GPU-seconds x the compute share it actually had
    first_started_at: Optional[float] = None
    last_started_at: Optional[float] = None
    last_stopped_at: Optional[float] = None
    waited_s: float = 0.0       # total time WAITING or SUSPENDED since submission
    marks: Mapping[str, float] = field(default_factory=dict)
    tenant: Optional[str] = None    # whose quota a guaranteed run counts against (None: no quota applies)
    gpu_type: Optional[str] = None  # runs only on GPUs of this type (None: any)
    node: Optional[str] = None      # runs only on this node (a suspended job's memory is in its host memory)
    bound_gpus: Tuple[int, ...] = ()  # resumes only on these (a suspended job's processes stay on their GPUs)
    speeds: Mapping[str, float] = field(default_factory=dict)  # relative throughput per GPU type (AlloX)
    remaining_s: Optional[float] = None  # estimated solo seconds of work left; None: unknown

    @property
    def ephemeral_bytes(self) -> int:
        return max(0, self.peak_bytes - self.persistent_bytes)

    @property
    def runnable(self) -> bool:
        """Whether a plan may place it (a STOPPING job must finish stopping first)."""
        return self.status in (WAITING, SUSPENDED, RUNNING)

    @property
    def waited_since_first_run_s(self) -> float:
        """Time spent waiting after its first start (Tiresias' pending time that counts toward starvation)."""
        if self.first_started_at is None:
            return 0.0
        return max(0.0, self.waited_s - (self.first_started_at - self.submit_time))


@dataclass(frozen=True)
class GpuView:
    """One GPU of a cluster, as its node's agent reports it (all optional)."""

    node: str = ""                       # GPUs of one node share fast links: a gang job prefers one node
    gpu_type: str = ""
    memory_bytes: Optional[int] = None   # its total memory; None: NodeState.gpu_memory_bytes
    free_bytes: Optional[int] = None     # measured free device memory
    utilization: Optional[float] = None  # measured busy fraction in [0, 1]


@dataclass(frozen=True)
class NodeState:
    now: float
    gpu_count: int
    gpu_memory_bytes: Optional[int]  # per GPU; None: unknown, memory is not checked
    jobs: Tuple[JobView, ...]        # every unfinished job; order does not matter
    gpus: Tuple[GpuView, ...] = ()   # per GPU, indexed like the plan's GPUs; empty: one node, one type
    quotas: Optional[Mapping[str, int]] = None  # tenant -> GPUs it may hold as guaranteed; None: no quotas

    def gpu(self, index: int) -> GpuView:
        return self.gpus[index] if self.gpus else _ONE_NODE_GPU

    def job(self, job_id: int) -> JobView:
        for job in self.jobs:
            if job.job_id == job_id:
                return job
        raise KeyError(job_id)


_ONE_NODE_GPU = GpuView()


@dataclass(frozen=True)
class Placement:
    gpus: Tuple[int, ...]
    share: float = 1.0
    role: str = GUARANTEED


@dataclass(frozen=True)
class Plan:
    """What should run from now on.

    A RUNNING job absent from `placements` is to be suspended (at its next
    iteration boundary). A placed job keeps the GPUs it holds: policies never
    move a running job. `waiting` lists the runnable jobs not placed, in the
    order the policy would start them; `priorities` gives every runnable job's
    priority level (0 = the highest) for `cotenant status`.
    """

    placements: Mapping[int, Placement]
    waiting: Tuple[int, ...] = ()
    priorities: Mapping[int, int] = field(default_factory=dict)
    refused: Mapping[int, str] = field(default_factory=dict)
    marks: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    wake_at: Optional[float] = None  # ask again at this time even if nothing else happens
