"""cotenant: share one NVIDIA GPU between PyTorch jobs without hurting the one that matters."""

# Compiled modules (_core, _C) may live in a build tree next to these sources
# (PYTHONPATH=python:build/python during development); extend_path merges them.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"

# The allocator's API. Importing it does not import torch: enable() does.
from cotenant.api import (  # noqa: E402
    NoGpuError,
    Region,
    disable,
    enable,
    enable_from_environment,
    host_headroom,
    is_enabled,
    memory_cap,
    memory_stats,
    pause_region,
    region,
    regions,
    reserve_host_memory,
    restore_all,
    resume_region,
    safe_point,
    set_host_headroom,
    set_memory_cap,
    spill_all,
)

# The launch gate: `cotenant.gate()` admits hand-launched work (the module is
# callable), `cotenant.iteration()` marks iterations. No torch at import either.
from cotenant import gate  # noqa: E402
from cotenant.gate import iteration  # noqa: E402
