"""torch over the fake CUDA runtime of tests/fake_cuda, on a machine without a GPU.

The core's CMake build writes the fake as `<build>/fake_cudart/libcudart.so.N`
(with libcuda.so.1, a link to it, beside it; see pytorch_replay.cmake). A
Python process started with `environment(library)` preloads it, so every
library of the torch wheel that links libcudart.so.N gets the fake, and
torch's lazy driver stubs find it as libcuda.so.1. torch then sees one CUDA
device, the fake's: allocations, frees, copies, streams, events and the
driver's virtual memory calls run on the CPU under the fake's rules; a kernel
launch (or any call the fake does not model) fails and counts a violation.

Both sides of that are here: the parent finds the library and builds the
environment; the child (`open_preloaded`, before it imports torch) gets the
fake's control API through ctypes, sets the device's capacity, and reads the
calls and violations the fake counted.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FAKE_DEVICE_NAME = "fake CUDA device (cotenant tests)"  # tests/fake_cuda's cudaGetDeviceProperties


def fake_cudart_beside(pytorch_replay: str) -> str:
    """The fake_cudart directory the core's CMake build writes next to `pytorch_replay`."""
    return os.path.join(os.path.dirname(os.path.abspath(pytorch_replay)), "fake_cudart")


def default_pytorch_replay() -> str:
    """Where the core build puts pytorch_replay: $COTENANT_PYTORCH_REPLAY, or
    build/core/pytorch_replay (scripts/test.sh's core build)."""
    return os.environ.get("COTENANT_PYTORCH_REPLAY") or os.path.join(ROOT, "build", "core", "pytorch_replay")


def default_fake_cudart() -> str:
    """The fake_cudart directory next to the default pytorch_replay."""
    return fake_cudart_beside(default_pytorch_replay())


def fake_library(fake_dir: Optional[str] = None) -> str:
    """The fake libcudart.so.N in `fake_dir`; ValueError naming the fix when there is none."""
    fake_dir = fake_dir or default_fake_cudart()
    found = sorted(glob.glob(os.path.join(fake_dir, "libcudart.so.[0-9]*")))
    if not found:
        raise ValueError(f"no fake libcudart.so.N in {fake_dir}: build the core with CMake next to a torch wheel "
                         "with CUDA (scripts/test.sh does, into build/core), or give its directory with --fake-cudart")
    return found[0]


def environment(library: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """`base` (the current environment by default) with the fake preloaded and
    its directory first on the library path."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(filter(None, [library, env.get("LD_PRELOAD")]))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.dirname(library), env.get("LD_LIBRARY_PATH")]))
    return env


# ---- the child's side --------------------------------------------------------------------------


class NotPreloaded(RuntimeError):
    """The fake is not loaded in this process, so torch would not see it."""


class Fake:
    """The preloaded fake's control API (benchmarks/pytorch_allocator/fake_cudart_control.cpp)."""

    def __init__(self, library: str):
        try:  # never loaded here: loading it by path would not make torch's libraries use it
            self.lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD)
        except OSError:
            raise NotPreloaded(f"{library} is not preloaded, so torch would not see the fake CUDA device: start "
                               "this process with over_fake.environment(), which sets LD_PRELOAD") from None
        self.lib.fake_cuda_reset.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64]
        self.lib.fake_cuda_set_delay_us.argtypes = [ctypes.c_uint64]
        self.lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
        self.lib.fake_cuda_calls.restype = ctypes.c_uint64
        self.lib.fake_cuda_device_bytes_created.restype = ctypes.c_uint64
        self.lib.fake_cuda_violation_count.restype = ctypes.c_uint64
        self.lib.fake_cuda_violation.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_uint64]
        self.lib.fake_cuda_violation.restype = ctypes.c_int64
        self.lib.fake_cuda_call_table.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        self.lib.fake_cuda_call_table.restype = ctypes.c_uint64

    def reset(self, device_capacity: int, garbage_in_new_pages: bool = False, host_vmm: bool = True,
              host_capacity: Optional[int] = None) -> None:
        """A device of `device_capacity` bytes, nothing counted yet. Before
        torch touches CUDA. `garbage_in_new_pages`: new pages hold 0xA5
        bytes (the driver does not promise zeros), not zeros. `host_vmm`
        False: the device cannot map host pages, as on GPUs where cotenant
        runs in pinned fallback mode. `host_capacity`: the bytes of host
        pages and pinned memory the host pins at most (None: no limit)."""
        flags = (1 if garbage_in_new_pages else 0) | (0 if host_vmm else 2)
        self.lib.fake_cuda_reset(device_capacity, flags, 2**64 - 1 if host_capacity is None else host_capacity)

    def set_delay(self, microseconds: int) -> None:
        """Each queued copy waits this long on its stream before it runs, so
        that a missing synchronization leaves work in flight."""
        self.lib.fake_cuda_set_delay_us(microseconds)

    def hold_streams(self) -> None:
        """Queued work waits until some caller waits for work (a synchronize,
        an event wait), which releases it: work queued now is still pending
        for sure when the next call is made."""
        self.lib.fake_cuda_hold_streams()

    def calls(self, entry: str) -> int:
        return int(self.lib.fake_cuda_calls(entry.encode()))

    def all_calls(self) -> Dict[str, int]:
        """Every entry called since the reset: name -> count."""
        size = self.lib.fake_cuda_call_table(None, 0)
        while True:  # another thread may call a new entry in between: the table grows
            buffer = ctypes.create_string_buffer(size)
            size = self.lib.fake_cuda_call_table(buffer, len(buffer))
            if size <= len(buffer):
                break
        lines = buffer.value.decode().splitlines()
        return {name: int(count) for name, count in (line.rsplit(" ", 1) for line in lines)}

    def device_bytes_created(self) -> int:
        return int(self.lib.fake_cuda_device_bytes_created())

    def violations(self) -> List[str]:
        messages = []
        buffer = ctypes.create_string_buffer(4096)
        for index in range(self.lib.fake_cuda_violation_count()):
            self.lib.fake_cuda_violation(index, buffer, len(buffer))
            messages.append(buffer.value.decode("utf-8", "replace"))
        return messages


def open_preloaded(library: str, device_capacity: int, garbage_in_new_pages: bool = False,
                   host_vmm: bool = True, host_capacity: Optional[int] = None) -> Fake:
    """The fake this process preloaded, reset (see Fake.reset). Call it
    before importing torch. NotPreloaded when it is not loaded."""
    fake = Fake(library)
    fake.reset(device_capacity, garbage_in_new_pages, host_vmm, host_capacity)
    return fake


def check_torch_sees_the_fake(torch) -> None:
    """RuntimeError unless torch's one CUDA device is the fake's, so that
    nothing here ever runs on a real GPU."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if name != FAKE_DEVICE_NAME:
        raise RuntimeError(f"torch sees {name!r}, not the fake CUDA device: the fake libcudart was not loaded "
                           f"(LD_PRELOAD={os.environ.get('LD_PRELOAD')!r})")
