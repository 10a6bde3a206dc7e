"""matplotlib and prometheus-client are extras (`cotenant[timeline]`, `cotenant[metrics]`):
nothing imports them until a feature needs them, and a feature whose extra is
missing says which extra to install, without a traceback. Also `cotenant --version`."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import cotenant
from cotenant import cli
from cotenant.coordinator import client
from coordinator_harness import child_env, wait_until

TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                      "traces", "jobs")
EXTRAS = {"matplotlib": "timeline", "prometheus_client": "metrics", "ray": "cluster", "scipy": "cluster"}


@pytest.fixture
def without_extras(tmp_path):
    """An environment for child processes in which matplotlib and prometheus_client
    fail to import as when they are not installed."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for module in EXTRAS:
        (blocked / f"{module}.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {module!r}'!r}, name={module!r})\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocked), env["PYTHONPATH"]])
    return env


def run_cli(env, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "cotenant.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def test_importing_every_module_of_the_package_imports_no_extra_and_no_numpy():
    code = ("import sys, cotenant, cotenant.cli, cotenant.timeline, cotenant.coordinator.daemon; "
            "import cotenant.cluster.scheduler, cotenant.cluster.runtime, cotenant.cluster.allox; "
            "cotenant.cli.build_parser(); "
            "print(sorted(m for m in ('matplotlib', 'prometheus_client', 'numpy', 'ray', 'scipy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, cwd="/",
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_timeline_without_matplotlib_names_the_timeline_extra(without_extras, tmp_path):
    history = tmp_path / "history.jsonl"
    history.write_text(json.dumps({"t": 1.0, "gpu": 0, "job": "a", "role": "guaranteed", "device_bytes": 1,
                                   "host_bytes": 0, "cap": None, "share": 1.0}) + "\n")
    png = tmp_path / "timeline.png"
    out = run_cli(without_extras, "timeline", "--history", str(history), "-o", str(png))
    assert out.returncode == 1
    assert "cotenant timeline needs matplotlib" in out.stderr
    assert "pip install 'cotenant[timeline]'" in out.stderr
    assert "Traceback" not in out.stderr
    assert not png.exists()


def test_coordinator_metrics_port_without_prometheus_client_names_the_metrics_extra(without_extras, tmp_path):
    socket_path = tmp_path / "c.sock"
    out = run_cli(without_extras, "coordinator", "--socket", str(socket_path), "--gpu-memory", "1GiB",
                  "--metrics-port", "65000")
    assert out.returncode == 1
    assert "cotenant coordinator --metrics-port needs prometheus_client" in out.stderr
    assert "pip install 'cotenant[metrics]'" in out.stderr
    assert "Traceback" not in out.stderr
    assert not socket_path.exists()


def test_coordinator_without_metrics_port_serves_without_prometheus_client(without_extras):
    # Unix socket paths are limited to 107 bytes: a short directory.
    directory = tempfile.mkdtemp(prefix="ct-", dir="/tmp")
    socket_path = os.path.join(directory, "c.sock")
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", socket_path, "--gpu-memory", "1GiB"],
        env=without_extras, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        def answers():
            try:
                return client.status(socket_path)
            except (client.CoordinatorUnavailable, OSError):
                return None

        view = wait_until(answers, timeout=10)
        assert view is not None, f"the coordinator did not answer; exit status {coordinator.poll()}"
        assert view["jobs"] == []
    finally:
        coordinator.terminate()
        _, stderr = coordinator.communicate(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)
    assert "prometheus" not in stderr


def test_version_option_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"cotenant {cotenant.__version__}\n"


def test_cluster_commands_without_ray_name_the_cluster_extra(without_extras):
    out = run_cli(without_extras, "cluster", "status")
    assert out.returncode == 1
    assert "cotenant cluster needs ray" in out.stderr and "pip install 'cotenant[cluster]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_simulating_a_heterogeneous_cluster_without_scipy_names_the_cluster_extra(without_extras):
    out = run_cli(without_extras, "simulate", "--trace", os.path.join(TRACES, "tiresias_60_job.csv"), "--nodes", "2",
                  "--gpus", "4", "--slow-nodes", "1", "--placement", "allox", "--policy", "fifo")
    assert out.returncode == 1
    assert "needs scipy" in out.stderr and "pip install 'cotenant[cluster]'" in out.stderr
    assert "Traceback" not in out.stderr
