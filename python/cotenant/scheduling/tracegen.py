"""Generates job traces in Tiresias' format, for `cotenant simulate`.

    python -m cotenant.scheduling.tracegen --jobs 120 --gpus 8 --load 1.2 --seed 1 -o trace.csv

What is drawn, and from what:
  * GPUs per job: the mix of Tiresias' 60-job trace (half the jobs 1 GPU, the
    rest 2, 4 and 8 equally), jobs wider than the node left out;
  * run time alone: log-normal, heavy-tailed as the Tiresias and Philly
    analyses describe (most jobs minutes, a few hours): median `--median-minutes`,
    sigma `--sigma`, cut at `--max-hours`;
  * arrivals: a Poisson process whose rate makes the offered load (GPU-seconds
    asked for per GPU-second the node has) equal `--load`;
  * the model: one of Tiresias' ten, uniformly, which sets the memory
    (trace.MODEL_MEMORY) and the iteration count (iteration times of 0.1-0.5 s);
  * utilization: uniform in [`--min-utilization`, 1]: AntMan and Gandiva
    report that many jobs leave their GPUs partly idle; the range is ours;
  * role: opportunistic with probability `--opportunistic`, else left to the policy.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from typing import List, Optional

from cotenant.scheduling.trace import MODEL_MEMORY

GPU_MIX = ((1, 0.5), (2, 1 / 6), (4, 1 / 6), (8, 1 / 6))
COLUMNS = ("job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration", "interval",
           "persistent_memory", "peak_memory", "role", "utilization")


def generate(jobs: int, gpus: int, load: float, seed: int, median_minutes: float = 15.0, sigma: float = 1.5,
             max_hours: float = 8.0, min_utilization: float = 0.3, opportunistic: float = 0.0) -> List[dict]:
    if jobs < 1 or gpus < 1 or not load > 0:
        raise ValueError("--jobs and --gpus must be at least 1 and --load positive")
    if not 0 < min_utilization <= 1 or not 0 <= opportunistic <= 1:
        raise ValueError("--min-utilization must be in (0, 1] and --opportunistic in [0, 1]")
    rng = random.Random(seed)
    mix = [(n, p) for n, p in GPU_MIX if n <= gpus]
    widths, weights = zip(*mix)
    models = sorted(MODEL_MEMORY)
    drawn = []
    for _ in range(jobs):
        width = rng.choices(widths, weights)[0]
        duration = min(max_hours * 3600, max(60.0, rng.lognormvariate(math.log(median_minutes * 60), sigma)))
        drawn.append((width, round(duration)))
    # Mean gap between arrivals so that the GPU-seconds asked for match load x capacity.
    mean_gap = sum(w * d for w, d in drawn) / jobs / (gpus * load)
    rows, now = [], 0.0
    for job_id, (width, duration) in enumerate(drawn):
        model = rng.choice(models)
        persistent, peak = MODEL_MEMORY[model]
        rows.append({
            "job_id": job_id, "num_gpu": width, "submit_time": round(now), "model_name": model,
            "iterations": max(1, round(duration / rng.uniform(0.1, 0.5))), "duration": duration, "interval": 0,
            "persistent_memory": persistent, "peak_memory": peak,
            "role": "opportunistic" if rng.random() < opportunistic else "",
            "utilization": round(rng.uniform(min_utilization, 1.0), 2),
        })
        now += rng.expovariate(1.0 / mean_gap)
    return rows


def write(rows: List[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cotenant.scheduling.tracegen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the node the load is for")
    parser.add_argument("--load", type=float, default=1.0, help="offered load: GPU-seconds asked per GPU-second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--median-minutes", type=float, default=15.0)
    parser.add_argument("--sigma", type=float, default=1.5)
    parser.add_argument("--max-hours", type=float, default=8.0)
    parser.add_argument("--min-utilization", type=float, default=0.3)
    parser.add_argument("--opportunistic", type=float, default=0.0, help="fraction of jobs marked opportunistic")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    try:
        rows = generate(args.jobs, args.gpus, args.load, args.seed, args.median_minutes, args.sigma, args.max_hours,
                        args.min_utilization, args.opportunistic)
    except ValueError as error:
        print(f"tracegen: {error}", file=sys.stderr)
        return 2
    write(rows, args.output)
    print(f"wrote {args.output} ({len(rows)} jobs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
