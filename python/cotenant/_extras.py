"""Optional dependencies: imported where a feature needs them, never at package import.

Each is an extra of the package (setup.py's EXTRAS): `pip install 'cotenant[metrics]'`
for the coordinator's Prometheus endpoint, `'cotenant[timeline]'` for `cotenant
timeline`, `'cotenant[cluster]'` (ray, scipy) for `cotenant cluster` and AlloX's
matching, `'cotenant[all]'` for all of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """A feature's optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports `module`, or raises MissingExtraError naming `extra`, the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name is not None and error.name != module and not module.startswith(error.name + "."):
            raise  # the module is installed but itself fails to import: that error says more
        raise MissingExtraError(
            f"{feature} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'cotenant[{extra}]'"
        ) from None
