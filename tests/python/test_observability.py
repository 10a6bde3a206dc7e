"""What users see: each command's --help, `cotenant status`, the timeline, the job side's messages."""

import argparse
import ast
from pathlib import Path

import pytest

from cotenant import cli

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "cotenant"


def subcommands(parser, path=("cotenant",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from subcommands(sub, path + (name,))


def test_every_subcommand_help_says_what_it_does():
    found = list(subcommands(cli.build_parser()))
    assert len(found) >= 10
    for path, sub in found:
        assert sub.description and len(sub.description) > 15, f"`{' '.join(path)} --help` has no description"
        assert " ".join(sub.description.split()) in " ".join(sub.format_help().split())


VIEW = {
    "coordinator": {"pid": 1, "socket": "/run/cotenant/coordinator.sock", "protocol": 2},
    "gpus": [{"gpu": "GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab", "uuid": "GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab",
              "index": 0, "note": None, "total_bytes": 80 << 30, "jobs": 4, "device_bytes": 30 << 30,
              "host_bytes": 2 << 30, "host_pool_bytes": 1 << 30, "spilled_bytes": 3 << 30, "restored_bytes": 1 << 30,
              "page_moves": 2048},
             {"gpu": "index:1", "uuid": None, "index": 1, "note": "index:1: the job reported no GPU UUID",
              "total_bytes": None, "jobs": 0, "device_bytes": 0, "host_bytes": 0, "spilled_bytes": 0,
              "restored_bytes": 0, "page_moves": 0}],
    "jobs": [
        dict(job_id=1, name="train", gpu=0, gpu_key="GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab", pid=10,
             role="guaranteed", state="running", share=1.0, cap=None, device_bytes=20 << 30, host_bytes=0),
        dict(job_id=2, name="extra", gpu=1, gpu_key="GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab", pid=11,
             role="opportunistic", state="running", share=0.4, cap=8 << 30, device_bytes=8 << 30, host_bytes=2 << 30),
        dict(job_id=3, name="paused", gpu=0, gpu_key="GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab", pid=12,
             role="opportunistic", state="suspended", share=0.0, cap=0, device_bytes=0, host_bytes=1 << 30),
        dict(job_id=4, name="waiting", gpu=0, gpu_key="GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab", pid=13,
             role="opportunistic", state="queued", share=0.0, cap=None, device_bytes=0, host_bytes=0,
             queue_reason="needs 10 GiB"),
    ],
    "queue": [],
}


def test_status_has_a_line_per_gpu_and_a_state_per_job():
    lines = cli.format_status(VIEW).splitlines()
    first, second = lines[0], lines[1]
    assert first.startswith("GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab (index 0): 80.00 GiB total")
    assert "for 4 jobs" in first and "2048 page moves" in first and "spilled 3.00 GiB" in first
    assert "2.00 GiB on the host (and 1.00 GiB pinned for spills) for 4 jobs" in first
    assert "pinned" not in second  # a GPU whose jobs keep no host pages says nothing of them
    assert second.startswith("index:1 (index 1)") and "note: index:1: the job reported no GPU UUID" in lines[2]
    rows = {line.split()[1]: line.split() for line in lines if line.startswith("GPU-5f1c0d3e ")}
    assert {name: row[4 + 1] for name, row in rows.items()} == {
        "train": "running", "extra": "throttled", "paused": "suspended", "waiting": "queued"}


def test_status_shows_the_hosts_memory_beside_what_the_jobs_pin_and_warns_when_a_squeeze_would_not_fit():
    from cotenant.coordinator import host_memory

    jobs = VIEW["jobs"] + [dict(name="big", role="opportunistic", device_bytes=40 << 30, host_bytes=0,
                                host_pool_bytes=1 << 30)]
    roomy = host_memory.host_status({"total_bytes": 512 << 30, "available_bytes": 400 << 30}, jobs)
    # 3 GiB spilled (extra, paused) + 1 GiB kept; a squeeze would move 8 + 40 GiB.
    assert roomy["pinned_by_jobs_bytes"] == 4 << 30 and roomy["squeezable_bytes"] == 48 << 30
    assert roomy["note"] is None
    lines = cli.format_status({**VIEW, "host": roomy}).splitlines()
    assert ("host memory: 4.00 GiB pinned by jobs (spilled tensors, pages kept for spills) of 512.00 GiB; "
            "400.00 GiB available") in lines
    tight = host_memory.host_status({"total_bytes": 64 << 30, "available_bytes": 20 << 30}, jobs)
    assert "would pin 48.00 GiB" in tight["note"] and "20.00 GiB available" in tight["note"]
    assert any(line.startswith("  note: squeezing every opportunistic job") for line in
               cli.format_status({**VIEW, "host": tight}).splitlines())
    # The headroom counts against what is available: 400 GiB less 380 cannot take 48.
    kept = host_memory.host_status({"total_bytes": 512 << 30, "available_bytes": 400 << 30}, jobs, 380 << 30)
    assert "more than the 20.00 GiB available beyond the 380.00 GiB host headroom" in kept["note"]
    held = host_memory.host_status({"total_bytes": 512 << 30, "available_bytes": 400 << 30},
                                   jobs + [dict(name="held", role="opportunistic", squeeze_held_back_bytes=3 << 30)],
                                   380 << 30)
    assert held["held_back_bytes"] == 3 << 30 and held["headroom_bytes"] == 380 << 30
    assert held["note"].startswith("squeezes held back by 3.00 GiB to keep 380.00 GiB of host memory available")
    held_lines = cli.format_status({**VIEW, "host": held}).splitlines()
    assert ("host memory: 4.00 GiB pinned by jobs (spilled tensors, pages kept for spills) of 512.00 GiB; "
            "400.00 GiB available; squeezes held back by 3.00 GiB") in held_lines
    unknown = host_memory.host_status(None, jobs)
    assert unknown["total_bytes"] is None and unknown["note"] is None
    assert "host memory: 4.00 GiB pinned by jobs (spilled tensors, pages kept for spills)" in \
        cli.format_status({**VIEW, "host": unknown}).splitlines()


def test_meminfo_is_read_in_bytes_and_an_unreadable_one_is_none(tmp_path):
    from cotenant.coordinator import host_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")
    assert host_memory.read_meminfo(str(meminfo)) == {"total_bytes": 16 << 20, "available_bytes": 8 << 20}
    meminfo.write_text("MemTotal:       16384 kB\n")  # a kernel without MemAvailable
    assert host_memory.read_meminfo(str(meminfo)) is None
    assert host_memory.read_meminfo(str(tmp_path / "absent")) is None
    real = host_memory.read_meminfo()
    assert real is None or 0 < real["available_bytes"] <= real["total_bytes"]


def test_a_processs_cgroups_are_read_as_text_and_an_unreadable_one_is_none(tmp_path):
    import os

    from cotenant.coordinator import host_memory

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("0::/kubepods/pod1/rank0\n")
    assert host_memory.read_cgroup(42, proc=str(tmp_path)) == "0::/kubepods/pod1/rank0"
    (tmp_path / "42" / "cgroup").write_text("")
    assert host_memory.read_cgroup(42, proc=str(tmp_path)) is None
    assert host_memory.read_cgroup(43, proc=str(tmp_path)) is None
    with open(f"/proc/{os.getpid()}/cgroup") as f:
        assert host_memory.read_cgroup(os.getpid()) == f.read().strip()


def test_timeline_legends_do_not_cover_the_plots():
    pytest.importorskip("matplotlib")
    from cotenant import timeline

    records = []
    for t in range(50):
        for j in range(6):  # many jobs: a legend inside would cover lines
            records.append({"t": float(t), "gpu": 0, "gpu_key": "GPU-a", "job": f"job{j}", "role": "opportunistic",
                            "cap": (j + 1) << 30, "device_bytes": (j + 1) << 29, "host_bytes": t << 20,
                            "share": (t % 10) / 10})
    fig = timeline.figure(records)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = [a for a in fig.axes if a.get_legend() is not None]
    assert len(axes) == 2
    for ax in axes:
        legend = ax.get_legend().get_window_extent(renderer)
        plot = ax.get_window_extent(renderer)
        assert legend.x0 >= plot.x1, "the legend overlaps the plot"


def test_timeline_groups_by_gpu_key_so_one_gpu_is_one_column():
    pytest.importorskip("matplotlib")
    from cotenant import timeline

    records = [{"t": 0.0, "gpu": 0, "gpu_key": "GPU-a", "job": "a", "role": "guaranteed", "cap": None,
                "device_bytes": 1, "host_bytes": 0, "share": 1.0},
               {"t": 0.0, "gpu": 1, "gpu_key": "GPU-a", "job": "b", "role": "opportunistic", "cap": None,
                "device_bytes": 1, "host_bytes": 0, "share": 0.5}]
    fig = timeline.figure(records)
    assert len(fig.axes) == 2  # one column: memory and share


SAMPLE = {"t": 0.0, "gpu": 0, "gpu_key": "GPU-a", "job": "a", "role": "guaranteed", "cap": None,
          "device_bytes": 1, "host_bytes": 0, "share": 1.0}


@pytest.mark.parametrize("content", [
    b"\x89PNG\r\n\x1a\n\x00\x00",                 # an image: 'utf-8' codec can't decode byte 0x89
    b"[1, 2]\n",                                        # AttributeError: 'list' object has no attribute 'get'
    b'{"t": 0, "device_bytes": 1}\n',                   # KeyError: 'job'
])
def test_timeline_of_a_file_that_is_not_a_coordinator_history_says_so(tmp_path, capsys, content):
    history = tmp_path / "wrong.jsonl"
    history.write_bytes(content)
    code = cli.main(["timeline", "--history", str(history), "-o", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert code == 1
    assert str(history) in err and "not a coordinator history" in err and "history.jsonl" in err, err
    assert not (tmp_path / "t.png").exists()


def test_timeline_of_a_directory_says_it_cannot_read_it(tmp_path, capsys):
    code = cli.main(["timeline", "--history", str(tmp_path), "-o", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert code == 1 and f"cannot read {tmp_path}" in err, err


def test_timeline_that_cannot_write_its_output_says_where_and_why(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import json

    history = tmp_path / "h.jsonl"
    history.write_text(json.dumps(SAMPLE) + "\n")
    output = tmp_path / "no such directory" / "t.png"
    code = cli.main(["timeline", "--history", str(history), "-o", str(output)])  # FileNotFoundError, a traceback
    err = capsys.readouterr().err
    assert code == 1
    assert f"cannot write {output}" in err and "No such file or directory" in err, err
    assert "coordinator socket" not in err


# Modules that run inside a job; they speak through the "cotenant" logger, never print.
JOB_SIDE = ["api.py", "gate.py", "settings.py", "launch.py", "_autoenable/sitecustomize.py",
            "coordinator/client.py", "coordinator/paths.py", "coordinator/protocol.py"]


@pytest.mark.parametrize("module", JOB_SIDE)
def test_the_job_side_logs_through_logging_and_never_prints(module):
    tree = ast.parse((PACKAGE / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            assert not (isinstance(func, ast.Name) and func.id == "print"), f"{module}:{node.lineno} prints"
            text = ast.unparse(func)
            assert "stderr.write" not in text and "stdout.write" not in text, f"{module}:{node.lineno} writes"


def test_metrics_listen_on_loopback_unless_told():
    parser = cli.build_parser()
    args = parser.parse_args(["coordinator"])
    assert args.metrics_address == "127.0.0.1"


@pytest.mark.parametrize("command", [["status"], ["set-cap", "trainer", "6GiB"], ["suspend", "trainer"]])
@pytest.mark.parametrize("where", ["too long", "under a file"])
def test_a_socket_path_no_socket_can_have_is_named_with_the_fix(tmp_path, capsys, command, where):
    (tmp_path / "file").write_text("")
    socket_path = str(tmp_path / ("s" * 120)) if where == "too long" else str(tmp_path / "file" / "c.sock")
    code = cli.main(command + ["--socket", socket_path])  # OSError from connect, a traceback
    err = capsys.readouterr().err
    assert code == 1
    assert socket_path in err and "--socket" in err, err
