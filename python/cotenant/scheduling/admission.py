"""Salus' admission, in front of every policy: which jobs may share a GPU.

Salus' safety condition: the jobs resident on a GPU fit when the persistent
memory of all of them plus the largest ephemeral working set among them fits
in the GPU's memory (only one job's iteration holds its ephemeral memory at a
time). With cotenant a suspended job holds no device memory, so only jobs
running (or stopping) on a GPU are resident there. A job that could not fit
even alone, or that needs more GPUs than the node has, is refused.

`GpuBook` is the scratch ledger a policy fills while it builds a plan:
which jobs are resident on each GPU, checked against that condition. On a
cluster it also knows each GPU's node and type: `pick` gives a gang job GPUs
of one node where one has enough (the fullest such node, so large holes stay
whole), else of as few nodes as it can, and never GPUs of another type or
node than the job is bound to.
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
    """Why `job` can never run on this node, or None when it can. (A cluster's GPU types and
    bindings are not checked here: a job bound to a type waits for one.)"""
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
    memory = state.gpu_memory_bytes
    if state.gpus and all(g.memory_bytes is not None for g in state.gpus):
        memory = max(g.memory_bytes for g in state.gpus)  # a cluster: what its largest GPU holds
    found = {}
    for job in state.jobs:
        reason = refusal(job, state.gpu_count, memory)
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
        self.views = [state.gpu(g) for g in range(state.gpu_count)]
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

    def memory_of(self, gpu: int) -> Optional[int]:
        measured = self.views[gpu].memory_bytes
        return self.memory if measured is None else measured

    def admits(self, gpu: int, job: JobView) -> bool:
        return self.allowed(gpu, job) and fits_together(self.residents[gpu] + [job], self.memory_of(gpu))

    def allowed(self, gpu: int, job: JobView) -> bool:
        """Whether the job's GPU type and node bindings let it run on `gpu`."""
        view = self.views[gpu]
        return (job.gpu_type is None or view.gpu_type == job.gpu_type) and (job.node is None or view.node == job.node) \
            and (not job.bound_gpus or gpu in job.bound_gpus)

    def measured_spare_bytes(self, gpu: int) -> int:
        """Free memory on `gpu` as its node's agent measured it; 0 where nothing was measured."""
        free = self.views[gpu].free_bytes
        return 0 if free is None else free

    def guaranteed_on(self, gpu: int) -> Optional[JobView]:
        for j in self.residents[gpu]:
            if self.roles.get(j.job_id) == GUARANTEED:
                return j
        return None

    def opportunistic_on(self, gpu: int) -> List[JobView]:
        return [j for j in self.residents[gpu] if self.roles.get(j.job_id) == OPPORTUNISTIC]

    def empty_gpus(self) -> List[int]:
        return [g for g in range(self.gpu_count) if self.is_empty(g) and not self.blocked[g]]

    def pick(self, job: JobView, candidates: Sequence[int]) -> Optional[List[int]]:
        """`job.num_gpus` of `candidates` (best first) that its bindings allow, topology first: all on
        one node when a node has enough (of those, the one with the fewest candidates, then the
        best-ranked), else from the nodes with the most candidates. None when too few."""
        allowed = [g for g in candidates if self.allowed(g, job)]
        need = job.num_gpus
        if len(allowed) < need:
            return None
        by_node: Dict[str, List[int]] = {}
        for gpu in allowed:
            by_node.setdefault(self.views[gpu].node, []).append(gpu)
        rank = {gpu: i for i, gpu in enumerate(allowed)}
        whole = [gpus for gpus in by_node.values() if len(gpus) >= need]
        if whole:
            best = min(whole, key=lambda gpus: (len(gpus), sum(rank[g] for g in gpus[:need])))
            return best[:need]
        chosen: List[int] = []
        for gpus in sorted(by_node.values(), key=lambda gpus: (-len(gpus), rank[gpus[0]])):
            chosen += gpus[: need - len(chosen)]
            if len(chosen) == need:
                break
        return sorted(chosen, key=rank.__getitem__)

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
        """`job.num_gpus` GPUs nobody holds (one node first, then lowest indices), or None."""
        gpus = self.pick(job, self.empty_gpus())
        if gpus is None:
            return None
        return self.place(job, gpus, role)
