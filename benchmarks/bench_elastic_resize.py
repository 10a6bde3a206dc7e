"""What resizing a torchrun-launched elastic job costs: torchrun agents started on this machine
exactly as the cluster's node agents start them (cotenant.cluster.torchrun.agent_command; no
Ray, no coordinator), each with one child running tests/python/elastic_train.py (DDP on gloo,
CPU), grown 1 -> 2 -> 3 agents and shrunk back 3 -> 2 -> 1.

    python benchmarks/bench_elastic_resize.py [--repeats 2] [--out benchmarks/results]

For each resize: `to new world`, from the agent's start (scale out) or its SIGTERM (scale in)
to the first step at the new world size; `paused`, from the last step at the old size to the
first at the new one (the time the job trained nothing). Writes elastic_resize.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))  # elastic_train.py: the script and its log's reader

from cotenant.cluster import torchrun  # noqa: E402
from cotenant.scheduling.report import write_json  # noqa: E402
from elastic_train import read_log  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "python", "elastic_train.py")
MAX = 3
TIMEOUT_S = 120.0


def wait_for_world(log, world, since):
    """(time of the last step at another size, time of the first step at `world`), both after `since`."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        seen = [r for r in read_log(log) if r["t"] >= since]
        first = next((i for i, r in enumerate(seen) if r["world"] == world), None)
        if first is not None:
            before = [r["t"] for r in seen[:first] if r["world"] != world]
            return (before[-1] if before else since), seen[first]["t"]
        time.sleep(0.05)
    raise TimeoutError(f"no step at world size {world} within {TIMEOUT_S:.0f} s; see the agents' logs")


def run_once(directory, rdzv_id):
    log, checkpoint = os.path.join(directory, f"{rdzv_id}.jsonl"), os.path.join(directory, f"{rdzv_id}.pt")
    store = torchrun.host_store("127.0.0.1")  # as the cluster's node agent hosts it
    endpoint = torchrun.endpoint(store)
    env = {**os.environ, **torchrun.agent_env(), "PYTHONPATH": os.path.join(ROOT, "python")}
    agents, results = [], []

    def start(index):
        child = [sys.executable, SCRIPT, checkpoint, log]
        argv = torchrun.agent_command(child, min_nodes=1, max_nodes=MAX, endpoint=endpoint, rdzv_id=rdzv_id,
                                      local_addr="127.0.0.1")
        out = open(os.path.join(directory, f"{rdzv_id}-agent{index}.log"), "wb")
        agents.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start(0)
        wait_for_world(log, 1, 0.0)
        for world in range(2, MAX + 1):
            time.sleep(1.0)
            began = time.time()
            start(world - 1)
            last, first = wait_for_world(log, world, began)
            results.append({"resize": f"{world - 1} -> {world}", "to_new_world_s": first - began,
                            "paused_s": first - last})
        for world in range(MAX - 1, 0, -1):
            time.sleep(1.0)
            began = time.time()
            agents[world].send_signal(signal.SIGTERM)
            last, first = wait_for_world(log, world, began)
            results.append({"resize": f"{world + 1} -> {world}", "to_new_world_s": first - began,
                            "paused_s": first - last})
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    import torch

    runs = []
    with tempfile.TemporaryDirectory() as directory:
        for repeat in range(args.repeats):
            runs.append(run_once(directory, f"bench-{os.getpid()}-{repeat}"))
    table = []
    for i, first in enumerate(runs[0]):
        to_new = [run[i]["to_new_world_s"] for run in runs]
        paused = [run[i]["paused_s"] for run in runs]
        table.append({"resize": first["resize"], "to_new_world_s": statistics.median(to_new),
                      "paused_s": statistics.median(paused), "samples": len(runs)})
    print(f"| resize | to the new world (median of {args.repeats}) | training paused |")
    print("|---|---|---|")
    for row in table:
        print(f"| {row['resize']} | {row['to_new_world_s']:.1f} s | {row['paused_s']:.1f} s |")
    settings = {k: getattr(torchrun, k) for k in ("MONITOR_INTERVAL_S", "LAST_CALL_S", "KEEP_ALIVE_S",
                                                  "KEEP_ALIVE_ATTEMPTS")}
    write_json(os.path.join(args.out, "elastic_resize.json"), {
        "benchmark": "elastic_resize", "torch": torch.__version__, "cpus": os.cpu_count(),
        "machine": platform.platform(), "settings": settings, "table": table, "runs": runs,
    })


if __name__ == "__main__":
    main()
