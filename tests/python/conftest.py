"""Shared pytest configuration: tests marked ``gpu`` skip, with the reason
shown, on machines without an NVIDIA GPU. The markers themselves are declared
in pyproject.toml."""

import functools

import pytest

GPU_SKIP_REASON = "needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine"


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    # Imported lazily: collecting tests that need no GPU must not pay for torch.
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not gpu_available():
        pytest.skip(GPU_SKIP_REASON)
