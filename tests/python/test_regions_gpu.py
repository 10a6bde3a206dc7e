"""Named regions on a real GPU: `with cotenant.region(...)` tags allocations,
pause/resume frees device memory and gives it back at the same addresses.

Each test runs in a fresh process (cotenant must be enabled before the first
CUDA allocation). Marked `gpu`: skipped, with the reason shown, without one.
"""

import textwrap

import pytest
from fresh_process import run_json

pytestmark = pytest.mark.gpu

MIB = 1 << 20


# Device memory the job gave back to the driver: its cuMemRelease calls, in
# bytes of device pages. Not torch.cuda.mem_get_info(): the
# driver's free memory is the whole device's, and other processes (other tests
# run in parallel) allocate meanwhile.
PRELUDE = """
from cotenant import _C
def released():
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    return _C._driver_call_times(device)["release_device_page"]["calls"] * _C._page_bytes(device)
"""


def run_script(body, timeout=300):
    """Runs `body` after cotenant.enable() in a fresh process; returns the JSON it prints last."""
    code = "import json, torch, cotenant\ncotenant.enable()\n" + PRELUDE + textwrap.dedent(body)
    return run_json(code, timeout=timeout)


def test_pause_with_keep_frees_device_memory_and_resume_brings_the_values_back():
    out = run_script("""
        other = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        with cotenant.region("kv_cache"):
            kv = torch.randn(64 << 20, device="cuda")  # 256 MiB
        expected = kv.sum().item()
        ptr = kv.data_ptr()
        torch.cuda.synchronize()
        before = released()
        moved = cotenant.pause_region("kv_cache", keep=True)
        paused = released()
        region = cotenant.memory_stats()["regions"][0]
        state_paused = cotenant.region("kv_cache").state
        other_ok = bool((other == torch.arange(1 << 20, dtype=torch.float32, device="cuda")).all())
        cotenant.resume_region("kv_cache")
        print(json.dumps({"moved": moved, "released": paused - before, "region": region,
                          "state_paused": state_paused, "other_ok": other_ok,
                          "same_ptr": kv.data_ptr() == ptr, "sum_ok": kv.sum().item() == expected,
                          "state": cotenant.region("kv_cache").state}))
    """)
    assert out["moved"] >= 256 * MIB
    assert out["released"] >= 256 * MIB, out
    assert out["region"]["name"] == "kv_cache" and out["region"]["device_bytes"] == 0
    assert out["region"]["host_bytes"] >= 256 * MIB
    assert out["state_paused"] == "paused (kept)"
    assert out["other_ok"] and out["same_ptr"] and out["sum_ok"]
    assert out["state"] == "active"


def test_pause_without_keep_frees_device_memory_and_resume_gives_zeros_at_the_same_address():
    out = run_script("""
        region = cotenant.region("weights")
        with region:
            w = torch.full((64 << 20,), 3.0, device="cuda")  # 256 MiB
        ptr = w.data_ptr()
        torch.cuda.synchronize()
        before = released()
        region.pause(keep=False)
        paused = released()
        host = cotenant.memory_stats()["regions"][0]["host_bytes"]
        device = cotenant.memory_stats()["regions"][0]["device_bytes"]
        region.resume()
        print(json.dumps({"released": paused - before, "host": host, "device": device, "same_ptr": w.data_ptr() == ptr,
                          "zeros": bool((w == 0).all()), "nonzero": int(w.count_nonzero())}))
    """)
    assert out["released"] >= 256 * MIB and out["device"] == 0, out
    assert out["host"] == 0
    assert out["same_ptr"]
    assert out["zeros"], out


def test_allocating_in_a_paused_region_and_pausing_during_capture_raise_with_the_fix():
    out = run_script("""
        with cotenant.region("kv_cache"):
            kv = torch.ones(1 << 20, device="cuda")
        cotenant.pause_region("kv_cache", keep=False)
        errors = {}
        try:
            with cotenant.region("kv_cache"):
                torch.empty(1 << 20, device="cuda")
        except RuntimeError as e:
            errors["allocate"] = str(e)
        del kv  # freeing a paused region's tensor is fine
        cotenant.resume_region("kv_cache")
        try:
            cotenant.pause_region("nope", keep=True)
        except RuntimeError as e:
            errors["unknown"] = str(e)
        with cotenant.region("kv_cache"):
            x = torch.ones(1 << 20, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = x * 2
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                try:
                    cotenant.pause_region("kv_cache", keep=True)
                except RuntimeError as e:
                    errors["capture"] = str(e)
                y = x * 2
        print(json.dumps(errors))
    """)
    assert "resume_region" in out["allocate"]
    assert "'nope'" in out["unknown"] and "'kv_cache'" in out["unknown"]
    assert "CUDA graph" in out["capture"] and "after the capture" in out["capture"]
