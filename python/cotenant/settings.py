"""The job side's settings: one string, COTENANT_CONF, or one variable each.

    COTENANT_CONF="cap:6GiB,role:opportunistic,name:trainer"

COTENANT_CONF holds `key:value` pairs separated by commas, in the habit of
PYTORCH_ALLOC_CONF (a value may hold ':' but not ','). Every key also has its
own variable (cap: COTENANT_MEMORY_CAP, ...; see SETTINGS). When both give a
key, the variable wins: `cotenant run` writes the variables, so its flags beat
a COTENANT_CONF in the user's environment; a disagreement is logged once.

A malformed string is a SettingsError (a ValueError) that names the key and
the fix. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

__all__ = ["SETTINGS", "SettingsError", "get", "value", "flag", "parse_conf", "check_all", "warn_ignored_pytorch_options",
           "unknown_variables", "warn_unknown_variables", "CONF_VARIABLE"]

CONF_VARIABLE = "COTENANT_CONF"
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off", "")

log = logging.getLogger("cotenant")


class SettingsError(ValueError):
    """A setting that cannot be read; the message names it and says how to write it."""


# ---- how each value is checked (each raises ValueError with a sentence) -----------------


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"{text!r} is not a yes/no value; write 1 or 0")


def _role(text: str):
    from cotenant.api import parse_role

    return parse_role(text)


def _cap(text: str):
    from cotenant.api import to_cap

    return to_cap(text)


def _size(text: str):
    from cotenant.api import parse_persistent_memory

    return parse_persistent_memory(text)


def _host_reserve(text: str):
    from cotenant.api import parse_host_reserve

    return parse_host_reserve(text)


def _host_headroom(text: str):
    from cotenant.api import parse_host_headroom

    return parse_host_headroom(text)


def _device(text: str):
    from cotenant.api import parse_device

    return parse_device(text)


def _share(text: str):
    from cotenant.gate import parse_share

    return parse_share(text)


def _job_name(text: str) -> str:
    from cotenant.coordinator.protocol import job_name_problem

    problem = job_name_problem(text)
    if problem:
        raise ValueError(problem)
    return text


def _whole_number(minimum: int, maximum: int) -> Callable[[str], int]:
    def check(text: str) -> int:
        # ASCII digits only: int() also takes other scripts' digits and
        # underscores ("1_000").
        if re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) is None:
            raise ValueError(f"{text!r} is not a whole number (digits 0-9)")
        value = int(text)
        if value < minimum:
            raise ValueError(f"{value} must be at least {minimum}")
        if value > maximum:
            raise ValueError(f"{value} must be at most {maximum}")
        return value

    return check


# The gate holds k as a size_t; 2**63 - 1 keeps it a number every platform's
# extension takes ("unbounded" in practice).
_MAX_IN_FLIGHT = 2**63 - 1
# The gate holds its window as a signed 64-bit count of nanoseconds.
_MAX_WINDOW_MS = float(2**63 // 10**6)


def _number(minimum: float, maximum: float) -> Callable[[str], float]:
    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not value >= minimum:
            raise ValueError(f"{value} must be at least {minimum}")
        if not value <= maximum:  # also inf
            raise ValueError(f"{value} must be at most {maximum:g}")
        return value

    return check


def _one_of(*words: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in words:
            raise ValueError(f"{text!r} is not one of {', '.join(words)}")
        return text

    return check


def _text(text: str) -> str:
    return text


def _group(text: str) -> int:
    """A group name or number, as its gid."""
    import grp

    name = text.strip()
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        pass
    if name.isdigit():
        return int(name)
    raise ValueError(f"no group named {name!r} on this machine; give an existing group's name or number "
                     "(the same group as the coordinator's --group)")


@dataclass(frozen=True)
class Setting:
    key: str                       # its name in COTENANT_CONF
    variable: str                  # its own environment variable
    read: Callable[[str], object]  # the value, or ValueError saying what is wrong
    example: str                   # a value that reads, for error messages and docs
    meaning: str


SETTINGS = (
    Setting("enable", "COTENANT_ENABLE", _boolean, "1", "enable_from_environment() enables cotenant"),
    Setting("disable", "COTENANT_DISABLE", _boolean, "1", "cotenant stays off; wins over everything"),
    Setting("role", "COTENANT_ROLE", _role, "opportunistic", "guaranteed, opportunistic, or cap_only (no gate)"),
    Setting("cap", "COTENANT_MEMORY_CAP", _cap, "6GiB", "device-memory cap: a size, a fraction (0.5, 50%) or none"),
    Setting("device", "COTENANT_DEVICE", _device, "0", "the CUDA device index"),
    Setting("socket", "COTENANT_SOCKET", _text, "/run/cotenant/coordinator.sock", "the coordinator's socket"),
    Setting("name", "COTENANT_JOB_NAME", _job_name, "trainer", "the job's name in `cotenant status`"),
    Setting("persistent", "COTENANT_PERSISTENT_MEMORY", _size, "10GiB",
            "memory held for the job's whole life, for the coordinator's admission"),
    Setting("host_reserve", "COTENANT_HOST_RESERVE", _host_reserve, "4GiB",
            "host memory pinned at enable and kept, so the first squeeze pins nothing"),
    Setting("host_headroom", "COTENANT_HOST_HEADROOM", _host_headroom, "4GiB",
            "host memory the job never pins into (spills stop there); the coordinator's may be larger"),
    Setting("share", "COTENANT_SHARE", _share, "0.5", "the job's own compute share at start, 0 to 1"),
    Setting("gate_max_in_flight", "COTENANT_GATE_MAX_IN_FLIGHT", _whole_number(1, _MAX_IN_FLIGHT), "2",
            "the launch gate's admitted ops in flight"),
    Setting("gate_window_ms", "COTENANT_GATE_WINDOW_MS", _number(1.0, _MAX_WINDOW_MS), "50",
            "the share's duty-cycle window (ms)"),
    Setting("gpu_segment", "COTENANT_GPU_SEGMENT", _text, "/cotenant-gpu-mine",
            "the per-GPU segment's name (default: from the GPU's UUID)"),
    Setting("gate_group", "COTENANT_GATE_GROUP", _group, "cotenant",
            "a group whose members' jobs share each GPU's gate segment (jobs of several users on one GPU)"),
    Setting("host_pages", "COTENANT_HOST_PAGES", _one_of("pinned", "auto"), "pinned",
            "pinned: the pinned-host fallback even where host VMM exists"),
    Setting("spill_without_cap", "COTENANT_SPILL_WITHOUT_CAP", _boolean, "1",
            "with no cap, a full device spills to the host instead of raising OutOfMemoryError"),
    Setting("keep_host_pages", "COTENANT_KEEP_HOST_PAGES", _boolean, "0",
            "0: host pages go back to the driver as soon as nothing uses them (default 1: kept under a cap)"),
    Setting("allow_uncapped", "COTENANT_ALLOW_UNCAPPED", _boolean, "1",
            "a job `cotenant run` started runs on when cotenant cannot be enabled"),
    Setting("coordinator_user", "COTENANT_COORDINATOR_USER", _text, "cotenant",
            "a service account the job trusts as its coordinator, besides root"),
    Setting("run_dir", "COTENANT_RUN_DIR", _text, "/run/cotenant", "the node's run directory"),
)
_BY_KEY = {s.key: s for s in SETTINGS}


def _setting(key: str) -> Setting:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no setting named {key!r}") from None  # a programming error, not a user's


# ---- COTENANT_CONF ------------------------------------------------------------------------


def _conf_error(problem: str) -> SettingsError:
    return SettingsError(f"{CONF_VARIABLE}: {problem}. Write key:value pairs separated by commas, "
                         f"e.g. {CONF_VARIABLE}=\"cap:6GiB,role:opportunistic\"")


def parse_conf(text: str) -> Dict[str, str]:
    """The key:value pairs of a COTENANT_CONF string, each value checked."""
    pairs: Dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, colon, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not colon:
            hint = f"; write {item.replace('=', ':', 1)}" if "=" in item else ""
            raise _conf_error(f"{item!r} is not key:value{hint}")
        if key not in _BY_KEY:
            near = difflib.get_close_matches(key, _BY_KEY, n=1)
            guess = f" (did you mean {near[0]!r}?)" if near else ""
            raise _conf_error(f"unknown key {key!r}{guess}; the keys are {', '.join(_BY_KEY)}")
        if key in pairs:
            raise _conf_error(f"{key!r} is given twice")
        setting = _BY_KEY[key]
        try:
            setting.read(value)
        except (ValueError, TypeError) as error:
            raise SettingsError(f"{CONF_VARIABLE}: {key}:{value}: {error} (e.g. {key}:{setting.example}, "
                                f"{setting.meaning})") from None
        pairs[key] = value
    return pairs


_warned_conflicts: set = set()


def get(key: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The text of a setting: its own variable when set, else COTENANT_CONF's
    value, else None. Raises SettingsError when either cannot be read."""
    env = os.environ if environ is None else environ
    setting = _setting(key)
    conf = parse_conf(env.get(CONF_VARIABLE, ""))
    own = env.get(setting.variable)
    if own is not None and own.strip() != "":
        own = own.strip()
        try:
            setting.read(own)
        except (ValueError, TypeError) as error:
            raise SettingsError(f"{setting.variable}={own!r}: {error} (e.g. {setting.variable}={setting.example})") \
                from None
        if key in conf and conf[key] != own and (key, own, conf[key]) not in _warned_conflicts:
            _warned_conflicts.add((key, own, conf[key]))
            log.warning("cotenant: %s=%s wins over %s's %s:%s", setting.variable, own, CONF_VARIABLE, key, conf[key])
        return own
    return conf.get(key)


def value(key: str, environ: Optional[Mapping[str, str]] = None, default: object = None) -> object:
    """A setting read into its value (an int, a Cap, ...), or `default` when not given."""
    text = get(key, environ)
    return default if text is None else _setting(key).read(text)


def flag(key: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A yes/no setting (False when not given)."""
    return bool(value(key, environ, False))


def check_all(environ: Optional[Mapping[str, str]] = None) -> None:
    """Reads every setting once: raises SettingsError for the first that cannot be read."""
    for setting in SETTINGS:
        get(setting.key, environ)


def export_for_extension(environ=None) -> None:
    """The C++ side reads COTENANT_HOST_PAGES, COTENANT_SPILL_WITHOUT_CAP and
    COTENANT_KEEP_HOST_PAGES with getenv, and knows "pinned", "1" and "0"
    only: give each its variable in that spelling, whether COTENANT_CONF or
    the variable itself gave it ("yes", "off", " pinned")."""
    env = os.environ if environ is None else environ
    for key in ("host_pages", "spill_without_cap", "keep_host_pages"):
        setting = _BY_KEY[key]
        text = get(key, env)
        if text is not None:
            value = ("1" if _boolean(text) else "0") if setting.read is _boolean else text
            env[setting.variable] = value


def describe() -> List[str]:
    """One line per setting: key, variable, meaning (for docs and --help)."""
    return [f"{s.key:<20} {s.variable:<28} {s.meaning}" for s in SETTINGS]


# ---- variables that are no setting ------------------------------------------------------

# COTENANT_* variables that are no setting of a job: what `cotenant run`, its
# queue and the cluster hand a job besides its settings, and what the build,
# the tests and the benchmarks read. tests/python/test_settings.py checks that
# every COTENANT_ variable the project reads is a setting's or one of these.
HANDED_TO_JOBS = ("COTENANT_JOB_PID", "COTENANT_QUEUE_GPUS", "COTENANT_CLUSTER_JOB")
BUILD_AND_TEST_VARIABLES = (
    "COTENANT_VENV", "COTENANT_SKIP_APT", "COTENANT_BUILD_ROOT", "COTENANT_CMAKE_ARGS", "COTENANT_CMAKE_BUILD_DIR",
    "COTENANT_SANITIZE", "COTENANT_REQUIRE_TORCH_EXTENSION", "COTENANT_TORCH_CMAKE_PREFIX", "COTENANT_TORCH_LIB_DIR",
    "COTENANT_PYTHON_OUTPUT_DIR", "COTENANT_WHEEL", "COTENANT_SDIST", "COTENANT_PYTORCH_REPLAY", "COTENANT_SOAK_S",
    "COTENANT_TIRESIAS_TRACE", "COTENANT_BENCH_OVER_FAKE", "COTENANT_PROPERTY_SEEDS", "COTENANT_DEPS",
)
_warned_unknown: set = set()


def unknown_variables(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The COTENANT_* variables of the environment that cotenant does not
    read (a misspelled COTENANT_MEMORY_CAP would leave the job uncapped), each
    as "VARIABLE (did you mean ...?)" where a setting's variable is close."""
    env = os.environ if environ is None else environ
    known = {s.variable for s in SETTINGS} | {CONF_VARIABLE, *HANDED_TO_JOBS, *BUILD_AND_TEST_VARIABLES}
    found = []
    for variable in sorted(name for name in env if name.startswith("COTENANT_") and name not in known):
        near = difflib.get_close_matches(variable, [s.variable for s in SETTINGS], n=1, cutoff=0.75)
        found.append(f"{variable} (did you mean {near[0]}?)" if near else variable)
    return found


def warn_unknown_variables(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Logs, once per variable and process, the COTENANT_* variables cotenant does not read."""
    unknown = unknown_variables(environ)
    new = [item for item in unknown if item not in _warned_unknown]
    if new:
        _warned_unknown.update(new)
        log.warning("cotenant reads no variable named %s, so it has no effect; the job's settings are %s "
                    "(or their keys in COTENANT_CONF)", ", ".join(new),
                    ", ".join(s.variable for s in SETTINGS))
    return unknown


# ---- PyTorch's allocator settings --------------------------------------------------------

PYTORCH_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# cotenant replaces PyTorch's CUDA caching allocator but not its pinned host
# allocator, so these options keep their meaning.
_STILL_HONOURED = ("pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
                   "pinned_reserve_segment_size_mb", "pinned_use_hip_host_register")
_warned_pytorch = False


def ignored_pytorch_options(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF options that have no
    effect once cotenant is the CUDA allocator, as "VARIABLE: key:value"."""
    env = os.environ if environ is None else environ
    ignored = []
    for variable in PYTORCH_CONF_VARIABLES:
        for item in env.get(variable, "").split(","):
            item = item.strip()
            key = item.partition(":")[0].strip()
            if item and key not in _STILL_HONOURED:
                ignored.append(f"{variable}: {item}")
    return ignored


def warn_ignored_pytorch_options(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Logs, once per process, the PyTorch allocator options cotenant ignores."""
    global _warned_pytorch
    ignored = ignored_pytorch_options(environ)
    if ignored and not _warned_pytorch:
        _warned_pytorch = True
        log.warning("cotenant replaces PyTorch's CUDA caching allocator, so these options have no effect: %s. "
                    "Remove them, and give cotenant's settings in %s (e.g. %s=\"cap:6GiB\")",
                    "; ".join(ignored), CONF_VARIABLE, CONF_VARIABLE)
    return ignored
