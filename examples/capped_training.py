"""Train under a memory cap that moves mid-run (needs an NVIDIA GPU).

    python examples/capped_training.py            # or, with no code change:
    cotenant run --opportunistic --cap 2GiB -- python my_script.py

cotenant.enable() must run before the first CUDA tensor. Halfway through, the
cap drops below the model's working set: parameters and optimizer state spill
to host memory instead of raising an out-of-memory error, and training goes
on (slower) until the cap rises again and they come back.
"""

import sys

import torch
from torch import nn

import cotenant


def main():
    try:
        cotenant.enable()
    except cotenant.NoGpuError as error:
        print(f"this example needs a GPU: {error}", file=sys.stderr)
        raise SystemExit(2)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 8192), nn.GELU(), nn.Linear(8192, 4096)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(256, 4096, device="cuda")

    for step in range(60):
        if step == 20:
            cotenant.set_memory_cap("256MiB")   # below the working set: pages spill to host
        if step == 40:
            cotenant.set_memory_cap(0.9)        # 90% of the device: pages come back
        loss = model(data).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()                        # a safe point: pending moves happen here
        if step % 10 == 0 or step in (21, 41):
            stats = cotenant.memory_stats()
            print(f"step {step:3d} loss {loss.item():.5f} device {stats['device_bytes'] >> 20} MiB "
                  f"host {stats['host_bytes'] >> 20} MiB mode {stats['mode']}")


if __name__ == "__main__":
    main()
