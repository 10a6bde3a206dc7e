"""Past one machine: AntMan's cluster scheduler, on Ray.

A global scheduler places jobs across nodes and a node agent on each node
drives that node's cotenant coordinator (AntMan's split). The decisions are
the node's own scheduling policies (cotenant.scheduling) run over every GPU
of the cluster, with tenant quotas, topology, AlloX's matching across GPU
types (`allox`) and Amoeba's elastic resizing (`elastic`); `runtime` runs
them on Ray. Nothing here imports Ray or scipy until a feature needs it
(the extra `cotenant[cluster]`).
"""
