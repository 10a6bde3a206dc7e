"""The coordinator's policies: pure functions from observed job state to caps and shares.

Nothing here does I/O or reads a clock; the daemon feeds observations in
and applies what comes out, so each rule is tested with tables of cases.

Memory (AntMan):
  * guaranteed jobs get what their live tensors hold plus a burst margin,
    first; whatever no one else gets goes to them too, so a burst
    needs no round trip;
  * the spare memory, minus a headroom, goes to opportunistic jobs
    (water-filling: each up to what it holds plus a margin);
  * when a guaranteed job bursts, opportunistic caps shrink at once (their
    pages spill) but a guaranteed cap grows only into memory that is free
    now, so the opportunistic jobs are out of the way first;
  * when room appears, opportunistic caps do not grow while a guaranteed job
    on the GPU still has spilled bytes, so its memory comes back first.
Compute (TGS-style AIMD): each opportunistic share follows the guaranteed
job's iteration time over its solo baseline, the mean iteration time of a
warm-up window during which opportunistic jobs are paused; a job still slow
after its neighbours have been at share 0 for a warm-up's worth of
iterations has its baseline measured again (the slowdown is not theirs).
Admission (Salus): an opportunistic job whose persistent memory cannot fit
next to the guaranteed jobs and the admitted opportunistic ones is queued,
or refused when it could never fit.
Host memory: every byte a squeeze spills is pinned host memory, which the
kernel can neither swap nor reclaim; a squeeze that would leave the node
less than a host headroom available is held back (the cap stays higher,
opportunistic jobs' squeezes before the others'), so cotenant never pins
the node into its OOM killer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

MiB = 1 << 20
# Host memory no squeeze may pin: the coordinator's [memory] host_headroom and
# a job's own default (cotenant.set_host_headroom).
DEFAULT_HOST_HEADROOM_BYTES = 4 << 30

GUARANTEED = "guaranteed"
OPPORTUNISTIC = "opportunistic"
CAP_ONLY = "cap_only"  # no gate, no share: its memory counts as a guaranteed job's does


@dataclass(frozen=True)
class JobObservation:
    """What the coordinator knows about one job at one moment (bytes, microseconds)."""

    job_id: int
    role: str
    device: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    host_pool_bytes: int = 0        # pinned host pages kept for spills (a squeeze fills them first)
    host_room_bytes: Optional[int] = None  # what the job may still pin by its own account (None: unknown)
    host_room_groups: Tuple[str, ...] = ()  # jobs of one group (a memory cgroup they are all under) share its room
    allocated_bytes: Optional[int] = None  # held by live tensors; None: count everything held
    cap: Optional[int] = None       # the cap now in force (None = none)
    # The highest cap the job may be following now: the one it applied last, or
    # a higher one written since that it has not applied yet (None = unknown).
    cap_bound: Optional[int] = None
    user_cap: Optional[int] = None  # an upper bound an administrator set
    admitted: bool = True           # False while queued by admission

    @property
    def held_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def may_hold_bytes(self) -> int:
        """What the job may hold on the device before it applies the newest
        cap: its device bytes, or its cap_bound where that is higher (under
        it, pages it spilled ahead come back at its next safe point)."""
        return max(self.device_bytes, self.cap_bound or 0)

    @property
    def live_bytes(self) -> int:
        """What the job cannot give back without spilling: its live tensors.
        Its cache above that is released when its cap comes down."""
        return self.held_bytes if self.allocated_bytes is None else self.allocated_bytes

    @property
    def live_device_bytes(self) -> int:
        """Its live tensors' bytes on the device: what a cap below them spills."""
        return min(self.device_bytes, max(0, self.live_bytes - self.host_bytes))

    def pins_under(self, cap: Optional[int]) -> int:
        """Host memory a cap would pin beyond what the job holds pinned now:
        the live device bytes above the cap, less the host pages it keeps."""
        if cap is None:
            return 0
        return max(0, self.live_device_bytes - cap - self.host_pool_bytes)


@dataclass(frozen=True)
class MemoryPolicyConfig:
    headroom_bytes: int = 512 * MiB      # kept free on every GPU
    burst_margin_bytes: int = 256 * MiB  # room above what a job holds before its cap binds
    min_cap_bytes: int = 2 * MiB         # never cap a job below one page (cap 0 is refused)
    host_headroom_bytes: int = DEFAULT_HOST_HEADROOM_BYTES  # host memory no squeeze may pin


def plan_memory_caps(
    device_total_bytes: int, jobs: Sequence[JobObservation], config: MemoryPolicyConfig = MemoryPolicyConfig()
) -> Dict[int, int]:
    """New caps (bytes) for the jobs of ONE GPU, keyed by job id."""
    usable = max(0, device_total_bytes - config.headroom_bytes)
    guaranteed = [j for j in jobs if j.role in (GUARANTEED, CAP_ONLY)]
    opportunistic = [j for j in jobs if j.role == OPPORTUNISTIC]

    def bounded(job: JobObservation, value: int) -> int:
        if job.user_cap is not None:
            value = min(value, job.user_cap)
        return max(config.min_cap_bytes, value)

    # Guaranteed need: its live bytes plus a margin, within what the GPU can give
    # (its cache beyond that is lent out: lowering a cap releases cache before spilling).
    need = {j.job_id: bounded(j, j.live_bytes + config.burst_margin_bytes) for j in guaranteed}
    total_need = sum(need.values())
    if total_need > usable and total_need > 0:
        need = {k: max(config.min_cap_bytes, v * usable // total_need) for k, v in need.items()}
        total_need = sum(need.values())
    spare = max(0, usable - total_need)

    # Opportunistic: water-fill the spare up to each job's want.
    wants = {
        j.job_id: (bounded(j, j.held_bytes + config.burst_margin_bytes) if j.admitted else config.min_cap_bytes)
        for j in opportunistic
    }
    given = _water_fill(spare, wants)
    caps: Dict[int, int] = {}
    guaranteed_spilled = any(j.host_bytes > 0 for j in guaranteed)
    for job in opportunistic:
        cap = max(config.min_cap_bytes, given[job.job_id])
        if guaranteed_spilled and job.cap is not None and cap > job.cap:
            cap = job.cap  # the guaranteed job's spilled memory comes back first
        caps[job.job_id] = cap

    # Guaranteed jobs also get what is left over, split evenly.
    leftover = max(0, usable - total_need - sum(caps.values()))
    # What each job may hold on the device until it applies its new cap.
    holds = {j.job_id: j.may_hold_bytes for j in jobs}
    for job in guaranteed:
        target = need[job.job_id] + (leftover // len(guaranteed))
        if job.user_cap is not None:
            target = min(target, job.user_cap)
        target = max(config.min_cap_bytes, target)
        if job.cap is not None and target > job.cap:
            # Grow only into memory free now, the headroom never lent out:
            # opportunistic jobs shrink first, and until one has applied its
            # lower cap it may still take back what it spilled under the old
            # one. Bytes this job holds over its cap (allocations made since
            # its last safe point, which spills them) are used, not its own.
            # What one job may grow into, the next cannot.
            others = sum(holds.values()) - holds[job.job_id]
            free_now = max(0, usable - others - job.device_bytes)
            target = max(job.cap, min(target, min(job.device_bytes, job.cap) + free_now))
            holds[job.job_id] = max(holds[job.job_id], target)
        caps[job.job_id] = target
    return caps


@dataclass(frozen=True)
class HostBound:
    """Caps after the host-memory bound, and how much each held-back job's
    cap stays above the plan (bytes, by job id)."""

    caps: Dict[int, int]
    held_back: Dict[int, int]


def bound_squeezes_by_host(
    caps: Dict[int, int], jobs: Sequence[JobObservation], host_room_bytes: Optional[int],
    group_rooms: Optional[Dict[str, int]] = None,
) -> HostBound:
    """Holds back the squeezes `caps` would make that do not fit in
    `host_room_bytes` (the node's available host memory less the host
    headroom and what squeezes on other GPUs will pin; None: unknown, no
    bound) or in a job's own room (JobObservation.host_room_bytes: its
    memory cgroup's limit and its headroom; a job pins no further, so a
    squeeze past it would stop part way and leave the device over the cap).
    Jobs of one group (JobObservation.host_room_groups: a memory cgroup
    they are all in or under, as the ranks of one container, or of one Slurm
    job step in task cgroups of their own, are) share one room:
    `group_rooms[group]` where given (the coordinator's reading, less what
    squeezes of the group's jobs on other GPUs will pin), else the least
    its jobs here report. A job may be in several groups (its own cgroup
    and a limited one above it); it gets no more than each allows.

    A squeeze pins the job's live device bytes above its new cap, less the
    host pages it keeps (JobObservation.pins_under). An administrator's cap
    is never raised, so its squeeze takes the room first; then opportunistic
    jobs' squeezes (they make way for guaranteed ones), water-filled, then
    the others'. A job given less than its squeeze gets the cap that pins
    only that much."""
    by_id = {j.job_id: j for j in jobs}
    wants = {job_id: by_id[job_id].pins_under(cap) for job_id, cap in caps.items() if job_id in by_id}
    fits = {}
    for job_id, want in wants.items():
        own = by_id[job_id].host_room_bytes
        fits[job_id] = want if own is None else min(want, max(0, own))

    def rank(job_id: int) -> int:  # an administrator's cap binds first; then opportunistic squeezes
        job = by_id[job_id]
        if job.user_cap is not None and caps[job_id] >= job.user_cap:
            return 0
        return 1 if job.role == OPPORTUNISTIC else 2

    groups: Dict[str, List[int]] = {}
    for job_id in fits:
        for group in by_id[job_id].host_room_groups:
            groups.setdefault(group, []).append(job_id)
    # Fewest members first: a cgroup's jobs are all among those of a group above it. Each fill only
    # lowers what its members get, so every group filled before stays within its room.
    for group, members in sorted(groups.items(), key=lambda item: (len(item[1]), item[0])):
        if group_rooms is not None and group in group_rooms:
            shared = group_rooms[group]
        else:  # each member reads the same room; the least is the latest to have seen the others' pins
            reports = [by_id[k].host_room_bytes for k in members if by_id[k].host_room_bytes is not None]
            if not reports:
                continue
            shared = min(reports)
        fits.update(_fill_by_rank(shared, {k: fits[k] for k in members}, rank))
    given = fits if host_room_bytes is None else _fill_by_rank(host_room_bytes, fits, rank)
    bounded = dict(caps)
    held_back: Dict[int, int] = {}
    for job_id, want in wants.items():
        if given[job_id] >= want:
            continue
        job = by_id[job_id]
        cap = job.live_device_bytes - job.host_pool_bytes - given[job_id]
        if job.user_cap is not None:
            cap = min(cap, job.user_cap)
        if cap > caps[job_id]:
            held_back[job_id] = cap - caps[job_id]
            bounded[job_id] = cap
    return HostBound(bounded, held_back)


def _fill_by_rank(room: int, wants: Dict[int, int], rank: Callable[[int], int]) -> Dict[int, int]:
    """Gives `room` (at least 0) to `wants` rank by rank (0 first), water-filled within a rank."""
    room = max(0, room)
    given: Dict[int, int] = {}
    for group_rank in sorted({rank(k) for k in wants}):
        group = {k: v for k, v in wants.items() if rank(k) == group_rank}
        given.update(_water_fill(room, group))
        room -= sum(given[k] for k in group)
    return given


def _water_fill(budget: int, wants: Dict[int, int]) -> Dict[int, int]:
    """Splits `budget` evenly, no job above its want; leftovers go to those still wanting."""
    given = {k: 0 for k in wants}
    remaining = dict(wants)
    while remaining and budget > 0:
        portion = budget // len(remaining)
        if portion == 0:
            break
        satisfied = []
        for job_id, want in remaining.items():
            take = min(want - given[job_id], portion)
            given[job_id] += take
            budget -= take
            if given[job_id] >= want:
                satisfied.append(job_id)
        if not satisfied:
            break
        for job_id in satisfied:
            del remaining[job_id]
    return given


# --- compute share ---------------------------------------------------------


@dataclass(frozen=True)
class SharePolicyConfig:
    target_slowdown: float = 1.05     # guaranteed iteration time / baseline the policy keeps under
    increase_step: float = 0.05       # additive increase per decision
    decrease_factor: float = 0.5      # multiplicative decrease when over target
    min_share: float = 0.0            # 0 lets a badly hurting opportunistic job pause
    tolerance: float = 0.02           # a band under the target where the share holds
    # A decrease that lands under this pauses (min_share if higher). At the
    # gate's 50 ms window, 1% is 0.5 ms, a few kernels: below it the duty
    # cycle still lets about one op through per window, so a smaller share
    # is a pause the gate cannot hold, and halving 1.0 until it rounds to 0
    # took 21 decisions (7 with this floor).
    pause_below: float = 0.01


def next_share(current: float, slowdown: Optional[float], config: SharePolicyConfig = SharePolicyConfig()) -> float:
    """AIMD step. slowdown is the guaranteed job's iteration time over its baseline,
    None when there is no guaranteed job to protect (share 1) or no measurement yet (hold)."""
    if slowdown is None:
        return current
    if slowdown > config.target_slowdown:
        decreased = round(current * config.decrease_factor, 6)
        return max(config.min_share, 0.0 if decreased < config.pause_below else decreased)
    if slowdown < config.target_slowdown - config.tolerance:
        return min(1.0, round(current + config.increase_step, 6))
    return current


@dataclass(frozen=True)
class BaselineConfig:
    skip_iterations: int = 3      # first iterations (compilation, cuDNN autotuning) are not counted
    window_iterations: int = 10   # iterations averaged into the solo baseline


@dataclass(frozen=True)
class Baseline:
    """A guaranteed job's solo iteration time, or the warm-up that measures it.

    The baseline is the mean iteration time over a window of iterations: the
    job's summed iteration time at the window's end less at its start, over
    the iterations between. Not the EWMA at the window's end: that still
    carries a share of the iterations before the window ((7/8)^10, a quarter,
    with ten), such as warm-up steps without the data loading of the steps
    that follow, and a baseline 12% low holds a job that is alone 12% "slow",
    so its opportunistic neighbours never get a share."""

    start_count: Optional[int] = None  # iteration count when the window opened
    baseline_us: Optional[float] = None
    start_total_ns: int = 0            # the job's summed iteration time then
    skip_until: Optional[int] = None   # the count the window opens at (None: BaselineConfig.skip_iterations)

    @property
    def warming_up(self) -> bool:
        return self.baseline_us is None


def update_baseline(
    state: Baseline, iteration_count: int, iteration_total_ns: int, config: BaselineConfig = BaselineConfig()
) -> Baseline:
    """Advances the warm-up; the baseline is the window's mean iteration time, in µs, once it is full."""
    if state.baseline_us is not None:
        return state
    if state.start_count is None:
        opens_at = config.skip_iterations if state.skip_until is None else state.skip_until
        if iteration_count >= opens_at:
            return Baseline(start_count=iteration_count, start_total_ns=iteration_total_ns,
                            skip_until=state.skip_until)
        return state
    counted = iteration_count - state.start_count
    took_ns = iteration_total_ns - state.start_total_ns
    if counted >= config.window_iterations and took_ns > 0:
        return Baseline(start_count=state.start_count, baseline_us=took_ns / counted / 1000.0,
                        start_total_ns=state.start_total_ns, skip_until=state.skip_until)
    return state


def remeasure_after_pause(
    state: Baseline,
    iteration_count: int,
    iterations_paused: int,
    slowdown: Optional[float],
    baseline_config: BaselineConfig = BaselineConfig(),
    share_config: SharePolicyConfig = SharePolicyConfig(),
) -> Baseline:
    """A guaranteed job whose opportunistic neighbours have all been at share
    0 for a warm-up's worth of its iterations (skipped and window) and that is
    still not under the share policy's climbing threshold (target less
    tolerance) is not slowed by them: its phase changed (longer sequences,
    slower data), or its baseline is stale. Left alone, that pause would last
    as long as the job. Its baseline is measured again, from now, alone as
    the first was (the neighbours stay paused for it)."""
    if state.warming_up or slowdown is None:
        return state
    if iterations_paused < baseline_config.skip_iterations + baseline_config.window_iterations:
        return state
    if slowdown < share_config.target_slowdown - share_config.tolerance:
        return state
    return Baseline(skip_until=iteration_count + baseline_config.skip_iterations)


def slowdown_of(iteration_ewma_us: float, baseline: Baseline) -> Optional[float]:
    if baseline.baseline_us is None or baseline.baseline_us <= 0 or iteration_ewma_us <= 0:
        return None
    return iteration_ewma_us / baseline.baseline_us


def plan_shares(
    current: Dict[int, float],
    guaranteed_slowdowns: Iterable[Optional[float]],
    any_guaranteed_warming_up: bool,
    has_guaranteed: bool,
    pinned: Dict[int, float] = {},
    admitted: Dict[int, bool] = {},
    config: SharePolicyConfig = SharePolicyConfig(),
) -> Dict[int, float]:
    """Shares for the opportunistic jobs of ONE GPU, keyed by job id.

    No guaranteed job: everyone runs at 1. A guaranteed job warming up: every
    opportunistic job is paused (0) so the baseline is a solo one. Otherwise
    AIMD on the worst slowdown. Pinned shares (set by an administrator) and
    queued jobs (0) are not moved.
    """
    slowdowns = [s for s in guaranteed_slowdowns if s is not None]
    worst = max(slowdowns) if slowdowns else None
    shares: Dict[int, float] = {}
    for job_id, share in current.items():
        if job_id in pinned:
            shares[job_id] = pinned[job_id]
        elif not admitted.get(job_id, True):
            shares[job_id] = 0.0
        elif not has_guaranteed:
            shares[job_id] = 1.0
        elif any_guaranteed_warming_up:
            shares[job_id] = 0.0
        else:
            # Leaving a warm-up pause, start low and climb additively.
            shares[job_id] = next_share(share, worst if worst is not None else 0.0, config)
    return shares


# --- admission -------------------------------------------------------------

ADMIT = "admit"
QUEUE = "queue"
REFUSE = "refuse"


@dataclass(frozen=True)
class Admission:
    decision: str
    reason: str = ""


def admit_opportunistic(
    persistent_bytes: int,
    device_total_bytes: int,
    guaranteed_live_bytes: int,
    admitted_opportunistic_persistent_bytes: int,
    config: MemoryPolicyConfig = MemoryPolicyConfig(),
) -> Admission:
    """Salus' safety condition for an opportunistic job's persistent memory
    (parameters, optimizer state): it must fit on the device next to what the
    guaranteed jobs hold and the persistent memory of the admitted
    opportunistic jobs, minus the headroom. Sizes in bytes."""
    from cotenant._core import format_size  # the one formatter

    usable = max(0, device_total_bytes - config.headroom_bytes)
    if persistent_bytes > usable:
        return Admission(
            REFUSE,
            f"the job's persistent memory ({format_size(persistent_bytes)}) exceeds what this GPU can ever give "
            f"an opportunistic job ({format_size(usable)} after the {format_size(config.headroom_bytes)} headroom); "
            "run it on a larger GPU or reduce its model or batch",
        )
    free_for_it = usable - guaranteed_live_bytes - admitted_opportunistic_persistent_bytes
    if persistent_bytes > free_for_it:
        return Admission(
            QUEUE,
            f"queued: the job's persistent memory ({format_size(persistent_bytes)}) does not fit in the "
            f"{format_size(max(0, free_for_it))} left next to the guaranteed jobs and the admitted opportunistic "
            "jobs; it starts when memory frees up",
        )
    return Admission(ADMIT)
