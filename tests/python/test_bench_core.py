"""benchmarks/bench_core.py: the project's targets, the verdict per trace, and
the result file's figures (a short run: the pair measurement shrunk)."""

import json
import os

import pytest

from script_loader import load_script

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_core.py")


@pytest.fixture(scope="module")
def bench_core():
    return load_script(PATH)


def test_the_targets_are_the_issues(bench_core):
    assert bench_core.TARGETS == {"fragmentation": 1.05, "maps_per_peak_page": 2.0,
                                  "steady_maps_per_iteration": 0.0, "alloc_free_pair_ns": 300.0}


def figures(fragmentation=1.0, maps_per_peak_page=1.0, steady_maps_per_iteration=0.0, alloc_free_pair_ns=200.0,
            training_loop=True):
    return {"fragmentation": fragmentation, "maps_per_peak_page": maps_per_peak_page,
            "steady_maps_per_iteration": steady_maps_per_iteration, "alloc_free_pair_ns": alloc_free_pair_ns,
            "training_loop": training_loop}


@pytest.mark.parametrize("changed, target, met", [
    ({"fragmentation": 1.05}, "fragmentation", True),
    ({"fragmentation": 1.0501}, "fragmentation", False),
    ({"maps_per_peak_page": 2.0}, "maps_per_peak_page", True),
    ({"maps_per_peak_page": 2.01}, "maps_per_peak_page", False),
    ({"steady_maps_per_iteration": 0.0}, "steady_maps_per_iteration", True),
    ({"steady_maps_per_iteration": 0.125}, "steady_maps_per_iteration", False),
    ({"steady_maps_per_iteration": None}, "steady_maps_per_iteration", None),  # no iteration marks
    ({"steady_maps_per_iteration": 1.75, "training_loop": False}, "steady_maps_per_iteration", None),
    ({"alloc_free_pair_ns": 300.0}, "alloc_free_pair_ns", True),
    ({"alloc_free_pair_ns": 300.5}, "alloc_free_pair_ns", False),
])
def test_each_target_is_an_upper_bound_on_its_figure(bench_core, changed, target, met):
    verdicts = bench_core.trace_targets_met(figures(**changed))
    assert verdicts[target] is met
    assert all(v is True for name, v in verdicts.items() if name != target)


def test_a_trace_without_iteration_marks_does_not_fail_the_steady_state_target(bench_core):
    trace = {"targets_met": bench_core.trace_targets_met(figures(steady_maps_per_iteration=None))}
    assert bench_core.all_met({"alloc_free": {"target_met": True}, "traces": {"t": trace}})
    missed = {"targets_met": bench_core.trace_targets_met(figures(maps_per_peak_page=3.0))}
    assert not bench_core.all_met({"alloc_free": {"target_met": True}, "traces": {"t": trace, "u": missed}})
    assert not bench_core.all_met({"alloc_free": {"target_met": False}, "traces": {"t": trace}})


def test_only_training_loops_answer_to_the_steady_state_target(bench_core):
    serving_figures = figures(steady_maps_per_iteration=1.75, training_loop=False)
    serving = {"training_loop": False, "steady_maps_per_iteration": 1.75,
               "targets_met": bench_core.trace_targets_met(serving_figures)}
    assert bench_core.all_met({"alloc_free": {"target_met": True}, "traces": {"serve": serving}})
    assert bench_core.steady_verdict(serving) == "not a loop (1.75)"
    training = {"training_loop": True, "steady_maps_per_iteration": 1.75,
                "targets_met": bench_core.trace_targets_met(figures(steady_maps_per_iteration=1.75))}
    assert not bench_core.all_met({"alloc_free": {"target_met": True}, "traces": {"train": training}})
    assert bench_core.steady_verdict(training) == "MISSED (1.75)"


def replay_result(bench_core, ns_per_alloc, ns_per_free, **changed):
    result = dict.fromkeys(bench_core.TRACE_FIGURES, 0)
    result.update(figures(), ns_per_alloc=ns_per_alloc, ns_per_free=ns_per_free, **changed)
    return result


def test_a_traces_times_are_its_median_runs(bench_core):
    runs = [replay_result(bench_core, 300.0, 200.0), replay_result(bench_core, 100.0, 90.0),
            replay_result(bench_core, 150.0, 100.0)]
    median = bench_core.median_replay(runs, training_loop=True, timed_pair_ns=[320.0, 150.0, 290.0])
    assert (median["ns_per_alloc"], median["ns_per_free"]) == (150.0, 100.0)
    assert median["per_call_pair_ns_runs"] == [190.0, 250.0, 500.0]
    assert median["pair_ns_runs"] == [150.0, 290.0, 320.0]
    assert median["alloc_free_pair_ns"] == 290.0
    assert median["targets_met"]["alloc_free_pair_ns"] is True  # the slow run alone would miss it
    slow = bench_core.median_replay(runs, training_loop=True, timed_pair_ns=[320.0, 150.0, 310.0])
    assert slow["targets_met"]["alloc_free_pair_ns"] is False  # judged on the run timed as one, not per call


def test_replays_of_a_trace_that_differ_in_more_than_time_are_refused(bench_core):
    runs = [replay_result(bench_core, 100.0, 100.0), replay_result(bench_core, 100.0, 100.0, num_page_maps=3)]
    with pytest.raises(ValueError, match="num_page_maps"):
        bench_core.median_replay(runs, training_loop=True, timed_pair_ns=[200.0, 200.0])


def test_a_short_run_writes_every_figure_and_verdict_per_trace(bench_core, tmp_path, capsys):
    out = tmp_path / "core.json"
    # Two replays of each trace: their figures other than time must agree.
    assert bench_core.main(["--pairs", "200", "--working-set", "16", "--repeats", "2", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["targets"] == bench_core.TARGETS
    assert figures["alloc_free"]["target_met"] in (True, False)
    assert len(figures["traces"]) == len(bench_core.TRACES) >= 3
    for name, trace in figures["traces"].items():
        for key in ("num_page_maps", "num_page_unmaps", "maps_per_peak_page", "steady_maps_per_iteration",
                    "steady_host_touched_bytes_per_iteration"):
            assert key in trace, (name, key)
        assert trace["targets_met"] == bench_core.trace_targets_met(trace)
        assert trace["training_loop"] is (name not in ("gpt_generate.jsonl.gz", "serve_varbatch.jsonl.gz"))
        assert len(trace["pair_ns_runs"]) == len(trace["per_call_pair_ns_runs"]) == 2
        assert trace["alloc_free_pair_ns"] in trace["pair_ns_runs"]
    pair = figures["alloc_free"]
    assert pair["alloc_free_pair_ns"] in pair["pair_ns_runs"] and len(pair["pair_ns_runs"]) == 2
    assert pair["timed_per_call"]["alloc_free_pair_ns"] in pair["timed_per_call"]["pair_ns_runs"]
    assert figures["all_targets_met"] == bench_core.all_met(figures)
    printed = capsys.readouterr().out
    assert "targets met" in printed and "maps/peak page <= 2" in printed
