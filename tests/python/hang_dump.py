"""A line that makes a test's child script explain a hang: faulthandler
prints every thread's stack and ends the process before the test's own
subprocess timeout would kill it silently. GPU_TEST_HANG_SECONDS shortens it
(a quick diagnosis on a device lent for minutes)."""

import os


def hang_dump(timeout: float) -> str:
    seconds = float(os.environ.get("GPU_TEST_HANG_SECONDS", 0)) or max(timeout - 30, timeout * 0.8)
    return f"import faulthandler\nfaulthandler.dump_traceback_later({seconds:.0f}, exit=True)\n"
