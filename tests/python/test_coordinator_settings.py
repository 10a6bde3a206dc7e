"""The coordinator's policy settings come from flags and a TOML file, and bad ones are refused clearly."""

import argparse
import subprocess
import sys

import pytest

from cotenant import cli
from cotenant.coordinator import daemon, policy
from cotenant.coordinator import settings as coordinator_settings

MiB = 1 << 20


def parse(*argv):
    parser = argparse.ArgumentParser()
    coordinator_settings.add_arguments(parser)
    args = parser.parse_args(list(argv))
    return coordinator_settings.apply(daemon.CoordinatorConfig(socket_path="s"), args)


def test_defaults_are_the_policy_defaults():
    config = parse()
    assert config.memory == policy.MemoryPolicyConfig()
    assert config.share == policy.SharePolicyConfig()
    assert config.baseline == policy.BaselineConfig()


def test_flags_set_every_kind_of_setting():
    config = parse("--memory-headroom", "1GiB", "--share-increase-step", "0.1", "--share-decrease-factor", "0.25",
                   "--baseline-window-iterations", "20", "--jobs-tick-s", "0.01", "--history-max-size", "8MiB",
                   "--idle-timeout", "5")
    assert config.memory.headroom_bytes == 1024 * MiB
    assert config.share.increase_step == 0.1 and config.share.decrease_factor == 0.25
    assert config.baseline.window_iterations == 20
    assert config.tick_s == 0.01 and config.history_max_bytes == 8 * MiB and config.idle_timeout_s == 5.0


def test_a_config_file_sets_settings_and_a_flag_wins_over_it(tmp_path):
    path = tmp_path / "coordinator.toml"
    path.write_text('[memory]\nheadroom = "2GiB"\n[share]\nincrease_step = 0.2\ntarget_slowdown = 1.1\n'
                    '[jobs]\nstale_heartbeat_s = 9\n')
    config = parse("--config", str(path), "--share-increase-step", "0.3")
    assert config.memory.headroom_bytes == 2048 * MiB
    assert config.share.target_slowdown == 1.1
    assert config.share.increase_step == 0.3  # the flag
    assert config.stale_heartbeat_s == 9


def test_printed_config_reads_back_to_the_same_settings(tmp_path):
    config = parse("--share-min-share", "0.1", "--memory-burst-margin", "300MiB",
                   "--memory-cgroup-root", "/host/sys/fs/cgroup")
    assert config.cgroup_root == "/host/sys/fs/cgroup"
    path = tmp_path / "printed.toml"
    path.write_text(coordinator_settings.format_toml(config))
    again = parse("--config", str(path))
    assert again == config


@pytest.mark.parametrize("text, words", [
    ('[share]\nincrease_stp = 0.1\n', ["unknown setting 'increase_stp' in [share]", "did you mean 'increase_step'"]),
    ('[shares]\nincrease_step = 0.1\n', ["unknown table 'shares'", "did you mean [share]"]),
    ('[share]\nincrease_step = 2\n', ["[share] increase_step", "at most 1"]),
    ('[share]\ndecrease_factor = "half"\n', ["[share] decrease_factor", "give a number"]),
    ('[memory]\nheadroom = "6 apples"\n', ["[memory] headroom", "6 apples"]),
    ('[baseline]\nwindow_iterations = 0\n', ["[baseline] window_iterations", "at least 1"]),
    ('[jobs]\ntick_s = 0\n', ["[jobs] tick_s", "above 0"]),
    ('[memory]\ncgroup_root = "sys/fs/cgroup"\n', ["[memory] cgroup_root", "give an absolute path"]),
    ('[share\n', ["not a TOML file"]),
    # Past 64 bits: accepted, then a TypeError from format_size (--print-config) or the daemon.
    ('[memory]\nhost_headroom = 99999999999999999999999\n', ["[memory] host_headroom", "2**64"]),
    ('[history]\nmax_size = 18446744073709551616\n', ["[history] max_size", "2**64"]),
])
def test_a_bad_config_file_is_refused_naming_the_setting(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(coordinator_settings.SettingsError) as caught:
        parse("--config", str(path))
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_a_config_file_that_is_not_text_is_refused_naming_the_file(tmp_path):
    # tomllib raises UnicodeDecodeError, which the command printed as
    # "cotenant: 'utf-8' codec can't decode byte 0xff in position 0", naming no file.
    path = tmp_path / "coordinator.toml"
    path.write_bytes(b"\xff\xfe[memory]\n")
    with pytest.raises(coordinator_settings.SettingsError) as caught:
        parse("--config", str(path))
    assert f"--config {path}: not a TOML file" in str(caught.value) and "UTF-8" in str(caught.value)


def test_settings_that_contradict_each_other_are_refused():
    with pytest.raises(coordinator_settings.SettingsError, match="tolerance 0.1 must be below target_slowdown - 1"):
        parse("--share-target-slowdown", "1.05", "--share-tolerance", "0.1")


def test_how_long_a_job_waits_on_a_silent_coordinator_is_zero_or_many_ticks():
    assert parse("--jobs-on-their-own-after-s", "0").on_their_own_after_s == 0  # waits for good
    assert parse("--jobs-on-their-own-after-s", "5").on_their_own_after_s == 5
    assert parse().on_their_own_after_s == 30
    with pytest.raises(coordinator_settings.SettingsError, match=r"on_their_own_after_s 0.5 must be 0 .* at least 20 "
                                                                  r"ticks \(1 s at tick_s 0.05\)"):
        parse("--jobs-on-their-own-after-s", "0.5")
    with pytest.raises(coordinator_settings.SettingsError, match="on_their_own_after_s"):
        parse("--jobs-on-their-own-after-s", "-1")


@pytest.mark.parametrize("argv, words", [
    (["--headroom", "6 apples"], ["6 apples", "[memory] headroom"]),
    (["--share-decrease-factor", "1.5"], ["[share] decrease_factor", "below 1"]),
    (["--config", "/nonexistent/coordinator.toml"], ["cannot read it"]),
])
def test_the_command_refuses_bad_settings_with_status_2_and_no_traceback(argv, words):
    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "coordinator", "--socket", "/tmp/none.sock", *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in out.stderr


def test_print_config_prints_every_setting(capsys):
    assert cli.main(["coordinator", "--print-config", "--jobs-tick-s", "0.2"]) == 0
    out = capsys.readouterr().out
    for setting in coordinator_settings.SETTINGS:
        assert f"\n{setting.name} = " in "\n" + out
    assert "tick_s = 0.2" in out
