"""The daemon's side of the job queue: requests in, policy decisions out, commands to jobs.

The daemon holds one QueueService and calls it from three places: requests of
the queue ops (`handle`), every tick (`tick`) and `status`. It maps each
queued process to the job it registers as (the same pid: `cotenant run`
execs the program) to send suspend and resume, and to read whether a
suspend has happened.

What it cannot do: suspend a program that never registered with the
coordinator (not a cotenant job); such a job keeps its GPUs until it exits,
and a warning says so.
"""

from __future__ import annotations

import os

import collections
import logging
from typing import Any, Deque, Dict, List, Optional, Tuple

from cotenant.coordinator import protocol
from cotenant.coordinator.protocol import ProtocolError
from cotenant.coordinator.queue import ADMIT, REFUSE, RESUME, SUSPEND, JobQueue
from cotenant.scheduling.state import STOPPING

_SENT = {SUSPEND: "queued job suspended", RESUME: "queued job resumed"}
_REMEMBERED_OUTCOMES = 1024  # ended tickets whose outcome a polling process may still ask for


class QueueService:
    def __init__(self, coordinator, policy) -> None:
        self.coordinator = coordinator
        self.queue = JobQueue(policy)
        self.outcomes: Dict[int, Tuple[str, str]] = {}  # ticket -> (state, reason) once it left the queue
        self._ended: Deque[int] = collections.deque()
        self._undelivered: Dict[int, str] = {}  # ticket -> command for a process not registered yet
        # ticket -> the sequence its last suspend carries: a "suspended" report counts once the job
        # applied that one (a report left from an earlier suspend is not this one's)
        self._suspend_sequence: Dict[int, int] = {}
        self._unsuspendable_warned: set = set()
        self._stranded_warned: set = set()
        self._saved_shape: Any = None  # the queue's shape when the daemon last saved its state

    # --- requests ---------------------------------------------------------------------

    def handle(self, req: protocol.Request, pid: int, uid: int, gid: int, now: float) -> Dict[str, Any]:
        args = req.args
        if req.op == "submit":
            from cotenant.coordinator.daemon import process_start_ticks

            if self.queue.by_pid(pid) is not None:
                raise ProtocolError(protocol.OUT_OF_ORDER, f"process {pid} already waits in the queue", req.id)
            held = sum(1 for j in self.queue.jobs.values() if j.uid == uid)
            limit = self.coordinator.config.max_jobs_per_uid
            if held >= limit:
                self._log("job not queued", logging.WARNING, pid=pid, uid=uid, tickets=held,
                          reason="too many tickets held by this uid")
                raise ProtocolError(protocol.RESOURCE_EXHAUSTED,
                                    f"uid {uid} already holds {held} tickets in the coordinator's queue, the most "
                                    "it allows one user (--max-jobs-per-uid); let some end or cancel them, or "
                                    "start the coordinator with a larger --max-jobs-per-uid", req.id)
            name = protocol.unique_name(args.get("name") or f"queued{self.queue.next_ticket}",
                                        {j.name for j in self.queue.jobs.values()}, self.queue.next_ticket)
            job = self.queue.submit(now, name, pid, uid, args.get("role"), args.get("gpus", 1),
                                    args.get("persistent_bytes", 0), args.get("peak_bytes", 0),
                                    process_start_ticks(pid))
            self._log("job queued", job=name, ticket=job.ticket, pid=pid, gpus=job.num_gpus, role=job.role)
            self.decide(now)
            return protocol.reply_ok(req.id, **self.state_of(job.ticket))
        if req.op == "queue_state":
            return protocol.reply_ok(req.id, **self.state_of(args["ticket"], req.id))
        if req.op == "cancel":
            job = self.queue.find(args["job"])
            if job is None:
                raise ProtocolError(protocol.NO_SUCH_JOB, f"no queued job named {args['job']!r}; `cotenant status` "
                                    "lists the queue", req.id)
            if uid not in (0, job.uid, os.geteuid()):  # the rule of Coordinator._may_change
                raise ProtocolError(protocol.PERMISSION_DENIED,
                                    f"process {pid} (uid {uid}) may not cancel job {job.name!r}: only its own user, "
                                    "the coordinator's user or root may", req.id)
            if job.status != "waiting":
                raise ProtocolError(protocol.BAD_REQUEST,
                                    f"job {job.name!r} is {job.status}, not waiting: stop its process instead", req.id)
            self._end(job.ticket, "cancelled", f"cancelled by uid {uid}")
            self._log("queued job cancelled", job=job.name, ticket=job.ticket, by_uid=uid)
            self.decide(now)
            return protocol.reply_ok(req.id, job=job.name, ticket=job.ticket, state="cancelled")
        raise ProtocolError(protocol.UNKNOWN_OP, f"op {req.op!r} is not a queue op", req.id)

    def state_of(self, ticket: int, request_id: Optional[int] = None) -> Dict[str, Any]:
        if ticket in self.outcomes:
            state, reason = self.outcomes[ticket]
            return {"ticket": ticket, "state": state, "reason": reason}
        for row in self.queue.status():
            if row["ticket"] == ticket:
                return row
        raise ProtocolError(protocol.NO_SUCH_JOB, f"no queued job with ticket {ticket}", request_id)

    # --- across a restart of the daemon ------------------------------------------------

    def changed(self) -> bool:
        """Whether the queue changed since the daemon last saved it (time accounts aside)."""
        return self.queue.shape() != self._saved_shape

    def state(self) -> Dict[str, Any]:
        """The queue for the daemon's durable state (then `saved()`, once it is on disk)."""
        return {**self.queue.to_state(), "undelivered": {str(t): c for t, c in self._undelivered.items()},
                "suspend_sequences": {str(t): n for t, n in self._suspend_sequence.items()}}

    def saved(self) -> None:
        self._saved_shape = self.queue.shape()

    def restore(self, saved: Dict[str, Any]) -> None:
        """Takes back the queue a previous daemon saved: every job whose process still runs (the same
        process: pid and start time), as it was. A waiting process polls the new daemon by its
        ticket; a suspended job resumes where it was when the policy says so."""
        from cotenant.coordinator.daemon import process_alive

        if not saved:
            return
        for job in self.queue.restore(saved, lambda j: process_alive(j.pid, j.pid_start_ticks)):
            self._log("queued job dropped at start", job=job.name, ticket=job.ticket, reason="its process exited")
        for ticket, command in saved.get("undelivered", {}).items():
            if int(ticket) in self.queue.jobs:
                self._undelivered[int(ticket)] = command
        # A suspend sent before the restart and not applied yet: its GPUs are still the job's until it is.
        for ticket, sequence in saved.get("suspend_sequences", {}).items():
            if int(ticket) in self.queue.jobs:
                self._suspend_sequence[int(ticket)] = int(sequence)
        for job in self.queue.jobs.values():
            self._log("queued job re-adopted", job=job.name, ticket=job.ticket, state=job.status,
                      gpus=list(job.gpus or job.suspended_on))
        self._saved_shape = self.queue.shape()

    # --- every tick -------------------------------------------------------------------

    def tick(self, now: float) -> None:
        from cotenant.coordinator.daemon import process_alive

        if not self.queue.jobs:
            return
        for job in list(self.queue.jobs.values()):
            if not process_alive(job.pid, job.pid_start_ticks):  # a reused pid is another process
                self._end(job.ticket, "finished", "its process exited")
                self._log("queued job ended", job=job.name, ticket=job.ticket, attained_gpu_s=job.attained_service)
            elif job.status == STOPPING:
                registered = self._registered(job.pid)
                if registered is not None and job.ticket in self._undelivered:
                    self._send(job, self._undelivered.pop(job.ticket))
                elif (registered is not None and registered.report.get("state") == "suspended"
                      and int(registered.report.get("applied_command_sequence", 0))
                      >= self._suspend_sequence.get(job.ticket, 0)):
                    self.queue.stopped(job.ticket, now)
                    self._suspend_sequence.pop(job.ticket, None)
        shares = {}
        for job in self.queue.jobs.values():
            registered = self._registered(job.pid)
            if registered is not None:
                shares[job.ticket] = registered.share
        self.queue.advance(now, shares)
        self.decide(now)

    def decide(self, now: float) -> None:
        gpus, memory = self._node()
        for action in self.queue.decide(now, gpus, memory):
            job = action.job
            if action.kind == REFUSE:
                self._end(job.ticket, "refused", action.reason, already_removed=True)
                self._log("queued job refused", job=job.name, ticket=job.ticket, reason=action.reason)
            elif action.kind == ADMIT:
                self._log("queued job admitted", job=job.name, ticket=job.ticket, gpus=list(job.gpus),
                          role=job.running_role)
            elif action.kind in (SUSPEND, RESUME):
                self._send(job, action.kind)
        for ticket, missing in self.queue.stranded.items():
            if ticket not in self._stranded_warned:
                job = self.queue.jobs[ticket]
                listed = ", ".join(str(g) for g in missing)
                self._log("queued job cannot resume", logging.WARNING, job=job.name, ticket=ticket, missing_gpus=listed,
                          reason=f"it was suspended on GPU {listed}, which this coordinator does not schedule "
                                 f"(its GPUs: {', '.join(str(g) for g in gpus)}), and it resumes only there: its "
                                 f"process and memory stay on that GPU and in host memory",
                          fix=f"restart the coordinator with GPU {listed} in --gpus, or stop the job's process "
                              f"(pid {job.pid})")
        self._stranded_warned = set(self.queue.stranded)  # said once while it lasts

    def _send(self, job, command: str) -> None:
        """Sends suspend or resume to the job the queued process registered as; a process not
        registered yet (starting) gets it when it registers."""
        registered = self._registered(job.pid)
        if registered is None:
            self._undelivered[job.ticket] = command
            if job.ticket not in self._unsuspendable_warned:
                self._unsuspendable_warned.add(job.ticket)
                self._log("queued job not registered yet", job=job.name, ticket=job.ticket, command=command,
                          reason="the command waits for its registration; a program that is not a cotenant job "
                                 "keeps its GPUs until it exits")
            return
        self._undelivered.pop(job.ticket, None)
        from cotenant import _core

        try:
            sequence = registered.send_command(command)
        except (_core.Error, ProtocolError) as error:  # a shrunk block, or commands piled up: the queue goes on
            self._log("queued job not sent its command", logging.WARNING, job=job.name, ticket=job.ticket,
                      command=command, reason=str(error))
            return
        self._log(_SENT[command], job=job.name, ticket=job.ticket, sequence=sequence)
        if command == SUSPEND:
            self._suspend_sequence[job.ticket] = int(sequence)
        else:
            self._suspend_sequence.pop(job.ticket, None)

    def _node(self) -> Tuple[List[int], Optional[int]]:
        """The GPUs the queue schedules (the managed ones, else those known, else GPU 0) and the
        memory of the smallest (None when unknown)."""
        c = self.coordinator
        gpus = list(c.config.gpus) if c.config.gpus else sorted(c.gpu_memory) or [0]
        totals = [c._device_total(g) for g in gpus]
        return gpus, (min(totals) if all(t is not None for t in totals) else None)

    def _registered(self, pid: int):
        for job in self.coordinator.jobs.values():
            if job.pid == pid:
                return job
        return None

    def _end(self, ticket: int, state: str, reason: str, already_removed: bool = False) -> None:
        if not already_removed:
            self.queue.remove(ticket)
        self._undelivered.pop(ticket, None)
        self._suspend_sequence.pop(ticket, None)
        self.outcomes[ticket] = (state, reason)
        self._ended.append(ticket)
        while len(self._ended) > _REMEMBERED_OUTCOMES:
            self.outcomes.pop(self._ended.popleft(), None)

    def status(self) -> List[Dict[str, Any]]:
        return self.queue.status()

    @staticmethod
    def _log(event: str, level: int = logging.INFO, **fields: Any) -> None:
        from cotenant.coordinator.daemon import _event

        _event(event, level, **fields)
