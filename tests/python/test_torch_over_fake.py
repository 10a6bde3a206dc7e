"""cotenant inside PyTorch, end to end, on the CPU: torch over the fake CUDA
runtime of tests/fake_cuda (benchmarks/pytorch_allocator/over_fake.py).

Each test runs a fresh Python process that preloads the fake as the
libcudart.so.N of the torch wheel, imports torch (which then sees one CUDA
device, the fake's), enables cotenant and works with CUDA tensors the way a
job does. The path is the product's: torch's allocator interface, cotenant's
CUDAAllocator (csrc/torch), the CudaBackend (csrc/cuda), the driver's virtual
memory calls, copies on streams; only the driver is the fake, which enforces
the real one's rules and counts a violation for anything else. No kernel
runs there, so data goes in and out by copies (tensor.to("cuda"),
tensor.to("cpu")), which is what a spill or a region pause must keep intact.
Every test also asserts that the fake saw no violation.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from fresh_process import run_json

HERE = os.path.dirname(os.path.abspath(__file__))
OVER_FAKE_DIR = os.path.join(HERE, "..", "..", "benchmarks", "pytorch_allocator")
sys.path.insert(0, OVER_FAKE_DIR)
import over_fake  # noqa: E402

MIB = 1 << 20

PRELUDE = r'''
import json, sys
sys.path.insert(0, {over_fake_dir!r})
import over_fake
fake = over_fake.open_preloaded({library!r}, {capacity}, garbage_in_new_pages={garbage}, host_vmm={host_vmm},
                               host_capacity={host_capacity})
import torch
over_fake.check_torch_sees_the_fake(torch)
import cotenant
MIB = 1 << 20

def pattern(count, seed):
    """A CPU tensor of `count` int32 values that differ from block to block."""
    values = torch.arange(count, dtype=torch.int64).mul_(2654435761).add_(seed * 40503)
    return values.remainder_(1 << 31).to(torch.int32)

def same(device_tensor, cpu_tensor):
    return bool(torch.equal(device_tensor.to("cpu"), cpu_tensor))  # a device-to-host copy, no kernel

def longest_stop_of_other_threads(call):
    """Runs call() while another Python thread notes the time every
    millisecond it gets the GIL; (seconds the call took, the longest stretch
    of it in which that thread could not run)."""
    import threading, time
    stamps, stop = [], threading.Event()
    def ticker():
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.001)
    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    began = time.monotonic()
    call()
    ended = time.monotonic()
    stop.set()
    thread.join()
    inside = [began] + [t for t in stamps if began < t < ended] + [ended]
    return ended - began, max(b - a for a, b in zip(inside, inside[1:]))

out = {{}}
'''

EPILOGUE = r'''
out["violations"] = fake.violations()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def library():
    try:
        return over_fake.fake_library()
    except ValueError as error:
        pytest.skip(f"{error} (COTENANT_PYTORCH_REPLAY names the core build's pytorch_replay)")


def run(library, body, capacity=1 << 30, garbage=False, host_vmm=True, host_capacity=None, check_device=True):
    """Runs `body` after the prelude in a fresh process over the fake; the JSON it prints.
    `check_device=False`: the prelude does not ask torch for the device (which
    initializes CUDA); the body must call over_fake.check_torch_sees_the_fake(torch)
    before its first CUDA work."""
    code = PRELUDE.format(over_fake_dir=OVER_FAKE_DIR, library=library, capacity=capacity, garbage=garbage,
                          host_vmm=host_vmm, host_capacity=host_capacity)
    if not check_device:
        code = code.replace("over_fake.check_torch_sees_the_fake(torch)\n", "", 1)
    code += textwrap.dedent(body) + EPILOGUE
    result = run_json(code, env=over_fake.environment(library))
    assert result.pop("violations") == [], "the fake CUDA driver saw calls a real one would refuse"
    return result


def test_torch_statistics_agree_with_cotenants_core(library):
    out = run(library, """
        cotenant.enable()
        xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (100, 4096, 3 << 20, 25 << 20)]
        core = cotenant.memory_stats()
        out["allocated"] = [torch.cuda.memory_allocated(), core["allocated_bytes"]]
        out["reserved"] = [torch.cuda.memory_reserved(), core["reserved_bytes"]]
        out["device_plus_host"] = core["device_bytes"] + core["host_bytes"]
        out["snapshot_total"] = sum(s["total_size"] for s in torch.cuda.memory_snapshot())
        out["count"] = torch.cuda.memory_stats()["allocation.all.current"]
        out["mode"] = core["mode"]
        del xs
        out["after_free"] = torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        out["reserved_after_empty"] = torch.cuda.memory_reserved()
        out["driver_pages_after_empty"] = fake.calls("cuMemMap") - fake.calls("cuMemUnmap")
    """)
    assert out["allocated"][0] == out["allocated"][1] > 28 * MIB
    assert out["reserved"][0] == out["reserved"][1] == out["device_plus_host"] == out["snapshot_total"]
    assert out["count"] == 4
    assert out["mode"] == "remap"
    assert out["after_free"] == 0 and out["reserved_after_empty"] == 0
    assert out["driver_pages_after_empty"] == 0  # every page cotenant mapped went back to the driver


def test_spill_all_and_restore_all_keep_addresses_and_values(library):
    out = run(library, """
        from cotenant import _C
        cotenant.enable()
        data = pattern(4 << 20, seed=1)  # 16 MiB
        x = data.to("cuda")
        ptr = x.data_ptr()
        out["moved_out"] = cotenant.spill_all()
        out["resident_spilled"] = _C.is_device_resident(ptr, 0)
        out["host_bytes"] = cotenant.memory_stats()["host_bytes"]
        out["same_while_spilled"] = same(x, data)  # read from host pages at the device address
        out["moved_in"] = cotenant.restore_all()
        out["resident_after"] = _C.is_device_resident(ptr, 0)
        out["same_after"] = same(x, data)
        out["same_ptr"] = x.data_ptr() == ptr
    """)
    assert out["moved_out"] >= 16 * MIB and out["moved_in"] >= 16 * MIB
    assert out["resident_spilled"] is False and out["host_bytes"] >= 16 * MIB
    assert out["same_while_spilled"] and out["same_after"] and out["same_ptr"]
    assert out["resident_after"] is True


def test_a_job_larger_than_the_device_spills_under_a_cap_instead_of_running_out_of_memory(library):
    """Five 24 MiB tensors on a 64 MiB device. Without a cap the third
    raises PyTorch's OutOfMemoryError, which names the fix; under a cap each
    allocation succeeds, the device holds no more than the cap, and every
    value survives."""
    out = run(library, """
        cotenant.enable()
        datas = [pattern(6 << 20, seed=i) for i in range(5)]
        xs = []
        try:
            for data in datas:
                xs.append(data.to("cuda"))
            out["error"] = None
        except torch.OutOfMemoryError as error:
            out["error"] = str(error)
        out["before_cap"] = len(xs)
        out["reserved_after_oom"] = torch.cuda.memory_reserved()
        out["free_after_oom"] = torch.cuda.mem_get_info()[0]
        cotenant.set_memory_cap("60MiB")
        for data in datas[len(xs):]:
            xs.append(data.to("cuda"))
            cotenant.safe_point()
        stats = cotenant.memory_stats()
        out["device_bytes"], out["host_bytes"] = stats["device_bytes"], stats["host_bytes"]
        out["allocated"] = torch.cuda.memory_allocated()
        out["same"] = [same(x, data) for x, data in zip(xs, datas)]
    """, capacity=64 * MIB)
    assert out["before_cap"] == 2
    assert "cotenant spills to host memory only under a cap" in out["error"]
    # The failed allocation keeps none of the pages it mapped: the rest of the device stays free for others.
    assert out["reserved_after_oom"] == 48 * MIB
    assert out["free_after_oom"] == 16 * MIB
    assert "of which 16.00 MiB is free" in out["error"]
    assert "cotenant.set_memory_cap()" in out["error"]
    assert out["allocated"] == 120 * MIB
    assert out["device_bytes"] <= 60 * MIB
    assert out["host_bytes"] >= 120 * MIB - out["device_bytes"]
    assert out["same"] == [True] * 5


def test_a_host_reserve_pinned_at_enable_serves_the_first_squeeze_without_pinning(library):
    """enable(host_reserve=...) pins host pages before any cap: the first
    squeeze moves pages into them (no cuMemCreate while it spills), and the
    reserve stays through the cap's removal and empty_cache() until it is
    lowered. A size it cannot read is refused with the form it takes."""
    out = run(library, """
        cotenant.enable(host_reserve="16MiB")
        stats = cotenant.memory_stats()
        out["reserve"], out["pool"] = stats["host_reserve_bytes"], stats["host_pool_bytes"]
        out["pinned_at_enable"] = fake.calls("cuMemCreate")
        datas = [pattern(2 << 20, seed=40 + i) for i in range(4)]  # 4 x 8 MiB
        xs = [data.to("cuda") for data in datas]
        creates = fake.calls("cuMemCreate")
        cotenant.set_memory_cap("16MiB")  # moves the pages at once
        out["created_by_the_squeeze"] = fake.calls("cuMemCreate") - creates
        out["host_bytes"] = cotenant.memory_stats()["host_bytes"]
        out["same_squeezed"] = [same(x, data) for x, data in zip(xs, datas)]
        cotenant.set_memory_cap(None)
        torch.cuda.empty_cache()
        out["pool_after_empty_cache"] = cotenant.memory_stats()["host_pool_bytes"]
        out["same_back"] = [same(x, data) for x, data in zip(xs, datas)]
        errors = []
        for bad in (-5, "lots", True):
            try:
                cotenant.reserve_host_memory(bad)
            except (ValueError, TypeError) as error:
                errors.append(str(error))
        out["errors"] = errors
        out["lowered"] = cotenant.reserve_host_memory(0)
        out["pool_after_lowering"] = cotenant.memory_stats()["host_pool_bytes"]
    """)
    assert out["reserve"] == out["pool"] == 16 * MIB
    assert out["pinned_at_enable"] >= 8  # the reserve's 8 host pages
    assert out["host_bytes"] == 16 * MIB
    assert out["created_by_the_squeeze"] == 0
    assert out["same_squeezed"] == [True] * 4 and out["same_back"] == [True] * 4
    assert out["pool_after_empty_cache"] == 16 * MIB
    assert "a host reserve cannot be -5 bytes" in out["errors"][0]
    assert "cannot use 'lots' as a host reserve" in out["errors"][1]
    assert "a host reserve must be bytes (int) or a size string" in out["errors"][2]
    assert out["lowered"] == 0 and out["pool_after_lowering"] == 0


def test_a_host_reserve_the_host_cannot_pin_warns_and_the_job_runs_on(library):
    """A host that pins at most 8 MiB and a reserve of 64 MiB: enable()
    says the job runs without its reserve and why, keeps none of it, and
    the job works; cotenant.reserve_host_memory() itself raises."""
    out = run(library, """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cotenant.enable(host_reserve="64MiB")
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        stats = cotenant.memory_stats()
        out["reserve"], out["pool"] = stats["host_reserve_bytes"], stats["host_pool_bytes"]
        data = pattern(1 << 20, seed=50)
        out["same"] = same(data.to("cuda"), data)
        try:
            cotenant.reserve_host_memory("64MiB")
            out["raised"] = None
        except RuntimeError as error:
            out["raised"] = str(error)
    """, host_capacity=8 * MIB)
    assert len(out["warnings"]) == 1
    assert "runs WITHOUT its host reserve" in out["warnings"][0] and "ulimit -l" in out["warnings"][0]
    assert out["reserve"] == 0 and out["pool"] == 0
    assert out["same"]
    assert "cannot reserve 64.00 MiB of host memory" in out["raised"]


def test_a_host_headroom_stops_a_squeeze_and_an_allocation_past_it_names_it(library):
    """A headroom larger than any host: nothing may be pinned. The squeeze
    leaves the pages on the device (pending, values intact), an allocation
    over the cap raises torch's OutOfMemoryError naming the headroom, and
    set_host_headroom(0) lets the next safe point finish the squeeze."""
    out = run(library, """
        cotenant.enable(host_headroom="1024TiB")
        out["headroom"] = cotenant.host_headroom()
        datas = [pattern(2 << 20, seed=60 + i) for i in range(4)]  # 4 x 8 MiB
        xs = [data.to("cuda") for data in datas]
        creates = fake.calls("cuMemCreate")
        cotenant.set_memory_cap("16MiB")
        stats = cotenant.memory_stats()
        out["held"] = {k: stats[k] for k in ("device_bytes", "host_bytes", "pending_spill_bytes",
                                             "host_headroom_bytes", "host_headroom_refusals")}
        out["available"] = stats["host_available_bytes"]
        from cotenant.coordinator.host_memory import read_meminfo
        out["mem_available"] = read_meminfo()["available_bytes"]
        out["pinned_while_held"] = fake.calls("cuMemCreate") - creates
        try:
            xs.append(pattern(2 << 20, seed=70).to("cuda"))
            out["oom"] = None
        except torch.OutOfMemoryError as error:
            out["oom"] = str(error)
        out["same_held"] = [same(x, data) for x, data in zip(xs, datas)]
        out["in_force"] = cotenant.set_host_headroom(0)
        cotenant.safe_point()
        stats = cotenant.memory_stats()
        out["after"] = {k: stats[k] for k in ("device_bytes", "host_bytes", "pending_spill_bytes")}
        out["same_after"] = [same(x, data) for x, data in zip(xs, datas)]
        errors = []
        for bad in (-1, "plenty", None):
            try:
                cotenant.set_host_headroom(bad)
            except (ValueError, TypeError) as error:
                errors.append(str(error))
        out["errors"] = errors
    """)
    assert out["headroom"] == 1024 << 40
    held = out["held"]
    assert held["device_bytes"] == 32 * MIB and held["host_bytes"] == 0 and held["pending_spill_bytes"] == 16 * MIB
    assert held["host_headroom_bytes"] == 1024 << 40 and held["host_headroom_refusals"] >= 1
    # What the job may take: MemAvailable, or less where its memory cgroup's limit is nearer.
    assert isinstance(out["available"], int) and 0 < out["available"] <= out["mem_available"] + (512 << 20)
    assert out["pinned_while_held"] == 0
    assert "the host is at its headroom" in out["oom"] and "COTENANT_HOST_HEADROOM" in out["oom"]
    assert out["same_held"] == [True] * 4
    assert out["in_force"] == 0
    assert out["after"] == {"device_bytes": 16 * MIB, "host_bytes": 16 * MIB, "pending_spill_bytes": 0}
    assert out["same_after"] == [True] * 4
    assert "a host headroom cannot be -1 bytes" in out["errors"][0]
    assert "cannot use 'plenty' as a host headroom" in out["errors"][1]
    assert "set_host_headroom() needs a size" in out["errors"][2]


def test_without_host_vmm_allocations_over_the_cap_go_to_pinned_host_memory(library):
    """On a device that cannot map host pages, cotenant runs in pinned
    fallback mode: what does not fit under the cap is allocated in pinned
    host memory the device reaches directly; values survive and, once freed,
    that memory goes back."""
    out = run(library, """
        cotenant.enable()
        out["mode"] = cotenant.memory_stats()["mode"]
        cotenant.set_memory_cap("32MiB")
        datas = [pattern(4 << 20, seed=20 + i) for i in range(4)]  # 4 x 16 MiB
        xs = [data.to("cuda") for data in datas]
        stats = cotenant.memory_stats()
        out["device_bytes"], out["host_bytes"] = stats["device_bytes"], stats["host_bytes"]
        out["pinned_allocs"] = fake.calls("cuMemHostAlloc")
        out["same"] = [same(x, data) for x, data in zip(xs, datas)]
        del xs
        torch.cuda.empty_cache()
        out["host_after"] = cotenant.memory_stats()["host_bytes"]
        out["pinned_frees"] = fake.calls("cuMemFreeHost")
    """, host_vmm=False)
    assert out["mode"] == "pinned_fallback"
    assert out["device_bytes"] <= 32 * MIB and out["host_bytes"] >= 32 * MIB
    assert out["pinned_allocs"] >= 2
    assert out["same"] == [True] * 4
    assert out["host_after"] == 0 and out["pinned_frees"] == out["pinned_allocs"]


def test_the_fix_the_out_of_memory_message_names_works_spill_without_a_cap(library):
    """COTENANT_SPILL_WITHOUT_CAP=1, which the OutOfMemoryError names: with
    no cap, what does not fit on the full device spills to the host."""
    out = run(library, """
        import os
        os.environ["COTENANT_SPILL_WITHOUT_CAP"] = "1"
        cotenant.enable()
        datas = [pattern(6 << 20, seed=30 + i) for i in range(5)]  # 5 x 24 MiB on a 64 MiB device
        xs = []
        for data in datas:
            xs.append(data.to("cuda"))
            cotenant.safe_point()
        stats = cotenant.memory_stats()
        out["cap"] = stats["memory_cap"]
        out["device_bytes"], out["host_bytes"] = stats["device_bytes"], stats["host_bytes"]
        out["same"] = [same(x, data) for x, data in zip(xs, datas)]
    """, capacity=64 * MIB)
    assert out["cap"] is None
    assert out["device_bytes"] <= 64 * MIB and out["host_bytes"] >= 120 * MIB - 64 * MIB
    assert out["same"] == [True] * 5


def test_mem_get_info_reports_the_cap_so_a_job_that_sizes_itself_fits_under_it(library):
    """A job that sizes a buffer from torch.cuda.mem_get_info(), as inference
    servers size their KV cache, fits it under the cap instead of filling the
    1 GiB device and spilling; without a cap the driver's figures come back."""
    out = run(library, """
        def device_bytes():
            return cotenant.memory_stats()["device_bytes"]

        cotenant.enable(memory_cap="96MiB")
        weights = pattern(8 << 20, seed=1).to("cuda")  # 32 MiB
        out["held"] = device_bytes()
        out["capped"] = torch.cuda.mem_get_info()
        out["spellings"] = [torch.cuda.mem_get_info("cuda:0"), torch.cuda.mem_get_info(torch.device("cuda", 0)),
                            torch.cuda.memory.mem_get_info(0)]
        out["driver"] = torch.cuda.mem_get_info.__wrapped__()
        free, total = torch.cuda.mem_get_info()
        cache = torch.empty(int(free * 0.9) // 4, dtype=torch.int32, device="cuda")
        cotenant.safe_point()
        stats = cotenant.memory_stats()
        out["cache_device"], out["cache_host"] = stats["device_bytes"], stats["host_bytes"]
        out["after_cache"] = torch.cuda.mem_get_info()
        cotenant.set_memory_cap("16MiB")  # below what the job holds: no room left
        out["over"] = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(0.25)  # a cap of 256 MiB
        cotenant.safe_point()
        out["fraction"], out["fraction_held"] = torch.cuda.mem_get_info(), device_bytes()
        cotenant.set_memory_cap(None)
        out["uncapped"], out["uncapped_driver"] = torch.cuda.mem_get_info(), torch.cuda.mem_get_info.__wrapped__()
        out["same"] = same(weights, pattern(8 << 20, seed=1))
    """)
    cap = 96 * MIB
    assert out["held"] >= 32 * MIB
    assert out["capped"] == [cap - out["held"], cap]
    assert out["spellings"] == [out["capped"]] * 3
    assert out["driver"][1] == 1 << 30 and out["driver"][0] > out["capped"][0]
    # The buffer sized from the capped figures fits: nothing spilled, the device at or under the cap.
    assert out["cache_host"] == 0 and out["cache_device"] <= cap
    assert out["after_cache"] == [cap - out["cache_device"], cap]
    assert out["over"] == [0, 16 * MIB]
    assert out["fraction"] == [256 * MIB - out["fraction_held"], 256 * MIB]
    assert out["uncapped"] == out["uncapped_driver"] and out["uncapped"][1] == 1 << 30
    assert out["same"]


def test_cache_info_answers_what_an_allocation_could_get_as_cudnn_sizes_its_workspace_by_it(library):
    """torch's cacheInfo (cuDNN's workspace limit) is the largest block an
    allocation on the current stream could get: a cached hole, or the free
    pages' room (under the cap, the room below it). The arena's free tail is
    as large as the device; counted whole, it promised cuDNN 1 GiB under a
    64 MiB cap, a workspace that would have spilled."""
    out = run(library, """
        from cotenant import _C
        cotenant.enable(memory_cap="64MiB")
        hole = torch.empty(10 * MIB, dtype=torch.uint8, device="cuda")
        after = torch.empty(1 * MIB, dtype=torch.uint8, device="cuda")
        del hole
        held = cotenant.memory_stats()["device_bytes"]
        out["held"] = held
        out["largest"] = _C._cache_info(0)
        out["given"] = _C._cache_info(0, 300 * MIB)  # a caller's own guess stays when larger
        workspace = torch.empty(out["largest"], dtype=torch.uint8, device="cuda")
        cotenant.safe_point()
        stats = cotenant.memory_stats()
        out["device"], out["host"] = stats["device_bytes"], stats["host_bytes"]
        del workspace
        torch.cuda.empty_cache()
        cotenant.set_memory_cap(None)
        out["uncapped"], out["free"] = _C._cache_info(0), torch.cuda.mem_get_info()[0]
        with cotenant.region("kv"):
            out["fresh_region"] = _C._cache_info(0)
    """)
    assert out["held"] == 12 * MIB  # pages 0-5: the 10 MiB hole and the page under `after`
    # The tail's mapped MiB and new pages up to the cap: 1 + (64 - 12) MiB, more than the hole.
    assert out["largest"] == 53 * MIB
    assert out["given"] == 300 * MIB
    # The promise holds: a workspace of that size stays on the device, at the cap.
    assert out["host"] == 0 and out["device"] == 64 * MIB
    # Without a cap: the device's free memory (a request larger than the
    # arena's tail, 1 GiB less 11 MiB, gets an arena of its own).
    assert out["uncapped"] == out["free"] and out["free"] > 1000 * MIB
    assert out["fresh_region"] == out["free"]  # a region not yet allocated in holds no block


def test_the_users_cap_covers_the_jobs_region_and_follows_it_as_it_grows(library):
    """cotenant.set_memory_cap caps the job, its region included: the region
    is never capped or moved, so the main allocator gets the rest, and follows
    the region as it grows at the next iteration mark."""
    out = run(library, """
        cotenant.enable()
        with cotenant.region("kv"):
            kv = pattern(8 << 20, seed=2).to("cuda")  # 32 MiB
        data = pattern(16 << 20, seed=3).to("cuda")  # 64 MiB
        cotenant.set_memory_cap("64MiB")
        cotenant.safe_point()

        def now():
            stats = cotenant.memory_stats()
            region = [r for r in cotenant.regions() if r["name"] == "kv"][0]
            return {"cap": cotenant.memory_cap(), "stats_cap": stats["memory_cap"],
                    "main_cap": stats["raw"]["memory_cap"], "main_device": stats["device_bytes"],
                    "main_host": stats["host_bytes"], "region_device": region["device_bytes"],
                    "info": list(torch.cuda.mem_get_info()), "fraction": torch.cuda.get_per_process_memory_fraction()}

        out["first"] = now()
        with cotenant.iteration():
            with cotenant.region("kv"):
                more = pattern(4 << 20, seed=4).to("cuda")  # 16 MiB more in the region
        cotenant.safe_point()
        out["grown"] = now()
        cotenant.set_memory_cap(None)
        cotenant.safe_point()
        out["lifted"] = now()
        out["same"] = same(kv, pattern(8 << 20, seed=2)) and same(data, pattern(16 << 20, seed=3)) and \
            same(more, pattern(4 << 20, seed=4))
    """)
    first, grown, lifted = out["first"], out["grown"], out["lifted"]
    assert first["cap"] == 64 * MIB
    assert first["main_cap"] == first["stats_cap"] == 32 * MIB  # 64 MiB less the region's 32
    assert first["region_device"] == 32 * MIB
    assert first["main_device"] <= 32 * MIB and first["main_host"] >= 32 * MIB
    # mem_get_info speaks of the job: the cap is its total, free what all of it may still place.
    assert first["info"] == [64 * MIB - 32 * MIB - first["main_device"], 64 * MIB]
    assert first["fraction"] == 64 / 1024
    assert grown["cap"] == 64 * MIB and grown["region_device"] == 48 * MIB
    assert grown["main_cap"] == 16 * MIB and grown["main_device"] <= 16 * MIB
    assert lifted["cap"] is None and lifted["main_cap"] in (None, 2**64 - 1, -1)
    assert lifted["main_host"] == 0
    assert out["same"]


def test_a_coordinators_cap_and_the_users_hold_together_the_lower_one_binding(library):
    """The job's cap has two sources, the user's and the coordinator's; the
    lower holds, and lifting one leaves the other in force."""
    out = run(library, """
        import os, time
        from cotenant import _core, _C
        cotenant.enable()
        data = pattern(16 << 20, seed=5).to("cuda")  # 64 MiB
        name = f"/cotenant-test-caps-{os.getpid()}"
        block = _core.JobBlock.create(name, job_id=1, job_name="caps", role="cap_only", device=0,
                                      pid=os.getpid(), uid=os.getuid())
        _C.start_job_channel(name, 0)

        def settled(cap, device):
            # The channel's thread applies the coordinator's cap and may run the safe point that
            # moves the pages (a safe point on this thread then finds it taken): wait for both.
            deadline = time.time() + 30
            while True:
                cotenant.safe_point()
                now = {"cap": cotenant.memory_cap(), "device": cotenant.memory_stats()["device_bytes"]}
                if now == {"cap": cap, "device": device} or time.time() > deadline:
                    return now
                time.sleep(0.01)

        block.set_control(memory_cap=48 * MIB)
        out["coordinator"] = settled(48 * MIB, 48 * MIB)
        cotenant.set_memory_cap("32MiB")
        out["user_lower"] = settled(32 * MIB, 32 * MIB)
        cotenant.set_memory_cap(None)
        out["user_lifted"] = settled(48 * MIB, 48 * MIB)
        cotenant.set_memory_cap("96MiB")
        out["user_higher"] = settled(48 * MIB, 48 * MIB)
        block.set_control(memory_cap=None)
        out["coordinator_lifted"] = settled(96 * MIB, 64 * MIB)
        block.set_control(memory_cap=48 * MIB)
        settled(48 * MIB, 48 * MIB)
        _C.stop_job_channel()  # as disable() does for a channel it started
        cotenant.disable()  # leaves the coordinator: its cap goes with it, the user's too
        cotenant.safe_point()
        out["disabled"] = {"cap": cotenant.memory_cap(), "device": cotenant.memory_stats()["device_bytes"]}
        block.unlink()
        out["same"] = same(data, pattern(16 << 20, seed=5))
    """)
    assert out["coordinator"] == {"cap": 48 * MIB, "device": 48 * MIB}
    assert out["user_lower"] == {"cap": 32 * MIB, "device": 32 * MIB}
    assert out["user_lifted"] == {"cap": 48 * MIB, "device": 48 * MIB}
    assert out["user_higher"] == {"cap": 48 * MIB, "device": 48 * MIB}
    assert out["coordinator_lifted"] == {"cap": 96 * MIB, "device": 64 * MIB}
    assert out["disabled"] == {"cap": None, "device": 64 * MIB}
    assert out["same"]


def test_a_cap_cut_below_the_working_set_and_raised_again_keeps_the_values(library):
    out = run(library, """
        cotenant.enable()
        datas = [pattern(4 << 20, seed=10 + i) for i in range(3)]  # 3 x 16 MiB
        xs = [data.to("cuda") for data in datas]
        cotenant.set_memory_cap("32MiB")
        cotenant.safe_point()
        capped = cotenant.memory_stats()
        out["capped_device"], out["capped_host"] = capped["device_bytes"], capped["host_bytes"]
        out["same_capped"] = [same(x, data) for x, data in zip(xs, datas)]
        cotenant.set_memory_cap(None)
        cotenant.safe_point()
        free = cotenant.memory_stats()
        out["free_device"], out["free_host"] = free["device_bytes"], free["host_bytes"]
        out["same_after"] = [same(x, data) for x, data in zip(xs, datas)]
    """)
    assert out["capped_device"] <= 32 * MIB and out["capped_host"] >= 16 * MIB
    assert out["same_capped"] == [True] * 3
    assert out["free_host"] == 0 and out["free_device"] >= 48 * MIB
    assert out["same_after"] == [True] * 3


def test_a_paused_region_gives_its_device_memory_back_and_its_values_on_resume(library):
    out = run(library, """
        cotenant.enable()
        other_data, kv_data = pattern(1 << 20, seed=3), pattern(16 << 20, seed=4)  # 4 and 64 MiB
        other = other_data.to("cuda")
        with cotenant.region("kv_cache"):
            kv = kv_data.to("cuda")
        ptr = kv.data_ptr()
        free_before = torch.cuda.mem_get_info()[0]
        out["moved"] = cotenant.pause_region("kv_cache", keep=True)
        out["freed"] = torch.cuda.mem_get_info()[0] - free_before
        out["region"] = cotenant.memory_stats()["regions"][0]
        out["state_paused"] = cotenant.region("kv_cache").state
        out["other_same"] = same(other, other_data)
        cotenant.resume_region("kv_cache")
        out["same_ptr"] = kv.data_ptr() == ptr
        out["kv_same"] = same(kv, kv_data)
        out["state"] = cotenant.region("kv_cache").state
    """)
    assert out["moved"] >= 64 * MIB and out["freed"] >= 64 * MIB
    assert out["region"]["name"] == "kv_cache" and out["region"]["device_bytes"] == 0
    assert out["state_paused"] == "paused (kept)" and out["state"] == "active"
    assert out["other_same"] and out["same_ptr"] and out["kv_same"]


def test_a_region_paused_with_keep_uses_the_host_reserve_and_pins_nothing(library):
    """The host reserve is the device's: a region's kept pause draws its host
    pages from it (no cuMemCreate while it pauses, twice over), and the
    resume gives them back to it, so the pinned memory stays the reserve."""
    out = run(library, """
        cotenant.enable(host_reserve="64MiB")
        kv_data = pattern(16 << 20, seed=6)  # 64 MiB
        with cotenant.region("kv_cache"):
            kv = kv_data.to("cuda")
        created, pools, same_values = [], [], []
        for _ in range(2):
            before = fake.calls("cuMemCreate")
            cotenant.pause_region("kv_cache", keep=True)
            created.append(fake.calls("cuMemCreate") - before)
            same_values.append(same(kv, kv_data))
            cotenant.resume_region("kv_cache")
            pools.append(cotenant.memory_stats()["host_pool_bytes"])
            same_values.append(same(kv, kv_data))
        out["created"], out["pools"], out["same"] = created, pools, same_values
    """)
    assert out["created"] == [0, 0]
    assert out["pools"] == [64 * MIB, 64 * MIB]
    assert out["same"] == [True] * 4


def test_a_region_paused_without_keep_resumes_as_zeros_at_the_same_address(library):
    """New pages hold garbage here, as the driver promises nothing: the zeros
    must be cotenant's."""
    out = run(library, """
        cotenant.enable()
        with cotenant.region("scratch"):
            x = pattern(4 << 20, seed=5).to("cuda")  # 16 MiB
        ptr = x.data_ptr()
        out["moved"] = cotenant.pause_region("scratch", keep=False)
        out["device_paused"] = cotenant.memory_stats()["regions"][0]["device_bytes"]
        cotenant.resume_region("scratch")
        out["same_ptr"] = x.data_ptr() == ptr
        out["zeros"] = same(x, torch.zeros(4 << 20, dtype=torch.int32))
    """, garbage=True)
    assert out["device_paused"] == 0
    assert out["same_ptr"] and out["zeros"]


def test_an_allocation_takes_the_room_another_allocators_cache_holds_before_an_oom(library):
    """The default pool's cache fills the device when a region allocates,
    and a region's cache when the default pool allocates: as under PyTorch's
    allocator (one cache per device, released before it reports an OOM),
    the allocation succeeds, and no OOM is counted."""
    out = run(library, """
        cotenant.enable()
        big = torch.empty(200 * MIB, dtype=torch.uint8, device="cuda")
        del big  # 200 MiB of the 256 cached by the default pool
        with cotenant.region("kv_cache"):
            kv = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
        out["region_device_bytes"] = cotenant.memory_stats()["regions"][0]["device_bytes"]
        del kv  # 128 MiB cached by the region
        x = torch.empty(160 * MIB, dtype=torch.uint8, device="cuda")
        out["main_device_bytes"] = cotenant.memory_stats()["device_bytes"]
        out["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]
    """, capacity=256 * MIB)
    assert out == {"region_device_bytes": 128 * MIB, "main_device_bytes": 160 * MIB, "num_ooms": 0}


def test_record_stream_holds_a_block_until_the_other_stream_is_done(library):
    """A side stream's copy reads x after x is freed on the default stream;
    record_stream must keep x's block from the next allocation until that
    copy has run. The fake holds the queued copy until someone waits."""
    out = run(library, """
        cotenant.enable()
        data = pattern(4 << 20, seed=8)
        x = data.to("cuda")
        y = torch.empty_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        fake.hold_streams()
        with torch.cuda.stream(side):
            y.copy_(x)  # queued on the side stream, held
        x.record_stream(side)
        x_ptr = x.data_ptr()
        del x
        z = pattern(4 << 20, seed=9).to("cuda")  # waits for its own copy: the hold ends, both streams run
        out["reused_early"] = z.data_ptr() == x_ptr
        side.synchronize()
        out["y_same"] = same(y, data)
        del z
        torch.cuda.synchronize()
        w = torch.empty(4 << 20, dtype=torch.int32, device="cuda")
        out["reused_after"] = w.data_ptr() == x_ptr
    """)
    assert out["reused_early"] is False
    assert out["y_same"]
    assert out["reused_after"] is True  # once the side stream is done, the block is free again


# record_stream on a block of a MemPool while allocations go to it
# (torch.cuda.use_mem_pool; a graph capture routes the same way): the free
# may not record events then, so PyTorch's allocator holds the block back
# until the routing ends instead of letting the pool reuse it at once.
RECORDED_IN_A_POOL = """
    data = pattern(4 << 20, seed=8)
    pool = torch.cuda.MemPool()
    side = torch.cuda.Stream()
    with torch.cuda.use_mem_pool(pool):
        x = data.to("cuda")
        y = torch.empty_like(x)
        side.wait_stream(torch.cuda.current_stream())
        fake.hold_streams()
        with torch.cuda.stream(side):
            y.copy_(x)  # queued on the side stream, held
        x.record_stream(side)
        x_ptr = x.data_ptr()
        del x
        z = pattern(4 << 20, seed=9).to("cuda")  # waits for its own copy: the hold ends, both streams run
        out["reused_early"] = z.data_ptr() == x_ptr
    side.synchronize()
    out["y_same"] = same(y, data)
    del y, z
    torch.cuda.synchronize()
    out["allocated_after"] = torch.cuda.memory_allocated()
"""


def test_record_stream_holds_a_pool_block_while_allocations_are_routed_to_the_pool(library):
    native = run(library, RECORDED_IN_A_POOL)
    ours = run(library, "cotenant.enable()\n" + textwrap.dedent(RECORDED_IN_A_POOL))
    expected = {"reused_early": False, "y_same": True, "allocated_after": 0}
    assert native == expected
    assert ours == expected


def test_spilling_waits_for_work_in_flight_on_the_pages(library):
    """A slow copy on a side stream reads x when spill_all() moves x's pages:
    the move must wait for it (the fake counts a violation for an unmap or
    a copy under work in flight), and the copy must see x's values."""
    out = run(library, """
        cotenant.enable()
        data = pattern(4 << 20, seed=12)
        x = data.to("cuda")
        y = torch.empty_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        fake.set_delay(50_000)  # 50 ms per queued copy
        with torch.cuda.stream(side):
            y.copy_(x)
        out["moved"] = cotenant.spill_all()
        fake.set_delay(0)
        side.synchronize()
        out["y_same"] = same(y, data)
        out["x_same"] = same(x, data)
    """)
    assert out["moved"] >= 16 * MIB
    assert out["y_same"] and out["x_same"]


def test_a_safe_point_at_op_entry_lets_the_other_python_threads_run_while_pages_move(library):
    """An op that begins with the GIL held (assignment through an index)
    runs the safe point a lowered cap left pending: its device synchronize
    and page copies (50 ms each here) must not stop the job's other Python
    threads (a DataLoader's pin-memory thread, a logger) for that long."""
    out = run(library, """
        from cotenant import _C
        cotenant.enable()
        data = pattern(4 << 20, seed=21)  # 16 MiB: 8 pages
        x = data.to("cuda")
        _C.set_memory_cap(0, 8 * MIB)  # pending: the next op's entry moves the pages
        fake.set_delay(50_000)  # 50 ms per queued copy
        def assign():
            x[:4] = data[:4]  # enters its op holding the GIL
        out["op_s"], out["longest_stop_s"] = longest_stop_of_other_threads(assign)
        fake.set_delay(0)
        out["host_bytes"] = cotenant.memory_stats()["host_bytes"]
        out["same"] = same(x, data)
    """)
    assert out["host_bytes"] >= 8 * MIB  # the op's entry moved the pages
    assert out["op_s"] >= 0.15  # four or more copies of 50 ms: the wait the test is about
    assert out["longest_stop_s"] < 0.1, out  # held, the other thread stopped for all the copies
    assert out["same"]


def test_a_child_forked_while_launches_are_paused_runs_its_ops(library):
    """A thread of the job holds the launch pause (the job channel's, while
    the coordinator suspends the job or a cap's safe point runs) when
    another forks a child (a DataLoader's worker). The child has no thread
    to end that pause: its ops must not wait for one."""
    out = run(library, """
        import os, signal, threading
        from cotenant import _C
        cotenant.enable()
        x = torch.arange(4).to("cuda")
        held, release = threading.Event(), threading.Event()
        def hold():
            held.set() if _C._pause_launches(5.0) else None
            release.wait()
            _C._resume_launches()
        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        child = os.fork()
        if child == 0:
            signal.alarm(10)  # a child that waits for the pause forever is ended here
            os._exit(0 if int(torch.arange(6).sum()) == 15 else 1)
        release.set()
        holder.join()
        out["child"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        out["parent"] = x.to("cpu").tolist()  # the parent's ops run on after the pause
    """)
    assert out == {"child": 0, "parent": [0, 1, 2, 3]}


def test_a_child_forked_before_cotenant_used_cuda_enables_it_and_moves_its_pages_at_op_entry(library):
    """A process that loaded cotenant's extension but has not used CUDA
    through it forks workers that enable cotenant themselves: each child is
    a job like any other, and a cap there must move pages at op entry. (A
    child forked after cotenant used CUDA cannot use CUDA and intercepts
    nothing: the test above; enable() itself initializes CUDA.)"""
    out = run(library, """
        import os, signal
        from cotenant import _C  # loaded, CUDA untouched
        child = os.fork()
        if child == 0:
            signal.alarm(20)
            over_fake.check_torch_sees_the_fake(torch)
            cotenant.enable()
            data = pattern(4 << 20, seed=8)  # 16 MiB: 8 pages
            x = data.to("cuda")
            _C.set_memory_cap(0, 8 * MIB)  # pending: the next op's entry moves the pages
            y = data[:4].to("cuda")  # an op: its entry moves the pages (the fake runs copies, not kernels)
            moved = cotenant.memory_stats()["host_bytes"] >= 8 * MIB
            os._exit(0 if moved and same(x, data) and same(y, data[:4]) else 1)
        out["child"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        over_fake.check_torch_sees_the_fake(torch)
        cotenant.enable()
        out["parent"] = torch.arange(3).to("cuda").to("cpu").tolist()
    """, check_device=False)
    assert out == {"child": 0, "parent": [0, 1, 2]}


def test_an_op_waiting_at_the_gate_lets_the_other_python_threads_run(library):
    """An op held at the gate may have begun with the GIL held (assignment
    through an index does); waiting with it would stop every Python thread
    of the job, the one that raises the share among them (a deadlock). Over
    the fake: the assignment's copy into a CUDA tensor is a copy, no kernel."""
    out = run(library, """
        import threading, time
        from cotenant import _C
        cotenant.enable(role="opportunistic")
        x = torch.arange(4.0).to("cuda")
        done = threading.Event()

        def worker():
            x[1:3] = torch.tensor([5.0, 6.0])  # enters its ops holding the GIL
            done.set()

        cotenant.gate.set_share(0)
        thread = threading.Thread(target=worker)
        thread.start()
        time.sleep(0.3)  # needs the GIL back
        out["held"] = not done.is_set()
        out["waiting"] = _C.gate_stats()["waiting"]
        cotenant.gate.set_share(1)
        thread.join(10)
        out["done"] = done.is_set()
        out["values"] = x.to("cpu").tolist()
    """)
    assert out == {"held": True, "waiting": 1, "done": True, "values": [0.0, 5.0, 6.0, 3.0]}


def test_work_launched_outside_aten_lets_the_gil_go_while_it_waits_at_the_gate(library):
    """Hand-launched kernels in cotenant.gate(), CUDA graph replays and
    Triton launches enter as one op each, with the GIL held (as an ATen op's
    entry is; a launch admitted at once costs no GIL switch). Held at an
    opportunistic job's gate they must let it go: the thread that lets them
    through needs it."""
    out = run(library, """
        import os, threading, time
        from cotenant import _C, _core
        segment = f"/cotenant-test-explicit-{os.getpid()}"
        _core.GpuPeerSegment.remove(segment)
        _C.gate_activate("opportunistic", 0, segment)
        torch.empty(1, device="cuda")  # the gate's markers go on the current stream
        launches = {
            "gate": (_C.gate_enter, _C.gate_exit),
            "explicit_op": (_C.begin_explicit_op, _C.end_explicit_op),
            "triton": (lambda: _C.triton_launch_enter(None), lambda: _C.triton_launch_exit(None)),
        }
        for name, (enter, leave) in launches.items():
            done = threading.Event()
            def worker():
                enter()
                leave()
                done.set()
            _C.gate_set_share(0.0)
            thread = threading.Thread(target=worker)
            thread.start()
            time.sleep(0.3)
            held = not done.is_set()
            _C.gate_set_share(1.0)  # needs the GIL the held launch began with
            thread.join(10)
            out[name] = {"held": held, "done": done.is_set()}
        _C.gate_deactivate()
        _core.GpuPeerSegment.remove(segment)
    """)
    for name in ("gate", "explicit_op", "triton"):
        assert out[name] == {"held": True, "done": True}, (name, out)


def test_a_cap_that_gives_cache_back_waits_for_the_device_without_the_gil(library):
    """Lowering the cap gives cached pages back after a device synchronize;
    work queued on the device (four 50 ms copies here) makes that wait long,
    and the job's other Python threads must run on meanwhile, as they do
    through torch.cuda.synchronize()."""
    out = run(library, """
        from cotenant import _C
        cotenant.enable()
        data = pattern(4 << 20, seed=22)  # 16 MiB
        x = data.to("cuda")
        cached = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
        del cached  # 16 MiB of cached pages
        side = torch.cuda.Stream()
        fake.set_delay(50_000)  # 50 ms per queued copy
        with torch.cuda.stream(side):
            for _ in range(4):
                x.copy_(data, non_blocking=True)
        # under what is reserved: the cache goes, after a synchronize
        out["call_s"], out["longest_stop_s"] = longest_stop_of_other_threads(lambda: _C.set_memory_cap(0, 20 * MIB))
        fake.set_delay(0)
        out["reserved"] = torch.cuda.memory_reserved()
        out["same"] = same(x, data)
    """)
    assert out["reserved"] <= 20 * MIB  # the cache went
    assert out["call_s"] >= 0.1  # it waited for the queued copies: the wait the test is about
    assert out["longest_stop_s"] < 0.05, out
    assert out["same"]


def test_cap_changes_from_another_thread_keep_every_value(library):
    """A job allocates, copies and frees tensors of many sizes while another
    thread cuts the cap to a third of what it holds, lifts it and restores
    everything, over and over: every value read back is the one written."""
    out = run(library, """
        import random, threading, time
        cotenant.enable()
        stop = threading.Event()
        def move_the_cap():
            held = None
            while not stop.is_set():
                held = held or cotenant.memory_stats()["device_bytes"]
                cotenant.set_memory_cap(max(held // 3, 8 << 20))
                time.sleep(0.005)
                cotenant.set_memory_cap(None)
                cotenant.restore_all()
                time.sleep(0.005)
        rng = random.Random(0)
        live, wrong, checks = [], 0, 0
        for seed in range(20):  # a warm-up, so the mover has something to cut
            live.append((pattern(rng.randrange(1, 1 << 20), seed), None))
        live = [(data, data.to("cuda")) for data, _ in live]
        mover = threading.Thread(target=move_the_cap)
        mover.start()
        try:
            for step in range(150):
                if live and rng.random() < 0.45:
                    data, tensor = live.pop(rng.randrange(len(live)))
                    wrong += not same(tensor, data)
                    checks += 1
                else:
                    data = pattern(rng.randrange(1, 1 << 20), 100 + step)
                    live.append((data, data.to("cuda")))
                cotenant.safe_point()
        finally:
            stop.set()
            mover.join()
        for data, tensor in live:
            wrong += not same(tensor, data)
            checks += 1
        out["wrong"], out["checks"] = wrong, checks
        out["spilled"] = cotenant.memory_stats()["spilled_bytes"]
    """)
    assert out["checks"] > 80
    assert out["wrong"] == 0
    assert out["spilled"] > 0  # the cap did move pages while the job ran


def test_a_paused_region_refuses_allocations_and_unknown_names_with_the_fix(library):
    out = run(library, """
        cotenant.enable()
        with cotenant.region("kv_cache"):
            kv = pattern(1 << 20, seed=6).to("cuda")
        cotenant.pause_region("kv_cache", keep=False)
        try:
            with cotenant.region("kv_cache"):
                torch.empty(1 << 20, device="cuda")
            out["allocate"] = None
        except RuntimeError as error:
            out["allocate"] = str(error)
        del kv  # freeing a paused region's tensor is fine
        cotenant.resume_region("kv_cache")
        try:
            cotenant.pause_region("nope", keep=True)
            out["unknown"] = None
        except RuntimeError as error:
            out["unknown"] = str(error)
        with cotenant.region("kv_cache"):
            again = pattern(1 << 20, seed=7).to("cuda")
        out["again_same"] = same(again, pattern(1 << 20, seed=7))
    """)
    assert "resume_region" in out["allocate"]
    assert "'nope'" in out["unknown"] and "'kv_cache'" in out["unknown"]
    assert out["again_same"]


def test_a_mem_pool_serves_its_tensors_and_gives_its_memory_back(library):
    out = run(library, """
        import gc
        cotenant.enable()
        pool = torch.cuda.MemPool()
        data = pattern(4 << 20, seed=14)
        with torch.cuda.use_mem_pool(pool):
            x = data.to("cuda")
        out["pool_segments"] = len(pool.snapshot())
        out["same"] = same(x, data)
        out["reserved_with_pool"] = torch.cuda.memory_reserved()
        del x, pool
        gc.collect()
        torch.cuda.empty_cache()
        out["reserved_after"] = torch.cuda.memory_reserved()
        y = pattern(1 << 20, seed=15).to("cuda")
        out["after_same"] = same(y, pattern(1 << 20, seed=15))
    """)
    assert out["pool_segments"] >= 1 and out["same"]
    assert out["reserved_with_pool"] >= 16 * MIB
    assert out["reserved_after"] == 0  # the pool's memory went back with it
    assert out["after_same"]


# A MemPool made with an allocator of its own (as NCCL's registered buffers
# and vLLM's sleep mode make them): here a ctypes allocator over the fake's
# cudaMalloc / cudaFree that notes each call.
FOREIGN_POOL = """
    import ctypes, gc
    calls = {"alloc": [], "free": []}
    def my_alloc(size, device, stream):
        ptr = ctypes.c_void_p()
        assert fake.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) == 0
        calls["alloc"].append((ptr.value, size))
        return ptr.value
    def my_free(ptr, size, device, stream):
        calls["free"].append((ptr, size))
        assert fake.lib.cudaFree(ctypes.c_void_p(ptr)) == 0
    alloc_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(my_alloc)
    free_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(my_free)
    allocator = torch._C._cuda_customAllocator(ctypes.cast(alloc_fn, ctypes.c_void_p).value,
                                               ctypes.cast(free_fn, ctypes.c_void_p).value)
    pool = torch.cuda.MemPool(allocator)
    data = pattern(1 << 20, seed=31)
    allocated_before = torch.cuda.memory_allocated()
    with torch.cuda.use_mem_pool(pool):
        x = data.to("cuda")
        y = torch.empty(1000, dtype=torch.uint8, device="cuda")
    inside = [(p, n) for p, n in calls["alloc"]]
    out["sizes_asked"] = sorted(n for p, n in inside)
    out["pool_allocator_holds_x_and_y"] = all(
        any(p <= t.data_ptr() and t.data_ptr() + t.untyped_storage().nbytes() <= p + n for p, n in inside)
        for t in (x, y))
    out["same"] = same(x, data)
    out["counted"] = torch.cuda.memory_allocated() - allocated_before >= (4 << 20) + 1000
    snapshot = pool.snapshot()
    out["pool_snapshot_holds_x"] = any(s["address"] <= x.data_ptr() < s["address"] + s["total_size"] for s in snapshot)
    out["reserved_is_the_snapshot"] = (
        torch.cuda.memory_reserved() == sum(s["total_size"] for s in torch.cuda.memory_snapshot()))
    z = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # outside the pool
    out["outside_the_pool_not_called"] = (
        len(calls["alloc"]) == len(inside) and not any(p <= z.data_ptr() < p + n for p, n in inside))
    y.record_stream(torch.cuda.Stream())
    del x, y, z
    gc.collect()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    out["each_call_freed"] = sorted(calls["free"]) == sorted(calls["alloc"]) and len(calls["alloc"]) >= 1
    out["allocated_after"] = torch.cuda.memory_allocated() - allocated_before
"""


def test_a_mem_pool_with_its_own_allocator_serves_its_tensors_from_it_as_under_pytorch(library):
    native = run(library, FOREIGN_POOL)
    ours = run(library, "cotenant.enable()\n" + textwrap.dedent(FOREIGN_POOL))
    # PyTorch asks its pool's allocator for segments it splits and caches
    # (2 MiB for small requests); cotenant for each allocation as it comes.
    assert ours.pop("sizes_asked") == [1000, 4 << 20]
    assert native.pop("sizes_asked")[0] >= 2 * MIB
    expected = {"pool_allocator_holds_x_and_y": True, "same": True, "counted": True, "pool_snapshot_holds_x": True,
                "reserved_is_the_snapshot": True, "outside_the_pool_not_called": True, "each_call_freed": True,
                "allocated_after": 0}
    assert native == expected
    assert ours == expected


def test_mem_pool_options_cotenant_cannot_honour_are_refused_with_the_fix(library):
    out = run(library, """
        import ctypes
        cotenant.enable()
        for name, make in [("use_on_oom", lambda: torch.cuda.MemPool(use_on_oom=True)),
                           ("no_split", lambda: torch.cuda.MemPool(no_split=True))]:
            try:
                make()
                out[name] = "accepted"
            except RuntimeError as error:
                out[name] = str(error)
        # A pool with its own allocator splits nothing anyway: no_split is its way already.
        alloc_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(lambda *a: None)
        free_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(lambda *a: None)
        allocator = torch._C._cuda_customAllocator(ctypes.cast(alloc_fn, ctypes.c_void_p).value,
                                                   ctypes.cast(free_fn, ctypes.c_void_p).value)
        pool = torch.cuda.MemPool(allocator, no_split=True)
        try:
            with torch.cuda.use_mem_pool(pool):
                torch.empty(100, device="cuda")  # its allocator returns no memory
            out["null_from_the_allocator"] = "no error"
        except torch.OutOfMemoryError as error:
            out["null_from_the_allocator"] = str(error)
        out["after"] = same(pattern(1000, seed=3).to("cuda"), pattern(1000, seed=3))
    """)
    assert "MemPool(use_on_oom=True) is not supported" in out["use_on_oom"]
    assert "Create the MemPool without use_on_oom" in out["use_on_oom"]
    assert "MemPool(no_split=True) is not supported" in out["no_split"] and "without no_split" in out["no_split"]
    assert "returned no memory for 400 bytes" in out["null_from_the_allocator"]
    assert out["after"]


# What CUDA graph trees (torch.compile(mode="reduce-overhead")) do with a
# pool between recordings (torch/_inductor/cudagraph_trees.py): checkpoint its
# allocations, go on, then put the checkpoint back with the storages alive
# since (stale: their blocks are freed, their deleters dropped) and the
# storages that hold a checkpointed block without owning it (they get the
# block's deleter); the checkpointed blocks no storage holds are freed by hand.
CHECKPOINTED_POOL = """
    import gc
    pool = torch.cuda.MemPool()
    data = pattern(1 << 20, seed=21)
    with torch.cuda.use_mem_pool(pool):
        a = data.to("cuda")
        b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    state = torch._C._cuda_getCheckpointState(0, pool.id)
    ptr_a, ptr_b = a.data_ptr(), b.data_ptr()
    del b
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        d = torch.empty(1000, dtype=torch.uint8, device="cuda")
    live = {a.data_ptr(), c.data_ptr(), d.data_ptr()}
    out["live_before"] = torch._C._cuda_checkPoolLiveAllocations(0, pool.id, live)
    out["c_in_b_place"] = c.data_ptr() == ptr_b
    held_a = torch._C._construct_storage_from_data_pointer(ptr_a, a.device, a.untyped_storage().nbytes())
    stale = [t.untyped_storage()._cdata for t in (a, c, d)]
    torch._C._cuda_setCheckpointPoolState(0, state, stale, [held_a._cdata])
    out["live_after"] = torch._C._cuda_checkPoolLiveAllocations(0, pool.id, {ptr_a, ptr_b})
    del a, c, d  # their deleters were dropped: they free nothing
    gc.collect()
    out["live_after_stale_died"] = torch._C._cuda_checkPoolLiveAllocations(0, pool.id, {ptr_a, ptr_b})
    restored_a = torch.empty(0, dtype=torch.int32, device="cuda").set_(held_a)
    out["a_kept_its_values"] = same(restored_a[: data.numel()], data)
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptr_b)  # no storage holds b
    del restored_a, held_a
    gc.collect()
    out["live_at_end"] = torch._C._cuda_checkPoolLiveAllocations(0, pool.id, set())
    out["allocated_at_end"] = torch.cuda.memory_allocated()
"""


def test_a_pool_checkpoint_restores_as_pytorchs_allocator_does_for_cuda_graph_trees(library):
    native = run(library, CHECKPOINTED_POOL)
    ours = run(library, "cotenant.enable()\n" + textwrap.dedent(CHECKPOINTED_POOL))
    expected = {"live_before": True, "c_in_b_place": True, "live_after": True, "live_after_stale_died": True,
                "a_kept_its_values": True, "live_at_end": True, "allocated_at_end": 0}
    assert native == expected
    assert ours == expected


def test_enable_after_a_cuda_allocation_says_how_to_fix_it(library):
    out = run(library, """
        x = torch.empty(1024, device="cuda")
        try:
            cotenant.enable()
            out["error"] = None
        except RuntimeError as error:
            out["error"] = str(error)
    """)
    assert out["error"] is not None
    assert "before" in out["error"] and "enable" in out["error"]


# What torch.profiler.profile(profile_memory=True) and the GPU trace hooks
# (torch.cuda._sanitizer's, torch.cuda._gpu_trace's callbacks) see of CUDA
# memory: PyTorch's allocator reports each allocation and free to both.
PROFILED_AND_TRACED = """
    import torch.cuda._gpu_trace as gpu_trace
    from torch.profiler import profile, ProfilerActivity
    traced = {"alloc": [], "free": []}
    gpu_trace.register_callback_for_memory_allocation(traced["alloc"].append)
    gpu_trace.register_callback_for_memory_deallocation(traced["free"].append)
    torch._C._activate_gpu_trace()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
        x_ptr = x.data_ptr()
        del x
        raw = torch.cuda.caching_allocator_alloc(1 << 20)
        torch.cuda.caching_allocator_delete(raw)
        try:
            torch.empty(900 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
    events = prof.key_averages()
    out["empty_device_bytes"] = sum(e.device_memory_usage for e in events if e.key == "aten::empty")
    # Outside any op: the raw buffer's allocation (+1 MiB) and the frees of both (-2 MiB, -1 MiB).
    out["device_bytes_outside_ops"] = sum(e.device_memory_usage for e in events if e.key == "[memory]")
    out["out_of_memory_events"] = sum(e.count for e in events if e.key == "[OutOfMemory]")
    out["traced_alloc"] = [x_ptr in traced["alloc"], raw in traced["alloc"]]
    out["traced_free"] = [x_ptr in traced["free"], raw in traced["free"]]
"""


def test_the_profiler_and_the_gpu_trace_see_cuda_memory_as_under_pytorch(library):
    native = run(library, PROFILED_AND_TRACED, capacity=512 * MIB)
    ours = run(library, "cotenant.enable()\n" + textwrap.dedent(PROFILED_AND_TRACED), capacity=512 * MIB)
    expected = {"empty_device_bytes": 2 * MIB, "device_bytes_outside_ops": -2 * MIB, "out_of_memory_events": 1,
                "traced_alloc": [True, True], "traced_free": [True, True]}
    assert native == expected
    assert ours == expected


# PyTorch keeps one set of statistics per device, whatever pool a block is
# in: a peak is the peak of the device's total, not a sum of each pool's.
PEAKS_ACROSS_POOLS = """
    import gc
    x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    del x
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    out["one_at_a_time"] = torch.cuda.max_memory_allocated() // MIB
    z = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    out["both_at_once"] = torch.cuda.max_memory_allocated() // MIB
    del y, z
    torch.cuda.reset_peak_memory_stats()
    out["after_reset"] = torch.cuda.max_memory_allocated()
    out["allocations_peak"] = torch.cuda.memory_stats()["allocation.all.peak"]
"""


def test_peak_statistics_are_the_devices_across_memory_pools_as_under_pytorch(library):
    native = run(library, PEAKS_ACROSS_POOLS)
    ours = run(library, "cotenant.enable()\n" + textwrap.dedent(PEAKS_ACROSS_POOLS))
    expected = {"one_at_a_time": 8, "both_at_once": 12, "after_reset": 0, "allocations_peak": 0}
    assert native == expected
    assert ours == expected


def test_the_max_split_size_statistic_reads_as_pytorchs_default(library):
    # Blocks of any size may split, as with PyTorch's default (max_split_size_mb unset): -1.
    # Before the device's first allocation too (it read 0 there).
    script = ('out["before"] = torch.cuda.memory_stats()["max_split_size"]\ntorch.empty(1, device="cuda")\n'
              'out["max_split_size"] = torch.cuda.memory_stats()["max_split_size"]\n')
    native = run(library, script)
    ours = run(library, "cotenant.enable()\n" + script)
    assert native == ours == {"before": -1, "max_split_size": -1}


def test_memory_history_records_cotenants_allocations(library):
    out = run(library, """
        cotenant.enable()
        torch.cuda.memory._record_memory_history(max_entries=1000)
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        del x
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out["actions"] = [(e["action"], e["size"]) for e in snapshot["device_traces"][0]
                          if e["action"] in ("alloc", "free_completed")]
    """)
    assert out["actions"] == [["alloc", 3 * MIB], ["free_completed", 3 * MIB]]


def test_memory_history_records_the_allocations_of_a_region(library):
    out = run(library, """
        cotenant.enable()
        with cotenant.region("kv_cache"):
            before = torch.empty(1000, dtype=torch.uint8, device="cuda")  # its allocator, before recording
        torch.cuda.memory._record_memory_history(max_entries=1000)
        with cotenant.region("kv_cache"):
            x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        with cotenant.region("weights"):  # its allocator comes once recording is on
            w = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del before
        y = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        del x
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out["actions"] = [(e["action"], e["size"]) for e in snapshot["device_traces"][0]
                          if e["action"] in ("alloc", "free_completed")]
        out["frames_on_live_blocks"] = sorted((b["size"], bool(b["frames"])) for s in snapshot["segments"]
                                              for b in s["blocks"] if b["state"] == "active_allocated")
    """)
    assert out["actions"] == [["alloc", 3 * MIB], ["alloc", 1 * MIB], ["free_completed", 1000], ["alloc", 5 * MIB],
                              ["free_completed", 3 * MIB]]
    assert out["frames_on_live_blocks"] == [[1 * MIB, True], [5 * MIB, True]]


ANNOTATED_RECORDING = """
    torch.cuda.memory._record_memory_history(max_entries=1000, compile_context=True)
    torch.cuda.memory._set_memory_metadata("run 7")
    with torch.profiler.record_function("forward"):
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    del x
    def make():
        return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    y = torch.compile(make, backend="eager")()  # allocates inside the compiled region
    del y
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    out["annotations"] = [(a["name"], a["stage"], a["device"]) for a in snapshot["external_annotations"]]
    times = [a["time_us"] for a in snapshot["external_annotations"]]
    trace = snapshot["device_traces"][0]
    alloc = next(e for e in trace if e["action"] == "alloc")
    out["inside"] = times[0] <= alloc["time_us"] <= times[1]  # the allocation is timed between START and END
    out["labels"] = sorted({(e["action"], e["compile_context"], e["user_metadata"]) for e in trace
                            if e["action"] in ("alloc", "free_completed")})
    out["segment_metadata"] = sorted({e["user_metadata"] for e in trace if e["action"].startswith("segment")})
"""


def test_memory_history_keeps_annotations_compile_contexts_and_user_metadata_as_pytorchs_does(library):
    native = run(library, ANNOTATED_RECORDING)
    ours = run(library, "cotenant.enable()\n" + textwrap.dedent(ANNOTATED_RECORDING))
    expected = [["forward", "START", 0], ["forward", "END", 0]]
    assert native["annotations"] == expected and ours["annotations"] == expected
    assert native["inside"] and ours["inside"]
    labels = [["alloc", "N/A", "run 7"], ["alloc", "Torch-Compiled Region: 0/0", "run 7"],
              ["free_completed", "N/A", "run 7"]]
    assert native["labels"] == labels and ours["labels"] == labels
    assert ours["segment_metadata"] == ["cotenant:device"]  # segment entries name their residency


def test_a_copy_reads_a_spilled_tensor_at_its_device_address(library):
    out = run(library, """
        cotenant.enable()
        data = pattern(2 << 20, seed=7)  # 8 MiB
        x = data.to("cuda")
        cotenant.spill_all()
        y = torch.empty_like(x)
        y.copy_(x)  # a device-to-device copy on the stream, its source on host pages
        out["same"] = same(y, data)
        out["host_bytes"] = cotenant.memory_stats()["host_bytes"]
    """)
    assert out["same"] and out["host_bytes"] >= 8 * MIB


def test_tensors_alive_at_interpreter_exit_are_freed_without_terminating(library):
    # A tensor's deleter runs in destructors, at interpreter exit too: a free
    # that fails there must be reported, not call std::terminate.
    code = PRELUDE.format(over_fake_dir=OVER_FAKE_DIR, library=library, capacity=1 << 30, garbage=False,
                          host_vmm=True, host_capacity=None)
    code += textwrap.dedent("""
        cotenant.enable()
        cotenant.set_memory_cap("64MiB")
        keep = [pattern(1 << 20, seed=i).to("cuda") for i in range(24)]  # 96 MiB: some on the host
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            keep[1].copy_(keep[0])
        keep[0].record_stream(side)
        print("ok", flush=True)
    """)
    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "terminate called" not in done.stderr


# ---- started by `cotenant run` (or the start-up hook), capped by the coordinator -----------------

JOB_PRELUDE = r'''
import json, os, sys, time
sys.path.insert(0, {over_fake_dir!r})
import over_fake
fake = over_fake.Fake({library!r})  # no reset: the start-up hook may have enabled cotenant already
import torch, cotenant
over_fake.check_torch_sees_the_fake(torch)

def wait_under_the_cap(most, deadline):
    # Until a cap of at most `most` is set and the job is under it, or the
    # deadline; the last statistics. The job is idle: the job channel's
    # thread moves the pages.
    while True:
        s = cotenant.memory_stats()
        if s["memory_cap"] is not None and s["memory_cap"] <= most and s["device_bytes"] <= s["memory_cap"]:
            return s
        if time.time() >= deadline:
            return s
        time.sleep(0.05)
'''


def job_code(library, body):
    """`body` after the prelude of a process whose start-up hook enables
    cotenant (`cotenant run`, COTENANT_ENABLE): the fake is used as loaded."""
    return JOB_PRELUDE.format(over_fake_dir=OVER_FAKE_DIR, library=library) + body


CAPPED_JOB = r'''
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
data = torch.arange(32 << 20, dtype=torch.int32)  # 128 MiB
x = data.to("cuda")
s = wait_under_the_cap(64 << 20, time.time() + 60)
print(json.dumps({"cap": s["memory_cap"], "device": s["device_bytes"], "host": s["host_bytes"],
                  "headroom": s["host_headroom_bytes"], "refusals": s["host_headroom_refusals"],
                  "same": bool(torch.equal(x.to("cpu"), data)), "violations": fake.violations()}))
'''


def test_a_cap_set_through_the_coordinator_reaches_a_running_job(library):
    from coordinator_harness import cap_a_job_through_the_coordinator

    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    result = cap_a_job_through_the_coordinator(job_code(library, CAPPED_JOB), "64MiB", env)
    assert result["violations"] == []
    assert result["cap"] == 64 * MIB
    assert result["headroom"] == 0  # the harness's: the host's load does not decide this test
    assert result["device"] <= result["cap"], result
    assert result["host"] >= 64 * MIB
    assert result["same"]  # the bytes survived the move


# A region (like a graph pool) is never capped or moved: the coordinator's cap
# is the job's, so the main allocator gets what the region leaves of it, and
# the job reports both to the coordinator.
CAPPED_BESIDE_A_REGION = r'''
from cotenant.coordinator import client
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
kv_data = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB
with cotenant.region("kv"):
    kv = kv_data.to("cuda")
data = torch.arange(32 << 20, dtype=torch.int32)  # 128 MiB
x = data.to("cuda")
deadline = time.time() + 60
s = wait_under_the_cap(64 << 20, deadline)
seen = {}
while time.time() < deadline:  # the report follows within a poll
    seen = [j for j in client.status(os.environ["COTENANT_SOCKET"])["jobs"] if j["name"] == "capjob"][0]
    if seen["device_bytes"] <= 96 << 20 and seen["host_bytes"] >= 64 << 20:
        break
    time.sleep(0.05)
with cotenant.region("kv"):  # the region grows: main's share of the cap shrinks with it
    kv2 = kv_data.to("cuda")
deadline = time.time() + 30
while time.time() < deadline:
    after = cotenant.memory_stats()
    if after["memory_cap"] <= 32 << 20 and after["device_bytes"] <= after["memory_cap"]:
        break
    time.sleep(0.05)
print(json.dumps({"main_cap": s["memory_cap"], "main_device": s["device_bytes"], "reported": seen,
                  "main_cap_after": after["memory_cap"], "main_device_after": after["device_bytes"],
                  "same": bool(torch.equal(x.to("cpu"), data)) and bool(torch.equal(kv.to("cpu"), kv_data))
                          and bool(torch.equal(kv2.to("cpu"), kv_data)),
                  "violations": fake.violations()}))
'''


def test_the_coordinators_cap_covers_a_jobs_region_and_the_job_reports_it(library):
    from coordinator_harness import cap_a_job_through_the_coordinator

    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    result = cap_a_job_through_the_coordinator(job_code(library, CAPPED_BESIDE_A_REGION), "96MiB", env)
    assert result["violations"] == []
    # Main's cap is the job's less the region's 32 MiB (it was 96 MiB, main alone).
    assert result["main_cap"] == 64 * MIB, result
    assert result["main_device"] <= 64 * MIB
    reported = result["reported"]
    assert reported["applied_cap"] == 96 * MIB
    # The coordinator sees the region's device memory too: 32 MiB + main's 64.
    assert 64 * MIB < reported["device_bytes"] <= 96 * MIB, reported
    assert reported["host_bytes"] >= 64 * MIB
    assert reported["allocated_bytes"] >= 160 * MIB  # both tensors
    assert result["main_cap_after"] == 32 * MIB  # 96 MiB less the region's 64
    assert result["main_device_after"] <= 32 * MIB
    assert result["same"]


# The coordinator suspends a job with a region: the region's pages go to the
# host with the job's main memory, and come back at resume. The job sends
# the commands about itself from its main thread, which runs no op while
# suspended (an op would wait for the resume).
SUSPENDED_WITH_A_REGION = r'''
from cotenant.coordinator import client
sock = os.environ["COTENANT_SOCKET"]
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
kv_data = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB
with cotenant.region("kv"):
    kv = kv_data.to("cuda")
data = torch.arange(4 << 20, dtype=torch.int32)  # 16 MiB
x = data.to("cuda")
def now():
    row = [r for r in cotenant.regions() if r["name"] == "kv"][0]
    return {"region_device": row["device_bytes"], "region_host": row["host_bytes"], "state": row["state"],
            "main_device": cotenant.memory_stats()["device_bytes"]}
client.send_command("capjob", "suspend", sock)
deadline = time.time() + 60
while time.time() < deadline and not (now()["region_device"] == 0 and now()["main_device"] == 0):
    time.sleep(0.05)
suspended = now()
client.send_command("capjob", "resume", sock)
while time.time() < deadline and not (now()["region_device"] >= 32 << 20 and now()["main_device"] >= 16 << 20):
    time.sleep(0.05)
resumed = now()
print(json.dumps({"suspended": suspended, "resumed": resumed,
                  "same": bool(torch.equal(x.to("cpu"), data)) and bool(torch.equal(kv.to("cpu"), kv_data)),
                  "violations": fake.violations()}))
'''


def test_a_suspended_job_moves_its_region_to_the_host_and_resume_brings_it_back(library):
    from coordinator_harness import cap_a_job_through_the_coordinator

    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    # A cap above what the job holds: the harness sets one; it moves nothing here.
    result = cap_a_job_through_the_coordinator(job_code(library, SUSPENDED_WITH_A_REGION), "512MiB", env)
    assert result["violations"] == []
    suspended, resumed = result["suspended"], result["resumed"]
    assert suspended["region_device"] == 0 and suspended["region_host"] >= 32 * MIB, suspended
    assert suspended["main_device"] == 0
    assert suspended["state"] == "active"  # moved with the job, not paused: its own pause is the job's
    assert resumed["region_device"] >= 32 * MIB and resumed["region_host"] == 0, resumed
    assert resumed["main_device"] >= 16 * MIB
    assert result["same"]


# The cap arrives while an op runs (work launched outside ATen, held open):
# the safe point the cap's own command runs cannot drain it and gives up. The
# job then idles, so no op entry comes to retry; the job channel's polls
# must, or the job stays over its cap for as long as it idles.
CAPPED_WHILE_AN_OP_RUNS = r'''
import os
from cotenant import _C
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
data = torch.arange(32 << 20, dtype=torch.int32)  # 128 MiB
x = data.to("cuda")
_C.begin_explicit_op()
open(os.environ["CAPJOB_READY"], "w").close()  # the harness sets the cap now
deadline = time.time() + 60
while cotenant.memory_stats()["memory_cap"] is None and time.time() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # well past the cap's safe point and its drain timeout
held_over = cotenant.memory_stats()["device_bytes"]
_C.end_explicit_op()
deadline = time.time() + 20
while time.time() < deadline:
    s = cotenant.memory_stats()
    if s["device_bytes"] <= s["memory_cap"]:
        break
    time.sleep(0.05)  # idle: no op entry from here on
print(json.dumps({"cap": s["memory_cap"], "device": s["device_bytes"], "held_over": held_over,
                  "same": bool(torch.equal(x.to("cpu"), data)), "violations": fake.violations()}))
'''


def test_a_cap_that_arrives_while_an_op_runs_reaches_the_job_once_it_idles(library):
    from coordinator_harness import cap_a_job_through_the_coordinator

    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    result = cap_a_job_through_the_coordinator(job_code(library, CAPPED_WHILE_AN_OP_RUNS), "64MiB", env,
                                               wait_for_ready=True)
    assert result["violations"] == []
    assert result["cap"] == 64 * MIB
    assert result["held_over"] > result["cap"]  # the op held the cap's own safe point off
    assert result["device"] <= result["cap"], result
    assert result["same"]


HOST_STREAM = -1  # the stream host-resident memory reports (docs/allocator.md, "Memory history")


def test_a_spill_shows_in_memory_history_as_device_unmap_then_host_map(library):
    out = run(library, """
        cotenant.enable()
        torch.cuda.memory._record_memory_history(max_entries=100000)
        data = pattern(8 << 20, seed=13)  # 32 MiB
        x = data.to("cuda")
        out["ptr"] = x.data_ptr()
        cotenant.set_memory_cap("8MiB")
        cotenant.safe_point()
        snap = torch.cuda.memory._snapshot()
        trace = snap["device_traces"][0]
        out["segments"] = [{"total_size": s["total_size"], "stream": s["stream"],
                            "allocated": [b["address"] for b in s["blocks"] if b["state"] == "active_allocated"]}
                           for s in snap["segments"]]
        out["moves"] = [(a["stream"], b["stream"], a["addr"], a["size"]) for a, b in zip(trace, trace[1:])
                        if a["addr"] == b.get("addr")
                        and (a["action"], b["action"]) == ("segment_unmap", "segment_map")]
        out["host_bytes"] = cotenant.memory_stats()["host_bytes"]
        out["reserved"] = torch.cuda.memory_reserved()
        out["same"] = same(x, data)
    """)
    assert out["same"]
    to_host = [m for m in out["moves"] if m[0] != HOST_STREAM and m[1] == HOST_STREAM]
    assert sum(m[3] for m in to_host) >= 24 * MIB
    assert all(out["ptr"] <= m[2] < out["ptr"] + 32 * MIB for m in to_host)
    host_segments = [s for s in out["segments"] if s["stream"] == HOST_STREAM]
    assert out["host_bytes"] == 24 * MIB
    # The segments add up to what is reserved; the tensor is one block in one segment, that of the page it
    # starts on (a host page: the coldest pages, its first, moved), which runs to its end.
    assert sum(s["total_size"] for s in out["segments"]) == out["reserved"] == 32 * MIB
    assert sum(s["total_size"] for s in host_segments) == 32 * MIB
    assert sum(s["allocated"].count(out["ptr"]) for s in out["segments"]) == 1


AUTOENABLED_JOB = r'''
x = torch.arange(1000, dtype=torch.int32).to("cuda")
print(json.dumps({"enabled": cotenant.is_enabled(), "cap": cotenant.memory_cap(),
                  "allocated": torch.cuda.memory_allocated() == cotenant.memory_stats()["allocated_bytes"],
                  "violations": fake.violations()}))
'''


def test_the_start_up_hook_enables_cotenant_from_the_environment(library):
    from coordinator_harness import AS_JOB

    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    autoenable = os.path.join(HERE, "..", "..", "python", "cotenant", "_autoenable")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [autoenable, env.get("PYTHONPATH")]))
    env.update({"COTENANT_ENABLE": "1", "COTENANT_MEMORY_CAP": "1GiB"})
    done = subprocess.run([*AS_JOB, "-c", job_code(library, AUTOENABLED_JOB)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"enabled": True, "cap": 1 << 30, "allocated": True, "violations": []}


# ---- the launch gate: a guaranteed and an opportunistic job under the coordinator ---------------

GATE_WORKER = r'''
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
role, progress_path = cotenant.gate.role(), sys.argv[1]
x = torch.arange(1 << 20, dtype=torch.int32).to("cuda")
y = torch.empty_like(x)
steps = 0
while True:
    if role == "guaranteed":
        with cotenant.gate.iteration():
            for _ in range(4):
                y.copy_(x)  # an op that reaches the device: a copy on the stream
            torch.cuda.synchronize()
        time.sleep(0.005)  # leaves the device idle about half the time
    else:
        y.copy_(x)
        torch.cuda.synchronize()
    steps += 1
    if steps % 5 == 0:
        with open(progress_path + ".tmp", "w") as f:
            json.dump({"steps": steps, "gate": cotenant.gate.stats(), "violations": fake.violations()}, f)
        os.replace(progress_path + ".tmp", progress_path)
'''


def test_the_coordinator_pauses_and_resumes_an_opportunistic_job_beside_a_guaranteed_one(library, tmp_path):
    """Two jobs `cotenant run` starts (each over its own fake device, one
    GPU to the coordinator): a share of 0 set through the coordinator stops
    the opportunistic job at its next op while the guaranteed one goes on;
    a share of 1 resumes it."""
    from coordinator_harness import check_the_share_pauses_and_resumes, guaranteed_and_opportunistic

    env = {k: v for k, v in over_fake.environment(library).items() if not k.startswith("COTENANT_")}
    with guaranteed_and_opportunistic(job_code(library, GATE_WORKER), env, tmp_path) as (sock, paths):
        guaranteed, opportunistic = check_the_share_pauses_and_resumes(sock, paths, start_timeout=60, settle_s=0.5,
                                                                      pause_s=1.5)
    assert opportunistic["violations"] == [] and guaranteed["violations"] == []


def test_the_warm_allocation_path_calls_the_driver_no_more_than_pytorchs_own(library, tmp_path):
    """bench_allocator.py --over-fake: torch.empty and del in a warm loop
    through PyTorch's allocator and through cotenant's. cotenant's path may
    make no driver or runtime call that PyTorch's does not (no page map, no
    event query, no synchronize), so its cost on a GPU is the CPU work timed
    here. Page moves make few virtual memory calls (below)."""
    script = os.path.join(HERE, "..", "..", "benchmarks", "bench_allocator.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTENANT_") or k == "COTENANT_PYTORCH_REPLAY"}
    done = subprocess.run([sys.executable, script, "--over-fake", "--quick", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    with open(tmp_path / "allocator_over_fake.json", encoding="utf-8") as f:
        result = json.load(f)
    native, ours = result["measured"]["native"], result["measured"]["cotenant"]
    assert native["violations"] == [] and ours["violations"] == []
    assert native["calls_per_pair"], "torch's own calls (cudaGetDevice) were not counted"
    extra = {name: count for name, count in ours["calls_per_pair"].items()
             if count > native["calls_per_pair"].get(name, 0)}
    assert extra == {}, f"cotenant's warm path calls the driver where PyTorch's does not: {extra}"
    assert result["figures"]["alloc_free_ratio_vs_native"] > 0
    assert "cotenant" in done.stdout and "us/pair" in done.stdout
    moves = result["measured"]["moves"]
    assert moves["violations"] == []
    figures = result["figures"]
    for name in ("spill", "restore", "spill_kept", "restore_kept"):
        assert moves[f"{name}_moved_bytes"] == 64 * MIB
        calls = moves[f"{name}_calls_per_page"]
        assert calls["cudaMemcpyAsync"] == 1, calls  # one copy per page
    # A restore, and a spill into kept host pages, map one page in another's
    # place (unmap, map; the device page created or released) and copy
    # without a mapping for the copy; each run of up to 8 neighbouring pages
    # gets one access call: 3.125 calls a page here. The first spill also
    # pins its host pages and maps each where copies reach it: 6.125.
    assert figures["spill_vmm_calls_per_page"] <= 6.125, moves["spill_calls_per_page"]
    for figure in ("restore_vmm_calls_per_page", "spill_vmm_calls_per_page_kept", "restore_vmm_calls_per_page_kept"):
        assert 0 < figures[figure] <= 3.125, (figure, moves)
    assert "cuMemCreate" not in moves["spill_kept_calls_per_page"]  # nothing pinned the second time
    assert moves["host_pool_bytes_after"] == 64 * MIB  # memory_stats() shows the host pages kept
    # The driver probe ran through the extension on both sides, every step
    # of every extent size, each call counted once, within the fake's rules.
    # Mapping a page from part of a larger allocation is refused, as on the
    # H200 (cuMemMap takes no offset), which ends the pieces.
    probe = result["measured"]["vmm_probe"]
    assert probe["violations"] == []
    rows = {(row["side"], row["extent_bytes"], row["step"]): row for row in probe["rows"]}
    assert all(row["error"] is None and row["ns"] > 0 for row in rows.values() if row["step"] != "map_piece"), \
        probe["rows"]
    assert all(row["error"] == "CUDA_ERROR_NOT_SUPPORTED" for row in rows.values() if row["step"] == "map_piece")
    assert not any(step == "set_access_piece" for (_, _, step) in rows)
    for side in ("device", "host"):
        for extent in (2 * MIB, 8 * MIB, 32 * MIB, 128 * MIB):
            assert rows[(side, extent, "map")]["calls"] == probe["total_bytes"] // extent
            assert rows[(side, extent, "set_access_whole")]["calls"] == 1
            assert ((side, extent, "map_piece") in rows) == (extent > 2 * MIB)
    assert "driver probe" in done.stdout


NO_KERNEL_CALLS = r'''
x = torch.empty(4, 4, device="cuda")
calls = {
    "aten::_reshape_alias": lambda: torch.ops.aten._reshape_alias(x, [16], [1]),
    "aten::_unsafe_view": lambda: torch.ops.aten._unsafe_view(x, [16]),
    "aten::alias": lambda: torch.ops.aten.alias(x),
    "aten::as_strided": lambda: x.as_strided((2, 2), (1, 2)),
    "aten::chunk": lambda: x.chunk(2),
    "aten::detach": lambda: x.detach(),
    "aten::diagonal": lambda: x.diagonal(),
    "aten::empty": lambda: torch.empty(3, device="cuda"),
    "aten::empty_like": lambda: torch.empty_like(x),
    "aten::empty_strided": lambda: torch.empty_strided((2, 2), (2, 1), device="cuda"),
    "aten::expand": lambda: x[:1].expand(3, 4),
    "aten::expand_as": lambda: x[:1].expand_as(x),
    "aten::movedim": lambda: torch.movedim(x, 0, 1),
    "aten::narrow": lambda: x.narrow(0, 1, 2),
    "aten::new_empty": lambda: x.new_empty(5),
    "aten::permute": lambda: x.permute(1, 0),
    "aten::select": lambda: x.select(0, 1),
    "aten::slice": lambda: x[1:3],
    "aten::split": lambda: x.split(2),
    "aten::split_with_sizes": lambda: x.split([1, 3]),
    "aten::squeeze": lambda: x[:1].squeeze(0),
    "aten::t": lambda: x.t(),
    "aten::transpose": lambda: x.transpose(0, 1),
    "aten::unbind": lambda: x.unbind(),
    "aten::unflatten": lambda: x.unflatten(1, (2, 2)),
    "aten::unsqueeze": lambda: x.unsqueeze(0),
    "aten::view": lambda: x.view(-1),
    "aten::view_as": lambda: x.view(-1).view_as(x),
}
'''


def test_the_ops_the_gate_lets_through_launch_no_kernel(library):
    """An opportunistic job's views, metadata ops and uninitialized
    allocations pass without the gate (they put no work on the GPU). Each
    listed op runs here over the fake, where a kernel launch is a violation,
    and is recorded by PyTorch under the listed name (a misspelt name would
    never match, and the op would be gated after all)."""
    out = run(library, textwrap.dedent("""
        from torch.profiler import ProfilerActivity, profile
        from cotenant import _C
        cotenant.enable()
    """) + NO_KERNEL_CALLS + textwrap.dedent("""
        out["listed"], out["tried"] = sorted(_C.ops_that_launch_no_kernel()), sorted(calls)
        out["recorded"] = []
        for name, call in calls.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                call()
            if name in {event.name for event in prof.events()}:
                out["recorded"].append(name)
    """))
    assert out["listed"] == out["tried"]
    assert sorted(out["recorded"]) == out["listed"]


def test_a_paused_opportunistic_job_runs_views_and_holds_its_copies(library):
    """Share 0 holds an opportunistic job at its next op that reaches the
    device (a copy here) until the share rises; ops that put nothing on the
    GPU (views, an empty tensor) go on meanwhile, without an event each."""
    out = run(library, """
        import threading
        cotenant.enable(role="opportunistic")
        data = pattern(1 << 16, seed=3)
        x = data.to("cuda").view(256, 256)
        cotenant.gate.set_share(0)
        views_done, copy_done, copied = threading.Event(), threading.Event(), {}

        def views():
            for _ in range(100):
                x.view(-1), x[1:3], x.t(), x.unsqueeze(0), torch.empty_like(x), x.expand(2, 256, 256)
            views_done.set()

        def copy_back():
            copied["value"] = x.to("cpu")
            copy_done.set()

        records_before = fake.calls("cudaEventRecord")
        threading.Thread(target=views, daemon=True).start()
        out["views_ran_while_paused"] = views_done.wait(30)
        out["events_for_views"] = fake.calls("cudaEventRecord") - records_before
        threading.Thread(target=copy_back, daemon=True).start()
        out["copy_held"] = not copy_done.wait(1.0)
        cotenant.gate.set_share(1)
        out["copy_resumed"] = copy_done.wait(30)
        out["same"] = bool(torch.equal(copied["value"].view(-1), data)) if out["copy_resumed"] else False
    """)
    assert out["views_ran_while_paused"]
    assert out["events_for_views"] == 0
    assert out["copy_held"] and out["copy_resumed"] and out["same"]


def test_a_paused_opportunistic_job_runs_its_cpu_work_and_holds_every_op_that_names_the_gpu(library):
    """Share 0 (the coordinator pauses opportunistic jobs while a guaranteed
    job measures its solo baseline) must not stop a job's CPU work: building
    a model on the CPU initializes its weights with ATen ops, and a job that
    waited there never got ready (H200, 2026-11-27). Every op that names the
    GPU, by a CUDA tensor, a list of them or a device argument, is held."""
    out = run(library, """
        import threading, time
        cotenant.enable(role="opportunistic")
        x = pattern(1 << 12, seed=5).to("cuda")
        cotenant.gate.set_share(0)
        records_before = fake.calls("cudaEventRecord")
        cpu_done = threading.Event()

        def cpu_work():
            torch.manual_seed(0)
            layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
            a = torch.randn(64, 64)
            out["cpu_sum"] = float((layer(a.unsqueeze(0)).sum() + torch.cat([a, a]).sum()).item())
            cpu_done.set()

        threading.Thread(target=cpu_work, daemon=True).start()
        out["cpu_work_ran_while_paused"] = cpu_done.wait(60)
        out["events_for_cpu_work"] = fake.calls("cudaEventRecord") - records_before
        # Each launches no kernel once let through (over the fake a kernel
        # launch is a violation): copies and views.
        gpu_ops = {
            "factory with a device": lambda: torch.tensor([1.0, 2.0], device="cuda"),
            "copy to the device": lambda: torch.ones(8).to("cuda"),
            "op on a cuda tensor": lambda: x.to("cpu"),
            "list of cuda tensors": lambda: torch.broadcast_tensors(x, x.view(1, -1)),
        }
        done = {name: threading.Event() for name in gpu_ops}
        results = {}

        def launch(name):
            results[name] = gpu_ops[name]()
            done[name].set()

        for name in gpu_ops:
            threading.Thread(target=launch, args=(name,), daemon=True).start()
        time.sleep(1.0)
        out["held"] = sorted(name for name, event in done.items() if not event.is_set())
        cotenant.gate.set_share(1)
        out["resumed"] = sorted(name for name, event in done.items() if event.wait(30))
        out["copied"] = same(results["copy to the device"], torch.ones(8)) if "copy to the device" in results else None
    """)
    names = ["copy to the device", "factory with a device", "list of cuda tensors", "op on a cuda tensor"]
    assert out["cpu_work_ran_while_paused"]
    assert out["events_for_cpu_work"] == 0
    assert out["held"] == names
    assert out["resumed"] == names
    assert out["copied"] is True


def test_a_paused_opportunistic_job_holds_a_custom_op_that_names_no_gpu(library):
    """Only ATen's ops name the device they use among their inputs. A custom
    op may launch on the current device from host inputs (in torch itself,
    symm_mem::_barrier takes only a SymmetricMemory object): paused, it
    waits. Over the fake, its work is an upload from an integer, a copy."""
    out = run(library, """
        import threading
        lib = torch.library.Library("cotenant_fake_test", "DEF")
        lib.define("upload(int n) -> Tensor")
        lib.impl("upload", lambda n: torch.arange(n, dtype=torch.float32).to("cuda"), "CompositeExplicitAutograd")
        cotenant.enable(role="opportunistic")
        cotenant.gate.set_share(0)
        done, result = threading.Event(), []
        threading.Thread(target=lambda: (result.append(torch.ops.cotenant_fake_test.upload(4)), done.set()),
                         daemon=True).start()
        out["held"] = not done.wait(1.0)
        out["cpu_op_ran"] = torch.ones(3).add_(1).tolist() == [2.0] * 3  # ATen on the CPU: not held
        cotenant.gate.set_share(1)
        out["resumed"] = done.wait(30)
        out["uploaded"] = result[0].to("cpu").tolist() if result else None
    """)
    assert out == {"held": True, "cpu_op_ran": True, "resumed": True, "uploaded": [0.0, 1.0, 2.0, 3.0]}


def test_a_tensor_subclass_whose_device_query_raises_leaves_the_gate_on(library):
    """A tensor subclass may answer its device in Python (FakeTensor does,
    while torch.compile traces), and Python may raise there (a
    KeyboardInterrupt). The gate must not ask it: an exception out of the
    op-entry hook left the thread's hooks off for good, so its later ops,
    those naming the GPU among them, ran while paused and uncounted by a
    launch pause."""
    out = run(library, """
        import threading

        class DeviceInPython(torch.Tensor):
            @staticmethod
            def __new__(cls, elem):
                return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                           dispatch_device=True)

            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                raise RuntimeError("DeviceInPython: " + str(func))

        cotenant.enable(role="opportunistic")
        x = torch.arange(4.0).to("cuda")
        t = DeviceInPython(torch.ones(2))
        subclass_op_done, paused, done = threading.Event(), threading.Event(), threading.Event()

        def worker():
            try:
                torch.add(t, t)
            except Exception as error:
                out["subclass_error"] = type(error).__name__
            subclass_op_done.set()
            paused.wait()
            out["copied"] = x.to("cpu").tolist()  # names the GPU
            done.set()

        threading.Thread(target=worker, daemon=True).start()
        out["subclass_op_done"] = subclass_op_done.wait(30)
        cotenant.gate.set_share(0)
        paused.set()
        out["held"] = not done.wait(1.0)
        cotenant.gate.set_share(1)
        out["resumed"] = done.wait(30)
    """)
    assert out == {"subclass_error": "RuntimeError", "subclass_op_done": True, "held": True, "resumed": True,
                   "copied": [0.0, 1.0, 2.0, 3.0]}


def test_threads_streams_and_a_moving_cap_keep_every_value(library):
    """Randomized, seeded: three threads allocate (on their own stream or the
    default one, some with record_stream), copy device to device, check and
    free tensors, while a fourth moves the cap, empties the cache, spills
    and restores everything and runs safe points, for six seconds on a
    512 MiB device whose new pages hold garbage (what the workers hold at
    once fits on it, so a moment without a cap runs out of nothing). Every
    value read back must be the one written."""
    out = run(library, """
        import random, threading, time
        errors, checked = [], [0]
        stop = time.time() + 6

        def worker(seed):
            rng, stream, live, n = random.Random(seed), torch.cuda.Stream(), {}, 0
            try:
                while time.time() < stop:
                    op = rng.random()
                    if op < 0.5 or not live:
                        data = pattern(rng.choice([100, 5000, 1 << 16, 1 << 18, 3 << 18, 1 << 20]),
                                       rng.randrange(1 << 20))
                        if rng.random() < 0.5:
                            with torch.cuda.stream(stream):
                                t = data.to("cuda")
                            if rng.random() < 0.3:
                                t.record_stream(torch.cuda.current_stream())
                        else:
                            t = data.to("cuda")
                        live[n], n = (t, data), n + 1
                    elif op < 0.8:
                        t, data = live.pop(rng.choice(list(live)))
                        if not same(t, data):
                            errors.append(f"worker {seed}: wrong values")
                        checked[0] += 1
                    else:
                        t, data = live[rng.choice(list(live))]
                        copy = torch.empty_like(t)
                        copy.copy_(t)  # device to device
                        live[n], n = (copy, data), n + 1
                    if len(live) > 20:  # 3 x 20 x 4 MiB at most: with no cap it all fits on the device
                        live.pop(rng.choice(list(live)))
                for t, data in live.values():
                    if not same(t, data):
                        errors.append(f"worker {seed}: wrong values at the end")
                    checked[0] += 1
            except Exception as error:
                errors.append(f"worker {seed}: {type(error).__name__}: {error}")

        def mover():
            rng = random.Random(99)
            while time.time() < stop:
                r = rng.random()
                try:
                    if r < 0.3:
                        cotenant.set_memory_cap(rng.choice([16, 32, 64, 128]) * MIB)
                    elif r < 0.4:
                        cotenant.set_memory_cap(None)
                    elif r < 0.5:
                        torch.cuda.empty_cache()
                    elif r < 0.55:
                        cotenant.spill_all()
                    elif r < 0.6:
                        cotenant.restore_all()
                    else:
                        cotenant.safe_point()
                except Exception as error:
                    errors.append(f"mover: {type(error).__name__}: {error}")
                time.sleep(rng.random() * 0.01)

        cotenant.enable()
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
        threads.append(threading.Thread(target=mover))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = cotenant.memory_stats()
        out.update(errors=errors, checked=checked[0], spilled=stats["spilled_bytes"],
                   restored=stats["restored_bytes"], allocated=stats["allocated_bytes"])
    """, capacity=512 * MIB, garbage=True)
    assert out["errors"] == []
    assert out["checked"] > 100
    assert out["spilled"] > 0 and out["restored"] > 0  # the mover's caps did move pages
    assert out["allocated"] == 0
