#!/usr/bin/env python3
"""The outcome of a GPU test run as a result file: every test marked `gpu` with
passed / failed / skipped (and the failure's last line), beside the device,
torch, CUDA and driver versions and the commit that was tested.

    python benchmarks/gpu_test_summary.py JUNIT_XML [--out DIR] [--commit SHA]
        [--device NAME --torch VERSION --driver VERSION --cuda VERSION]

scripts/gpu_check.sh runs it after the tests; the version flags replace the
ones read from the machine (for a report made from a run's saved files).
Writes <out>/gpu_tests-<device>-<UTC time>.json and prints the counts.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import result_base, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def outcomes(junit_xml: str) -> Dict[str, Dict[str, str]]:
    """test id -> {"outcome": passed|failed|skipped, "detail": the first line of why}."""
    tests: Dict[str, Dict[str, str]] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}"
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                detail = _why(child.get("message") or "", child.text or "")
            elif child.tag == "skipped":
                outcome, detail = "skipped", (child.get("message") or "")[:300]
        tests[name] = {"outcome": outcome, "detail": detail}
    return tests


def _why(message: str, text: str) -> str:
    """The most telling line of a failure: the last error a child process
    printed (pytest's "E" lines), else the assertion message's first line."""
    errors = [line.lstrip("E").strip() for line in text.splitlines()
              if re.match(r"E\s+(\w*Error|what\(\)|Segmentation|Fatal)", line)
              and "AssertionError: stdout" not in line]
    signal = re.search(r"assert (-\d+) == 0", text)
    ended = [f"the process ended by signal {-int(signal.group(1))}"] if signal else []
    if errors or ended:
        return "; ".join(errors[-1:] + ended)[:300]
    lines = [line for line in message.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def summary(tests: Dict[str, Dict[str, str]]) -> Dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for test in tests.values():
        counts[test["outcome"]] += 1
    return counts


def _machine_environment() -> Dict[str, str]:
    from result_file import gpu_environment

    return gpu_environment()


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit_xml")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--commit", help="the commit tested (default: this checkout's HEAD)")
    for field in ("device", "torch", "driver", "cuda"):
        parser.add_argument(f"--{field}")
    args = parser.parse_args(argv)
    given = {f: getattr(args, f) for f in ("device", "torch", "driver", "cuda") if getattr(args, f)}
    environment = given if len(given) == 4 else {**_machine_environment(), **given}
    tests = outcomes(args.junit_xml)
    if not tests:
        parser.error(f"{args.junit_xml} holds no test case")
    result: Dict[str, Any] = {**environment, "benchmark": "gpu_tests", "commit": args.commit or _git_commit(),
                              "figures": summary(tests), "tests": tests}
    path = result_base(args.out, "gpu_tests", result["device"]) + ".json"
    write_json(result, path)
    print(" ".join(f"{k} {v}" for k, v in result["figures"].items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
