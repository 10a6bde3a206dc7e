"""Enables cotenant in the process `cotenant run` started, with no code change.

`cotenant run` puts this directory first on PYTHONPATH, describes the job in
COTENANT_* environment variables and marks the job's pid (COTENANT_JOB_PID);
Python imports this file at start-up. Only that process is the job: in its
children this file does nothing. When cotenant cannot be enabled, the job
exits with status 2 and says why (cotenant.launch), unless allowed to run
uncapped. It first runs any other sitecustomize the environment had, so a
site's own start-up code keeps working.
"""

import importlib.util
import logging
import os
import sys


def _enable_cotenant() -> None:
    if os.environ.get("COTENANT_JOB_PID") != str(os.getpid()):
        return  # a child of the job (a worker, a compiler process): not a job
    try:
        from cotenant import launch
    except Exception as error:  # cotenant itself does not import: nothing else can say so
        allowed = os.environ.get("COTENANT_ALLOW_UNCAPPED", "").strip().lower() in ("1", "true", "yes", "on")
        logging.getLogger("cotenant").log(logging.WARNING if allowed else logging.ERROR,
                                          "cotenant run: cannot import cotenant in this program: %s", error)
        if not allowed:
            sys.stderr.flush()
            os._exit(2)
        return
    launch.enable_in_job()


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
