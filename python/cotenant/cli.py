"""The `cotenant` command: coordinator, status, set-cap, set-share, run, timeline, simulate, cluster."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional

EXIT_USAGE = 2


def _parse_size(text: str) -> int:
    from cotenant._core import parse_size  # the one parser for sizes

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parse_cap(text: str):
    """A cap through the one parser (cotenant._core.Cap): "6GiB", "0.5", "50%", "none"."""
    from cotenant import _core

    try:
        return _core.Cap(text)
    except _core.Error as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _format_size(value: Optional[int]) -> str:
    if value is None:
        return "-"
    from cotenant._core import format_size

    return format_size(value)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, not {text!r}")
    return port


def _gpu_list(text: str) -> List[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes GPU indices separated by commas, like 0,1; not {text!r}") from None


def _device_index(text: str) -> int:
    from cotenant.api import parse_device  # the one parser for devices, enable()'s

    try:
        index = parse_device(text)
    except (TypeError, ValueError):
        index = None
    if index is None:  # "cuda" alone names no device
        raise argparse.ArgumentTypeError(f"{text} is no CUDA device index; give a number from 0, such as 0 or 1, "
                                         "or cuda:1 (as CUDA_VISIBLE_DEVICES numbers the GPUs)")
    return index


def _interval(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 86400:  # also nan
        raise argparse.ArgumentTypeError(f"seconds between refreshes: a number more than 0 (such as 1 or 0.5), "
                                         f"not {text!r}")
    return seconds


# --- status ------------------------------------------------------------------

COLUMNS = ("GPU", "JOB", "PID", "ROLE", "STATE", "CAP", "DEVICE", "HOST", "SHARE", "ITER/BASE")


def short_gpu(key: str) -> str:
    """A GPU's key as the job table shows it: a UUID's first group ("GPU-5f1c0d3e"), or "index:N"."""
    return key[:12] if key.startswith("GPU-") else key


def job_state(job: Dict[str, Any]) -> str:
    """What a job is doing: queued (waiting for admission), suspended (its memory on
    the host), throttled (an opportunistic job held below its full share), running;
    else the job's own state (starting, exited)."""
    state = job["state"]
    if state in ("queued", "suspended"):
        return state
    if state == "running" and job["role"] == "opportunistic" and job["share"] < 1.0:
        return "throttled"
    return state


def gpu_lines(view: Dict[str, Any]) -> List[str]:
    """One line per GPU: its UUID, index, memory, and what its jobs hold and have moved;
    then one for the node's host memory and what the jobs pin in it."""
    lines = []
    for gpu in view.get("gpus", []):
        where = f" (index {gpu['index']})" if gpu.get("index") is not None else ""
        jobs = gpu.get("jobs", 0)
        pool = gpu.get("host_pool_bytes", 0)
        pinned = f" (and {_format_size(pool)} pinned for spills)" if pool else ""
        lines.append(
            f"{gpu['gpu']}{where}: {_format_size(gpu.get('total_bytes'))} total, "
            f"{_format_size(gpu.get('device_bytes', 0))} on the device and {_format_size(gpu.get('host_bytes', 0))} "
            f"on the host{pinned} for {jobs} job{'s' if jobs != 1 else ''}; spilled {_format_size(gpu.get('spilled_bytes', 0))},"
            f" restored {_format_size(gpu.get('restored_bytes', 0))}, {gpu.get('page_moves', 0)} page moves")
        if gpu.get("note"):
            lines.append(f"  note: {gpu['note']}")
    host = view.get("host")
    if host:
        pinned = _format_size(host.get("pinned_by_jobs_bytes", 0))
        held = host.get("held_back_bytes", 0)
        held = f"; squeezes held back by {_format_size(held)}" if held else ""
        if host.get("total_bytes") is not None:
            lines.append(f"host memory: {pinned} pinned by jobs (spilled tensors, pages kept for spills) of "
                         f"{_format_size(host['total_bytes'])}; {_format_size(host['available_bytes'])} available"
                         f"{held}")
        else:
            lines.append(f"host memory: {pinned} pinned by jobs (spilled tensors, pages kept for spills){held}")
        if host.get("note"):
            lines.append(f"  note: {host['note']}")
    return lines


def status_rows(view: Dict[str, Any]) -> List[List[str]]:
    rows = []
    for job in view["jobs"]:
        slowdown = job.get("slowdown")
        if slowdown is not None:
            ratio = f"{slowdown:.2f}x"
        elif job["role"] == "guaranteed" and job.get("iteration_count", 0):
            ratio = "warm-up"
        else:
            ratio = "-"
        share = f"{job['share']:.2f}" + ("*" if job.get("share_pinned") else "")
        gpu = short_gpu(job["gpu_key"]) if job.get("gpu_key") else str(job["gpu"])
        rows.append([
            gpu, f"{job['name']} ({job['job_id']})", str(job["pid"]), job["role"], job_state(job),
            _format_size(job["cap"]), _format_size(job["device_bytes"]), _format_size(job["host_bytes"]), share, ratio,
        ])
    return rows


def format_status(view: Dict[str, Any]) -> str:
    rows = [list(COLUMNS)] + status_rows(view)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = gpu_lines(view)
    if lines:
        lines.append("")
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    if not view["jobs"]:
        lines.append("(no jobs registered)")
    for job in view["jobs"]:
        if job.get("queue_reason"):
            lines.append(f"{job['name']}: {job['queue_reason']}")
    from cotenant.queue_commands import format_queue

    lines += format_queue(view.get("queue") or [])
    if any(j.get("share_pinned") for j in view["jobs"]):
        lines.append("* share pinned with `cotenant set-share` (`set-share JOB auto` hands it back to the policy)")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    from cotenant.coordinator import client

    while True:
        view = client.status(args.socket)
        if args.json:
            text = json.dumps(view, indent=2)
        else:
            text = format_status(view)
        if args.watch:
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + view["coordinator"]["socket"] + "\n")
        print(text, flush=True)
        if not args.watch:
            return 0
        time.sleep(args.interval)


# --- admin ---------------------------------------------------------------------


def cmd_set_cap(args: argparse.Namespace) -> int:
    from cotenant.coordinator import client

    reply = client.set_cap(args.job, args.size, args.socket)
    print(f"{reply['job']}: cap bound {_format_size(reply['user_cap'])}, cap in force {_format_size(reply['memory_cap'])}")
    return 0


def cmd_set_share(args: argparse.Namespace) -> int:
    from cotenant.coordinator import client

    if args.share != "auto":
        try:
            value = float(args.share)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            print(f"cotenant: a share is a number from 0 (paused) to 1, or 'auto'; not {args.share!r}", file=sys.stderr)
            return EXIT_USAGE
        share: Any = value
    else:
        share = "auto"
    reply = client.set_share(args.job, share, args.socket)
    how = "pinned" if reply["pinned"] else "set by the policy"
    print(f"{reply['job']}: share {reply['share']:.2f} ({how})")
    return 0


def cmd_command(args: argparse.Namespace) -> int:
    from cotenant.coordinator import client

    reply = client.send_command(args.job, args.command_name, args.socket)
    print(f"{reply['job']}: {reply['command']} sent (sequence {reply['sequence']})")
    return 0


# --- run -----------------------------------------------------------------------


def child_environment(args: argparse.Namespace, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment that enables cotenant in an unmodified child program."""
    import cotenant

    from cotenant import settings

    env = dict(os.environ if base is None else base)
    settings.check_all(env)  # a malformed COTENANT_CONF fails here, before the program starts
    for variable in settings.unknown_variables(env):  # a misspelled one would leave the job uncapped
        print(f"cotenant run: warning: cotenant reads no variable named {variable}; it has no effect",
              file=sys.stderr)
    env["COTENANT_ENABLE"] = "1"
    if args.allow_uncapped:
        env["COTENANT_ALLOW_UNCAPPED"] = "1"
    if args.cap_only:
        env.pop("COTENANT_ROLE", None)  # no role: a memory cap and nothing else
    else:
        env["COTENANT_ROLE"] = "guaranteed" if args.guaranteed else "opportunistic"
    if args.cap is not None:  # --cap "" is refused by the parser, not taken for no --cap
        env["COTENANT_MEMORY_CAP"] = _parse_cap(args.cap).text  # refused here, read back by the same parser
    if args.persistent:
        _parse_size(args.persistent)
        env["COTENANT_PERSISTENT_MEMORY"] = args.persistent
    if args.host_reserve:
        _parse_size(args.host_reserve)
        env["COTENANT_HOST_RESERVE"] = args.host_reserve
    if args.host_headroom:
        _parse_size(args.host_headroom)
        env["COTENANT_HOST_HEADROOM"] = args.host_headroom
    env["COTENANT_DEVICE"] = str(args.device)
    if args.socket:
        env["COTENANT_SOCKET"] = args.socket
    if args.name:
        from cotenant.coordinator.protocol import job_name_problem

        problem = job_name_problem(args.name)
        if problem:
            raise ValueError(f"--name: {problem}")
        env["COTENANT_JOB_NAME"] = args.name
    autoenable = os.path.join(os.path.dirname(cotenant.__file__), "_autoenable")
    # Every directory the package spans (sources and build tree) must stay importable in the child.
    package_roots = [os.path.dirname(p) for p in cotenant.__path__]
    parts = [autoenable] + package_roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    seen: List[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    env["PYTHONPATH"] = os.pathsep.join(seen)
    return env


def command_after_dashes(args: argparse.Namespace, verb: str) -> Optional[List[str]]:
    """The program to start (what follows `--`), or None after saying how to give one."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(f"cotenant {verb}: give the command after --, e.g. `cotenant {verb} --opportunistic -- python "
              "train.py`", file=sys.stderr)
        return None
    return command


def cannot_enable(args: argparse.Namespace, command: List[str], env: Dict[str, str], verb: str) -> bool:
    """Says so, and returns True, when cotenant could not be enabled in `command`
    and the user did not allow it to run uncapped (cotenant.launch: fail closed)."""
    from cotenant import launch, settings

    if settings.flag("disable", env):
        return False  # COTENANT_DISABLE=1: the user asked for no cotenant
    problem = launch.preflight(command, args.device)
    if problem is None:
        return False
    if args.allow_uncapped:
        print(f"cotenant {verb}: WARNING: the program runs without cotenant (no cap, no gate): {problem}",
              file=sys.stderr)
        return False
    print(f"cotenant {verb}: cannot enable cotenant: {problem}. Nothing was started; {launch.ALLOW_HINT}.",
          file=sys.stderr)
    return True


def cmd_run(args: argparse.Namespace) -> int:
    from cotenant import launch

    command = command_after_dashes(args, "run")
    if command is None:
        return EXIT_USAGE
    try:
        env = child_environment(args)
    except ValueError as error:
        print(f"cotenant run: {error}", file=sys.stderr)
        return EXIT_USAGE
    if cannot_enable(args, command, env, "run"):
        return launch.EXIT_NOT_ENABLED
    if args.queue:
        from cotenant.queue_commands import wait_for_admission

        code = wait_for_admission(args, env)
        if code is not None:
            return code
    try:
        launch.exec_job(command, env)  # same pid: the coordinator sees the real job
    except FileNotFoundError:
        print(f"cotenant run: no program named {command[0]!r} on PATH", file=sys.stderr)
        return 127
    except OSError as error:  # not main()'s PermissionError: this is the program, not the socket
        print(f"cotenant run: cannot start {command[0]!r}: {error.strerror or error}; {_how_to_start(error)}",
              file=sys.stderr)
        return 126  # the shell's status for a program found but not executable
    return 0  # not reached


def _how_to_start(error: OSError) -> str:
    import errno

    if error.errno == errno.ENOEXEC:
        return ("it is no binary and has no #! line; run it with its interpreter "
                "(`cotenant run ... -- python train.py`) or give it a #! line")
    return ("make it executable (chmod +x) or run it with its interpreter "
            "(`cotenant run ... -- python train.py`)")


# --- coordinator and timeline ----------------------------------------------------


def cmd_coordinator(args: argparse.Namespace) -> int:
    import grp

    from cotenant.coordinator import daemon
    from cotenant.coordinator import settings as coordinator_settings
    from cotenant.coordinator.paths import default_serving_path
    from cotenant.queue_commands import scheduler_options

    socket_path = args.socket or default_serving_path()
    if socket_path is None and not args.print_config:
        print("cotenant coordinator: no place for the socket: $XDG_RUNTIME_DIR is not set and /run/cotenant is not "
              "yours; give --socket PATH in a directory only you can write, e.g. --socket "
              "~/.cotenant/coordinator.sock (jobs then need COTENANT_SOCKET set to it)", file=sys.stderr)
        return EXIT_USAGE
    if args.group:
        try:
            grp.getgrnam(args.group)
        except KeyError:
            print(f"cotenant coordinator: --group {args.group!r} is no group on this machine", file=sys.stderr)
            return EXIT_USAGE
    config = daemon.CoordinatorConfig(
        socket_path=socket_path or "", gpus=args.gpus, group=args.group,
        metrics_port=args.metrics_port, metrics_address=args.metrics_address,
        gpu_memory_bytes=_parse_size(args.gpu_memory) if args.gpu_memory else None,
        scheduler=args.scheduler, scheduler_options=scheduler_options(args),
    )
    config = coordinator_settings.apply(config, args)  # the --config file, then the flags
    if args.print_config:
        print(coordinator_settings.format_toml(config), end="")
        return 0
    return daemon.run(config, args.log_level)


def cmd_timeline(args: argparse.Namespace) -> int:
    from cotenant import timeline
    from cotenant.coordinator import client, paths

    # The coordinator's history file holds everything recorded (its memory
    # only the latest samples); ask the coordinator when the file is not readable.
    path = args.history or paths.history_path(args.socket or paths.default_socket_path())
    if os.access(path, os.R_OK):
        try:
            records = timeline.load_history(path)
        except OSError as error:
            print(f"cotenant timeline: cannot read {path}: {error.strerror or error}", file=sys.stderr)
            return 1
        except timeline.HistoryError as error:
            print(f"cotenant timeline: {error}", file=sys.stderr)
            return 1
    elif args.history:
        print(f"cotenant timeline: cannot read {path}", file=sys.stderr)
        return 1
    else:
        try:
            records = client.history(args.socket)
        except (client.CoordinatorUnavailable, OSError):
            print(f"cotenant timeline: no coordinator is running and there is no recorded history at {path}",
                  file=sys.stderr)
            return 1
    try:
        n = timeline.plot(records, args.output)
    except OSError as error:  # not main()'s PermissionError: this is the output file, not the socket
        print(f"cotenant timeline: cannot write {args.output}: {error.strerror or error}; give -o a path in a "
              "directory you can write", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({n} samples)")
    return 0


class _Parser(argparse.ArgumentParser):
    """Reads an argument such as "-1G" or "-0.5" as a value, not as an
    unknown option (Python 3.13's rule, here on every version), so that a
    negative size reaches the size parser, whose error names it, instead of
    argparse's "expected one argument". Every subcommand's parser is one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")


def build_parser() -> argparse.ArgumentParser:
    from cotenant import __version__
    from cotenant.queue_commands import add_queue_arguments, add_queue_commands, add_scheduler_arguments

    parser = _Parser(prog="cotenant", description="Share NVIDIA GPUs between PyTorch jobs.")
    parser.add_argument("--version", action="version", version=f"cotenant {__version__}")
    sub = parser.add_subparsers(dest="subcommand", required=True)

    def with_socket(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--socket", help="coordinator socket (default: $COTENANT_SOCKET, else your own coordinator's "
                       "$XDG_RUNTIME_DIR/cotenant/coordinator.sock when it runs, else the node's "
                       "/run/cotenant/coordinator.sock)")
        return p

    p = with_socket(sub.add_parser("coordinator", help="run the per-node coordinator daemon"))
    p.add_argument("--gpus", type=_gpu_list, help="GPU indices to manage, e.g. 0,1 (default: all)")
    p.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-address", default="127.0.0.1",
                   help="address the metrics listen on (default 127.0.0.1; they name every job)")
    p.add_argument("--group", help="a group whose members may use the coordinator (register jobs, read the "
                                   "status, change their own jobs)")
    p.add_argument("--gpu-memory", help="device memory per GPU, when nvidia-smi cannot tell (e.g. 80GiB)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_scheduler_arguments(p)
    from cotenant.coordinator import settings as coordinator_settings

    coordinator_settings.add_arguments(p)
    p.set_defaults(func=cmd_coordinator)

    p = with_socket(sub.add_parser("status", help="show the jobs, their memory and shares"))
    p.add_argument("--json", action="store_true", help="print the coordinator's view as JSON")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=_interval, default=1.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=cmd_status)

    p = with_socket(sub.add_parser("set-cap", help="bound a job's device memory"))
    p.add_argument("job", help="job name or id")
    p.add_argument("size", help="a size like 6GiB, a fraction of the GPU like 0.5 or 50%%, or 'none' to remove the bound")
    p.set_defaults(func=cmd_set_cap)

    p = with_socket(sub.add_parser("set-share", help="pin a job's compute share"))
    p.add_argument("job", help="job name or id")
    p.add_argument("share", help="0 (paused) to 1, or 'auto' to hand it back to the policy")
    p.set_defaults(func=cmd_set_share)

    for command, text in (("suspend", "pause a job and move all its memory to the host"),
                          ("resume", "bring a suspended job's memory back and let it run")):
        p = with_socket(sub.add_parser(command, help=text))
        p.add_argument("job", help="job name or id")
        p.set_defaults(func=cmd_command, command_name=command)

    def run_arguments(p: argparse.ArgumentParser) -> None:
        with_socket(p)
        role = p.add_mutually_exclusive_group(required=True)
        role.add_argument("--guaranteed", action="store_true", help="the job whose speed is protected")
        role.add_argument("--opportunistic", action="store_true", help="a job that uses what is left")
        role.add_argument("--cap-only", action="store_true",
                          help="no launch gate: only the memory cap (the coordinator counts its memory, and "
                               "neither protects nor throttles it)")
        p.add_argument("--cap", help="device-memory cap: a size (6GiB), a fraction of the GPU (0.5, 50%%) or none")
        p.add_argument("--persistent", help="memory the job holds for its whole life, e.g. 10GiB: the coordinator "
                                            "admits an opportunistic job only when it fits")
        p.add_argument("--host-reserve", metavar="SIZE",
                       help="host memory pinned at start and kept, e.g. 4GiB: the job's first squeeze under a cap "
                            "then moves its pages at copy speed instead of pinning memory first")
        p.add_argument("--host-headroom", metavar="SIZE",
                       help="host memory the job never pins into (default 4GiB, or the coordinator's if larger): "
                            "its spills stop there instead of taking the node to its OOM killer")
        p.add_argument("--name", help="job name shown by `cotenant status`")
        p.add_argument("--device", type=_device_index, default=0, help="CUDA device index (default 0)")
        p.add_argument("--allow-uncapped", action="store_true",
                       help="start the program even when cotenant cannot be enabled in it (no driver or GPU, "
                            "python -E/-I/-S, not a Python program), with a warning; by default that is an "
                            "error (exit status 2)")
        add_queue_arguments(p)
        p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")

    p = sub.add_parser("run", help="run a command as a cotenant job, with no change to its code")
    run_arguments(p)
    p.set_defaults(func=cmd_run)
    add_queue_commands(sub, run_arguments)

    p = with_socket(sub.add_parser("timeline", help="plot each job's memory and share over time (PNG)"))
    p.add_argument("-o", "--output", default="cotenant-timeline.png")
    p.add_argument("--history", help="a recorded history file (default: the coordinator's, <socket>.history.jsonl)")
    p.set_defaults(func=cmd_timeline)

    from cotenant.scheduling.command import add_simulate_command

    add_simulate_command(sub)
    from cotenant.cluster.command import add_cluster_command

    add_cluster_command(sub)
    describe_subcommands(sub)
    return parser


def describe_subcommands(sub: "argparse._SubParsersAction") -> None:
    """Each subcommand's --help opens with what it does: its line in `cotenant --help`."""
    for choice in sub._choices_actions:
        command = sub.choices[choice.dest]
        if not command.description and choice.help:
            command.description = choice.help[0].upper() + choice.help[1:] + "."


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from cotenant._extras import MissingExtraError
    from cotenant.cluster.command import ClusterCommandError
    from cotenant.coordinator.client import CoordinatorError, CoordinatorUnavailable

    try:
        return args.func(args)
    except ClusterCommandError as error:
        print(f"cotenant cluster: {error}", file=sys.stderr)
        return 1
    except CoordinatorUnavailable as error:
        print(f"cotenant: {error}", file=sys.stderr)
        return 1
    except CoordinatorError as error:
        print(f"cotenant: {error}", file=sys.stderr)
        return 1
    except PermissionError as error:
        print(f"cotenant: permission denied on the coordinator socket ({error.filename or error}); ask for membership "
              "in the coordinator's group", file=sys.stderr)
        return 1
    except MissingExtraError as error:
        print(f"cotenant: {error}", file=sys.stderr)
        return 1
    except (ValueError, argparse.ArgumentTypeError) as error:
        print(f"cotenant: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
