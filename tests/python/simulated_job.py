"""A simulated training job for the coordinator tests.

It registers with the coordinator through the real job-side client, holds
memory in a CachingAllocator on a SimulatedBackend, drives the real C++
JobChannel (so the coordinator's caps spill and restore its pages) and
reports iteration times. The test steers it through small files:
  <control>.burst     its content: MiB to allocate on top (a burst); removed = free them
  <control>.iter_us   its content: the iteration time to report, microseconds
and it writes:
  <control>.resumes   how many times its memory read back intact after a suspend
  <control>.corrupt   written when its memory did not (what differed)
  ("{name}" in --control is replaced by the job's name: one path for every worker of a cluster job)
With --iterations N it exits after N iterations run while not suspended (a job
that finishes); a suspended job makes no progress. The GPU it registers on is
COTENANT_DEVICE when `cotenant run --queue` set it, else --device.
Prints one JSON line (the registration) when ready, or {"registration": null}.
"""

import argparse
import json
import math
import os
import sys
import time

from cotenant import _core
from cotenant.coordinator import client

MiB = 1 << 20


def read_number(path, default):
    try:
        with open(path) as f:
            return float(f.read().strip() or default)
    except (OSError, ValueError):
        return default


def write_pattern(backend, address, index, name):
    """Bytes that identify this block of this job, at both ends of it."""
    pattern = (f"{name}:{index}:".encode() * 512)[:4096]
    backend.write(address, pattern)
    backend.write(address + 16 * MiB - len(pattern), pattern)
    return pattern


def check_patterns(backend, held, patterns, control):
    for index, (address, pattern) in enumerate(zip(held, patterns)):
        for at in (address, address + 16 * MiB - len(pattern)):
            if backend.read(at, len(pattern)) != pattern:
                write_file(control + ".corrupt", f"block {index} at {at:#x} changed")
                return False
    return True


def write_file(path, text):
    if not path or path.startswith("."):
        return
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", help="the coordinator's socket (default: where cotenant looks)")
    parser.add_argument("--role", default=os.environ.get("COTENANT_ROLE"),
                        help="default: COTENANT_ROLE, as `cotenant run` sets it")
    parser.add_argument("--name", default=os.environ.get("COTENANT_JOB_NAME"))
    parser.add_argument("--device", type=int, default=int(os.environ.get("COTENANT_DEVICE", "0")))
    parser.add_argument("--iterations", type=int, default=0, help="exit after this many iterations run (0: never)")
    parser.add_argument("--hold-mib", type=int, default=64)
    parser.add_argument("--persistent-mib", type=int, default=0)
    parser.add_argument("--iteration-us", type=float, default=10000)
    parser.add_argument("--device-capacity-mib", type=int, default=1024)
    parser.add_argument("--host-capacity-mib", type=int, default=int(os.environ.get("SIMULATED_HOST_CAPACITY_MIB", 1 << 20)),
                        help="host memory the job may pin, as its memory cgroup's room would say "
                             "(default: $SIMULATED_HOST_CAPACITY_MIB, else 1 TiB)")
    parser.add_argument("--control", default="")
    parser.add_argument("--register-after-s", type=float, default=0.0,
                        help="wait this long before registering (a worker slow to start)")
    parser.add_argument("--gpu-uuid", default=os.environ.get("SIMULATED_GPU_UUID"),
                        help="the GPU UUID to report (default: $SIMULATED_GPU_UUID, else none)")
    args = parser.parse_args()
    if not args.role:
        parser.error("--role is needed (or COTENANT_ROLE)")
    args.control = args.control.replace("{name}", args.name or "job")
    time.sleep(args.register_after_s)

    try:
        registration = client.register(
            args.role, args.device, name=args.name, socket=args.socket,
            persistent_bytes=args.persistent_mib * MiB or None, gpu_uuid=args.gpu_uuid,
        )
    except client.AdmissionRefused:
        raise
    except (client.CoordinatorError, OSError):
        # As cotenant.enable() does: a coordinator that fails mid-registration
        # (killed) leaves the job to run on its own.
        registration = None
    if registration is None:
        print(json.dumps({"registration": None}), flush=True)
        return 0
    backend = _core.SimulatedBackend(device_capacity=args.device_capacity_mib * MiB,
                                     host_capacity=args.host_capacity_mib * MiB)
    allocator = _core.CachingAllocator(backend)
    held = [allocator.allocate(16 * MiB) for _ in range(args.hold_mib // 16)]
    patterns = [write_pattern(backend, address, i, registration.name) for i, address in enumerate(held)]
    channel = registration.open_channel(allocator=allocator, poll_interval_us=2000)
    own_block = _core.JobBlock.open(registration.block_name)
    print(json.dumps({"registration": registration.__dict__, "pid": os.getpid()}), flush=True)

    burst = []
    ran, was_suspended, resumes = 0, False, 0
    while True:
        # None while the channel's thread is mid-write (the read gives up after
        # 2 ms, as the coordinator's does): the state stays what it was.
        report = own_block.report()
        suspended = was_suspended if report is None else report["state"] == "suspended"
        if was_suspended and not suspended:
            if check_patterns(backend, held, patterns, args.control):
                resumes += 1
                write_file(args.control + ".resumes", str(resumes))
        was_suspended = suspended
        if not suspended:
            ran += 1
            if args.iterations and ran >= args.iterations:
                channel.close()
                return 0
        started = time.monotonic()
        iteration_us = read_number(args.control + ".iter_us", args.iteration_us) if args.control else args.iteration_us
        want_burst = int(read_number(args.control + ".burst", 0)) if args.control else 0
        while len(burst) * 16 < want_burst:
            burst.append(allocator.allocate(16 * MiB))
        while burst and len(burst) * 16 > want_burst:
            allocator.free(burst.pop())
        if not math.isfinite(iteration_us):
            # A job whose numbers are no numbers: its report's share becomes NaN.
            channel.set_user_share(float("nan"))
        # At most a second, and none for an iteration time that is no number (inf, NaN).
        time.sleep(min(1.0, max(0.0, iteration_us / 1e6 - (time.monotonic() - started))))
        # The end of an iteration, as `with cotenant.iteration():` marks it: the
        # job's one IterationTracker measures the time since the last mark.
        channel.iteration_boundary()


if __name__ == "__main__":
    sys.exit(main())
