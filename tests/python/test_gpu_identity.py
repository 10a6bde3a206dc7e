"""GPUs are known by their UUID: jobs that number one GPU differently (CUDA_VISIBLE_DEVICES) share it."""

import pytest

from cotenant import _core
from cotenant.coordinator import client, gpus
from coordinator_harness import MiB, Node, wait_until

UUID = "GPU-5f1c0d3e-8b7a-4c21-9d0e-0123456789ab"


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def test_jobs_with_different_cuda_indices_on_one_gpu_are_planned_as_one_gpu(node):
    node.start_coordinator()
    node.start_job("guaranteed", "g", hold_mib=512, env={"SIMULATED_GPU_UUID": UUID, "COTENANT_DEVICE": "0"})
    node.start_job("opportunistic", "o", hold_mib=512, env={"SIMULATED_GPU_UUID": UUID, "COTENANT_DEVICE": "1"})
    assert wait_until(lambda: node.job("g")["device_bytes"] == 512 * MiB)
    view = node.status()
    assert [g["gpu"] for g in view["gpus"]] == [UUID]
    (gpu,) = view["gpus"]
    assert gpu["uuid"] == UUID and gpu["jobs"] == 2 and gpu["note"] is None
    g, o = node.job("g"), node.job("o")
    assert (g["gpu"], o["gpu"]) == (0, 1)  # each job's own CUDA index
    assert g["gpu_uuid"] == o["gpu_uuid"] == UUID
    # One GPU of 1 GiB: the opportunistic job's cap leaves the guaranteed job's memory and the headroom.
    assert wait_until(lambda: node.job("o")["cap"] is not None
                      and node.job("o")["cap"] + 512 * MiB <= 1024 * MiB - 128 * MiB), node.status()


def test_the_gpu_uuid_is_written_into_the_job_block_and_kept_across_a_coordinator_restart(node):
    node.start_coordinator()
    job = node.start_job("opportunistic", "o", hold_mib=32, env={"SIMULATED_GPU_UUID": UUID})
    assert _core.JobBlock.open(job.registration["block_name"]).identity()["gpu_uuid"] == UUID
    node.kill_coordinator()
    node.start_coordinator()
    assert wait_until(lambda: (node.job("o") or {}).get("gpu_uuid") == UUID), node.status()


def test_a_job_that_reports_no_uuid_gets_a_synthetic_key_that_says_so(node):
    node.start_coordinator()
    node.start_job("opportunistic", "o", hold_mib=32)
    (gpu,) = node.status()["gpus"]
    assert gpu["gpu"] == "index:0" and gpu["uuid"] is None
    assert "no GPU UUID" in gpu["note"] and "CUDA_VISIBLE_DEVICES" in gpu["note"]


def test_a_malformed_uuid_is_refused_at_registration(node):
    node.start_coordinator()
    with pytest.raises(client.CoordinatorError, match="gpu_uuid"):
        client.register("opportunistic", 0, socket=node.socket, gpu_uuid="not-a-uuid")


def test_gpu_keys():
    assert gpus.gpu_key(UUID, 3) == UUID
    assert gpus.gpu_key(None, 3) == "index:3" and gpus.is_synthetic("index:3")
    assert gpus.gpu_key_note(UUID) is None


def test_node_gpus_come_from_nvml_when_pynvml_is_there(monkeypatch):
    import sys
    import types

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: f"GPU-{h}{h}".encode(),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=(h + 1) << 30))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    found, source = gpus.detect()
    assert source == "nvml"
    assert [(g.index, g.uuid, g.total_bytes) for g in found] == [(0, "GPU-00", 1 << 30), (1, "GPU-11", 2 << 30)]


def test_without_pynvml_or_nvidia_smi_detection_says_why(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(gpus, "_from_nvidia_smi", lambda: [])
    found, source = gpus.detect()
    assert found == [] and "nvidia-ml-py (pynvml) is not installed" in source
