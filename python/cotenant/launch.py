"""How `cotenant run` starts a job, and why it refuses to start one uncapped.

`cotenant run` replaces itself with the program (same pid), after writing the
job's settings into the environment and putting the start-up hook
(_autoenable/sitecustomize.py) first on PYTHONPATH. The hook enables cotenant
in the one process whose pid is COTENANT_JOB_PID: the program `cotenant run`
started. Its children (DataLoader workers, torch.compile's compile workers,
any subprocess) inherit the environment but are not jobs.

It fails closed: a job the user asked to be capped must not run uncapped
without saying so. Before starting the program, `cotenant run` checks what
it can (an NVIDIA driver and GPU; a Python program whose start-up hook can
run); in the program, the hook exits with status 2 when enabling fails.
`--allow-uncapped` (COTENANT_ALLOW_UNCAPPED=1) runs the program anyway, with
a warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shlex
import shutil
import sys
from typing import Dict, List, Optional, Sequence

EXIT_NOT_ENABLED = 2
ALLOW_HINT = "give --allow-uncapped to run it without cotenant"
log = logging.getLogger("cotenant")


# ---- the driver and the GPU ------------------------------------------------------------


def driver_problem(device: int = 0) -> Optional[str]:
    """Why cotenant cannot manage CUDA device `device` here, or None when a driver
    sees it. Asks the driver (libcuda) directly, without torch: the CUDA runtime
    reports a missing driver as "CUDA driver version is insufficient"."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ("no NVIDIA driver found (libcuda.so.1 cannot be loaded): this machine has no NVIDIA GPU driver "
                "installed, or it is not visible in this container")
    status = cuda.cuInit(0)
    if status != 0:
        return f"the NVIDIA driver did not start ({_driver_error(cuda, status)}); nvidia-smi shows what is wrong"
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        return f"the NVIDIA driver cannot count its GPUs ({_driver_error(cuda, status)})"
    if count.value == 0:
        return "no NVIDIA GPU found: the driver sees none (check CUDA_VISIBLE_DEVICES and nvidia-smi)"
    if device >= count.value:
        return (f"CUDA device {device} does not exist: the driver sees {count.value} GPU(s), numbered from 0 "
                "(check --device and CUDA_VISIBLE_DEVICES)")
    return None


def _driver_error(cuda, status: int) -> str:
    name = ctypes.c_char_p()
    try:
        if cuda.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except AttributeError:
        pass
    return f"CUresult {status}"


# ---- can the start-up hook run in the program? -----------------------------------------

_PYTHON_NAME = re.compile(r"^(python|pypy)[0-9.]*(-dbg)?$")
# Python options that keep sitecustomize from running: -E (PYTHON* variables
# ignored, so PYTHONPATH too), -I (isolated: implies -E and -s), -S (no site).
_HOOK_BLOCKERS = {"E": "-E ignores PYTHONPATH", "I": "-I (isolated mode) ignores PYTHONPATH",
                  "S": "-S skips the site module, which runs the hook"}
# Options that take a value as the next word; anything after -c/-m or the script is the program's.
_WITH_VALUE = set("WX")


def interpreter_of(command: Sequence[str]) -> Optional[List[str]]:
    """The Python interpreter and its options that `command` starts, or None
    when it does not start Python (directly, or through a #! line)."""
    program = command[0]
    if _PYTHON_NAME.match(os.path.basename(program)):
        return list(command)
    path = program if os.sep in program else shutil.which(program)
    if path is None:
        return None
    shebang = _shebang(path)
    if not shebang:
        return None
    if os.path.basename(shebang[0]) == "env":
        shebang = shebang[1:]
        if shebang and shebang[0] == "-S":  # env -S splits its argument into words
            shebang = shlex.split(" ".join(shebang[1:]))
        while shebang and (shebang[0].startswith("-") or "=" in shebang[0]):
            shebang = shebang[1:]
    if shebang and _PYTHON_NAME.match(os.path.basename(shebang[0])):
        return shebang + list(command[1:])
    return None


def _shebang(path: str) -> List[str]:
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    return first[2:].decode("utf-8", "replace").split()


def hook_blocker(interpreter: Sequence[str]) -> Optional[str]:
    """The option among the interpreter's that keeps the start-up hook from running."""
    words = list(interpreter[1:])
    while words:
        word = words.pop(0)
        if word == "--" or not word.startswith("-") or word == "-":
            return None  # the script: what follows is the program's
        if word.startswith("--"):
            continue
        letters = word[1:]
        for i, letter in enumerate(letters):
            if letter in _HOOK_BLOCKERS:
                return f"{_HOOK_BLOCKERS[letter]}"
            if letter in "cm":
                return None  # -c CODE / -m MODULE: the rest is the program's
            if letter in _WITH_VALUE:
                if i == len(letters) - 1 and words:
                    words.pop(0)
                break
    return None


def start_problem(command: Sequence[str]) -> Optional[str]:
    """Why cotenant's start-up hook cannot enable cotenant in `command`, or None."""
    interpreter = interpreter_of(command)
    if interpreter is None:
        return (f"{command[0]!r} is not a Python program, and `cotenant run` enables cotenant in the Python process "
                "it starts; run the Python program itself (`cotenant run ... -- python train.py`) or call "
                "cotenant.enable() in it")
    blocker = hook_blocker(interpreter)
    if blocker:
        return (f"Python's {blocker}, so cotenant's start-up hook cannot run; drop that option, or call "
                "cotenant.enable() at the top of the script")
    return None


def preflight(command: Sequence[str], device: int) -> Optional[str]:
    """What keeps `cotenant run` from enabling cotenant in `command` on `device`, or None."""
    return driver_problem(device) or start_problem(command)


# ---- starting the program ----------------------------------------------------------------


def exec_job(command: Sequence[str], env: Dict[str, str]) -> None:
    """Replaces this process with the job (same pid, which the coordinator sees)
    and marks it as the job: its children are not. Returns only on failure."""
    from cotenant.api import JOB_PID_VARIABLE

    env = dict(env)
    env[JOB_PID_VARIABLE] = str(os.getpid())
    os.execvpe(command[0], list(command), env)


# ---- in the program: the start-up hook ----------------------------------------------------


def enable_in_job() -> None:
    """Run by the start-up hook in the program `cotenant run` started: enables
    cotenant, or exits with status 2 saying why it could not (unless
    allow_uncapped)."""
    from cotenant import settings
    from cotenant.api import enable_from_environment, is_child_of_a_job

    if is_child_of_a_job():
        return
    try:
        enable_from_environment()
    except Exception as error:  # any failure: the job must not run uncapped unnoticed
        try:
            allowed = settings.flag("allow_uncapped")
        except ValueError:
            allowed = False
        fail_closed(str(error) or type(error).__name__, allowed)


def fail_closed(reason: str, allowed: bool) -> None:
    """Says why cotenant is not enabled; exits with status 2 unless allowed."""
    if allowed:
        log.warning("cotenant: not enabled, the program runs WITHOUT a cap or gate (--allow-uncapped): %s", reason)
        return
    log.error("cotenant run: cannot enable cotenant in this program: %s. Nothing ran; %s.", reason, ALLOW_HINT)
    for handler in logging.getLogger().handlers + [logging.lastResort]:
        if handler is not None:
            handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_NOT_ENABLED)
