"""cotenant: share one NVIDIA GPU between PyTorch jobs without hurting the one that matters."""

# Compiled modules (_core, _C) may live in a build tree next to these sources
# (PYTHONPATH=python:build/python during development); extend_path merges them.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
