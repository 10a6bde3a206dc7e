"""benchmarks/gpu_test_summary.py: a GPU test run's JUnit XML becomes a result file."""

import json
import os

import pytest

from script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="work.main.tests.python.test_allocator_gpu" name="test_ok" time="1.0"/>
<testcase classname="work.main.tests.python.test_allocator_gpu" name="test_pool" time="2.0">
<failure message="AssertionError: stdout:">E       AssertionError: stdout:
E         terminate called after throwing an instance of 'c10::Error'
E           what():  the pool was released
E       assert -6 == 0</failure></testcase>
<testcase classname="work.main.tests.python.test_gate_gpu" name="test_two" time="0.0">
<skipped type="pytest.skip" message="needs two GPUs"/></testcase>
</testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def summary_module():
    return load_script(os.path.join(REPO, "benchmarks", "gpu_test_summary.py"))


def test_a_junit_report_becomes_outcomes_with_the_reason_for_each_failure(summary_module, tmp_path):
    xml = tmp_path / "gpu_tests.xml"
    xml.write_text(JUNIT)
    out = tmp_path / "results"
    assert summary_module.main([str(xml), "--out", str(out), "--commit", "abc", "--device", "NVIDIA H100",
                                "--torch", "2.11.0+cu130", "--driver", "580.1", "--cuda", "13.0"]) == 0
    (written,) = out.iterdir()
    assert written.name.startswith("gpu_tests-nvidia-h100-")
    result = json.loads(written.read_text())
    assert result["figures"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert result["device"] == "NVIDIA H100" and result["driver"] == "580.1" and result["commit"] == "abc"
    failed = result["tests"]["test_allocator_gpu::test_pool"]
    assert failed["outcome"] == "failed"
    assert failed["detail"] == "what():  the pool was released; the process ended by signal 6"
    assert result["tests"]["test_gate_gpu::test_two"] == {"outcome": "skipped", "detail": "needs two GPUs"}


def test_an_empty_report_is_an_error(summary_module, tmp_path):
    xml = tmp_path / "empty.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    with pytest.raises(SystemExit):
        summary_module.main([str(xml), "--out", str(tmp_path), "--device", "d", "--torch", "t", "--driver", "v",
                             "--cuda", "c"])
