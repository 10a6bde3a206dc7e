"""What a moving memory cap does to live memory, on the simulated device.

Runs on any machine (no GPU): the same allocator core that serves CUDA
tensors in a real job, over a simulated 1 GiB device whose pages hold real
bytes. It allocates "parameters", writes them, cuts the cap below them, runs
a safe point, and shows that the bytes moved to the host at the same
addresses, then raises the cap and brings them back.

    python examples/simulated_spill.py
"""

import os

from cotenant import _core

MiB = 1 << 20


def show(label, allocator):
    stats = allocator.stats()
    print(f"{label:<34} device {_core.format_size(stats['device_resident_bytes.current']):>10}   "
          f"host {_core.format_size(stats['host_resident_bytes.current']):>10}   "
          f"spilled {_core.format_size(stats['spilled_bytes']):>10}   "
          f"restored {_core.format_size(stats['restored_bytes']):>10}")


def main():
    device = _core.SimulatedBackend(device_capacity=_core.parse_size("1GiB"))
    allocator = _core.CachingAllocator(device)

    # Three 64 MiB "parameter" tensors, allocated in order: the first is the coldest.
    params = [allocator.allocate(64 * MiB, 0) for _ in range(3)]
    contents = [os.urandom(4096) for _ in params]
    for address, data in zip(params, contents):
        device.write(address, data)
    show("three 64 MiB tensors", allocator)

    allocator.set_memory_cap("128MiB")
    show("cap 128 MiB (marked, not moved)", allocator)
    allocator.apply_pending_migrations()  # the safe point: no kernel in flight
    show("after the safe point", allocator)
    print("coldest tensor on the device?", allocator.is_device_resident(params[0]))

    allocator.set_memory_cap("1GiB")
    allocator.apply_pending_migrations()
    show("cap 1 GiB, after the safe point", allocator)

    intact = all(device.read(address, len(data)) == data for address, data in zip(params, contents))
    print("every tensor kept its address and bytes:", intact)
    if not intact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
