"""Named regions through cotenant._core on the simulated device: what pause
and resume keep, release and refuse, without a GPU. (The torch path, with
`with cotenant.region(...)`, is in test_regions_gpu.py.)"""

import threading

import pytest

from cotenant import _core

MiB = 1 << 20


class InRegion:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        _core.region_enter(self.name)

    def __exit__(self, *exc):
        _core.region_exit(self.name)


def device(**kwargs):
    return _core.SimulatedBackend(device_capacity="1GiB", **kwargs)


def test_pause_with_keep_moves_the_region_to_the_host_and_leaves_other_memory_alone():
    backend = device()
    main = _core.CachingAllocator(backend)
    table = _core.RegionTable(backend)
    other = main.allocate(3 * MiB)
    backend.write(other, b"\x11" * (3 * MiB))
    with InRegion("kv_cache"):
        kv = table.allocate(6 * MiB)
    backend.write(kv, b"\x22" * (6 * MiB))
    device_before = backend.device_bytes_in_use()

    assert table.pause("kv_cache", keep=True) == 6 * MiB
    assert table.state("kv_cache") == "paused (kept)"
    assert backend.device_bytes_in_use() == device_before - 6 * MiB
    assert backend.residency_at(kv) == "host"
    assert backend.residency_at(other) == "device"
    assert backend.read(other, 3 * MiB) == b"\x11" * (3 * MiB)

    table.resume("kv_cache")
    assert backend.residency_at(kv) == "device"
    assert backend.read(kv, 6 * MiB) == b"\x22" * (6 * MiB)
    table.allocator("kv_cache").check_invariants()


def test_pause_without_keep_releases_pages_and_resume_backs_the_same_address_with_zeros():
    backend = device(fresh_pages_hold_garbage=True)
    table = _core.RegionTable(backend)
    with InRegion("weights"):
        w = table.allocate(4 * MiB)
    backend.write(w, b"\x33" * (4 * MiB))
    table.pause("weights", keep=False)
    assert backend.device_bytes_in_use() == 0
    assert backend.host_bytes_in_use() == 0
    with pytest.raises(_core.Error, match="not mapped"):
        backend.read(w, 1)
    reserves = backend.calls()["reserve"]
    table.resume("weights")
    assert backend.calls()["reserve"] == reserves
    assert table.allocator("weights").allocation_size(w) == 4 * MiB
    assert backend.read(w, 4 * MiB) == bytes(4 * MiB)


def test_allocating_in_a_paused_region_raises_and_freeing_in_it_works():
    backend = device()
    table = _core.RegionTable(backend)
    with InRegion("kv_cache"):
        kv = table.allocate(MiB)
    table.pause("kv_cache", keep=True)
    with InRegion("kv_cache"), pytest.raises(_core.Error, match=r'paused \(kept\).*resume_region\("kv_cache"\)'):
        table.allocate(MiB)
    table.allocator("kv_cache").free(kv)
    table.resume("kv_cache")
    assert table.allocator("kv_cache").stats()["allocated_bytes.all.current"] == 0


def test_region_errors_name_the_region_and_the_fix():
    backend = device()
    table = _core.RegionTable(backend)
    with InRegion("kv_cache"):
        table.allocate(MiB)
    with pytest.raises(_core.Error, match=r"region 'kv'.*regions: 'kv_cache'"):
        table.pause("kv", keep=True)
    with pytest.raises(_core.Error, match="not paused"):
        table.resume("kv_cache")
    table.set_graph_capture(True)
    with pytest.raises(_core.Error, match="CUDA graph is being captured.*after the capture"):
        table.pause("kv_cache", keep=False)
    table.set_graph_capture(False)
    assert table.state("kv_cache") == "active"


def test_regions_do_not_nest_and_tag_only_their_thread():
    with InRegion("a"):
        with pytest.raises(_core.Error, match="inside region 'a'.*Leave 'a' first"):
            _core.region_enter("b")
        with InRegion("a"):
            assert _core.current_region() == "a"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_core.current_region()))
        thread.start()
        thread.join()
        assert seen == [""]
    assert _core.current_region() == ""
    with pytest.raises(_core.Error, match="in no region"):
        _core.region_exit("a")
