"""A cluster's shape for the simulator: nodes, GPUs per node, GPU types.

Tiresias' cluster files (`num_switch,num_node_p_switch,num_gpu_p_node,
num_cpu_p_node,mem_p_node`) give the nodes and their GPUs; the heterogeneous
variant gives `slow_nodes` of them, spread evenly, a slower GPU type. How much slower
depends on the model (AlloX's premise: jobs gain unequally from a newer GPU);
SLOW_SPEED is the model used here, an assumption and not a measurement:
convolution-heavy VGG gains most from the fast type, AlexNet least.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from typing import Dict, Tuple

from cotenant.scheduling.state import GpuView
from cotenant.scheduling.trace import TraceError, TraceJob

FAST = "fast"
SLOW = "slow"

# Speed on the slow type relative to the fast one (the trace's durations are on the fast type).
SLOW_SPEED: Dict[str, float] = {
    "vgg11": 0.30, "vgg16": 0.30, "vgg19": 0.30, "resnet50": 0.40, "resnet101": 0.40, "resnet152": 0.40,
    "inception3": 0.45, "inception4": 0.45, "googlenet": 0.50, "alexnet": 0.60,
}
DEFAULT_SLOW_SPEED = 0.45


@dataclass(frozen=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    slow_nodes: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs at least 1 node of at least 1 GPU, not {self.nodes} x "
                             f"{self.gpus_per_node}")
        if not 0 <= self.slow_nodes <= self.nodes:
            raise ValueError(f"--slow-nodes must be between 0 and the {self.nodes} nodes, not {self.slow_nodes}")

    @property
    def gpu_count(self) -> int:
        return self.nodes * self.gpus_per_node

    def gpus(self) -> Tuple[GpuView, ...]:
        """Every GPU, node by node; `slow_nodes` nodes spread evenly among the others hold the slow
        type (with half of them slow, every other node), so the order of the nodes favours no type."""
        views = []
        for node in range(self.nodes):
            slow = (node + 1) * self.slow_nodes // self.nodes > node * self.slow_nodes // self.nodes
            gpu_type = SLOW if slow else FAST
            views += [GpuView(node=f"node{node}", gpu_type=gpu_type)] * self.gpus_per_node
        return tuple(views)

    def describe(self) -> str:
        text = f"{self.nodes} nodes x {self.gpus_per_node} GPUs"
        if self.slow_nodes:
            text += f", {self.slow_nodes} of them with the slow GPU type"
        return text


def read_cluster(path: str, slow_nodes: int = 0) -> ClusterShape:
    """A Tiresias cluster file: all its switches' nodes, each with num_gpu_p_node GPUs."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as error:
        raise TraceError(f"cannot read the cluster file {path}: {error.strerror}") from None
    needed = ("num_switch", "num_node_p_switch", "num_gpu_p_node")
    if len(rows) != 1 or any(c not in rows[0] for c in needed):
        raise TraceError(f"the cluster file {path} needs a header naming {','.join(needed)} and one line "
                         "(Tiresias' format, e.g. 1,32,4,40,256)")
    try:
        switches, per_switch, gpus = (int(rows[0][c]) for c in needed)
    except ValueError:
        raise TraceError(f"the cluster file {path}: {','.join(needed)} must be whole numbers") from None
    return ClusterShape(nodes=switches * per_switch, gpus_per_node=gpus, slow_nodes=slow_nodes)


def relative_speed(job: TraceJob, gpu_type: str) -> float:
    """How fast `job` runs on `gpu_type` relative to the trace's duration."""
    if gpu_type != SLOW:
        return 1.0
    return SLOW_SPEED.get(job.model_name, DEFAULT_SLOW_SPEED)
