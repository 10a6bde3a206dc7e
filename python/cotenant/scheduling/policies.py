"""The node's scheduling policies, each a pure function `plan(NodeState) -> Plan`.

Every policy first applies Salus' admission (admission.py): a job that can
never fit is refused, and no GPU is ever given jobs that do not fit
together. Then:

  * `Fifo`: jobs start in submission order, each on GPUs of its own; the
    first that does not fit blocks the ones behind it (YARN's capacity
    scheduler, the baseline Tiresias compares against). Never preempts.
  * `DiscretizedLas`: Tiresias' discretized two-dimensional least attained
    service. A job's attained service is its GPU-seconds times the compute
    share it actually had; thresholds on it split jobs into priority queues
    (queue k holds the jobs whose service since their last promotion passed
    k thresholds). Queues are served in order; inside a queue, running jobs
    first, then by submission, skipping jobs that do not fit. A running job
    that no longer makes the cut is preempted (suspended: its memory goes to
    the host at the same addresses). Starvation limit: a job in a lower
    queue that has waited, since it last ran, `starvation_factor` times the
    service it got since its last promotion goes back to queue 0.
  * `TimeSlicing`: Gandiva's. While every job fits, every job runs. When
    some do not, jobs take turns in round-robin quanta: a running job whose
    quantum has expired yields to the job that has waited longest, at its
    next iteration boundary, by suspend and resume.
  * `Packing`: AntMan's. Guaranteed jobs start in submission order on GPUs no
    other guaranteed job holds, and run at full speed. Opportunistic jobs (by
    role, or jobs still waiting for a guaranteed place) run meanwhile on an
    idle GPU, or packed next to a guaranteed job whose memory they fit beside,
    at the compute share it leaves idle (the launch gate's idle slots), on
    the GPUs with the most spare compute, then memory. With tenant quotas
    (a cluster), a tenant's guaranteed jobs hold at most its quota of GPUs;
    its jobs beyond that run as opportunistic and are upgraded in place
    when its quota frees up.

The policies never move a running job to other GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple

from cotenant.scheduling.admission import GpuBook, refusals
from cotenant.scheduling.state import (
    GUARANTEED, OPPORTUNISTIC, RUNNING, JobView, NodeState, Placement, Plan,
)


def _submission_order(jobs: Sequence[JobView]) -> List[JobView]:
    return sorted(jobs, key=lambda j: (j.submit_time, j.job_id))


def _eligible(state: NodeState, refused: Dict[int, str]) -> List[JobView]:
    return [j for j in state.jobs if j.runnable and j.job_id not in refused]


def _start(book: GpuBook, job: JobView, placements: Dict[int, Placement], waiting: List[int]) -> None:
    """Keeps a running job where it is, or starts a selected one on free GPUs (or leaves it waiting
    until the GPUs it was counted on have been given back)."""
    if job.status == RUNNING:
        placements[job.job_id] = Placement(job.gpus, 1.0, GUARANTEED)
        return
    gpus = book.take_empty(job)
    if gpus is None:
        waiting.append(job.job_id)
    else:
        placements[job.job_id] = Placement(gpus, 1.0, GUARANTEED)


def _own_gpus(job: JobView) -> Set[int]:
    """The GPUs a job can only run on: a running job stays where it is, and a suspended one resumes
    where it was (its processes stay there). Empty for a job that has not started."""
    return set(job.gpus if job.status == RUNNING else job.bound_gpus)


def _fits(job: JobView, available: Set[int], anywhere: int) -> bool:
    """Whether `job` can be selected into the `available` GPUs while the jobs already selected
    without GPUs of their own still find `anywhere` of them."""
    mine = _own_gpus(job)
    if mine:
        return mine <= available and len(available - mine) >= anywhere
    return job.num_gpus <= len(available) - anywhere


def _start_all(book: GpuBook, selected: Sequence[JobView], kept: Set[int], placements: Dict[int, Placement],
               waiting: List[int]) -> None:
    """Starts the selected jobs with GPUs of their own first, then keeps the empty GPUs of `kept`
    from the others (held for a job whose turn it is), then starts the others on what is left."""
    for job in selected:
        if _own_gpus(job):
            _start(book, job, placements, waiting)
    for gpu in kept:
        if book.is_empty(gpu):
            book.blocked[gpu] = True
    for job in selected:
        if not _own_gpus(job):
            _start(book, job, placements, waiting)


# --- FIFO -------------------------------------------------------------------------


@dataclass(frozen=True)
class Fifo:
    name: str = "fifo"

    def plan(self, state: NodeState) -> Plan:
        refused = refusals(state)
        book = GpuBook(state)
        placements: Dict[int, Placement] = {}
        waiting: List[int] = []
        blocked = False
        for job in _submission_order(_eligible(state, refused)):
            if job.status == RUNNING:
                placements[job.job_id] = Placement(job.gpus, 1.0, GUARANTEED)
                continue
            gpus = None if blocked else book.take_empty(job)
            if gpus is None:
                blocked = True  # head-of-line: nothing behind it starts first
                waiting.append(job.job_id)
            else:
                placements[job.job_id] = Placement(gpus, 1.0, GUARANTEED)
        return Plan(placements, tuple(waiting), {j: 0 for j in placements.keys() | set(waiting)}, refused)


# --- Tiresias' discretized 2D-LAS -------------------------------------------------

PROMOTED_AT = "service_at_promotion"   # attained service when the job was last promoted to queue 0
WAITED_AT = "waited_at_promotion"      # its waited_since_first_run_s then
PROMOTIONS = "promotions"
# A threshold reached up to rounding counts as reached, so a host that wakes exactly
# at the crossing time does not wake again a rounding error later.
_SERVICE_TOLERANCE_GPU_S = 1e-6


@dataclass(frozen=True)
class DiscretizedLas:
    """Tiresias' discretized 2D-LAS.

    thresholds_gpu_s: the queue limits in GPU-seconds of attained service,
      increasing; k thresholds make k+1 queues (Tiresias' simulator: one at 3600).
    starvation_factor: Tiresias' STARVELIMIT; 0 turns promotion off.
    """

    thresholds_gpu_s: Tuple[float, ...] = (3600.0,)
    starvation_factor: float = 2.0
    name: str = "las"

    def __post_init__(self) -> None:
        # Written so that NaN, which compares false with everything, fails each test.
        ts = self.thresholds_gpu_s
        if not all(t > 0 for t in ts) or not all(b >= a for a, b in zip(ts, ts[1:])):
            raise ValueError(f"queue thresholds must be positive and increasing, not {list(ts)}")
        if not self.starvation_factor >= 0:
            raise ValueError(f"the starvation factor must be 0 (off) or positive, not {self.starvation_factor}")

    def service_since_promotion(self, job: JobView) -> float:
        return job.attained_service - job.marks.get(PROMOTED_AT, 0.0)

    def queue_of(self, job: JobView) -> int:
        service = self.service_since_promotion(job)
        return sum(1 for t in self.thresholds_gpu_s if service >= t - _SERVICE_TOLERANCE_GPU_S)

    def _starving(self, job: JobView) -> bool:
        if self.starvation_factor <= 0 or job.status == RUNNING or self.queue_of(job) == 0:
            return False
        waited = job.waited_since_first_run_s - job.marks.get(WAITED_AT, 0.0)
        return waited >= self.starvation_factor * self.service_since_promotion(job)

    def plan(self, state: NodeState) -> Plan:
        refused = refusals(state)
        jobs = _eligible(state, refused)
        marks: Dict[int, Dict[str, float]] = {}
        promoted: List[JobView] = []
        for job in jobs:
            if self._starving(job):
                new_marks = {**job.marks, PROMOTED_AT: job.attained_service, WAITED_AT: job.waited_since_first_run_s,
                             PROMOTIONS: job.marks.get(PROMOTIONS, 0.0) + 1}
                marks[job.job_id] = new_marks
                job = _with_marks(job, new_marks)
            promoted.append(job)
        order = sorted(promoted, key=lambda j: (self.queue_of(j), j.status != RUNNING, j.submit_time, j.job_id))

        # The cut: by priority, skipping jobs that do not fit in what is left. A running or
        # suspended job needs its own GPUs; any other job counts GPUs.
        available = set(range(state.gpu_count))
        anywhere = 0
        selected = []
        for job in order:
            if _fits(job, available, anywhere):
                mine = _own_gpus(job)
                selected.append(job)
                available -= mine
                anywhere += 0 if mine else job.num_gpus
        chosen = {j.job_id for j in selected}
        book = GpuBook(state)
        for job in jobs:
            if job.status == RUNNING and job.job_id not in chosen:
                book.release(job)  # preempted: suspended at its next iteration boundary
        placements: Dict[int, Placement] = {}
        waiting: List[int] = []
        _start_all(book, selected, set(), placements, waiting)
        waiting += [j.job_id for j in order if j.job_id not in chosen]
        priorities = {j.job_id: self.queue_of(j) for j in promoted}
        return Plan(placements, tuple(waiting), priorities, refused, marks, self._next_change(state.now, promoted))

    def _next_change(self, now: float, jobs: Sequence[JobView]) -> Optional[float]:
        """When a running job crosses its next threshold, or a waiting one reaches the starvation limit."""
        times = []
        for job in jobs:
            service = self.service_since_promotion(job)
            if job.status == RUNNING:
                rate = job.num_gpus * job.share
                above = [t for t in self.thresholds_gpu_s if t - _SERVICE_TOLERANCE_GPU_S > service]
                if above and rate > 0:
                    times.append(now + (above[0] - service) / rate)
            elif self.starvation_factor > 0 and self.queue_of(job) > 0:
                waited = job.waited_since_first_run_s - job.marks.get(WAITED_AT, 0.0)
                times.append(now + max(0.0, self.starvation_factor * service - waited))
        return min(times) if times else None


def _with_marks(job: JobView, marks: Dict[str, float]) -> JobView:
    return replace(job, marks=marks)


# --- Gandiva's time-slicing ---------------------------------------------------------


@dataclass(frozen=True)
class TimeSlicing:
    """Round-robin quanta among the jobs that do not fit (Gandiva).

    quantum_s: how long a job keeps its GPUs once others wait (Gandiva: about a minute).
    """

    quantum_s: float = 60.0
    name: str = "timeslice"

    def __post_init__(self) -> None:
        if not self.quantum_s > 0:
            raise ValueError(f"the time-slice quantum must be positive seconds, not {self.quantum_s}")

    def plan(self, state: NodeState) -> Plan:
        refused = refusals(state)
        jobs = _eligible(state, refused)
        now = state.now
        others_wait = any(j.status != RUNNING for j in jobs)

        def started(job: JobView) -> float:
            return now if job.last_started_at is None else job.last_started_at

        def expired(job: JobView) -> bool:
            return others_wait and now - started(job) >= self.quantum_s

        keep = [j for j in jobs if j.status == RUNNING and not expired(j)]
        # Round-robin order: who has waited longest since it last ran (or was submitted),
        # then the running jobs whose quantum is over, the earliest started first.
        turns = sorted((j for j in jobs if j.status != RUNNING),
                       key=lambda j: (j.last_stopped_at if j.last_stopped_at is not None else j.submit_time, j.job_id))
        turns += sorted((j for j in jobs if j.status == RUNNING and expired(j)),
                        key=lambda j: (started(j), j.job_id))
        # A running or suspended job takes exactly its own GPUs; any other job counts free ones.
        free = set(range(state.gpu_count)) - {g for j in keep for g in j.gpus}
        kept: Set[int] = set()  # free GPUs taken, or held for the job whose turn it is, by their owners
        anywhere = 0            # GPUs the selected jobs without GPUs of their own take
        selected = list(keep)
        for job in turns:
            mine = _own_gpus(job)
            if _fits(job, free - kept, anywhere):
                selected.append(job)
                kept |= mine
                anywhere += 0 if mine else job.num_gpus
            elif mine:
                if job.status != RUNNING and not mine & kept and len(free - kept - mine) >= anywhere:
                    kept |= mine & free  # its turn: its own GPUs are kept for it; the rest go on
            elif job.status != RUNNING:
                break  # its turn: what frees up next is kept for it
        chosen = {j.job_id for j in selected}
        book = GpuBook(state)
        for job in jobs:
            if job.status == RUNNING and job.job_id not in chosen:
                book.release(job)
        placements: Dict[int, Placement] = {}
        waiting: List[int] = []
        _start_all(book, selected, kept, placements, waiting)
        waiting += [j.job_id for j in turns if j.job_id not in chosen]
        wake = None
        if others_wait or waiting:
            ends = [started(j) + self.quantum_s for j in keep]
            wake = min(ends) if ends else None
        return Plan(placements, tuple(waiting), {j.job_id: 0 for j in jobs}, refused, {}, wake)


# --- AntMan's packing -----------------------------------------------------------------


@dataclass(frozen=True)
class Packing:
    """AntMan: guaranteed jobs in submission order, opportunistic jobs in the idle slots.

    min_share: an opportunistic job is not packed where it would get less
      compute than this (it would hold memory and do nearly nothing).
    """

    min_share: float = 0.05
    name: str = "antman"

    def plan(self, state: NodeState) -> Plan:
        refused = refusals(state)
        jobs = _submission_order(_eligible(state, refused))
        book = GpuBook(state)
        placements: Dict[int, Placement] = {}
        waiting: List[int] = []
        opportunistic: List[JobView] = []

        # Quota held by the guaranteed jobs that keep running, before anyone new is counted.
        quota_left = dict(state.quotas) if state.quotas is not None else None
        for job in jobs:
            if quota_left is not None and job.status == RUNNING and job.running_role == GUARANTEED \
                    and job.tenant is not None:
                quota_left[job.tenant] = quota_left.get(job.tenant, 0) - job.num_gpus

        def over_quota(job: JobView) -> bool:
            return quota_left is not None and job.tenant is not None and quota_left.get(job.tenant, 0) < job.num_gpus

        # 1. Guaranteed jobs, strictly in submission order (AntMan's guaranteed quota is FIFO);
        #    a job beyond its tenant's quota runs as opportunistic and blocks no one.
        blocked = False
        for job in jobs:
            if job.role == OPPORTUNISTIC:
                opportunistic.append(job)
                continue
            if job.status == RUNNING and job.running_role == GUARANTEED:
                placements[job.job_id] = Placement(job.gpus, 1.0, GUARANTEED)
                continue
            if over_quota(job):
                opportunistic.append(job)
                continue
            if not blocked and job.status == RUNNING and any(book.has_guaranteed(g) for g in job.gpus):
                # Running opportunistically beside a guaranteed job. Its processes cannot move (a
                # suspended job resumes where it was), so it stays, is promoted when that job ends,
                # and holds up no guaranteed job behind it.
                opportunistic.append(job)
                continue
            gpus = None if blocked else self._guaranteed_gpus(book, job)
            if gpus is None:
                blocked = True
                opportunistic.append(job)  # meanwhile it may run in the idle slots
            else:
                placements[job.job_id] = Placement(gpus, 1.0, GUARANTEED)
                if quota_left is not None and job.tenant is not None:
                    quota_left[job.tenant] = quota_left.get(job.tenant, 0) - job.num_gpus

        # 2. Opportunistic jobs, in submission order, into what is left.
        for job in opportunistic:
            gpus = self._opportunistic_gpus(book, job)
            if gpus is None:
                waiting.append(job.job_id)
                continue
            placements[job.job_id] = Placement(gpus, self._share(book, job, gpus), OPPORTUNISTIC)
        # Priority 0: guaranteed, or waiting to be; 1: runs in the idle slots by role.
        priorities = {j.job_id: 1 if j.role == OPPORTUNISTIC else 0 for j in jobs}
        return Plan(placements, tuple(waiting), priorities, refused)

    def _guaranteed_gpus(self, book: GpuBook, job: JobView) -> Optional[Tuple[int, ...]]:
        """GPUs no guaranteed job holds. A job already running opportunistically (on GPUs no
        guaranteed job holds: the caller sees to that) becomes guaranteed where it is;
        opportunistic jobs that no longer fit beside a job are preempted."""
        if job.status == RUNNING:
            book.roles[job.job_id] = GUARANTEED  # promoted where it runs: its memory already fits there
            return job.gpus
        candidates = [g for g in range(book.gpu_count) if not book.blocked[g] and not book.has_guaranteed(g)]
        # Empty GPUs first, then those whose opportunistic residents it fits beside.
        candidates.sort(key=lambda g: (not book.is_empty(g), not book.admits(g, job), g))
        chosen = book.pick(job, candidates)
        if chosen is None:
            return None
        for gpu in chosen:
            if not book.admits(gpu, job):
                for other in book.opportunistic_on(gpu):
                    book.release(other)
        if any(book.blocked[g] for g in chosen):
            return None  # it waits until the opportunistic jobs there have been suspended
        return book.place(job, chosen, GUARANTEED)

    def _opportunistic_gpus(self, book: GpuBook, job: JobView) -> Optional[Tuple[int, ...]]:
        if job.status == RUNNING and book.roles.get(job.job_id) == OPPORTUNISTIC:
            return job.gpus  # stays where it runs
        if job.status == RUNNING:
            return None  # released above: preempted
        usable = []
        for gpu in range(book.gpu_count):
            if book.blocked[gpu] or book.has_opportunistic(gpu) or not book.admits(gpu, job):
                continue
            share = self._gpu_share(book, job, gpu)
            if share >= self.min_share:
                usable.append((-share, -book.measured_spare_bytes(gpu), gpu))
        usable.sort()  # the most spare compute first, then the most spare memory measured
        gpus = book.pick(job, [g for _, _, g in usable])
        return None if gpus is None else book.place(job, gpus, OPPORTUNISTIC)

    @staticmethod
    def _gpu_share(book: GpuBook, job: JobView, gpu: int) -> float:
        """The compute the GPU leaves idle for `job`: what its node measured, when it did and no
        resident was placed since, else what the guaranteed resident declares."""
        guaranteed = book.guaranteed_on(gpu)
        if guaranteed is None:
            return 1.0
        measured = book.views[gpu].utilization
        busy = guaranteed.utilization if measured is None else measured
        idle = max(0.0, 1.0 - busy)
        return min(1.0, idle / max(job.utilization, 1e-9))

    def _share(self, book: GpuBook, job: JobView, gpus: Sequence[int]) -> float:
        """A gang job runs at the pace of its slowest GPU."""
        return round(min(self._gpu_share(book, job, g) for g in gpus), 6)


POLICIES = {
    "fifo": Fifo,
    "las": DiscretizedLas,
    "timeslice": TimeSlicing,
    "antman": Packing,
}


def make_policy(name: str, **options):
    """The policy called `name` ("fifo", "las", "timeslice", "antman")."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(**options)
