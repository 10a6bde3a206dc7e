"""The co-location benchmark's parts that need no GPU: arguments, summaries of
iteration times, the figures (names and arithmetic) and the auto share step."""

import json
import math
import os
import py_compile

import pytest

from script_loader import load_script

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "colocate.py")


@pytest.fixture(scope="module")
def colocate():
    return load_script(PATH)


def test_the_script_compiles():
    py_compile.compile(PATH, doraise=True)


def test_defaults_run_every_mode_on_the_resnet_pair(colocate):
    args = colocate.parse_args([])
    assert args.modes == list(colocate.MODES)
    assert args.pair == "resnet50+transformer"
    assert args.worker is None


def test_modes_are_validated(colocate):
    assert colocate.parse_args(["--modes", "naive, cotenant-auto"]).modes == ["naive", "cotenant-auto"]
    with pytest.raises(SystemExit):
        colocate.parse_args(["--modes", "naive,timeslice"])
    with pytest.raises(SystemExit):
        colocate.parse_args(["--seconds", "0"])


def test_quick_shortens_runs(colocate):
    args = colocate.parse_args(["--quick", "--seconds", "100"])
    assert args.seconds == 10.0
    assert args.warmup_steps == 5


def test_percentiles_are_nearest_rank(colocate):
    values = list(range(1, 101))
    assert colocate.percentile(values, 50) == 50
    assert colocate.percentile(values, 99) == 99
    assert colocate.percentile([5.0], 99) == 5.0
    assert math.isnan(colocate.percentile([], 50))


def test_summaries_give_throughput_over_measured_time(colocate):
    summary = colocate.summarize_iterations([0.1] * 9 + [0.2])
    assert summary["iterations"] == 10
    assert summary["throughput"] == pytest.approx(10 / 1.1)
    assert summary["p50_s"] == 0.1
    assert summary["p99_s"] == 0.2


def summary(throughput, p50, p99):
    return {"throughput": throughput, "p50_s": p50, "p99_s": p99}


def test_figures_are_ratios_over_solo_with_auto_also_under_plain_names(colocate):
    solo = {"guaranteed": summary(10.0, 0.1, 0.12), "opportunistic": summary(4.0, 0.25, 0.3)}
    runs = {
        "naive": {"guaranteed": summary(6.0, 0.16, 0.3), "opportunistic": summary(2.0, 0.5, 0.6)},
        "mps": {"skipped": "nvidia-cuda-mps-control is not installed"},
        "cotenant-auto": {"guaranteed": summary(9.8, 0.102, 0.123), "opportunistic": summary(2.4, 0.4, 0.5)},
    }
    figures = colocate.compute_figures(solo, runs)
    assert figures["naive.guaranteed_throughput_ratio"] == pytest.approx(0.6)
    assert figures["naive.guaranteed_p99_ratio"] == pytest.approx(2.5)
    assert figures["naive.opportunistic_throughput_ratio"] == pytest.approx(0.5)
    assert figures["naive.aggregate_normalized_throughput"] == pytest.approx(1.1)
    assert not any(key.startswith("mps.") for key in figures)
    for name in colocate.FIGURE_NAMES:
        assert figures[name] == figures[f"cotenant-auto.{name}"]
    assert figures["guaranteed_p50_ratio"] == pytest.approx(1.02)

    met = colocate.targets_met(figures)
    assert met["guaranteed_throughput_ratio"]       # 0.98 >= 0.97
    assert met["guaranteed_p99_ratio"]              # 1.025 <= 1.05
    assert met["opportunistic_throughput_ratio"]    # 0.6 >= 0.5
    assert met["best_aggregate_of_modes_meeting_guaranteed_targets"]


def test_a_mode_that_hurts_the_guaranteed_job_does_not_count_as_better(colocate):
    figures = {"cotenant-auto.aggregate_normalized_throughput": 1.5,
               "cotenant-auto.guaranteed_throughput_ratio": 0.98,
               "naive.aggregate_normalized_throughput": 1.7,
               "naive.guaranteed_throughput_ratio": 0.6,
               "priority.aggregate_normalized_throughput": 1.6,
               "priority.guaranteed_throughput_ratio": 0.99}
    assert not colocate.targets_met(figures)["best_aggregate_of_modes_meeting_guaranteed_targets"]
    figures["priority.aggregate_normalized_throughput"] = 1.4
    assert colocate.targets_met(figures)["best_aggregate_of_modes_meeting_guaranteed_targets"]


def test_auto_mode_runs_the_coordinators_own_policy_not_a_copy(colocate, tmp_path):
    # The benchmark has no share controller of its own: its auto mode starts
    # the product's coordinator, whose policy moves the share.
    assert not hasattr(colocate, "aimd_share")
    assert not hasattr(colocate, "_auto_share_controller")
    process, socket_path = colocate.start_coordinator(str(tmp_path))
    try:
        from cotenant.coordinator import client

        with client.CoordinatorClient(socket_path, 5.0) as c:
            assert c.request("status")["ok"]
    finally:
        process.terminate()
        process.wait(10)


def test_workers_are_started_with_their_role_mode_and_gap(colocate):
    args = colocate.parse_args(["--seconds", "7"])
    command = colocate.worker_command("resnet50-train", "guaranteed", "cotenant-0.5", args, 0.03, "/tmp/x")
    assert command[1].endswith("colocate.py")
    assert command[command.index("--worker") + 1] == "resnet50-train"
    assert command[command.index("--mode") + 1] == "cotenant-0.5"
    assert command[command.index("--gap-s") + 1] == "0.03"
    assert command[command.index("--seconds") + 1] == "7.0"


def test_a_guaranteed_job_beside_another_keeps_iterating_until_both_are_ready(colocate, tmp_path):
    # Under cotenant-auto the coordinator holds the opportunistic job at share
    # 0 until the guaranteed job's solo baseline is measured: a guaranteed job
    # that waited idle for the other to get ready left it waiting for ever
    # (H200, 2026-11-27). Beside another job it runs on until the go.
    go = tmp_path / "go"
    calls = []

    def one_iteration():
        calls.append(1)
        if len(calls) == 3:
            go.touch()

    assert colocate.wait_for_go(str(go), one_iteration) == 3
    assert colocate.wait_for_go(str(go)) == 0  # the go already given: nothing run

    args = colocate.parse_args(["--seconds", "1"])
    beside = colocate.worker_command("resnet50-train", "guaranteed", "cotenant-auto", args, 0.03, "/x", beside=True)
    alone = colocate.worker_command("resnet50-train", "guaranteed", "solo", args, 0.03, "/x")
    assert colocate.parse_args(beside[2:]).beside is True
    assert colocate.parse_args(alone[2:]).beside is False


def test_the_driver_tells_workers_whether_another_job_runs_beside_them(colocate, monkeypatch):
    seen = {}

    def command(workload, role, mode, args, gap_s, sync_dir, beside=False):
        seen[(mode, role)] = beside
        return [colocate.sys.executable, "-c", "import sys; sys.exit(3)"]

    monkeypatch.setattr(colocate, "worker_command", command)
    args = colocate.parse_args(["--seconds", "0.1"])
    for mode, roles in (("naive", {"guaranteed": "a", "opportunistic": "b"}), ("solo", {"guaranteed": "a"})):
        with pytest.raises(RuntimeError, match="exited with 3 before starting"):
            colocate._run(args, mode, roles, 0.0)
    assert seen == {("naive", "guaranteed"): True, ("naive", "opportunistic"): True, ("solo", "guaranteed"): False}


_READY_THEN_TIME_THE_GO = """
import json, os, sys, time
sync_dir, role = sys.argv[1], sys.argv[2]
open(os.path.join(sync_dir, role + ".ready"), "w").close()
ready = time.monotonic()
while not os.path.exists(os.path.join(sync_dir, "go")):
    time.sleep(0.01)
print(json.dumps({"waited_s": time.monotonic() - ready}), flush=True)
"""


@pytest.mark.parametrize("mode, settles", [("cotenant-auto", True), ("cotenant-0.5", False)])
def test_the_auto_mode_lets_the_coordinators_share_settle_before_it_measures(colocate, monkeypatch, mode, settles):
    # The coordinator raises an opportunistic job's share from 0 by 0.05 a
    # decision: a measured window that opens at once holds the ramp, not the
    # policy's steady state (the H200's 4 s runs). Both jobs run meanwhile.
    seen = {}

    def command(workload, role, mode_, args, gap_s, sync_dir, beside=False):
        seen[role] = beside
        return [colocate.sys.executable, "-c", _READY_THEN_TIME_THE_GO, sync_dir, role]

    monkeypatch.setattr(colocate, "worker_command", command)
    args = colocate.parse_args(["--seconds", "0.1", "--auto-settle-s", "1.5"])
    results = colocate._run(args, mode, {"guaranteed": "a", "opportunistic": "b"}, 0.0)
    for role in ("guaranteed", "opportunistic"):
        assert (results[role]["waited_s"] >= 1.5) == settles, results
    assert seen == {"guaranteed": True, "opportunistic": True}


def test_the_settle_time_cannot_be_negative_and_quick_runs_shorten_it(colocate):
    with pytest.raises(SystemExit):
        colocate.parse_args(["--auto-settle-s", "-1"])
    assert colocate.parse_args(["--quick"]).auto_settle_s == 3.0
    assert colocate.parse_args([]).auto_settle_s == 12.0


def test_overhead_figures_compare_each_job_with_and_without_the_gate(colocate):
    # plain 100 ms, enabled without a role 105 ms, enabled as guaranteed 105.42 ms
    figures = colocate.overhead_figures({"compute_p50_s": 0.100}, {"compute_p50_s": 0.105},
                                        {"compute_p50_s": 0.10542}, {"compute_p50_s": 0.010},
                                        {"compute_p50_s": 0.0102}, {"compute_p50_s": 0.0105})
    # The tracker is charged only what the role adds, not the allocator's 5%.
    assert figures["guaranteed_tracker_step_time_ratio"] == pytest.approx(1.004)
    assert figures["guaranteed_enabled_step_time_ratio"] == pytest.approx(1.05)
    assert figures["guaranteed_cotenant_step_time_ratio"] == pytest.approx(1.0542)
    # 0.5 ms more over 1000 ops: 0.5 us per op, 0.2 of them without a role
    assert figures["gate_overhead_us_per_op"] == pytest.approx(0.5)
    assert figures["enabled_overhead_us_per_op"] == pytest.approx(0.2)


def test_only_fixed_share_modes_pin_the_opportunistic_share(colocate):
    assert colocate.fixed_share("cotenant-0.25") == 0.25
    assert colocate.fixed_share("cotenant-0.5") == 0.5
    # The auto mode's gated solo runs and the baselines pin nothing (a gated
    # solo run once crashed parsing "solo" as a share).
    for mode in ("cotenant-auto", "gated-solo", colocate.ENABLED_SOLO, "solo", "naive", "mps", "priority"):
        assert colocate.fixed_share(mode) is None


def test_a_worker_that_hangs_is_given_up_with_its_stacks_and_killed(colocate, monkeypatch, capfd):
    # A run whose worker never finishes must not hang the whole benchmark:
    # the driver asks the worker for its threads' stacks, kills it and says so.
    hang = ("import faulthandler, os, signal, sys, time\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
            "sync_dir, role = sys.argv[1], sys.argv[2]\n"
            "open(os.path.join(sync_dir, role + '.ready'), 'w').close()\n"
            "time.sleep(600)\n")
    started = []

    def command(workload, role, mode, args, gap_s, sync_dir, beside=False):
        started.append(role)
        return [colocate.sys.executable, "-c", hang, sync_dir, role]

    monkeypatch.setattr(colocate, "worker_command", command)
    monkeypatch.setattr(colocate, "WORKER_FINISH_S", 0.5)
    args = colocate.parse_args(["--seconds", "0.1"])
    with pytest.raises(RuntimeError, match="the guaranteed worker of mode naive did not finish"):
        colocate._run(args, "naive", {"guaranteed": "resnet50"}, 0.0)
    assert started == ["guaranteed"]
    assert 'File "<string>", line 5 in <module>' in capfd.readouterr().err  # where it hung: the sleep


def test_a_late_worker_under_auto_mode_has_the_coordinators_view_of_each_job_printed(colocate, monkeypatch, capfd):
    # On an H200 the auto mode's opportunistic worker once sat at share 0 for
    # 180 s and the log held its stacks only: why it was held (its share,
    # the guaranteed job's baseline and slowdown) went with the coordinator.
    # The workers here are simulated jobs that register and never get ready.
    job = os.path.join(os.path.dirname(__file__), "simulated_job.py")

    def command(workload, role, mode, args, gap_s, sync_dir, beside=False):
        return [colocate.sys.executable, job, "--role", role, "--name", role, "--hold-mib", "16",
                "--iteration-us", "5000", "--control", os.path.join(sync_dir, role + ".control")]

    monkeypatch.setattr(colocate, "worker_command", command)
    monkeypatch.setattr(colocate, "WORKER_START_S", 10.0)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [os.path.dirname(__file__)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    args = colocate.parse_args(["--seconds", "0.1"])
    with pytest.raises(RuntimeError, match="the workers of mode cotenant-auto were not ready"):
        colocate._run(args, colocate.AUTO_MODE, {"guaranteed": "resnet50-train",
                                                 "opportunistic": "transformer-train"}, 0.0)
    views = [json.loads(line.split("coordinator's view: ", 1)[1])
             for line in capfd.readouterr().err.splitlines() if "coordinator's view: " in line]
    assert sorted(v["role"] for v in views) == ["guaranteed", "opportunistic"]
    guaranteed = next(v for v in views if v["role"] == "guaranteed")
    assert guaranteed["iteration_count"] > 0 and "baseline_us" in guaranteed and "slowdown" in guaranteed
    assert all(0.0 <= v["share"] <= 1.0 for v in views)


def test_a_run_stopped_part_way_keeps_the_modes_it_measured(colocate, monkeypatch, tmp_path):
    # A device call's time limit once stopped the benchmark in its last
    # runs, and the five modes it had measured were lost with it.
    summary = {"iterations": 10, "throughput": 10.0, "p50_s": 0.1, "p99_s": 0.1, "compute_p50_s": 0.05}
    ran = []

    def fake_run(args, mode, roles, gap_s, extra_env=None):
        ran.append(mode)
        if mode == "priority":
            raise KeyboardInterrupt  # what a kill leaves the driver
        return {role: dict(summary) for role in roles}

    monkeypatch.setattr(colocate, "_run", fake_run)
    monkeypatch.setattr(colocate, "gpu_environment", lambda: {"device": "Test GPU", "torch": "t", "driver": "d",
                                                               "cuda": "c"})
    with pytest.raises(KeyboardInterrupt):
        colocate.main(["--modes", "naive,cotenant-0.5,priority,cotenant-auto", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("colocate-*.json")
    with open(path) as f:
        result = json.load(f)
    assert result["complete"] is False
    assert sorted(result["runs"]) == ["cotenant-0.5", "naive"]
    assert result["figures"]["naive.guaranteed_throughput_ratio"] == 1.0
    assert "cotenant-auto.guaranteed_throughput_ratio" not in result["figures"]


def test_ratios_are_over_the_mean_of_the_solo_runs_before_and_after_the_modes(colocate):
    before = {"guaranteed": {"iterations": 10, "throughput": 10.0, "p50_s": 0.1, "p99_s": 0.2, "compute_p50_s": 0.05},
              "opportunistic": {"iterations": 20, "throughput": 20.0, "p50_s": 0.05, "p99_s": 0.06,
                                "compute_p50_s": 0.05}}
    after = {"guaranteed": {"iterations": 8, "throughput": 8.0, "p50_s": 0.125, "p99_s": 0.3, "compute_p50_s": 0.07},
             "opportunistic": {"iterations": 20, "throughput": 20.0, "p50_s": 0.05, "p99_s": 0.06,
                               "compute_p50_s": 0.05}}
    solo = colocate.bracketed_solo(before, after)
    assert solo["guaranteed"]["throughput"] == pytest.approx(9.0)
    assert solo["guaranteed"]["p99_s"] == pytest.approx(0.25)
    assert solo["guaranteed"]["compute_p50_s"] == pytest.approx(0.06)
    assert solo["guaranteed"]["iterations"] == 18
    assert colocate.solo_drift(before, after) == {"guaranteed_solo_drift": pytest.approx(0.8),
                                                  "opportunistic_solo_drift": pytest.approx(1.0)}
    together = {"guaranteed": {"throughput": 9.0, "p50_s": 0.1, "p99_s": 0.25},
                "opportunistic": {"throughput": 10.0, "p50_s": 0.1, "p99_s": 0.1}}
    figures = colocate.mode_figures(solo, together)
    assert figures["guaranteed_throughput_ratio"] == pytest.approx(1.0)
    assert figures["guaranteed_p99_ratio"] == pytest.approx(1.0)


def _stub_runs(colocate, monkeypatch, solo_throughputs):
    """Stubs the driver's runs: each solo run of a role takes the next of its
    throughputs; together, each role runs at 8 iterations/s."""
    ran = []
    solo_left = {role: list(values) for role, values in solo_throughputs.items()}

    def fake_run(args, mode, roles, gap_s, extra_env=None):
        ran.append((mode, tuple(roles)))
        out = {}
        for role, workload in roles.items():
            if mode == "solo" and workload != "tiny-ops":
                if not solo_left[role]:
                    raise RuntimeError("no GPU left")
                throughput = solo_left[role].pop(0)
            else:
                throughput = 8.0
            out[role] = {"iterations": 10, "throughput": throughput, "p50_s": 1 / throughput,
                         "p99_s": 1 / throughput, "compute_p50_s": 0.5 / throughput}
        return out

    monkeypatch.setattr(colocate, "_run", fake_run)
    monkeypatch.setattr(colocate, "gpu_environment", lambda: {"device": "Test GPU", "torch": "t", "driver": "d",
                                                               "cuda": "c"})
    monkeypatch.setattr(colocate, "_plot", lambda *a, **k: None)
    return ran


def test_the_benchmark_runs_each_job_alone_again_after_the_modes_and_reports_the_drift(colocate, monkeypatch,
                                                                                        tmp_path):
    # The probe, then the two solo runs; after the modes, the two again.
    ran = _stub_runs(colocate, monkeypatch, {"guaranteed": [10.0, 10.0, 6.0], "opportunistic": [16.0, 16.0]})
    assert colocate.main(["--modes", "naive", "--out", str(tmp_path)]) == 0
    modes = [mode for mode, _ in ran]
    assert modes.index("naive") < len(modes) - 1 - modes[::-1].index("solo")  # a solo run after the mode
    (path,) = tmp_path.glob("colocate-*.json")
    with open(path) as f:
        result = json.load(f)
    assert result["complete"] is True
    assert result["solo_runs"]["before"]["guaranteed"]["throughput"] == 10.0
    assert result["solo_runs"]["after"]["guaranteed"]["throughput"] == 6.0
    assert result["solo"]["guaranteed"]["throughput"] == pytest.approx(8.0)
    assert result["figures"]["naive.guaranteed_throughput_ratio"] == pytest.approx(1.0)  # 8 over the mean, not 0.8
    assert result["figures"]["naive.opportunistic_throughput_ratio"] == pytest.approx(0.5)
    assert result["figures"]["guaranteed_solo_drift"] == pytest.approx(0.6)
    assert result["figures"]["opportunistic_solo_drift"] == pytest.approx(1.0)


def test_without_the_second_solo_runs_the_ratios_stay_over_the_first(colocate, monkeypatch, tmp_path):
    # The second solo runs fail (or are turned off): the benchmark still
    # finishes, with the ratios over the first solo runs and no drift.
    _stub_runs(colocate, monkeypatch, {"guaranteed": [10.0, 10.0], "opportunistic": [16.0]})
    assert colocate.main(["--modes", "naive", "--out", str(tmp_path / "failed")]) == 0
    _stub_runs(colocate, monkeypatch, {"guaranteed": [10.0, 10.0], "opportunistic": [16.0]})
    assert colocate.main(["--modes", "naive", "--no-solo-after", "--out", str(tmp_path / "off")]) == 0
    for name in ("failed", "off"):
        (path,) = (tmp_path / name).glob("colocate-*.json")
        with open(path) as f:
            result = json.load(f)
        assert result["complete"] is True
        assert result["figures"]["naive.guaranteed_throughput_ratio"] == pytest.approx(0.8)
        assert "guaranteed_solo_drift" not in result["figures"]
        assert "after" not in result["solo_runs"]
    with open(next((tmp_path / "failed").glob("colocate-*.json"))) as f:
        assert "solo-after" in json.load(f)["skipped"]
