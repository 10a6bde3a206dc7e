"""The per-node coordinator daemon (asyncio).

Control plane: a Unix socket (mode 0660) speaking protocol.py; every peer is
identified by SO_PEERCRED. The socket, state file and history live in a run
directory made and opened safely (rundir.py); docs/coordinator.md states the
security model. Data plane: one JobBlock per job in shared memory,
written here (cap, share, commands) and by the job's C++ JobChannel thread
(its numbers and a heartbeat). Every `tick_s` the daemon reads every block,
reclaims dead jobs, runs the policies (policy.py) and writes the caps and
shares that changed.

Failures:
  * the daemon dies: blocks stay, each job keeps its last cap and share and
    keeps publishing; a restarted daemon on the same socket path re-adopts
    the live jobs its durable state names (block name, owner token,
    identity) and reloads administrator settings and baselines from it;
  * a job dies: its process is gone (or a zombie, or its pid names a process
    with another start time) or it reported "exited": its block is unlinked
    and its memory returns to the others at the next tick. A live process
    whose heartbeat stopped (SIGSTOP, a hang) is kept with its memory.
"""

from __future__ import annotations

import asyncio
import collections
import grp
import json
import logging
import os
import resource
import secrets
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

from cotenant.coordinator import gpus, host_memory, paths, policy, protocol, report
from cotenant.coordinator.protocol import ProtocolError
from cotenant.coordinator.queue_service import QueueService
from cotenant.coordinator.rundir import AlreadyRunning, RunDirectory, UnreadableJson, UnsafeRunDirectory

log = logging.getLogger("cotenant.coordinator")

MAX_QUEUED_COMMANDS = 16  # commands waiting for a job that has not applied the one before
CGROUP_READ_INTERVAL_S = 0.1  # the jobs' memory cgroups are read at most this often (a job reads its own as often)


def _core():
    from cotenant import _core

    return _core


# --- structured logs ---------------------------------------------------------


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, event, and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class RateLimit(logging.Filter):
    """At most `burst` warnings and errors of one event per `window_s`; the
    rest are counted and the count rides on the event's next line, so a flood
    of failures (hostile clients, a full descriptor table) cannot fill the disk."""

    def __init__(self, burst: int = 10, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._windows: Dict[str, List[float]] = {}  # event -> [window start, lines, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        event = record.getMessage()
        if len(self._windows) > 1000:
            self._windows.clear()
        window = self._windows.setdefault(event, [record.created, 0, 0])
        if record.created - window[0] >= self.window_s:
            suppressed = window[2]
            window[:] = [record.created, 0, 0]
            if suppressed:
                record.fields = {**getattr(record, "fields", {}), "suppressed_before": suppressed}
        if window[1] >= self.burst:
            window[2] += 1
            return False
        window[1] += 1
        return True


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    handler.addFilter(RateLimit())
    for logger in (log, logging.getLogger("asyncio")):  # asyncio's own errors: JSON and bounded too
        logger.handlers[:] = [handler]
        logger.propagate = False
    log.setLevel(level.upper())


def _event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    log.log(level, event, extra={"fields": fields})


# --- processes ---------------------------------------------------------------


def _proc_stat(pid: int) -> Optional[List[bytes]]:
    """/proc/<pid>/stat's fields from the state on (field 3, index 0), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def process_start_ticks(pid: int) -> int:
    """When `pid` started (clock ticks since boot, /proc/<pid>/stat field 22);
    0 where it cannot be read. With the pid it names one process for good:
    a pid the kernel reuses has another start time."""
    fields = _proc_stat(pid) if pid > 0 else None
    try:
        return int(fields[19]) if fields else 0
    except (IndexError, ValueError):
        return 0


def process_alive(pid: int, start_ticks: int = 0) -> bool:
    """True while `pid` runs (and, given its start time, is still the same
    process); a zombie (killed, not yet reaped) counts as dead. A stopped
    process (SIGSTOP) is alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] in (b"Z", b"X"):
        return False
    try:
        return not start_ticks or int(fields[19]) == start_ticks
    except (IndexError, ValueError):
        return True


def process_stopped(pid: int) -> bool:
    """True while `pid` is stopped (SIGSTOP, a debugger)."""
    fields = _proc_stat(pid) if pid > 0 else None
    return bool(fields) and fields[0] in (b"T", b"t")


# --- state -------------------------------------------------------------------


@dataclass
class Job:
    job_id: int
    name: str
    role: str
    device: int  # the job's CUDA index (relative to its CUDA_VISIBLE_DEVICES)
    pid: int
    uid: int
    block: Any  # _core.JobBlock
    gpu: str = ""  # the physical GPU: its UUID, or the synthetic "index:N" (gpus.gpu_key)
    user_cap: Optional[int] = None
    pinned_share: Optional[float] = None
    persistent_bytes: int = 0
    admitted: bool = True
    queue_reason: str = ""
    baseline: policy.Baseline = field(default_factory=policy.Baseline)
    report: Dict[str, Any] = field(default_factory=dict)
    cap: Optional[int] = None
    # The highest cap written since the job last reported applying the cap in
    # force: until it has, it may be following any of them (None: none such).
    cap_written_high: Optional[int] = None
    share: float = 1.0
    registered_at: float = field(default_factory=time.monotonic)
    iterated_at: Optional[float] = None  # time.monotonic() its iteration count last grew (None: not since it registered)
    paused_since_count: Optional[int] = None  # guaranteed: its iteration count when every opportunistic job of its GPU went to share 0
    adopted: bool = False
    invalid_reports: int = 0  # reads whose numbers report.check() refused
    pid_start_ticks: int = 0  # with pid, names the process for good (a reused pid starts later)
    owner_token: int = 0      # in the block's header and the durable state: what restart adopts
    silent_since: Optional[float] = None  # a live process's heartbeat stopped (stopped, or hung) at this time
    held_back_bytes: int = 0  # how far its cap stays above the plan, so the node keeps its host headroom
    cgroup: Optional[str] = None  # its process's /proc/<pid>/cgroup: jobs with the same share its memory limit
    cgroup_rooms: Tuple[Tuple[str, int], ...] = ()  # its limited memory cgroups, own first: (path, room) as last read
    commands: Deque[str] = field(default_factory=collections.deque)  # waiting for the job to apply the one before

    def send_command(self, command: str) -> int:
        """Sends `command` (spill_all, restore_all, suspend, resume) to the job;
        returns the sequence number it carries. The block holds one command
        and the job applies the newest it finds, so a command written before
        the job applied the one before would replace it unseen (a suspend
        then a spill: the job only spilled): until the job has applied the
        last one sent, the new one waits here and goes at a later tick, in
        order. At most MAX_QUEUED_COMMANDS wait; one more is refused."""
        sent = int(self.block.control()["command_sequence"])
        if not self.commands and self._applied(fresh=True) >= sent:
            return int(self.block.send_command(command))
        if len(self.commands) >= MAX_QUEUED_COMMANDS:
            raise ProtocolError(protocol.RESOURCE_EXHAUSTED,
                                f"job {self.name!r} has not applied its command {sent} yet and "
                                f"{len(self.commands)} more wait for it; is its process stopped or hung? "
                                "Send this one once it answers")
        self.commands.append(command)
        return sent + len(self.commands)

    def send_waiting_command(self) -> Optional[int]:
        """Sends the oldest waiting command once the job has applied the one
        before (each tick); its sequence number, or None."""
        if self.commands and self._applied() >= int(self.block.control()["command_sequence"]):
            return int(self.block.send_command(self.commands.popleft()))
        return None

    def _applied(self, fresh: bool = False) -> int:
        """The last command sequence the job applied: from its block now
        (fresh), else from the report this tick read."""
        new = self.block.report() if fresh else None
        return int((new or self.report).get("applied_command_sequence", 0))

    def warming_up(self, now: float, timeout_s: float) -> bool:
        """True while the solo baseline is being measured. Opportunistic jobs are
        held paused for it only while its iterations come: a guaranteed job that
        reports none within timeout_s (no optimizer hook), or whose iterations
        stop that long before the window is full (stopped, hung, a phase
        without steps), holds no one until its next iteration."""
        if not self.baseline.warming_up:
            return False
        since = self.registered_at if self.iterated_at is None else self.iterated_at
        return now - since < timeout_s

    def iteration_ewma_us(self) -> float:
        """The job's iteration-time EWMA (its one measurement, reported in ns), in µs."""
        return self.report.get("iteration_ewma_ns", 0) / 1000.0

    def slowdown(self) -> Optional[float]:
        return policy.slowdown_of(self.iteration_ewma_us(), self.baseline)

    def observation(self) -> policy.JobObservation:
        return policy.JobObservation(
            job_id=self.job_id, role=self.role, device=self.device,
            device_bytes=self.report.get("device_bytes", 0), host_bytes=self.report.get("host_bytes", 0),
            host_pool_bytes=self.report.get("host_pool_bytes", 0), host_room_bytes=self.report.get("host_room_bytes"),
            host_room_groups=self.host_room_groups(),
            allocated_bytes=self.report.get("allocated_bytes", 0), cap=self.cap, cap_bound=self.cap_bound(),
            user_cap=self.user_cap, admitted=self.admitted,
        )

    def cap_bound(self) -> Optional[int]:
        """The highest cap the job may be following: the one it applied last
        (its report), or a higher one written since. None where it applied
        none (no cap, or not yet)."""
        applied = self.report.get("applied_memory_cap")
        if applied is None:
            return None
        return max(applied, self.cap_written_high or 0)

    def host_room_groups(self) -> Tuple[str, ...]:
        """The groups whose room it shares: its /proc/<pid>/cgroup text (jobs in
        the same cgroups), then each limited memory cgroup on its way up."""
        return ((self.cgroup,) if self.cgroup is not None else ()) + tuple(path for path, _ in self.cgroup_rooms)

    def state(self) -> str:
        """queued, paused (the process is stopped), unresponsive (live, its
        heartbeat stopped), or what the job reports (starting, running, ...)."""
        if not self.admitted:
            return "queued"
        if self.silent_since is not None:
            return "paused" if process_stopped(self.pid) else "unresponsive"
        return self.report.get("state", "starting")

    def status(self, now_ns: int) -> Dict[str, Any]:
        r = self.report
        heartbeat = r.get("heartbeat_ns", 0)
        return {
            "job_id": self.job_id, "name": self.name, "gpu": self.device, "gpu_key": self.gpu,
            "gpu_uuid": None if gpus.is_synthetic(self.gpu) else self.gpu, "pid": self.pid, "uid": self.uid,
            "role": self.role,
            "state": self.state(),
            "queue_reason": self.queue_reason,
            "cap": self.cap, "user_cap": self.user_cap, "share": self.share,
            "share_pinned": self.pinned_share is not None,
            "device_bytes": r.get("device_bytes", 0), "host_bytes": r.get("host_bytes", 0),
            "host_pool_bytes": r.get("host_pool_bytes", 0), "host_room_bytes": r.get("host_room_bytes"),
            "allocated_bytes": r.get("allocated_bytes", 0), "cached_bytes": r.get("cached_bytes", 0),
            "spilled_bytes": r.get("spilled_bytes", 0), "restored_bytes": r.get("restored_bytes", 0),
            "page_moves": r.get("num_migrations", 0),
            "pending_migration_bytes": r.get("pending_migration_bytes", 0),
            "squeeze_held_back_bytes": self.held_back_bytes,
            "memory_cgroups": [{"path": path, "room_bytes": room} for path, room in self.cgroup_rooms],
            "applied_cap": r.get("applied_memory_cap"), "applied_share": r.get("applied_share"),
            "applied_command_sequence": r.get("applied_command_sequence", 0), "commands_waiting": len(self.commands),
            "iteration_ewma_us": self.iteration_ewma_us(), "iteration_count": r.get("iteration_count", 0),
            "effective_share": r.get("effective_share"),
            "baseline_us": self.baseline.baseline_us, "slowdown": self.slowdown(),
            "heartbeat_age_s": (now_ns - heartbeat) / 1e9 if heartbeat else None,
            "block": self.block.name, "adopted": self.adopted, "invalid_reports": self.invalid_reports,
        }


class Metrics:
    """Prometheus gauges and counters on a private registry (only with a metrics port:
    prometheus-client is an optional dependency, the extra `cotenant[metrics]`)."""

    def __init__(self) -> None:
        from cotenant._extras import require

        require("prometheus_client", "metrics", "cotenant coordinator --metrics-port")
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        labels = ["gpu", "job", "role"]
        self.cap = Gauge("cotenant_job_memory_cap_bytes", "Device-memory cap in force (absent: none).", labels, registry=self.registry)
        self.device = Gauge("cotenant_job_device_bytes", "Device-resident bytes.", labels, registry=self.registry)
        self.host = Gauge("cotenant_job_host_bytes", "Host-resident (spilled) bytes.", labels, registry=self.registry)
        self.host_pool = Gauge("cotenant_job_host_pool_bytes",
                               "Pinned host memory held for spills, mapped at no tensor (kept pages, the reserve).",
                               labels, registry=self.registry)
        self.share = Gauge("cotenant_job_compute_share", "Compute share in [0, 1].", labels, registry=self.registry)
        self.slowdown = Gauge("cotenant_job_slowdown", "Guaranteed iteration time over its solo baseline.", labels, registry=self.registry)
        self.spilled = Gauge("cotenant_job_spilled_bytes", "Bytes moved device -> host since the job started.",
                             labels, registry=self.registry)
        self.restored = Gauge("cotenant_job_restored_bytes", "Bytes moved host -> device since the job started.",
                              labels, registry=self.registry)
        self.moves = Gauge("cotenant_job_page_moves", "Pages moved (either way) since the job started.", labels,
                           registry=self.registry)
        gpu = ["gpu"]
        self.gpu_gauges = {
            "device_bytes": Gauge("cotenant_gpu_device_bytes", "Device-resident bytes of the GPU's jobs.", gpu,
                                  registry=self.registry),
            "host_bytes": Gauge("cotenant_gpu_host_bytes", "Host-resident bytes of the GPU's jobs.", gpu,
                                registry=self.registry),
            "host_pool_bytes": Gauge("cotenant_gpu_host_pool_bytes",
                                     "Pinned host memory the GPU's jobs hold for spills.", gpu,
                                     registry=self.registry),
            "spilled_bytes": Gauge("cotenant_gpu_spilled_bytes", "Bytes the GPU's live jobs moved device -> host.",
                                   gpu, registry=self.registry),
            "restored_bytes": Gauge("cotenant_gpu_restored_bytes", "Bytes the GPU's live jobs moved host -> device.",
                                    gpu, registry=self.registry),
            "page_moves": Gauge("cotenant_gpu_page_moves", "Pages the GPU's live jobs moved.", gpu,
                                registry=self.registry),
        }
        self.node_host = {
            "pinned_by_jobs_bytes": Gauge("cotenant_node_host_pinned_bytes",
                                          "Pinned host memory of all jobs: spilled bytes and kept host pages.",
                                          registry=self.registry),
            "available_bytes": Gauge("cotenant_node_host_available_bytes",
                                     "The node's available host memory (MemAvailable).", registry=self.registry),
            "squeezable_bytes": Gauge("cotenant_node_host_squeezable_bytes",
                                      "Device bytes of opportunistic jobs: what squeezing them all would pin.",
                                      registry=self.registry),
            "held_back_bytes": Gauge("cotenant_node_host_held_back_bytes",
                                     "How far the jobs' caps stay above the plan to keep the host headroom available.",
                                     registry=self.registry),
        }
        self.jobs = Gauge("cotenant_jobs", "Jobs known to the coordinator.", ["gpu", "role"], registry=self.registry)
        self.reclaimed = Counter("cotenant_jobs_reclaimed_total", "Dead jobs whose memory was reclaimed.", registry=self.registry)
        self.errors = Counter("cotenant_protocol_errors_total", "Requests answered with an error.", ["code"], registry=self.registry)

    def update(self, jobs: Dict[int, Job], meminfo: Optional[Dict[str, int]]) -> None:
        counts: Dict[tuple, int] = collections.Counter()
        for job in jobs.values():
            labels = (job.gpu, job.name, job.role)
            if job.cap is not None:
                self.cap.labels(*labels).set(job.cap)
            self.device.labels(*labels).set(job.report.get("device_bytes", 0))
            self.host.labels(*labels).set(job.report.get("host_bytes", 0))
            self.host_pool.labels(*labels).set(job.report.get("host_pool_bytes", 0))
            self.share.labels(*labels).set(job.share)
            slowdown = job.slowdown()
            if slowdown is not None:
                self.slowdown.labels(*labels).set(slowdown)
            self.spilled.labels(*labels).set(job.report.get("spilled_bytes", 0))
            self.restored.labels(*labels).set(job.report.get("restored_bytes", 0))
            self.moves.labels(*labels).set(job.report.get("num_migrations", 0))
            counts[(job.gpu, job.role)] += 1
        by_gpu: Dict[str, List[Job]] = collections.defaultdict(list)
        for job in jobs.values():
            by_gpu[job.gpu].append(job)
        for gauge in self.gpu_gauges.values():
            gauge.clear()
        for key, on_gpu in by_gpu.items():
            for name, value in _gpu_totals_of(on_gpu).items():
                self.gpu_gauges[name].labels(key).set(value)
        self.jobs.clear()
        for (gpu, role), n in counts.items():
            self.jobs.labels(gpu, role).set(n)
        host = host_memory.host_status(meminfo, (
            {"role": job.role, "squeeze_held_back_bytes": job.held_back_bytes,
             **{k: job.report.get(k, 0) for k in ("device_bytes", "host_bytes", "host_pool_bytes")}}
            for job in jobs.values()))
        for name, gauge in self.node_host.items():
            if host[name] is not None:
                gauge.set(host[name])

    def forget(self, job: Job) -> None:
        labels = (job.gpu, job.name, job.role)
        for gauge in (self.cap, self.device, self.host, self.host_pool, self.share, self.slowdown, self.spilled,
                      self.restored, self.moves):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass


@dataclass
class CoordinatorConfig:
    socket_path: str
    gpus: Optional[List[int]] = None         # None: every GPU a job names
    gpu_memory_bytes: Optional[int] = None   # overrides detection, for every GPU
    group: Optional[str] = None              # whose members may reach the socket (besides our uid and root)
    metrics_port: Optional[int] = None
    metrics_address: str = "127.0.0.1"      # the metrics name every job: loopback unless asked
    memory: policy.MemoryPolicyConfig = field(default_factory=policy.MemoryPolicyConfig)
    share: policy.SharePolicyConfig = field(default_factory=policy.SharePolicyConfig)
    baseline: policy.BaselineConfig = field(default_factory=policy.BaselineConfig)
    tick_s: float = 0.05
    share_interval_s: float = 0.5
    history_interval_s: float = 0.25
    stale_heartbeat_s: float = 3.0
    attach_timeout_s: float = 10.0     # a registered job's channel must start within this
    on_their_own_after_s: float = 30.0  # a job that hears no tick this long runs on its own (0: it waits for good)
    baseline_timeout_s: float = 30.0   # give up waiting for a guaranteed job's first iteration
    history_max_bytes: int = 64 << 20  # the history file rotates to <name>.1 beyond this
    detect_gpus: bool = True
    scheduler: str = "fifo"                  # the job queue's policy (cotenant.scheduling.policies)
    scheduler_options: Dict[str, Any] = field(default_factory=dict)
    idle_timeout_s: float = 30.0       # a connection (socket or metrics) silent this long is closed
    max_connections_per_uid: int = 64  # more from one uid are refused with "busy" (clients retry)
    max_jobs_per_uid: int = 256        # registered jobs, and queued tickets, one uid may hold; more are refused
    listen_backlog: int = 4096         # connections waiting for accept (the kernel caps it at somaxconn)
    cgroup_root: str = host_memory.CGROUP_ROOT  # where the jobs' memory cgroups are read (the node's cgroup fs)


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.socket_path = os.path.abspath(config.socket_path)
        self.jobs: Dict[int, Job] = {}
        self.next_job_id = 1
        self.gpu_memory: Dict[int, int] = {}      # by the node's GPU index (the queue's GPUs)
        self.gpu_totals: Dict[str, int] = {}      # by GPU key (gpus.gpu_key): what the policy plans with
        self.node_gpus: List[gpus.NodeGpu] = []   # from NVML (or nvidia-smi); empty without either
        self._listed_keys: set = set()            # gpu_totals' keys of the node's listed GPUs
        self.history: Deque[Dict[str, Any]] = collections.deque(maxlen=50000)
        self.metrics: Optional[Metrics] = Metrics() if config.metrics_port is not None else None
        self.admin_gid = grp.getgrnam(config.group).gr_gid if config.group else None
        self._server: Optional[asyncio.AbstractServer] = None
        self._stopping = asyncio.Event()
        self._last_share_decision: Dict[int, float] = {}  # per GPU, time.monotonic()
        self._last_history = 0.0
        self._cgroups_read = float("-inf")  # time.monotonic() of the last read of the jobs' memory cgroups
        self._history_file = None
        self._state_dirty = False
        from cotenant.scheduling.policies import make_policy

        self.queue = QueueService(self, make_policy(config.scheduler, **config.scheduler_options))
        self._run_dir: Optional[RunDirectory] = None
        self._connections: Dict[int, int] = collections.Counter()  # uid -> open connections

    # --- lifecycle -----------------------------------------------------------

    async def serve(self) -> None:
        try:
            self._run_dir = RunDirectory(self.socket_path, self.admin_gid)
            self._run_dir.lock()  # before anything else: one coordinator per socket
        except (UnsafeRunDirectory, AlreadyRunning, OSError) as error:
            raise SystemExit(f"cotenant coordinator: {error}") from None
        _raise_descriptor_limit()
        if self.config.detect_gpus:
            self._learn_node_gpus()
        self._adopt_existing_jobs()
        try:
            self._history_file = self._run_dir.open_append(paths.HISTORY_SUFFIX)
            listening = self._run_dir.listen(self.config.listen_backlog)
        except (UnsafeRunDirectory, AlreadyRunning, OSError) as error:
            raise SystemExit(f"cotenant coordinator: cannot serve {self.socket_path}: {error}") from None
        self._server = await asyncio.start_unix_server(
            self._handle_connection, sock=listening, limit=protocol.MAX_MESSAGE_BYTES + 1
        )
        if self.config.metrics_port is not None:
            from cotenant.coordinator.metrics_http import serve_metrics

            address = self.config.metrics_address
            try:
                serve_metrics(self.metrics.registry, address, self.config.metrics_port, self.config.idle_timeout_s)
            except (OSError, OverflowError) as error:
                self._run_dir.remove_socket()
                raise SystemExit(
                    f"cotenant coordinator: cannot serve metrics on {address}:{self.config.metrics_port} "
                    f"({getattr(error, 'strerror', None) or error}); choose another --metrics-port, or stop what "
                    "uses that one") from None
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_error)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, self._stopping.set)
            except (NotImplementedError, RuntimeError):
                pass
        _event("coordinator started", socket=self.socket_path, pid=os.getpid(), gpus=self.config.gpus,
               adopted=[j.name for j in self.jobs.values()], metrics_port=self.config.metrics_port)
        tick = asyncio.create_task(self._tick_loop())
        try:
            await self._stopping.wait()
        finally:
            tick.cancel()
            self._server.close()
            await self._server.wait_closed()
            self._run_dir.remove_socket()  # only the socket this coordinator made
            self._save_state()
            self._history_file.close()
            # Blocks stay: running jobs keep their caps and a new coordinator re-adopts them.
            _event("coordinator stopped", jobs=len(self.jobs))

    def stop(self) -> None:
        self._stopping.set()

    # --- adoption and persistence -----------------------------------------------

    def _adopt_existing_jobs(self) -> None:
        """Adopts the live jobs that this coordinator's durable state names, and
        only those: each block must carry the owner token the state recorded and
        belong to this coordinator's uid or the job's (docs/coordinator.md,
        "What is adopted on restart"). Identity comes from the state, never from
        the block, which its job can write. Other blocks under this
        coordinator's prefix are not read: its own leftovers (a registration cut
        short) are removed, anyone else's are left alone."""
        saved = self._load_state()
        readable = saved is not None
        saved = saved or {}
        named = set()
        for key, entry in saved.items():
            if key.startswith("_") or not isinstance(entry, dict):
                continue
            try:
                job = self._adopt(int(key), entry)
            except (KeyError, TypeError, ValueError) as error:
                _event("state entry not adopted", logging.WARNING, job_id=key, reason=f"incomplete entry: {error}")
                continue
            named.add(entry.get("block"))
            if job is not None:
                self.jobs[job.job_id] = job
                self.next_job_id = max(self.next_job_id, job.job_id + 1)
                _event("job re-adopted", job=job.name, job_id=job.job_id, pid=job.pid, role=job.role, cap=job.cap,
                       share=job.share)
        if readable:
            self._remove_own_leftovers(named)
        self.next_job_id = max(self.next_job_id, saved.get("_next_job_id", 1))
        try:
            self.queue.restore(saved.get("_queue") or {})
        except (KeyError, TypeError, ValueError) as error:
            _event("queue not restored", logging.WARNING, reason=f"incomplete entry: {error}",
                   consequence="its waiting processes are told their ticket is unknown")
        for key, total in saved.get("_gpu_totals", {}).items():
            self.gpu_totals.setdefault(key, total)

    def _adopt(self, job_id: int, entry: Dict[str, Any]) -> Optional[Job]:
        core = _core()
        name, token, uid, pid = entry["block"], int(entry["owner_token"]), int(entry["uid"]), int(entry["pid"])
        start_ticks = int(entry.get("pid_start_ticks", 0))
        if not name.startswith("/" + paths.job_block_prefix(self.socket_path)):
            raise ValueError(f"block {name!r} is not this coordinator's")
        if not process_alive(pid, start_ticks):
            self._unlink_if_ours(name, uid)
            _event("dead job reclaimed at start", job=entry.get("name"), job_id=job_id, pid=pid)
            return None
        problem = self._block_owner_problem(name, uid)
        if problem is None:
            try:
                block = core.JobBlock.open(name)
                if block.owner_token() != token or block.identity()["job_id"] != job_id:
                    block.close()
                    problem = "its owner token or job id is not the one this coordinator recorded"
            except (core.Error, ValueError, OSError) as error:
                problem = f"unreadable: {error}"
        if problem is not None:
            _event("job block not adopted", logging.WARNING, block=name, job_id=job_id, reason=problem)
            return None
        job = Job(job_id=job_id, name=entry["name"], role=entry["role"], device=int(entry["device"]), pid=pid,
                  gpu=str(entry.get("gpu") or gpus.gpu_key(None, int(entry["device"]))), uid=uid, block=block, report=block.report() or {"pid": pid, "state": "starting"},
                  adopted=True, pid_start_ticks=start_ticks, owner_token=token, cgroup=host_memory.read_cgroup(pid),
                  cgroup_rooms=host_memory.cgroup_rooms(pid, self.config.cgroup_root))
        job.user_cap = entry.get("user_cap")
        job.pinned_share = entry.get("pinned_share")
        job.persistent_bytes = entry.get("persistent_bytes", 0)
        job.admitted = entry.get("admitted", True)
        job.queue_reason = entry.get("queue_reason", "")
        if entry.get("baseline_us"):
            job.baseline = policy.Baseline(start_count=0, baseline_us=entry["baseline_us"])
        # The control section is the coordinator's: rewrite what the state says
        # (a job may have scribbled over its copy in the block).
        job.cap, job.share = entry.get("cap"), float(entry.get("share", 1.0))
        block.set_control(memory_cap=job.cap, share=job.share)
        return job

    def _block_owner_problem(self, name: str, job_uid: int) -> Optional[str]:
        try:
            info = os.stat("/dev/shm" + name, follow_symlinks=False)
        except OSError as error:
            return f"cannot inspect it: {error.strerror}"
        if not stat.S_ISREG(info.st_mode):
            return "it is not a regular shared-memory object"
        if info.st_uid not in (os.geteuid(), job_uid):
            return f"it belongs to uid {info.st_uid}, neither this coordinator's nor the job's"
        if info.st_mode & 0o007:
            return f"every user may access it (mode {stat.S_IMODE(info.st_mode):04o})"
        return None

    def _unlink_if_ours(self, name: str, job_uid: int) -> None:
        if self._block_owner_problem(name, job_uid) is None:
            self._unlink_quietly(name)

    def _remove_own_leftovers(self, named: set) -> None:
        prefix = paths.job_block_prefix(self.socket_path)
        try:
            entries = [e for e in os.listdir("/dev/shm") if e.startswith(prefix) and "/" + e not in named]
        except OSError:
            return
        foreign = 0
        for entry in entries:
            try:
                owner = os.stat("/dev/shm/" + entry, follow_symlinks=False).st_uid
            except OSError:
                continue
            if owner == os.geteuid():
                self._unlink_quietly("/" + entry)
                _event("leftover job block removed", block="/" + entry)
            else:
                foreign += 1
        if foreign:
            _event("blocks of other users ignored", logging.WARNING, count=foreign, prefix=prefix,
                   reason="not named by this coordinator's state; they are never read or adopted")

    @staticmethod
    def _unlink_quietly(name: str) -> None:
        try:
            _core().shm_unlink(name)
        except Exception:  # noqa: BLE001 - a name we cannot remove is not worth stopping for
            pass

    def _load_state(self) -> Optional[Dict[str, Any]]:
        """The saved state; {} when there is none, None when there is one that
        cannot be read (then nothing is adopted, and no block is taken for a
        leftover: the jobs it named may be running)."""
        try:
            return self._run_dir.read_json(paths.STATE_SUFFIX)
        except UnreadableJson as error:
            # Kept aside, not overwritten by the next save: what it held may be read by hand.
            kept = paths.STATE_SUFFIX + f".unreadable-{int(time.time())}"
            try:
                self._run_dir.rename(paths.STATE_SUFFIX, kept)
            except OSError as rename_error:
                kept = f"not kept aside: {rename_error}"
            else:
                kept = self._run_dir.name(kept)
            _event("state file unreadable", logging.ERROR, reason=str(error), kept=kept,
                   consequence="no job is re-adopted and no job block is removed; jobs that were running go on "
                               "without the coordinator until they are restarted")
            return None
        except (UnsafeRunDirectory, OSError) as error:
            _event("state file not read", logging.WARNING, reason=str(error))
            return {}

    def _forget_unused_gpu_totals(self) -> None:
        """Drops the sizes jobs reported for GPUs by UUID that no job runs on
        any more (the node's listed GPUs and the index:N keys, at most one per
        CUDA index, stay): a registration may name any UUID, so they would
        otherwise pile up in memory and in every save of the state."""
        used = {j.gpu for j in self.jobs.values()}
        for key in [k for k in self.gpu_totals if k not in used and k not in self._listed_keys
                    and not gpus.is_synthetic(k)]:
            del self.gpu_totals[key]
            self._last_share_decision.pop(key, None)

    def _save_state(self) -> None:
        """Writes the state durably: when this returns, a kill -9 or a power
        cut loses none of it (replies that acknowledge a change come after)."""
        self._forget_unused_gpu_totals()
        state: Dict[str, Any] = {
            str(j.job_id): {
                "name": j.name, "role": j.role, "device": j.device, "gpu": j.gpu, "pid": j.pid, "pid_start_ticks": j.pid_start_ticks,
                "uid": j.uid, "block": j.block.name, "owner_token": j.owner_token, "cap": j.cap, "share": j.share,
                "user_cap": j.user_cap, "pinned_share": j.pinned_share, "persistent_bytes": j.persistent_bytes,
                "admitted": j.admitted, "queue_reason": j.queue_reason, "baseline_us": j.baseline.baseline_us,
            }
            for j in self.jobs.values()
        }
        state["_next_job_id"] = self.next_job_id
        state["_gpu_totals"] = dict(self.gpu_totals)
        state["_queue"] = self.queue.state()
        self._run_dir.write_durably(paths.STATE_SUFFIX, json.dumps(state, allow_nan=False).encode())
        self.queue.saved()
        self._state_dirty = False

    # --- the control loop ------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - one bad tick must not stop the coordinator
                log.exception("tick failed", extra={"fields": {}})
            await asyncio.sleep(self.config.tick_s)

    def tick(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        now_ns = _core().monotonic_ns()
        for job in list(self.jobs.values()):
            self._beat(job)
            if process_alive(job.pid, job.pid_start_ticks):  # a dead job's block is not read: it may be stuck mid-update
                self._read_report(job)  # never waits: keeps the last report while the job's writer is mid-update
            reason = self._death_reason(job, now_ns)
            if reason:
                self._reclaim(job, reason)
            elif job.commands:
                self._send_waiting_command(job)
        meminfo = host_memory.read_meminfo()  # once a tick, for every GPU's plan
        if now - self._cgroups_read >= CGROUP_READ_INTERVAL_S:
            self._cgroups_read = now
            for job in self.jobs.values():
                job.cgroup_rooms = host_memory.cgroup_rooms(job.pid, self.config.cgroup_root)
        for gpu in sorted({j.gpu for j in self.jobs.values()}):
            self._plan_device(gpu, now, meminfo)
        self.queue.tick(now)
        if self.queue.changed():
            self._state_dirty = True
        if now - self._last_history >= self.config.history_interval_s:
            self._last_history = now
            self._record_history()
        if self.metrics is not None:
            self.metrics.update(self.jobs, meminfo)
        if self._state_dirty:
            self._save_state()

    def _beat(self, job: Job) -> None:
        """The coordinator's heartbeat in the job's block: a job that stops
        hearing it for `on_their_own_after_s` runs on its own (a suspended or
        paused job resumes) until it hears it again."""
        try:
            job.block.beat(self.config.on_their_own_after_s)
        except _core().Error:
            pass  # its job shrank its block away: the report's read says so, and death is checked below

    def _send_waiting_command(self, job: Job) -> None:
        try:
            sequence = job.send_waiting_command()
        except _core().Error as error:  # its job shrank its block away
            _event("command not sent", logging.WARNING, job=job.name, job_id=job.job_id, reason=str(error))
            return
        if sequence is not None:
            _event("command sent", job=job.name, sequence=sequence, waited=True)

    def _read_report(self, job: Job) -> None:
        new = job.block.report()  # None while the job's writer is mid-update (gives up after 2 ms)
        if new is None:
            return
        count = job.report.get("iteration_count", 0)
        job.report, refused = report.check(new, job.report)
        if job.report.get("applied_memory_cap") == job.cap:
            job.cap_written_high = None  # it follows the cap in force, and no other
        if job.report.get("iteration_count", 0) != count:
            job.iterated_at = time.monotonic()
        if refused:
            job.invalid_reports += 1
            if job.invalid_reports == 1:  # once per job: the count is in `status`
                _event("job reported invalid numbers", logging.WARNING, job=job.name, job_id=job.job_id,
                       fields=refused, action="each keeps its last valid value")

    def _death_reason(self, job: Job, now_ns: int) -> str:
        """Why `job` is gone, or "" while it lives. Only a process that is gone
        (or whose pid now names another process) or that said it exited is
        reclaimed: a live process whose heartbeat stopped (SIGSTOP, a debugger,
        a hang) still holds its GPU memory, so it keeps its block, its cap and
        its memory in the plan, and shows as paused or unresponsive."""
        if job.report.get("state") == "exited":
            return "it exited"
        if not process_alive(job.pid, job.pid_start_ticks):
            return f"its process {job.pid} is gone"
        heartbeat = job.report.get("heartbeat_ns", 0)
        silent = heartbeat and (now_ns - heartbeat) / 1e9 > self.config.stale_heartbeat_s
        if silent and job.silent_since is None:
            job.silent_since = time.monotonic()
            _event("job silent, kept", logging.WARNING, job=job.name, job_id=job.job_id, pid=job.pid,
                   state=job.state(), heartbeat_age_s=round((now_ns - heartbeat) / 1e9, 1),
                   reason="its process lives and holds its memory; it is reclaimed only when the process is gone")
        elif not silent and job.silent_since is not None:
            job.silent_since = None
            _event("job heard again", job=job.name, job_id=job.job_id, pid=job.pid)
        if (not heartbeat and time.monotonic() - job.registered_at > self.config.attach_timeout_s
                and not process_stopped(job.pid)):
            # E.g. the coordinator died between creating the block and replying:
            # the job never learnt its block and runs on its own.
            return f"it never attached to its block in {self.config.attach_timeout_s:.0f} s"
        return ""

    def _reclaim(self, job: Job, reason: str) -> None:
        self.jobs.pop(job.job_id, None)
        try:
            job.block.unlink()
        except Exception:  # noqa: BLE001
            self._unlink_quietly(job.block.name)
        if self.metrics is not None:
            self.metrics.reclaimed.inc()
            self.metrics.forget(job)
        self._state_dirty = True
        self._write_history({"t": time.time(), "event": "reclaimed", "job": job.name, "job_id": job.job_id,
                             "gpu": job.device, "gpu_key": job.gpu, "reason": reason})
        _event("job reclaimed", job=job.name, job_id=job.job_id, pid=job.pid, reason=reason)

    def _learn_node_gpus(self) -> None:
        """The node's GPUs (index, UUID, memory), from NVML, else nvidia-smi."""
        found, source = gpus.detect()
        self.node_gpus = found
        for gpu in found:
            self.gpu_memory[gpu.index] = gpu.total_bytes
            self.gpu_totals[gpu.uuid] = gpu.total_bytes
            self.gpu_totals.setdefault(gpus.gpu_key(None, gpu.index), gpu.total_bytes)
            self._listed_keys.add(gpu.uuid)
        if found:
            _event("gpus found", source=source, gpus=[{"index": g.index, "uuid": g.uuid} for g in found])
        else:
            _event("gpus not listed", logging.WARNING, reason=source,
                   consequence="jobs are told apart by the GPU UUID they report; a job that reports none is "
                               "keyed by its CUDA index (index:N)")

    def _node_key(self, index: int) -> str:
        """The key of the node's GPU `index` (the queue's and --gpus' numbering)."""
        for gpu in self.node_gpus:
            if gpu.index == index:
                return gpu.uuid
        return gpus.gpu_key(None, index)

    def _device_total(self, gpu: Union[str, int]) -> Optional[int]:
        """Memory of a GPU, by key (or by the node's index)."""
        if self.config.gpu_memory_bytes is not None:
            return self.config.gpu_memory_bytes
        key = self._node_key(gpu) if isinstance(gpu, int) else gpu
        return self.gpu_totals.get(key)

    def _resolve_cap(self, value: Any, gpu: str, request_id: Any) -> Optional[int]:
        """A cap from the wire (bytes, null or a cap's text) in bytes on GPU `gpu`,
        through the one parser (cotenant._core.Cap)."""
        cap = _core().Cap(value)
        if cap.is_fraction and self._device_total(gpu) is None:
            raise ProtocolError(protocol.BAD_REQUEST,
                                f"the cap {cap} is a fraction of the GPU, and this coordinator does not know GPU "
                                f"{gpu}'s memory; give the cap in bytes (e.g. \"6GiB\")", request_id)
        return cap.resolve(self._device_total(gpu) or 0)

    def _plan_device(self, device: str, now: float, meminfo: Optional[Dict[str, int]]) -> None:
        jobs = [j for j in self.jobs.values() if j.gpu == device]
        total = self._device_total(device)
        guaranteed = [j for j in jobs if j.role == policy.GUARANTEED]
        opportunistic = [j for j in jobs if j.role == policy.OPPORTUNISTIC]

        # Admission of queued jobs, oldest first.
        if total is not None:
            for job in sorted((j for j in opportunistic if not j.admitted), key=lambda j: j.job_id):
                decision = self._admission(job.persistent_bytes, device, total, exclude=job.job_id)
                if decision.decision == policy.ADMIT:
                    job.admitted, job.queue_reason = True, ""
                    self._state_dirty = True
                    _event("queued job admitted", job=job.name, job_id=job.job_id)

        # Baselines.
        for job in guaranteed:
            updated = policy.update_baseline(
                job.baseline, job.report.get("iteration_count", 0), job.report.get("iteration_total_ns", 0),
                self.config.baseline,
            )
            if updated != job.baseline:
                job.baseline = updated
                if updated.baseline_us is not None:
                    self._state_dirty = True
                    _event("baseline measured", job=job.name, baseline_us=round(updated.baseline_us, 1))

        # Memory.
        if total is not None:
            observed = [j.observation() for j in jobs]
            caps = policy.plan_memory_caps(total, observed, self.config.memory)
            node_room, group_rooms = self._host_rooms(device, meminfo)
            bound = policy.bound_squeezes_by_host(caps, observed, node_room, group_rooms)
            self._held_back_by_host(jobs, bound.held_back)
            for job in jobs:
                self._apply(job, cap=bound.caps.get(job.job_id, job.cap))
        else:
            self._held_back_by_host(jobs, {})  # no plan, nothing held back
            for job in jobs:  # capacity unknown: only administrator caps apply
                self._apply(job, cap=job.user_cap)

        # Compute shares, at a slower pace (a decision needs fresh iterations).
        warming_up = any(j.warming_up(now, self.config.baseline_timeout_s) for j in guaranteed)
        if now - self._last_share_decision.get(device, float("-inf")) >= self.config.share_interval_s or warming_up:
            self._last_share_decision[device] = now
            shares = policy.plan_shares(
                {j.job_id: j.share for j in opportunistic},
                [j.slowdown() for j in guaranteed],
                warming_up,
                bool(guaranteed),
                pinned={j.job_id: j.pinned_share for j in opportunistic if j.pinned_share is not None},
                admitted={j.job_id: j.admitted for j in opportunistic},
                config=self.config.share,
            )
            for job in opportunistic:
                self._apply(job, share=shares[job.job_id])
        self._remeasure_after_pause(guaranteed, opportunistic, warming_up)
        for job in guaranteed:
            self._apply(job, share=job.pinned_share if job.pinned_share is not None else 1.0)

    def _remeasure_after_pause(self, guaranteed: List[Job], opportunistic: List[Job], warming_up: bool) -> None:
        """Counts each guaranteed job's iterations while every opportunistic job
        of its GPU is at share 0; one still slow after a warm-up's worth of
        them has its baseline measured again (policy.remeasure_after_pause)."""
        paused = bool(opportunistic) and not warming_up and all(j.share == 0.0 for j in opportunistic)
        for job in guaranteed:
            count = job.report.get("iteration_count", 0)
            if not paused or job.paused_since_count is None:
                job.paused_since_count = count if paused else None
                continue
            slowdown = job.slowdown()
            updated = policy.remeasure_after_pause(job.baseline, count, count - job.paused_since_count, slowdown,
                                                   self.config.baseline, self.config.share)
            if updated != job.baseline:
                _event("baseline measured again: the job stays slow with every opportunistic job paused",
                       job=job.name, job_id=job.job_id, baseline_us=round(job.baseline.baseline_us or 0.0, 1),
                       slowdown=round(slowdown or 0.0, 3), paused_iterations=count - job.paused_since_count)
                job.baseline, job.paused_since_count = updated, None
                self._state_dirty = True

    def _host_rooms(self, device: str, meminfo: Optional[Dict[str, int]]) -> Tuple[Optional[int], Dict[str, int]]:
        """What squeezes on GPU `device` may pin: on the node, its available
        host memory (`meminfo`, read_meminfo()'s) less the host headroom
        (None where /proc/meminfo cannot be read: no bound); for each group
        of jobs (Job.host_room_groups): in one cgroup, the least any of them
        reports (the latest to see the others' pins); under one limited
        memory cgroup, its room as this coordinator reads it less the host
        headroom (as each job's own figure is). Each less what caps on the
        other GPUs will still pin."""
        headroom = self.config.memory.host_headroom_bytes
        elsewhere = 0
        rooms: Dict[str, int] = {}
        group_elsewhere: Dict[str, int] = collections.defaultdict(int)
        for job in self.jobs.values():
            pins = job.observation().pins_under(job.cap) if job.gpu != device else 0
            elsewhere += pins
            room = job.report.get("host_room_bytes")
            if job.cgroup is not None and room is not None:
                rooms[job.cgroup] = min(rooms.get(job.cgroup, room), room)
            for path, cgroup_room in job.cgroup_rooms:
                rooms[path] = cgroup_room - headroom
            for group in job.host_room_groups():
                group_elsewhere[group] += pins
        node = None if meminfo is None else meminfo["available_bytes"] - headroom - elsewhere
        return node, {group: room - group_elsewhere[group] for group, room in rooms.items()}

    def _held_back_by_host(self, jobs: List["Job"], held_back: Dict[int, int]) -> None:
        """Records, and logs when it starts and ends, each job's squeeze held back by host memory."""
        for job in jobs:
            now_held = held_back.get(job.job_id, 0)
            if bool(now_held) != bool(job.held_back_bytes):
                if now_held:
                    _event("squeeze held back by host memory", logging.WARNING, job=job.name,
                           held_back_bytes=now_held, host_headroom_bytes=self.config.memory.host_headroom_bytes,
                           job_host_room_bytes=job.report.get("host_room_bytes"),
                           consequence="the job's cap stays above the plan, its pages on the device, so that the "
                                       "node keeps its host headroom available and the job stays within its "
                                       "own memory limit")
                else:
                    _event("squeeze no longer held back by host memory", job=job.name)
            job.held_back_bytes = now_held

    def _apply(self, job: Job, cap: Any = ..., share: Any = ...) -> None:
        changes: Dict[str, Any] = {}
        if cap is not ... and cap != job.cap:
            changes["memory_cap"] = cap
        if share is not ... and share != job.share:
            changes["share"] = share
        if not changes:
            return
        try:
            job.block.set_control(**changes)
        except _core().Error as error:  # its job shrank its block away: that job only is not written
            _event("job block not written", logging.WARNING, job=job.name, job_id=job.job_id, reason=str(error))
            return
        if "memory_cap" in changes:
            job.cap = changes["memory_cap"]
            if job.cap is not None:
                job.cap_written_high = max(job.cap_written_high or 0, job.cap)
        if "share" in changes:
            job.share = changes["share"]
        _event("control changed", logging.DEBUG, job=job.name, **changes)

    def _admission(self, persistent_bytes: int, device: str, total: int, exclude: int = -1) -> policy.Admission:
        held = sum(j.observation().live_bytes for j in self.jobs.values()
                   if j.gpu == device and j.role == policy.GUARANTEED)
        others = sum(j.persistent_bytes for j in self.jobs.values()
                     if j.gpu == device and j.role == policy.OPPORTUNISTIC and j.admitted and j.job_id != exclude)
        return policy.admit_opportunistic(persistent_bytes, total, held, others, self.config.memory)

    def _record_history(self) -> None:
        t = time.time()
        for job in self.jobs.values():
            self._write_history({
                "t": round(t, 3), "gpu": job.device, "gpu_key": job.gpu, "job": job.name, "job_id": job.job_id, "role": job.role,
                "cap": job.cap, "device_bytes": job.report.get("device_bytes", 0),
                "host_bytes": job.report.get("host_bytes", 0), "share": job.share, "slowdown": job.slowdown(),
            })

    def _write_history(self, record: Dict[str, Any]) -> None:
        self.history.append(record)
        if self._history_file is None:
            return
        self._history_file.write(json.dumps(record, allow_nan=False) + "\n")
        if self._history_file.tell() > self.config.history_max_bytes:
            self._history_file.close()
            self._run_dir.rename(paths.HISTORY_SUFFIX, paths.HISTORY_SUFFIX + ".1")
            self._history_file = self._run_dir.open_append(paths.HISTORY_SUFFIX)

    # --- the control plane -----------------------------------------------------

    def _may_change(self, job: Job, uid: int) -> bool:
        """Only the job's owner, root or the coordinator's own uid (which can
        write every block anyway) may change a job."""
        return uid in (0, job.uid, os.geteuid())

    def _count_error(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code).inc()

    async def _handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, gid = protocol.peer_credentials(sock)
        except OSError:
            writer.close()
            return
        if self._connections[uid] >= self.config.max_connections_per_uid:
            _event("connection refused", logging.WARNING, uid=uid, open=self._connections[uid],
                   reason="too many connections from this uid")
            try:
                await self._send(writer, protocol.reply_error(
                    None, protocol.BUSY,
                    f"uid {uid} already has {self._connections[uid]} connections open to the coordinator, the most "
                    "it allows one user (--max-connections-per-uid); close some and retry"))
            except (ConnectionError, TimeoutError):
                pass
            writer.close()
            return
        self._connections[uid] += 1
        try:
            await self._serve_connection(reader, writer, pid, uid, gid)
        finally:
            self._connections[uid] -= 1
            if not self._connections[uid]:
                del self._connections[uid]

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                pid: int, uid: int, gid: int) -> None:
        last_id = -1
        try:
            while not reader.at_eof():
                try:
                    # A connection silent for the idle timeout is closed: idle ones cannot pile up.
                    line = await asyncio.wait_for(reader.readline(), self.config.idle_timeout_s)
                except (ValueError, asyncio.LimitOverrunError):
                    # The line is longer than the limit: no way to find the next one.
                    await self._send(writer, protocol.reply_error(
                        None, protocol.TOO_LARGE,
                        f"a message may be at most {protocol.MAX_MESSAGE_BYTES} bytes; closing this connection"))
                    self._count_error(protocol.TOO_LARGE)
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    req = protocol.parse_request(line)
                    if req.id <= last_id:
                        raise ProtocolError(
                            protocol.OUT_OF_ORDER,
                            f"request id {req.id} is not greater than the previous id {last_id} on this connection",
                            req.id)
                    last_id = req.id
                    reply = self._dispatch(req, pid, uid, gid)
                except ProtocolError as error:
                    self._count_error(error.code)
                    reply = protocol.reply_error(error.request_id, error.code, error.message)
                except Exception as error:  # noqa: BLE001 - one bad request must not stop the others
                    log.exception("request failed", extra={"fields": {"pid": pid}})
                    self._count_error(protocol.INTERNAL)
                    reply = protocol.reply_error(None, protocol.INTERNAL, f"the coordinator failed: {error}")
                await self._send(writer, reply)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    async def _send(self, writer: asyncio.StreamWriter, reply: Dict[str, Any]) -> None:
        try:
            data = protocol.encode(reply, protocol.MAX_REPLY_BYTES)
        except ProtocolError as error:
            data = protocol.encode(protocol.reply_error(reply.get("id"), error.code, error.message))
        except ValueError as error:  # a number JSON cannot carry: the reply fails, not the connection
            data = protocol.encode(protocol.reply_error(reply.get("id"), protocol.INTERNAL,
                                                        f"the coordinator could not encode its reply: {error}"))
        writer.write(data)
        # A peer that does not read its reply is dropped after the idle timeout.
        await asyncio.wait_for(writer.drain(), self.config.idle_timeout_s)

    def _find_job(self, ref: str, request_id: int) -> Job:
        """A number is a job id, anything else a name (names are never numbers)."""
        for job in self.jobs.values():
            if (str(job.job_id) == ref) if ref.isdigit() else (job.name == ref):
                return job
        what = f"no job with id {ref}" if ref.isdigit() else f"no job named {ref!r}"
        raise ProtocolError(protocol.NO_SUCH_JOB, f"{what}; `cotenant status` lists the jobs and their ids",
                            request_id)

    def _dispatch(self, req: protocol.Request, pid: int, uid: int, gid: int) -> Dict[str, Any]:
        op, args = req.op, req.args
        if op == "hello":
            return protocol.reply_ok(req.id, server="cotenant-coordinator", protocol=protocol.PROTOCOL_VERSION,
                                     pid=os.getpid(), your_pid=pid, your_uid=uid)
        if op == "status":
            return protocol.reply_ok(req.id, **self.status())
        if op == "history":
            since = args.get("since", 0)
            records = [r for r in self.history if r.get("t", 0) >= since][-args.get("limit", 50000):]
            return protocol.reply_ok(req.id, records=records)
        if op == "register":
            return self._register(req, pid, uid)
        if op in protocol.QUEUE_OPS:
            reply = self.queue.handle(req, pid, uid, gid, time.monotonic())
            if self.queue.changed():
                self._save_state()  # before the reply: an acknowledged ticket survives a restart
            return reply
        if op == "unregister":
            # The process's own jobs: the same uid, and a pid that still names the job's process (a
            # reused pid, even of the same uid, names another, whose request must not end a dead job
            # not yet reaped).
            mine = [j for j in self.jobs.values()
                    if j.pid == pid and j.uid == uid and process_alive(pid, j.pid_start_ticks)]
            if not mine:
                raise ProtocolError(protocol.OUT_OF_ORDER,
                                    f"process {pid} has no registered job to unregister; register first", req.id)
            for job in mine:
                self._reclaim(job, "it unregistered")
            return protocol.reply_ok(req.id, unregistered=[j.name for j in mine])
        if op in protocol.ADMIN_OPS:
            job = self._find_job(args["job"], req.id)
            if not self._may_change(job, uid):
                raise ProtocolError(
                    protocol.PERMISSION_DENIED,
                    f"uid {uid} may not change job {job.name!r} (id {job.job_id}): it belongs to uid {job.uid}, and "
                    "only its owner, root or the coordinator's own user may change it", req.id)
            if op == "set_cap":
                self._change_durably(job, "user_cap", self._resolve_cap(args["memory_cap"], job.gpu, req.id))
                if self._device_total(job.gpu) is None:
                    self._apply(job, cap=job.user_cap)
                else:
                    self._plan_device(job.gpu, time.monotonic(), host_memory.read_meminfo())
                _event("cap set", job=job.name, user_cap=job.user_cap, by_pid=pid, by_uid=uid)
                return protocol.reply_ok(req.id, job=job.name, memory_cap=job.cap, user_cap=job.user_cap)
            if op == "set_share":
                share = args["share"]
                self._change_durably(job, "pinned_share", None if share == "auto" else float(share))
                if job.pinned_share is not None:
                    self._apply(job, share=job.pinned_share)
                _event("share set", job=job.name, share=share, by_pid=pid, by_uid=uid)
                return protocol.reply_ok(req.id, job=job.name, share=job.share, pinned=job.pinned_share is not None)
            if op == "command":
                sequence = job.send_command(args["command"])
                _event("command sent", job=job.name, command=args["command"], sequence=sequence, by_pid=pid)
                return protocol.reply_ok(req.id, job=job.name, command=args["command"], sequence=sequence)
        raise ProtocolError(protocol.UNKNOWN_OP, f"op {op!r} is not handled", req.id)

    def _change_durably(self, job: Job, setting: str, value: Any) -> None:
        """Sets an administrator setting of `job` and saves the state before
        the caller replies: no acknowledged change is lost. When the state
        cannot be saved the setting is undone and the request fails."""
        previous = getattr(job, setting)
        setattr(job, setting, value)
        try:
            self._save_state()
        except OSError:
            setattr(job, setting, previous)
            raise

    def _register(self, req: protocol.Request, pid: int, uid: int) -> Dict[str, Any]:
        args = req.args
        index, role = args["device"], args["role"]
        uuid = args.get("gpu_uuid") or None
        device = gpus.gpu_key(uuid, index)
        self._refuse_unmanaged_gpu(uuid, index, req.id)
        if any(j.pid == pid and j.gpu == device for j in self.jobs.values()):
            raise ProtocolError(protocol.OUT_OF_ORDER,
                                f"process {pid} already registered a job on GPU {device}", req.id)
        held = sum(1 for j in self.jobs.values() if j.uid == uid)
        if held >= self.config.max_jobs_per_uid:
            _event("job refused", logging.WARNING, job=args.get("name"), pid=pid, uid=uid, jobs=held,
                   reason="too many jobs registered by this uid")
            raise ProtocolError(protocol.RESOURCE_EXHAUSTED,
                                f"uid {uid} already has {held} jobs registered with the coordinator, the most it "
                                "allows one user (--max-jobs-per-uid); let some end, or start the coordinator "
                                "with a larger --max-jobs-per-uid", req.id)
        if "device_total_bytes" in args:
            # Where the node lists no GPUs, its jobs say how large theirs is; the least said is kept, so
            # one job's wrong (larger) figure cannot make the coordinator hand out memory the GPU lacks.
            known, said = self.gpu_totals.get(device), args["device_total_bytes"]
            if known is None or said < known:
                if known is not None:
                    _event("GPU size lowered", logging.WARNING, gpu=device, job=args.get("name"), pid=pid,
                           was=known, now=said, reason="a job reports less memory on this GPU than one before it")
                self.gpu_totals[device] = said
                self._state_dirty = True
        if gpus.is_synthetic(device):
            _event("job without a GPU UUID", logging.DEBUG, pid=pid, note=gpus.gpu_key_note(device))
        persistent = args.get("persistent_bytes", 0)
        admitted, reason = True, ""
        total = self._device_total(device)
        if role == policy.OPPORTUNISTIC and persistent and total is not None:
            decision = self._admission(persistent, device, total)
            if decision.decision == policy.REFUSE:
                _event("job refused", job=args.get("name"), pid=pid, reason=decision.reason)
                raise ProtocolError(protocol.ADMISSION_REFUSED, decision.reason, req.id)
            if decision.decision == policy.QUEUE:
                admitted, reason = False, decision.reason
        job_id = self.next_job_id
        self.next_job_id += 1
        name = protocol.unique_name(args.get("name") or f"job{job_id}", {j.name for j in self.jobs.values()}, job_id)
        user_cap = self._resolve_cap(args.get("memory_cap"), device, req.id)
        guaranteed_exists = any(j.gpu == device and j.role == policy.GUARANTEED for j in self.jobs.values())
        # Opportunistic jobs start slow (or paused) and climb; guaranteed jobs run unthrottled.
        share = 1.0 if role == policy.GUARANTEED or not guaranteed_exists else 0.0
        if not admitted:
            share = 0.0
        owner_token = secrets.randbits(64)
        block_name = paths.job_block_name(self.socket_path, job_id, owner_token)
        start_ticks = process_start_ticks(pid)
        try:
            block = _core().JobBlock.create(block_name, job_id=job_id, job_name=name, role=role, device=index,
                                            pid=pid, uid=uid, memory_cap=user_cap, share=share,
                                            pid_start_ticks=start_ticks, owner_token=owner_token,
                                            gpu_uuid=uuid or "",
                                            silence_limit_s=self.config.on_their_own_after_s)
        except _core().Error as error:  # e.g. /dev/shm is full: this job is refused, the others go on
            _event("job block not created", logging.WARNING, job=name, pid=pid, reason=str(error))
            raise ProtocolError(protocol.RESOURCE_EXHAUSTED,
                                f"the coordinator could not create this job's shared-memory block: {error}",
                                req.id) from None
        self._give_block_to(block_name, uid)
        job = Job(job_id=job_id, name=name, role=role, device=index, gpu=device, pid=pid, uid=uid, block=block,
                  user_cap=user_cap, persistent_bytes=persistent, admitted=admitted, queue_reason=reason,
                  cap=user_cap, share=share, pid_start_ticks=start_ticks, owner_token=owner_token,
                  cgroup=host_memory.read_cgroup(pid), cgroup_rooms=host_memory.cgroup_rooms(pid, self.config.cgroup_root))
        job.report = block.report() or {}
        self.jobs[job_id] = job
        self._plan_device(device, time.monotonic(), host_memory.read_meminfo())
        self._state_dirty = True
        self._save_state()
        _event("job registered", job=name, job_id=job_id, pid=pid, uid=uid, role=role, gpu=device, device=index,
               cap=job.cap, share=job.share, queued=not admitted)
        return protocol.reply_ok(req.id, job_id=job_id, name=name, block=block_name, memory_cap=job.cap,
                                 share=job.share, admitted=admitted, queue_reason=reason,
                                 host_headroom_bytes=self.config.memory.host_headroom_bytes)

    def _give_block_to(self, block_name: str, uid: int) -> None:
        """A job of another uid must be able to open its block (mode 0660): it
        becomes the block's owner when the coordinator runs as root, else the
        admin group gets it (the coordinator's user must be a member)."""
        if uid == os.getuid():
            return
        path = "/dev/shm" + block_name
        try:
            os.chown(path, uid, -1)
            return
        except PermissionError:
            pass
        if self.admin_gid is not None:
            try:
                os.chown(path, -1, self.admin_gid)
                return
            except PermissionError:
                pass
        _event("job block not shared", logging.WARNING, block=block_name, uid=uid,
               reason="the coordinator may not give the block to the job's uid or the admin group; run it as "
                      "root or in the --group shared with the jobs")

    def _gpu_status(self, key: str) -> Dict[str, Any]:
        jobs = [j for j in self.jobs.values() if j.gpu == key]
        index = next((g.index for g in self.node_gpus if g.uuid == key), None)
        if index is None and gpus.is_synthetic(key):
            index = int(key[len(gpus.SYNTHETIC_PREFIX):])
        return {"gpu": key, "uuid": None if gpus.is_synthetic(key) else key, "index": index,
                "note": gpus.gpu_key_note(key), "total_bytes": self._device_total(key), "jobs": len(jobs),
                **_gpu_totals_of(jobs)}

    def _refuse_unmanaged_gpu(self, uuid: Optional[str], index: int, request_id: Any) -> None:
        """With --gpus, a job must run on one of them: by its UUID where the node's GPUs are known."""
        if self.config.gpus is None:
            return
        node_index = next((g.index for g in self.node_gpus if g.uuid == uuid), None) if uuid else None
        which = index if node_index is None else node_index
        if which not in self.config.gpus:
            named = f"GPU {which}" + (f" ({uuid})" if uuid else "")
            raise ProtocolError(protocol.BAD_REQUEST,
                                f"this coordinator manages GPUs {self.config.gpus}, not {named}; start one "
                                "with --gpus including it, or run the job on a managed GPU", request_id)

    def status(self) -> Dict[str, Any]:
        now_ns = _core().monotonic_ns()
        keys = sorted({j.gpu for j in self.jobs.values()} | {self._node_key(i) for i in self.config.gpus or []})
        jobs = [j.status(now_ns) for j in sorted(self.jobs.values(), key=lambda j: (j.gpu, j.job_id))]
        return {
            "coordinator": {"pid": os.getpid(), "socket": self.socket_path, "protocol": protocol.PROTOCOL_VERSION},
            "gpus": [self._gpu_status(key) for key in keys],
            "host": host_memory.host_status(host_memory.read_meminfo(), jobs, self.config.memory.host_headroom_bytes),
            "jobs": jobs,
            "queue": self.queue.status(),
        }


# A GPU's total -> the job report field it sums.
_GPU_TOTALS = {"device_bytes": "device_bytes", "host_bytes": "host_bytes", "host_pool_bytes": "host_pool_bytes",
               "spilled_bytes": "spilled_bytes", "restored_bytes": "restored_bytes", "page_moves": "num_migrations"}


def _gpu_totals_of(jobs: List[Job]) -> Dict[str, int]:
    """What the jobs on one GPU hold and have moved (bytes, page moves)."""
    return {total: sum(int(job.report.get(source, 0) or 0) for job in jobs) for total, source in _GPU_TOTALS.items()}


def _raise_descriptor_limit() -> None:
    """Every connection costs a descriptor: take all the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def _loop_error(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
    """asyncio's own failures (e.g. accept() with no descriptor left): one
    JSON event, rate-limited like the others."""
    error = context.get("exception")
    _event("event loop error", logging.WARNING, message=context.get("message", ""),
           error=f"{type(error).__name__}: {error}" if error else None)


def run(config: CoordinatorConfig, log_level: str = "info") -> int:
    configure_logging(log_level)
    coordinator = Coordinator(config)
    try:
        asyncio.run(coordinator.serve())
    except KeyboardInterrupt:
        pass
    return 0
