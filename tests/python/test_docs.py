"""The documentation's CPU examples run as written.

Convention: a fenced block whose info string is `python runnable`,
`bash runnable` or `console runnable` (README.md, docs/*.md) is run here,
from the repository root, on a machine without a GPU:

- python: the block is a script; it must exit 0.
- bash: the block runs under `bash -euo pipefail`; it must exit 0.
- console: each `$ COMMAND` line runs in bash; what follows it, up to the
  next `$` line, is its output (stdout and stderr), compared line by line
  with trailing spaces ignored. Lines whose first word is in TIMING_ROWS
  are times of this machine and are compared by their first word only.

Blocks without `runnable` are left alone (they need a GPU, a coordinator
that keeps running, or stand for the user's own program).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```(python|bash|console) runnable\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
TIMING_ROWS = ("ns/alloc", "ns/free")


def runnable_blocks():
    for path in DOCUMENTS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            yield pytest.param(match.group(1), match.group(2), id=f"{path.relative_to(ROOT)}:{line}")


def environment():
    import cotenant

    env = {k: v for k, v in os.environ.items() if not k.startswith(("COTENANT_", "PYTORCH_"))}
    roots = [os.path.dirname(p) for p in cotenant.__path__]
    env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # `cotenant` and `python` as the reader has them: this interpreter and its scripts.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def run(command, **kwargs):
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300,
                          **kwargs)


def console_steps(body):
    steps, command, output = [], None, []
    for line in body.splitlines():
        if line.startswith("$ "):
            if command is not None:
                steps.append((command, output))
            command, output = line[2:], []
        elif command is not None:
            output.append(line)
    if command is not None:
        steps.append((command, output))
    return steps


def comparable(lines):
    out = []
    for line in lines:
        line = line.rstrip()
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        out.append(word if word in TIMING_ROWS else line)
    while out and out[-1] == "":
        out.pop()
    return out


def test_the_documents_have_runnable_examples():
    assert len(list(runnable_blocks())) >= 4


@pytest.mark.parametrize("language, body", list(runnable_blocks()))
def test_documented_example_runs_as_written(language, body):
    if language == "python":
        out = run([sys.executable, "-c", body])
        assert out.returncode == 0, out.stderr
    elif language == "bash":
        out = run(["bash", "-euo", "pipefail", "-c", body])
        assert out.returncode == 0, out.stderr
    else:
        steps = console_steps(body)
        assert steps, "a console block needs `$ command` lines"
        for command, expected in steps:
            out = run(["bash", "-c", command])
            assert comparable((out.stdout + out.stderr).splitlines()) == comparable(expected), command
