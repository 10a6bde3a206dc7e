"""benchmarks/record_snapshots.py without a GPU: its arguments, the clear
error where there is no CUDA, the workers' environment (cotenant off), and
one training step of each workload on the CPU at a small size."""

import os
import py_compile
import subprocess
import sys

import pytest

from script_loader import load_script

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "record_snapshots.py")


@pytest.fixture(scope="module")
def record_snapshots():
    return load_script(PATH)


def test_the_script_compiles():
    py_compile.compile(PATH, doraise=True)


def test_defaults_record_both_workloads_within_a_minute(record_snapshots):
    args = record_snapshots.parse_args(["--out", "snapshots"])
    assert args.workloads == ["gpt_train_varlen", "resnet50_train"]
    assert (args.steps, args.seconds, args.max_entries) == (30, 60.0, 200_000)
    assert not args.expandable_segments and args.worker is None


def test_workloads_are_a_comma_separated_list(record_snapshots):
    args = record_snapshots.parse_args(["--out", "d", "--workloads", " resnet50_train ,", "--seconds", "20"])
    assert args.workloads == ["resnet50_train"] and args.seconds == 20.0


@pytest.mark.parametrize("argv, problem", [
    ([], "--out"),
    (["--out", "d", "--seconds", "0"], "more than 0"),
    (["--out", "d", "--steps", "-3"], "more than 0"),
    (["--out", "d", "--max-entries", "0"], "more than 0"),
    (["--out", "d", "--workloads", "bert_train"], "unknown workload bert_train"),
    (["--out", "d", "--workloads", ","], "(none given)"),
])
def test_bad_arguments_are_refused(record_snapshots, capsys, argv, problem):
    with pytest.raises(SystemExit) as exit_:
        record_snapshots.parse_args(argv)
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err


def test_snapshot_files_are_named_by_workload_and_allocator_mode(record_snapshots):
    path = record_snapshots.snapshot_path
    assert path("out", "resnet50_train", False) == os.path.join("out", "resnet50_train.pickle")
    assert path("out", "gpt_train_varlen", True) == os.path.join("out", "gpt_train_varlen-expandable.pickle")


def test_workers_run_with_cotenant_off_and_keep_the_users_allocator_settings(record_snapshots, monkeypatch):
    monkeypatch.setenv("COTENANT_ENABLE", "1")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    plain = record_snapshots.worker_environment(expandable_segments=False)
    assert plain["COTENANT_DISABLE"] == "1" and "COTENANT_ENABLE" not in plain
    assert plain["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:False"
    expandable = record_snapshots.worker_environment(expandable_segments=True)
    assert expandable["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"


@pytest.mark.parametrize("worker", [[], ["--worker", "resnet50_train"]], ids=["all", "one-worker"])
def test_without_cuda_it_says_so_and_exits_2(tmp_path, worker):
    out = tmp_path / "snapshots"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine that has one
    done = subprocess.run([sys.executable, PATH, "--out", str(out), *worker], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2
    assert "record_snapshots.py: error: no CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("name, small", [("gpt_train_varlen", {"batch": 1, "longest": 64}),
                                         ("resnet50_train", {"batch": 2, "image": 32})])
def test_each_workload_trains_a_step_on_the_cpu(record_snapshots, name, small):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model, step = record_snapshots.WORKLOADS[name](torch, "cpu", **small)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
