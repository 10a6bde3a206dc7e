#!/usr/bin/env python3
"""Record PyTorch memory snapshots of real training loops on a GPU, with
PyTorch's own caching allocator (cotenant is not enabled), for
`python -m cotenant.replay` to put PyTorch's figures beside cotenant's.

    python benchmarks/record_snapshots.py --out DIR [--steps 30] [--seconds 60]
                                          [--workloads gpt_train_varlen,resnet50_train]
                                          [--max-entries 200000] [--expandable-segments]

Workloads (an iteration is one training step):
  gpt_train_varlen  a GPT-style decoder (6 layers, width 512, 8 heads, vocabulary
                    8192), AdamW, bf16 autocast, batch 8; each step's sequence
                    length is drawn from 64..512, so block sizes change every step
  resnet50_train    ResNet-50 (torchvision's, or the same network written out in
                    benchmarks/colocate.py), SGD with momentum, bf16 autocast,
                    channels_last, batch 32 of 224x224 images

Each workload runs in its own process (`record_snapshots.py --worker NAME ...`),
so each snapshot begins with an empty allocator. The process turns recording on
with torch.cuda.memory._record_memory_history(max_entries=N, context=None,
global_record_annotations=True) before it builds the model (context=None: no
stack frames, which the replay does not use and which would make the files
hundreds of MB; the annotations hold each optimizer.step(), whose end the
replay reads as an iteration mark), runs the steps,
then writes DIR/NAME.pickle with torch.cuda.memory._dump_snapshot() while
recording is still on, so the snapshot's segment list is the state at the
trace's end. --expandable-segments records with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (files NAME-expandable.pickle).

Runtime: --seconds bounds the whole run. Each workload gets an equal share of
what is left, counted from its process's start (CUDA start-up included); its
loop stops after --steps steps or when the share is spent, whichever comes
first (at least one step), and a process still running 30 s after its share is
killed.

Exit status: 0 when every snapshot was written; 1 when a workload failed; 2
without a CUDA GPU or with bad arguments.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from typing import Dict, List, Optional

STARTED = time.monotonic()
HERE = os.path.dirname(os.path.abspath(__file__))
KILL_GRACE_S = 30.0  # past its share, a worker is stuck, not slow
WORKLOAD_NAMES = ("gpt_train_varlen", "resnet50_train")


# ---- arguments --------------------------------------------------------------------------------


def _workload_list(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(unknown) or '(none given)'}; the workloads are {', '.join(WORKLOAD_NAMES)}")
    return names


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
        return value
    return parse


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the snapshots (NAME.pickle)")
    parser.add_argument("--steps", type=_positive(int), default=30, help="training steps per workload, at most")
    parser.add_argument("--seconds", type=_positive(float), default=60.0,
                        help="the whole run's time, shared between the workloads (default 60)")
    parser.add_argument("--workloads", type=_workload_list, default=list(WORKLOAD_NAMES),
                        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)} (default: both)")
    parser.add_argument("--max-entries", type=_positive(int), default=200_000,
                        help="the trace's ring buffer: the last this many allocator events are kept")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="record with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    parser.add_argument("--worker", choices=WORKLOAD_NAMES, help=argparse.SUPPRESS)  # one workload, in this process
    return parser.parse_args(argv)


def snapshot_path(out: str, name: str, expandable_segments: bool) -> str:
    return os.path.join(out, f"{name}{'-expandable' if expandable_segments else ''}.pickle")


# ---- the GPU check ------------------------------------------------------------------------------


def cuda_problem() -> Optional[str]:
    """Why this machine cannot record a snapshot, or None when it can."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed; install torch with CUDA support"
    if not torch.cuda.is_available():
        return ("no CUDA GPU: torch.cuda.is_available() is False on this machine. A memory snapshot records "
                "PyTorch's CUDA caching allocator, so run this on a GPU machine (scripts/gpu_check.sh bench does)")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        return (f"PyTorch's CUDA allocator here is {backend!r} (PYTORCH_CUDA_ALLOC_CONF); snapshots record the "
                "native caching allocator: unset backend:cudaMallocAsync")
    return None


def worker_environment(expandable_segments: bool) -> Dict[str, str]:
    """PyTorch's own allocator: cotenant stays off even where the environment would enable it."""
    env = dict(os.environ, COTENANT_DISABLE="1")
    env.pop("COTENANT_ENABLE", None)
    if expandable_segments:
        settings = [s for s in env.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
                    if s and not s.startswith("expandable_segments")]
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(settings + ["expandable_segments:True"])
    return env


# ---- workloads ------------------------------------------------------------------------------------


def gpt_train_varlen(torch, device: str, batch: int = 8, longest: int = 512, mixed_precision: bool = True):
    """(the model, a training step per call), each step at a sequence length drawn from 64..longest;
    the forward pass under bfloat16 autocast unless mixed_precision is False."""
    nn = torch.nn
    vocab, width, heads, layers = 8192, 512, 8, 6
    lengths = list(range(64, longest + 1, 64))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Embedding(max(lengths), width)
            block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens):
            n = tokens.shape[1]
            x = self.embed(tokens) + self.position(torch.arange(n, device=tokens.device))
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
            return self.head(self.blocks(x, mask=mask, is_causal=True))

    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    shapes = random.Random(0)

    def step():
        tokens = torch.randint(0, vocab, (batch, shapes.choice(lengths) + 1), device=device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mixed_precision):
            logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
    return model, step


def resnet50_train(torch, device: str, batch: int = 32, image: int = 224):
    """(the model, a training step per call)."""
    sys.path.insert(0, HERE)
    from colocate import _resnet50  # the one ResNet-50 the benchmarks share

    model = _resnet50(torch).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        x = torch.randn(batch, 3, image, image, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return model, step


WORKLOADS = {"gpt_train_varlen": gpt_train_varlen, "resnet50_train": resnet50_train}


# ---- recording ----------------------------------------------------------------------------------


def record(name: str, args: argparse.Namespace) -> int:
    """One workload in this process: record, run, dump."""
    problem = cuda_problem()
    if problem:
        return fail(problem)
    import torch

    deadline = STARTED + args.seconds
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    # global_record_annotations: each optimizer.step() range goes into the snapshot, where the replay reads
    # its end as an iteration mark.
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, context=None, stacks="python",
                                             global_record_annotations=True)
    _, step = WORKLOADS[name](torch, "cuda")
    steps = 0
    while steps < args.steps and (steps == 0 or time.monotonic() < deadline):
        step()
        torch.cuda.synchronize()
        steps += 1
    path = snapshot_path(args.out, name, args.expandable_segments)
    torch.cuda.memory._dump_snapshot(path)  # recording still on: the segment list is the trace's end
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_reserved()
    print(f"{name}: {steps} steps in {time.monotonic() - STARTED:.1f} s, peak reserved {peak / 2**20:.0f} MiB, "
          f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)", flush=True)
    return 0


def record_all(args: argparse.Namespace) -> int:
    problem = cuda_problem()
    if problem:
        return fail(problem)
    os.makedirs(args.out, exist_ok=True)
    failed = []
    for index, name in enumerate(args.workloads):
        left = args.seconds - (time.monotonic() - STARTED)
        share = max(1.0, left / (len(args.workloads) - index))
        command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--out", args.out,
                   "--steps", str(args.steps), "--seconds", f"{share:.1f}", "--max-entries", str(args.max_entries)]
        command += ["--expandable-segments"] if args.expandable_segments else []
        try:
            done = subprocess.run(command, env=worker_environment(args.expandable_segments),
                                  timeout=share + KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            failed.append(f"{name} (still running {share + KILL_GRACE_S:.0f} s after it started: killed)")
            continue
        if done.returncode != 0:
            failed.append(f"{name} (exit status {done.returncode})")
    if failed:
        return fail("no snapshot from " + "; ".join(failed), status=1)
    return 0


def fail(message: str, status: int = 2) -> int:
    print(f"record_snapshots.py: error: {message}", file=sys.stderr)
    return status


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return record(args.worker, args) if args.worker else record_all(args)


if __name__ == "__main__":
    sys.exit(main())
