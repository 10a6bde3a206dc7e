"""Which physical GPU is which: GPUs are known by their UUID.

A job's CUDA index depends on its CUDA_VISIBLE_DEVICES: two jobs that both
say "cuda:0" may run on different GPUs, and one GPU may be cuda:0 to one job
and cuda:1 to another. So the coordinator keys every per-GPU fact (memory,
jobs, policy) by the UUID the job reports ("GPU-8f6c..."), and learns the
node's GPUs (index as nvidia-smi numbers them, UUID, memory) from NVML,
through nvidia-ml-py (`pynvml`, imported only here and only when asked).

Where no UUID is known (a job that sent none; a machine without NVML) the
key is synthetic, "index:N" (N as the job numbers it), and `gpu_key_note`
says that it cannot tell GPUs apart across different CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import List, Optional, Tuple

SYNTHETIC_PREFIX = "index:"


@dataclass(frozen=True)
class NodeGpu:
    index: int           # as nvidia-smi and NVML number it (not CUDA_VISIBLE_DEVICES-relative)
    uuid: str            # "GPU-..."
    total_bytes: int


def gpu_key(uuid: Optional[str], device: int) -> str:
    """The key of the GPU a job runs on: its UUID, else the synthetic "index:N"."""
    return uuid if uuid else f"{SYNTHETIC_PREFIX}{device}"


def is_synthetic(key: str) -> bool:
    return key.startswith(SYNTHETIC_PREFIX)


def gpu_key_note(key: str) -> Optional[str]:
    """What a synthetic key cannot tell, or None for a UUID."""
    if not is_synthetic(key):
        return None
    return (f"{key}: the job reported no GPU UUID, so its GPU is known by its CUDA index only; jobs with different "
            "CUDA_VISIBLE_DEVICES on one GPU are then not seen as sharing it")


def detect() -> Tuple[List[NodeGpu], str]:
    """The node's GPUs and where that came from ("nvml", "nvidia-smi", or why neither answered)."""
    gpus, problem = _from_nvml()
    if gpus:
        return gpus, "nvml"
    smi = _from_nvidia_smi()
    if smi:
        return smi, "nvidia-smi"
    return [], problem


def _from_nvml() -> Tuple[List[NodeGpu], str]:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return [], "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as error:  # pynvml.NVMLError, e.g. no driver
        return [], f"NVML did not start: {error}"
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            gpus.append(NodeGpu(index, uuid, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return gpus, "nvml"
    except Exception as error:
        return [], f"NVML could not list the GPUs: {error}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _from_nvidia_smi() -> List[NodeGpu]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        try:
            index, uuid, mib = (part.strip() for part in line.split(","))
            gpus.append(NodeGpu(int(index), uuid, int(mib) << 20))
        except ValueError:
            continue
    return gpus
