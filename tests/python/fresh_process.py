"""Runs a test's job in a fresh process and returns the JSON object the job
prints last: the job's code is written to a script file (stack frames name
its lines, and @triton.jit reads a kernel's source from its file), cotenant's
own environment variables (COTENANT_*) are cleared so that the caller's
settings do not leak in, a hang prints every thread's stack before the
timeout (hang_dump), and a failure shows the job's output."""

import json
import os
import subprocess
import sys
import tempfile

from hang_dump import hang_dump


def run_json(code, *, env=None, env_extra=None, launcher=None, directory=None, name="job.py", timeout=300):
    """Runs `code` as `directory`/`name` (a temporary folder by default) with
    `launcher` (default: this Python) under `env` (default: this process's
    environment) with COTENANT_* removed, then `env_extra` set (the job's own
    settings, COTENANT_* included); asserts it exits 0 and returns the JSON
    object of its last line of output."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("COTENANT_")}
    env.update(env_extra or {})
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(directory or scratch, name)
        with open(script, "w") as f:
            f.write(hang_dump(timeout) + code)
        result = subprocess.run([*(launcher or [sys.executable]), script], env=env, capture_output=True, text=True,
                                timeout=timeout, cwd=directory)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])
