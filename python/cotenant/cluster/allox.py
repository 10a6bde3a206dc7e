"""AlloX: which GPU type each waiting job should run on, by min-cost matching.

AlloX (EuroSys'20) places jobs on heterogeneous devices so that the average
completion time is smallest. Scheduling n jobs on one machine in the order
that minimizes the sum of completion times, the job in the k-th position
from the end adds k times its processing time to that sum (it delays itself
and the k-1 jobs after it). So the choice of a type and a position for every
job is an assignment problem: jobs on one side, (type, position from the end)
slots on the other, the cost of job j in slot (t, k) being k * p(j, t). AlloX
solves it with the Hungarian method; here scipy's linear_sum_assignment does.

A type here is a pool of GPUs, one AlloX machine that works through GPU-seconds
`pool size` times as fast as one GPU: p(j, t) = remaining seconds alone on the
trace's GPUs / relative speed on t * GPUs of j / GPUs of type t. That fluid
view of a pool is the one approximation beyond AlloX's model. As AlloX does
online, every decision matches the waiting jobs to the GPUs free now: a pool
is a type's GPUs that no job holds, and a job wider than every pool is left
unbound (it waits as the policy would have it wait).

`TypeMatching` wraps any scheduling policy: it binds each waiting job to the
type the matching gives (JobView.gpu_type) and lets the policy decide the
order and the GPUs as it would on one type; a job the user bound to a type
keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence

from cotenant.scheduling.state import RUNNING, STOPPING, JobView, NodeState, Plan

# A slot a job cannot take (a type it is not bound to, or a pool narrower than the job).
_FORBIDDEN = 1e18


def processing_s(job: JobView, gpu_type: str, pool_gpus: int) -> Optional[float]:
    """AlloX's p(j, t) for a pool of `pool_gpus` GPUs of `gpu_type`; None where the job cannot run."""
    speed = job.speeds.get(gpu_type, 1.0) if job.speeds else 1.0
    if pool_gpus < job.num_gpus or not speed > 0 or (job.gpu_type is not None and job.gpu_type != gpu_type):
        return None
    remaining = job.remaining_s if job.remaining_s is not None else 1.0
    return remaining / speed * job.num_gpus / pool_gpus


def match(jobs: Sequence[JobView], pools: Mapping[str, int]) -> Dict[int, str]:
    """The GPU type for each job (job_id -> type) that minimizes the sum of completion times,
    by AlloX's matching; jobs that fit no pool are left out."""
    from cotenant._extras import require

    optimize = require("scipy.optimize", "cluster", "placement across GPU types (AlloX)")
    types = sorted(pools)
    n = len(jobs)
    if n == 0 or not types:
        return {}
    slots = [(t, k) for t in types for k in range(1, n + 1)]
    cost: List[List[float]] = []
    for job in jobs:
        row = []
        for t, k in slots:
            p = processing_s(job, t, pools[t])
            row.append(_FORBIDDEN if p is None else k * p)
        cost.append(row)
    rows, columns = optimize.linear_sum_assignment(cost)
    return {jobs[r].job_id: slots[c][0] for r, c in zip(rows, columns) if cost[r][c] < _FORBIDDEN}


@dataclass(frozen=True)
class TypeMatching:
    """A policy that binds waiting jobs to GPU types by AlloX's matching, then asks `inner`."""

    inner: object

    @property
    def name(self) -> str:
        return f"{self.inner.name}+allox"

    def plan(self, state: NodeState) -> Plan:
        types = {state.gpu(index).gpu_type for index in range(state.gpu_count)}
        if len(types) < 2:
            return self.inner.plan(state)
        held = {g for j in state.jobs if j.status in (RUNNING, STOPPING) for g in j.gpus}
        pools: Dict[str, int] = {}
        for index in range(state.gpu_count):
            if index not in held:
                gpu_type = state.gpu(index).gpu_type
                pools[gpu_type] = pools.get(gpu_type, 0) + 1
        # A suspended job resumes on the GPUs it holds in host memory: their type is its type.
        waiting = [j for j in state.jobs
                   if j.status not in (RUNNING, STOPPING) and j.gpu_type is None and not j.bound_gpus]
        types = match(waiting, pools)
        jobs = tuple(replace(j, gpu_type=types[j.job_id]) if j.job_id in types else j for j in state.jobs)
        return self.inner.plan(replace(state, jobs=jobs))
