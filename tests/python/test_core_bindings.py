"""cotenant._core: sizes, errors, the simulated device and the allocator from Python."""

import os
import threading

import pytest

from cotenant import _core

MiB = 1 << 20
GiB = 1 << 30


# ---- sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", 6 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("2 MiB", 2 * MiB),
        ("6g", 6 * GiB),
    ],
)
def test_parse_size_reads_binary_and_decimal_units(text, expected):
    assert _core.parse_size(text) == expected


@pytest.mark.parametrize(
    "text, problem",
    [
        ("6 GB?", 'unexpected "?"'),
        ("-1", "negative"),
        ("", "empty"),
        ("abc", "does not start with a number"),
        ("12 parsecs", "not a unit"),
    ],
)
def test_parse_size_refuses_malformed_sizes_with_the_accepted_forms(text, problem):
    with pytest.raises(_core.Error) as caught:
        _core.parse_size(text)
    message = str(caught.value)
    assert problem in message
    assert f'"{text}"' in message
    assert "6GiB" in message  # the message shows how to write a size


def test_core_error_is_a_value_error_and_oom_is_a_memory_error():
    assert issubclass(_core.Error, ValueError)
    assert issubclass(_core.OutOfMemoryError, MemoryError)
    assert issubclass(_core.ReplayError, _core.Error)
    with pytest.raises(ValueError):
        _core.parse_size("-1")


def test_format_size_is_readable():
    assert _core.format_size(6 * GiB) == "6.00 GiB"
    assert _core.format_size(4096).endswith("KiB") or _core.format_size(4096).endswith("B")


# ---- the simulated device -----------------------------------------------------------


def test_simulated_backend_accepts_size_strings_and_refuses_bad_granularity():
    backend = _core.SimulatedBackend(device_capacity="64MiB", granularity="2MiB")
    assert backend.device_total_bytes == 64 * MiB
    assert backend.granularity == 2 * MiB
    with pytest.raises(_core.Error, match="power of two"):
        _core.SimulatedBackend(granularity=3 * MiB)
    with pytest.raises(_core.Error, match="negative"):
        _core.SimulatedBackend(device_capacity=-5)


def test_bytes_written_through_the_backend_read_back_at_the_same_address():
    backend = _core.SimulatedBackend(device_capacity="64MiB")
    allocator = _core.CachingAllocator(backend)
    address = allocator.allocate("3MiB")
    payload = bytes(range(256)) * 16
    backend.write(address + MiB, payload)
    assert backend.read(address + MiB, len(payload)) == payload
    assert backend.residency_at(address) == "device"
    assert backend.calls()["map"] >= 2


# ---- the allocator ----------------------------------------------------------------


def test_shrinking_cap_below_live_bytes_spills_at_the_safe_point_and_keeps_bytes():
    backend = _core.SimulatedBackend(device_capacity="64MiB")
    allocator = _core.CachingAllocator(backend)
    addresses = [allocator.allocate(2 * MiB) for _ in range(4)]
    for i, address in enumerate(addresses):
        backend.write(address, bytes([i + 1]) * 64)

    allocator.set_memory_cap("4MiB")
    assert allocator.memory_cap() == 4 * MiB
    assert allocator.has_pending_migrations()
    moved = allocator.apply_pending_migrations()

    assert moved >= 4 * MiB
    stats = allocator.stats()
    assert stats["device_resident_bytes.current"] <= 4 * MiB
    assert stats["spilled_bytes"] >= 4 * MiB
    assert sum(backend.residency_at(a) == "host" for a in addresses) >= 2
    for i, address in enumerate(addresses):
        assert backend.read(address, 64) == bytes([i + 1]) * 64


def test_raising_the_cap_restores_spilled_pages():
    backend = _core.SimulatedBackend(device_capacity="64MiB")
    allocator = _core.CachingAllocator(backend)
    address = allocator.allocate(8 * MiB)
    allocator.spill_all()
    allocator.apply_pending_migrations()
    assert backend.residency_at(address) == "host"
    allocator.restore_all()
    allocator.apply_pending_migrations()
    assert backend.residency_at(address) == "device"
    assert allocator.stats()["restored_bytes"] >= 8 * MiB


def test_memory_cap_none_means_no_cap_and_zero_is_refused():
    allocator = _core.CachingAllocator(_core.SimulatedBackend())
    assert allocator.memory_cap() is None
    allocator.set_memory_cap("6GiB")
    assert allocator.memory_cap() == 6 * GiB
    allocator.set_memory_cap(None)
    assert allocator.memory_cap() is None
    with pytest.raises(_core.Error, match="0 bytes"):
        allocator.set_memory_cap(0)
    with pytest.raises(_core.Error):
        allocator.set_memory_cap("6 GB?")


def test_free_of_an_unknown_address_raises_and_keeps_live_allocations():
    allocator = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="64MiB"))
    address = allocator.allocate(MiB)
    with pytest.raises(_core.Error):
        allocator.free(address + 12345)
    assert allocator.allocation_size(address) == MiB
    allocator.free(address)
    with pytest.raises(_core.Error):
        allocator.free(address)  # a double free


def test_allocation_beyond_device_and_host_raises_out_of_memory_error():
    backend = _core.SimulatedBackend(device_capacity="8MiB", host_capacity=0)
    allocator = _core.CachingAllocator(backend)
    with pytest.raises(MemoryError) as caught:
        allocator.allocate("64MiB")
    assert isinstance(caught.value, _core.OutOfMemoryError)
    assert allocator.stats()["num_ooms"] == 1


def test_a_full_device_without_a_cap_is_out_of_memory_unless_spilling_is_asked_for():
    # As PyTorch's allocator: no cap, no room on the device -> OutOfMemoryError.
    allocator = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="8MiB"))
    with pytest.raises(_core.OutOfMemoryError, match="^CUDA out of memory. Tried to allocate 16.00 MiB"):
        allocator.allocate("16MiB")
    assert allocator.stats()["host_resident_bytes.current"] == 0
    spilling = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="8MiB"), spill_without_cap=True)
    spilling.allocate("16MiB")
    assert spilling.stats()["host_resident_bytes.current"] == 8 * MiB


def test_stats_use_torch_key_names_and_snapshot_lists_blocks():
    allocator = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="64MiB"))
    address = allocator.allocate(1000)
    stats = allocator.stats()
    assert stats["allocated_bytes.all.current"] == 1024  # rounded to 512 bytes
    assert stats["requested_bytes.all.current"] == 1000
    assert stats["allocation.small_pool.current"] == 1
    assert stats["reserved_bytes.all.current"] >= 2 * MiB
    segments = allocator.snapshot()
    blocks = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [b["address"] for b in blocks] == [address]
    assert allocator.mode() == "remap"


def test_mark_iteration_ends_a_step_and_a_repeated_step_follows_the_step_before():
    allocator = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="256MiB"))
    first = allocator.allocate(MiB)  # lives across the steps
    allocator.allocate(MiB)
    allocator.mark_iteration()
    for _ in range(2):  # two steps alike: the second is the plan for the third
        # A plan forms once a repeated step has to map a page: emptying the
        # cache makes each step map its page again.
        allocator.empty_cache()
        planned = allocator.allocate(MiB)
        allocator.free(planned)
        allocator.mark_iteration()
    allocator.free(first)
    # Best fit alone would take the lower hole `first` left; the plan puts
    # the step's first request where it went in the step before.
    assert planned != first
    assert allocator.allocate(MiB) == planned
    allocator.check_invariants()


def test_a_repeated_step_that_maps_nothing_forms_no_plan():
    # The same loop, its page left mapped: best fit repeats the layout by
    # itself, so no plan forms, and the third step's request takes the lower
    # hole `first` left, as best fit does.
    allocator = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="256MiB"))
    first = allocator.allocate(MiB)
    allocator.allocate(MiB)
    allocator.mark_iteration()
    for _ in range(2):
        planned = allocator.allocate(MiB)
        allocator.free(planned)
        allocator.mark_iteration()
    allocator.free(first)
    assert allocator.allocate(MiB) == first
    allocator.check_invariants()


def test_allocator_keeps_its_backend_alive():
    allocator = _core.CachingAllocator(_core.SimulatedBackend(device_capacity="64MiB"))
    import gc

    gc.collect()
    address = allocator.allocate(MiB)  # would crash if the backend had been destroyed
    allocator.free(address)
    allocator.empty_cache()
    assert allocator.stats()["reserved_bytes.all.current"] == 0


def test_apply_pending_migrations_releases_the_gil_for_other_threads():
    backend = _core.SimulatedBackend(device_capacity="1GiB")
    allocator = _core.CachingAllocator(backend)
    for _ in range(64):
        allocator.allocate(8 * MiB)
    allocator.set_memory_cap("64MiB")
    results = []
    worker = threading.Thread(target=lambda: results.append(allocator.apply_pending_migrations()))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert results and results[0] > 0


def test_record_stream_holds_a_block_until_that_stream_completes():
    backend = _core.SimulatedBackend(device_capacity="64MiB", events_complete_immediately=False)
    allocator = _core.CachingAllocator(backend)
    address = allocator.allocate(MiB, stream=1)
    allocator.record_stream(address, 2)
    allocator.free(address)
    assert allocator.stats()["active_bytes.all.current"] == MiB  # waiting on stream 2's event
    backend.complete_stream(2)
    again = allocator.allocate(MiB, stream=1)
    assert allocator.stats()["active_bytes.all.current"] == MiB
    allocator.free(again)


def test_memory_cap_and_the_statistics_agree_while_everything_is_spilled():
    backend = _core.SimulatedBackend(device_capacity="64MiB", granularity="2MiB")
    allocator = _core.CachingAllocator(backend)
    held = allocator.allocate(8 * MiB)
    allocator.set_memory_cap("32MiB")
    allocator.spill_all()
    allocator.apply_pending_migrations()
    stats = allocator.stats()
    assert allocator.memory_cap() == 32 * MiB
    assert stats["memory_cap"] == 32 * MiB  # one value for the cap; spill_all is a state beside it
    assert stats["spilled_all"] == 1
    assert stats["device_resident_bytes.current"] == 0
    allocator.set_memory_cap("48MiB")  # a new cap while spilled brings nothing back
    allocator.apply_pending_migrations()
    assert allocator.stats()["device_resident_bytes.current"] == 0
    allocator.restore_all()
    allocator.apply_pending_migrations()
    assert allocator.stats()["device_resident_bytes.current"] >= 8 * MiB
    assert allocator.stats()["spilled_all"] == 0
    allocator.free(held)


def test_a_fraction_cap_resolves_on_the_allocators_device():
    backend = _core.SimulatedBackend(device_capacity="64MiB", granularity="2MiB")
    allocator = _core.CachingAllocator(backend)
    allocator.set_memory_cap(0.25)
    assert allocator.memory_cap() == 16 * MiB
    allocator.set_memory_cap("50%")
    assert allocator.memory_cap() == 32 * MiB
    allocator.set_memory_cap("none")
    assert allocator.memory_cap() is None


@pytest.mark.parametrize("value, expected", [
    (None, "none"), ("none", "none"), (4096, "4096"), ("6GiB", str(6 << 30)), (0.5, "0.5"), ("25%", "0.25"),
])
def test_every_spelling_of_a_cap_goes_through_one_parser(value, expected):
    cap = _core.Cap(value)
    assert cap.text == expected
    assert _core.Cap(cap.text) == cap


def test_suspend_stops_a_guaranteed_jobs_launches_and_resume_lets_them_go(tmp_path):
    name = f"/cotenant-test-suspend-{os.getpid()}"
    block = _core.JobBlock.create(name, job_id=1, job_name="g", role="guaranteed", device=0, pid=os.getpid(),
                                  uid=os.getuid())
    try:
        backend = _core.SimulatedBackend(device_capacity="64MiB", granularity="2MiB")
        allocator = _core.CachingAllocator(backend)
        held = allocator.allocate(8 * MiB)
        channel = _core.JobChannel(name, allocator=allocator)
        block.send_command("suspend")
        channel.poll_once()
        assert channel.launches_paused
        report = block.report()
        assert report["state"] == "suspended" and report["device_bytes"] == 0
        block.send_command("resume")
        channel.poll_once()
        assert not channel.launches_paused
        assert block.report()["device_bytes"] >= 8 * MiB
        channel.close()
        allocator.free(held)
    finally:
        block.unlink()


def test_time_ops_times_the_ops_after_the_warm_up_and_places_as_replay_does():
    mib = 1 << 20
    ops = [("alloc", 1, 3 * mib, 0), ("alloc", 2, 5 * mib, 0), ("free", 1), ("iteration",)]
    ops += [("alloc", 3, 2 * mib, 0), ("free", 3), ("free", 2), ("iteration",)]
    timed = _core.time_ops(ops, 4)
    assert (timed["allocs"], timed["frees"], timed["marks"]) == (1, 2, 1)
    assert timed["ns"] > 0 and timed["cpu_ns"] >= 0
    replayed = _core.replay(ops)
    assert timed["num_page_maps"] == replayed["num_page_maps"]
    assert timed["peak_reserved_bytes"] == replayed["peak_reserved_bytes"]
    with pytest.raises(_core.ReplayError, match="free of id 7, which is not live") as refused:
        _core.time_ops([("alloc", 1, mib, 0), ("free", 7)])
    assert refused.value.op_index == 1
    with pytest.raises(_core.Error, match="warm-up of 9 ops"):
        _core.time_ops(ops, 9)
