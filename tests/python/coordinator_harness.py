"""Starts coordinators and simulated jobs as real processes for the coordinator tests."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import cotenant
from cotenant.coordinator import client, paths

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def child_env():
    # Simulated jobs and CLI children start with none of the test run's own
    # cotenant settings: each test sets what it means to.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTENANT_")}
    roots = [os.path.dirname(p) for p in cotenant.__path__]
    env["PYTHONPATH"] = os.pathsep.join(roots + [HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# Runs `python -c CODE` as the process `cotenant run` marks as the job (its pid
# in COTENANT_JOB_PID, then exec: same pid), for tests of the start-up hook.
AS_JOB = [sys.executable, "-c", "import os, sys; os.environ['COTENANT_JOB_PID'] = str(os.getpid()); "
          "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"]


def wait_until(predicate, timeout=5.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval)


def read_json(path):
    """The JSON object in the file at `path`, or None while it is missing or half written."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Node:
    """One coordinator socket path with its coordinator process and jobs; cleans up everything."""

    def __init__(self, gpu_memory="1GiB", headroom="128MiB", host_headroom="0", extra_args=()):
        """host_headroom: the node's host memory no squeeze may pin; 0 by default, so that what
        this machine has available does not change what a test sees."""
        # Unix socket paths are limited to 107 bytes: keep the directory short.
        self.directory = tempfile.mkdtemp(prefix="ct-", dir="/tmp")
        os.chmod(self.directory, 0o755)
        self.socket = os.path.join(self.directory, "c.sock")
        self.args = ["--gpu-memory", gpu_memory, "--headroom", headroom, "--memory-host-headroom", host_headroom,
                     *extra_args]
        self.coordinator = None
        self.coordinators = []  # every one started: close() stops those a test replaced too
        self.jobs = []
        self.log = open(os.path.join(self.directory, "coordinator.log"), "ab")

    def start_coordinator(self, wait=True, prefix=(), env=None):
        """prefix: a command the coordinator runs under (setpriv, unshare, ...);
        env: variables added to its environment."""
        self.coordinator = subprocess.Popen(
            [*prefix, sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", self.socket, *self.args],
            env={**child_env(), **(env or {})}, stdout=self.log, stderr=self.log,
        )
        self.coordinators.append(self.coordinator)
        if wait:
            assert wait_until(self.answers, timeout=10), "the coordinator did not start: " + self.read_log()
        return self.coordinator

    def answers(self):
        try:
            return client.status(self.socket)
        except (client.CoordinatorUnavailable, OSError):
            return None

    def kill_coordinator(self):
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait()

    def start_job(self, role, name, hold_mib=64, iteration_us=10000, persistent_mib=0, expect_registration=True,
                  prefix=(), python=None, code_dir=None, env=None, socket=...):
        job = self.spawn_job(role, name, hold_mib, iteration_us, persistent_mib, prefix, python, code_dir, env, socket)
        job.wait_started()
        if expect_registration:
            assert job.registration, f"job {name} did not register: {job.info} {self.read_log()}"
        return job

    def spawn_job(self, role, name, hold_mib=64, iteration_us=10000, persistent_mib=0, prefix=(), python=None,
                  code_dir=None, env=None, socket=...):
        """Starts a job without waiting for its registration. code_dir: a directory holding the
        cotenant package and simulated_job.py to run from instead of this checkout (see
        readable_code_copy()); env: variables added to its environment; socket: None to let
        the job find the coordinator on the default path."""
        control = os.path.join(self.directory, name)
        env = {**child_env(), **(env or {})}
        if code_dir:
            env["PYTHONPATH"] = code_dir
        socket = self.socket if socket is ... else socket
        process = subprocess.Popen(
            [*prefix, python or sys.executable, os.path.join(code_dir or HERE, "simulated_job.py"),
             *(["--socket", socket] if socket else []),
             "--role", role, "--name", name, "--hold-mib", str(hold_mib), "--iteration-us", str(iteration_us),
             "--persistent-mib", str(persistent_mib), "--control", control],
            env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        job = SimulatedJob(process, control, {})
        self.jobs.append(job)
        return job

    def status(self):
        return client.status(self.socket)

    def job(self, name):
        for job in self.status()["jobs"]:
            if job["name"] == name:
                return job
        return None

    def read_log(self):
        self.log.flush()
        with open(os.path.join(self.directory, "coordinator.log"), "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def blocks(self):
        prefix = paths.job_block_prefix(self.socket)
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))

    def close(self):
        for job in self.jobs:
            job.kill()
        for coordinator in self.coordinators:
            if coordinator.poll() is None:
                coordinator.send_signal(signal.SIGKILL)
                coordinator.wait()
        for name in self.blocks():
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class SimulatedJob:
    def __init__(self, process, control, info):
        self.process = process
        self.control = control
        self.info = info

    def wait_started(self):
        """Reads the job's first line: its registration, or none (it then exits, running on its own)."""
        line = self.process.stdout.readline()
        self.info = json.loads(line) if line else {"registration": None, "exit": self.process.wait()}
        return self.info

    @property
    def pid(self):
        return self.process.pid

    @property
    def registration(self):
        return self.info.get("registration")

    def burst(self, mib):
        with open(self.control + ".burst.tmp", "w") as f:
            f.write(str(mib))
        os.replace(self.control + ".burst.tmp", self.control + ".burst")

    def set_iteration_us(self, us):
        with open(self.control + ".iter_us.tmp", "w") as f:
            f.write(str(us))
        os.replace(self.control + ".iter_us.tmp", self.control + ".iter_us")

    def alive(self):
        return self.process.poll() is None

    def kill(self, reap=True):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            if reap:
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()


def connect_raw(socket_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(socket_path)
    return sock


def readable_code_copy():
    """A world-readable copy of the cotenant package (sources and compiled modules,
    wherever they are installed), of prometheus_client (for a coordinator) and of
    simulated_job.py, for a job or coordinator run as another uid, which may not be
    able to read this checkout or the installed packages (e.g. under a home directory
    of mode 0700). The caller removes it."""
    import prometheus_client

    root = tempfile.mkdtemp(prefix="cotenant-code-")
    package = os.path.join(root, "cotenant")
    # Sources and a build tree's compiled modules are merged; the first part
    # (the one Python imports from) wins where both have a file.
    for part in reversed(cotenant.__path__):
        shutil.copytree(part, package, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.dirname(prometheus_client.__file__), os.path.join(root, "prometheus_client"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(HERE, "simulated_job.py"), root)
    for directory, subdirectories, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return root


def cap_a_job_through_the_coordinator(job_code, cap, env, name="capjob", wait_for_ready=False):
    """Starts a coordinator and `cotenant run --opportunistic --name NAME --
    python -c JOB_CODE` with `env`, sets the job's cap to `cap` through the
    coordinator once the job has registered (and, with `wait_for_ready`, once
    the job has created the file its CAPJOB_READY variable names), and returns
    the JSON object the job prints last. Both processes are stopped at the
    end. Neither keeps a host headroom: what the test runs beside (a build,
    other tests) must not decide whether the squeeze may pin."""
    env = {**env, "COTENANT_HOST_HEADROOM": "0"}
    directory = tempfile.mkdtemp(prefix="ctc-", dir="/tmp")  # Unix socket paths are short
    sock = os.path.join(directory, "c.sock")
    ready = os.path.join(directory, "ready")
    env["CAPJOB_READY"] = ready
    coordinator = subprocess.Popen([sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", sock,
                                    "--gpus", "0", "--memory-host-headroom", "0"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    job = None
    try:
        deadline = time.time() + 30
        while not os.path.exists(sock) and time.time() < deadline:
            time.sleep(0.05)
        job = subprocess.Popen([sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", "--name", name,
                                "--socket", sock, "--", sys.executable, "-c", job_code],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while time.time() < deadline and job.poll() is None:
            if any(j.get("name") == name for j in client.status(sock).get("jobs", [])):
                break
            time.sleep(0.1)
        while wait_for_ready and time.time() < deadline and job.poll() is None and not os.path.exists(ready):
            time.sleep(0.05)
        client.set_cap(name, cap, socket=sock)
        out, err = job.communicate(timeout=180)
        assert job.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])
    finally:
        for process in (job, coordinator):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def guaranteed_and_opportunistic(worker_code, env, directory):
    """A coordinator and two jobs `cotenant run` starts on GPU 0: `python -c
    WORKER_CODE PROGRESS_PATH`, one --guaranteed (named "guaranteed"), one
    --opportunistic (named "opportunistic"). Yields (socket, {role: progress
    path}); stops them all at the end."""
    sock_dir = tempfile.mkdtemp(prefix="ctp-", dir="/tmp")  # Unix socket paths are short
    sock = os.path.join(sock_dir, "c.sock")
    coordinator = subprocess.Popen([sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", sock,
                                    "--gpus", "0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    jobs = []
    try:
        wait_until(lambda: os.path.exists(sock), timeout=30)
        progress = {role: os.path.join(str(directory), f"{role}.json") for role in ("guaranteed", "opportunistic")}
        for role, path in progress.items():
            jobs.append(subprocess.Popen([sys.executable, "-m", "cotenant.cli", "run", f"--{role}", "--name", role,
                                          "--socket", sock, "--", sys.executable, "-c", worker_code, path], env=env))
        yield sock, progress
    finally:
        for process in (*jobs, coordinator):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


def check_the_share_pauses_and_resumes(sock, paths, start_timeout, settle_s, pause_s):
    """With the jobs of guaranteed_and_opportunistic() running and writing
    progress files ({"steps": N, "gate": cotenant.gate.stats(), ...}): both
    make progress; a share of 0 set through the coordinator stops the
    opportunistic job once it has applied it (after `settle_s` for admitted
    ops, no more than 5 steps over `pause_s`) while the guaranteed one goes
    on; a share of 1 resumes it. Returns the last progress of (guaranteed, opportunistic)."""
    guaranteed = wait_until(lambda: read_json(paths["guaranteed"]), timeout=start_timeout)
    assert guaranteed, "the guaranteed job made no progress"
    assert guaranteed["gate"]["role"] == "guaranteed" and guaranteed["gate"]["iteration_count"] > 0
    first = wait_until(lambda: read_json(paths["opportunistic"]), timeout=start_timeout)
    assert first, "the opportunistic job made no progress"
    moving = wait_until(lambda: (read_json(paths["opportunistic"]) or {}).get("steps", 0) > first["steps"],
                        timeout=30)
    assert moving, "the opportunistic job stopped before it was paused"

    def progress(role):  # the file is replaced whole, but may be missing for an instant
        return wait_until(lambda: read_json(paths[role]), timeout=10)

    def steps(role):
        return progress(role)["steps"]

    def opportunistic_job():  # as the coordinator sees it
        jobs = [j for j in client.status(sock)["jobs"] if j["name"] == "opportunistic"]
        return jobs[0] if jobs else None

    def applied_share():
        job = opportunistic_job()
        return job.get("applied_share") if job else None

    client.set_share("opportunistic", 0, socket=sock)
    # Once the job has applied it (a loaded machine may take a while to get there), ops already
    # admitted finish within settle_s; then it stays still.
    assert wait_until(lambda: applied_share() == 0, timeout=30), "the job never applied share 0"
    time.sleep(settle_s)
    before = progress("opportunistic")
    paused_at = before["steps"]
    time.sleep(pause_s)
    after = progress("opportunistic")
    # Its gate's counters before and after, and the coordinator's view, say which door let the steps through.
    assert after["steps"] <= paused_at + 5, ("share 0 did not pause the job", before["gate"], after["gate"],
                                             opportunistic_job())
    guaranteed_before = steps("guaranteed")
    assert wait_until(lambda: steps("guaranteed") > guaranteed_before, timeout=30), \
        "the guaranteed job stalled"

    client.set_share("opportunistic", 1, socket=sock)
    resumed = wait_until(lambda: steps("opportunistic") > paused_at + 10, timeout=30)
    assert resumed, "raising the share did not resume the job"
    opportunistic = read_json(paths["opportunistic"])
    assert opportunistic["gate"]["role"] == "opportunistic"
    assert opportunistic["gate"]["admitted_ops"] > 0 and opportunistic["gate"]["waits_paused"] > 0
    return read_json(paths["guaranteed"]), opportunistic
