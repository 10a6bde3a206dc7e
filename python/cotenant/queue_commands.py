"""The queue's side of the `cotenant` command: `run --queue`, `submit`, `cancel`,
the queue in `status`, and the coordinator's `--scheduler` options."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

EXIT_USAGE = 2


# --- the coordinator's policy ---------------------------------------------------------


def add_scheduler_arguments(p: argparse.ArgumentParser) -> None:
    from cotenant.scheduling.command import _thresholds
    from cotenant.scheduling.policies import POLICIES

    p.add_argument("--scheduler", default="fifo", choices=list(POLICIES),
                   help="the job queue's policy: fifo, las (Tiresias' 2D-LAS), timeslice (Gandiva), antman "
                        "(default fifo); see docs/scheduling.md")
    p.add_argument("--quantum", type=float, default=60.0, help="timeslice: quantum in seconds (default 60)")
    p.add_argument("--las-thresholds", type=_thresholds, default=(3600.0,), metavar="GPU_S,...",
                   help="las: queue thresholds in GPU-seconds of attained service (default 3600)")
    p.add_argument("--starvation-factor", type=float, default=2.0, help="las: starvation limit (default 2; 0: off)")


def scheduler_options(args: argparse.Namespace) -> Dict[str, Any]:
    from cotenant.scheduling.command import policy_options

    return policy_options(args).get(args.scheduler, {})


# --- run --queue and submit -------------------------------------------------------------


def add_queue_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queue", action="store_true",
                   help="wait in the coordinator's queue and start the program once admitted, on the GPUs it "
                        "gives (COTENANT_DEVICE, COTENANT_QUEUE_GPUS)")
    p.add_argument("--gpus", type=int, default=1, help="with --queue: how many GPUs the job needs (default 1)")
    p.add_argument("--peak", help="with --queue: the job's peak memory per GPU, e.g. 30GiB, for admission")


def refuses_cap_only(args: argparse.Namespace) -> bool:
    """Says so, and returns True, for a --cap-only job asked to wait in the
    queue: the queue's policy runs every job it admits as guaranteed or
    opportunistic, with the launch gate, which --cap-only asked not to have."""
    if not getattr(args, "cap_only", False):
        return False
    print("cotenant: --cap-only cannot wait in the queue (--queue, submit): the queue's policy runs each job it "
          "admits as guaranteed or opportunistic, with the launch gate; give --guaranteed or --opportunistic, "
          "or run it without --queue", file=sys.stderr)
    return True


def wait_for_admission(args: argparse.Namespace, env: Dict[str, str], on_queued=None) -> Optional[int]:
    """Queues this process and blocks until admitted; then points `env` at the GPUs and the
    role the coordinator chose. Returns an exit code on failure, None once admitted."""
    from cotenant.coordinator import client

    if args.gpus < 1:
        print(f"cotenant: --gpus must be at least 1, not {args.gpus}", file=sys.stderr)
        return EXIT_USAGE
    if refuses_cap_only(args):
        return EXIT_USAGE
    if args.peak:
        from cotenant.cli import _parse_size

        _parse_size(args.peak)
    try:
        state = client.wait_for_admission(
            args.socket, name=args.name, role="guaranteed" if args.guaranteed else "opportunistic",
            gpus=args.gpus, persistent_bytes=args.persistent, peak_bytes=args.peak, on_queued=on_queued)
    except client.CoordinatorUnavailable as error:
        print(f"cotenant: --queue needs a coordinator: {error}", file=sys.stderr)
        return 1
    except client.CoordinatorError as error:  # refused or cancelled
        print(f"cotenant: the job did not start: {error}", file=sys.stderr)
        return 1
    env["COTENANT_DEVICE"] = str(state["gpus"][0])
    env["COTENANT_QUEUE_GPUS"] = ",".join(str(g) for g in state["gpus"])
    env["COTENANT_ROLE"] = state.get("role") or env.get("COTENANT_ROLE", "guaranteed")
    env["COTENANT_JOB_NAME"] = state["name"]
    return None


def cmd_submit(args: argparse.Namespace) -> int:
    """Queues the command and returns at once; a waiter process starts it once admitted."""
    from cotenant import launch
    from cotenant.cli import cannot_enable, child_environment, command_after_dashes

    command = command_after_dashes(args, "submit")
    if command is None or refuses_cap_only(args):
        return EXIT_USAGE
    env = child_environment(args)
    if cannot_enable(args, command, env, "submit"):
        return launch.EXIT_NOT_ENABLED
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the waiter: its pid is the job's, from the queue to the program's end
        os.close(read_end)
        os.setsid()
        _redirect(args.log)

        def report(state: Dict[str, Any]) -> None:
            os.write(write_end, json.dumps(state).encode() + b"\n")

        code = wait_for_admission(args, env, on_queued=report)
        if code is not None:
            os.write(write_end, json.dumps({"error": True}).encode() + b"\n")
            os._exit(code)
        os.close(write_end)
        try:
            launch.exec_job(command, env)
        except OSError as error:
            sys.stderr.write(f"cotenant submit: cannot start {command[0]!r}: {error}\n")
            os._exit(127)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        line = pipe.readline()
    try:
        state = json.loads(line)
    except ValueError:
        state = {"error": True}
    if state.get("error"):
        print("cotenant submit: the job was not queued" + (f"; see {args.log}" if args.log else
              " (no coordinator, or it refused the job; `cotenant run --queue` says why)"), file=sys.stderr)
        return 1
    where = f"position {state['position']}" if state.get("position") else state["state"]
    print(f"{state['name']}: queued as ticket {state['ticket']} ({where}); waiter pid {pid}")
    return 0


def _redirect(log: Optional[str]) -> None:
    target = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(target, 1)
    os.dup2(target, 2)


def add_queue_commands(sub, add_run_arguments) -> None:
    """`submit` (the arguments of `run`, through add_run_arguments) and `cancel`."""
    p = sub.add_parser("submit", help="queue a command as a cotenant job and return at once")
    add_run_arguments(p)
    p.add_argument("--log", help="file for the program's output (default: discarded)")
    p.set_defaults(func=cmd_submit, queue=True)

    p = sub.add_parser("cancel", help="remove a waiting job from the queue")
    p.add_argument("--socket", help="coordinator socket")
    p.add_argument("job", help="queued job name or ticket")
    p.set_defaults(func=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    from cotenant.coordinator import client

    reply = client.cancel(args.job, args.socket)
    print(f"{reply['job']}: cancelled (ticket {reply['ticket']})")
    return 0


# --- status -------------------------------------------------------------------------------

QUEUE_COLUMNS = ("TICKET", "JOB", "PID", "STATE", "POSITION", "PRIORITY", "GPUS", "ROLE", "SERVICE")


def format_queue(queue: List[Dict[str, Any]]) -> List[str]:
    if not queue:
        return []
    rows = [list(QUEUE_COLUMNS)]
    for q in queue:
        rows.append([
            str(q["ticket"]), q["name"], str(q["pid"]),
            q["state"] + (f" (GPU {','.join(str(g) for g in q['missing_gpus'])} not here)"
                          if q.get("missing_gpus") else ""),
            str(q["position"] or "-"),
            "-" if q["priority"] is None else str(q["priority"]),
            ",".join(str(g) for g in q["gpus"]) or f"({q['num_gpus']})", q["role"] or "-",
            f"{q['attained_gpu_s']:.1f} GPU-s",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(QUEUE_COLUMNS))]
    return ["", "queue:"] + ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
