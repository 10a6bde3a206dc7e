"""The coordinator's job queue: who waits, who runs, who is suspended, by a scheduling policy.

A queued job is a process (`cotenant run --queue`, or the waiter `cotenant
submit` leaves behind) that asked the coordinator for GPUs and waits. The
queue hands the policy (cotenant.scheduling.policies, the same objects the
simulator drives) a NodeState of every queued job and turns the Plan into
actions the daemon carries out:

  admit    a waiting job may start: its process, which polls, execs the program
           on the GPUs and in the role the plan gives;
  suspend  a running job leaves its GPUs: the daemon sends the registered job the
           suspend command (its memory moves to the host at the same addresses);
  resume   a suspended job comes back: the resume command;
  refuse   a job that can never fit: its process is told why.

No I/O and no clock here (the daemon passes `now`, in seconds), so the state
machine is tested without a daemon. Invariants: a ticket is in exactly one
state; a STOPPING job holds its GPUs until the daemon reports it suspended
(`stopped`); a finished or cancelled job is gone from the queue.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cotenant.scheduling.state import (
    RUNNING, STOPPING, SUSPENDED, WAITING, JobView, NodeState, Plan, TimeAccount,
)

ADMIT = "admit"
SUSPEND = "suspend"
RESUME = "resume"
REFUSE = "refuse"


@dataclass
class QueuedJob:
    ticket: int
    name: str
    pid: int
    uid: int
    role: Optional[str]
    num_gpus: int
    persistent_bytes: int
    peak_bytes: int
    submitted_at: float
    status: str = WAITING
    gpus: Tuple[int, ...] = ()          # physical GPU indices while it holds them
    running_role: Optional[str] = None
    share: float = 1.0
    attained_service: float = 0.0       # GPU-seconds x share
    first_started_at: Optional[float] = None
    last_started_at: Optional[float] = None
    last_stopped_at: Optional[float] = None
    waited_s: float = 0.0
    marks: Dict[str, float] = field(default_factory=dict)
    refused: str = ""
    suspensions: int = 0
    suspended_on: Tuple[int, ...] = ()  # the GPUs a suspended job's process stays on: it resumes there
    pid_start_ticks: int = 0            # with pid, names the process for good (a restart checks it)


@dataclass(frozen=True)
class Action:
    kind: str
    job: QueuedJob
    reason: str = ""


class JobQueue:
    def __init__(self, policy) -> None:
        self.policy = policy
        self.jobs: Dict[int, QueuedJob] = {}
        self.next_ticket = 1
        self.last_plan: Optional[Plan] = None
        # ticket -> the GPUs a suspended job is bound to that the node does not schedule (any more): it
        # resumes only on them, so it waits until they are back (as of the last decision)
        self.stranded: Dict[int, Tuple[int, ...]] = {}
        self._time = TimeAccount()

    # --- membership -----------------------------------------------------------------

    def submit(self, now: float, name: str, pid: int, uid: int, role: Optional[str] = None, num_gpus: int = 1,
               persistent_bytes: int = 0, peak_bytes: int = 0, pid_start_ticks: int = 0) -> QueuedJob:
        self.advance(now)
        job = QueuedJob(ticket=self.next_ticket, name=name, pid=pid, uid=uid, role=role, num_gpus=num_gpus,
                        persistent_bytes=persistent_bytes, peak_bytes=max(peak_bytes, persistent_bytes),
                        submitted_at=now, pid_start_ticks=pid_start_ticks)
        self.next_ticket += 1
        self.jobs[job.ticket] = job
        return job

    # --- across a restart of the daemon ----------------------------------------------

    def to_state(self) -> Dict[str, Any]:
        """Every queued job as JSON-ready fields, for the daemon's durable state."""
        return {"next_ticket": self.next_ticket,
                "jobs": [{**asdict(job), "gpus": list(job.gpus), "suspended_on": list(job.suspended_on)}
                         for job in self.jobs.values()]}

    def shape(self) -> Tuple[Any, ...]:
        """What a restart must not lose: the tickets, their states and GPUs (not the time accounts,
        which change every tick; a restart loses at most the accounting since the last change)."""
        return (self.next_ticket, tuple((j.ticket, j.status, j.gpus, j.suspended_on, j.running_role, j.share,
                                         j.suspensions) for j in self.jobs.values()))

    def restore(self, state: Dict[str, Any], alive: Callable[[QueuedJob], bool]) -> List[QueuedJob]:
        """Takes back the jobs of `state` (to_state's) whose process `alive` accepts, each as it was:
        waiting, running, stopping or suspended where it was. Returns the ones left out."""
        known = {f.name for f in fields(QueuedJob)}
        self.next_ticket = max(self.next_ticket, int(state.get("next_ticket", 1)))
        dropped = []
        for entry in state.get("jobs", []):
            values = {k: v for k, v in entry.items() if k in known}
            values["gpus"] = tuple(values.get("gpus", ()))
            values["suspended_on"] = tuple(values.get("suspended_on", ()))
            job = QueuedJob(**values)
            if alive(job):
                self.jobs[job.ticket] = job
                self.next_ticket = max(self.next_ticket, job.ticket + 1)
            else:
                dropped.append(job)
        return dropped

    def remove(self, ticket: int) -> Optional[QueuedJob]:
        """A job that finished, exited or was cancelled; its GPUs are free at the next decision."""
        return self.jobs.pop(ticket, None)

    def find(self, ref: str) -> Optional[QueuedJob]:
        for job in self.jobs.values():
            if job.name == ref or str(job.ticket) == ref:
                return job
        return None

    def by_pid(self, pid: int) -> Optional[QueuedJob]:
        for job in self.jobs.values():
            if job.pid == pid:
                return job
        return None

    def stopped(self, ticket: int, now: float) -> None:
        """The daemon saw the job report itself suspended: its GPUs are free."""
        job = self.jobs.get(ticket)
        if job is not None and job.status == STOPPING:
            self.advance(now)
            job.suspended_on = job.gpus
            job.status, job.gpus, job.running_role, job.last_stopped_at = SUSPENDED, (), None, now

    # --- accounting -----------------------------------------------------------------

    def advance(self, now: float, shares: Optional[Dict[int, float]] = None) -> None:
        """Accounts the time since the last call: service while running, waiting while not.
        shares: the compute share each running job actually had (default: its planned share)."""
        self._time.advance(now, self.jobs.values(),
                           lambda job: job.num_gpus * (shares or {}).get(job.ticket, job.share))

    # --- decisions ------------------------------------------------------------------

    def decide(self, now: float, gpus: Sequence[int], gpu_memory_bytes: Optional[int]) -> List[Action]:
        """Asks the policy and applies its plan; returns what the daemon must do."""
        self.advance(now)
        slot = {gpu: i for i, gpu in enumerate(gpus)}  # the policy numbers GPUs 0..n-1
        self.stranded = {job.ticket: missing for job in self.jobs.values() if job.status == SUSPENDED
                         for missing in [tuple(g for g in job.suspended_on if g not in slot)] if missing}
        # Out of the plan: a job on GPUs the node does not schedule (it runs on, or waits for them to
        # come back; in no policy's order does it hold up the others).
        views = tuple(self._view(job, slot) for job in self.jobs.values()
                      if all(g in slot for g in job.gpus) and job.ticket not in self.stranded)
        plan = self.policy.plan(NodeState(now, len(gpus), gpu_memory_bytes, views))
        self.last_plan = plan
        actions: List[Action] = []
        for ticket, reason in plan.refused.items():
            job = self.jobs.pop(ticket, None)
            if job is not None:
                job.refused = reason
                actions.append(Action(REFUSE, job, reason))
        for ticket, marks in plan.marks.items():
            if ticket in self.jobs:
                self.jobs[ticket].marks = dict(marks)
        planned = {view.job_id for view in views}
        for job in self.jobs.values():
            if job.status == RUNNING and job.ticket in planned and job.ticket not in plan.placements:
                job.status = STOPPING
                job.suspensions += 1
                actions.append(Action(SUSPEND, job))
        for ticket, placement in plan.placements.items():
            job = self.jobs[ticket]
            physical = tuple(gpus[i] for i in placement.gpus)
            job.share, job.running_role = placement.share, placement.role
            if job.status in (WAITING, SUSPENDED):
                kind = ADMIT if job.status == WAITING else RESUME
                job.status, job.gpus, job.last_started_at = RUNNING, physical, now
                if job.first_started_at is None:
                    job.first_started_at = now
                actions.append(Action(kind, job))
        return actions

    def _view(self, job: QueuedJob, slot: Dict[int, int]) -> JobView:
        return JobView(
            job_id=job.ticket, num_gpus=job.num_gpus, submit_time=job.submitted_at,
            persistent_bytes=job.persistent_bytes, peak_bytes=job.peak_bytes, role=job.role, status=job.status,
            gpus=tuple(slot[g] for g in job.gpus), share=job.share, running_role=job.running_role,
            attained_service=job.attained_service, first_started_at=job.first_started_at,
            last_started_at=job.last_started_at, last_stopped_at=job.last_stopped_at, waited_s=job.waited_s,
            marks=dict(job.marks),
            bound_gpus=tuple(slot.get(g, -1) for g in job.suspended_on) if job.status == SUSPENDED else (),
        )

    def wake_at(self) -> Optional[float]:
        return self.last_plan.wake_at if self.last_plan is not None else None

    # --- status ---------------------------------------------------------------------

    def status(self) -> List[Dict[str, object]]:
        """Every queued job, with its position among the waiting (1 = next) and its priority level."""
        plan = self.last_plan
        waiting = list(plan.waiting) if plan else []
        priorities = dict(plan.priorities) if plan else {}
        rows = []
        for job in sorted(self.jobs.values(), key=lambda j: j.ticket):
            position = waiting.index(job.ticket) + 1 if job.ticket in waiting else None
            rows.append({
                "ticket": job.ticket, "name": job.name, "pid": job.pid, "uid": job.uid, "state": job.status,
                "position": position, "priority": priorities.get(job.ticket), "gpus": list(job.gpus),
                "num_gpus": job.num_gpus, "role": job.running_role or job.role,
                "attained_gpu_s": round(job.attained_service, 3), "waited_s": round(job.waited_s, 3),
                "suspensions": job.suspensions, "missing_gpus": list(self.stranded.get(job.ticket, ())),
            })
        return rows
