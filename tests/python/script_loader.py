"""Loads a script that is not a module of a package (benchmarks/*.py,
conftest.py) as a module, so that its tests can call its functions."""

import importlib.util
import os
import sys


def load_script(path, name=None):
    """The module made by running the script at `path`; named after its file
    unless `name` is given."""
    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import does: dataclasses look their module up there.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
