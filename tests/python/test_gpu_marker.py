"""The ``gpu`` marker: a GPU test skips with a visible reason on a machine without one."""

import os

import pytest

from script_loader import load_script

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")


def load_conftest():
    return load_script(CONFTEST, "cotenant_tests_conftest")


class FakeItem:
    """The one thing the hook asks of a test item: its markers."""

    def __init__(self, *markers):
        self.markers = set(markers)

    def get_closest_marker(self, name):
        return pytest.mark.gpu.mark if name in self.markers else None


def test_gpu_test_is_skipped_with_the_reason_when_cuda_is_unavailable(monkeypatch):
    conftest = load_conftest()
    monkeypatch.setattr(conftest, "gpu_available", lambda: False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        conftest.pytest_runtest_setup(FakeItem("gpu"))
    assert str(skipped.value) == "needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine"


def test_gpu_test_runs_when_cuda_is_available(monkeypatch):
    conftest = load_conftest()
    monkeypatch.setattr(conftest, "gpu_available", lambda: True)
    conftest.pytest_runtest_setup(FakeItem("gpu"))  # no skip


def test_unmarked_test_runs_without_a_gpu(monkeypatch):
    conftest = load_conftest()
    monkeypatch.setattr(conftest, "gpu_available", lambda: False)
    conftest.pytest_runtest_setup(FakeItem())


def test_gpu_availability_follows_torch(monkeypatch):
    import torch

    conftest = load_conftest()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert conftest.gpu_available() is False
