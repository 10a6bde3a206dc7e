"""Amoeba's elasticity: jobs that declare a range of workers grow into idle GPUs and
shrink when guaranteed jobs need them.

A pure function of the cluster's state and the plan the scheduling policy just
made (the policy sees an elastic job at its current width, or at its minimum
while it waits). Two rules, applied after the policy:

  * scale in: when the policy left a job waiting (the first in its order) and
    the GPUs that would let it start are held by elastic jobs above their
    minimum, those jobs give back workers, newest first, until enough GPUs
    are free. The workers stop at their iteration boundary; the waiting job
    starts on the next decision.
  * scale out: GPUs nobody holds and nobody waits for go to running elastic
    jobs below their maximum, in submission order, on nodes they already
    occupy first (their workers' collectives stay on fast links).

A job never shrinks below its minimum and never loses its first worker, which
holds its rendezvous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Tuple

from cotenant.scheduling.state import RUNNING, STOPPING, NodeState, Plan


@dataclass(frozen=True)
class WorkerRange:
    min_gpus: int
    max_gpus: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_gpus <= self.max_gpus:
            raise ValueError(f"a worker range needs 1 <= min <= max, not {self.min_gpus}-{self.max_gpus}")


def resize(state: NodeState, plan: Plan, ranges: Mapping[int, WorkerRange]) -> Dict[int, Tuple[int, ...]]:
    """The new GPUs (in worker order: kept ones first, added ones after) of every running elastic
    job whose width changes; jobs not listed keep theirs."""
    running = {j.job_id: j for j in state.jobs
               if j.job_id in ranges and j.status == RUNNING and j.job_id in plan.placements}
    if not running:
        return {}
    changes: Dict[int, Tuple[int, ...]] = {}
    if plan.waiting:
        first = state.job(plan.waiting[0])
        free = _free_gpus(state, plan)
        short = first.num_gpus - len(free)
        for job in sorted(running.values(), key=lambda j: (-j.submit_time, -j.job_id)):  # the newest job first
            if short <= 0:
                break
            surplus = len(job.gpus) - ranges[job.job_id].min_gpus
            give = min(surplus, short)
            if give > 0:
                changes[job.job_id] = tuple(job.gpus[: len(job.gpus) - give])
                short -= give
        return changes if short <= 0 else {}  # shrinking that would not let it start helps no one
    free = _free_gpus(state, plan)
    for job in sorted(running.values(), key=lambda j: (j.submit_time, j.job_id)):
        room = ranges[job.job_id].max_gpus - len(job.gpus)
        if room <= 0 or not free:
            continue
        own_nodes = {state.gpu(g).node for g in job.gpus}
        allowed = [g for g in free if job.gpu_type is None or state.gpu(g).gpu_type == job.gpu_type]
        allowed.sort(key=lambda g: (state.gpu(g).node not in own_nodes, g))
        added = allowed[:room]
        if added:
            changes[job.job_id] = tuple(job.gpus) + tuple(added)
            free = [g for g in free if g not in added]
    return changes


def _free_gpus(state: NodeState, plan: Plan) -> List[int]:
    """GPUs no job holds once the plan is applied (and none still stopping)."""
    held = set()
    for placement in plan.placements.values():
        held.update(placement.gpus)
    for job in state.jobs:
        if job.status in (RUNNING, STOPPING):  # a preempted job holds its GPUs until it has stopped
            held.update(job.gpus)
    return [g for g in range(state.gpu_count) if g not in held]
