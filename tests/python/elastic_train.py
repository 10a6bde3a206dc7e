"""A small elastic training script, written as torchrun's documentation asks of one, for the
cluster tests: it reads its rank and world from torch.distributed, resumes from its checkpoint
at every start (rank 0 saves one after every step) and trains a linear model with DDP on gloo.
Nothing in it knows about resizing: torchrun restarts it with a new world.

    elastic_train.py CHECKPOINT LOG [--steps N] [--step-s S]

Each rank appends one JSON line per step to LOG: step, rank, world, pid, the step it resumed
from and when it had loaded it, torchrun's restart count, the name it registered at its
node's coordinator, and the time (seconds since the epoch).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def read_log(path):
    """The complete lines of LOG so far, each a dict; [] before the first step."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def register():
    """What cotenant's start-up hook does in a job on a GPU (the cluster tests run without one, with
    COTENANT_DISABLE=1): registers under the name `cotenant run` gave, for as long as it lives."""
    from cotenant.coordinator import client

    name = os.environ.get("COTENANT_JOB_NAME")
    if not name:
        return None
    registration = client.register(os.environ["COTENANT_ROLE"], int(os.environ.get("COTENANT_DEVICE", "0")),
                                   name=name, socket=os.environ.get("COTENANT_SOCKET"))
    return registration.name if registration else None


def save(checkpoint, model, optimizer, step):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint + ".tmp")
    os.replace(checkpoint + ".tmp", checkpoint)  # whole or not at all, even when this rank is stopped mid-save


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("log")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps in all (0: never)")
    parser.add_argument("--step-s", type=float, default=0.05)
    args = parser.parse_args()
    registered = register()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    resumed, loaded_at = step, time.time()
    ddp = DistributedDataParallel(model)  # a collective: no rank trains (and saves) before every rank has loaded
    while not args.steps or step < args.steps:
        loss = ddp(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            save(args.checkpoint, model, optimizer, step)
        line = {"step": step, "rank": rank, "world": world, "pid": os.getpid(), "resumed": resumed,
                "loaded_at": loaded_at, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "registered": registered, "t": time.time()}
        with open(args.log, "a") as f:
            f.write(json.dumps(line) + "\n")
        time.sleep(args.step_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
