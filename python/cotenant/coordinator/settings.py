"""The coordinator's policy settings: defaults, a TOML file, flags.

    cotenant coordinator --config /etc/cotenant/coordinator.toml --share-increase-step 0.1

Each setting has one row in SETTINGS: its place in the file (`[share]
increase_step = 0.1`), its flag (`--share-increase-step`), how its value is
read and checked, and where it lands in CoordinatorConfig. A flag wins over
the file, the file over the default. Bad values are SettingsError (a
ValueError) naming the setting, the value and what would do.

The file's tables mirror the rows; `cotenant coordinator --print-config`
writes every setting with its value, a file to start from.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from cotenant.coordinator import policy

__all__ = ["SETTINGS", "SettingsError", "add_arguments", "load_file", "apply", "format_toml"]


class SettingsError(ValueError):
    """A coordinator setting that cannot be used; the message names it and says what would do."""


# ---- readers: value (from TOML or a flag's text) -> checked value, or ValueError ------------


def _size(value: Any) -> int:
    from cotenant._core import Error, parse_size

    if isinstance(value, bool):
        raise ValueError("give a size such as \"512MiB\"")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value >= 2**64:
            raise ValueError("a size is at most 2**64-1 bytes; give one such as \"512MiB\"")
        return value
    if not isinstance(value, str):
        raise ValueError("give a size such as \"512MiB\"")
    try:
        return parse_size(value)
    except (Error, ValueError) as error:
        raise ValueError(str(error)) from None


def _number(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Callable[[Any], float]:
    def read(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError("give a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError("give a number") from None
        too_low = number <= low if low_open else number < low
        too_high = number >= high if high_open else number > high
        if too_low or too_high or number != number:
            lo = f"{'above' if low_open else 'at least'} {low:g}"
            hi = "" if high == float("inf") else f" and {'below' if high_open else 'at most'} {high:g}"
            raise ValueError(f"give a number {lo}{hi}")
        return number

    return read


def _whole(low: int) -> Callable[[Any], int]:
    def read(value: Any) -> int:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError(f"give a whole number of at least {low}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"give a whole number of at least {low}") from None
        if number < low:
            raise ValueError(f"give a whole number of at least {low}")
        return number

    return read


_POSITIVE_SECONDS = _number(0.0, float("inf"), low_open=True)


def _absolute_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError("give an absolute path such as \"/sys/fs/cgroup\"")
    return value


@dataclass(frozen=True)
class Setting:
    table: str                  # the TOML table
    name: str                   # the key in it
    target: Tuple[str, ...]     # the field in CoordinatorConfig (a path through the policy configs)
    read: Callable[[Any], Any]
    meaning: str

    @property
    def flag(self) -> str:
        return "--" + f"{self.table}-{self.name}".replace("_", "-")

    @property
    def dest(self) -> str:
        return f"setting_{self.table}_{self.name}"

    @property
    def where(self) -> str:
        return f"[{self.table}] {self.name}"


SETTINGS = (
    Setting("memory", "headroom", ("memory", "headroom_bytes"), _size, "device memory kept free on every GPU"),
    Setting("memory", "burst_margin", ("memory", "burst_margin_bytes"), _size,
            "room above what an opportunistic job holds before its cap binds"),
    Setting("memory", "min_cap", ("memory", "min_cap_bytes"), _size, "the lowest cap the policy sets"),
    Setting("memory", "host_headroom", ("memory", "host_headroom_bytes"), _size,
            "host memory kept available on the node: no squeeze pins it (the cap stays higher instead)"),
    Setting("memory", "cgroup_root", ("cgroup_root",), _absolute_path,
            "where the node's cgroup filesystem is mounted, to read the memory limits the jobs share "
            "(a coordinator in a container: mount the node's there)"),
    Setting("share", "target_slowdown", ("share", "target_slowdown"), _number(1.0, float("inf"), low_open=True),
            "the guaranteed job's iteration time over its solo baseline that the policy keeps under"),
    Setting("share", "increase_step", ("share", "increase_step"), _number(0.0, 1.0, low_open=True),
            "AIMD: the share added per decision while under the target"),
    Setting("share", "decrease_factor", ("share", "decrease_factor"), _number(0.0, 1.0, high_open=True),
            "AIMD: the share is multiplied by this when over the target"),
    Setting("share", "min_share", ("share", "min_share"), _number(0.0, 1.0),
            "the least share an opportunistic job keeps (0: it may pause)"),
    Setting("share", "pause_below", ("share", "pause_below"), _number(0.0, 1.0),
            "AIMD: a decrease that lands under this share pauses the job (min_share if higher)"),
    Setting("share", "tolerance", ("share", "tolerance"), _number(0.0, float("inf")),
            "a band under the target where the share holds"),
    Setting("share", "interval_s", ("share_interval_s",), _POSITIVE_SECONDS, "seconds between share decisions"),
    Setting("baseline", "skip_iterations", ("baseline", "skip_iterations"), _whole(0),
            "first iterations of a guaranteed job left out of its solo baseline"),
    Setting("baseline", "window_iterations", ("baseline", "window_iterations"), _whole(1),
            "iterations averaged into the solo baseline"),
    Setting("baseline", "timeout_s", ("baseline_timeout_s",), _POSITIVE_SECONDS,
            "seconds a guaranteed job measuring its baseline may go without an iteration before shares are "
            "decided without it"),
    Setting("jobs", "tick_s", ("tick_s",), _POSITIVE_SECONDS, "seconds between reads of the jobs' reports"),
    Setting("jobs", "stale_heartbeat_s", ("stale_heartbeat_s",), _POSITIVE_SECONDS,
            "a job silent this long is checked for death"),
    Setting("jobs", "attach_timeout_s", ("attach_timeout_s",), _POSITIVE_SECONDS,
            "a registered job must attach to its block within this"),
    Setting("jobs", "on_their_own_after_s", ("on_their_own_after_s",), _number(0.0, float("inf")),
            "a job that hears nothing from the coordinator this long runs on its own (a suspended or paused job "
            "resumes) until the coordinator is back; 0: it waits for good"),
    Setting("jobs", "max_per_uid", ("max_jobs_per_uid",), _whole(1),
            "registered jobs one user may hold, and as many queued tickets; more are refused"),
    Setting("history", "interval_s", ("history_interval_s",), _POSITIVE_SECONDS, "seconds between history samples"),
    Setting("history", "max_size", ("history_max_bytes",), _size, "the history file rotates beyond this size"),
    Setting("connections", "idle_timeout_s", ("idle_timeout_s",), _POSITIVE_SECONDS,
            "a silent connection (socket or metrics) is closed after this"),
    Setting("connections", "max_per_uid", ("max_connections_per_uid",), _whole(1),
            "open connections one user may hold; more are refused as busy"),
)
_BY_PLACE = {(s.table, s.name): s for s in SETTINGS}


def _default(setting: Setting, config: Any) -> Any:
    value = config
    for part in setting.target:
        value = getattr(value, part)
    return value


def _checked(setting: Setting, value: Any, source: str) -> Any:
    try:
        return setting.read(value)
    except ValueError as error:
        raise SettingsError(f"{source}: {value!r} is not a valid {setting.where} ({setting.meaning}): {error}") \
            from None


# ---- flags ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE, --print-config, and one flag per setting (default: the file's, else the built-in)."""
    from cotenant.coordinator.daemon import CoordinatorConfig

    defaults = CoordinatorConfig(socket_path="")
    parser.add_argument("--config", metavar="FILE",
                        help="a TOML file of policy settings (see --print-config); flags win over it")
    parser.add_argument("--print-config", action="store_true",
                        help="print every policy setting in force as a TOML file, and exit")
    group = parser.add_argument_group("policy settings (also in the --config file)")
    for setting in SETTINGS:
        default = _default(setting, defaults)
        shown = _show(setting, default)
        group.add_argument(setting.flag, dest=setting.dest, metavar="VALUE",
                           help=f"{setting.meaning} (default {shown})")
    # Shorter spellings of four settings.
    parser.add_argument("--headroom", dest="setting_memory_headroom", metavar="SIZE",
                        help="the same as --memory-headroom")
    parser.add_argument("--idle-timeout", dest="setting_connections_idle_timeout_s", metavar="SECONDS",
                        help="the same as --connections-idle-timeout-s")
    parser.add_argument("--max-connections-per-uid", dest="setting_connections_max_per_uid", metavar="N",
                        help="the same as --connections-max-per-uid")
    parser.add_argument("--max-jobs-per-uid", dest="setting_jobs_max_per_uid", metavar="N",
                        help="the same as --jobs-max-per-uid")


def _show(setting: Setting, value: Any) -> str:
    if setting.read is _size:
        from cotenant._core import format_size

        return format_size(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- the file ------------------------------------------------------------------------------


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # a dependency on Python 3.10 (pyproject: tomli; python_version < "3.11")

    return tomli


def load_file(path: str) -> Dict[Tuple[str, str], Any]:
    """The settings a TOML file gives, checked: {(table, name): value}."""
    toml = _toml()
    try:
        with open(path, "rb") as f:
            document = toml.load(f)
    except OSError as error:
        raise SettingsError(f"--config {path}: cannot read it ({error.strerror or error})") from None
    except toml.TOMLDecodeError as error:
        raise SettingsError(f"--config {path}: not a TOML file: {error}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"--config {path}: not a TOML file: it is not UTF-8 text") from None
    tables = sorted({s.table for s in SETTINGS})
    values: Dict[Tuple[str, str], Any] = {}
    for table, body in document.items():
        if table not in tables or not isinstance(body, dict):
            near = difflib.get_close_matches(table, tables, n=1)
            guess = f" (did you mean [{near[0]}]?)" if near else ""
            raise SettingsError(f"--config {path}: unknown table {table!r}{guess}; the tables are "
                                f"{', '.join(f'[{t}]' for t in tables)}")
        names = [s.name for s in SETTINGS if s.table == table]
        for name, value in body.items():
            setting = _BY_PLACE.get((table, name))
            if setting is None:
                near = difflib.get_close_matches(name, names, n=1)
                guess = f" (did you mean {near[0]!r}?)" if near else ""
                raise SettingsError(f"--config {path}: unknown setting {name!r} in [{table}]{guess}; "
                                    f"[{table}] has {', '.join(names)}")
            values[(table, name)] = _checked(setting, value, f"--config {path}")
    return values


# ---- into CoordinatorConfig --------------------------------------------------------------


def apply(config: Any, args: argparse.Namespace) -> Any:
    """`config` with the file's settings (args.config), then the flags', in place of its defaults."""
    values: Dict[Tuple[str, str], Any] = {}
    if getattr(args, "config", None):
        values.update(load_file(args.config))
    for setting in SETTINGS:
        text = getattr(args, setting.dest, None)
        if text is not None:
            values[(setting.table, setting.name)] = _checked(setting, text, setting.flag)
    for (table, name), value in values.items():
        config = _replace(config, _BY_PLACE[(table, name)].target, value)
    _check_together(config)
    return config


def _replace(obj: Any, target: Tuple[str, ...], value: Any) -> Any:
    if len(target) == 1:
        return dataclasses.replace(obj, **{target[0]: value})
    inner = getattr(obj, target[0])
    return dataclasses.replace(obj, **{target[0]: _replace(inner, target[1:], value)})


def _check_together(config: Any) -> None:
    share: policy.SharePolicyConfig = config.share
    if share.tolerance >= share.target_slowdown - 1.0:
        raise SettingsError(f"[share] tolerance {share.tolerance:g} must be below target_slowdown - 1 "
                            f"({share.target_slowdown - 1.0:g}), or the share would never grow")
    alone = config.on_their_own_after_s
    if alone and alone < 20 * config.tick_s:
        raise SettingsError(f"[jobs] on_their_own_after_s {alone:g} must be 0 (jobs wait for good) or at least 20 "
                            f"ticks ({20 * config.tick_s:g} s at tick_s {config.tick_s:g}), or a job would run on "
                            f"its own whenever one tick is late")


def format_toml(config: Any) -> str:
    """Every setting of `config` as a TOML file, each with its meaning."""
    lines: List[str] = []
    table: Optional[str] = None
    for setting in SETTINGS:
        if setting.table != table:
            table = setting.table
            lines += ["", f"[{table}]"] if lines else [f"[{table}]"]
        value = _default(setting, config)
        text = f'"{_show(setting, value)}"' if setting.read in (_size, _absolute_path) else _show(setting, value)
        lines.append(f"{setting.name} = {text}  # {setting.meaning}")
    return "\n".join(lines) + "\n"
