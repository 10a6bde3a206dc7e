"""fresh_process.run_json, the runner the GPU tests start their jobs with
(they skip on a machine without a GPU; the runner itself needs none)."""

import pytest

from fresh_process import run_json

JOB = """
import json, os
print("some output first")
print(json.dumps({"cap": os.environ.get("COTENANT_MEMORY_CAP"), "leaked": os.environ.get("COTENANT_ROLE"),
                  "other": os.environ.get("FRESH_PROCESS_OTHER"), "file": os.path.basename(__file__)}))
"""


def test_a_job_sees_its_own_settings_and_none_of_the_callers(monkeypatch, tmp_path):
    monkeypatch.setenv("COTENANT_ROLE", "guaranteed")  # the caller's: must not reach the job
    monkeypatch.setenv("FRESH_PROCESS_OTHER", "kept")
    out = run_json(JOB, env_extra={"COTENANT_MEMORY_CAP": "1GiB"}, directory=str(tmp_path), name="mine.py")
    assert out == {"cap": "1GiB", "leaked": None, "other": "kept", "file": "mine.py"}
    assert (tmp_path / "mine.py").read_text().endswith(JOB)  # the script stays where the caller asked


def test_a_failing_job_fails_the_test_with_its_output():
    with pytest.raises(AssertionError, match=r"(?s)stdout:\nbefore\n.*stderr:.*ZeroDivisionError"):
        run_json("print('before')\n1 / 0\n")
