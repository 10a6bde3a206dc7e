"""Enables cotenant in a process started by `cotenant run`, with no code change.

`cotenant run` puts this directory first on PYTHONPATH and describes the job
in COTENANT_* environment variables; Python imports this file at start-up.
It first runs any other sitecustomize the environment had, so a site's own
start-up code keeps working.
"""

import importlib.util
import os
import sys


def _enable_cotenant() -> None:
    try:
        import cotenant

        cotenant.enable_from_environment()
    except Exception as error:  # never stop the user's program from starting
        sys.stderr.write(f"cotenant: not enabled in this process: {error}\n")


def _run_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        candidate = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_cotenant_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            return


# The site's own start-up code first: it may set up paths cotenant or torch need.
_run_next_sitecustomize()
_enable_cotenant()
