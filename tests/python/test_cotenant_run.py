"""`cotenant run` fails closed, and only the process it starts is a job."""

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from cotenant import cli, launch
from coordinator_harness import child_env


def run_cli(*args, env_extra=None, timeout=120):
    env = {**child_env(), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "cotenant.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def no_driver_here() -> bool:
    return launch.driver_problem(0) is not None and "no NVIDIA driver" in launch.driver_problem(0)


# ---- fail closed -----------------------------------------------------------------------------


@pytest.mark.skipif(not no_driver_here(), reason="this machine has an NVIDIA driver")
def test_run_without_a_driver_exits_2_naming_the_missing_driver_and_the_way_out():
    out = run_cli("run", "--opportunistic", "--", sys.executable, "-c", "print('the program ran')")
    assert out.returncode == 2
    assert "the program ran" not in out.stdout
    assert "no NVIDIA driver found" in out.stderr and "--allow-uncapped" in out.stderr
    assert "driver version is insufficient" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(not no_driver_here(), reason="this machine has an NVIDIA driver")
def test_allow_uncapped_runs_the_program_without_a_driver_and_says_so():
    out = run_cli("run", "--opportunistic", "--allow-uncapped", "--", sys.executable, "-c", "print('ran')")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ran"
    assert "WITHOUT" in out.stderr and "no NVIDIA driver found" in out.stderr


def test_the_hook_exits_2_when_enabling_fails_in_the_job(monkeypatch):
    # What the job sees when the checks before exec pass but enable() fails
    # (here: the job's own settings are bad): status 2 and the reason.
    env = {**child_env(), "COTENANT_ENABLE": "1", "COTENANT_MEMORY_CAP": "lots",
           "PYTHONPATH": os.path.join(os.path.dirname(cli.__file__), "_autoenable") + os.pathsep
           + child_env()["PYTHONPATH"]}
    script = "import os, subprocess, sys; os.environ['COTENANT_JOB_PID'] = str(os.getpid()); " \
             "os.execv(sys.executable, [sys.executable, '-c', 'print(\"the program ran\")'])"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "the program ran" not in out.stdout
    assert "COTENANT_MEMORY_CAP='lots'" in out.stderr and "--allow-uncapped" in out.stderr


@pytest.mark.parametrize("flags, named", [(["-E"], "-E"), (["-I"], "-I"), (["-S"], "-S"), (["-uE"], "-E"),
                                          (["-X", "dev", "-I"], "-I")])
def test_run_refuses_python_options_that_keep_the_start_up_hook_from_running(flags, named, monkeypatch):
    monkeypatch.setattr(launch, "driver_problem", lambda device: None)  # as on a GPU machine
    problem = launch.preflight([sys.executable, *flags, "train.py"], 0)
    assert problem is not None and named in problem and "start-up hook" in problem


def test_python_options_after_the_script_or_c_are_the_programs():
    for command in (["python", "train.py", "-E"], ["python", "-c", "pass", "-I"], ["python", "-m", "mod", "-S"],
                    ["python3.11", "-u", "-X", "E", "train.py"]):
        assert launch.start_problem(command) is None, command


def test_a_script_whose_shebang_says_python_E_is_refused_and_one_without_options_is_not(tmp_path):
    for line, refused in (("#!/usr/bin/env -S python3 -E", True), (f"#!{sys.executable} -I", True),
                          ("#!/usr/bin/env python3", False)):
        script = tmp_path / "train"
        script.write_text(line + "\nprint('hi')\n")
        script.chmod(0o755)
        problem = launch.start_problem([str(script)])
        assert (problem is not None) == refused, (line, problem)


def test_run_refuses_a_program_that_is_not_python(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\npython train.py\n")
    script.chmod(0o755)
    problem = launch.start_problem([str(script)])
    assert "is not a Python program" in problem and "cotenant.enable()" in problem


def test_run_with_a_python_E_command_exits_2_before_starting_it(monkeypatch, capsys):
    monkeypatch.setattr(launch, "driver_problem", lambda device: None)
    started = []
    monkeypatch.setattr(launch, "exec_job", lambda command, env: started.append(command))
    code = cli.main(["run", "--guaranteed", "--", sys.executable, "-I", "-c", "pass"])
    assert code == 2 and started == []
    err = capsys.readouterr().err
    assert "-I (isolated mode)" in err and "--allow-uncapped" in err


def test_cotenant_disable_in_the_environment_runs_the_program_as_asked(monkeypatch):
    monkeypatch.setenv("COTENANT_DISABLE", "1")
    monkeypatch.setattr(launch, "driver_problem", lambda device: "no NVIDIA driver found")
    started = []
    monkeypatch.setattr(launch, "exec_job", lambda command, env: started.append(command))
    assert cli.main(["run", "--guaranteed", "--", "true"]) == 0
    assert started == [["true"]]


def test_a_program_that_cannot_be_executed_is_named_with_the_way_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "driver_problem", lambda device: None)
    not_executable = tmp_path / "train.py"
    not_executable.write_text("#!/usr/bin/env python3\nprint('ran')\n")
    assert cli.main(["run", "--guaranteed", "--", str(not_executable)]) == 126
    err = capsys.readouterr().err
    assert "coordinator" not in err
    assert str(not_executable) in err and "chmod +x" in err and "python train.py" in err
    no_shebang = tmp_path / "job"
    no_shebang.write_text("print('ran')\n")
    no_shebang.chmod(0o755)
    assert cli.main(["run", "--guaranteed", "--allow-uncapped", "--", str(no_shebang)]) == 126
    err = capsys.readouterr().err
    assert str(no_shebang) in err and "#!" in err


@pytest.mark.parametrize("device, index", [("1", "1"), ("cuda:1", "1"), (" 2 ", "2")])
def test_run_reads_a_device_as_enable_does(device, index, monkeypatch):
    monkeypatch.setattr(launch, "driver_problem", lambda device: None)  # as on a GPU machine
    started = []
    monkeypatch.setattr(launch, "exec_job", lambda command, env: started.append(env))
    cli.main(["run", "--guaranteed", "--allow-uncapped", "--device", device, "--", sys.executable, "-c", "pass"])
    assert [env["COTENANT_DEVICE"] for env in started] == [index]


@pytest.mark.parametrize("device", ["-1", "-3", "cuda", "cpu:0"])
def test_run_refuses_what_names_no_cuda_device_before_starting_the_program(device, monkeypatch, capsys):
    monkeypatch.setattr(launch, "driver_problem", lambda device: None)  # as on a GPU machine
    started = []
    monkeypatch.setattr(launch, "exec_job", lambda command, env: started.append(command))
    with pytest.raises(SystemExit) as exit:
        cli.main(["run", "--guaranteed", "--allow-uncapped", "--device", device, "--", sys.executable, "-c", "pass"])
    assert exit.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert f"--device: {device} is no CUDA device index" in err


def test_run_queue_refuses_cap_only_instead_of_starting_a_gated_job(monkeypatch, capsys):
    # The queue's policy gives every job it admits a role, and the program
    # started with it: a --cap-only job would run gated, as opportunistic or guaranteed.
    from cotenant.coordinator import client

    monkeypatch.setattr(launch, "driver_problem", lambda device: None)
    monkeypatch.setattr(client, "wait_for_admission", lambda *a, **k: {"gpus": [0], "role": k.get("role"),
                                                                        "name": "job"})
    started = []
    monkeypatch.setattr(launch, "exec_job", lambda command, env: started.append(env.get("COTENANT_ROLE")))
    assert cli.main(["run", "--queue", "--cap-only", "--", sys.executable, "-c", "pass"]) == 2
    assert started == []
    err = capsys.readouterr().err
    assert "--cap-only" in err and "--queue" in err and "--guaranteed" in err
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("submit forked a waiter for a --cap-only job"))
    assert cli.main(["submit", "--cap-only", "--", sys.executable, "-c", "pass"]) == 2
    assert "--cap-only" in capsys.readouterr().err


# ---- children of the job are not jobs -----------------------------------------------------------

CHILDREN = textwrap.dedent("""
    import multiprocessing, subprocess, sys
    def work():
        pass
    if __name__ == "__main__":
        subprocess.run([sys.executable, "-c", "print('subprocess ran')"], check=True)
        context = multiprocessing.get_context("spawn")
        p = context.Process(target=work)
        p.start(); p.join()
        print("job ran")
""")


@pytest.mark.skipif(not no_driver_here(), reason="this machine has an NVIDIA driver")
def test_only_the_process_cotenant_run_started_tries_to_enable(tmp_path):
    # Without a GPU, every process that tries to enable says so once; with
    # --allow-uncapped the job says it and runs on. Its children must not try.
    program = tmp_path / "job.py"
    program.write_text(CHILDREN)
    out = run_cli("run", "--opportunistic", "--allow-uncapped", "--", sys.executable, str(program))
    assert out.returncode == 0, out.stderr
    assert "subprocess ran" in out.stdout and "job ran" in out.stdout
    assert out.stderr.count("cotenant: not enabled") == 1, out.stderr


def test_exec_job_marks_the_pid_that_becomes_the_job(monkeypatch):
    seen = {}
    monkeypatch.setattr(os, "execvpe", lambda program, argv, env: seen.update(env=env))
    launch.exec_job(["python", "train.py"], {"A": "1"})
    assert seen["env"]["COTENANT_JOB_PID"] == str(os.getpid()) and seen["env"]["A"] == "1"


def test_enable_from_environment_does_nothing_in_a_child_of_the_job(monkeypatch):
    from cotenant import api

    monkeypatch.setenv("COTENANT_ENABLE", "1")
    monkeypatch.setenv("COTENANT_JOB_PID", str(os.getpid() + 1))
    monkeypatch.setattr(api, "enable", lambda **kwargs: pytest.fail("a child of the job must not enable"))
    assert api.enable_from_environment() is False
    monkeypatch.setenv("COTENANT_JOB_PID", str(os.getpid()))
    monkeypatch.setattr(api, "enable", lambda **kwargs: True)
    assert api.enable_from_environment() is True


def test_the_driver_check_names_a_missing_device(monkeypatch):
    class FakeDriver:
        def cuInit(self, flags):
            return 0

        def cuDeviceGetCount(self, count):
            count._obj.value = 2
            return 0

    monkeypatch.setattr(launch.ctypes, "CDLL", lambda name: FakeDriver())
    assert launch.driver_problem(1) is None
    problem = launch.driver_problem(3)
    assert "CUDA device 3 does not exist" in problem and "2 GPU(s)" in problem


def test_run_help_describes_allow_uncapped():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "--allow-uncapped" in sub.choices["run"].format_help()


# ---- values that start with a minus sign, or are empty ---------------------------------------


NEGATIVE = "a cap cannot be negative"
EMPTY = 'it is empty (write "none" for no cap)'


@pytest.mark.parametrize("args, why", [
    # argparse used to read "-1G" as an unknown option: "expected one argument", or "the following
    # arguments are required: size", with nothing about the sign.
    (["set-cap", "trainer", "-1G"], NEGATIVE),
    (["set-cap", "trainer", "-0.5"], NEGATIVE),
    (["run", "--opportunistic", "--cap", "-1G", "--", "true"], NEGATIVE),
    (["run", "--opportunistic", "--cap=-1G", "--", "true"], NEGATIVE),
    # An unset shell variable (`cotenant set-cap trainer "$CAP"`) used to lift the job's cap bound,
    # and `run --cap ""` to start the job uncapped, without a word.
    (["set-cap", "trainer", ""], EMPTY),
    (["set-cap", "trainer", " "], EMPTY),
    (["run", "--opportunistic", "--cap", "", "--", "true"], EMPTY),
    (["run", "--opportunistic", "--cap=", "--", "true"], EMPTY),
])
def test_a_negative_or_empty_cap_is_refused_saying_which(args, why, capsys):
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert why in err and "required" not in err and "expected one argument" not in err


@pytest.mark.parametrize("interval", ["-1", "0", "nan"])
def test_status_watch_refuses_an_interval_that_is_not_positive(interval, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", "--watch", "--interval", interval])
    assert exited.value.code == 2
    assert f"seconds between refreshes: a number more than 0 (such as 1 or 0.5), not {interval!r}" in \
        capsys.readouterr().err
