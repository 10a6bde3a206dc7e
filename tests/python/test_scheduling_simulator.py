"""The discrete-event simulator, the trace format, the trace generator and `cotenant simulate`."""

import json
from dataclasses import dataclass

import pytest

from cotenant import cli
from cotenant.scheduling import tracegen
from cotenant.scheduling.policies import DiscretizedLas, Fifo, Packing, TimeSlicing
from cotenant.scheduling.simulator import SimulationConfig, SimulationError, Simulator, simulate
from cotenant.scheduling.state import Placement, Plan
from cotenant.scheduling.trace import MODEL_MEMORY, TraceError, TraceJob, read_trace

GB = 10**9


def tjob(job_id, duration, submit=0.0, gpus=1, iterations=None, persistent=0, peak=None, role=None,
         utilization=None):
    return TraceJob(job_id=job_id, num_gpus=gpus, submit_time=submit, iterations=iterations or int(duration),
                    model_name="m", duration_s=duration, persistent_bytes=persistent,
                    peak_bytes=persistent if peak is None else peak, role=role, utilization=utilization)


def by_id(result):
    return {j.job_id: j for j in result.jobs}


def test_a_job_alone_completes_in_its_duration_and_keeps_its_gpus_busy():
    result = simulate([tjob(1, 500, submit=10, gpus=2)], Fifo(), SimulationConfig(gpu_count=2))
    summary = result.summary()
    assert by_id(result)[1].jct_s == pytest.approx(500)
    assert summary["makespan_s"] == pytest.approx(500)
    assert summary["gpu_time_utilization"] == pytest.approx(1.0)
    assert summary["avg_queueing_s"] == 0


def test_fifo_second_job_waits_for_the_first():
    result = simulate([tjob(1, 100), tjob(2, 50, submit=30)], Fifo(), SimulationConfig(gpu_count=1))
    jobs = by_id(result)
    assert jobs[2].queueing_s == pytest.approx(70)
    assert jobs[2].jct_s == pytest.approx(120)
    assert result.summary()["median_jct_s"] == pytest.approx(110)


def test_las_preempts_at_the_iteration_boundary_and_pays_the_copies_both_ways():
    # Job 1: 1000 s of 10 s iterations, 10 GB persistent; past 100 GPU-s it is in queue 1.
    # Job 2 arrives at 105.5: job 1 runs to its boundary (110), copies out 1 s, job 2 runs
    # 111-161, job 1 copies back 1 s and computes its remaining 890 s.
    trace = [tjob(1, 1000, iterations=100, persistent=10 * GB), tjob(2, 50, submit=105.5)]
    config = SimulationConfig(gpu_count=1, pcie_bytes_per_s=10 * GB)
    result = simulate(trace, DiscretizedLas(thresholds_gpu_s=(100.0,), starvation_factor=0), config)
    jobs = by_id(result)
    assert jobs[2].first_started_at == pytest.approx(111)
    assert jobs[2].finished_at == pytest.approx(161)
    assert jobs[1].finished_at == pytest.approx(162 + 890)
    assert (jobs[1].preemptions, jobs[1].bytes_moved) == (1, 20 * GB)
    assert result.summary()["switch_s"] == pytest.approx(2)


def test_timeslicing_alternates_quanta_between_jobs_that_do_not_fit():
    result = simulate([tjob(1, 300), tjob(2, 300)], TimeSlicing(quantum_s=60), SimulationConfig(gpu_count=1))
    jobs = by_id(result)
    assert jobs[1].finished_at == pytest.approx(540)  # quanta 1, 3, 5, 7, 9
    assert jobs[2].finished_at == pytest.approx(600)
    assert jobs[1].preemptions == 4 and jobs[2].preemptions == 4


def test_attained_service_counts_the_share_a_packed_job_had():
    trace = [tjob(1, 1000, utilization=0.5, role="guaranteed"), tjob(2, 100, role="opportunistic", utilization=1.0)]
    simulator = Simulator(trace, Packing(), SimulationConfig(gpu_count=1))
    result = simulator.run()
    packed = next(j for j in simulator.done if j.job_id == 2)
    assert by_id(result)[2].jct_s == pytest.approx(200)  # at share 0.5
    assert packed.attained == pytest.approx(100)           # 200 s x 1 GPU x 0.5
    assert result.summary()["compute_utilization"] == pytest.approx((0.5 * 1000 + 100) / 1000)


def test_a_job_that_can_never_fit_is_refused_and_the_rest_run():
    trace = [tjob(1, 100, gpus=4), tjob(2, 100, persistent=GB, peak=100 * GB), tjob(3, 100)]
    result = simulate(trace, Fifo(), SimulationConfig(gpu_count=2, gpu_memory_bytes=80 * GB))
    summary = result.summary()
    assert summary["refused"] == [1, 2] and summary["jobs"] == 1


@dataclass(frozen=True)
class TwoOnOneGpu:
    name: str = "broken"

    def plan(self, state):
        return Plan({j.job_id: Placement((0,)) for j in state.jobs})


@dataclass(frozen=True)
class Idle:
    name: str = "idle"

    def plan(self, state):
        return Plan({}, tuple(j.job_id for j in state.jobs))


def test_a_plan_putting_two_guaranteed_jobs_on_one_gpu_is_an_error():
    with pytest.raises(SimulationError, match="guaranteed jobs .* on GPU 0"):
        simulate([tjob(1, 10), tjob(2, 10)], TwoOnOneGpu(), SimulationConfig(gpu_count=2))


def test_a_policy_that_never_starts_anything_is_reported_not_looped_on():
    with pytest.raises(SimulationError, match="leaves jobs 1 waiting"):
        simulate([tjob(1, 10)], Idle(), SimulationConfig(gpu_count=1))


@dataclass
class MovesASuspendedJob:
    """Runs job 1 on GPU 0, suspends it at t=50, then resumes it on `resume_on` at t=60."""
    resume_on: tuple
    name: str = "mover"
    seen: list = None

    def plan(self, state):
        if not state.jobs:
            return Plan({})
        job = state.jobs[0]
        self.seen = (self.seen or []) + [(job.status, job.bound_gpus)]
        if state.now < 50:
            return Plan({1: Placement((0,))}, wake_at=50)
        if state.now < 60:
            return Plan({}, (1,), wake_at=60)
        return Plan({1: Placement(self.resume_on)})


def test_a_suspended_job_is_bound_to_its_gpus_and_resuming_it_elsewhere_is_an_error():
    mover = MovesASuspendedJob(resume_on=(1,))
    with pytest.raises(SimulationError, match=r"resumed job 1 on GPUs \(1,\); it was suspended on \(0,\)"):
        simulate([tjob(1, 100, iterations=100)], mover, SimulationConfig(gpu_count=2))
    assert ("suspended", (0,)) in mover.seen
    assert all(bound == () for status, bound in mover.seen if status != "suspended")


def test_a_suspended_job_resumes_on_the_gpu_it_was_suspended_on():
    result = simulate([tjob(1, 100, iterations=100)], MovesASuspendedJob(resume_on=(0,)),
                      SimulationConfig(gpu_count=2))
    assert by_id(result)[1].preemptions == 1
    assert by_id(result)[1].finished_at == pytest.approx(110)  # idle from 50 to 60, nothing to copy


def test_las_on_two_gpus_resumes_a_preempted_job_on_its_own_gpu_when_another_frees_first():
    # Jobs 2 and 1 start on GPUs 0 and 1. Job 3 arrives at 100.5, when both are past the 100 GPU-s
    # threshold, and preempts job 1, the later arrival, at its boundary (101.25) on GPU 1. Job 2 ends
    # at 150 and frees GPU 0 first, but job 1's memory waits for it on GPU 1: it resumes there when
    # job 3 ends (161.25).
    trace = [tjob(2, 150), tjob(1, 1000, submit=0.25, iterations=1000), tjob(3, 60, submit=100.5)]
    config = SimulationConfig(gpu_count=2)
    simulator = Simulator(trace, DiscretizedLas(thresholds_gpu_s=(100.0,), starvation_factor=0), config)
    result = simulator.run()
    jobs = by_id(result)
    assert jobs[1].preemptions == 1
    assert jobs[3].first_started_at == pytest.approx(101.25)
    assert jobs[1].finished_at == pytest.approx(161.25 + 1000 - 101)


# --- traces ----------------------------------------------------------------------------


def write_csv(path, text):
    path.write_text(text)
    return str(path)


def test_tiresias_trace_reads_with_memory_from_the_model_table(tmp_path):
    path = write_csv(tmp_path / "t.csv", "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
                                         "0,2,5,100,resnet50,300,10\n")
    (job,) = read_trace(path)
    assert (job.num_gpus, job.submit_time, job.duration_s, job.iteration_s) == (2, 5.0, 300.0, 3.0)
    assert (job.persistent_bytes, job.peak_bytes) == MODEL_MEMORY["resnet50"]
    assert job.role is None and job.utilization is None


def test_trace_optional_columns_take_sizes_roles_and_utilization(tmp_path):
    path = write_csv(tmp_path / "t.csv", "job_id,num_gpu,submit_time,iterations,model_name,duration,interval,"
                                         "persistent_memory,peak_memory,role,utilization\n"
                                         "7,1,0,10,x,60,0,2GiB,6GiB,opportunistic,0.4\n")
    (job,) = read_trace(path)
    assert (job.persistent_bytes, job.peak_bytes) == (2 << 30, 6 << 30)
    assert (job.role, job.utilization) == ("opportunistic", 0.4)


@pytest.mark.parametrize("header,row,message", [
    ("job_id,num_gpu,submit_time,model_name,duration", "0,1,0,x,10", "lacks the column\\(s\\) iterations"),
    ("job_id,num_gpu,submit_time,iterations,model_name,duration", "0,1.5,0,1,x,10", "line 2: num_gpu must be a whole"),
    ("job_id,num_gpu,submit_time,iterations,model_name,duration,role", "0,1,0,1,x,10,best", "role must be"),
    ("job_id,num_gpu,submit_time,iterations,model_name,duration,peak_memory", "0,1,0,1,x,10,lots", "peak_memory"),
])
def test_a_bad_trace_line_names_the_file_the_line_and_the_column(tmp_path, header, row, message):
    path = write_csv(tmp_path / "bad.csv", header + "\n" + row + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)


@pytest.mark.parametrize("content", [
    b"\x1f\x8b\x08\x00 a gzip file \xff\xfe",  # not UTF-8 text
    b"job_id,num_gpu,submit_time,iterations,model_name,duration\n0,1,0,1," + b"x" * 200_000 + b",10\n",
])
def test_a_trace_that_is_not_a_csv_text_file_is_refused_naming_the_file(tmp_path, capsys, content):
    path = tmp_path / "not-a-trace.csv"
    path.write_bytes(content)
    with pytest.raises(TraceError, match="the trace .*not-a-trace.csv is not a CSV text file"):
        read_trace(str(path))
    assert cli.main(["simulate", "--trace", str(path), "--gpus", "4"]) == 2
    assert "not-a-trace.csv is not a CSV text file" in capsys.readouterr().err


def test_generated_trace_offers_the_load_asked_for_and_fits_the_node(tmp_path):
    rows = tracegen.generate(jobs=400, gpus=4, load=1.5, seed=3)
    assert max(r["num_gpu"] for r in rows) <= 4
    span = rows[-1]["submit_time"] - rows[0]["submit_time"]
    offered = sum(r["num_gpu"] * r["duration"] for r in rows) / (4 * span)
    assert 1.2 < offered < 1.8
    path = str(tmp_path / "g.csv")
    tracegen.write(rows, path)
    assert [j.job_id for j in read_trace(path)] == list(range(400))


# --- the command -----------------------------------------------------------------------


def test_cotenant_simulate_writes_a_table_json_and_plot(tmp_path, capsys):
    trace = str(tmp_path / "g.csv")
    tracegen.write(tracegen.generate(jobs=30, gpus=4, load=1.5, seed=1), trace)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = cli.main(["simulate", "--trace", trace, "--gpus", "4", "--policy", "fifo,las", "--policy", "antman",
                     "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "avg JCT" in printed and "antman" in printed
    result = json.loads(out_json.read_text())
    assert [r["summary"]["policy"] for r in result["runs"]] == ["fifo", "las", "antman"]
    assert all(len(r["jct_s"]) == 30 for r in result["runs"])
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_cotenant_simulate_refuses_a_missing_trace_with_a_sentence(tmp_path, capsys):
    assert cli.main(["simulate", "--trace", str(tmp_path / "none.csv"), "--gpus", "4"]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_cotenant_simulate_refuses_a_cluster_of_zero_nodes_instead_of_simulating_one_node(tmp_path, capsys):
    trace = str(tmp_path / "g.csv")
    tracegen.write(tracegen.generate(jobs=3, gpus=2, load=1.0, seed=1), trace)
    assert cli.main(["simulate", "--trace", trace, "--gpus", "2", "--nodes", "0", "--policy", "fifo"]) == 2
    assert "a cluster needs at least 1 node of at least 1 GPU, not 0 x 2" in capsys.readouterr().err
