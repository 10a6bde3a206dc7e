"""Scheduling at the node: which queued jobs run, and when, on which GPUs.

`policies` holds the policies (FIFO, Tiresias' discretized 2D-LAS, Gandiva's
time-slicing, AntMan's packing), each a pure function of a `state.NodeState`,
with Salus' admission (`admission`) in front of all of them. The
discrete-event simulator (`simulator`) and the coordinator's queue call the
same policy objects.
"""

from cotenant.scheduling.policies import POLICIES, make_policy  # noqa: F401
from cotenant.scheduling.state import JobView, NodeState, Placement, Plan  # noqa: F401
