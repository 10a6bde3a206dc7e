"""Salus' admission, in front of every policy: which jobs may share a GPU.

Salus' safety condition: the jobs resident on a GPU fit when the persistent
memory of all of them plus the largest ephemeral working set among them fits
in the GPU's memory (only one job's iteration holds its ephemeral memory at a
time). With cotenant a suspended job holds no device memory, so only jobs
running (or stopping) on a GPU are resident there. A job that could not fit
even alone, or that needs more GPUs than the node has, is refused.

`GpuBook` is the scratch ledger a policy fills while it builds a plan:
which jobs are resident on each GPU, checked against that condition.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from cotenant.scheduling.state import GUARANTEED, OPPORTUNISTIC, JobView, NodeState, RUNNING, STOPPING


def fits_together(jobs: Sequence[JobView], gpu_memory_bytes: Optional[int]) -> bool:
    """Salus' condition for the jobs resident on one GPU (sizes per GPU, in bytes)."""
    if gpu_memory_bytes is None or not jobs:
        return True
    persistent = sum(j.persistent_bytes for j in jobs)
    ephemeral = max(j.ephemeral_bytes for j in jobs)
    return persistent + ephemeral <= gpu_memory_bytes


def refusal(job: JobView, gpu_count: int, gpu_memory_bytes: Optional[int]) -> Optional[str]:
    """Why `job` can never run on this node, or None when it can."""
    if job.num_gpus > gpu_count:
        return (f"job {job.job_id} needs {job.num_gpus} GPUs and this node has {gpu_count}; "
                "run it on a larger node or with fewer GPUs")
    if job.num_gpus < 1:
        return f"job {job.job_id} asks for {job.num_gpus} GPUs; a job needs at least 1"
    if not fits_together([job], gpu_memory_bytes):
        from cotenant._core import format_size  # the one formatter

        return (f"job {job.job_id} needs {format_size(job.peak_bytes)} per GPU at its peak and a GPU has "
                f"{format_size(gpu_memory_bytes)}; reduce its batch or model")
    return None


def refusals(state: NodeState) -> Dict[int, str]:
    found = {}
    for job in state.jobs:
        reason = refusal(job, state.gpu_count, state.gpu_memory_bytes)
        if reason:
            found[job.job_id] = reason
    return found


class GpuBook:
    """Which jobs are resident on each GPU while a plan is built.

    Starts with the jobs that hold GPUs now (RUNNING and STOPPING); a policy
    releases the ones it preempts (their GPUs are still busy until they have
    stopped, so `release` only frees them for accounting, never for placing,
    unless `now_free=True`) and places the ones it starts.
    """

    def __init__(self, state: NodeState) -> None:
        self.gpu_count = state.gpu_count
        self.memory = state.gpu_memory_bytes
        self.residents: List[List[JobView]] = [[] for _ in range(state.gpu_count)]
        self.roles: Dict[int, str] = {}
        self.blocked = [False] * state.gpu_count  # a stopping job still holds it
        for job in state.jobs:
            if job.status in (RUNNING, STOPPING):
                for gpu in job.gpus:
                    if job.status == STOPPING:
                        self.blocked[gpu] = True
                    self.residents[gpu].append(job)
                self.roles[job.job_id] = job.running_role or GUARANTEED

    # --- queries -----------------------------------------------------------------

    def has_guaranteed(self, gpu: int) -> bool:
        return any(self.roles.get(j.job_id) == GUARANTEED for j in self.residents[gpu])

    def has_opportunistic(self, gpu: int) -> bool:
        return any(self.roles.get(j.job_id) == OPPORTUNISTIC for j in self.residents[gpu])

    def is_empty(self, gpu: int) -> bool:
        return not self.residents[gpu]

    def admits(self, gpu: int, job: JobView) -> bool:
        return fits_together(self.residents[gpu] + [job], self.memory)

    def guaranteed_on(self, gpu: int) -> Optional[JobView]:
        for j in self.residents[gpu]:
            if self.roles.get(j.job_id) == GUARANTEED:
                return j
        return None

    def opportunistic_on(self, gpu: int) -> List[JobView]:
        return [j for j in self.residents[gpu] if self.roles.get(j.job_id) == OPPORTUNISTIC]

    def empty_gpus(self) -> List[int]:
        return [g for g in range(self.gpu_count) if self.is_empty(g) and not self.blocked[g]]

    # --- changes -----------------------------------------------------------------

    def release(self, job: JobView) -> None:
        """Forgets `job` (it is preempted or changes GPUs); its GPUs stay blocked while it stops."""
        for gpu in range(self.gpu_count):
            before = len(self.residents[gpu])
            self.residents[gpu] = [j for j in self.residents[gpu] if j.job_id != job.job_id]
            if len(self.residents[gpu]) != before:
                self.blocked[gpu] = True
        self.roles.pop(job.job_id, None)

    def place(self, job: JobView, gpus: Iterable[int], role: str) -> Tuple[int, ...]:
        gpus = tuple(sorted(gpus))
        for gpu in gpus:
            self.residents[gpu].append(job)
        self.roles[job.job_id] = role
        return gpus

    def take_empty(self, job: JobView, role: str = GUARANTEED) -> Optional[Tuple[int, ...]]:
        """`job.num_gpus` GPUs nobody holds (lowest indices first), or None."""
        free = self.empty_gpus()
        if len(free) < job.num_gpus:
            return None
        return self.place(job, free[: job.num_gpus], role)
