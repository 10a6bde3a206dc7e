#!/usr/bin/env python3
"""What cotenant's op hooks cost the CPU that launches a job's ops, against
plain PyTorch in the same run (no GPU needed).

Every ATen op of a job with cotenant enabled passes the interception point
(csrc/torch/op_interceptor.h): one RecordFunction callback, the allocator's
safe-point check at entry, and per role the launch gate (opportunistic) or
the busy tracker (guaranteed) at entry and exit. That work runs on the CPU
thread that launches the op, so a training step bound by its launches pays
it in full; on a GPU, colocate.py's guaranteed_enabled_step_time_ratio and
guaranteed_tracker_step_time_ratio measure it with the kernels. Here each
mode runs in its own process with torch over the fake CUDA runtime of
tests/fake_cuda (benchmarks/pytorch_allocator/over_fake.py), on CPU tensors:
the hooks' code is the product's, the ops' kernels run on the CPU.

Modes: plain (cotenant not imported), enabled (no role), guaranteed,
opportunistic. Per mode:
  tiny_op_us        one torch.add(a, b, out=a) on 1-element tensors (best of --repeats)
  step_us           one training step of a small MLP on the CPU (forward, backward, SGD)
  ops_per_step      outermost ATen ops the step runs (the interception point's count)
  markers_per_step  completion markers the busy tracker records a step (guaranteed)
  runtime_calls_per_op  CUDA runtime and driver calls per tiny op (the fake counts them)
and over plain: overhead_us_per_op (tiny ops), step_ratio.

What it leaves out: a CUDA call costs next to nothing over the fake (the
call counts show them; on a GPU an event record costs microseconds), an
opportunistic job's CPU ops pass its gate unadmitted (only its ops that
name the GPU wait and record markers), and a GPU's kernels. Writes
results/op_hooks_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "pytorch_allocator"))
from result_file import cpu_model, torch_version, write_json  # noqa: E402

MODES = ("plain", "enabled", "guaranteed", "opportunistic")
DEFAULT_OUT = os.path.join(HERE, "results", "op_hooks_cpu.json")


def worker(mode: str, library: str, ops: int, steps: int, repeats: int) -> Dict:
    import over_fake

    fake = over_fake.open_preloaded(library, 8 << 30)
    import torch

    over_fake.check_torch_sees_the_fake(torch)
    _C = None
    if mode != "plain":
        import cotenant
        from cotenant import _C

        cotenant.enable(role=None if mode == "enabled" else mode, device=0)
    torch.manual_seed(0)
    # One thread: the ops are tiny, and an intra-op pool's spinning threads
    # would time the machine's other cores, not the hooks.
    torch.set_num_threads(1)
    a, b = torch.zeros(1), torch.zeros(1)

    def tiny(n: int) -> None:
        for _ in range(n):
            torch.add(a, b, out=a)

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                      torch.nn.ReLU()) for _ in range(16)])
    x = torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    def best(call, n: int) -> float:
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            call(n)
            times.append((time.perf_counter() - began) / n)
        return min(times)

    tiny(ops // 4)
    calls_before = sum(fake.all_calls().values())
    tiny_s = best(tiny, ops)
    runtime_calls = sum(fake.all_calls().values()) - calls_before
    for _ in range(steps // 4 + 1):
        step()
    markers_before = _C.gate_stats().get("busy_markers_recorded", 0) if _C else 0
    step_s = best(lambda n: [step() for _ in range(n)], steps)
    out = {"mode": mode, "tiny_op_us": tiny_s * 1e6, "step_us": step_s * 1e6,
           "runtime_calls_per_op": runtime_calls / (ops * repeats)}
    if _C is not None:
        out["markers_per_step"] = (_C.gate_stats().get("busy_markers_recorded", 0) - markers_before) / (steps * repeats)
        _C._count_op_entries(True)
        before = _C._counted_op_entries()
        step()
        out["ops_per_step"] = _C._counted_op_entries() - before
        _C._count_op_entries(False)
    out["violations"] = fake.violations()
    return out


def run_mode(mode: str, library: str, args) -> Dict:
    import over_fake

    env = over_fake.environment(library)
    command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--fake-library", library,
               "--ops", str(args.ops), "--steps", str(args.steps), "--repeats", str(args.repeats)]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"the {mode} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def figures(runs: Dict[str, Dict]) -> Dict[str, float]:
    plain = runs["plain"]
    out: Dict[str, float] = {}
    for mode, run in runs.items():
        if mode == "plain":
            continue
        out[f"{mode}.overhead_us_per_op"] = run["tiny_op_us"] - plain["tiny_op_us"]
        out[f"{mode}.step_ratio"] = run["step_us"] / plain["step_us"]
    return out


def table(runs: Dict[str, Dict], figs: Dict[str, float]) -> List[str]:
    lines = [f"{'mode':<14} {'tiny op µs':>10} {'+µs/op':>7} {'step µs':>9} {'x plain':>8} {'ops/step':>8} "
             f"{'markers/step':>12} {'CUDA calls/op':>13}"]
    for mode, run in runs.items():
        extra = figs.get(f"{mode}.overhead_us_per_op")
        ratio = figs.get(f"{mode}.step_ratio")
        lines.append(f"{mode:<14} {run['tiny_op_us']:10.2f} {'-' if extra is None else f'{extra:+.2f}':>7} "
                     f"{run['step_us']:9.0f} {'-' if ratio is None else f'{ratio:.3f}':>8} "
                     f"{run.get('ops_per_step', '-'):>8} {run.get('markers_per_step', 0):12.1f} "
                     f"{run['runtime_calls_per_op']:13.2f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake-cudart", help="directory of the fake libcudart.so.N (default: the core build's)")
    parser.add_argument("--ops", type=int, default=50_000, help="tiny ops per timed repeat")
    parser.add_argument("--steps", type=int, default=40, help="training steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per mode (the best counts)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times each mode runs, interleaved with the others (the best counts)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="result JSON (default: results/op_hooks_cpu.json)")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--fake-library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.fake_library, args.ops, args.steps, args.repeats)))
        return 0
    import over_fake

    library = over_fake.fake_library(args.fake_cudart)
    runs: Dict[str, Dict] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            run = run_mode(mode, library, args)
            kept = runs.get(mode)
            if kept is None:
                runs[mode] = run
            else:  # the best of the rounds, per figure
                kept["tiny_op_us"] = min(kept["tiny_op_us"], run["tiny_op_us"])
                kept["step_us"] = min(kept["step_us"], run["step_us"])
                kept["violations"] = kept["violations"] + run["violations"]
    violations = {mode: run["violations"] for mode, run in runs.items() if run["violations"]}
    if violations:
        raise SystemExit(f"the fake CUDA runtime saw driver-rule violations: {violations}")
    figs = figures(runs)
    print("\n".join(table(runs, figs)))
    result = {"benchmark": "op_hooks", "device": f"CPU: {cpu_model()} (torch over the fake CUDA runtime)",
              "torch": torch_version(), "settings": {"ops": args.ops, "steps": args.steps, "repeats": args.repeats,
                                                     "rounds": args.rounds},
              "figures": figs, "runs": runs}
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
