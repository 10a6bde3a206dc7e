#!/usr/bin/env python3
"""Two training jobs on one GPU: cotenant's launch gate against the other ways to share (needs a GPU).

A pair is a guaranteed job that leaves the GPU partly idle and an
opportunistic job that would take all of it:
  resnet50+transformer          ResNet-50 training, small batch, with a data-loading gap
                                as long as its compute (the GPU half idle), and a
                                GPT-style transformer training job
  inference-gaps+transformer    a transformer inference loop with gaps between
                                requests, and the same transformer training job

Each job runs alone first (solo), then both together under each mode, then
each alone again: a ratio is over the mean of the two solo runs, which
bracket the modes (a machine whose speed drifts during the benchmark moves
both), and the drift itself is a figure:
  naive            plain time-slicing between two CUDA contexts
  mps              the CUDA Multi-Process Service, when it can be started here
  priority         guaranteed on the highest-priority stream, opportunistic on the lowest
  cotenant-0.25    cotenant's gate with the opportunistic share fixed at 0.25
  cotenant-0.5     ... at 0.5
  cotenant-auto    cotenant's gate under a real `cotenant coordinator` on a private
                   socket: the coordinator's own policy (its solo-baseline
                   warm-up and AIMD, coordinator/policy.py) sets the share
                   through the opportunistic job's block, exactly as in use

Figures, per mode as "<mode>.<name>" and cotenant-auto also under the plain names:
  guaranteed_throughput_ratio      iterations/s together over solo (target >= 0.97)
  guaranteed_p50_ratio             median iteration time over solo
  guaranteed_p99_ratio             99th-percentile iteration time over solo (target <= 1.05)
  opportunistic_throughput_ratio   iterations/s together over solo (target >= 0.5)
  aggregate_normalized_throughput  the sum of the two throughput ratios
And, unprefixed:
  guaranteed_solo_drift            the guaranteed job's solo throughput after the modes over
                                   before them (1.0: the machine kept its speed)
  opportunistic_solo_drift         the same for the opportunistic job
And cotenant's own costs, each job alone:
  guaranteed_enabled_step_time_ratio  the guaranteed job's compute time with cotenant
                                      enabled without a role (its allocator, the op
                                      callbacks) over plain PyTorch
  guaranteed_tracker_step_time_ratio  its compute time as a guaranteed job over the
                                      same without a role: the busy/iteration
                                      tracker's own cost (target <= 1.005)
  guaranteed_cotenant_step_time_ratio its compute time as a guaranteed job over plain
                                      PyTorch: everything cotenant costs it
  gate_overhead_us_per_op             extra microseconds per op an opportunistic job pays
                                      at the gate with the GPU free (target <= 1)
  enabled_overhead_us_per_op          of those, what cotenant enabled without a role costs
                                      the same op (the op callbacks)

Writes benchmarks/results/colocate-<pair>-<device>-<time>.json (device, torch,
driver, benchmark, figures) and a PNG plot next to it.

Each job runs in its own process: `colocate.py --worker WORKLOAD --role ROLE --mode MODE ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import gpu_environment, result_base, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")

PAIRS = {
    "resnet50+transformer": ("resnet50-train", "transformer-train"),
    "inference-gaps+transformer": ("transformer-infer-gaps", "transformer-train"),
}
MODES = ("naive", "mps", "priority", "cotenant-0.25", "cotenant-0.5", "cotenant-auto")
WORKLOADS = ("resnet50-train", "transformer-train", "transformer-infer-gaps", "tiny-ops")
# The overhead runs' mode for a job with cotenant enabled and no role: its
# allocator and op callbacks without the launch gate or the busy tracker.
ENABLED_SOLO = "enabled-solo"
TINY_OPS_PER_STEP = 1000  # the tiny-ops workload: this many 1-element adds per step
FIGURE_NAMES = ("guaranteed_throughput_ratio", "guaranteed_p50_ratio", "guaranteed_p99_ratio",
                "opportunistic_throughput_ratio", "aggregate_normalized_throughput")
AUTO_MODE = "cotenant-auto"
TARGETS = {"guaranteed_throughput_ratio": (">=", 0.97), "guaranteed_p99_ratio": ("<=", 1.05),
           "opportunistic_throughput_ratio": (">=", 0.5)}


# ---- pure parts (unit-tested without a GPU) ---------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="resnet50+transformer")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes to run together (default: all)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per run")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--auto-settle-s", type=float, default=12.0,
                        help="cotenant-auto: seconds both jobs run before the measured ones, while the "
                             "coordinator's share climbs from 0 (+0.05 a decision, one every 0.5 s)")
    parser.add_argument("--gap-fraction", type=float, default=1.0,
                        help="the guaranteed job sleeps this fraction of its solo compute time per "
                             "iteration (1.0: the GPU is about half idle)")
    parser.add_argument("--solo-after", action=argparse.BooleanOptionalAction, default=True,
                        help="run each job alone again after the modes and take ratios over the mean of "
                             "both solo runs (--no-solo-after: over the first alone)")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("guaranteed", "opportunistic"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="solo", help=argparse.SUPPRESS)
    parser.add_argument("--gap-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--beside", action="store_true", help=argparse.SUPPRESS)  # another job runs too
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    if args.gap_fraction < 0:
        parser.error("--gap-fraction cannot be negative")
    if args.auto_settle_s < 0:
        parser.error("--auto-settle-s cannot be negative")
    if args.quick:
        args.seconds = min(args.seconds, 10.0)
        args.warmup_steps = min(args.warmup_steps, 5)
        args.auto_settle_s = min(args.auto_settle_s, 3.0)
    return args


def fixed_share(mode: str) -> Optional[float]:
    """The share a `cotenant-<share>` mode pins the opportunistic job to; None for
    every other mode (auto, the gated solo runs, the baselines)."""
    prefix = "cotenant-"
    if not mode.startswith(prefix) or mode == AUTO_MODE:
        return None
    return float(mode[len(prefix):])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize_iterations(iteration_s: Sequence[float]) -> Dict[str, float]:
    """Throughput (iterations/s over the measured time) and iteration-time quantiles."""
    total = sum(iteration_s)
    return {
        "iterations": len(iteration_s),
        "throughput": len(iteration_s) / total if total > 0 else 0.0,
        "p50_s": percentile(iteration_s, 50),
        "p99_s": percentile(iteration_s, 99),
    }


def _ratio(numerator: float, denominator: float) -> float:
    if not denominator or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


SOLO_AVERAGED = ("throughput", "p50_s", "p99_s", "compute_p50_s")


def bracketed_solo(before: Dict[str, Dict[str, float]],
                   after: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """Each role's solo summary as the mean of its runs before and after the
    modes: under a drift linear in time, what a solo run in the middle of
    the benchmark would have measured. Iterations add up."""
    solo = {}
    for role, first in before.items():
        second = after[role]
        solo[role] = {name: (first[name] + second[name]) / 2
                      for name in SOLO_AVERAGED if name in first and name in second}
        solo[role]["iterations"] = first.get("iterations", 0) + second.get("iterations", 0)
    return solo


def solo_drift(before: Dict[str, Dict[str, float]], after: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """`<role>_solo_drift`: each role's solo throughput after the modes over before them."""
    return {f"{role}_solo_drift": _ratio(after[role]["throughput"], before[role]["throughput"]) for role in before}


def mode_figures(solo: Dict[str, Dict[str, float]], together: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """The figures of one mode from the solo and co-located summaries of both roles."""
    g_solo, o_solo = solo["guaranteed"], solo["opportunistic"]
    g, o = together["guaranteed"], together["opportunistic"]
    g_tp = _ratio(g["throughput"], g_solo["throughput"])
    o_tp = _ratio(o["throughput"], o_solo["throughput"])
    return {
        "guaranteed_throughput_ratio": g_tp,
        "guaranteed_p50_ratio": _ratio(g["p50_s"], g_solo["p50_s"]),
        "guaranteed_p99_ratio": _ratio(g["p99_s"], g_solo["p99_s"]),
        "opportunistic_throughput_ratio": o_tp,
        "aggregate_normalized_throughput": g_tp + o_tp,
    }


def compute_figures(solo: Dict[str, Dict[str, float]], runs: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """`<mode>.<name>` for every mode that ran, and the auto mode's under the plain names.
    Modes that did not run (runs[mode] = {"skipped": reason}) have no figures."""
    figures: Dict[str, float] = {}
    for mode, run in runs.items():
        if "skipped" in run:
            continue
        for name, value in mode_figures(solo, run).items():
            figures[f"{mode}.{name}"] = value
            if mode == AUTO_MODE:
                figures[name] = value
    return figures


def targets_met(figures: Dict[str, float], mode: str = AUTO_MODE) -> Dict[str, bool]:
    """Each target for one mode, plus whether the mode beats every other mode measured
    on aggregate throughput while meeting the guaranteed job's targets."""
    met = {}
    for name, (op, bound) in TARGETS.items():
        value = figures.get(f"{mode}.{name}", math.nan)
        met[name] = (value >= bound) if op == ">=" else (value <= bound)
    others = {key.split(".")[0] for key in figures if "." in key and not key.startswith(mode + ".")}
    ours = figures.get(f"{mode}.aggregate_normalized_throughput", math.nan)
    met["best_aggregate_of_modes_meeting_guaranteed_targets"] = all(
        ours >= figures.get(f"{other}.aggregate_normalized_throughput", -math.inf)
        or figures.get(f"{other}.guaranteed_throughput_ratio", 0.0) < TARGETS["guaranteed_throughput_ratio"][1]
        for other in others)
    return met


def overhead_figures(plain_guaranteed: Dict[str, float], enabled_guaranteed: Dict[str, float],
                     tracked_guaranteed: Dict[str, float], plain_tiny: Dict[str, float],
                     enabled_tiny: Dict[str, float], gated_tiny: Dict[str, float]) -> Dict[str, float]:
    """cotenant's, the tracker's and the gate's own costs from runs of each job alone:
    plain PyTorch, cotenant enabled without a role, enabled as guaranteed."""
    plain, enabled, tracked = (run["compute_p50_s"] for run in (plain_guaranteed, enabled_guaranteed,
                                                                 tracked_guaranteed))
    return {
        "guaranteed_enabled_step_time_ratio": _ratio(enabled, plain),
        "guaranteed_tracker_step_time_ratio": _ratio(tracked, enabled),
        "guaranteed_cotenant_step_time_ratio": _ratio(tracked, plain),
        "gate_overhead_us_per_op": (gated_tiny["compute_p50_s"] - plain_tiny["compute_p50_s"])
        / TINY_OPS_PER_STEP * 1e6,
        "enabled_overhead_us_per_op": (enabled_tiny["compute_p50_s"] - plain_tiny["compute_p50_s"])
        / TINY_OPS_PER_STEP * 1e6,
    }


def worker_command(workload: str, role: str, mode: str, args: argparse.Namespace, gap_s: float,
                   sync_dir: str, beside: bool = False) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", workload, "--role", role, "--mode", mode,
            "--seconds", str(args.seconds), "--warmup-steps", str(args.warmup_steps), "--gap-s", str(gap_s),
            "--sync-dir", sync_dir] + (["--beside"] if beside else [])


def wait_for_go(go: str, keep_running: Optional[Callable[[], None]] = None) -> int:
    """Waits until the driver's file `go` exists. A guaranteed job beside
    another runs `keep_running` (one iteration, its gap included) meanwhile,
    as a running job does when another joins: under cotenant-auto the
    coordinator measures its solo baseline then, holding the opportunistic
    job at share 0 until it has, and sees no pause in its iterations. Under
    cotenant-auto the opportunistic job runs its steps too, for the
    driver's --auto-settle-s, while the coordinator raises its share.
    Returns the iterations run."""
    iterations = 0
    while not os.path.exists(go):
        if keep_running is None:
            time.sleep(0.01)
        else:
            keep_running()
            iterations += 1
    return iterations


# ---- workloads (worker processes) ------------------------------------------------------------


def _resnet50(torch):
    try:
        import torchvision

        return torchvision.models.resnet50()
    except ImportError:
        pass
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def _make_step(torch, workload: str):
    device = "cuda"
    if workload == "tiny-ops":
        x = torch.zeros(1, device=device)

        def step():
            for _ in range(TINY_OPS_PER_STEP):
                x.add_(1)
        return step
    if workload == "resnet50-train":
        model = _resnet50(torch).to(device).to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(16, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (16,), device=device)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        return step

    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 8).to(device)
    if workload == "transformer-train":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(16, 512, 1024, device=device)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
        return step

    model.eval()
    x = torch.randn(4, 256, 1024, device=device)

    def infer():
        import cotenant

        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), cotenant.gate.iteration():
            model(x)
            torch.cuda.synchronize()
    return infer


def run_worker(args: argparse.Namespace) -> Dict[str, Any]:
    import faulthandler

    import torch

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks where a late worker is

    mode, role = args.mode, args.role
    if mode.startswith("cotenant") or mode in ("gated-solo", ENABLED_SOLO):
        import cotenant

        cotenant.enable(role=None if mode == ENABLED_SOLO else role, device=0)
        share = fixed_share(mode)
        if role == "opportunistic" and share is not None:
            cotenant.gate.set_share(share)
    if mode == "priority":
        least, greatest = torch.cuda.Stream.priority_range()
        torch.cuda.set_stream(torch.cuda.Stream(priority=greatest if role == "guaranteed" else least))

    step = _make_step(torch, args.worker)
    compute_s = []
    for _ in range(args.warmup_steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        compute_s.append(time.perf_counter() - start)
    ready = os.path.join(args.sync_dir, f"{role}.ready")
    with open(ready, "w") as f:
        json.dump({"compute_p50_s": percentile(compute_s, 50)}, f)
    def one_iteration() -> None:
        step()
        torch.cuda.synchronize()
        if args.gap_s > 0:
            time.sleep(args.gap_s)

    def one_step() -> None:
        step()
        torch.cuda.synchronize()

    # Beside another job the guaranteed one runs on until the measured
    # seconds; under cotenant-auto the opportunistic one does too, so the
    # coordinator's share settles under the load it will be measured in.
    keep_running = None
    if args.beside and role == "guaranteed":
        keep_running = one_iteration
    elif args.beside and mode == AUTO_MODE:
        keep_running = one_step
    iterations_before_go = wait_for_go(os.path.join(args.sync_dir, "go"), keep_running)

    iteration_s: List[float] = []
    compute_s = []
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        compute_s.append(time.perf_counter() - start)
        if args.gap_s > 0:
            time.sleep(args.gap_s)  # the guaranteed job's data loading: the GPU idles
        iteration_s.append(time.perf_counter() - start)
    summary = summarize_iterations(iteration_s)
    summary["compute_p50_s"] = percentile(compute_s, 50)
    summary["mode"], summary["role"], summary["workload"] = mode, role, args.worker
    summary["iterations_before_go"] = iterations_before_go
    if mode.startswith("cotenant") or mode == "gated-solo":
        import cotenant

        summary["gate"] = cotenant.gate.stats()  # a gated solo run's markers and waits too
    return summary


# ---- the driver -----------------------------------------------------------------------------


class Mps:
    """Starts the MPS control daemon for the duration of a run, if this machine allows it."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="cotenant-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}
        self.reason: Optional[str] = None

    def start(self) -> bool:
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            self.reason = "nvidia-cuda-mps-control is not installed"
            return False
        for path in self.env.values():
            os.makedirs(path, exist_ok=True)
        result = subprocess.run([control, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True)
        if result.returncode != 0:
            self.reason = f"nvidia-cuda-mps-control -d failed: {result.stderr.strip() or result.returncode}"
            return False
        time.sleep(1.0)
        return True

    def stop(self) -> None:
        control = shutil.which("nvidia-cuda-mps-control")
        if control:
            subprocess.run([control], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                           text=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(args, mode: str, roles: Dict[str, str], gap_s: float,
         extra_env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Runs the given roles together (one role: solo) and returns each role's summary."""
    sync_dir = tempfile.mkdtemp(prefix="cotenant-colocate-")
    segment = f"/cotenant-colocate-{os.getpid()}-{mode}"
    env = {**os.environ, **(extra_env or {}), "COTENANT_GPU_SEGMENT": segment}
    coordinator = None
    if mode == AUTO_MODE and "opportunistic" in roles:
        coordinator, env["COTENANT_SOCKET"] = start_coordinator(sync_dir)
    processes = {}
    for role, workload in roles.items():
        out = open(os.path.join(sync_dir, f"{role}.json"), "w")
        processes[role] = (subprocess.Popen(
            worker_command(workload, role, mode, args, gap_s if role == "guaranteed" else 0.0, sync_dir,
                           beside=len(roles) > 1),
            env=env, stdout=out), out)
    try:
        deadline = time.monotonic() + WORKER_START_S
        while not all(os.path.exists(os.path.join(sync_dir, f"{r}.ready")) for r in roles):
            for role, (p, _) in processes.items():
                if p.poll() is not None:
                    raise RuntimeError(f"the {role} worker of mode {mode} exited with {p.returncode} before starting")
            if time.monotonic() > deadline:
                if coordinator is not None:
                    _print_coordinator_view(env["COTENANT_SOCKET"])
                _dump_stacks_of(processes)
                raise RuntimeError(f"the workers of mode {mode} were not ready after {WORKER_START_S:.0f} s "
                                   "(their threads' stacks are in the log)")
            time.sleep(0.05)
        if mode == AUTO_MODE and len(roles) > 1:
            time.sleep(args.auto_settle_s)  # both run meanwhile (wait_for_go): the share settles
        open(os.path.join(sync_dir, "go"), "w").close()
        deadline = time.monotonic() + args.seconds + WORKER_FINISH_S
        results = {}
        for role, (p, out) in processes.items():
            try:
                p.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _dump_stacks_of(processes)
                raise RuntimeError(f"the {role} worker of mode {mode} did not finish {WORKER_FINISH_S:.0f} s after "
                                   "its measured seconds (its threads' stacks are in the log)") from None
            out.close()
            with open(os.path.join(sync_dir, f"{role}.json")) as f:
                lines = f.read().strip().splitlines()
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"the {role} worker of mode {mode} failed (exit {p.returncode})")
            results[role] = json.loads(lines[-1])
        return results
    finally:
        for p, out in processes.values():
            if p.poll() is None:
                p.kill()
            out.close()
        if coordinator is not None:
            coordinator.terminate()
            coordinator.wait(10)
        shutil.rmtree(sync_dir, ignore_errors=True)
        try:
            from cotenant import _core

            _core.GpuPeerSegment.remove(segment)
        except Exception:  # noqa: BLE001 (cleanup only)
            pass


# How long a worker may take to load and warm up, and to finish after its
# measured seconds, before the run is given up (a worker that hangs must not
# take the whole benchmark with it).
WORKER_START_S = 180.0
WORKER_FINISH_S = 60.0


def _dump_stacks_of(processes) -> None:
    """Asks each live worker to print its threads' stacks (to the log) before it is killed."""
    for p, _ in processes.values():
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)


def _print_coordinator_view(socket_path: str) -> None:
    """Prints what the coordinator decided for each job (share, baseline,
    slowdown, iterations) to stderr: why a worker under cotenant-auto is late."""
    from cotenant.coordinator import client

    try:
        jobs = client.status(socket_path)["jobs"]
    except Exception as error:  # noqa: BLE001 - a view for the log, never a second failure
        print(f"colocate: the coordinator's status could not be read: {error}", file=sys.stderr)
        return
    for job in jobs:
        view = {k: job.get(k) for k in ("name", "role", "share", "applied_share", "effective_share", "baseline_us",
                                         "slowdown", "iteration_ewma_us", "iteration_count")}
        print(f"colocate: coordinator's view: {json.dumps(view)}", file=sys.stderr)


def result_document(env: Dict[str, Any], args: argparse.Namespace, pair: Dict[str, str], gap_s: float,
                    figures: Dict[str, float], solo: Dict[str, Any], runs: Dict[str, Dict[str, Any]],
                    complete: bool, solo_runs: Dict[str, Any]) -> Dict[str, Any]:
    """The result file's content; `complete` is false while modes (or the
    gate's overhead runs) are still to come. `solo` is what the ratios are
    over; `solo_runs` the solo runs it came from ("before", "after")."""
    return {**env, "benchmark": "colocate", "pair": args.pair, "workloads": pair, "complete": complete,
            "solo_runs": solo_runs,
            "seconds_per_run": args.seconds, "auto_settle_s": args.auto_settle_s, "guaranteed_gap_s": gap_s,
            "figures": figures,
            "targets_met": targets_met(figures) if f"{AUTO_MODE}.guaranteed_throughput_ratio" in figures else {},
            "skipped": {m: r["skipped"] for m, r in runs.items() if "skipped" in r},
            "solo": solo, "runs": {m: r for m, r in runs.items() if "skipped" not in r}}


def start_coordinator(directory: str, timeout_s: float = 30.0):
    """Starts the product's coordinator (`python -m cotenant.cli coordinator`) on a
    private socket in `directory`; returns (process, socket path) once it serves."""
    socket_path = os.path.join(directory, "coordinator.sock")
    process = subprocess.Popen([sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", socket_path],
                               stdout=subprocess.DEVNULL, stderr=open(os.path.join(directory, "coordinator.log"), "w"))
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(socket_path):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the coordinator did not start (see {directory}/coordinator.log)")
        time.sleep(0.05)
    return process, socket_path


def _plot(figures: Dict[str, float], modes: Sequence[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in modes if f"{m}.guaranteed_throughput_ratio" in figures]
    names = ("guaranteed_throughput_ratio", "opportunistic_throughput_ratio", "aggregate_normalized_throughput")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(shown))], [figures[f"{m}.{name}"] for m in shown], width,
               label=name.replace("_", " "))
    ax.axhline(0.97, color="k", linestyle="--", linewidth=0.8, label="guaranteed target 0.97")
    ax.set_xticks([x + width for x in range(len(shown))])
    ax.set_xticklabels(shown)
    ax.set_ylabel("throughput over solo")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return 0

    guaranteed_workload, opportunistic_workload = PAIRS[args.pair]
    # Solo runs: the guaranteed job's gap is its solo compute time times --gap-fraction.
    probe = _run(args, "solo", {"guaranteed": guaranteed_workload}, 0.0)
    gap_s = probe["guaranteed"]["p50_s"] * args.gap_fraction
    solo = {"guaranteed": _run(args, "solo", {"guaranteed": guaranteed_workload}, gap_s)["guaranteed"],
            "opportunistic": _run(args, "solo", {"opportunistic": opportunistic_workload}, 0.0)["opportunistic"]}

    pair = {"guaranteed": guaranteed_workload, "opportunistic": opportunistic_workload}
    runs: Dict[str, Dict[str, Any]] = {}
    env = gpu_environment()
    base = result_base(args.out, f"colocate-{args.pair.replace('+', '-')}", env["device"])

    solo_runs: Dict[str, Any] = {"before": solo}

    def save(figures: Dict[str, float], complete: bool) -> None:
        # After every mode too: a run stopped part-way (a device call's time
        # limit) keeps the modes it measured.
        write_json(result_document(env, args, pair, gap_s, figures, solo, runs, complete, solo_runs), base + ".json")

    for mode in args.modes:
        print(f"colocate: {mode} ...", file=sys.stderr, flush=True)
        mps = Mps() if mode == "mps" else None
        try:
            if mps is not None and not mps.start():
                runs[mode] = {"skipped": mps.reason}
                continue
            runs[mode] = _run(args, mode, pair, gap_s, mps.env if mps else None)
        except RuntimeError as error:
            runs[mode] = {"skipped": str(error)}
        finally:
            if mps is not None:
                mps.stop()
        save(compute_figures(solo, runs), complete=False)

    drift: Dict[str, float] = {}
    if args.solo_after:
        print("colocate: each job alone again ...", file=sys.stderr, flush=True)
        try:
            after = {"guaranteed": _run(args, "solo", {"guaranteed": guaranteed_workload}, gap_s)["guaranteed"],
                     "opportunistic": _run(args, "solo", {"opportunistic": opportunistic_workload},
                                           0.0)["opportunistic"]}
            solo_runs["after"] = after
            solo = bracketed_solo(solo_runs["before"], after)
            drift = solo_drift(solo_runs["before"], after)
        except RuntimeError as error:
            runs["solo-after"] = {"skipped": str(error)}  # the ratios stay over the first solo runs
    figures = {**compute_figures(solo, runs), **drift}
    print("colocate: the gate's overhead ...", file=sys.stderr, flush=True)
    try:
        enabled = _run(args, ENABLED_SOLO, {"guaranteed": guaranteed_workload}, gap_s)["guaranteed"]
        tracked = _run(args, "gated-solo", {"guaranteed": guaranteed_workload}, gap_s)["guaranteed"]
        plain_tiny = _run(args, "solo", {"opportunistic": "tiny-ops"}, 0.0)["opportunistic"]
        enabled_tiny = _run(args, ENABLED_SOLO, {"opportunistic": "tiny-ops"}, 0.0)["opportunistic"]
        # k unbounded: this measures the gate's bookkeeping per op, not the
        # in-flight bound's deliberate wait for the GPU.
        gated_tiny = _run(args, "gated-solo", {"opportunistic": "tiny-ops"}, 0.0,
                          {"COTENANT_GATE_MAX_IN_FLIGHT": "1000000"})["opportunistic"]
        figures.update(overhead_figures(solo["guaranteed"], enabled, tracked, plain_tiny, enabled_tiny, gated_tiny))
    except RuntimeError as error:
        runs["overhead"] = {"skipped": str(error)}
    save(figures, complete=True)
    _plot(figures, args.modes, base + ".png", f"{args.pair} on {env['device']}")
    print(json.dumps(figures, indent=2, sort_keys=True))
    print(f"wrote {base}.json and {base}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
