#!/usr/bin/env python3
"""Make the bundled allocation traces in benchmarks/traces/ from real models.

    python scripts/make_traces.py [--out benchmarks/traces] [--steps 3]

Each trace is a real PyTorch workload run on the CPU under
torch.profiler.profile(profile_memory=True). The profiler records every
allocation and free of PyTorch's CPU allocator with its address and size
(+bytes for an allocation, -bytes for a free); those events, in time order,
become cotenant's JSON-lines trace format (addresses become ids; a new id per
allocation, since addresses are reused), gzipped. The model, its optimizer
and its inputs are created inside the profiled region so their allocations
are in the trace too.

Workloads:
  resnet_train   a ResNet-style CNN (basic blocks, 4 stages), SGD with momentum
  gpt_train      a GPT-style decoder-only transformer, AdamW
  gpt_generate   the same transformer generating tokens with a growing KV cache
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

# ---- the models -------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, inputs = [], widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            for i in range(count):
                layers.append(BasicBlock(inputs, width, 2 if (i == 0 and stage > 0) else 1))
                inputs = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x, cache=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None or t > 1)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, cache=None):
        x = x + self.attention(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocabulary=8192, width=384, heads=6, depth=6, context=256):
        super().__init__()
        self.token = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens, caches=None, start=0):
        positions = torch.arange(start, start + tokens.shape[1])
        x = self.token(tokens) + self.position(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln(x))


# ---- the workloads ----------------------------------------------------------------


def resnet_train(steps: int):
    model = ResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(steps):
        images = torch.randn(32, 3, 32, 32)
        labels = torch.randint(0, 100, (32,))
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def gpt_train(steps: int):
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        tokens = torch.randint(0, 8192, (8, 257))
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def gpt_generate(steps: int):
    model = GPT().eval()
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.randint(0, 8192, (4, 32))
            caches = [dict() for _ in model.blocks]
            logits = model(tokens, caches)
            for position in range(tokens.shape[1], 160):
                next_token = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
                tokens = torch.cat([tokens, next_token], dim=1)
                logits = model(next_token, caches, start=position)


WORKLOADS = {"resnet_train": resnet_train, "gpt_train": gpt_train, "gpt_generate": gpt_generate}


# ---- profiler events -> trace -----------------------------------------------------


def allocation_events(prof):
    """(time ns, address, bytes) of every CPU allocator event, in time order;
    bytes < 0 is a free."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if str(fields.device) == "cpu" and fields.alloc_size != 0:
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        stack.extend(node.children)
    # Time order; on a tie a free goes first (an address is only reused after its free).
    events.sort(key=lambda e: (e[0], e[2] > 0))
    return events


def to_trace_lines(events, meta):
    """Trace records: a fresh id per allocation; frees of addresses allocated
    before profiling began are dropped (counted in meta)."""
    lines = [meta]
    live = {}  # address -> id
    next_id = 1
    dropped_frees = 0
    for _, address, size in events:
        if size > 0:
            if address in live:  # a free the profiler missed: the address was reused
                lines.append({"op": "free", "id": live.pop(address)})
            live[address] = next_id
            lines.append({"op": "alloc", "id": next_id, "size": size, "stream": 0})
            next_id += 1
        elif address in live:
            lines.append({"op": "free", "id": live.pop(address)})
        else:
            dropped_frees += 1
    meta["dropped_frees_of_earlier_allocations"] = dropped_frees
    meta["live_at_end"] = len(live)
    return lines


def make_trace(name: str, steps: int, out_dir: str) -> str:
    torch.manual_seed(0)
    started = time.time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        WORKLOADS[name](steps)
    events = allocation_events(prof)
    meta = {
        "op": "meta",
        "trace": name,
        "source": "torch.profiler.profile(activities=[CPU], profile_memory=True) allocation events",
        "command": f"python scripts/make_traces.py --steps {steps}",
        "torch": torch.__version__,
        "steps": steps,
    }
    lines = to_trace_lines(events, meta)
    path = os.path.join(out_dir, f"{name}.jsonl.gz")
    # mtime=0: the same run gives the same bytes.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        for record in lines:
            f.write((json.dumps(record, separators=(",", ":")) + "\n").encode())
    print(f"{path}: {len(lines) - 1} ops from {len(events)} allocator events, "
          f"{os.path.getsize(path) / 1024:.0f} KiB, {time.time() - started:.0f} s", file=sys.stderr)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "benchmarks", "traces"))
    parser.add_argument("--steps", type=int, default=3, help="training steps / generated sequences per workload")
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help=f"which to make (default: all of {', '.join(WORKLOADS)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {unknown[0]}; choose from {', '.join(WORKLOADS)}")
    torch.set_num_threads(1)  # one thread: the allocation sequence does not depend on the machine's cores
    os.makedirs(args.out, exist_ok=True)
    for name in args.workloads or list(WORKLOADS):
        make_trace(name, args.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
