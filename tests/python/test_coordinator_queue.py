"""The coordinator's job queue end to end, time-compressed: `cotenant run --queue`, `submit`,
`cancel` and `status` with simulated jobs (real client, shared memory, CachingAllocator on the
SimulatedBackend) under the real daemon, with FIFO, 2D-LAS and time-slicing."""

import json
import os
import subprocess
import sys

import pytest

from coordinator_harness import HERE, MiB, Node, child_env, wait_until
from cotenant.coordinator.queue import ADMIT, RESUME, SUSPEND, JobQueue
from cotenant.scheduling.policies import DiscretizedLas, Fifo


def queue_env():
    env = child_env()
    env["COTENANT_DISABLE"] = "1"  # the start-up hook would look for a GPU; the simulated job registers itself
    return env


class QueuedProcess:
    def __init__(self, node, name, iterations=0, hold_mib=32, iteration_us=20000, how=("run", "--queue")):
        self.node, self.name = node, name
        self.control = os.path.join(node.directory, name)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cotenant.cli", *how, "--guaranteed", "--name", name, "--socket", node.socket,
             "--", sys.executable, os.path.join(HERE, "simulated_job.py"), "--socket", node.socket,
             "--role", "guaranteed", "--name", name, "--hold-mib", str(hold_mib),
             "--iteration-us", str(iteration_us), "--iterations", str(iterations), "--control", self.control],
            env=queue_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def queued(self):
        return next((q for q in self.node.status().get("queue", []) if q["name"] == self.name), None)

    def registered(self):
        return self.node.job(self.name)

    def resumes(self):
        try:
            with open(self.control + ".resumes") as f:
                return int(f.read())
        except OSError:
            return 0

    def corrupt(self):
        return os.path.exists(self.control + ".corrupt")

    def finish(self, timeout=30):
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, err

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def make_node():
    nodes, processes = [], []

    def make(*args, gpus="0"):
        node = Node(extra_args=("--gpus", gpus, *args))
        nodes.append(node)
        node.start_coordinator()
        node.spawn = lambda *a, **k: processes.append(QueuedProcess(node, *a, **k)) or processes[-1]
        return node

    yield make
    for p in processes:
        p.kill()
    for node in nodes:
        node.close()


def test_queued_job_starts_only_when_admitted_and_status_shows_its_position(make_node):
    node = make_node("--scheduler", "fifo", gpus="0,1")
    a = node.spawn("a")
    assert wait_until(lambda: a.queued(), timeout=15)
    b = node.spawn("b")
    assert wait_until(lambda: a.registered() and b.registered(), timeout=15), node.read_log()
    c = node.spawn("c", iterations=5)
    assert wait_until(lambda: (c.queued() or {}).get("state") == "waiting", timeout=10)
    assert c.queued()["position"] == 1 and c.queued()["priority"] == 0
    assert c.registered() is None  # its program has not started
    status = subprocess.run([sys.executable, "-m", "cotenant.cli", "status", "--socket", node.socket],
                            env=queue_env(), capture_output=True, text=True, timeout=30).stdout
    assert "queue:" in status and "waiting" in status
    a.kill()  # a GPU frees up: c is admitted, starts, runs its 5 iterations and ends
    assert c.finish()[0] == 0
    assert c.resumes() == 0 and not c.corrupt()


def test_cancel_removes_a_waiting_job_and_its_process_says_so(make_node):
    node = make_node("--scheduler", "fifo")
    a = node.spawn("a")
    assert wait_until(lambda: a.queued(), timeout=15)
    b = node.spawn("b")
    assert wait_until(lambda: (b.queued() or {}).get("state") == "waiting", timeout=15)
    done = subprocess.run([sys.executable, "-m", "cotenant.cli", "cancel", "b", "--socket", node.socket],
                          env=queue_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "cancelled" in done.stdout
    code, _, err = b.finish()
    assert code == 1 and "cancelled" in err
    assert b.registered() is None


def test_submit_returns_at_once_and_the_job_runs_once_admitted(make_node):
    node = make_node("--scheduler", "fifo")
    first = node.spawn("first", iterations=10)
    assert wait_until(lambda: first.registered(), timeout=15)
    later = node.spawn("later", iterations=5, how=("submit",))
    code, out, _ = later.finish(timeout=15)
    assert code == 0 and "queued as ticket" in out
    assert first.finish()[0] == 0
    assert wait_until(lambda: any(r.get("event") == "queued job ended" and r.get("job") == "later"
                                  for r in node_events(node)), timeout=20), node.read_log()


def node_events(node):
    import json

    events = []
    for line in node.read_log().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events


def veteran_suspended_for_newcomer(make_node, newcomer_iterations):
    """LAS with one threshold: `veteran` passes it, `newcomer` arrives and the veteran is suspended."""
    node = make_node("--scheduler", "las", "--las-thresholds", "0.3", "--starvation-factor", "0")
    veteran = node.spawn("veteran", iterations=60, hold_mib=64)
    assert wait_until(lambda: (veteran.queued() or {}).get("attained_gpu_s", 0) > 0.3, timeout=15)
    newcomer = node.spawn("newcomer", iterations=newcomer_iterations)
    assert wait_until(lambda: (veteran.registered() or {}).get("state") == "suspended", timeout=10), node.read_log()
    return node, veteran, newcomer


def test_las_suspends_a_job_past_its_threshold_for_a_newcomer_and_resumes_it_intact(make_node):
    # The veteran is suspended (its memory to the host), the newcomer runs and ends,
    # then the veteran comes back with its memory intact and finishes.
    node, veteran, newcomer = veteran_suspended_for_newcomer(make_node, 15)
    suspended = veteran.registered()
    assert suspended["device_bytes"] == 0 and suspended["host_bytes"] == 64 * MiB
    assert newcomer.finish()[0] == 0
    assert veteran.finish()[0] == 0
    assert veteran.resumes() >= 1 and not veteran.corrupt()
    order = [e["job"] for e in node_events(node) if e.get("event") == "queued job admitted"]
    assert order == ["veteran", "newcomer"]


def test_timeslicing_rotates_jobs_that_do_not_fit_none_starves_and_memory_survives_each_slice(make_node):
    node = make_node("--scheduler", "timeslice", "--quantum", "0.4")
    jobs = []
    for name in ("s1", "s2", "s3"):  # submitted in this order
        jobs.append(node.spawn(name, iterations=40, hold_mib=32))
        assert wait_until(lambda: jobs[-1].queued(), timeout=15)
    for job in jobs:
        assert job.finish(timeout=60)[0] == 0, node.read_log()
    for job in jobs:
        assert job.resumes() >= 1, job.name  # it was suspended and came back intact
        assert not job.corrupt(), job.name
    events = node_events(node)
    admitted = [e["job"] for e in events if e.get("event") == "queued job admitted"]
    assert admitted == ["s1", "s2", "s3"]
    assert sum(1 for e in events if e.get("event") == "queued job suspended") >= 3


def one_running_one_waiting(make_node):
    """A FIFO node on one GPU: `a` runs (until killed), `b` (5 iterations) waits behind it."""
    node = make_node("--scheduler", "fifo")
    a = node.spawn("a")
    assert wait_until(lambda: a.registered(), timeout=15)
    b = node.spawn("b", iterations=5)
    assert wait_until(lambda: (b.queued() or {}).get("state") == "waiting", timeout=15)
    return node, a, b


def test_a_restarted_coordinator_keeps_its_queue_a_waiting_job_waits_on_and_starts(make_node):
    node, a, b = one_running_one_waiting(make_node)
    ticket = b.queued()["ticket"]
    node.kill_coordinator()
    node.start_coordinator()
    assert wait_until(lambda: (b.queued() or {}).get("state") == "waiting", timeout=10), node.read_log()
    assert b.queued()["ticket"] == ticket and b.process.poll() is None  # its process waits on, same ticket
    assert (a.queued() or {}).get("state") == "running"
    a.kill()  # its GPU frees up: the restarted coordinator admits b
    assert b.finish()[0] == 0, node.read_log()


def test_a_waiting_job_whose_ticket_a_restarted_coordinator_lost_says_so_and_exits(make_node):
    from cotenant.coordinator import paths

    node, _, b = one_running_one_waiting(make_node)
    node.kill_coordinator()
    os.unlink(node.socket + paths.STATE_SUFFIX)  # its state is gone: the new coordinator knows no ticket
    node.start_coordinator()
    code, _, err = b.finish()
    assert code == 1 and "no longer knows ticket" in err and "submit the job again" in err, err
    assert b.registered() is None  # its program never started


def test_a_job_suspended_before_a_coordinator_restart_resumes_after_it(make_node):
    node, veteran, newcomer = veteran_suspended_for_newcomer(make_node, 60)
    node.kill_coordinator()
    node.start_coordinator()
    assert (veteran.queued() or {}).get("state") == "suspended", node.read_log()
    assert newcomer.finish()[0] == 0
    assert veteran.finish()[0] == 0, node.read_log()  # the new coordinator resumed it where it was
    assert veteran.resumes() >= 1 and not veteran.corrupt()


def test_a_job_suspended_on_a_gpu_a_restarted_coordinator_does_not_schedule_says_so_and_resumes_once_it_does(
        make_node):
    node, veteran, newcomer = veteran_suspended_for_newcomer(make_node, 60)
    node.kill_coordinator()
    node.args[node.args.index("--gpus") + 1] = "1"  # restarted without GPU 0, where the veteran is
    node.start_coordinator()
    assert wait_until(lambda: [e for e in node_events(node) if e.get("event") == "queued job cannot resume"],
                      timeout=10), node.read_log()
    [event] = [e for e in node_events(node) if e.get("event") == "queued job cannot resume"]  # said once
    assert event["job"] == "veteran" and event["missing_gpus"] == "0" and event["level"] == "warning"
    assert "GPU 0 in --gpus" in event["fix"] and str(veteran.process.pid) in event["fix"]
    row = veteran.queued()
    assert (row["state"], row["missing_gpus"]) == ("suspended", [0])
    assert "suspended (GPU 0 not here)" in run_status(node)
    assert newcomer.finish()[0] == 0  # it runs on, on GPU 0, though no longer in the plan
    assert not [e for e in node_events(node) if e.get("job") == "newcomer" and
                ("suspend" in e["event"] or e.get("command") == "suspend")]
    assert (veteran.queued() or {}).get("state") == "suspended"  # GPU 0 is free, but not this coordinator's
    node.kill_coordinator()
    node.args[node.args.index("--gpus") + 1] = "0"  # the fix the warning names
    node.start_coordinator()
    assert veteran.finish()[0] == 0, node.read_log()
    assert veteran.resumes() >= 1 and not veteran.corrupt()


def run_status(node):
    done = subprocess.run([sys.executable, "-m", "cotenant.cli", "status", "--socket", node.socket],
                          env=queue_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- the queue's state machine, without a daemon ---------------------------------------------


def test_the_queue_comes_back_from_its_state_with_the_jobs_whose_process_still_runs():
    queue = JobQueue(Fifo())
    for name, pid in (("a", 11), ("b", 12), ("gone", 13)):
        queue.submit(0.0, name, pid=pid, uid=1000, pid_start_ticks=100 + pid)
    queue.decide(1.0, [0], None)
    queue.jobs[1].status, queue.jobs[1].suspended_on, queue.jobs[1].gpus = "suspended", (0,), ()
    saved = queue.to_state()
    assert json_roundtrip(saved) == saved  # what the daemon writes is plain JSON

    back = JobQueue(Fifo())
    dropped = back.restore(json_roundtrip(saved), alive=lambda job: job.pid != 13)
    assert [job.name for job in dropped] == ["gone"]
    assert sorted(back.jobs) == [1, 2] and back.next_ticket == 4
    assert back.jobs[1].status == "suspended" and back.jobs[1].suspended_on == (0,)
    assert back.jobs[2].status == "waiting" and back.jobs[2].pid_start_ticks == 112
    assert back.shape() != queue.shape()  # "gone" is not there
    assert [(a.kind, a.job.name) for a in back.decide(2.0, [0], None)] == [(RESUME, "a")]  # where it was


def test_a_suspended_job_whose_gpu_the_node_does_not_schedule_waits_for_it_and_the_rest_runs():
    queue = JobQueue(Fifo())
    a = queue.submit(0.0, "a", pid=10, uid=0)
    queue.decide(0.0, [0, 1], None)
    a.status, a.suspended_on, a.gpus = "suspended", a.gpus, ()  # as a suspension leaves it
    b = queue.submit(1.0, "b", pid=11, uid=0)
    assert [(x.kind, x.job.name) for x in queue.decide(1.0, [1], None)] == [(ADMIT, "b")]  # GPU 0 gone
    assert queue.stranded == {a.ticket: (0,)} and b.gpus == (1,)
    rows = {r["name"]: r for r in queue.status()}
    assert rows["a"]["missing_gpus"] == [0] and rows["b"]["missing_gpus"] == []
    queue.remove(b.ticket)
    assert queue.decide(2.0, [1], None) == [] and a.status == "suspended"  # never on another GPU
    assert [(x.kind, x.job.name) for x in queue.decide(3.0, [0, 1], None)] == [(RESUME, "a")]
    assert queue.stranded == {} and a.gpus == (0,)
    assert queue.decide(4.0, [1], None) == [] and a.status == "running"  # runs on where the node no longer plans


def json_roundtrip(value):
    import json

    return json.loads(json.dumps(value))


def test_queue_admits_in_policy_order_and_reports_positions():
    queue = JobQueue(Fifo())
    a = queue.submit(0.0, "a", pid=10, uid=0)
    b = queue.submit(1.0, "b", pid=11, uid=0)
    actions = queue.decide(1.0, gpus=[3], gpu_memory_bytes=None)
    assert [(x.kind, x.job.name, x.job.gpus) for x in actions] == [(ADMIT, "a", (3,))]
    rows = {r["name"]: r for r in queue.status()}
    assert rows["b"]["position"] == 1 and rows["a"]["position"] is None
    queue.remove(a.ticket)
    assert [(x.kind, x.job.name) for x in queue.decide(2.0, [3], None)] == [(ADMIT, "b")]
    assert b.waited_s == pytest.approx(1.0)


def test_queue_suspends_holds_gpus_until_stopped_then_resumes():
    queue = JobQueue(DiscretizedLas(thresholds_gpu_s=(1.0,), starvation_factor=0))
    a = queue.submit(0.0, "a", pid=10, uid=0)
    queue.decide(0.0, [0], None)
    queue.advance(2.0)  # 2 GPU-s: past the threshold
    b = queue.submit(2.0, "b", pid=11, uid=0)
    assert [(x.kind, x.job.name) for x in queue.decide(2.0, [0], None)] == [(SUSPEND, "a")]
    assert queue.decide(2.1, [0], None) == []  # a still holds the GPU until it has stopped
    queue.stopped(a.ticket, 2.2)
    assert [(x.kind, x.job.name) for x in queue.decide(2.2, [0], None)] == [(ADMIT, "b")]
    queue.remove(b.ticket)
    assert [(x.kind, x.job.name) for x in queue.decide(3.0, [0], None)] == [(RESUME, "a")]
    assert a.attained_service == pytest.approx(2.2)  # it computes until it has stopped, at 2.2


def test_a_suspended_job_resumes_on_the_gpu_its_process_stays_on():
    # Two GPUs: a runs on GPU 1, is suspended for b, and GPU 0 frees up first. a's process
    # (and its CUDA context) is on GPU 1: it resumes only when GPU 1 is free, and there.
    queue = JobQueue(DiscretizedLas(thresholds_gpu_s=(1.0,), starvation_factor=0))
    filler = queue.submit(0.0, "filler", pid=9, uid=0)
    a = queue.submit(0.0, "a", pid=10, uid=0)
    queue.decide(0.0, [0, 1], None)
    assert filler.gpus == (0,) and a.gpus == (1,)
    queue.advance(2.0)  # both past the threshold; the newcomer preempts the later one
    b = queue.submit(2.0, "b", pid=11, uid=0)
    suspended = [x.job.name for x in queue.decide(2.0, [0, 1], None) if x.kind == SUSPEND]
    victim = a if suspended == ["a"] else filler
    held = victim.gpus
    queue.stopped(victim.ticket, 2.2)
    queue.decide(2.2, [0, 1], None)
    assert b.gpus == held
    other = filler if victim is a else a
    queue.remove(other.ticket)  # the victim's GPU is still b's: it waits
    assert [(x.kind, x.job.name) for x in queue.decide(3.0, [0, 1], None)] == []
    queue.remove(b.ticket)
    assert [(x.kind, x.job.name) for x in queue.decide(4.0, [0, 1], None)] == [(RESUME, victim.name)]
    assert victim.gpus == held



def test_a_queued_job_whose_pid_now_names_another_process_has_ended():
    # The kernel reuses pids: the queue names a process by its pid and start time, as the coordinator's
    # jobs are named, so a queued job whose process exited ends even when its pid runs something else.
    from cotenant.coordinator.daemon import process_start_ticks
    from cotenant.coordinator.queue_service import QueueService

    from types import SimpleNamespace

    coordinator = SimpleNamespace(jobs={}, config=SimpleNamespace(gpus=[0]), gpu_memory={},
                                  _device_total=lambda gpu: 16 << 30)  # what the queue reads of the daemon
    service = QueueService(coordinator, Fifo())
    me = os.getpid()
    same = service.queue.submit(0.0, "same", me, os.getuid(), "guaranteed", 1, 0, 0, process_start_ticks(me))
    reused = service.queue.submit(0.0, "reused", me, os.getuid(), "guaranteed", 1, 0, 0,
                                  process_start_ticks(me) + 1)  # started at another time: another process
    service.tick(1.0)
    assert same.ticket in service.queue.jobs
    assert reused.ticket not in service.queue.jobs
    assert service.outcomes[reused.ticket] == ("finished", "its process exited")


def test_a_suspended_report_left_from_an_earlier_suspend_does_not_free_the_gpus_before_the_job_applies_this_one():
    # A job suspended, resumed and suspended again may still report "suspended" from the first time
    # when the second suspend is sent (it has not applied the resume yet): its GPUs are free only once
    # it applied the suspend the queue sent, or the newcomer would share them with a running job.
    from types import SimpleNamespace

    from cotenant.coordinator.daemon import process_start_ticks
    from cotenant.coordinator.queue_service import QueueService

    me, parent = os.getpid(), os.getppid()
    sent = []

    def send_command(command):
        sent.append(command)
        return 7

    registered = SimpleNamespace(pid=me, share=1.0, report={"state": "suspended", "applied_command_sequence": 6},
                                 send_command=send_command)
    coordinator = SimpleNamespace(jobs={1: registered}, config=SimpleNamespace(gpus=[0]), gpu_memory={},
                                  _device_total=lambda gpu: 16 << 30)
    service = QueueService(coordinator, DiscretizedLas(thresholds_gpu_s=(1.0,), starvation_factor=0))
    a = service.queue.submit(0.0, "a", me, os.getuid(), "guaranteed", 1, 0, 0, process_start_ticks(me))
    service.decide(0.0)
    service.queue.advance(2.0)  # past the threshold
    b = service.queue.submit(2.0, "b", parent, os.getuid(), "guaranteed", 1, 0, 0, process_start_ticks(parent))
    service.decide(2.0)
    assert sent == [SUSPEND]  # carries sequence 7
    service.tick(2.1)  # "suspended", but from sequence 6
    assert b.gpus in (None, ()) and a.gpus == (0,)

    # The coordinator restarts before the job applies it: the new one waits for sequence 7 too.
    saved = json.loads(json.dumps(service.state()))  # as the state file holds it
    service = QueueService(coordinator, DiscretizedLas(thresholds_gpu_s=(1.0,), starvation_factor=0))
    service.restore(saved)
    a, b = service.queue.jobs[a.ticket], service.queue.jobs[b.ticket]
    service.tick(2.15)
    assert b.gpus in (None, ()) and a.gpus == (0,)
    registered.report["applied_command_sequence"] = 7
    service.tick(2.2)
    assert b.gpus == (0,)
