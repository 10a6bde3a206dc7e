"""What every GPU benchmark result file holds besides its figures, and where it goes.

Each result file is JSON with `device`, `torch`, `driver`, `cuda`, `benchmark`
and `figures`, named `<benchmark>-<device>-<UTC time>` under benchmarks/results/.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from typing import Any, Dict, Optional


def gpu_environment() -> Dict[str, str]:
    """The device, torch, CUDA and driver versions of this run."""
    import torch

    driver = "unknown"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "driver": driver,
            "cuda": torch.version.cuda}


def cpu_model() -> str:
    """The CPU's model name, for results measured on the CPU (the simulated device)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> Optional[str]:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


def result_base(out_dir: str, name: str, device: str) -> str:
    """<out_dir>/<name>-<device slug>-<UTC time>, without an extension; creates out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in device).strip("-").lower()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return os.path.join(out_dir, f"{name}-{slug}-{stamp}")


def write_json(result: Dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=str)
