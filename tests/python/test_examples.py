"""The examples run as the README says they do."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name, timeout=300):
    return subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def test_simulated_spill_moves_tensors_to_host_and_back_keeping_their_bytes():
    result = run_example("simulated_spill.py")
    assert result.returncode == 0, result.stderr
    assert "coldest tensor on the device? False" in result.stdout
    assert "every tensor kept its address and bytes: True" in result.stdout
    after_spill = next(line for line in result.stdout.splitlines() if line.startswith("after the safe point"))
    assert "host  64.00 MiB" in after_spill


def test_capped_training_without_a_gpu_says_it_needs_one():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the example runs for real in the gpu test")
    try:
        from cotenant import _C  # noqa: F401
    except ImportError:
        pytest.skip("cotenant._C is not built here (no CUDA toolkit at build time)")
    result = run_example("capped_training.py")
    assert result.returncode == 2
    assert "this example needs a GPU" in result.stderr


@pytest.mark.gpu
def test_capped_training_runs_through_a_cap_below_its_working_set():
    result = run_example("capped_training.py", timeout=600)
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) >= 6
    spilled = next(line for line in steps if line.startswith("step  21"))
    assert " host 0 MiB" not in spilled  # the cut moved memory to the host
    losses = [float(line.split()[3]) for line in steps]
    assert all(loss == loss for loss in losses)  # no NaN
