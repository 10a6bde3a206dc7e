"""COTENANT_CONF: one string for every job-side setting, and PyTorch's options cotenant ignores."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cotenant import api, gate, settings
from cotenant.coordinator import paths

ROOT = Path(__file__).resolve().parents[2]


def test_conf_string_gives_each_key_and_checks_its_value():
    env = {"COTENANT_CONF": "cap:6GiB, role:opportunistic,name:trainer,gate_window_ms:20,share:0.5"}
    assert settings.get("cap", env) == "6GiB"
    assert settings.value("cap", env).resolve(0) == 6 << 30
    assert settings.get("role", env) == "opportunistic"
    assert settings.get("name", env) == "trainer"
    assert settings.get("device", env) is None
    assert gate.activation_settings(env)["share_window_s"] == 0.02
    assert gate.activation_settings(env)["initial_share"] == 0.5


@pytest.mark.parametrize("text, words", [
    ("cap=6GiB", ["'cap=6GiB' is not key:value", "write cap:6GiB"]),
    ("capp:6GiB", ["unknown key 'capp'", "did you mean 'cap'?"]),
    ("cap:lots", ["cap:lots", "cannot use \"lots\" as a memory cap", "e.g. cap:6GiB"]),
    ("role:boss", ["role:boss", "unknown role 'boss'"]),
    ("gate_max_in_flight:0", ["gate_max_in_flight:0", "must be at least 1"]),
    # int() takes these; the extension's size_t does not (a TypeError at enable()), nor other settings
    ("gate_max_in_flight:100000000000000000000", ["gate_max_in_flight:100000000000000000000", "at most"]),
    ("gate_max_in_flight:\u0663", ["is not a whole number (digits 0-9)"]),
    ("gate_max_in_flight:1_000", ["gate_max_in_flight:1_000", "is not a whole number"]),
    ("cap:1GiB,cap:2GiB", ["'cap' is given twice"]),
    ("spill_without_cap:maybe", ["spill_without_cap:maybe", "write 1 or 0"]),
    # Accepted before, and cast to a 64-bit count of nanoseconds in the extension (undefined for these).
    ("gate_window_ms:inf", ["gate_window_ms:inf", "at most"]),
    ("gate_window_ms:1e300", ["gate_window_ms:1e300", "at most"]),
])
def test_a_malformed_conf_string_names_the_key_and_the_fix(text, words):
    with pytest.raises(settings.SettingsError) as caught:
        settings.get("cap", {"COTENANT_CONF": text})
    message = str(caught.value)
    assert message.startswith("COTENANT_CONF: ")
    for word in words:
        assert word in message, message


def test_the_variable_wins_over_the_conf_string_and_the_disagreement_is_logged(caplog):
    env = {"COTENANT_CONF": "cap:4GiB", "COTENANT_MEMORY_CAP": "6GiB"}
    with caplog.at_level(logging.WARNING, logger="cotenant"):
        assert settings.get("cap", env) == "6GiB"
    assert "COTENANT_MEMORY_CAP=6GiB wins over COTENANT_CONF's cap:4GiB" in caplog.text


def test_every_job_side_variable_the_code_reads_is_a_conf_key():
    # The variables the job side reads (Python and C++), found in the sources.
    read = set()
    for path in list((ROOT / "python" / "cotenant").rglob("*.py")) + list((ROOT / "csrc").rglob("*.cpp")):
        read |= set(re.findall(r"\"(COTENANT_[A-Z_]+)\"", path.read_text()))
    # The string, outputs to the program, and the names settings.py lists as no job's setting.
    not_settings = {settings.CONF_VARIABLE, *settings.HANDED_TO_JOBS, *settings.BUILD_AND_TEST_VARIABLES}
    assert read - not_settings <= {s.variable for s in settings.SETTINGS}, read - not_settings
    assert {"COTENANT_HOST_PAGES", "COTENANT_SPILL_WITHOUT_CAP", "COTENANT_MEMORY_CAP"} <= read


def test_every_cotenant_variable_the_project_reads_is_known_so_none_is_warned_about():
    # Build, test and benchmark variables too: a user who builds and runs in one shell must not be told
    # that a variable the build reads has no effect.
    read = set()
    for path in ROOT.rglob("*"):
        if ".git" in path.parts or not path.is_file() or path == Path(__file__):  # this file names made-up ones
            continue
        if path.suffix in (".py", ".cpp", ".h"):
            read |= set(re.findall(r"\"(COTENANT_[A-Z0-9_]*[A-Z0-9])\"", path.read_text(errors="replace")))
        elif path.suffix == ".sh" or path.name == "run":
            read |= set(re.findall(r"\$\{?(COTENANT_[A-Z0-9_]*[A-Z0-9])", path.read_text(errors="replace")))
        elif path.name == "CMakeLists.txt" or path.suffix == ".cmake":  # ${COTENANT_...} there are CMake's own
            read |= set(re.findall(r"ENV\{(COTENANT_[A-Z0-9_]*[A-Z0-9])\}", path.read_text(errors="replace")))
    assert {"COTENANT_MEMORY_CAP", "COTENANT_VENV", "COTENANT_SKIP_APT"} <= read  # the scan finds each kind
    assert settings.unknown_variables({name: "1" for name in read}) == []


def test_a_misspelled_variable_is_named_with_the_setting_it_is_close_to(caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned_unknown", set())
    misspelled = "COTENANT_" + "CAP"  # built here, so that the scan above does not read it as a variable
    env = {misspelled: "6GiB", "COTENANT_MEMORY_CAP" + "P": "1GiB", "COTENANT_" + "ZZZ": "1",
           "COTENANT_MEMORY_CAP": "2GiB", "COTENANT_CONF": "cap:2GiB", "COTENANT_JOB_PID": "1"}
    assert settings.unknown_variables(env) == [
        "COTENANT_CAP (did you mean COTENANT_MEMORY_CAP?)", "COTENANT_MEMORY_CAPP (did you mean COTENANT_MEMORY_CAP?)",
        "COTENANT_ZZZ"]
    with caplog.at_level(logging.WARNING, logger="cotenant"):
        settings.warn_unknown_variables(env)
        settings.warn_unknown_variables(env)
    warnings = [r.getMessage() for r in caplog.records if "reads no variable" in r.getMessage()]
    assert len(warnings) == 1 and "COTENANT_CAP (did you mean COTENANT_MEMORY_CAP?)" in warnings[0]
    assert settings.unknown_variables({"COTENANT_MEMORY_CAP": "2GiB", "PATH": "/bin"}) == []


def test_cotenant_run_warns_of_a_misspelled_variable_before_the_program_starts():
    from coordinator_harness import child_env

    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", "--allow-uncapped", "--",
                          sys.executable, "-c", "print('ran')"],
                         env={**child_env(), "COTENANT_" + "CAP": "6GiB"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cotenant reads no variable named COTENANT_CAP (did you mean COTENANT_MEMORY_CAP?)" in out.stderr
    assert "ran" in out.stdout


def test_conf_string_reaches_the_readers_of_socket_device_and_disable(monkeypatch):
    monkeypatch.delenv("COTENANT_SOCKET", raising=False)
    monkeypatch.delenv("COTENANT_DISABLE", raising=False)
    monkeypatch.setenv("COTENANT_CONF", "socket:/tmp/x/c.sock,disable:1,run_dir:/srv/ct")
    assert paths.default_socket_path() == "/tmp/x/c.sock"
    assert paths.node_socket_path() == "/srv/ct/coordinator.sock"
    assert api.disabled_by_environment()
    assert api.enable() is False


def test_conf_string_sets_the_allocator_options_the_extension_reads_with_getenv():
    env = {"COTENANT_CONF": "host_pages:pinned,spill_without_cap:yes,keep_host_pages:no"}
    settings.export_for_extension(env)
    assert env["COTENANT_HOST_PAGES"] == "pinned" and env["COTENANT_SPILL_WITHOUT_CAP"] == "1"
    assert env["COTENANT_KEEP_HOST_PAGES"] == "0"


@pytest.mark.parametrize("variable, given, read", [
    ("COTENANT_SPILL_WITHOUT_CAP", "true", "1"), ("COTENANT_SPILL_WITHOUT_CAP", "yes", "1"),
    ("COTENANT_SPILL_WITHOUT_CAP", "off", "0"), ("COTENANT_KEEP_HOST_PAGES", "false", "0"),
    ("COTENANT_KEEP_HOST_PAGES", "no", "0"), ("COTENANT_KEEP_HOST_PAGES", " 0 ", "0"),
    ("COTENANT_HOST_PAGES", " pinned ", "pinned")])
def test_a_yes_no_word_in_its_own_variable_reaches_the_extension_as_it_reads_it(variable, given, read):
    # The extension reads these with getenv and knows "1", "0" and "pinned" only.
    env = {variable: given}
    settings.export_for_extension(env)
    assert env[variable] == read


def test_enable_from_environment_reads_the_conf_string(monkeypatch):
    for variable in ("COTENANT_ENABLE", "COTENANT_ROLE", "COTENANT_MEMORY_CAP", "COTENANT_JOB_PID",
                     "COTENANT_DISABLE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("COTENANT_CONF", "enable:1,role:cap_only,cap:0.5,name:n1,persistent:1GiB,host_reserve:2GiB")
    calls = []
    monkeypatch.setattr(api, "enable", lambda **kwargs: calls.append(kwargs) or True)
    assert api.enable_from_environment() is True
    (call,) = calls
    assert api.parse_role(call["role"]) is None
    assert call["memory_cap"].is_fraction and call["name"] == "n1" and call["persistent_memory"] == "1GiB"
    assert call["host_reserve"] == "2GiB"


def test_a_host_reserve_it_cannot_read_is_refused_naming_the_setting_and_the_form():
    with pytest.raises(settings.SettingsError, match=r"COTENANT_HOST_RESERVE.*a host reserve.*4GiB"):
        settings.check_all({"COTENANT_HOST_RESERVE": "-3GiB"})
    with pytest.raises(settings.SettingsError, match="host_reserve"):
        settings.check_all({"COTENANT_CONF": "host_reserve:plenty"})
    settings.check_all({"COTENANT_CONF": "host_reserve:512MiB"})  # read as the one size parser reads it


def test_cap_only_is_a_role_name_for_no_gate():
    assert api.parse_role("cap_only") is None
    with pytest.raises(ValueError, match="cap_only"):
        api.parse_role("boss")


# ---- PyTorch's allocator options ----------------------------------------------------------------


def test_pytorch_allocator_options_cotenant_ignores_are_named_once(caplog, monkeypatch):
    monkeypatch.setattr(settings, "_warned_pytorch", False)
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True,pinned_use_background_threads:True",
           "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    with caplog.at_level(logging.WARNING, logger="cotenant"):
        settings.warn_ignored_pytorch_options(env)
        settings.warn_ignored_pytorch_options(env)
    warnings = [r for r in caplog.records if "no effect" in r.getMessage()]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "PYTORCH_ALLOC_CONF: expandable_segments:True" in text
    assert "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb:128" in text
    assert "pinned_use_background_threads" not in text  # the pinned host allocator is still PyTorch's


def test_no_warning_without_pytorch_allocator_options():
    assert settings.ignored_pytorch_options({}) == []


def test_a_malformed_conf_string_stops_cotenant_run_before_the_program_starts():
    from coordinator_harness import child_env

    out = subprocess.run([sys.executable, "-m", "cotenant.cli", "run", "--opportunistic", "--", "true"],
                         env={**child_env(), "COTENANT_CONF": "role:opportunistic,cap:lots"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "COTENANT_CONF: cap:lots" in out.stderr and "Traceback" not in out.stderr
