"""benchmarks/bench_placement.py: both cores replay every bundled trace on the
same operations, the "after" figures are the replay's own, and bad input
gets a clear error. The before core here is this tree's own (building an
older commit is the script's default, not run by the tests)."""

import json
import os
import subprocess
import sys

import pytest

from script_loader import load_script

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "benchmarks", "bench_placement.py")


@pytest.fixture(scope="module")
def bench_placement():
    return load_script(PATH)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from cotenant import _core

    out = tmp_path_factory.mktemp("placement") / "placement.json"
    run = subprocess.run([sys.executable, PATH, "--before-core", _core.__file__, "--repeats", "1", "--out", str(out)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text()), run.stdout


def deterministic(figures, bench_placement):
    return {key: value for key, value in figures.items() if key not in bench_placement.TIMES}


def test_every_bundled_trace_is_replayed_by_both_cores_uncapped_and_under_half_its_peak(report, bench_placement):
    data, _ = report
    names = [bench_placement.trace_name(path) for path in bench_placement.bundled_traces.every()]
    assert set(names) >= {"gpt_train", "resnet50_train-h100"}  # synthetic and recorded
    assert sorted(data["after"]) == sorted(names) and sorted(data["before"]) == sorted(names)
    for name in names:
        for side in ("before", "after"):
            uncapped, half = data[side][name]["uncapped"], data[side][name]["half_cap"]
            assert half["peak_device_resident_bytes"] < uncapped["peak_device_resident_bytes"], (name, side)
    assert any(data["after"][name]["half_cap"]["spilled_bytes"] > 0 for name in names)


def test_the_same_core_gives_the_same_figures_on_both_sides(report, bench_placement):
    data, _ = report
    for name, after in data["after"].items():
        for run in ("uncapped", "half_cap"):
            assert deterministic(data["before"][name][run], bench_placement) == \
                deterministic(after[run], bench_placement), (name, run)


def test_the_after_figures_are_what_the_replay_itself_reports(report, bench_placement):
    from cotenant.replay import load_trace, replay_trace

    data, _ = report
    for path in bench_placement.bundled_traces.synthetic()[:3]:
        own = replay_trace(load_trace(path))
        after = data["after"][bench_placement.trace_name(path)]["uncapped"]
        for key in ("peak_reserved_bytes", "fragmentation", "num_page_maps", "maps_per_peak_page",
                    "steady_maps_per_iteration"):
            assert after[key] == own[key], (path, key)


def test_the_table_has_a_before_and_after_row_per_trace(report, bench_placement):
    data, stdout = report
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "→" in line]
    names = [bench_placement.trace_name(path) for path in bench_placement.bundled_traces.every()]
    assert [row.split(" | ")[0][2:] for row in rows] == names
    gpt = next(row for row in rows if row.startswith("| gpt_train |"))
    fragmentation = data["after"]["gpt_train"]["uncapped"]["fragmentation"]
    assert f"{fragmentation:.3f} → {fragmentation:.3f}" in gpt


def test_a_before_core_that_is_not_a_module_is_named_with_the_fix(bench_placement, tmp_path):
    not_a_module = tmp_path / "core.txt"
    not_a_module.write_text("")
    with pytest.raises(SystemExit, match="not a Python extension module; pass the _core"):
        bench_placement.load_core(str(not_a_module))


def test_a_commit_the_clone_lacks_is_named_with_the_fix(bench_placement, tmp_path):
    with pytest.raises(SystemExit, match="git archive 0{40} failed .*pass --before-core"):
        bench_placement.build_core("0" * 40, str(tmp_path / "work"))


def clone_has(commit):
    done = subprocess.run(["git", "-C", os.path.join(HERE, "..", ".."), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True, check=False)
    return done.returncode == 0


def test_the_default_before_is_the_old_policy_built_from_its_commit(bench_placement, tmp_path):
    """The README's "before" column, from the build the script makes of d7d7ed6."""
    if not clone_has(bench_placement.BEFORE_COMMIT):
        pytest.skip(f"this clone lacks commit {bench_placement.BEFORE_COMMIT} (a shallow clone): "
                    "the script's default build of the old policy needs the history")
    out = tmp_path / "placement.json"
    run = subprocess.run([sys.executable, PATH, "--repeats", "1", "--out", str(out)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    before = json.loads(out.read_text())["before"]
    # The old policy: low fragmentation bought with page churn, every step.
    gpt = before["gpt_train"]["uncapped"]
    assert round(gpt["fragmentation"], 3) == 1.048
    assert gpt["num_page_maps"] == 1652 and gpt["steady_maps_per_iteration"] == 194.0
    assert before["resnet50_train-h100"]["uncapped"]["steady_maps_per_iteration"] == 312.0


def test_a_build_that_fails_names_the_fix(bench_placement, tmp_path, monkeypatch):
    real_run = subprocess.run

    def cmake_fails(command, *args, **kwargs):
        if command[0] == "cmake":
            raise subprocess.CalledProcessError(1, command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(bench_placement.subprocess, "run", cmake_fails)
    with pytest.raises(SystemExit, match="cmake exited with status 1 .*pass --before-core"):
        bench_placement.build_core("HEAD", str(tmp_path / "work"))
