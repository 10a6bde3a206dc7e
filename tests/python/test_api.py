"""The allocator's Python API and the torch extension, on any machine (no GPU needed).

Run with the build tree on the path:
    PYTHONPATH=python:<build>/python python -m pytest tests/python/test_api.py
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cotenant
from cotenant import api

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOENABLE_DIR = os.path.join(REPO, "python", "cotenant", "_autoenable")
GIB = 1 << 30
MIB = 1 << 20


def _extension_or_skip():
    """cotenant._C, or a skip when this build tree was configured without it.
    COTENANT_REQUIRE_TORCH_EXTENSION=1 (CI) turns the skip into a failure."""
    import torch  # noqa: F401

    try:
        from cotenant import _C
    except ImportError as error:
        if os.environ.get("COTENANT_REQUIRE_TORCH_EXTENSION") == "1":
            raise
        pytest.skip(f"the torch extension cotenant._C is not built in this tree: {error}")
    return _C


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_python(code, env_extra=None, pythonpath_prefix=None, timeout=120, as_job=False):
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("COTENANT_") and key != "COTENANT_REQUIRE_TORCH_EXTENSION":
            del env[key]
    if pythonpath_prefix:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath_prefix, env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    from coordinator_harness import AS_JOB

    launcher = AS_JOB if as_job else [sys.executable]
    return subprocess.run([*launcher, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- the package and the extension ----------------------------------------------------


def test_importing_cotenant_does_not_import_torch():
    result = _run_python("import sys, cotenant; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_extension_imports_and_reports_whether_a_gpu_is_usable():
    _C = _extension_or_skip()
    available, reason = _C.gpu_available()
    if _gpu_present():
        assert available and reason == ""
    else:
        assert not available
        assert "no usable NVIDIA GPU" in reason and "COTENANT_DISABLE=1" in reason


def test_the_extension_finds_the_cuda_runtime_torch_loaded_not_the_toolkits():
    # Its only run path is torch's library directory: a toolkit's libcudart
    # found first could differ from the runtime torch itself uses.
    import shutil

    import torch

    _C = _extension_or_skip()
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
    paths = [line.split("[", 1)[1].rstrip("]").split(":") for line in dynamic.splitlines()
             if "RUNPATH" in line or "RPATH" in line]
    assert paths, dynamic
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    assert [os.path.realpath(p) for p in paths[0] if p] == [torch_lib]


def test_enable_without_a_gpu_raises_no_gpu_error_that_says_what_to_do():
    _extension_or_skip()
    if _gpu_present():
        pytest.skip("this machine has a GPU; tests/python/test_allocator_gpu.py covers enable()")
    result = _run_python("""
        import cotenant
        try:
            cotenant.enable()
        except cotenant.NoGpuError as error:
            print("NoGpuError:", error)
        print("enabled:", cotenant.is_enabled())
    """)
    assert result.returncode == 0, result.stderr
    assert "NoGpuError: cotenant found no usable NVIDIA GPU" in result.stdout
    assert "enabled: False" in result.stdout
    from cotenant import launch

    if "no NVIDIA driver found" in (launch.driver_problem(0) or ""):
        # Not the CUDA runtime's "driver version is insufficient", which blames a driver that is not there.
        assert "no NVIDIA driver found" in result.stdout and "insufficient" not in result.stdout


def test_enable_does_nothing_when_cotenant_disable_is_set():
    result = _run_python("""
        import sys, cotenant
        print(cotenant.enable(role="opportunistic"), cotenant.is_enabled(), 'torch' in sys.modules)
    """, env_extra={"COTENANT_DISABLE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False"]


def test_enable_rejects_an_unknown_role_before_touching_cuda():
    with pytest.raises(ValueError, match="guaranteed"):
        cotenant.enable(role="best-effort")


def test_api_calls_before_enable_say_to_call_enable_first():
    for call in (lambda: cotenant.set_memory_cap("1GiB"), cotenant.memory_cap,
                 cotenant.memory_stats, cotenant.spill_all, cotenant.restore_all,
                 lambda: cotenant.set_host_headroom("1GiB"), cotenant.host_headroom):
        with pytest.raises(RuntimeError, match=r"call cotenant.enable\(\) first"):
            call()


# ---- caps: parsing and validation -------------------------------------------------------


@pytest.mark.parametrize("size, expected", [
    (4096, 4096),
    ("6GiB", 6 * GIB),
    ("512MiB", 512 * MIB),
    ("1.5GB", 1_500_000_000),
    (0.5, 8 * GIB),
    (1.0, None),  # the whole device: no cap
    ("0.5", 8 * GIB),
    ("25%", 4 * GIB),
    ("none", None),
    (None, None),
])
def test_memory_cap_accepts_bytes_size_strings_and_fractions_of_the_device(size, expected):
    assert api.parse_memory_cap(size, device_total_bytes=16 * GIB) == expected


@pytest.mark.parametrize("size, message", [
    (0, "positive"),
    (-5, "cannot be negative"),
    ("0MiB", "0 bytes"),
    ("6 apples", 'cannot use "6 apples" as a memory cap'),
    ("1.5", r"in \(0, 1\]"),
    (0.0, r"in \(0, 1\]"),
    (1.5, r"in \(0, 1\]"),
    (-0.25, r"in \(0, 1\]"),
    ("", r'it is empty \(write "none" for no cap\)'),
])
def test_memory_cap_rejects_bad_values_with_the_accepted_forms(size, message):
    with pytest.raises(ValueError, match=message):
        api.parse_memory_cap(size, device_total_bytes=16 * GIB)


def test_memory_cap_rejects_non_sizes_with_a_type_error():
    for size in (True, [1], object()):
        with pytest.raises(TypeError, match="6GiB"):
            api.parse_memory_cap(size, device_total_bytes=16 * GIB)


def test_fractional_cap_needs_the_device_size():
    with pytest.raises(ValueError, match="enable"):
        api.parse_memory_cap(0.5)


def test_size_strings_go_through_the_one_core_parser():
    from cotenant import _core

    for text in ("6GiB", "512 MiB", "1.5GB", "4096", "2g"):
        assert api.parse_memory_cap(text) == _core.parse_size(text)


@pytest.mark.parametrize("device, expected", [
    (None, None), (0, 0), (3, 3), ("1", 1), ("cuda", None), ("cuda:2", 2),
])
def test_device_accepts_indices_and_cuda_names(device, expected):
    assert api.parse_device(device) == expected


@pytest.mark.parametrize("device", ["cpu", "cuda:x", "mps:0", -1])
def test_device_rejects_non_cuda_devices(device):
    with pytest.raises(ValueError):
        api.parse_device(device)


def test_role_is_normalised_and_validated():
    assert api.parse_role(" Guaranteed ") == "guaranteed"
    assert api.parse_role("") is None
    assert api.parse_role(None) is None
    with pytest.raises(ValueError, match="opportunistic"):
        api.parse_role("background")


def test_memory_stats_split_device_host_and_cached_bytes():
    raw = {
        "allocated_bytes.all.current": 6 * MIB,
        "reserved_bytes.all.current": 10 * MIB,
        "device_resident_bytes.current": 8 * MIB,
        "host_resident_bytes.current": 2 * MIB,
        "host_live_bytes": 1 * MIB,
        "memory_cap": 8 * MIB,
        "mode": "remap",
        "host_page_kind": "host-numa",
    }
    stats = api.summarize_stats(raw)
    assert stats["device_bytes"] == 8 * MIB
    assert stats["host_bytes"] == 2 * MIB
    assert stats["host_live_bytes"] == 1 * MIB  # of host_bytes, the pages that hold a live block
    assert stats["cached_bytes"] == 4 * MIB
    assert stats["device_bytes"] + stats["host_bytes"] == stats["reserved_bytes"]
    assert stats["memory_cap"] == 8 * MIB and stats["mode"] == "remap"
    # The core's "no cap" (2**64 - 1) reads back as -1 through int64 maps.
    assert api.summarize_stats({**raw, "memory_cap": -1})["memory_cap"] is None


@pytest.mark.parametrize("free, total, cap, device_bytes, expected", [
    (70 * GIB, 80 * GIB, 8 * GIB, 3 * GIB, (5 * GIB, 8 * GIB)),    # the room under the cap
    (2 * GIB, 80 * GIB, 8 * GIB, 3 * GIB, (2 * GIB, 8 * GIB)),     # never more than the driver has free
    (70 * GIB, 80 * GIB, 8 * GIB, 9 * GIB, (0, 8 * GIB)),          # over the cap until the next safe point
    (70 * GIB, 80 * GIB, 100 * GIB, 3 * GIB, (70 * GIB, 80 * GIB)),  # a cap above the device is the device
])
def test_mem_get_info_under_a_cap_reports_the_cap_and_the_room_under_it(free, total, cap, device_bytes, expected):
    assert api.memory_info_under_cap(free, total, cap, device_bytes) == expected


# ---- enabling through the environment -----------------------------------------------------


def test_environment_enabling_is_off_unless_cotenant_enable_is_set():
    result = _run_python("""
        import sys, cotenant
        print(cotenant.enable_from_environment(), 'torch' in sys.modules)
    """, env_extra={"COTENANT_ROLE": "guaranteed", "COTENANT_MEMORY_CAP": "1GiB"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("variable, value, message", [
    ("COTENANT_MEMORY_CAP", "6 apples", 'COTENANT_MEMORY_CAP=\'6 apples\': cannot use "6 apples" as a memory cap'),
    ("COTENANT_PERSISTENT_MEMORY", "lots", "COTENANT_PERSISTENT_MEMORY='lots': cannot use 'lots' as persistent memory"),
    ("COTENANT_HOST_HEADROOM", "-2GiB", "COTENANT_HOST_HEADROOM='-2GiB': cannot use '-2GiB' as a host headroom"),
])
def test_environment_enabling_rejects_a_bad_size_before_touching_cuda(variable, value, message):
    result = _run_python("""
        import sys, cotenant
        try:
            cotenant.enable_from_environment()
        except ValueError as error:
            print("ValueError:", error)
        print("torch imported:", 'torch' in sys.modules)
    """, env_extra={"COTENANT_ENABLE": "1", variable: value})
    assert result.returncode == 0, result.stderr
    assert f"ValueError: {message}" in result.stdout
    assert "torch imported: False" in result.stdout


def test_environment_enabling_rejects_a_bad_role():
    result = _run_python("""
        import cotenant
        try:
            cotenant.enable_from_environment()
        except ValueError as error:
            print("ValueError:", error)
    """, env_extra={"COTENANT_ENABLE": "1", "COTENANT_ROLE": "vip"})
    assert "ValueError: COTENANT_ROLE='vip': unknown role 'vip'" in result.stdout, result.stderr


def test_autoenable_reports_why_it_did_not_enable_and_runs_the_sites_own_sitecustomize(tmp_path):
    _extension_or_skip()
    if _gpu_present():
        pytest.skip("this machine has a GPU; tests/python/test_allocator_gpu.py covers autoenable")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text("import os\nos.environ['SITE_HOOK_RAN'] = 'yes'\n")
    program = """
        import os
        print("site hook:", os.environ.get("SITE_HOOK_RAN"))
        print("program ran")
    """
    job = {"COTENANT_ENABLE": "1", "COTENANT_ROLE": "opportunistic"}
    refused = _run_python(program, env_extra=job, pythonpath_prefix=[AUTOENABLE_DIR, str(site_dir)], as_job=True)
    assert refused.returncode == 2 and "program ran" not in refused.stdout  # fails closed
    assert "cannot enable cotenant in this program: cotenant found no usable NVIDIA GPU" in refused.stderr
    result = _run_python(program, env_extra={**job, "COTENANT_ALLOW_UNCAPPED": "1"},
                         pythonpath_prefix=[AUTOENABLE_DIR, str(site_dir)], as_job=True)
    assert result.returncode == 0, result.stderr
    assert "program ran" in result.stdout
    assert "site hook: yes" in result.stdout
    assert "cotenant: not enabled, the program runs WITHOUT a cap or gate" in result.stderr
    assert "cotenant found no usable NVIDIA GPU" in result.stderr


# ---- the op-entry interception point (CPU ops are ATen ops too) ------------------------------


def test_op_entry_hooks_run_once_per_outermost_op():
    _C = _extension_or_skip()
    import torch

    x = torch.randn(4, 8)
    w = torch.randn(3, 8)
    _C._count_op_entries(True)
    try:
        before = _C._counted_op_entries()
        torch.nn.functional.linear(x, w)  # aten::linear runs aten::t and aten::matmul inside
        assert _C._counted_op_entries() - before == 1
        before = _C._counted_op_entries()
        torch.add(x, 1.0)
        torch.mul(x, 2.0)
        assert _C._counted_op_entries() - before == 2
    finally:
        _C._count_op_entries(False)
    assert _C.ops_in_flight() == 0


def test_op_exit_hooks_run_once_per_outermost_op_aten_or_explicit():
    # The launch gate's markers and the guaranteed job's busy tracker run as
    # exit hooks on the interception point's one callback: once per outermost
    # op when its work is enqueued, never for the ops it runs inside.
    _C = _extension_or_skip()
    import torch

    x = torch.randn(4, 8)
    w = torch.randn(3, 8)
    _C._count_op_entries(True)
    try:
        before = _C._counted_op_exits()
        torch.nn.functional.linear(x, w)  # aten::t and aten::matmul inside
        assert _C._counted_op_exits() - before == 1
        before = _C._counted_op_exits()
        _C.begin_explicit_op()
        _C.begin_explicit_op()  # nested: not an outermost op of its own
        _C.end_explicit_op()
        assert _C._counted_op_exits() == before  # the outer one has not ended
        torch.add(x, 1.0)  # inside the explicit op: not outermost either
        _C.end_explicit_op()
        assert _C._counted_op_exits() - before == 1
        entries, exits = _C._counted_op_entries(), _C._counted_op_exits()
        a = torch.randn(3, 3, requires_grad=True)
        (a @ a).sum().backward()
        assert _C._counted_op_exits() - exits == _C._counted_op_entries() - entries > 0
    finally:
        _C._count_op_entries(False)
    assert _C.ops_in_flight() == 0


def test_a_hook_that_throws_leaves_the_op_entry_hooks_on():
    # torch logs an exception from a RecordFunction callback and runs the op;
    # this thread's hooks must go on running for the next ops (the gate and
    # the allocator's safe points are such hooks), and the op still counts.
    _C = _extension_or_skip()
    import torch

    x = torch.randn(4)
    _C._count_op_entries(True, 1)  # the next entry throws after it is counted
    try:
        before = _C._counted_op_entries()
        added = torch.add(x, 1.0)  # its entry's hook throws
        torch.mul(x, 2.0)
        torch.sub(x, 1.0)
        counted = _C._counted_op_entries() - before
    finally:
        _C._count_op_entries(False)
    assert counted == 3
    assert torch.equal(added, x + 1.0)  # the failing entry's op ran
    assert _C.ops_in_flight() == 0


def test_op_entry_hooks_see_ops_from_other_threads_and_backward():
    _C = _extension_or_skip()
    import torch

    _C._count_op_entries(True)
    try:
        before = _C._counted_op_entries()
        worker = threading.Thread(target=lambda: [torch.ones(2) + 1 for _ in range(10)])
        worker.start()
        worker.join()
        assert _C._counted_op_entries() - before >= 20  # ones + add, ten times
        a = torch.randn(3, 3, requires_grad=True)
        loss = (a @ a).sum()
        before = _C._counted_op_entries()
        loss.backward()
        assert _C._counted_op_entries() > before  # backward's ops are intercepted too
    finally:
        _C._count_op_entries(False)


def test_paused_launches_hold_other_threads_at_op_entry_until_resumed():
    _C = _extension_or_skip()
    import torch

    _C._count_op_entries(True)  # installs the interception point
    _C._count_op_entries(False)
    done = threading.Event()

    def worker():
        torch.add(torch.zeros(2), 1.0)
        done.set()

    assert _C._pause_launches(1.0)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        time.sleep(0.3)
        assert not done.is_set(), "an op ran while launches were paused"
    finally:
        _C._resume_launches()
    thread.join(timeout=10)
    assert done.is_set()
    assert _C.ops_in_flight() == 0


def test_a_thread_held_at_op_entry_lets_the_other_python_threads_run():
    # Some ops begin with the GIL held (tensor indexing; C++ code such as
    # torch.compile's launchers): a thread waiting for a pause to end must
    # not hold it, or the thread that would end the pause, and every other
    # Python thread of the job, stops with it. In a process of its own: the
    # failure is a deadlock.
    _extension_or_skip()
    script = textwrap.dedent("""
        import json, threading, time, torch
        from cotenant import _C
        _C._count_op_entries(True)  # installs the interception point
        _C._count_op_entries(False)
        x = torch.arange(4.0)
        done = threading.Event()
        def worker():
            x[1]  # indexing enters its ops holding the GIL
            done.set()
        assert _C._pause_launches(1.0)
        thread = threading.Thread(target=worker)
        thread.start()
        time.sleep(0.3)  # needs the GIL back
        held = not done.is_set()
        _C._resume_launches()
        thread.join(10)
        print(json.dumps({"held": held, "done": done.is_set()}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"held": True, "done": True}


def test_a_pause_lets_the_gil_go_while_an_op_that_needs_it_finishes():
    # A safe point pauses from op entry, where the GIL may be held; an op
    # running on another thread may need the GIL to finish (its kernel is
    # Python). Holding it, the pause would wait out its drain timeout and
    # give up. _pause_launches leaves the GIL to pause_launches itself.
    _extension_or_skip()
    script = textwrap.dedent("""
        import json, threading, time, torch
        from cotenant import _C
        _C._count_op_entries(True)  # installs the interception point
        _C._count_op_entries(False)
        lib = torch.library.Library("cotenant_gil_test", "DEF")
        lib.define("slow(Tensor x) -> Tensor")
        started = threading.Event()
        def slow(x):
            started.set()
            time.sleep(0.3)  # lets the GIL go; needs it back to return
            return x.clone()
        lib.impl("slow", slow, "CPU")
        thread = threading.Thread(target=lambda: torch.ops.cotenant_gil_test.slow(torch.ones(2)))
        thread.start()
        started.wait()
        begun = time.monotonic()
        paused = _C._pause_launches(20.0)
        waited = time.monotonic() - begun
        in_flight = _C.ops_in_flight()
        if paused:
            _C._resume_launches()
        thread.join(10)
        print(json.dumps({"paused": paused, "in_flight": in_flight, "quick": waited < 10}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"paused": True, "in_flight": 0, "quick": True}


def test_a_pause_waits_for_ops_already_running_on_other_threads():
    _C = _extension_or_skip()
    import torch

    _C._count_op_entries(True)
    _C._count_op_entries(False)
    big = torch.randn(1500, 1500)
    started = threading.Event()

    def worker():
        started.set()
        for _ in range(20):
            big @ big

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    if _C._pause_launches(30.0):
        try:
            assert _C.ops_in_flight() == 0  # the pause only returns once running ops finished
        finally:
            _C._resume_launches()
    thread.join()


# ---- the benchmark script -------------------------------------------------------------------


def test_allocator_benchmark_script_parses_and_lists_its_figures():
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_allocator.py"),
                             "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "shrink_response_s" in result.stdout


def _load_benchmark_module():
    from script_loader import load_script

    return load_script(os.path.join(REPO, "benchmarks", "bench_allocator.py"))


def test_allocator_benchmark_turns_measurements_into_every_figure():
    bench = _load_benchmark_module()
    measured = {
        "alloc_free": {"native_s_per_pair": 2e-6, "cotenant_s_per_pair": 1e-6,
                       "native_raw_s_per_pair": 1e-6, "cotenant_raw_s_per_pair": 1.5e-6},
        "step_time": {"resnet50": {"native_s": 0.100, "cotenant_s": 0.101},
                      "gpt": {"native_s": 0.200, "cotenant_s": 0.200}},
        "moves": {"memcpy_d2h_gbps": 25.0, "memcpy_h2d_gbps": 20.0, "spill_gbps": 2.5, "restore_gbps": 5.0,
                  "spill_kept_gbps": 22.5, "restore_kept_gbps": 20.0},
        "shrink": {"1GiB": 0.05, "4GiB": 0.2, "16GiB": 0.8},
        "spilled": {"0pct_s": 0.2, "25pct_s": 0.3, "50pct_s": 0.5},
    }
    figures = bench.compute_figures(measured)
    assert set(bench.FIGURES) <= set(figures)
    assert figures["alloc_free_ratio_vs_native"] == pytest.approx(0.5)
    assert figures["alloc_free_raw_ratio_vs_native"] == pytest.approx(1.5)
    assert figures["step_time_ratio_vs_native"] == pytest.approx(1.01)  # the worst model
    assert figures["spill_bandwidth_ratio_vs_memcpy"] == pytest.approx(0.1)
    assert figures["restore_bandwidth_ratio_vs_memcpy"] == pytest.approx(0.25)
    assert figures["spill_bandwidth_ratio_vs_memcpy_kept"] == pytest.approx(0.9)
    assert figures["restore_bandwidth_ratio_vs_memcpy_kept"] == pytest.approx(1.0)
    assert figures["shrink_response_s_16GiB"] == pytest.approx(0.8)
    assert figures["step_time_ratio_spilled_50pct"] == pytest.approx(2.5)


def test_allocator_benchmark_leaves_a_figure_empty_when_its_worker_failed():
    bench = _load_benchmark_module()
    figures = bench.compute_figures({"alloc_free": {"native_s_per_pair": 2e-6}, "moves": {"error": "x"}})
    assert figures["alloc_free_ratio_vs_native"] is None
    assert figures["spill_bandwidth_ratio_vs_memcpy"] is None
    assert figures["step_time_ratio_vs_native"] is None


def test_allocator_benchmark_alternates_the_allocators_and_averages_each_side(monkeypatch):
    bench = _load_benchmark_module()
    calls = []
    values = iter([1.0, 2.0, 4.0, 3.0])

    def worker(name, allocator, extra, env=None):
        calls.append((name, allocator, tuple(extra)))
        return {"s": next(values)}

    monkeypatch.setattr(bench, "_run_worker", worker)
    result = bench.alternated("step_time", ["--model", "gpt"], ("s",))
    assert [allocator for _, allocator, _ in calls] == ["native", "cotenant", "cotenant", "native"]
    assert all(extra == ("--model", "gpt") for _, _, extra in calls)
    assert result["native"]["s"] == pytest.approx(2.0)  # runs 1 and 4
    assert result["cotenant"]["s"] == pytest.approx(3.0)  # runs 2 and 3
    assert [run["s"] for run in result["cotenant"]["runs"]] == [2.0, 4.0]


def test_allocator_benchmark_leaves_a_side_empty_when_one_of_its_runs_failed(monkeypatch):
    bench = _load_benchmark_module()
    rows = iter([{"s": 1.0}, {"error": "CUDA error: out of memory"}, {"s": 2.0}, {"s": 1.0}])
    monkeypatch.setattr(bench, "_run_worker", lambda name, allocator, extra, env=None: next(rows))
    result = bench.alternated("step_time", [], ("s",))
    assert "s" not in result["cotenant"] and result["cotenant"]["error"] == "CUDA error: out of memory"
    assert result["native"]["s"] == pytest.approx(1.0)
    assert bench.compute_figures({"step_time": {"gpt": {"native_s": result["native"].get("s"),
                                                        "cotenant_s": result["cotenant"].get("s")}}})[
        "step_time_ratio_vs_native"] is None


def test_allocator_benchmark_run_alternates_its_comparisons_and_writes_each_run(monkeypatch, tmp_path):
    """bench_allocator.py's GPU run, its workers stubbed: alloc+free and each
    model's step alternate the allocators, the figures are of each side's
    mean, and the result file keeps every run (a failed one as null)."""
    bench = _load_benchmark_module()
    order = []
    step_times = {"native": iter([0.10, 0.14, 0.20, 0.24]), "cotenant": iter([0.11, 0.13, None, 0.22])}

    def worker(name, allocator, extra, env=None):
        order.append((name, allocator))
        if name == "alloc_free":
            return {"s_per_pair": 2e-6 if allocator == "native" else 1e-6, "raw_s_per_pair": 1e-6}
        if name == "step_time":
            s = next(step_times[allocator])
            return {"error": "worker died"} if s is None else {"s": s}
        return {"error": "not measured here"}

    monkeypatch.setattr(bench, "_run_worker", worker)
    monkeypatch.setattr(bench, "gpu_environment", lambda: {"device": "Test GPU", "torch": "x", "driver": "y", "cuda": "z"})
    assert bench.main(["--out", str(tmp_path)]) == 0
    assert order[:4] == [("alloc_free", a) for a in ("native", "cotenant", "cotenant", "native")]
    assert [a for name, a in order if name == "step_time"] == ["native", "cotenant", "cotenant", "native"] * 2
    (path,) = tmp_path.glob("allocator-test-gpu-*.json")
    result = json.loads(path.read_text())
    assert result["figures"]["alloc_free_ratio_vs_native"] == pytest.approx(0.5)
    assert result["figures"]["step_time_ratio_vs_native.resnet50"] == pytest.approx(0.12 / 0.12)
    assert result["figures"]["step_time_ratio_vs_native.gpt"] is None  # one of its cotenant runs failed
    assert result["measured"]["step_time"]["gpt"]["runs"] == {"native": [0.20, 0.24], "cotenant": [None, 0.22]}
    assert len(result["measured"]["alloc_free"]["runs"]["cotenant"]) == 2


def test_allocator_benchmark_uses_the_same_size_mix_for_both_allocators():
    bench = _load_benchmark_module()
    assert bench.size_sequence(500) == bench.size_sequence(500)
    assert set(bench.size_sequence(2000)) == {size for size, _ in bench.SIZE_MIX}


def test_environment_enabling_skips_processes_that_multiprocessing_starts():
    assert api.is_multiprocessing_helper(
        ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
         "--multiprocessing-fork"])
    assert api.is_multiprocessing_helper(
        ["python", "-c", "from multiprocessing.resource_tracker import main;main(7)"])
    assert not api.is_multiprocessing_helper(["python", "train.py", "--epochs", "3"])
    result = _run_python("""
        import cotenant
        print(cotenant.enable_from_environment())
    """, env_extra={"COTENANT_ENABLE": "1"})
    # A plain program is not a helper: it enables (or, without a GPU, says why it cannot).
    if _gpu_present():
        assert result.stdout.strip() == "True", result.stderr
    else:
        assert "NoGpuError: cotenant found no usable NVIDIA GPU" in result.stderr


def test_enable_rejects_a_bad_initial_cap_before_touching_cuda():
    result = _run_python("""
        import sys, cotenant
        try:
            cotenant.enable(memory_cap="6 apples")
        except ValueError as error:
            print("ValueError:", error)
        print("torch imported:", 'torch' in sys.modules)
    """)
    assert result.returncode == 0, result.stderr
    assert 'ValueError: cannot use "6 apples" as a memory cap' in result.stdout
    assert "torch imported: False" in result.stdout


def test_persistent_memory_is_read_by_the_one_size_parser():
    assert api.parse_persistent_memory(None) is None
    assert api.parse_persistent_memory("10GiB") == 10 << 30
    assert api.parse_persistent_memory(4096) == 4096
    with pytest.raises(ValueError, match="cannot use '10 gigs' as persistent memory"):
        api.parse_persistent_memory("10 gigs")
    with pytest.raises(ValueError, match="cannot be -1 bytes"):
        api.parse_persistent_memory(-1)
    with pytest.raises(TypeError):
        api.parse_persistent_memory(1.5)


@pytest.mark.parametrize("parse", [api.parse_memory_cap, api.parse_persistent_memory, api.parse_host_reserve,
                                   api.parse_host_headroom])
def test_a_size_beyond_64_bits_is_refused_naming_the_limit_not_a_binding_error(parse):
    # set_memory_cap(10**30) raised pybind11's "Unable to cast Python instance
    # of type <class 'int'> to C++ type '?'", and set_host_headroom(10**30) a
    # TypeError listing the binding's signature (after it had kept the bad
    # headroom in its state).
    for size in (2**64, 10**30):
        with pytest.raises(ValueError, match=r"2\*\*64") as caught:
            parse(size)
        assert "6GiB" in str(caught.value) or "4GiB" in str(caught.value) or "10GiB" in str(caught.value)


def test_a_cap_beyond_64_bits_for_the_coordinator_is_refused_as_the_api_refuses_it():
    from cotenant.coordinator import client

    with pytest.raises(ValueError, match=r"2\*\*64"):
        client._cap(2**64)
    with pytest.raises(TypeError):
        client._cap(True)
    assert client._cap("50%") == "0.5" and client._cap(4096) == 4096 and client._cap("none") is None


def as_if_enabled(monkeypatch, role, name=None):
    """This process as after a first enable(role, name=name) on cuda:0 (as the start-up hook of
    `cotenant run` leaves it), with no COTENANT_* variable that would change a second call."""
    for variable in ("COTENANT_DISABLE", "COTENANT_CONF", "COTENANT_DEVICE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(api._state, "enabled", True)
    monkeypatch.setattr(api._state, "device", 0)
    monkeypatch.setattr(api._state, "role", role)
    monkeypatch.setattr(api._state, "fixed_at_enable", {"name": name, "socket": None, "persistent_memory": None},
                        raising=False)


def test_a_second_enable_applies_its_cap_instead_of_dropping_it(monkeypatch):
    # enable() again with the same role and device returned True and kept the
    # old cap: the new one was lost without a word.
    applied = []
    monkeypatch.setattr(api, "set_memory_cap", lambda size, device=None: applied.append(("cap", size, device)))
    monkeypatch.setattr(api, "set_host_headroom", lambda size: applied.append(("headroom", size)))
    as_if_enabled(monkeypatch, role="opportunistic")
    assert cotenant.enable("opportunistic", memory_cap="2GiB", host_headroom="1GiB") is True
    assert applied == [("cap", "2GiB", 0), ("headroom", 1 << 30)]


def test_a_second_enable_refuses_a_name_it_cannot_apply_and_keeps_the_first(monkeypatch):
    applied = []
    monkeypatch.setattr(api, "set_memory_cap", lambda size, device=None: applied.append(size))
    as_if_enabled(monkeypatch, role=None, name="trainer")
    assert cotenant.enable(name="trainer") is True  # the same name: nothing to change
    with pytest.raises(RuntimeError) as caught:
        cotenant.enable(name="other", memory_cap="2GiB")
    message = str(caught.value)
    assert "name='other'" in message and "'trainer'" in message and "already enabled" in message
    assert applied == []  # refused before anything changed


def test_a_second_enable_without_a_role_keeps_the_first_role_and_applies_its_cap(monkeypatch):
    # A script's own cotenant.enable(memory_cap=...) under `cotenant run --opportunistic` (whose
    # start-up hook enabled it first) raised "cannot switch to role=None": a role left out was
    # taken for "cap only". It keeps the first call's role, as a name left out does; another role
    # is still refused.
    applied = []
    monkeypatch.setattr(api, "set_memory_cap", lambda size, device=None: applied.append(size))
    as_if_enabled(monkeypatch, role="opportunistic")
    assert cotenant.enable(memory_cap="6GiB") is True
    assert applied == ["6GiB"] and api._state.role == "opportunistic"
    with pytest.raises(RuntimeError, match="cannot switch to role='guaranteed'"):
        cotenant.enable("guaranteed", memory_cap="2GiB")
    assert applied == ["6GiB"]


def test_the_optimizer_safe_point_hooks_into_torch_optimizer_steps(monkeypatch):
    # The wiring to torch's optimizer hooks, on the CPU: a stand-in for the
    # extension records what enable()'s hook asks of it after each step.
    import torch

    calls = []

    class Extension:
        def iteration_boundary(self):
            calls.append("boundary")

        def mark_iteration(self):
            calls.append("iteration")

        def has_pending_migrations(self):
            calls.append("poll")
            return True

        def safe_point(self):
            calls.append("safe_point")
            return 0

    monkeypatch.setattr(api, "_extension", lambda: Extension())
    api._install_optimizer_safe_point()
    try:
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.SGD([weight], lr=0.5)
        weight.sum().backward()
        optimizer.step()
        optimizer.step()
    finally:
        api._state.optimizer_hook.remove()
        api._state.optimizer_hook = None
    assert calls == ["boundary", "iteration", "poll", "safe_point"] * 2
    assert torch.equal(weight.detach(), torch.zeros(3))


def test_enable_after_pytorch_allocated_cuda_memory_says_how_to_fix_it(monkeypatch):
    # PyTorch's allocator already holds memory: enable() refuses before the
    # extension touches the CUDA allocator (torch.cuda stands in for a GPU).
    import torch

    extension_loaded = []
    monkeypatch.delenv("COTENANT_DISABLE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0 if device == 0 else 4096)
    monkeypatch.setattr(api, "_extension", lambda: extension_loaded.append(True))
    with pytest.raises(RuntimeError) as error:
        cotenant.enable()
    message = str(error.value)
    assert "must run before the first CUDA allocation" in message
    assert "already holds 4.00 KiB on cuda:1" in message
    assert "cuda:1" in message and "cotenant run" in message
    assert extension_loaded == [] and not cotenant.is_enabled()


def test_an_explicit_op_holds_a_pause_until_it_ends():
    # Work launched outside ATen (a CUDA graph replay) counts as one op.
    _C = _extension_or_skip()
    _C._count_op_entries(True)
    try:
        before = _C._counted_op_entries()
        _C.begin_explicit_op()
        assert _C.ops_in_flight() == 1 and _C._counted_op_entries() == before + 1
        paused = []
        other = threading.Thread(target=lambda: paused.append(_C._pause_launches(0.2)))
        other.start()
        other.join()
        assert paused == [False], "a pause went ahead while an explicit op was launching"
        _C.end_explicit_op()
        assert _C.ops_in_flight() == 0
        assert _C._pause_launches(1.0)
        _C._resume_launches()
    finally:
        _C._count_op_entries(False)


EXPLICIT_OP_DURING_A_PAUSE = textwrap.dedent("""
    import json, threading, time
    from cotenant import _C
    assert _C._pause_launches(1.0)
    entered = threading.Event()
    def launch(begin, end):
        begin()  # with the GIL, as Python calls it
        entered.set()
        end()
    out = {}
    for name, begin, end in (("explicit_op", _C.begin_explicit_op, _C.end_explicit_op),
                             ("triton", lambda: _C.triton_launch_enter(None), lambda: _C.triton_launch_exit(None))):
        entered.clear()
        thread = threading.Thread(target=launch, args=(begin, end))
        thread.start()
        time.sleep(0.2)  # needs the GIL back: a launch waiting with it would hang here
        waited = not entered.is_set()
        _C._resume_launches()
        thread.join(10)
        out[name] = [waited, entered.is_set()]
        assert _C._pause_launches(1.0)
    _C._resume_launches()
    print(json.dumps(out))
""")


def test_work_launched_outside_aten_waits_out_a_pause_without_the_gil():
    # A CUDA graph replay or a Triton launch reached while launches are
    # paused waits for the pause to end; it begins with the GIL held, and
    # must let it go while it waits (the thread that ends the pause needs it).
    _extension_or_skip()
    done = subprocess.run([sys.executable, "-c", EXPLICIT_OP_DURING_A_PAUSE], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"explicit_op": [True, True], "triton": [True, True]}


def test_cuda_graph_replays_run_as_one_op(monkeypatch):
    _C = _extension_or_skip()
    import torch

    seen = []

    class Graph:
        def replay(self):
            seen.append(_C.ops_in_flight())
            return "replayed"

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(api, "_extension", lambda: _C)
    api._count_graph_replays_as_ops()
    api._count_graph_replays_as_ops()  # once only, however often enable() wires it
    assert Graph().replay() == "replayed"
    assert seen == [1] and _C.ops_in_flight() == 0


def test_a_module_imported_later_is_patched_right_after_its_import(tmp_path, monkeypatch):
    (tmp_path / "cotenant_late_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    api._after_import("cotenant_late_module", lambda module: seen.append(module.VALUE))
    assert seen == []  # not imported yet: nothing to patch
    import cotenant_late_module  # noqa: F401

    assert seen == [1]
    api._after_import("cotenant_late_module", lambda module: seen.append(module.VALUE + 1))
    assert seen == [1, 2]  # already imported: patched at once
    sys.modules.pop("cotenant_late_module", None)


def test_each_triton_launch_of_torch_compile_counts_as_one_op(monkeypatch):
    # Inductor's generated code launches every Triton kernel through
    # CachingAutotuner.run, outside ATen: the launch is bracketed as one op.
    import types

    calls = []

    class Extension:
        def begin_explicit_op(self):
            calls.append("begin")

        def end_explicit_op(self):
            calls.append("end")

        def triton_launch_exit(self):
            calls.append("end-triton")

    class CachingAutotuner:
        def run(self, *args, stream, **kwargs):
            calls.append(("run", args, stream))
            if kwargs.get("fail"):
                raise RuntimeError("launch failed")
            return "launched"

    module = types.SimpleNamespace(CachingAutotuner=CachingAutotuner)
    monkeypatch.setattr(api, "_extension", lambda: Extension())
    api._patch_triton_launcher(module)
    api._patch_triton_launcher(module)  # a second enable() does not wrap twice
    assert CachingAutotuner().run(1, 2, stream=7) == "launched"
    assert calls == ["begin", ("run", (1, 2), 7), "end-triton", "end"]
    calls.clear()
    with pytest.raises(RuntimeError):
        CachingAutotuner().run(stream=0, fail=True)
    assert calls == ["begin", ("run", (), 0), "end-triton", "end"]  # the op ends even when the launch fails


@pytest.fixture
def triton_launch_hooks():
    """Triton's launch hook chains with cotenant's hooks added as enable() adds
    them, and taken out again after the test (they are process-wide)."""
    _C = _extension_or_skip()
    knobs = pytest.importorskip("triton.knobs", reason="Triton is not installed")
    _C._count_op_entries(True)  # installs the interception point (explicit ops need none)
    _C._count_op_entries(False)
    api._add_triton_launch_hooks(knobs)
    api._add_triton_launch_hooks(knobs)  # a second enable() adds nothing
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    try:
        assert enter.calls.count(_C.triton_launch_enter) == 1
        assert leave.calls.count(_C.triton_launch_exit) == 1
        yield _C, enter, leave
    finally:
        enter.remove(_C.triton_launch_enter)
        leave.remove(_C.triton_launch_exit)
    assert _C.ops_in_flight() == 0


def _launch_metadata():
    # What Triton's launcher hands its hooks (CompiledKernel.launch_metadata).
    from triton.compiler.compiler import LazyDict

    return LazyDict({"name": "add_kernel", "function": 0, "stream": 0})


def test_a_triton_launch_waits_while_launches_are_paused(triton_launch_hooks):
    # Triton's generated launcher calls launch_enter_hook(metadata), launches
    # the kernel, then calls launch_exit_hook(metadata): the same calls here,
    # without a GPU.
    _C, enter, leave = triton_launch_hooks
    metadata = _launch_metadata()
    launched = threading.Event()

    def launch():
        enter(metadata)
        launched.set()
        leave(metadata)

    assert _C._pause_launches(1.0)
    try:
        thread = threading.Thread(target=launch)
        thread.start()
        assert not launched.wait(0.3), "a Triton kernel was launched while launches were paused"
    finally:
        _C._resume_launches()
    thread.join(10)
    assert launched.is_set()
    assert _C.ops_in_flight() == 0


def test_a_triton_launch_being_enqueued_holds_off_a_pause(triton_launch_hooks):
    _C, enter, leave = triton_launch_hooks
    metadata = _launch_metadata()
    enter(metadata)
    assert _C.ops_in_flight() == 1
    paused = []
    other = threading.Thread(target=lambda: paused.append(_C._pause_launches(0.2)))
    other.start()
    other.join()
    assert paused == [False], "a pause went ahead while a Triton kernel was being launched"
    leave(metadata)
    assert _C.ops_in_flight() == 0
    assert _C._pause_launches(1.0)
    _C._resume_launches()


def test_a_failed_triton_launch_does_not_hold_launches_forever(triton_launch_hooks):
    # Triton's launcher skips the exit hook when the launch fails: the
    # thread's next launch, or Inductor's wrapper around the launch, ends it.
    _C, enter, leave = triton_launch_hooks
    metadata = _launch_metadata()
    enter(metadata)  # the launch fails: no exit hook
    enter(metadata)
    assert _C.ops_in_flight() == 1
    leave(metadata)
    leave(metadata)  # a second exit ends nothing
    assert _C.ops_in_flight() == 0

    class CachingAutotuner:
        def run(self, *args, stream, **kwargs):
            enter(metadata)
            raise RuntimeError("the launch failed after Triton's enter hook")

    import types

    api._patch_triton_launcher(types.SimpleNamespace(CachingAutotuner=CachingAutotuner))
    with pytest.raises(RuntimeError):
        CachingAutotuner().run(stream=0)
    assert _C.ops_in_flight() == 0
    assert _C._pause_launches(1.0)
    _C._resume_launches()


def test_the_real_triton_launcher_is_the_one_patched():
    # Names the real modules, so a rename in torch or Triton fails here, not silently.
    import importlib

    module = importlib.import_module(api._TRITON_LAUNCHER)
    assert callable(getattr(module.CachingAutotuner, "run", None))
    knobs = importlib.import_module(api._TRITON_KNOBS)
    assert callable(knobs.runtime.launch_enter_hook.add) and callable(knobs.runtime.launch_exit_hook.add)


def test_raw_delete_never_throws_and_says_what_failed(capfd):
    # torch calls raw_delete from destructors (thrust's and workspaces' frees):
    # an exception there would call std::terminate.
    _C = _extension_or_skip()
    _C._raw_delete(0xDEAD000)
    err = capfd.readouterr().err
    assert "cotenant: freeing CUDA memory at 0xdead000 failed, so it stays allocated" in err
    assert "did not allocate" in err


# ---- regions (no GPU: validation and the not-enabled errors) -----------------------------


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_region_needs_a_non_empty_string_name(name):
    with pytest.raises(TypeError, match="non-empty string"):
        cotenant.region(name)


def test_regions_before_enable_raise_saying_to_enable_first():
    with pytest.raises(RuntimeError, match=r"cotenant.enable\(\) first"):
        with cotenant.region("kv_cache"):
            pass
    with pytest.raises(RuntimeError, match=r"cotenant.enable\(\) first"):
        cotenant.pause_region("kv_cache", keep=False)
    with pytest.raises(RuntimeError, match=r"cotenant.enable\(\) first"):
        cotenant.resume_region("kv_cache")
    assert cotenant.regions() == []


def test_the_extension_refuses_to_pause_a_region_when_cotenant_is_not_installed():
    _C = _extension_or_skip()
    with pytest.raises(RuntimeError, match=r"cannot pause region 'kv_cache'.*cotenant.enable\(\) first"):
        _C.pause_region("kv_cache", True)


def test_allocator_benchmark_shows_where_page_move_time_went_busiest_first():
    bench = _load_benchmark_module()
    times = {"map": {"calls": 1024, "ns": 5_000_000}, "unmap": {"calls": 0, "ns": 0},
             "create_host_page": {"calls": 512, "ns": 400_000_000}}
    lines = bench.driver_time_table(times, pages=512)
    assert lines[0].split() == ["driver", "call", "calls", "ms", "us/call", "us/page"]
    assert [line.split()[0] for line in lines[1:]] == ["create_host_page", "map"]  # unmap never called: left out
    assert lines[1].split()[1:] == ["512", "400.00", "781.2", "781.2"]
    assert lines[2].split()[1:] == ["1024", "5.00", "4.9", "9.8"]
    assert bench.driver_time_table(times, pages=0)[1].split()[-1] == "-"


def test_allocator_benchmark_says_where_a_spilled_steps_time_went():
    bench = _load_benchmark_module()
    calls = {"device_synchronize": {"calls": 40, "ns": 20_000_000}, "set_access": {"calls": 100, "ns": 80_000_000},
             "unmap": {"calls": 0, "ns": 0}}
    spilled = {"0pct_s": 0.1, "25pct_s": 0.5, "page_bytes": 2 << 20,
               "25pct_per_step": {"spilled_bytes": 300 << 20, "restored_bytes": 100 << 20, "num_migrations": 200,
                                  "driver_calls": calls}}
    lines = bench.spilled_step_table(spilled)
    assert lines[0].split() == ["on", "the", "host", "step", "ms", "x", "none", "MiB", "out", "MiB", "back", "moves",
                                "syncs", "driver", "ms", "share"]
    assert lines[1].split() == ["25%", "500.0", "5.0", "300.0", "100.0", "200", "40", "100.0", "20%"]
    assert len(lines) == 2  # no 50% run measured: no row
    figures = bench.compute_figures({"spilled": spilled})
    assert figures["spilled_step_driver_share_25pct"] == pytest.approx(0.2)
    assert figures["spilled_step_driver_share_50pct"] is None
    assert bench.spilled_step_table({"error": "boom"}) == ["spilled steps: failed: boom"]


class _HeadroomRecorder:
    def set_host_headroom(self, bytes_):
        self.bytes = bytes_


@pytest.mark.parametrize("own, coordinators, expected", [
    (None, None, 4 * GIB),        # the default
    (GIB, None, GIB),             # the job's own, even below the default
    (None, 8 * GIB, 8 * GIB),     # the node's
    (GIB, 8 * GIB, 8 * GIB),      # a job cannot go below the node's headroom
    (16 * GIB, 8 * GIB, 16 * GIB),
    (0, None, 0),                 # 0: pin until the host refuses
])
def test_the_host_headroom_in_force_is_the_larger_of_the_jobs_and_the_coordinators(own, coordinators, expected):
    saved = (api._state.own_host_headroom, api._state.coordinator_host_headroom)
    try:
        api._state.own_host_headroom, api._state.coordinator_host_headroom = own, coordinators
        recorder = _HeadroomRecorder()
        assert api._apply_host_headroom(recorder) == expected
        assert recorder.bytes == expected
    finally:
        api._state.own_host_headroom, api._state.coordinator_host_headroom = saved
