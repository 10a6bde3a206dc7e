"""The cluster scheduler on real Ray: a ray.cluster_utils.Cluster of three GPU nodes on this
machine (2 GPUs each, declared as Ray resources; two of type fast, one slow), each running its
own cotenant coordinator in its own socket directory, and simulated jobs as the workers (real
client, shared memory, CachingAllocator on the SimulatedBackend). One cluster for the module:
Ray's start-up is paid once. Select with `-m ray`."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from coordinator_harness import HERE, MiB, Node, child_env, wait_until
from elastic_train import read_log

ray = pytest.importorskip("ray", reason="the cluster tests need Ray: pip install 'cotenant[cluster]'")
pytest.importorskip("scipy", reason="the cluster tests need scipy: pip install 'cotenant[cluster]'")

from cotenant.cluster import runtime  # noqa: E402
from cotenant.cluster.allox import match  # noqa: E402
from cotenant.cluster.scheduler import JobSpec  # noqa: E402
from cotenant.scheduling.state import JobView  # noqa: E402

pytestmark = pytest.mark.ray

GPU_TYPES = ("fast", "fast", "slow")
TIMEOUT = 60
STRAY_GRACE_S = 2.0


class Cluster:
    def __init__(self, ray_cluster, nodes, coordinators, scheduler, directory, options):
        self.ray_cluster, self.nodes, self.coordinators = ray_cluster, nodes, coordinators
        self.scheduler, self.directory, self.options = scheduler, directory, options

    def status(self):
        return ray.get(self.scheduler.status.remote())

    def job(self, name):
        return next((j for j in reversed(self.status()["jobs"]) if j["name"] == name), None)

    def explain(self, *names):
        """For a failed wait: those jobs as the scheduler sees them, its last events, what each node's
        coordinator runs."""
        view = self.status()
        jobs = [j for j in view["jobs"] if j["name"] in names]
        workers = {n.node_id[:8]: sorted((j["name"], j["state"]) for j in c.status()["jobs"])
                   for n, c in zip(self.nodes, self.coordinators)}
        return f"jobs {jobs}\nevents {view['events'][-25:]}\nworkers {workers}"

    def node_of(self, node_id):
        return self.coordinators[[n.node_id for n in self.nodes].index(node_id)]

    def submit(self, *specs):
        return ray.get(self.scheduler.submit.remote(list(specs)))

    def worker(self, job, index):
        """The registered worker at its node's coordinator, or None."""
        state = self.job(job)
        if not state or index >= len(state["gpus"]):
            return None
        coordinator = self.node_of(state["gpus"][index][0])
        return coordinator.job(runtime.worker_name(job, index))

    def events(self, kind, job=None):
        return [e for e in ray.get(self.scheduler.history.remote())
                if e["event"] == kind and (job is None or e.get("job") == job)]

    def workers_running(self):
        return sum(len(c.status()["jobs"]) for c in self.coordinators)

    def stores(self, node_id):
        """The rendezvous stores a node's agent hosts, by rdzv id."""
        agent = ray.get_actor(runtime.agent_name(node_id), namespace=runtime.NAMESPACE)
        return ray.get(agent.report.remote())["rendezvous"]


def spec(name, **fields):
    control = os.path.join(fields.pop("control_dir"), "{name}") if "control_dir" in fields else ""
    env = child_env()
    env["COTENANT_DISABLE"] = "1"  # the start-up hook would look for a GPU; the simulated job registers itself
    command = (sys.executable, os.path.join(HERE, "simulated_job.py"), "--hold-mib", str(fields.pop("hold_mib", 32)),
               "--iteration-us", "20000", "--register-after-s", str(fields.pop("register_after_s", 0)),
               *(["--control", control] if control else []))
    return JobSpec(name=name, command=command, env=env, **fields)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster as RayCluster

    directory = tmp_path_factory.mktemp("cluster")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "COTENANT_DISABLE")}
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # Ray's workers import cotenant from this checkout
    os.environ["COTENANT_DISABLE"] = "1"  # workers submitted from the CLI: no GPU here for the start-up hook
    small = dict(num_cpus=1, object_store_memory=80 * MiB)
    ray_cluster = RayCluster(initialize_head=True, head_node_args=dict(num_gpus=0, include_dashboard=False, **small))
    nodes = [ray_cluster.add_node(num_gpus=2, labels={runtime.LABEL_GPU_TYPE: t, runtime.LABEL_GPU_MEMORY: "1GiB"},
                                  **small) for t in GPU_TYPES]
    coordinators = []
    try:
        ray.init(address=ray_cluster.address, namespace=runtime.NAMESPACE, log_to_driver=False,
                 logging_level="warning")
        ray_cluster.wait_for_nodes()
        for _ in nodes:
            coordinator = Node(gpu_memory="1GiB", extra_args=("--gpus", "0,1"))
            coordinator.start_coordinator()
            coordinators.append(coordinator)
        options = dict(policy="antman", node_sockets={n.node_id: c.socket for n, c in zip(nodes, coordinators)},
                       tick_s=0.2, agent_restart_s=3.0, stray_grace_s=STRAY_GRACE_S, log_dir=str(directory))
        scheduler = runtime.start_scheduler(ray, **options)
        c = Cluster(ray_cluster, nodes, coordinators, scheduler, str(directory), options)
        assert wait_until(lambda: sum(n["live"] for n in c.status()["nodes"]) == 3, timeout=TIMEOUT), c.status()
        yield c
    finally:
        ray.shutdown()
        ray_cluster.shutdown()
        for coordinator in coordinators:
            coordinator.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def clean(cluster):
    """Cancels every job a test left, and waits until no worker runs anywhere."""
    yield cluster
    for job in cluster.status()["jobs"]:
        if job["state"] not in ("finished", "failed"):
            ray.get(cluster.scheduler.cancel.remote(job["name"]))
    assert wait_until(lambda: cluster.workers_running() == 0, timeout=TIMEOUT)
    ray.get(cluster.scheduler.set_quota.remote("default", 6))


def test_gang_placement_is_all_or_nothing_and_prefers_one_node(clean):
    c = clean
    c.submit(spec("filler"))
    assert wait_until(lambda: c.worker("filler", 0), timeout=TIMEOUT), c.status()
    c.submit(spec("gang", min_gpus=6, max_gpus=6))
    # Five GPUs are free, it needs six: none of its workers starts anywhere, and Ray holds no
    # placement group for it.
    running = wait_until(lambda: c.workers_running() > 1, timeout=3)
    assert not running, json.dumps(c.status(), default=str)[:4000]
    assert c.job("gang")["state"] == "waiting"
    assert not any(g["name"].startswith("cotenant-gang") and g["state"] == "CREATED"
                   for g in ray.util.placement_group_table().values())
    ray.get(c.scheduler.cancel.remote("filler"))
    assert wait_until(lambda: all(c.worker("gang", i) for i in range(6)), timeout=TIMEOUT), c.status()
    assert len({tuple(g) for g in c.job("gang")["gpus"]}) == 6
    assert len(c.events("job started", "gang")) == 1  # one start, for all six
    ray.get(c.scheduler.cancel.remote("gang"))
    assert wait_until(lambda: c.workers_running() == 0, timeout=TIMEOUT)
    c.submit(spec("pair", min_gpus=2, max_gpus=2, gpu_type="fast"))
    assert wait_until(lambda: c.worker("pair", 1), timeout=TIMEOUT)
    assert len({node for node, _ in c.job("pair")["gpus"]}) == 1  # both on one node


def test_a_gang_ray_cannot_grant_yet_leaves_the_scheduler_answering_and_starts_once_ray_can(clean):
    # Another Ray user holds every GPU: the scheduler's nodes report them free, it places a
    # guaranteed job, and Ray cannot grant its gang. The tick used to wait for the grant (the gang
    # timeout, 10 s here) under the lock every request takes: status hung that long, every tick.
    from ray.util.placement_group import placement_group, remove_placement_group

    c = clean
    hold = placement_group([{"GPU": 2.0}] * len(c.nodes), strategy="STRICT_SPREAD")
    assert hold.wait(timeout_seconds=TIMEOUT)
    try:
        c.submit(spec("held"))
        assert wait_until(lambda: c.events("gang waiting", "held"), timeout=TIMEOUT), c.explain("held")
        slowest = 0.0
        for _ in range(10):
            asked = time.monotonic()
            assert c.job("held")["state"] == "running"  # placed; its worker starts once Ray grants the gang
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.2)
        assert slowest < 1.0, f"status took {slowest:.1f} s while the gang waited"
        assert c.worker("held", 0) is None and not c.events("job started", "held")
    finally:
        remove_placement_group(hold)
    assert wait_until(lambda: c.worker("held", 0), timeout=TIMEOUT), c.explain("held")
    assert len(c.events("job started", "held")) == 1 and not c.events("gang not granted", "held")


def test_a_tenant_over_quota_runs_opportunistic_is_evicted_for_a_guaranteed_job_and_upgraded_later(clean):
    c = clean
    ray.get(c.scheduler.set_quota.remote("alice", 1))
    ray.get(c.scheduler.set_quota.remote("bob", 6))
    heavy = 600 * MiB  # two such jobs do not fit on one 1 GiB GPU
    c.submit(spec("a1", tenant="alice", persistent_bytes=heavy))
    assert wait_until(lambda: c.worker("a1", 0), timeout=TIMEOUT)
    c.submit(spec("a2", tenant="alice", persistent_bytes=heavy, control_dir=c.directory))
    assert wait_until(lambda: c.worker("a2", 0), timeout=TIMEOUT)
    assert c.job("a1")["role"] == "guaranteed"
    assert c.job("a2")["role"] == "opportunistic" and c.worker("a2", 0)["role"] == "opportunistic"

    c.submit(spec("b", tenant="bob", min_gpus=5, max_gpus=5, persistent_bytes=heavy))
    assert wait_until(lambda: (c.job("a2") or {}).get("state") == "suspended", timeout=TIMEOUT), c.status()
    suspended = c.worker("a2", 0) or c.node_of(c.job("a2")["node"]).job("a2-w0")
    assert suspended["state"] == "suspended" and suspended["device_bytes"] == 0  # its memory is on the host
    assert wait_until(lambda: c.worker("b", 4), timeout=TIMEOUT), c.status()

    ray.get(c.scheduler.cancel.remote("b"))  # a2 comes back where its memory is, intact
    assert wait_until(lambda: (c.worker("a2", 0) or {}).get("state") == "running", timeout=TIMEOUT), c.status()
    assert wait_until(lambda: os.path.exists(os.path.join(c.directory, "a2-w0.resumes")), timeout=TIMEOUT)
    assert not os.path.exists(os.path.join(c.directory, "a2-w0.corrupt"))

    ray.get(c.scheduler.cancel.remote("a1"))  # alice's quota frees up: a2 becomes guaranteed where it runs
    assert wait_until(lambda: c.job("a2")["role"] == "guaranteed", timeout=TIMEOUT), c.status()
    assert wait_until(lambda: (c.worker("a2", 0) or {}).get("share_pinned"), timeout=TIMEOUT)
    assert c.events("job upgraded", "a2")


def test_a_suspended_job_whose_worker_died_fails_and_a_cancelled_one_stops_its_worker(clean):
    c = clean
    ray.get(c.scheduler.set_quota.remote("alice", 0))
    ray.get(c.scheduler.set_quota.remote("bob", 6))
    heavy = 600 * MiB
    c.submit(spec("s1", tenant="alice", persistent_bytes=heavy), spec("s2", tenant="alice", persistent_bytes=heavy))
    assert wait_until(lambda: c.worker("s1", 0) and c.worker("s2", 0), timeout=TIMEOUT), c.status()
    c.submit(spec("b", tenant="bob", min_gpus=6, max_gpus=6, persistent_bytes=heavy))
    assert wait_until(lambda: all((c.job(n) or {}).get("state") == "suspended" for n in ("s1", "s2")),
                      timeout=TIMEOUT), c.status()

    def registered(name):
        return c.node_of(c.job(name)["node"]).job(f"{name}-w0")

    os.kill(registered("s1")["pid"], signal.SIGKILL)  # dies while suspended: nothing is left to resume
    assert wait_until(lambda: c.job("s1")["state"] == "failed", timeout=TIMEOUT), c.status()
    assert "exited while it was suspended" in c.job("s1")["reason"]

    node = c.node_of(c.job("s2")["node"])
    ray.get(c.scheduler.cancel.remote("s2"))  # its worker process goes too, not only the job's entry
    assert wait_until(lambda: node.job("s2-w0") is None, timeout=TIMEOUT), node.status()
    assert c.job("s2")["state"] == "finished" and c.job("s2")["reason"] == "cancelled"


def test_a_worker_evicted_before_it_registered_is_suspended_once_it_has(clean):
    c = clean
    heavy = 600 * MiB
    c.submit(spec("slow", role="opportunistic", min_gpus=6, max_gpus=6, persistent_bytes=heavy,
                  register_after_s=4))
    assert wait_until(lambda: (c.job("slow") or {}).get("state") == "running", timeout=TIMEOUT), c.status()
    assert c.worker("slow", 0) is None  # its processes are still starting
    c.submit(spec("urgent", min_gpus=6, max_gpus=6, persistent_bytes=heavy))  # its memory does not fit beside
    assert wait_until(lambda: c.events("job evicting", "slow"), timeout=TIMEOUT), c.explain("slow", "urgent")
    # The suspend reached workers that had not registered: each agent delivers it once they have.
    assert wait_until(lambda: c.job("slow")["state"] == "suspended", timeout=TIMEOUT), c.explain("slow", "urgent")
    assert wait_until(lambda: c.worker("urgent", 5), timeout=TIMEOUT), c.explain("slow", "urgent")
    states = [j["state"] for node in c.coordinators for j in node.status()["jobs"] if j["name"].startswith("slow-w")]
    assert states == ["suspended"] * 6


def test_heterogeneous_placement_follows_the_matching(clean):
    c = clean
    speeds = {"insensitive": {"fast": 1.0, "slow": 1.0}, "sensitive": {"fast": 1.0, "slow": 0.2}}
    names = ["insensitive", "insensitive2", "sensitive", "sensitive2"]
    c.submit(*[spec(n, speeds=speeds[n.rstrip("2")]) for n in names])  # matched together
    assert wait_until(lambda: all(c.worker(n, 0) for n in names), timeout=TIMEOUT), c.status()
    types = {n["node"]: n["gpus"][0]["gpu_type"] for n in c.status()["nodes"]}
    placed = {n: types[c.job(n)["gpus"][0][0]] for n in names}
    views = [JobView(i, speeds=speeds[n.rstrip("2")]) for i, n in enumerate(names)]
    expected = match(views, {"fast": 4, "slow": 2})
    assert placed == {n: expected[i] for i, n in enumerate(names)}
    assert set(placed.values()) == {"fast", "slow"}
    assert placed["sensitive"] == placed["sensitive2"] == "fast"


def test_an_elastic_job_scales_out_and_back_in_without_losing_its_state(clean):
    c = clean
    c.submit(spec("elastic", min_gpus=1, max_gpus=3, control_dir=c.directory))
    assert wait_until(lambda: c.worker("elastic", 0), timeout=TIMEOUT)
    first = c.worker("elastic", 0)
    assert wait_until(lambda: c.job("elastic")["workers"] == 3 and c.worker("elastic", 2), timeout=TIMEOUT), \
        c.status()
    iterations = c.worker("elastic", 0)["iteration_count"]

    c.submit(spec("needy", min_gpus=5, max_gpus=5))
    assert wait_until(lambda: c.job("elastic")["workers"] == 1, timeout=TIMEOUT), c.explain("elastic", "needy")
    assert wait_until(lambda: c.worker("needy", 4), timeout=TIMEOUT), c.explain("elastic", "needy")
    assert len(c.events("worker left", "elastic")) == 2
    # The first worker was never stopped: the same process and registration, its iterations
    # went on counting, its memory untouched.
    now = c.worker("elastic", 0)
    assert (now["pid"], now["job_id"]) == (first["pid"], first["job_id"])
    assert now["state"] == "running" and now["iteration_count"] > iterations
    assert not os.path.exists(os.path.join(c.directory, "elastic-w0.corrupt"))


def latest_world(path):
    rows = read_log(path)
    return rows[-1]["world"] if rows else None


def test_a_torchrun_job_re_forms_its_world_as_it_scales_out_and_in_and_resumes_from_its_checkpoint(clean):
    c = clean
    log, checkpoint = os.path.join(c.directory, "trainer.jsonl"), os.path.join(c.directory, "trainer.pt")
    c.submit(spec("holder", min_gpus=5, max_gpus=5))
    assert wait_until(lambda: c.worker("holder", 4), timeout=TIMEOUT), c.status()
    env = {**child_env(), "COTENANT_DISABLE": "1"}  # the script registers itself, as the hook would
    c.submit(JobSpec("trainer", (sys.executable, os.path.join(HERE, "elastic_train.py"), checkpoint, log),
                     min_gpus=1, max_gpus=3, launcher="torchrun", env=env))
    assert wait_until(lambda: len(read_log(log)) >= 3, timeout=TIMEOUT, interval=0.2), c.status()

    ray.get(c.scheduler.cancel.remote("holder"))  # idle GPUs: two more agents join the running rendezvous
    assert wait_until(lambda: latest_world(log) == 3, timeout=TIMEOUT, interval=0.2), \
        (c.status(), read_log(log)[-3:])
    assert c.job("trainer")["workers"] == 3
    assert wait_until(lambda: all(c.worker("trainer", i) for i in range(3)), timeout=TIMEOUT), c.status()
    grown = len(read_log(log))

    c.submit(spec("needy", min_gpus=5, max_gpus=5))  # guaranteed: the trainer gives back two GPUs
    assert wait_until(lambda: c.worker("needy", 4), timeout=TIMEOUT), c.status()
    assert c.job("trainer")["workers"] == 1
    assert wait_until(lambda: latest_world(log) == 1 and len(read_log(log)) > grown + 5, timeout=TIMEOUT,
                      interval=0.2), (c.status(), read_log(log)[-3:])

    rows = read_log(log)
    worlds = [r["world"] for r in rows]
    assert worlds[0] == 1 and worlds[-1] == 1 and 3 in worlds
    # Every process (torchrun started one per worker in each round) resumed from the latest
    # checkpoint: no step rank 0 had finished (and saved, before logging it) by then was lost.
    for pid in dict.fromkeys(r["pid"] for r in rows):
        first = next(r for r in rows if r["pid"] == pid)
        saved = max([0] + [r["step"] for r in rows if r["rank"] == 0 and r["t"] < first["loaded_at"]])
        assert first["resumed"] >= saved, (first, saved)
    assert len({r["pid"] for r in rows}) >= 1 + 3 + 1 and rows[-1]["resumed"] > 0
    # Each restarted process registered again under its worker's name, never a stand-in.
    assert {r["registered"] for r in rows} <= {"trainer-w0", "trainer-w1", "trainer-w2"}
    latest = c.worker("trainer", 0)
    assert latest["pid"] == rows[-1]["pid"]  # the process training now is the one registered
    # Never failed, never killed, never evicted: resized only.
    state = c.job("trainer")
    assert state["state"] == "running" and state["evictions"] == 0
    assert not c.events("job ended", "trainer")
    assert len(c.events("worker left", "trainer")) == 2
    # Its rendezvous store lived on worker 0's node agent through every round, and goes with the job.
    host = state["gpus"][0][0]
    assert c.stores(host) == [f"trainer-{state['job_id']}"]
    ray.get(c.scheduler.cancel.remote("trainer"))
    assert wait_until(lambda: c.stores(host) == [], timeout=TIMEOUT), c.stores(host)


def test_a_killed_node_agent_leaves_the_rest_served_and_its_node_rejoins(clean):
    c = clean
    victim = c.nodes[2].node_id
    c.submit(spec("survivor", gpu_type="slow"))  # on the victim's node
    assert wait_until(lambda: c.worker("survivor", 0), timeout=TIMEOUT), c.explain("survivor")
    survivor = c.worker("survivor", 0)["pid"]
    agent = ray.get_actor(runtime.agent_name(victim), namespace=runtime.NAMESPACE)
    os.kill(ray.get(agent.pid.remote()), signal.SIGKILL)
    assert wait_until(lambda: not next(n for n in c.status()["nodes"] if n["node"] == victim)["live"],
                      timeout=TIMEOUT), c.status()
    c.submit(spec("meanwhile", min_gpus=4, max_gpus=4))
    assert wait_until(lambda: c.worker("meanwhile", 3), timeout=TIMEOUT), c.status()
    assert victim not in {node for node, _ in c.job("meanwhile")["gpus"]}
    assert wait_until(lambda: next(n for n in c.status()["nodes"] if n["node"] == victim)["live"],
                      timeout=TIMEOUT), c.status()
    assert len(c.events("node joined")) >= 4  # three at start, the victim again
    # The new agent took over the worker the dead one started: it follows it and stops it.
    agent = ray.get_actor(runtime.agent_name(victim), namespace=runtime.NAMESPACE)
    report = ray.get(agent.report.remote())["workers"]["survivor-w0"]
    assert (report["pid"], report.get("own"), c.job("survivor")["state"]) == (survivor, True, "running")
    ray.get(c.scheduler.cancel.remote("survivor"))
    assert wait_until(lambda: not os.path.exists(f"/proc/{survivor}"), timeout=TIMEOUT), c.explain("survivor")
    c.submit(spec("after", min_gpus=2, max_gpus=2))
    assert wait_until(lambda: c.worker("after", 1), timeout=TIMEOUT), c.status()
    assert {node for node, _ in c.job("after")["gpus"]} == {victim}  # the only free GPUs are the rejoined node's


def run_cli(c, verb, *args):
    """`cotenant cluster VERB ARGS` against the test cluster, from another process."""
    return subprocess.run([sys.executable, "-m", "cotenant.cli", "cluster", verb, "--address", c.ray_cluster.address,
                           *args], env=child_env(), capture_output=True, text=True, timeout=120)


def answers(c):
    """The scheduler's status, or None while it is down or restarting."""
    try:
        return ray.get(c.scheduler.status.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def group_state(name):
    """The state of the placement group of that name (CREATED, REMOVED, ...), or None."""
    from ray.util import placement_group_table

    states = [g["state"] for g in placement_group_table().values() if g["name"] == name]
    return "CREATED" if "CREATED" in states else (states[-1] if states else None)


def test_a_killed_scheduler_comes_back_with_its_jobs_their_gangs_and_their_workers(clean):
    c = clean
    c.submit(spec("kept", min_gpus=2, max_gpus=2, gpu_type="fast"), spec("dies", gpu_type="slow"))
    assert wait_until(lambda: c.worker("kept", 1) and c.worker("dies", 0), timeout=TIMEOUT), c.status()
    c.submit(spec("later", min_gpus=6, max_gpus=6))  # waits: kept and dies hold 3 of the 6 GPUs
    before = {j["name"]: j for j in c.status()["jobs"]}
    group = f"cotenant-kept-{before['kept']['job_id']}"
    assert group_state(group) == "CREATED" and before["later"]["state"] == "waiting"
    old_pid = ray.get(c.scheduler.pid.remote())
    os.kill(old_pid, signal.SIGKILL)
    os.kill(c.coordinators[2].job("dies-w0")["pid"], signal.SIGKILL)  # exits while no scheduler follows it
    assert wait_until(lambda: answers(c) and c.events("scheduler restored"), timeout=TIMEOUT), "not restarted"
    assert ray.get(c.scheduler.pid.remote()) != old_pid  # Ray started it again
    after = {j["name"]: j for j in c.status()["jobs"]}
    for name in ("kept", "later"):
        assert (after[name]["job_id"], after[name]["state"], after[name]["gpus"]) == \
            (before[name]["job_id"], before[name]["state"], before[name]["gpus"])
    assert c.events("job submitted", "kept")  # the events from before the restart are kept too
    assert wait_until(lambda: c.job("dies")["state"] == "failed", timeout=TIMEOUT), c.status()
    assert c.worker("kept", 0) and c.worker("kept", 1) and group_state(group) == "CREATED"  # untouched
    ray.get(c.scheduler.cancel.remote("kept"))  # the group the new scheduler found is released
    assert wait_until(lambda: c.worker("later", 5), timeout=TIMEOUT), c.status()  # needs every GPU, kept's too
    assert group_state(group) != "CREATED"
    assert c.submit(spec("newer"))[0]["job_id"] > max(j["job_id"] for j in before.values())


def test_an_agent_told_to_start_a_worker_it_runs_stops_the_old_process_first(clean):
    # As a scheduler that died between starting a job's workers and saving does when it starts them again.
    c = clean
    job = spec("twice")
    c.submit(job)
    assert wait_until(lambda: c.worker("twice", 0), timeout=TIMEOUT), c.explain("twice")
    first = c.worker("twice", 0)["pid"]
    node, gpu = c.job("twice")["gpus"][0]
    agent = ray.get_actor(runtime.agent_name(node), namespace=runtime.NAMESPACE)
    second = ray.get(agent.start.remote("twice-w0", list(job.command), gpu, "guaranteed", dict(job.env)))
    assert second != first
    assert wait_until(lambda: not os.path.exists(f"/proc/{first}"), timeout=TIMEOUT)  # stopped and reaped
    assert wait_until(lambda: (c.worker("twice", 0) or {}).get("pid") == second, timeout=TIMEOUT), c.explain("twice")
    assert c.job("twice")["state"] == "running"  # the old process's end is not the job's


def test_a_worker_no_job_has_on_its_node_is_stopped_and_the_coordinators_own_jobs_are_not(clean):
    # As a scheduler leaves a worker it started and died before saving, or a stop its agent missed.
    c = clean
    node = c.nodes[1].node_id
    local = c.coordinators[1].start_job("opportunistic", "local", hold_mib=16)  # not the cluster's: kept
    try:
        agent = ray.get_actor(runtime.agent_name(node), namespace=runtime.NAMESPACE)
        job = spec("stray")
        since = time.monotonic()
        started = ray.get(agent.start.remote("stray-w0", list(job.command), 1, "opportunistic", dict(job.env)))
        assert wait_until(lambda: not os.path.exists(f"/proc/{started}"), timeout=TIMEOUT), c.explain()
        assert time.monotonic() - since >= STRAY_GRACE_S  # not at the first report that showed it
        stopped = [e for e in c.events("stray worker stopped") if e["worker"] == "stray-w0"]
        assert [(e["node"], e["pid"]) for e in stopped] == [(node, started)]
        assert local.alive() and c.coordinators[1].job("local")
        assert not [e for e in c.events("stray worker stopped") if e["worker"] == "local"]
    finally:
        local.kill()


def test_cli_cancels_a_job_and_down_stops_every_job_the_agents_and_the_scheduler(clean):
    c = clean
    c.submit(spec("one"), spec("two", min_gpus=2, max_gpus=2), spec("three"))
    assert wait_until(lambda: c.worker("one", 0) and c.worker("two", 1) and c.worker("three", 0),
                      timeout=TIMEOUT), c.status()
    done = run_cli(c, "cancel", "one")
    assert done.returncode == 0 and "one: cancelled" in done.stdout, done.stderr
    assert wait_until(lambda: c.worker("one", 0) is None and c.job("one")["state"] == "finished", timeout=TIMEOUT)
    unknown = run_cli(c, "cancel", "nosuchjob")
    assert unknown.returncode == 2 and "no cluster job named 'nosuchjob'" in unknown.stderr
    assert "Traceback" not in unknown.stderr

    group = f"cotenant-two-{c.job('two')['job_id']}"
    down = run_cli(c, "down")
    assert down.returncode == 0, down.stderr
    assert "jobs cancelled: two, three" in down.stdout and "3 node agent(s)" in down.stdout
    assert c.workers_running() == 0 and group_state(group) != "CREATED"
    for name in [runtime.SCHEDULER_NAME] + [runtime.agent_name(n.node_id) for n in c.nodes]:
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=runtime.NAMESPACE)
    gone = run_cli(c, "status")
    assert gone.returncode == 1 and "start one with `cotenant cluster up`" in gone.stderr

    # A new scheduler starts afresh (the saved state went with `down`), and the module's tests go on with it.
    c.scheduler = runtime.start_scheduler(ray, **c.options)
    assert wait_until(lambda: sum(n["live"] for n in c.status()["nodes"]) == 3, timeout=TIMEOUT), c.status()
    assert c.status()["jobs"] == [] and not c.events("scheduler restored")


def test_cli_submits_a_job_and_status_shows_it_on_the_nodes_gpus(clean):
    c = clean
    ray.get(c.scheduler.set_quota.remote("cli", 2))  # a tenant without a quota runs opportunistic
    done = run_cli(c, "submit", "--tenant", "cli", "--gpus", "2", "--gpu-type", "fast", "--guaranteed", "--name",
                   "viacli", "--", sys.executable, os.path.join(HERE, "simulated_job.py"), "--hold-mib", "16")
    assert done.returncode == 0 and "viacli: submitted as job" in done.stdout, done.stderr
    assert wait_until(lambda: c.worker("viacli", 1), timeout=TIMEOUT), c.status()
    shown = run_cli(c, "status")
    assert shown.returncode == 0, shown.stderr
    row = next(line.split() for line in shown.stdout.splitlines() if line.startswith("viacli "))
    assert row[:4] == ["viacli", "cli", "running", "guaranteed"], shown.stdout
    assert shown.stdout.count("slow") == 2 and shown.stdout.count("fast") == 4  # every GPU, with its type
    logs = run_cli(c, "logs", "viacli", "--tail", "4KiB")
    assert logs.returncode == 0, logs.stderr
    for i in (0, 1):  # each worker's stdout, from its node
        header = f"==> viacli-w{i} (node {c.job('viacli')['gpus'][i][0][:12]}) <=="
        assert header in logs.stdout and '"registration"' in logs.stdout.split(header)[1], logs.stdout
    missing = run_cli(c, "logs", "nosuchjob")
    assert missing.returncode == 2 and "no cluster job named 'nosuchjob'" in missing.stderr
    refused = run_cli(c, "submit", "--gpus", "0", "--guaranteed", "--", "true")
    assert refused.returncode == 2 and "--gpus takes a count" in refused.stderr and "Traceback" not in refused.stderr
