"""The cluster scheduler's decisions without Ray: gang placement with topology, tenant quotas,
eviction and upgrade, AlloX's matching across GPU types, Amoeba's resizing, and the cluster
simulation, all on the node's own policy code."""

import os
import sys
import time
import types

import pytest

from cotenant.cluster.allox import TypeMatching, match
from cotenant.cluster.scheduler import (
    FAILED, GROW, RESUME, SHRINK, START, STOP, SUSPEND, UPGRADE, Action, ClusterScheduler, Gpu, JobSpec,
)
from cotenant.cluster.topology import ClusterShape, read_cluster, relative_speed
from cotenant.scheduling.policies import Fifo, Packing, make_policy
from cotenant.scheduling.simulator import SimulationConfig, simulate
from cotenant.scheduling.state import (
    GUARANTEED, OPPORTUNISTIC, RUNNING, STOPPING, SUSPENDED, WAITING, GpuView, JobView, NodeState,
)
from cotenant.scheduling.trace import TraceJob, read_trace

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

GiB = 1 << 30
CMD = ("true",)


def cluster(policy=None, quotas=None, nodes=(("a", 2, "fast"), ("b", 2, "fast"), ("c", 2, "slow"))):
    scheduler = ClusterScheduler(policy or TypeMatching(Packing()), quotas)
    for node, count, gpu_type in nodes:
        scheduler.node_reported(node, [Gpu(node, i, f"{node}{i}", gpu_type, GiB) for i in range(count)])
    return scheduler


def kinds(actions):
    return [(a.kind, a.job.name) for a in actions]


def test_gang_job_waits_whole_until_all_its_gpus_are_free_then_starts_all_at_once():
    s = cluster()
    s.submit(JobSpec("small", CMD, min_gpus=1, max_gpus=1), 0.0)
    first = s.decide(0.0)
    assert kinds(first) == [(START, "small")]
    wide = s.submit(JobSpec("wide", CMD, min_gpus=6, max_gpus=6), 1.0)
    assert [a for a in s.decide(1.0) if a.job is wide] == []  # 5 free of 6: nothing of it starts
    assert wide.status == WAITING and wide.gpus == ()
    s.ended(s.find("small"), 2.0)
    started = s.decide(2.0)
    assert kinds(started) == [(START, "wide")] and len(started[0].gpus) == 6


def test_a_gang_job_that_fits_on_one_node_gets_one_node_the_fullest_that_fits():
    s = cluster(policy=Packing())
    s.submit(JobSpec("one", CMD), 0.0)
    s.decide(0.0)  # node a now has one GPU free
    s.submit(JobSpec("pair", CMD, min_gpus=2, max_gpus=2), 1.0)
    action = s.decide(1.0)[0]
    assert {node for node, _ in action.gpus} == {"b"}  # not a's last GPU plus one of b
    s.submit(JobSpec("three", CMD, min_gpus=3, max_gpus=3), 2.0)
    spread = s.decide(2.0)[0]
    assert len({node for node, _ in spread.gpus}) == 2  # no node has 3: as few nodes as it can


def test_a_tenant_over_quota_runs_opportunistic_and_is_upgraded_when_its_quota_frees():
    s = cluster(quotas={"alice": 2, "bob": 4})
    s.submit(JobSpec("a1", CMD, tenant="alice", min_gpus=2, max_gpus=2, peak_bytes=GiB // 2), 0.0)
    s.submit(JobSpec("a2", CMD, tenant="alice", peak_bytes=GiB // 2), 0.0)
    s.decide(0.0)
    a1, a2 = s.find("a1"), s.find("a2")
    assert (a1.role, a2.role) == (GUARANTEED, OPPORTUNISTIC)
    s.ended(a1, 5.0)
    assert kinds(s.decide(5.0)) == [(UPGRADE, "a2")]
    assert a2.role == GUARANTEED and a2.status == RUNNING


def test_a_guaranteed_job_evicts_an_opportunistic_one_whose_memory_does_not_fit_beside_it():
    s = cluster(quotas={"alice": 0, "bob": 6})
    s.submit(JobSpec("opp", CMD, tenant="alice", persistent_bytes=GiB * 3 // 4), 0.0)
    s.decide(0.0)
    opp = s.find("opp")
    assert opp.role == OPPORTUNISTIC
    s.submit(JobSpec("big", CMD, tenant="bob", min_gpus=6, max_gpus=6, persistent_bytes=GiB * 3 // 4), 1.0)
    assert kinds(s.decide(1.0)) == [(SUSPEND, "opp")]
    assert opp.status == STOPPING and s.find("big").status == WAITING
    s.stopped(opp, 2.0)
    assert opp.status == SUSPENDED and opp.node == "a"
    assert kinds(s.decide(2.0)) == [(START, "big")]
    s.ended(s.find("big"), 3.0)
    resumed = s.decide(3.0)
    assert kinds(resumed) == [(RESUME, "opp")] and resumed[0].gpus[0][0] == "a"  # where its memory is


def test_a_suspended_job_whose_gpu_left_its_node_fails_and_its_workers_are_stopped():
    s = cluster(quotas={"alice": 0, "bob": 6})
    s.submit(JobSpec("opp", CMD, tenant="alice", persistent_bytes=GiB * 3 // 4), 0.0)
    s.submit(JobSpec("other", CMD, tenant="alice"), 0.0)
    s.decide(0.0)
    opp = s.find("opp")
    s.submit(JobSpec("big", CMD, tenant="bob", min_gpus=6, max_gpus=6, persistent_bytes=GiB * 3 // 4), 1.0)
    assert (SUSPEND, "opp") in kinds(s.decide(1.0))
    s.stopped(opp, 2.0)
    s.stopped(s.find("other"), 2.0)
    (node, index), = opp.suspended_on
    # Its node reports again without that GPU (it fell off the bus): the job cannot resume anywhere.
    s.node_reported(node, [g for g in s.nodes[node] if g.index != index])
    actions = s.decide(3.0)
    assert (STOP, "opp") in kinds(actions)
    assert next(a for a in actions if a.job is opp).gpus == ((node, index),)  # where its workers are
    assert opp.status == FAILED and f"GPU {index} of node {node} is no longer there" in opp.reason
    assert s.find("other").status != FAILED  # a suspended job whose GPUs are all there waits on
    assert STOP not in [a.kind for a in s.decide(4.0)]  # once


def test_allox_matching_gives_the_fast_gpu_to_the_job_that_gains_most_from_it():
    jobs = [JobView(1, speeds={"fast": 1.0, "slow": 0.9}, remaining_s=100),
            JobView(2, speeds={"fast": 1.0, "slow": 0.2}, remaining_s=100)]
    assert match(jobs, {"fast": 1, "slow": 1}) == {1: "slow", 2: "fast"}
    s = cluster(nodes=(("a", 1, "fast"), ("c", 1, "slow")))
    for name, slow in (("insensitive", 0.9), ("sensitive", 0.2)):
        s.submit(JobSpec(name, CMD, speeds={"fast": 1.0, "slow": slow}), 0.0)
    placed = {a.job.name: a.gpus[0][0] for a in s.decide(0.0)}
    assert placed == {"insensitive": "c", "sensitive": "a"}


def test_matching_puts_short_jobs_first_and_respects_a_type_the_user_asked_for():
    jobs = [JobView(1, remaining_s=10, gpu_type="slow"), JobView(2, remaining_s=10), JobView(3, remaining_s=1000)]
    types = match(jobs, {"fast": 1, "slow": 1})
    assert types[1] == "slow"
    assert types == {1: "slow", 2: "fast", 3: "fast"} or types == {1: "slow", 2: "fast", 3: "slow"}


def test_matching_leaves_a_suspended_job_the_type_of_the_gpus_its_memory_waits_on():
    # Suspended on the slow GPU 1, the job resumes there even though matching alone would give it
    # the free fast GPU 0, where it cannot go.
    state = NodeState(0.0, 2, None, (JobView(1, status=SUSPENDED, bound_gpus=(1,), speeds={"fast": 1.0, "slow": 0.5},
                                             remaining_s=100, submit_time=0.0),),
                      gpus=(GpuView("a", "fast"), GpuView("c", "slow")))
    assert match([state.jobs[0]], {"fast": 1, "slow": 1}) == {1: "fast"}
    assert TypeMatching(Fifo()).plan(state).placements[1].gpus == (1,)


def test_an_elastic_job_grows_into_idle_gpus_and_shrinks_for_a_waiting_job_keeping_its_first_worker():
    s = cluster(policy=Packing())
    s.submit(JobSpec("elastic", CMD, min_gpus=1, max_gpus=4), 0.0)
    assert kinds(s.decide(0.0)) == [(START, "elastic")]
    grown = s.decide(1.0)
    assert kinds(grown) == [(GROW, "elastic")]
    job = s.find("elastic")
    first = job.gpus[0]
    assert len(job.gpus) == 4 and {n for n, _ in job.gpus[:2]} == {first[0]}  # its own node first
    s.submit(JobSpec("wide", CMD, min_gpus=4, max_gpus=4), 2.0)
    shrunk = s.decide(2.0)
    assert kinds(shrunk) == [(SHRINK, "elastic")] and len(shrunk[0].gpus) == 2
    assert job.gpus[0] == first and len(job.gpus) == 2
    assert s.decide(2.5) == []  # the leaving workers still hold their GPUs
    s.workers_left(job, shrunk[0].gpus)
    assert kinds(s.decide(3.0)) == [(START, "wide")]


def test_the_workers_a_node_should_run_are_the_running_leaving_and_suspended_ones_of_unfinished_jobs():
    # What the runtime compares with its agents' reports to find strays.
    def by_node(name, gpus):
        found = {}
        for i, (node, _) in enumerate(gpus):
            found.setdefault(node, set()).add(f"{name}-w{i}")
        return found

    s = cluster(policy=Packing())
    s.submit(JobSpec("elastic", CMD, min_gpus=1, max_gpus=4), 0.0)
    s.decide(0.0)
    s.decide(1.0)
    job = s.find("elastic")
    assert len(job.gpus) == 4 and s.expected_workers() == by_node("elastic", job.gpus)
    s.submit(JobSpec("wide", CMD, min_gpus=4, max_gpus=4), 2.0)
    shrunk = s.decide(2.0)
    assert kinds(shrunk) == [(SHRINK, "elastic")]
    assert s.expected_workers() == by_node("elastic", job.gpus + job.stopping)  # leaving ones until they left
    s.workers_left(job, shrunk[0].gpus)
    assert s.expected_workers() == by_node("elastic", job.gpus)  # w2 and w3 are strays from now on
    assert s.find("wide").status == WAITING  # placed nowhere yet: no worker of it anywhere
    s.ended(job, 3.0)
    assert s.expected_workers() == {}  # nothing of an ended job runs
    s.decide(3.0)
    assert s.expected_workers() == by_node("wide", s.find("wide").gpus)

    s = cluster(quotas={"alice": 0, "bob": 6}, nodes=(("a", 2, "fast"), ("b", 2, "fast")))
    s.submit(JobSpec("opp", CMD, tenant="alice", persistent_bytes=GiB * 3 // 4), 0.0)
    s.decide(0.0)
    opp = s.find("opp")
    s.submit(JobSpec("big", CMD, tenant="bob", min_gpus=4, max_gpus=4, persistent_bytes=GiB * 3 // 4), 1.0)
    assert kinds(s.decide(1.0)) == [(SUSPEND, "opp")]
    s.stopped(opp, 2.0)
    assert opp.gpus == () and s.expected_workers() == by_node("opp", opp.suspended_on)


def test_an_elastic_job_evicted_while_grown_resumes_with_every_worker_it_suspended():
    s = cluster(quotas={"alice": 0, "bob": 6}, nodes=(("a", 2, "fast"), ("b", 2, "fast")))
    s.submit(JobSpec("elastic", CMD, tenant="alice", min_gpus=1, max_gpus=2, persistent_bytes=GiB * 3 // 4), 0.0)
    s.decide(0.0)
    assert kinds(s.decide(1.0)) == [(GROW, "elastic")]
    job = s.find("elastic")
    assert len(job.gpus) == 2 and job.role == OPPORTUNISTIC
    where = job.gpus
    s.submit(JobSpec("big", CMD, tenant="bob", min_gpus=4, max_gpus=4, persistent_bytes=GiB * 3 // 4), 2.0)
    assert kinds(s.decide(2.0)) == [(SUSPEND, "elastic")]
    s.stopped(job, 3.0)
    assert kinds(s.decide(3.0)) == [(START, "big")]
    s.ended(s.find("big"), 4.0)
    resumed = s.decide(4.0)
    assert kinds(resumed) == [(RESUME, "elastic")]
    assert resumed[0].gpus == where  # each worker where its process stayed


def test_a_restarted_scheduler_takes_back_every_job_in_its_state_and_decides_as_the_one_before():
    import json

    def busy_cluster():
        s = cluster(quotas={"alice": 0, "bob": 6})
        s.submit(JobSpec("evicted", CMD, tenant="alice", persistent_bytes=GiB * 3 // 4, env={"X": "1"},
                         speeds={"fast": 2.0}), 0.0)
        s.submit(JobSpec("elastic", CMD, tenant="bob", min_gpus=1, max_gpus=3), 0.0)
        s.decide(0.0)
        s.decide(1.0)  # elastic grows into the idle GPUs
        s.submit(JobSpec("big", CMD, tenant="bob", min_gpus=3, max_gpus=3, persistent_bytes=GiB * 3 // 4), 2.0)
        s.submit(JobSpec("pair", CMD, tenant="bob", min_gpus=2, max_gpus=2), 2.0)
        assert kinds(s.decide(2.0)) == [(SUSPEND, "evicted"), (START, "pair"), (SHRINK, "elastic")]
        s.stopped(s.find("evicted"), 2.5)
        return s

    before = busy_cluster()
    assert before.find("evicted").status == SUSPENDED and before.find("elastic").stopping  # worth keeping
    saved = json.loads(json.dumps(before.to_state()))  # as the runtime keeps it
    after = cluster(quotas={"bob": 1})  # started with other quotas: the saved ones are newer
    after.restore(saved)
    assert after.quotas == {"alice": 0, "bob": 6} and after.next_id == before.next_id
    assert after.to_state() == before.to_state()
    assert after.find("evicted").spec == before.find("evicted").spec
    assert after.find("evicted").suspended_on == before.find("evicted").suspended_on == (("a", 1),)
    assert after.find("elastic").stopping == before.find("elastic").stopping == (("b", 1),)

    def next_steps(s):
        steps = [s.decide(3.0)]  # big starts on evicted's GPU and beside pair (bob is past his quota)
        s.ended(s.find("big"), 4.0)
        steps.append(s.decide(4.0))  # evicted resumes where it was; bob's quota takes pair up
        return [[(a.kind, a.job.name, a.gpus) for a in step] for step in steps]

    steps = next_steps(after)
    assert steps == next_steps(before)
    assert [[(kind, name) for kind, name, _ in step] for step in steps] == [[(START, "big")],
                                                                        [(UPGRADE, "pair"), (RESUME, "evicted")]]
    assert after.submit(JobSpec("new", CMD), 5.0).job_id == before.submit(JobSpec("new", CMD), 5.0).job_id
    # The time accounts go on from where they were saved: the time away counts as it passed.
    assert after.find("elastic").attained_service == before.find("elastic").attained_service > 0
    assert after.find("evicted").waited_s == before.find("evicted").waited_s > 0


def test_a_lost_node_leaves_its_jobs_alone_and_the_rest_is_scheduled_until_it_rejoins():
    s = cluster(policy=Fifo())
    s.submit(JobSpec("on_c", CMD, gpu_type="slow", min_gpus=2, max_gpus=2), 0.0)
    s.decide(0.0)
    gpus_c = s.nodes["c"]
    assert s.node_lost("c")
    s.submit(JobSpec("later", CMD, min_gpus=4, max_gpus=4), 1.0)
    assert kinds(s.decide(1.0)) == [(START, "later")]
    assert s.find("on_c").status == RUNNING
    assert s.node_reported("c", gpus_c)
    assert s.status()["nodes"][2]["live"]


def test_a_job_that_needs_a_lost_nodes_gpus_waits_for_it_instead_of_failing():
    s = cluster(policy=Fifo())
    gpus_c = s.nodes["c"]
    assert s.node_lost("c")  # its agent is being started again
    wide = s.submit(JobSpec("wide", CMD, min_gpus=6, max_gpus=6), 0.0)
    assert s.decide(0.0) == [] and wide.status == WAITING and wide.reason == ""
    s.node_reported("c", gpus_c)
    assert kinds(s.decide(1.0)) == [(START, "wide")]
    too_wide = s.submit(JobSpec("too_wide", CMD, min_gpus=7, max_gpus=7), 2.0)
    assert s.node_lost("c")
    s.decide(2.0)
    assert too_wide.status == FAILED  # more than the cluster has even with the node back


def test_a_running_job_whose_gpu_left_its_node_is_left_alone_and_the_rest_is_scheduled():
    s = cluster(policy=Fifo())
    s.submit(JobSpec("running", CMD), 0.0)
    s.decide(0.0)
    job = s.find("running")
    (node, index), = job.gpus
    s.node_reported(node, [g for g in s.nodes[node] if g.index != index])
    s.submit(JobSpec("next", CMD, min_gpus=5, max_gpus=5), 1.0)
    assert kinds(s.decide(1.0)) == [(START, "next")]  # the five GPUs the nodes still list
    assert job.status == RUNNING and job.gpus == ((node, index),)  # until its workers exit
    s.ended(job, 2.0, failed=True, reason="exit status 1")
    assert s.decide(2.0) == []


def test_cluster_simulation_runs_every_policy_on_the_trace_and_its_cluster_with_slow_nodes():
    shape = read_cluster(str(REPO / "benchmarks/traces/jobs/tiresias_cluster_n32g4.csv"), slow_nodes=16)
    assert (shape.nodes, shape.gpus_per_node, shape.gpu_count) == (32, 4, 128)
    assert [g.gpu_type for g in shape.gpus()[::4]][:4] == ["fast", "slow", "fast", "slow"]
    trace = read_trace(str(REPO / "benchmarks/traces/jobs/tiresias_60_job.csv"))
    config = SimulationConfig(gpu_count=128, gpus=shape.gpus(), speed=relative_speed)
    blind = simulate(trace, make_policy("fifo"), config).summary()
    allox = simulate(trace, TypeMatching(make_policy("fifo")), config).summary()
    assert blind["jobs"] == allox["jobs"] == 60
    assert allox["avg_jct_s"] < blind["avg_jct_s"]


def test_a_measurement_taken_before_a_placed_worker_ran_is_not_used():
    # A guaranteed job is placed on GPU 0, then its node reports GPU 0 idle, measured before
    # that worker was running there. Trusting it, a gang waiting for its guarantee would start
    # opportunistically on both GPUs at full share; the job's declared load says GPU 0 is busy.
    s = cluster(policy=Packing(), nodes=())
    s.node_reported("a", [Gpu("a", i, f"a{i}", "fast", GiB, free_bytes=GiB, utilization=0.0,
                              running=frozenset()) for i in (0, 1)])
    s.submit(JobSpec("filler", CMD), 0.0)
    assert kinds(s.decide(0.0)) == [(START, "filler")]
    on = s.find("filler").gpus[0][1]
    s.submit(JobSpec("gang", CMD, min_gpus=2, max_gpus=2), 1.0)
    assert s.decide(1.0) == [] and s.find("gang").status == WAITING
    assert s.state(1.0).gpu(on).utilization is None and s.state(1.0).gpu(1 - on).utilization == 0.0

    # Once the report covers the worker, its measurement is used: it leaves 70% idle.
    s.node_reported("a", [Gpu("a", i, f"a{i}", "fast", GiB, free_bytes=GiB // 2, utilization=0.3 if i == on else 0.0,
                              running=frozenset({"filler-w0"} if i == on else ())) for i in (0, 1)])
    assert s.state(2.0).gpu(on).utilization == 0.3
    action = s.decide(2.0)[0]
    assert (action.kind, action.job.name, action.job.role) == (START, "gang", OPPORTUNISTIC)
    assert action.job.share == pytest.approx(0.7)


def test_a_slow_gpu_stretches_a_jobs_run_time_by_its_speed():
    job = TraceJob(job_id=1, num_gpus=1, submit_time=0.0, iterations=10, model_name="vgg16", duration_s=100.0,
                   persistent_bytes=0, peak_bytes=0)
    shape = ClusterShape(nodes=1, gpus_per_node=1, slow_nodes=1)
    config = SimulationConfig(gpu_count=1, gpus=shape.gpus(), speed=relative_speed)
    result = simulate([job], Fifo(), config)
    assert result.jobs[0].jct_s == pytest.approx(100.0 / 0.30)


def test_opportunistic_jobs_go_to_the_gpus_with_the_most_spare_compute_then_memory_as_measured():
    s = cluster(policy=Packing(), nodes=())
    s.node_reported("a", [Gpu("a", 0, "a0", "fast", GiB, free_bytes=GiB // 8), Gpu("a", 1, "a1", "fast", GiB,
                                                                                   free_bytes=GiB // 2)])
    s.submit(JobSpec("roomy", CMD, role=OPPORTUNISTIC), 0.0)
    assert s.decide(0.0)[0].gpus == (("a", 1),)  # both idle: the one with more free memory
    s.ended(s.find("roomy"), 1.0)
    for i in (0, 1):
        s.submit(JobSpec(f"g{i}", CMD), 1.0)
    s.decide(1.0)
    on = {s.find(f"g{i}").gpus[0]: f"g{i}" for i in (0, 1)}
    s.node_reported("a", [Gpu("a", 0, "a0", "fast", GiB, free_bytes=GiB // 2, utilization=0.9),
                          Gpu("a", 1, "a1", "fast", GiB, free_bytes=GiB // 2, utilization=0.3)])
    s.submit(JobSpec("packed", CMD, role=OPPORTUNISTIC), 2.0)
    action = s.decide(2.0)[0]
    assert action.gpus == (("a", 1),) and action.job.share == pytest.approx(0.7)  # the idler guaranteed job
    assert on[("a", 1)] in ("g0", "g1")


def test_a_torchrun_worker_is_an_agent_of_the_jobs_rendezvous_whose_child_is_cotenant_run():
    run = pytest.importorskip("torch.distributed.run")
    from cotenant.cluster import torchrun

    child = ["python3", "-m", "cotenant.cli", "run", "--guaranteed", "--device", "1", "--name", "t-w2", "--",
             "python3", "train.py", "--lr", "0.1"]
    argv = torchrun.agent_command(child, min_nodes=1, max_nodes=3, endpoint="10.0.0.5:29411", rdzv_id="t-7",
                                  local_addr="10.0.0.6")
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    args = run.parse_args(argv[3:])  # torch's own parser: every option is one it knows
    assert run.parse_min_max_nnodes(args.nnodes) == (1, 3) and args.nproc_per_node == "1"
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "10.0.0.5:29411", "t-7")
    assert args.no_python and [args.training_script, *args.training_script_args] == child
    assert args.local_addr == "10.0.0.6" and args.max_restarts == torchrun.MAX_RESTARTS
    conf = dict(pair.split("=") for pair in args.rdzv_conf.split(","))
    # No agent hosts the store (host_store does), not even one on the endpoint's machine.
    assert conf["is_host"] == "0" and float(conf["last_call_timeout"]) == torchrun.LAST_CALL_S
    assert torchrun.agent_env() == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_a_rendezvous_store_keeps_the_port_it_bound_and_serves_the_agents_until_it_goes():
    pytest.importorskip("torch.distributed")
    import datetime
    import socket

    from torch.distributed import TCPStore

    from cotenant.cluster import torchrun

    store = torchrun.host_store("127.0.0.1", timeout_s=5)
    host, port = torchrun.endpoint(store).rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:  # nobody else can take the port
        with pytest.raises(OSError):
            other.bind((host, int(port)))
    client = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("round", "3")
    assert store.get("round") == b"3"
    del client, store
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:  # gone with the object
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((host, int(port)))


def test_a_job_names_a_launcher_it_has():
    assert JobSpec("t", CMD, min_gpus=1, max_gpus=3, launcher="torchrun").launcher == "torchrun"
    with pytest.raises(ValueError, match="launcher is one of plain, torchrun"):
        JobSpec("t", CMD, launcher="mpirun")


def test_a_worker_taken_over_from_an_earlier_node_agent_is_followed_by_its_pid_and_start_time():
    import signal
    import subprocess
    import time

    from cotenant.cluster.runtime import _Adopted
    from cotenant.coordinator.daemon import process_alive, process_start_ticks

    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = process_start_ticks(process.pid)
        adopted = _Adopted(process.pid, started)
        assert started and adopted.poll() is None
        assert _Adopted(process.pid, started + 1).poll() == 0  # the pid, reused by another process
        with pytest.raises(subprocess.TimeoutExpired):
            adopted.wait(timeout=0.1)
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while adopted.poll() is None and time.monotonic() < deadline:  # a zombie (not reaped yet) is gone too
            time.sleep(0.02)
        assert adopted.poll() == 0 and adopted.wait(timeout=1) == 0 and os.path.exists(f"/proc/{process.pid}")
    finally:
        process.kill()
        process.wait()
    assert not process_alive(process.pid, started)


def test_a_starting_scheduler_reads_its_saved_state_again_while_the_gcs_does_not_answer(monkeypatch):
    from cotenant.cluster import runtime

    class Store:  # Ray's internal_kv, as far as the scheduler uses it
        def __init__(self, failures):
            self.failures, self.calls = failures, 0

        def _internal_kv_get(self, key, namespace):
            self.calls += 1
            assert (key, namespace) == (runtime.STATE_KEY, runtime.NAMESPACE)
            if self.calls <= self.failures:
                raise ConnectionError("GCS unavailable")
            return b"{}"

    monkeypatch.setattr(runtime, "READ_STATE_FOR_S", 1.0)
    store = Store(failures=2)
    assert runtime._read_saved_state(store) == b"{}" and store.calls == 3
    with pytest.raises(RuntimeError, match=r"cannot read its saved state .*ConnectionError: GCS unavailable.*"
                                           r"cotenant cluster up"):
        runtime._read_saved_state(Store(failures=10 ** 6))


# ---- `cotenant cluster up`'s options, without Ray ------------------------------------------------


@pytest.mark.parametrize("option, value", [("--gang-timeout", "0"), ("--gang-timeout", "soon"),
                                           ("--agent-timeout", "-1"), ("--agent-timeout", "inf")])
def test_cluster_up_refuses_a_timeout_that_is_not_a_positive_number_of_seconds(option, value, capsys):
    from cotenant import cli

    with pytest.raises(SystemExit) as exit_status:
        cli.main(["cluster", "up", option, value])
    assert exit_status.value.code == 2
    assert f"{option} takes a number of seconds above 0, like 30; not {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("running", [False, True])
def test_cluster_up_starts_the_scheduler_with_its_timeouts_and_says_when_one_runs_already(running, monkeypatch,
                                                                                         capsys):
    from cotenant import cli
    from cotenant.cluster import command, runtime

    started = {}

    class Ray:
        @staticmethod
        def nodes():
            return [{"Alive": True, "Resources": {"GPU": 2.0}}]

    def scheduler_handle(ray):
        if not running:
            raise LookupError("no cotenant scheduler runs on this Ray cluster")
        return object()

    monkeypatch.setattr(runtime, "ray_module", lambda: object())
    monkeypatch.setattr(command, "_connect", lambda address: Ray())
    monkeypatch.setattr(runtime, "scheduler_handle", scheduler_handle)
    monkeypatch.setattr(runtime, "start_scheduler", lambda ray, **options: started.update(options))
    assert cli.main(["cluster", "up", "--address", "10.0.0.1:6379", "--gang-timeout", "45",
                     "--agent-timeout", "5"]) == 0
    assert started["gang_timeout_s"] == 45.0 and started["agent_timeout_s"] == 5.0
    assert started["policy"] == "antman"
    out = capsys.readouterr()
    assert "1 node(s), 2 GPU(s)" in out.out
    assert ("runs on this Ray cluster already" in out.err) == running


# ---- the global scheduler's requests, without Ray ------------------------------------------------


@pytest.fixture
def global_scheduler(monkeypatch):
    """A GlobalScheduler with no saved state, no loop and no saving: its requests alone."""
    from cotenant.cluster import runtime

    for method in ("_load", "_loop", "_save"):
        monkeypatch.setattr(runtime.GlobalScheduler, method, lambda self: None)
    return runtime.GlobalScheduler(policy="fifo")


def test_cancelling_a_job_that_has_ended_is_refused_and_keeps_how_it_ended(global_scheduler):
    core = global_scheduler.core
    job = core.submit(JobSpec("crashed", CMD), 0.0)
    core.ended(job, 1.0, failed=True, reason="exit status 3")
    with pytest.raises(ValueError, match="job 'crashed' has already failed .exit status 3.; nothing to cancel"):
        global_scheduler.cancel("crashed")
    assert (job.status, job.reason, job.finished_at) == (FAILED, "exit status 3", 1.0)


def test_a_submission_with_a_name_taken_submits_none_of_its_jobs(global_scheduler):
    global_scheduler.submit([JobSpec("taken", CMD)])
    for batch in ([JobSpec("fresh", CMD), JobSpec("taken", CMD)], [JobSpec("twice", CMD), JobSpec("twice", CMD)]):
        with pytest.raises(ValueError, match="a job named .(taken|twice). is already in the cluster"):
            global_scheduler.submit(batch)
    assert [job.name for job in global_scheduler.core.jobs.values()] == ["taken"]


def test_a_leaving_worker_whose_node_has_not_reported_is_unknown_not_gone(global_scheduler):
    # As after a restart: the scheduler follows a shrink's leaving worker, and the agent of its
    # node has not answered yet (or its node is lost). Its GPU stays held and the tick goes on.
    core = global_scheduler.core
    core.node_reported("a", [Gpu("a", 0, "a0", "fast", GiB)])
    job = core.submit(JobSpec("elastic", CMD, min_gpus=1, max_gpus=2), 0.0)
    job.status, job.gpus, job.stopping = RUNNING, (("a", 0),), (("b", 0),)
    global_scheduler.leaving = {job.job_id: {"elastic-w1": (("b", 0), True)}}
    global_scheduler._follow_workers(1.0)
    assert job.stopping == (("b", 0),) and "elastic-w1" in global_scheduler.leaving[job.job_id]


def test_a_guaranteed_job_its_tenant_has_no_room_for_is_told_so_when_submitted(global_scheduler):
    # With quotas set, a tenant without one (or a typo in --tenant) gets none: its guaranteed jobs
    # ran opportunistic, evictable, and nothing said why.
    assert "note" not in global_scheduler.submit([JobSpec("free", CMD)])[0]  # no quotas: every job may be
    global_scheduler.set_quota("research", 4)
    typo, big, fits, opportunistic = global_scheduler.submit([
        JobSpec("typo", CMD, tenant="reserch"), JobSpec("big", CMD, tenant="research", min_gpus=6, max_gpus=6),
        JobSpec("fits", CMD, tenant="research", min_gpus=2, max_gpus=2),
        JobSpec("opp", CMD, tenant="reserch", role=OPPORTUNISTIC)])
    assert "tenant 'reserch' has no quota (quotas: research=4)" in typo["note"]
    assert "cotenant cluster up --quota reserch=GPUS" in typo["note"]
    assert "has a quota of 4 GPUs, fewer than the job's 6" in big["note"]
    assert "note" not in fits and "note" not in opportunistic
    assert [e["job"] for e in global_scheduler.events if e["event"] == "guaranteed beyond its quota"] == \
        ["typo", "big"]


class _Agent:
    """A node agent whose start fails for the workers named in `refused` (its actor died since its
    report); the workers it started and stopped."""

    def __init__(self, refused=()):
        self.refused, self.started, self.stopped = set(refused), [], []
        agent = self

        class _Start:
            @staticmethod
            def remote(worker, *args):
                agent.started.append(worker)
                return worker

        class _Stop:
            @staticmethod
            def remote(worker, pid=None):
                agent.stopped.append(worker)

        self.start, self.stop = _Start(), _Stop()


class _Ray:
    def __init__(self, agent):
        self.agent = agent

    def get(self, refs):
        failed = [r for r in refs if r in self.agent.refused]
        if failed:
            raise RuntimeError(f"the actor died before starting {failed[0]}")
        return refs


def test_a_start_the_agent_cannot_carry_out_leaves_the_job_waiting_not_running(global_scheduler):
    # decide() marks a job running before the agents start its workers; an agent that died in
    # between used to leave it marked running with no worker, read as finished once the node
    # reported again ("gone", no exit status). It waits instead, as if never started.
    core = global_scheduler.core
    core.node_reported("a", [Gpu("a", 0, "a0", "fast", GiB), Gpu("a", 1, "a1", "fast", GiB)])
    one = core.submit(JobSpec("one", CMD, role=OPPORTUNISTIC), 0.0)
    two = core.submit(JobSpec("two", CMD, role=OPPORTUNISTIC), 0.0)
    agent = _Agent(refused={"one-w0"})
    global_scheduler.agents = {"a": agent}
    global_scheduler._reserve = lambda job, gpus, kind, ray: True  # Ray's placement groups are not under test
    for action in core.decide(1.0):
        global_scheduler._carry_out(action, _Ray(agent))
    assert (one.status, one.gpus, one.first_started_at) == (WAITING, (), None)
    assert agent.stopped == ["one-w0"]
    assert two.status == RUNNING and "two-w0" in agent.started
    events = [e for e in global_scheduler.events if e["event"] == "job not started"]
    assert [e["job"] for e in events] == ["one"] and "it waits" in events[0]["reason"]


def test_a_number_names_a_job_by_id_and_a_job_cannot_be_named_by_a_number():
    # `cotenant cluster cancel 2` means job id 2: a job named "1" would make it ambiguous.
    s = cluster()
    first = s.submit(JobSpec("two", CMD, min_gpus=1, max_gpus=1), 0.0)
    second = s.submit(JobSpec("job-1", CMD, min_gpus=1, max_gpus=1), 0.0)
    assert s.find(str(second.job_id)) is second and s.find("two") is first
    assert s.find(str(second.job_id + 10)) is None and s.find("missing") is None
    with pytest.raises(ValueError, match=r"the job name '1' is a number.*'job-1'"):
        s.submit(JobSpec("1", CMD, min_gpus=1, max_gpus=1), 0.0)
    assert len(s.jobs) == 2  # nothing of the refused one stays


# ---- gangs Ray has not granted yet ------------------------------------------------------------


class _Group:
    """A placement group whose grant the test decides; the timeouts it was waited for."""

    def __init__(self, book, name):
        self.book, self.name, self.waits = book, name, []

    def wait(self, timeout_seconds=30):
        self.waits.append(timeout_seconds)
        return self.name in self.book.granted


@pytest.fixture
def placement_groups(monkeypatch):
    """Ray's placement-group calls, as the scheduler makes them, over groups the test grants."""
    book = types.SimpleNamespace(granted=set(), created=[], removed=[])
    module = types.ModuleType("ray.util.placement_group")

    def placement_group(bundles, strategy, bundle_label_selector, name, lifetime):
        group = _Group(book, name)
        book.created.append(group)
        return group

    def get_placement_group(name):
        raise ValueError(f"no placement group {name}")

    module.placement_group, module.get_placement_group = placement_group, get_placement_group
    module.remove_placement_group = book.removed.append
    monkeypatch.setitem(sys.modules, "ray.util.placement_group", module)
    return book


def _gang_waiting(global_scheduler):
    """A guaranteed job placed on node a's GPU, whose gang Ray has not granted."""
    core = global_scheduler.core
    core.node_reported("a", [Gpu("a", 0, "a0", "fast", GiB)])
    job = core.submit(JobSpec("g", CMD, role=GUARANTEED), 0.0)
    agent = _Agent()
    global_scheduler.agents = {"a": agent}
    for action in core.decide(1.0):
        global_scheduler._carry_out(action, _Ray(agent))
    assert job.role == GUARANTEED
    return job, agent


def test_a_gang_ray_has_not_granted_waits_without_holding_the_tick_and_starts_once_granted(global_scheduler,
                                                                                          placement_groups):
    # The tick used to wait for Ray's grant (the gang timeout, 10 s by default) under the lock that
    # status, submit and cancel take, at every tick while Ray could not grant it.
    job, agent = _gang_waiting(global_scheduler)
    group, = placement_groups.created
    assert group.waits == [0]  # asked, not waited for
    assert job.status == RUNNING and job.job_id in global_scheduler.reserving and agent.started == []
    assert global_scheduler.status()["jobs"][0]["name"] == "g"  # the lock is free
    waiting = lambda: [e["job"] for e in global_scheduler.events if e["event"] == "gang waiting"]  # noqa: E731
    assert waiting() == []  # Ray usually grants within a tick: no word of it before
    # Its node reports no worker of it: that is a start not carried out yet, not a job that finished.
    global_scheduler.reports = {"a": {"workers": {}, "coordinator": "up"}}
    for tick in (2.0, 3.0):
        global_scheduler._follow_workers(tick)
        global_scheduler._follow_reservations(_Ray(agent))
    assert job.status == RUNNING and agent.started == [] and waiting() == ["g"]  # said once
    placement_groups.granted.add(group.name)
    global_scheduler._follow_reservations(_Ray(agent))
    assert agent.started == ["g-w0"] and global_scheduler.groups[job.job_id] is group
    assert job.job_id not in global_scheduler.reserving and placement_groups.removed == []
    assert [e["job"] for e in global_scheduler.events if e["event"] == "job started"] == ["g"]


def test_a_gang_ray_does_not_grant_in_time_is_given_up_and_its_job_waits(global_scheduler, placement_groups):
    global_scheduler.gang_timeout_s = 0.05
    job, agent = _gang_waiting(global_scheduler)
    group, = placement_groups.created
    global_scheduler._follow_reservations(_Ray(agent))
    assert job.status == RUNNING  # not yet
    time.sleep(0.06)
    global_scheduler._follow_reservations(_Ray(agent))
    assert (job.status, job.gpus, job.first_started_at) == (WAITING, (), None)
    assert placement_groups.removed == [group] and not global_scheduler.reserving and agent.started == []
    given_up = [e for e in global_scheduler.events if e["event"] == "gang not granted"]
    assert [e["job"] for e in given_up] == ["g"] and given_up[0]["gpus"] == [["a", 0]]


def test_an_eviction_or_a_cancel_before_the_grant_gives_the_gang_up(global_scheduler, placement_groups):
    job, agent = _gang_waiting(global_scheduler)
    group, = placement_groups.created
    job.status, job.evictions = STOPPING, job.evictions + 1  # as decide() evicts a running job
    global_scheduler._carry_out(Action(SUSPEND, job), _Ray(agent))  # _Agent has no `command`: none is sent
    assert (job.status, job.gpus, job.evictions) == (WAITING, (), 0)
    assert placement_groups.removed == [group] and not global_scheduler.reserving
    assert [e["event"] for e in global_scheduler.events][-1] == "gang withdrawn"
    for action in global_scheduler.core.decide(2.0):  # placed again, and cancelled while it waits
        global_scheduler._carry_out(action, _Ray(agent))
    again = placement_groups.created[-1]
    assert again is not group and job.job_id in global_scheduler.reserving
    global_scheduler.cancel("g")
    assert placement_groups.removed == [group, again] and not global_scheduler.reserving
